"""Named, pure passes that turn a :class:`~gradscope._base.trace.Trace` into a :class:`Recording`.

Each pass reads the trace (and what earlier passes returned) and returns plain values; none of
them touches torch, a hook or a live object, so each can be run on a trace written by hand (see
``tests/test_passes.py``). :func:`build` is the list of passes, in order, and the recording
they make; each pass lives in the module of what it makes:

- :mod:`gradscope._passes.nodes`: ``graph`` (node table, edges), ``inplace_views``,
  ``unseen_nodes``, ``naming`` (root names);
- :mod:`gradscope._passes.steps`: ``steps`` (backward steps, who made the nodes a create_graph
  pass created), ``orders``;
- :mod:`gradscope._passes.module_paths`: ``modules``;
- :mod:`gradscope._passes.saved_tensors`: ``saves``;
- :mod:`gradscope._model.lines`: ``lines`` (each node's and save's user line);
- :mod:`gradscope._passes.allocations`: ``memory`` (allocation table, categories, timeline, peak);
- :mod:`gradscope._passes.tables`: the node, saved-tensor and step tables, the baseline, ``held``
  (what was alive at the peak or the failure, by :mod:`gradscope._model.held_at_peak`);
- :mod:`gradscope._passes.notes`: ``backward_calls``, ``notes``, ``collectives``,
  ``caught_budget``.
"""

from __future__ import annotations

from gradscope._base.trace import N_KEY, N_SEQ, Trace
from gradscope._model import lines as _lines
from gradscope._model.recording import Recording
from gradscope._passes.allocations import Memory, memory_pass
from gradscope._passes.module_paths import leaf_name, modules_pass
from gradscope._passes.nodes import (
    UNSEEN_NODE,
    Graph,
    call_path,
    graph_pass,
    inplace_views_pass,
    naming_pass,
    unseen_nodes_pass,
)
from gradscope._passes.notes import (
    backward_calls_pass,
    caught_budget_pass,
    collectives_pass,
    notes_pass,
    tracker_note,
)
from gradscope._passes.saved_tensors import Saves, saves_pass
from gradscope._passes.steps import Steps, engine_order, orders_pass, steps_pass
from gradscope._passes.tables import (
    _where,
    baseline_pass,
    created_pass,
    held_pass,
    node_table,
    oom_pass,
    save_kinds_pass,
    saved_table,
    step_table,
)

__all__ = [
    "UNSEEN_NODE",
    "Graph",
    "Memory",
    "Saves",
    "Steps",
    "backward_calls_pass",
    "build",
    "call_path",
    "caught_budget_pass",
    "collectives_pass",
    "engine_order",
    "graph_pass",
    "inplace_views_pass",
    "leaf_name",
    "memory_pass",
    "modules_pass",
    "naming_pass",
    "notes_pass",
    "orders_pass",
    "saves_pass",
    "steps_pass",
    "tracker_note",
    "unseen_nodes_pass",
]


def build(trace: Trace, *, complete: bool = True, error: str | None = None) -> Recording:
    """Run every pass over ``trace``, in order, and assemble the :class:`Recording` (its big tables
    handed over as columns: see NOTE [ tables are columns ] in :mod:`gradscope._model.table`)."""
    mt = trace.memory_trace
    mt.resolve()
    graph = graph_pass(trace)
    inplace_views_pass(trace, graph)
    unseen = unseen_nodes_pass(trace, graph)
    prefixes = naming_pass(trace)
    steps = steps_pass(trace, graph)
    orders = orders_pass(trace, graph, steps)
    modules = modules_pass(trace, graph, prefixes, steps, orders)
    saves = saves_pass(trace, graph, prefixes)
    node_line, save_line = _lines.lines_pass(trace, [r[N_KEY] for r in graph.rows], [r[N_SEQ] for r in graph.rows],
                                             saves.sid, saves.node)
    mem = memory_pass(trace, graph, prefixes, steps, orders, modules, saves, node_line)
    nodes = node_table(graph, prefixes, steps, orders, modules, node_line)
    kinds = save_kinds_pass(trace, saves, mem)
    saved = saved_table(trace, saves, kinds, modules, steps, mem, save_line)
    step_rows = step_table(trace, steps, mem)
    baseline = baseline_pass(trace, saves, kinds)
    oom = oom_pass(trace)
    held = held_pass(trace, nodes, step_rows, saved, saves, mem)
    calls = backward_calls_pass(trace, graph, steps)
    created, seen_created = created_pass(trace, graph, unseen)
    off = not trace.memory.measures
    return Recording(
        nodes=nodes,
        edges=graph.edges,
        saved=saved,
        steps=step_rows,
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
