"""The text path: the summary's figures, and nothing but gradscope's own lines on the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = textwrap.dedent(
    """
    import os, torch, gradscope as gs
    old = torch.randn(1000, 1000)            # allocated before the recording
    w = torch.randn(256, requires_grad=True)
    for _ in range(2):
        with gs.record(memory="cpu") as rec:
            del old                          # freed inside it: the profiler warns on fd 2
            os.write(2, b"the user's own line\\n")
            (w * 2).sum().backward()
            old = torch.randn(1000, 1000)
        print(rec.recording.summary().splitlines()[0], flush=True)
    os.write(2, b"after\\n")
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_profiler_free_warning_is_dropped_and_the_rest_of_stderr_kept():
    # NOTE [ the profiler's free warning ]: without the filter this prints
    # "[W ... CPUAllocator.cpp:245] Memory block of unknown size was allocated before ..."
    p = _run(_SCRIPT)
    assert p.returncode == 0, p.stderr
    assert "CPUAllocator" not in p.stderr and "unknown size" not in p.stderr, p.stderr
    assert p.stderr.count("the user's own line\n") == 2 and p.stderr.endswith("after\n"), p.stderr
    assert p.stdout.splitlines() == ["gradscope recording"] * 2


def test_the_warning_is_real_without_the_filter():
    # the same free under the bare profiler prints it: the test above checks something real
    code = textwrap.dedent(
        """
        import torch
        from torch.profiler import profile, ProfilerActivity
        old = torch.randn(1000, 1000)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            del old
        """
    )
    p = _run(code)
    assert "Memory block of unknown size" in p.stderr


def test_demo_text_names_its_figures():
    p = _run("from gradscope.__main__ import main; main(['demo', '--depth', '2', '--width', '32', '--batch', '4', '--out', ''])")
    assert p.returncode == 0, p.stderr
    assert "[W" not in p.stderr and "CPUAllocator" not in p.stderr
    out = p.stdout
    assert "top modules, alive at peak (bytes allocated inside the block by this module" in out
    assert "top saved tensors allocated in the block (activations" in out
    assert "backward 1 with create_graph=True (the graph was kept)" in out
    assert "peak (at once)" in out and "saved (total)" in out and "min-max" in out
