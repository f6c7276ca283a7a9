"""Two small helpers every payload and timeline shares: one downsampler and one interner.

NOTE [ downsampling keeps the peak ]: a timeline of a million points is thinned before it is
stored or drawn. :func:`downsample` cuts the points into equal buckets (one per pixel-ish column)
and keeps each bucket's first, lowest and highest point, plus the last point, the global peak
and any point the caller must keep (an OOM, the reserved peak). So the curve's envelope, its
peak and its ends survive exactly, and the first points sample the time evenly: a phase that is
never an extreme (backward, between a forward's top and an optimizer's bottom) still shows.
Points in between may go. The recorder (``max_events``), the widget, the job view and a CUDA
snapshot all call it.

NOTE [ strings interned in one table ]: payloads send columns of small integers instead of
repeated strings (module paths, file names, labels): :class:`Interner` gives each distinct value
an index in order of first sight, and its ``table`` travels once beside the columns.

Example:
    >>> downsample([0, 5, 1, 9, 2, 3, 7, 1, 0, 4], 8)  # two buckets of five points
    [0, 3, 5, 6, 8, 9]
    >>> s = Interner[str]()
    >>> [s("a"), s("b"), s("a"), s(None)], s.table
    ([0, 1, 0, -1], ['a', 'b'])
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

import torch

__all__ = ["Interner", "bucket_width", "downsample"]

K = TypeVar("K", bound=Hashable)


def bucket_width(n: int, limit: int, extra: int = 0) -> int:
    """Points per bucket when :func:`downsample` thins ``n`` points to ``limit`` with ``extra``
    points that must be kept: three points per bucket, and the last and the peak point beside
    them. Buckets are ``[0, w)``, ``[w, 2w)``, ...; the last may be shorter."""
    buckets = max(1, (limit - 2 - extra) // 3)
    return max(1, -(-n // buckets))


def downsample(values: Sequence[int] | Sequence[float] | torch.Tensor, limit: int,
               keep: Iterable[int] = ()) -> list[int]:
    """Indices of the points to keep, sorted: all of them when there are at most ``limit``;
    otherwise, per bucket (see :func:`bucket_width`) its first point and its lowest and highest
    point (the first of equal ones), plus the last point, the peak (the first highest point) and
    every index in ``keep``. At most ``max(limit, 5 + len(keep))`` indices.
    See NOTE [ downsampling keeps the peak ]."""
    n = int(values.numel()) if isinstance(values, torch.Tensor) else len(values)
    if n <= limit:
        return list(range(n))
    must = {int(i) for i in keep if 0 <= int(i) < n}
    v = values.flatten() if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    w = bucket_width(n, limit, len(must))
    rows = -(-n // w)
    # the short last bucket is padded with the last value: never lower or higher than that
    # bucket's own last point, so argmin/argmax (the first of equal values) stay inside it
    grid = torch.cat([v, v[-1:].expand(rows * w - n)]).view(rows, w)
    base = torch.arange(rows) * w
    picked = torch.cat([base, base + grid.argmin(1), base + grid.argmax(1)])
    out = set(picked.tolist()) | must
    out |= {n - 1, int(torch.argmax(v).item())}
    return sorted(out)


class Interner(Generic[K]):
    """Gives each distinct value an index in order of first sight (``None``: -1); ``table`` lists
    the values by index. See NOTE [ strings interned in one table ]."""

    def __init__(self) -> None:
        self.table: list[K] = []
        self._index: dict[K, int] = {}

    def __call__(self, value: K | None) -> int:
        if value is None:
            return -1
        i = self._index.get(value)
        if i is None:
            i = self._index[value] = len(self.table)
            self.table.append(value)
        return i

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, value: object) -> bool:
        return value in self._index
