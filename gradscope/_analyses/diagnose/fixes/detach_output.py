from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import replay, top_of
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import detached_calls
from gradscope._model.recording import Category


# ----- gradients computed for a model whose optimizer does not step --------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """A GAN's D step without ``G(z).detach()``: the backward ran into ``G`` (its gradients were
    accumulated), an optimizer trains ``G``, but only another optimizer stepped in the block:
    ``G``'s graph was kept and its gradients computed for a step that is not taken (the next
    ``opt_G.zero_grad()`` discards them). Known at the end of a block only: which optimizer
    stepped is read from the state it created (a first step)."""
    g = ctx.g
    if ctx.moment != "peak" or ctx.raised() or not g.calls:
        return []
    stepped = ctx.optimizers_that_stepped()
    if not stepped:
        return []
    accumulated = {top_of(g.leaf_name(i)) for c in g.calls for i in c.accumulated}
    out: list[Finding] = []
    for name, m in ctx.modules:
        if name not in ctx.roots or name not in accumulated:
            continue
        mine = [o for o, opt in ctx.optimizers if any(id(p) in {id(q) for q in m.parameters()}
                                                          for grp in opt.param_groups for p in grp["params"])]
        if not mine or any(o in stepped for o in mine):
            continue
        fix_peak = replay(
            ctx.rec.allocations,
            lambda a, name=name: g.alloc_root(a) == name and a.category in (Category.GRADIENT, Category.BACKWARD_TEMP),
            free_at=g.released_early(lambda a, name=name: g.alloc_root(a) == name and a.node is not None),
        )
        z = ctx.tensor_named(g.first_input_shape(name)) or "z"
        out.append(
            Finding(
                pattern="gradients_discarded",
                bytes=sum(a.bytes for a in g.alive if g.alloc_root(a) == name),
                variable=name,
                module=name,
                message=(
                    f"backward ran into `{name}` and computed its gradients, but only "
                    f"{', '.join(sorted(stepped))} stepped here; `{mine[0]}` (which trains {name}) did not: "
                    f"{name}'s graph was kept and its gradients computed for nothing"
                ),
                suggestion=f"detach {name}'s output where it feeds the other model's loss (or run {name} under torch.no_grad() there)",
                code=f"fake = {name}({z}).detach()  # in this step; {mine[0]}.zero_grad() would discard {name}'s gradients anyway",
                saves_bytes=ctx.saving(fix_peak),
            )
        )
    return out


def rewrite(ctx: Context, f: Finding, source: str) -> str | None:
    """The step with the model whose gradients are discarded called as ``model(...).detach()``."""
    name = f.module or f.variable
    return detached_calls(source, name) if name else None
