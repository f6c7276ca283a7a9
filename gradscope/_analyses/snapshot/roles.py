"""What each block of a snapshot was for, how its trace divides into passes and steps, and which
memory grows from one step to the next: the questions a diagnosis asks before it names a cause
(the public surface is :mod:`gradscope.snapshot`).

A snapshot has no autograd graph and no module names; what it has is every allocation's frames
and lifetime. From those alone (and the ``external_annotations`` some files carry) this module
tells, the way ``torch.profiler``'s memory categories name them:

- the **passes** of the trace: runs of allocations made in a forward, in backward (the autograd
  engine's C++ frames, or ``torch.autograd``'s Python ones) or in an optimizer's step
  (``torch.optim`` frames, or an ``Optimizer.step`` annotation);
- its **steps**: see NOTE [ steps of a trace ];
- each allocation's **role**: see NOTE [ roles from frames and lifetime ];
- **accumulating** memory: see NOTE [ a leak grows across steps ].

Example:
    >>> import gradscope as gs
    >>> from gradscope.snapshot import bytes_by_role, snapshot_data
    >>> fr = [{"filename": "/home/u/train.py", "line": 9, "name": "main"}]
    >>> trace = [{"action": "alloc", "addr": 0, "size": 4096, "stream": 0, "frames": fr}]
    >>> print(*bytes_by_role(snapshot_data(gs.load_snapshot({"segments": [], "device_traces": [trace]}))))
    activations: 4.0 KiB in 1 block
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import torch

from gradscope._analyses.snapshot import replay as _replay
from gradscope._analyses.snapshot.data import SnapshotData, _cols, _group_label, _live_mask
from gradscope._analyses.snapshot.frames import Frame, _check_group, _is_engine_frame
from gradscope._analyses.snapshot.queries import GroupTimeline, _stack_groups, timeline_of_groups
from gradscope._base.errors import GradscopeError
from gradscope._base.frames import is_folded_file, is_python_file, is_pytorch_file
from gradscope._model.recording import format_bytes

__all__ = [
    "Accumulation",
    "Role",
    "RoleBytes",
    "TracePass",
    "TraceSteps",
    "accumulating_lines",
    "allocation_role",
    "bytes_by_role",
    "memory_by_role",
    "role_notes",
    "trace_passes",
    "trace_steps",
]


# NOTE [ roles from frames and lifetime ]
# Each allocation gets one role, so that the roles of the blocks alive at any moment add up to the
# bytes allocated then:
# - before_trace: alive before the trace's first event (parameters, buffers, anything resident
#   when the history began); what made it is not in the trace. When the snapshot's block keeps
#   the frames that made it (history was on when it was made), they give it the role below
#   instead: parameters, gradients or optimizer state (made in a forward, it stays before_trace:
#   which forward, and whether it ended, is not in the trace);
# - parameters: made while building the model (a frame of an ``__init__``, of nn.Module's
#   ``to`` / ``cuda`` / ``_apply``, of ``load_state_dict`` / ``from_pretrained``, outside any
#   module call) and not freed within that pass;
# - optimizer_state: made in an optimizer's step (a ``torch/optim`` frame, or inside an
#   ``Optimizer.step#...`` annotation) and still alive when that step's pass ended;
# - gradients: made in backward (the engine's C++ frames: ``Engine::``, a node's
#   ``...Backward0::apply``, ``AccumulateGrad``; or ``torch.autograd.backward`` / ``grad``) and
#   alive when that backward ended;
# - activations: made in a forward (any other Python frames; inside a model call, see
#   is_model_call, or the code around it) and alive when that forward ended:
#   freed in the backward that followed, or still held (by a graph, or as an output) afterwards;
# - kept: made in a forward of one step and still alive when the next step ended (a list of
#   outputs, a cache): see NOTE [ a leak grows across steps ] for when that is a leak;
# - temporaries: freed within the pass that made them (and within its step; in a loop of forwards
#   only, within the model's call: what the model made and kept past its last allocation is held
#   by its output, an activation);
# - unknown: made in the trace with no frames, outside any pass (a file recorded without stacks).
# A pass ends where a pass of another kind begins (an annotated optimizer step where its
# annotation ends; a pass an OOM interrupts at the OOM: what the unwinding frees after it was
# alive when the pass ended, the forward's activations at a forward's OOM); an allocation without frames of its own (the engine thread's, when only
# Python stacks were recorded) takes the kind of the pass it falls in.
# What a file lacks is said in role_notes: no frames (roles from lifetime only), no trace
# (everything "before_trace"), no backward or optimizer in the trace.

# NOTE [ steps of a trace ]
# A step is one turn of the loop that repeats: "does memory grow from one step to the next" needs
# their ends. They come, first found first used, from:
# 1. annotations: each END of an ``Optimizer.step#...`` annotation (PyTorch's optimizers write
#    one per step), else each END of a ``record_function`` range of the user's that repeats
#    (``ProfilerStep#N`` counts as one name; torch.compile's ``(dynamo_timed)`` ranges do not);
# 2. passes: a step ends where a forward begins again after a backward or an optimizer step;
# 3. repetition, in a trace with no backward or optimizer pass (an evaluation loop): the stack
#    allocated least often, at least four times (three turns of a loop are too few to tell a loop
#    of steps from one that builds something), each turn of which (from one of its allocations
#    to the next; at most 64 turns looked at, evenly spread) is a step:
#    - it runs the model, when the trace runs one (an allocation inside a model call: a loop over
#      a batch's samples before the model is called is not a step);
#    - it spans code outside every model call: the common outer frames of what it allocates hold
#      no model call (a loop over the layers inside a model's forward is not a step; when a turn
#      allocates at one stack only, its own line is left out: the loop may be in any frame).
#    A model call is ``nn.Module``'s ``_call_impl`` or a ``forward`` (see is_model_call: a
#    model called as ``model.forward(x)`` records no ``_call_impl``). Each step ends just before
#    the stack allocates again.
# Without frames, annotations are the only source. The steps found, and from what, are said.

# NOTE [ a leak grows across steps ]
# Memory a step leaves behind for good is a leak only when it keeps growing: a stack's live bytes
# at the ends of the steps must rise at least twice (and in at least a third of the steps) within
# the last run where they never fall, ending above every earlier value. Memory that returns to
# the same level every step, a cache filled once, or a list cleared now and then is not a leak;
# optimizer state (kept by design) and memory made before the trace or while building the model
# are never counted. Gradients are: the parameters' come back at the same size each step, so only
# what backward keeps adding (graphs of create_graph=True passes kept alive) can grow. Long runs
# are read at most at 64 step ends (evenly spread, the last one included).


class Role(str, enum.Enum):
    """What a block of a snapshot was for (see NOTE [ roles from frames and lifetime ])."""

    BEFORE_TRACE = "before_trace"
    PARAMETERS = "parameters"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    KEPT = "kept"
    TEMPORARIES = "temporaries"
    UNKNOWN = "unknown"

    @property
    def label(self) -> str:
        """How the text names the role (``optimizer state``)."""
        return _LABELS[self]

    @property
    def how(self) -> str:
        """How the role was decided, in a few words."""
        return _HOW[self]


_LABELS = {
    Role.BEFORE_TRACE: "existed before the trace", Role.PARAMETERS: "parameters and model state",
    Role.OPTIMIZER_STATE: "optimizer state", Role.GRADIENTS: "gradients", Role.ACTIVATIONS: "activations",
    Role.KEPT: "kept across steps", Role.TEMPORARIES: "temporaries", Role.UNKNOWN: "role unknown",
}
_HOW = {
    Role.BEFORE_TRACE: "alive before the trace's first event: parameters, buffers, anything resident; the trace "
                       "does not say what made them",
    Role.PARAMETERS: "made while building the model (an __init__, Module.to/cuda, load_state_dict) and kept",
    Role.OPTIMIZER_STATE: "made in an optimizer's step (torch.optim frames or its Optimizer.step annotation) and "
                          "kept after it",
    Role.GRADIENTS: "made in backward (the autograd engine's frames) and kept after it",
    Role.ACTIVATIONS: "made in a forward and alive when it ended: freed by the backward after it, or still held",
    Role.KEPT: "made in one step and still alive after the next step ended",
    Role.TEMPORARIES: "freed within the forward, backward or optimizer step that made them",
    Role.UNKNOWN: "made in the trace without frames that say by what",
}
_ROLES = tuple(Role)
_CODE = {r: i for i, r in enumerate(_ROLES)}

# kinds of a stack, and of an allocation once the passes are known
_NONE, _FORWARD, _BACKWARD, _OPTIMIZER, _BUILD, _CPP = range(6)
_KIND_NAMES = {_FORWARD: "forward", _BACKWARD: "backward", _OPTIMIZER: "optimizer step"}
_MAX_STEP_ENDS = 64  # see NOTE [ a leak grows across steps ]
_CANDIDATES = 16  # stacks tried as the start of a repeated step (see NOTE [ steps of a trace ])
_MIN_REPEATS = 4  # a repeated stretch of code is a loop of steps when it runs at least this often

_BACKWARD_PY = {"backward", "grad"}  # torch.autograd's and Tensor's: the calls that run the engine
_BUILD_NAMES = {"__init__", "load_state_dict", "_load_from_state_dict", "from_pretrained", "reset_parameters",
                "to_empty"}
_MODULE_MOVE = {"to", "cuda", "_apply", "half", "bfloat16", "float", "type"}
_STEP_NUMBER = re.compile(r"#\d+$")
_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")


def is_model_call(frame: Frame) -> bool:
    """Whether a frame is a call into a model (see NOTE [ roles from frames and lifetime ]):
    ``nn.Module``'s ``_call_impl``, or any Python function named ``forward`` (a module's forward
    called directly, ``model.forward(x)``, records no ``_call_impl``; an autograd Function's)."""
    if not is_python_file(frame.filename):
        return False
    if frame.name == "forward":
        return True
    return frame.name in _MODULE_CALL and frame.filename.replace("\\", "/").endswith("/nn/modules/module.py")


