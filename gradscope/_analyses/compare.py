"""``gs.compare``: run several ways of computing the same thing, side by side, from identical state.

Each candidate is a zero-argument callable. It runs once unrecorded to find the state it involves
(this run also warms caches up and is not timed), once under :class:`gradscope.record` (peak bytes,
saved bytes, the full recording; not timed either: recording costs time) and ``repeat`` more times
without recording; the time is the median of those ``repeat`` runs, with their min and max. Before
every run the state is put back: the torch RNG (CPU, and CUDA when initialized), the parameters,
buffers, train/eval flags and ``requires_grad`` flags of the modules involved, and the ``.grad`` of every
leaf involved (cleared). After the comparison everything is restored to how it was before the call.

NOTE [ how compare finds the state to restore ]: modules are those passed as ``modules=`` plus every
module whose forward runs in the candidate's first (unrecorded) run, snapshotted by a global forward pre-hook the first time
it is seen (before its forward can change it). Leaves are the modules' parameters plus every leaf tensor
that requires grad and is passed to a torch function in that run, found by a
``TorchFunctionMode``; the first time a leaf is seen its ``.grad`` is remembered and cleared (a leaf is
always used before backward can accumulate into it). Neither keeps a tensor alive: leaves are held by
weak reference; module snapshots hold copies of the values. Other state is not restored: an optimizer
created outside the candidates keeps its moments from one run to the next (create it inside the
candidate), and so does Python's or NumPy's RNG.

Example:
    >>> import torch, gradscope as gs
    >>> lin = torch.nn.Linear(3, 1)
    >>> x = torch.randn(8, 3)
    >>> def mean_then_backward():
    ...     loss = lin(x).pow(2).mean()
    ...     loss.backward()
    ...     return loss
    >>> def sum_scaled():
    ...     loss = lin(x).pow(2).sum() / 8
    ...     loss.backward()
    ...     return loss
    >>> def forgot_backward():
    ...     return lin(x).pow(2).mean()
    >>> cmp = gs.compare({"mean": mean_then_backward, "sum": sum_scaled, "no_backward": forgot_backward},
    ...                  memory="off")
    >>> [(r.name, r.status) for r in cmp.rows]
    [('mean', 'ok'), ('sum', 'ok'), ('no_backward', 'wrong')]
    >>> lin.weight.grad is None  # compare leaves no trace
    True
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._model.figures import saved_activation_bytes
from gradscope._model.recording import Recording, atomic_write_text

__all__ = ["SPREAD_LIMIT", "Comparison", "Row", "compare", "saved_total", "tolerance"]

STATUSES = ("ok", "wrong", "raised")

# (rtol, atol) per dtype; a tensor passes when max|a - b| <= atol + rtol * max|reference|.
# Scaling by the reference's largest magnitude (not element-wise) keeps cancellation noise in
# near-zero entries from being reported as a wrong result.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.complex128: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.complex64: (1e-5, 1e-7),
    torch.float16: (1e-2, 1e-4),
    torch.bfloat16: (4e-2, 1e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The default ``(rtol, atol)`` that :func:`compare` uses for ``dtype`` (exact for non-float dtypes).

    Example:
        >>> import torch
        >>> tolerance(torch.float32)
        (1e-05, 1e-07)
    """
    return _TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass(frozen=True)
class Row:
    """One candidate's measurements.

    Attributes:
        name: the candidate's name.
        status: ``"ok"``, ``"wrong"`` (outputs or gradients differ from the reference beyond
            tolerance, a ``None`` where the reference has a tensor, a shape mismatch) or ``"raised"``.
        peak_bytes: peak of memory allocated inside the recorded run (None with ``memory="off"``).
        saved_bytes: :data:`gradscope.figures.SAVED_ALL` ("saved (all kinds)"): bytes kept alive
            by every tensor saved for backward, parameters and inputs included, each storage
            once. The table's "saved (total)" column is :func:`saved_total` (activations only).
        time_s: median wall time over the timed runs (None when the candidate raised).
        max_abs_error: largest absolute difference from the reference over outputs and gradients
            (0.0 for the reference itself; None when it cannot be computed).
        message: why the status is not ``ok`` (the exception's type and message for ``raised``).
        recording: the recording of the measured run.
        times_s: every timed run's time (after the warm-up; the recorded run is not timed).
        reference: whether this row is the reference.
        time_min_s: the fastest timed run.
        time_max_s: the slowest timed run.
        threads: ``torch.get_num_threads()`` while the candidate ran.
        run: which measurement round produced this row (1 for :func:`compare`, then one more per
            :meth:`Comparison.rerun`); rows of older rounds are stale next to newer ones.
    """

    name: str
    status: str
    peak_bytes: int | None
    saved_bytes: int | None
    time_s: float | None
    max_abs_error: float | None
    message: str
    recording: Recording | None
    times_s: tuple[float, ...] = ()
    reference: bool = False
    time_min_s: float | None = None
    time_max_s: float | None = None
    threads: int | None = None
    run: int = 1

    @property
    def time_spread(self) -> float | None:
        """Slowest over fastest timed run (None with fewer than two timed runs)."""
        if len(self.times_s) < 2 or not min(self.times_s) > 0:
            return None
        return max(self.times_s) / min(self.times_s)


