"""The builder of the compiled hooks: one process per cache that compiles them with
``torch.utils.cpp_extension``, outliving the process that started it (see NOTE [ one builder per
cache ] in gradscope._capture.native).

``python _build.py SETTINGS_JSON`` is the builder. It takes the cache's lock (``native/.lock``):
where another builder holds it, it ends at once (``"wait": true``: it waits for that one, as
``python -m gradscope setup`` does). Holding it, it removes what a builder killed outright left
(``build-*`` directories), writes ``native/.building`` (its pid, the file it builds, when it
began), runs the compile in a child process of its own process group and waits for it, then
moves the built file into place (atomically: a loader sees no file or the whole file), writes
the build's seconds (``native/.build-seconds``) and its output (``native/.build.log``). A failed
compile is written beside the target (``.<target>.failed``, the compiler's output): a script does
not start that build again; ``python -m gradscope setup`` does. SIGTERM, SIGINT or SIGHUP, or a
compile over the time limit, stop the compile: the builder sends SIGTERM to its process group
(ninja passes it to each compiler's group and ends), SIGKILL after a grace period, and on Linux,
where the builder is its descendants' subreaper, kills whatever is left of them; it removes its
directory either way. The builder always ends with no compiler left running.

``python _build.py --compile SETTINGS_JSON`` is the compile itself (the builder's child): with
ninja (``torch.utils.cpp_extension.load``, the sources compiled at once) where it is found, else
with setuptools and cpp_extension's ``BuildExtension`` (no ninja needed). Either way the module is
then imported once, so that a file that would not load is a failed build, not a loaded one.

This file imports nothing of gradscope's (the builder would import all of it for nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_GRACE_S = 10.0  # after SIGTERM, how long the compile has to end before SIGKILL
_PR_SET_CHILD_SUBREAPER = 36
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))


# ----------------------------------------------------------------------------- the compile
def _with_pip_ninja() -> None:
    """Put the ``ninja`` package's binary (where pip installed it) and the interpreter's scripts on
    PATH, where cpp_extension looks for ninja (else a system ninja, else setuptools)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _with_ninja(s: dict[str, Any], out: Path) -> Path:
    from torch.utils import cpp_extension

    cpp_extension.load(name="_hooks", sources=s["sources"], extra_cflags=s["cflags"],
                       extra_ldflags=s["ldflags"], build_directory=str(out), verbose=False,
                       is_python_module=False)  # (loads it with ctypes: imported again below)
    return out / "_hooks.so"


def _with_setuptools(s: dict[str, Any], out: Path) -> Path:
    from setuptools import setup
    from torch.utils import cpp_extension

    os.environ["CC"] = os.environ["CXX"] = str(s["cxx"])  # the C++ compiler compiles and links
    os.environ["LDSHARED"] = f"{s['cxx']} -shared"
    ext = cpp_extension.CppExtension("_hooks", s["sources"], extra_compile_args=s["cflags"],
                                     extra_link_args=s["ldflags"])
    setup(name="gradscope-hooks", ext_modules=[ext], script_name="setup.py",
          script_args=["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(out / "obj")],
          cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)})
    (built,) = out.glob("_hooks*.so")
    return built


def compile_into(s: dict[str, Any], out: Path) -> Path:
    """Compile the hooks into the directory ``out``; returns the built file (``out/<name>``),
    imported once."""
    _with_pip_ninja()
    os.environ["CXX"] = str(s["cxx"])
    from torch.utils import cpp_extension

    if s.get("ninja", True) and cpp_extension.is_ninja_available():
        built = _with_ninja(s, out)
    else:
        built = _with_setuptools(s, out)
    target = out / str(s["name"])
    shutil.move(str(built), target)
    import torch  # noqa: F401  # the module links against it

    loader = importlib.machinery.ExtensionFileLoader("gradscope._capture.native._hooks", str(target))
    spec = importlib.util.spec_from_file_location("gradscope._capture.native._hooks", str(target), loader=loader)
    assert spec is not None
    loader.exec_module(importlib.util.module_from_spec(spec))
    return target


# ----------------------------------------------------------------------------- the builder
class _Stopped(Exception):
    """A signal asked the builder to stop."""


