"""``gs.predict``: how much memory one step needs, without running a kernel or owning a GPU.

The step runs on copies of its modules and tensors on the ``meta`` device: every operator computes
its output's shape, dtype and strides but no data, so the bytes of every tensor the step creates
are exact while nothing is computed. The same online storage tracker that enforces budgets
(:class:`gradscope.memory.TrackerSource`) counts those bytes; for ``device="cuda"`` a model of the
CUDA caching allocator turns the stream of allocations and frees into allocated and reserved bytes.

NOTE [ why meta and not FakeTensorMode ]: FakeTensorMode pretending to be "cuda" on a CPU-only
build of PyTorch aborts the whole process at the first autograd op (not an exception that can be
caught). The meta device gives the same bytes as FakeTensorMode(cpu) and real CPU runs for MLPs and
encoders, and never touches a device.

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
and dropout take the usual fused kernels for their dtype, see :func:`_kernel_choices`, but a GPU
also decides by its architecture), the CUDA context itself (hundreds of MiB outside the allocator),
other streams, and the segments obtained before the step (the model starts from an empty cache: what
earlier steps reserved, and how fragmented they left it, is not known). Over the alloc/free sequence
of a real CUDA snapshot it reproduces the file's reserved peak (tests/test_snapshot_real.py). On
CPU, the meta run cannot see buffers that kernels allocate internally (convolution, norm and
flash-attention backward); the result's notes say when such ops ran. What a CPU step allocates
outside operator outputs (Python numbers wrapped in tensors, kernels' dtype copies of inputs) is
counted: see NOTE [ bytes no operator output holds ].

Example:
    >>> import torch, gradscope as gs
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> def step(model, x):
    ...     model(x).sum().backward()
    >>> p = gs.predict(step, model, torch.randn(32, 64), device="cpu")
    >>> p.peak_bytes
    25100
    >>> model[0].weight.device.type  # the user's model was never touched
    'cpu'
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope import _compat
from gradscope._compat import storage_key as _storage_key
from gradscope.errors import GradscopeError
from gradscope.memory import parse_size
from gradscope.recording import Recording, Where, format_bytes

__all__ = ["AllocatorEstimate", "BatchResult", "Prediction", "estimate_cuda_allocator", "predict"]

_MB = 1024 * 1024
_MIN_BLOCK = 512  # kMinBlockSize
_SMALL_SIZE = 1 * _MB  # kSmallSize: largest request served by the small pool
_SMALL_BUFFER = 2 * _MB  # kSmallBuffer: small pool segment
_LARGE_BUFFER = 20 * _MB  # kLargeBuffer: segment for large requests under kMinLargeAlloc
_MIN_LARGE_ALLOC = 10 * _MB  # kMinLargeAlloc
_ROUND_LARGE = 2 * _MB  # kRoundLarge

# Operators whose CPU kernels allocate internal buffers that are not operator outputs: the
# tracker (and so the meta device) cannot see them, while the CPU allocator's events can.
_HIDDEN_WORKSPACE_OPS = (
    "convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose",
    "mkldnn",
    "_slow_conv",
    "cudnn",
    "miopen",
    "col2im",
    "im2col",
)

# Operators whose CPU kernels allocate temporaries that are not outputs (measured: layer norm,
# batch norm and group norm backward, CPU flash attention backward).
_INTERNAL_TEMPORARY_OPS = (
    "aten::native_layer_norm_backward",
    "aten::native_batch_norm_backward",
    "aten::native_group_norm_backward",
    "aten::_fused_rms_norm_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)

# operators whose CUDA kernels run through cuBLAS (see the cuBLAS workspace note in ``_run``)
_CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "addmv", "mv", "dot",
                         "_scaled_dot_product_efficient_attention", "_addmm_activation"})

_CUDA_CANNOT_KNOW = (
    "CUDA estimate: a model of the caching allocator (512-byte rounding, 2 MiB small-pool segments, "
    "20 MiB segments for requests under 10 MiB, larger ones rounded to 2 MiB, best-fit reuse); it cannot "
    "know kernel workspaces (cuBLAS/cuDNN), the GPU's own kernel choices (attention and dropout follow "
    "the usual choice for their dtype, but a GPU also decides by its architecture), the CUDA context "
    "outside the allocator, or the segments obtained before the step: it starts from an empty cache, while a "
    "real allocator reuses (and is fragmented by) what earlier steps reserved. Replayed over a real snapshot's "
    "own allocations and frees, it gives that snapshot's reserved peak; without the history of how the cached "
    "segments were obtained it cannot."
)


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


# ----------------------------------------------------------------------------------------------
# the result
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchResult:
    """One batch size tried by ``predict(..., batch_sizes=...)``.

    ``peak_bytes`` is exact tensor bytes; ``allocated`` and ``reserved`` are the allocator model's
    estimates (None for ``device="cpu"``); ``fits`` is None without a budget.
    """

    batch_size: int
    peak_bytes: int
    allocated: int | None
    reserved: int | None
    fits: bool | None


@dataclass(frozen=True, repr=False)
class Prediction(Recording):
    """A :class:`~gradscope.Recording` of the step run on meta tensors, plus the estimate.

    Everything a recording has (graph, saved tensors, timeline; ``peak_bytes`` is the exact
    tensor bytes) plus the fields below, which read ``extra["prediction"]`` so that a saved
    prediction loads back as a plain Recording that still holds them.
    """

    @property
    def _p(self) -> Mapping[str, Any]:
        return self.extra.get("prediction", {})

    @property
    def device(self) -> str:
        """``"cuda"`` or ``"cpu"``: the device the step was predicted for."""
        return str(self._p.get("device", "cpu"))

    @property
    def allocated_bytes(self) -> int | None:
        """Estimated peak of ``torch.cuda.memory_allocated`` during the step, resident tensors
        included (None for CPU)."""
        return self._p.get("allocated_peak_bytes")

    @property
    def reserved_bytes(self) -> int | None:
        """Estimated peak of ``torch.cuda.memory_reserved`` in the step (None for CPU)."""
        return self._p.get("reserved_peak_bytes")

    @property
    def resident_bytes(self) -> int:
        """Bytes of the step's arguments (parameters, gradients, inputs, optimizer state) that are
        on the device before it starts; ``allocated_bytes``/``reserved_bytes`` include them,
        ``peak_bytes`` (memory allocated inside the step) does not."""
        return int(self._p.get("resident_bytes", 0))

    @property
    def budget(self) -> int | None:
        """The device size compared against, or None."""
        return self._p.get("budget")

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the budget (None without one)."""
        return self._p.get("fits")

    @property
    def batches(self) -> tuple[BatchResult, ...]:
        """One row per batch size tried, in the order given."""
        return tuple(BatchResult(**b) for b in self._p.get("batches", ()))

    @property
    def largest_batch(self) -> int | None:
        """The largest batch size tried that fits the budget, or None."""
        return self._p.get("largest_batch")

    def summary(self, top: int = 5) -> str:
        """The prediction's verdict, then the recording's summary."""
        lines = [f"gradscope prediction for {self.device}:"]
        lines.append(
            f"  exact tensor bytes at the peak: {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes)"
        )
        if self.allocated_bytes is not None:
            lines.append(
                f"  estimated CUDA allocated peak: {format_bytes(self.allocated_bytes)} "
                f"({self.allocated_bytes} bytes)"
            )
            lines.append(
                f"  estimated CUDA reserved peak: {format_bytes(self.reserved_bytes)} "
                f"({self.reserved_bytes} bytes)"
            )
        if self.budget is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in the budget of {format_bytes(self.budget)} ({self.budget} bytes)")
        for b in self.batches:
            est = "" if b.reserved is None else f", reserved {format_bytes(b.reserved)}"
            fit = "" if b.fits is None else ("  fits" if b.fits else "  too big")
            lines.append(f"  batch {b.batch_size:>6}: tensors {format_bytes(b.peak_bytes)}{est}{fit}")
        if self.batches and self.budget is not None:
            lines.append(f"  largest batch that fits: {self.largest_batch}")
        return "\n".join(lines) + "\n" + super().summary(top=top)

    def __repr__(self) -> str:
        fit = "" if self.fits is None else (", fits" if self.fits else ", does not fit")
        est = "" if self.reserved_bytes is None else f", reserved~{self.reserved_bytes}"
        return f"Prediction({self.device}: peak_bytes={self.peak_bytes}{est}{fit})"


