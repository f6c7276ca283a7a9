"""The diagnosed moment as the analysis reads it: the rows the recording held then, its backward
calls and the refused allocation, read in one place (``read``); what the user's variables hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._base import compat as _compat
from gradscope._base.errors import BudgetRefusal
from gradscope._model.recording import Recording

MAX_ITEMS = 10_000  # items looked at per container variable


MAX_NODES = 200_000  # graph nodes walked per variable


# ----------------------------------------------------------------------------------------------
# NOTE [ one accessor for what the recording held ]: everything the analysis knows about the
# diagnosed moment comes from `read`, which turns the recorder's data into the small frozen rows
# below. Today that data is `Recording.held` (the allocations alive at the moment),
# `Recording.backward_calls` and `Recording.oom`, read through their JSON forms; moving to the
# typed allocation table changes only `read`.
@dataclass(frozen=True)
class MomentRow:
    """One allocation made inside the block and alive at the diagnosed moment."""

    key: int  # storage key (tracker) or address (allocators), to match the user's live tensors
    bytes: int
    what: str  # "saved" | "gradient" | "backward" | "forward"
    module: str | None = None
    node_name: str | None = None
    order: int = 0
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    saved_kind: str = "activation"  # for saved rows: activation | parameter | input | buffer
    reused: bool = False  # the key was allocated again after the moment: never match it


@dataclass(frozen=True)
class Call:
    """One backward call made inside the block."""

    api: str  # "backward" | "autograd.grad"
    create_graph: bool
    retain_graph: bool


@dataclass(frozen=True)
class DiagnosedMoment:
    """The diagnosed moment, as `read` gives it to the analysis (see NOTE [ one accessor for what the recording held ])."""

    moment: str  # "failure" | "peak" | "none"
    live_bytes: int
    rows: tuple[MomentRow, ...]
    by_storage: bool  # keys are storage keys (tracker) rather than addresses
    omitted: int  # smaller rows not listed one by one, summed below
    omitted_by_kind: tuple[tuple[str, int], ...]
    omitted_by_module: tuple[tuple[str, int], ...]
    calls: tuple[Call, ...]
    budget: int | None = None
    requested: int | None = None
    where: str | None = None
    budget_resident: int = 0
    device: bool = False  # the budget counts what the user's variables held (see NOTE [ one budget ] in measure)
    error: str | None = None  # why the recorder could not list live tensors
    caught: bool = False  # the failure was caught inside the block (see `caught_oom`)


def caught_oom(rec: Recording) -> BudgetRefusal | None:
    """The first allocation the budget refused, when the block caught the error (``except
    torch.OutOfMemoryError: continue``, in a backward call or outside one) and did not fail itself:
    the diagnosis treats it as the block's failure, at the block's peak (the budget refused what
    would have crossed it, so the peak is the most the block held). The tracker's own refusal,
    kept as ``extra["caught_budget"]`` (see NOTE [ one refusal ] in gradscope._base.errors). None otherwise."""
    if rec.oom is not None or rec.error:
        return None
    caught = rec.extra.get("caught_budget") if isinstance(rec.extra, Mapping) else None
    return BudgetRefusal.from_dict(caught) if isinstance(caught, Mapping) else None


def resident_by_variable(ns: Mapping[str, Any], skip: set[int] | None = None,
                         device_type: str = "cpu") -> dict[str, int]:
    """Bytes of the distinct storages on ``device_type`` the user's variables reach (tensors, also
    inside lists, tuples and dicts; models' parameters, buffers and gradients; optimizers' state),
    each counted once, for the first variable (in the namespace's order) that reaches it; storages
    whose key is in ``skip`` are left out. On the CPU (the simulated device's tensors): what a
    notebook's ``--budget`` counts as held before a cell (see NOTE [ one budget ] in
    gradscope._analyses.diagnose.measure)."""
    seen: dict[int, tuple[str, int]] = {}
    name = ""

    def add(t: Any, with_grad: bool = False) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            return
        key = _compat.storage_key(t)
        if key is not None and key not in seen and (skip is None or key not in skip):
            try:
                seen[key] = (name, int(t.untyped_storage().nbytes()))
            except (RuntimeError, NotImplementedError):
                return
        # only a leaf has a .grad to count; reading it on another tensor makes PyTorch warn
        if with_grad and t.is_leaf:
            add(t.grad)

    for name, v in list(ns.items()):
        if not isinstance(name, str) or name.startswith("_") or name in ("In", "Out"):  # (IPython's history)
            continue
        if isinstance(v, nn.Module):
            for t in (*v.parameters(), *v.buffers()):
                add(t, with_grad=True)
        elif isinstance(v, torch.optim.Optimizer):
            for state in v.state.values():
                for t in state.values() if isinstance(state, Mapping) else ():
                    add(t)
        elif isinstance(v, torch.Tensor):
            add(v, with_grad=True)
        elif isinstance(v, list | tuple | dict):
            try:
                stack, looked = [v], 0
                while stack and looked < MAX_ITEMS:  # containers of containers (a list of (x, y) batches)
                    c = stack.pop()
                    for t in list(c.values() if isinstance(c, dict) else c)[:MAX_ITEMS]:
                        looked += 1
                        if isinstance(t, list | tuple | dict):
                            stack.append(t)
                        else:
                            add(t)
            except Exception:
                continue
    out: dict[str, int] = {}
    for holder, n in seen.values():
        out[holder] = out.get(holder, 0) + n
    return out


def read(rec: Recording) -> DiagnosedMoment:
    """The one place that reads the recorder's data about the diagnosed moment."""
    held = rec.held.to_dict() if rec.held is not None else {}
    caught = caught_oom(rec)
    refusal = rec.oom if rec.oom is not None else caught
    oom = refusal.to_dict() if refusal is not None else {}
    moment = held.get("moment", "none") if "rows" in held else "none"
    if oom:
        moment = "failure"  # even when it failed before anything was allocated
    rows = tuple(
        MomentRow(
            key=int(r["key"]),
            bytes=int(r["bytes"]),
            what=str(r.get("what", "forward")),
            module=r.get("module"),
            node_name=r.get("node_name"),
            order=int(r.get("order") or 0),
            shape=None if r.get("shape") is None else tuple(int(d) for d in r["shape"]),
            dtype=r.get("dtype"),
            saved_kind=str(r.get("saved_kind") or "activation"),
            reused=bool(r.get("reused")),
        )
        for r in held.get("rows", ())
    )
    calls = tuple(
        Call(c.api, c.create_graph, c.retain_graph)
        for c in rec.backward_calls
    )
    return DiagnosedMoment(
        moment=moment,
        live_bytes=int(held.get("live_bytes", 0)),
        rows=rows,
        by_storage=held.get("key_kind", "storage") == "storage",
        omitted=int(held.get("omitted", 0)),
        omitted_by_kind=tuple((str(k), int(b)) for k, b in (held.get("omitted_by_kind") or {}).items()),
        omitted_by_module=tuple((str(k), int(b)) for k, b in (held.get("omitted_by_module") or {}).items()),
        calls=calls,
        budget=oom.get("budget"),
        requested=oom.get("requested"),
        where=oom.get("where"),
        budget_resident=int(oom.get("resident", 0)),
        device=oom.get("cell_budget") is not None,
        error=held.get("error"),
        caught=caught is not None,
    )
