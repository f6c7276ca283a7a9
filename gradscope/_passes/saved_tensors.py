"""The saved tensors' pass: each save's node, attribute, storage, kind and parameter name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradscope._base.series import Interner
from gradscope._base.trace import (
    S_LEAFISH,
    S_SEQ,
    S_SKEY,
    Trace,
)
from gradscope._model import names as _names
from gradscope._model.recording import (
    Kind,
)
from gradscope._passes.nodes import _INNER_NODE, Graph


# ----------------------------------------------------------------------------------- saves
@dataclass
class Saves:
    """Saves attached to nodes, one list per field (``sid``: index into ``trace.saves``)."""

    sid: list[int]
    node: list[int]
    attribute: list[str]
    kind: list[Kind]
    name: list[str | None]
    storage: list[int]  # recording-local storage id
    dropped: int

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(save index, node id) for each save attached to a node."""
        return list(zip(self.sid, self.node, strict=True))


_DTYPE: dict[Any, str] = {}


def _dtype(d: Any) -> str:
    s = _DTYPE.get(d)
    if s is None:
        s = _DTYPE[d] = str(d).replace("torch.", "")
    return s


def saves_pass(trace: Trace, graph: Graph, prefixes: Sequence[str]) -> Saves:
    """Each save attached to the node that saved it (see NOTE [ which node saved a tensor ] in
    :mod:`gradscope._capture.record`), with its attribute, its kind and its parameter name."""
    sids: list[int] = []
    nodes: list[int] = []
    attrs: list[str] = []
    kinds: list[Kind] = []
    names: list[str | None] = []
    storages: list[int] = []
    storage_ids: Interner[int] = Interner()  # storage key -> storage id, in order of first save
    by_seq_get = graph.by_seq.get
    save_attr_get, seq_attr_get, param_get = trace.save_attr.get, trace.seq_attr.get, trace.param_keys.get
    seq_order = trace.seq_order
    position: dict[int, int] = {}  # saves of a node in seq_order seen so far
    inner_position: dict[int, int] = {}  # saves of a CopySlices node's inner node seen so far
    kind_of = {"parameter": Kind.PARAMETER, "buffer": Kind.BUFFER}
    input_kind, activation = Kind.INPUT, Kind.ACTIVATION
    moves_get = trace.seq_moves.get
    # a storage's identity: its first save where the recorder gave one (see NOTE [ a storage's
    # identity in a block ] in gradscope._capture.saves), else its key
    identity = trace.save_storage if len(trace.save_storage) == len(trace.saves) else None
    for sid, s in enumerate(trace.saves):
        seq = s[S_SEQ]
        node = by_seq_get(seq)
        attr = save_attr_get(sid)
        if node is None:  # see NOTE [ saves packed under another number ] in gradscope._capture.discover
            moved = moves_get(seq)
            if moved is None or (node := by_seq_get(moved[0])) is None:
                continue
            if moved[1] == _INNER_NODE:  # see NOTE [ saves inside CopySlices ]
                k = inner_position.get(moved[0], 0)
                inner_position[moved[0]] = k + 1
                attr = attr or f"fn.saved[{k}]"
            attr = attr or moved[1]
        sids.append(sid)
        nodes.append(node)
        attr = attr or seq_attr_get(seq)
        if attr is None and seq in seq_order:  # see NOTE [ pack order ] in gradscope._capture.discover
            k = position.get(seq, 0)
            position[seq] = k + 1
            order = seq_order[seq]
            attr = order[k] if k < len(order) else None
        attrs.append(attr or f"saved[{len(sids) - 1}]")
        skey = s[S_SKEY]
        named = param_get(skey)
        if named is not None:
            root, rel, kind = named
            kinds.append(kind_of[kind])
            names.append(_names.full_name(prefixes[root], rel))
        else:
            kinds.append(input_kind if s[S_LEAFISH] else activation)
            names.append(None)
        storages.append(storage_ids(skey if identity is None else identity[sid]))
    return Saves(sids, nodes, attrs, kinds, names, storages, len(trace.saves) - len(sids))
