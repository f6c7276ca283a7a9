"""``gs.diagnose`` of a CUDA memory snapshot: what was live at the OOM (else the peak) by role and by
the user's line, the request that failed, how fragmented the reserved memory was, and the causes
the trace shows, each with the bytes that acting on it would free.

Reached from :func:`gradscope.diagnose` for a :class:`~gradscope.snapshot.SnapshotRecording`
(see :func:`gradscope.snapshot.load_snapshot`); everything here reads the allocation-level data
through the pure functions of :mod:`gradscope.snapshot`, so each figure of the report can be
asked for on its own (``bytes_by_role``, ``bytes_by_line``, ``trace_steps``, ``fragmentation``,
``accumulating_lines``, ``segment_states``).

NOTE [ a snapshot's findings ]: one finding per cause, at most five. The failure's verdict comes
first (an OOM's ``capacity``, ``fragmentation``, ``request_too_large`` or ``free_piece_fits``),
then the causes ranked by the bytes that acting on them would free. Each names the user's line
(:func:`gradscope.snapshot.line_frame`: never a C++ frame), the role and the bytes. A snapshot
runs nothing, so no finding carries code: they say what to change in words and bytes, and
``gs.record`` / ``gs.diagnose`` on the step itself run each fix and print its code with the
saving measured. Causes:

- ``accumulating``: memory kept from step to step keeps growing (NOTE [ a leak grows across
  steps ] in :mod:`gradscope._analyses.snapshot.roles`): a list that keeps outputs, and with them their
  autograd graphs; a cache that only grows. One finding per line that enters the model (the stacks
  it reaches are one cause).
- ``unused_graph``: without an OOM, activations that no backward in the trace came after: a
  forward whose graph is never used (``torch.no_grad()`` / ``inference_mode()``), one finding
  however many lines made them.
- at a ``capacity`` OOM, what each lever would free: ``activations`` (checkpointing, a smaller
  batch), ``optimizer_state`` (its bytes per parameter), ``gradients`` (freed earlier), and
  ``fragmentation`` (what ``expandable_segments`` could map, counted from the segments).
- ``fragmentation``: the request would have fit in the reserved but unallocated memory plus what
  the device still had, but no free piece was large enough. What ``expandable_segments`` and
  ``max_split_size_mb`` would change is computed on the snapshot's own segments (NOTE [ what the
  allocator settings would change ]).
- ``capacity``: even all free memory together was less than the request: only holding less helps.
- ``request_too_large``: the one request is larger than everything the device had left, with
  nothing else counted.
- ``free_piece_fits``: a free piece of the request's stream was large enough: the failure came from
  memory this trace does not show.

Example:
    >>> import gradscope as gs
    >>> fr = [{"filename": "/home/u/train.py", "line": 57, "name": "train_step"}]
    >>> trace = [{"action": "alloc", "addr": i << 21, "size": 2 << 20, "stream": 0, "frames": fr}
    ...          for i in range(40)]
    >>> trace.append({"action": "oom", "size": 64 << 20, "device_free": 0, "stream": 0, "frames": fr})
    >>> seg = {"device": 0, "address": 0, "total_size": 80 << 20, "stream": 0,
    ...        "blocks": [{"address": i << 21, "size": 2 << 20, "requested_size": 2 << 20,
    ...                    "state": "active_allocated", "frames": fr} for i in range(40)]}
    >>> d = gs.diagnose(gs.load_snapshot({"segments": [seg], "device_traces": [trace]}))
    >>> d.request, [f.pattern for f in d.findings]
    (67108864, ['capacity', 'accumulating', 'activations'])
    >>> print(d.by_line[0])
    train.py:57 train_step: 80.0 MiB in 40 blocks
"""

from __future__ import annotations

from dataclasses import dataclass

