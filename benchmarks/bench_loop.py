"""A training loop recorded in one block, 100 to 100,000 iterations: what recording costs per step and
what the block keeps (see NOTE [ iterations ] in gradscope._passes.iterations).

A tiny model (Linear 8->16, ReLU, Linear 16->2, SGD, batch 4) trains N steps plain and recorded, side
by side in one run (the plain loop runs before each recorded one). For each N: the recorded loop's time
per step (µs and the ratio to the plain loop's), the time per step within it from the 10th step on (in
windows of 1,000 steps: the first and the last window; a cost that grows with the loop shows as a rising
ratio), the first look's time (``rec.recording``), the process's resident memory when the block ends and
after the first look (collected) against before the block (what the recording keeps, the kept iterations'
detail included), and the bytes of the iteration rows themselves (a row of numbers an iteration).

    python benchmarks/bench_loop.py [--memory cpu|tracker|off] [--steps 100,10000,100000]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
from torch import nn

import gradscope as gs


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(4, 8), torch.randint(0, 2, (4,))


def _loop(n: int, window: int = 1000) -> list[float]:
    """Train ``n`` steps; the seconds each window of ``window`` steps took (after the first 10)."""
    model, opt, x, y = _make()
    times: list[float] = []
    t = time.perf_counter()
    for k in range(n):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if k == 9 or (k > 9 and (k - 9) % window == 0):
            now = time.perf_counter()
            if k > 9:
                times.append(now - t)
            t = now
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="cpu", choices=["cpu", "tracker", "off"])
    ap.add_argument("--steps", default="100,10000,100000")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _loop(50)
    print(f"memory={args.memory}; torch {torch.__version__}")
    print(f"{'steps':>7} {'plain us/step':>14} {'recorded us/step':>17} {'ratio':>6} {'first/last window':>18} "
          f"{'first look ms':>14} {'look us/step':>13} {'RSS at end MiB':>15} {'RSS kept MiB':>13} "
          f"{'rows MiB':>9} {'iterations':>10} {'kept':>5}")
    for n in (int(s) for s in args.steps.split(",")):
        gc.collect()
        t0 = time.perf_counter()
        _loop(n)
        plain = (time.perf_counter() - t0) / n
        gc.collect()
        rss0 = _rss()
        t0 = time.perf_counter()
        with gs.record(memory=args.memory) as rec:
            windows = _loop(n)
        recorded = (time.perf_counter() - t0) / n
        gc.collect()
        at_end = _rss() - rss0
        rows = rec._loop.carry.rows  # the rows' own arrays
        row_bytes = sum(getattr(rows, f).buffer_info()[1] * getattr(rows, f).itemsize for f in rows.__dataclass_fields__)
        t1 = time.perf_counter()
        r = rec.recording
        look = time.perf_counter() - t1
        assert r is not None
        kept = sum(1 for it in r.iterations if it.kept)
        n_rows = len(r.iterations)
        gc.collect()
        held = _rss() - rss0
        drift = f"{windows[-1] / windows[0]:.2f}" if len(windows) >= 2 else "-"
        print(f"{n:>7} {1e6 * plain:>14.0f} {1e6 * recorded:>17.0f} {recorded / plain:>6.2f} {drift:>18} "
              f"{1e3 * look:>14.0f} {1e6 * look / n:>13.1f} {at_end / 2**20:>15.1f} {held / 2**20:>13.1f} "
              f"{row_bytes / 2**20:>9.1f} {n_rows:>10} {kept:>5}", flush=True)
        del r, rec


if __name__ == "__main__":
    main()
