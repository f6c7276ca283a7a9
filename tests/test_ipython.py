"""The notebook extension, driven headless through IPython's own test shell."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import gradscope as gs
from gradscope._notebook import cells as gsc
from gradscope._notebook import ipython as gsi
from gradscope.recording import format_bytes

_MODEL = (
    "import torch, gradscope as gs\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
)


def get_ipython() -> Any:
    """The test shell (started on first use; globalipapp replaces its own get_ipython then)."""
    shell = globalipapp.get_ipython()
    return shell if shell is not None else globalipapp.get_ipython()


def _callbacks(ip: Any) -> dict[str, list[Any]]:
    return {k: list(v) for k, v in ip.events.callbacks.items()}


@pytest.fixture
def ip() -> Iterator[Any]:
    shell = get_ipython()
    before = {
        # IPython loads some of its own magics lazily (%time): compare names, not objects
        "line": set(shell.magics_manager.magics["line"]),
        "cell": set(shell.magics_manager.magics["cell"]),
        "registry": set(shell.magics_manager.registry),
        "custom_exceptions": shell.custom_exceptions,
        "custom_tb": shell.__dict__.get("CustomTB", None),
        "callbacks": _callbacks(shell),
    }
    shell.run_line_magic("load_ext", "gradscope")
    shell.run_cell(_MODEL)
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "gradscope")
        for name in ("model", "r", "rec", "xs", "losses", "b", "a"):
            shell.user_ns.pop(name, None)
        # unloading restored exactly what loading changed
        assert set(shell.magics_manager.magics["line"]) == before["line"]
        assert set(shell.magics_manager.magics["cell"]) == before["cell"]
        reg = shell.magics_manager.registry
        assert {
            k for k in set(reg) ^ before["registry"] if not type(reg[k]).__module__.startswith("IPython.")
        } == set()
        assert "gradscope" not in before["line"] | before["cell"]
        assert shell.custom_exceptions == before["custom_exceptions"]
        assert shell.__dict__.get("CustomTB", None) is before["custom_tb"]
        assert _callbacks(shell) == before["callbacks"]


def test_load_registers_the_magics_and_unload_removes_them() -> None:
    shell = get_ipython()
    shell.run_line_magic("load_ext", "gradscope")
    try:
        assert "gradscope" in shell.magics_manager.magics["cell"]
        assert "gradscope" in shell.magics_manager.magics["line"]
        assert isinstance(shell.magics_manager.registry["GradscopeMagics"], gsi.GradscopeMagics)
        shell.run_line_magic("load_ext", "gradscope")  # twice: harmless
    finally:
        shell.run_line_magic("unload_ext", "gradscope")
    assert "gradscope" not in shell.magics_manager.magics["cell"]
    assert "gradscope" not in shell.magics_manager.magics["line"]
    assert "GradscopeMagics" not in shell.magics_manager.registry
    with pytest.raises(UsageError, match="Line magic function `%gradscope` not found"):
        shell.run_line_magic("gradscope", "oom on")


def test_cell_magic_records_through_run_cell(ip: Any, capsys: Any) -> None:
    res = ip.run_cell(
        "%%gradscope -o r --memory tracker --no-widget\n"
        "a = 2\n%time b = a + 1\nmodel(torch.randn(4, 8)).sum().backward()\n"
    )
    assert res.error_in_exec is None
    out = capsys.readouterr().out
    r = ip.user_ns["r"]
    assert isinstance(r, gs.Recording) and r.complete
    assert ip.user_ns["b"] == 3  # IPython syntax (%time) ran: the cell went through run_cell
    assert "Wall time" in out
    # variable names of the user's modules are the module paths' roots
    assert sorted(n.leaf for n in r.nodes if n.leaf) == [
        "model.0.bias",
        "model.0.weight",
        "model.2.bias",
        "model.2.weight",
    ]
    assert r.where.memory_source == "storage tracker"
    assert r.peak_bytes == 1036 and r.saved_bytes == 448
    assert r.summary() in out


def test_cell_magic_shows_the_recording(ip: Any, capsys: Any) -> None:
    ip.run_cell_magic("gradscope", "-o r --memory off --label tiny", "model(torch.randn(2, 8)).sum()\n")
    out = capsys.readouterr().out
    r = ip.user_ns["r"]
    assert r.label == "tiny" and r.where.memory_source == "off"
    assert "gradscope recording tiny" in out  # the display's text form in a terminal shell


def test_cell_magic_budget_failure_is_recorded_and_diagnosed(ip: Any, capsys: Any) -> None:
    resident = gsc._resident_cpu_bytes(ip.user_ns)
    assert resident >= 644  # the model's parameters, and whatever tensors other tests left
    res = ip.run_cell(
        "%%gradscope --budget 2KiB -o r --no-widget\nxs = [model(torch.randn(64, 8)) for i in range(10)]\n"
    )
    assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)  # the cell counts as failed
    out = capsys.readouterr().out
    r = ip.user_ns["r"]
    assert not r.complete and r.error.startswith("MemoryBudgetExceeded")
    assert r.oom is not None and r.oom.budget == 2048
    assert "MemoryBudgetExceeded" in out
    assert "gradscope diagnosis" in out and "simulated 2.0 KiB device" in out
    assert gsi.last_diagnosis(ip).budget == 2048
    # the model from an earlier cell is resident on the simulated device
    assert r.oom.resident == resident and r.oom.cell_budget == 2048 - resident
    assert f"with 0 B allocated by the cell and {resident} B held by your variables" in out
    # one budget story: every line uses the 2.0 KiB asked for; what the cell could allocate is said once,
    # and every resident byte is named by variable
    d = gsi.last_diagnosis(ip)
    assert sum(b for _, b in d.resident_by_variable) == resident
    assert dict(d.resident_by_variable)["model"] == _param_bytes(ip.user_ns["model"])
    assert out.count(f"could allocate the other {format_bytes(2048 - resident)} of the 2.0 KiB") == 1
    assert "2.0 KiB (2048 bytes) budget" in str(res.error_in_exec)


def _param_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_a_budget_smaller_than_the_variables_says_the_least_budget_in_one_line(ip: Any) -> None:
    model_bytes = _param_bytes(ip.user_ns["model"])
    assert model_bytes == 4 * (8 * 16 + 16 + 16 + 1)
    ip.user_ns["big"] = torch.zeros(3 * 1024 * 1024 // 4)
    try:
        total = gsc._resident_cpu_bytes(ip.user_ns)
        assert gsc._resident_by_variable(ip.user_ns)["big"] == 3 * 1024 * 1024
        assert gsc._resident_by_variable(ip.user_ns)["model"] == model_bytes
        with pytest.raises(UsageError) as e:
            ip.run_cell_magic("gradscope", "--budget 2MiB", "x = 1\n")
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(
            f"gradscope: a 2.0 MiB (2097152 bytes) budget cannot run this cell: your variables already hold "
            f"{format_bytes(total)} ({total} bytes) of CPU tensors (big 3.0 MiB, "
        )
        assert f"model {format_bytes(model_bytes)}" in msg
        assert (
            f"so the least budget that can run it is more than {format_bytes(total)} resident plus what the "
            "cell allocates" in msg
        )
        assert msg.endswith("or add --cell-only to count only what the cell allocates against 2.0 MiB.")
        assert "x" not in ip.user_ns  # the cell did not run
        # --cell-only: the same budget counts only what the cell allocates, so a cell that fits runs
        res = ip.run_cell("%%gradscope --budget 2MiB --cell-only -o r --no-widget\nx = torch.ones(1000)\n")
        assert res.error_in_exec is None and ip.user_ns["x"].shape == (1000,)
        r = ip.user_ns["r"]
        assert r.complete and r.oom is None and r.peak_bytes == 4000
        # and one that allocates more than the budget fails at that allocation, with nothing resident
        res = ip.run_cell("%%gradscope --budget 4KiB --cell-only -o r --no-widget\ny = torch.ones(2000)\n")
        err = res.error_in_exec
        assert isinstance(err, gs.MemoryBudgetExceeded)
        assert (err.requested, err.live, err.budget) == (8000, 0, 4096)
        assert ip.user_ns["r"].oom.budget == 4096 and ip.user_ns["r"].oom.resident == 0
    finally:
        for name in ("big", "x", "y"):
            ip.user_ns.pop(name, None)
    with pytest.raises(UsageError, match=r"budget cannot run this cell: .*\(model \d"):
        ip.run_cell_magic("gradscope", f"--budget {gsc._resident_cpu_bytes(ip.user_ns)}", "x = 1\n")


def test_the_oom_watch_takes_cell_only_too(ip: Any, capsys: Any) -> None:
    ip.user_ns["big"] = torch.zeros(1024 * 1024 // 4)
    try:
        ip.run_line_magic("gradscope", "oom on --budget 64KiB --cell-only")
        assert "a budget of 64.0 KiB (65536 bytes) for what each cell allocates" in capsys.readouterr().out
        res = ip.run_cell("z = torch.ones(1000)\n")  # 1 MiB resident would not leave room for it
        assert res.error_in_exec is None
        res = ip.run_cell("zs = [torch.ones(1000) for i in range(20)]\n")
        assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)
        assert res.error_in_exec.budget == 64 * 1024 and res.error_in_exec.live == 16 * 4000
        capsys.readouterr()
    finally:
        for name in ("big", "z", "zs"):
            ip.user_ns.pop(name, None)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--budget lots", "cannot read the memory size 'lots'"),
        ("--memory gpu", "invalid choice"),
        ("-o 1x", "-o takes a variable name"),
        ("--frobnicate", "unrecognized arguments"),
        ("--cell-only", "--cell-only goes with --budget SIZE"),
    ],
)
def test_cell_magic_mistakes_raise_usage_errors(ip: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("gradscope", line, "x = 1\n")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("oom maybe", "say 'on' or 'off'"),
        ("frobnicate", "unknown command 'frobnicate'"),
        ("oom on --budget -3", "cannot read the memory size"),
        ("oom on --cell-only", "--cell-only goes with --budget SIZE"),
    ],
)
def test_line_magic_mistakes_raise_usage_errors(ip: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("gradscope", line)
    assert ip.custom_exceptions == ()  # nothing was half-installed


def test_oom_on_diagnoses_before_the_traceback_and_off_restores(ip: Any, capsys: Any) -> None:
    original_exc, original_tb = ip.custom_exceptions, ip.__dict__.get("CustomTB")
    n_pre = len(ip.events.callbacks["pre_run_cell"])
    ip.run_line_magic("gradscope", "oom on --budget 64KiB")
    assert ip.custom_exceptions == (torch.OutOfMemoryError,)
    assert len(ip.events.callbacks["pre_run_cell"]) == n_pre + 1
    assert "OOM diagnosis is on" in capsys.readouterr().out
    res = ip.run_cell(
        "xs = []\nfor i in range(100):\n    xs.append(model(torch.randn(64, 8)).square().mean())\n"
    )
    out = capsys.readouterr().out
    assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)
    assert out.index("gradscope diagnosis") < out.index("MemoryBudgetExceeded")
    assert "graphs kept alive by variables:\n  xs: " in out
    d = gsi.last_diagnosis(ip)
    assert d.holders[0].variable == "xs" and d.budget == 64 * 1024
    # the losses may be back-propagated after the loop: never told to keep numbers
    assert not any(".item()" in f.code for f in d.findings)
    # a cell that fits runs as usual under the watch
    res = ip.run_cell("del xs\ny_ok = model(torch.randn(4, 8)).sum().item()\n")
    assert res.error_in_exec is None and isinstance(ip.user_ns.pop("y_ok"), float)
    ip.run_line_magic("gradscope", "oom")
    assert "is on" in capsys.readouterr().out
    ip.run_line_magic("gradscope", "oom off")
    assert ip.custom_exceptions == original_exc
    assert ip.__dict__.get("CustomTB") is original_tb
    assert len(ip.events.callbacks["pre_run_cell"]) == n_pre
    # with oom off, the budget is gone: the same cell runs
    res = ip.run_cell("xs = [model(torch.randn(64, 8)).square().mean() for i in range(100)]\n")
    assert res.error_in_exec is None and len(ip.user_ns["xs"]) == 100


def test_oom_on_without_budget_on_cpu_says_how_to_simulate(ip: Any, capsys: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA allocator is watched")
    ip.run_line_magic("gradscope", "oom on")
    assert "add --budget SIZE" in capsys.readouterr().out


def test_oom_watch_leaves_cells_that_record_on_their_own_alone(ip: Any, capsys: Any) -> None:
    ip.run_line_magic("gradscope", "oom on --budget 1MiB")
    res = ip.run_cell(
        "with gs.record(memory='tracker') as rec:\n    model(torch.randn(4, 8)).sum().backward()\n"
    )
    assert res.error_in_exec is None
    assert ip.user_ns["rec"].recording.complete
    ip.run_cell_magic("gradscope", "-o r --memory tracker --no-widget", "model(torch.randn(4, 8)).sum()\n")
    assert ip.user_ns["r"].complete
    capsys.readouterr()


def test_a_cell_recording_on_its_own_gets_its_own_diagnosis(ip: Any, capsys: Any) -> None:
    ip.run_line_magic("gradscope", "oom on --budget 1MiB")
    ip.run_cell("y_fine = model(torch.randn(4, 8)).sum()\n")  # watched, fine: its recording is done
    res = ip.run_cell(
        "losses = []\n"
        "with gs.record(budget='16KiB', modules={'model': model}) as rec:\n"
        "    for i in range(100):\n"
        "        losses.append(model(torch.randn(32, 8)).square().mean())\n"
    )
    out = capsys.readouterr().out
    assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)
    d = gsi.last_diagnosis(ip)
    assert (
        d.budget == 16 * 1024 and d.holders[0].variable == "losses"
    )  # the user's recording, not the watch's
    assert out.index("gradscope diagnosis") < out.index("MemoryBudgetExceeded")
    ip.user_ns.pop("y_fine", None)


def test_oom_inside_a_recorded_cell_with_oom_on_is_diagnosed_once(ip: Any, capsys: Any) -> None:
    ip.run_line_magic("gradscope", "oom on")
    ip.run_cell_magic(
        "gradscope", "--budget 2KiB -o r --no-widget", "xs = [model(torch.randn(64, 8)) for i in range(10)]\n"
    )
    out = capsys.readouterr().out
    assert out.count("gradscope diagnosis") == 1
    assert out.index("gradscope diagnosis") < out.index("MemoryBudgetExceeded")
    assert not ip.user_ns["r"].complete


def test_unload_while_oom_is_on_restores_everything() -> None:
    shell = get_ipython()
    exc, tb, cbs = shell.custom_exceptions, shell.__dict__.get("CustomTB"), _callbacks(shell)
    shell.run_line_magic("load_ext", "gradscope")
    shell.run_line_magic("gradscope", "oom on --budget 1GiB")
    assert shell.custom_exceptions == (torch.OutOfMemoryError,)
    shell.run_line_magic("unload_ext", "gradscope")
    assert shell.custom_exceptions == exc
    assert shell.__dict__.get("CustomTB") is tb
    assert _callbacks(shell) == cbs
    assert "gradscope" not in shell.magics_manager.magics["line"]


@pytest.mark.slow
def test_in_a_real_kernel() -> None:
    """The same magics in a real Jupyter kernel: outputs as a front end receives them."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "%load_ext gradscope\n" + _MODEL,
        "%%gradscope -o r --memory tracker\nmodel(torch.randn(4, 8)).sum().backward()",
        "print(type(r).__name__, r.peak_bytes, sorted(n.leaf for n in r.nodes if n.leaf)[0])",
        "%gradscope oom on --budget 64KiB",
        "xs = []\nfor i in range(100):\n    xs.append(model(torch.randn(64, 8)).square().mean())",
        "%gradscope oom off\n%unload_ext gradscope\nprint(get_ipython().custom_exceptions)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    outs = [c.outputs for c in nb.cells]

    def text(i: int) -> str:
        return "".join(o.get("text", "") + "".join(o.get("traceback", [])) for o in outs[i])

    shown = outs[1][0]
    assert shown.output_type == "display_data"
    assert "gradscope recording" in shown.data["text/plain"]  # what a widget-less front end shows
    assert text(2).strip() == "Recording 1036 model.0.bias"
    errors = [o for o in outs[4] if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "MemoryBudgetExceeded"
    streamed = "".join(o.get("text", "") for o in outs[4] if o.output_type == "stream")
    assert "gradscope diagnosis" in streamed and "graphs kept alive by variables:\n  xs: " in streamed
    assert text(5).splitlines()[-1] == "()"  # the handler is gone after unloading


def test_resident_bytes_count_each_storage_once() -> None:
    lin = torch.nn.Linear(4, 4)  # 64 + 16 bytes
    lin(torch.ones(1, 4)).sum().backward()  # and as much again in gradients
    t = torch.ones(16)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    opt.step()  # one momentum buffer per parameter: 80 bytes
    ns = {"lin": lin, "xs": [t, t.view(4, 4)], "d": {"a": t}, "opt": opt, "_hidden": torch.ones(1000)}
    assert gsc._resident_cpu_bytes(ns) == 80 + 80 + 64 + 80


# ----- friction: the diagnosis first, the recording named, units, no warnings of ours --------------
def test_a_budget_cell_shows_the_diagnosis_before_the_traceback_and_names_its_recording(
    ip: Any, capsys: Any
) -> None:
    res = ip.run_cell(
        "%%gradscope --budget 2KiB -o r --no-widget\nxs = [model(torch.randn(64, 8)) for i in range(10)]\n"
    )
    assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)
    out = capsys.readouterr().out
    assert out.count("gradscope diagnosis") == 1
    assert out.index("gradscope diagnosis") < out.index("MemoryBudgetExceeded")
    assert "the recording is `r`: gs.show(r), gs.diagnose(r)." in out
    assert "Call gs.diagnose(r) to see what held the memory." in out  # the error names it too
    assert "rec.recording" not in out
    assert ip.custom_exceptions == ()  # the handler was there for the cell only
    assert isinstance(ip.user_ns["r"], gs.Recording)


