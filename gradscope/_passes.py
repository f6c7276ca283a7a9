"""Named, pure passes that turn a :class:`~gradscope._trace.Trace` into a :class:`Recording`.

Each pass reads the trace (and what earlier passes returned) and returns plain values; none of
them touches torch, a hook or a live object, so each can be run on a trace written by hand (see
``tests/test_passes.py``). :func:`build` runs them in order:

``graph`` (node table, edges) -> ``naming`` (root names) -> ``steps`` (backward steps, who made
the nodes a create_graph pass created) -> ``orders`` -> ``modules`` -> ``saves`` -> ``memory``
(allocation table, categories, timeline, peak) -> ``held`` (what was alive at the peak or the
failure) -> ``backward_calls`` -> ``notes``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope import _compat, _held, _lines, _names
from gradscope._series import Interner, downsample
from gradscope._trace import (
    C_ROOT,
    C_SEQ0,
    C_SEQ1,
    C_T0,
    C_T1,
    EV_LIVE,
    EV_POST,
    EV_PRE,
    EV_UNPACK,
    N_CUSTOM,
    N_KEY,
    N_LEAF,
    N_LEAF_SHAPE,
    N_NAME,
    N_SEQ,
    S_BYTES,
    S_LEAFISH,
    S_PTR,
    S_SEQ,
    S_SKEY,
    S_T,
    BackwardRow,
    Trace,
)
from gradscope.recording import (
    Allocation,
    BackwardCall,
    Category,
    Edge,
    Kind,
    MemoryPoint,
    Node,
    OomInfo,
    Peak,
    Phase,
    Recording,
    SavedTensor,
    Step,
    Table,
    Where,
)

__all__ = [
    "Steps",
    "build",
    "collectives_pass",
    "graph_pass",
    "memory_pass",
    "modules_pass",
    "naming_pass",
    "orders_pass",
    "saves_pass",
    "steps_pass",
    "unseen_nodes_pass",
]

_DEEP_GRAPH = 40_000  # nodes above which freeing may crash PyTorch: see NOTE [ freeing deep graphs ]
_CLOCK_SLACK_NS = 200_000  # the profiler's clock against time.time_ns(): see saves_to_allocations
_REGION_MARGIN_NS = 20_000  # a marked region that began this long after a pack began after it
# Backward formulas PyTorch picks differently under any Python dispatch mode (see tracker_note).
_MODE_SENSITIVE = ("prod", "cumprod", "det", "vander", "ctc_loss")


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
            seq = moved[0]  # see NOTE [ saves packed under another number ] in gradscope.capture.discover
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
    """The name of each root module: see NOTE [ naming roots ] in :mod:`gradscope._names`."""
    return _names.root_prefixes(trace.roots, trace.root_names, trace.modules_given)


def call_path(trace: Trace, prefixes: Sequence[str], call: Sequence[Any]) -> str:
    """The module path of one call; an unnamed lone root is called by its class name."""
    root = call[C_ROOT]
    return _names.full_name(prefixes[root], call[1]) or trace.roots[root][0]


# ----------------------------------------------------------------------------------- steps
@dataclass
class Steps:
    """Backward steps before they become :class:`Step` rows (one list per field)."""

    node: list[int] = field(default_factory=list)
    backward: list[int] = field(default_factory=list)
    t0: list[int] = field(default_factory=list)
    t1: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)  # position in trace.events (-1: a profiler scope)
    scope: list[int | None] = field(default_factory=list)
    live_before: list[int | None] = field(default_factory=list)
    live_after: list[int | None] = field(default_factory=list)
    # created node id -> id of the node that was running when it was made (see NOTE [ orders ])
    creators: dict[int, int | None] = field(default_factory=dict)
    freed: dict[int, int] = field(default_factory=dict)  # save index -> step (weak-ref checks)
    scope_step: dict[int, int] = field(default_factory=dict)  # profiler scope -> step
    unresolved_scopes: int = 0
    unordered_passes: int = 0  # memory="off" passes whose unseen steps were not given back
    # backward index -> the step that raised: started, never finished (see NOTE [ a backward that raised ])
    failed: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.node)


def steps_pass(trace: Trace, graph: Graph) -> Steps:
    """Backward steps in engine order, from the trace's step events or, with the profiler as
    memory source, from its node scopes (see NOTE [ how steps are seen ] in
    :mod:`gradscope.record`).

    NOTE [ a backward that raised ]: a call into the engine that raises (an error of the engine's
    own, a custom Function's backward or a hook that raises, an out-of-memory, a budget crossed)
    keeps its row, with the exception as text (never the exception: its traceback holds the
    user's frames) and whether it was an out-of-memory. Its steps are the nodes that started
    before the failure, the node that raised last: every source sees a node start (its pre hook,
    its profiler scope, its first unpack) also when it never ends. Where every node is hooked
    (``memory="tracker"``, ``"cuda"``) a node that started and got no post hook is the one that
    raised: ``BackwardCall.failed_step``, and a leaf whose ``AccumulateGrad`` raised is not among
    the leaves it accumulated into. With ``memory="off"`` the steps of nodes that save nothing
    are given back from the engine's order only between seen steps: where the pass stopped
    after the last seen step is not known, so none is added after it (a note says so). Its
    frees are those found at its end (the engine released the saves of the nodes that
    finished); its gradients the ``.grad`` of the leaves it accumulated into before the failure
    (``autograd.grad`` returns nothing then)."""
    out = Steps()
    mt = trace.memory_trace
    from_scopes = mt.source.node_scopes and bool(mt.scopes)
    by_pass: dict[int | None, list[int]] = {}  # each pass's own node scopes, read once (not once a pass)
    if from_scopes:
        for k, sc in enumerate(mt.scopes):
            if not sc.nested:
                by_pass.setdefault(sc.backward, []).append(k)
    for b_index, b in enumerate(trace.backwards):
        if not b.observed:
            continue
        if from_scopes:
            _steps_from_scopes(trace, graph, b_index, b, out, by_pass.get(b_index, ()))
        else:
            _steps_from_events(trace, graph, b_index, b, out)
        _creators(trace, graph, b, out)
    return out


def _steps_from_events(trace: Trace, graph: Graph, b_index: int, b: BackwardRow, out: Steps) -> None:
    """Consecutive unpacks of one node's saves, or its pre hook, start its step; a post hook
    ends it (else the next step's start does); live bytes read at boundaries (online sources)
    are the bytes before and after; frees found at a boundary belong to the step before it."""
    events, saves, by_seq = trace.events, trace.saves, graph.by_seq
    node_l, t0_l, t1_l, pos_l = out.node, out.t0, out.t1, out.start_pos
    before_l, after_l = out.live_before, out.live_after
    freed = out.freed
    freed_here: list[int] = []  # saves this pass freed (their steps move if unseen steps are added)
    first = len(node_l)
    cur_node = -1
    closed = True
    closed_at: dict[int, int] = {}
    step_of: dict[int | None, int] = {}  # node -> its (last) step in this pass
    live: int | None = None
    for pos in range(b.ev0, b.ev1):
        kind, ident, t, value = events[pos]
        if kind == EV_UNPACK:
            node = by_seq.get(saves[ident][S_SEQ])
            if node is None or (node == cur_node and not closed):
                continue  # another save of the running node, or a node no pass of ours ran
        elif kind == EV_PRE:
            node = ident
        elif kind == EV_POST:
            if ident == cur_node and not closed:
                closed = True
                closed_at[len(node_l) - 1] = t
            continue
        elif kind == EV_LIVE:
            live = value
            if node_l and len(node_l) > first and after_l[-1] is None:
                after_l[-1] = value
            continue
        else:  # EV_FREED
            if len(node_l) > first:
                k = len(node_l) - 1
                if value is not None:  # found at the pass's end: see NOTE [ frees checked once a pass ] in record
                    k = step_of.get(_save_node(trace, by_seq, value), k)
                freed[ident] = k
                freed_here.append(ident)
            continue
        step_of[node] = len(node_l)
        node_l.append(node)
        t0_l.append(t)
        t1_l.append(t)
        pos_l.append(pos)
        before_l.append(live)
        after_l.append(None)
        cur_node, closed = node, False
    if trace.memory.steps_by_unpack and len(node_l) > first:
        _add_unseen_steps(graph, b, out, first, freed_here)
    n = len(node_l)
    if b.error is not None and n > first and n - 1 not in closed_at and _hooks_every_node(trace):
        out.failed[b_index] = n - 1  # see NOTE [ a backward that raised ]
    out.backward.extend([b_index] * (n - first))
    out.scope.extend([None] * (n - first))
    for k in range(first, n):  # a step without a post hook ends where the next begins
        end = closed_at.get(k)
        t1_l[k] = end if end is not None else (t0_l[k + 1] if k + 1 < n else max(b.t1_ns, t0_l[k]))


def _save_node(trace: Trace, by_seq: Mapping[int, int], sid: int) -> int | None:
    """The node a save belongs to (see NOTE [ saves packed under another number ] in record)."""
    seq = trace.saves[sid][S_SEQ]
    node = by_seq.get(seq)
    if node is None:
        moved = trace.seq_moves.get(seq)
        if moved is not None:
            node = by_seq.get(moved[0])
    return node


def engine_order(graph: Graph, b: BackwardRow) -> list[int]:
    """The nodes one backward pass runs, in the order PyTorch's engine runs them on one thread.

    NOTE [ steps nobody saw ]: with ``memory="off"`` a step is seen when its node unpacks a save
    of ours (or, for the few nodes hooked, its pre hook runs); a node that saves nothing runs
    unseen, since hooking every such node would cost as much as the op (see NOTE [ how steps are
    seen ] in :mod:`gradscope.record`). Its step is given back from the engine's own rule: the
    nodes a pass runs are those reachable from its roots (with ``inputs=``, those on a path to
    an input; an input itself runs only for ``backward``, which accumulates into it), each runs
    once every node pointing at it has run, and among ready nodes the engine's queue runs the
    highest sequence number first (``AccumulateGrad``'s number is the largest). So the order is
    a simulation of that queue over the walked graph. It is used only where the steps that were
    seen come in the same order (checked: a pass run on several threads, or a graph with nodes of
    another thread, keeps only its seen steps); an unseen step lasts no time, at the start of the
    next seen one."""
    rows = graph.rows
    n = len(rows)
    kids = graph.kids()
    roots = [r for r in dict.fromkeys(b.roots) if 0 <= r < n]
    run: set[int] = set()
    if b.inputs:  # the nodes on a path from a root to an input: found from the inputs' side (a
        # pass of an unrolled loop reaches every earlier step's graph, but leads to its inputs
        # through its own step only), among the nodes that existed when the pass started (those
        # the later steps of the loop made lead to the inputs too, but no root reaches them)
        parents = graph.parents()
        known = b.nodes_known if b.nodes_known is not None else n
        leads: set[int] = set()  # nodes from which an input is reached (inputs included)
        stack = list(b.inputs)
        while stack:
            s_ = stack.pop()
            if s_ not in leads:
                leads.add(s_)
                stack.extend(p for p in parents.get(s_, ()) if p < known)
        stack = [r for r in roots if r in leads]
        while stack:
            d = stack.pop()
            if d not in run:
                run.add(d)
                stack.extend(k for k in kids.get(d, ()) if k in leads)
        if b.api != "backward":  # autograd.grad captures an input's gradient without running it
            run -= {i for i in b.inputs if not any(k in run for k in kids.get(i, ()))}
    else:
        stack = list(roots)
        while stack:
            d = stack.pop()
            if d not in run:
                run.add(d)
                stack.extend(kids.get(d, ()))
    deps = dict.fromkeys(run, 0)
    for d in run:
        for s_ in kids.get(d, ()):
            if s_ in deps:
                deps[s_] += 1
    for r in roots:
        if r in deps:
            deps[r] += 1
    ready: list[tuple[int, int]] = []
    for r in roots:
        if r in deps:
            deps[r] -= 1
            if deps[r] == 0:
                heapq.heappush(ready, (-int(rows[r][N_SEQ]), r))
    order: list[int] = []
    while ready:
        _, d = heapq.heappop(ready)
        order.append(d)
        for s_ in kids.get(d, ()):
            if s_ in deps:
                deps[s_] -= 1
                if deps[s_] == 0:
                    heapq.heappush(ready, (-int(rows[s_][N_SEQ]), s_))
    return order


def _hooks_every_node(trace: Trace) -> bool:
    """Whether every node of a pass had a pre and a post hook (the sources that read memory at
    each step's start and end)."""
    return trace.memory.node_hooks


def _add_unseen_steps(graph: Graph, b: BackwardRow, out: Steps, first: int, freed_here: list[int]) -> None:
    """Insert the steps of nodes that ran unseen (see NOTE [ steps nobody saw ]) among the seen
    steps ``out[first:]`` of pass ``b`` (after the last seen one only where the pass returned:
    see NOTE [ a backward that raised ])."""
    seen = out.node[first:]
    order = engine_order(graph, b)
    pos = {d: k for k, d in enumerate(order)}
    rows = graph.rows
    acc = _compat.ACC_SEQ
    last = -1
    seen_set = set(seen)
    agree = len(seen_set) == len(seen)  # a node seen twice in one pass: not the single-threaded engine
    for d in seen:  # the seen steps must come in the simulated order (AccumulateGrad ties aside)
        p = pos.get(d)
        if p is None:
            agree = False
        elif rows[d][N_SEQ] != acc:
            agree = agree and p > last
            last = p
    if not agree:
        out.unordered_passes += 1
        return
    node_l, t0_l, pos_l, before_l, after_l = (out.node[first:], out.t0[first:], out.start_pos[first:],
                                               out.live_before[first:], out.live_after[first:])
    for col in (out.node, out.t0, out.t1, out.start_pos, out.live_before, out.live_after):
        del col[first:]

    # each step of the pass, in order: its node, the seen step it takes its time and memory from,
    # and how (0: ran unseen before that step, 1: that step, 2: ran unseen after the last one)
    nodes: list[int] = []
    src: list[int] = []
    how: list[int] = []
    remap: dict[int, int] = {}
    j = 0
    for k, d in enumerate(node_l):
        p = pos[d]
        while j < p:
            u = order[j]
            j += 1
            if u not in seen_set:  # ran unseen before this step: no time, no memory of its own
                nodes.append(u)
                src.append(k)
                how.append(0)
        if j == p:
            j += 1
        remap[first + k] = first + len(nodes)
        nodes.append(d)
        src.append(k)
        how.append(1)
    k_last = len(node_l) - 1
    for u in order[j:] if b.error is None else ():
        if u not in seen_set:
            nodes.append(u)
            src.append(k_last)
            how.append(2)
    t0 = [t0_l[k] for k in src]
    out.node += nodes
    out.t0 += t0
    out.t1 += t0
    out.start_pos += [pos_l[k] for k in src]
    out.live_before += [after_l[k] if h == 2 else before_l[k] for k, h in zip(src, how, strict=True)]
    out.live_after += [before_l[k] if h == 0 else after_l[k] for k, h in zip(src, how, strict=True)]
    freed = out.freed
    for sid in freed_here:
        freed[sid] = remap[freed[sid]]


def _steps_from_scopes(trace: Trace, graph: Graph, b_index: int, b: BackwardRow, out: Steps,
                       own: Sequence[int]) -> None:
    """The profiler's node scopes of this pass (``own``: their indices; nested ones belong to a
    reentrant backward inside a node and are not among them), matched with nodes by sequence
    number; all ``AccumulateGrad`` nodes share one number, so those are taken in order from their
    pre hooks."""
    rows = graph.rows
    accs = [ident for kind, ident, _, _ in trace.events[b.ev0:b.ev1]
            if kind == EV_PRE and rows[ident][N_NAME] == "AccumulateGrad"]
    acc_i = 0
    by_seq_get = graph.by_seq.get
    ks: list[int] = []
    nodes: list[int] = []
    t0: list[int] = []
    t1: list[int] = []
    unresolved = 0
    scopes = trace.memory_trace.scopes
    for k in own:
        name, seq, start, end, _, _ = scopes[k]
        node: int | None
        if name == "AccumulateGrad":
            node = accs[acc_i] if acc_i < len(accs) else None
            acc_i += 1
        else:
            node = by_seq_get(seq)
            if node is not None and rows[node][N_NAME] != name:
                node = None
        if node is None:
            unresolved += 1
            continue
        ks.append(k)
        nodes.append(node)
        t0.append(start)
        t1.append(end)
    out.unresolved_scopes += unresolved
    first = len(out.node)
    out.scope_step.update(zip(ks, range(first, first + len(ks)), strict=True))
    m = len(ks)
    out.node += nodes
    out.backward += [b_index] * m
    out.t0 += t0
    out.t1 += t1
    out.start_pos += [-1] * m
    out.scope += ks
    out.live_before += [None] * m
    out.live_after += [None] * m


def _creators(trace: Trace, graph: Graph, b: BackwardRow, out: Steps) -> None:
    """NOTE [ orders ]: a node made during a ``create_graph=True`` pass was made by the node the
    engine was running: the one whose pre hook read the largest sequence counter not above the
    new node's number. That includes the ``AddBackward0`` the engine makes after a node's post
    hook to sum two gradients reaching one input: it belongs to the node that produced them (its
    order is that node's plus one), never to the forward (order 0)."""
    if not b.create_graph:
        return
    saves, by_seq = trace.saves, graph.by_seq
    marks: list[tuple[int, int]] = []
    for kind, ident, _, value in trace.events[b.ev0:b.ev1]:
        if value is None:
            continue
        if kind == EV_PRE:
            marks.append((value, ident))
        elif kind == EV_UNPACK:  # a node's first unpack: see NOTE [ how steps are seen ] in record
            node = by_seq.get(saves[ident][S_SEQ])
            if node is not None:
                marks.append((value, node))
    marks.sort()
    seqs = [m[0] for m in marks]
    made = graph.made
    creators = out.creators
    for j in range(bisect.bisect_left(made, (b.seq0, -1)), bisect.bisect_left(made, (b.seq1, -1))):
        seq, i = made[j]
        if i not in creators:
            k = bisect.bisect_right(seqs, seq) - 1
            creators[i] = marks[k][1] if k >= 0 else None


# ----------------------------------------------------------------------------------- orders
def orders_pass(trace: Trace, graph: Graph, steps: Steps) -> list[int]:
    """0 for forward nodes; a node a create_graph pass made has its creator's order plus one
    (1 when its creator is unknown). See NOTE [ orders ]."""
    orders = [0] * len(graph.rows)
    for i in sorted(steps.creators, key=lambda i: graph.rows[i][N_SEQ]):
        c = steps.creators[i]
        orders[i] = (orders[c] + 1) if c is not None else 1
    return orders


# ----------------------------------------------------------------------------------- modules
def modules_pass(trace: Trace, graph: Graph, prefixes: Sequence[str], steps: Steps,
                 orders: Sequence[int]) -> list[str | None]:
    """Forward nodes get the innermost module call whose sequence range holds their number;
    nodes a backward made inherit the module of the node that made them; leaves their
    parameter's module."""
    n = len(graph.rows)
    modules: list[str | None] = [None] * n
    keyed = sorted((row[N_SEQ], i) for i, row in enumerate(graph.rows)
                   if isinstance(row[N_KEY], int) and orders[i] == 0)
    seqs = [q for q, _ in keyed]
    # Calls are appended at their start, so outer calls come before the calls nested in them:
    # writing each call's range in that order leaves every node with its innermost module.
    for call in trace.calls:
        lo = bisect.bisect_left(seqs, call[C_SEQ0])
        hi = bisect.bisect_left(seqs, call[C_SEQ1] if call[C_SEQ1] >= 0 else call[C_SEQ0])
        if lo < hi:
            path = call_path(trace, prefixes, call)
            for _, i in keyed[lo:hi]:
                modules[i] = path
    for i in sorted(steps.creators, key=lambda i: graph.rows[i][N_SEQ]):
        c = steps.creators[i]
        if c is not None and modules[i] is None:
            modules[i] = modules[c]
    for i in graph.leaves:
        name = leaf_name(graph.rows[i][N_LEAF], prefixes)
        if name and name != "input" and modules[i] is None and "." in name:
            modules[i] = name.rsplit(".", 1)[0]
    return modules


def leaf_name(leaf: Any, prefixes: Sequence[str]) -> str | None:
    """A node row's leaf field as a name: ``(root, path)`` -> ``"G.0.weight"``."""
    if isinstance(leaf, tuple):
        root, rel = leaf
        return _names.full_name(prefixes[root], rel) if root < len(prefixes) else rel
    return leaf


# ----------------------------------------------------------------------------------- saves
@dataclass
class Saves:
    """Saves attached to nodes, one list per field (``sid``: index into ``trace.saves``)."""

    sid: list[int]
    node: list[int]
    attribute: list[str]
    kind: list[Kind]
    name: list[str | None]
    storage: list[int]  # recording-local storage id
    dropped: int

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(save index, node id) for each save attached to a node."""
        return list(zip(self.sid, self.node, strict=True))


_DTYPE: dict[Any, str] = {}


def _dtype(d: Any) -> str:
    s = _DTYPE.get(d)
    if s is None:
        s = _DTYPE[d] = str(d).replace("torch.", "")
    return s


def saves_pass(trace: Trace, graph: Graph, prefixes: Sequence[str]) -> Saves:
    """Each save attached to the node that saved it (see NOTE [ which node saved a tensor ] in
    :mod:`gradscope.record`), with its attribute, its kind and its parameter name."""
    sids: list[int] = []
    nodes: list[int] = []
    attrs: list[str] = []
    kinds: list[Kind] = []
    names: list[str | None] = []
    storages: list[int] = []
    storage_ids: Interner[int] = Interner()  # storage key -> storage id, in order of first save
    by_seq_get = graph.by_seq.get
    save_attr_get, seq_attr_get, param_get = trace.save_attr.get, trace.seq_attr.get, trace.param_keys.get
    seq_order = trace.seq_order
    position: dict[int, int] = {}  # saves of a node in seq_order seen so far
    inner_position: dict[int, int] = {}  # saves of a CopySlices node's inner node seen so far
    kind_of = {"parameter": Kind.PARAMETER, "buffer": Kind.BUFFER}
    input_kind, activation = Kind.INPUT, Kind.ACTIVATION
    moves_get = trace.seq_moves.get
    # a storage's identity: its first save where the recorder gave one (see NOTE [ a storage's
    # identity in a block ] in gradscope.capture.saves), else its key
    identity = trace.save_storage if len(trace.save_storage) == len(trace.saves) else None
    for sid, s in enumerate(trace.saves):
        seq = s[S_SEQ]
        node = by_seq_get(seq)
        attr = save_attr_get(sid)
        if node is None:  # see NOTE [ saves packed under another number ] in gradscope.capture.discover
            moved = moves_get(seq)
            if moved is None or (node := by_seq_get(moved[0])) is None:
                continue
            if moved[1] == _INNER_NODE:  # see NOTE [ saves inside CopySlices ]
                k = inner_position.get(moved[0], 0)
                inner_position[moved[0]] = k + 1
                attr = attr or f"fn.saved[{k}]"
            attr = attr or moved[1]
        sids.append(sid)
        nodes.append(node)
        attr = attr or seq_attr_get(seq)
        if attr is None and seq in seq_order:  # see NOTE [ pack order ] in gradscope.capture.discover
            k = position.get(seq, 0)
            position[seq] = k + 1
            order = seq_order[seq]
            attr = order[k] if k < len(order) else None
        attrs.append(attr or f"saved[{len(sids) - 1}]")
        skey = s[S_SKEY]
        named = param_get(skey)
        if named is not None:
            root, rel, kind = named
            kinds.append(kind_of[kind])
            names.append(_names.full_name(prefixes[root], rel))
        else:
            kinds.append(input_kind if s[S_LEAFISH] else activation)
            names.append(None)
        storages.append(storage_ids(skey if identity is None else identity[sid]))
    return Saves(sids, nodes, attrs, kinds, names, storages, len(trace.saves) - len(sids))


# ----------------------------------------------------------------------------------- memory
@dataclass
class Memory:
    allocations: Table[Allocation]
    timeline: Table[MemoryPoint]
    peak_bytes: int
    peak: Peak | None
    dropped_points: int
    save_alloc: dict[int, int]  # save index -> allocation index
    freed_at: dict[int, int]  # save index -> step that freed its storage
    step_freed: dict[int, int]  # step -> bytes of saved storages it freed
    peak_position: int | None
    events_positions: int
    columns: _AllocColumns


def memory_pass(trace: Trace, graph: Graph, prefixes: Sequence[str], steps: Steps, orders: Sequence[int],
                modules: Sequence[str | None], saves: Saves, node_line: Sequence[int | None] = ()) -> Memory:
    """The allocation table, each allocation's category and phase, the timeline and the peak.

    The memory source's events are read as columns: each event gets its step, phase, module and
    label, allocations are paired with their frees (by key), saves are matched with allocations
    and categories assigned; only then is the timeline built (see NOTE [ tables are columns ] in
    :mod:`gradscope.recording`)."""
    mt = trace.memory_trace
    events = mt.events
    n = len(events)
    t0 = trace.t0_ns
    calls = trace.calls
    if n:
        t_l, size_l, key_l, label_l, scope_l, stamp_l, res_l, call_l, hint_l, bw_l, line_l, seq_l = (
            list(c) for c in zip(*events, strict=True))
    else:
        t_l = size_l = key_l = label_l = scope_l = stamp_l = res_l = call_l = hint_l = bw_l = line_l = seq_l = []
    if mt.source.unscoped and n:  # see NOTE [ a long loop's memory ] in gradscope.memory
        bw_l, hint_l, line_l = _counter_context(trace, graph, node_line, t_l, seq_l)
    ev_step = _event_steps(trace, steps, scope_l, bw_l, stamp_l, t_l)
    # each event's line: in backward the running node's, else what the source saw (see NOTE [ where
    # lines come from ] in gradscope._lines)
    ev_line: list[int | None] = (
        [node_line[steps.node[st]] if st is not None else (ln if ln is not None and ln >= 0 else None)
         for st, ln in zip(ev_step, line_l, strict=True)] if node_line else [None] * n)
    lives = list(itertools.accumulate(size_l))
    peak_v = max(lives) if lives else 0
    peak_i = lives.index(peak_v) if peak_v > 0 else -1
    peak_v = max(peak_v, 0)
    pairable = mt.key_kind != "none"
    a_bytes: list[int] = []
    a_at: list[int] = []
    a_key: list[int] = []
    a_free: list[int | None] = []
    a_free_t: list[int | None] = []
    point_alloc: list[int | None] = [None] * n
    if pairable:  # one sweep: an allocation is open from its event to the free of its key
        open_: dict[int, int] = {}
        open_pop = open_.pop
        for k, size in enumerate(size_l):
            if size > 0:
                ai = len(a_bytes)
                open_[key_l[k]] = ai
                a_bytes.append(size)
                a_at.append(k)
                a_free.append(None)
                a_free_t.append(None)
                point_alloc[k] = ai
            else:
                found = open_pop(key_l[k], None)
                if found is not None:
                    point_alloc[k] = found
                    a_free[found] = k
                    a_free_t[found] = t_l[k]
        a_key = [key_l[k] for k in a_at]
    a_t = [t_l[k] for k in a_at]
    allocs = _AllocColumns(a_bytes, a_at, a_free, a_t, a_free_t, a_key, [], [], [])  # steps and phases below
    unseen = {sid for sid, node in zip(saves.sid, saves.node, strict=True) if graph.rows[node][N_NAME] == UNSEEN_NODE}
    save_alloc, saver = (_saves_to_allocations(trace, saves, allocs, mt.key_kind, [call_l[k] for k in a_at],
                                               [bw_l[k] for k in a_at], unseen) if pairable else ({}, {}))
    if not mt.online and save_alloc:
        _releases_stamped_late(steps, scope_l, ev_step, set(save_alloc.values()), allocs)
    allocs.free_step = [None if k is None else ev_step[k] for k in a_free]
    backward, optimizer, other, forward = Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER, Phase.FORWARD
    windows = sorted((o[1], o[2] or trace.t1_ns) for o in trace.optimizer_steps)
    win_starts = [w[0] for w in windows]
    if mt.online:
        in_bw = _position_test([(b.ev0, b.ev1) for b in trace.backwards if b.observed])
        phases = [optimizer if h == "optimizer" or (h is None and st is None and windows and _inside(win_starts, windows, t))
                  else backward if st is not None or (p is not None and in_bw(p))
                  else other if h == "other" else forward
                  for h, st, p, t in zip(hint_l, ev_step, stamp_l, t_l, strict=True)]
    else:
        phases = [optimizer if h == "optimizer"
                  else backward if st is not None or sc is not None or b is not None
                  else other if h == "other" else forward
                  for h, st, sc, b in zip(hint_l, ev_step, scope_l, bw_l, strict=True)]
    call_paths = [call_path(trace, prefixes, c) for c in calls]
    call_labels = [c[7] if len(c) > 7 else "" for c in calls]
    node_module = [modules[i] for i in steps.node]
    node_label = [graph.rows[i][N_NAME] for i in steps.node]
    fwd_modules = (_modules_at(trace, prefixes, t_l) if n and not mt.marks_calls and calls else None)
    mods: list[str | None] = [
        node_module[st] if st is not None else call_paths[c] if c is not None and 0 <= c < len(calls) else None
        for st, c in zip(ev_step, call_l, strict=True)
    ]
    if fwd_modules is not None:
        mods = [fm if m is None and ph is forward else m for m, fm, ph in zip(mods, fwd_modules, phases, strict=True)]
    labels = [
        lb or (node_label[st] if st is not None else call_labels[c] if c is not None and 0 <= c < len(calls)
               else ph.value)
        for lb, st, c, ph in zip(label_l, ev_step, call_l, phases, strict=True)
    ]
    # bytes around each step, for sources that are not online: the events at its boundaries
    if not mt.online and len(steps) and n:
        for k, sc in enumerate(steps.scope):
            if sc is None:
                continue
            a = bisect.bisect_left(t_l, steps.t0[k])
            b = bisect.bisect_right(t_l, steps.t1[k])
            steps.live_before[k] = lives[a - 1] if a > 0 else 0
            steps.live_after[k] = lives[b - 1] if b > 0 else 0
    allocs.phase = [phases[k] for k in a_at]
    allocs.step = [ev_step[k] for k in a_at]
    categories = _categories(trace, orders, saves, allocs, save_alloc, mt.key_kind)
    # frees of saved storages: which step freed each (allocation table), or the weak-ref checks
    freed_at: dict[int, int] = {}
    step_freed: dict[int, int] = {}
    if pairable:
        saved_allocs: dict[int, list[int]] = {}
        for sid, ai in save_alloc.items():
            saved_allocs.setdefault(ai, []).append(sid)
        for ai, sids in saved_allocs.items():
            st = allocs.free_step[ai]
            if a_free[ai] is not None and st is not None:
                for sid in sids:
                    freed_at[sid] = st
                step_freed[st] = step_freed.get(st, 0) + a_bytes[ai]
    elif steps.freed:
        # A storage found freed at a step was also freed for the saves of it made before (by nodes
        # that ran earlier and released their reference then), back to the previous free found
        # for its key (a key names one storage at a time: the address is reused after a free).
        # Each save is visited once: a block of many passes reuses addresses thousands of times.
        tsaves = trace.saves
        by_key: dict[int, list[int]] = {}
        for sid in sorted(saves.sid):
            by_key.setdefault(tsaves[sid][S_SKEY], []).append(sid)
        done: dict[int, int] = {}  # key -> how many of its saves are behind a free already
        for sid in sorted(steps.freed):
            st = steps.freed[sid]
            key = tsaves[sid][S_SKEY]
            step_freed[st] = step_freed.get(st, 0) + tsaves[sid][S_BYTES]
            same = by_key.get(key, ())
            j = done.get(key, 0)
            while j < len(same) and same[j] <= sid:
                freed_at.setdefault(same[j], st)
                j += 1
            done[key] = j
    na = len(a_bytes)
    allocations: Table[Allocation] = Table(Allocation, {
        "index": range(na), "bytes": a_bytes, "alloc_at": a_at, "free_at": a_free,
        "t_s": [(t - t0) / 1e9 for t in a_t], "category": categories,
        "phase": allocs.phase, "module": [mods[k] for k in a_at],
        "node": [saver.get(i) for i in range(na)], "step": allocs.step,
        "label": [labels[k] for k in a_at], "key": a_key, "line": [ev_line[k] for k in a_at],
    })
    dropped = 0
    other_cat = Category.OTHER
    point_cat = [other_cat if pa is None else categories[pa] for pa in point_alloc]
    point_line = [ev_line[k] if pa is None else ev_line[a_at[pa]] for k, pa in enumerate(point_alloc)]
    if trace.max_events is not None and n > trace.max_events:
        keep = downsample(lives, trace.max_events, (peak_i,))  # see NOTE [ downsampling keeps the peak ]
        dropped = n - len(keep)
        t_l, lives, res_l = [t_l[k] for k in keep], [lives[k] for k in keep], [res_l[k] for k in keep]
        phases, labels = [phases[k] for k in keep], [labels[k] for k in keep]
        ev_step, mods = [ev_step[k] for k in keep], [mods[k] for k in keep]
        point_cat = [point_cat[k] for k in keep]
        point_line = [point_line[k] for k in keep]
    timeline: Table[MemoryPoint] = Table(MemoryPoint, {
        "t_s": [(t - t0) / 1e9 for t in t_l], "live": lives, "phase": phases, "label": labels,
        "step": ev_step, "module": mods, "reserved": res_l, "category": point_cat, "line": point_line,
    })
    peak_bytes = peak_v
    if mt.peak is not None:
        peak_bytes = max(peak_bytes, mt.peak)
    peak = None
    if peak_i >= 0:
        p = timeline[keep.index(peak_i)] if dropped else timeline[peak_i]
        peak = Peak(bytes=peak_bytes, phase=p.phase, t_s=p.t_s, label=p.label,
                    node=steps.node[p.step] if p.step is not None else None, module=p.module, step=p.step)
    elif mt.peak:
        peak = Peak(bytes=peak_bytes, phase=Phase.FORWARD, label="(allocator statistics)")
    return Memory(allocations, timeline, peak_bytes, peak, dropped, save_alloc, freed_at, step_freed,
                  peak_i if peak_i >= 0 else None, n, allocs)


def _counter_context(trace: Trace, graph: Graph, node_line: Sequence[int | None], t_l: Sequence[int],
                     seq_l: Sequence[int | None]) -> tuple[list[int | None], list[str | None], list[int | None]]:
    """For the allocator counter's events (see NOTE [ a long loop's memory ] in gradscope.memory),
    which carry our clock's time and the sequence counter: the backward pass each happened in (by
    time), ``"optimizer"`` inside an optimizer step, and a forward allocation's line, its node's
    (the node numbered one below the counter, as for a save: see NOTE [ which node saved a tensor ]
    in gradscope.record)."""
    passes = sorted((b.t0_ns, b.t1_ns, i) for i, b in enumerate(trace.backwards) if b.observed)
    starts = [p[0] for p in passes]
    opt = sorted((o[1], o[2] or trace.t1_ns) for o in trace.optimizer_steps)
    opt_starts = [w[0] for w in opt]
    by_seq = graph.by_seq
    bw_l: list[int | None] = []
    hint_l: list[str | None] = []
    line_l: list[int | None] = []
    for t, seq in zip(t_l, seq_l, strict=True):
        j = bisect.bisect_right(starts, t) - 1
        bw = passes[j][2] if j >= 0 and t <= passes[j][1] else None
        bw_l.append(bw)
        hint_l.append("optimizer" if bw is None and opt and _inside(opt_starts, opt, t) else None)
        node = by_seq.get(seq - 1) if seq is not None and bw is None and node_line else None
        line_l.append(node_line[node] if node is not None else None)
    return bw_l, hint_l, line_l


def _position_test(windows: list[tuple[int, int]]) -> Callable[[int], bool]:
    """Whether a step-event position falls inside one of the (sorted) backward windows."""
    starts = [a for a, _ in windows]

    def inside(pos: int) -> bool:
        j = bisect.bisect_right(starts, pos) - 1
        return j >= 0 and pos <= windows[j][1]

    return inside


def _inside(starts: list[int], windows: list[tuple[int, int]], t: int) -> bool:
    k = bisect.bisect_right(starts, t) - 1
    return k >= 0 and windows[k][0] <= t <= windows[k][1]


def _event_steps(trace: Trace, steps: Steps, scope_l: Sequence[int | None], bw_l: Sequence[int | None],
                 stamp_l: Sequence[int | None], t_l: Sequence[int]) -> list[int | None]:
    """The backward step each memory event belongs to: the node scope it happened in; for
    events between node scopes of a backward (the engine releasing the last node's saved
    tensors), the node that ran last, also when the next node's scope carries the same time
    stamp (the profiler's clock may not tell a release from the next start apart); for online
    sources, the step events before it."""
    n = len(t_l)
    out: list[int | None] = [None] * n
    if not len(steps):
        return out
    scope_step = steps.scope_step
    by_b: dict[int, tuple[list[int], list[int]]] = {}
    starts: list[int] = []
    start_steps: list[int] = []
    for k, sc in enumerate(steps.scope):
        if sc is not None:
            ts, ks = by_b.setdefault(steps.backward[k], ([], []))
            ts.append(steps.t0[k])
            ks.append(k)
        else:
            starts.append(steps.start_pos[k])
            start_steps.append(k)
    bw_ranges = [(b.ev0, b.ev1) for b in trace.backwards]
    s_backward = steps.backward
    right = bisect.bisect_right
    step_of_scope = scope_step.get
    timed: dict[int, tuple[list[int], list[int]]] = {}  # passes without node scopes: their steps by time
    for i, sc in enumerate(scope_l):
        if sc is not None:
            out[i] = step_of_scope(sc)
            continue
        bw = bw_l[i]
        if bw is not None:
            got = by_b.get(bw)
            if got is not None:
                j = bisect.bisect_left(got[0], t_l[i]) - 1  # a step that starts at t ran after
                if j >= 0:
                    out[i] = got[1][j]
            else:  # the allocator counter's events (see NOTE [ a long loop's memory ] in gradscope.memory)
                got = timed.get(bw)
                if got is None:
                    ks = [k for k in start_steps if s_backward[k] == bw]
                    got = timed[bw] = ([steps.t0[k] for k in ks], ks)
                j = bisect.bisect_right(got[0], t_l[i]) - 1
                if j >= 0:
                    out[i] = got[1][j]
            continue
        p = stamp_l[i]
        if p is not None and starts:
            j = right(starts, p) - 1
            if j >= 0:
                k = start_steps[j]
                a, b = bw_ranges[s_backward[k]]
                if a <= p <= b:
                    out[i] = k
    return out


def _releases_stamped_late(steps: Steps, scope_l: Sequence[int | None], ev_step: list[int | None],
                           saved_allocs: set[int], allocs: _AllocColumns) -> None:
    """NOTE [ releases stamped late ]: the engine releases a node's saved tensors after the node's
    scope has ended and before the next node's begins: no node frees a saved storage inside its
    own scope (it only reads its saves there). The profiler stamps allocator events and scopes
    from two clocks, so the free of the last release can carry a time microseconds inside the next
    node's scope, and the profiler's tree then puts it there (seen under load, in CI). A free of a
    saved storage inside a node scope, of an allocation made before that scope began, is moved to
    the step before it in the same pass (a storage made inside the scope, such as one a
    checkpointed segment recomputes there, stays its own). ``ev_step`` is changed in place."""
    s_backward, s_t0 = steps.backward, steps.t0
    a_free, a_t = allocs.free, allocs.t
    for ai in saved_allocs:
        k = a_free[ai]
        if k is None or scope_l[k] is None:
            continue
        st = ev_step[k]  # its scope's step (where the profiler gives scopes, every step is a scope's)
        if st and a_t[ai] < s_t0[st] and s_backward[st - 1] == s_backward[st]:
            ev_step[k] = st - 1


@dataclass
class _AllocColumns:
    """The allocation table while it is built (one list per field)."""

    bytes: list[int]
    at: list[int]
    free: list[int | None]
    t: list[int]
    free_t: list[int | None]
    key: list[int]
    free_step: list[int | None]
    phase: list[Phase]
    step: list[int | None]


def _saves_to_allocations(trace: Trace, saves: Saves, allocs: _AllocColumns, key_kind: str,
                          a_call: Sequence[int | None], a_bw: Sequence[int | None], strict: set[int] | None = None,
                          ) -> tuple[dict[int, int], dict[int, int]]:
    """Each save's allocation: the one that held the save's key (storage key for the tracker,
    address for the allocators) when it was packed. Keys are reused once freed, so the candidate
    is the latest allocation of that key made no later than the pack, still alive then. The
    profiler's clock and ``time.time_ns()`` differ by microseconds: times are compared with
    :data:`_CLOCK_SLACK_NS` of slack (an output is packed microseconds after it is allocated).
    Within that slack the allocator may already have given the address again, once the save was
    freed (a small graph's backward starts microseconds after its forward): an allocation made
    inside a backward pass or module call (``a_bw``, ``a_call``: known from the source's marks, not
    from a clock) that began after the pack, by :data:`_REGION_MARGIN_NS` or more, is a later
    one, and the candidate before it is taken.
    A save of an unseen node (``strict``: see NOTE [ saves of nodes never walked ]) has no backward to
    tell its allocation apart: its storage often died at once and its address was given again within
    the slack, so it takes only an allocation made before the pack with no other of its key made
    within the slack around it, and stays unmatched otherwise.
    Returns (save index -> allocation, allocation -> the first node that saved it)."""
    a_t, a_free_t = allocs.t, allocs.free_t
    # per key, its allocations and their times (allocation order is time order); an address
    # the allocator reuses has thousands: the candidate is found by bisection
    by_key: dict[int, tuple[list[int], list[int]]] = {}
    for i, k in enumerate(allocs.key):
        got = by_key.get(k)
        if got is None:
            got = by_key[k] = ([], [])
        got[0].append(i)
        got[1].append(a_t[i])
    key_field = S_SKEY if key_kind == "storage" else S_PTR
    # one clock for the tracker's and the allocator counter's events and the saves: no slack
    slack = 0 if trace.memory_trace.source.our_clock else _CLOCK_SLACK_NS
    out: dict[int, int] = {}
    saver: dict[int, int] = {}
    right = bisect.bisect_right
    tsaves = trace.saves
    # when each allocation's innermost marked region began (our clock), where a source marks them
    region_t0: list[int | None] = [None] * len(a_bw)
    if slack:
        bw_t0 = [b.t0_ns for b in trace.backwards]
        call_t0 = [c[C_T0] for c in trace.calls]
        for i, (b, c) in enumerate(zip(a_bw, a_call, strict=True)):
            if b is not None and 0 <= b < len(bw_t0):
                region_t0[i] = bw_t0[b]
            elif c is not None and 0 <= c < len(call_t0):
                region_t0[i] = call_t0[c]
    for sid, node in zip(saves.sid, saves.node, strict=True):
        s = tsaves[sid]
        cands = by_key.get(s[key_field])
        if cands is None:
            continue
        t = s[S_T]
        if strict and sid in strict:
            j = right(cands[1], t) - 1
            if j < 0 or (j + 1 < len(cands[1]) and cands[1][j + 1] <= t + slack):
                continue
        else:
            j = right(cands[1], t + slack) - 1
        while j >= 0 and (r0 := region_t0[cands[0][j]]) is not None and r0 > t + _REGION_MARGIN_NS:
            j -= 1  # made in a region that began after the pack: the address given again
        if j < 0:
            continue
        best = cands[0][j]
        ft = a_free_t[best]
        if ft is not None and ft < t - slack:
            continue
        out[sid] = best
        saver.setdefault(best, node)
    return out, saver


_CLOCK_SKEW_NS = 2_000_000  # see NOTE [ two clocks ]


def _freed_after(free_t: int | None, t: int) -> bool:
    return free_t is None or free_t >= t


def _categories(trace: Trace, orders: Sequence[int], saves: Saves, allocs: _AllocColumns,
                save_alloc: dict[int, int], key_kind: str) -> list[Category]:
    """Each allocation's :class:`Category`: saved by a forward node (ACTIVATION) or by a node a
    create_graph pass made (CREATE_GRAPH); a gradient (the ``.grad`` a pass accumulated into, or
    a result of ``autograd.grad``); made by an optimizer step; made during backward otherwise
    (BACKWARD_TEMP); anything else (OTHER)."""
    n = len(allocs.bytes)
    cats = [Category.OTHER] * n
    by_key: dict[int, tuple[list[int], list[int]]] = {}  # key -> its allocations and their times, in order
    a_t, a_free_t = allocs.t, allocs.free_t
    for i, k in enumerate(allocs.key):
        got = by_key.get(k)
        if got is None:
            got = by_key[k] = ([], [])
        got[0].append(i)
        got[1].append(a_t[i])
    gradient: set[int] = set()
    right = bisect.bisect_right
    for _b, skey, ptr, t in trace.gradient_keys:
        cands, times = by_key.get(skey if key_kind == "storage" else ptr, ((), ()))
        # one allocation of a key lives at a time: the latest made by t, if not freed before it (found by
        # bisection: a loop reuses an address thousands of times)
        j = right(times, t) - 1
        alive = [cands[j]] if j >= 0 and _freed_after(a_free_t[cands[j]], t) else []
        if not alive:
            # NOTE [ two clocks ]: the pass's end is read from Python's clock, the profiler's
            # events from its own; the last gradient of a pass (the first layer's) can be stamped
            # microseconds after the pass ended. Take the latest allocation of the key made
            # within the skew that was not freed before it.
            j = right(times, t + _CLOCK_SKEW_NS) - 1  # the earlier ones were freed before it was made
            alive = [cands[j]] if j >= 0 and _freed_after(a_free_t[cands[j]], t - _CLOCK_SKEW_NS) else []
        gradient.update(alive)
    saved_order: dict[int, int] = {}
    node_of = dict(zip(saves.sid, saves.node, strict=True))
    for sid, ai in save_alloc.items():
        o = orders[node_of[sid]]
        saved_order[ai] = min(saved_order.get(ai, o), o)
    for i in range(n):
        if i in saved_order:
            cats[i] = Category.ACTIVATION if saved_order[i] == 0 else Category.CREATE_GRAPH
        elif i in gradient:
            cats[i] = Category.GRADIENT
        elif allocs.phase[i] is Phase.OPTIMIZER:
            cats[i] = Category.OPTIMIZER
        elif allocs.phase[i] is Phase.BACKWARD:
            cats[i] = Category.BACKWARD_TEMP
    return cats


def _modules_at(trace: Trace, prefixes: Sequence[str], times: list[int]) -> list[str | None]:
    """The innermost module call running at each of ``times`` (sorted), in one sweep."""
    calls = trace.calls  # appended at their start: sorted by start time
    out: list[str | None] = []
    open_calls: list[Sequence[Any]] = []
    i = 0
    for t in times:
        while i < len(calls) and calls[i][C_T0] <= t:
            open_calls.append(calls[i])
            i += 1
        while open_calls and open_calls[-1][C_T1] < t:
            open_calls.pop()
        j = len(open_calls) - 1  # a call that ended may still sit under one that is open
        while j >= 0 and open_calls[j][C_T1] < t:
            j -= 1
        out.append(None if j < 0 else call_path(trace, prefixes, open_calls[j]))
    return out


# ----------------------------------------------------------------------------------- calls, notes
def backward_calls_pass(trace: Trace, graph: Graph, steps: Steps) -> list[BackwardCall]:
    out = []
    by_b: dict[int, list[int]] = {}
    for k, bi in enumerate(steps.backward):
        by_b.setdefault(bi, []).append(k)
    rows = graph.rows
    for i, b in enumerate(trace.backwards):
        ks = by_b.get(i, [])
        failed = steps.failed.get(i)  # a leaf whose AccumulateGrad raised got no gradient
        accumulated = tuple(dict.fromkeys(steps.node[k] for k in ks
                                          if k != failed and rows[steps.node[k]][N_NAME] == "AccumulateGrad"))
        out.append(BackwardCall(index=i, api=b.api, create_graph=b.create_graph, retain_graph=b.retain_graph,
                                roots=tuple(b.roots), inputs=tuple(b.inputs), accumulated=accumulated,
                                first_step=ks[0] if ks else None, last_step=ks[-1] if ks else None,
                                observed=b.observed, error=b.error, oom=b.oom, failed_step=failed))
    return out


def notes_pass(trace: Trace, graph: Graph, saves: Saves, steps: Steps, unseen: int = 0) -> list[str]:
    notes = list(trace.notes)
    if unseen:
        n_saves = sum(1 for node in saves.node if graph.rows[node][N_NAME] == UNSEEN_NODE)
        notes.append(f"{n_saves} saved tensors belonged to {unseen} nodes whose graph was freed before gradscope "
                     f"walked it (a result detached or dropped before any backward): they are counted, each under "
                     f"a node named {UNSEEN_NODE!r} with the module and line that made it; the graph's other "
                     "nodes are not known.")
    if saves.dropped:
        notes.append(f"{saves.dropped} saved tensors belonged to nodes that were freed before gradscope saw "
                     "them; they are not listed.")
    if trace.foreign_saves:
        notes.append(
            f"{trace.foreign_saves} saved tensors were packed by other saved_tensors_hooks (a user's own "
            "pair, save_on_cpu or non-reentrant checkpoint inside the block; only the innermost pair "
            "applies): gradscope cannot see or size them, so saved bytes are undercounted."
        )
    if trace.unseen_saves:
        notes.append(
            f"{trace.unseen_saves} saved variables of nodes made while other saved_tensors_hooks were "
            "active (a user's own pair, save_on_cpu or non-reentrant checkpoint inside the block) were "
            "not packed by gradscope: it cannot see or size them, so saved bytes are undercounted. This "
            "torch cannot say which of them are None (SavedTensor.unpack_hook is missing): the count "
            "includes those."
        )
    names = [row[N_NAME] for row in graph.rows]
    if any(row[N_CUSTOM] for row in graph.rows):
        notes.append(
            "custom autograd.Function nodes are present: tensors they keep as ctx attributes "
            "(ctx.x = t) bypass saved-tensor hooks and are not counted; save_for_backward is counted."
        )
    compiled = names.count("CompiledFunctionBackward")
    if compiled:
        tracker = trace.memory.dispatch_mode
        notes.append(
            f"{compiled} torch.compile'd regions ran as single CompiledFunctionBackward nodes: the "
            "operations inside them are not shown; the tensors they save for backward are counted"
            + ("; allocations made inside compiled code are not seen by memory='tracker' (use "
               "memory='cpu')." if tracker else ".")
        )

    if len(graph.rows) > _DEEP_GRAPH and trace.deep_graph_trap:
        # See NOTE [ freeing deep graphs ] in gradscope._walk.
        notes.append(
            f"{len(graph.rows)} nodes: this torch frees a graph that Python has walked recursively, and "
            "a chain this deep can overflow the stack (a crash) when its last tensor is dropped. Free "
            "it with gs.release(result) instead of del result."
        )
    for failure in trace.memory_trace.failures:
        notes.append(f"gradscope internal error while tracking memory (bytes may be missing): {failure}")
    if trace.func_regions:
        notes.append(
            f"{trace.func_regions} torch.func transform calls (grad, vjp, jacrev, ...) ran inside the "
            "block; they allow no saved-tensor hooks, so gradscope stepped aside inside them: their "
            "internal graph and saved tensors are not recorded (memory still is)."
        )
    if trace.memory.dispatch_mode:
        notes.append(tracker_note(trace))
    if steps.unordered_passes:
        notes.append(
            f"memory='off': in {steps.unordered_passes} backward pass(es) the steps seen did not come in the "
            "order PyTorch's engine runs nodes on one thread (a pass on several devices' threads), so the "
            "steps of nodes that save nothing are not shown there; memory='tracker' hooks every node."
        )
    raised = sum(1 for b in trace.backwards if b.observed and b.error is not None)
    if raised and not trace.memory.measures:
        notes.append(
            f"memory='off': {raised} backward call(s) raised; their steps end at the last node seen to run "
            "(one that unpacked a saved tensor, a custom Function, a leaf): nodes that save nothing and ran "
            "after it, the one that raised among them, are not shown. memory='tracker' hooks every node."
        )
    if steps.unresolved_scopes:
        notes.append(f"{steps.unresolved_scopes} node scopes of the profiler could not be matched with a node "
                     "gradscope saw (made on another thread, or before a walk); they are not steps.")
    return notes


def tracker_note(trace: Trace) -> str:
    """Tracker honesty (see README): what any Python dispatch mode changes in PyTorch itself."""
    seen = sorted({op for e in trace.memory_trace.events for op in _MODE_SENSITIVE
                   if e.label == f"aten::{op}" or e.label.startswith(f"aten::{op}_")})
    which = f" ({', '.join(seen)} ran here)" if seen else ""
    note = (
        "memory='tracker' runs a Python dispatch mode, and under any such mode PyTorch picks other "
        "backward formulas for some ops (prod, cumprod, det, vander: gradients can differ in the last "
        "bits; ctc_loss saves two extra tensors) and sums gradients that reach one input out of place"
        f"{which}: bytes and saves of those ops can differ from a run without it."
    )
    if trace.memory_trace.zero_tangents:
        # measured: jacfwd of a 16->256->512 MLP peaks at 546,820 B unobserved, 120,832 B under the
        # mode (each Linear weight's zero tangent is cloned into a real buffer without the mode)
        note += (" Forward-mode AD ran here: under the mode PyTorch keeps the zero tangents of tensors "
                 "without a tangent (a model's weights) as empty zero tensors, while a run without it "
                 "materializes them, one weight-sized buffer per layer: the real run can peak higher.")
    if not _compat.capabilities().ignore_compile_internals:
        note += (" This torch cannot tell a dispatch mode to leave compiled code alone: torch.compile'd "
                 "functions called in the block ran eagerly (they are compiled again after it).")
    return note


# ----------------------------------------------------------------------------------- build
def build(trace: Trace, *, complete: bool = True, error: str | None = None) -> Recording:
    """Run every pass over ``trace`` and assemble the :class:`Recording` (its big tables handed
    over as columns: see NOTE [ tables are columns ] in :mod:`gradscope.recording`)."""
    trace.memory_trace.resolve()
    graph = graph_pass(trace)
    inplace_views_pass(trace, graph)
    unseen = unseen_nodes_pass(trace, graph)
    prefixes = naming_pass(trace)
    steps = steps_pass(trace, graph)
    orders = orders_pass(trace, graph, steps)
    modules = modules_pass(trace, graph, prefixes, steps, orders)
    saves = saves_pass(trace, graph, prefixes)
    g_rows = graph.rows
    node_line, save_line = _lines.lines_pass(trace, [r[N_KEY] for r in g_rows], [r[N_SEQ] for r in g_rows],
                                             saves.sid, saves.node)
    mem = memory_pass(trace, graph, prefixes, steps, orders, modules, saves, node_line)
    n = len(graph.rows)
    executed = [0] * n
    for i in steps.node:
        executed[i] += 1
    g_rows = graph.rows
    leaf_col: list[str | None] = [None] * n
    for i in graph.leaves:
        leaf_col[i] = leaf_name(g_rows[i][N_LEAF], prefixes)
    nodes: Table[Node] = Table(Node, {
        "id": range(n), "name": [r[N_NAME] for r in g_rows], "order": orders, "module": modules,
        "leaf": leaf_col, "leaf_shape": [r[N_LEAF_SHAPE] for r in g_rows], "executed": executed,
        "line": node_line,
    })
    # INPUT saves allocated inside the block are activations (made by the block, then saved)
    kinds = saves.kind
    if mem.save_alloc:
        kinds = list(kinds)
        a_t = mem.columns.t
        pos = {sid: k for k, sid in enumerate(saves.sid)}
        for sid, ai in mem.save_alloc.items():
            k = pos[sid]
            if kinds[k] is Kind.INPUT and a_t[ai] <= trace.saves[sid][S_T] + _CLOCK_SLACK_NS:
                kinds[k] = Kind.ACTIVATION
    tsaves = trace.saves
    rows_s = tsaves if len(saves.sid) == len(tsaves) else [tsaves[sid] for sid in saves.sid]
    freed_at, weak_freed = mem.freed_at, steps.freed
    if rows_s:
        _, _, _, bytes_c, shape_c, dtype_c, device_c, _, _ = zip(*rows_s, strict=True)
    else:
        bytes_c = shape_c = dtype_c = device_c = ()
    saved: Table[SavedTensor] = Table(SavedTensor, {
        "node": saves.node,
        "attribute": saves.attribute,
        "shape": list(map(tuple, shape_c)),
        "dtype": list(map(_dtype, dtype_c)),
        "device": list(map(_device, device_c)),
        "bytes": list(bytes_c),
        "storage": saves.storage,
        "kind": kinds,
        "module": [modules[i] for i in saves.node],
        "name": saves.name,
        "freed_at_step": ([freed_at.get(sid, weak_freed.get(sid)) for sid in saves.sid] if freed_at or weak_freed
                          else [None] * len(saves.sid)),
        "line": save_line,
    })
    t0 = trace.t0_ns
    m = len(steps)
    step_table: Table[Step] = Table(Step, {
        "index": range(m), "node": steps.node, "backward": steps.backward,
        "start_s": [(t - t0) / 1e9 for t in steps.t0],
        "duration_s": [max(b - a, 0) / 1e9 for a, b in zip(steps.t0, steps.t1, strict=True)],
        "live_before": steps.live_before, "live_after": steps.live_after,
        "freed_bytes": [mem.step_freed.get(k, 0) for k in range(m)],
    })
    mt = trace.memory_trace
    baseline = mt.baseline if mt.baseline is not None else _baseline(trace, saves, kinds)
    oom = None if trace.refusal is None else OomInfo(**trace.refusal.to_dict())  # NOTE [ one refusal ] in errors
    held = None
    if mt.key_kind != "none" and len(mem.allocations):
        saved_by_alloc: dict[int, int] = {}
        for k, sid in enumerate(saves.sid):
            found = mem.save_alloc.get(sid)
            if found is not None:
                saved_by_alloc.setdefault(found, k)
        held = _held.held_pass(
            nodes, step_table, mem.allocations, saved, saved_by_alloc, mt.key_kind, failed=trace.failed_oom,
            peak_position=mem.peak_position,
            n_events=mem.events_positions if mt.failed_at is None else mt.failed_at,
        )
    calls = backward_calls_pass(trace, graph, steps)
    created = max(trace.seq1 - trace.seq0, 0)
    seen_created = sum(1 for row in graph.rows if isinstance(row[N_KEY], int) and row[N_SEQ] >= trace.seq0) - unseen
    off = not trace.memory.measures
    return Recording(
        nodes=nodes,
        edges=graph.edges,
        saved=saved,
        steps=step_table,
        timeline=() if off else mem.timeline,
        peak_bytes=0 if off else mem.peak_bytes,
        baseline_bytes=baseline,
        peak=None if off else mem.peak,
        where=_where(trace, mt.device),
        complete=complete,
        error=error,
        notes=tuple(notes_pass(trace, graph, saves, steps, unseen)),
        label=trace.label,
        wall_time_s=(trace.t1_ns - trace.t0_ns) / 1e9,
        backward_passes=sum(1 for b in trace.backwards if b.observed),
        reserved_peak_bytes=mt.reserved_peak,
        device_total_bytes=mt.total,
        timeline_dropped=0 if off else mem.dropped_points,
        allocations=mem.allocations if len(mem.allocations) else (),
        allocation_key=mt.key_kind if len(mem.allocations) else "none",
        backward_calls=tuple(calls),
        held=held,
        oom=oom,
        nodes_created=created,
        nodes_created_seen=seen_created,
        lines=tuple(trace.line_table.rows) if trace.line_table is not None else (),
        extra=collectives_pass(trace) | ({"step": trace.step} if trace.step else {}) | caught_budget_pass(trace),
    )


def caught_budget_pass(trace: Trace) -> dict[str, Any]:
    """``extra["caught_budget"]``: the first allocation the budget refused when the block caught the
    error itself (``except torch.OutOfMemoryError``) and went on; the diagnosis reads it as the
    block's failure. Empty otherwise."""
    refused = trace.memory_trace.refused
    if refused is None or trace.refusal is not None:
        return {}
    return {"caught_budget": refused.to_dict()}


def collectives_pass(trace: Trace) -> dict[str, Any]:
    """``extra["collectives"]``: the communication the memory source saw (a distributed job under
    the profiler source), one row per collective, seconds from the block's start like the
    timeline (see NOTE [ collectives in a recording ] in :mod:`gradscope._memory.profiler`). Empty when
    there was none."""
    rows = trace.memory_trace.collectives
    if not rows:
        return {}
    t0 = trace.t0_ns
    return {"collectives": [{"op": op, "t_s": (a - t0) / 1e9, "duration_s": max(b - a, 0) / 1e9, "bytes": n,
                             "kind": kind} for op, a, b, n, kind in rows]}


_DEVICE: dict[Any, str] = {}


def _device(d: Any) -> str:
    s = _DEVICE.get(d)
    if s is None:
        s = _DEVICE[d] = str(d)
    return s


def _baseline(trace: Trace, saves: Saves, kinds: Sequence[Kind]) -> int:
    """What existed before the block: parameters and buffers of the modules called, and inputs
    that were saved (storages counted once)."""
    total = sum(trace.baseline_storages.values())
    inputs: dict[int, int] = {}  # storage id -> bytes (an address freed and reused names two)
    for k, sid in enumerate(saves.sid):
        if kinds[k] is Kind.INPUT and trace.saves[sid][S_SKEY] not in trace.baseline_storages:
            inputs[saves.storage[k]] = int(trace.saves[sid][S_BYTES])
    return total + sum(inputs.values())


def _where(trace: Trace, device: str) -> Where:
    return Where(device=device, memory_source=trace.memory.shown, torch_version=str(trace.torch_version), rank=trace.rank,
                 world_size=trace.world_size, hostname=socket.gethostname())
