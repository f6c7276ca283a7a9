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
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope import _compat, _held, _names
from gradscope._trace import (
    C_ROOT,
    C_SEQ0,
    C_SEQ1,
    C_T0,
    C_T1,
    EV_FREED,
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
    S_DEVICE,
    S_DTYPE,
    S_LEAFISH,
    S_PTR,
    S_SEQ,
    S_SHAPE,
    S_SKEY,
    S_T,
    BackwardRow,
    Trace,
)
from gradscope.errors import MemoryBudgetExceeded
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
    Where,
)

__all__ = [
    "StepRow",
    "build",
    "graph_pass",
    "memory_pass",
    "modules_pass",
    "naming_pass",
    "orders_pass",
    "saves_pass",
    "steps_pass",
]

_DEEP_GRAPH = 40_000  # nodes above which freeing may crash PyTorch: see NOTE [ freeing deep graphs ]
_CLOCK_SLACK_NS = 200_000  # the profiler's clock against time.time_ns(): see saves_to_allocations
# Backward formulas PyTorch picks differently under any Python dispatch mode (see tracker_note).
_MODE_SENSITIVE = ("prod", "cumprod", "det", "vander", "ctc_loss")


# ----------------------------------------------------------------------------------- graph
@dataclass
class Graph:
    """The node table in discovery order (ids 0..n-1) and edges between ids."""

    rows: list[tuple[Any, ...]]
    edges: tuple[Edge, ...]
    by_seq: dict[int, int]  # sequence number -> node id (AccumulateGrad nodes excluded)


def graph_pass(trace: Trace) -> Graph:
    """Node ids are discovery order; edges are resolved from node keys (unknown keys dropped)."""
    index: dict[Hashable, int] = {row[N_KEY]: i for i, row in enumerate(trace.nodes)}
    edges = []
    for a, b in trace.edges:
        ia, ib = index.get(a), index.get(b)
        if ia is not None and ib is not None:
            edges.append(Edge(ia, ib))
    by_seq = {row[N_SEQ]: i for i, row in enumerate(trace.nodes) if isinstance(row[N_KEY], int)}
    return Graph(list(trace.nodes), tuple(edges), by_seq)


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
class StepRow:
    """One backward step before it becomes a :class:`Step`."""

    node: int
    backward: int
    t0_ns: int
    t1_ns: int
    start_pos: int  # position in trace.events where it began (-1: from a profiler scope)
    scope: int | None = None
    live_before: int | None = None
    live_after: int | None = None
    closed: bool = False


@dataclass
class Steps:
    rows: list[StepRow] = field(default_factory=list)
    # created node id -> id of the node that was running when it was made (see NOTE [ orders ])
    creators: dict[int, int | None] = field(default_factory=dict)
    freed: dict[int, int] = field(default_factory=dict)  # save index -> step (weak-ref checks)
    scope_step: dict[int, int] = field(default_factory=dict)  # profiler scope -> step
    starts: list[int] = field(default_factory=list)  # start_pos of event-made steps, ascending
    start_steps: list[int] = field(default_factory=list)  # the step of each entry in starts
    unresolved_scopes: int = 0


def steps_pass(trace: Trace, graph: Graph) -> Steps:
    """Backward steps in engine order, from the trace's step events or, with the profiler as
    memory source, from its node scopes (see NOTE [ how steps are seen ] in
    :mod:`gradscope.record`)."""
    out = Steps()
    mt = trace.memory_trace
    from_scopes = mt.source == "cpu" and bool(mt.scopes)
    for b_index, b in enumerate(trace.backwards):
        if not b.observed:
            continue
        if from_scopes:
            _steps_from_scopes(trace, graph, b_index, b, out)
        else:
            _steps_from_events(trace, graph, b_index, b, out)
        _creators(trace, graph, b, out)
    order = sorted(range(len(out.starts)), key=lambda k: out.starts[k])
    out.starts = [out.starts[k] for k in order]
    out.start_steps = [out.start_steps[k] for k in order]
    return out


