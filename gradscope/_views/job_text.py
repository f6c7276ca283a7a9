"""A job's text: the per-rank table, the imbalance and the communication, in words, and the text of
its diagnosis and of a job's prediction. Registered for :class:`~gradscope._model.job.Job`,
:class:`~gradscope._analyses.jobs.JobDiagnosis` and :class:`~gradscope.distributed.JobPrediction`
(kind TEXT, NOTE [ one registry of views ] in ``gradscope._base.registry``): ``Job.summary()``,
``str(gs.diagnose(job))``, ``gs.predict_job(...).summary()``.

Example:
    >>> from gradscope._model.job import Job, RankEntry, RankStatus
    >>> lines = summary_text(Job((RankEntry(0, RankStatus.MISSING, message="no file"),), label="step 3")).splitlines()
    >>> print(lines[0]); print(lines[2])
    gradscope job step 3: 1 rank (1 missing)
       0  missing    no file
"""

from __future__ import annotations

import re

from gradscope._analyses.jobs import JobDiagnosis, JobView, job_view
from gradscope._analyses.predict_job import JobPrediction
from gradscope._base.registry import ViewKind, register
from gradscope._model.figures import BASELINE, MODULE_SAVED, PEAK, SAVED_ALL
from gradscope._model.job import Job, RankStatus
from gradscope._model.recording import format_bytes

__all__ = ["job_diagnosis_text", "job_prediction_text", "summary_text"]


@register(ViewKind.TEXT, Job)
def summary_text(job: Job) -> str:
    """Deterministic text (apart from times): per-rank table, imbalance, collectives."""
    return _summary_text(job, job_view(job))


def _summary_text(job: Job, v: JobView) -> str:
    counts = job.status_counts()
    head = f"gradscope job{' ' + job.label if job.label else ''}: {job.world_size} rank" + (
        "s" if job.world_size != 1 else "")
    lines = [head + " (" + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")"]
    # columns titled by the figure registry (NOTE [ one definition per figure ] in gradscope._model.figures)
    wp, wb, ws = (max(10, len(f.label)) for f in (PEAK, BASELINE, SAVED_ALL))
    lines.append(f"{'rank':>4}  {'status':<10} {PEAK.label:>{wp}} {BASELINE.label:>{wb}} {SAVED_ALL.label:>{ws}} "
                 f"{'time':>8}  peak at")
    for row in v.rows:
        if row.status in (RankStatus.MISSING, RankStatus.UNREADABLE):
            lines.append(f"{row.rank:>4}  {row.status.value:<10} {row.message}")
            continue
        where = "" if row.peak_phase is None else row.peak_phase
        if row.peak_module:
            where += f" in {row.peak_module}"
        if row.peak_label:
            where += f" ({row.peak_label})"
        t = "" if row.time_s is None else f"{row.time_s:.3f} s"
        lines.append(
            f"{row.rank:>4}  {row.status.value:<10} {format_bytes(row.peak_bytes):>{wp}} "
            f"{format_bytes(row.baseline_bytes):>{wb}} {format_bytes(row.saved_bytes):>{ws}} {t:>8}  {where}"
        )
        if row.status is RankStatus.FAILED:
            lines.append(f"{'':>6}failed: {row.message}")
    imb = v.imbalance
    if imb is not None:
        lines.append("imbalance: " + imb.sentence)
        for s in imb.sizes:
            lines.append(f"  input {s.input}: {s.what} {s.heavy} on rank {imb.heaviest}, {s.light} on "
                         f"rank {imb.lightest}")
        if imb.modules:
            lines.append(f"  {MODULE_SAVED.label}, rank {imb.heaviest} vs rank {imb.lightest}:")
            for d in imb.modules[:5]:
                lines.append(f"    {d.name}: {format_bytes(d.heavy_bytes)} vs {format_bytes(d.light_bytes)}")
        if imb.held:
            lines.append(f"  held at the peak, rank {imb.heaviest} vs rank {imb.lightest}:")
            for d in imb.held[:5]:
                lines.append(f"    {d.name}: {format_bytes(d.heavy_bytes)} vs {format_bytes(d.light_bytes)}")
        if imb.heaviest != imb.lightest:
            lines.append(
                f"  peaks: rank {imb.heaviest} in {imb.heavy_phase or '?'}"
                + (f" ({imb.heavy_module})" if imb.heavy_module else "")
                + f", rank {imb.lightest} in {imb.light_phase or '?'}"
                + (f" ({imb.light_module})" if imb.light_module else "")
            )
    if v.collectives:
        per: dict[int, dict[str, int]] = {}
        for c in v.collectives:
            per.setdefault(c.rank, {})
            per[c.rank][_op_family(c.op)] = per[c.rank].get(_op_family(c.op), 0) + 1
        moved: dict[int, dict[str, int]] = {}
        for c in v.collectives:
            if c.source == "captured":
                fam, op = moved.setdefault(c.rank, {}), _op_family(c.op)
                fam[op] = fam.get(op, 0) + c.bytes
        if moved:
            lines.append("communication (the collectives each rank's recording captured, with the bytes they moved):")
        else:
            lines.append("communication seen in the timelines (spans that allocated memory):")
        for rank, fam in sorted(per.items()):
            lines.append(f"  rank {rank}: " + ", ".join(
                f"{k} x{n}" + (f" ({format_bytes(moved[rank][k])})" if k in moved.get(rank, {}) else "")
                for k, n in sorted(fam.items())))
    for n in v.notes:
        lines.append("note: " + n)
    return "\n".join(lines)


def _op_family(op: str) -> str:
    """``'FSDP::all_gather (2)'`` -> ``'FSDP::all_gather'``: the op without its unit number."""
    return re.sub(r"\s*\(\d+\)$", "", op)


@register(ViewKind.TEXT, JobDiagnosis)
def job_diagnosis_text(diagnosis: JobDiagnosis) -> str:
    """The job's out-of-memory ranks, each with its finding, then each failing rank's report."""
    lines = ["gradscope job diagnosis: " + (f"{len(diagnosis.findings)} rank(s) out of memory"
                                             if diagnosis.findings else "no rank ran out of memory")]
    for f in diagnosis.findings:
        lines.append(f"  rank {f.rank} [{f.pattern}] {f.message}")
        lines.append(f"     suggestion: {f.suggestion}")
    if diagnosis.imbalance is not None:
        lines.append("imbalance: " + diagnosis.imbalance.sentence)
    for rank, report in diagnosis.rank_reports:
        lines.append(f"--- rank {rank} ---")
        lines.append(report)
    return "\n".join(lines)


@register(ViewKind.TEXT, JobPrediction)
def job_prediction_text(prediction: JobPrediction) -> str:
    """Per rank: the predicted peak, the resident bytes, their total and whether it fits."""
    lines = [f"gradscope prediction: one step of {prediction.strategy.upper()} on {prediction.world_size} ranks"]
    lines.append(f"{'rank':>4} {'peak':>11} {'resident':>11} {'total':>11}" + ("  budget" if prediction.budget else ""))
    fits = prediction.fits
    for r in prediction.ranks:
        verdict = "" if fits is None else ("  fits" if fits[r.rank] else "  does NOT fit")
        lines.append(f"{r.rank:>4} {format_bytes(r.peak_bytes):>11} {format_bytes(r.resident_bytes):>11} "
                     f"{format_bytes(r.total_bytes):>11}{verdict}")
    imb = job_view(prediction.job).imbalance
    if imb is not None:
        lines.append("imbalance: " + imb.sentence)
    lines.extend("note: " + n for n in prediction.notes)
    return "\n".join(lines)
