"""The user's source lines of nodes, saved tensors and allocations (see NOTE [ where lines come from ]
in gradscope._model.lines): checked against this file's own lines, found by their ``# L:name`` markers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope._base.frames import is_folded_file
from gradscope._capture import native as _native
from gradscope._model.lines import cell_of, node_lines
from gradscope.recording import Recording, SourceLine
from gradscope.widget import recording_payload

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
_SOURCE = HERE.read_text().splitlines()


def line_of(marker: str) -> int:
    """The number of the one line of this file that ends with ``# L:<marker>``."""
    found = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# L:{marker}")]
    assert len(found) == 1, (marker, found)
    return found[0]


class Block(nn.Module):  # a user's module: its forward is the user's code, nn.Linear's is not
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # L:fc
        return torch.tanh(h)  # L:tanh


def squash(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * 2  # L:squash


def _mlp_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)  # L:call
    loss = (y * y).sum()  # L:loss
    loss.backward()  # L:backward
    return loss


def _where(rec: Recording, line: int | None) -> tuple[str, int, str] | None:
    if line is None:
        return None
    s = rec.lines[line]
    return (s.file, s.line, s.function)


def _here(marker: str, function: str) -> tuple[str, int, str]:
    return (str(HERE), line_of(marker), function)


def test_a_user_modules_forward_names_its_own_lines() -> None:
    model = Block()
    x = torch.randn(4, 8)
    with gs.record(memory="off") as rec:
        _mlp_step(model, x)
    r = rec.recording
    assert r is not None
    by_name = {n.name: _where(r, n.line) for n in r.nodes}
    # the line inside the user's forward, not nn.Linear.forward's (torch's, folded)
    assert by_name["AddmmBackward0"] == _here("fc", "forward")
    assert by_name["TBackward0"] == _here("fc", "forward")  # saves nothing: the node made before it
    assert by_name["TanhBackward0"] == _here("tanh", "forward")
    assert by_name["MulBackward0"] == _here("loss", "_mlp_step")
    assert by_name["SumBackward0"] == _here("loss", "_mlp_step")  # saves nothing of ours
    assert by_name["AccumulateGrad"] is None
    # each saved tensor has its node's line (each node's saves were packed inside its op)
    for s in r.saved:
        assert s.line == r.nodes[s.node].line
    assert {r.nodes[s.node].name for s in r.saved} == {"AddmmBackward0", "TanhBackward0", "MulBackward0"}
    # the whole stack: the folded torch frame inside, then the caller's lines outwards
    fc = r.lines[r.nodes[[n.name for n in r.nodes].index("AddmmBackward0")].line]
    assert fc.label == f"test_lines.py:{line_of('fc')} in forward"
    files = [f for f, _, _ in fc.stack]
    assert is_folded_file(files[0]) and "linear.py" in files[0]
    k = fc.stack.index(_here("fc", "forward"))
    assert _here("call", "_mlp_step") in fc.stack[k + 1:]
    assert fc.cell is None


def test_a_loop_and_a_function_called_from_the_block() -> None:
    w = torch.randn(16, requires_grad=True)
    with gs.record(memory="off") as rec:
        y = w
        for _ in range(5):
            y = squash(y)
            y = y.exp()  # L:loop
        y.sum().backward()
    r = rec.recording
    assert r is not None
    names = [(n.name, _where(r, n.line)) for n in r.nodes if n.name != "AccumulateGrad"]
    loop = (str(HERE), line_of("loop"), "test_a_loop_and_a_function_called_from_the_block")
    assert names.count(("ExpBackward0", loop)) == 5
    assert names.count(("SigmoidBackward0", _here("squash", "squash"))) == 5
    assert names.count(("MulBackward0", _here("squash", "squash"))) == 5
    # one line table row per line, however many ops ran there
    assert len([s for s in r.lines if s.line == line_of("loop")]) == 1
    assert len([s for s in r.lines if s.line == line_of("squash")]) == 1


