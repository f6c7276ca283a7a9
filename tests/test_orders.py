"""Orders: every node a backward with create_graph=True creates carries order >= 1, including the
AddBackward0 the engine itself makes, after a node's post hook, to sum the gradients that reach one
input. Checked against an independent walk of the graph (sequence numbers taken around the
backward), on hand-written code and on PyTorch's own op database when ``expecttest`` is there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import floating_tensors, independent_nodes, op_db_cases

import gradscope as gs
from gradscope._passes import UNSEEN_NODE


def _created(before: int, after: int, *roots: Any) -> tuple[list[Any], list[Any]]:
    """Nodes reachable from ``roots`` made between two readings of the sequence counter, and the
    others (AccumulateGrad nodes, which all share one number, count as made before)."""
    nodes = independent_nodes(*roots)
    made = [fn for fn in nodes if before <= fn._sequence_nr() < after]
    return made, [fn for fn in nodes if not before <= fn._sequence_nr() < after]


@pytest.mark.parametrize("memory", ["off", "cpu", "tracker"])
def test_engine_sum_node_has_order_one(memory: str) -> None:
    x = torch.randn(5, requires_grad=True)
    with gs.record(memory=memory) as rec:
        y = (x - x.tanh()).sum()  # two gradients reach x: the engine adds them
        before = torch._C._autograd._get_sequence_nr()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        after = torch._C._autograd._get_sequence_nr()
    r = rec.recording
    made, rest = _created(before, after, g.grad_fn, y.grad_fn)
    assert "AddBackward0" in {fn.name() for fn in made}
    assert r.order_counts() == {0: len(rest), 1: len(made)}
    add = [n for n in r.nodes if n.name == "AddBackward0"]
    assert len(add) == 1 and add[0].order == 1
    # its creator is the forward node whose gradients it sums: TanhBackward0 ran last before it
    assert all(n.order == 0 for n in r.nodes if n.name in ("SubBackward0", "TanhBackward0", "SumBackward0"))


def test_second_order_pass_gives_order_two() -> None:
    x = torch.randn(4, requires_grad=True)
    with gs.record(memory="off") as rec:
        y = (x.exp() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        b1 = torch._C._autograd._get_sequence_nr()
        (h,) = torch.autograd.grad(g.sum(), x, create_graph=True)
        b2 = torch._C._autograd._get_sequence_nr()
    r = rec.recording
    made2, _ = _created(b1, b2, h.grad_fn)
    counts = r.order_counts()
    assert counts.get(2, 0) > 0
    # every node the second pass made that was made by running an order-1 node is order 2:
    # at most the nodes the second pass made are order 2, and at least one of them is
    assert counts[2] <= len(made2)
    assert all(n.order <= 2 for n in r.nodes)


def test_orders_on_op_db() -> None:
    """PyTorch's OpInfo database: for each op that supports double backward, its first float64
    sample, forward and autograd.grad(create_graph=True) recorded; every node the grad made is
    order 1 and every other node order 0 (21 ops gave engine-made nodes order 0 before)."""
    pytest.importorskip("expecttest")
    ops = [op for op in op_db_cases() if op.supports_gradgrad]
    assert len(ops) > 300
    wrong: list[str] = []
    checked = 0
    for op in ops:
        if torch.float64 not in op.supported_dtypes("cpu"):
            continue
        try:
            sample = next(iter(op.sample_inputs("cpu", torch.float64, requires_grad=True)))
        except StopIteration:
            continue
        inputs = floating_tensors([sample.input, *sample.args])
        if not inputs:
            continue
        try:
            torch.manual_seed(0)
            with gs.record(memory="off") as rec:
                out = op(sample.input, *sample.args, **sample.kwargs)
                outs = floating_tensors(out)
                if not outs:
                    continue
                loss = sum(o.sum() for o in outs)
                before = torch._C._autograd._get_sequence_nr()
                grads = torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
                after = torch._C._autograd._get_sequence_nr()
        except Exception:  # an op whose sample does not run here: not ours to judge
            continue
        r = rec.recording
        roots = [g.grad_fn for g in grads if g is not None and g.grad_fn is not None] + [loss.grad_fn]
        made, rest = _created(before, after, *roots)
        counts: dict[int, int] = {}  # walked nodes (a graph the op made and dropped inside is not theirs)
        for n in r.nodes:
            if n.name != UNSEEN_NODE:
                counts[n.order] = counts.get(n.order, 0) + 1
        if counts.get(1, 0) != len(made) or counts.get(0, 0) != len(rest) or len(counts) > 2:
            wrong.append(f"{op.name}: recorded {counts}, created {len(made)}, other {len(rest)}")
        checked += 1
    assert checked > 250, checked
    assert wrong == []
