"""gradscope on a real GPU: every CUDA figure the README quotes, measured side by side in one run.

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/bench_cuda.py --out cuda-results

(and the CUDA tests: ``PYTHONPATH=. python -m pytest -q -m cuda tests/``). Without a GPU it says so
and exits 0. It prints, and writes to ``--out`` as ``cuda_bench.json``:

1. ``memory="cuda"``: the recording's ``peak_bytes`` against ``torch.cuda.max_memory_allocated``
   over the same block (minus what was allocated before it), and ``reserved_peak_bytes`` against
   ``torch.cuda.max_memory_reserved``, per model;
2. ``gs.predict(device="cuda")`` against the real peak of the same step, in percent, per model
   (MLP, CNN with batch norm, transformer encoder with SDPA, GPT-2 small from ``transformers`` with
   random weights when that package is there, a GAN gradient penalty with ``create_graph``, an Adam
   step);
3. recording overhead: plain against recorded step, interleaved, medians of ``--repeat`` runs;
4. a real out-of-memory caught by ``%gradscope oom on`` in an IPython shell (the process is capped
   with ``torch.cuda.set_per_process_memory_fraction``), its diagnosis, and the allocator snapshot
   that ``oom on`` saved of the same failure (copied to ``oom_snapshot.pickle``, the format PyTorch's
   own tools read), read back with ``gs.load_snapshot``: its diagnosis must be the one printed, its
   request the one in PyTorch's message, and the list keeping graphs (the cell's line 3) must be
   found accumulating. ``oom_snapshot.json`` beside it holds those facts: commit both under
   ``tests/fixtures/`` (as ``cuda_oom_snapshot.pickle`` / ``.json``) and
   ``tests/test_snapshot_diagnose.py`` checks gradscope against the real file from then on.

Each section reports its own failure and the run goes on, so that one run gives every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradscope as gs

MiB = 1 << 20


# ----- models: (name, make) where make() -> (model, step, args) on the GPU -------------------------
def _sq_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _mlp() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    m = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(2048, 2048), nn.GELU())])
    return m.cuda(), _sq_step, (torch.randn(512, 2048, device="cuda"),)


def _cnn() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    m = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1, stride=2),
        nn.BatchNorm2d(128),
        nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.BatchNorm2d(128),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    return m.cuda(), _sq_step, (torch.randn(64, 3, 64, 64, device="cuda"),)


def _encoder() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True)
    m = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    return m.cuda(), _sq_step, (torch.randn(16, 256, 512, device="cuda"),)


def _gpt2() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config())  # GPT-2 small, random weights: nothing is downloaded
    ids = torch.randint(0, 50257, (8, 512), device="cuda")

    def step(model: nn.Module, ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return m.cuda(), step, (ids,)


def _bert() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    from transformers import BertConfig, BertForMaskedLM

    m = BertForMaskedLM(BertConfig())  # BERT-base, random weights
    ids = torch.randint(0, 30522, (8, 512), device="cuda")

    def step(model: nn.Module, ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return m.cuda(), step, (ids,)


def _gan_penalty() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    d = nn.Sequential(
        nn.Linear(1024, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1)
    )

    def step(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> None:
        eps = torch.rand(real.shape[0], 1, device=real.device)
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(disc(mixed).sum(), mixed, create_graph=True)
        penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
        (disc(fake).mean() - disc(real).mean() + 10 * penalty).backward()

    return d.cuda(), step, (torch.randn(512, 1024, device="cuda"), torch.randn(512, 1024, device="cuda"))


def _adam() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    m = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return m, step, (torch.randn(256, 2048, device="cuda"), opt)


MODELS: dict[str, Callable[[], tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]]] = {
    "mlp 8x2048": _mlp,
    "cnn + batchnorm": _cnn,
    "encoder 6xd512 (sdpa)": _encoder,
    "gpt2 small 8x512": _gpt2,
    "bert base 8x512": _bert,
    "gan penalty (create_graph)": _gan_penalty,
    "adam step": _adam,
}


# ----- measurements --------------------------------------------------------------------------
def _fresh() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _real_peak(step: Callable[..., Any], model: nn.Module, args: tuple[Any, ...]) -> tuple[int, int]:
    """(peak allocated minus allocated before, peak reserved) of one plain step."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(model, *args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, torch.cuda.max_memory_reserved()


