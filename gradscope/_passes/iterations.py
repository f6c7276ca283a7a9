"""Iterations of a loop recorded in one block: a row per iteration, what grows across them, and the
bookkeeping a long loop needs to record in bounded memory (pure passes over traces, as
:mod:`gradscope._passes`; the recorder's side is :mod:`gradscope._capture.loop`).

NOTE [ iterations ]: a block that trains for many steps is a loop, and its unit is the iteration:
what runs up to and including an optimizer step, or, in a block that has made no optimizer step,
a ``backward()`` that keeps no graph (neither ``retain_graph`` nor ``create_graph``: an
``autograd.grad`` or a pass whose graph is used again is part of a larger iteration, as in
meta-learning's unrolled steps) and what follows it. The recorder marks each iteration's end in the
trace (``Trace.marks``). Every iteration gets a row (:class:`gradscope.recording.Iteration`): when
and how long, the memory when it began, at its peak and when it ended, the bytes its saves kept
alive, the largest holders at its peak. Rows are made as the loop runs, from the memory source's
events of the iteration and the live allocations the earlier iterations left (:class:`Carry`), so a
row costs the iteration's own events, whatever the loop's length.

The full detail (graph, saves, steps, timeline, allocation table) of a long loop is kept for a few
iterations only: the first ones (the block's head, up to :data:`HEAD` iterations, recorded as one
piece, as a block of that many iterations is), the last ones, the one with the highest peak, the
one that failed and any the user names (``gs.record(keep=...)``); after the head each iteration's
capture is a piece of its own, analysed as a block of one iteration would be, and those not kept
are dropped once their row is made (see :mod:`gradscope._capture.loop`). A block of at most
:data:`HEAD` iterations is recorded as it always was.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope._base.series import Interner
from gradscope._base.trace import (
    C_REL,
    C_ROOT,
    C_T0,
    C_T1,
    M_BACKWARDS,
    M_OPT,
    M_SAVES,
    M_T,
    S_BYTES,
    S_SEQ,
    Trace,
)
from gradscope._model.growth import SiteGrowth
from gradscope._model.recording import Growth, Iteration, Table

__all__ = ["HEAD", "KEEP_LAST", "Carry", "Rows", "iterations_pass", "site_label"]

HEAD = 10  # iterations recorded as one piece before a loop is cut (the first ones kept)
KEEP_LAST = 3  # the last iterations kept
HOLDERS = 3  # holders in a row

Site = tuple[Any, ...]  # ("line", index) | ("module", root, path) | ("phase", name) | ("label", text)


@dataclass
class Rows:
    """Every iteration's row, as columns of 8-byte numbers (see NOTE [ iterations ]: a 100,000
    iteration loop's rows are 100,000 x ~15 numbers; as Python objects they would cost ~40 MB).
    Holders are kept as interned sites; -1 stands for None."""

    start_ns: array[int] = field(default_factory=lambda: array("q"))
    end_ns: array[int] = field(default_factory=lambda: array("q"))
    peak: array[int] = field(default_factory=lambda: array("q"))
    start: array[int] = field(default_factory=lambda: array("q"))
    end: array[int] = field(default_factory=lambda: array("q"))
    saved: array[int] = field(default_factory=lambda: array("q"))
    backwards: array[int] = field(default_factory=lambda: array("i"))
    optimizer: array[int] = field(default_factory=lambda: array("i"))
    holder_site: array[int] = field(default_factory=lambda: array("i"))  # HOLDERS per row
    holder_bytes: array[int] = field(default_factory=lambda: array("q"))
    kept: array[int] = field(default_factory=lambda: array("b"))
    failed: array[int] = field(default_factory=lambda: array("b"))

    def __len__(self) -> int:
        return len(self.start_ns)

    @property
    def done(self) -> int:
        """Rows complete (``failed`` is appended last: another thread reads rows while they are made)."""
        return len(self.failed)

    def columns(self, t0_ns: int, start: int, stop: int) -> dict[str, list[Any]]:
        """Rows ``start`` to ``stop`` as plain columns (the live view's; -1 stands for none)."""
        return {
            "index": list(range(start, stop)),
            "start_s": [(t - t0_ns) / 1e9 for t in self.start_ns[start:stop]],
            "duration_s": [max(b - a, 0) / 1e9 for a, b in zip(self.start_ns[start:stop], self.end_ns[start:stop],
                                                                 strict=True)],
            "peak": list(self.peak[start:stop]), "start": list(self.start[start:stop]),
            "end": list(self.end[start:stop]), "saved": list(self.saved[start:stop]),
        }

    def table(self, t0_ns: int, labels: Sequence[str]) -> Table[Iteration]:
        """The rows as the recording's table; ``labels`` names each interned site."""
        n = len(self)

        def opt(col: array[int]) -> Sequence[int | None]:
            return _Read(col, _none_if_negative)

        return Table(Iteration, {
            "index": range(n),
            "start_s": _Seconds(self.start_ns, None, t0_ns),
            "duration_s": _Seconds(self.end_ns, self.start_ns, 0),
            "peak_bytes": opt(self.peak), "start_bytes": opt(self.start), "end_bytes": opt(self.end),
            "saved_bytes": self.saved, "backward_passes": self.backwards, "optimizer_steps": self.optimizer,
            "holders": _Holders(self.holder_site, self.holder_bytes, labels),
            "kept": _Read(self.kept, bool), "failed": _Read(self.failed, bool),
        }, cache=False)  # a 100,000-iteration loop's rows as objects would take ~60 MB


class _Made(Sequence[Any]):
    """A column whose items are made when read: ``_one(i)`` makes item ``i``."""

    what = "column"

    def __len__(self) -> int:
        raise NotImplementedError

    def _one(self, i: int) -> Any:
        raise NotImplementedError

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._one(k) for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"{self.what} index out of range")
        return self._one(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._one(k) for k in range(len(self)))


