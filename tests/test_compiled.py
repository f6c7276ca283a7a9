"""Inside torch.compile'd regions: each saved tensor of a CompiledFunctionBackward attributed to the
module and source line that produced it (gs.record(compiled="attribute"), the default), and
compiled="eager" (the block recorded with compilation set aside)."""

from __future__ import annotations

import collections
import gc
import inspect
import json
import linecache
import os
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradscope as gs
from gradscope._base import compat as _compat
from gradscope._capture import compiled as _compiled
from gradscope.recording import Recording
from gradscope.report import summary_text

B, D_IN, D_HID, D_OUT = 32, 64, 128, 10


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D_IN, D_HID)
        self.l2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        return self.l2(h).log_softmax(-1)


def _line_of(text: str) -> int:
    """The line of MLP.forward, in this file, that holds ``text``."""
    lines, first = inspect.getsourcelines(MLP.forward)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _strip(by_module: dict[str, int], prefix: str) -> dict[str, int]:
    """Module paths relative to the root (the root itself is "")."""
    return {("" if m == prefix else m.removeprefix(prefix + ".")): b for m, b in by_module.items()}


@pytest.fixture(scope="module", autouse=True)
def _compiler_state_dropped() -> Iterator[None]:
    """After this module: the compiler's caches emptied and their cycles collected, so that what
    the compiled models held is not found as garbage by a later test's collection."""
    yield
    torch._dynamo.reset()
    gc.collect()


# where torch does its bookkeeping of a region's saves inline (2.6), nothing is attributed: the
# recording says so (test_unseen_compile_says_so_and_points_to_eager), compiled="eager" still works
OBSERVED = pytest.mark.skipif(not _compat.compiled_saves_observable(),
                              reason="this torch does not expose AOTAutograd's saved-tensor bookkeeping")


@pytest.fixture(scope="module")
def mlp() -> dict[str, object]:
    torch.manual_seed(0)
    model = MLP()
    cm = torch.compile(model)
    x = torch.randn(B, D_IN)
    with gs.record(memory="cpu") as rec:  # the first call: compiled inside the block
        cm(x).sum().backward()
    recorded = _grads(model)
    model.zero_grad()
    cm(x).sum().backward()  # the same compiled program, not recorded
    plain = _grads(model)
    model.zero_grad()
    with gs.record(memory="cpu") as eager:
        model(x).sum().backward()
    eager_grads = _grads(model)
    model.zero_grad()
    return {"model": model, "cm": cm, "x": x, "rec": rec.recording, "eager": eager.recording,
            "recorded": recorded, "plain": plain, "eager_grads": eager_grads}


@OBSERVED
def test_mlp_saves_attributed_to_modules_and_lines_of_this_file(mlp: dict) -> None:
    rec: Recording = mlp["rec"]
    compiled = [n.id for n in rec.nodes if n.name == "CompiledFunctionBackward"]
    assert len(compiled) == 1
    saves = gs.compiled_saves(rec)
    relu_line = _line_of("h = torch.relu(self.l1(x))")
    out_line = _line_of("return self.l2(h).log_softmax(-1)")
    here = os.path.realpath(__file__)
    assert all(os.path.realpath(s.file or "") == here for s in saves)
    got = [(s.index, s.kind, s.module, s.line, sorted((u[0], u[2]) for u in s.used_by), s.bytes) for s in saves]
    f = 4  # float32
    assert got == [
        # x, read by l1's weight gradient
        (0, "input", "cm._orig_mod.l1", relu_line, [("cm._orig_mod.l1", relu_line)], B * D_IN * f),
        # l2's weight, read by the gradient of l2's input
        (1, "input", "cm._orig_mod.l2", out_line, [("cm._orig_mod.l2", out_line)], D_OUT * D_HID * f),
        # relu's output: read by relu's own backward (in the root module's forward) and by l2's
        (2, "activation", "cm._orig_mod", relu_line,
         [("cm._orig_mod", relu_line), ("cm._orig_mod.l2", out_line)], B * D_HID * f),
        # log_softmax's output
        (3, "activation", "cm._orig_mod", out_line, [("cm._orig_mod", out_line)], B * D_OUT * f),
    ]
    assert [s.op for s in saves] == ["placeholder", "placeholder", "aten.relu.default", "aten.sub.Tensor"]
    assert {s.node for s in saves} == set(compiled)
    # each save's bytes are the recording's own row of that saved_tensors[i]
    rows = {s.attribute: s.bytes for s in rec.saved if s.node == compiled[0]}
    assert {f"saved_tensors[{s.index}]": s.bytes for s in saves} == rows


