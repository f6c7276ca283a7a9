"""Transformers' folded graphs in a real browser (issue 30, point 3): GPT-2, BERT and ViT (tiny
configs from ``transformers``, random init) drawn by the widget's code on the self-contained
page, at 1000 and 1600 px. Asserted from what the canvas drew: nested module boxes, the four
blocks folded as one repeat box, labels shortened from the box around them (never cut from the
left), forward-down order. Screenshots go to test-artifacts/models_<model>_<width>*.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_browser import _open, _shot, browser  # noqa: F401  (browser is a fixture)
from test_layout import _tiny_transformer

import gradscope.widget as W

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