class _Seconds(_Made):
    """Seconds from nanoseconds, made when read (``minus``: a column subtracted, a duration's start;
    else ``t0_ns``)."""

    what = "seconds"

    def __init__(self, col: array[int], minus: array[int] | None, t0_ns: int) -> None:
        self.col, self.minus, self.t0_ns = col, minus, t0_ns

    def __len__(self) -> int:
        return len(self.col)

    def _one(self, i: int) -> float:
        base = self.minus[i] if self.minus is not None else self.t0_ns
        return max(self.col[i] - base, 0) / 1e9 if self.minus is not None else (self.col[i] - base) / 1e9


class _Read(Sequence[Any]):
    """A column of numbers, each read through ``read`` when read (not copied): -1 as None, 0/1 as bools."""

    def __init__(self, col: array[int], read: Callable[[int], Any]) -> None:
        self.col, self.read = col, read

    def __len__(self) -> int:
        return len(self.col)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.read(v) for v in self.col[i]]
        return self.read(self.col[i])


def _none_if_negative(v: int) -> int | None:
    return None if v < 0 else v


class _Holders(_Made):
    """Each row's holders as ``((label, bytes), ...)``, made when read."""

    what = "holders"

    def __init__(self, sites: array[int], nbytes: array[int], labels: Sequence[str]) -> None:
        self.sites, self.nbytes, self.labels = sites, nbytes, labels

    def __len__(self) -> int:
        return len(self.sites) // HOLDERS

    def _one(self, i: int) -> tuple[tuple[str, int], ...]:
        out = []
        for k in range(i * HOLDERS, i * HOLDERS + HOLDERS):
            s = self.sites[k]
            if s >= 0:
                out.append((self.labels[s], self.nbytes[k]))
        return tuple(out)


@dataclass
class Carry:
    """What one piece of a loop's capture hands the next (see NOTE [ iterations ]): the allocations
    alive (by the memory source's key: its bytes and site), the live bytes by site and in all, the
    growth figures of each site and of the whole, the rows so far, and the bytes of every storage
    saved so far (each once)."""

    rows: Rows = field(default_factory=Rows)
    sites: Interner[Site] = field(default_factory=Interner)
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (bytes, site id)
    site_live: dict[int, int] = field(default_factory=dict)  # site id -> live bytes
    total: int = 0
    growth: dict[int, SiteGrowth] = field(default_factory=dict)
    total_growth: SiteGrowth = field(default_factory=SiteGrowth)
    growth_from: int = 0  # the iteration site growth is counted from (a new memory source restarts it)
    saved_total: int = 0
    memory: bool = True  # rows carry memory figures (a source that reads it)


