"""The rows of a recording's tables: what a node, an edge, a saved tensor, a backward step, a
point of the timeline, an allocation and a loop's iteration are (each a small frozen dataclass),
and the enums they use. :mod:`gradscope.recording` is their face."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from gradscope._base.errors import BudgetRefusal
from gradscope._base.memory_kind import MemoryKind


class Kind(str, enum.Enum):
    """What a saved tensor is."""

    ACTIVATION = "activation"
    PARAMETER = "parameter"
    INPUT = "input"
    BUFFER = "buffer"


class Phase(str, enum.Enum):
    """Which part of the computation a moment belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


class Category(str, enum.Enum):
    """What an allocation made inside the block is, for memory by category over time.

    What existed before the block (parameters, buffers, inputs) is not an allocation of the
    block: it is :attr:`Recording.baseline_bytes`, drawn as its own band.
    """

    ACTIVATION = "activation"  # saved for backward by a forward (order 0) node
    CREATE_GRAPH = "create_graph"  # saved by a node that a create_graph=True backward made
    GRADIENT = "gradient"  # a gradient: accumulated into .grad, or returned by autograd.grad
    OPTIMIZER = "optimizer"  # made by an optimizer step (its state and temporaries)
    BACKWARD_TEMP = "backward_temp"  # made during backward, neither a gradient nor saved
    OTHER = "other"  # forward results nobody saved, temporaries, anything else


@dataclass(frozen=True, slots=True)
class Node:
    """One autograd node.

    Attributes:
        id: assigned while recording, 0..n-1 in discovery order (never ``id()``).
        name: the node's class, e.g. ``"AddmmBackward0"``; ``"AccumulateGrad"`` for leaves.
        order: 0 for forward nodes, 1 for nodes created by a backward run with
            ``create_graph=True``, 2 for the level after that.
        module: dotted path of the module that created it (``"layers.0.linear1"``), or None.
        leaf: for ``AccumulateGrad``, the parameter name or ``"input"``; None otherwise.
        leaf_shape: shape of the leaf tensor for ``AccumulateGrad`` nodes.
        executed: how many backward passes in the block ran this node.
        line: the user's line that made it (an index into :attr:`Recording.lines`), or None. Taken
            when the node's first save was packed (the op running on the user's stack); a node
            that saved nothing of ours gets the line of the nearest node made before it that has
            one (after it, when none was made before), and ``AccumulateGrad`` nodes have none
            (see NOTE [ where lines come from ] in :mod:`gradscope._model.lines`).
    """

    id: int
    name: str
    order: int = 0
    module: str | None = None
    leaf: str | None = None
    leaf_shape: tuple[int, ...] | None = None
    executed: int = 0
    line: int | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """Data flows from ``src`` to ``dst`` in forward; gradients flow from ``dst`` to ``src``.

    ``src`` is one of ``dst``'s ``next_functions``.
    """

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """A tensor that a node saved for backward.

    ``bytes`` is the size of the whole storage it keeps alive (a view keeps all of its base);
    ``storage`` is a recording-local id of that storage, so saves of one storage can be
    deduplicated (see :attr:`Recording.saved_bytes`). ``line`` is the user's line running when it
    was packed (an index into :attr:`Recording.lines`), or None.
    """

    node: int
    attribute: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    storage: int
    kind: Kind
    module: str | None = None
    name: str | None = None
    freed_at_step: int | None = None
    line: int | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One node executed by a backward pass, in execution order."""

    index: int
    node: int
    backward: int
    start_s: float
    duration_s: float
    live_before: int | None
    live_after: int | None
    freed_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryPoint:
    """Live bytes allocated inside the block after one allocation or free.

    ``label`` names the op or node running then; ``step`` is the backward step it happened in
    (None in forward). ``reserved`` is the CUDA caching allocator's reserved bytes when known.
    ``category`` is what the allocation (or freed allocation) of this point is; ``line`` the
    user's line that made it (an index into :attr:`Recording.lines`; see :attr:`Allocation.line`).
    """

    t_s: float
    live: int
    phase: Phase
    label: str
    step: int | None = None
    module: str | None = None
    reserved: int | None = None
    category: Category = Category.OTHER
    line: int | None = None


@dataclass(frozen=True, slots=True)
class Peak:
    """Where the peak was: phase, node (for backward) and module."""

    bytes: int
    phase: Phase
    t_s: float = 0.0
    label: str = ""
    node: int | None = None
    module: str | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Where:
    """Where a recording ran; ``memory_source`` is its memory source kind's words (``MemoryKind.shown``)."""

    device: str = "cpu"
    memory_source: str = "off"
    torch_version: str = ""
    rank: int | None = None
    world_size: int | None = None
    hostname: str = ""

    @property
    def measured(self) -> bool:
        """Whether a memory source measured the recording (a saved file keeps the kind's words)."""
        return self.memory_source != MemoryKind.OFF.shown


