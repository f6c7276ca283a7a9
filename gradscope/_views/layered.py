"""A layered (Sugiyama) layout of a directed graph in pure Python: ``gradscope.layout``'s engine,
which draws as Graphviz's ``dot`` draws without needing the program.

NOTE [ a layered layout of our own ]: ``pip install "gradscope[notebook]"`` brings no ``dot`` (the
``graphviz`` package on PyPI only calls the program), and igraph's Sugiyama layout, which knows no
box sizes, edge weights or straight columns, left the pages unreadable (a wide fan of nodes, edges
across the canvas). This module takes dot's steps (Gansner et al., 1993), with the network simplex
of :mod:`gradscope._views.simplex` where dot uses it:

1. cycles broken by reversing the back edges of a depth-first walk (for the layout only);
2. layers: from the sinks (NOTE [ layering next to the consumer ] in gradscope._views.layout), each node
   moved to the end of its slack its heavier side pulls it to, then the weighted edge lengths made
   least by the network simplex (a weight's gradient in a create_graph pass comes up beside what
   computes it instead of hanging at the bottom);
3. an edge over several layers gets a chain of narrow virtual nodes, one per layer it crosses;
4. the order within layers: breadth-first, then sweeps down and up placing each node at the
   (weighted) median of its neighbours in the layer before (a node with none keeps its place),
   each followed by swaps of neighbours that lessen the crossings (dot's transpose); the order
   with the fewest crossings (counted exactly: Barth, Juenger and Mutzel) is kept;
5. x: Brandes and Koepf's four alignments, compacted and balanced, then made least by the network
   simplex on dot's auxiliary graph (a node per edge measures the horizontal distance between its
   ends; virtual nodes' edges weigh more, so long edges run straight; neighbours keep half their
   widths and a gap apart), balanced as dot balances it. An edge between two boxes of one *group*
   weighs a hundredfold, as in dot: the main path (see NOTE [ drawing create_graph nodes beside
   what they differentiate ] in gradscope._views.layout) is one straight column;
6. y: the layers, each as tall as its tallest box.

Everything is iterative and deterministic (the same graph gives the same picture, whatever the
machine). On autograd graphs of a few hundred nodes it takes a few hundredths of a second; big
contents get fewer sweeps and skip the network simplex (``_SIMPLEX_MAX``), so 20,000 nodes take about
a second (``benchmarks/bench_layout.py`` prints the times, crossings and edge lengths beside dot's).

Example:
    >>> pos = layered(3, [(0, 2), (1, 2)], [(160, 40)] * 3)
    >>> pos[0][1] == pos[1][1] < pos[2][1]  # both inputs above the node they feed
    True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from gradscope._views.simplex import network_simplex

__all__ = ["layered", "sink_layers"]

NODE_SEP = 20.0  # horizontal gap between two boxes in a layer (dot's nodesep, in px)
RANK_SEP = 40.0  # vertical gap between two layers (dot's ranksep, in px)
_VIRTUAL_W = 10.0  # a long edge's virtual node: the room the edge takes in a layer it crosses
_SIMPLEX_MAX = 2000  # nodes (virtual ones included) up to which the network simplex places them
_SWEEPS = 24  # sweeps of the ordering at most (fewer on big graphs: see _sweeps), as dot's MaxIter
_GROUP_FACTOR = 100  # an edge within a group weighs this much more for x (dot's group)
_QUIT = 8  # sweeps without fewer crossings before the ordering stops (dot's MinQuit)
_TRANSPOSE_MAX = 3000  # nodes (virtual ones included) up to which neighbours are swapped too


def sink_layers(n: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Layer of each node: the sinks at the bottom, every other node one layer above its highest
    consumer (see NOTE [ layering next to the consumer ] in gradscope._views.layout). Iterative (Kahn's
    algorithm); nodes on a cycle are placed above their known consumers."""
    preds: list[list[int]] = [[] for _ in range(n)]
    remaining = [0] * n
    for s, d in edges:
        if s != d:
            preds[d].append(s)
            remaining[s] += 1
    depth = [0] * n
    done = [False] * n
    stack = [v for v in range(n) if remaining[v] == 0]
    processed = 0
    while True:
        while stack:
            u = stack.pop()
            done[u] = True
            processed += 1
            for p in preds[u]:
                if depth[u] + 1 > depth[p]:
                    depth[p] = depth[u] + 1
                remaining[p] -= 1
                if remaining[p] == 0:
                    stack.append(p)
        if processed >= n:
            break
        # a cycle: release the pending node with the fewest unprocessed consumers
        v = min((v for v in range(n) if not done[v] and remaining[v] > 0), key=lambda v: remaining[v])
        remaining[v] = 0
        stack.append(v)
    top = max(depth, default=0)
    return [top - d for d in depth]


