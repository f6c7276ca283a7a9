"""The diagnosis as data and text: what held memory, and the findings with their measured fixes."""

from __future__ import annotations

import html
from dataclasses import dataclass

from gradscope.recording import format_bytes

__all__ = ["Diagnosis", "Finding", "GraphHolder", "KIND_NAMES", "LiveTensor"]

KIND_NAMES = {
    "saved": "saved activations",
    "saved_order1": "saved by create_graph graphs (order >= 1)",
    "saved_input": "saved inputs",
    "saved_parameter": "saved parameters",
    "gradient": "gradients",
    "optimizer": "optimizer state",
    "backward": "backward temporaries",
    "forward": "forward results not saved (variables, temporaries)",
}


@dataclass(frozen=True)
class LiveTensor:
    """One allocation alive at the diagnosed moment.

    ``variable`` names a user variable that is this tensor (``model.0.weight.grad``,
    ``opt.state[0]['exp_avg']``); ``via`` a variable whose graphs save it (``losses``); ``line``
    the user's line that made it (``train.py:57 in train_step``; see :attr:`gradscope.Recording.lines`).
    """

    bytes: int
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    module: str | None
    node: str | None
    order: int | None
    variable: str | None
    via: str | None = None
    line: str | None = None


@dataclass(frozen=True)
class GraphHolder:
    """A user variable that keeps autograd graphs alive.

    ``graphs`` counts distinct ``grad_fn`` roots among its tensors; ``saved_bytes`` is what their
    graphs' saved tensors hold (each storage once); ``live_bytes`` the part of it that was
    allocated inside the recording and alive at the diagnosed moment.
    """

    variable: str
    graphs: int
    saved_bytes: int
    live_bytes: int


@dataclass(frozen=True)
class Finding:
    """One pattern found, with its culprit and what to do.

    ``bytes`` is what the culprit held at the diagnosed moment; ``saves_bytes`` the predicted drop
    of the peak if the fix is applied (at a failure: of what was asked for then), negative where a
    fix of the result costs memory (see NOTE [ findings are measured fixes ]); the scenario suite in
    ``tests/scenarios`` holds it within 25 % of the measured saving.
    """

    pattern: str
    bytes: int
    message: str
    suggestion: str
    code: str
    variable: str | None = None
    module: str | None = None
    saves_bytes: int | None = None
    peak_before: int | None = None  # the most memory the step holds at once over two runs of it, on copies of
    # the user's objects as the block started, counting what they hold when it starts (bytes)
    peak_after: int | None = None  # the same with the fix's code
    fits: bool | None = None  # under a budget: whether the step with the fix stays within it
    time_ratio: float | None = None  # the fix's wall time over the step's, on the copies
    tolerance: float | None = None  # results equal up to this relative difference (None: 1e-4)
    ran: bool = True  # False: gradscope could not run a rewriting of the step with this fix (no code, no claim)
    setup: str = ""  # the part of ``code`` run once before the steps (``code`` = setup, then step)
    step: str = ""  # the part of ``code`` that replaces the user's step (empty: all of ``code``)
    uses: tuple[str, ...] = ()  # the user's names the pattern's rewriting of the step applies to
    sketch: str = ""  # not run: the strategy's call in the user's names, kept aside, never printed as code
    compared: str = ""  # how its results were compared with the user's step's, where randomness made it matter
    allocates_before: int | None = None  # under a budget: the most the user's step allocates at once, counted
    # as the budget counts it (see NOTE [ one budget ] in gradscope.diagnose.measure)
    allocates_after: int | None = None  # the same with the fix's code


