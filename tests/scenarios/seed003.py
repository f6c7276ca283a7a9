"""Seed 003: penalties that branch off a trunk ``f1 -> f2 -> f3``, whose weights are trained.

``loss = accuracy + sum alpha * penalty_k``: each penalty's branch keeps its own saved tensors until
the one backward at the end. ``PenaltyBranches("early")`` takes each penalty's gradient to its branch
point at once and frees the branch; the trunk is traversed once. ``f1``, ``f2``, ``f3`` are trained
(their gradients are the result): ``torch.no_grad()`` on them removes the training signal.
K. Frank's answer (``penalty.backward(retain_graph=True)``, then drop the penalty) already frees each
branch; summing the losses into one backward there keeps every branch alive again (a higher peak).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gradscope.strategies import PenaltyBranches

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]

ALPHA = 0.1


def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "f1": nn.Sequential(nn.Linear(128, 128), nn.Tanh()),
        "f2": nn.Sequential(nn.Linear(128, 128), nn.Tanh()),
        "f3": nn.Sequential(nn.Linear(128, 128), nn.Tanh()),
        "x": torch.randn(128, 128),
        "target": torch.randn(128, 128),
        "P": torch.randn(128, 2048) / 16,  # the penalty's fixed projection
    }


def calc_penalty(comp: torch.Tensor, P: torch.Tensor) -> torch.Tensor:  # noqa: N803
    p_a = torch.sigmoid(comp @ P)
    p_b = p_a * torch.log(p_a)
    return -p_b.mean()


# ----- the user's original: one joint backward ---------------------------------------------------
def joint(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    comp1 = f1(x)
    penalty1 = calc_penalty(comp1, P)
    comp2 = f2(comp1)
    penalty2 = calc_penalty(comp2, P)
    comp3 = f3(comp2)
    penalty3 = calc_penalty(comp3, P)
    accuracy = F.mse_loss(comp3, target)
    loss = accuracy + ALPHA * (penalty1 + penalty2 + penalty3)
    loss.backward()
    return loss.detach()


def early(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    pb = PenaltyBranches("early")
    comp1 = f1(x)
    pb.add(ALPHA * calc_penalty(comp1, P), at=comp1)
    comp2 = f2(comp1)
    pb.add(ALPHA * calc_penalty(comp2, P), at=comp2)
    comp3 = f3(comp2)
    pb.add(ALPHA * calc_penalty(comp3, P), at=comp3)
    accuracy = F.mse_loss(comp3, target)
    return pb.backward(accuracy)


FIX_CODE = (
    'pb = PenaltyBranches("early")\n'
    "comp1 = f1(x); pb.add(alpha * calc_penalty(comp1), at=comp1)\n"
    "comp2 = f2(comp1); pb.add(alpha * calc_penalty(comp2), at=comp2)   # ... one add per penalty\n"
    "pb.backward(accuracy)"
)


def joint_no_grad(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    """"Run f1 under torch.no_grad()": f1 gets no gradient at all."""
    with torch.no_grad():
        comp1 = f1(x)
    penalty1 = calc_penalty(comp1, P)
    comp2 = f2(comp1)
    penalty2 = calc_penalty(comp2, P)
    comp3 = f3(comp2)
    penalty3 = calc_penalty(comp3, P)
    loss = F.mse_loss(comp3, target) + ALPHA * (penalty1 + penalty2 + penalty3)
    loss.backward()
    return loss.detach()


def joint_item(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    """"Keep the penalties as numbers (.item())": their gradients are gone."""
    comp1 = f1(x)
    penalty1 = calc_penalty(comp1, P).item()
    comp2 = f2(comp1)
    penalty2 = calc_penalty(comp2, P).item()
    comp3 = f3(comp2)
    penalty3 = calc_penalty(comp3, P).item()
    loss = F.mse_loss(comp3, target) + ALPHA * (penalty1 + penalty2 + penalty3)
    loss.backward()
    return loss.detach()


# ----- K. Frank's answer: backward each penalty with retain_graph, then drop it -------------------
def frank(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    comp1 = f1(x)
    penalty1 = ALPHA * calc_penalty(comp1, P)
    penalty1.backward(retain_graph=True)  # preserve the graph through f1
    total = penalty1.detach()
    penalty1 = None  # release penalty1's branch
    comp2 = f2(comp1)
    penalty2 = ALPHA * calc_penalty(comp2, P)
    penalty2.backward(retain_graph=True)
    total = total + penalty2.detach()
    penalty2 = None
    comp3 = f3(comp2)
    penalty3 = ALPHA * calc_penalty(comp3, P)
    penalty3.backward(retain_graph=True)
    total = total + penalty3.detach()
    penalty3 = None
    loss = F.mse_loss(comp3, target)
    loss.backward()
    return total + loss.detach()


def frank_summed(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    """"Sum the losses and call backward once": every branch is alive until that backward."""
    return joint(f1, f2, f3, x, target, P)


# ----- the same with the penalties kept in variables (retain_graph keeps their branches) -------
def kept(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    comp1 = f1(x)
    penalty1 = ALPHA * calc_penalty(comp1, P)
    penalty1.backward(retain_graph=True)
    comp2 = f2(comp1)
    penalty2 = ALPHA * calc_penalty(comp2, P)
    penalty2.backward(retain_graph=True)
    comp3 = f3(comp2)
    penalty3 = ALPHA * calc_penalty(comp3, P)
    penalty3.backward(retain_graph=True)
    loss = F.mse_loss(comp3, target)
    loss.backward()
    return (loss + penalty1 + penalty2 + penalty3).detach()


def kept_no_grad(f1: nn.Module, f2: nn.Module, f3: nn.Module, x: Any, target: Any, P: Any) -> torch.Tensor:  # noqa: N803
    """"Run f1 under torch.no_grad()": penalty1 has no graph, its backward raises."""
    with torch.no_grad():
        comp1 = f1(x)
    penalty1 = ALPHA * calc_penalty(comp1, P)
    penalty1.backward(retain_graph=True)
    return kept(f1, f2, f3, x, target, P)


_NO_GRAD_WHY = "f1, f2, f3 are trained: their weight gradients are the result; no_grad removes them"

SCENARIOS = [
    Scenario(
        name="s003_joint",
        title="seed 003: loss = accuracy + alpha * (penalty1 + penalty2 + penalty3) off a trained trunk f1 -> f2 -> f3",
        origin="seed 003",
        setup=setup,
        user=joint,
        fix=early,
        fix_code=FIX_CODE,
        right=(Advice("penalty_branches"),),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target=("f1", "f2", "f3")), joint_no_grad, "changes the result", _NO_GRAD_WHY),
            Wrong(Advice("item"), joint_item, "changes the result",
                  "penalties kept as numbers no longer train f1, f2, f3"),
        ),
        peak_user=9764888,
        peak_fix=5570572,
        budget=7864320,
        rtol=1e-4,
    ),
    Scenario(
        name="s003_retain_released",
        title="seed 003, K. Frank's answer: penalty.backward(retain_graph=True), then penalty = None",
        origin="seed 003",
        setup=setup,
        user=frank,
        fix=None,
        fix_code="",
        right=(),
        wrong=(
            Wrong(Advice("sum_losses"), frank_summed, "raises the peak",
                  "one backward over the summed losses keeps every penalty branch alive until it runs",
                  peak=9764888),
            Wrong(Advice("no_grad_or_freeze", target=("f1", "f2", "f3")), joint_no_grad, "changes the result", _NO_GRAD_WHY),
        ),
        peak_user=5571604,
        peak_fix=None,
        rtol=1e-4,
        notes="each branch is freed as soon as its penalty is dropped: nothing left to save in memory "
              "(PenaltyBranches would still traverse the trunk once instead of four times)",
    ),
    Scenario(
        name="s003_retain_kept",
        title="seed 003: penalty_k.backward(retain_graph=True) with the penalties kept in variables",
        origin="seed 003",
        setup=setup,
        user=kept,
        fix=early,
        fix_code=FIX_CODE,
        right=(Advice("penalty_branches"),),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target=("f1", "f2", "f3")), kept_no_grad, "changes the result", _NO_GRAD_WHY,
                  error="does not require grad"),
        ),
        peak_user=9765928,
        peak_fix=5570572,
        budget=7864320,
        rtol=1e-4,
    ),
]