def _stop(signum: int, _frame: Any) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _become_subreaper() -> bool:
    """On Linux, make the builder the reaper of its orphaned descendants: a compiler whose ninja
    died becomes the builder's child, so the builder can end it (see :func:`_end_descendants`)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; empty elsewhere)."""
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(name))
    return out


def _end_descendants() -> None:
    """Kill and reap every process left below the builder (orphans come to it as subreaper)."""
    for _ in range(100):
        kids = _children(os.getpid())
        if not kids:
            return
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def _end_compile(proc: subprocess.Popen[bytes]) -> None:
    """Stop the compile's process group: SIGTERM (ninja ends each compiler's group), then
    SIGKILL after a grace period; then whatever is left below the builder."""
    if not hasattr(os, "killpg"):  # no process groups (Windows): the compile alone
        proc.kill()
        with contextlib.suppress(subprocess.SubprocessError):
            proc.wait(_GRACE_S)
        return
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group's stragglers (cpp_extension, ninja)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc.wait(_GRACE_S)
    _end_descendants()


def _lock(native: Path, wait: bool) -> Any:
    """The cache's lock, held until the builder exits; None where another builder holds it."""
    f = open(native / ".lock", "a")  # noqa: SIM115  # held for the builder's life
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one builder per process is all that can be said
        return f
    if wait:
        fcntl.flock(f, fcntl.LOCK_EX)
        return f
    # a process that only looks whether a builder runs holds it for microseconds: try a while
    for _ in range(20):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            time.sleep(0.05)
    f.close()
    return None


def _write(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def build(s: dict[str, Any]) -> int:
    """The builder (see the module's docstring). Returns 0 when the file is built (or was),
    1 when the compile failed, 2 when it was stopped (a signal, the time limit), 3 when another
    builder holds the cache."""
    native = Path(s["dir"])
    native.mkdir(parents=True, exist_ok=True)
    target = native / str(s["name"])
    failed = target.with_name(f".{target.name}.failed")
    lock = _lock(native, bool(s.get("wait")))
    if lock is None:
        return 3
    if target.exists():
        return 0
    if failed.exists() and not s.get("force"):
        return 1
    for stale in native.glob("build-*"):  # a builder killed outright (SIGKILL) left it
        shutil.rmtree(stale, ignore_errors=True)
    _become_subreaper()
    for sig in _SIGNALS:
        signal.signal(sig, _stop)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=native))
    t0 = time.monotonic()
    _write(native / ".building", json.dumps({"pid": os.getpid(), "name": target.name, "started": time.time()}))
    proc: subprocess.Popen[bytes] | None = None
    output = b""
    status = 2
    try:
        proc = subprocess.Popen([sys.executable, __file__, "--compile", json.dumps({**s, "out": str(tmp)})],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=tmp, preexec_fn=getattr(os, "setpgrp", None))  # a group of its own: _end_compile
        try:
            output, _ = proc.communicate(timeout=float(s.get("timeout", 1800)))
        except subprocess.TimeoutExpired:
            output = f"the build took more than {s.get('timeout', 1800)} s and was stopped".encode()
            _end_compile(proc)
            raise
        _end_descendants()  # nothing is left after a compile that ended; this makes sure
        built = tmp / target.name
        if proc.returncode == 0 and built.exists():
            os.replace(built, target)  # atomic: a loader sees no file or the whole file
            failed.unlink(missing_ok=True)
            _write(native / ".build-seconds", f"{time.monotonic() - t0:.0f}\n")
            status = 0
        else:
            status = 1
    except subprocess.TimeoutExpired:
        status = 1
    except _Stopped as e:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # stop once: the clean-up below is not cut short
        output += f"\nstopped by {e}".encode()
        if proc is not None:
            _end_compile(proc)
    finally:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        text = output.decode("utf-8", "replace")
        _write(native / ".build.log", text)
        if status == 1:
            _write(failed, text)
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            (native / ".building").unlink()
        lock.close()
    return status


def main(argv: list[str]) -> int:
    if len(argv) > 2 and argv[1] == "--compile":
        s = json.loads(argv[2])
        compile_into(s, Path(s["out"]))
        return 0
    return build(json.loads(argv[1]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
