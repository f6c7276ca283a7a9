"""Layout: engines, module collapse and inner layouts (values checked exactly)."""

from __future__ import annotations

import shutil

import pytest
from _recordings import hostile_recording, layered_recording, tiny_recording

from gradscope.errors import GradscopeError
from gradscope.layout import (
    DOT_MAX_NODES,
    GROUP_W,
    NODE_W,
    choose_depth,
    group_nodes,
    layout_dag,
    layout_recording,
)
from gradscope.recording import Edge, Node, Recording


def test_group_nodes_by_prefix_and_singletons_stay_loose():
    mods = ["a.0.x", "a.0.y", "a.1.x", None, "b", "a.1"]
    group, keys = group_nodes(mods, 2)
    assert keys == ["a.0", "a.1"]
    assert group == [0, 0, 1, -1, -1, 1]
    group1, keys1 = group_nodes(mods, 1)
    assert keys1 == ["a"]
    assert group1 == [0, 0, 0, -1, -1, 0]


def test_choose_depth_small_graphs_are_not_collapsed():
    assert choose_depth(["a.b"] * 10) is None


def test_choose_depth_picks_layers_of_an_encoder():
    rec = layered_recording(48)
    assert choose_depth([n.module for n in rec.nodes]) == 2


@pytest.mark.parametrize("engine", ["sugiyama", "dot"])
def test_forward_direction_is_top_to_bottom(engine):
    if engine == "dot" and shutil.which("dot") is None:
        pytest.skip("Graphviz dot is not installed")
    rec = tiny_recording()
    lay = layout_recording(rec, engine=engine)
    assert lay.engine == engine
    assert lay.groups == ()
    assert lay.group == (-1,) * 6
    for e in rec.edges:  # every edge points downwards
        assert lay.y[e.src] < lay.y[e.dst], (e, lay.y)
    # boxes stay inside the drawing
    assert min(lay.x) - NODE_W / 2 >= 0 and max(lay.x) + NODE_W / 2 <= lay.width


def test_auto_engine_uses_dot_only_for_small_graphs():
    small = layout_recording(tiny_recording())
    assert small.engine == ("dot" if shutil.which("dot") else "sugiyama")
    big = layout_recording(layered_recording(8))  # 601 nodes > DOT_MAX_NODES
    assert len(big.x) > DOT_MAX_NODES
    assert big.engine == "sugiyama"


def test_encoder_opens_collapsed_to_its_layers():
    rec = layered_recording(48)
    lay = layout_recording(rec)
    assert lay.depth == 2
    assert len(lay.groups) == 48
    assert sorted(g.key for g in lay.groups) == sorted(f"layers.{i}" for i in range(48))
    assert all(g.count == 75 for g in lay.groups)
    assert lay.visible_count == 49  # 48 layers + the loss node
    # inner coordinates fit inside each group's expanded content
    for i, g in enumerate(lay.group):
        if g >= 0:
            grp = lay.groups[g]
            assert 0 <= lay.x[i] - NODE_W / 2 and lay.x[i] + NODE_W / 2 <= grp.inner_w
            assert 0 <= lay.y[i] and lay.y[i] <= grp.inner_h
    assert all(g.w == GROUP_W for g in lay.groups)


def test_collapse_options():
    rec = layered_recording(4)
    assert layout_recording(rec, collapse=False).groups == ()
    # automatic depth: the shallowest showing at least two dozen boxes (6 submodules x 4 layers)
    assert len(layout_recording(rec, collapse=True).groups) == 24
    assert len(layout_recording(rec, collapse=2).groups) == 4
    with pytest.raises(GradscopeError, match="collapse"):
        layout_recording(rec, collapse="sometimes")
    with pytest.raises(GradscopeError, match="engine"):
        layout_recording(rec, engine="neato")


def test_deep_chain_needs_no_recursion():
    n = 5000
    rec = Recording(
        nodes=tuple(Node(i, "MulBackward0") for i in range(n)),
        edges=tuple(Edge(i + 1, i) for i in range(n - 1)),
    )
    lay = layout_recording(rec, engine="sugiyama")
    assert lay.y[n - 1] < lay.y[0]
    assert len(set(lay.y)) == n


