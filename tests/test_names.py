"""Names say one thing. Every pointer in gradscope's docstrings and comments names what exists:
"NOTE [ x ] in gradscope.y" a module of the package that holds that NOTE, ":mod:`gradscope.y`" a
module, ":func:`gradscope.y.f`" (and its kinds) a function, class or attribute; every NOTE pointed
to is written somewhere; and no two classes of the package share a name."""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "gradscope"

# A pointer may wrap over lines (of a docstring, or of ``#`` comments): lines are joined first.
_JOIN = re.compile(r"\s*\n\s*(?:(?:#|//)\s*)?")
_NOTE = re.compile(r"NOTE \[ (?P<name>[^\]]+?) \](?P<colon>:)?"
                   r"(?: (?:there|in (?:(?P<file>\w+\.(?:cc|h))|(?P<path>gradscope/[\w/]+\.py)|(?::mod:`)?(?P<module>~?gradscope(?:\.\w+)*|_\w+)`?)))?")
# A NOTE is written either as ``NOTE [ x ]:`` followed by its text, or as a comment line of its own
# (``# NOTE [ x ]`` / ``// NOTE [ x ]``) above it.
_HEADING = re.compile(r"^\s*(?:#|//)\s*NOTE \[ (?P<name>[^\]]+?) \]\s*$", re.MULTILINE)
_MOD = re.compile(r":mod:`~?(gradscope(?:\.\w+)*)`")
_OBJ = re.compile(r":(?:func|class|meth|attr|data|exc):`~?(gradscope(?:\.\w+)+)`")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    """The package's source files: a Python module by its dotted name, a C++ file by its file name."""
    out = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    out |= {p.name: p for p in sorted(PKG.rglob("*.cc")) + sorted(PKG.rglob("*.h"))}
    return out


def _sources() -> dict[str, str]:
    """Each file's text, its lines joined so that a wrapped pointer reads as one."""
    return {name: _JOIN.sub(" ", p.read_text(encoding="utf-8")) for name, p in _files().items()}


def _defined() -> dict[str, set[str]]:
    """NOTE name -> files that write it."""
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in _files().items():
        text = path.read_text(encoding="utf-8")
        for m in _HEADING.finditer(text):
            out[m["name"]].add(name)
        for m in _NOTE.finditer(_JOIN.sub(" ", text)):
            if m["colon"]:
                out[m["name"]].add(name)
    return out


def _holders(defined: dict[str, set[str]], name: str) -> set[str]:
    """The files that write NOTE ``name`` (``x ...`` stands for a NOTE whose name starts with x)."""
    if name.endswith(" ..."):
        prefix = name[:-4]
        return set().union(*(files for note, files in defined.items() if note.startswith(prefix)))
    return defined.get(name, set())


def test_mod_pointers_name_modules_that_exist() -> None:
    files = set(_files())
    stale = []
    for source, text in _sources().items():
        for m in _MOD.finditer(text):
            if m[1] not in files:
                stale.append(f"{source}: :mod:`{m[1]}`")
    assert not stale, "pointers to modules that do not exist:\n" + "\n".join(stale)


def _resolves(dotted: str) -> bool:
    """Whether ``gradscope.a.B.c`` names a module, then attributes of it (a dataclass field or a
    slot of a class counts)."""
    parts = dotted.split(".")
    obj: object = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for name in parts[i:]:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type) and (name in getattr(obj, "__dataclass_fields__", {})
                                        or name in getattr(obj, "__slots__", ())):
            return True
        else:
            return False
    return True


def test_object_pointers_name_what_exists() -> None:
    """``:func:`gradscope.x.f``` and its kind name a function, class or attribute that exists."""
    stale = [f"{source}: {m[0]}" for source, text in _sources().items() for m in _OBJ.finditer(text)
             if not _resolves(m[1])]
    assert not stale, "pointers to names that do not exist:\n" + "\n".join(stale)


def test_note_pointers_name_the_module_that_holds_the_note() -> None:
    defined = _defined()
    files = set(_files())
    stale = []
    for source, text in _sources().items():
        for m in _NOTE.finditer(text):
            if m["colon"]:
                continue
            name = m["name"]
            holders = _holders(defined, name)
            if m["path"] is not None:  # ``in gradscope/_model/lines.py``, as C++ comments write it
                target = _module_name(PKG.parent / m["path"])
            elif m["file"] is not None:  # ``in walk.cc``
                target = m["file"]
            elif m["module"] is not None:
                target = m["module"].lstrip("~")
                if not target.startswith("gradscope"):
                    target = f"gradscope.{target}"  # ``in _views``, written inside the package
            else:
                if not holders:
                    stale.append(f"{source}: NOTE [ {name} ], which no file holds")
                continue
            if target not in files:
                stale.append(f"{source}: NOTE [ {name} ] in {target}, which is no module of gradscope")
            elif target not in holders:
                stale.append(f"{source}: NOTE [ {name} ] in {target}, which does not hold it"
                             f" (held in {sorted(holders) or 'no file'})")
    assert not stale, "stale NOTE pointers:\n" + "\n".join(stale)


# Names still shared, each with its reason (keep this short; it only ever shrinks).
_SHARED = {
    # capture.state.State is the recorder's state (mirrored field by field by the compiled hooks'
    # State); ipython._State is the extension's per-shell state. Both belong to the recorder's
    # and the notebook's restructuring, which renames them.
    "State",
    # capture.state.Block (what the recorder's parts share while a block runs) is new in that
    # restructuring; predict's _Block (an allocator block) predates it. Left to that work.
    "Block",
}


def test_one_class_name_one_class() -> None:
    """Two classes of the package with one name would be two things under one word (a class and
    its deprecated alias are one class)."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):  # one module may define a class twice (with and without ipywidgets)
                where[node.name.lstrip("_")].add(_module_name(path))
    twice = {name: sorted(mods) for name, mods in where.items() if len(mods) > 1 and name not in _SHARED}
    assert not twice, f"class names used twice: {twice}"
