"""Forward AD through frozen weights without weight-sized zero tangents.

NOTE [ forward AD through a frozen weight materializes a zero tangent ]: PyTorch's forward-AD formula
for ``addmm`` (what ``nn.Linear`` runs) is ``self_t + mat1_t @ mat2_p + mat1_p @ mat2_t``. A weight
that carries no tangent gets an ``_efficientzerotensor`` for ``mat2_t``; ``mat1_p @ mat2_t`` then goes
through the ZeroTensor fallback, which turns the zero tensor into an expanded scalar zero, and the CPU
``mm`` kernel copies that stride-0 operand into a contiguous weight-sized buffer before multiplying by
zero. Measured on torch 2.13 (CPU): 2 MiB for a 1024x512 ``nn.Linear`` with a (1, 512) input whose
plain forward allocates 4 KiB; ``torch.matmul`` with a plain weight and ``conv2d`` (the
``convolution_jvp`` formula) do the same. The temporary is freed at once, so the peak of a forward-AD
pass through a frozen model is one weight larger than its activations.

The formula cannot be changed from outside PyTorch, but the tangent of an op that is linear in its one
dual operand is that op applied to the tangent: ``linear(x, W, b)`` has tangent ``linear(x_t, W)``,
``a @ W`` has ``a_t @ W``, ``conv(x, W, b)`` has ``conv(x_t, W)``, ``addmm(b, x, W)`` has ``x_t @ W``. :func:`frozen_operand_tangents` is a
``TorchFunctionMode`` that computes those ops on primal and tangent separately and rebuilds the dual
output with ``make_dual``, so the zero tangent is never formed. It acts only when exactly one operand
carries a tangent (the frozen-model case); anything else goes to PyTorch unchanged. Tangents equal
PyTorch's own bit for bit on the ops handled (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode

__all__: list[str] = []

# op -> index of the bias argument (dropped from the tangent), None when the op has no bias
_AFFINE: dict[Callable[..., Any], int] = {
    F.linear: 2,
    torch.conv1d: 2,
    torch.conv2d: 2,
    torch.conv3d: 2,
    torch.conv_transpose1d: 2,
    torch.conv_transpose2d: 2,
    torch.conv_transpose3d: 2,
}
_BILINEAR: set[Callable[..., Any]] = {
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.mm,
    torch.Tensor.bmm,
}
_RMATMUL = torch.Tensor.__rmatmul__


def _tangent(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    return forward_ad.unpack_dual(t).tangent


def _primal(t: torch.Tensor) -> torch.Tensor:
    return forward_ad.unpack_dual(t).primal


class _FrozenOperandTangents(TorchFunctionMode):
    """See NOTE [ forward AD through a frozen weight materializes a zero tangent ]."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _AFFINE:
            out = _affine(func, _AFFINE[func], args, kwargs)
        elif func in _BILINEAR:
            out = _bilinear(func, args, kwargs)
        elif func is _RMATMUL:
            out = _bilinear(torch.matmul, (args[1], args[0]), kwargs) if len(args) == 2 else None
        elif func is torch.einsum:
            out = _einsum(args, kwargs)
        elif func in (torch.addmm, torch.Tensor.addmm):
            out = _addmm(args, kwargs)
        else:
            out = None
        return func(*args, **kwargs) if out is None else out


def _affine(
    func: Callable[..., Any], bias_at: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    if not args or "input" in kwargs or "weight" in kwargs:
        return None
    x_t = _tangent(args[0])
    if x_t is None:
        return None
    rest = list(args[1:])
    if any(_tangent(a) is not None for a in rest) or any(_tangent(v) is not None for v in kwargs.values()):
        return None
    primal = func(_primal(args[0]), *rest, **kwargs)
    t_args = [x_t, *rest]
    t_kwargs = dict(kwargs)
    if len(t_args) > bias_at:
        t_args[bias_at] = None
    t_kwargs.pop("bias", None)
    tangent = func(*t_args, **t_kwargs)
    return forward_ad.make_dual(primal, tangent)


def _bilinear(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    a_t, b_t = _tangent(a), _tangent(b)
    if (a_t is None) == (b_t is None):  # neither or both dual: PyTorch's own formula
        return None
    if a_t is not None:
        primal = func(_primal(a), b)
        tangent = func(a_t, b)
    else:
        assert b_t is not None
        primal = func(a, _primal(b))
        tangent = func(a, b_t)
    return forward_ad.make_dual(primal, tangent)


def _addmm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    # addmm(bias, mat1, mat2, beta=, alpha=): GPT-2's Conv1D calls it directly with a frozen weight
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    bias, a, b = args
    if _tangent(bias) is not None:
        return None
    a_t, b_t = _tangent(a), _tangent(b)
    if (a_t is None) == (b_t is None):
        return None
    alpha = kwargs.get("alpha", 1)
    if a_t is not None:
        primal = torch.addmm(bias, _primal(a), b, **kwargs)
        tangent = torch.mm(a_t, b)
    else:
        assert b_t is not None
        primal = torch.addmm(bias, a, _primal(b), **kwargs)
        tangent = torch.mm(a, b_t)
    return forward_ad.make_dual(primal, tangent if alpha == 1 else tangent * alpha)


def _einsum(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return None
    eq, ops = args[0], list(args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    tangents = [_tangent(o) for o in ops]
    duals = [i for i, t in enumerate(tangents) if t is not None]
    if len(duals) != 1:
        return None
    i = duals[0]
    primals = list(ops)
    primals[i] = _primal(ops[i])
    with_tangent = list(ops)
    with_tangent[i] = tangents[i]
    return forward_ad.make_dual(torch.einsum(eq, *primals), torch.einsum(eq, *with_tangent))


def frozen_operand_tangents() -> _FrozenOperandTangents:
    """A mode under which linear, matmul, conv and einsum push a tangent through a frozen operand
    without forming a zero tangent for it.

    Example:
        >>> import torch
        >>> from torch.autograd import forward_ad
        >>> lin = torch.nn.Linear(3, 2).requires_grad_(False)
        >>> x, v = torch.randn(4, 3), torch.randn(4, 3)
        >>> with forward_ad.dual_level(), frozen_operand_tangents():
        ...     t = forward_ad.unpack_dual(lin(forward_ad.make_dual(x, v))).tangent
        >>> torch.allclose(t, v @ lin.weight.T)
        True
    """
    return _FrozenOperandTangents()


def _iter_ops() -> Iterator[Callable[..., Any]]:  # for tests: every op the mode handles
    yield from _AFFINE
    yield from _BILINEAR
    yield _RMATMUL
    yield torch.einsum
    yield torch.addmm
