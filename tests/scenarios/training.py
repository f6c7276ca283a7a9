"""Everyday training code: lists of losses, gradient accumulation, evaluation without ``no_grad``,
a pretrained backbone left trainable, ``retain_graph`` in a loop, optimizer state, one huge batch,
a deep batch-norm network, and a plain step that fits (the right answer there is no finding).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from ._harness import Advice, Scenario, Wrong

__all__ = ["SCENARIOS"]


def _mlp(n_in: int = 64, width: int = 512, n_out: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, n_out)
    )


def setup_batches() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp()
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "xs": [torch.randn(64, 64) for _ in range(8)],
        "ys": [torch.randint(0, 10, (64,)) for _ in range(8)],
    }


# ----- gradient accumulation with a list of losses -------------------------------------------------
def accum_list(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    losses = []
    for xb, yb in zip(xs, ys, strict=True):
        losses.append(F.cross_entropy(model(xb), yb))
    loss = torch.stack(losses).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def accum_fix(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    opt.zero_grad()
    total = torch.zeros(())
    for xb, yb in zip(xs, ys, strict=True):
        loss = F.cross_entropy(model(xb), yb)
        (loss / len(xs)).backward()  # gradients accumulate; this micro-batch's graph is freed now
        total += loss.detach()
    opt.step()
    return total / len(xs)


ACCUM_FIX = "(loss / len(xs)).backward()  # in the loop, then opt.step() after it: each graph freed at once"


def accum_list_item(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """"losses.append(loss.item())": floats cannot be stacked and back-propagated (raises)."""
    losses = []
    for xb, yb in zip(xs, ys, strict=True):
        losses.append(F.cross_entropy(model(xb), yb).item())
    loss = torch.stack(losses).mean()  # type: ignore[arg-type]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def accum_sum(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    total = 0
    for xb, yb in zip(xs, ys, strict=True):
        total = total + F.cross_entropy(model(xb), yb)
    loss = total / len(xs)
    opt.zero_grad()
    loss.backward()  # type: ignore[union-attr]
    opt.step()
    return loss.detach()  # type: ignore[union-attr]


def accum_sum_item(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """"total += loss.item()": a float has no backward (raises)."""
    total = 0.0
    for xb, yb in zip(xs, ys, strict=True):
        total += F.cross_entropy(model(xb), yb).item()
    loss = total / len(xs)
    opt.zero_grad()
    loss.backward()  # type: ignore[attr-defined]
    opt.step()
    return torch.tensor(loss)


# ----- validation losses kept with their graphs ----------------------------------------------------
def eval_list(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    model.eval()
    val_losses = []
    for xb, yb in zip(xs, ys, strict=True):
        val_losses.append(F.cross_entropy(model(xb), yb))
    return torch.stack(val_losses).mean().item()


def eval_list_fix(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    model.eval()
    val_losses = []
    for xb, yb in zip(xs, ys, strict=True):
        val_losses.append(F.cross_entropy(model(xb), yb).item())
    return sum(val_losses) / len(val_losses)


def eval_list_backward(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    """"(loss / n).backward() on each micro-batch": gradients nobody asked for land in model's .grad."""
    model.eval()
    total = 0.0
    for xb, yb in zip(xs, ys, strict=True):
        loss = F.cross_entropy(model(xb), yb)
        (loss / len(xs)).backward()
        total += loss.item()
    return total / len(xs)


# ----- an evaluation forward without no_grad, then a training step ------------------------------------
def setup_eval_train() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp()
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "x_val": torch.randn(2048, 64),
        "y_val": torch.randint(0, 10, (2048,)),
        "x": torch.randn(64, 64),
        "y": torch.randint(0, 10, (64,)),
    }


def eval_train(model: nn.Module, opt: Any, x_val: Any, y_val: Any, x: Any, y: Any) -> Any:
    model.eval()
    scores = model(x_val)
    acc = (scores.argmax(1) == y_val).float().mean()
    model.train()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return scores, acc, loss.detach()


