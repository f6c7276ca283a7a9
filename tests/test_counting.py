"""The counter of the CPU allocator's bytes that measures the diagnosis's runs of a step on copies (a run's
count of NOTE [ the allocator's counter ] in gradscope/_capture/native/hooks.cc, NOTE [ the CPU allocator counts a run ]
in gradscope._analyses.diagnose.counts): its count against the allocator's reports as a recording with ``memory="cpu"``
reads them and the budget's (the tracker's) on steps users write; nothing of it left in the thread's profiler
slot after a run that raised; what a fix that fits as it counts does under the budget; the diagnosis with it
and without it; and the bound that spares a fix its run (NOTE [ runs a fix needs ])."""

from __future__ import annotations

import importlib
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope._capture import native as _native

measure = importlib.import_module("gradscope._analyses.diagnose.measure")
pytestmark = pytest.mark.skipif(
    (shutil.which("c++") or shutil.which("g++")) is None or os.environ.get("GRADSCOPE_NATIVE") == "0",
    reason="no C++ compiler here (or GRADSCOPE_NATIVE=0): the diagnosis counts with the tracker",
)


@pytest.fixture(scope="module")
def counter() -> Any:
    """A new run's counter each call."""
    _native.wait()
    assert _native.counter(run=True) is not None, _native.status()
    return lambda: _native.counter(run=True)


def test_counts_a_runs_own_allocations_until_they_are_freed(counter: Any) -> None:
    c = counter()
    c.start()
    try:
        a = torch.empty(1000)
        assert c.read() == (4000, 4000)
        c.restart()  # a run of its own: what came before is not counted, nor its free
        b = torch.empty(250)
        del a
        assert c.read() == (1000, 1000)
        d = torch.empty(500, dtype=torch.float64)
        del d
        assert c.read() == (1000, 5000)
        seen: list[int] = []

        def other() -> None:  # a thread of the program's own is not the step's: its allocations are not counted
            t = torch.empty(100)
            seen.append(c.read()[0])
            del t

        th = threading.Thread(target=other)
        th.start()
        th.join()
        assert seen == [1000] and c.read() == (1000, 5000)
        v = b[10:20]  # a view allocates nothing
        assert c.read()[0] == 1000 and v.numel() == 10
        w = torch.randn(64, 64, requires_grad=True)  # a backward's allocations are the thread's
        c.restart()
        (w * 2).sum().backward()
        assert w.grad is not None and c.read()[0] >= 64 * 64 * 4  # the gradient, made in backward
    finally:
        assert c.stop()
    e = torch.empty(10_000)  # counts no more once stopped
    assert c.read()[1] < 10_000 * 4
    del b, v, e


def test_counters_nest_and_a_stopped_one_counts_no_more(counter: Any) -> None:
    outer, inner = counter(), counter()
    outer.start()
    try:
        a = torch.empty(100)
        inner.start()
        b = torch.empty(200)
        assert inner.stop()
        assert inner.read() == (800, 800)
        assert outer.read()[0] == 400  # the inner one took the reports while it was on top
        c = torch.empty(300)
        assert outer.read() == (1600, 1600) and inner.read() == (800, 800)
    finally:
        assert outer.stop()
    del a, b, c


def _conv_step() -> Callable[[], None]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(32, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def step() -> None:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _transformer_step() -> Callable[[], None]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(4, 16, 32)

    def step() -> None:
        out = layer(x)
        (out.square().mean() * 2.5).backward()  # a Python number wrapped in a tensor for the operator
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _python_data_step() -> Callable[[], None]:
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, batch_first=True)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 12, 8)

    def step() -> None:
        weights = torch.tensor([[0.5] * 16] * 12)  # a tensor made from Python data
        out, _ = lstm(x)
        (out * weights).sum().backward()
        opt.step()
        opt.zero_grad()

    return step


