"""CUDA memory snapshots: safe loading, exact replay, the questions the views and the diagnosis ask.

Snapshots are written here, from the documented format, by ``_snapshots.FakeAllocator`` (no GPU),
which keeps its own ground truth of allocated and reserved bytes after every event, including the
events its ring buffer dropped. A second, naive replay in this file walks the trace backwards from
the snapshot's end state: a different algorithm from gradscope's forward pairing by address.
"""

from __future__ import annotations

import copyreg
import gzip
import io
import json
import os
import pickle
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _snapshots import TORCH, FakeAllocator, MiB, Oom, frames, snapshot, training_snapshot, write

import gradscope as gs
from gradscope.recording import Phase, Recording
from gradscope.snapshot import (
    TIMELINE_POINTS,
    OomCause,
    SnapshotData,
    accumulating_lines,
    bytes_by_line,
    fragmentation,
    group_of,
    live_blocks,
    load_snapshot_devices,
    memory_by_group,
    read_snapshot,
    snapshot_data,
    timeline_positions,
    trace_steps,
)

# ----- an independent replay ------------------------------------------------------------------


def _is_torch(fn: str) -> bool:
    return fn.startswith(TORCH + "/")


def _line_of(fr: list[dict[str, Any]]) -> str:
    if not fr:
        return "(no stack recorded)"
    for f in fr:
        if not _is_torch(f["filename"]):
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    raise AssertionError("every test stack has a user frame")


def naive_states(snap: dict[str, Any], device: int = 0) -> list[dict[int, tuple[int, str, int]]]:
    """Live allocations (address -> size, allocating line, stream) before the first event (index
    0) and after each event (index p + 1), found by walking the trace backwards from the
    snapshot's end state."""
    trace = snap["device_traces"][device]
    live: dict[int, tuple[int, str, int]] = {}
    for seg in snap["segments"]:
        if seg.get("device", 0) != device:
            continue
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                live[b["address"]] = (b["requested_size"], _line_of(b["frames"]), seg["stream"])
    states = [dict(live)]
    for e in reversed(trace):
        if e["action"] == "alloc":
            del live[e["addr"]]
        elif e["action"] == "free_completed":
            live[e["addr"]] = (e["size"], "?", e["stream"])
        states.append(dict(live))
    states.reverse()
    # lines of allocations made before the trace are unknown to the backward walk; fill them in
    # forwards from the alloc events that are in the trace
    line_at: dict[int, str] = {}
    for p, e in enumerate(trace):
        if e["action"] == "alloc":
            line_at[e["addr"]] = _line_of(e["frames"])
        state = states[p + 1]
        for a, (size, line, stream) in list(state.items()):
            if line == "?" and a in line_at:
                state[a] = (size, line_at[a], stream)
    return states


def _naive_by_line(state: dict[int, tuple[int, str, int]]) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = {}
    for size, line, _ in state.values():
        row = out.setdefault(line, [0, 0])
        row[0] += size
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _truth(alloc: FakeAllocator, p: int) -> tuple[int, int]:
    return alloc.truth[alloc.first_kept + p]


# ----- replay against the ground truth ---------------------------------------------------------


@pytest.mark.parametrize("max_entries", [None, 60, 7])
def test_replay_matches_the_allocator_at_every_event(max_entries: int | None) -> None:
    t = training_snapshot(steps=12, max_entries=max_entries)
    rec = gs.load_snapshot(t.snap)
    d = snapshot_data(rec)
    assert d.events == len(t.snap["device_traces"][0])
    for p in range(d.events):
        assert (d.live_bytes(p), d.reserved_bytes(p)) == _truth(t.alloc, p), p
    before = t.alloc.truth[t.alloc.first_kept - 1] if t.alloc.first_kept else (0, 0)
    assert (d.live_bytes(-1), d.reserved_bytes(-1)) == before
    assert d.initial_allocated == before[0] and d.initial_reserved == before[1]
    kept = [a for a, _ in t.alloc.truth[t.alloc.first_kept:]]
    assert rec.peak_bytes == max([before[0], *kept])
    assert rec.reserved_peak_bytes == max(r for _, r in [before, *t.alloc.truth[t.alloc.first_kept:]])
    if max_entries is not None:
        assert any("starts mid-run" in n for n in rec.notes)
    else:
        assert not any("starts mid-run" in n for n in rec.notes)
    assert not any("disagree" in n for n in rec.notes)


