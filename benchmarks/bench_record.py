"""Cost of recording: instrumented / uninstrumented forward+backward, measured side by side.

Targets (issue: record core): full recording (graph + saved + steps + CPU timeline) at most 1.3x on
a 4-layer nn.TransformerEncoder (d_model 256, seq 128, batch 16, training) and at most 1.5x on a
12-layer MLP (width 1024, batch 64); memory="off" at most 1.1x on both. CPU, one thread, median of
interleaved runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from torch import nn

import gradscope as gs


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(64, 1024)


def _encoder() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).train(), torch.randn(16, 128, 256)


def _measure(model: nn.Module, x: torch.Tensor, repeats: int, clock: object) -> dict[str, float]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    variants = {
        "plain": contextlib.nullcontext,
        "full": lambda: gs.record(memory="cpu"),
        "off": lambda: gs.record(memory="off"),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(2):
        for ctx in variants.values():
            with ctx():
                step()
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        for name, ctx in variants.items():
            t0 = clock()  # type: ignore[operator]
            with ctx():
                step()
            times[name].append(clock() - t0)  # type: ignore[operator]
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: this thread's CPU time (robust when other processes load the machine); wall: perf_counter",
    )
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    torch.manual_seed(0)
    targets = {"encoder": (1.3, 1.1), "mlp": (1.5, 1.1)}
    ok = True
    print(
        f"torch {torch.__version__}, 1 thread, median of {args.repeats} interleaved runs, {args.clock} time"
    )
    for name, make in (("mlp", _mlp), ("encoder", _encoder)):
        model, x = make()
        med = _measure(model, x, args.repeats, clock)
        full = med["full"] / med["plain"]
        off = med["off"] / med["plain"]
        t_full, t_off = targets[name]
        ok &= full <= t_full and off <= t_off
        print(
            f"{name:8s} plain {med['plain'] * 1e3:8.1f} ms | full {full:.3f}x (target <= {t_full}) "
            f"{'OK' if full <= t_full else 'MISS'} | memory=off {off:.3f}x (target <= {t_off}) "
            f"{'OK' if off <= t_off else 'MISS'}"
        )
    return 0 if ok or os.environ.get("GRADSCOPE_BENCH_NO_FAIL") else 1


if __name__ == "__main__":
    sys.exit(main())
