"""``gs.diagnose``: who held memory at the failing moment (or the peak), and what to change.

The recording says what was live then (see NOTE [ what is live at the failing moment ] in
``gradscope._held``): saved tensors with their node, module and order; gradients; what backward
made; forward results nobody saved. The user's namespace (by default the caller's variables; the
notebook passes its user namespace) adds what only the live objects know: which variable holds
this recording's graphs, which optimizer owns which state, which models still require grad
outside an optimizer (models are matched by identity, see NOTE [ modules by identity ]). All
recorder data is read through one accessor (see NOTE [ one accessor for what the recording
held ]). Every finding is one fix with what it saves (see NOTE [ findings are measured fixes ]).
Patterns found:

- ``differentiated_cut``: a tensor cut out of the graph by an in-place update under no_grad (the
  block raised "appears to not have been used"): ``hypergradient`` / ``unrolled_params``;
- ``create_graph``: input gradients with ``create_graph=True`` through a frozen model, differentiated
  afterwards with respect to another tensor: ``mixed_grad(..., method="forward_ad")``;
- ``jacobian_rows``: input gradients with ``create_graph=True`` that nothing differentiates:
  ``strategies.jacobian``;
- ``graphs_held``: graphs kept in a variable that no backward uses (``.item()``), or many calls of a
  model summed into one loss (a backward per micro-batch);
- ``many_outputs``: many calls of a model into one loss that couples them: ``many_inputs_backward``;
- ``forward_without_backward``: an evaluation forward whose graph nobody back-propagates: no_grad;
- ``frozen_trainable``: a model in eval mode that no optimizer trains, run with autograd on;
- ``gradients_discarded``: backward ran into a model whose optimizer did not step: detach its output;
- ``penalty_branches``: penalties branching off a trunk, alive together: ``PenaltyBranches``;
- ``retain_graph``: ``retain_graph=True`` whose graphs no later backward reuses;
- ``optimizer_state``: every gradient alive next to Adam's state at the step: step in backward;
- ``micro_batches`` / ``deep_activations``: one large batch (micro-batches; with batch norm,
  checkpointing with the running statistics kept exact).

Example:
    >>> import torch, gradscope as gs
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    >>> xs = [torch.randn(128, 64) for _ in range(50)]
    >>> losses = []
    >>> try:
    ...     with gs.record(budget="1MiB", modules={"model": model}) as rec:
    ...         for x in xs:
    ...             losses.append(model(x).square().mean())
    ... except torch.OutOfMemoryError:
    ...     pass
    >>> d = gs.diagnose(rec.recording)
    >>> d.findings[0].pattern, d.findings[0].code.split("  #")[0]
    ('many_outputs', 'L = many_inputs_backward(model, xs, g, method="two_pass")')
"""

from __future__ import annotations

import copy
import html
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradscope import _compat
from gradscope._names import code_path
from gradscope.errors import GradscopeError
from gradscope.recording import Allocation, BackwardCall, Category, Kind, Phase, Recording, format_bytes

__all__ = ["Diagnosis", "Finding", "GraphHolder", "HeldTensor", "diagnose"]

if TYPE_CHECKING:
    from gradscope._snapshot.diagnose import SnapshotDiagnosis

_MAX_ITEMS = 10_000  # items looked at per container variable
_MAX_NODES = 200_000  # graph nodes walked per variable

