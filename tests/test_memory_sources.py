"""The memory sources against PyTorch's own view of the same work.

- the tracker counts tensors made below the dispatcher (``torch.tensor(data)`` and its kin, the
  optimizers' step counters) as the CPU allocator reports them;
- the CPU source opens its scopes without operators a program's own dispatch mode would see;
- the CPU source leaves PyTorch's profiler flag as a bare profiler session does, also after code in
  the block failed to start a profiler of its own;
- the tracker leaves torch.compile'd code compiled after the block.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import OpLog, no_gradscope_left, profiler_peak
from torch import nn

import gradscope as gs
from gradscope._base import compat as _compat

# ------------------------------------------------------------------ tensors made outside dispatch
_ARRAY = np.arange(500, dtype=np.float32)

# name -> (the block, the bytes the allocator gives it: computed here from sizes and dtypes)
_FRESH: dict[str, tuple[Callable[[], Any], int]] = {
    "tensor(list)": (lambda: torch.tensor([float(i) for i in range(1000)]), 1000 * 4),
    "tensor(nested lists)": (lambda: torch.tensor([[1.0, 2.0, 3.0]] * 100), 300 * 4),
    "tensor(python scalar)": (lambda: torch.tensor(3.0), 4),
    "tensor(int list)": (lambda: torch.tensor(list(range(50))), 50 * 8),
    "tensor(list, requires_grad)": (lambda: torch.tensor([1.0] * 100, requires_grad=True), 100 * 4),
    "as_tensor(list)": (lambda: torch.as_tensor([1.0] * 300), 300 * 4),
    "asarray(list)": (lambda: torch.asarray([1.0] * 300, dtype=torch.float64), 300 * 8),
    "Tensor(list)": (lambda: torch.Tensor([1.0] * 200), 200 * 4),
    "new_tensor(list)": (lambda: torch.ones(1).new_tensor([1.0] * 100), 4 + 100 * 4),
    "sparse_coo_tensor(lists)": (lambda: torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), check_invariants=False), 2 * 8 + 2 * 4),
    # numpy's memory shared, not allocated: neither source counts it (see NOTE [ tensors made
    # outside dispatch ] in gradscope.memory); a copy into another dtype is an allocation
    "from_numpy": (lambda: torch.from_numpy(_ARRAY), 0),
    "as_tensor(ndarray)": (lambda: torch.as_tensor(_ARRAY), 0),
    "asarray(ndarray)": (lambda: torch.asarray(_ARRAY), 0),
    "as_tensor(ndarray, float64)": (lambda: torch.as_tensor(_ARRAY, dtype=torch.float64), 500 * 8),
    "tensor(ndarray)": (lambda: torch.tensor(_ARRAY), 500 * 4),
}


def _peak(memory: str, block: Callable[[], Any]) -> int:
    kept = []
    with gs.record(memory=memory) as rec:
        kept.append(block())
    return rec.recording.peak_bytes


@pytest.mark.parametrize("name", list(_FRESH))
def test_tracker_counts_tensors_made_outside_dispatch_as_the_allocator_does(name: str) -> None:
    block, expected = _FRESH[name]
    kept: list[Any] = []
    assert profiler_peak(lambda: kept.append(block())) == expected  # PyTorch's own events
    assert _peak("cpu", block) == expected
    assert _peak("tracker", block) == expected
    assert no_gradscope_left() == []


def test_tracker_counts_a_block_mixing_tensor_and_ones() -> None:
    def block() -> Any:
        return torch.tensor([float(i) for i in range(1000)]), torch.ones(1000)

    kept: list[Any] = []
    assert profiler_peak(lambda: kept.append(block())) == 8000
    assert _peak("tracker", block) == _peak("cpu", block) == 8000


def test_budget_refuses_a_tensor_made_from_a_list() -> None:
    """The tracker is online: a tensor made by torch.tensor now counts toward a budget."""
    with pytest.raises(gs.MemoryBudgetExceeded):
        with gs.record(memory="tracker", budget=3000):
            torch.tensor([0.5] * 1000)  # 4,000 bytes
    assert no_gradscope_left() == []


def _adamw_run(memory: str, foreach: bool) -> tuple[int, int, int]:
    """Two training steps of a small MLP with AdamW (its 0-d ``step`` counters are made by
    ``torch.tensor``): peak, bytes left allocated by the block, and the parameters' bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    x = torch.randn(64, 4)
    with gs.record(memory=memory) as rec:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
    r = rec.recording
    left = sum(a.bytes for a in r.allocations if a.free_at is None)
    return r.peak_bytes, left, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("foreach", [False, True])
