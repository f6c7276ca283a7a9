"""Reliability at scale: a graph of 210,000 nodes records without recursion errors and with memory
linear in its size (memory="off"; memory="tracker" at 105,000 nodes, as its dispatch mode costs
~0.2 ms an operation), gs.graph walks it and its JSON round-trips; a long training loop recorded
with a bound on timeline events keeps the peak exact.

NOTE [ freeing deep graphs ]: PyTorch itself overflows the C stack (segmentation fault) freeing a
chain of more than ~50,000 nodes once Python has walked it through ``next_functions`` (torchviz's
walk does the same; without any walk it frees fine). These tests keep a result every 10,000 steps
and drop them last-first, so the chain is freed in pieces; gradscope cannot change how PyTorch
frees a graph the user owns; recordings of more than 40,000 nodes say so in their notes.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from test_reliability import leftovers
from torch import nn

import gradscope as gs
from gradscope.recording import Phase

STEPS = {"off": 100_000, "tracker": 50_000}


def _nodes(steps: int) -> int:
    """x and one leaf a step (AccumulateGrad), one add a step, a tanh every 10 steps, one sum."""
    return 1 + 2 * steps + steps // 10 + 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chain(leaves: list[torch.Tensor], x: torch.Tensor, keep: list[torch.Tensor]) -> torch.Tensor:
    y = x
    for k, w in enumerate(leaves):
        y = y + w
        if k % 10 == 0:
            y = y.tanh()  # saves its result
        if k % 10_000 == 0:
            keep.append(y)
    return y.sum()


def _leaves(steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    ws = list(torch.randn(steps, 1).mul_(0.01).unbind(0))
    return [w.clone().requires_grad_(True) for w in ws], torch.full((1,), 0.5, requires_grad=True)


def _free(keep: list[torch.Tensor]) -> None:
    """See NOTE [ freeing deep graphs ]."""
    while keep:
        keep.pop()  # reference counting frees each piece at once


def _reference(steps: int) -> list[torch.Tensor]:
    ws, x = _leaves(steps)
    keep: list[torch.Tensor] = []
    _chain(ws, x, keep).backward()
    out = [torch.cat([w.grad for w in ws]), x.grad.clone()]
    _free(keep)
    return out


@pytest.mark.parametrize(("memory", "kib_per_node"), [("off", 6), ("tracker", 8)])
def test_deep_graph_records_in_linear_memory(memory: str, kib_per_node: int, tmp_path: Any) -> None:
    steps = STEPS[memory]
    nodes = _nodes(steps)
    reference = _reference(steps)
    ws, x = _leaves(steps)
    keep: list[torch.Tensor] = []
    gc.collect()
    rss0 = _rss()
    with gs.record(memory=memory) as rec:
        loss = _chain(ws, x, keep)
        g = gs.graph(loss) if memory == "off" else None  # the same graph, walked without backward
        loss.backward()
    grown = _rss() - rss0
    r = rec.recording
    assert r.complete and "internal error" not in "\n".join(r.notes)
    if gs._base.compat.capabilities().nodes_persist:  # see NOTE [ freeing deep graphs ] in gradscope._capture.walk
        assert any("gs.release(result)" in n for n in r.notes)
    assert len(r.nodes) == nodes and len(r.steps) == nodes
    assert all(n.executed == 1 for n in r.nodes)
    assert len(r.edges) == nodes - 1  # a tree: every node but the root feeds exactly one
    assert len(r.saved) == steps // 10 and r.saved_bytes == 4 * (steps // 10)
    assert sum(1 for n in r.nodes if n.leaf == "input") == steps + 1
    assert torch.equal(torch.cat([w.grad for w in ws]), reference[0])
    assert torch.equal(x.grad, reference[1])
    if memory == "tracker":
        assert r.peak_bytes > 0 and r.peak is not None
    # The graph itself costs PyTorch ~1.1 KiB a node; gradscope's per-pass hooks ~0.7 KiB more.
    assert grown < kib_per_node * 1024 * nodes, f"{grown / nodes:.0f} bytes per node"
    del loss
    _free(keep)
    assert leftovers() == []
    if g is not None:
        assert len(g.nodes) == nodes and len(g.edges) == nodes - 1 and len(g.saved) == steps // 10
        assert sorted(n.name for n in g.nodes) == sorted(n.name for n in r.nodes)
        path = tmp_path / "deep.gscope.json"
        g.save(path)
        assert gs.load(path) == g


def _train(memory: str, max_events: int | None) -> gs.Recording:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(60, 16, 32)
    # keep="all": one timeline over the whole loop (see NOTE [ iterations ] in gradscope._passes.iterations)
    with gs.record(memory=memory, max_events=max_events, keep="all") as rec:
        for k, xb in enumerate(data):
            opt.zero_grad(set_to_none=True)
            loss = model(xb * (1 + k % 7)).pow(2).mean()  # a peak in the middle of the loop
            loss.backward()
            opt.step()
    return rec.recording


@pytest.mark.parametrize("memory", ["tracker", "cpu"])
def test_bounded_timeline_keeps_the_peak_exact(memory: str) -> None:
    full = _train(memory, None)
    cut = _train(memory, 100)
    assert full.timeline_dropped == 0 and len(full.timeline) > 3000
    assert len(cut.timeline) <= 102  # the limit, plus the peak and the last point
    assert cut.timeline_dropped == len(full.timeline) - len(cut.timeline)
    assert cut.peak_bytes == full.peak_bytes > 0
    assert max(p.live for p in cut.timeline) == cut.peak_bytes  # the peak point itself is kept
    assert cut.peak is not None and full.peak is not None
    assert (cut.peak.bytes, cut.peak.phase, cut.peak.label, cut.peak.node, cut.peak.step,
            cut.peak.module) == (full.peak.bytes, full.peak.phase, full.peak.label,
                                 full.peak.node, full.peak.step, full.peak.module)
    assert cut.timeline[-1].live == full.timeline[-1].live
    assert cut.backward_passes == full.backward_passes == 60
    # Adam's steps are the optimizer phase; the profiler also sees zero_grad's frees (other)
    phases = {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER} | ({Phase.OTHER} if memory == "cpu" else set())
    assert {p.phase for p in full.timeline} == phases
    assert {Phase.FORWARD, Phase.BACKWARD} <= {p.phase for p in cut.timeline} <= phases
    assert "points dropped to stay within max_events" in cut.summary()
    assert leftovers() == []
