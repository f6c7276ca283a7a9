"""The data of a loaded CUDA memory snapshot and the pure functions that read it (the public
surface is :mod:`gradscope.snapshot`, which re-exports these names and the snapshot's diagnosis).

Example:
    >>> from gradscope._snapshot.data import Frame, is_pytorch_frame
    >>> is_pytorch_frame(Frame("/home/u/train.py", 57, "train_step"))
    False
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import operator
import os
import re
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradscope import _views
from gradscope._frames import is_folded_file, is_python_file, is_pytorch_file
from gradscope._gc import paused
from gradscope._series import downsample
from gradscope._snapshot import replay as _replay
from gradscope._snapshot.replay import Annotation, EndBlock, EndSegment
from gradscope._snapshot.unpickle import load_plain
from gradscope.errors import GradscopeError
from gradscope.recording import MemoryPoint, Peak, Phase, Recording, Where, format_bytes

__all__ = [
    "EXTRA_KEY",
    "GROUPS",
    "TIMELINE_POINTS",
    "Annotation",
    "TraceAllocation",
    "EndBlock",
    "EndSegment",
    "Fragmentation",
    "Frame",
    "GroupTimeline",
    "LineBytes",
    "LiveBlocksOverTime",
    "Oom",
    "OomCause",
    "SegmentState",
    "SnapshotData",
    "SnapshotRecording",
    "bytes_by_line",
    "fragmentation",
    "from_saved",
    "group_of",
    "is_pytorch_frame",
    "is_user_frame",
    "line_frame",
    "largest_live_blocks",
    "timeline_of_groups",
    "live_blocks",
    "load_snapshot",
    "load_snapshot_devices",
    "memory_by_group",
    "read_snapshot",
    "segment_size_for",
    "segment_states",
    "snapshot_data",
    "timeline_positions",
    "to_recording",
]

EXTRA_KEY = "cuda_snapshot"  # where a saved recording keeps its SnapshotData (Recording.extra in a file)
TIMELINE_POINTS = 10_000  # at most this many points in Recording.timeline (see NOTE [ what is kept ])
GROUPS = ("line", "function", "file", "stack")
_FORMAT = "gradscope.cuda_snapshot"
_VERSION = 1
_COLUMNS = (
    "alloc_addr", "alloc_size", "alloc_stream", "alloc_at", "alloc_free_requested_at", "alloc_free_at",
    "alloc_stack", "alloc_block_size", "seg_at", "seg_kind", "seg_addr", "seg_size", "seg_stream",
)  # fmt: skip

# NOTE [ what is kept ]
# A snapshot of a long run has millions of trace events; their dicts take about 500 bytes each in
# Python. The replay keeps what the views and the diagnosis need, in columns of 8-byte integers:
# per allocation its address, size, stream, the positions of its alloc / free_requested /
# free_completed events and its stack; per segment event its kind, address, size and stream; the
# OOM entries; each event's time. Frames and stacks are stored once each (NOTE [ stacks are
# interned ]). From these any moment replays exactly: live blocks, bytes by line, reserved
# ranges. What is dropped: the frames of free events (the stack that freed a block) and the
# per-event fields nothing reads (compile_context, user_metadata). The Recording's timeline is
# thinned to TIMELINE_POINTS points (per bucket its first, lowest and highest point, plus
# the peak, the highest reserved point and every OOM), so its peak is exact; its notes say how
# many points were dropped. Sizes are the requested bytes the trace records; the allocator rounds
# blocks up (to 512 bytes at least), so these totals can be a little below
# torch.cuda.memory_allocated().


# ----- data --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One Python (or C++) frame of an allocation's stack."""

    filename: str
    line: int
    name: str

    @property
    def label(self) -> str:
        """``train.py:57 train_step``: short file name, line, function."""
        return f"{_short_file(self.filename)}:{self.line} {self.name}"

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class TraceAllocation:
    """One allocation of the trace (or alive at its start). Positions are trace positions.

    ``alloc_at`` is -1 for memory allocated before the trace began (see NOTE [ a trace that
    starts mid-run ]); ``free_at`` is None while the allocation is alive at the end.
    ``frames`` are innermost first, empty when the allocator recorded none.
    """

    index: int
    address: int
    size: int
    stream: int
    alloc_at: int
    free_requested_at: int | None
    free_at: int | None
    frames: tuple[Frame, ...]

    @property
    def label(self) -> str:
        """The allocating line: the user's line (:func:`line_frame`, ``file:line function``)."""
        return _label_of(self.frames, "line")


@dataclass(frozen=True)
class Oom:
    """An ``oom`` entry: the allocator could not get ``requested`` bytes.

    ``requested`` is the allocator's rounded request; ``device_free`` what CUDA still reported
    free on the device (None when the entry lacks it); ``allocated`` / ``reserved`` the replayed
    bytes at that moment.
    """

    at: int
    requested: int
    device_free: int | None
    stream: int
    allocated: int
    reserved: int
    frames: tuple[Frame, ...] = ()
    t_s: float | None = None


