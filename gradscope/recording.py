"""The data model: one immutable :class:`Recording` that every view reads.

A recording holds numbers and names, never tensors, so keeping it never keeps memory alive.
It round-trips exactly through JSON (:meth:`Recording.save` / :func:`load`); no pickle.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradscope.errors import GradscopeError

__all__ = [
    "SCHEMA_VERSION",
    "Category",
    "Edge",
    "Kind",
    "MemoryPoint",
    "Node",
    "Peak",
    "Phase",
    "Recording",
    "SavedTensor",
    "Step",
    "Where",
    "format_bytes",
    "load",
]

SCHEMA_VERSION = 1
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


@dataclass(frozen=True)
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
    """

    id: int
    name: str
    order: int = 0
    module: str | None = None
    leaf: str | None = None
    leaf_shape: tuple[int, ...] | None = None
    executed: int = 0


@dataclass(frozen=True)
class Edge:
    """Data flows from ``src`` to ``dst`` in forward; gradients flow from ``dst`` to ``src``.

    ``src`` is one of ``dst``'s ``next_functions``.
    """

    src: int
    dst: int


@dataclass(frozen=True)
class SavedTensor:
    """A tensor that a node saved for backward.

    ``bytes`` is the size of the whole storage it keeps alive (a view keeps all of its base);
    ``storage`` is a recording-local id of that storage, so saves of one storage can be
    deduplicated (see :attr:`Recording.saved_bytes`).
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class MemoryPoint:
    """Live bytes allocated inside the block after one allocation or free.

    ``label`` names the op or node running then; ``step`` is the backward step it happened in
    (None in forward). ``reserved`` is the CUDA caching allocator's reserved bytes when known.
    ``category`` is what the allocation (or freed allocation) of this point is.
    """

    t_s: float
    live: int
    phase: Phase
    label: str
    step: int | None = None
    module: str | None = None
    reserved: int | None = None
    category: Category = Category.OTHER


@dataclass(frozen=True)
class Peak:
    """Where the peak was: phase, node (for backward) and module."""

    bytes: int
    phase: Phase
    t_s: float = 0.0
    label: str = ""
    node: int | None = None
    module: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Where:
    """Where a recording ran."""

    device: str = "cpu"
    memory_source: str = "off"
    torch_version: str = ""
    rank: int | None = None
    world_size: int | None = None
    hostname: str = ""


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

    nodes: tuple[Node, ...] = ()
    edges: tuple[Edge, ...] = ()
    saved: tuple[SavedTensor, ...] = ()
    steps: tuple[Step, ...] = ()
    timeline: tuple[MemoryPoint, ...] = ()
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

    # ----- derived figures -------------------------------------------------------------
    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive by saved tensors, each storage counted once.

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
        ``backward``, ``forward``). Empty when memory was not measured."""
        held = self.extra.get("held") if isinstance(self.extra, Mapping) else None
        if not isinstance(held, Mapping):
            return {}
        out: dict[str, int] = {}
        try:
            for r in held.get("rows", ()):
                what = r.get("what", "forward")
                if what == "saved" and (r.get("order") or 0) >= 1:
                    what = "saved_order1"
                out[what] = out.get(what, 0) + int(r.get("bytes", 0))
            for what, b in (held.get("omitted_by_kind") or {}).items():
                out[what] = out.get(what, 0) + int(b)
            return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
        except (AttributeError, TypeError, ValueError):  # damaged extra data in a loaded file
            return {}

    @property
    def saved_bytes_at_peak(self) -> int | None:
        """Bytes of saved tensors made inside the block and still alive at the peak (None when
        memory was not measured). Unlike :attr:`saved_bytes`, which counts every save over the
        whole block, this is what the saved tensors cost at the worst moment."""
        held = self.held_at_peak()
        if not held:
            return None
        return held.get("saved", 0) + held.get("saved_order1", 0)

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

    def saved_bytes_by_kind(self) -> dict[str, int]:
        """Saved bytes per kind (activation, parameter, input, buffer), storage-deduplicated."""
        per: dict[str, dict[int, int]] = {}
        for s in self.saved:
            per.setdefault(s.kind.value, {})[s.storage] = s.bytes
        return {k: sum(v.values()) for k, v in sorted(per.items())}

    def order_counts(self) -> dict[int, int]:
        """Number of nodes per order (0 = forward, 1 = created by create_graph, ...)."""
        out: dict[int, int] = {}
        for n in self.nodes:
            out[n.order] = out.get(n.order, 0) + 1
        return dict(sorted(out.items()))

    # ----- views -------------------------------------------------------------------------
    def summary(self, top: int = 5) -> str:
        """Deterministic text: totals, top saved tensors, top modules, peak location."""
        from gradscope.report import summary_text

        return summary_text(self, top=top)

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained HTML page (scripts and data inline, no network). Returns the HTML;
        writes it to ``path`` when given."""
        from gradscope.html import recording_html

        html = recording_html(self)
        if path is not None:
            _atomic_write_text(os.fspath(path), html)
        return html

    def to_dot(self, max_nodes: int = 5000) -> Any:
        """A ``graphviz.Digraph`` of the graph with saved tensors and their bytes."""
        from gradscope.graph import to_dot

        return to_dot(self, max_nodes=max_nodes)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        from gradscope.widget import mimebundle

        return mimebundle(self)

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
            "nodes": _columns(self.nodes, Node),
            "edges": _columns(self.edges, Edge),
            "saved": _columns(self.saved, SavedTensor),
            "steps": _columns(self.steps, Step),
            "timeline": _columns(self.timeline, MemoryPoint),
            "extra": dict(self.extra),
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
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise GradscopeError(
                f"gradscope: recording schema version {schema!r} is not supported by this gradscope "
                f"(it reads version {SCHEMA_VERSION}). Re-record with this version, or load it with "
                "the gradscope version that wrote it."
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
                extra=dict(d.get("extra") or {}),
            )
            _check_links(rec)
            return rec
        except GradscopeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GradscopeError(
                f"gradscope: the recording is damaged ({type(e).__name__}: {e}). "
                "Re-save it from the original session."
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the recording as JSON. Atomic: a crash mid-save leaves any previous file intact."""
        _atomic_write_text(os.fspath(path), self.to_json())


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


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes under 1 KiB. Deterministic."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{int(v)} B" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


# ----- helpers ---------------------------------------------------------------------------
def _atomic_write_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gradscope-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _enum_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in d.items()}


def _columns(rows: Iterable[Any], cls: type) -> dict[str, list[Any]]:
    names = [f.name for f in dataclasses.fields(cls)]
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


_CONVERT: dict[str, Any] = {
    "phase": Phase,
    "kind": Kind,
    "category": Category,
    "shape": lambda v: tuple(int(x) for x in v),
    "leaf_shape": lambda v: None if v is None else tuple(int(x) for x in v),
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


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)
