"""What the program still holds at the block's end: the graphs reachable from the user's variables
(see NOTE [ the block's nodes ])."""

from __future__ import annotations

import collections
import itertools
import sys
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradscope._base import compat as _compat
from gradscope._capture.discover import GraphDiscovery
from gradscope._capture.state import Block
from gradscope._model import names as _names

# NOTE [ the block's nodes ]: a notebook keeps earlier cells' results alive (an ``out`` whose graph
# is still there, a list of losses), and a script's globals hold the last step's graph while the
# next one is recorded. The block's graph is made of the nodes PyTorch created while it ran:
# PyTorch numbers nodes from a per-thread counter as it creates them, so a node of the recorded
# thread numbered below the counter at the block's start was made before it. The walk at the
# block's end takes no such root and enters no such node (an edge to one is dropped); a backward
# pass run inside the block still records every node it runs through, whenever it was made. Nodes
# made by other threads (a CUDA backward's ``create_graph`` nodes, made on the engine's device
# threads with their own counters) are found from the pass's gradients when it ends.
_SKIP_TYPES: tuple[type, ...] = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                 types.MethodType, types.CodeType, types.FrameType, str, bytes, int, float,
                                 complex, bool, range, weakref.ReferenceType)
_SKIP_PACKAGES = ("IPython", "ipykernel", "traitlets", "zmq", "tornado", "asyncio", "jupyter_client",
                  "ipywidgets", "comm", "gradscope", "torch")
_HELD_LIMIT = 20_000  # objects looked at, in all: a notebook's namespace may hold anything
_HELD_DEPTH = 6  # out.past_key_values.layers[i].keys is 5 steps from a variable
_PER_CONTAINER = 1_000


def _made_since(fn: Any, seq0: int, index: Mapping[Any, int]) -> bool:
    """Whether a root node is the block's (see NOTE [ the block's nodes ]) or walked already."""
    try:
        seq = _compat.node_sequence_nr(fn)
    except Exception:
        return True
    return seq == _compat.ACC_SEQ or seq >= seq0 or seq in index


def _held_graphs(values: list[Any]) -> list[Any]:
    """The ``grad_fn`` of every tensor held by ``values``: directly, in lists, tuples, sets and
    dicts, and in the attributes of the objects they hold (a KV cache in a model's output, a list
    of results kept on an object), breadth first, bounded in depth and in objects looked at. Not
    entered: Python modules, classes, functions, and objects of the notebook's and PyTorch's own
    machinery (an ``nn.Module`` is entered: a result kept as its attribute is held)."""
    found: list[Any] = []
    seen: set[int] = set()
    level = values
    looked = 0
    for _ in range(_HELD_DEPTH):
        nxt: list[Any] = []
        for v in level:
            if looked >= _HELD_LIMIT:
                return found
            if id(v) in seen:
                continue
            seen.add(id(v))
            looked += 1
            try:
                if isinstance(v, torch.Tensor):
                    fn = v.grad_fn
                    if fn is not None:
                        found.append(fn)
                    continue
                if v is None or isinstance(v, _SKIP_TYPES):
                    continue
                if isinstance(v, dict):
                    nxt.extend(itertools.islice(v.values(), _PER_CONTAINER))
                elif isinstance(v, list | tuple | set | frozenset | collections.deque):
                    nxt.extend(itertools.islice(v, _PER_CONTAINER))
                else:
                    mod = type(v).__module__ or ""
                    if mod.split(".", 1)[0] in _SKIP_PACKAGES and not isinstance(v, nn.Module):
                        continue
                    d = getattr(v, "__dict__", None)
                    if isinstance(d, dict):
                        nxt.extend(itertools.islice(d.values(), _PER_CONTAINER))
            except Exception:
                continue
        if not nxt:
            break
        level = nxt
    return found


def _frame_namespaces(frame: Any) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """A frame's locals and globals, read once.

    NOTE [ f_locals keeps tensors alive ]: before Python 3.13, reading a function frame's
    ``f_locals`` stores a snapshot dict of its locals on the frame, which keeps every value the
    function later ``del``s (a loss and its whole graph, a batch) alive until it returns. The
    snapshot is copied and emptied after reading; anything that reads ``f_locals`` or
    ``locals()`` again (a debugger, a trace function) gets a fresh one, so the function is
    unaffected."""
    if frame is None:
        return None, None
    try:
        local_ns = frame.f_locals
        global_ns = frame.f_globals
    except Exception:
        return None, None
    if local_ns is global_ns:
        return global_ns, global_ns
    copy = dict(local_ns)
    if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1:
        local_ns.clear()  # CO_OPTIMIZED: a function's snapshot, not a real namespace
    return copy, global_ns


class HeldGraphs:
    """The recorder's walk of what the block left behind (through graph discovery)."""

    __slots__ = ("b", "discovery")

    def __init__(self, b: Block, discovery: GraphDiscovery) -> None:
        self.b = b
        self.discovery = discovery

    # ------------------------------------------------------------------ end of a piece, of the block
    def _at_cut(self) -> None:
        """A piece of a loop's capture ends (see NOTE [ iterations ] in gradscope._passes.iterations): the
        graphs its module outputs still hold (a generator's output the next iteration
        backpropagates through) are walked into it, as the block's end walks them (the program's
        variables are not read: the loop goes on)."""
        b = self.b
        seq0 = b.trace.seq0
        index = b.trace.node_index
        roots = _kept_roots(b, seq0, index)
        hooking, b.hooking = b.hooking, False
        try:
            self.discovery._discover(roots, since=seq0)
        finally:
            b.hooking = hooking
            del roots

    def _at_block_end(self, frame: Any, tb: Any) -> None:
        """Roots of graphs the block left behind (results in variables and in the objects they
        hold, module outputs, results in the frames an exception unwound) are walked, stopping at
        nodes made before the block (see NOTE [ the block's nodes ]); root modules get their user
        names."""
        local_ns, global_ns = _frame_namespaces(frame)
        values: list[Any] = list(local_ns.values()) if local_ns is not None else []
        if local_ns is not global_ns and global_ns is not None:
            values += [v for k, v in global_ns.items() if not str(k).startswith("_")]
        while tb is not None:  # the frames of a failure still hold its half-built graphs
            f = tb.tb_frame
            if f is not frame:
                loc, _ = _frame_namespaces(f)
                if loc is not None:
                    values += list(loc.values())
            tb = tb.tb_next
        b = self.b
        seq0 = b.trace.seq0
        index = b.trace.node_index
        roots = [fn for fn in _held_graphs(values) if _made_since(fn, seq0, index)] + _kept_roots(b, seq0, index)
        del values
        b.hooking = False  # everything is uninstalled: this walk only reads
        try:
            self.discovery._discover(roots, since=seq0)
        finally:
            del roots
        mods = [r() for r in b.root_mods]
        b.trace.root_names = _names.names_in_frame(mods, local_ns, global_ns)
        del mods
        self.discovery.acc_vars.clear()


def _kept_roots(b: Any, seq0: int, index: Any) -> list[Any]:
    """The graphs of the tensors the block kept references to (``b.roots``) made since ``seq0``;
    the references are let go."""
    roots = []
    for ref in b.roots:
        t = ref()
        fn = t.grad_fn if t is not None else None
        if fn is not None and _made_since(fn, seq0, index):
            roots.append(fn)
    b.roots.clear()
    return roots
