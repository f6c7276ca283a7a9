"""The optimizer step in backward: one optimizer per parameter, of the user's class with its group's
arguments, stepped by a post-accumulate-grad hook as soon as that parameter's gradient is complete,
which is then freed. One gradient alive at a time instead of all of them next to the optimizer's
state; parameters that need no gradient are skipped; the optimizer's state is carried over."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, compose, statements, without
from gradscope._analyses.diagnose.toolbox._common import models

PATTERN = "optimizer_state"  # the name its finding and notes go by


def _arguments(opt: torch.optim.Optimizer) -> list[str]:
    """The constructor arguments an optimizer's param groups hold (those its class accepts) that
    differ from the class's defaults in some group, ``lr`` always."""
    sig = inspect.signature(type(opt).__init__).parameters
    out = []
    for k in opt.param_groups[0]:
        if k not in sig or k in ("self", "params"):
            continue
        default = sig[k].default
        if k == "lr" or any(not _same(g.get(k), default) for g in opt.param_groups):
            out.append(k)
    return sorted(out)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b) and type(a) is type(b) or (isinstance(a, tuple | list) and list(a) == list(b))  # type: ignore[call-overload]
    except Exception:
        return False


def _least(ctx: Context, bench: Bench, step: str, opt: torch.optim.Optimizer) -> int | None:
    """The least the fixed step's first run holds at once (see NOTE [ runs a fix needs ] in
    gradscope._analyses.diagnose.measure): its set-up makes no tensor (the per-parameter optimizers share the
    state); up to the backward call it runs the user's statements as they are; during that call it
    holds at most the parameters' gradients less than the user's step (it frees each once applied; the
    optimizer's state and temporaries it makes then only add). Not where a gradient is sparse (its
    bytes are not its parameter's)."""
    own = statements(bench.source)
    if own is None or own.backward is None:
        return None
    params = {id(p): p for group in opt.param_groups for p in group["params"] if p.requires_grad}
    for _, model in models(ctx, bench.source):
        for m in model.modules():
            if getattr(m, "sparse", False) is True and any(id(p) in params for p in m.parameters(recurse=False)):
                return None
    grads = sum(p.numel() * p.element_size() for p in params.values())
    return bench.least(step, before=own.backward, slack=grads)


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None:
        return []
    steps = shape.optimizer_calls(ctx.ns, "step")
    if len(steps) != 1:
        return []
    name = steps[0]
    opt = ctx.ns[name]
    cls = type(opt)
    where = "torch.optim." if getattr(torch.optim, cls.__name__, None) is cls else ""
    if not where:
        return []
    if any(getattr(s, "optimizer", None) is opt for s in ctx.ns.values() if not isinstance(s, torch.optim.Optimizer)):
        return []  # a learning-rate scheduler of `opt` would not reach the per-parameter optimizers
    keys = _arguments(opt)
    args = ", ".join(f"{k}=group[{k!r}]" for k in keys)
    setup = (
        "opt_of = {}\n"
        f"for group in {name}.param_groups:\n"
        "    for p in group['params']:\n"
        "        if p.requires_grad:\n"
        f"            opt_of[p] = {where}{cls.__name__}([p], {args})\n"
        f"            opt_of[p].state[p] = {name}.state[p]\n"
        "\n"
        "def step_in_backward(p):\n"
        "    opt_of[p].step()\n"
        "    opt_of[p].zero_grad()  # frees p.grad\n"
        "\n"
        "for p in opt_of:\n"
        "    p.register_post_accumulate_grad_hook(step_in_backward)\n"
    )
    step = without(shape, {(name, "step"), (name, "zero_grad")})
    code = compose(setup, step)
    trial = bench.run(step, setup=setup, least=_least(ctx, bench, step, opt))
    return [(Finding(
        pattern=PATTERN,
        bytes=0,
        variable=name,
        message=f"every gradient is alive next to {cls.__name__}'s state until {name}.step()",
        suggestion=("step each parameter in backward as soon as its gradient is complete, and free that "
                    "gradient then (one optimizer per parameter, a post-accumulate-grad hook): the same "
                    f"updates, one gradient alive at a time; the step no longer calls {name}.step() or "
                    f"{name}.zero_grad()"),
        code=code,
        setup=setup,
        step=step,
    ), trial)]
