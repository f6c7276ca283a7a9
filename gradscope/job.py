"""One job, many ranks: the recordings of a ``torch.distributed`` job side by side.

A :class:`Job` holds one entry per rank (its recording, or why there is none), ordered by rank.
It comes from :func:`gradscope.gather` on the destination rank, from :func:`load_ranks` (a
directory written by :meth:`Job.save`, or per-rank files saved independently), or from
:func:`gradscope.predict_job`. What a job view shows is computed by one pure function,
:func:`job_view`, which the text summary, the HTML page and the notebook widget all read.

This module imports nothing from ``torch.distributed``: a saved job opens on a laptop.

Example:
    >>> import torch, gradscope as gs
    >>> from gradscope.job import Job, RankEntry, RankStatus
    >>> def run(batch):
    ...     torch.manual_seed(0)
    ...     fnet = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    ...     x = torch.randn(batch, 64)
    ...     with gs.record(memory="tracker", modules={"fnet": fnet}) as rec:
    ...         fnet(x).sum().backward()
    ...     return rec.recording
    >>> job = Job((RankEntry(0, RankStatus.COMPLETE, run(32)), RankEntry(1, RankStatus.COMPLETE, run(64))))
    >>> print(job_view(job).imbalance.sentence)
    rank 1 peaks 2.0x rank 0: its batch is twice as large (64 vs 32); fnet.1 activations +32.0 KiB
"""

from __future__ import annotations

import enum
import html as _html
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gradscope import _views
from gradscope.errors import GradscopeError
from gradscope.recording import Kind, Recording, atomic_write_text, format_bytes, load

__all__ = [
    "JOB_SCHEMA_VERSION",
    "CollectiveSpan",
    "Difference",
    "Imbalance",
    "Job",
    "JobDiagnosis",
    "JobFinding",
    "JobView",
    "RankEntry",
    "RankRow",
    "RankStatus",
    "SizeDifference",
    "TimelineSeries",
    "diagnose_job",
    "job_html",
    "job_payload",
    "job_view",
    "load_ranks",
]

JOB_SCHEMA_VERSION = 1
_JOB_FORMAT = "gradscope.job"
MANIFEST = "gradscope-job.json"  # the file Job.save writes beside the per-rank recordings
_MAX_MANIFEST_BYTES = 16 << 20
_TIMELINE_POINTS = 600  # points kept per rank in the overlaid timeline (peaks always kept)
_RANK_IN_NAME = re.compile(r"(?:^|[._-])rank[_-]?(\d+)(?=[._-]|$)", re.IGNORECASE)
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
# Labels of timeline points made while a collective (or the framework code around one) ran: the
# profiler's names for c10d operators, gloo/NCCL kernels, and FSDP's and DDP's record_function
# ranges. See NOTE [ collectives in the job view ].
_COMM_LABEL = re.compile(r"^(c10d::|c10d\.|gloo:|nccl:|nccl::|record_param_comms|FSDP::|fsdp::|"
                         r"DistributedDataParallel)")


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

    def view(self) -> JobView:
        """What the job view shows, as data (see :func:`job_view`)."""
        return job_view(self)

    def summary(self) -> str:
        """Deterministic text (apart from times): per-rank table, imbalance, collectives."""
        return _summary_text(self, job_view(self))

    def diagnose(self, budget: int | str | None = None) -> JobDiagnosis:
        """Which ranks ran out of memory (or would, given ``budget``) and whether imbalance
        between ranks is the cause (see :func:`diagnose_job`)."""
        return diagnose_job(self, budget=budget)

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained page (script and data inline, no network): the job view of the
        notebook widget (per-rank table, imbalance, overlaid timelines, communication, each rank's
        graph), and where scripts do not run, the table and timelines of :func:`job_html`.
        Returns the HTML; writes it to ``path`` when given."""
        page = str(_views.render("html", self))  # see NOTE [ results ask the registry ]
        if path is not None:
            atomic_write_text(os.fspath(path), page)
        return page

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
        return _html_fragment(self, job_view(self))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget in a notebook (gs.show(job)), with the text summary and the script-free
        table and timelines for renderers without widgets."""
        out = dict(_views.render("mimebundle", self))
        out.setdefault("text/html", self._repr_html_())
        return out

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.status_counts().items())
        return f"Job({self.label or 'unnamed'}: {self.world_size} ranks, {counts})"


# ----------------------------------------------------------------------------------------------
# the view's data: one pure function
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankRow:
    """One rank's figures side by side with the others'. Byte fields are None without memory."""

    rank: int
    status: RankStatus
    message: str
    peak_bytes: int | None
    baseline_bytes: int | None
    saved_bytes: int | None
    saved_bytes_at_peak: int | None
    time_s: float | None
    nodes: int
    peak_phase: str | None
    peak_module: str | None
    peak_label: str | None
    inputs: tuple[tuple[int, ...], ...]  # shapes of the inputs its graph saved, largest first


@dataclass(frozen=True)
class Difference:
    """One thing (a module's saved bytes, a kind of memory held at the peak) on two ranks."""

    name: str
    heavy_bytes: int
    light_bytes: int

    @property
    def delta(self) -> int:
        return self.heavy_bytes - self.light_bytes


