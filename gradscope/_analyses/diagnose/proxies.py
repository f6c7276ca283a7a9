"""Stand-ins for a strategy a finding suggests, run on the user's model to measure the strategy's own
peak (see NOTE [ measuring a strategy's own peak ])."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

# NOTE [ measuring a strategy's own peak ]: a fix that runs the model another way (forward AD,
# two passes, micro-batches, an unrolled inner loop) has a peak of its own, which the replay of the
# user's timeline cannot know. It is measured by running that way on a copy of the user's model
# (``copy.deepcopy``: the user's parameters, batch-norm statistics and gradients are never touched;
# the RNG is forked) with zero inputs of the recorded shapes, under ``gs.record(memory="cpu")``.
# Where the model is not on the CPU (or too large to copy) it is predicted on the meta device
# with ``gs.predict`` instead. The strategy's loss is a stand-in (a sum of squares) of the same
# shape: its cost is small next to the model's. None when it cannot run (the finding is then not
# given: a saving that is not known is not claimed).
MAX_COPY_BYTES = 256 * 1024 * 1024


def proxy_peak(proxy: Any, model: nn.Module, *args: Any) -> int | None:
    if proxy is None:
        return None
    from gradscope._analyses.predict.predictor import predict
    from gradscope._capture.record import record

    params = list(model.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    on_cpu = all(p.device.type == "cpu" for p in params)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on_cpu and size <= MAX_COPY_BYTES:
                twin = copy.deepcopy(model)
                for p in twin.parameters():
                    p.grad = None
                with torch.random.fork_rng(devices=[]):
                    r = record(memory="cpu")
                    with r:
                        proxy(twin, *args)
                measured = r.recording
                return None if measured is None else int(measured.peak_bytes)
            return int(predict(proxy, model, *args, device="cpu").peak_bytes)
    except Exception:  # a stand-in that does not fit the user's model: no claim
        return None


def mixed_grad_proxy(z_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> Any:
    from gradscope._analyses.strategies.mixed import mixed_grad

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        z = torch.zeros(z_shape, device=dev)
        y = torch.zeros(y_shape, device=dev, requires_grad=True)

        def f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            n = min(g.numel(), y.numel())
            return (g.tanh().reshape(-1)[:n] * y.reshape(-1)[:n]).sum()

        mixed_grad(f, model, z, y, method="forward_ad")

    return run


def jacobian_proxy(n_in: int, method: str) -> Any:
    from gradscope._analyses.strategies.jacobian import jacobian

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        jacobian(lambda v: model(v.view(1, -1)).view(-1), torch.zeros(n_in, device=dev), method=method)

    return run


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def micro_batch_proxy(xs: Any, n: int) -> Any:
    def run(model: nn.Module) -> None:
        dev = _device_of(model)  # the stand-in inputs go where the model is (meta under predict; a GPU)
        for x in xs:
            (model(x.to(dev)).float().square().mean() / n).backward()

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def two_pass_proxy(xs: Any, n: int) -> Any:
    from gradscope._analyses.strategies.many_inputs import many_inputs_backward

    def run(model: nn.Module) -> None:
        dev = _device_of(model)
        many_inputs_backward(model, [x.to(dev) for x in xs], lambda zs: zs.float().square().mean(), method="two_pass")

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def hypergradient_proxy(a_shape: tuple[int, ...], x_shape: tuple[int, ...], steps: int) -> Any:
    from torch.func import functional_call

    from gradscope._analyses.strategies.hyper import hypergradient

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        A = torch.zeros(a_shape, device=dev, requires_grad=True)  # noqa: N806
        x = torch.zeros(x_shape, device=dev)

        def train_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, p, (x,)).square()
            if out.shape[0] == A.numel():
                return (A.reshape(-1) * out.reshape(out.shape[0], -1).sum(-1)).mean()
            return out.mean() * A.sum()

        def val_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(model, p, (x,)).square().mean()

        hypergradient(model, A, train_loss, val_loss, steps=steps, optimizer="sgd", lr=0.1)

    return run




# ----------------------------------------------------------------------------------------------
