"""gradscope's saved-tensor hooks, compiled against the PyTorch in use (built once, then cached).

NOTE [ compiled hooks ]: PyTorch calls a pack hook for every tensor a node saves and an unpack hook
for every one it reads back; on graphs of many small ops (an RNN cell in a loop, unrolled
optimizer steps, a GPU's microsecond kernels) these calls are a large share of all the work. A
Python hook pays for a frame and a dozen attribute reads on each (~2-3 us); the same row made in
C++ costs a fraction (``benchmarks/bench_small_ops.py`` prints both). ``hooks.cc`` holds a
pack/unpack pair that makes exactly the Python pair's rows (record.py) for plain tensors and hands
any other tensor to the Python pack hook; it is compiled on first use, for the PyTorch and Python
of the process, by ``torch.utils.cpp_extension`` (``_build.py``) with the C++ compiler found on the
machine, into gradscope's cache directory
(``$GRADSCOPE_CACHE``, else ``$XDG_CACHE_HOME/gradscope``, else ``~/.cache/gradscope``). Where it
cannot be built (no compiler, an unknown platform) the Python pair records the same rows, more
slowly; :func:`status` says which pair is in use and why. ``GRADSCOPE_NATIVE=0`` always uses the
Python pair, ``GRADSCOPE_NATIVE=1`` makes a failed build an error. The compiled pack hook also gives each save
the user's line, as the Python one does (see NOTE [ where lines come from ] in gradscope._lines),
reading the interpreter's frames in C++ and calling back only for a code object or line not met
before.

NOTE [ first use never waits for the compiler ]: a build takes 15-60 s, too long for a first
recording (a notebook's first ``%%gradscope`` cell) to wait. Where nothing is cached, :func:`hooks`
starts the build in a background thread (one per process; the lock file in the cache directory
makes another process wait for it, not build it again), says so in one line on stderr and returns
None: that block and every block begun while the build runs record with the Python pair (the same
rows, more slowly); the first block begun after it ends loads the built file. The build (a child
process running cpp_extension, in a session of its own) writes into a temporary directory beside
the target and the file is renamed into place, so no process loads a half-written file; a process
that exits while its build runs kills that session (cpp_extension, ninja and the compilers) and
removes the temporary directory (``python -m gradscope setup`` builds synchronously).
``GRADSCOPE_NATIVE=1`` builds synchronously (its failure is an error).

NOTE [ compiled walk ]: at each backward's start the recorder walks the graph's new nodes (a row
per node and edge, its saves named: record._discover); in Python that costs ~1.8 us a node, as
much as the pack hooks on an RNN loop. ``walk.cc`` walks the C++ nodes themselves: keys, edges,
rows, and saves named by a learnt pack order are made there; a node gets its Python object and
goes to the same Python code as in the Python walk only where Python must read it (the first
node of a class, a custom Function's node, saves not named by a learnt order, a node to hook, an
AccumulateGrad node's leaf). Its rows are the Python walk's (tests/test_native.py compares them).
A create_graph pass's pre hooks are compiled too where they write nothing but a step's event (see
NOTE [ compiled pass hooks ] in walk.cc), and so is the work around a backward's start and end
(see NOTE [ a pass in two calls ] there). All of it comes with the compiled hooks, and the Python
walk runs wherever they are not in use or a root is not a node ``walk.cc`` reads. The same module
holds both (one build, one cache entry).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from gradscope.errors import GradscopeError

__all__ = ["build", "build_or_say", "building", "cache_dir", "hooks", "status", "wait"]

_SOURCES = (Path(__file__).with_name("hooks.cc"), Path(__file__).with_name("walk.cc"))
_HEADER = Path(__file__).with_name("native.h")
_FIELDS = Path(__file__).with_name("fields.h")  # generated from fields.py
_BUILDER = Path(__file__).with_name("_build.py")  # run in a child process: see build()
_lock = threading.Lock()
_loaded: ModuleType | None = None
_reason: str | None = None  # why the compiled pair is not in use (None: not tried yet, or in use)
_tried = False  # settled: _loaded is the module, or None for good (GRADSCOPE_NATIVE=0, a failed build)
_thread: threading.Thread | None = None  # the background build (see NOTE [ first use never waits ... ])
_built: Path | None = None  # what the background build made
_build_error: BaseException | None = None  # why it failed
_running: set[subprocess.Popen[str]] = set()  # compilers running in this process
_temps: set[str] = set()  # their temporary directories
_BUILD_SECONDS = ".build-seconds"  # the last build's duration, in the cache (for the estimate said)


def cache_dir() -> Path:
    """Where gradscope keeps what it builds."""
    env = os.environ.get("GRADSCOPE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "gradscope"


def _mode() -> str:
    mode = os.environ.get("GRADSCOPE_NATIVE", "auto").strip().lower()
    if mode not in ("0", "1", "auto"):
        raise GradscopeError(f"gradscope: GRADSCOPE_NATIVE is 0, 1 or auto, got {mode!r}.")
    return mode


def _compiler() -> str:
    """The C++ compiler cpp_extension will run (``CXX``, else the first found)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise OSError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _settings() -> dict[str, object]:
    """What ``_build.py`` is given: the compiler, the sources and the flags beyond cpp_extension's own
    (which add PyTorch's and Python's headers and libraries, ``-fPIC``, the C++ standard and ABI)."""
    lib = Path(torch.__file__).parent / "lib"
    ldflags = [f"-Wl,-rpath,{lib}"]
    if sys.platform == "darwin":
        ldflags += ["-undefined", "dynamic_lookup"]
    return {"cxx": _compiler(), "sources": [str(p) for p in _SOURCES],
            "cflags": ["-O2", "-std=c++20", "-fvisibility=hidden", "-w"], "ldflags": ldflags}


