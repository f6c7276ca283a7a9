"""Dropping known-noise lines that PyTorch's C++ side writes to file descriptor 2 while a recording
runs, and passing every other byte through.

NOTE [ the profiler's free warning ]: while the profiler records memory, freeing a block that was
allocated before it started makes c10's CPU allocator log ``[W ... CPUAllocator.cpp:245] Memory
block of unknown size was allocated before the profiling started, profiler results will not
include the deallocation event`` straight to fd 2 (the first such free, then every 1000th). Any
recorded cell that rebinds a variable (``loss = ...`` run twice) triggers it, so it landed in
the text path (``./dev demo``, notebooks) though it says nothing about the user's code: gradscope
already ignores frees of memory older than the block. Silencing fd 2 for the whole block would
hide the user's own errors, so a pipe takes fd 2's place and a thread copies it back line by line,
leaving out only lines that carry one of the given markers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

__all__: list[str] = []

PROFILER_NOISE = ("CPUAllocator.cpp", "Memory block of unknown size was allocated before the profiling")


class LineFilter:
    """While started, lines written to fd 2 that contain one of ``markers`` are dropped; all
    other output reaches the original fd 2 unchanged and in order. Start and stop from one thread;
    never raises (without a usable fd 2 it does nothing)."""

    def __init__(self, markers: Sequence[str] = PROFILER_NOISE) -> None:
        self._markers = tuple(m.encode() for m in markers)
        self._saved: int | None = None
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def start(self) -> None:
        if self._saved is not None:
            return
        try:
            saved = os.dup(2)
        except OSError:
            return
        try:
            r, w = os.pipe()
        except OSError:
            os.close(saved)
            return
        try:
            os.dup2(w, 2)
        except OSError:
            for fd in (r, w, saved):
                os.close(fd)
            return
        os.close(w)  # fd 2 is now the only write end: restoring fd 2 ends the pipe
        self._saved = saved
        self._thread = threading.Thread(target=self._copy, args=(r, saved), name="gradscope-stderr", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        try:
            os.dup2(saved, 2)  # closes the pipe's last write end: the thread sees the end and stops
        except OSError:
            pass
        t = self._thread
        self._thread = None
        if t is not None:
            t.join(0.5)  # a child process that inherited fd 2 may hold the pipe open: do not wait for it
        if t is None or not t.is_alive():
            os.close(saved)

    def _copy(self, r: int, out: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                kept = [ln for ln in lines if not self._noise(ln)]
                if kept:
                    _write_all(out, b"\n".join(kept) + b"\n")
            if pending and not self._noise(pending):
                _write_all(out, pending)
        except OSError:
            pass
        finally:
            os.close(r)

    def _noise(self, line: bytes) -> bool:
        if any(m in line for m in self._markers):
            self.dropped += 1
            return True
        return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
