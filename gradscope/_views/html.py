"""Self-contained HTML pages: one file with the widget's script and the data inline, that renders
the graph, the memory timeline and the backward step-through from ``file://`` with no network.

Example:
    >>> from gradscope.recording import Recording, Node
    >>> page = recording_html(Recording(nodes=(Node(0, "SumBackward0"),)))  # doctest: +SKIP
    >>> page.startswith("<!doctype html>")  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

from gradscope._analyses.compare import Comparison
from gradscope._analyses.snapshot.data import SnapshotRecording
from gradscope._base.errors import GradscopeError
from gradscope._base.page import _inline_json, _inline_script, document
from gradscope._base.registry import ViewKind, register
from gradscope._model.job import Job
from gradscope._model.recording import Recording
from gradscope._views.job_page import fragment_html
from gradscope._views.payloads import comparison_payload, job_payload, recording_payload, snapshot_payload
from gradscope._views.widget import bundle_text

__all__ = ["comparison_html", "document", "job_page_html", "page_html", "recording_html", "snapshot_html"]


def page_html(payload: dict[str, Any], title: str, fallback: str | None = None) -> str:
    """A complete HTML document rendering ``payload`` (from recording_payload/comparison_payload).
    ``fallback``: HTML shown where scripts do not run (escaped by its maker)."""
    noscript = fallback if fallback is not None else "This gradscope page needs JavaScript to draw the graph and timeline."
    return document(
        title,
        f"<noscript>{noscript}</noscript>\n"
        f'<script type="application/json" id="gradscope-data">{_inline_json(payload)}</script>\n'
        '<div id="gradscope-page"></div>\n'
        f'<script type="module">\n{_inline_script(bundle_text())}\n</script>\n',
    )


@register(ViewKind.HTML, Recording)
def recording_html(rec: Recording) -> str:
    """One self-contained page for a recording (what :meth:`Recording.to_html` writes; a CUDA
    memory snapshot, ``gs.load_snapshot``, has its own: :func:`snapshot_html`)."""
    return page_html(recording_payload(rec), f"gradscope · {rec.label or 'recording'}")


@register(ViewKind.HTML, SnapshotRecording)
def snapshot_html(rec: SnapshotRecording) -> str:
    """One self-contained page for a recording made by ``gs.load_snapshot``: the snapshot view."""
    return page_html(snapshot_payload(rec), f"gradscope · {rec.label or 'recording'}")


@register(ViewKind.HTML, Job)
def job_page_html(job: Job, *, script: bool = True) -> str:
    """One self-contained page for a :class:`~gradscope.job.Job` (what ``Job.to_html`` writes):
    the job view, and the script-free table and timelines where scripts do not run. With
    ``script=False``, those alone (what a job shows as a cell's HTML: ``Job._repr_html_``)."""
    if not script:
        return fragment_html(job)
    title = "gradscope job" + (f" · {job.label}" if job.label else "")
    return page_html(job_payload(job), title, fallback=fragment_html(job))


@register(ViewKind.HTML, Comparison)
def comparison_html(cmp: Comparison, problem: str | None = None) -> str:
    """One self-contained page for a comparison (what ``Comparison.to_html`` writes).

    Args:
        cmp: a :class:`~gradscope.compare.Comparison`.
        problem: one sentence saying what the candidates solve, shown first on the page (above
            the winner and what holds memory, which the page works out itself); none when omitted.

    Example:
        >>> import torch, gradscope as gs
        >>> x = torch.randn(5, requires_grad=True)
        >>> cmp = gs.compare({"exp": lambda: x.exp(), "pow": lambda: torch.e ** x}, memory="off")
        >>> "exp or pow?" in comparison_html(cmp, problem="exp or pow?")
        True
    """
    payload = comparison_payload(cmp)
    if problem is not None:
        if not isinstance(problem, str):
            raise GradscopeError(
                f"gradscope: problem must be a sentence (str), got {type(problem).__name__}; pass the text "
                "the page should show first, or leave it out."
            )
        payload["problem"] = problem
    return page_html(payload, "gradscope · comparison")
