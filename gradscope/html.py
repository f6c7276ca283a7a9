"""Self-contained HTML pages: one file with the widget's script and the data inline, that renders
the graph, the memory timeline and the backward step-through from ``file://`` with no network.

Example:
    >>> from gradscope.recording import Recording, Node
    >>> page = recording_html(Recording(nodes=(Node(0, "SumBackward0"),)))  # doctest: +SKIP
    >>> page.startswith("<!doctype html>")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import html as _html
import json
from typing import Any

from gradscope._snapshot.data import SnapshotRecording
from gradscope.errors import GradscopeError
from gradscope.recording import Recording
from gradscope.widget import (
    bundle_text,
    comparison_payload,
    job_payload,
    recording_payload,
    snapshot_payload,
)

__all__ = ["comparison_html", "document", "job_page_html", "page_html", "recording_html", "snapshot_html"]

# NOTE [ no network in pages ]: the page's Content-Security-Policy allows inline script and
# style and data:/blob: images only, so a page cannot fetch anything even if some code tried.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data: blob:; font-src data:"
)


def _inline_json(payload: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: ``<``, ``>`` and ``&`` are escaped
    as ``\\u003c`` etc., so no text in the data can close the element or open a comment."""
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _inline_script(js: str) -> str:
    """Script text safe inside ``<script>``: no ``</script`` and no ``<!--`` can end it early."""
    return js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT").replace("<!--", "<\\!--")


def document(title: str, body: str, csp: str = _CSP) -> str:
    """The page skeleton every gradscope page shares: ``body`` (HTML made safe by its maker) under
    a head with the Content-Security-Policy ``csp`` (NOTE [ no network in pages ]; a page that runs
    no script passes one that allows none) and the escaped ``title``."""
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_html.escape(title)}</title>\n"
        "<style>body { margin: 12px; background: #f5f7fa; }</style>\n"
        f"</head>\n<body>\n{body}</body>\n</html>\n"
    )


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


def recording_html(rec: Recording) -> str:
    """One self-contained page for a recording (what :meth:`Recording.to_html` writes); a CUDA
    memory snapshot (``gs.load_snapshot``) gets the snapshot view."""
    if isinstance(rec, SnapshotRecording):
        return snapshot_html(rec)
    return page_html(recording_payload(rec), f"gradscope · {rec.label or 'recording'}")


def snapshot_html(rec: SnapshotRecording) -> str:
    """One self-contained page for a recording made by ``gs.load_snapshot``: the snapshot view."""
    return page_html(snapshot_payload(rec), f"gradscope · {rec.label or 'recording'}")


def job_page_html(job: Any) -> str:
    """One self-contained page for a :class:`~gradscope.job.Job` (what ``Job.to_html`` writes):
    the job view, and the script-free table and timelines where scripts do not run."""
    title = "gradscope job" + (f" · {job.label}" if job.label else "")
    return page_html(job_payload(job), title, fallback=job._repr_html_())


def comparison_html(cmp: Any, problem: str | None = None) -> str:
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