@dataclass(frozen=True, eq=False)
class SnapshotData:
    """Everything kept from one device's snapshot (NOTE [ what is kept ]). Immutable.

    Columns are read-only ``memoryview``s of 8-byte integers. Allocation columns share one
    index (``alloc_*[i]``; positions -1 = before the trace, free positions -1 = never);
    segment-event columns another (``seg_kind``: 0 segment_alloc, 1 segment_free, 2 segment_map,
    3 segment_unmap). ``stacks[i]`` is a tuple of indices into ``frames``, innermost first;
    ``stacks[0]`` is the empty stack. ``time_us[p]`` is the time of event ``p`` when recorded.
    ``initial_segments`` are the reserved ranges before the first event (address, size, stream,
    mapped); ``end_segments`` the allocator's segments and blocks when the snapshot was taken
    (:class:`EndSegment` / :class:`EndBlock`, a block's ``stack`` indexes ``stacks``).
    ``annotations`` are the snapshot's ``external_annotations`` of this device placed in the trace
    (:class:`Annotation`; none when the trace has no times). ``ooms_elsewhere`` are the other
    devices of the same snapshot whose traces end in an OOM (the run stopped there, whatever this
    device was doing).
    """

    device: int
    events: int
    frames: tuple[Frame, ...]
    stacks: tuple[tuple[int, ...], ...]
    alloc_addr: memoryview
    alloc_size: memoryview
    alloc_stream: memoryview
    alloc_at: memoryview
    alloc_free_requested_at: memoryview
    alloc_free_at: memoryview
    alloc_stack: memoryview
    alloc_block_size: memoryview  # exact block size when the end state has it, else -1
    seg_at: memoryview
    seg_kind: memoryview
    seg_addr: memoryview
    seg_size: memoryview
    seg_stream: memoryview
    time_us: memoryview | None
    ooms: tuple[Oom, ...]
    snapshot_at: tuple[int, ...]
    initial_allocated: int
    initial_reserved: int
    initial_segments: tuple[tuple[int, int, int, bool], ...]  # address, size, stream, mapped
    end_segments: tuple[EndSegment, ...]
    allocator_settings: Mapping[str, Any]
    notes: tuple[str, ...] = ()
    annotations: tuple[Annotation, ...] = ()
    ooms_elsewhere: tuple[int, ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __copy__(self) -> SnapshotData:
        return self  # immutable: a copy of a recording shares its data

    def __deepcopy__(self, memo: dict[int, Any]) -> SnapshotData:
        return self

    # ----- rows and moments -----------------------------------------------------------------
    @property
    def allocations(self) -> int:
        """Number of allocations (rows of the ``alloc_*`` columns)."""
        return len(self.alloc_size)

    def stack_frames(self, stack: int) -> tuple[Frame, ...]:
        """The frames of stack ``stack``, innermost first."""
        fr = self._cache.setdefault("stack_frames", {})
        out = fr.get(stack)
        if out is None:
            out = fr[stack] = tuple(self.frames[i] for i in self.stacks[stack])
        return out

    def allocation(self, i: int) -> TraceAllocation:
        """Row ``i`` of the allocation table."""
        if not 0 <= i < self.allocations:
            raise GradscopeError(f"gradscope: no allocation {i} (this snapshot has {self.allocations}).")
        req, free = self.alloc_free_requested_at[i], self.alloc_free_at[i]
        return TraceAllocation(
            index=i, address=self.alloc_addr[i], size=self.alloc_size[i], stream=self.alloc_stream[i],
            alloc_at=self.alloc_at[i], free_requested_at=None if req < 0 else req,
            free_at=None if free < 0 else free, frames=self.stack_frames(self.alloc_stack[i]),
        )

    @property
    def oom(self) -> Oom | None:
        """The failure: the last OOM entry of the trace (None without one)."""
        return self.ooms[-1] if self.ooms else None

    @property
    @_replay.on_one_thread
    def peak_at(self) -> int:
        """Position of the highest allocated bytes (the first such; -1 when nothing was allocated
        in the trace)."""
        s = _series(self)
        if s.pos.numel() == 0:
            return -1
        k = int(torch.argmax(s.live).item())
        return int(s.pos[k].item()) if int(s.live[k].item()) > self.initial_allocated else -1

    @property
    @_replay.on_one_thread
    def peak_bytes(self) -> int:
        """Highest allocated bytes over the trace (exact)."""
        s = _series(self)
        return max([self.initial_allocated] + ([int(s.live.max().item())] if s.pos.numel() else []))

    @property
    def default_at(self) -> int:
        """The moment ``at=None`` means: the OOM when there is one, else the peak."""
        return self.oom.at if self.oom is not None else self.peak_at

    @_replay.on_one_thread
    def live_bytes(self, at: int | None = None) -> int:
        """Allocated bytes at position ``at`` (replayed exactly)."""
        p = self._at(at)
        t = _cols(self)
        return int(t["alloc_size"][_live_mask(t, p)].sum().item())

    @_replay.on_one_thread
    def reserved_bytes(self, at: int | None = None) -> int:
        """Reserved bytes (the sum of segments) at position ``at``."""
        p = self._at(at)
        t = _cols(self)
        sign = torch.where(t["seg_kind"] % 2 == 0, 1, -1)
        done = t["seg_at"] <= p
        return self.initial_reserved + int((t["seg_size"] * sign)[done].sum().item())

    def t_s(self, at: int) -> float | None:
        """Seconds from the trace's first event to event ``at`` (None without times)."""
        if self.time_us is None or self.events == 0:
            return None
        p = min(max(at, 0), self.events - 1)
        return (self.time_us[p] - self.time_us[0]) / 1e6

    def _at(self, at: int | None) -> int:
        if at is None:
            return self.default_at
        try:
            p = -2 if isinstance(at, bool) else operator.index(at)
        except TypeError:
            p = -2
        if not -1 <= p < max(self.events, 1):
            raise GradscopeError(
                f"gradscope: position {at!r} is outside this trace: positions are -1 (before the first "
                f"event) to {self.events - 1} (after the last)."
            )
        return p

    # ----- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able data (integer columns as base64 of zlib'd little-endian int64)."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "device": self.device,
            "events": self.events,
            "frames": [[f.filename, f.line, f.name] for f in self.frames],
            "stacks": [list(s) for s in self.stacks],
            "columns": {c: _encode(getattr(self, c)) for c in _COLUMNS},
            "time_us": None if self.time_us is None else _encode(self.time_us),
            "ooms": [[o.at, o.requested, o.device_free, o.stream, o.allocated, o.reserved,
                      self._stack_of(o.frames)] for o in self.ooms],
            "snapshot_at": list(self.snapshot_at),
            "initial_allocated": self.initial_allocated,
            "initial_reserved": self.initial_reserved,
            "initial_segments": [list(s) for s in self.initial_segments],
            "end_segments": [
                [g.device, g.address, g.total_size, g.stream, g.large, g.expandable,
                 [[b.address, b.size, b.requested, b.state, b.stack] for b in g.blocks]]
                for g in self.end_segments
            ],
            "allocator_settings": dict(self.allocator_settings),
            "notes": list(self.notes),
            "annotations": [[a.name, a.stage, a.at, a.time_us] for a in self.annotations],
            "ooms_elsewhere": list(self.ooms_elsewhere),
        }

    def _stack_of(self, frames: tuple[Frame, ...]) -> int:
        index = self._cache.get("stack_index")
        if index is None:
            index = self._cache["stack_index"] = {self.stack_frames(i): i for i in range(len(self.stacks))}
        return int(index.get(frames, 0))

    @classmethod
    def from_json(cls, d: Any) -> SnapshotData:
        """Rebuild from :meth:`to_json`; GradscopeError on damaged data (NOTE [ files are data ])."""
        try:
            return _from_json(d)
        except GradscopeError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, zlib.error) as e:
            raise GradscopeError(
                f"gradscope: the recording's CUDA snapshot data is damaged ({type(e).__name__}: {e}). "
                "Load the snapshot file again with gs.load_snapshot(path)."
            ) from None


class OomCause(str, enum.Enum):
    """Why a request did not fit, from the reserved segments at that moment."""

    FRAGMENTATION = "fragmentation"  # enough free bytes in reserved segments, but no block large enough
    CAPACITY = "capacity"  # fewer free reserved bytes than the request, and no new segment from the device
    FITS = "fits"  # a free block was large enough (another pool, or the snapshot is of another moment)
    NO_REQUEST = "no_request"  # no OOM at this moment: figures only


@dataclass(frozen=True)
class Fragmentation:
    """Reserved memory at one moment: how much of it was free, and in which pieces.

    ``unallocated`` = ``reserved - allocated``; ``free_bytes`` the part of it in free pieces (the
    rest is rounding inside live blocks, which no request can use). ``largest_free`` is the
    largest free piece of one segment (any stream); ``largest_free_on_stream`` the largest on the
    request's stream (blocks serve only their own stream). Free pieces are the segments' ranges
    minus the live blocks; a block's size is exact when the snapshot's end state has it, else its
    request rounded up to 512 bytes (``exact`` says whether every live block was exact). The
    cause is FRAGMENTATION when the free pieces together hold the request (a compact layout would
    have served it from reserved memory), CAPACITY when they do not (the allocator needed a new
    segment of :func:`segment_size_for` the request, which the device, or the process's share of
    it, could not give).
    """

    at: int
    allocated: int
    reserved: int
    unallocated: int
    largest_free: int
    largest_free_on_stream: int | None
    free_pieces: int
    segments: int
    request: int | None
    stream: int | None
    device_free: int | None
    cause: OomCause
    exact: bool
    free_bytes: int = 0

    def __str__(self) -> str:
        text = (
            f"reserved {format_bytes(self.reserved)}, allocated {format_bytes(self.allocated)}, "
            f"{format_bytes(self.unallocated)} reserved but unallocated, {format_bytes(self.free_bytes)} of it in "
            f"{self.free_pieces} free pieces (largest {format_bytes(self.largest_free)})"
        )
        if self.request is not None:
            text += f"; request {format_bytes(self.request)}: {self.cause.value}"
        return text


