"""The data model: one immutable :class:`Recording` that every view reads.

A recording holds numbers and names, never tensors, so keeping it never keeps memory alive.
It round-trips exactly through JSON (:meth:`Recording.save` / :func:`load`); no pickle. Files of
schema 1 load through :func:`gradscope._model.files._migrate_1_to_2`.

This module is the data model's face: :class:`Recording` (with :class:`Loop`, whose parts are
recordings) and :func:`load` are defined here; the rows of its tables (:mod:`gradscope._model.rows`),
the :class:`Table` that holds them (:mod:`gradscope._model.table`) and the file's helpers
(:mod:`gradscope._model.files`) live in the private package and are named here.

NOTE [ one definition per figure ]: every byte figure a view shows is computed here, by one
method, with a label and a one-line definition in :data:`gradscope.figures.FIGURES` (the one
registry, which names these methods) that views show beside it (tooltips), so
the summary, the widget, the page and the diagnosis cannot disagree on what a number means.
This module imports no view: ``summary``, ``to_html``, ``to_dot`` and ``_repr_mimebundle_`` ask
the view registry (NOTE [ one registry of views ] in ``gradscope._base.registry``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._base.units import format_bytes
from gradscope._model.files import (
    _FORMAT,
    SCHEMA_VERSION,
    _build,
    _columns,
    _enum_safe,
    _extra,
    _held_from_json,
    _int,
    _lines,
    _lines_inside,
    _migrate_1_to_2,
    _opt_int,
    _opt_str,
    _rows,
    atomic_write_text,
    read_json,
)
from gradscope._model.rows import (
    Allocation,
    BackwardCall,
    Category,
    Edge,
    Growth,
    HeldAllocation,
    HeldMemory,
    Iteration,
    Kind,
    MemoryPoint,
    Node,
    OomInfo,
    Peak,
    Phase,
    SavedTensor,
    SourceLine,
    Step,
    Where,
)
from gradscope._model.table import Table

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


@dataclass(frozen=True)
class Loop:
    """A long loop's recording keeps the full detail of some iterations only (see NOTE [ iterations ]
    in :mod:`gradscope._passes.iterations`): the recording's own nodes, saves, steps, timeline and every
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


# NOTE [ one class for the recording ]: Recording is longer than a class should be, and is one piece:
# its dotted name ``gradscope.recording.Recording`` is data (each figure's ``computed_by`` in
# :data:`gradscope.figures.FIGURES` and docs/figures.md, the views declared for it), its methods
# are the figures (NOTE [ one definition per figure ]), each a few lines over the same tables, and
# ``to_dict`` / ``from_dict`` list every field beside the fields themselves (the helpers they use
# are in :mod:`gradscope._model.files`). Split, a figure would move away from its definition.
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
        across iterations ] in :mod:`gradscope._model.growth`): False where it grows, None with fewer than
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
        return str(_views.render(_views.ViewKind.TEXT, self, top=top))  # NOTE [ one registry of views ]

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained HTML page (scripts and data inline, no network). With ``path``,
        writes it there and returns the path (as a cell's last line it shows the file's name, not
        the page); without, returns the page's text."""
        html = str(_views.render(_views.ViewKind.HTML, self))
        if path is None:
            return html
        atomic_write_text(os.fspath(path), html)
        return os.fspath(path)

    def to_dot(self, max_nodes: int = 5000) -> Any:
        """A ``graphviz.Digraph`` of the graph with saved tensors and their bytes."""
        return _views.render(_views.ViewKind.DOT, self, max_nodes=max_nodes)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return _views.display(self)

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
            return _views.typed(rec)  # a saved snapshot loads as its own type (NOTE [ saved types ] in gradscope._base.registry)
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
    return Recording.from_dict(read_json(os.fspath(path)))


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
