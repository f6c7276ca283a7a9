"""gradscope's exceptions. Every error gradscope raises on purpose is a :class:`GradscopeError`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradscope._base.error import GradscopeError
from gradscope._base.units import format_bytes

__all__ = ["BudgetRefusal", "GradscopeError", "MemoryBudgetExceeded"]


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    """One allocation a simulated memory budget refused: ``requested`` bytes asked for with ``live``
    bytes already live inside the recording, of a ``budget``; ``where`` the operator that asked.

    NOTE [ one refusal ]: the tracker makes this value where it refuses; the same value is the
    exception's (:attr:`MemoryBudgetExceeded.refusal`), the raw trace's (``MemoryTrace.refused``),
    the recording's (``Recording.oom`` extends it; ``extra["caught_budget"]`` is its dict) and what
    the diagnosis reads. Nothing reads the numbers back from the error's words.
    """

    requested: int
    live: int
    budget: int
    where: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> BudgetRefusal:
        """The refusal a saved ``to_dict`` holds (the fields it has; other keys are ignored)."""
        return cls(int(d["requested"]), int(d["live"]), int(d["budget"]), str(d.get("where") or ""))


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Raised at the allocation that crosses a simulated memory budget (``record(budget=...)``).

    It is a ``torch.OutOfMemoryError`` so that code written for a real CUDA OOM handles it the same
    way. ``refusal`` is the :class:`BudgetRefusal` (see NOTE [ one refusal ]); ``requested`` is the
    size of the allocation that crossed the budget, ``live`` the bytes already live inside the
    recording when it was asked for, ``budget`` the limit, ``where`` the operator.
    """

    __module__ = "gradscope.errors"  # its public face, as the root error's (tracebacks name it there)

    def __init__(self, requested: int | BudgetRefusal, live: int = 0, budget: int = 0, where: str = "") -> None:
        refusal = (requested if isinstance(requested, BudgetRefusal)
                   else BudgetRefusal(int(requested), int(live), int(budget), str(where)))
        self.refusal = refusal
        requested, live, budget, where = refusal.requested, refusal.live, refusal.budget, refusal.where
        msg = (
            f"gradscope: simulated device out of memory: tried to allocate {format_bytes(requested)} "
            f"({requested} bytes) with {format_bytes(live)} live ({live} bytes) of a "
            f"{format_bytes(budget)} budget ({budget} bytes)"
        )
        if where:
            msg += f" (in {where})"
        msg += ". Call gs.diagnose(rec.recording) to see what held the memory."
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as its refusal (another process, a saved error)
        return type(self), (self.refusal,)

    @property
    def requested(self) -> int:
        return self.refusal.requested

    @property
    def live(self) -> int:
        return self.refusal.live

    @property
    def budget(self) -> int:
        return self.refusal.budget

    @property
    def where(self) -> str:
        return self.refusal.where
