"""One definition per figure: what each number in the summary, the widget, the page and the
comparison means, written once, with the function that computes it from a :class:`Recording`.

Every view reads its numbers from here, so a module shows the same bytes in the text summary,
the widget's list and tooltip, and the HTML page, each with the same one-line definition.

NOTE [ one definition per figure ]: three different numbers once described "module G.0" (the
widget summed every saved tensor, parameters included; the summary deduplicated them; the
diagnosis counted what was alive at the peak), each without saying so. Each figure is now a
:class:`Figure` (a name, a short label, a one-line definition) plus a pure function over the
recording. Parameters, inputs and buffers existed before the block: a node that saves a weight
makes no new memory, so they never count towards "memory allocated in the block".
This is the only registry: the data model's own figure methods (``Recording.saved_bytes``,
``Recording.node_saved_bytes``, ...) are registered here too, and the text summary, the job and
comparison tables, every payload and the generated figure page read labels and definitions
from :data:`FIGURES`. A label has one meaning everywhere: "saved (total)" is every activation
saved in the block, "saved (all kinds)" every saved tensor, parameters and inputs included.

Example:
    >>> from gradscope.recording import Recording, Node, SavedTensor, Kind
    >>> rec = Recording(nodes=(Node(0, "MmBackward0", module="fc"),),
    ...     saved=(SavedTensor(0, "self", (4, 8), "float32", "cpu", 128, 1, Kind.ACTIVATION, "fc"),
    ...            SavedTensor(0, "mat2", (8, 2), "float32", "cpu", 64, 2, Kind.PARAMETER, "fc", "fc.weight")))
    >>> saved_activations_by_node(rec)
    [128]
    >>> SAVED_ACTIVATIONS.label
    'saved activations'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from gradscope._model.recording import Category, Kind, Recording, SavedTensor

__all__ = [
    "ALIVE_AT_PEAK",
    "BASELINE",
    "CATEGORY_AT_PEAK",
    "CATEGORY_LABELS",
    "DEFINITIONS",
    "FIGURES",
    "FREED",
    "GROWTH",
    "ITERATION_PEAK",
    "ITERATION_SAVED",
    "LINE_ALIVE_AT_PEAK",
    "LINE_SAVED",
    "LOOP_SAVED",
    "MODULE_ALIVE_AT_PEAK",
    "MODULE_SAVED",
    "NODE_SAVED",
    "NODE_SAVED_AT_PEAK",
    "PARAMETERS_SAVED",
    "PEAK",
    "SAVED_ACTIVATIONS",
    "SAVED_ALL",
    "SAVED_AT_PEAK",
    "SAVED_TOTAL",
    "CategorySeries",
    "Figure",
    "figures_payload",
    "freed_bytes_by_step",
    "alive_at_peak_by_module",
    "alive_at_peak_by_node",
    "largest_saved_by_node",
    "memory_by_category",
    "module_prefix",
    "parameters_saved_bytes",
    "peak_index",
    "saved_activation_bytes",
    "saved_activations_by_module",
    "saved_activations_by_node",
    "step_number",
]


@dataclass(frozen=True)
class Figure:
    """A figure the views show: ``name`` (stable key), ``label`` (column or list title; each
    label has one meaning everywhere), a one-line ``definition`` (the tooltip) and the
    ``function`` that computes it from a :class:`Recording` (per module, node, step or line where
    the figure is one: then its further argument, or a dict by that key)."""

    name: str
    label: str
    definition: str
    function: Callable[..., Any] = field(compare=False, repr=False)

    @property
    def computed_by(self) -> str:
        """The dotted name of :attr:`function` (a ``Recording`` attribute for a plain field)."""
        fn = self.function
        if isinstance(fn, attrgetter):
            return "gradscope.recording.Recording." + repr(fn).split("'")[1]
        faces = {__name__: "gradscope.figures", "gradscope._model.recording": "gradscope.recording"}
        module = faces.get(fn.__module__, fn.__module__)  # where users import it
        return f"{module}.{fn.__qualname__}"


# What each band of memory-by-category is; ``baseline`` is the bottom band.
CATEGORY_LABELS: dict[str, str] = {
    "baseline": "parameters and inputs (before the block)",
    Category.ACTIVATION.value: "saved activations",
    Category.CREATE_GRAPH.value: "saved by create_graph nodes",
    Category.GRADIENT.value: "gradients",
    Category.OPTIMIZER.value: "optimizer state",
    Category.BACKWARD_TEMP.value: "backward temporaries",
    Category.OTHER.value: "other (results, temporaries)",
}


def step_number(index: int) -> int:
    """How every view numbers a backward step: from 1 (the data model counts from 0).

    Example:
        >>> step_number(0)
        1
    """
    return index + 1


def module_prefix(module: str | None, depth: int | None) -> str:
    """A module path cut to ``depth`` components (``None``: the whole path); ``"(no module)"``
    for nodes made outside any module.

    Example:
        >>> module_prefix("layers.3.linear1", 2), module_prefix(None, 2)
        ('layers.3', '(no module)')
    """
    if not module:
        return "(no module)"
    if depth is None:
        return module
    return ".".join(module.split(".")[:depth])


def _is_activation(s: SavedTensor) -> bool:
    return s.kind is Kind.ACTIVATION


# ----- saved tensors -------------------------------------------------------------------------
def saved_activation_bytes(rec: Recording) -> int:
    """:data:`SAVED_TOTAL` of a recording: activation storages saved in the block, each once."""
    seen: dict[int, int] = {}
    for s in rec.saved:
        if _is_activation(s):
            seen[s.storage] = s.bytes
    return sum(seen.values())


def parameters_saved_bytes(rec: Recording) -> int:
    """:data:`PARAMETERS_SAVED`: parameter, input and buffer storages saved, each once."""
    seen: dict[int, int] = {}
    for s in rec.saved:
        if not _is_activation(s):
            seen[s.storage] = s.bytes
    return sum(seen.values())


def saved_activations_by_node(rec: Recording) -> list[int]:
    """:data:`SAVED_ACTIVATIONS` per node (index = node id); a storage saved by two nodes
    counts for each of them (each keeps it alive)."""
    per: list[dict[int, int]] = [{} for _ in rec.nodes]
    n = len(per)
    for s in rec.saved:
        if _is_activation(s) and 0 <= s.node < n:
            per[s.node][s.storage] = s.bytes
    return [sum(d.values()) for d in per]


def largest_saved_by_node(rec: Recording) -> list[SavedTensor | None]:
    """Per node, its largest saved activation (ties: more elements, then first saved), or its
    largest saved tensor of any kind when it saved no activation; None when it saved nothing."""
    best: list[SavedTensor | None] = [None] * len(rec.nodes)
    n = len(best)

    def key(s: SavedTensor) -> tuple[int, int, int]:
        numel = 1
        for d in s.shape:
            numel *= d
        return (1 if _is_activation(s) else 0, s.bytes, numel)

    for s in rec.saved:
        if 0 <= s.node < n:
            b = best[s.node]
            if b is None or key(s) > key(b):
                best[s.node] = s
    return best


def saved_activations_by_module(
    rec: Recording, depth: int | None = None, *, groups: Sequence[int] | None = None
) -> dict[str, int]:
    """:data:`SAVED_ACTIVATIONS` per module (storage-deduplicated within the module), largest
    first. ``depth`` folds module paths to that many components (``layers.3``). With ``groups``
    (a group index per node, -1 for none), the result is keyed by group index as text instead,
    each group's saves found through its nodes."""
    per: dict[str, dict[int, int]] = {}
    n = len(rec.nodes)
    for s in rec.saved:
        if not _is_activation(s):
            continue
        if groups is not None:
            if not 0 <= s.node < n or groups[s.node] < 0:
                continue
            key = str(groups[s.node])
        else:
            node_module = rec.nodes[s.node].module if 0 <= s.node < n else None
            key = module_prefix(s.module if s.module is not None else node_module, depth)
        per.setdefault(key, {})[s.storage] = s.bytes
    totals = {m: sum(v.values()) for m, v in per.items()}
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


