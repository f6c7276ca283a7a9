"""Reliability: work done by other threads while a block records is excluded (module calls, saves,
backward passes and memory), recordings in several threads at once are each right, and whatever
order they end in, nothing stays installed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_reliability import MEMORY, leftovers
from torch import nn

import gradscope as gs


def _main_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)


def _shape(r: gs.Recording) -> tuple[Any, ...]:
    """Everything about a recording that does not depend on timing."""
    return (
        [(n.name, n.module, n.leaf, n.executed) for n in r.nodes],
        [(e.src, e.dst) for e in r.edges],
        [(s.node, s.attribute, s.shape, s.bytes, s.kind, s.module, s.freed_at_step) for s in r.saved],
        [(s.node, s.backward, s.freed_bytes, s.live_before, s.live_after) for s in r.steps],
        r.backward_passes,
        r.saved_bytes,
    )


def _record_main(memory: str, during: Any = None) -> tuple[gs.Recording, list[torch.Tensor]]:
    model, x = _main_model()
    with gs.record(memory=memory) as rec:
        h = model[0](x)
        if during is not None:
            during()
        model[1:](h).pow(2).mean().backward()
    return rec.recording, [p.grad.clone() for p in model.parameters()]


class _Worker:
    """Trains its own bigger model in a thread, started and joined from inside the block, so all
    of its work (module calls, saves, backward, 2 MB of allocations) happens while it records."""

    def __init__(self, shared: nn.Module | None = None) -> None:
        torch.manual_seed(5)
        self.model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 1))
        self.shared = shared
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            g = torch.Generator().manual_seed(7)  # the global generator is shared with the test
            x = torch.randn(256, 256, generator=g)
            y = self.model(x)
            if self.shared is not None:
                y = y + self.shared(torch.randn(256, 16, generator=g))[:, :1]
            y.pow(2).mean().backward()
        except BaseException as e:  # reported by the test
            self.error = e

    def __call__(self) -> None:
        t = threading.Thread(target=self.run)
        t.start()
        t.join()
        assert self.error is None


@pytest.mark.parametrize("memory", MEMORY)
def test_other_threads_work_is_excluded(memory: str) -> None:
    base, grads0 = _record_main(memory)
    worker = _Worker()
    got, grads1 = _record_main(memory, during=worker)
    assert _shape(got) == _shape(base)
    assert got.peak_bytes == base.peak_bytes  # the worker's 2 MB are not this block's memory
    for a, b in zip(grads1, grads0, strict=True):
        assert torch.equal(a, b)
    # the worker's own result is what it is without gradscope
    ref = _Worker()
    ref.run()
    for p, q in zip(worker.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert leftovers() == []


def test_shared_module_called_from_another_thread() -> None:
    """The recorded model's first layer is also called by another thread during the block: its
    module calls and saves there do not enter this recording."""
    model, _ = _main_model()
    base, _ = _record_main("tracker")
    got, _ = _record_main("tracker", during=_Worker(shared=model[0]))
    assert _shape(got) == _shape(base)
    assert leftovers() == []


def test_backward_run_by_another_thread_is_not_recorded() -> None:
    """A backward pass that another thread runs on this block's graph is excluded (documented):
    no steps, and the gradients are right."""
    model, x = _main_model()
    with gs.record(memory="tracker") as rec:
        loss = model(x).pow(2).mean()
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()
    r = rec.recording
    assert r.backward_passes == 0 and r.steps == ()
    assert len(r.nodes) == 11  # the graph itself was still found from the block's result
    ref, xr = _main_model()
    ref(xr).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert leftovers() == []


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("first_to_end", ["first_started", "last_started"])
def test_two_threads_record_at_once(memory: str, first_to_end: str) -> None:
    """Two blocks in two threads overlap; they end in either order. Each recording equals the
    same code recorded alone, and afterwards nothing of gradscope is installed."""
    alone = {}
    for name in ("a", "b"):
        alone[name], _ = _record_main(memory)
    started = {k: threading.Event() for k in "ab"}
    release = {k: threading.Event() for k in "ab"}
    out: dict[str, Any] = {}

    def body(name: str) -> None:
        try:
            model, x = _main_model()
            rec = gs.record(memory=memory)
            try:
                rec.__enter__()
            except gs.GradscopeError as e:  # memory='cpu': one profiler session per process
                started[name].set()
                out[name] = e
                return
            try:
                h = model[0](x)
                started[name].set()
                release[name].wait(10)
                model[1:](h).pow(2).mean().backward()
            finally:
                rec.__exit__(None, None, None)
            out[name] = rec.recording
        except BaseException as e:
            out[name] = e

    ta = threading.Thread(target=body, args=("a",))
    tb = threading.Thread(target=body, args=("b",))
    ta.start()
    assert started["a"].wait(10)
    tb.start()
    assert started["b"].wait(10)
    order = ["a", "b"] if first_to_end == "first_started" else ["b", "a"]
    for name in order:
        release[name].set()
        (ta if name == "a" else tb).join(10)
    for name in "ab":
        r = out[name]
        if memory == "cpu" and name == "b":
            # PyTorch's profiler crashes the process when two sessions overlap: refused instead
            assert isinstance(r, gs.GradscopeError) and "profiler session is already running" in str(r)
            continue
        assert isinstance(r, gs.Recording), r
        assert _shape(r) == _shape(alone[name])
        assert r.peak_bytes == alone[name].peak_bytes
    assert leftovers() == []
    with gs.record(memory=memory) as rec:  # and the profiler is free again
        _main_model()[0](torch.ones(1, 16)).sum().backward()
    assert rec.recording.backward_passes == 1


def test_recording_inside_a_users_profiler_keeps_their_session() -> None:
    """memory='cpu' inside a user's torch.profiler would end their session; it is refused, and
    the user's profile goes on recording. memory='tracker' works there."""
    from torch.profiler import ProfilerActivity, profile

    model, x = _main_model()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(gs.GradscopeError, match="memory='tracker'"):
            with gs.record(memory="cpu"):
                pass
        assert leftovers() == ["profiler"]  # theirs, still on
        with gs.record(memory="tracker") as rec:
            model(x).pow(2).mean().backward()
        model(x).sum()
    assert rec.recording.peak_bytes > 0 and rec.recording.backward_passes == 1
    names = {e.name for e in prof.events()}
    assert "aten::addmm" in names and "aten::sum" in names
    assert leftovers() == []


