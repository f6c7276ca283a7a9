"""A model of PyTorch's CUDA caching allocator (NOTE [ the allocator model ]): the stream of a
step's allocations and frees turned into allocated and reserved bytes. :mod:`gradscope.predict` is
its face.

NOTE [ the allocator model ]: a deliberately small model of PyTorch's CUDA caching allocator:
- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
- larger requests come from the large pool: a request under 10 MiB gets a 20 MiB segment, a larger
  one a segment of its size rounded up to 2 MiB;
- a request takes the smallest free block of its pool that fits (best fit), split when the rest is
  at least 512 bytes (small pool) or more than 1 MiB (large pool); freed blocks merge with free
  neighbours of the same segment; segments are never returned to the device, except that when a
  new segment would not fit in the budget, fully free segments are released and the request is
  tried again (what ``cudaMalloc`` failure handling does) before declaring an out-of-memory.
What it cannot know: workspaces that kernels allocate through the allocator (cuBLAS/cuDNN
workspaces, typically a few MiB to tens of MiB per stream), the GPU's own kernel choices (attention
and dropout take the usual fused kernels for their dtype, see
:func:`gradscope._analyses.predict.kernels._kernel_choices`, but a GPU also decides by its architecture), the CUDA context itself (hundreds of MiB outside the allocator),
other streams, and the segments obtained before the step (the model starts from an empty cache: what
earlier steps reserved, and how fragmented they left it, is not known). Over the alloc/free sequence
of a real CUDA snapshot it reproduces the file's reserved peak (tests/test_snapshot_real.py). On
CPU, the meta run cannot see buffers that kernels allocate internally (convolution, norm and
flash-attention backward); the result's notes say when such ops ran. What a CPU step allocates
outside operator outputs (Python numbers wrapped in tensors, kernels' dtype copies of inputs) is
counted: see NOTE [ bytes no operator output holds ].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

_MB = 1024 * 1024
_MIN_BLOCK = 512  # kMinBlockSize
_SMALL_SIZE = 1 * _MB  # kSmallSize: largest request served by the small pool
_SMALL_BUFFER = 2 * _MB  # kSmallBuffer: small pool segment
_LARGE_BUFFER = 20 * _MB  # kLargeBuffer: segment for large requests under kMinLargeAlloc
_MIN_LARGE_ALLOC = 10 * _MB  # kMinLargeAlloc
_ROUND_LARGE = 2 * _MB  # kRoundLarge


# ----------------------------------------------------------------------------------------------
# the allocator model
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocatorEstimate:
    """What the caching-allocator model says about one stream of allocations.

    Attributes:
        allocated_peak: most bytes in blocks handed out at once (requests rounded to 512 B).
        reserved_peak: most bytes in segments obtained from the device at once.
        segments: segments obtained over the run (small and large pool together).
        out_of_memory: True when a request could not be served within ``capacity`` even after
            releasing every fully free segment.
        oom_request: the rounded size of the request that failed, or None.
        capacity: the device size the model ran against (None: unlimited).
    """

    allocated_peak: int
    reserved_peak: int
    segments: int
    out_of_memory: bool = False
    oom_request: int | None = None
    capacity: int | None = None


class _Block:
    __slots__ = ("seg", "start", "size", "free")

    def __init__(self, seg: _Segment, start: int, size: int, free: bool) -> None:
        self.seg = seg
        self.start = start
        self.size = size
        self.free = free


class _Segment:
    __slots__ = ("size", "small", "blocks")

    def __init__(self, size: int, small: bool) -> None:
        self.size = size
        self.small = small
        self.blocks: list[_Block] = [_Block(self, 0, size, True)]


def _round_size(n: int) -> int:
    return _MIN_BLOCK if n < _MIN_BLOCK else _MIN_BLOCK * -(-n // _MIN_BLOCK)


def _segment_size(n: int) -> int:
    if n <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if n < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return _ROUND_LARGE * -(-n // _ROUND_LARGE)


def estimate_cuda_allocator(
    events: Iterable[tuple[int, int]], capacity: int | None = None
) -> AllocatorEstimate:
    """Replay allocations and frees through a model of the CUDA caching allocator.

    See NOTE [ the allocator model ] in this module for the rules and what they leave out.

    Args:
        events: ``(key, size)`` pairs in time order; ``size > 0`` allocates a tensor storage
            named ``key``, ``size < 0`` frees the storage ``key``.
        capacity: device bytes available to the allocator; None for unlimited.

    Returns:
        The peaks of allocated and reserved bytes; ``out_of_memory`` when ``capacity`` was too small.

    Example:
        >>> e = estimate_cuda_allocator([(1, 100), (2, 3 * 1024 * 1024), (1, -100)])
        >>> e.allocated_peak, e.reserved_peak
        (3146240, 23068672)
    """
    segments: list[_Segment] = []
    live: dict[int, _Block] = {}
    allocated = reserved = 0
    peak_alloc = peak_res = 0
    n_segments = 0
    for key, size in events:
        if size > 0:
            need = _round_size(size)
            small = need <= _SMALL_SIZE
            block = _best_fit(segments, need, small)
            if block is None:
                seg_size = _segment_size(need)
                if capacity is not None and reserved + seg_size > capacity:
                    # cudaMalloc failed: release cached (fully free) segments and try once more.
                    keep = [s for s in segments if not (len(s.blocks) == 1 and s.blocks[0].free)]
                    reserved -= sum(s.size for s in segments) - sum(s.size for s in keep)
                    segments = keep
                    if reserved + seg_size > capacity:
                        return AllocatorEstimate(peak_alloc, peak_res, n_segments, True, need, capacity)
                seg = _Segment(seg_size, small)
                segments.append(seg)
                n_segments += 1
                reserved += seg_size
                peak_res = max(peak_res, reserved)
                block = seg.blocks[0]
            block = _split(block, need)
            live[key] = block
            allocated += block.size
            peak_alloc = max(peak_alloc, allocated)
        elif size < 0:
            block = live.pop(key, None)
            if block is None:
                continue
            allocated -= block.size
            _free(block)
    return AllocatorEstimate(peak_alloc, peak_res, n_segments, False, None, capacity)


def _best_fit(segments: list[_Segment], need: int, small: bool) -> _Block | None:
    best: _Block | None = None
    for seg in segments:
        if seg.small != small:
            continue
        for b in seg.blocks:
            if b.free and b.size >= need and (best is None or b.size < best.size):
                best = b
    return best


def _split(block: _Block, need: int) -> _Block:
    rest = block.size - need
    min_rest = _MIN_BLOCK if block.seg.small else _SMALL_SIZE + 1
    block.free = False
    if rest >= min_rest:
        blocks = block.seg.blocks
        i = blocks.index(block)
        block.size = need
        blocks.insert(i + 1, _Block(block.seg, block.start + need, rest, True))
    return block


def _free(block: _Block) -> None:
    block.free = True
    blocks = block.seg.blocks
    i = blocks.index(block)
    if i + 1 < len(blocks) and blocks[i + 1].free:
        block.size += blocks.pop(i + 1).size
    if i > 0 and blocks[i - 1].free:
        prev = blocks[i - 1]
        prev.size += block.size
        blocks.pop(i)