def _steps_from_events(trace: Trace, graph: Graph, b_index: int, b: BackwardRow, out: Steps) -> None:
    events, saves, by_seq = trace.events, trace.saves, graph.by_seq
    cur: StepRow | None = None
    first = len(out.rows)
    live: int | None = None
    for pos in range(b.ev0, b.ev1):
        kind, ident, t, value = events[pos]
        if kind == EV_UNPACK:
            node = by_seq.get(saves[ident][S_SEQ])
            if node is None:
                continue  # a node this pass did not run through us (reentrant, unknown)
            if cur is None or cur.node != node or cur.closed:
                cur = _new_step(out, node, b_index, t, pos, live)
        elif kind == EV_PRE:
            cur = _new_step(out, ident, b_index, t, pos, live)
        elif kind == EV_POST:
            if cur is not None and cur.node == ident:
                cur.t1_ns = t
                cur.closed = True
        elif kind == EV_LIVE:
            live = value
            if cur is not None and cur.live_after is None:
                cur.live_after = value
        elif kind == EV_FREED and cur is not None:
            out.freed[ident] = len(out.rows) - 1
    rows = out.rows
    for k in range(first, len(rows)):  # a step without a post hook ends where the next begins
        if not rows[k].closed:
            rows[k].t1_ns = rows[k + 1].t0_ns if k + 1 < len(rows) else max(b.t1_ns, rows[k].t0_ns)


def _new_step(out: Steps, node: int, b_index: int, t: int, pos: int, live: int | None) -> StepRow:
    row = StepRow(node=node, backward=b_index, t0_ns=t, t1_ns=t, start_pos=pos, live_before=live)
    out.starts.append(pos)
    out.start_steps.append(len(out.rows))
    out.rows.append(row)
    return row


def _steps_from_scopes(trace: Trace, graph: Graph, b_index: int, b: BackwardRow, out: Steps) -> None:
    """The profiler's ``evaluate_function`` scopes of this pass (nested ones belong to a
    reentrant backward inside a node), matched with nodes by sequence number; all
    ``AccumulateGrad`` nodes share one number, so those are taken in order from their pre hooks."""
    accs = [ident for kind, ident, _, _ in trace.events[b.ev0:b.ev1]
            if kind == EV_PRE and graph.rows[ident][N_NAME] == "AccumulateGrad"]
    acc_i = 0
    for k, sc in enumerate(trace.memory_trace.scopes):
        if sc.backward != b_index or sc.nested:
            continue
        if sc.name == "AccumulateGrad":
            node = accs[acc_i] if acc_i < len(accs) else None
            acc_i += 1
        else:
            node = graph.by_seq.get(sc.seq)
            if node is not None and graph.rows[node][N_NAME] != sc.name:
                node = None
        if node is None:
            out.unresolved_scopes += 1
            continue
        out.scope_step[k] = len(out.rows)
        out.rows.append(StepRow(node=node, backward=b_index, t0_ns=sc.start_ns, t1_ns=sc.end_ns,
                                start_pos=-1, scope=k, closed=True))


def _creators(trace: Trace, graph: Graph, b: BackwardRow, out: Steps) -> None:
    """NOTE [ orders ]: a node made during a ``create_graph=True`` pass was made by the node the
    engine was running: the one whose pre hook read the largest sequence counter not above the
    new node's number. That includes the ``AddBackward0`` the engine makes after a node's post
    hook to sum two gradients reaching one input: it belongs to the node that produced them (its
    order is that node's plus one), never to the forward (order 0)."""
    if not b.create_graph:
        return
    marks = sorted((value, ident) for kind, ident, _, value in trace.events[b.ev0:b.ev1]
                   if kind == EV_PRE and value is not None)
    seqs = [m[0] for m in marks]
    for seq, i in graph.by_seq.items():
        if b.seq0 <= seq < b.seq1 and i not in out.creators:
            k = bisect.bisect_right(seqs, seq) - 1
            out.creators[i] = marks[k][1] if k >= 0 else None


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
    for i, row in enumerate(graph.rows):
        name = leaf_name(row[N_LEAF], prefixes)
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
    rows: list[tuple[int, int]]  # (save index, node id) for each save attached to a node
    dropped: int
    attributes: dict[int, str]
    kinds: dict[int, Kind]
    names: dict[int, str | None]
    storage_ids: dict[int, int]  # storage key -> recording-local storage id


_DTYPE: dict[Any, str] = {}


def _dtype(d: Any) -> str:
    s = _DTYPE.get(d)
    if s is None:
        s = _DTYPE[d] = str(d).replace("torch.", "")
    return s


