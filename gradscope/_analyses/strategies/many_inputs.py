"""A loss over many outputs of one model (the seed-001 pattern).

``L = g(f(x_1), ..., f(x_n))``. Stacking keeps ``n`` graphs of ``f`` alive until ``L.backward()``.
The two-pass version keeps one: a no-grad pass computes every ``z_i = f(x_i)``, ``dL/dz`` comes from
``g`` alone, then each ``z_i`` is recomputed and back-propagated with its slice of ``dL/dz``.

NOTE [ two-pass keeps RNG and batch-norm state exact ]: the recompute must see the same ``z_i`` as the
first pass and must leave the model exactly as the stacked run would. So:
  * the RNG state is saved once before the first pass and restored once before the recompute. The
    recompute then makes the same draws in the same order, so dropout draws the same masks, and the
    state before input ``i`` is again the one the first pass saw. Keeping one state per input would
    cost 5 KB per input on CPU (the Mersenne Twister state), which grows with ``n``; instead only a
    hash of each input's starting state is kept, and a recompute that starts from another state (a
    backward that draws random numbers) raises rather than give silently different gradients. At the
    end the RNG is put where the stacked run leaves it (after ``f`` on every input, then ``g``);
  * the first pass runs the model as the stacked run does (same order, train mode), so batch-norm
    running statistics and ``num_batches_tracked`` are updated exactly once per input;
  * during the recompute every norm layer in train mode gets ``track_running_stats = False``: it then
    normalizes with the batch statistics (as in the first pass) but neither reads nor updates the
    running statistics. The flags are restored afterwards, also on error.

NOTE [ two-pass refuses state that changes during the recompute ]: batch norm is the one kind of state
the recompute knows how to hold still. Anything else that a forward updates (``spectral_norm``'s power
iteration writes its ``u``/``v`` vectors and a new ``weight`` on every training-mode forward; a call
counter; a cache) makes the recompute a different function from the first pass, and its gradients
silently wrong (measured: ``spectral_norm`` gave a gradient error of 6.7e-4 and left its ``u`` buffer
3.5e-2 away from the stacked run's). Rather than trust a list of layer types, the recompute snapshots
the whole state of every module that ran in the first pass (see NOTE [ what counts as a module's state ]),
and after each recomputed forward, before its backward, compares: any difference puts the state back
and raises, naming what changed. As a second guard the recomputed output must equal the first pass's
(to a dtype tolerance: eval-mode fast paths may round differently under ``no_grad``), which also
catches state held outside any module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from gradscope._analyses.strategies._checks import (
    _fail,
    _need_callable,
    _need_method,
    _need_scalar,
    _outputs_close,
)
from gradscope._analyses.strategies._modules import StateSnapshot, modules_run, with_submodules

__all__ = ["MANY_INPUTS_METHODS", "many_inputs_backward"]

MANY_INPUTS_METHODS = ("stacked", "two_pass")

_F = "many_inputs_backward"


def many_inputs_backward(
    f: Callable[[torch.Tensor], torch.Tensor],
    inputs: Sequence[torch.Tensor],
    g: Callable[[torch.Tensor], torch.Tensor],
    method: str = "two_pass",
) -> torch.Tensor:
    """Back-propagate ``L = g(torch.stack([f(x) for x in inputs]))`` into ``.grad``; return ``L``.

    Args:
        f: the model, usually an ``nn.Module`` (dropout and batch norm allowed, see
            NOTE [ two-pass keeps RNG and batch-norm state exact ]).
        inputs: the ``x_i``, a non-empty sequence of tensors.
        g: ``g(zs) -> scalar`` where ``zs`` stacks the ``f(x_i)`` along a new first dimension.
        method: ``"stacked"`` (all graphs alive at once) or ``"two_pass"`` (one graph of ``f`` at a
            time; peak memory flat in ``len(inputs)``).

    Returns:
        ``L``, detached. Gradients are accumulated into ``.grad`` of every leaf that ``f`` and ``g`` use,
        as ``L.backward()`` would.

    Raises:
        GradscopeError: empty or non-tensor inputs, ``g`` not returning a scalar, an unknown method.

    Example:
        >>> import torch
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> f = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
        >>> xs = [torch.randn(5, 3) for _ in range(3)]
        >>> g = lambda zs: zs.pow(2).mean()
        >>> L = many_inputs_backward(f, xs, g, method="two_pass")
        >>> L.requires_grad, f[0].weight.grad.shape
        (False, torch.Size([4, 3]))
    """
    _need_callable(_F, "f", f)
    _need_callable(_F, "g", g)
    _need_method(_F, method, MANY_INPUTS_METHODS)
    if isinstance(inputs, torch.Tensor):
        inputs = list(inputs.unbind(0))
    if len(inputs) == 0:
        raise _fail(_F, "`inputs` is empty; pass a non-empty sequence of tensors.")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise _fail(_F, f"`inputs[{i}]` must be a torch.Tensor, got {type(x).__name__}.")
    if method == "stacked":
        zs = _stack([_output(f, x, i) for i, x in enumerate(inputs)])
        L = _need_scalar(_F, "`g`", g(zs))
        L.backward()
        return L.detach()
    return _two_pass(f, inputs, g)


def _output(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, i: int) -> torch.Tensor:
    z = f(x)
    if not isinstance(z, torch.Tensor):
        raise _fail(_F, f"`f(inputs[{i}])` must return a tensor, got {type(z).__name__}.")
    return z


def _stack(zs: list[torch.Tensor]) -> torch.Tensor:
    first = zs[0].shape
    for i, z in enumerate(zs):
        if z.shape != first:
            raise _fail(
                _F,
                f"`f(inputs[{i}])` has shape {tuple(z.shape)} but `f(inputs[0])` has {tuple(first)}; "
                "the outputs are stacked for `g`, so they must all have one shape.",
            )
    return torch.stack(zs)


def _two_pass(
    f: Callable[[torch.Tensor], torch.Tensor], inputs: Sequence[torch.Tensor], g: Any
) -> torch.Tensor:
    devices = _cuda_devices(inputs, f)
    start = _get_rng(devices)
    marks: list[int] = []
    zs = []
    with torch.no_grad(), modules_run() as ran:
        for i, x in enumerate(inputs):
            marks.append(_rng_hash(devices))
            zs.append(_output(f, x, i))
    own: list[tuple[str | None, nn.Module]] = [("f", f)] if isinstance(f, nn.Module) else []
    names = with_submodules(own + [(None, m) for m in ran])
    zs_leaf = _stack(zs).requires_grad_(True)
    del zs
    L = _need_scalar(_F, "`g`", g(zs_leaf))
    L.backward()  # also accumulates the gradients of any leaves g itself uses
    after = _get_rng(devices)  # where the stacked run leaves the RNG: after f on every input, then g
    dL_dz = zs_leaf.grad
    assert dL_dz is not None
    first = zs_leaf.detach()  # see NOTE [ two-pass refuses state that changes during the recompute ]
    del zs_leaf
    try:
        _set_rng(start)
        with _batch_stats_only(list(names)):
            state = StateSnapshot(names)
            for i, x in enumerate(inputs):
                if _rng_hash(devices) != marks[i]:
                    raise _fail(
                        _F,
                        f"the RNG state before recomputing `f(inputs[{i}])` differs from the first pass's: "
                        "the backward of `f` draws random numbers, so the two-pass recompute cannot "
                        "reproduce the first pass. Use method='stacked'.",
                    )
                z = _output(f, x, i)
                _check_recompute(state, i, z, first[i])
                z.backward(dL_dz[i])
                del z
    finally:
        _set_rng(after)
    return L.detach()


def _check_recompute(state: StateSnapshot, i: int, z: torch.Tensor, first: torch.Tensor) -> None:
    changes = state.changes()
    if changes:
        state.restore()
        listed = "; ".join(map(str, changes[:6])) + (
            f" (and {len(changes) - 6} more)" if len(changes) > 6 else ""
        )
        raise _fail(
            _F,
            f"recomputing `f(inputs[{i}])` changed the model's state: {listed}. A forward that updates "
            "state (spectral_norm's power iteration, a counter, a cache) is not the same function when "
            "run again, so the two-pass gradients would be wrong. Use method='stacked', or put the "
            "modules named above in eval mode if their state may stay fixed. The state is as the first "
            "pass left it; gradients already accumulated by this call are incomplete.",
        )
    problem = _outputs_close(z.detach(), first)
    if problem:
        raise _fail(
            _F,
            f"recomputing `f(inputs[{i}])` gave a different output than the first pass ({problem}): "
            "something the forward reads changed in between (state kept outside the modules, a "
            "non-deterministic kernel). Use method='stacked'.",
        )


def _cuda_devices(inputs: Sequence[torch.Tensor], f: Any) -> list[int]:
    devs = {x.device.index or 0 for x in inputs if x.device.type == "cuda"}
    if isinstance(f, nn.Module):
        devs |= {p.device.index or 0 for p in f.parameters() if p.device.type == "cuda"}
    return sorted(devs)


def _get_rng(cuda_devices: list[int]) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in cuda_devices]


def _rng_hash(cuda_devices: list[int]) -> int:
    cpu, cuda = _get_rng(cuda_devices)
    return hash((cpu.numpy().tobytes(), *(s.cpu().numpy().tobytes() for _, s in cuda)))


def _set_rng(state: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)


@contextlib.contextmanager
def _batch_stats_only(modules: list[nn.Module]) -> Iterator[None]:
    """Norm layers in train mode use batch statistics without touching running ones (see NOTE above)."""
    changed = [m for m in modules if isinstance(m, _NormBase) and m.training and m.track_running_stats]
    try:
        for m in changed:
            m.track_running_stats = False
        yield
    finally:
        for m in changed:
            m.track_running_stats = True
