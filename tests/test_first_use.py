"""First use: a fresh cache never makes a recording wait for the compiler (see NOTE [ first use never
waits for the compiler ] in gradscope._capture.native), and gradscope's global module hooks cause no
PyTorch warning about ``torch.compile``d modules."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import gradscope as gs

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++")
HOOK_WARNING = "Using `torch.compile(module)` when there are global hooks on modules"


def _env(**env: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("GRADSCOPE_NATIVE", "GRADSCOPE_CACHE", "CXX")}
    e.update(PYTHONPATH=str(ROOT), **env)
    return e


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=_env(**env), timeout=600)


# One process, the whole sequence: a first block while the build runs, a block after it.
SEQUENCE = """
    import json, torch, gradscope as gs
    from torch import nn
    from gradscope._capture import native as _native

    def step():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        m(torch.randn(5, 8)).pow(2).sum().backward()

    def rows(rec):
        r = rec.recording
        return {"nodes": [[n.id, n.name, n.order, n.module, n.leaf, n.executed] for n in r.nodes],
                "edges": [[e.src, e.dst] for e in r.edges],
                "saves": [[s.node, s.attribute, list(s.shape), s.bytes, s.storage, s.kind.value, s.module,
                           s.name, s.freed_at_step] for s in r.saved]}

    with gs.record(memory="off") as first:
        step()
    during = _native.status()
    _native.wait()
    with gs.record(memory="off") as later:
        step()
    after = _native.status()
    print(json.dumps({"during": during, "after": after, "first": rows(first), "later": rows(later)}, default=str))
"""

PYTHON_PAIR = SEQUENCE.replace("_native.wait()", "pass")


# A script as a user writes one: one block, then it exits (no wait for anything).
SCRIPT = """
    import json, torch, gradscope as gs
    from gradscope._capture import native as _native
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    with gs.record(memory="off") as rec:
        lin(torch.randn(3, 8)).tanh().sum().backward()
    print(json.dumps({"status": _native.status(), "saved": rec.recording.saved_bytes}))
"""


def _ours(cache: Path) -> dict[int, str]:
    """Every process at work in ``cache`` (its directory or command line there): the builder, the
    compile, ninja, the compilers. Linux's /proc."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(cache)) or str(cache) in args:
            found[int(proc.name)] = args[:120]
    return found


def _until(what: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _said(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("gradscope:")]


@pytest.mark.skipif(COMPILER is None or not sys.platform.startswith("linux"),
                    reason="a C++ compiler and Linux's /proc (to see every process of the build)")
def test_first_use_never_waits_and_scripts_get_the_compiled_hooks(tmp_path: Path) -> None:
    """NOTE [ first use never waits for the compiler ] and NOTE [ one builder per cache ] in
    gradscope._capture.native, from an empty cache, with one build: a script that records one block and exits
    starts the builder, which a signal stops cleanly (no compiler, ninja or directory left); the next
    process starts it again and records its first block with the Python pair, the same rows, while a
    process started meanwhile finds the builder at work and starts none; once built, a later block of
    the same process and the next process's first block record with the compiled pair, the same rows
    again, and no process of the build is left."""
    import json

    ref = _run(PYTHON_PAIR, GRADSCOPE_NATIVE="0")
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(ref.stdout)
    assert reference["during"]["pair"] == "python"
    assert reference["first"]["nodes"] and reference["first"]["saves"]

    cache = tmp_path / "cache"
    native = cache / "native"
    try:
        # a script: its one block does not wait, its exit does not end the build
        first = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["status"]["pair"] == "python"
        said = _said(first.stderr)
        assert len(said) == 1, first.stderr
        assert said[0].startswith(f"gradscope: building the fast saved-tensor hooks for torch {torch.__version__} in "
                                  "the background (once per torch version; ")
        assert said[0].endswith("until then blocks record with the Python hooks, more slowly. To build them now and "
                                "wait: python -m gradscope setup")
        # stopped (SIGTERM) while its compilers run, the builder ends them and removes its directory
        assert _until((native / ".building").exists, 30)
        building = json.loads((native / ".building").read_text())
        assert _until(lambda: any("cc1plus" in a or "clang" in a for a in _ours(cache).values()), 120), _ours(cache)
        os.kill(building["pid"], signal.SIGTERM)
        assert _until(lambda: not _ours(cache), 60), _ours(cache)
        assert sorted(p.name for p in native.iterdir()) == [".build.log", ".lock"]
        assert (native / ".build.log").read_text().strip().endswith("stopped by SIGTERM")

        # the next process starts the builder again, records its first block with the Python pair and
        # waits for the build (_native.wait) before its second block
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SEQUENCE)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(GRADSCOPE_CACHE=str(cache)))
        try:
            assert _until((native / ".building").exists, 60)
            # a process started meanwhile finds that builder at work and starts none
            meanwhile = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
            assert meanwhile.returncode == 0, meanwhile.stderr
            assert "gradscope: the fast saved-tensor hooks are being built in the background (started " in meanwhile.stderr
            assert json.loads(meanwhile.stdout)["status"]["building"] is True
            assert len([a for a in _ours(cache).values() if "_build.py {" in a]) == 1, _ours(cache)
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        got = json.loads(out)
        assert got["during"] == {**got["during"], "building": True, "compiled": False, "pair": "python"}
        assert got["first"] == reference["first"]
        assert got["after"] == {**got["after"], "compiled": True, "pair": "compiled", "building": False, "reason": None}
        assert got["later"] == reference["first"]
        assert len(_said(err)) == 1, err
        # the build completed and left no process and no directory
        assert _until(lambda: not _ours(cache), 60), _ours(cache)
        built = list(native.glob("_hooks-*"))
        assert len(built) == 1 and got["after"]["path"] == str(built[0])
        assert not [p for p in native.iterdir() if p.is_dir()] and not (native / ".building").exists()
        seconds = int((native / ".build-seconds").read_text())

        # the next process: compiled from its first block, the same rows, nothing said
        again = _run(SEQUENCE, GRADSCOPE_CACHE=str(cache))
        assert again.returncode == 0, again.stderr
        got = json.loads(again.stdout)
        assert got["during"]["compiled"] is True and got["during"]["building"] is False
        assert got["first"] == reference["first"]
        assert "gradscope:" not in again.stderr
        # a build's message from now on says the time this one took
        assert f"the last build here took {max(1, seconds)} s" in _run(
            "from gradscope._capture import native as _native; print(_native._time_text())", GRADSCOPE_CACHE=str(cache)).stdout
    finally:
        for pid in _ours(cache):  # a failed assertion leaves nothing running either
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_native_0_never_builds_and_native_1_builds_before_the_block(tmp_path: Path) -> None:
    off = _run(PYTHON_PAIR, GRADSCOPE_NATIVE="0", GRADSCOPE_CACHE=str(tmp_path / "off"))
    assert off.returncode == 0, off.stderr
    assert not (tmp_path / "off").exists() and "gradscope:" not in off.stderr
    # GRADSCOPE_NATIVE=1: a failed build is an error, raised by the first block (not left to a thread)
    strict = _run(PYTHON_PAIR, GRADSCOPE_NATIVE="1", CXX="/bin/false", GRADSCOPE_CACHE=str(tmp_path / "strict"))
    assert strict.returncode != 0
    assert "GRADSCOPE_NATIVE=1 but its compiled hooks could not be built" in strict.stderr
    # auto with a failing compiler: the failure is said by status() once the build ended, never raised
    failing = _run(SEQUENCE, CXX="/bin/false", GRADSCOPE_CACHE=str(tmp_path / "auto"))
    assert failing.returncode == 0, failing.stderr
    import json

    after = json.loads(failing.stdout)["after"]
    assert after["compiled"] is False and after["building"] is False
    assert after["reason"].startswith("could not build the compiled hooks: the C++ compiler failed")
    assert not list((tmp_path / "auto" / "native").glob("_hooks-*"))


