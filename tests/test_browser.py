"""The widget and the HTML page in a real browser (Chromium driven by Playwright).

1. JupyterLab: the test starts a server on 127.0.0.1 with a temp root, writes a notebook, runs it,
   and checks the graph's node count, a click on a node (its saved tensors, and the kernel's
   ``selected_node``), backward step-through (and the kernel's ``step``), a strategy toggle that
   re-runs one candidate in the kernel, and hostile module names shown as text.
2. The HTML page from file:// with every non-file request aborted.

Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _recordings import HOSTILE, hostile_recording, layered_recording

import gradscope.widget as W
from gradscope.recording import format_bytes

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium"),
    pytest.mark.skipif(not W.bundle_path().exists(), reason="front end not built (cd js && npm run build)"),
]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

playwright_sync = pytest.importorskip("playwright.sync_api")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


@pytest.fixture()
def browser() -> Iterator[object]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


# ----- the notebook ---------------------------------------------------------------------------
_SETUP = r"""
import json, torch, gradscope as gs
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
x = torch.randn(8, 6)
with gs.record() as r:
    model(x).pow(2).mean().backward()
rec = r.recording
by_node = rec.saved_by_node()
click = max(by_node, key=lambda n: (len(by_node[n]), -n))
print("FACTS=" + json.dumps({
    "nodes": len(rec.nodes),
    "click": click,
    "click_name": rec.nodes[click].name,
    "click_attrs": [s.attribute for s in by_node[click]],
    "steps": [[s.node, s.live_after, s.freed_bytes] for s in rec.steps],
    "freed": [s.freed_at_step for s in rec.saved],
}))
"""
_WIDGET = "w = gs.show(rec)\nw"
_COMPARE = r"""
CALLS = {"stacked": 0, "loop": 0}
xs = torch.randn(4, 6)
def stacked():
    CALLS["stacked"] += 1
    return model(xs).sum()
SLOW = {"on": False}
def loop():
    CALLS["loop"] += 1
    if SLOW["on"]:
        import time; time.sleep(3)  # a long run: the view must stay responsive meanwhile
    return sum(model(xs[i:i + 1]).sum() for i in range(4))
cmp = gs.compare({"stacked": stacked, "loop": loop}, reference="stacked", repeat=1)
CALLS0 = dict(CALLS)
cw = gs.show(cmp)
cw
"""
# the bare value: a Recording displays itself as the widget (_repr_mimebundle_)
_HOSTILE = "from _recordings import hostile_recording\nhostile_recording()"
_STATE = (
    'print("STATE=" + json.dumps({"selected_node": w.selected_node, "step": w.step, '
    '"calls": {k: CALLS[k] - CALLS0[k] for k in CALLS}, "reruns": cw.rerun_count, '
    '"rerun_error": cw.rerun_error, "running": cw.running, "statuses": [r.status for r in cmp.rows]}))'
)
_SLOW = 'SLOW["on"] = True\nprint("SLOW=" + json.dumps(SLOW))'
# selecting from Python: the next node after the current selection
_SELECT = 'w.selected_node = (w.selected_node + 1) % len(rec.nodes)\nprint("SELECT=" + json.dumps({"node": w.selected_node}))'
CELLS = [_SETUP, _WIDGET, _COMPARE, _HOSTILE, _STATE, _SLOW, _SELECT]


def _notebook() -> dict:
    return {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"c{i}",
                "metadata": {},
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(CELLS)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _settings(dirpath: Path) -> None:
    """User settings for a quiet, unvirtualised Lab: no news toast, every cell in the DOM."""
    (dirpath / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (dirpath / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    (dirpath / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (dirpath / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"})
    )


@pytest.fixture()
def lab(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """A JupyterLab server on 127.0.0.1 with a temp root; stopped (with its kernels) afterwards."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(ROOT / "tests" / "_recordings.py", root / "_recordings.py")
    (root / "widget_test.ipynb").write_text(json.dumps(_notebook()), encoding="utf-8")
    settings = tmp_path / "settings"
    _settings(settings)
    port = _free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JUPYTERLAB_SETTINGS_DIR"] = str(settings)
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "workspaces")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            "--LabApp.expose_app_in_browser=True",
            f"--ServerApp.root_dir={root}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.3)
        yield base, token, root
    finally:
        # the server's process group holds the server and its kernels: stop all of it
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        log.close()


