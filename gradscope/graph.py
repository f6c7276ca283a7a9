"""``gs.graph(tensor)``: the autograd graph and saved tensors behind an existing result, without
running backward, and ``to_dot`` for a ``graphviz.Digraph`` of any recording."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from gradscope.errors import GradscopeError
from gradscope.recording import Edge, Kind, Node, Recording, SavedTensor, Where, format_bytes

__all__ = ["graph", "to_dot"]

_ACC = 18446744073709551615


def graph(tensor: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor], *,
          modules: nn.Module | Mapping[str, nn.Module] | None = None, label: str = "") -> Recording:
    """The graph behind ``tensor`` (or several tensors) and every tensor its nodes saved.

    Args:
        tensor: a result with a ``grad_fn`` (e.g. a loss), or a list/tuple of them.
        modules: a module, or ``{"name": module}``, whose parameters name the leaves.
        label: a name for the result.

    Returns:
        A :class:`~gradscope.Recording` with nodes, edges and saved tensors (no steps, no timeline).
        Module paths are not known without running the model under :func:`gradscope.record`.

    Example:
        >>> import torch, gradscope as gs
        >>> w = torch.ones(3, requires_grad=True)
        >>> g = gs.graph((w.exp() * 2).sum())
        >>> [n.name for n in g.nodes], g.saved_bytes
        (['SumBackward0', 'MulBackward0', 'ExpBackward0', 'AccumulateGrad'], 20)

        Here 12 bytes are ``exp``'s result and 8 bytes the Python number 2, which PyTorch keeps as
        a 0-d int64 tensor; saved-tensor hooks never see such numbers, so ``gs.record`` counts 12.
    """
    tensors = list(tensor) if isinstance(tensor, list | tuple) else [tensor]
    roots = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise GradscopeError(
                f"gradscope: gs.graph takes tensors; argument {i} is a {type(t).__name__}. "
                "Pass the result of a computation, e.g. the loss."
            )
        if t.grad_fn is None:
            what = "a leaf that requires grad" if t.requires_grad else "a tensor that does not require grad"
            raise GradscopeError(
                f"gradscope: gs.graph needs a result with a grad_fn, but the tensor of shape "
                f"{tuple(t.shape)} is {what}, so it has no graph behind it. Pass the output of a "
                "computation on tensors that require grad (e.g. the loss), not an input or a "
                "parameter; inside torch.no_grad() no graph is built."
            )
        roots.append(t.grad_fn)
    names = _param_names(modules)
    ids: dict[Any, int] = {}
    infos: list[dict[str, Any]] = []
    edges: dict[tuple[int, int], None] = {}
    saved: list[SavedTensor] = []
    storages: dict[int, int] = {}
    keep: list[Any] = []  # node objects, alive only during this walk

    def node_id(fn: Any) -> int:
        seq = fn._sequence_nr()
        key: Any = ("acc", id(fn.variable)) if seq == _ACC else seq
        i = ids.get(key)
        if i is None:
            i = len(infos)
            ids[key] = i
            name = fn.name().rsplit("::", 1)[-1]
            info: dict[str, Any] = {"name": name, "leaf": None, "leaf_shape": None, "fn": fn}
            if seq == _ACC:
                var = fn.variable
                info["leaf"] = names.get(id(var), (None, "input"))[1]
                info["leaf_shape"] = tuple(var.shape)
            infos.append(info)
            keep.append(fn)
        return i

    stack = list(roots)
    walked: set[int] = set()
    while stack:
        fn = stack.pop()
        i = node_id(fn)
        if i in walked:
            continue
        walked.add(i)
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                j = node_id(nxt)
                edges[(j, i)] = None
                if j not in walked:
                    stack.append(nxt)
    foreign = [0]
    for i, info in enumerate(infos):
        for attr, t in _saved_tensors(info["fn"], foreign):
            try:
                storage = t.untyped_storage()
                key = int(StorageWeakRef(storage).cdata)
                nbytes = int(storage.nbytes())
            except (RuntimeError, NotImplementedError, TypeError):
                key, nbytes = -(len(saved) + 1), t.numel() * t.element_size()
            sid = storages.setdefault(key, len(storages))
            named = names.get(("storage", key))
            kind = named[0] if named else (Kind.INPUT if t.grad_fn is None else Kind.ACTIVATION)
            saved.append(SavedTensor(
                node=i, attribute=attr, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                device=str(t.device), bytes=nbytes, storage=sid, kind=kind,
                name=named[1] if named else None,
            ))
    keep.clear()
    nodes = tuple(Node(id=i, name=info["name"], leaf=info["leaf"], leaf_shape=info["leaf_shape"],
                       module=_leaf_module(info["leaf"]))
                  for i, info in enumerate(infos))
    return Recording(nodes=nodes, edges=tuple(Edge(a, b) for a, b in edges), saved=tuple(saved),
                     where=Where(device=str(tensors[0].device), memory_source="off",
                                 torch_version=torch.__version__),
                     label=label, notes=("from gs.graph: no backward ran; module paths need gs.record",)
                     + ((f"{foreign[0]} saved tensors of non-reentrant checkpoint segments were not unpacked "
                         "(that would recompute the segment once per tensor), so they are not listed.",) if foreign[0] else ()))


def _leaf_module(leaf: str | None) -> str | None:
    if leaf and leaf != "input" and "." in leaf:
        return leaf.rsplit(".", 1)[0]
    return None


def _param_names(modules: nn.Module | Mapping[str, nn.Module] | None) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    if modules is None:
        return out
    if isinstance(modules, nn.Module):
        items = [("", modules)]
    elif isinstance(modules, Mapping):
        items = list(modules.items())
    else:
        raise GradscopeError(
            f"gradscope: modules= takes an nn.Module or a dict {{'name': module}}, got {type(modules).__name__}."
        )
    for prefix, m in items:
        if not isinstance(m, nn.Module):
            raise GradscopeError(f"gradscope: modules[{prefix!r}] is not an nn.Module.")
        for kind, named in ((Kind.PARAMETER, m.named_parameters()), (Kind.BUFFER, m.named_buffers())):
            for name, p in named:
                full = f"{prefix}.{name}" if prefix else name
                out[id(p)] = (kind, full)
                try:
                    out.setdefault(("storage", int(StorageWeakRef(p.untyped_storage()).cdata)), (kind, full))
                except (RuntimeError, NotImplementedError):
                    pass
    return out


def _saved_tensors(fn: Any, foreign: list[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """A node's saved tensors, read through whatever saved_tensors_hooks packed them, except
    those of non-reentrant checkpoint: unpacking one outside backward recomputes the whole segment
    (once per tensor read), so they are counted in ``foreign`` and skipped."""
    from gradscope.record import _saved_attrs, _unpack

    attrs = ["saved_tensors"] if isinstance(fn, torch.autograd.function.BackwardCFunction) else _saved_attrs(fn)
    out: list[tuple[str, torch.Tensor]] = []
    for attr in attrs:
        raw = getattr(fn, "_raw" + attr if attr.startswith("_saved_") else "_raw_saved_tensors", None)
        hooks = [getattr(r, "unpack_hook", None) for r in (raw if isinstance(raw, list | tuple) else (raw,))]
        hidden = sum(1 for h in hooks if h is not None and h is not _unpack
                     and getattr(h, "__module__", "") == "torch.utils.checkpoint")
        if hidden:
            if foreign is not None:
                foreign[0] += hidden
            continue
        try:
            v = getattr(fn, attr)
        except (RuntimeError, AttributeError) as e:
            if "backward through the graph a second time" in str(e):
                raise GradscopeError(
                    "gradscope: this graph's saved tensors were already freed by a backward pass; "
                    "call gs.graph before backward, or run backward with retain_graph=True."
                ) from None
            continue
        if isinstance(v, torch.Tensor):
            out.append((attr, v))
        elif isinstance(v, list | tuple):
            for k, x in enumerate(v):
                if isinstance(x, torch.Tensor):
                    out.append((attr if len(v) == 1 and attr != "saved_tensors" else f"{attr}[{k}]", x))
    return out


def to_dot(rec: Recording, *, max_nodes: int = 5000) -> Any:
    """A ``graphviz.Digraph`` of the recording: nodes with their saved bytes, saved tensors as
    boxes (what torchviz's ``make_dot(show_saved=True)`` shows, plus bytes)."""
    try:
        import graphviz
    except ImportError:
        raise GradscopeError(
            "gradscope: to_dot needs the 'graphviz' Python package: pip install 'gradscope[notebook]'."
        ) from None
    if len(rec.nodes) > max_nodes:
        raise GradscopeError(
            f"gradscope: {len(rec.nodes)} nodes is too many for a dot drawing (max_nodes={max_nodes}); "
            "use gs.show(rec), which collapses by module, or pass a larger max_nodes."
        )
    dot = graphviz.Digraph(graph_attr={"rankdir": "BT"},
                           node_attr={"shape": "box", "style": "filled", "fontsize": "10"})
    by_node = rec.saved_by_node()
    for n in rec.nodes:
        own = sum(s.bytes for s in by_node.get(n.id, ()))
        text = n.leaf if n.leaf else n.name
        if n.leaf_shape is not None:
            text += "\n" + str(list(n.leaf_shape))
        if own:
            text += f"\nsaved {format_bytes(own)}"
        color = "lightblue" if n.leaf else ("orange" if n.order >= 1 else "lightgrey")
        dot.node(f"n{n.id}", text, fillcolor=color)
        for k, s in enumerate(by_node.get(n.id, ())):
            sid = f"s{n.id}_{k}"
            dot.node(sid, f"{s.attribute}\n{list(s.shape)} {s.dtype}\n{format_bytes(s.bytes)}",
                     fillcolor="orange" if s.kind is Kind.ACTIVATION else "white", shape="note")
            dot.edge(sid, f"n{n.id}", style="dotted", dir="none")
    for e in rec.edges:
        dot.edge(f"n{e.src}", f"n{e.dst}")
    return dot
