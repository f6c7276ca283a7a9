"""What the front end reads: a recording, a loop, a comparison, a snapshot or a job as the JSON
payload the widget and the page draw (the widget itself is :mod:`gradscope._views.widget`).

Example:
    >>> from gradscope.recording import Recording, Node
    >>> payload = recording_payload(Recording(nodes=(Node(0, "SumBackward0"),)))
    >>> payload["summary"]["nodes"]
    1
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from gradscope._analyses.compare import SPREAD_LIMIT, Comparison
from gradscope._analyses.snapshot.data import SnapshotRecording
from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._base.registry import ViewKind, register
from gradscope._base.series import Interner, downsample
from gradscope._model import figures as F
from gradscope._model.job import Job
from gradscope._model.recording import Phase, Recording, format_bytes
from gradscope._views.job_payload import job_payload as _job_payload
from gradscope._views.layout import GraphLayout, layout_levels
from gradscope._views.snapshot_payload import snapshot_payload as _snapshot_payload

__all__ = [
    "LIVE_INTERVAL_S",
    "MAX_ITERATION_POINTS",
    "MAX_TIMELINE_POINTS",
    "PAYLOAD_VERSION",
    "comparison_payload",
    "is_snapshot",
    "iterations_columns",
    "job_payload",
    "loop_payload",
    "payload_json",
    "payload_of",
    "recording_payload",
    "snapshot_payload",
]

MAX_TIMELINE_POINTS = 6000
PAYLOAD_VERSION = 2


# ----- payloads: what the front end reads -----------------------------------------------------
def _shape_text(shape: Sequence[int] | None) -> str | None:
    if shape is None:
        return None
    if len(shape) == 0:
        return "scalar"
    return " × ".join(str(int(d)) for d in shape)


def _line(v: int | None) -> int:
    """A row's line index for the payload: -1 for none."""
    return -1 if v is None else int(v)


def _round_t(v: float | None) -> float | None:
    if v is None:
        return None
    f = float(v)
    return round(f, 7) if math.isfinite(f) else None


