"""Measure every scenario again and print what the registry stores (and what the diagnosis says).

Run from ``tests/``: ``python -m scenarios.measure [NAME ...] [--diagnose]``. Peaks are under
``gs.record(memory="cpu")``; tracker peaks (``memory="tracker"``) are what a simulated budget counts,
so a budget is chosen between the fix's and the user's tracker peaks.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch

import gradscope as gs

from . import SCENARIOS, Scenario, advice_in, diagnose_user, run, same_results


def _results(s: Scenario, fn: Any) -> tuple[int, dict[str, Any], BaseException | None]:
    r = run(s, fn)
    return r.peak, r.outcome(s.ignore), r.error


def measure(s: Scenario, diagnose: bool) -> None:
    print(f"== {s.name}: {s.title}")
    ref_fn = s.reference or s.user
    peak_u, out_u, err_u = _results(s, s.user)
    print(f"  peak_user={peak_u}  error={type(err_u).__name__ + ': ' + str(err_u)[:80] if err_u else None}")
    ref = run(s, ref_fn, memory=None).outcome(s.ignore) if s.reference else out_u
    if s.reference and err_u is None:
        print(f"  user vs reference differ in: {same_results(out_u, ref, s.rtol, s.atol)}")
    tr_u = run(s, s.user, memory="tracker").peak
    if s.fix is not None:
        peak_f, out_f, err_f = _results(s, s.fix)
        tr_f = run(s, s.fix, memory="tracker").peak
        diff = same_results(out_f, ref, s.rtol, s.atol)
        print(f"  peak_fix={peak_f}  saving={peak_u - peak_f}  fix error={err_f}  differs in: {diff}")
        print(f"  tracker: user={tr_u} fix={tr_f}  budget~={(tr_u + tr_f) // 2 // 1024 * 1024}")
    else:
        print(f"  tracker: user={tr_u}")
    for w in s.wrong:
        peak_w, out_w, err_w = _results(s, w.apply)
        diff = same_results(out_w, ref, s.rtol, s.atol)
        print(
            f"  wrong {w.advice}: peak={peak_w} ({peak_w - peak_u:+d} vs user)  "
            f"error={type(err_w).__name__ + ': ' + str(err_w)[:70] if err_w else None}  differs in {len(diff)}: {diff[:4]}"
        )
    if diagnose:
        for budget in ([True, False] if s.budget else [False]):
            d, _, warned = diagnose_user(s, budget=budget)
            print(f"  diagnosis ({'budget' if budget else 'peak'}):" + (f" WARNED {warned}" if warned else ""))
            for f in d.findings:
                print(f"    [{f.pattern}] {f.message[:150]}")
                print(f"       code: {f.code}")
            right = [str(a) for a in s.right if advice_in(d, a)]
            wrong = [str(w.advice) for w in s.wrong if advice_in(d, w.advice)]
            print(f"    right advice given: {right or ('(none expected)' if not s.right else 'NO')}; wrong given: {wrong}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--diagnose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, gradscope {gs.__file__}")
    for name in args.names or SCENARIOS:
        measure(SCENARIOS[name], args.diagnose)


if __name__ == "__main__":
    main()
