"""``gs.record()``: watch real code run and produce one immutable :class:`~gradscope.Recording`.

What is installed while a block runs, and removed in ``finally`` whatever happens:
- a ``saved_tensors_hooks`` pair (every tensor saved for backward, with its true storage bytes),
- global module forward pre/post hooks (module paths and parameter names, no user changes),
- global optimizer step pre/post hooks (optimizer phases),
- an interception of the autograd engine's entry point (backward and autograd.grad), which walks
  the graph about to run, once per node, and hooks the few nodes whose steps cannot be seen
  otherwise (see NOTE [ how steps are seen ]),
- one memory source from :mod:`gradscope.memory`.

The hooks only append rows to a :class:`~gradscope._trace.Trace`; the passes of
:mod:`gradscope._passes` turn it into the recording the first time it is asked for (see NOTE
[ capture apart from analysis ] in :mod:`gradscope._trace` and NOTE [ analysis on first look ]).

NOTE [ which node saved a tensor ]: a node's sequence number is taken from the thread's counter
before the op saves its inputs/outputs, so in the pack hook the counter minus one is the
saving node. The attribute name comes from the node's raw saved variables when the graph is
walked: a class with one saved tensor names all of its saves; otherwise each raw variable shows
the value our pack hook returned (``SavedTensor.data``; older torch: reading the attribute calls
our unpack hook with it). Saves that another pair of hooks packed are never unpacked by us.

NOTE [ how steps are seen ]: a node pre hook costs a few microseconds per node, as much as a small
op. So steps come from what happens anyway: with ``memory="cpu"`` from the profiler's own node
scopes; with ``memory="off"`` from our unpack hook (a node unpacks its saves when it runs), plus
pre hooks on ``AccumulateGrad`` and custom Function nodes; the steps of nodes that unpack nothing
of ours are given back by simulating the engine's queue (see NOTE [ steps nobody saw ] in
:mod:`gradscope._passes`). Sources that read the allocator at every step (tracker, CUDA) hook
every node. A backward with ``create_graph=True`` needs the sequence counter as each node
starts: the nodes it creates (including the engine's ``AddBackward0`` that sums gradients
reaching one input) are then given to the node that was running (see NOTE [ orders ] in
:mod:`gradscope._passes`). A node's generated code unpacks all its saved variables before it
computes anything, so the first unpack of one of our saves reads the counter there; only the
nodes that unpack nothing of ours get a pre hook for the pass's duration (measured: registering
a hook costs about 4 us, as much as the node itself on small ops).

NOTE [ threads ]: a block records the thread that entered it; work other threads do meanwhile is
excluded, never mixed in. Module and optimizer calls from other threads are filtered by thread
id; saved-tensor hooks and the tracker's dispatch mode are thread-local, and the profiler source
counts only this thread's allocations (measured: a worker's 2 MB training step left
``peak_bytes`` unchanged). A backward pass or ``autograd.grad`` started by another thread runs
unobserved (no steps), even on this block's graph. Blocks in several threads may run at once (see
NOTE [ shared patches ]), except that only one at a time can use the profiler (see NOTE [ one
profiler at a time ]); nesting blocks in one thread is refused.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import operator
import re
import sys
import threading
import time
import types
import warnings
import weakref
from collections import _count_elements  # type: ignore[attr-defined]  # Counter.update's C loop
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.parameter import is_lazy

from gradscope import _compat, _compiled, _names, _native, _passes
from gradscope._lines import LineTable, lines_enabled
from gradscope._source import OWN_FILES as _OWN_FILES
from gradscope._trace import (
    C_SEQ1,
    C_T1,
    EV_FREED,
    EV_LIVE,
    EV_POST,
    EV_PRE,
    EV_UNPACK,
    S_SEQ,
    S_SKEY,
    BackwardRow,
    Trace,
)
from gradscope._walk import _leaf_key, keys_of, node_key, node_name, roots_of, walk
from gradscope.errors import GradscopeError, MemoryBudgetExceeded
from gradscope.memory import MemorySource, make_source, parse_size, resolve_memory
from gradscope.recording import Recording

__all__ = ["record"]

_active = threading.local()


def packed_here(fn: Any) -> bool:
    """Whether the ``gs.record`` block running on this thread packed ``fn``'s saved tensors (its
    own pair: reading them unpacks through it). For :func:`gradscope.graph` on a torch that
    cannot show which pair packed a save (<= 2.8)."""
    rec = getattr(_active, "rec", None)
    if rec is None:
        return False
    return rec._packed(_compat.node_sequence_nr(fn))

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
        return rec._run_backward(orig, t_outputs, args, kwargs)

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
        if rec is None or not rec._hooks_on_top():
            with orig(error_message):
                yield
            return
        owner: Any = rec
        _compat.pop_saved_tensors_hooks()
        owner._func_enter()
        try:
            with orig(error_message):
                yield
        finally:
            owner._func_exit()
            _compat.push_saved_tensors_hooks(owner._pack, owner._unpack)

    return guard


# NOTE [ other pairs on an older torch ]: a torch without ``SavedTensor.unpack_hook`` (<= 2.8)
# cannot say who packed a saved variable. There, while a block runs, the push and pop of every
# other saved_tensors_hooks pair (a user's, save_on_cpu, non-reentrant checkpoint) are watched
# (see NOTE [ shared patches ]): nodes made while one was innermost had their saves packed by it.
def _pair_enter(orig: Callable[..., Any]) -> Callable[..., Any]:
    def enter(self: Any) -> Any:
        out = orig(self)
        rec = _patch_users.get(threading.get_ident())
        if rec is not None and getattr(self, "pack_hook", None) is not rec._pack:
            rec._other_pair(True)
        return out

    return enter


def _pair_exit(orig: Callable[..., Any]) -> Callable[..., Any]:
    def exit_(self: Any, *exc: Any) -> Any:
        rec = _patch_users.get(threading.get_ident())
        if rec is not None and getattr(self, "pack_hook", None) is not rec._pack:
            rec._other_pair(False)
        return orig(self, *exc)

    return exit_


class _State:
    """What the hooks read and change while the block runs (attribute access is cheap)."""

    __slots__ = ("bw", "func_depth", "last_seq", "marks", "pending", "prev_node", "reading", "stack")

    def __init__(self) -> None:
        self.bw: BackwardRow | None = None  # the observed backward running now
        self.func_depth = 0
        self.last_seq = -1  # the node of the last step event (off mode)
        self.marks = False  # a node's first unpack is a step event (see NOTE [ how steps are seen ])
        self.pending: list[int] = []  # saves unpacked by the running node (frees checked next)
        self.prev_node: int | None = None  # hooks mode: the node of the last pre hook
        self.reading: list[int] | None = None  # names read by unpacking (older torch)
        self.stack: list[tuple[Any, list[Any], Any]] = []  # open module calls


_STATE_CLASSES: dict[type, type] = {}


def _new_state(native: Any) -> _State:
    """A :class:`_State`; with the compiled hooks, one they read directly (the same fields in C)."""
    if native is None:
        return _State()
    cls = _STATE_CLASSES.get(native.State)
    if cls is None:
        cls = _STATE_CLASSES[native.State] = type("_State", (native.State,),
                                                  {"__slots__": (), "__init__": _State.__init__,
                                                   "__doc__": _State.__doc__})
    return cls()  # type: ignore[no-any-return]


class record:  # noqa: N801 - reads like a function, as torch.no_grad does
    """Record the autograd graph, saved tensors, backward steps and memory of a block.

    Args:
        memory: ``"auto"`` (CUDA allocator on a GPU, else the CPU allocator's events), ``"cpu"``,
            ``"cuda"``, ``"tracker"`` (online storage tracker; also used with a budget) or ``"off"``.
        budget: a simulated device size (``"8GiB"`` or bytes). Crossing it raises
            :class:`~gradscope.MemoryBudgetExceeded` at the allocation that crosses it.
        label: a name for the recording.
        modules: a module or ``{"name": module}`` to name the roots of module paths. By default
            a root module is named by the variable that holds it where the block ends (see NOTE
            [ naming roots ] in :mod:`gradscope._names`).
        max_events: bound on timeline points kept (the peak is always exact and kept).
        history: on CUDA, also record the caching allocator's event history for the timeline.
        tracker_device: the device type the tracker counts (``"meta"`` when predicting).
        lines: record the user's source line of every node, saved tensor and allocation
            (:attr:`~gradscope.Recording.lines`; see NOTE [ where lines come from ] in
            :mod:`gradscope._lines`). None: on unless the environment sets ``GRADSCOPE_LINES=0``.
        compiled: ``"attribute"`` (attribute each tensor a ``torch.compile``'d region compiled inside
            the block saves to its module and line: :func:`gradscope.compiled_saves`), ``"eager"``
            (run the block with torch.compile set aside: every op is shown, the compiled program's
            own peak may differ) or ``"off"``. See :mod:`gradscope._compiled`.

    Example:
        >>> import torch, gradscope as gs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> with gs.record(memory="off") as rec:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sorted(n.leaf for n in rec.recording.nodes if n.leaf)
        ['model.0.bias', 'model.0.weight']
    """

    def __init__(self, memory: str = "auto", *, budget: int | str | None = None, label: str = "",
                 modules: nn.Module | Mapping[str, nn.Module] | None = None,
                 max_events: int | None = 200_000, history: bool = False,
                 tracker_device: str = "cpu", lines: bool | None = None, compiled: str = "attribute") -> None:
        self._budget = parse_size(budget)
        self._compiled = _compiled.Observer(compiled)
        self._memory = resolve_memory(memory, self._budget)
        if max_events is not None and (not isinstance(max_events, int) or max_events < 2):
            raise GradscopeError(f"gradscope: max_events must be an int >= 2 or None, got {max_events!r}.")
        if modules is not None and not isinstance(modules, nn.Module | Mapping):
            raise GradscopeError(
                "gradscope: modules= takes an nn.Module or a dict {'name': module}, "
                f"got {type(modules).__name__}."
            )
        self._given = _names.modules_arg(modules)
        self._label = label
        self._max_events = max_events
        self._history = history
        self._tracker_device = tracker_device
        self._lines_on = lines_enabled(lines)
        self._recording: Recording | None = None
        self._analysis: tuple[bool, str | None] | None = None  # (complete, error) until analysed
        self._analysis_lock = threading.Lock()  # two threads' first looks analyse once
        self._entered = False
        # the block's code for the diagnosis (see gradscope._source); the notebook magic gives its cell
        self.given_step: dict[str, Any] | None = None
        self._step_at: tuple[str, int] | None = None

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
        caller = sys._getframe(1)
        self._step_at = (caller.f_code.co_filename, caller.f_lineno)
        self._init_state()
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        try:
            self._install()
        except BaseException:
            try:
                self._uninstall()
            finally:
                self._let_go()
            raise
        _active.rec = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        with _no_gc():  # see NOTE [ no collection while rows are made ]
            return self._exit(exc_type, exc, tb, sys._getframe(1))

    def _exit(self, exc_type: Any, exc: Any, tb: Any, frame: Any) -> Literal[False]:
        _active.rec = None
        trace = self._trace
        trace.t1_ns = time.time_ns()
        trace.seq1 = _compat.sequence_nr()
        internal: BaseException | None = None
        try:
            self._uninstall()  # first: nothing that fails below may leave a hook installed
        except Exception as e:  # never mask the user's exception with ours
            internal = e
        self._state.stack.clear()  # module calls that raised: never keep a user's module alive
        # the trace keeps no reference to the exception (its traceback holds the user's frames)
        trace.failure = (MemoryBudgetExceeded(exc.requested, exc.live, exc.budget, where=exc.where)
                         if isinstance(exc, MemoryBudgetExceeded) else None)
        trace.failed_oom = isinstance(exc, torch.OutOfMemoryError)
        trace.rank, trace.world_size = _distributed()
        error = None
        if exc_type is not None:
            error = f"{exc_type.__name__}: {exc}"
        # where the block is; its source is read when a diagnosis asks (gradscope._source), so that a
        # recording costs no file reading or parsing (a notebook cell gives its source itself)
        trace.step = self.given_step
        if trace.step is None and self._step_at is not None and not self._step_at[0].startswith(_OWN_FILES):
            trace.step = {"file": self._step_at[0], "line": self._step_at[1]}
        try:
            self._at_block_end(frame, tb)
        except Exception as e:
            internal = internal or e
        self._root_mods.clear()
        self._free_weak_refs()
        self._let_go()
        self._analysis = (exc_type is None, error)
        if internal is not None:
            self._analysis = None
            self._recording = Recording(label=self._label, complete=False,
                                        error=error or f"gradscope internal error: {internal!r}")
            if exc_type is None:
                raise _internal_failure(internal) from internal
        return False

    @property
    def recording(self) -> Recording | None:
        """The :class:`Recording` of the block (None before it ended, or when it never started).

        NOTE [ analysis on first look ]: the block's exit only stops capture; the passes that turn
        the trace into a recording (and the reading of the profiler's events) run the first time
        the recording is asked for, as PyTorch's profiler parses its events on first use. A loop
        that records every step pays for the analysis of the steps it looks at. A failure inside
        the analysis raises a GradscopeError here, once; the recording is then an incomplete one
        that says so."""
        if self._analysis is not None:
            with self._analysis_lock:
                self._analyse()
        return self._recording

    def _analyse(self) -> None:
        if self._analysis is not None:
            complete, error = self._analysis
            try:
                with _no_gc():  # see NOTE [ no collection while rows are made ]
                    rec = self._finalize(complete=complete, error=error)
            except Exception as e:
                self._analysis = None
                self._recording = Recording(label=self._label, complete=False,
                                            error=error or f"gradscope internal error: {e!r}")
                self._trace = Trace()
                raise _internal_failure(e) from e
            self._analysis = None
            self._recording = rec
            self._trace = Trace()  # the rows are the recording's now

    def _finalize(self, complete: bool, error: str | None) -> Recording:
        """Everything after capture: the passes (see :mod:`gradscope._passes`)."""
        return self._compiled.attach(_passes.build(self._trace, complete=complete, error=error))

    def add_roots(self, *tensors: torch.Tensor) -> None:
        """Name more results whose graphs belong to this recording (before the block ends)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._roots.append(weakref.ref(t))

    def between_nodes(self) -> bool:
        """True while an observed backward pass is between one node's end and the next node's
        start (where the engine sums gradients that reach one input). Known only for sources
        that hook every node (the tracker, CUDA)."""
        st = self._state
        ev = self._trace.events
        return st.bw is not None and bool(ev) and ev[-1][0] == EV_POST

    # ------------------------------------------------------------------ set-up
    def _init_state(self) -> None:
        self._tid = threading.get_ident()
        self._native = _native.hooks()  # None: the Python pair records (see NOTE [ compiled hooks ])
        self._state = _new_state(self._native)
        caps = _compat.capabilities()
        self._caps = caps
        tr = self._trace = Trace(tid=self._tid, memory=self._memory, label=self._label,
                                 t0_ns=time.time_ns(), seq0=_compat.sequence_nr(),
                                 max_events=self._max_events, deep_graph_trap=caps.nodes_persist,
                                 modules_given=bool(self._given), torch_version=torch.__version__)
        if not caps.sequence_nr:
            tr.notes.append(_compat.MISSING_NOTES["sequence_nr"])
        self._line_table = tr.line_table = LineTable() if self._lines_on else None
        self._roots: list[Any] = []  # weak references to results that may root a graph
        self._root_mods: list[Any] = []  # weak references to root modules (by root index)
        self._root_index: dict[int, int] = {}
        self._param_by_id: dict[int, tuple[Any, int, str]] = {}
        self._hooked: set[int] = set()  # nodes with a pre hook for the whole block
        self._leaf_hooks: dict[int, Any] = {}  # see NOTE [ AccumulateGrad nodes come and go ]
        self._acc_vars: dict[int, Any] = {}  # AccumulateGrad node -> weak ref to its leaf
        self._packed_upto = 0
        self._packed_seqs: collections.Counter[int] = collections.Counter()  # node seq -> saves we packed
        self._func_seq: list[list[int]] = []  # [seq0, seq1] of regions where we stepped aside
        self._hooking = True
        self._other_seq: list[list[int]] = []  # see NOTE [ other pairs on an older torch ]
        self._other_depth = 0
        self._source: MemorySource | None = None
        self._pack, self._unpack = self._make_pack()
        tr = self._trace
        self._walker = None if self._native is None else self._native.Walker(  # see NOTE [ compiled walk ]
            tr.node_index, tr.nodes, tr.edge_keys, tr.edge_dst, self._packed_seqs, tr.seq_attr, tr.seq_order,
            self._hooked, self._leaf_hooks, _type_info, node_key, self._name_node, self._hook, self._leaf_row,
            tr.saves, self._acc_vars, _leaf_key)

    def _install(self) -> None:
        src = make_source(self._memory, budget=self._budget, device_type=self._tracker_device,
                          history=self._history, context=self._context)
        hooks = saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))
        mod_pre, mod_post = self._mod_pre, self._mod_post
        if self._native is not None and (src is None or not src.marks_calls):  # NOTE [ compiled module hooks ]
            st, tr = self._state, self._trace
            compiled = self._native.ModHooks(st, tr.calls, tr.module_paths, self._root_of, self._roots,
                                             self._internal, self._tid)
            mod_pre, mod_post = _outside_compilers(compiled.pre), _outside_compilers(compiled.post)
        # always_call: a forward that raises closes its call too (a caught error must not leave its
        # module open, or the nodes made after it would be given to that module)
        self._handles.append(_ModuleHooks(mod_pre, mod_post))  # see NOTE [ one key for module hooks ]
        self._undo.append(_quiet_global_hook_warning())
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        self._patch_engine()
        self._undo.append(self._compiled.start())
        if src is not None:
            if self._line_table is not None and hasattr(src, "line_of"):  # see NOTE [ where lines come from ]
                src.line_of = self._line_table.here
            src.start()
            self._source = src
            self._undo.append(self._stop_source)
            watch_alias = getattr(src, "watch_alias", None)
            if watch_alias is not None and self._native is not None:
                self._alias_watchers.append(watch_alias)
                self._undo.append(self._alias_watchers.clear)

    def _stop_source(self) -> None:
        src, self._source = self._source, None
        if src is not None:
            self._trace.memory_trace = src.stop()

    def _uninstall(self) -> None:
        first: BaseException | None = None
        st = self._state
        src = self._source
        while st.stack:  # module calls left open by an exception inside a forward
            _, call, token = st.stack.pop()
            call[C_SEQ1] = _compat.sequence_nr()
            call[C_T1] = time.time_ns()
            try:
                if src is not None and src.marks_calls:
                    src.call_exit(token, "")
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

    def _context(self) -> tuple[int | None, int | None]:
        """(position in the step events, module call running) for online sources."""
        st = self._state
        step = len(self._trace.events) if st.bw is not None else None
        call = self._calls_index(st.stack[-1][1]) if st.stack else None
        return step, call

    def _calls_index(self, call: list[Any]) -> int:
        return int(call[6])

    # ------------------------------------------------------------------ saved tensors
    def _make_pack(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The pack/unpack pair, built once per block with everything it needs bound locally:
        they run for every saved tensor (see NOTE [ capture apart from analysis ] in
        :mod:`gradscope._trace`)."""
        trace, st = self._trace, self._state
        saves, events = trace.saves, trace.events
        saves_append, events_append = saves.append, events.append
        seq = _compat.sequence_nr_fn()
        key_of, weak_of, version_of = _compat.storage_cdata, _compat.storage_weak, _compat.tensor_version
        time_ns = time.time_ns
        memory = self._memory
        need_ptr = memory == "cpu" or (memory == "cuda" and self._history)  # matched with allocations by address
        need_time = memory != "off"  # matched with allocations in time
        need_weak = self._free_checks_needed()  # frees seen by weak reference at step boundaries
        weak: list[int | None] = []
        self._weak = weak
        weak_append = weak.append
        internal = functools.partial(_note_internal, trace.notes)  # see NOTE [ no cycles through the recorder ]
        pending = st.pending
        pending_append = pending.append
        expired, free = _compat.weak_expired, _compat.weak_free
        sparse_parts, parts_bytes = _compat.sparse_parts, _compat.parts_bytes
        skey_of = operator.itemgetter(S_SKEY)
        # NOTE [ the packed value is the tensor ]: what the pack hook returns lives as long as the
        # saved variable, and every object it adds is one more for Python's cyclic collector to
        # walk until the backward frees it: a graph of small ops packs thousands, and a collector
        # pass over them cost more than the recording's own work (measured on a 5,000-op chain:
        # 25 ms a step). So the pack hook returns the detached tensor alone (see NOTE [ pack a
        # detached tensor ]); what unpack needs (save index, version, node) sits in this table of
        # plain ints under the tensor's id, which no other live object shares while the saved
        # variable holds it (a new pack of a reused id overwrites the entry first). Rows hold no
        # object the collector tracks either (the shape as a tuple of ints).
        packed_info: dict[int, int | None] = {}  # the packed value's id -> its save's index
        self._packed_info = packed_info
        versions: list[int] = []  # by save index: the saved tensor's version when packed
        versions_append = versions.append
        table = self._line_table  # see NOTE [ where lines come from ] in gradscope._lines
        save_lines = trace.save_lines
        lines_append = save_lines.append
        here = table.find if table is not None else None
        getframe = sys._getframe
        last_line: list[Any] = [None, -1]  # the node of the last save given a line, and that line
        same_node = self._caps.sequence_nr  # without the counter every save looks at its stack

        def check_frees(by_save: bool = False) -> None:
            """The engine releases a node's saved tensors right after the node (and its post
            hooks) ran; at the next step boundary, the storages of the saves it unpacked that
            are gone were freed by that step (``by_save``: by the step of the save's node)."""
            for q in pending:
                ref = weak[q]
                if ref is not None and expired(ref):
                    events_append((EV_FREED, q, 0, q if by_save else None))
                    weak[q] = None
                    free(ref)
            pending.clear()

        def check_frees_at_end() -> None:
            """NOTE [ frees checked once a pass ]: with ``memory="off"`` the saves a pass unpacked
            are checked once, when it ends, instead of at every step boundary (a check at each
            step cost as much as a tenth of a small op's recording). A storage the engine freed
            died when the last of its holders' nodes ran and let go of its saved variables: the
            free belongs to the step of the save of ours that unpacked it last (``value``; the
            graph pass finds that step by the save's node), and is reported on the storage's
            newest save (``ident``), so that every save of it made before is freed there too. A
            holder we cannot see (a node whose saves another pair of hooks packed, a custom
            Function's ``ctx`` attribute) that lets go later in the pass makes the free show at
            our holder's step, as it showed at the next step we saw before."""
            keys = list(map(skey_of, map(saves.__getitem__, pending)))
            if len(set(keys)) == len(keys):  # each storage unpacked once: its save is both the newest and the last
                check_frees(by_save=True)
                return
            last: dict[int, list[Any]] = {}  # storage key -> [save unpacked last, newest save, freed?]
            for q, k in zip(reversed(pending), reversed(keys), strict=True):
                e = last.get(k)
                if e is None:
                    ref = weak[q]
                    last[k] = [q, q, ref is not None and expired(ref)]
                elif q > e[1]:
                    e[1] = q
            for q_last, q_new, dead in last.values():
                if dead:
                    events_append((EV_FREED, q_new, 0, q_last))
            for q, k in zip(pending, keys, strict=True):
                ref = weak[q]
                if ref is not None and last[k][2]:
                    weak[q] = None
                    free(ref)
            pending.clear()

        batched = self._frees_once_a_pass = memory == "off"
        self._check_frees: Callable[[], None] = check_frees_at_end if batched else check_frees

        def pack(t: torch.Tensor) -> Any:
            # No thread filter: saved-tensor hooks are thread-local, and the engine carries them
            # into its device threads only for backward passes started in this block.
            try:
                try:
                    s = t.untyped_storage()
                    nbytes = s.nbytes()
                except (NotImplementedError, RuntimeError):
                    parts = sparse_parts(t)  # a sparse tensor has no storage of its own
                    if parts is None:
                        raise
                    s, nbytes = parts[-1].untyped_storage(), parts_bytes(parts)
                sid = len(saves)
                # is_leaf is ``grad_fn is None`` without making the producer's Python node object
                row = (seq() - 1, key_of(s), s.data_ptr() if need_ptr else 0, nbytes, tuple(t.shape), t.dtype,
                       t.device, time_ns() if need_time else sid, t.is_leaf)
                version = version_of(t)
                line = -1
                if here is not None:
                    if same_node and row[0] == last_line[0]:
                        line = last_line[1]
                    else:
                        try:
                            line = here(getframe(1))
                        except Exception:  # no line is no failure to pack (as the compiled pair)
                            line = -1
                        last_line[0], last_line[1] = row[0], line
                # nothing above may fail once a list has grown: the lists are indexed by save
                saves_append(row)
                versions_append(version)
                if here is not None:
                    lines_append(line)
                if need_weak:
                    weak_append(weak_of(s))  # type: ignore[arg-type]  # an int handle at run time
                # NOTE [ pack a detached tensor ]: a node that saves its own output (exp, tanh)
                # would hold the output, whose grad_fn is that node: a cycle through C++ that
                # Python's collector cannot break. Unpack rebuilds autograd metadata from the saved
                # variable, not from the tensor the hook returns, so keeping only the data (as
                # PyTorch does without hooks) is exact.
                # NOTE [ a save that needs no detaching ]: a tensor that does not require grad
                # has no node to hold, and PyTorch hands it back from ctx.saved_tensors as the
                # same Python object (attributes the program set on it, identity checks): it is
                # packed as itself, unless this object is packed already (its id names one save
                # in packed_info; an entry of a dead object whose id was reused names another
                # storage).
                if not t.requires_grad:
                    prev = packed_info.get(id(t), -1)
                    if prev == -1 or (prev is not None and (prev >= sid or saves[prev][S_SKEY] != row[S_SKEY])):
                        packed_info[id(t)] = sid
                        return t
                d = t.detach()
                packed_info[id(d)] = sid
                return d
            except Exception as e:  # observing must never break the model: save the tensor as is
                packed_info[id(t)] = None
                internal(e)
                return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            sid = packed_info.get(id(t))
            if sid is None:
                return t  # packed while observing failed
            # NOTE [ in-place checks ]: while saved-tensor hooks are active PyTorch does not check
            # that a saved tensor was left unmodified (measured: no error, silently different
            # gradients), so a program that fails without gradscope would run with wrong
            # gradients under it. The check is made here, with PyTorch's words.
            if version_of(t) != versions[sid]:
                raise _inplace_error(t, versions[sid])
            if st.bw is not None:
                # the save's node, as the graph walk may have moved it (see _reattribute)
                if st.marks and (node := saves[sid][S_SEQ]) != st.last_seq:
                    if pending and not batched:
                        check_frees()
                    st.last_seq = node
                    # the counter as the node starts: see NOTE [ orders ] in gradscope._passes
                    events_append((EV_UNPACK, sid, time_ns(), seq()))
                if need_weak:
                    pending_append(sid)
            elif st.reading is not None:
                st.reading.append(sid)
            return t

        self._free_handles: Callable[[], None] | None = None
        if self._native is None:
            return pack, unpack
        # the same pair, compiled: the Python pack hook packs what it does not read exactly
        # The tracker follows each storage until its last holder dies; the compiled pack hook makes
        # its alias without an operator (no dispatch mode sees it), so it tells the tracker (the
        # source, made later in _install, is put in this list, and taken out when the block ends).
        watchers: list[Callable[[torch.Tensor], None]] = []
        self._alias_watchers = watchers

        def watch(alias: torch.Tensor) -> None:
            for w in watchers:
                w(alias)

        compiled = self._native.Hooks(saves, versions, packed_info, weak if need_weak else None, events, pending, st,
                                      pack, None if batched else check_frees, _inplace_error, need_ptr, need_time,
                                      watch if memory == "tracker" else None,
                                      None if table is None else save_lines, table)
        if batched:
            self._check_frees = compiled.frees_at_end
        self._free_handles = compiled.free_handles  # the Python pair's handles are the same kind
        return compiled.pack, compiled.unpack  # bound once: the pair is known by identity

    def _free_checks_needed(self) -> bool:
        """Frees of saved storages are checked by weak reference at step boundaries where the
        memory source cannot say which allocation died (off; CUDA without history)."""
        return self._memory == "off" or (self._memory == "cuda" and not self._history)

    def _free_weak_refs(self) -> None:
        if self._free_handles is not None:  # compiled: one call for every save of the block
            self._free_handles()
            return
        free = _compat.free_weak_ref
        for ref in self._weak:
            if ref is not None:
                free(ref)
        self._weak.clear()

    def _let_go(self) -> None:
        """NOTE [ no cycles through the recorder ]: a recorder dropped after its block must go at
        once, with its rows, by reference counting: were it on a reference cycle, it (and the
        trace or recording it holds, thousands of objects) would wait for Python's cyclic
        collector, whose pass would then run inside the user's code, later. What the block
        installs never refers back to the recorder after the block: the saved-tensor hooks (which
        a graph keeps after the block, for its backward) note an internal error into the trace's
        notes, not through the recorder; memory sources let go of the recorder's callback when
        they stop; the compiled walk, whose callbacks are the recorder's methods, is dropped here
        when the block ends (the walk at the block's end is its last use).
        tests/test_cycles.py counts what the collector finds."""
        self._walker = None

    def _hooks_on_top(self) -> bool:
        """Whether our pair is the innermost saved-tensor hooks pair on this thread."""
        top = _compat.top_saved_tensors_hooks()
        if top is _compat.NOT_VISIBLE:
            return self._probe_innermost()
        return top is not None and top[0] is self._pack

    def _probe_innermost(self) -> bool:
        """Without ``_top_saved_tensors_default_hooks`` (torch 2.6): pack one tiny saved tensor and
        see whose pack hook ran; the probe's row is removed again."""
        saves = self._trace.saves
        n = len(saves)
        try:
            with _compat.no_dispatch_modes():
                x = torch.ones(1, device="cpu", requires_grad=True)
                with torch.enable_grad():
                    x.exp()
        except Exception:
            return False
        ours = len(saves) > n
        del saves[n:]
        return ours

    def _other_pair(self, entering: bool) -> None:
        """See NOTE [ other pairs on an older torch ]: [seq0, seq1) while another pair is on top."""
        seqs = self._other_seq
        if entering:
            self._other_depth += 1
            if self._other_depth == 1:
                seqs.append([_compat.sequence_nr(), -1])
        elif self._other_depth > 0:
            self._other_depth -= 1
            if self._other_depth == 0 and seqs:
                seqs[-1][1] = _compat.sequence_nr()

    def _func_enter(self) -> None:
        st = self._state
        st.func_depth += 1
        self._trace.func_regions += 1
        self._func_seq.append([_compat.sequence_nr(), -1])

    def _func_exit(self) -> None:
        st = self._state
        st.func_depth -= 1
        if self._func_seq and self._func_seq[-1][1] < 0:
            self._func_seq[-1][1] = _compat.sequence_nr()

    # ------------------------------------------------------------------ modules and optimizers
    def _mod_pre(self, module: nn.Module, args: Any) -> None:
        if _compat.is_compiling() or threading.get_ident() != self._tid:
            return  # see NOTE [ hooks inside compiled modules ] in gradscope._compat
        try:
            st = self._state
            calls = self._trace.calls
            if st.stack:
                parent = st.stack[-1][1]
                root, parent_rel = parent[0], parent[1]
            else:
                root, parent_rel = self._root_of(module), None
            rel = self._trace.module_paths[root].get(id(module))
            cls = type(module).__name__
            if rel is None:
                rel = cls if parent_rel in (None, "") else f"{parent_rel}.{cls}"
            idx = len(calls)
            call = [root, rel, _compat.sequence_nr(), -1, time.time_ns(), 0, idx, cls]
            calls.append(call)
            src = self._source
            token = src.call_enter("module", idx, cls) if src is not None and src.marks_calls else None
            call[2] = _compat.sequence_nr()
            st.stack.append((module, call, token))
        except Exception as e:  # observing must never break the model
            self._internal(e)

    def _mod_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compat.is_compiling() or threading.get_ident() != self._tid:
            return  # see NOTE [ hooks inside compiled modules ] in gradscope._compat
        try:
            st = self._state
            src = self._source
            while st.stack:
                m, call, token = st.stack.pop()
                call[C_SEQ1] = _compat.sequence_nr()
                call[C_T1] = time.time_ns()
                if src is not None and src.marks_calls:
                    src.call_exit(token, type(m).__name__)
                if m is module:
                    break
            # plain tensors only: a compiler tracing the module (fake tensors) makes no graph of ours
            if type(output) is torch.Tensor and not output.is_leaf:  # has a grad_fn (none made here)
                self._roots.append(weakref.ref(output))
        except Exception as e:
            self._internal(e)

    def _root_of(self, module: nn.Module) -> int:
        idx = self._root_index.get(id(module))
        if idx is not None and self._root_mods[idx]() is module:
            return idx
        tr = self._trace
        idx = len(tr.roots)
        self._root_index[id(module)] = idx
        given = _names.given_name(module, self._given)
        tr.roots.append((type(module).__name__, given))
        self._root_mods.append(weakref.ref(module))
        tr.module_paths.append({id(m): name for name, m in module.named_modules()})
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, p in named:
                if kind == "parameter":
                    self._param_by_id[id(p)] = (weakref.ref(p), idx, name)
                if is_lazy(p):  # a lazy module's parameter before its first call has no storage yet
                    continue
                k = _compat.storage_key(p)
                if k is not None:
                    tr.param_keys.setdefault(k, (idx, name, kind))
                    tr.baseline_storages[k] = int(p.untyped_storage().nbytes())
        return idx

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self._tid:
            self._trace.optimizer_steps.append([type(optimizer).__name__, time.time_ns(), 0,
                                                _compat.sequence_nr(), -1])

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self._tid and self._trace.optimizer_steps:
            row = self._trace.optimizer_steps[-1]
            row[2], row[4] = time.time_ns(), _compat.sequence_nr()

    # ------------------------------------------------------------------ engine interception
    def _patch_engine(self) -> None:
        ag = _compat.engine_entry_module()
        if ag is not None:  # see NOTE [ shared patches ]
            self._undo.append(lambda: _leave_patches(self))
            patches: list[tuple[Any, str, Callable[[Any], Any]]] = [(ag, _compat.ENGINE_ENTRY, _engine_dispatch)]
            agg = _compat.disable_hooks_module()
            if agg is not None:
                patches.append((agg, "disable_saved_tensors_hooks", _func_guard))
            if not self._caps.saved_hook:  # see NOTE [ other pairs on an older torch ]
                pairs = _compat.hooks_class()
                patches += [(pairs, "__enter__", _pair_enter), (pairs, "__exit__", _pair_exit)]
            _join_patches(self, patches)
        else:  # a torch without the shared entry point: wrap the two public functions
            import torch.autograd as agm

            orig_b, orig_g = agm.backward, agm.grad

            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                return self._run_backward(lambda *a, **k: orig_b(tensors, *args, **kwargs), tensors,
                                          (None, kwargs.get("retain_graph"), kwargs.get("create_graph", False),
                                           kwargs.get("inputs")), {})

            def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
                return self._run_backward(lambda *a, **k: orig_g(outputs, *args, **kwargs), outputs,
                                          (None, kwargs.get("retain_graph"), kwargs.get("create_graph", False),
                                           args[0] if args else kwargs.get("inputs")),
                                          {"accumulate_grad": False})

            agm.backward, agm.grad = backward, grad

            def restore() -> None:
                agm.backward, agm.grad = orig_b, orig_g

            self._undo.append(restore)

    def _run_backward(self, orig: Callable[..., Any], t_outputs: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        st = self._state
        if threading.get_ident() != self._tid or st.bw is not None or st.func_depth or _compat.is_compiling():
            # Another thread, a backward started from inside a node (reentrant checkpoint), a
            # torch.func region, or a compiler tracing a graph: run it unobserved (the nodes of the
            # user's graph are still found later).
            return orig(t_outputs, *args, **kwargs)
        outputs = list(t_outputs) if isinstance(t_outputs, list | tuple) else [t_outputs]
        if any(type(t) is not torch.Tensor and _compat.is_fake(t) for t in outputs):
            return orig(t_outputs, *args, **kwargs)  # a compiler tracing a backward: not the user's
        call = _compat.engine_call(args, kwargs)
        trace = self._trace
        row = BackwardRow(api="backward" if call.accumulate_grad else "autograd.grad",
                          create_graph=call.create_graph, retain_graph=call.retain_graph, roots=[],
                          inputs=[], seq0=_compat.sequence_nr(), t0_ns=time.time_ns(),
                          ev0=len(trace.events))
        index = len(trace.backwards)
        trace.backwards.append(row)
        src = self._source
        token = src.call_enter("backward", index, "") if src is not None and src.marks_calls else None
        temporary: list[Any] = []
        result: Any = None
        done = False
        try:
            try:
                walker = self._walker
                compiled_hooks = call.create_graph and src is None and self._frees_once_a_pass
                started: Any = NotImplemented
                was = gc.isenabled()  # see NOTE [ no collection while rows are made ] (inline: every pass)
                gc.disable()
                try:
                    if walker is not None:  # see NOTE [ a pass in two calls ] in walk.cc
                        started = walker.pass_start(outputs, call.inputs, compiled_hooks, self._hooking,
                                                    src is not None and src.node_hooks, trace.seq0, _TYPES, _ORDERS,
                                                    st, trace.events)
                    if started is NotImplemented:
                        roots, keys = self._roots_keys(outputs)
                        input_keys = self._roots_keys(call.inputs, make=False)[1]
                        self._discover(roots, keys)
                    else:
                        acc_known, row.roots, row.inputs, hooks, roots, keys, input_keys = started
                        self._rehook_known(acc_known)
                        if hooks is not None:
                            temporary.append(hooks)
                finally:
                    if was:
                        gc.enable()
                row.nodes_known = len(trace.nodes)
                if started is NotImplemented:
                    idx = trace.node_index
                    row.roots = [idx[k] for k in keys if k in idx]
                    row.inputs = [idx[k] for k in input_keys if k in idx]
                if call.create_graph and not temporary:
                    self._hook_for_pass(roots, keys, set(input_keys), temporary)
                del roots
            except Exception as e:  # the user's backward runs whatever happens to observing
                self._internal(e)
            st.bw = row
            st.marks = self._memory == "off" or (call.create_graph and not (src is not None and src.node_hooks))
            row.seq0 = _compat.sequence_nr()
            row.ev0 = len(trace.events)
            try:
                result = orig(t_outputs, *args, **kwargs)
            except BaseException as e:  # see NOTE [ a backward that raised ] in gradscope._passes
                row.oom = isinstance(e, torch.OutOfMemoryError)  # gs.MemoryBudgetExceeded is one
                try:
                    row.error = f"{type(e).__name__}: {e}"
                except Exception:  # an exception whose str() fails still names its type
                    row.error = f"{type(e).__name__}: (its message could not be read)"
                raise
            done = True
            return result
        finally:
            try:
                try:
                    self._step_boundary(None)
                except Exception as e:
                    self._internal(e)
            finally:  # whatever the boundary raised, the pass ends and its hooks go
                st.bw = None
                st.marks = False
                st.prev_node = None
                st.last_seq = -1
                row.seq1 = _compat.sequence_nr()
                row.t1_ns = time.time_ns()
                row.ev1 = len(trace.events)
                for h in temporary:
                    h.remove()
            if src is not None and src.marks_calls:
                try:
                    src.call_exit(token, "")
                except Exception as e:
                    self._internal(e)
            if done or row.api == "backward":
                # The gradients it made (a backward that raised: the .grad of the leaves it
                # accumulated into before the failure, which stay); after a create_graph=True pass,
                # the nodes it made are found from them too.
                try:
                    self._gradient_keys(index, row, result)
                except Exception as e:
                    self._internal(e)

    # ------------------------------------------------------------------ graph discovery
    def _packed(self, seq: int) -> bool:
        """Whether this recording's pack hook saved for the node numbered ``seq``."""
        if self._walker is not None:
            self._walker.count_packed()
            return seq in self._packed_seqs
        saves = self._trace.saves
        if self._packed_upto < len(saves):
            _count_elements(self._packed_seqs, map(_SEQ_OF, itertools.islice(saves, self._packed_upto, None)))
            self._packed_upto = len(saves)
        return seq in self._packed_seqs

    def _discover(self, roots: list[Any], keys: list[Any] | None = None, since: int | None = None) -> None:
        """Walk from ``roots`` through nodes not walked before, appending node and edge rows,
        naming saves and hooking the nodes whose steps the unpack hook cannot see (``keys``: the
        roots' keys, where the caller has them). ``since``: a sequence number below which a node
        not walked before is not entered (see NOTE [ the block's nodes ]); that walk is Python's."""
        trace = self._trace
        src = self._source
        hook_all = src is not None and src.node_hooks
        hooking = self._hooking
        walker = self._walker
        acc_known: Any = NotImplemented
        if walker is not None and since is None:  # see NOTE [ compiled walk ] in gradscope._native: the whole of this
            live = roots if keys is not None else [r for r in roots if r is not None]
            acc_known = walker.discover(live, keys if keys is not None else [node_key(r) for r in live], hooking,
                                        hook_all, trace.seq0, _TYPES, _ORDERS)
            del live
        if acc_known is NotImplemented:
            self._packed(-1)
            nodes, index, edge_keys = trace.nodes, trace.node_index, trace.edge_keys
            for i, ref in list(self._acc_vars.items()):
                if ref() is None:  # a leaf that died: its id() may name a new leaf now
                    index.pop(nodes[i][0], None)
                    del self._acc_vars[i]
            acc_edges, acc_known = self._walk_nodes(roots, hooking, hook_all, since)
            for p in acc_edges:  # every key of this walk is indexed now; a leaf's key may name another later
                j = index.get(edge_keys[p])
                edge_keys[p] = -1 - j if j is not None else None
        self._rehook_known(acc_known)

    def _rehook_known(self, acc_known: dict[Any, Any]) -> None:
        """The AccumulateGrad nodes a walk met that were walked before (key -> a parent node): a
        leaf's node may be a new one, to hook again (see _rehook_leaf)."""
        src = self._source
        hook_all = src is not None and src.node_hooks
        for k, fn in acc_known.items():
            self._rehook_leaf(fn, k, post=hook_all)

    def _walk_nodes(self, roots: list[Any], hooking: bool, hook_all: bool,
                    since: int | None = None) -> tuple[list[int], dict[Any, Any]]:
        """The walk of _discover in Python (where the compiled walk is not in use, or a root is not
        a node it reads): the positions in edge_keys of AccumulateGrad keys, and a parent of each
        AccumulateGrad node walked before."""
        trace = self._trace
        packed = self._packed_seqs
        nodes, index = trace.nodes, trace.node_index
        edge_keys = trace.edge_keys
        key_out, dst_out = edge_keys.append, trace.edge_dst.append
        acc_edges: list[int] = []  # positions in edge_keys of AccumulateGrad keys (resolved below)
        acc_known: dict[Any, Any] = {}  # known AccumulateGrad key -> a parent node
        seq0 = trace.seq0
        seq_attr, seq_order = trace.seq_attr, trace.seq_order
        types, orders = _TYPES, _ORDERS
        acc, seq_of = _compat.ACC_SEQ, _compat.node_seq
        # The walk of gradscope._walk.walk, inlined (a generator's resume per node costs as much
        # as the rest of a node's row): depth first, every node object held until the end (see
        # NOTE [ node identity ] there), nodes walked before (in ``index``) not walked again.
        held: list[Any] = []
        hold = held.append
        stack = [(r, node_key(r)) for r in roots if r is not None]
        pop, push = stack.pop, stack.append
        try:
            while stack:
                fn, key = pop()
                if key in index:
                    continue
                hold(fn)
                i = len(nodes)
                index[key] = i
                info = types.get(type(fn))
                if info is None:
                    info = _type_info(fn)
                name, attrs, custom, single = info
                nf = fn.next_functions
                for nxt, _ in nf:
                    if nxt is not None:
                        k = seq_of(nxt)
                        if k == acc:
                            k = node_key(nxt)
                            if hooking and k in index and k not in acc_known:
                                acc_known[k] = fn
                            acc_edges.append(len(edge_keys))
                        key_out(k)
                        dst_out(i)
                        if k not in index and (since is None or k.__class__ is not int or k >= since):
                            push((nxt, k))
                if key.__class__ is int:
                    nodes.append((key, key, name, None, None, custom))
                    if attrs:
                        ours = key in packed
                        if ours and single is not None:
                            seq_attr[key] = single  # see NOTE [ which node saved a tensor ]
                        elif ours and (rule := orders.get(type(fn))) is not None and packed[key] == len(rule[0]):
                            seq_order[key] = rule[0]  # see NOTE [ pack order ]
                        elif ours or key >= seq0:
                            self._name_node(fn, key, attrs, _absent(nf), ours)
                    if not hooking:
                        continue
                    if hook_all:
                        self._hook(fn, i, name=name, post=True)
                    elif custom:  # see NOTE [ steps nobody saw ] in gradscope._passes
                        self._hook(fn, i, name=name, post=False)
                else:
                    self._leaf_row(fn, i, key, name, custom, hooking, hook_all)
        finally:
            held.clear()
        return acc_edges, acc_known

    def _name_node(self, fn: Any, key: int, attrs: tuple[tuple[str, str], ...], absent: int, ours: bool) -> None:
        """The saves of a node made in the block whose class's learnt order does not name them
        (both walks call this): a learnt order for its pattern of saves, else they are read (and
        the orders learnt), or counted when another pair packed them."""
        packed = self._packed_seqs
        if ours:
            okey = (type(fn), packed[key], absent)
            rule = _ORDERS.get(okey)
            if rule is not None and (not rule[1] or self._move_saves(key, rule[1])):
                self._trace.seq_order[key] = rule[0]  # fewer saves than attributes: see NOTE [ pack order ]
                return
        try:
            if ours:
                n = packed[key]  # before naming: it may find more (see _reattribute)
                read = self._name_saves(fn, key, attrs)
                _learn_order(type(fn), read, len(attrs), moves=False)
                _learn_order(okey, read, n, moves=True)
            elif key >= self._trace.seq0:
                self._count_unseen(fn, key, attrs)
        except Exception as e:  # a node whose saves cannot be read: noted, the walk goes on
            self._internal(e)

    def _leaf_row(self, fn: Any, i: int, key: Any, name: str, custom: bool, hooking: bool, hook_all: bool) -> None:
        """An AccumulateGrad node's row (both walks call this): its leaf names it."""
        leaf: Any = "input"
        leaf_shape = None
        try:
            var = fn.variable
            self._acc_vars[i] = weakref.ref(var)
            leaf_shape = tuple(var.shape)
            named = self._param_by_id.get(id(var))
            if named is not None and named[0]() is var:
                leaf = (named[1], named[2])
        except (AttributeError, RuntimeError):
            pass
        self._trace.nodes.append((key, _compat.ACC_SEQ, name, leaf, leaf_shape, custom))
        if hooking:
            self._hook_leaf(fn, i, name, post=hook_all)

    def _name_saves(self, fn: Any, seq: int, attrs: tuple[tuple[str, str], ...]) -> list[tuple[int, str, int]] | None:
        """Attribute names of one node's saves (see NOTE [ which node saved a tensor ]); the
        ``(save index, label, offset)`` it named (offset: the save's first number minus the node's,
        see _reattribute), None when a list attribute was among them."""
        trace = self._trace
        if len(attrs) == 1 and type(fn) not in _LISTS:
            raw = getattr(fn, attrs[0][1], None)
            if isinstance(raw, list | tuple):
                _LISTS.add(type(fn))
            else:  # a class with one saved tensor: every save of this node is that attribute
                if type(fn) in _TYPES:
                    _TYPES[type(fn)] = _TYPES[type(fn)][:3] + (attrs[0][0],)
                trace.seq_attr[seq] = attrs[0][0]
                return None
        names = trace.save_attr
        named: list[tuple[int, str, int]] | None = []
        if not self._caps.saved_data:
            for attr, raw_attr in attrs:
                raws, listed = _compat.raw_saved_listed(fn, raw_attr)
                many = _indexed(attr, listed, len(raws))
                if many:
                    named = None
                if raws:
                    got = self._read_by_unpacking(fn, attr, None if many else attr, names)
                    if named is not None:
                        named += got
            return named
        # each raw saved variable shows what our pack hook returned for it (one getattr each)
        packed_by, not_visible, unpack = _compat.packed_by, _compat.NOT_VISIBLE, self._unpack
        info_get, saves = self._packed_info.get, trace.saves
        for attr, raw_attr in attrs:
            try:
                raw = getattr(fn, raw_attr, None)
            except (RuntimeError, AttributeError):
                continue
            if raw is None:
                continue
            if isinstance(raw, (list, tuple)):  # noqa: UP038 - a tuple of types checks faster than a union
                many = _indexed(attr, True, len(raw))
                if many:
                    named = None
                items = raw
            else:
                many, items = False, (raw,)
            for k, one in enumerate(items):
                value = packed_by(one, unpack)
                if value is not_visible:
                    continue
                sid = info_get(id(value))
                if sid is None:
                    continue
                offset = saves[sid][S_SEQ] - seq
                if offset:
                    self._reattribute(sid, seq)
                label = f"{attr}[{k}]" if many else attr
                names[sid] = label
                if named is not None:
                    named.append((sid, label, offset))
        return named

    def _read_by_unpacking(self, fn: Any, attr: str, label: str | None,
                           names: dict[int, str]) -> list[tuple[int, str, int]]:
        """Older torch: read the attribute; our unpack hook notes which saves it returned. Only
        nodes whose saves we packed get here, so no other pair's unpack hook runs."""
        st = self._state
        st.reading = []
        try:
            try:
                with _compat.no_dispatch_modes():  # unpacking makes ops (detach) no mode of the program's may see
                    value = getattr(fn, attr)
            except (RuntimeError, AttributeError):
                value = None
            read = st.reading
        finally:
            st.reading = None
        del value
        out = []
        seq = int(_compat.node_seq(fn))
        for k, sid in enumerate(read):
            offset = self._trace.saves[sid][S_SEQ] - seq
            if offset:
                self._reattribute(sid, seq)
            names[sid] = label if label is not None else (attr if len(read) == 1 and attr != "saved_tensors"
                                                          else f"{attr}[{k}]")
            out.append((sid, names[sid], offset))
        return out

    def _move_saves(self, seq: int, moves: tuple[tuple[int, str], ...]) -> bool:
        """A learnt order's saves made under later numbers (see NOTE [ saves packed under another
        number ]): where each such number has exactly the one save of ours and no node walked so
        far, the analysis moves it to this node (only if no node has that number by then).
        False where the pattern does not hold: the node is read instead."""
        packed, index = self._packed_seqs, self._trace.node_index
        if any(packed.get(seq + d, 0) != 1 or seq + d in index for d, _ in moves):
            return False
        for d, label in moves:
            self._trace.seq_moves[seq + d] = (seq, label)
        return True

    def _reattribute(self, sid: int, seq: int) -> None:
        """NOTE [ saves packed under another number ]: the counter minus one is not the saving
        node when the op runs another differentiable op between making its node and saving: an
        in-place ``mul_`` that needs its input's old value saves a clone, made (with a node of
        its own that no graph keeps) after the ``MulBackward0``. The node whose raw saved
        variable holds our packed value is the saver; its save moves there (a GRU cell step on
        CPU saves two tensors so). Nodes that learnt the pattern move theirs without a read
        (see _move_saves)."""
        saves = self._trace.saves
        row = saves[sid]
        packed = self._packed_seqs
        old = row[S_SEQ]
        packed[old] -= 1
        if packed[old] <= 0:
            del packed[old]
        packed[seq] += 1
        saves[sid] = (seq, *row[1:])  # the unpack hook's node too (step events): see NOTE [ how steps are seen ]

    def _count_unseen(self, fn: Any, seq: int, attrs: tuple[tuple[str, str], ...]) -> None:
        """NOTE [ saves packed by other hooks ]: only the innermost saved_tensors_hooks pair
        applies, so a user's own pair, ``save_on_cpu`` or a non-reentrant checkpoint inside the
        block hides saves from our pack hook. A node made in the block with saved variables but
        no save of ours had them packed by another pair, or saved while hooks were set aside (a
        torch.func region), or saved as None. The raw saved variable names its unpack hook
        without unpacking (torch >= 2.9): saves of other pairs are counted for the notes and are
        never unpacked by us (their unpack may recompute a checkpointed segment or copy to a
        device). An older torch cannot say who packed a save without unpacking or changing it:
        there the nodes made while another pair was on top are known (see NOTE [ other pairs on
        an older torch ]) and their saved variables are counted, Nones included, and the note
        says so."""
        for lo, hi in self._func_seq:
            if lo <= seq and (hi < 0 or seq < hi):
                return  # see NOTE [ torch.func and our hooks ]: said in the notes already
        trace = self._trace
        others = any(lo <= seq and (hi < 0 or seq < hi) for lo, hi in self._other_seq)
        for attr, raw_attr in attrs:
            raws, listed = _compat.raw_saved_listed(fn, raw_attr)
            read = False
            for k, raw in enumerate(raws):
                hook = _compat.unpack_hook_of(raw)
                if hook is self._unpack:  # ours, packed under another number
                    sid = self._packed_info.get(id(_compat.packed_value(raw)))
                    if sid is not None:
                        self._reattribute(sid, seq)
                        trace.save_attr[sid] = f"{attr}[{k}]" if _indexed(attr, listed, len(raws)) else attr
                elif hook is _compat.NOT_VISIBLE:
                    if others:
                        trace.unseen_saves += 1
                    else:
                        read = True
                elif hook is not None:
                    trace.foreign_saves += 1
            if read:
                # An older torch, no other pair on top when the node was made: the saves are ours,
                # packed under another number (torch 2.6's in-place ops clone self first, under a
                # node of its own), or None; reading them runs only our unpack hook, which names them.
                many = _indexed(attr, listed, len(raws))
                try:
                    self._read_by_unpacking(fn, attr, None if many else attr, trace.save_attr)
                except Exception as e:
                    self._internal(e)

    def _hook_leaf(self, fn: Any, i: int, name: str, post: bool) -> None:
        """NOTE [ AccumulateGrad nodes come and go ]: a leaf's AccumulateGrad node lives only while
        a graph points at it; the next forward makes a new one for the same leaf (one node of the
        recording, its key being the leaf). Its hooks are kept per node index, and a leaf whose
        hooked node died gets its new node hooked when a walk meets it (see _rehook_leaf)."""
        pre = fn.register_prehook(self._make_pre(i, name))
        self._handles.append(pre)
        self._leaf_hooks[i] = pre
        if post:
            self._handles.append(fn.register_hook(self._make_post(i)))

    def _rehook_leaf(self, parent: Any, key: Any, post: bool) -> None:
        i = self._trace.node_index.get(key)
        if i is None:
            return
        h = self._leaf_hooks.get(i)
        if h is not None and h.hooks_dict_ref() is not None:
            return  # the node we hooked is the leaf's node still (one lives at a time)

        for nxt, _ in parent.next_functions:
            if nxt is not None and node_key(nxt) == key:
                self._hook_leaf(nxt, i, self._trace.nodes[i][2], post)
                return

    def _hook(self, fn: Any, i: int, name: str, post: bool) -> None:
        if i in self._hooked:
            return
        self._hooked.add(i)
        self._handles.append(fn.register_prehook(self._make_pre(i, name)))
        if post:
            self._handles.append(fn.register_hook(self._make_post(i)))

    def _hook_for_pass(self, roots: list[Any], keys: list[Any], stop: set[Any], into: list[Any]) -> None:
        """Pre hooks for one create_graph pass on every node it may run that has none yet and
        unpacks none of our saves (a node's first unpack reads the counter as a pre hook would:
        see NOTE [ how steps are seen ]); the walk starts at ``roots`` (their ``keys``) and stops at
        ``stop``, the keys of the ``inputs=`` nodes, which the engine does not run past."""

        index = self._trace.node_index
        names = self._trace.nodes
        self._packed(-1)
        packed, hooked, leaf_hooks = self._packed_seqs, self._hooked, self._leaf_hooks
        walker = self._walker
        if walker is not None:  # see NOTE [ compiled walk ] in gradscope._native
            if self._source is None and self._frees_once_a_pass:  # see NOTE [ compiled pass hooks ] in walk.cc
                found = walker.hook_pass(roots, keys, stop, self._state, self._trace.events)
                if found is not NotImplemented:
                    into.append(found)
                    return
            else:
                found = walker.unhooked(roots, keys, stop)
                if found is not NotImplemented:
                    for fn, i in found:
                        into.append(fn.register_prehook(self._make_pre(i, names[i][2])))
                    return
        for fn, key, _kids in walk(roots, stop=stop):
            i = index.get(key)
            if i is not None and i not in hooked and i not in leaf_hooks and key not in packed:
                into.append(fn.register_prehook(self._make_pre(i, names[i][2])))

    def _make_pre(self, i: int, name: str) -> Callable[[Any], None]:
        st = self._state
        events_append = self._trace.events.append
        seq = _compat.sequence_nr_fn()
        time_ns = time.time_ns
        boundary = self._step_boundary

        def pre(grad_outputs: Any) -> None:
            if st.bw is not None:
                try:
                    boundary(name)
                    events_append((EV_PRE, i, time_ns(), seq()))
                    st.prev_node = i
                    st.last_seq = -2  # the next unpack starts a new step
                except MemoryBudgetExceeded:
                    raise
                except Exception as e:
                    self._internal(e)

        return pre

    def _make_post(self, i: int) -> Callable[[Any, Any], None]:
        st = self._state
        events_append = self._trace.events.append
        time_ns = time.time_ns

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            if st.bw is not None:
                events_append((EV_POST, i, time_ns(), None))

        return post

    def _step_boundary(self, name: str | None) -> None:
        """Between two steps (or at a pass's end): frees of the last step's saves, the source's
        reading after the last step (``"X done"``) and before the next one (``name``)."""
        st = self._state
        if st.pending and (name is None or not self._frees_once_a_pass):  # see NOTE [ frees checked once a pass ]
            self._check_frees()
        src = self._source
        if src is not None and src.node_hooks:
            prev = st.prev_node
            if prev is not None and src.marks_steps:
                src.mark(self._trace.nodes[prev][2] + " done")
            if prev is not None or name is not None:
                self._trace.events.append((EV_LIVE, prev if prev is not None else -1, time.time_ns(), src.live()))
            if name is not None and src.marks_steps:
                src.mark(name)

    def _internal(self, e: BaseException) -> None:
        _note_internal(self._trace.notes, e)

    # ------------------------------------------------------------------ end of the block
    def _at_block_end(self, frame: Any, tb: Any) -> None:
        """Roots of graphs the block left behind (results in variables and in the objects they
        hold, module outputs, results in the frames an exception unwound) are walked, stopping at
        nodes made before the block (see NOTE [ the block's nodes ]); root modules get their user
        names."""
        local_ns, global_ns = _frame_namespaces(frame)
        values: list[Any] = list(local_ns.values()) if local_ns is not None else []
        if local_ns is not global_ns and global_ns is not None:
            values += [v for k, v in global_ns.items() if not str(k).startswith("_")]
        while tb is not None:  # the frames of a failure still hold its half-built graphs
            f = tb.tb_frame
            if f is not frame:
                loc, _ = _frame_namespaces(f)
                if loc is not None:
                    values += list(loc.values())
            tb = tb.tb_next
        seq0 = self._trace.seq0
        index = self._trace.node_index
        roots = [fn for fn in _held_graphs(values) if _made_since(fn, seq0, index)]
        for ref in self._roots:
            t = ref()
            fn = t.grad_fn if t is not None else None
            if fn is not None and _made_since(fn, seq0, index):
                roots.append(fn)
        self._roots.clear()
        del values
        self._hooking = False  # everything is uninstalled: this walk only reads
        try:
            self._discover(roots, since=seq0)
        finally:
            del roots
        mods = [r() for r in self._root_mods]
        self._trace.root_names = _names.names_in_frame(mods, local_ns, global_ns)
        del mods
        self._acc_vars.clear()

    def _gradient_keys(self, index: int, row: BackwardRow, result: Any) -> None:
        """Storages of the gradients a pass made, for the GRADIENT category: the returned
        gradients of ``autograd.grad``, or the ``.grad`` of every leaf it accumulated into."""
        tensors: list[Any] = []
        if row.api == "autograd.grad":
            tensors = [t for t in (result if isinstance(result, list | tuple) else (result,))
                       if isinstance(t, torch.Tensor)]
        else:
            acc_vars = self._acc_vars  # the leaves whose node ran, in the order they ran
            ran = dict.fromkeys(e[1] for e in itertools.islice(self._trace.events, row.ev0, row.ev1) if e[0] == EV_PRE)
            for ident in [i for i in ran if i in acc_vars]:
                var = acc_vars[ident]()
                if var is not None and var.grad is not None:
                    tensors.append(var.grad)
        keys = self._trace.gradient_keys
        walker = self._walker
        if walker is not None:  # see NOTE [ a pass in two calls ] in walk.cc
            src = self._source
            acc_known = walker.pass_end(tensors, index, row.t1_ns, keys, row.create_graph, self._hooking,
                                        src is not None and src.node_hooks, self._trace.seq0, _TYPES, _ORDERS)
            if acc_known is not NotImplemented:
                if acc_known is not None:
                    self._rehook_known(acc_known)
                return
        for t in tensors:  # a tensor the compiled call does not read (nothing of it was appended)
            try:
                s = t.untyped_storage()
                keys.append((index, int(_compat.storage_cdata(s)), int(s.data_ptr()), row.t1_ns))
            except (RuntimeError, NotImplementedError):
                pass
        if row.create_graph:
            self._discover(*self._roots_keys(tensors))

    def _roots_keys(self, values: Any, make: bool = True) -> tuple[list[Any], list[Any]]:
        """The graph nodes behind ``values`` and their keys (``make``: roots_of and node_key), or
        their keys only, without making a leaf's node (keys_of): compiled where the walk is."""
        if self._walker is not None:
            got = self._walker.roots(values, make)
            if got is not NotImplemented:
                return got
        if not make:
            return [], keys_of(values)
        roots = roots_of(values)
        return roots, [node_key(r) for r in roots]


# Per node class: (name, saved tensor attributes, custom Function?, its one attribute if it has
# exactly one non-list saved tensor, learnt from the first node of the class whose saves we read).
_TYPES: dict[type, tuple[str, tuple[tuple[str, str], ...], bool, str | None]] = {}
_LISTS: set[type] = set()  # classes whose single saved attribute is a list of tensors
# See NOTE [ pack order ]: per class, the attributes of its saves in pack order (trusted), the
# first order seen (to be confirmed), and classes whose nodes disagreed.
# An order is the attributes of the saves made under the node's number, in pack order, and the
# (offset, attribute) of the saves made under later numbers (see NOTE [ saves packed under another number ]).
_Order = tuple[tuple[str, ...], tuple[tuple[int, str], ...]]
_ORDERS: dict[Any, _Order] = {}  # a class, or (class, number of saves, inputs without an edge)
_ORDER_SEEN: dict[Any, _Order] = {}
_NO_ORDER: set[Any] = set()
_SEQ_OF = operator.itemgetter(S_SEQ)


def _indexed(attr: str, listed: bool, n: int) -> bool:
    """Whether a save's label carries its position: several saves behind one attribute, or a list
    attribute (a custom Function's ``saved_tensors`` holding one tensor is named plainly)."""
    return listed and attr != "saved_tensors" or n > 1


def _absent(next_functions: tuple[tuple[Any, int], ...]) -> int:
    """Which of a node's inputs have no gradient edge, as bits (see NOTE [ pack order ])."""
    bits = 0
    for k, (nxt, _) in enumerate(next_functions):
        if nxt is None:
            bits |= 1 << k
    return bits


def _learn_order(key: Any, named: list[tuple[int, str, int]] | None, count: int, moves: bool) -> None:
    """NOTE [ pack order ]: PyTorch's generated code saves a node's tensors in one fixed order
    per node class, so once a node of a class has had all its saved tensors packed and read
    (one per attribute, no lists), the k-th save of any node of that class with as many saves
    is that attribute: naming it needs no read of the node's saved variables (a few
    microseconds per node). Which tensors a node saves besides depends on which of its inputs
    need a gradient (``mul`` saves ``other`` for ``self``'s gradient and ``self`` for
    ``other``'s; an undefined optional tensor has no edge either), so a node with fewer saves
    than attributes is keyed by its class, its number of saves and the inputs without a
    gradient edge (one RNN cell step makes hundreds of such nodes); such a key also learns the
    saves its nodes make under later numbers (``moves``: an in-place ``mul_`` saving a clone).
    An order is trusted after two nodes agree; a key whose nodes disagree is always read."""
    if key in _ORDERS or key in _NO_ORDER or named is None or not count:
        return
    own = sorted((sid, label) for sid, label, offset in named if not offset)
    later = tuple(sorted((offset, label) for _, label, offset in named if offset))
    if len(own) != count or (later and not moves):
        return
    if len({offset for offset, _ in later}) != len(later) or any(offset < 0 for offset, _ in later):
        _NO_ORDER.add(key)  # two saves under one later number, or under an earlier one: read each time
        return
    order = (tuple(label for _, label in own), later)
    seen = _ORDER_SEEN.get(key)
    if seen is None:
        _ORDER_SEEN[key] = order
    elif seen == order:
        _ORDERS[key] = order
    else:
        _NO_ORDER.add(key)


def _type_info(fn: Any) -> tuple[str, tuple[tuple[str, str], ...], bool, str | None]:
    info = (node_name(fn), _compat.saved_tensor_attributes(fn),
            isinstance(fn, torch.autograd.function.BackwardCFunction), None)
    if node_name(fn) == type(fn).__name__:  # one class, one node kind: safe to remember
        _TYPES[type(fn)] = info
    return info


def _quiet_global_hook_warning() -> Callable[[], None]:
    """Hide the warning a ``torch.compile``d module gives on each call while global module hooks
    exist (``OptimizedModule.__call__`` in torch/_dynamo/eval_frame.py: "Using `torch.compile(module)`
    when there are global hooks on modules ..."), which here are gradscope's own. One filter entry
    for exactly that message goes first in ``warnings.filters`` for the block; the returned undo
    removes that entry (by identity), so the program's own filters, changed in the block or not,
    are as it left them, and its other warnings show as ever."""
    entry = ("ignore", re.compile(r"Using `torch\.compile\(module\)` when there are global hooks on modules"),
             UserWarning, None, 0)
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
    filters.insert(0, entry)
    _warning_filters_changed()

    def undo() -> None:
        now: list[Any] = warnings.filters  # type: ignore[assignment]  # another list if the program swapped it
        for lst in (now, filters) if now is not filters else (now,):
            for i, f in enumerate(lst):
                if f is entry:
                    del lst[i]
                    break
        _warning_filters_changed()

    return undo


def _warning_filters_changed() -> None:
    """What ``warnings.filterwarnings`` does after changing the list: drop cached decisions."""
    changed = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if changed is not None:
        changed()


# NOTE [ one key for module hooks ]: torch.compile guards a graph it compiled inside a block on
# the global module hooks as they were (their keys in torch's hook dicts): hooks registered anew
# by each block, under new keys, failed that guard at every block, so each block compiled again,
# and from the 9th on (the recompile limit) the model ran eagerly, unsaid. So every recorder's
# module hooks go through one pair of functions kept under one fixed key while any block records
# (removed when none does: nothing stays hooked), and a compiler tracing them returns at once.
_MODULE_HOOKS: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # the active blocks', in order
_MODULE_HOOKS_LOCK = threading.Lock()


def _module_pre(module: nn.Module, args: Any) -> None:
    if _compat.is_compiling():
        return
    for pre, _ in tuple(_MODULE_HOOKS):
        pre(module, args)


def _module_post(module: nn.Module, args: Any, output: Any) -> None:
    if _compat.is_compiling():
        return
    for _, post in tuple(_MODULE_HOOKS):
        post(module, args, output)


class _ModuleHooks:
    """One block's module hooks among the active blocks' (see NOTE [ one key for module hooks ])."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.entry = (pre, post)
        with _MODULE_HOOKS_LOCK:
            if not _MODULE_HOOKS:
                _compat.add_global_module_hooks(_module_pre, _module_post)
            _MODULE_HOOKS.append(self.entry)

    def remove(self) -> None:
        with _MODULE_HOOKS_LOCK:
            if self.entry in _MODULE_HOOKS:
                _MODULE_HOOKS.remove(self.entry)
            if not _MODULE_HOOKS:
                _compat.remove_global_module_hooks()


def _outside_compilers(hook: Callable[..., None]) -> Callable[..., None]:
    """A compiled module hook behind a Python test of ``is_compiling``: a compiler tracing a module
    reads the test as true and skips the call (a compiled hook it cannot trace would break its
    graph: torch 2.6 then ran the module eagerly). See NOTE [ hooks inside compiled modules ]."""
    compiling = _compat.is_compiling

    def call(*args: Any) -> None:
        if not compiling():
            hook(*args)

    return call


def _note_internal(notes: list[str], e: BaseException) -> None:
    """An error of gradscope's own while observing becomes a note (once); a budget's refusal is
    the user's and goes on."""
    if isinstance(e, MemoryBudgetExceeded):
        raise e
    msg = f"gradscope internal error while observing: {e!r}"
    if msg not in notes:
        notes.append(msg)


def _internal_failure(e: BaseException) -> GradscopeError:
    return GradscopeError(
        f"gradscope: recording failed inside gradscope ({e!r}); every hook was removed. "
        "Please report this with the code that triggered it."
    )


def _inplace_error(t: torch.Tensor, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t.type()} {list(t.shape)}] is at version {_compat.tensor_version(t)}; expected version "
        f"{expected} instead. (Checked by gradscope, as PyTorch does without saved-tensor hooks.) "
        "Hint: remove the in-place operation, or clone the tensor first."
    )


