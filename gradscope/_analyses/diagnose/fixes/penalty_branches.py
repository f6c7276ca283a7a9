from __future__ import annotations

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._model.recording import format_bytes


# ----- penalties branching off a trunk ----------------------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Seed 003: terms computed from the outputs of successive models (penalties branching off
    a trunk), whose saved tensors are alive together until one backward. PenaltyBranches
    ("early") takes each penalty's gradient to its branch point at once and frees the branch."""
    g = ctx.g
    if any(c.create_graph for c in g.calls) or ctx.raised():
        return []
    branches = g.branches()
    if len(branches) < 2:
        return []
    total = sum(branches.values())
    keep = max(branches.values())
    if total - keep <= 0:
        return []
    order = g.trunk_order(list(branches))
    fix_peak = ctx.demand - (total - keep)
    lines = ['pb = PenaltyBranches("early")']
    prev = "x"
    for i, r in enumerate(order, 1):
        lines.append(f"comp{i} = {r}({prev}); pb.add(penalty{i}(comp{i}), at=comp{i})")
        prev = f"comp{i}"
    lines.append("pb.backward(main_loss)   # instead of (main_loss + penalties).backward()")
    return [
        Finding(
            pattern="penalty_branches",
            bytes=total,
            module=order[0],
            message=(
                f"{len(branches)} terms branch off the outputs of {', '.join(order)} and their saved tensors "
                f"({format_bytes(total)}) are alive together until one backward"
            ),
            suggestion=(
                "take each penalty's gradient to its branch point as soon as it is computed and free the "
                "branch (gradscope.strategies.PenaltyBranches): one branch alive at a time, the trunk "
                "traversed once, the same gradients"
            ),
            code="\n".join(lines),
            saves_bytes=ctx.saving(fix_peak),
        )
    ]
