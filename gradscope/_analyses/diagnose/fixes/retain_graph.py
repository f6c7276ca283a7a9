from __future__ import annotations

import torch

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import replay
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.step import without_retain_graph
from gradscope._model.recording import Category


# ----- retain_graph=True that nothing reuses ---------------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Backward calls with retain_graph=True whose graphs no later backward ran through: the
    graphs stayed alive (until their loss was dropped) for nothing."""
    g = ctx.g
    retained = [c for c in g.calls if c.retain_graph and not c.create_graph]
    if not retained or ctx.raised():
        return []
    ran = {i for i in g.nodes_run_by(retained) if g.nodes[i].name != "AccumulateGrad"}
    if not ran or any(g.nodes[i].executed > 1 for i in ran):
        return []  # a later backward reused them (penalties off one trunk, see `_penalty_branches`)
    # without retain_graph a saved tensor is freed once its node has run in backward
    ends = g.call_end_positions()
    step_end: dict[int, int] = {}
    for a in ctx.rec.allocations:
        if a.step is not None:
            step_end[a.step] = max(step_end.get(a.step, -1), a.alloc_at)
    ran_at = {st.node: k for k, st in enumerate(ctx.rec.steps)}
    free_at: dict[int, int] = {}
    for a in ctx.rec.allocations:
        if a.category is Category.ACTIVATION and a.node in ran:
            end = step_end.get(ran_at.get(a.node, -1), ends.get((g.calls_of_node.get(a.node) or [-1])[0]))
            if end is not None and (a.free_at is None or a.free_at > end):
                free_at[a.index] = end
    fix_peak = replay(ctx.rec.allocations, free_at=free_at)
    loss = next((h for h in (ctx.ns.get("loss"),) if isinstance(h, torch.Tensor)), None)
    var = "loss" if loss is not None or "loss" not in ctx.ns else "loss"
    n = len(retained)
    return [
        Finding(
            pattern="retain_graph",
            bytes=sum(a.bytes for a in g.alive if a.node in ran),
            variable=var,
            message=(
                f"{n} backward call{'s' if n != 1 else ''} used retain_graph=True and no later backward ran "
                "through those graphs: each graph's saved tensors stayed alive after its backward"
            ),
            suggestion="drop retain_graph=True: backward then frees each graph as it goes",
            code=f"{var}.backward()  # no retain_graph: nothing backpropagates through this graph again",
            saves_bytes=ctx.saving(fix_peak),
        )
    ]


def rewrite(ctx: Context, f: Finding, source: str) -> str | None:
    """The step without ``retain_graph=True``."""
    return without_retain_graph(source)
