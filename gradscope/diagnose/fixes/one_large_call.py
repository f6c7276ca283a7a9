from __future__ import annotations

import torch
from torch import nn

from gradscope._names import code_path
from gradscope.diagnose.facts import CHUNKS, GRAPH_CATEGORIES, Context
from gradscope.diagnose.measure import micro_batch_proxy, proxy_peak
from gradscope.diagnose.report import Finding, GraphHolder
from gradscope.recording import Category, format_bytes


# ----- one large call: micro-batches, or checkpointing with batch norm exact -------------------------
def propose(ctx: Context, holders: list[GraphHolder]) -> list[Finding]:
    """Activations of one call of one model dominate: without batch norm, micro-batches give the
    same gradients (for a mean loss, each micro-batch's loss scaled by its share); with batch
    norm, micro-batches change the statistics, so checkpoint the blocks, with the running
    statistics kept exact through the recompute."""
    g = ctx.g
    if any(c.create_graph for c in g.calls) or ctx.raised() or (not g.calls and ctx.moment != "failure"):
        return []
    root = g.main_root(order=0)
    model = ctx.module(root)
    if model is None or g.calls_of(root)[0] != 1 or not model.training:
        return []
    acts = sum(a.bytes for a in g.alive if a.category in GRAPH_CATEGORIES or g.alloc_root(a) == root)
    if acts < 0.5 * ctx.demand:
        return []
    name = ctx.model_name(root)
    bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.training]
    if not bn:
        x = ctx.tensor_named(g.first_input_shape(root)) or "x"
        rest = ctx.without_model_run(root)
        xv = ctx.ns.get(x)
        own = proxy_peak(micro_batch_proxy(list(xv.chunk(CHUNKS)) if isinstance(xv, torch.Tensor) else None, CHUNKS), model)
        if own is None:
            return []
        return [
            Finding(
                pattern="micro_batches",
                bytes=acts,
                module=root,
                message=(
                    f"one call of {name} on `{x}` saves {format_bytes(acts)} of activations and backward "
                    "temporaries at the peak: they grow with the batch"
                ),
                suggestion=(
                    f"split the batch into {CHUNKS} micro-batches and call backward on each, scaled by its "
                    "share of the batch: the same gradients, one micro-batch's activations alive at a time"
                ),
                code=(
                    f"for xb, yb in zip({x}.chunk({CHUNKS}), y.chunk({CHUNKS})):\n"
                    f"    (loss_fn({name}(xb), yb) * len(xb) / len({x})).backward()   # then opt.step() once"
                ),
                saves_bytes=ctx.saving(rest + own),
            )
        ]
    blocks = g.blocks(root)
    if len(blocks) < 2:
        return []
    per = {b: sum(a.bytes for a in g.alive if a.category is Category.ACTIVATION and g.block_of(a) == b) for b in blocks}
    kept_inputs = sum(g.block_input_bytes(b) for b in blocks[1:])
    saving = sum(per.values()) - kept_inputs - max(per.values())
    if saving <= 0:
        return []
    path = code_path(blocks[0].rsplit(".", 1)[0]) if "." in blocks[0] else name
    return [
        Finding(
            pattern="deep_activations",
            bytes=acts,
            module=root,
            message=(
                f"{len(blocks)} blocks of {name} save {format_bytes(sum(per.values()))} of activations, alive "
                f"together at the peak; {name} has batch norm, so micro-batches would change its statistics"
            ),
            suggestion=(
                "checkpoint each block (its activations are recomputed in backward, one block at a time), "
                "and restore the batch-norm running statistics around the recompute so that they move once"
            ),
            code=(
                "class keep_bn_stats:  # puts running_mean / running_var / num_batches_tracked back after the recompute\n"
                "    def __init__(ctx, m): ctx.bns = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._NormBase)]\n"
                "    def __enter__(ctx): ctx.kept = [[t.clone() for t in b.buffers()] for b in ctx.bns]\n"
                "    def __exit__(ctx, *e): [t.copy_(k) for b, ks in zip(ctx.bns, ctx.kept) for t, k in zip(b.buffers(), ks)]\n"
                f"for block in {path}[:{len(blocks)}]:\n"
                "    h = checkpoint(block, h, use_reentrant=False, context_fn=lambda b=block: (nullcontext(), keep_bn_stats(b)))"
            ),
            saves_bytes=ctx.saving(ctx.demand - saving),
        )
    ]
