"""What the diagnosis reads: the recording's held rows, its graph and allocation table, and the user's variables."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._analyses.diagnose.report import KIND_NAMES, GraphHolder, LiveTensor
from gradscope._analyses.diagnose.step import inline
from gradscope._base import compat as _compat
from gradscope._base.errors import BudgetRefusal
from gradscope._base.source import step_source
from gradscope._model.recording import Allocation, BackwardCall, Category, Kind, Phase, Recording

_MAX_ITEMS = 10_000  # items looked at per container variable


_MAX_NODES = 200_000  # graph nodes walked per variable


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


def resident_by_variable(ns: Mapping[str, Any], skip: set[int] | None = None) -> dict[str, int]:
    """Bytes of the distinct CPU and CUDA storages the user's variables reach (tensors, also inside
    lists, tuples and dicts; models' parameters, buffers and gradients; optimizers' state), each
    counted once, for the first variable (in the namespace's order) that reaches it; storages whose
    key is in ``skip`` are left out. What a notebook's ``--budget`` counts as held before a cell
    (see NOTE [ one budget ] in gradscope._analyses.diagnose.measure)."""
    seen: dict[int, tuple[str, int]] = {}
    name = ""

    def add(t: Any, with_grad: bool = False) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":  # the simulated device's tensors
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
                while stack and looked < _MAX_ITEMS:  # containers of containers (a list of (x, y) batches)
                    c = stack.pop()
                    for t in list(c.values() if isinstance(c, dict) else c)[:_MAX_ITEMS]:
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


# ----- what the findings read from the recording ----------------------------------------------------
MIN_SAVING = 0.1  # a fix that saves less than this share of the peak is not suggested


CHUNKS = 8  # micro-batches suggested for one large batch


GRAPH_CATEGORIES = (Category.ACTIVATION, Category.CREATE_GRAPH, Category.BACKWARD_TEMP)


# Operations that combine per-input terms linearly: a loss made only of these is a sum (or mean)
# of the terms, whose gradient a backward per micro-batch accumulates exactly.
LINEAR_MERGES = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SumBackward0", "SumBackward1", "MeanBackward0",
    "MeanBackward1", "DivBackward0", "DivBackward1", "MulBackward1", "StackBackward0", "CatBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ViewBackward0", "UnsafeViewBackward0",
    "ExpandBackward0", "SelectBackward0", "CloneBackward0",
})


class IndexedRecording:
    """The recording's graph and allocation table, indexed for the findings (see NOTE [ findings
    are measured fixes ]). Walks are iterative: graphs may be deep."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.nodes = rec.nodes
        self.calls = tuple(c for c in rec.backward_calls if c.observed)
        self.top = [top_of(n.module) for n in self.nodes]
        self.next: list[list[int]] = [[] for _ in self.nodes]
        for e in rec.edges:
            if 0 <= e.dst < len(self.next):
                self.next[e.dst].append(e.src)
        allocs = rec.allocations
        self.alive: tuple[Allocation, ...] = ()
        if len(allocs):
            if rec.oom is not None or rec.error is not None:
                last = max(max(a.alloc_at, a.free_at or 0) for a in allocs)
                live = [a for a in allocs if a.free_at is None or a.free_at > last]
                self.alive = tuple(live) if rec.oom is not None else rec.alive_at_peak()
            else:
                self.alive = rec.alive_at_peak()
        self.calls_of_node: dict[int, list[int]] = {}
        steps = rec.steps
        for c in self.calls:
            if c.first_step is None or c.last_step is None:
                continue
            for s in range(c.first_step, min(c.last_step, len(steps) - 1) + 1):
                self.calls_of_node.setdefault(steps[s].node, []).append(c.index)

    # ----- nodes and calls -------------------------------------------------------------------
    def leaf_name(self, node: int) -> str | None:
        return self.nodes[node].leaf if 0 <= node < len(self.nodes) else None

    def param_inputs(self, c: BackwardCall) -> bool:
        """Whether a call differentiated (or accumulated) anything but input leaves."""
        for i in (*c.inputs, *c.accumulated):
            n = self.nodes[i] if 0 <= i < len(self.nodes) else None
            if n is None or n.name != "AccumulateGrad" or n.leaf != "input":
                return True
        return False

    def order1_executed(self) -> bool:
        return any(n.order >= 1 and n.executed > 0 for n in self.nodes)

    def trainable(self, root: str) -> bool:
        """Whether the graph has leaves among ``root``'s parameters (they require grad)."""
        return any(n.name == "AccumulateGrad" and n.leaf and n.leaf != "input" and top_of(n.leaf) == root
                   for n in self.nodes)

    def asked_roots(self) -> set[str]:
        """Roots whose parameters an ``inputs=`` of a backward call named."""
        out = set()
        for c in self.calls:
            for i in c.inputs:
                leaf = self.leaf_name(i)
                if leaf and leaf != "input" and top_of(leaf):
                    out.add(top_of(leaf) or "")
        return out

    def differentiated_roots(self) -> set[str]:
        """Roots whose parameters a backward call differentiated (named them in ``inputs=`` or
        accumulated into their ``.grad``)."""
        out = set()
        for c in self.calls:
            for i in (*c.inputs, *c.accumulated):
                leaf = self.leaf_name(i)
                if leaf and leaf != "input" and top_of(leaf):
                    out.add(top_of(leaf) or "")
        return out

    def main_root(self, order: int = 0) -> str | None:
        """The root module holding the most at the diagnosed moment (else with the most nodes)."""
        per: dict[str, int] = {}
        for a in self.alive:
            r = top_of(a.module)
            if r:
                per[r] = per.get(r, 0) + a.bytes
        if not per:
            for n, t in zip(self.nodes, self.top, strict=True):
                if t and n.order == order:
                    per[t] = per.get(t, 0) + 1
        return min(per.items(), key=lambda kv: (-kv[1], kv[0]))[0] if per else None

    def calls_of(self, root: str | None) -> tuple[int, list[int]]:
        """How many times ``root`` ran forward (the most common count of its (module, op) node
        groups) and one node per call (an entry of each call's subgraph)."""
        groups: dict[tuple[str, str], list[int]] = {}
        for i, node in enumerate(self.nodes):
            if root and self.top[i] == root and node.order == 0 and node.name != "AccumulateGrad":
                groups.setdefault((node.module or "", node.name), []).append(i)
        if not groups:
            return 0, []
        counts: dict[int, int] = {}
        for ids in groups.values():
            counts[len(ids)] = counts.get(len(ids), 0) + 1
        n = min(counts.items(), key=lambda kv: (-kv[1], -kv[0]))[0]
        entry = min((ids for ids in groups.values() if len(ids) == n), key=lambda ids: ids[0])
        return n, entry

    def merge_names(self, entries: list[int]) -> set[str]:
        """Names of the nodes outside the model that combine the outputs of two or more of its
        calls (``entries``: one node per call)."""
        if len(entries) < 2 or len(self.nodes) > _MAX_NODES:
            return set()
        bit = {e: 1 << k for k, e in enumerate(entries)}
        mask = [0] * len(self.nodes)
        done = [False] * len(self.nodes)
        for start in range(len(self.nodes)):
            if done[start]:
                continue
            stack: list[tuple[int, bool]] = [(start, False)]
            while stack:
                v, post = stack.pop()
                if post:
                    m = bit.get(v, 0)
                    for s in self.next[v]:
                        m |= mask[s]
                    mask[v] = m
                    done[v] = True
                    continue
                if done[v]:
                    continue
                stack.append((v, True))
                stack.extend((s, False) for s in self.next[v] if not done[s])
        root = self.top[entries[0]]
        return {self.nodes[i].name for i in range(len(self.nodes))
                if self.top[i] != root and mask[i] & (mask[i] - 1)}

    def nodes_run_by(self, calls: list[BackwardCall]) -> set[int]:
        ids = {c.index for c in calls}
        return {n for n, cs in self.calls_of_node.items() if ids.intersection(cs)}

    def never_run_saving_nodes(self) -> set[int]:
        """Forward nodes that saved tensors and that no backward ever ran."""
        saving = {a.node for a in self.rec.allocations if a.node is not None}
        return {i for i in saving if 0 <= i < len(self.nodes) and self.nodes[i].order == 0
                and self.nodes[i].executed == 0}

    def call_end_positions(self) -> dict[int, int]:
        """The event position at which each backward call made its last allocation."""
        out: dict[int, int] = {}
        for c in self.calls:
            if c.first_step is None or c.last_step is None:
                continue
            ends = [a.alloc_at for a in self.rec.allocations
                    if a.step is not None and c.first_step <= a.step <= c.last_step]
            if ends:
                out[c.index] = max(ends)
        return out

    def live_before(self, root: str | None) -> int:
        """Bytes allocated inside the block and alive just before ``root``'s first allocation."""
        firsts = [a.alloc_at for a in self.rec.allocations if top_of(a.module) == root]
        if not firsts:
            return 0
        t = min(firsts)
        return sum(a.bytes for a in self.rec.allocations if a.alloc_at < t and (a.free_at is None or a.free_at > t))

    # ----- shapes --------------------------------------------------------------------------------
    def input_shapes(self, root: str | None) -> set[tuple[int, ...]]:
        """Shapes of the tensors from outside the block that ``root``'s nodes saved (its inputs)."""
        return {tuple(s.shape) for s in self.rec.saved if s.kind is Kind.INPUT and top_of(s.module) == root}

    def first_input_shape(self, root: str | None) -> tuple[int, ...] | None:
        """The shape of ``root``'s input: a tensor from before the block that it saved, else
        what its first layer saved as its input (an input made inside the block)."""
        ins = [s for s in self.rec.saved if s.kind is Kind.INPUT and top_of(s.module) == root]
        if ins:
            return tuple(ins[0].shape)
        first = next((a.module for a in self.rec.allocations if top_of(a.module) == root), None)
        mine = [s for s in self.rec.saved
                if s.module == first and s.attribute.removeprefix("_saved_") in ("mat1", "input", "self")]
        return tuple(mine[0].shape) if mine else None

    input_shape = first_input_shape

    # ----- allocations ---------------------------------------------------------------------------
    def alloc_root(self, a: Allocation) -> str | None:
        return top_of(a.module)

    def released_early(self, pick: Any) -> dict[int, int]:
        """For the allocations ``pick`` selects: free each at the next allocation after its own
        (what happens to a forward's intermediates under torch.no_grad(): the next operation's
        output is made, then the input it read is released)."""
        allocs = sorted(self.rec.allocations, key=lambda a: a.alloc_at)
        out: dict[int, int] = {}
        nxt: int | None = None  # the next allocation made in another module than the one at hand
        for k in range(len(allocs) - 1, -1, -1):
            a = allocs[k]
            if k + 1 < len(allocs) and allocs[k + 1].module != a.module:
                nxt = allocs[k + 1].alloc_at
            if pick(a):
                at = a.alloc_at if nxt is None else nxt
                if a.free_at is None or a.free_at > at:
                    out[a.index] = at
        return out

    def branches(self) -> dict[str, int]:
        """Saved bytes alive at the moment in nodes outside every module, by the model whose output
        they branch off (the first module reached walking toward the inputs)."""
        first: dict[int, str | None] = {}

        def reach(start: int) -> str | None:
            if start in first:
                return first[start]
            seen = {start}
            queue = [start]
            found: str | None = None
            while queue and found is None:
                nxt: list[int] = []
                for v in queue:
                    for s in self.next[v]:
                        if s in seen:
                            continue
                        seen.add(s)
                        if self.top[s]:
                            found = self.top[s]
                            break
                        if self.nodes[s].name != "AccumulateGrad":
                            nxt.append(s)
                    if found:
                        break
                queue = nxt
            first[start] = found
            return found

        out: dict[str, int] = {}
        for a in self.alive:
            if a.category is Category.ACTIVATION and a.module is None and a.node is not None \
                    and 0 <= a.node < len(self.nodes):
                r = reach(a.node)
                if r:
                    out[r] = out.get(r, 0) + a.bytes
        return out

    def trunk_order(self, roots: list[str]) -> list[str]:
        first: dict[str, int] = {}
        for a in self.rec.allocations:
            r = top_of(a.module)
            if r in roots and r not in first:
                first[r] = a.alloc_at
        return sorted(roots, key=lambda r: (first.get(r, 1 << 60), r))

    def block_of(self, a: Allocation) -> str | None:
        parts = (a.module or "").split(".")
        return ".".join(parts[:2]) if len(parts) >= 3 else None

    def blocks(self, root: str | None) -> list[str]:
        """``root``'s child modules that are blocks (have children of their own) with saved
        activations alive, in forward order."""
        first: dict[str, int] = {}
        for a in self.alive:
            b = self.block_of(a)
            if b and a.category is Category.ACTIVATION and top_of(b) == root:
                first[b] = min(first.get(b, 1 << 60), a.alloc_at)
        return sorted(first, key=lambda b: first[b])

    def block_input_bytes(self, block: str) -> int:
        """The bytes of a block's input, as checkpointing keeps it: the previous block's last
        saved activation (its output)."""
        blocks = self.blocks(top_of(block))
        k = blocks.index(block) if block in blocks else 0
        if k == 0:
            return 0
        prev = [a for a in self.alive if self.block_of(a) == blocks[k - 1] and a.category is Category.ACTIVATION]
        return max(prev, key=lambda a: a.alloc_at).bytes if prev else 0


