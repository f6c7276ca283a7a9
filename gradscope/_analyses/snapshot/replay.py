"""Check a snapshot's shape and replay one device's trace into compact tables.

The input is what :func:`gradscope._analyses.snapshot.unpickle.load_plain` returns (or the dict
``torch.cuda.memory._snapshot()`` returns): dicts, lists, strings and numbers that may come
from anyone, so every field is checked where it is read and a wrong one is a GradscopeError that
names where it is (``device_traces[0][1234]``). The tables are ``array('q')`` columns: about
60 bytes per allocation instead of the ~500 bytes of its dicts.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, TypeVar

import torch

from gradscope._base.errors import GradscopeError

__all__ = [
    "ACTIONS",
    "Annotation",
    "on_one_thread",
    "one_thread",
    "LIVE_STATES",
    "DeviceScan",
    "EndBlock",
    "EndSegment",
    "Ranges",
    "StackTable",
    "check_snapshot",
    "end_segments",
    "place_annotations",
    "read_annotations",
    "reconcile",
    "scan_device",
]

# trace actions, as the allocator writes them (torch/csrc/cuda/Module.cpp), and their codes here
ACTIONS = {
    "alloc": 0,
    "free_requested": 1,
    "free_completed": 2,
    "segment_alloc": 3,
    "segment_free": 4,
    "segment_map": 5,
    "segment_unmap": 6,
    "oom": 7,
    "snapshot": 8,
}
SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP = 0, 1, 2, 3  # segment event kinds (action code - 3)
# block states of memory in use: the docstring says "active_awaiting_free", the allocator writes
# "active_pending_free" (freed on one stream, still in use on another): both are still allocated.
LIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})

_F = TypeVar("_F", bound=Callable[..., Any])


# NOTE [ one thread for the tables ]
# The replay's array operations (a sort of a million positions, scatters, cumulative sums) take
# milliseconds on one core. With torch's default intra-op threads on a busy machine, every
# parallel operation waits for a descheduled worker: measured here on 2 shared cores, the same
# steps took 5-10x longer with 2 threads than with 1 (argsort of 660k positions: 0.34 s vs
# 0.06 s). So the snapshot code runs its tensor work on one thread and restores the setting.
@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU operations on one thread inside the block (see NOTE above)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def on_one_thread(fn: _F) -> _F:
    """Decorator: ``fn`` runs inside :func:`one_thread`."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_thread():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_FORMAT_HINT = (
    "The file is damaged, or was not written by torch.cuda.memory._dump_snapshot (or returned by "
    "torch.cuda.memory._snapshot())."
)


def _bad(where: str, problem: str) -> GradscopeError:
    return GradscopeError(f"gradscope: this snapshot's {where} {problem}. {_FORMAT_HINT}")


def _tname(v: Any) -> str:
    """``an int``, ``a str``, ``None``: the type of ``v`` for a message."""
    if v is None:
        return "None"
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _need_int(v: Any, where: str, name: str, minimum: int | None = 0) -> int:
    if type(v) is not int:
        raise _bad(where, f"has a {name!r} that is {_tname(v)} ({_shown(v)}), not an integer")
    if minimum is not None and v < minimum:
        raise _bad(where, f"has a negative {name!r} ({v})")
    if v >= 1 << 63:
        raise _bad(where, f"has a {name!r} too large for a byte count or address ({v})")
    return v


