"""A loop recorded in one block: where its iterations end, when its capture is cut, and which
pieces are kept for their detail (see NOTE [ iterations ] in gradscope._passes.iterations).

The recorder (:mod:`gradscope.record`) calls :meth:`LoopTracking.ended` when a backward pass or an
optimizer step ends; it marks the iteration's end in the current piece's trace and says whether the
recorder should cut. After a cut, :meth:`LoopTracking.piece_done` takes the finished piece (its trace
complete, its memory events resolved), makes its rows and decides whether its trace is kept: the
head always, the last :data:`~gradscope._passes.iterations.KEEP_LAST` pieces (a ring), the one with the
highest peak among those pushed out of the ring, any holding an iteration the user named; every
other piece's trace is dropped once its rows are made, which bounds a loop's memory to the pieces
kept and one row of numbers per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradscope._base.errors import GradscopeError
from gradscope._base.trace import Trace
from gradscope._passes import iterations as _iterations

__all__ = ["CONFIRM", "LoopTracking", "Piece", "parse_keep"]

CONFIRM = 8  # backward-only iterations before any optimizer step after which they are a loop's iterations


def parse_keep(keep: Any) -> tuple[bool, frozenset[int]]:
    """``keep=`` as (keep every iteration's detail, the iterations named)."""
    if keep is None:
        return False, frozenset()
    if keep == "all":
        return True, frozenset()
    try:
        named = frozenset(int(k) for k in ([keep] if isinstance(keep, int) else keep))
    except (TypeError, ValueError):
        named = None
    if named is None or isinstance(keep, bool | str) or any(k < 0 for k in named):
        raise GradscopeError(
            f"gradscope: keep= takes iteration indices (an int, or an iterable of ints >= 0, e.g. keep=[537] "
            f"or keep=range(100, 110)) or 'all' (every iteration's detail, memory growing with the loop), "
            f"got {keep!r}.")
    return False, named


_EMPTY = Trace()  # a dropped piece's trace


@dataclass(eq=False)
class Piece:
    """One piece of a loop's capture kept for its detail: its trace and its iterations [first, last]."""

    trace: Trace
    first: int
    last: int
    peak: int = -1  # the highest peak among its iterations (-1: none measured)
    named: bool = False


@dataclass(eq=False)
class LoopTracking:
    """The block's iterations as it runs (see the module's docstring)."""

    keep_all: bool = False
    named: frozenset[int] = frozenset()
    carry: _iterations.Carry = field(default_factory=_iterations.Carry)
    optimizer_seen: bool = False
    tentative: int = 0  # backward ends marked before any optimizer step, not yet confirmed (see ended)
    confirmed: bool = False  # CONFIRM backward ends came without an optimizer step: each ends an iteration
    iterations: int = 0  # iterations ended (marks made)
    first_in_piece: int = 0  # the first iteration of the current piece
    cut: bool = False  # the block's head was cut
    can_cut: bool = True  # the memory source allows cutting (see record._cut)
    head: Piece | None = None
    ring: list[Piece] = field(default_factory=list)
    peak: Piece | None = None
    named_parts: list[Piece] = field(default_factory=list)
    # called with the rows made so far, after each iteration's row (the live view, the progress lines)
    listeners: list[Callable[[LoopTracking], None]] = field(default_factory=list)
    rows_done: int = 0  # marks of the current piece whose rows are made
    events_done: int = 0  # the current piece's memory events read into the rows so far

    def ended(self, kind: str, trace: Trace, row: Any = None) -> bool:
        """A backward pass (``row``: its BackwardRow) or an optimizer step ended: True where an
        iteration ended (a mark is added to ``trace``) and its row may be made.

        Before the block's first optimizer step, a backward's end is an iteration's end only
        tentatively (see NOTE [ iterations ] in gradscope._passes.iterations): a loop that accumulates
        gradients over several backward passes per step makes its first step after them, and then
        they were one iteration; the first optimizer step takes back the tentative ends (no row is
        made for them until :data:`CONFIRM` of them came without an optimizer step)."""
        if kind == "optimizer":
            if not self.optimizer_seen and self.tentative:
                del trace.marks[-self.tentative:]
                self.iterations -= self.tentative
                self.tentative = 0
            self.optimizer_seen = True
        elif self.optimizer_seen or row is None or row.api != "backward" or row.create_graph or row.retain_graph:
            return False
        elif not self.confirmed:
            self.tentative += 1
        trace.marks.append((time.time_ns(), len(trace.saves), len(trace.backwards), len(trace.optimizer_steps)))
        self.iterations += 1
        if self.tentative >= CONFIRM:  # a loop without optimizer steps: a backward's end ends an iteration
            self.tentative, self.confirmed = 0, True
        return self.tentative == 0

    def should_cut(self) -> bool:
        return (not self.keep_all and self.can_cut and not self.tentative and self.iterations >= _iterations.HEAD
                and self.iterations > self.first_in_piece)

    def keeps(self, first: int, last: int) -> bool:
        return any(first <= k <= last for k in self.named)

    def rows(self, trace: Trace, events: Any, *, last: bool = False, failed: bool = False, deltas: bool = False) -> None:
        """Rows of the current piece's iterations ended since the last call (``events``: the piece's
        memory events so far, None where the source reads them at the end only; ``deltas``: see
        :func:`gradscope._passes.iterations.iterations_pass`)."""
        made, self.events_done = _iterations.iterations_pass(
            trace, self.carry, events, last=last, failed=failed, mark_from=self.rows_done,
            event_from=self.events_done, deltas=deltas)
        self.rows_done += made
        if made:
            self._notify()

    def piece_done(self, trace: Trace, events: Any, deltas: bool = False) -> None:
        """A piece ended at a cut: its last rows, then whether its trace is kept."""
        first = self.first_in_piece
        self.rows(trace, events, deltas=deltas)
        # see NOTE [ what a piece leaves after its last iteration ] in gradscope._passes.iterations
        _iterations.absorb(trace, self.carry, events, self.events_done, deltas=deltas)
        last = len(self.carry.rows) - 1
        self.first_in_piece = last + 1
        self.rows_done = self.events_done = 0
        rows = self.carry.rows
        peak = max((rows.peak[k] for k in range(first, last + 1)), default=-1)
        piece = Piece(trace, first, last, peak, self.keeps(first, last))
        if self.head is None:
            self.head = piece
        else:
            self.ring.append(piece)
            if len(self.ring) > _iterations.KEEP_LAST:
                self._retire(self.ring.pop(0))

    def _retire(self, piece: Piece) -> None:
        """A piece pushed out of the ring of the last ones: kept if named or the highest peak so far."""
        if piece.named:
            self.named_parts.append(piece)
            return
        if piece.peak >= 0 and (self.peak is None or piece.peak > self.peak.peak):
            old, self.peak = self.peak, piece
            if old is not None:
                self._drop(old)
        else:
            self._drop(piece)

    def _drop(self, piece: Piece) -> None:
        kept = self.carry.rows.kept
        for k in range(piece.first, piece.last + 1):
            kept[k] = 0
        piece.trace = _EMPTY  # its rows are made: the trace's rows go

    def _notify(self) -> None:
        for listen in self.listeners:
            try:
                listen(self)
            except Exception:  # a view that failed must not stop the program
                pass

    def kept_pieces(self, final: Piece | None) -> list[Piece]:
        """Every piece kept at the end, in order (``final``: the block's last piece, None where it holds
        no iteration)."""
        pieces = [p for p in (self.head, self.peak, *self.named_parts, *self.ring, final) if p is not None]
        return sorted(pieces, key=lambda p: p.first)
