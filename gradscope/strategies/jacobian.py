"""Jacobians five ways (the seed-004 pattern): row loop, batched grad_outputs, jacrev, jacfwd, vmap.

All methods return the same matrix. With ``batch_dim=0`` the function is taken to treat samples
independently (no batch norm in train mode, no mixing across the batch) and the per-sample Jacobians
``(B, *out, *in)`` are returned without ever forming the ``(B*out, B*in)`` matrix.

NOTE [ batched grad_outputs are materialized ]: ``autograd.grad(..., is_grads_batched=True)`` runs the
backward under vmap. An identity built with ``expand`` has stride-0 dimensions; a backward formula
without a batching rule for that layout falls back to a per-sample loop, and formulas that need a
contiguous gradient copy it inside every node. The identity is therefore materialized once with
``.contiguous()`` (one copy, the size of the result). Measured on this project's CPU build (torch 2.13,
one thread, thread CPU time), MLPs with Linear, Tanh, GELU, LayerNorm, softmax, cumsum and conv1d showed
no difference either way (ratios 0.9 to 1.1; ``benchmarks/bench_strategies.py`` prints it); the guard
costs little where it does not help. Not measured on CUDA.

NOTE [ torch.func under saved-tensor hooks ]: ``torch.func.vjp`` / ``jacrev`` refuse to run while any
``saved_tensors_hooks`` pair is active ("don't yet support saved tensor hooks"), which includes a
user's ``save_on_cpu`` and any recorder. The ``jacrev`` and ``vmap`` methods therefore set the hook stack
aside for the duration of the transform and put it back afterwards, also on error. Allocations are still
seen by allocation-level memory tracking; the tensors those transforms save are not seen by the set-aside
hooks (a recording reports their saved bytes as 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.func import jacfwd, jacrev, jvp, vjp, vmap

from gradscope.strategies._checks import _fail, _need_callable, _need_method

__all__ = ["JACOBIAN_METHODS", "jacobian"]

JACOBIAN_METHODS = ("loop", "batched", "jacrev", "jacfwd", "vmap")

_F = "jacobian"


def jacobian(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    method: str = "jacrev",
    batch_dim: int | None = None,
) -> torch.Tensor:
    """The Jacobian of ``fn`` at ``x``.

    Args:
        fn: maps one tensor to one tensor.
        x: the point; floating point. It is detached inside; its ``requires_grad`` does not matter.
        method: ``"loop"`` (one backward per output element), ``"batched"`` (one backward with an
            identity as batched ``grad_outputs``), ``"jacrev"`` / ``"jacfwd"`` (``torch.func``), or
            ``"vmap"`` (vmap over vector-Jacobian products; per sample: ``vmap(jacrev(fn))``).
        batch_dim: ``None`` for the full Jacobian ``(*out, *in)``; ``0`` for per-sample Jacobians
            ``(B, *out[1:], *in[1:])`` of a function that treats samples independently.

    Returns:
        The Jacobian, detached.

    Raises:
        GradscopeError: ``fn`` not callable or not returning a tensor, ``x`` not a floating tensor,
            a batch size that ``fn`` does not keep, an unknown method or ``batch_dim``.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> J = jacobian(lin, x, method="batched", batch_dim=0)
        >>> J.shape, torch.allclose(J[0], lin.weight)
        (torch.Size([4, 2, 3]), True)
    """
    _need_callable(_F, "fn", fn)
    _need_method(_F, method, JACOBIAN_METHODS)
    if not isinstance(x, torch.Tensor):
        raise _fail(_F, f"`x` must be a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise _fail(_F, f"`x` must be a floating-point tensor, got dtype {x.dtype}.")
    if batch_dim not in (None, 0):
        raise _fail(_F, f"`batch_dim` must be None (full Jacobian) or 0 (per sample), got {batch_dim!r}.")
    x = x.detach()
    if batch_dim == 0 and x.dim() == 0:
        raise _fail(_F, "`x` is a scalar; batch_dim=0 needs a leading batch dimension.")
    with torch.no_grad():
        probe = fn(x)
    if not isinstance(probe, torch.Tensor):
        raise _fail(_F, f"`fn` must return a tensor, got {type(probe).__name__}.")
    out_shape = tuple(probe.shape)
    del probe
    if batch_dim == 0:
        if not out_shape or out_shape[0] != x.shape[0]:
            raise _fail(
                _F,
                f"with batch_dim=0, `fn` must keep the batch size {x.shape[0]} as its output's first "
                f"dimension; it returned shape {out_shape}.",
            )
        compute = _per_sample
    else:
        compute = _full
    if method in ("jacrev", "vmap"):
        with _hooks_set_aside():
            return compute(fn, x, method, out_shape)
    return compute(fn, x, method, out_shape)


@contextlib.contextmanager
def _hooks_set_aside() -> Iterator[None]:
    """See NOTE [ torch.func under saved-tensor hooks ]."""
    ag = torch._C._autograd
    if not all(
        hasattr(ag, n)
        for n in (
            "_top_saved_tensors_default_hooks",
            "_pop_saved_tensors_default_hooks",
            "_push_saved_tensors_default_hooks",
        )
    ):
        yield
        return
    stack = []
    while (top := ag._top_saved_tensors_default_hooks(False)) is not None:
        stack.append(top)
        ag._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            ag._push_saved_tensors_default_hooks(pack, unpack)


def _full(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, method: str, out_shape: tuple[int, ...]
) -> torch.Tensor:
    n_out = 1
    for s in out_shape:
        n_out *= s
    shape = out_shape + tuple(x.shape)
    if method == "jacrev":
        return jacrev(fn)(x).detach()
    if method == "jacfwd":
        return jacfwd(fn)(x).detach()
    if method == "vmap":
        vjp_fn = vjp(fn, x)[1]
        eye = torch.eye(n_out, dtype=x.dtype, device=x.device).view(n_out, *out_shape)
        (rows,) = vmap(vjp_fn)(eye)
        return rows.reshape(shape).detach()
    xr = x.requires_grad_(True) if not x.requires_grad else x
    with torch.enable_grad():
        y = fn(xr).reshape(-1)
        if method == "loop":
            rows = [
                torch.autograd.grad(y[i], xr, retain_graph=True, allow_unused=True)[0] for i in range(n_out)
            ]
            rows = [torch.zeros_like(x) if r is None else r for r in rows]
            return torch.stack(rows).reshape(shape).detach()
        # see NOTE [ batched grad_outputs are materialized ]
        eye = torch.eye(n_out, dtype=x.dtype, device=x.device).contiguous()
        (J,) = torch.autograd.grad(y, xr, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
    if J is None:
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return J.reshape(shape).detach()


def _per_sample(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, method: str, out_shape: tuple[int, ...]
) -> torch.Tensor:
    # Samples are independent, so d(sum_b y[b, o]) / d x[b, i] = J_b[o, i]: the Jacobian of the
    # batch-summed output holds every sample's Jacobian side by side.
    B = x.shape[0]
    o_shape, i_shape = out_shape[1:], tuple(x.shape[1:])
    n_out = _numel(o_shape)
    n_in = _numel(i_shape)
    shape = (B, *o_shape, *i_shape)

    def summed(t: torch.Tensor) -> torch.Tensor:
        return fn(t).sum(0)

    if method == "jacrev":
        J = jacrev(summed)(x)  # (*o, B, *i)
        return J.reshape(n_out, B, n_in).transpose(0, 1).reshape(shape).detach()
    if method == "jacfwd":
        # One tangent per input feature, the same for every sample: jvp gives column i for all samples.
        eye = torch.eye(n_in, dtype=x.dtype, device=x.device).view(n_in, 1, *i_shape).expand(n_in, *x.shape)
        cols = vmap(lambda t: jvp(fn, (x,), (t,))[1])(eye.contiguous())  # (n_in, B, *o)
        return cols.reshape(n_in, B, n_out).permute(1, 2, 0).reshape(shape).detach()
    if method == "vmap":

        def single(t: torch.Tensor) -> torch.Tensor:
            return fn(t.unsqueeze(0)).squeeze(0)

        return vmap(jacrev(single))(x).reshape(shape).detach()
    xr = x.requires_grad_(True)
    with torch.enable_grad():
        y = fn(xr).reshape(B, n_out)
        if method == "loop":
            rows = [
                torch.autograd.grad(y[:, j].sum(), xr, retain_graph=True, allow_unused=True)[0]
                for j in range(n_out)
            ]
            rows = [torch.zeros_like(x) if r is None else r for r in rows]
            J = torch.stack(rows, 1)  # (B, n_out, *i)
            return J.reshape(shape).detach()
        # see NOTE [ batched grad_outputs are materialized ]
        eye = (
            torch.eye(n_out, dtype=x.dtype, device=x.device).unsqueeze(1).expand(n_out, B, n_out).contiguous()
        )
        (J,) = torch.autograd.grad(y, xr, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
    if J is None:
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return J.reshape(n_out, B, n_in).transpose(0, 1).reshape(shape).detach()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
