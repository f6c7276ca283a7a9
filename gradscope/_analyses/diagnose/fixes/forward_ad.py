from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import GRAPH_CATEGORIES, MIN_SAVING, replay
from gradscope._analyses.diagnose.proxies import mixed_grad_proxy, proxy_peak
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import input_grads, plain_derivatives
from gradscope._model.recording import Category, format_bytes


# ----- create_graph through a frozen model: forward AD ------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Seed 000: input gradients taken with create_graph=True through a model with no trainable
    parameters (or whose parameters no call differentiates and no optimizer steps), then differentiated with respect to another tensor: a mixed second derivative,
    which forward AD computes without keeping any graph of the model. Not when the
    create_graph graph trains parameters (a gradient penalty) or is taken with respect to
    parameters (an unrolled inner loop): there create_graph is the point."""
    g = ctx.g
    cg = [c for c in g.calls if c.create_graph]
    if not cg or any(g.param_inputs(c) or c.api != "autograd.grad" for c in cg):
        return []
    later = [c for c in g.calls if not c.create_graph and c.index > cg[0].index]
    asked = {i for c in cg for i in c.inputs}
    asked_shapes = {g.nodes[i].leaf_shape for i in asked}
    others = [i for i, n in enumerate(g.nodes)  # (an input of a pass still running is not one)
              if n.name == "AccumulateGrad" and n.leaf == "input" and i not in asked
              and n.leaf_shape not in asked_shapes]
    if later:
        wrt = [*later[-1].inputs, *later[-1].accumulated]
        if any(g.param_inputs(c) for c in later) or not g.order1_executed() or not wrt:
            return []  # (a later backward that trains parameters through them: a penalty)
        y = g.nodes[wrt[0]].leaf_shape
    elif ctx.moment == "failure" and len(others) == 1:
        # failed before the outer derivative: another leaf that requires grad feeds the
        # create_graph gradients (y of d/dy <v, df/dz>)
        y = g.nodes[others[0]].leaf_shape
    else:
        return []
    root = g.main_root(order=0)
    if root is None:
        return []
    model = ctx.module(root)
    name = ctx.model_name(root)
    # a model left trainable counts as frozen where the outer derivative was taken, no call
    # differentiated its parameters and no optimizer trains it (at a failure before the outer
    # derivative, a later backward may still train it: a gradient penalty)
    unused = g.trainable(root) and bool(later)
    # at a failure before the outer derivative, where the step's code takes it (a derivative taken
    # after the block, a penalty that trains the model, is not seen), the rewriting decides: it runs
    # the whole step on copies and is shown only if every gradient equals the step's own, the
    # model's included
    code = ctx.step_code() if ctx.moment == "failure" and not later else None
    runs = code is not None and plain_derivatives(code[0]) > 0
    if g.trainable(root) and (not (unused or runs) or root in g.differentiated_roots()
                              or (model is not None and ctx.trained_by_optimizer(model))):
        return []
    z = g.nodes[cg[0].inputs[0]].leaf_shape if cg[0].inputs else None
    if z is None or y is None:
        return []
    n = len(cg)
    saving: int | None = None
    fix_peak = 0
    if model is not None:
        rest = replay(ctx.rec.allocations, lambda a: a.category in GRAPH_CATEGORIES)
        own = proxy_peak(mixed_grad_proxy(tuple(z), tuple(y)), model)
        if own is None:
            return []
        # the stand-in f is a sum; the user's f carries a tangent next to each primal it saved
        f_saved = sum(a.bytes for a in g.alive if a.category is Category.ACTIVATION and a.module is None)
        fix_peak = rest + own + 2 * f_saved // n
        saving = ctx.saving(fix_peak)
    if saving is not None and saving < MIN_SAVING * ctx.demand:
        ctx.notes.append(
            f"forward AD (gradscope.strategies.mixed_grad(..., method=\"forward_ad\")) would not help here: "
            f"it peaks at {format_bytes(fix_peak)} against create_graph's {format_bytes(ctx.demand)} "
            f"({n} create_graph pass{'es' if n != 1 else ''}; forward AD through a linear layer makes a "
            "weight-sized temporary, which pays off only over several passes)"
        )
        return []
    zname = ctx.tensor_list(n, {tuple(z)}) if n > 1 else None
    yname = ctx.tensor_named(tuple(y), requires_grad=True) or "y"
    held = sum(a.bytes for a in g.alive if a.category in (Category.ACTIVATION, Category.CREATE_GRAPH))
    loop = f"for i, z in enumerate({zname})" if zname else "for i, z in enumerate(zs)"
    return [
        Finding(
            pattern="create_graph",
            bytes=held,
            variable=next((h.variable for h in ctx.holders if h.live_bytes > 0), None),
            module=root,
            message=(
                f"{n} autograd.grad call{'s' if n != 1 else ''} with create_graph=True through {name} "
                + ("(nothing recorded before the failure trains its parameters) " if runs and g.trainable(root)
                   else "(no parameter of it is trained) ")
                + f"keep {name}'s activations and the graphs they built: "
                f"{format_bytes(held)} at the peak, for a derivative taken afterwards with respect to "
                f"`{yname}`: a mixed second derivative"
                + (f"; {name}'s parameters require grad but nothing uses their gradients, so freezing "
                   f"{name} ({name}.requires_grad_(False)) is safe and forward AD applies" if unused else "")
            ),
            suggestion=(
                f"take those input gradients with gradscope.strategies.input_grad instead: the same values, "
                f"and their derivative with respect to `{yname}` pushes the direction through {name} as a "
                f"forward-AD tangent, so no graph of {name} is kept (mixed_grad(..., method=\"forward_ad\") "
                "does one such pass by hand)"
            ),
            code=(
                f'dgdy = sum(mixed_grad(f, {name}, z, {yname}, v=v[i], method="forward_ad") {loop})'
                "  # v = dg/d(dfdz) from the values of dfdz"
            ),
            saves_bytes=saving,
            uses=(name, yname),
        )
    ]


def rewrite(ctx: Context, f: Finding, source: str) -> str | None:
    """The step with each ``autograd.grad(..., create_graph=True)`` through the model made
    ``input_grad(...)``: the same values and derivative, no graph of the model kept."""
    return input_grads(source, *f.uses) if len(f.uses) == 2 else None
