"""A job's payload: what the notebook widget and the page draw for a :class:`~gradscope._model.job.Job`,
read from :func:`~gradscope._analyses.jobs.job_view`. The widget (``gradscope.widget.job_payload``,
a job's PAYLOAD view) calls it with its own ``recording_payload`` for each rank's graph.

Example:
    >>> from gradscope._model.job import Job, RankEntry, RankStatus
    >>> p = job_payload(Job((RankEntry(0, RankStatus.MISSING, message="no file"),)))
    >>> p["kind"], p["rows"][0]["status"], p["recordings"]
    ('job', 'missing', None)
"""

from __future__ import annotations

import math
from typing import Any

from gradscope._analyses.jobs import diagnose_job, job_view
from gradscope._model.figures import figures_payload
from gradscope._model.job import Job

__all__ = ["MAX_RANKS_WITH_GRAPHS", "job_payload"]

MAX_RANKS_WITH_GRAPHS = 8  # ranks whose whole recording (graph, steps) travels with the job's view


def job_payload(job: Job, *, recording_payload: Any = None, version: int = 2) -> dict[str, Any]:
    """What the widget and the page draw for a job, read from :func:`job_view`: the per-rank
    rows, the imbalance, the overlaid timelines (with each point's phase), the communication
    spans, the findings of :func:`diagnose_job` when a rank's block failed, and, for jobs of at
    most ``MAX_RANKS_WITH_GRAPHS`` ranks, each rank's own recording (``recording_payload(rec)``,
    from :mod:`gradscope.widget`) for its graph and step-through."""
    v = job_view(job)
    phases = ("forward", "backward", "optimizer", "other")

    def shape(t: tuple[int, ...]) -> str:
        return "×".join(str(d) for d in t) if t else "scalar"

    rows = [
        {
            "rank": r.rank, "status": r.status.value, "message": r.message, "peak_bytes": r.peak_bytes,
            "baseline_bytes": r.baseline_bytes, "saved_bytes": r.saved_bytes,
            "saved_at_peak": r.saved_bytes_at_peak, "time_s": _finite(r.time_s), "nodes": r.nodes,
            "peak_phase": r.peak_phase, "peak_module": r.peak_module, "peak_label": r.peak_label,
            "inputs": [shape(t) for t in r.inputs[:3]], "source": e.source,
        }
        for r, e in zip(v.rows, job.ranks, strict=True)
    ]
    imb = v.imbalance
    imbalance = None if imb is None else {
        "heaviest": imb.heaviest, "lightest": imb.lightest, "heavy_peak": imb.heavy_peak,
        "light_peak": imb.light_peak, "ratio": _finite(imb.ratio), "sentence": imb.sentence,
        "sizes": [{"what": d.what, "heavy": d.heavy, "light": d.light, "input": d.input} for d in imb.sizes],
        "modules": [[d.name, d.heavy_bytes, d.light_bytes] for d in imb.modules[:8]],
        "held": [[d.name, d.heavy_bytes, d.light_bytes] for d in imb.held[:8]],
        "heavy_phase": imb.heavy_phase, "light_phase": imb.light_phase,
        "heavy_module": imb.heavy_module, "light_module": imb.light_module,
    }
    timelines = [
        {"rank": tl.rank, "t": [p[0] for p in tl.points], "live": [p[1] for p in tl.points],
         "phase": [phases.index(ph) if ph in phases else 3 for ph in tl.phases] if tl.phases else None,
         "peak_t": _finite(tl.peak_t_s)}
        for tl in v.timelines
    ]
    collectives = [{"rank": c.rank, "op": c.op, "t0": _finite(c.t_start_s), "t1": _finite(c.t_end_s),
                    "bytes": c.bytes, "source": c.source} for c in v.collectives]
    notes = list(v.notes)
    findings = []
    if any(e.recording is not None and not e.recording.complete for e in job.ranks):
        findings = [{"rank": f.rank, "pattern": f.pattern, "message": f.message, "suggestion": f.suggestion}
                    for f in diagnose_job(job).findings]
    recordings: list[Any] | None = None
    if recording_payload is not None:
        if job.world_size <= MAX_RANKS_WITH_GRAPHS:
            recordings = [None if e.recording is None else recording_payload(e.recording) for e in job.ranks]
        else:
            notes.append(f"graphs and step-through are shown for jobs of up to {MAX_RANKS_WITH_GRAPHS} ranks; "
                         "gs.show(job.recordings[r]) shows one rank's.")
    return {
        "version": version,
        "kind": "job",
        "label": job.label,
        "world_size": job.world_size,
        "counts": job.status_counts(),
        "rows": rows,
        "imbalance": imbalance,
        "timelines": timelines,
        "phases": list(phases),
        "collectives": collectives,
        "findings": findings,
        "notes": notes,
        "figures": figures_payload(),
        "recordings": recordings,
    }


def _finite(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), 9)
