"""The notebook extension: ``%load_ext gradscope``, ``%%gradscope``, ``%gradscope oom`` and
``%gradscope tb``.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._notebook.cells import RECORDING_NAME, last_diagnosis
from gradscope._notebook.ipython import GradscopeMagics, load_ipython_extension, unload_ipython_extension

__all__ = [
    "RECORDING_NAME",
    "GradscopeMagics",
    "last_diagnosis",
    "load_ipython_extension",
    "unload_ipython_extension",
]
