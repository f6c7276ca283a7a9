"""Open the CUDA memory snapshots users already have (``torch.cuda.memory._dump_snapshot``).

``gs.load_snapshot(path)`` reads a snapshot pickle without letting it run anything (see NOTE
[ a plain-data unpickler ] in ``gradscope._analyses.snapshot.unpickle``), replays one device's allocator
trace exactly, and returns a :class:`SnapshotRecording` (a
:class:`~gradscope.recording.Recording` of its own type) whose timeline is the allocated (and
reserved) bytes over the trace. Everything the trace knows about each allocation (size, stream,
when it was made and freed, its Python frames) is kept in a :class:`SnapshotData`, its ``data``
field (also :func:`snapshot_data`); the pure functions below answer questions about any moment:
what was live and from which line, what each block was for (its role: parameters, activations,
gradients, optimizer state, temporaries; see :mod:`gradscope._analyses.snapshot.roles`), the trace's passes
and steps, how fragmented the reserved memory was, which memory grows from one step to the next.

Positions: every moment is a position in the device's trace, ``0 .. events - 1``; "at position
p" means after the trace's event ``p`` (``-1``: before its first event). ``at=None`` means the
out-of-memory failure when the trace has one, else the peak.

Example:
    >>> import gradscope as gs
    >>> from gradscope.snapshot import bytes_by_line, snapshot_data
    >>> frames = [{"filename": "/home/u/train.py", "line": 57, "name": "train_step"}]
    >>> trace = [{"action": "alloc", "addr": i << 21, "size": 2 << 20, "stream": 0, "frames": frames}
    ...          for i in range(40)]
    >>> seg = {"device": 0, "address": 0, "total_size": 80 << 20, "stream": 0,
    ...        "blocks": [{"address": i << 21, "size": 2 << 20, "requested_size": 2 << 20,
    ...                    "state": "active_allocated", "frames": frames} for i in range(40)]}
    >>> rec = gs.load_snapshot({"segments": [seg], "device_traces": [trace]})
    >>> type(rec).__name__, rec.peak_bytes, rec.where.memory_source
    ('SnapshotRecording', 83886080, 'cuda snapshot')
    >>> print(bytes_by_line(snapshot_data(rec))[0])
    train.py:57 train_step: 80.0 MiB in 40 blocks
"""

from __future__ import annotations

from gradscope._analyses.snapshot import data as _data
from gradscope._analyses.snapshot import frames as _frames
from gradscope._analyses.snapshot import queries as _queries
from gradscope._analyses.snapshot import reading as _reading
from gradscope._analyses.snapshot import roles as _roles
from gradscope._analyses.snapshot.data import *  # noqa: F403  (the snapshot's data and its recording, as listed there)
from gradscope._analyses.snapshot.findings import (
           SnapshotDiagnosis,
           SnapshotFinding,
           diagnose_snapshot,
           pageable_bytes,
)
from gradscope._analyses.snapshot.frames import *  # noqa: F403  (frames, the rows that hold them, groups)
from gradscope._analyses.snapshot.queries import *  # noqa: F403  (the questions asked of a snapshot's data)
from gradscope._analyses.snapshot.reading import *  # noqa: F403  (reading a snapshot, load_snapshot)
from gradscope._analyses.snapshot.roles import *  # noqa: F403  (roles, passes, steps, accumulating memory)

__all__ = [*_data.__all__, *_frames.__all__, *_reading.__all__, *_queries.__all__, *_roles.__all__,
           "SnapshotDiagnosis", "SnapshotFinding", "diagnose_snapshot", "pageable_bytes"]
