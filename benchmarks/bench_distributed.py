"""One job, many ranks, side by side: each rank's recorded peak against ``gs.predict_job``, and the
cost of ``gs.gather``.

Run: ``python benchmarks/bench_distributed.py [--world 2]``. Starts real gloo jobs on 127.0.0.1
(world size ``--world``, default 2 and 4), DDP and FSDP2 (``fully_shard`` per block, then the
root), on an MLP with uneven batches and a 2-layer TransformerEncoder with uneven sequence lengths.
Each rank warms up (three steps for DDP: its second step rebuilds the buckets; one for FSDP),
records one step with ``gs.record()`` (the CPU allocator's events) and gathers; rank 0 keeps the
job. Then, in this process, ``gs.predict_job`` predicts every rank on meta. Printed per rank:
recorded and predicted peak, their difference in percent; per job: the imbalance sentence, the
bytes gather moved and its seconds (wall clock on rank 0, a shared machine: indicative only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import gradscope as gs
from gradscope.job import job_view


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _batch(model: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if model == "mlp":
        return torch.randn(128 * (rank + 1), 256, generator=g)  # uneven batches
    return torch.randn(4, 64 * (rank + 1), 128, generator=g)  # uneven sequence lengths


def _units(model: str, net: nn.Module) -> list[nn.Module]:
    if model == "mlp":
        return [m for m in net if isinstance(m, nn.Linear)]
    return list(net.layers)


def _step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for model in ("mlp", "encoder"):
        for strategy in ("ddp", "fsdp"):
            net = _mlp() if model == "mlp" else _encoder()
            if strategy == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                wrapped: nn.Module = DistributedDataParallel(net)
            else:
                from torch.distributed.fsdp import fully_shard

                for u in _units(model, net):
                    fully_shard(u)
                wrapped = fully_shard(net)
            opt = _adam(wrapped.parameters())
            x = _batch(model, rank)
            for _ in range(2 if strategy == "ddp" else 1):
                _step(wrapped, x, opt)
            with gs.record(modules={model: net}) as rec:
                _step(wrapped, x, opt)
            assert rec.recording is not None
            size = len(rec.recording.to_json().encode())
            t0 = time.perf_counter()
            job = gs.gather(rec, timeout=120, label=f"{model} {strategy}")
            seconds = time.perf_counter() - t0
            if job is not None:
                job.save(Path(out) / f"{model}-{strategy}")
                results[f"{model}-{strategy}"] = {"gather_s": seconds, "bytes": size}
            dist.barrier()
    if rank == 0:
        (Path(out) / "gather.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int) -> None:
    out = tempfile.mkdtemp(prefix="gradscope-bench-dist-")
    t0 = time.perf_counter()
    ctx = mp.start_processes(_rank, args=(world, _free_port(), out), nprocs=world, join=False, start_method="spawn")
    while not ctx.join(timeout=300):
        if time.perf_counter() - t0 > 600:
            for p in ctx.processes:
                p.kill()
            raise SystemExit("the job did not end within 600 s")
    gathered = json.loads((Path(out) / "gather.json").read_text())
    print(f"\n== world size {world} (job ran {time.perf_counter() - t0:.0f} s, spawn included) ==")
    print(f"{'job':<14} {'rank':>4} {'recorded':>11} {'predicted':>11} {'pred/rec-1':>10}")
    for key, g in gathered.items():
        model, strategy = key.split("-")
        job = gs.load_ranks(Path(out) / key)
        net = _mlp() if model == "mlp" else _encoder()
        p = gs.predict_job(_step, net, [_batch(model, r) for r in range(world)], strategy=strategy,
                           optimizer=_adam, units=_units(model, net) if strategy == "fsdp" else None)
        for r, rec in enumerate(job.recordings):
            assert rec is not None
            pred = p.ranks[r].peak_bytes
            print(f"{key:<14} {r:>4} {rec.peak_bytes:>11} {pred:>11} {100 * (pred / rec.peak_bytes - 1):>+9.2f}%")
        imb = job_view(job).imbalance
        print(f"{'':<14} gather: {g['bytes'] / 1024:.0f} KiB of JSON per rank, {g['gather_s'] * 1000:.1f} ms on rank 0")
        if imb is not None:
            print(f"{'':<14} {imb.sentence}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, action="append", help="world size (repeatable); default 2 and 4")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs (shared machine: times are indicative)", file=sys.stderr)
    for w in args.world or [2, 4]:
        run(w)


if __name__ == "__main__":
    main()