@dataclass(frozen=True)
class RoleBytes:
    """The bytes of one role alive at one moment (see :func:`bytes_by_role`)."""

    role: Role
    bytes: int
    blocks: int

    def __str__(self) -> str:
        return f"{self.role.label}: {format_bytes(self.bytes)} in {self.blocks} block{'s' if self.blocks != 1 else ''}"


@dataclass(frozen=True)
class TracePass:
    """A run of the trace's allocations of one kind: ``"forward"`` (any Python code outside
    backward and the optimizer, model building included), ``"backward"`` or ``"optimizer step"``.
    ``start`` is the position of its first allocation, ``end`` the last position before the next
    pass begins (the trace's last event for the last pass); ``kept`` the bytes its allocations
    still held when it ended (a forward's activations, a backward's gradients, a step's state)."""

    kind: str
    start: int
    end: int
    allocations: int
    kept: int = 0


@dataclass(frozen=True)
class TraceSteps:
    """The steps found in a trace (see NOTE [ steps of a trace ]): ``ends`` the positions after
    which a step ended, in order; ``source`` ``"annotations"``, ``"passes"``, ``"repetition"``
    or ``""`` (none found); ``how`` one sentence saying so."""

    ends: tuple[int, ...]
    source: str
    how: str

    @property
    def count(self) -> int:
        """Steps that ended in the trace."""
        return len(self.ends)


