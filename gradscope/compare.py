"""``gs.compare``: run several ways of computing the same thing, side by side, from identical state.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._analyses.compare import SPREAD_LIMIT, Comparison, Row, compare, saved_total, tolerance

__all__ = [
    "SPREAD_LIMIT",
    "Comparison",
    "Row",
    "compare",
    "saved_total",
    "tolerance",
]