def test_timeline_points_are_the_replayed_values_at_their_positions() -> None:
    t = training_snapshot(steps=12)
    rec = gs.load_snapshot(t.snap)
    at = timeline_positions(rec)
    trace = t.snap["device_traces"][0]
    changing = [p for p, e in enumerate(trace)
                if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free", "oom")]
    assert list(at) == changing  # small trace: every point kept, one per changing event
    assert rec.timeline_dropped == 0
    for p, point in zip(at, rec.timeline, strict=True):
        assert (point.live, point.reserved) == _truth(t.alloc, p)
        assert point.phase is Phase.OTHER
        assert point.t_s == pytest.approx((trace[p]["time_us"] - trace[0]["time_us"]) / 1e6)
    # labels: the allocating line, skipping PyTorch's own frames (nn.Linear, Module._call_impl)
    first_act = next(k for k, p in enumerate(at) if trace[p]["action"] == "alloc"
                     and trace[p]["frames"][0]["filename"].endswith("linear.py"))
    assert rec.timeline[first_act].label == "model.py:20 forward"
    assert any(p.label.startswith("cudaMalloc ") for p in rec.timeline)
    assert any(p.label == "free model.py:20 forward" for p in rec.timeline)


def test_recording_fields_and_the_oom() -> None:
    t = training_snapshot(steps=12, oom_step=5, capacity=400 * MiB)
    rec = gs.load_snapshot(t.snap)
    d = snapshot_data(rec)
    assert isinstance(rec, Recording)
    assert rec.where.memory_source == "cuda snapshot" and rec.where.device == "cuda:0"
    assert rec.complete is False
    assert d.oom is not None and d.oom.at == t.oom_at
    assert d.oom.requested == 400 * MiB
    assert d.oom.device_free == 400 * MiB - _truth(t.alloc, t.oom_at)[1]
    assert (d.oom.allocated, d.oom.reserved) == _truth(t.alloc, t.oom_at)
    assert rec.error is not None and "tried to allocate 400.0 MiB" in rec.error
    assert [f.name for f in d.oom.frames][:3] == ["forward", "_call_impl", "forward"]
    assert d.default_at == t.oom_at
    # the OOM moment is a timeline point
    at = timeline_positions(rec)
    k = at.index(t.oom_at)
    assert rec.timeline[k].label == "OOM: tried to allocate 400.0 MiB"
    assert any("allocator settings" in n and "expandable_segments=False" in n for n in rec.notes)
    assert rec.label == "snapshot cuda:0"


def test_bytes_by_line_at_the_end_hand_computed() -> None:
    t = training_snapshot(steps=12)
    d = snapshot_data(gs.load_snapshot(t.snap))
    end = d.events - 1
    rows = {r.key: (r.bytes, r.blocks) for r in bytes_by_line(d, end)}
    three = sum(3 * MiB + 1000 * k for k in range(4))
    assert rows == {
        "train.py:59 train_step": (sum(3 * MiB + 1000 * k for k in range(8)), 8),  # Adam state
        "model.py:20 forward": (12 * 1536 * 1024, 12),  # validation activations a list keeps
        "model.py:10 __init__": (three, 4),  # parameters
        "train.py:57 train_step": (three, 4),  # gradients (made inside loss.backward())
        "data.py:33 prefetch": (700 * 1024, 1),  # freed, but still in use on stream 7: pending
    }
    assert str(bytes_by_line(d, end)[0]) == "train.py:59 train_step: 24.0 MiB in 8 blocks"
    assert [(r.key, r.bytes) for r in bytes_by_line(d, end, stream=7)] == [("data.py:33 prefetch", 700 * 1024)]
    assert {r.key for r in bytes_by_line(d, end, group="file")} == {"train.py", "model.py", "data.py"}
    by_fn = {r.key: r.bytes for r in bytes_by_line(d, end, group="function")}
    assert by_fn["train.py train_step"] == rows["train.py:59 train_step"][0] + three
    stacks = {r.key for r in bytes_by_line(d, end, group="stack")}
    assert "model.py:20 forward ← train.py:80 validate ← train.py:120 main" in stacks


@pytest.mark.parametrize("max_entries", [None, 40])
def test_bytes_by_line_and_live_blocks_match_the_naive_replay(max_entries: int | None) -> None:
    t = training_snapshot(steps=10, oom_step=8, max_entries=max_entries)
    d = snapshot_data(gs.load_snapshot(t.snap))
    states = naive_states(t.snap)
    for p in range(-1, d.events):
        state = states[p + 1]
        got = {r.key: (r.bytes, r.blocks) for r in bytes_by_line(d, p)}
        want = _naive_by_line(state)
        if max_entries is None:  # every allocating line is in the trace
            assert got == want, p
        else:  # lines of allocations made before the trace are known only from the end state
            assert sum(b for b, _ in got.values()) == sum(b for b, _ in want.values()), p
        blocks = live_blocks(d, p)
        assert {(b.address, b.size, b.stream) for b in blocks} == {(a, s, st) for a, (s, _, st) in state.items()}
        assert [b.size for b in blocks] == sorted((b.size for b in blocks), reverse=True)


def test_live_blocks_carry_their_frames_and_positions() -> None:
    t = training_snapshot(steps=4)
    d = snapshot_data(gs.load_snapshot(t.snap))
    trace = t.snap["device_traces"][0]
    blocks = live_blocks(d, d.events - 1)
    param = next(b for b in blocks if b.address == t.params[0])
    assert param.size == 3 * MiB and param.free_at is None
    assert param.alloc_at == next(p for p, e in enumerate(trace) if e["action"] == "alloc" and e["addr"] == t.params[0])
    assert [(f.filename, f.line, f.name) for f in param.frames] == [
        (f"{TORCH}/nn/modules/module.py", 1750, "_call_impl"), ("/home/u/proj/model.py", 10, "__init__"),
        ("/home/u/proj/train.py", 120, "main")]
    assert param.label == "model.py:10 __init__"
    assert len(live_blocks(d, d.events - 1, limit=3)) == 3


def test_a_side_stream_free_completes_later() -> None:
    t = training_snapshot(steps=3)
    d = snapshot_data(gs.load_snapshot(t.snap))
    trace = t.snap["device_traces"][0]
    pre = next(e["addr"] for e in trace if e["action"] == "alloc" and e["stream"] == 7)
    req = next(p for p, e in enumerate(trace) if e["action"] == "free_requested" and e["addr"] == pre)
    done = next(p for p, e in enumerate(trace) if e["action"] == "free_completed" and e["addr"] == pre)
    assert done > req + 1
    row = next(d.allocation(i) for i in range(d.allocations) if d.alloc_addr[i] == pre)
    assert (row.stream, row.free_requested_at, row.free_at) == (7, req, done)
    for p in (req, done - 1):
        assert pre in {b.address for b in live_blocks(d, p)}
    assert pre not in {b.address for b in live_blocks(d, done)}


# ----- fragmentation ---------------------------------------------------------------------------


def _holes(request: int, stream: int = 0) -> tuple[FakeAllocator, int]:
    """30 blocks of 2.5 MiB in four 20 MiB segments, every other one freed: 15 holes of 2.5 MiB
    and one 5 MiB tail; then a request that needs a new segment on a 100 MiB device."""
    a = FakeAllocator(100 * MiB)
    fr = frames(("/home/u/proj/train.py", 7, "make"))
    blocks = [a.malloc(2560 * 1024, fr) for _ in range(30)]
    for b in blocks[::2]:
        a.free(b)
    with pytest.raises(Oom):
        a.malloc(request, fr, stream=stream)
    return a, len(a.trace) - 1


def test_fragmentation_at_an_oom_hand_computed() -> None:
    a, oom_at = _holes(30 * MiB)
    d = snapshot_data(gs.load_snapshot(snapshot(a)))
    f = fragmentation(d)
    assert f.at == oom_at
    assert f.reserved == 80 * MiB and f.allocated == 15 * 2560 * 1024
    assert f.unallocated == 80 * MiB - 15 * 2560 * 1024
    assert f.largest_free == 5 * MiB and f.largest_free_on_stream == 5 * MiB
    assert f.free_pieces == 16 and f.segments == 4
    assert f.request == 30 * MiB and f.device_free == 20 * MiB
    assert f.cause is OomCause.FRAGMENTATION  # 37.5 MiB free in segments + 20 MiB on the device
    assert f.exact
    assert "request 30.0 MiB: fragmentation" in str(f) and f.free_bytes == f.unallocated


def test_fragmentation_capacity_and_streams() -> None:
    a, _ = _holes(90 * MiB, stream=3)
    d = snapshot_data(gs.load_snapshot(snapshot(a)))
    f = fragmentation(d)
    assert f.cause is OomCause.CAPACITY  # 37.5 + 20 MiB < 90 MiB
    assert f.stream == 3 and f.largest_free_on_stream == 0 and f.largest_free == 5 * MiB
    # at a moment without an OOM: figures only; sizes of blocks freed later are estimated
    mid = fragmentation(d, 40)
    assert mid.cause is OomCause.NO_REQUEST and mid.request is None
    assert mid.reserved == d.reserved_bytes(40) and mid.allocated == d.live_bytes(40)
    assert not mid.exact


# ----- patterns --------------------------------------------------------------------------------


def test_accumulating_lines_finds_the_list_keeping_graphs() -> None:
    t = training_snapshot(steps=12, oom_step=9)
    d = snapshot_data(gs.load_snapshot(t.snap))
    found = accumulating_lines(d, group="line")
    assert [a.key for a in found] == ["model.py:20 forward"]
    acc = found[0]
    # kept at the OOM: 9 validation activations, plus the OOM step's 3 activations of the same line
    assert acc.blocks == 9 + 3
    assert acc.bytes == 9 * 1536 * 1024 + sum(2 * MiB + 512 * k + 100 for k in range(3))
    assert acc.freed == 9 * 3  # the training activations of the 9 finished steps
    assert [f.name for f in acc.frames][2:4] == ["forward", "validate"]  # who keeps calling it
    # the steps end where a forward begins after the optimizer step (the first step) or the backward:
    # just before each validation pass; at the end of step k the list held k outputs
    trace = t.snap["device_traces"][0]
    kept_at = [p for p, e in enumerate(trace) if e["action"] == "alloc"
               and any(f["name"] == "validate" for f in e["frames"])]
    assert trace_steps(d).ends == tuple(p - 1 for p in kept_at) and trace_steps(d).source == "passes"
    assert acc.step_ends == trace_steps(d).ends
    assert acc.at_step_ends == tuple(k * 1536 * 1024 for k in range(9))
    assert acc.grew == 8 and "grew at 8 of 8 step ends (0 B → 12.0 MiB)" in str(acc)
    # by whole stack (the default), the validation path alone accumulates
    by_stack = accumulating_lines(d)
    assert [a.key for a in by_stack] == ["model.py:20 forward ← train.py:80 validate ← train.py:120 main"]
    assert by_stack[0].blocks == 9 and by_stack[0].bytes == 9 * 1536 * 1024


def test_no_accumulation_without_a_leak() -> None:
    t = training_snapshot(steps=12, leak=False)
    d = snapshot_data(gs.load_snapshot(t.snap))
    assert accumulating_lines(d, d.events - 1) == ()  # parameters, gradients, Adam: made once
    assert accumulating_lines(d, d.events - 1, group="line") == ()
    assert trace_steps(d).count == 11  # the steps are there: nothing grows across them


# ----- memory by group over time ---------------------------------------------------------------


def test_memory_by_group_is_exact_at_every_sample() -> None:
    t = training_snapshot(steps=10, oom_step=8)
    d = snapshot_data(gs.load_snapshot(t.snap))
    states = naive_states(t.snap)
    g = memory_by_group(d, top=3, points=25)
    assert g.groups[-1] == "(other)" and len(g.groups) == 4
    assert -1 in g.positions and d.oom is not None and d.oom.at in g.positions and d.peak_at in g.positions
    assert list(g.positions) == sorted(set(g.positions))
    top3 = [r.key for r in bytes_by_line(d)][:3]
    assert list(g.groups[:3]) == top3
    for k, p in enumerate(g.positions):
        want = _naive_by_line(states[p + 1])
        for gi, name in enumerate(g.groups[:3]):
            assert g.bytes[gi][k] == want.get(name, (0, 0))[0], (p, name)
        assert g.bytes[3][k] == sum(b for n, (b, _) in want.items() if n not in top3)
        if p >= 0:
            assert (g.total[k], g.reserved[k]) == _truth(t.alloc, p)
    assert g.t_s is not None and g.t_s[g.positions.index(0)] == 0.0


# ----- devices ---------------------------------------------------------------------------------


def _two_devices() -> tuple[dict[str, Any], FakeAllocator, FakeAllocator]:
    a0 = FakeAllocator(200 * MiB, device=0)
    a1 = FakeAllocator(200 * MiB, device=1)
    fr = frames(("/home/u/proj/ddp.py", 5, "shard"))
    for k in range(3):
        a0.malloc((k + 1) * MiB, fr)
    x = a1.malloc(5 * MiB, fr)
    a1.malloc(7 * MiB, fr)
    a1.free(x)
    return snapshot(a0, a1, devices=4), a0, a1


def test_several_devices_need_a_choice() -> None:
    snap, a0, a1 = _two_devices()
    with pytest.raises(gs.GradscopeError, match=r"several devices: cuda:0 .*; cuda:1 .*device=0"):
        gs.load_snapshot(snap)
    for dev in (1, "cuda:1", "1", torch.device("cuda", 1)):
        r = gs.load_snapshot(snap, device=dev)
        d = snapshot_data(r)
        assert d.device == 1 and r.where.device == "cuda:1"
        assert [d.live_bytes(p) for p in range(d.events)] == [a for a, _ in a1.truth]
    with pytest.raises(gs.GradscopeError, match=r"nothing on cuda:3 \(devices: cuda:0, cuda:1\)"):
        gs.load_snapshot(snap, device=3)
    with pytest.raises(gs.GradscopeError, match="device must be"):
        gs.load_snapshot(snap, device="gpu")
    both = load_snapshot_devices(snap)
    assert sorted(both) == [0, 1]
    assert both[0].peak_bytes == 6 * MiB and both[1].peak_bytes == 12 * MiB


def test_a_snapshot_without_allocations_says_so() -> None:
    with pytest.raises(gs.GradscopeError, match="no allocations on any device"):
        gs.load_snapshot({"segments": [], "device_traces": [[], []]})


def test_state_only_snapshot_has_one_moment() -> None:
    """``_record_memory_history(enabled="state")`` or none: segments, no trace."""
    a = FakeAllocator(100 * MiB)
    fr = frames(("/home/u/proj/train.py", 3, "load"))
    a.malloc(3 * MiB, fr)
    snap = snapshot(a)
    snap["device_traces"] = [[]]
    d = snapshot_data(gs.load_snapshot(snap))
    assert d.events == 0 and d.initial_allocated == 3 * MiB and d.peak_bytes == 3 * MiB
    assert [(r.key, r.bytes) for r in bytes_by_line(d, -1)] == [("train.py:3 load", 3 * MiB)]


# ----- files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_and_gzip(tmp_path: Path, protocol: int) -> None:
    t = training_snapshot(steps=5, oom_step=4)
    path = tmp_path / "snap.pickle"
    write(path, t.snap, protocol)
    ref = snapshot_data(gs.load_snapshot(t.snap)).to_json()
    assert snapshot_data(gs.load_snapshot(path)).to_json() == ref
    gz = tmp_path / "snap.pickle.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert snapshot_data(gs.load_snapshot(gz)).to_json() == ref
    assert gs.load_snapshot(path).label == "snap.pickle cuda:0"


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    t = training_snapshot(steps=8, oom_step=6)
    rec = gs.load_snapshot(t.snap)
    path = tmp_path / "r.gscope.json"
    rec.save(path)
    back = gs.load(path)
    assert back == rec
    d0, d1 = snapshot_data(rec), snapshot_data(back)
    assert d1 is not d0 and d1.to_json() == d0.to_json()
    assert bytes_by_line(d1) == bytes_by_line(d0) and fragmentation(d1) == fragmentation(d0)
    assert accumulating_lines(d1) == accumulating_lines(d0) and live_blocks(d1) == live_blocks(d0)
    assert timeline_positions(back) == timeline_positions(rec)
    assert back.summary() == rec.summary()


def test_damaged_snapshot_data_in_a_recording(tmp_path: Path) -> None:
    rec = gs.load_snapshot(training_snapshot(steps=3).snap)
    good = rec.to_dict()

    def broken(change: Any) -> Recording:
        d = json.loads(json.dumps(good))
        change(d["extra"]["cuda_snapshot"])
        return Recording.from_dict(d)

    cases = {
        "column": lambda x: x["columns"].__setitem__("alloc_size", "not base64!"),
        "stack": lambda x: x["stacks"].append([10**6]),
        "position": lambda x: x.__setitem__("events", 1),
        "version": lambda x: x.__setitem__("version", 99),
        "ooms": lambda x: x.__setitem__("ooms", [[0, 1]]),
    }
    for name, change in cases.items():
        with pytest.raises(gs.GradscopeError, match="gradscope: ") as info:
            snapshot_data(broken(change))
        assert "damaged" in str(info.value) or "version" in str(info.value), name
    with pytest.raises(gs.GradscopeError, match="not made from a CUDA memory snapshot"):
        snapshot_data(Recording())


def test_positions_outside_the_trace() -> None:
    d = snapshot_data(gs.load_snapshot(training_snapshot(steps=2).snap))
    for bad in (d.events, -2, 1.5):
        with pytest.raises(gs.GradscopeError, match="outside this trace"):
            live_blocks(d, bad)  # type: ignore[arg-type]
    with pytest.raises(gs.GradscopeError, match="outside this trace"):
        live_blocks(d, True)
    assert live_blocks(d, torch.tensor(d.events - 1)) == live_blocks(d, d.events - 1)  # any integer
    with pytest.raises(gs.GradscopeError, match="group must be one of"):
        bytes_by_line(d, group="module")


# ----- bad files ---------------------------------------------------------------------------


def _good_pickle() -> bytes:
    return pickle.dumps(training_snapshot(steps=3).snap, protocol=4)


def _with(change: Any) -> dict[str, Any]:
    snap = training_snapshot(steps=3).snap
    change(snap)
    return snap


BAD_FILES: dict[str, tuple[Any, str]] = {
    "empty": (b"", "is empty"),
    "truncated": (lambda: _good_pickle()[: len(_good_pickle()) // 2], "is truncated"),
    "text": (b"hello, this is not a pickle\n", "not a readable pickle"),
    "json": (b'{"segments": []}', "is JSON, not a pickle"),
    "zip": (lambda: _zip_bytes(), "zip archive"),
    "gzip garbage": (b"\x1f\x8b" + b"\x00" * 30, "cannot read|not a readable pickle"),
    "a list": (pickle.dumps([1, 2, 3]), "holds a list, not a CUDA memory snapshot"),
    "segments only": (pickle.dumps([{"address": 0, "total_size": 1, "blocks": []}]),
                      r"torch.cuda.memory_snapshot\(\) returns"),
    "an int": (pickle.dumps(7), "holds an int"),
    "no device_traces": (pickle.dumps({"segments": [], "foo": 1}), "without 'device_traces'"),
    "no keys": (pickle.dumps({"a": 1}), "without 'segments' or 'device_traces'"),
    "traces not a list": (pickle.dumps({"segments": [], "device_traces": {}}), "'device_traces' is a dict"),
    "a device trace not a list": (pickle.dumps({"segments": [], "device_traces": [5]}), r"device_traces\[0\] is an int"),
    "string size in a block": (
        lambda: pickle.dumps(_with(lambda s: s["segments"][0]["blocks"][0].__setitem__("size", "4096"))),
        r"segments\[0\]\['blocks'\]\[0\] has a 'size' that is a str \('4096'\)"),
    "entry without action": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][3].pop("action"))),
        r"device_traces\[0\]\[3\] has no 'action'"),
    "negative size": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][2].__setitem__("size", -5))),
        r"device_traces\[0\]\[2\] \(a '\w+' entry\) has a negative 'size' \(-5\)"),
    "float address": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][1].__setitem__("addr", 1.5))),
        r"device_traces\[0\]\[1\] \(a '\w+' entry\) has a 'addr' that is a float"),
    "bool size": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][1].__setitem__("size", True))),
        r"has a 'size' that is a bool"),
    "huge size": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][1].__setitem__("size", 1 << 70))),
        r"has a 'size' too large"),
    "entry not a dict": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0].__setitem__(4, ["alloc"]))),
        r"device_traces\[0\]\[4\] is a list, not a dict"),
    "frames not a list": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][1].__setitem__("frames", "x.py:1"))),
        r"'frames' that is a str"),
    "frame line not an int": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0][1].__setitem__(
            "frames", [{"filename": "a.py", "line": "3", "name": "f"}]))),
        r"frames\[0\] whose 'line' is a str"),
    "segment not a dict": (
        lambda: pickle.dumps(_with(lambda s: s["segments"].append(3))), r"segments\[\d+\] is an int"),
    "block state missing": (
        lambda: pickle.dumps(_with(lambda s: s["segments"][0]["blocks"][0].pop("state"))),
        r"has a 'state' that is None"),
    "oom without size": (
        lambda: pickle.dumps(_with(lambda s: s["device_traces"][0].append({"action": "oom", "device_free": 0}))),
        r"\(an 'oom' entry\) has a 'size' that is None"),
}


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"x")
    return buf.getvalue()


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_get_a_clear_error(tmp_path: Path, name: str) -> None:
    content, pattern = BAD_FILES[name]
    data = content() if callable(content) else content
    path = tmp_path / "bad.pickle"
    path.write_bytes(data)
    with pytest.raises(gs.GradscopeError, match=pattern) as info:
        gs.load_snapshot(path)
    assert str(info.value).startswith("gradscope: ")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(gs.GradscopeError, match="cannot read .*No such file"):
        gs.load_snapshot(tmp_path / "nope.pickle")
    with pytest.raises(gs.GradscopeError, match="not a regular file"):
        gs.load_snapshot(tmp_path)
    with pytest.raises(gs.GradscopeError, match="takes a file path or the dict"):
        gs.load_snapshot(42)  # type: ignore[arg-type]


