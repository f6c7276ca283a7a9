"""``gs.record()``: watch real code run and produce one immutable :class:`~gradscope.Recording`.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._capture.compiled import compiled_saves
from gradscope._capture.record import record
from gradscope._capture.walk import release

__all__ = [
    "compiled_saves",
    "record",
    "release",
]
