"""A dropped recording is freed at once: no reference cycles between the recorder, its hooks, its
memory source and the recording (see NOTE [ no cycles through the recorder ] in gradscope._capture.saves).

Each test runs a scenario once to warm caches, then again with the cyclic collector switched off
(so that no automatic pass hides a cycle) and counts what one ``gc.collect()`` finds afterwards,
as ``gc.DEBUG_SAVEALL`` keeps it. The same code run without a recording is the independent
count: gradscope adds nothing to it. A control puts a cycle through a recorder on purpose and
checks that the count finds it, with the recording in it. (A full collection scans every object
of the process, about a third of a second here: each test makes a few.)
"""

from __future__ import annotations

import collections
import gc
import importlib
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import independent_nodes
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope as gs
import gradscope.memory as gmem
from gradscope._capture import native as _native

grec = importlib.import_module("gradscope._capture.record")  # the module (``gs.record`` is the recorder)

MEMORY = ["off", "cpu", "tracker", "budget"]
BUDGET = 1 << 30  # never crossed by these steps
TIGHT = 1_000  # crossed in the backward: the step's peak is 1,240 bytes


def cyclic_garbage(scenario: Callable[[], None]) -> list[Any]:
    """The objects that only the cyclic collector frees after ``scenario()`` returned (each one
    that a ``gc.collect()`` found unreachable), warm: the scenario runs once before."""
    scenario()
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        scenario()
        return _collected()
    finally:
        if was:
            gc.enable()