# ----------------------------------------------------------------------------------------------
# predict
# ----------------------------------------------------------------------------------------------
def predict(
    fn: Callable[..., Any],
    *args: Any,
    device: str = "cuda",
    budget: int | str | None = None,
    batch_sizes: Sequence[int] | None = None,
    make_args: Callable[[int], Any] | None = None,
    label: str = "",
) -> Prediction:
    """Predict the memory of one step ``fn(*args)`` by running it on the meta device.

    Modules, tensors and optimizers among ``args`` (also inside lists, tuples and dicts) are
    copied to the meta device first; the originals are never touched and no data is copied. The
    copy runs under the same recorder as ``gs.record``, so the result is a full recording.

    Args:
        fn: one step, forward and backward (and optimizer step if you like).
        *args: what ``fn`` takes.
        device: ``"cuda"`` adds the caching-allocator estimate; ``"cpu"`` gives exact tensor bytes,
            which equal ``gs.record(memory="cpu")``'s ``peak_bytes`` for the real CPU step except
            where kernels allocate internal buffers (convolution, norm and flash-attention
            backward; a note says so). Either way attention and dropout take the device's kernels
            and gradients accumulate in place as the engine does (see :func:`_kernel_choices` and
            NOTE [ observers change gradient accumulation ]).
        budget: device size (``"8GiB"`` or bytes) to check against, for the step's resident
            tensors (parameters, gradients, inputs, optimizer state) plus what it allocates: on
            CUDA the allocator model is replayed against this capacity; on CPU the exact bytes are
            compared. Default on CUDA: the current GPU's total memory when a GPU is present.
        batch_sizes: batch sizes to try. Without ``make_args``, every tensor among ``args`` whose
            first dimension equals the first tensor argument's first dimension is resized along
            it (modules' parameters are never resized). The result also says the largest that fits.
        make_args: ``make_args(batch_size) -> tuple of args`` (or one arg), called under
            ``torch.device("meta")`` so that factory calls make no data; use instead of ``args``.
            Without ``args``, the returned recording is the largest fitting batch (else the first).
        label: a name for the recording.

    Returns:
        A :class:`Prediction` (a Recording): ``peak_bytes`` exact, ``allocated_bytes`` and
        ``reserved_bytes`` estimated for CUDA, ``fits``, ``batches``, ``largest_batch``, and notes
        on what the estimate cannot see.

    Raises:
        GradscopeError: a bad device or budget, or a step that cannot run on meta tensors (it reads
            values: ``.item()``, ``.tolist()``, data-dependent shapes or control flow).

    Example:
        >>> import torch, gradscope as gs
        >>> model = torch.nn.Linear(1024, 1024)
        >>> def step(model, x):
        ...     model(x).square().mean().backward()
        >>> p = gs.predict(step, model, torch.randn(8, 1024), budget="64MiB", batch_sizes=[8, 1024, 4096])
        >>> [b.fits for b in p.batches], p.largest_batch
        ([True, True, False], 1024)
    """
    if device not in ("cuda", "cpu"):
        raise GradscopeError(f"gradscope: predict(device={device!r}): use device='cuda' or device='cpu'.")
    if not callable(fn):
        raise GradscopeError(
            f"gradscope: predict's first argument must be the step function, got {type(fn).__name__}."
        )
    cap = parse_size(budget)
    if cap is None and device == "cuda" and torch.cuda.is_available():
        cap = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if make_args is not None and not callable(make_args):
        raise GradscopeError("gradscope: make_args must be a function make_args(batch_size) -> args.")
    if make_args is None and not args and batch_sizes:
        raise GradscopeError("gradscope: batch_sizes needs args to resize or make_args(batch_size).")
    if batch_sizes is not None:
        if isinstance(batch_sizes, int) or not all(isinstance(b, int) and b > 0 for b in batch_sizes):
            raise GradscopeError("gradscope: batch_sizes must be a list of positive ints, e.g. [8, 16, 32].")

    names = _module_names(args, sys._getframe(1))
    rows: list[dict[str, Any]] = []
    runs: list[tuple[int, Recording, dict[str, Any]]] = []
    if batch_sizes:
        dim = _batch_dim(args) if make_args is None else None
        if make_args is None and dim is None:
            raise GradscopeError(
                "gradscope: batch_sizes: no tensor with a first dimension among args; pass "
                "make_args=lambda b: (...) to say how a batch of size b is built."
            )
        for b in batch_sizes:
            bargs = _make(make_args, b) if make_args is not None else _resize(args, dim, b)
            rec, est = _run(fn, bargs, device, cap, label or f"batch {b}", names)
            rows.append(
                {
                    "batch_size": b,
                    "peak_bytes": rec.peak_bytes,
                    "allocated": est.get("allocated_peak_bytes"),
                    "reserved": est.get("reserved_peak_bytes"),
                    "fits": est.get("fits"),
                }
            )
            runs.append((b, rec, est))
    fitting = [r["batch_size"] for r in rows if r["fits"]]
    largest = max(fitting) if fitting else None
    if args or not runs:
        rec, est = _run(fn, args, device, cap, label, names)
    else:
        pick = largest if largest is not None else runs[0][0]
        _, rec, est = next(r for r in runs if r[0] == pick)
    est["batches"] = rows
    est["largest_batch"] = largest
    extra = dict(rec.extra)
    extra["prediction"] = est
    return Prediction(
        **{f.name: getattr(rec, f.name) for f in dataclasses.fields(Recording)} | {"extra": extra}
    )


