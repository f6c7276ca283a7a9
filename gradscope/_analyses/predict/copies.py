"""The step's objects copied to meta (NOTE [ no data is copied ]): its modules, optimizers, LR
schedulers and the tensors inside its arguments (NOTE [ tensors inside argument objects ]), and a
batch resized."""

from __future__ import annotations

import copy
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradscope._analyses.predict.values import known_from
from gradscope._base import compat as _compat
from gradscope._base.compat import storage_key as _storage_key
from gradscope._base.errors import GradscopeError


# ----------------------------------------------------------------------------------------------
# copying to meta
# ----------------------------------------------------------------------------------------------
def _meta_like(t: torch.Tensor) -> torch.Tensor:
    m: torch.Tensor = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        m = nn.Parameter(m, requires_grad=t.requires_grad)
    elif t.requires_grad:
        m.requires_grad_(True)
    if t.is_leaf and t.grad is not None:
        m.grad = torch.empty_strided(
            tuple(t.grad.shape), tuple(t.grad.stride()), dtype=t.grad.dtype, device="meta"
        )
    return m


def _collect_tensors(obj: Any, out: dict[int, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable through containers, modules and optimizers (iteratively)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out[id(o)] = o
        elif isinstance(o, nn.Module):
            for m in o.modules():  # (one walk over the modules: their parameters, buffers, tensor attributes)
                for t in (*m._parameters.values(), *m._buffers.values()):
                    if t is not None:
                        out[id(t)] = t
                stack.extend(v for v in vars(m).values() if isinstance(v, torch.Tensor))
        elif isinstance(o, torch.optim.Optimizer):
            for g in o.param_groups:
                stack.extend(g["params"])
            for st in o.state.values():
                stack.extend(st.values() if isinstance(st, Mapping) else ())
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        else:
            stack.extend(_attributes(o))


# NOTE [ tensors inside argument objects ]: a step's batch is often an object: a dataclass, a
# torch_geometric ``Data`` (its tensors in a storage object under ``_store``), a ``transformers``
# ``BatchEncoding``. Its tensors are found through its attributes (``__dict__`` and ``__slots__``),
# so that the copy for meta (``copy.deepcopy`` with every tensor mapped, see NOTE [ no data is
# copied ]) holds meta tensors where the object held real ones. Classes, functions and Python
# modules are not entered.
def _attributes(o: Any) -> list[Any]:
    """The values of an object's attributes, where it is an instance with any."""
    if isinstance(o, type | types.ModuleType | types.FunctionType | types.MethodType | types.BuiltinFunctionType
                  | str | bytes | int | float | complex | bool) or o is None:
        return []
    out: list[Any] = []
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        out.extend(d.values())
    for cls in type(o).__mro__:
        for slot in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
            if slot not in ("__dict__", "__weakref__") and hasattr(o, slot):
                out.append(getattr(o, slot))
    return out


def _to_meta(args: Any) -> tuple[Any, dict[int, Any]]:
    """A deep copy of ``args`` in which every tensor is an empty meta tensor of the same shape,
    dtype, strides and ``requires_grad`` (parameters stay parameters; gradients are mirrored).

    NOTE [ no data is copied ]: ``copy.deepcopy`` is given a memo that already maps every tensor
    to its meta twin, so modules and optimizers are rebuilt around meta tensors and the user's
    objects (and their memory) are never duplicated or modified."""
    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors(args, tensors, set())
    counters = _optimizer_scalars(args)
    memo: dict[int, Any] = {}
    for i, t in tensors.items():
        if t.device.type == "meta":
            memo[i] = t
        elif i in counters:
            memo[i] = t.detach().clone()  # see NOTE [ optimizer steps keep the default device ]
        else:
            memo[i] = _meta_like(t.detach() if not t.is_leaf else t)
            known_from(t, memo[i])  # see NOTE [ values known on meta ] in gradscope._analyses.predict.values
            if not t.is_leaf and t.requires_grad:
                memo[i].requires_grad_(True)
    try:
        out = copy.deepcopy(tuple(args), memo)
        copied_schedulers(args, memo)
        return out, memo
    except Exception as e:
        raise GradscopeError(
            f"gradscope: could not copy the step's arguments to the meta device ({type(e).__name__}: {e}). "
            "Pass modules, tensors and optimizers, or build them in make_args(batch_size)."
        ) from e


def copied_schedulers(originals: Any, memo: Mapping[int, Any]) -> None:
    """After ``copy.deepcopy(originals, memo)``: each copied optimizer whose LR scheduler was copied
    with it wrapped as that scheduler wraps it (see NOTE [ a copied optimizer and its LR scheduler ]
    in gradscope._base.compat)."""
    found: dict[int, Any] = {}
    stack, seen = [originals], set()
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, torch.Tensor | nn.Module):
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.lr_scheduler.LRScheduler):
            opt = getattr(o, "optimizer", None)
            if opt is not None:
                found[id(opt)] = opt
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
    for i, opt in found.items():
        twin = memo.get(i)
        if twin is not None and twin is not opt:
            _compat.track_lr_scheduler_step(twin, opt)


