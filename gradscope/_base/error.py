"""The root of gradscope's errors, below every other module (public in :mod:`gradscope.errors`)."""

from __future__ import annotations

__all__ = ["GradscopeError"]


class GradscopeError(RuntimeError):
    """A gradscope error: the message says what went wrong and what to do next.

    NOTE [ the error below the units ]: defined here, importing nothing, so that the lowest modules
    (:func:`gradscope._base.units.parse_size`) raise it while :mod:`gradscope.errors`, which formats sizes,
    stays their face; it is shown as ``gradscope.errors.GradscopeError``, where users import it.
    """

    __module__ = "gradscope.errors"
