"""The text views of a :class:`~gradscope.Recording` (a CUDA snapshot's too) and of a
:class:`~gradscope.compare.Comparison`, exact and deterministic apart from times, and a
recording's graphviz graph; registered for their types (NOTE [ one registry of views ] in
``gradscope._base.registry``): ``rec.summary()``, ``cmp.summary()``, ``rec.to_dot()`` (a
``graphviz.Digraph``: what torchviz's ``make_dot(show_saved=True)`` shows, plus bytes)."""

from __future__ import annotations

from typing import Any

from gradscope._analyses.compare import SPREAD_LIMIT, Comparison, saved_total
from gradscope._analyses.predict.predictor import Prediction
from gradscope._analyses.snapshot.data import SnapshotRecording
from gradscope._analyses.snapshot.frames import group_of
from gradscope._analyses.snapshot.queries import bytes_by_line
from gradscope._base.errors import GradscopeError
from gradscope._base.registry import ViewKind, register
from gradscope._capture.compiled import compiled_bytes_by_module
from gradscope._model.figures import (
    ALIVE_AT_PEAK,
    GROWTH,
    ITERATION_PEAK,
    LINE_SAVED,
    LOOP_SAVED,
    PARAMETERS_SAVED,
    PEAK,
    SAVED_ACTIVATIONS,
    SAVED_TOTAL,
    alive_at_peak_by_module,
    loop_saved_bytes,
    parameters_saved_bytes,
    saved_activation_bytes,
    saved_activations_by_module,
    step_number,
)
from gradscope._model.recording import Kind, Recording, format_bytes

__all__ = ["comparison_text", "snapshot_summary_text", "summary_text"]

_HELD_NAMES = {
    "saved": "saved tensors",
    "saved_order1": "saved by create_graph nodes",
    "gradient": "gradients",
    "backward": "backward temporaries",
    "forward": "forward results and temporaries",
}


def _loop_lines(rec: Recording) -> list[str]:
    """A loop's iterations (see NOTE [ iterations ] in gradscope._passes.iterations): how many, their time,
    whether memory grows, and which iterations the detail below is."""
    its = rec.iterations
    if len(its) < 2:
        return []
    durations = sorted(it.duration_s for it in its)
    saved = loop_saved_bytes(rec)
    lines = [f"  loop: {len(its)} iterations, {1e3 * durations[len(durations) // 2]:.2f} ms each (median), "
             f"{LOOP_SAVED.label} {format_bytes(saved)}"]
    peaks = [(it.peak_bytes, it.index) for it in its if it.peak_bytes is not None]
    if peaks:
        top, at = max(peaks, key=lambda p: (p[0], -p[1]))
        ends = [it.end_bytes for it in its[1:] if it.end_bytes is not None]
        lines.append(f"    highest {ITERATION_PEAK.label}: iteration {at}, {format_bytes(top)} ({top} bytes)")
        steady = rec.steady()
        if steady:
            lines.append(f"    memory at each iteration's end: steady ({format_bytes(min(ends))}"
                         + (f" to {format_bytes(max(ends))}" if max(ends) != min(ends) else "")
                         + " from iteration 1 on)")
        elif steady is None:
            lines.append("    memory growth: fewer than three iterations, not judged")
    for g in rec.growth:
        what = "memory at each iteration's end" if g.site == "" else _one_line(g.site, 90)
        lines.append(f"    {GROWTH.label}: {what}: +{format_bytes(round(g.bytes_per_iteration))} per iteration "
                     f"(iterations {g.first}-{g.last}, +{format_bytes(g.grown_bytes)}), "
                     f"{format_bytes(g.live_bytes)} alive at the end")
    if rec.loop is not None:
        a, b = rec.loop.detail
        kept = ", ".join(f"{p.loop.detail[0]}" + (f"-{p.loop.detail[1]}" if p.loop.detail[1] > p.loop.detail[0] else "")
                         for p in rec.loop.parts if p.loop is not None)
        lines.append(f"    detail below: iteration {a}" + (f"-{b}" if b > a else "")
                     + (f"; also kept: {kept} (rec.recording.loop.parts)" if kept else "")
                     + f"; {format_bytes(rec.loop.carried_bytes)} from earlier iterations alive when it began")
    return lines


def _one_line(text: str, limit: int = 120) -> str:
    """User-supplied names are data: no newlines or control characters reach the terminal."""
    clean = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