# each step and the most the kernels' own allocations add to its peak: convolutions' work buffers; a
# Python number wrapped in a tensor (bytes); the CPU LSTM's kernel makes its gates and its workspace below
# the dispatcher, where the tracker does not see them (+40 to +55 % on torch 2.13, +86 % on 2.6)
STEPS = {"conv": (_conv_step, 1.15), "transformer": (_transformer_step, 1.01), "lstm, python data": (_python_data_step, 2.0)}


def _counted(counter: Any, step: Callable[[], None]) -> int:
    c = counter()
    c.start()
    try:
        step()
        return int(c.read()[1])
    finally:
        c.stop()


def _recorded(memory: str, step: Callable[[], None], budget: int | None = None) -> int:
    with gs.record(memory=memory, budget=budget) as rec:
        step()
    return int(rec.recording.peak_bytes)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_count_is_the_allocators_and_never_below_the_budgets(counter: Any, name: str) -> None:
    """Each step's first run (Adam's state, BN statistics: what a diagnosis measures) on three fresh
    copies: the allocator's own reports give the same peak as the counter; the tracker (what a budget
    counts) gives at most as much, and a budget of the counted peak lets the step run."""
    make, most = STEPS[name]
    counted = _counted(counter, make())
    reported = _recorded("cpu", make())
    tracked = _recorded("tracker", make())
    assert counted == reported
    assert tracked <= counted <= tracked * most + 4096, (tracked, counted)
    _recorded("tracker", make(), budget=counted)  # fits as counted: fits the budget (raises where not)


def test_the_counter_is_taken_off_after_a_run_that_raises(counter: Any) -> None:
    w = torch.randn(8, 8, requires_grad=True)
    bench = measure.Bench("y = (w @ w).sum()\ny.backward()\nraise ValueError('the step failed')\n", {"w": w})
    trial = bench.user()
    assert trial.error == "ValueError: the step failed"
    assert bench.counted_by == "allocator"
    # nothing of the run's counter is left in the thread's profiler slot (PyTorch's profiler starts only where
    # nothing holds it)
    with torch.autograd.profiler.profile(profile_memory=True):
        torch.empty(10)


_PROGRAM = """\
import torch
from torch import nn
import gradscope as gs
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1)) for _ in range(6)],
                      nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
try:
    with gs.record(memory="tracker", budget=BUDGET) as rec:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
except torch.OutOfMemoryError:
    pass
"""


def _program(tmp_path: Any, budget: int | None) -> dict[str, Any]:
    path = tmp_path / "program.py"
    path.write_text(_PROGRAM.replace("BUDGET", repr(budget)))
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns


