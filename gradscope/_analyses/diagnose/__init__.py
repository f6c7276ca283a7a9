"""``gs.diagnose``: who held memory at the failing moment (or the peak), and what to change.

The recording says what was live then (see NOTE [ what is live at the failing moment ] in
``gradscope._model.held_at_peak``): saved tensors with their node, module and order; gradients; what backward
made; forward results nobody saved. The user's namespace (by default the caller's variables; the
notebook passes its user namespace) adds what only the live objects know: which variable holds
this recording's graphs, which optimizer owns which state, which models still require grad
outside an optimizer (models are matched by identity, see NOTE [ modules by identity ] in
``gradscope._analyses.diagnose.facts``). All recorder data is read through one accessor (see NOTE [ one
accessor for what the recording held ] in ``gradscope._analyses.diagnose.moment``). Every finding is one fix with what it saves (see NOTE [ findings are measured fixes ]).
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
    >>> f = d.findings[0]  # its code ran on copies of model and xs before it is shown
    >>> f.pattern, f.ran, f.fits
    ('many_outputs', True, True)
    >>> print(f.setup, end="")
    from torch.utils.checkpoint import checkpoint
    for block in [model]:
        block.forward = lambda *args, f=block.forward, **kwargs: checkpoint(f, *args, use_reentrant=False, **kwargs)
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradscope._analyses.diagnose.copies import quiet_logging
from gradscope._analyses.diagnose.counts import RUN_LIMIT_FACTOR, RUN_LIMIT_FLOOR
from gradscope._analyses.diagnose.facts import Context, held_order
from gradscope._analyses.diagnose.fixes import REGISTRY, inplace_cut
from gradscope._analyses.diagnose.indexed import MIN_SAVING, IndexedRecording
from gradscope._analyses.diagnose.measure import COMPARED_PLAIN, Bench, Room, worth_showing
from gradscope._analyses.diagnose.moment import resident_by_variable
from gradscope._analyses.diagnose.result import Diagnosis, Finding, GraphHolder, LiveTensor
from gradscope._analyses.diagnose.step import compose, shape_of
from gradscope._analyses.diagnose.toolbox import TOOLBOX
from gradscope._analyses.jobs import JobDiagnosis, diagnose_job
from gradscope._base.errors import GradscopeError
from gradscope._model.job import Job
from gradscope._model.recording import Recording, format_bytes

__all__ = ["Diagnosis", "Finding", "GraphHolder", "LiveTensor", "diagnose"]

if TYPE_CHECKING:
    from gradscope._analyses.snapshot.findings import SnapshotDiagnosis


# ----------------------------------------------------------------------------------------------
def diagnose(
    recording: Recording | Job | Any, namespace: Mapping[str, Any] | None = None, *, top: int = 8,
    toolbox: bool | None = None, progress: bool | None = None, budget: int | str | None = None,
    alternatives: bool = False,
) -> Diagnosis | SnapshotDiagnosis | JobDiagnosis:
    """Say what held memory when a recorded block failed (or at its peak) and what to change.

    Args:
        recording: a :class:`~gradscope.Recording` (or the ``gs.record`` object), or a
            :class:`~gradscope.Job`: which ranks ran out of memory and whether the imbalance between
            ranks is the cause (:func:`~gradscope._analyses.jobs.diagnose_job`), with each failing
            rank's own diagnosis.
        namespace: variables to look through for lists of losses, optimizers and models (names
            are reported as written there). Default: the caller's globals and locals.
        top: how many modules and tensors to list.
        toolbox: try the fixes for a step that does not fit (checkpointing, micro-batches, the
            optimizer step in backward, ``set_to_none``, autocast), each run on copies of your
            objects with the block's own code before it is shown. Default: when the block failed
            (a budget or an out-of-memory error); ``True`` also at the peak of a step that fits.
        progress: a line on stderr while fixes run on copies. Default: in a terminal or a notebook.
        alternatives: under a budget, also try the toolbox's fixes after the first that fits it (by
            default the diagnosis stops there and names the fixes it did not try: each fix tried costs
            a few runs of the step; see NOTE [ the first fix that fits ] in
            gradscope._analyses.diagnose.measure).
        budget: for a job, the device size every rank is held against (a rank that completed
            would not fit when its resident bytes plus its peak exceed it). A recording is
            diagnosed against the budget it was recorded with.

    Returns:
        A :class:`Diagnosis`; ``print(d)`` shows the report. For a CUDA memory snapshot
        (``gs.load_snapshot``) a :class:`~gradscope.snapshot.SnapshotDiagnosis`, for a job a
        :class:`~gradscope._analyses.jobs.JobDiagnosis`.

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
    if isinstance(recording, Job):
        return diagnose_job(recording, budget, rank_report=lambda r: diagnose(r, namespace={}, top=top).text())
    if budget is not None:
        raise GradscopeError("gradscope: diagnose(budget=...) is for a job (gs.gather, gs.load_ranks); a recording "
                             "is diagnosed against the budget it was recorded with: gs.record(budget=...).")
    rec = recording
    if not isinstance(rec, Recording):
        rec = getattr(recording, "recording", None)
    if not isinstance(rec, Recording):
        raise GradscopeError(
            f"gradscope: diagnose() takes a Recording (rec.recording after a gs.record block) or a Job, not "
            f"a {type(recording).__name__}."
        )
    from gradscope._analyses.snapshot.data import SnapshotRecording

    if isinstance(rec, SnapshotRecording):  # allocations with frames, no graph
        from gradscope._analyses.snapshot.findings import diagnose_snapshot

        return diagnose_snapshot(rec, top=top)
    if namespace is None:
        frame = sys._getframe(1)
        namespace = {**frame.f_globals, **frame.f_locals}
    if toolbox is not None and not isinstance(toolbox, bool):
        raise GradscopeError(f"gradscope: diagnose(toolbox=...) takes True, False or None, not {toolbox!r}.")
    if not isinstance(alternatives, bool):
        raise GradscopeError(f"gradscope: diagnose(alternatives=...) takes True or False, not {alternatives!r}.")
    ctx = Context(rec, namespace, top)
    ctx.toolbox = toolbox
    ctx.alternatives = alternatives
    ctx.progress = _Progress(_interactive() if progress is None else bool(progress))
    try:
        return _run(ctx)
    finally:
        ctx.progress.done()
        if getattr(ctx, "bench", None) is not None:
            ctx.bench.close()  # the copies kept for fixes' next runs


