"""The copies a fix runs on and what is compared after it: the user's objects copied as they are
(``_replica``), the user's functions rebuilt to read the copies (NOTE [ the user's functions as they are ]),
the results of a run taken and compared with another's (``_results``, ``_compare``)."""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import re
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradscope._base import compat as _compat

_TOLERANCE = 1e-4  # largest relative difference of a result counted as equal (float32 reordering)
# NOTE [ parameters after an optimizer's step ]: Adam's first step moves each element by about the
# learning rate whatever its gradient's size (m / sqrt(v)), so an element whose gradient is near
# epsilon turns a rounding difference of 1e-7 into a move of a few percent of the learning rate; and
# it would not see a gradient scaled by two at all. Gradients, optimizer state and buffers are
# compared at 1e-4 (relative to each tensor's largest value); parameters, which the step moved, at
# 1e-3. A finding's ``tolerance`` says when a fix needs more (autocast). A parameter whose optimizer
# state (its moments: Adam's exp_avg and exp_avg_sq, a momentum buffer; the step count left out)
# agrees within 1e-4 is not compared itself: the state holds the gradients the steps received
# (exp_avg is (1 - beta1) * g after a first step), and the same optimizer moved the parameter from
# them, by m / sqrt(v) where the gradient is near zero (GPT-2 6 x 384's micro-batches of 2 left a
# layer norm's bias 7e-3 apart, relative, whose moments agreed). A fix that changed the gradients
# changes the state.
PARAMETER_TOLERANCE = 1e-3
_PARAM = "#parameter"
_GRAPH = " (with its graph)"


# NOTE [ the user's functions as they are ]: a step calls the user's functions (``train_step``,
# ``inner_loss``) that read the user's objects through their module's globals or their closure; on
# the copies they must read the copies. Only such a function is rebuilt: its code, defaults,
# keyword-only defaults (``__kwdefaults__``), attributes and name kept, its globals a copy of its
# module's with the copies in, each closure cell that holds one of the user's objects (or such a
# function) a new cell holding its copy. Every other function, a library's above all
# (``torch.func.functional_call``), is passed as it is.
def _passed_as_is(v: Any) -> bool:
    return isinstance(v, types.ModuleType | types.FunctionType | types.BuiltinFunctionType | type | int
                      | float | str | bool | bytes | torch.dtype | torch.device) or v is None


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _global_reads(f: types.FunctionType, seen: set[int] | None = None) -> set[str]:
    """Names ``f`` reads from its globals, and those the functions it reads there read from theirs."""
    seen = seen if seen is not None else set()
    if id(f) in seen:
        return set()
    seen.add(id(f))
    names = _code_names(f.__code__) & set(f.__globals__)
    out = set(names)
    for n in names:
        g = f.__globals__.get(n)
        if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
            out |= _global_reads(g, seen)
    return out


def _closure_objects(f: types.FunctionType, seen: set[int] | None = None) -> list[Any]:
    """The objects ``f``'s closure cells hold (and those of the functions there), in order."""
    seen = seen if seen is not None else set()
    if id(f) in seen:
        return []
    seen.add(id(f))
    out: list[Any] = []
    for cell in f.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, types.FunctionType):
            out += _closure_objects(v, seen)
        else:
            out.append(v)
    for n in _code_names(f.__code__) & set(f.__globals__):
        g = f.__globals__.get(n)
        if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
            out += _closure_objects(g, seen)
    return out