# NOTE [ one payload, sent once ]: everything a view draws travels as one JSON string in the
# ``data`` trait: columns instead of row objects, strings interned in one table, coordinates
# rounded to pixels, the timeline thinned to MAX_TIMELINE_POINTS keeping its extremes. A
# 48-layer encoder's graph is about 0.55 MB; state changes (a click, a step) are small traits.
# Every figure comes from gradscope.figures, with its definition (see NOTE [ one definition per
# figure ]), so the widget, the page and the text summary show the same numbers.
@register(ViewKind.PAYLOAD, Recording)
def recording_payload(
    rec: Recording,
    *,
    layout: GraphLayout | None = None,
    collapse: bool | int | str = "auto",
    engine: str = "auto",
    max_timeline_points: int = MAX_TIMELINE_POINTS,
) -> dict[str, Any]:
    """Everything the front end draws for one recording, as compact JSON-ready columns.

    Strings are interned into one table (``strings``); columns hold indexes (-1 for none). The
    timeline is thinned to at most about ``max_timeline_points`` points, keeping the peak.
    ``levels`` holds the graph's layouts, finest first (see NOTE [ levels of detail ]); with
    ``layout`` given, only that one.
    """
    if not isinstance(rec, Recording):
        raise GradscopeError(f"gradscope: expected a Recording, got {type(rec).__name__}.")
    S: Interner[str] = Interner()  # see NOTE [ strings interned in one table ]
    levels = [layout] if layout is not None else layout_levels(rec, collapse=collapse, engine=engine)
    n = len(rec.nodes)
    node_storages: list[dict[int, int]] = [{} for _ in range(n)]
    saved_count = [0] * n
    for s in rec.saved:
        if 0 <= s.node < n:
            node_storages[s.node][s.storage] = s.bytes
            saved_count[s.node] += 1
    largest = F.largest_saved_by_node(rec)
    alive_nodes = F.alive_at_peak_by_node(rec)
    nodes: dict[str, Any] = {
        "name": [S(x.name) for x in rec.nodes],
        "order": [x.order for x in rec.nodes],
        "module": [S(x.module) for x in rec.nodes],
        "leaf": [S(x.leaf) for x in rec.nodes],
        "leaf_shape": [S(_shape_text(x.leaf_shape)) for x in rec.nodes],
        "executed": [x.executed for x in rec.nodes],
        "saved_bytes": [sum(d.values()) for d in node_storages],
        "saved_count": saved_count,
        "act_bytes": F.saved_activations_by_node(rec),
        "largest": [S(None if t is None else _shape_text(t.shape)) for t in largest],
        "largest_kind": [S(None if t is None else t.kind.value) for t in largest],
        "line": [_line(x.line) for x in rec.nodes],
    }
    if alive_nodes is not None:
        nodes["alive"] = [alive_nodes.get(i, 0) for i in range(n)]
    saved = {
        "node": [s.node for s in rec.saved],
        "attribute": [S(s.attribute) for s in rec.saved],
        "shape": [S(_shape_text(s.shape)) for s in rec.saved],
        "dtype": [S(s.dtype) for s in rec.saved],
        "device": [S(s.device) for s in rec.saved],
        "bytes": [s.bytes for s in rec.saved],
        "storage": [s.storage for s in rec.saved],
        "kind": [S(s.kind.value if hasattr(s.kind, "value") else str(s.kind)) for s in rec.saved],
        "module": [S(s.module) for s in rec.saved],
        "name": [S(s.name) for s in rec.saved],
        "freed": [s.freed_at_step for s in rec.saved],
        "line": [_line(s.line) for s in rec.saved],
    }
    steps = {
        "node": [s.node for s in rec.steps],
        "backward": [s.backward for s in rec.steps],
        "start": [_round_t(s.start_s) for s in rec.steps],
        "duration": [_round_t(s.duration_s) for s in rec.steps],
        "live_before": [s.live_before for s in rec.steps],
        "live_after": [s.live_after for s in rec.steps],
        "freed": [s.freed_bytes for s in rec.steps],
    }
    tl = rec.timeline
    keep = downsample([p.live for p in tl], max_timeline_points)  # see NOTE [ downsampling keeps the peak ]
    phase_code = {ph: k for k, ph in enumerate(Phase)}
    cats = F.memory_by_category(rec)
    timeline = {
        "t": [_round_t(tl[i].t_s) for i in keep],
        "live": [tl[i].live for i in keep],
        "phase": [phase_code.get(tl[i].phase, len(phase_code) - 1) for i in keep],
        "label": [S(tl[i].label) for i in keep],
        "module": [S(tl[i].module) for i in keep],
        "step": [tl[i].step for i in keep],
        "line": [_line(tl[i].line) for i in keep],
        # CUDA's reserved bytes, when the recording has them (absent otherwise, to stay small)
        **(
            {"reserved": [tl[i].reserved for i in keep]}
            if any(tl[i].reserved is not None for i in keep)
            else {}
        ),
        "dropped": rec.timeline_dropped + (len(tl) - len(keep)),
        # memory by category at each kept point, computed on the whole timeline first so that
        # thinning keeps every kept value exact (see NOTE [ categories from deltas ])
        "categories": [c.value for c in cats.categories],
        # one category is all of live: not sent twice (the front end uses live)
        "by_category": [] if len(cats.values) == 1 else [[col[i] for i in keep] for col in cats.values],
        "category_note": cats.note,
    }
    peak = None
    if rec.peak is not None:
        p = rec.peak
        peak = {
            "bytes": p.bytes,
            "phase": getattr(p.phase, "value", str(p.phase)),
            "t": _round_t(p.t_s),
            "label": p.label,
            "node": p.node,
            "module": p.module,
            "step": p.step,
        }
    pi = F.peak_index(rec)
    if peak is not None and pi >= 0 and cats.values:
        peak["breakdown"] = cats.at(pi)
    alive_mods = F.alive_at_peak_by_module(rec)
    act_mods = F.saved_activations_by_module(rec)
    names = sorted(
        set(act_mods) | set(alive_mods or {}),
        key=lambda m: (-(alive_mods or {}).get(m, 0), -act_mods.get(m, 0), m),
    )
    modules = {
        "name": [S(m) for m in names],
        "alive_at_peak": None if alive_mods is None else [alive_mods.get(m, 0) for m in names],
        "saved_activations": [act_mods.get(m, 0) for m in names],
    }
    # the user's lines (see NOTE [ where lines come from ] in gradscope._model.lines): the table, and the
    # "by line" figures beside the modules'
    lines = {"label": [S(x.label) for x in rec.lines], "stack": [S(x.format_stack()) for x in rec.lines]}
    saved_lines = rec.saved_bytes_by_line()
    alive_lines = rec.bytes_at_peak_by_line()
    line_ids = sorted(set(saved_lines) | set(alive_lines or {}),
                      key=lambda k: (-(alive_lines or {}).get(k, 0), -saved_lines.get(k, 0), k))
    by_line = {
        "line": line_ids,
        "alive_at_peak": None if alive_lines is None else [alive_lines.get(k, 0) for k in line_ids],
        "saved": [saved_lines.get(k, 0) for k in line_ids],
        "saved_label": F.LINE_SAVED.label,
        "saved_definition": F.LINE_SAVED.definition,
        "alive_label": F.LINE_ALIVE_AT_PEAK.label,
        "alive_definition": F.LINE_ALIVE_AT_PEAK.definition,
    }
    level_payloads = [_level_payload(rec, lay, alive_mods is not None) for lay in levels]
    backward_calls = [{"create_graph": c.create_graph, "retain_graph": c.retain_graph} for c in rec.backward_calls]
    return {
        "version": PAYLOAD_VERSION,
        "kind": "recording",
        "label": rec.label,
        "summary": {
            "nodes": n,
            "edges": len(rec.edges),
            "saved": len(rec.saved),
            "saved_bytes": rec.saved_bytes,
            "saved_activations": F.saved_activation_bytes(rec),
            "parameters_saved": F.parameters_saved_bytes(rec),
            "peak_bytes": rec.peak_bytes,
            "baseline_bytes": rec.baseline_bytes,
            "steps": len(rec.steps),
            "device": rec.where.device,
            "memory": rec.where.measured or bool(rec.timeline),
            "complete": rec.complete,
            "error": rec.error,
        },
        "peak": peak,
        "figures": F.figures_payload(),
        "category_labels": F.CATEGORY_LABELS,
        "phases": [ph.value for ph in Phase],
        "strings": S.table,
        "nodes": nodes,
        "edges": [v for e in rec.edges if 0 <= e.src < n and 0 <= e.dst < n for v in (e.src, e.dst)],
        "saved": saved,
        "steps": steps,
        "backward_calls": backward_calls,
        "timeline": timeline,
        "modules": modules,
        "lines": lines,
        "by_line": by_line,
        "levels": level_payloads,
        "level": 0,
        "loop": loop_payload(rec),
    }


