"""Cost of recording graphs made of many small ops, side by side with PyTorch's own tools.

Where ops are tiny (RNN cells in a loop, unrolled optimizer steps, long chains; on a GPU almost
everything), the cost of observing is set by per-op and per-node work, and PyTorch's own
observers set the floor: its profiler with ``profile_memory=True`` (what ``memory="cpu"`` reads)
and a bare ``saved_tensors_hooks`` pack hook (what any saved-tensor accounting needs). Targets
(issue: recorder core): default recording at most 1.5x the profiler alone, and ``memory="off"``
at most 1.5x a bare pack hook alone, on each workload. CPU, one thread, thread CPU time, median
of interleaved runs (drift hits every variant alike). The block is what is timed; the analysis
runs on the first look at the recording, as PyTorch's profiler parses its events on first use,
so the same ratios with that first look included (``rec.recording``; ``prof.events()``) are
printed beside them, ``memory="off"`` against a pack hook that detaches what it keeps (see
_detaching_hook), and ``memory="off"`` recorded by gradscope's Python hooks and walk instead of its
compiled ones (see _python_hooks).

The cost of source lines (``gs.record(lines=...)``, see NOTE [ where lines come from ] in
gradscope._model.lines) is measured in the same run: each recording variant again with ``lines=False``,
and the last columns print lines on / lines off (``--lines`` runs only those variants).

    python benchmarks/bench_small_ops.py [--repeats 9] [--clock cpu|wall] [--only tanh,lstm] [--lines]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # before torch: the profiler's start/stop lines

import torch  # noqa: E402
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call

import gradscope as gs
from gradscope._base.stderr import LineFilter

# Newer profilers write a start and a stop line to fd 2 for every run whatever KINETO_LOG_LEVEL
# says: dropped here (every other line passes), so that the table stays readable.
_PROFILER_LINES = ("SyncActivityProfilerHandler.cpp", "CPUAllocator.cpp")

Step = Callable[[], None]


def _tanh_chain() -> Step:
    x = torch.randn(16, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(5000):
            y = y.tanh()
        y.sum().backward()
        x.grad = None

    return step


def _rnn_cell(cell: nn.Module, lstm: bool) -> Step:
    torch.manual_seed(0)
    xs = torch.randn(200, 4, 16)

    def step() -> None:
        cell.zero_grad(set_to_none=True)
        h = torch.zeros(4, 32)
        c = torch.zeros(4, 32)
        out = []
        for t in range(xs.shape[0]):
            if lstm:
                h, c = cell(xs[t], (h, c))
            else:
                h = cell(xs[t], h)
            out.append(h)
        torch.stack(out).pow(2).mean().backward()

    return step


def _unrolled_sgd() -> Step:
    """Seed 002's pattern, scaled down: 20 differentiable SGD steps on a tiny MLP, then the
    validation loss differentiated back to the learning rate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x, t = torch.randn(32, 8), torch.randn(32, 1)
    xv, tv = torch.randn(32, 8), torch.randn(32, 1)
    lr = torch.tensor(0.1, requires_grad=True)

    def step() -> None:
        params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
        for _ in range(20):
            loss = ((functional_call(model, params, (x,)) - t) ** 2).mean()
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params = {k: p - lr * g for (k, p), g in zip(params.items(), grads, strict=True)}
        val = ((functional_call(model, params, (xv,)) - tv) ** 2).mean()
        val.backward()
        lr.grad = None

    return step


WORKLOADS: dict[str, Callable[[], Step]] = {
    "tanh": _tanh_chain,
    "lstm": lambda: _rnn_cell(nn.LSTMCell(16, 32), lstm=True),
    "sgd": _unrolled_sgd,
    "gru": lambda: _rnn_cell(nn.GRUCell(16, 32), lstm=False),
}
TITLES = {
    "tanh": "5,000-op tanh chain",
    "lstm": "LSTMCell, 200 steps",
    "sgd": "20 unrolled SGD steps, tiny MLP",
    "gru": "GRUCell, 200 steps",
}


@contextlib.contextmanager
def _profiler(look: bool = False) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    if look:  # what a first look costs: PyTorch parses its events on first use
        prof.events()


@contextlib.contextmanager
def _recorded(memory: str, look: bool = False, lines: bool = True) -> Iterator[None]:
    with gs.record(memory=memory, lines=lines) as rec:
        yield
    if look:  # the analysis runs on first look (see NOTE [ analysis on first look ])
        assert rec.recording is not None


@contextlib.contextmanager
def _python_hooks(lines: bool = True) -> Iterator[None]:
    """``memory="off"`` recorded by the Python hooks and walk, as where no compiler is (see NOTE
    [ compiled hooks ] in gradscope._capture.native): printed beside the targets, not part of them."""
    from gradscope._capture import native as _native

    compiled = _native.hooks
    _native.hooks = lambda: None  # type: ignore[assignment]
    try:
        with gs.record(memory="off", lines=lines):
            yield
    finally:
        _native.hooks = compiled  # type: ignore[assignment]


def _pack_hook() -> contextlib.AbstractContextManager[None]:
    return saved_tensors_hooks(lambda t: t, lambda t: t)  # type: ignore[return-value]


