"""The one definition of the state the compiled hooks and walk share with Python.

NOTE [ one definition of the shared state ]: the recorder's hooks state (``State``: read and set by
the Python hooks and by hooks.cc alike) and the tables the compiled walk writes into (``Walker``'s
one argument) are listed here, once. ``fields.h`` is generated from these lists
(:func:`render_header`; tests/test_native.py checks that the committed file is its output), and the
C++ structs, their attribute tables, collector functions and the walker's argument parsing are
X-macros over it; the Python side takes its ``__slots__`` from the same lists. A field added here,
then the header regenerated (``python -m gradscope._capture.native.fields``), appears on both sides.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["STATE", "WALKER", "WalkerTables", "render_header"]

# (name, C kind: "object" or "int"): record's hooks state (see record._State for each one's meaning)
STATE: tuple[tuple[str, str], ...] = (
    ("bw", "object"),
    ("marks", "object"),
    ("last_seq", "int"),
    ("pending", "object"),
    ("prev_node", "object"),
    ("reading", "object"),
    ("stack", "object"),
    ("func_depth", "int"),
)

# (name, the Python type it must be, or "" for any object, what it is): the compiled walk's tables
WALKER: tuple[tuple[str, str, str], ...] = (
    ("index", "dict", "node key -> node index (gradscope._base.trace)"),
    ("nodes", "list", "list of node rows"),
    ("edge_keys", "list", "the edges' source keys"),
    ("edge_dst", "list", "the edges' destination indices"),
    ("packed", "dict", "Counter: node number -> saves the pack hook made under it"),
    ("seq_attr", "dict", "node number -> the attribute of its one saved tensor"),
    ("seq_order", "dict", "node number -> its saves' attributes in pack order"),
    ("hooked", "set", "node indices with a pre hook for the whole block"),
    ("leaf_hooks", "dict", "node index -> a leaf's pre hook"),
    ("type_info", "", "callable(fn) -> (name, attributes, custom, single)"),
    ("node_key", "", "callable(fn) -> an AccumulateGrad node's key"),
    ("name_node", "", "callable(fn, key, attributes, absent bits, ours): the saves read in Python"),
    ("hook", "", "callable(fn, index, name, post)"),
    ("leaf_row", "", "callable(fn, index, key, name, custom, hooking, hook_all)"),
    ("saves", "list", "save rows (gradscope._base.trace): ``packed`` counts them"),
    ("acc_vars", "dict", "AccumulateGrad node index -> weak reference to its leaf"),
    ("leaf_key", "", "callable(leaf tensor) -> its AccumulateGrad node's key"),
)

STATE_SLOTS: tuple[str, ...] = tuple(sorted(name for name, _ in STATE))


class WalkerTables:
    """The compiled walker's one argument: every table and callback it reads, by name (``WALKER``)."""

    __slots__ = tuple(name for name, _, _ in WALKER)

    def __init__(self, **fields: Any) -> None:
        missing = set(self.__slots__) ^ set(fields)
        if missing:
            raise TypeError(f"WalkerTables takes exactly the fields {self.__slots__}; wrong: {sorted(missing)}")
        for name, value in fields.items():
            setattr(self, name, value)


_HEADER = Path(__file__).with_name("fields.h")
_C_TYPES = {"dict": "&PyDict_Type", "list": "&PyList_Type", "set": "&PySet_Type", "": "nullptr"}


def render_header() -> str:
    """``fields.h``'s text, made from :data:`STATE` and :data:`WALKER`."""
    lines = [
        "// Generated from gradscope/_capture/native/fields.py (python -m gradscope._capture.native.fields): do not edit.",
        "// See NOTE [ one definition of the shared state ] there.",
        "#pragma once",
        "",
        "// The hooks' State: OBJECT(name) for an owned object, INT(name) for a long long.",
        "#define GRADSCOPE_STATE_FIELDS(OBJECT, INT) \\",
    ]
    lines += [f"  {'OBJECT' if kind == 'object' else 'INT'}({name}) \\" for name, kind in STATE]
    lines += ["", "", "// The Walker's tables: FIELD(name, the type it must be or nullptr), all owned objects.",
              "#define GRADSCOPE_WALKER_FIELDS(FIELD) \\"]
    lines += [f"  FIELD({name}, {_C_TYPES[kind]}) /* {doc} */ \\" for name, kind, doc in WALKER]
    lines += ["", "", f"#define GRADSCOPE_WALKER_NFIELDS {len(WALKER)}", ""]
    return "\n".join(lines)


def main() -> int:
    _HEADER.write_text(render_header())
    print(f"wrote {_HEADER.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