@register(ViewKind.TEXT, Recording)
def summary_text(rec: Recording, top: int = 5) -> str:
    """The summary printed by :meth:`Recording.summary` (a snapshot's own for a
    :class:`~gradscope.snapshot.SnapshotRecording`)."""
    if isinstance(rec, SnapshotRecording):
        return snapshot_summary_text(rec, top)
    lines: list[str] = []
    title = f"gradscope recording {_one_line(rec.label)!s}" if rec.label else "gradscope recording"
    if not rec.complete:
        title += " (INCOMPLETE: " + _one_line(rec.error or "stopped early") + ")"
    lines.append(title)
    w = rec.where
    where = f"  device {w.device}, memory source: {w.memory_source}"
    if w.rank is not None:
        where += f", rank {w.rank} of {w.world_size}"
    lines.append(where)
    lines += _loop_lines(rec)
    if not rec.nodes:
        lines.append("  no autograd graph was built inside this block (nothing that requires grad was "
                     "computed); nothing to show.")
    else:
        orders = ", ".join(f"order {k}: {v}" for k, v in rec.order_counts().items())
        lines.append(f"  graph: {len(rec.nodes)} nodes ({orders}), {len(rec.edges)} edges")
        n_storages = len({s.storage for s in rec.saved})
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in rec.saved_bytes_by_kind().items())
        lines.append(
            f"  saved tensors: {len(rec.saved)} in {n_storages} storages, {format_bytes(rec.saved_bytes)} "
            f"({rec.saved_bytes} bytes)" + (f": {kinds}" if kinds else "")
        )
        if rec.saved:
            act_total, params = saved_activation_bytes(rec), parameters_saved_bytes(rec)
            lines.append(
                f"    of which {SAVED_ACTIVATIONS.label} {format_bytes(act_total)} (allocated in the block); "
                f"{PARAMETERS_SAVED.label} {format_bytes(params)} (existed before: no new memory)"
            )
        passes = "pass" if rec.backward_passes == 1 else "passes"
        lines.append(f"  backward: {rec.backward_passes} {passes}, {len(rec.steps)} node steps"
                     + _backward_calls_text(rec))
    lines += _failed_calls_lines(rec)
    if not rec.where.measured:
        lines.append("  memory: not measured (memory='off')")
    else:
        lines.append(
            f"  peak: {format_bytes(rec.peak_bytes)} ({rec.peak_bytes} bytes) allocated inside the block; "
            f"baseline {format_bytes(rec.baseline_bytes)} ({rec.baseline_bytes} bytes) existed before it"
        )
        if rec.peak is not None:
            p = rec.peak
            at = f"  peak at: {p.phase.value}"
            if p.step is not None:
                at += f", step {step_number(p.step)}"
            if p.node is not None and 0 <= p.node < len(rec.nodes):
                at += f", node {p.node} {rec.nodes[p.node].name}"
                made = rec.line_label(rec.nodes[p.node].line)
                if made:
                    at += f" (from {_one_line(made, 100)})"
            if p.label:
                at += f", during {_one_line(p.label, 60)}"
            if p.module:
                at += f", module {_one_line(p.module, 80)}"
            lines.append(at)
        held = rec.held_at_peak()
        if held:
            moment = "at the failure" if rec.held is not None and rec.held.moment == "failure" else "at the peak"
            parts = ", ".join(f"{_HELD_NAMES.get(k, k)} {format_bytes(v)}" for k, v in held.items())
            lines.append(f"  {moment}: {parts}")
        if rec.reserved_peak_bytes is not None:
            lines.append(f"  CUDA reserved peak: {format_bytes(rec.reserved_peak_bytes)}")
    if rec.saved:
        acts = [s for s in rec.saved if s.kind is Kind.ACTIVATION]
        if acts:
            lines.append(f"top saved tensors allocated in the block (activations, of {len(acts)}):")
        else:
            lines.append(f"top saved tensors: none allocated in the block; {len(rec.saved)} saved "
                         "parameters, inputs or buffers")
        ranked = sorted(acts, key=lambda s: (-s.bytes, s.node, s.attribute))
        for i, s in enumerate(ranked[:top], 1):
            node = rec.nodes[s.node].name if 0 <= s.node < len(rec.nodes) else "?"
            shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
            where_m = f"  in {_one_line(s.module, 80)}" if s.module else ""
            name = f" = {_one_line(s.name, 80)}" if s.name else ""
            made = rec.line_label(s.line)
            at = f"  at {_one_line(made, 100)}" if made else ""
            lines.append(
                f"  {i}. {format_bytes(s.bytes):>10}  {s.dtype} {shape}  {s.kind.value}{name}  "
                f"{node}.{s.attribute}{where_m}{at}"
            )
    alive = alive_at_peak_by_module(rec)
    figure, mods = (ALIVE_AT_PEAK, alive) if alive else (SAVED_ACTIVATIONS, saved_activations_by_module(rec))
    if mods:
        lines.append(f"top modules, {figure.label} ({figure.definition}):")
        for i, (m, b) in enumerate(list(mods.items())[:top], 1):
            lines.append(f"  {i}. {format_bytes(b):>10}  {_one_line(m, 100)}")
    by_line = rec.saved_bytes_by_line()
    if by_line:
        lines.append(f"top lines, {LINE_SAVED.label} ({LINE_SAVED.definition}):")
        for i, (k, b) in enumerate(list(by_line.items())[:top], 1):
            lines.append(f"  {i}. {format_bytes(b):>10}  {_one_line(rec.lines[k].label, 120)}")
    compiled = compiled_bytes_by_module(rec)  # see gradscope._capture.compiled
    if compiled:
        lines.append("compiled regions, saved bytes by module (from AOTAutograd's graphs):")
        for i, (m, b) in enumerate(list(compiled.items())[:top], 1):
            lines.append(f"  {i}. {format_bytes(b):>10}  {_one_line(m, 100)}")
    if rec.timeline_dropped:
        lines.append(f"  timeline: {rec.timeline_dropped} points dropped to stay within max_events "
                     "(the peak is exact)")
    for n in rec.notes:
        lines.append("note: " + _one_line(n, 300))
    return "\n".join(lines)


