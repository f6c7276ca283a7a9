"""``gs.record()``: watch real code run and produce one immutable :class:`~gradscope.Recording`.

What is installed while a block runs, and removed in ``finally`` whatever happens:
- a ``saved_tensors_hooks`` pair (every tensor saved for backward, with its true storage bytes),
- global module forward pre/post hooks (module paths and parameter names, no user changes),
- an interception of the autograd engine's entry point (backward and autograd.grad), which walks
  the graph about to run and puts pre/post hooks on its nodes for that pass only,
- one memory source from :mod:`gradscope.memory`.

NOTE [ node identity ]: an autograd node's Python object is recreated whenever nobody holds it,
and holding it would keep the graph (and its saved tensors) alive, so nodes are identified by
their sequence number (unique per thread, assigned at creation) and ``AccumulateGrad`` nodes by
their leaf tensor. The recorder never keeps a node or a tensor beyond the moment it looks at it.

NOTE [ which node saved a tensor ]: a node's sequence number is taken from the thread's counter
before the op saves its inputs/outputs, so in the pack hook ``_get_sequence_nr() - 1`` is the
saving node. The attribute name comes from reading the node's ``_saved_*`` attributes once
before its backward runs: that calls our unpack hook with the handle the pack hook returned.

NOTE [ threads ]: a block records the thread that entered it; work other threads do meanwhile is
excluded, never mixed in. Module calls from other threads are filtered by thread id; saved-tensor
hooks and the tracker's dispatch mode are thread-local, and the profiler source counts only this
thread's allocations (measured: a worker's 2 MB training step left ``peak_bytes`` unchanged). A
backward pass or ``autograd.grad`` started by another thread runs unobserved (no steps), even on
this block's graph. Blocks in several threads may run at once (see NOTE [ shared patches ]),
except that only one at a time can use the profiler (see NOTE [ one profiler at a time ]);
nesting blocks in one thread is refused.
"""

from __future__ import annotations

import bisect
import contextlib
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from gradscope import _held
from gradscope.errors import GradscopeError, MemoryBudgetExceeded
from gradscope.memory import (
    MODULE_MARK,
    AllocEvent,
    CudaSource,
    EvalScope,
    ProfilerSource,
    TrackerSource,
    nvml_device_totals,
    parse_size,
    resolve_memory,
)
from gradscope.recording import (
    Edge,
    Kind,
    MemoryPoint,
    Node,
    Peak,
    Phase,
    Recording,
    SavedTensor,
    Step,
    Where,
)

__all__ = ["record"]

_ACC = 18446744073709551615  # AccumulateGrad's sequence number (UINT64_MAX)
_DEEP_GRAPH = 40_000  # nodes above which freeing may crash PyTorch: see NOTE [ freeing deep graphs ]
_ROOT_RING = 4096  # how many recent results are remembered (weakly) as candidate graph roots
_active = threading.local()
# NOTE [ shared patches ]: the engine's entry point and torch.func's hooks guard are process-wide,
# but recordings are per thread and may end in any order (a widget re-measuring in a background
# thread while a cell records). One dispatcher per patched name is installed while any recording
# is active; it sends each call to the recording of the calling thread (or straight through), and
# the original comes back when the last recording ends, whatever the order.
_patch_lock = threading.Lock()
_patch_users: dict[int, Any] = {}  # thread id -> active recorder
_patch_saved: dict[tuple[Any, str], Any] = {}  # (module, attribute) -> original


def _join_patches(rec: Any, patches: list[tuple[Any, str, Callable[[Any], Any]]]) -> None:
    with _patch_lock:
        if not _patch_users:
            for obj, attr, make in patches:
                orig = getattr(obj, attr)
                _patch_saved[(obj, attr)] = orig
                setattr(obj, attr, make(orig))
        _patch_users[rec._tid] = rec


def _leave_patches(rec: Any) -> None:
    with _patch_lock:
        tid = rec._tid
        if _patch_users.get(tid) is rec:
            del _patch_users[tid]
        if not _patch_users:
            for (obj, attr), orig in _patch_saved.items():
                setattr(obj, attr, orig)
            _patch_saved.clear()


