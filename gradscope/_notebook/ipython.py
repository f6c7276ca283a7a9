"""The notebook extension: ``%load_ext gradscope``, ``%%gradscope``, ``%gradscope oom`` and
``%gradscope tb``.

``%%gradscope`` records a cell and shows the recording (the widget where the front end can show
one, the text summary elsewhere). ``%gradscope oom on`` makes every following cell run under a
light recording, so that a cell that raises ``torch.OutOfMemoryError`` shows a diagnosis
(:func:`gradscope.diagnose`) before its traceback. That traceback shows the user's frames only
(the cell's and their own files'), the frames of torch and other libraries folded into one line;
``%gradscope tb`` prints it whole (see NOTE [ the user's frames of an OOM traceback ] in gradscope._notebook.oom). With
``--budget``, what the variables of earlier cells hold counts against it; ``--cell-only`` counts
only what the cell allocates.

NOTE [ where the OOM diagnosis gets its data ]: a diagnosis needs to know what was alive at the
failing allocation, which nothing can tell after the fact on a CPU and which the CUDA allocator
tells only when its history was on before the allocations happened. So with ``oom on`` each cell
runs inside a ``gs.record``: on a GPU with the CUDA source and the allocator's history; on a CPU
with the online tracker, which with ``--budget`` also turns the CPU into a simulated device of that
size (the cell fails where a GPU of that size would; what the variables of earlier cells already
hold counts against it, see NOTE [ budgets count what earlier cells left ] in gradscope._notebook.cells). The recording is
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

from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gradscope._base.errors import GradscopeError
from gradscope._model.recording import Recording
from gradscope._notebook.cells import (
    _MEMORY_CHOICES,
    _STATES,
    RECORDING_NAME,
    _cell_budget,
    _finish,
    _live_widget,
    _memory_kind,
    _namespace_modules,
    _parse_budget,
    _run_recorded,
    _show,
    _State,
    _state,
    last_diagnosis,
)
from gradscope._notebook.oom import (
    _cell_step,
    _oom_handler_installed,
    _oom_off,
    _oom_on,
    _oom_status,
    _where_it_is,
)

__all__ = [
    "RECORDING_NAME",
    "GradscopeMagics",
    "last_diagnosis",
    "load_ipython_extension",
    "unload_ipython_extension",
]


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
