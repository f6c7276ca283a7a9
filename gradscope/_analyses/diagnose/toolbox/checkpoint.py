"""Activation checkpointing of the repeated blocks (non-reentrant): their activations are recomputed
in backward, one block at a time. A ``transformers`` model uses its own switch; any other model has
its blocks' ``forward`` wrapped, with batch-norm running statistics put back after the recompute so
that they move once. Under a budget, the fewest blocks that make the step fit (least recompute)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, compose
from gradscope._analyses.diagnose.toolbox._common import has_batch_norm, models
from gradscope._model.names import code_path
from gradscope._model.recording import Category

PATTERN = "deep_activations"  # the name its finding and notes go by

_KEEP_BN = (
    "class KeepBatchNormStats:  # the recompute must not move the running statistics a second time\n"
    "    def __init__(self, module):\n"
    "        self.buffers = [b for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) for b in m.buffers()]\n"
    "    def __enter__(self):\n"
    "        self.kept = [b.clone() for b in self.buffers]\n"
    "    def __exit__(self, *exc):\n"
    "        for b, k in zip(self.buffers, self.kept):\n"
    "            b.copy_(k)\n"
)


def _generic(name: str, paths: list[str], bn: bool) -> str:
    return wrapped_forwards([code_path(f"{name}.{p}") for p in paths], bn)


def wrapped_forwards(blocks_code: list[str], bn: bool) -> str:
    """Set-up code that checkpoints each of the modules named by ``blocks_code`` (expressions in
    the user's names): its ``forward`` wrapped in a non-reentrant checkpoint (dropout masks
    replayed), with batch-norm running statistics put back after the recompute when ``bn``."""
    blocks = ", ".join(blocks_code)
    lines = ["from torch.utils.checkpoint import checkpoint"]
    if bn:
        lines.insert(0, "import contextlib")
        lines.append(_KEEP_BN.rstrip("\n"))
    lines.append(f"for block in [{blocks}]:")
    if bn:
        lines.append("    block.forward = lambda *args, f=block.forward, b=block, **kwargs: checkpoint(f, *args, "
                     "use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), KeepBatchNormStats(b)), **kwargs)")
    else:
        lines.append("    block.forward = lambda *args, f=block.forward, **kwargs: checkpoint(f, *args, "
                     "use_reentrant=False, **kwargs)")
    return "\n".join(lines) + "\n"


_MOST = 12  # segments tried at most


def transformers_switch(model: nn.Module) -> str | None:
    """The call that turns on a ``transformers`` model's own activation checkpointing, non-reentrant,
    in the name the installed ``transformers`` documents: ``activation_checkpointing_enable`` where
    it has it (it deprecates ``gradient_checkpointing_enable`` with a FutureWarning), else
    ``gradient_checkpointing_enable``. None for a model without the switch."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        return 'activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})'
    if callable(getattr(model, "gradient_checkpointing_enable", None)):
        return 'gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    return None


def segments(ctx: Context, name: str, model: nn.Module) -> list[str]:
    """Submodules of ``model`` to checkpoint, most saved activations first (from the recording),
    none inside another, none holding more than half of them (a segment's recompute has its own
    activations alive at once), each holding at least 3 %."""
    saved: dict[str, int] = {}
    prefix = name + "."
    for a in ctx.rec.allocations:
        if a.category is not Category.ACTIVATION or not a.module or not a.module.startswith(prefix):
            continue
        parts = a.module[len(prefix):].split(".")
        for i in range(1, len(parts) + 1):
            key = ".".join(parts[:i])
            saved[key] = saved.get(key, 0) + a.bytes
    total = sum(b for k, b in saved.items() if "." not in k)
    if total <= 0:
        return []
    picked: list[str] = []
    for path, b in sorted(saved.items(), key=lambda kv: (-kv[1], kv[0].count("."), kv[0])):
        if b > total / 2 or b < 0.03 * total or len(picked) >= _MOST:
            continue
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, nn.ModuleList | nn.ModuleDict) or not any(True for _ in m.parameters()):
            continue
        if any(path.startswith(p + ".") or p.startswith(path + ".") for p in picked):
            continue
        picked.append(path)
    return picked


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None:
        return []
    out: list[tuple[Finding, Any]] = []
    for name, model in models(ctx, bench.source)[:1]:
        if not model.training:
            continue
        switch = transformers_switch(model)
        with warnings.catch_warnings():  # transformers renames the property (a FutureWarning)
            warnings.simplefilter("ignore")
            if getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False)):
                continue
        message = f"the activations of {name}'s blocks are alive together until backward reaches them"
        if switch:
            setup = f'{name}.{switch}\n'
            trial = bench.run(bench.source, setup=setup)
            what = "every block of the model (transformers' own switch)"
        else:
            plan = segments(ctx, name, model)
            if not plan:
                continue
            bn = has_batch_norm(model)
            trial, k = None, len(plan)
            if room is not None:  # the fewest segments, most saved activations first, that make the step fit
                for k in range(1, len(plan) + 1):
                    trial = bench.fitted(bench.run(bench.source, setup=_generic(name, plan[:k], bn)), room)
                    if trial.error is not None or trial.same is False or room.fits(trial):
                        break
            if trial is None:
                trial = bench.run(bench.source, setup=_generic(name, plan, bn))
            setup = _generic(name, plan[:k], bn)
            what = (f"{k} submodule{'s' if k != 1 else ''} of {name} (those that save the most activations)"
                    + (" with batch-norm running statistics put back after the recompute" if bn else ""))
        assert trial is not None
        user = bench.user()
        saved = None if user.peak is None or trial.peak is None else user.peak - trial.peak
        out.append((Finding(
            pattern=PATTERN,
            bytes=0 if saved is None else max(saved, 0),
            message=message,
            suggestion=(f"checkpoint {what}: their activations are recomputed in backward, one block at a time "
                        "(non-reentrant; the same results)"),
            code=compose(setup, bench.source),
            setup=setup,
            step=bench.source,
        ), trial))
    return out
