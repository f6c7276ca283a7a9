"""Layout engines side by side (NOTE [ a layered layout of our own ] in gradscope._views.layered): for
each graph, every node drawn, the time each engine takes, and what a reader sees of the result:
crossings of the straight edges the page draws, their total length, the drawing's size. Ratios are
gradscope's layered engine over Graphviz's dot (where it is installed) and igraph's Sugiyama.
Prints; asserts nothing.

    python benchmarks/bench_layout.py
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _recordings import layered_recording  # noqa: E402
from test_layered import _crossings_and_length  # noqa: E402
from test_layout import _create_graph_recording, _tiny_transformer  # noqa: E402

from gradscope.layout import layout_recording  # noqa: E402


def main() -> None:
    graphs = {"create_graph x24 (the demo)": _create_graph_recording(24), "encoder x2": layered_recording(2)}
    for kind in ("gpt2", "bert", "vit"):
        graphs[f"{kind} (4 blocks)"] = _tiny_transformer(kind)[0]
    engines = ["layered", "sugiyama"] + (["dot"] if shutil.which("dot") else [])
    for name, rec in graphs.items():
        print(f"== {name}: {len(rec.nodes)} nodes, {len(rec.edges)} edges")
        got = {}
        for eng in engines:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                lay = layout_recording(rec, collapse=False, engine=eng)
                best = min(best, time.perf_counter() - t0)
            crossings, length = _crossings_and_length(lay, rec)
            got[eng] = (best, crossings, length, lay.width, lay.height)
            print(f"  {eng:9} {best * 1e3:7.1f} ms  crossings {crossings:4}  edge length {length / 1e3:6.1f}k px  "
                  f"{lay.width:5.0f} x {lay.height:5.0f} px")
        ours = got["layered"]
        for other in engines[1:]:
            o = got[other]
            print(f"  layered / {other}: time {ours[0] / o[0]:.2f}x, crossings {ours[1]} vs {o[1]}, "
                  f"edge length {ours[2] / o[2]:.2f}x, width {ours[3] / o[3]:.2f}x")
    rec = layered_recording(267)
    for collapse in ("auto", False):
        t0 = time.perf_counter()
        lay = layout_recording(rec, collapse=collapse)
        print(f"== {len(rec.nodes)} nodes, collapse={collapse!r}: layered {time.perf_counter() - t0:.2f} s "
              f"({lay.visible_count} boxes)")


if __name__ == "__main__":
    main()