def replay(allocations: Sequence[Allocation], exclude: Any = None, free_at: Mapping[int, int] | None = None) -> int:
    """The peak of the allocation timeline without what ``exclude`` selects, with the frees
    ``free_at`` moves earlier (allocation index -> event position; freed just after that event)."""
    events: list[tuple[int, int, int]] = []
    for a in allocations:
        if exclude is not None and exclude(a):
            continue
        events.append((a.alloc_at, 0, a.bytes))
        f = free_at.get(a.index) if free_at else None
        if f is not None:
            events.append((f, 1, -a.bytes))
        elif a.free_at is not None:
            events.append((a.free_at, 0, -a.bytes))
    events.sort()
    live = peak = 0
    for _, _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ----- helpers ---------------------------------------------------------------------------------
def graph_roots(v: Any) -> list[Any]:
    """Distinct grad_fn nodes of the tensors a variable holds (itself, or items of a list,
    tuple or dict); the nodes are returned only for the walk and never stored. The node objects
    are held while they are compared (see NOTE [ walking a graph by node objects ])."""
    items: Iterable[Any]
    if isinstance(v, torch.Tensor):
        items = (v,)
    elif isinstance(v, list | tuple):
        items = v[:_MAX_ITEMS]
    elif isinstance(v, dict):
        items = list(v.values())[:_MAX_ITEMS]
    else:
        return []
    roots: dict[int, Any] = {}
    for t in items:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            roots.setdefault(id(t.grad_fn), t.grad_fn)
    return list(roots.values())