@dataclass(frozen=True)
class SegmentState:
    """One reserved range at one moment: a segment (one cudaMalloc), or the mapped part of an
    expandable segment. ``live_bytes`` are the requested bytes of its ``live_blocks``;
    ``free_pieces`` the (address, size) gaps between them (block sizes as in
    :class:`Fragmentation`)."""

    address: int
    size: int
    stream: int
    expandable: bool
    live_blocks: int
    live_bytes: int
    free_pieces: tuple[tuple[int, int], ...]

    @property
    def free_bytes(self) -> int:
        """Bytes of the segment not covered by a live block."""
        return sum(s for _, s in self.free_pieces)

    @property
    def largest_free(self) -> int:
        """The largest free piece (0 when the segment is full)."""
        return max((s for _, s in self.free_pieces), default=0)


@dataclass(frozen=True)
class LineBytes:
    """Bytes live at one moment from one source line (or another frame group)."""

    key: str
    bytes: int
    blocks: int
    frame: Frame | None

    def __str__(self) -> str:
        return f"{self.key}: {format_bytes(self.bytes)} in {self.blocks} block{'s' if self.blocks != 1 else ''}"


@dataclass(frozen=True)
class GroupTimeline:
    """Allocated bytes over time split by frame group, for a stacked chart.

    ``bytes[g][k]`` is what group ``groups[g]`` held at ``positions[k]`` (exact at each sample);
    the last group is ``"(other)"`` when more groups than ``top`` exist. ``total`` and
    ``reserved`` are the allocated and reserved bytes at each sample.
    """

    group: str
    positions: tuple[int, ...]
    t_s: tuple[float, ...] | None
    groups: tuple[str, ...]
    bytes: tuple[tuple[int, ...], ...]
    total: tuple[int, ...]
    reserved: tuple[int, ...]


