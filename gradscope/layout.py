"""Graph layout for the widget and the HTML page, computed in Python.

A layout places every node of a :class:`~gradscope.recording.Recording` in pixels, top to bottom
in the forward direction (leaves at the top, the loss at the bottom). Big graphs are *collapsed by
module*: the nodes of one module (at a chosen depth of the dotted path, e.g. ``layers.7``) fold into
one box. Each box carries its own inner layout, so the front end expands a box in place without
asking Python again (the HTML page has no kernel).

Engines: Graphviz ``dot`` draws the nicest small graphs but is slow on big ones (about 6 s at
2,000 nodes even with ``nslimit``), so it is used only when the whole graph is small; above that,
igraph's Sugiyama layout (under a second at 20,000 nodes). All graph walks are iterative.

A recording may be laid out at several *levels* of detail (:func:`layout_levels`): every node,
and folded by module. The front end picks the finest level whose names are legible at the width
it has, and lets the user switch.

Example:
    >>> from gradscope.recording import Recording, Node, Edge
    >>> rec = Recording(nodes=(Node(0, "SumBackward0"), Node(1, "AccumulateGrad", leaf="w")),
    ...                 edges=(Edge(1, 0),))
    >>> lay = layout_recording(rec, engine="sugiyama")
    >>> lay.y[1] < lay.y[0]   # the leaf is drawn above the sum
    True
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from gradscope.errors import GradscopeError
from gradscope.recording import Recording

__all__ = [
    "DOT_MAX_NODES",
    "COLLAPSE_MIN_NODES",
    "GROUP_H",
    "GROUP_W",
    "NODE_H",
    "NODE_W",
    "GraphLayout",
    "Group",
    "choose_depth",
    "group_nodes",
    "layout_dag",
    "layout_levels",
    "layout_recording",
]

NODE_W = 160
NODE_H = 40  # two lines: the node's name, then what it holds
GROUP_W = 190
GROUP_H = 50
_X_STEP = 200  # horizontal distance between neighbours in a layer (px)
_Y_STEP = 80  # vertical distance between layers (px)
_MARGIN = 30
_INNER_PAD = 24  # padding around an expanded module's nodes

# NOTE [ layout engine thresholds ]: dot's network simplex grows fast (21 s for a 2,000-node
# worst-case DAG, 6.4 s with -Gnslimit=2); igraph's Sugiyama takes 0.06 s there and 0.9 s at
# 20,000 nodes. dot is used only when the whole graph has at most DOT_MAX_NODES nodes, so that
# a widget never waits on it; graphs above COLLAPSE_MIN_NODES open collapsed by module.
DOT_MAX_NODES = 400
COLLAPSE_MIN_NODES = 250
_MIN_VISIBLE = 24  # a collapsed view should show at least this many boxes when it can
_FOLD_MIN_NODES = 20  # smaller graphs always fit legibly: no folded level for them
_DOT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Group:
    """One module folded into a box.

    ``x``/``y`` are the box's centre in the collapsed view; ``inner_w``/``inner_h`` the size of
    its expanded content, whose node coordinates are relative to the content's top-left corner.
    """

    key: str
    count: int
    x: float
    y: float
    w: float
    h: float
    inner_w: float
    inner_h: float


@dataclass(frozen=True)
class GraphLayout:
    """Node positions (pixels) and module groups.

    For a node with ``group[i] == -1``, ``(x[i], y[i])`` is its centre in the collapsed view;
    otherwise it is its centre inside the group's expanded content.
    """

    engine: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    group: tuple[int, ...]
    groups: tuple[Group, ...]
    width: float
    height: float
    depth: int | None

    @property
    def visible_count(self) -> int:
        """How many boxes the collapsed view draws (ungrouped nodes plus groups)."""
        return sum(1 for g in self.group if g < 0) + len(self.groups)

    def to_payload(self) -> dict[str, object]:
        """Columns for the front end (coordinates rounded to whole pixels)."""
        return {
            "engine": self.engine,
            "node_w": NODE_W,
            "node_h": NODE_H,
            "width": round(self.width),
            "height": round(self.height),
            "depth": self.depth,
            "x": [round(v) for v in self.x],
            "y": [round(v) for v in self.y],
            "group": list(self.group),
            "groups": {
                "key": [g.key for g in self.groups],
                "count": [g.count for g in self.groups],
                "x": [round(g.x) for g in self.groups],
                "y": [round(g.y) for g in self.groups],
                "w": [round(g.w) for g in self.groups],
                "h": [round(g.h) for g in self.groups],
                "iw": [round(g.inner_w) for g in self.groups],
                "ih": [round(g.inner_h) for g in self.groups],
            },
        }


def _prefix(module: str, depth: int) -> str:
    parts = module.split(".")
    return ".".join(parts[:depth])


def choose_depth(modules: Sequence[str | None], *, min_nodes: int = COLLAPSE_MIN_NODES) -> int | None:
    """The module depth to collapse at, or None to draw every node.

    Small graphs (at most ``min_nodes`` nodes) are not collapsed. Otherwise the shallowest depth
    whose collapsed view shows at least a couple of dozen boxes is chosen (a 48-layer encoder
    collapses to its 48 layers), or the deepest depth when none does.
    """
    if len(modules) <= min_nodes:
        return None
    max_depth = max((m.count(".") + 1 for m in modules if m), default=0)
    if max_depth == 0:
        return None
    for depth in range(1, max_depth + 1):
        groups, loose = group_nodes(modules, depth)
        visible = sum(1 for g in groups if g < 0) + len(loose)
        if visible >= _MIN_VISIBLE:
            return depth
    return max_depth


def group_nodes(modules: Sequence[str | None], depth: int) -> tuple[list[int], list[str]]:
    """Assign each node to a module group at ``depth``; returns (group per node, group keys).

    Nodes without a module, and groups that would hold a single node, stay ungrouped (-1).
    """
    members: dict[str, list[int]] = {}
    for i, m in enumerate(modules):
        if m:
            members.setdefault(_prefix(m, depth), []).append(i)
    group = [-1] * len(modules)
    keys: list[str] = []
    for key, idx in members.items():
        if len(idx) < 2:
            continue
        gi = len(keys)
        keys.append(key)
        for i in idx:
            group[i] = gi
    return group, keys


def _dot_available() -> bool:
    return shutil.which("dot") is not None


def _dot_source(
    n: int,
    edges: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[float, float]],
    weights: Sequence[int] | None,
    groups: Sequence[str | None] | None,
) -> str:
    lines = [
        "digraph G {",
        f"graph [nodesep={20 / 72:.3f}, ranksep={40 / 72:.3f}];",
        'node [shape=box, fixedsize=true, label=""];',
    ]
    for i in range(n):
        w, h = sizes[i]
        grp = f', group="{groups[i]}"' if groups is not None and groups[i] else ""
        lines.append(f"n{i} [width={w / 72:.3f}, height={h / 72:.3f}{grp}];")
    for k, (s, d) in enumerate(edges):
        wt = f" [weight={weights[k]}]" if weights is not None and weights[k] != 1 else ""
        lines.append(f"n{s} -> n{d}{wt};")
    lines.append("}")
    return "\n".join(lines)


def _layout_dot_many(jobs: Sequence[tuple[int, str]]) -> list[list[tuple[float, float]]]:
    """Run dot once over several graphs (``(node count, dot source)`` each): one process instead
    of one per module box."""
    if not jobs:
        return []
    try:
        out = subprocess.run(
            ["dot", "-Tplain"],
            input="\n".join(src for _, src in jobs),
            capture_output=True,
            text=True,
            timeout=_DOT_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise GradscopeError(
            f"gradscope: Graphviz dot failed ({type(e).__name__}); use engine='sugiyama'."
        ) from None
    results: list[list[tuple[float, float]]] = []
    pos: list[tuple[float, float]] = []
    height = 0.0
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "graph":
            height = float(parts[3])
            pos = [(0.0, 0.0)] * jobs[len(results)][0]
        elif parts[0] == "node":
            i = int(parts[1][1:])
            pos[i] = (float(parts[2]) * 72, (height - float(parts[3])) * 72)
        elif parts[0] == "stop":
            results.append(pos)
    if len(results) != len(jobs):
        raise GradscopeError("gradscope: Graphviz dot returned fewer layouts than asked; use engine='sugiyama'.")
    return results


def _layout_dot(
    n: int,
    edges: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[float, float]],
    weights: Sequence[int] | None = None,
    groups: Sequence[str | None] | None = None,
) -> list[tuple[float, float]]:
    return _layout_dot_many([(n, _dot_source(n, edges, sizes, weights, groups))])[0]


def _sink_layers(n: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Layer of each node: the loss (a sink) at the bottom, every other node one layer above its
    highest consumer.

    NOTE [ layering next to the consumer ]: longest-path layering from the sources (igraph's
    default) puts every parameter leaf in the top layer, so a leaf used 3,000 layers down drags
    an edge through 3,000 layers of dummy vertices (minutes at 20,000 nodes). Layering from the
    sinks puts each leaf right above the node that uses it. Iterative (Kahn's algorithm); nodes on
    a cycle (possible between collapsed modules) are placed above their known consumers.
    """
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


