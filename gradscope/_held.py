"""What held memory at the peak or at the failure: a pass over the allocation table.

NOTE [ what is live at the failing moment ]: the allocation table says, for every allocation
made inside the block, when it was made and freed. The allocations alive at the peak (or, when an
out-of-memory stopped the block, after the last event: the failing allocation itself was refused
and never recorded) are what held the memory then. Each is described by what the recording knows
about it: a saved tensor (node, module, order, attribute), a gradient, optimizer state, something
made during backward, or a forward result no node saved (held by a variable, or a temporary).
Only numbers and names: read by ``gs.diagnose``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradscope.recording import Allocation, Category, Held, HeldAllocation, Node, SavedTensor, Step

__all__: list[str] = []

_MAX_ROWS = 500  # rows kept (largest first); the rest is summed by kind and module

_WHAT = {
    Category.GRADIENT: "gradient",
    Category.OPTIMIZER: "optimizer",
    Category.BACKWARD_TEMP: "backward",
}


def held_pass(nodes: Sequence[Node], steps: Sequence[Step], allocations: Sequence[Allocation],
              saved_by_alloc: Mapping[int, SavedTensor], key_kind: str, *, failed: bool,
              peak_position: int | None, n_events: int) -> Held | None:
    """The :class:`Held` of a recording (see NOTE [ what is live at the failing moment ])."""
    if not allocations:
        return None
    moment = n_events - 1 if failed else peak_position
    if moment is None:
        return None
    alive = [a for a in allocations if a.alloc_at <= moment and (a.free_at is None or a.free_at > moment)]
    alive_keys = {a.key for a in alive}
    # Keys allocated again after the moment now name other storages: the diagnosis must not match
    # them with the user's live tensors.
    reused = {a.key for a in allocations if a.alloc_at > moment and a.key in alive_keys}
    rows: list[HeldAllocation] = []
    for a in alive:
        s = saved_by_alloc.get(a.index)
        if s is not None:
            node = nodes[s.node]
            rows.append(HeldAllocation(
                key=a.key, bytes=a.bytes, label=a.label, what="saved", allocation=a.index, node=node.id,
                node_name=node.name, order=node.order, module=node.module, shape=s.shape, dtype=s.dtype,
                saved_kind=s.kind.value, attribute=s.attribute, reused=a.key in reused,
            ))
        else:
            what = _WHAT.get(a.category, "backward" if a.step is not None else "forward")
            made_by = nodes[steps[a.step].node] if a.step is not None and a.step < len(steps) else None
            rows.append(HeldAllocation(
                key=a.key, bytes=a.bytes, label=a.label, what=what, allocation=a.index,
                node=None if made_by is None else made_by.id,
                node_name=None if made_by is None else made_by.name,
                order=None if made_by is None else made_by.order, module=a.module, reused=a.key in reused,
            ))
    rows.sort(key=lambda r: (-r.bytes, r.key))
    kept, rest = rows[:_MAX_ROWS], rows[_MAX_ROWS:]
    rest_what: dict[str, int] = {}
    rest_module: dict[str, int] = {}
    for r in rest:
        kind = r.what if r.what != "saved" or (r.order or 0) == 0 else "saved_order1"
        rest_what[kind] = rest_what.get(kind, 0) + r.bytes
        m = r.module or "(no module)"
        rest_module[m] = rest_module.get(m, 0) + r.bytes
    return Held(
        moment="failure" if failed else "peak",
        live_bytes=sum(r.bytes for r in rows),
        key_kind=key_kind,
        rows=tuple(kept),
        omitted=len(rest),
        omitted_bytes=sum(r.bytes for r in rest),
        omitted_by_kind=tuple(rest_what.items()),
        omitted_by_module=tuple(rest_module.items()),
    )
