"""``gs.diagnose``: who held memory at the failing moment (or the peak), and what to change.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._analyses.diagnose import diagnose
from gradscope._analyses.diagnose.result import Diagnosis, Finding, GraphHolder, LiveTensor

__all__ = [
    "Diagnosis",
    "Finding",
    "GraphHolder",
    "LiveTensor",
    "diagnose",
]
