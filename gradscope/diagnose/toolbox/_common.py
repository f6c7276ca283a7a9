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


def repeated_blocks(model: nn.Module) -> tuple[str, int, int] | None:
    """The longest run of consecutive sibling blocks of one class in a list of modules
    (``transformer.h``, ``model[0:4]``), with the most parameters: (path, start, stop)."""
    best: tuple[int, str, int, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList | nn.Sequential) or len(m) < 2:
            continue
        kids = list(m)
        i = 0
        while i < len(kids):
            j = i + 1
            while j < len(kids) and type(kids[j]) is type(kids[i]):
                j += 1
            size = sum(p.numel() for k in kids[i:j] for p in k.parameters())
            if j - i >= 2 and size and (best is None or size > best[0]):
                best = (size, path, i, j)
            i = j
    return None if best is None else (best[1], best[2], best[3])


def has_batch_norm(model: Any) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training for m in model.modules())