def check_snapshot(obj: Any, what: str) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The snapshot's segments, device traces and allocator settings, checked at the top level."""
    if isinstance(obj, list):
        hint = (
            " (a list of segments is what torch.cuda.memory_snapshot() returns: it has no trace; use "
            "torch.cuda.memory._snapshot() or _dump_snapshot(), after _record_memory_history())"
            if obj and isinstance(obj[0], dict) and "blocks" in obj[0]
            else ""
        )
        raise GradscopeError(
            f"gradscope: {what} holds a list, not a CUDA memory snapshot{hint}. A snapshot is a dict "
            "with 'segments' and 'device_traces', written by torch.cuda.memory._dump_snapshot(path)."
        )
    if not isinstance(obj, Mapping):
        raise GradscopeError(
            f"gradscope: {what} holds {_tname(obj)}, not a CUDA memory snapshot (a dict with "
            "'segments' and 'device_traces', written by torch.cuda.memory._dump_snapshot(path))."
        )
    missing = [k for k in ("segments", "device_traces") if k not in obj]
    if missing:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        raise GradscopeError(
            f"gradscope: {what} is not a CUDA memory snapshot: it is a dict without "
            f"{' or '.join(repr(k) for k in missing)} (its keys: {keys}). Snapshots come from "
            "torch.cuda.memory._dump_snapshot(path) after torch.cuda.memory._record_memory_history()."
        )
    segments, traces = obj["segments"], obj["device_traces"]
    if type(segments) is not list:
        raise _bad("'segments'", f"is {_tname(segments)}, not a list")
    if type(traces) is not list:
        raise _bad("'device_traces'", f"is {_tname(traces)}, not a list")
    for d, t in enumerate(traces):
        if type(t) is not list:
            raise _bad(f"device_traces[{d}]", f"is {_tname(t)}, not a list of trace entries")
    settings = obj.get("allocator_settings")
    return segments, traces, _plain_settings(settings) if isinstance(settings, Mapping) else {}


def _plain_settings(s: Mapping[Any, Any], depth: int = 0) -> dict[str, Any]:
    """Allocator settings as JSON-able data (strings, numbers, booleans, nested dicts)."""
    out: dict[str, Any] = {}
    for k, v in list(s.items())[:64]:
        if type(v) in (int, float, bool, str) or v is None:
            out[str(k)] = v[:500] if isinstance(v, str) else v
        elif isinstance(v, Mapping) and depth < 2:
            out[str(k)] = _plain_settings(v, depth + 1)
    return out


class StackTable:
    """Frames and stacks, each stored once (NOTE [ stacks are interned ])."""

    # NOTE [ stacks are interned ]: the allocator symbolizes each distinct frame once and shares
    # its dict between tracebacks, but every allocation has its own list of those dicts. A stack
    # is looked up by the identities of its frame dicts (one tuple(map(id, frames)) per entry, in
    # C), and only a stack not seen before is read frame by frame, checked, and stored by value:
    # stacks[i] is a tuple of indices into frames, innermost frame first; stacks[0] is the empty
    # stack (no frames recorded). The frame lists are kept alive while the table is in use, so
    # no identity in a key can be reused by another object.

    def __init__(self) -> None:
        self.frames: list[tuple[str, int, str]] = []
        self.stacks: list[tuple[int, ...]] = [()]
        self._frame_index: dict[tuple[str, int, str], int] = {}
        self._stack_index: dict[tuple[int, ...], int] = {(): 0}
        self._by_ids: dict[tuple[int, ...], int] = {}
        self._alive: list[Any] = []

    def intern(self, frames: Any, where: str) -> int:
        if frames is None:
            return 0
        if type(frames) is not list:
            raise _bad(where, f"has 'frames' that is {_tname(frames)}, not a list")
        if not frames:
            return 0
        key = tuple(map(id, frames))
        sid = self._by_ids.get(key)
        if sid is not None:
            return sid
        idx = []
        for i, f in enumerate(frames):
            if type(f) is not dict:
                raise _bad(where, f"has frames[{i}] that is {_tname(f)}, not a dict")
            fn, line, name = f.get("filename"), f.get("line"), f.get("name")
            if type(fn) is not str or type(name) is not str:
                raise _bad(where, f"has frames[{i}] without a string 'filename' and 'name'")
            if type(line) is not int:
                raise _bad(where, f"has frames[{i}] whose 'line' is {_tname(line)}, not an integer")
            fk = (fn, line, name)
            fi = self._frame_index.get(fk)
            if fi is None:
                fi = self._frame_index[fk] = len(self.frames)
                self.frames.append(fk)
            idx.append(fi)
        stack = tuple(idx)
        sid = self._stack_index.get(stack)
        if sid is None:
            sid = self._stack_index[stack] = len(self.stacks)
            self.stacks.append(stack)
        self._by_ids[key] = sid
        self._alive.append(frames)
        return sid

    def intern_many(self, trace: list[Any], positions: list[int], device: int) -> list[int]:
        """The stack of each entry ``trace[p]`` (0 for positions < 0), looked up in bulk, in
        chunks (a key per entry costs ~0.5 KB while it lives)."""
        by_ids = self._by_ids
        out: list[int] = []
        for lo in range(0, len(positions), 1 << 13):
            chunk = positions[lo:lo + (1 << 13)]
            frames = [trace[p].get("frames") if p >= 0 else None for p in chunk]
            keys = [tuple(map(id, f)) if type(f) is list else None for f in frames]
            sids = [by_ids.get(k, -1) if k is not None else 0 for k in keys]
            for i, sid in enumerate(sids):
                if sid < 0:  # a stack first seen in this chunk: looked up again, stored if new
                    hit = by_ids.get(keys[i])  # type: ignore[arg-type]
                    sids[i] = hit if hit is not None else self.intern(
                        frames[i], f"device_traces[{device}][{chunk[i]}]")
                elif sid == 0 and frames[i] is not None and type(frames[i]) is not list:
                    self.intern(frames[i], f"device_traces[{device}][{chunk[i]}]")  # raises
            out.extend(sids)
        return out

    def release(self) -> None:
        """Forget the identity keys (and the raw frame lists they keep alive)."""
        self._by_ids.clear()
        self._alive.clear()


