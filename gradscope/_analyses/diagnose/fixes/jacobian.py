from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import GRAPH_CATEGORIES, numel
from gradscope._analyses.diagnose.proxies import jacobian_proxy, proxy_peak
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import create_graph_dropped
from gradscope._model.recording import format_bytes

# the suggestion names gradscope.strategies.jacobian, which the rewriting (retain_graph instead of
# create_graph) does not run: where the rewriting saves nothing, the suggestion stays, unrun
STRATEGY = True


# ----- Jacobians row by row with create_graph, read only ------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Seed 004: input gradients taken with create_graph=True that nothing differentiates
    afterwards (their graphs' nodes never ran): a Jacobian read as numbers. The graphs were
    kept for nothing; ``strategies.jacobian`` with the mode that fits the shape keeps none."""
    g = ctx.g
    cg = [c for c in g.calls if c.create_graph]
    if not cg or g.order1_executed() or ctx.raised():
        return []
    if any(c.api != "autograd.grad" or g.param_inputs(c) or len(c.inputs) != 1 for c in cg):
        return []
    if len({c.inputs[0] for c in cg}) != 1:
        return []
    shape = g.nodes[cg[0].inputs[0]].leaf_shape
    root = g.main_root(order=0)
    model = ctx.module(root)
    if shape is None or model is None or ctx.trained_by_optimizer(model):
        return []  # an optimizer trains it: the input gradients are a penalty that trains it
    if ctx.moment == "failure" and any(
            n.name == "AccumulateGrad" and n.leaf == "input" and i != cg[0].inputs[0]
            for i, n in enumerate(g.nodes)):
        return []  # another leaf feeds them: a derivative with respect to it may follow
    if len(cg) > 1:  # one row per call
        n_out, n_in = len(cg), numel(tuple(shape))
    else:  # the repeat trick: copies of x along the first dimension
        n_out, n_in = int(shape[0]), numel(tuple(shape[1:]))
    method = "jacfwd" if n_out >= n_in else "jacrev"
    name = ctx.model_name(root)
    in_shape = tuple(shape) if len(cg) > 1 else tuple(shape[1:])
    x = ctx.tensor_named(in_shape) or "x"
    own = proxy_peak(jacobian_proxy(n_in, method), model)
    if own is None:
        return []
    saving = ctx.saving(g.live_before(root) + own)  # the strategy replaces the whole computation
    held = sum(a.bytes for a in g.alive if a.category in GRAPH_CATEGORIES)
    shape_word = "tall" if method == "jacfwd" else "wide"
    return [
        Finding(
            pattern="jacobian_rows",
            bytes=held,
            module=root,
            message=(
                f"{len(cg)} autograd.grad call{'s' if len(cg) != 1 else ''} with create_graph=True took "
                f"{name}'s input gradients ({n_out} outputs x {n_in} inputs) and nothing differentiated "
                f"them afterwards: their graphs hold {format_bytes(held)} at the peak for nothing"
            ),
            suggestion=(
                "the Jacobian is only read: take its rows with retain_graph=True instead of create_graph=True "
                "(the same values; no graph of each backward is built), or compute it in "
                f"{('forward' if method == 'jacfwd' else 'reverse')} mode for this {shape_word} Jacobian "
                "with gradscope.strategies.jacobian"
            ),
            code=(
                f'J = jacobian(lambda v: {name}(v.view(1, -1)).view(-1), {x}.reshape(-1), method="{method}")'
                f"  # {n_out} x {n_in}: {shape_word}"
            ),
            saves_bytes=saving,
        )
    ]


def rewrite(ctx: Context, f: Finding, source: str) -> str | None:
    """The step with ``create_graph=True`` made ``retain_graph=True``."""
    return create_graph_dropped(source)
