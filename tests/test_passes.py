"""The named passes of gradscope._passes on traces written by hand: no torch, no hook runs here.

The main trace is what the tracker source and the hooks would append for

    lin = Linear-like root module (parameter ``weight``), x an input leaf
    y = (x * lin.weight).tanh()      # inside lin's call: MulBackward0 (seq 10), TanhBackward0 (11)
    loss = y.sum()                   # SumBackward0 (12), outside any module
    loss.backward()

with every allocation, free and step event spelled out, so each expected value below is worked
out by hand from the rows, not by running the code under test.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradscope import _passes as P
from gradscope._base.compat import ACC_SEQ
from gradscope._base.trace import (
    EV_FREED,
    EV_LIVE,
    EV_POST,
    EV_PRE,
    EV_UNPACK,
    BackwardRow,
    MemoryTrace,
    Trace,
)
from gradscope.errors import BudgetRefusal
from gradscope.memory import AllocEvent, EvalScope, MemoryKind
from gradscope.recording import Allocation, BackwardCall, Category, Edge, Kind, Phase

F32 = "torch.float32"


def _nodes() -> list[tuple[Any, ...]]:
    return [
        (12, 12, "SumBackward0", None, None, False),
        (11, 11, "TanhBackward0", None, None, False),
        (10, 10, "MulBackward0", None, None, False),
        (("acc", 1), ACC_SEQ, "AccumulateGrad", (0, "weight"), (4,), False),
        (("acc", 2), ACC_SEQ, "AccumulateGrad", "input", (4,), False),
    ]


def _forward(trace: Trace) -> None:
    trace.nodes = _nodes()
    trace.node_index = {row[0]: i for i, row in enumerate(trace.nodes)}
    trace.edges = dict.fromkeys([(1, 0), (2, 1), (3, 2), (4, 2)])
    trace.roots = [("Linear", None)]
    trace.root_names = {0: "lin"}  # the variable found where the block ended
    trace.calls = [[0, "", 10, 12, 100, 200, 0, "Linear"]]
    trace.param_keys = {502: (0, "weight", "parameter")}
    trace.saves = [
        (10, 501, 0x10, 16, (4,), F32, "cpu", 110, True),  # x, by MulBackward0
        (10, 502, 0x20, 16, (4,), F32, "cpu", 110, True),  # lin.weight, by MulBackward0
        (11, 503, 0x30, 16, (4,), F32, "cpu", 120, False),  # tanh's result, by TanhBackward0
    ]
    trace.save_attr = {0: "_saved_self", 1: "_saved_other"}
    trace.seq_attr = {11: "_saved_result"}


def tracker_trace() -> Trace:
    t = Trace(memory="tracker", t0_ns=0, t1_ns=500, seq0=10, seq1=13)
    _forward(t)
    E = AllocEvent
    mem = [
        # forward (no step position: not in backward)
        E(105, 16, 504, "aten::mul", call=0),  # 0: x * w, freed when tanh is done with it
        E(115, 16, 503, "aten::tanh", call=0),  # 1: y, saved by TanhBackward0
        E(125, 4, 505, "aten::sum"),  # 2: loss
        E(130, -16, 504, "free"),  # 3
        # backward; ``step`` = how many step events there were
        E(302, 16, 506, "aten::ones_like", step=2),  # 4: SumBackward0's gradient
        E(312, 16, 507, "aten::tanh_backward", step=5),  # 5: TanhBackward0's gradient  <- peak, 52 B
        E(314, -16, 506, "free", step=5),  # 6
        E(316, -16, 503, "free", step=6),  # 7: the engine releases tanh's saved result
        E(322, 16, 508, "aten::mul", step=8),  # 8: x's gradient
        E(323, 16, 509, "aten::mul", step=8),  # 9: weight's gradient
        E(324, -16, 507, "free", step=8),  # 10
    ]
    t.memory_trace = MemoryTrace(source="tracker", online=True, key_kind="storage", events=mem)
    # at each boundary the source's live bytes, read as the last step ends (ident: that node)
    t.events = [
        (EV_LIVE, -1, 300, 20), (EV_PRE, 0, 300, 13), (EV_POST, 0, 305, None),
        (EV_LIVE, 0, 310, 36), (EV_PRE, 1, 310, 13), (EV_POST, 1, 315, None),
        (EV_LIVE, 1, 320, 20), (EV_PRE, 2, 320, 13), (EV_POST, 2, 325, None),
        (EV_LIVE, 2, 330, 36), (EV_PRE, 3, 330, 13), (EV_POST, 3, 331, None),
        (EV_LIVE, 3, 332, 36), (EV_PRE, 4, 332, 13), (EV_POST, 4, 333, None),
        (EV_LIVE, 4, 334, 36),
    ]
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=300, t1_ns=400, ev0=0, ev1=16)]
    t.baseline_storages = {502: 16}  # the parameters of the modules called
    t.gradient_keys = [(0, 509, 0x90, 400), (0, 508, 0x80, 400)]
    return t


# ----- graph, naming, steps, orders, modules, saves ------------------------------------------------
def test_graph_naming_steps_orders_modules_saves() -> None:
    t = tracker_trace()
    g = P.graph_pass(t)
    assert list(g.edges) == [Edge(1, 0), Edge(2, 1), Edge(3, 2), Edge(4, 2)]
    assert g.leaves == [3, 4] and g.by_seq[11] == 1
    prefixes = P.naming_pass(t)
    assert prefixes == ["lin"]
    steps = P.steps_pass(t, g)
    assert steps.node == [0, 1, 2, 3, 4] and steps.backward == [0] * 5
    assert steps.t0 == [300, 310, 320, 330, 332] and steps.t1 == [305, 315, 325, 331, 333]
    assert steps.live_before == [20, 36, 20, 36, 36] and steps.live_after == [36, 20, 36, 36, 36]
    orders = P.orders_pass(t, g, steps)
    assert orders == [0] * 5
    modules = P.modules_pass(t, g, prefixes, steps, orders)
    assert modules == [None, "lin", "lin", "lin", None]  # seq 10, 11 inside the call; the leaf by its name
    saves = P.saves_pass(t, g, prefixes)
    assert saves.node == [2, 2, 1]
    assert saves.attribute == ["_saved_self", "_saved_other", "_saved_result"]
    assert saves.kind == [Kind.INPUT, Kind.PARAMETER, Kind.ACTIVATION]
    assert saves.name == [None, "lin.weight", None] and saves.storage == [0, 1, 2] and saves.dropped == 0


def test_a_save_made_under_a_later_number_moves_to_its_node_only_where_no_node_has_that_number() -> None:
    """NOTE [ saves packed under another number ]: an in-place op saves a clone made (with a
    node no graph keeps, number 13) after its own node; the recorder's learnt rule says the save
    numbered 13 belongs to node 10. Where a node numbered 13 exists, the save stays with it."""
    t = tracker_trace()
    t.saves.append((13, 510, 0xA0, 16, (4,), F32, "cpu", 115, False))
    t.seq_moves = {13: (10, "_saved_self")}
    saves = P.saves_pass(t, P.graph_pass(t), P.naming_pass(t))
    assert saves.node == [2, 2, 1, 2] and saves.sid == [0, 1, 2, 3] and saves.dropped == 0
    assert saves.attribute == ["_saved_self", "_saved_other", "_saved_result", "_saved_self"]
    assert saves.kind[3] is Kind.ACTIVATION and saves.storage == [0, 1, 2, 3]

    t.nodes = [*_nodes(), (13, 13, "CloneBackward0", None, None, False)]
    saves = P.saves_pass(t, P.graph_pass(t), P.naming_pass(t))
    assert saves.node == [2, 2, 1, 5] and saves.attribute[3] == "saved[3]"

    t.seq_moves = {}
    t.nodes = _nodes()
    saves = P.saves_pass(t, P.graph_pass(t), P.naming_pass(t))
    assert saves.node == [2, 2, 1] and saves.dropped == 1


def test_the_allocation_table_categories_and_peak() -> None:
    r = P.build(tracker_trace())
    OT, A, G, B = Category.OTHER, Category.ACTIVATION, Category.GRADIENT, Category.BACKWARD_TEMP
    FW, BW = Phase.FORWARD, Phase.BACKWARD
    rows = [(a.bytes, a.alloc_at, a.free_at, a.category, a.phase, a.module, a.node, a.step, a.label, a.key)
            for a in r.allocations]
    assert rows == [
        (16, 0, 3, OT, FW, "lin", None, None, "aten::mul", 504),
        (16, 1, 7, A, FW, "lin", 1, None, "aten::tanh", 503),
        (4, 2, None, OT, FW, None, None, None, "aten::sum", 505),
        (16, 4, 6, B, BW, None, None, 0, "aten::ones_like", 506),
        (16, 5, 10, B, BW, "lin", None, 1, "aten::tanh_backward", 507),
        (16, 8, None, G, BW, "lin", None, 2, "aten::mul", 508),
        (16, 9, None, G, BW, "lin", None, 2, "aten::mul", 509),
    ]
    assert r.allocations[1] == Allocation(1, 16, 1, 7, 115e-9, A, FW, "lin", 1, None, "aten::tanh", 503)
    assert [p.live for p in r.timeline] == [16, 32, 36, 20, 36, 52, 36, 20, 36, 52, 36]
    assert r.peak_bytes == 52 and r.peak is not None
    assert (r.peak.step, r.peak.node, r.peak.module, r.peak.label) == (1, 1, "lin", "aten::tanh_backward")
    assert r.peak_event() == 5
    assert [a.index for a in r.alive_at_peak()] == [1, 2, 3, 4]
    assert r.bytes_at_peak_by_category() == {"backward_temp": 32, "activation": 16, "other": 4}
    assert r.bytes_at_peak_by_module() == {"lin": 32, "(no module)": 20}
    assert r.node_saved_bytes(2) == 32 and r.node_saved_bytes(1) == 16
    assert r.node_saved_alive_at_peak(1) == 16 and r.node_saved_alive_at_peak(2) == 0
    # without tanh's saved result the peak is the second 52 B moment (weight's gradient made)
    assert r.replay_peak() == 52
    assert r.replay_peak(lambda a: a.category is A) == 52
    assert r.replay_peak(lambda a: a.category is B) == 36
    assert r.replay_peak(lambda a: a.category in (A, B)) == 36
    assert [p.category for p in r.timeline][:3] == [OT, A, OT]
    assert [s.freed_bytes for s in r.steps] == [0, 16, 0, 0, 0]  # the step that released tanh's save
    assert r.saved_bytes == 48 and r.baseline_bytes == 32  # x and the weight existed before


def test_held_at_peak_and_backward_calls() -> None:
    r = P.build(tracker_trace())
    held = r.held
    assert held is not None and held.moment == "peak" and held.live_bytes == 52
    assert [(h.what, h.bytes, h.node_name) for h in held.rows] == [
        ("saved", 16, "TanhBackward0"), ("backward", 16, "SumBackward0"), ("backward", 16, "TanhBackward0"),
        ("forward", 4, None)]
    assert held.by_what() == {"saved": 16, "backward": 32, "forward": 4} == r.held_at_peak()
    assert r.saved_bytes_at_peak == 16
    assert r.backward_calls == (BackwardCall(0, "backward", False, False, roots=(0,), inputs=(),
                                             accumulated=(3, 4), first_step=0, last_step=4),)
    assert r.backward_leaves(r.backward_calls[0]) == ((), ("lin.weight", "input"))


def test_held_at_a_refused_allocation_stops_before_the_unwinding() -> None:
    t = tracker_trace()
    mt = t.memory_trace
    # the budget refused an allocation after event 5; then the exception unwound and freed
    mt.events = mt.events[:6] + [AllocEvent(340, -16, 507, "free"), AllocEvent(341, -16, 503, "free")]
    mt.failed_at = 6
    t.events = t.events[:5]
    t.backwards[0].ev1 = 5
    t.refusal = BudgetRefusal(16, 52, 60, where="aten::mul")
    t.failed_oom = True
    r = P.build(t, complete=False)
    assert r.oom is not None and (r.oom.requested, r.oom.live, r.oom.budget) == (16, 52, 60)
    assert r.held is not None and r.held.moment == "failure"
    assert r.held.live_bytes == 52  # not 20: what the unwinding freed was alive at the refusal
    mt.failed_at = None
    assert P.build(t, complete=False).held.live_bytes == 20  # type: ignore[union-attr]


# ----- create_graph orders -----------------------------------------------------------------------
def test_nodes_a_create_graph_pass_made_carry_their_creators_order_plus_one() -> None:
    """x - x.tanh() differentiated twice with create_graph=True: the engine's AddBackward0 that
    sums the two gradients reaching x is made after TanhBackward0 ran (seq 9), so it is order 1,
    and what the second pass made while running an order-1 node is order 2."""
    t = Trace(memory="off", seq0=4, seq1=12)
    t.nodes = [
        (5, 5, "SubBackward0", None, None, False),
        (4, 4, "TanhBackward0", None, None, False),
        (("acc", 1), ACC_SEQ, "AccumulateGrad", "input", (3,), False),
        # made by the first pass (found from its results afterwards)
        (6, 6, "NegBackward0", None, None, False),
        (7, 7, "MulBackward0", None, None, False),
        (8, 8, "TanhBackwardBackward0", None, None, False),
        (9, 9, "AddBackward0", None, None, False),
        # made by the second pass
        (10, 10, "MulBackward0", None, None, False),
        (11, 11, "AddBackward0", None, None, False),
    ]
    t.edges = dict.fromkeys([(2, 0), (1, 0), (2, 1), (3, 6), (4, 6), (5, 4)])
    t.calls = []
    t.events = [(EV_PRE, 0, 100, 6), (EV_PRE, 1, 110, 7), (EV_PRE, 4, 200, 10)]
    t.backwards = [
        BackwardRow("autograd.grad", True, True, roots=[0], inputs=[2], seq0=6, seq1=10, ev0=0, ev1=2),
        BackwardRow("autograd.grad", True, True, roots=[6], inputs=[2], seq0=10, seq1=12, ev0=2, ev1=3),
    ]
    g = P.graph_pass(t)
    steps = P.steps_pass(t, g)
    assert steps.creators == {3: 0, 4: 1, 5: 1, 6: 1, 7: 4, 8: 4}
    orders = P.orders_pass(t, g, steps)
    assert orders == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    r = P.build(t)
    assert r.order_counts() == {0: 3, 1: 4, 2: 2}
    assert [c.inputs for c in r.backward_calls] == [(2,), (2,)]


# ----- the profiler's node scopes --------------------------------------------------------------------
def test_steps_from_profiler_scopes_match_accumulate_grad_in_hook_order() -> None:
    """The CPU profiler names each node's scope with its sequence number, except AccumulateGrad
    (all share one): those are matched, in order, with the pre hooks of the leaves' nodes."""
    t = Trace(memory="cpu", t0_ns=0, t1_ns=500, seq0=10, seq1=13)
    _forward(t)
    S = EvalScope
    scopes = [S("SumBackward0", 12, 300, 305, 0, False), S("TanhBackward0", 11, 310, 315, 0, False),
              S("MulBackward0", 10, 320, 325, 0, False), S("AccumulateGrad", ACC_SEQ, 330, 331, 0, False),
              S("AccumulateGrad", ACC_SEQ, 332, 333, 0, False),
              S("MulBackward0", 99, 340, 341, None, False)]  # a pass gradscope did not observe
    E = AllocEvent
    mem = [E(115, 16, 0x30, "aten::tanh", call=0),
           E(311, 16, 0x70, "aten::tanh_backward", scope=1, backward=0),
           E(316, -16, 0x30, "free", backward=0),  # between scopes: the engine releasing saves
           E(321, 16, 0x80, "aten::mul", scope=2, backward=0)]
    t.memory_trace = MemoryTrace(source="cpu", online=False, key_kind="address", events=mem, scopes=scopes)
    t.events = [(EV_PRE, 4, 332, 13), (EV_PRE, 3, 330, 13)]  # x's leaf ran first here
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=300, t1_ns=400, ev0=0, ev1=2)]
    g = P.graph_pass(t)
    steps = P.steps_pass(t, g)
    assert steps.node == [0, 1, 2, 4, 3] and steps.scope == [0, 1, 2, 3, 4]
    r = P.build(t)
    assert [a.step for a in r.allocations] == [None, 1, 2]
    assert [p.step for p in r.timeline] == [None, 1, 1, 2]  # the free after tanh's scope: its step
    assert [s.live_before for s in r.steps][:3] == [16, 16, 16] and r.steps[1].live_after == 32
    assert r.allocations[0].node == 1 and r.allocations[0].category is Category.ACTIVATION
    # the release stamped with the next scope's start (the profiler's clock did not tell them
    # apart) is still the step before: the next node's scope would hold it if it were its own
    t.memory_trace.events[2] = E(320, -16, 0x30, "free", backward=0)
    assert [p.step for p in P.build(t).timeline] == [None, 1, 1, 2]