# ----- alive at the peak ---------------------------------------------------------------------
def _held_rows(rec: Recording) -> tuple[list[Mapping[str, Any]], Mapping[str, Any]] | None:
    held = rec.held.to_dict() if rec.held is not None else None
    if not isinstance(held, Mapping) or not isinstance(held.get("rows"), list):
        return None
    rows = [r for r in held["rows"] if isinstance(r, Mapping) and isinstance(r.get("bytes"), int)]
    return rows, held


def alive_at_peak_by_module(rec: Recording, depth: int | None = None) -> dict[str, int] | None:
    """:data:`ALIVE_AT_PEAK` per module (or per module prefix at ``depth``), largest first; None
    when the recording did not measure what was alive at the peak (``memory="off"``, or no
    allocation events). Allocations made outside any module count as ``"(no module)"``.
    Includes the small allocations the recorder summed by module instead of listing them."""
    got = _held_rows(rec)
    if got is None:
        return None
    rows, held = got
    out: dict[str, int] = {}
    for r in rows:
        m = r.get("module")
        key = module_prefix(m if isinstance(m, str) else None, depth)
        out[key] = out.get(key, 0) + int(r["bytes"])
    omitted = held.get("omitted_by_module")
    if isinstance(omitted, Mapping):
        for m, b in omitted.items():
            if isinstance(b, int):
                key = module_prefix(None if m == "(no module)" else str(m), depth)
                out[key] = out.get(key, 0) + b
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def alive_at_peak_by_node(rec: Recording) -> dict[int, int] | None:
    """Bytes alive at the peak that a node made or saved (a saved tensor counts for the node
    that saved it first; a gradient for its ``AccumulateGrad`` node), by node id; None when not
    measured. Only listed allocations count (the recorder keeps the largest few hundred)."""
    got = _held_rows(rec)
    if got is None:
        return None
    n = len(rec.nodes)
    out: dict[int, int] = {}
    for r in got[0]:
        node = r.get("node")
        if isinstance(node, int) and 0 <= node < n:
            out[node] = out.get(node, 0) + int(r["bytes"])
    return out


