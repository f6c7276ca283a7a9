"""``memory="cuda"``: the caching allocator's statistics and history, and NVML's device totals.

The allocated and reserved bytes (with ``history=True`` the allocator's event history), behind one
boundary (:class:`CudaStats`) that tests without a GPU replace; NVML's totals through
``nvidia-ml-py`` when present.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from gradscope._base import compat as _compat
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.trace import MemoryTrace
from gradscope._capture.memory.source import AllocEvent, _inside_only, _no_context

__all__ = ["CudaSource", "CudaStats", "cuda_stats", "nvml_device_totals"]


# --------------------------------------------------------------------------------------
# CUDA: the caching allocator (behind one boundary; exercised only where a GPU exists)
# --------------------------------------------------------------------------------------
class CudaStats(Protocol):
    """The boundary to the CUDA caching allocator: what :class:`CudaSource` reads, nothing more.

    ``torch.cuda`` satisfies it (see :class:`_TorchCudaStats`); tests on machines without a GPU
    pass a fake with the same methods, so the logic above the boundary is tested everywhere.
    """

    def synchronize(self, device: Any) -> None: ...
    def reset_peak_memory_stats(self, device: Any) -> None: ...
    def memory_allocated(self, device: Any) -> int: ...
    def max_memory_allocated(self, device: Any) -> int: ...
    def memory_reserved(self, device: Any) -> int: ...
    def max_memory_reserved(self, device: Any) -> int: ...
    def current(self, device: Any) -> tuple[int, int]: ...
    def total_memory(self, device: Any) -> int: ...
    def start_history(self, max_entries: int) -> None: ...
    def stop_history(self, device: Any) -> dict[str, Any]: ...
    def dump_snapshot(self, path: str) -> None: ...


class _TorchCudaStats:
    """``torch.cuda``'s allocator statistics and history behind the :class:`CudaStats` boundary."""

    def synchronize(self, device: Any) -> None:
        torch.cuda.synchronize(device)

    def reset_peak_memory_stats(self, device: Any) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_allocated(self, device: Any) -> int:
        return self.current(device)[0]  # see NOTE [ reading the allocator's figures ] in gradscope._base.compat

    def max_memory_allocated(self, device: Any) -> int:
        return int(torch.cuda.max_memory_allocated(device))

    def memory_reserved(self, device: Any) -> int:
        return self.current(device)[1]

    def max_memory_reserved(self, device: Any) -> int:
        return int(torch.cuda.max_memory_reserved(device))

    def current(self, device: Any) -> tuple[int, int]:
        """(allocated, reserved) now, read once (see NOTE [ reading the allocator's figures ] in
        gradscope._base.compat)."""
        index = device if isinstance(device, int) else torch.device(device).index
        return _compat.cuda_allocated_reserved(index or 0)

    def total_memory(self, device: Any) -> int:
        return int(torch.cuda.get_device_properties(device).total_memory)

    def start_history(self, max_entries: int) -> None:
        _compat.cuda_start_history(max_entries)

    def stop_history(self, device: Any) -> dict[str, Any]:
        return _compat.cuda_stop_history(device)

    def dump_snapshot(self, path: str) -> None:
        """The allocator's state and history as PyTorch writes it (``gs.load_snapshot`` and
        PyTorch's memory_viz read it); call while the history is on."""
        torch.cuda.memory._dump_snapshot(path)


def cuda_stats() -> CudaStats:
    """The CUDA allocator boundary (``torch.cuda``'s; tests replace ``_TorchCudaStats``)."""
    return _TorchCudaStats()


