"""The memory pass: the allocation table (each allocation's step, module, line and category), the
timeline and its peak."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gradscope._base.series import downsample
from gradscope._base.trace import (
    C_T0,
    C_T1,
    N_NAME,
    S_BYTES,
    S_PTR,
    S_SKEY,
    S_T,
    Trace,
)
from gradscope._model.recording import (
    Allocation,
    Category,
    MemoryPoint,
    Peak,
    Phase,
    Table,
)
from gradscope._passes.nodes import UNSEEN_NODE, Graph, call_path
from gradscope._passes.saved_tensors import Saves
from gradscope._passes.steps import Steps

_CLOCK_SLACK_NS = 200_000  # the profiler's clock against time.time_ns(): see saves_to_allocations
_REGION_MARGIN_NS = 20_000  # a marked region that began this long after a pack began after it


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
    :mod:`gradscope._model.table`)."""
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
    # lines come from ] in gradscope._model.lines)
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
    in gradscope._capture.record)."""
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



def _by_key(allocs: Any) -> dict[int, tuple[list[int], list[int]]]:
    """Per key, its allocations and their times, in allocation order (which is time order)."""
    a_t = allocs.t
    by_key: dict[int, tuple[list[int], list[int]]] = {}
    for i, k in enumerate(allocs.key):
        got = by_key.get(k)
        if got is None:
            got = by_key[k] = ([], [])
        got[0].append(i)
        got[1].append(a_t[i])
    return by_key

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
    a_free_t = allocs.free_t
    # an address the allocator reuses has thousands of allocations: the candidate is found by bisection
    by_key = _by_key(allocs)
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
    by_key = _by_key(allocs)
    a_free_t = allocs.free_t
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