def saves_pass(trace: Trace, graph: Graph, prefixes: Sequence[str]) -> Saves:
    """Each save attached to the node that saved it (see NOTE [ which node saved a tensor ] in
    :mod:`gradscope.record`), with its attribute, its kind and its parameter name."""
    rows: list[tuple[int, int]] = []
    dropped = 0
    attributes: dict[int, str] = {}
    kinds: dict[int, Kind] = {}
    names: dict[int, str | None] = {}
    storage_ids: dict[int, int] = {}
    by_seq = graph.by_seq
    kind_of = {"parameter": Kind.PARAMETER, "buffer": Kind.BUFFER}
    for sid, s in enumerate(trace.saves):
        node = by_seq.get(s[S_SEQ])
        if node is None:
            dropped += 1
            continue
        rows.append((sid, node))
        attributes[sid] = trace.save_attr.get(sid) or trace.seq_attr.get(s[S_SEQ]) or f"saved[{len(rows) - 1}]"
        named = trace.param_keys.get(s[S_SKEY])
        if named is not None:
            root, rel, kind = named
            kinds[sid] = kind_of[kind]
            names[sid] = _names.full_name(prefixes[root], rel)
        else:
            kinds[sid] = Kind.INPUT if s[S_LEAFISH] else Kind.ACTIVATION
            names[sid] = None
        storage_ids.setdefault(s[S_SKEY], len(storage_ids))
    return Saves(rows, dropped, attributes, kinds, names, storage_ids)


# ----------------------------------------------------------------------------------- memory
@dataclass
class Memory:
    allocations: list[Allocation]
    timeline: list[MemoryPoint]
    peak_bytes: int
    peak: Peak | None
    dropped_points: int
    save_alloc: dict[int, int]  # save index -> allocation index
    freed_at: dict[int, int]  # save index -> step that freed its storage
    step_freed: dict[int, int]  # step -> bytes of saved storages it freed
    peak_position: int | None
    events_positions: int


