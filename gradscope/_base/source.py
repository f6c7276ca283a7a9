"""The source of a recorded block: the body of the ``with gs.record(...)`` statement it ran in.

The diagnosis runs its fixes on copies of the user's objects with the block's own code (see
:mod:`gradscope._analyses.diagnose.measure`), so a recording keeps that code: ``extra["step"]`` is
``{"source": ..., "file": ..., "line": ...}`` (the body dedented; the file and line of the ``with``).
Read at the block's end from ``linecache`` (scripts, modules and IPython cells are all there),
parsed once per file version. A notebook's ``%%gradscope`` cell gives its cell instead.
"""

from __future__ import annotations

import ast
import linecache
import os
import textwrap
from typing import Any

__all__ = ["OWN_FILES", "block_source", "step_source"]

_OWN = OWN_FILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, above _base


# (file, line, the lines' identity and length) -> the block's source: a loop that records the same
# block a thousand times reads and parses its file once (the lines are linecache's list, replaced
# when the file is read again)
_BLOCKS: dict[tuple[str, int, int, int], dict[str, Any] | None] = {}
_MAX_BLOCKS = 256


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def block_source(filename: str, line: int) -> dict[str, Any] | None:
    """The body of the innermost ``with`` statement whose header spans ``line`` of ``filename``,
    or None (no source, or the block was not entered by a ``with`` statement there)."""
    if filename.startswith(_OWN):  # gradscope's own blocks (predict, the notebook magic): not a user's step
        return None
    lines = linecache.getlines(filename)
    if not lines:
        return None
    key = (filename, line, id(lines), len(lines))
    if key not in _BLOCKS:
        if len(_BLOCKS) >= _MAX_BLOCKS:
            _BLOCKS.clear()
        _BLOCKS[key] = _block(filename, line, lines)
    found = _BLOCKS[key]
    return None if found is None else dict(found)


def _block(filename: str, line: int, lines: list[str]) -> dict[str, Any] | None:
    tree = _parse("".join(lines))
    if tree is None:
        return None
    best: ast.With | ast.AsyncWith | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith) and node.body:
            if node.lineno <= line < node.body[0].lineno and (best is None or node.lineno >= best.lineno):
                best = node
    if best is None:
        return None
    first, last = best.body[0], best.body[-1]
    start = first.lineno - 1
    if hasattr(first, "decorator_list") and first.decorator_list:
        start = min(d.lineno for d in first.decorator_list) - 1
    body = textwrap.dedent("".join(lines[start : last.end_lineno]))
    return {"source": body, "file": filename, "line": best.lineno}


def step_source(step: Any) -> str | None:
    """The source of a recording's ``extra["step"]``: given (a notebook cell), or read now from the
    file and line the block was entered at."""
    if not isinstance(step, dict):
        return None
    if isinstance(step.get("source"), str):
        return str(step["source"])
    file, line = step.get("file"), step.get("line")
    if not isinstance(file, str) or not isinstance(line, int):
        return None
    try:
        found = block_source(file, line)
    except Exception:  # unreadable or changed since: no source
        return None
    return None if found is None else str(found["source"])
