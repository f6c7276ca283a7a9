"""gradscope's exceptions. Every error gradscope raises on purpose is a :class:`GradscopeError`."""

from __future__ import annotations

import torch

from gradscope._units import format_bytes

__all__ = ["GradscopeError", "MemoryBudgetExceeded"]


class GradscopeError(RuntimeError):
    """A gradscope error: the message says what went wrong and what to do next."""


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Raised at the allocation that crosses a simulated memory budget (``record(budget=...)``).

    It is a ``torch.OutOfMemoryError`` so that code written for a real CUDA OOM handles it the same
    way. ``requested`` is the size of the allocation that crossed the budget, ``live`` the bytes
    already live inside the recording when it was asked for, ``budget`` the limit.
    """

    def __init__(self, requested: int, live: int, budget: int, where: str = "") -> None:
        self.requested = requested
        self.live = live
        self.budget = budget
        self.where = where

        msg = (
            f"gradscope: simulated device out of memory: tried to allocate {format_bytes(requested)} "
            f"({requested} bytes) with {format_bytes(live)} live ({live} bytes) of a "
            f"{format_bytes(budget)} budget ({budget} bytes)"
        )
        if where:
            msg += f" (in {where})"
        msg += ". Call gs.diagnose(rec.recording) to see what held the memory."
        super().__init__(msg)
