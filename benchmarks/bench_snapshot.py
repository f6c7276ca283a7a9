"""Opening a large CUDA memory snapshot: time and peak memory, side by side with plain pickle.

Writes synthetic snapshots in the format ``torch.cuda.memory._dump_snapshot`` writes (documented
in torch/cuda/memory.py): a training loop of ~40 allocations per step with Python stacks of 18
frames (user code under nn.Module calls), each event with ``time_us``, ``compile_context`` and
``user_metadata`` strings as recent PyTorch writes them, the frame dicts shared between
tracebacks and a fresh traceback list per allocation (as the allocator symbolizes them; the
frees reuse their allocation's traceback), one allocation per step kept forever (a leak), an OOM
at the end, and the segments' end state consistent with the trace. Then, in fresh subprocesses,
interleaved, ``--repeat`` times each: plain ``pickle.load`` of the file (the floor: it runs
whatever the file says) and ``gs.load_snapshot`` (safe unpickling, replay, recording; timed alone),
then ``gs.diagnose`` of it (roles, passes, steps, findings; timed apart). Prints medians of seconds
and peak RSS above the process's baseline, at several sizes, and the line through them
extrapolated to a 1 GB file.

    python benchmarks/bench_snapshot.py [--events 250000,500000,1000000] [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20
SLOT = 4 * MiB  # every allocation gets a 4 MiB slot: a simple, consistent address layout
SLOTS_PER_SEGMENT = 64
BASE = 0x7F0000000000
SITE = "/opt/conda/lib/python3.11/site-packages/torch"


def _frame_pool(rng: random.Random) -> list[dict[str, Any]]:
    return [{"filename": f, "line": rng.randint(1, 2000), "name": n} for f, n in (
        [(f"{SITE}/nn/modules/module.py", "_call_impl"), (f"{SITE}/nn/modules/module.py", "_wrapped_call_impl"),
         (f"{SITE}/nn/modules/linear.py", "forward"), (f"{SITE}/nn/functional.py", "layer_norm"),
         (f"{SITE}/autograd/graph.py", "_engine_run_backward"), (f"{SITE}/_tensor.py", "backward"),
         (f"{SITE}/optim/adamw.py", "_single_tensor_adamw")] * 4
        + [(f"/home/user/project/model/block{k}.py", "forward") for k in range(12)]
        + [("/home/user/project/train.py", n) for n in ("train_step", "main", "evaluate", "<module>")]
    )]


def write_snapshot(path: str, events: int, seed: int = 0) -> dict[str, int]:
    """A snapshot of about ``events`` trace entries at ``path``; returns counts."""
    rng = random.Random(seed)
    pool = _frame_pool(rng)
    stacks = [[pool[rng.randrange(len(pool))] for _ in range(18)] for _ in range(600)]
    trace: list[dict[str, Any]] = []
    free_slots: list[int] = []
    next_slot = 0
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    t = 1_700_000_000_000_000

    def entry(action: str, addr: int, size: int, fr: list[dict[str, Any]] | None) -> None:
        nonlocal t
        t += rng.randint(1, 40)
        e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
             "compile_context": "".join(["N/", "A"]), "user_metadata": "".join([])}
        if fr is not None:
            e["frames"] = fr
        trace.append(e)

    def malloc(size: int, stack: int) -> int:
        nonlocal next_slot
        if free_slots:
            slot = free_slots.pop()
        else:
            slot = next_slot
            next_slot += 1
            if slot % SLOTS_PER_SEGMENT == 0:
                entry("segment_alloc", BASE + slot * SLOT, SLOTS_PER_SEGMENT * SLOT, list(stacks[stack]))
        addr = BASE + slot * SLOT
        fr = list(stacks[stack])  # a fresh traceback list, shared frame dicts
        live[addr] = (size, fr)
        entry("alloc", addr, size, fr)
        return addr

    def free(addr: int) -> None:
        size, fr = live.pop(addr)
        entry("free_requested", addr, size, fr)
        entry("free_completed", addr, size, fr)
        free_slots.append((addr - BASE) // SLOT)

    params = [malloc(rng.randrange(1, SLOT), rng.randrange(600)) for _ in range(50)]
    leaked = 0
    while len(trace) < events - 200:
        acts = [malloc(rng.randrange(512, SLOT), rng.randrange(600)) for _ in range(18)]
        loss = malloc(4, 7)
        grads = [malloc(rng.randrange(512, SLOT), rng.randrange(600)) for _ in range(6)]
        for a in acts:
            free(a)
        for g in grads:
            free(g)
        free(loss)
        malloc(4096, 11)  # the leak: one block per step, never freed
        leaked += 1
    trace.append({"action": "oom", "device_free": 123 * MiB, "size": 2 * SLOT, "stream": 0, "time_us": t + 5,
                  "frames": list(stacks[3])})
    segments = []
    for s in range(0, next_slot, SLOTS_PER_SEGMENT):
        blocks = []
        for slot in range(s, s + SLOTS_PER_SEGMENT):
            addr = BASE + slot * SLOT
            if addr in live:
                size, fr = live[addr]
                rounded = max(512, -(-size // 512) * 512)
                blocks.append({"address": addr, "size": rounded, "requested_size": size,
                               "state": "active_allocated", "frames": fr})
                if rounded < SLOT:
                    blocks.append({"address": addr + rounded, "size": SLOT - rounded, "requested_size": 0,
                                   "state": "inactive", "frames": []})
            else:
                blocks.append({"address": addr, "size": SLOT, "requested_size": 0, "state": "inactive",
                               "frames": []})
        segments.append({"device": 0, "address": BASE + s * SLOT, "total_size": SLOTS_PER_SEGMENT * SLOT,
                         "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                         "frames": [], "blocks": blocks})
    snap = {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0, "expandable_segments": False},
            "external_annotations": []}
    with open(path, "wb") as f:
        pickle.dump(snap, f)  # protocol 4, as _dump_snapshot writes on Python 3.8-3.13
    return {"events": len(trace), "leaked": leaked, "params": len(params)}


_CHILD = r"""
import json, resource, sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode == "gradscope":
    import gradscope._analyses.snapshot.data as gsdata
    import gradscope.snapshot as gsnap
