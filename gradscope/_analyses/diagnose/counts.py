"""How a run on copies is counted and started: its memory by the allocator's counter or the tracker
(see NOTE [ the CPU allocator counts a run ]), under a bound where the block ran out of memory (NOTE
[ a bound on runs of copies ]), from the same random state (``_RandomState``)."""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import torch

# NOTE [ the CPU allocator counts a run ]: a run of a CPU copy counts its memory with the allocator's
# counter of the compiled hooks where they are in use (the CPU allocator's own reports of each
# allocation and free, a run's count: see NOTE [ the allocator's counter ] in hooks.cc), else with the
# tracker (gradscope.memory.TrackerSource, the budget's own count). The tracker passes every operator
# through Python (about 40 us each on top of the operator: a run of the docs' GPT-2 step under it
# takes 3.2 times the plain step); the allocator's reports cost a lookup (1.05 to 1.2 times). Both
# count a run's own allocations only (``_most_above``; the counter in C++), and the allocator counts
# every byte the tracker counts: each storage an operator makes is one of the allocator's
# allocations, from its allocation to its free. It counts more, never less: the kernels' own
# temporaries (CPU convolution's work buffers; the 0-d tensor PyTorch wraps a Python number in),
# the allocations of the threads the step's thread hands its work to (autograd's), and storages the
# tracker skips, where they hold bytes. So a fix
# whose runs fit as the allocator counts them fits as the budget counts them, and the bytes shown are
# at least those the budget counts (48 B more on the docs' GPT-2 step; tests/test_diagnose.py compares
# the two on steps with convolutions, optimizers and tensors made from Python data). The one way the
# tracker counts more is a storage it sees freed late: one held at the end only by a tensor made
# outside the dispatcher (autograd's unpacked saves) is counted until the next sweep, which the
# recorder does at each backward step; that lateness makes the budget stricter, never a fix's count.
# NOTE [ a bound on runs of copies ]: a block that ran out of memory may have been on its way to
# far more: a loop appending every step's loss (and graph) to a list stops at the budget or the
# device, and its step run again on a copy, with nothing to stop it, runs every iteration the loop
# has (1,000 iterations of a small MLP kept 20 GB on the CPU and ran past ten minutes). So the runs
# of copies of such a block are counted by the tracker with a budget of RUN_LIMIT_FACTOR times the
# block's peak or its budget, whichever is more (at least RUN_LIMIT_FLOOR): a run that goes over it
# stops there, as a run that failed on the copies (nothing shown from it); the allocator's counter
# counts but cannot stop a run. Only a step with a loop (a for or while statement) is bounded: a step
# without one holds, run again, what it held, once (the docs' GPT-2 step keeps the allocator's faster
# count). The bound is generous because the user's whole step must run for its
# results to be compared with a fix's: a step that failed at its tenth iteration of a hundred needs
# ten times the budget (tests/test_diagnose.py's gradient penalty through a frozen G).
RUN_LIMIT_FACTOR = 16
RUN_LIMIT_FLOOR = 256 << 20


class _TrackerCount:
    """A run's own allocations as the tracker counts them (on meta, or where the compiled hooks are
    not in use)."""

    name = "tracker"

    def __init__(self, device_type: str, limit: int | None = None) -> None:
        from gradscope._capture.memory.tracker import TrackerSource

        self.source = TrackerSource(device_type, limit)  # see NOTE [ a bound on runs of copies ]
        self.first = 0

    def start(self) -> None:
        self.source.start()

    def begin(self) -> None:
        self.source.sweep()
        self.first = len(self.source.events)

    def most(self) -> int:
        """The most the current run's own allocations held at once so far."""
        self.source.sweep()
        return _most_above(self.source.events[self.first:])

    def stop(self) -> None:
        self.source.stop()


class _AllocatorCount:
    """A run's own allocations as the CPU allocator reports them, counted by the allocator's counter
    of the compiled hooks (see NOTE [ the CPU allocator counts a run ]): a new one per start."""

    name = "allocator"

    def __init__(self) -> None:
        self.counter: Any = None

    def start(self) -> None:
        from gradscope._capture import native as _native

        self.counter = _native.counter(run=True)
        self.counter.start()

    def begin(self) -> None:
        self.counter.restart()

    def most(self) -> int:
        return int(self.counter.read()[1])

    def stop(self) -> None:
        counter, self.counter = self.counter, None
        if counter is not None:
            counter.stop()


def _counter(device: str) -> _TrackerCount | _AllocatorCount:
    """What counts a run of a copy on ``device`` (``"cpu"``: the allocator's counter where the compiled
    hooks are in use, else the tracker)."""
    if device == "cpu":
        from gradscope._capture import native as _native

        if _native.counter(run=True) is not None:
            return _AllocatorCount()
    return _TrackerCount(device if device == "cpu" else "cuda")


def _most_above(events: Any) -> int:
    """The most bytes a run of tracker events had allocated at once: its own allocations alive.
    Frees of what was allocated before it are not counted, as a budget run of the step does not
    see them (its tracker starts with the step)."""
    live = most = 0
    mine: set[int] = set()
    for e in events:
        if e.size > 0:
            mine.add(e.key)
        elif e.key not in mine:
            continue
        live += e.size
        most = max(most, live)
    return most


class _RandomState:
    """The random generators' states (PyTorch's CPU and CUDA ones, Python's ``random``, numpy's
    where it is loaded): every run on copies starts from the same ones, and the user's are put
    back after it (a diagnosis draws nothing from the user's program's streams)."""

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor] | None, py: Any, np_state: Any) -> None:
        self.cpu, self.cuda, self.py, self.np = cpu, cuda, py, np_state

    @staticmethod
    def now() -> _RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        np = sys.modules.get("numpy")
        return _RandomState(torch.get_rng_state(), cuda, random.getstate(),
                            np.random.get_state() if np is not None else None)

    @contextlib.contextmanager
    def used(self) -> Any:
        outside = _RandomState.now()
        self._set()
        try:
            yield
        finally:
            outside._set()

    def _set(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.py)
        np = sys.modules.get("numpy")
        if np is not None and self.np is not None:
            np.random.set_state(self.np)