def test_unknown_actions_are_noted_not_fatal() -> None:
    snap = training_snapshot(steps=2).snap
    snap["device_traces"][0].insert(3, {"action": "segment_defrag", "addr": 0, "size": 0, "stream": 0})
    rec = gs.load_snapshot(snap)
    assert any("'segment_defrag' x1" in n for n in rec.notes)


def test_the_dict_from_snapshot_is_not_changed() -> None:
    snap = training_snapshot(steps=3).snap
    before = pickle.dumps(snap)
    gs.load_snapshot(snap)
    assert pickle.dumps(snap) == before


# ----- hostile pickles: nothing may run ---------------------------------------------------------


class _Reduce:
    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, Any]:
    cmd = f"touch {marker}"
    return {
        "os.system": _Reduce(os.system, (cmd,)),
        "builtins.eval": _Reduce(eval, (f"open({str(marker)!r}, 'w').close()",)),
        "builtins.exec": _Reduce(exec, (f"open({str(marker)!r}, 'w').close()",)),
        "subprocess.call": _Reduce(__import__("subprocess").call, (["touch", str(marker)],)),
        "pathlib.Path.touch": _Reduce(Path.touch, (marker,)),
    }


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "builtins.exec", "subprocess.call", "pathlib.Path.touch"])
def test_hostile_reduce_never_runs(tmp_path: Path, protocol: int, name: str) -> None:
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[name]
    data = pickle.dumps(payload, protocol=protocol)
    # sanity: the payload really runs under a plain pickle.loads
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    # hidden in a frame of an otherwise valid snapshot, and as the whole file
    snap = training_snapshot(steps=2).snap
    snap["device_traces"][0][1]["frames"][0] = {"filename": payload, "line": 1, "name": "f"}
    for blob in (data, pickle.dumps(snap, protocol=protocol)):
        path = tmp_path / "evil.pickle"
        path.write_bytes(blob)
        with pytest.raises(gs.GradscopeError, match=r"refers to the global \S+\.\S+, which gradscope refuses"):
            gs.load_snapshot(path)
        assert not marker.exists()


