"""Forwards whose results reach no backward call, run under ``torch.no_grad()``: read from the step's
code, so it applies at a failure too, before anything recorded shows that no backward will use them
(an evaluation forward that ran out of memory before the training step). Only in a step that
trains (it calls ``backward``): a step that does not may leave its results to be differentiated later."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, under_no_grad

PATTERN = "forward_without_backward"  # the name its finding and notes go by


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None:
        return []  # a step that trains nothing: what it computes may be differentiated after the block
    out = []
    for name in sorted(ctx.ns):
        if not isinstance(ctx.ns[name], nn.Module):
            continue
        code = under_no_grad(bench.source, name, only_dead=True)
        if code is None:
            continue
        out.append((Finding(
            pattern=PATTERN,
            bytes=0,
            variable=name,
            module=name,
            message=f"the step calls {name} where no backward uses the result: its graph is saved for nothing",
            suggestion=f"run those calls of {name} under torch.no_grad() ({name}'s own requires_grad unchanged)",
            code=code,
            step=code,
        ), bench.run(code)))
    return out
