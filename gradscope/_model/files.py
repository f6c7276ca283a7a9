"""A recording's file: JSON, columns for the big tables, no pickle; every field read back checked
(NOTE [ files are data ]); files of schema 1 migrated (:func:`_migrate_1_to_2`); every file
gradscope writes written atomically (:func:`atomic_write_text`). :meth:`Recording.to_dict` and
:meth:`Recording.from_dict` (in :mod:`gradscope.recording`) lay the fields out with these helpers.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from gradscope._base.errors import GradscopeError
from gradscope._model.rows import Category, HeldAllocation, HeldMemory, Kind, Phase, SourceLine
from gradscope._model.table import Table

SCHEMA_VERSION = 2
_FORMAT = "gradscope.recording"
# Files larger than this are refused by `load` before parsing: a recording of a 200,000-node
# graph is about 60 MB of JSON.
_MAX_FILE_BYTES = 1 << 30


def read_json(p: str) -> Any:
    """The JSON value in the file ``p``, read as :func:`gradscope.recording.load` reads it (a regular
    file, within the size limit, UTF-8 JSON); raises GradscopeError for anything else."""
    try:
        st = os.stat(p)
    except OSError as e:
        raise GradscopeError(f"gradscope: cannot read {p!r}: {e.strerror}.") from None
    if not stat.S_ISREG(st.st_mode):  # a directory, or a pipe that would block the read forever
        raise GradscopeError(f"gradscope: cannot read {p!r}: it is not a regular file.")
    size = st.st_size
    if size > _MAX_FILE_BYTES:
        raise GradscopeError(
            f"gradscope: {p!r} is {size} bytes, more than the {_MAX_FILE_BYTES}-byte limit for a "
            "recording; it is probably not a gradscope file."
        )
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise GradscopeError(f"gradscope: cannot read {p!r}: {e.strerror}.") from None
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        raise GradscopeError(f"gradscope: {p!r} is not UTF-8 JSON; is it a gradscope recording?") from None
    except json.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(text.rstrip()) else "not valid JSON"
        raise GradscopeError(
            f"gradscope: {p!r} is {what} ({e.msg} at character {e.pos}). "
            "Save the recording again with Recording.save()."
        ) from None
    except RecursionError:
        raise GradscopeError(f"gradscope: {p!r} is nested too deeply to be a gradscope recording.") from None
    return data


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a crash or a failed write leaves any
    previous file intact and no temporary behind (every file gradscope writes goes through it).
    The file gets the mode ``open(path, "w")`` would give it: a file written over keeps its
    mode, a new one gets ``0o666`` less the process's umask (the temporary is ``0o600``)."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=".gradscope-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.chmod(tmp, mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode_for(path: str) -> int:
    """The permission bits a plain ``open(path, "w")`` leaves: the existing file's, else
    ``0o666`` less the umask (read from /proc where it can be, so no other thread sees the umask
    changed for a moment)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    umask = None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except (OSError, ValueError):
        umask = None
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _enum_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in d.items()}


def _columns(rows: Iterable[Any], cls: type) -> dict[str, list[Any]]:
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(rows, Table) and rows._rows is None:  # see NOTE [ tables are columns ]
        return {n: [_json_value(v) for v in rows.column(n)] for n in names}
    cols: dict[str, list[Any]] = {n: [] for n in names}
    for r in rows:
        for n in names:
            v = getattr(r, n)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, float) and not math.isfinite(v):
                v = None
            cols[n].append(v)
    return cols


def _lines_inside(cols: dict[str, list[Any]], n_lines: int) -> dict[str, list[Any]]:
    """A table's line column as written: an index outside the line table (rows taken from another
    recording without its lines) is written as none, so that the file loads (see NOTE [ files are
    data ])."""
    col = cols.get("line")
    if col is not None and any(v is not None and not 0 <= v < n_lines for v in col):
        cols["line"] = [v if v is not None and 0 <= v < n_lines else None for v in col]
    return cols