def _layout_sugiyama(n: int, edges: Sequence[tuple[int, int]]) -> list[tuple[float, float]]:
    import igraph

    g = igraph.Graph(n=n, edges=list(edges), directed=True)
    coords = g.layout_sugiyama(layers=_sink_layers(n, edges)).coords
    return [(float(coords[i][0]) * _X_STEP, float(coords[i][1]) * _Y_STEP) for i in range(n)]


def _place(
    pos: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]]
) -> tuple[list[tuple[float, float]], float, float]:
    """Shift centres so that the boxes start at ``(_MARGIN, _MARGIN)``; total width and height."""
    if not pos:
        return [], 2 * _MARGIN, 2 * _MARGIN
    min_x = min(p[0] - sizes[i][0] / 2 for i, p in enumerate(pos))
    min_y = min(p[1] - sizes[i][1] / 2 for i, p in enumerate(pos))
    out = [(p[0] - min_x + _MARGIN, p[1] - min_y + _MARGIN) for p in pos]
    width = max(p[0] + sizes[i][0] / 2 for i, p in enumerate(out)) + _MARGIN
    height = max(p[1] + sizes[i][1] / 2 for i, p in enumerate(out)) + _MARGIN
    return out, width, height


def layout_dag(
    n: int,
    edges: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[float, float]] | None = None,
    *,
    engine: str = "sugiyama",
    weights: Sequence[int] | None = None,
    groups: Sequence[str | None] | None = None,
) -> tuple[list[tuple[float, float]], float, float]:
    """Lay out ``n`` boxes joined by ``edges`` (src drawn above dst).

    Returns centres shifted so that the boxes start at ``(_MARGIN, _MARGIN)``, and the total
    width and height including margins. ``weights`` (per edge) and ``groups`` (per node, boxes
    of one group are kept in a straight column) are hints for ``dot``.
    """
    if sizes is None:
        sizes = [(NODE_W, NODE_H)] * n
    if n == 0:
        return [], 2 * _MARGIN, 2 * _MARGIN
    if engine == "dot":
        pos = _layout_dot(n, edges, sizes, weights, groups)
    elif engine == "sugiyama":
        pos = _layout_sugiyama(n, edges)
    else:
        raise GradscopeError(f"gradscope: unknown layout engine {engine!r}; use 'dot' or 'sugiyama'.")
    return _place(pos, sizes)