@dataclass
class DeviceScan:
    """One device's trace, replayed forward. Allocation columns share one index; positions are
    indices into the device's trace list."""

    device: int
    events: int = 0
    addr: array = field(default_factory=lambda: array("q"))
    size: array = field(default_factory=lambda: array("q"))
    stream: array = field(default_factory=lambda: array("q"))
    alloc_at: array = field(default_factory=lambda: array("q"))  # -1: made before the trace began
    free_requested_at: array = field(default_factory=lambda: array("q"))  # -1: none
    free_at: array = field(default_factory=lambda: array("q"))  # -1: alive at the end
    stack: array = field(default_factory=lambda: array("q"))
    block_size: array = field(default_factory=lambda: array("q"))  # from the end state; -1 unknown
    seg_at: array = field(default_factory=lambda: array("q"))
    seg_kind: array = field(default_factory=lambda: array("q"))
    seg_addr: array = field(default_factory=lambda: array("q"))
    seg_size: array = field(default_factory=lambda: array("q"))
    seg_stream: array = field(default_factory=lambda: array("q"))
    ooms: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # at, size, free, stream, stack
    snapshots: list[int] = field(default_factory=list)
    times: array | None = field(default_factory=lambda: array("q"))
    open: dict[int, int] = field(default_factory=dict)  # address -> allocation alive at the end
    unknown_actions: dict[str, int] = field(default_factory=dict)
    double_allocs: int = 0  # an alloc at an address the trace had not freed
    freed_before_alloc: int = 0  # allocations made before the trace, seen through their free


def _new_alloc(s: DeviceScan, addr: int, size: int, stream: int, at: int, stack: int) -> int:
    i = len(s.addr)
    s.addr.append(addr)
    s.size.append(size)
    s.stream.append(stream)
    s.alloc_at.append(at)
    s.free_requested_at.append(-1)
    s.free_at.append(-1)
    s.stack.append(stack)
    s.block_size.append(-1)
    return i


def _column(values: list[Any], allowed: tuple[type, ...] = (int,)) -> array | None:
    """``values`` as an int64 array when every one is an int; None otherwise."""
    if not set(map(type, values)) <= set(allowed):
        return None
    try:
        return array("q", values)
    except OverflowError:
        return None


