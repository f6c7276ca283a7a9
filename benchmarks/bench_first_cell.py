"""A new user's first ``%%gradscope`` cell: how long it takes in a fresh kernel with nothing cached
(the compiled hooks build in the background meanwhile), against the same cell once they are built
and against the cell without gradscope, all measured in this run.

Each case runs a fresh Jupyter kernel with its own empty cache directory (``GRADSCOPE_CACHE``):
a cell that makes a 2-layer GPT-2 from ``transformers`` (random init) and AdamW, then the timed cell
(one training step), then the same cell again. "built" first runs ``python -m gradscope setup`` on
its cache (timed apart). Kernel start and the set-up cell are not in the cell times.

    python benchmarks/bench_first_cell.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

SETUP = """\
import torch, transformers
%load_ext gradscope
cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=64)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(cfg)
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 256, (4, 32))
"""
STEP = """\
out = model(input_ids=ids, labels=ids)
out.loss.backward()
opt.step()
opt.zero_grad()
"""


def cell_times(cache: str, magic: bool) -> tuple[float, float, list[str]]:
    """Seconds of the first and second timed cell in a fresh kernel, and gradscope's stderr lines."""
    body = ("%%gradscope\n" if magic else "") + STEP
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(body), nbformat.v4.new_code_cell(body)]
    os.environ["GRADSCOPE_CACHE"] = cache  # the kernel inherits it
    client = NotebookClient(nb, timeout=600, kernel_name="python3")
    times = []
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            t = time.perf_counter()
            client.execute_cell(cell, i)
            times.append(time.perf_counter() - t)
    said = [o.get("text", "").strip() for c in nb.cells for o in c.outputs
            if o.get("name") == "stderr" and "gradscope" in o.get("text", "")]
    return times[1], times[2], said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="fresh kernels per case (median shown)")
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {"empty cache": [], "built": [], "no gradscope": []}
    setup_s: list[float] = []
    said: list[str] = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as empty:
            first, second, lines = cell_times(empty, magic=True)
            rows["empty cache"].append((first, second))
            said += lines
        with tempfile.TemporaryDirectory() as built:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "gradscope", "setup"], env=dict(os.environ, GRADSCOPE_CACHE=built),
                           check=True, capture_output=True)
            setup_s.append(time.perf_counter() - t)
            first, second, _ = cell_times(built, magic=True)
            rows["built"].append((first, second))
        with tempfile.TemporaryDirectory() as plain:
            first, second, _ = cell_times(plain, magic=False)
            rows["no gradscope"].append((first, second))
    base = statistics.median(f for f, _ in rows["no gradscope"])
    print(f"first %%gradscope cell, a 2-layer GPT-2 training step, median of {args.repeat} fresh kernels")
    print(f"{'case':<14} {'first cell':>11} {'second cell':>12} {'first / no gradscope':>21}")
    for name, vals in rows.items():
        f = statistics.median(v[0] for v in vals)
        s = statistics.median(v[1] for v in vals)
        print(f"{name:<14} {f:>10.2f}s {s:>11.2f}s {f / base:>20.2f}x")
    print(f"python -m gradscope setup (the build, apart): median {statistics.median(setup_s):.1f} s")
    for line in sorted(set(said)):
        print(f"said on stderr with an empty cache: {line}")


if __name__ == "__main__":
    main()