def iterations_pass(trace: Trace, carry: Carry, events: Sequence[Any] | None, *, last: bool, failed: bool = False,
                    kept: bool = True, mark_from: int = 0, event_from: int = 0,
                    deltas: bool = False) -> tuple[int, int]:
    """Rows for the iterations of one piece of a loop's capture into ``carry``: one per mark from
    ``mark_from`` on, and, for the block's ``last`` piece, one for what ran after the last mark where
    anything did (a backward, an optimizer step, a save; or the whole block, if it has no mark).
    ``events``: the piece's memory events, read from ``event_from`` on (None: no memory figures;
    ``deltas``: samples of the live total, as CUDA's source without history makes, which name no
    allocation).
    As the loop runs, rows are made for the marks so far (``last=False``), and the piece's next call
    goes on from where this one stopped. ``failed``: the block ended with an exception in its last
    iteration. ``kept``: the piece's detail is kept. Returns (rows made, events read)."""
    marks = list(trace.marks)
    n_saves, n_back, n_opt = len(trace.saves), len(trace.backwards), len(trace.optimizer_steps)
    ends = [m[M_T] for m in marks]
    t_start = trace.piece_t0_ns or trace.t0_ns
    if last:
        before = marks[-1] if marks else (t_start, 0, 0, 0)
        tail = (not marks and not len(carry.rows)) or (before[M_SAVES] < n_saves or before[M_BACKWARDS] < n_back
                                                       or before[M_OPT] < n_opt)
        if tail:
            marks.append((trace.t1_ns, n_saves, n_back, n_opt))
            ends.append(trace.t1_ns)
        elif ends:
            ends[-1] = max(ends[-1], trace.t1_ns)  # what ran after the last mark (frees) ends it
    if len(marks) <= mark_from:
        return 0, event_from
    memory = events is not None and carry.memory
    evs: Sequence[Any] = events if events is not None else ()
    site_of = _Sites(trace, carry.sites) if memory else None
    identity = trace.save_storage if len(trace.save_storage) == n_saves else None
    base = trace.save_base
    rows = carry.rows
    e = event_from
    prev = marks[mark_from - 1] if mark_from else (t_start, 0, 0, 0)
    for k in range(mark_from, len(marks)):
        m = marks[k]
        index = len(rows)
        t_end = ends[k]
        # saves: bytes of the storages they kept alive, each once; and the block's total
        seen: dict[int, int] = {}
        for sid in range(prev[M_SAVES], m[M_SAVES]):
            serial = identity[sid] if identity is not None else sid + base
            seen[serial] = trace.saves[sid][S_BYTES]
            if serial == sid + base:  # the storage's first save in the block
                carry.saved_total += trace.saves[sid][S_BYTES]
        start_bytes = carry.total
        peak_bytes = carry.total
        top: dict[int, int] | None = None
        if memory:
            assert site_of is not None
            at_start = dict(carry.site_live)
            changes: list[tuple[int, int]] = []
            peak_at = -1
            while e < len(evs) and (evs[e].t_ns <= t_end or (last and k == len(marks) - 1)):
                _apply(carry, evs[e], site_of, deltas, changes)
                e += 1
                if carry.total > peak_bytes:
                    peak_bytes, peak_at = carry.total, len(changes)
            top = at_start
            for s, d in changes[:peak_at] if peak_at >= 0 else ():
                top[s] = top.get(s, 0) + d
            _feed_growth(carry, index)
        holders = sorted(((b, s) for s, b in top.items() if b > 0), reverse=True)[:HOLDERS] if top else []
        rows.start_ns.append(prev[M_T])
        rows.end_ns.append(t_end)
        rows.peak.append(peak_bytes if memory else -1)
        rows.start.append(start_bytes if memory else -1)
        rows.end.append(carry.total if memory else -1)
        rows.saved.append(sum(seen.values()))
        rows.backwards.append(sum(1 for b in trace.backwards[prev[M_BACKWARDS]:m[M_BACKWARDS]] if b.observed))
        rows.optimizer.append(m[M_OPT] - prev[M_OPT])
        for j in range(HOLDERS):
            rows.holder_site.append(holders[j][1] if j < len(holders) else -1)
            rows.holder_bytes.append(holders[j][0] if j < len(holders) else 0)
        rows.kept.append(1 if kept else 0)
        rows.failed.append(1 if failed and last and k == len(marks) - 1 else 0)
        prev = (t_end, m[M_SAVES], m[M_BACKWARDS], m[M_OPT])
    return len(marks) - mark_from, e