# ----- memory by category over time ---------------------------------------------------------
@dataclass(frozen=True)
class CategorySeries:
    """Memory allocated inside the block, split by :class:`Category`, at every timeline point.

    ``values[c][i]`` is the running sum of the changes (``live[i] - live[i-1]``) of the points of
    category ``categories[c]`` up to point ``i``, so at every point the categories add up to
    ``live``. ``categories`` lists those that are ever non-zero, in stacking order. When the
    split cannot be trusted (points were dropped while recording, so one change spans several
    allocations of unknown categories), ``values`` is empty and ``note`` says why; the total is
    still exact.
    """

    categories: tuple[Category, ...]
    values: tuple[tuple[int, ...], ...]
    note: str | None = None

    def at(self, i: int) -> dict[str, int]:
        """The non-zero categories at point ``i``, in stacking order."""
        return {c.value: v[i] for c, v in zip(self.categories, self.values, strict=True) if v[i]}


def memory_by_category(rec: Recording) -> CategorySeries:
    """The stacked series of memory by category (see :class:`CategorySeries`).

    NOTE [ categories from deltas ]: a timeline point is one allocation or free and carries its
    category, so each category's memory is the running sum of its points' changes. A timeline
    thinned while recording (``timeline_dropped > 0``) breaks that: a kept point's change sums
    the dropped events of any category. The split is then not drawn, rather than guessed.
    """
    tl = rec.timeline
    if rec.timeline_dropped > 0:
        return CategorySeries(
            (),
            (),
            f"{rec.timeline_dropped} timeline points were dropped while recording (max_events), so "
            "memory by category is not known; the total is exact",
        )
    order = list(Category)
    index = {c: k for k, c in enumerate(order)}
    running = [0] * len(order)
    cols: list[list[int]] = [[] for _ in order]
    prev = 0
    for p in tl:
        running[index[p.category]] += p.live - prev
        prev = p.live
        for k in range(len(order)):
            cols[k].append(running[k])
    present = [k for k in range(len(order)) if any(cols[k])]
    if any(v < 0 for k in present for v in cols[k]):
        bad = next(order[k].value for k in present if min(cols[k]) < 0)
        return CategorySeries(
            (),
            (),
            f"memory by category is not consistent ({bad} falls below zero: frees were tagged with "
            "another category than their allocations); the total is exact",
        )
    return CategorySeries(tuple(order[k] for k in present), tuple(tuple(cols[k]) for k in present))


