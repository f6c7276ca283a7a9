"""The table a recording keeps its rows in: columns, a row made the first time it is read (see
NOTE [ tables are columns ]). :mod:`gradscope.recording` is its face."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Table(Sequence[T], Generic[T]):
    """An immutable table of rows of one dataclass, kept as columns; a row object is made the
    first time it is read (then kept).

    NOTE [ tables are columns ]: a recording of a graph of small ops holds tens of thousands of
    nodes, saves, steps, allocations and timeline points; making a frozen dataclass object for
    each costs about a microsecond, as much as PyTorch spends on a small op, so the recorder
    hands its tables over as columns. Read a table as the tuple of rows it stands for (it
    compares equal to one); :meth:`column` gives one field of every row without making rows
    (what JSON, the widget and the page need).

    Example:
        >>> from gradscope.recording import Edge, Table
        >>> t = Table(Edge, {"src": [1, 2], "dst": [0, 1]})
        >>> len(t), t[1], t == (Edge(1, 0), Edge(2, 1)), t.column("src")
        (2, Edge(src=2, dst=1), True, [1, 2])
    """

    __slots__ = ("_cache", "_cls", "_cols", "_names", "_n", "_rows")

    def __init__(self, cls: type[T], columns: Mapping[str, Sequence[Any]], *, cache: bool = True) -> None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        names = [f.name for f in fields]
        lengths = {len(columns[n]) for n in names if n in columns}
        if len(lengths) > 1:
            raise ValueError(f"columns of {cls.__name__} have different lengths {sorted(lengths)}")
        n_rows = next(iter(lengths)) if lengths else 0
        # every field, in order (rows are made positionally); a column not given is its default's
        cols = [columns[f.name] if f.name in columns else [f.default] * n_rows for f in fields]
        if any(f.name not in columns and f.default is dataclasses.MISSING for f in fields):
            raise ValueError(f"a column of {cls.__name__} without a default is missing")
        lengths = {len(c) for c in cols}
        self._cls = cls
        self._names = names
        self._cols = cols
        self._n = lengths.pop() if lengths else 0
        self._rows: list[T] | None = None
        self._cache = cache  # False: rows are made each time they are read (a long loop's iterations)

    def _all(self) -> list[T]:
        rows = self._rows
        if rows is None:
            make = self._cls
            rows = [make(*vals) for vals in zip(*self._cols, strict=True)] if self._cols else []
            if self._cache:
                self._rows = rows
        return rows

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[T, ...]: ...
    def __getitem__(self, i: int | slice) -> T | tuple[T, ...]:
        if isinstance(i, slice):
            return tuple(self._all()[i])
        if self._rows is not None:
            return self._rows[i]
        if not -self._n <= i < self._n:
            raise IndexError("Table index out of range")
        return self._cls(*(c[i] for c in self._cols))  # one row: the others are not made

    def __iter__(self) -> Iterator[T]:
        if not self._cache and self._rows is None and self._cols:
            make = self._cls
            return (make(*vals) for vals in zip(*self._cols, strict=True))
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Table | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def column(self, name: str) -> Sequence[Any]:
        """One field of every row, in row order."""
        return self._cols[self._names.index(name)]
