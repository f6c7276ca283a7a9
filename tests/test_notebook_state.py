"""Recording in a notebook whose earlier cells left results alive.

A recording holds exactly the block's work: nodes made before the block (graphs kept in variables
by earlier cells) are not the block's, and nodes made in the block are, also where only a user's
object holds them (a KV cache's list, a dataclass output, a nested list in an attribute). Each
scenario runs as generated variants, checked against independent computations: the same step
recorded in a clean namespace, a walk of the graph through ``next_functions`` and PyTorch's own
per-thread node numbers (``grad_fn._sequence_nr()``: a node made later has a larger number; the
block's first and last lines read PyTorch's counter, which makes no node).

Cells run as a notebook runs them: ``exec`` of source in one namespace dict (the block's frame has
that dict as its locals and globals), and through IPython's own test shell with ``%%gradscope``.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import OpLog, independent_nodes, no_gradscope_left, profiler_peak
from IPython.testing import globalipapp
from torch import nn
from torch.profiler import ProfilerActivity, profile

import gradscope as gs
from gradscope._passes import UNSEEN_NODE

NodeKey = tuple[str, str | None, str | None]

# --------------------------------------------------------------------------------------- cells
_SETUP = """
import torch, gradscope as gs
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear({d}, {h}), nn.ReLU(), nn.Linear({h}, {h}), nn.Tanh(), nn.Linear({h}, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn({n}, {d})
_marker = torch._C._autograd._get_sequence_nr  # the number the next node gets
"""

# One earlier cell's result, as an expression (the cell before the block evaluates it k times).
_LEFTOVERS = {
    "model_output": "model(x)",  # `out = model(x)`: the same model's graph alive
    "unrelated": "(torch.randn(5, requires_grad=True) * 2).exp().sum()",
    "loss_after_backward": "_backward_and_keep(model(x).pow(2).mean())",  # nodes alive, saves freed
    "loss_list": "[model(x).pow(2).mean() for _ in range(2)]",  # an earlier loss list
    "deep_chain": "_chain(model(x), 12)",
}
_HELPERS = """
def _backward_and_keep(loss):
    loss.backward()
    opt.zero_grad(set_to_none=True)
    return loss
def _chain(t, n):
    for _ in range(n):
        t = t.sin() * 1.5
    return t
"""

# The block: one training step of the same model.
_STEP = """
opt.zero_grad(set_to_none=True)
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
"""


def _indent(src: str, by: str = "    ") -> str:
    return "".join(by + line if line.strip() else line for line in src.splitlines(keepends=True))


def _record_args(memory: str, budget: str | None) -> str:
    return f"memory={memory!r}" + (f", budget={budget!r}" if budget is not None else "")


def _leftover_cell(kinds: tuple[str, ...], k: int, holder: str) -> str:
    """Source that leaves ``k`` results of each kind alive, held the way ``holder`` says."""
    exprs = [_LEFTOVERS[kind] for kind in kinds for _ in range(k)]
    if holder in ("globals", "locals"):
        return "".join(f"left_{i} = {e}\n" for i, e in enumerate(exprs))
    if holder == "dict":
        return "held = {" + ", ".join(f"'r{i}': {e}" for i, e in enumerate(exprs)) + "}\n"
    if holder == "list":
        return "held = [" + ", ".join(exprs) + "]\n"
    if holder == "dict_of_lists":
        return "held = {'a': [" + ", ".join(exprs) + "]}\n"
    raise AssertionError(holder)


def _block_cell(memory: str, budget: str | None, leftovers: str, holder: str) -> str:
    """The earlier cells' leftovers, then the recorded step between two node-number markers."""
    block = (
        f"with gs.record({_record_args(memory, budget)}) as rec:\n"
        + _indent("_m0 = _marker()\n" + _STEP + "_m1 = _marker()\n")
    )
    if holder != "locals":
        return leftovers + block
    # leftovers and the block in one function: the results are its local variables
    body = leftovers + block + "return rec, loss, _m0, _m1\n"
    return "def cell():\n" + _indent(body) + "rec, loss, _m0, _m1 = cell()\n"


def _run(src: str, ns: dict[str, Any] | None = None) -> dict[str, Any]:
    ns = {"__name__": "__notebook__"} if ns is None else ns
    exec(compile(src, "<cell>", "exec"), ns)
    return ns


def _keys(r: gs.Recording) -> collections.Counter[NodeKey]:
    return collections.Counter((n.name, n.module, n.leaf) for n in r.nodes)


def _walk_check(r: gs.Recording, roots: list[Any], m0: int, m1: int) -> None:
    """The recording's nodes against an independent walk from the block's results: same node
    types, and every node numbered between the markers (made in the block) is seen."""
    walk = independent_nodes(*[t.grad_fn for t in roots if t.grad_fn is not None])
    made = [fn for fn in walk if m0 <= fn._sequence_nr() < m1]
    # the test's own premise: every node the block made is reachable from ``roots``
    assert len(made) == m1 - m0
    assert collections.Counter(n.name for n in r.nodes) == collections.Counter(type(fn).__name__ for fn in walk)
    assert r.nodes_created == m1 - m0
    assert r.nodes_created_seen == r.nodes_created, (
        f"created {r.nodes_created}, seen {r.nodes_created_seen}: nodes made in the block are missing"
    )


def _variants(dims: dict[str, list[Any]], n: int, seed: int) -> list[tuple[Any, ...]]:
    """``n`` distinct combinations of ``dims``: case ``i`` takes dimension ``i % len(dims)``'s
    values in turn, the rest of the combination drawn with a fixed seed (the same cases every run)."""
    rng = random.Random(seed)
    out: list[tuple[Any, ...]] = []
    i = 0
    while len(out) < n:
        case = tuple(vals[(i // len(dims)) % len(vals)] if j == i % len(dims) else rng.choice(vals)
                     for j, vals in enumerate(dims.values()))
        if case not in out:
            out.append(case)
        i += 1
    return out


# ------------------------------------------------------------- 1. earlier cells' results alive
_SIZES = [(8, 16, 4), (3, 5, 2), (32, 48, 16)]
_MODES = [("off", None), ("cpu", None), ("tracker", None), ("tracker", "64MiB")]
_KINDS = [("model_output",), ("unrelated",), ("loss_after_backward",), ("loss_list",), ("deep_chain",),
          ("model_output", "unrelated", "loss_list"), tuple(_LEFTOVERS)]
_HOLDERS = ["globals", "locals", "dict", "list", "dict_of_lists"]
LEFTOVER_CASES = _variants({"size": _SIZES, "mode": _MODES, "kinds": _KINDS, "k": [1, 2, 3],
                            "holder": _HOLDERS}, 18, seed=1)


def _case_id(case: tuple[Any, ...]) -> str:
    return "-".join("+".join(map(str, v)) if isinstance(v, list | tuple) else str(v) for v in case)


@pytest.mark.parametrize("case", LEFTOVER_CASES, ids=[_case_id(c) for c in LEFTOVER_CASES])
def test_results_of_earlier_cells_are_not_the_blocks_nodes(case: tuple[Any, ...]) -> None:
    (d, h, n), (memory, budget), kinds, k, holder = case
    setup = _SETUP.format(d=d, h=h, n=n) + _HELPERS
    clean = _run(setup + _block_cell(memory, budget, "", "globals"))
    dirty = _run(setup + _block_cell(memory, budget, _leftover_cell(kinds, k, holder), holder))
    rc, rd = clean["rec"].recording, dirty["rec"].recording
    assert rc.complete and rd.complete
    # the clean namespace's step: 6 AccumulateGrad + Mean, Pow, 3 x (Addmm, T), Relu, Tanh
    assert len(rc.nodes) == 16 and rc.nodes_created == 10
    assert _keys(rd) == _keys(rc), (
        f"extra {dict(_keys(rd) - _keys(rc))}, missing {dict(_keys(rc) - _keys(rd))}"
    )
    assert len(rd.edges) == len(rc.edges)
    assert rd.nodes_created == rc.nodes_created == rd.nodes_created_seen
    _walk_check(rd, [dirty["loss"]], dirty["_m0"], dirty["_m1"])
    # what the block saved is the same step's
    assert sorted((s.attribute, s.shape, s.kind) for s in rd.saved) == sorted(
        (s.attribute, s.shape, s.kind) for s in rc.saved)
    if memory != "off":
        assert rd.peak_bytes == rc.peak_bytes
    assert no_gradscope_left() == []


# -------------------------------------------------------- 2. graphs held only by user objects
# Each model keeps, inside its forward, a result that the loss does not use, in a user object.
_HOLDER_SETUP = """
import dataclasses
import torch, gradscope as gs
from torch import nn
torch.manual_seed(0)
D, H, N, W = {d}, {h}, {n}, {w}
_marker = torch._C._autograd._get_sequence_nr
class Cache:
    def __init__(self):
        self.k = []
        self.layers = [[], []]
        self.d = {{}}
        self.inner = None
class Inner:
    def __init__(self, t):
        self.k = t
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 2 * H)
        self.out = nn.Linear(H, 1)
    def forward(self, x, cache):
        k, v = self.proj(x).chunk(2, dim=-1)
        kept = k[:, -W:]  # a sliding window: a SliceBackward0 only the holder reaches
{keep}
        logits = self.out(torch.relu(v))
        return {ret}
net = Net()
cache = Cache()
x = torch.randn(N, D)
"""
# how the forward keeps ``kept`` (every step's stays alive); what it returns; the block's loss; the
# holder's tensors after the block (``_steps``: each step's (loss, output))
_KEEP = {
    "attr_list": ("cache.k.append(kept)", "logits", "o.pow(2).mean()", "list(cache.k)"),
    "attr_list_views": ("cache.k.append(kept); cache.k.append(kept.t() * 2)", "logits",
                        "o.pow(2).mean()", "list(cache.k)"),
    "dataclass": ("pass", "Out(logits, kept.sum(-1))", "o.logits.pow(2).mean()",
                  "[o_.aux for _, o_ in _steps]"),
    "nested_list_attr": ("cache.layers[len(cache.k) % 2].append([kept, kept.exp()]); cache.k.append(None)",
                         "logits", "o.pow(2).mean()",
                         "[t for layer in cache.layers for pair in layer for t in pair]"),
    "dict_attr": ("cache.d[len(cache.d)] = kept.tanh()", "logits", "o.pow(2).mean()", "list(cache.d.values())"),
    "growing_attr_of_attr": ("cache.inner = Inner(kept * 3 if cache.inner is None "
                             "else torch.cat([cache.inner.k, kept * 3]))",
                             "logits", "o.pow(2).mean()", "[cache.inner.k]"),
    "module_attr": ("self.kept = getattr(self, 'kept', ()) + (kept.sigmoid(),)", "logits", "o.pow(2).mean()",
                    "list(net.kept)"),
    "objects_in_list": ("cache.k.append(Inner(kept.cos()))", "logits", "o.pow(2).mean()",
                        "[i.k for i in cache.k]"),
}


def _holder_cell(keep: str, d: int, h: int, n: int, w: int) -> tuple[str, str, str]:
    stmt, ret, loss, held = _KEEP[keep]
    setup = _HOLDER_SETUP.format(d=d, h=h, n=n, w=w, keep=_indent(stmt, " " * 8), ret=ret)
    return setup, loss, held


HOLDER_CASES = _variants({"keep": list(_KEEP), "mode": _MODES, "steps": [1, 2, 3],
                          "size": [(6, 8, 4, 2), (16, 32, 8, 3), (4, 4, 3, 1)], "backward": [True, False]},
                         16, seed=2)


@pytest.mark.parametrize("case", HOLDER_CASES, ids=[_case_id(c) for c in HOLDER_CASES])
def test_nodes_held_only_by_user_objects_are_recorded(case: tuple[Any, ...]) -> None:
    keep, (memory, budget), steps, (d, h, n, w), backward = case
    setup, loss, held = _holder_cell(keep, d, h, n, w)
    body = (f"o = net(x, cache)\nloss = {loss}\n" + ("loss.backward()\n" if backward else "")
            + "_steps.append((loss, o))\n")
    cell = (
        setup + "_steps = []\n"
        f"with gs.record({_record_args(memory, budget)}) as rec:\n"
        + _indent("_m0 = _marker()\n" + f"for _ in range({steps}):\n" + _indent(body) + "_m1 = _marker()\n")
        + f"_held = {held}\n"
    )
    ns = _run(cell)
    r = ns["rec"].recording
    assert r.complete
    assert len(ns["_held"]) >= 1 and all(t.grad_fn is not None for t in ns["_held"])
    _walk_check(r, [t for t, _ in ns["_steps"]] + ns["_held"], ns["_m0"], ns["_m1"])
    # each step kept a window (one node; two on torch 2.6); exact: the walk above
    assert [n_.name for n_ in r.nodes].count("SliceBackward0") >= steps
    assert no_gradscope_left() == []


def test_a_kv_cache_of_slices_is_recorded_whole() -> None:
    """The shape of the case that was missed (a KV cache keeping four SliceBackward0 nodes):
    four layers, each appending a window of its keys to the cache's list."""

    class KV:
        def __init__(self) -> None:
            self.k: list[torch.Tensor] = []

    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 16) for _ in range(4))
    head = nn.Linear(8, 1)
    x = torch.randn(5, 8)
    cache = KV()

    def forward(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            k, v = layer(h).chunk(2, dim=-1)
            cache.k.append(k[-2:])
            h = torch.relu(v) + h
        return head(h)

    with gs.record(memory="off") as rec:
        m0 = torch._C._autograd._get_sequence_nr()
        loss = forward(x).pow(2).mean()
        loss.backward()
        m1 = torch._C._autograd._get_sequence_nr()
    r = rec.recording
    assert r is not None
    assert [n.name for n in r.nodes].count("SliceBackward0") == 4
    _walk_check(r, [loss, *cache.k], m0, m1)


# ----------------------------------------------------------------- 3. errors caught in the block
class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a custom backward that fails")


def _mlp(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), torch.randn(4, 8)


def _failing_call(kind: str, model: nn.Module, x: torch.Tensor) -> None:
    """One call into the engine that raises inside it."""
    if kind == "input_without_grad":
        torch.autograd.grad(model(x).sum(), [x])
    elif kind == "second_backward":
        loss = model(x).pow(2).sum()
        torch.autograd.grad(loss, list(model.parameters()))
        torch.autograd.grad(loss, list(model.parameters()))  # the saves were freed: raises
    elif kind == "custom_backward":
        _Fails.apply(model(x)).sum().backward()
    elif kind == "tensor_hook":
        h = model[0](x)
        h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a hook that fails")))
        model[2](torch.relu(h)).sum().backward()
    elif kind == "unused_input":
        w = torch.ones(3, requires_grad=True)
        torch.autograd.grad(model(x).sum(), [model[0].weight, w])
    else:
        raise AssertionError(kind)


# how many successful calls precede the failing one inside _failing_call
_CALLS_BEFORE = {"second_backward": 1}
ERROR_CASES = _variants({"kind": ["input_without_grad", "second_backward", "custom_backward", "tensor_hook",
                                  "unused_input"], "mode": _MODES, "repeat": [1, 2, 4]}, 12, seed=3)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[_case_id(c) for c in ERROR_CASES])
def test_backward_errors_caught_in_the_block_are_listed(case: tuple[Any, ...]) -> None:
    kind, (memory, budget), repeat = case
    model, x = _mlp()
    ref_model, _ = _mlp()
    ref_model(x).pow(2).mean().backward()  # the unrecorded reference for the final step
    messages: list[str] = []
    with gs.record(memory=memory, budget=budget) as rec:
        for _ in range(repeat):
            try:
                _failing_call(kind, model, x)
            except RuntimeError as e:
                messages.append(str(e))
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
    assert len(messages) == repeat
    assert no_gradscope_left() == []
    r = rec.recording
    assert r is not None and r.complete and r.error is None  # the block completed
    calls = r.backward_calls
    before = _CALLS_BEFORE.get(kind, 0)
    assert len(calls) == repeat * (before + 1) + 1
    assert all(hasattr(c, "error") for c in calls), "gs.BackwardCall has no field `error` yet"
    errors = [getattr(c, "error", None) for c in calls]
    expected: list[str | None] = []
    for m in messages:
        expected += [None] * before + [m]
    expected.append(None)
    assert [e is None for e in errors] == [e is None for e in expected]
    for got, want in zip(errors, expected, strict=True):
        if want is not None:
            assert got is not None and want.splitlines()[0] in got
    assert not any(getattr(c, "oom", False) for c in calls)
    # the final step recorded as in a clean block, with the gradients of an unrecorded run
    last = calls[-1]
    assert last.api == "backward" and last.error is None and len(last.accumulated) == 4
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _attempt(model: nn.Module, n: int, d: int) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(n)
    loss = model(torch.randn(n, d)).pow(2).mean()
    loss.backward()


def _forward_peak(model: nn.Module, n: int, d: int) -> int:
    keep: list[torch.Tensor] = []

    def fwd() -> None:
        torch.manual_seed(n)
        keep.append(model(torch.randn(n, d)).pow(2).mean())

    peak = profiler_peak(fwd)
    keep.clear()
    return peak


OOM_CASES = [
    ("small-big-small", [4, 64, 4]),
    ("big-first", [64, 4, 4]),
    ("big-twice", [64, 64, 4]),
    ("alternating", [4, 64, 4, 64, 4]),
    ("small-only-then-big", [4, 4, 4, 64]),
    ("huge-in-forward", [4, 1024, 64, 4]),
]


@pytest.mark.parametrize("name,sizes", OOM_CASES, ids=[c[0] for c in OOM_CASES])
def test_out_of_memory_caught_under_a_budget(name: str, sizes: list[int]) -> None:
    """``except torch.OutOfMemoryError`` around steps under ``gs.record(budget=...)``: which
    steps fail is predicted from PyTorch's own allocation events of each step alone (the
    profiler, not gradscope): a budget between the big step's forward peak and its whole peak
    fails it in backward; one below a huge step's forward peak fails that in forward."""
    torch.manual_seed(0)
    d = 16
    model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model.zero_grad(set_to_none=True)
    peak = {n: profiler_peak(lambda n=n: _attempt(model, n, d)) for n in (4, 64, 1024)}
    fwd = {n: _forward_peak(model, n, d) for n in (4, 64, 1024)}
    budget = (fwd[64] + peak[64]) // 2
    assert peak[4] < budget - 512 and fwd[64] < budget - 512 < budget + 512 < peak[64] and fwd[1024] > budget
    failed: list[int] = []
    with gs.record(budget=budget) as rec:
        for i, n in enumerate(sizes):
            try:
                _attempt(model, n, d)
            except torch.OutOfMemoryError as e:
                assert isinstance(e, gs.MemoryBudgetExceeded)
                failed.append(i)
    assert no_gradscope_left() == []
    assert failed == [i for i, n in enumerate(sizes) if n >= 64]
    r = rec.recording
    assert r is not None and r.complete and r.error is None
    calls = r.backward_calls
    # every step reaches backward except the one that fails in forward
    in_backward = [n for n in sizes if n < 1024]
    assert len(calls) == len(in_backward)
    assert all(hasattr(c, "error") for c in calls), "gs.BackwardCall has no field `error` yet"
    for c, n in zip(calls, in_backward, strict=True):
        err = getattr(c, "error", None)
        if n == 64:
            assert err is not None and "MemoryBudgetExceeded" in err
            if hasattr(c, "oom"):
                assert c.oom
        else:
            assert err is None
            assert not getattr(c, "oom", False)
            assert len(c.accumulated) == 6
    # the last step succeeded with the same gradients as an unrecorded run
    ref = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    ref.load_state_dict(model.state_dict())
    if sizes[-1] < 64:
        _attempt(ref, sizes[-1], d)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


class _Raises(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == 3:
            raise ValueError("a forward that fails on batches of 3")
        return t


def _forward_error_model(where: str) -> nn.Module:
    torch.manual_seed(0)
    if where == "first_layer":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if where == "middle":
        return nn.Sequential(nn.Linear(8, 16), _Raises(), nn.ReLU(), nn.Linear(16, 1))
    if where == "nested":
        return nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Sequential(_Raises())),
                             nn.Linear(16, 1))
    if where == "last":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), _Raises())
    raise AssertionError(where)