@dataclass(frozen=True)
class SizeDifference:
    """How the heaviest rank's inputs differ from the lightest's.

    ``what`` is ``"batch"`` (dimension 0), ``"sequence"`` (dimension 1 of token ids or of
    (batch, sequence, features) inputs), ``"dimension N"``, or ``"resident inputs"`` when only
    the bytes that existed before the block tell them apart (no saved inputs to compare).
    """

    what: str
    heavy: int
    light: int
    input: str  # which saved input was compared: "AddmmBackward0._saved_mat1 in fnet.0"
    # ``what`` may also be "first saved activation" (``heavy``/``light`` are element counts, when
    # no input was saved), see _first_saved_difference

    @property
    def ratio(self) -> float:
        return self.heavy / self.light if self.light else math.inf


@dataclass(frozen=True)
class Imbalance:
    """Which rank peaks highest, by how much, and what makes the difference."""

    heaviest: int
    lightest: int
    heavy_peak: int
    light_peak: int
    sizes: tuple[SizeDifference, ...]
    modules: tuple[Difference, ...]  # saved bytes by module, largest increase first
    held: tuple[Difference, ...]  # what was held at each rank's peak, by kind
    heavy_phase: str | None
    light_phase: str | None
    heavy_module: str | None
    light_module: str | None
    sentence: str

    @property
    def ratio(self) -> float:
        """Heaviest peak over lightest peak (inf when the lightest allocated nothing)."""
        return self.heavy_peak / self.light_peak if self.light_peak else math.inf


@dataclass(frozen=True)
class TimelineSeries:
    """One rank's memory over time: (seconds since its first point, live bytes), downsampled to
    at most a few hundred points with every local maximum kept, so the peak is never lost.
    ``phases[i]`` is the phase of ``points[i]`` (forward, backward, optimizer, other), so that
    views can line the ranks' phases up."""

    rank: int
    points: tuple[tuple[float, int], ...]
    peak_t_s: float | None
    phases: tuple[str, ...] = ()


@dataclass(frozen=True)
class CollectiveSpan:
    """Communication seen in one rank's recording: an operation's name, when (seconds since the
    rank's first timeline point), and its bytes.

    NOTE [ collectives in the job view ]: a recording made in a distributed job under the CPU
    memory source carries ``extra["collectives"]``, one row per collective (``op``, ``t_s``,
    ``duration_s``, ``bytes``, ``kind``): c10d's calls (``c10d::allreduce_`` of DDP's buckets,
    ``c10d::_allgather_base_`` and ``c10d::_reduce_scatter_base_`` of FSDP) and the backend's work
    (``gloo:all_reduce`` ...), with the bytes each moved (see NOTE [ collectives in a recording ]
    in :mod:`gradscope.memory`). Those are read first (``source`` "captured", ``bytes`` moved).
    A recording without them (another memory source, an older file) still has its timeline: with
    ``memory="cpu"`` every point is labelled with the innermost profiler range running, and
    PyTorch names its communication ranges ``c10d::...``, ``gloo:...``, ``nccl:...``,
    ``FSDP::all_gather (i)`` (i = the FSDP unit), ``DistributedDataParallel.forward``.
    Consecutive points with one such label form a span (``source`` "timeline labels", ``bytes``
    allocated inside it), so communication that allocates shows where it happens (FSDP's
    all-gathers do; DDP's in-place all-reduce does not).
    """

    rank: int
    op: str
    t_start_s: float
    t_end_s: float
    bytes: int
    source: str  # "captured" (extra["collectives"]: bytes moved) or "timeline labels" (bytes allocated)


@dataclass(frozen=True)
class JobView:
    """Everything a job view shows, computed once from a :class:`Job` by :func:`job_view`."""

    rows: tuple[RankRow, ...]
    imbalance: Imbalance | None
    timelines: tuple[TimelineSeries, ...]
    collectives: tuple[CollectiveSpan, ...]
    notes: tuple[str, ...]


def job_view(job: Job) -> JobView:
    """The data every view of a job shows: per-rank rows, the imbalance between the complete
    ranks (heaviest against lightest), downsampled timelines and communication spans. Pure:
    the same job gives the same view."""
    rows = tuple(_row(e) for e in job.ranks)
    notes: list[str] = list(job.notes)
    measured = [
        e for e in job.ranks
        if e.status is RankStatus.COMPLETE and e.recording is not None and _measured(e.recording)
    ]
    imbalance = _imbalance(measured) if len(measured) >= 2 else None
    if job.world_size >= 2 and len(measured) < 2:
        notes.append("fewer than two complete ranks with memory measured: no imbalance to show.")
    timelines = tuple(
        _series(e.rank, e.recording) for e in job.ranks if e.recording is not None and e.recording.timeline
    )
    spans: list[CollectiveSpan] = []
    for e in job.ranks:
        if e.recording is not None:
            spans.extend(_collectives(e.rank, e.recording))
    return JobView(rows=rows, imbalance=imbalance, timelines=timelines, collectives=tuple(spans),
                   notes=tuple(notes))


def _measured(r: Recording) -> bool:
    return bool(r.timeline) or r.peak_bytes > 0


