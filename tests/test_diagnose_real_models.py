"""The diagnosis on real architectures (issue 28): every finding's code, executed verbatim, does
what the finding says.

Fourteen ``transformers`` models from tiny configs (tests/_arch.py: 2 layers, hidden size 32,
batch 8, sequence 16, random weights; BERT also with its embeddings and first layer frozen,
LLaMA also with two parameter groups) take an AdamW step written as users write it, in one of
three ways (``model(**batch)``, ``model(input_ids=..., labels=...)``, a ``loss_fn`` on the
logits), inside ``gs.record(memory="tracker")``; then ``gs.diagnose(rec)``, which reads the
block's source and the test's variables itself. At the peak the recorded step is a loop's
second one (see NOTE [ which step is diagnosed ]) and the diagnosis is asked to try its fixes
(``toolbox=True``: by default it tries them only for a block that failed).

For every finding with code, two deep copies of the user's objects as they were when diagnose
ran (one ``copy.deepcopy`` of one dict each, so the optimizer's parameters are the copied
model's), dropout off and the same seed: copy A runs the block's own text (read from this file),
copy B ``exec``s ``f.code`` verbatim. Then:

- gradients left, parameters after the step and optimizer state are close: rtol 1e-4 and atol
  1e-6 times the largest magnitude in copy A's tensor, or the finding's own ``tolerance`` (as
  relative and absolute-to-magnitude bounds); an autocast finding must state one (its field or
  its message); parameters also within 1e-3 * lr (see NOTE [ parameters after an Adam step ] in
  tests/_arch.py);
- the fix never raises the peak, and the measured saving (A's peak - B's peak, counted as the diagnosis
  counts its runs: the CPU allocator's bytes where the compiled hooks are in use, else the tracker) is
  within 10 % of ``f.saves_bytes`` or 64 KiB; ``f.peak_before`` / ``f.peak_after`` are A's and B's
  peaks, counting what the copies held when the step started, within the same margin; ``f.fits`` is None without a budget.

Under a budget of 70 % of the step's own peak (measured on a copy first), for a first and a
later step, the step raises ``torch.OutOfMemoryError``; the diagnosis then has findings, says for
each with code whether it fits, and the code of each that fits runs under the same budget on a
fresh copy of the objects as the failed step started.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _arch import (
    ARCHS,
    BUDGET_TABLE,
    SMALL,
    STYLES,
    BudgetRow,
    Objects,
    Row,
    block_source,
    check_finding,
    copies,
    run_step,
    setup,
    take_step,
)

import gradscope as gs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _archs(style: str) -> list[str]:
    return [f.__name__ for f in STYLES[style]]


def _margin(claimed: int) -> float:
    return max(0.10 * abs(claimed), SMALL)


def _problems(row: Row, f: Any) -> list[str]:
    """What the finding's run on copies shows against its claims."""
    head = f"[{f.pattern}]"
    if row.error is not None:
        return [f"{head} its code raised {row.error}\n--- code ---\n{f.code}"]
    out = [f"{head} {m}" for m in row.mismatches]
    if f.fits is not None:
        out.append(f"{head} fits={f.fits!r} without a budget (should be None)")
    if row.fix_peak > row.user_peak:
        out.append(f"{head} the fix raised the peak: {row.user_peak} -> {row.fix_peak} bytes")
    if f.saves_bytes is None:
        out.append(f"{head} no claimed saving (saves_bytes is None)")
    elif abs(row.measured - f.saves_bytes) > _margin(f.saves_bytes):
        out.append(f"{head} claimed saving {f.saves_bytes} bytes, measured {row.measured} "
                   f"({row.user_peak} -> {row.fix_peak})")
    # a peak counts what the copies held when the step started plus the most it allocated at once
    for what, claimed, measured in (("peak_before", row.peak_before, row.resident + row.user_peak),
                                    ("peak_after", row.peak_after, row.resident + row.fix_peak)):
        if claimed is None or abs(claimed - measured) > _margin(measured):
            out.append(f"{head} {what} {claimed} bytes, measured {measured}")
    return out


