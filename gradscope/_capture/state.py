"""What the hooks read and change while a block runs (``_State``: the same fields as the
compiled hooks' State, NOTE [ one definition of the shared state ] in gradscope._capture.native.fields),
what the recorder's parts share (:class:`Block`), and the collector switched off while rows are
made."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradscope._base.compat import Capabilities
from gradscope._base.errors import MemoryBudgetExceeded
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.trace import (
    BackwardRow,
    Trace,
)
from gradscope._capture.memory.source import MemorySource
from gradscope._capture.native.fields import STATE_SLOTS
from gradscope._model.lines import LineTable


class _State:
    """What the hooks read and change while the block runs (attribute access is cheap)."""

    __slots__ = STATE_SLOTS  # the compiled State's fields too: NOTE [ one definition of the shared state ]

    def __init__(self) -> None:
        self.bw: BackwardRow | None = None  # the observed backward running now
        self.func_depth = 0
        self.last_seq = -1  # the node of the last step event (off mode)
        self.marks = False  # a node's first unpack is a step event (see NOTE [ how steps are seen ])
        self.pending: list[int] = []  # saves unpacked by the running node (frees checked next)
        self.prev_node: int | None = None  # hooks mode: the node of the last pre hook
        self.reading: list[int] | None = None  # names read by unpacking (older torch)
        self.stack: list[tuple[Any, list[Any], Any]] = []  # open module calls


_STATE_CLASSES: dict[type, type] = {}


def _new_state(native: Any) -> _State:
    """A :class:`_State`; with the compiled hooks, one they read directly (the same fields in C)."""
    if native is None:
        return _State()
    cls = _STATE_CLASSES.get(native.State)
    if cls is None:
        cls = _STATE_CLASSES[native.State] = type("_State", (native.State,),
                                                  {"__slots__": (), "__init__": _State.__init__,
                                                   "__doc__": _State.__doc__})
    return cls()  # type: ignore[no-any-return]


def _note_internal(notes: list[str], e: BaseException) -> None:
    """An error of gradscope's own while observing becomes a note (once); a budget's refusal is
    the user's and goes on."""
    if isinstance(e, MemoryBudgetExceeded):
        raise e
    msg = f"gradscope internal error while observing: {e!r}"
    if msg not in notes:
        notes.append(msg)


@dataclass(slots=True, eq=False)
class Block:
    """What the recorder's parts share while one block runs (one per block, made as it is entered;
    see :mod:`gradscope._capture`). Each part keeps the rest of its state itself."""

    tid: int  # the thread recorded (see NOTE [ threads ] in gradscope._capture.record)
    memory: MemoryKind  # the memory source's kind, resolved: capture asks its capabilities
    history: bool  # CUDA: the caching allocator's event history is recorded
    native: Any  # the compiled hooks' module; None: the Python pair records (see NOTE [ compiled hooks ])
    caps: Capabilities
    trace: Trace  # the rows the hooks append (see NOTE [ capture apart from analysis ] in gradscope._base.trace)
    state: _State  # what the hooks read and change (the compiled hooks read it too)
    line_table: LineTable | None  # see NOTE [ where lines come from ] in gradscope._model.lines
    source: MemorySource | None = None  # the memory source, once started
    walker: Any = None  # the compiled walk (see NOTE [ compiled walk ]); None: Python walks, or the block ended
    hooking: bool = True  # False for the walk at the block's end, which only reads
    handles: list[Any] = field(default_factory=list)  # hook handles, removed when the block ends
    undo: list[Callable[[], None]] = field(default_factory=list)  # what else the block's end undoes
    # hooks on the piece's graph nodes, removed when it ends (a piece of a loop's capture ends at a
    # cut: see NOTE [ iterations ] in gradscope._passes.iterations; the block's handles and undo go on)
    node_handles: list[Any] = field(default_factory=list)
    # the recorder's: an iteration may have ended ("backward": a pass with the row given, "optimizer")
    ended: Callable[[str, Any], None] | None = None
    roots: list[weakref.ref[torch.Tensor]] = field(default_factory=list)  # results that may root a graph
    root_mods: list[weakref.ref[nn.Module]] = field(default_factory=list)  # root modules, by root index
    param_by_id: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = field(default_factory=dict)  # id -> (param, root, name)

    def internal(self, e: BaseException) -> None:
        """An error of gradscope's own while observing: a note (see _note_internal)."""
        _note_internal(self.trace.notes, e)
