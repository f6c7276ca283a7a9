"""A WGAN-GP discriminator step: a gradient penalty through ``D`` with ``create_graph=True``.

``create_graph`` is the point here: the penalty trains ``D`` through its own input gradient, so
forward AD (which keeps no graph of the model) or ``no_grad`` for ``D`` change the training. Done as
usual (``fake = G(z).detach()``) the step has nothing to remove. Without the ``detach`` the D step
also saves ``G``'s activations and computes ``G``'s gradients, which ``opt_G.zero_grad()`` throws
away before ``G``'s own step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]

LAMBDA_GP = 10.0


def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 128))  # noqa: N806
    D = nn.Sequential(nn.Linear(128, 256), nn.LeakyReLU(0.2), nn.Linear(256, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))  # noqa: N806
    return {
        "G": G,
        "D": D,
        "opt_G": torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9)),
        "opt_D": torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9)),
        "real": torch.randn(256, 128),
        "z": torch.randn(256, 32),
    }


def _penalty(D: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:  # noqa: N803
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
    d_interp = D(interp)
    grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean()


# ----- the usual D step --------------------------------------------------------------------------------
def d_step(G: nn.Module, D: nn.Module, opt_G: Any, opt_D: Any, real: Any, z: Any) -> torch.Tensor:  # noqa: N803
    fake = G(z).detach()
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    d_interp = D(interp)
    grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
    gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    loss_D = D(fake).mean() - D(real).mean() + LAMBDA_GP * gp  # noqa: N806
    opt_D.zero_grad()
    loss_D.backward()
    opt_D.step()
    return loss_D.detach()


def d_step_frozen_penalty(G: nn.Module, D: nn.Module, opt_G: Any, opt_D: Any, real: Any, z: Any) -> torch.Tensor:  # noqa: N803
    """Forward AD (the seed-000 strategy) keeps no graph of D for the penalty: read literally, D is
    frozen while the penalty's input gradient is taken, so the penalty no longer trains D."""
    fake = G(z).detach()
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    for p in D.parameters():
        p.requires_grad_(False)
    try:
        d_interp = D(interp)
        grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
    finally:
        for p in D.parameters():
            p.requires_grad_(True)
    gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    loss_D = D(fake).mean() - D(real).mean() + LAMBDA_GP * gp  # noqa: N806
    opt_D.zero_grad()
    loss_D.backward()
    opt_D.step()
    return loss_D.detach()


def d_step_no_grad(G: nn.Module, D: nn.Module, opt_G: Any, opt_D: Any, real: Any, z: Any) -> torch.Tensor:  # noqa: N803
    """"Run D under torch.no_grad()" for the penalty: the input gradient cannot be taken (raises)."""
    fake = G(z).detach()
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    with torch.no_grad():
        d_interp = D(interp)
    grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
    gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    loss_D = D(fake).mean() - D(real).mean() + LAMBDA_GP * gp  # noqa: N806
    opt_D.zero_grad()
    loss_D.backward()
    opt_D.step()
    return loss_D.detach()


# ----- the D step without detaching the fake batch -------------------------------------------------------
def d_step_attached(G: nn.Module, D: nn.Module, opt_G: Any, opt_D: Any, real: Any, z: Any) -> torch.Tensor:  # noqa: N803
    fake = G(z)
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
    d_interp = D(interp)
    grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
    gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    loss_D = D(fake).mean() - D(real).mean() + LAMBDA_GP * gp  # noqa: N806
    opt_D.zero_grad()
    loss_D.backward()
    opt_D.step()
    return loss_D.detach()


def d_step_attached_no_grad_d(G: nn.Module, D: nn.Module, opt_G: Any, opt_D: Any, real: Any, z: Any) -> torch.Tensor:  # noqa: N803
    """"D looks frozen, run it under torch.no_grad()": D, the model this step trains, keeps only
    the penalty's gradient."""
    fake = G(z)
    with torch.no_grad():
        d_fake, d_real = D(fake), D(real)
    loss_D = d_fake.mean() - d_real.mean() + LAMBDA_GP * _penalty(D, real, fake)  # noqa: N806
    opt_D.zero_grad()
    loss_D.backward()
    opt_D.step()
    return loss_D.detach()


_NO_GRAD_D = "D is trained by this step (also through the penalty's input gradient)"

SCENARIOS = [
    Scenario(
        name="gan_gradient_penalty",
        title="WGAN-GP: D step with autograd.grad(D(interp), interp, create_graph=True), fake = G(z).detach()",
        origin="common",
        setup=setup,
        user=d_step,
        fix=None,
        fix_code="",
        right=(),
        wrong=(
            Wrong(Advice("mixed_grad_forward_ad"), d_step_frozen_penalty, "changes the result",
                  "forward AD keeps no graph of D: the penalty stops training D"),
            Wrong(Advice("no_grad_or_freeze", target="D"), d_step_no_grad, "changes the result", _NO_GRAD_D,
                  error="does not require grad"),
        ),
        peak_user=4332564,
        peak_fix=None,
        rtol=1e-4,
    ),
    Scenario(
        name="gan_fake_not_detached",
        title="WGAN-GP D step with fake = G(z) not detached: G's graph is built and back-propagated for nothing",
        origin="common",
        setup=setup,
        user=d_step_attached,
        fix=d_step,
        fix_code="fake = G(z).detach()  # in the D step: opt_G.zero_grad() discards G's gradients anyway",
        right=(Advice("detach_output", target="G"), Advice("no_grad", target="G")),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target="D"), d_step_attached_no_grad_d, "changes the result",
                  _NO_GRAD_D),
        ),
        ignore={"G.*.grad": "opt_G.zero_grad() clears G's gradients before G's own step reads them"},
        peak_user=5381140,
        peak_fix=4332564,
        budget=4856832,
        rtol=1e-4,
    ),
]