def _row(e: RankEntry) -> RankRow:
    r = e.recording
    if r is None:
        return RankRow(e.rank, e.status, e.message, None, None, None, None, None, 0, None, None, None, ())
    mem = _measured(r)
    peak = r.peak
    return RankRow(
        rank=e.rank,
        status=e.status,
        message=e.message or (r.error or ""),
        peak_bytes=r.peak_bytes if mem else None,
        baseline_bytes=r.baseline_bytes if mem else None,
        saved_bytes=r.saved_bytes,
        saved_bytes_at_peak=r.saved_bytes_at_peak,
        time_s=r.wall_time_s,
        nodes=len(r.nodes),
        peak_phase=None if peak is None else peak.phase.value,
        peak_module=None if peak is None else peak.module,
        peak_label=None if peak is None else peak.label,
        inputs=tuple(v[0] for v in sorted(_inputs(r).values(), key=lambda v: -v[2])),
    )


def _inputs(r: Recording) -> dict[tuple[str, str, str], tuple[tuple[int, ...], str, int]]:
    """Saved inputs (tensors that existed before the block and are not parameters) keyed by
    what saved them: (module, node name, attribute) -> (shape, dtype, bytes)."""
    out: dict[tuple[str, str, str], tuple[tuple[int, ...], str, int]] = {}
    for s in r.saved:
        if s.kind is not Kind.INPUT:
            continue
        name = r.nodes[s.node].name if 0 <= s.node < len(r.nodes) else "?"
        key = (s.module or "", name, s.attribute)
        out.setdefault(key, (s.shape, s.dtype, s.bytes))
    return out


def _size_differences(heavy: Recording, light: Recording) -> tuple[SizeDifference, ...]:
    """Dimensions in which the heavy rank's saved inputs are larger than the light rank's: the
    largest input saved under the same (module, node, attribute) on both is compared."""
    hi, lo = _inputs(heavy), _inputs(light)
    common = sorted((k for k in hi if k in lo and len(hi[k][0]) == len(lo[k][0]) and hi[k][0] != lo[k][0]),
                    key=lambda k: (-hi[k][2], k))
    for key in common:
        hs, dtype, _ = hi[key]
        ls = lo[key][0]
        where = f"{key[1]}.{key[2]}" + (f" in {key[0]}" if key[0] else "")
        out = []
        for d, (a, b) in enumerate(zip(hs, ls, strict=True)):
            if a != b:
                out.append(SizeDifference(_dim_name(d, len(hs), dtype), a, b, where))
        if any(s.heavy > s.light for s in out):
            return tuple(out)
    if heavy.baseline_bytes > light.baseline_bytes and not common:
        return (SizeDifference("resident inputs", heavy.baseline_bytes, light.baseline_bytes, "baseline bytes"),)
    if not hi or not lo:
        first = _first_saved_difference(heavy, light)
        return () if first is None else (first,)
    return ()


def _first_saved_difference(heavy: Recording, light: Recording) -> SizeDifference | None:
    """When no input was saved (the first op copies or reshapes it), the first tensor saved in
    forward under the same (module, node, attribute) on both ranks whose shapes differ."""
    lo: dict[tuple[str, str, str], tuple[int, ...]] = {}
    for s in light.saved:
        name = light.nodes[s.node].name if 0 <= s.node < len(light.nodes) else "?"
        lo.setdefault((s.module or "", name, s.attribute), s.shape)
    seen: set[tuple[str, str, str]] = set()
    for s in heavy.saved:  # in the order they were saved
        name = heavy.nodes[s.node].name if 0 <= s.node < len(heavy.nodes) else "?"
        key = (s.module or "", name, s.attribute)
        if key in seen:
            continue
        seen.add(key)
        other = lo.get(key)
        if other is None or len(other) != len(s.shape) or other == s.shape:
            continue
        a, b = math.prod(s.shape), math.prod(other)
        where = (f"{name}.{s.attribute}" + (f" in {key[0]}" if key[0] else "")
                 + f" {list(s.shape)} vs {list(other)}")
        return SizeDifference("first saved activation", a, b, where)
    return None


def _dim_name(d: int, ndim: int, dtype: str) -> str:
    if d == 0:
        return "batch"
    integer = "int" in dtype or "long" in dtype
    if d == 1 and ((ndim == 2 and integer) or ndim == 3):
        return "sequence"
    return f"dimension {d}"


def _times(ratio: float) -> str:
    if abs(ratio - 2.0) < 0.005:
        return "twice"
    return f"{ratio:.1f}x"


def _size_phrase(s: SizeDifference) -> str:
    if s.what == "first saved activation":
        return f"its first saved activation is {_times(s.ratio)} as large ({s.input})"
    if s.what == "resident inputs":
        return (f"it started with {format_bytes(s.heavy - s.light)} more resident before its block "
                f"({format_bytes(s.heavy)} vs {format_bytes(s.light)}: larger inputs)")
    if s.heavy < s.light:
        return f"its {s.what} is smaller ({s.heavy} vs {s.light})"
    adjective = "long" if s.what == "sequence" else "large"
    return f"its {s.what} is {_times(s.ratio)} as {adjective} ({s.heavy} vs {s.light})"


