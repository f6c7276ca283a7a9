"""What the toolbox's fixes share: the models the step calls."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradscope.diagnose.facts import Context
from gradscope.diagnose.measure import free_names


def models(ctx: Context, source: str) -> list[tuple[str, nn.Module]]:
    """The user's models the step reads, largest first."""
    names = free_names(source)
    out = [(n, v) for n, v in ctx.ns.items() if n in names and isinstance(v, nn.Module)]
    out.sort(key=lambda nv: (-sum(p.numel() for p in nv[1].parameters()), nv[0]))
    return out


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The path of the largest list of sibling blocks of one class (``transformer.h``), and its length."""
    best: tuple[int, str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList | nn.Sequential) or len(m) < 2:
            continue
        kinds = {type(c) for c in m}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size and (best is None or size > best[0]):
            best = (size, path, len(m))
    return None if best is None else (best[1], best[2])


def has_batch_norm(model: Any) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training for m in model.modules())
