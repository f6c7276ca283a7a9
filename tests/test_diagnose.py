"""gs.diagnose on CPU with a simulated budget: each seed pattern is named with its culprit and fix."""

from __future__ import annotations

import copy
import importlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope.diagnose import Diagnosis
from gradscope.recording import format_bytes

KiB = 1024


def _frozen_generator() -> nn.Module:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))  # noqa: N806
    return G.requires_grad_(False)


def test_gradient_penalty_through_frozen_generator_names_create_graph_and_forward_ad() -> None:
    G = _frozen_generator()  # noqa: N806
    y = torch.randn(64, requires_grad=True)
    dfdz = []
    with pytest.raises(gs.MemoryBudgetExceeded) as info:
        with gs.record(budget="3MiB", modules={"G": G}) as rec:
            for _ in range(100):
                z = torch.randn(128, 16, requires_grad=True)
                f = ((G(z) * y) ** 2).sum()
                dfdz.append(torch.autograd.grad(f, z, create_graph=True)[0])
    r = rec.recording
    assert r is not None and not r.complete
    assert r.oom is not None and r.oom.budget == 3 * 1024 * KiB
    assert r.oom.live == info.value.live
    assert all(c.create_graph and c.api == "autograd.grad" for c in r.backward_calls)
    d = gs.diagnose(r)
    twice = gs.diagnose(r)  # the same recording and namespace: the same text, but for wall times
    assert isinstance(d, Diagnosis)
    assert d.moment == "failure" and d.live_bytes == info.value.live
    assert d.requested == info.value.requested and d.where == info.value.where
    assert sum(b for _, b in d.by_kind) == d.live_bytes
    first = d.findings[0]
    assert first.pattern == "create_graph"
    assert first.module == "G" and first.variable == "dfdz"
    assert "create_graph=True" in first.message and "no parameter of it is trained" in first.message
    assert "forward-AD" in first.suggestion
    # the step rewritten with input_grad ran on copies: it fits the budget, by the drop it measured
    assert first.ran and "dfdz.append(input_grad(lambda y, out: ((out * y) ** 2).sum(), G, z, y))" in first.code
    assert first.fits is True and first.saves_bytes == first.peak_before - first.peak_after > 0
    # independently: the rewritten step recorded under the same budget does not fail
    G2, y2, got = _frozen_generator(), y.detach().clone().requires_grad_(True), []  # noqa: N806
    env = {"torch": torch, "G": G2, "y": y2, "dfdz": got}
    with gs.record(budget="3MiB") as again:
        exec(first.code, env)
    assert again.recording is not None and again.recording.complete and len(got) == 100
    holder = next(h for h in d.holders if h.variable == "dfdz")
    assert holder.graphs == len(dfdz) and holder.live_bytes > 0
    kinds = dict(d.by_kind)
    assert kinds["saved_order1"] > 0 and kinds["saved"] > 0
    # the largest tensors carry shapes and the module they were saved in
    assert d.largest[0].shape == (128, 256) and d.largest[0].module.startswith("G.")
    text = d.text()
    assert "out of memory on a simulated 3.0 MiB device" in text
    assert "[create_graph]" in text and "dfdz" in text
    untimed = lambda t: re.sub(r"time x[0-9.]+", "time", t)  # noqa: E731  (wall times differ run to run)
    assert text == str(d) and untimed(text) == untimed(twice.text())  # deterministic
    assert "<pre" in d._repr_html_()


def test_the_suggested_strategy_fits_where_create_graph_did_not() -> None:
    from gradscope.strategies import mixed_grad

    G = _frozen_generator()  # noqa: N806
    y = torch.randn(64, requires_grad=True)
    f = lambda y, g: ((g * y) ** 2).sum()  # noqa: E731
    zs = [torch.randn(128, 16) for _ in range(20)]
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="3MiB", modules={"G": G}):
            keep = [mixed_grad(f, G, z, y, method="create_graph") for z in zs[:1]]
            keep += [torch.autograd.grad(f(y, G(z.requires_grad_())), z, create_graph=True)[0] for z in zs]
    with gs.record(budget="3MiB", modules={"G": G}) as rec:
        out = [mixed_grad(f, G, z, y, method="forward_ad") for z in zs]
    assert rec.recording is not None and rec.recording.complete and len(out) == 20


def test_training_loop_appending_losses_is_never_told_to_keep_numbers() -> None:
    # the losses are back-propagated after the loop: .item() would break it. At the failure the
    # loss over them is not formed yet: two passes are right for any loss (seed 001)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    xs = [torch.randn(128, 64) for _ in range(100)]
    losses = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="4MiB", modules={"model": model}) as rec:
            for x in xs:
                loss = model(x).square().mean()
                losses.append(loss)
            torch.stack(losses).mean().backward()
    d = gs.diagnose(rec.recording)
    first = d.findings[0]
    assert first.pattern == "many_outputs" and first.module == "model"
    assert not first.ran and first.code == "" and first.saves_bytes is None  # (no namespace: nothing to run)
    assert first.sketch.startswith('L = many_inputs_backward(model, xs, g, method="two_pass")')
    assert not any(".item()" in f.code for f in d.findings)
    holder = d.holders[0]
    assert holder.variable == "losses" and holder.graphs == len(losses)
    assert holder.live_bytes >= 0.8 * d.live_bytes
    assert dict(d.by_kind)["saved"] >= 0.8 * d.live_bytes
    assert {m for m, _ in d.by_module} >= {"model.1", "model.3"}


def test_losses_kept_as_numbers_fit_the_same_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    losses: list[float] = []
    with gs.record(budget="4MiB", modules={"model": model}) as rec:
        for _ in range(100):
            loss = model(torch.randn(128, 64)).square().mean() / 100
            loss.backward()
            losses.append(loss.item())
    assert rec.recording is not None and rec.recording.complete and len(losses) == 100


