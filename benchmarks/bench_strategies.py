"""Strategies side by side: peak memory (``gs.record``'s ``peak_bytes``) and time, measured in one run.

    python benchmarks/bench_strategies.py            # everything
    python benchmarks/bench_strategies.py mixed jac  # a subset: mixed, loop, many, hyper, penalty, jac

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
from gradscope.strategies import (
    JACOBIAN_METHODS,
    PenaltyBranches,
    finite_difference_grad,
    grad_of_input_grads,
    jacobian,
    many_inputs_backward,
    mixed_grad,
    unrolled_params,
)

__all__ = [
    "bench_hyper",
    "bench_input_grads",
    "bench_jacobian",
    "bench_jacobian_shapes",
    "bench_many_inputs",
    "bench_mixed",
    "bench_penalty",
    "main",
]

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


def bench_input_grads(ns: tuple[int, ...] = (1, 2, 8, 32, 128)) -> None:
    """The thread's loop over N latents: the user's create_graph loop, the forum answer's forward AD (PyTorch's own
    tangents), and grad_of_input_grads(method="forward_ad"); G: R^16 -> R^1024 (largest weight 4 MiB)."""
    from torch.autograd import forward_ad

    print("\n== d/dy g(df/dz_1 .. df/dz_N), G = Linear 16-256-1024-1024 (+ Tanh), one latent per z_i")
    torch.manual_seed(0)
    G = nn.Sequential(
        nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024)
    ).eval()
    y = torch.randn(1, 1024, requires_grad=True)
    x = torch.randn(16, requires_grad=True)

    def f(y: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
        return ((y - g_out) ** 2).sum()

    def g(dfdz: list[torch.Tensor]) -> torch.Tensor:
        return sum((((d * x).sum()) ** 2 for d in dfdz), torch.zeros(()))

    def answer(zs: list[torch.Tensor]) -> torch.Tensor:  # the forum answer's forward-AD code, per z
        values = []
        for z in zs:
            z = z.clone().requires_grad_()
            values.append(torch.autograd.grad(f(y.detach(), G(z)), z)[0])
        leaves = [v.requires_grad_() for v in values]
        vs = torch.autograd.grad(g(leaves), leaves)
        total = torch.zeros_like(y)
        for z, v in zip(zs, vs, strict=True):
            G.requires_grad_(False)
            with forward_ad.dual_level():
                g_out, g_t = forward_ad.unpack_dual(G(forward_ad.make_dual(z, v)))
            G.requires_grad_(True)
            g_out.requires_grad_()
            (dfdg,) = torch.autograd.grad(f(y, g_out), g_out, create_graph=True)
            total = total + torch.autograd.grad(dfdg, y, grad_outputs=g_t)[0]
        return total

    peaks: dict[tuple[str, int], int] = {}
    for n in ns:
        gen = torch.Generator().manual_seed(n)
        zs = [torch.randn(1, 16, generator=gen) for _ in range(n)]
        cmp = gs.compare(
            {
                "users_loop": lambda zs=zs: grad_of_input_grads(f, G, zs, y, g, method="create_graph"),
                "answer_forward_ad": lambda zs=zs: answer(zs),
                "forward_ad": lambda zs=zs: grad_of_input_grads(f, G, zs, y, g, method="forward_ad"),
            },
            modules={"G": G},
            repeat=1,
        )
        _statuses(cmp)
        for r in cmp.rows:
            peaks[(r.name, n)] = r.peak_bytes or 0
        print(
            f"  N = {n:3d}: users_loop {format_bytes(peaks[('users_loop', n)]):>10s}   answer_forward_ad "
            f"{format_bytes(peaks[('answer_forward_ad', n)]):>10s}   forward_ad {format_bytes(peaks[('forward_ad', n)]):>10s}"
        )
    lo, hi = ns[0], ns[-1]
    flat = peaks[("forward_ad", hi)] / peaks[("forward_ad", lo)]
    _check(f"forward_ad peak N={hi} / N={lo}", flat, "<= 1.5", flat <= 1.5)
    ours = peaks[("forward_ad", lo)] / peaks[("answer_forward_ad", lo)]
    _check(
        f"forward_ad / the answer's forward AD peak at N={lo} (no zero tangent)", ours, "<= 0.1", ours <= 0.1
    )
    wins = [n for n in ns if peaks[("forward_ad", n)] < peaks[("users_loop", n)]]
    print(f"  forward_ad peak below the user's loop from N = {min(wins) if wins else 'never'}")


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

    # what the recompute's checks cost (RNG hashes, the state snapshot and its comparison, the output check):
    # against the thread's bare two-pass loop on a model where that loop is right (no dropout, eval-mode norm)
    torch.manual_seed(1)
    f = nn.Sequential(nn.Linear(width, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 8)).eval()
    inputs = [torch.randn(batch, width) for _ in range(16)]

    def g2(zs: torch.Tensor) -> torch.Tensor:
        return zs.softmax(-1).amax(0).log().mean()

    def bare() -> None:
        with torch.no_grad():
            zs = torch.stack([f(x) for x in inputs])
        zs.requires_grad_()
        g2(zs).backward()
        assert zs.grad is not None
        for x, dz in zip(inputs, zs.grad, strict=True):
            f(x).backward(dz)

    times: dict[str, list[float]] = {"bare": [], "two_pass": []}
    for _ in range(7):
        for kind in ("bare", "two_pass"):
            f.zero_grad(set_to_none=True)
            t0 = time.thread_time()
            if kind == "bare":
                bare()
            else:
                many_inputs_backward(f, inputs, g2, method="two_pass")
            times[kind].append(time.thread_time() - t0)
    ratio = statistics.median(times["two_pass"]) / statistics.median(times["bare"])
    print(
        f"  two_pass with its checks / the thread's bare two-pass loop (16 inputs, CPU time, median of 7): "
        f"{ratio:.2f}"
    )


# ----- seed 002 -----------------------------------------------------------------------------------
def bench_hyper(steps: tuple[int, ...] = (1, 4, 16)) -> None:
    """The thread's pipeline (A -> train M1 -> M1 labels M2's data -> train M2 -> validation loss), Adam:
    unrolled, truncated to the last step, and finite differences, side by side."""
    import torch.nn.functional as F
    from torch.func import functional_call

    print("\n== hypergradient through a two-model pipeline (M1 74 KiB, M2 19 KiB, float64, Adam)")
    torch.manual_seed(0)
    dt = torch.float64
    m1 = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4)).to(dt)
    m2 = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(dt)
    x1, y1 = torch.randn(16, 32, dtype=dt), torch.randint(0, 4, (16,))
    x2 = torch.randn(16, 32, dtype=dt)
    xv, yv = torch.randn(16, 32, dtype=dt), torch.randint(0, 4, (16,))
    A = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=dt, requires_grad=True)

    def pipeline(k: int, truncate: int | None = None) -> torch.Tensor:
        def train1(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return (A[y1] * F.cross_entropy(functional_call(m1, p, (x1,)), y1, reduction="none")).mean()

        p1 = unrolled_params(m1, train1, k, "adam", 1e-2, truncate=truncate)
        soft = functional_call(m1, p1, (x2,)).softmax(-1)

        def train2(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return -(soft * functional_call(m2, p, (x2,)).log_softmax(-1)).sum(-1).mean()

        p2 = unrolled_params(m2, train2, k, "adam", 1e-2, truncate=truncate)
        return F.cross_entropy(functional_call(m2, p2, (xv,)), yv)

    peaks: dict[tuple[str, int], int] = {}
    for k in steps:
        cmp = gs.compare(
            {
                "unrolled": lambda k=k: torch.autograd.grad(pipeline(k), A)[0],
                "truncated_1": lambda k=k: torch.autograd.grad(pipeline(k, truncate=1), A)[0],
                "finite_difference": lambda k=k: finite_difference_grad(
                    lambda: pipeline(k, truncate=0), A, step=1e-7
                )[0],
            },
            modules={"m1": m1, "m2": m2},
            repeat=1,
            rtol=1e-4,
        )
        print(f"-- {k} step(s) per model")
        print(cmp.summary())
        for r in cmp.rows:
            peaks[(r.name, k)] = r.peak_bytes or 0
        for name in ("unrolled", "finite_difference"):
            if cmp.row(name).status != "ok":
                _failures.append(f"{name} at {k} steps: {cmp.row(name).status}")
    lo, hi = steps[0], steps[-1]
    grow = peaks[("unrolled", hi)] / peaks[("unrolled", lo)]
    print(f"  unrolled peak {hi} steps / {lo} step = {grow:.1f}")
    flat = peaks[("finite_difference", hi)] / peaks[("finite_difference", lo)]
    _check(f"finite-difference peak {hi} steps / {lo} step", flat, "<= 1.1", flat <= 1.1)


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

    def step_more(
        method: str,
    ) -> torch.Tensor:  # penalties that also read a trunk weight and the pre-activation
        pb = PenaltyBranches(method)
        h = x
        for layer in trunk:
            pre = layer(h)
            h = torch.tanh(pre)
            gram = layer.weight @ layer.weight.T
            pb.add(
                1e-2 * penalty(pre) + 1e-4 * (gram - torch.eye(width)).pow(2).sum() * h.pow(2).mean(), at=h
            )
        return pb.backward(h.pow(2).mean())

    more = gs.compare(
        {m: (lambda m=m: step_more(m)) for m in ("joint", "early", "retain_graph")}, modules={"trunk": trunk}
    )
    print("-- penalties reading a trunk weight and the pre-activation too")
    print(more.summary())
    _statuses(more)
    ratio = (more.row("early").peak_bytes or 0) / (more.row("joint").peak_bytes or 1)
    _check("early / joint peak (penalties reading more of the trunk)", ratio, "<= 0.5", ratio <= 0.5)


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


def bench_jacobian_shapes() -> None:
    """Full Jacobians of a two-layer MLP, tall / square / wide, every method: when forward mode wins."""
    print("\n== full Jacobian of Linear(n_in, 128) + Tanh + Linear(128, n_out), one input vector")
    shapes = {"tall": (8, 256), "square": (64, 64), "wide": (256, 8)}
    rows: dict[str, gs.Comparison] = {}
    for name, (n_in, n_out) in shapes.items():
        torch.manual_seed(0)
        fxn = nn.Sequential(nn.Linear(n_in, 128), nn.Tanh(), nn.Linear(128, n_out))
        x = torch.randn(n_in)
        cmp = gs.compare(
            {m: (lambda m=m, fxn=fxn, x=x: jacobian(fxn, x, method=m)) for m in JACOBIAN_METHODS},
            reference="jacrev",
            modules={"fxn": fxn},
            repeat=7,
        )
        _statuses(cmp)
        rows[name] = cmp
    print(f"  {'method':11s}" + "".join(f"{s:>24s}" for s in shapes))
    for m in JACOBIAN_METHODS:
        cells = [
            f"{rows[s].row(m).time_s * 1e3:9.2f} ms {format_bytes(rows[s].row(m).peak_bytes):>10s}"
            for s in shapes
        ]
        print(f"  {m:11s}" + "".join(f"{c:>24s}" for c in cells))
    for s in shapes:
        fwd = min(rows[s].row(m).time_s or 0 for m in ("jacfwd", "double_vjp"))
        rev = min(rows[s].row(m).time_s or 0 for m in ("loop", "batched", "repeat", "jacrev", "vmap"))
        print(f"  {s:6s}: best forward mode / best reverse mode time = {fwd / rev:.2f}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in ``argv`` (all by default); exit status 1 if a target is missed."""
    torch.set_num_threads(1)
    which = set(argv or ["mixed", "loop", "many", "hyper", "penalty", "jac"])
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread")
    if "mixed" in which:
        bench_mixed()
    if "loop" in which:
        bench_input_grads()
    if "many" in which:
        bench_many_inputs()
    if "hyper" in which:
        bench_hyper()
    if "penalty" in which:
        bench_penalty()
    if "jac" in which:
        bench_jacobian_shapes()
        bench_jacobian()
    print("\nall targets met" if not _failures else f"\nNOT MET: {', '.join(_failures)}")
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
