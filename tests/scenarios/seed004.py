"""Seed 004: Jacobians of a small network, built the way the thread builds them.

Row by row with ``create_graph=True`` (``_rev_jacobian_simple``) every row's backward graph stays
alive in ``J``; the repeat trick (``_rev_jacobian``) runs the network on ``n_outputs`` copies of
``x`` and keeps the create_graph graph of all of them. When ``J`` is only read, ``strategies.jacobian``
with the method that fits the shape (forward mode for tall Jacobians, reverse for wide ones) gives the
same matrix without keeping any graph. (``net.requires_grad_(False)`` is harmless there, since only
``x`` is differentiated, and lowers the peak of the row loop from 1.61 to 1.09 MB; ``jacobian`` lowers
it to 0.55 MB.) When ``J`` is differentiated further (a Jacobian penalty
that trains the network) ``create_graph`` is needed: nothing to remove, and ``jacobian(...)``
(detached) would silently drop the penalty's gradient. The network is always differentiated: no
``no_grad`` for it; the seed-000 strategy (``mixed_grad``) computes another quantity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gradscope.strategies import jacobian, mixed_grad

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]


class Net(nn.Module):
    """The thread's two-layer network: x -> fc1 -> relu -> fc2."""

    def __init__(self, n_in: int, hidden: int, n_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# ----- tall: rows in a loop, create_graph=True, J only read ---------------------------------------
def setup_tall() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"net": Net(16, 256, 512), "x": torch.randn(16)}