def _t(a: array) -> torch.Tensor:
    return torch.frombuffer(a, dtype=torch.int64) if len(a) else torch.zeros(0, dtype=torch.int64)


def _to_array(t: torch.Tensor) -> array:
    """An int64 tensor as an ``array('q')``, copied without making a Python int per element."""
    out = array("q", bytes(8 * int(t.numel())))
    if len(out):
        torch.frombuffer(out, dtype=torch.int64).copy_(t)
    return out


def scan_device(trace: list[Any], device: int, stacks: StackTable, consume: bool = False) -> DeviceScan:
    """Replay ``trace`` forward: an allocation lives from its ``alloc`` to its ``free_completed``.
    With ``consume``, ``trace`` is emptied once read (a list nobody else holds: memory back early).

    An address whose first event is a free held an allocation made before the trace began (the
    allocator keeps the last ``max_entries`` events only); such allocations get ``alloc_at == -1``.
    See NOTE [ pairing events by address ] for how this runs at C speed.
    """
    # NOTE [ pairing events by address ]
    # The replay as array operations: read each field once with a list comprehension (C speed),
    # check its types in bulk (set(map(type, column))), then sort the alloc / free events by
    # address, keeping trace order within an address. Along one address the events form
    # episodes, each one allocation: an episode starts at an alloc, or at a free that follows a
    # free_completed or opens the address (an allocation made before the trace); it ends at its
    # free_completed, or at the next alloc of the address (which frees it implicitly: a trace
    # the allocator would not write, counted in double_allocs). Episode numbers are a cumulative
    # sum over the sorted events; scatters then give each allocation its positions. A damaged
    # entry makes a bulk step fail; _explain then walks the trace entry by entry to name it.
    # Measured against a per-entry loop keeping a dict of open addresses (collector off in both):
    # read_snapshot of a million events took 6.5 s against 8.2 s (medians of 6 interleaved runs on
    # 2 shared, loaded cores), and with every field read first a loaded file's entries can go
    # before the pairing's arrays are made.
    s = DeviceScan(device=device, events=len(trace))
    n = len(trace)
    if n == 0:
        s.times = array("q")
        return s
    actions = ACTIONS
    try:  # one field at a time, so that one list of a million references lives at once
        codes = _column([actions.get(e["action"], -1) for e in trace])
        addrs = _column([e.get("addr", -1) for e in trace])
        sizes = _column([e.get("size", -1) for e in trace])
        streams = _column([e.get("stream", 0) for e in trace])
    except (KeyError, TypeError, AttributeError):
        raise _explain(trace, device) from None
    if codes is None or addrs is None or sizes is None or streams is None:
        raise _explain(trace, device)
    c, a, z, st = _t(codes), _t(addrs), _t(sizes), _t(streams)
    pos = torch.arange(n, dtype=torch.int64)
    unknown = torch.nonzero(c < 0).flatten().tolist()
    for p in unknown:
        action = trace[p]["action"]
        if type(action) is not str:
            raise _bad(f"device_traces[{device}][{p}]", f"has an 'action' that is {_tname(action)}")
        s.unknown_actions[action] = s.unknown_actions.get(action, 0) + 1
    with_addr = (c >= 0) & (c <= 6)
    if bool((with_addr & ((a < 0) | (z < 0))).any().item()):
        raise _explain(trace, device)
    s.times = _column([e.get("time_us") for e in trace])
    # the rest of what the entries hold, read now: a trace this module owns (a file it loaded)
    # is dropped before the pairing's arrays exist, so the two never take memory at once
    alloc_pos = torch.nonzero(c == 0).flatten()
    stack_at = torch.zeros(n, dtype=torch.int64)
    if alloc_pos.numel():
        stack_at[alloc_pos] = torch.tensor(stacks.intern_many(trace, alloc_pos.tolist(), device),
                                           dtype=torch.int64)
    for p in torch.nonzero(c == 7).flatten().tolist():
        e = trace[p]
        where = f"device_traces[{device}][{p}] (an 'oom' entry)"
        _need_int(e.get("size"), where, "size")
        free = e.get("device_free", -1)
        free = -1 if free is None else _need_int(free, where, "device_free")
        s.ooms.append((p, int(z[p].item()), free, int(st[p].item()), stacks.intern(e.get("frames"), where)))
    s.snapshots = torch.nonzero(c == 8).flatten().tolist()
    if consume:
        trace.clear()
    segs = torch.nonzero((c >= 3) & (c <= 6)).flatten()
    s.seg_at, s.seg_kind = _to_array(segs), _to_array(c[segs] - 3)
    s.seg_addr, s.seg_size, s.seg_stream = _to_array(a[segs]), _to_array(z[segs]), _to_array(st[segs])
    # alloc / free events, sorted by address (stable: trace order within an address)
    sel = torch.nonzero((c >= 0) & (c <= 2)).flatten()
    order = torch.argsort(a[sel], stable=True)
    ev = sel[order]
    ca, aa, pa = c[ev], a[ev], pos[ev]
    m = int(ev.numel())
    if m:
        first = torch.ones(m, dtype=torch.bool)
        first[1:] = aa[1:] != aa[:-1]
        prev_code = torch.full((m,), -1, dtype=torch.int64)
        prev_code[1:] = ca[:-1]
        prev_closes = first | (prev_code == 2)
        start = (ca == 0) | prev_closes
        episode = torch.cumsum(start.to(torch.int64), 0) - 1
        starts = torch.nonzero(start).flatten()
        n_ep = int(starts.numel())
        alloc_at = torch.where(ca[starts] == 0, pa[starts], -1)
        free_at = torch.full((n_ep,), -1, dtype=torch.int64)
        done = ca == 2
        free_at[episode[done]] = pa[done]
        implicit = (ca == 0) & ~prev_closes  # an alloc on an address still open ends that episode
        free_at[episode[implicit] - 1] = pa[implicit]
        s.double_allocs = int(implicit.sum().item())
        req = ca == 1
        free_req = torch.full((n_ep,), -1, dtype=torch.int64).scatter_reduce_(
            0, episode[req], pa[req], "amax")
        # allocations in order of their first event, as a forward replay would number them
        by_time = torch.argsort(pa[starts], stable=True)
        src = ev[starts][by_time]
        del first, prev_code, prev_closes, start, episode, done, implicit, req, ca, aa, pa, order, ev, sel
        alloc_at, free_at, free_req = alloc_at[by_time], free_at[by_time], free_req[by_time]
        s.freed_before_alloc = int((alloc_at < 0).sum().item())
        s.addr, s.size, s.stream = _to_array(a[src]), _to_array(z[src]), _to_array(st[src])
        s.alloc_at, s.free_requested_at, s.free_at = _to_array(alloc_at), _to_array(free_req), _to_array(free_at)
        s.stack = _to_array(torch.where(alloc_at >= 0, stack_at[alloc_at.clamp(min=0)], 0))
        s.block_size = array("q", [-1]) * n_ep
        open_ = torch.nonzero(free_at < 0).flatten()
        s.open = dict(zip(a[src[open_]].tolist(), open_.tolist(), strict=True))
    return s


