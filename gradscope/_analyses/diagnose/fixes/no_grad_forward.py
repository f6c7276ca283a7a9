from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import replay
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import under_no_grad
from gradscope._model.recording import format_bytes


def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """A forward (evaluation) whose graph no backward ran through, kept alive by a variable
    while a training step runs: that forward belongs under torch.no_grad(). The model itself
    is trained (its gradients were accumulated), so it is never frozen."""
    g = ctx.g
    if any(c.create_graph for c in g.calls) or ctx.raised():
        return []
    if ctx.moment == "failure":
        # Nothing is known yet of the backward to come: a forward of a model in eval() mode
        # that an optimizer trains is an evaluation, whose graph nobody will use.
        root = g.main_root(order=0)
        model = ctx.module(root)
        if model is None or model.training or ctx.trained_by_optimizer(model) is not True:
            return []
        dead = {i for i in g.never_run_saving_nodes() if g.top[i] == root}
        if not dead:
            dead = {a.node for a in g.alive if a.node is not None}
    elif not g.calls:
        return []
    else:
        dead = g.never_run_saving_nodes()
    if not dead:
        return []
    dead_alive = sum(a.bytes for a in g.alive if a.node in dead)
    if dead_alive <= 0:
        return []
    roots = {g.top[i] for i in dead if g.top[i]}
    if len(roots) != 1:
        return []
    root = roots.pop()
    holder = next((h for h in holders if h.graphs >= 1 and h.live_bytes > 0), None)
    var = holder.variable if holder else "out"
    name = ctx.model_name(root)
    fix_peak = replay(ctx.rec.allocations, free_at=g.released_early(lambda a: a.node in dead))
    return [
        Finding(
            pattern="forward_without_backward",
            bytes=dead_alive,
            variable=var,
            module=root,
            message=(
                f"a forward of {name} kept its graph ({format_bytes(dead_alive)} saved) but no backward "
                f"ever ran through it; `{var}` keeps it alive while the training step runs"
            ),
            suggestion=(
                f"run that forward under torch.no_grad() ({name} itself is trained here: keep its "
                "requires_grad)"
            ),
            code=f"with torch.no_grad():\n    {var} = {name}(...)   # the forward nothing back-propagates",
            saves_bytes=ctx.saving(fix_peak),
        )
    ]


def rewrite(ctx: Context, f: Finding, source: str) -> str | None:
    """The step with the forwards of the model whose results reach no backward under no_grad."""
    return under_no_grad(source, ctx.model_name(f.module), only_dead=True) if f.module else None
