"""One job, many ranks: the recordings of a ``torch.distributed`` job side by side.

A :class:`Job` holds one entry per rank (its recording, or why there is none), ordered by rank.
It comes from :func:`gradscope.gather` on the destination rank, from :func:`load_ranks` (a
directory written by :meth:`Job.save`, or per-rank files saved independently), or from
:func:`gradscope.predict_job`. What a job view shows is computed by one pure function,
:func:`job_view`, which the text summary, the HTML page and the notebook widget all read.

This module gathers the public names of the package :mod:`gradscope.job`, where they live by
layer: the job and its files (:mod:`gradscope._model.job`), its analysis
(:mod:`gradscope._analyses.jobs`), its payload and its script-free page (:mod:`gradscope._views.job_payload`,
:mod:`gradscope._views.job_page`). Nothing here imports ``torch.distributed``: a saved job opens on a laptop.

Its example is :mod:`gradscope._analyses.jobs`'s (a job of two ranks and the sentence that says why one peaks).
"""

from __future__ import annotations

from gradscope._analyses.jobs import _TIMELINE_POINTS as _TIMELINE_POINTS
from gradscope._analyses.jobs import (
    CollectiveSpan,
    Difference,
    Imbalance,
    JobDiagnosis,
    JobFinding,
    JobView,
    RankRow,
    SizeDifference,
    TimelineSeries,
    diagnose_job,
    job_view,
)
from gradscope._model.job import JOB_SCHEMA_VERSION, Job, RankEntry, RankStatus, load_ranks
from gradscope._model.job import MANIFEST as MANIFEST
from gradscope._views.job_page import job_html
from gradscope._views.job_payload import MAX_RANKS_WITH_GRAPHS as MAX_RANKS_WITH_GRAPHS
from gradscope._views.job_payload import job_payload

__all__ = [
    "JOB_SCHEMA_VERSION",
    "CollectiveSpan",
    "Difference",
    "Imbalance",
    "Job",
    "JobDiagnosis",
    "JobFinding",
    "JobView",
    "RankEntry",
    "RankRow",
    "RankStatus",
    "SizeDifference",
    "TimelineSeries",
    "diagnose_job",
    "job_html",
    "job_payload",
    "job_view",
    "load_ranks",
]
