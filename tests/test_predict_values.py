"""Values known on meta (NOTE [ values known on meta ] in gradscope._analyses.predict.values): a step
whose Python reads integer values that are known exactly runs on meta, and its prediction equals
the CPU allocator's count of a real run; a value that is not known (a float, a random draw, a tensor
written with an unknown value) still stops the prediction with gradscope's error."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import recorded_peak
from torch import nn

import gradscope as gs


def _gpt2(checkpointed: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (the name older versions document)
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randint(0, 500, (8, 32))


def _train_step(model, opt, input_ids) -> None:  # noqa: ANN001
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_transformers_step_is_predicted_to_the_allocators_byte(checkpointed: bool) -> None:
    # checkpointing turns the model's cache off, and without a cache transformers reads its position
    # ids' values (packed sequences?): on meta that read was refused before their values were known
    model, opt, ids = _gpt2(checkpointed)
    p = gs.predict(_train_step, model, opt, ids, device="cpu")
    assert p.peak_bytes == recorded_peak(_train_step, model, opt, ids)


def test_a_checkpointed_step_holds_less_than_the_plain_one_as_predicted_and_as_run() -> None:
    plain, checkpointed = _gpt2(False), _gpt2(True)
    predicted = [gs.predict(_train_step, *a, device="cpu").peak_bytes for a in (plain, checkpointed)]
    real = [recorded_peak(_train_step, *a) for a in (plain, checkpointed)]
    assert predicted == real and real[1] < real[0]


def _branching(x: torch.Tensor, mask: torch.Tensor) -> None:
    pos = torch.arange(mask.shape[1]).unsqueeze(0).expand(mask.shape[0], -1)
    packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    y = x * 2
    if (packed[:, -1] == 0).all():  # a value of the arange's
        y = y.exp()
    if bool((mask == 0).any()):  # a value of the step's own integer input
        y = torch.cat([y, y * mask[:, :1].to(y.dtype)])
    y.sum().backward()


@pytest.mark.parametrize("zeros", [False, True])
def test_branches_on_known_integers_take_the_way_the_real_run_takes(zeros: bool) -> None:
    x = torch.randn(64, 512, requires_grad=True)
    mask = torch.ones(64, 8, dtype=torch.long)
    if zeros:
        mask[3, 0] = 0
    p = gs.predict(_branching, x, mask, device="cpu")
    assert p.peak_bytes == recorded_peak(_branching, x, mask)


def test_the_two_branches_differ_so_the_value_was_read() -> None:
    x = torch.randn(64, 512, requires_grad=True)
    ones = torch.ones(64, 8, dtype=torch.long)
    some = ones.clone()
    some[0, 0] = 0
    a, b = (gs.predict(_branching, x, m, device="cpu").peak_bytes for m in (ones, some))
    assert b - a > 64 * 512 * 4  # the concatenation holds a second [64, 512] at least
    assert b - a == recorded_peak(_branching, x, some) - recorded_peak(_branching, x, ones)


def _reads_a_float(x: torch.Tensor) -> None:
    y = (x * 2).sum()
    if y.item() > 0:
        y = y * 3
    y.backward()


def _reads_a_random_draw(x: torch.Tensor) -> None:
    k = torch.randint(0, 4, (1,))
    y = x[: int(k.item()) + 1].sum()
    y.backward()


def _reads_a_tensor_written_with_an_unknown_value(x: torch.Tensor) -> None:
    idx = torch.zeros(1, dtype=torch.long)
    idx.add_(x.argmax())  # the argmax of data: its value is not known on meta
    y = x[: int(idx.item()) + 1].sum()
    y.backward()


@pytest.mark.parametrize("step", [_reads_a_float, _reads_a_random_draw, _reads_a_tensor_written_with_an_unknown_value])
def test_a_value_that_is_not_known_still_stops_the_prediction(step) -> None:  # noqa: ANN001
    x = torch.randn(16, requires_grad=True)
    with pytest.raises(gs.GradscopeError, match="cannot be predicted"):
        gs.predict(step, x, device="cpu")


def test_a_prediction_leaves_no_value_and_no_patch_behind() -> None:
    import gc

    from gradscope._analyses.predict import values

    before = torch.get_rng_state
    x = torch.randn(64, 512, requires_grad=True)
    gs.predict(_branching, x, torch.ones(64, 8, dtype=torch.long), device="cpu")
    with pytest.raises(gs.GradscopeError):
        gs.predict(_reads_a_float, torch.randn(16, requires_grad=True), device="cpu")
    gc.collect()
    assert not values.any_known()  # (weakly held: gone with the meta tensors)
    assert torch.get_rng_state is before


def test_the_diagnosis_measures_a_checkpointed_transformers_step_on_meta_as_the_tracker_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step too large for CPU copies is measured on meta (NOTE [ meta or a CPU copy ]): checkpointing a
    transformers model is too, now that the position ids' values are known there, and its peak equals a
    real run's on a CPU copy counted by the tracker (the budget's own count)."""
    import importlib

    measure = importlib.import_module("gradscope._analyses.diagnose.measure")
    checkpoint = importlib.import_module("gradscope._analyses.diagnose.toolbox.checkpoint")
    model, opt, ids = _gpt2(False)
    ns = {"model": model, "opt": opt, "input_ids": ids}
    source = ("out = model(input_ids=input_ids, labels=input_ids)\nout.loss.backward()\nopt.step()\n"
              "opt.zero_grad()\n")
    setup = "model." + checkpoint.transformers_switch(model) + "\n"
    monkeypatch.setattr(measure, "SMALL_STEP_BYTES", 0)  # every step is large: measured on meta
    on_meta = measure.Bench(source, ns).measure(source, setup)
    monkeypatch.setattr(measure, "SMALL_STEP_BYTES", 1 << 40)
    real = measure.Bench(source, ns)
    real.counted_by = "tracker"
    on_cpu = real.measure(source, setup)
    assert on_meta.error is None and on_meta.how == "meta", on_meta.error
    assert on_cpu.error is None and on_cpu.how == "cpu copy"
    assert on_meta.peak == on_cpu.peak


def test_predictions_on_threads_at_once_count_their_own_random_states_and_unpatch() -> None:
    """Two checkpointed predictions on two threads at once, as ``gs.predict`` may be called from a
    thread pool: each equals the one made alone, and ``torch.get_rng_state`` is PyTorch's again."""
    import threading

    before = torch.get_rng_state
    model, opt, ids = _gpt2(True)
    alone = gs.predict(_train_step, model, opt, ids, device="cpu").peak_bytes
    got: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        try:
            m, o, i = _gpt2(True)
            barrier.wait()
            got.append(gs.predict(_train_step, m, o, i, device="cpu").peak_bytes)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == [alone, alone]
    assert torch.get_rng_state is before


def _written_by_a_foreach_op(x: torch.Tensor) -> None:
    idx = [torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)]
    torch._foreach_add_(idx, [x.argmax().reshape(1), x.argmin().reshape(1)])  # values of data: not known
    y = x[: int(idx[0].item()) + 1].sum()
    y.backward()


def test_a_foreach_op_that_writes_unknown_values_drops_the_known_ones() -> None:
    with pytest.raises(gs.GradscopeError, match="cannot be predicted"):
        gs.predict(_written_by_a_foreach_op, torch.randn(16, requires_grad=True), device="cpu")