# ----- loading -----------------------------------------------------------------------------
@_replay.on_one_thread
def read_snapshot(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[int, SnapshotData]:
    """Every device of a snapshot file (or of the dict ``torch.cuda.memory._snapshot()``
    returns), as :class:`SnapshotData` keyed by device index. Devices with neither trace events
    nor segments are left out."""
    if not isinstance(source, (Mapping, str, os.PathLike)):
        raise GradscopeError(
            f"gradscope: load_snapshot takes a file path or the dict torch.cuda.memory._snapshot() "
            f"returns, not a {type(source).__name__}."
        )
    # see NOTE [ a plain-data unpickler ]: no collections while millions of containers are alive
    # (objects made with the collector off sit in its youngest generation: the first collection
    # after it is back on would walk them all, so it stays off until they are gone)
    with paused():
        if isinstance(source, Mapping):
            raw: Any = source
            what = "the snapshot dict"
        else:
            what = repr(os.fspath(source))
            raw = load_plain(source)
        segments, traces, settings = _replay.check_snapshot(raw, what)
        annotations, skipped = _replay.read_annotations(raw)
        stacks = _replay.StackTable()
        try:
            segs = _replay.end_segments(segments, stacks)
            devices = sorted({d for d, t in enumerate(traces) if t}
                             | {g.device for g in segs if g.device is not None}
                             | ({0} if any(g.device is None for g in segs) else set()))
            owned = not isinstance(source, Mapping)  # a file we loaded: its lists may be emptied as read
            scans = {d: _replay.scan_device(traces[d] if d < len(traces) else [], d, stacks, consume=owned)
                     for d in devices}
        finally:
            stacks.release()
        del raw, segments, traces
        frames = tuple(Frame(*f) for f in stacks.frames)
        stack_tuple = tuple(stacks.stacks)
        out = {}
        for d, scan in scans.items():
            rec = _replay.reconcile(scan, segs, stacks, have_state=True)
            out[d] = _build(scan, rec, segs, frames, stack_tuple, settings,
                            _replay.place_annotations(annotations, d, scan.times), skipped)
        failed = {d for d, data in out.items() if data.ooms}
        for d, data in out.items():
            object.__setattr__(data, "ooms_elsewhere", tuple(sorted(failed - {d})))
    return out


def load_snapshot(source: str | os.PathLike[str] | Mapping[str, Any],
                  device: int | str | torch.device | None = None, *, label: str | None = None) -> SnapshotRecording:
    """A :class:`SnapshotRecording` (a :class:`~gradscope.recording.Recording`) of one device of a
    CUDA memory snapshot.

    ``source`` is a file written by ``torch.cuda.memory._dump_snapshot`` (gzip-compressed or
    not) or the dict ``torch.cuda.memory._snapshot()`` returns. ``device`` picks the device
    (``0``, ``"cuda:1"``) when the snapshot has several; the error lists them otherwise. The file
    is read without running anything in it. :func:`snapshot_data` gives the allocation-level data.
    """
    all_devices = read_snapshot(source)
    d = _pick_device(all_devices, device, source)
    return to_recording(all_devices[d], label=label if label is not None else _default_label(source, d))


def load_snapshot_devices(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[int, SnapshotRecording]:
    """One recording per device of the snapshot, keyed by device index."""
    return {d: to_recording(data, label=_default_label(source, d)) for d, data in read_snapshot(source).items()}


def _pick_device(all_devices: Mapping[int, SnapshotData], device: Any, source: Any) -> int:
    if device is None:
        if len(all_devices) == 1:
            return next(iter(all_devices))
        if not all_devices:
            raise GradscopeError(
                "gradscope: this snapshot has no allocations on any device (empty traces, no segments). "
                "Call torch.cuda.memory._record_memory_history() before the code runs, and dump the "
                "snapshot before memory is freed."
            )
        listing = "; ".join(
            f"cuda:{d} ({v.events} trace events, {format_bytes(v.peak_bytes)} allocated at the peak"
            + (", an OOM" if v.ooms else "") + ")"
            for d, v in sorted(all_devices.items())
        )
        raise GradscopeError(
            f"gradscope: this snapshot has several devices: {listing}. Pick one with "
            f"load_snapshot(..., device={min(all_devices)}), or use "
            "gradscope.snapshot.load_snapshot_devices(...) for one recording per device."
        )
    index = _device_index(device)
    if index not in all_devices:
        have = ", ".join(f"cuda:{d}" for d in sorted(all_devices)) or "none"
        raise GradscopeError(f"gradscope: this snapshot has nothing on cuda:{index} (devices: {have}).")
    return index


def _device_index(device: Any) -> int:
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise GradscopeError(f"gradscope: a CUDA snapshot has only cuda devices, not {device}.")
        return device.index or 0
    if type(device) is int and device >= 0:
        return device
    if isinstance(device, str):
        m = re.fullmatch(r"(?:cuda:)?(\d+)", device.strip())
        if m:
            return int(m.group(1))
    raise GradscopeError(f"gradscope: device must be an index (0), 'cuda:1' or a torch.device, not {device!r}.")


def _default_label(source: Any, device: int) -> str:
    name = os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "snapshot"
    return f"{name} cuda:{device}"


def _build(scan: _replay.DeviceScan, rec: _replay.Reconciled, segs: list[_replay.EndSegment],
           frames: tuple[Frame, ...], stacks: tuple[tuple[int, ...], ...],
           settings: dict[str, Any], annotations: tuple[Annotation, ...] = (),
           skipped_annotations: int = 0) -> SnapshotData:
    def ro(a: array) -> memoryview:
        return memoryview(a).toreadonly()

    notes = list(rec.notes)
    pre = sum(1 for a in scan.alloc_at if a < 0)
    initial_allocated = sum(s for s, a in zip(scan.size, scan.alloc_at, strict=True) if a < 0)
    if pre and pre == len(scan.alloc_at):
        notes.append(
            f"no allocation history: the snapshot holds the allocator's segments and blocks when it was taken and "
            f"no allocation in its trace ({pre} allocations, {format_bytes(initial_allocated)}, alive then). When "
            "each was made and "
            "freed, and so whether memory grows from step to step, cannot be known (a block's role only from its "
            "own frames); record with "
            "torch.cuda.memory._record_memory_history() before the code runs for a trace."
        )
    elif pre:
        notes.append(
            f"the trace starts mid-run: {pre} allocations ({format_bytes(initial_allocated)}) were alive "
            "before its first event, known from their frees and from the snapshot's segments "
            "(NOTE [ a trace that starts mid-run ])."
        )
    if scan.unknown_actions:
        kinds = ", ".join(f"{k!r} x{v}" for k, v in sorted(scan.unknown_actions.items())[:5])
        notes.append(f"trace entries with actions this gradscope does not know were skipped: {kinds}.")
    if scan.double_allocs:
        notes.append(f"{scan.double_allocs} allocations reused an address the trace had not freed; "
                     "the earlier allocation is taken as freed there.")
    if skipped_annotations:
        notes.append(f"{skipped_annotations} external_annotations entries without a name, stage or time were "
                     "left out.")
    if scan.events and scan.times is None:
        notes.append("the trace has no 'time_us' on every event: times are event positions.")
    if scan.events and not any(scan.stack):
        notes.append("no stack frames were recorded: record with "
                     "torch.cuda.memory._record_memory_history(stacks='python') to see the allocating lines.")
    if settings:
        shown = ", ".join(f"{k}={v!r}" for k, v in settings.items() if not isinstance(v, Mapping))
        notes.append(f"allocator settings: {shown}.")
    data = SnapshotData(
        device=scan.device, events=scan.events, frames=frames, stacks=stacks,
        alloc_addr=ro(scan.addr), alloc_size=ro(scan.size), alloc_stream=ro(scan.stream),
        alloc_at=ro(scan.alloc_at), alloc_free_requested_at=ro(scan.free_requested_at),
        alloc_free_at=ro(scan.free_at), alloc_stack=ro(scan.stack), alloc_block_size=ro(scan.block_size),
        seg_at=ro(scan.seg_at), seg_kind=ro(scan.seg_kind), seg_addr=ro(scan.seg_addr),
        seg_size=ro(scan.seg_size), seg_stream=ro(scan.seg_stream),
        time_us=None if scan.times is None else ro(scan.times),
        ooms=(), snapshot_at=tuple(scan.snapshots), initial_allocated=initial_allocated,
        initial_reserved=rec.initial_reserved,
        initial_segments=tuple((a, s, st, m) for a, s, st, m in rec.initial_ranges),
        end_segments=tuple(g for g in segs if g.device is None or g.device == scan.device),
        allocator_settings=settings, notes=tuple(notes), annotations=annotations,
    )
    ooms = tuple(
        Oom(at=at, requested=size, device_free=None if free < 0 else free, stream=stream,
            allocated=data.live_bytes(at), reserved=data.reserved_bytes(at),
            frames=data.stack_frames(stack), t_s=data.t_s(at))
        for at, size, free, stream, stack in scan.ooms
    )
    object.__setattr__(data, "ooms", ooms)
    data._cache.clear()
    return data


def _from_json(d: Any) -> SnapshotData:
    if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
        raise GradscopeError("gradscope: this recording holds no CUDA snapshot data (it was not made by "
                             "gs.load_snapshot).")
    if d.get("version") != _VERSION:
        raise GradscopeError(f"gradscope: CUDA snapshot data version {d.get('version')!r} is not supported "
                             f"(this gradscope reads version {_VERSION}); load the snapshot file again.")
    events = _nonneg(d["events"])
    frames = tuple(Frame(str(f[0]), _int(f[1]), str(f[2])) for f in d["frames"])
    stacks = tuple(tuple(_int(i) for i in s) for s in d["stacks"])
    if not stacks or stacks[0] != ():
        raise ValueError("stack 0 must be the empty stack")
    if any(not 0 <= i < len(frames) for s in stacks for i in s):
        raise ValueError("a stack points outside the frame table")
    cols = {c: _decode(d["columns"][c]) for c in _COLUMNS}
    n_alloc, n_seg = len(cols["alloc_addr"]), len(cols["seg_at"])
    for c in _COLUMNS:
        if len(cols[c]) != (n_alloc if c.startswith("alloc_") else n_seg):
            raise ValueError(f"column {c} has {len(cols[c])} rows")
    t = {c: torch.frombuffer(cols[c], dtype=torch.int64) if len(cols[c]) else torch.zeros(0, dtype=torch.int64)
         for c in _COLUMNS}
    for c in ("alloc_at", "alloc_free_requested_at", "alloc_free_at", "seg_at"):
        if t[c].numel() and (int(t[c].min()) < -1 or int(t[c].max()) >= events):
            raise ValueError(f"{c} points outside the trace")
    if t["alloc_stack"].numel() and (int(t["alloc_stack"].min()) < 0 or int(t["alloc_stack"].max()) >= len(stacks)):
        raise ValueError("alloc_stack points outside the stack table")
    if t["seg_kind"].numel() and (int(t["seg_kind"].min()) < 0 or int(t["seg_kind"].max()) > 3):
        raise ValueError("unknown segment event kind")
    if any(int(t[c].min()) < 0 for c in ("alloc_size", "alloc_addr", "seg_size") if t[c].numel()):
        raise ValueError("negative sizes or addresses")
    times = None if d.get("time_us") is None else _decode(d["time_us"])
    if times is not None and len(times) != events:
        raise ValueError("time_us does not have one time per event")

    def stack_frames(i: Any) -> tuple[Frame, ...]:
        i = _int(i)
        if not 0 <= i < len(stacks):
            raise ValueError("an OOM's stack points outside the stack table")
        return tuple(frames[k] for k in stacks[i])

    ooms = []
    for o in d["ooms"]:
        at = _int(o[0])
        if not 0 <= at < events:
            raise ValueError("an OOM points outside the trace")
        free = o[2]
        ooms.append(Oom(at=at, requested=_nonneg(o[1]), device_free=None if free is None else _nonneg(free),
                        stream=_int(o[3]), allocated=_nonneg(o[4]), reserved=_nonneg(o[5]),
                        frames=stack_frames(o[6]),
                        t_s=None if times is None else (times[at] - times[0]) / 1e6))
    end = []
    for g in d["end_segments"]:
        blocks = tuple(_replay.EndBlock(_nonneg(b[0]), _nonneg(b[1]), _nonneg(b[2]), str(b[3]), _int(b[4]))
                       for b in g[6])
        if any(not 0 <= b.stack < len(stacks) for b in blocks):
            raise ValueError("a block's stack points outside the stack table")
        end.append(_replay.EndSegment(None if g[0] is None else _nonneg(g[0]), _nonneg(g[1]), _nonneg(g[2]),
                                      _int(g[3]), bool(g[4]), bool(g[5]), blocks))
    settings = d.get("allocator_settings") or {}
    if not isinstance(settings, Mapping):
        raise TypeError("allocator_settings is not an object")
    annotations = []
    for a in d.get("annotations", ()):  # absent in files saved before annotations were kept
        at = _int(a[2])
        if not -1 <= at < max(events, 1) or a[1] not in ("START", "END"):
            raise ValueError("an annotation points outside the trace")
        annotations.append(Annotation(str(a[0]), str(a[1]), at, _int(a[3])))
    return SnapshotData(
        device=_nonneg(d["device"]), events=events, frames=frames, stacks=stacks,
        **{c: memoryview(cols[c]).toreadonly() for c in _COLUMNS},
        time_us=None if times is None else memoryview(times).toreadonly(),
        ooms=tuple(ooms), snapshot_at=tuple(_int(p) for p in d["snapshot_at"]),
        initial_allocated=_nonneg(d["initial_allocated"]), initial_reserved=_nonneg(d["initial_reserved"]),
        initial_segments=tuple((_nonneg(s[0]), _nonneg(s[1]), _int(s[2]), bool(s[3])) for s in d["initial_segments"]),
        end_segments=tuple(end), allocator_settings=dict(settings),
        notes=tuple(str(n) for n in d.get("notes", ())), annotations=tuple(annotations),
        ooms_elsewhere=tuple(_nonneg(x) for x in d.get("ooms_elsewhere", ())),  # absent in older files
    )


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _nonneg(v: Any) -> int:
    v = _int(v)
    if v < 0:
        raise ValueError(f"expected a non-negative integer, got {v}")
    return v


def _encode(col: memoryview) -> str:
    raw = col.tobytes()
    if sys.byteorder == "big":
        a = array("q")
        a.frombytes(raw)
        a.byteswap()
        raw = a.tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def _decode(text: Any) -> array:
    if not isinstance(text, str):
        raise TypeError("a column is not a string")
    raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    if len(raw) % 8:
        raise ValueError("a column's length is not a multiple of 8 bytes")
    a = array("q")
    a.frombytes(raw)
    if sys.byteorder == "big":
        a.byteswap()
    return a


# ----- the recording -----------------------------------------------------------------------
# NOTE [ a snapshot is its own type ]: a recording made by load_snapshot is a SnapshotRecording, a
# frozen subclass of Recording that carries its SnapshotData (and the trace position of each
# timeline point) as fields. A subclass, not a separate class, because a snapshot has the
# Recording's timeline, peak, where, notes and error, and every generic reader of those (compare,
# jobs, save, the figures that are empty without a graph) keeps working unchanged; what differs
# is found by type: its views are registered for this class (NOTE [ one registry of views ] in
# gradscope._views) and gs.diagnose tests isinstance. Nothing reads where.memory_source to decide, and
# nothing keys data by id(): the data travels with the object through copy.copy,
# dataclasses.replace and deepcopy (SnapshotData is immutable, so copies share it). In a file the
# data is the JSON of SnapshotData under extra[EXTRA_KEY] (the same layout as before this type, so
# older files load): to_dict writes it, and gs.load rebuilds a SnapshotRecording from it through
# the registry's saved-type hook (_views.declare_saved, called below from_saved).
@dataclass(frozen=True, kw_only=True, repr=False, eq=False)
class SnapshotRecording(Recording):
    """A :class:`~gradscope.recording.Recording` made from a CUDA memory snapshot
    (:func:`load_snapshot`): allocations over a trace, no autograd graph. ``data`` is every
    allocation (:class:`SnapshotData`); ``timeline_at`` the trace position of each point of
    ``timeline``. See NOTE [ a snapshot is its own type ].
    """

    data: SnapshotData
    timeline_at: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.data, SnapshotData):
            raise GradscopeError(
                f"gradscope: SnapshotRecording.data must be a SnapshotData, not a {type(self.data).__name__}; "
                "make one with gs.load_snapshot(path).")
        if len(self.timeline_at) != len(self.timeline):
            raise GradscopeError(
                f"gradscope: a SnapshotRecording has {len(self.timeline)} timeline points but "
                f"{len(self.timeline_at)} trace positions; give one position per point "
                "(gs.load_snapshot(path) makes both).")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, SnapshotRecording)
        return (Recording.__eq__(self, other) is True and self.timeline_at == other.timeline_at
                and (self.data is other.data or self.data.to_json() == other.data.to_json()))

    def to_dict(self) -> dict[str, Any]:
        """The recording's JSON-ready dict, with the snapshot's data under ``extra[EXTRA_KEY]``."""
        d = super().to_dict()
        d["extra"] = {**d["extra"], EXTRA_KEY: {**self.data.to_json(), "timeline_at": list(self.timeline_at)}}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SnapshotRecording:
        """Rebuild from :meth:`to_dict` output; GradscopeError on bad data or another kind of recording."""
        rec = Recording.from_dict(d)
        if not isinstance(rec, SnapshotRecording):
            raise GradscopeError("gradscope: this recording was not made from a CUDA memory snapshot (no "
                                 f"extra[{EXTRA_KEY!r}]); load it with gs.load(path) or Recording.from_dict.")
        return rec


