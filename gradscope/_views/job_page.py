"""A job's script-free view: the per-rank table, the imbalance and the overlaid timelines as HTML
and inline SVG, read from :func:`~gradscope._analyses.jobs.job_view`. It is the text/html of a job's
notebook display (the HTML view of a job with ``script=False``), the ``<noscript>`` of the page
``Job.to_html`` writes, and :func:`job_html`, a page of its own.

Example:
    >>> from gradscope._model.job import Job, RankEntry, RankStatus
    >>> page = job_html(Job((RankEntry(0, RankStatus.MISSING, message="<no file>"),)))
    >>> "<script" in page, "&lt;no file&gt;" in page
    (False, True)
"""

from __future__ import annotations

import html as _html

from gradscope._analyses.jobs import JobView, job_view
from gradscope._base.page import document
from gradscope._model.figures import BASELINE, MODULE_SAVED, PEAK, SAVED_ALL
from gradscope._model.job import Job
from gradscope._model.recording import format_bytes

__all__ = ["fragment_html", "job_html"]

# NOTE [ the job's script-free view ]: the job view itself is the widget's front end (the page
# Job.to_html writes inlines it, see gradscope.html.job_page_html). This table and SVG are what
# shows where no script runs: a notebook rendered by nbconvert or on a code host (the text/html
# of Job._repr_mimebundle_), the page's <noscript>, and job_html(), a page with no script at all
# (its Content-Security-Policy allows none: the page skeleton is html.document's, with a policy
# of its own), which renders anywhere.
_JOB_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_STYLE = (
    ".gs-job{font:13px system-ui,sans-serif;color:#1b1f24}"
    ".gs-job table{border-collapse:collapse;margin:8px 0}"
    ".gs-job td,.gs-job th{padding:3px 9px;border-bottom:1px solid #dde3ea;text-align:right}"
    ".gs-job td.l,.gs-job th.l{text-align:left}"
    ".gs-job .failed{color:#b35c00}.gs-job .missing,.gs-job .unreadable{color:#b00020}"
    ".gs-job .imb{margin:8px 0;font-weight:600}"
)


def job_html(job: Job) -> str:
    """A page with no script at all: the per-rank table, the imbalance and the overlaid
    timelines as inline SVG (see NOTE [ the job's script-free view ])."""
    title = "gradscope job" + (f" · {job.label}" if job.label else "")
    return document(title, fragment_html(job) + "\n", csp=_JOB_CSP)


def fragment_html(job: Job) -> str:
    """The table and timelines alone (a ``<div>`` with its style): what a job shows as a cell's
    HTML where no widget runs (see NOTE [ the job's script-free view ])."""
    return _html_fragment(job, job_view(job))


def _html_fragment(job: Job, v: JobView) -> str:
    e = _html.escape
    out = [f"<div class='gs-job'><style>{_STYLE}</style>"]
    out.append(f"<h3>{e('gradscope job' + (' · ' + job.label if job.label else ''))}: "
               f"{job.world_size} ranks</h3>")
    if v.imbalance is not None:
        out.append(f"<div class='imb'>{e(v.imbalance.sentence)}</div>")
    head = "".join(f"<th title='{e(f.definition, quote=True)}'>{e(f.label)}</th>" for f in (PEAK, BASELINE, SAVED_ALL))
    out.append(f"<table><tr><th>rank</th><th class='l'>status</th>{head}<th>time</th><th class='l'>peak at</th>"
               "<th class='l'>inputs</th></tr>")
    for row in v.rows:
        color = _COLORS[row.rank % len(_COLORS)]
        where = " ".join(x for x in (row.peak_phase, row.peak_module, row.peak_label) if x)
        inputs = ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in row.inputs[:3])
        msg = f"<br><small>{e(row.message)}</small>" if row.message else ""
        t = "" if row.time_s is None else f"{row.time_s:.3f} s"
        out.append(
            f"<tr><td><span style='color:{color}'>&#9632;</span> {row.rank}</td>"
            f"<td class='l {row.status.value}'>{e(row.status.value)}{msg}</td>"
            f"<td>{e(format_bytes(row.peak_bytes))}</td><td>{e(format_bytes(row.baseline_bytes))}</td>"
            f"<td>{e(format_bytes(row.saved_bytes))}</td><td>{t}</td>"
            f"<td class='l'>{e(where)}</td><td class='l'>{e(inputs)}</td></tr>"
        )
    out.append("</table>")
    if v.timelines:
        out.append(_svg(v))
    if v.imbalance is not None and v.imbalance.modules:
        imb = v.imbalance
        out.append(f"<table><tr><th class='l'>module</th><th>{e(MODULE_SAVED.label)}, rank {imb.heaviest}</th>"
                   f"<th>{e(MODULE_SAVED.label)}, rank {imb.lightest}</th></tr>")
        for d in imb.modules[:8]:
            out.append(f"<tr><td class='l'>{e(d.name)}</td><td>{e(format_bytes(d.heavy_bytes))}</td>"
                       f"<td>{e(format_bytes(d.light_bytes))}</td></tr>")
        out.append("</table>")
    for n in v.notes:
        out.append(f"<p><small>note: {e(n)}</small></p>")
    out.append("</div>")
    return "".join(out)


