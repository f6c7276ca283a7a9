"""Roles, steps and memory that grows from step to step, on loops written the way real snapshots
record them (``_snapshots.real_loop``: the allocator's C++ frames first, Python frames between the
interpreter's, PyTorch under site-packages, the autograd engine's thread with C++ frames only,
``Optimizer.step`` annotations or none, ``stacks="python"`` or ``"all"``): a list that keeps
outputs is found with and without annotations, memory that returns to the same level never is, nor
optimizer state, however it is made. Expected values come from the generator's own bookkeeping and
from the trace read directly."""

from __future__ import annotations

from typing import Any

import pytest
from _snapshots import Loop, MiB, real_loop

import gradscope as gs
from gradscope.snapshot import (
    Role,
    SnapshotDiagnosis,
    accumulating_lines,
    allocation_role,
    bytes_by_role,
    memory_by_role,
    snapshot_data,
    trace_passes,
    trace_steps,
)


def _diagnose(loop: Loop) -> SnapshotDiagnosis:
    d = gs.diagnose(gs.load_snapshot(loop.snap))
    assert isinstance(d, SnapshotDiagnosis)
    return d


def _allocs(loop: Loop, line: tuple[str, int] | None = None) -> list[tuple[int, dict[str, Any], int]]:
    """(position, entry, free position or -1) of each alloc; with ``line``, those whose innermost
    Python frame outside site-packages is that line."""
    trace = loop.alloc.trace
    open_: dict[int, int] = {}
    free: dict[int, int] = {}
    for p, e in enumerate(trace):
        if e["action"] == "alloc":
            open_[e["addr"]] = p
        elif e["action"] == "free_completed":
            free[open_.pop(e["addr"])] = p
    def user(e: dict[str, Any]) -> tuple[str, int] | None:
        f = next((f for f in e["frames"] if f["filename"].endswith(".py") and "site-packages" not in f["filename"]),
                 None)
        return None if f is None else (f["filename"].rsplit("/", 1)[-1], f["line"])

    return [(p, e, free.get(p, -1)) for p, e in enumerate(trace) if e["action"] == "alloc" and (
        line is None or user(e) == line)]


def _step_ends(loop: Loop, annotate: bool) -> list[int]:
    """Where each step ends, from the trace alone: the last event at or before each Optimizer.step
    END, or (without annotations) the event before each step's input after the first."""
    trace = loop.alloc.trace
    if annotate:
        ends = [a["time_us"] for a in loop.alloc.annotations if a["name"].startswith("Optimizer.step#")
                and a["stage"] == "END"]
        return [max(p for p, e in enumerate(trace) if e["time_us"] <= t) for t in ends]
    return [p - 1 for p, _, _ in _allocs(loop, ("train.py", 57))[1:]]


def _alive(p: int, free: int, at: int) -> bool:
    return p <= at and (free < 0 or free > at)


@pytest.mark.parametrize("annotate", [True, False])
@pytest.mark.parametrize("cpp", [True, False])
def test_a_list_keeping_each_steps_logits_is_one_leak(annotate: bool, cpp: bool) -> None:
    loop = real_loop(steps=6, keep="logits", annotate=annotate, cpp=cpp)
    rec = gs.load_snapshot(loop.snap)
    data = snapshot_data(rec)
    d = _diagnose(loop)
    steps = trace_steps(data)
    # with annotations a step ends where Optimizer.step ends; without, where a forward begins again
    ends = _step_ends(loop, annotate)
    assert steps.source == ("annotations" if annotate else "passes") and steps.ends == tuple(ends)
    assert steps.count == (6 if annotate else 5)
    (leak,) = [f for f in d.findings if f.pattern == "accumulating"]
    assert len(d.findings) == 1
    # every step's logits, all alive at the peak
    logits = _allocs(loop, ("model.py", 30))
    assert all(fr < 0 for _, _, fr in logits) and len(logits) == 6
    assert leak.bytes == sum(e["size"] for p, e, fr in logits if _alive(p, fr, d.at)) == 6 * 5 * MiB
    assert leak.role is Role.KEPT and leak.key.startswith("model.py:30 forward ← model.py:40 forward ← train.py:57")
    (acc,) = d.accumulating
    assert all(b - a == 5 * MiB for a, b in zip(acc.at_step_ends, acc.at_step_ends[1:], strict=False))  # one more per step
    assert "(called from model.py:40 forward ← train.py:57 train_step ← train.py:120 main)" in leak.message
    assert "where train.py:57 train_step keeps the result" in leak.suggestion
    assert "about 5.0 MiB more per step" in leak.message
    # the user's lines: never the einops frame under model.py:22, never a C++ frame
    keys = [r.key for r in d.by_line]
    assert "model.py:22 forward" in keys and not any("einops" in k or "::" in k for k in keys)
    assert ("(backward: C++ frames only)" in keys) == cpp
    # roles at the end: the model, AdamW's two tensors per parameter, the gradients, the kept logits
    end = {r.role: r.bytes for r in bytes_by_role(data, data.events - 1)}
    assert end[Role.PARAMETERS] == loop.param_bytes and end[Role.GRADIENTS] == loop.param_bytes
    assert end[Role.OPTIMIZER_STATE] == 2 * loop.param_bytes
    # kept: logits still alive when the step after theirs ended (the last ones have no such step yet)
    kept = [e["size"] for p, e, fr in logits if sum(1 for x in ends if x < p) + 1 < len(ends)]
    assert end[Role.KEPT] == sum(kept) and end[Role.ACTIVATIONS] == 6 * 5 * MiB - sum(kept)
    assert sum(end.values()) == data.live_bytes(data.events - 1)