else:
    import pickle
    import gradscope  # the same imports (torch) in both, so the baselines match
with open("/proc/self/statm") as f:  # resident now (the imports' own peak may have been higher)
    base = int(f.read().split()[1]) * resource.getpagesize()
t0 = time.perf_counter()
if mode == "gradscope":
    rec = gsnap.load_snapshot(path)
    data = gsnap.snapshot_data(rec)
    kept = sum(len(getattr(data, c)) * 8 for c in gsdata._COLUMNS) + (len(data.time_us) * 8 if data.time_us else 0)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    d = gsnap.diagnose_snapshot(rec)  # roles, passes, steps, findings: what gs.diagnose adds to the load
    diagnose_s = time.perf_counter() - t1
    out = {"points": len(rec.timeline), "dropped": rec.timeline_dropped, "allocations": data.allocations,
           "kept_bytes": kept, "json_bytes": len(rec.to_json()), "peak": rec.peak_bytes,
           "leak": [str(a) for a in d.accumulating][:1], "diagnose_s": diagnose_s}
else:
    with open(path, "rb") as f:
        obj = pickle.load(f)
    out = {}
    seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss": peak - base, **out}))
"""


def _child(mode: str, path: str) -> dict[str, Any]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, path], capture_output=True, text=True, env=env,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", default="250000,500000,1000000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", default=None, help="write the snapshot files here instead of a temporary folder")
    args = ap.parse_args()
    sizes = [int(s) for s in args.events.split(",")]
    folder = args.keep or tempfile.mkdtemp(prefix="gradscope-bench-snapshot-")
    os.makedirs(folder, exist_ok=True)
    print("machine: shared, 2 cores; medians of interleaved runs in fresh processes; RSS = peak resident "
          "memory above what the process held after its imports")
    print(f"{'events':>9} {'file MiB':>9} {'pickle s':>9} {'gs s':>7} {'gs/pickle':>9} {'pickle RSS MiB':>15} "
          f"{'gs RSS MiB':>11} {'gs RSS/file':>11} {'kept MiB':>9}")
    rows = []
    for n in sizes:
        path = os.path.join(folder, f"snapshot-{n}.pickle")
        t0 = time.perf_counter()
        info = write_snapshot(path, n)
        gen = time.perf_counter() - t0
        size = os.path.getsize(path)
        plain, ours = [], []
        for _ in range(args.repeat):
            plain.append(_child("pickle", path))
            ours.append(_child("gradscope", path))
        ps = statistics.median(r["seconds"] for r in plain)
        gs_s = statistics.median(r["seconds"] for r in ours)
        prss = statistics.median(r["rss"] for r in plain)
        grss = statistics.median(r["rss"] for r in ours)
        last = ours[-1]
        rows.append((size, gs_s, grss))
        print(f"{info['events']:>9} {size / MiB:>9.1f} {ps:>9.2f} {gs_s:>7.2f} {gs_s / ps:>9.2f} {prss / MiB:>15.0f} "
              f"{grss / MiB:>11.0f} {grss / size:>11.1f} {last['kept_bytes'] / MiB:>9.1f}")
        diag = statistics.median(r["diagnose_s"] for r in ours)
        print(f"          (written in {gen:.1f} s; {last['allocations']} allocations; timeline {last['points']} "
              f"points, {last['dropped']} dropped; recording JSON {last['json_bytes'] / MiB:.1f} MiB; "
              f"gs.diagnose after the load {diag:.2f} s; "
              f"memory that grows: {last['leak'][0] if last['leak'] else 'none'})")
        if not args.keep:
            os.unlink(path)
    if len(rows) >= 2:
        xs = [r[0] / 2**30 for r in rows]
        for name, ys in (("seconds", [r[1] for r in rows]), ("RSS GiB", [r[2] / 2**30 for r in rows])):
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
            print(f"a 1 GiB snapshot (extrapolated from the line through {len(rows)} sizes): "
                  f"{my + slope * (1 - mx):.1f} {name}")
    if not args.keep:
        os.rmdir(folder)


if __name__ == "__main__":
    main()