def eval_train_fix(model: nn.Module, opt: Any, x_val: Any, y_val: Any, x: Any, y: Any) -> Any:
    model.eval()
    with torch.no_grad():
        scores = model(x_val)
    acc = (scores.argmax(1) == y_val).float().mean()
    model.train()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return scores, acc, loss.detach()


def eval_train_frozen(model: nn.Module, opt: Any, x_val: Any, y_val: Any, x: Any, y: Any) -> Any:
    """"model.requires_grad_(False)": the training step after it has nothing to train (raises)."""
    model.requires_grad_(False)
    return eval_train(model, opt, x_val, y_val, x, y)


# ----- a pretrained backbone left trainable; only the head is trained ------------------------------------
def setup_backbone() -> dict[str, Any]:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    backbone.eval()
    head = nn.Sequential(nn.Linear(512, 10))
    return {
        "backbone": backbone,
        "head": head,
        "opt": torch.optim.Adam(head.parameters(), lr=1e-3),
        "xs": [torch.randn(256, 64) for _ in range(2)],
        "ys": [torch.randint(0, 10, (256,)) for _ in range(2)],
    }


def backbone_user(backbone: nn.Module, head: nn.Module, opt: Any, xs: Any, ys: Any) -> torch.Tensor:
    for xb, yb in zip(xs, ys, strict=True):
        feats = backbone(xb)
        loss = F.cross_entropy(head(feats), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


def backbone_fix(backbone: nn.Module, head: nn.Module, opt: Any, xs: Any, ys: Any) -> torch.Tensor:
    for xb, yb in zip(xs, ys, strict=True):
        with torch.no_grad():
            feats = backbone(xb)
        loss = F.cross_entropy(head(feats), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


def backbone_head_no_grad(backbone: nn.Module, head: nn.Module, opt: Any, xs: Any, ys: Any) -> torch.Tensor:
    """"Run head under torch.no_grad()": the model being trained gets no gradient (raises)."""
    for xb, yb in zip(xs, ys, strict=True):
        feats = backbone(xb)
        with torch.no_grad():
            out = head(feats)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


# ----- retain_graph=True in a training loop -------------------------------------------------------------
def retain_loop(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    for xb, yb in zip(xs, ys, strict=True):
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
    return loss.detach()


def retain_loop_fix(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    for xb, yb in zip(xs, ys, strict=True):
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


def retain_loop_summed(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """"Sum the losses and call backward once": one step instead of eight."""
    losses = [F.cross_entropy(model(xb), yb) for xb, yb in zip(xs, ys, strict=True)]
    opt.zero_grad()
    sum(losses).backward()  # type: ignore[union-attr]
    opt.step()
    return losses[-1].detach()


def retain_loop_no_grad(model: nn.Module, opt: Any, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """"model under torch.no_grad()": nothing to train (raises)."""
    for xb, yb in zip(xs, ys, strict=True):
        with torch.no_grad():
            out = model(xb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
    return loss.detach()


# ----- optimizer state: Adam on a model that is large next to its activations --------------------------
def setup_adam() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())))
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3), "x": torch.randn(16, 512)}


def adam(model: nn.Module, opt: Any, x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return loss.detach()


def adam_fix(model: nn.Module, opt: Any, x: torch.Tensor) -> torch.Tensor:
    # one optimizer per parameter, stepped as soon as its gradient is complete; the gradient is
    # freed right away, so only one parameter's gradient exists at a time
    opts = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    try:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return loss.detach()


ADAM_FIX = (
    "opts = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}\n"
    "for p in model.parameters(): p.register_post_accumulate_grad_hook(lambda p: (opts[p].step(), "
    "opts[p].zero_grad()))  # step each parameter in backward; its gradient is freed at once"
)


def adam_set_to_none(model: nn.Module, opt: Any, x: torch.Tensor) -> torch.Tensor:
    """"opt.zero_grad(set_to_none=True)": the gradients are alive at the step either way."""
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return loss.detach()


def adam_sgd(model: nn.Module, opt: Any, x: torch.Tensor) -> torch.Tensor:
    """"Use an optimizer with less state (SGD)": another training run."""
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(3):
        sgd.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        sgd.step()
    return loss.detach()


# ----- one huge batch ------------------------------------------------------------------------------------
def setup_huge() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(128, 512, 10)
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "x": torch.randn(2048, 128),
        "y": torch.randint(0, 10, (2048,)),
    }


def huge(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def huge_fix(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    total = torch.zeros(())
    for xb, yb in zip(x.chunk(8), y.chunk(8), strict=True):
        loss = F.cross_entropy(model(xb), yb) * len(xb) / len(x)
        loss.backward()
        total += loss.detach()
    opt.step()
    return total


HUGE_FIX = (
    "for xb, yb in zip(x.chunk(8), y.chunk(8)):\n"
    "    (F.cross_entropy(model(xb), yb) * len(xb) / len(x)).backward()   # then opt.step() once"
)


def huge_checkpoint(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Checkpointing the whole model: the recompute in backward holds the same activations."""
    loss = F.cross_entropy(checkpoint(model, x, use_reentrant=False), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def huge_no_grad(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """"model under torch.no_grad()": nothing to train (raises)."""
    with torch.no_grad():
        out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


# ----- a deep batch-norm network on one batch: checkpointing, with batch norm kept exact ----------------
def setup_deep_bn() -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU()) for _ in range(8)]
    model = nn.Sequential(*blocks, nn.Linear(256, 10))
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "x": torch.randn(512, 256),
        "y": torch.randint(0, 10, (512,)),
    }


class batch_norm_stats_restored:  # noqa: N801 - a context manager, read like a function
    """Put the batch-norm running statistics back after the recompute, which updated them again.

    A class rather than a generator: checkpoint enters the same object at every recompute."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [m for m in module.modules() if isinstance(m, _NormBase)]
        self.kept: list[list[torch.Tensor]] = []

    def __enter__(self) -> None:
        self.kept = [[b.clone() for b in m.buffers()] for m in self.norms]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, bufs in zip(self.norms, self.kept, strict=True):
                for b, v in zip(m.buffers(), bufs, strict=True):
                    b.copy_(v)


def deep_bn_checkpointed(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for block in model[:-1]:  # type: ignore[index]
        h = checkpoint(
            block,
            h,
            use_reentrant=False,
            context_fn=lambda b=block: (contextlib.nullcontext(), batch_norm_stats_restored(b)),
        )
    loss = F.cross_entropy(model[-1](h), y)  # type: ignore[index]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


DEEP_BN_FIX = (
    "for block in model[:-1]:\n"
    "    h = checkpoint(block, h, use_reentrant=False, context_fn=lambda: (nullcontext(), "
    "batch_norm_stats_restored(block)))   # the recompute must not move running_mean / num_batches_tracked"
)


def deep_bn_plain_checkpoint(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain checkpointing: each block's batch norm updates its running statistics twice."""
    h = x
    for block in model[:-1]:  # type: ignore[index]
        h = checkpoint(block, h, use_reentrant=False)
    loss = F.cross_entropy(model[-1](h), y)  # type: ignore[index]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def deep_bn_micro_batches(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Micro-batches: batch norm normalizes each micro-batch by its own statistics (another model)."""
    opt.zero_grad()
    total = torch.zeros(())
    for xb, yb in zip(x.chunk(4), y.chunk(4), strict=True):
        loss = F.cross_entropy(model(xb), yb) / 4
        loss.backward()
        total += loss.detach()
    opt.step()
    return total


# ----- a plain training step that fits ---------------------------------------------------------------------
def setup_plain() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _mlp(64, 256, 10)
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        "x": torch.randn(64, 64),
        "y": torch.randint(0, 10, (64,)),
    }


def plain(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def plain_checkpoint(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Checkpointing a step whose activations are small: the same peak, and forward runs twice."""
    loss = F.cross_entropy(checkpoint(model, x, use_reentrant=False), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


_NO_GRAD_TRAINED = "model is trained by this code: no_grad or requires_grad_(False) removes its gradients"

SCENARIOS = [
    Scenario(
        name="accum_list",
        title="gradient accumulation: losses.append(cross_entropy(model(xb), yb)); stack(losses).mean().backward()",
        origin="common",
        setup=setup_batches,
        user=accum_list,
        fix=accum_fix,
        fix_code=ACCUM_FIX,
        right=(Advice("backward_per_micro_batch", target="loss"), Advice("checkpoint", target="model")),
        wrong=(
            Wrong(Advice("item", target="losses"), accum_list_item, "changes the result",
                  "the mean of the losses is back-propagated: numbers cannot be (raises)",
                  error="expected Tensor as element 0"),
        ),
        peak_user=5151880,
        peak_fix=2648120,
        budget=3899392,
    ),
    Scenario(
        name="accum_sum",
        title="gradient accumulation: total = total + cross_entropy(model(xb), yb); (total / n).backward()",
        origin="common",
        setup=setup_batches,
        user=accum_sum,
        fix=accum_fix,
        fix_code=ACCUM_FIX,
        right=(Advice("backward_per_micro_batch", target="loss"), Advice("checkpoint", target="model")),
        wrong=(
            Wrong(Advice("item"), accum_sum_item, "changes the result",
                  "the total is back-propagated: a float has no backward (raises)",
                  error="'float' object has no attribute 'backward'"),
        ),
        peak_user=5151824,
        peak_fix=2648120,
        budget=3899392,
    ),
    Scenario(
        name="eval_losses_list",
        title="validation without no_grad: val_losses.append(cross_entropy(model(xb), yb)), averaged with .item()",
        origin="common",
        setup=setup_batches,
        user=eval_list,
        fix=eval_list_fix,
        fix_code="val_losses.append(F.cross_entropy(model(xb), yb).item())  # or the loop under torch.no_grad()",
        right=(Advice("item", target="val_losses"), Advice("no_grad", target="model")),
        wrong=(
            Wrong(Advice("backward_per_micro_batch"), eval_list_backward, "changes the result",
                  "nothing differentiates validation losses: backward puts gradients into model's .grad"),
        ),
        peak_user=2246200,
        peak_fix=393216,
        budget=1318912,
        rtol=1e-5,
    ),
    Scenario(
        name="eval_then_train",
        title="scores = model(x_val) in eval() without no_grad, kept in a variable, then a training step",
        origin="common",
        setup=setup_eval_train,
        user=eval_train,
        fix=eval_train_fix,
        fix_code="with torch.no_grad():\n    scores = model(x_val)",
        right=(Advice("no_grad", target="model"),),
        wrong=(
            Wrong(Advice("freeze", target="model"), eval_train_frozen, "changes the result",
                  "model is trained right after: requires_grad_(False) leaves the step nothing to train",
                  error="does not require grad"),
        ),
        peak_user=12582912,
        peak_fix=8388608,
        budget=10485760,
    ),
    Scenario(
        name="trainable_backbone",
        title="a pretrained backbone (eval, requires grad) feeds a head trained by Adam(head.parameters())",
        origin="common",
        setup=setup_backbone,
        user=backbone_user,
        fix=backbone_fix,
        fix_code="with torch.no_grad():\n    feats = backbone(xb)",
        right=(Advice("no_grad_or_freeze", target="backbone"),),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target="head"), backbone_head_no_grad, "changes the result",
                  "head is the model being trained: without its graph loss.backward() raises",
                  error="does not require grad"),
        ),
        ignore={"backbone.*.grad": "no optimizer reads backbone's gradients (opt trains head only)"},
        peak_user=5968008,
        peak_fix=1634436,
        budget=3801088,
    ),
    Scenario(
        name="retain_graph_loop",
        title="a training loop calling loss.backward(retain_graph=True) at every step",
        origin="common",
        setup=setup_batches,
        user=retain_loop,
        fix=retain_loop_fix,
        fix_code="loss.backward()  # without retain_graph=True: nothing backpropagates through this graph again",
        right=(Advice("drop_retain_graph", target="loss"),),
        wrong=(
            Wrong(Advice("sum_losses"), retain_loop_summed, "changes the result",
                  "one backward over the summed losses is one optimizer step instead of eight"),
            Wrong(Advice("no_grad_or_freeze", target="model"), retain_loop_no_grad, "changes the result",
                  _NO_GRAD_TRAINED,
                  error="does not require grad"),
        ),
        peak_user=1862192,
        peak_fix=1597484,
        budget=1729536,
    ),
    Scenario(
        name="adam_state",
        title="Adam on a 4 x Linear(512, 512) model with a small batch, zero_grad(set_to_none=False)",
        origin="common",
        setup=setup_adam,
        user=adam,
        fix=adam_fix,
        fix_code=ADAM_FIX,
        right=(Advice("step_in_backward"),),
        wrong=(
            Wrong(Advice("other_optimizer"), adam_sgd, "changes the result",
                  "another optimizer is another training run"),
            Wrong(Advice("set_to_none"), adam_set_to_none, "does not lower the peak",
                  "the gradients are alive when the optimizer steps, whatever zero_grad did before",
                  peak=14706736),
        ),
        ignore={"model.*.grad": "the next zero_grad clears them; the fix frees each gradient once its "
                                "parameter has stepped"},
        peak_user=14706736,
        peak_fix=11681844,
        budget=13194240,
        rtol=1e-4,
    ),
    Scenario(
        name="huge_batch",
        title="one training step on one huge batch (2048 x 128 through a 512-wide MLP)",
        origin="common",
        setup=setup_huge,
        user=huge,
        fix=huge_fix,
        fix_code=HUGE_FIX,
        right=(Advice("backward_per_micro_batch"),),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target="model"), huge_no_grad, "changes the result",
                  _NO_GRAD_TRAINED,
                  error="does not require grad"),
            Wrong(Advice("checkpoint"), huge_checkpoint, "does not lower the peak",
                  "the recompute in backward holds the same activations again", peak=16802800),
        ),
        peak_user=16797744,
        peak_fix=3958836,
        budget=10378240,
        rtol=1e-4,
    ),
    Scenario(
        name="deep_batchnorm",
        title="one step of 8 x (Linear 256, BatchNorm1d, ReLU) on a batch of 512: checkpointing, batch norm exact",
        origin="common",
        setup=setup_deep_bn,
        user=huge,
        fix=deep_bn_checkpointed,
        fix_code=DEEP_BN_FIX,
        right=(Advice("checkpoint_bn_exact"),),
        wrong=(
            Wrong(
                Advice("checkpoint"),
                deep_bn_plain_checkpoint,
                "changes the result",
                "plain checkpointing runs each block's forward again: batch norm's running statistics move "
                "twice (num_batches_tracked 2 instead of 1)",
            ),
            Wrong(
                Advice("backward_per_micro_batch"),
                deep_bn_micro_batches,
                "changes the result",
                "batch norm normalizes each micro-batch by its own mean and variance: other gradients",
            ),
        ),
        peak_user=9465904,
        peak_fix=6351352,
        budget=7700 * 1024,
    ),
    Scenario(
        name="plain_step",
        title="one ordinary training step that fits: nothing to fix",
        origin="common",
        setup=setup_plain,
        user=plain,
        fix=None,
        fix_code="",
        right=(),
        wrong=(
            Wrong(Advice("no_grad_or_freeze", target="model"), huge_no_grad, "changes the result",
                  _NO_GRAD_TRAINED,
                  error="does not require grad"),
            Wrong(Advice("checkpoint"), plain_checkpoint, "does not lower the peak",
                  "checkpointing saves the activations it recomputes; here they are small", peak=680020),
        ),
        peak_user=680020,
        peak_fix=None,
    ),
]
