"""A ``%%gradscope`` cell that trains for many steps, in a real JupyterLab in Chromium: the widget
shows as the cell starts and its per-iteration memory chart grows while the loop runs (see NOTE [ a
live loop ] in gradscope._views.widget), at least once a second; when the cell ends the recording replaces
it, its chart holding every iteration. Screenshots (while running, and after) go to test-artifacts/."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from _lab import ROOT, chromium, jupyterlab, notebook, open_notebook, shot

import gradscope._views.widget as W

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium"),
    pytest.mark.skipif(not W.bundle_path().exists(), reason="front end not built (cd js && npm run build)"),
]
pytest.importorskip("playwright.sync_api")

STEPS = 120
_SETUP = r"""
%load_ext gradscope
import time, torch
from _loops import make_classifier
train = make_classifier("output")  # keeps each output: memory grows by 640 B an iteration
"""
# each iteration sleeps 40 ms (a slow step): the cell runs ~5 s
_LOOP = f"""%%gradscope --memory tracker
for i in range({STEPS}):
    train(1)
    time.sleep(0.04)
"""


@pytest.fixture()
def lab(tmp_path: Path) -> Iterator[tuple[str, str]]:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(ROOT / "tests" / "_loops.py", root / "_loops.py")
    (root / "live.ipynb").write_text(json.dumps(notebook([_SETUP, _LOOP])), encoding="utf-8")
    with jupyterlab(tmp_path, root) as (base, token):
        yield base, token


def test_the_chart_grows_while_the_cell_runs(lab: tuple[str, str]) -> None:
    base, token = lab
    errors: list[str] = []
    with chromium() as browser:
        page = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        open_notebook(page, base, token, "live.ipynb")
        page.evaluate(
            """async () => {
                const p = window.jupyterapp.shell.currentWidget;
                await p.sessionContext.ready;
                const nb = p.content;
                nb.activeCellIndex = 0;
                await window.jupyterapp.commands.execute('notebook:run-cell');
            }""")
        page.wait_for_function(
            "() => window.jupyterapp.shell.currentWidget.content.widgets[0].model.executionCount > 0", timeout=60_000)
        # every change of the chart's iteration count, with the time the page saw it
        page.evaluate(
            """() => {
                window.gsSeen = [];
                const obs = new MutationObserver(() => {
                    const el = document.querySelector('.gs-live .gs-loop');
                    if (el) window.gsSeen.push([performance.now(), Number(el.dataset.count), Number(el.dataset.points)]);
                });
                obs.observe(document.body, {subtree: true, attributes: true, childList: true,
                                            attributeFilter: ['data-count', 'data-points']});
                const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = 1;
                window.gsStart = performance.now();
                window.jupyterapp.commands.execute('notebook:run-cell');
            }""")
        page.wait_for_selector(".gs-live .gs-loop", timeout=60_000)
        page.wait_for_function("() => Number(document.querySelector('.gs-live .gs-loop').dataset.count) >= 30",
                               timeout=60_000)
        running = page.evaluate("() => !!document.querySelector('.gs-live')")
        status = page.locator(".gs-live .gs-loop-status").inner_text()
        shot(page, "live_loop_running")
        assert running and status.startswith("running:"), status
        assert page.locator(".gs-live .gs-loop-peak").count() == 1  # the peak's line is drawn
        # the recording replaces the live view when the cell ends
        page.wait_for_function(
            "() => !document.querySelector('.gs-live') && document.querySelector('.gs-root[data-kind=\"recording\"] .gs-loop')",
            timeout=120_000)
        shot(page, "live_loop_done")
        seen = page.evaluate("() => window.gsSeen")
        final = page.locator(".gs-root[data-kind='recording'] .gs-loop")
        assert final.get_attribute("data-count") == str(STEPS)
        assert "gs-loop-grows" in final.inner_html()  # the outputs kept each iteration are named
    assert errors == []
    # updates while it ran: the count rose at least once a second between the first and the last
    counts = [(t, c) for t, c, _ in seen if c > 0]
    assert counts and counts[-1][1] >= STEPS - 20
    changes = [t for (t, c), (_, p) in zip(counts[1:], counts, strict=False) if c > p]
    span_s = (changes[-1] - changes[0]) / 1000
    gaps = [(b - a) / 1000 for a, b in zip(changes, changes[1:], strict=False)]
    assert span_s > 2 and max(gaps) <= 1.0, (span_s, gaps)