@pytest.mark.parametrize("annotate", [True, False])
@pytest.mark.parametrize("lazy_state", [False, True])
def test_memory_returning_to_the_same_level_and_optimizer_state_are_never_a_leak(annotate: bool,
                                                                                  lazy_state: bool) -> None:
    """The same loop keeping nothing: every step ends where it began. Optimizer state lives across
    every step, and made over the first three steps (lazy) it even grows: never a leak."""
    loop = real_loop(steps=8, annotate=annotate, lazy_state=lazy_state)
    d = _diagnose(loop)
    data = snapshot_data(gs.load_snapshot(loop.snap))
    assert trace_steps(data).count == (8 if annotate else 7)
    assert d.findings == () and d.accumulating == ()
    for group in ("stack", "line", "function", "file"):
        assert accumulating_lines(data, data.events - 1, group=group) == ()
    state = [(p, e, fr) for p, e, fr in _allocs(loop) if any(f["filename"].endswith("/torch/optim/adamw.py")
                                                           for f in e["frames"])]
    alive = [e["size"] for _, e, fr in state if fr < 0]
    assert len(alive) == 6 and sum(alive) == 2 * loop.param_bytes  # the step's temporaries were freed
    assert {allocation_role(data, i) for i in range(data.allocations)
            if data.alloc_free_at[i] < 0 and data.stack_frames(data.alloc_stack[i])
            and any(f.filename.endswith("adamw.py") for f in data.stack_frames(data.alloc_stack[i]))} \
        == {Role.OPTIMIZER_STATE}
    text = d.text()
    assert "findings: none: no memory grows from step to step, and no forward left activations waiting" in text


def test_an_evaluation_loop_keeping_its_outputs_is_one_cause() -> None:
    """No backward: each step's logits kept, and with them every activation of that forward.
    Four stacks grow (three layers and the logits): one cause, the line that called the model."""
    loop = real_loop(steps=6, keep="outputs", backward=False, optimizer=False)
    data = snapshot_data(gs.load_snapshot(loop.snap))
    d = _diagnose(loop)
    steps = trace_steps(data)
    assert steps.source == "repetition" and steps.count == 6
    # each step starts where the loop allocates its input: validate's first line
    inputs = _allocs(loop, ("train.py", 80))
    assert steps.ends == tuple(p - 1 for p, _, _ in inputs)
    assert "each starts where train.py:80 validate ← train.py:120 main" in steps.how
    leaks = [f for f in d.findings if f.pattern == "accumulating"]
    assert len(leaks) == 1
    (leak,) = leaks
    in_model = [(p, e, fr) for p, e, fr in _allocs(loop) if any(f["line"] == 40 and f["filename"].endswith("model.py")
                                                               for f in e["frames"])]
    assert leak.bytes == sum(e["size"] for p, e, fr in in_model if _alive(p, fr, d.at))
    assert "and 3 other stacks" in leak.message and "where train.py:80 validate keeps the result" in leak.suggestion
    assert "torch.no_grad()" in leak.suggestion
    # and the forward of the last step holds its graph for a backward that never comes
    (unused,) = [f for f in d.findings if f.pattern == "unused_graph"]
    assert unused.key == "train.py:80 validate"


def test_a_forward_loop_under_grad_that_drops_its_outputs() -> None:
    """Memory returns to the same level each step, but at the peak one forward's activations are
    held for a backward that never comes: one unused_graph finding, with their bytes."""
    loop = real_loop(steps=5, backward=False, optimizer=False)
    data = snapshot_data(gs.load_snapshot(loop.snap))
    d = _diagnose(loop)
    assert trace_steps(data).count == 5 and d.accumulating == ()
    (f,) = d.findings
    assert f.pattern == "unused_graph"
    # alive at the peak and made by the model after its layers' temporaries: activations and logits
    model_made = [(p, e, fr) for p, e, fr in _allocs(loop) if any(x["line"] == 40 for x in e["frames"])
                  and not any(x["name"].endswith("gelu") for x in e["frames"])]
    assert f.bytes == sum(e["size"] for p, e, fr in model_made if _alive(p, fr, d.at))
    roles = {r.role: r.bytes for r in d.by_role}
    assert roles[Role.ACTIVATIONS] >= f.bytes and Role.KEPT not in roles


