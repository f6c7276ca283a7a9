"""A large CUDA memory snapshot in the browser: the payload's size, the time to build it, and the
page's load time in headless Chromium, at several trace lengths (1 M events included).

The snapshots are the synthetic training loops of ``bench_snapshot.py`` (the format
``torch.cuda.memory._dump_snapshot`` writes, ~40 allocations a step with 18-frame stacks, a leak,
an OOM). For each size: ``gs.load_snapshot`` (for reference), the widget's data (``payload_json``,
what the notebook sends and the page inlines) built and measured, ``to_html`` written, and the page
opened from file:// with the network blocked, ``--repeat`` times in fresh pages, the sizes
interleaved: the time from navigation to the memory chart drawn (``.gs-snap-timeline[data-ready]``),
then one moment picked with the slider (the panels redrawn). Medians. Prints; asserts nothing.

    python benchmarks/bench_snapshot_view.py [--events 250000,1000000] [--repeat 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_snapshot import write_snapshot  # noqa: E402

import gradscope as gs  # noqa: E402
from gradscope.recording import format_bytes  # noqa: E402
from gradscope.snapshot import snapshot_data  # noqa: E402
from gradscope.widget import bundle_text, payload_json  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _open(browser, path: Path, width: int) -> dict[str, float]:
    page = browser.new_page(viewport={"width": width, "height": 1000})
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
    t0 = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_selector(".gs-snap-timeline[data-ready]", timeout=120_000)
    load = time.perf_counter() - t0
    ms = page.evaluate(
        """() => { const s = document.querySelector('.gs-snap-slider'); const t0 = performance.now();
                   s.value = String(Math.floor(Number(s.max) / 2)); s.dispatchEvent(new Event('input'));
                   return performance.now() - t0; }"""
    )
    page.close()
    return {"load_s": load, "moment_ms": float(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", default="250000,1000000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", default=None, help="keep (and reuse) the snapshot files in this folder")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    folder = Path(args.keep or tempfile.mkdtemp(prefix="gradscope-bench-snapview-"))
    folder.mkdir(parents=True, exist_ok=True)
    print("machine: shared, 2 cores; the page opened from file:// in headless Chromium; medians of "
          f"{args.repeat} interleaved runs")
    pages: dict[int, Path] = {}
    rows = {}
    for n in (int(s) for s in args.events.split(",")):
        snap = folder / f"snapshot-{n}.pickle"
        if not snap.exists():
            write_snapshot(str(snap), n)
        t0 = time.perf_counter()
        rec = gs.load_snapshot(snap)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = payload_json(rec)
        t_payload = time.perf_counter() - t0
        pages[n] = folder / f"snapshot-{n}.html"
        rec.to_html(pages[n])
        d = snapshot_data(rec)
        rows[n] = {"file": snap.stat().st_size, "events": d.events, "allocations": d.allocations,
                   "load_s": t_load, "payload_s": t_payload, "payload": len(data.encode()),
                   "page": pages[n].stat().st_size}
    bundle = len(bundle_text().encode())
    runs: dict[tuple[int, int], list[dict[str, float]]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            for _ in range(args.repeat):
                for n in pages:
                    for width in (1000, 1600):
                        runs.setdefault((n, width), []).append(_open(browser, pages[n], width))
        finally:
            browser.close()
    print(f"{'events':>9} {'file':>10} {'allocs':>8} {'load_snapshot':>13} {'payload':>10} {'built in':>9} "
          f"{'page':>10} {'opens 1000px':>13} {'1600px':>8} {'a moment':>9}")
    for n, r in rows.items():
        load = {w: statistics.median(x["load_s"] for x in runs[(n, w)]) for w in (1000, 1600)}
        moment = statistics.median(x["moment_ms"] for w in (1000, 1600) for x in runs[(n, w)])
        print(f"{r['events']:>9} {format_bytes(r['file']):>10} {r['allocations']:>8} {r['load_s']:>12.2f}s "
              f"{format_bytes(r['payload']):>10} {r['payload_s']:>8.2f}s {format_bytes(r['page']):>10} "
              f"{load[1000]:>12.2f}s {load[1600]:>7.2f}s {moment:>7.0f}ms")
    print(f"(the page is the payload plus the front end's bundle, {format_bytes(bundle)}, the same for any snapshot; "
          "the notebook widget sends the payload and the bundle once each)")
    if not args.keep:
        for f in folder.iterdir():
            os.unlink(f)
        folder.rmdir()


if __name__ == "__main__":
    main()