def memory_pass(trace: Trace, graph: Graph, prefixes: Sequence[str], steps: Steps, orders: Sequence[int],
                modules: Sequence[str | None], saves: Saves) -> Memory:
    """The allocation table, each allocation's category and phase, the timeline and the peak."""
    mt = trace.memory_trace
    events = mt.events
    rows = steps.rows
    t0 = trace.t0_ns
    calls = trace.calls
    call_paths: dict[int, str] = {}

    def path_of_call(c: int) -> str | None:
        p = call_paths.get(c)
        if p is None and 0 <= c < len(calls):
            p = call_paths[c] = call_path(trace, prefixes, calls[c])
        return p

    windows = sorted((o[1], o[2] or trace.t1_ns) for o in trace.optimizer_steps)
    win_starts = [w[0] for w in windows]
    bw_windows = [(b.ev0, b.ev1) for b in trace.backwards if b.observed]
    fwd_modules = _modules_at(trace, prefixes, [e.t_ns for e in events]) if events else []

    def step_of(e: Any) -> int | None:
        if e.scope is not None:
            return steps.scope_step.get(e.scope)
        if e.step is not None and steps.starts:
            k = bisect.bisect_right(steps.starts, e.step) - 1
            if k >= 0:
                row = rows[steps.start_steps[k]]
                b = trace.backwards[row.backward]
                if b.ev0 <= e.step <= b.ev1:
                    return steps.start_steps[k]
        return None

    def in_optimizer(t: int) -> bool:
        k = bisect.bisect_right(win_starts, t) - 1
        return k >= 0 and windows[k][0] <= t <= windows[k][1]

    def in_backward(pos: int | None) -> bool:
        return pos is not None and any(a <= pos <= b for a, b in bw_windows)

    points: list[MemoryPoint] = []
    live = 0
    peak_i = -1
    peak_v = 0
    cum_t: list[int] = []
    cum_live: list[int] = []
    pairable = mt.key_kind != "none"
    allocs: list[dict[str, Any]] = []
    open_: dict[int, int] = {}
    point_alloc: list[int | None] = []
    for k, e in enumerate(events):
        live += e.size
        step = step_of(e)
        if e.hint == "optimizer" or (e.hint is None and step is None and in_optimizer(e.t_ns)):
            phase = Phase.OPTIMIZER
        elif step is not None or e.scope is not None or in_backward(e.step):
            phase = Phase.BACKWARD
        elif e.hint == "other":
            phase = Phase.OTHER
        else:
            phase = Phase.FORWARD
        if step is not None and step < len(rows):
            module = modules[rows[step].node]
        elif e.call is not None:
            module = path_of_call(e.call)
        elif phase is Phase.FORWARD and fwd_modules:
            module = fwd_modules[k]
        else:
            module = None
        a_index: int | None = None
        if pairable:
            if e.size > 0:
                a_index = len(allocs)
                open_[e.key] = a_index
                allocs.append({"bytes": e.size, "at": k, "free": None, "t": e.t_ns, "phase": phase,
                               "module": module, "step": step, "label": e.label, "key": e.key, "free_t": None})
            else:
                a_index = open_.pop(e.key, None)
                if a_index is not None:
                    allocs[a_index]["free"] = k
                    allocs[a_index]["free_t"] = e.t_ns
                    allocs[a_index]["free_step"] = step
        point_alloc.append(a_index)
        points.append(MemoryPoint(t_s=(e.t_ns - t0) / 1e9, live=live, phase=phase, label=e.label, step=step,
                                  module=module, reserved=e.reserved))
        cum_t.append(e.t_ns)
        cum_live.append(live)
        if live > peak_v:
            peak_v, peak_i = live, len(points) - 1
    # bytes around each step, for sources that are not online: the events at its boundaries
    if not mt.online:
        for row in rows:
            if row.scope is None:
                continue
            a = bisect.bisect_left(cum_t, row.t0_ns)
            b = bisect.bisect_right(cum_t, row.t1_ns)
            row.live_before = cum_live[a - 1] if a > 0 else 0
            row.live_after = cum_live[b - 1] if b > 0 else 0
    save_alloc, saver = _saves_to_allocations(trace, saves, allocs, mt.key_kind) if pairable else ({}, {})
    categories = _categories(trace, graph, orders, saves, allocs, save_alloc, mt.key_kind)
    # frees of saved storages: which step freed each (allocation table), or the weak-ref checks
    freed_at: dict[int, int] = {}
    step_freed: dict[int, int] = {}
    if pairable:
        saved_allocs: dict[int, list[int]] = {}
        for sid, a in save_alloc.items():
            saved_allocs.setdefault(a, []).append(sid)
        for a, sids in saved_allocs.items():
            st = allocs[a].get("free_step")
            if allocs[a]["free"] is not None and st is not None:
                for sid in sids:
                    freed_at[sid] = st
                step_freed[st] = step_freed.get(st, 0) + allocs[a]["bytes"]
    else:
        by_key: dict[int, list[int]] = {}
        for sid, _node in saves.rows:
            by_key.setdefault(trace.saves[sid][S_SKEY], []).append(sid)
        done: set[int] = set()
        for sid, st in sorted(steps.freed.items(), key=lambda kv: kv[1]):
            key = trace.saves[sid][S_SKEY]
            if key in done:
                continue
            done.add(key)
            step_freed[st] = step_freed.get(st, 0) + trace.saves[sid][S_BYTES]
            for other in by_key.get(key, ()):
                if other not in freed_at and trace.saves[other][S_T] <= trace.saves[sid][S_T] + 1:
                    freed_at[other] = st
    allocations = [
        Allocation(index=i, bytes=a["bytes"], alloc_at=a["at"], free_at=a["free"], t_s=(a["t"] - t0) / 1e9,
                   category=categories[i], phase=a["phase"], module=a["module"],
                   node=saver.get(i), step=a["step"], label=a["label"], key=a["key"])
        for i, a in enumerate(allocs)
    ]
    if allocs:
        points = [p if (ai := point_alloc[k]) is None else _with_category(p, categories[ai])
                  for k, p in enumerate(points)]
    peak_bytes = peak_v
    if mt.peak is not None:
        peak_bytes = max(peak_bytes, mt.peak)
    peak = None
    if peak_i >= 0:
        p = points[peak_i]
        node = rows[p.step].node if p.step is not None and p.step < len(rows) else None
        peak = Peak(bytes=peak_bytes, phase=p.phase, t_s=p.t_s, label=p.label, node=node, module=p.module,
                    step=p.step)
    elif mt.peak:
        peak = Peak(bytes=peak_bytes, phase=Phase.FORWARD, label="(allocator statistics)")
    dropped = 0
    if trace.max_events is not None and len(points) > trace.max_events:
        points, dropped = _downsample(points, peak_i, trace.max_events)
    return Memory(allocations, points, peak_bytes, peak, dropped, save_alloc, freed_at, step_freed,
                  peak_i if peak_i >= 0 else None, len(events))


