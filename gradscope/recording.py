"""The data model: one immutable :class:`Recording` that every view reads.

This module is a face: each name below is defined in :mod:`gradscope._model.recording`.
"""

from __future__ import annotations

from gradscope._model.recording import (
    SCHEMA_VERSION,
    Allocation,
    BackwardCall,
    Category,
    Edge,
    Growth,
    HeldAllocation,
    HeldMemory,
    Iteration,
    Kind,
    Loop,
    MemoryPoint,
    Node,
    OomInfo,
    Peak,
    Phase,
    Recording,
    SavedTensor,
    SourceLine,
    Step,
    Table,
    Where,
    format_bytes,
    load,
)

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
