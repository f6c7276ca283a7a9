"""Graph discovery: the walk of a pass's new nodes (Python, or the compiled walk), their saves
named (NOTE [ pack order ]), the few nodes hooked, and the per-class tables learnt."""

from __future__ import annotations

import collections
import itertools
import operator
import time
import weakref
from collections import _count_elements  # type: ignore[attr-defined]  # Counter.update's C loop
from collections.abc import Callable
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.errors import MemoryBudgetExceeded
from gradscope._base.trace import (
    EV_LIVE,
    EV_POST,
    EV_PRE,
    S_SEQ,
)
from gradscope._capture.native.fields import WalkerTables
from gradscope._capture.saves import SavedTensors
from gradscope._capture.state import Block
from gradscope._capture.walk import _leaf_key, node_key, node_name, walk

# Per node class: (name, saved tensor attributes, custom Function?, its one attribute if it has
# exactly one non-list saved tensor, learnt from the first node of the class whose saves we read).
_TYPES: dict[type, tuple[str, tuple[tuple[str, str], ...], bool, str | None]] = {}
_LISTS: set[type] = set()  # classes whose single saved attribute is a list of tensors
# See NOTE [ pack order ]: per class, the attributes of its saves in pack order (trusted), the
# first order seen (to be confirmed), and classes whose nodes disagreed.
# An order is the attributes of the saves made under the node's number, in pack order, and the
# (offset, attribute) of the saves made under later numbers (see NOTE [ saves packed under another number ]).
_Order = tuple[tuple[str, ...], tuple[tuple[int, str], ...]]
_ORDERS: dict[Any, _Order] = {}  # a class, or (class, number of saves, inputs without an edge)
_ORDER_SEEN: dict[Any, _Order] = {}
_NO_ORDER: set[Any] = set()
_SEQ_OF = operator.itemgetter(S_SEQ)


def _indexed(attr: str, listed: bool, n: int) -> bool:
    """Whether a save's label carries its position: several saves behind one attribute, or a list
    attribute (a custom Function's ``saved_tensors`` holding one tensor is named plainly)."""
    return listed and attr != "saved_tensors" or n > 1


def _absent(next_functions: tuple[tuple[Any, int], ...]) -> int:
    """Which of a node's inputs have no gradient edge, as bits (see NOTE [ pack order ])."""
    bits = 0
    for k, (nxt, _) in enumerate(next_functions):
        if nxt is None:
            bits |= 1 << k
    return bits


def _learn_order(key: Any, named: list[tuple[int, str, int]] | None, count: int, moves: bool) -> None:
    """NOTE [ pack order ]: PyTorch's generated code saves a node's tensors in one fixed order
    per node class, so once a node of a class has had all its saved tensors packed and read
    (one per attribute, no lists), the k-th save of any node of that class with as many saves
    is that attribute: naming it needs no read of the node's saved variables (a few
    microseconds per node). Which tensors a node saves besides depends on which of its inputs
    need a gradient (``mul`` saves ``other`` for ``self``'s gradient and ``self`` for
    ``other``'s; an undefined optional tensor has no edge either), so a node with fewer saves
    than attributes is keyed by its class, its number of saves and the inputs without a
    gradient edge (one RNN cell step makes hundreds of such nodes); such a key also learns the
    saves its nodes make under later numbers (``moves``: an in-place ``mul_`` saving a clone).
    An order is trusted after two nodes agree; a key whose nodes disagree is always read."""
    if key in _ORDERS or key in _NO_ORDER or named is None or not count:
        return
    own = sorted((sid, label) for sid, label, offset in named if not offset)
    later = tuple(sorted((offset, label) for _, label, offset in named if offset))
    if len(own) != count or (later and not moves):
        return
    if len({offset for offset, _ in later}) != len(later) or any(offset < 0 for offset, _ in later):
        _NO_ORDER.add(key)  # two saves under one later number, or under an earlier one: read each time
        return
    order = (tuple(label for _, label in own), later)
    seen = _ORDER_SEEN.get(key)
    if seen is None:
        _ORDER_SEEN[key] = order
    elif seen == order:
        _ORDERS[key] = order
    else:
        _NO_ORDER.add(key)


def _type_info(fn: Any) -> tuple[str, tuple[tuple[str, str], ...], bool, str | None]:
    info = (node_name(fn), _compat.saved_tensor_attributes(fn),
            isinstance(fn, torch.autograd.function.BackwardCFunction), None)
    if node_name(fn) == type(fn).__name__:  # one class, one node kind: safe to remember
        _TYPES[type(fn)] = info
    return info