def _with_category(p: MemoryPoint, c: Category) -> MemoryPoint:
    if c is Category.OTHER:
        return p
    return MemoryPoint(p.t_s, p.live, p.phase, p.label, p.step, p.module, p.reserved, c)


def _saves_to_allocations(trace: Trace, saves: Saves, allocs: list[dict[str, Any]],
                          key_kind: str) -> tuple[dict[int, int], dict[int, int]]:
    """Each save's allocation: the one that held the save's key (storage key for the tracker,
    address for the allocators) when it was packed. Keys are reused once freed, so the candidate
    is the latest allocation of that key made no later than the pack, still alive then. The
    profiler's clock and ``time.time_ns()`` differ by microseconds: times are compared with
    :data:`_CLOCK_SLACK_NS` of slack (an output is packed microseconds after it is allocated).
    Returns (save index -> allocation, allocation -> the first node that saved it)."""
    by_key: dict[int, list[int]] = {}
    for i, a in enumerate(allocs):
        by_key.setdefault(a["key"], []).append(i)
    key_field = S_SKEY if key_kind == "storage" else S_PTR
    slack = 0 if key_kind == "storage" else _CLOCK_SLACK_NS
    out: dict[int, int] = {}
    saver: dict[int, int] = {}
    for sid, node in saves.rows:
        s = trace.saves[sid]
        cands = by_key.get(s[key_field])
        if not cands:
            continue
        t = s[S_T]
        best = None
        for i in cands:
            if allocs[i]["t"] <= t + slack:
                best = i
            else:
                break
        if best is None:
            continue
        ft = allocs[best]["free_t"]
        if ft is not None and ft < t - slack:
            continue
        out[sid] = best
        saver.setdefault(best, node)
    return out, saver


def _categories(trace: Trace, graph: Graph, orders: Sequence[int], saves: Saves, allocs: list[dict[str, Any]],
                save_alloc: dict[int, int], key_kind: str) -> list[Category]:
    """Each allocation's :class:`Category`: saved by a forward node (ACTIVATION) or by a node a
    create_graph pass made (CREATE_GRAPH); a gradient (the ``.grad`` a pass accumulated into, or
    a result of ``autograd.grad``); made by an optimizer step; made during backward otherwise
    (BACKWARD_TEMP); anything else (OTHER)."""
    cats = [Category.OTHER] * len(allocs)
    by_key: dict[int, list[int]] = {}
    for i, a in enumerate(allocs):
        by_key.setdefault(a["key"], []).append(i)
    gradient: set[int] = set()
    for _b, skey, ptr, t in trace.gradient_keys:
        key = skey if key_kind == "storage" else ptr
        for i in by_key.get(key, ()):
            a = allocs[i]
            if a["t"] <= t and (a["free_t"] is None or a["free_t"] >= t):
                gradient.add(i)
    saved_order: dict[int, int] = {}
    node_of = dict(saves.rows)
    for sid, ai in save_alloc.items():
        o = orders[node_of[sid]]
        saved_order[ai] = min(saved_order.get(ai, o), o)
    for i, row in enumerate(allocs):
        if i in saved_order:
            cats[i] = Category.ACTIVATION if saved_order[i] == 0 else Category.CREATE_GRAPH
        elif i in gradient:
            cats[i] = Category.GRADIENT
        elif row["phase"] is Phase.OPTIMIZER:
            cats[i] = Category.OPTIMIZER
        elif row["phase"] is Phase.BACKWARD:
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