FORWARD_ERROR_CASES = _variants({"where": ["first_layer", "middle", "nested", "last"], "mode": _MODES,
                                 "repeat": [1, 3]}, 10, seed=4)


@pytest.mark.parametrize("case", FORWARD_ERROR_CASES, ids=[_case_id(c) for c in FORWARD_ERROR_CASES])
def test_forward_errors_caught_in_the_block_leave_the_next_step_intact(case: tuple[Any, ...]) -> None:
    where, (memory, budget), repeat = case

    def bad_input() -> torch.Tensor:
        return torch.randn(4, 9) if where == "first_layer" else torch.randn(3, 8)

    model = _forward_error_model(where)
    x = torch.randn(4, 8)
    with gs.record(memory=memory, budget=budget) as clean:
        model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    raised = 0
    with gs.record(memory=memory, budget=budget) as rec:
        for _ in range(repeat):
            try:
                model(bad_input())
            except (RuntimeError, ValueError):
                raised += 1
        model(x).pow(2).mean().backward()
    assert raised == repeat
    assert no_gradscope_left() == []
    rc, r = clean.recording, rec.recording
    assert rc is not None and r is not None and r.complete
    # the module that raised was left: the next step's nodes are named as in a clean block; the
    # calls that raised made nodes and saved before raising (PyTorch saves an op's inputs before it
    # runs): their saves are on unseen nodes (see NOTE [ saves of nodes never walked ] in
    # gradscope._passes), at most one a layer (three), in the modules called
    walked = collections.Counter({k: v for k, v in _keys(r).items() if k[0] != UNSEEN_NODE})
    assert walked == _keys(rc), f"extra {dict(walked - _keys(rc))}, missing {dict(_keys(rc) - walked)}"
    unseen = [n for n in r.nodes if n.name == UNSEEN_NODE]
    assert len(unseen) <= repeat * 3 and all(n.module is not None and n.module.startswith("model") for n in unseen)
    assert r.nodes_created_seen == rc.nodes_created_seen


