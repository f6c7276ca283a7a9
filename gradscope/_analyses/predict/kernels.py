"""The kernels a device would choose, chosen on meta: attention and dropout take the fused kernels of
their dtype (NOTE [ patching the attention function ]), autocast is refused by name (NOTE
[ autocast is refused by name ]), and the CPU random states a step takes are counted on CPU."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base.errors import GradscopeError


@contextlib.contextmanager
def _kernel_choices(device: str, counts_rng: Any = None) -> Iterator[None]:
    """On meta tensors, attention and dropout take the kernels the target device would take; with
    ``counts_rng`` (a recorder, for ``device="cpu"``), each CPU random state this thread's step takes
    (``torch.get_rng_state()``: the 5,056 bytes of the generator's state that non-reentrant
    checkpointing keeps for every checkpointed segment until its recomputation) is counted by its
    memory source from the call until the tensor is freed: PyTorch makes it outside any operator, so
    no dispatch mode sees it, and the CPU allocator does (see NOTE [ bytes no operator output holds ]
    in gradscope._analyses.predict.predictor).

    ``scaled_dot_product_attention`` asks a per-device function which fused kernel to use; the
    meta device has none, so it always takes the unfused math path, which saves the whole attention
    matrix. While a prediction runs, ``torch.nn.functional.scaled_dot_product_attention`` (the
    name ``nn.MultiheadAttention`` and user code call) chooses as the target would and calls that
    kernel's meta implementation:

    - ``"cpu"``: the CPU's own choice function, run on stand-ins of the same shapes and dtypes that
      hold one row of memory each; when it says flash, the CPU flash kernel (it saves the output
      and a log-sum-exp);
    - ``"cuda"``: flash attention for float16/bfloat16 without a mask (head size a multiple of 8,
      at most 256), else memory-efficient attention (head size a multiple of 8), else the math
      path; the GPU's own choice also depends on its architecture, which a prediction cannot see.

    For ``"cuda"``, ``torch.nn.functional.dropout`` in training takes the fused kernel a GPU uses
    (``native_dropout``, which saves a one-byte mask) instead of the CPU path (a float mask).
    Calls from other threads, or with tensors that are not on meta, go to the originals unchanged.

    NOTE [ patching the attention function ]: a TorchFunctionMode cannot do this: modes are off
    while their handler runs, so attention called inside a Python-level function that the mode
    handled (``multi_head_attention_forward``) would never reach it.
    """
    import torch.nn.functional as F  # noqa: N812

    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            originals: dict[str, Any] = {"sdpa": F.scaled_dot_product_attention, "dropout": F.dropout,
                                         "autocast": torch.amp.autocast_mode.autocast.__init__,
                                         "rng": torch.get_rng_state}
            _ORIGINALS.append(originals)
            F.scaled_dot_product_attention = _patched_sdpa(originals["sdpa"])
            F.dropout = _patched_dropout(originals["dropout"])
            torch.amp.autocast_mode.autocast.__init__ = _refused_autocast(originals["autocast"])  # type: ignore[method-assign]
            torch.get_rng_state = _counted_rng_state(originals["rng"])
        _PATCH_DEPTH += 1
    previous = getattr(_TARGET, "device", None), getattr(_TARGET, "rng_rec", None)
    _TARGET.device, _TARGET.rng_rec = device, counts_rng
    try:
        yield
    finally:
        _TARGET.device, _TARGET.rng_rec = previous
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                originals = _ORIGINALS.pop()
                F.scaled_dot_product_attention = originals["sdpa"]
                F.dropout = originals["dropout"]
                torch.amp.autocast_mode.autocast.__init__ = originals["autocast"]  # type: ignore[method-assign]
                torch.get_rng_state = originals["rng"]


def _counted_rng_state(original: Any) -> Any:
    def get_rng_state() -> torch.Tensor:
        state = original()
        rec = getattr(_TARGET, "rng_rec", None)
        src = None if rec is None else rec.memory_source
        if src is not None and hasattr(src, "count_unseen"):
            nbytes = state.untyped_storage().nbytes()
            key = src.count_unseen(nbytes, "torch.get_rng_state (the CPU generator's state)")
            weakref.finalize(state, src.end_unseen, key, nbytes)
        return state

    return get_rng_state


def _patched_sdpa(original: Any) -> Any:
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        device = getattr(_TARGET, "device", None)
        out = None if device is None else _attention_on_meta(device, *args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


# NOTE [ autocast is refused by name ]: autocast casts only tensors of its own device, so on meta
# tensors it casts nothing, and on a CPU-only build ``torch.autocast("cuda")`` turns itself off with a
# warning: a prediction of an autocast step would silently be float32's (measured on three real GPU
# files: 0.81-1.10 of the real peak). So a prediction refuses a step that enters an enabled
# ``torch.autocast`` (``torch.amp.autocast``, ``torch.cuda.amp.autocast``, as a decorator too),
# naming it, in the thread that predicts: a :class:`GradscopeError` raised where it is entered, and
# again after the step if the step caught it.
def _refused_autocast(original: Any) -> Any:
    def __init__(self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
        if getattr(_TARGET, "device", None) is not None and enabled:
            name = f"torch.autocast({device_type!r}" + (f", dtype={dtype}" if dtype is not None else "") + ")"
            _TARGET.autocast = name
            raise GradscopeError(_autocast_message(name))
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    __init__.__doc__ = original.__doc__
    return __init__


def _autocast_message(name: str) -> str:
    return (f"gradscope: the step runs under {name}, which a prediction cannot apply: autocast casts only "
            "tensors of its own device, none of the meta tensors a prediction runs on (and on a build "
            "without CUDA, torch.autocast('cuda') turns itself off), so its numbers would be float32's. "
            "Predict the step without autocast for its float32 memory, or measure a real run with gs.record() "
            "on the device.")


def _patched_dropout(original: Any) -> Any:
    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if (
            getattr(_TARGET, "device", None) == "cuda"
            and isinstance(input, torch.Tensor)
            and input.device.type == "meta"
            and training
            and 0 < p < 1
            and not inplace
        ):
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    dropout.__doc__ = original.__doc__
    return dropout


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_ORIGINALS: list[dict[str, Any]] = []
_TARGET = threading.local()  # the device the current thread's prediction is for


def _attention_on_meta(
    device: str,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    tensors = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
    if enable_gqa or not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return None
    if query.dim() != 4:
        return None
    if device == "cuda":
        head = query.shape[-1]
        if head % 8 != 0:
            return None
        if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        grad = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, _float_mask(attn_mask, query.dtype), grad, dropout_p, is_causal, scale=scale
        )[0]
    try:
        q, k, v = (_stand_in(t) for t in (query, key, value))
        choice = _compat.fused_sdp_choice(
            q, k, v, attn_mask=_stand_in(attn_mask), dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    except Exception:  # no answer: let the meta device decide
        return None
    if choice != 1:  # SDPBackend.FLASH_ATTENTION
        return None
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=_float_mask(attn_mask, query.dtype), scale=scale
    )
    return out


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """What the fused paths do with a boolean mask: an additive float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device="meta").masked_fill(mask.logical_not(), float("-inf"))


def _stand_in(t: Any) -> Any:
    """A CPU tensor that the CPU's kernel choice cannot tell from ``t``: the same shape, dtype and
    ``requires_grad``, holding one row of memory.

    NOTE [ stand-ins keep requires_grad ]: the choice depends on which inputs require grad (the
    CPU flash kernel has no gradient for ``attn_mask``, so a mask that requires grad, as Swin's
    relative position bias does, sends the real step to the math kernel); a stand-in that
    dropped the flag would make the prediction take a kernel the real step never runs.
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    if t.dim() == 0:
        s = torch.empty((), dtype=t.dtype, device="cpu")
    else:
        s = torch.empty(t.shape[-1], dtype=t.dtype, device="cpu").expand(t.shape).detach()
    return s.requires_grad_(t.requires_grad)