from gradscope._analyses.snapshot.data import SnapshotData, snapshot_data
from gradscope._analyses.snapshot.frames import Frame, group_of, is_user_frame
from gradscope._analyses.snapshot.queries import (
    Fragmentation,
    LineBytes,
    OomCause,
    SegmentState,
    bytes_by_line,
    fragmentation,
    segment_size_for,
    segment_states,
)
from gradscope._analyses.snapshot.roles import (
    Accumulation,
    Role,
    RoleBytes,
    TracePass,
    TraceSteps,
    UnusedGraph,
    accumulating_lines,
    bytes_by_role,
    entry_frame,
    is_model_call,
    role_notes,
    trace_passes,
    trace_steps,
    unused_graph,
)
from gradscope._base import registry as _views
from gradscope._model.recording import Recording, format_bytes

__all__ = [
    "LARGE_PAGE",
    "MAX_FINDINGS",
    "SMALL_PAGE",
    "SMALL_REQUEST",
    "SnapshotDiagnosis",
    "SnapshotFinding",
    "diagnose_snapshot",
    "pageable_bytes",
]

SMALL_REQUEST = 1 << 20  # requests up to 1 MiB are served from the small pool
SMALL_PAGE = 2 << 20  # expandable segments map the small pool in 2 MiB pages
LARGE_PAGE = 20 << 20  # and the large pool in 20 MiB pages
MAX_FINDINGS = 5  # see NOTE [ a snapshot's findings ]
# NOTE [ what the allocator settings would change ]
# PyTorch's caching allocator serves a request from one contiguous free block of one segment of
# the request's stream and pool; a segment goes back to CUDA only when it is entirely free (on an
# OOM the allocator releases those and retries). So free bytes in partly used segments are lost to
# a request larger than their largest piece. The two settings people are told to try change that
# in different ways, and the snapshot's segments at the OOM say whether either would have helped:
# - expandable_segments:True: one segment per stream and pool grows by mapping physical pages
#   (2 MiB in the small pool, 20 MiB in the large one) into a large virtual range, and on an OOM
#   the allocator unmaps the free pages of partly used segments and maps them again where the
#   request needs them. What becomes usable is the free pieces' whole pages plus the device's free
#   bytes (`pageable_bytes`), counted on this snapshot's layout: with the setting the layout
#   differs, so this is an estimate of the same run's state, said so in the text.
# - max_split_size_mb:M: blocks of M MiB or more are never split for requests below M. It helps
#   only when a segment at least as large as the request exists and smaller live blocks split it;
#   with no segment that large there is no large block to keep whole, and the text says so.
# Neither helps a capacity failure: all free memory together is less than the request.


@dataclass(frozen=True)
class SnapshotFinding:
    """One cause found in a snapshot, with what to change, in words (see NOTE [ a snapshot's
    findings ]).

    ``bytes`` is what acting on it would free (for an OOM's verdict: what had to be released, or
    the request); ``key`` the user's line (or stack) it is about, None for the allocator as a
    whole; ``role`` the role of the memory it is about (None for the allocator).
    """

    pattern: str
    bytes: int
    message: str
    suggestion: str
    key: str | None = None
    role: Role | None = None