# ------------------------------------------------------ 4. a profiler or dispatch mode of the user's

def _cache_net() -> tuple[Any, torch.Tensor]:
    ns = _run(_holder_cell("attr_list", 6, 8, 4, 2)[0])
    net, cache = ns["net"], ns["Cache"]()

    def step() -> None:
        net.zero_grad(set_to_none=True)
        net(ns["x"], cache).pow(2).mean().backward()

    return step, ns["x"]


def _mlp_step(size: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(size, 2 * size), nn.ReLU(), nn.Linear(2 * size, 1))
    x = torch.randn(4, size)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    return step


def _step(which: str) -> Any:
    return _cache_net()[0] if which == "cache_net" else _mlp_step(int(which.split("_")[1]))


DISPATCH_CASES = _variants({"model": ["mlp_8", "mlp_32", "cache_net"], "mode": _MODES,
                            "where": ["inside", "around"]}, 10, seed=5)


DETACH = "aten.detach.default"


def _same(t: Any) -> Any:
    return t


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=[_case_id(c) for c in DISPATCH_CASES])
def test_a_users_dispatch_mode_sees_the_same_ops(case: tuple[Any, ...]) -> None:
    """Under the block, the user's dispatch mode sees exactly the ops of the same step under a
    bare identity pair of saved-tensor hooks (what any pair makes PyTorch do is PyTorch's)."""
    which, (memory, budget), where = case
    step = _step(which)
    step()  # a first run: lazily made state (AccumulateGrad nodes, caches) exists in both runs
    with OpLog() as plain:
        step()
    # PyTorch's, with any pair of saved-tensor hooks (here a bare pair that detaches what requires
    # grad, as gradscope's keeps it): a saved input is detached before its pack hook sees it, and
    # on older torch an unpacked save is detached again. Only detaches may differ from the plain
    # run; under the block, no more of them than under the bare pair.
    with torch.autograd.graph.saved_tensors_hooks(_detached, _same), OpLog() as ref:
        step()
    pytorchs = collections.Counter(ref.ops) - collections.Counter(plain.ops)
    assert set(pytorchs) <= {DETACH}, pytorchs
    assert not collections.Counter(plain.ops) - collections.Counter(ref.ops)
    rec = gs.record(memory=memory, budget=budget)
    log = OpLog()
    if where == "inside":
        with rec, log:
            step()
    else:
        with log, rec:
            step()
    assert no_gradscope_left() == []
    assert rec.recording is not None and rec.recording.complete
    assert log.ops.count(DETACH) <= ref.ops.count(DETACH)
    got, want = [o for o in log.ops if o != DETACH], [o for o in plain.ops if o != DETACH]
    extra = collections.Counter(got) - collections.Counter(want)
    missing = collections.Counter(want) - collections.Counter(got)
    assert got == want, f"ops gradscope added: {dict(extra)}; ops the user's mode missed: {dict(missing)}"


