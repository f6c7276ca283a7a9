"""Which modules a call runs, and whether their state changed: for strategies that run a model twice.

NOTE [ what counts as a module's state ]: a recompute is only the same computation if nothing the
forward reads changed in between, and a module's forward may keep anything on itself. So the state of a
module is everything in it apart from ``nn.Module``'s own bookkeeping (hook dicts, the submodule dict,
``training``):
  * buffers: cloned (they are small: running statistics, power-iteration vectors, masks) and compared by
    value, so a buffer written in place (``out=``, ``copy_``, ``.data``) is seen;
  * parameters: held by reference with their version counter (cloning them would double the model);
    replacing one, or an in-place write that bumps the version, is seen. A write through ``.data``
    bypasses the version counter and is not;
  * every other attribute: tensors by reference and version (a replaced tensor is compared by value,
    so ``weight_norm`` recomputing an equal ``weight`` on each forward is no change), plain values
    (numbers, strings, tuples, lists, dicts of them) by value, other objects by identity.
``parametrize`` keeps its state in submodules (``parametrizations.weight.0._u``), covered by walking
every submodule of every module that ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._base import compat as _compat

__all__: list[str] = []

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


@contextlib.contextmanager
def modules_run() -> Iterator[list[nn.Module]]:
    """Collect every module whose forward starts inside the block (a global forward pre-hook, this
    thread only), in first-call order; the hook is removed on exit, also on error."""
    import threading

    seen: dict[nn.Module, None] = {}
    me = threading.get_ident()

    def pre_hook(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == me and module not in seen:
            seen[module] = None

    handle = nn.modules.module.register_module_forward_pre_hook(pre_hook)
    out: list[nn.Module] = []
    try:
        yield out
    finally:
        handle.remove()
        out.extend(seen)


def with_submodules(roots: list[tuple[str | None, nn.Module]]) -> dict[nn.Module, str]:
    """Every module under ``roots`` -> a readable path: the root's given name (its class name when
    ``None``) and the submodule's path; the first root wins where they overlap."""
    names: dict[nn.Module, str] = {}
    counts: dict[str, int] = {}
    for given, root in roots:
        if root in names:
            continue
        if given is None:
            cls = type(root).__name__
            counts[cls] = counts.get(cls, 0) + 1
            given = cls if counts[cls] == 1 else f"{cls}#{counts[cls]}"
        for name, m in root.named_modules():
            if m not in names:
                names[m] = f"{given}.{name}" if name else given
    return names


@dataclass(frozen=True)
class Change:
    """One piece of module state that differs from the snapshot."""

    path: str  # "spectral.0.weight_u"
    kind: str  # "buffer", "parameter", "attribute"
    how: str  # "changed in place", "replaced by different values", "3 -> 4"

    def __str__(self) -> str:
        return f"{self.path} ({self.kind}) {self.how}"


