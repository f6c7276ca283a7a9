"""Argument checks shared by the strategies: each failure says which argument is off."""

from __future__ import annotations

from typing import Any

import torch

from gradscope.errors import GradscopeError

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
