"""Memory sources: where a recording's bytes come from, behind one small protocol.

- ``cpu``: PyTorch's profiler allocation events. They come from the CPU allocator itself, so they
  include memory that kernels allocate internally (CPU convolution's temporaries), which a tracker
  of operator outputs cannot see. See NOTE [ CPU bytes come from the allocator ].
- ``tracker``: a dispatch mode that follows every operator's output storages with weak references.
  It is online (it knows the live total at every moment), so it enforces a simulated budget
  (:class:`~gradscope.errors.MemoryBudgetExceeded`) and works on the meta device for prediction;
  it misses kernel-internal temporaries.
- ``cuda``: the caching allocator's statistics (allocated, reserved; with ``history=True`` its
  event history) and NVML totals through ``nvidia-ml-py`` when present.

Every source implements :class:`MemorySource` and hands over a
:class:`~gradscope._trace.MemoryTrace` (the same :class:`AllocEvent` rows for all of them), so the
recorder and the passes never ask which source they have. Sources keep no tensors alive: only
sizes, addresses and weak references.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from gradscope import _compat
from gradscope._stderr import LineFilter
from gradscope._trace import MemoryTrace
from gradscope.errors import GradscopeError, MemoryBudgetExceeded

__all__ = [
    "AllocEvent",
    "CounterSource",
    "CudaSource",
    "EvalScope",
    "MemorySource",
    "ProfilerSource",
    "TrackerSource",
    "cuda_stats",
    "make_source",
    "nvml_device_totals",
    "parse_size",
    "resolve_memory",
]

_MODES = ("auto", "cpu", "cuda", "tracker", "off")


class AllocEvent(NamedTuple):
    """One allocation (``size > 0``) or free (``size < 0``) inside the block.

    ``t_ns`` is on the ``time.time_ns()`` clock (the profiler's clock is converted to it by
    PyTorch). ``key`` names the block or storage (see :attr:`MemoryTrace.key_kind`). ``scope`` is,
    for the profiler source, the index of the engine's ``evaluate_function`` scope it happened in
    (None outside backward); ``step`` is, for online sources, the position in the trace's step
    events when it happened; ``call`` the module call running; ``hint`` ``"optimizer"`` or
    ``"other"`` when the source saw it inside an optimizer step or a ``zero_grad``. ``line`` is
    the user's line on the stack when it was made (the tracker; an index into the recorder's line
    table, -1 or None: none; see NOTE [ where lines come from ] in :mod:`gradscope._lines`).
    """

    t_ns: int
    size: int
    key: int
    label: str
    scope: int | None = None
    step: int | None = None
    reserved: int | None = None
    call: int | None = None
    hint: str | None = None
    backward: int | None = None
    line: int | None = None
    seq: int | None = None  # the autograd sequence counter when it was made (the allocator's counter)


class EvalScope(NamedTuple):
    """One node's scope seen by the profiler (``TanhBackward0``, with the node's number).

    ``backward`` is the index of the gradscope backward marker it ran under (None: a backward
    gradscope did not observe); ``nested`` is True for scopes inside another node's scope (a
    reentrant backward, e.g. reentrant checkpointing).
    """

    name: str
    seq: int
    start_ns: int
    end_ns: int
    backward: int | None
    nested: bool


class MemorySource(Protocol):
    """What the recorder asks of a memory source, and nothing more.

    ``online``: it knows the live total at any moment (budgets, bytes around each step).
    ``node_hooks``: it wants every node's start and end (it reads the allocator there).
    ``marks_calls``: it wants :meth:`call_enter` / :meth:`call_exit` at module calls and
    backward passes. ``marks_steps``: it wants :meth:`mark` at step boundaries.
    """

    name: str
    online: bool
    node_hooks: bool
    marks_calls: bool
    marks_steps: bool

    def start(self) -> None: ...
    def stop(self) -> MemoryTrace: ...
    def live(self) -> int | None: ...
    def call_enter(self, kind: str, index: int, label: str) -> Any: ...
    def call_exit(self, token: Any, label: str) -> None: ...
    def mark(self, label: str) -> None: ...


def parse_size(size: int | str | None) -> int | None:
    """``"8GiB"`` -> 8589934592; ints pass through; raises GradscopeError on nonsense."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool)):
        if isinstance(size, int) and size <= 0:
            raise GradscopeError(f"gradscope: a memory budget must be positive, got {size}.")
        return size
    if not isinstance(size, str):
        raise GradscopeError(
            f"gradscope: a memory size must be an int of bytes or a string like '8GiB', got {size!r}."
        )
    s = size.strip().replace(" ", "")
    units = {
        "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
        "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4,
        "tib": 1024**4,
    }
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:].lower()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise GradscopeError(
            f"gradscope: cannot read the memory size {size!r}; write it like '512MiB', '8GiB' or "
            "'2GB' (KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000)."
        )
    return int(value * units[unit])


def resolve_memory(memory: str, budget: int | None) -> str:
    """Turn ``memory="auto"`` and a budget into the concrete source name."""
    if memory not in _MODES:
        raise GradscopeError(
            f"gradscope: memory={memory!r} is not one of {', '.join(_MODES)}. Use 'auto' to take "
            "CUDA's allocator on a GPU and the CPU allocator's events otherwise."
        )
    if memory == "auto":
        memory = "cuda" if torch.cuda.is_available() else "cpu"
    if budget is not None and memory in ("cpu", "off"):
        # NOTE [ budgets need an online source ]: the profiler's events arrive only after the
        # block, so a budget that must stop the program at the crossing allocation uses the tracker.
        memory = "tracker"
    return memory


