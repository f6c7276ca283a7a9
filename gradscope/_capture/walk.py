"""The one autograd-graph walker (iterative), and a safe way to free a deep walked graph.

NOTE [ node identity ]: a node's Python object cannot name it across time: on older torch it is
recreated whenever nobody holds it (and its ``id()`` reused by the next one), and holding it
keeps the graph alive. Nodes are named by their sequence number (unique per thread, assigned at
creation) and ``AccumulateGrad`` nodes, which all share one number, by their leaf tensor. While a
walk runs it holds every node object it reached, so that callers that do use ``id()`` inside the
walk see stable ids on every version.

NOTE [ freeing deep graphs ]: PyTorch frees a graph through a custom deleter that turns the
recursion over ``next_functions`` into a loop (torch/csrc/autograd/function.cpp, ``deleteNode``
and ``gatherFunctions``: a next node is queued on a heap vector when the edge holds its last
reference). From torch 2.13 on, a node that was ever handed to Python keeps its Python object for
as long as it lives (the node holds it in a PyObject slot, as tensors and storages do). Freeing
such a node goes through that object's deallocation, which drops the node's edges from inside the
Python deallocator, outside the loop: each next node that also has a Python object is then freed
from inside the previous one's deallocation. A chain walked by Python (any walk: gradscope's,
torchviz's, a user's ``next_functions`` loop) therefore frees recursively, and past ~50,000
nodes that overflows the C stack (measured: a 60,000-op chain walked and dropped, then ``del y``:
segmentation fault; the same chain unwalked frees fine; on torch 2.6 the walked chain frees fine).
A walk cannot avoid creating those objects, so :func:`release` frees such a graph safely: it holds
every node object, detaches the tensors from the graph, then lets go of the nodes in topological
order from the roots, so that each deallocation frees one node whose next nodes are still held.

:func:`release` is public as ``gradscope.release`` (``gs.release``), a function: no module of that
name exists, since importing one would replace the package attribute. It lives here, beside the
walk whose node objects it holds and lets go of, and its face is :mod:`gradscope.record`, which
the package takes it from; point to it as :func:`gradscope.release`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch

from gradscope._base.compat import ACC_SEQ, is_view, node_seq, tensor_version
from gradscope._base.errors import GradscopeError

__all__ = ["keys_of", "node_key", "node_name", "plain_pack", "plain_unpack", "release", "roots_of", "walk"]


def node_key(fn: Any) -> Hashable:
    """A node's identity while the graph lives: see NOTE [ node identity ]."""
    seq = node_seq(fn)
    if seq != ACC_SEQ:
        return seq
    try:
        return _leaf_key(fn.variable)
    except (AttributeError, RuntimeError):
        return ("obj", id(fn))


def _leaf_key(leaf: torch.Tensor) -> Hashable:
    """An AccumulateGrad node's key, named by its leaf tensor (see NOTE [ node identity ])."""
    return ("acc", id(leaf))


_NAMES: dict[type, str] = {}


def node_name(fn: Any) -> str:
    """``"AddmmBackward0"``, ``"AccumulateGrad"``: the node's class without its C++ namespace."""
    cls = type(fn)
    name = _NAMES.get(cls)
    if name is None:
        name = fn.name().rsplit("::", 1)[-1]
        if cls.__name__ == name:  # one class, one name (generic C++ wrappers are not cached)
            _NAMES[cls] = name
    return name


def roots_of(values: Iterable[Any]) -> list[Any]:
    """The graph nodes behind tensors and gradient edges (tensors without a graph are skipped)."""
    out = []
    for t in values:
        try:
            if isinstance(t, torch.autograd.graph.GradientEdge):
                out.append(t.node)
            elif isinstance(t, torch.Tensor):
                fn = t.grad_fn
                if fn is not None:
                    out.append(fn)
                elif t.requires_grad:
                    out.append(torch.autograd.graph.get_gradient_edge(t).node)
        except (RuntimeError, AttributeError):  # a wrapped tensor (torch.func) without a usable edge
            continue
    return [r for r in out if r is not None]


def keys_of(values: Iterable[Any]) -> list[Hashable]:
    """The keys of the nodes :func:`roots_of` finds, without making a leaf's AccumulateGrad node:
    a leaf's key is its tensor's (see node_key)."""
    out: list[Hashable] = []
    for t in values:
        try:
            leaf = isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
        except (RuntimeError, AttributeError):  # a wrapped tensor (torch.func): as roots_of reads it
            leaf = False
        if leaf:
            out.append(_leaf_key(t))  # the leaf's node's .variable is t
        else:
            out += [node_key(r) for r in roots_of((t,))]
    return out


