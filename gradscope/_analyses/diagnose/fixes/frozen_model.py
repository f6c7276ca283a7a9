from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import replay
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import under_no_grad
from gradscope._model.recording import Category, format_bytes


# ----- a model that requires grad but is not trained ------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """A model in eval() mode whose parameters require grad, that no optimizer among the
    user's variables trains, run with autograd on (its gradients were computed for nothing).
    Never a model that a create_graph gradient goes through or whose parameters an
    autograd.grad asked for."""
    g = ctx.g
    out: list[Finding] = []
    if any(c.create_graph for c in g.calls):
        return []
    trained = [n for n, m in ctx.modules if n in ctx.roots and ctx.trained_by_optimizer(m)]
    for name, m in ctx.modules:
        if name not in ctx.roots or ctx.trained_by_optimizer(m) is not False:
            continue
        # in train mode only where the optimizers train another model of the same graphs (a head on
        # a backbone no optimizer steps): the backbone's gradients are computed for nothing
        if m.training and not trained:
            continue
        if not any(p.requires_grad for p in m.parameters()) or name in g.asked_roots():
            continue
        saved = sum(a.bytes for a in g.alive if g.alloc_root(a) == name)
        fix_peak = replay(  # no gradients or backward work for it; its intermediates freed at once
            ctx.rec.allocations,
            lambda a, name=name: g.alloc_root(a) == name and a.category in (Category.GRADIENT, Category.BACKWARD_TEMP),
            free_at=g.released_early(lambda a, name=name: g.alloc_root(a) == name and a.node is not None),
        )
        out.append(
            Finding(
                pattern="frozen_trainable",
                bytes=saved,
                variable=name,
                module=name,
                message=(
                    f"`{name}` ({type(m).__name__}) is "
                    + ("in eval() mode and no optimizer trains it" if not m.training else
                       f"trained by no optimizer of yours (they train {', '.join(trained)})")
                    + ", but its parameters require grad and it ran with autograd on: its activations were saved "
                    f"and its gradients computed for nothing ({format_bytes(saved)} of it at the peak)"
                ),
                suggestion=f"run `{name}` under torch.no_grad() (or turn its requires_grad off)",
                code=f"with torch.no_grad():\n    feats = {name}(x)",
                saves_bytes=ctx.saving(fix_peak),
            )
        )
    return out


def rewrite(ctx: Context, f: Finding, source: str) -> list[tuple[str, str] | str | None]:
    """Every call of the model that nothing trains under no_grad; else (a statement that also
    builds what a later backward needs: ``losses.append(loss_fn(head(backbone(x)), y))``) its
    requires_grad off once before the step, so that what reads its output still builds its graph."""
    if not f.variable:
        return []
    return [under_no_grad(source, f.variable, only_dead=False), (f"{f.variable}.requires_grad_(False)\n", source)]
