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
from gradscope.errors import GradscopeError
from gradscope.predict import estimate_cuda_allocator
from gradscope.recording import format_bytes
from gradscope.snapshot import (
    Role,
    SnapshotDiagnosis,
    accumulating_lines,
    allocation_role,
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
    """One device of the file's snapshot dict and what this test computes from it alone."""

    snap: dict[str, Any]
    trace: list[dict[str, Any]]
    live: list[int]  # allocated bytes after each event (index p + 1; index 0: before the first)
    reserved: list[int]
    pre: dict[int, tuple[int, int]]  # address -> (size, position of its free or -1) of blocks alive before the trace
    pre_frames: dict[int, list[dict[str, Any]]]  # address -> the frames its end-state block keeps (alive at the end)


def _block_size(b: dict[str, Any]) -> int:
    if "requested_size" in b:
        return int(b["requested_size"])
    return int(b["history"][0]["real_size"]) if b.get("history") else int(b["size"])


def _block_frames(b: dict[str, Any]) -> list[dict[str, Any]]:
    if b.get("frames"):
        return list(b["frames"])
    return list(b["history"][0].get("frames", [])) if b.get("history") else []


@cache
def _snap(name: str) -> dict[str, Any]:
    with gzip.open(DATA / name, "rb") as f:
        return pickle.load(f)  # type: ignore[no-any-return]  # a file of this repository's tests


def devices(name: str) -> list[int]:
    """The devices with trace events or segments."""
    snap = _snap(name)
    return sorted({d for d, t in enumerate(snap["device_traces"]) if t}
                  | {s.get("device", 0) for s in snap["segments"]})


@cache
def raw(name: str, device: int = 0) -> Raw:
    """Allocated and reserved bytes after every event, replayed backwards from the end state (the
    segments are the allocator's state right after the last event)."""
    snap = _snap(name)
    trace = snap["device_traces"][device] if device < len(snap["device_traces"]) else []
    segments = [s for s in snap["segments"] if s.get("device", 0) == device]
    end = [b for s in segments for b in s["blocks"] if b["state"] in LIVE]
    live = [sum(_block_size(b) for b in end)]
    reserved = [sum(s["total_size"] for s in segments)]
    for e in reversed(trace):
        a, r = live[-1], reserved[-1]
        if e["action"] == "alloc":
            a -= e["size"]
        elif e["action"] == "free_completed":
            a += e["size"]
        elif e["action"] in ("segment_alloc", "segment_map"):
            r -= e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            r += e["size"]
        live.append(a)
        reserved.append(r)
    live.reverse()
    reserved.reverse()
    # alive before the trace: an address whose first event is a free, or an end-state block no event touched
    seen: set[int] = set()
    pre: dict[int, tuple[int, int]] = {}
    pre_frames: dict[int, list[dict[str, Any]]] = {}
    for p, e in enumerate(trace):
        if e["action"] in ("alloc", "free_requested", "free_completed") and e["addr"] not in seen:
            seen.add(e["addr"])
            if e["action"] != "alloc":
                pre[e["addr"]] = (e["size"], next(q for q in range(p, len(trace)) if trace[q]["action"] ==
                                                  "free_completed" and trace[q]["addr"] == e["addr"]))
    for s in segments:
        at = s["address"]
        for b in s["blocks"]:
            addr = b.get("address", at)
            at = addr + b["size"]
            if b["state"] in LIVE and addr not in seen:
                pre[addr] = (_block_size(b), -1)
                pre_frames[addr] = _block_frames(b)
    return Raw(snap, trace, live, reserved, pre, pre_frames)


@cache
def loaded(name: str, device: int = 0) -> tuple[gs.Recording, SnapshotDiagnosis]:
    rec = gs.load_snapshot(DATA / name, device=device)
    d = gs.diagnose(rec)
    assert isinstance(d, SnapshotDiagnosis)
    return rec, d


def _names(e: dict[str, Any]) -> list[str]:
    return [f["name"] for f in e.get("frames", [])]


def _files(e: dict[str, Any]) -> list[str]:
    return [f["filename"].replace("\\", "/") for f in e.get("frames", [])]  # a file from Windows too


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
CASES = [(n, d) for n in FILES for d in devices(n)]


def test_the_files_are_here() -> None:
    assert FILES == [
        "counterfactual_adam_10_steps.pickle.gz", "dataparallel_3gpu_oom_expandable.pickle.gz",
        "flexgen_opt_oom_no_history.pickle.gz", "llama_offload_validation_no_grad.pickle.gz",
        "llm1.3b_inference_no_history.pickle.gz", "lm2.7b_ctx128_adamw_step.pickle.gz",
        "lm2.7b_ctx128_earlier_run.pickle.gz", "lm2.7b_ctx128_forward_only.pickle.gz",
        "lm2.7b_ctx128_forward_only_bf16.pickle.gz", "lm_large_adamw_step_state_before_trace.pickle.gz",
        "lm_large_forward_mid_training_bf16.pickle.gz", "lm_medium_adamw_step_state_replaced.pickle.gz",
        "lm_medium_inference_mode.pickle.gz", "lm_small_compiled_adamw_step.pickle.gz",
        "lm_small_forward_no_grad_bf16.pickle.gz", "lm_small_fwd_bwd_no_optimizer.pickle.gz",
        "tinyllama_8bit_lora_fwd_bwd_notebook.pickle.gz", "zeroth_order_fl_no_grad.pickle.gz"]
    assert devices("dataparallel_3gpu_oom_expandable.pickle.gz") == [0, 1, 2]
    assert sum((DATA / n).stat().st_size for n in FILES) < 3 << 20


def _made_by(frames: list[dict[str, Any]]) -> Role:
    """What the frames that made a block say it is, read here from the raw frame dicts: an
    optimizer's (a torch/optim frame), the autograd engine's, or a constructor's outside any
    forward; else only that it existed before the trace."""
    if any("/torch/optim/" in f["filename"].replace("\\", "/") for f in frames):
        return Role.OPTIMIZER_STATE
    if any("torch::autograd::Engine::" in f["name"] for f in frames):
        return Role.GRADIENTS
    py = [f["name"] for f in frames if f["filename"].endswith(".py")]
    if "__init__" in py and not any(n in ("forward", "_call_impl") for n in py[py.index("__init__"):]):
        return Role.PARAMETERS
    return Role.BEFORE_TRACE


@pytest.mark.parametrize("name, device", CASES)
def test_every_file_replays_and_its_roles_add_up(name: str, device: int) -> None:
    r = raw(name, device)
    rec, d = loaded(name, device)
    data = snapshot_data(rec)
    assert rec.peak_bytes == max(r.live) and rec.reserved_peak_bytes == max(r.reserved)
    for p in [*range(-1, data.events, 97), data.peak_at, data.events - 1]:
        assert data.live_bytes(p) == r.live[p + 1] and data.reserved_bytes(p) == r.reserved[p + 1]
    for at in (data.peak_at, max(data.events - 1, -1)):
        roles = bytes_by_role(data, at)
        assert sum(x.bytes for x in roles) == r.live[at + 1] == data.live_bytes(at)
        assert sum(x.blocks for x in roles) == sum(1 for p, _, f in _allocs(r) if _alive(p, f, at)) + sum(
            1 for _, f in r.pre.values() if f < 0 or f > at)
        # memory made before the trace is exactly what the file says was alive then, each block in
        # the role its own frames give it (none: existed before the trace)
        pre = [i for i in range(data.allocations) if data.alloc_at[i] < 0 and _alive(-1, data.alloc_free_at[i], at)]
        assert sum(data.alloc_size[i] for i in pre) == sum(s for s, f in r.pre.values() if f < 0 or f > at)
        by_frames: dict[Role, int] = {}
        for a, (size, f) in r.pre.items():
            if f < 0 or f > at:
                role = _made_by(r.pre_frames.get(a, []))
                by_frames[role] = by_frames.get(role, 0) + size
        got: dict[Role, int] = {}
        for i in pre:
            role = allocation_role(data, i)
            got[role] = got.get(role, 0) + data.alloc_size[i]
        assert got == by_frames
    assert sum(x.bytes for x in d.by_role) == d.allocated == r.live[d.at + 1]


@pytest.mark.parametrize("name, device", CASES)
def test_no_finding_carries_code_or_names_a_cpp_frame(name: str, device: int) -> None:
    _, d = loaded(name, device)
    assert len(d.findings) <= 5
    text = d.text()
    assert "code:" not in text and "torch::" not in text and "unwind" not in text
    for f in d.findings:
        assert not hasattr(f, "code")
        assert f.key is None or ("::" not in f.key and "einops" not in f.key and "_backends" not in f.key)
    for row in d.by_line:  # the user's lines, never inside an installed package or a C++ function's name
        assert "::" not in row.key and not row.key.startswith(("_backends.py", "einops.py"))


@pytest.mark.parametrize("name, device", CASES)
def test_no_real_file_has_a_leak(name: str, device: int) -> None:
    """None of these programs keeps memory from step to step (what each did is in the README):
    every step frees what it made, or there are too few steps to tell."""
    rec, d = loaded(name, device)
    assert d.accumulating == () and accumulating_lines(snapshot_data(rec), group="line") == ()
    assert all(f.pattern != "accumulating" for f in d.findings)


@pytest.mark.parametrize("name, device", CASES)
def test_the_allocator_model_gives_the_reserved_peak(name: str, device: int) -> None:
    """estimate_cuda_allocator over the file's own sequence: what was alive before the trace first
    (by address), then every alloc and free_completed in order."""
    r = raw(name, device)
    rec, _ = loaded(name, device)
    events: list[tuple[Any, int]] = [(("pre", a), s) for a, (s, _) in sorted(r.pre.items())]
    episode: dict[int, Any] = {a: ("pre", a) for a in r.pre}
    for p, e in enumerate(r.trace):
        if e["action"] == "alloc":
            episode[e["addr"]] = ("alloc", p)
            events.append((episode[e["addr"]], e["size"]))
        elif e["action"] == "free_completed":
            events.append((episode.pop(e["addr"]), -e["size"]))
    model = estimate_cuda_allocator(events).reserved_peak
    peak = rec.reserved_peak_bytes
    assert peak == max(r.reserved)
    actions = {e["action"] for e in r.trace}
    before = r.reserved[0]  # reserved when the trace began
    if actions & {"segment_map", "segment_unmap"}:
        # expandable segments grow by 20 MiB pages; the model takes whole segments per request
        assert peak <= model <= peak * 1.1
    elif "segment_free" in actions:
        # segments went back to CUDA during the trace (empty_cache): the model keeps every segment
        assert peak < model <= peak * 1.15
    elif not actions & {"segment_alloc"} and before:
        # every segment was obtained before the history: the model packs the blocks from an empty
        # cache and cannot know the free space of the file's (its notes say so)
        assert sum(-(-s // 512) * 512 for s, _ in r.pre.values()) <= model <= peak
    elif name.startswith("tinyllama"):
        # segments obtained before the trace hold free space the model does not know of
        assert peak <= model <= peak * 1.01
    else:
        assert model == peak


def test_the_allocator_model_says_what_it_cannot_know() -> None:
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


@pytest.mark.parametrize("name", ["llm1.3b_inference_no_history.pickle.gz", "flexgen_opt_oom_no_history.pickle.gz"])
def test_a_file_without_history_says_what_cannot_be_known(name: str) -> None:
    """PyTorch 1.13/2.0 files of FlexGen's OPT: segments and blocks, no trace. When each block was
    made cannot be known; what made it can: the blocks' own frames say the model's weights were
    allocated in its constructor (``OptLM.__init__`` -> ``init_all_weights``)."""
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    blocks = [b for s in r.snap["segments"] for b in s["blocks"]]
    live = [b for b in blocks if b["state"] in LIVE]
    weights = sum(_block_size(b) for b in live if "__init__" in [f["name"] for f in _block_frames(b)])
    assert weights > 5 << 30
    assert [(x.role, x.bytes) for x in d.by_role] == [
        (role, n) for role, n in ((Role.BEFORE_TRACE, d.allocated - weights), (Role.PARAMETERS, weights)) if n]
    assert d.findings == () and d.accumulating == () and trace_steps(data).count == 0 and not d.history
    text = d.text()
    assert "trace: no allocation history (the segments and blocks when the snapshot was taken): no passes, no " \
           "steps, no lifetimes" in text
    assert "findings: none: without an allocation history no cause can be told" in text
    assert "When each was made and freed, and so whether memory grows from step to step, cannot be known (a " \
           "block's role only from its own frames)" in rec.notes[0]
    # allocated, reserved and the free pieces, as the blocks say
    end = fragmentation(data, data.events - 1)
    inactive = [b["size"] for b in blocks if b["state"] == "inactive"]
    assert (end.free_bytes, end.free_pieces) == (sum(inactive), len(inactive))
    assert end.reserved == sum(s["total_size"] for s in r.snap["segments"])
    # the blocks' own frames (the PyTorch 2.0 format keeps them in 'history') name the lines
    top = _block_frames(max(live, key=_block_size))[0]
    assert d.by_line[0].key == f"pytorch_backend.py:{top['line']} allocate"
    assert d.by_line[0].bytes == sum(_block_size(b) for b in live if _block_frames(b)[0]["line"] == top["line"])


def test_a_list_of_segments_is_not_a_snapshot() -> None:
    """torch.cuda.memory_snapshot() (no underscore) returns the segments alone, a list, and people
    pickle that: the error says so and what to call instead."""
    with pytest.raises(GradscopeError, match=r"holds a list, not a CUDA memory snapshot \(a list of segments is "
                                             r"what torch\.cuda\.memory_snapshot\(\) returns"):
        gs.load_snapshot(DATA / "segments_list_memory_snapshot.pkl.gz")


# ----- files people published, found by searching for them ------------------------------------------
def _py(e: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in e.get("frames", []) if f["filename"].endswith(".py")]


def _user_line(e: dict[str, Any]) -> str:
    """The innermost frame outside site-packages and the standard library, as 'file.py:line'."""
    for f in _py(e):
        fn = f["filename"].replace("\\", "/")
        if "site-packages" not in fn and "/lib/python3" not in fn:
            return f"{fn.rsplit('/', 1)[-1]}:{f['line']}"
    return ""


def test_dataparallel_oom_on_one_device_of_three() -> None:
    """DataParallel over 3 GPUs (a graph model and a Qwen3 embedding model built in the trainer's
    __init__), expandable segments: a 4.9 GiB scatter in the replica on cuda:1 ran out of memory
    in the first step's forward; the snapshot was dumped in the except block."""
    name = "dataparallel_3gpu_oom_expandable.pickle.gz"
    assert _snap(name)["allocator_settings"]["expandable_segments"] is True
    r1 = raw(name, 1)
    rec, d = loaded(name, 1)
    (oom,) = [(p, e) for p, e in enumerate(r1.trace) if e["action"] == "oom"]
    p, e = oom
    assert (d.moment, d.at, d.request, d.device_free) == ("oom", p, e["size"], e["device_free"])
    assert d.request_line == "models.py:181 update_nodes" and _user_line(e) == "models.py:181"
    # every byte alive at the OOM was made in this forward (the replica's parameters are broadcast to
    # it), and what the unwinding freed after the OOM was alive when the forward stopped: activations
    made = sum(x["size"] for q, x, f in _allocs(r1) if _alive(q, f, p))
    assert made == r1.live[p + 1] == d.allocated
    assert [(x.role, x.bytes) for x in d.by_role] == [(Role.ACTIVATIONS, made)]
    assert [f.pattern for f in d.findings] == ["capacity", "activations"] and d.findings[1].bytes == made
    assert "needed to map 5.0 GiB more into its expandable segment (20.0 MiB pages)" in d.findings[0].message
    assert trace_passes(snapshot_data(rec))[0].end == p  # the OOM ended the pass
    for device in (0, 2):  # the other devices did not fail: the run stopped at cuda:1's OOM
        rec, d = loaded(name, device)
        assert d.moment == "peak" and d.findings == () and d.ooms_elsewhere == (1,)
        assert "the snapshot also records an OOM on cuda:1 (gs.load_snapshot(path, device=1) diagnoses it): the " \
               "run stopped there, so no backward came after this device's forward" in d.text()
        assert trace_steps(snapshot_data(rec)).count == 0
    # cuda:0: the models moved there in the trainer's constructor are parameters; the loop over the
    # batch's 8 graphs (trainers.py:419, before the model is called) is not a loop of steps
    r0 = raw(name, 0)
    rec, d = loaded(name, 0)
    built = sum(x["size"] for q, x, f in _allocs(r0) if _alive(q, f, d.at)
                and any(fr["name"] == "__init__" and fr["filename"].endswith("trainers.py") for fr in _py(x)))
    assert dict((x.role, x.bytes) for x in d.by_role)[Role.PARAMETERS] == built > 2 << 30
    assert sum(1 for _, x, _ in _allocs(r0) if _user_line(x) == "trainers.py:419") == 8


def test_a_forward_under_no_grad_that_calls_its_model_directly() -> None:
    """A 12-layer LM's forward under torch.no_grad() and bf16 autocast, called as model.forward(x):
    no nn.Module._call_impl frame above the layer loop. The 12 layers repeat, they are not steps;
    autocast's bf16 copies of the weights grow layer by layer and are freed when it exits."""
    name = "lm_small_forward_no_grad_bf16.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    allocs = list(_allocs(r))
    assert all(f >= 0 for _, _, f in allocs)  # the forward freed everything it made
    # the model's forward is called by the benchmark itself, not through nn.Module.__call__
    callers = {fs[i + 1]["name"] for _, x, _ in allocs for fs in [_py(x)] for i, f in enumerate(fs[:-1])
               if f["filename"].endswith("transformer_lm.py") and f["name"] == "forward"}
    assert callers == {"run_mode"}
    assert trace_steps(data).count == 0 and d.findings == ()
    roles = {x.role: x.bytes for x in d.by_role}
    assert set(roles) == {Role.BEFORE_TRACE, Role.TEMPORARIES}
    casts = sum(x["size"] for p, x, f in allocs if _alive(p, f, d.at)
                and any("at::autocast::cached_cast" in n for n in _names(x)))
    assert casts > 200 << 20 and roles[Role.TEMPORARIES] >= casts


def test_adam_on_an_input_for_ten_steps() -> None:
    """Counterfactual search: a frozen CNN, Adam optimizing the input image (7.5 MiB) for 10 steps
    of forward, backward and step; the state is Adam's two tensors the size of that input."""
    name = "counterfactual_adam_10_steps.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    kinds = [p.kind for p in trace_passes(data)]
    assert kinds == ["forward", "backward", "optimizer step"] * 10
    assert trace_steps(data).count == 9 and trace_steps(data).source == "passes"
    state = [x["size"] for _, x, f in _allocs(r) if f < 0 and any("/torch/optim/" in y for y in _files(x))]
    assert state == [7864320, 7864320]
    end = {x.role: x.bytes for x in bytes_by_role(data, data.events - 1)}
    assert end[Role.OPTIMIZER_STATE] == sum(state)
    assert d.findings == ()


@pytest.mark.parametrize("name", ["zeroth_order_fl_no_grad.pickle.gz", "llama_offload_validation_no_grad.pickle.gz",
                                  "lm_medium_inference_mode.pickle.gz"])
def test_forwards_under_no_grad_keep_no_graph(name: str) -> None:
    """Zeroth-order federated training (every forward under torch.no_grad()), a Llama validation
    loop under no_grad that moves each layer's weights in and out, an LM's forward under
    inference_mode: what the forwards leave alive is their outputs, not a graph."""
    r = raw(name)
    rec, d = loaded(name)
    assert d.findings == ()
    assert "no forward left activations waiting for a backward" in d.text()
    # the forwards made thousands of allocations inside the model
    inside = sum(1 for _, x, _ in _allocs(r) if any(f["name"] in ("forward", "_call_impl") for f in _py(x)))
    assert inside > 1000


def test_a_loop_over_layers_is_not_a_loop_of_steps() -> None:
    """The Llama validation repeats each decoder layer's code 32 times per batch inside one model
    call: no steps (two batches are too few anyway)."""
    name = "llama_offload_validation_no_grad.pickle.gz"
    r = raw(name)
    rec, _ = loaded(name)
    layer = [p for p, x, _ in _allocs(r) if _user_line(x).startswith("select_n.py:140")]
    assert len(layer) >= 64
    assert trace_steps(snapshot_data(rec)).count == 0


def test_a_forward_inside_a_training_loop() -> None:
    """A 36-layer LM's forward with grad enabled under bf16 autocast, the snapshot dumped before its
    backward, in a loop that trains (AdamW's state and the previous step's gradients are alive,
    made before this trace, their blocks keep the frames)."""
    name = "lm_large_forward_mid_training_bf16.pickle.gz"
    r = raw(name)
    rec, d = loaded(name)
    (f,) = d.findings
    assert f.pattern == "unused_graph" and f.key == "benchmarking_script.py:108 run_benchmark_with_nvtx"
    held = sum(x["size"] for _, x, fr in _allocs(r) if fr < 0)
    assert f.bytes == held
    state = sum(s for a, (s, fr) in r.pre.items() if any("/torch/optim/" in x["filename"]
                                                          for x in r.pre_frames.get(a, [])))
    grads = sum(s for a, (s, fr) in r.pre.items() if any("torch::autograd::Engine::" in x["name"]
                                                         for x in r.pre_frames.get(a, [])))
    roles = {x.role: x.bytes for x in d.by_role}
    assert roles[Role.OPTIMIZER_STATE] == state > 10 << 30 and roles[Role.GRADIENTS] == grads > 5 << 30
    assert f"in a run that trains (it holds {format_bytes(state)} of optimizer state and {format_bytes(grads)} of " \
           "gradients), so these are what that backward needs" in f.message
    assert f.suggestion.startswith("activation checkpointing")


@pytest.mark.parametrize("name, made_state", [("lm_large_adamw_step_state_before_trace.pickle.gz", False),
                                              ("lm_medium_adamw_step_state_replaced.pickle.gz", True),
                                              ("lm_small_compiled_adamw_step.pickle.gz", True)])
def test_one_training_step_after_warmup(name: str, made_state: bool) -> None:
    """One step (forward, backward, AdamW step) after warm-up steps: the parameters and AdamW's
    state exist before the trace. The assignment's AdamW keeps its state (two tensors per
    parameter) in place, or replaces it each step (new tensors, the old freed); one of them runs
    a torch.compile'd model."""
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    steps = trace_steps(data)
    assert (steps.source, steps.count) == ("annotations", 1) and d.findings == ()
    assert [p.kind for p in trace_passes(data)] == ["forward", "backward", "optimizer step"]
    opt = trace_passes(data)[2]
    made = sum(x["size"] for p, x, f in _allocs(r) if p >= opt.start and f < 0
               and any("/torch/optim/" in y for y in _files(x)))
    end = {x.role: x.bytes for x in bytes_by_role(data, data.events - 1)}
    before = sum(s for a, (s, f) in r.pre.items() if f < 0 and _made_by(r.pre_frames.get(a, [])) is
                 Role.OPTIMIZER_STATE)
    assert end.get(Role.OPTIMIZER_STATE, 0) == made + before
    assert (made > 0) == made_state and (before > 0) == (not made_state)


@pytest.mark.parametrize("name", ["lm_small_fwd_bwd_no_optimizer.pickle.gz",
                                  "tinyllama_8bit_lora_fwd_bwd_notebook.pickle.gz"])
def test_a_forward_and_a_backward(name: str) -> None:
    """A forward and a backward, no optimizer: an LM whose gradients accumulate into the .grad of
    earlier warm-up backwards (nothing new kept), and a TinyLlama 8-bit LoRA in a notebook cell
    (the LoRA weights' gradients are the backward's)."""
    r = raw(name)
    rec, d = loaded(name)
    data = snapshot_data(rec)
    fwd, bwd = trace_passes(data)
    assert (fwd.kind, bwd.kind) == ("forward", "backward") and d.findings == ()
    assert trace_steps(data).count == 0
    allocs = list(_allocs(r))
    first_bwd = min(p for p, x, _ in allocs if any("torch::autograd::Engine::" in n for n in _names(x))
                    or any(f.endswith("torch/autograd/__init__.py") for f in _files(x)))
    assert bwd.start == first_bwd
    acts = sum(x["size"] for p, x, f in allocs if p < first_bwd and _alive(p, f, first_bwd - 1))
    assert {x.role: x.bytes for x in bytes_by_role(data, first_bwd - 1)}[Role.ACTIVATIONS] == acts == fwd.kept
    kept = sum(x["size"] for p, x, f in allocs if p >= first_bwd and f < 0)
    assert bwd.kept == kept
    assert {x.role: x.bytes for x in bytes_by_role(data, data.events - 1)}.get(Role.GRADIENTS, 0) == kept
    assert (kept == 0) == name.startswith("lm_small")
