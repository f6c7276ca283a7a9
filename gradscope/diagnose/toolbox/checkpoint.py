"""Activation checkpointing of the repeated blocks (non-reentrant): their activations are recomputed
in backward, one block at a time. A ``transformers`` model uses its own switch; any other model has
its blocks' ``forward`` wrapped, with batch-norm running statistics put back after the recompute so
that they move once. Under a budget, the fewest blocks that make the step fit (least recompute)."""

from __future__ import annotations

import warnings
from typing import Any

from gradscope._names import code_path
from gradscope.diagnose.facts import Context
from gradscope.diagnose.measure import Bench
from gradscope.diagnose.report import Finding
from gradscope.diagnose.step import Shape, compose
from gradscope.diagnose.toolbox._common import has_batch_norm, models, repeated_blocks

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


def _generic(name: str, path: str, start: int, stop: int, n: int, bn: bool) -> str:
    whole = f"{name}.{code_path(path)}" if path else name
    blocks = whole if (start, stop) == (0, n) else f"{whole}[{start or ''}:{stop if stop < n else ''}]"
    lines = ["from torch.utils.checkpoint import checkpoint"]
    if bn:
        lines.insert(0, "import contextlib")
        lines.append(_KEEP_BN.rstrip("\n"))
    lines.append(f"for block in {blocks}:")
    if bn:
        lines.append("    block.forward = lambda *args, f=block.forward, b=block, **kwargs: checkpoint(f, *args, "
                     "use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), KeepBatchNormStats(b)), **kwargs)")
    else:
        lines.append("    block.forward = lambda *args, f=block.forward, **kwargs: checkpoint(f, *args, "
                     "use_reentrant=False, **kwargs)")
    return "\n".join(lines) + "\n"


def propose(ctx: Context, bench: Bench, shape: Shape, budget: int | None) -> list[tuple[Finding, Any]]:
    if shape.backward is None:
        return []
    out: list[tuple[Finding, Any]] = []
    for name, model in models(ctx, bench.source)[:1]:
        if not model.training:
            continue
        found = repeated_blocks(model)
        hf = bool(getattr(model, "supports_gradient_checkpointing", False)) and hasattr(model, "gradient_checkpointing_enable")
        with warnings.catch_warnings():  # transformers renames the property (a FutureWarning)
            warnings.simplefilter("ignore")
            if getattr(model, "is_gradient_checkpointing", False):
                continue
        message = f"the activations of {name}'s blocks are alive together until backward reaches them"
        if hf:
            setup = f'{name}.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})\n'
            trial = bench.run(bench.source, setup=setup)
            what = "every block of the model (transformers' own switch)"
        elif found is not None:
            path, start, stop = found
            size = len(model.get_submodule(path)) if path else len(model)  # type: ignore[arg-type]
            bn = has_batch_norm(model)
            trial, k = None, stop
            if budget is not None:  # the fewest blocks (from the first) that make the step fit
                for k in range(start + 1, stop + 1):
                    trial = bench.run(bench.source, setup=_generic(name, path, start, k, size, bn))
                    if trial.error is not None or (trial.peak is not None and trial.peak <= budget):
                        break
            if trial is None:
                trial = bench.run(bench.source, setup=_generic(name, path, start, stop, size, bn))
            setup = _generic(name, path, start, k, size, bn)
            where = f"{name}.{path}" if path else name
            what = f"{k - start} of the {stop - start} blocks of {where}" + (
                " (batch-norm running statistics put back after the recompute)" if bn else "")
        else:
            continue
        assert trial is not None
        user = bench.user()
        saved = None if user.peak is None or trial.peak is None else user.peak - trial.peak
        out.append((Finding(
            pattern="deep_activations",
            bytes=0 if saved is None else max(saved, 0),
            message=message,
            suggestion=(f"checkpoint {what}: their activations are recomputed in backward, one block at a time "
                        "(non-reentrant; the same results)"),
            code=compose(setup, bench.source),
            setup=setup,
            step=bench.source,
        ), trial))
    return out
