"""What grows from iteration to iteration of a loop: the rule, over a series of live bytes at the end of
each iteration, and its online form (one site's running figures, kept as a long loop records).

NOTE [ growth across iterations ]: a loop's memory is steady when what is alive at the end of each
iteration stays the same; the first iteration makes what lives for the whole loop (gradients,
optimizer state) and is not counted. What grows does so when the live bytes at an iteration's end
exceed every earlier iteration's end (from the second on) in at least two iterations: one new high is
a step up (a cache filled once, a buffer resized), not growth, and a series that goes up and down (a
GAN's critic and generator iterations) makes no new high after its first cycle. Its growth is what it
added from the iteration before its first new high to its last one, over those iterations: the bytes
per iteration a list of kept results (losses kept as tensors, outputs kept across iterations) adds.
The same rule names the allocation sites that grow (by the user's line, else the module) and says
whether the block's memory as a whole grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SiteGrowth", "growth_of"]

WARMUP = 1  # iterations whose end is not compared (see NOTE [ growth across iterations ])


@dataclass(slots=True)
class SiteGrowth:
    """One series' running figures (see NOTE [ growth across iterations ]), fed one iteration's end
    at a time: O(1) memory whatever the loop's length."""

    prev: int = 0  # its live bytes at the last iteration's end
    high: int | None = None  # the most at any end compared so far
    highs: int = 0  # new highs seen
    base: int = 0  # its live bytes at the end before the first new high
    first: int = -1  # the iteration of the first new high, and of the last
    last: int = -1
    top: int = 0  # its live bytes at the last new high

    def add(self, iteration: int, live: int) -> None:
        """The series' live bytes at the end of ``iteration`` (iterations in order; a site absent
        from an iteration's end is fed 0)."""
        if iteration >= WARMUP:
            if self.high is None:
                self.high = live
            elif live > self.high:
                if self.highs == 0:
                    self.base, self.first = self.prev, iteration
                self.highs += 1
                self.high = self.top = live
                self.last = iteration
        self.prev = live

    def growth(self) -> tuple[int, int, int] | None:
        """(bytes added, first iteration, last iteration) where the series grows, else None."""
        if self.highs < 2 or self.top <= self.base:
            return None
        return self.top - self.base, self.first, self.last


def growth_of(series: Sequence[int]) -> tuple[int, int, int] | None:
    """The rule over a whole series (live bytes at each iteration's end, in order): (bytes added,
    first iteration, last iteration) where it grows, else None.

    Example:
        >>> growth_of([100, 104, 108, 112, 116])  # a loss kept as a tensor each iteration
        (12, 2, 4)
        >>> growth_of([100, 900, 100, 900, 100, 900]) is None  # alternating iterations: steady
        True
    """
    g = SiteGrowth()
    for k, v in enumerate(series):
        g.add(k, v)
    return g.growth()