def _imbalance(entries: list[RankEntry]) -> Imbalance:
    recs = {e.rank: e.recording for e in entries if e.recording is not None}
    heaviest = max(recs, key=lambda r: (recs[r].peak_bytes, -r))
    lightest = min(recs, key=lambda r: (recs[r].peak_bytes, r))
    h, lo = recs[heaviest], recs[lightest]
    sizes = _size_differences(h, lo) if heaviest != lightest else ()
    hm, lm = h.saved_bytes_by_module(), lo.saved_bytes_by_module()
    modules = sorted(
        (Difference(m, hm.get(m, 0), lm.get(m, 0)) for m in set(hm) | set(lm)),
        key=lambda d: (-d.delta, d.name),
    )
    hh, lh = h.held_at_peak(), lo.held_at_peak()
    held = sorted((Difference(k, hh.get(k, 0), lh.get(k, 0)) for k in set(hh) | set(lh)),
                  key=lambda d: (-d.delta, d.name))
    imb = Imbalance(
        heaviest=heaviest,
        lightest=lightest,
        heavy_peak=h.peak_bytes,
        light_peak=lo.peak_bytes,
        sizes=sizes,
        modules=tuple(d for d in modules if d.delta != 0),
        held=tuple(d for d in held if d.delta != 0),
        heavy_phase=None if h.peak is None else h.peak.phase.value,
        light_phase=None if lo.peak is None else lo.peak.phase.value,
        heavy_module=None if h.peak is None else h.peak.module,
        light_module=None if lo.peak is None else lo.peak.module,
        sentence="",
    )
    return Imbalance(**{**imb.__dict__, "sentence": _sentence(imb)})


def _sentence(imb: Imbalance) -> str:
    """'rank 1 peaks 2.0x rank 0: its batch is twice as large (64 vs 32); fnet.0 activations +X'."""
    if imb.heaviest == imb.lightest or imb.ratio < 1.05:
        return (f"ranks are balanced: every complete rank peaks within 5% of rank {imb.lightest} "
                f"({format_bytes(imb.light_peak)})")
    ratio = "more than rank" if math.isinf(imb.ratio) else f"{imb.ratio:.1f}x rank"
    parts = [f"rank {imb.heaviest} peaks {ratio} {imb.lightest}"]
    why = [_size_phrase(s) for s in imb.sizes if s.heavy != s.light]
    grown = [d for d in imb.modules if d.delta > 0]
    if grown:
        why.append(f"{grown[0].name} activations +{format_bytes(grown[0].delta)}")
    elif imb.held and imb.held[0].delta > 0:
        why.append(f"{imb.held[0].name} +{format_bytes(imb.held[0].delta)} at the peak")
    if imb.heavy_phase and imb.light_phase and imb.heavy_phase != imb.light_phase:
        why.append(f"it peaks in {imb.heavy_phase}, rank {imb.lightest} in {imb.light_phase}")
    return parts[0] + (": " + "; ".join(why) if why else "")