def _run(
    fn: Callable[..., Any],
    args: Any,
    device: str,
    cap: int | None,
    label: str,
    names: dict[int, str] | None = None,
) -> tuple[Recording, dict[str, Any]]:
    from gradscope.record import record

    meta_args, memo = _to_meta(args)
    # module paths start with the caller's names for the models it passed (``G.1``)
    modules = {n: memo[i] for i, n in (names or {}).items() if isinstance(memo.get(i), nn.Module)}
    del memo
    resident = _resident_bytes(meta_args)
    rec = record(memory="tracker", label=label, modules=modules or None, tracker_device="meta")
    outside = torch.get_default_device()
    try:
        # Factory calls inside the step (torch.zeros, torch.arange) make meta tensors too, except
        # inside optimizer steps: see NOTE [ optimizer steps keep the default device ].
        with (
            rec,
            torch.device("meta"),
            _kernel_choices(device),
            _AsOnTheDevice(rec, device) as device_mode,
            _optimizer_steps_on(outside, functools.partial(_count_cpu, rec) if device == "cpu" else None),
        ):
            _TARGET.autocast = None
            fn(*meta_args)
            if getattr(_TARGET, "autocast", None):  # the step caught the refusal: see NOTE [ autocast is refused by name ]
                raise GradscopeError(_autocast_message(_TARGET.autocast))
            device_mode.settle()
    except GradscopeError:
        raise
    except Exception as e:
        first = _first_cause(e)
        if isinstance(first, GradscopeError):
            raise first from None
        after = "" if first is e else f"; while handling it, the step raised {type(e).__name__}: {e}"
        raise GradscopeError(
            f"gradscope: the step could not run on meta tensors ({type(first).__name__}: {first}{after}). "
            "Prediction runs without data: code that reads values (.item(), .tolist(), printing tensors, "
            "data-dependent shapes or if/while on tensor values) cannot be predicted; move it out of "
            "the step, or measure a real run with gs.record()."
        ) from e
    finally:
        del meta_args
    r = rec.recording
    assert r is not None
    # The step's own tensors (parameters, gradients, inputs, optimizer state) are on the device
    # before it starts: the allocator model takes them first, under keys of their own.
    events = [(-1 - i, n) for i, n in enumerate(resident)]
    moves = [(a.alloc_at, a.index, a.bytes) for a in r.allocations]
    moves += [(a.free_at, a.index, -a.bytes) for a in r.allocations if a.free_at is not None]
    events += [(index, size) for _, index, size in sorted(moves)]
    notes = list(r.notes)
    if device_mode.on_cpu:
        notes.append(
            "ops whose meta kernels reject what the CPU kernel takes (" + ", ".join(sorted(device_mode.on_cpu))
            + "): their outputs' shapes and strides came from the CPU kernel run on zero-filled copies of "
            "their inputs (see NOTE [ meta kernels stricter than the CPU's ] in gradscope.predict)."
        )
    ops = sorted({a.label for a in r.allocations})
    hidden = [o for o in ops if any(h in o for h in _HIDDEN_WORKSPACE_OPS)]
    if hidden:
        notes.append(
            "convolution ops present (" + ", ".join(hidden[:4]) + "): their kernels allocate internal "
            "workspaces that meta tensors cannot show; the real run will peak higher than this estimate."
        )
    temps = [o for o in ops if o in _INTERNAL_TEMPORARY_OPS]
    if temps:
        notes.append(
            "ops whose CPU kernels allocate internal temporaries (" + ", ".join(temps[:4]) + "): "
            "meta tensors cannot show them; if the peak falls inside one of them the real CPU run "
            "peaks higher (by up to about one activation of that layer)."
        )
    if device_mode.unseen:
        notes.append(
            "CPU: counted what the real step allocates outside any operator output and meta tensors do not "
            "(see NOTE [ bytes no operator output holds ] in gradscope.predict): "
            + "; ".join(f"{what}: {n} ({b} bytes in all)"
                        for what, (n, b) in sorted(device_mode.unseen.items()))
            + "."
        )
    if device == "cuda" and any(o.split("::")[-1] in _CUBLAS_OPS for o in ops):
        backward = any(a.step is not None for a in r.allocations)
        notes.append(
            "cuBLAS workspace not counted: each thread that runs matmuls on a CUDA stream takes one from the "
            "caching allocator at its first matmul and keeps it (the step's thread"
            + (", and the autograd engine's device thread that runs backward: two here" if backward else ": one here")
            + "); its size is set by CUBLAS_WORKSPACE_CONFIG (PyTorch's default is a few MiB, larger on Hopper "
            "GPUs): add it to allocated_bytes and reserved_bytes."
        )
    if any("scaled_dot_product" in o for o in ops):
        notes.append(
            "attention: the meta run used the fused kernel the "
            + device.upper()
            + " would choose "
            + (
                "(asked from the CPU's own choice function)."
                if device == "cpu"
                else "(flash for float16/bfloat16 without a mask, memory-efficient otherwise); the GPU's own "
                "choice also depends on its architecture."
            )
        )
    est: dict[str, Any] = {
        "device": device,
        "exact_peak_bytes": r.peak_bytes,
        "budget": cap,
        "resident_bytes": sum(resident),
        "allocated_peak_bytes": None,
        "reserved_peak_bytes": None,
        "fits": None,
    }
    reserved = None
    if device == "cuda":
        free_run = estimate_cuda_allocator(events)
        est["allocated_peak_bytes"] = free_run.allocated_peak
        est["reserved_peak_bytes"] = reserved = free_run.reserved_peak
        est["segments"] = free_run.segments
        if cap is not None:
            est["fits"] = not estimate_cuda_allocator(events, capacity=cap).out_of_memory
        notes.append(_CUDA_CANNOT_KNOW)
    elif cap is not None:
        est["fits"] = sum(resident) + r.peak_bytes <= cap
    notes.append("predicted on the meta device: tensor bytes are exact; nothing was computed.")
    where = Where(
        device=f"{device} (predicted on meta)",
        memory_source="meta tracker" + (" + caching-allocator model" if device == "cuda" else ""),
        torch_version=r.where.torch_version,
        hostname=r.where.hostname,
    )
    r = dataclasses.replace(
        r,
        notes=tuple(notes),
        where=where,
        reserved_peak_bytes=reserved,
        device_total_bytes=cap if device == "cuda" else None,
    )
    return r, est


