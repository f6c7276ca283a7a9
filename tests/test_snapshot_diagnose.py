"""``gs.diagnose`` of CUDA memory snapshots: one synthetic snapshot per pattern, written by the fake
caching allocator of ``_snapshots.py`` (which keeps its own ground truth), and the diagnosis held
to numbers computed by hand from the scenario's design or from the fake's own bookkeeping.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from _snapshots import TORCH, FakeAllocator, MiB, Oom, frames, snapshot, training_snapshot

import gradscope as gs
from gradscope.snapshot import (
    OomCause,
    Role,
    SnapshotDiagnosis,
    pageable_bytes,
    segment_size_for,
    segment_states,
    snapshot_data,
)

LINEAR = (f"{TORCH}/nn/modules/linear.py", 125, "forward")
CALL = (f"{TORCH}/nn/modules/module.py", 1750, "_call_impl")
MAIN = ("/home/u/proj/train.py", 120, "main")
STEP = ("/home/u/proj/train.py", 57, "train_step")
BIG = ("/home/u/proj/train.py", 60, "train_step")
FWD = ("/home/u/proj/model.py", 20, "forward")
EVAL = ("/home/u/proj/train.py", 80, "validate")
CACHE = ("/home/u/proj/model.py", 30, "cache_kv")
INIT = ("/home/u/proj/model.py", 10, "__init__")


def _diagnose(a: FakeAllocator) -> SnapshotDiagnosis:
    d = gs.diagnose(gs.load_snapshot(snapshot(a), label="synthetic"))
    assert isinstance(d, SnapshotDiagnosis)
    return d


def _live_truth(a: FakeAllocator) -> int:
    return sum(r for r, _, _ in a.live.values())


def _free_truth(a: FakeAllocator) -> int:
    """Bytes in the fake's free blocks (inside its segments)."""
    return sum(b.size for seg in a.segments for b in seg.blocks if b.state == "inactive")


# ----- a list keeping graphs: validation outputs kept step after step, until the device is full ----
def _leak_until_oom() -> tuple[FakeAllocator, int]:
    """Per step 3 activations of 2 MiB (model.py:20 under train.py:57), freed; then a validation
    output of 1.5 MiB (model.py:20 under train.py:80 validate) that a list keeps. 60 MiB device."""
    a = FakeAllocator(60 * MiB)
    steps = 0
    with pytest.raises(Oom):
        while True:
            acts = [a.malloc(2 * MiB, frames(LINEAR, CALL, FWD, STEP, MAIN)) for _ in range(3)]
            for x in acts:
                a.free(x)
            a.malloc(1536 * 1024, frames(LINEAR, CALL, FWD, EVAL, MAIN))
            steps += 1
    return a, steps


def test_a_list_keeping_graphs_fills_the_device() -> None:
    a, steps = _leak_until_oom()
    d = _diagnose(a)
    live = _live_truth(a)
    assert d.moment == "oom" and d.at == len(a.trace) - 1
    oom = a.trace[-1]
    assert d.request == oom["size"] and d.device_free == oom["device_free"] == 60 * MiB - a.reserved
    assert (d.allocated, d.reserved) == (live, a.reserved)
    # what is live at the OOM: every kept validation output, plus the activations of the step that failed
    n_acts = sum(1 for _, _, fr in a.live.values() if fr[3] == frames(STEP)[0])
    assert d.by_line[0].key == "model.py:20 forward"
    assert d.by_line[0].bytes == live == steps * 1536 * 1024 + n_acts * 2 * MiB
    assert d.by_line[0].blocks == steps + n_acts
    acc = [f for f in d.findings if f.pattern == "accumulating"]
    assert len(acc) == 1
    assert acc[0].key == "model.py:20 forward ← train.py:80 validate ← train.py:120 main"
    assert acc[0].bytes == steps * 1536 * 1024
    assert f"held {gs.recording.format_bytes(steps * 1536 * 1024)} in {steps} blocks at the OOM" in acc[0].message
    # the steps: the loop's turns, found from the code that repeats (each starts at the kept output);
    # at the end of step k the list held k outputs
    assert acc[0].role is Role.KEPT and d.steps is not None and d.steps.source == "repetition"
    kept_at = [p for p, e in enumerate(a.trace) if e["action"] == "alloc" and e["frames"][3] == frames(EVAL)[0]]
    assert d.steps.ends == tuple(p - 1 for p in kept_at)
    assert d.accumulating[0].at_step_ends == tuple(k * 1536 * 1024 for k in range(steps))
    assert f"it went from 0 B to {gs.recording.format_bytes((steps - 1) * 1536 * 1024)}, about 1.5 MiB more per " \
           "step" in acc[0].message
    assert "(called from train.py:80 validate ← train.py:120 main)" in acc[0].message
    assert "none of its allocations was ever freed" in acc[0].message
    assert "autograd graphs" in acc[0].message and "train.py:80 validate" in acc[0].suggestion
    cap = [f for f in d.findings if f.pattern == "capacity"]
    assert len(cap) == 1 and d.findings[0] is cap[0]  # the cause first, then what fed it
    # the free pieces cannot hold the request, so it needed a new segment: 20 MiB for a 2 MiB request
    assert _free_truth(a) < oom["size"]
    short = min(oom["size"] - _free_truth(a), 20 * MiB - oom["device_free"])
    assert short > 0 and cap[0].bytes == short
    assert f"needed a new segment of 20.0 MiB, and the device had {gs.recording.format_bytes(oom['device_free'])} " \
           f"free; no allocator setting makes room: at least {gs.recording.format_bytes(short)} had to be " \
           "released" in cap[0].message
    assert d.fragmentation.cause is OomCause.CAPACITY
    assert "releasing it leaves room" in cap[0].suggestion  # the kept outputs are more than was missing
    assert steps * 1536 * 1024 >= short


