"""The notebook extension: ``%load_ext gradscope``, ``%%gradscope``, ``%gradscope oom`` and
``%gradscope tb``.

``%%gradscope`` records a cell and shows the recording (the widget where the front end can show
one, the text summary elsewhere). ``%gradscope oom on`` makes every following cell run under a
light recording, so that a cell that raises ``torch.OutOfMemoryError`` shows a diagnosis
(:func:`gradscope.diagnose`) before its traceback. That traceback shows the user's frames only
(the cell's and their own files'), the frames of torch and other libraries folded into one line;
``%gradscope tb`` prints it whole (see NOTE [ the user's frames of an OOM traceback ]). With
``--budget``, what the variables of earlier cells hold counts against it; ``--cell-only`` counts
only what the cell allocates.

NOTE [ where the OOM diagnosis gets its data ]: a diagnosis needs to know what was alive at the
failing allocation, which nothing can tell after the fact on a CPU and which the CUDA allocator
tells only when its history was on before the allocations happened. So with ``oom on`` each cell
runs inside a ``gs.record``: on a GPU with the CUDA source and the allocator's history; on a CPU
with the online tracker, which with ``--budget`` also turns the CPU into a simulated device of that
size (the cell fails where a GPU of that size would; what the variables of earlier cells already
hold counts against it, see NOTE [ budgets count what earlier cells left ]). The recording is
finished by the exception handler itself, while the failing frames (and the graphs they hold) are
still alive, so the diagnosis also sees which variables hold graphs. Cells that record on their own (``%%gradscope``,
``gs.record``) are left alone, since recordings cannot nest. The price is the recorder's overhead
on every cell (about 1.1-1.4x on CPU); ``%gradscope oom off`` removes it.

Unloading restores exactly what loading changed: the magics, the custom exception handler and the
cell hooks.

Example:
    >>> from IPython.testing.globalipapp import get_ipython  # doctest: +SKIP
    >>> ip = get_ipython()  # doctest: +SKIP
    >>> ip.run_line_magic("load_ext", "gradscope")  # doctest: +SKIP
    >>> ip.run_cell_magic("gradscope", "-o rec --memory tracker --no-widget", "x = 1")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import linecache
import os
import site
import sys
import sysconfig
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gradscope._base.errors import GradscopeError, MemoryBudgetExceeded
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.units import parse_size
from gradscope._model.recording import Recording, format_bytes

__all__ = [
    "RECORDING_NAME",
    "GradscopeMagics",
    "last_diagnosis",
    "load_ipython_extension",
    "unload_ipython_extension",
]

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
@magics_class
class GradscopeMagics(Magics):
    """``%%gradscope`` (record a cell) and ``%gradscope oom on|off`` (diagnose OOMs)."""

    @magic_arguments()
    @argument(
        "-o",
        "--output",
        metavar="NAME",
        default=None,
        help="store the Recording in the user namespace under NAME",
    )
    @argument(
        "--memory",
        default="auto",
        choices=_MEMORY_CHOICES,
        help="memory source: auto (CUDA on a GPU, else the CPU allocator), cpu, cuda, tracker, off",
    )
    @argument(
        "--budget",
        metavar="SIZE",
        default=None,
        help="simulated device size, e.g. 8GiB: crossing it raises gs.MemoryBudgetExceeded",
    )
    @argument(
        "--cell-only",
        action="store_true",
        help="with --budget: count only what the cell allocates, not what your variables already hold",
    )
    @argument("--label", default="", help="a name for the recording")
    @argument("--no-widget", action="store_true", help="print the text summary instead of the widget")
    @argument("--history", action="store_true", help="on CUDA, keep the allocator's event history")
    @cell_magic
    def gradscope(self, line: str, cell: str) -> None:
        """Record this cell with ``gs.record`` and show the recording (see ``%%gradscope?``)."""
        args = parse_argstring(self.gradscope, line)
        shell = self.shell
        assert shell is not None
        st = _state(shell)
        budget = _parse_budget(args.budget)
        if args.cell_only and budget is None:
            raise UsageError("gradscope: --cell-only goes with --budget SIZE (it says what the budget counts).")
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"gradscope: -o takes a variable name, got {args.output!r}.")
        from gradscope._capture.record import record

        kind = _memory_kind(args.memory, budget)
        cell_budget, resident, held = _cell_budget(budget, kind, shell.user_ns, args.cell_only)
        try:
            rec = record(
                memory=kind,
                budget=cell_budget,
                label=args.label,
                modules=_namespace_modules(shell.user_ns) or None,
                history=args.history,
            )
        except GradscopeError as e:
            raise UsageError(str(e)) from None
        rec.given_step = _cell_step(shell, cell)  # the diagnosis runs its fixes on the cell's own code
        st.cell_budget = None if budget is None or args.cell_only else (budget, resident, held)
        st.recording_name = args.output or RECORDING_NAME
        shown = st.last
        live = None if args.no_widget else _live_widget(shell, rec, args.label)
        try:
            with _oom_handler_installed(shell):
                recording = _run_recorded(shell, st, rec, cell)
        finally:
            if live is not None:
                live[0].stop()
        shell.user_ns[st.recording_name] = recording
        if live is not None and isinstance(recording, Recording):
            widget, handle = live
            widget.finish(recording)  # the widget shown as the cell started: the recording in full,
            handle.update(widget)  # and its text for a front end without widgets
        else:
            _show(recording, widget=not args.no_widget)
        if st.last is shown and recording.oom is not None:
            # an OOM the handler could not diagnose (the user has an exception handler of their
            # own, which one shell cannot share): diagnose it after the traceback
            from gradscope._analyses.diagnose import diagnose

            st.last = diagnose(recording, namespace=shell.user_ns)
            print(st.last.text() + "\n" + _where_it_is(st.recording_name))

    @magic_arguments()
    @argument("command", nargs="?", default="", help="oom | tb")
    @argument("state", nargs="?", default="", help="on | off")
    @argument(
        "--budget",
        metavar="SIZE",
        default=None,
        help="with oom on: run cells on a simulated device of this size (CPU tracker)",
    )
    @argument(
        "--cell-only",
        action="store_true",
        help="with oom on --budget: count only what each cell allocates, not what your variables hold",
    )
    @argument(
        "--memory",
        default="auto",
        choices=_MEMORY_CHOICES,
        help="with oom on: memory source for the per-cell recording",
    )
    @argument(
        "--snapshot-dir",
        metavar="DIR",
        default=".",
        help="with oom on and CUDA: where to save the allocator snapshot of a cell that runs out of memory",
    )
    @line_magic("gradscope")  # type: ignore[arg-type]
    def gradscope_line(self, line: str) -> None:
        """``%gradscope oom on [--budget SIZE] [--cell-only] [--memory SOURCE]`` / ``%gradscope oom
        off`` / ``%gradscope oom`` (status) / ``%gradscope tb`` (the last OOM's whole traceback)."""
        args = parse_argstring(self.gradscope_line, line)
        st = _state(self.shell)
        if args.command == "tb":
            print(
                st.full_traceback
                if st.full_traceback is not None
                else "gradscope: no out-of-memory traceback to show yet: %gradscope tb prints the whole "
                "traceback of the last OOM that a %%gradscope cell (or %gradscope oom on) showed trimmed."
            )
            return
        if args.command != "oom":
            raise UsageError(
                f"gradscope: unknown command {args.command!r}. Use '%gradscope oom on' (diagnose out-of-"
                "memory errors, optionally --budget 8GiB) or '%gradscope oom off'; '%gradscope tb' prints "
                "the last OOM's whole traceback; record a cell with %%gradscope on its first line."
            )
        if args.state == "":
            print(_oom_status(st))
            return
        if args.state not in ("on", "off"):
            raise UsageError(f"gradscope: '%gradscope oom {args.state}': say 'on' or 'off'.")
        if args.state == "off":
            _oom_off(self.shell, st)
            print("gradscope: OOM diagnosis is off.")
            return
        budget = _parse_budget(args.budget)
        if args.cell_only and budget is None:
            raise UsageError("gradscope: --cell-only goes with --budget SIZE (it says what the budget counts).")
        memory = _memory_kind(args.memory, None, online=True)
        if memory.history and not torch.cuda.is_available():
            raise UsageError(
                "gradscope: --memory cuda but CUDA is not available; use --memory tracker "
                "with --budget SIZE to simulate a device."
            )
        st.snapshot_dir = args.snapshot_dir
        st.oom_cell_only = args.cell_only
        _oom_on(self.shell, st, budget, memory)
        print(_oom_status(st))


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
    from gradscope._analyses.diagnose.facts import resident_by_variable

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


# ----------------------------------------------------------------------------------------------
# OOM diagnosis: per-cell recording and the custom exception handler
# ----------------------------------------------------------------------------------------------
def _oom_status(st: _State) -> str:
    if not st.oom:
        return "gradscope: OOM diagnosis is off. Turn it on with %gradscope oom on [--budget SIZE]."
    dev = (
        f"a budget of {_size(st.oom_budget)} for what each cell allocates"
        if st.oom_budget is not None and st.oom_cell_only
        else f"a simulated {_size(st.oom_budget)} device"
        if st.oom_budget is not None
        else "the CUDA allocator"
        if st.oom_memory.history
        else f"memory source {st.oom_memory.value}"
    )
    text = (
        f"gradscope: OOM diagnosis is on: each cell runs under a recording ({dev}); a cell that "
        "raises torch.OutOfMemoryError shows a diagnosis before its traceback."
    )
    if st.oom_memory.history:
        text += (f" With the allocator's history on, a CUDA OOM also saves its snapshot in {st.snapshot_dir!r} "
                 "(gs.load_snapshot(path), or PyTorch's memory_viz).")
    if st.oom_budget is None and not st.oom_memory.history:
        text += (
            " No GPU and no --budget: nothing here will run out of memory; add --budget SIZE "
            "(e.g. 8GiB) to run cells on a simulated device of that size."
        )
    return text


def _oom_on(shell: Any, st: _State, budget: int | None, memory: MemoryKind) -> None:
    st.oom_budget, st.oom_memory = budget, memory
    if st.oom:
        return
    st.saved_custom_exceptions = shell.custom_exceptions
    st.custom_tb_was_instance = "CustomTB" in shell.__dict__
    st.saved_custom_tb = shell.__dict__.get("CustomTB")
    shell.set_custom_exc((torch.OutOfMemoryError,), _oom_handler)
    for event, cb in (("pre_run_cell", _make_pre(shell)), ("post_run_cell", _make_post(shell))):
        shell.events.register(event, cb)
        st.callbacks.append((event, cb))
    st.oom = True


def _oom_off(shell: Any, st: _State) -> None:
    if not st.oom:
        return
    for event, cb in st.callbacks:
        try:
            shell.events.unregister(event, cb)
        except ValueError:
            pass
    st.callbacks.clear()
    shell.custom_exceptions = st.saved_custom_exceptions
    if st.custom_tb_was_instance:
        shell.CustomTB = st.saved_custom_tb
    else:
        shell.__dict__.pop("CustomTB", None)
    if st.active is not None and st.watching:
        _finish(st, st.active, None)
    st.oom = False


def _cell_step(shell: Any, cell: str) -> dict[str, Any] | None:
    """A cell's code as the recording's step (``extra["step"]``, see ``gradscope._base.source``): IPython's
    own syntax (magics, ``!cmd``) turned into Python, as the cell runs."""
    try:
        source = shell.transform_cell(cell)
    except Exception:
        return None
    return {"source": source, "file": "<cell>", "line": 1}


def _make_pre(shell: Any) -> Any:
    def pre_run_cell(info: Any) -> None:
        st = _STATES.get(shell)
        if st is None or not st.oom or st.active is not None:
            return
        st.finished = None  # a recording of an earlier cell never explains this one
        raw = getattr(info, "raw_cell", "") or ""
        if any(m in raw for m in _RECORDING_MARKERS) or raw.lstrip().startswith(
            ("%gradscope", "%unload_ext")
        ):
            return  # it records on its own, or changes the extension itself
        from gradscope._capture.record import record

        try:
            cell_budget, resident, held = _cell_budget(
                st.oom_budget, st.oom_memory, shell.user_ns, st.oom_cell_only
            )
            rec = record(
                memory=st.oom_memory,
                budget=cell_budget,
                label="cell (oom watch)",
                modules=_namespace_modules(shell.user_ns) or None,
                history=st.oom_memory.history,
            )
            rec.given_step = _cell_step(shell, raw)
            rec.__enter__()
        except (GradscopeError, UsageError) as e:
            print(f"gradscope: could not watch this cell for OOM ({e})", file=sys.stderr)
            return
        st.active, st.finished, st.watching = rec, None, True
        st.cell_budget = None if st.oom_budget is None or st.oom_cell_only else (st.oom_budget, resident, held)
        st.recording_name = RECORDING_NAME

    return pre_run_cell


def _users_recording(value: BaseException, ns: dict[str, Any]) -> tuple[str, Recording] | None:
    """For a cell that recorded on its own (``with gs.record(budget=...) as rec``): the
    recording in the user's variables that ended with this very exception, and how the user
    reaches it (``rec.recording``)."""
    from gradscope._capture.record import record

    error = f"{type(value).__name__}: {value}"
    for name, v in sorted(ns.items()):
        if name.startswith("_"):
            continue
        r = v.recording if isinstance(v, record) else v if isinstance(v, Recording) else None
        if isinstance(r, Recording) and r.error == error:
            return (f"{name}.recording" if isinstance(v, record) else name), r
    return None


# NOTE [ the allocator snapshot of an OOM ]: with oom on and CUDA, every watched cell runs with
# the caching allocator's history on (the recording's CUDA source starts it). When a cell runs out
# of memory, the handler first writes that history to a file, before the recording is finished
# (finishing turns the history off), with PyTorch's own writer: the file is what
# torch.cuda.memory._dump_snapshot writes, so PyTorch's memory_viz opens it, and gs.load_snapshot
# reads it back into the same diagnosis the handler prints (it prints the one from the file).
def _save_snapshot(st: _State) -> tuple[str | None, str | None]:
    """Write the allocator snapshot of the failing cell; (path, None) or (None, why not)."""
    import os

    from gradscope._capture.memory.cuda import cuda_stats

    directory = st.snapshot_dir or "."
    try:
        os.makedirs(directory, exist_ok=True)
        k = 1
        while os.path.exists(os.path.join(directory, f"gradscope-oom-{k}.pickle")):
            k += 1
        path = os.path.join(directory, f"gradscope-oom-{k}.pickle")
        cuda_stats().dump_snapshot(path)
    except Exception as e:  # never hide the user's traceback
        return None, f"{type(e).__name__}: {e}"
    st.last_snapshot = path
    return path, None


def _snapshot_text(saved: tuple[str | None, str | None]) -> str:
    path, error = saved
    if path is None:
        return f"gradscope: could not save the allocator snapshot of this OOM ({error})."
    head = (f"gradscope: the allocator's history of this cell is saved as {path} (PyTorch's memory_viz opens "
            f"it too); gs.diagnose(gs.load_snapshot({path!r})) says:")
    try:
        from gradscope._analyses.diagnose import diagnose
        from gradscope._analyses.snapshot.reading import load_snapshot

        return head + "\n" + diagnose(load_snapshot(path)).text()
    except Exception as e:
        return head + f"\n(could not read it back: {type(e).__name__}: {e})"


def _make_post(shell: Any) -> Any:
    def post_run_cell(result: Any) -> None:
        st = _STATES.get(shell)
        if st is None or st.active is None or not st.watching:
            return
        _finish(st, st.active, getattr(result, "error_in_exec", None), shell.user_ns)

    return post_run_cell


def _size(n: int) -> str:
    """A size for a sentence: binary units, the exact bytes in parentheses (``50.0 MiB (52428800
    bytes)``); under 1 KiB the bytes alone."""
    return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({n} bytes)"


def _where_it_is(name: str) -> str:
    """The line after a diagnosis that says where its recording is, under the user's own name."""
    how = "" if not name.startswith("_") else " (name it yourself with %%gradscope -o NAME)"
    return f"gradscope: the recording is `{name}`{how}: gs.show({name}), gs.diagnose({name})."


def _name_the_recording(value: BaseException, name: str) -> None:
    """A budget failure's message names the recording as the user can reach it (the recorder,
    raising it deep inside the cell, cannot know the variable)."""
    if isinstance(value, MemoryBudgetExceeded) and value.args:
        value.args = (str(value.args[0]).replace("gs.diagnose(rec.recording)", f"gs.diagnose({name})"),)


@contextlib.contextmanager
def _oom_handler_installed(shell: Any) -> Iterator[None]:
    """The OOM handler for the duration of one recorded cell, so that its diagnosis comes before
    the traceback as with ``%gradscope oom on``. A shell has one custom exception handler: when
    the user installed one of their own, it is left alone."""
    if shell.custom_exceptions:  # ours (oom on) or the user's
        yield
        return
    was_instance = "CustomTB" in shell.__dict__
    saved_tb = shell.__dict__.get("CustomTB")
    shell.set_custom_exc((torch.OutOfMemoryError,), _oom_handler)
    try:
        yield
    finally:
        shell.custom_exceptions = ()
        if was_instance:
            shell.CustomTB = saved_tb
        else:
            shell.__dict__.pop("CustomTB", None)


def _oom_handler(
    shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: int | None = None
) -> list[str]:
    """Shows the diagnosis, then the traceback trimmed to the user's frames (see NOTE [ the
    user's frames of an OOM traceback ]); IPython does not print what a custom handler returns
    when it calls it from ``run_code``."""
    st = _STATES.get(shell)
    text = None
    if st is not None:
        rec = st.active
        name = st.recording_name
        recording: Recording | None
        snapshot = None
        if rec is not None and st.watching and st.oom_memory.history:
            snapshot = _save_snapshot(st)  # while the allocator's history is still on
        if rec is not None:
            recording = _finish(st, rec, value, shell.user_ns)
            if recording is not None:
                shell.user_ns[name] = recording  # reachable now, also if the cell magic never returns
        elif st.finished is not None:
            recording = st.finished
        else:
            found = _users_recording(value, shell.user_ns)
            name, recording = found if found is not None else (name, None)
        if recording is not None:
            from gradscope._analyses.diagnose import diagnose

            _name_the_recording(value, name)
            try:
                d = diagnose(recording, namespace=shell.user_ns)
                st.last = d
                text = d.text() + "\n" + _where_it_is(name)
            except Exception as e:  # a diagnosis must never hide the user's traceback
                text = f"gradscope: could not diagnose this OOM ({type(e).__name__}: {e})"
            if snapshot is not None:
                text += "\n" + _snapshot_text(snapshot)
        else:
            text = (
                "gradscope: this cell ran without a recording (it records on its own, or OOM "
                "diagnosis was turned on after it started); no diagnosis."
            )
    if text is not None:
        print(text)
    _show_traceback(shell, st, etype, value, tb, tb_offset)
    return []


# NOTE [ the user's frames of an OOM traceback ]: an out-of-memory error inside a model is raised
# under dozens of frames of torch (module calls, hooks, the allocator, or gradscope's tracker for a
# budget) and of the model's library (transformers); the frames that say which line to change are
# the user's: the cell's and those of the user's own files. So the handler shows those, and folds
# each run of other frames into one line that names their packages ("... 35 frames in torch,
# transformers, gradscope"). The whole traceback is kept as text for ``%gradscope tb`` (text, not
# the traceback object, which would keep the failing cell's tensors alive); sys.last_traceback is
# set as IPython sets it, so ``%tb`` and ``%debug`` work as usual. A frame is not the user's when
# its file lies under the interpreter's standard library or site-packages, or its module belongs to
# a package that is never the user's (an editable install of torch or gradscope lives elsewhere).
_NEVER_THE_USERS = frozenset({"torch", "gradscope", "IPython", "ipykernel", "traitlets"})


def _library_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(Exception):  # not every interpreter's site module has these
        paths.update(site.getsitepackages())
        paths.add(site.getusersitepackages())
    return tuple(sorted(os.path.realpath(p).rstrip(os.sep) + os.sep for p in paths if p))


def _cell_name(shell: Any, filename: str) -> tuple[str, str] | None:
    """("Cell", "In[3]") for a file IPython compiled a cell into, else None."""
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    try:
        return fmt(filename) if fmt is not None else None
    except Exception:
        return None


def _frame_owner(shell: Any, frame: Any, roots: tuple[str, ...]) -> str | None:
    """None for a frame of the user's (a cell, a file of theirs), else the package it belongs to."""
    filename = frame.f_code.co_filename
    if _cell_name(shell, filename) is not None:
        return None
    top = str(frame.f_globals.get("__name__") or "").split(".")[0]
    if top in _NEVER_THE_USERS:
        return top
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return top or filename
    if (os.path.realpath(filename) + os.sep).startswith(roots):
        return top or os.path.basename(filename)
    return None


def _trimmed_traceback(
    shell: Any, etype: type[BaseException], value: BaseException, tb: Any
) -> list[str] | None:
    """The traceback's lines with only the user's frames, others folded; None when it has none."""
    roots = _library_roots()
    rows = [(_frame_owner(shell, f, roots), f, n) for f, n in traceback.walk_tb(tb)]
    first = next((i for i, (owner, _, _) in enumerate(rows) if owner is None), None)
    if first is None:
        return None
    rows = rows[first:]  # above the first frame of the user's: IPython running the cell
    lines = ["-" * 75, f"{etype.__name__:<42}Traceback (most recent call last; your frames only)"]
    i = 0
    while i < len(rows):
        owner, frame, lineno = rows[i]
        if owner is None:
            filename = frame.f_code.co_filename
            cell = _cell_name(shell, filename)
            name = frame.f_code.co_name
            where = f"{cell[0]} {cell[1]}, line {lineno}" if cell is not None else f"File {filename}:{lineno}"
            where += f", in {name}" if cell is None or name != "<module>" else ""
            code = linecache.getline(filename, lineno, frame.f_globals).strip()
            lines += [where, f"----> {lineno} {code}", ""]
            i += 1
            continue
        owners: list[str] = []
        j = i
        while j < len(rows) and rows[j][0] is not None:
            if rows[j][0] not in owners:
                owners.append(str(rows[j][0]))
            j += 1
        n = j - i
        frames = f"{n} frame{'' if n == 1 else 's'}"
        lines += [f"... {frames} in {', '.join(owners)} (%gradscope tb prints them all)", ""]
        i = j
    lines += f"{etype.__name__}: {value}".split("\n")
    lines += [str(note) for note in getattr(value, "__notes__", None) or ()]
    return lines


def _show_traceback(
    shell: Any, st: _State | None, etype: type[BaseException], value: BaseException, tb: Any,
    tb_offset: int | None,
) -> None:
    """The traceback trimmed to the user's frames, the whole one kept as text for ``%gradscope tb``
    (see NOTE [ the user's frames of an OOM traceback ])."""
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # as IPython's showtraceback
    if sys.version_info >= (3, 12):
        setattr(sys, "last_exc", value)  # noqa: B010 - absent from 3.11's stubs
    try:
        stb = _trimmed_traceback(shell, etype, value, tb)
        if st is not None:
            whole = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
            st.full_traceback = shell.InteractiveTB.stb2text(whole)
    except Exception:  # never hide the user's traceback
        stb = None
    if stb is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return
    shell._showtraceback(etype, value, stb)
    if getattr(shell, "call_pdb", False):
        shell.debugger(force=True)


# ----------------------------------------------------------------------------------------------
def load_ipython_extension(shell: Any) -> None:
    """Register the magics on ``shell`` (``%load_ext gradscope``). Loading twice is harmless."""
    if shell in _STATES:
        return
    st = _State()
    mm = shell.magics_manager
    st.saved_line = mm.magics["line"].get("gradscope")
    st.saved_cell = mm.magics["cell"].get("gradscope")
    st.saved_registry = mm.registry.get(GradscopeMagics.__name__)
    st.magics = GradscopeMagics(shell)
    shell.register_magics(st.magics)
    _STATES[shell] = st


def unload_ipython_extension(shell: Any) -> None:
    """Undo :func:`load_ipython_extension` exactly: magics, exception handler, cell hooks."""
    st = _STATES.pop(shell, None)
    if st is None:
        return
    _oom_off(shell, st)
    if st.active is not None:
        _finish(st, st.active, None)
    mm = shell.magics_manager
    for kind, saved in (("line", st.saved_line), ("cell", st.saved_cell)):
        if saved is None:
            mm.magics[kind].pop("gradscope", None)
        else:
            mm.magics[kind]["gradscope"] = saved
    if st.saved_registry is None:
        mm.registry.pop(GradscopeMagics.__name__, None)
    else:
        mm.registry[GradscopeMagics.__name__] = st.saved_registry