def _graphs() -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    model = Block()
    cell = nn.LSTMCell(4, 8)
    xs = torch.randn(6, 2, 4)
    lr = torch.tensor(0.1, requires_grad=True)

    def mlp() -> None:
        _mlp_step(model, torch.randn(4, 8))

    def lstm() -> None:
        h = c = torch.zeros(2, 8)
        for t in range(xs.shape[0]):
            h, c = cell(xs[t], (h, c))
        h.pow(2).mean().backward()

    def unrolled() -> None:  # create_graph: nodes made in backward get the line that ran backward
        p = model.fc.weight.detach().requires_grad_()
        for _ in range(3):
            loss = (squash(torch.randn(4, 8) @ p) ** 2).mean()
            (g,) = torch.autograd.grad(loss, [p], create_graph=True)
            p = p - lr * g
        p.sum().backward()

    return {"mlp": mlp, "lstm": lstm, "unrolled": unrolled}


def _lines_of(step: Callable[[], None], memory: str) -> dict[str, Any]:
    with gs.record(memory=memory) as rec:
        step()
    save_lines = list(rec._block.trace.save_lines)
    r = rec.recording
    assert r is not None
    # each line, and its stack up to this function (the callers outside differ between the runs)
    lines = [(s.file, s.line, s.function, s.cell,
              s.stack[:next(i for i, f in enumerate(s.stack) if f[2] == "_lines_of")]) for s in r.lines]
    return {"save_lines": save_lines, "lines": lines, "nodes": [(n.name, n.line) for n in r.nodes],
            "saved": [s.line for s in r.saved], "allocations": [(a.label, a.line) for a in r.allocations]}


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("GRADSCOPE_NATIVE") == "0",
                    reason="no C++ compiler here (or GRADSCOPE_NATIVE=0): the Python hooks record")
@pytest.mark.parametrize("name", ["mlp", "lstm", "unrolled"])
@pytest.mark.parametrize("memory", ["off", "tracker"])
def test_the_compiled_hooks_give_the_python_hooks_lines(name: str, memory: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if _native.wait() is None:
        pytest.skip("the compiled hooks are not built in this process")
    step = _graphs()[name]
    _lines_of(step, memory)  # warm up (orders learnt)
    compiled = _lines_of(step, memory)
    with monkeypatch.context() as m:
        m.setattr(_native, "hooks", lambda: None)
        python = _lines_of(step, memory)
    assert compiled["save_lines"] and min(compiled["save_lines"]) >= 0
    assert compiled == python


def test_nodes_made_by_backward_name_the_line_that_ran_it() -> None:
    step = _graphs()["unrolled"]
    with gs.record(memory="off") as rec:
        step()
    r = rec.recording
    assert r is not None
    grad_line = next(i for i, t in enumerate(_SOURCE) if "torch.autograd.grad(loss, [p], create_graph=True)" in t) + 1
    order1 = {_where(r, n.line) for n in r.nodes if n.order == 1}
    assert order1 == {(str(HERE), grad_line, "unrolled")}


def test_tracker_allocations_name_their_lines_and_backward_ones_their_nodes() -> None:
    model = Block()
    x = torch.randn(4, 8)
    with gs.record(memory="tracker") as rec:
        _mlp_step(model, x)
    r = rec.recording
    assert r is not None and r.allocations
    fwd = [(a.label, _where(r, a.line)) for a in r.allocations if a.phase.value == "forward"]
    assert ("aten::addmm", _here("fc", "forward")) in fwd
    assert ("aten::tanh", _here("tanh", "forward")) in fwd
    assert ("aten::mul", _here("loss", "_mlp_step")) in fwd
    node_line = {r.steps[a.step].node: a.line for a in r.allocations if a.step is not None}
    assert node_line and all(r.nodes[n].line == line for n, line in node_line.items())
    # the timeline's points carry their allocation's line
    assert {p.line for p in r.timeline} >= {a.line for a in r.allocations}
    # by line, from the rows themselves
    expect: dict[int, dict[int, int]] = {}
    for s in r.saved:
        if s.line is not None:
            expect.setdefault(s.line, {})[s.storage] = s.bytes
    assert r.saved_bytes_by_line() == dict(sorted(((k, sum(v.values())) for k, v in expect.items()),
                                                  key=lambda kv: (-kv[1], kv[0])))
    alive = r.bytes_at_peak_by_line()
    assert alive is not None and sum(alive.values()) == sum(a.bytes for a in r.alive_at_peak() if a.line is not None)


def test_profiler_source_gives_backward_allocations_their_nodes_lines() -> None:
    model = Block()
    with gs.record(memory="cpu") as rec:
        _mlp_step(model, torch.randn(4, 8))
    r = rec.recording
    assert r is not None and r.allocations
    assert all(a.line is None for a in r.allocations if a.step is None)  # no stacks from the profiler
    stepped = [a for a in r.allocations if a.step is not None]
    assert stepped and all(a.line == r.nodes[r.steps[a.step].node].line for a in stepped)


def test_lines_can_be_turned_off() -> None:
    model = Block()
    with gs.record(memory="tracker", lines=False) as rec:
        _mlp_step(model, torch.randn(4, 8))
    r = rec.recording
    assert r is not None and r.nodes and r.lines == ()
    assert all(n.line is None for n in r.nodes) and all(s.line is None for s in r.saved)
    assert all(a.line is None for a in r.allocations)
    code = "import torch, gradscope as gs\nw = torch.ones(3, requires_grad=True)\n" \
           "with gs.record(memory='off') as rec:\n    (w * 2).sum().backward()\nprint(len(rec.recording.lines))\n"
    env = {**os.environ, "GRADSCOPE_LINES": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_gradients_are_bit_equal_with_lines() -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8)
    _mlp_step(model, x)
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    with gs.record(memory="tracker"):
        _mlp_step(model, x)
    recorded = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(plain) == len(recorded) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded, strict=True))