def test_the_text_says_it_in_words() -> None:
    a, steps = _leak_until_oom()
    d = _diagnose(a)
    text = d.text()
    head = text.splitlines()
    assert head[0] == f"gradscope diagnosis of synthetic: CUDA out of memory on cuda:0 at trace event {d.at}, " \
                      f"{d.t_s:.3f} s into the trace"
    assert head[1].startswith(f"failed request: 2.0 MiB ({2 * MiB} bytes) on stream 0, from model.py:20 forward;")
    assert f"live at the OOM by source line:\n  model.py:20 forward: {gs.recording.format_bytes(d.by_line[0].bytes)} " \
           f"in {d.by_line[0].blocks} blocks" in text
    assert "  1. [capacity]" in text and "  2. [accumulating]" in text
    assert str(d) == text and text == _diagnose(a).text()  # deterministic


# ----- fragmentation that expandable segments would fix ---------------------------------------------
def _three_split_segments() -> FakeAllocator:
    """Three 100 MiB segments, each with 60 MiB free at its start and a 40 MiB cache block after
    it; then a 120 MiB request on a 350 MiB device (50 MiB free)."""
    a = FakeAllocator(350 * MiB)
    for b in [a.malloc(100 * MiB, frames(INIT, MAIN)) for _ in range(3)]:
        a.free(b)
    temps = []
    for _ in range(3):
        temps.append(a.malloc(60 * MiB, frames(STEP, MAIN)))
        a.malloc(40 * MiB, frames(CACHE, FWD, MAIN))
    for t in temps:
        a.free(t)
    with pytest.raises(Oom):
        a.malloc(120 * MiB, frames(BIG, MAIN))
    return a


def test_fragmentation_that_expandable_segments_fix() -> None:
    a = _three_split_segments()
    d = _diagnose(a)
    f = d.fragmentation
    assert (f.reserved, f.allocated, f.unallocated) == (300 * MiB, 120 * MiB, 180 * MiB)
    assert (f.free_pieces, f.segments, f.largest_free) == (3, 3, 60 * MiB)
    assert f.cause is OomCause.FRAGMENTATION and d.device_free == 50 * MiB and d.request == 120 * MiB
    # each free piece is the first 60 MiB of its segment: three whole 20 MiB pages each
    assert d.pageable_bytes == 3 * 60 * MiB
    (frag,) = [x for x in d.findings if x.pattern == "fragmentation"]
    assert frag.bytes == 180 * MiB
    assert "the 120.0 MiB (125829120 bytes) request did not fit although 180.0 MiB of reserved memory was " \
           "free and the device had 50.0 MiB free" in frag.message
    assert "split into 3 pieces across 3 segments, the largest on stream 0 60.0 MiB." in frag.message
    # 50 MiB free on the device: two whole 20 MiB pages; the request takes six
    assert "the free pieces hold 180.0 MiB in whole pages and the device's 50.0 MiB free gives 40.0 MiB more: " \
           "220.0 MiB to map, enough for the 120.0 MiB of 20.0 MiB pages the 120.0 MiB request takes" in frag.suggestion
    assert "max_split_size_mb would not help here: no segment of stream 0 is as large as the request (the " \
           "largest is 100.0 MiB)" in frag.suggestion
    assert frag.suggestion.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts)")
    assert [r.key for r in d.by_line] == ["model.py:30 cache_kv"] and d.by_line[0].blocks == 3
    assert not [x for x in d.findings if x.pattern == "accumulating"]  # made once, not across the run


