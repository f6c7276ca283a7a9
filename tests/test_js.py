"""The front end's pure logic, unit-tested with Node's built-in test runner."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parent.parent / "js"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_unit_tests_pass():
    proc = subprocess.run(["node", "--test", "test/"], cwd=JS, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passed = int(re.search(r"^# pass (\d+)", out, re.M).group(1))
    failed = int(re.search(r"^# fail (\d+)", out, re.M).group(1))
    assert failed == 0
    assert passed >= 25, out[-2000:]
