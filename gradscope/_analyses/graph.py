"""``gs.graph(tensor)``: the autograd graph and saved tensors behind an existing result, without
running backward (a recording's graphviz drawing, ``rec.to_dot()``, is a view: :mod:`gradscope.report`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError
from gradscope._capture.walk import node_name, plain_pack, plain_unpack, walk
from gradscope._model import names as _names
from gradscope._model.recording import Edge, Kind, Node, Recording, SavedTensor, Where

__all__ = ["graph"]


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
    names = _names.parameter_names(modules)
    storage_names: dict[int, tuple[str, str]] = {}
    for _prefix, m in _names.modules_arg(modules):
        for t in (*m.parameters(), *m.buffers()):
            k = _compat.storage_key(t)
            if k is not None and id(t) in names:
                storage_names.setdefault(k, names[id(t)])
    nodes: list[Node] = []
    index: dict[Any, int] = {}
    edge_keys: list[tuple[Any, Any]] = []
    saved: list[SavedTensor] = []
    storages: dict[int, int] = {}
    counts = {"checkpoint": 0, "hooked": 0}
    kinds = {"parameter": Kind.PARAMETER, "buffer": Kind.BUFFER}
    for fn, key, kids in walk(roots):
        i = len(nodes)
        index[key] = i
        leaf = leaf_shape = None
        if not isinstance(key, int):  # AccumulateGrad
            var = fn.variable
            leaf = names.get(id(var), ("", "input"))[1]
            leaf_shape = tuple(var.shape)
        nodes.append(Node(id=i, name=node_name(fn), leaf=leaf, leaf_shape=leaf_shape, module=_leaf_module(leaf)))
        edge_keys.extend((k, key) for k in kids)
        for attr, t in _saved_tensors(fn, counts):
            key_s = _compat.storage_key(t)
            try:
                nbytes = int(t.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError, TypeError):
                key_s, nbytes = None, t.numel() * t.element_size()
            if key_s is None:
                key_s = -(len(saved) + 1)
            sid = storages.setdefault(key_s, len(storages))
            named = storage_names.get(key_s)
            kind = kinds[named[0]] if named else (Kind.INPUT if t.grad_fn is None else Kind.ACTIVATION)
            saved.append(SavedTensor(
                node=i, attribute=attr, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                device=str(t.device), bytes=nbytes, storage=sid, kind=kind,
                name=named[1] if named else None,
            ))
            del t
    edges = tuple(dict.fromkeys(Edge(index[a], index[b]) for a, b in edge_keys if a in index and b in index))
    notes = ["from gs.graph: no backward ran; module paths need gs.record"]
    if counts["checkpoint"]:
        notes.append(f"{counts['checkpoint']} saved tensors of non-reentrant checkpoint segments were not unpacked "
                     "(that would recompute the segment once per tensor), so they are not listed.")
    if counts["hooked"]:
        notes.append(f"{counts['hooked']} saved tensors of non-reentrant checkpoint segments were not unpacked (or of "
                     "other saved_tensors_hooks pairs: this torch cannot tell which, and reading a checkpoint's "
                     "would recompute its segment), so they are not listed.")
    return Recording(nodes=tuple(nodes), edges=edges, saved=tuple(saved),
                     where=Where(device=str(tensors[0].device), memory_source="off",
                                 torch_version=torch.__version__),
                     label=label, notes=tuple(notes))


def _leaf_module(leaf: str | None) -> str | None:
    if leaf and leaf != "input" and "." in leaf:
        return leaf.rsplit(".", 1)[0]
    return None


def _saved_tensors(fn: Any, counts: dict[str, int]) -> list[tuple[str, torch.Tensor]]:
    """A node's saved tensors, read through whatever saved_tensors_hooks packed them, except
    those of non-reentrant checkpoint: unpacking one outside backward recomputes the whole segment
    (once per tensor read), so they are counted and skipped. A torch that cannot name a saved
    variable's hooks (<= 2.8) cannot tell a checkpoint's from other pairs': every hooked save is
    skipped there (``counts["hooked"]``); one without hooks is given a pair equivalent to none
    (data and version check), the only way that torch has of asking."""
    out: list[tuple[str, torch.Tensor]] = []
    ours: bool | None = None  # packed by the gs.record block around this call (its pair reads them)
    for attr, raw_attr in _compat.saved_tensor_attributes(fn):
        skip = False
        for raw in _compat.raw_saved(fn, raw_attr):
            hook = _compat.unpack_hook_of(raw)
            if hook is _compat.NOT_VISIBLE:
                if ours is None:
                    from gradscope._capture.patches import packed_here

                    ours = packed_here(fn)
                if ours:
                    continue
                # registering a pair is the only question that torch answers; under a dispatch
                # mode its answer may leave the save half-hooked, so nothing is read there
                if _compat.dispatch_modes_active() or _compat.probe_saved(raw, plain_pack, plain_unpack) == "hooked":
                    counts["hooked"] += 1
                    skip = True
            elif hook is not None and getattr(hook, "__module__", "") == "torch.utils.checkpoint":
                counts["checkpoint"] += 1
                skip = True
        if skip:
            continue
        try:
            v = getattr(fn, attr)
        except (RuntimeError, AttributeError) as e:
            if "backward through the graph a second time" in str(e) or "has been freed" in str(e):
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
