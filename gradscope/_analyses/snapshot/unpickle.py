"""Read a pickle that may only hold plain data, without letting it run anything.

A CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``) is a pickle of dicts, lists,
strings and integers. :func:`load_plain` reads such a pickle with the C unpickler, refusing
every global, so a hostile file cannot execute code: see NOTE [ a plain-data unpickler ].
"""

from __future__ import annotations

import copyreg
import gzip
import io
import os
import pickle
import stat
from typing import IO, Any, cast

from gradscope._base.errors import GradscopeError
from gradscope._base.gc import paused

__all__ = ["load_plain"]

# NOTE [ a plain-data unpickler ]
# A pickle is a program for a small stack machine. Only a few of its opcodes can call anything:
#
# - GLOBAL / STACK_GLOBAL / INST push a module attribute (a class, a function) after looking it
#   up through ``Unpickler.find_class``; ours refuses every name, so no callable ever reaches the
#   stack through them.
# - EXT1 / EXT2 / EXT4 look a code up in copyreg's extension registry and then call
#   ``find_class`` (refused), except that a code found in ``copyreg._extension_cache`` is pushed
#   without asking ``find_class``. The registry is empty in a plain Python; the cache is emptied
#   (``copyreg.clear_extension_cache()``, a public function: it is only a cache) right before
#   each load, so an extension code also ends in ``find_class``.
# - PERSID / BINPERSID call ``persistent_load``; ours refuses every id.
# - REDUCE, NEWOBJ, NEWOBJ_EX and OBJ call an object from the stack; BUILD calls the
#   ``__setstate__`` of an object from the stack, or sets attributes on it. Without globals, the
#   only objects the machine can make are None, booleans, ints, floats, strings, bytes,
#   bytearrays, tuples, lists, dicts, sets and frozensets: none of them is callable (REDUCE and
#   OBJ fail with TypeError, NEWOBJ/NEWOBJ_EX require a type object and fail), none has a
#   ``__setstate__``, and none accepts new attributes (BUILD fails with AttributeError).
# - APPEND(S) / SETITEM(S) / ADDITEMS on those objects run the built-in C methods of those types,
#   and hashing their keys runs only the built-in hashes: no Python code.
# - NEXT_BUFFER / READONLY_BUFFER need out-of-band buffers, which we never pass (an error).
#
# So the C unpickler, which is about 15x faster than the pure-Python one, is as safe here as a
# hand-written reader of plain data, and ``tests/test_snapshot.py`` checks every one of these
# opcodes with a payload that would create a file. Its garbage collector is switched off while it
# runs: building millions of containers otherwise triggers full collections that double the time
# (measured: 2.0 s -> 1.0 s for a 68 MB snapshot).


class _Refused(Exception):
    """A global or persistent id that the plain-data unpickler will not build."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # noqa: D401
        raise _Refused(f"the global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({str(pid)[:60]!r})")




def _unpickle(f: IO[bytes], what: str) -> Any:
    copyreg.clear_extension_cache()  # see NOTE [ a plain-data unpickler ]
    try:
        with paused():
            return _PlainUnpickler(f).load()
    except _Refused as e:
        raise GradscopeError(
            f"gradscope: {what} refers to {e}, which gradscope refuses to load: a memory snapshot "
            "holds only dicts, lists, strings and numbers, and nothing in a file may run code. If this "
            "is not a CUDA memory snapshot from torch.cuda.memory._dump_snapshot, it cannot be opened "
            "as one."
        ) from None
    except (EOFError, pickle.UnpicklingError) as e:
        msg = str(e) or type(e).__name__
        if isinstance(e, EOFError) or "truncated" in msg or "exhausted" in msg:
            raise GradscopeError(
                f"gradscope: {what} is truncated ({msg}): the pickle ends before its last object. "
                "Copy the file again, or dump the snapshot again."
            ) from None
        raise GradscopeError(
            f"gradscope: {what} is not a readable pickle ({msg}). A CUDA memory snapshot is the "
            "file torch.cuda.memory._dump_snapshot writes."
        ) from None
    except MemoryError:
        raise GradscopeError(
            f"gradscope: {what} is damaged or too large for this machine's memory (the pickle asks "
            "for more memory than is available)."
        ) from None
    except Exception as e:  # noqa: BLE001 - the C unpickler raises many types on damaged input
        raise GradscopeError(
            f"gradscope: {what} is not a readable pickle ({type(e).__name__}: {str(e)[:200]}). "
            "A CUDA memory snapshot is the file torch.cuda.memory._dump_snapshot writes."
        ) from None


def _kind_of(head: bytes) -> str:
    if not head:
        return "empty"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"{":  # not a pickle opcode; JSON objects start so
        return "json"
    return "pickle"  # or something else: the unpickler says so


def load_plain(path: str | os.PathLike[str]) -> Any:
    """Unpickle the file at ``path`` (gzip-compressed or not), building only plain data.

    Raises GradscopeError when the file is missing, empty, not a pickle, truncated, or refers to
    any global (a class or function), naming the global.
    """
    p = os.fspath(path)
    what = repr(p)
    try:
        st = os.stat(p)
    except OSError as e:
        raise GradscopeError(f"gradscope: cannot read {what}: {e.strerror}.") from None
    if not stat.S_ISREG(st.st_mode):
        raise GradscopeError(f"gradscope: cannot read {what}: it is not a regular file.")
    try:
        with open(p, "rb", buffering=1 << 20) as f:
            raw = cast(io.BufferedReader, f)
            kind = _kind_of(raw.peek(4)[:4])
            if kind == "empty":
                raise GradscopeError(
                    f"gradscope: {what} is empty (0 bytes). Dump the snapshot again with "
                    "torch.cuda.memory._dump_snapshot(path)."
                )
            if kind == "zip":
                raise GradscopeError(
                    f"gradscope: {what} is a zip archive (what torch.save writes), not a CUDA memory "
                    "snapshot. Write snapshots with torch.cuda.memory._dump_snapshot(path)."
                )
            if kind == "json":
                raise GradscopeError(
                    f"gradscope: {what} is JSON, not a pickle: a gradscope recording opens with "
                    "gs.load(path); a CUDA memory snapshot is the pickle torch.cuda.memory._dump_snapshot "
                    "writes."
                )
            if kind == "gzip":
                with gzip.GzipFile(fileobj=raw) as gz:
                    return _unpickle(io.BufferedReader(gz, 1 << 20), what)  # type: ignore[arg-type]
            return _unpickle(raw, what)
    except OSError as e:  # includes gzip.BadGzipFile
        raise GradscopeError(f"gradscope: cannot read {what}: {e}.") from None