def _interactive() -> bool:
    """Whether a progress line is wanted by default: a terminal, or a notebook's kernel."""
    err = sys.stderr
    try:
        if err.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    return type(err).__module__.startswith("ipykernel")


class _Progress:
    """One line on stderr while the fixes run on copies, rewritten in place, cleared at the end:
    how many were measured on meta and how many ran for real, and the time so far. Said once the
    diagnosis has taken ``AFTER_S`` (a timer says it then, while a run may still be going), not
    before: a diagnosis of a small step is over before a line would help."""

    AFTER_S = 1.0

    def __init__(self, on: bool) -> None:
        self.on = on
        self.counts = {"meta": 0, "run": 0}
        self.t0 = time.perf_counter()
        self.width = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if on:
            self._timer = threading.Timer(self.AFTER_S, self._say)
            self._timer.daemon = True
            self._timer.start()

    def __call__(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if self.on and time.perf_counter() - self.t0 >= self.AFTER_S:
            self._say()

    def _say(self) -> None:
        with self._lock:
            if not self.on:
                return
            line = (f"gradscope: trying fixes on copies of your objects: {self.counts['meta']} measured on meta, "
                    f"{self.counts['run']} run for real ({time.perf_counter() - self.t0:.1f} s)")
            self.width = max(self.width, len(line))
            sys.stderr.write("\r" + line.ljust(self.width))
            sys.stderr.flush()

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self.on and self.width:
                sys.stderr.write("\r" + " " * self.width + "\r")
                sys.stderr.flush()
            self.on = False


def _run(self: Context) -> Diagnosis:
    rec = self.rec
    self.namespace_objects()
    holders = self.find_holders()
    kinds: dict[str, int] = {}
    modules: dict[str, int] = {}
    held: list[LiveTensor] = []
    for r in self.rows:
        kind = self.kind(r)
        kinds[kind] = kinds.get(kind, 0) + r.bytes
        mod = r.module or "(no module)"
        modules[mod] = modules.get(mod, 0) + r.bytes
        held.append(
            LiveTensor(
                bytes=r.bytes,
                kind=kind,
                shape=r.shape,
                dtype=r.dtype,
                module=r.module,
                node=r.node_name,
                order=r.order if r.node_name is not None else None,
                variable=self.names.get(r.key) if self.matchable(r) else None,
                via=None if r.reused else self.via.get(r.key),
                line=rec.held_line(r.key),
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
    resident = tuple((k, b) for k, b in resident if b > 0) if self.at_end() else ()
    by_module = tuple(sorted(modules.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top])
    findings = _findings(self, holders)
    room = self.measured[2] if self.measured else None
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
        largest=tuple(sorted(held, key=held_order)[: self.top]),
        holders=tuple(holders[: self.top]),
        findings=tuple(findings),
        notes=tuple(self.notes),
        budget_resident=self.held.budget_resident,
        step_peak=self.measured[0] if self.measured else None,
        step_resident=self.measured[1] if self.measured else 0,
        room=room.allowed if room is not None else None,
        device_budget=self.held.device,
        resident_by_variable=self.resident_by_variable() if self.at_end() else (),
        step_allocates=_most(room, self.measured_user) if room is not None else None,
        step=self.bench.source if getattr(self, "bench", None) is not None else "",
        totals_only=rec.allocation_key == "none" and bool(rec.timeline),
    )




# ----- findings -------------------------------------------------------------------------------
# NOTE [ findings are measured fixes ]: every finding names one fix, in the user's names, and
# says what it saves (``saves_bytes``): the recording's peak (at a failure: what the refused
# allocation asked for on top of what was live) minus the fix's predicted peak. The fix's peak
# is the block's allocation timeline replayed without what the fix removes (see
# `replay`), plus, where the fix is a gradscope strategy or another way to run the model,
# that way's own peak, measured on a copy of the user's model with inputs of the recorded
# shapes (see `proxy_peak`). A fix whose predicted saving is under a tenth of the peak is not
# suggested. Advice that would change the result is never given: a model whose gradients
# were accumulated, or that a create_graph gradient is taken through, is never frozen or run
# under no_grad; values a later backward differentiates are never turned into numbers; a
# model with batch-norm statistics is checkpointed only with its statistics kept exact.
def _run_limit(ctx: Context, source: str) -> int | None:
    """The most a run of a copy may hold before it is stopped, for a block with a loop that ran out of
    memory (see NOTE [ a bound on runs of copies ] in gradscope._analyses.diagnose.counts); None otherwise."""
    rec = ctx.rec
    if rec.oom is None and "out of memory" not in (rec.error or "").lower():
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    if not any(isinstance(node, ast.For | ast.While | ast.AsyncFor) for node in ast.walk(tree)):
        return None  # a step without a loop holds, run again, what it holds: its own peak, once
    budget = rec.oom.budget if rec.oom is not None else 0
    return max(RUN_LIMIT_FACTOR * max(rec.peak_bytes, budget), RUN_LIMIT_FLOOR)


def _bench(ctx: Context) -> Bench | None:
    """The user's step and variables, to run fixes on copies of (None: the block's source is unknown)."""
    if getattr(ctx, "bench", None) is None:
        code = ctx.step_code()
        if code is None or not ctx.ns:
            return None
        devices = {t.device.type for v in ctx.ns.values() for t in _first_tensors(v)}
        source, ns = code  # (a step that calls the user's own function: its body)
        # optimizer state and gradients that the block made (their storages are among its
        # allocations still alive at its end): the copies drop them (see NOTE [ copies start as
        # the block started ] in gradscope._analyses.diagnose.measure)
        made = {a.key for a in ctx.rec.allocations if a.free_at is None}
        ctx.bench = Bench(source, ns, device="cuda" if "cuda" in devices else "cpu",
                          fresh_optimizers=any(k in made for k in ctx.resident["optimizer state"]),
                          fresh_gradients=any(k in made for k in ctx.resident["gradients"]),
                          progress=getattr(ctx, "progress", None),
                          step_allocated=sum(a.bytes for a in ctx.rec.allocations),
                          room=lambda user: _room(ctx, user), limit=_run_limit(ctx, source))
    return ctx.bench


def _first_tensors(v: Any) -> Sequence[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, torch.nn.Module):
        return list(v.parameters())[:1]
    return []


def _checked(ctx: Context, fix: Any, f: Finding) -> Finding | None:
    """A pattern's fix, run: where the fix module can rewrite the user's step (``rewrite``), the
    rewritten step runs on copies like the toolbox's fixes (see NOTE [ nothing shown that was not
    run ] in gradscope._analyses.diagnose.measure) and replaces the pattern's code, with the measured saving;
    a rewrite that fails or changes a result leaves the finding without code (a note says why).
    Where no rewrite applies, the finding keeps no code and claims no saving (``ran=False``): its
    suggestion names the strategy, and the strategy's call in the user's names is kept aside
    (``sketch``), never printed as code to paste."""
    if not f.code:
        return f
    bench = _bench(ctx)
    rewrite = getattr(fix, "rewrite", None)
    user = None if bench is None or rewrite is None else bench.user()
    if bench is None or rewrite is None or user is None or user.error is not None or user.peak is None:
        return _unrun(f)
    codes = rewrite(ctx, f, bench.source)
    codes = [c for c in ([codes] if isinstance(codes, str | tuple) or codes is None else codes) if c]
    if not codes:
        return _unrun(f)
    for code in codes:  # the first rewriting that runs and keeps the results
        setup, step = code if isinstance(code, tuple) else ("", code)  # (once before the steps, the step)
        trial = bench.run(step, setup=setup)
        if trial.error is None and int(trial.peak or 0) < user.peak:  # worth running for real
            trial = bench.settled(trial)
        if trial.error is None and trial.same is not False:
            break
    if trial.error is not None and _fails_again(ctx, bench):
        return _unrun(f)
    if trial.error is not None or trial.same is False:
        why = (f"it failed on copies of your objects ({trial.error})" if trial.error is not None
               else f"it changes a result ({trial.worst_at} differs by {trial.worst:.1e}, relative)")
        ctx.notes.append(f"[{f.pattern}] its rewriting of your step is not shown: {why}.")
        return dataclasses.replace(f, code="", saves_bytes=None)
    saving = user.peak - int(trial.peak or 0)
    if saving <= 0:
        ctx.notes.append(f"[{f.pattern}] tried on copies of your objects: the step's peak {format_bytes(user.peak)} -> "
                         f"{format_bytes(trial.peak)}; not worth it.")
        # a pattern whose suggestion names a strategy beyond its rewriting keeps that suggestion, unrun
        return _unrun(f) if getattr(fix, "STRATEGY", False) else None
    room = _room(ctx, user)
    ratio, differs = _time_and_differences(user, trial)
    if _raises_later(ctx, f, user, trial):
        return dataclasses.replace(f, code="", saves_bytes=None)
    ctx.measured = (user.peak, user.resident, room)
    ctx.measured_user = user
    fits = None if room is None else _fits(trial, room)
    return dataclasses.replace(f, code=compose(setup, step), setup=setup, step=step, saves_bytes=saving,
                               peak_before=user.peak,
                               peak_after=trial.peak, fits=fits,
                               time_ratio=ratio, message=f.message + differs, compared=trial.compared,
                               allocates_before=_most(room, user), allocates_after=_most(room, trial))


def _change(room: Room | None, user: Any, trial: Any) -> str:
    """What a fix changed, in the budget's terms where there is one (see NOTE [ one budget ] in
    gradscope._analyses.diagnose.measure); of its first run alone where its next was not run (see NOTE [ runs a
    fix needs ] there)."""
    first = "" if trial.later is not None else " in its first run"
    if room is None:
        return f"the step's peak {format_bytes(user.peak)} -> {format_bytes(trial.peak)}{first}"
    return f"the step allocates up to {format_bytes(_most(room, user))} -> {format_bytes(_most(room, trial))}{first}"


def _most(room: Room | None, trial: Any) -> int | None:
    """The most a trial's step allocates at once over its runs, as the budget counts it."""
    if room is None or trial is None:
        return None
    first, later = room.allocates(trial)
    return max(first, later if later is not None else first)


def _not_worth(ctx: Context, f: Finding, user: Any, trial: Any, room: Room | None, fails: bool) -> bool:
    """Whether a fix saves too little to be shown (see ``worth_showing``), by its first run where its next
    was not run; a note says so."""
    peak = int(trial.peak or 0)
    fits = room is not None and (room.fits(trial) if trial.later is not None else room.fits_first(peak))
    if worth_showing(user, peak, room, fits):
        return False
    ctx.notes.append(f"[{f.pattern}] tried on copies of your objects: {_change(room, user, trial)}"
                     + (", still over the budget" if fails and not fits else "") + "; not worth it.")
    return True


def _not_run(f: Finding, trial: Any, room: Room | None, user: Any) -> str:
    """The note for a fix not run: the least its first run would hold, known from the user's step's
    own run, already keeps it from being shown (see NOTE [ runs a fix needs ] in gradscope._analyses.diagnose.measure)."""
    least = int(trial.bound)
    best = max(int(user.peak or 0) - least, 0)
    if room is not None:
        still = f"allocate at least {format_bytes(least - room.base)} at once" + (
            f", over the {format_bytes(room.allowed)} it may allocate," if not room.fits_first(least) else "")
    else:
        still = f"hold at least {format_bytes(least)} at once"
    return (f"[{f.pattern}] not run: your step's own run on copies of your objects, statement by statement, shows "
            f"that with this fix the step would still {still} and save at most {format_bytes(best)} of its peak "
            f"(under {MIN_SAVING:.0%}).")


def _fits(trial: Any, room: Room) -> bool:
    """Whether a fix's step fits ``room`` in its first run and the next (see NOTE [ two runs of a
    step ] in gradscope._analyses.diagnose.measure)."""
    return room.fits(trial)


def _unrun(f: Finding) -> Finding:
    """A finding whose code gradscope could not run on the user's step: nothing of it is shown as
    code or claimed as a saving (see NOTE [ nothing shown that was not run ] in
    gradscope._analyses.diagnose.measure)."""
    return dataclasses.replace(f, ran=False, sketch=f.code, code="", saves_bytes=None)


def _room(ctx: Context, user: Any) -> Room | None:
    """At a failure under a budget, what a fixed step may allocate (see NOTE [ one budget ] in
    gradscope._analyses.diagnose.measure). None otherwise."""
    budget = ctx.held.budget if ctx.moment == "failure" else None
    if budget is None:
        return None
    return Room(int(budget), ctx.held.budget_resident if ctx.held.device else 0, ctx.held.device, user.resident)


def _time_and_differences(user: Any, trial: Any) -> tuple[float | None, str]:
    """A fix's wall time over the user's step's on the copies, and the words naming the variables
    it leaves with other values."""
    ratio = None if not user.seconds or not trial.seconds else trial.seconds / user.seconds
    differs = (f"; afterwards {', '.join(trial.differs)} hold{'s' if len(trial.differs) == 1 else ''} other values "
               "than after your step") if trial.differs else ""
    return ratio, differs


def _raises_later(ctx: Context, f: Finding, user: Any, trial: Any) -> bool:
    """Whether a fix raises the peak of the step's next run (see NOTE [ two runs of a step ]);
    a note says so. A fix that fits the budget in both its runs does not, whatever the user's step's
    next run holds (see NOTE [ the user's step's next run ] in gradscope._analyses.diagnose.measure)."""
    if trial.later is None:
        return False
    room = _room(ctx, user)
    if room is not None and room.fits(trial):
        return False
    user = ctx.measured_user = ctx.bench.user_complete()
    if user.later is None or trial.later <= user.later:
        return False
    ctx.notes.append(f"[{f.pattern}] not shown: on copies of your objects, the step's peak {format_bytes(user.peak)} -> "
                     f"{format_bytes(trial.peak)}, and run again with what it left {format_bytes(user.later)} -> "
                     f"{format_bytes(trial.later)}.")
    return True


def _inside_a_loop(ctx: Context, source: str) -> str | None:
    """The note for a step whose backward runs inside a library's loop (Lightning's
    ``trainer.fit``, a ``transformers`` Trainer's ``train``): the block's code has no backward call
    to rewrite; what the recording says about where its forward ran is named. None when the block
    takes derivatives itself (``autograd.grad``) or calls no library object's method."""
    tree = ast.parse(source)
    if any(isinstance(n, ast.Call) and (isinstance(n.func, ast.Attribute) and n.func.attr in ("backward", "grad")
                                        or isinstance(n.func, ast.Name) and n.func.id in ("backward", "grad"))
           for n in ast.walk(tree)):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name)]
    owners = [(c, ctx.ns.get(c.func.value.id)) for c in calls]  # type: ignore[attr-defined]
    found = [(c, type(o).__module__.split(".")[0]) for c, o in owners
             if o is not None and not isinstance(o, torch.Tensor | torch.nn.Module | torch.optim.Optimizer)
             and type(o).__module__.split(".")[0] not in ("__main__", "builtins", "torch", "gradscope")]
    if not found:
        return None
    call, library = found[0]
    what = ast.unparse(call.func)
    counts: dict[int, int] = {}
    for n in ctx.rec.nodes:
        if n.line is not None and n.order == 0:
            counts[n.line] = counts.get(n.line, 0) + 1
    line = ctx.rec.line_label(max(counts, key=lambda k: (counts[k], -k))) if counts else None
    return (f"your block's code calls no backward itself: its forward and backward ran inside `{what}`"
            + (f" ({library}'s loop)" if library else "") + (f", the forward mostly at {line}" if line else "")
            + "; the fixes that rewrite a step were tried on the block's code as it is, and the patterns above "
            "come from the recording. To try them on your step itself, record the step's own code (the body of "
            "your training step with its backward) in the block.")