class CudaSource:
    """CUDA memory from the caching allocator.

    ``peak_bytes`` is the allocator's own peak of allocated bytes during the block minus what was
    allocated before it (exact). The timeline is sampled online: the allocated and reserved bytes
    at every module entry and exit and around every backward step, each sample labelled with the
    module or node running; with ``history=True`` it is instead rebuilt from the allocator's event
    history (every allocation and free, labelled by the allocating frame).
    """

    kind = MemoryKind.CUDA

    def __init__(self, device: torch.device | None = None, history: bool = False,
                 max_entries: int = 100_000, context: Callable[[], tuple[int | None, int | None]] | None = None,
                 stats: CudaStats | None = None) -> None:
        self.stats: CudaStats = stats if stats is not None else _TorchCudaStats()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.history = history
        self.max_entries = max_entries
        self.context = context or _no_context
        self.events: list[AllocEvent] = []
        self.baseline = 0
        self._last = 0
        self._call: int | None = None

    def start(self) -> None:
        st = self.stats
        st.synchronize(self.device)
        st.reset_peak_memory_stats(self.device)
        self.baseline = st.memory_allocated(self.device)
        self._last = 0
        if self.history:
            st.start_history(self.max_entries)
        self._t0 = time.time_ns()

    def mark(self, label: str) -> None:
        """Add a timeline point with the allocator's current figures (called from the hooks)."""
        if self.history:
            return
        allocated, reserved = self.stats.current(self.device)
        self._sample(allocated, reserved, label)

    def _sample(self, allocated: int, reserved: int, label: str) -> None:
        live = allocated - self.baseline
        delta, self._last = live - self._last, live
        step, _ = self.context()
        self.events.append(AllocEvent(time.time_ns(), delta, 0, label, None, step, reserved, self._call))

    def drain(self) -> None:
        pass

    def boundary(self, done: str | None, following: str | None) -> int:
        """One reading of the allocator between two backward steps: the sample after the step
        that ended, the one before the next (without the history) and the live bytes."""
        allocated, reserved = self.stats.current(self.device)
        if not self.history:
            if done is not None:
                self._sample(allocated, reserved, done)
            if following is not None:
                self._sample(allocated, reserved, following)
        return allocated - self.baseline

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        prev = self._call
        if kind == "module":
            self._call = index
            self.mark(label)
        return prev

    def call_exit(self, token: Any, label: str) -> None:
        if label:
            self.mark(label + " done")
        self._call = token

    def stop(self) -> MemoryTrace:
        st = self.stats
        st.synchronize(self.device)
        if not self.history:
            self._call = None
            self.mark("end of block")
        peak = st.max_memory_allocated(self.device) - self.baseline
        reserved_peak = st.max_memory_reserved(self.device)
        nv = nvml_device_totals(self.device.index or 0)
        total = nv["total"] if nv else st.total_memory(self.device)
        events = self.events
        if self.history:
            snap = st.stop_history(self.device)
            events = _events_from_snapshot(snap, self.device.index or 0, self._t0, time.time_ns())
        return MemoryTrace(source=self.kind, device=str(self.device), online=True,
                           key_kind="address" if self.history else "none", events=events,
                           marks_calls=not self.history,
                           baseline=self.baseline, peak=peak, reserved_peak=reserved_peak, total=total)

    def live(self) -> int:
        return self.stats.memory_allocated(self.device) - self.baseline

    def cut(self) -> MemoryTrace:
        """The samples since the last cut (see NOTE [ iterations ] in gradscope._passes.iterations); not with
        the allocator's history, which is read once, when the block ends."""
        self.mark("end of piece")
        events, self.events = self.events, []
        peak = self.stats.max_memory_allocated(self.device) - self.baseline
        return MemoryTrace(source=self.kind, device=str(self.device), online=True, key_kind="none", events=events,
                           baseline=self.baseline, peak=peak)


def _events_from_snapshot(snap: dict[str, Any], index: int, t0_ns: int, t1_ns: int) -> list[AllocEvent]:
    """Allocation and completed-free events of one device, in the allocator's order. Their times
    are used when they fall inside the block; otherwise events are spread evenly over it."""
    traces = snap.get(_compat.SNAPSHOT_TRACES, [])
    if index >= len(traces):
        return []
    out: list[AllocEvent] = []
    for e in traces[index]:
        action = e.get(_compat.TRACE_ACTION)
        if action not in ("alloc", "free_completed"):
            continue
        frames = e.get(_compat.TRACE_FRAMES) or []
        label = str(frames[0].get("name", "")) if frames else action
        size = int(e[_compat.TRACE_SIZE]) if action == "alloc" else -int(e[_compat.TRACE_SIZE])
        out.append(AllocEvent(int(e.get(_compat.TRACE_TIME_US, 0)) * 1000, size, int(e[_compat.TRACE_ADDR]), label))
    if not all(t0_ns <= ev.t_ns <= t1_ns for ev in out):
        step = (t1_ns - t0_ns) / max(len(out), 1)
        out = [ev._replace(t_ns=t0_ns + int(k * step)) for k, ev in enumerate(out)]
    return _inside_only(out)


_nvml_missing = False  # NVML's library was looked for and is not on this machine


def nvml_device_totals(index: int = 0) -> dict[str, int] | None:
    """Whole-device memory from NVML (``nvidia-ml-py``): ``{"total", "used", "free"}``.

    None when NVML is not installed or no NVIDIA driver is present: normal on CPU machines. A
    driver library found missing once is not looked for again: each try makes a new ctypes
    library object, whose function-pointer class is cyclic garbage (see NOTE [ no cycles through
    the recorder ] in :mod:`gradscope._capture.saves`).
    """
    global _nvml_missing
    if _nvml_missing:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except getattr(pynvml, "NVMLError_LibraryNotFound", ()):
        _nvml_missing = True
        return None
    except Exception:  # no device, a driver too old, ...: asked again next time
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {"total": int(info.total), "used": int(info.used), "free": int(info.free)}
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
