"""A snapshot's frames, the rows that hold them (an allocation of the trace, an OOM), and the rules
that read them: which frame is PyTorch's and which the user's, the line a stack is shown by, and
the groups (line, function, file, stack) bytes are summed by. :mod:`gradscope.snapshot` is their
face.

Example:
    >>> from gradscope._analyses.snapshot.frames import Frame, is_pytorch_frame
    >>> is_pytorch_frame(Frame("/home/u/train.py", 57, "train_step"))
    False"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gradscope._base.errors import GradscopeError
from gradscope._base.frames import is_folded_file, is_python_file, is_pytorch_file

__all__ = [
    "GROUPS",
    "Frame",
    "Oom",
    "TraceAllocation",
    "group_of",
    "is_pytorch_frame",
    "is_user_frame",
    "line_frame",
]


GROUPS = ("line", "function", "file", "stack")


# ----- data --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One Python (or C++) frame of an allocation's stack."""

    filename: str
    line: int
    name: str

    @property
    def label(self) -> str:
        """``train.py:57 train_step``: short file name, line, function."""
        return f"{_short_file(self.filename)}:{self.line} {self.name}"

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class TraceAllocation:
    """One allocation of the trace (or alive at its start). Positions are trace positions.

    ``alloc_at`` is -1 for memory allocated before the trace began (see NOTE [ a trace that
    starts mid-run ]); ``free_at`` is None while the allocation is alive at the end.
    ``frames`` are innermost first, empty when the allocator recorded none.
    """

    index: int
    address: int
    size: int
    stream: int
    alloc_at: int
    free_requested_at: int | None
    free_at: int | None
    frames: tuple[Frame, ...]

    @property
    def label(self) -> str:
        """The allocating line: the user's line (:func:`line_frame`, ``file:line function``)."""
        return _label_of(self.frames, "line")


@dataclass(frozen=True)
class Oom:
    """An ``oom`` entry: the allocator could not get ``requested`` bytes.

    ``requested`` is the allocator's rounded request; ``device_free`` what CUDA still reported
    free on the device (None when the entry lacks it); ``allocated`` / ``reserved`` the replayed
    bytes at that moment.
    """

    at: int
    requested: int
    device_free: int | None
    stream: int
    allocated: int
    reserved: int
    frames: tuple[Frame, ...] = ()
    t_s: float | None = None


# ----- frames and groups -------------------------------------------------------------------
def is_pytorch_frame(frame: Frame) -> bool:
    """Whether a frame is PyTorch's own code (or not Python at all: C++ frames); the rule is
    :func:`gradscope._base.frames.is_pytorch_file` (see NOTE [ folded frames ] there)."""
    return is_pytorch_file(frame.filename)


def is_user_frame(frame: Frame) -> bool:
    """Whether a frame is the user's code: Python outside PyTorch, the standard library and
    installed packages (:func:`gradscope._base.frames.is_folded_file`, also for another machine's
    paths); never a C++ frame."""
    return is_python_file(frame.filename) and not is_folded_file(frame.filename)


def line_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The frame that names a stack's line: the innermost user frame (:func:`is_user_frame`);
    without one the innermost Python frame outside PyTorch (a library's), else PyTorch's own;
    None when the stack has no Python frame (C++ only: the autograd engine's threads)."""
    fallback = own = None
    for f in frames:
        if not is_python_file(f.filename):
            continue
        if not is_folded_file(f.filename):
            return f
        if fallback is None and not is_pytorch_file(f.filename):
            fallback = f
        if own is None:
            own = f
    return fallback or own


def _cpp_only_label(frames: tuple[Frame, ...]) -> str:
    """A stack of C++ frames only: the autograd engine's (backward) or another thread's."""
    if any(_is_engine_frame(f.name) for f in frames):
        return "(backward: C++ frames only)"
    return "(C++ frames only)"


_ENGINE = re.compile(r"torch::autograd::(?:Engine::|python::PythonEngine|AccumulateGrad|generated::\w+Backward\d*::apply)"
                     r"|Backward\d*::apply\b|AccumulateGrad::apply")


def _is_engine_frame(name: str) -> bool:
    """A C++ frame of the autograd engine running backward (its thread, a node's apply,
    AccumulateGrad)."""
    return bool(_ENGINE.search(name))


def _short_file(fn: str) -> str:
    parts = fn.replace("\\", "/").rstrip("/").split("/")
    base = parts[-1] if parts else fn
    if base in ("__init__.py", "__main__.py") and len(parts) > 1:
        return f"{parts[-2]}/{base}"
    return base


def _label_of(frames: tuple[Frame, ...], group: str) -> str:
    if not frames:
        return "(no stack recorded)"
    f = line_frame(frames)
    if f is None:
        return _cpp_only_label(frames)
    if group == "stack":
        users = [u for u in frames if is_user_frame(u)]
        shown = users[:4] or [f]
        return " ← ".join(u.label for u in shown) + (" ← …" if len(users) > 4 else "")
    if group == "line":
        return f.label
    if group == "function":
        return f"{_short_file(f.filename)} {f.name}"
    return _short_file(f.filename)


def group_of(frames: tuple[Frame, ...], group: str = "line") -> str:
    """The frame group of a stack: ``"line"`` (``train.py:57 train_step``, the user's line:
    :func:`line_frame`), ``"function"`` (``train.py train_step``), ``"file"`` (``train.py``) or
    ``"stack"`` (the user frames, innermost first). A stack of C++ frames only (the autograd
    engine's backward thread has no Python frames) is ``"(backward: C++ frames only)"``, never
    a C++ function's name."""
    _check_group(group)
    return _label_of(frames, group)


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise GradscopeError(f"gradscope: group must be one of {', '.join(GROUPS)}, not {group!r}.")
