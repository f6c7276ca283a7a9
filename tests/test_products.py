"""The data products other parts build on, on code written the way users write it: the
allocation table (against the profiler's own events, run without gradscope), categories and
phases (against the optimizer's state, the gradients and the saved tensors), backward calls,
held allocations, the figures' methods, naming by the user's variables, the schema-1 migration
and the tracker's honesty note."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import independent_nodes, profiler_cpu_allocations
from torch import nn

import gradscope as gs
from gradscope.figures import DEFINITIONS as FIGURES
from gradscope.recording import BackwardCall, Category, HeldAllocation, HeldMemory, Kind, Phase

DATA = Path(__file__).parent / "data"


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _profiler_allocations(step: Any) -> tuple[list[int], int]:
    """Sizes of the CPU allocations PyTorch's profiler sees during ``step()`` (time order), and
    how many of them were still alive at its end (paired by address)."""
    sizes, alive = [], {}
    for _, size, ptr in profiler_cpu_allocations(step):
        if size > 0:
            sizes.append(size)
            alive[ptr] = size
        else:
            alive.pop(ptr, None)
    return sizes, len(alive)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 32)


# ----- (a) the allocation table -----------------------------------------------------------------------
def test_allocation_table_is_the_profilers_allocations() -> None:
    model, x = _mlp()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    step()  # warm up
    sizes, alive_at_end = _profiler_allocations(step)
    with gs.record(memory="cpu") as rec:
        step()
    r = rec.recording
    assert r.allocation_key == "address"
    assert [a.bytes for a in r.allocations] == sizes
    assert sum(1 for a in r.allocations if a.free_at is None) == alive_at_end
    # positions are event positions: each allocation before its free, the timeline replays them
    assert all(a.free_at is None or a.alloc_at < a.free_at for a in r.allocations)
    assert [a.index for a in r.allocations] == list(range(len(r.allocations)))
    assert r.replay_peak() == r.peak_bytes == max(p.live for p in r.timeline)
    # what is alive at the end is the parameters' gradients: their storages
    assert sum(a.bytes for a in r.allocations if a.free_at is None) == _storage_bytes(
        [p.grad for p in model.parameters()])


# ----- (b) categories and phases --------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["cpu", "tracker"])
def test_categories_of_a_training_step(memory: str) -> None:
    model, x = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    with gs.record(memory=memory) as rec:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    r = rec.recording
    alive = [a for a in r.allocations if a.free_at is None]
    by_cat = {c: sum(a.bytes for a in alive if a.category is c) for c in Category}
    # the gradients are the parameters' .grad, the optimizer's state its exp_avg / exp_avg_sq
    assert by_cat[Category.GRADIENT] == _storage_bytes([p.grad for p in model.parameters()])
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert by_cat[Category.OPTIMIZER] - _storage_bytes(state) in (0, 4 * len(opt.state))  # (+ step counters)
    # every optimizer allocation was made inside Optimizer.step
    assert {a.phase for a in r.allocations if a.category is Category.OPTIMIZER} == {Phase.OPTIMIZER}
    assert all(a.phase is Phase.OPTIMIZER for a in r.allocations if a.category is Category.OPTIMIZER)
    # activations: what order-0 nodes saved that was allocated in the block (each storage once)
    act = {s.storage: s.bytes for s in r.saved if s.kind is Kind.ACTIVATION}
    assert sum(a.bytes for a in r.allocations if a.category is Category.ACTIVATION) == sum(act.values())
    assert all(a.node is not None for a in r.allocations if a.category is Category.ACTIVATION)
    assert {a.phase for a in r.allocations if a.category is Category.BACKWARD_TEMP} == {Phase.BACKWARD}
    # one step numbering: an allocation's step is a step of the recording and the timeline agrees
    for a in r.allocations:
        if a.step is not None:
            assert r.steps[a.step].index == a.step and a.phase is Phase.BACKWARD
    assert r.peak is not None and r.peak.phase is Phase.OPTIMIZER  # Adam's first step peaks
    assert r.timeline[r.peak_event()].live == r.peak_bytes  # type: ignore[index]


def test_create_graph_and_autograd_grad_categories() -> None:
    x = torch.randn(4096, requires_grad=True)
    w = torch.randn(4096, requires_grad=True)
    with gs.record(memory="tracker") as rec:
        y = (x * w).tanh()
        (gx,) = torch.autograd.grad(y.sum(), [x], create_graph=True)
        penalty = gx.pow(2).sum()
        (gw,) = torch.autograd.grad(penalty, [w])
    r = rec.recording
    n_bytes = 4096 * 4
    cats = {a.category for a in r.allocations}
    assert Category.CREATE_GRAPH in cats
    # the create_graph pass's nodes saved tensors: each such allocation is saved by an order >= 1 node
    for a in r.allocations:
        if a.category is Category.CREATE_GRAPH:
            assert a.node is not None and r.nodes[a.node].order >= 1
    # (a storage the forward saved too, like tanh's result, is an activation)
    by_forward = {s.storage for s in r.saved if r.nodes[s.node].order == 0}
    saved_by_order1 = {s.storage: s.bytes for s in r.saved
                       if r.nodes[s.node].order >= 1 and s.kind is Kind.ACTIVATION and s.storage not in by_forward}
    assert sum(a.bytes for a in r.allocations if a.category is Category.CREATE_GRAPH) == sum(saved_by_order1.values())
    # the last pass's result (not saved by anything): a gradient
    grads = [a for a in r.allocations if a.category is Category.GRADIENT]
    assert [a.bytes for a in grads if a.free_at is None] == [n_bytes] and gw.shape == (4096,)
    # the nodes made by the create_graph pass are those of gx's graph that y's graph lacks
    made = Counter(type(f).__name__ for f in independent_nodes(gx.grad_fn)) - Counter(
        type(f).__name__ for f in independent_nodes(y.grad_fn))
    assert Counter(n.name for n in r.nodes if n.order == 1) == made and sum(made.values()) >= 2


# ----- (d) backward calls ---------------------------------------------------------------------------
def test_backward_calls_say_what_was_differentiated_and_accumulated() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    with gs.record(memory="off") as rec:
        m(x).sum().backward(inputs=[m.weight])
        (gb,) = torch.autograd.grad(m(x).sum(), [m.bias], retain_graph=True)
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
    r = rec.recording
    assert m.weight.grad is not None and gb.shape == (2,) and x.grad is not None
    c0, c1, c2 = r.backward_calls
    assert (c0.api, c1.api, c2.api) == ("backward", "autograd.grad", "backward")
    assert (c1.retain_graph, c2.retain_graph, c0.retain_graph, c0.create_graph) == (True, True, False, False)
    assert r.backward_leaves(c0) == (("m.weight",), ("m.weight",))
    assert r.backward_leaves(c1) == (("m.bias",), ())  # autograd.grad accumulates into nothing
    assert sorted(r.backward_leaves(c2)[1]) == ["input", "m.bias", "m.weight"]
    for c in (c0, c1, c2):
        assert c.first_step is not None and c.last_step is not None
        assert {r.steps[k].backward for k in range(c.first_step, c.last_step + 1)} == {c.index}
        assert [r.nodes[i].name for i in c.roots] == ["SumBackward0"]


# ----- (c) held, (f) the figures' methods ---------------------------------------------------------
def test_held_rows_and_figures_add_up_to_the_peak() -> None:
    model, x = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gs.record(memory="tracker", modules={"net": model}) as rec:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    r = rec.recording
    held = r.held
    assert isinstance(held, HeldMemory) and all(isinstance(h, HeldAllocation) for h in held.rows)
    assert held.moment == "peak"
    assert held.live_bytes == sum(h.bytes for h in held.rows) + held.omitted_bytes == r.peak_bytes
    assert sum(r.bytes_at_peak_by_module().values()) == r.peak_bytes
    assert sum(r.bytes_at_peak_by_category().values()) == r.peak_bytes
    assert sum(held.by_what().values()) == r.peak_bytes
    # a row and its allocation agree
    for h in held.rows:
        a = r.allocations[h.allocation]
        assert (a.bytes, a.key, a.module if h.what != "saved" else h.module) == (h.bytes, h.key, h.module)
    for n in r.nodes:
        alive = r.node_saved_alive_at_peak(n.id)
        assert alive is not None and alive <= r.node_saved_bytes(n.id)
    assert {"module_alive_at_peak", "node_saved_bytes", "node_saved_alive_at_peak", "category_at_peak"} <= set(FIGURES)
    assert all(isinstance(v, str) and v for v in FIGURES.values())
    # the typed fields survive a save and a load
    assert gs.recording.Recording.from_dict(json.loads(r.to_json())) == r


# ----- (e) naming by the user's variables -------------------------------------------------------------
G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _train_step(x: torch.Tensor) -> gs.Recording:
    """A helper that uses the notebook's global model (the case once named ``model[0]`` / ``0``)."""
    with gs.record(memory="off") as rec:
        G(x).sum().backward()
    return rec.recording