def _aten_counts(prof: Any) -> collections.Counter[str]:
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


PROFILER_AROUND_CASES = _variants({"model": ["mlp_8", "mlp_32", "cache_net"], "mode": _MODES,
                                   "profile_memory": [False, True], "record_shapes": [False, True]}, 10, seed=6)


@pytest.mark.parametrize("case", PROFILER_AROUND_CASES, ids=[_case_id(c) for c in PROFILER_AROUND_CASES])
def test_a_users_profiler_around_the_block(case: tuple[Any, ...]) -> None:
    """The user's profiler keeps recording the block's ops; with ``memory='cpu'`` (which needs
    the one profiler session) the block is refused up front with a GradscopeError that names
    the modes that work, and nothing is left behind."""
    which, (memory, budget), profile_memory, record_shapes = case
    step = _step(which)
    step()
    with gs.record(memory=memory, budget=budget) as alone:
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=profile_memory,
                 record_shapes=record_shapes) as p0:
        step()
    ref = _aten_counts(p0)
    rec = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=profile_memory,
                 record_shapes=record_shapes) as p1:
        if memory == "cpu":
            with pytest.raises(gs.GradscopeError, match="memory='tracker'"):
                with gs.record(memory=memory, budget=budget):
                    pass
            step()
        else:
            with gs.record(memory=memory, budget=budget) as rec:
                step()
    assert no_gradscope_left() == []
    got = _aten_counts(p1)
    short = {op: (ref[op], got[op]) for op in ref if got[op] < ref[op]}
    assert not short, f"the user's profiler missed ops (reference, recorded): {short}"
    if rec is not None:
        r, ra = rec.recording, alone.recording
        assert r is not None and ra is not None and r.complete
        assert _keys(r) == _keys(ra)
        assert r.peak_bytes == ra.peak_bytes


