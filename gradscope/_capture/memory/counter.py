"""The allocator's counter: the CPU source a long loop's capture goes on with (see NOTE [ a long
loop's memory ] in gradscope.memory).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from gradscope._base.memory_kind import MemoryKind
from gradscope._base.stderr import LineFilter
from gradscope._base.trace import MemoryTrace
from gradscope._capture.memory.source import AllocEvent, watch_profiler_start

__all__ = ["CounterSource"]


class CounterSource:
    """The CPU allocator's reports through the compiled hooks' counter, drained at each iteration's
    end: what a long loop's capture reads after its first cut, in place of the profiler (see NOTE
    [ a long loop's memory ] in gradscope.memory)."""

    kind = MemoryKind.COUNTER

    def __init__(self, counter: Any) -> None:
        self._counter = counter  # a new one of gradscope._capture.native.counter()
        self._noise = LineFilter()
        self.events: list[AllocEvent] = []
        self.peak = 0  # the most live bytes since the last cut
        self._restore: Callable[[], None] | None = None
        self._taken = False
        self.failures: list[str] = []

    def start(self) -> None:
        self._counter.start()
        self._noise.start()  # see NOTE [ the profiler's free warning ] in gradscope._base.stderr
        self._watch_takeover()

    def _watch_takeover(self) -> None:
        """A profiler the program starts inside the block needs the thread's profiler slot, which
        PyTorch refuses while anything holds it: the counter steps aside first (and says so; see
        NOTE [ a profiler started inside the block ] in gradscope._capture.memory.source)."""

        def step_aside(me: CounterSource) -> None:
            if not me._taken:
                me.drain()
                me._counter.stop()
                me._taken = True
                me.failures.append("a profiler the program started inside the block took the allocator's reports "
                                   "from there on: memory after that is missing")

        self._restore = watch_profiler_start(self, before=step_aside)

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
        return MemoryTrace(source=self.kind, device="cpu", online=True, key_kind="address", marks_calls=False,
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

    def boundary(self, done: str | None, following: str | None) -> int:
        return self.live()