@contextlib.contextmanager
def _no_gc() -> Any:
    """NOTE [ no collection while rows are made ]: walks and passes make tens of thousands of
    small objects that all live on; Python's cyclic collector, triggered by that count, would
    scan every object in the process again and again (measured: a 5,000-node graph pass took
    127 ms with it, 4 ms without). Nothing gradscope makes there is cyclic garbage; the
    collector is switched off for those moments only, and back on as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _distributed() -> tuple[int | None, int | None]:
    """(rank, world size) under torch.distributed, else (None, None)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None, None


# NOTE [ the block's nodes ]: a notebook keeps earlier cells' results alive (an ``out`` whose graph
# is still there, a list of losses), and a script's globals hold the last step's graph while the
# next one is recorded. The block's graph is made of the nodes PyTorch created while it ran:
# PyTorch numbers nodes from a per-thread counter as it creates them, so a node of the recorded
# thread numbered below the counter at the block's start was made before it. The walk at the
# block's end takes no such root and enters no such node (an edge to one is dropped); a backward
# pass run inside the block still records every node it runs through, whenever it was made. Nodes
# made by other threads (a CUDA backward's ``create_graph`` nodes, made on the engine's device
# threads with their own counters) are found from the pass's gradients when it ends.
_SKIP_TYPES: tuple[type, ...] = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                 types.MethodType, types.CodeType, types.FrameType, str, bytes, int, float,
                                 complex, bool, range, weakref.ReferenceType)
