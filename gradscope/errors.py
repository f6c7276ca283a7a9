"""gradscope's exceptions. Every error gradscope raises on purpose is a :class:`GradscopeError`.

This module is a face: each name below is defined in :mod:`gradscope._base.errors`.
"""

from __future__ import annotations

from gradscope._base.errors import (
    BudgetRefusal,
    GradscopeError,
    MemoryBudgetExceeded,
)

__all__ = [
    "BudgetRefusal",
    "GradscopeError",
    "MemoryBudgetExceeded",
]