def _check_findings(arch: str, d: Any, snapshot: Objects, user_step: str) -> None:
    # at the peak a diagnosis may show nothing (what it tried was not worth it, its notes say);
    # under a budget it must (the tests below)
    with_code = [f for f in d.findings if f.code]
    problems: list[str] = []
    a = run_step(user_step, copies(snapshot)) if with_code else None  # copy A: the same for every finding
    for f in with_code:
        problems += _problems(check_finding(arch, f, snapshot, user_step, a), f)
    assert not problems, f"{arch}:\n" + "\n".join(problems)


def _objects(arch: str, test: Any, later: bool) -> Objects:
    """The user's objects; where ``later``, after one unrecorded step of the test's own block (a
    loop's earlier iteration: the optimizer has state before the recorded step)."""
    objs = setup(arch)
    if later:
        take_step(block_source(test), objs)
    return objs


# NOTE [ which step is diagnosed ]: at the peak, the recorded step is a later one, so that the
# objects as the block started and as they are when diagnose runs hold the same kinds of state
# (the optimizer's moments exist in both). Under a budget, first steps too: a fix that fits is
# then run from the objects as the failed step started (built again, bit-equal, from the seeds).
def _budget(arch: str, test: Any, objs: Objects, later: bool) -> int:
    """70 % of the peak of the test's own step, run on a copy of the objects as they are now."""
    peak = run_step(block_source(test), copies(objs)).peak
    BUDGET_TABLE.append(BudgetRow(arch, later, int(0.7 * peak), peak))
    return int(0.7 * peak)


def _check_under_budget(arch: str, d: Any, test: Any, later: bool, budget: int) -> None:
    row = BUDGET_TABLE[-1]
    assert d.findings, f"{arch}: no findings under a {budget}-byte budget:\n{d}"
    with_code = [f for f in d.findings if f.code]
    failed: list[str] = []
    for f in with_code:
        ran = None
        if f.fits is True:  # MemoryBudgetExceeded included: the finding said it fits
            try:
                run_step(f.code, copies(_objects(arch, test, later)), budget=budget)
                ran = "ok"
            except Exception as e:
                ran = f"{type(e).__name__}: {e}"
                failed.append(f"[{f.pattern}] fits=True but its code raised {ran}\n--- code ---\n{f.code}")
        row.findings.append((f.pattern, f.fits, ran))
    assert all(isinstance(f.fits, bool) for f in with_code), [(f.pattern, f.fits) for f in with_code]
    assert any(f.fits is True for f in with_code), f"{arch}: no finding fits a {budget}-byte budget:\n{d}"
    assert not failed, f"{arch}:\n" + "\n".join(failed)


_STEPS = pytest.mark.parametrize("later", [False, True], ids=["first_step", "later_step"])


# ----------------------------------------------------------------------------------------------
# model(**batch), out.loss
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", _archs("batch"))
def test_findings_of_a_batch_step_run_verbatim(arch: str) -> None:
    objs = _objects(arch, test_findings_of_a_batch_step_run_verbatim, later=True)
    model, opt, batch = objs["model"], objs["opt"], objs["batch"]
    with gs.record(memory="tracker") as rec:
        out = model(**batch)
        loss = out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    d = gs.diagnose(rec, toolbox=True)  # a step that fits: its fixes are tried when asked
    snapshot = copy.deepcopy(objs)  # the objects as the diagnosis saw them
    _check_findings(arch, d, snapshot, block_source(test_findings_of_a_batch_step_run_verbatim))


@_STEPS
@pytest.mark.parametrize("arch", _archs("batch"))
def test_a_batch_step_over_budget_gets_a_fix_that_fits(arch: str, later: bool) -> None:
    test = test_a_batch_step_over_budget_gets_a_fix_that_fits
    objs = _objects(arch, test, later)
    model, opt, batch = objs["model"], objs["opt"], objs["batch"]
    budget = _budget(arch, test, objs, later)
    with pytest.raises(torch.OutOfMemoryError):
        with gs.record(memory="tracker", budget=budget) as rec:
            out = model(**batch)
            loss = out.loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    d = gs.diagnose(rec)
    _check_under_budget(arch, d, test, later, budget)


