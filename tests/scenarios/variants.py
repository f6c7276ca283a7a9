"""Generated variants of every diagnosis scenario family (issue 28): the same mistake at other sizes,
with pretrained parts frozen or left trainable, the failure caught inside the block or not, under no
budget, a tight one or a very tight one, with memory held by earlier "cells", and written as a script
(statements inside ``with gs.record(...)``), as a function called inside the block, or as a notebook
cell run through IPython's ``run_cell`` with ``%%gradscope``.

A family is the user's code as source text (the statements a user writes, in the user's names), a
setup built from size parameters, the right fix as a function of the same variables, and the advice
of the hand-written scenario it generalizes (``right`` / ``wrong`` of ``SCENARIOS[base]``).

NOTE [ a variant's ground truth ]: the user's code and the fix run on fresh, seeded copies of the
variables under ``gs.record(memory="tracker")``: their results are compared (``same_results``) and
their tracker peaks give the budgets (tight: a quarter of the saving below the user's peak; very
tight: an eighth of it above the fix's peak), so that the user's code fails and the fix fits by
construction, on the same bytes the simulated device counts.
"""

from __future__ import annotations

import contextlib
import functools
import io
import linecache
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import gradscope as gs
from gradscope.strategies import PenaltyBranches, hypergradient, jacobian, many_inputs_backward, mixed_grad

from . import SCENARIOS, gan, seed000, seed001, seed002, seed003, seed004, training
from ._harness import Advice, outcome, same_results

__all__ = ["BUDGETS", "FAMILIES", "FORMS", "VARIANTS", "Family", "Ran", "Truth", "Variant", "budget_of", "ground_truth", "run_code",
           "run_variant", "same"]

FORMS = ("script", "function", "notebook")
BUDGETS = ("none", "tight", "very tight")
RESIDENT = 2 * 1024 * 1024  # bytes an earlier cell keeps alive (a tensor in the namespace)


@dataclass(frozen=True)
class Family:
    """One scenario family: the user's statements, sized setups, the right fix.

    ``body`` is the user's code as statements over the setup's variables; ``result`` the variable
    it leaves that the user reads (None: the results are the variables' own state, parameters,
    gradients, buffers). ``catches`` is the error a user would catch around the failing call.
    ``fix(**state)`` returns the value of ``result``. ``frozen`` names the pretrained model whose
    ``requires_grad_`` a variant sets; ``frozen_is_fine`` says that once it is frozen nothing is
    left to fix.
    """

    name: str
    base: str  # the hand-written scenario whose advice this family generalizes
    body: str
    setup: Callable[..., dict[str, Any]]
    sizes: tuple[Mapping[str, int], ...]
    fix: Callable[..., Any]
    result: str | None = None
    helpers: Mapping[str, Any] = field(default_factory=dict)
    catches: str = "torch.OutOfMemoryError"
    memory: bool = True  # a fix of memory: budgets apply
    toolbox: bool = False  # the right fix is one of the toolbox's: asked for at the peak too (toolbox=True)
    nothing: bool = False  # nothing to fix (``fix`` is the user's code as a function): the right answer is no finding
    reference: Callable[..., Any] | None = None
    user_error: str | None = None
    frozen: str | None = None
    frozen_is_fine: bool = False
    ignore: Mapping[str, str] = field(default_factory=dict)
    rtol: float = 1e-4
    atol: float = 1e-6

    @property
    def right(self) -> tuple[Advice, ...]:
        return SCENARIOS[self.base].right

    @property
    def wrong(self) -> tuple[Advice, ...]:
        return tuple(w.advice for w in SCENARIOS[self.base].wrong)


