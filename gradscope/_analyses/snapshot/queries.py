"""Questions about a loaded snapshot, each a pure function of its data: the blocks alive at a moment,
bytes by line, the segments and their fragmentation, the largest live blocks over time and memory
by group over time. :mod:`gradscope.snapshot` is their face."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradscope._analyses.snapshot import replay as _replay
from gradscope._analyses.snapshot.data import SnapshotData, _cols, _group_label, _live_mask, _t_of
from gradscope._analyses.snapshot.frames import Frame, TraceAllocation, _check_group, line_frame
from gradscope._base.errors import GradscopeError
from gradscope._model.recording import format_bytes

__all__ = [
    "Fragmentation",
    "GroupTimeline",
    "LineBytes",
    "LiveBlocksOverTime",
    "OomCause",
    "SegmentState",
    "bytes_by_line",
    "fragmentation",
    "largest_live_blocks",
    "live_blocks",
    "memory_by_group",
    "segment_size_for",
    "segment_states",
    "timeline_of_groups",
]


class OomCause(str, enum.Enum):
    """Why a request did not fit, from the reserved segments at that moment."""

    FRAGMENTATION = "fragmentation"  # enough free bytes in reserved segments, but no block large enough
    CAPACITY = "capacity"  # fewer free reserved bytes than the request, and no new segment from the device
    FITS = "fits"  # a free block was large enough (another pool, or the snapshot is of another moment)
    NO_REQUEST = "no_request"  # no OOM at this moment: figures only


@dataclass(frozen=True)
class Fragmentation:
    """Reserved memory at one moment: how much of it was free, and in which pieces.

    ``unallocated`` = ``reserved - allocated``; ``free_bytes`` the part of it in free pieces (the
    rest is rounding inside live blocks, which no request can use). ``largest_free`` is the
    largest free piece of one segment (any stream); ``largest_free_on_stream`` the largest on the
    request's stream (blocks serve only their own stream). Free pieces are the segments' ranges
    minus the live blocks; a block's size is exact when the snapshot's end state has it, else its
    request rounded up to 512 bytes (``exact`` says whether every live block was exact). The
    cause is FRAGMENTATION when the free pieces together hold the request (a compact layout would
    have served it from reserved memory), CAPACITY when they do not (the allocator needed a new
    segment of :func:`segment_size_for` the request, which the device, or the process's share of
    it, could not give).
    """

    at: int
    allocated: int
    reserved: int
    unallocated: int
    largest_free: int
    largest_free_on_stream: int | None
    free_pieces: int
    segments: int
    request: int | None
    stream: int | None
    device_free: int | None
    cause: OomCause
    exact: bool
    free_bytes: int = 0

    def __str__(self) -> str:
        text = (
            f"reserved {format_bytes(self.reserved)}, allocated {format_bytes(self.allocated)}, "
            f"{format_bytes(self.unallocated)} reserved but unallocated, {format_bytes(self.free_bytes)} of it in "
            f"{self.free_pieces} free pieces (largest {format_bytes(self.largest_free)})"
        )
        if self.request is not None:
            text += f"; request {format_bytes(self.request)}: {self.cause.value}"
        return text


@dataclass(frozen=True)
class SegmentState:
    """One reserved range at one moment: a segment (one cudaMalloc), or the mapped part of an
    expandable segment. ``live_bytes`` are the requested bytes of its ``live_blocks``;
    ``free_pieces`` the (address, size) gaps between them (block sizes as in
    :class:`Fragmentation`)."""

    address: int
    size: int
    stream: int
    expandable: bool
    live_blocks: int
    live_bytes: int
    free_pieces: tuple[tuple[int, int], ...]

    @property
    def free_bytes(self) -> int:
        """Bytes of the segment not covered by a live block."""
        return sum(s for _, s in self.free_pieces)

    @property
    def largest_free(self) -> int:
        """The largest free piece (0 when the segment is full)."""
        return max((s for _, s in self.free_pieces), default=0)


@dataclass(frozen=True)
class LineBytes:
    """Bytes live at one moment from one source line (or another frame group)."""

    key: str
    bytes: int
    blocks: int
    frame: Frame | None

    def __str__(self) -> str:
        return f"{self.key}: {format_bytes(self.bytes)} in {self.blocks} block{'s' if self.blocks != 1 else ''}"


@dataclass(frozen=True)
class GroupTimeline:
    """Allocated bytes over time split by frame group, for a stacked chart.

    ``bytes[g][k]`` is what group ``groups[g]`` held at ``positions[k]`` (exact at each sample);
    the last group is ``"(other)"`` when more groups than ``top`` exist. ``total`` and
    ``reserved`` are the allocated and reserved bytes at each sample.
    """

    group: str
    positions: tuple[int, ...]
    t_s: tuple[float, ...] | None
    groups: tuple[str, ...]
    bytes: tuple[tuple[int, ...], ...]
    total: tuple[int, ...]
    reserved: tuple[int, ...]


def _stack_groups(data: SnapshotData, group: str) -> tuple[torch.Tensor, list[str], list[Frame | None]]:
    """Group index of every stack, the group names, and a representative frame per group."""
    key = f"groups:{group}"
    hit = data._cache.get(key)
    if hit is not None:
        return hit
    names: list[str] = []
    firsts: list[Frame | None] = []
    index: dict[str, int] = {}
    of_stack = []
    for sid in range(len(data.stacks)):
        name = _group_label(data, sid, group)
        g = index.get(name)
        if g is None:
            g = index[name] = len(names)
            names.append(name)
            fr = data.stack_frames(sid)
            firsts.append(line_frame(fr) or (fr[0] if fr else None))
        of_stack.append(g)
    out = (torch.tensor(of_stack, dtype=torch.int64), names, firsts)
    data._cache[key] = out
    return out


# ----- questions about a moment ------------------------------------------------------------
@_replay.on_one_thread
def live_blocks(data: SnapshotData, at: int | None = None, limit: int | None = None) -> tuple[TraceAllocation, ...]:
    """Allocations alive at position ``at`` (default: the OOM, else the peak), largest first,
    with their frames."""
    p = data._at(at)
    t = _cols(data)
    idx = torch.nonzero(_live_mask(t, p)).flatten()
    sizes = t["alloc_size"][idx]
    order = sorted(zip((-sizes).tolist(), idx.tolist(), strict=True))
    if limit is not None:
        order = order[:limit]
    return tuple(data.allocation(i) for _, i in order)


@_replay.on_one_thread
def bytes_by_line(data: SnapshotData, at: int | None = None, group: str = "line",
                  stream: int | None = None) -> tuple[LineBytes, ...]:
    """Bytes alive at ``at`` by allocating source line (or another frame group, see
    :func:`group_of`), largest first: ``train.py:57 train_step: 80.0 MiB in 40 blocks``.
    ``stream`` keeps one stream's allocations only."""
    _check_group(group)
    p = data._at(at)
    t = _cols(data)
    mask = _live_mask(t, p)
    if stream is not None:
        mask &= t["alloc_stream"] == stream
    of_stack, names, firsts = _stack_groups(data, group)
    g = of_stack[t["alloc_stack"][mask]]
    nbytes = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g, t["alloc_size"][mask])
    count = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g, torch.ones_like(g))
    rows = [LineBytes(names[i], b, c, firsts[i]) for i, (b, c) in enumerate(zip(nbytes.tolist(), count.tolist(), strict=True)) if c]
    rows.sort(key=lambda r: (-r.bytes, -r.blocks, r.key))
    return tuple(rows)


