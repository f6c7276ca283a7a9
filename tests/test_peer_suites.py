"""Peer suites: PyTorch's own databases, run plain and inside ``gs.record``, see no difference.

gradscope promises that the program under recording sees no difference. PyTorch ships two ready
databases of programs in its wheel: ``module_db`` (nn modules with sample inputs, train and eval)
and ``autograd_function_db`` (custom ``autograd.Function`` classes with sample inputs). Each sample
runs forward and backward (random gradients, seeded) plain, then again from fresh copies with the
same seeds inside ``gs.record(memory=m)`` for every CPU memory mode (``"off"``, ``"cpu"``,
``"tracker"``), and the two runs are compared field by field (see :class:`_Obs`): outputs,
gradients, module state (parameters and buffers such as batch norm's running statistics), the
Python objects the backward reads back from its saved tensors (``ctx.saved_tensors`` and the
built-in nodes' ``_saved_*``: the same object, with the attributes set on it, where the plain run
got the same object), the warnings emitted, the global RNG state, the exception raised if any, what
the program's own instruments saw (its dispatch mode, its profiler), and what is left installed
after the block (saved-tensor hooks, dispatch modes, the profiler, global module and optimizer
hooks, the engine's entry point).

Tensors are compared bit for bit. A difference that a bare tool causes too (a saved-tensor hook
pair that detaches what requires grad, a ``torch.profiler.profile(profile_memory=True)`` session,
a pass-through ``TorchDispatchMode``) is PyTorch's: it is listed in :data:`KNOWN` with its reason,
and the test runs that bare tool and asserts it gives the same observation as the recording (and
``test_known_difference_is_pytorchs`` that it differs from the plain run, so no row goes stale).
Any other difference fails. The recording itself must be sane: complete, no internal error, and
its ``saved_bytes`` equal to an independent count (a bare pack hook's saves alive after forward,
unique storages, ``nbytes``).

What is run, to keep the module within ~3 minutes on 2 shared cores (measured on torch 2.13: 26-63 s):
of each module, up to three samples spread over its list (the first, one a third in, one two
thirds in) in train mode, and the first in eval mode where ``train_and_eval_differ``; float64
where the module supports it; the first sample of every autograd.Function; and three programs of
our own that use PyTorch's instruments themselves inside the block (their own dispatch mode, their
own profiler, ``emit_itt``); every autograd.Function sample and four module samples run a second
time inside a dispatch mode of their own that logs the ops it sees. Each case's plain run is made
twice and must agree with itself (the first also takes PyTorch's once-only warnings); inputs are
copies of samples made once (seed 0), as leaves. Bytes left uninitialized by PyTorch are not
compared (see NOTE [ saves with uninitialized bytes ]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import saved_tensors_hooks_active
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import gradscope as gs

pytest.importorskip("expecttest")  # PyTorch's testing databases import it

from torch.testing._internal.autograd_function_db import autograd_function_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

MODES = ("off", "cpu", "tracker")
_TAG = "_peer_tag"  # a Python attribute put on every tensor the program is given or returns


# ----------------------------------------------------------------------------------------------
# Programs: one sample, built afresh with the same seeds for every run
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Program:
    call: Callable[[], Any]  # the forward: returns the outputs
    module: nn.Module | None = None
    inputs: Any = ()  # what the forward is given (tagged; its leaves' gradients are compared)
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext  # the program's own
    seen: list[str] = dataclasses.field(default_factory=list)  # what the program's own instruments saw


@dataclasses.dataclass(frozen=True)
class _Case:
    id: str
    build: Callable[[], _Program]
    sane: tuple[str, ...] = MODES  # where the recording's own checks apply


@functools.cache
def _module_samples(index: int, dtype: torch.dtype, training: bool) -> list[Any]:
    """The samples of ``module_db[index]`` that have a forward input, made once (seed 0)."""
    info = module_db[index]
    torch.manual_seed(0)
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
    return [s for s in samples if s.forward_input is not None]


def _fresh(value: Any) -> Any:
    """A copy of every tensor in ``value``: same bytes, same ``requires_grad``, a leaf (an input made
    from another tensor with grad becomes the leaf the backward stops at)."""
    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return pytree.tree_map(copy, value)


def _spread(n: int) -> list[int]:
    """Up to three sample indices spread over ``n`` (the first, a third in, two thirds in)."""
    return sorted({0, n // 3, 2 * n // 3})


def _build_module(index: int, dtype: torch.dtype, training: bool, k: int) -> _Program:
    info = module_db[index]
    sample = _module_samples(index, dtype, training)[k]
    c_args, c_kwargs = _fresh((sample.constructor_input.args, sample.constructor_input.kwargs))
    args, kwargs = _fresh((sample.forward_input.args, sample.forward_input.kwargs))
    torch.manual_seed(0)
    m = info.module_cls(*c_args, **c_kwargs)
    m.to(dtype)
    m.train(training)
    return _Program(call=lambda: m(*args, **kwargs), module=m, inputs=(args, kwargs))


def _build_function(op: Any) -> _Program:
    torch.manual_seed(0)
    sample = next(iter(op.sample_inputs("cpu", torch.float64, requires_grad=True)))
    return _Program(call=lambda: op.op(sample.input, *sample.args, **sample.kwargs),
                    inputs=(sample.input, sample.args, sample.kwargs))


class _OpLog(TorchDispatchMode):
    """A program's own dispatch mode: it writes down every op it sees."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.log.append(str(func))
        return func(*args, **(kwargs or {}))