def test_nesting_in_one_thread_is_refused_and_leaves_the_outer_block_intact() -> None:
    model, x = _main_model()
    with gs.record(memory="off") as outer:
        with pytest.raises(gs.GradscopeError, match="cannot be nested"):
            with gs.record(memory="off"):
                pass
        model(x).pow(2).mean().backward()
    base, _ = _record_main("off")
    assert [n.name for n in outer.recording.nodes] == [n.name for n in base.nodes]
    assert outer.recording.backward_passes == 1
    assert leftovers() == []


@pytest.mark.parametrize("memory", ["off", "tracker"])
def test_a_block_starting_and_ending_on_another_thread_during_an_optimizer_step(memory: str) -> None:
    """torch iterates its global optimizer hooks during every ``optimizer.step()``: a block that
    starts and ends on another thread meanwhile changes nothing there (see NOTE [ one pair of
    optimizer hooks ]); before, its own pair was added and removed, and the step raised
    "OrderedDict mutated during iteration" (two predictions on two threads at once)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    model, x = _main_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors: list[BaseException] = []

    def other_block() -> None:
        try:
            with gs.record(memory=memory):
                nn.Linear(3, 3)(torch.ones(2, 3)).sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def during_the_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        t = threading.Thread(target=other_block)
        t.start()
        t.join(60)

    handle = register_optimizer_step_pre_hook(during_the_step)  # iterated before gradscope's pair
    try:
        with gs.record(memory=memory) as rec:
            model(x).sum().backward()
            opt.step()
    finally:
        handle.remove()
    assert not errors and rec.recording.complete
    assert all(p.grad is not None for p in model.parameters())
    assert leftovers() == []
