"""Micro-batches with gradient accumulation: the forward and backward of the step run on slices of
its batch, each loss scaled by its share, so that one slice's activations are alive at a time. Under
a budget, the largest micro-batch that fits; else a quarter of the batch. Exact for a loss that is a
mean over the batch; batch norm or a sum makes the results differ, and the run says so."""

from __future__ import annotations

from typing import Any

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, batch_inputs, micro_batched
from gradscope._analyses.diagnose.toolbox._common import dropouts_in_turn

PATTERN = "micro_batches"  # the name its finding and notes go by


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    found = batch_inputs(shape, ctx.ns)
    if found is None or shape.loss is None:
        return []
    tensors, dicts, n = found
    sizes = [m for m in range(n - 1, 0, -1) if n % m == 0]
    if room is None:
        sizes = [m for m in sizes if m <= max(n // 4, 1)][:1]
    best = None
    reorders = dropouts_in_turn(ctx, bench.source)  # compared with dropout off at once (see Bench.verify)
    for m in sizes:
        code = micro_batched(shape, tensors, dicts, n, m)
        trial = bench.run(code, reorders=reorders)  # its memory: the diagnosis runs the one it shows for real
        if trial.error is not None:
            best = best or (m, code, trial)
            break  # another size gives the same answer
        trial = trial if room is None else bench.fitted(trial, room)
        best = (m, code, trial)
        if room is None or trial.error is not None or trial.same is False or room.fits(trial):
            break
    if best is None:
        return []
    m, code, trial = best
    names = ", ".join(sorted(tensors | dicts))
    return [(Finding(
        pattern=PATTERN,
        bytes=0,
        message=f"the step's activations grow with its batch of {n} ({names})",
        suggestion=(f"run forward and backward in micro-batches of {m}, each loss scaled by its share of the "
                    "batch: the same gradients, one micro-batch's activations alive at a time"),
        code=code,
        step=code,
    ), trial)]