@OBSERVED
def test_mlp_saved_bytes_by_module_equal_the_eager_recording(mlp: dict) -> None:
    compiled = _strip(_compiled.saved_bytes_by_module(mlp["rec"]), "cm._orig_mod")
    eager = _strip(mlp["eager"].saved_bytes_by_module(), "model")
    f = 4
    assert compiled == eager == {
        "l2": (D_OUT * D_HID + B * D_HID) * f,  # its weight and its input (relu's output)
        "": (B * D_HID + B * D_OUT) * f,  # relu's output, log_softmax's output
        "l1": B * D_IN * f,  # x (l1's weight is not needed: x needs no gradient)
    }
    assert _compiled.compiled_bytes_by_module(mlp["rec"]) == {f"cm._orig_mod{'.' if k else ''}{k}": v
                                                              for k, v in compiled.items()}


def test_mlp_gradients_equal_an_unrecorded_compiled_run(mlp: dict) -> None:
    assert mlp["recorded"].keys() == mlp["plain"].keys() == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
    for k, g in mlp["recorded"].items():
        assert torch.equal(g, mlp["plain"][k]), k
        torch.testing.assert_close(g, mlp["eager_grads"][k])


@OBSERVED
def test_attribution_survives_json_and_shows_in_the_summary(mlp: dict) -> None:
    rec: Recording = mlp["rec"]
    back = Recording.from_dict(json.loads(rec.to_json()))
    assert gs.compiled_saves(back) == gs.compiled_saves(rec)
    text = summary_text(rec)
    assert "compiled regions, saved bytes by module (from AOTAutograd's graphs):" in text
    top = next(iter(_compiled.compiled_bytes_by_module(rec).items()))
    assert top == ("cm._orig_mod.l2", (D_OUT * D_HID + B * D_HID) * 4)
    assert "cm._orig_mod.l2" in text.split("compiled regions, saved bytes")[1].splitlines()[1]
    assert any("attributed to the module and line" in n for n in rec.notes)


@OBSERVED
def test_a_graph_compiled_in_an_earlier_block_is_attributed_from_it(mlp: dict) -> None:
    cm = mlp["cm"]  # the root is named by the variable that holds it
    with gs.record(memory="off") as rec:
        cm(mlp["x"]).sum().backward()
    r = rec.recording
    mlp["model"].zero_grad()
    assert [(s.index, s.module, s.bytes) for s in gs.compiled_saves(r)] == [
        (s.index, s.module, s.bytes) for s in gs.compiled_saves(mlp["rec"])]