@dataclass(frozen=True)
class SnapshotDiagnosis:
    """What a CUDA snapshot says about its OOM (or its peak, without one).

    ``moment`` is ``"oom"`` or ``"peak"`` (``"empty"`` without allocations); ``at`` its trace
    position. ``by_role`` is what was live then by role, ``by_line`` by the user's line, largest
    first (all of them; the text lists ``top``); ``passes`` and ``steps`` the trace's structure;
    ``accumulating`` the memory that grows from step to step; ``pageable_bytes`` what
    ``expandable_segments`` could have unmapped and used again (None without a request);
    ``ooms_elsewhere`` the other devices of the snapshot that ran out of memory; ``history``
    False when the snapshot has no allocation history (segments and blocks only). ``text()`` is
    deterministic.
    """

    label: str
    device: int
    moment: str
    at: int
    t_s: float | None
    allocated: int
    reserved: int
    request: int | None
    request_stream: int | None
    request_line: str | None
    device_free: int | None
    by_line: tuple[LineBytes, ...]
    fragmentation: Fragmentation
    accumulating: tuple[Accumulation, ...]
    findings: tuple[SnapshotFinding, ...]
    pageable_bytes: int | None
    notes: tuple[str, ...] = ()
    top: int = 8
    by_role: tuple[RoleBytes, ...] = ()
    passes: tuple[TracePass, ...] = ()
    steps: TraceSteps | None = None
    ooms_elsewhere: tuple[int, ...] = ()
    history: bool = True

    def text(self) -> str:
        """The report as plain text (its view: ``gradscope._views.snapshot_text``)."""
        return str(_views.render(_views.ViewKind.TEXT, self))

    def why_no_finding(self) -> str:
        """Why there is no finding, in one sentence (what the trace could and could not tell)."""
        steps = self.steps.count if self.steps is not None else 0
        if not self.history:
            return ("without an allocation history no cause can be told (when each block was made and freed is "
                    "unknown); the lines above are where the memory is.")
        if not self.passes:
            return "without frames no cause can be told; the lines above are where the memory is."
        if self.ooms_elsewhere:
            return (f"this device did not run out of memory: {_devices(self.ooms_elsewhere)} did, and the run stopped "
                    "there (diagnose that device); the roles and lines above are where the memory is.")
        grow = ("no memory grows from step to step" if steps >= 3 else
                f"the trace holds {steps} step end{'s' if steps != 1 else ''}, too few to tell whether memory grows "
                "from step to step (it takes three)")
        return f"{grow}, and no forward left activations waiting for a backward that did not come; the roles and " \
               "lines above are where the memory is."

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return str(_views.render(_views.ViewKind.HTML, self))


def diagnose_snapshot(recording: Recording, *, top: int = 8) -> SnapshotDiagnosis:
    """The diagnosis of a recording made by :func:`gradscope.snapshot.load_snapshot` (what
    ``gs.diagnose`` returns for one). ``top``: how many lines the text lists."""
    data = snapshot_data(recording)
    at = data.default_at
    notes = [n for n in recording.notes
             if n.startswith(("the trace starts mid-run", "no stack frames", "no allocation history"))]
    notes.extend(role_notes(data))
    if data.ooms_elsewhere and data.oom is None:
        acts = sum(r.bytes for r in bytes_by_role(data, at) if r.role is Role.ACTIVATIONS) if at >= 0 else 0
        waiting = (f"; the {format_bytes(acts)} of activations alive at the peak were waiting for it, not kept by a "
                   "graph nobody uses" if acts else "")
        notes.append(f"the snapshot also records an OOM on {_devices(data.ooms_elsewhere)} (gs.load_snapshot(path, "
                     f"device={data.ooms_elsewhere[0]}) diagnoses it): the run stopped there, so no backward came "
                     f"after this device's forward{waiting}.")
    if at < 0 and data.peak_bytes == 0:
        return SnapshotDiagnosis(
            label=recording.label, device=data.device, moment="empty", at=at, t_s=None, allocated=0,
            reserved=data.reserved_bytes(at) if data.events else data.initial_reserved, request=None,
            request_stream=None, request_line=None, device_free=None, by_line=(),
            fragmentation=fragmentation(data, at), accumulating=(), findings=(), pageable_bytes=None,
            notes=tuple(notes), top=top,
        )
    oom = data.oom
    frag = fragmentation(data, at)
    by_line = bytes_by_line(data, at)
    by_role = bytes_by_role(data, at)
    acc = accumulating_lines(data, at, group="stack")
    segs = segment_states(data, at)
    pageable = pageable_bytes(segs) if oom is not None else None
    causes = _leak_findings(data, acc, oom is not None)
    unused = unused_graph(data, at)
    if unused is not None:
        trains: dict[Role, int] = {r.role: r.bytes for r in by_role if r.role in (Role.OPTIMIZER_STATE, Role.GRADIENTS)}
        causes.append(_unused_graph_finding(unused, trains))
    verdict: list[SnapshotFinding] = []
    if oom is not None:
        verdict = _oom_findings(data, frag, segs, by_line, by_role, causes, pageable or 0)
        if verdict and verdict[0].pattern == "capacity":
            causes.extend(_levers(data, at, by_role, frag, pageable or 0))
    causes.sort(key=lambda fd: (-fd.bytes, fd.pattern, fd.key or ""))
    findings = (verdict + causes)[:MAX_FINDINGS]
    return SnapshotDiagnosis(
        label=recording.label, device=data.device, moment="oom" if oom is not None else "peak", at=at,
        t_s=data.t_s(at), allocated=frag.allocated, reserved=frag.reserved,
        request=None if oom is None else oom.requested, request_stream=None if oom is None else oom.stream,
        request_line=None if oom is None or not oom.frames else group_of(oom.frames, "line"),
        device_free=None if oom is None else oom.device_free, by_line=by_line, fragmentation=frag,
        accumulating=acc, findings=tuple(findings), pageable_bytes=pageable, notes=tuple(notes), top=top,
        by_role=by_role, passes=trace_passes(data), steps=trace_steps(data), ooms_elsewhere=data.ooms_elsewhere,
        history=any(a >= 0 for a in data.alloc_at),
    )


