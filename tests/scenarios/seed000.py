"""Seed 000: ``d g(dfdz, x) / dy`` with ``dfdz_i = d f(y, G(z_i)) / dz_i`` through a pretrained ``G``.

The user's loop keeps, for every ``z_i``, the graph of ``G(z_i)`` and the graph its create_graph
backward made. Forward AD (``mixed_grad(..., method="forward_ad")``) pushes the direction through
``G`` as a tangent instead and keeps no graph of ``G``; for a general ``g`` the direction is
``v = dg/d(dfdz)``, computed once from the values of ``dfdz``. With a single batch of ``z`` forward
AD costs more than it saves (forward AD through ``nn.Linear`` allocates a weight-sized temporary).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradscope.strategies import mixed_grad

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]


def f(y: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    return ((g_out * y).tanh() ** 2).sum()


def g(dfdz: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (dfdz * x).sum() ** 2 / 1000


def _generator() -> nn.Module:
    # the G: 16 -> 256 -> 512 -> 1024, pretrained (frozen)
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 1024))  # noqa: N806
    return G.requires_grad_(False)


def _setup(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    G = _generator()  # noqa: N806
    y = torch.randn(1024, requires_grad=True)
    zs = [torch.randn(8, 16) for _ in range(n)]
    x = torch.randn(8, 16)
    return {"G": G, "y": y, "zs": zs, "x": x}


def setup_many() -> dict[str, Any]:
    return _setup(32)


def setup_one() -> dict[str, Any]:
    return _setup(1)


# ----- the user's code (the thread's loop, scaled down) ----------------------------------------
def user(G: Any, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:  # noqa: N803
    dfdz = []
    for z in zs:
        z.requires_grad_(True)
        dfdz.append(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0])
    t = g(torch.stack(dfdz), x)
    dgdy = torch.autograd.grad(t, y)[0]
    return dgdy


# ----- the right fix: forward AD through G, with v = dg/d(dfdz) ---------------------------------
def fix(G: Any, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:  # noqa: N803
    dfdz = [torch.autograd.grad(f(y, G(z.requires_grad_(True))), z)[0] for z in zs]  # values only
    D = torch.stack(dfdz).requires_grad_(True)  # noqa: N806
    v = torch.autograd.grad(g(D, x), D)[0]
    dgdy = sum(mixed_grad(f, G, z, y, v=v[i], method="forward_ad") for i, z in enumerate(zs))
    return dgdy  # type: ignore[return-value]


FIX_CODE = (
    "dfdz = [torch.autograd.grad(f(y, G(z.requires_grad_())), z)[0] for z in zs]  # values only\n"
    "D = torch.stack(dfdz).requires_grad_(); v = torch.autograd.grad(g(D, x), D)[0]\n"
    'dgdy = sum(mixed_grad(f, G, z, y, v=v[i], method="forward_ad") for i, z in enumerate(zs))'
)


# ----- wrong advice -----------------------------------------------------------------------------
def split(G: Any, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> Any:  # noqa: N803
    """The thread's two-step attempt (df/dG with create_graph, then the chain rule without):
    the dependency of dfdz on y is cut; autograd.grad(t, y) raises."""
    dfdz = []
    for z in zs:
        z.requires_grad_(True)
        out = G(z)
        leaf = out.detach().requires_grad_(True)
        dfdg = torch.autograd.grad(f(y, leaf), leaf, create_graph=True)[0]
        dfdz.append(torch.autograd.grad(out, z, grad_outputs=dfdg)[0])
    t = g(torch.stack(dfdz), x)
    return torch.autograd.grad(t, y)[0]


def no_grad_G(G: Any, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> Any:  # noqa: N802, N803
    """"Run G under torch.no_grad()": G(z) no longer depends on z; autograd.grad raises."""
    dfdz = []
    for z in zs:
        z.requires_grad_(True)
        with torch.no_grad():
            out = G(z)
        dfdz.append(torch.autograd.grad(f(y, out), z, create_graph=True)[0])
    t = g(torch.stack(dfdz), x)
    return torch.autograd.grad(t, y)[0]


def detach_dfdz(G: Any, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> Any:  # noqa: N803
    """"Keep numbers, not graphs, in dfdz": t no longer depends on y; autograd.grad raises."""
    dfdz = []
    for z in zs:
        z.requires_grad_(True)
        dfdz.append(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0].detach())
    t = g(torch.stack(dfdz), x)
    return torch.autograd.grad(t, y)[0]


SCENARIOS = [
    Scenario(
        name="s000_many_z",
        title="seed 000: dfdz.append(autograd.grad(f(y, G(z_i)), z_i, create_graph=True)) for 32 z_i, then d g(dfdz, x)/dy",
        origin="seed 000",
        setup=setup_many,
        user=user,
        fix=fix,
        fix_code=FIX_CODE,
        right=(Advice("mixed_grad_forward_ad", target="G"),),
        wrong=(
            Wrong(Advice("no_grad", target="G"), no_grad_G, "changes the result",
                  "G(z) under no_grad no longer depends on z: autograd.grad raises",
                  error="appears to not have been used in the graph"),
            Wrong(Advice("detach", target="dfdz"), detach_dfdz, "changes the result",
                  "detached dfdz no longer depend on y: autograd.grad(t, y) raises",
                  error="does not require grad"),
            Wrong(Advice("item", target="dfdz"), detach_dfdz, "changes the result",
                  "numbers in dfdz carry no dependency on y (same as detach)",
                  error="does not require grad"),
        ),
        peak_user=5910664,
        peak_fix=385032,
        budget=3145728,
        notes="the thread's own split attempt (method='split') raises as well; see split()",
    ),
    Scenario(
        name="s000_one_z",
        title="seed 000 with N = 1: one batch of 8 z through G, create_graph, d g/dy",
        origin="seed 000",
        setup=setup_one,
        user=user,
        fix=None,
        fix_code="",
        right=(),
        wrong=(
            Wrong(Advice("mixed_grad_forward_ad", target="G"), fix, "raises the peak",
                  "for one batch, forward AD's tangents cost more than the graph create_graph keeps "
                  "(333,320 against 291,340 bytes)", peak=333320),
            Wrong(Advice("no_grad", target="G"), no_grad_G, "changes the result",
                  "G(z) under no_grad no longer depends on z: autograd.grad raises",
                  error="appears to not have been used in the graph"),
        ),
        peak_user=291340,
        peak_fix=None,
    ),
]