def _apply(carry: Carry, ev: Any, site_of: _Sites | None, deltas: bool, changes: list[tuple[int, int]]) -> None:
    """One memory event into ``carry`` (its live bytes by key and site); each change of a site's
    bytes is appended to ``changes``."""
    if deltas:
        carry.total += ev.size
    elif ev.size > 0:
        assert site_of is not None
        s = site_of(ev)
        old = carry.live.get(ev.key)
        if old is not None:  # a key allocated again without its free seen: the old one is gone
            carry.total -= old[0]
            carry.site_live[old[1]] = carry.site_live.get(old[1], 0) - old[0]
            changes.append((old[1], -old[0]))
        carry.live[ev.key] = (ev.size, s)
        carry.total += ev.size
        carry.site_live[s] = carry.site_live.get(s, 0) + ev.size
        changes.append((s, ev.size))
    else:
        got = carry.live.pop(ev.key, None)
        if got is None:
            return  # memory from before the block (or before the source started)
        carry.total -= got[0]
        carry.site_live[got[1]] = carry.site_live.get(got[1], 0) - got[0]
        changes.append((got[1], -got[0]))


def absorb(trace: Trace, carry: Carry, events: Sequence[Any] | None, event_from: int, *, deltas: bool = False) -> None:
    """NOTE [ what a piece leaves after its last iteration ]: a piece is cut at an iteration's end,
    but its memory events go on until the cut itself (the frees that end the iteration, the CUDA
    source's sample at the cut). They belong to the next iteration and are not in the next piece's
    events: they are applied to ``carry`` here, with their own piece's trace for their sites, so that
    the next iteration starts from them. Dropped, each piece lost a free (CUDA's sample of the loss
    freed, the tracker's frees after the mark) and a steady loop on a GPU read as growing by 1 KiB
    an iteration."""
    if events is None or event_from >= len(events) or not carry.memory:
        return
    site_of = None if deltas else _Sites(trace, carry.sites)
    changes: list[tuple[int, int]] = []
    for e in range(event_from, len(events)):
        _apply(carry, events[e], site_of, deltas, changes)


def _feed_growth(carry: Carry, index: int) -> None:
    """The live bytes by site and in all at one iteration's end, into the growth figures."""
    carry.total_growth.add(index, carry.total)
    rel = index - carry.growth_from
    for s, b in carry.site_live.items():
        g = carry.growth.get(s)
        if g is None:
            g = carry.growth[s] = SiteGrowth()
            if rel > 0:
                g.add(rel - 1, 0)  # absent until now
        g.add(rel, b)
    if len(carry.growth) > len(carry.site_live):
        for s, g in carry.growth.items():
            if s not in carry.site_live:
                g.add(rel, 0)


def growth_rows(carry: Carry, labels: Sequence[str]) -> tuple[Growth, ...]:
    """What grows, largest first (see NOTE [ growth across iterations ] in gradscope._model.growth):
    each site that does, and the block's memory as a whole (site ``""``)."""
    out = []
    got = carry.total_growth.growth()
    if got is not None:
        out.append(Growth("", got[0], got[1], got[2], carry.total))
    for s, g in carry.growth.items():
        got = g.growth()
        if got is not None:
            first, last = got[1] + carry.growth_from, got[2] + carry.growth_from
            out.append(Growth(labels[s], got[0], first, last, carry.site_live.get(s, 0)))
    return tuple(sorted(out, key=lambda g: (g.site != "", -g.bytes_per_iteration, g.site)))