def test_a_release_stamped_inside_the_next_scope_is_the_step_before() -> None:
    """See NOTE [ releases stamped late ] in gradscope._passes: the engine frees a node's saves
    between node scopes, but the profiler's two clocks can put that free microseconds inside the
    next node's scope. A saved storage made before that scope and freed inside it was released by
    the step before; frees of what the scope made itself, or of storages nobody saved, stay."""
    t = Trace(memory="cpu", t0_ns=0, t1_ns=500, seq0=10, seq1=13)
    _forward(t)
    S = EvalScope
    t.memory_trace = MemoryTrace(source="cpu", online=False, key_kind="address", scopes=[
        S("SumBackward0", 12, 300, 305, 0, False), S("TanhBackward0", 11, 310, 315, 0, False),
        S("MulBackward0", 10, 320, 330, 0, False)])
    E = AllocEvent
    t.memory_trace.events = [
        E(115, 16, 0x30, "aten::tanh", call=0),  # tanh's result, saved by TanhBackward0
        E(116, 8, 0x40, "aten::empty", call=0),  # made before, saved by nobody
        E(311, 16, 0x70, "aten::tanh_backward", scope=1, backward=0),
        E(321, 16, 0x80, "aten::mul", scope=2, backward=0),
        E(322, -16, 0x30, "free", scope=2, backward=0),  # the release after tanh's scope, stamped late
        E(323, -8, 0x40, "free", scope=2, backward=0),
        E(324, -16, 0x80, "free", scope=2, backward=0),
    ]
    t.events = [(EV_PRE, 4, 332, 13), (EV_PRE, 3, 330, 13)]
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=300, t1_ns=400, ev0=0, ev1=2)]
    r = P.build(t)
    assert [r.nodes[s.node].name for s in r.steps][:3] == ["SumBackward0", "TanhBackward0", "MulBackward0"]
    assert [p.step for p in r.timeline] == [None, None, 1, 2, 1, 2, 2]
    saved = {a.index: a for a in r.allocations}
    assert saved[0].node == 1 and r.saved[2].freed_at_step == 1
    assert [s.freed_bytes for s in r.steps][:3] == [0, 16, 0]
    # the same free stamped before the next scope began was the step before already
    t.memory_trace.events[4] = E(318, -16, 0x30, "free", backward=0)
    t.memory_trace.events.sort(key=lambda e: e.t_ns)
    r2 = P.build(t)
    assert r2.saved[2].freed_at_step == 1 and [s.freed_bytes for s in r2.steps][:3] == [0, 16, 0]


