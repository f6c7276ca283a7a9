"""Fixes for any step that does not fit, each a rewriting of the user's step (see
:mod:`gradscope._analyses.diagnose.step`) that the diagnosis runs on copies before showing it (see NOTE [ nothing
shown that was not run ] in :mod:`gradscope._analyses.diagnose.measure`). One module per fix; ``TOOLBOX`` is the
order they are tried in, those that change least and cost no time first (see NOTE [ the first fix that fits ]
in :mod:`gradscope._analyses.diagnose.measure`). Each ``propose(ctx, bench, shape)`` returns ``(finding, code)`` candidates, or
measures variants itself through ``bench`` where the fix has a size to choose (micro-batch size)."""

from __future__ import annotations

from gradscope._analyses.diagnose.toolbox import (
    autocast,
    checkpoint,
    dead_forwards,
    loop_backward,
    micro_batches,
    set_to_none,
    step_in_backward,
)

TOOLBOX = (dead_forwards, loop_backward, checkpoint, micro_batches, step_in_backward, set_to_none, autocast)

__all__ = ["TOOLBOX"]