MAX_ITERATION_POINTS = 2000  # the per-iteration chart's points (a long loop's are thinned, its peaks kept)
LIVE_INTERVAL_S = 0.5  # how often a running cell's widget gets the iterations ended since the last time


def iterations_columns(cols: dict[str, list[Any]], limit: int = MAX_ITERATION_POINTS) -> dict[str, list[Any]]:
    """Iteration rows as the front end's chart takes them (``index, duration, peak, start, end,
    saved``; -1 or None: not measured), thinned to about ``limit`` keeping each stretch's highest
    and lowest peak (see NOTE [ downsampling keeps the peak ] in gradscope._base.series)."""
    peak = [(-1 if v is None else v) for v in cols["peak"]]
    keep = downsample(peak, limit) if peak else []
    return {
        "index": [cols["index"][i] for i in keep],
        "duration": [_round_t(cols["duration_s"][i]) for i in keep],
        "peak": [peak[i] for i in keep],
        "start": [(-1 if cols["start"][i] is None else cols["start"][i]) for i in keep],
        "end": [(-1 if cols["end"][i] is None else cols["end"][i]) for i in keep],
        "saved": [cols["saved"][i] for i in keep],
    }


def loop_payload(rec: Recording) -> dict[str, Any] | None:
    """A loop's iterations for the widget's per-iteration memory chart, what grows, and which
    iterations the detail is (None: a block of one iteration)."""
    its = rec.iterations
    if len(its) < 2:
        return None
    cols: dict[str, list[Any]] = {
        "index": list(range(len(its))), "duration_s": [it.duration_s for it in its],
        "peak": [it.peak_bytes for it in its], "start": [it.start_bytes for it in its],
        "end": [it.end_bytes for it in its], "saved": [it.saved_bytes for it in its],
    }
    return {
        "count": len(its),
        "iterations": iterations_columns(cols),
        "growth": [{"site": g.site, "per_iteration": g.bytes_per_iteration, "first": g.first, "last": g.last,
                    "live": g.live_bytes} for g in rec.growth],
        "steady": rec.steady(),
        "detail": list(rec.loop.detail) if rec.loop is not None else [0, len(its) - 1],
        "kept": [it.index for it in its if it.kept] if rec.loop is not None else None,
        "peak_label": F.ITERATION_PEAK.label, "peak_definition": F.ITERATION_PEAK.definition,
        "growth_label": F.GROWTH.label, "growth_definition": F.GROWTH.definition,
    }


