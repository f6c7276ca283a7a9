"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and says what it should."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebook  # real kernels: see RANGE_PYTEST_ARGS in ./dev

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


def _status_lines(text: str) -> list[dict[str, str]]:
    """Every ``status: {name: status, ...}`` line the notebook printed, in order."""
    out = []
    for line in text.splitlines():
        if line.startswith("status: {"):
            out.append(dict(re.findall(r"'([^']+)': '(ok|wrong|raised)'", line)))
    return out


def _ints(pattern: str, text: str) -> list[tuple[int, ...]]:
    return [tuple(int(g.replace(",", "")) for g in m) for m in re.findall(pattern, text)]


def test_01_mixed_second_derivatives():
    text, _ = _run("01_mixed_second_derivatives.ipynb")
    assert "nodes per order: {0: 136, 1: 96}" in text  # the user's loop keeps G's graph, twice over, per z
    loop = _ints(r"user's loop, N = +(\d+): peak +([\d,]+) B", text)
    assert [n for n, _ in loop] == [2, 8, 32] and loop[2][1] > 10 * loop[0][1]
    # the two-step attempt fails as it did for the user (newer PyTorch words it "The differentiated Tensor ...")
    assert re.search(
        r"RuntimeError: .*appears to not have been used in the graph\. Set allow_unused=True", text
    )
    assert "with allow_unused=True: None" in text
    # the forum answer's forward AD allocates a weight-sized zero tangent (G.4.weight, 4 MiB) in module G.4
    m = re.search(r"peak ([\d,]+) B, at: forward, \S+, module G\.4", text)
    assert m and int(m.group(1).replace(",", "")) >= 1024 * 1024 * 4
    assert _status_lines(text)[0] == {"users_loop": "ok", "forward_ad": "ok", "split": "wrong"}
    assert "the strategy equals the user's own loop: True" in text
    rows = _ints(
        r"N = +(\d+): user's loop +([\d,]+) B +answer's forward AD +([\d,]+) B +forward_ad +([\d,]+) B +status ok/ok",
        text,
    )
    assert [r[0] for r in rows] == [1, 2, 8, 32, 128]
    ours = {r[0]: r[3] for r in rows}
    assert ours[128] - ours[1] < 128 * 1024  # flat in N: only the N values and directions grow
    assert all(
        r[2] > 4 * 1024 * 1024 for r in rows
    )  # the answer's forward AD: the 4 MiB temporary every time
    assert rows[-1][1] > 50 * ours[128]
    assert _number(text, r"forward_ad peak below the user's loop from N = (\d+)") <= 2
    assert _number(text, r"so it would win only from N = (\d+)") > 128
    # where it stops: a custom Function without jvp
    assert re.search(r"forward_ad +raised .*\n(.*\n)*?forward_ad: .*You must implement the jvp function", text)


def test_02_many_inputs():
    text, _ = _run("02_many_inputs.ipynb")
    assert _status_lines(text) == [
        {"stacked": "ok", "users_two_pass": "wrong", "two_pass": "ok"},
        {"stacked": "ok", "users_two_pass": "wrong", "two_pass": "raised"},
    ]
    assert re.search(r"users_two_pass: f\.\S+\.grad: max abs error \S+ above the tolerance", text)
    assert "gradients allclose: True" in text
    assert "running stats and num_batches_tracked equal: True 6" in text
    assert "RNG state afterwards equal: True" in text
    peaks = _ints(r"n = +(\d+): stacked peak +([\d,]+) B +two_pass peak +([\d,]+) B +\(ok\)", text)
    assert [p[0] for p in peaks] == [4, 16, 64]
    assert peaks[2][2] <= 1.6 * peaks[0][2] and peaks[2][1] > 10 * peaks[0][1]
    assert _number(text, r"two-pass peak / stacked peak at n = 64: ([\d.]+)") < 0.1
    # spectral_norm: refused by name, while the user's code is silently off
    assert (
        "two_pass: GradscopeError: gradscope.strategies.many_inputs_backward: recomputing `f(inputs[0])` "
        in text
    )
    assert "f.0.weight_u (buffer) changed in place" in text
    assert _number(text, r"spectral_norm: gradient error ([\d.e-]+),") > 1e-4
    assert "eval mode: {'stacked': 'ok', 'two_pass': 'ok'}" in text