def _collected() -> list[Any]:
    """What one collection finds unreachable now, kept (``DEBUG_SAVEALL``) to be looked at."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def cyclic_garbage_now() -> int:
    """How many objects a collection finds unreachable right now (inside a scenario: the collector
    is off there, so these are the scenario's so far)."""
    return len(_collected())


def kinds(objects: list[Any]) -> collections.Counter[str]:
    """What a cycle is made of: how many objects of each kind (a method or function by name)."""
    def what(o: Any) -> str:
        if isinstance(o, types.MethodType):
            return f"method {o.__func__.__qualname__}"
        if isinstance(o, types.FunctionType):
            return f"function {o.__qualname__}"
        return type(o).__qualname__
    return collections.Counter(map(what, objects))


def describe(objects: list[Any]) -> str:
    """For a failure's message."""
    return ", ".join(f"{n} x {w}" for w, n in kinds(objects).most_common(12))


def assert_no_cycles(scenario: Callable[[], None], plain: Callable[[], None] | None = None) -> None:
    """``scenario`` leaves no cyclic garbage, and ``plain`` (the same code unrecorded) none
    either: the count is gradscope's."""
    if plain is not None:
        base = cyclic_garbage(plain)
        assert base == [], f"the unrecorded code itself made cycles: {describe(base)}"
    found = cyclic_garbage(scenario)
    assert len(found) == 0, f"{len(found)} objects on cycles: {describe(found)}"


def small_mlp() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(5, 8), torch.randint(0, 4, (5,))


def graph_size(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The step's graph nodes, counted unrecorded by following next_functions."""
    loss = nn.functional.cross_entropy(model(x), y)
    return len(independent_nodes(loss.grad_fn))


def record_args(memory: str) -> dict[str, Any]:
    return {"memory": "tracker", "budget": BUDGET} if memory == "budget" else {"memory": memory}


@pytest.mark.parametrize("memory", MEMORY)
def test_dropped_recording_is_not_cyclic(memory: str) -> None:
    """A training step's recording, dropped: looked at or not, the block completed or raised."""
    model, opt, x, y = small_mlp()
    n_nodes = graph_size(model, x, y)
    after_del: list[int] = []

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def recorded() -> None:
        for look in (True, False):
            for raised in (False, True):
                try:
                    with gs.record(**record_args(memory)) as rec:
                        step()
                        if raised:
                            raise ValueError("the user's own error")
                except ValueError:
                    pass
                if look:
                    r = rec.recording
                    assert r is not None and r.complete is not raised and len(r.nodes) == n_nodes
                    del rec
                    if not raised:  # the recording kept, the recorder dropped
                        after_del.append(cyclic_garbage_now())
                    del r
                else:
                    del rec

    assert_no_cycles(recorded, plain=step)
    assert after_del == [0, 0]


def test_budget_exceeded_is_not_cyclic() -> None:
    model, _, x, y = small_mlp()
    refused: list[tuple[int, bool]] = []

    def recorded() -> None:
        for look in (True, False):
            with pytest.raises(gs.MemoryBudgetExceeded) as info:
                with gs.record(memory="tracker", budget=TIGHT) as rec:
                    nn.functional.cross_entropy(model(x), y).backward()
            if look:
                r = rec.recording
                assert r is not None
                refused.append((info.value.budget, r.complete))
                del r
            del rec, info
            model.zero_grad()

    assert_no_cycles(recorded)
    assert refused == [(TIGHT, False)] * 2


@pytest.mark.parametrize("memory", ["off", "tracker"])
def test_python_hooks_are_not_cyclic(memory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python pair and walk, used where the compiled hooks cannot be built."""
    monkeypatch.setattr(_native, "hooks", lambda: None)
    model, opt, x, y = small_mlp()
    n_nodes = graph_size(model, x, y)

    def recorded() -> None:
        with gs.record(memory=memory) as rec:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        r = rec.recording
        assert rec._block.native is None and r is not None and len(r.nodes) == n_nodes

    assert_no_cycles(recorded)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@pytest.mark.parametrize("memory", MEMORY)
def test_double_backward_and_custom_function_are_not_cyclic(memory: str) -> None:
    """A create_graph pass (its pre hooks for the pass) and a custom Function's node (hooked for
    the whole block)."""
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    grads: list[torch.Tensor] = []

    def step() -> None:
        loss = _Square.apply(w.tanh()).sum() - 1
        (g,) = torch.autograd.grad(loss * loss, w, create_graph=True)
        (g2,) = torch.autograd.grad(g.sum(), w)
        grads.append(g2)

    def recorded() -> None:
        with gs.record(**record_args(memory)) as rec:
            step()
        assert rec.recording is not None and rec.recording.backward_passes == 2

    assert_no_cycles(recorded, plain=step)
    # the recorded gradients are the unrecorded ones (plain and recorded, each warm and counted)
    assert len(grads) == 4 and all(torch.equal(g, grads[0]) for g in grads)


@pytest.mark.parametrize("memory", MEMORY)
def test_graph_kept_after_the_block_is_not_cyclic(memory: str) -> None:
    """A graph recorded in the block and run after it (its saves unpacked by our hook then)."""
    model, _, x, y = small_mlp()
    while_held: list[int] = []

    def recorded() -> None:
        with gs.record(**record_args(memory)) as rec:
            loss = nn.functional.cross_entropy(model(x), y)
        del rec
        while_held.append(cyclic_garbage_now())  # the graph holds our hooks, and they not the recorder
        loss.backward()
        del loss
        model.zero_grad()

    assert_no_cycles(recorded)
    assert while_held[-1] == 0


@pytest.mark.parametrize("memory", MEMORY)
def test_torch_func_and_checkpoint_add_no_cycles(memory: str) -> None:
    """A torch.func transform (our hooks set aside for it) and a non-reentrant checkpoint (another
    pair of hooks on top of ours). PyTorch's own tree flattening leaves a few cyclic objects behind
    (a closure that calls itself): the recorded code leaves exactly those."""
    model, _, x, y = small_mlp()
    w = torch.randn(3)

    def step() -> None:
        torch.func.grad(lambda v: (v.sin() ** 2).sum())(w)
        checkpoint(model, x, use_reentrant=False).logsumexp(1).sum().backward()
        model.zero_grad()

    def recorded() -> None:
        with gs.record(**record_args(memory)) as rec:
            step()
        assert rec.recording is not None and rec.recording.backward_passes == 1

    base, found = cyclic_garbage(step), cyclic_garbage(recorded)
    assert kinds(found) == kinds(base), describe(found)


def test_block_that_never_started_is_not_cyclic() -> None:
    """A source that refuses to start (a profiler running already) undoes what was installed."""
    model, _, x, y = small_mlp()

    def refused() -> None:
        with torch.profiler.profile():
            with pytest.raises(gs.GradscopeError, match="profiler session is already running"):
                with gs.record(memory="cpu"):
                    nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad()

    def plain() -> None:
        with torch.profiler.profile():
            pass
        model.zero_grad()

    # the profiler's own objects are cyclic: the block adds none to them
    base, found = cyclic_garbage(plain), cyclic_garbage(refused)
    assert len(base) > 0 and kinds(found) == kinds(base), describe(found)


def test_control_a_cycle_through_the_recorder_is_counted() -> None:
    """The count sees a cycle of the kind this file is about: a recorder that refers to itself,
    with its recording hanging off it, is freed only by the collector."""
    model, _, x, y = small_mlp()

    def recorded() -> None:
        with gs.record(memory="off") as rec:
            nn.functional.cross_entropy(model(x), y).backward()
        assert rec.recording is not None  # analysed: the recording hangs off the recorder
        rec.__dict__["_myself"] = rec
        model.zero_grad()

    found = cyclic_garbage(recorded)
    assert sum(type(o) is gs.record for o in found) == 1
    assert sum(type(o) is gs.Recording for o in found) == 1


class _FakeCudaStats:
    """The caching allocator's figures for a CUDA source run on the CPU (the recorder's side of
    ``memory="cuda"``: its hooks, callbacks and step marks): a counter of the CPU bytes the
    source's callers made, enough for the source to run; the numbers are not checked here."""

    def synchronize(self, device: Any) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any) -> None:
        pass

    def memory_allocated(self, device: Any) -> int:
        return 0

    def max_memory_allocated(self, device: Any) -> int:
        return 0

    def memory_reserved(self, device: Any) -> int:
        return 0

    def max_memory_reserved(self, device: Any) -> int:
        return 0

    def current(self, device: Any) -> tuple[int, int]:
        return self.memory_allocated(device), self.memory_reserved(device)

    def total_memory(self, device: Any) -> int:
        return 1 << 30

    def start_history(self, max_entries: int) -> None:
        pass

    def stop_history(self, device: Any) -> dict[str, Any]:
        return {"segments": [], "device_traces": [[]]}

    def dump_snapshot(self, path: str) -> None:
        pass