# ----------------------------------------------------------------------------------------------
# model(input_ids=..., labels=...), out.loss
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", _archs("kwargs"))
def test_findings_of_a_keyword_step_run_verbatim(arch: str) -> None:
    objs = _objects(arch, test_findings_of_a_keyword_step_run_verbatim, later=True)
    model, opt, input_ids, labels = objs["model"], objs["opt"], objs["input_ids"], objs["labels"]
    with gs.record(memory="tracker") as rec:
        out = model(input_ids=input_ids, labels=labels)
        loss = out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    d = gs.diagnose(rec, toolbox=True)
    snapshot = copy.deepcopy(objs)
    _check_findings(arch, d, snapshot, block_source(test_findings_of_a_keyword_step_run_verbatim))


@_STEPS
@pytest.mark.parametrize("arch", _archs("kwargs"))
def test_a_keyword_step_over_budget_gets_a_fix_that_fits(arch: str, later: bool) -> None:
    test = test_a_keyword_step_over_budget_gets_a_fix_that_fits
    objs = _objects(arch, test, later)
    model, opt, input_ids, labels = objs["model"], objs["opt"], objs["input_ids"], objs["labels"]
    budget = _budget(arch, test, objs, later)
    with pytest.raises(torch.OutOfMemoryError):
        with gs.record(memory="tracker", budget=budget) as rec:
            out = model(input_ids=input_ids, labels=labels)
            loss = out.loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    d = gs.diagnose(rec)
    _check_under_budget(arch, d, test, later, budget)