def test_03_hypergradients():
    text, _ = _run("03_hypergradients.ipynb")
    assert re.search(r"RuntimeError: .*appears to not have been used in the graph", text)
    assert "after the update: is_leaf True | grad_fn None | p.grad depends on A: True" in text
    assert "with allow_unused=True: None" in text
    assert "argmax labels: torch.int64 requires_grad False" in text
    assert "d loss2 / d M1 through argmax labels: None" in text
    assert "backward(inputs=[A]) on the cut graph: no error, A.grad = None" in text
    assert "matches finite differences (h = 1e-7): True" in text
    fd_err = {
        float(h): float(e)
        for h, e in re.findall(r"h = (\S+): relative error of finite differences (\S+)", text)
    }
    assert fd_err[1e-7] < 1e-5 < fd_err[1e-3]
    rows = re.findall(
        r"^ +(\w+) +(ok|wrong) +peak +([\d,]+) B +time +[\d.]+ ms +relative error (\S+)$", text, re.M
    )
    table = {}
    steps = iter((1, 1, 1, 4, 4, 4, 16, 16, 16, 16))
    for name, status, peak, rel in rows:
        table[name, next(steps)] = (status, int(peak.replace(",", "")), float(rel))
    assert all(
        table["unrolled", k][0] == "ok" and table["finite_difference", k][0] == "ok" for k in (1, 4, 16)
    )
    assert table["unrolled", 16][1] > 8 * table["unrolled", 1][1]  # grows with the steps
    assert table["finite_difference", 16][1] == table["finite_difference", 1][1]  # flat
    assert table["truncated_1", 16][1] == table["truncated_1", 1][1]
    assert table["truncated_1", 16][0] == "wrong" and table["truncated_1", 16][2] > 0.5  # biased, shown


def test_04_penalty_branches():
    text, _ = _run("04_penalty_branches.ipynb")
    assert _status_lines(text) == [
        {"joint": "ok", "forum_recipe": "ok", "early": "ok"},
        {"joint": "ok", "early": "ok"},
        {"by_hand": "ok", "custom_function": "ok", "early_scaled": "ok"},
    ]
    assert _number(text, r"early release peak / joint peak = ([\d.]+)") <= 0.45
    assert _number(text, r"early / joint peak = ([\d.]+)") <= 0.5
    assert _number(text, r"early_scaled peak / custom_function peak = ([\d.]+)") <= 0.45
    assert "gradscope recording joint" in text
    assert "cannot rescale per sample: penalty #0 sends gradient into a leaf of shape (16, 128)" in text
    assert "a penalty read a trunk tensor made after its `at`" in text


def test_05_jacobians():
    text, _ = _run("05_jacobians.ipynb")
    methods = ("loop", "batched", "repeat", "double_vjp", "jacrev", "jacfwd", "vmap")
    shapes = _status_lines(text)
    every = {m: "ok" for m in (*methods, "thread_rev_jacobian", "thread_fwd_jacobian")}
    assert shapes[:3] == [every, every, every]
    assert shapes[3] == {m: "ok" for m in methods}
    assert "d/dx and d/dweights of |J|^2 equal double backward: " + str({m: True for m in methods}) in text
    assert _number(text, r"blocks: max abs error ([\d.]+)") > 0.05  # what batch_dim=0 used to return
    assert "`fn.1` (BatchNorm1d, train mode) normalizes with the statistics of the whole batch" in text
    assert "equals the diagonal blocks of autograd.functional.jacobian: True" in text
    assert "`fn` mixes samples" in text
    peaks = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in (*methods, "thread_rev_jacobian", "thread_fwd_jacobian") and "KiB" in line:
            peaks[parts[0]] = [int(p) for p in re.findall(r"(\d+) KiB", line)]
    assert (
        peaks["repeat"][0] > 10 * peaks["double_vjp"][0]
    )  # tall: repeat's copies against forward from reverse
