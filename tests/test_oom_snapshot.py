"""``%gradscope oom on`` on CUDA saves the allocator snapshot of a cell that runs out of memory, and
``gs.load_snapshot`` of that file gives the diagnosis it printed.

No GPU here: the CUDA allocator boundary (``gradscope.memory.CudaStats``) is a fake backed by the
fake caching allocator of ``_snapshots.py``; the cell allocates through it, as PyTorch's CUDA
tensors would, and its OOM is raised as ``torch.OutOfMemoryError`` with the allocator's message.
What is tested is everything above the boundary: the history on while the cell runs, the file
written before the recording finishes (which turns the history off), its name and place, the
message, and the diagnosis read back from the file.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _snapshots import FakeAllocator, MiB, Oom, frames, snapshot, write
from IPython.testing import globalipapp

import gradscope as gs
from gradscope._capture.memory import cuda as memory_cuda

CELL = "/tmp/ipykernel_4242/1234567.py"


class FakeCuda:
    """``CudaStats`` over a FakeAllocator: statistics from its ground truth, the history from its
    trace (restarted by ``start_history``), the snapshot file from its segments and trace."""

    def __init__(self, alloc: FakeAllocator) -> None:
        self.a = alloc
        self.history = False
        self.dumps: list[tuple[str, bool]] = []  # (path, history on when written)
        self._from = 0

    def synchronize(self, device: Any) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any) -> None:
        self._from = len(self.a.truth)

    def memory_allocated(self, device: Any) -> int:
        return sum(r for r, _, _ in self.a.live.values())

    def max_memory_allocated(self, device: Any) -> int:
        return max([self.memory_allocated(device)] + [t[0] for t in self.a.truth[self._from:]])

    def memory_reserved(self, device: Any) -> int:
        return self.a.reserved

    def max_memory_reserved(self, device: Any) -> int:
        return max([self.a.reserved] + [t[1] for t in self.a.truth[self._from:]])

    def current(self, device: Any) -> tuple[int, int]:
        return self.memory_allocated(device), self.memory_reserved(device)

    def total_memory(self, device: Any) -> int:
        return self.a.capacity

    def start_history(self, max_entries: int) -> None:
        self.history = True
        self.a.trace.clear()  # the allocator keeps what happens from now on

    def stop_history(self, device: Any) -> dict[str, Any]:
        self.history = False
        return snapshot(self.a)

    def dump_snapshot(self, path: str) -> None:
        self.dumps.append((path, self.history))
        write(path, snapshot(self.a))


class Gpu:
    """What the cell calls to allocate 'on the GPU' (a tensor's storage, as far as the allocator
    sees it): the fake allocator, with its OOM raised as PyTorch raises it."""

    def __init__(self, alloc: FakeAllocator) -> None:
        self.a = alloc

    def empty(self, nbytes: int, line: int, name: str = "<module>") -> int:
        fr = frames((f"{os.path.dirname(torch.__file__)}/_tensor.py", 10, "new"), (CELL, line, name))
        try:
            return self.a.malloc(nbytes, fr)
        except Oom:
            free = self.a.capacity - self.a.reserved
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB. GPU 0 has a total capacity of "
                f"{self.a.capacity / MiB:.2f} MiB of which {free / MiB:.2f} MiB is free."
            ) from None


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Any, FakeCuda, FakeAllocator]]:
    alloc = FakeAllocator(64 * MiB)
    fake = FakeCuda(alloc)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(memory_cuda, "_TorchCudaStats", lambda: fake)
    monkeypatch.chdir(tmp_path)
    ip = globalipapp.get_ipython() or globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "gradscope")
    ip.user_ns["gpu"] = Gpu(alloc)
    try:
        yield ip, fake, alloc
    finally:
        ip.run_line_magic("unload_ext", "gradscope")
        for name in ("gpu", "kept", "w", "_gs_recording"):
            ip.user_ns.pop(name, None)


LEAK = (
    "kept = []\n"
    "w = gpu.empty(8 << 20, 2)\n"  # 'parameters'
    "for step in range(1000):\n"
    "    acts = [gpu.empty(2 << 20, 5) for _ in range(3)]\n"  # a step's activations, freed below
    "    for a in acts: gpu.a.free(a)\n"
    "    kept.append(gpu.empty(1536 << 10, 7, 'validate'))\n"  # a list that keeps every step's output
)


def test_a_cuda_oom_saves_the_snapshot_and_the_file_gives_the_same_diagnosis(
        shell: tuple[Any, FakeCuda, FakeAllocator], capsys: Any, tmp_path: Path) -> None:
    ip, fake, alloc = shell
    ip.run_line_magic("gradscope", "oom on --memory cuda")
    status = capsys.readouterr().out
    assert "a CUDA OOM also saves its snapshot in '.'" in status
    ip.run_cell(LEAK)
    out = capsys.readouterr().out
    path = tmp_path / "gradscope-oom-1.pickle"
    assert path.exists() and fake.dumps == [("./gradscope-oom-1.pickle", True)]  # written while the history was on
    assert not fake.history  # and the recording turned it off afterwards
    assert "gradscope: the allocator's history of this cell is saved as ./gradscope-oom-1.pickle" in out
    # the diagnosis printed is the one the file gives, word for word
    d = gs.diagnose(gs.load_snapshot(path))
    assert d.text() in out
    # ... and it is about this failure: the request, what was live, the list that kept the outputs
    oom = alloc.trace[-1]
    assert oom["action"] == "oom" and d.request == oom["size"] == 2 << 20
    steps = len(ip.user_ns["kept"])
    assert d.allocated == 8 * MiB + steps * 1536 * 1024 + sum(
        r for r, _, fr in alloc.live.values() if fr[-1]["line"] == 5)
    acc = [f for f in d.findings if f.pattern == "accumulating"]
    assert len(acc) == 1 and acc[0].bytes == steps * 1536 * 1024
    assert acc[0].key.startswith("1234567.py:7 validate")
    # the watch's own recording is kept and diagnosed before, as on every OOM
    rec = ip.user_ns["_gs_recording"]
    assert rec.where.memory_source == "cuda caching allocator" and not rec.complete
    assert out.index("gradscope diagnosis") < out.index("saved as ./gradscope-oom-1.pickle")
    # the file is what PyTorch's _dump_snapshot writes: a plain pickle of the snapshot dict
    with open(path, "rb") as fh:
        raw = pickle.load(fh)
    assert set(raw) >= {"segments", "device_traces"} and raw["device_traces"][0][-1]["action"] == "oom"


def test_the_next_oom_never_overwrites_and_a_directory_is_honoured(
        shell: tuple[Any, FakeCuda, FakeAllocator], capsys: Any, tmp_path: Path) -> None:
    ip, fake, alloc = shell
    ip.run_line_magic("gradscope", "oom on --memory cuda --snapshot-dir snaps")
    ip.run_cell("x = gpu.empty(80 << 20, 1)")
    ip.run_cell("y = gpu.empty(90 << 20, 1)")
    out = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "snaps")) == ["gradscope-oom-1.pickle", "gradscope-oom-2.pickle"]
    assert "saved as snaps/gradscope-oom-2.pickle" in out
    d = gs.diagnose(gs.load_snapshot(tmp_path / "snaps" / "gradscope-oom-2.pickle"))
    assert d.request == 90 * MiB and [f.pattern for f in d.findings] == ["request_too_large"]
    ip.user_ns.pop("x", None), ip.user_ns.pop("y", None)


def test_a_snapshot_that_cannot_be_written_never_hides_the_traceback(
        shell: tuple[Any, FakeCuda, FakeAllocator], capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ip, fake, alloc = shell

    def refuse(path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fake, "dump_snapshot", refuse)
    ip.run_line_magic("gradscope", "oom on --memory cuda")
    res = ip.run_cell("x = gpu.empty(80 << 20, 1)")
    out = capsys.readouterr()
    assert isinstance(res.error_in_exec, torch.OutOfMemoryError)
    assert "could not save the allocator snapshot of this OOM (OSError: [Errno 28] No space left on device)" in out.out
    assert "OutOfMemoryError" in out.out + out.err  # the traceback still shows


def test_cells_that_do_not_fail_save_nothing(shell: tuple[Any, FakeCuda, FakeAllocator], capsys: Any,
                                             tmp_path: Path) -> None:
    ip, fake, alloc = shell
    ip.run_line_magic("gradscope", "oom on --memory cuda")
    ip.run_cell("x = gpu.empty(1 << 20, 1)")
    assert fake.dumps == [] and list(tmp_path.iterdir()) == []
    ip.user_ns.pop("x", None)
