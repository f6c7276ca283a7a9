"""gradscope's exceptions. Every error gradscope raises on purpose is a :class:`GradscopeError`.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._base.error import GradscopeError
from gradscope._base.errors import BudgetRefusal, MemoryBudgetExceeded

__all__ = [
    "BudgetRefusal",
    "GradscopeError",
    "MemoryBudgetExceeded",
]
