"""A kind's memory source, made (the one place that knows which class each kind is)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradscope._base.errors import GradscopeError
from gradscope._base.memory_kind import MemoryKind
from gradscope._capture.memory.cuda import CudaSource
from gradscope._capture.memory.profiler import ProfilerSource
from gradscope._capture.memory.source import MemorySource
from gradscope._capture.memory.tracker import TrackerSource

__all__ = ["make_source"]


def make_source(kind: MemoryKind, *, budget: int | None = None, device_type: str = "cpu",
                history: bool = False, context: Callable[[], tuple[int | None, int | None]] | None = None
                ) -> MemorySource | None:
    """The source of a resolved kind (None for one that measures nothing). ``context`` returns the
    recorder's (step event position, module call) at any moment, for online sources. A new kind of
    source is added here, in :mod:`~gradscope._base.memory_kind` (its capabilities) and in a module of its own."""
    if kind is MemoryKind.CPU:
        return ProfilerSource()
    if kind is MemoryKind.TRACKER:
        return TrackerSource(device_type, budget, context=context)
    if kind is MemoryKind.CUDA:
        if not torch.cuda.is_available():
            raise GradscopeError(
                "gradscope: memory='cuda' but CUDA is not available here; use memory='cpu', or "
                "gs.predict(..., device='cuda') to estimate CUDA memory without a GPU."
            )
        return CudaSource(history=history, context=context)
    return None  # off; the allocator's counter is made by a long loop's capture (gradscope.record)