def test_tracker_sees_adamw_step_counters(foreach: bool) -> None:
    t_peak, t_left, param_bytes = _adamw_run("tracker", foreach)
    c_peak, c_left, _ = _adamw_run("cpu", foreach)
    n_params = 4
    # left by the block: the gradients, exp_avg and exp_avg_sq (each as big as the parameters)
    # and one 4-byte float step counter per parameter
    assert c_left == 3 * param_bytes + 4 * n_params
    assert t_left == c_left
    assert t_peak == c_peak  # the peak is in the second backward, with the counters alive


# ------------------------------------------------------------------ scopes outside the dispatcher

class _Scale(nn.Module):
    """Saves only its input, which needs no gradient (so no pack hook detaches anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((16,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Scale(), _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x.clone())  # one save per input object: see _Scale


def _logged_ops(model: nn.Module, x: torch.Tensor) -> list[str]:
    model.zero_grad(set_to_none=True)
    with OpLog() as log:
        model(x).sum().backward()
    return log.ops


def test_cpu_source_adds_no_operator_a_program_dispatch_mode_sees() -> None:
    model, x = _Two(), torch.ones(8, 16)
    plain = _logged_ops(model, x)
    with gs.record(memory="cpu") as rec:
        recorded = _logged_ops(model, x)
    assert recorded == plain
    assert not any(op.startswith("profiler.") for op in recorded)
    # the scopes are still there for the recording: forward allocations carry their module
    r = rec.recording
    mul_rows = [a for a in r.allocations if a.phase.value == "forward" and a.bytes == 8 * 16 * 4]
    # the clone and the sum in the outer module, one product in each inner one
    assert sorted(str(a.module) for a in mul_rows) == ["model", "model", "model.a", "model.b"]


def test_cpu_source_adds_no_operator_over_memory_off() -> None:
    """On an MLP (whose saves the pack hook detaches in every mode), memory='cpu' sees exactly the
    operators memory='off' sees: the memory source adds none."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(5, 6)
    lists = {}
    for memory in ("off", "cpu"):
        with gs.record(memory=memory):
            lists[memory] = _logged_ops(model, x)
    assert lists["cpu"] == lists["off"]
    assert "aten.addmm.default" in lists["cpu"]


def test_profiler_scopes_bypass_the_dispatcher() -> None:
    assert _compat.scopes_bypass_dispatch()
    with OpLog() as log:
        _compat.record_scope_exit(_compat.record_scope_enter("gradscope.test"))
    assert log.ops == []


# ------------------------------------------------------------------ the profiler flag
def _flag() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


def test_a_failed_profiler_start_inside_a_block_leaves_nothing() -> None:
    # emit_itt is the starter that fails on a CPU build (emit_nvtx needs CUDA; a second profile
    # starts: see the next tests)
    starter = torch.autograd.profiler.emit_itt
    # what a bare profiler session does: the inner start fails, the session's end clears the flag
    with torch.profiler.profile(profile_memory=True):
        with pytest.raises(RuntimeError, match="already enabled"):
            with starter():
                pass
        assert _flag()
    bare_after = _flag()
    assert bare_after is False

    with gs.record(memory="cpu"):
        with pytest.raises(RuntimeError, match="already enabled"):
            with starter():
                pass
        assert _flag()  # as inside the bare session
    assert _flag() is bare_after
    assert no_gradscope_left() == []
    # a later recording starts and measures
    with gs.record(memory="cpu") as rec:
        y = torch.ones(1000)
    assert rec.recording.peak_bytes == 4000
    del y


def test_cpu_source_sets_the_flag_as_a_bare_session_does() -> None:
    seen = []
    with torch.profiler.profile(profile_memory=True):
        seen.append(_flag())
    with gs.record(memory="cpu"):
        seen.append(_flag())
    assert seen == [True, True]
    assert not _flag()