def compare(
    candidates: Mapping[str, Callable[[], Any]],
    reference: str | None = None,
    repeat: int = 3,
    *,
    modules: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module] | None = None,
    memory: str = "auto",
    rtol: float | None = None,
    atol: float | None = None,
) -> Comparison:
    """Run each candidate from identical state and compare memory, time and results.

    Args:
        candidates: name -> zero-argument callable. A callable returns what should be checked: a
            tensor, ``None``, or a tuple / list / dict of those. The ``.grad`` of the leaves it touches
            (parameters included) is checked as well.
        reference: the candidate the others are checked against; the first one when omitted.
        repeat: timed runs per candidate, after a warm-up run and the recorded run (neither is
            timed); the time is their median, with min and max (``Row.time_min_s``/``time_max_s``).
        modules: modules whose state must be reset between candidates, as a module, an iterable, or
            a ``{"name": module}`` dict (names label the gradients in messages). Modules whose forward
            runs are found by themselves; see NOTE [ how compare finds the state to restore ].
        memory: passed to :class:`gradscope.record` (``"auto"``, ``"cpu"``, ``"cuda"``, ``"off"``...).
        rtol: relative tolerance instead of the per-dtype default (:func:`tolerance`).
        atol: absolute tolerance instead of the per-dtype default.

    Returns:
        A :class:`Comparison`; ``print(cmp.summary())`` shows the table.

    Raises:
        GradscopeError: no candidates, a candidate that is not callable, a ``reference`` that is not a
            candidate, ``repeat`` < 1, or a candidate returning something other than tensors.

    Example:
        >>> import torch, gradscope as gs
        >>> x = torch.randn(5, requires_grad=True)
        >>> cmp = gs.compare({"exp": lambda: x.exp(), "pow": lambda: torch.e ** x}, memory="off")
        >>> cmp.reference, [r.status for r in cmp.rows]
        ('exp', ['ok', 'ok'])
    """
    cmp = Comparison(candidates, reference, repeat, modules=modules, memory=memory, rtol=rtol, atol=atol)
    cmp._run_all()
    return cmp