def _small_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return m, torch.randn(5, 6, dtype=torch.float64, requires_grad=True)


def _build_own_dispatch_mode() -> _Program:
    """A program that logs its ops with its own dispatch mode around forward and backward."""
    m, x = _small_mlp()
    prog = _Program(call=lambda: m(x), module=m, inputs=(x,))
    prog.around = lambda: _OpLog(prog.seen)
    return prog


def _under_own_mode(build: Callable[[], _Program]) -> _Program:
    """The same program, run inside a dispatch mode of its own that logs its ops."""
    prog = build()
    prog.around = lambda: _OpLog(prog.seen)
    return prog


# samples of module_db that also run under a dispatch mode of their own (with every autograd.Function)
_UNDER_OWN_MODE = ("nn.BatchNorm2d.train.0", "nn.Embedding.train.0", "nn.LSTM.train.0",
                   "nn.MultiheadAttention.train.0")


def _build_own_profiler() -> _Program:
    """A program that profiles its own forward with ``torch.profiler`` and reads which ops ran."""
    m, x = _small_mlp()

    def call() -> torch.Tensor:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = m(x)
        prog.seen += sorted({e.key for e in prof.key_averages()})
        return y

    prog = _Program(call=call, module=m, inputs=(x,))
    return prog


def _build_own_emit_itt() -> _Program:
    """A program that tries to annotate its forward for Intel VTune (``emit_itt``), goes on
    without it where that fails, and looks at whether PyTorch thinks a profiler runs."""
    m, x = _small_mlp()

    def call() -> torch.Tensor:
        try:
            with torch.autograd.profiler.emit_itt():
                prog.seen.append(f"inside: {torch.autograd.profiler._is_profiler_enabled}")
        except RuntimeError as e:
            prog.seen.append(f"emit_itt: {e}")
        prog.seen.append(f"after: {torch.autograd.profiler._is_profiler_enabled}")
        return m(x)

    prog = _Program(call=call, module=m, inputs=(x,))
    return prog


def _cases() -> list[_Case]:
    out = []
    for index, info in enumerate(module_db):
        dtype = torch.float64 if torch.float64 in info.supported_dtypes("cpu") else torch.float32
        for training in (True, False) if info.train_and_eval_differ else (True,):
            samples = _module_samples(index, dtype, training)
            for k in _spread(len(samples)) if training else [0]:
                desc = f"-{samples[k].desc}" if samples[k].desc else ""
                out.append(_Case(f"{info.name}.{'train' if training else 'eval'}.{k}{desc}",
                                 functools.partial(_build_module, index, dtype, training, k)))
    out += [_Case(op.name, functools.partial(_build_function, op)) for op in autograd_function_db]
    out += [_Case(f"{c.id}+own_dispatch_mode", functools.partial(_under_own_mode, c.build)) for c in out
            if c.id in _UNDER_OWN_MODE or not c.id.startswith("nn.")]
    out += [_Case("own.dispatch_mode", _build_own_dispatch_mode),
            _Case("own.profiler", _build_own_profiler, sane=("off", "tracker")),
            _Case("own.emit_itt", _build_own_emit_itt)]
    return out


CASES = {c.id: c for c in _cases()}


