"""``gs.diagnose``: who held memory at the failing moment (or the peak), and what to change.

The recording says what was live then (see NOTE [ what is live at the failing moment ] in
``gradscope._held``): saved tensors with their node, module and order; gradients; what backward
made; forward results nobody saved. The user's namespace (by default the caller's variables; the
notebook passes its user namespace) adds what only the live objects know: which variable holds
this recording's graphs, which optimizer owns which state, which models still require grad
outside an optimizer (models are matched by identity, see NOTE [ modules by identity ]). All
recorder data is read through one accessor (see NOTE [ one accessor for what the recording
held ]). Patterns found:

- ``create_graph``: a backward with ``create_graph=True`` built nodes of order >= 1 that keep the
  forward activations alive (mixed second derivatives through a frozen model: forward AD);
- ``graphs_held``: a variable (a list of losses, of gradients) holds several graphs;
- ``frozen_trainable``: a model whose parameters require grad but that no optimizer trains (or that
  is in eval mode) ran with autograd on, so its activations were saved;
- ``retain_graph``: backward calls with ``retain_graph=True`` kept their graphs;
- ``optimizer_state``: gradients and optimizer state dominate;
- ``deep_activations``: saved activations dominate: checkpoint the largest block.

Example:
    >>> import torch, gradscope as gs
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    >>> losses = []
    >>> try:
    ...     with gs.record(budget="1MiB", modules={"model": model}) as rec:
    ...         for _ in range(50):
    ...             losses.append(model(torch.randn(128, 64)).square().mean())
    ... except torch.OutOfMemoryError:
    ...     pass
    >>> d = gs.diagnose(rec.recording)
    >>> d.findings[0].pattern, d.findings[0].variable
    ('graphs_held', 'losses')
"""

from __future__ import annotations

import html
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradscope import _compat
from gradscope.errors import GradscopeError
from gradscope.recording import Recording, format_bytes

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
    of the peak if the fix is applied (None where it is not predicted yet: the scenario suite in
    ``tests/scenarios`` holds the measured savings it must come within 25 % of).
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