def from_saved(recording: Recording) -> SnapshotRecording:
    """The :class:`SnapshotRecording` of a recording read from a file whose ``extra`` carries
    snapshot data (what ``gs.load`` returns for a saved snapshot); GradscopeError when damaged."""
    if isinstance(recording, SnapshotRecording):
        return recording
    extra = dict(recording.extra)
    saved = extra.pop(EXTRA_KEY)
    data = SnapshotData.from_json(saved)
    at = saved.get("timeline_at") if isinstance(saved, Mapping) else None
    if (not isinstance(at, list) or len(at) != len(recording.timeline)
            or any(type(p) is not int or p < -1 for p in at)):
        raise GradscopeError("gradscope: the recording's timeline positions are damaged; load the snapshot "
                             "file again with gs.load_snapshot(path).")
    fields = {f.name: getattr(recording, f.name) for f in dataclasses.fields(Recording)}
    return SnapshotRecording(**{**fields, "extra": extra}, data=data, timeline_at=tuple(at))


_views.declare_saved(EXTRA_KEY, from_saved)  # NOTE [ saved types ] in gradscope._views


def snapshot_data(recording: Recording) -> SnapshotData:
    """The :class:`SnapshotData` behind a recording made by :func:`load_snapshot` (also after
    ``Recording.save`` / ``gs.load``, ``copy`` or ``dataclasses.replace``): ``recording.data``."""
    if isinstance(recording, SnapshotRecording):
        return recording.data
    how = "gs.load_snapshot(path) makes one"
    if isinstance(recording, Recording) and isinstance(recording.extra, Mapping) and EXTRA_KEY in recording.extra:
        how = ("this plain Recording only carries its saved data: gs.load(path) or Recording.from_dict rebuilds "
               "the snapshot recording")
    raise GradscopeError(f"gradscope: this recording was not made from a CUDA memory snapshot ({how}).")


def timeline_positions(recording: Recording) -> tuple[int, ...]:
    """The trace position of each point of ``recording.timeline`` (a recording made by
    :func:`load_snapshot`): what to pass as ``at`` for the moment a timeline point shows."""
    snapshot_data(recording)  # the same checks and error for a recording of another kind
    assert isinstance(recording, SnapshotRecording)
    return recording.timeline_at