@dataclass(frozen=True)
class Variant:
    family: Family
    size: int  # index into family.sizes
    form: str = "script"
    budget: str = "none"
    caught: bool = False
    resident: bool = False
    frozen: bool | None = None  # requires_grad_(False) on family.frozen (None: as the family's setup leaves it)

    @property
    def id(self) -> str:
        sizes = ",".join(f"{k}{v}" for k, v in self.family.sizes[self.size].items())
        parts = [self.family.name, sizes, self.form, self.budget.replace(" ", "-")]
        parts += ["caught"] if self.caught else []
        parts += ["resident"] if self.resident else []
        parts += [] if self.frozen is None else ["frozen" if self.frozen else "trainable"]
        return "-".join(parts)

    @property
    def expects_nothing(self) -> bool:
        """Nothing to fix: the right answer is no finding."""
        return self.family.nothing or bool(self.frozen and self.family.frozen_is_fine)

    def state(self) -> dict[str, Any]:
        """Fresh, seeded variables; the RNG at a fixed point afterwards (as ``Scenario.state``)."""
        st = self.family.setup(**self.family.sizes[self.size])
        if self.family.frozen is not None and self.frozen is not None:
            st[self.family.frozen].requires_grad_(not self.frozen)
        torch.manual_seed(1234)
        return st


# ----- the families ---------------------------------------------------------------------------------
def _setup000(n: int, batch: int, width: int, out: int) -> dict[str, Any]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 2 * width), nn.Tanh(),  # noqa: N806
                      nn.Linear(2 * width, out))
    return {"G": G.requires_grad_(False), "y": torch.randn(out, requires_grad=True),
            "zs": [torch.randn(batch, 16) for _ in range(n)], "x": torch.randn(batch, 16)}


def _fix000(G: nn.Module, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:  # noqa: N803
    was = [p.requires_grad for p in G.parameters()]
    G.requires_grad_(False)  # nothing differentiates G's parameters: forward AD through it
    try:
        return seed000.fix(G, y, zs, x)
    finally:
        for p, r in zip(G.parameters(), was, strict=True):
            p.requires_grad_(r)


def _setup001(n: int, batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(32, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1),
                      nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    return {"f": f, "inputs": [torch.randn(batch, 32) for _ in range(n)]}


def _setup002(n: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model1": nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)),
        "A": torch.rand(n, requires_grad=True),
        "x_train": torch.randn(n, 8), "t_train": torch.randn(n, 1),
        "x_val": torch.randn(n, 8), "t_val": torch.randn(n, 1),
    }


def _setup003(batch: int, width: int, proj: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "f1": nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        "f2": nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        "f3": nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        "x": torch.randn(batch, width), "target": torch.randn(batch, width),
        "P": torch.randn(width, proj) / 16,
    }


def _setup004(n_in: int, hidden: int, n_out: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"net": seed004.Net(n_in, hidden, n_out), "x": torch.randn(n_in)}


def _mlp(n_in: int, width: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, n_out))


def _setup_batches(n: int, batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(64, width, 10)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
            "xs": [torch.randn(batch, 64) for _ in range(n)], "ys": [torch.randint(0, 10, (batch,)) for _ in range(n)]}


def _setup_eval(n_val: int, batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(64, width, 10)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
            "x_val": torch.randn(n_val, 64), "y_val": torch.randint(0, 10, (n_val,)),
            "x": torch.randn(batch, 64), "y": torch.randint(0, 10, (batch,))}


def _setup_backbone(n: int, batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    backbone.eval()
    head = nn.Sequential(nn.Linear(width, 10))
    return {"backbone": backbone, "head": head, "opt": torch.optim.Adam(head.parameters(), lr=1e-3),
            "xs": [torch.randn(batch, 64) for _ in range(n)], "ys": [torch.randint(0, 10, (batch,)) for _ in range(n)]}


def _setup_adam(depth: int, width: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())))
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3), "x": torch.randn(batch, width)}


def _setup_huge(batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(128, width, 10)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
            "x": torch.randn(batch, 128), "y": torch.randint(0, 10, (batch,))}


def _setup_bn(depth: int, width: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()) for _ in range(depth)]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(batch, width), "y": torch.randint(0, 10, (batch,))}


def _setup_gan(batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 128))  # noqa: N806
    D = nn.Sequential(nn.Linear(128, width // 2), nn.LeakyReLU(0.2), nn.Linear(width // 2, width // 2),  # noqa: N806
                      nn.LeakyReLU(0.2), nn.Linear(width // 2, 1))
    return {"G": G, "D": D,
            "opt_G": torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9)),
            "opt_D": torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9)),
            "real": torch.randn(batch, 128), "z": torch.randn(batch, 32)}


