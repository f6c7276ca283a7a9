"""gradscope's own layered layout (NOTE [ a layered layout of our own ] in gradscope._views.layered) and
the network simplex under it: least costs against brute force, geometry checked on the output
coordinates, and readability measured against Graphviz's dot on the same graphs."""

from __future__ import annotations

import itertools
import random
import shutil

import pytest
from _recordings import layered_recording
from test_layout import _create_graph_recording, _tiny_transformer

from gradscope._views.layered import NODE_SEP, RANK_SEP, layered
from gradscope._views.simplex import network_simplex
from gradscope.layout import layout_recording


# ----------------------------------------------------------------------------- network simplex
def _random_problem(rng: random.Random, n: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """A connected DAG (a random spanning tree plus extra edges, tail before head), minimum
    lengths 0-2, weights 0-3, and feasible ranks (longest paths)."""
    tail, head = [], []
    for v in range(1, n):
        tail.append(rng.randrange(v))
        head.append(v)
    for _ in range(rng.randint(0, 4)):
        a, b = sorted(rng.sample(range(n), 2))
        tail.append(a)
        head.append(b)
    minlen = [rng.randint(0, 2) for _ in tail]
    weight = [rng.randint(0, 3) for _ in tail]
    rank = [0] * n
    for v in range(n):  # tails come before heads: one pass is the longest path
        for t, h, m in zip(tail, head, minlen, strict=True):
            if h == v:
                rank[v] = max(rank[v], rank[t] + m)
    return tail, head, minlen, weight, rank


def _cost(ranks, tail, head, weight) -> int:
    return sum(w * (ranks[h] - ranks[t]) for t, h, w in zip(tail, head, weight, strict=True))


def _feasible(ranks, tail, head, minlen) -> bool:
    return all(ranks[h] - ranks[t] >= m for t, h, m in zip(tail, head, minlen, strict=True))


def test_network_simplex_finds_the_least_weighted_length() -> None:
    rng = random.Random(0)
    for _ in range(80):
        n = rng.randint(2, 5)
        tail, head, minlen, weight, rank = _random_problem(rng, n)
        got = network_simplex(n, tail, head, minlen, weight, rank)
        assert _feasible(got, tail, head, minlen) and min(got) == 0
        # every feasible ranking up to the longest path's total is no cheaper (brute force)
        top = sum(minlen) + 1
        best = min(_cost(r, tail, head, weight) for r in itertools.product(range(top + 1), repeat=n)
                   if _feasible(r, tail, head, minlen))
        assert _cost(got, tail, head, weight) == best, (tail, head, minlen, weight, got)


def test_network_simplex_stopped_early_is_feasible_and_pieces_are_joined() -> None:
    rng = random.Random(1)
    n = 300
    tail, head, minlen, weight, rank = _random_problem(rng, n)
    full = network_simplex(n, tail, head, minlen, weight, rank)
    for cap in (0, 3, 30):
        early = network_simplex(n, tail, head, minlen, weight, rank, max_iter=cap)
        assert _feasible(early, tail, head, minlen)
        assert _cost(early, tail, head, weight) >= _cost(full, tail, head, weight)
    # two components (0-1 and 2-3): solved as one, each at its least length
    r = network_simplex(4, [0, 2], [1, 3], [1, 2], [1, 1], [0, 5, 0, 9])
    assert (r[1] - r[0], r[3] - r[2], min(r)) == (1, 2, 0), r
    with pytest.raises(ValueError, match="not feasible"):
        network_simplex(2, [0], [1], [2], [1], [0, 1])


# ----------------------------------------------------------------------------- the layout
def _boxes_apart(pos, sizes) -> bool:
    """No two boxes of one row closer than the gap (checked on every pair)."""
    for a, b in itertools.combinations(range(len(pos)), 2):
        if pos[a][1] == pos[b][1]:
            room = (sizes[a][0] + sizes[b][0]) / 2 + NODE_SEP
            if abs(pos[a][0] - pos[b][0]) < room - 1e-6:
                return False
    return True


def test_generated_graphs_lay_out_downwards_apart_and_the_same_each_time() -> None:
    rng = random.Random(2)
    for _ in range(25):
        n = rng.randint(1, 60)
        edges = [tuple(sorted(rng.sample(range(n), 2))) for _ in range(rng.randint(0, 2 * n))] if n > 1 else []
        sizes = [(rng.choice([160, 190, 40]), rng.choice([40, 50])) for _ in range(n)]
        pos = layered(n, edges, sizes)
        assert len(pos) == n
        for s, d in edges:  # every edge runs down (sources above)
            assert pos[s][1] < pos[d][1]
        assert _boxes_apart(pos, sizes)
        rows = sorted({y for _, y in pos})
        for upper, lower in itertools.pairwise(rows):  # rows at least the rank gap apart
            assert lower - upper >= RANK_SEP + 40 - 1e-6
        assert layered(n, edges, sizes) == pos
    # a cycle (possible between folded boxes) is laid out, one of its edges drawn upwards
    pos = layered(3, [(0, 1), (1, 2), (2, 0)], [(160, 40)] * 3)
    assert len({y for _, y in pos}) == 3


def _crossings_and_length(lay, rec) -> tuple[int, float]:
    """Crossings of the straight edges the page draws (every node shown), and their total length."""
    segs = [(lay.x[e.src], lay.y[e.src], lay.x[e.dst], lay.y[e.dst], e.src, e.dst) for e in rec.edges]

    def side(ax, ay, bx, by, cx, cy):
        return (cy - ay) * (bx - ax) - (by - ay) * (cx - ax)

    crossings = 0
    for a, b in itertools.combinations(segs, 2):
        if len({a[4], a[5], b[4], b[5]}) < 4:
            continue
        if (side(*a[:4], *b[:2]) * side(*a[:4], *b[2:4]) < 0
                and side(*b[:4], *a[:2]) * side(*b[:4], *a[2:4]) < 0):
            crossings += 1
    return crossings, sum(((s[2] - s[0]) ** 2 + (s[3] - s[1]) ** 2) ** 0.5 for s in segs)


@pytest.fixture(scope="module")
def graphs() -> dict[str, object]:
    out = {"create_graph x24": _create_graph_recording(24), "encoder x2": layered_recording(2)}
    for kind in ("gpt2", "bert", "vit"):
        out[kind] = _tiny_transformer(kind)[0]
    return out


def test_the_main_path_is_one_straight_column(graphs) -> None:
    """The demo's graph: the forward chain (Addmm, Tanh) one column, the create_graph chain beside it
    another, each weight's gradient beside the node that computes it (no edge hangs to the bottom)."""
    rec = graphs["create_graph x24"]
    lay = layout_recording(rec, collapse=False)
    forward = {lay.x[i] for i, n in enumerate(rec.nodes) if n.order == 0 and n.name in ("AddmmBackward0", "TanhBackward0")}
    backward = {lay.x[i] for i, n in enumerate(rec.nodes) if n.order == 1 and n.name in ("MmBackward0", "TanhBackwardBackward0")}
    assert len(forward) == 1 and len(backward) == 1, (forward, backward)
    rows = sorted(set(lay.y))
    spans = [abs(rows.index(lay.y[e.dst]) - rows.index(lay.y[e.src])) for e in rec.edges]
    assert max(spans) <= 3


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot, to compare with, is not installed")
def test_as_readable_as_dot(graphs) -> None:
    """Every node of each graph drawn with straight edges, as the page draws them: no more
    crossings than dot's picture (a quarter more at most, on BERT's attention), edges about as long,
    no wider."""
    for name, rec in graphs.items():
        ours = layout_recording(rec, collapse=False)
        dot = layout_recording(rec, collapse=False, engine="dot")
        (c_ours, len_ours), (c_dot, len_dot) = _crossings_and_length(ours, rec), _crossings_and_length(dot, rec)
        assert c_ours <= 1.25 * c_dot + 2, (name, c_ours, c_dot)
        assert len_ours <= 1.05 * len_dot, (name, len_ours, len_dot)
        assert ours.width <= dot.width + 10 and ours.height <= 1.05 * dot.height, (name, ours.width, dot.width)