def _series(rank: int, r: Recording) -> TimelineSeries:
    pts = r.timeline
    t0 = pts[0].t_s
    raw = [(p.t_s - t0, p.live) for p in pts]
    keep = list(range(len(raw)))
    if len(raw) > _TIMELINE_POINTS:
        # NOTE [ downsampling keeps the peak ]: one bucket per pixel-ish column, and in each
        # bucket its first point, its lowest and its highest, in time order.
        per = math.ceil(len(raw) / (_TIMELINE_POINTS // 3))
        keep = []
        for i in range(0, len(raw), per):
            chunk = raw[i : i + per]
            picks = {0, min(range(len(chunk)), key=lambda j: chunk[j][1]),
                     max(range(len(chunk)), key=lambda j: chunk[j][1])}
            keep.extend(i + j for j in sorted(picks))
        if keep[-1] != len(raw) - 1:
            keep.append(len(raw) - 1)
    peak_t = None if r.peak is None or not math.isfinite(r.peak.t_s) else max(0.0, r.peak.t_s - t0)
    return TimelineSeries(rank, tuple((round(raw[i][0], 9), raw[i][1]) for i in keep), peak_t,
                          tuple(getattr(pts[i].phase, "value", str(pts[i].phase)) for i in keep))


def _collectives(rank: int, r: Recording) -> list[CollectiveSpan]:
    """See NOTE [ collectives in the job view ]."""
    out: list[CollectiveSpan] = []
    t0 = r.timeline[0].t_s if r.timeline else 0.0
    captured = r.extra.get("collectives") if isinstance(r.extra, Mapping) else None
    if isinstance(captured, list):
        # a backend's worker thread stamps the end of its work after it wakes the waiting thread:
        # on a busy machine that stamp can land after the block ended (measured: 0.17 ms past a
        # block whose optimizer step ran after the wait). Spans are kept inside the block.
        lo = -t0
        hi = max(lo, r.wall_time_s - t0) if r.wall_time_s > 0 else math.inf  # no length known: not cut
        for c in captured:
            try:
                t = float(c["t_s"]) - t0
                end = min(hi, t + float(c.get("duration_s", 0.0)))
                start = min(max(lo, t), end)
                out.append(CollectiveSpan(rank, str(c["op"]), start, end, int(c.get("bytes", 0)), "captured"))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        if out:
            return out
    cur: list[Any] | None = None
    for p in r.timeline:
        if _COMM_LABEL.match(p.label):
            if cur is not None and cur[0] == p.label:
                cur[2] = p.t_s
                cur[4] = max(cur[4], p.live)
            else:
                if cur is not None:
                    out.append(_span(rank, cur, t0))
                cur = [p.label, p.t_s, p.t_s, p.live, p.live]
        elif cur is not None:
            out.append(_span(rank, cur, t0))
            cur = None
    if cur is not None:
        out.append(_span(rank, cur, t0))
    return out


def _span(rank: int, cur: list[Any], t0: float) -> CollectiveSpan:
    label, ta, tb, first, top = cur
    return CollectiveSpan(rank, label, ta - t0, tb - t0, max(0, top - first), "timeline labels")


# ----------------------------------------------------------------------------------------------
# the widget's and the page's data
# ----------------------------------------------------------------------------------------------
MAX_RANKS_WITH_GRAPHS = 8  # ranks whose whole recording (graph, steps) travels with the job's view


def job_payload(job: Job, *, recording_payload: Any = None, version: int = 2) -> dict[str, Any]:
    """What the widget and the page draw for a job, read from :func:`job_view`: the per-rank
    rows, the imbalance, the overlaid timelines (with each point's phase), the communication
    spans, the findings of :func:`diagnose_job` when a rank's block failed, and, for jobs of at most ``MAX_RANKS_WITH_GRAPHS`` ranks, each rank's own recording
    (``recording_payload(rec)``, from :mod:`gradscope.widget`) for its graph and step-through."""
    v = job_view(job)
    phases = ("forward", "backward", "optimizer", "other")

    def shape(t: tuple[int, ...]) -> str:
        return "×".join(str(d) for d in t) if t else "scalar"

    rows = [
        {
            "rank": r.rank, "status": r.status.value, "message": r.message, "peak_bytes": r.peak_bytes,
            "baseline_bytes": r.baseline_bytes, "saved_bytes": r.saved_bytes,
            "saved_at_peak": r.saved_bytes_at_peak, "time_s": _finite(r.time_s), "nodes": r.nodes,
            "peak_phase": r.peak_phase, "peak_module": r.peak_module, "peak_label": r.peak_label,
            "inputs": [shape(t) for t in r.inputs[:3]], "source": e.source,
        }
        for r, e in zip(v.rows, job.ranks, strict=True)
    ]
    imb = v.imbalance
    imbalance = None if imb is None else {
        "heaviest": imb.heaviest, "lightest": imb.lightest, "heavy_peak": imb.heavy_peak,
        "light_peak": imb.light_peak, "ratio": _finite(imb.ratio), "sentence": imb.sentence,
        "sizes": [{"what": d.what, "heavy": d.heavy, "light": d.light, "input": d.input} for d in imb.sizes],
        "modules": [[d.name, d.heavy_bytes, d.light_bytes] for d in imb.modules[:8]],
        "held": [[d.name, d.heavy_bytes, d.light_bytes] for d in imb.held[:8]],
        "heavy_phase": imb.heavy_phase, "light_phase": imb.light_phase,
        "heavy_module": imb.heavy_module, "light_module": imb.light_module,
    }
    timelines = [
        {"rank": tl.rank, "t": [p[0] for p in tl.points], "live": [p[1] for p in tl.points],
         "phase": [phases.index(ph) if ph in phases else 3 for ph in tl.phases] if tl.phases else None,
         "peak_t": _finite(tl.peak_t_s)}
        for tl in v.timelines
    ]
    collectives = [{"rank": c.rank, "op": c.op, "t0": _finite(c.t_start_s), "t1": _finite(c.t_end_s),
                    "bytes": c.bytes, "source": c.source} for c in v.collectives]
    notes = list(v.notes)
    findings = []
    if any(e.recording is not None and not e.recording.complete for e in job.ranks):
        findings = [{"rank": f.rank, "pattern": f.pattern, "message": f.message, "suggestion": f.suggestion}
                    for f in diagnose_job(job).findings]
    recordings: list[Any] | None = None
    if recording_payload is not None:
        if job.world_size <= MAX_RANKS_WITH_GRAPHS:
            recordings = [None if e.recording is None else recording_payload(e.recording) for e in job.ranks]
        else:
            notes.append(f"graphs and step-through are shown for jobs of up to {MAX_RANKS_WITH_GRAPHS} ranks; "
                         "gs.show(job.recordings[r]) shows one rank's.")
    return {
        "version": version,
        "kind": "job",
        "label": job.label,
        "world_size": job.world_size,
        "counts": job.status_counts(),
        "rows": rows,
        "imbalance": imbalance,
        "timelines": timelines,
        "phases": list(phases),
        "collectives": collectives,
        "findings": findings,
        "notes": notes,
        "recordings": recordings,
    }


def _finite(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), 9)


# ----------------------------------------------------------------------------------------------
# text
# ----------------------------------------------------------------------------------------------
def _summary_text(job: Job, v: JobView) -> str:
    counts = job.status_counts()
    head = f"gradscope job{' ' + job.label if job.label else ''}: {job.world_size} rank" + (
        "s" if job.world_size != 1 else "")
    lines = [head + " (" + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")"]
    lines.append(f"{'rank':>4}  {'status':<10} {'peak':>10} {'baseline':>10} {'saved':>10} {'time':>8}  peak at")
    for row in v.rows:
        if row.status in (RankStatus.MISSING, RankStatus.UNREADABLE):
            lines.append(f"{row.rank:>4}  {row.status.value:<10} {row.message}")
            continue
        where = "" if row.peak_phase is None else row.peak_phase
        if row.peak_module:
            where += f" in {row.peak_module}"
        if row.peak_label:
            where += f" ({row.peak_label})"
        t = "" if row.time_s is None else f"{row.time_s:.3f} s"
        lines.append(
            f"{row.rank:>4}  {row.status.value:<10} {format_bytes(row.peak_bytes):>10} "
            f"{format_bytes(row.baseline_bytes):>10} {format_bytes(row.saved_bytes):>10} {t:>8}  {where}"
        )
        if row.status is RankStatus.FAILED:
            lines.append(f"{'':>6}failed: {row.message}")
    imb = v.imbalance
    if imb is not None:
        lines.append("imbalance: " + imb.sentence)
        for s in imb.sizes:
            lines.append(f"  input {s.input}: {s.what} {s.heavy} on rank {imb.heaviest}, {s.light} on "
                         f"rank {imb.lightest}")
        if imb.modules:
            lines.append(f"  saved bytes by module, rank {imb.heaviest} vs rank {imb.lightest}:")
            for d in imb.modules[:5]:
                lines.append(f"    {d.name}: {format_bytes(d.heavy_bytes)} vs {format_bytes(d.light_bytes)}")
        if imb.held:
            lines.append(f"  held at the peak, rank {imb.heaviest} vs rank {imb.lightest}:")
            for d in imb.held[:5]:
                lines.append(f"    {d.name}: {format_bytes(d.heavy_bytes)} vs {format_bytes(d.light_bytes)}")
        if imb.heaviest != imb.lightest:
            lines.append(
                f"  peaks: rank {imb.heaviest} in {imb.heavy_phase or '?'}"
                + (f" ({imb.heavy_module})" if imb.heavy_module else "")
                + f", rank {imb.lightest} in {imb.light_phase or '?'}"
                + (f" ({imb.light_module})" if imb.light_module else "")
            )
    if v.collectives:
        per: dict[int, dict[str, int]] = {}
        for c in v.collectives:
            per.setdefault(c.rank, {})
            per[c.rank][_op_family(c.op)] = per[c.rank].get(_op_family(c.op), 0) + 1
        moved: dict[int, dict[str, int]] = {}
        for c in v.collectives:
            if c.source == "captured":
                fam, op = moved.setdefault(c.rank, {}), _op_family(c.op)
                fam[op] = fam.get(op, 0) + c.bytes
        if moved:
            lines.append("communication (the collectives each rank's recording captured, with the bytes they moved):")
        else:
            lines.append("communication seen in the timelines (spans that allocated memory):")
        for rank, fam in sorted(per.items()):
            lines.append(f"  rank {rank}: " + ", ".join(
                f"{k} x{n}" + (f" ({format_bytes(moved[rank][k])})" if k in moved.get(rank, {}) else "")
                for k, n in sorted(fam.items())))
    for n in v.notes:
        lines.append("note: " + n)
    return "\n".join(lines)


def _op_family(op: str) -> str:
    """``'FSDP::all_gather (2)'`` -> ``'FSDP::all_gather'``: the op without its unit number."""
    return re.sub(r"\s*\(\d+\)$", "", op)


# ----------------------------------------------------------------------------------------------
# HTML: a table and inline SVG, no script
# ----------------------------------------------------------------------------------------------
# NOTE [ the job's script-free view ]: the job view itself is the widget's front end (the page
# Job.to_html writes inlines it, see gradscope.html.job_page_html). This table and SVG are what
# shows where no script runs: a notebook rendered by nbconvert or on a code host (the text/html
# of Job._repr_mimebundle_), the page's <noscript>, and job_html(), a page with no script at all
# (its Content-Security-Policy allows none), which renders anywhere.
_JOB_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_STYLE = (
    ".gs-job{font:13px system-ui,sans-serif;color:#1b1f24}"
    ".gs-job table{border-collapse:collapse;margin:8px 0}"
    ".gs-job td,.gs-job th{padding:3px 9px;border-bottom:1px solid #dde3ea;text-align:right}"
    ".gs-job td.l,.gs-job th.l{text-align:left}"
    ".gs-job .failed{color:#b35c00}.gs-job .missing,.gs-job .unreadable{color:#b00020}"
    ".gs-job .imb{margin:8px 0;font-weight:600}"
)


def job_html(job: Job) -> str:
    """A page with no script at all: the per-rank table, the imbalance and the overlaid
    timelines as inline SVG (see NOTE [ the job's script-free view ])."""
    title = "gradscope job" + (f" · {job.label}" if job.label else "")
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_JOB_CSP}">\n'
        f"<title>{_html.escape(title)}</title>\n<style>body{{margin:12px;background:#f5f7fa}}</style>\n"
        "</head>\n<body>\n" + _html_fragment(job, job_view(job)) + "\n</body>\n</html>\n"
    )