def _setup_penalty(batch: int, hidden: int, n_out: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = seed004.Net(16, hidden, n_out)
    return {"net": net, "x": torch.randn(batch, 16), "t": torch.randn(batch, n_out),
            "opt": torch.optim.SGD(net.parameters(), lr=0.1)}


def _setup_plain(batch: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(64, width, 10)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            "x": torch.randn(batch, 64), "y": torch.randint(0, 10, (batch,))}


def _no_result(fix: Callable[..., Any]) -> Callable[..., Any]:
    def run(**state: Any) -> None:
        fix(**state)

    return run


def _eval_fix(model: nn.Module, opt: Any, x_val: Any, y_val: Any, x: Any, y: Any) -> Any:
    return training.eval_train_fix(model, opt, x_val, y_val, x, y)[0]


_BODY_000 = """\
dfdz = []
for z in zs:
    z.requires_grad_(True)
    dfdz.append(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0])
t = g(torch.stack(dfdz), x)
dgdy = torch.autograd.grad(t, y)[0]
"""
_BODY_001 = """\
zs = []
for x in inputs:
    z = f(x)
    zs.append(z)
zs = torch.stack(zs)
L = g(zs)
L.backward()
"""
_BODY_002 = """\
for _ in range(2):
    loss1 = (A * ((model1(x_train) - t_train) ** 2).squeeze(1)).mean()
    model1.zero_grad()
    loss1.backward(inputs=list(model1.parameters()), retain_graph=True, create_graph=True)
    with torch.no_grad():
        for p in model1.parameters():
            if p.grad is not None:
                p.copy_(p - 0.1 * p.grad)
loss3 = ((model1(x_val) - t_val) ** 2).mean()
A_grad = torch.autograd.grad(loss3, A)[0]
"""
_BODY_003 = """\
comp1 = f1(x)
penalty1 = calc_penalty(comp1, P)
comp2 = f2(comp1)
penalty2 = calc_penalty(comp2, P)
comp3 = f3(comp2)
penalty3 = calc_penalty(comp3, P)
accuracy = F.mse_loss(comp3, target)
loss = accuracy + ALPHA * (penalty1 + penalty2 + penalty3)
loss.backward()
"""
_BODY_004 = """\
xd = x.detach()
xd.requires_grad_(True)
n_inputs = int(xd.size(0))
y = net(xd.view(1, n_inputs)).view(-1)
n_outputs = int(y.size(0))
I = torch.eye(n_outputs)
J = torch.zeros([n_outputs, n_inputs])
for i in range(n_outputs):
    J[i, :] = torch.autograd.grad(y, xd, grad_outputs=I[i], retain_graph=True, create_graph=True)[0]
"""
_BODY_ACCUM_LIST = """\
losses = []
for xb, yb in zip(xs, ys):
    losses.append(F.cross_entropy(model(xb), yb))
loss = torch.stack(losses).mean()
opt.zero_grad()
loss.backward()
opt.step()
"""
_BODY_ACCUM_SUM = """\
total = 0
for xb, yb in zip(xs, ys):
    total = total + F.cross_entropy(model(xb), yb)
loss = total / len(xs)
opt.zero_grad()
loss.backward()
opt.step()
"""
_BODY_EVAL = """\
model.eval()
scores = model(x_val)
acc = (scores.argmax(1) == y_val).float().mean()
model.train()
loss = F.cross_entropy(model(x), y)
opt.zero_grad()
loss.backward()
opt.step()
"""
_BODY_BACKBONE = """\
for xb, yb in zip(xs, ys):
    feats = backbone(xb)
    loss = F.cross_entropy(head(feats), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
_BODY_RETAIN = """\
for xb, yb in zip(xs, ys):
    loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad()
    loss.backward(retain_graph=True)
    opt.step()
"""
_BODY_ADAM = """\
for _ in range(3):
    opt.zero_grad(set_to_none=False)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
"""
_BODY_HUGE = """\
loss = F.cross_entropy(model(x), y)
opt.zero_grad()
loss.backward()
opt.step()
"""
_BODY_GAN = """\
fake = G(z)
alpha = torch.rand(real.size(0), 1)
interp = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
d_interp = D(interp)
grads = torch.autograd.grad(d_interp, interp, grad_outputs=torch.ones_like(d_interp), create_graph=True)[0]
gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
loss_D = D(fake).mean() - D(real).mean() + 10.0 * gp
opt_D.zero_grad()
loss_D.backward()
opt_D.step()
"""

_BODY_002_UNROLLED = """\
params = dict(model1.named_parameters())
for _ in range(3):
    loss1 = (A * ((functional_call(model1, params, (x_train,)) - t_train) ** 2).squeeze(1)).mean()
    grads = torch.autograd.grad(loss1, list(params.values()), create_graph=True)
    params = {n: p - 0.1 * gr for (n, p), gr in zip(params.items(), grads)}
loss3 = ((functional_call(model1, params, (x_val,)) - t_val) ** 2).mean()
A_grad = torch.autograd.grad(loss3, A)[0]
"""
_BODY_003_RELEASED = """\
comp1 = f1(x)
penalty1 = ALPHA * calc_penalty(comp1, P)
penalty1.backward(retain_graph=True)
total = penalty1.detach()
penalty1 = None
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
total = total + loss.detach()
"""
_BODY_004_PENALTY = """\
xg = x.detach().requires_grad_(True)
out = net(xg)
rows = [torch.autograd.grad(out[:, i].sum(), xg, create_graph=True)[0] for i in range(out.shape[1])]
jac_norm = sum(r.pow(2).sum() for r in rows) / xg.shape[0]
loss = F.mse_loss(out, t) + 0.01 * jac_norm
opt.zero_grad()
loss.backward()
opt.step()
"""

FAMILIES: dict[str, Family] = {fam.name: fam for fam in [
    Family("seed000", "s000_many_z", _BODY_000, _setup000,
           ({"n": 12, "batch": 8, "width": 128, "out": 512}, {"n": 16, "batch": 4, "width": 64, "out": 256},
            {"n": 8, "batch": 16, "width": 96, "out": 384}),
           _fix000, result="dgdy", helpers={"f": seed000.f, "g": seed000.g}, frozen="G"),
    Family("seed001", "s001_stacked", _BODY_001, _setup001,
           ({"n": 8, "batch": 16, "width": 128}, {"n": 12, "batch": 8, "width": 96}, {"n": 6, "batch": 12, "width": 160}),
           seed001.stacked_fix, result="L", helpers={"g": seed001.g}),
    Family("seed002", "s002_inplace_update", _BODY_002, _setup002,
           ({"n": 32, "width": 64}, {"n": 48, "width": 96}, {"n": 16, "width": 128}),
           seed002.inplace_fix, result="A_grad", catches="RuntimeError", memory=False,
           reference=seed002.reference(2), user_error="appears to not have been used in the graph"),
    Family("seed003", "s003_joint", _BODY_003, _setup003,
           ({"batch": 64, "width": 96, "proj": 1024}, {"batch": 96, "width": 64, "proj": 768},
            {"batch": 48, "width": 128, "proj": 512}),
           _no_result(seed003.early), helpers={"calc_penalty": seed003.calc_penalty, "ALPHA": seed003.ALPHA}),
    Family("seed004", "s004_rows_tall", _BODY_004, _setup004,
           ({"n_in": 16, "hidden": 128, "n_out": 128}, {"n_in": 8, "hidden": 96, "n_out": 96},
            {"n_in": 12, "hidden": 64, "n_out": 160}),
           seed004.rows_fix, result="J", frozen="net"),
    Family("accum_list", "accum_list", _BODY_ACCUM_LIST, _setup_batches,
           ({"n": 6, "batch": 16, "width": 256}, {"n": 8, "batch": 8, "width": 192}, {"n": 4, "batch": 24, "width": 256}),
           _no_result(training.accum_fix)),
    Family("accum_sum", "accum_sum", _BODY_ACCUM_SUM, _setup_batches,
           ({"n": 6, "batch": 16, "width": 256}, {"n": 8, "batch": 8, "width": 192}, {"n": 4, "batch": 24, "width": 256}),
           _no_result(training.accum_fix)),
    Family("eval_then_train", "eval_then_train", _BODY_EVAL, _setup_eval,
           ({"n_val": 512, "batch": 16, "width": 256}, {"n_val": 768, "batch": 8, "width": 192},
            {"n_val": 384, "batch": 24, "width": 320}),
           _eval_fix, result="scores"),
    Family("trainable_backbone", "trainable_backbone", _BODY_BACKBONE, _setup_backbone,
           ({"n": 2, "batch": 64, "width": 256}, {"n": 3, "batch": 32, "width": 320}, {"n": 2, "batch": 24, "width": 384}),
           _no_result(training.backbone_fix), frozen="backbone", frozen_is_fine=True,
           ignore=SCENARIOS["trainable_backbone"].ignore),
    Family("retain_graph", "retain_graph_loop", _BODY_RETAIN, _setup_batches,
           ({"n": 4, "batch": 64, "width": 256}, {"n": 6, "batch": 48, "width": 128}, {"n": 3, "batch": 32, "width": 192}),
           _no_result(training.retain_loop_fix)),
    Family("adam_state", "adam_state", _BODY_ADAM, _setup_adam,
           ({"depth": 3, "width": 256, "batch": 8}, {"depth": 4, "width": 192, "batch": 4}, {"depth": 3, "width": 320, "batch": 4}),
           _no_result(training.adam_fix), ignore=SCENARIOS["adam_state"].ignore, toolbox=True),
    Family("huge_batch", "huge_batch", _BODY_HUGE, _setup_huge,
           ({"batch": 1024, "width": 256}, {"batch": 768, "width": 192}, {"batch": 1536, "width": 128}),
           _no_result(training.huge_fix), toolbox=True),
    Family("batchnorm_depth", "deep_batchnorm", _BODY_HUGE, _setup_bn,
           ({"depth": 6, "width": 128, "batch": 128}, {"depth": 8, "width": 96, "batch": 96},
            {"depth": 5, "width": 160, "batch": 128}),
           _no_result(training.deep_bn_checkpointed), toolbox=True),
    Family("gan", "gan_fake_not_detached", _BODY_GAN, _setup_gan,
           ({"batch": 32, "width": 256}, {"batch": 24, "width": 384}, {"batch": 48, "width": 192}),
           _no_result(gan.d_step), ignore=SCENARIOS["gan_fake_not_detached"].ignore),
    # nothing to fix: the right answer is no finding
    Family("seed002_unrolled", "s002_unrolled", _BODY_002_UNROLLED, _setup002,
           ({"n": 32, "width": 64}, {"n": 48, "width": 96}, {"n": 16, "width": 128}),
           seed002.unrolled, result="A_grad", memory=False, nothing=True, reference=seed002.reference(3)),
    Family("seed003_released", "s003_retain_released", _BODY_003_RELEASED, _setup003,
           ({"batch": 64, "width": 96, "proj": 1024}, {"batch": 96, "width": 64, "proj": 768},
            {"batch": 48, "width": 128, "proj": 512}),
           seed003.frank, result="total", memory=False, nothing=True,
           helpers={"calc_penalty": seed003.calc_penalty, "ALPHA": seed003.ALPHA}),
    Family("seed004_penalty", "s004_jacobian_penalty", _BODY_004_PENALTY, _setup_penalty,
           ({"batch": 64, "hidden": 128, "n_out": 8}, {"batch": 32, "hidden": 256, "n_out": 6},
            {"batch": 48, "hidden": 96, "n_out": 10}),
           _no_result(seed004.penalty), memory=False, nothing=True),
    Family("plain_step", "plain_step", _BODY_HUGE, _setup_plain,
           ({"batch": 64, "width": 256}, {"batch": 32, "width": 192}, {"batch": 48, "width": 320}),
           _no_result(training.plain), memory=False, nothing=True),
    Family("gan_detached", "gan_gradient_penalty", _BODY_GAN.replace("fake = G(z)\n", "fake = G(z).detach()\n"),
           _setup_gan, ({"batch": 32, "width": 256}, {"batch": 24, "width": 384}, {"batch": 48, "width": 192}),
           _no_result(gan.d_step), memory=False, nothing=True),
]}


def _variants(fam: Family) -> list[Variant]:
    """Five variants per family that between them take every form, budget level, caught and left
    failure, resident memory or none, and (where the family has a pretrained part) frozen and
    trainable."""
    if not fam.memory:  # no budget: the user's code raises for another reason (caught instead), or fits
        grid = [(0, "script", "none", False, False), (1, "function", "none", True, True),
                (2, "notebook", "none", False, True), (1, "script", "none", True, False),
                (0, "notebook", "none", True, False)]
    else:
        grid = [(0, "script", "none", False, False), (1, "function", "tight", False, True),
                (2, "notebook", "very tight", True, False), (0, "script", "very tight", True, True),
                (1, "notebook", "tight", False, True)]
    out = []
    for i, (size, form, budget, caught, resident) in enumerate(grid):
        frozen = None if fam.frozen is None else i % 2 == 1
        if frozen and fam.frozen_is_fine:  # nothing left to fix: a plain recording, no budget
            budget, caught = "none", False
        out.append(Variant(fam, size, form, budget, caught, resident, frozen))
    return out


VARIANTS: list[Variant] = [v for fam in FAMILIES.values() for v in _variants(fam)]


# ----- running the user's code in each form -----------------------------------------------------------
def _namespace(v: Variant, state: Mapping[str, Any]) -> dict[str, Any]:
    """What the user's file or notebook has: the usual imports, the family's helpers, the variables."""
    ns: dict[str, Any] = {
        "torch": torch, "nn": nn, "F": F, "gs": gs, "checkpoint": checkpoint, "functional_call": functional_call,
        "nullcontext": contextlib.nullcontext, "mixed_grad": mixed_grad, "many_inputs_backward": many_inputs_backward,
        "hypergradient": hypergradient, "PenaltyBranches": PenaltyBranches, "jacobian": jacobian,
        "batch_norm_stats_restored": training.batch_norm_stats_restored,
    }
    ns.update(v.family.helpers)
    ns.update(state)
    return ns


def _body(v: Variant) -> str:
    body = v.family.body
    if v.caught:  # the user catches the failure around the step and goes on
        body = f"try:\n{textwrap.indent(body, '    ')}except {v.family.catches}:\n    pass\n"
    return body


def _compile_run(src: str, ns: dict[str, Any], filename: str) -> BaseException | None:
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # the user's file
    try:
        exec(compile(src, filename, "exec"), ns)  # noqa: S102 - the variant's own source, generated here
    except Exception as e:  # the user's code may raise: that is part of the variant
        e.__traceback__ = None
        return e
    return None


@dataclass
class Ran:
    """One run of a variant in its form: the namespace after it, its recording, what it raised."""

    state: dict[str, Any]
    namespace: dict[str, Any]
    recording: gs.Recording | None
    error: BaseException | None
    budget: int | None


def budget_of(v: Variant) -> int | None:
    """The simulated device of a variant (bytes the block may allocate), see NOTE [ a variant's ground truth ]."""
    if v.budget == "none":
        return None
    gt = ground_truth(v)
    gap = gt.peak_user - gt.peak_fix
    return gt.peak_user - gap // 4 if v.budget == "tight" else gt.peak_fix + gap // 8


def run_variant(v: Variant) -> Ran:
    """The user's code, in the variant's form, recorded with the tracker under its budget."""
    state = v.state()
    budget = budget_of(v)
    ns = _namespace(v, state)
    if v.resident:
        ns["earlier"] = torch.zeros(RESIDENT // 4)  # an earlier cell's tensor, alive in the namespace
    names = ", ".join(state)
    name = f"<variant {v.id}>"
    arg = "" if budget is None else f", budget={budget}"
    if v.form == "script":
        src = f"rec = gs.record(memory=\"tracker\"{arg})\nwith rec:\n{textwrap.indent(_body(v), '    ')}"
    elif v.form == "function":
        ret = f"    return {v.family.result}\n" if v.family.result else ""
        if v.family.result and v.caught:
            ret = f"    return locals().get({v.family.result!r})\n"
        src = (f"def train({names}):\n{textwrap.indent(_body(v), '    ')}{ret}\n"
               f"rec = gs.record(memory=\"tracker\"{arg})\nwith rec:\n"
               f"    {v.family.result or '_'} = train({names})\n")
    else:
        return _run_cell(v, state, ns, budget)
    error = _compile_run(src, ns, name)
    return Ran(state, ns, ns["rec"].recording, error, budget)


@contextlib.contextmanager
def _shell() -> Iterator[Any]:
    from IPython.testing import globalipapp

    shell = globalipapp.get_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "gradscope")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "gradscope")


def _run_cell(v: Variant, state: dict[str, Any], ns: dict[str, Any], budget: int | None) -> Ran:
    from gradscope._notebook import cells as gsi

    with _shell() as ip:
        mine = {*ns, "rec", *_assigned(v)}
        before = {k: ip.user_ns[k] for k in mine if k in ip.user_ns}  # put back afterwards
        ip.user_ns.update(ns)
        try:
            if budget is None:
                line = "--memory tracker"
            else:  # what earlier cells left counts against the device
                line = f"--budget {budget + gsi._resident_cpu_bytes(ip.user_ns)}"
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = ip.run_cell(f"%%gradscope {line} -o rec --no-widget\n{_body(v)}")
            cell_ns = dict(ip.user_ns)
        finally:
            for k in mine:
                ip.user_ns.pop(k, None)
            ip.user_ns.update(before)
    error = res.error_in_exec
    if error is not None:
        error.__traceback__ = None
    user = {k: cell_ns[k] for k in cell_ns if k in ns or k in _assigned(v) or k == "rec"}
    return Ran(state, user, cell_ns["rec"], error, budget)


def _assigned(v: Variant) -> tuple[str, ...]:
    return _names_stored(v.family.body)


@functools.cache
def _names_stored(body: str) -> tuple[str, ...]:
    import ast

    tree = ast.parse(body)
    return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}))