# ----- fragmentation that max_split_size_mb would fix -----------------------------------------------
def _one_big_segment_split() -> FakeAllocator:
    """A 200 MiB segment cached from an earlier step; an 80 MiB temporary and then a 30 MiB
    long-lived block are carved from it; the temporary is freed (free pieces of 80 and 90 MiB);
    then a 150 MiB request on a 260 MiB device (60 MiB free)."""
    a = FakeAllocator(260 * MiB)
    a.free(a.malloc(200 * MiB, frames(INIT, MAIN)))
    tmp = a.malloc(80 * MiB, frames(STEP, MAIN))
    a.malloc(30 * MiB, frames(CACHE, FWD, MAIN))
    a.free(tmp)
    with pytest.raises(Oom):
        a.malloc(150 * MiB, frames(BIG, MAIN))
    return a


def test_fragmentation_that_max_split_size_fixes() -> None:
    a = _one_big_segment_split()
    d = _diagnose(a)
    f = d.fragmentation
    assert (f.reserved, f.allocated, f.unallocated, f.largest_free) == (200 * MiB, 30 * MiB, 170 * MiB, 90 * MiB)
    assert f.cause is OomCause.FRAGMENTATION and d.device_free == 60 * MiB
    (seg,) = segment_states(snapshot_data(gs.load_snapshot(snapshot(a))))
    assert seg.size == 200 * MiB and seg.live_blocks == 1 and seg.live_bytes == 30 * MiB
    assert [s for _, s in seg.free_pieces] == [80 * MiB, 90 * MiB]
    # pages from the segment's start: [0, 80) holds 4; [110, 200) holds [120, 200): 4
    assert d.pageable_bytes == pageable_bytes((seg,)) == 8 * 20 * MiB
    (frag,) = d.findings
    assert "the free pieces hold 160.0 MiB in whole pages and the device's 60.0 MiB free gives 60.0 MiB more: " \
           "220.0 MiB to map, enough for the 160.0 MiB of 20.0 MiB pages the 150.0 MiB request takes" in frag.suggestion
    assert "or max_split_size_mb:150: 1 segment of at least the request's size (200.0 MiB) is split by smaller " \
           "live blocks (1 of them, 30.0 MiB)" in frag.suggestion
    assert frag.suggestion.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts)")


def test_holes_too_small_for_any_setting() -> None:
    """Every other 2.5 MiB block freed in 20 MiB segments: the free pieces hold no whole 20 MiB
    page, so expandable segments would not make room on this layout either, and no segment is as
    large as the 30 MiB request."""
    a = FakeAllocator(100 * MiB)
    fr = frames(("/home/u/proj/train.py", 7, "make"))
    blocks = [a.malloc(2560 * 1024, fr) for _ in range(30)]
    for b in blocks[::2]:
        a.free(b)
    with pytest.raises(Oom):
        a.malloc(30 * MiB, fr)
    d = _diagnose(a)
    assert d.fragmentation.cause is OomCause.FRAGMENTATION and d.pageable_bytes == 0
    frag, kept = d.findings  # the cause, then the 15 blocks that one line keeps (a list here)
    assert kept.pattern == "accumulating" and kept.bytes == 15 * 2560 * 1024
    assert "15 other allocations from it were freed" in kept.message
    assert "the free pieces hold 0 B in whole pages and the device's 20.0 MiB free gives 20.0 MiB more: 20.0 MiB " \
           "to map, 20.0 MiB short of the 40.0 MiB of 20.0 MiB pages the 30.0 MiB request takes" in frag.suggestion
    assert "max_split_size_mb would not help here" in frag.suggestion


