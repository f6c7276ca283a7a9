"""A loss accumulated over a loop's iterations and differentiated once after the loop (a MAML outer loss
summed over tasks, a loss summed over chunks or micro-batches): every iteration's graph is alive until that
one backward. Each iteration's term is differentiated in its iteration instead (``backward_per_iteration``
in :mod:`gradscope._analyses.diagnose.step`): the gradients add up in ``.grad`` to the same values, one iteration's
graph alive at a time; the accumulated loss keeps its value, without a graph."""

from __future__ import annotations

from typing import Any

from gradscope._analyses.diagnose.facts import Context
from gradscope._analyses.diagnose.measure import Bench, Room
from gradscope._analyses.diagnose.result import Finding
from gradscope._analyses.diagnose.step import Shape, backward_per_iteration

PATTERN = "loop_backward"  # the name its finding and notes go by


def propose(ctx: Context, bench: Bench, shape: Shape, room: Room | None) -> list[tuple[Finding, Any]]:
    found = backward_per_iteration(shape)
    if found is None:
        return []
    code, name = found
    return [(Finding(
        pattern=PATTERN,
        bytes=0,
        variable=name,
        message=f"the loop's iterations keep their graphs alive together for one backward of {name} after it",
        suggestion=(f"call backward on each iteration's term inside the loop: the gradients add up in .grad to the "
                    f"same values, and each iteration's graph is freed at once ({name} keeps its value, without "
                    "a graph)"),
        code=code,
        step=code,
    ), bench.run(code))]
