"""The one place where gradscope touches PyTorch's private APIs.

Every private touchpoint (engine entry point, sequence numbers, saved variables, the profiler's
event tree, storage weak references, dispatch modes, the saved-tensor hook stack, the CUDA
allocator's snapshot, the fused attention choice, ...) lives here, behind a feature probe: a
``hasattr`` or a try on a tiny tensor, never a version comparison. Everything else in the package
imports plain functions from here. Where a capability is missing, :func:`capabilities` says so
and the recorder writes a note about what it could not see (see :data:`MISSING_NOTES`); no figure
silently changes.

NOTE [ PyTorch's private APIs in one module ]: this module is longer than the others (about 910
lines) and stays one piece on purpose: it is a flat list of small wrappers (most under 20 lines),
one section per part of PyTorch, with no state of its own beyond cached probes; kept whole, one
file answers "what does gradscope rely on that PyTorch may change" (tests/test_imports.py checks
that no other module touches a private name), and a new PyTorch release is checked by reading it
top to bottom. Splitting it by section would spread that answer over several files for no
separation of concerns (each section is already its own concern, a few wrappers long).

NOTE [ supported range ]: torch 2.6 through the newest release. Measured gaps inside it:
``SavedTensor.unpack_hook`` and ``SavedTensor.data`` are absent on 2.8 and older,
``_top_saved_tensors_default_hooks`` on 2.6, ``TorchDispatchMode.ignore_compile_internals`` on
2.8; from 2.13 on a node's Python object lives as long as the node (see NOTE [ freeing deep
graphs ] in :mod:`gradscope._capture.walk`), before that it is recreated whenever nobody holds it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "ACC_SEQ",
    "MISSING_NOTES",
    "Capabilities",
    "capabilities",
]

# AccumulateGrad's sequence number: every leaf's node has this one (UINT64_MAX).
ACC_SEQ = 18446744073709551615


# ----------------------------------------------------------------------------- sequence numbers
def _probe_sequence_nr() -> Callable[[], int] | None:
    fn = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)
    if fn is None:
        return None
    try:
        a = int(fn())
        x = torch.ones(1, requires_grad=True)
        (x * 2).grad_fn  # noqa: B018 - creates one node
        return fn if int(fn()) > a else None
    except Exception:
        return None


_SEQ = _probe_sequence_nr()


def sequence_nr() -> int:
    """The calling thread's next autograd sequence number (a node made now gets this one)."""
    if _SEQ is None:
        return -1
    return int(_SEQ())


def sequence_nr_fn() -> Callable[[], int]:
    """The raw counter (hooks call it directly: one call less)."""
    return _SEQ if _SEQ is not None else (lambda: -1)


def node_sequence_nr(fn: Any) -> int:
    """A node's sequence number (``ACC_SEQ`` for ``AccumulateGrad``)."""
    return int(fn._sequence_nr())


# Getters for the hot paths (pack hook, graph walk): C-level callables, no Python frame each.
node_seq = operator.methodcaller("_sequence_nr")  # a node's sequence number
tensor_version = operator.attrgetter("_version")  # a tensor's version counter (in-place changes)
storage_cdata = operator.attrgetter("_cdata")  # a storage's key: see storage_key
storage_weak = torch.UntypedStorage._weak_ref  # a weak handle to a storage: see storage_weak_ref
weak_expired = torch.UntypedStorage._expired  # whether that handle's storage died: see weak_ref_expired
weak_free = torch.UntypedStorage._free_weak_ref  # let go of the handle: see free_weak_ref


def cxx11_abi() -> int:
    """Whether this PyTorch was built with the C++11 string ABI (code compiled against it must match)."""
    return int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))


def is_view(t: torch.Tensor) -> bool:
    return bool(t._is_view())


def current_node() -> Any:
    """The autograd node being executed on this thread, or None (forward, or no backward)."""
    f = getattr(torch._C, "_current_autograd_node", None)
    return None if f is None else f()


# ----------------------------------------------------------------------------- storages
def storage_key(t: torch.Tensor) -> int | None:
    """An int naming the storage ``t`` uses (its StorageImpl's address): equal for views of one
    storage, reused only after the storage is freed. None where there is no storage."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The dense tensors a sparse tensor is made of (indices first, values last), whose storages
    hold its bytes; None for a tensor of another layout. A sparse tensor has no storage of its own
    (``untyped_storage()`` raises)."""
    names = _SPARSE_PARTS.get(t.layout)
    if names is None:
        return None
    return [getattr(t, n)() for n in names]


def parts_bytes(parts: list[torch.Tensor]) -> int:
    """The bytes of the storages behind ``parts`` (a sparse tensor's: see sparse_parts), each once.
    The values' storage names the tensor's save (its key, address and weak reference)."""
    return sum({int(s._cdata): int(s.nbytes()) for s in (p.untyped_storage() for p in parts)}.values())


def storage_weak_ref(storage: Any) -> int:
    """A weak reference to a storage (an int handle); free it with :func:`free_weak_ref`."""
    return int(storage._weak_ref())


def weak_ref_expired(ref: int) -> bool:
    return bool(torch.UntypedStorage._expired(ref))


