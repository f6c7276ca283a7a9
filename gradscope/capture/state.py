"""What the hooks read and change while a block runs (``_State``: the same fields as the
compiled hooks' State, NOTE [ one definition of the shared state ] in gradscope._native.fields),
the recorder's parts' common base, and the collector switched off while rows are made."""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING, Any

from gradscope._native.fields import STATE_SLOTS
from gradscope._trace import (
    BackwardRow,
)
from gradscope.errors import MemoryBudgetExceeded


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


@contextlib.contextmanager
def _no_gc() -> Any:
    """NOTE [ no collection while rows are made ]: walks and passes make tens of thousands of
    small objects that all live on; Python's cyclic collector, triggered by that count, would
    scan every object in the process again and again (measured: a 5,000-node graph pass took
    127 ms with it, 4 ms without). Nothing gradscope makes there is cyclic garbage; the
    collector is switched off for those moments only, and back on as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _note_internal(notes: list[str], e: BaseException) -> None:
    """An error of gradscope's own while observing becomes a note (once); a budget's refusal is
    the user's and goes on."""
    if isinstance(e, MemoryBudgetExceeded):
        raise e
    msg = f"gradscope internal error while observing: {e!r}"
    if msg not in notes:
        notes.append(msg)


class Part:
    """A part of the recorder (:class:`gradscope.record.record` is made of them): its methods read
    the block's attributes, set by ``record._init_state``."""

    # set by the parts themselves (the rest by record._init_state)
    _other_depth: int  # see NOTE [ other pairs on an older torch ]
    _packed_upto: int  # saves counted into record._packed_seqs so far

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...
