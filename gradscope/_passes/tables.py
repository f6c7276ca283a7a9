"""The tables the passes' results become (nodes, saved tensors, steps), the baseline, what was held
at the peak or the failure, and where the block ran."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from gradscope._base.trace import (
    N_KEY,
    N_LEAF,
    N_LEAF_SHAPE,
    N_NAME,
    N_SEQ,
    S_BYTES,
    S_SKEY,
    S_T,
    Trace,
)
from gradscope._model import held_at_peak as _held
from gradscope._model.recording import (
    HeldMemory,
    Kind,
    Node,
    OomInfo,
    SavedTensor,
    Step,
    Table,
    Where,
)
from gradscope._passes.allocations import _CLOCK_SLACK_NS, Memory
from gradscope._passes.module_paths import leaf_name
from gradscope._passes.nodes import Graph
from gradscope._passes.saved_tensors import Saves, _dtype
from gradscope._passes.steps import Steps

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


def node_table(graph: Graph, prefixes: Sequence[str], steps: Steps, orders: Sequence[int],
               modules: Sequence[str | None], node_line: Sequence[int | None]) -> Table[Node]:
    """The node table: each node's name, order, module, leaf, how often it ran and its line."""
    n = len(graph.rows)
    executed = [0] * n
    for i in steps.node:
        executed[i] += 1
    g_rows = graph.rows
    leaf_col: list[str | None] = [None] * n
    for i in graph.leaves:
        leaf_col[i] = leaf_name(g_rows[i][N_LEAF], prefixes)
    return Table(Node, {
        "id": range(n), "name": [r[N_NAME] for r in g_rows], "order": orders, "module": modules,
        "leaf": leaf_col, "leaf_shape": [r[N_LEAF_SHAPE] for r in g_rows], "executed": executed,
        "line": node_line,
    })


def save_kinds_pass(trace: Trace, saves: Saves, mem: Memory) -> Sequence[Kind]:
    """Each save's kind, where an INPUT save allocated inside the block is an activation (made by
    the block, then saved)."""
    kinds = saves.kind
    if mem.save_alloc:
        kinds = list(kinds)
        a_t = mem.columns.t
        pos = {sid: k for k, sid in enumerate(saves.sid)}
        for sid, ai in mem.save_alloc.items():
            k = pos[sid]
            if kinds[k] is Kind.INPUT and a_t[ai] <= trace.saves[sid][S_T] + _CLOCK_SLACK_NS:
                kinds[k] = Kind.ACTIVATION
    return kinds


def saved_table(trace: Trace, saves: Saves, kinds: Sequence[Kind], modules: Sequence[str | None], steps: Steps,
                mem: Memory, save_line: Sequence[int | None]) -> Table[SavedTensor]:
    """The saved-tensor table: each save's node, attribute, shape, dtype, device, bytes, storage,
    kind, module, name, the step that freed it and its line."""
    tsaves = trace.saves
    rows_s = tsaves if len(saves.sid) == len(tsaves) else [tsaves[sid] for sid in saves.sid]
    freed_at, weak_freed = mem.freed_at, steps.freed
    if rows_s:
        _, _, _, bytes_c, shape_c, dtype_c, device_c, _, _ = zip(*rows_s, strict=True)
    else:
        bytes_c = shape_c = dtype_c = device_c = ()
    return Table(SavedTensor, {
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


def step_table(trace: Trace, steps: Steps, mem: Memory) -> Table[Step]:
    """The step table: each backward step's node, call, start, duration, memory and what it freed."""
    t0 = trace.t0_ns
    m = len(steps)
    return Table(Step, {
        "index": range(m), "node": steps.node, "backward": steps.backward,
        "start_s": [(t - t0) / 1e9 for t in steps.t0],
        "duration_s": [max(b - a, 0) / 1e9 for a, b in zip(steps.t0, steps.t1, strict=True)],
        "live_before": steps.live_before, "live_after": steps.live_after,
        "freed_bytes": [mem.step_freed.get(k, 0) for k in range(m)],
    })


def baseline_pass(trace: Trace, saves: Saves, kinds: Sequence[Kind]) -> int:
    """What existed before the block: the memory source's own figure, else :func:`_baseline`."""
    mt = trace.memory_trace
    return mt.baseline if mt.baseline is not None else _baseline(trace, saves, kinds)


def oom_pass(trace: Trace) -> OomInfo | None:
    """The allocation the budget refused, when the block ended with it."""
    return None if trace.refusal is None else OomInfo(**trace.refusal.to_dict())  # NOTE [ one refusal ] in errors


def held_pass(trace: Trace, nodes: Table[Node], step_rows: Table[Step], saved: Table[SavedTensor], saves: Saves,
              mem: Memory) -> HeldMemory | None:
    """What was alive at the peak or the failure (:func:`gradscope._model.held_at_peak.held_pass` over the
    allocation table, each allocation with the first save it holds); None without allocations."""
    mt = trace.memory_trace
    if mt.key_kind == "none" or not len(mem.allocations):
        return None
    saved_by_alloc: dict[int, int] = {}
    for k, sid in enumerate(saves.sid):
        found = mem.save_alloc.get(sid)
        if found is not None:
            saved_by_alloc.setdefault(found, k)
    return _held.held_pass(
        nodes, step_rows, mem.allocations, saved, saved_by_alloc, mt.key_kind, failed=trace.failed_oom,
        peak_position=mem.peak_position,
        n_events=mem.events_positions if mt.failed_at is None else mt.failed_at,
    )


def created_pass(trace: Trace, graph: Graph, unseen: int) -> tuple[int, int]:
    """Nodes the block created, and how many of them the recording shows."""
    created = max(trace.seq1 - trace.seq0, 0)
    seen_created = sum(1 for row in graph.rows if isinstance(row[N_KEY], int) and row[N_SEQ] >= trace.seq0) - unseen
    return created, seen_created