def _html_fragment(job: Job, v: JobView) -> str:
    e = _html.escape
    out = [f"<div class='gs-job'><style>{_STYLE}</style>"]
    out.append(f"<h3>{e('gradscope job' + (' · ' + job.label if job.label else ''))}: "
               f"{job.world_size} ranks</h3>")
    if v.imbalance is not None:
        out.append(f"<div class='imb'>{e(v.imbalance.sentence)}</div>")
    out.append("<table><tr><th>rank</th><th class='l'>status</th><th>peak</th><th>baseline</th>"
               "<th>saved</th><th>time</th><th class='l'>peak at</th><th class='l'>inputs</th></tr>")
    for row in v.rows:
        color = _COLORS[row.rank % len(_COLORS)]
        where = " ".join(x for x in (row.peak_phase, row.peak_module, row.peak_label) if x)
        inputs = ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in row.inputs[:3])
        msg = f"<br><small>{e(row.message)}</small>" if row.message else ""
        t = "" if row.time_s is None else f"{row.time_s:.3f} s"
        out.append(
            f"<tr><td><span style='color:{color}'>&#9632;</span> {row.rank}</td>"
            f"<td class='l {row.status.value}'>{e(row.status.value)}{msg}</td>"
            f"<td>{e(format_bytes(row.peak_bytes))}</td><td>{e(format_bytes(row.baseline_bytes))}</td>"
            f"<td>{e(format_bytes(row.saved_bytes))}</td><td>{t}</td>"
            f"<td class='l'>{e(where)}</td><td class='l'>{e(inputs)}</td></tr>"
        )
    out.append("</table>")
    if v.timelines:
        out.append(_svg(v))
    if v.imbalance is not None and v.imbalance.modules:
        imb = v.imbalance
        out.append(f"<table><tr><th class='l'>module</th><th>saved on rank {imb.heaviest}</th>"
                   f"<th>saved on rank {imb.lightest}</th></tr>")
        for d in imb.modules[:8]:
            out.append(f"<tr><td class='l'>{e(d.name)}</td><td>{e(format_bytes(d.heavy_bytes))}</td>"
                       f"<td>{e(format_bytes(d.light_bytes))}</td></tr>")
        out.append("</table>")
    for n in v.notes:
        out.append(f"<p><small>note: {e(n)}</small></p>")
    out.append("</div>")
    return "".join(out)


