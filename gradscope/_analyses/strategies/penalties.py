"""Releasing penalty branches early (the seed-003 pattern).

``loss = main(trunk) + sum_k penalty_k(h_k)`` where each penalty branches off the trunk at ``h_k``.
Keeping every penalty until one joint backward keeps every branch's saved tensors alive at once. Each
branch only needs the gradient flowing into the trunk, so :class:`PenaltyBranches` takes that gradient
as soon as the penalty exists (``autograd.grad`` to the trunk runs only the branch and frees its
buffers), drops the branch, and finishes with one backward over the loss and the branch points:
``backward([loss, h_1, ..., h_K], [1, g_1, ..., g_K])``. The trunk is traversed once, and the gradients
equal the joint backward's.

NOTE [ where a branch meets the trunk ]: a penalty may read more of the trunk than its ``at``: a trunk
weight, the pre-activation ``at`` was made from, an earlier ``h``. ``autograd.grad(penalty, [at, W])``
would then run the trunk below ``at`` to reach ``W`` (freeing it, so the final backward fails with
"backward through the graph a second time", and counting the path through ``at`` twice). So ``add``
first finds the trunk: every node reachable from ``at`` (kept across calls, so each trunk node is walked
once). The penalty's own nodes are those reached from it without entering the trunk; the trunk nodes
they point to are where the branch meets the trunk. When it meets the trunk at one node (the usual
case), the gradient is taken there and the branch is freed. When it meets it at several nodes and one
lies below another, the engine must run the trunk between them to reach the lower one; those trunk
nodes (the *region*) run with ``retain_graph=True`` so the final backward still has them, and the
gradients are taken where the region ends instead: the trunk nodes that the branch and the region
point to but that no longer lead to one another (found by a fixed point, since taking a gradient at a
node makes every trunk node above it run). Leaves reached that way (the branch's own parameters, a
trunk weight) get their gradient at ``backward`` time; gradients at non-leaf trunk tensors other than
``at`` become extra roots of the final backward (``GradientEdge`` roots, PyTorch 2.7 or later). A
penalty that reads a trunk tensor made *after* its ``at`` cannot be told apart from its own branch; the
final backward then fails, and :meth:`PenaltyBranches.backward` says so.

NOTE [ graph nodes are held, never keyed by id() ]: on some PyTorch versions the Python object of a
graph node is freed as soon as nothing refers to it, and the next ``next_functions`` call can hand out
a new object at the same address. A walk keyed by ``id(node)`` then takes unseen nodes for seen ones
(this left every branch parameter without a gradient, issue 12). Every walk here keeps the node objects
themselves in a dict (identity hash, and the held object keeps its id), and the trunk's nodes are
released root-first at the end (releasing a long walked chain leaves-first can crash PyTorch).

NOTE [ rescaling a penalty's gradient per sample ]: ``backward(loss, scale=s)`` multiplies row ``b`` of
the gradient each penalty sends into its ``at`` by ``s[b]`` before the final backward: the user's
per-sample weights, known only at the end of the network. It needs every penalty to reach the trunk
through its ``at`` alone: a gradient that went into a parameter (the branch's own, or a trunk weight)
or through trunk layers is already summed over the samples and cannot be rescaled per sample, so such a
penalty is refused, by name, before anything is accumulated.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradscope._analyses.strategies._checks import _fail, _need_scalar

__all__ = ["PENALTY_METHODS", "PenaltyBranches"]

PENALTY_METHODS = ("early", "retain_graph", "joint")

_F = "PenaltyBranches"

Node = Any  # torch.autograd.graph.Node; its Python objects are hashable by identity


@dataclass
class _Root:
    """A gradient waiting for the final backward: at ``at`` (a tensor) or at a trunk edge."""

    target: torch.Tensor | GradientEdge
    grad: torch.Tensor
    penalty: int  # which add() it came from (0-based)
    is_at: bool


class PenaltyBranches:
    """Collect penalties that branch off a trunk, back-propagating each one as the method says.

    Methods:
        ``"early"``: gradient of the penalty to where it meets the trunk, at once; the branch is freed;
            one backward at the end over loss and branch points (trunk traversed once). See
            NOTE [ where a branch meets the trunk ].
        ``"retain_graph"``: the forum thread's version: ``penalty.backward(retain_graph=True)`` at once
            (the branch is freed too, but every penalty back-propagates through the whole trunk).
        ``"joint"``: keep every penalty; ``(loss + sum(penalties)).backward()`` at the end.

    Example:
        >>> import torch
        >>> w = torch.randn(3, 3, requires_grad=True)
        >>> pb = PenaltyBranches("early")
        >>> h = torch.randn(2, 3)
        >>> for _ in range(3):
        ...     h = torch.tanh(h @ w)
        ...     _ = pb.add(h.exp().pow(2).mean() + 1e-3 * w.pow(2).sum(), at=h)
        >>> total = pb.backward(h.sum())
        >>> w.grad.shape, len(pb)
        (torch.Size([3, 3]), 3)
    """

    def __init__(self, method: str = "early") -> None:
        if method not in PENALTY_METHODS:
            raise _fail(
                _F, f"`method` must be one of {', '.join(map(repr, PENALTY_METHODS))}, got {method!r}."
            )
        self.method = method
        self._roots: list[_Root] = []
        self._leaf_grads: dict[torch.Tensor, torch.Tensor] = {}  # leaf -> summed gradient (by identity)
        self._summed: list[str] = []  # why a per-sample rescale is impossible, one line per penalty
        self._trunk: dict[Node, None] = {}  # see NOTE [ graph nodes are held, never keyed by id() ]
        self._kept: list[torch.Tensor] = []
        self._value: torch.Tensor | None = None
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, penalty: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Register one penalty and the trunk tensor it branches from; return its value, detached.

        Args:
            penalty: a scalar computed from ``at`` (and possibly from other trunk tensors, trunk
                weights, or leaves of its own).
            at: the latest trunk tensor the penalty reads; must require grad.

        Returns:
            The penalty's value, detached (for logging or for the loss total).

        Raises:
            GradscopeError: a penalty that is not a scalar requiring grad, an ``at`` that is not in the
                graph, or (before PyTorch 2.7) a penalty that meets the trunk away from ``at``.
        """
        _need_scalar(_F, "`penalty`", penalty)
        if not isinstance(at, torch.Tensor):
            raise _fail(
                _F, f"`at` must be the trunk tensor the penalty branches from, got {type(at).__name__}."
            )
        if not at.requires_grad:
            raise _fail(_F, "`at` does not require grad: it must be a trunk tensor inside the graph.")
        if not penalty.requires_grad:
            raise _fail(_F, "`penalty` does not require grad: compute it from `at` with grad mode on.")
        value = penalty.detach()
        if self.method == "joint":
            self._kept.append(penalty)
        elif self.method == "retain_graph":
            penalty.backward(retain_graph=True)
        else:
            self._add_early(penalty, at)
        self._count += 1
        self._value = value if self._value is None else self._value + value
        return value

    def backward(
        self, loss: torch.Tensor, scale: torch.Tensor | Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One backward over ``loss`` and the branch points; return ``loss + sum(penalties)``, detached.

        Args:
            loss: the main loss, a scalar.
            scale: per-sample weights for the penalties' gradients (``"early"`` only): a tensor of shape
                ``(B,)`` for every penalty, or one such tensor per penalty; row ``b`` of the gradient a
                penalty sends into its ``at`` is multiplied by ``scale[b]``. See
                NOTE [ rescaling a penalty's gradient per sample ].

        Raises:
            GradscopeError: a ``scale`` that does not fit, or that some penalty cannot take; a penalty
                that read a trunk tensor made after its ``at``.
        """
        _need_scalar(_F, "`loss`", loss)
        if scale is not None and self.method != "early":
            raise _fail(
                _F,
                f"`scale` needs method='early' (this one is {self.method!r}): with 'retain_graph' the "
                "penalties' gradients are already in the trunk, with 'joint' they are summed with the "
                "loss before any gradient exists.",
            )
        total = loss.detach() if self._value is None else loss.detach() + self._value
        if self.method == "joint":
            full = loss
            for p in self._kept:
                full = full + p
            self._kept.clear()
            full.backward()
            return total
        if self.method == "retain_graph":
            loss.backward()
            return total
        try:
            grads = self._scaled(scale)
            targets = [r.target for r in self._roots]
            try:
                torch.autograd.backward([loss, *targets], [torch.ones_like(loss), *grads])  # type: ignore[arg-type]
            except RuntimeError as e:
                if "backward through the graph a second time" not in str(e):
                    raise
                raise _fail(
                    _F,
                    "the final backward found part of the trunk already freed: a penalty read a trunk "
                    "tensor made after its `at`, so it was taken for part of the penalty's own branch "
                    "and released with it. Pass as `at` the latest trunk tensor each penalty reads "
                    "(the gradients accumulated by this backward are incomplete: zero them).",
                ) from e
            for leaf, g in self._leaf_grads.items():
                leaf.grad = g if leaf.grad is None else leaf.grad + g
        finally:
            self._clear()
        return total

    # ----- early release ---------------------------------------------------------------------
    def _add_early(self, penalty: torch.Tensor, at: torch.Tensor) -> None:
        k = self._count
        at_edge = get_gradient_edge(at)
        self._extend_trunk(at_edge.node)
        p_edge = get_gradient_edge(penalty)
        branch, meets, own_leaves = _walk_branch(p_edge.node, p_edge.output_nr, self._trunk)
        region, ends = _region(meets, branch, self._trunk)
        leaves: list[torch.Tensor] = [n.variable for n in own_leaves]
        edges: list[tuple[Node, int]] = []
        for node, slots in ends.items():
            if _is_leaf(node) and node is not at_edge.node:
                leaves.append(node.variable)
            else:  # a trunk tensor, or `at` itself even when it is a leaf (its gradient is per sample)
                edges.extend((node, nr) for nr in sorted(slots))
        away = [(n, nr) for n, nr in edges if not (n is at_edge.node and nr == at_edge.output_nr)]
        if away and not _edge_roots():
            names = ", ".join(f"{type(n).__name__} (output {nr})" for n, nr in away)
            raise _fail(
                _F,
                f"penalty #{k} meets the trunk away from `at` (at the output of {names}); taking its "
                "gradient there early needs PyTorch 2.7 or later. Pass that tensor as `at`, or use "
                "method='retain_graph'.",
            )
        inputs = [GradientEdge(n, nr) for n, nr in edges] + [get_gradient_edge(leaf) for leaf in leaves]
        if not inputs:
            return
        # see NOTE [ where a branch meets the trunk ]: the region must survive for the final backward
        grads = torch.autograd.grad(penalty, inputs, allow_unused=True, retain_graph=bool(region))
        for (node, nr), g in zip(edges, grads[: len(edges)], strict=True):
            if g is None:
                continue
            is_at = node is at_edge.node and nr == at_edge.output_nr
            self._roots.append(_Root(at if is_at else GradientEdge(node, nr), g, k, is_at))
            if not is_at:
                self._summed.append(
                    f"penalty #{k} meets the trunk at {type(node).__name__} (output {nr}), not at its `at`"
                )
        for leaf, g in zip(leaves, grads[len(edges) :], strict=True):
            if g is None:
                continue
            held = self._leaf_grads.get(leaf)
            self._leaf_grads[leaf] = g if held is None else held + g
            self._summed.append(
                f"penalty #{k} sends gradient into a leaf of shape {tuple(leaf.shape)} (a parameter)"
            )
        if region:
            self._summed.append(f"penalty #{k} back-propagates through {len(region)} trunk node(s)")

    def _extend_trunk(self, root: Node) -> None:
        stack = [root]
        trunk = self._trunk
        while stack:  # iterative: deep graphs must not hit the recursion limit
            node = stack.pop()
            if node is None or node in trunk:
                continue
            trunk[node] = None
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and nxt not in trunk)

    def _scaled(self, scale: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        if scale is None:
            return [r.grad for r in self._roots]
        if self._summed:
            listed = "; ".join(dict.fromkeys(self._summed))
            raise _fail(
                _F,
                f"cannot rescale per sample: {listed}. Such a gradient is already summed over the "
                "samples. Compute those penalties without parameters of their own and from `at` alone, "
                "or fold the weights into the penalty itself.",
            )
        scales = _per_penalty(scale, self._count)
        out = []
        for r in self._roots:
            s = scales[r.penalty]
            if s.dim() != 1 or s.shape[0] != r.grad.shape[0]:
                raise _fail(
                    _F,
                    f"`scale` for penalty #{r.penalty} must have shape ({r.grad.shape[0]},), one weight per "
                    f"row of its `at` {tuple(r.grad.shape)}; got {tuple(s.shape)}.",
                )
            out.append(r.grad * s.detach().to(r.grad).view(-1, *([1] * (r.grad.dim() - 1))))
        return out

    def _clear(self) -> None:
        self._roots.clear()
        self._leaf_grads.clear()
        self._summed.clear()
        # release root-first, see NOTE [ graph nodes are held, never keyed by id() ]
        while self._trunk:
            self._trunk.pop(next(iter(self._trunk)))


def _per_penalty(scale: torch.Tensor | Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    if isinstance(scale, torch.Tensor):
        return [scale] * count
    scales = list(scale)
    if len(scales) != count or not all(isinstance(s, torch.Tensor) for s in scales):
        raise _fail(
            _F, f"`scale` must be one tensor, or a sequence of {count} tensors (one per penalty added)."
        )
    return scales


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")


def _walk_branch(
    start: Node, output_nr: int, trunk: dict[Node, None]
) -> tuple[dict[Node, None], dict[Node, set[int]], list[Node]]:
    """From the penalty's node ``start``: the penalty's own nodes, the trunk nodes they point to (with
    the input slots), and the penalty's own leaves (AccumulateGrad nodes outside the trunk). See
    NOTE [ graph nodes are held, never keyed by id() ]."""
    branch: dict[Node, None] = {}
    meets: dict[Node, set[int]] = {}
    own: dict[Node, None] = {}
    if start in trunk:  # the penalty is itself a trunk tensor
        meets[start] = {output_nr}
        return branch, meets, []
    stack = [start]
    while stack:
        node = stack.pop()
        if node in branch or node in own:
            continue
        if _is_leaf(node):
            own[node] = None
            continue
        branch[node] = None
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if nxt in trunk:
                meets.setdefault(nxt, set()).add(nr)
            elif nxt not in branch and nxt not in own:
                stack.append(nxt)
    return branch, meets, list(own)


def _region(
    meets: dict[Node, set[int]], branch: dict[Node, None], trunk: dict[Node, None]
) -> tuple[dict[Node, None], dict[Node, set[int]]]:
    """The trunk nodes the engine must run (``region``) and the edges where the gradients are taken
    (``ends``). See NOTE [ where a branch meets the trunk ].

    The engine runs a trunk node reached from the penalty when it leads to a node a gradient is taken
    at; the gradients are taken where the branch and the region point into the rest of the trunk.
    Each side depends on the other; growing the region until it stops growing settles both (it only
    grows: a node that led to a meeting point still leads to wherever that point's region ends).
    """
    region: dict[Node, None] = {}
    while True:
        ends: dict[Node, set[int]] = {}
        for src in (*branch, *region):
            for nxt, nr in src.next_functions:
                if nxt is not None and nxt in trunk and nxt not in region:
                    ends.setdefault(nxt, set()).add(nr)
        if len(ends) <= 1:
            return region, ends
        grown = _reaching(meets, ends, trunk)
        if all(n in region for n in grown):
            return region, ends
        region.update(grown)


def _reaching(
    starts: Iterable[Node], goal: dict[Node, set[int]], trunk: dict[Node, None]
) -> dict[Node, None]:
    """Trunk nodes reachable from ``starts`` from which a ``goal`` node is reachable by at least one edge."""
    reaches: dict[Node, bool] = {}
    for start in starts:
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:  # iterative post-order; a graph has no cycles, so a child is done before its parent
            node, done = stack.pop()
            if done:
                reaches[node] = any(
                    nxt is not None and nxt in trunk and (nxt in goal or reaches.get(nxt, False))
                    for nxt, _ in node.next_functions
                )
                continue
            if node in reaches:
                continue
            reaches[node] = False
            stack.append((node, True))
            stack.extend(
                (nxt, False)
                for nxt, _ in node.next_functions
                if nxt is not None and nxt in trunk and nxt not in reaches
            )
    return {n: None for n, r in reaches.items() if r}


@functools.cache
def _edge_roots() -> bool:
    """Whether ``torch.autograd.backward`` takes a ``GradientEdge`` as a root (PyTorch 2.7+)."""
    a = torch.zeros(1, requires_grad=True)
    b = a * 2
    try:
        node = b.grad_fn
        assert node is not None
        torch.autograd.backward([GradientEdge(node, 0)], [torch.ones(1)])
    except (TypeError, RuntimeError, AttributeError):
        return False
    return a.grad is not None and float(a.grad) == 2.0