def _backward_calls_text(rec: Recording) -> str:
    """Which backward calls kept their graph (create_graph / retain_graph), e.g. ``; backward 1
    with create_graph=True``."""
    kept = []
    for i, c in enumerate(rec.backward_calls, 1):
        if c.create_graph:
            kept.append(f"backward {i} with create_graph=True")
        elif c.retain_graph:
            kept.append(f"backward {i} with retain_graph=True")
    return ("; " + ", ".join(kept) + " (the graph was kept)") if kept else ""


def _failed_calls_lines(rec: Recording) -> list[str]:
    """One line per backward call that raised, e.g. ``backward 2 (backward) raised in step 3
    (BoomBackward), after steps 1-2: ValueError: boom`` (see NOTE [ a backward that raised ] in
    gradscope._passes.steps)."""
    lines = []

    def node_of(step: int) -> str:
        node = rec.steps[step].node if 0 <= step < len(rec.steps) else -1
        return rec.nodes[node].name if 0 <= node < len(rec.nodes) else "?"

    def span(a: int, b: int) -> str:
        return f"step {step_number(a)}" if a == b else f"steps {step_number(a)}-{step_number(b)}"

    for i, c in enumerate(rec.backward_calls, 1):
        if c.error is None:
            continue
        first, last, failed = c.first_step, c.last_step, c.failed_step
        if first is None or last is None:
            where = " with no step seen"
        elif failed is not None:
            where = f" in step {step_number(failed)} ({node_of(failed)})"
            if failed > first:
                where += ", after " + span(first, failed - 1)
        else:
            where = f" after {span(first, last)} (last seen: {node_of(last)})"
        oom = " [out of memory]" if c.oom else ""
        lines.append(f"  backward {i} ({c.api}) raised{oom}{where}: {_one_line(c.error, 160)}")
    return lines


