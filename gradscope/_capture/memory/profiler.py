"""``memory="cpu"``: PyTorch's profiler allocation events.

They come from the CPU allocator itself, so they include memory that kernels allocate internally
(CPU convolution's temporaries), which a tracker of operator outputs cannot see. See NOTE [ CPU
bytes come from the allocator ].
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.stderr import LineFilter
from gradscope._base.trace import MemoryTrace
from gradscope._capture.memory.source import AllocEvent, EvalScope, _inside_only, watch_profiler_start

__all__ = ["ProfilerSource"]


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
    [ a lean profiler ] in :mod:`gradscope._base.compat`).

    NOTE [ profiler marks ]: the recorder opens a profiler scope per module call and per backward
    pass (``gradscope.module#3``, ``gradscope.backward#0``), so that each allocation knows its
    module and each node scope its backward pass from the event tree itself, without comparing
    clocks.
    """

    kind = MemoryKind.CPU

    def __init__(self) -> None:
        self._running = False
        self._clock: list[tuple[int, int]] = []
        self._noise = LineFilter()
        self._ops = False  # op scopes (a distributed job): collectives are read from them
        self._taken = False  # see NOTE [ a profiler started inside the block ] in gradscope._capture.memory.source
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
            self._noise.start()  # see NOTE [ the profiler's free warning ] in gradscope._base.stderr
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
        """After a profiler the program starts inside the block, no scope of the block's is opened
        (see NOTE [ a profiler started inside the block ] in gradscope._capture.memory.source)."""

        def taken(me: ProfilerSource) -> None:
            me._taken = True

        self._restore = watch_profiler_start(self, after=taken)

    def stop(self) -> MemoryTrace:
        global _profiler_busy
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        running, self._running = self._running, False
        out = MemoryTrace(source=self.kind, device="cpu", online=False, key_kind="address")
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

        def read(trace: MemoryTrace) -> None:  # see NOTE [ analysis on first look ] in gradscope._capture.record
            roots = _compat.results_event_tree(results)
            trace.events, trace.scopes = self._parse(roots)
            if ops:
                trace.collectives = _collective_rows(roots, clock)

        out.pending = read
        return out

    def live(self) -> int | None:
        return None

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        if self._taken:  # see NOTE [ a profiler started inside the block ] in gradscope._capture.memory.source
            return None
        return _compat.record_scope_enter(f"{MARK}{kind}#{index}")

    def call_exit(self, token: Any, label: str) -> None:
        if token is not None and not self._taken:
            _compat.record_scope_exit(token)

    def mark(self, label: str) -> None:
        pass

    def drain(self) -> None:
        pass

    def boundary(self, done: str | None, following: str | None) -> int | None:
        return None

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
# their inputs' shapes (see NOTE [ a lean profiler ] in gradscope._base.compat), and communication is
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
    in :mod:`gradscope._base.compat`)."""
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