def test_a_save_is_not_matched_with_an_allocation_its_address_got_after_it_was_freed() -> None:
    """A save finds its allocation by address, with the clocks' slack (200 us); in a small graph
    the backward starts within that slack, frees the save and gives its address to a gradient.
    That gradient, made inside a backward pass that began after the save was packed, is not the
    save's allocation (see _saves_to_allocations)."""
    t = Trace(memory="cpu", t0_ns=0, t1_ns=90_000, seq0=10, seq1=13)
    _forward(t)  # tanh's result packed at 120 ns, at 0x30
    S = EvalScope
    b0 = 50_000  # the backward began 50 us after the pack
    t.memory_trace = MemoryTrace(source="cpu", online=False, key_kind="address", scopes=[
        S("SumBackward0", 12, b0 + 300, b0 + 305, 0, False), S("TanhBackward0", 11, b0 + 310, b0 + 315, 0, False),
        S("MulBackward0", 10, b0 + 320, b0 + 330, 0, False)])
    E = AllocEvent
    t.memory_trace.events = [
        E(115, 16, 0x30, "aten::tanh", call=0),
        E(b0 + 311, 16, 0x70, "aten::tanh_backward", scope=1, backward=0),
        E(b0 + 316, -16, 0x30, "free", backward=0),  # tanh's result released after its node
        E(b0 + 321, 16, 0x30, "aten::mul", scope=2, backward=0),  # a gradient at the same address
        E(b0 + 340, -16, 0x30, "free", backward=0),
    ]
    t.events = [(EV_PRE, 4, b0 + 332, 13), (EV_PRE, 3, b0 + 330, 13)]
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=b0, t1_ns=b0 + 400, ev0=0, ev1=2)]
    r = P.build(t)
    assert r.allocations[0].node == 1 and r.allocations[0].category is Category.ACTIVATION
    assert r.allocations[2].node is None and r.allocations[2].category is not Category.ACTIVATION
    assert r.saved[2].freed_at_step == 1 and [s.freed_bytes for s in r.steps][:3] == [0, 16, 0]
    # a backward that began right at the pack (within the clocks' margin) proves nothing: the
    # latest allocation made no later than the pack, with the slack, is taken as before
    t.backwards[0].t0_ns = 130
    assert P.build(t).allocations[2].node == 1