@_replay.on_one_thread
def to_recording(data: SnapshotData, label: str = "") -> SnapshotRecording:
    """The :class:`SnapshotRecording` of one device's snapshot data."""
    s = _series(data)
    n = int(s.pos.numel())
    must = [int(i) for i in s.oom_index.tolist()]
    if n:
        must.append(int(torch.argmax(s.live).item()))
        must.append(int(torch.argmax(s.reserved).item()))
    keep = downsample(s.live, TIMELINE_POINTS, must)  # see NOTE [ downsampling keeps the peak ]
    labels = _point_labels(data, s)
    pos_l, live_l, res_l = s.pos.tolist(), s.live.tolist(), s.reserved.tolist()
    timeline = tuple(
        MemoryPoint(t_s=_t_of(data, pos_l[k]), live=live_l[k], phase=Phase.OTHER, label=labels(k),
                    reserved=res_l[k])
        for k in keep
    )
    peak_at = data.peak_at
    peak_bytes = data.peak_bytes
    if n and peak_at >= 0:
        k = int(torch.argmax(s.live).item())
        peak = Peak(bytes=peak_bytes, phase=Phase.OTHER, t_s=_t_of(data, peak_at), label=labels(k))
    else:
        peak = Peak(bytes=peak_bytes, phase=Phase.OTHER, t_s=0.0, label="before the trace")
    reserved_peak = max([data.initial_reserved] + ([int(s.reserved.max().item())] if n else []))
    notes = list(data.notes)
    if len(keep) < n:
        notes.append(
            f"timeline: {len(keep)} of {n} points kept (per bucket the first, lowest and highest, "
            "plus the peak and every OOM); every allocation is kept, so any moment replays exactly "
            "(gradscope.snapshot.live_blocks(data, at))."
        )
    notes.append("allocated bytes are the sizes the trace records (requested bytes; the allocator rounds "
                 "blocks up to multiples of 512 bytes).")
    notes.append("kept per allocation: size, stream, its alloc / free_requested / free_completed positions and "
                 "its stack; not kept: the stacks of free events and the entries' other fields "
                 "(NOTE [ what is kept ] in gradscope._snapshot.data).")
    oom = data.oom
    error = None
    if oom is not None:
        free = "" if oom.device_free is None else f", {format_bytes(oom.device_free)} free on the device"
        error = (
            f"CUDA out of memory on cuda:{data.device}: tried to allocate {format_bytes(oom.requested)} with "
            f"{format_bytes(oom.allocated)} allocated and {format_bytes(oom.reserved)} reserved{free} "
            f"(trace event {oom.at})."
        )
        if len(data.ooms) > 1:
            notes.append(f"the trace has {len(data.ooms)} OOMs; the last (event {oom.at}) is the failure shown.")
    duration = 0.0
    if data.time_us is not None and data.events:
        duration = (data.time_us[data.events - 1] - data.time_us[0]) / 1e6
    return SnapshotRecording(
        timeline=timeline,
        peak_bytes=peak_bytes,
        baseline_bytes=0,
        peak=peak,
        where=Where(device=f"cuda:{data.device}", memory_source="cuda snapshot"),
        complete=oom is None,
        error=error,
        notes=tuple(notes),
        label=label,
        wall_time_s=duration,
        reserved_peak_bytes=reserved_peak,
        timeline_dropped=n - len(keep),
        data=data,
        timeline_at=tuple(pos_l[k] for k in keep),
    )


def _t_of(data: SnapshotData, pos: int) -> float:
    t = data.t_s(pos)
    return float(pos) if t is None else t


def _point_labels(data: SnapshotData, s: _Series) -> Any:
    kind_l, ref_l = s.kind.tolist(), s.ref.tolist()
    stack_l = data.alloc_stack
    seg_size = data.seg_size
    seg_names = ("cudaMalloc", "cudaFree", "map", "unmap")

    def label(k: int) -> str:
        kind, ref = kind_l[k], ref_l[k]
        if kind == 0:
            return _group_label(data, stack_l[ref], "line")
        if kind == 1:
            return "free " + _group_label(data, stack_l[ref], "line")
        if kind == 2:
            return f"{seg_names[data.seg_kind[ref]]} {format_bytes(seg_size[ref])}"
        o = data.ooms[ref]
        return f"OOM: tried to allocate {format_bytes(o.requested)}"

    return label


# ----- replayed series ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Series:
    pos: torch.Tensor  # event position of each point, increasing
    live: torch.Tensor  # allocated bytes after it
    reserved: torch.Tensor
    kind: torch.Tensor  # 0 alloc, 1 free, 2 segment event, 3 OOM
    ref: torch.Tensor  # allocation / segment event / OOM index
    oom_index: torch.Tensor  # point index of each OOM


def _cols(data: SnapshotData) -> dict[str, torch.Tensor]:
    t = data._cache.get("tensors")
    if t is None:
        t = {}
        for c in _COLUMNS:
            mv = getattr(data, c)
            t[c] = torch.frombuffer(mv.obj, dtype=torch.int64) if len(mv) else torch.zeros(0, dtype=torch.int64)
        data._cache["tensors"] = t
    return t


def _live_mask(t: dict[str, torch.Tensor], at: int) -> torch.Tensor:
    free = t["alloc_free_at"]
    return (t["alloc_at"] <= at) & ((free < 0) | (free > at))


def _series(data: SnapshotData) -> _Series:
    s = data._cache.get("series")
    if s is not None:
        return s
    t = _cols(data)
    made = t["alloc_at"] >= 0
    freed = t["alloc_free_at"] >= 0
    idx = torch.arange(data.allocations, dtype=torch.int64)
    seg_sign = torch.where(t["seg_kind"] % 2 == 0, 1, -1)
    oom_at = torch.tensor([o.at for o in data.ooms], dtype=torch.int64)
    n_seg, n_oom = int(t["seg_at"].numel()), len(data.ooms)
    pos = torch.cat([t["alloc_at"][made], t["alloc_free_at"][freed], t["seg_at"], oom_at])
    d_live = torch.cat([t["alloc_size"][made], -t["alloc_size"][freed], torch.zeros(n_seg + n_oom, dtype=torch.int64)])
    d_res = torch.cat([torch.zeros(int(made.sum()) + int(freed.sum()), dtype=torch.int64),
                       t["seg_size"] * seg_sign, torch.zeros(n_oom, dtype=torch.int64)])
    kind = torch.cat([torch.zeros(int(made.sum()), dtype=torch.int64), torch.ones(int(freed.sum()), dtype=torch.int64),
                      torch.full((n_seg,), 2, dtype=torch.int64), torch.full((n_oom,), 3, dtype=torch.int64)])
    ref = torch.cat([idx[made], idx[freed], torch.arange(n_seg, dtype=torch.int64),
                     torch.arange(n_oom, dtype=torch.int64)])
    order = torch.argsort(pos, stable=True)
    pos, kind, ref = pos[order], kind[order], ref[order]
    live = data.initial_allocated + torch.cumsum(d_live[order], 0)
    reserved = data.initial_reserved + torch.cumsum(d_res[order], 0)
    oom_index = torch.nonzero(kind == 3).flatten()
    s = _Series(pos, live, reserved, kind, ref, oom_index)
    data._cache["series"] = s
    return s


# ----- frames and groups -------------------------------------------------------------------
def is_pytorch_frame(frame: Frame) -> bool:
    """Whether a frame is PyTorch's own code (or not Python at all: C++ frames); the rule is
    :func:`gradscope._frames.is_pytorch_file` (see NOTE [ folded frames ] there)."""
    return is_pytorch_file(frame.filename)


def is_user_frame(frame: Frame) -> bool:
    """Whether a frame is the user's code: Python outside PyTorch, the standard library and
    installed packages (:func:`gradscope._frames.is_folded_file`, also for another machine's
    paths); never a C++ frame."""
    return is_python_file(frame.filename) and not is_folded_file(frame.filename)