def _cell_output(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea-output").all_inner_texts()


def _facts(page, prefix: str, index: int) -> dict:
    text = "\n".join(_cell_output(page, index))
    m = re.search(prefix + r"=(\{.*\})", text)
    assert m, f"no {prefix} in cell {index} output: {text[-1500:]}"
    return json.loads(m.group(1))


def _run_cell(page, index: int, prefix: str) -> dict:
    """Run one cell and return the JSON it printed after ``prefix=``; waits for this run's output
    (the model's execution count must move past the one before), never a stale one."""
    before = page.evaluate(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].model.executionCount || 0", index
    )
    page.evaluate(
        """async (i) => {
            const nb = window.jupyterapp.shell.currentWidget.content;
            nb.activeCellIndex = i;
            await window.jupyterapp.commands.execute('notebook:run-cell');
        }""",
        index,
    )
    page.wait_for_function(
        """([i, p, before]) => {
            const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
            const count = cell.model.executionCount || 0;
            const out = cell.node.querySelector('.jp-OutputArea-output');
            return count > before && out && out.textContent.includes(p);
        }""",
        arg=[index, prefix + "=", before],
        timeout=60_000,
    )
    return _facts(page, prefix, index)


def _click_node(page, graph, node_id: int) -> None:
    graph.scroll_into_view_if_needed()
    pos = graph.locator("canvas").evaluate(f"c => c.gsNodeCenter({node_id})")
    assert pos is not None and pos["visible"], pos
    page.mouse.click(pos["x"], pos["y"])