def test_unseen_compile_says_so_and_points_to_eager(mlp: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # a graph compiled before any block saw it: observing, but the block compiles nothing
    monkeypatch.setattr(_compiled, "_EARLIER", collections.deque())
    monkeypatch.setattr(_compat, "observe_compiled_saves", lambda seen: lambda: None)
    with gs.record(memory="off") as rec:
        mlp["cm"](mlp["x"]).sum().backward()
    r = rec.recording
    assert r is not None
    mlp["model"].zero_grad()
    node = next(n.id for n in r.nodes if n.name == "CompiledFunctionBackward")
    assert r.extra["compiled"]["unattributed_nodes"] == [node]
    assert gs.compiled_saves(r) == []
    note = next(n for n in r.notes if "not attributed" in n)
    assert "compiled before the block" in note and "compiled='eager'" in note
    monkeypatch.setattr(_compat, "observe_compiled_saves", lambda seen: None)  # a torch without the step
    with gs.record(memory="off") as rec:
        mlp["cm"](mlp["x"]).sum().backward()
    mlp["model"].zero_grad()
    assert rec.recording is not None
    assert any("does not expose AOTAutograd" in n for n in rec.recording.notes)


def test_eager_mode_records_every_op_of_the_compiled_model(mlp: dict) -> None:
    cm = mlp["cm"]
    with gs.record(memory="cpu", compiled="eager") as rec:
        cm(mlp["x"]).sum().backward()
    r = rec.recording
    assert r is not None
    grads = _grads(mlp["model"])
    mlp["model"].zero_grad()
    names = [n.name for n in r.nodes]
    assert "CompiledFunctionBackward" not in names
    assert names.count("AddmmBackward0") == 2 and "ReluBackward0" in names
    assert _strip(r.saved_bytes_by_module(), "cm._orig_mod") == _strip(mlp["eager"].saved_bytes_by_module(), "model")
    assert any("compiled='eager'" in n and "may differ" in n for n in r.notes)
    assert r.extra["compiled"] == {"mode": "eager"}
    for k, g in grads.items():
        torch.testing.assert_close(g, mlp["eager_grads"][k])
    # the stance is back: the next call runs compiled
    assert mlp["cm"](mlp["x"]).grad_fn.name() == "CompiledFunctionBackward"


@OBSERVED
def test_nothing_stays_hooked_after_an_exception(mlp: dict) -> None:
    from torch._functorch import config as fconfig
    from torch._functorch._aot_autograd import graph_compile

    before = graph_compile._categorize_saved_tensors_for_backward, fconfig.enable_autograd_cache
    for mode in ("attribute", "eager"):
        with pytest.raises(ValueError, match="user error"), gs.record(memory="off", compiled=mode):
            mlp["cm"](mlp["x"]).sum()
            raise ValueError("user error")
        assert (graph_compile._categorize_saved_tensors_for_backward, fconfig.enable_autograd_cache) == before
        assert mlp["cm"](mlp["x"]).grad_fn.name() == "CompiledFunctionBackward"


def test_bad_compiled_value_is_a_gradscope_error() -> None:
    with pytest.raises(gs.GradscopeError, match="compiled= takes one of 'attribute', 'eager', 'off'"):
        gs.record(compiled="inductor")


# ----------------------------------------------------------------------------- a real model
transformers = pytest.importorskip("transformers")
BATCH, SEQ, EMBD = 2, 16, 64


@pytest.fixture(scope="module")
def gpt2() -> dict[str, object]:
    if not hasattr(torch.compiler, "is_exporting"):  # transformers' masks call it inside the compiled forward
        pytest.skip("this transformers compiles only on a torch with torch.compiler.is_exporting")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=EMBD, n_head=4, vocab_size=500, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 500, (BATCH, SEQ))
    cm = torch.compile(model)
    with gs.record(memory="off") as rec:
        cm(input_ids=ids, labels=ids).loss.backward()
    recorded = _grads(model)
    model.zero_grad()
    cm(input_ids=ids, labels=ids).loss.backward()
    plain = _grads(model)
    model.zero_grad()
    with gs.record(memory="off") as eager:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
    return {"rec": rec.recording, "eager": eager.recording, "recorded": recorded, "plain": plain}