def _engine_dispatch(orig: Callable[..., Any]) -> Callable[..., Any]:
    def run(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _patch_users.get(threading.get_ident())
        if rec is None:
            return orig(t_outputs, *args, **kwargs)
        create = bool(args[2]) if len(args) > 2 else bool(kwargs.get("create_graph", False))
        return rec._run_backward(orig, t_outputs, create, args, kwargs)

    return run


# NOTE [ torch.func and our hooks ]: torch.func's grad, vjp, jacrev and hessian refuse to run
# while any saved_tensors_hooks pair is active (they enter
# ``torch.autograd.graph.disable_saved_tensors_hooks``, which raises then). While a block runs,
# the guard below takes our pair off this thread's stack for the transform's duration and puts it
# back after, whatever happens; backward passes inside it run unobserved. The transform's internal
# graph and saves are not recorded, and the recording says so. It is installed with the engine's
# patch (see NOTE [ shared patches ]).
def _func_guard(orig: Callable[..., Any]) -> Callable[..., Any]:
    """See NOTE [ torch.func and our hooks ]."""

    @contextlib.contextmanager
    def guard(error_message: str) -> Any:
        rec = _patch_users.get(threading.get_ident())
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if rec is None or top is None or getattr(top[0], "__self__", None) is not rec:
            with orig(error_message):
                yield
            return
        owner: Any = rec
        torch._C._autograd._pop_saved_tensors_default_hooks()
        owner._func_depth += 1
        owner._func_regions += 1
        try:
            with orig(error_message):
                yield
        finally:
            owner._func_depth -= 1
            torch._C._autograd._push_saved_tensors_default_hooks(owner._pack, _unpack)

    return guard


class _NodeInfo:
    __slots__ = ("id", "name", "order", "module", "leaf", "leaf_shape", "executed", "seq",
                 "walked", "saved_read", "custom", "leaf_ref", "creator")

    def __init__(self, id: int, name: str, order: int, seq: int | None) -> None:
        self.id = id
        self.name = name
        self.order = order
        self.module: str | None = None
        self.leaf: str | None = None
        self.leaf_shape: tuple[int, ...] | None = None
        self.executed = 0
        self.seq = seq
        self.walked = False
        self.saved_read = False
        self.custom = False
        self.leaf_ref: Any = None
        self.creator: _NodeInfo | None = None  # for order >= 1: the node whose formula made it


class _SavedRaw:
    __slots__ = ("sid", "seq", "node", "attribute", "shape", "dtype", "device", "bytes", "skey",
                 "ptr", "kind", "name", "t_ns", "ref", "freed_at_step", "leafish")
    sid: int
    seq: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    skey: int
    ptr: int
    kind: Kind
    name: str | None
    t_ns: int
    ref: StorageWeakRef | None
    leafish: bool

    def __init__(self) -> None:
        self.node: _NodeInfo | None = None
        self.attribute = ""
        self.freed_at_step: int | None = None


class _Packed:
    """What the pack hook returns: the tensor's data (the node keeps its storage alive exactly as
    it would keep the tensor itself; see NOTE [ pack a detached tensor ]) plus the id of its
    metadata row and a weak link to the recorder."""

    __slots__ = ("t", "sid", "owner", "version", "__weakref__")

    def __init__(self, t: torch.Tensor, sid: int, owner: Any) -> None:
        self.t = t
        self.sid = sid
        self.owner = owner
        try:
            self.version: int | None = t._version  # shared with the saved tensor (detach shares it)
        except (RuntimeError, AttributeError):
            self.version = None


def _unpack(p: Any) -> torch.Tensor:
    if not isinstance(p, _Packed):  # saved before the hooks were ours
        return p
    # NOTE [ in-place checks ]: while saved-tensor hooks are active PyTorch does not check that a
    # saved tensor was left unmodified (measured: no error, silently different gradients), so a
    # program that fails without gradscope would run with wrong gradients under it. The check is
    # made here, with PyTorch's words.
    if p.version is not None and p.t._version != p.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{p.t.type()} {list(p.t.shape)}] is at version {p.t._version}; expected "
            f"version {p.version} instead. (Checked by gradscope, as PyTorch does without "
            "saved-tensor hooks.) Hint: remove the in-place operation, or clone the tensor first."
        )
    rec = p.owner() if p.owner is not None else None
    if rec is not None and rec._reading is not None:
        rec._note_read(p.sid)
    return p.t


class _Call:
    __slots__ = ("idx", "root", "rel", "seq0", "seq1", "t0", "t1", "handle")
    idx: int
    root: int
    rel: str
    seq0: int
    seq1: int
    t0: int
    t1: int
    handle: Any


class _Step:
    __slots__ = ("index", "info", "backward", "t0", "t1", "live_before", "live_after", "freed")
    index: int
    info: _NodeInfo
    backward: int
    t0: int
    t1: int
    live_before: int | None
    live_after: int | None
    freed: int