def _marker_cmd(marker: Path) -> bytes:
    return f"touch {marker}".encode()


def _opcode_payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    cmd = _marker_cmd(marker)
    s = b"S'" + cmd + b"'\n"
    short = bytes([0x8C, len(cmd)]) + cmd  # SHORT_BINUNICODE
    return {
        # GLOBAL + REDUCE (protocol 0 text)
        "GLOBAL": (b"cos\nsystem\n(" + s + b"tR.", "the global os.system"),
        # INST: looks the class up through find_class, then calls it
        "INST": (b"(" + s + b"ios\nsystem\n.", "the global os.system"),
        # OBJ with a global class
        "OBJ global": (b"(cos\nsystem\n" + s + b"o.", "the global os.system"),
        # STACK_GLOBAL (protocol 4)
        "STACK_GLOBAL": (b"\x80\x04\x8c\x02os\x8c\x06system\x93" + short + b"\x85R.", "the global os.system"),
        # PERSID / BINPERSID: persistent ids are refused
        "PERSID": (b"P" + cmd + b"\n.", "persistent id"),
        "BINPERSID": (b"\x80\x02" + short + b"Q.", "persistent id"),
        # REDUCE / OBJ / NEWOBJ / NEWOBJ_EX / BUILD with only plain objects on the stack: nothing
        # callable exists without a global, so each fails in the C unpickler without running code
        "REDUCE on a str": (s + b"(" + s + b"tR.", "not a readable pickle"),
        "OBJ on a str": (b"(" + s + s + b"o.", "not a readable pickle"),
        "NEWOBJ on a str": (b"\x80\x02" + short + b")\x81.", "not a readable pickle"),
        "NEWOBJ_EX on a str": (b"\x80\x04" + short + b")}\x92.", "not a readable pickle"),
        "BUILD dict state": (b"\x80\x02]}" + short + short + b"sb.", "not a readable pickle"),
        "BUILD slot state": (b"\x80\x02]N}X\x06\x00\x00\x00appendK\x01s\x86b.", "not a readable pickle"),
        "NEXT_BUFFER": (b"\x80\x05\x97.", "not a readable pickle"),
    }


