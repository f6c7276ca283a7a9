"""The fixes the diagnosis knows, one module each: ``propose(context, holders)`` reads the facts and returns
findings (each a fix with its code and what it saves). ``REGISTRY`` is the order they are asked in."""

from __future__ import annotations

from gradscope._analyses.diagnose.fixes import (
    detach_output,
    forward_ad,
    frozen_model,
    graphs_unused,
    inplace_cut,
    jacobian,
    many_calls,
    no_grad_forward,
    penalty_branches,
    retain_graph,
)

REGISTRY = (
    forward_ad,
    jacobian,
    graphs_unused,
    no_grad_forward,
    many_calls,
    frozen_model,
    detach_output,
    penalty_branches,
    retain_graph,
)

__all__ = ["REGISTRY", "inplace_cut"]
