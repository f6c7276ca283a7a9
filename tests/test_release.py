"""Deep graphs: see NOTE [ freeing deep graphs ] in gradscope._capture.walk. A 200,000-node chain that a
recording walked is freed safely by ``gs.release``; dropping it the plain way crashes PyTorch (on a
torch whose node objects persist), which is why the recording says so. Each case runs in its own
process, so a crash fails the test rather than the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gradscope as gs
from gradscope._base import compat as _compat

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import sys, torch, gradscope as gs
torch.set_num_threads(1)
x = torch.full((1,), 0.5, requires_grad=True)
with gs.record(memory="off") as rec:
    y = x
    for _ in range({steps}):
        y = y * 1.00001
    y = y.sum()
r = rec.recording
print("nodes", len(r.nodes))
print("note", any("gs.release(result)" in n for n in r.notes))
if {release}:
    print("released", gs.release(y))
else:
    del y
print("survived yes", flush=True)
"""


def _run(steps: int, release: bool) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_SCRIPT.format(steps=steps, release=release))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_release_frees_a_200000_node_recorded_chain() -> None:
    steps = 200_000
    p = _run(steps, release=True)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert lines["nodes"] == str(steps + 2)  # the leaf's AccumulateGrad, the muls, the sum
    assert lines["released"] == str(steps + 2)
    assert lines["survived"] == "yes"
    assert lines["note"] == str(_compat.capabilities().nodes_persist)


@pytest.mark.skipif(not _compat.capabilities().nodes_persist, reason="this torch frees walked graphs fine")
def test_plain_del_of_the_same_walked_chain_crashes() -> None:
    """The trap gs.release avoids, shown (in its own process)."""
    p = _run(200_000, release=False)
    assert p.returncode != 0 and "survived" not in p.stdout


def test_release_small_graph_and_bad_input() -> None:
    w = torch.ones(3, requires_grad=True)
    a = w * 2
    b = (a * 3).exp()
    c = b.sum()
    assert gs.release(c) == 5  # Sum, Exp, Mul, Mul, AccumulateGrad
    assert not c.requires_grad and c.grad_fn is None
    assert torch.equal(c, (w.detach() * 6).exp().sum())
    with pytest.raises(gs.GradscopeError, match="takes tensors"):
        gs.release([c])  # type: ignore[arg-type]
    v = (w * 2)[:2]
    with pytest.raises(gs.GradscopeError, match="view"):
        gs.release(v)
