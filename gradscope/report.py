"""The text views of a :class:`~gradscope.Recording` (a CUDA snapshot's too) and of a
:class:`~gradscope.compare.Comparison`, exact and deterministic apart from times, and a
recording's graphviz graph; registered for their types (NOTE [ one registry of views ] in
``gradscope._base.registry``): ``rec.summary()``, ``cmp.summary()``, ``rec.to_dot()`` (a
``graphviz.Digraph``: what torchviz's ``make_dot(show_saved=True)`` shows, plus bytes).

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._views.recording_text import comparison_text, snapshot_summary_text, summary_text

__all__ = [
    "comparison_text",
    "snapshot_summary_text",
    "summary_text",
]
