"""The diagnosis's views: its report as plain text (``str(d)``, ``d.text()``) and as a block of HTML
(what a notebook shows for ``gs.diagnose(...)``), registered for :class:`Diagnosis` (NOTE [ one
registry of views ] in ``gradscope._base.registry``)."""

from __future__ import annotations

import html
from typing import Any

from gradscope._analyses.diagnose.result import KIND_NAMES, Diagnosis
from gradscope._base.registry import ViewKind, register, render
from gradscope._model.recording import format_bytes

__all__ = ["diagnosis_text", "text_html"]


def text_html(result: Any) -> str:
    """A result's text view as a block of preformatted HTML (a diagnosis in a notebook)."""
    return "<pre class='gradscope-diagnosis'>" + html.escape(str(render(ViewKind.TEXT, result))) + "</pre>"


register(ViewKind.HTML, Diagnosis)(text_html)


@register(ViewKind.TEXT, Diagnosis)
def diagnosis_text(diagnosis: Diagnosis) -> str:
    """The report as plain text."""
    lines: list[str] = []
    title = "gradscope diagnosis" + (f" of {diagnosis.label}" if diagnosis.label else "")
    if diagnosis.moment == "failure" and diagnosis.budget is not None:
        lines.append(
            f"{title}: out of memory on a simulated {format_bytes(diagnosis.budget)} device"
            + (f" in {diagnosis.where}" if diagnosis.where else "")
            + f": tried to allocate {format_bytes(diagnosis.requested)} with {format_bytes(diagnosis.live_bytes)} "
            + (f"allocated by the cell and {format_bytes(diagnosis.budget_resident)} held by your variables"
               if diagnosis.device_budget else "live")
        )
    elif diagnosis.moment == "failure":
        lines.append(f"{title}: the block failed ({diagnosis.error}); state at its last allocation")
    elif diagnosis.moment == "peak":
        lines.append(f"{title}: state at the peak")
    elif diagnosis.totals_only:
        lines.append(
            f"{title}: " + (f"the block failed ({diagnosis.error}); " if diagnosis.error else "")
            + "its memory source sampled the allocator's totals, not each allocation, so what was alive then is "
            "not known (record with gs.record(memory='cuda', history=True), as `%gradscope oom on` does); "
            "graph analysis only"
        )
    else:
        lines.append(f"{title}: " + (f"the block failed ({diagnosis.error}); " if diagnosis.error else "")
                     + "no memory events were recorded (memory='off'?); graph analysis only")
    held = (f"held: {format_bytes(diagnosis.live_bytes)} ({diagnosis.live_bytes} bytes) allocated inside the block and "
            "alive then")
    if diagnosis.resident_by_variable:
        total = sum(b for _, b in diagnosis.resident_by_variable)
        held += (f"; before it, your variables held {format_bytes(total)}: "
                 + ", ".join(f"{k} {format_bytes(b)}" for k, b in diagnosis.resident_by_variable))
        if diagnosis.budget is not None and diagnosis.moment == "failure":
            held += (f" (the cell could allocate the other {format_bytes(diagnosis.budget - diagnosis.budget_resident)} of "
                     f"the {format_bytes(diagnosis.budget)})" if diagnosis.device_budget else
                     " (the budget counts only what the block allocates)")
    else:
        held += f"; {format_bytes(diagnosis.resident_bytes)} existed before it (parameters, inputs)"
    if diagnosis.moment != "none":
        lines.append(held)
    elif diagnosis.resident_bytes:
        lines.append(f"before the block: {format_bytes(diagnosis.resident_bytes)} (parameters, inputs)")
    if diagnosis.by_kind:
        lines.append("by kind (allocated inside the block):")
        for k, b in diagnosis.by_kind:
            lines.append(f"  {format_bytes(b):>10}  {KIND_NAMES.get(k, k)}")
    if diagnosis.by_module:
        lines.append("by module:")
        for m, b in diagnosis.by_module:
            lines.append(f"  {format_bytes(b):>10}  {m}")
    if diagnosis.largest:
        lines.append("largest tensors:")
        for i, t in enumerate(diagnosis.largest, 1):
            shape = "" if t.shape is None else " [" + ", ".join(str(d) for d in t.shape) + "]"
            dtype = f" {t.dtype}" if t.dtype else ""
            bits = [f"{KIND_NAMES.get(t.kind, t.kind)}"]
            if t.node:
                bits.append(f"by {t.node}" + (f" (order {t.order})" if t.order else ""))
            if t.module:
                bits.append(f"in {t.module}")
            if t.variable:
                bits.append(f"= {t.variable}")
            elif t.via:
                bits.append(f"(kept by `{t.via}`)")
            if t.line:
                bits.append(f"at {t.line}")
            lines.append(f"  {i}. {format_bytes(t.bytes):>10}{dtype}{shape}  " + " ".join(bits))
    if diagnosis.holders:
        lines.append("graphs kept alive by variables:")
        for h in diagnosis.holders:
            lines.append(
                f"  {h.variable}: {h.graphs} graph{'s' if h.graphs != 1 else ''}, "
                f"{format_bytes(h.saved_bytes)} of saved tensors ({format_bytes(h.live_bytes)} of it live then)"
            )
    if diagnosis.step_peak is not None and diagnosis.room is not None and diagnosis.step_allocates is not None:
        lines.append(
            f"your step, run on copies of your objects as the block started (as you run it): it allocates up to "
            f"{format_bytes(diagnosis.step_allocates)} at once; the {'cell' if diagnosis.device_budget else 'block'} may "
            f"allocate {format_bytes(diagnosis.room)}"
        )
    elif diagnosis.step_peak is not None:
        lines.append(
            f"your step, run on copies of your objects as the block started (as you run it): at most "
            f"{format_bytes(diagnosis.step_peak)} held at once ({format_bytes(diagnosis.step_resident)} of it held before "
            "it started)"
        )
    if diagnosis.findings:
        lines.append("findings:")
        for i, f in enumerate(diagnosis.findings, 1):
            lines.append(f"  {i}. [{f.pattern}] {f.message}")
            lines.append(f"     suggestion: {f.suggestion}")
            if f.saves_bytes is not None:
                lines.append(f"     saves: {format_bytes(f.saves_bytes)} of the peak ({f.saves_bytes} bytes)")
            if not f.ran:
                lines.append("     not run: gradscope could not rewrite your step with it, so it shows no code "
                             "and claims no saving (gs.compare measures strategies on your own functions)")
            if f.allocates_before is not None and f.allocates_after is not None:
                bits = [f"allocates up to {format_bytes(f.allocates_before)} -> {format_bytes(f.allocates_after)}"]
                if f.fits is not None:
                    bits.append(f"fits the {format_bytes(diagnosis.room)}" if f.fits and diagnosis.room is not None
                                else "fits the budget" if f.fits else "still does not fit the budget")
                if f.time_ratio is not None:
                    bits.append(f"time x{f.time_ratio:.2f}")
                if f.tolerance is not None:
                    bits.append(f"results within {f.tolerance:.1e} (relative)")
                lines.append("     measured on the copies: " + ", ".join(bits))
            elif f.peak_before is not None and f.peak_after is not None:
                bits = [f"peak {format_bytes(f.peak_before)} -> {format_bytes(f.peak_after)}"]
                if f.fits is not None:
                    bits.append("fits the budget" if f.fits else "still does not fit the budget")
                if f.time_ratio is not None:
                    bits.append(f"time x{f.time_ratio:.2f}")
                if f.tolerance is not None:
                    bits.append(f"results within {f.tolerance:.1e} (relative)")
                lines.append("     measured on the copies: " + ", ".join(bits))
            if f.compared:
                lines.append(f"     results {f.compared}")
            if f.code:
                lines.append("     code:")
                lines.extend("       " + ln for ln in f.code.rstrip("\n").splitlines())
    else:
        lines.append("findings: no known pattern; the largest holders above are where to look."
                     if diagnosis.moment != "none" else "findings: no known pattern in the graph.")
    for n in diagnosis.notes:
        lines.append("note: " + n)
    return "\n".join(lines)
