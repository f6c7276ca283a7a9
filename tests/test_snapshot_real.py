"""CUDA memory snapshots taken on real GPUs by other people (``tests/data/snapshots``, its README says
where each comes from and what the program did), held to what a right diagnosis says about them:
every figure checked against an account written here from the raw file (a replay backwards from
the allocator's end state, the frames read directly), and the allocator model of
``gradscope.predict`` replayed over each file's own allocations and frees against its reserved peak.
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

import gradscope as gs
from gradscope.predict import estimate_cuda_allocator
from gradscope.recording import format_bytes
from gradscope.snapshot import (
    Role,
    SnapshotDiagnosis,
    accumulating_lines,
    bytes_by_role,
    fragmentation,
    snapshot_data,
    trace_passes,
    trace_steps,
)

DATA = Path(__file__).resolve().parent / "data" / "snapshots"
FILES = sorted(p.name for p in DATA.glob("*.pickle.gz"))
LIVE = {"active_allocated", "active_pending_free", "active_awaiting_free"}


@dataclass(frozen=True)
class Raw:
    """The file's snapshot dict and what this test computes from it alone."""

    snap: dict[str, Any]
    trace: list[dict[str, Any]]
    live: list[int]  # allocated bytes after each event (index p + 1; index 0: before the first)
    reserved: list[int]
    pre: dict[int, tuple[int, int]]  # address -> (size, position of its free or -1) of blocks alive before the trace


def _block_size(b: dict[str, Any]) -> int:
    if "requested_size" in b:
        return int(b["requested_size"])
    return int(b["history"][0]["real_size"]) if b.get("history") else int(b["size"])


@cache
def raw(name: str) -> Raw:
    """Allocated and reserved bytes after every event, replayed backwards from the end state (the
    segments are the allocator's state right after the last event)."""
    with gzip.open(DATA / name, "rb") as f:
        snap = pickle.load(f)  # a file of this repository's tests
    trace = snap["device_traces"][0]
    end = [b for s in snap["segments"] for b in s["blocks"] if b["state"] in LIVE]
    live = [sum(_block_size(b) for b in end)]
    reserved = [sum(s["total_size"] for s in snap["segments"])]
    for e in reversed(trace):
        a, r = live[-1], reserved[-1]
        if e["action"] == "alloc":
            a -= e["size"]
        elif e["action"] == "free_completed":
            a += e["size"]
        elif e["action"] == "segment_alloc":
            r -= e["size"]
        elif e["action"] == "segment_free":
            r += e["size"]
        live.append(a)
        reserved.append(r)
    live.reverse()
    reserved.reverse()
    # alive before the trace: an address whose first event is a free, or an end-state block no event touched
    seen: set[int] = set()
    pre: dict[int, tuple[int, int]] = {}
    for p, e in enumerate(trace):
        if e["action"] in ("alloc", "free_requested", "free_completed") and e["addr"] not in seen:
            seen.add(e["addr"])
            if e["action"] != "alloc":
                pre[e["addr"]] = (e["size"], next(q for q in range(p, len(trace)) if trace[q]["action"] ==
                                                  "free_completed" and trace[q]["addr"] == e["addr"]))
    for s in snap["segments"]:
        at = s["address"]
        for b in s["blocks"]:
            addr = b.get("address", at)
            at = addr + b["size"]
            if b["state"] in LIVE and addr not in seen:
                pre[addr] = (_block_size(b), -1)
    return Raw(snap, trace, live, reserved, pre)


@cache
def loaded(name: str) -> tuple[gs.Recording, SnapshotDiagnosis]:
    rec = gs.load_snapshot(DATA / name)
    d = gs.diagnose(rec)
    assert isinstance(d, SnapshotDiagnosis)
    return rec, d


def _names(e: dict[str, Any]) -> list[str]:
    return [f["name"] for f in e.get("frames", [])]


def _files(e: dict[str, Any]) -> list[str]:
    return [f["filename"] for f in e.get("frames", [])]