def _itt() -> Any:
    return torch.autograd.profiler.emit_itt()


_INNER_PROFILERS = {
    "profile": lambda: profile(activities=[ProfilerActivity.CPU]),
    "profile_memory": lambda: profile(activities=[ProfilerActivity.CPU], profile_memory=True),
    "autograd_profile": lambda: torch.autograd.profiler.profile(),
    "emit_itt": _itt,
    "profile_shapes": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True),
}


@pytest.mark.parametrize("inner", list(_INNER_PROFILERS))
def test_a_users_profiler_inside_a_cpu_block(inner: str) -> None:
    """A profiler the user starts inside a ``memory='cpu'`` block (which runs PyTorch's one
    profiler session) starts or fails; either way the block completes, its recording does not
    claim a peak it did not see, and later recordings and profilers work."""
    step = _mlp_step(8)
    step()
    expected = profiler_peak(step)
    inner_error = None
    with gs.record(memory="cpu") as rec:
        step()
        try:
            with _INNER_PROFILERS[inner]():
                step()
        except RuntimeError as e:
            inner_error = str(e)
        step()
    r = rec.recording
    assert r is not None and r.complete
    # its peak is the steps' peak, or the recording says the profiler's events were cut short
    assert r.peak_bytes == expected or any("profiler" in note for note in r.notes), (
        f"peak {r.peak_bytes} B against {expected} B, notes {r.notes}, inner profiler error {inner_error!r}"
    )
    assert no_gradscope_left() == [], f"left behind after an inner profiler ({inner_error!r})"
    with gs.record(memory="cpu") as later:
        step()
    assert later.recording is not None and later.recording.peak_bytes == expected
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    assert _aten_counts(p)["aten::addmm"] == 2


