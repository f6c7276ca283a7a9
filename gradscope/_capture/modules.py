"""Module and optimizer tracking: gradscope's one global pair of module hooks (NOTE [ one key for
module hooks ]), the open module calls, root modules, optimizer phases."""

from __future__ import annotations

import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from gradscope._base import compat as _compat
from gradscope._base.trace import (
    C_SEQ1,
    C_T1,
)
from gradscope._capture.state import Block
from gradscope._model import names as _names


def _quiet_global_hook_warning() -> Callable[[], None]:
    """Hide the warning a ``torch.compile``d module gives on each call while global module hooks
    exist (``OptimizedModule.__call__`` in torch/_dynamo/eval_frame.py: "Using `torch.compile(module)`
    when there are global hooks on modules ..."), which here are gradscope's own. One filter entry
    for exactly that message goes first in ``warnings.filters`` for the block; the returned undo
    removes that entry (by identity), so the program's own filters, changed in the block or not,
    are as it left them, and its other warnings show as ever."""
    entry = ("ignore", re.compile(r"Using `torch\.compile\(module\)` when there are global hooks on modules"),
             UserWarning, None, 0)
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
    filters.insert(0, entry)
    _warning_filters_changed()

    def undo() -> None:
        now: list[Any] = warnings.filters  # type: ignore[assignment]  # another list if the program swapped it
        for lst in (now, filters) if now is not filters else (now,):
            for i, f in enumerate(lst):
                if f is entry:
                    del lst[i]
                    break
        _warning_filters_changed()

    return undo


def _warning_filters_changed() -> None:
    """What ``warnings.filterwarnings`` does after changing the list: drop cached decisions."""
    changed = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if changed is not None:
        changed()


# NOTE [ one key for module hooks ]: torch.compile guards a graph it compiled inside a block on
# the global module hooks as they were (their keys in torch's hook dicts): hooks registered anew
# by each block, under new keys, failed that guard at every block, so each block compiled again,
# and from the 9th on (the recompile limit) the model ran eagerly, unsaid. So every recorder's
# module hooks go through one pair of functions kept under one fixed key while any block records
# (removed when none does: nothing stays hooked), and a compiler tracing them returns at once.
_MODULE_HOOKS: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # the active blocks', in order
_MODULE_HOOKS_LOCK = threading.Lock()


def _module_pre(module: nn.Module, args: Any) -> None:
    if _compat.is_compiling():
        return
    for pre, _ in tuple(_MODULE_HOOKS):
        pre(module, args)


def _module_post(module: nn.Module, args: Any, output: Any) -> None:
    if _compat.is_compiling():
        return
    for _, post in tuple(_MODULE_HOOKS):
        post(module, args, output)


# NOTE [ one pair of optimizer hooks ]: torch keeps global optimizer step hooks in an OrderedDict that
# every ``optimizer.step()`` iterates; a block that registered and removed its own pair mutated it
# while a step on another thread iterated it ("OrderedDict mutated during iteration": two
# predictions on two threads at once). As with module hooks, the active blocks' hooks go through
# one registered pair, registered with the first block and removed with the last.
_OPT_HOOKS: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # the active blocks', in order
_OPT_HANDLES: list[Any] = []  # torch's handles of the one pair, while any block records


def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    for pre, _ in tuple(_OPT_HOOKS):
        pre(optimizer, args, kwargs)


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    for _, post in tuple(_OPT_HOOKS):
        post(optimizer, args, kwargs)


