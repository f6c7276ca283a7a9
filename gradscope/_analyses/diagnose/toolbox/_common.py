"""What the toolbox's fixes share: the models the step calls."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.step import free_names


def models(ctx: Context, source: str) -> list[tuple[str, nn.Module]]:
    """The user's models the step reads, largest first."""
    names = free_names(source)
    out = [(n, v) for n, v in ctx.ns.items() if n in names and isinstance(v, nn.Module)]
    out.sort(key=lambda nv: (-sum(p.numel() for p in nv[1].parameters()), nv[0]))
    return out


def has_batch_norm(model: Any) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training for m in model.modules())


def dropouts_in_turn(ctx: Context, source: str) -> bool:
    """Whether the step's models hold two dropout modules or more in train mode with a p over 0: a
    forward run slice by slice (micro-batches) then draws their masks in another order than the
    step's (the first's for every slice, then the second's, against the first's for the whole batch,
    then the second's), so that the two cannot agree with dropout on."""
    on = 0
    for _, model in models(ctx, source):
        on += sum(1 for m in model.modules()
                  if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0)
    return on >= 2
