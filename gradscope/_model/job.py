"""A job's data: one entry per rank (its recording, or why there is none), its files, and reading
them back.

A :class:`Job` comes from :func:`gradscope.gather` on the destination rank, from :func:`load_ranks`
(a directory written by :meth:`Job.save`, or per-rank files saved independently), or from
:func:`gradscope.predict_job`. This module is the jobs' data: it imports nothing from
``torch.distributed`` (a saved job opens on a laptop), no analysis and no view. What a job view
shows and the job's diagnosis are functions of the job (:func:`gradscope._analyses.jobs.job_view`,
``gs.diagnose(job)``); its text, page and notebook display are views, which :meth:`Job.summary`,
:meth:`Job.to_html` and the notebook display ask the view registry for (NOTE [ one registry of
views ] in ``gradscope._base.registry``).

Example:
    >>> from gradscope.recording import Recording
    >>> job = Job((RankEntry(0, RankStatus.COMPLETE, Recording()), RankEntry(1, RankStatus.MISSING)))
    >>> job
    Job(unnamed: 2 ranks, 1 complete, 1 missing)
    >>> job.recordings[1] is None
    True
"""

from __future__ import annotations

import enum
import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._model.recording import Recording, atomic_write_text, load

__all__ = ["JOB_SCHEMA_VERSION", "MANIFEST", "Job", "RankEntry", "RankStatus", "load_ranks"]

JOB_SCHEMA_VERSION = 1
_JOB_FORMAT = "gradscope.job"
MANIFEST = "gradscope-job.json"  # the file Job.save writes beside the per-rank recordings
_MAX_MANIFEST_BYTES = 16 << 20
_RANK_IN_NAME = re.compile(r"(?:^|[._-])rank[_-]?(\d+)(?=[._-]|$)", re.IGNORECASE)
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


class RankStatus(str, enum.Enum):
    """What a job knows about one rank."""

    COMPLETE = "complete"  # its block finished; its recording is whole
    FAILED = "failed"  # its block raised: the recording is partial (``recording.error`` says why)
    MISSING = "missing"  # no recording: it never arrived (timeout, process gone) or no file holds it
    UNREADABLE = "unreadable"  # something arrived or was found, but it is not a valid recording


@dataclass(frozen=True)
class RankEntry:
    """One rank of a job.

    Attributes:
        rank: the rank (in the group the job was gathered over).
        status: see :class:`RankStatus`.
        recording: the rank's recording (partial when FAILED), None when MISSING or UNREADABLE.
        message: why the rank is failed, missing or unreadable ("" when complete).
        source: where the recording came from ("gathered", a file name, "predicted").
        global_rank: its rank in the default group, when the job was gathered over another
            group (then ``rank`` is its rank in that group); None otherwise.
    """

    rank: int
    status: RankStatus
    recording: Recording | None = None
    message: str = ""
    source: str = ""
    global_rank: int | None = None