def _svg(v: JobView, width: int = 760, height: int = 260) -> str:
    """Overlaid per-rank timelines (live bytes over seconds since each rank's first point), the
    peaks marked, communication spans as ticks under the axis."""
    pad_l, pad_r, pad_t, pad_b = 70, 12, 24, 48
    t_max = max((p[0] for s in v.timelines for p in s.points), default=0.0) or 1.0
    y_max = max((p[1] for s in v.timelines for p in s.points), default=0) or 1
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def x(t: float) -> float:
        return pad_l + w * t / t_max

    def y(b: int) -> float:
        return pad_t + h * (1 - b / y_max)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"role='img' aria-label='memory over time, one line per rank'>"]
    parts.append(f"<rect x='{pad_l}' y='{pad_t}' width='{w}' height='{h}' fill='#fff' stroke='#c8d0da'/>")
    for frac in (0.0, 0.5, 1.0):
        yy = y(int(y_max * frac))
        parts.append(f"<text x='{pad_l - 6}' y='{yy + 4:.1f}' font-size='11' text-anchor='end'>"
                     f"{_html.escape(format_bytes(int(y_max * frac)))}</text>")
    parts.append(f"<text x='{pad_l}' y='{pad_t + h + 14:.1f}' font-size='11'>0 s</text>")
    parts.append(f"<text x='{pad_l + w:.1f}' y='{pad_t + h + 14:.1f}' font-size='11' text-anchor='end'>"
                 f"{t_max:.3g} s since each rank's block began</text>")
    for s in v.timelines:
        color = _COLORS[s.rank % len(_COLORS)]
        # memory is a step function: hold each level until the next point
        steps: list[str] = []
        for i, (t, b) in enumerate(s.points):
            if i:
                steps.append(f"{x(t):.1f},{y(s.points[i - 1][1]):.1f}")
            steps.append(f"{x(t):.1f},{y(b):.1f}")
        pts = " ".join(steps)
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{pts}'>"
                     f"<title>rank {s.rank}</title></polyline>")
        top = max(s.points, key=lambda p: p[1])
        parts.append(f"<circle cx='{x(top[0]):.1f}' cy='{y(top[1]):.1f}' r='3.5' fill='{color}'>"
                     f"<title>rank {s.rank} peak {_html.escape(format_bytes(top[1]))}</title></circle>")
    ranks = sorted({s.rank for s in v.timelines})
    for c in v.collectives:
        if c.rank not in ranks:
            continue
        row = ranks.index(c.rank) % 4
        yy = pad_t + h + 22 + 5 * row
        color = _COLORS[c.rank % len(_COLORS)]
        x0, x1 = x(c.t_start_s), max(x(c.t_end_s), x(c.t_start_s) + 2)
        parts.append(f"<line x1='{x0:.1f}' x2='{x1:.1f}' y1='{yy}' y2='{yy}' stroke='{color}' "
                     f"stroke-width='4'><title>rank {c.rank}: {_html.escape(c.op)}</title></line>")
    legend_x = pad_l
    for r in ranks:  # above the plot, clear of the communication ticks under it
        color = _COLORS[r % len(_COLORS)]
        parts.append(f"<text x='{legend_x}' y='{pad_t - 8}' font-size='11' fill='{color}'>rank {r}</text>")
        legend_x += 56
    if v.collectives:
        parts.append(f"<text x='{pad_l + w:.1f}' y='{height - 4}' font-size='10' text-anchor='end' "
                     "fill='#5a6570'>ticks: communication (one row per rank)</text>")
    parts.append("</svg>")
    return "".join(parts)


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
    """See NOTE [ files are data ] in gradscope.recording: the manifest is checked field by field,
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


# ----------------------------------------------------------------------------------------------
# diagnosis: is one rank's OOM the job's imbalance?
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobFinding:
    """One rank that ran out of memory (or would, against a budget), and why.

    ``pattern`` is ``"imbalance"`` (the rank needs more than the others because its inputs are
    larger, and the others fit) or ``"every_rank"`` (the others need about as much: the step is
    too big everywhere; ``gs.diagnose`` of the rank says what held it).
    """

    rank: int
    pattern: str
    needed_bytes: int
    others_peak_bytes: int
    budget: int | None
    message: str
    suggestion: str


@dataclass(frozen=True)
class JobDiagnosis:
    """The job's out-of-memory ranks, each explained against the other ranks."""

    findings: tuple[JobFinding, ...]
    imbalance: Imbalance | None
    rank_reports: tuple[tuple[int, str], ...]  # (rank, gs.diagnose text) for each failing rank

    def text(self) -> str:
        lines = ["gradscope job diagnosis: " + (f"{len(self.findings)} rank(s) out of memory"
                                                 if self.findings else "no rank ran out of memory")]
        for f in self.findings:
            lines.append(f"  rank {f.rank} [{f.pattern}] {f.message}")
            lines.append(f"     suggestion: {f.suggestion}")
        if self.imbalance is not None:
            lines.append("imbalance: " + self.imbalance.sentence)
        for rank, report in self.rank_reports:
            lines.append(f"--- rank {rank} ---")
            lines.append(report)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _oom(r: Recording) -> Mapping[str, Any] | None:
    if r.oom is not None:
        return r.oom.to_dict()
    if r.error and ("OutOfMemoryError" in r.error or "out of memory" in r.error.lower()):
        return {}
    return None