def test_setup_command_builds_synchronously(tmp_path: Path) -> None:
    out = _run("from gradscope.__main__ import main; raise SystemExit(main(['setup']))",
               GRADSCOPE_NATIVE="0", GRADSCOPE_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "GRADSCOPE_NATIVE=0" in out.stdout and not (tmp_path / "native").exists()
    failing = _run("from gradscope.__main__ import main; raise SystemExit(main(['setup']))",
                   CXX="/bin/false", GRADSCOPE_CACHE=str(tmp_path))
    assert failing.returncode == 1 and "the C++ compiler failed" in failing.stderr


# ---------------------------------------------------------------------- torch.compile's warning
def test_a_compiled_module_gives_no_global_hook_warning() -> None:
    if not hasattr(torch, "compile") or COMPILER is None:
        pytest.skip("torch.compile needs a C compiler")
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    compiled = torch.compile(lin)
    x = torch.randn(2, 4)
    compiled(x)  # compiles here, outside the block (the compiler's imports add their own filters)
    with gs.record(memory="off"):  # so do the modules a first block imports (torch.distributed on 2.6)
        pass
    before = list(warnings.filters)  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside_filters = list(warnings.filters)  # type: ignore[attr-defined]
        with gs.record(memory="off") as rec:
            outs = [compiled(x) for _ in range(3)]
            warnings.warn("the program's own warning", UserWarning, stacklevel=1)
        after_block = list(warnings.filters)  # type: ignore[attr-defined]
    # the block left the program's filters as they were (as a multiset: torch 2.6's compiled calls
    # move their own "torch.distributed" entry to the front on each call, gradscope or not)
    assert Counter(map(repr, after_block)) == Counter(map(repr, inside_filters))
    assert not [f for f in after_block if f[1] is not None and "global hooks" in f[1].pattern]
    assert list(warnings.filters) == before  # type: ignore[attr-defined]
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if t.startswith(HOOK_WARNING)], texts
    assert "the program's own warning" in texts
    for out in outs:  # the compiled module computed what the module computes
        torch.testing.assert_close(out, x @ lin.weight.T + lin.bias)
    assert rec.recording is not None
    # outside a block the same call still warns where this torch warns (gradscope hides it only inside)
    nn.modules.module.register_module_forward_hook(lambda *a: None).remove()
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
        try:
            compiled(x)
        finally:
            handle.remove()
    eval_frame = Path(torch.__file__).parent / "_dynamo" / "eval_frame.py"
    torch_warns = "global hooks on " in eval_frame.read_text()
    assert any(str(w.message).startswith(HOOK_WARNING) for w in outside) == torch_warns