def _toolbox(ctx: Context) -> list[Finding]:
    """The toolbox's fixes for the step, each run on copies; those that fail, change a result or
    save nothing are named in a note instead."""
    bench = _bench(ctx)
    if bench is None:
        ctx.notes.append("the block's source is unknown (a loaded recording, or a block not entered by a with "
                         "statement): fixes that rewrite the step were not tried.")
        return []
    shape = shape_of(bench.source)
    user = bench.user()
    if shape is None or user.error is not None or user.peak is None:
        _could_not_run(ctx, user.error)
        return []
    room = _room(ctx, user)
    ctx.measured = (user.peak, user.resident, room)
    ctx.measured_user = user
    loop = _inside_a_loop(ctx, bench.source) if shape.backward is None and ctx.rec.backward_calls else None
    if loop:
        ctx.notes.append(loop)
    fails = room is not None and not room.fits(user)
    if room is not None and not fails:
        first, later = room.allocates(user)
        ctx.notes.append(f"your step, run twice on copies of your objects, allocates at most "
                         f"{format_bytes(max(first, later or 0))} at once, within the {format_bytes(room.allowed)} "
                         "it may allocate: the failure depended on state the copies do not have.")
    out: list[Finding] = []
    for i, fix in enumerate(TOOLBOX):
        for f, trial in fix.propose(ctx, bench, shape, room):
            if trial.error is not None:
                if _fails_again(ctx, bench):
                    return []
                ctx.notes.append(_failed_on_copies(ctx, f.pattern, trial.error))
                continue
            if trial.bound is not None:  # see NOTE [ runs a fix needs ] in gradscope._analyses.diagnose.measure
                ctx.notes.append(_not_run(f, trial, room, user))
                continue
            first = int(trial.peak or 0)
            if not worth_showing(user, first, room, room is not None and room.fits_first(first)) or trial.complete:
                if _not_worth(ctx, f, user, trial, room, fails):  # (decided by its first run alone, or by both)
                    continue
            if f.pattern == "autocast" and not fails:
                continue  # a change of precision is advice for a step that does not fit
            trial = bench.settled(trial)  # worth showing by its memory: its results compared, its next run
            user = bench.user()
            if trial.error is not None:
                if _fails_again(ctx, bench):
                    return []
                ctx.notes.append(_failed_on_copies(ctx, f.pattern, trial.error))
                continue
            if trial.same is False:
                ctx.notes.append(f"[{f.pattern}] not shown: it changes a result ({trial.worst_at} differs by "
                                 f"{trial.worst:.1e}, relative; {trial.compared or COMPARED_PLAIN}).")
                continue
            saving = int(user.peak or 0) - int(trial.peak or 0)
            fits = None if room is None else _fits(trial, room)
            if _raises_later(ctx, f, user, trial) or _not_worth(ctx, f, user, trial, room, fails):
                continue
            finish = getattr(fix, "finish", None)
            if finish is not None:
                f = finish(f, trial)
            ratio, note = _time_and_differences(user, trial)
            if trial.freed:
                note += f"; after the step {trial.freed} gradients are None (applied and freed) where yours kept them"
            out.append(dataclasses.replace(
                f, bytes=saving, saves_bytes=saving, peak_before=user.peak, peak_after=trial.peak, fits=fits,
                time_ratio=ratio, message=f.message + note, compared=trial.compared,
                allocates_before=_most(room, user), allocates_after=_most(room, trial),
                tolerance=f.tolerance if f.tolerance is not None and f.tolerance > 1e-4 else None))
            if fits and not ctx.alternatives:  # see NOTE [ the first fix that fits ] in measure
                rest = [t.PATTERN for t in TOOLBOX[i + 1:]]
                if rest:
                    ctx.notes.append(_not_tried(f.pattern, rest))
                return out
    return out