class record:  # noqa: N801 - reads like a function, as torch.no_grad does
    """Record the autograd graph, saved tensors, backward steps and memory of a block.

    Args:
        memory: ``"auto"`` (CUDA allocator on a GPU, else the CPU allocator's events), ``"cpu"``,
            ``"cuda"``, ``"tracker"`` (online storage tracker; also used with a budget) or ``"off"``.
        budget: a simulated device size (``"8GiB"`` or bytes). Crossing it raises
            :class:`~gradscope.MemoryBudgetExceeded` at the allocation that crosses it.
        label: a name for the recording.
        modules: a module or ``{"name": module}`` to name the roots of module paths. By default
            the root modules called in the block are found by themselves.
        max_events: bound on timeline points kept (the peak is always exact and kept).
        history: on CUDA, also record the caching allocator's event history for the timeline.

    Example:
        >>> import torch, gradscope as gs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> with gs.record(memory="off") as rec:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sorted(n.leaf for n in rec.recording.nodes if n.leaf)
        ['0.bias', '0.weight']
    """

    def __init__(self, memory: str = "auto", *, budget: int | str | None = None, label: str = "",
                 modules: nn.Module | Mapping[str, nn.Module] | None = None,
                 max_events: int | None = 200_000, history: bool = False) -> None:
        self._budget = parse_size(budget)
        self._memory = resolve_memory(memory, self._budget)
        if max_events is not None and (not isinstance(max_events, int) or max_events < 2):
            raise GradscopeError(f"gradscope: max_events must be an int >= 2 or None, got {max_events!r}.")
        if modules is not None and not isinstance(modules, nn.Module | Mapping):
            raise GradscopeError(
                "gradscope: modules= takes an nn.Module or a dict {'name': module}, "
                f"got {type(modules).__name__}."
            )
        self._label = label
        self._max_events = max_events
        self._history = history
        # The device type the tracker counts; gs.predict sets "meta" (see gradscope.predict).
        self._tracker_device = "cpu"
        self._given_roots: dict[int, str] = {}
        if isinstance(modules, nn.Module):
            self._given_roots[id(modules)] = ""
        elif modules is not None:
            for k, m in modules.items():
                if not isinstance(m, nn.Module):
                    raise GradscopeError(f"gradscope: modules[{k!r}] is not an nn.Module.")
                self._given_roots[id(m)] = str(k)
        self.recording: Recording | None = None
        self._entered = False
        self._exc: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> record:
        if self._entered:
            raise GradscopeError("gradscope: a gs.record object can be used once; create a new one.")
        if getattr(_active, "rec", None) is not None:
            raise GradscopeError(
                "gradscope: gs.record blocks cannot be nested (only the innermost saved-tensor hooks "
                "would apply, so the outer numbers would be wrong). Record the outer block only, or "
                "run the inner part in its own block."
            )
        self._entered = True
        self._init_state()
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        _active.rec = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        _active.rec = None
        self._exc = exc
        t1 = time.time_ns()
        internal: BaseException | None = None
        try:
            self._uninstall()  # first: nothing that fails below may leave a hook installed
        except Exception as e:  # never mask the user's exception with ours
            internal = e
        self._stack.clear()  # module calls that raised: never keep a user's module alive
        try:
            self._remember_frame_roots(sys._getframe(1))
        except Exception as e:
            internal = internal or e
        error = None
        if exc_type is not None:
            error = f"{exc_type.__name__}: {exc}"
        try:
            self.recording = self._finalize(t1, complete=exc_type is None, error=error)
        except Exception as e:
            internal = internal or e
            self.recording = Recording(label=self._label, complete=False,
                                       error=error or f"gradscope internal error: {e!r}")
        if internal is not None and exc_type is None:
            raise GradscopeError(
                f"gradscope: recording failed inside gradscope ({internal!r}); every hook was removed. "
                "Please report this with the code that triggered it."
            ) from internal
        return False

    def _remember_frame_roots(self, frame: Any) -> None:
        """Results the block left in local variables (``loss = ...``) are roots of the graph even
        when no backward ran. Only weak references are kept.

        NOTE [ f_locals keeps tensors alive ]: before Python 3.13, reading a function frame's
        ``f_locals`` stores a snapshot dict of its locals on the frame, which keeps every value
        the function later ``del``s (a loss and its whole graph, a batch) alive until it returns.
        The snapshot is emptied after reading; anything that reads ``f_locals`` or ``locals()``
        again (a debugger, a trace function) gets a fresh one, so the function is unaffected."""
        try:
            local_ns = frame.f_locals
            values = list(local_ns.values())
        except Exception:
            return
        if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1 and local_ns is not frame.f_globals:
            local_ns.clear()  # CO_OPTIMIZED: a function's snapshot, not a real namespace
        for v in values:
            items = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else (v,)
            for t in list(items)[:1000]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    self._ring.append(weakref.ref(t))

    def add_roots(self, *tensors: torch.Tensor) -> None:
        """Name more results whose graphs belong to this recording (before the block ends)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._ring.append(weakref.ref(t))

    def _init_state(self) -> None:
        self._tid = threading.get_ident()
        self._self_ref = weakref.ref(self)
        self._hook_pre, self._hook_post = _shared_hooks(self._self_ref)
        self._t0 = time.time_ns()
        self._seq0 = torch._C._autograd._get_sequence_nr()
        self._by_key: dict[Any, _NodeInfo] = {}
        self._infos: list[_NodeInfo] = []
        self._edges: dict[tuple[int, int], None] = {}
        self._saved: list[_SavedRaw] = []
        self._saved_by_seq: dict[int, list[_SavedRaw]] = {}
        self._saved_by_skey: dict[int, list[_SavedRaw]] = {}
        self._saved_by_node: dict[int, list[_SavedRaw]] = {}
        self._reading: tuple[_NodeInfo, str] | None = None
        self._ring: deque[Any] = deque(maxlen=_ROOT_RING)
        self._calls: list[_Call] = []
        self._stack: list[tuple[nn.Module, _Call]] = []
        self._roots: list[tuple[Any, str, str | None]] = []  # (weakref to module, class name, given name)
        self._root_index: dict[int, int] = {}
        self._module_paths: list[dict[int, str]] = []
        self._param_by_id: dict[int, tuple[Any, int, str]] = {}
        self._param_skeys: dict[int, tuple[int, str, Kind]] = {}
        self._baseline_storages: dict[int, int] = {}
        self._steps: list[_Step] = []
        self._cur: _Step | None = None
        self._pending: _Step | None = None
        self._backward_idx = -1
        self._create_graph = False
        self._notes: list[str] = []
        self._foreign_saves = 0
        self._bw_calls: list[dict[str, Any]] = []  # for gs.diagnose, see gradscope._held
        self._exc = None
        self._func_depth = 0  # inside a torch.func transform: see NOTE [ torch.func and our hooks ]
        self._func_regions = 0
        self._source: Any = None

    def _install(self) -> None:
        src = self._make_source()
        hooks = saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._mod_pre))
        self._handles.append(nn.modules.module.register_module_forward_hook(self._mod_post))
        self._patch_engine()
        if src is not None:
            src.start()
            self._source = src
            self._undo.append(src.stop)

    def _uninstall(self) -> None:
        first: BaseException | None = None
        while self._stack:  # module calls left open by an exception inside a forward
            _, call = self._stack.pop()
            call.seq1 = torch._C._autograd._get_sequence_nr()
            call.t1 = time.time_ns()
            try:
                _close_marker(call)
            except Exception as e:
                first = first or e
        for h in self._handles:
            try:
                h.remove()
            except BaseException as e:  # a KeyboardInterrupt here must not skip the rest
                first = first or e
        self._handles.clear()
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _make_source(self) -> Any:
        m = self._memory
        if m == "cpu":
            return ProfilerSource()
        if m == "tracker":
            return TrackerSource(self._tracker_device, self._budget, step_of=self._step_index,
                                 call_of=self._call_index)
        if m == "cuda":
            if not torch.cuda.is_available():
                raise GradscopeError(
                    "gradscope: memory='cuda' but CUDA is not available here; use memory='cpu', or "
                    "gs.predict(..., device='cuda') to estimate CUDA memory without a GPU."
                )
            return CudaSource(history=self._history, step_of=self._step_index, call_of=self._call_index)
        return None

    def _step_index(self) -> int | None:
        return None if self._cur is None else self._cur.index

    def _call_index(self) -> int | None:
        return self._stack[-1][1].idx if self._stack else None

    # ------------------------------------------------------------------ engine interception
    def _patch_engine(self) -> None:
        import torch.autograd as ag

        if hasattr(ag, "_engine_run_backward"):  # see NOTE [ shared patches ]
            import torch.autograd.graph as agg

            self._undo.append(lambda: _leave_patches(self))
            _join_patches(self, [(ag, "_engine_run_backward", _engine_dispatch),
                                 (agg, "disable_saved_tensors_hooks", _func_guard)])
        else:  # older torch: wrap the two public entry points
            orig_b, orig_g = ag.backward, ag.grad

            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                return self._run_backward(lambda *a, **k: orig_b(tensors, *args, **kwargs),
                                          tensors, bool(kwargs.get("create_graph", False)), (), {})

            def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
                return self._run_backward(lambda *a, **k: orig_g(outputs, *args, **kwargs),
                                          outputs, bool(kwargs.get("create_graph", False)), (), {})

            ag.backward, ag.grad = backward, grad

            def restore() -> None:
                ag.backward, ag.grad = orig_b, orig_g

            self._undo.append(restore)

    def _run_backward(self, orig: Callable[..., Any], t_outputs: Any, create: bool,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() != self._tid or self._cur is not None or self._func_depth:
            # Another thread, or a backward started from inside a node (reentrant checkpoint):
            # run it unobserved by the step hooks (its nodes are still found later).
            return orig(t_outputs, *args, **kwargs)
        roots = []
        for t in t_outputs if isinstance(t_outputs, list | tuple) else (t_outputs,):
            fn = _node_of(t)
            if fn is not None:
                roots.append(fn)
        handles: list[Any] = []
        self._backward_idx += 1
        self._create_graph = create
        self._bw_calls.append({"create_graph": create, "retain_graph": bool(args[1]) if len(args) > 1 else create,
                               "api": "backward" if kwargs.get("accumulate_grad", True) else "autograd.grad"})
        try:
            try:
                self._discover(roots, order=0, module=None, hook_into=handles)
            except Exception as e:  # the user's backward runs whatever happens to observing
                self._internal(e)
            return orig(t_outputs, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            try:
                self._settle_pending()
            except Exception as e:
                self._internal(e)
            self._cur = None
            self._create_graph = False

    # ------------------------------------------------------------------ graph discovery
    def _key(self, fn: Any) -> Any:
        seq = fn._sequence_nr()
        if seq == _ACC:
            try:
                return ("acc", id(fn.variable))
            except (AttributeError, RuntimeError):
                return ("obj", id(fn))
        return seq

    def _info(self, fn: Any, order: int, module: str | None,
              creator: _NodeInfo | None = None) -> _NodeInfo:
        key = self._key(fn)
        info = self._by_key.get(key)
        if info is not None and info.leaf_ref is not None and info.leaf_ref() is None:
            info = None  # a leaf died and its id() was reused
        if info is None:
            seq = None if isinstance(key, tuple) else key
            info = _NodeInfo(len(self._infos), _node_name(fn.name()), order, seq)
            info.module = module
            info.creator = creator
            if isinstance(key, tuple) and key[0] == "acc":
                var = fn.variable
                info.leaf_ref = weakref.ref(var)
                info.leaf_shape = tuple(var.shape)
                named = self._param_by_id.get(id(var))
                if named is not None and named[0]() is var:
                    info.leaf = self._full_name(named[1], named[2])
                else:
                    info.leaf = "input"
            elif isinstance(fn, torch.autograd.function.BackwardCFunction):
                info.custom = True
            self._by_key[key] = info
            self._infos.append(info)
        return info

    def _discover(self, roots: Iterable[Any], order: int, module: str | None,
                  hook_into: list[Any] | None = None, creator: _NodeInfo | None = None) -> None:
        """Walk from ``roots`` through ``next_functions`` (iteratively). New nodes get ``order``
        and ``module``. Without ``hook_into`` the walk stops at nodes already walked; with it,
        every node reached gets step hooks for this backward pass."""
        stack = [r for r in roots if r is not None]
        visited: set[int] = set()
        while stack:
            fn = stack.pop()
            info = self._info(fn, order, module, creator)
            if info.id in visited:
                continue
            visited.add(info.id)
            if not info.saved_read:
                self._read_saved(fn, info)
            if hook_into is not None:
                # One pair of hook functions serves every node (fewer objects per pass, so less
                # work for Python's garbage collector); the node comes from the engine itself.
                hook_into.append(fn.register_prehook(self._hook_pre))
                hook_into.append(fn.register_hook(self._hook_post))
            elif info.walked:
                continue
            info.walked = True
            for nxt, _ in fn.next_functions:
                if nxt is None:
                    continue
                ninfo = self._info(nxt, order, module, creator)
                self._edges[(ninfo.id, info.id)] = None
                if ninfo.id not in visited:
                    stack.append(nxt)

    def _read_saved(self, fn: Any, info: _NodeInfo) -> None:
        info.saved_read = True
        if info.custom:
            attrs = ["saved_tensors"]
        else:
            attrs = _saved_attrs(fn)
        for attr in attrs:
            if self._foreign(fn, attr):
                continue  # see NOTE [ saves packed by other hooks ]
            self._reading = (info, attr)
            try:
                value = getattr(fn, attr)
            except (RuntimeError, AttributeError):
                value = None
            finally:
                self._reading = None
            del value

    def _foreign(self, fn: Any, attr: str) -> bool:
        """NOTE [ saves packed by other hooks ]: only the innermost saved_tensors_hooks pair
        applies, so a user's own pair, ``save_on_cpu`` or a non-reentrant checkpoint inside the
        block hides saves from our pack hook. The raw saved variable names its unpack hook without
        unpacking: saves whose hook is not ours are counted for the recording's notes and are never
        unpacked by us (their unpack may recompute a checkpointed segment or copy to a device)."""
        name = "_raw" + attr if attr.startswith("_saved_") else "_raw_saved_tensors"
        try:
            raw = getattr(fn, name, None)
        except (RuntimeError, AttributeError):
            return False
        n = 0
        for r in raw if isinstance(raw, list | tuple) else (raw,):
            hook = getattr(r, "unpack_hook", None)  # None: saved without hooks, or already freed
            if hook is not None and hook is not _unpack:
                n += 1
        self._foreign_saves += n
        return n > 0

    def _note_read(self, sid: int) -> None:
        assert self._reading is not None
        info, attr = self._reading
        if not 0 <= sid < len(self._saved):
            return
        s = self._saved[sid]
        if s.node is None or s.node is info:
            if s.node is None:
                self._attach_saved(s, info)
            if not s.attribute:
                s.attribute = attr

    def _attach_saved(self, s: _SavedRaw, info: _NodeInfo) -> None:
        s.node = info
        self._saved_by_node.setdefault(info.id, []).append(s)

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            return self._pack_one(t)
        except Exception as e:  # observing must never break the model: save the tensor as is
            self._internal(e)
            return t

    def _pack_one(self, t: torch.Tensor) -> Any:
        # No thread filter here: saved-tensor hooks are thread-local, and the autograd engine
        # carries them into its device threads only for backward passes started in this block.
        s = _SavedRaw()
        s.sid = len(self._saved)
        s.seq = torch._C._autograd._get_sequence_nr() - 1
        s.t_ns = time.time_ns()
        s.shape = tuple(t.shape)
        s.dtype = str(t.dtype).replace("torch.", "")
        s.device = str(t.device)
        try:
            storage = t.untyped_storage()
            s.bytes = int(storage.nbytes())
            s.ptr = int(storage.data_ptr())
            ref = StorageWeakRef(storage)
            s.skey = int(ref.cdata)
            s.ref = ref
        except (RuntimeError, NotImplementedError, TypeError):
            s.bytes = t.numel() * t.element_size()
            s.ptr = 0
            s.skey = -(s.sid + 1)
            s.ref = None
        s.name = None
        s.kind = Kind.ACTIVATION
        s.leafish = t.grad_fn is None
        named = self._param_skeys.get(s.skey)
        if named is not None:
            s.kind = named[2]
            s.name = self._full_name(named[0], named[1])
        elif s.leafish:
            s.kind = Kind.INPUT
        else:
            self._ring.append(weakref.ref(t))
        self._saved.append(s)
        self._saved_by_seq.setdefault(s.seq, []).append(s)
        self._saved_by_skey.setdefault(s.skey, []).append(s)
        # NOTE [ pack a detached tensor ]: a node that saves its own output (exp, tanh, relu)
        # would hold the output, whose grad_fn is that node: a cycle through C++ that Python's
        # collector cannot break, so a graph never run backward (or run with retain_graph) lived
        # forever. Unpack rebuilds autograd metadata from the saved variable, not from the tensor
        # the hook returns, so keeping only the data (as PyTorch does without hooks) is exact.
        return _Packed(t.detach(), s.sid, self._self_ref)

    def _mod_pre(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() != self._tid:
            return
        try:
            call = _Call()
            if self._stack:
                root = self._stack[-1][1].root
                parent_rel = self._stack[-1][1].rel
            else:
                root = self._root_of(module)
                parent_rel = None
            rel = self._module_paths[root].get(id(module))
            if rel is None:
                cls = type(module).__name__
                rel = cls if parent_rel in (None, "") else f"{parent_rel}.{cls}"
            call.root, call.rel = root, rel
            call.idx = len(self._calls)
            call.handle = None
            if isinstance(self._source, ProfilerSource):  # see NOTE [ module markers ]
                call.handle = torch.ops.profiler._record_function_enter_new(f"{MODULE_MARK}{call.idx}", None)
            call.seq0 = torch._C._autograd._get_sequence_nr()
            call.t0 = time.time_ns()
            call.seq1, call.t1 = call.seq0, call.t0
            self._calls.append(call)
            self._stack.append((module, call))
            if isinstance(self._source, CudaSource):
                self._source.sample(type(module).__name__)
        except Exception as e:  # observing must never break the model
            self._internal(e)

    def _mod_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._tid:
            return
        try:
            while self._stack:
                m, call = self._stack.pop()
                call.seq1 = torch._C._autograd._get_sequence_nr()
                call.t1 = time.time_ns()
                _close_marker(call)
                if m is module:
                    break
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:
                self._ring.append(weakref.ref(output))
            if isinstance(self._source, CudaSource):
                self._source.sample(type(module).__name__ + " done")
        except Exception as e:
            self._internal(e)

    def _root_of(self, module: nn.Module) -> int:
        idx = self._root_index.get(id(module))
        if idx is not None and self._roots[idx][0]() is module:
            return idx
        idx = len(self._roots)
        self._root_index[id(module)] = idx
        given = self._given_roots.get(id(module))
        self._roots.append((weakref.ref(module), type(module).__name__, given))
        self._module_paths.append({id(m): name for name, m in module.named_modules()})
        for name, p in module.named_parameters():
            self._param_by_id[id(p)] = (weakref.ref(p), idx, name)
            k = _skey(p)
            if k is not None:
                self._param_skeys.setdefault(k, (idx, name, Kind.PARAMETER))
                self._baseline_storages[k] = p.untyped_storage().nbytes()
        for name, b in module.named_buffers():
            k = _skey(b)
            if k is not None:
                self._param_skeys.setdefault(k, (idx, name, Kind.BUFFER))
                self._baseline_storages[k] = b.untyped_storage().nbytes()
        return idx

    def _full_name(self, root: int, rel: str) -> str:
        prefix = self._root_prefix(root)
        if not prefix:
            return rel
        return prefix if not rel else f"{prefix}.{rel}"

    def _call_path(self, call: _Call) -> str:
        """The module path of one call; an unnamed single root is called by its class name."""
        return self._full_name(call.root, call.rel) or self._roots[call.root][1]

    def _root_prefix(self, root: int) -> str:
        _, cls, given = self._roots[root]
        if given is not None:
            return given
        if len(self._roots) == 1 and not self._given_roots:
            return ""
        same = [i for i, r in enumerate(self._roots) if r[1] == cls and r[2] is None]
        return cls if len(same) <= 1 else f"{cls}#{same.index(root)}"

    def _running_info(self) -> _NodeInfo | None:
        fn = torch._C._current_autograd_node()
        if fn is None:
            return None
        return self._by_key.get(self._key(fn))

    def _pre(self, info: _NodeInfo, grad_outputs: Any) -> None:
        try:
            self._settle_pending()
            st = _Step()
            st.index = len(self._steps)
            st.info = info
            st.backward = self._backward_idx
            st.freed = 0
            src = self._source
            st.live_before = src.live() if src is not None and src.online else None
            st.live_after = None
            st.t0 = time.time_ns()
            st.t1 = st.t0
            info.executed += 1
            self._steps.append(st)
            self._cur = st
            if isinstance(src, CudaSource):
                src.sample(info.name, st.index)
        except Exception as e:
            self._internal(e)

    def _post(self, info: _NodeInfo, grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            st = self._cur
            if st is None or st.info is not info:
                return
            st.t1 = time.time_ns()
            if self._create_graph:
                made = [g.grad_fn for g in grad_inputs
                        if isinstance(g, torch.Tensor) and g.grad_fn is not None]
                if made:
                    self._discover(made, order=info.order + 1, module=None, creator=info)
            self._pending = st
            self._cur = None
        except Exception as e:
            self._internal(e)

    def _settle_pending(self) -> None:
        """The engine frees a node's saved tensors right after its post hook; at the next step's
        pre hook (or at the end of the pass) we check which of them are gone."""
        st, self._pending = self._pending, None
        if st is None:
            return
        src = self._source
        if src is not None and src.online:
            if isinstance(src, TrackerSource):
                src.sweep()
            st.live_after = src.live()
            if isinstance(src, CudaSource):
                src.sample(st.info.name + " done", st.index)
        freed_keys: set[int] = set()
        for s in self._saved_for(st.info):
            if s.freed_at_step is None and s.ref is not None and s.ref.expired():
                s.freed_at_step = st.index
                if s.skey not in freed_keys:
                    freed_keys.add(s.skey)
                    st.freed += s.bytes
        if freed_keys:
            # Other saves of the same storages (by nodes that already ran) are gone too.
            # (Looked up by storage: a scan of every save here made backward quadratic.)
            for k in freed_keys:
                for s in self._saved_by_skey.get(k, ()):
                    if s.freed_at_step is None:
                        s.freed_at_step = st.index

    def _saved_for(self, info: _NodeInfo) -> list[_SavedRaw]:
        out = list(self._saved_by_node.get(info.id, ()))
        if info.seq is not None:
            for s in self._saved_by_seq.get(info.seq, ()):
                if s.node is None:
                    self._attach_saved(s, info)
                    out.append(s)
        return out

    def _internal(self, e: BaseException) -> None:
        if isinstance(e, MemoryBudgetExceeded):
            raise e
        msg = f"gradscope internal error while observing: {e!r}"
        if msg not in self._notes:
            self._notes.append(msg)

    # ------------------------------------------------------------------ finalize
    def _finalize(self, t1: int, complete: bool, error: str | None) -> Recording:
        # Roots never passed to backward: recent op outputs and module outputs still alive.
        live_roots = []
        for ref in list(self._ring):
            t = ref()
            if t is not None and t.grad_fn is not None:
                live_roots.append(t.grad_fn)
        self._ring.clear()
        self._discover(live_roots, order=0, module=None)
        del live_roots
        self._assign_modules()
        # Saves that were never read back are attached through their sequence number.
        by_seq = {i.seq: i for i in self._infos if i.seq is not None}
        dropped = 0
        for s in self._saved:
            if s.node is None:
                info = by_seq.get(s.seq)
                if info is None:
                    dropped += 1
                    continue
                self._attach_saved(s, info)
        if dropped:
            self._notes.append(
                f"{dropped} saved tensors belonged to nodes that were freed before gradscope saw them; "
                "they are not listed."
            )
        if any(i.custom for i in self._infos):
            self._notes.append(
                "custom autograd.Function nodes are present: tensors they keep as ctx attributes "
                "(ctx.x = t) bypass saved-tensor hooks and are not counted; save_for_backward is counted."
            )
        compiled = sum(1 for i in self._infos if i.name == "CompiledFunctionBackward")
        if compiled:
            self._notes.append(
                f"{compiled} torch.compile'd regions ran as single CompiledFunctionBackward nodes: the "
                "operations inside them are not shown; the tensors they save for backward are counted"
                + ("; allocations made inside compiled code are not seen by memory='tracker' (use "
                   "memory='cpu')." if self._memory == "tracker" else ".")
            )
        seq_end = torch._C._autograd._get_sequence_nr()
        created = seq_end - self._seq0
        seen_created = sum(1 for i in self._infos if i.seq is not None and i.seq >= self._seq0)
        if self._memory == "off":
            timeline: list[MemoryPoint] = []
            peak_bytes, peak, dropped_points = 0, None, 0
        else:
            timeline, peak_bytes, peak, dropped_points = self._timeline(t1)
        nodes = tuple(
            Node(id=i.id, name=i.name, order=i.order, module=i.module, leaf=i.leaf,
                 leaf_shape=i.leaf_shape, executed=i.executed)
            for i in self._infos
        )
        saved = tuple(
            SavedTensor(node=n.id, attribute=s.attribute or f"saved[{k}]", shape=s.shape,
                        dtype=s.dtype, device=s.device, bytes=s.bytes, storage=self._storage_id(s.skey),
                        kind=self._final_kind(s), module=n.module, name=s.name,
                        freed_at_step=s.freed_at_step)
            for k, (s, n) in enumerate((x, x.node) for x in self._saved if x.node is not None)
        )
        steps = tuple(
            Step(index=st.index, node=st.info.id, backward=st.backward, start_s=(st.t0 - self._t0) / 1e9,
                 duration_s=(st.t1 - st.t0) / 1e9, live_before=st.live_before,
                 live_after=st.live_after, freed_bytes=st.freed)
            for st in self._steps
        )
        baseline = self._baseline(saved)
        reserved_peak = total = None
        device = "cpu"
        if isinstance(self._source, CudaSource):
            baseline = self._source.baseline
            reserved_peak = self._source.reserved_peak
            device = str(self._source.device)
            nv = nvml_device_totals(self._source.device.index or 0)
            total = nv["total"] if nv else self._source.total
        notes = list(self._notes)
        if self._foreign_saves:
            notes.append(
                f"{self._foreign_saves} saved tensors were packed by other saved_tensors_hooks (a "
                "user's own pair, save_on_cpu or non-reentrant checkpoint inside the block; only the "
                "innermost pair applies): gradscope cannot see or size them, so saved bytes are "
                "undercounted."
            )
        if len(self._infos) > _DEEP_GRAPH:
            # NOTE [ freeing deep graphs ]: measured on torch 2.13: once Python has walked a graph
            # through next_functions (any walk: ours, torchviz's), PyTorch frees a chain deeper
            # than ~50,000 nodes recursively and overflows the C stack (segmentation fault).
            notes.append(
                f"{len(self._infos)} nodes: if this graph is a long chain, PyTorch may crash freeing "
                "it once Python has walked it (a stack overflow; any graph walk, gradscope's or "
                "torchviz's, triggers it). Keep every ~10,000th intermediate result and drop them "
                "last-first, so that the chain is freed in pieces."
            )
        for failure in getattr(self._source, "failures", ()):
            notes.append(f"gradscope internal error while tracking memory (bytes may be missing): {failure}")
        if self._func_regions:
            notes.append(
                f"{self._func_regions} torch.func transform calls (grad, vjp, jacrev, ...) ran inside "
                "the block; they allow no saved-tensor hooks, so gradscope stepped aside inside them: "
                "their internal graph and saved tensors are not recorded (memory still is)."
            )
        extra: dict[str, Any] = {"nodes_created": created, "nodes_created_seen": seen_created}
        extra.update(_held.collect(self))  # what held memory at the peak, for gs.diagnose
        return Recording(
            nodes=nodes,
            edges=tuple(Edge(a, b) for a, b in self._edges),
            saved=saved,
            steps=steps,
            timeline=tuple(timeline),
            peak_bytes=peak_bytes,
            baseline_bytes=baseline,
            peak=peak,
            where=_where(device, self._memory),
            complete=complete,
            error=error,
            notes=tuple(notes),
            label=self._label,
            wall_time_s=(t1 - self._t0) / 1e9,
            backward_passes=self._backward_idx + 1,
            reserved_peak_bytes=reserved_peak,
            device_total_bytes=total,
            timeline_dropped=dropped_points,
            extra=extra,
        )

    def _storage_id(self, skey: int) -> int:
        ids = self.__dict__.setdefault("_sids", {})
        return ids.setdefault(skey, len(ids))

    def _final_kind(self, s: _SavedRaw) -> Kind:
        if s.kind is Kind.INPUT and self._allocated_inside(s):
            return Kind.ACTIVATION
        return s.kind

    def _allocated_inside(self, s: _SavedRaw) -> bool:
        src = self._source
        if src is None or not s.ptr:
            return False
        keys: dict[int, list[int]] | None = self.__dict__.get("_alloc_keys")
        if keys is None:
            keys = {}
            for e in src.events:
                if e.size > 0:
                    keys.setdefault(e.key, []).append(e.t_ns)
            self._alloc_keys = keys
        k = s.skey if isinstance(src, TrackerSource) else s.ptr
        times = keys.get(k)
        return times is not None and len(times) > 0 and times[0] <= s.t_ns

    def _baseline(self, saved: tuple[SavedTensor, ...]) -> int:
        storages = dict(self._baseline_storages)
        for s in self._saved:
            if s.node is not None and self._final_kind(s) is Kind.INPUT:
                storages[s.skey] = s.bytes
        return sum(storages.values())

    def _assign_modules(self) -> None:
        """Order-0 nodes get the innermost module call whose sequence range holds their number."""
        keyed = sorted((i.seq, i.id) for i in self._infos
                       if i.seq is not None and i.order == 0 and i.module is None)
        infos = [self._infos[k] for _, k in keyed]
        seqs = [q for q, _ in keyed]
        # Calls are appended at their start, so outer calls come before the calls nested in them:
        # writing each call's range in that order leaves every node with its innermost module.
        for call in self._calls:
            lo = bisect.bisect_left(seqs, call.seq0)
            hi = bisect.bisect_left(seqs, call.seq1)
            path = self._call_path(call)
            for i in infos[lo:hi]:
                i.module = path
        # Nodes created by create_graph inherit the module of the node whose formula made them
        # (lower orders first, so that order 2 inherits from an order 1 that already has one);
        # leaves take their parameter's module.
        for i in sorted(self._infos, key=lambda i: i.order):
            if i.order >= 1 and i.module is None and i.creator is not None:
                i.module = i.creator.module
        for i in self._infos:
            if i.leaf and i.leaf != "input" and i.module is None and "." in i.leaf:
                i.module = i.leaf.rsplit(".", 1)[0]

    def _modules_at(self, times: list[int]) -> list[str | None]:
        """The innermost module call running at each of ``times`` (sorted), in one sweep."""
        calls = self._calls  # appended at their start: sorted by start time
        out: list[str | None] = []
        open_calls: list[_Call] = []
        i = 0
        for t in times:
            while i < len(calls) and calls[i].t0 <= t:
                open_calls.append(calls[i])
                i += 1
            while open_calls and open_calls[-1].t1 < t:
                open_calls.pop()
            # a call that ended may still sit under one that is open; skip it lazily
            j = len(open_calls) - 1
            while j >= 0 and open_calls[j].t1 < t:
                j -= 1
            if j < 0:
                out.append(None)
            else:
                c = open_calls[j]
                out.append(self._call_path(c))
        return out

    def _timeline(self, t1: int) -> tuple[list[MemoryPoint], int, Peak | None, int]:
        src = self._source
        events: list[AllocEvent] = list(src.events) if src is not None else []
        step_of_scope = self._match_scopes(src.scopes if src is not None else [])
        steps = self._steps
        # Step live_before/after from a source that is not online: bisect the events by time.
        points: list[MemoryPoint] = []
        live = 0
        peak_i = -1
        peak_v = 0
        cum_t: list[int] = []
        cum_live: list[int] = []
        fwd_modules = self._modules_at([e.t_ns for e in events])
        for k, e in enumerate(events):
            live += e.size
            step = e.step
            if step is None and e.eval_index is not None:
                step = step_of_scope.get(e.eval_index)
            phase = Phase.BACKWARD if (step is not None or e.eval_index is not None) else Phase.FORWARD
            module = None
            if step is not None and step < len(steps):
                module = steps[step].info.module
            elif e.module_call is not None and e.module_call < len(self._calls):
                c = self._calls[e.module_call]
                module = self._call_path(c)
            elif phase is Phase.FORWARD:
                module = fwd_modules[k]
            points.append(MemoryPoint(t_s=(e.t_ns - self._t0) / 1e9, live=live, phase=phase,
                                      label=e.label, step=step, module=module, reserved=e.reserved))
            cum_t.append(e.t_ns)
            cum_live.append(live)
            if live > peak_v:
                peak_v, peak_i = live, len(points) - 1
        if src is not None and not src.online and src.scopes:
            for k, scope in enumerate(src.scopes):
                si = step_of_scope.get(k)
                if si is None:
                    continue
                a = bisect.bisect_left(cum_t, scope.start_ns)
                b = bisect.bisect_right(cum_t, scope.end_ns)
                steps[si].live_before = cum_live[a - 1] if a > 0 else 0
                steps[si].live_after = cum_live[b - 1] if b > 0 else 0
        peak_bytes = peak_v
        if isinstance(src, CudaSource):
            peak_bytes = max(peak_bytes, src.peak)
        peak = None
        if peak_i >= 0:
            p = points[peak_i]
            node = steps[p.step].info.id if p.step is not None and p.step < len(steps) else None
            peak = Peak(bytes=peak_bytes, phase=p.phase, t_s=p.t_s, label=p.label, node=node,
                        module=p.module, step=p.step)
        elif isinstance(src, CudaSource) and peak_bytes:
            peak = Peak(bytes=peak_bytes, phase=Phase.FORWARD, label="(allocator statistics)")
        dropped = 0
        if self._max_events is not None and len(points) > self._max_events:
            points, dropped = _downsample(points, peak_i, self._max_events)
        return points, peak_bytes, peak, dropped

    def _match_scopes(self, scopes: list[EvalScope]) -> dict[int, int]:
        """Pair the profiler's evaluate_function scopes with our steps, in order, by node name
        and sequence number (scopes of backward passes we did not observe are skipped)."""
        out: dict[int, int] = {}
        j = 0
        steps = self._steps
        for k, sc in enumerate(scopes):
            if j >= len(steps):
                break
            info = steps[j].info
            if sc.name == info.name and (info.seq is None or sc.seq == info.seq or sc.seq < 0):
                out[k] = j
                j += 1
        return out


def _close_marker(call: _Call) -> None:
    handle, call.handle = call.handle, None
    if handle is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


def _downsample(points: list[MemoryPoint], peak_i: int, limit: int) -> tuple[list[MemoryPoint], int]:
    stride = -(-len(points) // (limit - 1))
    keep = set(range(0, len(points), stride))
    keep.add(peak_i)
    keep.add(len(points) - 1)
    kept = [points[i] for i in sorted(keep)]
    return kept, len(points) - len(kept)


def _shared_hooks(ref: Any) -> tuple[Callable[[Any], None], Callable[[Any, Any], None]]:
    """Node pre/post hooks that hold the recorder weakly and look the node up as it runs."""

    def pre(grad_outputs: Any) -> None:
        rec = ref()
        if rec is not None:
            info = rec._running_info()
            if info is not None:
                rec._pre(info, grad_outputs)

    def post(grad_inputs: Any, grad_outputs: Any) -> None:
        rec = ref()
        if rec is not None:
            info = rec._running_info()
            if info is not None:
                rec._post(info, grad_inputs, grad_outputs)

    return pre, post


_SAVED_ATTRS: dict[type, list[str]] = {}


def _saved_attrs(fn: Any) -> list[str]:
    cls = type(fn)
    attrs = _SAVED_ATTRS.get(cls)
    if attrs is None:
        attrs = [a for a in dir(fn) if a.startswith("_saved_") and not a.endswith(("_sym_sizes",
                 "_sym_strides", "_sizes", "_strides"))]
        _SAVED_ATTRS[cls] = attrs
    return attrs


def _node_name(name: str) -> str:
    return name.rsplit("::", 1)[-1]


def _node_of(t: Any) -> Any:
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return t.node
    if isinstance(t, torch.Tensor):
        if t.grad_fn is not None:
            return t.grad_fn
        if t.requires_grad:
            return torch.autograd.graph.get_gradient_edge(t).node
    return None


def _skey(t: torch.Tensor) -> int | None:
    try:
        return int(StorageWeakRef(t.untyped_storage()).cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _where(device: str, memory: str) -> Where:
    rank = world = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    source = {"cpu": "cpu-allocator (profiler events)", "tracker": "storage tracker",
              "cuda": "cuda caching allocator", "off": "off"}.get(memory, memory)
    return Where(device=device, memory_source=source, torch_version=torch.__version__, rank=rank,
                 world_size=world, hostname=socket.gethostname())