@dataclass(frozen=True)
class Accumulation:
    """Memory that grows from step to step (see NOTE [ a leak grows across steps ]).

    ``key`` is the group (a stack, or a line); ``bytes`` / ``blocks`` what its allocations made in
    the trace held at ``at``, made between positions ``first_at`` and ``last_at``;
    ``at_step_ends`` what they held at the ends of the steps ``step_ends``, ``grew`` how many
    times that rose within the last run where it never fell. ``frames`` is the stack holding most
    of it; ``freed`` how many of the group's allocations were freed before ``at``.
    """

    key: str
    bytes: int
    blocks: int
    first_at: int
    last_at: int
    step_ends: tuple[int, ...]
    at_step_ends: tuple[int, ...]
    grew: int
    freed: int
    frames: tuple[Frame, ...]

    def __str__(self) -> str:
        return (
            f"{self.key}: {format_bytes(self.bytes)} in {self.blocks} block{'s' if self.blocks != 1 else ''}, "
            f"grew at {self.grew} of {len(self.step_ends) - 1} step ends "
            f"({format_bytes(self.at_step_ends[0])} → {format_bytes(self.at_step_ends[-1])})"
        )


# ----- stacks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stacks:
    kind: torch.Tensor  # per stack: _NONE .. _CPP
    python: torch.Tensor  # bool: has a Python frame
    in_module: torch.Tensor  # bool: has an nn.Module call frame (made inside a model's forward)
    entry: torch.Tensor  # frame index of the user's line that called into the model (-1: none)
    autocast: torch.Tensor  # bool: made by autocast's cast (at::autocast::cached_cast)
    module_call: torch.Tensor  # per frame: an nn.Module call frame


def _frame_flags(data: SnapshotData) -> dict[str, torch.Tensor]:
    n = len(data.frames)
    flags = {k: torch.zeros(n, dtype=torch.bool) for k in
             ("python", "user", "optim", "backward", "build", "module_call", "engine", "autocast")}
    for i, f in enumerate(data.frames):
        fn, name = f.filename, f.name
        if not is_python_file(fn):
            flags["engine"][i] = _is_engine_frame(name)
            flags["autocast"][i] = "at::autocast::cached_cast" in name  # a cast, not the op autocast wraps
            continue
        flags["python"][i] = True
        torch_own = is_pytorch_file(fn)
        flags["user"][i] = not is_folded_file(fn)
        path = fn.replace("\\", "/")
        if torch_own and "/optim/" in path:
            flags["optim"][i] = True
        if torch_own and name in _BACKWARD_PY and ("/autograd/" in path or path.endswith("/_tensor.py")):
            flags["backward"][i] = True
        module_py = path.endswith("/nn/modules/module.py")
        flags["module_call"][i] = is_model_call(f)
        flags["build"][i] = name in _BUILD_NAMES or (module_py and name in _MODULE_MOVE)
    return flags