def test_pretrained_extractor_left_trainable_names_the_model_and_no_grad() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
    ).eval()
    head = nn.Linear(512, 10)
    opt = torch.optim.Adam(head.parameters())
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="6MiB", modules={"backbone": backbone, "head": head}) as rec:
            for _ in range(3):
                feats = backbone(torch.randn(512, 64))
                loss = head(feats).logsumexp(-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    d = gs.diagnose(rec.recording)
    f = next(f for f in d.findings if f.pattern == "frozen_trainable")
    assert f is d.findings[0]
    assert f.variable == "backbone" and f.module == "backbone"
    assert "no optimizer trains it" in f.message and "eval() mode" in f.message
    assert "torch.no_grad()" in f.suggestion
    # the block's own code with the backbone's calls under no_grad, run on copies and measured
    assert f.code == (
        "for _ in range(3):\n"
        "    with torch.no_grad():\n"
        "        feats = backbone(torch.randn(512, 64))\n"
        "    loss = head(feats).logsumexp(-1).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    assert f.ran and f.fits is True and f.saves_bytes == f.peak_before - f.peak_after > 0
    # applied as printed to copies of the models as they were: it fits the budget, the head's update is the same
    twin_b, twin_h = copy.deepcopy(backbone), copy.deepcopy(head)
    twin_o = torch.optim.Adam(twin_h.parameters())
    torch.manual_seed(1)
    with gs.record(budget="6MiB") as fixed:
        exec(f.code, {"torch": torch, "backbone": twin_b, "head": twin_h, "opt": twin_o})
    assert fixed.recording.oom is None
    # what the backbone made and still held at the refused allocation
    r = rec.recording
    alive = [a for a in r.allocations if a.free_at is None]
    assert f.bytes == sum(a.bytes for a in alive if (a.module or "").split(".")[0] == "backbone") > 0
    # the head is trained: not flagged
    assert not any(x.variable == "head" for x in d.findings)
    # what existed before the block, from the variables: both models' parameters
    params = sum(p.numel() * 4 for m in (backbone, head) for p in m.parameters())
    assert dict(d.resident)["parameters"] == params
    # and by variable, every byte of it named
    assert dict(d.resident_by_variable) == {"backbone": params - 20520, "head": 20520}
    assert "before it, your variables held 2.2 MiB: backbone 2.1 MiB, head 20.0 KiB" in d.text()


def test_extractor_under_no_grad_fits_and_is_not_flagged() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
    ).eval()
    head = nn.Linear(512, 10)
    opt = torch.optim.Adam(head.parameters())
    with gs.record(budget="6MiB", modules={"backbone": backbone, "head": head}) as rec:
        for _ in range(3):
            with torch.no_grad():
                feats = backbone(torch.randn(512, 64))
            loss = head(feats).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    d = gs.diagnose(rec.recording)
    assert d.moment == "peak" and d.budget is None
    assert not any(x.pattern == "frozen_trainable" for x in d.findings)


def test_retain_graph_is_reported_only_where_no_later_backward_reuses_the_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(64, 64) for _ in range(4)]
    ys = [torch.randint(0, 10, (64,)) for _ in range(4)]

    def loop(retain: bool) -> gs.Recording:
        with gs.record(memory="tracker", modules={"model": model}) as rec:
            for x, y in zip(xs, ys, strict=True):
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward(retain_graph=retain)
                opt.step()
        assert rec.recording is not None
        return rec.recording

    r = loop(True)
    assert [c.retain_graph for c in r.backward_calls] == [True] * 4
    partial = gs.diagnose(r, namespace={"model": model, "opt": opt})  # `xs`, `ys`, `retain` missing
    f = next(f for f in partial.findings if f.pattern == "retain_graph")
    assert "4 backward calls used retain_graph=True" in f.message and f.sketch.startswith("loss.backward()")
    assert not f.ran and f.code == "" and f.saves_bytes is None and "not run:" in partial.text()
    ns = {"model": model, "opt": opt, "xs": xs, "ys": ys, "retain": True, "nn": nn}
    f = next(f for f in gs.diagnose(r, namespace=ns).findings if f.pattern == "retain_graph")
    assert f.ran and "loss.backward()\n" in f.code and "retain_graph" not in f.code
    # measured independently: the same loop without retain_graph, recorded (the model moved on by
    # the diagnosis' runs? no: those ran on copies)
    saved = r.peak_bytes - loop(False).peak_bytes
    assert saved > 0 and f.saves_bytes is not None and abs(f.saves_bytes - saved) <= 0.1 * saved, (f.saves_bytes, saved)
    # a second backward through the same graph is what retain_graph is for: not reported
    w = torch.randn(256, 256, requires_grad=True)
    with gs.record(memory="tracker") as rec2:
        h = (torch.randn(512, 256) @ w).tanh()
        h.sum().backward(retain_graph=True)
        (h * 2).sum().backward()
    assert not any(f.pattern == "retain_graph" for f in gs.diagnose(rec2.recording, namespace={}).findings)