def _tighten(n: int, edges: dict[tuple[int, int], int], layer: list[int]) -> list[int]:
    """Shorten edges: a node whose incoming edges weigh more than its outgoing ones moves up to
    just below its lowest input, one whose outgoing edges weigh more moves down to just above its
    highest consumer (a sink left at the bottom by the layering, such as a weight's gradient in a
    create_graph pass, comes up beside what computes it). Each move lowers the total weighted
    edge length, so the passes end; at most a few are needed."""
    ins: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    outs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for (s, d), w in edges.items():
        outs[s].append((d, w))
        ins[d].append((s, w))
    layer = list(layer)
    for _ in range(8):
        changed = False
        for v in sorted(range(n), key=lambda v: (layer[v], v)):
            w_in = sum(w for _, w in ins[v])
            w_out = sum(w for _, w in outs[v])
            if w_in > w_out:
                target = max(layer[u] for u, _ in ins[v]) + 1
            elif w_out > w_in:
                target = min(layer[u] for u, _ in outs[v]) - 1
            else:
                continue
            if target != layer[v]:
                layer[v] = target
                changed = True
        if not changed:
            break
    low = min(layer, default=0)
    return [lay - low for lay in layer]


def _acyclic(n: int, edges: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """The edges with each back edge of a depth-first walk reversed (an iterative walk)."""
    out: list[list[int]] = [[] for _ in range(n)]
    for s, d in edges:
        out[s].append(d)
    state = [0] * n  # 0 new, 1 on the walk's path, 2 done
    back: set[tuple[int, int]] = set()
    for start in range(n):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, 0)]
        while stack:
            v, i = stack[-1]
            if i < len(out[v]):
                stack[-1] = (v, i + 1)
                w = out[v][i]
                if state[w] == 1:
                    back.add((v, w))
                elif state[w] == 0:
                    state[w] = 1
                    stack.append((w, 0))
            else:
                state[v] = 2
                stack.pop()
    if not back:
        return edges
    fixed: dict[tuple[int, int], int] = {}
    for (s, d), w in edges.items():
        key = (d, s) if (s, d) in back else (s, d)
        fixed[key] = max(w, fixed.get(key, 0))
    return fixed


class _Layers:
    """The proper layered graph: real nodes ``0..n-1``, then virtual ones; every edge joins two
    neighbouring layers."""

    def __init__(self, n: int, edges: dict[tuple[int, int], int], layer: list[int],
                 widths: list[float]) -> None:
        self.n = n
        self.layer = list(layer)
        self.width = list(widths)
        self.up: list[list[int]] = [[] for _ in range(n)]  # neighbours in the layer above
        self.down: list[list[int]] = [[] for _ in range(n)]
        self.weight: dict[tuple[int, int], int] = {}
        for (s, d), w in sorted(edges.items()):
            prev = s
            for lay in range(layer[s] + 1, layer[d]):
                v = len(self.layer)
                self.layer.append(lay)
                self.width.append(_VIRTUAL_W)
                self.up.append([])
                self.down.append([])
                self._join(prev, v, w)
                prev = v
            self._join(prev, d, w)
        self.layers: list[list[int]] = [[] for _ in range(max(self.layer, default=-1) + 1)]

    def _join(self, a: int, b: int, w: int) -> None:
        if (a, b) in self.weight:
            self.weight[a, b] = max(w, self.weight[a, b])
            return
        self.weight[a, b] = w
        self.down[a].append(b)
        self.up[b].append(a)

    def virtual(self, v: int) -> bool:
        return v >= self.n

    def gap(self, a: int, b: int) -> float:
        """The least distance between the centres of neighbours a and b in a layer: half of
        each width and the gap between boxes (half of it between two long edges)."""
        return (self.width[a] + self.width[b]) / 2 + (NODE_SEP / 2 if self.virtual(a) and self.virtual(b) else NODE_SEP)


