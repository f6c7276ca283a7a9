"""The notebook's per-shell state and a recorded cell (``%%gradscope``): the budget a cell runs
under, what earlier cells hold, the recording kept in the namespace and shown (the extension is
:mod:`gradscope._notebook.ipython`; the OOM watch :mod:`gradscope._notebook.oom`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from IPython.core.error import UsageError

from gradscope._base.errors import GradscopeError, MemoryBudgetExceeded
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.units import parse_size
from gradscope._model.recording import Recording, format_bytes

__all__ = ["RECORDING_NAME", "last_diagnosis"]

_MEMORY_CHOICES = ("auto", "cpu", "cuda", "off", "tracker")
_RECORDING_MARKERS = ("%%gradscope", "gs.record(", "gradscope.record(")

#: Where a cell's recording is kept in the user namespace when ``%%gradscope`` has no ``-o NAME``
#: and where ``%gradscope oom on`` keeps the recording of a cell that ran out of memory.
RECORDING_NAME = "_gs_recording"


@dataclass
class _State:
    """What loading changed on one shell, and the extension's live state."""

    magics: Any = None
    saved_line: Any = None  # magics of the same name that loading replaced
    saved_cell: Any = None
    saved_registry: Any = None
    oom: bool = False
    oom_budget: int | None = None
    oom_memory: MemoryKind = MemoryKind.OFF  # set by %gradscope oom on
    oom_cell_only: bool = False  # oom on --cell-only: budgets count only what each cell allocates
    saved_custom_exceptions: tuple[type[BaseException], ...] = ()
    saved_custom_tb: Any = None
    custom_tb_was_instance: bool = False
    callbacks: list[tuple[str, Any]] = field(default_factory=list)
    active: Any = None  # the gs.record of the cell running now, if any
    watching: bool = False  # whether ``active`` is the OOM watch's own recording
    cell_budget: tuple[int, int, dict[str, int]] | None = None  # (the budget asked for, bytes resident before
    # the cell, the same by variable)
    finished: Any = None  # Recording finished by the exception handler, for the cell magic
    last: Any = None  # the last Diagnosis shown
    recording_name: str = RECORDING_NAME  # where the running cell's recording will be kept
    snapshot_dir: str = "."  # where oom on saves the allocator snapshot of a CUDA OOM
    full_traceback: str | None = None  # the last OOM's whole traceback, as text, for %gradscope tb
    last_snapshot: str | None = None  # the path of the last one saved


_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(shell: Any) -> _State:
    st = _STATES.get(shell)
    if st is None:
        raise UsageError("gradscope: the extension is not loaded here; run %load_ext gradscope first.")
    return st


def last_diagnosis(shell: Any = None) -> Any:
    """The last :class:`~gradscope.diagnose.Diagnosis` the extension showed in this shell, or None.

    Example:
        >>> from gradscope.ipython import last_diagnosis  # doctest: +SKIP
        >>> print(last_diagnosis())  # doctest: +SKIP
    """
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    st = _STATES.get(shell)
    return None if st is None else st.last




# ----------------------------------------------------------------------------------------------
def _memory_kind(name: str, budget: int | None, online: bool = False) -> MemoryKind:
    """``--memory NAME`` read once into its kind (``online``: ``auto`` takes the tracker without a GPU)."""
    try:
        return MemoryKind.resolve(name, budget, online=online)
    except GradscopeError as e:
        raise UsageError(str(e)) from None