def _devices(devices: tuple[int, ...]) -> str:
    return " and ".join(f"cuda:{d}" for d in devices)

# ----- memory that grows from step to step ----------------------------------------------------------
def _leak_findings(data: SnapshotData, acc: tuple[Accumulation, ...], at_oom: bool) -> list[SnapshotFinding]:
    """One finding per line that enters the model: the stacks that grow through it are one cause."""
    causes: dict[str, list[Accumulation]] = {}
    for a in acc:
        entry = _entry_of(data, a.frames)
        causes.setdefault(entry.label if entry is not None else a.key, []).append(a)
    moment = "at the OOM" if at_oom else "at the peak"
    out = []
    for where, group in causes.items():
        top = max(group, key=lambda a: a.bytes)
        total = sum(a.bytes for a in group)
        blocks = sum(a.blocks for a in group)
        first = sum(a.at_step_ends[0] for a in group)
        last = sum(a.at_step_ends[-1] for a in group)
        n = len(top.step_ends)
        per_step = (last - first) // max(n - 1, 1)
        users = [f for f in top.frames if is_user_frame(f)]
        line = users[0].label if users else group_of(top.frames, "line")
        callers = [f.label for f in users[1:4]]
        called = f" (called from {' ← '.join(callers)})" if callers else ""
        others = f" and {len(group) - 1} other stack{'s' if len(group) > 2 else ''}" if len(group) > 1 else ""
        # made inside a module call: outputs that hold their autograd graphs while they are kept
        graphs = any(is_model_call(f) for f in top.frames)
        keeper = where if where != line else (callers[0] if callers else line)
        what = ("a module's outputs, and with them their autograd graphs (every activation saved for backward)"
                if graphs else "what it makes each step (a list or cache that only grows)")
        freed = sum(a.freed for a in group)
        gone = ("none of its allocations was ever freed" if not freed else
                f"{freed} other allocation{'s' if freed != 1 else ''} from it {'were' if freed != 1 else 'was'} freed")
        message = (
            f"memory kept from step to step grows: {line}{called}{others} held {format_bytes(total)} in {blocks} "
            f"block{'s' if blocks != 1 else ''} {moment} ({gone}); at the ends of {n} steps it went from "
            f"{format_bytes(first)} to {format_bytes(last)}, about {format_bytes(per_step)} more per step: "
            f"something keeps {what}."
        )
        suggestion = (
            f"where {keeper} keeps the result, keep a number (loss.item()) or a detached copy (out.detach()) "
            + ("instead, or run the call under torch.no_grad() when no gradient is needed; " if graphs else
               "instead; ")
            + f"or clear or bound what keeps them each step: that frees the {format_bytes(total)} and stops the "
            f"growth of about {format_bytes(per_step)} per step."
        )
        if not top.frames:  # a trace recorded without frames: the growth is known, the line is not
            message = (
                f"memory kept from step to step grows: allocations without frames held {format_bytes(total)} in "
                f"{blocks} block{'s' if blocks != 1 else ''} {moment}; at the ends of {n} steps it went from "
                f"{format_bytes(first)} to {format_bytes(last)}, about {format_bytes(per_step)} more per step: "
                "something keeps memory each step, and the trace has no frames to say which line makes it."
            )
            suggestion = (
                "record the history with frames (torch.cuda.memory._record_memory_history(stacks='all')) to see the "
                "line; then keep numbers or detached copies there instead of tensors, or clear what keeps them each "
                f"step: that frees the {format_bytes(total)}."
            )
        out.append(SnapshotFinding("accumulating", total, message, suggestion, top.key if top.frames else None,
                                   Role.KEPT))
    return out