# NOTE [ counted as a budget counts ]: the diagnosis measures a fix's memory on meta copies to
# say whether it fits a simulated budget, which the tracker enforces on the real run. Under the
# tracker (a Python dispatch mode) the engine sums gradients out of place and PyTorch's wrapped
# Python numbers are not seen (see NOTE [ observers change gradient accumulation ] and NOTE [ bytes
# no operator output holds ]): a run on meta counted the same way leaves out both corrections
# ``predict`` makes for a plain run, so that its peak is the tracker's peak of the real run.
@contextlib.contextmanager
def counted_on_meta(device: str, source: Any) -> Iterator[None]:
    """Code run inside runs on meta tensors (factory calls included) as on ``device``'s kernels,
    its allocations counted by ``source`` (a started :class:`gradscope.memory.TrackerSource` for
    ``"meta"``) as the tracker counts a real run of it (see NOTE [ counted as a budget counts ]):
    the optimizers' step counters, real CPU tensors, count for ``device="cpu"``."""

    def count(inside: bool) -> None:
        source.also_device_type = "cpu" if inside else None

    outside = torch.get_default_device()
    with (
        torch.device("meta"),
        _kernel_choices(device),
        _AsOnTheDevice(None, device),
        _optimizer_steps_on(outside, count if device == "cpu" else None),
    ):
        yield


def _first_cause(e: BaseException) -> BaseException:
    """The first exception of the chain ``e`` ends (``__cause__``, else ``__context__``): a framework
    that fails while tearing down after the step's own error (Lightning's ``fit``) raises its own,
    and the step's is the one that says why it could not run."""
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or e.__context__
        if nxt is None or id(nxt) in seen:
            return e
        seen.add(id(nxt))
        e = nxt


@contextlib.contextmanager
def _kernel_choices(device: str) -> Iterator[None]:
    """On meta tensors, attention and dropout take the kernels the target device would take.

    ``scaled_dot_product_attention`` asks a per-device function which fused kernel to use; the
    meta device has none, so it always takes the unfused math path, which saves the whole attention
    matrix. While a prediction runs, ``torch.nn.functional.scaled_dot_product_attention`` (the
    name ``nn.MultiheadAttention`` and user code call) chooses as the target would and calls that
    kernel's meta implementation:

    - ``"cpu"``: the CPU's own choice function, run on stand-ins of the same shapes and dtypes that
      hold one row of memory each; when it says flash, the CPU flash kernel (it saves the output
      and a log-sum-exp);
    - ``"cuda"``: flash attention for float16/bfloat16 without a mask (head size a multiple of 8,
      at most 256), else memory-efficient attention (head size a multiple of 8), else the math
      path; the GPU's own choice also depends on its architecture, which a prediction cannot see.

    For ``"cuda"``, ``torch.nn.functional.dropout`` in training takes the fused kernel a GPU uses
    (``native_dropout``, which saves a one-byte mask) instead of the CPU path (a float mask).
    Calls from other threads, or with tensors that are not on meta, go to the originals unchanged.

    NOTE [ patching the attention function ]: a TorchFunctionMode cannot do this: modes are off
    while their handler runs, so attention called inside a Python-level function that the mode
    handled (``multi_head_attention_forward``) would never reach it.
    """
    import torch.nn.functional as F  # noqa: N812

    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            originals: dict[str, Any] = {"sdpa": F.scaled_dot_product_attention, "dropout": F.dropout,
                                         "autocast": torch.amp.autocast_mode.autocast.__init__}
            _ORIGINALS.append(originals)
            F.scaled_dot_product_attention = _patched_sdpa(originals["sdpa"])
            F.dropout = _patched_dropout(originals["dropout"])
            torch.amp.autocast_mode.autocast.__init__ = _refused_autocast(originals["autocast"])  # type: ignore[method-assign]
        _PATCH_DEPTH += 1
    previous = getattr(_TARGET, "device", None)
    _TARGET.device = device
    try:
        yield
    finally:
        _TARGET.device = previous
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                originals = _ORIGINALS.pop()
                F.scaled_dot_product_attention = originals["sdpa"]
                F.dropout = originals["dropout"]
                torch.amp.autocast_mode.autocast.__init__ = originals["autocast"]  # type: ignore[method-assign]