def free_weak_ref(ref: int) -> None:
    torch.UntypedStorage._free_weak_ref(ref)


def is_zero_tensor(t: torch.Tensor) -> bool:
    try:
        return bool(t._is_zerotensor())
    except (AttributeError, RuntimeError):
        return False


# ----------------------------------------------------------------------------- saved variables
_SAVED_ATTRS: dict[type, tuple[tuple[str, str], ...]] = {}


def saved_tensor_attributes(fn: Any) -> tuple[tuple[str, str], ...]:
    """``(attribute, raw attribute)`` for each saved *tensor* (or tensor list) of a node's class,
    e.g. ``(("_saved_self", "_raw_saved_self"), ...)``; custom Functions give
    ``(("saved_tensors", "_raw_saved_tensors"),)``. Scalars saved by a node have no raw
    attribute and are left out. Cached per class."""
    cls = type(fn)
    attrs = _SAVED_ATTRS.get(cls)
    if attrs is None:
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            attrs = (("saved_tensors", "_raw_saved_tensors"),)
        else:
            names = set(dir(fn))
            attrs = tuple((a, "_raw" + a) for a in sorted(names)
                          if a.startswith("_saved_") and "_raw" + a in names)
        _SAVED_ATTRS[cls] = attrs
    return attrs


def raw_saved(fn: Any, raw_attr: str) -> list[Any]:
    """The raw saved variables behind one attribute (a list, for tensor lists), never unpacked.
    Empty when the node's saves were already freed or the attribute does not apply."""
    return raw_saved_listed(fn, raw_attr)[0]


def raw_saved_listed(fn: Any, raw_attr: str) -> tuple[list[Any], bool]:
    """:func:`raw_saved` and whether the attribute is a list of tensors, from one read."""
    try:
        raw = getattr(fn, raw_attr, None)
    except (RuntimeError, AttributeError):
        return [], False
    if raw is None:
        return [], False
    if isinstance(raw, list | tuple):
        return list(raw), True
    return [raw], False


def packed_by(raw: Any, unpack: Callable[..., Any]) -> Any:
    """What the pack hook returned for a raw saved variable if ``unpack`` is its unpack hook,
    else :data:`NOT_VISIBLE` (also where this torch cannot show either: see :func:`capabilities`)."""
    try:
        if raw.unpack_hook is unpack:
            return raw.data
    except (RuntimeError, AttributeError):
        pass
    return NOT_VISIBLE


def _probe_saved_data() -> bool:
    from torch.autograd.graph import saved_tensors_hooks

    marker = object()
    try:
        x = torch.ones(1, requires_grad=True)
        with saved_tensors_hooks(lambda t: marker, lambda p: x):
            y = x.exp()
        return getattr(getattr(y.grad_fn, "_raw_saved_result", None), "data", None) is marker
    except Exception:
        return False


def _probe_unpack_hook() -> bool:
    from torch.autograd.graph import saved_tensors_hooks

    def unpack(p: Any) -> Any:
        return p

    try:
        x = torch.ones(1, requires_grad=True)
        with saved_tensors_hooks(lambda t: t, unpack):
            y = x.exp()
        return getattr(getattr(y.grad_fn, "_raw_saved_result", None), "unpack_hook", None) is unpack
    except Exception:
        return False


_NOTHING = object()


def packed_value(raw: Any) -> Any:
    """What the pack hook returned for a raw saved variable, without unpacking it; a sentinel
    (:data:`NOT_VISIBLE`) where this torch cannot say (see :func:`capabilities`)."""
    if not capabilities().saved_data:
        return NOT_VISIBLE
    try:
        return raw.data
    except (RuntimeError, AttributeError):
        return NOT_VISIBLE


NOT_VISIBLE = _NOTHING


def unpack_hook_of(raw: Any) -> Any:
    """The unpack hook attached to a raw saved variable (None: saved without hooks or freed),
    or :data:`NOT_VISIBLE` where this torch cannot say."""
    if not capabilities().saved_hook:
        return NOT_VISIBLE
    try:
        return raw.unpack_hook
    except (RuntimeError, AttributeError):
        return None


def probe_saved(raw: Any, pack: Callable[..., Any], unpack: Callable[..., Any]) -> str:
    """For a torch that cannot show a saved variable's hooks (<= 2.8): try to register ``pack``
    and ``unpack`` on it. PyTorch refuses a second pair (``"hooked"``: another pair packed it),
    a None value (``"none"``) and a freed one (``"freed"``); otherwise the pair is now its own
    (``"registered"``: ``pack`` ran, as it would have if the save had been made under it)."""
    try:
        raw.register_hooks(pack, unpack)
    except RuntimeError as e:
        msg = str(e)
        if "already been set" in msg:
            return "hooked"
        if "None" in msg:
            return "none"
        return "freed"
    return "registered"


# ----------------------------------------------------------------------------- hook stack
def top_saved_tensors_hooks() -> Any:
    """The innermost ``(pack, unpack)`` pair on this thread's stack, None when empty, or
    :data:`NOT_VISIBLE` where this torch cannot say."""
    f = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if f is None:
        return NOT_VISIBLE
    return f(False)