def _entry_of(data: SnapshotData, frames: tuple[Frame, ...]) -> Frame | None:
    index = data._cache.get("stack_by_frames")
    if index is None:
        index = data._cache["stack_by_frames"] = {data.stack_frames(i): i for i in range(len(data.stacks))}
    sid = index.get(frames)
    return entry_frame(data, sid) if sid is not None else None


# ----- a forward whose graph no backward used -----------------------------------------------------
def _unused_graph_finding(u: UnusedGraph, trains: dict[Role, int]) -> SnapshotFinding:
    """``trains``: the optimizer state and gradients alive then (a run that trains: the backward
    after the snapshot needs the activations)."""
    from_ = u.entry
    where = from_.label if from_ is not None else "the forward"
    nbytes, blocks, cast, passes = u.bytes, u.blocks, u.autocast, u.passes
    forwards = "the forward" if passes <= 1 else f"the {passes} forwards"
    it = "it" if passes <= 1 else "them"
    called = f" called at {where}" if from_ is not None else ""
    autocast = (f"; {format_bytes(cast)} of it are autocast's lower-precision copies of weights and inputs "
                "(at::autocast::cached_cast), kept for the same backward" if cast else "")
    left = (f"{forwards}{called} left {format_bytes(nbytes)} of activations in {blocks} "
            f"block{'s' if blocks != 1 else ''} alive at the peak, and no backward in the trace came after {it}")
    if trains:
        held = " and ".join(f"{format_bytes(b)} of {r.label}" for r, b in trains.items())
        message = (f"{left}: the trace ends between a forward and its backward, in a run that trains (it holds "
                   f"{held}), so these are what that backward needs, held by the output's autograd graph{autocast}.")
        suggestion = (f"activation checkpointing (torch.utils.checkpoint around the model's blocks) keeps only each "
                      f"block's inputs of the {format_bytes(nbytes)} and recomputes the rest in backward; half the "
                      f"batch (or sequence) keeps about half; if this forward needs no gradient, torch.no_grad() or "
                      "torch.inference_mode() keeps none of it.")
    else:
        message = (f"{left}: the autograd graph of the output holds them for a backward that did not run{autocast}.")
        suggestion = (
            f"if no gradient is needed there, run {it} under torch.no_grad() or torch.inference_mode(): activations "
            f"are then not kept, up to {format_bytes(nbytes)} less at the peak (the output itself stays); if a "
            "backward comes after the snapshot was taken, they are what it needs (activation checkpointing keeps "
            "fewer)."
        )
    return SnapshotFinding("unused_graph", nbytes, message, suggestion, where if from_ is not None else None,
                           Role.ACTIVATIONS)


