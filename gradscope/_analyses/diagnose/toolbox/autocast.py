"""Autocast of the forward to bfloat16 (CPU and CUDA): activations saved in half the bytes. It
changes the results by rounding: the finding states the largest relative difference measured."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, autocast

PATTERN = "autocast"  # the name its finding and notes go by

ACCEPTED = 0.05  # largest relative difference of a result shown as acceptable for bfloat16


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None or "autocast" in bench.source:
        return []
    if room is not None and any(room.fits(t) and t.same is not False for t in bench.measured()):
        return []  # a change of precision is advice for a step nothing else makes fit (with the same results)
    code = autocast(shape, bench.device, "bfloat16")
    trial = bench.run(code, tolerance=ACCEPTED)
    return [(Finding(
        pattern=PATTERN,
        bytes=0,
        message="the forward runs in float32: every saved activation takes 4 bytes per element",
        suggestion="run the forward under torch.autocast with bfloat16",
        code=code,
        step=code,
    ), trial)]


def finish(f: Finding, trial: Any) -> Finding:
    """The finding once its code ran for real: the difference of its results, measured."""
    if trial.same is None:
        return dataclasses.replace(f, suggestion=f.suggestion + ": results differ by rounding")
    return dataclasses.replace(f, tolerance=trial.worst, suggestion=(
        f"{f.suggestion}: results differ by rounding, at most {trial.worst:.1e} relative here (measured)"))
