"""``memory="tracker"``: a dispatch mode that follows every operator's output storages.

It follows them with weak references. It is online (it knows the live total at every moment), so
it enforces a simulated budget (:class:`~gradscope.errors.MemoryBudgetExceeded`, carrying the
:class:`~gradscope.errors.BudgetRefusal` it made) and works on the meta device for prediction; it
misses kernel-internal temporaries.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.errors import BudgetRefusal, MemoryBudgetExceeded
from gradscope._base.memory_kind import MemoryKind
from gradscope._base.trace import MemoryTrace
from gradscope._capture.memory.source import AllocEvent, _no_context

__all__ = ["TrackerSource"]


# --------------------------------------------------------------------------------------
# The online tracker (budgets, meta-device prediction)
# --------------------------------------------------------------------------------------
_MODE_CLASS: Any = None
# NOTE [ tensors made outside dispatch ]: ``torch.tensor(data)`` (nested lists and Python scalars
# too; the optimizers' 0-d ``step`` counters are made this way), ``torch.as_tensor`` /
# ``torch.asarray`` of Python data, ``Tensor.new_tensor``, the legacy ``torch.Tensor(list)`` and
# the index and value lists of ``sparse_coo_tensor`` allocate their storage below the dispatcher,
# then pass the new tensor through ``aten::lift_fresh``, whose output is its input. The rule that
# skips outputs sharing an input's storage (views, in-place) skipped these, and the tracker missed
# their bytes where the allocator's events (memory='cpu') count them. So ``lift_fresh``'s output
# is counted as an allocation when its storage is the allocator's. Storages wrapping memory made
# elsewhere (``torch.from_numpy``, ``as_tensor``/``asarray`` of a numpy array of the same dtype,
# which share the array's memory) are not: no allocator event reports them, and the memory was
# numpy's before the call; a copy made from them (another dtype, ``torch.tensor(array)``) is an
# ordinary operator output and counts. ``torch.frombuffer`` passes no operator and allocates nothing.
_LIFT_FRESH = _compat.LIFT_FRESH_OP


def _make_tracker_mode(source: TrackerSource) -> Any:
    """The tracker's dispatch mode (its class made once: a class per recording would pile up)."""
    global _MODE_CLASS
    if _MODE_CLASS is None:
        base = _compat.torch_dispatch_mode()

        class _TrackerMode(base):  # type: ignore[misc, valid-type]
            def __init__(self, src: TrackerSource) -> None:
                super().__init__()
                self.source = src

            @classmethod
            def ignore_compile_internals(cls) -> bool:
                """NOTE [ the tracker and torch.compile ]: a compiled function called while a
                dispatch mode that does not ignore compile internals is active is skipped by Dynamo
                for good: it runs eagerly from then on, also after the block (other numerics, other
                memory). Ignoring them, compiled code stays compiled; allocations inside it are not
                seen by the tracker (the recording says so; the profiler source sees them). A torch
                without this switch (2.6-2.8) marks the code object of every frame it meets under
                the mode as one never to compile (torch 2.6, measured: a compiled Linear called in
                the block ran eagerly afterwards, and so did every other compiled Linear and a
                compiled function called there); there the tracker sets torch.compile's stance to
                "force_eager" for the block (see eager_compile_stance in gradscope._base.compat), so
                compiled code runs eagerly inside it without Dynamo seeing a frame, and compiled
                again after it; the recording says that compiled code ran eagerly."""
                return True

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                src = self.source
                src._drain()
                kwargs = kwargs or {}
                in_keys: set[int] = set()
                for a in _compat.tree_leaves((args, kwargs)):
                    if isinstance(a, torch.Tensor):
                        k = _compat.storage_key(a)
                        if k is not None:
                            in_keys.add(k)
                out = func(*args, **kwargs)
                if func is _compat.EFFICIENT_ZERO_OP:
                    src.zero_tangents = True
                elif func is _LIFT_FRESH and _compat.allocator_owned(out):
                    in_keys = set()  # see NOTE [ tensors made outside dispatch ]
                try:
                    for t in _compat.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            src._observe(t, in_keys, func)
                except MemoryBudgetExceeded:
                    raise
                except Exception as e:  # observing must never break the user's operation
                    if len(src.failures) < 10:
                        src.failures.append(f"{_op_label(func)}: {e!r}")
                return out

        _MODE_CLASS = _TrackerMode
    return _MODE_CLASS(source)