def pop_saved_tensors_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


def push_saved_tensors_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


# ----------------------------------------------------------------------------- engine entry
ENGINE_ENTRY = "_engine_run_backward"


def engine_entry_module() -> Any:
    """The module whose ``_engine_run_backward`` (:data:`ENGINE_ENTRY`) both ``backward`` and
    ``autograd.grad`` call, or None (then :mod:`gradscope.record` wraps the two public functions)."""
    import torch.autograd as ag

    return ag if hasattr(ag, ENGINE_ENTRY) else None


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward pass now running ends (FSDP's use of the engine's queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


class EngineCall(NamedTuple):
    """The arguments of one call into the autograd engine, read from ``_engine_run_backward``'s
    positional layout ``(outputs, grad_outputs, retain_graph, create_graph, inputs,
    allow_unreachable, accumulate_grad)``. (A named tuple: one is made for every backward.)"""

    create_graph: bool
    retain_graph: bool
    inputs: tuple[Any, ...]
    accumulate_grad: bool


def engine_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> EngineCall:
    n = len(args)
    create = bool(args[2] if n > 2 else kwargs.get("create_graph", False))
    retain = args[1] if n > 1 else kwargs.get("keep_graph", None)
    retain = create if retain is None else bool(retain)
    inputs = (args[3] if n > 3 else kwargs.get("inputs", ())) or ()
    accumulate = bool(args[5] if n > 5 else kwargs.get("accumulate_grad", True))
    return EngineCall(create, retain, tuple(inputs), accumulate)


def hooks_class() -> Any:
    """The class whose ``__enter__``/``__exit__`` push and pop a saved-tensor hooks pair for
    ``saved_tensors_hooks``, ``save_on_cpu`` and non-reentrant checkpointing alike."""
    from torch.autograd.graph import saved_tensors_hooks

    return saved_tensors_hooks


def disable_hooks_module() -> Any:
    """Where torch.func's guard ``disable_saved_tensors_hooks`` is looked up at call time."""
    import torch.autograd.graph as agg

    return agg if hasattr(agg, "disable_saved_tensors_hooks") else None


# ----------------------------------------------------------------------------- profiler
def allocation_tag() -> Any:
    from torch._C._profiler import _EventType

    return _EventType.Allocation


# NOTE [ scopes outside the dispatcher ]: ``record_function`` opens its scope through two
# operators (``profiler::_record_function_enter_new`` / ``_record_function_exit``), so a program's
# own TorchDispatchMode saw them at every module call and backward pass gradscope marked. The
# autograd bindings' ``_record_function_with_args_enter`` / ``_exit`` open the same user scope
# (``RecordScope.USER_SCOPE``, which the lean profiler keeps) without an operator. (The profiler's
# ``_RecordFunctionFast`` also bypasses the dispatcher, but its scopes are operator scopes, which
# the lean profiler drops: see NOTE [ a lean profiler ].)
_SCOPE_ENTER: Callable[..., Any] | None = getattr(torch._C._autograd, "_record_function_with_args_enter", None)
_SCOPE_EXIT: Callable[[Any], None] | None = getattr(torch._C._autograd, "_record_function_with_args_exit", None)


def _probe_direct_scopes() -> bool:
    """Whether user scopes open and close without the dispatcher (a try outside any profiler)."""
    if _SCOPE_ENTER is None or _SCOPE_EXIT is None:
        return False
    try:
        _SCOPE_EXIT(_SCOPE_ENTER("gradscope.probe"))
        return True
    except Exception:
        return False


_DIRECT_SCOPES = _probe_direct_scopes()


def record_scope_enter(name: str) -> Any:
    """Open a profiler user scope (a handle for :func:`record_scope_exit`), without the
    dispatcher where this torch allows (see NOTE [ scopes outside the dispatcher ])."""
    if _DIRECT_SCOPES:
        return _SCOPE_ENTER(name)  # type: ignore[misc]
    return torch.ops.profiler._record_function_enter_new(name, None)


def record_scope_exit(handle: Any) -> None:
    if _DIRECT_SCOPES:
        _SCOPE_EXIT(handle)  # type: ignore[misc]
    else:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


def scopes_bypass_dispatch() -> bool:
    """Whether :func:`record_scope_enter` opens scopes without an operator (no dispatch mode sees it)."""
    return _DIRECT_SCOPES


def profiler_enabled() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled) or bool(torch._C._autograd._profiler_enabled())


def profiler_session_active() -> bool:
    """Whether a profiler session is running on this thread (PyTorch's own state, not the flag)."""
    return bool(torch._C._autograd._profiler_enabled())


def _set_profiler_flag(enabled: bool) -> None:
    """Set ``torch.autograd.profiler._is_profiler_enabled`` as PyTorch's own sessions do
    (see NOTE [ the profiler flag ])."""
    prof = torch.autograd.profiler
    fn = getattr(prof, "_run_on_profiler_start" if enabled else "_run_on_profiler_stop", None)
    if fn is not None:
        fn()
    elif hasattr(prof, "_is_profiler_enabled"):
        prof._is_profiler_enabled = enabled


