"""Widget benchmarks: layout + first paint of a 20,000-node graph, and the widget state of a
48-layer TransformerEncoder recording.

Targets: page load to first paint at most 1.5 s at 20,000 nodes, layout plus first paint at most
3 s (painted in headless Chromium); names legible at first paint; widget state at most 2 MB for the
48-layer encoder. Prints the figures; asserts nothing.

    python benchmarks/bench_widget.py              # everything
    python benchmarks/bench_widget.py --synthetic  # a synthesized ~3,600-node encoder-sized
                                                   # recording instead of recording a real one
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _recordings import layered_recording  # noqa: E402

from gradscope.html import page_html  # noqa: E402
from gradscope.layout import layout_recording  # noqa: E402
from gradscope.recording import Recording, format_bytes  # noqa: E402
from gradscope.widget import bundle_text, loader_text, payload_json, recording_payload  # noqa: E402

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _paint(browser, html_path: Path, expand_all: bool) -> dict[str, float]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
    page.goto(html_path.as_uri())
    page.wait_for_selector(".gs-graph[data-first-paint-ms]", timeout=60_000)
    first = float(page.get_attribute(".gs-graph", "data-first-paint-ms"))
    out = {
        "first_paint_ms": first,
        "boxes": float(page.get_attribute(".gs-graph", "data-visible-count")),
        "labelled": float(page.get_attribute(".gs-graph", "data-labelled")),
        "scale": float(page.get_attribute(".gs-graph", "data-scale")),
    }
    if expand_all:
        ms = page.evaluate(
            """() => new Promise((done) => {
                const t0 = performance.now();
                document.querySelector('.gs-expand-all').click();
                requestAnimationFrame(() => requestAnimationFrame(() => done(performance.now() - t0)));
            })"""
        )
        out["expand_all_ms"] = float(ms)
        out["boxes_expanded"] = float(page.get_attribute(".gs-graph", "data-visible-count"))
        # one redraw after a pan, the cost of each interaction frame
        out["redraw_ms"] = float(
            page.evaluate(
                """() => { const c = document.querySelector('.gs-canvas');
                    const t0 = performance.now();
                    c.dispatchEvent(new WheelEvent('wheel', {deltaY: -100, clientX: 300, clientY: 300}));
                    return performance.now() - t0; }"""
            )
        )
    page.close()
    return out


def bench_20k(browser) -> None:
    rec = layered_recording(267)
    print(f"== 20,000-node graph: {len(rec.nodes)} nodes, {len(rec.edges)} edges")
    with tempfile.TemporaryDirectory() as d:
        for mode, collapse in (("collapsed by module (default)", "auto"), ("every node drawn", False)):
            t0 = time.perf_counter()
            lay = layout_recording(rec, collapse=collapse)
            t_layout = time.perf_counter() - t0
            t0 = time.perf_counter()
            payload = recording_payload(rec, layout=lay)
            page = page_html(payload, "bench")
            t_page = time.perf_counter() - t0
            path = Path(d) / "bench.html"
            path.write_text(page, encoding="utf-8")
            paint = _paint(browser, path, expand_all=collapse == "auto")
            total = t_layout + t_page + paint["first_paint_ms"] / 1e3
            print(
                f"  {mode}: layout {t_layout:.2f} s ({lay.engine}, {lay.visible_count} boxes) + payload/page "
                f"{t_page:.2f} s + page load to first paint {paint['first_paint_ms'] / 1e3:.2f} s (target <= 1.5 s) "
                f"= {total:.2f} s (target <= 3 s); first view at scale {paint['scale']:.2f} with "
                f"{int(paint['labelled'])} boxes named"
            )
            if "expand_all_ms" in paint:
                print(
                    f"    expand all {int(paint['boxes_expanded'])} boxes in the browser: "
                    f"{paint['expand_all_ms'] / 1e3:.2f} s; one zoom redraw {paint['redraw_ms']:.0f} ms"
                )


def _encoder_recording(synthetic: bool) -> Recording:
    if synthetic:
        return layered_recording(48)
    import torch

    import gradscope as gs

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, num_layers=48, enable_nested_tensor=False)
    x = torch.randn(2, 16, 64)
    with gs.record() as r:
        enc(x).pow(2).mean().backward()
    return r.recording


def bench_encoder(synthetic: bool) -> None:
    t0 = time.perf_counter()
    rec = _encoder_recording(synthetic)
    t_rec = time.perf_counter() - t0
    kind = "synthesized" if synthetic else "recorded"
    print(
        f"== 48-layer TransformerEncoder ({kind} in {t_rec:.1f} s): {len(rec.nodes)} nodes, "
        f"{len(rec.saved)} saved tensors, {len(rec.timeline)} timeline points"
    )
    t0 = time.perf_counter()
    data = payload_json(rec)
    t_payload = time.perf_counter() - t0
    lay = layout_recording(rec)
    size = len(data.encode())
    esm = len(loader_text().encode())
    print(
        f"  widget data trait: {size:,} bytes ({format_bytes(size)}; target <= 2 MB), built in "
        f"{t_payload:.2f} s; opens as {lay.visible_count} boxes ({len(lay.groups)} modules at depth {lay.depth})"
    )
    print(f"  plus the widget's own module (the loader) {esm:,} bytes; together {size + esm:,} bytes (the front end, "
          f"{len(bundle_text().encode()):,} bytes, is loaded once per page)")
    print(f"  the recording's own JSON file: {len(json.dumps(rec.to_dict()).encode()):,} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", action="store_true", help="synthesize the encoder recording")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            bench_20k(browser)
        finally:
            browser.close()
    bench_encoder(args.synthetic)


if __name__ == "__main__":
    main()