def diagnose_job(job: Job, budget: int | str | None = None) -> JobDiagnosis:
    """Say which ranks ran out of memory (or, given ``budget``, would: resident bytes plus the
    block's peak above it) and whether it is the job's imbalance: the rank needs more than the
    other ranks peaked at, because its batch or sequence is larger, while the others fit.

    Example:
        >>> import torch, gradscope as gs
        >>> from gradscope.job import Job, RankEntry, RankStatus, diagnose_job
        >>> def run(batch):
        ...     net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))
        ...     x = torch.randn(batch, 64)
        ...     try:
        ...         with gs.record(budget="300KiB") as rec:
        ...             net(x).sum().backward()
        ...     except torch.OutOfMemoryError:
        ...         pass
        ...     return rec.recording
        >>> recs = [run(32), run(128)]
        >>> job = Job(tuple(RankEntry(i, RankStatus.COMPLETE if r.complete else RankStatus.FAILED, r)
        ...                 for i, r in enumerate(recs)))
        >>> [(f.rank, f.pattern) for f in diagnose_job(job).findings]
        [(1, 'imbalance')]
    """
    from gradscope.memory import parse_size

    cap = parse_size(budget)
    complete = {e.rank: e.recording for e in job.ranks
                if e.status is RankStatus.COMPLETE and e.recording is not None and _measured(e.recording)}
    failing: list[tuple[int, Recording, int, int | None]] = []  # rank, recording, bytes needed, budget
    for e in job.ranks:
        r = e.recording
        if r is None:
            continue
        oom = _oom(r) if not r.complete else None
        if oom is not None:
            need = int(oom.get("live", r.peak_bytes) or 0) + int(oom.get("requested", 0) or 0)
            b = oom.get("budget")
            failing.append((e.rank, r, need, int(b) if isinstance(b, int) else cap))
        elif cap is not None and r.baseline_bytes + r.peak_bytes > cap:
            failing.append((e.rank, r, r.peak_bytes, cap - r.baseline_bytes))
    failed_ranks = {f[0] for f in failing}
    findings = []
    reports = []
    for rank, r, need, b in failing:
        others = {k: v for k, v in complete.items() if k not in failed_ranks}
        top = max((v.peak_bytes for v in others.values()), default=0)
        light = min(others, key=lambda k: (others[k].peak_bytes, k)) if others else None
        sizes = _size_differences(r, others[light]) if light is not None else ()
        larger = [s for s in sizes if s.heavy > s.light]
        fits = b is not None and top <= b
        cap_text = "" if b is None else f" of a {format_bytes(b)} budget"
        if light is not None and larger and (fits or (b is None and need > 1.05 * top)):
            why = "; ".join(_size_phrase(s) + f" than rank {light}'s" for s in larger)
            findings.append(JobFinding(
                rank, "imbalance", need, top, b,
                f"needs at least {format_bytes(need)}{cap_text}, while the other ranks peak at most at "
                f"{format_bytes(top)}: {why}.",
                "balance the work per rank: give every rank the same batch size (DistributedSampler "
                "splits a dataset evenly; drop_last=True drops the short last batch), bucket sequences "
                "by length or cap the tokens per rank, or split the largest rank's batch into "
                "micro-batches with gradient accumulation.",
            ))
        else:
            findings.append(JobFinding(
                rank, "every_rank", need, top, b,
                f"needs at least {format_bytes(need)}{cap_text}; the other ranks peak at "
                f"{format_bytes(top)}: not an imbalance between ranks, the step itself is too large.",
                "see this rank's diagnosis below (gs.diagnose(job.recordings[rank])) for what held "
                "the memory and how to shrink it.",
            ))
        try:
            from gradscope.diagnose import diagnose

            reports.append((rank, diagnose(r, namespace={}).text()))
        except Exception as ex:  # a partial recording the per-rank analysis cannot read
            reports.append((rank, f"(no per-rank diagnosis: {type(ex).__name__}: {ex})"))
    v = job_view(job)
    return JobDiagnosis(tuple(findings), v.imbalance, tuple(reports))