class _Rebuilt:
    """The user's functions rebuilt to read the copies (see NOTE [ the user's functions as they are ])."""

    def __init__(self, twins: Mapping[int, Any]) -> None:
        self.twins = twins  # id(the user's object) -> its copy
        self.done: dict[int, types.FunctionType] = {}
        self.globals: dict[int, dict[str, Any]] = {}

    def needs(self, f: types.FunctionType, seen: set[int] | None = None) -> bool:
        seen = seen if seen is not None else set()
        if id(f) in seen:
            return False
        seen.add(id(f))
        g = f.__globals__
        for n in _code_names(f.__code__) & set(g):
            v = g[n]
            if id(v) in self.twins or (isinstance(v, types.FunctionType) and self.needs(v, seen)):
                return True
        for cell in f.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if id(v) in self.twins or (isinstance(v, types.FunctionType) and self.needs(v, seen)):
                return True
        return False

    def function(self, f: types.FunctionType) -> types.FunctionType:
        if id(f) in self.done:
            return self.done[id(f)]
        if not self.needs(f):
            return f
        g = self.globals.get(id(f.__globals__))
        if g is None:
            g = dict(f.__globals__)
            self.globals[id(f.__globals__)] = g
            for n, v in list(g.items()):
                if id(v) in self.twins:
                    g[n] = self.twins[id(v)]
        closure = None
        if f.__closure__ is not None:
            closure = tuple(self._cell(c) for c in f.__closure__)
        new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, closure)
        self.done[id(f)] = new
        new.__kwdefaults__ = dict(f.__kwdefaults__) if f.__kwdefaults__ is not None else None
        new.__qualname__ = f.__qualname__
        new.__module__ = f.__module__
        new.__doc__ = f.__doc__
        new.__annotations__ = dict(getattr(f, "__annotations__", {}) or {})
        new.__dict__.update(f.__dict__)
        for n, v in list(g.items()):  # the functions of that module that read the copies
            if isinstance(v, types.FunctionType) and v.__globals__ is f.__globals__ and v is not f:
                if self.needs(v):
                    g[n] = self.function(v)
        return new

    def _cell(self, cell: Any) -> Any:
        try:
            v = cell.cell_contents
        except ValueError:
            return cell
        if id(v) in self.twins:
            return types.CellType(self.twins[id(v)])
        if isinstance(v, types.FunctionType) and self.needs(v):
            return types.CellType(self.function(v))
        return cell


@contextlib.contextmanager
def quiet_logging() -> Any:
    """Libraries' log records (transformers: "use_cache=True is incompatible with gradient
    checkpointing") from runs on copies are not the user's: none reaches their output. Nothing to do
    inside another (a switch costs a walk over every logger: the diagnosis holds one around its runs)."""
    before = logging.root.manager.disable
    if before >= logging.CRITICAL:
        yield
        return
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)


