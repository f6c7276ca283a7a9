"""The diagnosis example of docs/diagnosis.md is run as a script and prints what the page shows; every
fix it says fits is pasted into a fresh process and fits.

The example is the page's only code block after the marker ``diagnosis example``; the output block
after it is compared line by line with the script's output from the diagnosis' first line on (its
middle, the tables of held memory, is elided there with ``...``), time factors masked. The
numbers are the pinned torch's (kernels and allocations differ between releases).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradscope._capture import native as _native

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


def _mask(line: str, counted: bool = True) -> str:
    """Time factors masked; where the tracker counted the runs (no compiled hooks), the exact bytes of a
    saving too: the page's are those of the counting CPU allocator, which also sees checkpointing's saved
    random states (5 KB; see NOTE [ the CPU allocator counts a run ] in gradscope._analyses.diagnose.counts)."""
    line = re.sub(r"time x\d+\.\d+", "time x?", line)
    return line if counted else re.sub(r"of the peak \(\d+ bytes\)", "of the peak (? bytes)", line)


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
    counted = os.environ.get("GRADSCOPE_NATIVE") != "0" and _native.counter() is not None
    assert [_mask(line, counted) for line in out[-len(tail):]] == [_mask(line, counted) for line in tail]
    # every finding that says it fits does, pasted as printed into a fresh process, in train mode (as
    # transformers builds the model) under the same budget, for a first step and the next
    fitting = _fitting_fixes(out)
    assert fitting and len(fitting) == sum("fits the 4.0 MiB" in line for line in tail)
    setup = code[: code.index("try:")]
    runner = ["import sys\n"]
    for k, (setup_code, step) in enumerate(fitting):  # each in a namespace of its own, built from the start
        pasted = (setup + "assert model.training\n" + setup_code + "for _ in range(2):\n"
                  + "    with gs.record(memory='tracker', budget='4MiB') as rec:\n"
                  + "".join("        " + line + "\n" for line in step.splitlines()) + f"print('fix {k} fits')\n")
        (tmp_path / f"fix{k}.py").write_text(pasted)
        runner.append(f"exec(compile(open('fix{k}.py').read(), 'fix{k}.py', 'exec'), {{'__name__': '__main__'}})\n")
    (tmp_path / "fixes.py").write_text("".join(runner))
    r = subprocess.run([sys.executable, "-W", "error::FutureWarning", "fixes.py"], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() [-3 * len(fitting):] == " ".join(f"fix {k} fits" for k in range(len(fitting))).split()


@pytest.mark.skipif(_PINNED is None or torch.__version__.split("+")[0] != _PINNED.group(1),
                    reason="the page's findings are the pinned torch's")
def test_the_readme_example_with_alternatives_shows_what_the_page_says(tmp_path: Path) -> None:
    """The page says that ``alternatives=True`` also shows micro-batches of 4, which fit too, and a note on
    the optimizer step in backward: the page's example, diagnosed so, does;
    every fix it says fits fits pasted into a fresh process, under the same budget, a first step and the next."""
    pytest.importorskip("transformers")
    code, _ = _blocks()
    script = tmp_path / "gpt2_oom.py"
    script.write_text(code.replace("print(gs.diagnose(rec))", "print(gs.diagnose(rec, alternatives=True))"))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.rstrip("\n").splitlines()
    findings = [line for line in out if re.match(r"^  \d+\. \[", line)]
    assert [re.search(r"\[(\w+)\]", f).group(1) for f in findings] == ["deep_activations", "micro_batches"]  # type: ignore[union-attr]
    assert sum(", fits the 4.0 MiB, time x" in line for line in out) == 2  # both fit
    assert any("micro-batches of 4" in line for line in out)
    assert any(line.startswith("note: [optimizer_state] not run:") for line in out)
    assert not any("were not tried" in line for line in out)
    fitting = _fitting_fixes(out)
    assert len(fitting) == 2
    setup = code[: code.index("try:")]
    for k, (setup_code, step) in enumerate(fitting):
        pasted = (setup + "assert model.training\n" + setup_code + "for _ in range(2):\n"
                  + "    with gs.record(memory='tracker', budget='4MiB') as rec:\n"
                  + "".join("        " + line + "\n" for line in step.splitlines()) + "print('fits')\n")
        (tmp_path / f"fix{k}.py").write_text(pasted)
        r = subprocess.run([sys.executable, f"fix{k}.py"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.split()[-1] == "fits", r.stderr[-3000:]


def _fitting_fixes(out: list[str]) -> list[tuple[str, str]]:
    """(set-up, step) of each finding whose measured line says it fits, from the printed report."""
    fixes: list[tuple[str, str]] = []
    fits = False
    i = 0
    while i < len(out):
        line = out[i]
        if line.startswith("     measured on the copies:"):
            fits = ", fits the " in line
        if line == "     code:":
            code: list[str] = []
            i += 1
            while i < len(out) and out[i].startswith("       "):
                code.append(out[i][7:])
                i += 1
            if fits:
                text = "\n".join(code) + "\n"
                if text.startswith("# once, before the steps:\n"):
                    once, each = text.split("# each step:\n")
                    fixes.append((once.split("\n", 1)[1], each))
                else:
                    fixes.append(("", text))
            continue
        i += 1
    return fixes
