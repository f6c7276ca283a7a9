"""The raw trace of one ``gs.record`` block: plain rows that the hooks append, nothing else.

Capture is dumb and fast (see NOTE [ capture apart from analysis ]); every meaning (which node
saved what, modules, kinds, orders, steps, timeline, peak, held tensors) is given later by the
named passes of :mod:`gradscope._passes`, which read a :class:`Trace` and nothing else, so each of
them can be tested on a trace written by hand.

NOTE [ capture apart from analysis ]: a small op costs PyTorch a few microseconds; a Python hook
that looks anything up costs as much again. So a hook appends one tuple of numbers it already has
(the sequence counter, a storage's address, a time) and returns; node identity, naming and every
cross-reference are resolved once, after the block (on the first look at the recording: see NOTE
[ analysis on first look ] in :mod:`gradscope._capture.record`), in passes that touch each row once.

Row layouts (tuples, fields by position; the constants below name them):

- ``saves``: one per tensor our pack hook packed: ``(seq, skey, ptr, nbytes, shape, dtype,
  device, t_ns, leafish)``. ``seq`` is the autograd sequence counter minus one at pack time (the
  saving node's number, see NOTE [ which node saved a tensor ] in :mod:`gradscope._capture.record`),
  ``skey`` the storage's key (:func:`gradscope._base.compat.storage_key`), ``ptr`` its data address,
  ``nbytes`` the whole storage's bytes, ``leafish`` whether the tensor had no ``grad_fn``.
- ``nodes``: one per autograd node found by a walk: ``(key, seq, name, leaf, leaf_shape,
  custom)``; ``key`` is the sequence number, or ``("acc", id(leaf tensor))`` for
  ``AccumulateGrad`` (see NOTE [ node identity ] in :mod:`gradscope._capture.walk`); ``leaf`` is
  ``(root, path in root)`` for a parameter of a root module, ``"input"`` for other leaves, None
  for other nodes.
- ``edges``: ``(src, dst)`` node indices, ``src`` being one of ``dst``'s ``next_functions``;
  ``edge_keys``/``edge_dst``: the same as the walk met them (source by key, resolved later).
- ``gradient_keys``: ``(backward, skey, ptr, t_ns)`` for each gradient a pass produced (the
  ``.grad`` it accumulated into, or a result of ``autograd.grad``), read when the pass ended.
- ``calls``: module calls, ``[root, rel, seq0, seq1, t0_ns, t1_ns, index, class name]`` (a
  list: the exit fills ``seq1``/``t1``); ``root`` indexes ``roots``.
- ``backwards``: :class:`BackwardRow` per call into the autograd engine from the block's thread
  (also a call that raised: its error, and the events up to the failure).
- ``events``: step events in engine order, ``(kind, ident, t_ns, value)``: see ``EV_*``.
- ``optimizer_steps``: ``[name, t0_ns, t1_ns, seq0, seq1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from gradscope._base.errors import BudgetRefusal
from gradscope._base.memory_kind import MemoryKind

__all__ = ["BackwardRow", "MemoryTrace", "Trace"]

# saves
S_SEQ, S_SKEY, S_PTR, S_BYTES, S_SHAPE, S_DTYPE, S_DEVICE, S_T, S_LEAFISH = range(9)
# nodes
N_KEY, N_SEQ, N_NAME, N_LEAF, N_LEAF_SHAPE, N_CUSTOM = range(6)
# module calls
C_ROOT, C_REL, C_SEQ0, C_SEQ1, C_T0, C_T1 = range(6)

# Trace.marks: the end of one iteration of a loop (see NOTE [ iterations ] in gradscope._passes.iterations):
# the time, and the saves, backward calls and optimizer steps made by then
M_T, M_SAVES, M_BACKWARDS, M_OPT = range(4)

# Step events: (kind, ident, t_ns, value)
EV_UNPACK = 0  # a node unpacked one of our saves: ident = save index; value unused
EV_PRE = 1  # a node's pre hook: ident = node index; value = sequence counter then
EV_POST = 2  # a node's post hook: ident = node index; value = live bytes (online sources)
EV_FREED = 3  # a saved storage was found freed at a step boundary: ident = save index; value: None, or (found at
#   the pass's end) the save whose node's step freed it (see NOTE [ frees checked once a pass ] in record)
EV_LIVE = 4  # live bytes read at a step start (online sources): ident = node index


@dataclass
class BackwardRow:
    """One call into the autograd engine (``backward`` or ``autograd.grad``) from the block."""

    api: str  # "backward" or "autograd.grad"
    create_graph: bool
    retain_graph: bool
    roots: list[int]  # node indices of the outputs differentiated
    inputs: list[int]  # node indices named by ``inputs=`` (leaves' AccumulateGrad, or nodes)
    seq0: int  # sequence counter when the engine started and ended
    seq1: int = -1
    t0_ns: int = 0
    t1_ns: int = 0
    ev0: int = 0  # first and one-past-last index into Trace.events
    ev1: int = 0
    observed: bool = True  # False: run unobserved (reentrant, inside torch.func)
    nodes_known: int | None = None  # nodes walked when it started: every node it can reach is among them
    # the exception the call raised ("TypeName: message"; None: it returned), and whether it was an
    # out-of-memory (torch.OutOfMemoryError, gs.MemoryBudgetExceeded among them); see NOTE [ a
    # backward that raised ] in gradscope._passes.steps
    error: str | None = None
    oom: bool = False


@dataclass
class MemoryTrace:
    """What a memory source hands over when it stops (see :mod:`gradscope.memory`)."""

    source: MemoryKind = MemoryKind.OFF  # the kind of source that measured (a kind's name is read as the kind)
    device: str = "cpu"
    online: bool = False
    key_kind: str = "none"  # what AllocEvent.key is: "address", "storage" or "none"
    marks_calls: bool = True  # events carry the module call they happened in
    events: list[Any] = field(default_factory=list)  # AllocEvent rows, in order
    scopes: list[Any] = field(default_factory=list)  # EvalScope rows (profiler source)
    baseline: int | None = None  # allocated before the block, when the source knows it
    peak: int | None = None  # the allocator's own peak, when the source has one
    reserved_peak: int | None = None
    total: int | None = None
    failures: list[str] = field(default_factory=list)
    # collectives seen by the profiler source in a distributed job: (op, t0_ns, t1_ns, bytes,
    # kind) rows (see NOTE [ collectives in a recording ] in gradscope._capture.memory.profiler)
    collectives: list[tuple[str, int, int, int, str]] = field(default_factory=list)
    # events recorded when the source refused an allocation (a budget); what came after is
    # the exception unwinding (see NOTE [ what is live at the failing moment ] in gradscope._model.held_at_peak)
    failed_at: int | None = None
    refused: BudgetRefusal | None = None  # the first allocation a budget refused (NOTE [ one refusal ] in gradscope._base.errors)
    # the tracker saw forward-mode AD's zero tangents of tensors without a tangent (PyTorch then
    # uses efficient zero tensors; without a dispatch mode it materializes them: see tracker_note)
    zero_tangents: bool = False
    # a source whose events are read after the block (the profiler's): fills the rows above when
    # the analysis starts (see NOTE [ analysis on first look ] in gradscope._capture.record)
    pending: Callable[[MemoryTrace], None] | None = None

    def __post_init__(self) -> None:
        self.source = MemoryKind.of(self.source)

    def resolve(self) -> MemoryTrace:
        """Fill the rows a source left to be read later; returns self."""
        read, self.pending = self.pending, None
        if read is not None:
            read(self)
        return self


@dataclass
class Trace:
    """Everything the hooks of one block appended (see the module docstring for row layouts)."""

    tid: int = 0
    memory: MemoryKind = MemoryKind.OFF  # the block's kind of memory source (a kind's name is read as the kind)
    label: str = ""
    t0_ns: int = 0
    t1_ns: int = 0
    seq0: int = 0
    seq1: int = 0
    step: dict[str, Any] | None = None  # the block's source (see gradscope._base.source)
    saves: list[tuple[Any, ...]] = field(default_factory=list)
    # by save index: the user's line it was packed at (an index into line_table.rows, -1: none);
    # empty when lines are not recorded (see NOTE [ where lines come from ] in gradscope._model.lines)
    save_lines: list[int] = field(default_factory=list)
    # by save index: its storage's identity in the block, the index of the storage's first save (see
    # NOTE [ a storage's identity in a block ] in gradscope._capture.saves); empty: by ``skey``
    save_storage: list[int] = field(default_factory=list)
    line_table: Any = None  # gradscope._model.lines.LineTable, or None
    save_attr: dict[int, str] = field(default_factory=dict)  # save index -> attribute
    seq_attr: dict[int, str] = field(default_factory=dict)  # node seq -> its one attribute
    # node seq -> the attributes of its saves in pack order (see NOTE [ pack order ] in record)
    seq_order: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # a number without a node -> (the node whose save was made under it, attribute): see NOTE [ saves
    # packed under another number ] in record
    seq_moves: dict[int, tuple[int, str]] = field(default_factory=dict)
    nodes: list[tuple[Any, ...]] = field(default_factory=list)
    node_index: dict[Hashable, int] = field(default_factory=dict)
    edges: dict[tuple[int, int], None] = field(default_factory=dict)
    # edges as the walk met them, resolved by the graph pass: the source's key (a sequence number;
    # ``-1 - id`` for an AccumulateGrad resolved when its walk ended; None: unknown) and the
    # destination's id
    edge_keys: list[Any] = field(default_factory=list)
    edge_dst: list[int] = field(default_factory=list)
    gradient_keys: list[tuple[int, int, int, int]] = field(default_factory=list)
    roots: list[tuple[str, str | None]] = field(default_factory=list)  # (class, given name)
    root_names: dict[int, str] = field(default_factory=dict)  # root -> user's variable name
    module_paths: list[dict[int, str]] = field(default_factory=list)  # per root: id -> rel path
    param_keys: dict[int, tuple[int, str, str]] = field(default_factory=dict)  # skey -> (root, rel, kind)
    baseline_storages: dict[int, int] = field(default_factory=dict)  # skey -> bytes
    calls: list[list[Any]] = field(default_factory=list)
    backwards: list[BackwardRow] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    optimizer_steps: list[list[Any]] = field(default_factory=list)
    memory_trace: MemoryTrace = field(default_factory=MemoryTrace)
    foreign_saves: int = 0  # saves packed by other saved_tensors_hooks pairs
    unseen_saves: int = 0  # saves this torch cannot attribute (see _compat.capabilities)
    func_regions: int = 0  # torch.func transforms run inside the block
    notes: list[str] = field(default_factory=list)  # raw notes (internal errors, capabilities)
    refusal: BudgetRefusal | None = None  # the budget's refusal that ended the block, if one did
    max_events: int | None = 200_000
    modules_given: bool = False  # modules= was passed
    torch_version: str = ""
    rank: int | None = None  # under torch.distributed
    world_size: int | None = None
    failed_oom: bool = False  # the block ended with an out-of-memory (real or simulated)
    deep_graph_trap: bool = False  # node objects persist: see gradscope._capture.walk.release
    # a loop (see NOTE [ iterations ] in gradscope._passes.iterations): the end of each iteration in this
    # trace, and the block's saves before this piece of it (its save_storage identities count them)
    marks: list[tuple[int, int, int, int]] = field(default_factory=list)
    save_base: int = 0
    piece_t0_ns: int = 0  # when this piece began (0: the block's start, t0_ns)

    def __post_init__(self) -> None:
        self.memory = MemoryKind.of(self.memory)