class _OptimizerHooks:
    """One block's optimizer step hooks among the active blocks' (see NOTE [ one pair of optimizer
    hooks ])."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.entry = (pre, post)
        with _MODULE_HOOKS_LOCK:
            if not _OPT_HOOKS:
                _OPT_HANDLES[:] = [register_optimizer_step_pre_hook(_opt_pre),
                                   register_optimizer_step_post_hook(_opt_post)]
            _OPT_HOOKS.append(self.entry)

    def remove(self) -> None:
        with _MODULE_HOOKS_LOCK:
            if self.entry in _OPT_HOOKS:
                _OPT_HOOKS.remove(self.entry)
            if not _OPT_HOOKS:
                for h in _OPT_HANDLES:
                    h.remove()
                _OPT_HANDLES.clear()


class _ModuleHooks:
    """One block's module hooks among the active blocks' (see NOTE [ one key for module hooks ])."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.entry = (pre, post)
        with _MODULE_HOOKS_LOCK:
            if not _MODULE_HOOKS:
                _compat.add_global_module_hooks(_module_pre, _module_post)
            _MODULE_HOOKS.append(self.entry)

    def replace(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        """The block's hooks from now on (a loop's next piece: see NOTE [ iterations ] in
        gradscope._passes.iterations), in the same place among the active blocks'."""
        entry = (pre, post)
        with _MODULE_HOOKS_LOCK:
            for i, e in enumerate(_MODULE_HOOKS):
                if e is self.entry:
                    _MODULE_HOOKS[i] = entry
            self.entry = entry

    def remove(self) -> None:
        with _MODULE_HOOKS_LOCK:
            if self.entry in _MODULE_HOOKS:
                _MODULE_HOOKS.remove(self.entry)
            if not _MODULE_HOOKS:
                _compat.remove_global_module_hooks()


def _outside_compilers(hook: Callable[..., None]) -> Callable[..., None]:
    """A compiled module hook behind a Python test of ``is_compiling``: a compiler tracing a module
    reads the test as true and skips the call (a compiled hook it cannot trace would break its
    graph: torch 2.6 then ran the module eagerly). See NOTE [ hooks inside compiled modules ]."""
    compiling = _compat.is_compiling

    def call(*args: Any) -> None:
        if not compiling():
            hook(*args)

    return call


class ModuleTracking:
    """The recorder's module and optimizer hooks: the open module calls, the root modules, the
    optimizers' phases."""

    __slots__ = ("b", "given", "root_index")

    def __init__(self, b: Block, given: list[tuple[str, nn.Module]], root_index: dict[int, int] | None = None) -> None:
        self.b = b
        self.given = given  # modules= as [(name, module)]
        # id(root module) -> its root index (the block's: the pieces of a loop's capture share it)
        self.root_index: dict[int, int] = {} if root_index is None else root_index

    # ------------------------------------------------------------------ modules and optimizers
    def _mod_pre(self, module: nn.Module, args: Any) -> None:
        b = self.b
        if _compat.is_compiling() or threading.get_ident() != b.tid:
            return  # see NOTE [ hooks inside compiled modules ] in gradscope._base.compat
        try:
            st = b.state
            calls = b.trace.calls
            if st.stack:
                parent = st.stack[-1][1]
                root, parent_rel = parent[0], parent[1]
            else:
                root, parent_rel = self._root_of(module), None
            rel = b.trace.module_paths[root].get(id(module))
            cls = type(module).__name__
            if rel is None:
                rel = cls if parent_rel in (None, "") else f"{parent_rel}.{cls}"
            idx = len(calls)
            call = [root, rel, _compat.sequence_nr(), -1, time.time_ns(), 0, idx, cls]
            calls.append(call)
            src = b.source
            token = src.call_enter("module", idx, cls) if src is not None and src.kind.marks_calls else None
            call[2] = _compat.sequence_nr()
            st.stack.append((module, call, token))
        except Exception as e:  # observing must never break the model
            b.internal(e)

    def _mod_post(self, module: nn.Module, args: Any, output: Any) -> None:
        b = self.b
        if _compat.is_compiling() or threading.get_ident() != b.tid:
            return  # see NOTE [ hooks inside compiled modules ] in gradscope._base.compat
        try:
            st = b.state
            src = b.source
            while st.stack:
                m, call, token = st.stack.pop()
                call[C_SEQ1] = _compat.sequence_nr()
                call[C_T1] = time.time_ns()
                if src is not None and src.kind.marks_calls:
                    src.call_exit(token, type(m).__name__)
                if m is module:
                    break
            # plain tensors only: a compiler tracing the module (fake tensors) makes no graph of ours
            if type(output) is torch.Tensor and not output.is_leaf:  # has a grad_fn (none made here)
                b.roots.append(weakref.ref(output))
        except Exception as e:
            b.internal(e)

    def _root_of(self, module: nn.Module) -> int:
        b = self.b
        idx = self.root_index.get(id(module))
        if idx is not None and b.root_mods[idx]() is module:
            return idx
        tr = b.trace
        idx = len(tr.roots)
        self.root_index[id(module)] = idx
        given = _names.given_name(module, self.given)
        tr.roots.append((type(module).__name__, given))
        b.root_mods.append(weakref.ref(module))
        tr.module_paths.append({id(m): name for name, m in module.named_modules()})
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, p in named:
                if kind == "parameter":
                    b.param_by_id[id(p)] = (weakref.ref(p), idx, name)
                if is_lazy(p):  # a lazy module's parameter before its first call has no storage yet
                    continue
                k = _compat.storage_key(p)
                if k is not None:
                    tr.param_keys.setdefault(k, (idx, name, kind))
                    tr.baseline_storages[k] = int(p.untyped_storage().nbytes())
        return idx

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self.b.tid:
            self.b.trace.optimizer_steps.append([type(optimizer).__name__, time.time_ns(), 0,
                                                _compat.sequence_nr(), -1])

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        b = self.b
        if threading.get_ident() == b.tid and b.trace.optimizer_steps:
            row = b.trace.optimizer_steps[-1]
            row[2], row[4] = time.time_ns(), _compat.sequence_nr()
            if b.ended is not None:  # see NOTE [ iterations ] in gradscope._passes.iterations
                try:
                    b.ended("optimizer", row)
                except Exception as e:
                    b.internal(e)
