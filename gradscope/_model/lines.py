"""The user's source lines of a recorded block: captured while it runs, interned in one table.

NOTE [ where lines come from ]: a node is made while its op runs, and the op packs the node's saves
right then: inside the pack hook the user's frame is on the Python stack. So each save is given
the line of the innermost frame that is not folded (see NOTE [ folded frames ] in
:mod:`gradscope._base.frames`), and a node the line of its first save. The walk out of folded frames
is decided once per code object and the line interned once per (code object, line): a pack hook
that finds the node of the previous save (same sequence number) reuses its line without looking
at the stack at all (the compiled pack hook keeps the same caches in C++, keyed by code object and
instruction offset, and calls :meth:`LineTable.intern` only for a (code, offset) it has not seen).
Nodes that saved nothing of ours get the line of the nearest node made before them that has one
(after them when none was made before); ``AccumulateGrad`` nodes have none. The tracker's dispatch
mode runs on the user's stack too: each allocation it sees gets the line there; allocations made
in backward get the line of the node running (the forward line they differentiate), whatever the
source. The profiler's source (``memory="cpu"``) records no stacks: asking it to
(``with_stack=True``) costs a Python tracer on every op, so its forward allocations have no line.
``gs.record(lines=False)`` (or ``GRADSCOPE_LINES=0``) records no lines at all
(``benchmarks/bench_small_ops.py`` prints the cost side by side).
"""

from __future__ import annotations

import bisect
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gradscope._base.frames import is_folded_file
from gradscope._base.trace import Trace
from gradscope._model.recording import SourceLine

__all__ = ["LineTable", "cell_of", "lines_enabled", "lines_pass", "node_lines"]

MAX_STACK = 64
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, above _model
_CELL_NAME = re.compile(r"<ipython-input-(\d+)-")


def lines_enabled(lines: bool | None) -> bool:
    """``record(lines=...)``: None reads ``GRADSCOPE_LINES`` (``0`` turns capture off)."""
    if lines is not None:
        return bool(lines)
    return os.environ.get("GRADSCOPE_LINES", "1").strip() not in ("0", "false", "no", "off")


def cell_of(filename: str) -> int | None:
    """The execution count of the notebook cell a code object's file name stands for: from
    IPython's compiler cache (``/tmp/ipykernel_.../123.py``, ``<ipython-input-3-...>``) when IPython
    is running, else from an ``<ipython-input-N-...>`` name; None for any other file."""
    ipython = sys.modules.get("IPython")
    shell = None
    if ipython is not None:
        try:
            shell = ipython.get_ipython()
        except Exception:  # an IPython half imported or shut down: no shell
            shell = None
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(names, dict):
        n = names.get(filename)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    m = _CELL_NAME.match(filename)
    return int(m.group(1)) if m else None


class LineTable:
    """The lines of one block, interned in order of first sight: ``(code, line) -> index``.

    ``folded`` maps each code object met to whether its frames are skipped; ``at`` each (code
    object, instruction offset) met to its line's index, so that a line met before costs no
    line-number lookup. ``find(frame)`` is what the Python pack hook calls; the compiled one keeps
    the same two tables in C++ and asks :meth:`is_folded` and :meth:`intern` the first time it
    meets a code object or a (code, offset).
    """

    __slots__ = ("at", "find", "folded", "index", "rows")

    def __init__(self) -> None:
        self.rows: list[SourceLine] = []
        self.index: dict[tuple[Any, int], int] = {}  # (code, line) -> row
        self.at: dict[tuple[Any, int], int] = {}  # (code, instruction offset) -> row
        self.folded: dict[Any, bool] = {}
        self.find: Callable[[Any], int] = _finder(self.rows, self.index, self.at, self.folded)

    def is_folded(self, code: Any) -> bool:
        """Whether frames of ``code`` are skipped (decided once per code object)."""
        folded = self.folded.get(code)
        if folded is None:
            folded = self.folded[code] = is_folded_file(code.co_filename)
        return folded

    def here(self) -> int:
        """The line of the innermost frame of the calling stack that is not folded; -1 when every
        frame is."""
        return self.find(sys._getframe(1))

    def intern(self, frame: Any, top: Any = None) -> int:
        """The index of ``frame``'s line, made the first time (with the stack from ``top``, the
        innermost frame, outwards)."""
        return _intern(self.rows, self.index, frame, top)