@pytest.mark.parametrize("name", sorted(_opcode_payloads(Path("x"))))
def test_every_opcode_that_can_call_is_refused(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "pwned"
    data, pattern = _opcode_payloads(marker)[name]
    path = tmp_path / "evil.pickle"
    path.write_bytes(data)
    with pytest.raises(gs.GradscopeError, match=pattern):
        gs.load_snapshot(path)
    assert not marker.exists()


def test_extension_codes_cannot_bypass_find_class(tmp_path: Path) -> None:
    """EXT1/2/4 push what copyreg's extension cache holds without asking find_class: the loader
    empties that cache first (NOTE [ a plain-data unpickler ])."""
    marker = tmp_path / "pwned"
    module = os.system.__module__  # 'posix' on Linux
    code = 0x7FFFFFF0 - random.randrange(1000)
    ext4 = b"\x84" + struct.pack("<i", code)
    copyreg.add_extension(module, "system", code)
    try:
        pickle.loads(b"\x80\x02" + ext4 + b".")  # an ordinary load elsewhere fills the cache...
        assert code in copyreg._extension_cache  # type: ignore[attr-defined]
        cmd = _marker_cmd(marker)
        evil = b"\x80\x02" + ext4 + bytes([0x8C, len(cmd)]) + cmd + b"\x85R."
        path = tmp_path / "evil.pickle"
        path.write_bytes(evil)
        with pytest.raises(gs.GradscopeError, match=f"the global {module}.system"):
            gs.load_snapshot(path)
        assert not marker.exists()
        for op, fmt in ((b"\x82", "<B"), (b"\x83", "<H")):  # EXT1, EXT2 with unregistered codes
            path.write_bytes(b"\x80\x02" + op + struct.pack(fmt, 7) + b".")
            with pytest.raises(gs.GradscopeError, match="not a readable pickle"):
                gs.load_snapshot(path)
    finally:
        copyreg.remove_extension(module, "system", code)
        copyreg.clear_extension_cache()


def test_plain_types_cannot_call() -> None:
    """The safety argument of NOTE [ a plain-data unpickler ]: what the machine can build without
    globals is neither callable nor has a __setstate__."""
    for value in (None, True, 1, 1.5, "s", b"b", bytearray(b"x"), (), [], {}, set(), frozenset()):
        assert not callable(value)
        assert not hasattr(value, "__setstate__")


# ----- a random trace: the bulk replay against a step-by-step one -----------------------------


@pytest.mark.parametrize("seed", range(4))
def test_random_allocator_traces(seed: int) -> None:
    rng = random.Random(seed)
    a = FakeAllocator(10**12, max_entries=rng.choice([None, 500, 1500]))
    lines = [frames((f"/home/u/proj/m{k}.py", k, "f"), (f"{TORCH}/nn/modules/module.py", 1, "_call_impl"))[::-1]
             for k in range(6)]
    live: list[int] = []
    for _ in range(3000):
        r = rng.random()
        if live and r < 0.45:
            a.free(live.pop(rng.randrange(len(live))), in_use_for=rng.choice([0, 0, 0, 1, 3]))
        elif r < 0.47:
            a.empty_cache()
        else:
            size = rng.choice([1, 511, 512, 4000, 700_000, 1 << 20, 3 << 20, 25 << 20])
            live.append(a.malloc(size, rng.choice(lines), stream=rng.choice([0, 0, 5])))
    d = snapshot_data(gs.load_snapshot(snapshot(a)))
    for p in range(d.events):
        assert (d.live_bytes(p), d.reserved_bytes(p)) == _truth(a, p)
    states = naive_states(snapshot(a))
    for p in range(-1, d.events, 97):
        want = {k: v[0] for k, v in _naive_by_line(states[p + 1]).items()}
        got = {r.key: r.bytes for r in bytes_by_line(d, p)}
        if a.max_entries is None:
            assert got == want, p
        else:  # allocations made before the trace: their lines are known from the end state only
            assert sum(got.values()) == sum(want.values()), p


def test_group_of_and_pytorch_frames() -> None:
    from gradscope.snapshot import Frame, is_pytorch_frame

    user = Frame("/home/u/proj/train.py", 57, "train_step")
    torch_own = Frame(f"{TORCH}/nn/modules/linear.py", 125, "forward")
    checkout = Frame("/src/pytorch/torch/nn/modules/linear.py", 125, "forward")  # this install has the file
    cpp = Frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1021, "c10::cuda::malloc")
    generated = Frame("<eval_with_key>.3", 12, "forward")
    notebook = Frame("/tmp/ipykernel_77/3184.py", 4, "<module>")
    assert not is_pytorch_frame(user) and not is_pytorch_frame(notebook)
    assert all(is_pytorch_frame(f) for f in (torch_own, checkout, cpp, generated))
    stack = (cpp, torch_own, user, Frame("/home/u/proj/train.py", 120, "main"))
    assert group_of(stack) == "train.py:57 train_step"
    assert group_of(stack, "function") == "train.py train_step"
    assert group_of(stack, "file") == "train.py"
    assert group_of(stack, "stack") == "train.py:57 train_step ← train.py:120 main"
    assert group_of((cpp, torch_own)) == "linear.py:125 forward"  # no user frame: PyTorch's line
    assert group_of(()) == "(no stack recorded)"
    assert group_of((Frame("/x/pkg/__init__.py", 3, "f"),)) == "pkg/__init__.py:3 f"


