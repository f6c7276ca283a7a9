"""The seed patterns as tested, plain-PyTorch functions (no gradscope hooks needed).

=========================================  ==================================================
pattern                                    functions
=========================================  ==================================================
mixed second derivative, frozen model      :func:`mixed_grad` (``create_graph`` / ``forward_ad`` / ``split``),
                                           :func:`grad_of_input_grads` (the same, over many ``z_i``),
                                           :func:`input_grad` (a drop-in for ``autograd.grad(..., create_graph=True)``)
loss over many outputs of one model        :func:`many_inputs_backward` (``stacked`` / ``two_pass``)
hypergradient through optimizer steps      :func:`hypergradient` (``unrolled`` / ``finite_difference`` /
                                           ``inplace``), :func:`unrolled_params` (``truncate=``),
                                           :func:`finite_difference_grad`
early release of penalty branches          :class:`PenaltyBranches` (``early`` / ``retain_graph`` / ``joint``),
                                           ``backward(loss, scale=)``
Jacobians                                  :func:`jacobian` (``loop`` / ``batched`` / ``repeat`` /
                                           ``double_vjp`` / ``jacrev`` / ``jacfwd`` / ``vmap``)
=========================================  ==================================================

Example:
    >>> import torch
    >>> from gradscope import strategies
    >>> J = strategies.jacobian(torch.sin, torch.zeros(3), method="jacfwd")
    >>> torch.equal(J, torch.eye(3))
    True
"""

from __future__ import annotations

from gradscope._analyses.strategies.hyper import (
    HYPERGRAD_METHODS,
    OPTIMIZERS,
    finite_difference_grad,
    hypergradient,
    unrolled_params,
)
from gradscope._analyses.strategies.jacobian import JACOBIAN_METHODS, jacobian
from gradscope._analyses.strategies.many_inputs import MANY_INPUTS_METHODS, many_inputs_backward
from gradscope._analyses.strategies.mixed import (
    INPUT_GRADS_METHODS,
    MIXED_GRAD_METHODS,
    frozen,
    grad_of_input_grads,
    input_grad,
    mixed_grad,
)
from gradscope._analyses.strategies.penalties import PENALTY_METHODS, PenaltyBranches

__all__ = [
    "HYPERGRAD_METHODS",
    "INPUT_GRADS_METHODS",
    "JACOBIAN_METHODS",
    "MANY_INPUTS_METHODS",
    "MIXED_GRAD_METHODS",
    "OPTIMIZERS",
    "PENALTY_METHODS",
    "PenaltyBranches",
    "finite_difference_grad",
    "frozen",
    "grad_of_input_grads",
    "input_grad",
    "hypergradient",
    "jacobian",
    "many_inputs_backward",
    "mixed_grad",
    "unrolled_params",
]
