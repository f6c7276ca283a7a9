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
the user's line, as the Python one does (see NOTE [ where lines come from ] in gradscope._model.lines),
reading the interpreter's frames in C++ and calling back only for a code object or line not met
before.

NOTE [ first use never waits for the compiler ]: a build takes half a minute to two minutes
(C++ files against PyTorch's headers, about 1 GB of memory each), too long for a first
recording (a notebook's first ``%%gradscope`` cell, a short script) to wait. Where nothing is
cached, :func:`hooks` starts the builder in the background (see NOTE [ one builder per cache ]),
says so in one line on stderr, with the time the last build here took and the command that builds
now (``python -m gradscope setup``), and returns None: that block and every block begun while the
build runs record with the Python pair (the same rows, more slowly); the first block begun after
the file appears loads it, in this process or the next. ``GRADSCOPE_NATIVE=1`` builds
synchronously (its failure is an error), and so does ``python -m gradscope setup``.

NOTE [ one builder per cache ]: a script that records one block and exits must still get the
compiled hooks for its next run, so the build is not this process's: it is a builder process
(``_build.py``) in a session of its own, which outlives the script that started it and is the
only one at work on a cache (it holds ``native/.lock``; a second one started meanwhile ends at
once, and a process that finds one at work says so and starts none). It finishes by itself: it
moves the built file into place atomically, or records a failed compile beside the target (a
script does not start that build again: ``python -m gradscope setup`` does, and shows why); and
it cleans up by itself: stopped by a signal or a time limit, it ends its compilers (ninja runs
each in a process group of its own, which a kill of the builder's group would leave running) and
removes its directory. Its output is kept in ``native/.build.log``, the build's seconds in
``native/.build-seconds``.

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
holds both (one build, one cache entry), and so does the one counter of the CPU allocator's bytes
(see NOTE [ the allocator's counter ] in hooks.cc), which a long loop's later iterations and the
diagnosis's runs of a step on copies both count with (:func:`counter`).
"""

from __future__ import annotations

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gradscope._base.errors import GradscopeError

__all__ = ["build", "build_or_say", "building", "cache_dir", "counter", "hooks", "status", "wait"]

_SOURCES = (Path(__file__).with_name("hooks.cc"), Path(__file__).with_name("walk.cc"))
_HEADER = Path(__file__).with_name("native.h")
_FIELDS = Path(__file__).with_name("fields.h")  # generated from fields.py
_BUILDER = Path(__file__).with_name("_build.py")  # the builder: see NOTE [ one builder per cache ]
_lock = threading.Lock()
_loaded: ModuleType | None = None
_reason: str | None = None  # why the compiled pair is not in use (None: not tried yet, or in use)
_tried = False  # settled: _loaded is the module, or None for good (GRADSCOPE_NATIVE=0, a failed build)
_builder: subprocess.Popen[bytes] | None = None  # the builder this process started, if any
_said = False  # the one line on stderr about a build in the background was said
_settings_made: dict[str, object] | None = None  # this process's settings (see _settings_now)
_target_path: Path | None = None  # and the file they build
_BUILD_SECONDS = ".build-seconds"  # the last build's duration, in the cache (for the time said)
_TIME_LIMIT_S = 1800  # a build taking longer is stopped (and recorded as failed)
_BUSY = 3  # the builder's exit status where another builder held the cache (it built nothing)


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


def _given(target: Path, settings: dict[str, object], **more: object) -> str:
    return json.dumps({**settings, "dir": str(target.parent), "name": target.name, "timeout": _TIME_LIMIT_S,
                       **more})


def _failure(target: Path) -> str | None:
    """The compiler's output where the last build of ``target`` failed, else None."""
    try:
        return target.with_name(f".{target.name}.failed").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output")
    return f"the C++ compiler failed: {first}"


def _builder_at_work(target_dir: Path) -> bool:
    """Whether a builder holds the cache's lock (this process's or another's)."""
    if _builder is not None and _builder.poll() is None:
        return True
    try:
        import fcntl
    except ImportError:
        return False
    try:
        with open(target_dir / ".lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def _building_since(target_dir: Path) -> float | None:
    """Seconds since the builder at work began (from ``native/.building``), None if unknown."""
    try:
        started = float(json.loads((target_dir / ".building").read_text())["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return max(0.0, time.time() - started)


def _last_build_s() -> int | None:
    """Seconds the last build in this cache took (measured by its builder), None before any."""
    try:
        return max(1, round(float((cache_dir() / "native" / _BUILD_SECONDS).read_text())))
    except (OSError, ValueError):
        return None


def _time_text() -> str:
    last = _last_build_s()
    if last is not None:
        return f"the last build here took {last} s"
    return "about 35 s on two free cores, up to 2 minutes on a busy machine"


def build(*, say: bool = True) -> Path:
    """Compile the hooks for this PyTorch now, unless a build is cached; returns the built file.
    Waits for a builder already at work; starts again a build that failed before. ``say=False``
    prints nothing. Raises OSError (no compiler, the compiler failed, the cache not writable).

    The builder runs in the foreground (see NOTE [ one builder per cache ]): Ctrl-C stops it,
    and it ends its compilers before it exits."""
    settings = _settings()
    target = _target(settings)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    waiting = _builder_at_work(target.parent)
    if say:
        if waiting:
            since = _building_since(target.parent)
            ago = f" {since:.0f} s ago" if since is not None else ""
            print(f"gradscope: [c++] waiting for the build of the compiled hooks another process started{ago}",
                  file=sys.stderr, flush=True)
        else:
            print(f"gradscope: [c++] compiling its saved-tensor hooks for torch {torch.__version__} (once per "
                  f"torch version; {_time_text()}; GRADSCOPE_NATIVE=0 skips it)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(_BUILDER), _given(target, settings, wait=True, force=True)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=target.parent)
    try:
        proc.wait()
    except BaseException:  # Ctrl-C (the builder, in the same process group, got it too) or a kernel interrupt
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)  # it ends its compilers and removes its directory
        raise
    if target.exists():
        if say:
            done = "ready after" if waiting else "built in"
            print(f"gradscope: [c++] {done} {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return target
    output = _failure(target)
    if output is None:
        raise OSError(f"the build ended without the compiled hooks (exit status {proc.returncode}); its output "
                      f"is in {target.parent / '.build.log'}")
    raise OSError(f"{_first_error(output)}\n{output[-3000:]}")


def _start_builder(target: Path, settings: dict[str, object]) -> None:
    """Start the builder in a session of its own, to outlive this process (NOTE [ one builder per
    cache ]); a daemon thread reaps it should this process live longer."""
    global _builder
    target.parent.mkdir(parents=True, exist_ok=True)
    _builder = subprocess.Popen([sys.executable, str(_BUILDER), _given(target, settings)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=target.parent, start_new_session=True)
    threading.Thread(target=_builder.wait, name="gradscope-builder-reaper", daemon=True).start()


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
    loader = importlib.machinery.ExtensionFileLoader("gradscope._capture.native._hooks", str(path))
    spec = importlib.util.spec_from_file_location("gradscope._capture.native._hooks", str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def hooks() -> ModuleType | None:
    """The compiled module, or None where the Python pair records instead (see NOTE [ compiled
    hooks ], NOTE [ first use never waits for the compiler ] and :func:`status`). Where nothing is
    cached it starts the builder in the background (unless one is at work) and returns None at
    once; a later call loads the file once it is there."""
    global _reason, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        mode = _mode()
        if mode == "0":
            _reason, _tried = "GRADSCOPE_NATIVE=0", True
            return None
        try:
            settings, target = _settings_now()
        except OSError as e:
            _reason, _tried = f"could not build the compiled hooks: {str(e).splitlines()[0]}", True
            return None
        if target.exists():
            return _settle(lambda: target, mode)
        if mode == "1":
            return _settle(build, mode)
        failed = _failure(target)
        if failed is not None:  # not started again by a script: python -m gradscope setup does
            _reason, _tried = f"could not build the compiled hooks: {_first_error(failed)}", True
            return None
        if _builder_at_work(target.parent):
            _reason = "the compiled hooks are being built in the background"
            if not _said:
                since = _building_since(target.parent)
                began = f"started {since:.0f} s ago; " if since is not None else ""
                _say(f"gradscope: the fast saved-tensor hooks are being built in the background ({began}"
                     f"{_time_text()}); until then blocks record with the Python hooks, more slowly. "
                     "To wait for them: python -m gradscope setup")
            return None
        if _builder is not None and _builder.returncode != _BUSY:  # ours ended without the file or a failure
            _reason, _tried = ("could not build the compiled hooks: the background build ended without them "
                               f"(its output: {target.parent / '.build.log'})"), True
            return None
        try:
            _start_builder(target, settings)
        except OSError as e:
            _reason, _tried = f"could not build the compiled hooks: {e}", True
            return None
        _reason = "the compiled hooks are being built in the background"
        _say(f"gradscope: building the fast saved-tensor hooks for torch {torch.__version__} in the background "
             f"(once per torch version; {_time_text()}); until then blocks record with the Python hooks, more "
             "slowly. To build them now and wait: python -m gradscope setup")
        return None


def _say(line: str) -> None:
    global _said
    _said = True
    print(line, file=sys.stderr, flush=True)


def _settings_now() -> tuple[dict[str, object], Path]:
    """This process's settings and target, worked out once (looking for the compiler and hashing
    the sources at each block would cost)."""
    global _settings_made, _target_path
    if _settings_made is None or _target_path is None:
        _settings_made = _settings()
        _target_path = _target(_settings_made)
    return _settings_made, _target_path


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


def counter(run: bool = False) -> Any:
    """A new counter of the CPU allocator's bytes (see NOTE [ the allocator's counter ] in hooks.cc),
    None where the compiled hooks are not in use (see :func:`hooks`). ``run=True``: a run's count (its
    own allocations alive and their peak, no reports kept), as the diagnosis counts its runs on copies;
    else a long loop's (every report kept until drained). It counts from ``start()`` to ``stop()``,
    once."""
    m = hooks()
    return None if m is None else m.Counter(run)


def wait(timeout: float | None = None) -> ModuleType | None:
    """Wait (at most ``timeout`` seconds) for a builder at work to end, then answer as
    :func:`hooks`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        module = hooks()
        if _tried:
            return module
        if not building():
            return hooks()  # (the file may have come since)
        if deadline is not None and time.monotonic() >= deadline:
            return module
        time.sleep(0.1)


def building() -> bool:
    """True while a builder (this process's or another's) is at work on the hooks this process
    would load, before they are loaded."""
    if _tried:
        return False
    target = _target_path
    return target is not None and not target.exists() and _builder_at_work(target.parent)


def status() -> dict[str, object]:
    """Which saved-tensor hooks record now: ``{"compiled": bool, "pair": "compiled" | "python",
    "reason": str | None, "path": str | None, "building": bool}`` (``building``: a background build
    runs; the next block begun after it ends uses the compiled pair)."""
    m = hooks()
    return {"compiled": m is not None, "pair": "compiled" if m is not None else "python", "reason": _reason,
            "path": getattr(m, "__file__", None), "building": building()}