@dataclass(frozen=True, repr=False)
class Job:
    """The recordings of one job, one entry per rank, ordered by rank. Immutable.

    ``job.recordings[r]`` is rank ``r``'s :class:`~gradscope.Recording` (None when it is
    missing); ``job.ranks[r]`` says its status and why. ``summary()`` is text, ``to_html(path)``
    a self-contained page, ``save(directory)`` files that :func:`load_ranks` reads back.
    """

    ranks: tuple[RankEntry, ...]
    label: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, tuple) or not self.ranks:
            raise GradscopeError("gradscope: a Job needs a non-empty tuple of RankEntry, one per rank.")
        for i, e in enumerate(self.ranks):
            if not isinstance(e, RankEntry) or e.rank != i:
                raise GradscopeError(
                    f"gradscope: Job.ranks[{i}] must be the RankEntry of rank {i} (ranks 0..n-1 in order)."
                )
            if e.status in (RankStatus.COMPLETE, RankStatus.FAILED) and not isinstance(e.recording, Recording):
                raise GradscopeError(f"gradscope: rank {i} is {e.status.value} but has no recording.")

    @property
    def world_size(self) -> int:
        """How many ranks the job has (missing ones included)."""
        return len(self.ranks)

    @property
    def recordings(self) -> tuple[Recording | None, ...]:
        """Each rank's recording, by rank; None where a rank is missing or unreadable."""
        return tuple(e.recording for e in self.ranks)

    def status_counts(self) -> dict[str, int]:
        """How many ranks are complete, failed, missing, unreadable (only those present)."""
        out: dict[str, int] = {}
        for e in self.ranks:
            out[e.status.value] = out.get(e.status.value, 0) + 1
        return out

    def summary(self) -> str:
        """Deterministic text (apart from times): per-rank table, imbalance, collectives."""
        return str(_views.render(_views.ViewKind.TEXT, self))  # NOTE [ one registry of views ]

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained page (script and data inline, no network): the job view of the
        notebook widget (per-rank table, imbalance, overlaid timelines, communication, each rank's
        graph), and where scripts do not run, the table and timelines of
        :func:`~gradscope._views.job_page.job_html`.
        With ``path``, writes it there and returns the path; without, returns the page's text."""
        page = str(_views.render(_views.ViewKind.HTML, self))
        if path is None:
            return page
        atomic_write_text(os.fspath(path), page)
        return os.fspath(path)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``rank{r}.gscope.json`` for each rank with a recording, and a manifest
        (``gradscope-job.json``) with every rank's status and message, into ``directory``
        (created if needed). :func:`load_ranks` reads it back."""
        d = os.fspath(directory)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise GradscopeError(f"gradscope: cannot create the directory {d!r}: {e.strerror}.") from None
        rows = []
        for entry in self.ranks:
            name = None
            if entry.recording is not None:
                name = f"rank{entry.rank}.gscope.json"
                entry.recording.save(os.path.join(d, name))
            rows.append({"rank": entry.rank, "status": entry.status.value, "message": entry.message,
                         "source": entry.source, "file": name, "global_rank": entry.global_rank})
        manifest = {"format": _JOB_FORMAT, "schema": JOB_SCHEMA_VERSION, "label": self.label,
                    "notes": list(self.notes), "world_size": self.world_size, "ranks": rows}
        atomic_write_text(os.path.join(d, MANIFEST), json.dumps(manifest, indent=1))

    def _repr_html_(self) -> str:
        """The script-free table and timelines (NOTE [ the job's script-free view ] in
        :mod:`gradscope._views.job_page`)."""
        return str(_views.render(_views.ViewKind.HTML, self, script=False))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget in a notebook (gs.show(job)), with the text summary and the script-free
        table and timelines for renderers without widgets."""
        return {**_views.display(self), "text/html": self._repr_html_()}

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.status_counts().items())
        return f"Job({self.label or 'unnamed'}: {self.world_size} ranks, {counts})"


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
def load_ranks(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Job:
    """Read a job back: a directory written by :meth:`Job.save`, a directory of per-rank files
    saved independently (``rec.save(f"step.rank{rank}.gscope.json")``), or a list of such files.

    Each file's rank is the one it was recorded on (``where.rank``), else the number in its name
    (``rank3``, ``rank_3``, ``rank-3``). The world size is the recordings' ``where.world_size``
    (else the highest rank + 1); ranks with no file are marked missing. A file that cannot be
    read is marked unreadable when its name gives its rank.

    Raises:
        GradscopeError: no recordings found; two files for one rank; a name and a recording
            that disagree on the rank; recordings from jobs of different world sizes; a rank with
            no way to tell it; a damaged manifest.
    """
    if isinstance(source, str | os.PathLike):
        p = os.fspath(source)
        if os.path.isdir(p):
            if os.path.isfile(os.path.join(p, MANIFEST)):
                return _load_manifest(os.path.join(p, MANIFEST))
            files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".gscope.json"))
            if not files:
                raise GradscopeError(
                    f"gradscope: {p!r} holds no gradscope recordings (*.gscope.json) and no {MANIFEST}; "
                    "save a job with job.save(directory), or each rank with "
                    "rec.save(f'step.rank{rank}.gscope.json')."
                )
            return _load_files(files)
        if os.path.basename(p) == MANIFEST:
            return _load_manifest(p)
        return _load_files([p])
    try:
        files = [os.fspath(f) for f in source]
    except TypeError:
        raise GradscopeError(
            f"gradscope: load_ranks takes a directory or a list of files, not {type(source).__name__}."
        ) from None
    if not files:
        raise GradscopeError("gradscope: load_ranks got an empty list of files.")
    return _load_files(files)


def _rank_from_name(path: str) -> int | None:
    found = _RANK_IN_NAME.findall(os.path.basename(path))
    return int(found[-1]) if found else None


def _load_files(files: list[str]) -> Job:
    by_rank: dict[int, RankEntry] = {}
    origin: dict[int, str] = {}
    worlds: dict[int, str] = {}
    for f in files:
        named = _rank_from_name(f)
        try:
            rec = load(f)
        except GradscopeError as e:
            if named is None:
                raise GradscopeError(
                    f"gradscope: {f!r} cannot be read and its name gives no rank: {e}"
                ) from None
            _put(by_rank, origin, named, RankEntry(named, RankStatus.UNREADABLE, None, str(e), f), f)
            continue
        rank = rec.where.rank
        if rank is not None and named is not None and rank != named:
            raise GradscopeError(
                f"gradscope: {f!r} is named for rank {named} but was recorded on rank {rank}; "
                "rename the file (or pass the files of one job only)."
            )
        rank = rank if rank is not None else named
        if rank is None:
            raise GradscopeError(
                f"gradscope: cannot tell which rank wrote {f!r}: it was recorded outside torch.distributed "
                "and its name has no rank; name it like 'step.rank0.gscope.json'."
            )
        if rec.where.world_size is not None:
            worlds.setdefault(rec.where.world_size, f)
        status = RankStatus.COMPLETE if rec.complete else RankStatus.FAILED
        _put(by_rank, origin, rank, RankEntry(rank, status, rec, rec.error or "", f), f)
    if len(worlds) > 1:
        listed = ", ".join(f"{n} ({f!r})" for n, f in sorted(worlds.items()))
        raise GradscopeError(
            f"gradscope: these recordings come from jobs of different world sizes: {listed}; "
            "load the files of one job at a time."
        )
    world = next(iter(worlds)) if worlds else max(by_rank) + 1
    beyond = sorted(r for r in by_rank if r >= world)
    if beyond:
        raise GradscopeError(
            f"gradscope: {origin[beyond[0]]!r} holds rank {beyond[0]} but the job's world size is {world}."
        )
    ranks = tuple(
        by_rank.get(r) or RankEntry(r, RankStatus.MISSING, None, "no file for this rank", "")
        for r in range(world)
    )
    return Job(ranks)


