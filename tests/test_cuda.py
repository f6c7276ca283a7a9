"""The CUDA boundary: recording on a GPU, the allocator's history, prediction against a real run.

Tests marked ``cuda`` are skipped where no GPU is present; the rest check what a CPU-only machine
must do at that boundary (say what to use instead; NVML missing is normal).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope.memory import nvml_device_totals

MiB = 1024 * 1024
has_cuda = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")]


def _mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10)
    ).to(device)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@pytest.mark.skipif(has_cuda, reason="checks the CPU-only answer")
def test_cuda_memory_without_a_gpu_says_what_to_use() -> None:
    with pytest.raises(gs.GradscopeError, match=r"gs\.predict\(\.\.\., device='cuda'\)"):
        with gs.record(memory="cuda"):
            pass


def test_nvml_missing_or_present_is_not_an_error() -> None:
    totals = nvml_device_totals(0)
    assert totals is None or totals["total"] >= totals["used"] >= 0


def test_cuda_prediction_needs_no_gpu() -> None:
    p = gs.predict(_step, _mlp("cpu"), torch.randn(64, 1024), device="cuda", budget="1GiB")
    assert p.device == "cuda" and p.fits is True
    assert p.allocated_bytes is not None and p.allocated_bytes % 512 == 0
    assert p.reserved_bytes is not None and p.reserved_bytes >= p.allocated_bytes


@pytest.mark.parametrize("history", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")
def test_record_cuda_peak_reserved_and_history(history: bool) -> None:
    model, x = _mlp("cuda"), torch.randn(64, 1024, device="cuda")
    _step(copy.deepcopy(model), x)  # warm up: cuBLAS workspaces exist before the measured run
    with gs.record(memory="cuda", history=history) as rec:
        _step(model, x)
    r = rec.recording
    assert r is not None and r.complete
    assert r.where.device.startswith("cuda") and r.where.memory_source == "cuda caching allocator"
    assert r.peak_bytes > 0
    assert r.reserved_peak_bytes is not None and r.reserved_peak_bytes >= r.peak_bytes
    saved_cpu = _saved_bytes_cpu()
    assert r.saved_bytes == saved_cpu  # saved tensors are the same tensors on either device
    if history:
        assert r.timeline, "the allocator's history gives a timeline"
        assert max(p.live for p in r.timeline) <= r.peak_bytes
        assert any(p.phase.value == "backward" for p in r.timeline) or len(r.timeline) > 2
    assert r.device_total_bytes is None or r.device_total_bytes > 0


def _saved_bytes_cpu() -> int:
    with gs.record(memory="off") as rec:
        _step(_mlp("cpu"), torch.randn(64, 1024))
    assert rec.recording is not None
    return rec.recording.saved_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")
def test_prediction_against_the_real_cuda_run() -> None:
    model, x = _mlp("cuda"), torch.randn(256, 1024, device="cuda")
    _step(copy.deepcopy(model), x)  # warm up (workspaces), then measure from a clean peak
    for p in model.parameters():
        p.grad = None
    pred = gs.predict(_step, model, x, device="cuda")
    resident = _rounded_resident(model, x)  # before the step: its gradients are the step's memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(model, x)
    torch.cuda.synchronize()
    real_peak = torch.cuda.max_memory_allocated() - before
    predicted = pred.allocated_bytes - resident
    # exact tensor bytes never exceed what the allocator hands out
    assert pred.peak_bytes <= real_peak
    # the allocator model is close: kernels' own workspaces are what it cannot see
    assert abs(real_peak - predicted) <= 0.05 * real_peak + 8 * MiB, (real_peak, predicted)
    assert all(p.device.type == "cuda" for p in model.parameters())  # originals untouched


def _rounded_resident(model: nn.Module, x: torch.Tensor) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), x]
    return sum(512 * -(-t.untyped_storage().nbytes() // 512) for t in tensors)


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")
def test_real_cuda_oom_is_diagnosed_from_the_allocator_history() -> None:
    """Room for a few of the loop's graphs (one holds ~200 MiB): with a single graph alive at the
    failure there is no list of graphs to speak of, and no finding."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    used = torch.cuda.memory_reserved()
    fraction = min(1.0, (used + 1024 * MiB) / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    model = _mlp("cuda")
    losses = []
    try:
        with pytest.raises(torch.OutOfMemoryError):
            with gs.record(memory="cuda", history=True, modules={"model": model}) as rec:
                for _ in range(10_000):
                    losses.append(model(torch.randn(4096, 1024, device="cuda")).square().mean())
        d = gs.diagnose(rec.recording)
        assert d.moment == "failure"
        assert d.findings and d.findings[0].variable == "losses"
    finally:
        losses.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
