"""The saved-tensor hooks: the pack/unpack pair (Python, or the compiled pair of gradscope._capture.native),
frees checked by weak handle, other pairs of hooks (see NOTE [ which node saved a tensor ] in
gradscope._capture.record)."""

from __future__ import annotations

import functools
import operator
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.trace import (
    EV_FREED,
    EV_UNPACK,
    S_SEQ,
    S_SKEY,
)
from gradscope._capture.state import Block, _note_internal


# NOTE [ the saved-tensor hooks are one piece ]: SavedTensors is longer than a class should be
# (about 355 lines), most of it ``_make_pack``: the pack/unpack pair runs for every saved tensor, so
# it is built once per block as closures over locals bound there (the trace's lists, the state, the
# source's callbacks), and the helpers that must see the same locals (``trim``, ``sweep``, the frees
# checked) are made beside it. Split, each call of pack would go through attribute lookups again.
class SavedTensors:
    """The recorder's saved-tensor hooks: the pair (``pack``, ``unpack``, made once per block),
    what unpacking reads, the frees checked, and the regions where other hooks saved."""

    __slots__ = ("b", "pack", "unpack", "weak", "packed_info", "check_frees", "frees_once_a_pass",
                 "free_handles", "alias_watchers", "func_seq", "other_seq", "other_depth", "storages", "trim",
                 "sweep")

    def __init__(self, b: Block, storages: dict[int, tuple[int, int]] | None = None) -> None:
        self.b = b
        self.weak: list[int | None] = []  # by save index: the storage's weak handle (frees checked)
        self.packed_info: dict[int, int | None] = {}  # see NOTE [ the packed value is the tensor ]
        self.frees_once_a_pass = not b.memory.measures  # see NOTE [ frees checked once a pass ]
        self.check_frees: Callable[[], None] = _nothing
        self.free_handles: Callable[[], None] | None = None  # the compiled pair's: frees every handle
        self.alias_watchers: list[Callable[[torch.Tensor], None]] = []  # see _make_pack
        self.func_seq: list[list[int]] = []  # [seq0, seq1] of regions where we stepped aside
        self.other_seq: list[list[int]] = []  # see NOTE [ other pairs on an older torch ]
        self.other_depth = 0
        # see NOTE [ a storage's identity in a block ]: the block's, shared by the pieces of a loop's capture
        self.storages: dict[int, tuple[int, int]] = {} if storages is None else storages
        self.trim: Callable[[int], None] = _nothing_to_trim  # drops the rows from a save index on (see _make_pack)
        self.sweep: Callable[[], None] = _nothing  # lets go of the storages that died (see _make_pack)
        self.pack, self.unpack = self._make_pack()

    # ------------------------------------------------------------------ saved tensors
    def _make_pack(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The pack/unpack pair, built once per block with everything it needs bound locally:
        they run for every saved tensor (see NOTE [ capture apart from analysis ] in
        :mod:`gradscope._base.trace`)."""
        b = self.b
        trace, st = b.trace, b.state
        saves, events = trace.saves, trace.events
        saves_append, events_append = saves.append, events.append
        seq = _compat.sequence_nr_fn()
        key_of, weak_of, version_of = _compat.storage_cdata, _compat.storage_weak, _compat.tensor_version
        time_ns = time.time_ns
        memory = b.memory
        need_ptr = memory.key_kind(b.history) == "address"  # matched with allocations by address
        need_time = memory.measures  # matched with allocations in time
        need_weak = self._free_checks_needed()  # frees seen by weak reference at step boundaries
        weak = self.weak
        weak_append = weak.append
        internal = functools.partial(_note_internal, trace.notes)  # see NOTE [ no cycles through the recorder ]
        pending = st.pending
        pending_append = pending.append
        expired, free = _compat.weak_expired, _compat.weak_free
        sparse_parts, parts_bytes = _compat.sparse_parts, _compat.parts_bytes
        skey_of = operator.itemgetter(S_SKEY)
        # NOTE [ the packed value is the tensor ]: what the pack hook returns lives as long as the
        # saved variable, and every object it adds is one more for Python's cyclic collector to
        # walk until the backward frees it: a graph of small ops packs thousands, and a collector
        # pass over them cost more than the recording's own work (measured on a 5,000-op chain:
        # 25 ms a step). So the pack hook returns the detached tensor alone (see NOTE [ pack a
        # detached tensor ]); what unpack needs (save index, version, node) sits in this table of
        # plain ints under the tensor's id, which no other live object shares while the saved
        # variable holds it (a new pack of a reused id overwrites the entry first). Rows hold no
        # object the collector tracks either (the shape as a tuple of ints).
        packed_info = self.packed_info  # the packed value's id -> its save's index
        versions: list[int] = []  # by save index: the saved tensor's version when packed
        versions_append = versions.append
        table = b.line_table  # see NOTE [ where lines come from ] in gradscope._model.lines
        save_lines = trace.save_lines
        lines_append = save_lines.append
        here = table.find if table is not None else None
        getframe = sys._getframe
        last_line: list[Any] = [None, -1]  # the node of the last save given a line, and that line
        same_node = b.caps.sequence_nr  # without the counter every save looks at its stack
        # NOTE [ a storage's identity in a block ]: a StorageImpl's address names one storage only
        # while it lives; once freed, the next storage made may sit at the same address (a loop's
        # second chunk, after the first chunk's backward freed its saves, reuses them). So the
        # first save of each storage holds a weak handle to it, which keeps the StorageImpl's own
        # memory (not its data) from being reused: while its entry is in ``storages``, its address
        # names it alone, and every later save of that address is a save of that storage. Its
        # identity in the block is the index of its first save (``trace.save_storage``, one per
        # save). Entries whose storage died are let go of when the table has doubled since the last
        # sweep (amortized O(1) a save, the table at most twice the storages alive); a storage made
        # at a freed address then gets an identity of its own.
        storages = self.storages
        storages_get = storages.get
        storage_ids = trace.save_storage
        storage_append = storage_ids.append
        sweep_at = [max(_STORAGE_SWEEP, 2 * len(storages))]
        base = trace.save_base  # the block's saves before this piece of it (see NOTE [ iterations ] in gradscope._passes.iterations)

        def sweep() -> None:
            dead = [k for k, (_, h) in storages.items() if expired(h)]
            for k in dead:
                free(storages.pop(k)[1])
            sweep_at[0] = max(_STORAGE_SWEEP, 2 * len(storages))

        again = _SavedAgain

        def check_frees(by_save: bool = False) -> None:
            """The engine releases a node's saved tensors right after the node (and its post
            hooks) ran; at the next step boundary, the storages of the saves it unpacked that
            are gone were freed by that step (``by_save``: by the step of the save's node)."""
            for q in pending:
                ref = weak[q]
                if ref is not None and expired(ref):
                    events_append((EV_FREED, q, 0, q if by_save else None))
                    weak[q] = None
                    free(ref)
            pending.clear()

        def check_frees_at_end() -> None:
            """NOTE [ frees checked once a pass ]: with ``memory="off"`` the saves a pass unpacked
            are checked once, when it ends, instead of at every step boundary (a check at each
            step cost as much as a tenth of a small op's recording). A storage the engine freed
            died when the last of its holders' nodes ran and let go of its saved variables: the
            free belongs to the step of the save of ours that unpacked it last (``value``; the
            graph pass finds that step by the save's node), and is reported on the storage's
            newest save (``ident``), so that every save of it made before is freed there too. A
            holder we cannot see (a node whose saves another pair of hooks packed, a custom
            Function's ``ctx`` attribute) that lets go later in the pass makes the free show at
            our holder's step, as it showed at the next step we saw before."""
            keys = list(map(skey_of, map(saves.__getitem__, pending)))
            if len(set(keys)) == len(keys):  # each storage unpacked once: its save is both the newest and the last
                check_frees(by_save=True)
                return
            last: dict[int, list[Any]] = {}  # storage key -> [save unpacked last, newest save, freed?]
            for q, k in zip(reversed(pending), reversed(keys), strict=True):
                e = last.get(k)
                if e is None:
                    ref = weak[q]
                    last[k] = [q, q, ref is not None and expired(ref)]
                elif q > e[1]:
                    e[1] = q
            for q_last, q_new, dead in last.values():
                if dead:
                    events_append((EV_FREED, q_new, 0, q_last))
            for q, k in zip(pending, keys, strict=True):
                ref = weak[q]
                if ref is not None and last[k][2]:
                    weak[q] = None
                    free(ref)
            pending.clear()

        batched = self.frees_once_a_pass
        self.check_frees = check_frees_at_end if batched else check_frees

        def pack(t: torch.Tensor) -> Any:
            # No thread filter: saved-tensor hooks are thread-local, and the engine carries them
            # into its device threads only for backward passes started in this block.
            try:
                try:
                    s = t.untyped_storage()
                    nbytes = s.nbytes()
                except (NotImplementedError, RuntimeError):
                    parts = sparse_parts(t)  # a sparse tensor has no storage of its own
                    if parts is None:
                        raise
                    s, nbytes = parts[-1].untyped_storage(), parts_bytes(parts)
                sid = len(saves)
                skey = key_of(s)
                # is_leaf is ``grad_fn is None`` without making the producer's Python node object
                row = (seq() - 1, skey, s.data_ptr() if need_ptr else 0, nbytes, tuple(t.shape), t.dtype,
                       t.device, time_ns() if need_time else sid, t.is_leaf)
                known = storages_get(skey)
                if known is None:  # see NOTE [ a storage's identity in a block ]
                    if len(storages) >= sweep_at[0]:
                        sweep()
                    serial = base + sid
                    storages[skey] = (serial, weak_of(s))  # type: ignore[assignment]  # an int handle at run time
                else:
                    serial = known[0]
                version = version_of(t)
                line = -1
                if here is not None:
                    if same_node and row[0] == last_line[0]:
                        line = last_line[1]
                    else:
                        try:
                            line = here(getframe(1))
                        except Exception:  # no line is no failure to pack (as the compiled pair)
                            line = -1
                        last_line[0], last_line[1] = row[0], line
                # nothing above may fail once a list has grown: the lists are indexed by save
                saves_append(row)
                versions_append(version)
                storage_append(serial)
                if here is not None:
                    lines_append(line)
                if need_weak:
                    weak_append(weak_of(s))  # type: ignore[arg-type]  # an int handle at run time
                # NOTE [ pack a detached tensor ]: a node that saves its own output (exp, tanh)
                # would hold the output, whose grad_fn is that node: a cycle through C++ that
                # Python's collector cannot break. Unpack rebuilds autograd metadata from the saved
                # variable, not from the tensor the hook returns, so keeping only the data (as
                # PyTorch does without hooks) is exact.
                # NOTE [ a save that needs no detaching ]: a tensor that does not require grad
                # has no node to hold, and PyTorch hands it back from ctx.saved_tensors as the
                # same Python object (attributes the program set on it, identity checks): it is
                # packed as itself. NOTE [ one object saved twice ]: its id then names its save in
                # packed_info, and one id can name one save only; an object packed again while an
                # entry has its id (a checkpoint saves its inputs, which the function inside saved
                # before: PyTorch's test_checkpointing_without_reentrant_saved_object_identity) is
                # packed in a _SavedAgain, whose own id names the new save and which unpack opens:
                # every save of it hands back the object itself. An entry of a dead object whose id
                # was reused names another storage and is taken over.
                if not t.requires_grad:
                    prev = packed_info.get(id(t), -1)
                    if prev == -1 or (prev is not None and (prev >= sid or storage_ids[prev] != serial)):
                        packed_info[id(t)] = sid
                        return t
                    w = again(t)
                    packed_info[id(w)] = sid
                    return w
                d = t.detach()
                packed_info[id(d)] = sid
                return d
            except Exception as e:  # observing must never break the model: save the tensor as is
                packed_info[id(t)] = None
                internal(e)
                return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            sid = packed_info.get(id(t))
            if t.__class__ is again:  # see NOTE [ one object saved twice ]
                t = t.tensor  # type: ignore[attr-defined]
            if sid is None:
                return t  # packed while observing failed
            # NOTE [ in-place checks ]: while saved-tensor hooks are active PyTorch does not check
            # that a saved tensor was left unmodified (measured: no error, silently different
            # gradients), so a program that fails without gradscope would run with wrong
            # gradients under it. The check is made here, with PyTorch's words.
            if version_of(t) != versions[sid]:
                raise _inplace_error(t, versions[sid])
            if st.bw is not None:
                # the save's node, as the graph walk may have moved it (see _reattribute)
                if st.marks and (node := saves[sid][S_SEQ]) != st.last_seq:
                    if pending and not batched:
                        check_frees()
                    st.last_seq = node
                    # the counter as the node starts: see NOTE [ orders ] in gradscope._passes.steps
                    events_append((EV_UNPACK, sid, time_ns(), seq()))
                if need_weak:
                    pending_append(sid)
            elif st.reading is not None:
                st.reading.append(sid)
            return t

        def trim(n: int) -> None:
            """Drop the rows of saves ``n`` and later (a probe's: see _probe_innermost)."""
            for rows in (saves, versions, storage_ids, save_lines, weak):
                for ref in rows[n:] if rows is weak else ():
                    if ref is not None:
                        free(ref)
                del rows[n:]
            for k in [k for k, (first, _) in storages.items() if first >= base + n]:
                free(storages.pop(k)[1])

        self.trim = trim
        self.sweep = sweep
        self.free_handles = None
        if b.native is None:
            return pack, unpack
        # the same pair, compiled: the Python pack hook packs what it does not read exactly
        # The tracker follows each storage until its last holder dies; the compiled pack hook makes
        # its alias without an operator (no dispatch mode sees it), so it tells the tracker (the
        # source, made later in _install, is put in this list, and taken out when the block ends).
        watchers = self.alias_watchers

        def watch(alias: torch.Tensor) -> None:
            for w in watchers:
                w(alias)

        compiled = b.native.Hooks(saves, versions, packed_info, weak if need_weak else None, events, pending, st,
                                      pack, None if batched else check_frees, _inplace_error, need_ptr, need_time,
                                      watch if memory.key_kind() == "storage" else None,
                                      None if table is None else save_lines, table, storages, storage_ids, sweep,
                                      again, base)
        if batched:
            self.check_frees = compiled.frees_at_end
        self.free_handles = compiled.free_handles  # the Python pair's handles are the same kind
        return compiled.pack, compiled.unpack  # bound once: the pair is known by identity

    def _free_checks_needed(self) -> bool:
        """Frees of saved storages are checked by weak reference at step boundaries where the
        memory source cannot say which allocation died (off; CUDA without history)."""
        return self.b.memory.key_kind(self.b.history) == "none"

    def _free_weak_refs(self, storages: bool = True) -> None:
        """Let go of every weak handle the pair made: each save's (frees checked by handle) and, but
        for a piece of a loop's capture whose successor goes on with them, the storages' identities."""
        free = _compat.free_weak_ref
        if storages:
            for _, handle in self.storages.values():  # see NOTE [ a storage's identity in a block ]
                free(handle)
            self.storages.clear()
        if self.free_handles is not None:  # compiled: one call for every save of the block
            self.free_handles()
            return
        for ref in self.weak:
            if ref is not None:
                free(ref)
        self.weak.clear()

    def _let_go(self) -> None:
        """NOTE [ no cycles through the recorder ]: a recorder dropped after its block must go at
        once, with its rows, by reference counting: were it on a reference cycle, it (and the
        trace or recording it holds, thousands of objects) would wait for Python's cyclic
        collector, whose pass would then run inside the user's code, later. What the block
        installs never refers back to the recorder after the block: the saved-tensor hooks (which
        a graph keeps after the block, for its backward) note an internal error into the trace's
        notes, not through the recorder; memory sources let go of the recorder's callback when
        they stop; the compiled walk, whose callbacks are graph discovery's methods, is dropped
        here when the block ends (the walk at the block's end is its last use).
        tests/test_cycles.py counts what the collector finds."""
        self.b.walker = None

    def _hooks_on_top(self) -> bool:
        """Whether our pair is the innermost saved-tensor hooks pair on this thread."""
        top = _compat.top_saved_tensors_hooks()
        if top is _compat.NOT_VISIBLE:
            return self._probe_innermost()
        return top is not None and top[0] is self.pack

    def _probe_innermost(self) -> bool:
        """Without ``_top_saved_tensors_default_hooks`` (torch 2.6): pack one tiny saved tensor and
        see whose pack hook ran; the probe's row is removed again."""
        saves = self.b.trace.saves
        n = len(saves)
        try:
            with _compat.no_dispatch_modes():
                x = torch.ones(1, device="cpu", requires_grad=True)
                with torch.enable_grad():
                    x.exp()
        except Exception:
            return False
        ours = len(saves) > n
        self.trim(n)
        return ours

    def _other_pair(self, entering: bool) -> None:
        """See NOTE [ other pairs on an older torch ]: [seq0, seq1) while another pair is on top."""
        seqs = self.other_seq
        if entering:
            self.other_depth += 1
            if self.other_depth == 1:
                seqs.append([_compat.sequence_nr(), -1])
        elif self.other_depth > 0:
            self.other_depth -= 1
            if self.other_depth == 0 and seqs:
                seqs[-1][1] = _compat.sequence_nr()

    def _func_enter(self) -> None:
        self.b.state.func_depth += 1
        self.b.trace.func_regions += 1
        self.func_seq.append([_compat.sequence_nr(), -1])

    def _func_exit(self) -> None:
        self.b.state.func_depth -= 1
        if self.func_seq and self.func_seq[-1][1] < 0:
            self.func_seq[-1][1] = _compat.sequence_nr()


def _nothing() -> None:
    """No frees to check (until the pair is made)."""


def _nothing_to_trim(n: int) -> None:
    """No rows to drop (until the pair is made)."""


_STORAGE_SWEEP = 4096  # storages known before the first sweep: see NOTE [ a storage's identity in a block ]


class _SavedAgain:
    """A tensor packed again while its id names another save (see NOTE [ one object saved twice ]):
    the unpack hook hands back ``tensor`` itself."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _inplace_error(t: torch.Tensor, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t.type()} {list(t.shape)}] is at version {_compat.tensor_version(t)}; expected version "
        f"{expected} instead. (Checked by gradscope, as PyTorch does without saved-tensor hooks.) "
        "Hint: remove the in-place operation, or clone the tensor first."
    )