def _level_payload(rec: Recording, lay: GraphLayout, measured: bool) -> dict[str, Any]:
    """One level of detail: its layout and, per module box, the same figures as the module list."""
    graph = lay.to_payload()
    groups: Any = graph["groups"]
    groups["key"] = [str(k) for k in groups["key"]]
    act = [0] * len(lay.groups)
    for column in lay.group_columns():  # nested boxes: each box's figure includes its inner boxes
        for g, v in F.saved_activations_by_module(rec, groups=column).items():
            act[int(g)] = v
    groups["act"] = act
    alive = F.alive_at_peak_by_module(rec) if measured and lay.groups else None
    groups["alive"] = None if alive is None else lay.group_totals(alive)
    return graph


def _is_comparison(obj: Any) -> bool:
    return hasattr(obj, "rows") and callable(getattr(obj, "rerun", None))


def _finite(v: Any) -> Any:
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return _finite(a / b)


def comparison_payload(cmp: Any) -> dict[str, Any]:
    """The front end's data for a comparison: one row per candidate and its recording, with
    ratios to the reference, the best value per column, and which rows are stale (measured in an
    earlier round than the newest)."""
    if not _is_comparison(cmp):
        raise GradscopeError(f"gradscope: expected a Comparison (from gs.compare), got {type(cmp).__name__}.")
    reference = getattr(cmp, "reference", None)
    rows_in = list(cmp.rows)
    latest = max((int(getattr(r, "run", 1)) for r in rows_in), default=1)
    ref = next((r for r in rows_in if r.name == reference), None)
    ref_peak = ref.peak_bytes if ref is not None and str(getattr(ref.status, "value", ref.status)) != "raised" else None
    ref_time = ref.time_s if ref is not None else None
    rows = []
    recordings: list[dict[str, Any] | None] = []
    for r in rows_in:
        status = getattr(r.status, "value", r.status)
        rec = getattr(r, "recording", None)
        t_min, t_max = getattr(r, "time_min_s", None), getattr(r, "time_max_s", None)
        spread = t_max / t_min if isinstance(t_min, float) and isinstance(t_max, float) and t_min > 0 else None
        rows.append(
            {
                "name": str(r.name),
                "status": str(status),
                "peak_bytes": r.peak_bytes,
                "saved_bytes": r.saved_bytes,
                "saved_total": F.saved_activation_bytes(rec) if isinstance(rec, Recording) else None,
                "time_s": _finite(r.time_s),
                "time_min_s": _finite(t_min),
                "time_max_s": _finite(t_max),
                "runs": len(getattr(r, "times_s", ()) or ()),
                "spread_too_wide": spread is not None and spread > SPREAD_LIMIT,
                "threads": getattr(r, "threads", None),
                "peak_ratio": _ratio(r.peak_bytes, ref_peak),
                "time_ratio": _ratio(r.time_s, ref_time),
                "max_abs_error": _finite(r.max_abs_error),
                "message": "" if r.message is None else str(r.message),
                "run": int(getattr(r, "run", 1)),
                "stale": int(getattr(r, "run", 1)) < latest,
            }
        )
        recordings.append(recording_payload(rec) if isinstance(rec, Recording) else None)
    best_of = getattr(cmp, "best", None)
    best = best_of() if callable(best_of) else {}
    return {
        "version": PAYLOAD_VERSION,
        "kind": "comparison",
        "reference": None if reference is None else str(reference),
        "repeat": getattr(cmp, "repeat", None),
        "round": latest,
        "best": {k: list(v) for k, v in best.items()},
        "figures": F.figures_payload(),
        "spread_limit": SPREAD_LIMIT,
        "rows": rows,
        "recordings": recordings,
    }