def _read(rec: Recording) -> _Held:
    """The one place that reads the recorder's data about the diagnosed moment."""
    held = rec.held.to_dict() if rec.held is not None else {}
    oom = rec.oom.to_dict() if rec.oom is not None else {}
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
        resident = tuple((k, b) for k, b in resident if b > 0) if self.moment == "failure" else ()
        by_module = tuple(sorted(modules.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top])
        findings = self._findings(kinds, holders)
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
        return self.moment == "failure" and not r.reused

    def _kind(self, r: _Row) -> str:
        named = self.kind_of_key.get(r.key) if self._matchable(r) else None
        if named is not None:
            return named
        if r.what == "saved":
            if r.order >= 1:
                return "saved_order1"
            return "saved" if r.saved_kind == "activation" else f"saved_{r.saved_kind}"
        return r.what

    def _findings(self, kinds: dict[str, int], holders: list[GraphHolder]) -> list[Finding]:
        out: list[Finding] = []
        rec = self.rec
        live = max(self.live, 1)
        # create_graph: nodes of order >= 1 and the forward activations they keep.
        created = [c for c in self.calls if c.create_graph]
        high = [n for n in rec.nodes if n.order >= 1]
        if created or high:
            top_mods = _top_modules(r.module for r in self.rows if r.order >= 1)
            if not top_mods:
                top_mods = _top_modules(n.module for n in high)
            mod = top_mods[0] if top_mods else None
            in_mod = sum(
                r.bytes
                for r in self.rows
                if r.what == "saved" and mod is not None and _top(r.module) == mod
            )
            order1 = kinds.get("saved_order1", 0)
            held_bytes = max(in_mod, order1)
            trainable = {_top(n.module) for n in rec.nodes if n.leaf and n.leaf != "input"}
            frozen = mod is not None and mod not in trainable
            holder = next((h for h in holders if h.live_bytes > 0), None)
            where = f" through {mod}" if mod else ""
            msg = (
                f"{len(created)} backward call{'s' if len(created) != 1 else ''} with create_graph=True built "
                f"{len(high)} nodes of order >= 1{where}; they keep {mod + chr(39) + 's' if mod else 'the'} "
                f"forward activations alive: {format_bytes(held_bytes)} of the {format_bytes(self.live)} live"
            )
            if holder is not None:
                msg += f" (held by `{holder.variable}`: {holder.graphs} graphs)"
            if frozen:
                msg += f"; {mod}'s parameters do not require grad (a frozen model)"
            g = _code_path(mod) if mod else "G"
            out.append(
                Finding(
                    pattern="create_graph",
                    bytes=held_bytes,
                    variable=holder.variable if holder else None,
                    module=mod,
                    message=msg,
                    suggestion=(
                        f"{g}'s activations are kept by create_graph=True: use the forward-AD strategy, which "
                        f"pushes the direction through {g} as a tangent and keeps no graph of {g} "
                        "(or drop create_graph=True if no second derivative is needed)"
                    ),
                    code=f'gradscope.strategies.mixed_grad(f, {g}, z, y, method="forward_ad")',
                )
            )
        # variables holding several graphs (a list of losses)
        for h in holders:
            if h.graphs < 2 or h.live_bytes <= 0 or (out and out[0].variable == h.variable):
                continue
            out.append(
                Finding(
                    pattern="graphs_held",
                    bytes=h.live_bytes,
                    variable=h.variable,
                    message=(
                        f"`{h.variable}` holds {h.graphs} graphs; their saved tensors are "
                        f"{format_bytes(h.live_bytes)} of the {format_bytes(self.live)} live"
                    ),
                    suggestion=(
                        f"keep numbers, not graphs, in `{h.variable}`: append loss.item() (or loss.detach()); "
                        "if the graphs are for one backward at the end, call (loss / n).backward() on each "
                        "micro-batch instead: gradients accumulate and each graph is freed at once"
                    ),
                    code=f"{h.variable}.append(loss.item())",
                )
            )
        # a model that requires grad but is not trained, run with autograd on
        out.extend(self._frozen_trainable())
        flagged = {f.module for f in out if f.pattern == "frozen_trainable"}
        out.extend(f for f in self._params_without_grads() if f.module not in flagged)
        # gradients and optimizer state dominate
        opt_bytes, grad_bytes = kinds.get("optimizer", 0), kinds.get("gradient", 0)
        # (state no larger than the gradients is SGD momentum's one copy: nothing leaner to advise)
        if opt_bytes + grad_bytes >= 0.5 * live and opt_bytes > grad_bytes:
            name = self.optimizers[0][0] if self.optimizers else "opt"
            kind = type(self.optimizers[0][1]).__name__ if self.optimizers else "the optimizer"
            out.append(
                Finding(
                    pattern="optimizer_state",
                    bytes=opt_bytes + grad_bytes,
                    variable=name,
                    message=(
                        f"{kind}'s state ({format_bytes(opt_bytes)}) and the gradients ({format_bytes(grad_bytes)}) "
                        f"are {format_bytes(opt_bytes + grad_bytes)} of the {format_bytes(self.live)} live"
                    ),
                    suggestion=(
                        "free gradients between steps (zero_grad(set_to_none=True), the default), step with "
                        "foreach=False to avoid the step's temporary copies, or use an optimizer with less "
                        "state per parameter (SGD with momentum keeps one copy, Adam two)"
                    ),
                    code=f"{name}.zero_grad(set_to_none=True)",
                )
            )
        # retain_graph
        retained = [c for c in self.calls if c.retain_graph and not c.create_graph]
        if retained:
            saved_live = sum(v for k, v in kinds.items() if k.startswith("saved"))
            out.append(
                Finding(
                    pattern="retain_graph",
                    bytes=saved_live,
                    message=(
                        f"{len(retained)} backward call{'s' if len(retained) != 1 else ''} used retain_graph=True: "
                        f"the graphs keep their saved tensors after backward ({format_bytes(saved_live)} saved live)"
                    ),
                    suggestion=(
                        "sum the losses and call backward once, or release each penalty branch right after its "
                        "backward (gradscope.strategies.PenaltyBranches); retain only what a later backward "
                        "really reuses"
                    ),
                    code="(loss_a + loss_b).backward()  # one pass, no retain_graph",
                )
            )
        # deep activations: saved activations dominate and nothing above explains them
        acts = kinds.get("saved", 0)
        if acts >= 0.5 * live and not out:
            per: dict[str, int] = {}
            for r in self.rows:
                if r.what == "saved":
                    m = _block(r.module)
                    per[m] = per.get(m, 0) + r.bytes
            block, b = min(per.items(), key=lambda kv: (-kv[1], kv[0]))
            out.append(
                Finding(
                    pattern="deep_activations",
                    bytes=acts,
                    module=block,
                    message=(
                        f"saved activations are {format_bytes(acts)} of the {format_bytes(self.live)} live; "
                        f"{block} saves the most ({format_bytes(b)})"
                    ),
                    suggestion=(
                        "recompute instead of saving: wrap the deepest blocks in activation checkpointing "
                        "(memory falls to about one block's activations; backward runs forward again)"
                    ),
                    code=f"torch.utils.checkpoint.checkpoint({_code_path(block)}, x, use_reentrant=False)",
                )
            )
        out.sort(key=lambda f: (-f.bytes, f.pattern))
        return out

    def _params_without_grads(self) -> list[Finding]:
        """Parameters in the graph while every backward call was ``autograd.grad`` (which never
        accumulates into ``.grad``) and that were not among its inputs: they required grad for
        nothing, and the inputs of their layers were saved to compute weight gradients nobody asked
        for. Known from the recording alone (no namespace needed)."""
        if not self.calls or any(c.api != "autograd.grad" for c in self.calls):
            return []
        per: dict[str, list[str]] = {}
        for n in self.rec.nodes:
            if n.name == "AccumulateGrad" and n.leaf and n.leaf != "input" and n.executed == 0:
                per.setdefault(_top(n.module or n.leaf) or "(no module)", []).append(n.leaf)
        out: list[Finding] = []
        for mod, leaves in sorted(per.items()):
            saved = sum(
                r.bytes for r in self.rows if r.what == "saved" and _top(r.module) == mod
            )
            out.append(
                Finding(
                    pattern="frozen_trainable",
                    bytes=saved,
                    module=mod,
                    message=(
                        f"{len(leaves)} parameters of {mod} require grad, but every backward here is "
                        f"autograd.grad and none asked for them: {format_bytes(saved)} saved in {mod} "
                        "serve weight gradients that are never computed"
                    ),
                    suggestion=f"turn {mod}'s requires_grad off while it is used as a fixed function",
                    code=f"{_code_path(mod)}.requires_grad_(False)",
                )
            )
        return out

    def _frozen_trainable(self) -> list[Finding]:
        out: list[Finding] = []
        trained: set[int] = set()
        for _, opt in self.optimizers:
            for g in opt.param_groups:
                trained.update(id(p) for p in g["params"])
        mods_with_saves: dict[str, int] = {}
        for r in self.rows:
            if r.what == "saved" and r.module:
                mods_with_saves[r.module] = mods_with_saves.get(r.module, 0) + r.bytes
        seen: set[int] = set()
        for name, m in self.modules:
            if id(m) in seen:
                continue
            seen.add(id(m))
            params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
            if not params:
                continue
            untrained = bool(self.optimizers) and not any(id(p) in trained for _, p in params)
            eval_mode = not m.training
            if not (untrained or eval_mode):
                continue
            if name not in self.roots:
                continue  # it did not take part in this recording (see NOTE [ modules by identity ])
            prefix = name
            saved = sum(b for mod, b in mods_with_saves.items() if mod == prefix or mod.startswith(prefix + "."))
            grads = sum(p.numel() * p.element_size() for _, p in params)
            why = "no optimizer trains its parameters" if untrained else "it is in eval() mode"
            out.append(
                Finding(
                    pattern="frozen_trainable",
                    bytes=saved,
                    variable=name,
                    module=prefix or name,
                    message=(
                        f"`{name}` ({type(m).__name__}) looks frozen ({why}) but its {len(params)} parameters "
                        f"require grad and it ran outside torch.no_grad(): autograd saved "
                        f"{format_bytes(saved)} of its activations and backward makes "
                        f"{format_bytes(grads)} of gradients for it"
                    ),
                    suggestion=(
                        f"run `{name}` under torch.no_grad() (or turn its requires_grad off) so that nothing "
                        "is saved for it"
                    ),
                    code=f"with torch.no_grad(): feats = {name}(x)   # or {name}.requires_grad_(False)",
                )
            )
        return out


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


def _code_path(module: str) -> str:
    """A module path as Python that reaches it: ``layers.3`` -> ``layers[3]``; a path relative to
    an unnamed root (``1.conv``) starts from ``model``."""
    parts = module.split(".")
    out = parts[0] if parts[0].isidentifier() else f"model[{parts[0]}]" if parts[0].isdigit() else "model"
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}" if p.isidentifier() else ""
    return out
