"""The diagnosis example of docs/diagnosis.md is run as a script and prints what the page shows.

The example is the page's only code block after the marker ``diagnosis example``; the output block
after it is compared line by line with the script's output from the diagnosis' first line on (its
middle, the tables of held memory, is elided there with ``...``), time factors masked. The
numbers are the pinned torch's (kernels and allocations differ between releases).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "diagnosis.md"  # the page tests/test_docs_examples.py leaves this example to
_PINNED = re.search(r"^TORCH_PINNED=(\S+)", (ROOT / "dev").read_text(), re.MULTILINE)


def _blocks() -> tuple[str, list[str]]:
    text = PAGE.read_text()
    rest = text[text.index("<!-- diagnosis example"):]
    blocks = re.findall(r"```(\w*)\n(.*?)```", rest, flags=re.DOTALL)
    code = next(body for lang, body in blocks if lang == "python")
    shown = next(body for lang, body in blocks if lang == "")
    return code, shown.rstrip("\n").splitlines()


def _mask(line: str) -> str:
    return re.sub(r"time x\d+\.\d+", "time x?", line)


@pytest.mark.skipif(_PINNED is None or torch.__version__.split("+")[0] != _PINNED.group(1),
                    reason="the page's numbers are the pinned torch's")
def test_the_readme_diagnosis_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    code, shown = _blocks()
    script = tmp_path / "gpt2_oom.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.rstrip("\n").splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("gradscope diagnosis:"))
    out = out[start:]
    cut = shown.index("...")
    head, tail = shown[:cut], shown[cut + 1:]
    assert out[: len(head)] == head
    assert [_mask(line) for line in out[-len(tail):]] == [_mask(line) for line in tail]
    # the finding that fits runs as printed: the page's code is the diagnosis' own
    assert "fits the budget" in "\n".join(tail)