def _explain(trace: list[Any], device: int) -> GradscopeError:
    """The error for the first damaged entry of ``trace`` (see NOTE [ pairing events by address ])."""
    for pos, e in enumerate(trace):
        here = f"device_traces[{device}][{pos}]"
        if type(e) is not dict:
            return _bad(here, f"is {_tname(e)}, not a dict")
        action = e.get("action")
        if type(action) is not str:
            return _bad(here, "has no 'action'" if action is None else f"has an 'action' that is {_tname(action)}")
        code = ACTIONS.get(action)
        where = f"{here} (a {action!r} entry)"
        try:
            if code is not None and code <= 6:
                _need_int(e.get("addr"), where, "addr")
            if code is not None and code <= 7:
                _need_int(e.get("size"), where, "size")
            _need_int(e.get("stream", 0), where, "stream", None)
        except GradscopeError as err:
            return err
    return _bad(f"device_traces[{device}]", "could not be read")


@dataclass(frozen=True)
class EndBlock:
    """A block of a segment when the snapshot was taken (``stack`` indexes the stack table)."""

    address: int
    size: int
    requested: int
    state: str
    stack: int


@dataclass(frozen=True)
class EndSegment:
    """A segment (one cudaMalloc, or an expandable segment's mapped range) when the snapshot was
    taken; ``large``: the large-allocation pool."""

    device: int | None
    address: int
    total_size: int
    stream: int
    large: bool
    expandable: bool
    blocks: tuple[EndBlock, ...]