# NOTE [ graph discovery is one piece ]: GraphDiscovery is longer than a class should be (about 450
# lines) and stays one piece: the walk, the naming of each node's saves and the hooks on nodes all
# read and fill the same per-block tables (the saves packed per node, the nodes hooked, the leaves'
# hooks and variables), and the compiled walk (NOTE [ compiled walk ] in gradscope._capture.native) is handed those tables and
# this class's ``_name_node``, ``_hook`` and ``_leaf_row`` as its callbacks: the Python walk and
# the compiled one do the same steps on the same tables. Split, the tables would be passed among
# several objects on every node of every walk.
class GraphDiscovery:
    """The recorder's graph walk (Python's, or the compiled walk, made here and shared through
    the block) and what it learns of the block's nodes."""

    __slots__ = ("b", "saves", "packed_seqs", "packed_upto", "hooked", "leaf_hooks", "acc_vars")

    def __init__(self, b: Block, saves: SavedTensors) -> None:
        self.b = b
        self.saves = saves  # what the pack hook packed (names the saves)
        self.packed_seqs: collections.Counter[int] = collections.Counter()  # node seq -> saves we packed
        self.packed_upto = 0  # saves counted into packed_seqs so far
        self.hooked: set[int] = set()  # nodes with a pre hook for the whole block
        self.leaf_hooks: dict[int, Any] = {}  # see NOTE [ AccumulateGrad nodes come and go ]
        self.acc_vars: dict[int, weakref.ref[torch.Tensor]] = {}  # AccumulateGrad node -> weak ref to its leaf
        tr = b.trace
        b.walker = None if b.native is None else b.native.Walker(  # see NOTE [ compiled walk ] in gradscope._capture.native
            WalkerTables(index=tr.node_index, nodes=tr.nodes, edge_keys=tr.edge_keys, edge_dst=tr.edge_dst,
                         packed=self.packed_seqs, seq_attr=tr.seq_attr, seq_order=tr.seq_order,
                         hooked=self.hooked, leaf_hooks=self.leaf_hooks, type_info=_type_info,
                         node_key=node_key, name_node=self._name_node, hook=self._hook, leaf_row=self._leaf_row,
                         saves=tr.saves, acc_vars=self.acc_vars, leaf_key=_leaf_key))

    # ------------------------------------------------------------------ graph discovery
    def _packed(self, seq: int) -> bool:
        """Whether this recording's pack hook saved for the node numbered ``seq``."""
        walker = self.b.walker
        if walker is not None:
            walker.count_packed()
            return seq in self.packed_seqs
        saves = self.b.trace.saves
        if self.packed_upto < len(saves):
            _count_elements(self.packed_seqs, map(_SEQ_OF, itertools.islice(saves, self.packed_upto, None)))
            self.packed_upto = len(saves)
        return seq in self.packed_seqs

    def _discover(self, roots: list[Any], keys: list[Any] | None = None, since: int | None = None) -> None:
        """Walk from ``roots`` through nodes not walked before, appending node and edge rows,
        naming saves and hooking the nodes whose steps the unpack hook cannot see (``keys``: the
        roots' keys, where the caller has them). ``since``: a sequence number below which a node
        not walked before is not entered (see NOTE [ the block's nodes ]); that walk is Python's."""
        trace = self.b.trace
        src = self.b.source
        hook_all = src is not None and src.kind.node_hooks
        hooking = self.b.hooking
        walker = self.b.walker
        acc_known: Any = NotImplemented
        if walker is not None and since is None:  # see NOTE [ compiled walk ] in gradscope._capture.native: the whole of this
            live = roots if keys is not None else [r for r in roots if r is not None]
            acc_known = walker.discover(live, keys if keys is not None else [node_key(r) for r in live], hooking,
                                        hook_all, trace.seq0, _TYPES, _ORDERS)
            del live
        if acc_known is NotImplemented:
            self._packed(-1)
            nodes, index, edge_keys = trace.nodes, trace.node_index, trace.edge_keys
            for i, ref in list(self.acc_vars.items()):
                if ref() is None:  # a leaf that died: its id() may name a new leaf now
                    index.pop(nodes[i][0], None)
                    del self.acc_vars[i]
            acc_edges, acc_known = self._walk_nodes(roots, hooking, hook_all, since)
            for p in acc_edges:  # every key of this walk is indexed now; a leaf's key may name another later
                j = index.get(edge_keys[p])
                edge_keys[p] = -1 - j if j is not None else None
        self._rehook_known(acc_known)

    def _rehook_known(self, acc_known: dict[Any, Any]) -> None:
        """The AccumulateGrad nodes a walk met that were walked before (key -> a parent node): a
        leaf's node may be a new one, to hook again (see _rehook_leaf)."""
        src = self.b.source
        hook_all = src is not None and src.kind.node_hooks
        for k, fn in acc_known.items():
            self._rehook_leaf(fn, k, post=hook_all)

    def _walk_nodes(self, roots: list[Any], hooking: bool, hook_all: bool,
                    since: int | None = None) -> tuple[list[int], dict[Any, Any]]:
        """The walk of _discover in Python (where the compiled walk is not in use, or a root is not
        a node it reads): the positions in edge_keys of AccumulateGrad keys, and a parent of each
        AccumulateGrad node walked before."""
        trace = self.b.trace
        packed = self.packed_seqs
        nodes, index = trace.nodes, trace.node_index
        edge_keys = trace.edge_keys
        key_out, dst_out = edge_keys.append, trace.edge_dst.append
        acc_edges: list[int] = []  # positions in edge_keys of AccumulateGrad keys (resolved below)
        acc_known: dict[Any, Any] = {}  # known AccumulateGrad key -> a parent node
        seq0 = trace.seq0
        seq_attr, seq_order = trace.seq_attr, trace.seq_order
        types, orders = _TYPES, _ORDERS
        acc, seq_of = _compat.ACC_SEQ, _compat.node_seq
        # The walk of gradscope._capture.walk.walk, inlined (a generator's resume per node costs as much
        # as the rest of a node's row): depth first, every node object held until the end (see
        # NOTE [ node identity ] there), nodes walked before (in ``index``) not walked again.
        held: list[Any] = []
        hold = held.append
        stack = [(r, node_key(r)) for r in roots if r is not None]
        pop, push = stack.pop, stack.append
        try:
            while stack:
                fn, key = pop()
                if key in index:
                    continue
                hold(fn)
                i = len(nodes)
                index[key] = i
                info = types.get(type(fn))
                if info is None:
                    info = _type_info(fn)
                name, attrs, custom, single = info
                nf = fn.next_functions
                for nxt, _ in nf:
                    if nxt is not None:
                        k = seq_of(nxt)
                        if k == acc:
                            k = node_key(nxt)
                            if hooking and k in index and k not in acc_known:
                                acc_known[k] = fn
                            acc_edges.append(len(edge_keys))
                        key_out(k)
                        dst_out(i)
                        if k not in index and (since is None or k.__class__ is not int or k >= since):
                            push((nxt, k))
                if key.__class__ is int:
                    nodes.append((key, key, name, None, None, custom))
                    if attrs:
                        ours = key in packed
                        if ours and single is not None:
                            seq_attr[key] = single  # see NOTE [ which node saved a tensor ]
                        elif ours and (rule := orders.get(type(fn))) is not None and packed[key] == len(rule[0]):
                            seq_order[key] = rule[0]  # see NOTE [ pack order ]
                        elif ours or key >= seq0:
                            self._name_node(fn, key, attrs, _absent(nf), ours)
                    if not hooking:
                        continue
                    if hook_all:
                        self._hook(fn, i, name=name, post=True)
                    elif custom:  # see NOTE [ steps nobody saw ] in gradscope._passes.steps
                        self._hook(fn, i, name=name, post=False)
                else:
                    self._leaf_row(fn, i, key, name, custom, hooking, hook_all)
        finally:
            held.clear()
        return acc_edges, acc_known

    def _name_node(self, fn: Any, key: int, attrs: tuple[tuple[str, str], ...], absent: int, ours: bool) -> None:
        """The saves of a node made in the block whose class's learnt order does not name them
        (both walks call this): a learnt order for its pattern of saves, else they are read (and
        the orders learnt), or counted when another pair packed them."""
        packed = self.packed_seqs
        if ours:
            okey = (type(fn), packed[key], absent)
            rule = _ORDERS.get(okey)
            if rule is not None and (not rule[1] or self._move_saves(key, rule[1])):
                self.b.trace.seq_order[key] = rule[0]  # fewer saves than attributes: see NOTE [ pack order ]
                return
        try:
            if ours:
                n = packed[key]  # before naming: it may find more (see _reattribute)
                read = self._name_saves(fn, key, attrs)
                _learn_order(type(fn), read, len(attrs), moves=False)
                _learn_order(okey, read, n, moves=True)
            elif key >= self.b.trace.seq0:
                self._count_unseen(fn, key, attrs)
        except Exception as e:  # a node whose saves cannot be read: noted, the walk goes on
            self.b.internal(e)

    def _leaf_row(self, fn: Any, i: int, key: Any, name: str, custom: bool, hooking: bool, hook_all: bool) -> None:
        """An AccumulateGrad node's row (both walks call this): its leaf names it."""
        leaf: Any = "input"
        leaf_shape = None
        try:
            var = fn.variable
            self.acc_vars[i] = weakref.ref(var)
            leaf_shape = tuple(var.shape)
            named = self.b.param_by_id.get(id(var))
            if named is not None and named[0]() is var:
                leaf = (named[1], named[2])
        except (AttributeError, RuntimeError):
            pass
        self.b.trace.nodes.append((key, _compat.ACC_SEQ, name, leaf, leaf_shape, custom))
        if hooking:
            self._hook_leaf(fn, i, name, post=hook_all)

    def _name_saves(self, fn: Any, seq: int, attrs: tuple[tuple[str, str], ...]) -> list[tuple[int, str, int]] | None:
        """Attribute names of one node's saves (see NOTE [ which node saved a tensor ]); the
        ``(save index, label, offset)`` it named (offset: the save's first number minus the node's,
        see _reattribute), None when a list attribute was among them."""
        trace = self.b.trace
        if len(attrs) == 1 and type(fn) not in _LISTS:
            raw = getattr(fn, attrs[0][1], None)
            if isinstance(raw, list | tuple):
                _LISTS.add(type(fn))
            else:  # a class with one saved tensor: every save of this node is that attribute
                if type(fn) in _TYPES:
                    _TYPES[type(fn)] = _TYPES[type(fn)][:3] + (attrs[0][0],)
                trace.seq_attr[seq] = attrs[0][0]
                return None
        names = trace.save_attr
        named: list[tuple[int, str, int]] | None = []
        if not self.b.caps.saved_data:
            for attr, raw_attr in attrs:
                raws, listed = _compat.raw_saved_listed(fn, raw_attr)
                many = _indexed(attr, listed, len(raws))
                if many:
                    named = None
                if raws:
                    got = self._read_by_unpacking(fn, attr, None if many else attr, names)
                    if named is not None:
                        named += got
            return named
        # each raw saved variable shows what our pack hook returned for it (one getattr each)
        packed_by, not_visible, unpack = _compat.packed_by, _compat.NOT_VISIBLE, self.saves.unpack
        info_get, saves = self.saves.packed_info.get, trace.saves
        for attr, raw_attr in attrs:
            try:
                raw = getattr(fn, raw_attr, None)
            except (RuntimeError, AttributeError):
                continue
            if raw is None:
                continue
            if isinstance(raw, (list, tuple)):  # noqa: UP038 - a tuple of types checks faster than a union
                many = _indexed(attr, True, len(raw))
                if many:
                    named = None
                items = raw
            else:
                many, items = False, (raw,)
            for k, one in enumerate(items):
                value = packed_by(one, unpack)
                if value is not_visible:
                    continue
                sid = info_get(id(value))
                if sid is None:
                    continue
                offset = saves[sid][S_SEQ] - seq
                if offset:
                    self._reattribute(sid, seq)
                label = f"{attr}[{k}]" if many else attr
                names[sid] = label
                if named is not None:
                    named.append((sid, label, offset))
        return named

    def _read_by_unpacking(self, fn: Any, attr: str, label: str | None,
                           names: dict[int, str]) -> list[tuple[int, str, int]]:
        """Older torch: read the attribute; our unpack hook notes which saves it returned. Only
        nodes whose saves we packed get here, so no other pair's unpack hook runs."""
        st = self.b.state
        st.reading = []
        try:
            try:
                with _compat.no_dispatch_modes():  # unpacking makes ops (detach) no mode of the program's may see
                    value = getattr(fn, attr)
            except (RuntimeError, AttributeError):
                value = None
            read = st.reading
        finally:
            st.reading = None
        del value
        out = []
        seq = int(_compat.node_seq(fn))
        for k, sid in enumerate(read):
            offset = self.b.trace.saves[sid][S_SEQ] - seq
            if offset:
                self._reattribute(sid, seq)
            names[sid] = label if label is not None else (attr if len(read) == 1 and attr != "saved_tensors"
                                                          else f"{attr}[{k}]")
            out.append((sid, names[sid], offset))
        return out

    def _move_saves(self, seq: int, moves: tuple[tuple[int, str], ...]) -> bool:
        """A learnt order's saves made under later numbers (see NOTE [ saves packed under another
        number ]): where each such number has exactly the one save of ours and no node walked so
        far, the analysis moves it to this node (only if no node has that number by then).
        False where the pattern does not hold: the node is read instead."""
        packed, index = self.packed_seqs, self.b.trace.node_index
        if any(packed.get(seq + d, 0) != 1 or seq + d in index for d, _ in moves):
            return False
        for d, label in moves:
            self.b.trace.seq_moves[seq + d] = (seq, label)
        return True

    def _reattribute(self, sid: int, seq: int) -> None:
        """NOTE [ saves packed under another number ]: the counter minus one is not the saving
        node when the op runs another differentiable op between making its node and saving: an
        in-place ``mul_`` that needs its input's old value saves a clone, made (with a node of
        its own that no graph keeps) after the ``MulBackward0``. The node whose raw saved
        variable holds our packed value is the saver; its save moves there (a GRU cell step on
        CPU saves two tensors so). Nodes that learnt the pattern move theirs without a read
        (see _move_saves)."""
        saves = self.b.trace.saves
        row = saves[sid]
        packed = self.packed_seqs
        old = row[S_SEQ]
        packed[old] -= 1
        if packed[old] <= 0:
            del packed[old]
        packed[seq] += 1
        saves[sid] = (seq, *row[1:])  # the unpack hook's node too (step events): see NOTE [ how steps are seen ]

    def _count_unseen(self, fn: Any, seq: int, attrs: tuple[tuple[str, str], ...]) -> None:
        """NOTE [ saves packed by other hooks ]: only the innermost saved_tensors_hooks pair
        applies, so a user's own pair, ``save_on_cpu`` or a non-reentrant checkpoint inside the
        block hides saves from our pack hook. A node made in the block with saved variables but
        no save of ours had them packed by another pair, or saved while hooks were set aside (a
        torch.func region), or saved as None. The raw saved variable names its unpack hook
        without unpacking (torch >= 2.9): saves of other pairs are counted for the notes and are
        never unpacked by us (their unpack may recompute a checkpointed segment or copy to a
        device). An older torch cannot say who packed a save without unpacking or changing it:
        there the nodes made while another pair was on top are known (see NOTE [ other pairs on
        an older torch ]) and their saved variables are counted, Nones included, and the note
        says so."""
        for lo, hi in self.saves.func_seq:
            if lo <= seq and (hi < 0 or seq < hi):
                return  # see NOTE [ torch.func and our hooks ]: said in the notes already
        trace = self.b.trace
        others = any(lo <= seq and (hi < 0 or seq < hi) for lo, hi in self.saves.other_seq)
        for attr, raw_attr in attrs:
            raws, listed = _compat.raw_saved_listed(fn, raw_attr)
            read = False
            for k, raw in enumerate(raws):
                hook = _compat.unpack_hook_of(raw)
                if hook is self.saves.unpack:  # ours, packed under another number
                    sid = self.saves.packed_info.get(id(_compat.packed_value(raw)))
                    if sid is not None:
                        self._reattribute(sid, seq)
                        trace.save_attr[sid] = f"{attr}[{k}]" if _indexed(attr, listed, len(raws)) else attr
                elif hook is _compat.NOT_VISIBLE:
                    if others:
                        trace.unseen_saves += 1
                    else:
                        read = True
                elif hook is not None:
                    trace.foreign_saves += 1
            if read:
                # An older torch, no other pair on top when the node was made: the saves are ours,
                # packed under another number (torch 2.6's in-place ops clone self first, under a
                # node of its own), or None; reading them runs only our unpack hook, which names them.
                many = _indexed(attr, listed, len(raws))
                try:
                    self._read_by_unpacking(fn, attr, None if many else attr, trace.save_attr)
                except Exception as e:
                    self.b.internal(e)

    def _hook_leaf(self, fn: Any, i: int, name: str, post: bool) -> None:
        """NOTE [ AccumulateGrad nodes come and go ]: a leaf's AccumulateGrad node lives only while
        a graph points at it; the next forward makes a new one for the same leaf (one node of the
        recording, its key being the leaf). Its hooks are kept per node index, and a leaf whose
        hooked node died gets its new node hooked when a walk meets it (see _rehook_leaf)."""
        pre = fn.register_prehook(self._make_pre(i, name))
        self.b.node_handles.append(pre)
        self.leaf_hooks[i] = pre
        if post:
            self.b.node_handles.append(fn.register_hook(self._make_post(i)))

    def _rehook_leaf(self, parent: Any, key: Any, post: bool) -> None:
        i = self.b.trace.node_index.get(key)
        if i is None:
            return
        h = self.leaf_hooks.get(i)
        if h is not None and h.hooks_dict_ref() is not None:
            return  # the node we hooked is the leaf's node still (one lives at a time)

        for nxt, _ in parent.next_functions:
            if nxt is not None and node_key(nxt) == key:
                self._hook_leaf(nxt, i, self.b.trace.nodes[i][2], post)
                return

    def _hook(self, fn: Any, i: int, name: str, post: bool) -> None:
        if i in self.hooked:
            return
        self.hooked.add(i)
        self.b.node_handles.append(fn.register_prehook(self._make_pre(i, name)))
        if post:
            self.b.node_handles.append(fn.register_hook(self._make_post(i)))

    def _hook_for_pass(self, roots: list[Any], keys: list[Any], stop: set[Any], into: list[Any]) -> None:
        """Pre hooks for one create_graph pass on every node it may run that has none yet and
        unpacks none of our saves (a node's first unpack reads the counter as a pre hook would:
        see NOTE [ how steps are seen ]); the walk starts at ``roots`` (their ``keys``) and stops at
        ``stop``, the keys of the ``inputs=`` nodes, which the engine does not run past."""

        index = self.b.trace.node_index
        names = self.b.trace.nodes
        self._packed(-1)
        packed, hooked, leaf_hooks = self.packed_seqs, self.hooked, self.leaf_hooks
        walker = self.b.walker
        if walker is not None:  # see NOTE [ compiled walk ] in gradscope._capture.native
            if self.b.source is None and self.saves.frees_once_a_pass:  # see NOTE [ compiled pass hooks ] in walk.cc
                found = walker.hook_pass(roots, keys, stop, self.b.state, self.b.trace.events)
                if found is not NotImplemented:
                    into.append(found)
                    return
            else:
                found = walker.unhooked(roots, keys, stop)
                if found is not NotImplemented:
                    for fn, i in found:
                        into.append(fn.register_prehook(self._make_pre(i, names[i][2])))
                    return
        for fn, key, _kids in walk(roots, stop=stop):
            i = index.get(key)
            if i is not None and i not in hooked and i not in leaf_hooks and key not in packed:
                into.append(fn.register_prehook(self._make_pre(i, names[i][2])))

    def _make_pre(self, i: int, name: str) -> Callable[[Any], None]:
        st = self.b.state
        events_append = self.b.trace.events.append
        seq = _compat.sequence_nr_fn()
        time_ns = time.time_ns
        boundary = self._step_boundary

        def pre(grad_outputs: Any) -> None:
            if st.bw is not None:
                try:
                    boundary(name)
                    events_append((EV_PRE, i, time_ns(), seq()))
                    st.prev_node = i
                    st.last_seq = -2  # the next unpack starts a new step
                except MemoryBudgetExceeded:
                    raise
                except Exception as e:
                    self.b.internal(e)

        return pre

    def _make_post(self, i: int) -> Callable[[Any, Any], None]:
        st = self.b.state
        events_append = self.b.trace.events.append
        time_ns = time.time_ns

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            if st.bw is not None:
                events_append((EV_POST, i, time_ns(), None))

        return post

    def _step_boundary(self, name: str | None) -> None:
        """Between two steps (or at a pass's end): frees of the last step's saves, the source's
        reading after the last step (``"X done"``) and before the next one (``name``)."""
        b = self.b
        st = b.state
        if st.pending and (name is None or not self.saves.frees_once_a_pass):  # see NOTE [ frees checked once a pass ]
            self.saves.check_frees()
        src = b.source
        if src is not None and src.kind.node_hooks:
            prev = st.prev_node
            if prev is not None or name is not None:
                marks = src.kind.marks_steps
                done = b.trace.nodes[prev][2] + " done" if prev is not None and marks else None
                live = src.boundary(done, name if marks else None)
                b.trace.events.append((EV_LIVE, prev if prev is not None else -1, time.time_ns(), live))
