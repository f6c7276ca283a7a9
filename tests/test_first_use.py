"""First use: a fresh cache never makes a recording wait for the compiler (see NOTE [ first use never
waits for the compiler ] in gradscope._native), and gradscope's global module hooks cause no
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


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("GRADSCOPE_NATIVE", "GRADSCOPE_CACHE", "CXX")}
    e.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                          timeout=600)


# One process, the whole sequence: a first block while the build runs, a block after it.
SEQUENCE = """
    import json, torch, gradscope as gs
    from torch import nn
    from gradscope import _native

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


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler here: nothing is built")
def test_first_record_does_not_wait_for_the_build(tmp_path: Path) -> None:
    import json

    ref = _run(PYTHON_PAIR, GRADSCOPE_NATIVE="0")
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(ref.stdout)
    assert reference["during"]["pair"] == "python"
    assert reference["first"]["nodes"] and reference["first"]["saves"]

    out = _run(SEQUENCE, GRADSCOPE_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # the first block ended while the build still ran: the Python pair recorded it, with the same rows
    assert got["during"]["building"] is True and got["during"]["compiled"] is False
    assert got["during"]["pair"] == "python"
    assert got["first"] == reference["first"]
    # once built, a later block records with the compiled pair, the same rows again
    assert got["after"] == {**got["after"], "compiled": True, "pair": "compiled", "building": False, "reason": None}
    assert got["later"] == reference["first"]
    built = list((tmp_path / "native").glob("_hooks-*"))
    assert len(built) == 1 and got["after"]["path"] == str(built[0])
    assert [p.name for p in (tmp_path / "native").iterdir() if p.is_dir()] == []  # no temporary left
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("gradscope:")]
    assert len(said) == 1, out.stderr
    assert said[0].startswith(f"gradscope: building the fast saved-tensor hooks for torch {torch.__version__} in "
                              "the background (once per torch version; ")
    assert said[0].endswith("until then blocks record with the Python hooks, more slowly. To build them now and "
                            "wait: python -m gradscope setup")

    # the next process finds the build cached: compiled from its first block, nothing said
    again = _run(SEQUENCE, GRADSCOPE_CACHE=str(tmp_path))
    assert again.returncode == 0, again.stderr
    got = json.loads(again.stdout)
    assert got["during"]["compiled"] is True and got["during"]["building"] is False
    assert got["first"] == reference["first"]
    assert "gradscope:" not in again.stderr


# A script as a user writes one: one block, then it exits (no wait for anything).
SCRIPT = """
    import json, torch, gradscope as gs
    from gradscope import _native
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


@pytest.mark.skipif(COMPILER is None or not sys.platform.startswith("linux"),
                    reason="a C++ compiler and Linux's /proc (to see every process of the build)")
def test_scripts_run_back_to_back_get_the_compiled_hooks(tmp_path: Path) -> None:
    """NOTE [ one builder per cache ]: short scripts from an empty cache each exit after one block;
    the build outlives them, one builder at a time, and the next script uses it. A builder stopped
    mid-compile ends its compilers and leaves nothing; one that finishes leaves no process."""
    import json

    cache = tmp_path / "cache"
    native = cache / "native"
    try:
        first = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["status"]["pair"] == "python"
        said = [ln for ln in first.stderr.splitlines() if ln.startswith("gradscope:")]
        assert len(said) == 1 and "in the background" in said[0] and said[0].endswith("python -m gradscope setup")
        # the script has exited; its builder has not: stopped now (SIGTERM) while its compilers run, it ends them
        assert _until((native / ".building").exists, 30)
        building = json.loads((native / ".building").read_text())
        assert _until(lambda: any("cc1plus" in a or "clang" in a for a in _ours(cache).values()), 120), _ours(cache)
        os.kill(building["pid"], signal.SIGTERM)
        assert _until(lambda: not _ours(cache), 60), _ours(cache)  # no compiler, no ninja, no builder left
        assert sorted(p.name for p in native.iterdir()) == [".build.log", ".lock"]  # its directory removed
        assert (native / ".build.log").read_text().strip().endswith("stopped by SIGTERM")

        # the next script starts the build again; the one after it finds that builder at work and starts none
        second = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
        assert second.returncode == 0, second.stderr
        assert "gradscope: building the fast saved-tensor hooks" in second.stderr
        third = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
        assert third.returncode == 0, third.stderr
        assert "gradscope: the fast saved-tensor hooks are being built in the background (started " in third.stderr
        assert json.loads(third.stdout)["status"]["building"] is True
        builders = [a for a in _ours(cache).values() if "_build.py {" in a]
        assert len(builders) == 1, builders
        # no script runs now: the build completes by itself, and leaves no process behind
        assert _until(lambda: not _ours(cache), 600), _ours(cache)
        built = list(native.glob("_hooks-*"))
        assert len(built) == 1, sorted(p.name for p in native.iterdir())
        assert not list(native.glob("build-*")) and not (native / ".building").exists()
        seconds = int((native / ".build-seconds").read_text())
        # the next script records with the compiled hooks from its first block, and says nothing
        fourth = _run(SCRIPT, GRADSCOPE_CACHE=str(cache))
        assert fourth.returncode == 0, fourth.stderr
        got = json.loads(fourth.stdout)
        assert got["status"] == {**got["status"], "compiled": True, "path": str(built[0]), "building": False}
        assert got["saved"] == json.loads(first.stdout)["saved"]
        assert "gradscope:" not in fourth.stderr
        # a build's message from now on says the time this one took
        assert f"the last build here took {max(1, seconds)} s" in _run(
            "from gradscope import _native; print(_native._time_text())", GRADSCOPE_CACHE=str(cache)).stdout
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