class Comparison:
    """The result of :func:`compare`: one :class:`Row` per candidate, in the order given.

    ``rows``, ``reference``, ``summary()``, ``rerun(names)``, ``to_html(path)``; in a notebook it
    displays itself as the comparison widget.

    Example:
        >>> import torch, gradscope as gs
        >>> x = torch.randn(5, requires_grad=True)
        >>> cmp = gs.compare({"a": lambda: x.sin(), "b": lambda: x.cos()}, memory="off")
        >>> cmp.row("b").status, cmp.row("b").message.startswith("output: max abs error")
        ('wrong', True)
    """

    def __init__(
        self,
        candidates: Mapping[str, Callable[[], Any]],
        reference: str | None = None,
        repeat: int = 3,
        *,
        modules: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module] | None = None,
        memory: str = "auto",
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        if not isinstance(candidates, Mapping) or not candidates:
            raise GradscopeError(
                "gradscope: compare() takes a non-empty dict {name: zero-argument callable}, "
                f"got {type(candidates).__name__ if not isinstance(candidates, Mapping) else 'an empty dict'}."
            )
        for name, fn in candidates.items():
            if not isinstance(name, str):
                raise GradscopeError(f"gradscope: candidate names must be strings, got {name!r}.")
            if not callable(fn):
                raise GradscopeError(
                    f"gradscope: candidate {name!r} is a {type(fn).__name__}, not a callable; pass a "
                    "zero-argument function, e.g. lambda: mixed_grad(f, G, z, y)."
                )
        if reference is None:
            reference = next(iter(candidates))
        if reference not in candidates:
            raise GradscopeError(
                f"gradscope: reference {reference!r} is not a candidate; use one of "
                f"{', '.join(map(repr, candidates))}."
            )
        if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
            raise GradscopeError(f"gradscope: repeat must be an int >= 1, got {repeat!r}.")
        self._candidates = dict(candidates)
        self.reference: str = reference
        self.repeat = repeat
        self.memory = memory
        self._rtol = rtol
        self._atol = atol
        self._lock = threading.RLock()
        self._state = _Baseline(modules)
        # Modules passed by name also name the recordings' module paths ("G.0.weight").
        self._names = {k: m for k, m in _modules_arg(modules) if k} or None
        self._ref_outputs: list[tuple[str, torch.Tensor | None]] | None = None
        self._ref_grads: dict[int, tuple[str, torch.Tensor | None]] = {}
        self._rows: dict[str, Row] = {}
        self._round = 1  # the measurement round; see Row.run

    # ----- public ------------------------------------------------------------------------
    @property
    def rows(self) -> list[Row]:
        """One row per candidate, in the order the candidates were given."""
        rows = self._rows
        return [rows[n] for n in self._candidates if n in rows]

    @property
    def names(self) -> list[str]:
        """The candidates' names, in order."""
        return list(self._candidates)

    def row(self, name: str) -> Row:
        """The row of candidate ``name``."""
        if name not in self._rows:
            raise GradscopeError(
                f"gradscope: no candidate {name!r}; candidates: {', '.join(map(repr, self.names))}."
            )
        return self._rows[name]

    def rerun(self, names: Iterable[str] | None = None) -> None:
        """Measure the named candidates (all of them when ``names`` is None) again, in place, from
        the state captured by :func:`compare`.

        Every run starts from the modules, RNG and gradients as they were when :func:`compare` first
        saw them; afterwards the current state (the model may have been trained since) is given back.
        Safe to call from a background thread while the notebook is idle; calls are serialized.
        Re-running the reference refreshes the values the others were checked against. The rows
        re-measured get the next round number (``Row.run``); rows left out are :meth:`stale`.
        """
        names = list(self._candidates) if names is None else [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in self._candidates]
        if unknown:
            raise GradscopeError(
                f"gradscope: rerun() got unknown candidate(s) {', '.join(map(repr, unknown))}; "
                f"candidates: {', '.join(map(repr, self.names))}."
            )
        with self._lock:
            self._round += 1
            held = self._state.hold()
            try:
                # the reference first, so that the others are checked against its fresh values
                for name in sorted(names, key=lambda n: n != self.reference):
                    self._measure(name)
            finally:
                self._state.restore_original()  # what this rerun saw first...
                self._state.give_back(held)  # ...and what existed before it, as it was then

    def stale(self) -> list[str]:
        """Candidates measured in an earlier round than the newest row: after re-running some
        candidates only, these would compare an old run with a new one."""
        rows = self.rows
        latest = max((r.run for r in rows), default=1)
        return [r.name for r in rows if r.run < latest]

    def best(self) -> dict[str, list[str]]:
        """Per column (``peak``, ``saved``, ``time``), the candidates with the best (lowest) value
        among those whose status is ``ok`` and that are not :meth:`stale`; ties share it."""
        return _best(self)

    def summary(self) -> str:
        """The comparison as a text table (deterministic apart from the times; its view:
        ``gradscope.report``)."""
        return str(_views.render(_views.ViewKind.TEXT, self))

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """One self-contained HTML page of the comparison. With ``path``, writes it there and
        returns the path; without, returns the page's text."""
        html = str(_views.render(_views.ViewKind.HTML, self))  # NOTE [ one registry of views ] in gradscope._base.registry
        if path is None:
            return html
        atomic_write_text(os.fspath(path), html)
        return os.fspath(path)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return _views.display(self)

    def __repr__(self) -> str:
        parts = ", ".join(f"{r.name}={r.status}" for r in self.rows)
        return f"Comparison(reference={self.reference!r}: {parts})"

    # ----- running -----------------------------------------------------------------------
    def _run_all(self) -> None:
        with self._lock:
            try:
                self._measure(self.reference)
                for name in self._candidates:
                    if name != self.reference:
                        self._measure(name)
            finally:
                self._state.restore_original()

    def _measure(self, name: str) -> None:
        from gradscope._capture.record import record

        fn = self._candidates[name]
        state = self._state
        is_ref = name == self.reference
        # A first, unrecorded run finds the modules and leaves involved and snapshots them at first
        # sight (see NOTE [ how compare finds the state to restore ]), so that the recorded run
        # carries none of compare's own hooks or copies. It also warms caches; it is not timed.
        seen = _Seen(state)
        state.reset()
        try:
            with state.watch(seen):
                out = fn()
            del out
        except Exception:  # the recorded run below raises too, and reports it
            pass
        state.reset(known=seen)
        rec = record(memory=self.memory, label=name, modules=self._names)
        error: BaseException | None = None
        outputs: Any = None
        times: list[float] = []
        threads = torch.get_num_threads()
        try:
            with rec:
                outputs = fn()
                _sync()
        except GradscopeError as e:
            if "gs.record blocks cannot be nested" in str(e):
                raise
            error = e
        except Exception as e:
            error = e
        recording = rec.recording
        peak, saved = _memory_of(recording)
        if error is not None:
            message = f"{type(error).__name__}: {error}"
            self._rows[name] = Row(
                name, "raised", peak, saved, None, None, message, recording, (), is_ref,
                threads=threads, run=self._round,
            )
            if is_ref:
                self._ref_outputs = None
                self._ref_grads = {}
            return
        try:
            flat = _flatten(outputs, name)
        except GradscopeError:
            state.restore_original()
            raise
        grads = state.grads_of(seen)
        del outputs
        if is_ref:
            self._ref_outputs = [(p, None if t is None else t.detach().clone()) for p, t in flat]
            self._ref_grads = {
                k: (n, None if g is None else g.detach().clone()) for k, (n, g) in grads.items()
            }
            status, err, message = "ok", 0.0, ""
        elif self._ref_outputs is None:
            status, err, message = "ok", None, f"not checked: the reference {self.reference!r} raised"
        else:
            status, err, message = self._check(flat, grads)
        del flat, grads
        # NOTE [ what is timed ]: the first run warms caches up and the recorded run pays for the
        # recording (1.1x to 7x on small ops), so neither is timed: the time is the median of
        # `repeat` plain runs after them, kept with its min and max so a busy machine shows.
        for _ in range(self.repeat):
            state.reset(known=seen)
            try:
                _sync()
                t0 = time.perf_counter()
                out = fn()
                _sync()
                times.append(time.perf_counter() - t0)
                del out
            except Exception as e:  # a candidate that raises only sometimes
                message = f"{type(e).__name__}: {e} (in a timing run)"
                self._rows[name] = Row(
                    name, "raised", peak, saved, None, None, message, recording, tuple(times), is_ref,
                    threads=threads, run=self._round,
                )
                return
        self._rows[name] = Row(
            name, status, peak, saved, statistics.median(times), err, message, recording, tuple(times), is_ref,
            time_min_s=min(times), time_max_s=max(times), threads=threads, run=self._round,
        )

    def _check(
        self, flat: list[tuple[str, torch.Tensor | None]], grads: dict[int, tuple[str, torch.Tensor | None]]
    ) -> tuple[str, float | None, str]:
        assert self._ref_outputs is not None
        problems: list[str] = []
        worst = 0.0
        incomparable = False  # a None, shape or structure mismatch: no error figure is meaningful
        ref = self._ref_outputs
        if [p for p, _ in flat] != [p for p, _ in ref]:
            incomparable = True
            problems.append(f"output structure differs: {_paths(flat)} vs the reference's {_paths(ref)}")
            pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
        else:
            pairs = [(p, a, b) for (p, a), (_, b) in zip(flat, ref, strict=True)]
        for key, (gname, ref_grad) in self._ref_grads.items():
            cand = grads.get(key, (gname, None))[1]
            pairs.append((f"{gname}.grad", cand, ref_grad))
        for path, got, want in pairs:
            if want is None and got is None:
                continue
            if got is None:
                incomparable = True
                problems.append(f"{path} is None where the reference has a tensor")
                continue
            if want is None:
                incomparable = True
                problems.append(f"{path} is a tensor where the reference has None")
                continue
            if got.shape != want.shape:
                incomparable = True
                problems.append(
                    f"{path}: shape mismatch {tuple(got.shape)} vs the reference's {tuple(want.shape)}"
                )
                continue
            e, bad = self._error(got, want)
            worst = max(worst, e)
            if bad:
                problems.append(bad.format(path=path))
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            # an error figure over only part of the results would read as "close": leave it out
            return "wrong", None if incomparable else worst, "; ".join(problems[:3]) + more
        return "ok", worst, ""

    def _error(self, got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
        """Max abs error and, when beyond tolerance, a message template with ``{path}``."""
        if got.numel() == 0:
            return 0.0, ""
        g = got.detach().to("cpu")
        w = want.detach().to("cpu")
        if not (w.is_floating_point() or w.is_complex()):
            diff = (
                (g.to(torch.float64) - w.to(torch.float64)).abs().max().item()
                if g.dtype != torch.bool
                else float((g != w).sum().item())
            )
            return diff, (
                "" if diff == 0 else "{path}: differs from the reference (max abs error " + f"{diff:.3g})"
            )
        g64 = g.to(torch.complex128 if w.is_complex() else torch.float64)
        w64 = w.to(g64.dtype)
        nan_g, nan_w = torch.isnan(g64), torch.isnan(w64)
        if not torch.equal(nan_g, nan_w):
            return math.inf, "{path}: NaN where the reference has none (or the other way round)"
        both = ~nan_w
        d = (g64 - w64).abs()[both]
        scale = w64.abs()[both]
        err = d.max().item() if d.numel() else 0.0
        if math.isnan(err):  # inf - inf
            same_inf = torch.equal(g64[both], w64[both])
            return (0.0, "") if same_inf else (math.inf, "{path}: infinities differ from the reference")
        rtol, atol = tolerance(w.dtype)
        rtol = self._rtol if self._rtol is not None else rtol
        atol = self._atol if self._atol is not None else atol
        limit = atol + rtol * (scale.max().item() if scale.numel() else 0.0)
        if err > limit:
            return err, "{path}: max abs error " + f"{err:.3g} above the tolerance {limit:.3g} ({w.dtype})"
        return err, ""


# ----- state capture and restore ----------------------------------------------------------
class _Seen:
    """What one recorded run touched: leaf keys (see NOTE [ how compare finds the state to restore ])."""

    def __init__(self, state: _Baseline) -> None:
        self.state = state
        self.leaves: set[int] = set()


class _Baseline:
    """The state every run of the comparison starts from: the random generators, the modules'
    parameters and buffers, the leaves' gradients (see NOTE [ how compare finds the state to restore ])."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module] | None) -> None:
        self.cuda = torch.cuda.is_available()
        self.rng_cpu = torch.get_rng_state()
        self.rng_cuda = torch.cuda.get_rng_state_all() if self.cuda else None
        self.covered: dict[
            int, nn.Module
        ] = {}  # id -> module, every module with a snapshot (with submodules)
        self.snapshots: list[_ModuleSnapshot] = []
        self.leaves: dict[int, _Leaf] = {}  # keyed by id, checked against the weak reference
        self.root_names: dict[int, str] = {}
        self._class_counts: dict[str, int] = {}
        self._tensor_count = 0
        for name, m in _modules_arg(modules):
            self.adopt(m, name)

    # modules
    def adopt(self, m: nn.Module, name: str | None = None) -> None:
        if id(m) in self.covered and self.covered[id(m)] is m:
            return
        if name is None:
            cls = type(m).__name__
            k = self._class_counts.get(cls, 0) + 1
            self._class_counts[cls] = k
            name = cls if k == 1 else f"{cls}#{k}"
        self.snapshots.append(_ModuleSnapshot(m))
        for sub in m.modules():
            self.covered[id(sub)] = sub
        for pname, p in m.named_parameters():
            self.see_leaf(p, f"{name}.{pname}" if name else pname)

    # leaves
    def see_leaf(self, t: torch.Tensor, name: str | None = None) -> int:
        key = id(t)
        leaf = self.leaves.get(key)
        if leaf is None or leaf.ref() is not t:
            if name is None:
                self._tensor_count += 1
                name = f"tensor#{self._tensor_count}{tuple(t.shape)}"
            self.leaves[key] = _Leaf(weakref.ref(t), name, t.grad)
        return key

    def grads_of(self, seen: _Seen) -> dict[int, tuple[str, torch.Tensor | None]]:
        out: dict[int, tuple[str, torch.Tensor | None]] = {}
        for key in seen.leaves | self._param_keys():
            leaf = self.leaves.get(key)
            if leaf is None:
                continue
            t = leaf.ref()
            if t is not None:
                out[key] = (leaf.name, t.grad)
        return out

    def _param_keys(self) -> set[int]:
        return {id(p) for s in self.snapshots for p in s.params}

    def reset(self, known: _Seen | None = None) -> None:
        """Before a run: RNG, module state, cleared gradients."""
        torch.set_rng_state(self.rng_cpu)
        if self.rng_cuda is not None:
            torch.cuda.set_rng_state_all(self.rng_cuda)
        for s in self.snapshots:
            s.restore()
        keys = set(self.leaves) if known is None else known.leaves | self._param_keys()
        for key in keys:
            leaf = self.leaves.get(key)
            t = None if leaf is None else leaf.ref()
            if t is not None:
                t.grad = None

    def restore_original(self) -> None:
        """After the comparison: everything as it was before it (the state first seen)."""
        self.reset()
        for leaf in self.leaves.values():
            t = leaf.ref()
            if t is not None:
                t.grad = leaf.original_grad
            leaf.original_grad = None  # given back: holding it longer would keep it alive
        self.leaves = {k: v for k, v in self.leaves.items() if v.ref() is not None}

    def hold(self) -> _Checkpoint:
        """The current state of everything known, to give back after a rerun (the user may have
        trained the model since the comparison: a rerun must not undo that)."""
        return _Checkpoint(self)

    def give_back(self, held: _Checkpoint) -> None:
        torch.set_rng_state(held.rng_cpu)
        if held.rng_cuda is not None:
            torch.cuda.set_rng_state_all(held.rng_cuda)
        for snap in held.modules:
            snap.restore()
        for ref, grad in held.grads:
            t = ref()
            if t is not None:
                t.grad = grad

    def watch(self, seen: _Seen) -> _Watch:
        return _Watch(self, seen)


class _Checkpoint:
    """The state as it is now, given back after a rerun (see :meth:`_Baseline.hold`)."""

    def __init__(self, state: _Baseline) -> None:
        self.rng_cpu = torch.get_rng_state()
        self.rng_cuda = torch.cuda.get_rng_state_all() if state.cuda else None
        self.modules = [_ModuleSnapshot(s.module) for s in state.snapshots]
        self.grads = [(leaf.ref, t.grad) for leaf in state.leaves.values() if (t := leaf.ref()) is not None]


class _Leaf:
    __slots__ = ("ref", "name", "original_grad")

    def __init__(self, ref: weakref.ref[torch.Tensor], name: str, original_grad: torch.Tensor | None) -> None:
        self.ref = ref
        self.name = name
        self.original_grad = original_grad


class _ModuleSnapshot:
    def __init__(self, m: nn.Module) -> None:
        self.module = m
        self.params = [p for p in m.parameters()]
        self.values = [(t, t.detach().clone()) for t in [*self.params, *m.buffers()]]
        self.flags = [(p, p.requires_grad) for p in self.params]
        self.training = [(sub, sub.training) for sub in m.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for t, v in self.values:
                if t.shape == v.shape:
                    t.copy_(v)
        for p, flag in self.flags:
            p.requires_grad_(flag)
        for sub, training in self.training:
            sub.training = training


class _Watch:
    """During a recorded run: snapshot modules and leaves at first sight (global pre-hook + mode)."""

    def __init__(self, state: _Baseline, seen: _Seen) -> None:
        self.state = state
        self.seen = seen
        self.mode = _LeafMode(self)
        self.handle: Any = None
        self.busy = False  # our own snapshot copies must not count as the candidate's use
        self.tid = threading.get_ident()

    def __enter__(self) -> _Watch:
        self.handle = nn.modules.module.register_module_forward_pre_hook(self._pre)
        try:
            self.mode.__enter__()
        except BaseException:
            self.handle.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            self.handle.remove()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() != self.tid:  # the hook is global; other threads' modules are not ours
            return
        state = self.state
        if state.covered.get(id(module)) is not module:
            self.busy = True
            try:
                state.adopt(module)
            finally:
                self.busy = False
        for p in module.parameters(recurse=False):
            key = id(p)
            if key not in self.seen.leaves:
                self.seen.leaves.add(key)
                p.grad = None

    def leaf(self, t: torch.Tensor) -> None:
        key = id(t)
        if key in self.seen.leaves:
            return
        state = self.state
        state.see_leaf(t)
        self.seen.leaves.add(key)
        t.grad = None


class _LeafMode(TorchFunctionMode):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if threading.get_ident() == self.watch.tid and not self.watch.busy:
            for a in _tensors(args, kwargs):
                try:
                    if a.requires_grad and a.is_leaf:
                        self.watch.leaf(a)
                except (RuntimeError, TypeError, AttributeError):  # functorch-wrapped tensors
                    pass
        return func(*args, **(kwargs or {}))


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list | tuple):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                yield a


def _modules_arg(modules: Any) -> list[tuple[str | None, nn.Module]]:
    if modules is None:
        return []
    if isinstance(modules, nn.Module):
        return [(None, modules)]
    if isinstance(modules, Mapping):
        items = list(modules.items())
    else:
        try:
            items = [(None, m) for m in modules]
        except TypeError:
            items = [("", modules)]
    for k, m in items:
        if not isinstance(m, nn.Module):
            raise GradscopeError(
                f"gradscope: modules= takes nn.Module objects (one, a list, or a dict name -> module); "
                f"{'entry ' + repr(k) if k else 'an entry'} is a {type(m).__name__}."
            )
    return [(None if k is None else str(k), m) for k, m in items]


# ----- outputs --------------------------------------------------------------------------------
def _flatten(obj: Any, name: str, path: str = "output") -> list[tuple[str, torch.Tensor | None]]:
    out: list[tuple[str, torch.Tensor | None]] = []
    stack: list[tuple[str, Any]] = [(path, obj)]
    while stack:  # iterative, in order
        p, o = stack.pop()
        if o is None or isinstance(o, torch.Tensor):
            out.append((p, o))
        elif isinstance(o, tuple | list):
            stack.extend(reversed([(f"{p}[{i}]", v) for i, v in enumerate(o)]))
        elif isinstance(o, Mapping):
            stack.extend(reversed([(f"{p}[{k!r}]", v) for k, v in o.items()]))
        else:
            raise GradscopeError(
                f"gradscope: candidate {name!r} returned a {type(o).__name__} at {p}; compare() expects a "
                "tensor, None, or a tuple / list / dict of tensors (return the loss, gradients or outputs "
                "to check, e.g. torch.tensor(value) for a number)."
            )
    return out


def _paths(flat: list[tuple[str, Any]]) -> str:
    names = [p for p, _ in flat]
    return "[" + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") + "]"


def _memory_of(recording: Recording | None) -> tuple[int | None, int | None]:
    if recording is None:
        return None, None
    peak = recording.peak_bytes if recording.where.measured else None
    return peak, recording.saved_bytes


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----- text -------------------------------------------------------------------------------------
SPREAD_LIMIT = 2.0  # slowest / fastest timed run above this: the time is not trustworthy


def saved_total(row: Row) -> int | None:
    """:data:`gradscope.figures.SAVED_TOTAL` of a row's recorded run (None without a recording)."""
    if row.recording is None:
        return None
    return saved_activation_bytes(row.recording)


def _best(cmp: Comparison) -> dict[str, list[str]]:
    stale = set(cmp.stale())
    rows = [r for r in cmp.rows if r.status == "ok" and r.name not in stale]
    out: dict[str, list[str]] = {"peak": [], "saved": [], "time": []}
    if len(cmp.rows) < 2:
        return out
    getters: tuple[tuple[str, Callable[[Row], float | None]], ...] = (
        ("peak", lambda r: r.peak_bytes),
        ("saved", saved_total),
        ("time", lambda r: r.time_s),
    )
    for col, get in getters:
        vals = [(v, r.name) for r in rows if (v := get(r)) is not None]
        if vals:
            low = min(v for v, _ in vals)
            out[col] = [n for v, n in vals if v == low]
    return out
