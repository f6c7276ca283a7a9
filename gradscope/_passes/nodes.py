"""The node table's passes: the walked graph's nodes and edges, the saves inside ``CopySlices``
(NOTE [ saves inside CopySlices ]), the nodes never walked (NOTE [ saves of nodes never walked ]),
the roots' names and call paths."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope._base.trace import (
    C_ROOT,
    N_KEY,
    N_NAME,
    N_SEQ,
    S_SEQ,
    Trace,
)
from gradscope._model import names as _names
from gradscope._model.recording import (
    Edge,
    Table,
)


# ----------------------------------------------------------------------------------- graph
@dataclass
class Graph:
    """The node table in discovery order (ids 0..n-1) and edges between ids."""

    rows: list[tuple[Any, ...]]
    edges: Table[Edge]
    by_seq: Mapping[Any, int]  # sequence number -> node id (AccumulateGrad keys are tuples)
    leaves: list[int]  # ids of AccumulateGrad nodes
    made: list[tuple[int, int]] = field(default_factory=list)  # (sequence number, id), sorted
    _kids: dict[int, list[int]] | None = None
    _parents: dict[int, list[int]] | None = None

    def kids(self) -> dict[int, list[int]]:
        """Node id -> ids of its next nodes (made once: every backward pass reads it)."""
        if self._kids is None:
            kids: dict[int, list[int]] = {}
            for s_, d_ in zip(self.edges.column("src"), self.edges.column("dst"), strict=True):
                kids.setdefault(d_, []).append(s_)
            self._kids = kids
        return self._kids

    def parents(self) -> dict[int, list[int]]:
        """Node id -> ids of the nodes whose next nodes include it (made once, as kids)."""
        if self._parents is None:
            parents: dict[int, list[int]] = {}
            for d_, kids in self.kids().items():
                for s_ in kids:
                    parents.setdefault(s_, []).append(d_)
            self._parents = parents
        return self._parents


def graph_pass(trace: Trace) -> Graph:
    """Node ids are discovery order; edges are resolved from node keys (unknown keys dropped)."""
    index: Mapping[Any, int] = {row[N_KEY]: i for i, row in enumerate(trace.nodes) if isinstance(row[N_KEY], int)}
    n = len(trace.nodes)
    src: list[int] = []
    dst: list[int] = []
    pairs = dict(trace.edges)
    index_get = index.get
    for k, b in zip(trace.edge_keys, trace.edge_dst, strict=True):
        if k is not None:
            a = -1 - k if k < 0 else index_get(k)
            if a is not None:
                pairs[(a, b)] = None
    for a, b in pairs:
        if 0 <= a < n and 0 <= b < n:
            src.append(a)
            dst.append(b)
    leaves = [i for i, row in enumerate(trace.nodes) if not isinstance(row[N_KEY], int)]
    made = sorted((row[N_SEQ], i) for i, row in enumerate(trace.nodes) if isinstance(row[N_KEY], int))
    return Graph(trace.nodes, Table(Edge, {"src": src, "dst": dst}), index, leaves, made)


_INNER_NODE = "\0inner"  # a move's label: the saves of a node that CopySlices holds


def inplace_views_pass(trace: Trace, graph: Graph) -> None:
    """NOTE [ saves inside CopySlices ]: an in-place op on a view (``y = (w * 2).view(-1);
    y.mul_(noise)``, an in-place dropout on a flattened view, ``hidden[mask] = v`` on a view) makes
    its node (numbered n) and saves under it, then PyTorch wraps that node in a ``CopySlices`` node
    made right after it (numbered n + 1, or n + 2 where the op saved a clone of ``self`` made
    under a node of its own, n + 1), which holds it where no walk can reach it: no edge and no
    attribute leads to the inner node. Its saves belong to the ``CopySlices`` node (they live as
    long as it does, and it unpacks them when it runs), so they are moved there, as
    ``fn.saved[i]``: the saves of the numbers right below the ``CopySlices`` node's that no node
    walked has (at most three numbers, down to the first number that is a node or saved nothing).
    """
    by_seq = graph.by_seq
    rows = graph.rows
    moves = trace.seq_moves
    packed: set[int] | None = None
    for seq, i in by_seq.items():
        if rows[i][N_NAME] != "CopySlices" or not isinstance(seq, int):
            continue
        if packed is None:
            packed = {s[S_SEQ] for s in trace.saves}
        for inner in range(seq - 1, seq - 4, -1):
            if inner in by_seq or inner in moves or inner not in packed:
                break
            moves[inner] = (seq, _INNER_NODE)


UNSEEN_NODE = "(unseen node)"  # the name of a node whose graph no walk reached: see unseen_nodes_pass


def unseen_nodes_pass(trace: Trace, graph: Graph) -> int:
    """NOTE [ saves of nodes never walked ]: a graph that dies before any backward pass or the
    block's end (``fake = generator(z).detach()`` in a GAN's critic step: the generator's graph is
    dropped at once) is never walked, yet its nodes saved tensors, which were alive until it died:
    every save counts in ``saved_bytes`` (see gradscope.figures), so each number that saved one and
    has no node gets a node of its own, named :data:`UNSEEN_NODE`, with no edges and no steps; its
    module and line are found from its number as any forward node's. The graph's other nodes (those
    that saved nothing) are not known. Such nodes come after the walked ones (their ids are the
    last), so the ids of the nodes walked are as without them. Returns how many were made."""
    by_seq = graph.by_seq
    moves_get = trace.seq_moves.get
    missing: dict[int, None] = {}
    for row in trace.saves:
        seq = row[S_SEQ]
        if seq in by_seq:
            continue
        moved = moves_get(seq)
        if moved is not None:
            seq = moved[0]  # see NOTE [ saves packed under another number ] in gradscope._capture.discover
            if seq in by_seq:
                continue
        missing[seq] = None
    if not missing:
        return 0
    rows = graph.rows = list(graph.rows)
    index = dict(by_seq)
    for seq in sorted(missing):
        index[seq] = len(rows)
        graph.made.append((seq, len(rows)))
        rows.append((seq, seq, UNSEEN_NODE, None, None, False))
    graph.by_seq = index
    graph.made.sort()
    return len(missing)


# ----------------------------------------------------------------------------------- naming
def naming_pass(trace: Trace) -> list[str]:
    """The name of each root module: see NOTE [ naming roots ] in :mod:`gradscope._model.names`."""
    return _names.root_prefixes(trace.roots, trace.root_names, trace.modules_given)


def call_path(trace: Trace, prefixes: Sequence[str], call: Sequence[Any]) -> str:
    """The module path of one call; an unnamed lone root is called by its class name."""
    root = call[C_ROOT]
    return _names.full_name(prefixes[root], call[1]) or trace.roots[root][0]