# ----- capacity: the step itself is too large ---------------------------------------------------------
def test_capacity_names_the_lines_that_hold_most() -> None:
    """40 MiB of parameters and three 15 MiB activations on a 100 MiB device (each activation in a
    20 MiB segment of its own: 5 MiB free pieces), then a 30 MiB request."""
    a = FakeAllocator(100 * MiB)
    a.malloc(40 * MiB, frames(INIT, MAIN))
    for _ in range(3):
        a.malloc(15 * MiB, frames(LINEAR, CALL, FWD, STEP, MAIN))
    with pytest.raises(Oom):
        a.malloc(30 * MiB, frames(BIG, MAIN))
    d = _diagnose(a)
    assert (d.allocated, d.reserved, d.device_free) == (85 * MiB, 100 * MiB, 0)
    assert d.fragmentation.cause is OomCause.CAPACITY and d.fragmentation.unallocated == 15 * MiB
    assert [(r.key, r.bytes, r.blocks) for r in d.by_line] == [
        ("model.py:20 forward", 45 * MiB, 3), ("model.py:10 __init__", 40 * MiB, 1)]
    cap, act = d.findings  # the verdict, then what each role would free: the activations only
    # the 15 MiB of free pieces cannot hold it; a new 30 MiB segment cannot come from a full device:
    # 15 MiB more in one free piece would have served it
    assert cap.pattern == "capacity" and cap.bytes == 15 * MiB
    assert "the free pieces of reserved memory hold 15.0 MiB, less than the 30.0 MiB request, so the " \
           "allocator needed a new segment of 30.0 MiB, and the device had 0 B free; no allocator setting " \
           "makes room: at least 15.0 MiB had to be released" in cap.message
    assert "85.0 MiB was allocated: activations 45.0 MiB, parameters and model state 40.0 MiB; most by model.py:20 " \
           "forward (45.0 MiB), model.py:10 __init__ (40.0 MiB)." in cap.message
    assert cap.suggestion == "hold at least 15.0 MiB less; what each role would free is below (largest first)."
    # the 40 MiB made in __init__ are the model's; the three outputs of forward its activations
    assert [(r.role, r.bytes, r.blocks) for r in d.by_role] == [
        (Role.PARAMETERS, 40 * MiB, 1), (Role.ACTIVATIONS, 45 * MiB, 3)]
    assert (act.pattern, act.bytes, act.role) == ("activations", 45 * MiB, Role.ACTIVATIONS)
    assert "half the batch (or sequence) frees about 22.5 MiB" in act.suggestion


def test_a_request_larger_than_the_device() -> None:
    a = FakeAllocator(100 * MiB)
    a.malloc(10 * MiB, frames(INIT, MAIN))
    with pytest.raises(Oom):
        a.malloc(200 * MiB, frames(BIG, MAIN))
    d = _diagnose(a)
    (f,) = d.findings
    assert f.pattern == "request_too_large" and f.bytes == 200 * MiB
    # 20 MiB reserved (10 MiB of it unallocated) and 80 MiB free: 110 MiB short
    assert "it is 110.0 MiB more than all free memory together" in f.message
    assert "make the tensor requested at train.py:60 train_step smaller" in f.suggestion


def test_a_free_piece_that_fits_points_outside_the_trace() -> None:
    fr = frames(("/home/u/proj/train.py", 9, "go"))
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 64 * MiB, "stream": 0, "frames": fr},
        {"action": "alloc", "addr": 0, "size": 8 * MiB, "stream": 0, "frames": fr},
        {"action": "oom", "size": 16 * MiB, "device_free": 0, "stream": 0, "frames": fr},
    ]
    d = gs.diagnose(gs.load_snapshot({"segments": [], "device_traces": [trace]}))
    assert d.fragmentation.cause is OomCause.FITS
    (f,) = d.findings
    assert f.pattern == "free_piece_fits" and "a free piece of 56.0 MiB on stream 0" in f.message


# ----- no OOM: the peak ----------------------------------------------------------------------------------
def test_without_an_oom_the_peak_and_the_pattern() -> None:
    t = training_snapshot(steps=12, leak=True)
    d = gs.diagnose(gs.load_snapshot(t.snap))
    data = snapshot_data(gs.load_snapshot(t.snap))
    assert d.moment == "peak" and d.at == data.peak_at and d.request is None and d.pageable_bytes is None
    (acc,) = d.findings
    assert acc.pattern == "accumulating" and acc.key.endswith("train.py:80 validate ← train.py:120 main")
    # the validation outputs of the steps finished before the peak
    kept = sum(1 for p in range(len(t.snap["device_traces"][0]))
               if t.snap["device_traces"][0][p]["action"] == "alloc" and p <= d.at
               and t.snap["device_traces"][0][p].get("frames", [{}])[-2:] == frames(EVAL, MAIN))
    assert acc.bytes == kept * 1536 * 1024 and kept >= 8
    assert "no OOM in this CUDA snapshot of cuda:0; state at its peak" in d.text()
    assert f"held {gs.recording.format_bytes(acc.bytes)} in {kept} blocks at the peak" in acc.message


