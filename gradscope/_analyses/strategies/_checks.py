"""Argument checks shared by the strategies: each failure says which argument is off."""

from __future__ import annotations

from typing import Any

import torch

from gradscope._base.errors import GradscopeError

__all__: list[str] = []


def _fail(func: str, msg: str) -> GradscopeError:
    return GradscopeError(f"gradscope.strategies.{func}: {msg}")


def _need_callable(func: str, name: str, value: Any) -> None:
    if not callable(value):
        raise _fail(
            func, f"`{name}` must be callable (a function or an nn.Module), got {type(value).__name__}."
        )


def _need_tensor(func: str, name: str, value: Any, *, requires_grad: bool | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _fail(func, f"`{name}` must be a torch.Tensor, got {type(value).__name__}.")
    if requires_grad is True and not value.requires_grad:
        raise _fail(
            func,
            f"`{name}` must require grad (the result is a derivative with respect to it); "
            f"call `{name}.requires_grad_()` first.",
        )
    if requires_grad is False and value.requires_grad:
        raise _fail(func, f"`{name}` must not require grad; pass `{name}.detach()`.")
    return value


def _need_float(func: str, name: str, value: torch.Tensor) -> None:
    if not value.is_floating_point():
        raise _fail(func, f"`{name}` must be a floating-point tensor, got dtype {value.dtype}.")


def _need_scalar(func: str, what: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _fail(func, f"{what} must return a tensor, got {type(value).__name__}.")
    if value.numel() != 1:
        raise _fail(
            func, f"{what} must return a scalar, got shape {tuple(value.shape)}; reduce it (e.g. .sum())."
        )
    return value


def _need_method(func: str, method: str, allowed: tuple[str, ...]) -> None:
    if method not in allowed:
        raise _fail(func, f"`method` must be one of {', '.join(repr(m) for m in allowed)}, got {method!r}.")


# (rtol, atol) against the largest magnitude of the reference, per dtype
_CLOSE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.float16: (1e-2, 1e-4),
    torch.bfloat16: (4e-2, 1e-3),
}


def _outputs_close(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when ``got`` equals ``want`` to a dtype tolerance, otherwise what differs."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if got.is_meta or want.is_meta:  # under gs.predict: no values, nothing more to compare
        return ""
    if torch.equal(got, want):
        return ""
    if not got.is_floating_point():
        return "values differ"
    rtol, atol = _CLOSE.get(want.dtype, (1e-5, 1e-7))
    g64, w64 = got.double(), want.double()
    if not torch.equal(torch.isnan(g64), torch.isnan(w64)):
        return "NaN in one and not the other"
    finite = ~torch.isnan(w64)
    err = (g64 - w64).abs()[finite].max().item() if finite.any() else 0.0
    limit = atol + rtol * (w64.abs()[finite].max().item() if finite.any() else 0.0)
    return "" if err <= limit else f"max abs difference {err:.3g}, tolerance {limit:.3g}"
