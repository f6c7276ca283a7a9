"""The CUDA memory source, run on CPU through its allocator boundary with a fake allocator.

The fake reports the live bytes of an online CPU tracker as "allocated", so the figures it gives
are real numbers from the same computation; what is tested is everything above the boundary:
baseline, peak, samples at module and step boundaries, phases and labels, history parsing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import mlp

import gradscope as gs
from gradscope import memory
from gradscope._capture.memory import cuda as memory_cuda
from gradscope.recording import Phase


class _FakeAllocator:
    def __init__(self, tracker: memory.TrackerSource) -> None:
        self.tracker = tracker
        self.peak_from = 0
        self.history: dict[str, Any] | None = None

    def _running(self) -> list[int]:
        live, out = 0, []
        for e in self.tracker.events:
            live += e.size
            out.append(live)
        return out

    def synchronize(self, device: Any) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any) -> None:
        self.peak_from = len(self.tracker.events)

    def memory_allocated(self, device: Any) -> int:
        return self.tracker.live() + 1000  # 1000 bytes allocated before anything we track

    def max_memory_allocated(self, device: Any) -> int:
        running = self._running()[self.peak_from:]
        return max(running, default=self.tracker.live()) + 1000

    def memory_reserved(self, device: Any) -> int:
        return 2 << 20

    def max_memory_reserved(self, device: Any) -> int:
        return 4 << 20

    def current(self, device: Any) -> tuple[int, int]:
        return self.memory_allocated(device), self.memory_reserved(device)

    def total_memory(self, device: Any) -> int:
        return 80 << 30

    def start_history(self, max_entries: int) -> None:
        self.history = {"device_traces": [[]]}

    def stop_history(self, device: Any) -> dict[str, Any]:
        traces = []
        for e in self.tracker.events:
            action = "alloc" if e.size > 0 else "free_completed"
            traces.append({"action": action, "addr": e.key, "size": abs(e.size),
                           "frames": [{"name": e.label, "filename": "", "line": 0}]})
        return {"device_traces": [traces]}


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    tracker = memory.TrackerSource("cpu")
    fake = _FakeAllocator(tracker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(memory_cuda, "_TorchCudaStats", lambda: fake)
    tracker.start()
    yield fake
    tracker.stop()


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()


def test_cuda_source_peak_samples_and_steps(fake_cuda: _FakeAllocator) -> None:
    model, x = mlp()
    with gs.record(memory="cuda") as rec:
        _step(model, x)
    r = rec.recording
    running = fake_cuda._running()[fake_cuda.peak_from:]
    assert r.where.device == "cuda:0" and r.where.memory_source == "cuda caching allocator"
    assert r.baseline_bytes == 1000 + running[0] - fake_cuda.tracker.events[fake_cuda.peak_from].size
    assert r.peak_bytes == max(running) + 1000 - r.baseline_bytes
    assert r.reserved_peak_bytes == 4 << 20 and r.device_total_bytes == 80 << 30
    # one sample at each module entry/exit and around each backward step
    n_modules = len(list(model.modules()))
    assert len(r.timeline) == 2 * n_modules + 2 * len(r.steps) + 1
    assert {p.phase for p in r.timeline} == {Phase.FORWARD, Phase.BACKWARD}
    assert any(p.label == "ReLU" and p.module == "model.1" for p in r.timeline)
    assert all(s.live_before is not None and s.live_after is not None for s in r.steps)
    # samples are exact allocator readings: the last one is the live total at the end
    assert r.timeline[-1].live == fake_cuda.memory_allocated(None) - r.baseline_bytes
    assert max(p.live for p in r.timeline) <= r.peak_bytes


def test_cuda_history_timeline(fake_cuda: _FakeAllocator) -> None:
    model, x = mlp()
    with gs.record(memory="cuda", history=True) as rec:
        _step(model, x)
    r = rec.recording
    assert fake_cuda.history is not None
    allocs = [p for p in r.timeline]
    assert allocs and max(p.live for p in allocs) == r.peak_bytes
    assert any(p.label.startswith("aten::") for p in allocs)
    times = [p.t_s for p in allocs]
    assert times == sorted(times) and times[0] >= 0  # spread over the block, in allocator order


def test_graphs_kept_in_a_list_are_found_for_a_model_that_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on a GPU (or too large to copy) has its fixes' stand-ins measured by ``gs.predict`` on
    meta, where the stand-in's inputs must follow the model and no values can be compared. On a real
    H200 a cell appending 13 losses to a list until CUDA ran out of memory got no finding (the
    stand-in's CPU inputs met a meta model, then its recompute check read values); here the same
    path runs on the CPU with copying turned off, and the finding is there, its stand-in's peak below
    the peak of every graph at once."""
    import importlib

    measure = importlib.import_module("gradscope._analyses.diagnose.proxies")
    monkeypatch.setattr(measure, "MAX_COPY_BYTES", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
    xs = [torch.zeros(64, 256) for _ in range(4)]
    two_pass = measure.proxy_peak(measure.two_pass_proxy(xs, 4), model)
    micro = measure.proxy_peak(measure.micro_batch_proxy(xs, 4), model)
    everything = gs.predict(lambda m, xs: sum(m(x).square().mean() for x in xs).backward(), model, xs).peak_bytes
    assert two_pass is not None and micro is not None
    assert two_pass < everything and micro < everything
    losses: list[torch.Tensor] = []
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(memory="tracker", budget="4MiB", modules={"model": model}) as rec:
            for _ in range(1000):
                losses.append(model(torch.randn(64, 256)).square().mean())
    assert rec.recording is not None
    d = gs.diagnose(rec.recording)
    assert [(f.pattern, f.variable) for f in d.findings][:1] == [("many_outputs", "losses")]


def test_a_failure_sampled_without_the_history_says_what_is_not_known(fake_cuda: _FakeAllocator) -> None:
    """``memory='cuda'`` without ``history=True`` samples the allocator's totals, not allocations: on
    an H200 a GPT-2 step that ran out of memory got "no memory events were recorded (memory='off'?)"
    and "held: 0 B ... alive then", both untrue. The report says the block failed, why nothing is
    itemised and how to record so that it is, and claims no bytes held."""
    model, x = mlp()
    with pytest.raises(torch.OutOfMemoryError):
        with gs.record(memory="cuda") as rec:
            model(x).pow(2).mean()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
    r = rec.recording
    assert r is not None and r.timeline and r.allocation_key == "none"
    d = gs.diagnose(r)
    first, text = d.text().splitlines()[0], d.text()
    assert d.totals_only and "the block failed (OutOfMemoryError" in first and "history=True" in first
    assert "memory='off'" not in text and "held:" not in text and "inside the block and alive" not in text
    assert "the largest holders above" not in text
    with pytest.raises(RuntimeError):
        with gs.record(memory="off") as rec:
            raise RuntimeError("boom")
    d = gs.diagnose(rec.recording)
    assert not d.totals_only and "the block failed (RuntimeError: boom)" in d.text().splitlines()[0]