@register(ViewKind.TEXT, Prediction)
def prediction_text(p: Prediction, top: int = 5) -> str:
    """The summary printed by :meth:`Prediction.summary`: the prediction's verdict, then the
    recording's summary."""
    lines = [f"gradscope prediction for {p.device}:"]
    lines.append(
        f"  exact tensor bytes at the peak: {format_bytes(p.peak_bytes)} ({p.peak_bytes} bytes)"
    )
    if p.allocated_bytes is not None:
        lines.append(
            f"  estimated CUDA allocated peak: {format_bytes(p.allocated_bytes)} "
            f"({p.allocated_bytes} bytes)"
        )
        lines.append(
            f"  estimated CUDA reserved peak: {format_bytes(p.reserved_bytes)} "
            f"({p.reserved_bytes} bytes)"
        )
    if p.budget is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  {verdict} in the budget of {format_bytes(p.budget)} ({p.budget} bytes)")
    for b in p.batches:
        est = "" if b.reserved is None else f", reserved {format_bytes(b.reserved)}"
        fit = "" if b.fits is None else ("  fits" if b.fits else "  too big")
        lines.append(f"  batch {b.batch_size:>6}: tensors {format_bytes(b.peak_bytes)}{est}{fit}")
    if p.batches and p.budget is not None:
        lines.append(f"  largest batch that fits: {p.largest_batch}")
    return "\n".join(lines) + "\n" + summary_text(p, top)


@register(ViewKind.TEXT, SnapshotRecording)
def snapshot_summary_text(rec: SnapshotRecording, top: int = 5) -> str:
    """The summary of a recording made by ``gs.load_snapshot``: allocations over a trace, not a graph."""
    d = rec.data
    title = f"gradscope recording {_one_line(rec.label)}" if rec.label else "gradscope recording"
    if not rec.complete:
        title += " (INCOMPLETE: CUDA out of memory)" if d.oom is not None else (
            " (INCOMPLETE: " + _one_line(rec.error or "stopped early") + ")")
    lines = [title, f"  device {rec.where.device}, memory source: cuda snapshot"]
    span = "" if d.time_us is None or not d.events else f" over {d.t_s(d.events - 1):.3f} s"
    alive = sum(1 for f in d.alloc_free_at if f < 0)
    lines.append(
        f"  a CUDA memory snapshot (torch.cuda.memory._dump_snapshot): {d.events} trace events{span}, "
        f"{d.allocations} allocations ({alive} still alive at its end); no autograd graph: a snapshot "
        "records allocations with their Python frames, not the graph"
    )
    peak = f"  peak: {format_bytes(rec.peak_bytes)} ({rec.peak_bytes} bytes) allocated"
    if d.peak_at >= 0:
        peak += f" at trace event {d.peak_at}"
        if rec.peak is not None and rec.peak.label:
            peak += f" ({_one_line(rec.peak.label, 80)})"
    if rec.reserved_peak_bytes is not None:
        peak += f"; reserved peak {format_bytes(rec.reserved_peak_bytes)}"
    lines.append(peak)
    oom = d.oom
    if oom is not None:
        where = f" from {_one_line(group_of(oom.frames), 80)}" if oom.frames else ""
        free = "" if oom.device_free is None else f", {format_bytes(oom.device_free)} free on the device"
        lines.append(f"  OOM at trace event {oom.at}: tried to allocate {format_bytes(oom.requested)}{where} with "
                     f"{format_bytes(oom.allocated)} allocated, {format_bytes(oom.reserved)} reserved{free}")
    moment = "at the OOM" if oom is not None else "at the peak"
    rows = bytes_by_line(d) if d.default_at >= 0 or d.initial_allocated else ()
    if rows:
        lines.append(f"  live {moment} by source line:")
        lines.extend(f"    {_one_line(str(r), 160)}" for r in rows[:top])
        if len(rows) > top:
            rest = rows[top:]
            lines.append(f"    ({len(rest)} other lines: {format_bytes(sum(r.bytes for r in rest))})")
    lines.append("  gs.diagnose(rec) explains the OOM (or the peak); gs.show(rec) draws memory by line over time "
                 "and the live blocks at any moment")
    for n in rec.notes:
        lines.append("note: " + _one_line(n, 300))
    return "\n".join(lines)