def test_json_round_trip_and_files_without_lines(tmp_path: Path) -> None:
    model = Block()
    with gs.record(memory="tracker") as rec:
        _mlp_step(model, torch.randn(4, 8))
    r = rec.recording
    assert r is not None and r.lines
    path = tmp_path / "r.gscope.json"
    r.save(path)
    back = gs.load(path)
    assert back.lines == r.lines
    assert [n.line for n in back.nodes] == [n.line for n in r.nodes]
    assert [s.line for s in back.saved] == [s.line for s in r.saved]
    assert [a.line for a in back.allocations] == [a.line for a in r.allocations]
    assert [p.line for p in back.timeline] == [p.line for p in r.timeline]
    # a file written before lines existed: no table, no line columns
    d = json.loads(path.read_text())
    del d["lines"]
    for table in ("nodes", "saved", "allocations", "timeline"):
        del d[table]["line"]
    old = Recording.from_dict(d)
    assert old.lines == () and all(n.line is None for n in old.nodes) and old.saved_bytes_by_line() == {}
    # rows taken without their line table are written without lines
    Recording(nodes=r.nodes[:3], label="part").save(tmp_path / "part.json")
    part = gs.load(tmp_path / "part.json")
    assert [n.name for n in part.nodes] == [n.name for n in r.nodes[:3]] and all(n.line is None for n in part.nodes)
    assert any(n.line is not None for n in r.nodes[:3])
    # a line index outside the table is a damaged file
    d = json.loads(path.read_text())
    d["nodes"]["line"][0] = len(r.lines)
    with pytest.raises(gs.GradscopeError, match="node line"):
        Recording.from_dict(d)