def walk(roots: Iterable[Any], stop: Any = None,
         limit: int | None = None) -> Iterator[tuple[Any, Hashable, list[Hashable]]]:
    """Each node reachable from ``roots`` once, depth first, without recursion.

    Yields ``(node, key, next_keys)`` where ``next_keys`` lists the key of each of the node's
    ``next_functions`` (None entries left out). Nodes whose key is in ``stop`` are listed as next
    nodes but not yielded nor walked through (a recorder passes the nodes it already walked:
    their subgraphs cannot have changed). Every node object reached is held until the walk ends
    (see NOTE [ node identity ]). ``limit`` stops after that many nodes.
    """
    held: list[Any] = []
    seen: set[Hashable] = set()
    stack: list[tuple[Any, Hashable]] = []
    for r in roots:
        if r is not None:
            stack.append((r, node_key(r)))
    stop = stop if stop is not None else ()
    pop, push, hold, mark = stack.pop, stack.append, held.append, seen.add
    acc, seq_of = ACC_SEQ, node_seq
    count = 0
    try:
        while stack:
            fn, key = pop()
            if key in seen or key in stop:
                continue
            mark(key)
            hold(fn)
            kids: list[Hashable] = []
            for nxt, _ in fn.next_functions:
                if nxt is not None:
                    k = seq_of(nxt)
                    if k == acc:
                        k = node_key(nxt)
                    kids.append(k)
                    if k not in seen:
                        push((nxt, k))
            yield fn, key, kids
            count += 1
            if limit is not None and count >= limit:
                return
    finally:
        held.clear()


def plain_pack(t: torch.Tensor) -> Any:
    """With :func:`plain_unpack`, a saved-tensor hooks pair that behaves as no hooks at all: the
    data (detached: see NOTE [ pack a detached tensor ] in :mod:`gradscope._capture.saves`) and its
    version, checked when unpacked as PyTorch checks saves without hooks. What gradscope
    registers on a save a torch <= 2.8 only lets it inspect by registering a pair
    (see :func:`gradscope._base.compat.probe_saved`)."""
    return (t.detach(), tensor_version(t))


def plain_unpack(p: Any) -> torch.Tensor:
    t, version = p
    if tensor_version(t) != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {tensor_version(t)}; expected version "
            f"{version} instead. (Checked by gradscope, as PyTorch does without saved-tensor hooks.)"
        )
    return t  # type: ignore[no-any-return]


def release(*tensors: torch.Tensor) -> int:
    """Free the autograd graph behind ``tensors`` one node at a time; returns how many nodes.

    A graph that Python has walked (``gs.record`` and ``gs.graph`` walk every graph they see)
    frees recursively on torch 2.13 and newer, and a chain of more than ~50,000 nodes then
    crashes the process when its last tensor is dropped (see NOTE [ freeing deep graphs ]).
    ``gs.release(loss)`` instead of ``del loss`` frees it safely. The tensors stay usable as
    values: they are detached (they no longer require grad). Pass every tensor you still hold
    from the graph; nodes that another live tensor still reaches are freed when it dies.

    Example:
        >>> import torch, gradscope as gs
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = x
        >>> for _ in range(5):
        ...     y = y * 2
        >>> gs.release(y), y.requires_grad
        (6, False)
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise GradscopeError(f"gradscope: release() takes tensors; argument {i} is a {type(t).__name__}.")
        if is_view(t) and t.grad_fn is not None:
            raise GradscopeError(
                "gradscope: release() cannot detach a view from its graph in place (PyTorch refuses "
                "to); pass the tensor it is a view of, or release a result that is not a view "
                "(e.g. y.clone())."
            )
    held, parents, children, root_keys = _hold_graph([t.grad_fn for t in tensors if t.grad_fn is not None])
    for t in tensors:
        if t.grad_fn is not None:
            t.detach_()
    # Kahn's order from the roots: a node is let go only after every node pointing at it, so each
    # deallocation frees one node whose next nodes are still held (no local name may hold a
    # node here: it would be freed last, with everything below it, recursively).
    ready = [k for k in dict.fromkeys(root_keys) if parents.get(k, 0) == 0]
    freed = 0
    while ready:
        key = ready.pop()
        held.pop(key, None)
        freed += 1
        for k in children.pop(key, ()):
            n = parents[k] - 1
            parents[k] = n
            if n == 0:
                ready.append(k)
    held.clear()
    return freed


def _hold_graph(roots: list[Any]) -> tuple[dict[Hashable, Any], dict[Hashable, int], dict[Hashable, list[Hashable]],
                                            list[Hashable]]:
    """Every node object reachable from ``roots``, with how many nodes point at each and what each
    points at (by key). A function of its own, so that no loop variable outlives it."""
    held: dict[Hashable, Any] = {}
    parents: dict[Hashable, int] = {}
    children: dict[Hashable, list[Hashable]] = {}
    root_keys = [node_key(r) for r in roots]
    for fn, key, kids in walk(roots):
        held[key] = fn
        children[key] = kids
        for k in kids:
            parents[k] = parents.get(k, 0) + 1
    return held, parents, children, root_keys