def test_widget_in_jupyterlab(lab, browser):
    base, token, _root = lab
    dialogs: list[str] = []
    blocked: list[str] = []
    errors: list[str] = []
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):
        if r.request.url.startswith(base):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    t0 = time.monotonic()
    try:
        page.goto(f"{base}/lab/tree/widget_test.ipynb?token={token}")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
            "window.jupyterapp.shell.currentWidget.sessionContext && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=60_000,
        )
        page.evaluate(
            """async () => {
                const p = window.jupyterapp.shell.currentWidget;
                await p.sessionContext.ready;
                await window.jupyterapp.commands.execute('notebook:run-all-cells');
            }"""
        )
        page.wait_for_function(
            "() => document.querySelectorAll('.gs-root[data-ready=\"1\"]').length >= 3", timeout=120_000
        )
        facts = _facts(page, "FACTS", 0)
        state0 = _run_cell(page, 4, "STATE")
        # run-all ran the SELECT cell once: node 0 chosen from Python, shown by the view
        assert state0["selected_node"] == 0 and state0["step"] == -1 and state0["reruns"] == 0

        # --- the graph: every node drawn (a small MLP is not collapsed) ---------------------
        rw = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".gs-root")
        graph = rw.locator(".gs-graph")
        assert int(graph.get_attribute("data-node-count")) == facts["nodes"]
        assert int(graph.get_attribute("data-visible-count")) == facts["nodes"]
        graph.scroll_into_view_if_needed()
        assert rw.locator(".gs-side").get_attribute("data-node") == "0"
        _shot(page, "lab_01_recording")

        # --- click a node: its saved tensors, and the kernel knows ---------------------------
        _click_node(page, graph, facts["click"])
        title = rw.locator(".gs-node-title")
        assert title.inner_text() == f"{facts['click_name']} #{facts['click']}"
        attrs = rw.locator(".gs-saved tr[data-saved] td:first-child").all_inner_texts()
        assert attrs == facts["click_attrs"]
        _shot(page, "lab_02_clicked")
        assert _run_cell(page, 4, "STATE")["selected_node"] == facts["click"]

        # --- step through backward -----------------------------------------------------------
        rw.locator(".gs-stepper").scroll_into_view_if_needed()
        for _ in range(3):
            rw.locator(".gs-next").click()
        node, live, freed = facts["steps"][2]
        label = rw.locator(".gs-steplabel")
        assert label.get_attribute("data-step") == "2"
        assert f"step 3/{len(facts['steps'])}" in label.inner_text()
        assert f"live {format_bytes(live)}" in label.inner_text()
        assert rw.locator(".gs-side").get_attribute("data-node") == str(node)
        greyed = rw.locator(".gs-saved tr.gs-freed")
        expected = [i for i, f in enumerate(facts["freed"]) if f is not None and f <= 2]
        shown = [int(x) for x in greyed.evaluate_all("rs => rs.map(r => r.dataset.saved)")]
        assert set(shown) <= set(expected)
        released = rw.locator(".gs-released tr[data-saved]").evaluate_all(
            "rs => rs.map(r => Number(r.dataset.saved))"
        )
        assert released == [i for i, f in enumerate(facts["freed"]) if f == 2]
        _shot(page, "lab_03_step")
        assert _run_cell(page, 4, "STATE")["step"] == 2

        # --- selecting from Python shows the node in the view ---------------------------------
        target = _run_cell(page, 6, "SELECT")["node"]
        assert target == (facts["click"] + 1) % facts["nodes"]
        page.wait_for_selector(
            f'.jp-Notebook .jp-Cell >> nth=1 >> .gs-side[data-node="{target}"]', timeout=10_000
        )
        assert rw.locator(".gs-node-title").inner_text().endswith(f" #{target}")

        # --- pan and zoom ------------------------------------------------------------------------
        canvas = graph.locator("canvas")
        graph.scroll_into_view_if_needed()
        a0 = canvas.evaluate("c => c.gsNodeCenter(0)")
        b0 = canvas.evaluate(f"c => c.gsNodeCenter({facts['click']})")
        box = canvas.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.wheel(0, -300)  # zoom in around the centre
        a1 = canvas.evaluate("c => c.gsNodeCenter(0)")
        b1 = canvas.evaluate(f"c => c.gsNodeCenter({facts['click']})")
        assert abs(a1["y"] - b1["y"]) > abs(a0["y"] - b0["y"]) * 1.2
        page.mouse.move(box["x"] + 50, box["y"] + box["height"] - 20)
        page.mouse.down()
        page.mouse.move(box["x"] + 150, box["y"] + box["height"] - 60, steps=5)
        page.mouse.up()
        a2 = canvas.evaluate("c => c.gsNodeCenter(0)")
        assert a2["x"] - a1["x"] == pytest.approx(100, abs=2) and a2["y"] - a1["y"] == pytest.approx(
            -40, abs=2
        )

        # --- strategy toggles: re-run only "loop" ----------------------------------------------
        cw = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".gs-root")
        cw.scroll_into_view_if_needed()
        assert cw.locator(".gs-cmp-row").count() == 2
        assert cw.locator(".gs-cmp-name").all_inner_texts() == ["stacked", "loop"]
        assert _run_cell(page, 5, "SLOW") == {"on": True}
        cw.locator('.gs-toggle[data-name="stacked"]').uncheck()
        cw.locator(".gs-rerun").click()
        # while "loop" runs (3 s), the kernel answers and the page reacts
        page.wait_for_selector('.gs-cmp-status[data-running="1"]', timeout=10_000)
        during = _run_cell(page, 4, "STATE")
        assert during["running"] == ["loop"] and during["reruns"] == 0
        assert cw.locator('.gs-cmp-row[data-name="loop"] td').nth(2).inner_text() == "running…"
        rw.locator(".gs-prev").click()
        assert rw.locator(".gs-steplabel").get_attribute("data-step") == "1"
        page.wait_for_selector('.gs-cmp-status[data-rerun-count="1"]', timeout=30_000)
        assert cw.locator(".gs-cmp-status").inner_text() == "re-runs: 1"
        # the redrawn table keeps the user's toggles
        assert not cw.locator('.gs-toggle[data-name="stacked"]').is_checked()
        assert cw.locator('.gs-toggle[data-name="loop"]').is_checked()
        _shot(page, "lab_04_compare")
        state = _run_cell(page, 4, "STATE")
        assert state["reruns"] == 1 and state["rerun_error"] == "" and state["running"] == []
        assert state["step"] == 1
        assert state["calls"]["stacked"] == 0 and state["calls"]["loop"] >= 1
        assert state["statuses"] == ["ok", "ok"]

        # --- hostile names are text ------------------------------------------------------------
        hw = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".gs-root")
        hw.scroll_into_view_if_needed()
        mods = hw.locator(".gs-module").all_inner_texts()
        for text in HOSTILE:
            if text != "new\nline":
                assert any(m.startswith(text.strip()) for m in mods), (text, mods)
        assert page.locator('img[src="x"]').count() == 0
        _shot(page, "lab_05_hostile")
        assert dialogs == []
        assert not [e for e in errors if "gradscope" in e or "gs-" in e], errors
    except Exception:
        _shot(page, "lab_failure")
        print("status:", page.locator(".gs-cmp-status").all_inner_texts(), "errors:", errors)
        try:
            print("kernel state:", _run_cell(page, 4, "STATE"))
        except Exception as e:  # noqa: BLE001
            print("no kernel state:", e)
        raise
    finally:
        print(
            f"browser test (JupyterLab) took {time.monotonic() - t0:.1f} s; blocked requests: {len(blocked)}"
        )
        ctx.close()


