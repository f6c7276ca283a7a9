"""Seed 002: the gradient of a validation loss with respect to ``A`` through training steps of a model.

The user updated the parameters in place under ``torch.no_grad()`` (what ``optimizer.step()`` does):
that cuts ``A`` out of the graph, and ``autograd.grad(loss3, A)`` raises "One of the differentiated
Tensors appears to not have been used in the graph" (``None`` with ``allow_unused=True``). The fix
unrolls the steps out of place (``hypergradient`` / ``unrolled_params``). The model is differentiated
through: ``no_grad`` or freezing it, or forward AD as for seed 000, give another number or raise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from gradscope.strategies import hypergradient, mixed_grad

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]

LR = 0.1


def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model1": nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)),
        "A": torch.rand(64, requires_grad=True),  # one weight per training sample
        "x_train": torch.randn(64, 8),
        "t_train": torch.randn(64, 1),
        "x_val": torch.randn(64, 8),
        "t_val": torch.randn(64, 1),
    }


# ----- the user's code: in-place update under no_grad ------------------------------------------
def inplace(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    for _ in range(2):
        loss1 = (A * ((model1(x_train) - t_train) ** 2).squeeze(1)).mean()
        model1.zero_grad()
        loss1.backward(inputs=list(model1.parameters()), retain_graph=True, create_graph=True)
        with torch.no_grad():
            for p in model1.parameters():
                if p.grad is not None:
                    p.copy_(p - LR * p.grad)
    loss3 = ((model1(x_val) - t_val) ** 2).mean()
    A_grad = torch.autograd.grad(loss3, A)[0]  # noqa: N806 - raises: A is not in loss3's graph
    return A_grad


def inplace_fix(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    def train_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return (A * ((functional_call(model1, p, (x_train,)) - t_train) ** 2).squeeze(1)).mean()

    def val_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((functional_call(model1, p, (x_val,)) - t_val) ** 2).mean()

    return hypergradient(model1, A, train_loss, val_loss, steps=2, optimizer="sgd", lr=LR)


FIX_CODE = (
    "A_grad = hypergradient(model1, A, train_loss, val_loss, steps=2, optimizer=\"sgd\", lr=0.1)  "
    "# train_loss(p) / val_loss(p) call torch.func.functional_call(model1, p, (x,))"
)


def reference(steps: int) -> Any:
    """An independent computation: the same steps written out with explicit weight tensors."""

    def ref(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
        ws = [p.detach().clone().requires_grad_(True) for p in model1.parameters()]

        def net(w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x @ w[0].T + w[1])
            h = torch.tanh(h @ w[2].T + w[3])
            return h @ w[4].T + w[5]

        for _ in range(steps):
            loss = (A * ((net(ws, x_train) - t_train) ** 2).squeeze(1)).mean()
            grads = torch.autograd.grad(loss, ws, create_graph=True)
            ws = [w - LR * gr for w, gr in zip(ws, grads, strict=True)]
        return torch.autograd.grad(((net(ws, x_val) - t_val) ** 2).mean(), A)[0]

    return ref


def inplace_allow_unused(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    """"Set allow_unused=True": no error, and no gradient (None)."""
    for _ in range(2):
        loss1 = (A * ((model1(x_train) - t_train) ** 2).squeeze(1)).mean()
        model1.zero_grad()
        loss1.backward(inputs=list(model1.parameters()), retain_graph=True, create_graph=True)
        with torch.no_grad():
            for p in model1.parameters():
                if p.grad is not None:
                    p.copy_(p - LR * p.grad)
    loss3 = ((model1(x_val) - t_val) ** 2).mean()
    return torch.autograd.grad(loss3, A, allow_unused=True)[0]


def forward_ad(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    """The seed-000 strategy read literally (f = the weighted training loss, G = model1, z = x_train,
    y = A): d/dA <1, d loss1/dx_train>, a number shaped like A that is not the hypergradient."""

    def f(a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return (a * ((out - t_train) ** 2).squeeze(1)).mean()

    return mixed_grad(f, model1, x_train, A, method="forward_ad")


# ----- the user's own unroll (correct): memory grows with the steps, nothing to remove -------------
def unrolled(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    params = dict(model1.named_parameters())
    for _ in range(3):
        loss1 = (A * ((functional_call(model1, params, (x_train,)) - t_train) ** 2).squeeze(1)).mean()
        grads = torch.autograd.grad(loss1, list(params.values()), create_graph=True)
        params = {n: p - LR * gr for (n, p), gr in zip(params.items(), grads, strict=True)}
    loss3 = ((functional_call(model1, params, (x_val,)) - t_val) ** 2).mean()
    return torch.autograd.grad(loss3, A)[0]


def unrolled_frozen(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
    """"model1.requires_grad_(False)": the inner gradients cannot be taken (raises)."""
    model1.requires_grad_(False)
    return unrolled(model1, A, x_train, t_train, x_val, t_val)


SCENARIOS = [
    Scenario(
        name="s002_inplace_update",
        title="seed 002: two training steps updated in place under no_grad, then autograd.grad(val_loss, A)",
        origin="seed 002",
        setup=setup,
        user=inplace,
        fix=inplace_fix,
        fix_code=FIX_CODE,
        reference=reference(2),
        user_error="appears to not have been used in the graph",
        right=(Advice("hypergradient", target="model1"),),
        wrong=(
            Wrong(Advice("mixed_grad_forward_ad"), forward_ad, "changes the result",
                  "forward AD through model1 as in seed 000 computes d/dA <1, d loss1/dx>, not d loss3/dA"),
        ),
        ignore={"model1": "the fix unrolls copies of model1's parameters; the user's in-place training "
                          "changed model1 itself, which is not the quantity asked for (d loss3 / dA)"},
        peak_user=1126920,
        peak_fix=2558816,
        notes="the user's code raises; the ground truth is an independent unroll with explicit weights. "
              "allow_unused=True (the error's own hint) returns None: see inplace_allow_unused()",
    ),
    Scenario(
        name="s002_unrolled",
        title="seed 002 done right by hand: 3 unrolled SGD steps with create_graph, then d val_loss / dA",
        origin="seed 002",
        setup=setup,
        user=unrolled,
        fix=None,
        fix_code="",
        reference=reference(3),
        right=(),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target="model1"), unrolled_frozen, "changes the result",
                  "model1's parameters are differentiated (inner gradients): freezing them raises",
                  error="does not require grad"),
            Wrong(Advice("mixed_grad_forward_ad"), forward_ad, "changes the result",
                  "forward AD through model1 computes another quantity (see s002_inplace_update)"),
        ),
        peak_user=2925692,
        peak_fix=None,
    ),
]
