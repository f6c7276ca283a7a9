"""What the widget and the self-contained page draw for a CUDA memory snapshot (``kind: "snapshot"``).

NOTE [ a bounded snapshot payload ]: a snapshot of a long run has a million trace events and
hundreds of thousands of allocations; the page must open it in a browser without a kernel. So
the payload never carries the trace or the allocation table. It carries:
- memory over time by frame group (``memory_by_group``) at about ``points`` moments (evenly
  spaced trace positions plus the peak and every OOM), for each grouping the view offers (line,
  function, file): the top ``top`` groups and "(other)", exact at every moment, with the
  reserved bytes; and by role (``memory_by_role``: every role, at the same moments);
- at each of those moments, the ``blocks`` largest live blocks (``largest_live_blocks``) and how
  many were live in all; the blocks' rows (size, stream, address, allocated and freed at, role)
  are sent once however many moments show them, with their stacks and frames interned (a frame
  says whether it is folded: PyTorch's, the standard library's or an installed package's);
- the diagnosis (``gs.diagnose``), its findings and the figures it used.
Its size is thus bounded by ``points x (groups x top + blocks)`` numbers and the stacks of the
blocks shown: about 600 KiB for a 1 M-event trace (``benchmarks/bench_snapshot_view.py`` measures
it), whatever the trace's length. A moment between two samples is not shown in the page; from
Python, ``live_blocks(data, at)`` answers any position exactly.
"""

from __future__ import annotations

import math
from typing import Any

from gradscope._analyses.snapshot.data import SnapshotData, snapshot_data
from gradscope._analyses.snapshot.findings import diagnose_snapshot
from gradscope._analyses.snapshot.frames import group_of, is_user_frame
from gradscope._analyses.snapshot.queries import (
    GroupTimeline,
    bytes_by_line,
    largest_live_blocks,
    memory_by_group,
)
from gradscope._analyses.snapshot.roles import allocation_role, memory_by_role
from gradscope._base.series import Interner
from gradscope._model.recording import Recording

__all__ = ["SNAPSHOT_GROUPS", "snapshot_payload"]

SNAPSHOT_GROUPS = ("line", "function", "file")  # the groupings the view offers
_MAX_FRAMES = 48  # frames kept per stack (innermost first); deeper stacks say how many were cut


def _t(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), 7)


def snapshot_payload(rec: Recording, *, points: int = 1000, top: int = 8, blocks: int = 20,
                     version: int = 2) -> dict[str, Any]:
    """The front end's data for a recording made by ``gs.load_snapshot`` (see NOTE [ a bounded
    snapshot payload ])."""
    data = snapshot_data(rec)
    S: Interner[str] = Interner()  # see NOTE [ strings interned in one table ]
    timelines = {g: memory_by_group(data, g, top=top, points=points) for g in SNAPSHOT_GROUPS}
    timelines["role"] = memory_by_role(data, points=points)
    base = timelines["line"]
    live = largest_live_blocks(data, base.positions, blocks)
    rows: Interner[int] = Interner()  # allocation index -> row in the payload's block table
    moment_blocks = []
    for ids in live.blocks:
        moment_blocks.append([rows(i) for i in ids])
    block_rows = rows.table
    stacks: dict[int, int] = {}
    frames: dict[int, int] = {}
    stack_list: list[list[int]] = []
    frame_cols: dict[str, list[Any]] = {"file": [], "line": [], "name": [], "folded": []}

    def frame_id(f: int) -> int:
        k = frames.get(f)
        if k is None:
            fr = data.frames[f]
            k = frames[f] = len(frame_cols["line"])
            frame_cols["file"].append(S(fr.filename))
            frame_cols["line"].append(fr.line)
            frame_cols["name"].append(S(fr.name))
            frame_cols["folded"].append(not is_user_frame(fr))
        return k

    def stack_id(s: int) -> int:
        k = stacks.get(s)
        if k is None:
            k = stacks[s] = len(stack_list)
            stack_list.append([frame_id(f) for f in data.stacks[s][:_MAX_FRAMES]])
        return k

    table: dict[str, list[Any]] = {k: [] for k in ("size", "stream", "address", "alloc_at", "free_at", "stack",
                                                    "line", "depth", "role")}
    for i in block_rows:
        s = data.alloc_stack[i]
        table["size"].append(data.alloc_size[i])
        table["stream"].append(data.alloc_stream[i])
        table["address"].append(data.alloc_addr[i])
        table["alloc_at"].append(data.alloc_at[i])
        table["free_at"].append(data.alloc_free_at[i])
        table["stack"].append(stack_id(s))
        table["line"].append(S(group_of(data.stack_frames(s), "line")))
        table["depth"].append(len(data.stacks[s]))
        table["role"].append(S(allocation_role(data, i).label))
    groupings = {}
    for g, tl in timelines.items():
        groupings[g] = {"names": [S(n) for n in tl.groups], "bytes": [list(r) for r in tl.bytes]}
    d = diagnose_snapshot(rec)
    oom = data.oom
    default_k = base.positions.index(data.default_at) if data.default_at in base.positions else 0
    return {
        "version": version,
        "kind": "snapshot",
        "label": rec.label,
        "summary": _summary(rec, data),
        "strings": S.table,
        "positions": list(base.positions),
        "t": None if base.t_s is None else [_t(v) for v in base.t_s],
        "total": list(base.total),
        "reserved": list(base.reserved),
        "groupings": groupings,
        "group": "line",
        "top": top,
        "moments": {"blocks": moment_blocks, "counts": list(live.counts), "limit": blocks},
        "blocks": table,
        "stacks": stack_list,
        "frames": frame_cols,
        "peak": {"at": data.peak_at, "bytes": data.peak_bytes, "index": _index_of(base, data.peak_at)},
        "oom": None if oom is None else {
            "at": oom.at, "index": _index_of(base, oom.at), "requested": oom.requested,
            "device_free": oom.device_free, "stream": oom.stream, "allocated": oom.allocated,
            "reserved": oom.reserved, "line": group_of(oom.frames, "line") if oom.frames else None,
        },
        "ooms": [_index_of(base, o.at) for o in data.ooms],
        "default": default_k,
        "diagnosis": {
            "moment": d.moment,
            "at": d.at,
            "text": d.text(),
            "findings": [{"pattern": f.pattern, "bytes": f.bytes, "message": f.message, "suggestion": f.suggestion,
                          "role": None if f.role is None else f.role.label} for f in d.findings],
            "by_role": [[r.role.label, r.bytes, r.blocks] for r in d.by_role],
            "none": None if d.findings or d.moment == "empty" else d.why_no_finding(),
            "steps": None if d.steps is None else d.steps.how,
            "by_line": [[r.key, r.bytes, r.blocks] for r in bytes_by_line(data, d.at)[:top]]
            if d.moment != "empty" else [],
        },
        "notes": list(rec.notes),
    }


def _index_of(tl: GroupTimeline, at: int) -> int | None:
    try:
        return tl.positions.index(at)
    except ValueError:
        return None


def _summary(rec: Recording, data: SnapshotData) -> dict[str, Any]:
    return {
        "device": rec.where.device,
        "events": data.events,
        "allocations": data.allocations,
        "alive_at_end": sum(1 for f in data.alloc_free_at if f < 0),
        "peak_bytes": rec.peak_bytes,
        "reserved_peak_bytes": rec.reserved_peak_bytes,
        "duration_s": _t(rec.wall_time_s) if data.time_us is not None else None,
        "complete": rec.complete,
        "error": rec.error,
        "has_times": data.time_us is not None,
    }
