"""The data of a loaded CUDA memory snapshot (:class:`SnapshotData`, in columns: NOTE [ what is
kept ]) and the recording made from it (:class:`SnapshotRecording`, saved and loaded back as its
own type). Its frames are in :mod:`gradscope._analyses.snapshot.frames`, reading a snapshot into it in
:mod:`gradscope._analyses.snapshot.reading`, the questions asked of it in :mod:`gradscope._analyses.snapshot.queries`;
the public surface is :mod:`gradscope.snapshot`, which names these and the snapshot's diagnosis.
"""

from __future__ import annotations

import base64
import dataclasses
import operator
import sys
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradscope._analyses.snapshot import replay as _replay
from gradscope._analyses.snapshot.frames import Frame, Oom, TraceAllocation, _label_of
from gradscope._analyses.snapshot.replay import Annotation, EndBlock, EndSegment
from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._base.series import downsample
from gradscope._model.recording import MemoryPoint, Peak, Phase, Recording, Where, format_bytes

__all__ = [
    "EXTRA_KEY",
    "TIMELINE_POINTS",
    "Annotation",
    "EndBlock",
    "EndSegment",
    "SnapshotData",
    "SnapshotRecording",
    "from_saved",
    "snapshot_data",
    "timeline_positions",
    "to_recording",
]


EXTRA_KEY = "cuda_snapshot"  # where a saved recording keeps its SnapshotData (Recording.extra in a file)
TIMELINE_POINTS = 10_000  # at most this many points in Recording.timeline (see NOTE [ what is kept ])
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
# gradscope._base.registry) and gs.diagnose tests isinstance. Nothing reads where.memory_source to decide, and
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


_views.declare_saved(EXTRA_KEY, from_saved)  # NOTE [ saved types ] in gradscope._base.registry


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
                 "(NOTE [ what is kept ] in gradscope._analyses.snapshot.data).")
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


def _group_label(data: SnapshotData, stack: int, group: str) -> str:
    cache = data._cache.setdefault(f"labels:{group}", {})
    lab = cache.get(stack)
    if lab is None:
        lab = cache[stack] = _label_of(data.stack_frames(stack), group)
    return lab
