"""The data model: one immutable :class:`Recording` that every view reads.

A recording holds numbers and names, never tensors, so keeping it never keeps memory alive.
It round-trips exactly through JSON (:meth:`Recording.save` / :func:`load`); no pickle. Files of
schema 1 load through :func:`_migrate_1_to_2`.

NOTE [ one definition per figure ]: every byte figure a view shows is computed here, by one
method, with a label and a one-line definition in :data:`gradscope.figures.FIGURES` (the one
registry, which names these methods) that views show beside it (tooltips), so
the summary, the widget, the page and the diagnosis cannot disagree on what a number means.
This module imports no view: ``summary``, ``to_html`` and ``_repr_mimebundle_`` load theirs
lazily when called.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from gradscope import _views
from gradscope._memory.kind import MemoryKind
from gradscope._units import format_bytes
from gradscope.errors import BudgetRefusal, GradscopeError

__all__ = [
    "SCHEMA_VERSION",
    "Allocation",
    "Table",
    "BackwardCall",
    "Category",
    "Edge",
    "HeldMemory",
    "HeldAllocation",
    "Growth",
    "Iteration",
    "Kind",
    "Loop",
    "OomInfo",
    "MemoryPoint",
    "Node",
    "Peak",
    "Phase",
    "Recording",
    "SavedTensor",
    "SourceLine",
    "Step",
    "Where",
    "format_bytes",
    "load",
]

SCHEMA_VERSION = 2
_FORMAT = "gradscope.recording"
# Files larger than this are refused by `load` before parsing: a recording of a 200,000-node
# graph is about 60 MB of JSON.
_MAX_FILE_BYTES = 1 << 30


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
            (see NOTE [ where lines come from ] in :mod:`gradscope._lines`).
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
    :mod:`gradscope._frames`).

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
            d = {k: v for k, v in dataclasses.asdict(r).items() if v is not None and v is not False}
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
    gradscope.errors). In a notebook budget run, ``budget`` is the whole simulated device,
    ``cell_budget`` what was left for the cell and ``resident`` what earlier cells held on it."""

    cell_budget: int | None = None
    resident: int = 0