def is_snapshot(obj: Any) -> bool:
    """Whether ``obj`` is a recording made by ``gs.load_snapshot`` (drawn by the snapshot view)."""
    return isinstance(obj, SnapshotRecording)


def snapshot_payload(rec: Recording, **kwargs: Any) -> dict[str, Any]:
    """The front end's data for a CUDA memory snapshot (see NOTE [ a bounded snapshot payload ]
    in ``gradscope._views.snapshot_payload``): memory by frame group over time, the largest live
    blocks at each moment with their stacks, the OOM and the diagnosis."""
    if not is_snapshot(rec):
        raise GradscopeError("gradscope: snapshot_payload takes a recording made by gs.load_snapshot(path).")
    return _snapshot_payload(rec, version=PAYLOAD_VERSION, **kwargs)


def job_payload(job: Job) -> dict[str, Any]:
    """The front end's data for a :class:`~gradscope.job.Job` (``gradscope._views.job_payload.job_payload``,
    with this module's ``recording_payload`` for each rank's graph)."""
    return _job_payload(job, recording_payload=recording_payload, version=PAYLOAD_VERSION)


# The PAYLOAD views, one per result type (NOTE [ one registry of views ] in gradscope._base.registry); each
# takes the result and how to fold a recording's graph (only a recording's own graph is folded: its
# view is recording_payload, above).
@register(ViewKind.PAYLOAD, SnapshotRecording)
def _snapshot_data(rec: SnapshotRecording, *, collapse: bool | int | str = "auto") -> dict[str, Any]:
    return snapshot_payload(rec)


@register(ViewKind.PAYLOAD, Comparison)
def _comparison_data(cmp: Comparison, *, collapse: bool | int | str = "auto") -> dict[str, Any]:
    return comparison_payload(cmp)


@register(ViewKind.PAYLOAD, Job)
def _job_data(job: Job, *, collapse: bool | int | str = "auto") -> dict[str, Any]:
    return job_payload(job)


def payload_of(obj: Any, *, collapse: bool | int | str = "auto") -> dict[str, Any]:
    """The payload of a Recording (a snapshot's own kind for ``gs.load_snapshot``), a Comparison
    or a Job: its PAYLOAD view."""
    if _views.find(ViewKind.PAYLOAD, type(obj)) is None:
        raise GradscopeError(
            f"gradscope: cannot show a {type(obj).__name__}; pass a Recording (rec.recording), a "
            "Comparison (from gs.compare) or a Job (from gs.gather or gs.load_ranks)."
        )
    return dict(_views.render(ViewKind.PAYLOAD, obj, collapse=collapse))


def payload_json(obj: Any, *, collapse: bool | int | str = "auto") -> str:
    """The payload of a Recording, Comparison or Job as compact JSON text."""
    return _json(payload_of(obj, collapse=collapse))


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def _summary_text(obj: Any) -> str:
    try:
        return str(obj.summary())
    except Exception:  # the text report is another module; a widget must still show
        if isinstance(obj, Recording):
            return f"{obj!r}\npeak {format_bytes(obj.peak_bytes)}, saved {format_bytes(obj.saved_bytes)}"
        return repr(obj)
