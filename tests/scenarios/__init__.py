"""The diagnosis scenario suite: user code, its right fix, the advice never to give, measured.

``SCENARIOS`` maps a name to a :class:`Scenario` (see ``_harness``). ``tests/test_diagnose_scenarios.py``
checks the ground truth (the fix keeps every result and changes the peak by the measured amount;
each wrong advice does what it says) and holds ``gs.diagnose`` to it. ``python -m scenarios.measure``
(from ``tests/``) measures everything again and prints the table the stored numbers come from.
"""

from __future__ import annotations

from . import gan, seed000, seed001, seed002, seed003, seed004, training
from ._harness import (
    ADVICE_KINDS,
    EFFECTS,
    Advice,
    Run,
    Scenario,
    Wrong,
    advice_in,
    diagnose_user,
    outcome,
    run,
    same_results,
)

__all__ = [
    "ADVICE_KINDS",
    "EFFECTS",
    "SCENARIOS",
    "Advice",
    "Run",
    "Scenario",
    "Wrong",
    "advice_in",
    "diagnose_user",
    "outcome",
    "run",
    "same_results",
]

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for module in (seed000, seed001, seed002, seed003, seed004, training, gan)
    for s in module.SCENARIOS
}