def test_a_notebook_cell_is_named_by_its_execution_count() -> None:
    assert cell_of("<ipython-input-12-0123456789ab>") == 12
    assert cell_of("/home/u/train.py") is None
    src = textwrap.dedent("""
        def f(w):
            return (w * w).sum()
        with gs.record(memory="off") as rec:
            f(w).backward()
    """)
    ns: dict[str, Any] = {"gs": gs, "w": torch.ones(3, requires_grad=True)}
    exec(compile(src, "<ipython-input-7-abcdefabcdef>", "exec"), ns)
    r = ns["rec"].recording
    mul = next(n for n in r.nodes if n.name == "MulBackward0")
    assert r.lines[mul.line].label == "cell [7]:3 in f"
    assert r.lines[mul.line].cell == 7


def test_an_ipython_cell_is_named_from_the_shell() -> None:
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.user_ns.update(gs=gs, torch=torch)
    result = ip.run_cell("w = torch.ones(3, requires_grad=True)\n"
                         "with gs.record(memory='off') as rec:\n"
                         "    (w * w).sum().backward()\n", store_history=True)
    assert result.success, result.error_in_exec
    r = ip.user_ns["rec"].recording
    mul = next(n for n in r.nodes if n.name == "MulBackward0")
    line = r.lines[mul.line]
    assert line.cell == result.execution_count
    assert line.label == f"cell [{result.execution_count}]:3 in <module>"


def test_the_widget_payload_and_the_text_name_lines() -> None:
    model = Block()
    with gs.record(memory="tracker") as rec:
        _mlp_step(model, torch.randn(4, 8))
    r = rec.recording
    assert r is not None
    p = recording_payload(r)
    S = p["strings"]
    assert [S[k] for k in p["lines"]["label"]] == [s.label for s in r.lines]
    assert p["nodes"]["line"] == [-1 if n.line is None else n.line for n in r.nodes]
    assert p["saved"]["line"] == [-1 if s.line is None else s.line for s in r.saved]
    assert set(p["timeline"]["line"]) <= set(range(len(r.lines))) | {-1}
    by_saved = r.saved_bytes_by_line()
    assert dict(zip(p["by_line"]["line"], p["by_line"]["saved"], strict=True)) == {
        k: by_saved.get(k, 0) for k in p["by_line"]["line"]}
    text = r.summary()
    top = next(iter(by_saved))
    assert f"  1. {gs.recording.format_bytes(by_saved[top]):>10}  {r.lines[top].label}" in text
    assert f"at test_lines.py:{line_of('tanh')} in forward" in text  # the tanh output, saved


def test_the_diagnosis_names_the_lines_of_its_largest_holders() -> None:
    model = Block()
    x = torch.randn(32, 8)
    with gs.record(memory="tracker") as rec:
        out = model(x).pow(2)
    r = rec.recording
    assert r is not None
    d = gs.diagnose(r, {"model": model})
    by_node = {t.node: t.line for t in d.largest}
    assert by_node["TanhBackward0"] == f"test_lines.py:{line_of('tanh')} in forward"
    # the peak comes while fc's output is still alive (a forward result nobody saved: no node)
    assert [(t.kind, t.line) for t in d.largest if t.node is None] == [
        ("forward", f"test_lines.py:{line_of('fc')} in forward")]
    assert f"at test_lines.py:{line_of('tanh')} in forward" in str(d)
    del out


def test_node_lines_fill_from_the_nearest_earlier_node() -> None:
    keys = [5, 4, 3, ("acc", 1), 2]
    seqs = [5, 4, 3, -1, 2]
    assert node_lines(keys, seqs, {1: 7, 4: 9}) == [7, 7, 9, None, 9]
    assert node_lines(keys, seqs, {}) == [None] * 5


def test_source_line_labels() -> None:
    s = SourceLine("/home/u/proj/train.py", 57, "train_step", stack=(("/home/u/proj/train.py", 57, "train_step"),))
    assert s.label == "train.py:57 in train_step"
    assert s.format_stack() == "/home/u/proj/train.py:57 in train_step"
    assert SourceLine("/x/pkg/__init__.py", 3, "f").label == "pkg/__init__.py:3 in f"
    assert SourceLine("/tmp/ipykernel_1/99.py", 2, "<module>", cell=4).label == "cell [4]:2 in <module>"