def test_roles_over_time_for_the_view() -> None:
    loop = real_loop(steps=4, keep="logits")
    data = snapshot_data(gs.load_snapshot(loop.snap))
    tl = memory_by_role(data, points=50)
    assert tl.group == "role" and tl.groups[0] == Role.PARAMETERS.label
    assert set(tl.groups) == {r.role.label for p in tl.positions for r in bytes_by_role(data, p)}
    for k, p in enumerate(tl.positions):
        want = {r.role.label: r.bytes for r in bytes_by_role(data, p)}
        assert {g: tl.bytes[j][k] for j, g in enumerate(tl.groups) if tl.bytes[j][k]} == want
        assert tl.total[k] == data.live_bytes(p)
    assert [p.kind for p in trace_passes(data)][:3] == ["forward", "backward", "optimizer step"]


def test_a_trace_without_frames_says_what_it_cannot_tell() -> None:
    """The same leaking loop recorded without stacks: the Optimizer.step annotations still give the
    steps, and what is made inside them is optimizer state; the rest has no role, and the growth is
    found without a line to name."""
    loop = real_loop(steps=6, keep="logits")
    for e in loop.snap["device_traces"][0]:
        e["frames"] = []
    for seg in loop.snap["segments"]:
        for b in seg["blocks"]:
            b["frames"] = []
    data = snapshot_data(gs.load_snapshot(loop.snap))
    d = _diagnose(loop)
    steps = trace_steps(data)
    assert steps.source == "annotations" and steps.ends == tuple(_step_ends(loop, True))
    assert [p.kind for p in trace_passes(data)] == ["optimizer step"] * 6
    roles = {r.role: r.bytes for r in bytes_by_role(data, data.events - 1)}
    assert roles == {Role.OPTIMIZER_STATE: 2 * loop.param_bytes,
                     Role.UNKNOWN: data.live_bytes(data.events - 1) - 2 * loop.param_bytes}
    (leak,) = d.findings
    assert leak.pattern == "accumulating" and leak.key is None
    assert "the trace has no frames to say which line makes it" in leak.message
    assert "about 5.0 MiB more per step" in leak.message  # the kept logits, one per step
    assert any("the trace has no Python frames" in n for n in d.notes)


def test_a_capacity_oom_says_what_each_role_would_free() -> None:
    """An OOM in the third step's forward of the training loop: the verdict, then the levers by the
    bytes they free: AdamW's state (two tensors per parameter: 2x the parameters), the
    activations held so far (checkpointing, half the batch), the fragmented free pieces."""
    loop = real_loop(steps=5, oom_step=2, capacity=100 * MiB)
    data = snapshot_data(gs.load_snapshot(loop.snap))
    d = _diagnose(loop)
    assert d.moment == "oom" and d.findings[0].pattern == "capacity"
    levers = d.findings[1:]
    assert [f.bytes for f in levers] == sorted((f.bytes for f in levers), reverse=True)
    by = {f.pattern: f for f in levers}
    roles = {r.role: r.bytes for r in bytes_by_role(data)}
    assert sum(roles.values()) == d.allocated == data.live_bytes(d.at)
    assert by["optimizer_state"].bytes == roles[Role.OPTIMIZER_STATE] == 2 * loop.param_bytes
    assert "2.0x the 12.0 MiB of the parameters (Adam and AdamW keep two tensors the size of each parameter: " \
           "2x)" in by["optimizer_state"].message
    assert f"about {gs.recording.format_bytes(loop.param_bytes * 2 * 3 // 4)} less here" in \
        by["optimizer_state"].suggestion
    # the activations alive at the OOM: the two layers of this step's forward, and its input
    acts = [(p, e, fr) for p, e, fr in _allocs(loop) if e["size"] in (3 * MiB, 512 * 1024)]
    assert by["activations"].bytes == roles[Role.ACTIVATIONS] == sum(
        e["size"] for p, e, fr in acts if _alive(p, fr, d.at))
    assert "half the batch (or sequence) frees about" in by["activations"].suggestion
    assert "gradients" not in by  # zero_grad(set_to_none=True) freed them before this forward
    if "fragmentation" in by:
        assert by["fragmentation"].bytes == d.pageable_bytes
    for role in (Role.OPTIMIZER_STATE, Role.ACTIVATIONS, Role.PARAMETERS):
        assert f"{role.label} {gs.recording.format_bytes(roles[role])}" in d.findings[0].message