def test_cpu_source_clears_the_flag_when_the_block_raises() -> None:
    with pytest.raises(ZeroDivisionError):
        with gs.record(memory="cpu"):
            with pytest.raises(RuntimeError, match="already enabled"):
                with torch.autograd.profiler.emit_itt():
                    pass
            raise ZeroDivisionError
    assert not _flag()
    assert no_gradscope_left() == []
    with gs.record(memory="cpu") as rec:
        y = torch.ones(250)
    assert rec.recording.peak_bytes == 1000
    del y


def test_a_profile_started_inside_a_block_is_said() -> None:
    """A second torch.profiler.profile() inside the block takes over the session (PyTorch ends
    the running one); the recording says its memory is missing, and nothing is left behind."""
    with gs.record(memory="cpu") as rec:
        try:
            with torch.profiler.profile():
                pass
        except RuntimeError:  # a torch that refuses the second session: ours runs on
            pass
        y = torch.ones(1000)
    r = rec.recording
    ended = any("ended inside the block by another profiler" in n for n in r.notes)
    assert ended is (r.peak_bytes == 0)
    if not ended:
        assert r.peak_bytes == 4000
    assert not _flag()
    assert no_gradscope_left() == []
    with gs.record(memory="cpu") as rec2:
        z = torch.ones(500)
    assert rec2.recording.peak_bytes == 2000
    del y, z


# ------------------------------------------------------------------ torch.compile after the tracker
def _compile_available() -> bool:
    if importlib.util.find_spec("torch._dynamo") is None:
        return False
    try:
        out = torch.compile(lambda t: t * 2 + 1, backend="aot_eager")(torch.ones(2, requires_grad=True))
    except Exception:
        return False
    return type(out.grad_fn).__name__ == "CompiledFunctionBackward"


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def _stance() -> str | None:
    ef = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    stance = getattr(ef, "_stance", None)
    return getattr(stance, "stance", None)


@pytest.fixture
def _compiled() -> Iterator[None]:
    if not _compile_available():
        pytest.skip("torch.compile cannot run here")
    yield
    torch._dynamo.reset()


def _kind(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


@pytest.mark.usefixtures("_compiled")
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_compiled_code_stays_compiled_after_a_tracker_block() -> None:
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 3), nn.Linear(4, 3)
    c_used = torch.compile(used, backend="aot_eager")
    c_unused = torch.compile(unused, backend="aot_eager")
    c_fn = torch.compile(_fn, backend="aot_eager")
    x = torch.randn(2, 4, requires_grad=True)
    assert [_kind(c_used(x)), _kind(c_unused(x)), _kind(c_fn(x))] == ["CompiledFunctionBackward"] * 3
    expected = used(x).detach(), _fn(x).detach()

    def first_compiled_inside(t: torch.Tensor) -> torch.Tensor:
        return t.exp() + 1

    with gs.record(memory="tracker") as rec:
        y, z = c_used(x), c_fn(x)
        c_new = torch.compile(first_compiled_inside, backend="aot_eager")
        w = c_new(x)
        (y.sum() + z.sum() + w.sum()).backward()
    assert torch.allclose(y, expected[0]) and torch.allclose(z, expected[1])
    if not _compat.capabilities().ignore_compile_internals:
        assert "ran eagerly" in " ".join(rec.recording.notes)
    assert _stance() in (None, "default")
    assert no_gradscope_left() == []
    after = [_kind(c_used(x)), _kind(c_unused(x)), _kind(c_fn(x)), _kind(c_new(x))]
    assert after == ["CompiledFunctionBackward"] * 4


@pytest.mark.usefixtures("_compiled")
def test_compile_stance_is_put_back_when_the_block_raises() -> None:
    torch.compiler.set_stance("eager_on_recompile")
    try:
        with pytest.raises(ZeroDivisionError):
            with gs.record(memory="tracker"):
                torch.ones(3).sum()
                raise ZeroDivisionError
        assert _stance() == "eager_on_recompile"
    finally:
        torch.compiler.set_stance("default")
    assert no_gradscope_left() == []
