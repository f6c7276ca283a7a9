"""Transformers' folded graphs in a real browser (issue 30, point 3): GPT-2, BERT and ViT (tiny
configs from ``transformers``, random init) drawn by the widget's code on the self-contained
page, at 1000 and 1600 px. Asserted from what the canvas drew: nested module boxes, the four
blocks folded as one repeat box, labels shortened from the box around them (never cut from the
left), forward-down order. Screenshots go to test-artifacts/models_<model>_<width>*.png.

The pages as a pip-only install makes them (no Graphviz ``dot`` on PATH, NOTE [ layout engine
thresholds ] in gradscope._views.layout): the same page as with dot; the first screen of a 1000 x 800
window shows the whole folded model with its loss (NOTE [ the graph takes the window's height ] in
js/src/app.js); *Fit* and *Whole graph* do what they say, folded and with every node shown.
Screenshots: test-artifacts/layout_<model>_<width>_<state>.png.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_browser import _open, _shot, browser  # noqa: F401  (browser is a fixture)
from test_layout import _tiny_transformer

import gradscope._views.widget as W

NAMES = 0.5  # js/src/lod.js: the least scale at which a box's name is drawn

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium"),
    pytest.mark.skipif(not W.bundle_path().exists(), reason="front end not built (cd js && npm run build)"),
]


def _boxes(graph) -> list[dict]:
    return graph.locator("canvas").evaluate("c => c.gsBoxes()")


def _contains(outer: dict, inner: dict) -> bool:
    return (outer["left"] - 0.5 <= inner["left"] and inner["right"] <= outer["right"] + 0.5
            and outer["top"] - 0.5 <= inner["top"] and inner["bottom"] <= outer["bottom"] + 0.5)


def _open_box(page, graph, key: str) -> None:
    """Click a folded box (brought on screen first) and wait for it to become a frame."""
    box = next(b for b in _boxes(graph) if b["key"] == key)
    assert box["kind"] == "group", box
    pos = graph.locator("canvas").evaluate(f"c => c.gsGroupCenter({key!r})")
    assert pos["visible"], pos
    page.mouse.click(pos["x"], pos["y"])
    assert next(b for b in _boxes(graph) if b["key"] == key)["kind"] == "frame"


@pytest.mark.parametrize("width", [1000, 1600])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit"])
def test_transformer_graph_reads_folded(tmp_path: Path, browser, kind: str, width: int):  # noqa: F811
    rec, embeddings, blocks_path = _tiny_transformer(kind)
    name = blocks_path.rsplit(".", 1)[1]
    path = tmp_path / f"{kind}.html"
    rec.to_html(path)
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        root = page.locator(".gs-root")
        graph = root.locator(".gs-graph")
        levels = root.locator(".gs-level option").count()
        if levels > 1 and graph.get_attribute("data-level") != str(levels - 1):
            root.locator(".gs-level").select_option(str(levels - 1))  # the folded level
        _shot(page, f"models_{kind}_{width}")
        boxes = _boxes(graph)
        groups = [b for b in boxes if b["kind"] != "node"]
        assert groups
        # first paint: the model's body is open, its blocks folded as one repeat box
        rep = [b for b in groups if b["repeat"] > 1]
        assert len(rep) == 1 and rep[0]["kind"] == "group", rep
        assert rep[0]["lines"] and rep[0]["lines"][0] == f"▸ {name}.0 – {name}.3 (×4)", rep[0]
        assert any(b["kind"] == "frame" for b in groups)
        # open the repeat box, then its last block: the blocks' boxes hold their submodules' boxes
        _open_box(page, graph, rep[0]["key"])
        last = f"{blocks_path}.3"
        _open_box(page, graph, last)
        boxes = _boxes(graph)
        by_key = {b["key"]: b for b in boxes if b["key"]}
        block = by_key[last]
        inside = [b for b in boxes if b["kind"] != "node" and b["parent"] == block["id"]]
        assert len(inside) >= 2
        for b in inside:
            assert _contains(block, b), (block, b)
            assert b["key"].startswith(last + ".") and b["label"] == b["key"][len(last) + 1:]
        assert _contains(by_key[rep[0]["key"]], block)
        # forward-down: the embeddings above the first and the last block
        for e in embeddings:
            assert by_key[e]["bottom"] <= by_key[f"{blocks_path}.0"]["top"] < block["top"], (by_key[e], block)
        # no drawn text is cut from the left or mid-word with room to spare
        for b in _boxes(graph):
            for line in b["lines"]:
                assert not line.startswith("…") and not line.startswith("▸ …") and not line.startswith("▾ …"), b
            if b["kind"] == "frame" and b["lines"] and b["right"] - b["left"] > 300:
                assert "…" not in b["lines"][0], b
        page.mouse.move(0, 0)  # no tooltip over the picture
        _shot(page, f"models_{kind}_{width}_open")
        assert errors == [] and requests == []
    finally:
        ctx.close()


# ----------------------------------------------------------------------------- Fit, Whole graph
def _inside(b: dict, r: dict) -> bool:
    return r["left"] - 0.5 <= b["left"] and b["right"] <= r["right"] + 0.5 and r["top"] - 0.5 <= b["top"] and b["bottom"] <= r["bottom"] + 0.5


def _canvas(graph) -> dict:
    box = graph.locator("canvas").bounding_box()
    return {"left": box["x"], "top": box["y"], "right": box["x"] + box["width"], "bottom": box["y"] + box["height"]}


def check_fit_and_whole(page, root, name: str) -> dict:
    """Click *Fit*, then *Whole graph*, asserting each does what its title says, with a screenshot
    after each (``<name>_fit``, ``<name>_whole``); returns what *Whole graph* gave."""
    graph = root.locator(".gs-graph")
    canvas = graph.locator("canvas")
    root.locator(".gs-fit").click()
    scale = float(graph.get_attribute("data-scale"))
    boxes, r = _boxes(graph), _canvas(graph)
    # Fit: the whole graph where names can be read, else its top with names
    assert scale >= NAMES - 1e-6 and int(graph.get_attribute("data-labelled")) > 0, (name, scale)
    if not all(_inside(b, r) for b in boxes):
        top = min(boxes, key=lambda b: b["top"])
        assert top["top"] >= r["top"] - 0.5 and top["top"] <= r["top"] + 40, (name, top, r)
    page.mouse.move(0, 0)
    _shot(page, f"{name}_fit")
    root.locator(".gs-fit-all").click()
    boxes, r = _boxes(graph), _canvas(graph)
    view = canvas.evaluate("c => c.gsView()")
    # Whole graph: every box on the canvas, at the largest scale that shows them all (to within
    # the margin); where names cannot be read at it, a note says so, why, and what would show them
    assert all(_inside(b, r) for b in boxes), name
    width = max(b["right"] for b in boxes) - min(b["left"] for b in boxes)
    height = max(b["bottom"] for b in boxes) - min(b["top"] for b in boxes)
    assert width >= r["right"] - r["left"] - 60 or height >= r["bottom"] - r["top"] - 60 or view["scale"] >= 1.2 - 1e-6
    note = graph.locator(".gs-graph-note")
    legible = view["scale"] >= NAMES - 1e-6
    assert graph.get_attribute("data-whole") == ("names" if legible else "too-small")
    if legible:
        assert note.count() == 0 or not note.is_visible()
        assert int(graph.get_attribute("data-labelled")) > 0
    else:
        text = note.inner_text()
        pct = re.search(r"shown at (\d+)% of their size: too small for names", text)
        assert pct and int(pct.group(1)) == max(1, round(view["scale"] * 100)), text
        assert "Fit shows it from the top with names" in text
    page.mouse.move(0, 0)
    _shot(page, f"{name}_whole")
    if not legible:  # the note goes with the next view
        root.locator(".gs-fit").click()
        assert not note.is_visible()
    return {"scale": view["scale"], "legible": legible}


@pytest.mark.parametrize("width", [1000, 1600])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit"])
def test_transformer_pages_read_without_dot(tmp_path: Path, browser, kind: str, width: int,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch):
    rec = _tiny_transformer(kind)[0]
    with_dot = tmp_path / "with_dot.html"
    rec.to_html(with_dot)
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))  # what pip install leaves: no dot
    path = tmp_path / f"{kind}.html"
    rec.to_html(path)
    monkeypatch.undo()
    data = re.compile(r'<script type="application/json" id="gradscope-data">(.*?)</script>', re.S)
    assert json.loads(data.search(path.read_text()).group(1)) == json.loads(data.search(with_dot.read_text()).group(1))
    height = 800 if width == 1000 else 900
    ctx, page, requests, errors = _open(browser, width, path)
    try:
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_timeout(100)
        root = page.locator(".gs-root")
        graph = root.locator(".gs-graph")
        canvas = graph.locator("canvas")
        # the first screen: the whole folded model, its loss (node 0) drawn with its name above the
        # window's bottom, the step controls below the graph in sight too
        loss = canvas.evaluate("c => c.gsNodeCenter(0)")
        assert loss["visible"] and loss["y"] < height, loss
        holder = min((b for b in _boxes(graph) if b["left"] <= loss["x"] <= b["right"] and b["top"] <= loss["y"] <= b["bottom"]),
                     key=lambda b: (b["right"] - b["left"]) * (b["bottom"] - b["top"]))  # the loss's box, or its module's
        assert holder["lines"] and re.match(r"(NllLoss|▸ CrossEntropyLoss)", holder["lines"][0]), holder
        assert all(_inside(b, _canvas(graph)) for b in _boxes(graph))  # nothing clipped at any edge
        stepbar = root.locator(".gs-stepbar").bounding_box()
        assert stepbar["y"] + stepbar["height"] <= height, stepbar
        page.mouse.move(0, 0)
        _shot(page, f"layout_{kind}_{width}_first")
        levels = root.locator(".gs-level option").count()
        for level in range(max(levels, 1)):
            if levels > 1:
                root.locator(".gs-level").select_option(str(level))
            depth = graph.get_attribute("data-depth")
            check_fit_and_whole(page, root, f"layout_{kind}_{width}_{'every_node' if depth == '' else 'folded'}")
        if root.locator(".gs-expand-all").is_visible():  # every node, by opening every module
            root.locator(".gs-expand-all").click()
            assert int(graph.get_attribute("data-expanded-count")) == int(graph.get_attribute("data-group-count"))
            whole = check_fit_and_whole(page, root, f"layout_{kind}_{width}_all_open")
            assert not whole["legible"]  # a model's every node is taller than any window: said so
        assert errors == [] and requests == []
    finally:
        ctx.close()
