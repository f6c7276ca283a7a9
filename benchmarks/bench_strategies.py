"""Strategies side by side: peak memory (``gs.record``'s ``peak_bytes``) and time, measured in one run.

    python benchmarks/bench_strategies.py            # everything
    python benchmarks/bench_strategies.py mixed jac  # a subset: mixed, many, penalty, jac

CPU, one thread. Every figure comes from ``gs.compare``, which also checks each strategy's result against
the reference; a ratio is printed with its target and whether it is met. Times are medians of the runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import gradscope as gs
from gradscope.recording import format_bytes
from gradscope.strategies import JACOBIAN_METHODS, PenaltyBranches, jacobian, many_inputs_backward, mixed_grad

__all__ = ["bench_jacobian", "bench_many_inputs", "bench_mixed", "bench_penalty", "main"]

_failures: list[str] = []


def _check(label: str, value: float, target: str, ok: bool) -> None:
    print(f"  {label} = {value:.3f}   target {target}: {'met' if ok else 'NOT MET'}")
    if not ok:
        _failures.append(label)


def _statuses(cmp: gs.Comparison) -> None:
    for r in cmp.rows:
        if r.status != "ok" and r.name not in ("split",):
            _failures.append(f"{r.name} status {r.status}")


# ----- seed 000 -----------------------------------------------------------------------------------
def bench_mixed(width: int = 512, batch: int = 64, depths: tuple[int, int] = (2, 32)) -> None:
    """Mixed second derivative through a frozen G = D x (Linear + Tanh): create_graph vs forward AD."""
    print(f"\n== mixed second derivative, G = D x (Linear {width} + Tanh), batch {batch}")

    def f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return ((y + g) ** 3).sum()

    peaks: dict[tuple[str, int], int] = {}
    for depth in depths:
        torch.manual_seed(0)
        G = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]).eval()
        z = torch.randn(batch, width)
        y = torch.randn(batch, width, requires_grad=True)
        cands: dict[str, Callable[[], object]] = {
            m: (lambda m=m, G=G, z=z, y=y: mixed_grad(f, G, z, y, method=m))
            for m in ("create_graph", "forward_ad", "split")
        }
        cmp = gs.compare(cands, reference="create_graph", modules={"G": G})
        print(f"-- D = {depth}")
        print(cmp.summary())
        _statuses(cmp)
        for r in cmp.rows:
            if r.peak_bytes is not None:
                peaks[(r.name, depth)] = r.peak_bytes
        if cmp.row("split").status == "ok":
            _failures.append("split reported ok")
    d0, d1 = depths
    _check(
        f"forward_ad peak D={d1} / D={d0}",
        peaks[("forward_ad", d1)] / peaks[("forward_ad", d0)],
        "<= 1.1",
        peaks[("forward_ad", d1)] <= 1.1 * peaks[("forward_ad", d0)],
    )
    ratio = peaks[("forward_ad", d1)] / peaks[("create_graph", d1)]
    _check(f"forward_ad / create_graph peak at D={d1}", ratio, "<= 0.15", ratio <= 0.15)


# ----- seed 001 -----------------------------------------------------------------------------------
def bench_many_inputs(ns: tuple[int, int] = (4, 64), batch: int = 64, width: int = 512) -> None:
    """Loss over many outputs of one model with batch norm and dropout: stacked vs two-pass."""
    print(f"\n== loss over N outputs of one model (BatchNorm + Dropout), inputs {batch}x{width}")
    peaks: dict[tuple[str, int], int] = {}
    for n in ns:
        torch.manual_seed(0)
        f = nn.Sequential(
            nn.Linear(width, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Dropout(0.2), nn.Linear(1024, 8)
        )
        inputs = [torch.randn(batch, width) for _ in range(n)]

        def g(zs: torch.Tensor) -> torch.Tensor:
            return zs.softmax(-1).amax(0).log().mean()

        cmp = gs.compare(
            {
                m: (lambda m=m, f=f, inputs=inputs: many_inputs_backward(f, inputs, g, method=m))
                for m in ("stacked", "two_pass")
            },
            modules={"f": f},
        )
        print(f"-- N = {n}")
        print(cmp.summary())
        _statuses(cmp)
        for r in cmp.rows:
            peaks[(r.name, n)] = r.peak_bytes or 0
    n0, n1 = ns
    ratio = peaks[("two_pass", n1)] / peaks[("two_pass", n0)]
    _check(f"two_pass peak N={n1} / N={n0}", ratio, "<= 1.2", ratio <= 1.2)
    print(f"  (stacked peak N={n1} / N={n0} = {peaks[('stacked', n1)] / peaks[('stacked', n0)]:.1f})")


# ----- seed 003 -----------------------------------------------------------------------------------
def bench_penalty(steps: int = 6, batch: int = 32, width: int = 256) -> None:
    """Penalty branches with large intermediates off a 6-step trunk: joint vs early vs retain_graph."""
    print(
        f"\n== penalty branches off a {steps}-step trunk (Linear {width} + Tanh, batch {batch}); "
        f"branch intermediates {batch}x{width}x{width}"
    )
    torch.manual_seed(0)
    trunk = nn.ModuleList([nn.Linear(width, width) for _ in range(steps)])
    x = torch.randn(batch, width)

    def penalty(h: torch.Tensor) -> torch.Tensor:
        a = (h.unsqueeze(2) * h.unsqueeze(1)).tanh()
        b = a.sigmoid()
        c = b.sin()
        return (c * c).mean()

    def step(method: str) -> torch.Tensor:
        pb = PenaltyBranches(method)
        h = x
        for layer in trunk:
            h = torch.tanh(layer(h))
            pb.add(1e-2 * penalty(h), at=h)
        return pb.backward(h.pow(2).mean())

    cmp = gs.compare(
        {m: (lambda m=m: step(m)) for m in ("joint", "early", "retain_graph")}, modules={"trunk": trunk}
    )
    print(cmp.summary())
    _statuses(cmp)
    ratio = (cmp.row("early").peak_bytes or 0) / (cmp.row("joint").peak_bytes or 1)
    _check("early / joint peak", ratio, "<= 0.45", ratio <= 0.45)


# ----- seed 004 -----------------------------------------------------------------------------------
def bench_jacobian(n: int = 1000, batch: int = 32) -> None:
    """Per-sample Jacobians of an R^n -> R^n MLP, batch 32: every method, time and peak."""
    print(f"\n== per-sample Jacobian of an MLP R^{n} -> R^{n} (3 Linear + Tanh), batch {batch}")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(n, n), nn.Tanh(), nn.Linear(n, n), nn.Tanh(), nn.Linear(n, n))
    x = torch.randn(batch, n)
    cmp = gs.compare(
        {m: (lambda m=m: jacobian(net, x, method=m, batch_dim=0)) for m in JACOBIAN_METHODS},
        reference="jacrev",
        repeat=3,
        modules={"net": net},
    )
    print(cmp.summary())
    _statuses(cmp)
    print(f"\n  {'method':8s} {'time':>10s} {'peak':>12s}")
    for r in cmp.rows:
        t = "-" if r.time_s is None else f"{r.time_s * 1e3:.0f} ms"
        print(f"  {r.name:8s} {t:>10s} {format_bytes(r.peak_bytes):>12s}   {r.status}")
    # see NOTE [ batched grad_outputs are materialized ]; thread CPU time, less disturbed by other load
    eye = torch.eye(n).unsqueeze(1).expand(n, batch, n)
    times: dict[str, list[float]] = {"expanded": [], "materialized": []}
    xr = x.detach().requires_grad_(True)
    for _ in range(3):
        for kind in ("expanded", "materialized"):
            y = net(xr)
            t0 = time.thread_time()
            grad_outputs = eye if kind == "expanded" else eye.contiguous()
            torch.autograd.grad(y, xr, grad_outputs, is_grads_batched=True)
            times[kind].append(time.thread_time() - t0)
            del y
    e, m = statistics.median(times["expanded"]), statistics.median(times["materialized"])
    print(
        f"\n  batched grad_outputs, backward CPU time: expanded identity {e * 1e3:.0f} ms, "
        f"materialized (copy included) {m * 1e3:.0f} ms, expanded / materialized = {e / m:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in ``argv`` (all by default); exit status 1 if a target is missed."""
    torch.set_num_threads(1)
    which = set(argv or ["mixed", "many", "penalty", "jac"])
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread")
    if "mixed" in which:
        bench_mixed()
    if "many" in which:
        bench_many_inputs()
    if "penalty" in which:
        bench_penalty()
    if "jac" in which:
        bench_jacobian()
    print("\nall targets met" if not _failures else f"\nNOT MET: {', '.join(_failures)}")
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