@dataclass(frozen=True)
class Diagnosis:
    """What held memory at a recording's failing moment (budget or OOM) or at its peak.

    ``text()`` (also ``str()``) is deterministic but for measured wall-time ratios: the same
    recording and namespace give the same text. ``findings`` are sorted by the bytes they explain, largest first. ``budget_resident`` is
    what a notebook's earlier cells held on the simulated device (``%gradscope oom on --budget``).
    """

    label: str
    moment: str
    live_bytes: int
    resident_bytes: int
    budget: int | None
    requested: int | None
    where: str | None
    error: str | None
    by_kind: tuple[tuple[str, int], ...]
    by_module: tuple[tuple[str, int], ...]
    resident: tuple[tuple[str, int], ...]
    largest: tuple[LiveTensor, ...]
    holders: tuple[GraphHolder, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()
    budget_resident: int = 0
    step_peak: int | None = None  # the user's step run twice on copies: the most held at once (see Finding)
    step_resident: int = 0  # of it, what the copies held when the step started
    room: int | None = None  # under a budget: what the step may allocate (see NOTE [ one budget ] in measure)
    step: str = ""  # the user's step as the diagnosis ran it on copies (a function it calls inlined)
    device_budget: bool = False  # the budget counts what the user's variables held (a notebook's --budget)
    resident_by_variable: tuple[tuple[str, int], ...] = ()  # what the user's variables held before the block
    step_allocates: int | None = None  # under a budget: the most the user's step allocates at once on copies

    def text(self) -> str:
        """The report as plain text."""
        lines: list[str] = []
        title = "gradscope diagnosis" + (f" of {self.label}" if self.label else "")
        if self.moment == "failure" and self.budget is not None:
            lines.append(
                f"{title}: out of memory on a simulated {format_bytes(self.budget)} device"
                + (f" in {self.where}" if self.where else "")
                + f": tried to allocate {format_bytes(self.requested)} with {format_bytes(self.live_bytes)} "
                + (f"allocated by the cell and {format_bytes(self.budget_resident)} held by your variables"
                   if self.device_budget else "live")
            )
        elif self.moment == "failure":
            lines.append(f"{title}: the block failed ({self.error}); state at its last allocation")
        elif self.moment == "peak":
            lines.append(f"{title}: state at the peak")
        else:
            lines.append(f"{title}: no memory events were recorded (memory='off'?); graph analysis only")
        held = (f"held: {format_bytes(self.live_bytes)} ({self.live_bytes} bytes) allocated inside the block and "
                "alive then")
        if self.resident_by_variable:
            total = sum(b for _, b in self.resident_by_variable)
            held += (f"; before it, your variables held {format_bytes(total)}: "
                     + ", ".join(f"{k} {format_bytes(b)}" for k, b in self.resident_by_variable))
            if self.budget is not None and self.moment == "failure":
                held += (f" (the cell could allocate the other {format_bytes(self.budget - self.budget_resident)} of "
                         f"the {format_bytes(self.budget)})" if self.device_budget else
                         " (the budget counts only what the block allocates)")
        else:
            held += f"; {format_bytes(self.resident_bytes)} existed before it (parameters, inputs)"
        lines.append(held)
        if self.by_kind:
            lines.append("by kind (allocated inside the block):")
            for k, b in self.by_kind:
                lines.append(f"  {format_bytes(b):>10}  {KIND_NAMES.get(k, k)}")
        if self.by_module:
            lines.append("by module:")
            for m, b in self.by_module:
                lines.append(f"  {format_bytes(b):>10}  {m}")
        if self.largest:
            lines.append("largest tensors:")
            for i, t in enumerate(self.largest, 1):
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
        if self.holders:
            lines.append("graphs kept alive by variables:")
            for h in self.holders:
                lines.append(
                    f"  {h.variable}: {h.graphs} graph{'s' if h.graphs != 1 else ''}, "
                    f"{format_bytes(h.saved_bytes)} of saved tensors ({format_bytes(h.live_bytes)} of it live then)"
                )
        if self.step_peak is not None and self.room is not None and self.step_allocates is not None:
            lines.append(
                f"your step, run on copies of your objects as the block started (as you run it): it allocates up to "
                f"{format_bytes(self.step_allocates)} at once; the {'cell' if self.device_budget else 'block'} may "
                f"allocate {format_bytes(self.room)}"
            )
        elif self.step_peak is not None:
            lines.append(
                f"your step, run on copies of your objects as the block started (as you run it): at most "
                f"{format_bytes(self.step_peak)} held at once ({format_bytes(self.step_resident)} of it held before "
                "it started)"
            )
        if self.findings:
            lines.append("findings:")
            for i, f in enumerate(self.findings, 1):
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
                        bits.append(f"fits the {format_bytes(self.room)}" if f.fits and self.room is not None
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
            lines.append("findings: no known pattern; the largest holders above are where to look.")
        for n in self.notes:
            lines.append("note: " + n)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return "<pre class='gradscope-diagnosis'>" + html.escape(self.text()) + "</pre>"

