"""A step run on meta as on the device: gradients accumulated as the engine does without observers,
outputs laid out as the device's kernels lay them out, ops a meta kernel refuses run on CPU
stand-ins, and the bytes no operator output holds counted (NOTE [ bytes no operator output holds ] in gradscope._analyses.predict.predictor)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gradscope._analyses.predict import values as _values
from gradscope._analyses.predict.copies import _flat
from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError


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
    """

    def __init__(self, recorder: Any, device: str) -> None:
        # recorder None: counted as the tracker counts a real run (see NOTE [ counted as a budget
        # counts ]): neither correction that needs the recorder applies
        super().__init__()
        self._rec = recorder
        self._device = device
        self.on_cpu: set[str] = set()  # ops run by the CPU kernel (NOTE [ meta kernels stricter ... ])
        # how many of each were counted, and their bytes (NOTE [ bytes no operator output holds ] in
        # gradscope._analyses.predict.predictor)
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
        """The op on meta, values kept where they are known (see NOTE [ values known on meta ] in
        gradscope._analyses.predict.values)."""
        if func in _READS and _values.any_known():
            cpu = _on_values(args, kwargs)
            if cpu is not None:  # a value read of tensors whose values are known: answered from them
                with _compat.no_dispatch_modes():
                    return func(*cpu[0], **cpu[1])
        out = self._dispatch_meta(func, args, kwargs)
        _keep_values(func, args, kwargs, out)
        return out

    def _dispatch_meta(self, func: Any, args: Any, kwargs: Any) -> Any:
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
        """See NOTE [ meta kernels stricter than the CPU's ] in gradscope._analyses.predict.predictor."""

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


# ops that read a tensor's values into Python (see NOTE [ values known on meta ] in
# gradscope._analyses.predict.values)
_READS = frozenset(getattr(torch.ops.aten, n).default for n in ("_local_scalar_dense", "is_nonzero", "equal")
                   if hasattr(torch.ops.aten, n))
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}  # an op's arguments it writes into, by position and name


def _on_values(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]] | None:
    """``args`` and ``kwargs`` with each meta tensor replaced by its value and each device made the
    CPU; None where a meta tensor's value is not known."""
    missing = False

    def cpu(o: Any) -> Any:
        nonlocal missing
        if isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                return o
            v = _values.value_of(o)
            if v is None:
                missing = True
            return v
        if isinstance(o, torch.device) and o.type == "meta":
            return torch.device("cpu")
        if isinstance(o, list | tuple):
            return type(o)(cpu(v) for v in o)
        return o

    a = [cpu(v) for v in args]
    k = {n: torch.device("cpu") if n == "device" and v is not None else cpu(v) for n, v in kwargs.items()}
    return None if missing else (a, k)


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    w = _WRITES.get(func)
    if w is None:
        schema = getattr(func, "_schema", None)
        w = () if schema is None else tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        _WRITES[func] = w
    return w


def _keep_values(func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """After ``func`` ran on meta: the values of its integer and boolean outputs, computed by the CPU
    kernel where its meta inputs' values are known; the values of what it wrote into dropped where
    they are not (see NOTE [ values known on meta ] in gradscope._analyses.predict.values)."""
    outs = tuple(out) if isinstance(out, tuple | list) else (out,)
    wanted = any(isinstance(t, torch.Tensor) and t.device.type == "meta" and _values.exact(t) for t in outs)
    written = _written(func)
    if not wanted and not (written and _values.any_known()):
        return
    name = str(getattr(func, "__name__", ""))
    cpu = None
    if (wanted and not name.startswith(("empty", "new_empty", "resize", "set_"))
            and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ())):
        cpu = _on_values(args, kwargs)
    if cpu is None:
        for i, n in written:
            t = args[i] if i < len(args) else kwargs.get(n)
            for w in (t if isinstance(t, list | tuple) else (t,)):  # (a foreach op writes into a list)
                if isinstance(w, torch.Tensor):
                    _values.forget_storage_of(w)
        return
    try:
        with _compat.no_dispatch_modes(), torch.no_grad():
            values = func(*cpu[0], **cpu[1])
    except Exception:  # the CPU kernel takes other inputs than the meta one: no values
        for t in outs:
            if isinstance(t, torch.Tensor):
                _values.forget_storage_of(t)
        return
    values = values if isinstance(values, tuple) else (values,)
    for t, v in zip(outs, values, strict=False):
        if (isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor) and t.device.type == "meta"
                and _values.exact(t) and v.shape == t.shape and v.dtype == t.dtype):
            _values.know(t, v)


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


# The bytes no operator output holds: see NOTE [ bytes no operator output holds ] in gradscope._analyses.predict.predictor.
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
    output holds: see NOTE [ bytes no operator output holds ] in gradscope._analyses.predict.predictor."""
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