def _allocs(r: Raw) -> Iterator[tuple[int, dict[str, Any], int]]:
    """Each alloc of the trace: its position, entry and the position of its free_completed (-1 never)."""
    open_: dict[int, int] = {}
    free_at: dict[int, int] = {}
    for p, e in enumerate(r.trace):
        if e["action"] == "alloc":
            open_[e["addr"]] = p
        elif e["action"] == "free_completed" and e["addr"] in open_:
            free_at[open_.pop(e["addr"])] = p
    for p, e in enumerate(r.trace):
        if e["action"] == "alloc":
            yield p, e, free_at.get(p, -1)


def _alive(p: int, free: int, at: int) -> bool:
    return p <= at and (free < 0 or free > at)


# ----- every file ----------------------------------------------------------------------------------
def test_the_files_are_here() -> None:
    assert FILES == ["llm1.3b_inference_no_history.pickle.gz", "lm2.7b_ctx128_adamw_step.pickle.gz",
                     "lm2.7b_ctx128_earlier_run.pickle.gz", "lm2.7b_ctx128_forward_only.pickle.gz",
                     "lm2.7b_ctx128_forward_only_bf16.pickle.gz"]


@pytest.mark.parametrize("name", FILES)
def test_every_file_replays_and_its_roles_add_up(name: str) -> None:
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    assert rec.peak_bytes == max(r.live) and rec.reserved_peak_bytes == max(r.reserved)
    for p in [*range(-1, data.events, 97), data.peak_at, data.events - 1]:
        assert data.live_bytes(p) == r.live[p + 1] and data.reserved_bytes(p) == r.reserved[p + 1]
    for at in (data.peak_at, max(data.events - 1, -1)):
        roles = bytes_by_role(data, at)
        assert sum(x.bytes for x in roles) == r.live[at + 1] == data.live_bytes(at)
        assert sum(x.blocks for x in roles) == sum(1 for p, _, f in _allocs(r) if _alive(p, f, at)) + sum(
            1 for _, f in r.pre.values() if f < 0 or f > at)
        # memory made before the trace is exactly what the file says was alive then
        before = next((x.bytes for x in roles if x.role is Role.BEFORE_TRACE), 0)
        assert before == sum(s for s, f in r.pre.values() if f < 0 or f > at)
    assert sum(x.bytes for x in d.by_role) == d.allocated == r.live[d.at + 1]


@pytest.mark.parametrize("name", FILES)
def test_no_finding_carries_code_or_names_a_cpp_frame(name: str) -> None:
    _, d = loaded(name)
    assert len(d.findings) <= 5
    text = d.text()
    assert "code:" not in text and "torch::" not in text and "unwind" not in text
    for f in d.findings:
        assert not hasattr(f, "code")
        assert f.key is None or ("::" not in f.key and "einops" not in f.key and "_backends" not in f.key)
    for row in d.by_line:  # the user's lines, never inside an installed package or a C++ function's name
        assert "::" not in row.key and not row.key.startswith(("_backends.py", "einops.py"))


