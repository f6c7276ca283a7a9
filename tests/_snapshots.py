"""Snapshot files for the tests, written from the format documented in torch/cuda/memory.py.

:class:`FakeAllocator` behaves like PyTorch's caching allocator as far as a snapshot can tell:
blocks rounded to 512 bytes and carved first-fit out of segments of their stream's pool (2 MiB
segments for requests up to 1 MiB, larger ones otherwise), segment_alloc / segment_free events,
free_requested then free_completed (later, for a block still used by another stream), an ``oom``
entry with the device's free bytes when a request does not fit (after releasing empty segments,
as the allocator does), a ring buffer of ``max_entries`` events, frames shared between tracebacks
the way the allocator symbolizes them. It also keeps its own ground truth: the allocated and
reserved bytes after every event, including events the ring buffer dropped. Nothing here uses
gradscope; the tests compare gradscope's replay with this independent account.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeAllocator", "Oom", "frames", "real_loop", "training_snapshot"]

MiB = 1 << 20
TORCH = "/opt/venv/lib/python3.11/site-packages/torch"
_FRAME_DICTS: dict[tuple[str, int, str], dict[str, Any]] = {}


def frames(*spec: tuple[str, int, str]) -> list[dict[str, Any]]:
    """A fresh traceback list (innermost first) whose frame dicts are shared, like the
    allocator's symbolized frames."""
    out = []
    for fn, line, name in spec:
        d = _FRAME_DICTS.get((fn, line, name))
        if d is None:
            d = _FRAME_DICTS[(fn, line, name)] = {"filename": fn, "line": line, "name": name}
        out.append(d)
    return out


class Oom(Exception):
    pass


@dataclass
class _Block:
    addr: int
    size: int
    state: str = "inactive"  # active_allocated | active_pending_free | inactive
    requested: int = 0
    frames: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Segment:
    addr: int
    size: int
    stream: int
    small: bool
    blocks: list[_Block]