def test_one_large_batch_without_batch_norm_gets_micro_batches_not_checkpointing() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
    x = torch.randn(2048, 128)
    with gs.record(memory="tracker", modules={"layers": layers}) as rec:
        layers(x).square().mean().backward()
    assert not any(f.pattern == "micro_batches" for f in gs.diagnose(rec.recording).findings)  # it fits
    d = gs.diagnose(rec.recording, namespace={"layers": layers, "x": x}, toolbox=True)
    assert d.moment == "peak"
    f = d.findings[0]
    assert f.pattern == "micro_batches"
    assert f.code == ("for start in range(0, 2048, 512):\n"
                      "    (layers(x[start:start + 512]).square().mean() * (512 / 2048)).backward()\n")
    assert "checkpoint(" not in "".join(g.code for g in d.findings if g.pattern != "deep_activations")
    # the code as printed and the user's, each run on a copy as the block started: the same
    # gradients; the most memory held at once (what the copy holds at the start plus what the run
    # allocates) as claimed
    grads = [p.grad.clone() for p in layers.parameters()]
    held = {}
    for name, code in (("user", "layers(x).square().mean().backward()\n"), ("fix", f.code)):
        twin = copy.deepcopy(layers)
        twin.zero_grad(set_to_none=True)
        start = sum(p.numel() * 4 for p in twin.parameters()) + x.numel() * 4
        with gs.record(memory="tracker") as r:
            exec(code, {"layers": twin, "x": x})
        held[name] = start + r.recording.peak_bytes
        assert all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7) for p, g in zip(twin.parameters(), grads, strict=True))
    assert f.peak_before == held["user"] and f.peak_after == held["fix"]
    assert f.saves_bytes == held["user"] - held["fix"] > 0.5 * held["user"]


def test_diagnosis_without_namespace_or_memory_still_reads() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    with gs.record(memory="off") as rec:
        (w * 2).sum().backward()
    d = gs.diagnose(rec.recording, namespace={})
    assert d.moment == "none" and d.live_bytes == 0
    assert "no memory events were recorded" in d.text()


def test_diagnose_rejects_other_objects() -> None:
    with pytest.raises(gs.GradscopeError, match="takes a Recording"):
        gs.diagnose(42)


def test_a_loaded_recording_keeps_the_diagnosis_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    G = _frozen_generator()  # noqa: N806
    y = torch.randn(64, requires_grad=True)
    grads = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="2MiB", modules={"G": G}) as rec:
            for _ in range(50):
                z = torch.randn(128, 16, requires_grad=True)
                grads.append(torch.autograd.grad(((G(z) * y) ** 2).sum(), z, create_graph=True)[0])
    path = tmp_path / "oom.gscope.json"
    rec.recording.save(path)
    back = gs.load(path)
    live = gs.diagnose(rec.recording, namespace={"G": G, "y": y})
    loaded = gs.diagnose(back, namespace={"G": G, "y": y})
    assert loaded.text() == live.text()
    assert loaded.findings[0].pattern == "create_graph" and loaded.findings[0].module == "G"


def test_smaller_live_tensors_are_summed_not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.modules["gradscope._model.held_at_peak"], "_MAX_ROWS", 5)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    losses = []
    with pytest.raises(gs.MemoryBudgetExceeded) as info:
        with gs.record(budget="1MiB", modules={"model": model}) as rec:
            for _ in range(50):
                losses.append(model(torch.randn(128, 64)).square().mean())
    held = rec.recording.held
    assert held is not None and len(held.rows) == 5 and held.omitted > 0
    d = gs.diagnose(rec.recording)
    assert sum(b for _, b in d.by_kind) == d.live_bytes == info.value.live
    assert sum(b for _, b in d.by_module) == d.live_bytes
    assert any("not listed one by one" in n for n in d.notes)
    assert d.findings[0].pattern == "many_outputs" and d.findings[0].module == "model"


def test_gradients_and_optimizer_state_are_told_apart() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget=3 * params + 150 * KiB, modules={"model": model}) as rec:
            for _ in range(5):
                opt.zero_grad(set_to_none=False)
                model(torch.randn(64, 256)).square().mean().backward()
                opt.step()
    d = gs.diagnose(rec.recording)
    kinds = dict(d.by_kind)
    # exp_avg and exp_avg_sq, and Adam's 0-d step counters (made by torch.tensor, 4 B each)
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    assert state == 2 * params + 4 * len(list(model.parameters()))
    assert kinds["gradient"] == params  # made in the block by AccumulateGrad, named from model
    assert kinds["optimizer"] == state
    # Stepping in backward was tried on copies and measured: the peak is Adam's per-parameter
    # temporaries next to its state in backward, a few percent lower, still over the budget; so it
    # is a note, not a finding (a replay of the timeline once claimed it fits).
    assert not any(f.pattern in ("optimizer_state", "set_to_none") for f in d.findings)
    tried = [n for n in d.notes if n.startswith("[optimizer_state] tried")]
    assert len(tried) == 1 and "still over the budget" in tried[0]
    named = {t.variable for t in d.largest if t.variable}
    assert any(n.startswith("opt.state[") for n in named)
    assert any(n.startswith("model.") and n.endswith(".grad") for n in named)


def test_a_model_a_later_backward_may_train_is_never_frozen_at_a_failure() -> None:
    # G requires grad and the block failed before anything but input gradients ran: a gradient
    # penalty trains G next (gan_gradient_penalty), so neither no_grad nor requires_grad_(False)
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 64))  # noqa: N806 - not frozen
    y = torch.randn(64, requires_grad=True)
    grads = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="2MiB", modules={"G": G}) as rec:
            for _ in range(50):
                z = torch.randn(128, 16, requires_grad=True)
                grads.append(torch.autograd.grad(((G(z) * y) ** 2).sum(), z, create_graph=True)[0])
    d = gs.diagnose(rec.recording, namespace={"G": G, "y": y, "grads": grads})
    assert len(rec.recording.backward_calls) > 1
    assert not any("requires_grad_(False)" in f.code or "no_grad" in f.code for f in d.findings)
    assert not any(f.pattern == "create_graph" for f in d.findings)  # G is trainable: not a mixed derivative


@pytest.mark.parametrize("memory", ["cpu", "tracker"])
def test_addresses_reused_after_the_peak_are_not_matched_with_live_variables(memory: str) -> None:
    # gradients and optimizer state are made after the peak, often at addresses that tensors alive
    # at the peak had; they must not be taken for those tensors
    for _ in range(3):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        opt = torch.optim.Adam(model.parameters())
        losses = []
        with gs.record(memory=memory, modules={"model": model}) as rec:
            for _ in range(3):
                losses.append(model(torch.randn(128, 64)).square().mean())
            torch.stack(losses).sum().backward()
            opt.step()
        rows = rec.recording.held.to_dict()["rows"]
        d = gs.diagnose(rec.recording)
        kinds = dict(d.by_kind)
        assert kinds.get("saved", 0) == sum(r["bytes"] for r in rows if r["what"] == "saved")
        assert "optimizer" not in kinds
        assert d.resident == ()  # at a peak, what the variables hold now is not "before the block"


