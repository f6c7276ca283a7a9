"""Whole training loops recorded (loops from tests/_loops.py, written as their projects write them):
what a block over several iterations holds.

Saved bytes are checked against a bare ``saved_tensors_hooks`` pack hook that keeps every storage
it is given alive until the end, so that each storage is one object and no address names two (see
NOTE [ a storage's identity in a block ] in gradscope._capture.saves); the objects handed back to
the program against the program run without gradscope.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import _loops
import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

import gradscope as gs
from gradscope._capture import native as _native
from gradscope._passes import UNSEEN_NODE
from gradscope._passes import iterations as _iterations
from gradscope.recording import format_bytes

MODES = ["off", "cpu", "tracker"]
PAIRS = ["compiled", "python"]


def _pair(pair: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if pair == "python":
        monkeypatch.setattr(_native, "hooks", lambda: None)
    elif _native.hooks() is None:
        pytest.skip(f"the compiled hooks are not in use here: {_native.status()['reason']}")


def _bare_saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the distinct storages a bare pack hook saw saved by ``run``: every storage is kept
    alive to the end (one object each), so their keys name one storage each."""
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        kept.setdefault(s._cdata, s)
        return t.detach() if t.requires_grad else t

    with saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(s.nbytes() for s in kept.values())


LOOPS: dict[str, Callable[[], Callable[[int], Any]]] = {
    "word_language_model": lambda: _loops.make_word_language_model("LSTM"),
    "dcgan": _loops.make_dcgan,
    "wgan_gp": _loops.make_wgan_gp,
}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", list(LOOPS))
def test_saved_bytes_of_a_loop_equal_a_bare_hooks(loop: str, mode: str, pair: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Three iterations, a backward each (TBPTT over chunks, a GAN's critic and generator steps):
    a storage freed by one chunk's backward and a new one made at its address in the next are two
    storages (each storage id's saves have one size), and the saves of a graph dropped before any
    backward (WGAN-GP's ``fake = generator(z).detach()``) are counted, on unseen nodes that name the
    generator's modules."""
    _pair(pair, monkeypatch)
    expected = _bare_saved_bytes(lambda: LOOPS[loop]()(3))
    train = LOOPS[loop]()
    names = {"dcgan": ("netG", "netD"), "wgan_gp": ("generator", "critic")}.get(loop)
    given = dict(zip(names, train.models, strict=True)) if names else None  # type: ignore[attr-defined]
    with gs.record(memory=mode, modules=given) as rec:
        train(3)
    r = rec.recording
    assert r is not None and r.complete
    assert r.saved_bytes == expected
    sizes: dict[int, set[int]] = {}
    for s in r.saved:
        sizes.setdefault(s.storage, set()).add(s.bytes)
    assert all(len(v) == 1 for v in sizes.values())
    unseen = [n for n in r.nodes if n.name == UNSEEN_NODE]
    if loop != "wgan_gp":  # DCGAN's G step backpropagates through the fake its D step detached
        assert not unseen
    else:  # the generator's forward under fake.detach(): its BatchNorm and activations saved
        assert names is not None and unseen and {str(n.module).split(".")[0] for n in unseen} == {names[0]}
        assert any(UNSEEN_NODE in note for note in r.notes)


def _saved_object_identity() -> tuple[bool, bool]:
    """The body of PyTorch's ``test_checkpointing_without_reentrant_saved_object_identity`` (its
    test/test_autograd.py): a custom Function saves a tensor that needs no grad; read back in its
    backward it is the object saved, also when a non-reentrant checkpoint saved it first (as its
    input) and the Function saved it again in the recomputation."""
    x_backward = None

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx: Any, x: torch.Tensor) -> Any:
            nonlocal x_backward
            (x_backward,) = ctx.saved_tensors
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    first = b is x_backward
    x_backward = None
    checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    return first, b is x_backward


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", MODES)
def test_pytorchs_saved_object_identity_test_passes_recorded(mode: str, pair: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _pair(pair, monkeypatch)
    assert _saved_object_identity() == (True, True)  # as PyTorch's test asserts, without gradscope
    with gs.record(memory=mode) as rec:
        got = _saved_object_identity()
    assert got == (True, True)
    r = rec.recording
    assert r is not None and r.complete and not any("internal error" in n for n in r.notes)


@pytest.mark.parametrize("pair", PAIRS)
def test_one_object_saved_twice_is_checked_for_in_place_changes_per_save(pair: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save of one object keeps its own version (see NOTE [ one object saved twice ]): a change
    between the two saves fails the first save's backward, as without gradscope, and not the second's."""
    _pair(pair, monkeypatch)

    def run() -> list[str]:
        w = torch.ones(4, requires_grad=True)
        c = torch.full((4,), 2.0)
        first = (w * c).sum()  # saves c (version 0)
        with torch.no_grad():
            c.add_(1)  # version 1
        second = (w * c).sum()  # saves c again (version 1)
        errors = []
        for loss in (second, first):
            try:
                loss.backward()
            except RuntimeError as e:
                errors.append("modified by an inplace operation" in str(e))
        return errors

    plain = run()
    assert plain == [True]  # the first save's backward fails, the second's does not
    with gs.record(memory="off"):
        assert run() == plain


# ----------------------------------------------------------------------------------------------
# iterations (see NOTE [ iterations ] in gradscope._passes.iterations)
# ----------------------------------------------------------------------------------------------
N_LONG = _iterations.HEAD + 2 * _iterations.KEEP_LAST + 4  # past the head: the loop is cut


def _profiled_peaks(train: Callable[[int], Any], n: int) -> list[tuple[int, int]]:
    """Each iteration's (peak, end) live bytes of a plain run, read independently: PyTorch's own
    profiler over the loop, the CPU allocator's reports (of memory allocated in the loop: a free of
    an address not allocated in it is older memory) summed from the loop's start and cut where each
    optimizer step ends (its ``Optimizer.step`` scope, which is where the recorder ends an iteration)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        train(n)
    steps: list[int] = []
    mem: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.name == "[memory]":
            mem.append((ev.start_time_ns, ev.extra_fields.alloc_size, ev.extra_fields.ptr))
        elif ev.name.startswith("Optimizer.step#"):
            steps.append(ev.end_time_ns)
    steps.sort()
    mem.sort()
    out: list[tuple[int, int]] = []
    live = peak = 0
    k = 0
    alive: dict[int, int] = {}
    for t, delta, ptr in mem:
        while k < len(steps) and t > steps[k]:
            out.append((peak, live))
            peak, k = live, k + 1
        if delta > 0:
            alive[ptr] = delta
        elif alive.pop(ptr, None) is None:
            continue
        live += delta
        peak = max(peak, live)
    while k < len(steps):
        out.append((peak, live))
        peak, k = live, k + 1
    return out


@pytest.mark.parametrize("keep", ["item", "loss"])
def test_each_iterations_peak_equals_the_allocators_reports_of_a_plain_run(keep: str) -> None:
    """memory="cpu" over a loop cut into pieces: the head read from the profiler, the rest from the
    allocator's counter (see NOTE [ a long loop's memory ] in gradscope.memory); every iteration's
    peak and end equal those PyTorch's profiler gives a plain run of the same loop."""
    expected = _profiled_peaks(_loops.make_classifier(keep), N_LONG)
    train = _loops.make_classifier(keep)
    with gs.record(memory="cpu") as rec:
        train(N_LONG)
    r = rec.recording
    assert r is not None and r.loop is not None  # cut
    assert [(it.peak_bytes, it.end_bytes) for it in r.iterations] == expected
    assert [it.optimizer_steps for it in r.iterations] == [1] * N_LONG


@pytest.mark.parametrize("mode", ["cpu", "tracker"])
@pytest.mark.parametrize("keep", ["loss", "output", "item"])
def test_growth_names_the_line_that_leaks_and_steady_loops_are_steady(mode: str, keep: str) -> None:
    """A list of losses kept as tensors, or of outputs, grows by the bytes of what it keeps each
    iteration (measured on the list itself), named by the line that made them; the same loop keeping
    ``loss.item()`` is steady."""
    train = _loops.make_classifier(keep)
    with gs.record(memory=mode) as rec:
        kept = train(N_LONG)
    r = rec.recording
    assert r is not None and len(r.iterations) == N_LONG
    if keep == "item":
        assert r.growth == () and r.steady() is True
        return
    per = kept[-1].untyped_storage().nbytes()
    assert r.steady() is False
    sites = [g for g in r.growth if g.site]
    assert len(sites) == 1, r.growth
    g = sites[0]
    assert g.bytes_per_iteration == per and g.site.startswith("_loops.py:")
    line = int(g.site.split(":")[1].split()[0])
    made = "loss = F.cross_entropy" if keep == "loss" else "out = model(x)"
    assert made in _loops_source(line)
    whole = next(g for g in r.growth if not g.site)
    assert whole.bytes_per_iteration == per


def _loops_source(line: int) -> str:
    import inspect

    return inspect.getsource(_loops).splitlines()[line - 1]


@pytest.mark.parametrize("mode", ["cpu", "tracker", "off"])
def test_a_long_loop_keeps_the_detail_of_the_iterations_that_matter(mode: str) -> None:
    """The head, the last iterations, the one with the highest peak and one named with keep= keep
    their detail; the others only their rows. Each kept part is a recording of its iterations (its
    saves those a bare pack hook sees in one iteration); the file round-trips."""
    named = _iterations.HEAD + 3
    train = _loops.make_classifier("output")  # the peak grows: the last iteration has it
    with gs.record(memory=mode, keep=[named]) as rec:
        train(N_LONG)
    r = rec.recording
    assert r is not None and r.loop is not None
    kept = {it.index for it in r.iterations if it.kept}
    last = set(range(N_LONG - _iterations.KEEP_LAST, N_LONG))
    # the highest peak pushed out of the last ones: the one before them (the loop's peak grows)
    peak = {N_LONG - _iterations.KEEP_LAST - 1} if mode != "off" else set()
    assert kept == set(range(_iterations.HEAD)) | {named} | last | peak
    details = sorted([r.loop.detail, *(p.loop.detail for p in r.loop.parts if p.loop is not None)])
    assert details[0] == (0, _iterations.HEAD - 1) and all(a == b for a, b in details[1:])
    assert r.loop.detail == ((N_LONG - 1, N_LONG - 1) if mode != "off" else r.loop.detail)
    one = _bare_saved_bytes(lambda: _loops.make_classifier("item")(1))
    for p in r.loop.parts[1:]:  # one iteration each: its saves are one step's
        assert p.saved_bytes == one
    assert r.saved_bytes == one and r.iterations[-1].saved_bytes == one
    assert gs.Recording.from_dict(json.loads(r.to_json())) == r


@pytest.mark.parametrize("mode", MODES)
def test_a_long_loop_recorded_trains_as_without_gradscope(mode: str) -> None:
    """Every piece's hooks swapped in mid-loop: the parameters after the loop are bit-equal to a plain
    run's, and nothing stays installed (hooks, the profiler slot: a profiler starts after it)."""
    from conftest import saved_tensors_hooks_active

    plain = _loops.make_hf_accumulation()
    plain(N_LONG)
    train = _loops.make_hf_accumulation()
    with gs.record(memory=mode) as rec:
        train(N_LONG)
    for (name, a), b in zip(plain.model.named_parameters(), train.model.parameters(), strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a, b), name
    r = rec.recording
    assert r is not None and r.loop is not None
    # an iteration is an optimizer step: two backward passes each (gradient accumulation)
    assert len(r.iterations) == N_LONG and all(it.backward_passes == 2 for it in r.iterations)
    assert not saved_tensors_hooks_active()
    assert not torch.autograd.profiler._is_profiler_enabled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(3).sum()


def test_iterations_of_loops_nobody_here_wrote() -> None:
    """word_language_model's TBPTT loop (no optimizer: a backward per chunk), DCGAN's loop (a D and
    a G iteration per batch), a WGAN-GP loop (5 critic iterations per generator iteration)."""
    lm = _loops.make_word_language_model("LSTM")
    with gs.record(memory="tracker") as rec:
        lm(N_LONG)
    r = rec.recording
    assert r is not None and [it.backward_passes for it in r.iterations] == [1] * N_LONG
    assert [it.optimizer_steps for it in r.iterations] == [0] * N_LONG and r.steady() is True
    gan = _loops.make_dcgan()
    with gs.record(memory="tracker") as rec:
        gan(8)
    r = rec.recording
    assert r is not None and [it.backward_passes for it in r.iterations] == [2, 1] * 8
    wgan = _loops.make_wgan_gp()
    with gs.record(memory="off") as rec:
        wgan(10)
    r = rec.recording
    assert r is not None
    assert [it.backward_passes for it in r.iterations] == [2, 2, 2, 2, 2, 1] * 2  # a grad + a backward per critic step


def test_a_profiler_started_inside_a_long_loop_runs() -> None:
    """After the head, memory="cpu" counts with the allocator's counter in the thread's profiler
    slot; a profiler the program starts there gets the slot (the counter steps aside, said in the notes)."""
    train = _loops.make_classifier("item")
    with gs.record(memory="cpu") as rec:
        train(N_LONG)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train(1)
    assert any(e.name.startswith("aten::") for e in prof.events())
    r = rec.recording
    assert r is not None and r.loop is not None
    assert any("took the allocator's reports" in n for p in (r, *r.loop.parts) for n in p.notes)


# ----------------------------------------------------------------------------------------------
# as the loop runs (see NOTE [ a live loop ] in gradscope._views.widget)
# ----------------------------------------------------------------------------------------------
def test_progress_lines_say_each_stretch_of_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    """gs.record(progress=N): a line on stderr every N iterations, as the loop runs, with the last
    iteration's memory at its end as its row says."""
    train = _loops.make_classifier("output")
    seen: list[int] = []
    with gs.record(memory="tracker", progress=5) as rec:
        for _ in range(N_LONG):
            train(1)
            seen.append(len([ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gradscope: iteration")]))
    r = rec.recording
    assert r is not None
    assert sum(seen) == N_LONG // 5 and seen[4] == 1  # the fifth iteration's line came as it ended
    with gs.record(memory="tracker", progress=5) as rec:
        train(10)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gradscope: iteration")]
    r = rec.recording
    assert r is not None and len(lines) == 2
    assert lines[1].startswith("gradscope: iteration 9:")
    assert f"{format_bytes(r.iterations[9].end_bytes)} alive at its end" in lines[1]
    with pytest.raises(gs.GradscopeError, match="progress="):
        gs.record(progress=0)


def test_iterations_so_far_are_the_rows_while_the_loop_runs() -> None:
    """What the live widget reads from another thread: how many iterations ended, and the rows made
    since a given one, equal to the finished recording's."""
    train = _loops.make_classifier("item")
    got: list[tuple[int, int]] = []
    rec = gs.record(memory="tracker")
    assert rec.iterations_so_far() == (0, {})
    with rec:
        for _ in range(6):
            train(1)
            count, cols = rec.iterations_so_far(2)
            got.append((count, len(cols["index"])))
    assert got == [(k, max(k - 2, 0)) for k in range(1, 7)]
    r = rec.recording
    assert r is not None
    _, cols = rec.iterations_so_far(0)
    assert cols["peak"] == [it.peak_bytes for it in r.iterations]


def test_the_failing_iteration_is_the_detail_and_without_the_counter_every_iteration_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that fails in an iteration past the head: that iteration is the recording's detail (its
    row says so). memory="cpu" without the compiled hooks (no allocator counter) keeps every iteration,
    as keep="all", and says so in the notes."""
    train = _loops.make_classifier("item")
    bad = _iterations.HEAD + 5
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with gs.record(memory="tracker") as rec:
            for k in range(N_LONG):
                if k == bad:
                    train.model(torch.randn(3, 31))  # type: ignore[attr-defined]  # a wrong shape
                train(1)
    r = rec.recording
    assert r is not None and r.loop is not None and not r.complete
    assert r.loop.detail == (bad, bad) and r.iterations[bad].failed and len(r.iterations) == bad + 1
    monkeypatch.setattr(_native, "hooks", lambda: None)
    with gs.record(memory="cpu") as rec:
        train(N_LONG)
    r = rec.recording
    assert r is not None and r.loop is None and all(it.kept for it in r.iterations)
    assert len(r.iterations) == N_LONG and any("the compiled hooks are not in use" in n for n in r.notes)


def test_a_loop_without_optimizer_steps_is_cut_at_each_backward_once_it_is_known_to_be_one() -> None:
    """word_language_model updates its parameters by hand: after CONFIRM backward passes with no
    optimizer step, each backward's end ends an iteration (before, they are taken back by a first
    optimizer step: see LoopTracking.ended), and past the head each iteration is a piece of its own."""
    from gradscope._capture.loop import CONFIRM

    lm = _loops.make_word_language_model("GRU")
    with gs.record(memory="tracker") as rec:
        lm(N_LONG)
    r = rec.recording
    assert r is not None and r.loop is not None and CONFIRM <= _iterations.HEAD
    details = sorted([r.loop.detail, *(p.loop.detail for p in r.loop.parts if p.loop is not None)])
    assert details[0] == (0, _iterations.HEAD - 1) and all(a == b for a, b in details[1:])
    assert len(r.iterations) == N_LONG and all(it.backward_passes == 1 for it in r.iterations)


def test_frees_after_an_iterations_end_are_kept_across_a_cut() -> None:
    """An AdamW loop frees memory after the optimizer step's end (the mark of an iteration) and before
    the cut: those frees belong to the next iteration (see NOTE [ what a piece leaves after its last
    iteration ] in gradscope._passes.iterations). Dropped, the tracker's memory at each iteration's end
    wandered and grew (and CUDA's samples grew by 1 KiB an iteration on a real GPU): every end here
    equals the first, and the loop is steady."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)

    def loop(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

    loop(3)  # the optimizer's state exists before the block
    with gs.record(memory="tracker") as rec:
        loop(80)
    r = rec.recording
    assert r is not None and r.loop is not None and len(r.iterations) == 80
    ends = [it.end_bytes for it in r.iterations]
    assert ends == [ends[0]] * 80
    assert r.steady() is True and r.growth == ()
