"""Graph layout for the widget and the HTML page, computed in Python.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._views.layout import (
    COLLAPSE_MIN_NODES,
    GROUP_H,
    GROUP_W,
    NESTED,
    NODE_H,
    NODE_W,
    GraphLayout,
    Group,
    choose_depth,
    group_nodes,
    layout_dag,
    layout_levels,
    layout_recording,
)

__all__ = [
    "COLLAPSE_MIN_NODES",
    "NESTED",
    "GROUP_H",
    "GROUP_W",
    "NODE_H",
    "NODE_W",
    "GraphLayout",
    "Group",
    "choose_depth",
    "group_nodes",
    "layout_dag",
    "layout_levels",
    "layout_recording",
]
