"""The notebook extension, driven headless through IPython's own test shell."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import gradscope as gs
from gradscope import ipython as gsi

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
    resident = gsi._resident_cpu_bytes(ip.user_ns)
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
    assert f"with 0 B live and {resident} B resident from earlier cells" in out


def test_a_budget_smaller_than_the_variables_is_a_usage_error(ip: Any) -> None:
    resident = gsi._resident_cpu_bytes(ip.user_ns)
    with pytest.raises(UsageError, match=f"your variables already hold {resident} B of CPU tensors, more than the {resident - 1} B budget"):
        ip.run_cell_magic("gradscope", f"--budget {resident - 1}", "x = 1\n")
    ip.user_ns["big"] = torch.zeros(3 * 1024 * 1024 // 4)
    try:
        total = gsi._resident_cpu_bytes(ip.user_ns)
        expected = rf"already hold 3\.0 MiB \({total} bytes\) of CPU tensors, more than the 2\.0 MiB \(2097152 bytes\) budget"
        with pytest.raises(UsageError, match=expected):
            ip.run_cell_magic("gradscope", "--budget 2MiB", "x = 1\n")
    finally:
        del ip.user_ns["big"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--budget lots", "cannot read the memory size 'lots'"),
        ("--memory gpu", "invalid choice"),
        ("-o 1x", "-o takes a variable name"),
        ("--frobnicate", "unrecognized arguments"),
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
    assert gsi._resident_cpu_bytes(ns) == 80 + 80 + 64 + 80


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
    assert "cnn" not in out.split("Traceback")[0]
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
    assert "dfdz" not in out.split("Traceback")[0]
    for name in ("zs", "dfdz", "xs"):
        ip.user_ns.pop(name, None)
