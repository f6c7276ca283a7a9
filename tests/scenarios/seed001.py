"""Seed 001: ``L = g(f(x_1), ..., f(x_n))`` with a pretrained ``f`` that has batch norm and dropout.

Stacking keeps ``n`` graphs of ``f`` alive until ``L.backward()``. ``many_inputs_backward(...,
method="two_pass")`` keeps one, with the same gradients, dropout masks and batch-norm running
statistics. Checkpointing ``f`` looks like a fix but runs ``f``'s forward twice per input: the
running statistics move twice (what the user worried about). Per-input backward or ``.item()``
break a loss that couples all outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradscope.strategies import many_inputs_backward

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]


def _f() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.Tanh(),
        nn.Linear(256, 16),
    )


def setup_stacked() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"f": _f(), "inputs": [torch.randn(32, 32) for _ in range(16)]}


def g(zs: torch.Tensor) -> torch.Tensor:
    # couples every output: the mean and the spread across inputs
    return (zs.mean(0) ** 2).sum() + zs.var(0).mean()


# ----- the stacked loss, as the thread's first snippet ---------------------------------------
def stacked(f: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    zs = []
    for x in inputs:
        z = f(x)
        zs.append(z)
    zs = torch.stack(zs)  # type: ignore[assignment]
    L = g(zs)  # type: ignore[arg-type]  # noqa: N806
    L.backward()
    return L.detach()


def stacked_fix(f: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    return many_inputs_backward(f, inputs, g, method="two_pass")


def stacked_checkpointed(f: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Activation checkpointing of f: forward runs again in backward, batch norm counts twice."""
    zs = torch.stack([checkpoint(f, x, use_reentrant=False) for x in inputs])
    L = g(zs)  # noqa: N806
    L.backward()
    return L.detach()


def stacked_detached(f: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    """"Keep numbers, not graphs, in zs": L.backward() raises, f gets no gradient."""
    zs = torch.stack([f(x).detach() for x in inputs])
    L = g(zs)  # noqa: N806
    L.backward()
    return L.detach()


# ----- a list of losses coupled by logsumexp ------------------------------------------------------
def setup_losses() -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "f": _f(),
        "inputs": [torch.randn(32, 32) for _ in range(16)],
        "targets": [torch.randn(32, 16) for _ in range(16)],
    }


def losses_user(f: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    losses = []
    for x, t in zip(inputs, targets, strict=True):
        loss = F.mse_loss(f(x), t)
        losses.append(loss)
    L = torch.stack(losses).logsumexp(0)  # a soft maximum over the batches: couples all of them  # noqa: N806
    L.backward()
    return L.detach()


def losses_fix(f: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    def soft_max_loss(zs: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.mse_loss(z, t) for z, t in zip(zs, targets, strict=True)]).logsumexp(0)

    return many_inputs_backward(f, inputs, soft_max_loss, method="two_pass")


def losses_item(f: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """"losses.append(loss.item())": the list holds floats, the loss has no graph: raises."""
    losses = []
    for x, t in zip(inputs, targets, strict=True):
        loss = F.mse_loss(f(x), t)
        losses.append(loss.item())
    L = torch.tensor(losses).logsumexp(0)  # noqa: N806
    L.backward()
    return L.detach()


def losses_per_batch(f: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """"(loss / n).backward() on each micro-batch": the gradient of the mean, not of logsumexp."""
    total = torch.zeros(())
    for x, t in zip(inputs, targets, strict=True):
        loss = F.mse_loss(f(x), t)
        (loss / len(inputs)).backward()
        total += loss.detach()
    return total


FIX_STACKED = "L = many_inputs_backward(f, inputs, g, method=\"two_pass\")"
FIX_LOSSES = (
    "L = many_inputs_backward(f, inputs, lambda zs: torch.stack([F.mse_loss(z, t) for z, t in "
    'zip(zs, targets)]).logsumexp(0), method="two_pass")'
)

SCENARIOS = [
    Scenario(
        name="s001_stacked",
        title="seed 001: zs = stack([f(x) for x in inputs]); g(zs).backward(), f with BatchNorm and Dropout",
        origin="seed 001",
        setup=setup_stacked,
        user=stacked,
        fix=stacked_fix,
        fix_code=FIX_STACKED,
        right=(Advice("two_pass", target="f"), Advice("checkpoint_bn_exact", target="f")),
        wrong=(
            Wrong(Advice("checkpoint"), stacked_checkpointed, "changes the result",
                  "checkpointing runs f's forward again in backward: batch norm's running statistics "
                  "move twice per input (num_batches_tracked 32 instead of 16)"),
            Wrong(Advice("detach", target="zs"), stacked_detached, "changes the result",
                  "detached outputs carry no graph: L.backward() raises",
                  error="does not require grad"),
        ),
        peak_user=3362888,
        peak_fix=854980,
        budget=2097152,
    ),
    Scenario(
        name="s001_losses_logsumexp",
        title="seed 001 as a list of losses: losses.append(mse(f(x), t)); stack(losses).logsumexp(0).backward()",
        origin="seed 001",
        setup=setup_losses,
        user=losses_user,
        fix=losses_fix,
        fix_code=FIX_LOSSES,
        right=(Advice("two_pass", target="f"), Advice("checkpoint_bn_exact", target="f")),
        wrong=(
            Wrong(Advice("item", target="losses"), losses_item, "changes the result",
                  "floats carry no graph: the coupled loss cannot be back-propagated (raises)",
                  error="does not require grad"),
            Wrong(Advice("backward_per_micro_batch"), losses_per_batch, "changes the result",
                  "per-batch backward gives the gradient of the mean, not of the logsumexp that couples them"),
        ),
        peak_user=3356808,
        peak_fix=854980,
        budget=2097152,
    ),
]
