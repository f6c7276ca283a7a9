"""``%gradscope oom``: every cell under a light recording, and the exception handler that shows
a diagnosis of a cell that ran out of memory before its traceback trimmed to the user's frames
(see NOTE [ where the OOM diagnosis gets its data ] in gradscope._notebook.ipython)."""

from __future__ import annotations

import contextlib
import linecache
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from IPython.core.error import UsageError

from gradscope._base.errors import GradscopeError, MemoryBudgetExceeded
from gradscope._base.memory_kind import MemoryKind
from gradscope._model.recording import Recording
from gradscope._notebook.cells import (
    _RECORDING_MARKERS,
    _STATES,
    RECORDING_NAME,
    _cell_budget,
    _finish,
    _namespace_modules,
    _size,
    _State,
)


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

