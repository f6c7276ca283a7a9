"""The code base stays clean: ruff's lint rules and mypy's type check, as configured in pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _pinned_torch() -> str:
    """The torch release the project is developed on: ``TORCH_PINNED`` in ``./dev``."""
    m = re.search(r"^TORCH_PINNED=(\S+)", (ROOT / "dev").read_text(), re.MULTILINE)
    assert m, "./dev names no TORCH_PINNED"
    return m.group(1)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff() -> None:
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


# NOTE [ mypy against the pinned torch ]: the type check reads PyTorch's own annotations, and they
# change between releases (torch 2.6's stubs type ``torch.autograd.grad(inputs=...)`` without
# ``GradientEdge``, which 2.13 accepts and gradscope passes). The check is the project's own, of
# its own code: it runs against the pinned torch, where CI runs the whole suite; the other
# versions of the range test behaviour, not PyTorch's annotations.
@pytest.mark.skipif(torch.__version__.split("+")[0] != _pinned_torch(),
                    reason="mypy checks against the pinned torch's annotations (see NOTE [ mypy against the pinned "
                           "torch ] in tests/test_lint.py)")
def test_mypy() -> None:
    r = _run("mypy")
    assert r.returncode == 0 and "Success" in r.stdout, r.stdout + r.stderr