# --------------------------------------------------------------------------------- 5. IPython
def _shell() -> Any:
    shell = globalipapp.get_ipython()
    return shell if shell is not None else globalipapp.get_ipython()


@pytest.fixture
def ip() -> Iterator[Any]:
    shell = _shell()
    before = {k: v for k, v in shell.user_ns.items()}
    shell.run_line_magic("load_ext", "gradscope")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "gradscope")
        # the user namespace as it was: the cells' variables go, the names they replaced come back
        for name in [k for k in shell.user_ns if k not in before]:
            del shell.user_ns[name]
        shell.user_ns.update(before)


def _cells(ip: Any, *cells: str) -> None:
    for c in cells:
        res = ip.run_cell(c)
        assert res.error_in_exec is None and res.error_before_exec is None, c


IP_LEFTOVER_CASES = _variants({"kinds": _KINDS, "mode": ["off", "cpu", "tracker"], "k": [1, 2],
                               "holder": ["globals", "dict", "list", "dict_of_lists"]}, 8, seed=7)


@pytest.mark.parametrize("case", IP_LEFTOVER_CASES, ids=[_case_id(c) for c in IP_LEFTOVER_CASES])
def test_ipython_cell_after_cells_that_left_graphs(ip: Any, case: tuple[Any, ...], capsys: Any) -> None:
    kinds, memory, k, holder = case
    setup = _SETUP.format(d=8, h=16, n=4) + _HELPERS
    clean = _run(setup + _block_cell(memory, None, "", "globals"))["rec"].recording
    _cells(ip, setup, _leftover_cell(kinds, k, holder))
    _cells(ip, f"%%gradscope -o r --memory {memory} --no-widget\n"
           "_m0 = _marker()\n" + _STEP + "_m1 = _marker()\n")
    capsys.readouterr()
    r = ip.user_ns["r"]
    assert isinstance(r, gs.Recording) and r.complete
    assert _keys(r) == _keys(clean), (
        f"extra {dict(_keys(r) - _keys(clean))}, missing {dict(_keys(clean) - _keys(r))}"
    )
    _walk_check(r, [ip.user_ns["loss"]], ip.user_ns["_m0"], ip.user_ns["_m1"])
    if memory != "off":
        assert r.peak_bytes == clean.peak_bytes


