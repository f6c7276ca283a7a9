"""gs.diagnose on generated variants of seeds 000 and 002: a model left trainable that nothing
trains, and an out-of-memory caught inside the block."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
import torch
from scenarios import seed000, seed002
from torch import nn
from torch.func import functional_call

import gradscope as gs
from gradscope.diagnose import Diagnosis
from gradscope.strategies import mixed_grad

pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")

MiB = 1024 * 1024
f, g = seed000.f, seed000.g


# ----- seed 000: G left trainable, nothing differentiates its parameters --------------------------
def _setup000(n: int, batch: int, trainable: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    G = seed000._generator().requires_grad_(trainable)  # noqa: N806
    return {"G": G, "y": torch.randn(1024, requires_grad=True),
            "zs": [torch.randn(batch, 16) for _ in range(n)], "x": torch.randn(batch, 16)}


def _loop000(G: nn.Module, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:  # noqa: N803
    dfdz = []
    for z_i in zs:
        z_i.requires_grad_(True)
        dfdz.append(torch.autograd.grad(f(y, G(z_i)), z_i, create_graph=True)[0])
    t = g(torch.stack(dfdz), x)
    return torch.autograd.grad(t, y)[0], dfdz


def _fix000(G: nn.Module, y: torch.Tensor, zs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:  # noqa: N803
    G.requires_grad_(False)  # what the finding says is safe
    dfdz = [torch.autograd.grad(f(y, G(z.requires_grad_(True))), z)[0] for z in zs]
    D = torch.stack(dfdz).requires_grad_(True)  # noqa: N806
    v = torch.autograd.grad(g(D, x), D)[0]
    out = torch.zeros_like(y)
    for i, z in enumerate(zs):
        part = mixed_grad(f, G, z, y, v=v[i], method="forward_ad")
        assert part is not None
        out = out + part
    return out


def _diagnose(r: gs.Recording | None, namespace: dict[str, Any]) -> Diagnosis:
    assert r is not None
    d = gs.diagnose(r, namespace=namespace)
    assert isinstance(d, Diagnosis)
    return d


VARIANTS_000 = [(32, 8, True), (16, 8, True), (32, 16, True), (24, 8, True), (32, 8, False), (16, 16, False)]


@pytest.mark.parametrize(("n", "batch", "trainable"), VARIANTS_000)
def test_seed000_create_graph_is_found_whether_or_not_g_requires_grad(n: int, batch: int, trainable: bool) -> None:
    st = _setup000(n, batch, trainable)
    with gs.record(memory="cpu", modules={"G": st["G"]}) as rec:
        dgdy, dfdz = _loop000(**st)
    d = _diagnose(rec.recording, {**st, "st": st, "_loop000": _loop000, "dfdz": dfdz, "dgdy": dgdy})
    first = d.findings[0]
    assert first.pattern == "create_graph" and first.module == "G" and first.variable == "dfdz"
    assert first.ran and "input_grad(f, G, z_i, y)" in first.code and "no_grad" not in first.code, (d.step, d.notes)
    said = "G's parameters require grad but nothing uses their gradients"
    assert (said in first.message) == trainable
    if trainable:
        assert "G.requires_grad_(False)" in first.message and "forward AD applies" in first.message
    assert all(p.grad is None for p in st["G"].parameters())  # nothing trained G indeed
    # its code, verbatim, on a fresh set-up: the same dg/dy, and the saving as claimed (within a quarter)
    fresh = _setup000(n, batch, trainable)
    env = {**fresh, "torch": torch, "f": f, "g": g}
    with gs.record(memory="cpu") as ran:
        exec(first.code, env)
    assert torch.allclose(env["dgdy"], dgdy, rtol=1e-4, atol=1e-6)
    assert rec.recording is not None and ran.recording is not None
    saved = rec.recording.peak_bytes - ran.recording.peak_bytes
    assert saved > 0 and first.saves_bytes is not None and abs(first.saves_bytes - saved) <= 0.25 * saved
    # the hand-written strategy (G frozen, forward AD) gives the same dg/dy
    fixed_state = _setup000(n, batch, trainable)
    assert torch.allclose(_fix000(**fixed_state), dgdy, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("n", "batch"), [(16, 8), (32, 8), (24, 16), (8, 8), (32, 16)])
@pytest.mark.parametrize("trains", ["optimizer", "penalty"])
def test_seed000_a_g_that_is_trained_is_never_frozen(n: int, batch: int, trains: str) -> None:
    st = _setup000(n, batch, True)
    G = st["G"]  # noqa: N806
    opt = torch.optim.SGD(G.parameters(), lr=0.01)
    with gs.record(memory="cpu", modules={"G": G}) as rec:
        if trains == "optimizer":
            dgdy, dfdz = _loop000(**st)
            G(st["zs"][0]).square().mean().backward()
            opt.step()
        else:  # a gradient penalty: the create_graph gradients are differentiated into G
            dfdz = []
            for z_i in st["zs"]:
                z_i.requires_grad_(True)
                dfdz.append(torch.autograd.grad(f(st["y"], G(z_i)), z_i, create_graph=True)[0])
            torch.stack(dfdz).square().mean().backward()
    assert any(p.grad is not None for p in G.parameters())
    d = _diagnose(rec.recording, {**st, "dfdz": dfdz, "opt": opt})
    assert not any(x.pattern == "create_graph" for x in d.findings)
    assert not any("requires_grad_(False)" in x.code or "no_grad" in x.code for x in d.findings)


# ----- seed 002: the outer gradient's out-of-memory caught inside the block -------------------------
def _unrolled(caught: bool) -> Any:
    def user(model1: nn.Module, A: torch.Tensor, x_train: Any, t_train: Any, x_val: Any, t_val: Any) -> Any:  # noqa: N803
        params: dict[str, torch.Tensor] = dict(model1.named_parameters())
        for _ in range(3):
            loss1 = (A * ((functional_call(model1, params, (x_train,)) - t_train) ** 2).squeeze(1)).mean()
            grads = torch.autograd.grad(loss1, list(params.values()), create_graph=True)
            params = {n: p - seed002.LR * gr for (n, p), gr in zip(params.items(), grads, strict=True)}
        loss3 = ((functional_call(model1, params, (x_val,)) - t_val) ** 2).mean()
        if not caught:
            return torch.autograd.grad(loss3, A)[0]
        try:
            return torch.autograd.grad(loss3, A)[0]
        except torch.OutOfMemoryError:  # skip the batch
            return None

    return user


def _run002(caught: bool, budget: int, resident: bool) -> tuple[Diagnosis, gs.Recording, Any]:
    st = seed002.setup()
    earlier = torch.zeros(3 * MiB) if resident else None  # an earlier cell's 12 MiB tensor
    error: BaseException | None = None
    try:
        with gs.record(budget=budget, modules={"model1": st["model1"]}) as rec:
            _unrolled(caught)(**st)
    except gs.MemoryBudgetExceeded as e:
        error = e
    r = rec.recording
    assert r is not None
    return _diagnose(r, {**st, "earlier": earlier}), r, error


@pytest.mark.parametrize(("budget", "resident"), [(2_400_000, False), (2_500_000, False), (2_700_000, False),
                                                 (2_800_000, False), (2_500_000, True)])
def test_seed002_an_out_of_memory_caught_in_the_block_is_diagnosed_as_a_failure(budget: int, resident: bool) -> None:
    left, r_left, error = _run002(False, budget, resident)
    caught, r_caught, none = _run002(True, budget, resident)
    assert isinstance(error, gs.MemoryBudgetExceeded) and none is None
    assert r_left.oom is not None and r_caught.oom is None and r_caught.error is None
    failed = [c for c in r_caught.backward_calls if c.oom]
    assert len(failed) == 1 and failed[0].error is not None and failed[0].api == "autograd.grad"
    # the same moment, budget and refused request as when the error leaves the block
    assert left.moment == caught.moment == "failure"
    assert caught.budget == left.budget == budget
    assert caught.requested == left.requested == error.requested
    assert caught.where == left.where == error.where
    # live at the caught failure: the block's peak, which is at least what was live then
    assert error.live <= caught.live_bytes == r_caught.peak_bytes <= budget
    assert [(x.pattern, x.module, x.variable) for x in caught.findings] == [
        (x.pattern, x.module, x.variable) for x in left.findings]
    assert any("caught the error" in n for n in caught.notes)
    assert caught.resident == ()  # other allocations ran after the failure: nothing said "before the block"


@pytest.mark.parametrize(("requested", "live", "budget", "where"),
                         [(16384, 53516, 68156, "aten::addmm"), (1, 0, 1, ""), (3 << 30, 5 << 30, 8 << 30, "aten::mm")])
def test_a_budget_refusal_is_one_value(requested: int, live: int, budget: int, where: str) -> None:
    """One BudgetRefusal (gradscope.errors) is the exception's numbers and the saved form's (NOTE [ one refusal ] in
    gradscope._base.errors): nothing reads them back from the error's words, which are free to change."""
    from gradscope.errors import BudgetRefusal

    refusal = BudgetRefusal(requested, live, budget, where)
    e = gs.MemoryBudgetExceeded(refusal)
    assert e.refusal is refusal and (e.requested, e.live, e.budget, e.where) == (requested, live, budget, where)
    assert gs.MemoryBudgetExceeded(requested, live, budget, where=where).refusal == refusal
    assert BudgetRefusal.from_dict(json.loads(json.dumps(refusal.to_dict()))) == refusal
    again = pickle.loads(pickle.dumps(e))  # another process gets the same value (and the same words)
    assert again.refusal == refusal and str(again) == str(e)


def test_the_trackers_refusal_reaches_the_diagnosis_unchanged() -> None:
    """The refusal the tracker made is the caught exception's, the recording's and the diagnosis's:
    a 64x64 float32 product is 16384 bytes; the second one crosses a 20000-byte budget."""
    from gradscope._analyses.diagnose.moment import caught_oom
    from gradscope.errors import BudgetRefusal

    x = torch.randn(64, 64)
    with gs.record(memory="tracker", budget=20000) as rec:
        a = x @ x
        try:
            a @ x
        except torch.OutOfMemoryError as err:
            caught = err
    assert isinstance(caught, gs.MemoryBudgetExceeded)
    assert caught.refusal == BudgetRefusal(64 * 64 * 4, 64 * 64 * 4, 20000, "aten::mm")
    assert caught_oom(rec.recording) == caught.refusal
    del a