# ----- names and holders by identity; the graph walk keeps its node objects ----------------------
def test_a_model_is_named_by_identity_never_by_class_name_or_parameter_names() -> None:
    torch.manual_seed(0)
    used = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512))
    unused = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512)).eval()  # same class, same names
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # trains neither model
    outs: list[torch.Tensor] = []

    def fill(net: nn.Module) -> gs.Recording:
        # no modules=: the recording names the root by the variable it has where the block ends
        # ("net", a name the diagnosed namespace does not have)
        with pytest.raises(gs.MemoryBudgetExceeded):
            with gs.record(budget="2MiB") as rec:
                for _ in range(20):
                    outs.append(net(torch.randn(128, 64)))
        return rec.recording

    r = fill(used)
    assert r.nodes[0].module is not None and r.nodes[0].module.startswith("net.")
    d = gs.diagnose(r, namespace={"used": used, "unused": unused, "opt": opt, "outs": outs})
    # neither model is claimed: the recording did not name its root by a variable of the namespace
    assert not any(f.pattern == "frozen_trainable" for f in d.findings)
    assert dict(d.resident).get("parameters") is None
    assert [h.variable for h in d.holders] == ["outs"]
    # named by the variable it was given as, the same recording's model is found, and only it
    outs.clear()
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="2MiB", modules={"used": used}) as rec:
            for _ in range(20):
                outs.append(used(torch.randn(128, 64)))
    d = gs.diagnose(rec.recording, namespace={"used": used, "unused": unused, "opt": opt, "outs": outs})
    assert {f.module for f in d.findings} <= {"used", None}  # never `unused`, which did not run
    assert not any("unused" in f.code or "unused" in f.message for f in d.findings)
    params = sum(p.numel() * 4 for p in used.parameters())
    assert dict(d.resident)["parameters"] == params


def test_variables_holding_graphs_of_other_recordings_are_not_holders() -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 64))  # noqa: N806
    zs = [torch.randn(32, 16, requires_grad=True) for _ in range(8)]
    dfdz = [torch.autograd.grad(G(z).square().sum(), z, create_graph=True)[0] for z in zs]  # before
    losses = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="1MiB", modules={"G": G}) as rec:
            for _ in range(100):
                losses.append(G(torch.randn(128, 16)).square().mean())
    d = gs.diagnose(rec.recording, namespace={"G": G, "dfdz": dfdz, "losses": losses})
    assert [h.variable for h in d.holders] == ["losses"]
    # dfdz is named only as a variable that held memory before the block, never as a holder
    assert "dfdz" not in d.text().split("graphs kept alive by variables:")[1]
    assert dict(d.resident_by_variable)["dfdz"] == 8 * 32 * 16 * 4
    assert len(dfdz) == 8


class _RecycledNode:
    """A node object as some PyTorch versions make them: ``next_functions`` wraps the child anew at
    each call, and a wrapper nobody holds any more is recycled for the next one made, so that its
    ``id()`` comes back for another node."""

    pool: list[_RecycledNode] = []

    def __init__(self, depth: int, chain: list[torch.Tensor]) -> None:
        self.depth, self.chain = depth, chain
        self._saved_self = chain[depth]
        self._raw_saved_self = None  # as a real node: each saved tensor also has its raw variable

    def __del__(self) -> None:
        _RecycledNode.pool.append(self)

    @property
    def next_functions(self) -> tuple[tuple[_RecycledNode, int], ...]:
        if self.depth + 1 >= len(self.chain):
            return ()
        child = _RecycledNode.pool.pop() if _RecycledNode.pool else _RecycledNode.__new__(_RecycledNode)
        child.__init__(self.depth + 1, self.chain)  # type: ignore[misc]
        return ((child, 0),)


def test_the_graph_walk_holds_its_node_objects_so_ids_are_never_reused() -> None:
    import sys

    walk = sys.modules["gradscope._analyses.diagnose.facts"].saved_storages
    chain = [torch.zeros(10 + i) for i in range(50)]
    try:
        found = walk([_RecycledNode(0, chain)], lambda t: int(t.untyped_storage().data_ptr()))
    finally:
        _RecycledNode.pool.clear()
    assert len(found) == 50  # a walk that forgot its nodes found 3: the fourth reused the second's id
    assert sum(found.values()) == sum(t.untyped_storage().nbytes() for t in chain) == 6900


def test_the_budget_error_gives_sizes_in_binary_units_with_bytes_in_parentheses() -> None:
    e = gs.MemoryBudgetExceeded(65536, 224288, 52428800, where="aten::tanh")
    assert str(e) == (
        "gradscope: simulated device out of memory: tried to allocate 64.0 KiB (65536 bytes) with "
        "219.0 KiB live (224288 bytes) of a 50.0 MiB budget (52428800 bytes) (in aten::tanh). "
        "Call gs.diagnose(rec.recording) to see what held the memory."
    )
    assert (e.requested, e.live, e.budget) == (65536, 224288, 52428800)


def test_at_a_failure_the_live_bytes_are_those_at_the_refused_allocation() -> None:
    torch.manual_seed(0)
    with pytest.raises(gs.MemoryBudgetExceeded) as info:
        with gs.record(budget="253KiB") as rec:
            big = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 8))
            [big(torch.randn(64, 8)) for _ in range(100)]  # the list dies with the error
    assert info.value.live == 224288  # the model's 17 KiB and two iterations' outputs and saves
    d = gs.diagnose(rec.recording, namespace={})
    assert d.live_bytes == info.value.live  # not 85,024: the two iterations freed while unwinding