def _put(by_rank: dict[int, RankEntry], origin: dict[int, str], rank: int, entry: RankEntry, f: str) -> None:
    if rank < 0:
        raise GradscopeError(f"gradscope: {f!r} names rank {rank}; ranks start at 0.")
    if rank in by_rank:
        raise GradscopeError(
            f"gradscope: two files for rank {rank}: {origin[rank]!r} and {f!r}; keep one "
            "(different steps of one job belong in different directories)."
        )
    by_rank[rank] = entry
    origin[rank] = f


def _load_manifest(path: str) -> Job:
    """See NOTE [ files are data ] in gradscope._model.recording: the manifest is checked field by field,
    and it may only name plain files beside itself."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MANIFEST_BYTES:
            raise GradscopeError(f"gradscope: {path!r} is not a gradscope job manifest (not a small file).")
        with open(path, encoding="utf-8") as fh:
            m = json.load(fh)
    except GradscopeError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GradscopeError(f"gradscope: cannot read the job manifest {path!r}: {e}.") from None
    if not isinstance(m, dict) or m.get("format") != _JOB_FORMAT:
        raise GradscopeError(f"gradscope: {path!r} is not a gradscope job manifest (no 'format': '{_JOB_FORMAT}').")
    if m.get("schema") != JOB_SCHEMA_VERSION:
        raise GradscopeError(
            f"gradscope: job manifest schema {m.get('schema')!r} is not supported (this gradscope reads "
            f"{JOB_SCHEMA_VERSION}); load the per-rank files with load_ranks([...]) instead."
        )
    directory = os.path.dirname(os.path.abspath(path))
    rows = m.get("ranks")
    world = m.get("world_size")
    if type(world) is not int or world < 1 or not isinstance(rows, list) or len(rows) != world:
        raise GradscopeError(f"gradscope: the job manifest {path!r} is damaged (world_size and ranks disagree).")
    entries = []
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict) or row["rank"] != i:
                raise ValueError(f"entry {i} is not rank {i}")
            status = RankStatus(row["status"])
            message, source, name = str(row.get("message", "")), str(row.get("source", "")), row.get("file")
            global_rank = row.get("global_rank")
            if global_rank is not None and type(global_rank) is not int:
                raise ValueError(f"global_rank of rank {i} is not an integer")
        except (KeyError, ValueError, TypeError) as e:
            raise GradscopeError(f"gradscope: the job manifest {path!r} is damaged ({e}).") from None
        rec = None
        if name is not None:
            if not isinstance(name, str) or not _SAFE_FILE.match(name) or name == MANIFEST:
                raise GradscopeError(
                    f"gradscope: the job manifest {path!r} names {name!r} for rank {i}: only plain file "
                    "names beside the manifest are read."
                )
            f = os.path.join(directory, name)
            if not os.path.exists(f):
                entries.append(RankEntry(i, RankStatus.MISSING, None, f"its file {name} is gone", source,
                                         global_rank))
                continue
            try:
                rec = load(f)
            except GradscopeError as e:
                entries.append(RankEntry(i, RankStatus.UNREADABLE, None, str(e), source, global_rank))
                continue
            expected = i if global_rank is None else global_rank
            if rec.where.rank is not None and rec.where.rank != expected and source != "predicted":
                raise GradscopeError(
                    f"gradscope: {f!r} is listed for rank {expected} but was recorded on rank {rec.where.rank}."
                )
            status = RankStatus.COMPLETE if rec.complete else RankStatus.FAILED
        elif status in (RankStatus.COMPLETE, RankStatus.FAILED):
            raise GradscopeError(f"gradscope: the job manifest {path!r} lists rank {i} as {status.value} "
                                 "without a file.")
        entries.append(RankEntry(i, status, rec, message, source, global_rank))
    notes = m.get("notes", [])
    return Job(tuple(entries), label=str(m.get("label", "")),
               notes=tuple(str(n) for n in notes) if isinstance(notes, list) else ())