_KIND_NAMES = {
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
class HeldTensor:
    """One allocation alive at the diagnosed moment.

    ``variable`` names a user variable that is this tensor (``model.0.weight.grad``,
    ``opt.state[0]['exp_avg']``); ``via`` a variable whose graphs save it (``losses``).
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


@dataclass(frozen=True)
class Diagnosis:
    """What held memory at a recording's failing moment (budget or OOM) or at its peak.

    ``text()`` (also ``str()``) is deterministic: the same recording and namespace give the same
    text. ``findings`` are sorted by the bytes they explain, largest first. ``budget_resident`` is
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
    largest: tuple[HeldTensor, ...]
    holders: tuple[GraphHolder, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()
    budget_resident: int = 0

    def text(self) -> str:
        """The report as plain text."""
        lines: list[str] = []
        title = "gradscope diagnosis" + (f" of {self.label}" if self.label else "")
        if self.moment == "failure" and self.budget is not None:
            lines.append(
                f"{title}: out of memory on a simulated {format_bytes(self.budget)} device"
                + (f" in {self.where}" if self.where else "")
                + f": tried to allocate {format_bytes(self.requested)} with {format_bytes(self.live_bytes)} live"
                + (
                    f" and {format_bytes(self.budget_resident)} resident from earlier cells"
                    if self.budget_resident
                    else ""
                )
            )
        elif self.moment == "failure":
            lines.append(f"{title}: the block failed ({self.error}); state at its last allocation")
        elif self.moment == "peak":
            lines.append(f"{title}: state at the peak")
        else:
            lines.append(f"{title}: no memory events were recorded (memory='off'?); graph analysis only")
        lines.append(
            f"held: {format_bytes(self.live_bytes)} ({self.live_bytes} bytes) allocated inside the block and "
            f"alive then; {format_bytes(self.resident_bytes)} existed before it (parameters, inputs)"
        )
        if self.resident:
            lines.append(
                "resident before the block, from your variables: "
                + ", ".join(f"{k} {format_bytes(b)}" for k, b in self.resident)
            )
        if self.by_kind:
            lines.append("by kind (allocated inside the block):")
            for k, b in self.by_kind:
                lines.append(f"  {format_bytes(b):>10}  {_KIND_NAMES.get(k, k)}")
        if self.by_module:
            lines.append("by module:")
            for m, b in self.by_module:
                lines.append(f"  {format_bytes(b):>10}  {m}")
        if self.largest:
            lines.append("largest tensors:")
            for i, t in enumerate(self.largest, 1):
                shape = "" if t.shape is None else " [" + ", ".join(str(d) for d in t.shape) + "]"
                dtype = f" {t.dtype}" if t.dtype else ""
                bits = [f"{_KIND_NAMES.get(t.kind, t.kind)}"]
                if t.node:
                    bits.append(f"by {t.node}" + (f" (order {t.order})" if t.order else ""))
                if t.module:
                    bits.append(f"in {t.module}")
                if t.variable:
                    bits.append(f"= {t.variable}")
                elif t.via:
                    bits.append(f"(kept by `{t.via}`)")
                lines.append(f"  {i}. {format_bytes(t.bytes):>10}{dtype}{shape}  " + " ".join(bits))
        if self.holders:
            lines.append("graphs kept alive by variables:")
            for h in self.holders:
                lines.append(
                    f"  {h.variable}: {h.graphs} graph{'s' if h.graphs != 1 else ''}, "
                    f"{format_bytes(h.saved_bytes)} of saved tensors ({format_bytes(h.live_bytes)} of it live then)"
                )
        if self.findings:
            lines.append("findings:")
            for i, f in enumerate(self.findings, 1):
                lines.append(f"  {i}. [{f.pattern}] {f.message}")
                lines.append(f"     suggestion: {f.suggestion}")
                if f.saves_bytes is not None:
                    lines.append(f"     saves: {format_bytes(f.saves_bytes)} of the peak ({f.saves_bytes} bytes)")
                if f.code:
                    lines.append(f"     code: {f.code}")
        else:
            lines.append("findings: no known pattern; the largest holders above are where to look.")
        for n in self.notes:
            lines.append("note: " + n)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return "<pre class='gradscope-diagnosis'>" + html.escape(self.text()) + "</pre>"


# ----------------------------------------------------------------------------------------------
def diagnose(
    recording: Recording | Any, namespace: Mapping[str, Any] | None = None, *, top: int = 8
) -> Diagnosis | SnapshotDiagnosis:
    """Say what held memory when a recorded block failed (or at its peak) and what to change.

    Args:
        recording: a :class:`~gradscope.Recording` (or the ``gs.record`` object).
        namespace: variables to look through for lists of losses, optimizers and models (names
            are reported as written there). Default: the caller's globals and locals.
        top: how many modules and tensors to list.

    Returns:
        A :class:`Diagnosis`; ``print(d)`` shows the report. For a CUDA memory snapshot
        (``gs.load_snapshot``) a :class:`~gradscope.snapshot.SnapshotDiagnosis`.

    Raises:
        GradscopeError: when given something that is not a recording.

    Example:
        >>> import torch, gradscope as gs
        >>> w = torch.randn(512, 512, requires_grad=True)
        >>> with gs.record(memory="tracker") as rec:
        ...     (torch.randn(256, 512) @ w).tanh().sum().backward()
        >>> gs.diagnose(rec.recording).moment
        'peak'
    """
    rec = recording
    if not isinstance(rec, Recording):
        rec = getattr(recording, "recording", None)
    if not isinstance(rec, Recording):
        raise GradscopeError(
            f"gradscope: diagnose() takes a Recording (rec.recording after a gs.record block), not "
            f"a {type(recording).__name__}."
        )
    if rec.where.memory_source == "cuda snapshot":  # allocations with frames, no graph
        from gradscope._snapshot.diagnose import diagnose_snapshot

        return diagnose_snapshot(rec, top=top)
    if namespace is None:
        frame = sys._getframe(1)
        namespace = {**frame.f_globals, **frame.f_locals}
    return _Analysis(rec, namespace, top).run()


# ----------------------------------------------------------------------------------------------
# NOTE [ one accessor for what the recording held ]: everything the analysis knows about the
# diagnosed moment comes from `_read`, which turns the recorder's data into the small frozen rows
# below. Today that data is `Recording.held` (the allocations alive at the moment),
# `Recording.backward_calls` and `Recording.oom`, read through their JSON forms; moving to the
# typed allocation table changes only `_read`.
@dataclass(frozen=True)
class _Row:
    """One allocation made inside the block and alive at the diagnosed moment."""

    key: int  # storage key (tracker) or address (allocators), to match the user's live tensors
    bytes: int
    what: str  # "saved" | "gradient" | "backward" | "forward"
    module: str | None = None
    node_name: str | None = None
    order: int = 0
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    saved_kind: str = "activation"  # for saved rows: activation | parameter | input | buffer
    reused: bool = False  # the key was allocated again after the moment: never match it


@dataclass(frozen=True)
class _Call:
    """One backward call made inside the block."""

    api: str  # "backward" | "autograd.grad"
    create_graph: bool
    retain_graph: bool


@dataclass(frozen=True)
class _Held:
    """What `_read` gives the analysis (see NOTE [ one accessor for what the recording held ])."""

    moment: str  # "failure" | "peak" | "none"
    live_bytes: int
    rows: tuple[_Row, ...]
    by_storage: bool  # keys are storage keys (tracker) rather than addresses
    omitted: int  # smaller rows not listed one by one, summed below
    omitted_by_kind: tuple[tuple[str, int], ...]
    omitted_by_module: tuple[tuple[str, int], ...]
    calls: tuple[_Call, ...]
    budget: int | None = None
    requested: int | None = None
    where: str | None = None
    budget_resident: int = 0
    error: str | None = None  # why the recorder could not list live tensors
    caught: bool = False  # the failure was a backward call's, caught inside the block (see `_caught_oom`)


# what gs.MemoryBudgetExceeded says (gradscope.errors): requested, live and budget in bytes, and where
_BUDGET_MESSAGE = re.compile(
    r"\((\d+) bytes\) with .*? \((\d+) bytes\) of a .*? budget \((\d+) bytes\)(?: \(in (.+?)\))?\. Call"
)


def _caught_oom(rec: Recording) -> dict[str, Any] | None:
    """The simulated out-of-memory the first backward call that ran out raised, when the block
    caught it (``except torch.OutOfMemoryError: continue``) and did not fail itself: the
    diagnosis treats it as the block's failure, at the block's peak (the budget refused what would
    have crossed it, so the peak is the most the block held). None otherwise."""
    if rec.oom is not None or rec.error:
        return None
    for c in rec.backward_calls:
        m = _BUDGET_MESSAGE.search(c.error or "") if c.oom else None
        if m is not None:
            return {"requested": int(m[1]), "live": int(m[2]), "budget": int(m[3]), "where": m[4] or ""}
    return None


def _read(rec: Recording) -> _Held:
    """The one place that reads the recorder's data about the diagnosed moment."""
    held = rec.held.to_dict() if rec.held is not None else {}
    caught = _caught_oom(rec)
    oom = rec.oom.to_dict() if rec.oom is not None else caught or {}
    moment = held.get("moment", "none") if "rows" in held else "none"
    if oom:
        moment = "failure"  # even when it failed before anything was allocated
    rows = tuple(
        _Row(
            key=int(r["key"]),
            bytes=int(r["bytes"]),
            what=str(r.get("what", "forward")),
            module=r.get("module"),
            node_name=r.get("node_name"),
            order=int(r.get("order") or 0),
            shape=None if r.get("shape") is None else tuple(int(d) for d in r["shape"]),
            dtype=r.get("dtype"),
            saved_kind=str(r.get("saved_kind") or "activation"),
            reused=bool(r.get("reused")),
        )
        for r in held.get("rows", ())
    )
    calls = tuple(
        _Call(c.api, c.create_graph, c.retain_graph)
        for c in rec.backward_calls
    )
    return _Held(
        moment=moment,
        live_bytes=int(held.get("live_bytes", 0)),
        rows=rows,
        by_storage=held.get("key_kind", "storage") == "storage",
        omitted=int(held.get("omitted", 0)),
        omitted_by_kind=tuple((str(k), int(b)) for k, b in (held.get("omitted_by_kind") or {}).items()),
        omitted_by_module=tuple((str(k), int(b)) for k, b in (held.get("omitted_by_module") or {}).items()),
        calls=calls,
        budget=oom.get("budget"),
        requested=oom.get("requested"),
        where=oom.get("where"),
        budget_resident=int(oom.get("resident", 0)),
        error=held.get("error"),
        caught=caught is not None,
    )


class _Analysis:
    def __init__(self, rec: Recording, namespace: Mapping[str, Any], top: int) -> None:
        self.rec = rec
        self.ns = {k: v for k, v in namespace.items() if isinstance(k, str) and not k.startswith("_")}
        self.top = top
        self.held = _read(rec)
        self.moment = self.held.moment
        self.rows = self.held.rows
        self.by_storage = self.held.by_storage
        self.live = self.held.live_bytes
        self.omitted = self.held.omitted
        self.calls = self.held.calls
        self.notes: list[str] = []
        if self.held.error is not None:
            self.notes.append(f"the recorder could not list live tensors: {self.held.error}")
        if self.held.caught:
            self.notes.append(
                "a backward call ran out of memory and the block caught the error: diagnosed as the "
                "block's failure, with what was live at its peak."
            )

    # ----- namespace ---------------------------------------------------------------------------
    def _key(self, t: torch.Tensor) -> int | None:
        try:
            st = t.untyped_storage()
            if self.by_storage:
                return _compat.storage_key(t)
            return int(st.data_ptr())
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def _namespace_objects(self) -> None:
        self.modules: list[tuple[str, nn.Module]] = []
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self.names: dict[int, str] = {}  # storage key -> the variable path that is this tensor
        self.via: dict[int, str] = {}  # storage key -> the variable whose graphs save it
        self.kind_of_key: dict[int, str] = {}
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, nn.Module):
                self.modules.append((name, v))
            elif isinstance(v, torch.optim.Optimizer):
                self.optimizers.append((name, v))
        self.resident: dict[str, dict[int, int]] = {"parameters": {}, "gradients": {}, "optimizer state": {}}
        self.roots = _root_names(self.rec)
        for name, m in self.modules:
            if name not in self.roots:
                continue  # a model that took no part in this recording (see NOTE [ modules by identity ])
            for t in (*m.parameters(), *m.buffers()):
                k = self._key(t)
                if k is not None:
                    self.resident["parameters"][k] = int(t.untyped_storage().nbytes())
            for pname, p in m.named_parameters():
                if p.grad is not None:
                    k = self._key(p.grad)
                    if k is not None:
                        self.kind_of_key.setdefault(k, "gradient")
                        self.names.setdefault(k, f"{name}.{pname}.grad")
                        self.resident["gradients"][k] = int(p.grad.untyped_storage().nbytes())
        for name, opt in self.optimizers:
            for i, st in enumerate(opt.state.values()):
                if not isinstance(st, Mapping):
                    continue
                for sk, t in st.items():
                    if isinstance(t, torch.Tensor):
                        k = self._key(t)
                        if k is not None:
                            self.kind_of_key[k] = "optimizer"
                            self.names.setdefault(k, f"{name}.state[{i}][{sk!r}]")
                            self.resident["optimizer state"][k] = int(t.untyped_storage().nbytes())

    def _holders(self) -> list[GraphHolder]:
        """Variables whose graphs save tensors this recording allocated and that were alive at the
        diagnosed moment. A variable from an earlier cell holding graphs of its own (``dfdz: 8
        graphs``) is not a holder of this recording: none of its saved storages can be one of
        this block's live allocations, since both would be alive at once under one key."""
        live_keys = {r.key: r.bytes for r in self.rows if not r.reused}
        out: list[GraphHolder] = []
        for name in sorted(self.ns):
            roots = _graph_roots(self.ns[name])
            if not roots:
                continue
            saved = _saved_storages(roots, self._key)
            mine = {k: b for k, b in saved.items() if live_keys.get(k) == b}
            if not mine:
                continue
            for k in mine:
                self.via.setdefault(k, name)
            out.append(GraphHolder(name, len(roots), sum(saved.values()), sum(mine.values())))
        out.sort(key=lambda h: (-h.live_bytes, -h.saved_bytes, h.variable))
        return out

    # ----- analysis ----------------------------------------------------------------------------
    def run(self) -> Diagnosis:
        rec = self.rec
        self._namespace_objects()
        holders = self._holders()
        kinds: dict[str, int] = {}
        modules: dict[str, int] = {}
        held: list[HeldTensor] = []
        for r in self.rows:
            kind = self._kind(r)
            kinds[kind] = kinds.get(kind, 0) + r.bytes
            mod = r.module or "(no module)"
            modules[mod] = modules.get(mod, 0) + r.bytes
            held.append(
                HeldTensor(
                    bytes=r.bytes,
                    kind=kind,
                    shape=r.shape,
                    dtype=r.dtype,
                    module=r.module,
                    node=r.node_name,
                    order=r.order if r.node_name is not None else None,
                    variable=self.names.get(r.key) if self._matchable(r) else None,
                    via=None if r.reused else self.via.get(r.key),
                )
            )
        if self.omitted:
            for k, b in self.held.omitted_by_kind:
                kinds[k] = kinds.get(k, 0) + b
            for m, b in self.held.omitted_by_module:
                modules[m] = modules.get(m, 0) + b
            self.notes.append(
                f"{self.omitted} smaller live tensors are counted by kind and module but "
                "not listed one by one."
            )
        by_kind = tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        inside = {r.key for r in self.rows if not r.reused}
        resident = tuple(
            (k, sum(b for key, b in v.items() if key not in inside)) for k, v in self.resident.items()
        )
        # Only at a failure is everything the variables hold now either older than the block or
        # alive at that moment (nothing ran after it); after a peak, later allocations exist too.
        resident = tuple((k, b) for k, b in resident if b > 0) if self._at_end() else ()
        by_module = tuple(sorted(modules.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top])
        findings = self._findings(holders)
        return Diagnosis(
            label=rec.label,
            moment=self.moment,
            live_bytes=self.live,
            resident_bytes=rec.baseline_bytes,
            budget=self.held.budget,
            requested=self.held.requested,
            where=self.held.where,
            error=rec.error,
            by_kind=by_kind,
            by_module=by_module,
            resident=resident,
            largest=tuple(sorted(held, key=_held_order)[: self.top]),
            holders=tuple(holders[: self.top]),
            findings=tuple(findings),
            notes=tuple(self.notes),
            budget_resident=self.held.budget_resident,
        )

    def _matchable(self, r: _Row) -> bool:
        """Whether a row's key may be matched with the user's live tensors: only at a failure
        (nothing ran after it) and only if the key was not allocated again after the moment.
        After a peak, storages made outside any operator (``torch.tensor``) may reuse a key
        without any event saying so."""
        return self._at_end() and not r.reused

    def _at_end(self) -> bool:
        """Whether the diagnosed moment is where the block ended (a failure it did not catch)."""
        return self.moment == "failure" and not self.held.caught

    def _kind(self, r: _Row) -> str:
        named = self.kind_of_key.get(r.key) if self._matchable(r) else None
        if named is not None:
            return named
        if r.what == "saved":
            if r.order >= 1:
                return "saved_order1"
            return "saved" if r.saved_kind == "activation" else f"saved_{r.saved_kind}"
        return r.what

    # ----- findings -------------------------------------------------------------------------------
    # NOTE [ findings are measured fixes ]: every finding names one fix, in the user's names, and
    # says what it saves (``saves_bytes``): the recording's peak (at a failure: what the refused
    # allocation asked for on top of what was live) minus the fix's predicted peak. The fix's peak
    # is the block's allocation timeline replayed without what the fix removes (see
    # `_replay`), plus, where the fix is a gradscope strategy or another way to run the model,
    # that way's own peak, measured on a copy of the user's model with inputs of the recorded
    # shapes (see `_measure`). A fix whose predicted saving is under a tenth of the peak is not
    # suggested. Advice that would change the result is never given: a model whose gradients
    # were accumulated, or that a create_graph gradient is taken through, is never frozen or run
    # under no_grad; values a later backward differentiates are never turned into numbers; a
    # model with batch-norm statistics is checkpointed only with its statistics kept exact.
    def _findings(self, holders: list[GraphHolder]) -> list[Finding]:
        self.g = _Facts(self.rec)
        self.holders = holders
        self.demand = self._demand()
        cut = self._cut_by_inplace_update()
        if cut:
            return cut  # the block raised for a reason no memory advice addresses
        out: list[Finding] = []
        out += self._second_derivatives()
        out += self._jacobian_rows()
        out += self._graphs_nobody_differentiates(holders)
        out += self._forward_kept_for_nothing(holders)
        out += self._many_calls(holders)
        out += self._untrained_model()
        out += self._gradients_discarded()
        out += self._penalty_branches()
        out += self._retained_graphs()
        out += self._optimizer_state()
        out += self._one_large_call()
        out = [f for f in out if f.saves_bytes is None or f.saves_bytes >= self._worth()]
        out.sort(key=lambda f: (-(f.saves_bytes or 0), -f.bytes, f.pattern))
        # one fix per model: the one that saves the most (a model run under no_grad needs no
        # micro-batches; graphs nobody differentiates are one finding, not two)
        seen: set[str] = set()
        kept: list[Finding] = []
        for f in out:
            if f.module is not None and f.module in seen:
                continue
            if f.module is not None:
                seen.add(f.module)
            kept.append(f)
        return kept

    def _demand(self) -> int:
        """What the block asked for at the diagnosed moment: its peak, or at a failure what was
        live plus the refused request."""
        if self.moment == "failure" and self.held.requested is not None:
            return self.live + int(self.held.requested)
        return max(self.rec.peak_bytes, self.live)

    def _without_model_run(self, root: str | None) -> int:
        """The peak replayed without the model's run (forward, backward, gradients): what a fix
        that runs the model another way keeps of the block."""
        return _replay(self.rec.allocations, lambda a: a.category in _GRAPH_CATEGORIES
                       or a.category is Category.GRADIENT or (root is not None and self.g.alloc_root(a) == root))

    def _worth(self) -> float:
        """The least saving worth a finding: a tenth of the peak, or at a failure under a budget
        whatever makes the block fit."""
        least = _MIN_SAVING * self.demand
        if self.moment == "failure" and self.held.budget is not None:
            over = self.demand + self.held.budget_resident - int(self.held.budget)
            least = min(least, max(over, 1))
        return least

    def _raised(self) -> bool:
        """Whether the block raised for another reason than running out of memory."""
        return bool(self.rec.error) and self.rec.oom is None and "out of memory" not in (self.rec.error or "").lower()

    def _saving(self, fix_peak: int | None) -> int | None:
        return None if fix_peak is None else self.demand - fix_peak

    # ----- namespace helpers ---------------------------------------------------------------------
    def _module(self, root: str | None) -> nn.Module | None:
        """The user's model that the recording calls ``root`` (see NOTE [ modules by identity ])."""
        return next((m for n, m in self.modules if n == root), None) if root else None

    def _model_name(self, root: str | None) -> str:
        if root and root.isidentifier():
            return root
        return "model"

    def _trained_by_optimizer(self, m: nn.Module) -> bool | None:
        """Whether an optimizer among the user's variables trains ``m`` (None: none is known)."""
        if not self.optimizers:
            return None
        ids = {id(p) for _, o in self.optimizers for grp in o.param_groups for p in grp["params"]}
        return any(id(p) in ids for p in m.parameters())

    def _tensor_list(self, n: int, shapes: set[tuple[int, ...]]) -> str | None:
        """The user's list of input tensors for ``n`` calls of a model (its items' shape among
        ``shapes``, the model's recorded inputs), by name."""
        best: tuple[int, str] | None = None
        for name in sorted(self.ns):
            v = self.ns[name]
            if not isinstance(v, list | tuple) or len(v) < 2 or not all(isinstance(t, torch.Tensor) for t in v[:64]):
                continue
            if any(t.requires_grad for t in v[:64]):
                continue
            score = (2 if tuple(v[0].shape) in shapes else 0) + (1 if len(v) == n else 0)
            if score and (best is None or score > best[0]):
                best = (score, name)
        return best[1] if best else None

    def _tensor_named(self, shape: tuple[int, ...] | None, *, requires_grad: bool | None = None) -> str | None:
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, torch.Tensor) and (shape is None or tuple(v.shape) == shape):
                if requires_grad is None or v.requires_grad == requires_grad:
                    return name
        return None

    # ----- the block raised: a differentiated tensor cut out of the graph ---------------------------
    def _cut_by_inplace_update(self) -> list[Finding]:
        """Seed 002: parameters updated in place under no_grad (``p.copy_(p - lr * p.grad)``, what
        ``optimizer.step()`` does) after a create_graph backward: the update is not in the graph,
        so what the inner gradients depended on (``A``) is cut out of the validation loss, and
        ``autograd.grad`` raises "... appears to not have been used in the graph"."""
        err = self.rec.error or ""
        if "not have been used in the graph" not in err:
            return []
        g = self.g
        inner = [c for c in g.calls if c.create_graph and g.param_inputs(c)]
        if not inner:
            return []
        root = _top(g.leaf_name(inner[0].accumulated[0] if inner[0].accumulated else inner[0].inputs[0]))
        model = self._module(root)
        name = self._model_name(root)
        last = g.calls[-1]
        leaf_shape = g.nodes[last.inputs[0]].leaf_shape if last.inputs else None
        target = self._tensor_named(tuple(leaf_shape) if leaf_shape else None, requires_grad=True) or "A"
        steps = len(inner)
        fix_peak = None
        if model is not None and leaf_shape is not None:
            x_shape = g.input_shape(root)
            if x_shape is not None:
                fix_peak = _measure(_hypergradient_proxy(tuple(leaf_shape), x_shape, steps), model)
        saving = self._saving(fix_peak)
        cost = "" if saving is None else (
            f"; the unrolled steps keep their graphs, so this costs {format_bytes(-saving)} more at the "
            "peak" if saving < 0 else f"; it peaks {format_bytes(saving)} lower")
        return [
            Finding(
                pattern="differentiated_cut",
                bytes=0,
                variable=target,
                module=root,
                message=(
                    f"`{target}` was cut out of the graph: {steps} backward call{'s' if steps != 1 else ''} with "
                    f"create_graph=True computed {name}'s gradients, and the update of {name}'s parameters "
                    "ran in place under torch.no_grad(), which autograd does not record; the loss after "
                    f"the update no longer depends on `{target}` (allow_unused=True would only return None)"
                ),
                suggestion=(
                    f"unroll the updates out of place so that each step's parameters are a function of "
                    f"`{target}`: gradscope.strategies.hypergradient (or unrolled_params for the "
                    f"parameters themselves) runs {name} with torch.func.functional_call{cost}"
                ),
                code=(
                    f"A_grad = hypergradient({name}, {target}, train_loss, val_loss, steps={steps}, "
                    'optimizer="sgd", lr=lr)  # train_loss(p) / val_loss(p): torch.func.functional_call('
                    f"{name}, p, (x,))"
                ).replace("A_grad", f"{target}_grad" if target.isidentifier() else "A_grad"),
                saves_bytes=saving,
            )
        ]

    # ----- create_graph through a frozen model: forward AD ------------------------------------------
    def _second_derivatives(self) -> list[Finding]:
        """Seed 000: input gradients taken with create_graph=True through a model with no trainable
        parameters (or whose parameters no call differentiates and no optimizer steps), then differentiated with respect to another tensor: a mixed second derivative,
        which forward AD computes without keeping any graph of the model. Not when the
        create_graph graph trains parameters (a gradient penalty) or is taken with respect to
        parameters (an unrolled inner loop): there create_graph is the point."""
        g = self.g
        cg = [c for c in g.calls if c.create_graph]
        if not cg or any(g.param_inputs(c) or c.api != "autograd.grad" for c in cg):
            return []
        later = [c for c in g.calls if not c.create_graph and c.index > cg[0].index]
        asked = {i for c in cg for i in c.inputs}
        asked_shapes = {g.nodes[i].leaf_shape for i in asked}
        others = [i for i, n in enumerate(g.nodes)  # (an input of a pass still running is not one)
                  if n.name == "AccumulateGrad" and n.leaf == "input" and i not in asked
                  and n.leaf_shape not in asked_shapes]
        if later:
            wrt = [*later[-1].inputs, *later[-1].accumulated]
            if any(g.param_inputs(c) for c in later) or not g.order1_executed() or not wrt:
                return []  # (a later backward that trains parameters through them: a penalty)
            y = g.nodes[wrt[0]].leaf_shape
        elif self.moment == "failure" and len(others) == 1:
            # failed before the outer derivative: another leaf that requires grad feeds the
            # create_graph gradients (y of d/dy <v, df/dz>)
            y = g.nodes[others[0]].leaf_shape
        else:
            return []
        root = g.main_root(order=0)
        if root is None:
            return []
        model = self._module(root)
        name = self._model_name(root)
        # a model left trainable counts as frozen where the outer derivative was taken, no call
        # differentiated its parameters and no optimizer trains it (at a failure before the outer
        # derivative, a later backward may still train it: a gradient penalty)
        unused = g.trainable(root) and bool(later)
        if g.trainable(root) and (not unused or root in g.differentiated_roots()
                                  or (model is not None and self._trained_by_optimizer(model))):
            return []
        z = g.nodes[cg[0].inputs[0]].leaf_shape if cg[0].inputs else None
        if z is None or y is None:
            return []
        n = len(cg)
        saving: int | None = None
        fix_peak = 0
        if model is not None:
            rest = _replay(self.rec.allocations, lambda a: a.category in _GRAPH_CATEGORIES)
            own = _measure(_mixed_grad_proxy(tuple(z), tuple(y)), model)
            if own is None:
                return []
            # the stand-in f is a sum; the user's f carries a tangent next to each primal it saved
            f_saved = sum(a.bytes for a in g.alive if a.category is Category.ACTIVATION and a.module is None)
            fix_peak = rest + own + 2 * f_saved // n
            saving = self._saving(fix_peak)
        if saving is not None and saving < _MIN_SAVING * self.demand:
            self.notes.append(
                f"forward AD (gradscope.strategies.mixed_grad(..., method=\"forward_ad\")) would not help here: "
                f"it peaks at {format_bytes(fix_peak)} against create_graph's {format_bytes(self.demand)} "
                f"({n} create_graph pass{'es' if n != 1 else ''}; forward AD through a linear layer makes a "
                "weight-sized temporary, which pays off only over several passes)"
            )
            return []
        zname = self._tensor_list(n, {tuple(z)}) if n > 1 else None
        yname = self._tensor_named(tuple(y), requires_grad=True) or "y"
        held = sum(a.bytes for a in g.alive if a.category in (Category.ACTIVATION, Category.CREATE_GRAPH))
        loop = f"for i, z in enumerate({zname})" if zname else "for i, z in enumerate(zs)"
        return [
            Finding(
                pattern="create_graph",
                bytes=held,
                variable=next((h.variable for h in self.holders if h.live_bytes > 0), None),
                module=root,
                message=(
                    f"{n} autograd.grad call{'s' if n != 1 else ''} with create_graph=True through {name} "
                    f"(no parameter of it is trained) keep {name}'s activations and the graphs they built: "
                    f"{format_bytes(held)} at the peak, for a derivative taken afterwards with respect to "
                    f"`{yname}`: a mixed second derivative"
                    + (f"; {name}'s parameters require grad but nothing uses their gradients, so freezing "
                       f"{name} ({name}.requires_grad_(False)) is safe and forward AD applies" if unused else "")
                ),
                suggestion=(
                    f"push the direction through {name} as a forward-AD tangent instead: no graph of {name} "
                    + (f"is kept (predicted peak {format_bytes(fix_peak)})" if saving is not None else
                       f"is kept (what it saves is not predicted: {name} is not among the variables given; "
                       "forward AD pays off only over several passes)")
                    + "; with a loss g(dfdz) over the input gradients, take v = dg/d(dfdz) once from their values"
                ),
                code=(
                    f'dgdy = sum(mixed_grad(f, {name}, z, {yname}, v=v[i], method="forward_ad") {loop})'
                    "  # v = dg/d(dfdz) from the values of dfdz"
                ),
                saves_bytes=saving,
            )
        ]

    # ----- Jacobians row by row with create_graph, read only ------------------------------------------
    def _jacobian_rows(self) -> list[Finding]:
        """Seed 004: input gradients taken with create_graph=True that nothing differentiates
        afterwards (their graphs' nodes never ran): a Jacobian read as numbers. The graphs were
        kept for nothing; ``strategies.jacobian`` with the mode that fits the shape keeps none."""
        g = self.g
        cg = [c for c in g.calls if c.create_graph]
        if not cg or g.order1_executed() or self._raised():
            return []
        if any(c.api != "autograd.grad" or g.param_inputs(c) or len(c.inputs) != 1 for c in cg):
            return []
        if len({c.inputs[0] for c in cg}) != 1:
            return []
        shape = g.nodes[cg[0].inputs[0]].leaf_shape
        root = g.main_root(order=0)
        model = self._module(root)
        if shape is None or model is None or self._trained_by_optimizer(model):
            return []  # an optimizer trains it: the input gradients are a penalty that trains it
        if self.moment == "failure" and any(
                n.name == "AccumulateGrad" and n.leaf == "input" and i != cg[0].inputs[0]
                for i, n in enumerate(g.nodes)):
            return []  # another leaf feeds them: a derivative with respect to it may follow
        if len(cg) > 1:  # one row per call
            n_out, n_in = len(cg), _numel(tuple(shape))
        else:  # the repeat trick: copies of x along the first dimension
            n_out, n_in = int(shape[0]), _numel(tuple(shape[1:]))
        method = "jacfwd" if n_out >= n_in else "jacrev"
        name = self._model_name(root)
        in_shape = tuple(shape) if len(cg) > 1 else tuple(shape[1:])
        x = self._tensor_named(in_shape) or "x"
        own = _measure(_jacobian_proxy(n_in, method), model)
        if own is None:
            return []
        saving = self._saving(g.live_before(root) + own)  # the strategy replaces the whole computation
        held = sum(a.bytes for a in g.alive if a.category in _GRAPH_CATEGORIES)
        shape_word = "tall" if method == "jacfwd" else "wide"
        return [
            Finding(
                pattern="jacobian_rows",
                bytes=held,
                module=root,
                message=(
                    f"{len(cg)} autograd.grad call{'s' if len(cg) != 1 else ''} with create_graph=True took "
                    f"{name}'s input gradients ({n_out} outputs x {n_in} inputs) and nothing differentiated "
                    f"them afterwards: their graphs hold {format_bytes(held)} at the peak for nothing"
                ),
                suggestion=(
                    f"the Jacobian is only read: compute it without keeping graphs, in {('forward' if method == 'jacfwd' else 'reverse')} "
                    f"mode for this {shape_word} Jacobian (gradscope.strategies.jacobian); or drop create_graph=True"
                ),
                code=(
                    f'J = jacobian(lambda v: {name}(v.view(1, -1)).view(-1), {x}.reshape(-1), method="{method}")'
                    f"  # {n_out} x {n_in}: {shape_word}"
                ),
                saves_bytes=saving,
            )
        ]

    # ----- graphs that nothing differentiates -------------------------------------------------------
    def _graphs_nobody_differentiates(self, holders: list[GraphHolder]) -> list[Finding]:
        """Losses (or outputs) kept with their graphs where no backward ran: an evaluation loop.
        At a failure only when the model is in eval() mode (a training loop's losses may still be
        back-propagated, see `_many_calls`)."""
        g = self.g
        if g.calls:
            return []
        root = g.main_root(order=0)
        model = self._module(root)
        if self.moment == "failure" and (model is None or model.training):
            return []
        out: list[Finding] = []
        # Without a backward the recorder may never have walked these graphs (they were dropped
        # before the block ended): what the model made is what the graphs kept.
        saved = sum(a.bytes for a in g.alive if a.node is not None or (root and g.alloc_root(a) == root))
        if saved <= 0 or model is None:
            return []
        for var, graphs in self._graph_lists(holders):
            fix_peak = _replay(self.rec.allocations, free_at=g.released_early(
                lambda a: a.node is not None or g.alloc_root(a) == root))
            name = self._model_name(root)
            out.append(
                Finding(
                    pattern="graphs_held",
                    bytes=saved,
                    variable=var,
                    module=root,
                    message=(
                        f"`{var}` holds {graphs} graphs and nothing here differentiates them: their "
                        f"saved tensors are {format_bytes(saved)} of the {format_bytes(self.live)} live"
                    ),
                    suggestion=(
                        f"keep numbers in `{var}` (loss.item()), or run the loop under torch.no_grad() "
                        f"so that {name} saves nothing for a backward that never comes"
                    ),
                    code=f"{var}.append(loss.item())  # or the loop under torch.no_grad()",
                    saves_bytes=self._saving(fix_peak),
                )
            )
            break
        return out

    def _graph_lists(self, holders: list[GraphHolder]) -> list[tuple[str, int]]:
        """The user's variables holding two or more graphs: the holders found by their saved
        storages, else lists whose tensors carry graphs."""
        out = [(h.variable, h.graphs) for h in holders if h.graphs >= 2 and h.live_bytes > 0]
        if out:
            return out
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, list | tuple) and len(_graph_roots(v)) >= 2:
                out.append((name, len(_graph_roots(v))))
        return out

    def _forward_kept_for_nothing(self, holders: list[GraphHolder]) -> list[Finding]:
        """A forward (evaluation) whose graph no backward ran through, kept alive by a variable
        while a training step runs: that forward belongs under torch.no_grad(). The model itself
        is trained (its gradients were accumulated), so it is never frozen."""
        g = self.g
        if any(c.create_graph for c in g.calls) or self._raised():
            return []
        if self.moment == "failure":
            # Nothing is known yet of the backward to come: a forward of a model in eval() mode
            # that an optimizer trains is an evaluation, whose graph nobody will use.
            root = g.main_root(order=0)
            model = self._module(root)
            if model is None or model.training or self._trained_by_optimizer(model) is not True:
                return []
            dead = {i for i in g.never_run_saving_nodes() if g.top[i] == root}
            if not dead:
                dead = {a.node for a in g.alive if a.node is not None}
        elif not g.calls:
            return []
        else:
            dead = g.never_run_saving_nodes()
        if not dead:
            return []
        dead_alive = sum(a.bytes for a in g.alive if a.node in dead)
        if dead_alive <= 0:
            return []
        roots = {g.top[i] for i in dead if g.top[i]}
        if len(roots) != 1:
            return []
        root = roots.pop()
        holder = next((h for h in holders if h.graphs >= 1 and h.live_bytes > 0), None)
        var = holder.variable if holder else "out"
        name = self._model_name(root)
        fix_peak = _replay(self.rec.allocations, free_at=g.released_early(lambda a: a.node in dead))
        return [
            Finding(
                pattern="forward_without_backward",
                bytes=dead_alive,
                variable=var,
                module=root,
                message=(
                    f"a forward of {name} kept its graph ({format_bytes(dead_alive)} saved) but no backward "
                    f"ever ran through it; `{var}` keeps it alive while the training step runs"
                ),
                suggestion=(
                    f"run that forward under torch.no_grad() ({name} itself is trained here: keep its "
                    "requires_grad)"
                ),
                code=f"with torch.no_grad():\n    {var} = {name}(...)   # the forward nothing back-propagates",
                saves_bytes=self._saving(fix_peak),
            )
        ]

    # ----- one model called on many inputs, one loss --------------------------------------------------
    def _many_calls(self, holders: list[GraphHolder]) -> list[Finding]:
        """Seed 001 and gradient accumulation: one model called on many inputs whose graphs are all
        alive at once. When the loss is a sum or mean of per-input terms, a backward per
        micro-batch gives the same gradients and frees each graph at once; when it couples the
        outputs (a variance, a logsumexp), ``many_inputs_backward(method="two_pass")`` keeps one
        graph at a time (with batch norm and dropout exact). At a failure before the loss was
        formed the coupling is unknown: two_pass is right either way."""
        g = self.g
        if any(c.create_graph for c in g.calls) or self._raised():
            return []
        if not g.calls and self.moment != "failure":
            return []  # see `_graphs_nobody_differentiates`
        root = g.main_root(order=0)
        model = self._module(root)
        if model is None:
            return []
        n, entries = g.calls_of(root)
        if n < 2:
            return []
        if not g.calls and not model.training:
            return []
        acts = sum(a.bytes for a in g.alive if a.category in _GRAPH_CATEGORIES and g.alloc_root(a) == root)
        if acts <= 0:
            return []
        merge = g.merge_names(entries)
        linear = bool(merge) and merge <= _LINEAR_MERGES
        name = self._model_name(root)
        xs = self._tensor_list(n, g.input_shapes(root)) or "inputs"
        shape = g.first_input_shape(root)
        given = self.ns.get(xs)
        if not isinstance(given, list | tuple) and shape is not None:  # inputs made inline: their recorded shape
            given = [torch.zeros(shape) for _ in range(n)]
        rest = self._without_model_run(root)
        if linear:
            own = _measure(_micro_batch_proxy(given, n), model)
            if own is None:
                return []
            mean = bool(merge & {"MeanBackward0", "MeanBackward1", "DivBackward0"})
            scale = f" / len({xs})" if mean else ""
            return [
                Finding(
                    pattern="graphs_held",
                    bytes=acts,
                    variable=next((h.variable for h in holders if h.live_bytes > 0), None),
                    module=root,
                    message=(
                        f"{n} calls of {name} keep their graphs alive together ({format_bytes(acts)} at the peak) "
                        "for one backward over a sum of their losses"
                    ),
                    suggestion=(
                        "call backward on each micro-batch's loss inside the loop: the gradients add up in .grad "
                        "to the same values, and each graph is freed at once; step the optimizer after the loop"
                    ),
                    code=f"(loss{scale}).backward()  # in the loop, for each micro-batch; opt.step() after it",
                    saves_bytes=self._saving(rest + own),
                )
            ]
        own = _measure(_two_pass_proxy(given, n), model)
        if own is None:
            return []
        bn = any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())
        coupled = "couples them" if merge else "is formed from all of them (if it only sums them, a backward per micro-batch is simpler)"
        return [
            Finding(
                pattern="many_outputs",
                bytes=acts,
                module=root,
                message=(
                    f"{n} calls of {name} keep their graphs alive together ({format_bytes(acts)} at the peak) "
                    f"for one loss that {coupled}"
                ),
                suggestion=(
                    f"compute the outputs without graphs, take the loss's gradient with respect to them, then "
                    f"run {name} again one input at a time with that gradient: one graph alive at a time, "
                    "the same gradients"
                    + (" (batch-norm statistics and dropout masks stay as in one pass)" if bn else "")
                ),
                code=f'L = many_inputs_backward({name}, {xs}, g, method="two_pass")  # g(zs): your loss on the stacked outputs',
                saves_bytes=self._saving(rest + own),
            )
        ]

    # ----- a model that requires grad but is not trained ------------------------------------------
    def _untrained_model(self) -> list[Finding]:
        """A model in eval() mode whose parameters require grad, that no optimizer among the
        user's variables trains, run with autograd on (its gradients were computed for nothing).
        Never a model that a create_graph gradient goes through or whose parameters an
        autograd.grad asked for."""
        g = self.g
        out: list[Finding] = []
        if any(c.create_graph for c in g.calls):
            return []
        for name, m in self.modules:
            if name not in self.roots or m.training or self._trained_by_optimizer(m) is not False:
                continue
            if not any(p.requires_grad for p in m.parameters()) or name in g.asked_roots():
                continue
            saved = sum(a.bytes for a in g.alive if g.alloc_root(a) == name)
            fix_peak = _replay(  # no gradients or backward work for it; its intermediates freed at once
                self.rec.allocations,
                lambda a, name=name: g.alloc_root(a) == name and a.category in (Category.GRADIENT, Category.BACKWARD_TEMP),
                free_at=g.released_early(lambda a, name=name: g.alloc_root(a) == name and a.node is not None),
            )
            out.append(
                Finding(
                    pattern="frozen_trainable",
                    bytes=saved,
                    variable=name,
                    module=name,
                    message=(
                        f"`{name}` ({type(m).__name__}) is in eval() mode and no optimizer trains it, but its "
                        "parameters require grad and it ran with autograd on: its activations were saved and "
                        f"its gradients computed for nothing ({format_bytes(saved)} of it at the peak)"
                    ),
                    suggestion=f"run `{name}` under torch.no_grad() (or turn its requires_grad off)",
                    code=f"with torch.no_grad():\n    feats = {name}(x)",
                    saves_bytes=self._saving(fix_peak),
                )
            )
        return out

    # ----- gradients computed for a model whose optimizer does not step --------------------------------
    def _gradients_discarded(self) -> list[Finding]:
        """A GAN's D step without ``G(z).detach()``: the backward ran into ``G`` (its gradients were
        accumulated), an optimizer trains ``G``, but only another optimizer stepped in the block:
        ``G``'s graph was kept and its gradients computed for a step that is not taken (the next
        ``opt_G.zero_grad()`` discards them). Known at the end of a block only: which optimizer
        stepped is read from the state it created (a first step)."""
        g = self.g
        if self.moment != "peak" or self._raised() or not g.calls:
            return []
        stepped = self._optimizers_that_stepped()
        if not stepped:
            return []
        accumulated = {_top(g.leaf_name(i)) for c in g.calls for i in c.accumulated}
        out: list[Finding] = []
        for name, m in self.modules:
            if name not in self.roots or name not in accumulated:
                continue
            mine = [o for o, opt in self.optimizers if any(id(p) in {id(q) for q in m.parameters()}
                                                              for grp in opt.param_groups for p in grp["params"])]
            if not mine or any(o in stepped for o in mine):
                continue
            fix_peak = _replay(
                self.rec.allocations,
                lambda a, name=name: g.alloc_root(a) == name and a.category in (Category.GRADIENT, Category.BACKWARD_TEMP),
                free_at=g.released_early(lambda a, name=name: g.alloc_root(a) == name and a.node is not None),
            )
            z = self._tensor_named(g.first_input_shape(name)) or "z"
            out.append(
                Finding(
                    pattern="gradients_discarded",
                    bytes=sum(a.bytes for a in g.alive if g.alloc_root(a) == name),
                    variable=name,
                    module=name,
                    message=(
                        f"backward ran into `{name}` and computed its gradients, but only "
                        f"{', '.join(sorted(stepped))} stepped here; `{mine[0]}` (which trains {name}) did not: "
                        f"{name}'s graph was kept and its gradients computed for nothing"
                    ),
                    suggestion=f"detach {name}'s output where it feeds the other model's loss (or run {name} under torch.no_grad() there)",
                    code=f"fake = {name}({z}).detach()  # in this step; {mine[0]}.zero_grad() would discard {name}'s gradients anyway",
                    saves_bytes=self._saving(fix_peak),
                )
            )
        return out

    def _optimizers_that_stepped(self) -> set[str]:
        """The user's optimizers whose state was created in the block (the allocations of its
        optimizer phase that were alive at its end)."""
        if self.moment == "failure":
            return set()
        made = {a.key: a.bytes for a in self.rec.allocations if a.phase is Phase.OPTIMIZER and a.free_at is None}
        by_storage = self.by_storage
        out = set()
        for name, opt in self.optimizers:
            for st in opt.state.values():
                ts = [t for t in st.values() if isinstance(t, torch.Tensor)] if isinstance(st, Mapping) else []
                keys = [_compat.storage_key(t) if by_storage else t.untyped_storage().data_ptr() for t in ts]
                if any(k in made for k in keys):
                    out.add(name)
                    break
        return out

    # ----- penalties branching off a trunk ----------------------------------------------------------
    def _penalty_branches(self) -> list[Finding]:
        """Seed 003: terms computed from the outputs of successive models (penalties branching off
        a trunk), whose saved tensors are alive together until one backward. PenaltyBranches
        ("early") takes each penalty's gradient to its branch point at once and frees the branch."""
        g = self.g
        if any(c.create_graph for c in g.calls) or self._raised():
            return []
        branches = g.branches()
        if len(branches) < 2:
            return []
        total = sum(branches.values())
        keep = max(branches.values())
        if total - keep <= 0:
            return []
        order = g.trunk_order(list(branches))
        fix_peak = self.demand - (total - keep)
        lines = ['pb = PenaltyBranches("early")']
        prev = "x"
        for i, r in enumerate(order, 1):
            lines.append(f"comp{i} = {r}({prev}); pb.add(penalty{i}(comp{i}), at=comp{i})")
            prev = f"comp{i}"
        lines.append("pb.backward(main_loss)   # instead of (main_loss + penalties).backward()")
        return [
            Finding(
                pattern="penalty_branches",
                bytes=total,
                module=order[0],
                message=(
                    f"{len(branches)} terms branch off the outputs of {', '.join(order)} and their saved tensors "
                    f"({format_bytes(total)}) are alive together until one backward"
                ),
                suggestion=(
                    "take each penalty's gradient to its branch point as soon as it is computed and free the "
                    "branch (gradscope.strategies.PenaltyBranches): one branch alive at a time, the trunk "
                    "traversed once, the same gradients"
                ),
                code="\n".join(lines),
                saves_bytes=self._saving(fix_peak),
            )
        ]

    # ----- retain_graph=True that nothing reuses ---------------------------------------------------
    def _retained_graphs(self) -> list[Finding]:
        """Backward calls with retain_graph=True whose graphs no later backward ran through: the
        graphs stayed alive (until their loss was dropped) for nothing."""
        g = self.g
        retained = [c for c in g.calls if c.retain_graph and not c.create_graph]
        if not retained or self._raised():
            return []
        ran = {i for i in g.nodes_run_by(retained) if g.nodes[i].name != "AccumulateGrad"}
        if not ran or any(g.nodes[i].executed > 1 for i in ran):
            return []  # a later backward reused them (penalties off one trunk, see `_penalty_branches`)
        # without retain_graph a saved tensor is freed once its node has run in backward
        ends = g.call_end_positions()
        step_end: dict[int, int] = {}
        for a in self.rec.allocations:
            if a.step is not None:
                step_end[a.step] = max(step_end.get(a.step, -1), a.alloc_at)
        ran_at = {st.node: k for k, st in enumerate(self.rec.steps)}
        free_at: dict[int, int] = {}
        for a in self.rec.allocations:
            if a.category is Category.ACTIVATION and a.node in ran:
                end = step_end.get(ran_at.get(a.node, -1), ends.get((g.calls_of_node.get(a.node) or [-1])[0]))
                if end is not None and (a.free_at is None or a.free_at > end):
                    free_at[a.index] = end
        fix_peak = _replay(self.rec.allocations, free_at=free_at)
        loss = next((h for h in (self.ns.get("loss"),) if isinstance(h, torch.Tensor)), None)
        var = "loss" if loss is not None or "loss" not in self.ns else "loss"
        n = len(retained)
        return [
            Finding(
                pattern="retain_graph",
                bytes=sum(a.bytes for a in g.alive if a.node in ran),
                variable=var,
                message=(
                    f"{n} backward call{'s' if n != 1 else ''} used retain_graph=True and no later backward ran "
                    "through those graphs: each graph's saved tensors stayed alive after its backward"
                ),
                suggestion="drop retain_graph=True: backward then frees each graph as it goes",
                code=f"{var}.backward()  # no retain_graph: nothing backpropagates through this graph again",
                saves_bytes=self._saving(fix_peak),
            )
        ]

    # ----- gradients alive while the optimizer steps -----------------------------------------------
    def _optimizer_state(self) -> list[Finding]:
        """The peak is in the optimizer step with every gradient alive next to optimizer state larger
        than the gradients (Adam's two moments): stepping each parameter in backward, as soon as its
        gradient is complete, keeps one gradient alive at a time."""
        allocs = self.rec.allocations
        if self.moment == "failure":
            phase = allocs[-1].phase if len(allocs) else None
        else:
            phase = self.rec.peak.phase if self.rec.peak is not None else None
        if phase is not Phase.OPTIMIZER:
            return []
        alive = self.g.alive
        grads = [a.bytes for a in alive if a.category is Category.GRADIENT]
        state = sum(a.bytes for a in alive if a.category is Category.OPTIMIZER)
        if not grads or state <= sum(grads):
            return []
        name, opt = self.optimizers[0] if self.optimizers else ("opt", None)
        kind = type(opt).__name__ if opt is not None else "Adam"
        fix_peak = self.demand - (sum(grads) - max(grads))
        model = self.g.main_root(order=0)
        mname = self._model_name(model)
        return [
            Finding(
                pattern="optimizer_state",
                bytes=state + sum(grads),
                variable=name,
                message=(
                    f"the peak is in {name}.step(): {kind}'s state ({format_bytes(state)}) and every gradient "
                    f"({format_bytes(sum(grads))}) are alive together"
                ),
                suggestion=(
                    "step each parameter in backward as soon as its gradient is complete and free the gradient "
                    "then (one optimizer per parameter, a post-accumulate-grad hook): one gradient alive at a time, "
                    "the same updates"
                ),
                code=(
                    f"opts = {{p: torch.optim.{kind}([p], **{name}.defaults) for p in {mname}.parameters()}}\n"
                    f"for p in {mname}.parameters(): p.register_post_accumulate_grad_hook("
                    "lambda p: (opts[p].step(), opts[p].zero_grad()))   # then no opt.step()"
                ),
                saves_bytes=self._saving(fix_peak),
            )
        ]

    # ----- one large call: micro-batches, or checkpointing with batch norm exact -------------------------
    def _one_large_call(self) -> list[Finding]:
        """Activations of one call of one model dominate: without batch norm, micro-batches give the
        same gradients (for a mean loss, each micro-batch's loss scaled by its share); with batch
        norm, micro-batches change the statistics, so checkpoint the blocks, with the running
        statistics kept exact through the recompute."""
        g = self.g
        if any(c.create_graph for c in g.calls) or self._raised() or (not g.calls and self.moment != "failure"):
            return []
        root = g.main_root(order=0)
        model = self._module(root)
        if model is None or g.calls_of(root)[0] != 1 or not model.training:
            return []
        acts = sum(a.bytes for a in g.alive if a.category in _GRAPH_CATEGORIES or g.alloc_root(a) == root)
        if acts < 0.5 * self.demand:
            return []
        name = self._model_name(root)
        bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.training]
        if not bn:
            x = self._tensor_named(g.first_input_shape(root)) or "x"
            rest = self._without_model_run(root)
            xv = self.ns.get(x)
            own = _measure(_micro_batch_proxy(list(xv.chunk(_CHUNKS)) if isinstance(xv, torch.Tensor) else None, _CHUNKS), model)
            if own is None:
                return []
            return [
                Finding(
                    pattern="micro_batches",
                    bytes=acts,
                    module=root,
                    message=(
                        f"one call of {name} on `{x}` saves {format_bytes(acts)} of activations and backward "
                        "temporaries at the peak: they grow with the batch"
                    ),
                    suggestion=(
                        f"split the batch into {_CHUNKS} micro-batches and call backward on each, scaled by its "
                        "share of the batch: the same gradients, one micro-batch's activations alive at a time"
                    ),
                    code=(
                        f"for xb, yb in zip({x}.chunk({_CHUNKS}), y.chunk({_CHUNKS})):\n"
                        f"    (loss_fn({name}(xb), yb) * len(xb) / len({x})).backward()   # then opt.step() once"
                    ),
                    saves_bytes=self._saving(rest + own),
                )
            ]
        blocks = g.blocks(root)
        if len(blocks) < 2:
            return []
        per = {b: sum(a.bytes for a in g.alive if a.category is Category.ACTIVATION and g.block_of(a) == b) for b in blocks}
        kept_inputs = sum(g.block_input_bytes(b) for b in blocks[1:])
        saving = sum(per.values()) - kept_inputs - max(per.values())
        if saving <= 0:
            return []
        path = code_path(blocks[0].rsplit(".", 1)[0]) if "." in blocks[0] else name
        return [
            Finding(
                pattern="deep_activations",
                bytes=acts,
                module=root,
                message=(
                    f"{len(blocks)} blocks of {name} save {format_bytes(sum(per.values()))} of activations, alive "
                    f"together at the peak; {name} has batch norm, so micro-batches would change its statistics"
                ),
                suggestion=(
                    "checkpoint each block (its activations are recomputed in backward, one block at a time), "
                    "and restore the batch-norm running statistics around the recompute so that they move once"
                ),
                code=(
                    "class keep_bn_stats:  # puts running_mean / running_var / num_batches_tracked back after the recompute\n"
                    "    def __init__(self, m): self.bns = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._NormBase)]\n"
                    "    def __enter__(self): self.kept = [[t.clone() for t in b.buffers()] for b in self.bns]\n"
                    "    def __exit__(self, *e): [t.copy_(k) for b, ks in zip(self.bns, self.kept) for t, k in zip(b.buffers(), ks)]\n"
                    f"for block in {path}[:{len(blocks)}]:\n"
                    "    h = checkpoint(block, h, use_reentrant=False, context_fn=lambda b=block: (nullcontext(), keep_bn_stats(b)))"
                ),
                saves_bytes=self._saving(self.demand - saving),
            )
        ]