def _run(net: nn.Module, x: torch.Tensor) -> gs.Recording:
    with gs.record(memory="off") as rec:
        net(x).sum().backward()
    return rec.recording


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


def _modules(r: gs.Recording) -> set[str]:
    return {n.module for n in r.nodes if n.module}


def test_roots_are_named_by_the_users_variables() -> None:
    x = torch.randn(2, 4)
    r = _train_step(x)
    assert _modules(r) == {"G.0", "G.1", "G.2"}
    assert {n.leaf for n in r.nodes if n.leaf and n.leaf != "input"} == {"G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias"}
    assert _modules(_run(G, x)) == {"net.0", "net.1", "net.2"}  # the helper's own name for it
    w = _Wrapper()
    with gs.record(memory="off") as rec:
        w.body(x).sum().backward()
    assert _modules(rec.recording) == {"w.body.0", "w.body.1"}  # reached through the variable that holds it
    with gs.record(memory="off", modules={"gen": G}) as rec:
        G(x).sum().backward()
    assert _modules(rec.recording) == {"gen.0", "gen.1", "gen.2"}  # modules= wins


# ----- schema 1 files ---------------------------------------------------------------------------------
def test_a_schema_1_file_loads_into_the_typed_fields() -> None:
    """A file written by gradscope before schema 2 (a tracker recording of G(x).pow(2).sum()
    with retain_graph=True), read as it is on disk."""
    path = DATA / "schema1_mlp.json"
    raw = json.loads(path.read_text())
    assert raw["schema"] == 1
    r = gs.load(path)
    assert r.backward_calls == (BackwardCall(0, "backward", create_graph=False, retain_graph=True),)
    held = raw["extra"]["held"]
    assert r.held is not None and r.held.moment == held["moment"] and r.held.live_bytes == held["live_bytes"]
    assert [(h.key, h.bytes, h.what, h.node, h.module) for h in r.held.rows] == [
        (h["key"], h["bytes"], h["what"], h.get("node"), h.get("module")) for h in held["rows"]]
    assert (r.nodes_created, r.nodes_created_seen) == (raw["extra"]["nodes_created"], raw["extra"]["nodes_created_seen"])
    assert "held" not in r.extra and "backward_calls" not in r.extra
    assert len(r.nodes) == len(raw["nodes"]["id"]) and r.peak_bytes == raw["peak_bytes"]
    assert r.allocations == () and r.allocation_key == "none"  # schema 1 had no allocation table
    assert gs.recording.Recording.from_dict(json.loads(r.to_json())) == r  # and it saves as schema 2


# ----- tracker honesty ---------------------------------------------------------------------------------
def test_tracker_says_which_formulas_the_dispatch_mode_changes() -> None:
    x = torch.rand(64, requires_grad=True)
    with gs.record(memory="tracker") as rec:
        x.prod().backward()
    notes = [n for n in rec.recording.notes if "dispatch mode" in n]
    assert len(notes) == 1 and "prod ran here)" in notes[0]
    with gs.record(memory="cpu") as rec:
        x.prod().backward()
    assert not any("dispatch mode" in n for n in rec.recording.notes)