class FakeAllocator:
    """One device's caching allocator, as far as its snapshot shows it."""

    def __init__(self, capacity: int, device: int = 0, max_entries: int | None = None,
                 base: int = 0x7F0000000000, t0_us: int = 1_700_000_000_000_000) -> None:
        self.capacity = capacity
        self.device = device
        self.max_entries = max_entries
        self.next_addr = base + device * (1 << 40)
        self.t_us = t0_us
        self.segments: list[_Segment] = []
        self.trace: list[dict[str, Any]] = []
        self.truth: list[tuple[int, int]] = []  # (allocated, reserved) after each event, dropped or not
        self.live: dict[int, tuple[int, int, list[dict[str, Any]]]] = {}  # addr -> requested, stream, frames
        self.pending: list[tuple[int, int]] = []  # (events to wait, addr) of frees still in use elsewhere
        self.ooms: list[int] = []  # index (in the full history) of each oom event
        self.events = 0
        self.annotations: list[dict[str, Any]] = []  # external_annotations (record_function ranges)

    def annotate(self, name: str, stage: str) -> None:
        """A ``record_function`` range's START or END, at the time of the last event (as PyTorch
        records them: by time, beside the trace)."""
        self.annotations.append({"stage": stage, "name": name, "device": self.device, "time_us": self.t_us + 1})

    # ----- the trace ---------------------------------------------------------------------
    def _emit(self, entry: dict[str, Any]) -> None:
        self.t_us += 7
        entry["time_us"] = self.t_us
        self.trace.append(entry)
        self.events += 1
        if self.max_entries is not None and len(self.trace) > self.max_entries:
            del self.trace[0]
        allocated = sum(r for r, _, _ in self.live.values())
        self.truth.append((allocated, self.reserved))

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    # ----- allocation --------------------------------------------------------------------
    def malloc(self, size: int, fr: list[dict[str, Any]], stream: int = 0) -> int:
        self._tick()
        rounded = max(512, -(-size // 512) * 512)
        small = rounded <= MiB
        block = self._find(rounded, stream, small)
        if block is None:
            seg_size = 2 * MiB if small else max(20 * MiB, -(-rounded // (2 * MiB)) * 2 * MiB)
            if self.reserved + seg_size > self.capacity:
                self._release_empty()
            if self.reserved + seg_size > self.capacity:
                self._emit({"action": "oom", "device_free": self.capacity - self.reserved, "size": rounded,
                            "stream": stream, "frames": fr})
                self.ooms.append(self.events - 1)
                raise Oom(f"tried to allocate {rounded}")
            seg = _Segment(self.next_addr, seg_size, stream, small, [_Block(self.next_addr, seg_size)])
            self.next_addr += seg_size + 64 * MiB
            self.segments.append(seg)
            self._emit({"action": "segment_alloc", "addr": seg.addr, "size": seg_size, "stream": stream,
                        "frames": fr})
            block = self._find(rounded, stream, small)
            assert block is not None
        seg, i = block
        b = seg.blocks[i]
        remaining = b.size - rounded
        if remaining >= 512 if small else remaining > MiB:
            seg.blocks.insert(i + 1, _Block(b.addr + rounded, remaining))
            b.size = rounded
        b.state, b.requested, b.frames = "active_allocated", size, fr
        self.live[b.addr] = (size, stream, fr)
        self._emit({"action": "alloc", "addr": b.addr, "size": size, "stream": stream, "frames": fr})
        return b.addr

    def _find(self, rounded: int, stream: int, small: bool) -> tuple[_Segment, int] | None:
        for seg in self.segments:
            if seg.stream != stream or seg.small != small:
                continue
            for i, b in enumerate(seg.blocks):
                if b.state == "inactive" and b.size >= rounded:
                    return seg, i
        return None

    def free(self, addr: int, fr: list[dict[str, Any]] | None = None, in_use_for: int = 0) -> None:
        """free_requested now; free_completed now, or after ``in_use_for`` more allocator calls
        (a block recorded on another stream)."""
        self._tick()
        size, stream, alloc_fr = self.live[addr]
        self._emit({"action": "free_requested", "addr": addr, "size": size, "stream": stream,
                    "frames": fr if fr is not None else alloc_fr})
        seg, b = self._block(addr)
        if in_use_for:
            b.state = "active_pending_free"
            self.pending.append((in_use_for, addr))
        else:
            self._complete(addr)

    def _tick(self) -> None:
        still = []
        for wait, addr in self.pending:
            if wait <= 1:
                self._complete(addr)
            else:
                still.append((wait - 1, addr))
        self.pending = still

    def _complete(self, addr: int) -> None:
        size, stream, fr = self.live.pop(addr)
        seg, b = self._block(addr)
        b.state, b.requested, b.frames = "inactive", 0, []
        self._emit({"action": "free_completed", "addr": addr, "size": size, "stream": stream, "frames": fr})
        i = seg.blocks.index(b)
        if i + 1 < len(seg.blocks) and seg.blocks[i + 1].state == "inactive":  # merge with the next
            b.size += seg.blocks.pop(i + 1).size
        if i > 0 and seg.blocks[i - 1].state == "inactive":
            seg.blocks[i - 1].size += seg.blocks.pop(i).size

    def _block(self, addr: int) -> tuple[_Segment, _Block]:
        for seg in self.segments:
            for b in seg.blocks:
                if b.addr == addr:
                    return seg, b
        raise KeyError(addr)

    def _release_empty(self) -> None:
        for seg in list(self.segments):
            if all(b.state == "inactive" for b in seg.blocks):
                self.segments.remove(seg)
                self._emit({"action": "segment_free", "addr": seg.addr, "size": seg.size, "stream": seg.stream,
                            "frames": []})

    def empty_cache(self) -> None:
        self._release_empty()

    # ----- the snapshot ------------------------------------------------------------------
    def segment_dicts(self) -> list[dict[str, Any]]:
        out = []
        for seg in self.segments:
            blocks = [{"address": b.addr, "size": b.size, "requested_size": b.requested, "state": b.state,
                       "frames": b.frames if b.state != "inactive" else []} for b in seg.blocks]
            out.append({
                "device": self.device, "address": seg.addr, "total_size": seg.size,
                "allocated_size": sum(b.size for b in seg.blocks if b.state == "active_allocated"),
                "active_size": sum(b.size for b in seg.blocks if b.state != "inactive"),
                "requested_size": sum(b.requested for b in seg.blocks),
                "stream": seg.stream, "segment_type": "small" if seg.small else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
            })
        return out

    @property
    def first_kept(self) -> int:
        """Index, in the full history, of the trace's first event."""
        return self.events - len(self.trace)


def snapshot(*allocators: FakeAllocator, devices: int | None = None) -> dict[str, Any]:
    n = devices if devices is not None else max(a.device for a in allocators) + 1
    traces: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    segments: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for a in allocators:
        traces[a.device] = a.trace
        segments.extend(a.segment_dicts())
        annotations.extend(a.annotations)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "garbage_collection_threshold": 0.0, "expandable_segments": False,
                               "roundup_power2_divisions": {"1": 0, "2": 0}},
        "external_annotations": annotations,
    }


def write(path: Any, snap: dict[str, Any], protocol: int = pickle.DEFAULT_PROTOCOL) -> None:
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=protocol)


# ----- a training loop -------------------------------------------------------------------
def _stack(*user: tuple[str, int, str], torch_inner: Sequence[tuple[str, int, str]] = ()) -> list[dict[str, Any]]:
    return frames(*torch_inner, *user)


LINEAR = (f"{TORCH}/nn/modules/linear.py", 125, "forward")
CALL = (f"{TORCH}/nn/modules/module.py", 1750, "_call_impl")
BACKWARD = (f"{TORCH}/autograd/__init__.py", 353, "backward")
TENSOR_BWD = (f"{TORCH}/_tensor.py", 648, "backward")
ADAM = (f"{TORCH}/optim/adam.py", 441, "_single_tensor_adam")
MAIN = ("/home/u/proj/train.py", 120, "main")
STEP = ("/home/u/proj/train.py", 57, "train_step")
FWD = ("/home/u/proj/model.py", 20, "forward")
INIT = ("/home/u/proj/model.py", 10, "__init__")
EVAL = ("/home/u/proj/train.py", 80, "validate")


@dataclass
class Training:
    alloc: FakeAllocator
    snap: dict[str, Any]
    params: list[int]
    leaked: list[int]
    oom_at: int | None  # index in the trace of the oom entry
    steps_done: int


def training_snapshot(steps: int = 12, leak: bool = True, oom_step: int | None = None, capacity: int = 400 * MiB,
                      max_entries: int | None = None, side_stream: bool = True) -> Training:
    """A training loop as the allocator sees it: 4 parameters, per step 3 activations (model.py:20
    via nn.Linear), a 256 KiB loss at train.py:57, gradients in backward, Adam state at the first
    step, a side-stream prefetch freed while still in use (free_completed later); with ``leak``
    a validation pass each step whose activations a list keeps (model.py:20 called from
    train.py:80 validate), never freed. ``oom_step`` asks for more than the device has in that
    step, and the loop ends there (the snapshot is taken right after the oom, as an except block
    would)."""
    a = FakeAllocator(capacity, max_entries=max_entries)
    params = [a.malloc(3 * MiB + 1000 * k, _stack(INIT, MAIN, torch_inner=[CALL])) for k in range(4)]
    grads: list[int] = []
    adam: list[int] = []
    leaked: list[int] = []
    oom_at = None
    done = 0
    for step in range(steps):
        try:
            acts = [a.malloc(2 * MiB + 512 * k + 100, _stack(FWD, STEP, MAIN, torch_inner=[LINEAR, CALL]))
                    for k in range(3)]
            if side_stream:
                pre = a.malloc(700 * 1024, _stack(("/home/u/proj/data.py", 33, "prefetch"), MAIN), stream=7)
            loss = a.malloc(256 * 1024, _stack(STEP, MAIN))
            if oom_step is not None and step == oom_step:
                a.malloc(capacity, _stack(FWD, STEP, MAIN, torch_inner=[LINEAR, CALL]))
            if not grads:
                grads = [a.malloc(3 * MiB + 1000 * k, _stack(STEP, MAIN, torch_inner=[BACKWARD, TENSOR_BWD]))
                         for k in range(4)]
            tmp = a.malloc(1 * MiB, _stack(STEP, MAIN, torch_inner=[BACKWARD, TENSOR_BWD]))
            for x in reversed(acts):
                a.free(x)
            a.free(tmp)
            if not adam:
                adam = [a.malloc(3 * MiB + 1000 * k, _stack(("/home/u/proj/train.py", 59, "train_step"), MAIN,
                                                         torch_inner=[ADAM])) for k in range(8)]
            a.free(loss)
            if side_stream:
                a.free(pre, in_use_for=2)
            if leak:
                leaked.append(a.malloc(1536 * 1024, _stack(FWD, EVAL, MAIN, torch_inner=[LINEAR, CALL])))
            done += 1
        except Oom:
            oom_at = len(a.trace) - 1
            break
    a._emit({"action": "snapshot", "addr": 0, "size": 0, "stream": 0})
    return Training(a, snapshot(a), params, leaked, oom_at, done)


# ----- a loop as real files record it ------------------------------------------------------
# The frames of a real snapshot (stacks="all"): the allocator's C++ frames first, then the
# operator's, then Python frames interleaved with the interpreter's C frames, the process's C
# frames last; PyTorch under site-packages; the autograd engine's thread with C++ frames only.
SITE = "/opt/conda/lib/python3.11/site-packages"
_ALLOC_CPP = (("??", 0, "torch::unwind::unwind()"), ("??", 0, "torch::CapturedTraceback::gather(bool, bool, bool)"),
              ("memory_snapshot.cpp", 0, "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
              ("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::"
               "malloc(signed char, unsigned long, CUstream_st*)"),
              ("", 0, "at::detail::empty_generic(c10::ArrayRef<long>, c10::Allocator*, c10::DispatchKeySet, "
               "c10::ScalarType, std::optional<c10::MemoryFormat>)"))
_EVAL = ("??", 0, "_PyEval_EvalFrameDefault")
_MAIN_CPP = (("??", 0, "Py_RunMain"), ("??", 0, "__libc_start_main"), ("??", 0, "_start"))
_ENGINE_CPP = (("??", 0, "torch::autograd::Node::operator()(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)"),
               ("??", 0, "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
                "torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::"
                "ReadyQueue> const&)"),
               ("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
               ("thread48.o", 0, "execute_native_thread_routine"))
CALL_IMPL = (f"{SITE}/torch/nn/modules/module.py", 1750, "_call_impl")
WRAPPED_CALL = (f"{SITE}/torch/nn/modules/module.py", 1739, "_wrapped_call_impl")
EINSUM = (f"{SITE}/einops/einops.py", 916, "einsum")
TRAIN = "/home/u/proj/train.py"
MODEL = "/home/u/proj/model.py"


def real_frames(*python: tuple[str, int, str], op: str = "mm", cpp: bool = True) -> list[dict[str, Any]]:
    """A stack as ``_record_memory_history(stacks="all")`` writes it, ``python`` innermost first
    (``cpp=False``: as ``stacks="python"`` writes it, the Python frames alone)."""
    if not cpp:
        return frames(*python)
    spec: list[tuple[str, int, str]] = [*_ALLOC_CPP, ("RegisterCUDA.cpp", 0, f"at::(anonymous namespace)::wrapper_CUDA_{op}")]
    for f in python:
        spec += [f, _EVAL]
    return frames(*spec, *_MAIN_CPP)


def engine_frames(node: str, cpp: bool = True) -> list[dict[str, Any]]:
    """A stack of the autograd engine's device thread: C++ only (``node`` as ``MmBackward0``);
    with ``stacks="python"`` (``cpp=False``) it has no frame at all."""
    if not cpp:
        return []
    return frames(*_ALLOC_CPP, ("??", 0, f"torch::autograd::generated::{node}::apply(std::vector<at::Tensor, "
                                         "std::allocator<at::Tensor> >&&)"), *_ENGINE_CPP)


def _in_model(*inner: tuple[str, int, str], caller: tuple[str, int, str]) -> tuple[tuple[str, int, str], ...]:
    """Frames of a line of the model's forward (``inner``, innermost first) called through
    ``model(x)`` at ``caller``."""
    return (*inner, (MODEL, 40, "forward"), CALL_IMPL, WRAPPED_CALL, caller, (TRAIN, 120, "main"),
            (TRAIN, 130, "<module>"))


@dataclass
class Loop:
    alloc: FakeAllocator
    snap: dict[str, Any]
    param_bytes: int
    kept: list[int]  # addresses the program's list keeps
    kept_size: int  # bytes of each kept block
    layers: int


def real_loop(steps: int = 6, *, keep: str | None = None, annotate: bool = True, backward: bool = True,
              optimizer: bool = True, layers: int = 3, capacity: int = 4000 * MiB, lazy_state: bool = False,
              cpp: bool = True, oom_step: int | None = None) -> Loop:
    """A training (or evaluation) loop as a real snapshot shows it: parameters made by
    ``model.to("cuda")`` (nn.Module._apply), per step a forward through ``layers`` layers (an
    activation each, a temporary freed at once, one line through einops), logits and a loss; with
    ``backward`` the engine's C++-only allocations (gradient buffers, the parameters' gradients,
    the activations freed as it goes); with ``optimizer`` AdamW's two state tensors per parameter
    at the first step (kept for good) and a temporary each step, inside ``Optimizer.step``
    annotations when ``annotate``; zero_grad(set_to_none=True) frees the gradients before each
    forward. ``keep="logits"`` keeps each step's logits in a list (a leak);
    ``keep="outputs"`` (without backward: an evaluation loop under grad) keeps each step's logits
    and with them every activation of that forward (its graph). ``lazy_state``: the optimizer makes
    the state of parameter k at step k (its state grows over the first steps, then stays);
    ``cpp=False``: frames as ``stacks="python"`` records them. ``oom_step``: in that step's forward,
    after its second layer, a request 2 MiB larger than both the free pieces of the reserved memory
    and what the device has left (a capacity failure; the loop ends there)."""

    def fr(*python: tuple[str, int, str], op: str = "mm") -> list[dict[str, Any]]:
        return real_frames(*python, op=op, cpp=cpp)

    a = FakeAllocator(capacity)
    to = (f"{SITE}/torch/nn/modules/module.py", 1355, "_apply")
    sizes = [4 * MiB + 512 * k for k in range(layers)]
    for n in sizes:  # model.to("cuda")
        a.malloc(n, fr((f"{SITE}/torch/nn/modules/module.py", 1340, "convert"), to,
                       (f"{SITE}/torch/nn/modules/module.py", 1369, "to"), (TRAIN, 20, "build"),
                       (TRAIN, 120, "main"), (TRAIN, 130, "<module>"), op="copy_"))
    grads: list[int] = []
    state: list[int] = []
    kept: list[int] = []
    act_size, logit_size = 3 * MiB, 5 * MiB
    step_line = (TRAIN, 57, "train_step") if backward else (TRAIN, 80, "validate")
    for step in range(steps):
        if annotate and optimizer:
            a.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for g in grads:
            a.free(g)
        grads = []
        if annotate and optimizer:
            a.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
        x = a.malloc(512 * 1024, fr(step_line, (TRAIN, 120, "main"), (TRAIN, 130, "<module>"), op="to"))
        acts = []
        for k in range(layers):
            line = (MODEL, 22 + k, "forward")
            inner = (EINSUM, line) if k == 0 else (line,)
            tmp = a.malloc(1 * MiB, fr(*_in_model(*inner, caller=step_line), op="gelu"))
            acts.append(a.malloc(act_size, fr(*_in_model(*inner, caller=step_line))))
            a.free(tmp)
            if step == oom_step and k == 1:
                try:
                    free = sum(b.size for g in a.segments for b in g.blocks if b.state == "inactive")
                    a.malloc(max(free, capacity - a.reserved) + 2 * MiB,
                             fr(*_in_model((MODEL, 35, "forward"), caller=step_line)))
                except Oom:
                    return Loop(a, snapshot(a), sum(sizes), kept, logit_size, layers)
        logits = a.malloc(logit_size, fr(*_in_model((MODEL, 30, "forward"), caller=step_line)))
        loss = a.malloc(512, fr((TRAIN, 58, "train_step") if backward else (TRAIN, 81, "validate"),
                                         (TRAIN, 120, "main"), (TRAIN, 130, "<module>"), op="mean"))
        if backward:
            ones = a.malloc(512, fr((f"{SITE}/torch/autograd/__init__.py", 220, "_make_grads"),
                                             (f"{SITE}/torch/autograd/__init__.py", 340, "backward"),
                                             (f"{SITE}/torch/_tensor.py", 626, "backward"), (TRAIN, 59, "train_step"),
                                             (TRAIN, 120, "main"), (TRAIN, 130, "<module>"), op="ones_like"))
            gl = a.malloc(logit_size, engine_frames("LogSoftmaxBackward0", cpp))
            a.free(ones)
            for k in reversed(range(layers)):
                gx = a.malloc(act_size, engine_frames("MmBackward0", cpp))
                grads.insert(0, a.malloc(sizes[k], engine_frames("MmBackward0", cpp)))  # AccumulateGrad keeps it
                a.free(acts[k])
                a.free(gx)
            a.free(gl)
            acts = []
        if optimizer:
            if annotate:
                a.annotate("Optimizer.step#AdamW.step", "START")
            opt = [(f"{SITE}/torch/optim/adamw.py", 520, "_single_tensor_adamw"),
                   (f"{SITE}/torch/optim/adamw.py", 230, "step"), (f"{SITE}/torch/optim/optimizer.py", 493, "wrapper"),
                   (TRAIN, 60, "train_step"), (TRAIN, 120, "main"), (TRAIN, 130, "<module>")]
            for k, n in enumerate(sizes):
                if len(state) < 2 * (k + 1) and (not lazy_state or k <= step):
                    state.append(a.malloc(n, fr(*opt, op="zeros_like")))  # exp_avg
                    state.append(a.malloc(n, fr(*opt, op="zeros_like")))  # exp_avg_sq
            a.free(a.malloc(max(sizes), fr(*opt, op="addcdiv")))
            if annotate:
                a.annotate("Optimizer.step#AdamW.step", "END")
        a.free(loss)
        a.free(x)
        if keep in ("logits", "outputs"):
            kept.append(logits)
        else:
            a.free(logits)
        if not backward and keep != "outputs":
            for t in acts:  # the output is dropped: its graph, and the activations with it
                a.free(t)
    a._emit({"action": "snapshot", "addr": 0, "size": 0, "stream": 0})
    return Loop(a, snapshot(a), sum(sizes), kept, logit_size + (0 if keep != "outputs" else layers * act_size),
                layers)