class StateSnapshot:
    """The state of some modules at one moment; see NOTE [ what counts as a module's state ]."""

    def __init__(self, names: dict[nn.Module, str]) -> None:
        self._entries: list[tuple[nn.Module, str, str, str, Any]] = []
        for m, path in names.items():
            for k, b in m._buffers.items():
                if b is not None:
                    self._entries.append((m, path, k, "buffer", (b, b.detach().clone())))
            for k, p in m._parameters.items():
                if p is not None:
                    self._entries.append((m, path, k, "parameter", (p, _compat.tensor_version(p))))
            for k, v in m.__dict__.items():
                if k not in _MODULE_INTERNALS:
                    self._entries.append((m, path, k, "attribute", _freeze(v)))

    def changes(self) -> list[Change]:
        out: list[Change] = []
        for m, path, key, kind, then in self._entries:
            where = f"{path}.{key}" if path else key
            if kind == "buffer":
                now_t = m._buffers.get(key)
                old, copy = then
                if now_t is None:
                    out.append(Change(where, kind, "was removed"))
                elif not _same_values(now_t, copy):
                    how = "changed in place" if now_t is old else "replaced by different values"
                    out.append(Change(where, kind, how))
            elif kind == "parameter":
                now_p = m._parameters.get(key)
                old, version = then
                if now_p is not old:
                    out.append(Change(where, kind, "was replaced"))
                elif now_p is not None and _compat.tensor_version(now_p) != version:
                    out.append(Change(where, kind, "changed in place"))
            else:
                if key not in m.__dict__:
                    out.append(Change(where, kind, "was removed"))
                    continue
                how = _differs(then, m.__dict__[key])
                if how:
                    out.append(Change(where, kind, how))
        seen_attrs = {(m, key) for m, _, key, kind, _ in self._entries if kind == "attribute"}
        for m, path in {e[0]: e[1] for e in self._entries}.items():
            for k in m.__dict__:
                if k not in _MODULE_INTERNALS and (m, k) not in seen_attrs:
                    out.append(Change(f"{path}.{k}" if path else k, "attribute", "was added"))
        return out

    def restore(self) -> None:
        """Put back buffers and attributes (parameters changed in place cannot be: no copy is kept)."""
        known = {(id(m), key) for m, _, key, kind, _ in self._entries if kind == "attribute"}
        for m in {e[0]: None for e in self._entries}:
            for k in [k for k in m.__dict__ if k not in _MODULE_INTERNALS and (id(m), k) not in known]:
                del m.__dict__[k]  # added since the snapshot
        with torch.no_grad():
            for m, _, key, kind, then in self._entries:
                if kind == "buffer":
                    old, copy = then
                    if m._buffers.get(key) is not old:
                        m._buffers[key] = old
                    if not _same_values(old, copy):
                        old.copy_(copy)
                elif kind == "parameter":
                    old, _ = then
                    if m._parameters.get(key) is not old:
                        m._parameters[key] = old
                elif isinstance(then, _Frozen) and then.original is not _MISSING:
                    m.__dict__[key] = then.original


_MISSING = object()


@dataclass(frozen=True)
class _Frozen:
    original: Any  # the object itself (kept for restore and identity)
    kind: str  # "plain", "tensor", "seq", "dict", "object"
    value: Any  # comparable form


def _freeze(v: Any, depth: int = 0) -> _Frozen:
    if isinstance(v, torch.Tensor):
        return _Frozen(v, "tensor", _compat.tensor_version(v))
    if isinstance(v, _PLAIN):
        return _Frozen(v, "plain", v)
    if depth < 3 and isinstance(v, (list, tuple)):
        return _Frozen(v, "seq", (type(v), tuple(_freeze(x, depth + 1) for x in v)))
    if depth < 3 and isinstance(v, dict):
        return _Frozen(v, "dict", tuple((k, _freeze(x, depth + 1)) for k, x in v.items()))
    return _Frozen(v, "object", None)


def _differs(then: _Frozen, now: Any) -> str:
    """'' when ``now`` equals the frozen state, otherwise how it differs."""
    if then.kind == "tensor":
        if not isinstance(now, torch.Tensor):
            return f"was a tensor, now {type(now).__name__}"
        if now is then.original:
            return "changed in place" if _compat.tensor_version(now) != then.value else ""
        return "" if _same_values(now, then.original) else "replaced by different values"
    if then.kind == "plain":
        if type(now) is type(then.value) and (now == then.value or now != now and then.value != then.value):
            return ""
        return f"{_short(then.value)} -> {_short(now)}"
    if then.kind == "seq":
        typ, items = then.value
        if type(now) is not typ or len(now) != len(items):
            return "changed"
        return "changed" if any(_differs(a, b) for a, b in zip(items, now, strict=True)) else ""
    if then.kind == "dict":
        if not isinstance(now, dict) or list(now) != [k for k, _ in then.value]:
            return "changed"
        return "changed" if any(_differs(a, now[k]) for k, a in then.value) else ""
    return "" if now is then.original else "was replaced"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:  # under gs.predict there are no values to compare: shapes and dtypes are all
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(
            torch.equal(a, b)
            or torch.equal(torch.isnan(a), torch.isnan(b))
            and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        )
    return bool(torch.equal(a, b))


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."