# ----------------------------------------------------------------------------------------------
# Observations: what the program can see, as plain comparable values
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Bits:
    """A tensor's exact contents: dtype, shape, strides and its bytes."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data: bytes

    @staticmethod
    def of(t: torch.Tensor) -> _Bits:
        t = t.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        flat = t.contiguous().reshape(-1)
        data = flat.resolve_conj().resolve_neg().view(torch.uint8).numpy().tobytes()
        return _Bits(str(t.dtype), tuple(t.shape), tuple(t.stride()), data)

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        if not self.data:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype)


def _value(v: Any) -> Any:
    return _Bits.of(v) if isinstance(v, torch.Tensor) else repr(v)


@dataclasses.dataclass(frozen=True)
class _Obs:
    """Everything the program could tell apart between two runs."""

    outputs: tuple[Any, ...]
    grads: tuple[tuple[str, Any], ...]
    state: tuple[tuple[str, Any], ...]
    saved: tuple[tuple[str, str, str | None, bool, Any], ...]  # node, attribute, tag, requires_grad, value
    warnings: tuple[tuple[str, str], ...]
    rng: bytes
    raised: str | None
    seen: tuple[str, ...]
    left: tuple[str, ...]


FIELDS = tuple(f.name for f in dataclasses.fields(_Obs))

# the objects gradscope may replace while a block runs, as PyTorch has them
_PATCHABLE = [(torch.autograd, "_engine_run_backward"), (torch.autograd.graph, "_engine_run_backward"),
              (torch.autograd, "backward"), (torch.autograd, "grad"),
              (torch.autograd.graph, "disable_saved_tensors_hooks"),
              (saved_tensors_hooks, "__enter__"), (saved_tensors_hooks, "__exit__")]
_ORIGINALS = [(obj, name, getattr(obj, name)) for obj, name in _PATCHABLE if hasattr(obj, name)]
_GLOBAL_HOOK_DICTS = [(nn_module, name) for name in dir(nn_module) if name.startswith("_global_") and
                      name.endswith("_hooks")] + [(optim_module, "_global_optimizer_pre_hooks"),
                                                  (optim_module, "_global_optimizer_post_hooks")]


def _left_over() -> tuple[str, ...]:
    """What is installed now that a plain program never installs."""
    left = []
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if (top(False) is not None) if top is not None else saved_tensors_hooks_active():
        left.append("saved_tensors_hooks")
    if torch._C._len_torch_dispatch_stack():
        left.append("dispatch mode")
    if torch.autograd.profiler._is_profiler_enabled:
        left.append("torch.autograd.profiler._is_profiler_enabled")
    if torch._C._autograd._profiler_enabled():
        left.append("profiler")
    left += [name for mod, name in _GLOBAL_HOOK_DICTS if getattr(mod, name, None)]
    left += [f"{getattr(obj, '__name__', obj)}.{name}" for obj, name, orig in _ORIGINALS
             if getattr(obj, name) is not orig]
    return tuple(left)


def _tag(t: Any, name: str) -> None:
    if isinstance(t, torch.Tensor):
        with contextlib.suppress(AttributeError, RuntimeError):
            setattr(t, _TAG, name)


def _node_saves(fn: Any) -> list[tuple[str, Any]]:
    if isinstance(fn, torch.autograd.function.BackwardCFunction):
        return [(f"saved_tensors[{i}]", t) for i, t in enumerate(fn.saved_tensors)]
    return [(a, getattr(fn, a)) for a in dir(fn) if a.startswith("_saved_")]


def _graph(roots: list[Any]) -> list[Any]:
    seen: dict[int, Any] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if id(fn) not in seen:
            seen[id(fn)] = fn
            stack += [n for n, _ in fn.next_functions if n is not None and id(n) not in seen]
    return list(seen.values())


def _run(case: _Case, outer: Callable[[], contextlib.AbstractContextManager[Any]],
         after_forward: Callable[[], None] | None = None) -> tuple[_Obs, Any]:
    """Build the case afresh, run its forward and backward inside ``outer()``, observe."""
    with warnings.catch_warnings():  # a module's constructor warns about its options: not the program's run
        warnings.simplefilter("ignore")
        prog = case.build()
    for i, t in enumerate(pytree.tree_leaves(prog.inputs)):
        _tag(t, f"input{i}")
    if prog.module is not None:
        for name, t in [*prog.module.named_parameters(), *prog.module.named_buffers()]:
            _tag(t, name)
    saved: list[tuple[str, str, str | None, bool, Any]] = []

    def read_saves(grad_outputs: Any) -> None:  # a node pre hook: what backward reads back, as it runs
        fn = torch._C._current_autograd_node()
        # the observer's own ops pass no dispatch mode (a program's, or the tracker's: under any
        # Python mode a wrapped number, such as the 10 that ``x / 10`` saves, arrives as an int)
        with _disable_current_modes():
            for attr, v in _node_saves(fn):
                for j, t in enumerate(v if isinstance(v, tuple | list) else [v]):
                    if isinstance(t, torch.Tensor):
                        tag = getattr(t, _TAG, None)
                        saved.append((type(fn).__name__, f"{attr}.{j}", tag, t.requires_grad, _Bits.of(t)))

    torch.manual_seed(1)
    outs: list[Any] = []
    raised, handle = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with outer() as handle, prog.around():
                result = prog.call()
                outs = pytree.tree_leaves(result)
                for i, t in enumerate(outs):
                    _tag(t, f"output{i}")
                if after_forward is not None:
                    after_forward()
                diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
                for fn in _graph([o.grad_fn for o in diff]):
                    if type(fn).__name__ != "AccumulateGrad":
                        fn.register_prehook(read_saves)
                if diff:
                    torch.autograd.backward(diff, [torch.randn_like(o) for o in diff])
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
    leaves = [t for t in pytree.tree_leaves(prog.inputs) if isinstance(t, torch.Tensor) and t.requires_grad
              and t.is_leaf]
    grads = [(f"input{i}", t.grad) for i, t in enumerate(leaves)]
    state: list[tuple[str, Any]] = []
    if prog.module is not None:
        grads += [(name, p.grad) for name, p in prog.module.named_parameters()]
        state = [(name, _value(v)) for name, v in prog.module.state_dict().items()]
    obs = _Obs(outputs=tuple(_value(o) for o in outs),
               grads=tuple((name, None if g is None else _Bits.of(g)) for name, g in grads),
               state=tuple(state), saved=tuple(saved),
               warnings=tuple((w.category.__name__, str(w.message)) for w in caught),
               rng=torch.get_rng_state().numpy().tobytes(), raised=raised, seen=tuple(prog.seen),
               left=_left_over())
    return obs, handle


# ----------------------------------------------------------------------------------------------
# The bare tools: what PyTorch does to a program with nothing of gradscope's
# ----------------------------------------------------------------------------------------------
class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _bare_hooks() -> contextlib.AbstractContextManager[Any]:
    return saved_tensors_hooks(lambda t: t.detach() if t.requires_grad else t, lambda t: t)


def _bare_profiler() -> contextlib.AbstractContextManager[Any]:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


TOOLS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "hooks": _bare_hooks, "profiler": _bare_profiler, "dispatch": _PassThrough}


@contextlib.contextmanager
def _tools(names: tuple[str, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(TOOLS[name]())
        yield


@dataclasses.dataclass(frozen=True)
class _Known:
    """A difference PyTorch makes itself: ``tools`` alone give the same observation of ``field``."""

    field: str
    cases: str  # an fnmatch pattern over case ids
    modes: tuple[str, ...]
    tools: tuple[str, ...]
    example: str  # a case where it shows: the bare tools must differ from the plain run there
    reason: str
    before: tuple[int, int] | None = None  # a torch older than this only
    same: Callable[[Any], Any] | None = None  # what of the observation must be the same (default: all)


def _without_detaches(seen: tuple[str, ...]) -> tuple[str, ...]:
    """What a program's own instrument saw, less ``detach``: how many ``detach`` calls a saved-tensor
    hook pair makes, and where, depends on its path (torch 2.6: two from a Python pack hook, one from
    C++; a compiled hook that detaches below the dispatcher makes none); everything else must match."""
    return tuple(op for op in seen if op not in ("aten.detach.default", "aten::detach", "detach"))


_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


KNOWN: tuple[_Known, ...] = (
    _Known("saved", "*", MODES, ("hooks",), "nn.Linear.train.0",
           "a pack hook that keeps a saved tensor which requires grad must detach it (returned as is, "
           "a node that saves its own output would hold itself), so backward reads back a new object "
           "without the attributes set on the original"),
    _Known("saved", "nn.CTCLoss.*", ("tracker",), ("hooks", "dispatch"),
           "nn.CTCLoss.train.13-reduction_none_lengths_tensors",
           "under any Python dispatch mode, ctc_loss with lengths given as tensors goes through the overload "
           "that takes tensors (CtcLossBackward1, which saves the two length tensors too) instead of "
           "converting them to lists first"),
    _Known("seen", "*dispatch_mode", MODES, ("hooks",), "own.dispatch_mode",
           "a pack hook's ``t.detach()`` is an op like any other: a dispatch mode the program enters "
           "inside the block sees it (how many, and where, varies: see _without_detaches)",
           same=_without_detaches),
    _Known("seen", "own.profiler", ("off",), ("hooks",), "own.profiler",
           "a pack hook's ``t.detach()`` shows in a profiler the program runs inside the block "
           "(``aten::detach``, ``detach``)", same=_without_detaches),
    _Known("seen", "own.profiler", ("cpu",), ("hooks", "profiler"), "own.profiler",
           "as above; the outer profiler session, ended by the program's own, adds nothing to it",
           same=_without_detaches),
    _Known("seen", "own.profiler", ("tracker",), ("hooks", "dispatch"), "own.profiler",
           "as above, and any Python dispatch mode shows in that profiler as a ``PythonDispatchMode`` event",
           same=_without_detaches),
    _Known("raised", "own.profiler", ("cpu",), ("hooks", "profiler"), "own.profiler",
           "on torch 2.6 a profiler session that a program's own ``torch.profiler.profile`` ended raises "
           "\"Can't disable Kineto profiler when it's not running\" when it stops", before=(2, 7)),
    _Known("seen", "own.emit_itt", ("cpu",), ("profiler",), "own.emit_itt",
           "PyTorch runs one profiler per thread: ``emit_itt`` inside a running session raises \"Profiler is "
           "already enabled on this thread\" and leaves ``torch.autograd.profiler._is_profiler_enabled`` "
           "True until that session ends"),
)


# ----------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------
_PLAIN: dict[str, _Obs] = {}
_BARE: dict[tuple[str, tuple[str, ...]], _Obs] = {}
# NOTE [ saves with uninitialized bytes ]: CTC loss saves its ``log_alpha`` table (``result1``),
# made with ``empty()`` and written only inside each sequence's input and target lengths: the rest
# is whatever the allocator handed back, different from run to run. Its bytes are not compared
# (its dtype, shape, strides and object identity are).
_UNINITIALIZED = {("CtcLossBackward0", "_saved_result1.0"), ("CtcLossBackward1", "_saved_result1.0")}


def _masked(obs: _Obs) -> _Obs:
    """``obs`` without the bytes of saves that hold uninitialized memory (see NOTE [ saves with
    uninitialized bytes ])."""
    saved = tuple(s[:4] + (dataclasses.replace(s[4], data=b""),) if s[:2] in _UNINITIALIZED else s
                  for s in obs.saved)
    return dataclasses.replace(obs, saved=saved)


def _plain(case: _Case) -> _Obs:
    if case.id not in _PLAIN:
        first, again = (_masked(_run(case, contextlib.nullcontext)[0]) for _ in range(2))
        unequal = [f for f in FIELDS if f != "warnings" and getattr(first, f) != getattr(again, f)]
        assert unequal == [], f"{case.id}: the plain program differs from itself in {unequal}"
        _PLAIN[case.id] = again
    return _PLAIN[case.id]


def _bare(case: _Case, tools: tuple[str, ...]) -> _Obs:
    if (case.id, tools) not in _BARE:
        _BARE[(case.id, tools)] = _masked(_run(case, lambda: _tools(tools))[0])
    return _BARE[(case.id, tools)]


def _short(v: Any) -> Any:
    """An observed row without its bytes (for messages)."""
    if isinstance(v, tuple):
        return tuple(_short(x) for x in v if not isinstance(x, _Bits))
    return v


def _max_error(a: Any, b: Any) -> str:
    ba = [x for x in (a if isinstance(a, tuple) else (a,)) if isinstance(x, _Bits)]
    bb = [x for x in (b if isinstance(b, tuple) else (b,)) if isinstance(x, _Bits)]
    if not (ba and bb) or (ba[0].dtype, ba[0].shape) != (bb[0].dtype, bb[0].shape):
        return ""
    if ba[0] == bb[0]:
        return ""
    ta, tb = ba[0].tensor(), bb[0].tensor()
    if not ta.is_floating_point() or ta.numel() == 0:
        return f" ({int((ta != tb).sum())} of {ta.numel()} elements differ)"
    return f" (max abs diff {(ta - tb).abs().max().item():.3g})"


def _describe(field: str, a: Any, b: Any) -> str:
    """Where two observations of ``field`` differ, in a line a person can act on."""
    if not isinstance(a, tuple) or not isinstance(b, tuple):
        return f"{str(a)[:300]!r} -> {str(b)[:300]!r}"
    parts = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "replace" and i2 - i1 == j2 - j1:
            pairs = zip(a[i1:i2], b[j1:j2], strict=True)
            parts += [f"{_short(x)} -> {_short(y)}{_max_error(x, y)}" for x, y in pairs]
        elif tag != "equal":
            gone, new = [_short(x) for x in a[i1:i2]], [_short(y) for y in b[j1:j2]]
            parts.append(f"{gone[:3]} -> {new[:3]} at {i1}")
    return "; ".join(p[:300] for p in parts[:4]) + (f"; ... {len(parts)} in all" if len(parts) > 4 else "")


def _as_is(v: Any) -> Any:
    return v


def _known(field: str, case_id: str, mode: str) -> list[_Known]:
    return [k for k in KNOWN if k.field == field and mode in k.modes and fnmatch.fnmatchcase(case_id, k.cases)
            and (k.before is None or _TORCH < k.before)]


_COUNTED: dict[tuple[str, bool], tuple[int, int] | None] = {}


def _independent_saves(case: _Case, mode: str) -> tuple[int, int] | None:
    """(saves alive after forward, bytes of their unique storages), from a bare pack hook (under a
    pass-through dispatch mode for the tracker, as PyTorch saves otherwise under one: see KNOWN);
    None where a save has no storage to count (sparse)."""
    key = (case.id, mode == "tracker")
    if key not in _COUNTED:
        _COUNTED[key] = _count_saves(case, under_mode=key[1])
    return _COUNTED[key]


def _count_saves(case: _Case, under_mode: bool) -> tuple[int, int] | None:
    packed: list[weakref.ref[torch.Tensor]] = []
    counted: list[tuple[int, int] | None] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        packed.append(weakref.ref(d))
        return d

    def count() -> None:
        alive = [t for t in (r() for r in packed) if t is not None]
        if any(t.layout != torch.strided for t in alive):
            counted.append(None)
            return
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        counted.append((len(alive), sum(storages.values())))

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        mode_for = _PassThrough() if under_mode else contextlib.nullcontext()
        with mode_for, saved_tensors_hooks(pack, lambda t: t):
            yield

    _run(case, counting, after_forward=count)
    return counted[0] if counted else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_id", list(CASES))
def test_recording_changes_nothing_the_program_sees(case_id: str, mode: str) -> None:
    """The sample run inside ``gs.record(memory=mode)`` sees what it sees plain, but for the
    differences of KNOWN (checked against the bare tools); the recording is complete and its
    saves are those a bare pack hook counts."""
    case = CASES[case_id]
    plain = _plain(case)
    recorded, rec = _run(case, lambda: gs.record(memory=mode))
    recorded = _masked(recorded)
    unexplained = []
    for field in FIELDS:
        mine, theirs = getattr(plain, field), getattr(recorded, field)
        if mine == theirs:
            continue
        known = _known(field, case_id, mode)
        bare = [getattr(_bare(case, k.tools), field) for k in known]
        if not any((k.same or _as_is)(theirs) == (k.same or _as_is)(obs)
                   for k, obs in zip(known, bare, strict=True)):
            how = _describe(field, mine, theirs)
            for k, b in zip(known, bare, strict=True):
                how += f" | {'+'.join(k.tools)} alone: {_describe(field, mine, b)}"
            unexplained.append(f"{field}: {how}")
    assert unexplained == [], f"{case_id}, memory={mode!r}:\n" + "\n".join(unexplained)
    if mode not in case.sane:  # the program's own profiler ends the one memory="cpu" reads
        return
    assert rec is not None
    r = rec.recording
    assert r.complete, r.error
    assert [n for n in r.notes if "internal error" in n] == []
    independent = _independent_saves(case, mode)
    if independent is not None:  # (saves, their bytes): the recording's against a bare pack hook's
        assert (len(r.saved), r.saved_bytes) == independent, r.notes


@pytest.mark.parametrize("known", KNOWN, ids=[f"{k.field}-{k.example}-{'+'.join(k.tools)}" for k in KNOWN])
def test_known_difference_is_pytorchs(known: _Known) -> None:
    """Each row of KNOWN is a difference the bare tools make on their own (no stale rows)."""
    if known.before is not None and _TORCH >= known.before:
        pytest.skip(f"a difference of torch older than {known.before}")
    case = CASES[known.example]
    assert getattr(_bare(case, known.tools), known.field) != getattr(_plain(case), known.field)