IP_HOLDER_CASES = _variants({"keep": list(_KEEP), "mode": ["off", "cpu", "tracker"], "steps": [1, 2]},
                            8, seed=8)


@pytest.mark.parametrize("case", IP_HOLDER_CASES, ids=[_case_id(c) for c in IP_HOLDER_CASES])
def test_ipython_cell_whose_graphs_only_objects_hold(ip: Any, case: tuple[Any, ...], capsys: Any) -> None:
    keep, memory, steps = case
    setup, loss, held = _holder_cell(keep, 6, 8, 4, 2)
    # an earlier cell ran the model once with a cache of its own, still alive
    _cells(ip, setup, "earlier_cache = Cache()\nearlier = net(x, earlier_cache)\nvars(net).pop('kept', None)\n",
           "_steps = []\n")
    body = f"o = net(x, cache)\nloss = {loss}\nloss.backward()\n_steps.append((loss, o))\n"
    _cells(ip, f"%%gradscope -o r --memory {memory} --no-widget\n_m0 = _marker()\n"
           f"for _ in range({steps}):\n" + _indent(body) + "_m1 = _marker()\n")
    capsys.readouterr()
    r = ip.user_ns["r"]
    assert isinstance(r, gs.Recording) and r.complete
    ns = ip.user_ns
    _walk_check(r, [t for t, _ in ns["_steps"]] + ip.ev(held), ns["_m0"], ns["_m1"])
    assert [n.name for n in r.nodes].count("SliceBackward0") >= steps  # exact: the walk above