# ----- what the findings read from the recording ----------------------------------------------------
_MIN_SAVING = 0.1  # a fix that saves less than this share of the peak is not suggested
_CHUNKS = 8  # micro-batches suggested for one large batch
_GRAPH_CATEGORIES = (Category.ACTIVATION, Category.CREATE_GRAPH, Category.BACKWARD_TEMP)
# Operations that combine per-input terms linearly: a loss made only of these is a sum (or mean)
# of the terms, whose gradient a backward per micro-batch accumulates exactly.
_LINEAR_MERGES = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SumBackward0", "SumBackward1", "MeanBackward0",
    "MeanBackward1", "DivBackward0", "DivBackward1", "MulBackward1", "StackBackward0", "CatBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ViewBackward0", "UnsafeViewBackward0",
    "ExpandBackward0", "SelectBackward0", "CloneBackward0",
})


class _Facts:
    """The recording's graph and allocation table, indexed for the findings (see NOTE [ findings
    are measured fixes ]). Walks are iterative: graphs may be deep."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.nodes = rec.nodes
        self.calls = tuple(c for c in rec.backward_calls if c.observed)
        self.top = [_top(n.module) for n in self.nodes]
        self.next: list[list[int]] = [[] for _ in self.nodes]
        for e in rec.edges:
            if 0 <= e.dst < len(self.next):
                self.next[e.dst].append(e.src)
        allocs = rec.allocations
        self.alive: tuple[Allocation, ...] = ()
        if len(allocs):
            if rec.oom is not None or rec.error is not None:
                last = max(max(a.alloc_at, a.free_at or 0) for a in allocs)
                live = [a for a in allocs if a.free_at is None or a.free_at > last]
                self.alive = tuple(live) if rec.oom is not None else rec.alive_at_peak()
            else:
                self.alive = rec.alive_at_peak()
        self.calls_of_node: dict[int, list[int]] = {}
        steps = rec.steps
        for c in self.calls:
            if c.first_step is None or c.last_step is None:
                continue
            for s in range(c.first_step, min(c.last_step, len(steps) - 1) + 1):
                self.calls_of_node.setdefault(steps[s].node, []).append(c.index)

    # ----- nodes and calls -------------------------------------------------------------------
    def leaf_name(self, node: int) -> str | None:
        return self.nodes[node].leaf if 0 <= node < len(self.nodes) else None

    def param_inputs(self, c: BackwardCall) -> bool:
        """Whether a call differentiated (or accumulated) anything but input leaves."""
        for i in (*c.inputs, *c.accumulated):
            n = self.nodes[i] if 0 <= i < len(self.nodes) else None
            if n is None or n.name != "AccumulateGrad" or n.leaf != "input":
                return True
        return False

    def order1_executed(self) -> bool:
        return any(n.order >= 1 and n.executed > 0 for n in self.nodes)

    def trainable(self, root: str) -> bool:
        """Whether the graph has leaves among ``root``'s parameters (they require grad)."""
        return any(n.name == "AccumulateGrad" and n.leaf and n.leaf != "input" and _top(n.leaf) == root
                   for n in self.nodes)

    def asked_roots(self) -> set[str]:
        """Roots whose parameters an ``inputs=`` of a backward call named."""
        out = set()
        for c in self.calls:
            for i in c.inputs:
                leaf = self.leaf_name(i)
                if leaf and leaf != "input" and _top(leaf):
                    out.add(_top(leaf) or "")
        return out

    def differentiated_roots(self) -> set[str]:
        """Roots whose parameters a backward call differentiated (named them in ``inputs=`` or
        accumulated into their ``.grad``)."""
        out = set()
        for c in self.calls:
            for i in (*c.inputs, *c.accumulated):
                leaf = self.leaf_name(i)
                if leaf and leaf != "input" and _top(leaf):
                    out.add(_top(leaf) or "")
        return out

    def main_root(self, order: int = 0) -> str | None:
        """The root module holding the most at the diagnosed moment (else with the most nodes)."""
        per: dict[str, int] = {}
        for a in self.alive:
            r = _top(a.module)
            if r:
                per[r] = per.get(r, 0) + a.bytes
        if not per:
            for n, t in zip(self.nodes, self.top, strict=True):
                if t and n.order == order:
                    per[t] = per.get(t, 0) + 1
        return min(per.items(), key=lambda kv: (-kv[1], kv[0]))[0] if per else None

    def calls_of(self, root: str | None) -> tuple[int, list[int]]:
        """How many times ``root`` ran forward (the most common count of its (module, op) node
        groups) and one node per call (an entry of each call's subgraph)."""
        groups: dict[tuple[str, str], list[int]] = {}
        for i, node in enumerate(self.nodes):
            if root and self.top[i] == root and node.order == 0 and node.name != "AccumulateGrad":
                groups.setdefault((node.module or "", node.name), []).append(i)
        if not groups:
            return 0, []
        counts: dict[int, int] = {}
        for ids in groups.values():
            counts[len(ids)] = counts.get(len(ids), 0) + 1
        n = min(counts.items(), key=lambda kv: (-kv[1], -kv[0]))[0]
        entry = min((ids for ids in groups.values() if len(ids) == n), key=lambda ids: ids[0])
        return n, entry

    def merge_names(self, entries: list[int]) -> set[str]:
        """Names of the nodes outside the model that combine the outputs of two or more of its
        calls (``entries``: one node per call)."""
        if len(entries) < 2 or len(self.nodes) > _MAX_NODES:
            return set()
        bit = {e: 1 << k for k, e in enumerate(entries)}
        mask = [0] * len(self.nodes)
        done = [False] * len(self.nodes)
        for start in range(len(self.nodes)):
            if done[start]:
                continue
            stack: list[tuple[int, bool]] = [(start, False)]
            while stack:
                v, post = stack.pop()
                if post:
                    m = bit.get(v, 0)
                    for s in self.next[v]:
                        m |= mask[s]
                    mask[v] = m
                    done[v] = True
                    continue
                if done[v]:
                    continue
                stack.append((v, True))
                stack.extend((s, False) for s in self.next[v] if not done[s])
        root = self.top[entries[0]]
        return {self.nodes[i].name for i in range(len(self.nodes))
                if self.top[i] != root and mask[i] & (mask[i] - 1)}

    def nodes_run_by(self, calls: list[BackwardCall]) -> set[int]:
        ids = {c.index for c in calls}
        return {n for n, cs in self.calls_of_node.items() if ids.intersection(cs)}

    def never_run_saving_nodes(self) -> set[int]:
        """Forward nodes that saved tensors and that no backward ever ran."""
        saving = {a.node for a in self.rec.allocations if a.node is not None}
        return {i for i in saving if 0 <= i < len(self.nodes) and self.nodes[i].order == 0
                and self.nodes[i].executed == 0}

    def call_end_positions(self) -> dict[int, int]:
        """The event position at which each backward call made its last allocation."""
        out: dict[int, int] = {}
        for c in self.calls:
            if c.first_step is None or c.last_step is None:
                continue
            ends = [a.alloc_at for a in self.rec.allocations
                    if a.step is not None and c.first_step <= a.step <= c.last_step]
            if ends:
                out[c.index] = max(ends)
        return out

    def live_before(self, root: str | None) -> int:
        """Bytes allocated inside the block and alive just before ``root``'s first allocation."""
        firsts = [a.alloc_at for a in self.rec.allocations if _top(a.module) == root]
        if not firsts:
            return 0
        t = min(firsts)
        return sum(a.bytes for a in self.rec.allocations if a.alloc_at < t and (a.free_at is None or a.free_at > t))

    # ----- shapes --------------------------------------------------------------------------------
    def input_shapes(self, root: str | None) -> set[tuple[int, ...]]:
        """Shapes of the tensors from outside the block that ``root``'s nodes saved (its inputs)."""
        return {tuple(s.shape) for s in self.rec.saved if s.kind is Kind.INPUT and _top(s.module) == root}

    def first_input_shape(self, root: str | None) -> tuple[int, ...] | None:
        """The shape of ``root``'s input: a tensor from before the block that it saved, else
        what its first layer saved as its input (an input made inside the block)."""
        ins = [s for s in self.rec.saved if s.kind is Kind.INPUT and _top(s.module) == root]
        if ins:
            return tuple(ins[0].shape)
        first = next((a.module for a in self.rec.allocations if _top(a.module) == root), None)
        mine = [s for s in self.rec.saved
                if s.module == first and s.attribute.removeprefix("_saved_") in ("mat1", "input", "self")]
        return tuple(mine[0].shape) if mine else None

    input_shape = first_input_shape

    # ----- allocations ---------------------------------------------------------------------------
    def alloc_root(self, a: Allocation) -> str | None:
        return _top(a.module)

    def released_early(self, pick: Any) -> dict[int, int]:
        """For the allocations ``pick`` selects: free each at the next allocation after its own
        (what happens to a forward's intermediates under torch.no_grad(): the next operation's
        output is made, then the input it read is released)."""
        allocs = sorted(self.rec.allocations, key=lambda a: a.alloc_at)
        out: dict[int, int] = {}
        nxt: int | None = None  # the next allocation made in another module than the one at hand
        for k in range(len(allocs) - 1, -1, -1):
            a = allocs[k]
            if k + 1 < len(allocs) and allocs[k + 1].module != a.module:
                nxt = allocs[k + 1].alloc_at
            if pick(a):
                at = a.alloc_at if nxt is None else nxt
                if a.free_at is None or a.free_at > at:
                    out[a.index] = at
        return out

    def branches(self) -> dict[str, int]:
        """Saved bytes alive at the moment in nodes outside every module, by the model whose output
        they branch off (the first module reached walking toward the inputs)."""
        first: dict[int, str | None] = {}

        def reach(start: int) -> str | None:
            if start in first:
                return first[start]
            seen = {start}
            queue = [start]
            found: str | None = None
            while queue and found is None:
                nxt: list[int] = []
                for v in queue:
                    for s in self.next[v]:
                        if s in seen:
                            continue
                        seen.add(s)
                        if self.top[s]:
                            found = self.top[s]
                            break
                        if self.nodes[s].name != "AccumulateGrad":
                            nxt.append(s)
                    if found:
                        break
                queue = nxt
            first[start] = found
            return found

        out: dict[str, int] = {}
        for a in self.alive:
            if a.category is Category.ACTIVATION and a.module is None and a.node is not None \
                    and 0 <= a.node < len(self.nodes):
                r = reach(a.node)
                if r:
                    out[r] = out.get(r, 0) + a.bytes
        return out

    def trunk_order(self, roots: list[str]) -> list[str]:
        first: dict[str, int] = {}
        for a in self.rec.allocations:
            r = _top(a.module)
            if r in roots and r not in first:
                first[r] = a.alloc_at
        return sorted(roots, key=lambda r: (first.get(r, 1 << 60), r))

    def block_of(self, a: Allocation) -> str | None:
        parts = (a.module or "").split(".")
        return ".".join(parts[:2]) if len(parts) >= 3 else None

    def blocks(self, root: str | None) -> list[str]:
        """``root``'s child modules that are blocks (have children of their own) with saved
        activations alive, in forward order."""
        first: dict[str, int] = {}
        for a in self.alive:
            b = self.block_of(a)
            if b and a.category is Category.ACTIVATION and _top(b) == root:
                first[b] = min(first.get(b, 1 << 60), a.alloc_at)
        return sorted(first, key=lambda b: first[b])

    def block_input_bytes(self, block: str) -> int:
        """The bytes of a block's input, as checkpointing keeps it: the previous block's last
        saved activation (its output)."""
        blocks = self.blocks(_top(block))
        k = blocks.index(block) if block in blocks else 0
        if k == 0:
            return 0
        prev = [a for a in self.alive if self.block_of(a) == blocks[k - 1] and a.category is Category.ACTIVATION]
        return max(prev, key=lambda a: a.alloc_at).bytes if prev else 0