def restart_site_growth(carry: Carry) -> None:
    """A new memory source names sites otherwise (see NOTE [ a long loop's memory ] in gradscope.memory):
    site growth is counted again from the next iteration on."""
    carry.growth.clear()
    carry.growth_from = len(carry.rows)


class _Sites:
    """The site of each allocation event of one trace (see :data:`Site`): in forward, the user's line
    where the source knows it (the tracker's line; the allocator counter's node, by the sequence
    counter), else the module call running; in backward and optimizer steps, their phase."""

    def __init__(self, trace: Trace, sites: Interner[Site]) -> None:
        self.trace = trace
        self.sites = sites
        self.bw = sorted((b.t0_ns, b.t1_ns) for b in trace.backwards)
        self.bw_t0 = [w[0] for w in self.bw]
        self.opt = sorted((o[1], o[2] or trace.t1_ns) for o in trace.optimizer_steps)
        self.opt_t0 = [w[0] for w in self.opt]
        self.calls = trace.calls
        self.call_t0 = [c[C_T0] for c in self.calls]
        self._seq_line: dict[int, int] | None = None

    def _inside(self, starts: list[int], windows: list[tuple[int, int]], t: int) -> bool:
        j = bisect.bisect_right(starts, t) - 1
        return j >= 0 and windows[j][0] <= t <= windows[j][1]

    def seq_line(self) -> dict[int, int]:
        if self._seq_line is None:
            tr = self.trace
            out: dict[int, int] = {}
            if tr.save_lines:
                for row, line in zip(tr.saves, tr.save_lines, strict=False):
                    if line >= 0:
                        out.setdefault(row[S_SEQ], line)
            self._seq_line = out
        return self._seq_line

    def __call__(self, ev: Any) -> int:
        t = ev.t_ns
        if ev.scope is not None or ev.backward is not None or self._inside(self.bw_t0, self.bw, t):
            return self.sites(("phase", "backward"))
        if ev.hint == "optimizer" or self._inside(self.opt_t0, self.opt, t):
            return self.sites(("phase", "optimizer"))
        if ev.line is not None and ev.line >= 0:
            return self.sites(("line", ev.line))
        seq = getattr(ev, "seq", None)
        if seq is not None:
            line = self.seq_line().get(seq - 1)
            if line is not None:
                return self.sites(("line", line))
        call = ev.call
        if call is None and self.calls:
            call = self._call_at(t)
        if call is not None and 0 <= call < len(self.calls):
            c = self.calls[call]
            return self.sites(("module", c[C_ROOT], c[C_REL]))
        if ev.hint == "other":
            return self.sites(("phase", "other"))
        return self.sites(("phase", "forward"))

    def _call_at(self, t: int) -> int | None:
        """The innermost module call running at ``t``: calls are appended as they start and nest,
        so it is the latest one begun by then that had not ended (looked for among a few)."""
        j = bisect.bisect_right(self.call_t0, t) - 1
        for k in range(j, max(j - 64, -1), -1):
            if t <= self.calls[k][C_T1]:
                return k
        return None


def site_label(site: Site, line_label: Callable[[int], str | None], module_name: Callable[[int, str], str]) -> str:
    """A site as the views say it: the user's line (``train.py:57 in train``), the module, or the phase."""
    kind = site[0]
    if kind == "line":
        return line_label(site[1]) or "(unknown line)"
    if kind == "module":
        return module_name(site[1], site[2])
    if kind == "phase":
        return {"backward": "backward (gradients, temporaries)", "optimizer": "optimizer step",
                "forward": "forward, outside any module", "other": "other"}.get(site[1], str(site[1]))
    return str(site[-1])


def labels_for(carry: Carry, line_label: Callable[[int], str | None], module_name: Callable[[int, str], str],
               ) -> list[str]:
    return [site_label(s, line_label, module_name) for s in carry.sites.table]