# ----- memory="off": steps from unpacks, frees from weak-reference checks ----------------------------
def test_off_steps_from_unpacks_and_frees_from_checks() -> None:
    t = Trace(memory="off", t0_ns=0, t1_ns=500, seq0=10, seq1=13)
    _forward(t)
    t.events = [
        (EV_PRE, 0, 300, 13),  # SumBackward0 saves nothing: hooked
        (EV_UNPACK, 2, 310, None),  # TanhBackward0 unpacks its result
        (EV_UNPACK, 0, 320, None), (EV_UNPACK, 1, 321, None),  # MulBackward0 unpacks two
        (EV_FREED, 2, 322, None),  # tanh's result found freed at the next boundary
        (EV_PRE, 3, 330, 13), (EV_PRE, 4, 332, 13),
    ]
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=300, t1_ns=400, ev0=0, ev1=7)]
    r = P.build(t)
    assert [s.node for s in r.steps] == [0, 1, 2, 3, 4]
    assert [s.start_s for s in r.steps] == [300e-9, 310e-9, 320e-9, 330e-9, 332e-9]
    assert [s.freed_bytes for s in r.steps] == [0, 0, 16, 0, 0]
    assert r.timeline == () and r.peak is None and r.allocations == ()


def _off_unseen_sum() -> Trace:
    """memory="off" as it records now: SumBackward0 saves nothing and has no hook; its step is
    given back from the engine's order (see NOTE [ steps nobody saw ] in gradscope._passes)."""
    t = Trace(memory="off", t0_ns=0, t1_ns=500, seq0=10, seq1=13)
    _forward(t)
    t.events = [
        (EV_UNPACK, 2, 310, 13),  # TanhBackward0 unpacks its result
        (EV_FREED, 2, 0, None),  # found freed as the next node starts: Tanh's step freed it
        (EV_UNPACK, 0, 320, 13), (EV_UNPACK, 1, 321, 13),  # MulBackward0 unpacks two
        (EV_PRE, 3, 330, 13), (EV_PRE, 4, 332, 13),
    ]
    t.backwards = [BackwardRow("backward", False, False, roots=[0], inputs=[], seq0=13, seq1=13,
                               t0_ns=300, t1_ns=400, ev0=0, ev1=6)]
    return t