def _patched_sdpa(original: Any) -> Any:
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        device = getattr(_TARGET, "device", None)
        out = None if device is None else _attention_on_meta(device, *args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


# NOTE [ autocast is refused by name ]: autocast casts only tensors of its own device, so on meta
# tensors it casts nothing, and on a CPU-only build ``torch.autocast("cuda")`` turns itself off with a
# warning: a prediction of an autocast step would silently be float32's (measured on three real GPU
# files: 0.81-1.10 of the real peak). So a prediction refuses a step that enters an enabled
# ``torch.autocast`` (``torch.amp.autocast``, ``torch.cuda.amp.autocast``, as a decorator too),
# naming it, in the thread that predicts: a :class:`GradscopeError` raised where it is entered, and
# again after the step if the step caught it.
def _refused_autocast(original: Any) -> Any:
    def __init__(self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
        if getattr(_TARGET, "device", None) is not None and enabled:
            name = f"torch.autocast({device_type!r}" + (f", dtype={dtype}" if dtype is not None else "") + ")"
            _TARGET.autocast = name
            raise GradscopeError(_autocast_message(name))
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    __init__.__doc__ = original.__doc__
    return __init__


def _autocast_message(name: str) -> str:
    return (f"gradscope: the step runs under {name}, which a prediction cannot apply: autocast casts only "
            "tensors of its own device, none of the meta tensors a prediction runs on (and on a build "
            "without CUDA, torch.autocast('cuda') turns itself off), so its numbers would be float32's. "
            "Predict the step without autocast for its float32 memory, or measure a real run with gs.record() "
            "on the device.")


def _patched_dropout(original: Any) -> Any:
    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if (
            getattr(_TARGET, "device", None) == "cuda"
            and isinstance(input, torch.Tensor)
            and input.device.type == "meta"
            and training
            and 0 < p < 1
            and not inplace
        ):
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    dropout.__doc__ = original.__doc__
    return dropout


class _AsOnTheDevice(_compat.torch_dispatch_mode()):  # type: ignore[misc]
    """Ops on meta tensors made to behave as the target device's kernels do.

    Three corrections, each with its NOTE:

    - gradient accumulation in place, as the engine does it without observers (NOTE [ observers
      change gradient accumulation ]);
    - outputs laid out as the device kernels lay them out where a meta kernel differs (NOTE [ meta
      layouts that differ from the device's ]);
    - ops whose meta kernel rejects what the CPU kernel takes (NOTE [ meta kernels stricter than
      the CPU's ]).

    NOTE [ observers change gradient accumulation ]: when two gradients reach one input, the
    engine adds the second into the first in place if it holds the only reference to the first;
    a tensor that has been seen from Python (as every output is under a dispatch mode) has one
    more, so under any Python dispatch mode the engine allocates a new tensor for the sum instead
    (measured: a no-op mode raises the peak of an attention input projection from 704 KiB to
    832 KiB). The prediction undoes that: an ``add`` the engine makes between one node's post hook
    and the next node's pre hook (the recorder knows that window) with grad mode off runs as the
    in-place ``add_`` the engine would have used.

    NOTE [ meta layouts that differ from the device's ]: a meta kernel that gives an output other
    strides than the device kernel changes what later ops do: a ``reshape`` of it copies where the
    device's is a view. Measured on torch 2.13: ``native_layer_norm_backward`` with a
    non-contiguous ``grad_out`` (Swin's windows) returns ``grad_input`` with ``grad_out``'s strides
    on meta, contiguous on CPU and CUDA (both kernels write into an ``empty_like`` of the
    contiguous input), and the prediction of a Swin step was 4 KiB high, one extra copy in a
    ``ViewBackward0``. Such outputs (:data:`_DEVICE_CONTIGUOUS`) are given the device's strides
    in place: same storage, no allocation.

    NOTE [ meta kernels stricter than the CPU's ]: some meta kernels check the rules of the CUDA
    kernel: ``_grouped_mm`` (``F.grouped_mm``, Mixtral's experts in transformers) demands
    bfloat16 on meta while the CPU kernel takes float32. For ``device="cpu"`` such an op (all of
    its tensors on meta, functional, its output shape not data-dependent) runs once more as the
    CPU kernel on zero-filled CPU tensors of the same shapes, strides and dtypes, and its outputs
    are made on meta with the CPU outputs' shapes, strides and dtypes: exact bytes, at the cost of
    that op's inputs and outputs in CPU memory for a moment. The ops are listed in a note. For
    ``device="cuda"``, where the meta kernel stands for the GPU's, the rejection is reported as
    what it is (a :class:`GradscopeError` naming the op).
    """

    def __init__(self, recorder: Any, device: str) -> None:
        # recorder None: counted as the tracker counts a real run (see NOTE [ counted as a budget
        # counts ]): neither correction that needs the recorder applies
        super().__init__()
        self._rec = recorder
        self._device = device
        self.on_cpu: set[str] = set()  # ops run by the CPU kernel (NOTE [ meta kernels stricter ... ])
        # NOTE [ bytes no operator output holds ]: how many of each were counted, and their bytes
        self.unseen: dict[str, list[int]] = {}
        self._saved: list[tuple[Any, int, int]] = []  # (weak ref to the op's output, key, bytes)

    def _source(self) -> Any:
        src = self._rec.memory_source if self._device == "cpu" and self._rec is not None else None
        return src if hasattr(src, "count_unseen") else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        src = self._source()
        if src is None:
            return self._dispatch(func, args, kwargs)
        if self._saved:
            self.settle()
        unseen = _unseen_on_cpu(func, args, kwargs)
        begun: list[tuple[int, int]] = []
        kept: list[tuple[int, int]] = []
        try:
            for nbytes, what in unseen:
                key = src.count_unseen(nbytes, f"{_label(func)} ({what})")
                (kept if what == _SAVED_NUMBER else begun).append((key, nbytes))
                row = self.unseen.setdefault(what, [0, 0])
                row[0] += 1
                row[1] += nbytes
            out = self._dispatch(func, args, kwargs)
        except BaseException:
            begun += kept
            raise
        finally:
            for key, nbytes in reversed(begun):
                src.end_unseen(key, nbytes)
        if kept:
            first = next((t for t in _flat([out]) if isinstance(t, torch.Tensor)), None)
            ref = None if first is None else weakref.ref(first)
            self._saved += [(ref, key, nbytes) for key, nbytes in kept]
        return out

    def settle(self) -> None:
        """Tie each Python number saved for backward to the node that saved it (known once
        autograd has set the op's output's ``grad_fn``, by the next op): its bytes end when that
        node's backward has run, as the engine then releases the node's saved tensors."""
        src = self._source()
        pending, self._saved = self._saved, []
        if src is None:
            return
        for ref, key, nbytes in pending:
            t = None if ref is None else ref()
            node = None if t is None else t.grad_fn
            if node is None:
                src.end_unseen(key, nbytes)
            else:
                node.register_hook(_EndAfterBackward(src, key, nbytes))

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        if (
            func is torch.ops.aten.add.Tensor
            and not kwargs
            and len(args) == 2
            and self._rec is not None
            and self._rec.between_nodes()  # between a node's post hook and the next node's pre hook
            and not torch.is_grad_enabled()
            and all(isinstance(a, torch.Tensor) for a in args)
            and args[0].shape == args[1].shape
            and args[0].dtype == args[1].dtype
            and _dense(args[0])
        ):
            return torch.ops.aten.add_.Tensor(args[0], args[1])
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:  # NotImplementedError (no meta kernel) is one too
            if not _cpu_can_stand_in(func, args, kwargs):
                raise
            if self._device != "cpu":
                raise GradscopeError(
                    f"gradscope: PyTorch's meta kernel for {func} rejects this step's inputs "
                    f"({type(e).__name__}: {e}); the meta kernel checks the GPU kernel's rules, so the "
                    "real step may fail on the GPU too. Predict with device='cpu' (the CPU kernel runs "
                    "such ops), or measure a real run with gs.record()."
                ) from e
            out = self._on_cpu(func, args, kwargs, e)
        fix = _DEVICE_CONTIGUOUS.get(func)
        if fix is not None:
            outs = out if isinstance(out, tuple) else (out,)
            for i in fix:
                t = outs[i]
                if isinstance(t, torch.Tensor) and t.device.type == "meta" and not t.is_contiguous():
                    t.as_strided_(t.shape, _contiguous_strides(t.shape))
        return out

    def _on_cpu(self, func: Any, args: Any, kwargs: Any, error: Exception) -> Any:
        """See NOTE [ meta kernels stricter than the CPU's ]."""

        def zeros(t: torch.Tensor) -> torch.Tensor:
            span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
            return torch.zeros(span, dtype=t.dtype, device="cpu").as_strided(tuple(t.shape), tuple(t.stride()))

        def cpu_version(o: Any) -> Any:
            if isinstance(o, torch.Tensor):
                return zeros(o)
            if isinstance(o, list | tuple):
                return type(o)(cpu_version(v) for v in o)
            return o

        try:
            with torch.no_grad():
                cpu_out = func(*cpu_version(list(args)), **{k: cpu_version(v) for k, v in kwargs.items()})
        except Exception:
            raise error from None  # the CPU kernel rejects it too: the step's own error
        self.on_cpu.add(str(func.name()) if hasattr(func, "name") else str(func))

        def meta_version(o: Any) -> Any:
            if isinstance(o, torch.Tensor):
                return torch.empty_strided(tuple(o.shape), tuple(o.stride()), dtype=o.dtype, device="meta")
            if isinstance(o, list | tuple):
                return type(o)(meta_version(v) for v in o)
            return o

        return meta_version(cpu_out)


class _EndAfterBackward:
    """A node's post hook that ends a saved Python number's bytes (once): see NOTE [ bytes no
    operator output holds ]."""

    def __init__(self, src: Any, key: int, nbytes: int) -> None:
        self._src: Any = weakref.ref(src)
        self._key = key
        self._nbytes = nbytes

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        src = self._src()
        if src is not None and self._nbytes:
            src.end_unseen(self._key, self._nbytes)
        self._nbytes = 0


# Outputs whose device kernels (CPU and CUDA) are contiguous whatever the meta kernel says: see
# NOTE [ meta layouts that differ from the device's ].
_DEVICE_CONTIGUOUS: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.native_layer_norm_backward.default: (0,),
}


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(int(size), 1)
    return tuple(reversed(strides))


def _cpu_can_stand_in(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether a CPU run on zero-filled tensors gives ``func``'s exact output layout: a functional
    op whose outputs' shapes do not depend on values, with every tensor of it on meta."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False
    tags = set(getattr(func, "tags", ()))
    if any(getattr(torch.Tag, n, None) in tags for n in ("dynamic_output_shape", "data_dependent_output")):
        return False
    tensors = [a for a in _flat([list(args), dict(kwargs)]) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)  # no CPU kernel: the CPU run says so


# NOTE [ bytes no operator output holds ]: on CPU, three kinds of allocation are made where no
# dispatch mode sees an operator output, and on meta none of them is made at all (measured with
# the profiler's allocation events, torch 2.13):
# - a Python number passed where an operator takes a Tensor (``exp_avg_sq.mul_(beta2)``,
#   ``x / 2``) is wrapped into a 0-dim tensor by PyTorch's argument parser, outside any operator:
#   double and int64 8 bytes, complex 16, bool 1; a dispatch mode receives it back as the Python
#   number, in a Tensor slot of the schema. It dies when the op returns, except that autograd keeps
#   ``mul``'s and ``div``'s ``other`` (without passing it through saved-tensor hooks) until the
#   node's backward has run: ``x / math.sqrt(d)`` in attention holds 8 bytes until backward reaches
#   it (counted until the node's post hook; a graph freed without backward keeps them counted to
#   the end of the block). The ``.Scalar`` overloads of the binary and comparison
#   ops (``div_.Scalar`` in dropout, ``mul.Scalar`` in backward formulas) wrap their number the
#   same way inside the CPU kernel, and the CPU ``mean`` divides by the element count as a wrapped
#   int64 (``sum(...).div_(n)``);
# - the CPU's TensorIterator binary and comparison kernels copy every input whose dtype is not the
#   op's common dtype before allocating the output (``.to(common)``): a wrapped double becomes a
#   4-byte float32, a bool mask multiplied into float32 becomes a float32 mask of its size; an
#   in-place op whose own dtype is not the common one also computes into a temporary of it;
# - the step counters of optimizers (see NOTE [ optimizer steps keep the default device ]).
# For ``device="cpu"`` each of the first two is counted as alive for the duration of its op
# (:func:`_unseen_on_cpu`) and the counters are counted as CPU tensors, so that the prediction
# matches the CPU allocator's events. On a GPU, wrapped numbers live in CPU memory and kernels
# read them as scalars: nothing is counted for ``device="cuda"``.
_NUMBER_DTYPES: tuple[tuple[type, torch.dtype], ...] = (
    (bool, torch.bool),  # before int: a bool is an int
    (int, torch.int64),
    (float, torch.float64),
    (complex, torch.complex128),
)
# binary ops whose ``.Scalar`` overloads wrap the number in their CPU kernel (measured one by one)
_WRAPS_SCALAR = frozenset(
    "add sub mul div true_divide rsub remainder fmod floor_divide eq ne lt le gt ge "
    "bitwise_and bitwise_or bitwise_xor".split()
)
# TensorIterator ops that copy an input of another dtype than the common one on CPU, with the
# names of their two operands (measured one by one; ``where``'s kernel copies with ``.to`` itself)
_PROMOTES_INPUTS: dict[str, tuple[str, str]] = {
    **{n: ("self", "other") for n in _WRAPS_SCALAR},
    **{n: ("self", "other") for n in ("maximum", "minimum", "atan2", "logical_and", "logical_or",
                                      "logical_xor", "where")},
    "pow": ("self", "exponent"),
}
_FLOAT_OPS = frozenset({"div", "true_divide", "atan2"})  # integer inputs compute in the default float
_SAVED_NUMBER = "Python number saved for backward"


def _number_dtype(v: Any) -> torch.dtype | None:
    """The dtype PyTorch wraps a Python number in (None: not a Python number)."""
    for kind, dtype in _NUMBER_DTYPES:
        if type(v) is kind:
            return dtype
    return None


def _label(func: Any) -> str:
    return "aten::" + str(getattr(func, "__name__", func))


def _unseen_on_cpu(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[int, str]]:
    """``(bytes, what)`` of each allocation a real CPU run of ``func`` makes that no operator
    output holds: see NOTE [ bytes no operator output holds ]."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    values: dict[str, Any] = {}
    slots: dict[str, str] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            values[a.name] = args[i]
        elif a.name in kwargs:
            values[a.name] = kwargs[a.name]
        else:
            continue
        slots[a.name] = str(a.type)
    packet = str(schema.name).split("::")[-1]
    base = packet[:-1] if packet.endswith("_") and not packet.endswith("__") else packet
    overload = str(schema.overload_name)
    wraps = base in _WRAPS_SCALAR and overload in ("Scalar", "Scalar_mode")
    self_ = values.get("self")
    saves = (  # autograd keeps mul's and div's ``other`` for self's gradient
        base in ("mul", "div")
        and overload in ("Tensor", "Tensor_mode")
        and isinstance(self_, torch.Tensor)
        and self_.requires_grad
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
    )
    # a C++ backward formula that gets a number in a Tensor slot passes a number its node kept
    node = _compat.current_node()
    kept = node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction)
    out: list[tuple[int, str]] = []
    wrapped: set[str] = set()
    for name, v in values.items():
        dtype = _number_dtype(v)
        tensor_slot = slots[name] in ("Tensor", "Optional[Tensor]")
        if dtype is None or not (tensor_slot or (wraps and name == "other")):
            continue
        wrapped.add(name)
        if kept and slots[name] != "number":  # (a Scalar slot's type reads "number")
            continue
        what = _SAVED_NUMBER if saves and name == "other" else "Python number as a tensor"
        out.append((dtype.itemsize, what))
    if base == "mean" and overload in ("dim", ""):
        t = values.get("self")
        dtype = values.get("dtype") or (t.dtype if isinstance(t, torch.Tensor) else None)
        if dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128):
            out += [(8, "Python number as a tensor"), (dtype.itemsize, "kernel's copy of an input")]
        return out
    names = _PROMOTES_INPUTS.get(base)
    if names is None or overload.startswith("out") or any(n not in values for n in names):
        return out
    if any(not isinstance(values[n], torch.Tensor) and n not in wrapped for n in names):
        return out  # a number the kernel takes as a Scalar (pow.Tensor_Scalar): no tensor, no copy
    a, b = (values[n] for n in names)
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return out
    try:
        common = torch.result_type(a, b)
    except (RuntimeError, TypeError):
        return out
    integral = not (common.is_floating_point or common.is_complex)
    if base in _FLOAT_OPS and values.get("rounding_mode") is None and integral:
        common = torch.get_default_dtype()
    for v in (a, b):
        if isinstance(v, torch.Tensor):
            if v.dtype != common:
                out.append((v.numel() * common.itemsize, "kernel's copy of an input"))
        elif _number_dtype(v) not in (None, common):
            out.append((common.itemsize, "kernel's copy of an input"))
    if packet != base and isinstance(a, torch.Tensor) and a.dtype != common:  # in place
        out.append((a.numel() * common.itemsize, "kernel's copy of an input"))
    return out


def _count_cpu(rec: Any, inside: bool) -> None:
    """Inside an optimizer step of a ``device="cpu"`` prediction, CPU tensors count as the meta ones
    do: see NOTE [ optimizer steps keep the default device ]."""
    src = rec.memory_source
    if src is not None and hasattr(src, "also_device_type"):
        src.also_device_type = "cpu" if inside else None


@contextlib.contextmanager
def _optimizer_steps_on(
    default: torch.device, on_step: Callable[[bool], None] | None = None
) -> Iterator[None]:
    """While this thread runs an optimizer's ``step``, factory calls make tensors on ``default``
    (and ``on_step(True)`` / ``on_step(False)`` are called as it starts and ends).

    NOTE [ optimizer steps keep the default device ]: optimizers keep their per-parameter step
    counter as a 0-dim tensor made by ``torch.tensor(0.0)`` and read it with ``.item()`` (Adam,
    AdamW, RMSprop, ... without ``capturable``). Newer PyTorch places it with ``device="cpu"``;
    torch 2.6 to 2.8 leave the device to the default, which inside a prediction is ``meta``, and
    ``.item()`` on meta fails. A real step makes that counter on the default device whatever device
    the parameters are on, so inside ``Optimizer.step`` the user's default device (the one outside
    the prediction) is put back. State made from the parameters (``zeros_like(p)``: exp_avg,
    momentum buffers) still follows them onto meta and is counted; the counters are on the default
    device: for ``device="cpu"`` they are counted (4 bytes each, as the real CPU run allocates them
    inside the step), for ``device="cuda"`` not (a real GPU step keeps them in CPU memory). For the
    same reason the copy of an optimizer that has stepped before (or made its state in its
    constructor: Adagrad, ASGD) keeps its 0-dim state tensors as private copies with their values
    (see :func:`_optimizer_scalars`), not as meta tensors.
    The step hooks are global, so they act only on the thread that runs the prediction; a context
    a raising step left entered is exited here, innermost first, before the meta device context.
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    me = threading.get_ident()
    entered: list[torch.device] = []

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == me:
            ctx = torch.device(default)
            ctx.__enter__()
            entered.append(ctx)
            if on_step is not None:
                on_step(True)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == me and entered:
            entered.pop().__exit__(None, None, None)
            if on_step is not None and not entered:
                on_step(False)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while entered:
            entered.pop().__exit__(None, None, None)
        if on_step is not None:
            on_step(False)


def _dense(t: torch.Tensor) -> bool:
    return _compat.non_overlapping_and_dense(t)


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_ORIGINALS: list[dict[str, Any]] = []
_TARGET = threading.local()  # the device the current thread's prediction is for


def _attention_on_meta(
    device: str,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    tensors = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
    if enable_gqa or not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return None
    if query.dim() != 4:
        return None
    if device == "cuda":
        head = query.shape[-1]
        if head % 8 != 0:
            return None
        if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        grad = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, _float_mask(attn_mask, query.dtype), grad, dropout_p, is_causal, scale=scale
        )[0]
    try:
        q, k, v = (_stand_in(t) for t in (query, key, value))
        choice = _compat.fused_sdp_choice(
            q, k, v, attn_mask=_stand_in(attn_mask), dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    except Exception:  # no answer: let the meta device decide
        return None
    if choice != 1:  # SDPBackend.FLASH_ATTENTION
        return None
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=_float_mask(attn_mask, query.dtype), scale=scale
    )
    return out


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """What the fused paths do with a boolean mask: an additive float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device="meta").masked_fill(mask.logical_not(), float("-inf"))


def _stand_in(t: Any) -> Any:
    """A CPU tensor that the CPU's kernel choice cannot tell from ``t``: the same shape, dtype and
    ``requires_grad``, holding one row of memory.

    NOTE [ stand-ins keep requires_grad ]: the choice depends on which inputs require grad (the
    CPU flash kernel has no gradient for ``attn_mask``, so a mask that requires grad, as Swin's
    relative position bias does, sends the real step to the math kernel); a stand-in that
    dropped the flag would make the prediction take a kernel the real step never runs.
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    if t.dim() == 0:
        s = torch.empty((), dtype=t.dtype, device="cpu")
    else:
        s = torch.empty(t.shape[-1], dtype=t.dtype, device="cpu").expand(t.shape).detach()
    return s.requires_grad_(t.requires_grad)


# ----------------------------------------------------------------------------------------------
# copying to meta
# ----------------------------------------------------------------------------------------------
def _meta_like(t: torch.Tensor) -> torch.Tensor:
    m: torch.Tensor = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        m = nn.Parameter(m, requires_grad=t.requires_grad)
    elif t.requires_grad:
        m.requires_grad_(True)
    if t.is_leaf and t.grad is not None:
        m.grad = torch.empty_strided(
            tuple(t.grad.shape), tuple(t.grad.stride()), dtype=t.grad.dtype, device="meta"
        )
    return m


def _collect_tensors(obj: Any, out: dict[int, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable through containers, modules and optimizers (iteratively)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out[id(o)] = o
        elif isinstance(o, nn.Module):
            for t in (*o.parameters(), *o.buffers()):
                out[id(t)] = t
            for m in o.modules():
                stack.extend(v for v in vars(m).values() if isinstance(v, torch.Tensor))
        elif isinstance(o, torch.optim.Optimizer):
            for g in o.param_groups:
                stack.extend(g["params"])
            for st in o.state.values():
                stack.extend(st.values() if isinstance(st, Mapping) else ())
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        else:
            stack.extend(_attributes(o))


# NOTE [ tensors inside argument objects ]: a step's batch is often an object: a dataclass, a
# torch_geometric ``Data`` (its tensors in a storage object under ``_store``), a ``transformers``
# ``BatchEncoding``. Its tensors are found through its attributes (``__dict__`` and ``__slots__``),
# so that the copy for meta (``copy.deepcopy`` with every tensor mapped, see NOTE [ no data is
# copied ]) holds meta tensors where the object held real ones. Classes, functions and Python
# modules are not entered.
def _attributes(o: Any) -> list[Any]:
    """The values of an object's attributes, where it is an instance with any."""
    if isinstance(o, type | types.ModuleType | types.FunctionType | types.MethodType | types.BuiltinFunctionType
                  | str | bytes | int | float | complex | bool) or o is None:
        return []
    out: list[Any] = []
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        out.extend(d.values())
    for cls in type(o).__mro__:
        for slot in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
            if slot not in ("__dict__", "__weakref__") and hasattr(o, slot):
                out.append(getattr(o, slot))
    return out


def _to_meta(args: Any) -> tuple[Any, dict[int, Any]]:
    """A deep copy of ``args`` in which every tensor is an empty meta tensor of the same shape,
    dtype, strides and ``requires_grad`` (parameters stay parameters; gradients are mirrored).

    NOTE [ no data is copied ]: ``copy.deepcopy`` is given a memo that already maps every tensor
    to its meta twin, so modules and optimizers are rebuilt around meta tensors and the user's
    objects (and their memory) are never duplicated or modified."""
    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors(args, tensors, set())
    counters = _optimizer_scalars(args)
    memo: dict[int, Any] = {}
    for i, t in tensors.items():
        if t.device.type == "meta":
            memo[i] = t
        elif i in counters:
            memo[i] = t.detach().clone()  # see NOTE [ optimizer steps keep the default device ]
        else:
            memo[i] = _meta_like(t.detach() if not t.is_leaf else t)
            if not t.is_leaf and t.requires_grad:
                memo[i].requires_grad_(True)
    try:
        out = copy.deepcopy(tuple(args), memo)
        copied_schedulers(args, memo)
        return out, memo
    except Exception as e:
        raise GradscopeError(
            f"gradscope: could not copy the step's arguments to the meta device ({type(e).__name__}: {e}). "
            "Pass modules, tensors and optimizers, or build them in make_args(batch_size)."
        ) from e


def copied_schedulers(originals: Any, memo: Mapping[int, Any]) -> None:
    """After ``copy.deepcopy(originals, memo)``: each copied optimizer whose LR scheduler was copied
    with it wrapped as that scheduler wraps it (see NOTE [ a copied optimizer and its LR scheduler ]
    in gradscope._compat)."""
    found: dict[int, Any] = {}
    stack, seen = [originals], set()
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, torch.Tensor | nn.Module):
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.lr_scheduler.LRScheduler):
            opt = getattr(o, "optimizer", None)
            if opt is not None:
                found[id(opt)] = opt
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
    for i, opt in found.items():
        twin = memo.get(i)
        if twin is not None and twin is not opt:
            _compat.track_lr_scheduler_step(twin, opt)


def _optimizer_scalars(args: Any) -> set[int]:
    """ids of the 0-dim tensors in the state of the optimizers among ``args`` (step counters,
    ASGD's eta and mu): a real step reads them with ``.item()``, so the copy keeps their values
    on their own device instead of making them meta."""
    out: set[int] = set()
    for o in _flat(args):
        if isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                if isinstance(st, Mapping):
                    out.update(id(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 0)
    return out


def _module_names(args: Sequence[Any], frame: Any) -> dict[int, str]:
    """``id(module) -> name`` for the modules among ``args``: the caller's variable that holds
    it (locals first, then globals), else its class name."""
    out: dict[int, str] = {}
    mods = [a for a in _flat(args) if isinstance(a, nn.Module)]
    if not mods:
        return out
    try:
        local_ns = frame.f_locals
        scopes = [dict(local_ns), frame.f_globals]
        if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1 and local_ns is not frame.f_globals:
            # see NOTE [ f_locals keeps tensors alive ] in gradscope.capture.held: drop the snapshot
            local_ns.clear()
    except Exception:
        scopes = []
    for m in mods:
        if id(m) in out:
            continue
        name = next(
            (
                k
                for sc in scopes
                for k, v in list(sc.items())
                if v is m and isinstance(k, str) and k.isidentifier() and not k.startswith("_")
            ),
            None,
        )
        out[id(m)] = name or type(m).__name__
    del scopes
    return out


def _resident_bytes(meta_args: Any) -> list[int]:
    """Bytes of each distinct storage among the (meta) arguments, parameters, gradients and
    optimizer state: what is on the device before the step runs."""
    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors(meta_args, tensors, set())
    for t in list(tensors.values()):
        if t.grad is not None:
            tensors[id(t.grad)] = t.grad
    seen: dict[int, int] = {}
    for t in tensors.values():
        key = _storage_key(t)
        if key is not None:
            seen[key] = int(t.untyped_storage().nbytes())
    return list(seen.values())


def _batch_dim(args: Sequence[Any]) -> int | None:
    for a in _flat(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[0])
    return None


def _flat(obj: Any) -> list[Any]:
    out: list[Any] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Mapping):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, list | tuple):
            stack.extend(reversed(o))
        else:
            out.append(o)
    return out