def _closure_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., None]:
    def step(x: torch.Tensor, *, scale: float = 0.5) -> None:  # a keyword-only default, read at every call
        (model(x).square().mean() * scale).backward()
        opt.step()
        opt.zero_grad()

    return step


def test_the_users_functions_run_as_they_are_on_copies_and_the_users_objects_and_random_state_stay() -> None:
    # a closure over the model and optimizer, with a keyword-only default: run on copies, rebuilt to read
    # the copies (never the user's objects), its __kwdefaults__ kept; the user's random state put back
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Dropout(0.1), nn.Linear(512, 1))
    opt = torch.optim.Adam(model.parameters())
    step = _closure_step(model, opt)
    x = torch.randn(256, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="700KiB") as rec:
            step(x)
    rng = torch.get_rng_state()
    d = gs.diagnose(rec.recording, progress=False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()) and not opt.state
    # the step ran on the copies (a fix was measured against it), with dropout on as the user has it
    assert d.step_peak is not None and model.training
    assert not any("failed on copies" in n or "could not be run" in n for n in d.notes), d.notes


def test_a_loss_summed_over_a_loop_is_differentiated_in_each_iteration() -> None:
    """A MAML-like outer loss summed over tasks, differentiated once after the loop: the toolbox's
    loop_backward calls backward in each iteration instead. Pasted as printed under the same budget, a
    first step and the next fit, and its gradients and Adam state equal the user's step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tasks = [(torch.randn(256, 32), torch.randn(256, 1)) for _ in range(8)]
    start = copy.deepcopy((model.state_dict(), opt.state_dict()))
    budget = 7 * 1024 * KiB
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(memory="tracker", budget=budget) as rec:
            opt.zero_grad()
            outer = 0.0
            for x, y in tasks:
                outer = outer + nn.functional.mse_loss(model(x), y)
            (outer / len(tasks)).backward()
            opt.step()
    d = gs.diagnose(rec.recording)
    (f,) = [f for f in d.findings if f.pattern == "loop_backward"]
    assert f.fits and f.ran and f.variable == "outer"
    assert f.code == ("opt.zero_grad()\n"
                      "outer = 0.0\n"
                      "for x, y in tasks:\n"
                      "    term = nn.functional.mse_loss(model(x), y)\n"
                      "    (term / len(tasks)).backward()\n"
                      "    outer = outer + term.detach()\n"
                      "opt.step()\n")
    after: list[dict[str, torch.Tensor]] = []  # the user's step and the fix, each after its first step
    for code, limit in (("opt.zero_grad()\nouter = 0.0\nfor x, y in tasks:\n"
                         "    outer = outer + nn.functional.mse_loss(model(x), y)\n"
                         "(outer / len(tasks)).backward()\nopt.step()\n", None), (f.code, budget)):
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        opt.state.clear()
        env = {"model": model, "opt": opt, "tasks": tasks, "nn": nn}
        for i in range(2):  # a first step and the next, each within the budget where it says it fits
            with gs.record(memory="tracker", budget=limit):
                exec(code, env)
            if i == 0:
                after.append({f"{n}{k}": t.detach().clone() for n, p in model.named_parameters()
                              for k, t in (("#p", p), (".grad", p.grad), *((f".{s}", v) for s, v in opt.state[p].items()))})
    for k, a in after[0].items():  # parameters at 1e-3 of their largest value (Adam's first step), the rest 1e-4
        b = after[1][k]
        assert float((a - b).abs().max()) <= (1e-3 if k.endswith("#p") else 1e-4) * float(a.abs().max()) + 1e-12, k


@pytest.mark.parametrize("step", [
    "loss = 0\nfor x in xs:\n    loss = loss + f(x)\nprint(loss)\nloss.backward()\n",  # read between loop and call
    "loss = 0\nfor x in xs:\n    loss = loss + f(x)\n    k = 2\n(loss / k).backward()\n",  # a factor the loop sets
    "loss = 0\nfor x in xs:\n    loss = loss + f(x)\n    loss = loss * 0.5\nloss.backward()\n",  # read again inside
    "for x in xs:\n    loss = f(x)\n    loss.backward()\n",  # already one backward per iteration
])
def test_backward_per_iteration_leaves_loops_it_cannot_rewrite_exactly(step: str) -> None:
    from gradscope._analyses.diagnose.step import backward_per_iteration, shape_of

    shape = shape_of(step)
    assert shape is not None and backward_per_iteration(shape) is None


def test_the_progress_line_comes_only_after_a_second_and_is_cleared(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A diagnosis over before its wait (a second) says nothing on stderr; one that takes longer says how far
    it is (while a run is still going: a timer says it) and clears its line at the end. (The waits are set
    here, so that the machine's load decides nothing.)"""
    import time

    progress = importlib.import_module("gradscope._analyses.diagnose")._Progress
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
    x = torch.randn(256, 64)
    with gs.record(memory="tracker", modules={"layers": layers}) as rec:
        layers(x).square().mean().backward()
    ns = {"layers": layers, "x": x}
    monkeypatch.setattr(progress, "AFTER_S", 3600.0)
    gs.diagnose(rec.recording, namespace=ns, toolbox=True, progress=True)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    shown: list[str] = []
    original = progress._say

    def say(self: object) -> None:
        original(self)
        shown.append(threading.current_thread().name)

    monkeypatch.setattr(progress, "_say", say)
    real_run = importlib.import_module("gradscope._analyses.diagnose.measure").Bench._run_once

    def slow(self: object, *args: object, **kwargs: object) -> object:
        time.sleep(0.1)  # a run longer than the wait: the timer's line comes during it
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module("gradscope._analyses.diagnose.measure").Bench, "_run_once", slow)
    d = gs.diagnose(rec.recording, namespace=ns, toolbox=True, progress=True)
    err = capsys.readouterr().err
    assert d.findings and "gradscope: trying fixes on copies of your objects:" in err and "run for real" in err
    assert err.endswith("\r") and err.rstrip("\r").split("\r")[-1].strip() == ""  # the line is cleared
    assert shown[0] != threading.main_thread().name  # the first came from the timer, mid-run