def line_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The frame that names a stack's line: the innermost user frame (:func:`is_user_frame`);
    without one the innermost Python frame outside PyTorch (a library's), else PyTorch's own;
    None when the stack has no Python frame (C++ only: the autograd engine's threads)."""
    fallback = own = None
    for f in frames:
        if not is_python_file(f.filename):
            continue
        if not is_folded_file(f.filename):
            return f
        if fallback is None and not is_pytorch_file(f.filename):
            fallback = f
        if own is None:
            own = f
    return fallback or own


def _cpp_only_label(frames: tuple[Frame, ...]) -> str:
    """A stack of C++ frames only: the autograd engine's (backward) or another thread's."""
    if any(_is_engine_frame(f.name) for f in frames):
        return "(backward: C++ frames only)"
    return "(C++ frames only)"


_ENGINE = re.compile(r"torch::autograd::(?:Engine::|python::PythonEngine|AccumulateGrad|generated::\w+Backward\d*::apply)"
                     r"|Backward\d*::apply\b|AccumulateGrad::apply")


def _is_engine_frame(name: str) -> bool:
    """A C++ frame of the autograd engine running backward (its thread, a node's apply,
    AccumulateGrad)."""
    return bool(_ENGINE.search(name))


def _short_file(fn: str) -> str:
    parts = fn.replace("\\", "/").rstrip("/").split("/")
    base = parts[-1] if parts else fn
    if base in ("__init__.py", "__main__.py") and len(parts) > 1:
        return f"{parts[-2]}/{base}"
    return base


def _label_of(frames: tuple[Frame, ...], group: str) -> str:
    if not frames:
        return "(no stack recorded)"
    f = line_frame(frames)
    if f is None:
        return _cpp_only_label(frames)
    if group == "stack":
        users = [u for u in frames if is_user_frame(u)]
        shown = users[:4] or [f]
        return " ← ".join(u.label for u in shown) + (" ← …" if len(users) > 4 else "")
    if group == "line":
        return f.label
    if group == "function":
        return f"{_short_file(f.filename)} {f.name}"
    return _short_file(f.filename)


def group_of(frames: tuple[Frame, ...], group: str = "line") -> str:
    """The frame group of a stack: ``"line"`` (``train.py:57 train_step``, the user's line:
    :func:`line_frame`), ``"function"`` (``train.py train_step``), ``"file"`` (``train.py``) or
    ``"stack"`` (the user frames, innermost first). A stack of C++ frames only (the autograd
    engine's backward thread has no Python frames) is ``"(backward: C++ frames only)"``, never
    a C++ function's name."""
    _check_group(group)
    return _label_of(frames, group)


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise GradscopeError(f"gradscope: group must be one of {', '.join(GROUPS)}, not {group!r}.")


def _group_label(data: SnapshotData, stack: int, group: str) -> str:
    cache = data._cache.setdefault(f"labels:{group}", {})
    lab = cache.get(stack)
    if lab is None:
        lab = cache[stack] = _label_of(data.stack_frames(stack), group)
    return lab


def _stack_groups(data: SnapshotData, group: str) -> tuple[torch.Tensor, list[str], list[Frame | None]]:
    """Group index of every stack, the group names, and a representative frame per group."""
    key = f"groups:{group}"
    hit = data._cache.get(key)
    if hit is not None:
        return hit
    names: list[str] = []
    firsts: list[Frame | None] = []
    index: dict[str, int] = {}
    of_stack = []
    for sid in range(len(data.stacks)):
        name = _group_label(data, sid, group)
        g = index.get(name)
        if g is None:
            g = index[name] = len(names)
            names.append(name)
            fr = data.stack_frames(sid)
            firsts.append(line_frame(fr) or (fr[0] if fr else None))
        of_stack.append(g)
    out = (torch.tensor(of_stack, dtype=torch.int64), names, firsts)
    data._cache[key] = out
    return out


# ----- questions about a moment ------------------------------------------------------------
@_replay.on_one_thread
def live_blocks(data: SnapshotData, at: int | None = None, limit: int | None = None) -> tuple[TraceAllocation, ...]:
    """Allocations alive at position ``at`` (default: the OOM, else the peak), largest first,
    with their frames."""
    p = data._at(at)
    t = _cols(data)
    idx = torch.nonzero(_live_mask(t, p)).flatten()
    sizes = t["alloc_size"][idx]
    order = sorted(zip((-sizes).tolist(), idx.tolist(), strict=True))
    if limit is not None:
        order = order[:limit]
    return tuple(data.allocation(i) for _, i in order)


@_replay.on_one_thread
def bytes_by_line(data: SnapshotData, at: int | None = None, group: str = "line",
                  stream: int | None = None) -> tuple[LineBytes, ...]:
    """Bytes alive at ``at`` by allocating source line (or another frame group, see
    :func:`group_of`), largest first: ``train.py:57 train_step: 80.0 MiB in 40 blocks``.
    ``stream`` keeps one stream's allocations only."""
    _check_group(group)
    p = data._at(at)
    t = _cols(data)
    mask = _live_mask(t, p)
    if stream is not None:
        mask &= t["alloc_stream"] == stream
    of_stack, names, firsts = _stack_groups(data, group)
    g = of_stack[t["alloc_stack"][mask]]
    nbytes = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g, t["alloc_size"][mask])
    count = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g, torch.ones_like(g))
    rows = [LineBytes(names[i], b, c, firsts[i]) for i, (b, c) in enumerate(zip(nbytes.tolist(), count.tolist(), strict=True)) if c]
    rows.sort(key=lambda r: (-r.bytes, -r.blocks, r.key))
    return tuple(rows)


