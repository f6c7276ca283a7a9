"""What held memory at the peak or at the failure: a pass over the allocation table.

NOTE [ what is live at the failing moment ]: the allocation table says, for every allocation
made inside the block, when it was made and freed. The allocations alive at the peak (or, when an
out-of-memory stopped the block, after the last event before the refused allocation, which was
never recorded) are what held the memory then. The exception unwinding frees what only its frames
held (a list comprehension's list), so a source that refuses allocations itself (a budget) says
how many events it had recorded then; for a real out-of-memory the last event is the moment. Each is described by what the recording knows
about it: a saved tensor (node, module, order, attribute), a gradient, optimizer state, something
made during backward, or a forward result no node saved (held by a variable, or a temporary).
Only numbers and names: read by ``gs.diagnose``.
"""

from __future__ import annotations

from collections.abc import Mapping

from gradscope._model.recording import (
    Allocation,
    Category,
    HeldAllocation,
    HeldMemory,
    Node,
    SavedTensor,
    Step,
    Table,
)

__all__: list[str] = []

_MAX_ROWS = 500  # rows kept (largest first); the rest is summed by kind and module

_WHAT = {
    Category.GRADIENT: "gradient",
    Category.OPTIMIZER: "optimizer",
    Category.BACKWARD_TEMP: "backward",
}


def held_pass(nodes: Table[Node], steps: Table[Step], allocations: Table[Allocation], saved: Table[SavedTensor],
              saved_by_alloc: Mapping[int, int], key_kind: str, *, failed: bool,
              peak_position: int | None, n_events: int) -> HeldMemory | None:
    """The :class:`HeldMemory` of a recording (see NOTE [ what is live at the failing moment ]).
    ``saved_by_alloc`` maps an allocation to the first saved tensor (row of ``saved``) it holds.
    Reads the tables' columns: only the rows it keeps are made."""
    if not len(allocations):
        return None
    moment = n_events - 1 if failed else peak_position
    if moment is None:
        return None
    at, free, keys = allocations.column("alloc_at"), allocations.column("free_at"), allocations.column("key")
    alive = [i for i in range(len(allocations))
             if at[i] <= moment and ((f := free[i]) is None or f > moment)]
    alive_keys = {keys[i] for i in alive}
    # Keys allocated again after the moment now name other storages: the diagnosis must not match
    # them with the user's live tensors.
    reused = {keys[i] for i in range(len(allocations)) if at[i] > moment and keys[i] in alive_keys}
    nbytes, labels = allocations.column("bytes"), allocations.column("label")
    cats, mods, a_step = allocations.column("category"), allocations.column("module"), allocations.column("step")
    step_node = steps.column("node")
    n_name, n_order, n_module = nodes.column("name"), nodes.column("order"), nodes.column("module")
    # Rows are made for the largest allocations only; the rest is summed from the columns.
    alive.sort(key=lambda i: (-nbytes[i], keys[i]))
    kept, rest = alive[:_MAX_ROWS], alive[_MAX_ROWS:]
    s_node, s_shape, s_dtype = saved.column("node"), saved.column("shape"), saved.column("dtype")
    s_kind, s_attr = saved.column("kind"), saved.column("attribute")
    rows: list[HeldAllocation] = []
    for i in kept:
        k = saved_by_alloc.get(i)
        if k is not None:
            node = s_node[k]
            rows.append(HeldAllocation(
                key=keys[i], bytes=nbytes[i], label=labels[i], what="saved", allocation=i, node=node,
                node_name=n_name[node], order=n_order[node], module=n_module[node], shape=s_shape[k],
                dtype=s_dtype[k], saved_kind=s_kind[k].value, attribute=s_attr[k], reused=keys[i] in reused,
            ))
        else:
            what = _WHAT.get(cats[i], "backward" if a_step[i] is not None else "forward")
            st = a_step[i]
            node = step_node[st] if st is not None and st < len(steps) else None
            rows.append(HeldAllocation(
                key=keys[i], bytes=nbytes[i], label=labels[i], what=what, allocation=i, node=node,
                node_name=None if node is None else n_name[node], order=None if node is None else n_order[node],
                module=mods[i], reused=keys[i] in reused,
            ))
    rest_what: dict[str, int] = {}
    rest_module: dict[str, int] = {}
    for i in rest:
        k = saved_by_alloc.get(i)
        if k is not None:
            what = "saved" if n_order[s_node[k]] == 0 else "saved_order1"
            module = n_module[s_node[k]]
        else:
            what = _WHAT.get(cats[i], "backward" if a_step[i] is not None else "forward")
            module = mods[i]
        rest_what[what] = rest_what.get(what, 0) + nbytes[i]
        m = module or "(no module)"
        rest_module[m] = rest_module.get(m, 0) + nbytes[i]
    rest_bytes = sum(nbytes[i] for i in rest)
    return HeldMemory(
        moment="failure" if failed else "peak",
        live_bytes=sum(r.bytes for r in rows) + rest_bytes,
        key_kind=key_kind,
        rows=tuple(rows),
        omitted=len(rest),
        omitted_bytes=rest_bytes,
        omitted_by_kind=tuple(rest_what.items()),
        omitted_by_module=tuple(rest_module.items()),
    )
