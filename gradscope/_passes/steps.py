"""The backward steps' passes: which node ran when and in which call into the engine, seen from
events, from the profiler's scopes or from the engine's own order (NOTE [ steps nobody saw ]), and
each node's order (NOTE [ orders ])."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gradscope._base import compat as _compat
from gradscope._base.trace import (
    EV_LIVE,
    EV_POST,
    EV_PRE,
    EV_UNPACK,
    N_NAME,
    N_SEQ,
    S_SEQ,
    BackwardRow,
    Trace,
)
from gradscope._passes.nodes import Graph


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
    :mod:`gradscope._capture.record`).

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
    seen ] in :mod:`gradscope._capture.record`). Its step is given back from the engine's own rule: the
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
