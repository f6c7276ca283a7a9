"""A backward call that raises inside the block leaves a trace: its error, whether it was an
out-of-memory, and the steps it ran before failing (see NOTE [ a backward that raised ] in
gradscope._passes).

Each case runs twice: once recorded, once unrecorded with a pre and a post hook on every node
(the independent truth: which nodes started, which finished, in order, and the exception's text).
Each runs with the failure caught inside the block (the block then completes and runs one more
backward) and not caught (the block raises)."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_gradscope_left

import gradscope as gs
from gradscope.recording import BackwardCall, Category, Recording

grec = importlib.import_module("gradscope._capture.record")
DATA = Path(__file__).parent / "data"
MEMORY = ["off", "cpu", "tracker"]
Env = dict[str, Any]


class Boom(torch.autograd.Function):
    """Doubles its input; its backward raises (midway through a pass: nodes run before it and
    others wait after it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in a custom backward")


# ------------------------------------------------------------------ the cases
@dataclass
class Case:
    """``setup`` makes the leaves (outside the block); each call is (make: its forward, inside
    the block, returning the outputs it differentiates; run: the call into the engine). The
    last call raises ``exc``. ``fails_at``: the node where a budget is crossed (the unrecorded
    run has no budget, so its truth ends there)."""

    setup: Callable[[], Env]
    calls: list[tuple[Callable[[Env], list[torch.Tensor]], Callable[[Env, list[torch.Tensor]], Any]]]
    exc: type[BaseException]
    api: str = "backward"  # the failing call's engine entry
    budget: int | None = None
    fails_at: Any = None  # a node's label (see _label)


def _small() -> Env:
    torch.manual_seed(0)
    return {"w": torch.randn(3, 4, requires_grad=True), "b": torch.randn(4, requires_grad=True),
            "x": torch.randn(2, 3), "u": torch.randn(5, requires_grad=True)}


def _mlp_loss(env: Env) -> list[torch.Tensor]:
    env["loss"] = ((env["x"] @ env["w"]).tanh() + env["b"]).sin().sum()
    return [env["loss"]]


def _boom_loss(env: Env) -> list[torch.Tensor]:
    env["loss"] = (Boom.apply((env["x"] @ env["w"]).tanh()) * env["b"]).sin().sum()
    return [env["loss"]]


def _big() -> Env:
    torch.manual_seed(0)
    return {"x": torch.randn(256 * 1024, requires_grad=True), "w": torch.randn(3, requires_grad=True)}


CASES: dict[str, Case] = {
    # the engine refuses before any node runs
    "grad_of_input_without_grad": Case(
        _small, [(_mlp_loss, lambda env, out: torch.autograd.grad(out, [env["w"], env["x"]]))], RuntimeError, api="autograd.grad"),
    "grad_of_constant": Case(
        _small, [(lambda env: [env["x"].sum()], lambda env, out: torch.autograd.grad(out, [env["w"]]))],
        RuntimeError, api="autograd.grad"),
    # the engine runs every node, then refuses (an input the graph never used)
    "unused_input": Case(
        _small, [(_mlp_loss, lambda env, out: torch.autograd.grad(out, [env["w"], env["u"]]))], RuntimeError, api="autograd.grad"),
    # a second backward through freed saves: the first node that unpacks one raises
    "backward_twice": Case(
        _small, [(_mlp_loss, lambda env, out: out[0].backward()),
                 (lambda env: [env["loss"]], lambda env, out: out[0].backward())], RuntimeError),
    # a custom Function's backward raises midway
    "custom_backward": Case(_small, [(_boom_loss, lambda env, out: out[0].backward())], ValueError),
    "custom_backward_create_graph": Case(
        _small, [(_boom_loss, lambda env, out: torch.autograd.grad(out, [env["w"], env["b"]], create_graph=True))],
        ValueError, api="autograd.grad"),
    # a simulated device too small: MeanBackward0 makes a 1 MiB gradient (all else is bytes)
    "budget_in_node": Case(
        _big, [(lambda env: [((env["x"].mean() * env["w"]).sin().sum())], lambda env, out: out[0].backward())],
        gs.MemoryBudgetExceeded, budget=512 * 1024, fails_at="MeanBackward0"),
    # SumBackward0's gradient is an expanded view: AccumulateGrad makes the 1 MiB .grad
    "budget_in_accumulate": Case(
        _big, [(lambda env: [((env["x"].sum() * env["w"]).sin().sum())], lambda env, out: out[0].backward())],
        gs.MemoryBudgetExceeded, budget=512 * 1024, fails_at=("AccumulateGrad", (256 * 1024,))),
}


def _after(env: Env) -> list[torch.Tensor]:
    """A backward after the failure, caught inside the block."""
    env["after"] = (env["w"] * 3).sum()
    return [env["after"]]


def _run_after(env: Env, out: list[torch.Tensor]) -> Any:
    return out[0].backward()


# ------------------------------------------------------------------ the independent truth
@dataclass
class Truth:
    """Per call: labels of the nodes that started and that finished, in order; the error's
    text; for memory='off', whether each started node is one it sees run."""

    started: list[list[Any]] = field(default_factory=list)
    finished: list[list[Any]] = field(default_factory=list)
    seen: list[list[bool]] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    api: list[str] = field(default_factory=list)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def _label(fn: Any) -> Any:
    """A node's name; an AccumulateGrad's also names its leaf by shape (the cases' leaves differ)."""
    name = type(fn).__name__
    return (name, tuple(fn.variable.shape)) if name == "AccumulateGrad" else name


def _saves_tensors(fn: Any) -> bool:
    for a in dir(fn):
        if a.startswith("_saved_"):
            v = getattr(fn, a)
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple | list) and any(
                    isinstance(t, torch.Tensor) for t in v)):
                return True
    return False


