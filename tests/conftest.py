"""Shared helpers for gradscope's tests: small models and independent measurements."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10)), torch.randn(32, 64)


def cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                      nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    return m, torch.randn(4, 3, 16, 16)


def encoder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(2, 8, 32)


MODELS = {"mlp": mlp, "cnn": cnn, "encoder": encoder}


def op_db_cases() -> list[Any]:
    """The ops of PyTorch's OpInfo database that support autograd (empty without expecttest,
    which the database imports)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except Exception:
        return []
    return [op for op in op_db if op.supports_autograd]


def floating_tensors(t: Any) -> list[torch.Tensor]:
    """The floating-point tensors that require a gradient in a value, a list or a tuple."""
    if isinstance(t, torch.Tensor):
        return [t] if t.is_floating_point() and t.requires_grad else []
    if isinstance(t, list | tuple):
        return [x for v in t for x in floating_tensors(v)]
    return []


def independent_nodes(*roots: Any) -> list[Any]:
    """Every node reachable from ``roots`` through next_functions, by object identity; the node
    objects are held in the returned list, so identity is stable while the caller holds it."""
    seen: dict[int, Any] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return list(seen.values())


def profiler_cpu_allocations(step: Any) -> list[tuple[int, int, int]]:
    """PyTorch profiler's own CPU allocation events over ``step()``, read from its event tree
    independently of gradscope: ``(start_ns, size, address)`` in time order (frees negative)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, int(e.extra_fields.alloc_size), int(e.extra_fields.ptr)))
    events.sort(key=lambda x: x[0])
    return events


class OpLog(TorchDispatchMode):
    """A program's own dispatch mode: it logs every operator it sees, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def profiler_peak(step: Any) -> int:
    """Peak of the running sum of PyTorch profiler's CPU allocation events over ``step()``,
    counting only memory allocated inside the step (frees of older memory are ignored)."""
    return running_peak((size, ptr) for _, size, ptr in profiler_cpu_allocations(step))


def recorded_peak(step: Any, *args: Any, memory: str = "cpu") -> int:
    """The recorded peak of a real run of ``step`` on deep copies of ``args`` (``memory="cpu"``: the CPU
    allocator's own reports; the tensors the copies hold counted as resident, as gs.predict counts them)."""
    import copy

    import gradscope as gs

    args = copy.deepcopy(args)
    with gs.record(memory=memory) as rec:
        step(*args)
    assert rec.recording is not None
    return rec.recording.peak_bytes


def running_peak(events: Any) -> int:
    """Peak of the running sum of ``(size, address)`` allocation events (frees negative), counting
    only memory allocated among them (a free of an address not allocated there is ignored)."""
    live, peak, alive = 0, 0, {}
    for size, ptr in events:
        if size > 0:
            alive[ptr] = size
        elif alive.pop(ptr, None) is None:
            continue
        live += size
        peak = max(peak, live)
    return peak


def saved_tensors_hooks_active() -> bool:
    """Whether a tensor saved now would be packed by some ``saved_tensors_hooks`` pair.

    A probe that works on every supported PyTorch (``_top_saved_tensors_default_hooks`` is absent
    before 2.7, ``SavedTensor.unpack_hook`` before 2.9): an op saves its result, and registering
    hooks on that saved tensor fails exactly when default hooks already packed it.
    """
    x = torch.ones(2, requires_grad=True)
    y = x.exp()  # ExpBackward0 saves its result; y keeps it alive while we look
    assert y.grad_fn is not None
    try:
        y.grad_fn._raw_saved_result.register_hooks(lambda t: t, lambda t: t)
    except RuntimeError as e:
        if "hooks have already been set" in str(e):
            return True
        raise
    return False


def count_packs(hooks: torch.autograd.graph.saved_tensors_hooks) -> list[int]:
    """Make a user's ``saved_tensors_hooks`` pair (``save_on_cpu()`` ...) count the tensors it
    packs, before it is entered; the count is the returned list's one element. Tells, on every
    PyTorch, whether that pair is the one applied to what is saved now."""
    count = [0]
    pack = hooks.pack_hook

    def counting_pack(t: torch.Tensor) -> Any:
        count[0] += 1
        return pack(t)

    hooks.pack_hook = counting_pack
    return count


def no_gradscope_left() -> list[str]:
    """What gradscope might have left installed; empty when everything was removed."""
    import torch.autograd as ag
    from torch.nn.modules import module as mod

    left = []
    from gradscope._base import compat as _compat

    top = _compat.top_saved_tensors_hooks()
    if (top is not None and top is not _compat.NOT_VISIBLE) or saved_tensors_hooks_active():
        left.append("saved_tensors_hooks")
    if mod._global_forward_hooks or mod._global_forward_pre_hooks:
        left.append("module hooks")
    if torch._C._len_torch_dispatch_stack():
        left.append("dispatch mode")
    if torch._C._autograd._profiler_enabled():
        left.append("profiler")
    if getattr(ag._engine_run_backward, "__module__", "") != "torch.autograd.graph":
        left.append("engine patch")
    return left


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