def _target(settings: dict[str, object]) -> Path:
    """The built file's path: one per source, compiler and flags, PyTorch build and Python."""
    h = hashlib.sha256()
    for source in (*_SOURCES, _HEADER, _FIELDS, _BUILDER):
        h.update(source.read_bytes())
    # the sources by their bytes above, not their paths: checkouts and installs elsewhere share a build
    h.update(repr(sorted((k, v) for k, v in settings.items() if k != "sources")).encode())
    h.update(f"{torch.__version__} {torch.version.git_version} {sys.implementation.cache_tag}".encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / "native" / f"_hooks-{torch.__version__.replace('+', '-')}-{h.hexdigest()[:16]}{suffix}"


def build(*, say: bool = True) -> Path:
    """Compile the hooks for this PyTorch unless a build is cached; returns the built file.
    ``say=False`` prints nothing (the background build said it already).
    Raises OSError (no compiler, the compiler failed, the cache not writable).

    The build is ``torch.utils.cpp_extension``'s (``_build.py``, in a child process of its own
    session, so that :func:`_stop_builds` can end it and the compilers it runs at once)."""
    settings = _settings()
    target = _target(settings)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "a") as lock:
        with contextlib.suppress(ImportError, OSError):
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same file: wait for it
        if target.exists():
            return target
        if say:
            print(f"gradscope: [c++] compiling its saved-tensor hooks for torch {torch.__version__} (once, "
                  f"~{_estimate()} s; GRADSCOPE_NATIVE=0 skips it)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _temps.add(tmp)
            try:
                out = Path(tmp) / target.name
                given = json.dumps({**settings, "out": tmp, "name": target.name})
                proc = subprocess.Popen([sys.executable, str(_BUILDER), given], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                        cwd=tmp)
                _running.add(proc)
                try:
                    err, _ = proc.communicate()
                finally:
                    _running.discard(proc)
                if proc.returncode != 0 or not out.exists():
                    first = next((ln for ln in err.splitlines() if "error" in ln.lower()), "")
                    raise OSError(f"the C++ compiler failed: {first.strip()}\n{err[-3000:]}")
                os.replace(out, target)  # atomic: a loader sees no file or the whole file
            finally:
                _temps.discard(tmp)
        with contextlib.suppress(OSError):
            (target.parent / _BUILD_SECONDS).write_text(f"{time.monotonic() - t0:.0f}\n")
    return target


def _estimate() -> int:
    """Seconds a build takes here: the last build's, else a busy 2-core machine's."""
    try:
        return max(1, round(float((cache_dir() / "native" / _BUILD_SECONDS).read_text())))
    except (OSError, ValueError):
        return 60


@atexit.register
def _stop_builds() -> None:
    """A process that ends during a background build kills its compiler and leaves no temporary
    files (the build starts again in the next process)."""
    for proc in list(_running):
        with contextlib.suppress(OSError):
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)  # the build's session: cpp_extension, its compilers
            else:
                proc.kill()
            proc.wait()
    for tmp in list(_temps):
        shutil.rmtree(tmp, ignore_errors=True)


