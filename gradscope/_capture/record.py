"""``gs.record()``: watch real code run and produce one immutable :class:`~gradscope.Recording`.

What is installed while a block runs, and removed in ``finally`` whatever happens:
- a ``saved_tensors_hooks`` pair (every tensor saved for backward, with its true storage bytes),
- global module forward pre/post hooks (module paths and parameter names, no user changes),
- global optimizer step pre/post hooks (optimizer phases),
- an interception of the autograd engine's entry point (backward and autograd.grad), which walks
  the graph about to run, once per node, and hooks the few nodes whose steps cannot be seen
  otherwise (see NOTE [ how steps are seen ]),
- one memory source from :mod:`gradscope.memory`.

The class :class:`record` is a facade: it holds the block's lifecycle (enter, set-up, exit,
analysis) and calls its parts in :mod:`gradscope._capture`, objects made for each block, each with
the block's shared state (:class:`~gradscope._capture.state.Block`) and its own: saves (the
saved-tensor hooks), modules (module and optimizer tracking), engine (the engine's entry point
intercepted), discover (graph discovery), held (what the block left behind); patches are what
the blocks of all threads share.

This module is also the face of the two public functions that act on what a block walked and
compiled: :func:`gradscope.release` (defined in :mod:`gradscope._capture.walk`, beside the walk whose node
objects it lets go of) and :func:`gradscope.compiled_saves` (defined in :mod:`gradscope._capture.compiled`).

The hooks only append rows to a :class:`~gradscope._base.trace.Trace`; the passes of
:mod:`gradscope._passes` turn it into the recording the first time it is asked for (see NOTE
[ capture apart from analysis ] in :mod:`gradscope._base.trace` and NOTE [ analysis on first look ]).

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
:mod:`gradscope._passes.steps`). Sources that read the allocator at every step (tracker, CUDA) hook
every node. A backward with ``create_graph=True`` needs the sequence counter as each node
starts: the nodes it creates (including the engine's ``AddBackward0`` that sums gradients
reaching one input) are then given to the node that was running (see NOTE [ orders ] in
:mod:`gradscope._passes.steps`). A node's generated code unpacks all its saved variables before it
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

import dataclasses
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from gradscope import _passes
from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError, MemoryBudgetExceeded
from gradscope._base.gc import paused
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.source import OWN_FILES as _OWN_FILES
from gradscope._base.trace import (
    C_SEQ1,
    C_T1,
    EV_POST,
    Trace,
)
from gradscope._base.units import format_bytes, parse_size
from gradscope._capture import compiled as _compiled
from gradscope._capture import native as _native
from gradscope._capture.compiled import compiled_saves
from gradscope._capture.discover import GraphDiscovery
from gradscope._capture.engine import EngineInterception, EngineRoute
from gradscope._capture.held_graphs import HeldGraphs
from gradscope._capture.loop import LoopTracking, Piece, parse_keep
from gradscope._capture.memory.counter import CounterSource
from gradscope._capture.memory.make import make_source
from gradscope._capture.memory.source import MemorySource
from gradscope._capture.modules import (
    ModuleTracking,
    _ModuleHooks,
    _OptimizerHooks,
    _outside_compilers,
    _quiet_global_hook_warning,
)
from gradscope._capture.patches import _active
from gradscope._capture.saves import SavedTensors
from gradscope._capture.state import Block, _new_state
from gradscope._capture.walk import release
from gradscope._model import names as _names
from gradscope._model.lines import LineTable, lines_enabled
from gradscope._model.recording import Loop, Recording
from gradscope._passes import iterations as _iterations

__all__ = ["compiled_saves", "record", "release"]

# NOTE [ the recorder is one piece ]: ``record`` is longer than a class should be (about 510 lines)
# and stays one piece: its parts are already apart (saved-tensor hooks, module tracking, graph
# discovery, engine interception, what a block leaves held: gradscope._capture's modules, each given
# the Block), and what is left here is what must mirror itself in one place: ``_install`` puts each
# hook in its place (the saved-tensor hooks' top, the module hooks' entry, the engine's route),
# ``_uninstall`` takes each out in the reverse order whatever failed, and a long loop's ``_cut``
# replaces each in the same place between two pieces; ``_finalize`` turns what they leave into a
# Recording. Split, the three lists of the same places would live in different files.
class record:  # noqa: N801 - as torch.no_grad
    """Record the autograd graph, saved tensors, backward steps and memory of a block.

    Args:
        memory: ``"auto"`` (CUDA allocator on a GPU, else the CPU allocator's events), ``"cpu"``,
            ``"cuda"``, ``"tracker"`` (online storage tracker; also used with a budget) or ``"off"``.
        budget: a simulated device size (``"8GiB"`` or bytes). Crossing it raises
            :class:`~gradscope.MemoryBudgetExceeded` at the allocation that crosses it.
        label: a name for the recording.
        modules: a module or ``{"name": module}`` to name the roots of module paths. By default
            a root module is named by the variable that holds it where the block ends (see NOTE
            [ naming roots ] in :mod:`gradscope._model.names`).
        max_events: bound on timeline points kept (the peak is always exact and kept).
        history: on CUDA, also record the caching allocator's event history for the timeline.
        tracker_device: the device type the tracker counts (``"meta"`` when predicting).
        lines: record the user's source line of every node, saved tensor and allocation
            (:attr:`~gradscope.Recording.lines`; see NOTE [ where lines come from ] in
            :mod:`gradscope._model.lines`). None: on unless the environment sets ``GRADSCOPE_LINES=0``.
        compiled: ``"attribute"`` (attribute each tensor a ``torch.compile``'d region compiled inside
            the block saves to its module and line: :func:`gradscope.compiled_saves`), ``"eager"``
            (run the block with torch.compile set aside: every op is shown, the compiled program's
            own peak may differ) or ``"off"``. See :mod:`gradscope._capture.compiled`.
        keep: a loop's iterations whose full detail to keep besides the first, the last, the one
            with the highest peak and the one that failed (an int or an iterable of ints:
            ``keep=[537]``), or ``"all"`` (every iteration's: memory grows with the loop). See NOTE
            [ iterations ] in :mod:`gradscope._passes.iterations`.
        progress: print a line to stderr every ``progress`` iterations of a loop (its time, memory
            and saves), as the loop runs.

    Example:
        >>> import torch, gradscope as gs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> with gs.record(memory="off") as rec:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sorted(n.leaf for n in rec.recording.nodes if n.leaf)
        ['model.0.bias', 'model.0.weight']
    """

    def __init__(self, memory: str | MemoryKind = "auto", *, budget: int | str | None = None, label: str = "",
                 modules: nn.Module | Mapping[str, nn.Module] | None = None,
                 max_events: int | None = 200_000, history: bool = False,
                 tracker_device: str = "cpu", lines: bool | None = None, compiled: str = "attribute",
                 keep: Any = None, progress: int | None = None) -> None:
        self._budget = parse_size(budget)
        self._keep_all, self._keep = parse_keep(keep)
        if progress is not None and (not isinstance(progress, int) or isinstance(progress, bool) or progress < 1):
            raise GradscopeError(f"gradscope: progress= takes a number of iterations >= 1, got {progress!r}.")
        self._progress = progress
        self._compiled = _compiled.Observer(compiled)
        self._memory = MemoryKind.resolve(memory, self._budget)  # the user's name, read once
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
        # the block's code for the diagnosis (see gradscope._base.source); the notebook magic gives its cell
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
        try:
            self._install()
        except BaseException:
            self._block.ended = None  # see NOTE [ no cycles through the recorder ] in gradscope._capture.saves
            try:
                self._uninstall()
            finally:
                self._saves._let_go()
            raise
        _active.rec = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        with paused():  # see NOTE [ no collection while rows are made ]
            return self._exit(exc_type, exc, tb, sys._getframe(1))

    def _exit(self, exc_type: Any, exc: Any, tb: Any, frame: Any) -> Literal[False]:
        _active.rec = None
        b = self._block
        trace = b.trace
        trace.t1_ns = time.time_ns()
        trace.seq1 = _compat.sequence_nr()
        self._failed = exc_type is not None
        b.ended = None  # see NOTE [ no cycles through the recorder ] in gradscope._capture.saves
        internal: BaseException | None = None
        try:
            self._uninstall()  # first: nothing that fails below may leave a hook installed
        except Exception as e:  # never mask the user's exception with ours
            internal = e
        b.state.stack.clear()  # module calls that raised: never keep a user's module alive
        # the trace keeps no reference to the exception (its traceback holds the user's frames)
        trace.refusal = exc.refusal if isinstance(exc, MemoryBudgetExceeded) else None
        trace.failed_oom = isinstance(exc, torch.OutOfMemoryError)
        trace.rank, trace.world_size = _distributed()
        error = None
        if exc_type is not None:
            error = f"{exc_type.__name__}: {exc}"
        # where the block is; its source is read when a diagnosis asks (gradscope._base.source), so that a
        # recording costs no file reading or parsing (a notebook cell gives its source itself)
        trace.step = self.given_step
        if trace.step is None and self._step_at is not None and not self._step_at[0].startswith(_OWN_FILES):
            trace.step = {"file": self._step_at[0], "line": self._step_at[1]}
        try:
            self._held._at_block_end(frame, tb)
        except Exception as e:
            internal = internal or e
        b.root_mods.clear()
        self._saves._free_weak_refs()
        self._saves._let_go()
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
                with paused():  # see NOTE [ no collection while rows are made ]
                    rec = self._finalize(complete=complete, error=error)
            except Exception as e:
                self._analysis = None
                self._recording = Recording(label=self._label, complete=False,
                                            error=error or f"gradscope internal error: {e!r}")
                self._block.trace = Trace()
                raise _internal_failure(e) from e
            self._analysis = None
            self._recording = rec
            self._block.trace = Trace()  # the rows are the recording's now

    def _finalize(self, complete: bool, error: str | None) -> Recording:
        """Everything after capture: the passes (see :mod:`gradscope._passes`); a loop's rows, what
        grows, and the pieces kept (see NOTE [ iterations ] in gradscope._passes.iterations)."""
        loop = self._loop
        trace = self._block.trace
        trace.memory_trace.resolve()
        loop.rows(trace, self._events_of(trace.memory_trace), last=True, failed=self._failed,
                  deltas=trace.memory_trace.key_kind == "none")
        carry = loop.carry
        labels = self._site_labels(trace)
        rows = carry.rows.table(self._t0_ns, labels)
        growth = _iterations.growth_rows(carry, labels)
        if not loop.cut:
            rec = _passes.build(trace, complete=complete, error=error)
            return self._compiled.attach(dataclasses.replace(rec, iterations=rows, growth=growth))
        final = Piece(trace, loop.first_in_piece, len(carry.rows) - 1)
        pieces = loop.kept_pieces(final if final.first <= final.last else None)
        for p in pieces:  # what only the block's end knows: the roots' names, the block's code
            p.trace.root_names, p.trace.step = trace.root_names, trace.step
            p.trace.rank, p.trace.world_size = trace.rank, trace.world_size
        peaks = carry.rows.peak
        if (self._failed or max(peaks, default=-1) < 0) and final in pieces:
            main = final
        elif max(peaks, default=-1) < 0:
            main = pieces[-1]
        else:
            at = max(range(len(peaks)), key=peaks.__getitem__)
            main = next(p for p in pieces if p.first <= at <= p.last)
        made: dict[int, Recording] = {}
        for p in pieces:
            last = p is final
            r = _passes.build(p.trace, complete=complete if last else True, error=error if last else None)
            start = carry.rows.start[p.first]
            made[id(p)] = dataclasses.replace(r, loop=Loop(detail=(p.first, p.last), saved_bytes=r.saved_bytes,
                                                           carried_bytes=max(start, 0)))
        head = made[id(main)]
        parts = tuple(made[id(p)] for p in pieces if p is not main)
        notes = head.notes + (
            f"a loop of {len(carry.rows)} iterations: the detail here is iteration {main.first}"
            + (f"-{main.last}" if main.last > main.first else "")
            + f"'s ({'the failing one' if self._failed else 'the highest peak'}); "
            f"{len(parts)} other part(s) kept (rec.recording.loop.parts), every iteration's row in "
            "rec.recording.iterations (see NOTE [ iterations ] in gradscope._passes.iterations).",)
        assert head.loop is not None
        return self._compiled.attach(dataclasses.replace(
            head, iterations=rows, growth=growth, notes=notes,
            loop=Loop(detail=head.loop.detail, parts=parts, saved_bytes=carry.saved_total,
                      carried_bytes=head.loop.carried_bytes)))

    def _site_labels(self, trace: Trace) -> list[str]:
        """The names of the sites the rows and growth speak of, with the names the block's end gave."""
        prefixes = _passes.naming_pass(trace)
        table = trace.line_table
        rows = table.rows if table is not None else []

        def line_label(i: int) -> str | None:
            return rows[i].label if 0 <= i < len(rows) else None

        def module_name(root: int, rel: str) -> str:
            return _names.full_name(prefixes[root], rel) or trace.roots[root][0] if root < len(prefixes) else rel

        return _iterations.labels_for(self._loop.carry, line_label, module_name)

    @staticmethod
    def _events_of(mt: Any) -> Any:
        """A piece's memory events for the rows (None: no memory figures)."""
        return mt.events if mt.source.measures else None

    def add_roots(self, *tensors: torch.Tensor) -> None:
        """Name more results whose graphs belong to this recording (before the block ends)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._block.roots.append(weakref.ref(t))

    def iterations_so_far(self, start: int = 0) -> tuple[int, dict[str, list[Any]]]:
        """A loop's iterations while it runs (see NOTE [ iterations ] in gradscope._passes.iterations): how
        many have ended, and the rows made from ``start`` on, as columns (memory figures -1 where
        not read yet: ``memory="cpu"`` reads its first ten iterations' when the tenth ends). Any
        thread may ask; before the block, ``(0, {})``."""
        loop = getattr(self, "_loop", None)
        if loop is None:
            return 0, {}
        rows = loop.carry.rows
        return loop.iterations, rows.columns(self._t0_ns, min(start, rows.done), rows.done)

    @property
    def memory_source(self) -> MemorySource | None:
        """The block's memory source while it runs (None before the block starts): ``gs.predict``
        counts into it the bytes no operator output holds (NOTE [ bytes no operator output holds ]
        in gradscope._analyses.predict.predictor)."""
        b = getattr(self, "_block", None)  # set as the block starts
        return None if b is None else b.source

    def between_nodes(self) -> bool:
        """True while an observed backward pass is between one node's end and the next node's
        start (where the engine sums gradients that reach one input). Known only for sources
        that hook every node (the tracker, CUDA)."""
        st = self._block.state
        ev = self._block.trace.events
        return st.bw is not None and bool(ev) and ev[-1][0] == EV_POST

    # ------------------------------------------------------------------ set-up
    def _init_state(self) -> None:
        """The block's shared state and its parts (see :mod:`gradscope._capture`)."""
        tid = threading.get_ident()
        native = _native.hooks()  # None: the Python pair records (see NOTE [ compiled hooks ])
        caps = _compat.capabilities()
        self._t0_ns = time.time_ns()
        self._failed = False
        self._loop = LoopTracking(keep_all=self._keep_all, named=self._keep)
        if self._progress is not None:
            self._loop.listeners.append(_ProgressLines(self._progress, self._t0_ns))
        self._storages: dict[int, tuple[int, int]] = {}  # see NOTE [ a storage's identity in a block ]
        self._root_index: dict[int, int] = {}
        tr = Trace(tid=tid, memory=self._memory, label=self._label, t0_ns=self._t0_ns, seq0=_compat.sequence_nr(),
                   max_events=self._max_events, deep_graph_trap=caps.nodes_persist,
                   modules_given=bool(self._given), torch_version=torch.__version__)
        if not caps.sequence_nr:
            tr.notes.append(_compat.MISSING_NOTES["sequence_nr"])
        tr.line_table = LineTable() if self._lines_on else None
        b = Block(tid=tid, memory=self._memory, history=self._history, native=native, caps=caps,
                  trace=tr, state=_new_state(native), line_table=tr.line_table)
        self._parts(b)

    def _parts(self, b: Block) -> None:
        """A piece's parts (the block's first, or the next after a cut: see NOTE [ iterations ] in
        gradscope._passes.iterations), made current."""
        b.ended = self._ended
        self._block = b
        self._saves = SavedTensors(b, self._storages)
        self._modules = ModuleTracking(b, self._given, self._root_index)
        self._discovery = GraphDiscovery(b, self._saves)
        self._engine = EngineInterception(b, self._saves, self._discovery)
        self._held = HeldGraphs(b, self._discovery)

    def _module_hooks(self) -> tuple[Any, Any]:
        """The current piece's module hooks (compiled where the source marks no call)."""
        b, modules, src = self._block, self._modules, self._block.source
        if b.native is not None and (src is None or not src.kind.marks_calls):  # NOTE [ compiled module hooks ]
            compiled = b.native.ModHooks(b.state, b.trace.calls, b.trace.module_paths, modules._root_of, b.roots,
                                         b.internal, b.tid)
            return _outside_compilers(compiled.pre), _outside_compilers(compiled.post)
        return modules._mod_pre, modules._mod_post

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._modules._opt_pre(optimizer, args, kwargs)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._modules._opt_post(optimizer, args, kwargs)

    # ------------------------------------------------------------------ a loop's iterations
    def _ended(self, kind: str, row: Any) -> None:
        """A backward pass or an optimizer step ended (see NOTE [ iterations ] in gradscope._passes.iterations):
        an iteration's end is marked, its row made where the source reads memory as the loop runs,
        and past the head the capture is cut."""
        b = self._block
        loop = self._loop
        if not loop.ended(kind, b.trace, row):
            return
        b.roots[:] = [r for r in b.roots if r() is not None]  # module outputs of graphs gone
        if loop.should_cut():
            try:
                if self._cut():
                    return
            except Exception as e:  # the loop goes on in one piece from here
                loop.can_cut = False
                self._block.internal(e)
        src = b.source
        if src is not None:
            src.drain()
        # an online source's events are there as the loop runs; samples of totals come as deltas
        events = getattr(src, "events", None) if src is not None and src.kind.online else None
        if events is not None or src is None:
            loop.rows(b.trace, events, deltas=src is not None and src.kind.key_kind(b.history) == "none")

    def _cut(self) -> bool:
        """End the current piece of the capture and begin the next (see NOTE [ iterations ] in
        gradscope._passes.iterations): what was made for the piece (its trace, hooks state, saved-tensor pair,
        walk, module hooks) is handed over, new ones are put in place of those the block installed
        (the same places: the saved-tensor hooks' top, the module hooks' entry, the engine's route),
        and the finished piece's rows are made. Only between iterations outside any module call,
        backward pass or torch.func region, with our pair on top (else the next end tries again).
        Returns whether it cut."""
        old = self._block
        st = old.state
        if st.stack or st.bw is not None or st.func_depth or not self._saves._hooks_on_top():
            return False
        src = old.source
        memory = old.memory
        if src is not None and not src.kind.online:  # see NOTE [ a long loop's memory ] in gradscope.memory
            if old.native is None:
                self._loop.can_cut = False
                old.trace.notes.append(
                    "memory='cpu' in a long loop: the compiled hooks are not in use here, so every iteration's "
                    "detail is kept and the profiler's events grow with the loop; build them (python -m gradscope "
                    "setup) or record with memory='tracker'.")
                return False
        elif src is not None and (getattr(src, "cut", None) is None or getattr(src, "history", False)):
            self._loop.can_cut = False  # a source read once, at the end (CUDA's history)
            return False
        try:
            self._held._at_cut()
        except Exception as e:
            old.internal(e)
        trace = old.trace
        trace.t1_ns = time.time_ns()
        trace.seq1 = _compat.sequence_nr()
        for h in old.node_handles:
            h.remove()
        old.node_handles.clear()
        old.ended = None  # see NOTE [ no cycles through the recorder ] in gradscope._capture.saves
        old_saves = self._saves
        old_saves._free_weak_refs(storages=False)
        old_saves.sweep()  # the block's storage identities: those that died go (the next pair counts from here)
        old_saves._let_go()
        new_src: MemorySource | None = src
        if src is not None and not src.kind.online:  # the profiler: read once, at its stop
            trace.memory_trace = src.stop()
            new_src, memory = None, memory.long_loop  # started once the next piece is in place (below)
        elif src is not None:
            trace.memory_trace = src.cut()  # type: ignore[attr-defined]
        trace.memory_trace.resolve()
        tr = Trace(tid=trace.tid, memory=memory, label=trace.label, t0_ns=self._t0_ns, seq0=trace.seq1,
                   max_events=trace.max_events, deep_graph_trap=trace.deep_graph_trap,
                   modules_given=trace.modules_given, torch_version=trace.torch_version,
                   roots=trace.roots, module_paths=trace.module_paths, param_keys=trace.param_keys,
                   baseline_storages=trace.baseline_storages, line_table=trace.line_table,
                   save_base=trace.save_base + len(trace.saves), piece_t0_ns=trace.t1_ns)
        b = Block(tid=old.tid, memory=memory, history=old.history, native=old.native, caps=old.caps, trace=tr,
                  state=_new_state(old.native), line_table=old.line_table, source=new_src, handles=old.handles,
                  undo=old.undo, root_mods=old.root_mods, param_by_id=old.param_by_id)
        self._parts(b)
        _compat.pop_saved_tensors_hooks()
        try:
            _compat.push_saved_tensors_hooks(self._saves.pack, self._saves.unpack)
        except BaseException:  # the block's own place on the hooks' stack is kept whatever happens
            _compat.push_saved_tensors_hooks(old_saves.pack, old_saves.unpack)
            raise
        if memory is not old.memory and new_src is None:  # see NOTE [ a long loop's memory ] in gradscope.memory
            counter = CounterSource(_native.counter())
            counter.start()
            b.source = new_src = counter
        self._mod_entry.replace(*self._module_hooks())
        self._route.engine = self._engine
        watch_alias = getattr(new_src, "watch_alias", None)
        if watch_alias is not None and b.native is not None:
            self._saves.alias_watchers.append(watch_alias)
        self._loop.cut = True
        self._loop.piece_done(trace, self._events_of(trace.memory_trace), deltas=trace.memory_trace.key_kind == "none")
        if memory != old.memory:  # the counter names sites by line: growth is counted anew from here
            _iterations.restart_site_growth(self._loop.carry)
        return True


    def _install(self) -> None:
        b, saves = self._block, self._saves
        src = make_source(self._memory, budget=self._budget, device_type=self._tracker_device,
                          history=self._history, context=self._context)
        hooks = saved_tensors_hooks(saves.pack, saves.unpack)
        hooks.__enter__()
        b.undo.append(lambda: hooks.__exit__(None, None, None))
        b.source = src  # for the module hooks' choice; started below
        mod_pre, mod_post = self._module_hooks()
        b.source = None
        # always_call: a forward that raises closes its call too (a caught error must not leave its
        # module open, or the nodes made after it would be given to that module)
        self._mod_entry = _ModuleHooks(mod_pre, mod_post)  # see NOTE [ one key for module hooks ]
        b.handles.append(self._mod_entry)
        b.undo.append(_quiet_global_hook_warning())
        b.handles.append(_OptimizerHooks(self._opt_pre, self._opt_post))  # see NOTE [ one pair of optimizer hooks ]
        self._route = EngineRoute(self._engine)
        self._engine._patch_engine(self._route)
        b.undo.append(self._compiled.start())
        if src is not None:
            if b.line_table is not None and hasattr(src, "line_of"):  # see NOTE [ where lines come from ]
                src.line_of = b.line_table.here
            src.start()
            b.source = src
            b.undo.append(self._stop_source)
            watch_alias = getattr(src, "watch_alias", None)
            if watch_alias is not None and b.native is not None:
                saves.alias_watchers.append(watch_alias)
                b.undo.append(saves.alias_watchers.clear)

    def _stop_source(self) -> None:
        b = self._block
        src, b.source = b.source, None
        if src is not None:
            b.trace.memory_trace = src.stop()

    def _uninstall(self) -> None:
        first: BaseException | None = None
        b = self._block
        st = b.state
        src = b.source
        for h in b.node_handles:
            try:
                h.remove()
            except BaseException as e:
                first = first or e
        b.node_handles.clear()
        while st.stack:  # module calls left open by an exception inside a forward
            _, call, token = st.stack.pop()
            call[C_SEQ1] = _compat.sequence_nr()
            call[C_T1] = time.time_ns()
            try:
                if src is not None and src.kind.marks_calls:
                    src.call_exit(token, "")
            except Exception as e:
                first = first or e
        for h in b.handles:
            try:
                h.remove()
            except BaseException as e:  # a KeyboardInterrupt here must not skip the rest
                first = first or e
        b.handles.clear()
        while b.undo:
            undo = b.undo.pop()
            try:
                undo()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _context(self) -> tuple[int | None, int | None]:
        """(position in the step events, module call running) for online sources."""
        st = self._block.state
        step = len(self._block.trace.events) if st.bw is not None else None
        call = self._calls_index(st.stack[-1][1]) if st.stack else None
        return step, call

    def _calls_index(self, call: list[Any]) -> int:
        return int(call[6])


class _ProgressLines:
    """``gs.record(progress=N)``: a line on stderr each ``N`` iterations (see NOTE [ iterations ] in
    gradscope._passes.iterations), from the rows made since the last one."""

    def __init__(self, every: int, t0_ns: int) -> None:
        self.every = every
        self.t0_ns = t0_ns
        self.said = 0

    def __call__(self, loop: LoopTracking) -> None:
        rows = loop.carry.rows
        while rows.done >= self.said + self.every:
            a, b = self.said, self.said + self.every
            self.said = b
            ms = 1e3 * (rows.end_ns[b - 1] - rows.start_ns[a]) / 1e9 / (b - a)
            line = f"gradscope: iteration {b - 1}: {ms:.2f} ms each"
            peak = max(rows.peak[a:b])
            if peak >= 0:
                line += (f", peak {format_bytes(peak)}, {format_bytes(rows.end[b - 1])} alive at its end "
                         f"(allocated inside the block)")
            line += f", saved {format_bytes(rows.saved[b - 1])}"
            print(line, file=sys.stderr, flush=True)


def _internal_failure(e: BaseException) -> GradscopeError:
    return GradscopeError(
        f"gradscope: recording failed inside gradscope ({e!r}); every hook was removed. "
        "Please report this with the code that triggered it."
    )


def _distributed() -> tuple[int | None, int | None]:
    """(rank, world size) under torch.distributed, else (None, None)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None, None