def test_cuda_source_is_not_cyclic(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory="cuda"``'s source holds the recorder's callback while the block runs; with the
    allocator's figures faked, the same wiring runs on the CPU."""
    def make_source(memory: str, **kwargs: Any) -> gmem.CudaSource:
        assert memory == "cuda"
        return gmem.CudaSource(device=torch.device("cuda", 0), context=kwargs["context"], stats=_FakeCudaStats())

    monkeypatch.setattr(grec, "make_source", make_source)
    model, opt, x, y = small_mlp()
    n_nodes = graph_size(model, x, y)

    def recorded() -> None:
        with gs.record(memory="cuda") as rec:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        r = rec.recording
        assert r is not None and r.where.memory_source == "cuda caching allocator" and len(r.nodes) == n_nodes

    assert_no_cycles(recorded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("history", [False, True], ids=["sampled", "history"])
def test_real_cuda_recording_is_not_cyclic(history: bool) -> None:
    model, opt, x, y = small_mlp()
    model.cuda()
    x, y = x.cuda(), y.cuda()
    n_nodes = graph_size(model, x, y)

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def recorded() -> None:
        with gs.record(memory="cuda", history=history) as rec:
            step()
        r = rec.recording
        assert r is not None and len(r.nodes) == n_nodes

    assert_no_cycles(recorded, plain=step)
