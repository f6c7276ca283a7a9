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
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _lab import chromium, jupyterlab, notebook, shot
from _recordings import HOSTILE, hostile_recording, layered_recording

import gradscope._views.widget as W
from gradscope.recording import format_bytes

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium"),
    pytest.mark.skipif(not W.bundle_path().exists(), reason="front end not built (cd js && npm run build)"),
]

ROOT = Path(__file__).resolve().parent.parent

playwright_sync = pytest.importorskip("playwright.sync_api")


_shot = shot


@pytest.fixture()
def browser() -> Iterator[object]:
    with chromium() as b:
        yield b


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
# the tour's create_graph recording (seed 000, small), saved for the test to read
_CREATE_GRAPH = r"""
from gradscope.strategies import mixed_grad
G = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())]).eval()
zz, yy = torch.randn(32, 128), torch.randn(32, 128, requires_grad=True)
with gs.record(label="create_graph", modules={"G": G}) as rcg:
    mixed_grad(lambda a, b: ((a + b) ** 3).sum(), G, zz, yy, method="create_graph")
rcg.recording.save("cg.gscope.json")
gs.show(rcg.recording)
"""
_FAST = 'SLOW["on"] = False\nprint("FAST=" + json.dumps(SLOW))'
CELLS = [_SETUP, _WIDGET, _COMPARE, _HOSTILE, _STATE, _SLOW, _SELECT, _CREATE_GRAPH, _FAST]


def _notebook() -> dict:
    return notebook(CELLS)


