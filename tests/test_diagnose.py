"""gs.diagnose on CPU with a simulated budget: each seed pattern is named with its culprit and fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope.diagnose import Diagnosis

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
    assert isinstance(d, Diagnosis)
    assert d.moment == "failure" and d.live_bytes == info.value.live
    assert d.requested == info.value.requested and d.where == info.value.where
    assert sum(b for _, b in d.by_kind) == d.live_bytes
    first = d.findings[0]
    assert first.pattern == "create_graph"
    assert first.module == "G" and first.variable == "dfdz"
    assert "create_graph=True" in first.message and "frozen" in first.message
    assert "forward-AD" in first.suggestion
    assert first.code == 'gradscope.strategies.mixed_grad(f, G, z, y, method="forward_ad")'
    holder = next(h for h in d.holders if h.variable == "dfdz")
    assert holder.graphs == len(dfdz) and holder.live_bytes > 0
    kinds = dict(d.by_kind)
    assert kinds["saved_order1"] > 0 and kinds["saved"] > 0
    # the largest tensors carry shapes and the module they were saved in
    assert d.largest[0].shape == (128, 256) and d.largest[0].module.startswith("G.")
    text = d.text()
    assert "out of memory on a simulated 3.0 MiB device" in text
    assert "[create_graph]" in text and "dfdz" in text
    assert text == str(d) == gs.diagnose(r).text()  # deterministic
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


def test_training_loop_appending_losses_names_the_list() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    losses = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="4MiB", modules={"model": model}) as rec:
            for _ in range(100):
                loss = model(torch.randn(128, 64)).square().mean()
                losses.append(loss)
            torch.stack(losses).mean().backward()
    d = gs.diagnose(rec.recording)
    first = d.findings[0]
    assert first.pattern == "graphs_held" and first.variable == "losses"
    assert f"`losses` holds {len(losses)} graphs" in first.message
    assert "loss.item()" in first.suggestion and first.code == "losses.append(loss.item())"
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
    assert "no optimizer trains its parameters" in f.message
    assert "torch.no_grad()" in f.suggestion
    assert f.code.startswith("with torch.no_grad(): feats = backbone(x)")
    # what the backbone's nodes saved and still held at the refused allocation (by_module also
    # counts the backward temporaries of its steps)
    held = rec.recording.held
    assert held is not None and held.omitted == 0
    saved_in_backbone = sum(r.bytes for r in held.rows if r.what == "saved" and (r.module or "").startswith("backbone"))
    assert f.bytes == saved_in_backbone > 0
    # the head is trained: not flagged
    assert not any(x.variable == "head" for x in d.findings)
    # what existed before the block, from the variables: both models' parameters
    params = sum(p.numel() * 4 for m in (backbone, head) for p in m.parameters())
    assert dict(d.resident)["parameters"] == params
    assert "resident before the block, from your variables: parameters 2.2 MiB" in d.text()


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


def test_retain_graph_is_reported() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)
    with gs.record(memory="tracker") as rec:
        h = (x @ w).tanh()
        h.sum().backward(retain_graph=True)
        (h * 2).sum().backward(retain_graph=True)
    calls = rec.recording.backward_calls
    assert [c.retain_graph for c in calls] == [True, True]
    assert [c.api for c in calls] == ["backward", "backward"]
    d = gs.diagnose(rec.recording, namespace={})
    f = next(f for f in d.findings if f.pattern == "retain_graph")
    assert "2 backward calls used retain_graph=True" in f.message


def test_deep_activations_suggest_checkpointing_the_largest_block() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
    with gs.record(memory="tracker", modules={"layers": layers}) as rec:
        out = layers(torch.randn(256, 128)).sum()
    d = gs.diagnose(rec.recording, namespace={})
    assert d.moment == "peak"
    f = d.findings[0]
    assert f.pattern == "deep_activations"
    assert f.module is not None and f.module.startswith("layers.")
    assert f.code.startswith("torch.utils.checkpoint.checkpoint(layers[")
    del out


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
    live = gs.diagnose(rec.recording, namespace={})
    loaded = gs.diagnose(back, namespace={})
    assert loaded.text() == live.text()
    assert loaded.findings[0].pattern == "create_graph" and loaded.findings[0].module == "G"


def test_smaller_live_tensors_are_summed_not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.modules["gradscope._held"], "_MAX_ROWS", 5)
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
    assert d.findings[0].variable == "losses"


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
    assert kinds["gradient"] == params  # made in the block by AccumulateGrad, named from model
    assert kinds["optimizer"] == 2 * params  # exp_avg and exp_avg_sq
    f = d.findings[0]
    assert f.pattern == "optimizer_state" and f.variable == "opt" and f.bytes == 3 * params
    assert "Adam's state" in f.message and f.code == "opt.zero_grad(set_to_none=True)"
    named = {t.variable for t in d.largest if t.variable}
    assert any(n.startswith("opt.state[") for n in named)
    assert any(n.startswith("model.") and n.endswith(".grad") for n in named)


def test_parameters_nobody_differentiates_are_found_from_the_recording_alone() -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 64))  # noqa: N806 - not frozen
    y = torch.randn(64, requires_grad=True)
    grads = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(budget="2MiB", modules={"G": G}) as rec:
            for _ in range(50):
                z = torch.randn(128, 16, requires_grad=True)
                grads.append(torch.autograd.grad(((G(z) * y) ** 2).sum(), z, create_graph=True)[0])
    d = gs.diagnose(rec.recording, namespace={})
    f = next(f for f in d.findings if f.pattern == "frozen_trainable")
    assert f.module == "G" and f.code == "G.requires_grad_(False)"
    assert "4 parameters of G require grad" in f.message and f.bytes > 0
    assert d.findings[0].pattern == "create_graph"


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
    flagged = {f.variable for f in d.findings if f.pattern == "frozen_trainable"}
    assert flagged == {"used"}  # trained by no optimizer here: the rule is the next engineer's
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
    assert "dfdz" not in d.text()
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

    walk = sys.modules["gradscope.diagnose"]._saved_storages
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