def test_empty_graph_and_hostile_names():
    lay = layout_recording(Recording())
    assert lay.x == () and lay.visible_count == 0
    h = layout_recording(hostile_recording(), collapse=1)
    # only the first hostile module holds two nodes (the sum and one leaf); the others stay loose
    assert [(g.key, g.count) for g in h.groups] == [("<img src=x onerror=alert(1)>", 2)]
    pos, w, hgt = layout_dag(2, [(0, 1)], engine="sugiyama")
    assert pos[0][1] < pos[1][1] and w > 0 and hgt > 0


def test_sink_layering_puts_leaves_next_to_their_consumer():
    from gradscope.layout import _sink_layers

    # chain 3 -> 2 -> 1 -> 0 (the loss), and a leaf 4 used only by node 1
    assert _sink_layers(5, [(3, 2), (2, 1), (1, 0), (4, 1)]) == [3, 2, 1, 0, 1]
    # a cycle between collapsed boxes still gets layers, without recursion or looping forever
    layers = _sink_layers(3, [(0, 1), (1, 0), (1, 2)])
    assert layers[2] == max(layers) and len(layers) == 3


def test_twenty_thousand_nodes_fully_expanded_lays_out():
    rec = layered_recording(267)
    lay = layout_recording(rec, collapse=False)
    assert len(lay.x) == 20026 and lay.visible_count == 20026
    # each parameter leaf sits one layer above the node that uses it
    rows = sorted(set(lay.y))
    step = rows[1] - rows[0]
    for e in rec.edges[:2000]:
        if rec.nodes[e.src].leaf:
            assert lay.y[e.dst] - lay.y[e.src] == pytest.approx(step)


def test_auto_engine_falls_back_to_sugiyama_when_dot_fails(monkeypatch):
    import gradscope.layout as L

    def broken(*args, **kwargs):
        raise GradscopeError("gradscope: Graphviz dot failed (TimeoutExpired); use engine='sugiyama'.")

    monkeypatch.setattr(L, "_layout_dot", broken)
    monkeypatch.setattr(L, "_dot_available", lambda: True)
    assert layout_recording(tiny_recording()).engine == "sugiyama"
    with pytest.raises(GradscopeError, match="dot failed"):
        layout_recording(tiny_recording(), engine="dot")


def _create_graph_recording(depth: int = 8):
    import torch

    import gradscope as gs
    from gradscope.strategies import mixed_grad

    torch.manual_seed(0)
    G = torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]).eval()
    z, y = torch.randn(8, 64), torch.randn(8, 64, requires_grad=True)
    with gs.record(memory="off", modules={"G": G}) as r:
        mixed_grad(lambda a, b: ((a + b) ** 3).sum(), G, z, y, method="create_graph")
    return r.recording


@pytest.mark.parametrize("engine", ["dot", "sugiyama"])
def test_create_graph_nodes_sit_beside_what_they_differentiate(engine):
    if engine == "dot" and shutil.which("dot") is None:
        pytest.skip("Graphviz dot is not installed")
    rec = _create_graph_recording(8)
    assert {n.order for n in rec.nodes} == {0, 1}
    lay = layout_recording(rec, collapse=False, engine=engine)
    order = [n.order for n in rec.nodes]
    up = down = 0
    for e in rec.edges:
        if order[e.src] == order[e.dst] == 1:
            assert lay.y[e.dst] < lay.y[e.src], e  # gradients' chain runs upwards
            up += 1
        elif order[e.src] == order[e.dst] == 0:
            assert lay.y[e.dst] > lay.y[e.src], e  # forward runs down
            down += 1
    assert up >= 16 and down >= 32
    if engine == "dot":
        # no edge spans the drawing: the create_graph chain is not hung below the forward one
        spans = sorted(abs(lay.y[e.dst] - lay.y[e.src]) for e in rec.edges)
        assert spans[-1] < lay.height / 6  # three ranks at most, here
        # compact: a few columns (forward chain, leaves, create_graph chain), not one per long edge
        # (before: 1,892 px for this graph, 2,706 px for the 24-layer demo)
        assert lay.width <= 7 * (NODE_W + 20), lay.width


def test_small_graphs_travel_with_a_folded_level():
    from gradscope.layout import layout_levels

    rec = _create_graph_recording(8)
    levels = layout_levels(rec)
    assert [lv.depth for lv in levels] == [None, 2]
    assert levels[1].visible_count < len(rec.nodes) * 0.75
    assert [lv.depth for lv in layout_levels(rec, collapse=False)] == [None]
    assert [lv.depth for lv in layout_levels(layered_recording(8))] == [3]  # big: folded only