def test_without_a_name_the_recording_is_kept_under_a_documented_one(ip: Any, capsys: Any) -> None:
    ip.user_ns.pop(gsi.RECORDING_NAME, None)
    ip.run_cell("%%gradscope --budget 2KiB --no-widget\nxs = [model(torch.randn(64, 8)) for i in range(10)]\n")
    out = capsys.readouterr().out
    r = ip.user_ns.pop(gsi.RECORDING_NAME)
    assert isinstance(r, gs.Recording) and not r.complete
    assert gsi.RECORDING_NAME == "_gs_recording"
    assert (
        "the recording is `_gs_recording` (name it yourself with %%gradscope -o NAME): "
        "gs.show(_gs_recording), gs.diagnose(_gs_recording)." in out
    )
    assert "Call gs.diagnose(_gs_recording)" in out
    # a cell that fits keeps its recording there as well
    ip.run_cell("%%gradscope --memory off --no-widget\nmodel(torch.randn(2, 8)).sum()\n")
    assert ip.user_ns.pop(gsi.RECORDING_NAME).complete


def test_the_oom_watch_names_the_recording_and_the_users_own_recording(ip: Any, capsys: Any) -> None:
    ip.run_line_magic("gradscope", "oom on --budget 64KiB")
    assert "a simulated 64.0 KiB (65536 bytes) device" in capsys.readouterr().out
    ip.run_cell("xs = [model(torch.randn(64, 8)).square().mean() for i in range(100)]\n")
    out = capsys.readouterr().out
    assert "gs.diagnose(_gs_recording)" in out and "rec.recording" not in out
    assert isinstance(ip.user_ns.pop(gsi.RECORDING_NAME), gs.Recording)
    ip.run_cell(
        "losses = []\n"
        "with gs.record(budget='16KiB', modules={'model': model}) as my_rec:\n"
        "    for i in range(100):\n"
        "        losses.append(model(torch.randn(32, 8)).square().mean())\n"
    )
    out = capsys.readouterr().out
    assert "the recording is `my_rec.recording`: gs.show(my_rec.recording)" in out
    assert "Call gs.diagnose(my_rec.recording) to see what held the memory." in out
    ip.user_ns.pop("my_rec", None)


