"""gradscope's saved-tensor hooks, compiled against the PyTorch in use (built once, then cached).

NOTE [ compiled hooks ]: PyTorch calls a pack hook for every tensor a node saves and an unpack hook
for every one it reads back; on graphs of many small ops (an RNN cell in a loop, unrolled
optimizer steps, a GPU's microsecond kernels) these calls are a large share of all the work. A
Python hook pays for a frame and a dozen attribute reads on each (~2-3 us); the same row made in
C++ costs a fraction (``benchmarks/bench_small_ops.py`` prints both). ``hooks.cc`` holds a
pack/unpack pair that makes exactly the Python pair's rows (record.py) for plain tensors and hands
any other tensor to the Python pack hook; it is compiled on first use, for the PyTorch and Python
of the process, with the C++ compiler found on the machine, into gradscope's cache directory
(``$GRADSCOPE_CACHE``, else ``$XDG_CACHE_HOME/gradscope``, else ``~/.cache/gradscope``). Where it
cannot be built (no compiler, an unknown platform) the Python pair records the same rows, more
slowly; :func:`status` says which pair is in use and why. ``GRADSCOPE_NATIVE=0`` always uses the
Python pair, ``GRADSCOPE_NATIVE=1`` makes a failed build an error.

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

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import torch

from gradscope import _compat
from gradscope.errors import GradscopeError

__all__ = ["build", "build_or_say", "cache_dir", "hooks", "status"]

_SOURCES = (Path(__file__).with_name("hooks.cc"), Path(__file__).with_name("walk.cc"))
_HEADER = Path(__file__).with_name("native.h")
_lock = threading.Lock()
_loaded: ModuleType | None = None
_reason: str | None = None  # why the compiled pair is not in use (None: not tried yet, or in use)
_tried = False


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


def _command() -> list[str]:
    """The compiler's command, less its output (``-o FILE``, added by :func:`build`)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise OSError("no C++ compiler found (set CXX, or install g++)")
    root = Path(torch.__file__).parent
    abi = _compat.cxx11_abi()
    cmd = [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
           f"-I{sysconfig.get_paths()['include']}", *map(str, _SOURCES),
           f"-L{root / 'lib'}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{root / 'lib'}"]
    if sys.platform == "darwin":
        cmd.insert(1, "-undefined")
        cmd.insert(2, "dynamic_lookup")
    return cmd


def _target(command: list[str]) -> Path:
    """The built file's path: one per source, compiler command, PyTorch build and Python."""
    h = hashlib.sha256()
    for source in (*_SOURCES, _HEADER):
        h.update(source.read_bytes())
    h.update(" ".join(command).encode())
    h.update(f"{torch.__version__} {torch.version.git_version} {sys.implementation.cache_tag}".encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / "native" / f"_hooks-{torch.__version__.replace('+', '-')}-{h.hexdigest()[:16]}{suffix}"


def build() -> Path:
    """Compile the hooks for this PyTorch unless a build is cached; returns the built file.
    Raises OSError (no compiler, the compiler failed, the cache not writable)."""
    command = _command()
    target = _target(command)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "a") as lock:
        with contextlib.suppress(ImportError, OSError):
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same file: wait for it
        if target.exists():
            return target
        print(f"gradscope: [c++] compiling its saved-tensor hooks for torch {torch.__version__} (once, "
              "~15 s; GRADSCOPE_NATIVE=0 skips it)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), "")
                raise OSError(f"the C++ compiler failed: {first.strip()}\n{proc.stderr[-3000:]}")
            os.replace(out, target)
    return target


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
    """The compiled module (built on first use), or None where the Python pair records instead
    (see NOTE [ compiled hooks ] and :func:`status`)."""
    global _loaded, _reason, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        mode = _mode()
        if mode == "0":
            _reason = "GRADSCOPE_NATIVE=0"
        else:
            try:
                _loaded = _load(build())
                _reason = None
            except Exception as e:
                if mode == "1":
                    raise GradscopeError(
                        f"gradscope: GRADSCOPE_NATIVE=1 but its compiled hooks could not be built: {e}"
                    ) from e
                _reason = f"could not build the compiled hooks: {str(e).splitlines()[0]}"
        _tried = True
    return _loaded


def status() -> dict[str, object]:
    """Which saved-tensor hooks record: ``{"compiled": bool, "reason": str | None, "path": str | None}``."""
    m = hooks()
    return {"compiled": m is not None, "reason": _reason, "path": getattr(m, "__file__", None)}
