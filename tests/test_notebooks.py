"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and says what it should."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
_ROW = re.compile(r"^(\S+)(?: \(ref\))?\s+(ok|wrong|raised)\s")


def _run(name: str) -> tuple[str, list[dict]]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # the "python3" kernel is the interpreter running the tests (the venv's)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    text: list[str] = []
    displays: list[dict] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stdout":
                text.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                displays.append(dict(out.data))
            elif out.output_type == "error":  # pragma: no cover - execute() raises first
                raise AssertionError(f"{name}: {out.ename}: {out.evalue}")
    return "".join(text), displays


def _statuses(text: str) -> list[dict[str, str]]:
    """One {candidate: status} per gs.compare table printed, in order."""
    tables: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if line.startswith("gs.compare:"):
            current = {}
            tables.append(current)
        elif current is not None and (m := _ROW.match(line)):
            current[m.group(1)] = m.group(2)
    return tables


def _number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output"
    return float(m.group(1))


def test_every_notebook_is_covered():
    assert ALL == [
        "00_tour.ipynb",
        "01_mixed_second_derivatives.ipynb",
        "02_many_inputs.ipynb",
        "03_hypergradients.ipynb",
        "04_penalty_branches.ipynb",
        "05_jacobians.ipynb",
    ]


def test_00_tour():
    text, displays = _run("00_tour.ipynb")
    assert "gradscope recording mlp step" in text
    assert _statuses(text) == [{"create_graph": "ok", "forward_ad": "ok", "split": "wrong"}]
    assert "split: output is None where the reference has a tensor" in text
    assert _number(text, r"forward AD peak / create_graph peak = ([\d.]+)") < 0.6
    # ReLU output (shared with the next Linear) + input + (10, 128) weight + (32, 10) log-softmax
    # + int64 targets + the loss's scalar total weight
    assert (
        _number(text, r"saved bytes: (\d+)")
        == 4 * 32 * 128 + 4 * 32 * 64 + 4 * 10 * 128 + 4 * 32 * 10 + 8 * 32 + 4
    )
    assert any("text/plain" in d for d in displays)  # the comparison displayed itself
    assert "mixed_grad, unrolled_params" in text


def test_01_mixed_second_derivatives():
    text, _ = _run("01_mixed_second_derivatives.ipynb")
    assert "dfdz requires grad: False" in text
    assert "RuntimeError: element 0 of tensors does not require grad" in text
    assert _statuses(text)[0] == {"create_graph": "ok", "forward_ad": "ok", "split": "wrong"}
    assert "forward AD equals double backward: True" in text
    assert "dg/dy by forward AD equals the naive double backward: True" in text
    rows = re.findall(
        r"depth\s+(\d+): create_graph peak\s+([\d,]+) B\s+forward_ad peak\s+([\d,]+) B\s+status ok", text
    )
    assert [r[0] for r in rows] == ["2", "12"]
    cg = [int(r[1].replace(",", "")) for r in rows]
    fa = [int(r[2].replace(",", "")) for r in rows]
    assert fa[1] <= 1.1 * fa[0]  # flat in depth
    assert cg[1] > 2 * cg[0]  # grows with depth


def test_02_many_inputs():
    text, _ = _run("02_many_inputs.ipynb")
    assert _statuses(text) == [{"stacked": "ok", "two_pass": "ok", "naive_two_pass": "wrong"}]
    assert re.search(r"naive_two_pass: f\.\S+\.grad: max abs error \S+ above the tolerance", text)
    assert "gradients allclose: True" in text
    assert "running stats and num_batches_tracked equal: True 6" in text
    assert "RNG state afterwards equal: True" in text
    assert _number(text, r"two-pass peak / stacked peak = ([\d.]+)") < 0.6


def test_03_hypergradients():
    text, _ = _run("03_hypergradients.ipynb")
    assert "appears to not have been used in the graph" in text
    assert "with allow_unused=True: None" in text
    assert _statuses(text) == [{"unrolled_sgd": "ok", "inplace_sgd": "wrong"}]
    assert "sgd: hypergradient matches finite differences: True" in text
    assert "adam: hypergradient matches finite differences: True" in text


def test_04_penalty_branches():
    text, _ = _run("04_penalty_branches.ipynb")
    assert _statuses(text) == [{"joint": "ok", "early": "ok", "retain_graph": "ok"}]
    assert _number(text, r"early release peak / joint peak = ([\d.]+)") <= 0.45
    assert "gradscope recording joint" in text


def test_05_jacobians():
    text, _ = _run("05_jacobians.ipynb")
    assert _statuses(text) == [{m: "ok" for m in ("loop", "batched", "jacrev", "jacfwd", "vmap")}]
    assert "shape: (8, 32, 32) | sample 0 equals autograd.functional.jacobian: True" in text
    assert "{'loop': True, 'batched': True, 'jacrev': True, 'jacfwd': True, 'vmap': True}" in text