def _clear_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_model(name: str, make: Callable[[], Any], repeat: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, step, args = make()
    row: dict[str, Any] = {"model": name}
    step(model, *args)  # warm-up: cuBLAS/cuDNN workspaces and lazy state exist before measuring
    _clear_grads(model)
    _fresh()
    real, real_reserved = _real_peak(step, model, args)
    row["real_peak_bytes"] = real
    row["real_reserved_peak_bytes"] = real_reserved
    _clear_grads(model)

    # 1. the recording against the allocator's own statistics over the same block
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with gs.record(memory="cuda") as rec:
        step(model, *args)
    torch.cuda.synchronize()
    allocator_peak = torch.cuda.max_memory_allocated() - before
    r = rec.recording
    assert r is not None
    row["recorded_peak_bytes"] = r.peak_bytes
    row["allocator_peak_bytes"] = allocator_peak
    row["peak_exact"] = r.peak_bytes == allocator_peak
    row["recorded_reserved_peak_bytes"] = r.reserved_peak_bytes
    row["allocator_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    row["reserved_exact"] = r.reserved_peak_bytes == row["allocator_reserved_peak_bytes"]
    _clear_grads(model)

    # 2. the prediction on meta against the real step
    p = gs.predict(step, model, *args, device="cuda")
    resident = _rounded_resident(model, args)
    row["predicted_peak_bytes"] = p.peak_bytes
    row["predicted_allocated_bytes"] = p.allocated_bytes
    row["predicted_reserved_bytes"] = p.reserved_bytes
    row["resident_rounded_bytes"] = resident
    predicted_delta = (p.allocated_bytes or 0) - resident
    row["predicted_minus_resident_bytes"] = predicted_delta
    row["prediction_error_pct"] = 100.0 * (predicted_delta - real) / real if real else None
    row["prediction_notes"] = list(p.notes)
    _clear_grads(model)

    # 3. overhead, interleaved: the plain step, recorded with memory="cuda" and "off", and the two
    # tools PyTorch has for the same question, each alone
    def rec_cuda() -> None:
        with gs.record(memory="cuda"):
            step(model, *args)

    def rec_cuda_history() -> None:
        with gs.record(memory="cuda", history=True):
            step(model, *args)

    def rec_off() -> None:
        with gs.record(memory="off"):
            step(model, *args)

    def profiler_alone() -> None:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            profile_memory=True,
        ):
            step(model, *args)

    def history_alone() -> None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            step(model, *args)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    variants: dict[str, Callable[[], None]] = {
        "plain": lambda: step(model, *args),
        "record cuda": rec_cuda,
        "record cuda history": rec_cuda_history,
        "record off": rec_off,
        "profiler(profile_memory)": profiler_alone,
        "_record_memory_history": history_alone,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeat):
        for k, fn in variants.items():
            times[k].append(_timed(fn))
            _clear_grads(model)
    row["times_s"] = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()
    }
    row["plain_median_s"] = statistics.median(times["plain"])
    row["recorded_median_s"] = statistics.median(times["record cuda"])
    row["overhead"] = row["recorded_median_s"] / row["plain_median_s"]
    row["ratios"] = {k: statistics.median(v) / row["plain_median_s"] for k, v in times.items()}
    return row


