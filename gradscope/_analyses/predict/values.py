"""Values known on meta: the integer and boolean tensors of a step run on meta whose values are
known exactly (see NOTE [ values known on meta ])."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscope._base import compat as _compat

# NOTE [ values known on meta ]: a meta tensor has no data, so code that reads a value (``.item()``,
# ``bool(t)``, ``if (mask == 0).all():``) cannot run on meta. Much of the code that does reads index
# tensors, not data: ``transformers`` builds position ids with ``torch.arange`` and, where the model
# runs without a cache (gradient checkpointing turns the cache off), asks whether they hold packed
# sequences (``find_packed_sequence_indices``: ``(mask[:, -1] == 0).all()``); a checkpointed
# ``transformers`` model could not be predicted, nor measured on meta by the diagnosis. So a small
# integer or boolean tensor gets its value where it is exact: one the user's step is given (its
# token ids, masks, labels; at most KNOWN_MAX elements), one a factory makes (``arange``, ``zeros``,
# ``full``; not ``empty``, whose values are none, and not a random one, whose values are the
# device's generator's), and the output of an operator whose meta inputs all have values (its
# value computed by the CPU kernel on theirs, outside every dispatch mode: nothing it allocates is
# counted). Integers and booleans only: their arithmetic is the same on every device, so a value
# read is the one the device's run reads; a float's is not, and a step that reads one still cannot
# run on meta. The meta operator itself runs as before, so what is counted does not change: values
# only decide which way the step's Python goes. An operator that writes into a tensor whose value
# it cannot compute drops the values of every tensor of that storage.
KNOWN_MAX = 1 << 20

_VALUES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> its value, a CPU tensor
_STORAGES: set[int] = set()  # storage keys of tensors with values (some may be gone)


def exact(t: torch.Tensor) -> bool:
    """Whether ``t`` is of a dtype whose values are the same on every device, and small enough."""
    return (not t.dtype.is_floating_point and not t.dtype.is_complex and t.layout == torch.strided
            and t.numel() <= KNOWN_MAX)


def know(meta: torch.Tensor, value: torch.Tensor) -> None:
    """``meta``'s value is ``value`` (a CPU tensor of its shape and dtype)."""
    _VALUES[meta] = value
    key = _compat.storage_key(meta)
    if key is not None:
        _STORAGES.add(key)


def value_of(t: Any) -> torch.Tensor | None:
    return _VALUES.get(t) if isinstance(t, torch.Tensor) else None


def forget_storage_of(t: torch.Tensor) -> None:
    """Drop the values of every tensor sharing ``t``'s storage (something wrote into it)."""
    key = _compat.storage_key(t)
    if key is None or key not in _STORAGES:
        return
    _STORAGES.discard(key)
    for m in [m for m in _VALUES.keys() if _compat.storage_key(m) == key]:
        _VALUES.pop(m, None)


def known_from(original: torch.Tensor, meta: torch.Tensor) -> None:
    """``meta``, made on meta from the user's ``original``, gets its value where it is exact."""
    if meta.device.type == "meta" and original.device.type != "meta" and exact(original):
        with torch.no_grad():
            know(meta, original.detach().to("cpu", copy=True))


def any_known() -> bool:
    return len(_VALUES) > 0
