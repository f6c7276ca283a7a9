"""Sizes as people read them (the lowest layer: imports nothing of gradscope)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes under 1 KiB. Deterministic.

    Example:
        >>> format_bytes(1536), format_bytes(512), format_bytes(None)
        ('1.5 KiB', '512 B', 'n/a')
    """
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{int(v)} B" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")