# ----------------------------------------------------------------------------- order in layers
def _initial_order(g: _Layers) -> None:
    """Breadth-first from the top layer's nodes, in index order (dot's start)."""
    seen = [False] * len(g.layer)
    starts = sorted(range(len(g.layer)), key=lambda v: (g.layer[v], v))
    for s in starts:
        if seen[s] or g.up[s]:
            continue
        queue = [s]
        seen[s] = True
        k = 0
        while k < len(queue):
            v = queue[k]
            k += 1
            g.layers[g.layer[v]].append(v)
            for w in g.down[v]:
                if not seen[w]:
                    seen[w] = True
                    queue.append(w)
    for v in starts:  # on a cycle's remains (none after _acyclic): placed anyway
        if not seen[v]:
            seen[v] = True
            g.layers[g.layer[v]].append(v)


def _crossings(upper: list[int], lower: list[int], down: list[list[int]], pos: list[int]) -> int:
    """Edge crossings between two neighbouring layers (Barth, Juenger and Mutzel's accumulator tree)."""
    if len(upper) < 2 or len(lower) < 2:
        return 0
    south: list[int] = []
    for u in upper:
        south.extend(sorted(pos[w] for w in down[u]))
    first = 1
    while first < len(lower):
        first *= 2
    tree = [0] * (2 * first)
    first -= 1
    total = 0
    for p in south:
        i = p + first
        tree[i] += 1
        while i > 0:
            if i % 2:
                total += tree[i + 1]
            i = (i - 1) // 2
            tree[i] += 1
    return total


def _all_crossings(g: _Layers, pos: list[int]) -> int:
    return sum(_crossings(g.layers[i], g.layers[i + 1], g.down, pos) for i in range(len(g.layers) - 1))


