"""Reading a CUDA memory snapshot (``torch.cuda.memory._snapshot()``, its pickle read without running
any of it, or its dict) into :class:`~gradscope._analyses.snapshot.data.SnapshotData` and a
:class:`~gradscope._analyses.snapshot.data.SnapshotRecording` of one device or of each.
:mod:`gradscope.snapshot` is their face."""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Mapping
from typing import Any

import torch

from gradscope._analyses.snapshot import replay as _replay
from gradscope._analyses.snapshot.data import SnapshotData, SnapshotRecording, to_recording
from gradscope._analyses.snapshot.frames import Frame, Oom
from gradscope._analyses.snapshot.replay import Annotation
from gradscope._analyses.snapshot.unpickle import load_plain
from gradscope._base.errors import GradscopeError
from gradscope._base.gc import paused
from gradscope._model.recording import format_bytes

__all__ = [
    "load_snapshot",
    "load_snapshot_devices",
    "read_snapshot",
]


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