def _svg(v: JobView, width: int = 760, height: int = 260) -> str:
    """Overlaid per-rank timelines (live bytes over seconds since each rank's first point), the
    peaks marked, communication spans as ticks under the axis."""
    pad_l, pad_r, pad_t, pad_b = 70, 12, 24, 48
    t_max = max((p[0] for s in v.timelines for p in s.points), default=0.0) or 1.0
    y_max = max((p[1] for s in v.timelines for p in s.points), default=0) or 1
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def x(t: float) -> float:
        return pad_l + w * t / t_max

    def y(b: int) -> float:
        return pad_t + h * (1 - b / y_max)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"role='img' aria-label='memory over time, one line per rank'>"]
    parts.append(f"<rect x='{pad_l}' y='{pad_t}' width='{w}' height='{h}' fill='#fff' stroke='#c8d0da'/>")
    for frac in (0.0, 0.5, 1.0):
        yy = y(int(y_max * frac))
        parts.append(f"<text x='{pad_l - 6}' y='{yy + 4:.1f}' font-size='11' text-anchor='end'>"
                     f"{_html.escape(format_bytes(int(y_max * frac)))}</text>")
    parts.append(f"<text x='{pad_l}' y='{pad_t + h + 14:.1f}' font-size='11'>0 s</text>")
    parts.append(f"<text x='{pad_l + w:.1f}' y='{pad_t + h + 14:.1f}' font-size='11' text-anchor='end'>"
                 f"{t_max:.3g} s since each rank's block began</text>")
    for s in v.timelines:
        color = _COLORS[s.rank % len(_COLORS)]
        # memory is a step function: hold each level until the next point
        steps: list[str] = []
        for i, (t, b) in enumerate(s.points):
            if i:
                steps.append(f"{x(t):.1f},{y(s.points[i - 1][1]):.1f}")
            steps.append(f"{x(t):.1f},{y(b):.1f}")
        pts = " ".join(steps)
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{pts}'>"
                     f"<title>rank {s.rank}</title></polyline>")
        top = max(s.points, key=lambda p: p[1])
        parts.append(f"<circle cx='{x(top[0]):.1f}' cy='{y(top[1]):.1f}' r='3.5' fill='{color}'>"
                     f"<title>rank {s.rank} peak {_html.escape(format_bytes(top[1]))}</title></circle>")
    ranks = sorted({s.rank for s in v.timelines})
    for c in v.collectives:
        if c.rank not in ranks:
            continue
        row = ranks.index(c.rank) % 4
        yy = pad_t + h + 22 + 5 * row
        color = _COLORS[c.rank % len(_COLORS)]
        x0, x1 = x(c.t_start_s), max(x(c.t_end_s), x(c.t_start_s) + 2)
        parts.append(f"<line x1='{x0:.1f}' x2='{x1:.1f}' y1='{yy}' y2='{yy}' stroke='{color}' "
                     f"stroke-width='4'><title>rank {c.rank}: {_html.escape(c.op)}</title></line>")
    legend_x = pad_l
    for r in ranks:  # above the plot, clear of the communication ticks under it
        color = _COLORS[r % len(_COLORS)]
        parts.append(f"<text x='{legend_x}' y='{pad_t - 8}' font-size='11' fill='{color}'>rank {r}</text>")
        legend_x += 56
    if v.collectives:
        parts.append(f"<text x='{pad_l + w:.1f}' y='{height - 4}' font-size='10' text-anchor='end' "
                     "fill='#5a6570'>ticks: communication (one row per rank)</text>")
    parts.append("</svg>")
    return "".join(parts)