def _optimizer_scalars(args: Any) -> set[int]:
    """ids of the 0-dim tensors in the state of the optimizers among ``args`` (step counters,
    ASGD's eta and mu): a real step reads them with ``.item()``, so the copy keeps their values
    on their own device instead of making them meta."""
    out: set[int] = set()
    for o in _flat(args):
        if isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                if isinstance(st, Mapping):
                    out.update(id(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 0)
    return out


def _module_names(args: Sequence[Any], frame: Any) -> dict[int, str]:
    """``id(module) -> name`` for the modules among ``args``: the caller's variable that holds
    it (locals first, then globals), else its class name."""
    out: dict[int, str] = {}
    mods = [a for a in _flat(args) if isinstance(a, nn.Module)]
    if not mods:
        return out
    try:
        local_ns = frame.f_locals
        scopes = [dict(local_ns), frame.f_globals]
        if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1 and local_ns is not frame.f_globals:
            # see NOTE [ f_locals keeps tensors alive ] in gradscope._capture.held_graphs: drop the snapshot
            local_ns.clear()
    except Exception:
        scopes = []
    for m in mods:
        if id(m) in out:
            continue
        name = next(
            (
                k
                for sc in scopes
                for k, v in list(sc.items())
                if v is m and isinstance(k, str) and k.isidentifier() and not k.startswith("_")
            ),
            None,
        )
        out[id(m)] = name or type(m).__name__
    del scopes
    return out


def _resident_bytes(meta_args: Any) -> list[int]:
    """Bytes of each distinct storage among the (meta) arguments, parameters, gradients and
    optimizer state: what is on the device before the step runs."""
    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors(meta_args, tensors, set())
    for t in list(tensors.values()):
        if t.grad is not None:
            tensors[id(t.grad)] = t.grad
    seen: dict[int, int] = {}
    for t in tensors.values():
        key = _storage_key(t)
        if key is not None:
            seen[key] = int(t.untyped_storage().nbytes())
    return list(seen.values())


def _batch_dim(args: Sequence[Any]) -> int | None:
    for a in _flat(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[0])
    return None


def _flat(obj: Any) -> list[Any]:
    out: list[Any] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Mapping):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, list | tuple):
            stack.extend(reversed(o))
        else:
            out.append(o)
    return out


def _resize(args: Any, dim: int | None, b: int) -> Any:
    """``args`` with every tensor whose first dimension is ``dim`` rebuilt as a meta tensor of
    first dimension ``b`` (contiguous). Modules and other objects are kept as they are."""

    def one(o: Any) -> Any:
        if (
            isinstance(o, torch.Tensor)
            and not isinstance(o, nn.Parameter)
            and o.dim() >= 1
            and o.shape[0] == dim
        ):
            t = torch.empty((b, *o.shape[1:]), dtype=o.dtype, device="meta")
            return t.requires_grad_(o.requires_grad)
        if isinstance(o, Mapping):
            return (
                type(o)({k: one(v) for k, v in o.items()})
                if isinstance(o, dict)
                else {k: one(v) for k, v in o.items()}
            )
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return type(o)(*(one(v) for v in o))
        if isinstance(o, list | tuple):
            return type(o)(one(v) for v in o)
        return o

    return tuple(one(a) for a in args)


def _make(make_args: Callable[[int], Any], b: int) -> tuple[Any, ...]:
    try:
        with torch.device("meta"):
            out = make_args(b)
    except Exception as e:
        raise GradscopeError(f"gradscope: make_args({b}) raised {type(e).__name__}: {e}.") from e
    return tuple(out) if isinstance(out, tuple) else (out,)