def start_node_profiler(ops: bool = False) -> None:
    """Start PyTorch's profiler with memory events and only node and user scopes (and op scopes
    too with ``ops``).

    NOTE [ a lean profiler ]: ``torch.profiler.profile`` records a scope for every aten op; on
    graphs of small ops that doubles the profiler's own cost and, worse, the event tree gradscope
    must read back through Python grows with it (measured on a 5,000-op chain: 4.5x plain with
    op scopes, 2.5x without; reading the tree back 1.3x more). Memory events do not depend on
    scopes, so the CPU source asks for node scopes (``BACKWARD_FUNCTION``: one per executed node,
    with its sequence number) and user scopes (``record_function``: gradscope's marks, the
    optimizer's ``Optimizer.step#...``) only; forward allocations are then labelled by module.
    In a process of a ``torch.distributed`` job, op scopes are recorded too, with their inputs'
    shapes: communication ops (``c10d::_allgather_base_`` ...) then label the memory they allocate,
    and their tensors' sizes give the bytes each collective moves (see NOTE [ collectives in a
    recording ] in :mod:`gradscope._capture.memory.profiler`).
    """
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )

    cfg = ProfilerConfig(ProfilerState.KINETO, ops, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    torch._C._autograd._prepare_profiler(cfg, activities)
    # NOTE [ the profiler flag ]: PyTorch's sessions set the Python-side flag
    # ``torch.autograd.profiler._is_profiler_enabled`` before they start and clear it after they
    # stop (torch.compile's code and ``record_function``'s fast paths read it). A session that fails
    # to start (``emit_itt``, ``emit_nvtx`` or a second profile inside a running one: "Profiler is
    # already enabled on this thread") sets it and leaves it set; the running session's stop clears
    # it. gradscope's session does the same, so that a program's failed start inside a block
    # leaves nothing behind (before, the flag stayed set and every later memory='cpu' block
    # refused to start); its own failed start puts the flag back as it was.
    before = bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
    _set_profiler_flag(True)
    try:
        torch._C._autograd._enable_profiler(  # type: ignore[call-arg]
            cfg, activities,
            {RecordScope.BACKWARD_FUNCTION, RecordScope.USER_SCOPE, *((RecordScope.FUNCTION,) if ops else ())},
        )
    except BaseException:
        _set_profiler_flag(before)
        raise


def stop_profiler() -> Any:
    """Stop the profiler started by :func:`start_node_profiler`; its results, or None when no
    session runs any more (code in between stopped it; torch 2.6 raises when told to stop then).
    Clears the flag as PyTorch's sessions do (see NOTE [ the profiler flag ])."""
    try:
        if not profiler_session_active():
            return None
        return torch._C._autograd._disable_profiler()
    finally:
        _set_profiler_flag(False)


def results_event_tree(results: Any) -> list[Any]:
    return list(results.experimental_event_tree())


def event_input_bytes(extra_fields: Any) -> list[int]:
    """Bytes of each input of a profiler op event, from the shapes it reports (with ``ops`` in
    :func:`start_node_profiler`): a tensor's ``numel * itemsize``, a list of tensors summed, 0 for
    any other argument. Empty when the event carries no inputs."""
    return [_argument_bytes(a) for a in (getattr(extra_fields, "inputs", None) or ())]


def _argument_bytes(a: Any) -> int:
    sizes = getattr(a, "sizes", None)
    if sizes is not None:
        dtype = getattr(a, "dtype", None)
        return functools.reduce(operator.mul, sizes, 1) * (dtype.itemsize if dtype is not None else 0)
    if isinstance(a, (list, tuple)):
        return sum(_argument_bytes(x) for x in a)
    return 0


def node_scope() -> Any:
    from torch._C._profiler import RecordScope

    return RecordScope.BACKWARD_FUNCTION


# ----------------------------------------------------------------------------- dispatch modes
# NOTE [ dispatch-mode flags across threads ]: PyTorch keeps whether a dispatch mode is active in
# process-wide flags (``torch.utils._python_dispatch._is_in_torch_dispatch_mode`` and its kin), and a
# mode's exit puts back the values its enter found. Modes on two threads that end out of order (two
# tracker blocks, the first ending while the second runs) left them set after both had ended: the
# second found the first's "active" and put it back last. torch 2.6's Dynamo reads them, compiles
# nothing while they say a mode is active, and marks each function it meets so as one never to
# compile (measured: a function compiled after two such blocks ran eagerly, whatever was reset).
# So gradscope's modes count themselves across threads, and when the last of them ends the flags get
# back the values they had before the first began.
_MODE_LOCK = threading.Lock()
_MODES_ACTIVE = [0]  # gradscope's dispatch modes active, on every thread
_FLAGS_OUTSIDE: dict[str, bool] = {}  # the flags as the first of them found them


def _mode_flags() -> dict[str, bool]:
    from torch.utils import _python_dispatch as pd

    return {k: v for k, v in vars(pd).items() if k.startswith("_is_in_") and isinstance(v, bool)}


def _put_mode_flags(flags: dict[str, bool]) -> None:
    from torch.utils import _python_dispatch as pd

    for k, v in flags.items():
        setattr(pd, k, v)
    mirror = getattr(pd, "set_is_in_mode_without_ignore_compile_internals", None)  # (its C twin, 2.13 on)
    if callable(mirror) and "_is_in_any_mode_without_ignore_compile_internals" in flags:
        mirror(flags["_is_in_any_mode_without_ignore_compile_internals"])


@functools.cache
def torch_dispatch_mode() -> type:
    """The base of gradscope's dispatch modes: PyTorch's, counted across threads (see NOTE
    [ dispatch-mode flags across threads ])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CountedMode(TorchDispatchMode):  # type: ignore[misc]
        def __enter__(self) -> Any:
            with _MODE_LOCK:
                if _MODES_ACTIVE[0] == 0:
                    _FLAGS_OUTSIDE.clear()
                    _FLAGS_OUTSIDE.update(_mode_flags())
                _MODES_ACTIVE[0] += 1
            try:
                return super().__enter__()
            except BaseException:
                _left_mode()
                raise

        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                _left_mode()

    return _CountedMode


def _left_mode() -> None:
    with _MODE_LOCK:
        _MODES_ACTIVE[0] -= 1
        if _MODES_ACTIVE[0] == 0:
            _put_mode_flags(_FLAGS_OUTSIDE)


def has_ignore_compile_internals() -> bool:
    return hasattr(torch_dispatch_mode(), "ignore_compile_internals")


def eager_compile_stance() -> Any:
    """On a torch whose dispatch modes cannot ignore compile internals, set torch.compile's stance
    to ``"force_eager"`` and return what :func:`restore_compile_stance` needs to put the previous
    one back; None elsewhere (nothing changed).

    NOTE [ compiled code under the tracker on old torch ]: torch 2.6's Dynamo, asked to run a frame
    while a non-infra dispatch mode is active, returns no compiled code, and a frame it returns
    nothing for has its code object marked "skip" with its cache dropped: that function, and every
    module sharing its ``forward`` (all ``nn.Linear``), runs eagerly for the rest of the process.
    With the stance ``"force_eager"`` Dynamo's frame callback is not installed at all, so frames run
    eagerly without being marked. The stance is process-wide: for the block's duration compiled
    code on other threads runs eagerly too. Dynamo is imported for this (a compiled function made
    inside the block would be marked too)."""
    if has_ignore_compile_internals():
        return None
    return force_eager_stance()


def restore_compile_stance(handle: Any) -> None:
    """Give back a hold of :func:`force_eager_stance` or :func:`eager_compile_stance` (None:
    nothing to do); the last one held puts the previous stance back."""
    if handle is None:
        return
    with _STANCE_LOCK:
        _STANCE_HOLDS.remove(handle)
        if _STANCE_HOLDS:
            return
        stance = _STANCE[0]
        _STANCE.clear()
    stance.__exit__(None, None, None)


_MODULE_HOOK_KEY = -0x6773  # gradscope's one key in torch's global module-hook dicts (never a handle's id)


def add_global_module_hooks(pre: Callable[..., Any], post: Callable[..., Any]) -> None:
    """Put ``pre`` and ``post`` (called also when the forward raises) among torch's global module
    forward hooks under gradscope's fixed key (see NOTE [ one key for module hooks ] in
    gradscope._capture.modules); where this torch keeps them otherwise, registered the public way."""
    from torch.nn.modules import module as m

    pres = getattr(m, "_global_forward_pre_hooks", None)
    posts = getattr(m, "_global_forward_hooks", None)
    always = getattr(m, "_global_forward_hooks_always_called", None)
    if not isinstance(pres, dict) or not isinstance(posts, dict) or not isinstance(always, dict):
        _PUBLIC_MODULE_HOOKS[:] = [m.register_module_forward_pre_hook(pre),
                                   m.register_module_forward_hook(post, always_call=True)]
        return
    pres[_MODULE_HOOK_KEY] = pre
    posts[_MODULE_HOOK_KEY] = post
    always[_MODULE_HOOK_KEY] = True


def remove_global_module_hooks() -> None:
    """Undo :func:`add_global_module_hooks`."""
    from torch.nn.modules import module as m

    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called"):
        d = getattr(m, name, None)
        if isinstance(d, dict):
            d.pop(_MODULE_HOOK_KEY, None)
    for h in _PUBLIC_MODULE_HOOKS:
        h.remove()
    _PUBLIC_MODULE_HOOKS.clear()


_PUBLIC_MODULE_HOOKS: list[Any] = []


# NOTE [ one eager stance for all blocks ]: torch.compile's stance is process-wide, and each
# ``set_stance`` puts back the stance it found. Blocks on several threads that each set and put back
# their own (two tracker blocks on torch 2.6, each forcing eager) ended out of order: the second
# block found "force_eager", the first's and put it back last, and torch.compile ran eagerly in the
# whole process from then on (measured: a function compiled after two such blocks ran eagerly). So
# the stance is held: the first hold sets it, the others count, and the last one given back puts
# back the stance the first found.
_STANCE_LOCK = threading.Lock()
_STANCE: list[Any] = []  # the first hold's set_stance context, whose exit puts back the stance it found
_STANCE_HOLDS: list[object] = []  # one token per hold not given back yet


def force_eager_stance() -> Any:
    """Hold torch.compile's stance at ``"force_eager"`` (compiled functions and modules run their
    Python code eagerly; see NOTE [ one eager stance for all blocks ]) and return the hold for
    :func:`restore_compile_stance`; None where this torch has no ``torch.compiler.set_stance``
    (nothing changed)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    with _STANCE_LOCK:
        if not _STANCE:
            try:
                with no_dispatch_modes():  # importing Dynamo runs ops: a program's own mode must not see them
                    _STANCE.append(set_stance("force_eager"))  # sets it now; its exit puts the previous one back
            except Exception:
                return None
        hold = object()
        _STANCE_HOLDS.append(hold)
        return hold


