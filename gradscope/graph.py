"""``gs.graph(tensor)``: the autograd graph and saved tensors behind an existing result, without
running backward (a recording's graphviz drawing, ``rec.to_dot()``, is a view: :mod:`gradscope.report`).

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._analyses.graph import graph

__all__ = [
    "graph",
]