@register(ViewKind.TEXT, Comparison)
def comparison_text(cmp: Comparison) -> str:
    """The comparison as a text table: each candidate's peak, saved bytes and time against the
    reference, the best value of each column starred, then what the columns mean and what to
    distrust (times too spread to trust, rows from an earlier round)."""
    rows = cmp.rows
    ref = next((r for r in rows if r.name == cmp.reference), None)
    ref_peak = ref.peak_bytes if ref is not None and ref.status != "raised" else None
    ref_time = ref.time_s if ref is not None else None
    best = cmp.best()
    stale = cmp.stale()

    def mark(text: str, col: str, name: str) -> str:
        return text + ("*" if name in best[col] else " ")

    header = ["candidate", "status", PEAK.label, "vs ref", SAVED_TOTAL.label, "time (median)", "min-max",
              "vs ref", "max abs error"]
    table = [header]
    for r in rows:
        spread = "-" if r.time_min_s is None or r.time_max_s is None else (
            f"{_fmt_time(r.time_min_s)}-{_fmt_time(r.time_max_s)}"
        )
        table.append(
            [
                r.name + (" (ref)" if r.reference else "") + (" (stale)" if r.name in stale else ""),
                r.status,
                mark(format_bytes(r.peak_bytes), "peak", r.name),
                _ratio(r.peak_bytes, ref_peak),
                mark(format_bytes(saved_total(r)), "saved", r.name),
                mark(_fmt_time(r.time_s), "time", r.name),
                spread,
                _ratio(r.time_s, ref_time),
                "-" if r.max_abs_error is None else f"{r.max_abs_error:.3g}",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    threads = sorted({r.threads for r in rows if r.threads is not None})
    thread_text = "/".join(str(t) for t in threads) if threads else "?"
    lines = [
        f"gs.compare: {len(rows)} candidates, reference {cmp.reference!r}, time = median (min-max) of "
        f"{cmp.repeat} run(s) after a warm-up, {thread_text} torch thread(s)"
    ]
    for i, row in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if any(best.values()):
        lines.append("* best value among the candidates that are ok")
    lines.append(f"{PEAK.label}: {PEAK.definition}")
    lines.append(f"{SAVED_TOTAL.label}: {SAVED_TOTAL.definition}")
    for r in rows:
        spread_r = r.time_spread
        if spread_r is not None and spread_r > SPREAD_LIMIT:
            lines.append(
                f"{r.name}: times vary {spread_r:.1f}x between runs ({_fmt_time(r.time_min_s)} to "
                f"{_fmt_time(r.time_max_s)}): too wide to trust. The machine was probably busy; re-run, "
                "or time with torch.set_num_threads(1)."
            )
    if stale:
        newest = max(r.run for r in rows)
        lines.append(
            f"stale: {', '.join(stale)} measured in an earlier round than run {newest}; "
            "cmp.rerun() re-measures every candidate as one set."
        )
    for r in rows:
        if r.message:
            lines.append(f"{r.name}: {r.message}")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s"


@register(ViewKind.DOT, Recording)
def to_dot(rec: Recording, *, max_nodes: int = 5000) -> Any:
    """A ``graphviz.Digraph`` of the recording: nodes with their saved bytes, saved tensors as
    boxes (what torchviz's ``make_dot(show_saved=True)`` shows, plus bytes)."""
    try:
        import graphviz
    except ImportError:
        raise GradscopeError(
            "gradscope: to_dot needs the 'graphviz' Python package: pip install 'gradscope[notebook]'."
        ) from None
    if len(rec.nodes) > max_nodes:
        raise GradscopeError(
            f"gradscope: {len(rec.nodes)} nodes is too many for a dot drawing (max_nodes={max_nodes}); "
            "use gs.show(rec), which collapses by module, or pass a larger max_nodes."
        )
    dot = graphviz.Digraph(graph_attr={"rankdir": "BT"},
                           node_attr={"shape": "box", "style": "filled", "fontsize": "10"})
    by_node = rec.saved_by_node()
    for n in rec.nodes:
        own = sum(s.bytes for s in by_node.get(n.id, ()))
        text = n.leaf if n.leaf else n.name
        if n.leaf_shape is not None:
            text += "\n" + str(list(n.leaf_shape))
        if own:
            text += f"\nsaved {format_bytes(own)}"
        color = "lightblue" if n.leaf else ("orange" if n.order >= 1 else "lightgrey")
        dot.node(f"n{n.id}", text, fillcolor=color)
        for k, s in enumerate(by_node.get(n.id, ())):
            sid = f"s{n.id}_{k}"
            dot.node(sid, f"{s.attribute}\n{list(s.shape)} {s.dtype}\n{format_bytes(s.bytes)}",
                     fillcolor="orange" if s.kind is Kind.ACTIVATION else "white", shape="note")
            dot.edge(sid, f"n{n.id}", style="dotted", dir="none")
    for e in rec.edges:
        dot.edge(f"n{e.src}", f"n{e.dst}")
    return dot
