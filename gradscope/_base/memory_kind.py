"""What a memory source can do, asked by kind: capture, the passes and the views never ask a name.

A user names a source as a string (``gs.record(memory="tracker")``, ``%gradscope --memory``);
:meth:`MemoryKind.resolve` reads it once, at that boundary, into a :class:`MemoryKind`, with a
:class:`~gradscope.errors.GradscopeError` for a name that is none. From there on the kind travels
(the block, the raw trace, the memory trace) and everything downstream asks its capabilities.
A recording saved to a file keeps the kind's :attr:`~MemoryKind.shown` text (``Where.memory_source``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from gradscope._base.errors import GradscopeError

__all__ = ["MemoryKind", "USER_NAMES"]


# what users may write, "auto" first; "counter" is not one (a long loop's capture turns to it itself)
USER_NAMES = ("auto", "cpu", "cuda", "tracker", "off")


@dataclass(frozen=True, slots=True)
class _Can:
    """One kind's capabilities (see :class:`MemoryKind`)."""

    shown: str
    measures: bool
    online: bool
    node_hooks: bool
    node_scopes: bool
    marks_calls: bool
    marks_steps: bool
    keys: str  # AllocEvent.key: "address", "storage" or "none"
    dispatch_mode: bool = False
    budgets: bool = False
    our_clock: bool = False
    unscoped: bool = False
    history: bool = False


class MemoryKind(enum.StrEnum):
    """A kind of memory source, and what it can do (its value is its name, the one users write).

    Capabilities (attributes): ``measures`` (it measures memory at all: not ``off``); ``online`` (it
    knows the live total at any moment: budgets, bytes around each step); ``node_hooks`` (it wants
    every node's start and end, so every step is seen); ``node_scopes`` (its events name the node
    scope they happened in: the profiler's); ``marks_calls`` (it wants module calls and backward
    passes marked); ``marks_steps`` (it wants step boundaries marked); :meth:`key_kind` (what its
    events' keys are); ``dispatch_mode`` (it runs a Python dispatch mode, which changes a few of
    PyTorch's backward formulas and cannot see inside compiled code); ``budgets`` (it can refuse
    an allocation at a simulated budget); ``our_clock`` (its events are stamped on the saves'
    clock: no slack when pairing them); ``unscoped`` (its events carry no node scope, backward mark
    or line: they are given from the times and the sequence counter); ``history`` (an allocator that
    can keep its event history and write a snapshot of it: CUDA's); ``steps_by_unpack`` (steps
    are seen only when a node unpacks a save); ``shown`` (the words a recording shows and keeps).
    """

    CPU = "cpu", _Can("cpu-allocator (profiler events)", measures=True, online=False, node_hooks=False,
                      node_scopes=True, marks_calls=True, marks_steps=False, keys="address")
    TRACKER = "tracker", _Can("storage tracker", measures=True, online=True, node_hooks=True, node_scopes=False,
                              marks_calls=True, marks_steps=True, keys="storage", dispatch_mode=True,
                              budgets=True, our_clock=True)
    CUDA = "cuda", _Can("cuda caching allocator", measures=True, online=True, node_hooks=True, node_scopes=False,
                        marks_calls=True, marks_steps=True, keys="none", history=True)
    COUNTER = "counter", _Can("cpu-allocator (allocator counter)", measures=True, online=True, node_hooks=False,
                              node_scopes=False, marks_calls=False, marks_steps=False, keys="address",
                              our_clock=True, unscoped=True)
    OFF = "off", _Can("off", measures=False, online=False, node_hooks=False, node_scopes=False,
                      marks_calls=False, marks_steps=False, keys="none")

    # each member's capabilities, plain attributes (capture reads some of them at every module call)
    shown: str
    measures: bool
    online: bool
    node_hooks: bool
    node_scopes: bool
    marks_calls: bool
    marks_steps: bool
    dispatch_mode: bool
    budgets: bool
    our_clock: bool
    unscoped: bool
    history: bool
    steps_by_unpack: bool  # steps are seen when a node unpacks a save: see NOTE [ how steps are seen ] in gradscope._capture.record
    _keys: str

    def __new__(cls, name: str, can: _Can) -> MemoryKind:
        kind = str.__new__(cls, name)
        kind._value_ = name
        for f in fields(_Can):
            setattr(kind, "_keys" if f.name == "keys" else f.name, getattr(can, f.name))
        kind.steps_by_unpack = not (can.node_hooks or can.node_scopes)
        return kind

    def key_kind(self, history: bool = False) -> str:
        """What its events' keys are: ``"address"``, ``"storage"`` or ``"none"`` (samples without
        keys); ``history``: CUDA's allocator history is on (its events have addresses)."""
        return "address" if history and self.history else self._keys

    @property
    def long_loop(self) -> MemoryKind:
        """The kind a long loop's capture goes on with from its first cut (see NOTE [ a long loop's
        memory ] in gradscope.memory): the allocator's counter instead of the profiler."""
        return MemoryKind.COUNTER if self is MemoryKind.CPU else self

    @staticmethod
    def of(kind: MemoryKind | str) -> MemoryKind:
        """A kind, or a resolved kind's name (the raw trace's constructors take both)."""
        if isinstance(kind, MemoryKind):
            return kind
        found = _BY_NAME.get(kind)
        if found is None:
            raise GradscopeError(
                f"gradscope: {kind!r} is not a memory source; the kinds are "
                f"{', '.join(k.value for k in MemoryKind)}.")
        return found

    @staticmethod
    def resolve(memory: MemoryKind | str, budget: int | None = None, *, online: bool = False) -> MemoryKind:
        """The kind a user's ``memory=`` names, read once where the user gives it.

        ``"auto"`` takes CUDA's allocator on a GPU, else the CPU allocator's events, or the tracker
        where an online source is needed (``online``: the notebook's OOM diagnosis). A budget needs
        a source that can refuse an allocation: ``cpu`` and ``off`` become the tracker (NOTE
        [ budgets need an online source ]).
        """
        if isinstance(memory, MemoryKind):
            kind = memory
        elif not isinstance(memory, str) or memory not in USER_NAMES:
            raise GradscopeError(
                f"gradscope: memory={memory!r} is not one of {', '.join(USER_NAMES)}. Use 'auto' to take "
                "CUDA's allocator on a GPU and the CPU allocator's events otherwise."
            )
        elif memory == "auto":
            kind = (MemoryKind.CUDA if torch.cuda.is_available()
                    else MemoryKind.TRACKER if online else MemoryKind.CPU)
        else:
            kind = _BY_NAME[memory]
        if budget is not None and not kind.online:
            # NOTE [ budgets need an online source ]: the profiler's events arrive only after the
            # block, so a budget that must stop the program at the crossing allocation uses the tracker.
            kind = MemoryKind.TRACKER
        return kind


_BY_NAME: dict[str, MemoryKind] = {k.value: k for k in MemoryKind}