def _stacks(data: SnapshotData) -> _Stacks:
    hit = data._cache.get("role_stacks")
    if hit is not None:
        return hit
    S = len(data.stacks)
    flags = _frame_flags(data)
    lengths = torch.tensor([len(s) for s in data.stacks], dtype=torch.int64)
    flat = torch.tensor([f for s in data.stacks for f in s], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(S), lengths)
    depth = torch.arange(int(flat.numel()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)

    def any_of(flag: str) -> torch.Tensor:
        return torch.zeros(S, dtype=torch.int64).index_add_(0, owner, flags[flag][flat].to(torch.int64)) > 0

    def outermost(mask: torch.Tensor) -> torch.Tensor:  # largest depth where mask, -1 without
        return torch.full((S,), -1, dtype=torch.int64).scatter_reduce_(
            0, owner, torch.where(mask, depth, -1), "amax")

    python, engine = any_of("python"), any_of("engine")
    outer_call = outermost(flags["module_call"][flat])
    outer_build = outermost(flags["build"][flat])
    kind = torch.full((S,), _NONE, dtype=torch.int64)
    kind[lengths > 0] = _CPP
    kind[python] = _FORWARD
    kind[(outer_build > outer_call) & python] = _BUILD  # building outside any module call
    kind[engine | any_of("backward")] = _BACKWARD
    kind[any_of("optim")] = _OPTIMIZER
    # the user's line that called into the model: the first user frame outside the outermost
    # module call (the stack's own user line when no module call is in it)
    outside = flags["user"][flat] & (depth > outer_call[owner])
    big = int(flat.numel()) + 1
    first = torch.full((S,), big, dtype=torch.int64).scatter_reduce_(
        0, owner, torch.where(outside, depth, big), "amin")
    starts = torch.cumsum(lengths, 0) - lengths
    entry = torch.full((S,), -1, dtype=torch.int64)
    has = first < big
    entry[has] = flat[(starts + first)[has]]
    out = _Stacks(kind=kind, python=python, in_module=outer_call >= 0, entry=entry, autocast=any_of("autocast"),
                  module_call=flags["module_call"])
    data._cache["role_stacks"] = out
    return out


# ----- passes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Structure:
    kind: torch.Tensor  # per allocation, after the passes (_NONE: no frames and no pass)
    pass_of: torch.Tensor  # per allocation: its pass (-1 none)
    passes: tuple[TracePass, ...]
    steps: TraceSteps
    role: torch.Tensor  # per allocation: index into _ROLES
    has_frames: bool


def _optimizer_windows(data: SnapshotData) -> list[tuple[int, int]]:
    """(START, END) positions of every Optimizer.step annotation."""
    out, open_at = [], None
    for a in data.annotations:
        if not a.name.startswith("Optimizer.step#"):
            continue
        if a.stage == "START":
            open_at = a.at
        elif open_at is not None:
            out.append((open_at, a.at))
            open_at = None
    return out


def _passes(data: SnapshotData, st: _Stacks) -> tuple[torch.Tensor, torch.Tensor, list[TracePass]]:
    t = _cols(data)
    n = data.allocations
    at = t["alloc_at"]
    kind = st.kind[t["alloc_stack"]].clone() if n else torch.zeros(0, dtype=torch.int64)
    kind[kind == _BUILD] = _FORWARD  # model building is code outside backward and the optimizer
    windows = _optimizer_windows(data)
    window = torch.full((n,), -1, dtype=torch.int64)  # the Optimizer.step annotation an allocation is in
    for j, (lo, hi) in enumerate(windows):
        inside = (at > lo) & (at <= hi) & (kind != _BACKWARD)
        kind[inside] = _OPTIMIZER
        window[inside] = j
    classified = (at >= 0) & (kind >= _FORWARD) & (kind <= _OPTIMIZER)
    idx = torch.nonzero(classified).flatten()
    order = idx[torch.argsort(at[idx], stable=True)]
    ks, ps, ws = kind[order], at[order], window[order]
    passes: list[TracePass] = []
    pass_of = torch.full((n,), -1, dtype=torch.int64)
    if ks.numel():
        change = torch.ones(int(ks.numel()), dtype=torch.bool)
        change[1:] = (ks[1:] != ks[:-1]) | (ws[1:] != ws[:-1])  # each annotated step is a pass of its own
        starts = torch.nonzero(change).flatten()
        counts = torch.diff(torch.cat([starts, torch.tensor([int(ks.numel())])]))
        start_pos = ps[starts]
        ends = torch.cat([start_pos[1:] - 1, torch.tensor([max(data.events - 1, 0)])])
        if windows:  # an annotated optimizer step ends where its annotation does
            hi_of = torch.tensor([hi for _, hi in windows], dtype=torch.int64)
            w0 = ws[starts]
            ends = torch.where(w0 >= 0, torch.minimum(ends, hi_of[torch.clamp(w0, min=0)]), ends)
        for o in sorted({x.at for x in data.ooms}):  # an OOM ends the pass it interrupts
            ends = torch.where((start_pos <= o) & (ends > o), o, ends)
        # every allocation made in the trace falls in the pass whose extent holds it
        made = at >= 0
        p = torch.searchsorted(start_pos, at, right=True) - 1
        pass_of = torch.where(made & (p >= 0), p, -1)
        pass_of = torch.where(at > ends[torch.clamp(pass_of, min=0)], -1, pass_of)
        free = t["alloc_free_at"]
        mine = pass_of >= 0
        end_of = ends[torch.clamp(pass_of, min=0)]
        left = mine & ((free < 0) | (free > end_of))
        kept = torch.zeros(int(starts.numel()), dtype=torch.int64).index_add_(
            0, pass_of[left], t["alloc_size"][left])
        passes = [TracePass(_KIND_NAMES[int(k)], int(s), int(e), int(c), int(b))
                  for k, s, e, c, b in zip(ks[starts].tolist(), start_pos.tolist(), ends.tolist(), counts.tolist(),
                                           kept.tolist(), strict=True)]
        # no frames of its own (or C++ frames of another thread): the kind of its pass
        bare = made & ((kind == _NONE) | (kind == _CPP)) & (pass_of >= 0)
        if bare.any() and bool((st.python).any()):
            kind[bare] = ks[starts][pass_of[bare]]
    kind[(kind == _CPP)] = _NONE
    return kind, pass_of, passes


# ----- steps -------------------------------------------------------------------------------------
def _steps_from_annotations(data: SnapshotData) -> TraceSteps | None:
    ends: dict[str, list[int]] = {}
    for a in data.annotations:
        if a.stage == "END":
            ends.setdefault(_STEP_NUMBER.sub("", a.name), []).append(a.at)
    opt = [k for k in ends if k.startswith("Optimizer.step#")]
    if opt:
        name = opt[0]
    else:
        users = [k for k, v in ends.items() if len(v) >= 2 and not k.endswith("(dynamo_timed)")
                 and not k.startswith("Optimizer.")]
        if not users:
            return None
        name = max(users, key=lambda k: len(ends[k]))
    found = tuple(sorted(p for p in ends[name] if p >= 0))
    if not found:
        return None
    what = "Optimizer.step" if name.startswith("Optimizer.step#") else repr(name)
    return TraceSteps(found, "annotations", f"{len(found)} step{'s' if len(found) != 1 else ''} from the trace's "
                                            f"{what} annotations (a step ends where one ends)")


def _steps_from_passes(passes: list[TracePass]) -> TraceSteps | None:
    ends = tuple(passes[i].start - 1 for i in range(1, len(passes))
                 if passes[i].kind == "forward" and passes[i - 1].kind != "forward")
    if not ends:
        return None
    return TraceSteps(ends, "passes", f"{len(ends)} step{'s' if len(ends) != 1 else ''} from the frames: a step "
                                      "ends where a forward begins again after a backward or an optimizer step")


def _steps_from_repetition(data: SnapshotData, st: _Stacks, kind: torch.Tensor) -> TraceSteps | None:
    t = _cols(data)
    at, stack = t["alloc_at"], t["alloc_stack"]
    ok = (at >= 0) & (kind == _FORWARD) & (st.kind[stack] == _FORWARD)  # not the model's building
    if not bool(ok.any()):
        return None
    order = torch.argsort(at[ok], stable=True)
    s_ok, a_ok = stack[ok][order], at[ok][order]  # in trace order
    S = len(data.stacks)
    counts = torch.bincount(s_ok, minlength=S)
    first = torch.full((S,), data.events, dtype=torch.int64).scatter_reduce_(0, s_ok, a_ok, "amin")
    cand = torch.nonzero(counts >= _MIN_REPEATS).flatten().tolist()
    cand.sort(key=lambda s: (int(counts[s]), int(first[s])))
    calls_model = bool(st.in_module[s_ok].any())  # the trace runs a model: each step must
    py_frames: dict[int, tuple[int, ...]] = {}

    def outer_python(sid: int) -> tuple[int, ...]:
        hit = py_frames.get(sid)
        if hit is None:
            hit = py_frames[sid] = tuple(f for f in reversed(data.stacks[sid])
                                         if is_python_file(data.frames[f].filename))
        return hit

    def a_step(lo: int, hi: int) -> bool:  # allocations at positions [lo, hi) are one turn of a loop of steps
        i, j = (int(x) for x in torch.searchsorted(a_ok, torch.tensor([lo, hi])))
        inside = torch.unique(s_ok[i:j])
        if calls_model and not bool(st.in_module[inside].any()):
            return False  # a loop that never calls the model (over a batch's samples): not a step
        ids = inside.tolist()
        common = outer_python(ids[0])
        for other in ids[1:]:
            o = outer_python(other)
            k = 0
            while k < min(len(common), len(o)) and common[k] == o[k]:
                k += 1
            common = common[:k]
            if not common:
                break
        if len(ids) == 1:
            common = common[:-1]  # one line allocating again: its loop may be in any frame outside it
        return not any(bool(st.module_call[f]) for f in common)  # else a loop inside a model (its layers)

    for sid in cand[:_CANDIDATES]:
        occ = a_ok[s_ok == sid].tolist()
        turns = len(occ) - 1
        pick = range(turns) if turns <= _MAX_STEP_ENDS else \
            sorted(set(torch.linspace(0, turns - 1, _MAX_STEP_ENDS).round().to(torch.int64).tolist()))
        if not all(a_step(occ[k], occ[k + 1]) for k in pick):
            continue
        ends = tuple(p - 1 for p in occ if p >= 1)
        if len(ends) < 2:
            continue
        return TraceSteps(ends, "repetition", f"{len(ends)} steps from a stretch of code that repeats outside the "
                                              f"model: each starts where {_group_label(data, sid, 'stack')} allocates")
    return None


# ----- roles -------------------------------------------------------------------------------------
def _structure(data: SnapshotData) -> _Structure:
    hit = data._cache.get("structure")
    if hit is not None:
        return hit
    with _replay.one_thread():
        st = _stacks(data)
        kind, pass_of, passes = _passes(data, st)
        has_backward = any(p.kind != "forward" for p in passes)
        steps = (_steps_from_annotations(data) or _steps_from_passes(passes)
                 or (None if has_backward else _steps_from_repetition(data, st, kind))
                 or TraceSteps((), "", _no_steps(data, passes)))
        role = _roles(data, st, kind, pass_of, passes, steps)
    out = _Structure(kind=kind, pass_of=pass_of, passes=tuple(passes), steps=steps, role=role,
                     has_frames=bool(st.python.any()))
    data._cache["structure"] = out
    return out


def _no_steps(data: SnapshotData, passes: list[TracePass]) -> str:
    if not any(a >= 0 for a in data.alloc_at):
        return "no steps: the snapshot has no allocation history"
    if not passes:
        return "no steps found: no frames and no step annotations to tell them"
    kinds = sorted({p.kind for p in passes})
    if kinds == ["forward"]:
        return ("no steps found: the trace has no backward and no optimizer step, and no stretch of code "
                "repeats outside the model")
    return f"no steps found: the trace holds one {' and one '.join(kinds)} pass each, not a loop of them"


def _roles(data: SnapshotData, st: _Stacks, kind: torch.Tensor, pass_of: torch.Tensor,
           passes: list[TracePass], steps: TraceSteps) -> torch.Tensor:
    t = _cols(data)
    n = data.allocations
    at, free = t["alloc_at"], t["alloc_free_at"]
    last = max(data.events - 1, 0)
    role = torch.full((n,), _CODE[Role.UNKNOWN], dtype=torch.int64)
    made = at >= 0
    role[~made] = _CODE[Role.BEFORE_TRACE]
    # alive before the trace, with the frames that made it (the snapshot's blocks keep them): an
    # optimizer's state, a backward's gradients, the model's building say what it is
    pre_kind = st.kind[t["alloc_stack"]]
    for k, r in ((_BUILD, Role.PARAMETERS), (_BACKWARD, Role.GRADIENTS), (_OPTIMIZER, Role.OPTIMIZER_STATE)):
        role[~made & (pre_kind == k)] = _CODE[r]
    ends_t = torch.tensor(steps.ends, dtype=torch.int64)
    step = torch.searchsorted(ends_t, at, right=False)  # the step an allocation is made in
    m = len(steps.ends)
    limit = torch.full_like(at, last)
    if m:  # within its step
        limit = torch.where(step < m, ends_t[torch.clamp(step, max=m - 1)], limit)
    if passes:  # and within its pass
        pass_end = torch.tensor([p.end for p in passes], dtype=torch.int64)
        limit = torch.where(pass_of >= 0, torch.minimum(limit, pass_end[torch.clamp(pass_of, min=0)]), limit)
    if m and not any(p.kind != "forward" for p in passes):
        # steps of forwards only (an evaluation loop): a step's forward ends where its model call
        # returns, at its last allocation inside an nn.Module call; what the model made and kept
        # past that point is held by its output (and its graph), not a temporary
        inside = made & st.in_module[t["alloc_stack"]] & (step < m)
        model_end = torch.full((m,), -1, dtype=torch.int64).scatter_reduce_(0, step[inside], at[inside], "amax")
        ends_model = model_end[torch.clamp(step, max=m - 1)]
        limit = torch.where((step < m) & (ends_model >= at), torch.minimum(limit, ends_model), limit)
    freed = free >= 0
    temporary = made & (kind != _NONE) & freed & (free <= limit)
    build = st.kind[t["alloc_stack"]] == _BUILD
    alive_after = made & (kind != _NONE) & ~temporary
    role[alive_after & (kind == _FORWARD)] = _CODE[Role.ACTIVATIONS]
    if m >= 2:
        nxt = torch.clamp(step + 1, max=m - 1)
        kept = (step + 1 < m) & (~freed | (free > ends_t[nxt]))
        role[alive_after & (kind == _FORWARD) & kept] = _CODE[Role.KEPT]
    role[alive_after & build] = _CODE[Role.PARAMETERS]
    role[alive_after & (kind == _BACKWARD)] = _CODE[Role.GRADIENTS]
    role[alive_after & (kind == _OPTIMIZER)] = _CODE[Role.OPTIMIZER_STATE]
    role[temporary] = _CODE[Role.TEMPORARIES]
    return role


# ----- public questions --------------------------------------------------------------------------
@_replay.on_one_thread
def trace_passes(data: SnapshotData) -> tuple[TracePass, ...]:
    """The trace's passes in order (see :class:`TracePass`); empty without frames."""
    return _structure(data).passes


@_replay.on_one_thread
def trace_steps(data: SnapshotData) -> TraceSteps:
    """The steps found in the trace and from what (see NOTE [ steps of a trace ])."""
    return _structure(data).steps


def allocation_role(data: SnapshotData, i: int) -> Role:
    """The role of allocation ``i`` (a row of the ``alloc_*`` columns)."""
    if not 0 <= i < data.allocations:
        raise GradscopeError(f"gradscope: no allocation {i} (this snapshot has {data.allocations}).")
    return _ROLES[int(_structure(data).role[i])]


@_replay.on_one_thread
def bytes_by_role(data: SnapshotData, at: int | None = None) -> tuple[RoleBytes, ...]:
    """Bytes alive at ``at`` (default: the OOM, else the peak) by role, in the order of
    :class:`Role`, roles holding nothing left out; they add up to the bytes allocated then."""
    p = data._at(at)
    t = _cols(data)
    role = _structure(data).role
    live = _live_mask(t, p)
    nbytes = torch.zeros(len(_ROLES), dtype=torch.int64).index_add_(0, role[live], t["alloc_size"][live])
    blocks = torch.bincount(role[live], minlength=len(_ROLES))
    return tuple(RoleBytes(r, b, c) for r, b, c in zip(_ROLES, nbytes.tolist(), blocks.tolist(), strict=True) if c)


@_replay.on_one_thread
def memory_by_role(data: SnapshotData, points: int = 1000) -> GroupTimeline:
    """Allocated bytes over the trace by role, for a stacked chart (the samples of
    :func:`~gradscope.snapshot.memory_by_group`); every role that ever held memory gets a row, in
    the order of :class:`Role`, named by its label."""
    if points < 2:
        raise GradscopeError("gradscope: memory_by_role needs points >= 2.")
    role = _structure(data).role
    t = _cols(data)
    held = torch.zeros(len(_ROLES), dtype=torch.int64).index_add_(0, role, t["alloc_size"])
    names = [r.label for r in _ROLES]
    chosen = [names[i] for i in range(len(_ROLES)) if int(held[i]) > 0]
    return timeline_of_groups(data, "role", role, names, chosen, points)


def role_notes(data: SnapshotData) -> tuple[str, ...]:
    """What the roles and steps rest on, and what this file lacks to tell more."""
    s = _structure(data)
    made = sum(1 for a in data.alloc_at if a >= 0)
    out = []
    if data.allocations and not made:
        out.append("roles: the snapshot has no allocation history, so every block 'existed before the trace', "
                   "unless its own frames say it was made while building the model (parameters), in backward "
                   "(gradients) or in an optimizer's step (optimizer state); its lines come from those frames.")
        return tuple(out)
    if not s.has_frames:
        out.append("roles: the trace has no Python frames (record with torch.cuda.memory._record_memory_history("
                   "stacks='all')); without them forward, backward and optimizer cannot be told apart, so blocks made "
                   "in the trace have no role beyond their lifetime.")
    elif s.passes and not any(p.kind == "backward" for p in s.passes):
        out.append("roles: no backward in the trace, so nothing is a gradient; what a forward left alive is "
                   "'activations' (or 'kept across steps').")
    return tuple(out)


# ----- accumulating memory ------------------------------------------------------------------------
_COUNTED = torch.tensor([_CODE[r] for r in (Role.ACTIVATIONS, Role.KEPT, Role.GRADIENTS, Role.TEMPORARIES,
                                            Role.UNKNOWN)])


@_replay.on_one_thread
def accumulating_lines(data: SnapshotData, at: int | None = None, group: str = "stack") -> tuple[Accumulation, ...]:
    """Memory that grows from step to step (a list that keeps outputs, and so their graphs; a
    cache that only grows), largest first, by frame group (``"stack"``: one caller each, or
    ``"line"``, ``"function"``, ``"file"``). Empty when fewer than three step ends are found
    before ``at`` (see NOTE [ steps of a trace ] and NOTE [ a leak grows across steps ])."""
    _check_group(group)
    p = data._at(at)
    s = _structure(data)
    ends_all = [e for e in s.steps.ends if e <= p]
    if len(ends_all) < 3:
        return ()
    if len(ends_all) > _MAX_STEP_ENDS:
        pick = torch.linspace(0, len(ends_all) - 1, _MAX_STEP_ENDS).round().to(torch.int64).tolist()
        ends_all = [ends_all[i] for i in sorted(set(pick))]
    ends = torch.tensor(ends_all, dtype=torch.int64)
    m = int(ends.numel())
    t = _cols(data)
    alloc_at, free = t["alloc_at"], t["alloc_free_at"]
    counted = torch.isin(s.role, _COUNTED) & (alloc_at >= 0) & (alloc_at <= p)
    k0 = torch.searchsorted(ends, alloc_at, right=False)
    k1 = torch.where(free < 0, m, torch.searchsorted(ends, free, right=False))
    across = counted & (k1 > k0)
    if not bool(across.any()):
        return ()
    of_stack, names, _ = _stack_groups(data, group)
    g_all = of_stack[t["alloc_stack"]]
    groups, local = torch.unique(g_all[across], return_inverse=True)
    G = int(groups.numel())
    diff = torch.zeros(G, m + 1, dtype=torch.int64)
    size = t["alloc_size"][across]
    diff.index_put_((local, k0[across]), size, accumulate=True)
    diff.index_put_((local, k1[across]), -size, accumulate=True)
    L = torch.cumsum(diff, 1)[:, :m]
    step = L[:, 1:] - L[:, :-1]
    k = torch.arange(m - 1)
    last_fall = torch.where(step < 0, k, -1).max(1).values  # the tail starts after it
    in_tail = k[None, :] > last_fall[:, None]
    grew = ((step > 0) & in_tail).sum(1)
    before = torch.where(torch.arange(m)[None, :] <= last_fall[:, None], L, -1).max(1).values
    need = max(2, math.ceil((m - 1) / 3))
    leak = (grew >= need) & (L[:, -1] > before) & (L[:, -1] > L[:, 0])
    out = []
    live = _live_mask(t, p) & counted
    for j in torch.nonzero(leak).flatten().tolist():
        g = int(groups[j])
        mine = torch.nonzero(live & (g_all == g)).flatten()
        if not mine.numel():
            continue
        sizes = t["alloc_size"][mine]
        stacks_ = t["alloc_stack"][mine]
        uniq, inv = torch.unique(stacks_, return_inverse=True)
        per = torch.zeros(int(uniq.numel()), dtype=torch.int64).index_add_(0, inv, sizes)
        best = int(uniq[int(torch.argmax(per))])
        freed = int((counted & (g_all == g) & (free >= 0) & (free <= p)).sum())
        out.append(Accumulation(
            key=names[g], bytes=int(sizes.sum()), blocks=int(mine.numel()),
            first_at=int(alloc_at[mine].min()), last_at=int(alloc_at[mine].max()),
            step_ends=tuple(ends_all), at_step_ends=tuple(L[j].tolist()), grew=int(grew[j]), freed=freed,
            frames=data.stack_frames(best),
        ))
    out.sort(key=lambda a: (-a.bytes, a.key))
    return tuple(out)


# ----- for the diagnosis ---------------------------------------------------------------------------
def entry_frame(data: SnapshotData, stack: int) -> Frame | None:
    """The user's line through which a stack entered the model: the first user frame outside its
    outermost ``nn.Module`` call (its own user line when it has no module call)."""
    f = int(_stacks(data).entry[stack])
    return data.frames[f] if f >= 0 else None


# NOTE [ a forward that kept its graph ]
# A forward run with grad enabled keeps, for its backward, most of what it makes: the inputs of
# every matmul, norm and nonlinearity, layer after layer, stay alive when it returns. Under
# torch.no_grad() (an evaluation loop, zeroth-order training, a benchmark's forward) it keeps
# only its output, and the allocations around it. So a forward (a run of allocations made inside
# one model call, from one entry line, with nothing made outside the model in between; without
# model calls, everything made after the last backward) is said to have kept a graph only when,
# besides one output, at least a tenth of its allocations are still alive at the moment looked
# at: measured on real files, forwards with grad enabled keep 21-48% of their allocations, those
# under no_grad 0.1-0.9%. One cannot tell a kept output from a kept graph by a single block.
_KEPT_SHARE = 10  # a forward kept its graph when (alive - 1) * _KEPT_SHARE >= its allocations


def _kept_a_graph(data: SnapshotData, st: _Stacks, alive: torch.Tensor, after: int, at: int) -> torch.Tensor:
    """Per allocation: made by a forward that kept its graph (NOTE [ a forward that kept its graph ])."""
    t = _cols(data)
    made, stack = t["alloc_at"], t["alloc_stack"]
    sel = torch.nonzero((made > after) & (made <= at)).flatten()
    out = torch.zeros(data.allocations, dtype=torch.bool)
    if not sel.numel():
        return out
    sel = sel[torch.argsort(made[sel], stable=True)]
    inside = st.in_module[stack[sel]]
    if bool(inside.any()):
        label = torch.where(inside, st.entry[stack[sel]], -2)
    else:
        label = torch.zeros(int(sel.numel()), dtype=torch.int64)
    run = torch.cumsum(torch.cat([torch.ones(1, dtype=torch.int64), (label[1:] != label[:-1]).to(torch.int64)]), 0) - 1
    R = int(run[-1]) + 1
    counted = label != -2
    n = torch.zeros(R, dtype=torch.int64).index_add_(0, run, counted.to(torch.int64))
    k = torch.zeros(R, dtype=torch.int64).index_add_(0, run, (alive[sel] & counted).to(torch.int64))
    ok = (k >= 2) & ((k - 1) * _KEPT_SHARE >= n)
    out[sel] = ok[run] & counted
    return out


@dataclass(frozen=True)
class UnusedGraph:
    """Activations alive at a moment that no backward in the trace came after: what their forward
    keeps for a backward that never ran. ``autocast`` is the part autocast's casts made."""

    bytes: int
    blocks: int
    autocast: int
    entry: Frame | None
    passes: int


@_replay.on_one_thread
def unused_graph(data: SnapshotData, at: int) -> UnusedGraph | None:
    """The activations alive at ``at`` made after the trace's last backward began, inside a model's
    call when any were, by forwards that kept a graph (see NOTE [ a forward that kept its graph ]);
    None when there are none, or when the trace ends in an OOM (the backward may never have had
    its turn, also when another device of the snapshot ran out of memory)."""
    if data.oom is not None or data.ooms_elsewhere:
        return None
    s = _structure(data)
    last_backward = max((p.start for p in s.passes if p.kind == "backward"), default=-1)
    t = _cols(data)
    mask = _live_mask(t, at) & (s.role == _CODE[Role.ACTIVATIONS]) & (t["alloc_at"] > last_backward)
    st = _stacks(data)
    in_model = mask & st.in_module[t["alloc_stack"]]
    if bool(in_model.any()):  # what a model made is what its graph saves; the inputs stay either way
        mask = in_model
    mask &= _kept_a_graph(data, st, mask, last_backward, at)
    idx = torch.nonzero(mask).flatten()
    if not idx.numel():
        return None
    sizes, stacks_ = t["alloc_size"][idx], t["alloc_stack"][idx]
    entries = st.entry[stacks_]
    known = entries >= 0
    entry = None
    if bool(known.any()):
        uniq, inv = torch.unique(entries[known], return_inverse=True)
        per = torch.zeros(int(uniq.numel()), dtype=torch.int64).index_add_(0, inv, sizes[known])
        entry = data.frames[int(uniq[int(torch.argmax(per))])]
    forwards = len({int(p) for p in s.pass_of[idx].tolist() if p >= 0})
    return UnusedGraph(bytes=int(sizes.sum()), blocks=int(idx.numel()),
                       autocast=int(sizes[st.autocast[stacks_]].sum()), entry=entry, passes=forwards)