def test_decimated_timeline_keeps_peak_and_oom() -> None:
    a = FakeAllocator(64 * MiB)
    fr = frames(("/home/u/proj/loop.py", 9, "step"))
    rng = random.Random(5)
    live: list[int] = []
    for _ in range(TIMELINE_POINTS):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([4096, 100_000, 300_000]), fr))
    with pytest.raises(Oom):
        a.malloc(128 * MiB, fr)
    for b in live[:50]:  # the except block unwinds after the failure
        a.free(b)
    rec = gs.load_snapshot(snapshot(a))
    d = snapshot_data(rec)
    at = timeline_positions(rec)
    assert len(rec.timeline) <= TIMELINE_POINTS < len(rec.timeline) + rec.timeline_dropped
    assert any("points kept" in n for n in rec.notes)
    assert max(p.live for p in rec.timeline) == rec.peak_bytes == max(x for x, _ in a.truth)
    assert d.oom is not None and d.oom.at in at
    for p, point in zip(at, rec.timeline, strict=True):
        assert (point.live, point.reserved) == _truth(a, p)


def test_snapshot_data_is_immutable() -> None:
    d = snapshot_data(gs.load_snapshot(training_snapshot(steps=2).snap))
    with pytest.raises(TypeError):
        d.alloc_size[0] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        d.events = 3  # type: ignore[misc]
    assert isinstance(d, SnapshotData)


