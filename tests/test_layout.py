"""Layout: engines, module collapse and inner layouts (values checked exactly)."""

from __future__ import annotations

import shutil

import pytest
from _recordings import hostile_recording, layered_recording, tiny_recording

from gradscope.errors import GradscopeError
from gradscope.layout import (
    GROUP_W,
    NODE_W,
    choose_depth,
    group_nodes,
    layout_dag,
    layout_levels,
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


@pytest.mark.parametrize("engine", ["layered", "sugiyama", "dot"])
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


def test_auto_engine_is_the_layered_one_whatever_is_installed(monkeypatch):
    """NOTE [ layout engine thresholds ]: the same page with Graphviz's dot on PATH and without
    (as ``pip install "gradscope[notebook]"`` leaves a machine)."""
    small, big = tiny_recording(), layered_recording(8)
    with_dot = [layout_recording(r) for r in (small, big)]
    monkeypatch.setenv("PATH", "")
    assert shutil.which("dot") is None
    without = [layout_recording(r) for r in (small, big)]
    assert [lay.engine for lay in with_dot] == ["layered", "layered"]
    assert with_dot == without
    with pytest.raises(GradscopeError, match="needs Graphviz's dot program"):
        layout_recording(small, engine="dot")


def test_encoder_opens_folded_as_one_box_of_repeated_layers():
    rec = layered_recording(48)
    lay = layout_recording(rec)
    # the 48 identical layers fold into one repeat box holding 48 layer boxes, each holding its
    # six submodules; the loss node stays loose
    top = [g for g in lay.groups if g.parent < 0]
    assert [(g.label, g.repeat, g.count) for g in top] == [("layers.0 – layers.47 (×48)", 48, 48 * 75)]
    rep = lay.groups.index(top[0])
    blocks = [g for g in lay.groups if g.parent == rep]
    assert [g.key for g in blocks] == [f"layers.{i}" for i in range(48)]
    assert [g.label for g in blocks] == [f"layers.{i}" for i in range(48)]
    assert all(g.count == 75 for g in blocks)
    assert lay.visible_count == 2
    subs = {g.label for g in lay.groups if g.parent == lay.groups.index(blocks[0])}
    assert subs == {"self_attn", "linear1", "dropout", "linear2", "norm1", "norm2"}
    # inner coordinates fit inside each box's content
    for i, g in enumerate(lay.group):
        if g >= 0:
            grp = lay.groups[g]
            assert 0 <= lay.x[i] - NODE_W / 2 and lay.x[i] + NODE_W / 2 <= grp.inner_w
            assert 0 <= lay.y[i] and lay.y[i] <= grp.inner_h
    for grp in lay.groups:
        if grp.parent >= 0:
            outer = lay.groups[grp.parent]
            assert 0 <= grp.x - grp.w / 2 and grp.x + grp.w / 2 <= outer.inner_w
    assert all(g.w == GROUP_W for g in lay.groups)
    # forward-down: layer 0 (the input side) above layer 47, the repeat box above the loss
    ys = {g.key: g.y for g in blocks}
    assert all(ys[f"layers.{i}"] < ys[f"layers.{i + 1}"] for i in range(47))
    assert top[0].y < lay.y[0] and rec.nodes[0].name == "MeanBackward0"


def test_collapse_options():
    rec = layered_recording(4)
    assert layout_recording(rec, collapse=False).groups == ()
    # nested: one repeat box, its 4 layers, their 6 submodules each
    assert len(layout_recording(rec, collapse=True).groups) == 1 + 4 + 24
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
    for engine in ("layered", "sugiyama"):
        lay = layout_recording(rec, engine=engine)
        assert lay.y[n - 1] < lay.y[0]
        assert len(set(lay.y)) == n
        assert len(set(lay.x)) == 1  # one straight column


def test_empty_graph_and_hostile_names():
    lay = layout_recording(Recording())
    assert lay.x == () and lay.visible_count == 0
    h = layout_recording(hostile_recording(), collapse=1)
    # only the first hostile module holds two nodes (the sum and one leaf); the others stay loose
    assert [(g.key, g.count) for g in h.groups] == [("<img src=x onerror=alert(1)>", 2)]
    for engine in ("layered", "sugiyama"):
        pos, w, hgt = layout_dag(2, [(0, 1)], engine=engine)
        assert pos[0][1] < pos[1][1] and w > 0 and hgt > 0


def test_sink_layering_puts_leaves_next_to_their_consumer():
    from gradscope._views.layered import sink_layers as _sink_layers

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


def test_dot_asked_for_says_when_it_fails(monkeypatch):
    import gradscope._views.layout as L

    def broken(*args, **kwargs):
        raise GradscopeError("gradscope: Graphviz dot failed (TimeoutExpired); leave engine='auto'.")

    monkeypatch.setattr(L, "_layout_dot_many", broken)
    monkeypatch.setattr(L, "_dot_available", lambda: True)
    assert layout_recording(tiny_recording()).engine == "layered"  # auto never runs dot
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


@pytest.mark.parametrize("engine", ["layered", "dot", "sugiyama"])
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
    if engine in ("dot", "layered"):
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
    assert [lv.depth is None for lv in levels] == [True, False]
    assert levels[1].visible_count < len(rec.nodes) * 0.75
    # the Sequential's box is the whole model, so its layers are the top boxes; alternating
    # Linear and Tanh are no repeats; a list index keeps its list's name ("G.3", not "3")
    assert [(g.key, g.label, g.parent, g.repeat) for g in levels[1].groups] == [
        (f"G.{k}", f"G.{k}", -1, 1) for k in range(16)
    ]
    assert [lv.depth for lv in layout_levels(rec, collapse=False)] == [None]
    big = layout_levels(layered_recording(8))  # big: folded only
    assert len(big) == 1 and big[0].depth == 3 and big[0].visible_count == 2


# ----- nested folding of real transformers (tiny configs, random init) --------------------------
def _tiny_transformer(kind: str):
    """A recording of one training step of a 4-layer, 32-wide model from ``transformers``, and the
    module paths of its embeddings and its repeated blocks."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    import gradscope as gs

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                            bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 100, (2, 8))
        opt = torch.optim.AdamW(model.parameters())
        with gs.record(memory="off") as r:
            model(ids, labels=ids).loss.backward()
            opt.step()
        return r.recording, ["model.transformer.wte", "model.transformer.wpe"], "model.transformer.h"
    if kind == "bert":
        cfg = tf.BertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            vocab_size=100, max_position_embeddings=16)
        model = tf.BertForSequenceClassification(cfg)
        ids = torch.randint(0, 100, (2, 8))
        with gs.record(memory="off") as r:
            model(ids, labels=torch.tensor([0, 1])).loss.backward()
        return r.recording, ["model.bert.embeddings"], "model.bert.encoder.layer"
    cfg = tf.ViTConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                       image_size=16, patch_size=4, num_labels=3)
    model = tf.ViTForImageClassification(cfg)
    with gs.record(memory="off") as r:
        model(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([0, 2])).loss.backward()
    return r.recording, ["model.vit.embeddings"], "model.vit.layers"


def _chain(lay, group: int) -> list[int]:
    out = []
    while group >= 0:
        out.append(group)
        group = lay.groups[group].parent
    return out[::-1]


def _above(lay, a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether box or node ``a`` is drawn above ``b``: compared in the innermost content holding
    both (opening boxes only pushes what is below further down, so that order is the drawing's)."""
    def chain(item):
        kind, i = item
        return _chain(lay, i) if kind == "g" else _chain(lay, lay.group[i]) + [("n", i)]

    ca, cb = chain(a), chain(b)
    k = 0
    while k < min(len(ca), len(cb)) and ca[k] == cb[k]:
        k += 1
    assert k < len(ca) and k < len(cb), (a, b)  # neither holds the other

    def y(x):
        return lay.y[x[1]] if isinstance(x, tuple) else lay.groups[x].y

    return y(ca[k]) < y(cb[k])


@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit"])
def test_transformer_folds_into_nested_boxes_with_repeated_blocks(kind):
    rec, embeddings, blocks_path = _tiny_transformer(kind)
    levels = layout_levels(rec)
    lay = levels[-1]
    assert lay.depth is not None and lay.groups
    name = blocks_path.rsplit(".", 1)[1]
    # the four blocks fold as one repeat box holding one box per block
    reps = [g for g in lay.groups if g.repeat > 1]
    assert [(g.label, g.repeat) for g in reps] == [(f"{name}.0 – {name}.3 (×4)", 4)]
    rep = lay.groups.index(reps[0])
    blocks = [gi for gi, g in enumerate(lay.groups) if g.parent == rep]
    assert [lay.groups[b].key for b in blocks] == [f"{blocks_path}.{i}" for i in range(4)]
    assert [lay.groups[b].label for b in blocks] == [f"{name}.{i}" for i in range(4)]
    # each block's box holds exactly the nodes made by its modules (counted from the recording)
    for b in blocks:
        path = lay.groups[b].key
        mine = {n.id for n in rec.nodes if n.module and (n.module == path or n.module.startswith(path + "."))}
        held = {i for i in range(len(rec.nodes)) if b in _chain(lay, lay.group[i])}
        assert held == mine and lay.groups[b].count == len(mine) > 10
        # its submodules' boxes are inside it, labelled relative to it
        subs = [g for g in lay.groups if g.parent == b]
        assert subs and all(g.key.startswith(path + ".") and g.label == g.key[len(path) + 1:] for g in subs)
    assert reps[0].count == sum(lay.groups[b].count for b in blocks)
    # names shortened from the box around them, never cut from the left
    for g in lay.groups:
        assert not g.label.startswith("…") and len(g.label) <= 28, g.label
        if g.parent >= 0 and g.repeat == 1:
            assert g.key.endswith("." + g.label) and g.label != g.key
    for i, short in enumerate(lay.labels):
        if short is not None:
            assert rec.nodes[i].leaf.endswith("." + short) and not short.startswith("…")
    # forward-down: embeddings above the first block above the last block above the loss
    sinks = set(range(len(rec.nodes))) - {e.src for e in rec.edges}
    assert len(sinks) == 1
    loss = sinks.pop()
    emb = [lay.groups.index(g) for g in lay.groups if g.key in embeddings]
    assert len(emb) == len(embeddings)
    for e in emb:
        assert _above(lay, ("g", e), ("g", rep))
        assert _above(lay, ("g", e), ("n", loss))
    assert _above(lay, ("g", blocks[0]), ("g", blocks[-1]))
    assert all(_above(lay, ("g", blocks[k]), ("g", blocks[k + 1])) for k in range(3))
    assert _above(lay, ("g", rep), ("n", loss))


def test_nested_box_figures_include_inner_boxes():
    """What the widget sums per box (saved activations by column, alive at peak by module path)
    covers the nodes of the boxes inside it: checked with node counts, computed from the paths."""
    from collections import Counter

    rec, _, _ = _tiny_transformer("bert")
    lay = layout_recording(rec, collapse=True)
    per_module = Counter(n.module for n in rec.nodes if n.module)
    assert lay.group_totals(dict(per_module)) == [g.count for g in lay.groups]
    cols = lay.group_columns()
    assert len(cols) == lay.depth
    seen = Counter()
    for col in cols:
        seen.update(g for g in col if g >= 0)
    assert [seen[g] for g in range(len(lay.groups))] == [g.count for g in lay.groups]