# NOTE [ drawing create_graph nodes beside what they differentiate ]: a node made by a
# create_graph backward (odd order) computes a gradient, so data flows through a chain of them in
# the opposite direction to the forward pass: the gradient for the last layer first. Laid out as
# they are, that chain hangs below the whole forward graph, every edge from a forward node to its
# create_graph partner spans the graph's height, and each such edge needs a column of its own (the
# 200-node demo was 2,700 px wide, one stray node making it wider still). Reversing the edges
# *between* odd-order nodes for the layout only puts each one beside the forward node it
# differentiates; the front end still draws every arrow in its true direction (upwards there).
# A second hint keeps the main path straight: nodes that combine two or more inputs (and what
# follows them) share a dot group per order and their edges weigh more, so leaves and parameter-side nodes (TBackward0
# of a weight) sit beside the column instead of pushing it sideways layer after layer.
def _layout_plan(
    n: int, edges: Sequence[tuple[int, int]], order: Sequence[int], leafish_seed: Sequence[bool]
) -> tuple[list[tuple[int, int]], list[int], list[str | None]]:
    """Edges as laid out (some reversed), their weights and each box's dot group."""
    inputs: list[list[int]] = [[] for _ in range(n)]
    consumers: list[list[int]] = [[] for _ in range(n)]
    for s, d in edges:
        if s != d:
            inputs[d].append(s)
            consumers[s].append(d)
    # leafish: a leaf, or a box with one input that is leafish (a parameter's TBackward0 or
    # view); a box combining two inputs is on the main path. Kahn's order; cycles stay main.
    pending = [len(inputs[i]) for i in range(n)]
    leafish = [False] * n
    stack = [i for i in range(n) if pending[i] == 0]
    while stack:
        u = stack.pop()
        leafish[u] = leafish_seed[u] or (len(inputs[u]) == 1 and leafish[inputs[u][0]])
        for c in consumers[u]:
            pending[c] -= 1
            if pending[c] == 0:
                stack.append(c)
    laid: list[tuple[int, int]] = []
    weights: list[int] = []
    for s, d in edges:
        odd = order[s] % 2 == 1 and order[s] == order[d]
        laid.append((d, s) if odd else (s, d))
        weights.append(4 if not leafish[s] and not leafish[d] else 1)
    groups = [None if leafish[i] else f"o{order[i]}" for i in range(n)]
    return laid, weights, groups