# NOTE [ walking a graph by node objects ]: on some PyTorch versions the Python object of a C++
# autograd node exists only while something references it: `next_functions` makes a new one at each
# call, and once it is dropped its `id()` can be given to the next one. A walk that remembers
# visited nodes by `id()` alone then takes a new node for one it has seen and skips it (a list of
# losses was reported holding 132,608 bytes instead of 4,103,680). So the walk keeps every node
# object it visits until it ends: while one is held, the same C++ node gives back the same object,
# and no other object can have its `id()`. The objects are dropped in the order they were found
# (roots first), which PyTorch frees safely.
def saved_storages(roots: list[Any], key_of: Any) -> dict[int, int]:
    """Bytes of the storages saved by the nodes reachable from ``roots``, by key (iterative
    walk; each storage once; see NOTE [ walking a graph by node objects ])."""
    out: dict[int, int] = {}
    seen: dict[int, Any] = {}  # id -> the node object itself, held until the walk ends
    stack = list(roots)
    while stack and len(seen) < _MAX_NODES:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for attr, _raw in _compat.saved_tensor_attributes(fn):
            try:
                v = getattr(fn, attr)
            except (RuntimeError, AttributeError):  # freed by a backward without retain_graph
                continue
            for t in v if isinstance(v, tuple | list) else (v,):
                if isinstance(t, torch.Tensor):
                    k = key_of(t)
                    if k is not None:
                        out[k] = int(t.untyped_storage().nbytes())
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return out