@dataclass(frozen=True, slots=True)
class Iteration:
    """One iteration of a loop recorded in one block (a row of :attr:`Recording.iterations`; see
    NOTE [ iterations ] in :mod:`gradscope._iterations`).

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
    :mod:`gradscope._growth`): the allocations ``site`` made that were still alive at each
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


@dataclass(frozen=True)
class Loop:
    """A long loop's recording keeps the full detail of some iterations only (see NOTE [ iterations ]
    in :mod:`gradscope._iterations`): the recording's own nodes, saves, steps, timeline and every
    figure made from them are those of iterations ``detail`` (first, last), as a block of those
    iterations would record them, and ``parts`` hold the other iterations kept (each a recording of
    its iterations, with a ``loop`` of its own). Memory in each one's timeline and allocation table
    is what its iterations allocated; ``carried_bytes`` was alive when its first iteration began
    (made earlier in the block). The whole loop's figures are the recording's ``iterations`` (every
    one's peak, memory and saves), ``growth``, and ``saved_bytes`` here: every save of the block,
    kept or not, each storage once."""

    detail: tuple[int, int]
    parts: tuple[Recording, ...] = ()
    saved_bytes: int = 0
    carried_bytes: int = 0

    def part(self, iteration: int) -> Recording | None:
        """The kept part holding ``iteration``'s detail (None: it was not kept, or it is the
        recording's own detail)."""
        return next((p for p in self.parts if p.loop is not None
                     and p.loop.detail[0] <= iteration <= p.loop.detail[1]), None)


T = TypeVar("T")


class Table(Sequence[T], Generic[T]):
    """An immutable table of rows of one dataclass, kept as columns; a row object is made the
    first time it is read (then kept).

    NOTE [ tables are columns ]: a recording of a graph of small ops holds tens of thousands of
    nodes, saves, steps, allocations and timeline points; making a frozen dataclass object for
    each costs about a microsecond, as much as PyTorch spends on a small op, so the recorder
    hands its tables over as columns. Read a table as the tuple of rows it stands for (it
    compares equal to one); :meth:`column` gives one field of every row without making rows
    (what JSON, the widget and the page need).

    Example:
        >>> from gradscope.recording import Edge, Table
        >>> t = Table(Edge, {"src": [1, 2], "dst": [0, 1]})
        >>> len(t), t[1], t == (Edge(1, 0), Edge(2, 1)), t.column("src")
        (2, Edge(src=2, dst=1), True, [1, 2])
    """

    __slots__ = ("_cache", "_cls", "_cols", "_names", "_n", "_rows")

    def __init__(self, cls: type[T], columns: Mapping[str, Sequence[Any]], *, cache: bool = True) -> None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        names = [f.name for f in fields]
        lengths = {len(columns[n]) for n in names if n in columns}
        if len(lengths) > 1:
            raise ValueError(f"columns of {cls.__name__} have different lengths {sorted(lengths)}")
        n_rows = next(iter(lengths)) if lengths else 0
        # every field, in order (rows are made positionally); a column not given is its default's
        cols = [columns[f.name] if f.name in columns else [f.default] * n_rows for f in fields]
        if any(f.name not in columns and f.default is dataclasses.MISSING for f in fields):
            raise ValueError(f"a column of {cls.__name__} without a default is missing")
        lengths = {len(c) for c in cols}
        self._cls = cls
        self._names = names
        self._cols = cols
        self._n = lengths.pop() if lengths else 0
        self._rows: list[T] | None = None
        self._cache = cache  # False: rows are made each time they are read (a long loop's iterations)

    def _all(self) -> list[T]:
        rows = self._rows
        if rows is None:
            make = self._cls
            rows = [make(*vals) for vals in zip(*self._cols, strict=True)] if self._cols else []
            if self._cache:
                self._rows = rows
        return rows

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[T, ...]: ...
    def __getitem__(self, i: int | slice) -> T | tuple[T, ...]:
        if isinstance(i, slice):
            return tuple(self._all()[i])
        if self._rows is not None:
            return self._rows[i]
        if not -self._n <= i < self._n:
            raise IndexError("Table index out of range")
        return self._cls(*(c[i] for c in self._cols))  # one row: the others are not made

    def __iter__(self) -> Iterator[T]:
        if not self._cache and self._rows is None and self._cols:
            make = self._cls
            return (make(*vals) for vals in zip(*self._cols, strict=True))
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Table | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def column(self, name: str) -> Sequence[Any]:
        """One field of every row, in row order."""
        return self._cols[self._names.index(name)]


@dataclass(frozen=True)
class Recording:
    """Everything gradscope saw inside one ``gs.record()`` block. Immutable.

    Example:
        >>> import torch, gradscope as gs
        >>> w = torch.ones(3, requires_grad=True)
        >>> with gs.record(memory="off") as rec:
        ...     (w * 2).sum().backward()
        >>> [n.name for n in rec.recording.nodes]
        ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    """

    nodes: Sequence[Node] = ()
    edges: Sequence[Edge] = ()
    saved: Sequence[SavedTensor] = ()
    steps: Sequence[Step] = ()
    timeline: Sequence[MemoryPoint] = ()
    peak_bytes: int = 0
    baseline_bytes: int = 0
    peak: Peak | None = None
    where: Where = field(default_factory=Where)
    complete: bool = True
    error: str | None = None
    notes: tuple[str, ...] = ()
    label: str = ""
    wall_time_s: float = 0.0
    backward_passes: int = 0
    reserved_peak_bytes: int | None = None
    device_total_bytes: int | None = None
    timeline_dropped: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    allocations: Sequence[Allocation] = ()
    allocation_key: str = "none"
    backward_calls: tuple[BackwardCall, ...] = ()
    held: HeldMemory | None = None
    oom: OomInfo | None = None
    nodes_created: int = 0
    nodes_created_seen: int = 0
    lines: tuple[SourceLine, ...] = ()
    iterations: Sequence[Iteration] = ()
    growth: tuple[Growth, ...] = ()
    loop: Loop | None = None

    # ----- derived figures -------------------------------------------------------------
    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive by saved tensors, each storage counted once (a long loop's recording:
        those of the iterations whose detail it holds; the whole loop's are ``loop.saved_bytes``).

        NOTE [ why saved bytes are deduped ]: one storage is often saved by several nodes
        (a ReLU's output by the ReLU and by the next Linear) and several views of one storage
        keep the same memory alive; counting each save would double-count memory that exists once.
        """
        seen: dict[int, int] = {}
        for s in self.saved:
            seen[s.storage] = s.bytes
        return sum(seen.values())

    def held_at_peak(self) -> dict[str, int]:
        """What the memory allocated inside the block was at the peak (or at the failing
        allocation): bytes by what held it (``saved``, ``saved_order1``, ``gradient``,
        ``backward``, ``optimizer``, ``forward``). Empty when memory was not measured."""
        return self.held.by_what() if self.held is not None else {}

    @property
    def saved_bytes_at_peak(self) -> int | None:
        """Bytes of saved tensors made inside the block and still alive at the peak (None when
        memory was not measured). Unlike :attr:`saved_bytes`, which counts every save over the
        whole block, this is what the saved tensors cost at the worst moment."""
        held = self.held_at_peak()
        if not held:
            return None
        return held.get("saved", 0) + held.get("saved_order1", 0)

    # ----- the allocation table -----------------------------------------------------------
    def peak_event(self) -> int | None:
        """Position in the event sequence of the peak (the first event at which the live bytes
        reach :attr:`peak_bytes`), from the allocation table; None without one."""
        events = _events(self.allocations)
        live = best = 0
        at: int | None = None
        for pos, delta in events:
            live += delta
            if live > best:
                best, at = live, pos
        return at

    def alive_at(self, position: int) -> tuple[Allocation, ...]:
        """The allocations alive just after the event at ``position``."""
        return tuple(a for a in self.allocations
                     if a.alloc_at <= position and (a.free_at is None or a.free_at > position))

    def alive_at_peak(self) -> tuple[Allocation, ...]:
        """The allocations alive at the peak (see :meth:`peak_event`)."""
        at = self.peak_event()
        return () if at is None else self.alive_at(at)

    def replay_peak(self, exclude: Callable[[Allocation], bool] | None = None) -> int:
        """The peak of the block's live bytes replayed without the allocations ``exclude``
        selects: what a fix that removed them would save (``peak_bytes - replay_peak(...)``).
        Pure: events keep their order, nothing else moves. Needs the allocation table (a
        recording with a memory source).

        Example:
            >>> from gradscope.recording import Allocation, Category, Phase, Recording
            >>> a = Allocation(0, 100, 0, 2, 0.0, Category.ACTIVATION, Phase.FORWARD, None, None, None, "x")
            >>> b = Allocation(1, 50, 1, None, 0.0, Category.OTHER, Phase.FORWARD, None, None, None, "y")
            >>> r = Recording(allocations=(a, b))
            >>> r.replay_peak(), r.replay_peak(lambda a: a.category is Category.ACTIVATION)
            (150, 50)
        """
        keep = self.allocations if exclude is None else tuple(a for a in self.allocations if not exclude(a))
        live = peak = 0
        for _, delta in _events(keep):
            live += delta
            peak = max(peak, live)
        return peak

    def bytes_at_peak_by_category(self) -> dict[str, int]:
        """See ``gradscope.figures.FIGURES["category_at_peak"]``."""
        out: dict[str, int] = {}
        for a in self.alive_at_peak():
            out[a.category.value] = out.get(a.category.value, 0) + a.bytes
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def bytes_at_peak_by_module(self) -> dict[str, int]:
        """See ``gradscope.figures.FIGURES["module_alive_at_peak"]``; allocations made outside
        any module are under ``"(no module)"``."""
        out: dict[str, int] = {}
        for a in self.alive_at_peak():
            m = a.module or "(no module)"
            out[m] = out.get(m, 0) + a.bytes
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def node_saved_bytes(self, node_id: int) -> int:
        """See ``gradscope.figures.FIGURES["node_saved_bytes"]``."""
        return sum({s.storage: s.bytes for s in self.saved if s.node == node_id}.values())

    def node_saved_alive_at_peak(self, node_id: int) -> int | None:
        """See ``gradscope.figures.FIGURES["node_saved_alive_at_peak"]`` (None without an
        allocation table)."""
        if not self.allocations:
            return None
        return sum(a.bytes for a in self.alive_at_peak() if a.node == node_id)

    def backward_leaves(self, call: BackwardCall) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Names of what one backward call differentiated (``inputs=``: leaf names, or node names
        for non-leaf tensors) and of the leaves whose ``.grad`` it accumulated into."""
        def name(i: int) -> str:
            n = self.nodes[i] if 0 <= i < len(self.nodes) else None
            return "?" if n is None else (n.leaf or n.name)

        return tuple(name(i) for i in call.inputs), tuple(name(i) for i in call.accumulated)

    def node(self, node_id: int) -> Node:
        """The node with this id."""
        if not 0 <= node_id < len(self.nodes) or self.nodes[node_id].id != node_id:
            raise GradscopeError(
                f"gradscope: no node {node_id} in this recording (it has {len(self.nodes)} nodes, "
                "ids 0..n-1)."
            )
        return self.nodes[node_id]

    def saved_by_node(self) -> dict[int, list[SavedTensor]]:
        """Saved tensors grouped by node id."""
        out: dict[int, list[SavedTensor]] = {}
        for s in self.saved:
            out.setdefault(s.node, []).append(s)
        return out

    def saved_bytes_by_module(self) -> dict[str, int]:
        """Saved bytes per module (storage-deduplicated within the module), largest first."""
        per: dict[str, dict[int, int]] = {}
        for s in self.saved:
            per.setdefault(s.module or "(no module)", {})[s.storage] = s.bytes
        totals = {m: sum(v.values()) for m, v in per.items()}
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))

    def line_label(self, line: int | None) -> str | None:
        """The label of row ``line`` of :attr:`lines` (``train.py:57 in train_step``), None for
        None or an index outside the table."""
        if line is None or not 0 <= line < len(self.lines):
            return None
        return self.lines[line].label

    def saved_bytes_by_line(self) -> dict[int, int]:
        """See ``gradscope.figures.FIGURES["line_saved_bytes"]``: by index into :attr:`lines`,
        largest first; saves without a line are left out."""
        per: dict[int, dict[int, int]] = {}
        for s in self.saved:
            if s.line is not None:
                per.setdefault(s.line, {})[s.storage] = s.bytes
        totals = {k: sum(v.values()) for k, v in per.items()}
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))

    def bytes_at_peak_by_line(self) -> dict[int, int] | None:
        """See ``gradscope.figures.FIGURES["line_alive_at_peak"]``: by index into :attr:`lines`,
        largest first; None without an allocation table."""
        if not self.allocations:
            return None
        out: dict[int, int] = {}
        for a in self.alive_at_peak():
            if a.line is not None:
                out[a.line] = out.get(a.line, 0) + a.bytes
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def held_line(self, key: int) -> str | None:
        """The label of the line that made the allocation held under ``key`` at the held moment
        (see :attr:`held`): its allocation's line, else the saving node's; None where unknown."""
        if self.held is None:
            return None
        row = next((h for h in self.held.rows if h.key == key), None)
        if row is None:
            return None
        if row.allocation is not None and 0 <= row.allocation < len(self.allocations):
            label = self.line_label(self.allocations[row.allocation].line)
            if label is not None:
                return label
        if row.node is not None and 0 <= row.node < len(self.nodes):
            return self.line_label(self.nodes[row.node].line)
        return None

    def saved_bytes_by_kind(self) -> dict[str, int]:
        """Saved bytes per kind (activation, parameter, input, buffer), storage-deduplicated."""
        per: dict[str, dict[int, int]] = {}
        for s in self.saved:
            per.setdefault(s.kind.value, {})[s.storage] = s.bytes
        return {k: sum(v.values()) for k, v in sorted(per.items())}

    def steady(self) -> bool | None:
        """Whether the block's memory at the end of its iterations stays the same (see NOTE [ growth
        across iterations ] in :mod:`gradscope._growth`): False where it grows, None with fewer than
        three iterations or no memory source."""
        if len(self.iterations) < 3 or any(it.end_bytes is None for it in self.iterations):
            return None
        return not any(g.site == "" for g in self.growth)

    def order_counts(self) -> dict[int, int]:
        """Number of nodes per order (0 = forward, 1 = created by create_graph, ...)."""
        out: dict[int, int] = {}
        for n in self.nodes:
            out[n.order] = out.get(n.order, 0) + 1
        return dict(sorted(out.items()))

    # ----- views -------------------------------------------------------------------------
    def summary(self, top: int = 5) -> str:
        """Deterministic text: totals, top saved tensors, top modules, peak location."""
        return str(_views.render("text", self, top=top))  # see NOTE [ results ask the registry ]

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained HTML page (scripts and data inline, no network). With ``path``,
        writes it there and returns the path (as a cell's last line it shows the file's name, not
        the page); without, returns the page's text."""
        html = str(_views.render("html", self))
        if path is None:
            return html
        atomic_write_text(os.fspath(path), html)
        return os.fspath(path)

    def to_dot(self, max_nodes: int = 5000) -> Any:
        """A ``graphviz.Digraph`` of the graph with saved tensors and their bytes."""
        return _views.render("dot", self, max_nodes=max_nodes)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return dict(_views.render("mimebundle", self))

    def __repr__(self) -> str:
        state = "" if self.complete else ", incomplete"
        return (
            f"Recording({self.label or 'unnamed'}: {len(self.nodes)} nodes, {len(self.saved)} saved "
            f"tensors, saved_bytes={self.saved_bytes}, peak_bytes={self.peak_bytes}, "
            f"{len(self.steps)} backward steps{state})"
        )

    # ----- files -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (columns for the big tables)."""
        return {
            "format": _FORMAT,
            "schema": SCHEMA_VERSION,
            "label": self.label,
            "complete": self.complete,
            "error": self.error,
            "notes": list(self.notes),
            "wall_time_s": self.wall_time_s,
            "backward_passes": self.backward_passes,
            "peak_bytes": self.peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "device_total_bytes": self.device_total_bytes,
            "timeline_dropped": self.timeline_dropped,
            "where": dataclasses.asdict(self.where),
            "peak": None if self.peak is None else _enum_safe(dataclasses.asdict(self.peak)),
            "nodes": _lines_inside(_columns(self.nodes, Node), len(self.lines)),
            "edges": _columns(self.edges, Edge),
            "saved": _lines_inside(_columns(self.saved, SavedTensor), len(self.lines)),
            "steps": _columns(self.steps, Step),
            "timeline": _lines_inside(_columns(self.timeline, MemoryPoint), len(self.lines)),
            "allocations": _lines_inside(_columns(self.allocations, Allocation), len(self.lines)),
            "allocation_key": self.allocation_key,
            "backward_calls": _columns(self.backward_calls, BackwardCall),
            "held": None if self.held is None else self.held.to_dict(),
            "oom": None if self.oom is None else self.oom.to_dict(),
            "nodes_created": self.nodes_created,
            "nodes_created_seen": self.nodes_created_seen,
            "lines": [[s.file, s.line, s.function, s.cell, [list(f) for f in s.stack]] for s in self.lines],
            "extra": dict(self.extra),
            "iterations": _columns(self.iterations, Iteration),
            "growth": _columns(self.growth, Growth),
            "loop": None if self.loop is None else {
                "detail": list(self.loop.detail), "parts": [p.to_dict() for p in self.loop.parts],
                "saved_bytes": self.loop.saved_bytes, "carried_bytes": self.loop.carried_bytes},
        }

    def to_json(self) -> str:
        """The recording as JSON text (what :meth:`save` writes)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recording:
        """Rebuild a recording from :meth:`to_dict` output; raises GradscopeError on bad data."""
        if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
            raise GradscopeError(
                "gradscope: this is not a gradscope recording (no 'format': "
                f"'{_FORMAT}' field). Load files written by Recording.save()."
            )
        schema = d.get("schema")
        if schema == 1 and not isinstance(schema, bool):
            d = _migrate_1_to_2(d)
            schema = d.get("schema")
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise GradscopeError(
                f"gradscope: recording schema version {schema!r} is not supported by this gradscope "
                f"(it reads versions 1 and {SCHEMA_VERSION}). Re-record with this version, or load it "
                "with the gradscope version that wrote it."
            )
        try:
            peak = d.get("peak")
            rec = cls(
                nodes=tuple(_rows(d["nodes"], Node)),
                edges=tuple(_rows(d["edges"], Edge)),
                saved=tuple(_rows(d["saved"], SavedTensor)),
                steps=tuple(_rows(d["steps"], Step)),
                timeline=tuple(_rows(d["timeline"], MemoryPoint)),
                peak_bytes=_int(d["peak_bytes"]),
                baseline_bytes=_int(d["baseline_bytes"]),
                peak=None if peak is None else _build(Peak, peak),
                where=_build(Where, d["where"]),
                complete=bool(d["complete"]),
                error=_opt_str(d.get("error")),
                notes=tuple(str(n) for n in d.get("notes", ())),
                label=str(d.get("label", "")),
                wall_time_s=float(d.get("wall_time_s", 0.0)),
                backward_passes=_int(d.get("backward_passes", 0)),
                reserved_peak_bytes=_opt_int(d.get("reserved_peak_bytes")),
                device_total_bytes=_opt_int(d.get("device_total_bytes")),
                timeline_dropped=_int(d.get("timeline_dropped", 0)),
                extra=_extra(d.get("extra")),
                allocations=tuple(_rows(d.get("allocations") or {}, Allocation)),
                allocation_key=str(d.get("allocation_key", "none")),
                backward_calls=tuple(_rows(d.get("backward_calls") or {}, BackwardCall)),
                held=_held_from_json(d.get("held")),
                oom=None if d.get("oom") is None else _build(OomInfo, d["oom"]),
                nodes_created=_int(d.get("nodes_created", 0)),
                nodes_created_seen=_int(d.get("nodes_created_seen", 0)),
                lines=_lines(d.get("lines")),  # a file written before lines existed: none
                iterations=tuple(_rows(d.get("iterations") or {}, Iteration)),
                growth=tuple(_rows(d.get("growth") or {}, Growth)),
                loop=_loop(d.get("loop"), cls),
            )
            _check_links(rec)
            return _views.typed(rec)  # a saved snapshot loads as its own type (NOTE [ saved types ] in _views)
        except GradscopeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GradscopeError(
                f"gradscope: the recording is damaged ({type(e).__name__}: {e}). "
                "Re-save it from the original session."
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the recording as JSON. Atomic: a crash mid-save leaves any previous file intact."""
        atomic_write_text(os.fspath(path), self.to_json())