def test_a_block_that_ran_out_is_run_again_only_up_to_a_bound() -> None:
    """A loop appending every step's loss (and graph) to a list stops at the budget; its step run again
    on copies would go on for all 1,000 iterations (1.5 GB here; 20 GB and past ten minutes for a larger
    model before this bound). The
    runs of copies stop at 16 times the block's budget, at least 256 MiB (see NOTE [ a bound on runs of copies ] in
    gradscope._analyses.diagnose.counts): the diagnosis ends, says so, and still names the list."""
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    losses: list[torch.Tensor] = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(memory="tracker", budget="8MiB", modules={"model": model}) as rec:
            for _ in range(1000):
                losses.append(model(torch.randn(256, 256)).square().mean())
    assert rec.recording is not None
    stopped_at = len(losses)
    d = gs.diagnose(rec.recording)
    limit = max(measure.RUN_LIMIT_FACTOR * (8 << 20), measure.RUN_LIMIT_FLOOR)
    assert len(losses) == stopped_at < 1000  # the user's own list is untouched by the runs on copies
    assert f"it went over {format_bytes(limit)}" in d.text()
    assert any(h.variable == "losses" for h in d.holders)


class _Tied(nn.Module):
    """Modules of every kind a copy meets: tied weights, batch-norm statistics, a None and a
    non-persistent buffer, a forward hook, an LSTM's flat weights, a parametrization."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.BatchNorm1d(8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gate = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.register_buffer("nothing", None)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)
        self.norm.register_forward_hook(lambda m, args, out: out * 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        h = self.lstm(h)[0] * self.scale
        return self.head(self.gate(h))


def test_a_replica_is_what_deepcopy_makes_of_the_objects() -> None:
    """The copies the diagnosis runs fixes on (see NOTE [ a module's containers copied ahead ] in
    gradscope._analyses.diagnose.copies) against ``copy.deepcopy`` of the same objects: the same modules with the same
    attributes, tied weights tied, hooks kept, the same results and optimizer steps, gradients copied too,
    nothing shared with the user's objects."""
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 20, (4, 6))
    model(ids).square().mean().backward()
    opt.step()  # optimizer state and gradients to copy too
    objs = {"model": model, "opt": opt, "ids": ids}
    mine, theirs = measure._replica(objs), copy.deepcopy(objs)
    for p, q, r in zip(model.parameters(), mine["model"].parameters(), theirs["model"].parameters(), strict=True):
        assert q.grad is not None and q.grad is not p.grad and torch.equal(q.grad, p.grad)
        r.grad = p.grad.clone()  # (a parameter's deepcopy leaves its gradient behind; the copies keep it)
    for (name, a), (_, b), (_, o) in zip(mine["model"].named_modules(), theirs["model"].named_modules(),
                                         model.named_modules(), strict=True):
        assert type(a) is type(b) and sorted(vars(a)) == sorted(vars(b)), name
        for k, v in vars(a).items():
            w = vars(b)[k]
            assert type(v) is type(w), (name, k)
            if isinstance(v, dict | set):
                assert list(v) == list(w), (name, k)
                assert v is not vars(o)[k], (name, k)  # never the user's container
    assert mine["model"].head.weight is mine["model"].emb.weight
    assert mine["model"].head.weight is not model.head.weight
    assert mine["model"].nothing is None and "scale" not in mine["model"].state_dict()
    state = theirs["model"].state_dict()
    assert all(torch.equal(t, state[k]) for k, t in mine["model"].state_dict().items())
    assert {id(p) for g in mine["opt"].param_groups for p in g["params"]} == {id(p) for p in mine["model"].parameters()}
    for objects in (mine, theirs):  # a step on each: the same results (the hook doubles the norm's output)
        objects["model"](objects["ids"]).square().mean().backward()
        objects["opt"].step()
    state = theirs["model"].state_dict()
    assert all(torch.equal(t, state[k]) for k, t in mine["model"].state_dict().items())
    assert torch.equal(mine["model"](ids), theirs["model"](ids))
    assert not torch.equal(mine["model"].emb.weight, model.emb.weight)  # the user's model did not move


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "one_at_a_time"])
def test_a_results_difference_is_the_largest_relative_one(foreach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result's difference (``_worst`` of ``_differences`` in gradscope._analyses.diagnose.copies) against one worked out in float64
    tensor by tensor here, with PyTorch's foreach operators and without them: each tensor's largest difference
    relative to its largest value, parameters scaled (NOTE [ parameters after an optimizer's step ]), NaN and inf
    the same only at the same places, integers equal or not."""
    measure = importlib.import_module("gradscope._analyses.diagnose.copies")

    def difference(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> tuple[float, str]:
        return measure._worst(measure._differences(x, y))

    if not foreach:
        monkeypatch.setattr(measure._compat, "largest_differences", lambda xs, ys: None)
    torch.manual_seed(0)
    a = {"w#parameter": torch.randn(30, 7), "g": torch.randn(12, dtype=torch.float64), "h": torch.randn(5).half(),
         "n": torch.tensor(3.0), "i": torch.arange(6), "e": torch.empty(0)}
    b = {k: v.clone() for k, v in a.items()}
    b["w#parameter"][3, 2] += 0.02
    b["g"] += 1e-9 * torch.randn(12, dtype=torch.float64)
    b["h"][1] += 0.25

    def expected(k: str) -> float:
        x, y = a[k].double(), b[k].double()
        d = float((x - y).abs().max() / x.abs().max())
        return d * measure._TOLERANCE / measure.PARAMETER_TOLERANCE if k.endswith("#parameter") else d

    worst = max(["w#parameter", "g", "h"], key=expected)
    got = difference(a, b)
    assert got[1] == worst.removesuffix("#parameter") and got[0] == pytest.approx(expected(worst), rel=1e-3)
    assert difference({"g": a["g"]}, {"g": b["g"]})[0] == pytest.approx(expected("g"), rel=1e-6)
    assert difference(a, a) == (0.0, "")
    nan = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert difference({"x": nan}, {"x": nan.clone()}) == (0.0, "")
    assert difference({"x": nan}, {"x": nan.flip(0)})[0] == float("inf")
    assert difference({"i": a["i"]}, {"i": a["i"] + 1}) == (float("inf"), "i")


def test_micro_batches_measured_on_meta_are_compared_with_dropout_off_without_a_run_with_it_on() -> None:
    """Micro-batches draw dropout's masks slice by slice, in another order than the step: their results are
    compared with dropout off (see NOTE [ results where randomness allows ] in gradscope._analyses.diagnose.measure). Where
    their memory was measured on meta, neither they nor the user's step are run for real with dropout on (see NOTE
    [ one reference with dropout off ]): two real runs (the user's step and the fix with dropout off) where four
    ran before, and the same comparison."""
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    source = "out = model(x)\nout.square().mean().backward()\nopt.step()\nopt.zero_grad()\n"
    micro = ("for start in range(0, 256, 128):\n"
             "    out = model(x[start:start + 128])\n"
             "    (out.square().mean() * (128 / 256)).backward()\n"
             "opt.step()\n"
             "opt.zero_grad()\n")
    found = {}
    for reorders in (True, False):
        bench, runs, _ = _meta_bench(source)
        assert bench.user().how == "meta"
        trial = bench.run(micro, reorders=reorders)
        assert trial.how == "meta"
        trial = bench.settled(trial)
        found[reorders] = (trial, runs.count("run"))
    for trial, _ in found.values():
        assert trial.same is True and trial.later is not None
        assert trial.seconds is not None and trial.seconds > 0
    assert found[True][0].compared == measure.COMPARED_OFF and found[False][0].compared == measure.COMPARED_OFF_ONCE
    assert found[True][0].worst == found[False][0].worst and found[True][0].worst_at == found[False][0].worst_at
    assert (found[True][1], found[False][1]) == (2, 2)


def _meta_bench(source: str) -> tuple[Any, list[str], dict[str, Any]]:
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Dropout(0.2), nn.ReLU(), nn.Linear(256, 256), nn.Dropout(0.1),
                          nn.ReLU(), nn.Linear(256, 8))
    ns = {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3), "x": torch.randn(256, 32),
          "checkpoint": torch.utils.checkpoint.checkpoint}
    runs: list[str] = []
    bench = measure.Bench(source, ns, progress=runs.append)
    bench._is_small = False  # measured on meta (a step this small would run on CPU copies)
    return bench, runs, ns


def test_fixes_measured_on_meta_share_one_run_of_the_step_with_dropout_off() -> None:
    """NOTE [ one reference with dropout off ]: a fix that replays dropout's masks (checkpointing) and one
    that draws them in another order (micro-batches), both measured on meta, are compared with dropout off
    against one real run of the user's step: three real runs in all, where four ran (the user's step with
    dropout on as well). A fix that changes the results is still found so, and the comparison agrees with
    one made independently: the step and the fix run on deep copies with every dropout's p set to 0."""
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    source = "out = model(x)\nout.square().mean().backward()\nopt.step()\nopt.zero_grad()\n"
    ckpt = "out = checkpoint(model, x, use_reentrant=False)\nout.square().mean().backward()\nopt.step()\nopt.zero_grad()\n"
    doubled = "out = model(x)\n(2 * out.square().mean()).backward()\nopt.step()\nopt.zero_grad()\n"
    micro = ("for start in range(0, 256, 128):\n"
             "    out = model(x[start:start + 128])\n"
             "    (out.square().mean() * (128 / 256)).backward()\n"
             "opt.step()\n"
             "opt.zero_grad()\n")
    bench, runs, ns = _meta_bench(source)
    assert bench.user().how == "meta"
    trials = {}
    for name, code in (("ckpt", ckpt), ("micro", micro), ("doubled", doubled)):
        trial = bench.run(code, reorders=name == "micro")
        assert trial.how == "meta"
        trials[name] = bench.settled(trial)
    assert runs.count("run") == 4  # the user's step with dropout off once, each fix once
    assert trials["ckpt"].compared == measure.COMPARED_OFF_ONCE and trials["ckpt"].same is True
    assert trials["micro"].compared == measure.COMPARED_OFF and trials["micro"].same is True
    assert trials["doubled"].same is False  # Adam's moments of twice the gradients differ
    assert bench.user().seconds is not None and all(t.seconds for t in trials.values())

    def independent(code: str) -> list[torch.Tensor]:
        env = copy.deepcopy({k: v for k, v in ns.items() if k != "checkpoint"})
        for m in env["model"].modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        env["checkpoint"] = ns["checkpoint"]
        exec(code, env)
        return [p.detach() for p in env["model"].parameters()] + [
            t for st in env["opt"].state.values() for t in st.values() if torch.is_tensor(t)]

    ref = independent(source)
    for name, code in (("ckpt", ckpt), ("micro", micro), ("doubled", doubled)):
        agree = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ref, independent(code), strict=True))
        assert agree is (name != "doubled"), name