def _build_in_background() -> None:
    global _built, _build_error
    try:
        _built = build(say=False)
    except BaseException as e:  # said by hooks() and status(), never raised in this thread
        _build_error = e


def build_or_say() -> None:
    """``./dev``'s set-up step: compile unless cached; a failure is said, not raised (the Python
    hooks record then)."""
    if _mode() == "0":
        return
    try:
        build()
    except OSError as e:
        print(f"gradscope: [c++] the compiled hooks were not built ({str(e).splitlines()[0]}); "
              "the Python hooks record instead, more slowly", file=sys.stderr)


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("gradscope._native._hooks", str(path))
    spec = importlib.util.spec_from_file_location("gradscope._native._hooks", str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def hooks() -> ModuleType | None:
    """The compiled module, or None where the Python pair records instead (see NOTE [ compiled
    hooks ], NOTE [ first use never waits for the compiler ] and :func:`status`). Where nothing is
    cached it starts the build in the background and returns None at once."""
    global _loaded, _reason, _tried, _thread, _built, _build_error
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        mode = _mode()
        if mode == "0":
            _reason, _tried = "GRADSCOPE_NATIVE=0", True
            return None
        if _thread is not None:
            if _thread.is_alive() and mode != "1":
                return None  # still building: the Python pair records this block too
            _thread.join()
            _thread = None
            if _built is not None:
                return _settle(lambda: _built, mode)
            if mode != "1":
                e, _build_error = _build_error, None
                _reason, _tried = f"could not build the compiled hooks: {str(e).splitlines()[0]}", True
                return None
        if mode == "1":
            return _settle(build, mode)
        try:
            target = _target(_settings())
        except OSError as e:
            _reason, _tried = f"could not build the compiled hooks: {str(e).splitlines()[0]}", True
            return None
        if target.exists():
            return _settle(lambda: target, mode)
        _thread = threading.Thread(target=_build_in_background, name="gradscope-build", daemon=True)
        _thread.start()
        _reason = "the compiled hooks are being built in the background"
        print(f"gradscope: compiling the fast saved-tensor hooks in the background (~{_estimate()} s); "
              "this recording uses the Python hooks", file=sys.stderr, flush=True)
        return None


def _settle(path: Callable[[], Path | None], mode: str) -> ModuleType | None:
    """Load the built file for good (called under ``_lock``)."""
    global _loaded, _reason, _tried
    try:
        p = path()
        assert p is not None
        _loaded, _reason = _load(p), None
    except Exception as e:
        if mode == "1":
            raise GradscopeError(
                f"gradscope: GRADSCOPE_NATIVE=1 but its compiled hooks could not be built: {e}"
            ) from e
        _reason = f"could not build the compiled hooks: {str(e).splitlines()[0]}"
    _tried = True
    return _loaded


def wait(timeout: float | None = None) -> ModuleType | None:
    """Wait for a background build (if one runs) to end, then answer as :func:`hooks`."""
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    return hooks()


def building() -> bool:
    """True while this process's background build runs."""
    thread = _thread
    return thread is not None and thread.is_alive()


def status() -> dict[str, object]:
    """Which saved-tensor hooks record now: ``{"compiled": bool, "pair": "compiled" | "python",
    "reason": str | None, "path": str | None, "building": bool}`` (``building``: a background build
    runs; the next block begun after it ends uses the compiled pair)."""
    m = hooks()
    return {"compiled": m is not None, "pair": "compiled" if m is not None else "python", "reason": _reason,
            "path": getattr(m, "__file__", None), "building": building()}
