from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import replay
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import numbers_appended, under_no_grad
from gradscope._model.recording import format_bytes


# ----- graphs that nothing differentiates -------------------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Losses (or outputs) kept with their graphs where no backward ran: an evaluation loop.
    At a failure only when the model is in eval() mode (a training loop's losses may still be
    back-propagated, see `_many_calls`)."""
    g = ctx.g
    if g.calls:
        return []
    root = g.main_root(order=0)
    model = ctx.module(root)
    if ctx.moment == "failure" and (model is None or model.training):
        return []
    out: list[Finding] = []
    # Without a backward the recorder may never have walked these graphs (they were dropped
    # before the block ended): what the model made is what the graphs kept.
    saved = sum(a.bytes for a in g.alive if a.node is not None or (root and g.alloc_root(a) == root))
    if saved <= 0 or model is None:
        return []
    for var, graphs in ctx.graph_lists(holders):
        fix_peak = replay(ctx.rec.allocations, free_at=g.released_early(
            lambda a: a.node is not None or g.alloc_root(a) == root))
        name = ctx.model_name(root)
        out.append(
            Finding(
                pattern="graphs_held",
                bytes=saved,
                variable=var,
                module=root,
                message=(
                    f"`{var}` holds {graphs} graphs and nothing here differentiates them: their "
                    f"saved tensors are {format_bytes(saved)} of the {format_bytes(ctx.live)} live"
                ),
                suggestion=(
                    f"keep numbers in `{var}` (loss.item()), or run the loop under torch.no_grad() "
                    f"so that {name} saves nothing for a backward that never comes"
                ),
                code=f"{var}.append(loss.item())  # or the loop under torch.no_grad()",
                saves_bytes=ctx.saving(fix_peak),
            )
        )
        break
    return out


def rewrite(ctx: Context, f: Finding, source: str) -> list[str | None]:
    """The step appending numbers (``loss.item()``) to the list that kept graphs; else (the step
    uses them as tensors) the forwards whose results reach no backward under no_grad."""
    root = f.module or ctx.g.main_root(order=0)
    return [numbers_appended(source, f.variable) if f.variable else None,
            under_no_grad(source, ctx.model_name(root), only_dead=True) if root else None]
