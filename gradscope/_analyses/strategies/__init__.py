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

__all__: list[str] = []  # the names are the face's: gradscope.strategies takes each from its module