def make_source(memory: str, *, budget: int | None = None, device_type: str = "cpu",
                history: bool = False, context: Callable[[], tuple[int | None, int | None]] | None = None
                ) -> MemorySource | None:
    """The source for a resolved ``memory`` name (None for ``"off"``). ``context`` returns the
    recorder's (step event position, module call) at any moment, for online sources."""
    if memory == "cpu":
        return ProfilerSource()
    if memory == "tracker":
        return TrackerSource(device_type, budget, context=context)
    if memory == "cuda":
        if not torch.cuda.is_available():
            raise GradscopeError(
                "gradscope: memory='cuda' but CUDA is not available here; use memory='cpu', or "
                "gs.predict(..., device='cuda') to estimate CUDA memory without a GPU."
            )
        return CudaSource(history=history, context=context)
    return None


def _no_context() -> tuple[int | None, int | None]:
    return None, None


def _inside_only(events: list[AllocEvent]) -> list[AllocEvent]:
    """Drop frees of memory allocated before the block (the profiler reports them with a size when
    an earlier profiling session saw the allocation): they are baseline, not the block's memory."""
    live: dict[int, int] = {}
    out: list[AllocEvent] = []
    for e in events:
        if e.size > 0:
            live[e.key] = e.size
            out.append(e)
        elif live.pop(e.key, None) is not None:
            out.append(e)
    return out


# --------------------------------------------------------------------------------------
# CPU: the profiler's allocation events
# --------------------------------------------------------------------------------------
_profiler_lock = threading.Lock()
_profiler_busy = False  # see NOTE [ one profiler at a time ]
MARK = "gradscope."
_MEMORY_EVENT = "[memory]"  # the name the profiler gives allocation events
_CLOCK = "gradscope.clock#"  # numbered: see NOTE [ profiler clock ]
_CLOCK_READINGS = 5
_OPT_STEP = "Optimizer.step#"
_ZERO_GRAD = ("Optimizer.zero_grad#", "Module.zero_grad")