def test_read_snapshot_from_a_file(tmp_path: Path) -> None:
    snap, _, a1 = _two_devices()
    path = tmp_path / "two.pickle"
    write(path, snap)
    both = read_snapshot(path)
    assert sorted(both) == [0, 1]
    assert both[1].live_bytes(both[1].events - 1) == a1.truth[-1][0]


def test_expandable_segments_map_and_unmap() -> None:
    """With expandable_segments the allocator maps and unmaps pages of one growing segment; a
    block may span pages mapped at different times."""
    S = 0x7F0000000000
    fr = frames(("/home/u/proj/train.py", 3, "grow"))

    def e(action: str, addr: int, size: int) -> dict[str, Any]:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": fr}

    trace = [
        e("segment_map", S, 2 * MiB), e("alloc", S, MiB), e("segment_map", S + 2 * MiB, 2 * MiB),
        e("alloc", S + MiB, 2560 * 1024), e("free_requested", S, MiB), e("free_completed", S, MiB),
        e("free_requested", S + MiB, 2560 * 1024), e("free_completed", S + MiB, 2560 * 1024),
        e("segment_unmap", S + 2 * MiB, 2 * MiB),
    ]
    seg = {"device": 0, "address": S, "total_size": 2 * MiB, "stream": 0, "segment_type": "large",
           "is_expandable": True, "blocks": [{"address": S, "size": 2 * MiB, "requested_size": 0,
                                              "state": "inactive", "frames": []}]}
    d = snapshot_data(gs.load_snapshot({"segments": [seg], "device_traces": [trace]}))
    assert [d.reserved_bytes(p) // 1024 for p in range(9)] == [2048, 2048, 4096, 4096, 4096, 4096, 4096, 4096, 2048]
    assert [d.live_bytes(p) // 1024 for p in range(9)] == [0, 1024, 1024, 3584, 3584, 2560, 2560, 0, 0]
    assert d.initial_reserved == 0 and d.initial_segments == ()
    f = fragmentation(d, 3)
    assert (f.segments, f.free_pieces, f.largest_free) == (1, 1, 512 * 1024)  # one mapped range of 4 MiB
    assert fragmentation(d, 8).largest_free == 2 * MiB


# ----- reserved ranges ---------------------------------------------------------------------------
def _ranges_reference(ops: list[tuple[str, int, int, int, bool]]) -> list[list[int]]:
    """Reserved ranges after ``ops``, the plain way: cut every range the new one overlaps, then
    merge a mapped range with the mapped ranges of its stream that touch it; sorted."""
    items: list[list[int]] = []
    for op, start, size, stream, mapped in ops:
        end = start + size
        cut: list[list[int]] = []
        for s, e, st, m in items:
            if e <= start or s >= end:
                cut.append([s, e, st, m])
                continue
            if s < start:
                cut.append([s, start, st, m])
            if e > end:
                cut.append([end, e, st, m])
        items = cut
        if op == "add":
            item = [start, end, stream, int(mapped)]
            for other in [x for x in items if mapped and x[3] and x[2] == stream and (x[1] == start or x[0] == end)]:
                items.remove(other)
                item[0], item[1] = min(item[0], other[0]), max(item[1], other[1])
            items.append(item)
        items.sort()
    return items


def test_reserved_ranges_match_a_plain_replay() -> None:
    """The allocator's reserved ranges (segments, pages mapped into expandable segments), kept
    sorted and cut by bisection, agree with a plain replay over random adds and removes."""
    from gradscope._analyses.snapshot.replay import Ranges

    rng = random.Random(7)
    for _ in range(200):
        r = Ranges()
        ops: list[tuple[str, int, int, int, bool]] = []
        for _ in range(40):
            op = rng.choice(["add", "add", "remove"])
            start, size = rng.randrange(0, 60), rng.randrange(1, 12)
            stream, mapped = rng.randrange(2), rng.random() < 0.5
            ops.append((op, start, size, stream, mapped))
            if op == "add":
                r.add(start, size, stream, mapped)
            else:
                r.remove(start, size)
            assert r.items == _ranges_reference(ops)
