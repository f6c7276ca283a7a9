"""Each node's module path and each leaf's parameter name."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from gradscope._base.trace import (
    C_SEQ0,
    C_SEQ1,
    N_KEY,
    N_LEAF,
    N_SEQ,
    Trace,
)
from gradscope._model import names as _names
from gradscope._passes.nodes import Graph, call_path
from gradscope._passes.steps import Steps


# ----------------------------------------------------------------------------------- modules
def modules_pass(trace: Trace, graph: Graph, prefixes: Sequence[str], steps: Steps,
                 orders: Sequence[int]) -> list[str | None]:
    """Forward nodes get the innermost module call whose sequence range holds their number;
    nodes a backward made inherit the module of the node that made them; leaves their
    parameter's module."""
    n = len(graph.rows)
    modules: list[str | None] = [None] * n
    keyed = sorted((row[N_SEQ], i) for i, row in enumerate(graph.rows)
                   if isinstance(row[N_KEY], int) and orders[i] == 0)
    seqs = [q for q, _ in keyed]
    # Calls are appended at their start, so outer calls come before the calls nested in them:
    # writing each call's range in that order leaves every node with its innermost module.
    for call in trace.calls:
        lo = bisect.bisect_left(seqs, call[C_SEQ0])
        hi = bisect.bisect_left(seqs, call[C_SEQ1] if call[C_SEQ1] >= 0 else call[C_SEQ0])
        if lo < hi:
            path = call_path(trace, prefixes, call)
            for _, i in keyed[lo:hi]:
                modules[i] = path
    for i in sorted(steps.creators, key=lambda i: graph.rows[i][N_SEQ]):
        c = steps.creators[i]
        if c is not None and modules[i] is None:
            modules[i] = modules[c]
    for i in graph.leaves:
        name = leaf_name(graph.rows[i][N_LEAF], prefixes)
        if name and name != "input" and modules[i] is None and "." in name:
            modules[i] = name.rsplit(".", 1)[0]
    return modules


def leaf_name(leaf: Any, prefixes: Sequence[str]) -> str | None:
    """A node row's leaf field as a name: ``(root, path)`` -> ``"G.0.weight"``."""
    if isinstance(leaf, tuple):
        root, rel = leaf
        return _names.full_name(prefixes[root], rel) if root < len(prefixes) else rel
    return leaf
