"""Jacobians seven ways (the seed-004 pattern): row loop, batched grad_outputs, the thread's ``repeat``
trick and its double-vjp ("forward from reverse") trick, jacrev, jacfwd, vmap.

All methods return the same matrix. With ``batch_dim=0`` the function is taken to treat samples
independently (no batch norm in train mode, no mixing across the batch) and the per-sample Jacobians
``(B, *out, *in)`` are returned without ever forming the ``(B*out, B*in)`` matrix.

Which is fastest depends on the shape: reverse mode (``loop``, ``batched``, ``repeat``, ``jacrev``,
``vmap``) costs one backward per output element, forward mode (``jacfwd``, and ``double_vjp``, which gets
forward mode out of two reverse passes) one pass per input element. Tall Jacobians (few inputs, many
outputs) favour forward mode, wide ones reverse mode; ``repeat`` and ``batched`` trade memory (one copy
of the forward per output) for fewer, larger operations.

NOTE [ per-sample Jacobians need independent samples ]: ``batch_dim=0`` reads every sample's Jacobian off
the Jacobian of the batch-summed output, which is only right when no output depends on another sample's
input. Batch norm in train mode (or with ``track_running_stats=False``) normalizes with the batch's own
statistics, so its per-sample blocks came out silently wrong with ``loop`` and ``batched``. Such a layer
is refused by name; and since other layers mix samples too (a mean over the batch, attention across
it), the probe run that finds the output shape also back-propagates a fixed random cotangent on sample 0
alone: any non-zero gradient on another sample's input is refused. ``repeat`` without a batch dimension
stacks copies of ``x`` along a new leading dimension and needs the same of ``fn`` across copies, checked
the same way.

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
from torch import nn
from torch.func import jacfwd, jacrev, jvp, vjp, vmap

from gradscope._analyses.strategies._checks import _fail, _need_callable, _need_method
from gradscope._analyses.strategies._modules import modules_run, with_submodules
from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError

__all__ = ["JACOBIAN_METHODS", "jacobian"]

JACOBIAN_METHODS = ("loop", "batched", "repeat", "double_vjp", "jacrev", "jacfwd", "vmap")

_F = "jacobian"
_Fn = Callable[[torch.Tensor], torch.Tensor]


def jacobian(
    fn: _Fn,
    x: torch.Tensor,
    method: str = "jacrev",
    batch_dim: int | None = None,
    create_graph: bool = False,
) -> torch.Tensor:
    """The Jacobian of ``fn`` at ``x``.

    Args:
        fn: maps one tensor to one tensor.
        x: the point; floating point.
        method: ``"loop"`` (one backward per output element), ``"batched"`` (one backward with an
            identity as batched ``grad_outputs``), ``"repeat"`` (the thread's trick: ``fn`` on one copy
            of ``x`` per output element, one backward with an identity; ``fn`` must treat a leading
            dimension of copies independently), ``"double_vjp"`` (the thread's "forward from reverse"
            trick: a vjp ``J^T v`` with ``v`` requiring grad, then one backward per input element
            through it, giving the Jacobian column by column), ``"jacrev"`` / ``"jacfwd"``
            (``torch.func``), or ``"vmap"`` (vmap over vector-Jacobian products; per sample:
            ``vmap(jacrev(fn))``).
        batch_dim: ``None`` for the full Jacobian ``(*out, *in)``; ``0`` for per-sample Jacobians
            ``(B, *out[1:], *in[1:])`` of a function that treats samples independently (see
            NOTE [ per-sample Jacobians need independent samples ]).
        create_graph: keep the graph, so that the Jacobian can be differentiated further (with
            respect to ``x`` when it requires grad, and to ``fn``'s parameters).

    Returns:
        The Jacobian; detached unless ``create_graph``.

    Raises:
        GradscopeError: ``fn`` not callable or not returning a tensor, ``x`` not a floating tensor,
            a batch size that ``fn`` does not keep, samples that ``fn`` mixes (with ``batch_dim=0``),
            copies that ``fn`` mixes (``repeat``), an unknown method or ``batch_dim``.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> J = jacobian(lin, x, method="batched", batch_dim=0)
        >>> J.shape, torch.allclose(J[0], lin.weight)
        (torch.Size([4, 2, 3]), True)
        >>> torch.allclose(jacobian(lin, x, method="double_vjp", batch_dim=0), J)
        True
    """
    _need_callable(_F, "fn", fn)
    _need_method(_F, method, JACOBIAN_METHODS)
    if not isinstance(x, torch.Tensor):
        raise _fail(_F, f"`x` must be a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise _fail(_F, f"`x` must be a floating-point tensor, got dtype {x.dtype}.")
    if batch_dim not in (None, 0):
        raise _fail(_F, f"`batch_dim` must be None (full Jacobian) or 0 (per sample), got {batch_dim!r}.")
    if batch_dim == 0 and x.dim() == 0:
        raise _fail(_F, "`x` is a scalar; batch_dim=0 needs a leading batch dimension.")
    point = x if create_graph else x.detach()
    if batch_dim == 0:
        out_shape = _probe_per_sample(fn, x.detach())
        compute = _per_sample
    else:
        out_shape = _probe(fn, x.detach())
        if method == "repeat":
            _probe_copies(fn, x.detach(), out_shape)
        compute = _full
    with _hooks_set_aside() if method in ("jacrev", "vmap") else contextlib.nullcontext():
        J = compute(fn, point, method, out_shape, create_graph)
    return J if create_graph else J.detach()


# ----- probes ----------------------------------------------------------------------------------
def _probe(fn: _Fn, x: torch.Tensor) -> tuple[int, ...]:
    with torch.no_grad():
        out = fn(x)
    if not isinstance(out, torch.Tensor):
        raise _fail(_F, f"`fn` must return a tensor, got {type(out).__name__}.")
    return tuple(out.shape)


def _probe_per_sample(fn: _Fn, x: torch.Tensor) -> tuple[int, ...]:
    """Output shape; refuses batch statistics and any mixing of samples.
    See NOTE [ per-sample Jacobians need independent samples ]."""
    xp = x.detach().requires_grad_(True)
    with torch.enable_grad(), modules_run() as ran:
        out = fn(xp)
    if not isinstance(out, torch.Tensor):
        raise _fail(_F, f"`fn` must return a tensor, got {type(out).__name__}.")
    out_shape = tuple(out.shape)
    if not out_shape or out_shape[0] != x.shape[0]:
        raise _fail(
            _F,
            f"with batch_dim=0, `fn` must keep the batch size {x.shape[0]} as its output's first "
            f"dimension; it returned shape {out_shape}.",
        )
    own = [("fn", fn)] if isinstance(fn, nn.Module) else []
    for m, path in with_submodules(own + [(None, m) for m in ran]).items():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            why = "train mode" if m.training else "track_running_stats=False"
            raise _fail(
                _F,
                f"`{path}` ({type(m).__name__}, {why}) normalizes with the statistics of the whole "
                "batch, so every output depends on every sample and per-sample Jacobians (batch_dim=0) "
                "would be wrong. Call .eval() on it to use its running statistics, or take the full "
                "Jacobian (batch_dim=None).",
            )
    _refuse_mixing(out, xp, "samples", "per-sample Jacobians (batch_dim=0)")
    return out_shape


def _probe_copies(fn: _Fn, x: torch.Tensor, out_shape: tuple[int, ...]) -> None:
    """``repeat`` runs ``fn`` on a stack of copies of ``x``: ``fn`` must map each copy on its own."""
    xr = x.detach().unsqueeze(0).repeat(2, *([1] * x.dim())).requires_grad_(True)
    try:
        with torch.enable_grad():
            out = fn(xr)
    except Exception as e:
        raise _fail(
            _F,
            f"method='repeat' calls `fn` on copies of `x` stacked along a new first dimension, shape "
            f"{tuple(xr.shape)}, and `fn` failed on it ({type(e).__name__}: {e}). Use another method.",
        ) from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, *out_shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise _fail(
            _F,
            f"method='repeat' needs `fn` to map a stack of copies of `x` to a stack of outputs: on "
            f"shape {tuple(xr.shape)} it returned {got}, not {(2, *out_shape)}. Use another method.",
        )
    _refuse_mixing(out, xr, "copies", "method='repeat'")


def _refuse_mixing(out: torch.Tensor, inp: torch.Tensor, what: str, needs: str) -> None:
    if inp.shape[0] < 2 or not out.requires_grad:
        return
    gen = torch.Generator(device=out.device).manual_seed(0)  # fixed, and no draw from the global RNG
    cot = torch.zeros_like(out)
    cot[0] = torch.randn(out.shape[1:], generator=gen, dtype=out.dtype, device=out.device)
    (g,) = torch.autograd.grad(out, inp, cot, allow_unused=True)
    if g is not None and bool((g[1:] != 0).any()):
        raise _fail(
            _F,
            f"`fn` mixes {what}: the output of {what[:-1]} 0 depends on the input of another {what[:-1]}, "
            f"so {needs} would be wrong. Take the full Jacobian (batch_dim=None) with 'loop', "
            "'batched', 'jacrev' or 'jacfwd'.",
        )


@contextlib.contextmanager
def _hooks_set_aside() -> Iterator[None]:
    """See NOTE [ torch.func under saved-tensor hooks ]."""
    if _compat.top_saved_tensors_hooks() is _compat.NOT_VISIBLE:
        # torch 2.6 cannot show the stack: under someone's hooks the transform refuses to run
        try:
            yield
        except RuntimeError as e:
            if "saved tensor hooks" not in str(e):
                raise
            raise GradscopeError(
                "gradscope: jacobian's 'jacrev' and 'vmap' methods run torch.func, which refuses to run "
                "under saved-tensor hooks (a save_on_cpu, a saved_tensors_hooks pair, a recording), and "
                "this torch cannot set them aside (it has no torch._C._autograd._top_saved_tensors_default_hooks; "
                "torch 2.7 and newer do). Use method='batched' or 'loop' here, or call jacobian outside "
                "the hooks."
            ) from e
        return
    stack = []
    while (top := _compat.top_saved_tensors_hooks()) is not None:
        stack.append(top)
        _compat.pop_saved_tensors_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            _compat.push_saved_tensors_hooks(pack, unpack)


# ----- full Jacobian ---------------------------------------------------------------------------
def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when it is in a graph already (create_graph), else a detached leaf requiring grad."""
    return x if x.requires_grad else x.detach().requires_grad_(True)


def _full(fn: _Fn, x: torch.Tensor, method: str, out_shape: tuple[int, ...], cg: bool) -> torch.Tensor:
    n_out = _numel(out_shape)
    shape = out_shape + tuple(x.shape)
    if method == "jacrev":
        return jacrev(fn)(x)
    if method == "jacfwd":
        return jacfwd(fn)(x)
    if method == "vmap":
        vjp_fn = vjp(fn, x)[1]
        eye = torch.eye(n_out, dtype=x.dtype, device=x.device).view(n_out, *out_shape)
        (rows,) = vmap(vjp_fn)(eye)
        return rows.reshape(shape)
    xr = _leaf(x)
    with torch.enable_grad():
        if method == "repeat":
            # the thread's rev_jacobian: one copy of x per output element, one backward with I
            copies = xr.unsqueeze(0).repeat(n_out, *([1] * x.dim()))
            y = fn(copies).reshape(n_out, n_out)
            eye = torch.eye(n_out, dtype=x.dtype, device=x.device)
            (J,) = torch.autograd.grad(y, copies, eye, create_graph=cg, allow_unused=True)
            return _or_zeros(J, shape, x).reshape(shape)
        y = fn(xr).reshape(-1)
        if method == "loop":
            rows = [
                torch.autograd.grad(y[i], xr, retain_graph=True, create_graph=cg, allow_unused=True)[0]
                for i in range(n_out)
            ]
            return torch.stack([_or_zeros(r, x.shape, x) for r in rows]).reshape(shape)
        if method == "double_vjp":
            cols = _double_vjp_columns(y, xr, torch.ones_like(y), x.numel(), cg)  # (n_in, n_out)
            return cols.transpose(0, 1).reshape(shape)
        # see NOTE [ batched grad_outputs are materialized ]
        eye = torch.eye(n_out, dtype=x.dtype, device=x.device).contiguous()
        (J,) = torch.autograd.grad(
            y, xr, grad_outputs=eye, is_grads_batched=True, create_graph=cg, allow_unused=True
        )
    return _or_zeros(J, shape, x).reshape(shape)


def _double_vjp_columns(
    y: torch.Tensor, xr: torch.Tensor, v: torch.Tensor, n_in: int, cg: bool, per_sample: bool = False
) -> torch.Tensor:
    """Forward mode from two reverse passes (the thread's fwd_jacobian): ``u = J^T v`` is linear in
    ``v``, so the derivative of ``<u, e_i>`` with respect to ``v`` is ``J e_i``, column ``i``. With
    ``per_sample``, ``e_i`` is basis vector ``i`` in every sample at once."""
    v = v.detach().requires_grad_(True)
    (u,) = torch.autograd.grad(y, xr, v, create_graph=True, allow_unused=True)
    if u is None or not u.requires_grad:  # y does not depend on x: J = 0
        return torch.zeros(n_in, *y.shape, dtype=y.dtype, device=y.device)
    flat = u.reshape(u.shape[0], -1) if per_sample else u.reshape(-1)
    cols = []
    for i in range(n_in):
        e = torch.zeros_like(flat)
        e[..., i] = 1
        (c,) = torch.autograd.grad(flat, v, e, retain_graph=True, create_graph=cg, allow_unused=True)
        cols.append(torch.zeros_like(y) if c is None else c)
    return torch.stack(cols)


# ----- per-sample Jacobians --------------------------------------------------------------------
def _per_sample(fn: _Fn, x: torch.Tensor, method: str, out_shape: tuple[int, ...], cg: bool) -> torch.Tensor:
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
        return J.reshape(n_out, B, n_in).transpose(0, 1).reshape(shape)
    if method == "jacfwd":
        # One tangent per input feature, the same for every sample: jvp gives column i for all samples.
        eye = torch.eye(n_in, dtype=x.dtype, device=x.device).view(n_in, 1, *i_shape).expand(n_in, *x.shape)
        cols = vmap(lambda t: jvp(fn, (x,), (t,))[1])(eye.contiguous())  # (n_in, B, *o)
        return cols.reshape(n_in, B, n_out).permute(1, 2, 0).reshape(shape)
    if method == "vmap":

        def single(t: torch.Tensor) -> torch.Tensor:
            return fn(t.unsqueeze(0)).squeeze(0)

        return vmap(jacrev(single))(x).reshape(shape)
    xr = _leaf(x)
    with torch.enable_grad():
        if method == "repeat":
            # one copy of the batch per output element; copy o carries the cotangent e_o in every sample
            copies = xr.repeat(n_out, *([1] * (x.dim() - 1)))  # (n_out * B, *i)
            y = fn(copies).reshape(n_out, B, n_out)
            eye = torch.eye(n_out, dtype=x.dtype, device=x.device).unsqueeze(1).expand(n_out, B, n_out)
            (J,) = torch.autograd.grad(y, copies, eye.contiguous(), create_graph=cg, allow_unused=True)
            J = _or_zeros(J, (n_out * B, *i_shape), x)
            return J.reshape(n_out, B, n_in).transpose(0, 1).reshape(shape)
        y = fn(xr).reshape(B, n_out)
        if method == "loop":
            rows = [
                torch.autograd.grad(y[:, j].sum(), xr, retain_graph=True, create_graph=cg, allow_unused=True)[
                    0
                ]
                for j in range(n_out)
            ]
            J = torch.stack([_or_zeros(r, x.shape, x) for r in rows], 1)  # (B, n_out, *i)
            return J.reshape(shape)
        if method == "double_vjp":
            cols = _double_vjp_columns(
                y, xr, torch.ones_like(y), n_in, cg, per_sample=True
            )  # (n_in, B, n_out)
            return cols.permute(1, 2, 0).reshape(shape)
        # see NOTE [ batched grad_outputs are materialized ]
        eye = (
            torch.eye(n_out, dtype=x.dtype, device=x.device).unsqueeze(1).expand(n_out, B, n_out).contiguous()
        )
        (J,) = torch.autograd.grad(
            y, xr, grad_outputs=eye, is_grads_batched=True, create_graph=cg, allow_unused=True
        )
    J = _or_zeros(J, (n_out, *x.shape), x)
    return J.reshape(n_out, B, n_in).transpose(0, 1).reshape(shape)


def _or_zeros(
    t: torch.Tensor | None, shape: tuple[int, ...] | torch.Size, like: torch.Tensor
) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device) if t is None else t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
