"""How recording cost grows with graph size: a chain of ``y = y + w_k`` (a leaf per step, a tanh
every 10 steps) recorded at several lengths, side by side with the same code unrecorded, in one
run. Linear growth shows as a flat "per node" column; a quadratic pass would double it with each
doubling of the chain.

    python benchmarks/bench_scale.py [--memory off|tracker|cpu] [--steps 5000,10000,20000,40000]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import gradscope as gs


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(steps: int, memory: str | None) -> tuple[float, int, int]:
    leaves = [torch.full((1,), 0.01, requires_grad=True) for _ in range(steps)]
    x = torch.full((1,), 0.5, requires_grad=True)
    keep = []
    gc.collect()
    rss0 = _rss()
    t0 = time.perf_counter()
    rec = gs.record(memory=memory) if memory is not None else None
    if rec is not None:
        rec.__enter__()
    try:
        y = x
        for k, w in enumerate(leaves):
            y = y + w
            if k % 10 == 0:
                y = y.tanh()
            if k % 10_000 == 0:
                keep.append(y)  # freed in pieces: PyTorch overflows its stack freeing long walked chains
        y.sum().backward()
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    grown = _rss() - rss0
    nodes = len(rec.recording.nodes) if rec is not None else 2 * steps + steps // 10 + 2
    del y
    while keep:
        keep.pop()
    return seconds, nodes, grown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="off", choices=["off", "tracker", "cpu"])
    ap.add_argument("--steps", default="5000,10000,20000,40000")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"memory={args.memory}")
    print(f"{'steps':>8} {'nodes':>8} {'plain s':>8} {'record s':>9} {'ratio':>6} {'us/node':>8} "
          f"{'rss KiB/node':>13}")
    for steps in (int(s) for s in args.steps.split(",")):
        plain, _, _ = _run(steps, None)
        recorded, nodes, grown = _run(steps, args.memory)
        print(f"{steps:>8} {nodes:>8} {plain:>8.2f} {recorded:>9.2f} {recorded / plain:>6.1f} "
              f"{1e6 * recorded / nodes:>8.1f} {grown / 1024 / nodes:>13.2f}")


if __name__ == "__main__":
    main()