def _downsample(points: list[MemoryPoint], peak_i: int, limit: int) -> tuple[list[MemoryPoint], int]:
    stride = -(-len(points) // (limit - 1))
    keep = set(range(0, len(points), stride))
    keep.add(peak_i)
    keep.add(len(points) - 1)
    kept = [points[i] for i in sorted(keep)]
    return kept, len(points) - len(kept)


# ----------------------------------------------------------------------------------- calls, notes
def backward_calls_pass(trace: Trace, graph: Graph, steps: Steps) -> list[BackwardCall]:
    out = []
    by_b: dict[int, list[int]] = {}
    for k, row in enumerate(steps.rows):
        by_b.setdefault(row.backward, []).append(k)
    for i, b in enumerate(trace.backwards):
        ks = by_b.get(i, [])
        accumulated = tuple(dict.fromkeys(steps.rows[k].node for k in ks
                                          if graph.rows[steps.rows[k].node][N_NAME] == "AccumulateGrad"))
        out.append(BackwardCall(index=i, api=b.api, create_graph=b.create_graph, retain_graph=b.retain_graph,
                                roots=tuple(b.roots), inputs=tuple(b.inputs), accumulated=accumulated,
                                first_step=ks[0] if ks else None, last_step=ks[-1] if ks else None,
                                observed=b.observed))
    return out


def notes_pass(trace: Trace, graph: Graph, saves: Saves, steps: Steps) -> list[str]:
    notes = list(trace.notes)
    if saves.dropped:
        notes.append(f"{saves.dropped} saved tensors belonged to nodes that were freed before gradscope saw "
                     "them; they are not listed.")
    if trace.foreign_saves:
        notes.append(
            f"{trace.foreign_saves} saved tensors were packed by other saved_tensors_hooks (a user's own "
            "pair, save_on_cpu or non-reentrant checkpoint inside the block; only the innermost pair "
            "applies): gradscope cannot see or size them, so saved bytes are undercounted."
        )
    names = [row[N_NAME] for row in graph.rows]
    if any(row[N_CUSTOM] for row in graph.rows):
        notes.append(
            "custom autograd.Function nodes are present: tensors they keep as ctx attributes "
            "(ctx.x = t) bypass saved-tensor hooks and are not counted; save_for_backward is counted."
        )
    compiled = names.count("CompiledFunctionBackward")
    if compiled:
        tracker = trace.memory == "tracker"
        notes.append(
            f"{compiled} torch.compile'd regions ran as single CompiledFunctionBackward nodes: the "
            "operations inside them are not shown; the tensors they save for backward are counted"
            + ("; allocations made inside compiled code are not seen by memory='tracker' (use "
               "memory='cpu')." if tracker else ".")
        )
        if tracker and not _compat.capabilities().ignore_compile_internals:
            notes.append("this torch cannot tell a dispatch mode to leave compiled code alone: compiled "
                         "functions called under memory='tracker' ran eagerly, and keep running eagerly.")
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
    if trace.memory == "tracker":
        notes.append(tracker_note(trace))
    if steps.unresolved_scopes:
        notes.append(f"{steps.unresolved_scopes} node scopes of the profiler could not be matched with a node "
                     "gradscope saw (made on another thread, or before a walk); they are not steps.")
    return notes


def tracker_note(trace: Trace) -> str:
    """Tracker honesty (see README): what any Python dispatch mode changes in PyTorch itself."""
    seen = sorted({op for e in trace.memory_trace.events for op in _MODE_SENSITIVE
                   if e.label == f"aten::{op}" or e.label.startswith(f"aten::{op}_")})
    which = f" ({', '.join(seen)} ran here)" if seen else ""
    return (
        "memory='tracker' runs a Python dispatch mode, and under any such mode PyTorch picks other "
        "backward formulas for some ops (prod, cumprod, det, vander: gradients can differ in the last "
        "bits; ctc_loss saves two extra tensors) and sums gradients that reach one input out of place"
        f"{which}: bytes and saves of those ops can differ from a run without it."
    )


# ----------------------------------------------------------------------------------- build
def build(trace: Trace, *, complete: bool = True, error: str | None = None) -> Recording:
    """Run every pass over ``trace`` and assemble the :class:`Recording`."""
    graph = graph_pass(trace)
    prefixes = naming_pass(trace)
    steps = steps_pass(trace, graph)
    orders = orders_pass(trace, graph, steps)
    modules = modules_pass(trace, graph, prefixes, steps, orders)
    saves = saves_pass(trace, graph, prefixes)
    mem = memory_pass(trace, graph, prefixes, steps, orders, modules, saves)
    executed = [0] * len(graph.rows)
    for row in steps.rows:
        executed[row.node] += 1
    nodes = tuple(
        Node(id=i, name=row[N_NAME], order=orders[i], module=modules[i], leaf=leaf_name(row[N_LEAF], prefixes),
             leaf_shape=row[N_LEAF_SHAPE], executed=executed[i])
        for i, row in enumerate(graph.rows)
    )
    # INPUT saves allocated inside the block are activations (made by the block, then saved)
    kinds = dict(saves.kinds)
    for sid, a in mem.save_alloc.items():
        if kinds.get(sid) is Kind.INPUT and mem.allocations[a].t_s * 1e9 + trace.t0_ns <= trace.saves[sid][S_T] + _CLOCK_SLACK_NS:
            kinds[sid] = Kind.ACTIVATION
    saved = tuple(
        SavedTensor(node=node, attribute=saves.attributes[sid], shape=tuple(s[S_SHAPE]), dtype=_dtype(s[S_DTYPE]),
                    device=str(s[S_DEVICE]), bytes=int(s[S_BYTES]), storage=saves.storage_ids[s[S_SKEY]],
                    kind=kinds[sid], module=modules[node], name=saves.names[sid],
                    freed_at_step=mem.freed_at.get(sid, steps.freed.get(sid)))
        for sid, node in saves.rows
        for s in (trace.saves[sid],)
    )
    step_objs = tuple(
        Step(index=k, node=row.node, backward=row.backward, start_s=(row.t0_ns - trace.t0_ns) / 1e9,
             duration_s=max(row.t1_ns - row.t0_ns, 0) / 1e9, live_before=row.live_before,
             live_after=row.live_after, freed_bytes=mem.step_freed.get(k, 0))
        for k, row in enumerate(steps.rows)
    )
    mt = trace.memory_trace
    baseline = mt.baseline if mt.baseline is not None else _baseline(trace, saves, kinds)
    failure = trace.failure
    oom = None
    if isinstance(failure, MemoryBudgetExceeded):
        oom = OomInfo(requested=int(failure.requested), live=int(failure.live), budget=int(failure.budget),
                      where=str(failure.where))
    held = None
    if mt.key_kind != "none" and mem.allocations:
        saved_by_alloc: dict[int, SavedTensor] = {}
        for k, (sid, _node) in enumerate(saves.rows):
            found = mem.save_alloc.get(sid)
            if found is not None:
                saved_by_alloc.setdefault(found, saved[k])
        held = _held.held_pass(
            nodes, step_objs, mem.allocations, saved_by_alloc, mt.key_kind, failed=trace.failed_oom,
            peak_position=mem.peak_position, n_events=mem.events_positions,
        )
    calls = backward_calls_pass(trace, graph, steps)
    created = max(trace.seq1 - trace.seq0, 0)
    seen_created = sum(1 for row in graph.rows if isinstance(row[N_KEY], int) and row[N_SEQ] >= trace.seq0)
    return Recording(
        nodes=nodes,
        edges=graph.edges,
        saved=saved,
        steps=step_objs,
        timeline=tuple(mem.timeline) if trace.memory != "off" else (),
        peak_bytes=mem.peak_bytes if trace.memory != "off" else 0,
        baseline_bytes=baseline,
        peak=mem.peak if trace.memory != "off" else None,
        where=_where(trace, mt.device),
        complete=complete,
        error=error,
        notes=tuple(notes_pass(trace, graph, saves, steps)),
        label=trace.label,
        wall_time_s=(trace.t1_ns - trace.t0_ns) / 1e9,
        backward_passes=sum(1 for b in trace.backwards if b.observed),
        reserved_peak_bytes=mt.reserved_peak,
        device_total_bytes=mt.total,
        timeline_dropped=mem.dropped_points if trace.memory != "off" else 0,
        allocations=tuple(mem.allocations),
        allocation_key=mt.key_kind if mem.allocations else "none",
        backward_calls=tuple(calls),
        held=held,
        oom=oom,
        nodes_created=created,
        nodes_created_seen=seen_created,
    )


def _baseline(trace: Trace, saves: Saves, kinds: dict[int, Kind]) -> int:
    """What existed before the block: parameters and buffers of the modules called, and inputs
    that were saved (storages counted once)."""
    storages = dict(trace.baseline_storages)
    for sid, _node in saves.rows:
        if kinds[sid] is Kind.INPUT:
            s = trace.saves[sid]
            storages[s[S_SKEY]] = int(s[S_BYTES])
    return sum(storages.values())


def _where(trace: Trace, device: str) -> Where:
    source = {"cpu": "cpu-allocator (profiler events)", "tracker": "storage tracker",
              "cuda": "cuda caching allocator", "off": "off"}.get(trace.memory, trace.memory)
    return Where(device=device, memory_source=source, torch_version=trace.torch_version, rank=trace.rank,
                 world_size=trace.world_size, hostname=socket.gethostname())