# NOTE [ the recompile limit in a block ]: torch.compile compiles a function again when a guard of
# what it compiled fails, and past a limit per code object (config.cache_size_limit on torch 2.6,
# recompile_limit later; 8) it gives up and runs that function eagerly from then on, logging a
# warning. A recording can be what tips it: on torch 2.6 the module hooks a block installs fail the
# guard on the global hooks, so a compiled module compiles once more in its first recorded block,
# and a process that already compiled eight modules of one code object (nn.Module.__call__'s,
# shared by all) ran the ninth eagerly while recorded (measured: a ninth live compiled Sequential
# ran compiled outside the block and eagerly inside it). The watch reads that warning, which has
# kept one shape from 2.6 to 2.15, so that the recording says so.
_LIMIT_HIT = "torch._dynamo hit config."


def watch_recompile_limit(hit: Callable[[str], None]) -> Callable[[], None]:
    """``hit(function)`` for each time torch.compile gives up on a function, on the calling
    thread, because it reached its recompile limit (see NOTE [ the recompile limit in a block ]),
    until the returned undo runs. The warning itself still reaches the user's handlers."""
    import logging

    logger = logging.getLogger("torch._dynamo.convert_frame")
    thread = threading.get_ident()

    def seen(record: logging.LogRecord) -> bool:
        try:
            if record.thread == thread and isinstance(record.msg, str) and record.msg.startswith(_LIMIT_HIT):
                message = record.getMessage()
                start = message.find("function: ")
                hit(message[start + 10:].split("\n", 1)[0].strip() if start >= 0 else "?")
        except Exception:  # a watch never breaks torch's logging
            pass
        return True  # never filters anything out

    logger.addFilter(seen)
    return lambda: logger.removeFilter(seen)