def segment_size_for(request: int) -> int:
    """The segment PyTorch's caching allocator asks CUDA for when no cached block serves a
    request: 2 MiB for requests up to 1 MiB (the small pool), 20 MiB up to 10 MiB, else the
    request rounded up to 2 MiB."""
    if request <= 1 << 20:
        return 2 << 20
    if request < 10 << 20:
        return 20 << 20
    return -(-request // (2 << 20)) * (2 << 20)


@_replay.on_one_thread
def segment_states(data: SnapshotData, at: int | None = None) -> tuple[SegmentState, ...]:
    """Every reserved range at ``at`` (default: the OOM, else the peak), by address: its live
    blocks and its free pieces. See :class:`SegmentState`."""
    return _segment_states(data, data._at(at))[0]


def _segment_states(data: SnapshotData, p: int) -> tuple[tuple[SegmentState, ...], bool]:
    """The segments at position ``p`` and whether every live block's size was exact."""
    ranges = _replay.Ranges()
    for a, size, stream, mapped in data.initial_segments:
        ranges.add(a, size, stream, mapped)
    for k in range(len(data.seg_at)):
        if data.seg_at[k] > p:
            break
        ranges.apply(data.seg_kind[k], data.seg_addr[k], data.seg_size[k], data.seg_stream[k])
    t = _cols(data)
    idx = torch.nonzero(_live_mask(t, p)).flatten()
    exact_size = t["alloc_block_size"][idx]
    rounded = (t["alloc_size"][idx] + 511) // 512 * 512
    rounded = torch.where(rounded == 0, 512, rounded)
    # a block's exact size is known only for allocations still alive at the end
    alive_end = t["alloc_free_at"][idx] < 0
    bsize = torch.where((exact_size >= 0) & alive_end, exact_size, rounded)
    exact = bool(((exact_size >= 0) & alive_end).all().item()) if idx.numel() else True
    blocks = sorted(zip(t["alloc_addr"][idx].tolist(), bsize.tolist(), t["alloc_size"][idx].tolist(), strict=True))
    out = []
    bi = 0
    for start, end, stream, is_mapped in ranges.items:
        while bi < len(blocks) and blocks[bi][0] < start:
            bi += 1
        cur = start
        j = bi
        pieces: list[tuple[int, int]] = []
        n_live = live = 0
        while j < len(blocks) and blocks[j][0] < end:
            a, s, req = blocks[j]
            if a > cur:
                pieces.append((cur, a - cur))
            cur = max(cur, a + s)
            n_live += 1
            live += req
            j += 1
        if end > cur:
            pieces.append((cur, end - cur))
        out.append(SegmentState(address=start, size=end - start, stream=stream, expandable=bool(is_mapped),
                                live_blocks=n_live, live_bytes=live, free_pieces=tuple(pieces)))
    return tuple(out), exact


@_replay.on_one_thread
def fragmentation(data: SnapshotData, at: int | None = None) -> Fragmentation:
    """Reserved memory at ``at`` (default: the OOM, else the peak): allocated vs reserved, the
    free pieces inside segments, and whether the OOM's request failed for want of a large
    enough piece (fragmentation) or of bytes (capacity). See :class:`Fragmentation`."""
    p = data._at(at)
    segs, exact = _segment_states(data, p)
    largest: dict[int, int] = {}
    pieces = free = 0
    for g in segs:
        pieces += len(g.free_pieces)
        free += g.free_bytes
        if g.free_pieces:
            largest[g.stream] = max(largest.get(g.stream, 0), g.largest_free)
    allocated = data.live_bytes(p)
    reserved = sum(g.size for g in segs)
    oom = next((o for o in data.ooms if o.at == p), None)
    request = oom.requested if oom is not None else None
    on_stream = largest.get(oom.stream, 0) if oom is not None else None
    largest_any = max(largest.values(), default=0)
    if oom is None or request is None:
        cause = OomCause.NO_REQUEST
    elif (on_stream or 0) >= request:
        cause = OomCause.FITS
    elif free >= request:
        cause = OomCause.FRAGMENTATION
    else:
        cause = OomCause.CAPACITY
    return Fragmentation(
        at=p, allocated=allocated, reserved=reserved, unallocated=reserved - allocated,
        largest_free=largest_any, largest_free_on_stream=on_stream, free_pieces=pieces,
        segments=len(segs), request=request, stream=None if oom is None else oom.stream,
        device_free=None if oom is None else oom.device_free, cause=cause, exact=exact, free_bytes=free,
    )


@dataclass(frozen=True)
class LiveBlocksOverTime:
    """The largest live blocks at each of several moments, for a view that steps through them.

    ``blocks[k]`` are allocation indices (rows of :class:`SnapshotData`'s ``alloc_*`` columns)
    alive at ``positions[k]``, largest first (ties: the earlier allocation first), at most
    ``limit`` of them; ``counts[k]`` how many blocks were alive then in all.
    """

    positions: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    limit: int


@_replay.on_one_thread
def largest_live_blocks(data: SnapshotData, positions: Sequence[int], limit: int = 20) -> LiveBlocksOverTime:
    """The ``limit`` largest allocations alive at each position (exact; see
    :class:`LiveBlocksOverTime`): :func:`live_blocks` for many moments at once."""
    if limit < 1:
        raise GradscopeError("gradscope: largest_live_blocks needs limit >= 1.")
    pos = [data._at(p) for p in positions]
    t = _cols(data)
    n = data.allocations
    blocks: list[tuple[int, ...]] = []
    counts: list[int] = []
    if n == 0:
        return LiveBlocksOverTime(tuple(pos), tuple(() for _ in pos), tuple(0 for _ in pos), limit)
    # one key orders by size, then by index (earlier first), so that ties are deterministic
    index = torch.arange(n, dtype=torch.int64)
    key = t["alloc_size"] * n + (n - 1 - index)
    alloc_at, free_at = t["alloc_at"], t["alloc_free_at"]
    k = min(limit, n)
    # see NOTE [ one thread for the tables ]: rows of positions at a time, a few million cells each
    rows = max(1, (1 << 22) // n)
    pos_t = torch.tensor(pos, dtype=torch.int64)
    for chunk in pos_t.split(rows):
        c = chunk[:, None]
        live = (alloc_at[None, :] <= c) & ((free_at[None, :] < 0) | (free_at[None, :] > c))
        counts.extend(live.sum(1).tolist())
        top = torch.where(live, key[None, :], -1).topk(k, dim=1)
        for vals, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            blocks.append(tuple(i for v, i in zip(vals, idx, strict=True) if v >= 0))
    return LiveBlocksOverTime(tuple(pos), tuple(blocks), tuple(counts), limit)


@_replay.on_one_thread
def memory_by_group(data: SnapshotData, group: str = "line", top: int = 8, points: int = 1000) -> GroupTimeline:
    """Allocated bytes over the trace by frame group, for a stacked chart: ``points`` evenly
    spaced positions plus the peak and every OOM (exact at each). The ``top`` groups are those
    holding most at the peak (OOM when there is one); the rest is ``"(other)"``."""
    _check_group(group)
    if top < 1 or points < 2:
        raise GradscopeError("gradscope: memory_by_group needs top >= 1 and points >= 2.")
    t = _cols(data)
    of_stack, names, _ = _stack_groups(data, group)
    g_all = of_stack[t["alloc_stack"]]
    ranked = [r.key for r in bytes_by_line(data, data.default_at, group)]
    chosen = ranked[:top] if len(ranked) > top else ranked
    if len(chosen) < top:  # fill with groups that never peak together: by total bytes allocated
        total = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g_all, t["alloc_size"])
        for g in torch.argsort(total, descending=True, stable=True).tolist():
            if len(chosen) >= top or total[g] == 0:
                break
            if names[g] not in chosen:
                chosen.append(names[g])
    return timeline_of_groups(data, group, g_all, names, chosen, points)


def timeline_of_groups(data: SnapshotData, group: str, of_alloc: torch.Tensor, names: Sequence[str],
                       chosen: Sequence[str], points: int) -> GroupTimeline:
    """The :class:`GroupTimeline` of any grouping of the allocations: ``of_alloc[i]`` indexes
    ``names`` for allocation ``i``; the groups ``chosen`` get a row each, the rest "(other)".
    Samples as in :func:`memory_by_group`."""
    n = data.events
    base = torch.linspace(0, max(n - 1, 0), steps=min(points, max(n, 1))).round().to(torch.int64)
    extra = torch.tensor([-1, data.peak_at] + [o.at for o in data.ooms], dtype=torch.int64)
    pos = torch.unique(torch.cat([base, extra]))
    t = _cols(data)
    g_all = of_alloc
    chosen = list(chosen)
    slot = torch.full((len(names),), len(chosen), dtype=torch.int64)
    for i, name in enumerate(chosen):
        slot[names.index(name)] = i
    rows = len(chosen) + 1
    P = int(pos.numel())
    start = torch.searchsorted(pos, t["alloc_at"], right=False)
    free = t["alloc_free_at"]
    end = torch.where(free < 0, torch.full_like(free, P), torch.searchsorted(pos, free, right=False))
    row = slot[g_all]
    diff = torch.zeros(rows, P + 1, dtype=torch.int64)
    diff.index_put_((row, start), t["alloc_size"], accumulate=True)
    diff.index_put_((row, end), -t["alloc_size"], accumulate=True)
    grid = torch.cumsum(diff, 1)[:, :P]
    has_other = bool(grid[-1].any().item())
    groups = tuple(chosen) + (("(other)",) if has_other else ())
    grid = grid if has_other else grid[:-1]
    sign = torch.where(t["seg_kind"] % 2 == 0, 1, -1)
    seg_slot = torch.searchsorted(pos, t["seg_at"], right=False)
    rdiff = torch.zeros(P + 1, dtype=torch.int64).index_add_(0, seg_slot, t["seg_size"] * sign)
    reserved = data.initial_reserved + torch.cumsum(rdiff, 0)[:P]
    pos_l = pos.tolist()
    return GroupTimeline(
        group=group, positions=tuple(pos_l),
        t_s=None if data.time_us is None else tuple(_t_of(data, q) for q in pos_l),
        groups=groups, bytes=tuple(tuple(r) for r in grid.tolist()),
        total=tuple(grid.sum(0).tolist()) if len(groups) else tuple(0 for _ in pos_l),
        reserved=tuple(reserved.tolist()),
    )