def _replay(allocations: Sequence[Allocation], exclude: Any = None, free_at: Mapping[int, int] | None = None) -> int:
    """The peak of the allocation timeline without what ``exclude`` selects, with the frees
    ``free_at`` moves earlier (allocation index -> event position; freed just after that event)."""
    events: list[tuple[int, int, int]] = []
    for a in allocations:
        if exclude is not None and exclude(a):
            continue
        events.append((a.alloc_at, 0, a.bytes))
        f = free_at.get(a.index) if free_at else None
        if f is not None:
            events.append((f, 1, -a.bytes))
        elif a.free_at is not None:
            events.append((a.free_at, 0, -a.bytes))
    events.sort()
    live = peak = 0
    for _, _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# NOTE [ measuring a strategy's own peak ]: a fix that runs the model another way (forward AD,
# two passes, micro-batches, an unrolled inner loop) has a peak of its own, which the replay of the
# user's timeline cannot know. It is measured by running that way on a copy of the user's model
# (``copy.deepcopy``: the user's parameters, batch-norm statistics and gradients are never touched;
# the RNG is forked) with zero inputs of the recorded shapes, under ``gs.record(memory="cpu")``.
# Where the model is not on the CPU (or too large to copy) it is predicted on the meta device
# with ``gs.predict`` instead. The strategy's loss is a stand-in (a sum of squares) of the same
# shape: its cost is small next to the model's. None when it cannot run (the finding is then not
# given: a saving that is not known is not claimed).
_MAX_COPY_BYTES = 256 * 1024 * 1024