ERROR_CELL_CASES = _variants({"kind": ["input_without_grad", "second_backward", "custom_backward",
                                       "unused_input"], "mode": ["off", "cpu", "tracker"],
                              "repeat": [1, 2]}, 6, seed=9)


@pytest.mark.parametrize("case", ERROR_CELL_CASES, ids=[_case_id(c) for c in ERROR_CELL_CASES])
def test_ipython_cell_that_catches_backward_errors(ip: Any, case: tuple[Any, ...], capsys: Any) -> None:
    kind, memory, repeat = case
    body = ("messages = []\n"
            f"for _ in range({repeat}):\n"
            f"    try:\n        _failing_call({kind!r}, model, x)\n"
            "    except RuntimeError as e:\n        messages.append(str(e))\n"
            "model.zero_grad(set_to_none=True)\nloss = model(x).pow(2).mean()\nloss.backward()\n")
    # the same cell recorded in a clean namespace
    clean_ns = _run("model, x = _mlp()\n"
                    f"with gs.record(memory={memory!r}) as rec:\n" + _indent(body),
                    {"_mlp": _mlp, "_failing_call": _failing_call, "gs": gs})
    clean = clean_ns["rec"].recording
    ip.user_ns["_failing_call"] = _failing_call
    ip.user_ns["_mlp"] = _mlp
    _cells(ip, "model, x = _mlp()\nout = model(x)\n")  # an earlier cell's graph, alive
    _cells(ip, f"%%gradscope -o r --memory {memory} --no-widget\n" + body)
    capsys.readouterr()
    r = ip.user_ns["r"]
    messages = ip.user_ns["messages"]
    assert isinstance(r, gs.Recording) and r.complete and len(messages) == repeat
    assert no_gradscope_left() == []
    assert _keys(r) == _keys(clean), f"extra {dict(_keys(r) - _keys(clean))}, missing {dict(_keys(clean) - _keys(r))}"
    calls = r.backward_calls
    assert all(hasattr(c, "error") for c in calls), "gs.BackwardCall has no field `error` yet"
    failed = [getattr(c, "error", None) for c in calls if getattr(c, "error", None) is not None]
    assert len(failed) == repeat
    assert all(m.splitlines()[0] in e for m, e in zip(messages, failed, strict=True))
    assert [c.error is None for c in calls] == [c.error is None for c in clean.backward_calls]
    assert calls[-1].error is None and len(calls[-1].accumulated) == 4