class TrackerSource:
    """A dispatch mode that counts each operator output's storage until its last reference dies.

    Rules it follows: outputs whose storage is also an input's are views or in-place results and
    are skipped, except ``lift_fresh``'s, the way tensors made from Python data enter the
    dispatcher (see NOTE [ tensors made outside dispatch ]); zero tensors are skipped; only tensors
    of the recorded device type count (torch.func creates internal meta tensors); it must be
    active before the forward pass.

    Known limitations: memory a kernel allocates for itself is not seen (CPU convolution's
    temporaries; the 0-d tensor PyTorch wraps a Python number in for one operator, 8 bytes, and
    the copy a kernel makes of it in the other operand's dtype: an optimizer step peaks 12 bytes
    above what the tracker says inside such an operator). Memory shared with numpy
    (``torch.from_numpy``) is numpy's and counts nowhere, as in the allocator's events.
    """

    kind = MemoryKind.TRACKER

    def __init__(self, device_type: str = "cpu", budget: int | None = None,
                 context: Callable[[], tuple[int | None, int | None]] | None = None) -> None:
        self.device_type = device_type
        self.budget = budget
        self.context = context or _no_context
        self.events: list[AllocEvent] = []
        self._live = 0
        self._known: dict[int, tuple[int, Any]] = {}
        self._pending: list[int] = []
        # NOTE [ orphaned storages ]: how many watched tensors (with a finalizer) hold each storage;
        # a storage whose watched tensors all died but which is still alive is held only by tensors
        # made outside dispatch (autograd's unpacked saves): only those are checked by sweep().
        self._holders: dict[int, int] = {}
        self._orphans: set[int] = set()
        self.failures: list[str] = []  # errors while observing (the first 10), for the notes
        self.failed_at: int | None = None  # events recorded when the budget refused an allocation
        self.refused: BudgetRefusal | None = None  # that allocation (see NOTE [ one refusal ] in gradscope._base.errors)
        self.zero_tangents = False  # see MemoryTrace.zero_tangents
        # a second device type whose outputs count while it is set (gradscope.predict for a CPU
        # step: the optimizers' step counters are real CPU tensors among the meta ones)
        self.also_device_type: str | None = None
        self._unseen_keys = 0  # keys of count_unseen's allocations: negative, never a storage's
        self._mode: Any = None
        self._stance: Any = None  # torch.compile's stance to put back (see eager_compile_stance)
        self._call: int | None = None
        self.stopped = False
        # the recorder's line finder (gradscope._model.lines.LineTable.here), or None: no lines
        self.line_of: Callable[[], int] | None = None

    def start(self) -> None:
        self._stance = _compat.eager_compile_stance()  # see NOTE [ the tracker and torch.compile ]
        try:
            self._mode = _make_tracker_mode(self)
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            stance, self._stance = self._stance, None
            _compat.restore_compile_stance(stance)
            raise

    def stop(self) -> MemoryTrace:
        mode, self._mode = self._mode, None
        stance, self._stance = self._stance, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
                mode.source = None  # the mode object may be cached by torch: never keep the source
        finally:
            _compat.restore_compile_stance(stance)
        self._drain()
        self.stopped = True
        # The finalizers on tensors made in the block (gradients, optimizer state) keep this source
        # alive as long as they live; without the recorder's callback they no longer keep the
        # whole recorder (its graph bookkeeping) alive with it.
        self.context = _no_context
        self.line_of = None
        return MemoryTrace(source=self.kind, device=self.device_type, online=True, key_kind="storage",
                           events=list(self.events), failures=list(self.failures), failed_at=self.failed_at,
                           refused=self.refused, zero_tangents=self.zero_tangents)

    def live(self) -> int:
        self._drain()
        return self._live

    def cut(self) -> MemoryTrace:
        """The events since the last cut, as a piece of a loop's capture hands them over (see NOTE
        [ iterations ] in gradscope._passes.iterations); the source goes on."""
        self._drain()
        events, self.events = self.events, []
        return MemoryTrace(source=self.kind, device=self.device_type, online=True, key_kind="storage",
                           events=events, failures=list(self.failures), zero_tangents=self.zero_tangents)

    def __del__(self) -> None:
        # weak references still held (storages alive when the source goes): let go of them
        try:
            for _, ref in self._known.values():
                _compat.free_weak_ref(ref)
            self._known.clear()
        except Exception:  # interpreter shutdown
            pass

    def call_enter(self, kind: str, index: int, label: str) -> Any:
        prev = self._call
        if kind == "module":
            self._call = index
        return prev

    def call_exit(self, token: Any, label: str) -> None:
        self._call = token

    def mark(self, label: str) -> None:
        self.sweep()

    def drain(self) -> None:
        self._drain()

    def boundary(self, done: str | None, following: str | None) -> int:
        self.sweep()
        return self.live()

    def _observe(self, t: torch.Tensor, in_keys: set[int], func: Any) -> None:
        if t.device.type != self.device_type and t.device.type != self.also_device_type:
            return
        if _compat.is_zero_tensor(t):
            return
        key = _compat.storage_key(t)
        if key is not None and key in self._known and not _mutates(func):
            # A view or alias (``_unsafe_view``) of a tracked storage keeps it alive after the
            # tensor that brought it dies: without its own finalizer the free would only be seen
            # at the next sweep (late). In-place and out= results are tensors already watched.
            self._hold(t, key)
            return
        if key is None or key in in_keys or key in self._known:
            return
        try:
            storage = t.untyped_storage()
            nbytes = int(storage.nbytes())
        except (RuntimeError, NotImplementedError):
            return
        if nbytes == 0:
            return
        self._allocated(nbytes, key, _op_label(func))
        # The finalizer is attached to the tensor object (tensors keep their Python object while
        # C++ holds them); the weak reference below decides when its bytes are really gone.
        self._known[key] = (nbytes, _compat.storage_weak_ref(storage))
        self._holders[key] = 1
        weakref.finalize(t, self._holder_died, key)

    def watch_alias(self, t: torch.Tensor) -> None:
        """A tensor made without an operator (gradscope's compiled pack hook's alias of a saved
        tensor) that holds a tracked storage: followed as a view is (see NOTE [ orphaned
        storages ]), so that the storage's free is seen when its last holder dies."""
        if self.stopped or t.device.type not in (self.device_type, self.also_device_type):
            return
        key = _compat.storage_key(t)
        if key is not None and key in self._known:
            self._hold(t, key)

    def _hold(self, t: torch.Tensor, key: int) -> None:
        """One more tensor holding the tracked storage ``key``: its death is checked too."""
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(t, self._holder_died, key)

    def _allocated(self, nbytes: int, key: int, label: str) -> None:
        """An allocation of ``nbytes`` under ``key``: refused where it crosses the budget, else
        live and an event."""
        if self.budget is not None and self._live + nbytes > self.budget:
            refusal = BudgetRefusal(nbytes, self._live, self.budget, label)
            if self.failed_at is None:
                self.failed_at = len(self.events)
                self.refused = refusal
            raise MemoryBudgetExceeded(refusal)
        self._live += nbytes
        step, _ = self.context()
        line = None
        if self.line_of is not None and step is None:  # in backward the node's line is given later
            try:
                line = self.line_of()
            except Exception:  # no line is no failure to observe
                line = None
        self.events.append(AllocEvent(time.time_ns(), nbytes, key, label, None, step, None, self._call,
                                      line=line))

    def _freed(self, key: int, nbytes: int) -> None:
        """The free of an allocation counted under ``key``: no longer live, and an event."""
        self._live -= nbytes
        step, _ = self.context()
        self.events.append(AllocEvent(time.time_ns(), -nbytes, key, "free", None, step))

    def count_unseen(self, nbytes: int, label: str) -> int:
        """Count ``nbytes`` that no operator output holds (gradscope.predict's model of a Python
        number PyTorch wraps in a tensor, or a kernel's copy of an input) until :meth:`end_unseen`
        is called with the key returned. Frees already due are accounted first."""
        self._drain()
        key = self._unseen_keys - 1
        self._allocated(nbytes, key, label)
        self._unseen_keys = key
        return key

    def end_unseen(self, key: int, nbytes: int) -> None:
        """The end of an allocation :meth:`count_unseen` began."""
        if not self.stopped:
            self._freed(key, nbytes)

    def _holder_died(self, key: int) -> None:
        n = self._holders.get(key, 0) - 1
        if n > 0:
            self._holders[key] = n
        else:
            self._holders.pop(key, None)
        self._maybe_free(key)

    def _maybe_free(self, key: int, deferred: bool = False) -> None:
        entry = self._known.get(key)
        if entry is None:
            return
        nbytes, ref = entry
        if self.stopped:  # nothing is counted any more: only let go of the weak reference
            del self._known[key]
            _compat.free_weak_ref(ref)
            return
        if not _compat.weak_ref_expired(ref):
            # NOTE [ frees are checked at the next operator ]: a finalizer runs while the dying
            # tensor still holds its storage, so the check is repeated at the next operator
            # (before it allocates) or live() call. A view still holding the storage then has a
            # finalizer of its own that checks again when it dies.
            if not deferred:
                self._pending.append(key)
            elif key not in self._holders:
                self._orphans.add(key)  # see NOTE [ orphaned storages ]
            return
        del self._known[key]
        _compat.free_weak_ref(ref)
        self._holders.pop(key, None)
        self._orphans.discard(key)
        self._freed(key, nbytes)  # not stopped: returned above

    def _drain(self) -> None:
        """Check the storages whose tensors died since the last operator (see NOTE above)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for key in pending:
                self._maybe_free(key, deferred=True)

    def sweep(self) -> None:
        """Account frees of storages whose last holder was a view that died without a finalizer.

        Only orphaned storages are checked (see NOTE [ orphaned storages ]): checking every live
        storage at each backward step made backward quadratic in the number of live tensors."""
        self._drain()
        for key in list(self._orphans):
            entry = self._known.get(key)
            if entry is None:
                self._orphans.discard(key)
            elif _compat.weak_ref_expired(entry[1]):
                self._maybe_free(key)


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", True))


def _op_label(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    return "aten::" + name.split(".")[0]
