"""``zero_grad(set_to_none=True)``: gradients freed between steps instead of zero-filled and kept."""

from __future__ import annotations

from typing import Any

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, replaced_zero_grad

PATTERN = "set_to_none"  # the name its finding and notes go by


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    code = replaced_zero_grad(shape, ctx.ns)
    if code is None:
        return []
    return [(Finding(
        pattern=PATTERN,
        bytes=0,
        message="zero_grad(set_to_none=False) keeps every gradient allocated, filled with zeros",
        suggestion="zero_grad(set_to_none=True): gradients freed until backward makes them again",
        code=code,
        step=code,
    ), bench.run(code, least=bench.least(code)))]  # no set-up: its statements that are the user's run as theirs