def _first_argmax(values: Iterable[int]) -> int:
    best, best_i = None, -1
    for i, v in enumerate(values):
        if best is None or v > best:
            best, best_i = v, i
    return best_i


def peak_index(rec: Recording) -> int:
    """Index of the timeline point at the peak (the first one with the most live bytes), -1
    when there is no timeline."""
    return _first_argmax(p.live for p in rec.timeline)


# ----- the registry ----------------------------------------------------------------------------
def freed_bytes_by_step(rec: Recording) -> list[int]:
    """:data:`FREED` of every backward step (index = step)."""
    return [s.freed_bytes for s in rec.steps]


PEAK = Figure(
    "peak",
    "peak (at once)",
    "the most memory allocated inside the block that was alive at one moment (what existed before "
    "the block, the baseline, is not included)",
    attrgetter("peak_bytes"),
)
BASELINE = Figure(
    "baseline_bytes",
    "baseline",
    "bytes that existed before the block (parameters, buffers, inputs; CUDA: allocated bytes)",
    attrgetter("baseline_bytes"),
)
SAVED_ALL = Figure(
    "saved_bytes",
    "saved (all kinds)",
    "bytes kept alive by every tensor saved for backward over the whole block (activations, "
    "parameters, inputs and buffers), each storage once (for a long loop, over the iterations whose "
    "detail the recording holds; see saved over the loop)",
    attrgetter("saved_bytes"),
)
SAVED_TOTAL = Figure(
    "saved_total",
    "saved (total)",
    "bytes of every activation saved for backward during the whole block, each storage counted "
    "once: a total over time, not what was alive at one moment (see peak)",
    saved_activation_bytes,
)
SAVED_ACTIVATIONS = Figure(
    "saved_activations",
    "saved activations",
    "bytes of tensors saved for backward that were allocated inside the block (activations), each "
    "storage counted once; saved parameters, inputs and buffers existed before the block and are "
    "not counted",
    saved_activations_by_module,
)
PARAMETERS_SAVED = Figure(
    "parameters_saved",
    "parameters and inputs saved",
    "bytes of parameters, inputs and buffers that nodes saved for backward: they existed before "
    "the block, so saving them made no new memory",
    parameters_saved_bytes,
)
SAVED_AT_PEAK = Figure(
    "saved_bytes_at_peak",
    "saved, alive at peak",
    "bytes of saved tensors made inside the block and still alive at the peak",
    attrgetter("saved_bytes_at_peak"),
)
ALIVE_AT_PEAK = Figure(
    "alive_at_peak",
    "alive at peak",
    "bytes allocated inside the block by this module (saved tensors, gradients, temporaries, "
    "results) and still alive at the peak",
    alive_at_peak_by_module,
)
MODULE_SAVED = Figure(
    "module_saved_bytes",
    "saved by the module (all kinds)",
    "bytes saved for backward by this module's nodes, each storage once (whole block)",
    Recording.saved_bytes_by_module,
)
MODULE_ALIVE_AT_PEAK = Figure(
    "module_alive_at_peak",
    "alive at peak (allocation table)",
    "bytes allocated inside the block while this module ran (forward: its ops; backward: its "
    "nodes) and still alive at the peak",
    Recording.bytes_at_peak_by_module,
)
NODE_SAVED = Figure(
    "node_saved_bytes",
    "saved by the node (all kinds)",
    "bytes this node saved for backward, each storage once",
    Recording.node_saved_bytes,
)
NODE_SAVED_AT_PEAK = Figure(
    "node_saved_alive_at_peak",
    "saved by the node, alive at peak",
    "bytes this node saved that were still alive at the peak",
    Recording.node_saved_alive_at_peak,
)
CATEGORY_AT_PEAK = Figure(
    "category_at_peak",
    "at peak, by category",
    "bytes alive at the peak by what they are (activation, create_graph, gradient, optimizer, "
    "backward_temp, other)",
    Recording.bytes_at_peak_by_category,
)
FREED = Figure(
    "freed_bytes",
    "freed at the step",
    "bytes of saved tensors the engine freed when this backward step ended",
    freed_bytes_by_step,
)
LINE_SAVED = Figure(
    "line_saved_bytes",
    "saved by the line (all kinds)",
    "bytes saved for backward by the ops of this line of code, each storage once (whole block)",
    Recording.saved_bytes_by_line,
)
LINE_ALIVE_AT_PEAK = Figure(
    "line_alive_at_peak",
    "alive at peak, by line",
    "bytes allocated inside the block by this line of code (backward: by its nodes' steps) and "
    "still alive at the peak",
    Recording.bytes_at_peak_by_line,
)