def test_a_step_that_draws_with_dropout_off_is_compared_as_before_on_meta() -> None:
    """Where the user's step draws random numbers of its own (noise), its run with dropout off cannot be the
    reference: a checkpointed fix measured on meta is then compared with dropout on, from the same random
    state, as before."""
    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    source = "out = model(x + 0.1 * torch.randn_like(x))\nout.square().mean().backward()\nopt.step()\nopt.zero_grad()\n"
    ckpt = source.replace("model(x + 0.1 * torch.randn_like(x))",
                          "checkpoint(model, x + 0.1 * torch.randn_like(x), use_reentrant=False)")
    bench, runs, _ = _meta_bench(source)
    trial = bench.settled(bench.run(ckpt))
    assert trial.compared == measure.COMPARED_ON and trial.same is True


def test_a_fix_that_ran_out_of_memory_on_copies_names_what_the_variables_hold() -> None:
    """On an H200 a GPT-2 cell that ran out of CUDA memory kept its graph in ``out`` (500.8 MiB);
    the copies the fixes run on share that GPU, and checkpointing (277 MiB on its own) failed beside
    it with PyTorch's whole message as the note. The note now names what holds the most, largest
    first, and what to do."""
    from gradscope._analyses.diagnose import _oom_on_copies_note
    from gradscope.recording import format_bytes

    error = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
             "139.80 GiB of which 138.49 GiB is free.")
    held = {"ids": 32 * 1024, "m": 84 * 1024 * 1024, "out": 525_076_480, "empty": 0, "x": 1024, "y": 2048}
    note = _oom_on_copies_note("deep_activations", error, held)
    top = sorted(((v, b) for v, b in held.items() if b), key=lambda kv: -kv[1])[:3]
    assert [v for v, _ in top] == ["out", "m", "ids"]
    listed = ", ".join(f"`{v}` {format_bytes(b)}" for v, b in top)
    assert note == (f"[deep_activations] not shown: it ran out of memory on copies of your objects beside what your "
                    f"variables still hold ({listed}) (OutOfMemoryError: CUDA out of memory); free what you no "
                    "longer need (del ...) and diagnose again.")
    assert "`out` 500.8 MiB" in note and "138.49 GiB" not in note
    assert "beside" not in _oom_on_copies_note("autocast", error, {})