class ProfilerSource:
    """NOTE [ CPU bytes come from the allocator ]: the profiler with memory profiling gets a
    report from the CPU allocator for every allocation and free, including buffers that kernels
    allocate internally. The running sum of those events from the block's start is the block's
    live memory; frees of memory allocated before the block come without a size and are ignored,
    so pre-existing tensors never count toward ``peak_bytes``. The profiler runs lean (see NOTE
    [ a lean profiler ] in :mod:`gradscope._compat`).

    NOTE [ profiler marks ]: the recorder opens a profiler scope per module call and per backward
    pass (``gradscope.module#3``, ``gradscope.backward#0``), so that each allocation knows its
    module and each node scope its backward pass from the event tree itself, without comparing
    clocks.
    """

    name = "cpu"
    online = False
    node_hooks = False
    marks_calls = True
    marks_steps = False

    def __init__(self) -> None:
        self._running = False
        self._clock: list[tuple[int, int]] = []
        self._noise = LineFilter()
        self._ops = False  # op scopes (a distributed job): collectives are read from them
        self._taken = False  # see NOTE [ a profiler started inside the block ]
        self._restore: Callable[[], None] | None = None

    def start(self) -> None:
        """NOTE [ one profiler at a time ]: PyTorch runs one profiler session per process. A
        second one started in another thread crashes the process when both stop (segmentation
        fault), and one started inside a user's ``torch.profiler`` session ends theirs (it records
        nothing more). So a busy profiler is refused with a GradscopeError before anything starts."""
        global _profiler_busy
        with _profiler_lock:
            if _profiler_busy or _compat.profiler_enabled():
                raise GradscopeError(
                    "gradscope: memory='cpu' reads PyTorch's profiler, and a profiler session is "
                    "already running (your torch.profiler, or a recording in another thread); "
                    "PyTorch runs one at a time. Use memory='tracker' (no profiler needed) or "
                    "memory='off' here, or record after the other session ends."
                )
            _profiler_busy = True
        try:
            with _quiet_stderr():
                self._ops = _in_distributed_job()
                _compat.start_node_profiler(ops=self._ops)
            self._running = True
            self._noise.start()  # see NOTE [ the profiler's free warning ] in gradscope._stderr
            # NOTE [ profiler clock ]: the profiler stamps events with its own clock; a scope
            # opened between two time.time_ns() readings gives the offset to ours, to within the
            # time between them. A thread preempted there (a busy machine) would shift every event
            # by as much and pair saves with the wrong allocations, so a few are opened and the
            # tightest pair of readings is used.
            clock = []
            for k in range(_CLOCK_READINGS):
                before = time.time_ns()
                handle = _compat.record_scope_enter(f"{_CLOCK}{k}")
                clock.append((before, time.time_ns()))
                _compat.record_scope_exit(handle)
            self._clock = clock
            self._watch_takeover()
        except BaseException:
            self._noise.stop()
            if self._running:
                self._running = False
                with _quiet_stderr():
                    _compat.stop_profiler()
            _profiler_busy = False
            raise

    def _watch_takeover(self) -> None:
        """NOTE [ a profiler started inside the block ]: PyTorch runs one profiler session per
        thread, and a ``torch.profiler.profile`` the program starts inside the block replaces
        this one (no error on recent torch). From then on the block's scopes would land in the
        program's profile: so the profiler's start inside ``torch.autograd.profiler`` is watched
        while the block runs, and after one that succeeded on this thread no scope is opened."""
        prof = torch.autograd.profiler
        orig = getattr(prof, "_enable_profiler", None)
        if orig is None:
            return
        tid = threading.get_ident()
        source = weakref.ref(self)

        def enable(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            me = source()
            if me is not None and threading.get_ident() == tid:
                me._taken = True
            return out

        prof._enable_profiler = enable
        self._restore = lambda: setattr(prof, "_enable_profiler", orig)

    def stop(self) -> MemoryTrace:
        global _profiler_busy
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        running, self._running = self._running, False
        out = MemoryTrace(source=self.name, device="cpu", online=False, key_kind="address")
        if not running:
            return out
        try:
            if not _compat.profiler_session_active():
                # PyTorch ends the running session when code inside starts and stops a profile of
                # its own (torch 2.13: a second torch.profiler.profile() starts without an error):
                # the events after that went to it, not to this block.
                out.failures.append(
                    "the profiler session memory='cpu' reads was ended inside the block by another "
                    "profiler (a torch.profiler.profile started inside it): allocations after that "
                    "are missing. Record that code with memory='tracker', or profile it outside the block."
                )
            with _quiet_stderr():
                results = _compat.stop_profiler()
        finally:
            self._noise.stop()
            _profiler_busy = False
        if results is None:
            return out
        ops, clock = self._ops, self._clock

        def read(trace: MemoryTrace) -> None:  # see NOTE [ analysis on first look ] in gradscope.record
            roots = _compat.results_event_tree(results)
            trace.events, trace.scopes = self._parse(roots)
            if ops:
                trace.collectives = _collective_rows(roots, clock)

        out.pending = read
        return out

    def live(self) -> int | None:
        return None

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        if self._taken:  # see NOTE [ a profiler started inside the block ]
            return None
        return _compat.record_scope_enter(f"{MARK}{kind}#{index}")

    def call_exit(self, token: Any, label: str) -> None:
        if token is not None and not self._taken:
            _compat.record_scope_exit(token)

    def mark(self, label: str) -> None:
        pass

    def _parse(self, roots: Any) -> tuple[list[AllocEvent], list[EvalScope]]:
        """Allocation events and node scopes from the profiler's event tree, each allocation with
        the node scope, module mark and backward mark it happened under.

        NOTE [ reading the event tree ]: every field read through the profiler's bindings costs
        100-350 ns, and a graph of small ops leaves tens of thousands of events (a 5,000-op chain:
        20,000 allocations and frees, 5,000 node scopes), so the read is the biggest cost of the
        CPU source after the profiler's own. The walk is iterative (deep trees must not hit the
        recursion limit) and reads each event's fields once: siblings are read in one loop over
        their list, an event's kind by its name (``typed`` and ``tag`` build Python objects for
        each event: 0.5-1.1 us), an allocation by three fields, and only scopes with children open
        a frame.
        Preorder is kept, so events and scopes come out in time order within each scope."""
        node_scope = _compat.node_scope()
        check_device = torch.cuda.is_available()  # without CUDA every allocation is the CPU's
        events: list[AllocEvent] = []
        scopes: list[EvalScope] = []
        offset = _clock_offset(roots, self._clock)
        new_event = tuple.__new__
        append = events.append
        mem_name = _MEMORY_EVENT
        # Frames: (siblings left to read, (label, node scope, module call, backward mark, hint)).
        frames: list[tuple[Iterator[Any], tuple[str, int | None, int | None, int | None, str | None]]] = [
            (iter(roots), ("", None, None, None, None))
        ]
        while frames:
            it, ctx = frames[-1]
            label, scope, call, bw, hint = ctx
            for ev in it:
                name = ev.name
                if name == mem_name:
                    ef = ev.extra_fields
                    if check_device and ef.device.type != "cpu":
                        continue
                    append(new_event(AllocEvent, (ev.start_time_ns - offset, ef.alloc_size, ef.ptr, label, scope,
                                                  None, None, call, hint, bw, None, None)))
                    continue
                ef = ev.extra_fields
                if not hasattr(ef, "scope"):  # not an operator or user scope (an out-of-memory event)
                    continue
                children = ev.children
                c_label, c_scope, c_call, c_bw, c_hint = label, scope, call, bw, hint
                if name.startswith(MARK):
                    kind, _, idx = name[len(MARK):].partition("#")
                    try:
                        if kind == "module":
                            c_call = int(idx)
                        elif kind == "backward":
                            c_bw = int(idx)
                    except ValueError:
                        pass
                elif ef.scope == node_scope:
                    node = name.rsplit("::", 1)[-1]
                    scopes.append(EvalScope(node, int(getattr(ef, "sequence_number", -1)), ev.start_time_ns - offset,
                                            ev.end_time_ns - offset, bw, scope is not None))
                    c_scope = len(scopes) - 1
                    c_label = node
                elif name.startswith(_OPT_STEP):
                    c_hint, c_label = "optimizer", name
                elif name.startswith(_ZERO_GRAD):
                    c_hint, c_label = "other", name
                elif scope is None:
                    c_label = name  # a user's record_function
                if children:
                    frames.append((iter(children), (c_label, c_scope, c_call, c_bw, c_hint)))
                    break
            else:
                frames.pop()
        if len(events) > 1 and any(events[i].t_ns > events[i + 1].t_ns for i in range(len(events) - 1)):
            events.sort(key=_t_ns)
        return _inside_only(events), scopes


# NOTE [ collectives in a recording ]: in a distributed job the profiler records op scopes with
# their inputs' shapes (see NOTE [ a lean profiler ] in gradscope._compat), and communication is
# among them: c10d's operators, called on the thread that runs the user's code
# (``c10d::allreduce_`` from DDP's reducer, ``c10d::_allgather_base_`` and
# ``c10d::_reduce_scatter_base_`` from FSDP, ``_c10d_functional::*``), and the backends' own scopes
# for the work itself, on their threads (``gloo:all_reduce``, ``nccl:all_gather`` ...). A call
# returns once the work is queued; the backend's scope lasts while the data moves. Each becomes one
# row, of kind "call" (c10d's operators) or "backend" (the work), with the bytes of its largest
# argument: the bucket of an all-reduce, the gathered output of an all-gather, the unreduced input
# of a reduce-scatter (a backend's scope shows what it was handed: gloo's all-gather shows the
# rank's own shard). A separate walk, in distributed jobs only: the walk that reads allocations
# stays as it is.
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:")
_COMM_CALLS = ("c10d::", "_c10d_functional::")
_COMM_SKIP = frozenset({"_c10d_functional::wait_tensor"})


def _collective_rows(roots: Any, clock: list[tuple[int, int]]) -> list[tuple[str, int, int, int, str]]:
    """``(op, t0_ns, t1_ns, bytes, kind)`` for every collective in the profiler's event tree, in
    time order, on ``time.time_ns()``'s clock (``clock``: see _clock_offset); ``kind`` is "call"
    (c10d's operator) or "backend" (the backend's work). See NOTE [ collectives in a recording ]."""
    offset = _clock_offset(roots, clock)
    rows: list[tuple[str, int, int, int, str]] = []
    stack = list(roots)
    while stack:
        ev = stack.pop()
        name = ev.name
        if name.startswith(_COMM_PREFIXES) and name not in _COMM_SKIP:
            sizes = _compat.event_input_bytes(ev.typed[1])
            rows.append((name, ev.start_time_ns - offset, ev.end_time_ns - offset, max(sizes, default=0),
                         "call" if name.startswith(_COMM_CALLS) else "backend"))
        stack.extend(ev.children)
    rows.sort(key=lambda r: r[1])
    return rows


def _clock_offset(roots: Any, clock: list[tuple[int, int]]) -> int:
    """The profiler's clock minus ours (see NOTE [ profiler clock ]): ``clock[k]`` is the pair of
    ``time.time_ns()`` readings around the opening of scope ``k``; the scope with the tightest
    pair gives the offset, from its start and the pair's midpoint. 0 when none is found."""
    best: tuple[int, int] | None = None
    for r in roots:
        name = r.name
        if name.startswith(_CLOCK):
            try:
                before, after = clock[int(name[len(_CLOCK):])]
            except (ValueError, IndexError):
                continue
            if best is None or after - before < best[0]:
                best = (after - before, int(r.start_time_ns) - (before + after) // 2)
    return best[1] if best is not None else 0


def _in_distributed_job() -> bool:
    """Whether this process is a rank of a ``torch.distributed`` job (see NOTE [ a lean profiler ]
    in :mod:`gradscope._compat`)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def _t_ns(e: AllocEvent) -> int:
    return e.t_ns


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines straight to file descriptor 2; they would
    land in every notebook's log for every recorded cell. Silence the descriptor for those calls."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


# --------------------------------------------------------------------------------------
# The online tracker (budgets, meta-device prediction)
# --------------------------------------------------------------------------------------
_MODE_CLASS: Any = None
# NOTE [ tensors made outside dispatch ]: ``torch.tensor(data)`` (nested lists and Python scalars
# too; the optimizers' 0-d ``step`` counters are made this way), ``torch.as_tensor`` /
# ``torch.asarray`` of Python data, ``Tensor.new_tensor``, the legacy ``torch.Tensor(list)`` and
# the index and value lists of ``sparse_coo_tensor`` allocate their storage below the dispatcher,
# then pass the new tensor through ``aten::lift_fresh``, whose output is its input. The rule that
# skips outputs sharing an input's storage (views, in-place) skipped these, and the tracker missed
# their bytes where the allocator's events (memory='cpu') count them. So ``lift_fresh``'s output
# is counted as an allocation when its storage is the allocator's. Storages wrapping memory made
# elsewhere (``torch.from_numpy``, ``as_tensor``/``asarray`` of a numpy array of the same dtype,
# which share the array's memory) are not: no allocator event reports them, and the memory was
# numpy's before the call; a copy made from them (another dtype, ``torch.tensor(array)``) is an
# ordinary operator output and counts. ``torch.frombuffer`` passes no operator and allocates nothing.
_LIFT_FRESH = _compat.LIFT_FRESH_OP


def _make_tracker_mode(source: TrackerSource) -> Any:
    """The tracker's dispatch mode (its class made once: a class per recording would pile up)."""
    global _MODE_CLASS
    if _MODE_CLASS is None:
        base = _compat.torch_dispatch_mode()

        class _TrackerMode(base):  # type: ignore[misc, valid-type]
            def __init__(self, src: TrackerSource) -> None:
                super().__init__()
                self.source = src

            @classmethod
            def ignore_compile_internals(cls) -> bool:
                """NOTE [ the tracker and torch.compile ]: a compiled function called while a
                dispatch mode that does not ignore compile internals is active is skipped by Dynamo
                for good: it runs eagerly from then on, also after the block (other numerics, other
                memory). Ignoring them, compiled code stays compiled; allocations inside it are not
                seen by the tracker (the recording says so; the profiler source sees them). A torch
                without this switch (2.6-2.8) marks the code object of every frame it meets under
                the mode as one never to compile (torch 2.6, measured: a compiled Linear called in
                the block ran eagerly afterwards, and so did every other compiled Linear and a
                compiled function called there); there the tracker sets torch.compile's stance to
                "force_eager" for the block (see eager_compile_stance in gradscope._compat), so
                compiled code runs eagerly inside it without Dynamo seeing a frame, and compiled
                again after it; the recording says that compiled code ran eagerly."""
                return True

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                src = self.source
                src._drain()
                kwargs = kwargs or {}
                in_keys: set[int] = set()
                for a in _compat.tree_leaves((args, kwargs)):
                    if isinstance(a, torch.Tensor):
                        k = _compat.storage_key(a)
                        if k is not None:
                            in_keys.add(k)
                out = func(*args, **kwargs)
                if func is _compat.EFFICIENT_ZERO_OP:
                    src.zero_tangents = True
                elif func is _LIFT_FRESH and _compat.allocator_owned(out):
                    in_keys = set()  # see NOTE [ tensors made outside dispatch ]
                try:
                    for t in _compat.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            src._observe(t, in_keys, func)
                except MemoryBudgetExceeded:
                    raise
                except Exception as e:  # observing must never break the user's operation
                    if len(src.failures) < 10:
                        src.failures.append(f"{_op_label(func)}: {e!r}")
                return out

        _MODE_CLASS = _TrackerMode
    return _MODE_CLASS(source)


class TrackerSource:
    """A dispatch mode that counts each operator output's storage until its last reference dies.

    Rules it follows: outputs whose storage is also an input's are views or in-place results and
    are skipped, except ``lift_fresh``'s, the way tensors made from Python data enter the
    dispatcher (see NOTE [ tensors made outside dispatch ]); zero tensors are skipped; only tensors
    of the recorded device type count (torch.func creates internal meta tensors); it must be
    active before the forward pass.

    Known limitations: memory a kernel allocates for itself is not seen (CPU convolution's
    temporaries; the 0-d tensor PyTorch wraps a Python number in for one operator, 8 bytes, and
    the copy a kernel makes of it in the other operand's dtype: an optimizer step peaks 12 bytes
    above what the tracker says inside such an operator). Memory shared with numpy
    (``torch.from_numpy``) is numpy's and counts nowhere, as in the allocator's events.
    """

    name = "tracker"
    online = True
    node_hooks = True
    marks_calls = True
    marks_steps = True

    def __init__(self, device_type: str = "cpu", budget: int | None = None,
                 context: Callable[[], tuple[int | None, int | None]] | None = None) -> None:
        self.device_type = device_type
        self.budget = budget
        self.context = context or _no_context
        self.events: list[AllocEvent] = []
        self._live = 0
        self._known: dict[int, tuple[int, Any]] = {}
        self._pending: list[int] = []
        # NOTE [ orphaned storages ]: how many watched tensors (with a finalizer) hold each storage;
        # a storage whose watched tensors all died but which is still alive is held only by tensors
        # made outside dispatch (autograd's unpacked saves): only those are checked by sweep().
        self._holders: dict[int, int] = {}
        self._orphans: set[int] = set()
        self.failures: list[str] = []  # errors while observing (the first 10), for the notes
        self.failed_at: int | None = None  # events recorded when the budget refused an allocation
        self.refused: tuple[int, int, int, str] | None = None  # that allocation: bytes, live, budget, op
        self.zero_tangents = False  # see MemoryTrace.zero_tangents
        # a second device type whose outputs count while it is set (gradscope.predict for a CPU
        # step: the optimizers' step counters are real CPU tensors among the meta ones)
        self.also_device_type: str | None = None
        self._unseen_keys = 0  # keys of count_unseen's allocations: negative, never a storage's
        self._mode: Any = None
        self._stance: Any = None  # torch.compile's stance to put back (see eager_compile_stance)
        self._call: int | None = None
        self.stopped = False
        # the recorder's line finder (gradscope._lines.LineTable.here), or None: no lines
        self.line_of: Callable[[], int] | None = None

    def start(self) -> None:
        self._stance = _compat.eager_compile_stance()  # see NOTE [ the tracker and torch.compile ]
        try:
            self._mode = _make_tracker_mode(self)
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            stance, self._stance = self._stance, None
            _compat.restore_compile_stance(stance)
            raise

    def stop(self) -> MemoryTrace:
        mode, self._mode = self._mode, None
        stance, self._stance = self._stance, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
                mode.source = None  # the mode object may be cached by torch: never keep the source
        finally:
            _compat.restore_compile_stance(stance)
        self._drain()
        self.stopped = True
        # The finalizers on tensors made in the block (gradients, optimizer state) keep this source
        # alive as long as they live; without the recorder's callback they no longer keep the
        # whole recorder (its graph bookkeeping) alive with it.
        self.context = _no_context
        self.line_of = None
        return MemoryTrace(source=self.name, device=self.device_type, online=True, key_kind="storage",
                           events=list(self.events), failures=list(self.failures), failed_at=self.failed_at,
                           refused=self.refused, zero_tangents=self.zero_tangents)

    def live(self) -> int:
        self._drain()
        return self._live

    def cut(self) -> MemoryTrace:
        """The events since the last cut, as a piece of a loop's capture hands them over (see NOTE
        [ iterations ] in gradscope._iterations); the source goes on."""
        self._drain()
        events, self.events = self.events, []
        return MemoryTrace(source=self.name, device=self.device_type, online=True, key_kind="storage",
                           events=events, failures=list(self.failures), zero_tangents=self.zero_tangents)

    def __del__(self) -> None:
        # weak references still held (storages alive when the source goes): let go of them
        try:
            for _, ref in self._known.values():
                _compat.free_weak_ref(ref)
            self._known.clear()
        except Exception:  # interpreter shutdown
            pass

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        prev = self._call
        if kind == "module":
            self._call = index
        return prev

    def call_exit(self, token: Any, label: str) -> None:
        self._call = token

    def mark(self, label: str) -> None:
        self.sweep()

    def _observe(self, t: torch.Tensor, in_keys: set[int], func: Any) -> None:
        if t.device.type != self.device_type and t.device.type != self.also_device_type:
            return
        if _compat.is_zero_tensor(t):
            return
        key = _compat.storage_key(t)
        if key is not None and key in self._known and not _mutates(func):
            # A view or alias (``_unsafe_view``) of a tracked storage keeps it alive after the
            # tensor that brought it dies: without its own finalizer the free would only be seen
            # at the next sweep (late). In-place and out= results are tensors already watched.
            self._hold(t, key)
            return
        if key is None or key in in_keys or key in self._known:
            return
        try:
            storage = t.untyped_storage()
            nbytes = int(storage.nbytes())
        except (RuntimeError, NotImplementedError):
            return
        if nbytes == 0:
            return
        self._allocated(nbytes, key, _op_label(func))
        # The finalizer is attached to the tensor object (tensors keep their Python object while
        # C++ holds them); the weak reference below decides when its bytes are really gone.
        self._known[key] = (nbytes, _compat.storage_weak_ref(storage))
        self._holders[key] = 1
        weakref.finalize(t, self._holder_died, key)

    def watch_alias(self, t: torch.Tensor) -> None:
        """A tensor made without an operator (gradscope's compiled pack hook's alias of a saved
        tensor) that holds a tracked storage: followed as a view is (see NOTE [ orphaned
        storages ]), so that the storage's free is seen when its last holder dies."""
        if self.stopped or t.device.type not in (self.device_type, self.also_device_type):
            return
        key = _compat.storage_key(t)
        if key is not None and key in self._known:
            self._hold(t, key)

    def _hold(self, t: torch.Tensor, key: int) -> None:
        """One more tensor holding the tracked storage ``key``: its death is checked too."""
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(t, self._holder_died, key)

    def _allocated(self, nbytes: int, key: int, label: str) -> None:
        """An allocation of ``nbytes`` under ``key``: refused where it crosses the budget, else
        live and an event."""
        if self.budget is not None and self._live + nbytes > self.budget:
            if self.failed_at is None:
                self.failed_at = len(self.events)
                self.refused = (nbytes, self._live, self.budget, label)
            raise MemoryBudgetExceeded(nbytes, self._live, self.budget, where=label)
        self._live += nbytes
        step, _ = self.context()
        line = None
        if self.line_of is not None and step is None:  # in backward the node's line is given later
            try:
                line = self.line_of()
            except Exception:  # no line is no failure to observe
                line = None
        self.events.append(AllocEvent(time.time_ns(), nbytes, key, label, None, step, None, self._call,
                                      line=line))

    def _freed(self, key: int, nbytes: int) -> None:
        """The free of an allocation counted under ``key``: no longer live, and an event."""
        self._live -= nbytes
        step, _ = self.context()
        self.events.append(AllocEvent(time.time_ns(), -nbytes, key, "free", None, step))

    def count_unseen(self, nbytes: int, label: str) -> int:
        """Count ``nbytes`` that no operator output holds (gradscope.predict's model of a Python
        number PyTorch wraps in a tensor, or a kernel's copy of an input) until :meth:`end_unseen`
        is called with the key returned. Frees already due are accounted first."""
        self._drain()
        key = self._unseen_keys - 1
        self._allocated(nbytes, key, label)
        self._unseen_keys = key
        return key

    def end_unseen(self, key: int, nbytes: int) -> None:
        """The end of an allocation :meth:`count_unseen` began."""
        if not self.stopped:
            self._freed(key, nbytes)

    def _holder_died(self, key: int) -> None:
        n = self._holders.get(key, 0) - 1
        if n > 0:
            self._holders[key] = n
        else:
            self._holders.pop(key, None)
        self._maybe_free(key)

    def _maybe_free(self, key: int, deferred: bool = False) -> None:
        entry = self._known.get(key)
        if entry is None:
            return
        nbytes, ref = entry
        if self.stopped:  # nothing is counted any more: only let go of the weak reference
            del self._known[key]
            _compat.free_weak_ref(ref)
            return
        if not _compat.weak_ref_expired(ref):
            # NOTE [ frees are checked at the next operator ]: a finalizer runs while the dying
            # tensor still holds its storage, so the check is repeated at the next operator
            # (before it allocates) or live() call. A view still holding the storage then has a
            # finalizer of its own that checks again when it dies.
            if not deferred:
                self._pending.append(key)
            elif key not in self._holders:
                self._orphans.add(key)  # see NOTE [ orphaned storages ]
            return
        del self._known[key]
        _compat.free_weak_ref(ref)
        self._holders.pop(key, None)
        self._orphans.discard(key)
        self._freed(key, nbytes)  # not stopped: returned above

    def _drain(self) -> None:
        """Check the storages whose tensors died since the last operator (see NOTE above)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for key in pending:
                self._maybe_free(key, deferred=True)

    def sweep(self) -> None:
        """Account frees of storages whose last holder was a view that died without a finalizer.

        Only orphaned storages are checked (see NOTE [ orphaned storages ]): checking every live
        storage at each backward step made backward quadratic in the number of live tensors."""
        self._drain()
        for key in list(self._orphans):
            entry = self._known.get(key)
            if entry is None:
                self._orphans.discard(key)
            elif _compat.weak_ref_expired(entry[1]):
                self._maybe_free(key)


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", True))


def _op_label(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    return "aten::" + name.split(".")[0]


# --------------------------------------------------------------------------------------
# CUDA: the caching allocator (behind one boundary; exercised only where a GPU exists)
# --------------------------------------------------------------------------------------
class CudaStats(Protocol):
    """The boundary to the CUDA caching allocator: what :class:`CudaSource` reads, nothing more.

    ``torch.cuda`` satisfies it (see :class:`_TorchCudaStats`); tests on machines without a GPU
    pass a fake with the same methods, so the logic above the boundary is tested everywhere.
    """

    def synchronize(self, device: Any) -> None: ...
    def reset_peak_memory_stats(self, device: Any) -> None: ...
    def memory_allocated(self, device: Any) -> int: ...
    def max_memory_allocated(self, device: Any) -> int: ...
    def memory_reserved(self, device: Any) -> int: ...
    def max_memory_reserved(self, device: Any) -> int: ...
    def current(self, device: Any) -> tuple[int, int]: ...
    def total_memory(self, device: Any) -> int: ...
    def start_history(self, max_entries: int) -> None: ...
    def stop_history(self, device: Any) -> dict[str, Any]: ...
    def dump_snapshot(self, path: str) -> None: ...


class _TorchCudaStats:
    """``torch.cuda``'s allocator statistics and history behind the :class:`CudaStats` boundary."""

    def synchronize(self, device: Any) -> None:
        torch.cuda.synchronize(device)

    def reset_peak_memory_stats(self, device: Any) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_allocated(self, device: Any) -> int:
        return self.current(device)[0]  # see NOTE [ reading the allocator's figures ] in gradscope._compat

    def max_memory_allocated(self, device: Any) -> int:
        return int(torch.cuda.max_memory_allocated(device))

    def memory_reserved(self, device: Any) -> int:
        return self.current(device)[1]

    def max_memory_reserved(self, device: Any) -> int:
        return int(torch.cuda.max_memory_reserved(device))

    def current(self, device: Any) -> tuple[int, int]:
        """(allocated, reserved) now, read once (see NOTE [ reading the allocator's figures ] in
        gradscope._compat)."""
        index = device if isinstance(device, int) else torch.device(device).index
        return _compat.cuda_allocated_reserved(index or 0)

    def total_memory(self, device: Any) -> int:
        return int(torch.cuda.get_device_properties(device).total_memory)

    def start_history(self, max_entries: int) -> None:
        _compat.cuda_start_history(max_entries)

    def stop_history(self, device: Any) -> dict[str, Any]:
        return _compat.cuda_stop_history(device)

    def dump_snapshot(self, path: str) -> None:
        """The allocator's state and history as PyTorch writes it (``gs.load_snapshot`` and
        PyTorch's memory_viz read it); call while the history is on."""
        torch.cuda.memory._dump_snapshot(path)


def cuda_stats() -> CudaStats:
    """The CUDA allocator boundary (``torch.cuda``'s; tests replace ``_TorchCudaStats``)."""
    return _TorchCudaStats()


class CudaSource:
    """CUDA memory from the caching allocator.

    ``peak_bytes`` is the allocator's own peak of allocated bytes during the block minus what was
    allocated before it (exact). The timeline is sampled online: the allocated and reserved bytes
    at every module entry and exit and around every backward step, each sample labelled with the
    module or node running; with ``history=True`` it is instead rebuilt from the allocator's event
    history (every allocation and free, labelled by the allocating frame).
    """

    name = "cuda"
    online = True
    node_hooks = True
    marks_calls = True
    marks_steps = True

    def __init__(self, device: torch.device | None = None, history: bool = False,
                 max_entries: int = 100_000, context: Callable[[], tuple[int | None, int | None]] | None = None,
                 stats: CudaStats | None = None) -> None:
        self.stats: CudaStats = stats if stats is not None else _TorchCudaStats()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.history = history
        self.max_entries = max_entries
        self.context = context or _no_context
        self.events: list[AllocEvent] = []
        self.baseline = 0
        self._last = 0
        self._call: int | None = None

    def start(self) -> None:
        st = self.stats
        st.synchronize(self.device)
        st.reset_peak_memory_stats(self.device)
        self.baseline = st.memory_allocated(self.device)
        self._last = 0
        if self.history:
            st.start_history(self.max_entries)
        self._t0 = time.time_ns()

    def mark(self, label: str) -> None:
        """Add a timeline point with the allocator's current figures (called from the hooks)."""
        if self.history:
            return
        allocated, reserved = self.stats.current(self.device)
        live = allocated - self.baseline
        delta, self._last = live - self._last, live
        step, _ = self.context()
        self.events.append(AllocEvent(time.time_ns(), delta, 0, label, None, step, reserved, self._call))

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        prev = self._call
        if kind == "module":
            self._call = index
            self.mark(label)
        return prev

    def call_exit(self, token: Any, label: str) -> None:
        if label:
            self.mark(label + " done")
        self._call = token

    def stop(self) -> MemoryTrace:
        st = self.stats
        st.synchronize(self.device)
        if not self.history:
            self._call = None
            self.mark("end of block")
        peak = st.max_memory_allocated(self.device) - self.baseline
        reserved_peak = st.max_memory_reserved(self.device)
        nv = nvml_device_totals(self.device.index or 0)
        total = nv["total"] if nv else st.total_memory(self.device)
        events = self.events
        if self.history:
            snap = st.stop_history(self.device)
            events = _events_from_snapshot(snap, self.device.index or 0, self._t0, time.time_ns())
        return MemoryTrace(source=self.name, device=str(self.device), online=True,
                           key_kind="address" if self.history else "none", events=events,
                           marks_calls=not self.history,
                           baseline=self.baseline, peak=peak, reserved_peak=reserved_peak, total=total)

    def live(self) -> int:
        return self.stats.memory_allocated(self.device) - self.baseline

    def cut(self) -> MemoryTrace:
        """The samples since the last cut (see NOTE [ iterations ] in gradscope._iterations); not with
        the allocator's history, which is read once, when the block ends."""
        self.mark("end of piece")
        events, self.events = self.events, []
        peak = self.stats.max_memory_allocated(self.device) - self.baseline
        return MemoryTrace(source=self.name, device=str(self.device), online=True, key_kind="none", events=events,
                           baseline=self.baseline, peak=peak)


class CounterSource:
    """NOTE [ a long loop's memory ]: ``memory="cpu"`` reads the profiler's allocation events, which
    the profiler keeps until it stops (about 6 KB a step of a small MLP: 600 MB over 100,000 steps).
    A loop's head is recorded with it as any block is; from the first cut on (see NOTE [ iterations ]
    in gradscope._iterations) the allocator's counter of the compiled hooks takes its place (see NOTE
    [ the allocator's counter ] in hooks.cc): the same reports of the CPU allocator
    (every allocation and free, its bytes and address), stamped with our own clock and the autograd
    sequence counter, drained at each iteration's end, so its memory is the iteration's events. The
    profiler's allocations still alive are freed through it with their sizes (the allocator keeps them
    while either counts). Its events carry no node scope: steps are seen as ``memory="off"`` sees them,
    and an allocation's module, phase and step come from the times of the block's module calls,
    passes and steps; a forward allocation's line is its node's (by the sequence counter)."""

    name = "counter"
    online = True
    node_hooks = False
    marks_calls = False
    marks_steps = False

    def __init__(self, counter: Any) -> None:
        self._counter = counter  # a new one of gradscope._native.counter()
        self._noise = LineFilter()
        self.events: list[AllocEvent] = []
        self.peak = 0  # the most live bytes since the last cut
        self._restore: Callable[[], None] | None = None
        self._taken = False
        self.failures: list[str] = []

    def start(self) -> None:
        self._counter.start()
        self._noise.start()  # see NOTE [ the profiler's free warning ] in gradscope._stderr
        self._watch_takeover()

    def _watch_takeover(self) -> None:
        """A profiler the program starts inside the block needs the thread's profiler slot, which
        PyTorch refuses while anything holds it: the counter steps aside first (and says so)."""
        prof = torch.autograd.profiler
        orig = getattr(prof, "_enable_profiler", None)
        if orig is None:
            return
        tid = threading.get_ident()
        source = weakref.ref(self)

        def enable(*args: Any, **kwargs: Any) -> Any:
            me = source()
            if me is not None and threading.get_ident() == tid and not me._taken:
                me.drain()
                me._counter.stop()
                me._taken = True
                me.failures.append("a profiler the program started inside the block took the allocator's reports "
                                   "from there on: memory after that is missing")
            return orig(*args, **kwargs)

        prof._enable_profiler = enable
        self._restore = lambda: setattr(prof, "_enable_profiler", orig)

    def drain(self) -> None:
        """The reports since the last drain into ``events``."""
        data, peak = self._counter.drain()
        self.peak = max(self.peak, peak)
        if not data:
            return
        n = array("q")
        n.frombytes(data)
        append, new = self.events.append, tuple.__new__
        for k in range(0, len(n), 4):
            append(new(AllocEvent, (n[k], n[k + 1], n[k + 2], "", None, None, None, None, None, None, None,
                                    n[k + 3])))

    def live(self) -> int:
        return int(self._counter.live())

    def cut(self) -> MemoryTrace:
        self.drain()
        events, self.events = self.events, []
        self.peak = 0
        return MemoryTrace(source=self.name, device="cpu", online=True, key_kind="address", marks_calls=False,
                           events=events, peak=None, failures=list(self.failures))

    def stop(self) -> MemoryTrace:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        try:
            out = self.cut()
            if not self._counter.stop():
                out.failures.append("a profiler started inside the block was still running when it ended")
        finally:
            self._noise.stop()
        return out

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        return None

    def call_exit(self, token: Any, label: str) -> None:
        pass

    def mark(self, label: str) -> None:
        pass


def _events_from_snapshot(snap: dict[str, Any], index: int, t0_ns: int, t1_ns: int) -> list[AllocEvent]:
    """Allocation and completed-free events of one device, in the allocator's order. Their times
    are used when they fall inside the block; otherwise events are spread evenly over it."""
    traces = snap.get(_compat.SNAPSHOT_TRACES, [])
    if index >= len(traces):
        return []
    out: list[AllocEvent] = []
    for e in traces[index]:
        action = e.get(_compat.TRACE_ACTION)
        if action not in ("alloc", "free_completed"):
            continue
        frames = e.get(_compat.TRACE_FRAMES) or []
        label = str(frames[0].get("name", "")) if frames else action
        size = int(e[_compat.TRACE_SIZE]) if action == "alloc" else -int(e[_compat.TRACE_SIZE])
        out.append(AllocEvent(int(e.get(_compat.TRACE_TIME_US, 0)) * 1000, size, int(e[_compat.TRACE_ADDR]), label))
    if not all(t0_ns <= ev.t_ns <= t1_ns for ev in out):
        step = (t1_ns - t0_ns) / max(len(out), 1)
        out = [ev._replace(t_ns=t0_ns + int(k * step)) for k, ev in enumerate(out)]
    return _inside_only(out)


_nvml_missing = False  # NVML's library was looked for and is not on this machine


def nvml_device_totals(index: int = 0) -> dict[str, int] | None:
    """Whole-device memory from NVML (``nvidia-ml-py``): ``{"total", "used", "free"}``.

    None when NVML is not installed or no NVIDIA driver is present: normal on CPU machines. A
    driver library found missing once is not looked for again: each try makes a new ctypes
    library object, whose function-pointer class is cyclic garbage (see NOTE [ no cycles through
    the recorder ] in :mod:`gradscope.capture.saves`).
    """
    global _nvml_missing
    if _nvml_missing:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except getattr(pynvml, "NVMLError_LibraryNotFound", ()):
        _nvml_missing = True
        return None
    except Exception:  # no device, a driver too old, ...: asked again next time
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {"total": int(info.total), "used": int(info.used), "free": int(info.free)}
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
