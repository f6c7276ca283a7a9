"""What every memory source implements and the rows they hand over (see :mod:`gradscope.memory`).

Every source implements :class:`MemorySource` and hands over a
:class:`~gradscope._base.trace.MemoryTrace` (the same :class:`AllocEvent` rows for all of them), so the
recorder and the passes never ask which source they have, only what its kind can do. Sources keep
no tensors alive: only sizes, addresses and weak references.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from gradscope._base.memory_kind import MemoryKind
from gradscope._base.trace import MemoryTrace

__all__ = ["AllocEvent", "EvalScope", "MemorySource", "watch_profiler_start"]


class AllocEvent(NamedTuple):
    """One allocation (``size > 0``) or free (``size < 0``) inside the block.

    ``t_ns`` is on the ``time.time_ns()`` clock (the profiler's clock is converted to it by
    PyTorch). ``key`` names the block or storage (see :attr:`MemoryTrace.key_kind`). ``scope`` is,
    for the profiler source, the index of the engine's ``evaluate_function`` scope it happened in
    (None outside backward); ``step`` is, for online sources, the position in the trace's step
    events when it happened; ``call`` the module call running; ``hint`` ``"optimizer"`` or
    ``"other"`` when the source saw it inside an optimizer step or a ``zero_grad``. ``line`` is
    the user's line on the stack when it was made (the tracker; an index into the recorder's line
    table, -1 or None: none; see NOTE [ where lines come from ] in :mod:`gradscope._model.lines`).
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

    ``kind`` says what it can do (see :class:`~gradscope._base.memory_kind.MemoryKind`): the recorder
    calls :meth:`call_enter` / :meth:`call_exit` at module calls and backward passes where the
    kind ``marks_calls``, :meth:`mark` at step boundaries where it ``marks_steps``, and hooks
    every node where it wants ``node_hooks``; between two backward steps it calls :meth:`boundary`
    once, which marks the step that ended and the one that starts and returns the live bytes from
    one reading (on CUDA each reading of the allocator is a call into it, and a backward pass has
    a boundary per node); :meth:`drain` brings in what it was told outside Python (the allocator's
    counter) before its events are read while the block runs.
    """

    kind: MemoryKind

    def start(self) -> None: ...
    def stop(self) -> MemoryTrace: ...
    def live(self) -> int | None: ...
    def call_enter(self, kind: str, index: int, label: str) -> Any: ...
    def call_exit(self, token: Any, label: str) -> None: ...
    def mark(self, label: str) -> None: ...
    def boundary(self, done: str | None, following: str | None) -> int | None: ...
    def drain(self) -> None: ...


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


def watch_profiler_start(owner: Any, before: Callable[[Any], None] | None = None,
                         after: Callable[[Any], None] | None = None) -> Callable[[], None] | None:
    """NOTE [ a profiler started inside the block ]: PyTorch runs one profiler session per thread,
    and a ``torch.profiler.profile`` the program starts inside the block needs the slot a source
    holds (the allocator's counter: PyTorch refuses the start) or replaces its session (the
    profiler source: no error on recent torch, and the block's scopes would land in the
    program's profile). So the profiler's start inside ``torch.autograd.profiler`` is watched
    while the block runs: ``before(owner)`` runs just before a start on the block's thread (the
    counter steps aside), ``after(owner)`` just after one that succeeded (the profiler source
    opens no scope from then on), as long as ``owner`` lives. Returns what puts the start back
    (None: this torch has no such start to watch)."""
    prof = torch.autograd.profiler
    orig = getattr(prof, "_enable_profiler", None)
    if orig is None:
        return None
    tid = threading.get_ident()
    ref = weakref.ref(owner)

    def enable(*args: Any, **kwargs: Any) -> Any:
        me = ref() if threading.get_ident() == tid else None
        if me is not None and before is not None:
            before(me)
        out = orig(*args, **kwargs)
        if me is not None and after is not None:
            after(me)
        return out

    prof._enable_profiler = enable
    return lambda: setattr(prof, "_enable_profiler", orig)
