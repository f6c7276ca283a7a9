"""Memory sources: where a recording's bytes come from, behind one small protocol.

- ``cpu``: PyTorch's profiler allocation events. They come from the CPU allocator itself, so they
  include memory that kernels allocate internally (CPU convolution's temporaries), which a tracker
  of operator outputs cannot see (:mod:`gradscope._capture.memory.profiler`).
- ``tracker``: a dispatch mode that follows every operator's output storages with weak references.
  It is online (it knows the live total at every moment), so it enforces a simulated budget
  (:class:`~gradscope.errors.MemoryBudgetExceeded`) and works on the meta device for prediction;
  it misses kernel-internal temporaries (:mod:`gradscope._capture.memory.tracker`).
- ``cuda``: the caching allocator's statistics (allocated, reserved; with ``history=True`` its
  event history) and NVML totals through ``nvidia-ml-py`` when present (:mod:`gradscope._capture.memory.cuda`).

A user names a source as a string; :meth:`MemoryKind.resolve` reads it once into a
:class:`MemoryKind`, whose capabilities are all the recorder and the passes ask. Every source
implements :class:`MemorySource` and hands over a :class:`~gradscope._base.trace.MemoryTrace`.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._base.memory_kind import MemoryKind
from gradscope._base.units import parse_size
from gradscope._capture.memory.counter import CounterSource
from gradscope._capture.memory.cuda import CudaSource, CudaStats, cuda_stats, nvml_device_totals
from gradscope._capture.memory.make import make_source
from gradscope._capture.memory.profiler import ProfilerSource
from gradscope._capture.memory.source import AllocEvent, EvalScope, MemorySource
from gradscope._capture.memory.tracker import TrackerSource

__all__ = [
    "AllocEvent",
    "CounterSource",
    "CudaSource",
    "CudaStats",
    "EvalScope",
    "MemoryKind",
    "MemorySource",
    "ProfilerSource",
    "TrackerSource",
    "cuda_stats",
    "make_source",
    "nvml_device_totals",
    "parse_size",
]

# NOTE [ a long loop's memory ]: ``memory="cpu"`` reads the profiler's allocation events, which
# the profiler keeps until it stops (about 6 KB a step of a small MLP: 600 MB over 100,000 steps).
# A loop's head is recorded with it as any block is; from the first cut on (see NOTE [ iterations ]
# in gradscope._passes.iterations) the allocator's counter of the compiled hooks takes its place (see NOTE
# [ the allocator's counter ] in hooks.cc): the same reports of the CPU allocator
# (every allocation and free, its bytes and address), stamped with our own clock and the autograd
# sequence counter, drained at each iteration's end, so its memory is the iteration's events. The
# profiler's allocations still alive are freed through it with their sizes (the allocator keeps them
# while either counts). Its events carry no node scope: steps are seen as ``memory="off"`` sees them,
# and an allocation's module, phase and step come from the times of the block's module calls,
# passes and steps; a forward allocation's line is its node's (by the sequence counter).
