from __future__ import annotations

import torch
from torch import nn

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.indexed import GRAPH_CATEGORIES, LINEAR_MERGES
from gradscope._analyses.diagnose.proxies import micro_batch_proxy, proxy_peak, two_pass_proxy
from gradscope._analyses.diagnose.result import Finding, GraphHolder
from gradscope._analyses.diagnose.toolbox.checkpoint import wrapped_forwards
from gradscope._model.recording import format_bytes


# ----- one model called on many inputs, one loss --------------------------------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Seed 001 and gradient accumulation: one model called on many inputs whose graphs are all
    alive at once. When the loss is a sum or mean of per-input terms, a backward per
    micro-batch gives the same gradients and frees each graph at once; when it couples the
    outputs (a variance, a logsumexp), ``many_inputs_backward(method="two_pass")`` keeps one
    graph at a time (with batch norm and dropout exact). At a failure before the loss was
    formed the coupling is unknown: two_pass is right either way."""
    g = ctx.g
    if any(c.create_graph for c in g.calls) or ctx.raised():
        return []
    if not g.calls and ctx.moment != "failure":
        return []  # see `_graphs_nobody_differentiates`
    root = g.main_root(order=0)
    model = ctx.module(root)
    if model is None:
        return []
    n, entries = g.calls_of(root)
    if n < 2:
        return []
    if not g.calls and not model.training:
        return []
    acts = sum(a.bytes for a in g.alive if a.category in GRAPH_CATEGORIES and g.alloc_root(a) == root)
    if acts <= 0:
        return []
    merge = g.merge_names(entries)
    linear = bool(merge) and merge <= LINEAR_MERGES
    name = ctx.model_name(root)
    xs = ctx.tensor_list(n, g.input_shapes(root)) or "inputs"
    shape = g.first_input_shape(root)
    given = ctx.ns.get(xs)
    if not isinstance(given, list | tuple) and shape is not None:  # inputs made inline: their recorded shape
        given = [torch.zeros(shape) for _ in range(n)]
    rest = ctx.without_model_run(root)
    if linear:
        own = proxy_peak(micro_batch_proxy(given, n), model)
        if own is None:
            return []
        mean = bool(merge & {"MeanBackward0", "MeanBackward1", "DivBackward0"})
        scale = f" / len({xs})" if mean else ""
        return [
            Finding(
                pattern="graphs_held",
                bytes=acts,
                variable=next((h.variable for h in holders if h.live_bytes > 0), None),
                module=root,
                message=(
                    f"{n} calls of {name} keep their graphs alive together ({format_bytes(acts)} at the peak) "
                    "for one backward over a sum of their losses"
                ),
                suggestion=(
                    f"checkpoint {name}: each call keeps only its input, and backward recomputes one call's "
                    "activations at a time (the same gradients, dropout masks replayed"
                    + (", batch-norm statistics moved once" if _bn(model) else "") + "); "
                    "or call backward on each micro-batch's loss inside the loop: the gradients add up in .grad "
                    "to the same values, and each graph is freed at once"
                ),
                code=f"(loss{scale}).backward()  # in the loop, for each micro-batch; opt.step() after it",
                saves_bytes=ctx.saving(rest + own),
                uses=(name,),
            )
        ]
    own = proxy_peak(two_pass_proxy(given, n), model)
    if own is None:
        return []
    bn = _bn(model)
    coupled = "couples them" if merge else "is formed from all of them (if it only sums them, a backward per micro-batch is simpler)"
    return [
        Finding(
            pattern="many_outputs",
            bytes=acts,
            variable=next((h.variable for h in holders if h.live_bytes > 0), None),
            module=root,
            message=(
                f"{n} calls of {name} keep their graphs alive together ({format_bytes(acts)} at the peak) "
                f"for one loss that {coupled}"
            ),
            suggestion=(
                f"checkpoint {name}: each call keeps only its input, and backward recomputes one call's "
                "activations at a time (the same gradients, dropout masks replayed"
                + (", batch-norm statistics moved once" if bn else "") + "); gradscope.strategies."
                f"many_inputs_backward({name}, {xs}, loss_of_outputs, method=\"two_pass\") does the same in two passes"
            ),
            code=f'L = many_inputs_backward({name}, {xs}, g, method="two_pass")  # g(zs): your loss on the stacked outputs',
            saves_bytes=ctx.saving(rest + own),
            uses=(name,),
        )
    ]


def _bn(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())


def rewrite(ctx: Context, f: Finding, source: str) -> tuple[str, str] | None:
    """Your step as it is, with the model checkpointed once before it: every call's activations
    are recomputed in backward, one call at a time."""
    model = ctx.ns.get(f.uses[0]) if f.uses else None
    if not isinstance(model, nn.Module):
        return None
    return wrapped_forwards([f.uses[0]], _bn(model)), source
