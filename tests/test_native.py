"""gradscope's compiled saved-tensor hooks and graph walk (see NOTE [ compiled hooks ] and NOTE
[ compiled walk ] in gradscope._capture.native): the same rows, events, frees, graph rows and recordings as
the Python pair and walk, on the graphs users write; the build, its cache and its failure paths."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope._base.trace import S_PTR, S_SEQ, S_SKEY, S_T
from gradscope._capture import native as _native

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(
    COMPILER is None or os.environ.get("GRADSCOPE_NATIVE") == "0",
    reason="no C++ compiler here (or GRADSCOPE_NATIVE=0): the Python hooks record",
)


def _tanh_chain() -> None:
    x = torch.randn(16, requires_grad=True)
    y = x
    for _ in range(50):
        y = y.tanh()
    y.sum().backward()


def _shared_storage() -> None:  # y saved by exp (its output), by mul twice, by the last mul
    x = torch.randn(64, requires_grad=True)
    y = x.exp()
    (((y * y).sin()) * y).sum().backward()


def _lstm_loop() -> None:  # a user's RNN loop; parameters saved by every step
    torch.manual_seed(0)
    cell, xs = nn.LSTMCell(4, 8), torch.randn(6, 2, 4)
    h = c = torch.zeros(2, 8)
    out = []
    for t in range(6):
        h, c = cell(xs[t], (h, c))
        out.append(h)
    torch.stack(out).pow(2).mean().backward()


def _views() -> None:  # saves that are views of a bigger storage (the storage's bytes count)
    x = torch.randn(8, 8, requires_grad=True)
    big = x * 2
    (big[2:4].exp() * big[:, 1].sum()).sum().backward()


def _sparse() -> None:  # a sparse save has no storage of its own: the Python pack hook reads it
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    s = torch.sparse_coo_tensor(i, torch.randn(3), (3, 3)).coalesce()
    w = torch.randn(3, 4, requires_grad=True)
    torch.sparse.mm(s, w).pow(2).sum().backward()


class _Sub(torch.Tensor):  # a subclass: its methods could be overridden, the Python hook reads it
    pass


def _subclass() -> None:
    x = torch.randn(5, requires_grad=True)
    (x.as_subclass(_Sub).exp() * 3).sum().backward()


def _unrolled_sgd() -> None:  # seed 002's pattern: create_graph passes, then one through all of them
    torch.manual_seed(0)
    w = torch.randn(4, 1, requires_grad=True)
    lr = torch.tensor(0.1, requires_grad=True)
    x, t = torch.randn(8, 4), torch.randn(8, 1)
    p = w
    for _ in range(3):
        (g,) = torch.autograd.grad(((x @ p - t) ** 2).mean(), p, create_graph=True)
        p = p - lr * g
    ((x @ p - t) ** 2).mean().backward()


class _Clamp(torch.autograd.Function):  # a user's own Function: a custom node, hooked by the walk
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1)


def _model_with_function() -> None:  # parameters by name, a custom Function, a leaf input
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 6, requires_grad=True)
    _Clamp.apply(model(x) * 3).pow(2).sum().backward()


def _hypergradient() -> None:  # seed 002 with a model: functional_call, autograd.grad, then backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    lr = torch.tensor(0.1, requires_grad=True)
    x, t = torch.randn(8, 4), torch.randn(8, 1)
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    for _ in range(3):
        loss = ((torch.func.functional_call(model, params, (x,)) - t) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {k: p - lr * g for (k, p), g in zip(params.items(), grads, strict=True)}
    ((torch.func.functional_call(model, params, (x,)) - t) ** 2).mean().backward()


def _gradient_without_its_own_number() -> None:  # ctc_loss's gradient: a NotImplemented node, numbered as leaves are
    torch.manual_seed(0)
    log_probs = torch.randn(12, 2, 5, dtype=torch.float64).log_softmax(2).detach().requires_grad_()
    targets = torch.randint(1, 5, (2, 4))
    loss = nn.functional.ctc_loss(log_probs, targets, torch.full((2,), 12), torch.full((2,), 4))
    (g,) = torch.autograd.grad(loss, log_probs, create_graph=True)
    assert g.grad_fn is not None and g.grad_fn.name() == "torch::autograd::NotImplemented"


def _gradient_edges() -> None:  # autograd.grad to an intermediate's GradientEdge and to a parameter
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    h = lin(torch.randn(3, 4)).tanh()
    loss = (h * 2).pow(2).sum()
    g_h, g_w = torch.autograd.grad(loss, [torch.autograd.graph.get_gradient_edge(h), lin.weight],
                                   create_graph=True)
    (g_h.pow(2).sum() + g_w.pow(2).sum()).backward()


def _sparse_gradient() -> None:  # a sparse gradient beside a dense one: only the dense one has a storage row
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    w = torch.randn(3, 2, requires_grad=True)
    g_e, g_w = torch.autograd.grad((emb(torch.tensor([1, 2, 1])) @ w).pow(2).sum(), [emb.weight, w])
    assert g_e.is_sparse and not g_w.is_sparse


def _chunks() -> None:  # TBPTT: a backward per chunk, the next chunk's storages at the freed addresses
    torch.manual_seed(0)
    lstm, xs = nn.LSTM(4, 8), torch.randn(9, 2, 4)
    h = None
    for c in range(3):
        out, h = lstm(xs[3 * c:3 * c + 3], h)
        h = tuple(v.detach() for v in h)
        out.pow(2).mean().backward()


class _SavesTwice(torch.autograd.Function):  # one object that needs no grad, saved twice (NOTE [ one object saved twice ])
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        w, w2 = ctx.saved_tensors
        assert w is w2
        return g * w, None


def _saved_twice() -> None:
    x, w = torch.randn(4, requires_grad=True), torch.randn(4)
    (_SavesTwice.apply(x, w) * (x * w)).sum().backward()  # and once more by mul


GRAPHS: dict[str, Callable[[], None]] = {
    "chunks": _chunks, "saved_twice": _saved_twice,
    "tanh_chain": _tanh_chain, "shared": _shared_storage, "lstm_loop": _lstm_loop, "views": _views,
    "sparse": _sparse, "subclass": _subclass, "unrolled_sgd": _unrolled_sgd,
    "model_with_function": _model_with_function, "hypergradient": _hypergradient,
    "gradient_without_its_own_number": _gradient_without_its_own_number, "gradient_edges": _gradient_edges,
    "sparse_gradient": _sparse_gradient,
}


def _graph_rows(trace: Any) -> dict[str, Any]:
    """The walk's rows, made comparable across runs: node numbers from the block's first, leaves'
    keys (their tensors' ids) by first appearance."""
    leaves: dict[Any, int] = {}

    def key(k: Any) -> Any:
        return ("seq", k - trace.seq0) if isinstance(k, int) else ("leaf", leaves.setdefault(k, len(leaves)))

    def edge(k: Any) -> Any:  # a node number, or an AccumulateGrad node's index as -1 - index
        return None if k is None else ("seq", k - trace.seq0) if k >= 0 else ("acc", k)

    return {
        "nodes": [(key(r[0]), "acc" if r[1] != r[0] else None, *r[2:]) for r in trace.nodes],
        "index": sorted((key(k), i) for k, i in trace.node_index.items()),
        "edges": [(edge(k), d) for k, d in zip(trace.edge_keys, trace.edge_dst, strict=True)],
        "seq_attr": sorted((k - trace.seq0, v) for k, v in trace.seq_attr.items()),
        "seq_order": sorted((k - trace.seq0, v) for k, v in trace.seq_order.items()),
        "seq_moves": sorted((k - trace.seq0, v[0] - trace.seq0, v[1]) for k, v in trace.seq_moves.items()),
        "save_attr": sorted(trace.save_attr.items()),
        "counts": (trace.unseen_saves, trace.foreign_saves),
    }


def _capture(step: Callable[[], None], memory: str) -> dict[str, Any]:
    """What a block's hooks wrote (rows made comparable across runs: storages and addresses by
    first appearance, numbers from the block's first), and what its recording says."""
    with gs.record(memory=memory) as rec:
        step()
    trace = rec._block.trace
    keys: dict[int, int] = {}
    ptrs: dict[int, int] = {}
    rows = []
    for row in trace.saves:
        r = list(row)
        r[S_SEQ] = row[S_SEQ] - trace.seq0
        r[S_SKEY] = keys.setdefault(row[S_SKEY], len(keys))
        r[S_PTR] = ptrs.setdefault(row[S_PTR], len(ptrs)) if row[S_PTR] else 0
        r[S_T] = row[S_T] if memory == "off" else row[S_T] > 0  # off: the save's index; else a time
        rows.append(tuple(r))
    events = [(e[0], e[1], e[3] if e[0] == 3 else None) for e in trace.events]  # kind, ident, save freed by
    storages = list(trace.save_storage)  # see NOTE [ a storage's identity in a block ]
    assert len(storages) == len(rows) and all(storages[k] <= k for k in range(len(storages)))
    graph = _graph_rows(trace)
    # the gradients' storage rows: (pass, at the pass's end); their storages are checked while the
    # gradients live (test_gradient_rows_name_the_gradients_storages): here an address a freed
    # storage left may be reused differently by the two runs
    gradients = [(g[0], g[3] == trace.backwards[g[0]].t1_ns) for g in trace.gradient_keys]
    calls = [(c[0], c[1], c[2] - trace.seq0, c[3] - trace.seq0, c[4] <= c[5], *c[6:]) for c in trace.calls]
    r = rec.recording
    return {
        "rows": rows, "storages": storages, "events": events, "notes": sorted(r.notes), "graph": graph,
        "gradients": gradients,
        "calls": calls, "roots": trace.roots, "modules": [n.module for n in r.nodes],
        "nodes": [n.name for n in r.nodes],
        "saved": [(r.nodes[s.node].name, s.attribute, s.shape, s.bytes,
                   None if s.freed_at_step is None else r.steps[s.freed_at_step].node) for s in r.saved],
        "steps": [(r.nodes[s.node].name, r.nodes[s.node].order, s.backward, s.freed_bytes) for s in r.steps],
    }


@pytest.mark.parametrize("name", list(GRAPHS))
def test_compiled_rows_equal_the_python_hooks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row, step event and free the compiled pair writes is the Python pair's, every node and
    edge row and save name of the compiled walk the Python walk's, and so is the recording made
    from them (memory="off": frees by weak handle, checked once a pass; a create_graph pass's pre
    hooks compiled)."""
    step = GRAPHS[name]
    for _ in range(2):  # warm up: node classes learnt, pack orders seen twice (trusted) before both
        _capture(step, "off")  # (a fresh process: see the next test)
    compiled = _capture(step, "off")
    assert compiled["rows"], "the graph saved nothing: the test would compare nothing"
    with monkeypatch.context() as m:
        m.setattr(_native, "hooks", lambda: None)
        python = _capture(step, "off")
    assert compiled == python


@pytest.mark.parametrize("name", ["shared", "lstm_loop", "views"])
def test_compiled_rows_equal_the_python_hooks_with_addresses_and_times(name: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """memory="tracker" and "cpu" rows carry a time (and "cpu" the data address): the same fields."""
    step = GRAPHS[name]
    step()
    for memory in ("tracker", "cpu"):
        compiled = _capture(step, memory)
        with monkeypatch.context() as m:
            m.setattr(_native, "hooks", lambda: None)
            python = _capture(step, memory)
        assert compiled["rows"] == python["rows"], memory
        assert compiled["storages"] == python["storages"], memory
        assert compiled["saved"][:3] and [s[:4] for s in compiled["saved"]] == [s[:4] for s in python["saved"]]
        assert compiled["nodes"] == python["nodes"]
        assert compiled["graph"] == python["graph"], memory  # every node hooked: each has its Python object


@pytest.mark.parametrize("name", ["lstm_loop", "model_with_function", "hypergradient"])
@pytest.mark.parametrize("memory", ["off", "tracker"])
def test_compiled_walk_learns_as_the_python_walk_in_a_fresh_process(name: str, memory: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing learnt yet (node classes, pack orders: as in a new process) the compiled walk
    hands each node it cannot read to the same Python code, and learns the same: the same rows
    on a first and a second block, and the same tables after them."""
    rec_mod = importlib.import_module("gradscope._capture.discover")  # the learnt tables
    step = GRAPHS[name]
    tables = ("_TYPES", "_LISTS", "_ORDERS", "_ORDER_SEEN", "_NO_ORDER")

    def twice() -> tuple[list[dict[str, Any]], list[Any]]:
        for table in tables:
            monkeypatch.setattr(rec_mod, table, type(getattr(rec_mod, table))())
        runs = [_capture(step, memory) for _ in range(2)]
        return runs, [sorted(map(repr, getattr(rec_mod, t))) for t in tables]

    compiled = twice()
    assert compiled[0][0]["graph"]["seq_order"] or compiled[0][0]["graph"]["seq_attr"]
    with monkeypatch.context() as m:
        m.setattr(_native, "hooks", lambda: None)
        python = twice()
    assert compiled == python


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner(x)
        raise ValueError("a user's module failing mid-forward")


@pytest.mark.parametrize("compiled", [True, False])
def test_gradient_rows_name_the_gradients_storages(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's gradient rows (the GRADIENT category) name the storages and addresses of the gradients
    autograd.grad returned (a sparse one has none: no row), or of the .grad of the leaves backward
    accumulated into, read here while they live; the compiled rows and the Python ones alike."""
    if not compiled:
        monkeypatch.setattr(_native, "hooks", lambda: None)
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    w = torch.randn(3, 2, requires_grad=True)
    lr = torch.tensor(0.5, requires_grad=True)
    with gs.record(memory="off") as rec:
        loss = (emb(torch.tensor([1, 2, 1])) @ (w * lr)).pow(2).sum()
        dense = torch.autograd.grad(loss, [w, lr], create_graph=True)
        mixed = torch.autograd.grad((emb(torch.tensor([3])) @ w).sum(), [emb.weight, w])
        (dense[0].sum() * dense[1]).backward()
    assert (rec._block.native is not None) == compiled  # the compiled walk ran (dropped at the block's end)
    trace = rec._block.trace

    def rows(i: int, tensors: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
        return [(i, t.untyped_storage()._cdata, t.untyped_storage().data_ptr(), trace.backwards[i].t1_ns)
                for t in tensors]

    assert mixed[0].is_sparse and w.grad is not None and lr.grad is not None
    assert trace.gradient_keys == rows(0, list(dense)) + rows(1, [mixed[1]]) + rows(2, [w.grad, lr.grad])


def test_compiled_module_hooks_write_the_python_hooks_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ compiled module hooks ]: nested modules, a module called twice, one that raises inside
    a parent's forward (its calls are closed, the stack left clean), the graph roots outputs give:
    the same call rows, root modules and node attribution as the Python hooks."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(block, nn.Linear(4, 4), block)
    failing = nn.Sequential(nn.Linear(4, 4), _Raises())
    x = torch.randn(3, 4)
    used: list[str] = []

    def step() -> None:
        # (the block's own pre hook, behind gradscope's one global pair: NOTE [ one key for module hooks ])
        used.append(type(importlib.import_module("gradscope._capture.modules")._MODULE_HOOKS[-1][0]).__name__)
        out = model(x)
        with pytest.raises(ValueError, match="mid-forward"):
            failing(x)
        (out.sum() + model(x).pow(2).sum()).backward()

    for _ in range(2):  # warm up, as in the graph tests above
        _capture(step, "off")
    used.clear()
    compiled = _capture(step, "off")
    with monkeypatch.context() as m:
        m.setattr(_native, "hooks", lambda: None)
        python = _capture(step, "off")
    assert used == ["function", "method"]  # the compiled pair (behind a compiler test), then the Python one
    # two calls of model (itself, block twice with its two layers, the middle layer), one of failing (4)
    assert len(compiled["calls"]) == 2 * 8 + 4 and [r[0] for r in compiled["roots"]] == ["Sequential"] * 2
    assert compiled == python


def test_compiled_pass_hooks_mark_steps_and_come_off() -> None:
    """NOTE [ compiled pass hooks ]: a create_graph pass's nodes without a save of ours get a C++
    pre hook (their steps are seen: the graph tests above compare them with the Python hooks'),
    and none stays on a node after the pass, nor after a pass that failed."""

    class Spy:  # the recorder's walker, keeping the pass hooks it made (see NOTE [ a pass in two calls ])
        def __init__(self, walker: Any) -> None:
            self.walker, self.made = walker, []

        def __getattr__(self, name: str) -> Any:
            return getattr(self.walker, name)

        def pass_start(self, *args: Any) -> Any:
            started = self.walker.pass_start(*args)
            if started[3] is not None:
                self.made.append((started[3], started[3].attached()))
            return started

    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    with gs.record(memory="off") as rec:
        spy = rec._block.walker = Spy(rec._block.walker)
        loss = (w.exp().sum() - 1) ** 2  # SubBackward0 saves nothing: it needs a pre hook
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        bad = (w.exp() * 2).sum() - 1
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(bad, [w, torch.ones(1)], create_graph=True)
        (g2,) = torch.autograd.grad(g.sum(), w)
    assert len(spy.made) == 2
    assert all(on >= 1 for _, on in spy.made)  # on the nodes while the pass ran
    assert all(hooks.attached() == 0 for hooks, _ in spy.made)  # and off after it, failed or not
    r = rec.recording
    assert "SubBackward0" in [r.nodes[s.node].name for s in r.steps if s.backward == 0]
    x = w.detach().requires_grad_()
    ref = torch.autograd.grad(torch.autograd.grad((x.exp().sum() - 1) ** 2, x, create_graph=True)[0].sum(), x)[0]
    assert torch.allclose(g2, ref) and torch.allclose(g, 2 * (x.exp().sum() - 1) * x.exp())


def test_the_compiled_pair_is_the_one_recording() -> None:
    with gs.record(memory="off") as rec:
        _shared_storage()
    assert _native.status()["compiled"] is True, _native.status()
    assert type(rec._saves.pack).__name__ == "builtin_function_or_method"
    assert rec._saves.pack.__self__ is rec._saves.unpack.__self__
    r = rec.recording
    # exp saves its 64-float output; mul saves y twice, sin its input, the last mul two tensors
    assert r.saved_bytes == 64 * 4 * 3
    x = torch.randn(64, requires_grad=True)
    y = x.exp()
    (((y * y).sin()) * y).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    with gs.record(memory="off"):
        y = x.exp()
        (((y * y).sin()) * y).sum().backward()
    assert torch.equal(x.grad, grad)


def test_inplace_change_of_a_save_is_caught_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ in-place checks ]: the compiled unpack hook raises PyTorch's words as the Python one."""

    def run() -> str:
        x = torch.randn(4, requires_grad=True)
        with gs.record(memory="off"):
            y = x.exp()
            z = (y * 2).sum()
            y.add_(1)
            with pytest.raises(RuntimeError) as info:
                z.backward()
        return str(info.value)

    compiled = run()
    with monkeypatch.context() as m:
        m.setattr(_native, "hooks", lambda: None)
        python = run()
    assert "modified by an inplace operation" in compiled and compiled == python


def test_weak_handles_are_pytorchs_own() -> None:
    """The compiled pack hook's weak handles are those UntypedStorage._weak_ref makes: PyTorch's
    _expired and _free_weak_ref read them (a storage freed shows as expired)."""
    x = torch.randn(8, requires_grad=True)
    with gs.record(memory="off") as rec:
        y = x.exp()
        handle = rec._saves.weak[-1]
        assert handle == y.untyped_storage()._cdata
        assert not torch.UntypedStorage._expired(handle)
        del y
        assert torch.UntypedStorage._expired(handle)  # the graph died with y: its save was freed


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                          timeout=300)


RECORD_AND_SAY = """
    import torch, gradscope as gs
    from gradscope._capture import native as _native
    x = torch.randn(4, requires_grad=True)
    with gs.record(memory="off") as rec:
        x.exp().sum().backward()
    _native.wait()  # a build begun by the block runs in the background
    print(_native.status()["compiled"], _native.status()["reason"], rec.recording.saved_bytes)
"""


def test_without_the_compiled_hooks_the_python_pair_records(tmp_path: Path) -> None:
    off = _run(RECORD_AND_SAY, GRADSCOPE_NATIVE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "GRADSCOPE_NATIVE=0", "16"]
    # a compiler that fails: said in status(), the Python pair records, nothing is cached
    failing = _run(RECORD_AND_SAY, CXX="/bin/false", GRADSCOPE_CACHE=str(tmp_path))
    assert failing.returncode == 0, failing.stderr
    assert failing.stdout.startswith("False could not build the compiled hooks: the C++ compiler failed")
    assert failing.stdout.split()[-1] == "16"
    assert not list((tmp_path / "native").glob("_hooks-*"))
    strict = _run(RECORD_AND_SAY, CXX="/bin/false", GRADSCOPE_CACHE=str(tmp_path), GRADSCOPE_NATIVE="1")
    assert strict.returncode != 0 and "GRADSCOPE_NATIVE=1 but its compiled hooks could not be built" in strict.stderr
    bad = _run(RECORD_AND_SAY, GRADSCOPE_NATIVE="yes")
    assert bad.returncode != 0 and "GRADSCOPE_NATIVE is 0, 1 or auto" in bad.stderr


def test_the_shared_state_has_one_definition() -> None:
    """NOTE [ one definition of the shared state ]: fields.h is fields.py's output, the compiled
    State has the Python _State's fields, and the Walker reads its one argument by those names."""
    from gradscope._capture.native import fields

    assert (Path(fields.__file__).with_name("fields.h")).read_text() == fields.render_header()
    rec_mod = importlib.import_module("gradscope._capture.state")
    native = _native.hooks()
    assert native is not None, _native.status()
    state = rec_mod._new_state(native)
    assert isinstance(state, native.State) and sorted(rec_mod._State.__slots__) == sorted(n for n, _ in fields.STATE)
    for name, _ in fields.STATE:
        assert getattr(state, name) == getattr(rec_mod._State(), name), name
    tables = {name: {} if kind in ("dict", "") else [] if kind == "list" else set() for name, kind, _ in fields.WALKER}
    native.Walker(fields.WalkerTables(**tables))
    with pytest.raises(TypeError, match="Walker's nodes must be a list"):
        native.Walker(fields.WalkerTables(**{**tables, "nodes": {}}))
    with pytest.raises(TypeError, match="exactly the fields"):
        fields.WalkerTables(**{k: v for k, v in tables.items() if k != "hook"})


def test_a_build_is_keyed_by_the_sources_bytes_not_where_they_are() -> None:
    """Two checkouts (or a checkout and a wheel's install) of the same sources share one build; a
    different flag does not."""
    settings = _native._settings()
    here = _native._target(settings)
    elsewhere = dict(settings, sources=[f"/elsewhere/gradscope/_native/{Path(p).name}" for p in settings["sources"]])
    assert _native._target(elsewhere) == here
    assert _native._target(dict(settings, cflags=[*settings["cflags"], "-DGRADSCOPE_OTHER"])) != here