def measure_loop(steps: int) -> dict[str, Any]:
    """A training loop of ``steps`` Adam steps recorded in one block with ``memory="cuda"``: per-step
    time against the plain loop, the iterations found, whether memory is steady, and the recorded
    peak against the allocator's over the same block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")

    def loop(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

    loop(3)  # warm-up: optimizer state and workspaces exist before measuring
    plain = _timed(lambda: loop(steps))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with gs.record(memory="cuda") as rec:
        loop(steps)
    torch.cuda.synchronize()
    recorded = time.perf_counter() - t0
    allocator_peak = torch.cuda.max_memory_allocated() - before
    r = rec.recording
    assert r is not None
    t1 = time.perf_counter()
    text = r.summary()
    first_look = time.perf_counter() - t1
    leaky: list[torch.Tensor] = []

    def leaky_loop(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            opt.step()
            leaky.append(loss)  # keeps every step's graph

    with gs.record(memory="cuda") as rec2:
        leaky_loop(20)
    r2 = rec2.recording
    assert r2 is not None
    leaky.clear()
    return {
        "steps": steps,
        "plain_per_step_us": 1e6 * plain / steps,
        "recorded_per_step_us": 1e6 * recorded / steps,
        "ratio": recorded / plain,
        "iterations": len(r.iterations),
        "steady": r.steady(),
        "recorded_peak_bytes": r.peak_bytes,
        "allocator_peak_bytes": allocator_peak,
        "first_look_s": first_look,
        "summary_head": text[:1500],
        "leaky_iterations": len(r2.iterations),
        "leaky_steady": r2.steady(),
        "leaky_growth": [str(g) for g in r2.growth][:5],
    }


def _rounded_resident(model: nn.Module, args: tuple[Any, ...]) -> int:
    """What the step finds allocated, rounded as the allocator rounds (512-byte blocks)."""
    tensors: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]:
        tensors[t.untyped_storage().data_ptr()] = t
    return sum(512 * -(-t.untyped_storage().nbytes() // 512) for t in tensors.values())


def measure_oom(out: str) -> dict[str, Any]:
    """A real OOM in an IPython shell with ``%gradscope oom on``, and the allocator snapshot it saved."""
    import glob
    import shutil

    from IPython.testing import globalipapp

    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    _fresh()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = 1 << 30  # 1 GiB of this process's share of the device
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + cap) / total))
    buf = io.StringIO()
    result: dict[str, Any] = {"cap_bytes": cap}
    snaps = os.path.join(out, "oom-snapshots")
    shutil.rmtree(snaps, ignore_errors=True)
    try:
        shell.run_line_magic("load_ext", "gradscope")
        shell.run_cell(
            "import torch\n"
            "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1)).cuda()\n"
        )
        shell.run_line_magic("gradscope", f"oom on --snapshot-dir {snaps}")
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            res = shell.run_cell(
                "losses = []\n"
                "for i in range(100_000):\n"
                "    losses.append(model(torch.randn(2048, 1024, device='cuda')).square().mean())\n"
            )
        result["raised"] = type(res.error_in_exec).__name__ if res.error_in_exec is not None else None
        result["message"] = str(res.error_in_exec)[:400] if res.error_in_exec is not None else None
    finally:
        with contextlib.suppress(Exception):
            shell.run_line_magic("gradscope", "oom off")
            shell.run_line_magic("unload_ext", "gradscope")
        shell.user_ns.pop("losses", None)
        shell.user_ns.pop("model", None)
        torch.cuda.set_per_process_memory_fraction(1.0)
        _fresh()
    text = buf.getvalue()
    result["output_head"] = text[:9000]
    result["diagnosed"] = "gradscope diagnosis" in text
    result["names_losses"] = "losses" in text
    saved = sorted(glob.glob(os.path.join(snaps, "gradscope-oom-*.pickle")))
    result["snapshots_saved"] = [os.path.basename(f) for f in saved]
    if saved:
        snap_path = os.path.join(out, "oom_snapshot.pickle")
        shutil.copy(saved[-1], snap_path)
        result["snapshot_file"] = snap_path
        result["snapshot_bytes"] = os.path.getsize(snap_path)
        result["snapshot"] = check_snapshot(snap_path, text, result.get("message") or "")
    return result


def check_snapshot(path: str, printed: str, message: str) -> dict[str, Any]:
    """``gs.load_snapshot`` on the real file of a real OOM: what the fixture test will check."""
    import re

    t0 = time.perf_counter()
    rec = gs.load_snapshot(path)
    seconds = time.perf_counter() - t0
    d = gs.diagnose(rec)
    from gradscope.snapshot import snapshot_data

    data = snapshot_data(rec)
    m = re.search(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB)", message)
    asked = (
        None
        if m is None
        else float(m.group(1)) * {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[m.group(2)]
    )
    facts = {
        "load_s": seconds,
        "events": data.events,
        "allocations": data.allocations,
        "peak_bytes": rec.peak_bytes,
        "oom_at": None if data.oom is None else data.oom.at,
        "request": d.request,
        "device_free": d.device_free,
        "allocated": d.allocated,
        "reserved": d.reserved,
        "message_request_bytes": asked,
        # PyTorch's message rounds to two decimals of its unit: the request must agree with it
        "request_matches_message": asked is not None
        and d.request is not None
        and abs(d.request - asked) <= 0.01 * asked,
        "same_diagnosis_printed": d.text() in printed,
        "patterns": [f.pattern for f in d.findings],
        "by_line": [[r.key, r.bytes, r.blocks] for r in d.by_line[:8]],
        "accumulating_keys": [a.key for a in d.accumulating],
        "cell_line_accumulates": any(re.search(r":3 <module>", a.key) for a in d.accumulating),
        "text": d.text(),
    }
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({k: v for k, v in facts.items() if k != "load_s"}, f, indent=1)
    return facts


def _nvml() -> dict[str, int] | None:
    try:
        from gradscope.memory import nvml_device_totals
    except ImportError:
        return None
    return nvml_device_totals(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="cuda-results", help="folder for cuda_bench.json and the OOM snapshot")
    ap.add_argument("--repeat", type=int, default=15, help="interleaved runs per model for the overhead")
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    ap.add_argument("--no-oom", action="store_true", help="skip the OOM section")
    ap.add_argument(
        "--loop-steps", type=int, default=500, help="steps of the recorded training loop (0: skip)"
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; run it on a machine with an NVIDIA GPU.")
        return
    os.makedirs(a.out, exist_ok=True)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "nvml": _nvml(),
        "models": [],
    }
    print(f"torch {report['torch']} on {report['device']} (CUDA {report['cuda']})")
    print(
        f"{'model':28s} {'real peak':>10s} {'recorded':>10s} {'exact':>5s} {'reserved ok':>11s} "
        f"{'predicted':>10s} {'error %':>8s} {'overhead':>8s}"
    )
    for name, make in MODELS.items():
        if a.only and name not in a.only:
            continue
        try:
            row = measure_model(name, make, a.repeat)
            _fresh()  # the model and its tensors died with measure_model's frame
        except Exception as e:  # one model's failure must not hide the others' figures
            row = {"model": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"{name:28s} FAILED {row['error']}")
            _fresh()
        else:
            err = row["prediction_error_pct"]
            print(
                f"{name:28s} {row['real_peak_bytes'] / MiB:9.1f}M {row['recorded_peak_bytes'] / MiB:9.1f}M "
                f"{str(row['peak_exact']):>5s} {str(row['reserved_exact']):>11s} "
                f"{row['predicted_minus_resident_bytes'] / MiB:9.1f}M "
                f"{'n/a' if err is None else f'{err:+.1f}':>8s} {row['overhead']:7.2f}x"
            )
            print(
                "    "
                + "  ".join(
                    f"{k} {v['median'] * 1e3:.2f} ms ({v['min'] * 1e3:.2f}-{v['max'] * 1e3:.2f})"
                    for k, v in row["times_s"].items()
                )
            )
        report["models"].append(row)
        sys.stdout.flush()
    if a.loop_steps:
        try:
            report["loop"] = measure_loop(a.loop_steps)
            print("loop:", {k: v for k, v in report["loop"].items() if k != "summary_head"})
        except Exception as e:
            report["loop"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print("loop section FAILED:", report["loop"]["error"])
        _fresh()
        sys.stdout.flush()
    if not a.no_oom:
        try:
            report["oom"] = measure_oom(a.out)
            print("oom:", {k: v for k, v in report["oom"].items() if k not in ("output_head", "snapshot")})
            snap = report["oom"].get("snapshot") or {}
            print("snapshot read back:", {k: v for k, v in snap.items() if k != "text"})
            print(report["oom"]["output_head"][:3000])
        except Exception as e:
            report["oom"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print("oom section FAILED:", report["oom"]["error"])
    with open(os.path.join(a.out, "cuda_bench.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {os.path.join(a.out, 'cuda_bench.json')}")


if __name__ == "__main__":
    main()
