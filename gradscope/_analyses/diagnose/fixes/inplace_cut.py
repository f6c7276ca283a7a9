from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import top_of
from gradscope._analyses.diagnose.proxies import hypergradient_proxy, proxy_peak
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._model.recording import format_bytes


# ----- the block raised: a differentiated tensor cut out of the graph ---------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Seed 002: parameters updated in place under no_grad (``p.copy_(p - lr * p.grad)``, what
    ``optimizer.step()`` does) after a create_graph backward: the update is not in the graph,
    so what the inner gradients depended on (``A``) is cut out of the validation loss, and
    ``autograd.grad`` raises "... appears to not have been used in the graph"."""
    # the block's error, or a backward call's that the user caught inside the block
    errors = [ctx.rec.error or "", *(c.error or "" for c in ctx.rec.backward_calls)]
    if not any("not have been used in the graph" in e for e in errors):
        return []
    g = ctx.g
    inner = [c for c in g.calls if c.create_graph and g.param_inputs(c)]
    if not inner:
        return []
    root = top_of(g.leaf_name(inner[0].accumulated[0] if inner[0].accumulated else inner[0].inputs[0]))
    model = ctx.module(root)
    name = ctx.model_name(root)
    last = g.calls[-1]
    leaf_shape = g.nodes[last.inputs[0]].leaf_shape if last.inputs else None
    target = ctx.tensor_named(tuple(leaf_shape) if leaf_shape else None, requires_grad=True) or "A"
    steps = len(inner)
    fix_peak = None
    if model is not None and leaf_shape is not None:
        x_shape = g.input_shape(root)
        if x_shape is not None:
            fix_peak = proxy_peak(hypergradient_proxy(tuple(leaf_shape), x_shape, steps), model)
    saving = ctx.saving(fix_peak)
    cost = "" if saving is None else (
        f"; the unrolled steps keep their graphs, so this costs {format_bytes(-saving)} more at the "
        "peak" if saving < 0 else f"; it peaks {format_bytes(saving)} lower")
    return [
        Finding(
            pattern="differentiated_cut",
            bytes=0,
            variable=target,
            module=root,
            message=(
                f"`{target}` was cut out of the graph: {steps} backward call{'s' if steps != 1 else ''} with "
                f"create_graph=True computed {name}'s gradients, and the update of {name}'s parameters "
                "ran in place under torch.no_grad(), which autograd does not record; the loss after "
                f"the update no longer depends on `{target}` (allow_unused=True would only return None)"
            ),
            suggestion=(
                f"unroll the updates out of place so that each step's parameters are a function of "
                f"`{target}`: gradscope.strategies.hypergradient (or unrolled_params for the "
                f"parameters themselves) runs {name} with torch.func.functional_call{cost}"
            ),
            code=(
                f"A_grad = hypergradient({name}, {target}, train_loss, val_loss, steps={steps}, "
                'optimizer="sgd", lr=lr)  # train_loss(p) / val_loss(p): torch.func.functional_call('
                f"{name}, p, (x,))"
            ).replace("A_grad", f"{target}_grad" if target.isidentifier() else "A_grad"),
            saves_bytes=saving,
        )
    ]
