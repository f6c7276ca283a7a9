"""Graph layout for the widget and the HTML page, computed in Python.

A layout places every node of a :class:`~gradscope.recording.Recording` in pixels, top to bottom
in the forward direction (leaves at the top, the loss at the bottom). Big graphs are *collapsed by
module*: the nodes of one module (at a chosen depth of the dotted path, e.g. ``layers.7``) fold into
one box. Each box carries its own inner layout, so the front end expands a box in place without
asking Python again (the HTML page has no kernel).

Engines: Graphviz ``dot`` draws the nicest small graphs but is slow on big ones (about 6 s at
2,000 nodes even with ``nslimit``), so it is used only when the whole graph is small; above that,
igraph's Sugiyama layout (under a second at 20,000 nodes). All graph walks are iterative.

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
    "layout_recording",
]

NODE_W = 150
NODE_H = 30
GROUP_W = 190
GROUP_H = 44
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


def _layout_dot(
    n: int, edges: Sequence[tuple[int, int]], sizes: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    lines = [
        "digraph G {",
        f"graph [nslimit=2, nodesep={20 / 72:.3f}, ranksep={40 / 72:.3f}];",
        'node [shape=box, fixedsize=true, label=""];',
    ]
    for i in range(n):
        w, h = sizes[i]
        lines.append(f"n{i} [width={w / 72:.3f}, height={h / 72:.3f}];")
    for s, d in edges:
        lines.append(f"n{s} -> n{d};")
    lines.append("}")
    try:
        out = subprocess.run(
            ["dot", "-Tplain"],
            input="\n".join(lines),
            capture_output=True,
            text=True,
            timeout=_DOT_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise GradscopeError(
            f"gradscope: Graphviz dot failed ({type(e).__name__}); use engine='sugiyama'."
        ) from None
    pos: list[tuple[float, float]] = [(0.0, 0.0)] * n
    height = 0.0
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "graph":
            height = float(parts[3])
        elif parts[0] == "node":
            i = int(parts[1][1:])
            pos[i] = (float(parts[2]) * 72, (height - float(parts[3])) * 72)
    return pos


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


def layout_dag(
    n: int,
    edges: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[float, float]] | None = None,
    *,
    engine: str = "sugiyama",
) -> tuple[list[tuple[float, float]], float, float]:
    """Lay out ``n`` boxes joined by ``edges`` (src drawn above dst).

    Returns centres shifted so that the boxes start at ``(_MARGIN, _MARGIN)``, and the total
    width and height including margins.
    """
    if sizes is None:
        sizes = [(NODE_W, NODE_H)] * n
    if n == 0:
        return [], 2 * _MARGIN, 2 * _MARGIN
    if engine == "dot":
        pos = _layout_dot(n, edges, sizes)
    elif engine == "sugiyama":
        pos = _layout_sugiyama(n, edges)
    else:
        raise GradscopeError(f"gradscope: unknown layout engine {engine!r}; use 'dot' or 'sugiyama'.")
    min_x = min(p[0] - sizes[i][0] / 2 for i, p in enumerate(pos))
    min_y = min(p[1] - sizes[i][1] / 2 for i, p in enumerate(pos))
    out = [(p[0] - min_x + _MARGIN, p[1] - min_y + _MARGIN) for p in pos]
    width = max(p[0] + sizes[i][0] / 2 for i, p in enumerate(out)) + _MARGIN
    height = max(p[1] + sizes[i][1] / 2 for i, p in enumerate(out)) + _MARGIN
    return out, width, height


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
    if engine == "auto":
        try:
            return _layout_recording(rec, collapse, _pick_engine("auto", len(rec.nodes)))
        except GradscopeError:
            # dot failed or timed out: Sugiyama always works
            return _layout_recording(rec, collapse, "sugiyama")
    return _layout_recording(rec, collapse, _pick_engine(engine, len(rec.nodes)))


def _layout_recording(rec: Recording, collapse: bool | int | str, eng: str) -> GraphLayout:
    n = len(rec.nodes)
    modules = [node.module for node in rec.nodes]
    if collapse == "auto":
        depth = choose_depth(modules)
    elif collapse is True:
        depth = choose_depth(modules, min_nodes=0)
    elif collapse is False or collapse is None:
        depth = None
    elif isinstance(collapse, int) and collapse >= 1:
        depth = collapse
    else:
        raise GradscopeError(
            f"gradscope: collapse={collapse!r} is not understood; use 'auto', True, False or a depth >= 1."
        )
    edges = [(e.src, e.dst) for e in rec.edges if 0 <= e.src < n and 0 <= e.dst < n]

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
    for s, d in edges:
        gs_, gd = group[s], group[d]
        if gs_ >= 0 and gs_ == gd:
            inner_edges[gs_].append((local[s], local[d]))

    xs = [0.0] * n
    ys = [0.0] * n
    inner_size: list[tuple[float, float]] = []
    for gi, idx in enumerate(members):
        pos, w, h = layout_dag(len(idx), inner_edges[gi], engine=eng)
        for j, i in enumerate(idx):
            xs[i], ys[i] = pos[j][0] - _MARGIN + _INNER_PAD, pos[j][1] - _MARGIN + _INNER_PAD + 14
        inner_size.append((w - 2 * _MARGIN + 2 * _INNER_PAD, h - 2 * _MARGIN + 2 * _INNER_PAD + 14))

    # Top level: loose nodes and one box per group, edges between them deduplicated.
    top_of = [0] * n
    loose = [i for i in range(n) if group[i] < 0]
    for j, i in enumerate(loose):
        top_of[i] = j
    n_top = len(loose) + len(keys)
    for i in range(n):
        if group[i] >= 0:
            top_of[i] = len(loose) + group[i]
    top_edges = sorted({(top_of[s], top_of[d]) for s, d in edges if top_of[s] != top_of[d]})
    sizes = [(NODE_W, NODE_H)] * len(loose) + [(GROUP_W, GROUP_H)] * len(keys)
    pos, width, height = layout_dag(n_top, top_edges, sizes, engine=eng)
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