def compiled_saves_observable() -> bool:
    """Whether this torch has the AOTAutograd step :func:`observe_compiled_saves` observes (torch
    2.13 and 2.15 do; 2.6 does this bookkeeping inline)."""
    try:
        from torch._functorch import config as fconfig
        from torch._functorch._aot_autograd import graph_compile
    except Exception:
        return False
    return (callable(getattr(graph_compile, "_categorize_saved_tensors_for_backward", None))
            and hasattr(fconfig, "enable_autograd_cache"))


def observe_compiled_saves(seen: Callable[[Any, Any, int, Any], None]) -> Callable[[], None] | None:
    """Observe AOTAutograd's own bookkeeping of the tensors a compiled region saves for backward:
    ``seen(fw_module, bw_module, n_fw_outputs, fw_metadata)`` runs after each partition made while
    observed (the forward graph's outputs past ``n_fw_outputs`` are what the region saves, in
    ``save_for_backward`` order). Returns the undo (it also restores the autograd cache setting), or
    None where this torch has no such step (then nothing was changed).

    NOTE [ observing compiled saves ]: AOTAutograd partitions the joint graph and then counts the
    forward graph's saved outputs in ``_categorize_saved_tensors_for_backward`` (torch 2.13's
    ``torch._functorch._aot_autograd.graph_compile``; older releases do this inline, with no name to
    observe). The wrapper calls the original first and only reads the graphs. A graph taken from
    AOTAutograd's own cache skips the partition, so the cache is off while observed (the compiled
    program is the same; only the cache lookup is skipped)."""
    if not compiled_saves_observable():
        return None
    from torch._functorch import config as fconfig
    from torch._functorch._aot_autograd import graph_compile

    name = "_categorize_saved_tensors_for_backward"
    orig = getattr(graph_compile, name)

    @functools.wraps(orig)
    def categorize(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        try:  # (fw_module, bw_module, inner_meta, fw_metadata, num_inner_fwd_outputs) on 2.13 and 2.15
            fw_module, bw_module, _inner, fw_metadata, n = args
            seen(fw_module, bw_module, n, fw_metadata)
        except Exception:  # observing never breaks the user's compile
            pass
        return out

    cache = fconfig.enable_autograd_cache
    setattr(graph_compile, name, categorize)
    fconfig.enable_autograd_cache = False

    def undo() -> None:
        if getattr(graph_compile, name, None) is categorize:
            setattr(graph_compile, name, orig)
        fconfig.enable_autograd_cache = cache

    return undo


def tree_leaves(x: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves as leaves

    return list(leaves(x))


def _probe_is_compiling() -> Callable[[], bool]:
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return f if f is not None else (lambda: False)


is_compiling = _probe_is_compiling()
"""Whether torch.compile is tracing the calling code. NOTE [ hooks inside compiled modules ]:
a torch that traces a compiled module's ``__call__`` (before 2.13) would trace gradscope's global
module hooks too, break the graph on them and run the module eagerly: the hooks return at once
when traced (the compiled region is one opaque node in the recording anyway)."""


def is_fake(t: Any) -> bool:
    """Whether ``t`` belongs to a compiler tracing a graph (a fake or functional tensor: no run)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as _is_fake
        from torch._subclasses.functional_tensor import FunctionalTensor

        return isinstance(t, FunctionalTensor) or bool(_is_fake(t))
    except Exception:
        return False


def dispatch_modes_active() -> bool:
    """Whether a Python dispatch mode is active on this thread."""
    f = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return bool(f()) if f is not None else False


@contextlib.contextmanager
def no_dispatch_modes() -> Iterator[None]:
    """Run a few ops without the active Python dispatch modes (gradscope's own probes)."""
    from torch.utils._python_dispatch import _disable_current_modes

    if not torch._C._len_torch_dispatch_stack():
        yield
        return
    with _disable_current_modes():
        yield


# ----------------------------------------------------------------------------- CUDA allocator
def cuda_start_history(max_entries: int) -> None:
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def cuda_stop_history(device: Any) -> dict[str, Any]:
    try:
        return dict(torch.cuda.memory._snapshot(device))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_allocated_reserved(index: int) -> tuple[int, int]:
    """The caching allocator's (allocated, reserved) bytes now on device ``index``, in one call.

    NOTE [ reading the allocator's figures ]: ``torch.cuda.memory_allocated`` and
    ``memory_reserved`` each build the allocator's whole statistics (every stat of every pool) and
    flatten them into a sorted dict of dotted keys in Python, for one number; called around every
    module call and backward step that cost a GPT-2 small step (batch 8 x 512, 86 ms on an H200)
    over 300 ms. The nested statistics that they flatten are read here once, both numbers from
    them; where this torch lays them out otherwise, the public functions answer.
    """
    try:
        s = torch._C._cuda_memoryStats(index)
        return int(s["allocated_bytes"]["all"]["current"]), int(s["reserved_bytes"]["all"]["current"])
    except (AttributeError, KeyError, TypeError):
        return int(torch.cuda.memory_allocated(index)), int(torch.cuda.memory_reserved(index))


# Keys of a CUDA allocator snapshot that gradscope reads (see torch/cuda/memory.py, _snapshot).
SNAPSHOT_TRACES = "device_traces"

# Forward-mode AD's zero tangent under a dispatch mode (see gradscope._passes.tracker_note); None
# where this torch lacks the op.
EFFICIENT_ZERO_OP: Any = getattr(getattr(torch.ops.aten, "_efficientzerotensor", None), "default", None)
TRACE_ACTION, TRACE_SIZE, TRACE_ADDR, TRACE_TIME_US, TRACE_FRAMES = "action", "size", "addr", "time_us", "frames"

# The operator through which tensors made outside the dispatcher (``torch.tensor(data)``,
# ``torch.as_tensor``, ``torch.asarray``, ``new_tensor``, ...) enter it (see NOTE [ tensors made
# outside dispatch ] in gradscope._capture.memory.tracker); None where this torch lacks it.
LIFT_FRESH_OP: Any = getattr(getattr(torch.ops.aten, "lift_fresh", None), "default", None)


def allocator_owned(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was allocated by PyTorch's allocator (it can be resized) rather
    than wrapping memory made elsewhere (numpy's array under ``torch.from_numpy`` / ``as_tensor``,
    a buffer under ``frombuffer``, DLPack), which no allocator event reports."""
    try:
        return bool(t.untyped_storage().resizable())
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


# ----------------------------------------------------------------------------- prediction helpers
def fused_sdp_choice(*args: Any, **kwargs: Any) -> int | None:
    """The CPU's own choice of fused attention kernel (1 = flash), or None where not asked."""
    f = getattr(torch, "_fused_sdp_choice", None)
    if f is None:
        return None
    return int(f(*args, **kwargs))


def _probe_dense() -> Callable[[torch.Tensor], bool] | None:
    try:
        import torch._prims_common as pc
    except Exception:
        return None
    # ``..._or_false`` (newer) also answers for symbolic shapes; the plain one (2.6) for ours
    return getattr(pc, "is_non_overlapping_and_dense_or_false", None) or getattr(pc, "is_non_overlapping_and_dense", None)


_DENSE = _probe_dense()


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps in some order
    (a transposed tensor is; a strided slice is not)."""
    if _DENSE is not None:
        try:
            return bool(_DENSE(t))
        except Exception:
            pass
    return t.is_contiguous()  # a private helper that moved: contiguity is the common case


def largest_differences(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[tuple[float, float]] | None:
    """Each ``xs[i]``'s largest absolute value and its largest absolute difference from ``ys[i]``
    (floating tensors, non-empty, each pair of one shape and dtype), as floats, by PyTorch's foreach
    operators: a few operators for the tensors of each dtype instead of a few for each tensor (half
    the time for a GPT-2's parameters). None where those operators are missing or refuse them."""
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(xs)
    groups: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    try:
        for group in groups.values():
            a, b = [xs[i] for i in group], [ys[i] for i in group]
            diff = torch._foreach_sub(a, b)
            torch._foreach_abs_(diff)
            values = torch.stack([*torch._foreach_max(torch._foreach_abs(a)), *torch._foreach_max(diff)]).tolist()
            for n, i in enumerate(group):
                out[i] = (values[n], values[len(group) + n])
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return None
    return out


# NOTE [ a copied optimizer and its LR scheduler ]: an LR scheduler wraps its optimizer's ``step``
# in an instance attribute (marked ``_wrapped_by_lr_sched``) that sets ``_opt_called``; a copy of the
# optimizer (``copy.deepcopy``: ``Optimizer.__getstate__`` keeps only defaults, state and groups)
# loses both, and the copied scheduler's first ``step()`` then warns that ``optimizer.step()`` "has
# been overridden". The copy's ``step`` is wrapped again the way the scheduler does it, pointing at
# the copy, with the original's ``_opt_called``. Private attributes of torch.optim.lr_scheduler
# (torch 2.6 to 2.15).
def track_lr_scheduler_step(copy: Any, original: Any) -> None:
    """The copied optimizer ``copy`` of ``original``, whose scheduler was copied with it, wrapped as
    the scheduler wraps its optimizer (see NOTE [ a copied optimizer and its LR scheduler ]). Older
    releases mark the wrapper ``_with_counter`` and count ``_step_count`` instead."""
    marker = next((m for m in ("_wrapped_by_lr_sched", "_with_counter") if hasattr(original.step, m)), None)
    step = getattr(copy, "step", None)
    if marker is None or step is None or hasattr(step, marker):
        return
    func = type(copy).step
    me = weakref.ref(copy)
    counts = "_step_count" in vars(original)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = me()
        opt._opt_called = True  # type: ignore[union-attr]
        if counts:
            opt._step_count += 1  # type: ignore[union-attr]
        return func.__get__(opt, type(opt))(*args, **kwargs)

    setattr(wrapper, marker, True)
    copy.step = wrapper
    for name in ("_opt_called", "_step_count"):
        if name in vars(original):
            setattr(copy, name, vars(original)[name])


# ----------------------------------------------------------------------------- node objects
def _probe_nodes_persist() -> bool:
    """Whether a node's Python object lives as long as the node once created (PyTorch keeps it
    in the node, as it does for tensors): then ``id()`` of node objects is stable, and a walked
    graph frees recursively (see :func:`gradscope.release` and NOTE [ freeing deep graphs ] in
    :mod:`gradscope._capture.walk`)."""
    try:
        x = torch.ones(1, requires_grad=True)
        y = x.exp()
        a = y.grad_fn
        ida = id(a)
        del a
        decoys = [(x * float(i)).grad_fn for i in range(16)]
        same = id(y.grad_fn) == ida
        del decoys
        return same
    except Exception:
        return False


# ----------------------------------------------------------------------------- capabilities
@dataclass(frozen=True)
class Capabilities:
    """What this torch lets gradscope see (each probed once)."""

    sequence_nr: bool  # which node saved a tensor: _get_sequence_nr
    saved_data: bool  # SavedTensor.data: our pack result read without unpacking (>= 2.9)
    saved_hook: bool  # SavedTensor.unpack_hook: who packed a save (>= 2.9)
    hook_stack: bool  # _top_saved_tensors_default_hooks (>= 2.7)
    ignore_compile_internals: bool  # TorchDispatchMode.ignore_compile_internals (>= 2.9)
    engine_entry: bool  # torch.autograd._engine_run_backward
    nodes_persist: bool  # node Python objects live as long as the node (>= 2.13)


_caps_lock = threading.Lock()


@functools.cache
def capabilities() -> Capabilities:
    """What this torch lets gradscope see, probed once per process, on tiny tensors of its own
    that no dispatch mode of the program's sees (a mode around the first block must see only the
    program's ops)."""
    with _caps_lock, no_dispatch_modes(), torch.enable_grad():
        return Capabilities(
            sequence_nr=_SEQ is not None,
            saved_data=_probe_saved_data(),
            saved_hook=_probe_unpack_hook(),
            hook_stack=hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
            ignore_compile_internals=has_ignore_compile_internals(),
            engine_entry=engine_entry_module() is not None,
            nodes_persist=_probe_nodes_persist(),
        )


# What a recording says when a capability is missing (keys: Capabilities fields).
MISSING_NOTES: dict[str, str] = {
    "sequence_nr": (
        "this torch has no autograd sequence counter: saved tensors cannot be matched with the "
        "nodes that saved them, so they are not listed."
    ),
}