def test_gradscope_triggers_no_pytorch_warnings(ip: Any, capsys: Any) -> None:
    import warnings

    # a non-leaf tensor and a model whose buffer is computed from a tensor requiring grad
    ip.run_cell("h = model(torch.randn(4, 8))\n")
    ip.run_line_magic("gradscope", "oom on --budget 64KiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ip.run_cell("xs = [model(torch.randn(64, 8)).square().mean() for i in range(100)]\n")
        ip.run_cell("%%gradscope --budget 4KiB -o r --no-widget\nys = [model(torch.randn(64, 8)) for i in range(10)]\n")
    capsys.readouterr()
    assert [str(w.message) for w in caught] == []
    for name in ("h", "xs", "ys"):
        ip.user_ns.pop(name, None)


def test_models_are_matched_by_identity_never_by_class_name(ip: Any, capsys: Any) -> None:
    # `cnn` (an nn.Sequential in eval mode, from an earlier cell) is not used by the failing cell;
    # `big`, made in that cell, is an nn.Sequential too and so is recorded by its class name
    ip.run_cell("cnn = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU()).eval()\n")
    ip.run_line_magic("gradscope", "oom on --budget 256KiB")
    ip.run_cell(
        "big = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))\n"
        "outs = []\n"
        "for i in range(100):\n"
        "    outs.append(big(torch.randn(64, 8)))\n"
    )
    out = capsys.readouterr().out
    d = gsi.last_diagnosis(ip)
    assert d is not None and d.moment == "failure"
    assert not any(f.variable == "cnn" or f.module == "cnn" for f in d.findings)
    # named only among the variables that held memory before the cell, never in a finding or a note
    report = out.split("Traceback")[0]
    assert [ln for ln in report.splitlines() if "cnn" in ln] == [ln for ln in report.splitlines()
                                                               if ln.startswith("held:")]
    assert d.holders[0].variable == "outs"
    for name in ("cnn", "big", "outs"):
        ip.user_ns.pop(name, None)


def test_graphs_of_earlier_cells_are_not_holders_of_a_later_recording(ip: Any, capsys: Any) -> None:
    ip.run_cell(
        "zs = [torch.randn(4, 8, requires_grad=True) for i in range(8)]\n"
        "dfdz = [torch.autograd.grad(model(z).square().sum(), z, create_graph=True)[0] for z in zs]\n"
    )
    ip.run_line_magic("gradscope", "oom on --budget 64KiB")
    ip.run_cell("xs = []\nfor i in range(100):\n    xs.append(model(torch.randn(64, 8)).square().mean())\n")
    out = capsys.readouterr().out
    d = gsi.last_diagnosis(ip)
    assert [h.variable for h in d.holders] == ["xs"]
    assert [ln for ln in out.split("Traceback")[0].splitlines() if "dfdz" in ln and not ln.startswith("held:")] == []
    for name in ("zs", "dfdz", "xs"):
        ip.user_ns.pop(name, None)


# ----- the traceback of an OOM: the user's frames, the rest folded, the whole one a command away ----
_HELPER = '''import torch


def forward_all(model, n):
    outs = []
    for _ in range(n):
        outs.append(model(torch.randn(64, 8)))
    return outs
'''


def test_an_oom_traceback_shows_the_users_frames_and_folds_the_rest(
    ip: Any, capsys: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    import linecache
    import re
    import sys
    import traceback

    (tmp_path / "gs_user_helper.py").write_text(_HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    ip.run_cell("import gs_user_helper\n")
    res = ip.run_cell(
        "%%gradscope --budget 8KiB -o r --no-widget\n"
        "def run():\n"
        "    return gs_user_helper.forward_all(model, 10)\n"
        "xs = run()\n"
    )
    assert isinstance(res.error_in_exec, gs.MemoryBudgetExceeded)
    out = capsys.readouterr().out
    diag, trimmed = out.index("gradscope diagnosis"), out.index("Traceback (most recent call last; your frames only)")
    assert diag < trimmed
    shown = out[trimmed:].split("gradscope recording")[0]  # up to the recording's summary
    # the frames, counted independently from the traceback IPython keeps
    frames = [(f.f_code.co_filename, n) for f, n in traceback.walk_tb(sys.last_traceback)]
    helper = str(tmp_path / "gs_user_helper.py")
    user = [i for i, (fn, _) in enumerate(frames) if fn == helper or ip.compile.format_code_name(fn)]
    assert len(user) == 3  # the cell, run(), forward_all()
    assert user == list(range(user[0], user[0] + 3))
    folded = len(frames) - user[-1] - 1
    assert folded > 5
    line = linecache.getline(helper, frames[user[2]][1]).strip()
    assert line == "outs.append(model(torch.randn(64, 8)))"
    lines = shown.splitlines()
    assert lines[1:] == [
        "Cell In[" + lines[1].split("[")[1].split("]")[0] + "], line 3",
        "----> 3 xs = run()",
        "",
        lines[1].split(", line")[0] + ", line 2, in run",
        "----> 2 return gs_user_helper.forward_all(model, 10)",
        "",
        f"File {helper}:7, in forward_all",
        f"----> 7 {line}",
        "",
        f"... {folded} frames in torch, gradscope (%gradscope tb prints them all)",
        "",
        f"MemoryBudgetExceeded: {res.error_in_exec}",
        *lines[13:],
    ]
    assert re.fullmatch(r"Cell In\[\d+\], line 3", lines[1])
    assert "site-packages" not in shown and "torch/nn" not in shown and "gradscope/_capture/memory/tracker.py" not in shown
    # the whole traceback is one command away
    ip.run_line_magic("gradscope", "tb")
    whole = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "torch/nn/modules/module.py" in whole and "gradscope/_capture/memory/tracker.py" in whole
    assert f"{helper}:7" in whole
    assert whole.rstrip().splitlines()[-1].startswith("MemoryBudgetExceeded: gradscope: simulated device out of memory")
    for name in ("xs", "run", "gs_user_helper"):
        ip.user_ns.pop(name, None)
    sys.modules.pop("gs_user_helper", None)


def test_gradscope_tb_before_any_oom_says_so(ip: Any, capsys: Any) -> None:
    gsi._state(ip).full_traceback = None
    ip.run_line_magic("gradscope", "tb")
    assert "no out-of-memory traceback to show yet" in capsys.readouterr().out


@pytest.mark.slow
def test_a_gpt2_over_budget_in_a_real_kernel() -> None:
    """A GPT-2 (tiny config, random init) under a budget it does not fit, in a real Jupyter kernel:
    the budget below what is resident says the least budget, and the failing cell shows its widget
    (shown as the cell started: the partial recording's at the end), the diagnosis, then the traceback
    with the user's frames only; ``%gradscope tb`` prints the whole traceback."""
    import re

    pytest.importorskip("transformers")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "%load_ext gradscope\n"
        "import torch, gradscope as gs\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "torch.manual_seed(0)\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64))\n"
        "ids = torch.randint(0, 512, (8, 64))\n"
        "print('params', sum(p.numel() * p.element_size() for p in model.parameters()))",
        "%%gradscope --budget 256KiB\nloss = model(ids, labels=ids).loss",
        "%%gradscope --budget 3MiB -o r\n"
        "def step(m):\n"
        "    return m(ids, labels=ids).loss\n"
        "loss = step(model)\n"
        "loss.backward()",
        "%gradscope tb",
        "print(r.complete, r.oom.budget, r.oom.resident)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True).execute()
    outs = [c.outputs for c in nb.cells]

    def streamed(i: int, name: str = "stdout") -> str:
        return "".join(o.text for o in outs[i] if o.output_type == "stream" and o.name == name)

    # tied embeddings: wte (512 x 64) once, wpe (64 x 64), 2 blocks, the final layer norm
    d = 64
    block = (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (2 * d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    params = 4 * (512 * d + 64 * d + 2 * block + 2 * d)
    assert streamed(0).split() == ["params", str(params)]
    resident = params + 8 * 64 * 8  # and the int64 ids

    # a budget below what is resident: one line with the least budget, the variables named
    refused = streamed(1, "stderr").strip()
    assert len(refused.splitlines()) == 1 and refused.startswith("UsageError: gradscope: a 256.0 KiB")
    assert f"your variables already hold {format_bytes(resident)} ({resident} bytes) of CPU tensors" in refused
    assert f"(model {format_bytes(params)}, ids 4.0 KiB)" in refused
    assert f"more than {format_bytes(resident)} resident plus what the cell allocates" in refused

    # the failing cell: the widget, the diagnosis, then the trimmed traceback
    kinds = [o.output_type for o in outs[2]]
    first_error = kinds.index("error")
    diagnosis = "".join(o.text for o in outs[2][:first_error] if o.output_type == "stream")
    assert "gradscope diagnosis: out of memory on a simulated 3.0 MiB device" in diagnosis
    assert "the recording is `r`" in diagnosis
    error = outs[2][first_error]
    assert kinds.count("error") == 1 and error.ename == "MemoryBudgetExceeded"
    tb = error.traceback
    assert tb[1].endswith("Traceback (most recent call last; your frames only)")
    # (the lines of the cell's code below the %%gradscope line)
    assert re.fullmatch(r"Cell In\[\d+\], line 3", tb[2]) and tb[3] == "----> 3 loss = step(model)"
    assert re.fullmatch(r"Cell In\[\d+\], line 2, in step", tb[5])
    assert tb[6] == "----> 2 return m(ids, labels=ids).loss"
    fold = re.fullmatch(r"\.\.\. (\d+) frames in (.*) \(%gradscope tb prints them all\)", tb[8])
    assert fold and int(fold.group(1)) > 10
    assert fold.group(2).split(", ") == ["torch", "transformers", "gradscope"]
    assert tb[10].startswith("MemoryBudgetExceeded: gradscope: simulated device out of memory")
    assert len(tb) == 11
    assert not [line for line in tb if "site-packages" in line or "/torch/" in line or "transformers/" in line]
    # the widget shows as the cell starts (its loop chart grows while it runs: see NOTE [ a live loop ] in
    # gradscope._views.widget), and is the partial recording's when the cell has failed
    widget = [o for o in outs[2] if o.output_type == "display_data"]
    assert kinds[0] == "display_data" and len(widget) == 1
    assert "application/vnd.jupyter.widget-view+json" in widget[0].data
    assert widget[0].data["text/plain"].startswith("gradscope recording (INCOMPLETE: MemoryBudgetExceeded")

    # the whole traceback, one command away: every frame, the libraries' too
    whole = re.sub(r"\x1b\[[0-9;]*m", "", streamed(3))
    assert "transformers/models/gpt2/modeling_gpt2.py" in whole and "torch/nn/modules/module.py" in whole
    assert "loss = step(model)" in whole
    assert whole.count("File ") >= int(fold.group(1))
    assert streamed(4).split() == ["False", str(3 * 1024 * 1024), str(resident)]


def test_a_recorded_cell_keeps_its_own_number(ip: Any, capsys: Any) -> None:
    """NOTE [ the recorded cell keeps its number ]: the lines of a %%gradscope cell and its
    traceback name the cell by the number the notebook shows for it (the ExecutionResult's), as a
    plain ``with gs.record()`` cell's lines do, whichever IPython adds one to the count first."""
    body = "w = torch.ones(3, requires_grad=True)\n(w * w).sum().backward()\n"
    plain = ip.run_cell("with gs.record(memory='off') as rec:\n" + "".join("    " + ln + "\n" for ln in body.splitlines()),
                        store_history=True)
    magic = ip.run_cell("%%gradscope -o r --memory off --no-widget\n" + body, store_history=True)
    assert plain.success and magic.success, (plain.error_in_exec, magic.error_in_exec)
    assert magic.execution_count == plain.execution_count + 1
    for result, r, line in ((plain, ip.user_ns["rec"].recording, 3), (magic, ip.user_ns["r"], 2)):
        mul = next(n for n in r.nodes if n.name == "MulBackward0")
        assert r.lines[mul.line].label == f"cell [{result.execution_count}]:{line} in <module>"
    capsys.readouterr()
    failing = ip.run_cell("%%gradscope -o r --memory off --no-widget\nx = 1\nraise ValueError('the cell failed')\n",
                          store_history=True)
    assert isinstance(failing.error_in_exec, ValueError)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    # "Cell In[N], line 2" (IPython 8.4 and later), "Input In [N], in <module>" before
    assert re.findall(r"(?:Cell In\[|Input In \[)(\d+)\]", out) == [str(failing.execution_count)], out
    after = ip.run_cell("1 + 1", store_history=True)
    assert after.execution_count == failing.execution_count + 1  # the shell's own count moved on as usual
