"""How the diagnosis compares a fix's results with the user's step's after an optimizer's step (NOTE
[ parameters after an optimizer's step ] in gradscope._analyses.diagnose.copies), on real AdamW and SGD
steps: gradients that agree to float32 rounding but straddle zero move Adam's parameters apart by up
to twice the learning rate, and the moments say the gradients agreed; gradients that differ change the
moments, and the comparison says so."""

from __future__ import annotations

import importlib

import torch
from torch import nn

copies = importlib.import_module("gradscope._analyses.diagnose.copies")


def _stepped(grad: torch.Tensor, make_opt: type, **kw: float) -> dict[str, object]:
    """A one-layer model whose weight receives ``grad``, stepped once by a new optimizer."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    opt = make_opt(model.parameters(), **kw)
    model.weight.grad = grad.clone()
    opt.step()
    opt.zero_grad()
    return {"model": model, "opt": opt}


def _compared(a: dict[str, object], b: dict[str, object]) -> float:
    names = {"model", "opt"}
    return copies._compare(copies._results(a, names), copies._results(b, names), names)[0]


def _gradients() -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient and the same one as another order of float32 sums gives it: equal to 1e-7 of its
    largest value, and a few elements near zero whose sign differs between the two."""
    torch.manual_seed(1)
    g = torch.randn(64, 64)
    h = g + 1e-7 * g.abs().max() * torch.randn(64, 64)
    g[0, :8] = 1e-9
    h[0, :8] = -1e-9  # (a rounding difference of 2e-9 where the gradient is near zero)
    return g, h


def test_adams_parameters_apart_by_rounding_near_zero_are_the_same_results() -> None:
    g, h = _gradients()
    a, b = _stepped(g, torch.optim.AdamW, lr=1e-3), _stepped(h, torch.optim.AdamW, lr=1e-3)
    params = copies._worst(copies._differences(copies._results(a, {"model"})["model"], copies._results(b, {"model"})["model"]))[0]
    assert params > copies._TOLERANCE  # the parameters alone say "changed" (2 lr apart where the signs differ)
    assert _compared(a, b) <= copies._TOLERANCE  # the moments say the gradients agreed


def test_adams_parameters_from_gradients_twice_as_large_differ() -> None:
    g, _ = _gradients()
    a, b = _stepped(g, torch.optim.AdamW, lr=1e-3), _stepped(2 * g, torch.optim.AdamW, lr=1e-3)
    # Adam's first step moves each element by about lr whatever the scale: the parameters barely differ...
    params = copies._worst(copies._differences(copies._results(a, {"model"})["model"], copies._results(b, {"model"})["model"]))[0]
    assert params <= copies._TOLERANCE
    assert _compared(a, b) > 0.4  # ...the moments do (exp_avg twice, exp_avg_sq four times)


def test_a_parameter_whose_moments_differ_is_compared_itself() -> None:
    g, h = _gradients()
    a = _stepped(g, torch.optim.AdamW, lr=1e-3)
    b = _stepped(h, torch.optim.AdamW, lr=1e-3)
    b["opt"].state[b["model"].weight]["exp_avg"][5, 5] += 1.0  # the state no longer agrees
    assert _compared(a, b) > copies._TOLERANCE


def test_sgd_without_state_compares_its_parameters() -> None:
    g, _ = _gradients()
    a = _stepped(g, torch.optim.SGD, lr=1e-1)
    b = _stepped(g * (1 + 1e-2), torch.optim.SGD, lr=1e-1)
    assert not b["opt"].state  # nothing to say the gradients agreed: the parameters are compared
    assert _compared(a, b) > copies._TOLERANCE