def resident_bytes(values: Any) -> int:
    """Bytes of the distinct storages of the tensors reachable from ``values`` (modules' parameters,
    buffers and gradients, optimizers' state, tensors in containers)."""
    from gradscope._analyses.predict.copies import _collect_tensors

    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors([v for v in values if not isinstance(v, types.ModuleType | types.FunctionType | type)],
                     tensors, set())
    for t in list(tensors.values()):
        if t.is_leaf and t.grad is not None:
            tensors[id(t.grad)] = t.grad
    seen: dict[int, int] = {}
    for t in tensors.values():
        try:
            st = t.untyped_storage()
            key = _compat.storage_key(t)
            if key is not None:
                seen[key] = int(st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    return sum(seen.values())


def _replica(objs: Mapping[str, Any], *, dropout: bool = True,
             tensors: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
    """A deep copy of the user's objects on their device, as the user has them (train/eval state,
    dropout); ``dropout=False``: with dropout off (see NOTE [ results where randomness allows ] in gradscope._analyses.diagnose.measure).
    Tensors that are results of autograd (not leaves) are copied detached, as they cannot be
    deep-copied. ``tensors``: the objects' tensors by id, where they were collected already."""
    from gradscope._analyses.predict.copies import _collect_tensors, copied_schedulers

    if tensors is None:
        tensors = {}
        _collect_tensors(dict(objs), tensors, set())
    memo: dict[int, Any] = {}
    storages = collections.Counter(t.untyped_storage().data_ptr() for t in tensors.values() if t.layout == torch.strided)
    for i, t in tensors.items():
        if not t.is_leaf:
            memo[i] = t.detach().clone().requires_grad_(t.requires_grad)
        elif _clones_as_deepcopy(t, storages):  # (what deepcopy would make, without its Python per tensor)
            c = t.detach().clone()
            memo[i] = nn.Parameter(c, t.requires_grad) if type(t) is nn.Parameter else c.requires_grad_(t.requires_grad)
    shells = _module_shells(objs, memo)
    _containers_ahead(objs, memo)
    _modules_ahead(shells, memo)
    out = copy.deepcopy(dict(objs), memo)
    copied_schedulers(dict(objs), memo)
    for i, t in tensors.items():  # a parameter's deep copy leaves its gradient behind: the copy has it too
        twin = memo.get(i)
        if isinstance(twin, torch.Tensor) and t.is_leaf and t.grad is not None and twin.grad is None:
            twin.grad = t.grad.detach().clone()
    if not dropout:
        for m, k in _dropouts(out):
            setattr(m, k, 0.0)
    return out


def _dropouts(objs: Mapping[str, Any]) -> list[tuple[nn.Module, str]]:
    """Where the objects' modules hold dropout, as (module, attribute): each dropout module's ``p``
    and each float attribute named dropout (what a copy with dropout off sets to 0)."""
    return [(m, k) for v in objs.values() if isinstance(v, nn.Module) for m in v.modules()
            for k in (("p",) if isinstance(m, nn.modules.dropout._DropoutNd) else ())
            + tuple(k for k, a in vars(m).items() if "dropout" in k and isinstance(a, float))]


# NOTE [ a module's containers copied ahead ]: ``copy.deepcopy`` of a module rebuilds each of its
# dicts (a dozen per module: parameters, buffers, submodules and every kind of hook) through its
# ``__reduce_ex__``, most of them empty: three quarters of the Python a copy of the docs' GPT-2 runs.
# A plain dict, ``OrderedDict`` or set of a module's attributes that is empty, or that holds only
# tensors already copied (``memo``) or None under names (its parameters, its buffers), is made here and put in
# deepcopy's memo, as deepcopy would make it: the same type, the copies in the same order. Anything
# else (a subclass, a container of other things) is left to deepcopy.
_PLAIN = (dict, collections.OrderedDict, set)


def _containers_ahead(objs: Mapping[str, Any], memo: dict[int, Any]) -> None:
    """See NOTE [ a module's containers copied ahead ]."""
    for v in objs.values():
        if not isinstance(v, nn.Module):
            continue
        for m in v.modules():
            for a in vars(m).values():
                if type(a) not in _PLAIN or id(a) in memo:
                    continue
                if not a:
                    memo[id(a)] = type(a)()
                elif isinstance(a, dict) and all(type(k) is str and (x is None or id(x) in memo)
                                                 for k, x in a.items()):
                    memo[id(a)] = type(a)((k, None if x is None else memo[id(x)]) for k, x in a.items())


# NOTE [ modules copied ahead ]: ``copy.deepcopy`` of a module makes it by ``__reduce_ex__``: a new object of
# its class (``cls.__new__``), its ``__getstate__`` (a copy of its ``__dict__``) deep-copied, value by value,
# and given to its ``__setstate__``. For a module whose class copies so (none of those, nor ``__deepcopy__``,
# ``__copy__`` or slots, its own: ``nn.Module``'s), that is done here ahead, without deepcopy's calls for the
# values it gives back as they are (numbers, strings, None, functions, types: a module's flags, sizes and
# names, a dozen a module) or found in its memo (its parameters, its containers copied ahead, its children):
# each module made first, then filled, so that children, tied modules and cycles resolve through the memo.
# Anything else a module holds goes through deepcopy with the same memo. The docs' GPT-2 copies in 1.1 ms
# where it took 1.3 (two copies a diagnosis).
_ATOMIC = (type(None), int, float, bool, complex, str, bytes, type, types.FunctionType, types.BuiltinFunctionType,
           range, type(Ellipsis), type(NotImplemented))
_OWN = ("__deepcopy__", "__copy__", "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__", "__new__",
        "__slots__", "__getnewargs_ex__", "__getnewargs__")
_COPIES_BY_STATE: dict[type, bool] = {}


def _by_state(cls: type) -> bool:
    """Whether ``copy.deepcopy`` copies a module of this class as nn.Module's own methods say (see NOTE
    [ modules copied ahead ])."""
    found = _COPIES_BY_STATE.get(cls)
    if found is None:
        found = _COPIES_BY_STATE[cls] = not issubclass(cls, list | dict) and not any(
            k in vars(b) for b in cls.__mro__ if b not in (nn.Module, object) for k in _OWN)
    return found


def _module_shells(objs: Mapping[str, Any], memo: dict[int, Any]) -> list[tuple[nn.Module, nn.Module]]:
    """Each module of the objects that copies by its state (see NOTE [ modules copied ahead ]), as a new
    object of its class in deepcopy's memo, to be filled by ``_modules_ahead``."""
    shells: list[tuple[nn.Module, nn.Module]] = []
    for v in objs.values():
        if not isinstance(v, nn.Module):
            continue
        for m in v.modules():
            if id(m) not in memo and _by_state(type(m)):
                new = memo[id(m)] = object.__new__(type(m))
                shells.append((m, new))
    return shells


def _modules_ahead(shells: list[tuple[nn.Module, nn.Module]], memo: dict[int, Any]) -> None:
    """The modules made by ``_module_shells`` given their state, as deepcopy would give it."""
    keep = memo.setdefault(id(memo), [])  # (what deepcopy keeps alive with its memo, so that no id is reused)
    for m, new in shells:
        state = m.__getstate__()
        keep.append(m)
        new.__setstate__({k: a if type(a) in _ATOMIC else memo[id(a)] if id(a) in memo else copy.deepcopy(a, memo)
                          for k, a in state.items()})


def _clones_as_deepcopy(t: torch.Tensor, storages: Mapping[int, int]) -> bool:
    """Whether a leaf tensor's clone is what ``copy.deepcopy`` makes of it: a plain tensor or parameter,
    dense, no attributes of its own, alone on a storage it fills (deepcopy keeps storages shared; a
    clone would not)."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_quantized or t.is_meta:
        return False
    if t.__dict__ or t.is_conj() or t.is_neg() or t.storage_offset() != 0 or not t.is_contiguous():
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size():
        return False
    ptr = storage.data_ptr()
    return ptr != 0 and storages.get(ptr) == 1  # (``storages``: how many of the objects' tensors are on each)


def _tensors_of(name: str, v: Any, out: dict[str, torch.Tensor], params: set[str] | None = None,
                named: Mapping[int, str] | None = None) -> None:
    """The tensors ``v`` holds, under names that start with ``name``; an optimizer's state under the
    names of its parameters where ``named`` (parameters by id) has them."""
    if isinstance(v, torch.Tensor):
        out[name] = v
        if v.is_leaf and v.grad is not None:
            out[name + ".grad"] = v.grad
    elif isinstance(v, nn.Module):
        for k, p in v.named_parameters():
            out[f"{name}.{k}"] = p
            if params is not None:
                params.add(f"{name}.{k}")
            if p.grad is not None:
                out[f"{name}.{k}.grad"] = p.grad
        for k, b in v.named_buffers():
            out[f"{name}.{k}"] = b
    elif isinstance(v, torch.optim.Optimizer):
        for i, (param, st) in enumerate(v.state.items()):
            which = (named or {}).get(id(param), str(i))
            for k, t in st.items():
                if isinstance(t, torch.Tensor):
                    out[f"{name}.state[{which}][{k!r}]"] = t
    elif isinstance(v, bool):
        return
    elif isinstance(v, int | float):  # a number where the step kept a tensor (`losses.append(loss.item())`)
        out[name] = torch.tensor(float(v), dtype=torch.float64)
    elif isinstance(v, list | tuple):
        for i, x in enumerate(v[:10_000]):
            _tensors_of(f"{name}[{i}]", x, out, params, named)
    elif isinstance(v, dict):
        for i, (k, x) in enumerate(list(v.items())[:10_000]):
            # a key that is no plain value (a parameter: the optimizer in backward's ``opt_of``) by its place
            key = repr(k) if isinstance(k, str | int | float | bool | tuple) or k is None else f"<{type(k).__name__} {i}>"
            _tensors_of(f"{name}[{key}]", x, out, params, named)


def _results(env: Mapping[str, Any], names: set[str], *, clone: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the named variables hold (see ``_tensors_of``), detached: copies where the
    variables run on (``clone``), the tensors themselves where nothing runs in ``env`` again."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    named = {id(p): f"{n}.{k}" for n in sorted(names) if isinstance(env[n], nn.Module)
             for k, p in env[n].named_parameters()}
    for name in names:
        flat: dict[str, torch.Tensor] = {}
        params: set[str] = set()
        _tensors_of(name, env[name], flat, params, named)
        # a result that carries a graph (a loss kept for a later backward) differs from one that does
        # not, whatever its value: the later backward would fail
        out[name] = {k + (_PARAM if k in params else _GRAPH if t.requires_grad else ""):
                     t.detach().clone() if clone else t.detach() for k, t in flat.items()}
    return out


def _compare(a: Mapping[str, Any], b: Mapping[str, Any], objects: set[str]) -> tuple[float, str, tuple[str, ...], int]:
    """The largest relative difference over the user's objects' tensors (parameters, gradients,
    buffers, optimizer state, inputs), and the other variables whose values differ."""
    worst, where = 0.0, ""
    differs: list[str] = []
    freed = 0
    found = {name: _differences(a[name], b[name]) for name in sorted(set(a) & set(b))}
    agreed = _moments_agree(found)  # see NOTE [ parameters after an optimizer's step ]
    for name, each in found.items():
        ta, tb = a[name], b[name]
        if name in objects:
            freed += sum(1 for k in set(ta) - set(tb) if k.endswith(".grad"))
        d = _worst(each, agreed)
        if name in objects:
            if d[0] > worst:
                worst, where = d[0], d[1]
        elif d[0] > _TOLERANCE:
            differs.append(name)
    return worst, where, tuple(differs), freed


def _marked(t: torch.Tensor) -> torch.Tensor:
    """Non-finite values as numbers that ``torch.equal`` compares: NaN 0, inf 1, -inf -1."""
    return t.nan_to_num(0.0, 1.0, -1.0)


def _differences(ta: Mapping[str, torch.Tensor], tb: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Gradients the fix left freed (None) where the step kept them are not a difference: the fix
    applied them already (the finding says so through ``Trial.freed``). Each tensor's difference is its
    largest one relative to its largest value (parameters scaled, see NOTE [ parameters after an
    optimizer's step ]); NaN and inf are the same where both hold them at the same places."""
    if set(tb) - set(ta) or any(not k.endswith(".grad") for k in set(ta) - set(tb)):
        return {", ".join(sorted(set(ta) ^ set(tb))[:3]): math.inf}
    found: list[tuple[str, float | None]] = []  # each tensor's difference (None: a float one, worked out below)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # the float ones' tensors, in order
    for k in ta:
        if k not in tb:
            continue
        x, y = ta[k].detach(), tb[k].detach()
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y):  # (the same values: most results of a
            found.append((k, 0.0))  # fix that replays the step, checkpointing's; one pass, not four)
            continue
        if x.dim() == 0 and y.dim() == 0 and x.is_floating_point() and y.is_floating_point():
            x, y = x.double(), y.double()  # a number and a 0-dim tensor of the same value are the same result
        if x.shape != y.shape or x.dtype != y.dtype:
            return {k: math.inf}
        if not x.is_floating_point():
            found.append((k, 0.0 if torch.equal(x, y) else math.inf))
        elif x.numel() == 0:
            found.append((k, 0.0))
        else:
            if x.dtype not in (torch.float32, torch.float64):
                x, y = x.float(), y.float()
            found.append((k, None))
            pairs.append((x, y))
    floats = iter(zip(pairs, _largest(pairs), strict=True))
    out: dict[str, float] = {}
    for k, d in found:
        if d is None:
            (x, y), (scale, most) = next(floats)
            if not (math.isfinite(scale) and math.isfinite(most)):  # NaN or inf: the same where both have them
                fx, fy = x.isfinite(), y.isfinite()
                if not torch.equal(fx, fy) or not torch.equal(_marked(x[~fx]), _marked(y[~fy])):
                    return {k: math.inf}
                x, y = x.where(fx, 0.0), y.where(fy, 0.0)
                scale, most = torch.stack([x.abs().max(), (x - y).abs().max()]).double().tolist()
            d = most / scale if scale > 0 else most
            if k.endswith(_PARAM):
                d *= _TOLERANCE / PARAMETER_TOLERANCE  # see NOTE [ parameters after an optimizer's step ]
        out[k] = d
    return out


def _worst(each: Mapping[str, float], agreed: set[str] = frozenset()) -> tuple[float, str]:  # type: ignore[assignment]
    """The largest of a variable's differences (``_differences``) and where, the parameters in
    ``agreed`` left out (see NOTE [ parameters after an optimizer's step ])."""
    worst, where = 0.0, ""
    for k, d in each.items():
        if k not in agreed and d > worst:
            worst, where = d, k.removesuffix(_PARAM)
    return worst, where


_STATE = re.compile(r"^[^.\[]+\.state\[(?P<param>.+)\]\[(?P<key>'[^']*')\]$")


def _moments_agree(found: Mapping[str, Mapping[str, float]]) -> set[str]:
    """Parameters (as their results are named) whose optimizer state other than its step count agrees
    within _TOLERANCE: see NOTE [ parameters after an optimizer's step ]."""
    states: dict[str, list[float]] = {}
    for each in found.values():
        for k, d in each.items():
            m = _STATE.match(k)
            if m is not None and m.group("key") != "'step'":
                states.setdefault(m.group("param"), []).append(d)
    return {p + _PARAM for p, ds in states.items() if ds and max(ds) <= _TOLERANCE}


def _largest(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, float]]:
    """Each pair's largest absolute value of its first tensor and largest absolute difference: a few
    operators over all of them at once (the results of the docs' GPT-2 step hold some hundred tensors,
    and an operator or four for each cost a fifth of the step per comparison), else a pair at a time."""
    if not pairs:
        return []
    found = _compat.largest_differences([x for x, _ in pairs], [y for _, y in pairs])
    if found is not None:
        return found
    return [tuple(torch.stack([x.abs().max(), (x - y).abs().max()]).double().tolist())  # type: ignore[misc]
            for x, y in pairs]
