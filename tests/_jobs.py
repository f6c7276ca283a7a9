"""A real gathered job for the tests that show one: the ranks of ``_dist_worker.py`` started on
127.0.0.1 with the gloo backend, stopped within a time bound."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(out: Path, bound_s: float = 120.0) -> Path:
    """The worker's two-rank scenario (DDP, then FSDP, batches 256 / 512; rank 1 then exits on
    purpose). Returns ``out``: the saved jobs are ``out/ddp/job`` and ``out/fsdp/job``."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    port = _free_port()
    procs = []
    for r in range(2):
        with open(out / f"log.rank{r}", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), "pair", str(r), "2", str(port), str(out)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out))
    deadline = time.monotonic() + bound_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    if not (out / "fsdp" / "job").is_dir():
        logs = "\n".join((out / f"log.rank{r}").read_text(errors="replace")[-2000:] for r in range(2))
        raise RuntimeError(f"the two-rank job did not save its FSDP step:\n{logs}")
    return out
