"""gs.graph: the graph behind a result without running backward, and to_dot."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import MODELS, independent_nodes
from torch.autograd.graph import saved_tensors_hooks

import gradscope as gs
from gradscope.recording import Kind


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_matches_walk_and_saved(name: str) -> None:
    model, x = MODELS[name]()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(x).pow(2).mean()  # the same forward, seen by an independent pack hook
    loss = model(x).pow(2).mean()
    g = gs.graph(loss, modules=model)
    assert len(g.nodes) == len(independent_nodes(loss.grad_fn))
    assert g.saved_bytes == sum(storages.values())
    assert {n.leaf for n in g.nodes if n.leaf} == {k for k, _ in model.named_parameters()}
    kinds = {s.kind for s in g.saved}
    assert Kind.ACTIVATION in kinds and Kind.PARAMETER in kinds
    assert g.steps == () and g.timeline == ()
    loss.backward()  # the graph is untouched by gs.graph


def test_graph_without_grad_fn_says_what_to_pass() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(gs.GradscopeError, match=r"shape \(3, 4\).*does not require grad.*e\.g\. the loss"):
        gs.graph(x)
    w = torch.randn(2, requires_grad=True)
    with pytest.raises(gs.GradscopeError, match="leaf that requires grad"):
        gs.graph(w)
    with pytest.raises(gs.GradscopeError, match="takes tensors"):
        gs.graph([1.0])


def test_graph_after_backward_is_clear_error() -> None:
    w = torch.randn(4, requires_grad=True)
    y = (w.exp() * w).sum()
    y.backward()
    with pytest.raises(gs.GradscopeError, match="already freed"):
        gs.graph(y)


def test_deep_graph_no_recursion() -> None:
    w = torch.ones(1, requires_grad=True)
    y = w
    for _ in range(20_000):
        y = y * 1.0001
    g = gs.graph(y)
    assert len(g.nodes) == 20_001 and len(g.edges) == 20_000


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot not installed")
def test_to_dot_has_nodes_and_saved_boxes() -> None:
    model, x = MODELS["mlp"]()
    g = gs.graph(model(x).sum(), modules=model)
    dot = g.to_dot()
    src = dot.source
    assert src.count("->") == len(g.edges) + len(g.saved)
    assert "0.weight" in src and "_saved_result" in src
    svg = dot.pipe(format="svg").decode()
    assert svg.count('class="node"') == len(g.nodes) + len(g.saved)
