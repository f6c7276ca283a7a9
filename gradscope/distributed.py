"""Recordings of a ``torch.distributed`` job: ``gs.gather`` moves them to one rank over the job's
own process group, and ``gs.predict_job`` predicts each rank's peak under DDP or FSDP.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._analyses.gather import gather
from gradscope._analyses.predict_job import JobPrediction, RankPrediction, predict_job

__all__ = [
    "JobPrediction",
    "RankPrediction",
    "gather",
    "predict_job",
]
