"""What the diagnosis reads: the recording's held rows, its graph and allocation table, and the user's variables."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradscope._analyses.diagnose.indexed import (
    GRAPH_CATEGORIES,
    MIN_SAVING,
    IndexedRecording,
    replay,
    top_of,
)
from gradscope._analyses.diagnose.moment import MAX_ITEMS, MAX_NODES, MomentRow, read, resident_by_variable
from gradscope._analyses.diagnose.result import KIND_NAMES, GraphHolder, LiveTensor
from gradscope._analyses.diagnose.step import inline
from gradscope._base import compat as _compat
from gradscope._base.source import step_source
from gradscope._model.recording import Category, Phase, Recording


# ----- helpers ---------------------------------------------------------------------------------
def graph_roots(v: Any) -> list[Any]:
    """Distinct grad_fn nodes of the tensors a variable holds (itself, or items of a list,
    tuple or dict); the nodes are returned only for the walk and never stored. The node objects
    are held while they are compared (see NOTE [ walking a graph by node objects ])."""
    items: Iterable[Any]
    if isinstance(v, torch.Tensor):
        items = (v,)
    elif isinstance(v, list | tuple):
        items = v[:MAX_ITEMS]
    elif isinstance(v, dict):
        items = list(v.values())[:MAX_ITEMS]
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
    while stack and len(seen) < MAX_NODES:
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
    alternatives: bool = False  # also try the toolbox's fixes after the first that fits the budget
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