def test_html_page_offline(tmp_path: Path, browser):
    import torch

    import gradscope as gs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with gs.record() as r:
        model(torch.randn(8, 6)).pow(2).mean().backward()
    rec = r.recording
    page_path = tmp_path / "run.html"
    rec.to_html(page_path)
    hostile_path = tmp_path / "hostile.html"
    hostile_recording().to_html(hostile_path)
    layered_path = tmp_path / "layered.html"
    layered_recording(48).to_html(layered_path)

    ctx = browser.new_context(viewport={"width": 1300, "height": 1000})
    page = ctx.new_page()
    requests: list[str] = []
    dialogs: list[str] = []
    errors: list[str] = []

    def route(rt):
        if rt.request.url.startswith("file:"):
            rt.continue_()
        else:
            requests.append(rt.request.url)
            rt.abort()

    page.route("**/*", route)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(page_path.as_uri())
        page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
        graph = page.locator(".gs-graph")
        assert int(graph.get_attribute("data-node-count")) == len(rec.nodes)
        assert int(graph.get_attribute("data-visible-count")) == len(rec.nodes)
        page.wait_for_selector('.gs-timeline[data-ready="1"]', timeout=20_000)
        assert page.locator(".gs-timeline .scatterlayer .trace").count() >= 1
        assert page.locator(".gs-timeline .shapelayer path").count() >= 2  # forward and backward shaded
        # hovering the timeline's peak names the op running then
        peak_i = max(range(len(rec.timeline)), key=lambda i: rec.timeline[i].live)
        page.locator(".gs-timeline").scroll_into_view_if_needed()
        pos = page.evaluate(
            """() => { const gd = document.querySelector('.gs-timeline');
                       const tr = gd.data[1]; const fl = gd._fullLayout; const r = gd.getBoundingClientRect();
                       return { x: r.left + fl._size.l + fl.xaxis.l2p(tr.x[0]),
                                y: r.top + fl._size.t + fl.yaxis.l2p(tr.y[0]) }; }"""
        )
        page.mouse.move(pos["x"], pos["y"])
        page.wait_for_selector(".gs-timeline .hoverlayer .hovertext", timeout=5_000)
        hover = page.locator(".gs-timeline .hoverlayer .hovertext").first.text_content()
        assert rec.timeline[peak_i].label in hover and format_bytes(rec.timeline[peak_i].live) in hover
        _shot(page, "html_01_page")
        # clicking a point of backward jumps the step-through to its step
        target = page.evaluate(
            """() => { const gd = document.querySelector('.gs-timeline'); const tr = gd.data[0];
                       const fl = gd._fullLayout; const r = gd.getBoundingClientRect();
                       const ks = tr.customdata.map((s, i) => [s, i]).filter(([s]) => s !== null && s > 0);
                       const [step, i] = ks[Math.floor(ks.length / 2)];
                       return { step, x: r.left + fl._size.l + fl.xaxis.l2p(tr.x[i]),
                                y: r.top + fl._size.t + fl.yaxis.l2p(tr.y[i]) }; }"""
        )
        page.mouse.click(target["x"], target["y"])
        assert page.locator(".gs-steplabel").get_attribute("data-step") == str(target["step"])
        # step-through works without a kernel
        page.locator(".gs-last").click()
        n = len(rec.steps)
        assert page.locator(".gs-steplabel").get_attribute("data-step") == str(n - 1)
        assert f"step {n}/{n}" in page.locator(".gs-steplabel").inner_text()
        _shot(page, "html_02_last_step")
        # a click shows the node's saved tensors
        by_node = rec.saved_by_node()
        click = max(by_node, key=lambda k: (len(by_node[k]), -k))
        _click_node(page, graph, click)
        assert page.locator(".gs-saved tr[data-saved] td:first-child").all_inner_texts() == [
            s.attribute for s in by_node[click]
        ]

        # a 48-layer model opens collapsed; a module expands on click and collapses again
        page.goto(layered_path.as_uri())
        page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
        g = page.locator(".gs-graph")
        assert g.get_attribute("data-node-count") == "3601"
        assert g.get_attribute("data-visible-count") == "49" and g.get_attribute("data-group-count") == "48"
        pos = g.locator("canvas").evaluate("c => c.gsGroupCenter('layers.1')")
        page.mouse.click(pos["x"], pos["y"])
        assert g.get_attribute("data-visible-count") == str(49 - 1 + 75)
        assert g.get_attribute("data-expanded-count") == "1"
        _shot(page, "html_04_expanded_module")
        pos = g.locator("canvas").evaluate("c => c.gsGroupCenter('layers.1')")  # the frame's header
        page.mouse.click(pos["x"], pos["y"])
        assert g.get_attribute("data-visible-count") == "49" and g.get_attribute("data-expanded-count") == "0"
        # a module in the side list opens its box and shows its largest saver
        item = page.locator(".gs-module").first
        module = item.inner_text().split(":")[0]
        item.click()
        assert g.get_attribute("data-expanded-count") == "1"
        assert page.locator(".gs-node-module").inner_text() == module
        # the find box opens the module holding the match
        page.locator(".gs-find").fill("layers.5.linear1")
        page.locator(".gs-find").press("Enter")
        assert page.locator(".gs-node-module").inner_text() == "layers.5.linear1"
        assert g.get_attribute("data-expanded-count") == "2"
        assert page.locator(".gs-found").inner_text().startswith("1/")
        page.locator(".gs-expand-all").click()
        assert g.get_attribute("data-visible-count") == "3601"

        # hostile texts
        page.goto(hostile_path.as_uri())
        page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
        assert page.locator(".gs-title").inner_text() == f"gradscope · {HOSTILE[1]}"
        mods = page.locator(".gs-module").all_inner_texts()
        assert f"{HOSTILE[0]}: 12 B" in mods
        assert f"{HOSTILE[4]}: 60 B" in mods
        _click_node(page, page.locator(".gs-graph"), 0)
        assert page.locator(".gs-node-module").inner_text() == HOSTILE[0]
        attrs = page.locator(".gs-saved tr[data-saved] td:first-child").all_inner_texts()
        assert attrs[0] == f"attr {HOSTILE[0]}"
        assert attrs[3] == "attr new\nline"
        # the graph's tooltip shows the hostile parameter name as text
        pos = page.locator(".gs-canvas").evaluate("c => c.gsNodeCenter(1)")
        page.mouse.move(pos["x"], pos["y"])
        assert (
            page.locator(".gs-tip").inner_text()
            == f"AccumulateGrad #1\nparameter {HOSTILE[0]}\nmodule {HOSTILE[0]}\n0 saved, 0 B"
        )
        # arrow keys step through backward when the graph has the focus
        page.locator(".gs-canvas").focus()
        page.keyboard.press("ArrowRight")
        assert page.locator(".gs-steplabel").get_attribute("data-step") == "0"
        assert page.locator('img[src="x"]').count() == 0
        _shot(page, "html_03_hostile")
        assert dialogs == [] and requests == [] and errors == []
    finally:
        ctx.close()


