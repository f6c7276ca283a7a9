"""Hypergradients through unrolled optimizer steps (the seed-002 pattern).

``d val_loss(θ_K) / d λ`` where ``θ_{k+1} = step(θ_k, d train_loss(θ_k, λ) / dθ_k)``. Done functionally:
the parameters are plain tensors passed to ``torch.func.functional_call``, every update is an
out-of-place expression (``θ - lr * g`` for SGD, Adam's moments as tensors), and the gradients are taken
with ``create_graph=True``, so the whole trajectory stays differentiable in ``λ``.

The forum thread's failure mode is kept as ``method="inplace"``: the update runs in place under
``torch.no_grad()`` (what ``optimizer.step()`` does), which cuts the graph from ``θ_K`` back to ``λ``;
``autograd.grad(val, λ)`` then raises "One of the differentiated Tensors appears to not have been used
in the graph", and with ``allow_unused=True`` it returns ``None``.

NOTE [ three ways to pay for a hypergradient ]: unrolling keeps every step's graph (and the graph of its
gradient) until the end, so memory grows linearly with the steps. Two ways out, each with its price:
  * truncation (``truncate=T``): the first ``K - T`` steps run without a graph (values only, Adam's
    moments too) and only the last ``T`` are differentiated. Memory is that of ``T`` steps; the result
    is biased, since the influence of ``λ`` on the early steps is dropped (exact when ``T = K``);
  * finite differences (``method="finite_difference"``, what the thread's author ended with): train
    with ``λ_i ± h`` for every element ``i`` and difference the validation losses. No graph at all, so
    memory is one training step's; it costs ``2 · numel(λ)`` trainings and its error is of order
    ``h²`` plus rounding over ``h`` (``h = ε^(1/3) · max(1, |λ_i|)`` by default, ``ε`` the dtype's).
:func:`finite_difference_grad` does the same for any zero-argument function, for pipelines that
:func:`hypergradient` does not cover (train one model, let it label data for another, train that one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from gradscope._analyses.strategies._checks import _fail, _need_method, _need_scalar

__all__ = ["HYPERGRAD_METHODS", "OPTIMIZERS", "finite_difference_grad", "hypergradient", "unrolled_params"]

HYPERGRAD_METHODS = ("unrolled", "finite_difference", "inplace")
OPTIMIZERS = ("sgd", "adam")

_F = "hypergradient"

Params = dict[str, torch.Tensor]


def unrolled_params(
    model: nn.Module,
    train_loss: Callable[[Params], torch.Tensor],
    steps: int,
    optimizer: str = "sgd",
    lr: float | torch.Tensor = 0.1,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    truncate: int | None = None,
) -> Params:
    """The parameters after ``steps`` differentiable optimizer steps, as a name -> tensor dict.

    The model itself is not changed. The result carries the graph back to anything ``train_loss`` (or a
    tensor ``lr``) depends on. The updates are those of ``torch.optim.SGD`` (no momentum) and
    ``torch.optim.Adam`` (no weight decay, no amsgrad).

    Args:
        model: supplies the starting parameters (detached copies) and names.
        train_loss: ``train_loss(params) -> scalar``; typically calls
            ``torch.func.functional_call(model, params, (x,))``.
        steps: number of steps, at least 1.
        optimizer: ``"sgd"`` or ``"adam"``.
        lr: learning rate, a float or a tensor (then it can be a hyperparameter too).
        betas: Adam's moment decay rates.
        eps: Adam's epsilon.
        truncate: differentiate only the last ``truncate`` steps (``None``: all of them; ``0``: none,
            plain training). See NOTE [ three ways to pay for a hypergradient ].

    Returns:
        ``{name: tensor}`` after the last step.

    Example:
        >>> import torch
        >>> from torch.func import functional_call
        >>> model = torch.nn.Linear(2, 1)
        >>> x, t = torch.randn(4, 2), torch.randn(4, 1)
        >>> loss = lambda p: ((functional_call(model, p, (x,)) - t) ** 2).mean()
        >>> p = unrolled_params(model, loss, steps=2)
        >>> sorted(p), p["weight"].shape
        (['bias', 'weight'], torch.Size([1, 2]))
    """
    if not isinstance(model, nn.Module):
        raise _fail(_F, f"`model` must be an nn.Module, got {type(model).__name__}.")
    if not callable(train_loss):
        raise _fail(
            _F, f"`train_loss` must be callable as train_loss(params), got {type(train_loss).__name__}."
        )
    if not isinstance(steps, int) or steps < 1:
        raise _fail(_F, f"`steps` must be a positive int, got {steps!r}.")
    if optimizer not in OPTIMIZERS:
        raise _fail(_F, f"`optimizer` must be one of {OPTIMIZERS}, got {optimizer!r}.")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 0):
        raise _fail(_F, f"`truncate` must be None or an int >= 0 (steps to differentiate), got {truncate!r}.")
    first_graph = 1 if truncate is None else max(1, steps - truncate + 1)
    params: Params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    if not params:
        raise _fail(_F, "`model` has no parameters to unroll.")
    names = list(params)
    b1, b2 = betas
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for k in range(1, steps + 1):
        graph = k >= first_graph
        loss = _need_scalar(_F, "`train_loss`", train_loss(params))
        if not loss.requires_grad:  # nothing in the model is used: no step to take
            grads: Sequence[torch.Tensor | None] = [None] * len(names)
        else:
            grads = torch.autograd.grad(
                loss, [params[n] for n in names], create_graph=graph, allow_unused=True
            )
        del loss
        new: Params = {}
        for n, gr in zip(names, grads, strict=True):
            p = params[n]
            if gr is None:
                gr = torch.zeros_like(p)
            if optimizer == "sgd":
                new[n] = p - lr * gr
            else:
                m[n] = b1 * m[n] + (1 - b1) * gr
                v[n] = b2 * v[n] + (1 - b2) * gr * gr
                m_hat = m[n] / (1 - b1**k)
                v_hat = v[n] / (1 - b2**k)
                # sqrt has an infinite derivative at 0; a zero gradient entry would turn it into NaN.
                # The 1e-30 shift is far below float32 resolution of any non-zero v_hat.
                new[n] = p - lr * m_hat / (torch.sqrt(v_hat + 1e-30) + eps)
        if not graph:  # a truncated step: values only, see NOTE [ three ways to pay for a hypergradient ]
            new = {n: t.detach().requires_grad_(True) for n, t in new.items()}
            m = {n: t.detach() for n, t in m.items()}
            v = {n: t.detach() for n, t in v.items()}
        params = new
    return params


def hypergradient(
    model: nn.Module,
    hyper: torch.Tensor | Sequence[torch.Tensor],
    train_loss: Callable[[Params], torch.Tensor],
    val_loss: Callable[[Params], torch.Tensor],
    steps: int = 1,
    optimizer: str = "sgd",
    lr: float | torch.Tensor = 0.1,
    method: str = "unrolled",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    truncate: int | None = None,
    fd_step: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor | None, ...] | None:
    """``d val_loss(θ_K) / d hyper`` through ``steps`` optimizer steps on ``train_loss``.

    Args:
        model: the model trained in the inner loop; left unchanged by both methods.
        hyper: the hyperparameter tensor(s), each requiring grad; ``train_loss`` (or a tensor ``lr``)
            depends on them.
        train_loss: ``train_loss(params) -> scalar`` with ``params`` a name -> tensor dict (use
            ``torch.func.functional_call(model, params, args)``).
        val_loss: ``val_loss(params) -> scalar``, evaluated at the parameters after the last step.
        steps: number of unrolled steps ``K``.
        optimizer: ``"sgd"`` or ``"adam"``.
        lr: learning rate (float or tensor).
        method: ``"unrolled"`` (functional, exact; memory grows with ``steps``),
            ``"finite_difference"`` (central differences, no graph: memory flat in ``steps``, cost
            ``2 · numel(hyper)`` trainings) or ``"inplace"`` (the thread's in-place ``no_grad`` update
            through ``torch.optim``; the graph is cut and the result is ``None``).
        betas: Adam's moment decay rates.
        eps: Adam's epsilon.
        truncate: with ``"unrolled"``, differentiate only the last ``truncate`` steps (biased, memory of
            ``truncate`` steps); see NOTE [ three ways to pay for a hypergradient ].
        fd_step: with ``"finite_difference"``, the step ``h`` (default: ``ε^(1/3) · max(1, |λ_i|)``).

    Returns:
        One tensor shaped like ``hyper`` (a tuple for a sequence of hyperparameters); ``None`` entries
        where no gradient reaches a hyperparameter.

    Raises:
        GradscopeError: a hyperparameter that is not a tensor requiring grad, a bad ``steps``, optimizer
            or method.

    Example:
        >>> import torch
        >>> from torch.func import functional_call
        >>> model = torch.nn.Linear(2, 1)
        >>> x, t = torch.randn(4, 2), torch.randn(4, 1)
        >>> w = torch.ones(4, requires_grad=True)  # per-sample weights
        >>> tr = lambda p: (w * (functional_call(model, p, (x,)) - t).squeeze(1) ** 2).mean()
        >>> va = lambda p: ((functional_call(model, p, (x,)) - t) ** 2).mean()
        >>> hypergradient(model, w, tr, va, steps=2).shape
        torch.Size([4])
        >>> print(hypergradient(model, w, tr, va, steps=2, method="inplace"))
        None
    """
    _need_method(_F, method, HYPERGRAD_METHODS)
    single = isinstance(hyper, torch.Tensor)
    hypers: list[torch.Tensor] = [hyper] if isinstance(hyper, torch.Tensor) else list(hyper)
    if not hypers:
        raise _fail(
            _F, "`hyper` is empty; pass the hyperparameter tensor(s) to differentiate with respect to."
        )
    for i, h in enumerate(hypers):
        name = "hyper" if single else f"hyper[{i}]"
        if not isinstance(h, torch.Tensor):
            raise _fail(_F, f"`{name}` must be a torch.Tensor, got {type(h).__name__}.")
        if not h.requires_grad:
            raise _fail(_F, f"`{name}` must require grad; call `.requires_grad_()` on it first.")
    if not callable(val_loss):
        raise _fail(_F, f"`val_loss` must be callable as val_loss(params), got {type(val_loss).__name__}.")
    if truncate is not None and method != "unrolled":
        raise _fail(_F, f"`truncate` applies to method='unrolled', not {method!r}.")
    if fd_step is not None and method != "finite_difference":
        raise _fail(_F, f"`fd_step` applies to method='finite_difference', not {method!r}.")
    grads: list[torch.Tensor | None]
    if method == "unrolled":
        params = unrolled_params(model, train_loss, steps, optimizer, lr, betas, eps, truncate)
        val = _need_scalar(_F, "`val_loss`", val_loss(params))
        if not val.requires_grad:
            grads = [None] * len(hypers)
        else:
            grads = list(torch.autograd.grad(val, hypers, allow_unused=True))
    elif method == "finite_difference":

        def trained_val() -> torch.Tensor:
            params = unrolled_params(model, train_loss, steps, optimizer, lr, betas, eps, truncate=0)
            with torch.no_grad():
                return _need_scalar(_F, "`val_loss`", val_loss(params))

        grads = list(finite_difference_grad(trained_val, hypers, step=fd_step))
    else:
        grads = _inplace(model, hypers, train_loss, val_loss, steps, optimizer, lr, betas, eps)
    return grads[0] if single else tuple(grads)


def _inplace(
    model: nn.Module,
    hypers: list[torch.Tensor],
    train_loss: Callable[[Params], torch.Tensor],
    val_loss: Callable[[Params], torch.Tensor],
    steps: int,
    optimizer: str,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> list[torch.Tensor | None]:
    if not isinstance(model, nn.Module):
        raise _fail(_F, f"`model` must be an nn.Module, got {type(model).__name__}.")
    if not isinstance(steps, int) or steps < 1:
        raise _fail(_F, f"`steps` must be a positive int, got {steps!r}.")
    if optimizer not in OPTIMIZERS:
        raise _fail(_F, f"`optimizer` must be one of {OPTIMIZERS}, got {optimizer!r}.")
    named: Params = dict(model.named_parameters())
    saved = {n: (p.detach().clone(), p.grad) for n, p in named.items()}
    lr_value = float(lr) if isinstance(lr, torch.Tensor) else lr
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(list(named.values()), lr=lr_value)
    else:
        opt = torch.optim.Adam(list(named.values()), lr=lr_value, betas=betas, eps=eps)
    try:
        for _ in range(steps):
            loss = _need_scalar(_F, "`train_loss`", train_loss(named))
            grads = torch.autograd.grad(loss, list(named.values()), create_graph=True, allow_unused=True)
            for p, gr in zip(named.values(), grads, strict=True):
                p.grad = None if gr is None else gr.detach()
            opt.step()  # in place, under no_grad: θ no longer depends on the hyperparameters
        val = _need_scalar(_F, "`val_loss`", val_loss(named))
        if not val.requires_grad:
            return [None] * len(hypers)
        return list(torch.autograd.grad(val, hypers, allow_unused=True))
    finally:
        with torch.no_grad():
            for n, p in named.items():
                value, grad = saved[n]
                p.copy_(value)
                p.grad = grad


_FD = "finite_difference_grad"


def finite_difference_grad(
    fn: Callable[[], torch.Tensor], inputs: torch.Tensor | Sequence[torch.Tensor], step: float | None = None
) -> tuple[torch.Tensor, ...]:
    """Central-difference gradient of a scalar ``fn()`` with respect to ``inputs``, moved in place.

    ``fn`` takes no argument and reads the ``inputs`` it closes over (a pipeline's hyperparameters);
    each element is moved by ``±h`` in turn and put back exactly afterwards, also on error. Costs
    ``2 · numel`` calls of ``fn``, keeps no graph.

    Args:
        fn: returns a scalar tensor (or a float).
        inputs: the tensor(s) to differentiate with respect to (leaves; ``requires_grad`` not needed).
        step: ``h``; default ``ε^(1/3) · max(1, |x_i|)`` with ``ε`` the machine epsilon of the dtype.

    Returns:
        One gradient per input, shaped like it.

    Example:
        >>> import torch
        >>> a = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> (g,) = finite_difference_grad(lambda: (a ** 3).sum(), a)
        >>> torch.allclose(g, 3 * a ** 2, rtol=1e-8)
        True
    """
    if not callable(fn):
        raise _fail(_FD, f"`fn` must be a zero-argument callable, got {type(fn).__name__}.")
    xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise _fail(_FD, f"`inputs[{i}]` must be a floating-point tensor.")
    out = []
    for x in xs:
        held = x.detach()  # shares x's storage: writes move x itself
        saved = held.clone()
        grad = torch.zeros(x.shape, dtype=torch.float64)
        for idx in _indices(tuple(x.shape)):
            h = step if step is not None else _default_step(x.dtype, float(saved[idx]))
            vals = []
            try:
                for sign in (1.0, -1.0):
                    with torch.no_grad():
                        held[idx] = saved[idx] + sign * h
                    vals.append(_fd_value(fn))
            finally:
                with torch.no_grad():
                    held[idx] = saved[idx]
            grad[idx] = (vals[0] - vals[1]) / (2 * h)
        out.append(grad.to(dtype=x.dtype, device=x.device))
    return tuple(out)


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [(*i, j) for i in out for j in range(size)]
    return out


def _default_step(dtype: torch.dtype, value: float) -> float:
    return float(torch.finfo(dtype).eps) ** (1 / 3) * max(1.0, abs(value))


def _fd_value(fn: Callable[[], torch.Tensor]) -> float:
    value = fn()
    if isinstance(value, torch.Tensor):
        return float(_need_scalar(_FD, "`fn`", value).detach())
    if isinstance(value, (int, float)):
        return float(value)
    raise _fail(_FD, f"`fn` must return a scalar tensor or a float, got {type(value).__name__}.")
