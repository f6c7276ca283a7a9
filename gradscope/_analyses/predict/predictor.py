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

The allocator model, what it and the meta run cannot know, and how near it comes to a real CUDA
snapshot: NOTE [ the allocator model ] in :mod:`gradscope._analyses.predict.allocator`. This module is the
face of the predictor's private package :mod:`gradscope._analyses.predict` (the allocator model, the kernels
a device would choose, a step run on meta as on the device, the step's objects copied to meta); the
predictor itself (:func:`predict`, :class:`Prediction`) and :func:`counted_on_meta` are defined here.

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
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._analyses.predict.allocator import AllocatorEstimate, estimate_cuda_allocator
from gradscope._analyses.predict.copies import (
    _batch_dim,
    _make,
    _module_names,
    _resident_bytes,
    _resize,
    _to_meta,
)
from gradscope._analyses.predict.kernels import _TARGET, _autocast_message, _kernel_choices
from gradscope._analyses.predict.on_meta import _AsOnTheDevice, _count_cpu, _optimizer_steps_on
from gradscope._base.errors import GradscopeError
from gradscope._base.units import parse_size
from gradscope._model.recording import Recording, Where

__all__ = ["AllocatorEstimate", "BatchResult", "Prediction", "estimate_cuda_allocator", "predict"]

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

    def __repr__(self) -> str:
        fit = "" if self.fits is None else (", fits" if self.fits else ", does not fit")
        est = "" if self.reserved_bytes is None else f", reserved~{self.reserved_bytes}"
        return f"Prediction({self.device}: peak_bytes={self.peak_bytes}{est}{fit})"


# ----------------------------------------------------------------------------------------------
# predict
# ----------------------------------------------------------------------------------------------
# The prediction's notes send the reader here: these two NOTEs say what a step run on meta
# (gradscope._analyses.predict.on_meta) counts that no operator output holds, and what it runs on CPU.
#
# NOTE [ bytes no operator output holds ]: on CPU, four kinds of allocation are made where no
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
# - the step counters of optimizers (see NOTE [ optimizer steps keep the default device ]);
# - the CPU generator's state that ``torch.get_rng_state()`` returns (5,056 bytes), which non-reentrant
#   checkpointing keeps for each checkpointed segment until it is recomputed
#   (``counts_rng`` of :func:`gradscope._analyses.predict.kernels._kernel_choices`).
# For ``device="cpu"`` each of the first two is counted as alive for the duration of its op
# (:func:`gradscope._analyses.predict.on_meta._unseen_on_cpu`), the counters are counted as CPU
# tensors and the random states from the call until they are freed, so that the prediction matches the CPU allocator's events. On a GPU, wrapped numbers live in CPU memory and kernels
# read them as scalars: nothing is counted for ``device="cuda"``.
#
# NOTE [ meta kernels stricter than the CPU's ]: some meta kernels check the rules of the CUDA
# kernel: ``_grouped_mm`` (``F.grouped_mm``, Mixtral's experts in transformers) demands
# bfloat16 on meta while the CPU kernel takes float32. For ``device="cpu"`` such an op (all of
# its tensors on meta, functional, its output shape not data-dependent) runs once more as the
# CPU kernel on zero-filled CPU tensors of the same shapes, strides and dtypes, and its outputs
# are made on meta with the CPU outputs' shapes, strides and dtypes: exact bytes, at the cost of
# that op's inputs and outputs in CPU memory for a moment. The ops are listed in a note. For
# ``device="cuda"``, where the meta kernel stands for the GPU's, the rejection is reported as
# what it is (a :class:`GradscopeError` naming the op).
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
    from gradscope._capture.record import record

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
            _kernel_choices(device, rec if device == "cpu" else None),
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
            "their inputs (see NOTE [ meta kernels stricter than the CPU's ] in gradscope._analyses.predict.predictor)."
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
            "(see NOTE [ bytes no operator output holds ] in gradscope._analyses.predict.predictor): "
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
