"""``gs.predict``: how much memory one step needs, without running a kernel or owning a GPU.

This module is a face: each name below is defined in the module it is imported from.
"""

from __future__ import annotations

from gradscope._analyses.predict.allocator import AllocatorEstimate, estimate_cuda_allocator
from gradscope._analyses.predict.predictor import BatchResult, Prediction, predict

__all__ = [
    "AllocatorEstimate",
    "BatchResult",
    "Prediction",
    "estimate_cuda_allocator",
    "predict",
]
