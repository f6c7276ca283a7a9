"""A CUDA snapshot's diagnosis as text (``str(d)``, ``d.text()``) and as a block of HTML (what a
notebook shows for ``gs.diagnose(gs.load_snapshot(path))``), registered for
:class:`~gradscope._analyses.snapshot.findings.SnapshotDiagnosis` (NOTE [ one registry of views ] in
``gradscope._base.registry``). Text from the file is data: no newline or control character of it reaches
the terminal."""

from __future__ import annotations

from gradscope._analyses.snapshot.findings import SnapshotDiagnosis, _size
from gradscope._analyses.snapshot.roles import TracePass
from gradscope._base.registry import ViewKind, register
from gradscope._model.recording import format_bytes
from gradscope._views.diagnosis_text import text_html

__all__ = ["snapshot_diagnosis_text"]

_MEASURE = ("a snapshot runs nothing: these say what to change and how many bytes it frees; gs.record() and "
            "gs.diagnose() on the step itself run each fix and print its code with the saving measured.")


@register(ViewKind.TEXT, SnapshotDiagnosis)
def snapshot_diagnosis_text(diagnosis: SnapshotDiagnosis) -> str:
    """The report as plain text."""
    title = "gradscope diagnosis" + (f" of {_one_line(diagnosis.label)}" if diagnosis.label else "")
    when = "" if diagnosis.t_s is None else f", {diagnosis.t_s:.3f} s into the trace"
    lines: list[str] = []
    if diagnosis.moment == "oom":
        lines.append(f"{title}: CUDA out of memory on cuda:{diagnosis.device} at trace event {diagnosis.at}{when}")
        req = f"failed request: {_size(diagnosis.request)} on stream {diagnosis.request_stream}"
        if diagnosis.request_line:
            req += f", from {_one_line(diagnosis.request_line)}"
        if diagnosis.device_free is not None:
            req += f"; the device had {_size(diagnosis.device_free)} free"
        lines.append(req)
        moment = "at the OOM"
    elif diagnosis.moment == "peak":
        lines.append(f"{title}: no OOM in this CUDA snapshot of cuda:{diagnosis.device}; state at its peak, "
                     f"trace event {diagnosis.at}{when}")
        moment = "at the peak"
    else:
        lines.append(f"{title}: no allocation in this CUDA snapshot of cuda:{diagnosis.device}; nothing to "
                     "diagnose")
        return "\n".join(lines + [f"note: {n}" for n in diagnosis.notes])
    f = diagnosis.fragmentation
    slack = f.unallocated - f.free_bytes
    lines.append(
        f"{moment}: {_size(diagnosis.allocated)} allocated, {_size(diagnosis.reserved)} reserved by the caching "
        + (f"allocator: {format_bytes(f.free_bytes)} free in {f.free_pieces} "
           f"piece{'s' if f.free_pieces != 1 else ''} (largest {format_bytes(f.largest_free)})"
           if f.free_pieces else "allocator: no free piece")
        + f" across {f.segments} segment{'s' if f.segments != 1 else ''}"
        + (f", {format_bytes(slack)} rounding inside blocks" if slack > 0 else "")
    )
    if not diagnosis.history:
        lines.append("trace: no allocation history (the segments and blocks when the snapshot was taken): "
                     "no passes, no steps, no lifetimes")
    elif diagnosis.steps is not None:
        lines.append(f"trace: {_passes_text(diagnosis.passes)}; {diagnosis.steps.how}")
    if diagnosis.by_role:
        lines.append(f"live {moment} by role:")
        for rb in diagnosis.by_role:
            lines.append(f"  {rb} — {rb.role.how}")
    if diagnosis.by_line:
        lines.append(f"live {moment} by source line:")
        for r in diagnosis.by_line[: diagnosis.top]:
            lines.append(f"  {_one_line(str(r), 200)}")
        rest = diagnosis.by_line[diagnosis.top:]
        if rest:
            n = sum(r.blocks for r in rest)
            lines.append(f"  ({len(rest)} other lines: {format_bytes(sum(r.bytes for r in rest))} in {n} "
                         f"block{'s' if n != 1 else ''})")
    if diagnosis.findings:
        lines.append("findings:")
        for i, fd in enumerate(diagnosis.findings, 1):
            lines.append(f"  {i}. [{fd.pattern}] {_clean(fd.message)}")
            lines.append(f"     suggestion: {_clean(fd.suggestion)}")
        lines.append(f"  ({_MEASURE})")
    else:
        lines.append(f"findings: none: {diagnosis.why_no_finding()}")
    lines.extend(f"note: {_one_line(n, 300)}" for n in diagnosis.notes)
    return "\n".join(lines)


register(ViewKind.HTML, SnapshotDiagnosis)(text_html)

def _passes_text(passes: tuple[TracePass, ...]) -> str:
    if not passes:
        return "no passes (no frames tell forward, backward and optimizer step apart)"
    if len(passes) <= 4:
        return ", ".join(f"{p.kind} events {p.start}-{p.end} (left {format_bytes(p.kept)} alive)" for p in passes)
    kinds: dict[str, int] = {}
    for p in passes:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return f"{len(passes)} passes (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")"

def _clean(text: str) -> str:
    """Text from a file is data: no newlines or control characters reach the terminal."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _one_line(text: str, limit: int = 160) -> str:
    clean = _clean(text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"