def segment_size_for(request: int) -> int:
    """The segment PyTorch's caching allocator asks CUDA for when no cached block serves a
    request: 2 MiB for requests up to 1 MiB (the small pool), 20 MiB up to 10 MiB, else the
    request rounded up to 2 MiB."""
    if request <= 1 << 20:
        return 2 << 20
    if request < 10 << 20:
        return 20 << 20
    return -(-request // (2 << 20)) * (2 << 20)


@_replay.on_one_thread
def segment_states(data: SnapshotData, at: int | None = None) -> tuple[SegmentState, ...]:
    """Every reserved range at ``at`` (default: the OOM, else the peak), by address: its live
    blocks and its free pieces. See :class:`SegmentState`."""
    return _segment_states(data, data._at(at))[0]


def _segment_states(data: SnapshotData, p: int) -> tuple[tuple[SegmentState, ...], bool]:
    """The segments at position ``p`` and whether every live block's size was exact."""
    ranges = _replay.Ranges()
    for a, size, stream, mapped in data.initial_segments:
        ranges.add(a, size, stream, mapped)
    for k in range(len(data.seg_at)):
        if data.seg_at[k] > p:
            break
        ranges.apply(data.seg_kind[k], data.seg_addr[k], data.seg_size[k], data.seg_stream[k])
    t = _cols(data)
    idx = torch.nonzero(_live_mask(t, p)).flatten()
    exact_size = t["alloc_block_size"][idx]
    rounded = (t["alloc_size"][idx] + 511) // 512 * 512
    rounded = torch.where(rounded == 0, 512, rounded)
    # a block's exact size is known only for allocations still alive at the end
    alive_end = t["alloc_free_at"][idx] < 0
    bsize = torch.where((exact_size >= 0) & alive_end, exact_size, rounded)
    exact = bool(((exact_size >= 0) & alive_end).all().item()) if idx.numel() else True
    blocks = sorted(zip(t["alloc_addr"][idx].tolist(), bsize.tolist(), t["alloc_size"][idx].tolist(), strict=True))
    out = []
    bi = 0
    for start, end, stream, is_mapped in ranges.items:
        while bi < len(blocks) and blocks[bi][0] < start:
            bi += 1
        cur = start
        j = bi
        pieces: list[tuple[int, int]] = []
        n_live = live = 0
        while j < len(blocks) and blocks[j][0] < end:
            a, s, req = blocks[j]
            if a > cur:
                pieces.append((cur, a - cur))
            cur = max(cur, a + s)
            n_live += 1
            live += req
            j += 1
        if end > cur:
            pieces.append((cur, end - cur))
        out.append(SegmentState(address=start, size=end - start, stream=stream, expandable=bool(is_mapped),
                                live_blocks=n_live, live_bytes=live, free_pieces=tuple(pieces)))
    return tuple(out), exact


@_replay.on_one_thread
def fragmentation(data: SnapshotData, at: int | None = None) -> Fragmentation:
    """Reserved memory at ``at`` (default: the OOM, else the peak): allocated vs reserved, the
    free pieces inside segments, and whether the OOM's request failed for want of a large
    enough piece (fragmentation) or of bytes (capacity). See :class:`Fragmentation`."""
    p = data._at(at)
    segs, exact = _segment_states(data, p)
    largest: dict[int, int] = {}
    pieces = free = 0
    for g in segs:
        pieces += len(g.free_pieces)
        free += g.free_bytes
        if g.free_pieces:
            largest[g.stream] = max(largest.get(g.stream, 0), g.largest_free)
    allocated = data.live_bytes(p)
    reserved = sum(g.size for g in segs)
    oom = next((o for o in data.ooms if o.at == p), None)
    request = oom.requested if oom is not None else None
    on_stream = largest.get(oom.stream, 0) if oom is not None else None
    largest_any = max(largest.values(), default=0)
    if oom is None or request is None:
        cause = OomCause.NO_REQUEST
    elif (on_stream or 0) >= request:
        cause = OomCause.FITS
    elif free >= request:
        cause = OomCause.FRAGMENTATION
    else:
        cause = OomCause.CAPACITY
    return Fragmentation(
        at=p, allocated=allocated, reserved=reserved, unallocated=reserved - allocated,
        largest_free=largest_any, largest_free_on_stream=on_stream, free_pieces=pieces,
        segments=len(segs), request=request, stream=None if oom is None else oom.stream,
        device_free=None if oom is None else oom.device_free, cause=cause, exact=exact, free_bytes=free,
    )


@dataclass(frozen=True)
class LiveBlocksOverTime:
    """The largest live blocks at each of several moments, for a view that steps through them.

    ``blocks[k]`` are allocation indices (rows of :class:`SnapshotData`'s ``alloc_*`` columns)
    alive at ``positions[k]``, largest first (ties: the earlier allocation first), at most
    ``limit`` of them; ``counts[k]`` how many blocks were alive then in all.
    """

    positions: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    limit: int


@_replay.on_one_thread
def largest_live_blocks(data: SnapshotData, positions: Sequence[int], limit: int = 20) -> LiveBlocksOverTime:
    """The ``limit`` largest allocations alive at each position (exact; see
    :class:`LiveBlocksOverTime`): :func:`live_blocks` for many moments at once."""
    if limit < 1:
        raise GradscopeError("gradscope: largest_live_blocks needs limit >= 1.")
    pos = [data._at(p) for p in positions]
    t = _cols(data)
    n = data.allocations
    blocks: list[tuple[int, ...]] = []
    counts: list[int] = []
    if n == 0:
        return LiveBlocksOverTime(tuple(pos), tuple(() for _ in pos), tuple(0 for _ in pos), limit)
    # one key orders by size, then by index (earlier first), so that ties are deterministic
    index = torch.arange(n, dtype=torch.int64)
    key = t["alloc_size"] * n + (n - 1 - index)
    alloc_at, free_at = t["alloc_at"], t["alloc_free_at"]
    k = min(limit, n)
    # see NOTE [ one thread for the tables ]: rows of positions at a time, a few million cells each
    rows = max(1, (1 << 22) // n)
    pos_t = torch.tensor(pos, dtype=torch.int64)
    for chunk in pos_t.split(rows):
        c = chunk[:, None]
        live = (alloc_at[None, :] <= c) & ((free_at[None, :] < 0) | (free_at[None, :] > c))
        counts.extend(live.sum(1).tolist())
        top = torch.where(live, key[None, :], -1).topk(k, dim=1)
        for vals, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            blocks.append(tuple(i for v, i in zip(vals, idx, strict=True) if v >= 0))
    return LiveBlocksOverTime(tuple(pos), tuple(blocks), tuple(counts), limit)


@_replay.on_one_thread
def memory_by_group(data: SnapshotData, group: str = "line", top: int = 8, points: int = 1000) -> GroupTimeline:
    """Allocated bytes over the trace by frame group, for a stacked chart: ``points`` evenly
    spaced positions plus the peak and every OOM (exact at each). The ``top`` groups are those
    holding most at the peak (OOM when there is one); the rest is ``"(other)"``."""
    _check_group(group)
    if top < 1 or points < 2:
        raise GradscopeError("gradscope: memory_by_group needs top >= 1 and points >= 2.")
    t = _cols(data)
    of_stack, names, _ = _stack_groups(data, group)
    g_all = of_stack[t["alloc_stack"]]
    ranked = [r.key for r in bytes_by_line(data, data.default_at, group)]
    chosen = ranked[:top] if len(ranked) > top else ranked
    if len(chosen) < top:  # fill with groups that never peak together: by total bytes allocated
        total = torch.zeros(len(names), dtype=torch.int64).index_add_(0, g_all, t["alloc_size"])
        for g in torch.argsort(total, descending=True, stable=True).tolist():
            if len(chosen) >= top or total[g] == 0:
                break
            if names[g] not in chosen:
                chosen.append(names[g])
    return timeline_of_groups(data, group, g_all, names, chosen, points)


def timeline_of_groups(data: SnapshotData, group: str, of_alloc: torch.Tensor, names: Sequence[str],
                       chosen: Sequence[str], points: int) -> GroupTimeline:
    """The :class:`GroupTimeline` of any grouping of the allocations: ``of_alloc[i]`` indexes
    ``names`` for allocation ``i``; the groups ``chosen`` get a row each, the rest "(other)".
    Samples as in :func:`memory_by_group`."""
    n = data.events
    base = torch.linspace(0, max(n - 1, 0), steps=min(points, max(n, 1))).round().to(torch.int64)
    extra = torch.tensor([-1, data.peak_at] + [o.at for o in data.ooms], dtype=torch.int64)
    pos = torch.unique(torch.cat([base, extra]))
    t = _cols(data)
    g_all = of_alloc
    chosen = list(chosen)
    slot = torch.full((len(names),), len(chosen), dtype=torch.int64)
    for i, name in enumerate(chosen):
        slot[names.index(name)] = i
    rows = len(chosen) + 1
    P = int(pos.numel())
    start = torch.searchsorted(pos, t["alloc_at"], right=False)
    free = t["alloc_free_at"]
    end = torch.where(free < 0, torch.full_like(free, P), torch.searchsorted(pos, free, right=False))
    row = slot[g_all]
    diff = torch.zeros(rows, P + 1, dtype=torch.int64)
    diff.index_put_((row, start), t["alloc_size"], accumulate=True)
    diff.index_put_((row, end), -t["alloc_size"], accumulate=True)
    grid = torch.cumsum(diff, 1)[:, :P]
    has_other = bool(grid[-1].any().item())
    groups = tuple(chosen) + (("(other)",) if has_other else ())
    grid = grid if has_other else grid[:-1]
    sign = torch.where(t["seg_kind"] % 2 == 0, 1, -1)
    seg_slot = torch.searchsorted(pos, t["seg_at"], right=False)
    rdiff = torch.zeros(P + 1, dtype=torch.int64).index_add_(0, seg_slot, t["seg_size"] * sign)
    reserved = data.initial_reserved + torch.cumsum(rdiff, 0)[:P]
    pos_l = pos.tolist()
    return GroupTimeline(
        group=group, positions=tuple(pos_l),
        t_s=None if data.time_us is None else tuple(_t_of(data, q) for q in pos_l),
        groups=groups, bytes=tuple(tuple(r) for r in grid.tolist()),
        total=tuple(grid.sum(0).tolist()) if len(groups) else tuple(0 for _ in pos_l),
        reserved=tuple(reserved.tolist()),
    )