def _finder(rows: list[SourceLine], index: dict[tuple[Any, int], int], at: dict[tuple[Any, int], int],
            folded_all: dict[Any, bool]) -> Callable[[Any], int]:
    """``find(frame)``: the line of the innermost frame from ``frame`` outwards that is not folded,
    -1 when every one is. It refers to the table's contents, never to the table that holds it (see
    NOTE [ no cycles through the recorder ] in gradscope._capture.saves)."""
    folded_get, at_get = folded_all.get, at.get

    def find(frame: Any) -> int:
        f = frame
        while f is not None:
            code = f.f_code
            folded = folded_get(code)
            if folded is None:
                folded = folded_all[code] = is_folded_file(code.co_filename)
            if not folded:
                key = (code, f.f_lasti)
                i = at_get(key)
                if i is None:
                    i = at[key] = _intern(rows, index, f, frame)
                return i
            f = f.f_back
        return -1

    return find


def _intern(rows: list[SourceLine], index: dict[tuple[Any, int], int], frame: Any, top: Any) -> int:
    """See :meth:`LineTable.intern`."""
    code = frame.f_code
    key = (code, frame.f_lineno)
    i = index.get(key)
    if i is not None:
        return i
    stack: list[tuple[str, int, str]] = []
    f = top if top is not None else frame
    while f is not None and f is not frame and f.f_code.co_filename.startswith(_OWN):  # our hook's frames
        f = f.f_back
    while f is not None and len(stack) < MAX_STACK:
        c = f.f_code
        stack.append((c.co_filename, int(f.f_lineno or 0), c.co_name))
        f = f.f_back
    i = index[key] = len(rows)
    rows.append(SourceLine(file=code.co_filename, line=int(frame.f_lineno or 0), function=code.co_name,
                           cell=cell_of(code.co_filename), stack=tuple(stack)))
    return i


def node_lines(keys: Sequence[Any], seqs: Sequence[int], first_line: dict[int, int]) -> list[int | None]:
    """Each node's line: its first save's (``first_line``: node index -> line), else the nearest
    node made before it that has one (by sequence number), else the nearest after; None for
    ``AccumulateGrad`` nodes (``keys`` not an int) and where no node has a line."""
    n = len(keys)
    out: list[int | None] = [None] * n
    if not first_line:
        return out
    known = sorted((seqs[i], line) for i, line in first_line.items())
    known_seqs = [s for s, _ in known]
    for i in range(n):
        line = first_line.get(i)
        if line is None and isinstance(keys[i], int):
            j = bisect.bisect_right(known_seqs, seqs[i]) - 1
            line = known[j][1] if j >= 0 else known[0][1]
        if isinstance(keys[i], int):
            out[i] = line
    return out


def lines_pass(trace: Trace, keys: Sequence[Any], seqs: Sequence[int], save_ids: Sequence[int],
               save_nodes: Sequence[int]) -> tuple[list[int | None], list[int | None]]:
    """Each node's line and each attached save's line (``save_ids``: their indices in the trace,
    ascending; ``save_nodes``: their nodes), see NOTE [ where lines come from ]."""
    packed = trace.save_lines
    if trace.line_table is None or not packed:
        return [None] * len(keys), [None] * len(save_ids)
    first: dict[int, int] = {}
    per_save: list[int | None] = []
    n_packed = len(packed)
    for sid, node in zip(save_ids, save_nodes, strict=True):
        line = packed[sid] if sid < n_packed else -1
        if line < 0:
            per_save.append(None)
            continue
        per_save.append(line)
        first.setdefault(node, line)
    return node_lines(keys, seqs, first), per_save