# ----- ground truth -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Truth:
    peak_user: int
    peak_fix: int
    user: Mapping[str, Any]  # the results of the user's code (an error entry where it raises)
    fixed: Mapping[str, Any]
    reference: Mapping[str, Any]


def results(v: Variant, state: Mapping[str, Any], value: Any, error: BaseException | None = None) -> dict[str, Any]:
    return outcome(state, value, error, v.family.ignore)


def user_plain(v: Variant, state: dict[str, Any]) -> tuple[Any, BaseException | None]:
    """The user's statements run as they are, no recording, on ``state``: the value of the result."""
    ns = _namespace(v, state)
    error = _compile_run(v.family.body, ns, f"<user {v.id}>")
    return (ns.get(v.family.result) if v.family.result else None), error


def _tracked(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
    rec = gs.record(memory="tracker")
    value, error = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with rec:
                value = fn()
        except Exception as e:  # the user's code may raise
            error = e
            e.__traceback__ = None
    assert rec.recording is not None
    return value, error, rec.recording.peak_bytes


def ground_truth(v: Variant) -> Truth:
    return _ground_truth(v.family.name, v.size, v.frozen)


@functools.cache
def _ground_truth(family: str, size: int, frozen: bool | None) -> Truth:
    v = Variant(FAMILIES[family], size, frozen=frozen)
    fam = v.family
    su = v.state()
    value, error, peak_user = _tracked(lambda: user_plain(v, su))
    if error is None:
        value, error = value
    user = results(v, su, value, error)
    sf = v.state()
    fvalue, ferror, peak_fix = _tracked(lambda: fam.fix(**sf))
    fixed = results(v, sf, fvalue, ferror)
    if fam.reference is not None:
        sr = v.state()
        reference = results(v, sr, fam.reference(**sr))
    else:
        reference = user
    return Truth(peak_user, peak_fix, user, fixed, reference)


def same(v: Variant, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return same_results(a, b, v.family.rtol, v.family.atol)


def run_code(v: Variant, code: str) -> dict[str, Any]:
    """A finding's code, verbatim, on fresh copies of the variables: the results it leaves."""
    state = v.state()
    ns = _namespace(v, state)
    if v.form == "function":  # the user's own function is in their file too
        names = ", ".join(state)
        _compile_run(f"def train({names}):\n{textwrap.indent(v.family.body, '    ')}", ns, f"<train {v.id}>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        error = _compile_run(code, ns, f"<finding {v.id}>")
    return results(v, state, ns.get(v.family.result) if v.family.result else None, error)
