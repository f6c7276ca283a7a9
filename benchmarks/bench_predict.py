"""gs.predict against real CPU runs, side by side: bytes (predicted vs measured) and time.

Run: ``python benchmarks/bench_predict.py``. Prints one row per model: the real step's peak from the
CPU allocator's events (``gs.record(memory="cpu")``), the meta prediction, whether they are equal,
the CUDA allocator model's allocated/reserved estimate, and the time of a plain real step next to
the time of the prediction (median of a few runs, measured in this process, one after the other).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import gradscope as gs


def _sq(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True), 4, enable_nested_tensor=False
    )
    return {
        "mlp 12x1024": (
            nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(1024, 1024), nn.GELU())]),
            torch.randn(256, 1024),
        ),
        "encoder 4xd256": (enc, torch.randn(8, 128, 256)),
        "cnn": (
            nn.Sequential(
                nn.Conv2d(3, 32, 3),
                nn.ReLU(),
                nn.Conv2d(32, 32, 3),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 28 * 28, 10),
            ),
            torch.randn(16, 3, 32, 32),
        ),
    }


def _median_time(fn: Callable[[], object], n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(
        f"{'model':16s} {'real peak':>12s} {'predicted':>12s} {'equal':>6s} {'cuda alloc~':>12s} "
        f"{'reserved~':>12s} {'real step s':>11s} {'predict s':>10s} {'ratio':>6s}"
    )
    for name, (model, x) in _models().items():
        twin = copy.deepcopy(model)
        with gs.record(memory="cpu") as rec:
            _sq(twin, x)
        assert rec.recording is not None
        real = rec.recording.peak_bytes
        pred = gs.predict(_sq, model, x, device="cpu")
        cuda = gs.predict(_sq, model, x, device="cuda")
        t_real = _median_time(lambda m=model, x=x: _sq(copy.deepcopy(m), x))
        t_pred = _median_time(lambda m=model, x=x: gs.predict(_sq, m, x, device="cpu"))
        print(
            f"{name:16s} {real:12d} {pred.peak_bytes:12d} {str(real == pred.peak_bytes):>6s} "
            f"{cuda.allocated_bytes:12d} {cuda.reserved_bytes:12d} {t_real:11.3f} {t_pred:10.3f} "
            f"{t_pred / t_real:6.2f}"
        )


if __name__ == "__main__":
    main()
