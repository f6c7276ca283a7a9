"""Print, per architecture, the diagnosis's findings with their claimed and measured savings.

Runs the tests of tests/test_diagnose_real_models.py for each architecture (or those named on
the command line) and prints what they measured, passed or not:

    python tests/_diagnose_table.py [gpt2 bert ...]

First table, at the step's peak: each finding with code; claimed saving (``saves_bytes``) against
the measured one (copy A's peak - copy B's peak, counted as the diagnosis counts), the claimed peaks against copy A's and
B's, the bytes copy A's objects held before its step (parameters, gradients, optimizer state,
inputs), and whether the results matched. Second table, under a budget of 70 % of the step's peak:
each finding with code, whether it says it fits, and what its code gave under the budget.
"""

from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _arch  # noqa: E402
import test_diagnose_real_models as t  # noqa: E402
import torch  # noqa: E402

from gradscope.recording import format_bytes  # noqa: E402

TESTS = {
    "batch": (t.test_findings_of_a_batch_step_run_verbatim, t.test_a_batch_step_over_budget_gets_a_fix_that_fits),
    "kwargs": (t.test_findings_of_a_keyword_step_run_verbatim,
               t.test_a_keyword_step_over_budget_gets_a_fix_that_fits),
    "loss_fn": (t.test_findings_of_a_loss_fn_step_run_verbatim,
                t.test_a_loss_fn_step_over_budget_gets_a_fix_that_fits),
}


def _size(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines() or [""]
    first = " ".join(text[:2]) if text[0].endswith(":") and len(text) > 1 else text[0]
    return f"{type(e).__name__}: {first}"[:160]


def main(archs: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # as the tests run (tests/conftest.py); two threads on two shared cores crawl
    outcome: dict[tuple[str, int], str] = {}
    for arch in archs:
        at_peak, over_budget = TESTS[_arch.STYLE_OF[arch]]
        calls = [partial(at_peak, arch), partial(over_budget, arch, False), partial(over_budget, arch, True)]
        for i, call in enumerate(calls):
            try:
                call()
                outcome[arch, i] = "pass"
            except Exception as e:  # AssertionError and anything the diagnosis raised
                outcome[arch, i] = "FAIL " + _first_line(e)

    print("At the step's peak (no budget): each finding with code, run verbatim on a copy")
    print(f"{'arch':<13}{'finding':<20}{'claimed':>11}{'measured':>11}{'peak A -> B':>24}"
          f"{'claimed before -> after':>26}{'resident':>11}  results")
    for arch in archs:
        rows = [r for r in _arch.TABLE if r.arch == arch]
        if not rows:
            print(f"{arch:<13}{'(none)':<20}  {outcome[arch, 0]}")
        for r in rows:
            measured = "-" if r.error else _size(r.measured)
            results = (f"raised {r.error[:60]}" if r.error else
                       "equal" if not r.mismatches else f"{len(r.mismatches)} differ: {r.mismatches[0][:60]}")
            print(f"{arch:<13}{r.pattern:<20}{_size(r.claimed):>11}{measured:>11}"
                  f"{_size(r.user_peak) + ' -> ' + ('-' if r.error else _size(r.fix_peak)):>24}"
                  f"{_size(r.peak_before) + ' -> ' + _size(r.peak_after):>26}{_size(r.resident):>11}  {results}")
        print(f"{'':<13}test: {outcome[arch, 0]}")

    print()
    print("Under a budget of 70 % of the step's peak: findings with code, fits?, their code under the budget")
    for arch in archs:
        for b in (r for r in _arch.BUDGET_TABLE if r.arch == arch):
            found = "; ".join(f"{p} fits={fits} ran={ran or '-'}" for p, fits, ran in b.findings) or "(none)"
            print(f"{arch:<13}{'later' if b.later else 'first'} step, budget {format_bytes(b.budget)} of "
                  f"{format_bytes(b.peak)}: {found}")
            print(f"{'':<13}test: {outcome[arch, 2 if b.later else 1]}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(_arch.ARCHS))
