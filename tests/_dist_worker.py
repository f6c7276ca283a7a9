"""One rank of the real multi-process jobs that tests/test_distributed.py starts.

    python _dist_worker.py SCENARIO RANK WORLD PORT OUT

Each rank joins a gloo process group on 127.0.0.1, runs the scenario's phases the way a training
script does (a warm-up step, then one recorded step, then ``gs.gather``), and writes what it saw
under OUT/<phase>/: ``own/rank{r}.json`` (the recording it made), and on rank 0
``gathered/rank{r}.json`` (what gather returned, per rank), ``job/`` (``job.save``) and
``result.json`` (statuses, messages, seconds spent in gather). The models and batches are defined
here so that the test can predict the same steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HIDDEN = 256

# NOTE [ FSDP2 on CPU ]: FSDP2 (``fully_shard``) runs on CPU with gloo from torch 2.7. On 2.6 it
# fails inside PyTorch: its CPU stream has no ``record_event`` (``foreach_all_gather``), and with
# that stubbed the first backward still fails (a sharded weight modified in place, version 2
# expected 1). DDP runs on every supported torch. So the jobs below run their FSDP phases only
# where PyTorch can, and the 4-rank job runs DDP in their place on older torch.
FSDP2_CPU_SINCE = "2.7"
FSDP2_ON_CPU = torch.torch_version.TorchVersion(torch.__version__) >= FSDP2_CPU_SINCE
FOUR = "fsdp4" if FSDP2_ON_CPU else "ddp4"  # the 4-rank job's recorded step


def fnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


def batch_size(scenario: str, phase: str, rank: int) -> int:
    """Uneven batches: rank 1 of the pair gets twice rank 0's; in the 4-rank job rank 2 gets the
    most (and in the budget phase, 4x the others')."""
    if scenario == "pair":
        return (256, 512)[rank]
    if phase == "budget":
        return (64, 64, 256, 64)[rank]
    return (256, 384, 512, 256)[rank]


def batch(scenario: str, phase: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = batch_size(scenario, phase, rank)
    g = torch.Generator().manual_seed(rank)
    return torch.randn(b, 128, generator=g), torch.randint(0, 10, (b,), generator=g)


def train_step(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], opt: torch.optim.Optimizer) -> None:
    """The step as users write it: forward, loss, backward, optimizer step, zero_grad."""
    x, y = data
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _dump(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _phase(out: Path, phase: str, rank: int, rec: Any, job: Any, gather_s: float) -> None:
    d = out / phase
    if rec is not None and rec.recording is not None:
        _dump(d / "own" / f"rank{rank}.json", rec.recording.to_json())
    if job is None:
        return
    for r, g in enumerate(job.recordings):
        if g is not None:
            _dump(d / "gathered" / f"rank{r}.json", g.to_json())
    job.save(d / "job")
    result = {
        "statuses": [e.status.value for e in job.ranks],
        "messages": [e.message for e in job.ranks],
        "gather_s": gather_s,
        "summary": job.summary(),
    }
    _dump(d / "result.json", json.dumps(result))


def _wrapped(strategy: str, model: nn.Module) -> nn.Module:
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _recorded_step(gs: Any, scenario: str, phase: str, strategy: str, rank: int, out: Path) -> Any:
    model = fnet()
    wrapped = _wrapped(strategy, model)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    data = batch(scenario, phase, rank)
    # warm-up: Adam's state exists after one step; DDP rebuilds its buckets at the start of the
    # second, so a DDP job is recorded at its third step
    for _ in range(2 if strategy == "ddp" else 1):
        train_step(wrapped, data, opt)
    with gs.record(modules={"fnet": model}) as rec:
        train_step(wrapped, data, opt)
    t0 = time.monotonic()
    job = gs.gather(rec, timeout=60, label=phase)
    _phase(out, phase, rank, rec, job, time.monotonic() - t0)
    return rec


def main() -> None:
    scenario, rank, world, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    out = Path(out_dir)
    torch.set_num_threads(1)
    import torch.distributed as dist

    import gradscope as gs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if scenario == "pair":
        _recorded_step(gs, scenario, "ddp", "ddp", rank, out)
        if FSDP2_ON_CPU:
            _recorded_step(gs, scenario, "fsdp", "fsdp", rank, out)
        # rank 1 dies before gathering; rank 0 must not wait for it
        if rank == 1:
            _dump(out / "exit" / "rank1.exited", "")
            os._exit(3)
        model = fnet()
        with gs.record(modules={"fnet": model}) as rec:
            model(batch(scenario, "exit", rank)[0]).sum().backward()
        t0 = time.monotonic()
        job = gs.gather(rec, timeout=30, label="exit")
        _phase(out, "exit", rank, rec, job, time.monotonic() - t0)
    elif scenario == "four":
        rec = _recorded_step(gs, scenario, FOUR, FOUR[:-1], rank, out)
        # a group of its own: ranks 1 and 2 gather to global rank 2 (every rank creates the group)
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            job = gs.gather(rec, dst=2, group=sub, timeout=60, label="sub")
            if job is not None:
                _phase(out, "sub", rank, None, job, 0.0)
        # each rank records a local step on a simulated 768 KiB device; rank 2's batch is 4x the
        # others' and runs out of memory inside its block; rank 3 never calls gather (it hangs)
        model = fnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = batch(scenario, "budget", rank)
        rec = gs.record(budget="768KiB", modules={"fnet": model})
        try:
            with rec:
                train_step(model, data, opt)
        except torch.OutOfMemoryError:
            pass
        finally:
            if rank == 3:
                _dump(out / "budget" / "own" / "rank3.json", rec.recording.to_json())
                time.sleep(600)  # the test kills it
            t0 = time.monotonic()
            job = gs.gather(rec, timeout=5, label="budget")
            _phase(out, "budget", rank, rec, job, time.monotonic() - t0)
    _dump(out / f"done.rank{rank}", "")
    os._exit(0)  # rank 3 may still hang in the group: do not wait for it at shutdown


if __name__ == "__main__":
    main()
