"""The recording's graph and allocation table indexed for the findings, and the figures they share
(the least saving shown, the graph's categories, the merges that make a loss a sum)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradscope._analyses.diagnose.moment import MAX_NODES
from gradscope._model.recording import Allocation, BackwardCall, Category, Kind, Recording

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
    are measured fixes ] in gradscope._analyses.diagnose). Walks are iterative: graphs may be deep."""

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
        if len(entries) < 2 or len(self.nodes) > MAX_NODES:
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


def top_of(module: str | None) -> str | None:
    return None if not module else module.split(".")[0]