def _pick_engine(engine: str, n_nodes: int) -> str:
    if engine == "auto":
        return "dot" if n_nodes <= DOT_MAX_NODES and _dot_available() else "sugiyama"
    if engine == "dot" and not _dot_available():
        raise GradscopeError(
            "gradscope: engine='dot' needs Graphviz's dot program (Debian: apt-get install graphviz); "
            "or use engine='sugiyama'."
        )
    if engine not in ("dot", "sugiyama"):
        raise GradscopeError(f"gradscope: unknown layout engine {engine!r}; use 'auto', 'dot' or 'sugiyama'.")
    return engine


def _depth_of(modules: Sequence[str | None], collapse: bool | int | str) -> int | None:
    if collapse == "auto":
        return choose_depth(modules)
    if collapse is True:
        return choose_depth(modules, min_nodes=0)
    if collapse is False or collapse is None:
        return None
    if isinstance(collapse, int) and not isinstance(collapse, bool) and collapse >= 1:
        return collapse
    raise GradscopeError(
        f"gradscope: collapse={collapse!r} is not understood; use 'auto', True, False or a depth >= 1."
    )


def layout_recording(
    rec: Recording, *, collapse: bool | int | str = "auto", engine: str = "auto"
) -> GraphLayout:
    """Lay out a recording's graph.

    Args:
        rec: the recording.
        collapse: ``"auto"`` (collapse big graphs by module, see :func:`choose_depth`), ``False``
            (draw every node), ``True`` (collapse at the automatic depth even if small) or an int
            (the module depth to collapse at, 1 = top-level modules).
        engine: ``"auto"``, ``"dot"`` or ``"sugiyama"``.
    """
    depth = _depth_of([n.module for n in rec.nodes], collapse)
    return _with_fallback(rec, [depth], engine)[0]


def layout_levels(
    rec: Recording, *, collapse: bool | int | str = "auto", engine: str = "auto"
) -> list[GraphLayout]:
    """Layouts of a recording at the levels of detail the front end can switch between, finest
    first: every node, then folded by module (``depth`` set).

    NOTE [ levels of detail ]: names must be legible at first paint, and only the front end knows
    its width. So a small graph (at most COLLAPSE_MIN_NODES nodes) travels both as every node and
    folded by module (when that folds anything), and the front end shows the finest level whose
    names fit. A big graph travels folded only (its every-node layout is what expanding each box
    gives), so its layout time does not double. ``collapse=False`` or a depth asks for one level.
    """
    modules = [n.module for n in rec.nodes]
    if collapse != "auto":
        return _with_fallback(rec, [_depth_of(modules, collapse)], engine)
    depth = choose_depth(modules)
    if depth is not None:
        return _with_fallback(rec, [depth], engine)
    depths: list[int | None] = [None]
    fold = choose_depth(modules, min_nodes=0) if len(modules) > _FOLD_MIN_NODES else None
    if fold is not None:
        group, keys = group_nodes(modules, fold)
        boxes = sum(1 for g in group if g < 0) + len(keys)
        if boxes <= 0.75 * len(modules):  # folding must make the picture clearly smaller
            depths.append(fold)
    return _with_fallback(rec, depths, engine)


def _with_fallback(rec: Recording, depths: Sequence[int | None], engine: str) -> list[GraphLayout]:
    if engine == "auto":
        try:
            eng = _pick_engine("auto", len(rec.nodes))
            return [_layout_recording(rec, d, eng) for d in depths]
        except GradscopeError:
            # dot failed or timed out: Sugiyama always works
            return [_layout_recording(rec, d, "sugiyama") for d in depths]
    eng = _pick_engine(engine, len(rec.nodes))
    return [_layout_recording(rec, d, eng) for d in depths]


