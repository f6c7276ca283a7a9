"""Names: module paths, parameter names and what a root module is called, in one place.

NOTE [ naming roots ]: a module path is ``<root name>.<path inside the root>``. The root (the
outermost module called in the block) is named, first match wins:

1. by ``modules=`` (``{"G": G}``; a module passed alone names paths relative to itself), also when
   the called root is a submodule of a module passed there (``model.encoder``);
2. by the user's own variable: the variable of the frame where the block ends (locals first, then
   globals) that *is* the module, found by identity (``G``, also when ``G`` was called inside a
   helper), or that contains it (``model.0`` for ``model[0](x)``);
3. otherwise a lone root gives bare paths (``0``, ``layers.0.linear1``) and several roots their
   class names (``Sequential#1`` when two share a class).

Earlier versions named a lone root's paths from the root itself (``0``) even when the user's
variable was ``G``, which is why a diagnosis then spoke of ``model[0]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from gradscope._base.errors import GradscopeError

__all__ = ["code_path", "full_name", "modules_arg", "names_in_frame", "parameter_names", "root_prefixes"]


def modules_arg(modules: Any) -> list[tuple[str, nn.Module]]:
    """``modules=`` as ``[(name, module)]``: a module alone has the name ``""``."""
    if modules is None:
        return []
    if isinstance(modules, nn.Module):
        return [("", modules)]
    if isinstance(modules, Mapping):
        out = []
        for k, m in modules.items():
            if not isinstance(m, nn.Module):
                raise GradscopeError(f"gradscope: modules[{k!r}] is not an nn.Module.")
            out.append((str(k), m))
        return out
    raise GradscopeError(
        "gradscope: modules= takes an nn.Module or a dict {'name': module}, "
        f"got {type(modules).__name__}."
    )


def full_name(prefix: str, rel: str) -> str:
    """``("G", "0.weight")`` -> ``"G.0.weight"``; an empty part is left out."""
    if not prefix:
        return rel
    return prefix if not rel else f"{prefix}.{rel}"


def parameter_names(modules: Any) -> dict[int, tuple[str, str]]:
    """``id(tensor) -> (kind, full name)`` for the parameters (``"parameter"``) and buffers
    (``"buffer"``) of ``modules=``."""
    out: dict[int, tuple[str, str]] = {}
    for prefix, m in modules_arg(modules):
        for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
            for name, p in named:
                out.setdefault(id(p), (kind, full_name(prefix, name)))
    return out


def _find_in(module: nn.Module, holders: Iterable[tuple[str, Any]]) -> str | None:
    """The name under which ``module`` is reached from ``holders``: itself, or as a submodule."""
    holders = list(holders)
    for name, v in holders:
        if v is module:
            return name
    for name, v in holders:
        if isinstance(v, nn.Module) and v is not module:
            for sub, m in v.named_modules():
                if m is module and sub:
                    return full_name(name, sub)
    return None


def names_in_frame(modules: list[nn.Module | None], local_ns: Mapping[str, Any] | None,
                   global_ns: Mapping[str, Any] | None) -> dict[int, str]:
    """For each module (by position), the user variable that is it or contains it: see NOTE
    [ naming roots ], rule 2. Private names (``_x``) are skipped."""
    holders: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for ns in (local_ns, global_ns):
        if not ns:
            continue
        for name in sorted(k for k in ns if isinstance(k, str)):
            v = ns[name]
            if name.startswith("_") or not isinstance(v, nn.Module) or id(v) in seen:
                continue
            seen.add(id(v))
            holders.append((name, v))
    out: dict[int, str] = {}
    if not holders:
        return out
    for i, m in enumerate(modules):
        if m is not None:
            found = _find_in(m, holders)
            if found:
                out[i] = found
    return out


def given_name(module: nn.Module, given: list[tuple[str, nn.Module]]) -> str | None:
    """Rule 1 of NOTE [ naming roots ]: the name ``modules=`` gives this root, if any."""
    found = _find_in(module, given)
    return found


def root_prefixes(roots: list[tuple[str, str | None]], found: Mapping[int, str], any_given: bool) -> list[str]:
    """The name of each root (``(class name, name from modules=)``) given the variables found for
    them: see NOTE [ naming roots ]. ``any_given``: ``modules=`` was passed."""
    out: list[str] = []
    unnamed = [i for i, (_, given) in enumerate(roots) if given is None and i not in found]
    for i, (cls, given) in enumerate(roots):
        if given is not None:
            out.append(given)
        elif i in found:
            out.append(found[i])
        elif len(roots) == 1 and not any_given:
            out.append("")
        else:
            same = [j for j in unnamed if roots[j][0] == cls]
            out.append(cls if len(same) <= 1 else f"{cls}#{same.index(i)}")
    return out


def code_path(module: str) -> str:
    """A module path as Python that reaches it: ``layers.3`` -> ``layers[3]``; a path relative to
    an unnamed root (``1.conv``) starts from ``model``."""
    parts = module.split(".")
    out = parts[0] if parts[0].isidentifier() else f"model[{parts[0]}]" if parts[0].isdigit() else "model"
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}" if p.isidentifier() else ""
    return out