# ----- what each lever would free at a capacity OOM ------------------------------------------------
def _levers(data: SnapshotData, at: int, by_role: tuple[RoleBytes, ...], frag: Fragmentation,
            pageable: int) -> list[SnapshotFinding]:
    held = {r.role: r.bytes for r in by_role}
    total = max(frag.allocated, 1)
    out = []

    def share(n: int) -> str:
        return f"{format_bytes(n)} ({100 * n / total:.0f}% of what was allocated)"

    act = held.get(Role.ACTIVATIONS, 0)
    if act:
        out.append(SnapshotFinding(
            "activations", act,
            f"activations held {share(act)} at the OOM: what the forward keeps for its backward.",
            f"activation checkpointing (torch.utils.checkpoint around the model's blocks) keeps only each block's "
            f"inputs and recomputes the rest in backward: it frees most of the {format_bytes(act)}; half the batch "
            f"(or sequence) frees about {format_bytes(act // 2)}.",
            None, Role.ACTIVATIONS))
    opt = held.get(Role.OPTIMIZER_STATE, 0)
    if opt:
        params = held.get(Role.PARAMETERS, 0) or held.get(Role.BEFORE_TRACE, 0)
        what = ("the parameters" if held.get(Role.PARAMETERS, 0) else
                "what existed before the trace (the parameters among it)")
        ratio = (f", {opt / params:.1f}x the {format_bytes(params)} of {what} (Adam and AdamW keep two tensors "
                 "the size of each parameter: 2x)" if params else "")
        out.append(SnapshotFinding(
            "optimizer_state", opt,
            f"optimizer state held {share(opt)} at the OOM{ratio}.",
            "an optimizer that keeps less per parameter: 8-bit Adam keeps 2 bytes per parameter where fp32 Adam "
            f"keeps 8 (about {format_bytes(opt * 3 // 4)} less here); sharding the state over N GPUs (FSDP, "
            "ZeRO) keeps 1/N of it; SGD without momentum keeps none.",
            None, Role.OPTIMIZER_STATE))
    grads = held.get(Role.GRADIENTS, 0)
    if grads:
        kind = _pass_kind_at(data, at)
        if kind == "forward":
            fix = (f"they are the previous step's, still alive in this forward: optimizer.zero_grad(set_to_none=True) "
                   f"before the forward frees the {format_bytes(grads)}.")
        else:
            fix = ("an optimizer step inside backward (Tensor.register_post_accumulate_grad_hook) frees each "
                   f"gradient as soon as it is used, up to the {format_bytes(grads)}; gradients in lower precision "
                   "keep half.")
        out.append(SnapshotFinding("gradients", grads, f"gradients held {share(grads)} at the OOM.", fix, None,
                                   Role.GRADIENTS))
    if pageable:
        out.append(SnapshotFinding(
            "fragmentation", pageable,
            f"{format_bytes(frag.free_bytes)} of reserved memory was free in {frag.free_pieces} pieces, none large "
            "enough: a block must be contiguous inside one segment.",
            f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) the allocator can unmap "
            f"the whole pages of those pieces and map them where a request needs them: {format_bytes(pageable)} "
            "counted on this snapshot's segments (an estimate: with the setting the layout differs).",
            None, None))
    return out


def _pass_kind_at(data: SnapshotData, at: int) -> str | None:
    kind = None
    for p in trace_passes(data):
        if p.start <= at:
            kind = p.kind
    return kind


