"""Mixed second derivatives through a frozen model (the seed-000 pattern).

``f(y, G(z))`` with a large frozen ``G``: the quantity wanted is ``d/dy <v, df/dz>``. Double backward
with ``create_graph=True`` keeps the whole graph of ``G`` (and the graph of its backward) alive; forward
AD gets the same number while ``G`` runs with no autograd graph at all, so its memory does not grow with
``G``'s depth.

The thread's real loop runs over many ``z_i`` and differentiates ``g(df/dz_1, ..., df/dz_N)``:
:func:`grad_of_input_grads` does it as written (one ``create_graph`` graph per ``z_i``, all alive until
the end) or through forward AD, one ``z_i`` at a time, with memory flat in ``N``.

NOTE [ dg/dy one z at a time ]: ``dg/dy = sum_i d/dy <v_i, df/dz_i>`` with ``v_i = dg/d(df/dz_i)`` taken
at the values of ``df/dz`` and then held fixed (the chain rule, exactly). So the values of every
``df/dz_i`` come first (a plain backward per ``z_i``, nothing kept but the values, which have the size
of ``z``), then every ``v_i`` from one backward through ``g`` alone, then one forward-AD pass through
``G`` per ``z_i`` (:func:`mixed_grad`). Only one ``z_i``'s computation is alive at a time; what grows
with ``N`` is the ``N`` values and directions, each the size of ``z_i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd import forward_ad

from gradscope._analyses.strategies._checks import (
    _fail,
    _need_callable,
    _need_method,
    _need_scalar,
    _need_tensor,
)
from gradscope._analyses.strategies._tangents import frozen_operand_tangents

__all__ = ["INPUT_GRADS_METHODS", "MIXED_GRAD_METHODS", "frozen", "grad_of_input_grads", "input_grad", "mixed_grad"]

MIXED_GRAD_METHODS = ("create_graph", "forward_ad", "split")
INPUT_GRADS_METHODS = ("create_graph", "forward_ad", "split")

_F = "mixed_grad"


@contextlib.contextmanager
def frozen(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Turn ``requires_grad`` off for ``tensors`` for the duration; restore each flag on exit, also on error.

    Args:
        tensors: parameters (or any leaf tensors) to exclude from autograd.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> with frozen(lin.parameters()):
        ...     lin.weight.requires_grad
        False
        >>> lin.weight.requires_grad
        True
    """
    flags = [(t, t.requires_grad) for t in tensors]
    try:
        for t, _ in flags:
            if t.requires_grad:
                t.requires_grad_(False)
        yield
    finally:
        for t, flag in flags:
            t.requires_grad_(flag)


def mixed_grad(
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    G: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor | None = None,
    method: str = "create_graph",
    frozen_params: Iterable[torch.Tensor] = (),
) -> torch.Tensor | None:
    """``d/dy <v, d f(y, G(z)) / dz>``: a mixed second derivative through a frozen model ``G``.

    For the gradient of any ``g(df/dz)`` with respect to ``y``, pass ``v = dg/d(df/dz)`` (computed once
    from the value of ``df/dz``, with a plain backward): ``dg/dy = d/dy <v, df/dz>`` with ``v`` held fixed.

    Args:
        f: ``f(y, g) -> scalar``.
        G: the frozen model, a function or an ``nn.Module``; its parameters are not differentiated.
        z: input of ``G``; it need not require grad (it is detached inside).
        y: the tensor to differentiate with respect to; must require grad.
        v: direction in ``z``-space, same shape as ``z``; ones when omitted.
        method: ``"create_graph"`` (double backward through ``G``), ``"forward_ad"`` (push ``v`` forward
            through ``G`` as a tangent, then one backward through ``f`` only; memory flat in ``G``'s depth;
            see NOTE [ forward AD through a frozen weight materializes a zero tangent ])
            or ``"split"`` (the forum thread's two-step attempt: ``df/dz`` computed by the chain rule
            without ``create_graph``, which cuts the dependency on ``y``; it returns ``None``, reported
            as wrong by ``gs.compare``).
        frozen_params: extra tensors to exclude from autograd while ``G`` runs under forward AD, for a
            plain-function ``G`` that closes over parameters (an ``nn.Module``'s own parameters are
            found automatically).

    Returns:
        A tensor shaped like ``y``; ``None`` for ``"split"`` (no gradient reaches ``y``).

    Raises:
        GradscopeError: a callable, shape or ``requires_grad`` that is off, or an unknown method.

    Example:
        >>> import torch
        >>> G = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        >>> f = lambda y, g: ((y * g) ** 2).sum()
        >>> z, y = torch.randn(2, 4), torch.randn(2, 3, requires_grad=True)
        >>> a = mixed_grad(f, G, z, y, method="create_graph")
        >>> b = mixed_grad(f, G, z, y, method="forward_ad")
        >>> torch.allclose(a, b, atol=1e-6), mixed_grad(f, G, z, y, method="split")
        (True, None)
    """
    _need_callable(_F, "f", f)
    _need_callable(_F, "G", G)
    _need_tensor(_F, "z", z)
    _need_tensor(_F, "y", y, requires_grad=True)
    _need_method(_F, method, MIXED_GRAD_METHODS)
    if not z.is_floating_point():
        raise _fail(_F, f"`z` must be a floating-point tensor, got dtype {z.dtype}.")
    if v is None:
        v = torch.ones_like(z)
    else:
        _need_tensor(_F, "v", v)
        if v.shape != z.shape:
            raise _fail(_F, f"`v` must have the shape of `z` {tuple(z.shape)}, got {tuple(v.shape)}.")
    v = v.detach()
    z = z.detach()
    if method == "create_graph":
        return _by_create_graph(f, G, z, y, v)
    if method == "forward_ad":
        params = list(frozen_params)
        if isinstance(G, nn.Module):
            params += list(G.parameters())
        return _by_forward_ad(f, G, z, y, v, params)
    return _by_split(f, G, z, y, v)


_Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_G = Callable[[torch.Tensor], torch.Tensor]


def _by_create_graph(f: _Fn, G: _G, z: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    z = z.requires_grad_(True)
    out = _need_scalar(_F, "`f`", f(y, G(z)))
    (dfdz,) = torch.autograd.grad(out, z, create_graph=True)
    if not dfdz.requires_grad:  # df/dz does not depend on y at all
        return torch.zeros_like(y)
    (res,) = torch.autograd.grad(dfdz, y, grad_outputs=v, allow_unused=True)
    return torch.zeros_like(y) if res is None else res


def _by_forward_ad(
    f: _Fn, G: _G, z: torch.Tensor, y: torch.Tensor, v: torch.Tensor, params: list[torch.Tensor]
) -> torch.Tensor:
    # d/dy <v, J_G^T df/dg> = d/dy <J_G v, df/dg>: J_G v is the tangent of G's output when z carries
    # tangent v. G runs with no autograd graph (parameters frozen, grad mode off), so nothing of G is
    # saved and memory does not depend on its depth. Linear, matmul and conv layers push the tangent
    # themselves, see NOTE [ forward AD through a frozen weight materializes a zero tangent ].
    with frozen(params), torch.no_grad(), forward_ad.dual_level(), frozen_operand_tangents():
        g_dual = G(forward_ad.make_dual(z, v))
        if not isinstance(g_dual, torch.Tensor):
            raise _fail(_F, f"`G` must return a tensor, got {type(g_dual).__name__}.")
        g, g_tangent = forward_ad.unpack_dual(g_dual)
        g = g.detach()
        if g_tangent is None:  # G's output does not depend on z
            return torch.zeros_like(y)
        g_tangent = g_tangent.detach()
        del g_dual
    g.requires_grad_(True)
    out = _need_scalar(_F, "`f`", f(y, g))
    (dfdg,) = torch.autograd.grad(out, g, create_graph=True)
    if not dfdg.requires_grad:
        return torch.zeros_like(y)
    (res,) = torch.autograd.grad(dfdg, y, grad_outputs=g_tangent, allow_unused=True)
    return torch.zeros_like(y) if res is None else res


def _by_split(f: _Fn, G: _G, z: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    # The thread's attempt, step for step: df/dg with create_graph=True, then df/dz by the chain rule
    # with create_graph=False. The second step produces a tensor with no graph, so d/dy of it is lost:
    # autograd raises "One of the differentiated Tensors appears to not have been used in the graph",
    # and with allow_unused=True the gradient is None. Kept to be shown as wrong, never patched.
    z = z.requires_grad_(True)
    g = G(z)
    g_leaf = g.detach().requires_grad_(True)
    out = _need_scalar(_F, "`f`", f(y, g_leaf))
    dfdg, _dfdy = torch.autograd.grad(out, (g_leaf, y), create_graph=True)
    (dfdz,) = torch.autograd.grad(g, z, grad_outputs=dfdg, create_graph=False)
    inner = (v * dfdz).sum()
    if not inner.requires_grad:
        return None
    (res,) = torch.autograd.grad(inner, y, allow_unused=True)
    return res


_FI = "grad_of_input_grads"


def grad_of_input_grads(
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    G: Callable[[torch.Tensor], torch.Tensor],
    zs: Sequence[torch.Tensor] | torch.Tensor,
    y: torch.Tensor,
    g: Callable[[list[torch.Tensor]], torch.Tensor],
    method: str = "create_graph",
    frozen_params: Iterable[torch.Tensor] = (),
) -> torch.Tensor | None:
    """``d g([df(y, G(z_1))/dz_1, ..., df(y, G(z_N))/dz_N]) / dy``: the seed-000 thread's whole loop.

    Args:
        f: ``f(y, g) -> scalar``.
        G: the frozen model (function or ``nn.Module``); its parameters are not differentiated.
        zs: the ``z_i``, a non-empty sequence of floating tensors (a tensor is split along dim 0).
        y: the tensor to differentiate with respect to; must require grad.
        g: ``g(dfdz) -> scalar`` with ``dfdz`` the list of ``df/dz_i`` (the thread's ``g(dfdz, x)``:
            close over ``x``). It may also use ``y`` directly.
        method: ``"create_graph"`` (the thread's loop as written: ``autograd.grad(..., create_graph=True)``
            per ``z_i``, every graph alive until ``g`` is differentiated; memory grows with ``N``),
            ``"forward_ad"`` (see NOTE [ dg/dy one z at a time ]; memory flat in ``N`` and in ``G``'s
            depth) or ``"split"`` (the thread's two-step attempt: ``df/dz_i`` by the chain rule with
            ``create_graph=False``; no gradient reaches ``y``, so it returns ``None`` as the thread's
            ``allow_unused=True`` did).
        frozen_params: extra tensors to keep out of autograd while ``G`` runs (``forward_ad``), for a
            plain-function ``G`` that closes over parameters.

    Returns:
        A tensor shaped like ``y``; ``None`` for ``"split"``.

    Raises:
        GradscopeError: a callable, tensor or ``requires_grad`` that is off, ``f`` or ``g`` not returning
            a scalar, an empty ``zs``, an unknown method.

    Example:
        >>> import torch
        >>> G = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh())
        >>> f = lambda y, g: ((y - g) ** 2).sum()
        >>> g = lambda dfdz: sum((d ** 2).sum() for d in dfdz)
        >>> zs, y = [torch.randn(1, 2) for _ in range(3)], torch.randn(1, 5, requires_grad=True)
        >>> a = grad_of_input_grads(f, G, zs, y, g, method="create_graph")
        >>> b = grad_of_input_grads(f, G, zs, y, g, method="forward_ad")
        >>> torch.allclose(a, b, atol=1e-6), grad_of_input_grads(f, G, zs, y, g, method="split")
        (True, None)
    """
    _need_callable(_FI, "f", f)
    _need_callable(_FI, "G", G)
    _need_callable(_FI, "g", g)
    _need_tensor(_FI, "y", y, requires_grad=True)
    _need_method(_FI, method, INPUT_GRADS_METHODS)
    if isinstance(zs, torch.Tensor):
        zs = list(zs.unbind(0))
    zs = list(zs)
    if not zs:
        raise _fail(_FI, "`zs` is empty; pass a non-empty sequence of tensors.")
    for i, z in enumerate(zs):
        _need_tensor(_FI, f"zs[{i}]", z)
        if not z.is_floating_point():
            raise _fail(_FI, f"`zs[{i}]` must be a floating-point tensor, got dtype {z.dtype}.")
    zs = [z.detach() for z in zs]
    if method == "create_graph":
        return _loop_create_graph(f, G, zs, y, g)
    if method == "split":
        return _loop_split(f, G, zs, y, g)
    params = list(frozen_params)
    if isinstance(G, nn.Module):
        params += list(G.parameters())
    return _loop_forward_ad(f, G, zs, y, g, params)


_Gfn = Callable[[list[torch.Tensor]], torch.Tensor]


def _loop_create_graph(f: _Fn, G: _G, zs: list[torch.Tensor], y: torch.Tensor, g: _Gfn) -> torch.Tensor:
    dfdz = []
    for z in zs:
        z = z.requires_grad_(True)
        out = _need_scalar(_FI, "`f`", f(y, G(z)))
        dfdz.append(torch.autograd.grad(out, z, create_graph=True)[0])
    t = _need_scalar(_FI, "`g`", g(dfdz))
    if not t.requires_grad:
        return torch.zeros_like(y)
    (res,) = torch.autograd.grad(t, y, allow_unused=True)
    return torch.zeros_like(y) if res is None else res


def _loop_split(f: _Fn, G: _G, zs: list[torch.Tensor], y: torch.Tensor, g: _Gfn) -> torch.Tensor | None:
    # The thread's attempt, step for step (see _by_split): each df/dz_i comes out without a graph.
    dfdz = []
    for z in zs:
        z = z.requires_grad_(True)
        g_out = G(z)
        g_leaf = g_out.detach().requires_grad_(True)
        out = _need_scalar(_FI, "`f`", f(y, g_leaf))
        dfdg, _dfdy = torch.autograd.grad(out, (g_leaf, y), create_graph=True)
        dfdz.append(torch.autograd.grad(g_out, z, grad_outputs=dfdg)[0])
    t = _need_scalar(_FI, "`g`", g(dfdz))
    if not t.requires_grad:
        return None
    (res,) = torch.autograd.grad(t, y, allow_unused=True)
    return res


def _loop_forward_ad(
    f: _Fn, G: _G, zs: list[torch.Tensor], y: torch.Tensor, g: _Gfn, params: list[torch.Tensor]
) -> torch.Tensor:
    # see NOTE [ dg/dy one z at a time ]
    y_value = y.detach()
    values: list[torch.Tensor] = []
    with frozen(params), torch.enable_grad():
        for z in zs:
            z = z.requires_grad_(True)
            out = _need_scalar(_FI, "`f`", f(y_value, G(z)))
            if not out.requires_grad:  # f does not depend on G(z)
                values.append(torch.zeros_like(z))
                continue
            (d,) = torch.autograd.grad(out, z, allow_unused=True)
            values.append(torch.zeros_like(z) if d is None else d)
            del out, d
    leaves = [v.detach().requires_grad_(True) for v in values]
    del values
    t = _need_scalar(_FI, "`g`", g(leaves))
    if not t.requires_grad:
        return torch.zeros_like(y)
    *vs, direct = torch.autograd.grad(t, [*leaves, y], allow_unused=True)
    del t, leaves
    total = torch.zeros_like(y) if direct is None else direct
    for z, v in zip(zs, vs, strict=True):
        if v is not None:
            total = total + _by_forward_ad(f, G, z, y, v, params)
    return total


_FG = "input_grad"


def input_grad(
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    G: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    y: torch.Tensor,
    frozen_params: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """``df(y, G(z))/dz`` as a tensor that can be differentiated with respect to ``y``, without
    keeping any graph of the frozen model ``G``: a drop-in replacement for
    ``torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0]`` when what follows differentiates
    the result with respect to ``y`` only (the seed-000 loop).

    Its value comes from one plain backward; its backward, given ``v = dL/d(df/dz)``, is
    :func:`mixed_grad` by forward AD (``d/dy <v, df/dz>``), so only ``z`` and ``y`` are kept between
    the two, whatever ``G``'s depth. Gradients flow to ``y`` (and through ``y``'s own graph) only:
    not to ``z``, ``G``'s parameters or tensors ``f`` closes over, and not twice (a second
    derivative through it raises).

    Args:
        f: ``f(y, g) -> scalar``.
        G: the frozen model, a function or an ``nn.Module`` (its parameters are not differentiated).
        z: input of ``G``, a floating-point tensor (it need not require grad).
        y: what the result is later differentiated with respect to; must require grad.
        frozen_params: for a plain-function ``G`` that closes over parameters, those parameters.

    Returns:
        A tensor shaped like ``z``.

    Raises:
        GradscopeError: a callable, tensor or ``requires_grad`` that is off.

    Example:
        >>> import torch
        >>> G = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        >>> f = lambda y, g: ((y * g) ** 2).sum()
        >>> z, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3, requires_grad=True)
        >>> a = torch.autograd.grad(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0].sum(), y)[0]
        >>> b = torch.autograd.grad(input_grad(f, G, z, y).sum(), y)[0]
        >>> torch.allclose(a, b, atol=1e-6)
        True
    """
    _need_callable(_FG, "f", f)
    _need_callable(_FG, "G", G)
    _need_tensor(_FG, "z", z)
    _need_tensor(_FG, "y", y, requires_grad=True)
    if not z.is_floating_point():
        raise _fail(_FG, f"`z` must be a floating-point tensor, got dtype {z.dtype}.")
    params = list(frozen_params)
    if isinstance(G, nn.Module):
        params += list(G.parameters())
    return _InputGrad.apply(y, z.detach(), f, G, params)


class _InputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, y: torch.Tensor, z: torch.Tensor, f: _Fn, G: _G,  # type: ignore[override]
                params: list[torch.Tensor]) -> torch.Tensor:
        with torch.enable_grad(), frozen(params):
            z_leaf = z.requires_grad_(True)
            out = _need_scalar(_FG, "`f`", f(y.detach(), G(z_leaf)))
            (dfdz,) = torch.autograd.grad(out, z_leaf, allow_unused=True)
        z_leaf.requires_grad_(False)
        ctx.save_for_backward(y, z)  # type: ignore[attr-defined]
        ctx.fns = (f, G, params)  # type: ignore[attr-defined]
        return torch.zeros_like(z) if dfdz is None else dfdz

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: object, v: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        y, z = ctx.saved_tensors  # type: ignore[attr-defined]
        f, G, params = ctx.fns  # type: ignore[attr-defined]
        with torch.enable_grad():
            y_leaf = y.detach().requires_grad_(True)
            dy = _by_forward_ad(f, G, z, y_leaf, v.detach(), params)
        return dy, None, None, None, None