def _truth(case: Case, calls: list[Any]) -> Truth:
    """The unrecorded run, hooking every node (iterative walk) before each call."""
    env = case.setup()
    truth = Truth()
    # node -> (label, seen by memory='off' when it starts, saves tensors); keeps the nodes alive
    hooked: dict[Any, tuple[Any, bool, bool]] = {}
    handles: list[Any] = []  # removed at the end: a hook holding its node is a cycle left to the collector
    current = [0]

    def watch(outputs: list[torch.Tensor]) -> None:
        stack: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in hooked:
                continue
            custom = isinstance(fn, torch.autograd.function.BackwardCFunction)
            hooked[fn] = (_label(fn), custom or type(fn).__name__ == "AccumulateGrad", _saves_tensors(fn))
            handles.append(fn.register_prehook(lambda g, fn=fn: truth.started[current[0]].append(fn)))
            handles.append(fn.register_hook(lambda gi, go, fn=fn: truth.finished[current[0]].append(fn)))
            stack.extend(n for n, _ in fn.next_functions)

    for k, (make, run) in enumerate(calls):
        current[0] = k
        truth.started.append([])
        truth.finished.append([])
        outputs = make(env)
        watch(outputs)
        error = None
        try:
            run(env, outputs)
        except case.exc as e:
            error = f"{type(e).__name__}: {e}"
        started, finished = truth.started[k], truth.finished[k]
        if case.fails_at is not None and k == len(case.calls) - 1:
            cut = [hooked[fn][0] for fn in started].index(case.fails_at)
            del started[cut + 1:]
            finished[:] = [fn for fn in finished if any(fn is s for s in started[:cut])]
            error = "MemoryBudgetExceeded"  # the text is checked against the caught exception
        # memory='off' sees a node run when it is hooked (custom, AccumulateGrad) or unpacks one
        # of the saves of ours, which a node that finished has done
        truth.seen.append([hooked[fn][1] or (hooked[fn][2] and any(fn is f for f in finished))
                           for fn in started])
        truth.started[k] = [hooked[fn][0] for fn in started]
        truth.finished[k] = [hooked[fn][0] for fn in finished]
        truth.errors.append(error)
    truth.grads = {k: (v.grad.clone() if v.grad is not None else None)
                   for k, v in env.items() if isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad}
    for h in handles:
        h.remove()
    hooked.clear()
    return truth