@pytest.fixture()
def lab(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """A JupyterLab server on 127.0.0.1 with a temp root; stopped (with its kernels) afterwards."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(ROOT / "tests" / "_recordings.py", root / "_recordings.py")
    (root / "widget_test.ipynb").write_text(json.dumps(_notebook()), encoding="utf-8")
    with jupyterlab(tmp_path, root) as (base, token):
        yield base, token, root


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
    base, token, root = lab
    dialogs: list[str] = []
    blocked: list[str] = []
    errors: list[str] = []
    ctx = browser.new_context(viewport={"width": 1000, "height": 1000})
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
            "() => document.querySelectorAll('.gs-root[data-ready=\"1\"]').length >= 4", timeout=180_000
        )
        facts = _facts(page, "FACTS", 0)
        # --- names at first paint, at 1000 px with Lab's file browser open, then at 1600 px ---------
        from gradscope.recording import load

        cg = load(root / "cg.gscope.json")
        page.evaluate("() => window.jupyterapp.shell.expandLeft()")
        cgw = page.locator(".jp-Notebook .jp-Cell").nth(7).locator(".gs-root")
        cgw.locator(".gs-graph").scroll_into_view_if_needed()
        page.wait_for_timeout(500)  # the sidebar's width settles; the untouched view re-fits
        _assert_readable_graph(page, cgw, cg, "lab_graph_1000")
        narrow = _graph_state(cgw.locator(".gs-graph"))
        page.set_viewport_size({"width": 1600, "height": 1000})
        page.wait_for_timeout(800)
        cgw.locator(".gs-graph").scroll_into_view_if_needed()
        _assert_readable_graph(page, cgw, cg, "lab_graph_1600")
        wide = _graph_state(cgw.locator(".gs-graph"))
        # more width never folds further (level 0 is every node, 1 folded by module)
        assert narrow["level"] >= wide["level"], (narrow, wide)
        cgw.locator(".gs-timeline").scroll_into_view_if_needed()
        _assert_timeline(page, cgw, cg)
        _shot(page, "lab_timeline_1600")
        # a step of the create_graph backward that frees nothing says why, in the notebook too
        k = next(i for i, st in enumerate(cg.steps) if st.backward == 0 and st.freed_bytes == 0 and i > 2)
        cgw.locator(".gs-slider").fill(str(k))
        assert cgw.locator(".gs-steplabel").get_attribute("data-step") == str(k)
        assert "create_graph=True, which keeps the graph" in cgw.locator(".gs-step-why").inner_text()
        cgw.locator(".gs-stepper").scroll_into_view_if_needed()
        _shot(page, "lab_step_why_1600")
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
        page.wait_for_selector('.gs-cmp-status[data-rerun-count="1"]', timeout=60_000)
        assert cw.locator(".gs-cmp-status").inner_text() == "re-runs: 1"
        # the redrawn table keeps the user's toggles
        assert not cw.locator('.gs-toggle[data-name="stacked"]').is_checked()
        assert cw.locator('.gs-toggle[data-name="loop"]').is_checked()
        # "stacked" now comes from an older round than "loop": marked stale, left out of the overlay
        stale = cw.locator(".gs-cmp-row").evaluate_all("rs => rs.map(r => [r.dataset.name, r.dataset.stale])")
        assert stale == [["stacked", "1"], ["loop", "0"]]
        assert "stacked" in cw.locator(".gs-cmp-left-out").inner_text()
        drawn = cw.locator(".gs-cmp-timeline").evaluate("d => d.data.map(t => t.name).filter(n => n !== 'peak')")
        assert drawn == ["loop"]
        cw.locator(".gs-cmp-table").scroll_into_view_if_needed()
        _shot(page, "lab_04_compare")
        state = _run_cell(page, 4, "STATE")
        assert state["reruns"] == 1 and state["rerun_error"] == "" and state["running"] == []
        assert state["step"] == 1
        assert state["calls"]["stacked"] == 0 and state["calls"]["loop"] >= 1
        assert state["statuses"] == ["ok", "ok"]
        # re-running the whole set makes it one consistent set again
        assert _run_cell(page, 8, "FAST") == {"on": False}
        cw.locator(".gs-rerun-all").click()
        page.wait_for_selector('.gs-cmp-status[data-rerun-count="2"]', timeout=60_000)
        stale = cw.locator(".gs-cmp-row").evaluate_all("rs => rs.map(r => r.dataset.stale)")
        assert stale == ["0", "0"] and cw.locator(".gs-cmp-left-out").count() == 0
        assert _run_cell(page, 4, "STATE")["calls"]["stacked"] >= 1
        cw.locator(".gs-cmp-table").scroll_into_view_if_needed()
        _shot(page, "lab_06_compare_rerun_all")

        # --- hostile names are text ------------------------------------------------------------
        hw = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".gs-root")
        hw.scroll_into_view_if_needed()
        hg = hw.locator(".gs-graph")
        for i, text in enumerate(HOSTILE):
            drawn = _drawn(hg, i + 1)  # each hostile name is a parameter leaf, drawn as text
            if drawn and drawn["lines"]:
                assert text.endswith(drawn["lines"][0].lstrip("…")), (text, drawn)
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


# ----- checks shared by the notebook and the page ---------------------------------------------
BINARY_TICK = re.compile(r"^(0|0 B|[\d.]+ (B|KiB|MiB|GiB|TiB))$")


def _graph_state(graph) -> dict:
    """What the graph drew at first paint: scale, level, boxes with text, arrowheads."""
    g = graph.evaluate(
        """el => ({ scale: Number(el.dataset.scale), labelled: Number(el.dataset.labelled),
                    arrows: Number(el.dataset.arrows), level: Number(el.dataset.level),
                    visible: Number(el.dataset.visibleCount), depth: el.dataset.depth })"""
    )
    return g


def _drawn(graph, node: int) -> dict | None:
    return graph.locator("canvas").evaluate(f"c => c.gsNodeDrawn({node})")


def _node_detail(rec, node: int) -> str:
    """The second line a node box should show, computed here from the saved tensors."""
    acts = {s.storage: s for s in rec.saved if s.node == node and s.kind.value == "activation"}
    if not acts:
        raise AssertionError("pick a node with a saved activation")
    total = sum(s.bytes for s in acts.values())
    largest = max(acts.values(), key=lambda s: s.bytes)
    return f"{format_bytes(total)} · " + "×".join(str(d) for d in largest.shape)


def _assert_readable_graph(page, root, rec, name: str) -> None:
    """Names at first paint, arrowheads, direction stated, boxes saying what they hold, weights
    out of the heat scale (see issue 10, point 1)."""
    graph = root.locator(".gs-graph")
    st = _graph_state(graph)
    assert st["scale"] >= 0.5, st  # NAMES in lod.js: a node's name fits in its box
    assert st["labelled"] >= 5 and st["arrows"] >= 5, st
    legend = root.locator(".gs-legend-item").evaluate_all("es => es.map(e => e.dataset.key)")
    assert "arrows" in legend
    assert "data flows along them" in root.locator(".gs-legend-arrows").inner_text()
    # every drawn node: its box text equals the recording's own numbers
    shown = 0
    for n in rec.nodes:
        d = _drawn(graph, n.id)
        if not d or len(d["lines"]) < 2:
            continue
        shown += 1
        name_line, detail = d["lines"]
        if n.leaf:
            assert d["fill"] == "#dbeafe", (n, d)  # leaves: their own colour, outside the heat scale
            assert name_line.lstrip("…") and n.leaf.endswith(name_line.lstrip("…")), (n, d)
        else:
            assert name_line.rstrip("…") and n.name.startswith(name_line.rstrip("…")), (n, d)
            acts = [s for s in rec.saved if s.node == n.id and s.kind.value == "activation"]
            if acts and not detail.endswith("…"):
                assert detail == _node_detail(rec, n.id), (n, d)
            if not acts:
                assert d["fill"] == "#eef2f7", (n, d)  # saving only weights: no heat
    if st["depth"] == "":  # every node drawn (folded levels draw module boxes, counted in labelled)
        assert shown >= 5, shown
    _shot(page, name)


def _annotation_boxes(div) -> list[dict]:
    return div.evaluate(
        """d => Array.from(d.querySelectorAll('g.annotation')).map(a => {
                const r = a.getBoundingClientRect();
                return { text: a.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom };
            })"""
    )


def _assert_timeline(page, root, rec) -> None:
    """Stacked by category with a legend of what is present, binary ticks, phase labels that do
    not collide, a peak marker inside the plot, the breakdown at the peak (issue 10, point 2)."""
    tl = root.locator(".gs-timeline").first
    page.wait_for_function("el => el.dataset.ready === '1'", arg=tl.element_handle(), timeout=20_000)
    ticks = tl.locator(".ytick text").all_text_contents()
    assert ticks and all(BINARY_TICK.match(t.replace("\u2212", "-")) for t in ticks), ticks
    svg = tl.locator(".main-svg").first.bounding_box()
    boxes = _annotation_boxes(tl)
    peak = [b for b in boxes if b["text"].startswith("peak")]
    assert len(peak) == 1
    p = peak[0]
    assert svg["x"] <= p["left"] and p["right"] <= svg["x"] + svg["width"], (p, svg)
    assert svg["y"] <= p["top"] and p["bottom"] <= svg["y"] + svg["height"], (p, svg)
    phases = [b for b in boxes if b["text"] in ("forward", "backward", "optimizer", "other")]
    for i, a in enumerate(phases):
        for b in phases[i + 1 :]:
            assert a["right"] <= b["left"] or b["right"] <= a["left"], (a, b)  # never "backwardforward"


# ----- the HTML page ------------------------------------------------------------------------------
def _open(browser, width: int, path: Path):
    ctx = browser.new_context(viewport={"width": width, "height": 1000})
    page = ctx.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.route(
        "**/*",
        lambda rt: rt.continue_() if rt.request.url.startswith("file:") else (requests.append(rt.request.url), rt.abort()),
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (errors.append("dialog " + d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
    return ctx, page, requests, errors


def _categorized_recording():
    """Memory with known categories and all four phases (the recorder does not tag categories
    yet): 4 MiB baseline; forward saves 3 MiB of activations and makes 1 MiB of other; backward
    makes 2 MiB of create_graph saves and 1 MiB of gradients, then frees the activations;
    the optimizer makes 1 MiB of state; 'other' frees the create_graph saves."""
    from gradscope.recording import (
        Category,
        Edge,
        Kind,
        MemoryPoint,
        Node,
        Peak,
        Phase,
        Recording,
        SavedTensor,
        Step,
    )

    M = 1 << 20
    C, P = Category, Phase
    rows = [  # (t, change, category, phase, step)
        (0.00, 1 * M, C.ACTIVATION, P.FORWARD, None),
        (0.01, 1 * M, C.OTHER, P.FORWARD, None),
        (0.02, 2 * M, C.ACTIVATION, P.FORWARD, None),
        (0.03, 2 * M, C.CREATE_GRAPH, P.BACKWARD, 0),
        (0.04, 1 * M, C.GRADIENT, P.BACKWARD, 1),
        (0.05, -3 * M, C.ACTIVATION, P.BACKWARD, 2),
        (0.06, 1 * M, C.OPTIMIZER, P.OPTIMIZER, None),
        (0.07, -2 * M, C.CREATE_GRAPH, P.OTHER, None),
        (0.08, -1 * M, C.OTHER, P.OTHER, None),
    ]
    live, points = 0, []
    for t, d, c, ph, step in rows:
        live += d
        points.append(MemoryPoint(t, live, ph, f"op@{t:.2f}", step=step, category=c))
    nodes = (Node(0, "SumBackward0", executed=1), Node(1, "MulBackward0", module="m", executed=1),
             Node(2, "AccumulateGrad", module="m", leaf="m.weight", leaf_shape=(512, 512), executed=1))
    saved = (SavedTensor(1, "self", (768, 1024), "float32", "cpu", 3 * M, 1, Kind.ACTIVATION, "m", None, 2),)
    steps = tuple(Step(i, i, 0, 0.03 + 0.01 * i, 0.01, None, None, 3 * M if i == 2 else 0) for i in range(3))
    return Recording(
        nodes=nodes, edges=(Edge(1, 0), Edge(2, 1)), saved=saved, steps=steps, timeline=tuple(points),
        peak_bytes=7 * M, baseline_bytes=4 * M, peak=Peak(7 * M, Phase.BACKWARD, 0.04, "op@0.04", node=1, step=1),
        label="categories", backward_passes=1,
    )


@pytest.mark.parametrize("width", [1000, 1600])
def test_memory_by_category_page(tmp_path: Path, browser, width: int):
    rec = _categorized_recording()
    path = tmp_path / "cat.html"
    rec.to_html(path)
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        tl = page.locator(".gs-timeline")
        page.wait_for_selector('.gs-timeline[data-ready="1"]', timeout=20_000)
        tl.scroll_into_view_if_needed()
        M = 1 << 20
        # stacked series = the running sum of each category's changes, written out by hand
        want = {
            "baseline": [4 * M] * 9,
            "activation": [1, 1, 3, 3, 3, 0, 0, 0, 0],
            "create_graph": [0, 0, 0, 2, 2, 2, 2, 0, 0],
            "gradient": [0, 0, 0, 0, 1, 1, 1, 1, 1],
            "optimizer": [0, 0, 0, 0, 0, 0, 1, 1, 1],
            "other": [0, 1, 1, 1, 1, 1, 1, 1, 0],
        }
        got = page.evaluate(
            """() => Object.fromEntries(document.querySelector('.gs-timeline').data
                 .filter(t => t.stackgroup).map(t => [t.meta, Array.from(t.y)]))"""
        )
        assert got == {k: (v if k == "baseline" else [x * M for x in v]) for k, v in want.items()}
        legend = tl.locator(".legendtext").all_text_contents()
        from gradscope.figures import CATEGORY_LABELS

        assert sorted(legend) == sorted(CATEGORY_LABELS[k] for k in want)  # only what is present
        assert tl.get_attribute("data-phases") == "forward,backward,optimizer,other"
        _assert_timeline(page, page.locator(".gs-root"), rec)
        breakdown = page.locator(".gs-peak-breakdown").inner_text()
        assert breakdown == (
            "At the peak (backward, step 2, op@0.04): 7.0 MiB allocated in the block: saved activations 3.0 MiB · "
            "saved by create_graph nodes 2.0 MiB · gradients 1.0 MiB · other (results, temporaries) 1.0 MiB; "
            "on top of 4.0 MiB of parameters and inputs that existed before it."
        )
        # one step numbering: hover, click, slider and text agree (data step 1 = "step 2")
        pos = page.evaluate(
            """() => { const gd = document.querySelector('.gs-timeline');
                       const tr = gd.data.find(t => t.meta === 'total'); const i = tr.customdata.indexOf(1);
                       const fl = gd._fullLayout; const r = gd.getBoundingClientRect();
                       return { x: r.left + fl._size.l + fl.xaxis.l2p(tr.x[i]) - 2,
                                y: r.top + fl._size.t + fl.yaxis.l2p(tr.y[i]) }; }"""
        )
        page.mouse.move(pos["x"], pos["y"])
        page.wait_for_selector(".gs-timeline .hoverlayer .hovertext", timeout=5_000)
        hover = page.locator(".gs-timeline .hoverlayer .hovertext").first.text_content()
        assert "step 2" in hover and "gradients: 1.0 MiB" in hover, hover
        page.mouse.click(pos["x"], pos["y"])
        label = page.locator(".gs-steplabel")
        assert label.get_attribute("data-step") == "1" and label.inner_text().startswith("step 2/3")
        assert page.locator(".gs-slider").input_value() == "1"
        _shot(page, f"page_timeline_{width}")
        # the baseline band can be left out: the stack then starts at 0
        page.locator(".gs-baseline-toggle").uncheck()
        page.wait_for_function(
            "() => !document.querySelector('.gs-timeline').data.some(t => t.meta === 'baseline')"
        )
        assert errors == [] and requests == []
    finally:
        ctx.close()


def _create_graph_recording():
    """The seed-000 problem, small: create_graph through a frozen model (nodes of order 1)."""
    import torch

    import gradscope as gs
    from gradscope.strategies import mixed_grad

    torch.manual_seed(0)
    G = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())]).eval()
    z = torch.randn(32, 128)
    y = torch.randn(32, 128, requires_grad=True)
    with gs.record(memory="cpu", label="create_graph", modules={"G": G}) as r:
        mixed_grad(lambda a, b: ((a + b) ** 3).sum(), G, z, y, method="create_graph")
    return r.recording


@pytest.mark.parametrize("width", [1000, 1600])
def test_create_graph_page_reads_at_first_paint(tmp_path: Path, browser, width: int):
    rec = _create_graph_recording()
    path = tmp_path / "cg.html"
    rec.to_html(path)
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        root = page.locator(".gs-root")
        _assert_readable_graph(page, root, rec, f"page_graph_{width}")
        # legend: order 1 is drawn, order 2 is not
        keys = root.locator(".gs-legend-item").evaluate_all("es => es.map(e => e.dataset.key)")
        assert "order1" in keys and "order2" not in keys
        # "+" zooms towards the drawing, never into empty space: some node stays on screen
        graph = root.locator(".gs-graph")
        for _ in range(4):
            root.locator(".gs-zoom-in").click()
        centers = [graph.locator("canvas").evaluate(f"c => c.gsNodeCenter({n.id})") for n in rec.nodes]
        assert any(c and c["visible"] for c in centers)
        root.locator(".gs-fit").click()
        # the module table: one definition per figure, in the header's tooltip
        from gradscope.figures import ALIVE_AT_PEAK, SAVED_ACTIVATIONS, alive_at_peak_by_module

        heads = root.locator(".gs-modtable th").evaluate_all("es => es.map(e => [e.textContent, e.title])")
        assert [ALIVE_AT_PEAK.label, ALIVE_AT_PEAK.definition] in heads
        assert [SAVED_ACTIVATIONS.label, SAVED_ACTIVATIONS.definition] in heads
        alive = alive_at_peak_by_module(rec)
        first = root.locator(".gs-modtable tr.gs-module").first
        name = first.locator(".gs-module-name").inner_text()
        assert first.locator(".gs-module-alive").inner_text() == format_bytes(alive[name])
        # step-through: a step of the create_graph backward that frees nothing says why
        by_step = [i for i, s in enumerate(rec.steps) if s.backward == 0 and s.freed_bytes == 0]
        assert by_step
        k = by_step[len(by_step) // 2]
        root.locator(".gs-stepper").scroll_into_view_if_needed()
        page.locator(".gs-slider").fill(str(k))
        assert root.locator(".gs-steplabel").get_attribute("data-step") == str(k)
        why = root.locator(".gs-step-why").inner_text()
        assert "create_graph=True, which keeps the graph" in why
        node = rec.nodes[rec.steps[k].node]
        assert root.locator(".gs-side").get_attribute("data-node") == str(node.id)  # the node in context
        if node.module:
            assert f"in {node.module}" in root.locator(".gs-steplabel").inner_text()
        _shot(page, f"page_step_{width}")
        _assert_timeline(page, root, rec)
        assert errors == [] and requests == []
    finally:
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

    ctx, page, requests, errors = _open(browser, 1300, page_path)
    try:
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
                       const tr = gd.data.find(t => t.meta === 'peak'); const fl = gd._fullLayout;
                       const r = gd.getBoundingClientRect();
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
            """() => { const gd = document.querySelector('.gs-timeline');
                       const tr = gd.data.find(t => t.meta === 'total');
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

        # a 48-layer model opens folded: its 48 identical layers are one box of repeated blocks
        # (nested boxes: repeat > layer > submodule); a box expands on click and collapses again
        page.goto(layered_path.as_uri())
        page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
        g = page.locator(".gs-graph")
        assert g.get_attribute("data-node-count") == "3601"
        assert g.get_attribute("data-visible-count") == "2" and g.get_attribute("data-group-count") == str(1 + 48 + 48 * 6)
        assert _graph_state(g)["labelled"] == 2  # the folded box and the loss carry their names at first paint
        pos = g.locator("canvas").evaluate("c => c.gsGroupCenter('layers.0 – layers.47')")
        page.mouse.move(pos["x"], pos["y"])
        assert "folded: click to open" in page.locator(".gs-tip").inner_text()
        page.mouse.click(pos["x"], pos["y"])
        assert g.get_attribute("data-visible-count") == str(2 - 1 + 48)
        pos = g.locator("canvas").evaluate("c => c.gsGroupCenter('layers.1')")
        page.mouse.click(pos["x"], pos["y"])
        assert g.get_attribute("data-visible-count") == str(49 - 1 + 6)  # its six submodules
        assert g.get_attribute("data-expanded-count") == "2"
        # the tooltip under the pointer now says what a click does next, not "click to open"
        pos = g.locator("canvas").evaluate("c => c.gsGroupCenter('layers.1')")  # the frame's header
        page.mouse.move(pos["x"], pos["y"])
        tip = page.locator(".gs-tip").inner_text()
        assert "open: click the header to fold it" in tip and "click to open" not in tip
        _shot(page, "html_04_expanded_module")
        page.mouse.click(pos["x"], pos["y"])
        assert g.get_attribute("data-visible-count") == "49" and g.get_attribute("data-expanded-count") == "1"
        # a module in the side table opens its box (and the boxes around it) and shows its largest saver
        item = page.locator(".gs-module").first
        module = item.locator(".gs-module-name").inner_text()
        item.click()
        assert g.get_attribute("data-expanded-count") == "3"
        assert page.locator(".gs-node-module").inner_text() == module
        # the find box opens the module holding the match
        page.locator(".gs-find").fill("layers.5.linear1")
        page.locator(".gs-find").press("Enter")
        assert page.locator(".gs-node-module").inner_text() == "layers.5.linear1"
        assert g.get_attribute("data-expanded-count") == "5"
        assert page.locator(".gs-found").inner_text().startswith("1/")
        page.locator(".gs-expand-all").click()
        assert g.get_attribute("data-visible-count") == "3601"

        # hostile texts
        page.goto(hostile_path.as_uri())
        page.wait_for_selector('.gs-root[data-ready="1"]', timeout=20_000)
        assert page.locator(".gs-title").inner_text() == f"gradscope · {HOSTILE[1]}"
        _click_node(page, page.locator(".gs-graph"), 0)
        assert page.locator(".gs-node-module").inner_text() == HOSTILE[0]
        attrs = page.locator(".gs-saved tr[data-saved] td:first-child").all_inner_texts()
        assert attrs[0] == f"attr {HOSTILE[0]}"
        assert attrs[3] == "attr new\nline"
        # the graph's tooltip shows the hostile parameter name as text
        pos = page.locator(".gs-canvas").evaluate("c => c.gsNodeCenter(1)")
        page.mouse.move(pos["x"], pos["y"])
        assert page.locator(".gs-tip").inner_text() == (
            f"AccumulateGrad #1\nparameter {HOSTILE[0]} (3): existed before the block\nmodule {HOSTILE[0]}"
        )
        # arrow keys step through backward when the graph has the focus
        page.locator(".gs-canvas").focus()
        page.keyboard.press("ArrowRight")
        assert page.locator(".gs-steplabel").get_attribute("data-step") == "0"
        assert page.locator('img[src="x"]').count() == 0
        _shot(page, "html_03_hostile")
        assert requests == [] and errors == []
    finally:
        ctx.close()


@pytest.mark.parametrize("width", [1000, 1600])
def test_comparison_page_offline(tmp_path: Path, browser, width: int):
    import torch

    import gradscope as gs
    from gradscope.compare import saved_total

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

    cmp = gs.compare({"stacked": stacked, "<i>halves</i>": halves}, reference="stacked", repeat=3)
    path = tmp_path / "cmp.html"
    cmp.to_html(path)
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        page.wait_for_selector('.gs-cmp-timeline[data-ready="1"]', timeout=20_000)
        assert page.locator(".gs-cmp-name").all_inner_texts() == ["stacked", "<i>halves</i>"]
        statuses = page.locator(".gs-cmp-row").evaluate_all("rs => rs.map(r => r.dataset.status)")
        assert statuses == [r.status for r in cmp.rows]
        ref, other = cmp.rows
        assert page.locator(".gs-cmp-peak").all_inner_texts() == [format_bytes(r.peak_bytes) for r in cmp.rows]
        assert page.locator(".gs-cmp-saved").all_inner_texts() == [format_bytes(saved_total(r)) for r in cmp.rows]
        # ratios to the reference, as the text table has them
        assert page.locator(".gs-cmp-peak-ratio").all_inner_texts() == [
            "ref", f"{other.peak_bytes / ref.peak_bytes:.2f}×"
        ]
        assert page.locator(".gs-cmp-time-ratio").all_inner_texts()[1] == f"{other.time_s / ref.time_s:.2f}×"
        # the best value per column is highlighted, among the ok candidates
        best = cmp.best()
        for col, cls in (("peak", ".gs-cmp-peak"), ("saved", ".gs-cmp-saved"), ("time", ".gs-cmp-time")):
            marked = page.locator(f"{cls}.gs-best").evaluate_all("es => es.map(e => e.closest('tr').dataset.name)")
            assert marked == best[col], (col, marked)
        # time with its spread over the repeats
        spread = page.locator(".gs-cmp-spread").first.inner_text()
        assert "–" in spread and spread.split("–")[0]
        assert page.locator(".gs-cmp-threads").inner_text().startswith(f"Timed with {torch.get_num_threads()} torch thread")
        # one line per candidate, overlaid on each run's normalized time
        names = page.evaluate("() => document.querySelector('.gs-cmp-timeline').data.map(t => t.name)")
        assert [n for n in names if n != "peak"] == ["stacked", "&lt;i&gt;halves&lt;/i&gt;"]
        assert page.evaluate("() => document.querySelector('.gs-cmp-timeline')._fullLayout.xaxis.range") == [0, 100]
        assert page.locator(".gs-cmp-timeline .legendtext").all_text_contents() == ["stacked", "<i>halves</i>"]
        ticks = page.locator(".gs-cmp-timeline .ytick text").all_text_contents()
        assert all(BINARY_TICK.match(t) for t in ticks), ticks
        assert page.locator(".gs-rerun").is_disabled() and page.locator(".gs-rerun-all").is_disabled()
        _shot(page, f"page_comparison_{width}")
        page.locator('.gs-xmode[data-mode="ms"]').click()
        page.wait_for_selector('.gs-cmp-timeline[data-ready="1"]', timeout=20_000)
        assert page.evaluate("() => document.querySelector('.gs-cmp-timeline')._fullLayout.xaxis.title.text") == "time (ms)"
        # the candidate's own graph, switchable
        assert page.locator(".gs-candidate-view .gs-graph").get_attribute("data-node-count") == str(
            len(cmp.rows[0].recording.nodes)
        )
        page.locator(".gs-candidate").select_option("<i>halves</i>")
        assert page.locator(".gs-candidate-view .gs-title").inner_text() == "gradscope · <i>halves</i>"
        assert page.locator("i").count() == 0
        assert requests == [] and errors == []
    finally:
        ctx.close()


# ----- CUDA memory snapshots and jobs (issues 14 and 15) --------------------------------------------
def _snapshot_recording():
    """A training loop's snapshot with a side stream, a list keeping validation outputs and an OOM."""
    from _snapshots import training_snapshot

    import gradscope as gs

    return gs.load_snapshot(training_snapshot(steps=14, oom_step=11).snap, label="train.pickle cuda:0")


def _snap_state(root) -> dict:
    return root.evaluate(
        """r => ({
            position: Number(r.querySelector('.gs-snap-label').dataset.position),
            slider: Number(r.querySelector('.gs-snap-slider').value),
            rows: Array.from(r.querySelectorAll('.gs-snap-blocklist tr.gs-snap-block')).map(
                tr => Array.from(tr.children).map(td => td.textContent.trim())),
            head: r.querySelector('.gs-snap-blocks h4').textContent,
            groups: Array.from(r.querySelectorAll('.gs-snap-bygroup tr[data-group]')).map(
                tr => [tr.dataset.group, tr.children[1].textContent]),
            findings: Array.from(r.querySelectorAll('.gs-snap-diagnosis .gs-finding')).map(f => f.dataset.pattern),
            graphs: r.querySelectorAll('.gs-graph').length,
        })"""
    )


def _assert_snapshot_moment(state: dict, d, pos: int, group: str = "line") -> None:
    from gradscope.snapshot import allocation_role, bytes_by_line, bytes_by_role, live_blocks

    live = live_blocks(d, pos)
    assert state["position"] == pos
    assert state["head"] == f"Largest live blocks: {min(20, len(live))} of {len(live)}"
    assert [r[0] for r in state["rows"]] == [format_bytes(a.size) for a in live[:20]]
    assert [r[1].lstrip("▸▾ ") for r in state["rows"]] == [a.label for a in live[:20]]
    assert [r[2] for r in state["rows"]] == [allocation_role(d, a.index).label for a in live[:20]]
    assert [r[4] for r in state["rows"]] == ["never" if a.free_at is None else f"#{a.free_at}" for a in live[:20]]
    named = [g for g in state["groups"] if g[0] != "(other)"]
    if group == "role":  # every role, largest first
        want = sorted(bytes_by_role(d, pos), key=lambda r: (-r.bytes, r.role.label))
        assert named == [[r.role.label, format_bytes(r.bytes)] for r in want]
        return
    assert named == [[r.key, format_bytes(r.bytes)] for r in bytes_by_line(d, pos, group)[: len(named)]]


@pytest.mark.parametrize("width", [1000, 1600])
def test_snapshot_page_offline(tmp_path: Path, browser, width: int):
    """The snapshot view from file:// with the network blocked: the diagnosis first, no graph,
    memory by line with the OOM and the peak, the largest live blocks with their frames at the
    OOM, at the peak, at a slider position and at a click on the plot, grouped by function too.
    Every figure is checked against the snapshot functions."""
    import gradscope as gs
    from gradscope.snapshot import is_user_frame, live_blocks, memory_by_group, snapshot_data

    rec = _snapshot_recording()
    d = snapshot_data(rec)
    path = tmp_path / "snap.html"
    rec.to_html(path)
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]', timeout=20_000)
        root = page.locator(".gs-snapshot")
        s = _snap_state(root)
        assert s["graphs"] == 0  # a snapshot has no graph: none is drawn
        assert s["findings"] == [f.pattern for f in gs.diagnose(rec).findings]
        assert s["findings"][0] == "capacity" and "accumulating" in s["findings"] and len(s["findings"]) <= 5
        _assert_snapshot_moment(s, d, d.oom.at)  # it opens at the OOM
        boxes = _annotation_boxes(page.locator(".gs-snap-timeline"))
        assert [b["text"] for b in boxes if b["text"].startswith("OOM")] == ["OOM: tried to allocate 400.0 MiB"]
        assert [b["text"] for b in boxes if b["text"].startswith("peak")] == [f"peak {format_bytes(d.peak_bytes)}"]
        traces = page.evaluate("() => document.querySelector('.gs-snap-timeline').data.map(t => t.meta)")
        assert traces.count("group") == len(memory_by_group(d).groups) == 5 and "reserved" in traces
        _shot(page, f"snapshot_page_{width}")
        # a block's frames: the user's, those of PyTorch, libraries and C++ folded into a count
        first = root.locator("tr.gs-snap-block").first
        first.click()
        a = live_blocks(d, d.oom.at)[0]
        shown = root.locator(".gs-snap-frames li.gs-snap-frame").all_inner_texts()
        assert shown == [f.label for f in a.frames if is_user_frame(f)] != []
        folded_runs = sum(1 for i, f in enumerate(a.frames)
                          if not is_user_frame(f) and (i == 0 or is_user_frame(a.frames[i - 1])))
        assert root.locator(".gs-snap-frames li.gs-snap-folded").count() == folded_runs
        root.locator(".gs-snap-frames").scroll_into_view_if_needed()
        _shot(page, f"snapshot_frames_{width}")
        # the peak button, then the slider, then a click on the plot
        root.locator(".gs-snap-peak").click()
        _assert_snapshot_moment(_snap_state(root), d, d.peak_at)
        positions = page.evaluate("() => JSON.parse(document.getElementById('gradscope-data').textContent).positions")
        k = len(positions) // 3
        root.locator(".gs-snap-slider").fill(str(k))
        _assert_snapshot_moment(_snap_state(root), d, positions[k])
        k2 = (2 * len(positions)) // 3
        page.locator(".gs-snap-timeline").scroll_into_view_if_needed()
        pos = page.evaluate(
            """(k) => { const gd = document.querySelector('.gs-snap-timeline');
                       const tr = gd.data.find(t => t.meta === 'total'); const fl = gd._fullLayout;
                       const r = gd.getBoundingClientRect();
                       return { x: r.left + fl._size.l + fl.xaxis.l2p(tr.x[k]),
                                y: r.top + fl._size.t + fl.yaxis.l2p(tr.y[k]) }; }""",
            k2,
        )
        page.mouse.click(pos["x"], pos["y"])
        page.wait_for_function(
            "(p) => document.querySelector('.gs-snap-label').dataset.position === String(p)", arg=positions[k2],
            timeout=5_000,
        )
        _assert_snapshot_moment(_snap_state(root), d, positions[k2])
        # by function: the chart and the table regroup
        root.locator(".gs-snap-group").select_option("function")
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]')
        _assert_snapshot_moment(_snap_state(root), d, positions[k2], "function")
        _shot(page, f"snapshot_function_{width}")
        # by role: every role, each in its own color, at every moment
        root.locator(".gs-snap-group").select_option("role")
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]')
        _assert_snapshot_moment(_snap_state(root), d, positions[k2], "role")
        root.locator(".gs-snap-oom").click()
        _assert_snapshot_moment(_snap_state(root), d, d.oom.at, "role")
        from gradscope.snapshot import memory_by_role

        names = page.evaluate("() => document.querySelector('.gs-snap-timeline').data.filter(t => t.meta === 'group')"
                              ".map(t => t.name)")
        assert names == list(memory_by_role(d).groups)
        page.locator(".gs-snap-timeline").scroll_into_view_if_needed()
        _shot(page, f"snapshot_role_{width}")
        assert errors == [] and requests == []
    finally:
        ctx.close()