def top_of(module: str | None) -> str | None:
    return None if not module else module.split(".")[0]


def top_modules(mods: Iterable[str | None]) -> list[str]:
    count: dict[str, int] = {}
    for m in mods:
        t = top_of(m)
        if t:
            count[t] = count.get(t, 0) + 1
    return [m for m, _ in sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))]


def block_path(module: str | None) -> str:
    """A checkpointable block: the module path without its last component (``layers.3``)."""
    if not module:
        return "(no module)"
    parts = module.split(".")
    return ".".join(parts[:-1]) if len(parts) > 1 else module


# NOTE [ modules by identity ]: a variable of the user's is taken for one of the recording's
# models only when the recording names a root module by that very variable: the recorder names
# roots by identity (the object given with ``modules={"G": G}``, which the notebook extension passes
# for every model in the namespace, or found among the variables where the block ends). Never by
# class name (``cnn`` and ``big`` are both ``Sequential``: a cell using only ``big`` once reported
# "``cnn`` looks frozen") and never by parameter names alone (every ``nn.Sequential`` has a
# ``0.weight``). A root the recorder could not name by a variable (a class name such as
# ``Sequential``, or the paths of a single unnamed root) is matched with no variable.
def root_names(rec: Recording) -> set[str]:
    """The first components of the recording's module paths and parameter names."""
    out = {top_of(n.module) for n in rec.nodes if n.module}
    out |= {n.leaf.split(".")[0] for n in rec.nodes if n.leaf and n.leaf != "input" and "." in n.leaf}
    return {r for r in out if r}