def _expected_steps(truth: Truth, k: int, memory: str) -> list[Any]:
    """The steps call ``k`` shows: every node that started; with memory='off', for a call that
    raised, up to the last one it saw run."""
    started = truth.started[k]
    if memory != "off" or truth.errors[k] is None:
        return started
    seen = [i for i, s in enumerate(truth.seen[k]) if s]
    return started[: seen[-1] + 1] if seen else []


# ------------------------------------------------------------------ the recorded run
def _recorded(case: Case, memory: str, caught: bool) -> tuple[Recording, Env, str, Any]:
    """Returns the recording, the leaves, the failing exception's text and a weak reference to
    the recorder."""
    env = case.setup()
    text = ""
    if caught:
        with gs.record(memory=memory, budget=case.budget) as rec:
            for k, (make, run) in enumerate(case.calls):
                out = make(env)
                if k < len(case.calls) - 1:
                    run(env, out)
                    continue
                with pytest.raises(case.exc) as info:
                    run(env, out)
                text = f"{type(info.value).__name__}: {info.value}"
                del info
            _run_after(env, _after(env))
    else:
        with pytest.raises(case.exc) as info:
            with gs.record(memory=memory, budget=case.budget) as rec:
                for make, run in case.calls:
                    run(env, make(env))
        text = f"{type(info.value).__name__}: {info.value}"
        del info
    ref = weakref.ref(rec)
    r = rec.recording
    assert r is not None
    del rec
    return r, env, text, ref


def _step_labels(r: Recording, first: int | None, last: int | None) -> list[Any]:
    if first is None or last is None:
        return []
    out = []
    for s in r.steps[first:last + 1]:
        n = r.nodes[s.node]
        out.append((n.name, n.leaf_shape) if n.name == "AccumulateGrad" else n.name)
    return out


@pytest.mark.parametrize("caught", [True, False], ids=["caught", "raises"])
@pytest.mark.parametrize(("case_name", "memory"),
                         [(c, m) for c in CASES for m in (MEMORY if CASES[c].budget is None else ["tracker"])])
def test_a_backward_that_raised_leaves_its_call(case_name: str, memory: str, caught: bool) -> None:
    case = CASES[case_name]
    calls = list(case.calls) + ([(_after, _run_after)] if caught else [])
    truth = _truth(case, calls)
    if case.fails_at is None:  # the unrecorded run raised the same error
        assert truth.errors[len(case.calls) - 1] is not None
    r, env, text, ref = _recorded(case, memory, caught)
    failing = len(case.calls) - 1
    if case.fails_at is None:
        assert text == truth.errors[failing]
    else:
        assert text.startswith("MemoryBudgetExceeded: gradscope: simulated device out of memory: tried to "
                               "allocate 1.0 MiB (1048576 bytes)")

    # the block: complete when the failure was caught, else incomplete with the same error
    assert r.complete is caught
    assert r.error == (None if caught else text)
    assert r.backward_passes == len(calls) == len(r.backward_calls)

    # each call: its error, its steps (consecutive, in call order), what it accumulated
    position = 0
    for k, c in enumerate(r.backward_calls):
        error = text if k == failing else None
        assert c.index == k and c.error == error
        assert c.oom is (k == failing and issubclass(case.exc, torch.OutOfMemoryError))
        expected = _expected_steps(truth, k, memory)
        assert _step_labels(r, c.first_step, c.last_step) == expected
        if expected:
            assert c.first_step is not None and c.last_step is not None
            assert (c.first_step, c.last_step) == (position, position + len(expected) - 1)
            assert all(s.backward == k for s in r.steps[c.first_step:c.last_step + 1])
        position += len(expected)
        ran_to_end = len(truth.finished[k]) == len(truth.started[k])
        failed = (position - 1 if memory == "tracker" and error is not None and expected and not ran_to_end
                  else None)
        assert c.failed_step == failed
        accumulated = [(r.nodes[i].name, r.nodes[i].leaf_shape) for i in c.accumulated]
        finished_leaves = [lab for lab in truth.finished[k] if isinstance(lab, tuple)]
        assert accumulated == [lab for lab in finished_leaves if lab in expected]
    assert len(r.steps) == position

    # what the failure left in the leaves: the .grad the unrecorded run left (a budget: none,
    # the crossing node being at or before every leaf's AccumulateGrad)
    for name, g in truth.grads.items():
        got = env[name].grad
        if case.fails_at is not None and name == "x":
            assert got is None
        else:
            assert (got is None and g is None) or (got is not None and g is not None and torch.equal(got, g)), name

    # one summary line per failed call, as computed from the truth
    lines = [ln for ln in r.summary().splitlines() if ln.startswith(f"  backward {failing + 1} (")]
    c = r.backward_calls[failing]
    expected = _expected_steps(truth, failing, memory)
    first = c.first_step if c.first_step is not None else 0
    last = "" if not expected else expected[-1] if isinstance(expected[-1], str) else expected[-1][0]
    if not expected:
        where = " with no step seen"
    elif c.failed_step is not None:
        where = f" in step {first + len(expected)} ({last})"
        if len(expected) > 1:
            where += (f", after step {first + 1}" if len(expected) == 2 else
                      f", after steps {first + 1}-{first + len(expected) - 1}")
    else:
        span = f"step {first + 1}" if len(expected) == 1 else f"steps {first + 1}-{first + len(expected)}"
        where = f" after {span} (last seen: {last})"
    oom = " [out of memory]" if c.oom else ""
    assert len(lines) == 1
    prefix = f"  backward {failing + 1} ({case.api}) raised{oom}{where}: "
    assert lines[0].startswith(prefix)
    assert text.startswith(lines[0][len(prefix):].rstrip("…"))
    assert sum(1 for ln in r.summary().splitlines() if " raised" in ln and ln.startswith("  backward ")) == 1

    # the calls survive the file
    assert Recording.from_dict(json.loads(r.to_json())).backward_calls == r.backward_calls

    # nothing stays hooked: nothing global, and no node hook on the graphs the leaves still hold
    # keeps the recorder alive (compiled pass hooks come off when their owner goes: see NOTE
    # [ compiled pass hooks ] in walk.cc; the saves still in those graphs keep the saved-tensor
    # pair they were packed by, which is PyTorch's, not a hook left on)
    assert no_gradscope_left() == []
    gc.collect()
    assert ref() is None
    assert env  # the graphs (loss, after) lived through the check