def end_segments(segments: list[Any], stacks: StackTable) -> list[EndSegment]:
    """The allocator's segments when the snapshot was taken, checked."""
    out = []
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if type(seg) is not dict:
            raise _bad(where, f"is {_tname(seg)}, not a dict")
        address = _need_int(seg.get("address"), where, "address")
        total = _need_int(seg.get("total_size"), where, "total_size")
        stream = _need_int(seg.get("stream", 0), where, "stream", None)
        dev = seg.get("device")
        if dev is not None:
            dev = _need_int(dev, where, "device")
        blocks_raw = seg.get("blocks", [])
        if type(blocks_raw) is not list:
            raise _bad(where, f"has 'blocks' that is {_tname(blocks_raw)}, not a list")
        blocks = []
        at = address
        for j, b in enumerate(blocks_raw):
            bw = f"{where}['blocks'][{j}]"
            if type(b) is not dict:
                raise _bad(bw, f"is {_tname(b)}, not a dict")
            size = _need_int(b.get("size"), bw, "size")
            req = b.get("requested_size", size)
            req = _need_int(size if req is None else req, bw, "requested_size")
            state = b.get("state")
            if type(state) is not str:
                raise _bad(bw, f"has a 'state' that is {_tname(state)}, not a string")
            baddr = b.get("address", at)
            baddr = _need_int(baddr, bw, "address")
            frames = b.get("frames")
            if frames is None:
                frames = _legacy_frames(b, bw)
            blocks.append(EndBlock(baddr, size, req, state, stacks.intern(frames, bw)))
            at = baddr + size
        kind = seg.get("segment_type")
        large = kind != "small" if isinstance(kind, str) else total != 2 << 20
        out.append(EndSegment(dev, address, total, stream, large, bool(seg.get("is_expandable", False)),
                              tuple(blocks)))
    return out


def _legacy_frames(block: dict[str, Any], where: str) -> Any:
    """The frames of a block in the format of PyTorch 1.13 to 2.0: ``history``, a list of
    ``{addr, real_size, frames}`` whose first entry is the block's allocation (what
    ``torch.cuda._memory_viz`` reads); None when the block has none."""
    history = block.get("history")
    if history is None:
        return None
    if type(history) is not list:
        raise _bad(where, f"has a 'history' that is {_tname(history)}, not a list")
    if not history:
        return None
    first = history[0]
    if type(first) is not dict:
        raise _bad(where, f"has history[0] that is {_tname(first)}, not a dict")
    return first.get("frames")


@dataclass(frozen=True)
class Annotation:
    """An ``external_annotations`` entry: a ``record_function`` range that began (``START``) or
    ended (``END``) while the history was recorded (``Optimizer.step#AdamW.step``, a user's
    ``torch.profiler.record_function("step")``), placed in the trace: ``at`` is the position of
    the last event at or before its time (-1: before the first)."""

    name: str
    stage: str
    at: int
    time_us: int


