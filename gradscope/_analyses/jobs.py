"""A job's analysis: what every view of a job shows, computed by one pure function
(:func:`job_view`: per-rank rows, the imbalance between ranks, downsampled timelines, the
communication), and which ranks ran out of memory and why (:func:`diagnose_job`).

The job's data is :mod:`gradscope._model.job`; its views (text, payload, pages) read
:func:`job_view` and live in the views layer (:mod:`gradscope._views.job_text`,
:mod:`gradscope._views.job_payload`, :mod:`gradscope._views.job_page`).

Example:
    >>> import torch, gradscope as gs
    >>> from gradscope._model.job import Job, RankEntry, RankStatus
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

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gradscope._base import registry as _views
from gradscope._base.series import downsample
from gradscope._model.job import Job, RankEntry, RankStatus
from gradscope._model.recording import Kind, Recording, format_bytes

__all__ = [
    "CollectiveSpan",
    "Difference",
    "Imbalance",
    "JobDiagnosis",
    "JobFinding",
    "JobView",
    "RankRow",
    "SizeDifference",
    "TimelineSeries",
    "diagnose_job",
    "job_view",
]

_TIMELINE_POINTS = 600  # points kept per rank in the overlaid timeline (peaks always kept)
# Labels of timeline points made while a collective (or the framework code around one) ran: the
# profiler's names for c10d operators, gloo/NCCL kernels, and FSDP's and DDP's record_function
# ranges. See NOTE [ collectives in the job view ].
_COMM_LABEL = re.compile(r"^(c10d::|c10d\.|gloo:|nccl:|nccl::|record_param_comms|FSDP::|fsdp::|"
                         r"DistributedDataParallel)")


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
    in :mod:`gradscope._capture.memory.profiler`). Those are read first (``source`` "captured", ``bytes`` moved).
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
    keep = downsample([v for _, v in raw], _TIMELINE_POINTS)  # see NOTE [ downsampling keeps the peak ]
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
    rank_reports: tuple[tuple[int, str], ...]  # (rank, gs.diagnose text) for each failing rank (from gs.diagnose(job))

    def text(self) -> str:
        """The diagnosis as plain text (its view: ``gradscope._views.job_text``)."""
        return str(_views.render(_views.ViewKind.TEXT, self))

    def __str__(self) -> str:
        return self.text()


def _oom(r: Recording) -> Mapping[str, Any] | None:
    if r.oom is not None:
        return r.oom.to_dict()
    if r.error and ("OutOfMemoryError" in r.error or "out of memory" in r.error.lower()):
        return {}
    return None


def diagnose_job(job: Job, budget: int | str | None = None, *,
                 rank_report: Callable[[Recording], str] | None = None) -> JobDiagnosis:
    """Say which ranks ran out of memory (or, given ``budget``, would: resident bytes plus the
    block's peak above it) and whether it is the job's imbalance: the rank needs more than the
    other ranks peaked at, because its batch or sequence is larger, while the others fit.
    ``rank_report``: each failing rank's own report (``gs.diagnose(job)`` passes its text of the
    rank's recording); without it, ``rank_reports`` is empty.

    Example:
        >>> import torch, gradscope as gs
        >>> from gradscope._model.job import Job, RankEntry, RankStatus
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
    from gradscope._base.units import parse_size

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
        if rank_report is None:
            continue
        try:
            reports.append((rank, rank_report(r)))
        except Exception as ex:  # a partial recording the per-rank analysis cannot read
            reports.append((rank, f"(no per-rank diagnosis: {type(ex).__name__}: {ex})"))
    v = job_view(job)
    return JobDiagnosis(tuple(findings), v.imbalance, tuple(reports))
