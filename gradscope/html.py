"""Self-contained HTML pages: one file with the widget's script and the data inline, that renders
the graph, the memory timeline and the backward step-through from ``file://`` with no network.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._base.page import document
from gradscope._views.html import comparison_html, job_page_html, page_html, recording_html, snapshot_html

__all__ = [
    "comparison_html",
    "document",
    "job_page_html",
    "page_html",
    "recording_html",
    "snapshot_html",
]