def _not_tried(fitting: str, rest: Sequence[str]) -> str:
    """The note for the toolbox's fixes not tried after one fitted (see NOTE [ the first fix that fits ]
    in gradscope._analyses.diagnose.measure)."""
    return (f"[{fitting}] fits the budget: the fixes after it ({', '.join(rest)}) were not tried, each a few more "
            "runs of your step; gs.diagnose(..., alternatives=True) tries them too.")


def _fails_again(ctx: Context, bench: Bench) -> bool:
    """Where a fix failed on copies: whether the user's own step fails there too, run a second time
    (see NOTE [ the user's step's next run ] in gradscope._analyses.diagnose.measure): a step that
    appends its graphs to a list made outside it back-propagates through the first run's again. Then
    no fix that rewrites the step is shown, and a note (once) says why."""
    user = bench.user_complete()
    if user.error is None:
        return False
    _could_not_run(ctx, user.error)
    return True


def _could_not_run(ctx: Context, error: str | None) -> None:
    """The note (once: a fix's failure may have said it already, see ``_fails_again``) that the user's
    step could not be run on copies, so no fix that rewrites it was tried."""
    note = f"your step could not be run on copies of your objects ({error}): fixes that rewrite it were not tried."
    if note not in ctx.notes:
        ctx.notes.append(note)