def test_a_real_gpu_snapshot_by_role(tmp_path: Path, browser):
    """The page of a 2.7B model's AdamW step recorded on a real GPU (tests/data/snapshots): no finding,
    and why; the steps; memory by role: at the peak each role's bytes, in the chart every role."""
    import gradscope as gs
    from gradscope.snapshot import bytes_by_role, memory_by_role, snapshot_data

    rec = gs.load_snapshot(Path(__file__).parent / "data" / "snapshots" / "lm2.7b_ctx128_adamw_step.pickle.gz")
    d, data = gs.diagnose(rec), snapshot_data(rec)
    path = tmp_path / "adamw.html"
    rec.to_html(path)
    ctx, page, requests, errors = _open(browser, 1300, path)
    try:
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]', timeout=30_000)
        root = page.locator(".gs-snapshot")
        assert d.findings == () and root.locator(".gs-finding").count() == 0
        assert root.locator(".gs-snap-none").inner_text() == f"No finding: {d.why_no_finding()}"
        assert root.locator(".gs-snap-steps").inner_text() == f"Steps: {d.steps.how}."
        root.locator(".gs-snap-group").select_option("role")
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]')
        root.locator(".gs-snap-peak").click()
        state = _snap_state(root)
        assert state["position"] == data.peak_at
        want = sorted(bytes_by_role(data, data.peak_at), key=lambda r: (-r.bytes, r.role.label))
        assert state["groups"] == [[r.role.label, format_bytes(r.bytes)] for r in want]
        names = page.evaluate("() => document.querySelector('.gs-snap-timeline').data.filter(t => t.meta === 'group')"
                              ".map(t => t.name)")
        assert names == list(memory_by_role(data).groups) == [
            "existed before the trace", "optimizer state", "gradients", "activations", "temporaries"]
        _shot(page, "snapshot_real_adamw_roles")
        assert errors == [] and requests == []
    finally:
        ctx.close()