@pytest.mark.parametrize("name", FILES)
def test_the_allocator_model_gives_the_reserved_peak(name: str) -> None:
    """estimate_cuda_allocator over the file's own sequence: what was alive before the trace first
    (by address), then every alloc and free_completed in order."""
    r = raw(name)
    rec, _ = loaded(name)
    events: list[tuple[Any, int]] = [(("pre", a), s) for a, (s, _) in sorted(r.pre.items())]
    episode: dict[int, Any] = {a: ("pre", a) for a in r.pre}
    for p, e in enumerate(r.trace):
        if e["action"] == "alloc":
            episode[e["addr"]] = ("alloc", p)
            events.append((episode[e["addr"]], e["size"]))
        elif e["action"] == "free_completed":
            events.append((episode.pop(e["addr"]), -e["size"]))
    model = estimate_cuda_allocator(events)
    made_in_trace = any(e["action"] == "alloc" for e in r.trace)
    if made_in_trace:
        assert model.reserved_peak == rec.reserved_peak_bytes == max(r.reserved)
    else:
        # the cached segments came before the history: the model packs the live blocks from an
        # empty cache and cannot know them (its notes say so)
        assert sum(-(-s // 512) * 512 for s, _ in r.pre.values()) <= model.reserved_peak < rec.reserved_peak_bytes
        p = gs.predict(_step, torch.nn.Linear(4, 4), torch.randn(2, 4), device="cuda")
        assert any(n.startswith("CUDA estimate") and "the segments obtained before the step" in n for n in p.notes)


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


# ----- what a right diagnosis says, file by file -----------------------------------------------------
def test_adamw_step_parameters_activations_gradients_and_state() -> None:
    name = "lm2.7b_ctx128_adamw_step.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    assert [p.kind for p in trace_passes(data)] == ["forward", "backward", "optimizer step"]
    steps = trace_steps(data)
    assert steps.source == "annotations" and steps.count == 1
    # where the backward and the step begin, from the frames alone
    allocs = list(_allocs(r))
    bwd = min(p for p, e, _ in allocs if any("torch::autograd::Engine::" in n for n in _names(e))
              or any(f.endswith("torch/autograd/__init__.py") for f in _files(e)))
    opt = min(p for p, e, _ in allocs if any("/torch/optim/" in f for f in _files(e)))
    assert (trace_passes(data)[1].start, trace_passes(data)[2].start) == (bwd, opt)
    roles = {x.role: x.bytes for x in bytes_by_role(data, d.at)}
    # optimizer state: made in the optimizer's step and still alive after it (the trace's end)
    state = sum(e["size"] for p, e, f in allocs if p >= opt and f < 0 and any("/torch/optim/" in x for x in _files(e)))
    assert roles[Role.OPTIMIZER_STATE] == state
    # AdamW's two tensors per parameter: exp_avg (optimizers.py:82) and exp_avg_sq (:84), equal
    by_line = {row.key: row.bytes for row in d.by_line}
    assert by_line["optimizers.py:82 step"] == by_line["optimizers.py:84 step"] == state // 2
    # gradients: the engine's (C++ only) allocations still alive when the step began
    grads = sum(e["size"] for p, e, f in allocs if bwd <= p < opt and _alive(p, f, opt)
                and all(not x.endswith(".py") for x in _files(e)))
    assert roles[Role.GRADIENTS] == grads and by_line["(backward: C++ frames only)"] == grads
    # the parameters were there before the trace
    assert roles[Role.BEFORE_TRACE] == sum(s for s, f in r.pre.values() if f < 0)
    # activations: built in forward, freed in backward; what the forward left alive at its end
    fwd_end = bwd - 1
    acts = sum(e["size"] for p, e, f in allocs if p < bwd and _alive(p, f, fwd_end))
    at_fwd_end = {x.role: x.bytes for x in bytes_by_role(data, fwd_end)}
    assert at_fwd_end[Role.ACTIVATIONS] == acts > 5 << 30 and trace_passes(data)[0].kept == acts
    assert roles[Role.ACTIVATIONS] < acts // 100  # the backward freed them
    # nothing accumulates across steps (there is one step), and optimizer state is never a leak
    assert d.findings == () and d.accumulating == ()
    assert "findings: none: the trace holds 1 step end, too few to tell whether memory grows" in d.text()
    assert "optimizer state: 25.4 GiB in 582 blocks — made in an optimizer's step" in d.text()


def test_a_saved_recording_keeps_the_annotations_and_the_diagnosis(tmp_path: Path) -> None:
    name = "lm2.7b_ctx128_adamw_step.pickle.gz"
    rec, d = loaded(name)
    rec.save(tmp_path / "r.gscope.json")
    back = gs.load(tmp_path / "r.gscope.json")
    assert snapshot_data(back).annotations == snapshot_data(rec).annotations
    assert [(a.name, a.stage) for a in snapshot_data(rec).annotations] == [
        ("Optimizer.zero_grad#AdamW.zero_grad", "START"), ("Optimizer.zero_grad#AdamW.zero_grad", "END"),
        ("Optimizer.step#AdamW.step", "START"), ("Optimizer.step#AdamW.step", "END")]
    assert gs.diagnose(back).text() == d.text()


@pytest.mark.parametrize("name, line", [("lm2.7b_ctx128_forward_only.pickle.gz", 222),
                                        ("lm2.7b_ctx128_forward_only_bf16.pickle.gz", 224)])
def test_a_forward_whose_graph_no_backward_uses_is_one_finding(name: str, line: int) -> None:
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    at = d.at
    assert d.moment == "peak" and at == data.peak_at
    (f,) = d.findings
    assert f.pattern == "unused_graph" and f.role is Role.ACTIVATIONS
    # what the forward made and never freed: the activations its output's graph holds
    held = [(e, fr) for p, e, fr in _allocs(r) if _alive(p, fr, at) and fr < 0]
    assert f.bytes == sum(e["size"] for e, _ in held)
    # the line that called the model: the benchmark's, outside the outermost nn.Module call
    largest = max(held, key=lambda x: x[0]["size"])[0]["frames"]
    outer = max(i for i, x in enumerate(largest) if x["filename"].endswith("torch/nn/modules/module.py"))
    caller = next(x for x in largest[outer:] if x["filename"].endswith("benchmark.py"))
    assert caller["line"] == line and f.key == f"benchmark.py:{line} run_memory_foward_fullstep"
    assert f"the forward called at benchmark.py:{line} run_memory_foward_fullstep left {format_bytes(f.bytes)} " \
           "of activations" in f.message
    assert "torch.no_grad() or torch.inference_mode()" in f.suggestion
    cast = sum(e["size"] for e, _ in held if any("at::autocast::cached_cast" in n for n in _names(e)))
    if "bf16" in name:
        assert cast > 5 << 30 and f"{format_bytes(cast)} of it are autocast's lower-precision copies" in f.message
    else:
        assert cast == 0 and "autocast" not in f.message
    assert trace_steps(data).count == 0  # one forward: the layers repeat inside the model, not a loop


def test_an_earlier_run_has_no_leak() -> None:
    name = "lm2.7b_ctx128_earlier_run.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    assert not d.accumulating and all(f.pattern == "unused_graph" for f in d.findings)
    # compilation and autotuning (each benchmark frees what it made), then one compiled forward whose
    # activations are alive at the end: no line's memory grows from one turn to the next
    data = snapshot_data(rec)
    assert [p.kind for p in trace_passes(data)] == ["forward"] and trace_steps(data).count == 0
    assert accumulating_lines(data, group="line") == ()
    (f,) = d.findings
    assert f.bytes == sum(e["size"] for p, e, fr in _allocs(r) if fr < 0)


def test_a_file_without_history_says_what_cannot_be_known() -> None:
    name = "llm1.3b_inference_no_history.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    blocks = [b for s in r.snap["segments"] for b in s["blocks"]]
    assert [(x.role, x.bytes) for x in d.by_role] == [(Role.BEFORE_TRACE, d.allocated)]
    assert d.findings == () and d.accumulating == () and trace_steps(data).count == 0
    text = d.text()
    assert "trace: no allocation history (the segments and blocks when the snapshot was taken): no passes, no " \
           "steps, no lifetimes" in text
    assert "When each was made and freed, and so its role and whether memory grows from step to step, cannot " \
           "be known" in rec.notes[0]
    # allocated, reserved and the free pieces, as the blocks say
    end = fragmentation(data, data.events - 1)
    inactive = [b["size"] for b in blocks if b["state"] == "inactive"]
    assert (end.free_bytes, end.free_pieces) == (sum(inactive), len(inactive))
    assert end.reserved == sum(s["total_size"] for s in r.snap["segments"])
    # the blocks' own frames (the PyTorch 2.0 format keeps them in 'history') name the lines
    assert d.by_line[0].key == "pytorch_backend.py:195 allocate"
    assert d.by_line[0].bytes == sum(_block_size(b) for b in blocks if b["state"] in LIVE and b["history"][0][
        "frames"][0]["line"] == 195)