def read_annotations(obj: Mapping[str, Any]) -> tuple[list[tuple[int | None, str, str, int]], int]:
    """The snapshot's ``external_annotations`` as (device, name, stage, time_us), and how many
    entries were skipped because a field was missing or of the wrong type (annotations only
    help to find steps: a damaged one is left out, never fatal)."""
    raw = obj.get("external_annotations")
    if type(raw) is not list:
        return [], 0 if raw is None else 1
    out: list[tuple[int | None, str, str, int]] = []
    skipped = 0
    for e in raw:
        if type(e) is not dict:
            skipped += 1
            continue
        name, stage, t, dev = e.get("name"), e.get("stage"), e.get("time_us"), e.get("device")
        if type(name) is not str or stage not in ("START", "END") or type(t) is not int \
                or not (dev is None or type(dev) is int):
            skipped += 1
            continue
        out.append((dev, name[:500], stage, t))
    return out, skipped


def place_annotations(entries: list[tuple[int | None, str, str, int]], device: int,
                      times: array | None) -> tuple[Annotation, ...]:
    """The annotations of ``device`` placed at trace positions by their times (none without
    times: an annotation has a time, not a position)."""
    mine = [(n, st, t) for d, n, st, t in entries if d is None or d == device]
    if not mine or times is None or not len(times):
        return ()
    reach = torch.cummax(_t(times), 0).values  # times of a trace only grow, but never rely on it
    when = torch.tensor([t for _, _, t in mine], dtype=torch.int64)
    at = (torch.searchsorted(reach, when, right=True) - 1).tolist()
    return tuple(Annotation(n, st, p, t) for (n, st, t), p in zip(mine, at, strict=True))


class Ranges:
    """Disjoint address ranges [start, end) with a stream each: reserved memory over time.

    Whole segments (cudaMalloc) stay separate even when they touch: no block spans two of them.
    Ranges mapped into an expandable segment merge with mapped neighbours of the same stream.
    """

    def __init__(self) -> None:
        self.items: list[list[int]] = []  # [start, end, stream, mapped]

    def copy(self) -> Ranges:
        r = Ranges()
        r.items = [list(x) for x in self.items]
        return r

    def add(self, start: int, size: int, stream: int, mapped: bool) -> None:
        if size <= 0:
            return
        end = start + size
        i = self._cut(start, end)
        items = self.items
        item = [start, end, stream, int(mapped)]
        if mapped:  # merge with mapped neighbours of the same stream that touch it
            if i < len(items) and items[i][3] and items[i][2] == stream and items[i][0] == end:
                item[1] = items.pop(i)[1]
            if i > 0 and items[i - 1][3] and items[i - 1][2] == stream and items[i - 1][1] == start:
                i -= 1
                item[0] = items.pop(i)[0]
        items.insert(i, item)

    def remove(self, start: int, size: int) -> None:
        self._cut(start, start + size)

    def _cut(self, start: int, end: int) -> int:
        """Take [start, end) out of the ranges; the index where a range starting there goes.
        The ranges are disjoint and sorted, so only those overlapping it are touched."""
        items = self.items
        i = bisect.bisect_right(items, start, key=lambda x: x[1])  # first range ending after start
        j = bisect.bisect_left(items, end, key=lambda x: x[0])  # first range starting at or after end
        if i >= j:
            return i
        pieces: list[list[int]] = []
        s, _, st, m = items[i]
        if s < start:
            pieces.append([s, start, st, m])
        s, e, st, m = items[j - 1]
        if e > end:
            pieces.append([end, e, st, m])
        items[i:j] = pieces
        return i + (1 if pieces and pieces[0][0] < start else 0)

    def apply(self, kind: int, addr: int, size: int, stream: int, undo: bool = False) -> None:
        adds = kind in (SEG_ALLOC, SEG_MAP)
        if adds != undo:
            self.add(addr, size, stream, kind in (SEG_MAP, SEG_UNMAP))
        else:
            self.remove(addr, size)

    @property
    def total(self) -> int:
        return sum(e - s for s, e, _, _ in self.items)