_VIEWS_SETUP = r"""
import json, gradscope as gs
from gradscope.snapshot import snapshot_data, live_blocks
from gradscope.widget import payload_of
r = gs.load_snapshot("train.pickle", label="train.pickle cuda:0")
d = snapshot_data(r)
job = gs.load_ranks("pairjob/fsdp/job")
print("FACTS=" + json.dumps({"oom": d.oom.at, "peak": d.peak_at, "positions": payload_of(r)["positions"],
                             "heaviest": gs.job.job_view(job).imbalance.heaviest,
                             "nodes": [len(x.nodes) for x in job.recordings]}))
"""
_VIEWS_STATE = (
    'print("VSTATE=" + json.dumps({"position": w.position, "group": w.group, "rank": jw.selected_rank, '
    '"align": jw.align, "top": [a.size for a in w.live_blocks(limit=3)], '
    '"want": [a.size for a in live_blocks(d, w.position, 3)]}))'
)
_VIEWS_CELLS = [_VIEWS_SETUP, "w = gs.show(r)\nw", "jw = gs.show(job)\njw", _VIEWS_STATE,
                'w.position = d.peak_at\nprint("SET=" + json.dumps({"position": w.position}))']


def test_snapshot_and_job_widgets_in_jupyterlab(lab, browser, tmp_path: Path):
    """A CUDA snapshot and a real gathered two-rank FSDP job (gloo, started here) as widgets in
    JupyterLab: the kernel follows the moment, the grouping, the rank and the alignment picked in the
    browser, and a moment set from Python shows; screenshots at 1000 and 1600 px."""
    from _jobs import run_pair
    from _snapshots import training_snapshot, write

    base, token, root = lab
    write(root / "train.pickle", training_snapshot(steps=14, oom_step=11).snap)
    run_pair(root / "pairjob")
    nb = _notebook()
    nb["cells"] = [{**nb["cells"][0], "id": f"v{i}", "source": src} for i, src in enumerate(_VIEWS_CELLS)]
    (root / "views_test.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    errors: list[str] = []
    blocked: list[str] = []
    ctx = browser.new_context(viewport={"width": 1000, "height": 1000})
    page = ctx.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else (blocked.append(r.request.url),
                                                                                       r.abort()))
    try:
        page.goto(f"{base}/lab/tree/views_test.ipynb?token={token}")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
            "window.jupyterapp.shell.currentWidget.sessionContext && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=60_000,
        )
        facts = _run_cell(page, 0, "FACTS")
        for i in (1, 2):  # the two widgets
            page.evaluate(
                """async (i) => { const nb = window.jupyterapp.shell.currentWidget.content;
                    nb.activeCellIndex = i; await window.jupyterapp.commands.execute('notebook:run-cell'); }""", i)
        page.wait_for_selector('.gs-snap-timeline[data-ready="1"]', timeout=120_000)
        page.wait_for_selector('.gs-job-timeline[data-ready="1"]', timeout=120_000)
        snap = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".gs-snapshot")
        jobw = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".gs-jobview")
        assert snap.locator(".gs-snap-label").get_attribute("data-position") == str(facts["oom"])
        state = _run_cell(page, 3, "VSTATE")
        assert state["position"] == facts["oom"] and state["top"] == state["want"] and state["group"] == "line"
        assert state["rank"] == facts["heaviest"] and state["align"] == "normalized"  # the heaviest rank opens
        snap.scroll_into_view_if_needed()
        _shot(page, "lab_snapshot_1000")
        # pick a moment with the slider, regroup by file: the kernel follows
        k = len(facts["positions"]) // 2
        snap.locator(".gs-snap-slider").fill(str(k))
        snap.locator(".gs-snap-group").select_option("file")
        # the browser's changes reach the kernel as comm messages, handled between cell runs: a run
        # may come first, so the kernel is asked again until both changes arrived (or 20 runs)
        for _ in range(20):
            state = _run_cell(page, 3, "VSTATE")
            if state["position"] == facts["positions"][k] and state["group"] == "file":
                break
            page.wait_for_timeout(250)
        assert state["position"] == facts["positions"][k] and state["group"] == "file"
        assert state["top"] == state["want"]  # the kernel answers for that moment exactly
        # a moment set from Python shows in the view
        assert _run_cell(page, 4, "SET")["position"] == facts["peak"]
        page.wait_for_function(
            "(p) => document.querySelectorAll('.gs-snap-label')[0].dataset.position === String(p)",
            arg=facts["peak"], timeout=10_000,
        )
        # the job: pick the other rank and align by phase
        other = 1 - facts["heaviest"]
        jobw.scroll_into_view_if_needed()
        jobw.locator(f'tr.gs-job-row[data-rank="{other}"]').click()
        page.wait_for_selector(f'.gs-job-rankview[data-rank="{other}"] .gs-graph[data-node-count]', timeout=30_000)
        assert int(jobw.locator(".gs-job-rankview .gs-graph").get_attribute("data-node-count")) == facts["nodes"][other]
        jobw.locator('.gs-job-align[data-mode="phase"]').click()
        page.wait_for_selector('.gs-jobview[data-align="phase"] .gs-job-timeline[data-ready="1"]', timeout=30_000)
        state = _run_cell(page, 3, "VSTATE")
        assert state["rank"] == other and state["align"] == "phase"
        jobw.locator(".gs-job-table").scroll_into_view_if_needed()  # the job's own panels, not the rank's graph
        _shot(page, "lab_job_1000")
        page.set_viewport_size({"width": 1600, "height": 1000})
        page.wait_for_timeout(800)
        snap.locator(".gs-snap-timeline").scroll_into_view_if_needed()
        _shot(page, "lab_snapshot_1600")
        jobw.locator(".gs-job-table").scroll_into_view_if_needed()
        _shot(page, "lab_job_1600")
        assert errors == [] and blocked == []
    finally:
        ctx.close()