@pytest.mark.browser
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium")
def test_the_page_names_lines_in_the_side_panel_and_the_timeline(tmp_path: Path) -> None:
    from gradscope.widget import bundle_path

    if not bundle_path().exists():
        pytest.skip("front end not built (cd js && npm run build)")
    sync_api = pytest.importorskip("playwright.sync_api")
    model = Block()
    with gs.record(memory="tracker") as rec:
        _mlp_step(model, torch.randn(4, 8))
    r = rec.recording
    assert r is not None
    path = tmp_path / "run.html"
    r.to_html(path)
    alive, saved = r.bytes_at_peak_by_line() or {}, r.saved_bytes_by_line()
    expect = sorted(set(alive) | set(saved), key=lambda k: (-alive.get(k, 0), -saved.get(k, 0), k))
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.route("**/*", lambda rt: rt.continue_() if rt.request.url.startswith("file:") else rt.abort())
            page.goto(path.as_uri())
            page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
            # the "by line" table beside "by module": the lines in the recording's order
            shown = page.locator(".gs-linetable .gs-line-name").all_inner_texts()
            assert shown == [r.lines[k].label for k in expect if alive.get(k, 0) or saved.get(k, 0)][:15]
            # a click on a line shows its largest saver, whose panel names the line
            page.locator(".gs-linetable .gs-line").first.click()
            node = int(page.locator(".gs-side").get_attribute("data-node") or "-1")
            assert r.nodes[node].line == expect[0]
            assert page.locator(".gs-node-line").inner_text() == r.lines[expect[0]].label
            shots = HERE.parent.parent / "test-artifacts"  # looked at by whoever changes the view
            shots.mkdir(exist_ok=True)
            page.screenshot(path=str(shots / "lines_01_table_and_panel.png"), full_page=True)
            # hovering the timeline's peak names the line that made what was allocated there
            peak_i = max(range(len(r.timeline)), key=lambda i: r.timeline[i].live)
            page.wait_for_selector('.gs-timeline[data-ready="1"]', timeout=20_000)
            page.locator(".gs-timeline").scroll_into_view_if_needed()
            pos = page.evaluate(
                """() => { const gd = document.querySelector('.gs-timeline');
                           const tr = gd.data.find(t => t.meta === 'peak'); const fl = gd._fullLayout;
                           const r = gd.getBoundingClientRect();
                           return { x: r.left + fl._size.l + fl.xaxis.l2p(tr.x[0]),
                                    y: r.top + fl._size.t + fl.yaxis.l2p(tr.y[0]) }; }""")
            page.mouse.move(pos["x"], pos["y"])
            page.wait_for_selector(".gs-timeline .hoverlayer .hovertext", timeout=5_000)
            hover = page.locator(".gs-timeline .hoverlayer .hovertext").first.text_content() or ""
            line = r.timeline[peak_i].line
            assert line is not None and f"at {r.lines[line].label}" in hover
        finally:
            browser.close()


def test_the_folding_rule() -> None:
    import contextlib

    import gradscope

    assert is_folded_file(nn.Linear.forward.__code__.co_filename)  # torch's
    assert is_folded_file(gradscope.record.__init__.__code__.co_filename)  # gradscope's own
    assert is_folded_file(contextlib.__file__)  # the standard library's
    assert is_folded_file("/usr/lib/python3/dist-packages/transformers/models/bert/modeling_bert.py")
    assert is_folded_file("/venv/lib/python3.11/site-packages/timm/layers/mlp.py")
    assert is_folded_file("<frozen runpy>")
    assert not is_folded_file(str(HERE))  # a user's file, its modules included
    assert not is_folded_file("/home/u/proj/train.py")
    assert not is_folded_file("/tmp/ipykernel_77/3184.py") and not is_folded_file("<ipython-input-3-0123456789ab>")
