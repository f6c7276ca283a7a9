"""The diagnosis as data: what held memory, and the findings with their measured fixes (its text and
HTML are views: :mod:`gradscope._views.diagnosis_text`)."""

from __future__ import annotations

from dataclasses import dataclass

from gradscope._base import registry as _views

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
    # as the budget counts it (see NOTE [ one budget ] in gradscope._analyses.diagnose.measure)
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
    totals_only: bool = False  # the memory source sampled totals, no allocations (memory='cuda' without history)

    def text(self) -> str:
        """The report as plain text (its view: ``gradscope._views.diagnosis_text``)."""
        return str(_views.render(_views.ViewKind.TEXT, self))

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return str(_views.render(_views.ViewKind.HTML, self))

