"""gs.compare: statuses, error figures, identical inputs between candidates, restored state, rerun."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope._base import registry as _views
from gradscope.compare import Comparison, Row, tolerance
from gradscope.errors import GradscopeError
from gradscope.strategies import mixed_grad


def _mixed_setup(depth: int = 3):
    torch.manual_seed(0)
    G = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(32, 32), nn.Tanh())])

    def f(y, g):
        return ((y + g) ** 3).sum()

    z = torch.randn(8, 32)
    y = torch.randn(8, 32, requires_grad=True)
    return f, G, z, y


def test_seed_000_table_forward_ad_ok_split_wrong():
    f, G, z, y = _mixed_setup()
    cmp = gs.compare(
        {m: (lambda m=m: mixed_grad(f, G, z, y, method=m)) for m in ("create_graph", "forward_ad", "split")},
        memory="cpu",
    )
    assert isinstance(cmp, Comparison)
    assert cmp.reference == "create_graph"
    assert [r.name for r in cmp.rows] == ["create_graph", "forward_ad", "split"]
    ref, fwd, split = cmp.rows
    assert (ref.status, fwd.status, split.status) == ("ok", "ok", "wrong")
    assert ref.max_abs_error == 0.0 and ref.reference and not fwd.reference
    assert fwd.max_abs_error is not None and fwd.max_abs_error < 1e-4
    assert split.max_abs_error is None
    assert split.message == "output is None where the reference has a tensor"
    # forward AD keeps nothing of G: fewer saved bytes and a lower peak than double backward
    assert fwd.saved_bytes < ref.saved_bytes / 4
    assert fwd.peak_bytes < ref.peak_bytes
    for r in cmp.rows:
        assert r.peak_bytes == r.recording.peak_bytes
        assert r.saved_bytes == r.recording.saved_bytes
        assert len(r.times_s) == 3 and r.time_s == sorted(r.times_s)[1]
    text = cmp.summary()
    assert "reference 'create_graph'" in text
    assert "split: output is None where the reference has a tensor" in text
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["create_graph", "forward_ad", "split"]


def test_exact_saved_bytes_and_gradient_checked():
    w = torch.ones(1000, requires_grad=True)

    def exp_twice():
        (w.exp() * 2).sum().backward()

    def wrong_factor():
        (w.exp() * 3).sum().backward()

    cmp = gs.compare({"a": exp_twice, "b": exp_twice, "c": wrong_factor}, memory="cpu", repeat=1)
    a, b, c = cmp.rows
    assert a.saved_bytes == 4000  # exp saves its 1000-float result; the constant factor saves nothing
    assert a.peak_bytes == b.peak_bytes
    assert (a.status, b.status, c.status) == ("ok", "ok", "wrong")
    assert b.max_abs_error == 0.0
    # the outputs are both None: only the gradient tells them apart; e = 2.718..., so |3e - 2e| = e
    assert c.max_abs_error == pytest.approx(torch.e, rel=1e-6)
    assert c.message.startswith("tensor#1(1000,).grad: max abs error 2.72 above the tolerance")
    assert w.grad is None  # compare leaves no gradient behind


def test_candidate_that_raises_does_not_stop_the_others():
    x = torch.randn(4, requires_grad=True)

    def boom():
        raise ValueError("shape (3, 4) is not what I wanted")

    cmp = gs.compare({"ok": lambda: x * 2, "boom": boom, "after": lambda: x + x}, memory="off")
    assert [r.status for r in cmp.rows] == ["ok", "raised", "ok"]
    bad = cmp.row("boom")
    assert bad.message == "ValueError: shape (3, 4) is not what I wanted"
    assert bad.time_s is None and bad.max_abs_error is None
    assert bad.recording is not None and bad.recording.complete is False
    assert cmp.row("after").max_abs_error == 0.0


def test_raising_reference_leaves_others_unchecked():
    cmp = gs.compare({"ref": lambda: 1 / 0, "b": lambda: torch.ones(2)}, memory="off", repeat=1)
    assert cmp.row("ref").status == "raised" and cmp.row("ref").message.startswith("ZeroDivisionError")
    assert cmp.row("b").status == "ok" and cmp.row("b").max_abs_error is None
    assert "reference 'ref' raised" in cmp.row("b").message


def test_wrong_statuses_say_which():
    lin = nn.Linear(3, 2)
    x = torch.randn(5, 3)

    def ref():
        out = lin(x)
        out.pow(2).sum().backward()
        return {"out": out, "pair": (out.sum(), out.mean())}

    def no_backward():
        out = lin(x)
        return {"out": out, "pair": (out.sum(), out.mean())}

    def transposed():
        out = lin(x)
        out.pow(2).sum().backward()
        return {"out": out.t(), "pair": (out.sum(), out.mean())}

    def fewer():
        out = lin(x)
        out.pow(2).sum().backward()
        return {"out": out}

    def slightly_off():
        out = lin(x)
        out.pow(2).sum().backward()
        return {"out": out + 1e-7, "pair": (out.sum(), out.mean())}

    cmp = gs.compare(
        {
            "ref": ref,
            "no_backward": no_backward,
            "transposed": transposed,
            "fewer": fewer,
            "slightly_off": slightly_off,
        },
        memory="off",
        repeat=1,
    )
    st = {r.name: r.status for r in cmp.rows}
    assert st == {
        "ref": "ok",
        "no_backward": "wrong",
        "transposed": "wrong",
        "fewer": "wrong",
        "slightly_off": "ok",
    }
    assert cmp.row("no_backward").message == (
        "Linear.weight.grad is None where the reference has a tensor; "
        "Linear.bias.grad is None where the reference has a tensor"
    )
    assert cmp.row("transposed").message == "output['out']: shape mismatch (2, 5) vs the reference's (5, 2)"
    assert cmp.row("fewer").message.startswith("output structure differs: [output['out']] vs the reference's")
    assert 0 < cmp.row("slightly_off").max_abs_error < 1e-6
    assert lin.weight.grad is None


def test_tolerance_is_dtype_aware():
    assert tolerance(torch.float64) == (1e-9, 1e-12)
    assert tolerance(torch.float16) == (1e-2, 1e-4)
    assert tolerance(torch.int64) == (0.0, 0.0)
    base = torch.linspace(1, 2, 10)
    for dtype, delta, status in [
        (torch.float32, 1e-6, "ok"),
        (torch.float32, 1e-3, "wrong"),
        (torch.float64, 1e-6, "wrong"),
        (torch.float16, 1e-3, "ok"),
        (torch.int64, 1, "wrong"),
    ]:
        ref = base.to(dtype) if dtype != torch.int64 else torch.arange(10)
        cmp = gs.compare(
            {"r": lambda ref=ref: ref, "c": lambda ref=ref, d=delta: ref + d}, memory="off", repeat=1
        )
        assert cmp.row("c").status == status, (dtype, delta)
    cmp = gs.compare({"r": lambda: base, "c": lambda: base + 1e-3}, memory="off", repeat=1, atol=1e-2)
    assert cmp.row("c").status == "ok"


def test_nan_where_the_reference_has_none_is_wrong():
    cmp = gs.compare(
        {"r": lambda: torch.ones(3), "c": lambda: torch.tensor([1.0, float("nan"), 1.0])}, memory="off"
    )
    assert cmp.row("c").status == "wrong"
    assert "NaN" in cmp.row("c").message


def test_candidates_see_identical_rng_and_module_state():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    x = torch.randn(16, 4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    draws = []

    def run():
        out = net(x)  # dropout draws from the RNG, batch norm updates its running stats
        draws.append(torch.rand(1).item())
        out.sum().backward()
        return out, net[1].running_mean.clone(), net[1].num_batches_tracked.clone()

    cmp = gs.compare({"a": run, "b": run}, memory="off", repeat=2)
    assert [r.status for r in cmp.rows] == ["ok", "ok"]
    assert cmp.row("b").max_abs_error == 0.0
    assert len(draws) == 8 and len(set(draws)) == 1  # (warm-up + recorded + 2 timed runs) x 2
    # everything is back as it was: buffers, parameters, no gradients
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in net.parameters())


def test_without_restoring_rng_the_runs_would_differ():
    # guards the test above: two dropout calls in a row do draw different masks
    x = torch.ones(100)
    assert not torch.equal(nn.functional.dropout(x, 0.5), nn.functional.dropout(x, 0.5))


def test_modules_argument_names_gradients_and_restores_state():
    net = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    old = torch.full((2, 2), 7.0)
    net.weight.grad = old

    def step():
        net(x).sum().backward()
        with torch.no_grad():
            net.weight.add_(1.0)  # a candidate that changes the model
        return net.weight.clone()

    def step_twice():
        net(x).sum().backward()
        with torch.no_grad():
            net.weight.add_(2.0)
        return net.weight.clone()

    w0 = net.weight.detach().clone()
    cmp = gs.compare({"one": step, "two": step_twice}, modules={"net": net}, memory="off")
    assert cmp.row("two").status == "wrong"
    assert cmp.row("two").max_abs_error == pytest.approx(1.0)
    assert cmp.row("two").message.startswith("output: max abs error 1 above")
    assert torch.equal(net.weight.detach(), w0)
    assert net.weight.grad is old  # the user's gradient is given back, untouched
    assert torch.equal(old, torch.full((2, 2), 7.0))


def test_rerun_from_a_background_thread():
    f, G, z, y = _mixed_setup(depth=2)
    cmp = gs.compare(
        {m: (lambda m=m: mixed_grad(f, G, z, y, method=m)) for m in ("create_graph", "forward_ad")},
        memory="cpu",
        repeat=1,
    )
    first = cmp.row("forward_ad")
    t = threading.Thread(target=cmp.rerun, args=(["forward_ad"],))
    t.start()
    t.join(60)
    assert not t.is_alive()
    again = cmp.row("forward_ad")
    assert again is not first and again.recording is not first.recording
    assert again.status == "ok" and again.saved_bytes == first.saved_bytes
    assert cmp.row("create_graph") is cmp.rows[0]
    cmp.rerun(["create_graph"])
    assert cmp.row("create_graph").max_abs_error == 0.0
    with pytest.raises(GradscopeError, match="unknown candidate"):
        cmp.rerun(["nope"])


def test_bad_input_is_a_gradscope_error():
    with pytest.raises(GradscopeError, match="non-empty dict"):
        gs.compare({})
    with pytest.raises(GradscopeError, match="candidate 'a' is a int, not a callable"):
        gs.compare({"a": 3})
    with pytest.raises(GradscopeError, match="reference 'c' is not a candidate; use one of 'a', 'b'"):
        gs.compare({"a": lambda: None, "b": lambda: None}, reference="c")
    with pytest.raises(GradscopeError, match="repeat must be an int >= 1"):
        gs.compare({"a": lambda: None}, repeat=0)
    with pytest.raises(GradscopeError, match=r"returned a str at output\[1\]; compare\(\) expects a tensor"):
        gs.compare({"a": lambda: (torch.ones(1), "done")}, memory="off")
    with pytest.raises(GradscopeError, match="modules= takes nn.Module"):
        gs.compare({"a": lambda: None}, modules=[3])


def test_views_delegate_to_html_and_widget(monkeypatch, tmp_path):
    cmp = gs.compare({"a": lambda: torch.ones(1)}, memory="off", repeat=1)
    # the comparison's HTML view, and what the notebook shows (display: its widget, text and HTML views)
    monkeypatch.setitem(_views._VIEWS, (_views.ViewKind.HTML, Comparison),
                        lambda c: f"<p>{c.rows[0].name}:{c.rows[0].status}</p>")
    monkeypatch.setattr(_views, "display", lambda c: {"text/plain": repr(c)})
    out = tmp_path / "cmp.html"
    assert cmp.to_html(out) == str(out)  # the path, not the page (as a cell's last line)
    assert out.read_text() == cmp.to_html() == "<p>a:ok</p>"
    assert cmp._repr_mimebundle_() == {"text/plain": "Comparison(reference='a': a=ok)"}


def test_row_is_frozen():
    row = Row("a", "ok", 1, 2, 0.1, 0.0, "", None)
    with pytest.raises(AttributeError):
        row.status = "wrong"  # type: ignore[misc]


def test_recorded_run_carries_no_compare_copies():
    # a 4 MB weight: if compare's snapshot of the module happened inside the recording, the reference's
    # peak would be 4 MB higher than a plain recording of the same code
    torch.manual_seed(0)
    lin = nn.Linear(1000, 1000)
    x = torch.randn(2, 1000)

    def step():
        lin(x).pow(2).sum().backward()

    with gs.record(memory="cpu") as rec:
        step()
    lin.zero_grad(set_to_none=True)
    cmp = gs.compare({"a": step, "b": step}, memory="cpu", repeat=1)
    assert cmp.row("a").peak_bytes == cmp.row("b").peak_bytes == rec.recording.peak_bytes
    assert cmp.row("a").saved_bytes == rec.recording.saved_bytes
    assert rec.recording.peak_bytes < 4 * 1000 * 1000 + 64 * 1024  # the weight's gradient, plus little


def test_strategy_memory_claims_hold_when_recorded():
    from gradscope.strategies import PenaltyBranches, many_inputs_backward

    # seed 001: the two-pass peak does not grow with the number of inputs; the stacked one does
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 4))
    peaks = {}
    for n in (2, 16):
        xs = [torch.randn(16, 32) for _ in range(n)]
        cmp = gs.compare(
            {
                m: (lambda m=m, xs=xs: many_inputs_backward(f, xs, lambda zs: zs.pow(2).mean(), method=m))
                for m in ("stacked", "two_pass")
            },
            modules=f,
            memory="cpu",
            repeat=1,
        )
        assert [r.status for r in cmp.rows] == ["ok", "ok"]
        peaks[n] = (cmp.row("stacked").peak_bytes, cmp.row("two_pass").peak_bytes)
    assert peaks[16][1] <= 1.2 * peaks[2][1]
    assert peaks[16][0] > 4 * peaks[2][0]

    # seed 003: releasing each branch early keeps one branch alive instead of all of them
    trunk = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])
    x = torch.randn(8, 32)

    def step(method):
        pb = PenaltyBranches(method)
        h = x
        for layer in trunk:
            h = torch.tanh(layer(h))
            pb.add((h.unsqueeze(2) * h.unsqueeze(1)).tanh().sigmoid().pow(2).mean(), at=h)
        return pb.backward(h.sum())

    cmp = gs.compare({m: (lambda m=m: step(m)) for m in ("joint", "early")}, memory="cpu", repeat=1)
    assert cmp.row("early").status == "ok"
    assert cmp.row("early").peak_bytes <= 0.5 * cmp.row("joint").peak_bytes


def test_rerun_starts_from_the_compared_state_and_keeps_later_training():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    x = torch.randn(4, 3)

    def run():
        out = net(x)
        out.sum().backward()
        return out

    cmp = gs.compare({"a": run, "b": run}, memory="off", repeat=1)
    with torch.no_grad():  # the user trains on after the comparison
        net.weight.add_(1.0)
    trained = net.weight.detach().clone()
    marker = torch.ones(2, 3)
    net.weight.grad = marker
    seed_state = torch.get_rng_state()
    cmp.rerun(["b"])
    assert cmp.row("b").status == "ok" and cmp.row("b").max_abs_error == 0.0  # same inputs as before
    assert torch.equal(net.weight.detach(), trained)
    assert net.weight.grad is marker and net.bias.grad is None
    assert torch.equal(torch.get_rng_state(), seed_state)


def test_named_modules_name_the_recordings() -> None:
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    x = torch.randn(2, 4)
    cmp = gs.compare({"a": lambda: G(x).sum().backward(), "b": lambda: G(x).pow(2).sum().backward()},
                     reference="a", modules={"G": G})
    for row in cmp.rows:
        leaves = {n.leaf for n in row.recording.nodes if n.leaf}
        assert leaves == {"G.0.weight", "G.0.bias"}
        assert {n.module for n in row.recording.nodes if n.name == "AddmmBackward0"} == {"G.0"}


def test_time_is_the_median_of_plain_runs_after_warm_up_and_recording():
    import time as _time

    calls: list[int] = []
    # warm-up, recorded run, then three timed runs: only the last three are timed
    naps = [0.0, 0.5, 0.02, 0.1, 0.05]
    x = torch.ones(3, requires_grad=True)

    def napper():
        _time.sleep(naps[len(calls)])
        calls.append(1)
        return x * 2

    cmp = gs.compare({"nap": napper}, memory="off", repeat=3)
    r = cmp.row("nap")
    assert len(calls) == 5 and len(r.times_s) == 3
    assert r.time_min_s == min(r.times_s) and r.time_max_s == max(r.times_s)
    assert r.time_s == sorted(r.times_s)[1]
    # the 0.5 s recorded run is not among them; the 20, 50 and 100 ms runs are
    assert 0.02 <= r.time_min_s and 0.05 <= r.time_s and 0.1 <= r.time_max_s < 0.45
    assert r.threads == torch.get_num_threads()
    assert r.time_spread == pytest.approx(r.time_max_s / r.time_min_s)
    text = cmp.summary()
    assert f"{torch.get_num_threads()} torch thread(s)" in text
    assert "median (min-max) of 3 run(s) after a warm-up" in text
    # 100 ms / 20 ms is a spread of about 5x: flagged as too wide to trust
    assert "nap: times vary" in text and "too wide to trust" in text


def test_rerunning_part_of_a_set_marks_the_rest_stale_and_best_skips_it():
    x = torch.randn(64, requires_grad=True)

    def small():
        return x.exp()

    def big():
        return torch.cat([x, x, x, x]).exp()[:64]

    cmp = gs.compare({"small": small, "big": big}, memory="cpu", repeat=1)
    assert [r.run for r in cmp.rows] == [1, 1] and cmp.stale() == []
    # 'small' saves 256 bytes of exp's result, 'big' 1 KiB: small wins peak and saved
    assert cmp.best()["saved"] == ["small"] and cmp.best()["peak"] == ["small"]
    assert cmp.row("big").status == "ok"
    cmp.rerun(["big"])
    assert [r.run for r in cmp.rows] == [1, 2]
    assert cmp.stale() == ["small"]
    assert cmp.best()["saved"] == ["big"]  # the stale row competes no more
    assert "stale: small measured in an earlier round than run 2" in cmp.summary()
    assert "small (ref) (stale)" in cmp.summary()
    cmp.rerun()  # everything, as one set
    assert [r.run for r in cmp.rows] == [3, 3] and cmp.stale() == []
    assert cmp.best()["saved"] == ["small"]


def test_summary_names_peak_at_once_apart_from_saved_total_with_ratios():
    f, G, z, y = _mixed_setup()
    cmp = gs.compare(
        {m: (lambda m=m: mixed_grad(f, G, z, y, method=m)) for m in ("create_graph", "forward_ad")},
        memory="cpu",
        repeat=1,
    )
    from gradscope.compare import saved_total
    from gradscope.figures import PEAK, SAVED_TOTAL, saved_activation_bytes
    from gradscope.recording import format_bytes

    text = cmp.summary()
    header = text.splitlines()[1]
    assert "peak (at once)" in header and "saved (total)" in header and "min-max" in header
    assert f"{PEAK.label}: {PEAK.definition}" in text and f"{SAVED_TOTAL.label}: {SAVED_TOTAL.definition}" in text
    ref, fwd = cmp.rows
    assert saved_total(fwd) == saved_activation_bytes(fwd.recording)
    # the saved total leaves G's weights out: create_graph saves each weight, forward AD none
    assert saved_total(ref) < ref.saved_bytes
    line = next(ln for ln in text.splitlines() if ln.startswith("forward_ad"))
    assert f"{fwd.peak_bytes / ref.peak_bytes:.2f}x" in line
    assert format_bytes(fwd.peak_bytes) + "*" in line  # the lower peak is marked best