def held_order(t: LiveTensor) -> tuple[Any, ...]:
    """Largest first; ties in an order that does not depend on memory addresses."""
    return (
        -t.bytes,
        KIND_RANK.get(t.kind, len(KIND_RANK)),
        t.module or "",
        t.node or "",
        t.order or 0,
        t.shape or (),
        t.variable or "",
        t.via or "",
    )


KIND_RANK = {k: i for i, k in enumerate(KIND_NAMES)}



_HISTORY = re.compile(r"__\w*__|_+|_i+|_i?\d+|_(oh|ih|dh|exit_code)")


class Context:
    """What every fix reads: the recording's held rows and graph facts (``g``), the user's variables
    (``ns``, ``modules``, ``optimizers``, ``names``), the holders of graphs and the block's demand."""

    g: IndexedRecording
    holders: list[GraphHolder]
    demand: int
    modules: list[tuple[str, nn.Module]]
    optimizers: list[tuple[str, torch.optim.Optimizer]]
    toolbox: bool | None = None  # try the toolbox's fixes (None: at a failure)
    measured: tuple[int, int, Any] | None = None  # the user's step on copies: peak, resident, room (measure.Room)
    measured_user: Any = None  # the user's step's measure.Trial
    progress: Any = None  # called once per run on copies (the diagnosis's progress line)
    bench: Any = None  # the user's step to run fixes on (gradscope._analyses.diagnose.measure.Bench), made on first use
    _step: Any = False  # step_code()'s answer, once read (False: not read yet)

    def __init__(self, rec: Recording, namespace: Mapping[str, Any], top: int) -> None:
        self.rec = rec
        self.ns = {k: v for k, v in namespace.items() if isinstance(k, str) and not k.startswith("_")}
        # what the user's step may read when it runs on copies: also the user's own _private names
        # (a `_train_step` helper), not Python's dunders or IPython's output history (_, _i3, _oh)
        self.step_ns = {k: v for k, v in namespace.items() if isinstance(k, str) and not _HISTORY.fullmatch(k)}
        self.top = top
        self.held = read(rec)
        self.moment = self.held.moment
        self.rows = self.held.rows
        self.by_storage = self.held.by_storage
        self.live = self.held.live_bytes
        self.omitted = self.held.omitted
        self.calls = self.held.calls
        self.notes: list[str] = []
        if self.held.error is not None:
            self.notes.append(f"the recorder could not list live tensors: {self.held.error}")
        if self.held.caught:
            self.notes.append(
                "the block ran out of memory"
                + (f" in {self.held.where}" if self.held.where else "")
                + " and caught the error: diagnosed as the block's failure, with what was live at its peak."
            )

    # ----- namespace ---------------------------------------------------------------------------
    def key(self, t: torch.Tensor) -> int | None:
        try:
            st = t.untyped_storage()
            if self.by_storage:
                return _compat.storage_key(t)
            return int(st.data_ptr())
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def namespace_objects(self) -> None:
        self.modules: list[tuple[str, nn.Module]] = []
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self.names: dict[int, str] = {}  # storage key -> the variable path that is this tensor
        self.via: dict[int, str] = {}  # storage key -> the variable whose graphs save it
        self.kind_of_key: dict[int, str] = {}
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, nn.Module):
                self.modules.append((name, v))
            elif isinstance(v, torch.optim.Optimizer):
                self.optimizers.append((name, v))
        self.resident: dict[str, dict[int, int]] = {"parameters": {}, "gradients": {}, "optimizer state": {}}
        self.roots = root_names(self.rec)
        for name, m in self.modules:
            if name not in self.roots:
                continue  # a model that took no part in this recording (see NOTE [ modules by identity ])
            for t in (*m.parameters(), *m.buffers()):
                k = self.key(t)
                if k is not None:
                    self.resident["parameters"][k] = int(t.untyped_storage().nbytes())
            for pname, p in m.named_parameters():
                if p.grad is not None:
                    k = self.key(p.grad)
                    if k is not None:
                        self.kind_of_key.setdefault(k, "gradient")
                        self.names.setdefault(k, f"{name}.{pname}.grad")
                        self.resident["gradients"][k] = int(p.grad.untyped_storage().nbytes())
        for name, opt in self.optimizers:
            for i, st in enumerate(opt.state.values()):
                if not isinstance(st, Mapping):
                    continue
                for sk, t in st.items():
                    if isinstance(t, torch.Tensor):
                        k = self.key(t)
                        if k is not None:
                            self.kind_of_key[k] = "optimizer"
                            self.names.setdefault(k, f"{name}.state[{i}][{sk!r}]")
                            self.resident["optimizer state"][k] = int(t.untyped_storage().nbytes())

    def resident_by_variable(self) -> tuple[tuple[str, int], ...]:
        """What the user's variables held before the block, by variable, largest first: as the
        notebook's budget counted it when the cell started (the recording keeps it), else read from
        the namespace now (at a failure nothing ran after the block's last allocation)."""
        kept = self.rec.extra.get("resident_by_variable") if isinstance(self.rec.extra, Mapping) else None
        if isinstance(kept, Mapping):
            held = dict(kept)
        else:  # what the block allocated and a variable holds is not "before"
            held = resident_by_variable(self.ns, skip={r.key for r in self.rows})
        return tuple(sorted(((str(k), int(b)) for k, b in held.items() if int(b) > 0), key=lambda kv: (-kv[1], kv[0])))

    def find_holders(self) -> list[GraphHolder]:
        """Variables whose graphs save tensors this recording allocated and that were alive at the
        diagnosed moment. A variable from an earlier cell holding graphs of its own (``dfdz: 8
        graphs``) is not a holder of this recording: none of its saved storages can be one of
        this block's live allocations, since both would be alive at once under one key."""
        live_keys = {r.key: r.bytes for r in self.rows if not r.reused}
        out: list[GraphHolder] = []
        for name in sorted(self.ns):
            roots = graph_roots(self.ns[name])
            if not roots:
                continue
            saved = saved_storages(roots, self.key)
            mine = {k: b for k, b in saved.items() if live_keys.get(k) == b}
            if not mine:
                continue
            for k in mine:
                self.via.setdefault(k, name)
            out.append(GraphHolder(name, len(roots), sum(saved.values()), sum(mine.values())))
        out.sort(key=lambda h: (-h.live_bytes, -h.saved_bytes, h.variable))
        return out

    # ----- analysis ----------------------------------------------------------------------------
    def matchable(self, r: MomentRow) -> bool:
        """Whether a row's key may be matched with the user's live tensors: only at a failure
        (nothing ran after it) and only if the key was not allocated again after the moment.
        After a peak, storages made outside any operator (``torch.tensor``) may reuse a key
        without any event saying so."""
        return self.at_end() and not r.reused

    def at_end(self) -> bool:
        """Whether the diagnosed moment is where the block ended (a failure it did not catch)."""
        return self.moment == "failure" and not self.held.caught

    def kind(self, r: MomentRow) -> str:
        named = self.kind_of_key.get(r.key) if self.matchable(r) else None
        if named is not None:
            return named
        if r.what == "saved":
            if r.order >= 1:
                return "saved_order1"
            return "saved" if r.saved_kind == "activation" else f"saved_{r.saved_kind}"
        return r.what

    def demand_bytes(self) -> int:
        """What the block asked for at the diagnosed moment: its peak, or at a failure what was
        live plus the refused request."""
        if self.moment == "failure" and self.held.requested is not None:
            return self.live + int(self.held.requested)
        return max(self.rec.peak_bytes, self.live)

    def without_model_run(self, root: str | None) -> int:
        """The peak replayed without the model's run (forward, backward, gradients): what a fix
        that runs the model another way keeps of the block."""
        return replay(self.rec.allocations, lambda a: a.category in GRAPH_CATEGORIES
                       or a.category is Category.GRADIENT or (root is not None and self.g.alloc_root(a) == root))

    def worth(self) -> float:
        """The least saving worth a finding: a tenth of the peak, or at a failure under a budget
        whatever makes the block fit."""
        least = MIN_SAVING * self.demand
        if self.moment == "failure" and self.held.budget is not None:
            over = self.demand + self.held.budget_resident - int(self.held.budget)
            least = min(least, max(over, 1))
        return least

    def raised(self) -> bool:
        """Whether the block raised for another reason than running out of memory."""
        return bool(self.rec.error) and self.rec.oom is None and "out of memory" not in (self.rec.error or "").lower()

    def saving(self, fix_peak: int | None) -> int | None:
        return None if fix_peak is None else self.demand - fix_peak

    # ----- namespace helpers ---------------------------------------------------------------------
    def module(self, root: str | None) -> nn.Module | None:
        """The user's model that the recording calls ``root`` (see NOTE [ modules by identity ])."""
        return next((m for n, m in self.modules if n == root), None) if root else None

    def model_name(self, root: str | None) -> str:
        if root and root.isidentifier():
            return root
        return "model"

    def step_code(self) -> tuple[str, dict[str, Any]] | None:
        """The block's code as it runs on copies, and the names it reads: a step that calls the
        user's own function is that function's body (see :func:`gradscope._analyses.diagnose.step.inline`).
        None when the block's source is unknown. Read once."""
        if self._step is False:
            step = self.rec.extra.get("step") if isinstance(self.rec.extra, Mapping) else None
            text = step_source(dict(step)) if isinstance(step, Mapping) else None
            if text is None:
                self._step = None
            else:
                inlined = inline(text, self.step_ns)
                self._step = (text, dict(self.step_ns)) if inlined is None else (inlined[0], inlined[1] | self.step_ns)
        return self._step  # type: ignore[no-any-return]

    def trained_by_optimizer(self, m: nn.Module) -> bool | None:
        """Whether an optimizer among the user's variables trains ``m`` (None: none is known)."""
        if not self.optimizers:
            return None
        ids = {id(p) for _, o in self.optimizers for grp in o.param_groups for p in grp["params"]}
        return any(id(p) in ids for p in m.parameters())

    def tensor_list(self, n: int, shapes: set[tuple[int, ...]]) -> str | None:
        """The user's list of input tensors for ``n`` calls of a model (its items' shape among
        ``shapes``, the model's recorded inputs), by name."""
        best: tuple[int, str] | None = None
        for name in sorted(self.ns):
            v = self.ns[name]
            if not isinstance(v, list | tuple) or len(v) < 2 or not all(isinstance(t, torch.Tensor) for t in v[:64]):
                continue
            if any(t.requires_grad for t in v[:64]):
                continue
            score = (2 if tuple(v[0].shape) in shapes else 0) + (1 if len(v) == n else 0)
            if score and (best is None or score > best[0]):
                best = (score, name)
        return best[1] if best else None

    def tensor_named(self, shape: tuple[int, ...] | None, *, requires_grad: bool | None = None) -> str | None:
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, torch.Tensor) and (shape is None or tuple(v.shape) == shape):
                if requires_grad is None or v.requires_grad == requires_grad:
                    return name
        return None

    def graph_lists(self, holders: list[GraphHolder]) -> list[tuple[str, int]]:
        """The user's variables holding two or more graphs: the holders found by their saved
        storages, else lists whose tensors carry graphs."""
        out = [(h.variable, h.graphs) for h in holders if h.graphs >= 2 and h.live_bytes > 0]
        if out:
            return out
        for name in sorted(self.ns):
            v = self.ns[name]
            if isinstance(v, list | tuple) and len(graph_roots(v)) >= 2:
                out.append((name, len(graph_roots(v))))
        return out

    def optimizers_that_stepped(self) -> set[str]:
        """The user's optimizers whose state was created in the block (the allocations of its
        optimizer phase that were alive at its end)."""
        if self.moment == "failure":
            return set()
        made = {a.key: a.bytes for a in self.rec.allocations if a.phase is Phase.OPTIMIZER and a.free_at is None}
        by_storage = self.by_storage
        out = set()
        for name, opt in self.optimizers:
            for st in opt.state.values():
                ts = [t for t in st.values() if isinstance(t, torch.Tensor)] if isinstance(st, Mapping) else []
                keys = [_compat.storage_key(t) if by_storage else t.untyped_storage().data_ptr() for t in ts]
                if any(k in made for k in keys):
                    out.add(name)
                    break
        return out