@dataclass(frozen=True, slots=True)
class Allocation:
    """One allocation made inside the block (a row of :attr:`Recording.allocations`).

    Attributes:
        index: position in the allocation table (allocation order).
        bytes: its size.
        alloc_at: position of its allocation event in the block's event sequence (the full
            timeline before any downsampling: ``alloc_at``-th event, counting from 0).
        free_at: position of its free event, None if it was alive when the block ended.
        t_s: seconds from the block's start to the allocation.
        category: what it is (see :class:`Category`).
        phase: when it was made (forward, backward, optimizer, other).
        module: the module running when it was made (for backward: the node's module).
        node: the node that saved it for backward (the first one), if any.
        step: the backward step that made it, if any (an index into :attr:`Recording.steps`).
        label: the op (or node) that made it, e.g. ``"aten::addmm"``.
        key: the memory source's key for it (see :attr:`Recording.allocation_key`).
        line: the user's line that made it (an index into :attr:`Recording.lines`), or None. In
            backward, the line of the node running (the forward line it differentiates); in
            forward, the line on the stack when the op ran (``memory="tracker"``); the
            profiler's source (``"cpu"``) and CUDA's give forward allocations none.
    """

    index: int
    bytes: int
    alloc_at: int
    free_at: int | None
    t_s: float
    category: Category
    phase: Phase
    module: str | None
    node: int | None
    step: int | None
    label: str
    key: int = 0
    line: int | None = None


@dataclass(frozen=True, slots=True)
class SourceLine:
    """A line of the user's code that made nodes, saved tensors or allocations (a row of
    :attr:`Recording.lines`): the innermost frame that is not PyTorch's, gradscope's, the
    standard library's or an installed library's (see NOTE [ folded frames ] in
    :mod:`gradscope._base.frames`).

    Attributes:
        file: the code's file name as Python knows it.
        line: its line number.
        function: the function's name (``<module>`` at a script's or cell's top level).
        cell: for a notebook cell, its execution count (``In [n]``) where IPython knew it.
        stack: the whole Python stack, innermost first, as ``(file, line, function)``, folded
            frames included, the first time the line was seen (at most 64 frames).
    """

    file: str
    line: int
    function: str
    cell: int | None = None
    stack: tuple[tuple[str, int, str], ...] = ()

    @property
    def label(self) -> str:
        """``train.py:57 in train_step``; ``cell [3]:5 in <module>`` for a notebook cell."""
        where = f"cell [{self.cell}]" if self.cell is not None else short_file(self.file)
        return f"{where}:{self.line} in {self.function}"

    def format_stack(self) -> str:
        """The whole stack, one frame a line, innermost first (``file:line in function``)."""
        return "\n".join(f"{f}:{n} in {fn}" for f, n, fn in self.stack)


def short_file(fn: str) -> str:
    """A file's short name: ``train.py``, ``pkg/__init__.py`` (the folder where the name says
    little)."""
    parts = fn.replace("\\", "/").rstrip("/").split("/")
    base = parts[-1] if parts else fn
    if base in ("__init__.py", "__main__.py") and len(parts) > 1:
        return f"{parts[-2]}/{base}"
    return base


@dataclass(frozen=True, slots=True)
class BackwardCall:
    """One call into the autograd engine inside the block (``backward`` or ``autograd.grad``).

    ``roots`` are the node ids of the outputs differentiated; ``inputs`` the node ids named by
    ``inputs=`` (a leaf's ``AccumulateGrad`` node, or the node of a non-leaf tensor);
    ``accumulated`` the ``AccumulateGrad`` nodes that ran (the leaves whose ``.grad`` it wrote);
    ``steps`` the ``[first, last]`` indices into :attr:`Recording.steps` it ran (None: no step
    seen). ``observed`` is False for a pass gradscope let run unobserved (another's hooks region).

    A call that raised (and was caught inside the block, or ended it) has ``error``, the
    exception as ``"TypeName: message"`` (None: it returned), and ``oom``, True for an
    out-of-memory (``torch.OutOfMemoryError``, :class:`~gradscope.MemoryBudgetExceeded` among
    them). Its steps are the nodes that started before the failure, the last one seen last;
    ``failed_step`` is the step that raised (started and never finished), known where every node
    is hooked (``memory="tracker"`` or ``"cuda"``; None elsewhere, or when it raised between
    nodes or before the first). ``accumulated`` then lists the leaves whose ``.grad`` it wrote
    before the failure. Files written before these fields existed load with ``error=None``.
    """

    index: int
    api: str
    create_graph: bool
    retain_graph: bool
    roots: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    accumulated: tuple[int, ...] = ()
    first_step: int | None = None
    last_step: int | None = None
    observed: bool = True
    error: str | None = None
    oom: bool = False
    failed_step: int | None = None


@dataclass(frozen=True, slots=True)
class HeldAllocation:
    """One allocation alive at the held moment (see :class:`HeldMemory`).

    ``what`` is ``"saved"`` (saved for backward: ``node``, ``order``, ``attribute``,
    ``saved_kind``, ``shape``, ``dtype`` say by whom and what), ``"gradient"``, ``"backward"``
    (made during backward otherwise), ``"optimizer"`` or ``"forward"`` (a forward result nobody
    saved: held by a variable, or a temporary). ``reused`` marks a key allocated again after the
    moment (it then names another storage: do not match it with live tensors).
    """

    key: int
    bytes: int
    label: str
    what: str
    allocation: int | None = None
    node: int | None = None
    node_name: str | None = None
    order: int | None = None
    module: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    saved_kind: str | None = None
    attribute: str | None = None
    reused: bool = False


