"""Engine interception: the autograd engine's entry point (backward and autograd.grad) seen by
the block, a pass's start and end (see NOTE [ how steps are seen ] in gradscope._capture.record)."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.trace import (
    EV_PRE,
    BackwardRow,
)
from gradscope._capture import discover as _discovery  # its tables, read where patched
from gradscope._capture.discover import GraphDiscovery
from gradscope._capture.patches import (
    _engine_dispatch,
    _func_guard,
    _join_patches,
    _leave_patches,
    _pair_enter,
    _pair_exit,
)
from gradscope._capture.saves import SavedTensors
from gradscope._capture.state import Block
from gradscope._capture.walk import keys_of, node_key, roots_of


class EngineRoute:
    """What the shared patches call for a block (see NOTE [ shared patches ]): its current engine
    interception, which a loop's capture replaces at each cut (see NOTE [ iterations ] in
    gradscope._passes.iterations)."""

    __slots__ = ("engine",)

    def __init__(self, engine: EngineInterception) -> None:
        self.engine = engine

    @property
    def b(self) -> Block:
        return self.engine.b

    @property
    def saves(self) -> SavedTensors:
        return self.engine.saves

    def _run_backward(self, orig: Callable[..., Any], t_outputs: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        return self.engine._run_backward(orig, t_outputs, args, kwargs)


class EngineInterception:
    """The recorder's view of each backward pass: the engine's entry point patched (see NOTE
    [ shared patches ]); a pass's new nodes found by graph discovery, its steps by the saves'
    hooks."""

    __slots__ = ("b", "saves", "discovery")

    def __init__(self, b: Block, saves: SavedTensors, discovery: GraphDiscovery) -> None:
        self.b = b
        self.saves = saves
        self.discovery = discovery

    # ------------------------------------------------------------------ engine interception
    def _patch_engine(self, route: Any = None) -> None:
        """Install the interception; ``route`` (an :class:`EngineRoute`), where given, is what the
        shared patches call, so that the pieces of a loop's capture can take over one by one."""
        me: Any = self if route is None else route
        ag = _compat.engine_entry_module()
        if ag is not None:  # see NOTE [ shared patches ]
            self.b.undo.append(lambda: _leave_patches(me))
            patches: list[tuple[Any, str, Callable[[Any], Any]]] = [(ag, _compat.ENGINE_ENTRY, _engine_dispatch)]
            agg = _compat.disable_hooks_module()
            if agg is not None:
                patches.append((agg, "disable_saved_tensors_hooks", _func_guard))
            if not self.b.caps.saved_hook:  # see NOTE [ other pairs on an older torch ]
                pairs = _compat.hooks_class()
                patches += [(pairs, "__enter__", _pair_enter), (pairs, "__exit__", _pair_exit)]
            _join_patches(me, patches)
        else:  # a torch without the shared entry point: wrap the two public functions
            import torch.autograd as agm

            orig_b, orig_g = agm.backward, agm.grad

            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                return me._run_backward(lambda *a, **k: orig_b(tensors, *args, **kwargs), tensors,
                                          (None, kwargs.get("retain_graph"), kwargs.get("create_graph", False),
                                           kwargs.get("inputs")), {})

            def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
                return me._run_backward(lambda *a, **k: orig_g(outputs, *args, **kwargs), outputs,
                                          (None, kwargs.get("retain_graph"), kwargs.get("create_graph", False),
                                           args[0] if args else kwargs.get("inputs")),
                                          {"accumulate_grad": False})

            agm.backward, agm.grad = backward, grad

            def restore() -> None:
                agm.backward, agm.grad = orig_b, orig_g

            self.b.undo.append(restore)

    def _run_backward(self, orig: Callable[..., Any], t_outputs: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        b = self.b
        st = b.state
        if threading.get_ident() != b.tid or st.bw is not None or st.func_depth or _compat.is_compiling():
            # Another thread, a backward started from inside a node (reentrant checkpoint), a
            # torch.func region, or a compiler tracing a graph: run it unobserved (the nodes of the
            # user's graph are still found later).
            return orig(t_outputs, *args, **kwargs)
        outputs = list(t_outputs) if isinstance(t_outputs, list | tuple) else [t_outputs]
        if any(type(t) is not torch.Tensor and _compat.is_fake(t) for t in outputs):
            return orig(t_outputs, *args, **kwargs)  # a compiler tracing a backward: not the user's
        call = _compat.engine_call(args, kwargs)
        trace = b.trace
        row = BackwardRow(api="backward" if call.accumulate_grad else "autograd.grad",
                          create_graph=call.create_graph, retain_graph=call.retain_graph, roots=[],
                          inputs=[], seq0=_compat.sequence_nr(), t0_ns=time.time_ns(),
                          ev0=len(trace.events))
        index = len(trace.backwards)
        trace.backwards.append(row)
        src = b.source
        token = src.call_enter("backward", index, "") if src is not None and src.kind.marks_calls else None
        temporary: list[Any] = []
        result: Any = None
        done = False
        try:
            try:
                walker = b.walker
                compiled_hooks = call.create_graph and src is None and self.saves.frees_once_a_pass
                started: Any = NotImplemented
                was = gc.isenabled()  # see NOTE [ no collection while rows are made ] (inline: every pass)
                gc.disable()
                try:
                    if walker is not None:  # see NOTE [ a pass in two calls ] in walk.cc
                        started = walker.pass_start(outputs, call.inputs, compiled_hooks, b.hooking,
                                                    src is not None and src.kind.node_hooks, trace.seq0, _discovery._TYPES, _discovery._ORDERS,
                                                    st, trace.events)
                    if started is NotImplemented:
                        roots, keys = self._roots_keys(outputs)
                        input_keys = self._roots_keys(call.inputs, make=False)[1]
                        self.discovery._discover(roots, keys)
                    else:
                        acc_known, row.roots, row.inputs, hooks, roots, keys, input_keys = started
                        self.discovery._rehook_known(acc_known)
                        if hooks is not None:
                            temporary.append(hooks)
                finally:
                    if was:
                        gc.enable()
                row.nodes_known = len(trace.nodes)
                if started is NotImplemented:
                    idx = trace.node_index
                    row.roots = [idx[k] for k in keys if k in idx]
                    row.inputs = [idx[k] for k in input_keys if k in idx]
                if call.create_graph and not temporary:
                    self.discovery._hook_for_pass(roots, keys, set(input_keys), temporary)
                del roots
            except Exception as e:  # the user's backward runs whatever happens to observing
                b.internal(e)
            st.bw = row
            st.marks = b.memory.steps_by_unpack or (call.create_graph and not (src is not None and src.kind.node_hooks))
            row.seq0 = _compat.sequence_nr()
            row.ev0 = len(trace.events)
            try:
                result = orig(t_outputs, *args, **kwargs)
            except BaseException as e:  # see NOTE [ a backward that raised ] in gradscope._passes.steps
                row.oom = isinstance(e, torch.OutOfMemoryError)  # gs.MemoryBudgetExceeded is one
                try:
                    row.error = f"{type(e).__name__}: {e}"
                except Exception:  # an exception whose str() fails still names its type
                    row.error = f"{type(e).__name__}: (its message could not be read)"
                raise
            done = True
            return result
        finally:
            try:
                try:
                    self.discovery._step_boundary(None)
                except Exception as e:
                    b.internal(e)
            finally:  # whatever the boundary raised, the pass ends and its hooks go
                st.bw = None
                st.marks = False
                st.prev_node = None
                st.last_seq = -1
                row.seq1 = _compat.sequence_nr()
                row.t1_ns = time.time_ns()
                row.ev1 = len(trace.events)
                for h in temporary:
                    h.remove()
            if src is not None and src.kind.marks_calls:
                try:
                    src.call_exit(token, "")
                except Exception as e:
                    b.internal(e)
            if done or row.api == "backward":
                # The gradients it made (a backward that raised: the .grad of the leaves it
                # accumulated into before the failure, which stay); after a create_graph=True pass,
                # the nodes it made are found from them too.
                try:
                    self._gradient_keys(index, row, result)
                except Exception as e:
                    b.internal(e)
            if done and b.ended is not None:  # see NOTE [ iterations ] in gradscope._passes.iterations
                try:
                    b.ended("backward", row)
                except Exception as e:
                    b.internal(e)

    def _gradient_keys(self, index: int, row: BackwardRow, result: Any) -> None:
        """Storages of the gradients a pass made, for the GRADIENT category: the returned
        gradients of ``autograd.grad``, or the ``.grad`` of every leaf it accumulated into."""
        b = self.b
        tensors: list[Any] = []
        if row.api == "autograd.grad":
            tensors = [t for t in (result if isinstance(result, list | tuple) else (result,))
                       if isinstance(t, torch.Tensor)]
        else:
            acc_vars = self.discovery.acc_vars  # the leaves whose node ran, in the order they ran
            ran = dict.fromkeys(e[1] for e in itertools.islice(b.trace.events, row.ev0, row.ev1) if e[0] == EV_PRE)
            for ident in [i for i in ran if i in acc_vars]:
                var = acc_vars[ident]()
                if var is not None and var.grad is not None:
                    tensors.append(var.grad)
        keys = b.trace.gradient_keys
        walker = b.walker
        if walker is not None:  # see NOTE [ a pass in two calls ] in walk.cc
            src = b.source
            acc_known = walker.pass_end(tensors, index, row.t1_ns, keys, row.create_graph, b.hooking,
                                        src is not None and src.kind.node_hooks, b.trace.seq0,
                                        _discovery._TYPES, _discovery._ORDERS)
            if acc_known is not NotImplemented:
                if acc_known is not None:
                    self.discovery._rehook_known(acc_known)
                return
        for t in tensors:  # a tensor the compiled call does not read (nothing of it was appended)
            try:
                s = t.untyped_storage()
                keys.append((index, int(_compat.storage_cdata(s)), int(s.data_ptr()), row.t1_ns))
            except (RuntimeError, NotImplementedError):
                pass
        if row.create_graph:
            self.discovery._discover(*self._roots_keys(tensors))

    def _roots_keys(self, values: Any, make: bool = True) -> tuple[list[Any], list[Any]]:
        """The graph nodes behind ``values`` and their keys (``make``: roots_of and node_key), or
        their keys only, without making a leaf's node (keys_of): compiled where the walk is."""
        if self.b.walker is not None:
            got = self.b.walker.roots(values, make)
            if got is not NotImplemented:
                return got
        if not make:
            return [], keys_of(values)
        roots = roots_of(values)
        return roots, [node_key(r) for r in roots]