def _measure(proxy: Any, model: nn.Module, *args: Any) -> int | None:
    if proxy is None:
        return None
    from gradscope.predict import predict
    from gradscope.record import record

    params = list(model.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    on_cpu = all(p.device.type == "cpu" for p in params)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on_cpu and size <= _MAX_COPY_BYTES:
                twin = copy.deepcopy(model)
                for p in twin.parameters():
                    p.grad = None
                with torch.random.fork_rng(devices=[]):
                    r = record(memory="cpu")
                    with r:
                        proxy(twin, *args)
                measured = r.recording
                return None if measured is None else int(measured.peak_bytes)
            return int(predict(proxy, model, *args, device="cpu").peak_bytes)
    except Exception:  # a stand-in that does not fit the user's model: no claim
        return None


def _mixed_grad_proxy(z_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> Any:
    from gradscope.strategies import mixed_grad

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        z = torch.zeros(z_shape, device=dev)
        y = torch.zeros(y_shape, device=dev, requires_grad=True)

        def f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            n = min(g.numel(), y.numel())
            return (g.tanh().reshape(-1)[:n] * y.reshape(-1)[:n]).sum()

        mixed_grad(f, model, z, y, method="forward_ad")

    return run


def _jacobian_proxy(n_in: int, method: str) -> Any:
    from gradscope.strategies import jacobian

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        jacobian(lambda v: model(v.view(1, -1)).view(-1), torch.zeros(n_in, device=dev), method=method)

    return run


def _micro_batch_proxy(xs: Any, n: int) -> Any:
    def run(model: nn.Module) -> None:
        for x in xs:
            (model(x).float().square().mean() / n).backward()

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def _two_pass_proxy(xs: Any, n: int) -> Any:
    from gradscope.strategies import many_inputs_backward

    def run(model: nn.Module) -> None:
        many_inputs_backward(model, list(xs), lambda zs: zs.float().square().mean(), method="two_pass")

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def _hypergradient_proxy(a_shape: tuple[int, ...], x_shape: tuple[int, ...], steps: int) -> Any:
    from torch.func import functional_call

    from gradscope.strategies import hypergradient

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        A = torch.zeros(a_shape, device=dev, requires_grad=True)  # noqa: N806
        x = torch.zeros(x_shape, device=dev)

        def train_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, p, (x,)).square()
            if out.shape[0] == A.numel():
                return (A.reshape(-1) * out.reshape(out.shape[0], -1).sum(-1)).mean()
            return out.mean() * A.sum()

        def val_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(model, p, (x,)).square().mean()

        hypergradient(model, A, train_loss, val_loss, steps=steps, optimizer="sgd", lr=0.1)

    return run


# ----- helpers ---------------------------------------------------------------------------------
def _graph_roots(v: Any) -> list[Any]:
    """Distinct grad_fn nodes of the tensors a variable holds (itself, or items of a list,
    tuple or dict); the nodes are returned only for the walk and never stored. The node objects
    are held while they are compared (see NOTE [ walking a graph by node objects ])."""
    items: Iterable[Any]
    if isinstance(v, torch.Tensor):
        items = (v,)
    elif isinstance(v, list | tuple):
        items = v[:_MAX_ITEMS]
    elif isinstance(v, dict):
        items = list(v.values())[:_MAX_ITEMS]
    else:
        return []
    roots: dict[int, Any] = {}
    for t in items:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            roots.setdefault(id(t.grad_fn), t.grad_fn)
    return list(roots.values())


# NOTE [ walking a graph by node objects ]: on some PyTorch versions the Python object of a C++
# autograd node exists only while something references it: `next_functions` makes a new one at each
# call, and once it is dropped its `id()` can be given to the next one. A walk that remembers
# visited nodes by `id()` alone then takes a new node for one it has seen and skips it (a list of
# losses was reported holding 132,608 bytes instead of 4,103,680). So the walk keeps every node
# object it visits until it ends: while one is held, the same C++ node gives back the same object,
# and no other object can have its `id()`. The objects are dropped in the order they were found
# (roots first), which PyTorch frees safely.
def _saved_storages(roots: list[Any], key_of: Any) -> dict[int, int]:
    """Bytes of the storages saved by the nodes reachable from ``roots``, by key (iterative
    walk; each storage once; see NOTE [ walking a graph by node objects ])."""
    out: dict[int, int] = {}
    seen: dict[int, Any] = {}  # id -> the node object itself, held until the walk ends
    stack = list(roots)
    while stack and len(seen) < _MAX_NODES:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for attr, _raw in _compat.saved_tensor_attributes(fn):
            try:
                v = getattr(fn, attr)
            except (RuntimeError, AttributeError):  # freed by a backward without retain_graph
                continue
            for t in v if isinstance(v, tuple | list) else (v,):
                if isinstance(t, torch.Tensor):
                    k = key_of(t)
                    if k is not None:
                        out[k] = int(t.untyped_storage().nbytes())
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return out


def _top(module: str | None) -> str | None:
    return None if not module else module.split(".")[0]


def _top_modules(mods: Iterable[str | None]) -> list[str]:
    count: dict[str, int] = {}
    for m in mods:
        t = _top(m)
        if t:
            count[t] = count.get(t, 0) + 1
    return [m for m, _ in sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))]