# ----------------------------------------------------------------------------------------------
# model(pixel_values=...), loss_fn(out.logits, labels)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", _archs("loss_fn"))
def test_findings_of_a_loss_fn_step_run_verbatim(arch: str) -> None:
    objs = _objects(arch, test_findings_of_a_loss_fn_step_run_verbatim, later=True)
    model, opt, loss_fn = objs["model"], objs["opt"], objs["loss_fn"]
    pixel_values, labels = objs["pixel_values"], objs["labels"]
    with gs.record(memory="tracker") as rec:
        out = model(pixel_values=pixel_values)
        loss = loss_fn(out.logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
    d = gs.diagnose(rec, toolbox=True)
    snapshot = copy.deepcopy(objs)
    _check_findings(arch, d, snapshot, block_source(test_findings_of_a_loss_fn_step_run_verbatim))


# NOTE [ no fix fits these ]: measured, not assumed. ResNet's tiny config spends its activations in
# the stem (batch norm, ReLU, max-pool on 32x32 images): checkpointing it raises the peak (its
# recompute's activations arrive when backward has freed little), micro-batches change the batch-
# norm statistics, autocast the results. MobileNetV2's first step (Adam's state made inside it):
# checkpointing its nine largest segments takes 8.6 MiB to 7.3 MiB, over the 6.5 MiB the budget
# allows. The diagnosis must not claim a fit there: these cases hold it to that (strict xfail).
_NO_FIX_FITS = {
    ("resnet", False): "nothing in the toolbox fits: checkpointing the stem raises the peak, micro-batches "
                       "change batch-norm statistics",
    ("resnet", True): "nothing in the toolbox fits: checkpointing the stem raises the peak, micro-batches "
                      "change batch-norm statistics",
    ("mobilenetv2", False): "the first step (Adam's state made in it): checkpointing nine segments gives "
                            "8.6 -> 7.3 MiB, over the 6.5 MiB the budget allows",
}


def _loss_fn_budget_cases() -> list[Any]:
    return [pytest.param(arch, later, id=f"{arch}-{'later_step' if later else 'first_step'}",
                         marks=[pytest.mark.xfail(strict=True, reason=_NO_FIX_FITS[(arch, later)])]
                         if (arch, later) in _NO_FIX_FITS else [])
            for arch in _archs("loss_fn") for later in (False, True)]


@pytest.mark.parametrize(("arch", "later"), _loss_fn_budget_cases())
def test_a_loss_fn_step_over_budget_gets_a_fix_that_fits(arch: str, later: bool) -> None:
    test = test_a_loss_fn_step_over_budget_gets_a_fix_that_fits
    objs = _objects(arch, test, later)
    model, opt, loss_fn = objs["model"], objs["opt"], objs["loss_fn"]
    pixel_values, labels = objs["pixel_values"], objs["labels"]
    budget = _budget(arch, test, objs, later)
    with pytest.raises(torch.OutOfMemoryError):
        with gs.record(memory="tracker", budget=budget) as rec:
            out = model(pixel_values=pixel_values)
            loss = loss_fn(out.logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
    d = gs.diagnose(rec)
    _check_under_budget(arch, d, test, later, budget)


# ----------------------------------------------------------------------------------------------
# the harness itself, on a fix written here (so that it can fail where a fix is wrong)
# ----------------------------------------------------------------------------------------------
class _Fix:
    """A stand-in finding: the shape of ``gs.diagnose``'s findings, with code written here."""

    def __init__(self, code: str, saves_bytes: int | None = None, message: str = "", pattern: str = "test") -> None:
        self.pattern, self.code, self.message, self.saves_bytes = pattern, code, message, saves_bytes
        self.peak_before = self.peak_after = self.fits = self.tolerance = None


def test_the_harness_reads_the_block_as_written() -> None:
    src = block_source(test_findings_of_a_loss_fn_step_run_verbatim)
    assert src == ("out = model(pixel_values=pixel_values)\n"
                   "loss = loss_fn(out.logits, labels)\n"
                   "loss.backward()\n"
                   "opt.step()\n"
                   "opt.zero_grad()\n")


def test_the_harness_sees_a_same_step_as_the_same_and_a_changed_step_as_changed() -> None:
    objs = setup("gpt2")
    step = block_source(test_findings_of_a_batch_step_run_verbatim)
    model, opt, batch = objs["model"], objs["opt"], objs["batch"]
    out = model(**batch)  # one step first: the optimizer has state, as after the recorded step
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    snapshot = copy.deepcopy(objs)
    # the same step, written differently (micro-batches of a mean loss, each weighed by its share)
    halves = ("ids = batch['input_ids']\n"
              "for part in ids.chunk(2):\n"
              "    (model(input_ids=part, labels=part).loss * len(part) / len(ids)).backward()\n"
              "opt.step()\n"
              "opt.zero_grad()\n")
    same = check_finding("gpt2", _Fix(halves), snapshot, step)
    assert same.error is None and same.mismatches == []
    assert 0 < same.measured < same.user_peak  # half the activations alive at once
    # a step that forgets to scale: gradients (so parameters and Adam's moments) differ
    unscaled = halves.replace(" * len(part) / len(ids)", "")
    wrong = check_finding("gpt2", _Fix(unscaled), snapshot, step)
    assert any(m.startswith("optimizer state 'exp_avg' of transformer.h.0.attn.c_attn.weight")
               for m in wrong.mismatches), wrong.mismatches
    assert any(m.startswith("transformer.h.0.attn.c_attn.weight: max |diff|") for m in wrong.mismatches)
    # an autocast finding is held to the tolerance its message states, and needs one
    loose = check_finding("gpt2", _Fix(halves, pattern="autocast", message="within rtol=1e-2, atol=1e-3"),
                          snapshot, step)
    assert loose.mismatches == []
    silent = check_finding("gpt2", _Fix(halves, pattern="autocast"), snapshot, step)
    assert silent.mismatches and "states no tolerance" in silent.mismatches[0]
    # the copies are the snapshot's: the user's objects are untouched by any of it
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), snapshot["model"].parameters(), strict=True))


def _forward(objs: Objects, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    kwargs = objs.get("batch") or {k: objs[k] for k in ("input_ids", "labels", "pixel_values") if k in objs}
    out = objs["model"](**kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.logits_per_image


def test_dropout_is_off_in_every_model_as_built() -> None:
    """See NOTE [ dropout off ] in tests/_arch.py: the train-mode forward draws no random numbers."""
    for arch in ARCHS:
        objs = setup(arch)
        assert objs["model"].training
        assert torch.equal(_forward(objs, 1), _forward(objs, 2)), arch
    # the check sees dropout where it is on: GPT-2 as transformers builds it (p=0.1)
    objs = setup("gpt2")
    torch.manual_seed(0)
    objs["model"] = ARCHS["gpt2"]()[0].train()
    assert not torch.equal(_forward(objs, 1), _forward(objs, 2))
