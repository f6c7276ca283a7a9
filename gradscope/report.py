"""Text rendering of a :class:`~gradscope.Recording`: exact and deterministic apart from times."""

from __future__ import annotations

from gradscope.recording import Recording, format_bytes

__all__ = ["summary_text"]

_HELD_NAMES = {
    "saved": "saved tensors",
    "saved_order1": "saved by create_graph nodes",
    "gradient": "gradients",
    "backward": "backward temporaries",
    "forward": "forward results and temporaries",
}


def _one_line(text: str, limit: int = 120) -> str:
    """User-supplied names are data: no newlines or control characters reach the terminal."""
    clean = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def summary_text(rec: Recording, top: int = 5) -> str:
    """The summary printed by :meth:`Recording.summary`."""
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
        passes = "pass" if rec.backward_passes == 1 else "passes"
        lines.append(f"  backward: {rec.backward_passes} {passes}, {len(rec.steps)} node steps")
    if rec.where.memory_source == "off":
        lines.append("  memory: not measured (memory='off')")
    else:
        lines.append(
            f"  peak: {format_bytes(rec.peak_bytes)} ({rec.peak_bytes} bytes) allocated inside the block; "
            f"baseline {format_bytes(rec.baseline_bytes)} ({rec.baseline_bytes} bytes) existed before it"
        )
        if rec.peak is not None:
            p = rec.peak
            at = f"  peak at: {p.phase.value}"
            if p.node is not None and 0 <= p.node < len(rec.nodes):
                at += f", node {p.node} {rec.nodes[p.node].name}"
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
        lines.append(f"top saved tensors (of {len(rec.saved)}):")
        ranked = sorted(rec.saved, key=lambda s: (-s.bytes, s.node, s.attribute))
        for i, s in enumerate(ranked[:top], 1):
            node = rec.nodes[s.node].name if 0 <= s.node < len(rec.nodes) else "?"
            shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
            where_m = f"  in {_one_line(s.module, 80)}" if s.module else ""
            name = f" = {_one_line(s.name, 80)}" if s.name else ""
            lines.append(
                f"  {i}. {format_bytes(s.bytes):>10}  {s.dtype} {shape}  {s.kind.value}{name}  "
                f"{node}.{s.attribute}{where_m}"
            )
        mods = rec.saved_bytes_by_module()
        lines.append("top modules by saved bytes:")
        for i, (m, b) in enumerate(list(mods.items())[:top], 1):
            lines.append(f"  {i}. {format_bytes(b):>10}  {_one_line(m, 100)}")
    if rec.timeline_dropped:
        lines.append(f"  timeline: {rec.timeline_dropped} points dropped to stay within max_events "
                     "(the peak is exact)")
    for n in rec.notes:
        lines.append("note: " + _one_line(n, 300))
    return "\n".join(lines)