def test_off_steps_of_nodes_that_save_nothing_come_from_the_engine_order() -> None:
    r = P.build(_off_unseen_sum())
    assert [s.node for s in r.steps] == [0, 1, 2, 3, 4]
    # the unseen step takes no time, at the start of the next seen one
    assert [s.start_s for s in r.steps] == [310e-9, 310e-9, 320e-9, 330e-9, 332e-9]
    assert [s.duration_s for s in r.steps][:2] == [0.0, 10e-9]
    assert [n.executed for n in r.nodes] == [1, 1, 1, 1, 1]
    # the free found at Mul's start stays with Tanh's step once Sum's step is put before it
    assert [s.freed_bytes for s in r.steps] == [0, 16, 0, 0, 0] and r.saved[2].freed_at_step == 1


def test_engine_order_runs_the_highest_sequence_number_first_and_stops_at_inputs() -> None:
    """Two branches off one root: (12) -> (11) and (10); (11) -> (9); the leaf's AccumulateGrad
    (ACC_SEQ) runs as soon as it is ready. autograd.grad with inputs=[(9)] runs only the nodes on a
    path to it and does not run (9) itself; backward(inputs=...) runs it."""
    t = Trace(memory="off")
    t.nodes = [
        (12, 12, "AddBackward0", None, None, False),
        (11, 11, "MulBackward0", None, None, False),
        (10, 10, "ExpBackward0", None, None, False),
        (9, 9, "TanhBackward0", None, None, False),
        (("acc", 1), ACC_SEQ, "AccumulateGrad", "input", (3,), False),
    ]
    t.edges = dict.fromkeys([(1, 0), (2, 0), (3, 1), (4, 1), (4, 2), (4, 3)])
    g = P.graph_pass(t)

    def order(api: str, inputs: list[int]) -> list[int]:
        return P.engine_order(g, BackwardRow(api, False, False, roots=[0], inputs=inputs, seq0=13))

    # (12), (11); then (10) before (9), which (11) made ready (a depth-first walk would take (9));
    # x's AccumulateGrad waits for all three of its parents
    assert order("backward", []) == [0, 1, 2, 3, 4]
    assert order("autograd.grad", [3]) == [0, 1]
    assert order("backward", [3]) == [0, 1, 3]