def _json_value(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_CONVERT: dict[str, Any] = {
    "phase": Phase,
    "kind": Kind,
    "category": Category,
    "shape": lambda v: tuple(int(x) for x in v) if isinstance(v, list | tuple) else v,
    "leaf_shape": lambda v: None if v is None else tuple(int(x) for x in v),
    "roots": lambda v: tuple(v) if isinstance(v, list) else v,
    "inputs": lambda v: tuple(v) if isinstance(v, list) else v,
    "accumulated": lambda v: tuple(v) if isinstance(v, list) else v,
    "holders": lambda v: _holders(v),
}


# NOTE [ files are data ]: a recording file may come from anyone. Every field read from one must
# have its declared type (views index, sort and add with them), and every index into another
# table must point inside it; otherwise loading fails with a GradscopeError.
_TYPE_CHECKS: dict[str, Any] = {
    "int": lambda v: type(v) is int,
    "float": lambda v: v is None or type(v) in (int, float),  # non-finite floats are written as null
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "None": lambda v: v is None,
    "Kind": lambda v: isinstance(v, Kind),
    "Phase": lambda v: isinstance(v, Phase),
    "Category": lambda v: isinstance(v, Category),
    "tuple[int, ...]": lambda v: type(v) is tuple and all(type(x) is int for x in v),
}
_PLANS: dict[type, list[tuple[str, Any, Any]]] = {}


def _plan(cls: type) -> list[tuple[str, Any, Any]]:
    """(field name, conversion, type check or None) for each field of ``cls``."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = []
        for f in dataclasses.fields(cls):
            parts = [p.strip() for p in str(f.type).split("|")]
            checks = [_TYPE_CHECKS.get(p) for p in parts]
            check = None if None in checks else (lambda v, cs=tuple(checks): any(c(v) for c in cs))
            plan.append((f.name, _CONVERT.get(f.name), check))
        _PLANS[cls] = plan
    return plan


def _build(cls: type, d: Mapping[str, Any]) -> Any:
    if not isinstance(d, Mapping):
        raise TypeError(f"expected an object for {cls.__name__}")
    kwargs = {}
    for name, conv, check in _plan(cls):
        if name in d:
            v = d[name]
            if conv is not None:
                v = conv(v)
            if check is not None and not check(v):
                raise TypeError(f"{cls.__name__}.{name} cannot be {type(v).__name__} {str(v)[:40]!r}")
            kwargs[name] = v
    return cls(**kwargs)


def _rows(cols: Mapping[str, list[Any]], cls: type) -> list[Any]:
    if not isinstance(cols, Mapping):
        raise TypeError(f"expected columns for {cls.__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    present = [n for n in names if n in cols]
    lengths = {len(cols[n]) for n in present}
    if len(lengths) > 1:
        raise ValueError(f"columns of {cls.__name__} have different lengths {sorted(lengths)}")
    n_rows = lengths.pop() if lengths else 0
    return [_build(cls, {n: cols[n][i] for n in present}) for i in range(n_rows)]


def _holders(v: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(v, list | tuple) or not all(
            isinstance(h, list | tuple) and len(h) == 2 and type(h[0]) is str and type(h[1]) is int for h in v):
        raise TypeError("holders are not (what, bytes) pairs")
    return tuple((h[0], h[1]) for h in v)


def _extra(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise TypeError("extra must be an object")
    return dict(v)


def _held_from_json(v: Any) -> HeldMemory | None:
    """A held-at-peak object from its JSON form (see :meth:`HeldMemory.to_dict`)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise TypeError("held must be an object")
    if "rows" not in v:  # schema 1 kept {"error": ...} when listing failed
        return HeldMemory(moment="none", live_bytes=0, key_kind="none", error=_opt_str(v.get("error")))
    rows = []
    for r in v.get("rows") or ():
        if not isinstance(r, Mapping):
            raise TypeError("a held row must be an object")
        r = dict(r)
        if r.get("shape") is not None:
            r["shape"] = tuple(int(x) for x in r["shape"])
        r.setdefault("what", "forward")
        r.setdefault("label", "")
        rows.append(_build(HeldAllocation, r))

    def pairs(m: Any) -> tuple[tuple[str, int], ...]:
        if not isinstance(m, Mapping):
            raise TypeError("expected an object of byte counts")
        return tuple((str(k), _int(b)) for k, b in m.items())

    return HeldMemory(
        moment=str(v.get("moment", "peak")), live_bytes=_int(v.get("live_bytes", 0)),
        key_kind=str(v.get("key_kind", "storage")), rows=tuple(rows), omitted=_int(v.get("omitted", 0)),
        omitted_bytes=_int(v.get("omitted_bytes", 0)), omitted_by_kind=pairs(v.get("omitted_by_kind") or {}),
        omitted_by_module=pairs(v.get("omitted_by_module") or {}), error=_opt_str(v.get("error")),
    )


def _lines(v: Any) -> tuple[SourceLine, ...]:
    """The line table from its JSON form: ``[file, line, function, cell, stack]`` rows."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise TypeError("lines must be a list")
    out = []
    for row in v:
        if not isinstance(row, list) or len(row) != 5:
            raise TypeError("a line must be [file, line, function, cell, stack]")
        file, line, function, cell, stack = row
        if not isinstance(stack, list) or not all(isinstance(f, list) and len(f) == 3 for f in stack):
            raise TypeError("a line's stack must be a list of [file, line, function]")
        out.append(SourceLine(
            file=str(file), line=_int(line), function=str(function), cell=_opt_int(cell),
            stack=tuple((str(f[0]), _int(f[1]), str(f[2])) for f in stack),
        ))
    return tuple(out)


def _migrate_1_to_2(d: Mapping[str, Any]) -> dict[str, Any]:
    """Schema 1 kept what is now typed (held tensors, backward calls, the simulated OOM, node
    counts) as untyped dicts in ``extra``; schema 2 has fields for them. Nothing else changed."""
    out = dict(d)
    extra = d.get("extra")
    extra = dict(extra) if isinstance(extra, Mapping) else extra
    if isinstance(extra, dict):
        if "held" in extra:
            out["held"] = extra.pop("held")
        if "oom" in extra:
            out["oom"] = extra.pop("oom")
        calls = extra.pop("backward_calls", None)
        if isinstance(calls, list):
            cols: dict[str, list[Any]] = {"index": [], "api": [], "create_graph": [], "retain_graph": []}
            for i, c in enumerate(calls):
                if not isinstance(c, Mapping):
                    raise TypeError("a backward call must be an object")
                cols["index"].append(i)
                cols["api"].append(str(c.get("api", "backward")))
                cols["create_graph"].append(bool(c.get("create_graph", False)))
                cols["retain_graph"].append(bool(c.get("retain_graph", False)))
            out["backward_calls"] = cols
        for k in ("nodes_created", "nodes_created_seen"):
            if k in extra:
                out[k] = extra.pop(k)
    out["extra"] = extra
    out["schema"] = 2
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)