def test_comparison_page_offline(tmp_path: Path, browser):
    import torch

    import gradscope as gs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    xs = torch.randn(8, 6)

    def stacked():
        model.zero_grad()
        model(xs).sum().backward()
        return [p.grad for p in model.parameters()]

    def halves():
        model.zero_grad()
        for i in (0, 4):
            model(xs[i : i + 4]).sum().backward()
        return [p.grad for p in model.parameters()]

    cmp = gs.compare({"stacked": stacked, "<i>halves</i>": halves}, reference="stacked", repeat=1)
    path = tmp_path / "cmp.html"
    cmp.to_html(path)
    ctx = browser.new_context(viewport={"width": 1300, "height": 1200})
    page = ctx.new_page()
    requests: list[str] = []
    page.route(
        "**/*",
        lambda rt: (
            rt.continue_()
            if rt.request.url.startswith("file:")
            else (requests.append(rt.request.url), rt.abort())
        ),
    )
    try:
        page.goto(path.as_uri())
        page.wait_for_selector('.gs-cmp-timeline[data-ready="1"]', timeout=20_000)
        assert page.locator(".gs-cmp-name").all_inner_texts() == ["stacked", "<i>halves</i>"]
        statuses = page.locator(".gs-cmp-row").evaluate_all("rs => rs.map(r => r.dataset.status)")
        assert statuses == [r.status for r in cmp.rows]
        peaks = page.locator(".gs-cmp-row td:nth-child(4)").all_inner_texts()
        assert peaks == [format_bytes(r.peak_bytes) for r in cmp.rows]
        # one line per candidate with a recording, overlaid, plus its peak marker
        names = page.evaluate("() => document.querySelector('.gs-cmp-timeline').data.map(t => t.name)")
        assert [n for n in names if n != "peak"] == ["stacked", "&lt;i&gt;halves&lt;/i&gt;"]
        assert page.locator(".gs-cmp-timeline .legendtext").all_text_contents() == [
            "stacked",
            "<i>halves</i>",
        ]
        assert page.locator(".gs-rerun").is_disabled()
        # the candidate's own graph, switchable
        assert page.locator(".gs-candidate-view .gs-graph").get_attribute("data-node-count") == str(
            len(cmp.rows[0].recording.nodes)
        )
        page.locator(".gs-candidate").select_option("<i>halves</i>")
        assert page.locator(".gs-candidate-view .gs-title").inner_text() == "gradscope · <i>halves</i>"
        assert page.locator("i").count() == 0
        _shot(page, "html_05_comparison")
        assert requests == []
    finally:
        ctx.close()