def test_off_steps_seen_out_of_the_engine_order_are_kept_alone() -> None:
    """Seen steps in an order the single-threaded engine would not run (a pass on several
    threads): nothing is guessed, the seen steps stay as they were."""
    t = _off_unseen_sum()
    t.events = [(EV_UNPACK, 0, 310, 13), (EV_UNPACK, 1, 311, 13), (EV_UNPACK, 2, 320, 13),
                (EV_PRE, 3, 330, 13), (EV_PRE, 4, 332, 13)]  # Mul seen before Tanh
    t.backwards[0].ev1 = 5
    r = P.build(t)
    assert [s.node for s in r.steps] == [2, 1, 3, 4]
    assert any("did not come in the order" in n for n in r.notes)
    assert not any("did not come in the order" in n for n in P.build(_off_unseen_sum()).notes)


# ----- notes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["foreign_saves", "unseen_saves"])
def test_saves_others_packed_are_noted(field: str) -> None:
    t = tracker_trace()
    setattr(t, field, 3)
    notes = P.build(t).notes
    assert any(n.startswith("3 saved") for n in notes)


def test_tracker_note_names_the_ops_whose_formulas_change() -> None:
    plain = [n for n in P.build(tracker_trace()).notes if "dispatch mode" in n]
    assert len(plain) == 1 and "ran here" not in plain[0]
    t = tracker_trace()
    t.memory_trace.events.append(AllocEvent(350, 4, 600, "aten::prod"))
    assert any("(prod ran here)" in n for n in P.build(t).notes)
    t.memory = MemoryKind.OFF
    assert not any("dispatch mode" in n for n in P.build(t).notes)


def test_a_gradient_stamped_just_after_its_pass_ended_is_still_a_gradient() -> None:
    """The pass's end comes from Python's clock, allocations from the memory source's: the last
    gradient of a pass (the first layer's) can carry a later stamp (see NOTE [ two clocks ])."""
    t = tracker_trace()
    t.gradient_keys = [(0, 509, 0x90, 322), (0, 508, 0x80, 322)]  # 509 stamped at 323, 1 ns after
    cats = {a.key: a.category for a in P.build(t).allocations}
    assert cats[509] is Category.GRADIENT and cats[508] is Category.GRADIENT