@dataclass
class Reconciled:
    initial_reserved: int
    initial_ranges: list[tuple[int, int, int, bool]]  # start, size, stream, mapped
    notes: list[str]


def reconcile(s: DeviceScan, segs: list[EndSegment], stacks: StackTable, have_state: bool) -> Reconciled:
    """Join the forward replay with the end state: see NOTE [ a trace that starts mid-run ]."""
    # NOTE [ a trace that starts mid-run ]
    # The allocator keeps only the last ``max_entries`` trace events, and history may be switched
    # on long after the model was built, so the trace usually starts with memory already in use.
    # What was alive at its first event is not in the trace, but it is implied by it and by the
    # segments, which are the allocator's state at the moment of the snapshot, i.e. right after
    # the last event:
    #   - an address whose first event in the trace is a free (free_requested or
    #     free_completed) held an allocation made before the trace; the free tells its size
    #     (scan_device creates it with alloc_at = -1);
    #   - a block that is allocated at the end but that no event of the trace touched was alive
    #     during the whole trace (alloc_at = -1, free_at = -1; size, stream and, if recorded,
    #     frames from the block);
    #   - a block allocated at the end whose address the trace did touch must be the trace's last
    #     allocation there, still open: the two agree, and the block gives its exact size.
    # The allocations alive before the trace are exactly the union of the first two kinds. The
    # same reasoning backwards gives the reserved memory: the segments at the end, with the
    # trace's segment events undone from last to first, are the segments at the start. Where the
    # trace and the end state disagree (a snapshot pieced together by hand, a private memory
    # pool), the replay keeps the trace and the recording says how many blocks disagree.
    notes: list[str] = []
    dev_segs = [g for g in segs if g.device is None or g.device == s.device]
    if have_state:
        touched = set(s.addr)
        conflicts = mismatched = 0
        for g in dev_segs:
            for b in g.blocks:
                if b.state not in LIVE_STATES:
                    continue
                i = s.open.pop(b.address, None)
                if i is not None:
                    s.block_size[i] = b.size
                    if s.size[i] != b.requested:
                        mismatched += 1
                    if s.stack[i] == 0 and b.stack:
                        s.stack[i] = b.stack
                elif b.address not in touched:
                    i = _new_alloc(s, b.address, b.requested, g.stream, -1, b.stack)
                    s.block_size[i] = b.size
                else:
                    conflicts += 1
        left = len(s.open)
        if conflicts or left or mismatched:
            parts = []
            if left:
                parts.append(f"{left} allocations open at the end of the trace are not in its segments")
            if conflicts:
                parts.append(f"{conflicts} blocks allocated in the segments were freed by the trace")
            if mismatched:
                parts.append(f"{mismatched} blocks have another size in the segments than in the trace")
            notes.append(
                "the trace and the snapshot's segments disagree (" + "; ".join(parts) + "); the replay "
                "follows the trace. A snapshot assembled from parts, or memory of a private pool, does this."
            )
    # reserved memory: undo the trace's segment events on the end state
    ranges = Ranges()
    for g in dev_segs:
        ranges.add(g.address, g.total_size, g.stream, g.expandable)
    final_reserved = sum(g.total_size for g in dev_segs)
    net = 0
    for k in range(len(s.seg_at) - 1, -1, -1):
        kind, size = s.seg_kind[k], s.seg_size[k]
        net += size if kind in (SEG_ALLOC, SEG_MAP) else -size
        ranges.apply(kind, s.seg_addr[k], size, s.seg_stream[k], undo=True)
    initial = final_reserved - net
    if initial < 0:
        notes.append(
            f"the trace frees {-initial} more bytes of segments than the snapshot's segments account for; "
            "reserved bytes before the trace are taken as 0."
        )
        initial = 0
    return Reconciled(
        initial_reserved=initial,
        initial_ranges=[(a, b - a, st, bool(m)) for a, b, st, m in ranges.items],
        notes=notes,
    )