def _parse_budget(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except GradscopeError as e:
        raise UsageError(str(e)) from None


def _namespace_modules(ns: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """Top-level nn.Modules of the user namespace, by variable name, so that module paths in the
    recording start with the names the user wrote (``backbone.layer1``)."""
    out: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for name in sorted(ns):
        v = ns[name]
        if name.startswith("_") or not isinstance(v, torch.nn.Module) or id(v) in seen:
            continue
        seen.add(id(v))
        out[name] = v
    return out


def _run_recorded(shell: Any, st: _State, rec: Any, cell: str) -> Recording:
    """Run ``cell`` through ``shell.run_cell`` inside ``rec``; the recording is finished with the
    cell's exception (so a budget failure is diagnosed at the failing allocation)."""
    if st.active is not None:
        raise UsageError("gradscope: a recorded cell is already running; recordings cannot nest.")
    try:
        rec.__enter__()
    except GradscopeError as e:
        raise UsageError(str(e)) from None
    st.active, st.finished = rec, None
    outer = getattr(shell.displayhook, "exec_result", None)
    count = _outer_count(shell, outer)
    try:
        with _numbered_as(shell, count):
            result = shell.run_cell(cell, store_history=False)
    except BaseException as e:
        _finish(st, rec, e, shell.user_ns)
        raise
    finally:
        shell.displayhook.exec_result = outer
    err = result.error_in_exec if result is not None else None
    if err is not None and outer is not None and outer.error_in_exec is None:
        # The traceback was shown by the inner run; the %%gradscope cell itself failed too, so
        # that a kernel reports the cell as an error (and a notebook run stops there).
        outer.error_in_exec = err
    recording = _finish(st, rec, err, shell.user_ns)
    return recording


# NOTE [ the recorded cell keeps its number ]: the cell under ``%%gradscope`` runs through a second
# ``shell.run_cell`` (store_history=False), which compiles it under the shell's execution count at
# that moment. IPython 8 adds one to the count after a cell has run, so that was the outer cell's
# number; IPython 9 adds one before the cell runs, so the inner cell was compiled as the next
# cell's (``cell [4]`` in the lines, ``Cell In[4]`` in tracebacks, for the cell shown as In[3]).
# The inner run therefore sees the outer cell's own count (its ExecutionResult's), restored after.
def _outer_count(shell: Any, outer: Any) -> int | None:
    """The execution count of the cell running ``%%gradscope`` (None outside a cell: a magic
    called from code)."""
    count = getattr(outer, "execution_count", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


@contextlib.contextmanager
def _numbered_as(shell: Any, count: int | None) -> Iterator[None]:
    """Run the inner cell under the outer cell's number (see NOTE [ the recorded cell keeps its
    number ])."""
    before = getattr(shell, "execution_count", None)
    if count is None or before == count:
        yield
        return
    shell.execution_count = count
    try:
        yield
    finally:
        if shell.execution_count == count:  # the inner run stores no history: nothing moved it
            shell.execution_count = before


def _finish(st: _State, rec: Any, err: BaseException | None, ns: dict[str, Any] | None = None) -> Recording:
    """Close ``rec`` once (the exception handler may have done it already). Results the cell
    left in the user namespace (``loss``, a list of losses) are roots of its graph: the recorder
    looks at its caller's variables, which here are ours, so they are named to it."""
    if st.active is rec:
        st.active, st.watching = None, False
        if ns is not None:
            _add_namespace_roots(rec, ns)
        try:
            rec.__exit__(
                type(err) if err is not None else None, err, err.__traceback__ if err is not None else None
            )
        except GradscopeError:
            pass
        _restated(err, st.cell_budget)
        st.finished = _with_resident(rec.recording, st.cell_budget)
        st.cell_budget = None
    return st.finished


def _cell_budget(
    budget: int | None, memory: MemoryKind | str, ns: dict[str, Any], cell_only: bool = False
) -> tuple[int | None, int, dict[str, int]]:
    """The part of a simulated device left for one cell: what the user's variables already hold
    on the CPU (tensors, models with their gradients, optimizer state) is resident on that device
    before the cell starts, as it would be on a GPU. Returns (budget for the cell, resident bytes).

    NOTE [ budgets count what earlier cells left ]: the tracker counts only what is allocated
    while it runs, so a budget given as a device size is reduced by the resident bytes first.
    A budget at or below the resident bytes cannot run any cell: the error names the variables
    that hold them and the least budget (more than the resident bytes, plus what the cell
    allocates, which nothing knows before it runs). ``cell_only`` (``--cell-only``) counts only
    what the cell allocates against the budget, as ``gs.record(budget=...)`` does."""
    if budget is None or not MemoryKind.resolve(memory, budget).budgets:
        return budget, 0, {}
    if cell_only:
        return budget, 0, {}
    held = _resident_by_variable(ns)
    resident = sum(held.values())
    if resident >= budget:
        raise UsageError(_too_small(budget, held))
    return budget - resident, resident, held


def _too_small(budget: int, held: dict[str, int]) -> str:
    """One line: why ``budget`` cannot run a cell, the least one that can, and the way out."""
    resident = sum(held.values())
    largest = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))
    named = ", ".join(f"{name} {format_bytes(n)}" for name, n in largest[:4])
    if len(largest) > 4:
        named += f", {len(largest) - 4} more"
    return (
        f"gradscope: a {_size(budget)} budget cannot run this cell: your variables already hold "
        f"{_size(resident)} of CPU tensors ({named}), so the least budget that can run it is more than "
        f"{format_bytes(resident)} resident plus what the cell allocates (run it once without --budget to "
        f"see its peak); give a larger --budget, or add --cell-only to count only what the cell allocates "
        f"against {format_bytes(budget)}."
    )


def _resident_cpu_bytes(ns: dict[str, Any]) -> int:
    """Bytes of distinct CPU storages reachable from the user's variables: tensors (also inside
    lists, tuples and dicts), models' parameters, buffers and gradients, optimizers' state."""
    return sum(_resident_by_variable(ns).values())


def _resident_by_variable(ns: dict[str, Any]) -> dict[str, int]:
    """:func:`_resident_cpu_bytes` by variable (see NOTE [ one budget ] in gradscope._analyses.diagnose.measure)."""
    from gradscope._analyses.diagnose.moment import resident_by_variable

    return resident_by_variable(ns)


def _with_resident(recording: Any, cell_budget: tuple[int, int, dict[str, int]] | None) -> Any:
    """The recording, its budget failure restated for the whole simulated device, with what each
    variable held when the cell started (see NOTE [ one budget ] in gradscope._analyses.diagnose.measure)."""
    if recording is None or cell_budget is None:
        return recording
    oom = recording.oom
    if oom is None:
        return recording
    budget, resident, by_variable = cell_budget
    import dataclasses

    oom = dataclasses.replace(oom, budget=budget, cell_budget=oom.budget, resident=resident)
    extra = {**recording.extra, "resident_by_variable": dict(by_variable)}
    return dataclasses.replace(recording, oom=oom, extra=extra)


def _restated(err: BaseException | None, cell_budget: tuple[int, int, dict[str, int]] | None) -> None:
    """A budget error of a cell, said for the device the user gave (see NOTE [ one budget ] in
    gradscope._analyses.diagnose.measure): its budget, what the cell allocated and what the variables held."""
    if not isinstance(err, MemoryBudgetExceeded) or cell_budget is None or not err.args:
        return
    budget, resident, by_variable = cell_budget
    named = ", ".join(f"{k} {format_bytes(b)}" for k, b in sorted(by_variable.items(), key=lambda kv: (-kv[1], kv[0])))
    err.args = (
        f"gradscope: simulated device out of memory: tried to allocate {_size(err.requested)} with "
        f"{_size(err.live)} allocated by the cell and {_size(resident)} held by your variables ({named}) of a "
        f"{_size(budget)} budget" + (f" (in {err.where})" if err.where else "")
        + ". Call gs.diagnose(rec.recording) to see what held the memory.",
    )


def _add_namespace_roots(rec: Any, ns: dict[str, Any]) -> None:
    roots: list[torch.Tensor] = []
    for name, v in list(ns.items()):
        if name.startswith("_"):
            continue
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else (v,)
        try:
            for t in list(items)[:1000]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    roots.append(t)
        except Exception:  # a user object that is odd to iterate: not a root
            continue
    try:
        rec.add_roots(*roots)
    except Exception:
        pass


def _live_widget(shell: Any, rec: Any, label: str) -> tuple[Any, Any] | None:
    """The widget a recorded cell shows as it starts (see NOTE [ a live loop ] in gradscope._views.widget)
    and its display's handle: its per-iteration memory chart grows while the cell runs. None outside
    a kernel (a terminal shows no widget) or where the widget stack or its bundle is missing: the
    recording is then shown at the end as it would be."""
    try:
        from IPython.display import display

        from gradscope._views import widget

        if getattr(shell, "kernel", None) is None or widget._anywidget is None or not widget.bundle_path().exists():
            return None
        w = widget.RecordingWidget.live(rec, label=label)
        return w, display(w, display_id=True)
    except Exception:  # a view that failed never stops the cell
        return None


def _show(recording: Recording, widget: bool) -> None:
    from IPython.display import display

    if not widget:
        print(recording.summary())
        return
    display(recording)


def _size(n: int) -> str:
    """A size for a sentence: binary units, the exact bytes in parentheses (``50.0 MiB (52428800
    bytes)``); under 1 KiB the bytes alone."""
    return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({n} bytes)"
