"""Releasing penalty branches early (the seed-003 pattern).

``loss = main(trunk) + sum_k penalty_k(h_k)`` where each penalty branches off the trunk at ``h_k``.
Keeping every penalty until one joint backward keeps every branch's saved tensors alive at once. Each
branch only needs the gradient flowing into its branch point, so :class:`PenaltyBranches` takes
``d penalty_k / d h_k`` as soon as the penalty exists (``autograd.grad`` to a non-leaf tensor runs
only the branch and frees its buffers), drops the branch, and finishes with one backward over the loss
and the branch points: ``backward([loss, h_1, ..., h_K], [1, g_1, ..., g_K])``. The trunk is
traversed once, and the gradients equal the joint backward's.
"""

from __future__ import annotations

import torch

from gradscope.strategies._checks import _fail, _need_scalar

__all__ = ["PENALTY_METHODS", "PenaltyBranches"]

PENALTY_METHODS = ("early", "retain_graph", "joint")

_F = "PenaltyBranches"


class PenaltyBranches:
    """Collect penalties that branch off a trunk, back-propagating each one as the method says.

    Methods:
        ``"early"``: gradient of the penalty to its branch point at once, branch freed, one backward
            at the end over loss and branch points (trunk traversed once).
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
        ...     _ = pb.add(h.exp().pow(2).mean(), at=h)
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
        self._points: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        self._kept: list[torch.Tensor] = []
        self._value: torch.Tensor | None = None
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, penalty: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Register one penalty and the trunk tensor it branches from; return its value, detached.

        Args:
            penalty: a scalar computed from ``at`` (and possibly leaves of its own).
            at: the trunk tensor the branch starts from; must require grad.

        Returns:
            The penalty's value, detached (for logging or for the loss total).
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
        self._count += 1
        value = penalty.detach()
        self._value = value if self._value is None else self._value + value
        if self.method == "joint":
            self._kept.append(penalty)
        elif self.method == "retain_graph":
            penalty.backward(retain_graph=True)
        else:
            # Gradient to the branch point only; leaves used inside the branch get theirs in the same
            # pass. Without retain_graph the branch's buffers are freed by this call.
            leaves = _branch_leaves(penalty, at)
            grads = torch.autograd.grad(penalty, [at, *leaves], allow_unused=True)
            g_at = grads[0]
            for leaf, g in zip(leaves, grads[1:], strict=True):
                if g is not None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
            if g_at is not None:
                self._points.append(at)
                self._grads.append(g_at)
        return value

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """One backward over ``loss`` and the branch points; return ``loss + sum(penalties)``, detached."""
        _need_scalar(_F, "`loss`", loss)
        total = loss.detach() if self._value is None else loss.detach() + self._value
        if self.method == "joint":
            full = loss
            for p in self._kept:
                full = full + p
            self._kept.clear()
            full.backward()
        elif self.method == "retain_graph":
            loss.backward()
        else:
            torch.autograd.backward([loss, *self._points], [torch.ones_like(loss), *self._grads])
            self._points.clear()
            self._grads.clear()
        return total


def _branch_leaves(penalty: torch.Tensor, at: torch.Tensor) -> list[torch.Tensor]:
    """Leaves requiring grad reached from ``penalty`` without passing through ``at`` (the branch's own)."""
    stop = at.grad_fn
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [penalty.grad_fn]
    while stack:  # iterative: deep graphs must not hit the recursion limit
        node = stack.pop()
        if node is None or node is stop or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None:
            if var is not at:
                leaves.append(var)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions)
    return leaves