def _block(module: str | None) -> str:
    """A checkpointable block: the module path without its last component (``layers.3``)."""
    if not module:
        return "(no module)"
    parts = module.split(".")
    return ".".join(parts[:-1]) if len(parts) > 1 else module


# NOTE [ modules by identity ]: a variable of the user's is taken for one of the recording's
# models only when the recording names a root module by that very variable: the recorder names
# roots by identity (the object given with ``modules={"G": G}``, which the notebook extension passes
# for every model in the namespace, or found among the variables where the block ends). Never by
# class name (``cnn`` and ``big`` are both ``Sequential``: a cell using only ``big`` once reported
# "``cnn`` looks frozen") and never by parameter names alone (every ``nn.Sequential`` has a
# ``0.weight``). A root the recorder could not name by a variable (a class name such as
# ``Sequential``, or the paths of a single unnamed root) is matched with no variable.
def _root_names(rec: Recording) -> set[str]:
    """The first components of the recording's module paths and parameter names."""
    out = {_top(n.module) for n in rec.nodes if n.module}
    out |= {n.leaf.split(".")[0] for n in rec.nodes if n.leaf and n.leaf != "input" and "." in n.leaf}
    return {r for r in out if r}


def _held_order(t: HeldTensor) -> tuple[Any, ...]:
    """Largest first; ties in an order that does not depend on memory addresses."""
    return (
        -t.bytes,
        _KIND_RANK.get(t.kind, len(_KIND_RANK)),
        t.module or "",
        t.node or "",
        t.order or 0,
        t.shape or (),
        t.variable or "",
        t.via or "",
    )


_KIND_RANK = {k: i for i, k in enumerate(_KIND_NAMES)}