def _median(values: list[int]) -> float:
    values.sort()
    m = len(values)
    if m % 2:
        return float(values[m // 2])
    if m == 2:
        return (values[0] + values[1]) / 2
    # dot's weighted median: leaning towards the side whose neighbours lie closer together
    left = values[m // 2 - 1] - values[0]
    right = values[-1] - values[m // 2]
    if left + right == 0:
        return (values[m // 2 - 1] + values[m // 2]) / 2
    return (values[m // 2 - 1] * right + values[m // 2] * left) / (left + right)


def _sweep(g: _Layers, pos: list[int], downwards: bool) -> None:
    """Reorder every layer by the median position of each node's neighbours in the layer before
    it in the sweep's direction; nodes without any keep their places."""
    order = range(1, len(g.layers)) if downwards else range(len(g.layers) - 2, -1, -1)
    for i in order:
        layer = g.layers[i]
        near = g.up if downwards else g.down
        keyed: list[tuple[float, int, int]] = []
        free: list[int] = []
        for k, v in enumerate(layer):
            ns = near[v]
            if ns:
                keyed.append((_median([pos[w] for w in ns]), k, v))
            else:
                free.append(k)
        keyed.sort()
        out: list[int] = [0] * len(layer)
        fixed = set(free)
        it = iter(keyed)
        for k in range(len(layer)):
            out[k] = layer[k] if k in fixed else next(it)[2]
        g.layers[i] = out
        for k, v in enumerate(out):
            pos[v] = k


def _pair_crossings(near: list[list[int]], pos: list[int], v: int, w: int) -> int:
    """Crossings between v's and w's edges to one neighbouring layer, v left of w."""
    c = 0
    for a in near[w]:
        pa = pos[a]
        for b in near[v]:
            if pa < pos[b]:
                c += 1
    return c


def _transpose(g: _Layers, pos: list[int], equal_too: bool) -> None:
    """Swap neighbours in a layer while that lessens the crossings (dot's transpose); with
    ``equal_too``, also where it keeps them equal and some remain (to leave a plateau)."""
    for _ in range(50):
        gained = 0
        for layer in g.layers:
            for i in range(len(layer) - 1):
                v, w = layer[i], layer[i + 1]
                c0 = _pair_crossings(g.up, pos, v, w) + _pair_crossings(g.down, pos, v, w)
                c1 = _pair_crossings(g.up, pos, w, v) + _pair_crossings(g.down, pos, w, v)
                if c1 < c0 or (equal_too and c0 > 0 and c1 == c0):
                    layer[i], layer[i + 1] = w, v
                    pos[v], pos[w] = i + 1, i
                    gained += c0 - c1
        if gained <= 0:
            return


def _sweeps(size: int) -> int:
    return _SWEEPS if size <= 2000 else 4 if size <= 8000 else 2


def _order(g: _Layers) -> list[int]:
    _initial_order(g)
    pos = [0] * len(g.layer)
    for layer in g.layers:
        for k, v in enumerate(layer):
            pos[v] = k
    small = len(g.layer) <= _TRANSPOSE_MAX
    if small:
        _transpose(g, pos, equal_too=False)
    best = [list(layer) for layer in g.layers]
    best_crossings = _all_crossings(g, pos)
    since_better = 0
    for it in range(_sweeps(len(g.layer))):
        if best_crossings == 0 or since_better >= _QUIT:
            break
        _sweep(g, pos, downwards=it % 2 == 0)
        if small:
            _transpose(g, pos, equal_too=it % 4 >= 2)
        c = _all_crossings(g, pos)
        if c < best_crossings:
            best, best_crossings = [list(layer) for layer in g.layers], c
            since_better = 0
        else:
            since_better += 1
    g.layers = best
    for layer in g.layers:
        for k, v in enumerate(layer):
            pos[v] = k
    return pos


# ----------------------------------------------------------------------------- x coordinates
def _type1_conflicts(g: _Layers, pos: list[int]) -> set[tuple[int, int]]:
    """Edges that cross an edge between two virtual nodes (a long edge's inner segment), which
    Brandes and Koepf keep straight in preference."""
    conflicts: set[tuple[int, int]] = set()
    for i in range(1, len(g.layers)):
        prev, layer = g.layers[i - 1], g.layers[i]
        k0 = 0
        scan = 0
        for l1, v in enumerate(layer):
            inner = next((u for u in g.up[v] if g.virtual(u) and g.virtual(v)), None)
            k1 = pos[inner] if inner is not None else len(prev)
            if inner is not None or l1 == len(layer) - 1:
                for w in layer[scan:l1 + 1]:
                    for u in g.up[w]:
                        if (pos[u] < k0 or k1 < pos[u]) and not (g.virtual(u) and g.virtual(w)):
                            conflicts.add((u, w))
                scan = l1 + 1
                k0 = k1
    return conflicts


def _align(g: _Layers, layers: list[list[int]], pos: list[int], near: list[list[int]],
           conflicts: set[tuple[int, int]], upward: bool) -> tuple[list[int], list[int]]:
    """Vertical alignment: each node joins the block of a median neighbour (among its heaviest
    edges) in the layer before, if no alignment made earlier crosses it."""
    root = list(range(len(g.layer)))
    align = list(range(len(g.layer)))
    for layer in layers:
        prev_index = -1
        for v in layer:
            ws = near[v]
            if not ws:
                continue
            heaviest = max(g.weight[(w, v) if upward else (v, w)] for w in ws)
            ws = sorted((w for w in ws if g.weight[(w, v) if upward else (v, w)] == heaviest), key=lambda w: pos[w])
            mid = (len(ws) - 1) / 2
            for m in sorted({int(mid), int(mid + 0.5)}):
                w = ws[m]
                if align[v] != v:
                    break
                edge = (w, v) if upward else (v, w)
                if prev_index < pos[w] and edge not in conflicts:
                    align[w] = v
                    root[v] = root[w]
                    align[v] = root[v]
                    prev_index = pos[w]
    return root, align


def _compact(g: _Layers, layers: list[list[int]], root: list[int], align: list[int]) -> list[float]:
    """Horizontal compaction: each block as far left as the blocks to its left allow (the
    separation of two boxes is half of each width and the gap), then moved right as far as the
    blocks to its right allow, iteratively."""
    size = len(g.layer)
    left: dict[int, dict[int, float]] = {}  # block -> block to its left -> least distance
    for layer in layers:
        for a, b in itertools.pairwise(layer):
            sep = g.gap(a, b)
            ra, rb = root[a], root[b]
            d = left.setdefault(rb, {})
            d[ra] = max(sep, d.get(ra, 0.0))
    blocks = sorted({root[v] for v in range(size)})
    right: dict[int, dict[int, float]] = {}
    indeg = {b: 0 for b in blocks}
    for b, lefts in left.items():
        for a, sep in lefts.items():
            right.setdefault(a, {})[b] = sep
            indeg[b] += 1
    # a topological order of the blocks (left to right)
    order: list[int] = []
    stack = [b for b in blocks if indeg[b] == 0][::-1]
    while stack:
        b = stack.pop()
        order.append(b)
        for c in sorted(right.get(b, {}), reverse=True):
            indeg[c] -= 1
            if indeg[c] == 0:
                stack.append(c)
    if len(order) < len(blocks):  # a cycle among blocks (not expected): the rest in index order
        placed = set(order)
        order += [b for b in blocks if b not in placed]
    x: dict[int, float] = {}
    for b in order:
        x[b] = max((x[a] + sep for a, sep in left.get(b, {}).items() if a in x), default=0.0)
    for b in reversed(order):  # pull each block right, towards the blocks on its right
        rights = right.get(b)
        if rights:
            x[b] = max(x[b], min(x[c] - sep for c, sep in rights.items()))
    return [x[root[v]] for v in range(size)]


def _coordinates(g: _Layers, pos: list[int]) -> list[float]:
    conflicts = _type1_conflicts(g, pos)
    runs: list[list[float]] = []
    for upward in (True, False):
        layers = g.layers if upward else g.layers[::-1]
        near = g.up if upward else g.down
        for leftward in (True, False):
            ordered = layers if leftward else [layer[::-1] for layer in layers]
            p = pos if leftward else [0] * len(pos)
            if not leftward:
                for layer in ordered:
                    for k, v in enumerate(layer):
                        p[v] = k
            root, align = _align(g, ordered, p, near, conflicts, upward)
            xs = _compact(g, ordered, root, align)
            runs.append(xs if leftward else [-v for v in xs])
    # align the four to the narrowest: the left ones by their left edge, the right by their right
    def span(xs: list[float]) -> tuple[float, float]:
        return (min(x - w / 2 for x, w in zip(xs, g.width, strict=True)),
                max(x + w / 2 for x, w in zip(xs, g.width, strict=True)))

    spans = [span(xs) for xs in runs]
    narrow = min(range(4), key=lambda k: (spans[k][1] - spans[k][0], k))
    lo, hi = spans[narrow]
    for k, xs in enumerate(runs):
        shift = lo - spans[k][0] if k in (0, 2) else hi - spans[k][1]
        runs[k] = [x + shift for x in xs]
    out = []
    for v in range(len(g.layer)):
        four = sorted(r[v] for r in runs)
        out.append((four[1] + four[2]) / 2)
    return out


def _rank(n: int, edges: dict[tuple[int, int], int], start: list[int]) -> list[int]:
    """Layers whose weighted edge lengths are least (dot's ranking), from feasible ones."""
    if n > _SIMPLEX_MAX or not edges:
        return start
    return network_simplex(n, [s for s, _ in edges], [d for _, d in edges], [1] * len(edges),
                           list(edges.values()), start, max_iter=_max_iter(n))


_VIRTUAL_OMEGA = {(False, False): 1, (False, True): 2, (True, False): 2, (True, True): 8}


def _x_by_simplex(g: _Layers, start: list[float]) -> list[float]:
    """x coordinates whose weighted horizontal edge lengths are least, boxes kept apart (dot's
    auxiliary graph: a node per edge, below both its ends, so that its two edges measure the
    distance between them; a virtual node's edges weigh more, so long edges run straight),
    from Brandes and Koepf's coordinates; then balanced as dot balances them."""
    size = len(g.layer)
    if size > _SIMPLEX_MAX:
        return start
    x = [int(round(v)) for v in start]
    tail: list[int] = []
    head: list[int] = []
    minlen: list[int] = []
    weight: list[int] = []
    for layer in g.layers:
        for a, b in itertools.pairwise(layer):
            gap = math.ceil(g.gap(a, b))
            x[b] = max(x[b], x[a] + gap)  # rounding must not bring two boxes closer than the gap
            tail.append(a)
            head.append(b)
            minlen.append(gap)
            weight.append(0)
    ranks = list(x)
    for (u, v), w in g.weight.items():
        e = len(ranks)
        ranks.append(min(x[u], x[v]))
        omega = _VIRTUAL_OMEGA[g.virtual(u), g.virtual(v)] * w
        for end in (u, v):
            tail.append(e)
            head.append(end)
            minlen.append(0)
            weight.append(omega)
    solved = network_simplex(len(ranks), tail, head, minlen, weight, ranks, max_iter=_max_iter(len(ranks)),
                             balance=True)
    return [float(solved[v]) for v in range(size)]


def _max_iter(size: int) -> int:
    return max(200, 4 * size)


def layered(
    n: int,
    edges: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[float, float]],
    weights: Sequence[int] | None = None,
    groups: Sequence[str | None] | None = None,
) -> list[tuple[float, float]]:
    """Centres of ``n`` boxes of ``sizes`` (width, height) joined by ``edges`` (source drawn
    above destination), laid out in layers (see NOTE [ a layered layout of our own ]);
    ``weights`` (per edge, default 1) keep heavier edges shorter and straighter, and an edge
    between two boxes of one of ``groups`` (per node, None for none) is kept straight before
    others (its weight counts a hundredfold for x, as dot's ``group``)."""
    if n == 0:
        return []
    merged: dict[tuple[int, int], int] = {}
    for k, (s, d) in enumerate(edges):
        if s != d:
            w = 1 if weights is None else int(weights[k])
            merged[s, d] = max(w, merged.get((s, d), 0))
    merged = _acyclic(n, merged)
    layer = _rank(n, merged, _tighten(n, merged, sink_layers(n, list(merged))))
    straight = {(s, d): w * (_GROUP_FACTOR if groups is not None and groups[s] is not None and groups[s] == groups[d]
                             else 1) for (s, d), w in merged.items()}
    g = _Layers(n, straight, layer, [float(w) for w, _ in sizes])
    pos = _order(g)
    xs = _x_by_simplex(g, _coordinates(g, pos))
    heights = [0.0] * len(g.layers)
    for v in range(n):
        heights[layer[v]] = max(heights[layer[v]], float(sizes[v][1]))
    ys: list[float] = []
    y = 0.0
    for i, h in enumerate(heights):
        if i:
            y += heights[i - 1] / 2 + RANK_SEP + h / 2
        ys.append(y)
    return [(xs[v], ys[layer[v]]) for v in range(n)]