def iteration_peaks(rec: Recording) -> list[int | None]:
    """:data:`ITERATION_PEAK` of every iteration of a loop (index = iteration)."""
    return [it.peak_bytes for it in rec.iterations]


def iteration_saved_bytes(rec: Recording) -> list[int]:
    """:data:`ITERATION_SAVED` of every iteration of a loop."""
    return [it.saved_bytes for it in rec.iterations]


def loop_saved_bytes(rec: Recording) -> int:
    """:data:`LOOP_SAVED`: the loop's (``rec.loop``), or the block's where its detail is whole."""
    return rec.loop.saved_bytes if rec.loop is not None else rec.saved_bytes


def growth_by_site(rec: Recording) -> dict[str, float]:
    """:data:`GROWTH` by site (``""``: all memory), bytes per iteration."""
    return {g.site: g.bytes_per_iteration for g in rec.growth}


ITERATION_PEAK = Figure(
    "iteration_peak",
    "peak in the iteration",
    "the most memory allocated inside the block that was alive at one moment during this iteration of "
    "a loop (what earlier iterations made and left alive included)",
    iteration_peaks,
)
ITERATION_SAVED = Figure(
    "iteration_saved",
    "saved in the iteration",
    "bytes kept alive by the tensors this iteration of a loop saved for backward (all kinds), each "
    "storage once",
    iteration_saved_bytes,
)
LOOP_SAVED = Figure(
    "loop_saved_bytes",
    "saved over the loop",
    "bytes kept alive by every tensor saved for backward over all the iterations of a loop, kept in "
    "detail or not, each storage once",
    loop_saved_bytes,
)
GROWTH = Figure(
    "growth",
    "grows by",
    "bytes a line (else a module) adds, per iteration of a loop, to what it made that is still alive "
    "at the end of each iteration, where that rose above every earlier end in at least two iterations "
    "after the first; the same of all memory for the loop as a whole",
    growth_by_site,
)

# NOTE [ one definition per figure ]: the one registry every text, payload, page and table reads.
FIGURES: dict[str, Figure] = {f.name: f for f in (
    PEAK, BASELINE, SAVED_ALL, SAVED_TOTAL, SAVED_ACTIVATIONS, PARAMETERS_SAVED, SAVED_AT_PEAK,
    ALIVE_AT_PEAK, MODULE_SAVED, MODULE_ALIVE_AT_PEAK, NODE_SAVED, NODE_SAVED_AT_PEAK, CATEGORY_AT_PEAK,
    FREED, LINE_SAVED, LINE_ALIVE_AT_PEAK, ITERATION_PEAK, ITERATION_SAVED, LOOP_SAVED, GROWTH,
)}
# name -> definition, for a table or a tooltip that needs only the text
DEFINITIONS: Mapping[str, str] = MappingProxyType({f.name: f.definition for f in FIGURES.values()})


def figures_payload() -> dict[str, dict[str, str]]:
    """The registry as payloads send it: name -> {label, definition}."""
    return {f.name: {"label": f.label, "definition": f.definition} for f in FIGURES.values()}