def _detaching_hook() -> contextlib.AbstractContextManager[None]:
    """The least a pack hook that keeps what it packs can do: a node that saves its own output
    passes the output, whose grad_fn is that node, and a hook returning it as is makes a cycle
    through C++ that no collector breaks (the graph leaks when it is dropped without a backward).
    Printed beside the targets as the floor of any recorder, not part of them."""
    return saved_tensors_hooks(lambda t: t.detach(), lambda t: t)  # type: ignore[return-value]


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "plain": contextlib.nullcontext,
    "profiler": _profiler,
    "pack_hook": _pack_hook,
    "detaching_hook": _detaching_hook,
    "off": lambda: _recorded("off"),
    "default": lambda: _recorded("cpu"),
    "off_python": _python_hooks,
    # with the first look at the results (not part of the targets: printed beside them)
    "profiler_look": lambda: _profiler(look=True),
    "off_look": lambda: _recorded("off", look=True),
    "default_look": lambda: _recorded("cpu", look=True),
    # the same recordings without source lines (the cost of lines: printed last)
    "off_nolines": lambda: _recorded("off", lines=False),
    "default_nolines": lambda: _recorded("cpu", lines=False),
    "off_python_nolines": lambda: _python_hooks(lines=False),
}
LINES_ONLY = ("plain", "off", "off_nolines", "default", "default_nolines", "off_python", "off_python_nolines")


def measure(step: Step, repeats: int, clock: Callable[[], float],
            names: tuple[str, ...] = tuple(VARIANTS)) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(2):  # warm up every path
        for name in names:
            with VARIANTS[name]():
                step()
    order = list(names)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):  # interleaved, so drift hits every variant alike; in a new order each
        shuffle(order)  # round, so that what one variant leaves behind (the profiler's state, a big
        for name in order:  # recording to free) does not always fall on the same next one
            ctx = VARIANTS[name]
            gc.collect()
            t0 = clock()
            with ctx():
                step()
            times[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--lines", action="store_true", help="only the cost of source lines")
    args = ap.parse_args()
    if args.lines:
        return _lines_cost(args)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats} interleaved runs, {args.clock} time")
    print(f"{'workload':34s} {'plain':>8s} {'profiler':>9s} {'pack hook':>9s} {'off':>7s} {'default':>8s}"
          f" {'default/profiler':>17s} {'off/pack hook':>14s}   with a first look: {'default':>8s} {'off':>6s}"
          f"   {'off / detaching hook':>20s}   {'off, Python hooks / pack hook':>29s}")
    ok = True
    quiet = LineFilter(_PROFILER_LINES)
    for name in args.only.split(","):
        sys.stdout.flush()
        quiet.start()
        try:
            med = measure(WORKLOADS[name](), args.repeats, clock)
        finally:
            quiet.stop()
        plain = med["plain"]
        r = {k: v / plain for k, v in med.items()}
        d_vs_p = med["default"] / med["profiler"]
        o_vs_h = med["off"] / med["pack_hook"]
        ok &= d_vs_p <= 1.5 and o_vs_h <= 1.5
        print(f"{TITLES[name]:34s} {plain * 1e3:6.1f}ms {r['profiler']:8.2f}x {r['pack_hook']:8.2f}x "
              f"{r['off']:6.2f}x {r['default']:7.2f}x {d_vs_p:10.2f} {'OK' if d_vs_p <= 1.5 else 'MISS':>4s}"
              f" {o_vs_h:8.2f} {'OK' if o_vs_h <= 1.5 else 'MISS':>4s}"
              f"   {'':>18s} {med['default_look'] / med['profiler_look']:7.2f}  {med['off_look'] / med['pack_hook']:5.2f}"
              f"   {med['off'] / med['detaching_hook']:20.2f}   {med['off_python'] / med['pack_hook']:29.2f}"
              f"   lines: {_lines_columns(med)}")
        sys.stdout.flush()
    return 0 if ok or os.environ.get("GRADSCOPE_BENCH_NO_FAIL") else 1


def _lines_columns(med: dict[str, float]) -> str:
    """Lines on / lines off, per recording variant."""
    return (f"off {med['off'] / med['off_nolines']:.3f}  default {med['default'] / med['default_nolines']:.3f}"
            f"  off (Python hooks) {med['off_python'] / med['off_python_nolines']:.3f}")


def _lines_cost(args: argparse.Namespace) -> int:
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats} interleaved runs, {args.clock} time")
    print("cost over plain without lines -> with lines (lines on / lines off)")
    quiet = LineFilter(_PROFILER_LINES)
    for name in args.only.split(","):
        sys.stdout.flush()
        quiet.start()
        try:
            med = measure(WORKLOADS[name](), args.repeats, clock, LINES_ONLY)
        finally:
            quiet.stop()
        plain = med["plain"]
        cells = [f"{v:<18s} {med[v + '_nolines'] / plain:5.2f}x -> {med[v] / plain:5.2f}x ({med[v] / med[v + '_nolines']:.3f})"
                 for v in ("off", "default", "off_python")]
        print(f"{TITLES[name]:34s} {plain * 1e3:6.1f}ms   " + "   ".join(cells))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
