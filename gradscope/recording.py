"""The data model: one immutable :class:`Recording` that every view reads.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._base.units import format_bytes
from gradscope._model.files import SCHEMA_VERSION
from gradscope._model.recording import Loop, Recording, load
from gradscope._model.rows import (
    Allocation,
    BackwardCall,
    Category,
    Edge,
    Growth,
    HeldAllocation,
    HeldMemory,
    Iteration,
    Kind,
    MemoryPoint,
    Node,
    OomInfo,
    Peak,
    Phase,
    SavedTensor,
    SourceLine,
    Step,
    Where,
)
from gradscope._model.table import Table

__all__ = [
    "SCHEMA_VERSION",
    "Allocation",
    "Table",
    "BackwardCall",
    "Category",
    "Edge",
    "HeldMemory",
    "HeldAllocation",
    "Growth",
    "Iteration",
    "Kind",
    "Loop",
    "OomInfo",
    "MemoryPoint",
    "Node",
    "Peak",
    "Phase",
    "Recording",
    "SavedTensor",
    "SourceLine",
    "Step",
    "Where",
    "format_bytes",
    "load",
]