# ------------------------------------------------------------------ files and passes
def test_files_without_the_error_fields_load() -> None:
    """A schema 1 file, and a schema 2 file written before calls carried errors, load with
    error=None, oom=False, failed_step=None."""
    old = gs.load(DATA / "schema1_mlp.json")
    assert old.backward_calls == (BackwardCall(0, "backward", create_graph=False, retain_graph=True),)
    assert (old.backward_calls[0].error, old.backward_calls[0].oom, old.backward_calls[0].failed_step) == (
        None, False, None)
    env = _small()
    with gs.record(memory="tracker") as rec:
        with pytest.raises(ValueError):
            _boom_loss(env)[0].backward()
    r = rec.recording
    assert r is not None
    d = r.to_dict()
    assert d["backward_calls"]["error"] == ["ValueError: boom in a custom backward"]
    # Sum, Sin, Mul, b's AccumulateGrad, then the custom node raises
    assert d["backward_calls"]["oom"] == [False] and d["backward_calls"]["failed_step"] == [4]
    for name in ("error", "oom", "failed_step"):
        del d["backward_calls"][name]
    back = Recording.from_dict(d)
    assert back.backward_calls[0] == dataclasses.replace(r.backward_calls[0], error=None, oom=False,
                                                         failed_step=None)
    assert (back.backward_calls[0].first_step, back.backward_calls[0].last_step) == (0, 4)


@pytest.mark.parametrize(("column", "value", "match"), [
    ("failed_step", [99], "backward call step 99 points outside"),
    ("error", [3], "BackwardCall.error cannot be int"),
    ("oom", ["yes"], "BackwardCall.oom cannot be str"),
])
def test_damaged_error_fields_are_refused(column: str, value: list[Any], match: str) -> None:
    env = _small()
    with gs.record(memory="tracker") as rec:
        with pytest.raises(ValueError):
            _boom_loss(env)[0].backward()
    assert rec.recording is not None
    d = rec.recording.to_dict()
    d["backward_calls"][column] = value
    with pytest.raises(gs.GradscopeError, match=match):
        Recording.from_dict(d)