def _dropout_blocks() -> dict[str, Any]:
    """Six Linear-Tanh-Dropout blocks in train mode, their Adam optimizer and a batch of 512."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Dropout(0.1)) for _ in range(6)],
                          nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return {"model": model, "opt": opt, "x": torch.randn(512, 256), "y": torch.randn(512, 1), "nn": nn, "gs": gs}


_BLOCKS_STEP = ("loss = nn.functional.mse_loss(model(x), y)\n"
                "loss.backward()\n"
                "opt.step()\n"
                "opt.zero_grad()\n")


def _dropout_blocks_step(alternatives: bool, runs: list[str], tmp_path: Path) -> Diagnosis:
    """The blocks' step over a 6 MiB budget it does not fit, run from a file (where the diagnosis reads
    its code) and diagnosed (``runs`` collects the diagnosis's progress events)."""
    ns = _dropout_blocks()
    path = tmp_path / "blocks.py"
    path.write_text("with gs.record(memory='tracker', budget='6MiB') as rec:\n"
                    + "".join("    " + line + "\n" for line in _BLOCKS_STEP.splitlines()))
    with pytest.raises(torch.OutOfMemoryError):
        exec(compile(path.read_text(), str(path), "exec"), ns)
    module = importlib.import_module("gradscope._analyses.diagnose")
    original = module._Progress.__call__

    def counting(self: Any, what: str) -> None:
        runs.append(what)
        original(self, what)

    module._Progress.__call__ = counting
    try:
        return gs.diagnose(ns["rec"].recording, namespace=ns, progress=False, alternatives=alternatives)
    finally:
        module._Progress.__call__ = original


def test_the_diagnosis_stops_at_the_first_fix_that_fits_and_alternatives_tries_the_rest(tmp_path: Path) -> None:
    """Under a budget the toolbox stops at its first fix that fits (checkpointing here), names the fixes it
    did not try, and runs the step fewer times; ``alternatives=True`` tries them (micro-batches fit too),
    and the fix both show is the same, measured the same. The fix shown fits pasted verbatim, in train
    mode, for a first step and the next."""
    first_runs: list[str] = []
    alt_runs: list[str] = []
    d = _dropout_blocks_step(False, first_runs, tmp_path)
    alt = _dropout_blocks_step(True, alt_runs, tmp_path)
    assert [f.pattern for f in d.findings] == ["deep_activations"]
    assert {f.pattern for f in alt.findings} == {"deep_activations", "micro_batches"}
    assert all(f.fits for f in alt.findings)
    (same,) = [f for f in alt.findings if f.pattern == "deep_activations"]
    (f,) = d.findings
    assert (f.code, f.fits, f.peak_before, f.peak_after) == (same.code, same.fits, same.peak_before, same.peak_after)
    toolbox = importlib.import_module("gradscope._analyses.diagnose.toolbox").TOOLBOX
    patterns = [t.PATTERN for t in toolbox]
    rest = patterns[patterns.index("deep_activations") + 1:]
    assert f"[deep_activations] fits the budget: the fixes after it ({', '.join(rest)}) were not tried" in "\n".join(
        d.notes)
    assert not any("fits the budget: the fixes after it" in n for n in alt.notes)
    assert 0 < first_runs.count("run") < alt_runs.count("run")
    # pasted as printed, from the objects as they were built: a first step and the next fit the budget
    env = _dropout_blocks()
    assert env["model"].training
    exec(f.setup, env)
    for _ in range(2):
        with gs.record(memory="tracker", budget="6MiB"):
            exec(f.step, env)
    with gs.record(memory="tracker") as rec:
        torch.ones(8, requires_grad=True).exp().sum().backward()
    with pytest.raises(gs.GradscopeError, match=r"diagnose\(alternatives=...\) takes True or False"):
        gs.diagnose(rec.recording, alternatives="yes")  # type: ignore[arg-type]