def load(path: str | os.PathLike[str]) -> Recording:
    """Read a recording written by :meth:`Recording.save`.

    Raises GradscopeError for a truncated file, another schema version, a JSON file that is not a
    gradscope recording, or a file that is not JSON at all. Never executes anything from the file.
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise GradscopeError(f"gradscope: cannot read {p!r}: {e.strerror}.") from None
    if not stat.S_ISREG(st.st_mode):  # a directory, or a pipe that would block the read forever
        raise GradscopeError(f"gradscope: cannot read {p!r}: it is not a regular file.")
    size = st.st_size
    if size > _MAX_FILE_BYTES:
        raise GradscopeError(
            f"gradscope: {p!r} is {size} bytes, more than the {_MAX_FILE_BYTES}-byte limit for a "
            "recording; it is probably not a gradscope file."
        )
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise GradscopeError(f"gradscope: cannot read {p!r}: {e.strerror}.") from None
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        raise GradscopeError(f"gradscope: {p!r} is not UTF-8 JSON; is it a gradscope recording?") from None
    except json.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(text.rstrip()) else "not valid JSON"
        raise GradscopeError(
            f"gradscope: {p!r} is {what} ({e.msg} at character {e.pos}). "
            "Save the recording again with Recording.save()."
        ) from None
    except RecursionError:
        raise GradscopeError(f"gradscope: {p!r} is nested too deeply to be a gradscope recording.") from None
    return Recording.from_dict(data)


# ----- helpers ---------------------------------------------------------------------------
def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a crash or a failed write leaves any
    previous file intact and no temporary behind (every file gradscope writes goes through it).
    The file gets the mode ``open(path, "w")`` would give it: a file written over keeps its
    mode, a new one gets ``0o666`` less the process's umask (the temporary is ``0o600``)."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=".gradscope-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.chmod(tmp, mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode_for(path: str) -> int:
    """The permission bits a plain ``open(path, "w")`` leaves: the existing file's, else
    ``0o666`` less the umask (read from /proc where it can be, so no other thread sees the umask
    changed for a moment)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    umask = None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except (OSError, ValueError):
        umask = None
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _enum_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in d.items()}