def _layout_recording(rec: Recording, depth: int | None, eng: str) -> GraphLayout:
    n = len(rec.nodes)
    modules = [node.module for node in rec.nodes]
    edges = [(e.src, e.dst) for e in rec.edges if 0 <= e.src < n and 0 <= e.dst < n]
    order = [node.order for node in rec.nodes]
    laid_all, weights_all, dot_group = _layout_plan(
        n, edges, order, [node.leaf is not None for node in rec.nodes]
    )

    keys: list[str]
    if depth is None:
        group, keys = [-1] * n, []
    else:
        group, keys = group_nodes(modules, depth)

    # Inner layout of each group: its members and the edges between them.
    members: list[list[int]] = [[] for _ in keys]
    for i, g in enumerate(group):
        if g >= 0:
            members[g].append(i)
    local = [0] * n
    for idx in members:
        for j, i in enumerate(idx):
            local[i] = j
    inner_edges: list[list[tuple[int, int]]] = [[] for _ in keys]
    inner_weights: list[list[int]] = [[] for _ in keys]
    for (s, d), w in zip(laid_all, weights_all, strict=True):
        gs_, gd = group[s], group[d]
        if gs_ >= 0 and gs_ == gd:
            inner_edges[gs_].append((local[s], local[d]))
            inner_weights[gs_].append(w)

    xs = [0.0] * n
    ys = [0.0] * n
    inner_size: list[tuple[float, float]] = []
    node_sizes = [(float(NODE_W), float(NODE_H))]
    if eng == "dot":
        jobs = [
            (len(idx), _dot_source(len(idx), inner_edges[gi], node_sizes * len(idx), inner_weights[gi],
                                   [dot_group[i] for i in idx]))
            for gi, idx in enumerate(members)
        ]
        raw = _layout_dot_many(jobs)
    else:
        raw = [_layout_sugiyama(len(idx), inner_edges[gi]) for gi, idx in enumerate(members)]
    for gi, idx in enumerate(members):
        placed, iw, ih = _place(raw[gi], node_sizes * len(idx))
        for j, i in enumerate(idx):
            xs[i], ys[i] = placed[j][0] - _MARGIN + _INNER_PAD, placed[j][1] - _MARGIN + _INNER_PAD + 14
        inner_size.append((iw - 2 * _MARGIN + 2 * _INNER_PAD, ih - 2 * _MARGIN + 2 * _INNER_PAD + 14))

    # Top level: loose nodes and one box per group, edges between them deduplicated.
    top_of = [0] * n
    loose = [i for i in range(n) if group[i] < 0]
    for j, i in enumerate(loose):
        top_of[i] = j
    n_top = len(loose) + len(keys)
    for i in range(n):
        if group[i] >= 0:
            top_of[i] = len(loose) + group[i]
    top_weight: dict[tuple[int, int], int] = {}
    for (s, d), w in zip(laid_all, weights_all, strict=True):
        a, b = top_of[s], top_of[d]
        if a != b:
            top_weight[(a, b)] = max(w, top_weight.get((a, b), 0))
    top_edges = sorted(top_weight)
    top_groups: list[str | None] = [dot_group[i] for i in loose]
    for idx in members:
        main = [order[i] for i in idx if dot_group[i] is not None]
        top_groups.append(f"o{min(main)}" if main else None)
    sizes = [(NODE_W, NODE_H)] * len(loose) + [(GROUP_W, GROUP_H)] * len(keys)
    pos, width, height = layout_dag(
        n_top, top_edges, sizes, engine=eng, weights=[top_weight[e] for e in top_edges], groups=top_groups
    )
    for j, i in enumerate(loose):
        xs[i], ys[i] = pos[j]
    groups = tuple(
        Group(
            key=k,
            count=len(members[gi]),
            x=pos[len(loose) + gi][0],
            y=pos[len(loose) + gi][1],
            w=GROUP_W,
            h=GROUP_H,
            inner_w=inner_size[gi][0],
            inner_h=inner_size[gi][1],
        )
        for gi, k in enumerate(keys)
    )
    return GraphLayout(
        engine=eng,
        x=tuple(xs),
        y=tuple(ys),
        group=tuple(group),
        groups=groups,
        width=width,
        height=height,
        depth=depth,
    )