@OBSERVED
def test_gpt2_saved_bytes_by_module_against_eager(gpt2: dict) -> None:
    compiled = _strip(_compiled.saved_bytes_by_module(gpt2["rec"]), "cm._orig_mod")
    eager = _strip(gpt2["eager"].saved_bytes_by_module(), "model")
    assert compiled.keys() == eager.keys()
    assert "(no module)" not in compiled and "cm" not in compiled  # every compiled save was opened up
    act = {m for m in eager if m.endswith(".mlp.act")}
    norms = {m for m in eager if m.rsplit(".", 1)[-1] in ("ln_1", "ln_2", "ln_f")}
    same = {m: b for m, b in eager.items() if m not in act | norms | {""}}
    assert len(same) == 13  # lm_head, wte, wpe, and per layer attn, c_attn, c_proj, mlp.c_fc, mlp.c_proj
    assert {m: compiled[m] for m in same} == same  # inductor saves the same tensors for these
    f = 4
    for m in act:  # NewGELU: eager saves 4 tensors of c_fc's output size; inductor saves c_fc's
        # output alone and recomputes the tanh approximation in backward
        assert eager[m] == 4 * BATCH * SEQ * 4 * EMBD * f
        assert compiled[m] == BATCH * SEQ * 4 * EMBD * f
    for m in norms:  # eager layer_norm saves input, weight, bias, mean, rstd; the decomposition
        # saves the normalised input, rstd and the weight
        assert eager[m] == (BATCH * SEQ * EMBD + 2 * EMBD + 2 * BATCH * SEQ) * f
        assert compiled[m] == (BATCH * SEQ * EMBD + EMBD + BATCH * SEQ) * f


@OBSERVED
def test_gpt2_lines_are_the_models_own_source_lines(gpt2: dict) -> None:
    saves = gs.compiled_saves(gpt2["rec"])
    assert len(saves) == sum(1 for s in gpt2["rec"].saved if s.attribute.startswith("saved_tensors["))
    checked = 0
    for s in saves:
        for module, file, line in s.used_by:
            assert file is not None and line is not None, s
            text = linecache.getline(file, line)
            assert text.strip(), (file, line)
            last = (module or "").rsplit(".", 1)[-1]
            if last in ("ln_1", "ln_2", "ln_f", "lm_head", "wpe"):
                assert f"self.{last}(" in text, (module, text)
                assert os.path.basename(file) == "modeling_gpt2.py"
                checked += 1
    assert checked >= 11


def test_gpt2_gradients_equal_an_unrecorded_compiled_run(gpt2: dict) -> None:
    assert len(gpt2["recorded"]) == 2 + 2 * 12 + 2
    assert gpt2["recorded"].keys() == gpt2["plain"].keys()
    for k, g in gpt2["recorded"].items():
        torch.testing.assert_close(g, gpt2["plain"][k], rtol=0, atol=0)


@pytest.mark.parametrize("memory", ["off", "cpu", "tracker"])
def test_a_model_compiled_in_a_block_stays_compiled_over_many_blocks(memory: str) -> None:
    # NOTE [ one key for module hooks ]: with each block's global module hooks under a new key,
    # every block compiled the model again, and from the 9th on (the recompile limit) it ran
    # eagerly, unsaid. Twelve blocks, the first compile inside the first: one graph, compiled
    # regions in every recording, nothing hooked between the blocks.
    from torch._dynamo.utils import counters
    from torch.nn.modules import module as nn_module

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    compiled = torch.compile(model)
    x = torch.randn(8, 16)
    before = counters["stats"]["unique_graphs"]
    seen = []
    for _ in range(12):
        with gs.record(memory=memory, modules={"model": model}) as rec:
            compiled(x).sum().backward()
        assert rec.recording is not None
        seen.append(any(n.name == "CompiledFunctionBackward" for n in rec.recording.nodes))
        assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks
    # (torch 2.6 runs a compiled model eagerly under the tracker's dispatch mode: the same in every block)
    assert seen == [seen[0]] * 12
    assert seen[0] or (memory == "tracker" and not _compat.compiled_saves_observable())
    assert counters["stats"]["unique_graphs"] - before == int(seen[0])
    expected = model(x).sum()
    torch.testing.assert_close(compiled(x).sum(), expected)
