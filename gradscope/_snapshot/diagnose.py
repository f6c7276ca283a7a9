"""``gs.diagnose`` of a CUDA memory snapshot: what was live at the OOM by source line, the request
that failed, how fragmented the reserved memory was, and which pattern the trace matches.

Reached from :func:`gradscope.diagnose` for a :class:`~gradscope.snapshot.SnapshotRecording`
(see :func:`gradscope.snapshot.load_snapshot`); everything here reads the allocation-level data
through the pure functions of :mod:`gradscope.snapshot`, so each figure of the report can be
asked for on its own (``bytes_by_line``, ``fragmentation``, ``accumulating_lines``,
``segment_states``).

Patterns:

- ``accumulating``: one line (reached through one stack) keeps allocating memory that is never
  freed, across the whole trace: a list that keeps outputs and with them their autograd graphs,
  a cache that only grows. The outer frames name who keeps calling it.
- ``fragmentation``: the request would have fit in the reserved but unallocated memory plus what
  the device still had, but no free piece was large enough. What ``expandable_segments`` and
  ``max_split_size_mb`` would change is computed on the snapshot's own segments (NOTE [ what the
  allocator settings would change ]).
- ``capacity``: even all free memory together was less than the request: only holding less helps;
  the lines holding most are named.
- ``request_too_large``: the one request is larger than everything the device had left, with
  nothing else counted.
- ``free_piece_fits``: a free piece of the request's stream was large enough: the failure came from
  memory this trace does not show.

Example:
    >>> import gradscope as gs
    >>> fr = [{"filename": "/home/u/train.py", "line": 57, "name": "train_step"}]
    >>> trace = [{"action": "alloc", "addr": i << 21, "size": 2 << 20, "stream": 0, "frames": fr}
    ...          for i in range(40)]
    >>> trace.append({"action": "oom", "size": 64 << 20, "device_free": 0, "stream": 0, "frames": fr})
    >>> seg = {"device": 0, "address": 0, "total_size": 80 << 20, "stream": 0,
    ...        "blocks": [{"address": i << 21, "size": 2 << 20, "requested_size": 2 << 20,
    ...                    "state": "active_allocated", "frames": fr} for i in range(40)]}
    >>> d = gs.diagnose(gs.load_snapshot({"segments": [seg], "device_traces": [trace]}))
    >>> d.request, [f.pattern for f in d.findings]
    (67108864, ['capacity', 'accumulating'])
    >>> print(d.by_line[0])
    train.py:57 train_step: 80.0 MiB in 40 blocks
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from gradscope._snapshot.data import (
    Accumulation,
    Fragmentation,
    LineBytes,
    OomCause,
    SegmentState,
    SnapshotData,
    accumulating_lines,
    bytes_by_line,
    fragmentation,
    group_of,
    is_pytorch_frame,
    segment_size_for,
    segment_states,
    snapshot_data,
)
from gradscope.recording import Recording, format_bytes

__all__ = [
    "LARGE_PAGE",
    "SMALL_PAGE",
    "SMALL_REQUEST",
    "SnapshotDiagnosis",
    "SnapshotFinding",
    "diagnose_snapshot",
    "pageable_bytes",
]

SMALL_REQUEST = 1 << 20  # requests up to 1 MiB are served from the small pool
SMALL_PAGE = 2 << 20  # expandable segments map the small pool in 2 MiB pages
LARGE_PAGE = 20 << 20  # and the large pool in 20 MiB pages

# NOTE [ what the allocator settings would change ]
# PyTorch's caching allocator serves a request from one contiguous free block of one segment of
# the request's stream and pool; a segment goes back to CUDA only when it is entirely free (on an
# OOM the allocator releases those and retries). So free bytes in partly used segments are lost to
# a request larger than their largest piece. The two settings people are told to try change that
# in different ways, and the snapshot's segments at the OOM say whether either would have helped:
# - expandable_segments:True: one segment per stream and pool grows by mapping physical pages
#   (2 MiB in the small pool, 20 MiB in the large one) into a large virtual range, and on an OOM
#   the allocator unmaps the free pages of partly used segments and maps them again where the
#   request needs them. What becomes usable is the free pieces' whole pages plus the device's free
#   bytes (`pageable_bytes`), counted on this snapshot's layout: with the setting the layout
#   differs, so this is an estimate of the same run's state, said so in the text.
# - max_split_size_mb:M: blocks of M MiB or more are never split for requests below M. It helps
#   only when a segment at least as large as the request exists and smaller live blocks split it;
#   with no segment that large there is no large block to keep whole, and the text says so.
# Neither helps a capacity failure: all free memory together is less than the request.


@dataclass(frozen=True)
class SnapshotFinding:
    """One pattern found in a snapshot, with what to do.

    ``bytes`` is what the culprit held at the diagnosed moment; ``key`` the line or stack it is
    about (None for the allocator as a whole).
    """

    pattern: str
    bytes: int
    message: str
    suggestion: str
    code: str = ""
    key: str | None = None


@dataclass(frozen=True)
class SnapshotDiagnosis:
    """What a CUDA snapshot says about its OOM (or its peak, without one).

    ``moment`` is ``"oom"`` or ``"peak"`` (``"empty"`` without allocations); ``at`` its trace
    position. ``by_line`` is what was live then by allocating line, largest first (all of them;
    the text lists ``top``); ``pageable_bytes`` what ``expandable_segments`` could have unmapped
    and used again (None without a request). ``text()`` is deterministic.
    """

    label: str
    device: int
    moment: str
    at: int
    t_s: float | None
    allocated: int
    reserved: int
    request: int | None
    request_stream: int | None
    request_line: str | None
    device_free: int | None
    by_line: tuple[LineBytes, ...]
    fragmentation: Fragmentation
    accumulating: tuple[Accumulation, ...]
    findings: tuple[SnapshotFinding, ...]
    pageable_bytes: int | None
    notes: tuple[str, ...] = ()
    top: int = 8

    def text(self) -> str:
        """The report as plain text."""
        title = "gradscope diagnosis" + (f" of {_one_line(self.label)}" if self.label else "")
        when = "" if self.t_s is None else f", {self.t_s:.3f} s into the trace"
        lines: list[str] = []
        if self.moment == "oom":
            lines.append(f"{title}: CUDA out of memory on cuda:{self.device} at trace event {self.at}{when}")
            req = f"failed request: {_size(self.request)} on stream {self.request_stream}"
            if self.request_line:
                req += f", from {_one_line(self.request_line)}"
            if self.device_free is not None:
                req += f"; the device had {_size(self.device_free)} free"
            lines.append(req)
            moment = "at the OOM"
        elif self.moment == "peak":
            lines.append(f"{title}: no OOM in this CUDA snapshot of cuda:{self.device}; state at its peak, "
                         f"trace event {self.at}{when}")
            moment = "at the peak"
        else:
            lines.append(f"{title}: no allocation in this CUDA snapshot of cuda:{self.device}; nothing to "
                         "diagnose")
            return "\n".join(lines + [f"note: {n}" for n in self.notes])
        f = self.fragmentation
        slack = f.unallocated - f.free_bytes
        lines.append(
            f"{moment}: {_size(self.allocated)} allocated, {_size(self.reserved)} reserved by the caching "
            + (f"allocator: {format_bytes(f.free_bytes)} free in {f.free_pieces} "
               f"piece{'s' if f.free_pieces != 1 else ''} (largest {format_bytes(f.largest_free)})"
               if f.free_pieces else "allocator: no free piece")
            + f" across {f.segments} segment{'s' if f.segments != 1 else ''}"
            + (f", {format_bytes(slack)} rounding inside blocks" if slack > 0 else "")
        )
        if self.by_line:
            lines.append(f"live {moment} by source line:")
            for r in self.by_line[: self.top]:
                lines.append(f"  {_one_line(str(r), 200)}")
            rest = self.by_line[self.top:]
            if rest:
                n = sum(r.blocks for r in rest)
                lines.append(f"  ({len(rest)} other lines: {format_bytes(sum(r.bytes for r in rest))} in {n} "
                             f"block{'s' if n != 1 else ''})")
        if self.findings:
            lines.append("findings:")
            for i, fd in enumerate(self.findings, 1):
                lines.append(f"  {i}. [{fd.pattern}] {_clean(fd.message)}")
                lines.append(f"     suggestion: {_clean(fd.suggestion)}")
                if fd.code:
                    lines.append(f"     code: {_clean(fd.code)}")
        else:
            lines.append("findings: no known pattern; the lines above are where the memory is.")
        lines.extend(f"note: {_one_line(n, 300)}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return "<pre class='gradscope-diagnosis'>" + html.escape(self.text()) + "</pre>"


def diagnose_snapshot(recording: Recording, *, top: int = 8) -> SnapshotDiagnosis:
    """The diagnosis of a recording made by :func:`gradscope.snapshot.load_snapshot` (what
    ``gs.diagnose`` returns for one). ``top``: how many lines the text lists."""
    data = snapshot_data(recording)
    at = data.default_at
    notes = [n for n in recording.notes if n.startswith(("the trace starts mid-run", "no stack frames"))]
    if at < 0 and data.peak_bytes == 0:
        return SnapshotDiagnosis(
            label=recording.label, device=data.device, moment="empty", at=at, t_s=None, allocated=0,
            reserved=data.reserved_bytes(at) if data.events else data.initial_reserved, request=None,
            request_stream=None, request_line=None, device_free=None, by_line=(),
            fragmentation=fragmentation(data, at), accumulating=(), findings=(), pageable_bytes=None,
            notes=tuple(notes), top=top,
        )
    oom = data.oom
    frag = fragmentation(data, at)
    by_line = bytes_by_line(data, at)
    acc = _accumulations(data, at)
    segs = segment_states(data, at)
    pageable = pageable_bytes(segs) if oom is not None else None
    findings: list[SnapshotFinding] = []
    findings.extend(_accumulation_finding(a, data, oom is not None) for a in acc)
    if oom is not None:
        findings.extend(_oom_findings(data, frag, segs, by_line, acc, pageable or 0))
    findings.sort(key=lambda fd: (_ORDER.get(fd.pattern, 9), -fd.bytes))
    return SnapshotDiagnosis(
        label=recording.label, device=data.device, moment="oom" if oom is not None else "peak", at=at,
        t_s=data.t_s(at), allocated=frag.allocated, reserved=frag.reserved,
        request=None if oom is None else oom.requested, request_stream=None if oom is None else oom.stream,
        request_line=None if oom is None or not oom.frames else group_of(oom.frames, "line"),
        device_free=None if oom is None else oom.device_free, by_line=by_line, fragmentation=frag,
        accumulating=acc, findings=tuple(findings), pageable_bytes=pageable, notes=tuple(notes), top=top,
    )


# the cause of the failure first, then what fed it
_ORDER = {"request_too_large": 0, "fragmentation": 0, "free_piece_fits": 0, "capacity": 1, "accumulating": 2}


# ----- accumulation ----------------------------------------------------------------------------
def _accumulations(data: SnapshotData, at: int) -> tuple[Accumulation, ...]:
    """Whole stacks that accumulate (exact: one caller's blocks), then lines that accumulate
    through no single stack (several callers each too few to count)."""
    by_stack = accumulating_lines(data, at, group="stack")
    covered = {group_of(a.frames, "line") for a in by_stack}
    by_line = tuple(a for a in accumulating_lines(data, at, group="line") if a.key not in covered)
    return tuple(sorted(by_stack + by_line, key=lambda a: (-a.bytes, a.key)))


def _accumulation_finding(a: Accumulation, data: SnapshotData, at_oom: bool) -> SnapshotFinding:
    users = [f for f in a.frames if not is_pytorch_frame(f)]
    line = users[0].label if users else group_of(a.frames, "line")
    outer = [f.label for f in users[1:4]]
    callers = f" (called from {' ← '.join(outer)})" if outer else ""
    module_call = any(f.name in ("_call_impl", "_wrapped_call_impl") or f.filename.endswith("/nn/modules/module.py")
                      for f in a.frames)
    what = ("a module's outputs: whatever keeps them (a list of outputs or losses) also keeps their autograd "
            "graphs, with every activation saved for backward" if module_call else
            "memory that is made again and again and never released (a list or cache that only grows)")
    moment = "at the OOM" if at_oom else "at the peak"
    freed = ("none of its allocations was ever freed" if a.freed == 0
             else f"{a.freed} other allocation{'s' if a.freed != 1 else ''} from it "
                  f"{'were' if a.freed != 1 else 'was'} freed")
    message = (
        f"{line}{callers} made {a.blocks} blocks ({format_bytes(a.bytes)}) that were all still alive {moment}, "
        f"allocated across {a.slices_hit} of {a.slices} equal parts of the trace; {freed}: {what}."
    )
    where = outer[0] if outer else line
    if module_call:
        suggestion = (
            f"where {where} keeps the result, keep a number or a detached copy instead (loss.item(), "
            "out.detach()), or run the call under torch.no_grad() when no gradient is needed; or stop keeping "
            "the results (clear the list each step)."
        )
        code = f"# at {where}: results.append(out.detach())  # or loss.item(); or with torch.no_grad(): ..."
    else:
        suggestion = (f"find what keeps the blocks made at {line} alive (a list, dict or cache filled at {where}) "
                      "and clear or bound it each step; keep numbers (.item()) or detached copies instead.")
        code = ""
    return SnapshotFinding("accumulating", a.bytes, message, suggestion, code, a.key)


# ----- the failed request ----------------------------------------------------------------------
def pageable_bytes(segments: tuple[SegmentState, ...]) -> int:
    """Bytes in the whole pages of the segments' free pieces: what ``expandable_segments`` could
    unmap and map again for a request (see NOTE [ what the allocator settings would change ]).
    Pages are counted from each segment's start, 2 MiB in segments of the small pool (2 MiB
    segments), 20 MiB otherwise."""
    total = 0
    for g in segments:
        page = SMALL_PAGE if g.size <= SMALL_PAGE else LARGE_PAGE
        for addr, size in g.free_pieces:
            first = -(-(addr - g.address) // page)  # first whole page inside the piece
            last = (addr + size - g.address) // page
            total += max(0, last - first) * page
    return total


def _oom_findings(data: SnapshotData, frag: Fragmentation, segs: tuple[SegmentState, ...],
                  by_line: tuple[LineBytes, ...], acc: tuple[Accumulation, ...],
                  pageable: int) -> list[SnapshotFinding]:
    oom = data.oom
    assert oom is not None and frag.request is not None
    request = frag.request
    device_free = oom.device_free or 0
    free_total = frag.free_bytes + device_free
    holders = ", ".join(f"{r.key} ({format_bytes(r.bytes)})" for r in by_line[:3])
    if frag.cause is OomCause.FITS:
        return [SnapshotFinding(
            "free_piece_fits", request,
            f"a free piece of {format_bytes(frag.largest_free_on_stream)} on stream {frag.stream} was large "
            f"enough for the {format_bytes(request)} request at that moment: the failure came from memory "
            "this trace does not show (a memory pool of its own, e.g. a CUDA graph's; another process; "
            "NCCL or cuBLAS workspaces).",
            "check torch.cuda.memory_stats() and nvidia-smi for memory outside the caching allocator, and "
            "record the history of every pool (torch.cuda.memory._record_memory_history before the pools "
            "are made).",
        )]
    if frag.cause is OomCause.FRAGMENTATION:
        return [_fragmentation_finding(frag, segs, pageable, device_free)]
    if request > frag.reserved + device_free:
        short = request - free_total
        return [SnapshotFinding(
            "request_too_large", request,
            f"the one request of {_size(request)} is larger than all the device could still give: "
            f"{format_bytes(frag.reserved)} reserved by the allocator (of which {format_bytes(frag.free_bytes)} "
            f"free) and {format_bytes(device_free)} free on the device; it is {format_bytes(short)} more than "
            "all free memory together.",
            f"make the tensor requested at {_request_line(oom)} smaller (a smaller batch or sequence, chunks "
            "processed one at a time, a lower precision), or run on a device with more memory.",
        )]
    need = segment_size_for(request)
    if device_free >= need:
        # the device said it had room for the segment: a cap on this process held it back
        short = request - frag.free_bytes
        device = (f"the device reported {format_bytes(device_free)} free, enough for it: the process's share was "
                  "used up (torch.cuda.set_per_process_memory_fraction, or memory taken outside this allocator)")
    else:
        # releasing that much makes room either way: a free piece the request fits, or a segment
        short = min(request - frag.free_bytes, need - device_free)
        device = f"the device had {format_bytes(device_free)} free"
    if acc:
        kept = sum(a.bytes for a in acc)
        suggestion = (f"the accumulating memory below holds {format_bytes(kept)}"
                      + (f", more than the {format_bytes(short)} that had to be released: releasing it leaves room."
                         if kept >= short else
                         f", less than the {format_bytes(short)} that had to be released: release it, then hold "
                         "less at the lines above."))
    else:
        suggestion = (f"hold less where the memory is: {holders}: a smaller batch, activation checkpointing "
                      "(torch.utils.checkpoint) around the blocks that allocate most, or lower precision "
                      "(torch.autocast).")
    return [SnapshotFinding(
        "capacity", short,
        f"not fragmentation: the free pieces of reserved memory hold {format_bytes(frag.free_bytes)}, less than "
        f"the {format_bytes(request)} request, so the allocator needed a new segment of {format_bytes(need)}, and "
        f"{device}; no allocator setting makes room: at least {format_bytes(short)} had to be released. "
        f"{format_bytes(frag.allocated)} was allocated, most by {holders}.",
        suggestion,
    )]


def _fragmentation_finding(frag: Fragmentation, segs: tuple[SegmentState, ...], pageable: int,
                           device_free: int) -> SnapshotFinding:
    request = frag.request or 0
    stream = frag.stream
    on_stream = frag.largest_free_on_stream or 0
    others = "" if frag.largest_free == on_stream else f" (on any stream: {format_bytes(frag.largest_free)})"
    message = (
        f"the {_size(request)} request did not fit although {format_bytes(frag.free_bytes)} of reserved memory "
        f"was free and the device had {format_bytes(device_free)} free: the free reserved memory is split "
        f"into {frag.free_pieces} pieces across {frag.segments} segment{'s' if frag.segments != 1 else ''}, the "
        f"largest on stream {stream} {format_bytes(on_stream)}{others}. A block must be contiguous inside one segment, and a segment "
        "goes back to CUDA only when it is entirely free."
    )
    # a mapping takes whole pages of the request's pool, from unmapped free pages or from the device
    page = SMALL_PAGE if request <= SMALL_REQUEST else LARGE_PAGE
    from_device = device_free // page * page
    usable = pageable + from_device
    need = -(-request // page) * page
    pages = f"the {format_bytes(need)} of {format_bytes(page)} pages the {format_bytes(request)} request takes"
    verdict = f"enough for {pages}" if usable >= need else f"{format_bytes(need - usable)} short of {pages}"
    expandable = (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts): segments then grow by "
        "mapping pages (2 MiB for blocks up to 1 MiB, 20 MiB above), and on an OOM the allocator unmaps the "
        "free pages of partly used segments and maps them where the request needs them; on this snapshot's "
        f"segments the free pieces hold {format_bytes(pageable)} in whole pages and the device's "
        f"{format_bytes(device_free)} free gives {format_bytes(from_device)} more: {format_bytes(usable)} to map, "
        f"{verdict} (an estimate: with the setting the layout differs)"
    )
    large = [g for g in segs if g.stream == stream and g.size > SMALL_PAGE]
    big = [g for g in large if g.size >= request]
    m = request // (1 << 20)
    splitting = [g for g in big if g.live_blocks]
    if not big:
        largest = max((g.size for g in large), default=0)
        split = (
            "max_split_size_mb would not help here: no segment of stream "
            f"{stream} is as large as the request (the largest is {format_bytes(largest)}), so there is no "
            "large block to keep whole"
        )
        code = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    elif m >= 1 and splitting:
        sizes = ", ".join(format_bytes(g.size) for g in splitting[:4])
        split = (
            f"or max_split_size_mb:{m}: {len(splitting)} segment{'s' if len(splitting) != 1 else ''} of at least "
            f"the request's size ({sizes}) {'are' if len(splitting) != 1 else 'is'} split by smaller live blocks "
            f"({sum(g.live_blocks for g in splitting)} of them, {format_bytes(sum(g.live_bytes for g in splitting))}); "
            f"blocks of {m} MiB or more are then never split for smaller requests, which keeps them whole for "
            "requests like this one (the smaller requests take segments of their own)"
        )
        code = f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # or max_split_size_mb:{m}"
    else:
        split = ("max_split_size_mb would not help here: the segments as large as the request hold no live "
                 "block that splits them")
        code = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    return SnapshotFinding("fragmentation", frag.free_bytes, message, f"{expandable}; {split}.", code)


def _request_line(oom: object) -> str:
    frames = getattr(oom, "frames", ())
    return group_of(frames, "line") if frames else "the failing line"


def _size(n: int | None) -> str:
    """Binary units with the exact bytes in parentheses (under 1 KiB the bytes alone)."""
    if n is None:
        return "n/a"
    return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({n} bytes)"


def _clean(text: str) -> str:
    """Text from a file is data: no newlines or control characters reach the terminal."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _one_line(text: str, limit: int = 160) -> str:
    clean = _clean(text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"
