"""The live widget of a ``%%gradscope`` cell (see NOTE [ a live loop ] in gradscope._views.widget): how often its
chart gets new iterations while the loop runs, and what that costs the loop.

A real IPython kernel (started with jupyter_client, as a notebook server starts one) runs the same
``%%gradscope`` cell, a training loop of a small MLP, with the widget (its chart fed while the cell runs)
and with ``--no-widget`` (nothing fed), alternately, several times. The loop times itself inside the cell;
the updates are the widget's messages the kernel publishes (counted on its IOPub channel, with the time
each arrived). Printed: the loop's time per step with and without the live chart (medians, and their
ratio), and the updates' count and largest gap during a run.

    python benchmarks/bench_live.py [--steps 2000] [--runs 5] [--memory cpu|tracker]
"""

from __future__ import annotations

import argparse
import statistics
import time

from jupyter_client.manager import start_new_kernel

SETUP = r"""
%load_ext gradscope
import time, torch
from torch import nn
torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
"""
CELL = """%%gradscope --memory {memory} {flags}
t0 = time.perf_counter()
for _ in range({steps}):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print("LOOP_S=%r" % (time.perf_counter() - t0))
"""


def _run(kc: object, code: str) -> tuple[float | None, list[float]]:
    """Run ``code``; the loop's seconds it printed, and when each widget update arrived."""
    msg_id = kc.execute(code)  # type: ignore[attr-defined]
    loop_s = None
    updates: list[float] = []
    while True:
        msg = kc.get_iopub_msg(timeout=600)  # type: ignore[attr-defined]
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream" and "LOOP_S=" in msg["content"]["text"]:
            loop_s = float(msg["content"]["text"].split("LOOP_S=")[1].split()[0])
        elif kind == "comm_msg":
            data = msg["content"].get("data", {})
            if data.get("method") == "custom" and data.get("content", {}).get("type") == "iterations":
                updates.append(time.monotonic())
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return loop_s, updates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory", default="cpu", choices=["cpu", "tracker", "off"])
    args = ap.parse_args()
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _run(kc, SETUP)
        _run(kc, CELL.format(memory=args.memory, flags="--no-widget", steps=50))  # warm up
        live: list[float] = []
        quiet: list[float] = []
        rates: list[tuple[int, float, float]] = []
        for _ in range(args.runs):
            t_live, ups = _run(kc, CELL.format(memory=args.memory, flags="", steps=args.steps))
            t_quiet, _ = _run(kc, CELL.format(memory=args.memory, flags="--no-widget", steps=args.steps))
            assert t_live is not None and t_quiet is not None
            live.append(t_live)
            quiet.append(t_quiet)
            gaps = [b - a for a, b in zip(ups, ups[1:], strict=False)]
            rates.append((len(ups), len(ups) / t_live, max(gaps) if gaps else float("nan")))
        ml, mq = statistics.median(live), statistics.median(quiet)
        print(f"memory={args.memory}, {args.steps} steps a run, {args.runs} runs each, alternating")
        print(f"loop with the live chart: {1e6 * ml / args.steps:.0f} us/step; without: {1e6 * mq / args.steps:.0f} "
              f"us/step; ratio {ml / mq:.3f}")
        for n, rate, gap in rates:
            print(f"  updates: {n} ({rate:.2f}/s), largest gap {gap:.2f} s")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