_SKIP_PACKAGES = ("IPython", "ipykernel", "traitlets", "zmq", "tornado", "asyncio", "jupyter_client",
                  "ipywidgets", "comm", "gradscope", "torch")
_HELD_LIMIT = 20_000  # objects looked at, in all: a notebook's namespace may hold anything
_HELD_DEPTH = 6  # out.past_key_values.layers[i].keys is 5 steps from a variable
_PER_CONTAINER = 1_000


def _made_since(fn: Any, seq0: int, index: Mapping[Any, int]) -> bool:
    """Whether a root node is the block's (see NOTE [ the block's nodes ]) or walked already."""
    try:
        seq = _compat.node_sequence_nr(fn)
    except Exception:
        return True
    return seq == _compat.ACC_SEQ or seq >= seq0 or seq in index


def _held_graphs(values: list[Any]) -> list[Any]:
    """The ``grad_fn`` of every tensor held by ``values``: directly, in lists, tuples, sets and
    dicts, and in the attributes of the objects they hold (a KV cache in a model's output, a list
    of results kept on an object), breadth first, bounded in depth and in objects looked at. Not
    entered: Python modules, classes, functions, and objects of the notebook's and PyTorch's own
    machinery (an ``nn.Module`` is entered: a result kept as its attribute is held)."""
    found: list[Any] = []
    seen: set[int] = set()
    level = values
    looked = 0
    for _ in range(_HELD_DEPTH):
        nxt: list[Any] = []
        for v in level:
            if looked >= _HELD_LIMIT:
                return found
            if id(v) in seen:
                continue
            seen.add(id(v))
            looked += 1
            try:
                if isinstance(v, torch.Tensor):
                    fn = v.grad_fn
                    if fn is not None:
                        found.append(fn)
                    continue
                if v is None or isinstance(v, _SKIP_TYPES):
                    continue
                if isinstance(v, dict):
                    nxt.extend(itertools.islice(v.values(), _PER_CONTAINER))
                elif isinstance(v, list | tuple | set | frozenset | collections.deque):
                    nxt.extend(itertools.islice(v, _PER_CONTAINER))
                else:
                    mod = type(v).__module__ or ""
                    if mod.split(".", 1)[0] in _SKIP_PACKAGES and not isinstance(v, nn.Module):
                        continue
                    d = getattr(v, "__dict__", None)
                    if isinstance(d, dict):
                        nxt.extend(itertools.islice(d.values(), _PER_CONTAINER))
            except Exception:
                continue
        if not nxt:
            break
        level = nxt
    return found


def _frame_namespaces(frame: Any) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """A frame's locals and globals, read once.

    NOTE [ f_locals keeps tensors alive ]: before Python 3.13, reading a function frame's
    ``f_locals`` stores a snapshot dict of its locals on the frame, which keeps every value the
    function later ``del``s (a loss and its whole graph, a batch) alive until it returns. The
    snapshot is copied and emptied after reading; anything that reads ``f_locals`` or
    ``locals()`` again (a debugger, a trace function) gets a fresh one, so the function is
    unaffected."""
    if frame is None:
        return None, None
    try:
        local_ns = frame.f_locals
        global_ns = frame.f_globals
    except Exception:
        return None, None
    if local_ns is global_ns:
        return global_ns, global_ns
    copy = dict(local_ns)
    if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1:
        local_ns.clear()  # CO_OPTIMIZED: a function's snapshot, not a real namespace
    return copy, global_ns

