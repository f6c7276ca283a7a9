"""Autocast of the forward to bfloat16 (CPU and CUDA): activations saved in half the bytes. It
changes the results by rounding: the finding states the largest relative difference measured."""

from __future__ import annotations

from typing import Any

from gradscope.diagnose.facts import Context
from gradscope.diagnose.measure import Bench
from gradscope.diagnose.report import Finding
from gradscope.diagnose.step import Shape, autocast

ACCEPTED = 0.05  # largest relative difference of a result shown as acceptable for bfloat16


def propose(ctx: Context, bench: Bench, shape: Shape, room: int | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None or "autocast" in bench.source:
        return []
    code = autocast(shape, bench.device, "bfloat16")
    trial = bench.run(code, tolerance=ACCEPTED)
    return [(Finding(
        pattern="autocast",
        bytes=0,
        message="the forward runs in float32: every saved activation takes 4 bytes per element",
        suggestion=(f"run the forward under torch.autocast with bfloat16: results differ by rounding, at most "
                    f"{trial.worst:.1e} relative here (measured)"),
        code=code,
        step=code,
        tolerance=trial.worst if trial.error is None else None,
    ), trial)]