def _failed_on_copies(ctx: Context, pattern: str, error: str) -> str:
    """The note for a fix whose code failed on copies. Copies of a GPU's objects run on that GPU,
    beside what the user's variables still hold after the failure (a graph kept by ``out``): a fix
    that ran out of memory there is named with what holds the most, so that the user can free it and
    diagnose again (on an H200, checkpointing a GPT-2 that fits in 277 MiB failed so beside the
    500 MiB graph its cell's ``out`` kept)."""
    if not error.startswith("OutOfMemoryError"):
        return f"[{pattern}] not shown: its code failed on copies of your objects ({error})."
    held = resident_by_variable(ctx.ns, device_type="cuda")  # (the CPU raises no OutOfMemoryError)
    for h in ctx.holders:
        held[h.variable] = held.get(h.variable, 0) + h.live_bytes
    return _oom_on_copies_note(pattern, error, held)


def _oom_on_copies_note(pattern: str, error: str, held: Mapping[str, int]) -> str:
    """The words for a fix that ran out of memory on copies, ``held``: bytes by variable."""
    top = sorted(((v, b) for v, b in held.items() if b > 0), key=lambda kv: (-kv[1], kv[0]))[:3]
    first = error.split(". ")[0]
    beside = (" beside what your variables still hold (" + ", ".join(f"`{v}` {format_bytes(b)}" for v, b in top) + ")"
              if top else "")
    return (f"[{pattern}] not shown: it ran out of memory on copies of your objects{beside} ({first}); "
            "free what you no longer need (del ...) and diagnose again.")


def _findings(self: Context, holders: list[GraphHolder]) -> list[Finding]:
    self.g = IndexedRecording(self.rec)
    self.holders = holders
    self.demand = self.demand_bytes()
    cut = inplace_cut.propose(self, holders)
    if cut:
        return [_unrun(f) for f in cut]  # the block raised for a reason no memory advice addresses
    found = [(fix, f) for fix in REGISTRY for f in fix.propose(self, holders)]
    # a pattern whose fix rewrites the step is measured on copies (its estimate is not its claim)
    found = [(fix, f) for fix, f in found if f.saves_bytes is None or f.saves_bytes >= self.worth()
             or (getattr(fix, "rewrite", None) is not None and self.moment == "failure")]
    wanted = self.toolbox if self.toolbox is not None else self.moment == "failure"
    with quiet_logging():  # once for every run on copies
        out = [c for c in (_checked(self, fix, f) for fix, f in found) if c is not None]
        tools = _toolbox(self) if wanted else []
    mine = {f.pattern for f in tools}
    out = [f for f in out if f.pattern not in mine] + tools
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

