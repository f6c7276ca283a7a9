"""``python -m gradscope demo``: record a mixed second derivative through a frozen model and compare
three ways to compute it, saying what each result means.

This module is a face: ``python -m gradscope`` runs :func:`gradscope._notebook.cli.main`, where it is defined.
"""

from __future__ import annotations

from gradscope._notebook.cli import demo, main, setup

__all__ = ["demo", "main", "setup"]

if __name__ == "__main__":
    raise SystemExit(main())