_BUDGET_SETUP = r"""
%load_ext gradscope
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 500, (8, 32))
print("READY=1")
"""
_BUDGET_CELL = """%%gradscope --budget 4MiB
out = model(input_ids=ids, labels=ids)
out.loss.backward()
opt.step()
opt.zero_grad()"""


def test_a_cell_over_budget_in_jupyterlab_shows_diagnosis_trimmed_traceback_and_widget(lab, browser):
    """The budget flow as a user meets it in JupyterLab: a GPT-2 step from transformers that does not
    fit a simulated 4 MiB device shows, in its cell's output, the widget (shown as the cell started,
    the partial recording's, drawn), then the diagnosis (with a fix that fits, run on copies), then
    the traceback trimmed to the cell's frames (torch and transformers folded into one line)."""
    pytest.importorskip("transformers")
    base, token, root = lab
    nb = _notebook()
    nb["cells"] = [{**nb["cells"][0], "id": f"b{i}", "source": src} for i, src in enumerate([_BUDGET_SETUP, _BUDGET_CELL])]
    (root / "budget_test.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    errors: list[str] = []
    ctx = browser.new_context(viewport={"width": 1000, "height": 1000})
    page = ctx.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{base}/lab/tree/budget_test.ipynb?token={token}")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
            "window.jupyterapp.shell.currentWidget.sessionContext && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session && "
            "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=180_000,  # a kernel's first start on a loaded machine
        )
        page.evaluate(
            """async () => { const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = 0; await window.jupyterapp.commands.execute('notebook:run-cell'); }""")
        # the setup's output: transformers and the extension may print before READY
        page.wait_for_function(
            "() => window.jupyterapp.shell.currentWidget.content.widgets[0].node.innerText.includes('READY=1')",
            timeout=180_000,
        )
        page.evaluate(
            """async () => { const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = 1; await window.jupyterapp.commands.execute('notebook:run-cell'); }""")
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        cell.locator('.gs-graph[data-node-count]').wait_for(timeout=180_000)
        outputs = cell.locator(".jp-OutputArea-child")
        texts = outputs.evaluate_all("os => os.map(o => ({text: o.innerText, widget: !!o.querySelector('.gs-root')}))")
        diag = next(i for i, o in enumerate(texts) if "gradscope diagnosis" in o["text"])
        tb = next(i for i, o in enumerate(texts)
                  if not o["widget"] and ("OutOfMemoryError" in o["text"] or "MemoryBudgetExceeded" in o["text"]))
        widget = next(i for i, o in enumerate(texts) if o["widget"])
        # the widget shows as the cell starts (see NOTE [ a live loop ] in gradscope._views.widget): above the
        # diagnosis and the traceback, the partial recording's once the cell failed
        assert widget < diag <= tb, [(o["text"][:60], o["widget"]) for o in texts]
        d, t = texts[diag]["text"], texts[tb]["text"]
        assert ", fits the " in d and "code:" in d  # a fix that fits, run on copies
        assert "frames in" in t and "torch" in t  # the library frames folded into one line
        assert "out = model(input_ids=ids, labels=ids)" in t  # the cell's own line
        # the traceback names the cell by the number JupyterLab shows for it (NOTE [ the recorded cell
        # keeps its number ] in gradscope._notebook.cells): "Cell In[2]" beside the prompt [2]
        shown = re.search(r"\[(\d+)\]", cell.locator(".jp-InputArea-prompt").inner_text())
        assert shown is not None and re.findall(r"Cell In\[(\d+)\]", t) == [shown.group(1)], t
        assert "site-packages/transformers" not in t and "site-packages/torch" not in t
        # the fixes ran on copies without a word to the user's output (transformers logs "use_cache=True
        # is incompatible with gradient checkpointing" when one enables checkpointing)
        assert not any("gradient checkpointing" in o["text"] for o in texts)
        assert int(cell.locator(".gs-graph").get_attribute("data-node-count")) > 100
        cell.scroll_into_view_if_needed()
        _shot(page, "lab_budget_oom_1000")
        assert errors == []
    finally:
        ctx.close()