def rows(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n_outputs = 512
    xd = x.detach()
    xd.requires_grad_(True)
    n_inputs = int(xd.size(0))
    y = net(xd.view(1, n_inputs)).view(n_outputs)
    I = torch.eye(n_outputs)  # noqa: E741, N806
    J = torch.zeros([n_outputs, n_inputs])  # noqa: N806
    for i in range(n_outputs):
        J[i, :] = torch.autograd.grad(y, xd, grad_outputs=I[i], retain_graph=True, create_graph=True)[0]
    return J


def rows_fix(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return jacobian(lambda v: net(v.view(1, -1)).view(-1), x, method="jacfwd")


def rows_no_grad(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """"Run net under torch.no_grad()": y does not depend on x; autograd.grad raises."""
    xd = x.detach().requires_grad_(True)
    with torch.no_grad():
        y = net(xd.view(1, -1)).view(-1)
    J = torch.zeros([y.numel(), xd.numel()])  # noqa: N806
    for i in range(y.numel()):
        J[i, :] = torch.autograd.grad(y[i], xd, retain_graph=True, create_graph=True)[0]
    return J


def jac_mixed_grad(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The seed-000 strategy read literally (G = net, z = y = x, f = sum of the output): a
    vector shaped like x, not the Jacobian."""
    y = x.detach().clone().view(1, -1).requires_grad_(True)
    out = mixed_grad(lambda y, g: g.sum() + 0 * y.sum(), net, x.view(1, -1), y, method="forward_ad")
    assert out is not None
    return out


# ----- the repeat trick: n_outputs copies of x, one batched backward with create_graph ----------
def setup_repeat() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"net": Net(32, 512, 256), "x": torch.randn(1, 32)}


def repeat_trick(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n_outputs = 256
    repear_arg = (n_outputs,) + (1,) * len(x.size())
    xr = x.repeat(*repear_arg)
    xr.requires_grad_(True)
    y = net(xr).view(n_outputs, -1)
    I = torch.eye(n_outputs, device=xr.device)  # noqa: E741, N806
    J = torch.autograd.grad(y, xr, grad_outputs=I, retain_graph=True, create_graph=True)  # noqa: N806
    return J[0]


def repeat_fix(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return jacobian(net, x, method="jacfwd").view(256, 1, 32)


def repeat_no_grad(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """"Run net under torch.no_grad()": autograd.grad raises."""
    xr = x.repeat(256, 1, 1).requires_grad_(True)
    with torch.no_grad():
        y = net(xr).view(256, -1)
    return torch.autograd.grad(y, xr, grad_outputs=torch.eye(256), create_graph=True)[0]


# ----- a Jacobian penalty that trains the network: create_graph is the point ------------------------
def setup_penalty() -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net(16, 256, 8)
    return {
        "net": net,
        "x": torch.randn(64, 16),
        "t": torch.randn(64, 8),
        "opt": torch.optim.SGD(net.parameters(), lr=0.1),
    }


def penalty(net: nn.Module, x: torch.Tensor, t: torch.Tensor, opt: Any) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    out = net(x)
    rows = [torch.autograd.grad(out[:, i].sum(), x, create_graph=True)[0] for i in range(out.shape[1])]
    jac_norm = sum(r.pow(2).sum() for r in rows) / x.shape[0]
    loss = F.mse_loss(out, t) + 0.01 * jac_norm
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def penalty_jacobian(net: nn.Module, x: torch.Tensor, t: torch.Tensor, opt: Any) -> torch.Tensor:
    """strategies.jacobian (detached): the penalty no longer trains the network."""
    out = net(x)
    J = jacobian(net, x, method="jacrev", batch_dim=0)  # noqa: N806
    loss = F.mse_loss(out, t) + 0.01 * J.pow(2).sum() / x.shape[0]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def penalty_no_grad(net: nn.Module, x: torch.Tensor, t: torch.Tensor, opt: Any) -> torch.Tensor:
    """"net under torch.no_grad()": nothing to differentiate; raises."""
    x = x.detach().requires_grad_(True)
    with torch.no_grad():
        out = net(x)
    rows = [torch.autograd.grad(out[:, i].sum(), x, create_graph=True)[0] for i in range(out.shape[1])]
    loss = F.mse_loss(out, t) + 0.01 * sum(r.pow(2).sum() for r in rows) / x.shape[0]
    loss.backward()
    return loss.detach()


def penalty_mixed_grad(net: nn.Module, x: torch.Tensor, t: torch.Tensor, opt: Any) -> torch.Tensor:
    """The seed-000 strategy keeps no graph of net: read literally, the penalty's gradient with
    respect to net's weights is lost (net frozen while the Jacobian is taken)."""
    x = x.detach().requires_grad_(True)
    out = net(x)
    for p in net.parameters():
        p.requires_grad_(False)
    try:
        xx = x.detach().requires_grad_(True)
        o2 = net(xx)
        rows = [torch.autograd.grad(o2[:, i].sum(), xx, create_graph=True)[0] for i in range(o2.shape[1])]
    finally:
        for p in net.parameters():
            p.requires_grad_(True)
    loss = F.mse_loss(out, t) + 0.01 * sum(r.pow(2).sum() for r in rows) / x.shape[0]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


SCENARIOS = [
    Scenario(
        name="s004_rows_tall",
        title="seed 004: J[i, :] = autograd.grad(y, x, I[i], retain_graph=True, create_graph=True) for 512 rows, 16 inputs",
        origin="seed 004",
        setup=setup_tall,
        user=rows,
        fix=rows_fix,
        fix_code='J = jacobian(lambda v: net(v.view(1, -1)).view(-1), x, method="jacfwd")  # 512 x 16: tall, forward mode',
        right=(Advice("jacobian", target="net"), Advice("drop_create_graph")),
        wrong=(
            Wrong(Advice("no_grad", target="net"), rows_no_grad, "changes the result",
                  "the Jacobian is net's derivative: without its graph autograd.grad raises",
                  error="does not require grad"),
            Wrong(Advice("mixed_grad_forward_ad"), jac_mixed_grad, "changes the result",
                  "mixed_grad computes a mixed second derivative shaped like its y, not a Jacobian"),
        ),
        peak_user=1609728,
        peak_fix=546820,
        budget=1300 * 1024,  # the eye (1 MiB) fits; the rows kept by create_graph do not
    ),
    Scenario(
        name="s004_repeat_trick",
        title="seed 004: the repeat trick: 256 copies of x, autograd.grad(y, xr, grad_outputs=I, create_graph=True)",
        origin="seed 004",
        setup=setup_repeat,
        user=repeat_trick,
        fix=repeat_fix,
        fix_code='J = jacobian(net, x, method="jacfwd")  # 256 outputs, 32 inputs: tall, forward mode',
        right=(Advice("jacobian", target="net"), Advice("drop_create_graph")),
        wrong=(
            Wrong(Advice("no_grad", target="net"), repeat_no_grad, "changes the result",
                  "the Jacobian is net's derivative: without its graph autograd.grad raises",
                  error="does not require grad"),
            Wrong(Advice("mixed_grad_forward_ad"), jac_mixed_grad, "changes the result",
                  "mixed_grad computes a mixed second derivative shaped like its y, not a Jacobian"),
        ),
        peak_user=2129920,
        peak_fix=598020,
        budget=1167360,
    ),
    Scenario(
        name="s004_jacobian_penalty",
        title="seed 004 trained: loss = mse + 0.01 * |dnet/dx|^2 with rows by create_graph, then opt.step()",
        origin="seed 004",
        setup=setup_penalty,
        user=penalty,
        fix=None,
        fix_code="",
        right=(),
        wrong=(
            Wrong(Advice("jacobian"), penalty_jacobian, "changes the result",
                  "strategies.jacobian returns a detached matrix: the penalty stops training net"),
            Wrong(Advice("no_grad_or_freeze", target="net"), penalty_no_grad, "changes the result",
                  "net is trained by this loss: no_grad leaves nothing to differentiate (raises)",
                  error="does not require grad"),
            Wrong(Advice("mixed_grad_forward_ad"), penalty_mixed_grad, "changes the result",
                  "forward AD keeps no graph of net: the penalty's gradient for net's weights is lost"),
        ),
        peak_user=821260,
        peak_fix=None,
        rtol=1e-4,
    ),
]