_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(HeldAllocation))  # (HeldMemory.to_dict reads them)


@dataclass(frozen=True, slots=True)
class HeldMemory:
    """What held the block's memory at its peak (``moment="peak"``) or at the allocation that
    failed (``"failure"``): the allocations alive then, largest first (at most 500 rows; the
    rest summed by kind and module). ``key_kind`` says what ``HeldAllocation.key`` is
    (``"storage"``: a storage's key, ``"address"``: a block's address)."""

    moment: str
    live_bytes: int
    key_kind: str
    rows: tuple[HeldAllocation, ...] = ()
    omitted: int = 0
    omitted_bytes: int = 0
    omitted_by_kind: tuple[tuple[str, int], ...] = ()
    omitted_by_module: tuple[tuple[str, int], ...] = ()
    error: str | None = None

    def by_what(self) -> dict[str, int]:
        """Bytes by what held them (``saved``, ``saved_order1``, ``gradient``, ``backward``,
        ``optimizer``, ``forward``), largest first."""
        out: dict[str, int] = {}
        for r in self.rows:
            what = "saved_order1" if r.what == "saved" and (r.order or 0) >= 1 else r.what
            out[what] = out.get(what, 0) + r.bytes
        for what, b in self.omitted_by_kind:
            out[what] = out.get(what, 0) + b
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (schema 1's ``extra["held"]`` layout, which diagnosis code reads)."""
        rows = []
        for r in self.rows:
            # (its fields read directly: ``dataclasses.asdict`` copies each value deeply, a row holds plain ones)
            d = {k: v for k in _ROW_FIELDS if (v := getattr(r, k)) is not None and v is not False}
            if r.shape is not None:
                d["shape"] = list(r.shape)
            rows.append(d)
        out: dict[str, Any] = {
            "moment": self.moment, "live_bytes": self.live_bytes, "key_kind": self.key_kind, "rows": rows,
            "omitted": self.omitted, "omitted_bytes": self.omitted_bytes,
            "omitted_by_kind": dict(self.omitted_by_kind), "omitted_by_module": dict(self.omitted_by_module),
        }
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class OomInfo(BudgetRefusal):
    """A simulated out-of-memory that stopped the block: the budget's refusal (``requested`` bytes
    asked for with ``live`` bytes live of a ``budget``; ``where`` the op: see NOTE [ one refusal ] in
    gradscope._base.errors). In a notebook budget run, ``budget`` is the whole simulated device,
    ``cell_budget`` what was left for the cell and ``resident`` what earlier cells held on it."""

    cell_budget: int | None = None
    resident: int = 0


@dataclass(frozen=True, slots=True)
class Iteration:
    """One iteration of a loop recorded in one block (a row of :attr:`Recording.iterations`; see
    NOTE [ iterations ] in :mod:`gradscope._passes.iterations`).

    Attributes:
        index: 0, 1, ... in the block.
        start_s, duration_s: when it began (seconds from the block's start) and how long it ran.
        peak_bytes: the most memory allocated inside the block alive at one moment during it (None
            without a memory source, or where its memory was not read).
        start_bytes, end_bytes: that memory when it began and when it ended.
        saved_bytes: bytes of the storages its saves kept alive, each storage once.
        backward_passes, optimizer_steps: the calls into the engine and optimizer steps it made.
        holders: what held the most memory at its peak, ``(what, bytes)``, largest first: the user's
            line that made it, else the module, else the phase.
        kept: its full detail (nodes, saves, timeline) is in the recording (:attr:`Recording.loop`
            says where).
        failed: the block ended in it with an exception.
    """

    index: int
    start_s: float
    duration_s: float
    peak_bytes: int | None
    start_bytes: int | None
    end_bytes: int | None
    saved_bytes: int
    backward_passes: int = 0
    optimizer_steps: int = 0
    holders: tuple[tuple[str, int], ...] = ()
    kept: bool = True
    failed: bool = False


@dataclass(frozen=True, slots=True)
class Growth:
    """Memory that grows from iteration to iteration (see NOTE [ growth across iterations ] in
    :mod:`gradscope._model.growth`): the allocations ``site`` made that were still alive at each
    iteration's end added ``grown_bytes`` from iteration ``first`` to ``last``; ``live_bytes`` is
    what they held at the end of the last iteration. ``site`` is the user's line
    (``train.py:57 in train``), else the module, else what made them; ``""`` is the block's memory
    as a whole."""

    site: str
    grown_bytes: int
    first: int
    last: int
    live_bytes: int

    @property
    def bytes_per_iteration(self) -> float:
        """What it adds an iteration."""
        return self.grown_bytes / max(self.last - self.first + 1, 1)
