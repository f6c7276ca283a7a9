"""The seed patterns as tested, plain-PyTorch functions (no gradscope hooks needed).

This module is a face: each name below is defined in the module it is imported from.
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