def test_an_empty_trace_says_so() -> None:
    seg = {"device": 0, "address": 0, "total_size": 2 * MiB, "stream": 0,
           "blocks": [{"address": 0, "size": 2 * MiB, "requested_size": 0, "state": "inactive"}]}
    d = gs.diagnose(gs.load_snapshot({"segments": [seg], "device_traces": [[]]}))
    assert d.moment == "empty" and d.findings == () and "nothing to diagnose" in d.text()


def test_the_same_diagnosis_from_the_file_and_after_save(tmp_path: Path) -> None:
    a, _ = _leak_until_oom()
    snap = snapshot(a)
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as fh:
        pickle.dump(snap, fh)
    from_dict = gs.diagnose(gs.load_snapshot(snap, label="x")).text()
    assert gs.diagnose(gs.load_snapshot(path, label="x")).text() == from_dict
    gs.load_snapshot(path, label="x").save(tmp_path / "r.gscope.json")
    assert gs.diagnose(gs.load(tmp_path / "r.gscope.json")).text() == from_dict


def test_hostile_frame_names_stay_on_one_line() -> None:
    evil = ("/home/u/proj/x.py", 1, "f\n[fake] finding\x1b[31m")
    a = FakeAllocator(40 * MiB)
    a.malloc(30 * MiB, frames(evil))
    with pytest.raises(Oom):
        a.malloc(30 * MiB, frames(evil))
    text = _diagnose(a).text()
    assert "\x1b" not in text and "\n[fake]" not in text and "f\\n[fake] finding\\x1b[31m" in text


def _frames_of(e: dict[str, Any]) -> list[dict[str, Any]]:
    return e.get("frames", [])


def test_segment_sizes_follow_the_allocator() -> None:
    assert [segment_size_for(n) for n in (1, 1 << 20, (1 << 20) + 1, (10 << 20) - 1, 10 << 20, (21 << 20) + 5)] \
        == [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 22 * MiB]


def test_a_process_share_used_up_while_the_device_had_room() -> None:
    """The device reports enough free memory for the new segment (a per-process memory fraction
    held the allocator back): the finding says so, and what had to be released is what the free
    pieces lacked."""
    fr = frames(STEP, MAIN)
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 40 * MiB, "stream": 0, "frames": fr},
        {"action": "alloc", "addr": 0, "size": 30 * MiB, "stream": 0, "frames": fr},
        {"action": "oom", "size": 24 * MiB, "device_free": 60 * 1024 * MiB, "stream": 0, "frames": frames(BIG, MAIN)},
    ]
    d = gs.diagnose(gs.load_snapshot({"segments": [], "device_traces": [trace]}))
    cap = d.findings[0]
    assert cap.pattern == "capacity" and cap.bytes == 24 * MiB - 10 * MiB
    assert "the device reported 60.0 GiB free, enough for it: the process's share was used up" in cap.message


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "cuda_oom_snapshot.pickle"


@pytest.mark.skipif(not FIXTURE.exists(), reason="no real CUDA OOM snapshot yet: benchmarks/bench_cuda.py on a GPU writes one")
def test_a_real_cuda_oom_snapshot() -> None:
    """The snapshot ``%gradscope oom on`` saved of a real OOM on a GPU (benchmarks/bench_cuda.py: a
    list keeping every step's loss, so its graph, on a 1 GiB share of the device), with the facts
    the GPU session read from PyTorch itself beside it."""
    import json

    facts = json.loads(FIXTURE.with_suffix(".json").read_text())
    rec = gs.load_snapshot(FIXTURE)
    d = gs.diagnose(rec)
    assert d.moment == "oom" and d.request == facts["request"] and d.text() == facts["text"]
    asked = facts["message_request_bytes"]
    assert asked is not None and abs(d.request - asked) <= 0.01 * asked  # what PyTorch's message said
    assert sum(r.bytes for r in d.by_line) == d.allocated == snapshot_data(rec).live_bytes(d.at)
    assert any(a.key.split(" ← ")[0].endswith(":3 <module>") for a in d.accumulating)  # losses.append(...)
