"""What a recording says besides its tables: its backward calls, its notes, and the collectives and
the caught budget it keeps in ``extra``."""

from __future__ import annotations

from typing import Any

from gradscope._base import compat as _compat
from gradscope._base.trace import (
    N_CUSTOM,
    N_NAME,
    Trace,
)
from gradscope._model.recording import (
    BackwardCall,
)
from gradscope._passes.nodes import UNSEEN_NODE, Graph
from gradscope._passes.saved_tensors import Saves
from gradscope._passes.steps import Steps

_DEEP_GRAPH = 40_000  # nodes above which freeing may crash PyTorch: see NOTE [ freeing deep graphs ]
# Backward formulas PyTorch picks differently under any Python dispatch mode (see tracker_note).
_MODE_SENSITIVE = ("prod", "cumprod", "det", "vander", "ctc_loss")


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
        # See NOTE [ freeing deep graphs ] in gradscope._capture.walk.
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
    timeline (see NOTE [ collectives in a recording ] in :mod:`gradscope._capture.memory.profiler`). Empty when
    there was none."""
    rows = trace.memory_trace.collectives
    if not rows:
        return {}
    t0 = trace.t0_ns
    return {"collectives": [{"op": op, "t_s": (a - t0) / 1e9, "duration_s": max(b - a, 0) / 1e9, "bytes": n,
                             "kind": kind} for op, a, b, n, kind in rows]}