def test_diagnosis_with_the_counter_and_with_the_tracker_agree(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same findings, code and verdicts whichever counts the runs (the tracker where the compiled hooks
    are not in use); the bytes within the kernels' temporaries of each other, the counter's never below."""
    budget = int(0.6 * _program(tmp_path, None)["rec"].recording.peak_bytes)
    used: list[str] = []
    original = measure.Bench._counter

    def counter(self: Any) -> Any:
        c = original(self)
        used.append(c.name)
        return c

    monkeypatch.setattr(measure.Bench, "_counter", counter)
    shown = {}
    for how in ("allocator", "tracker"):
        if how == "tracker":
            monkeypatch.setattr(_native, "counter", lambda run=False: None)
        used.clear()
        ns = _program(tmp_path, budget)
        shown[how] = gs.diagnose(ns["rec"].recording, namespace=ns, progress=False)
        assert used and set(used) == {how}
    a, b = shown["allocator"], shown["tracker"]
    assert a.findings and all(f.code for f in a.findings)
    assert [(f.pattern, f.code, f.fits) for f in a.findings] == [(f.pattern, f.code, f.fits) for f in b.findings]
    for fa, fb in zip(a.findings, b.findings, strict=True):
        assert fb.peak_before <= fa.peak_before <= fb.peak_before * 1.02 + 4096
        assert fb.peak_after <= fa.peak_after <= fb.peak_after * 1.02 + 4096


def _tied_lm(ns: dict[str, Any]) -> str:  # an embedding and a head sharing one weight (GPT-2's)
    emb = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    ns["model"] = nn.Sequential(emb, nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1), head)
    ns["opt"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-3)
    ns["ids"] = torch.randint(0, 64, (16, 32))
    return ("logits = model(ids)\n"
            "loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())\n"
            "loss.backward()\n"
            "opt.step()\n"
            "opt.zero_grad()\n")


def _wide_mlp(ns: dict[str, Any]) -> str:  # the peak in backward, SGD with momentum, zero_grad kept
    ns["model"] = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 256))
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1, momentum=0.9)
    ns["x"] = torch.randn(64, 256)
    return ("opt.zero_grad(set_to_none=False)\n"
            "loss = model(x).square().mean()\n"
            "loss.backward()\n"
            "opt.step()\n")


def _layer_norm_net(ns: dict[str, Any]) -> str:  # the peak in the forward, Adam
    ns["model"] = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 64))
                                  for _ in range(4)])
    ns["opt"] = torch.optim.Adam(ns["model"].parameters(), lr=1e-3)
    ns["x"] = torch.randn(512, 64)
    return ("out = model(x)\n"
            "out.pow(2).mean().backward()\n"
            "opt.step()\n"
            "opt.zero_grad()\n")


@pytest.mark.parametrize("make", [_tied_lm, _wide_mlp, _layer_norm_net], ids=lambda f: f.__name__.strip("_"))
def test_the_least_a_fix_not_run_would_hold_is_never_above_what_it_holds(make: Any) -> None:
    """The bound that spares the optimizer step in backward its run (NOTE [ runs a fix needs ]) against the
    fix run anyway, on the same copies: the fix never holds less than the bound says."""
    sib = importlib.import_module("gradscope._analyses.diagnose.toolbox.step_in_backward")
    shape_of = importlib.import_module("gradscope._analyses.diagnose.step").shape_of

    torch.manual_seed(0)
    ns: dict[str, Any] = {"nn": nn}
    source = make(ns)
    bench = measure.Bench(source, ns)
    user = bench.user()
    assert user.error is None and user.through is not None and len(user.through) == source.count("\n")
    ctx = type("Ctx", (), {"ns": ns})()
    shape = shape_of(source)
    assert shape is not None
    ran = 0
    for finding, _ in sib.propose(ctx, bench, shape, None):
        least = sib._least(ctx, bench, finding.step, ns["opt"])
        if source.startswith("opt.zero_grad"):  # the fix drops the step's first statement: nothing is known
            assert least is None
            continue
        assert least is not None and least > user.resident
        run = measure.Bench(source, ns).measure(finding.step, finding.setup)  # run whatever the bound says
        if run.error is None:
            assert run.peak is not None and run.peak >= least, (run.peak, least)
            ran += 1
    assert ran == (0 if source.startswith("opt.zero_grad") else 1)
    # set_to_none: the user's statements up to the one it changes
    if "set_to_none=False" in source:
        code = source.replace("set_to_none=False", "set_to_none=True")
        least = bench.least(code)
        assert least is None  # its first statement changes: nothing is known before it


def test_a_step_that_starts_the_profiler_is_counted_by_the_tracker(counter: Any) -> None:
    """The profiler starts only where nothing holds the thread's profiler slot, where the counter sits while it
    counts: such a step's runs are counted by the tracker, and they run (the peak of the same step without the
    profiler, counted by the tracker too)."""
    w = torch.randn(32, 32, requires_grad=True)
    plain = measure.Bench("y = (w @ w).tanh().sum()\ny.backward()\n", {"w": w})
    plain.counted_by = "tracker"
    bench = measure.Bench("with torch.profiler.profile():\n    y = (w @ w).tanh().sum()\n    y.backward()\n", {"w": w})
    trial = bench.user()
    assert trial.error is None and bench.counted_by == "tracker"
    assert trial.peak is not None and trial.peak == plain.user().peak
