"""What held memory at the peak: collected by the recorder when a block ends, read by ``gs.diagnose``.

NOTE [ what is live at the failing moment ]: a memory source's events are allocations and frees in
order. Replaying them up to the peak (or, when a budget stopped the block, up to the last event:
the failing allocation itself was refused and never recorded) leaves the set of allocations made
inside the block that were still alive then. Each is matched with what the recorder knows about
it: a saved tensor (by storage key for the tracker, by address for the allocators), a gradient
made by an ``AccumulateGrad`` step, something made during backward, or a forward result that no
node saved (held by a variable, or a temporary). Only numbers and names go into the recording.
"""

from __future__ import annotations

from typing import Any

import torch

from gradscope.errors import MemoryBudgetExceeded
from gradscope.memory import TrackerSource

__all__: list[str] = []

_MAX_ROWS = 500  # rows kept (largest first); the rest is summed by kind and module


def collect(rec: Any) -> dict[str, Any]:
    """``Recording.extra`` entries for one finished ``gs.record`` (``rec`` is the recorder).

    Returns ``backward_calls`` always, ``oom`` when a simulated budget stopped the block, and
    ``held`` (see NOTE above) when the memory source produced events. Never raises.
    """
    out: dict[str, Any] = {"backward_calls": list(getattr(rec, "_bw_calls", []))}
    exc = getattr(rec, "_exc", None)
    if isinstance(exc, MemoryBudgetExceeded):
        out["oom"] = {
            "requested": int(exc.requested),
            "live": int(exc.live),
            "budget": int(exc.budget),
            "where": str(exc.where),
        }
    try:
        # A real CUDA out-of-memory is a failure too: its refused allocation is not in the events.
        held = _held(rec, failed=isinstance(exc, torch.OutOfMemoryError))
    except Exception as e:  # observing never breaks the recording
        held = {"error": repr(e)}
    if held:
        out["held"] = held
    return out


def _held(rec: Any, failed: bool) -> dict[str, Any] | None:
    src = rec._source
    events = list(getattr(src, "events", None) or [])
    if not events:
        return None
    live = peak = 0
    peak_i = -1
    for i, e in enumerate(events):
        live += e.size
        if live > peak:
            peak, peak_i = live, i
    end = len(events) - 1 if failed else peak_i
    alive: dict[int, Any] = {}
    last_free: dict[int, int] = {}
    born_after: dict[int, int] = {}  # key -> when its previous holder was freed
    for e in events[: end + 1]:
        if e.size > 0:
            alive[e.key] = e
            born_after[e.key] = last_free.get(e.key, -1)
        else:
            alive.pop(e.key, None)
            last_free[e.key] = e.t_ns
    # Keys allocated again after the moment now name other storages: the diagnosis must not
    # match them with the user's live tensors.
    reused = {e.key for e in events[end + 1 :] if e.size > 0 and e.key in alive}
    by_key = isinstance(src, TrackerSource)
    # Keys (storage objects' or blocks' addresses) are reused once freed: a save belongs to the
    # allocation that held its key when it was packed, i.e. it came after the key's previous free
    # (compared with the free, far from the save, rather than with the allocation next to it: the
    # profiler's clock and time.time_ns() can differ by microseconds).
    saved: dict[int, list[Any]] = {}
    for s in sorted((s for s in rec._saved if s.node is not None), key=lambda s: s.t_ns):
        saved.setdefault(s.skey if by_key else s.ptr, []).append(s)
    steps = rec._steps
    step_of_scope = rec._match_scopes(src.scopes) if getattr(src, "scopes", None) else {}
    rows: list[dict[str, Any]] = []
    for key, e in alive.items():
        step = e.step
        if step is None and e.eval_index is not None:
            step = step_of_scope.get(e.eval_index)
        node = steps[step].info if step is not None and step < len(steps) else None
        s = next((x for x in saved.get(key, ()) if x.t_ns > born_after[key]), None)
        row: dict[str, Any] = {"key": int(key), "bytes": int(e.size), "label": e.label}
        if key in reused:
            row["reused"] = True
        if s is not None:
            row.update(
                what="saved",
                node=s.node.id,
                node_name=s.node.name,
                order=s.node.order,
                module=s.node.module,
                shape=list(s.shape),
                dtype=s.dtype,
                saved_kind=rec._final_kind(s).value,
                attribute=s.attribute,
            )
        elif node is not None:
            row.update(
                what="gradient" if node.name == "AccumulateGrad" else "backward",
                node=node.id,
                node_name=node.name,
                order=node.order,
                module=node.module,
            )
        elif e.eval_index is not None:
            row.update(what="backward", module=None)
        else:
            row.update(what="forward", module=_forward_module(rec, e))
        rows.append(row)
    rows.sort(key=lambda r: (-r["bytes"], r["key"]))
    kept, rest = rows[:_MAX_ROWS], rows[_MAX_ROWS:]
    rest_what: dict[str, int] = {}
    rest_module: dict[str, int] = {}
    for r in rest:
        kind = r["what"] if r["what"] != "saved" or (r.get("order") or 0) == 0 else "saved_order1"
        rest_what[kind] = rest_what.get(kind, 0) + r["bytes"]
        m = r.get("module") or "(no module)"
        rest_module[m] = rest_module.get(m, 0) + r["bytes"]
    return {
        "moment": "failure" if failed else "peak",
        "live_bytes": sum(r["bytes"] for r in rows),
        "key_kind": "storage" if by_key else "address",
        "rows": kept,
        "omitted": len(rest),
        "omitted_bytes": sum(r["bytes"] for r in rest),
        "omitted_by_kind": rest_what,
        "omitted_by_module": rest_module,
    }


def _forward_module(rec: Any, e: Any) -> str | None:
    """The module call an allocation happened in (the recorder's own attribution)."""
    call = e.module_call
    if call is not None and call < len(rec._calls):
        return rec._call_path(rec._calls[call])
    return rec._modules_at([e.t_ns])[0]
