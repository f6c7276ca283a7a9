"""Engine interception's process-wide patches, shared by the blocks of every thread (see NOTE
[ shared patches ]; each thread's block is there as its engine interception part), and the block
running on this thread (``_active``: the recorder)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from gradscope._base import compat as _compat

_active = threading.local()


def packed_here(fn: Any) -> bool:
    """Whether the ``gs.record`` block running on this thread packed ``fn``'s saved tensors (its
    own pair: reading them unpacks through it). For :func:`gradscope.graph` on a torch that
    cannot show which pair packed a save (<= 2.8)."""
    rec = getattr(_active, "rec", None)
    if rec is None:
        return False
    return bool(rec._discovery._packed(_compat.node_sequence_nr(fn)))

# NOTE [ shared patches ]: the engine's entry point and torch.func's hooks guard are process-wide,
# but recordings are per thread and may end in any order (a widget re-measuring in a background
# thread while a cell records). One dispatcher per patched name is installed while any recording
# is active; it sends each call to the recording of the calling thread (or straight through), and
# the original comes back when the last recording ends, whatever the order.
_patch_lock = threading.Lock()
_patch_users: dict[int, Any] = {}  # thread id -> the active recorder's EngineInterception
_patch_saved: dict[tuple[Any, str], Any] = {}  # (module, attribute) -> original


def _join_patches(rec: Any, patches: list[tuple[Any, str, Callable[[Any], Any]]]) -> None:
    with _patch_lock:
        if not _patch_users:
            for obj, attr, make in patches:
                orig = getattr(obj, attr)
                _patch_saved[(obj, attr)] = orig
                setattr(obj, attr, make(orig))
        _patch_users[rec.b.tid] = rec


def _leave_patches(rec: Any) -> None:
    with _patch_lock:
        tid = rec.b.tid
        if _patch_users.get(tid) is rec:
            del _patch_users[tid]
        if not _patch_users:
            for (obj, attr), orig in _patch_saved.items():
                setattr(obj, attr, orig)
            _patch_saved.clear()


def _engine_dispatch(orig: Callable[..., Any]) -> Callable[..., Any]:
    def run(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _patch_users.get(threading.get_ident())
        if rec is None:
            return orig(t_outputs, *args, **kwargs)
        return rec._run_backward(orig, t_outputs, args, kwargs)

    return run


# NOTE [ torch.func and our hooks ]: torch.func's grad, vjp, jacrev and hessian refuse to run
# while any saved_tensors_hooks pair is active (they enter
# ``torch.autograd.graph.disable_saved_tensors_hooks``, which raises then). While a block runs,
# the guard below takes our pair off this thread's stack for the transform's duration and puts it
# back after, whatever happens; backward passes inside it run unobserved. The transform's internal
# graph and saves are not recorded, and the recording says so. It is installed with the engine's
# patch (see NOTE [ shared patches ]).
def _func_guard(orig: Callable[..., Any]) -> Callable[..., Any]:
    """See NOTE [ torch.func and our hooks ]."""

    @contextlib.contextmanager
    def guard(error_message: str) -> Any:
        rec = _patch_users.get(threading.get_ident())
        if rec is None or not rec.saves._hooks_on_top():
            with orig(error_message):
                yield
            return
        saves: Any = rec.saves
        _compat.pop_saved_tensors_hooks()
        saves._func_enter()
        try:
            with orig(error_message):
                yield
        finally:
            saves._func_exit()
            _compat.push_saved_tensors_hooks(saves.pack, saves.unpack)

    return guard


# NOTE [ other pairs on an older torch ]: a torch without ``SavedTensor.unpack_hook`` (<= 2.8)
# cannot say who packed a saved variable. There, while a block runs, the push and pop of every
# other saved_tensors_hooks pair (a user's, save_on_cpu, non-reentrant checkpoint) are watched
# (see NOTE [ shared patches ]): nodes made while one was innermost had their saves packed by it.
def _pair_enter(orig: Callable[..., Any]) -> Callable[..., Any]:
    def enter(self: Any) -> Any:
        out = orig(self)
        rec = _patch_users.get(threading.get_ident())
        if rec is not None and getattr(self, "pack_hook", None) is not rec.saves.pack:
            rec.saves._other_pair(True)
        return out

    return enter


def _pair_exit(orig: Callable[..., Any]) -> Callable[..., Any]:
    def exit_(self: Any, *exc: Any) -> Any:
        rec = _patch_users.get(threading.get_ident())
        if rec is not None and getattr(self, "pack_hook", None) is not rec.saves.pack:
            rec.saves._other_pair(False)
        return orig(self, *exc)

    return exit_
