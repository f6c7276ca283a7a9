from __future__ import annotations

from gradscope.diagnose.facts import Context
from gradscope.diagnose.report import Finding, GraphHolder
from gradscope.recording import Category, Phase, format_bytes


# ----- gradients alive while the optimizer steps -----------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """The peak is in the optimizer step with every gradient alive next to optimizer state larger
    than the gradients (Adam's two moments): stepping each parameter in backward, as soon as its
    gradient is complete, keeps one gradient alive at a time."""
    allocs = ctx.rec.allocations
    if ctx.moment == "failure":
        phase = allocs[-1].phase if len(allocs) else None
    else:
        phase = ctx.rec.peak.phase if ctx.rec.peak is not None else None
    if phase is not Phase.OPTIMIZER:
        return []
    alive = ctx.g.alive
    grads = [a.bytes for a in alive if a.category is Category.GRADIENT]
    state = sum(a.bytes for a in alive if a.category is Category.OPTIMIZER)
    if not grads or state <= sum(grads):
        return []
    name, opt = ctx.optimizers[0] if ctx.optimizers else ("opt", None)
    kind = type(opt).__name__ if opt is not None else "Adam"
    fix_peak = ctx.demand - (sum(grads) - max(grads))
    model = ctx.g.main_root(order=0)
    mname = ctx.model_name(model)
    return [
        Finding(
            pattern="optimizer_state",
            bytes=state + sum(grads),
            variable=name,
            message=(
                f"the peak is in {name}.step(): {kind}'s state ({format_bytes(state)}) and every gradient "
                f"({format_bytes(sum(grads))}) are alive together"
            ),
            suggestion=(
                "step each parameter in backward as soon as its gradient is complete and free the gradient "
                "then (one optimizer per parameter, a post-accumulate-grad hook): one gradient alive at a time, "
                "the same updates"
            ),
            code=(
                f"opts = {{p: torch.optim.{kind}([p], **{name}.defaults) for p in {mname}.parameters()}}\n"
                f"for p in {mname}.parameters(): p.register_post_accumulate_grad_hook("
                "lambda p: (opts[p].step(), opts[p].zero_grad()))   # then no opt.step()"
            ),
            saves_bytes=ctx.saving(fix_peak),
        )
    ]