def _resize(args: Any, dim: int | None, b: int) -> Any:
    """``args`` with every tensor whose first dimension is ``dim`` rebuilt as a meta tensor of
    first dimension ``b`` (contiguous). Modules and other objects are kept as they are."""

    def one(o: Any) -> Any:
        if (
            isinstance(o, torch.Tensor)
            and not isinstance(o, nn.Parameter)
            and o.dim() >= 1
            and o.shape[0] == dim
        ):
            t = torch.empty((b, *o.shape[1:]), dtype=o.dtype, device="meta")
            return t.requires_grad_(o.requires_grad)
        if isinstance(o, Mapping):
            return (
                type(o)({k: one(v) for k, v in o.items()})
                if isinstance(o, dict)
                else {k: one(v) for k, v in o.items()}
            )
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return type(o)(*(one(v) for v in o))
        if isinstance(o, list | tuple):
            return type(o)(one(v) for v in o)
        return o

    return tuple(one(a) for a in args)


def _make(make_args: Callable[[int], Any], b: int) -> tuple[Any, ...]:
    try:
        with torch.device("meta"):
            out = make_args(b)
    except Exception as e:
        raise GradscopeError(f"gradscope: make_args({b}) raised {type(e).__name__}: {e}.") from e
    return tuple(out) if isinstance(out, tuple) else (out,)