def _columns(rows: Iterable[Any], cls: type) -> dict[str, list[Any]]:
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(rows, Table) and rows._rows is None:  # see NOTE [ tables are columns ]
        return {n: [_json_value(v) for v in rows.column(n)] for n in names}
    cols: dict[str, list[Any]] = {n: [] for n in names}
    for r in rows:
        for n in names:
            v = getattr(r, n)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, float) and not math.isfinite(v):
                v = None
            cols[n].append(v)
    return cols


def _lines_inside(cols: dict[str, list[Any]], n_lines: int) -> dict[str, list[Any]]:
    """A table's line column as written: an index outside the line table (rows taken from another
    recording without its lines) is written as none, so that the file loads (see NOTE [ files are
    data ])."""
    col = cols.get("line")
    if col is not None and any(v is not None and not 0 <= v < n_lines for v in col):
        cols["line"] = [v if v is not None and 0 <= v < n_lines else None for v in col]
    return cols


def _json_value(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_CONVERT: dict[str, Any] = {
    "phase": Phase,
    "kind": Kind,
    "category": Category,
    "shape": lambda v: tuple(int(x) for x in v) if isinstance(v, list | tuple) else v,
    "leaf_shape": lambda v: None if v is None else tuple(int(x) for x in v),
    "roots": lambda v: tuple(v) if isinstance(v, list) else v,
    "inputs": lambda v: tuple(v) if isinstance(v, list) else v,
    "accumulated": lambda v: tuple(v) if isinstance(v, list) else v,
    "holders": lambda v: _holders(v),
}


# NOTE [ files are data ]: a recording file may come from anyone. Every field read from one must
# have its declared type (views index, sort and add with them), and every index into another
# table must point inside it; otherwise loading fails with a GradscopeError.
_TYPE_CHECKS: dict[str, Any] = {
    "int": lambda v: type(v) is int,
    "float": lambda v: v is None or type(v) in (int, float),  # non-finite floats are written as null
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "None": lambda v: v is None,
    "Kind": lambda v: isinstance(v, Kind),
    "Phase": lambda v: isinstance(v, Phase),
    "Category": lambda v: isinstance(v, Category),
    "tuple[int, ...]": lambda v: type(v) is tuple and all(type(x) is int for x in v),
}
_PLANS: dict[type, list[tuple[str, Any, Any]]] = {}


def _plan(cls: type) -> list[tuple[str, Any, Any]]:
    """(field name, conversion, type check or None) for each field of ``cls``."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = []
        for f in dataclasses.fields(cls):
            parts = [p.strip() for p in str(f.type).split("|")]
            checks = [_TYPE_CHECKS.get(p) for p in parts]
            check = None if None in checks else (lambda v, cs=tuple(checks): any(c(v) for c in cs))
            plan.append((f.name, _CONVERT.get(f.name), check))
        _PLANS[cls] = plan
    return plan


def _build(cls: type, d: Mapping[str, Any]) -> Any:
    if not isinstance(d, Mapping):
        raise TypeError(f"expected an object for {cls.__name__}")
    kwargs = {}
    for name, conv, check in _plan(cls):
        if name in d:
            v = d[name]
            if conv is not None:
                v = conv(v)
            if check is not None and not check(v):
                raise TypeError(f"{cls.__name__}.{name} cannot be {type(v).__name__} {str(v)[:40]!r}")
            kwargs[name] = v
    return cls(**kwargs)


def _check_links(r: Recording) -> None:
    """See NOTE [ files are data ]: ids and indices between the tables point inside them."""
    n, m = len(r.nodes), len(r.steps)
    if any(node.id != i for i, node in enumerate(r.nodes)):
        raise ValueError("node ids are not 0..n-1 in order")
    if not math.isfinite(r.wall_time_s):
        raise ValueError("wall_time_s is not a finite number")

    def inside(v: int | None, size: int, what: str) -> None:
        if v is not None and not 0 <= v < size:
            raise ValueError(f"{what} {v} points outside its table of {size}")

    for e in r.edges:
        inside(e.src, n, "edge source")
        inside(e.dst, n, "edge target")
    for s in r.saved:
        inside(s.node, n, "saved tensor node")
        inside(s.freed_at_step, m, "saved tensor freed_at_step")
    for st in r.steps:
        inside(st.node, n, "step node")
    for p in r.timeline:
        inside(p.step, m, "timeline step")
        inside(p.line, len(r.lines), "timeline line")
    k = len(r.lines)
    for node in r.nodes:
        inside(node.line, k, "node line")
    for s in r.saved:
        inside(s.line, k, "saved tensor line")
    for a in r.allocations:
        inside(a.line, k, "allocation line")
        inside(a.node, n, "allocation node")
        inside(a.step, m, "allocation step")
        if a.bytes < 0 or a.alloc_at < 0 or (a.free_at is not None and a.free_at <= a.alloc_at):
            raise ValueError(f"allocation {a.index} has impossible bytes or event positions")
    for c in r.backward_calls:
        for i in (*c.roots, *c.inputs, *c.accumulated):
            inside(i, n, "backward call node")
        inside(c.first_step, m, "backward call step")
        inside(c.last_step, m, "backward call step")
        inside(c.failed_step, m, "backward call step")
    if r.held is not None:
        for h in r.held.rows:
            inside(h.node, n, "held node")
            inside(h.allocation, len(r.allocations), "held allocation")
    if r.peak is not None:
        inside(r.peak.node, n, "peak node")
        inside(r.peak.step, m, "peak step")


def _rows(cols: Mapping[str, list[Any]], cls: type) -> list[Any]:
    if not isinstance(cols, Mapping):
        raise TypeError(f"expected columns for {cls.__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    present = [n for n in names if n in cols]
    lengths = {len(cols[n]) for n in present}
    if len(lengths) > 1:
        raise ValueError(f"columns of {cls.__name__} have different lengths {sorted(lengths)}")
    n_rows = lengths.pop() if lengths else 0
    return [_build(cls, {n: cols[n][i] for n in present}) for i in range(n_rows)]


def _events(allocations: Iterable[Allocation]) -> list[tuple[int, int]]:
    """(event position, signed bytes) of an allocation table, in event order."""
    out = []
    for a in allocations:
        out.append((a.alloc_at, a.bytes))
        if a.free_at is not None:
            out.append((a.free_at, -a.bytes))
    out.sort()
    return out


def _loop(v: Any, cls: Any) -> Loop | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise TypeError("loop is not an object")
    detail = tuple(v["detail"])
    if len(detail) != 2 or not all(type(x) is int for x in detail) or not isinstance(v.get("parts", []), list):
        raise TypeError("loop detail is not two iteration indices")
    saved, carried = v.get("saved_bytes", 0), v.get("carried_bytes", 0)
    if type(saved) is not int or type(carried) is not int:
        raise TypeError("loop bytes are not ints")
    return Loop(detail=(detail[0], detail[1]), parts=tuple(cls.from_dict(p) for p in v.get("parts", [])),
                saved_bytes=saved, carried_bytes=carried)


def _holders(v: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(v, list | tuple) or not all(
            isinstance(h, list | tuple) and len(h) == 2 and type(h[0]) is str and type(h[1]) is int for h in v):
        raise TypeError("holders are not (what, bytes) pairs")
    return tuple((h[0], h[1]) for h in v)


def _extra(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise TypeError("extra must be an object")
    return dict(v)


def _held_from_json(v: Any) -> HeldMemory | None:
    """A held-at-peak object from its JSON form (see :meth:`HeldMemory.to_dict`)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise TypeError("held must be an object")
    if "rows" not in v:  # schema 1 kept {"error": ...} when listing failed
        return HeldMemory(moment="none", live_bytes=0, key_kind="none", error=_opt_str(v.get("error")))
    rows = []
    for r in v.get("rows") or ():
        if not isinstance(r, Mapping):
            raise TypeError("a held row must be an object")
        r = dict(r)
        if r.get("shape") is not None:
            r["shape"] = tuple(int(x) for x in r["shape"])
        r.setdefault("what", "forward")
        r.setdefault("label", "")
        rows.append(_build(HeldAllocation, r))

    def pairs(m: Any) -> tuple[tuple[str, int], ...]:
        if not isinstance(m, Mapping):
            raise TypeError("expected an object of byte counts")
        return tuple((str(k), _int(b)) for k, b in m.items())

    return HeldMemory(
        moment=str(v.get("moment", "peak")), live_bytes=_int(v.get("live_bytes", 0)),
        key_kind=str(v.get("key_kind", "storage")), rows=tuple(rows), omitted=_int(v.get("omitted", 0)),
        omitted_bytes=_int(v.get("omitted_bytes", 0)), omitted_by_kind=pairs(v.get("omitted_by_kind") or {}),
        omitted_by_module=pairs(v.get("omitted_by_module") or {}), error=_opt_str(v.get("error")),
    )


def _lines(v: Any) -> tuple[SourceLine, ...]:
    """The line table from its JSON form: ``[file, line, function, cell, stack]`` rows."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise TypeError("lines must be a list")
    out = []
    for row in v:
        if not isinstance(row, list) or len(row) != 5:
            raise TypeError("a line must be [file, line, function, cell, stack]")
        file, line, function, cell, stack = row
        if not isinstance(stack, list) or not all(isinstance(f, list) and len(f) == 3 for f in stack):
            raise TypeError("a line's stack must be a list of [file, line, function]")
        out.append(SourceLine(
            file=str(file), line=_int(line), function=str(function), cell=_opt_int(cell),
            stack=tuple((str(f[0]), _int(f[1]), str(f[2])) for f in stack),
        ))
    return tuple(out)


def _migrate_1_to_2(d: Mapping[str, Any]) -> dict[str, Any]:
    """Schema 1 kept what is now typed (held tensors, backward calls, the simulated OOM, node
    counts) as untyped dicts in ``extra``; schema 2 has fields for them. Nothing else changed."""
    out = dict(d)
    extra = d.get("extra")
    extra = dict(extra) if isinstance(extra, Mapping) else extra
    if isinstance(extra, dict):
        if "held" in extra:
            out["held"] = extra.pop("held")
        if "oom" in extra:
            out["oom"] = extra.pop("oom")
        calls = extra.pop("backward_calls", None)
        if isinstance(calls, list):
            cols: dict[str, list[Any]] = {"index": [], "api": [], "create_graph": [], "retain_graph": []}
            for i, c in enumerate(calls):
                if not isinstance(c, Mapping):
                    raise TypeError("a backward call must be an object")
                cols["index"].append(i)
                cols["api"].append(str(c.get("api", "backward")))
                cols["create_graph"].append(bool(c.get("create_graph", False)))
                cols["retain_graph"].append(bool(c.get("retain_graph", False)))
            out["backward_calls"] = cols
        for k in ("nodes_created", "nodes_created_seen"):
            if k in extra:
                out[k] = extra.pop(k)
    out["extra"] = extra
    out["schema"] = 2
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)