def test_off_gives_back_no_step_after_a_failure() -> None:
    """memory='off' gives the steps of nodes that save nothing back from the engine's order: in
    a pass that raised, between seen steps only. Here the custom node raises; the tanh, matmul
    and w's leaf node after it never ran (a pass that returned shows them: the control)."""
    env = _small()
    with gs.record(memory="off") as rec:
        with pytest.raises(ValueError):
            _boom_loss(env)[0].backward()
        _mlp_loss(env)[0].backward()
    r = rec.recording
    assert r is not None
    failed, ok = r.backward_calls
    assert failed.last_step is not None and ok.last_step is not None
    names = [r.nodes[s.node].name for s in r.steps]
    assert names[failed.first_step:failed.last_step + 1] == ["SumBackward0", "SinBackward0", "MulBackward0",
                                                             "AccumulateGrad", "BoomBackward"]
    assert names[ok.first_step:ok.last_step + 1] == [
        "SumBackward0", "SinBackward0", "AddBackward0", "AccumulateGrad", "TanhBackward0", "MmBackward0",
        "AccumulateGrad"]
    assert [r.nodes[i].leaf_shape for i in failed.accumulated] == [(4,)]  # b's, not w's
    assert env["w"].grad is not None
    assert any("1 backward call(s) raised" in n for n in r.notes)


@pytest.mark.parametrize("memory", ["cpu", "tracker"])
def test_gradients_written_before_the_failure_are_gradients(memory: str) -> None:
    """The .grad a failed backward wrote before it raised stays, and is a gradient in the
    allocation table (b's 4 floats, made by MulBackward0 and kept by AccumulateGrad; w's
    AccumulateGrad never ran)."""
    env = _small()
    with gs.record(memory=memory) as rec:
        with pytest.raises(ValueError):
            _boom_loss(env)[0].backward()
    r = rec.recording
    assert r is not None
    assert env["w"].grad is None and env["b"].grad is not None
    grads = [a for a in r.allocations if a.category is Category.GRADIENT]
    assert [(a.bytes, a.free_at) for a in grads] == [(env["b"].grad.untyped_storage().nbytes(), None)]
    c = r.backward_calls[0]
    assert c.first_step is not None and c.last_step is not None
    assert grads[0].step is not None and c.first_step <= grads[0].step <= c.last_step


class HugeBackward(torch.autograd.Function):
    """Its backward asks the device for far more memory than any has: a real out-of-memory,
    raised by the allocator at once (nothing is filled)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        torch.empty(1 << 50, dtype=torch.uint8, device=g.device)
        return g * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_out_of_memory_caught_inside_the_block() -> None:
    """``except torch.OutOfMemoryError: skip this batch``: the call says it ran out of memory, in
    which node, after which steps (the unrecorded run's pre hooks give them)."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    x = torch.randn(8, 64, device="cuda")

    def loss() -> torch.Tensor:
        return HugeBackward.apply((x @ w).tanh()).sin().sum()

    started: list[str] = []
    out = loss()
    fn_stack: list[Any] = [out.grad_fn]
    while fn_stack:
        fn = fn_stack.pop()
        if fn is not None:
            fn.register_prehook(lambda g, fn=fn: started.append(type(fn).__name__))
            fn_stack.extend(n for n, _ in fn.next_functions)
    with pytest.raises(torch.OutOfMemoryError):
        out.backward()
    w.grad = None
    assert started[-1] == "HugeBackwardBackward"
    with gs.record(memory="cuda") as rec:
        try:
            loss().backward()
        except torch.OutOfMemoryError:
            pass
        (w * 3).sum().backward()
    r = rec.recording
    assert r is not None and r.complete
    failed, after = r.backward_calls
    assert failed.oom and failed.error is not None and failed.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert failed.first_step == 0 and failed.last_step == failed.failed_step == len(started) - 1
    assert [r.nodes[s.node].name for s in r.steps[: len(started)]] == started
    assert after.error is None and not after.oom and after.first_step == len(started)
    assert " raised [out of memory] in step " in r.summary()
    assert no_gradscope_left() == []
