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