# ----- the failed request ----------------------------------------------------------------------
def pageable_bytes(segments: tuple[SegmentState, ...]) -> int:
    """Bytes in the whole pages of the segments' free pieces: what ``expandable_segments`` could
    unmap and map again for a request (see NOTE [ what the allocator settings would change ]).
    Pages are counted from each segment's start, 2 MiB in segments of the small pool (2 MiB
    segments), 20 MiB otherwise."""
    total = 0
    for g in segments:
        page = SMALL_PAGE if g.size <= SMALL_PAGE else LARGE_PAGE
        for addr, size in g.free_pieces:
            first = -(-(addr - g.address) // page)  # first whole page inside the piece
            last = (addr + size - g.address) // page
            total += max(0, last - first) * page
    return total


def _oom_findings(data: SnapshotData, frag: Fragmentation, segs: tuple[SegmentState, ...],
                  by_line: tuple[LineBytes, ...], by_role: tuple[RoleBytes, ...], causes: list[SnapshotFinding],
                  pageable: int) -> list[SnapshotFinding]:
    oom = data.oom
    assert oom is not None and frag.request is not None
    request = frag.request
    device_free = oom.device_free or 0
    free_total = frag.free_bytes + device_free
    holders = ", ".join(f"{r.key} ({format_bytes(r.bytes)})" for r in by_line[:3])
    if frag.cause is OomCause.FITS:
        return [SnapshotFinding(
            "free_piece_fits", request,
            f"a free piece of {format_bytes(frag.largest_free_on_stream)} on stream {frag.stream} was large "
            f"enough for the {format_bytes(request)} request at that moment: the failure came from memory "
            "this trace does not show (a memory pool of its own, e.g. a CUDA graph's; another process; "
            "NCCL or cuBLAS workspaces).",
            "check torch.cuda.memory_stats() and nvidia-smi for memory outside the caching allocator, and "
            "record the history of every pool (torch.cuda.memory._record_memory_history before the pools "
            "are made).",
        )]
    if frag.cause is OomCause.FRAGMENTATION:
        return [_fragmentation_finding(frag, segs, pageable, device_free)]
    if request > frag.reserved + device_free:
        short = request - free_total
        return [SnapshotFinding(
            "request_too_large", request,
            f"the one request of {_size(request)} is larger than all the device could still give: "
            f"{format_bytes(frag.reserved)} reserved by the allocator (of which {format_bytes(frag.free_bytes)} "
            f"free) and {format_bytes(device_free)} free on the device; it is {format_bytes(short)} more than "
            "all free memory together.",
            f"make the tensor requested at {_request_line(oom)} smaller (a smaller batch or sequence, chunks "
            "processed one at a time, a lower precision), or run on a device with more memory.",
        )]
    expandable = any(g.expandable and g.stream == frag.stream for g in segs)
    if expandable:  # the segment grows by mapping whole pages (see NOTE [ what the allocator settings would change ])
        page = SMALL_PAGE if request <= SMALL_REQUEST else LARGE_PAGE
        need = -(-request // page) * page
        grow = f"needed to map {format_bytes(need)} more into its expandable segment ({format_bytes(page)} pages)"
    else:
        need = segment_size_for(request)
        grow = f"needed a new segment of {format_bytes(need)}"
    if device_free >= need:
        # the device said it had room for the segment: a cap on this process held it back
        short = request - frag.free_bytes
        device = (f"the device reported {format_bytes(device_free)} free, enough for it: the process's share was "
                  "used up (torch.cuda.set_per_process_memory_fraction, or memory taken outside this allocator)")
    else:
        # releasing that much makes room either way: a free piece the request fits, or a segment
        short = min(request - frag.free_bytes, need - device_free)
        device = f"the device had {format_bytes(device_free)} free"
    leaks = [c for c in causes if c.pattern == "accumulating"]
    if leaks:
        kept = sum(c.bytes for c in leaks)
        suggestion = (f"the memory that grows from step to step (below) holds {format_bytes(kept)}"
                      + (f", more than the {format_bytes(short)} that had to be released: releasing it leaves room."
                         if kept >= short else
                         f", less than the {format_bytes(short)} that had to be released: release it, then hold "
                         "less at the lines above."))
    else:
        suggestion = (f"hold at least {format_bytes(short)} less; what each role would free is below "
                      "(largest first).")
    roles = ", ".join(f"{r.role.label} {format_bytes(r.bytes)}" for r in sorted(by_role, key=lambda r: -r.bytes))
    return [SnapshotFinding(
        "capacity", short,
        f"not fragmentation: the free pieces of reserved memory hold {format_bytes(frag.free_bytes)}, less than "
        f"the {format_bytes(request)} request, so the allocator {grow}, and {device}; no allocator setting makes room: at least {format_bytes(short)} had to be released. "
        f"{format_bytes(frag.allocated)} was allocated: {roles}; most by {holders}.",
        suggestion,
    )]


def _fragmentation_finding(frag: Fragmentation, segs: tuple[SegmentState, ...], pageable: int,
                           device_free: int) -> SnapshotFinding:
    request = frag.request or 0
    stream = frag.stream
    on_stream = frag.largest_free_on_stream or 0
    others = "" if frag.largest_free == on_stream else f" (on any stream: {format_bytes(frag.largest_free)})"
    message = (
        f"the {_size(request)} request did not fit although {format_bytes(frag.free_bytes)} of reserved memory "
        f"was free and the device had {format_bytes(device_free)} free: the free reserved memory is split "
        f"into {frag.free_pieces} pieces across {frag.segments} segment{'s' if frag.segments != 1 else ''}, the "
        f"largest on stream {stream} {format_bytes(on_stream)}{others}. A block must be contiguous inside one segment, and a segment "
        "goes back to CUDA only when it is entirely free."
    )
    # a mapping takes whole pages of the request's pool, from unmapped free pages or from the device
    page = SMALL_PAGE if request <= SMALL_REQUEST else LARGE_PAGE
    from_device = device_free // page * page
    usable = pageable + from_device
    need = -(-request // page) * page
    pages = f"the {format_bytes(need)} of {format_bytes(page)} pages the {format_bytes(request)} request takes"
    verdict = f"enough for {pages}" if usable >= need else f"{format_bytes(need - usable)} short of {pages}"
    expandable = (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts): segments then grow by "
        "mapping pages (2 MiB for blocks up to 1 MiB, 20 MiB above), and on an OOM the allocator unmaps the "
        "free pages of partly used segments and maps them where the request needs them; on this snapshot's "
        f"segments the free pieces hold {format_bytes(pageable)} in whole pages and the device's "
        f"{format_bytes(device_free)} free gives {format_bytes(from_device)} more: {format_bytes(usable)} to map, "
        f"{verdict} (an estimate: with the setting the layout differs)"
    )
    large = [g for g in segs if g.stream == stream and g.size > SMALL_PAGE]
    big = [g for g in large if g.size >= request]
    m = request // (1 << 20)
    splitting = [g for g in big if g.live_blocks]
    if not big:
        largest = max((g.size for g in large), default=0)
        split = (
            "max_split_size_mb would not help here: no segment of stream "
            f"{stream} is as large as the request (the largest is {format_bytes(largest)}), so there is no "
            "large block to keep whole"
        )
    elif m >= 1 and splitting:
        sizes = ", ".join(format_bytes(g.size) for g in splitting[:4])
        split = (
            f"or max_split_size_mb:{m}: {len(splitting)} segment{'s' if len(splitting) != 1 else ''} of at least "
            f"the request's size ({sizes}) {'are' if len(splitting) != 1 else 'is'} split by smaller live blocks "
            f"({sum(g.live_blocks for g in splitting)} of them, {format_bytes(sum(g.live_bytes for g in splitting))}); "
            f"blocks of {m} MiB or more are then never split for smaller requests, which keeps them whole for "
            "requests like this one (the smaller requests take segments of their own)"
        )
    else:
        split = ("max_split_size_mb would not help here: the segments as large as the request hold no live "
                 "block that splits them")
    return SnapshotFinding("fragmentation", frag.free_bytes, message, f"{expandable}; {split}.")


def _request_line(oom: object) -> str:
    frames = getattr(oom, "frames", ())
    return group_of(frames, "line") if frames else "the failing line"


def _size(n: int | None) -> str:
    """Binary units with the exact bytes in parentheses (under 1 KiB the bytes alone)."""
    if n is None:
        return "n/a"
    return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({n} bytes)"
