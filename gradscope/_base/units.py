"""Sizes as people read them and write them (the lowest layer: imports only the root error)."""

from __future__ import annotations

from gradscope._base.error import GradscopeError

__all__ = ["format_bytes", "parse_size"]


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


def parse_size(size: int | str | None) -> int | None:
    """``"8GiB"`` -> 8589934592; ints pass through; raises GradscopeError on nonsense."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool)):
        if isinstance(size, int) and size <= 0:
            raise GradscopeError(f"gradscope: a memory budget must be positive, got {size}.")
        return size
    if not isinstance(size, str):
        raise GradscopeError(
            f"gradscope: a memory size must be an int of bytes or a string like '8GiB', got {size!r}."
        )
    s = size.strip().replace(" ", "")
    units = {
        "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
        "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4,
        "tib": 1024**4,
    }
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:].lower()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise GradscopeError(
            f"gradscope: cannot read the memory size {size!r}; write it like '512MiB', '8GiB' or "
            "'2GB' (KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000)."
        )
    return int(value * units[unit])
