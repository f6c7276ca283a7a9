"""The views layer, imported whole: importing this module registers every view of every result
type (NOTE [ one registry of views ] in ``gradscope._base.registry``). The package's top imports it, so a
result finds its views whichever of its methods is called first.

Each module below registers the views it defines, beside their code: text (:mod:`gradscope.report`,
:mod:`gradscope._views.diagnosis_text`, :mod:`gradscope._views.snapshot_text`, :mod:`gradscope._views.job_text`), pages
(:mod:`gradscope.html`), payloads (:mod:`gradscope._views.payloads`) and widgets (:mod:`gradscope._views.widget`), the graphviz graph
(:mod:`gradscope.report`).

Example:
    >>> from gradscope._base.registry import ViewKind, find
    >>> from gradscope._analyses.diagnose.result import Diagnosis
    >>> find(ViewKind.TEXT, Diagnosis).__name__
    'diagnosis_text'
"""

from __future__ import annotations

from gradscope._views import diagnosis_text as _diagnosis_text
from gradscope._views import html, payloads, widget
from gradscope._views import job_text as _job_text
from gradscope._views import recording_text as report
from gradscope._views import snapshot_text as _snapshot_text

__all__: list[str] = []

REGISTERING = (report, html, payloads, widget, _snapshot_text, _diagnosis_text, _job_text)
