"""What a recording holds of the program it watched: saves PyTorch hides inside ``CopySlices``
(an in-place op on a view), and saved tensors handed back to the program as the objects it saved.

Each case is checked against an independent count: a bare ``saved_tensors_hooks`` pack hook
that keeps the storages of the saves made in the same code, or plain PyTorch without gradscope.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import gradscope as gs

MODES = ["off", "cpu", "tracker"]


def _bare_saved_bytes(fn: Any) -> tuple[int, Any]:
    """Bytes of the distinct storages a bare pack hook saw saved by ``fn`` (still alive after it)."""
    kept: dict[int, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        kept[s.data_ptr()] = s
        return t.detach() if t.requires_grad else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(s.nbytes() for s in kept.values()), out


# (numel, whether the multiplier requires grad too, the view: flatten or a slice)
INPLACE_VIEW_CASES = list(itertools.product([64, 4096, 16384], [False, True], ["flat", "slice"]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", INPLACE_VIEW_CASES, ids=[f"{n}-{g}-{v}" for n, g, v in INPLACE_VIEW_CASES])
def test_saves_inside_copyslices_belong_to_it(mode: str, case: tuple[int, bool, str]) -> None:
    n, noise_grad, view = case
    torch.manual_seed(n)
    w = torch.randn(n, requires_grad=True)
    noise = torch.randn(n // 2 if view == "slice" else n, requires_grad=noise_grad)

    def block() -> torch.Tensor:
        y = w * 2
        v = y.view(-1) if view == "flat" else y[: n // 2]
        v.mul_(noise)  # in place on a view: PyTorch wraps MulBackward0 in CopySlices
        return y.sum()

    expected, _ = _bare_saved_bytes(block)

    def recorded() -> Any:
        with gs.record(memory=mode) as rec:
            loss = block()
            loss.backward()
        return rec.recording

    r = recorded()
    names = [node.name for node in r.nodes]
    assert "CopySlices" in names
    inner = [s for s in r.saved if names[s.node] == "CopySlices"]
    # mul_ saves the multiplier (for self's gradient), and self's value where noise needs a gradient
    assert len(inner) == (2 if noise_grad else 1)
    assert sorted(s.attribute for s in inner) == [f"fn.saved[{k}]" for k in range(len(inner))]
    assert r.saved_bytes == expected
    assert not any("freed before gradscope saw them" in note for note in r.notes)
    ran = [names[s.node] for s in r.steps]
    assert "CopySlices" in ran  # its step is seen in every mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["function", "module_input", "twice"])
def test_a_save_that_needs_no_grad_comes_back_as_the_same_object(mode: str, where: str) -> None:
    """PyTorch hands a saved tensor that does not require grad back from ``ctx.saved_tensors``
    as the object the program saved (attributes and identity kept); so does a recording."""
    seen: list[Any] = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w, w) if where == "twice" else ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            saved = ctx.saved_tensors
            w = saved[1]
            seen.append(saved)
            return g * w * w.scale, None

    def run() -> tuple[torch.Tensor, list[Any], torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(8, requires_grad=True)
        w = torch.randn(8)
        w.scale = 3.0  # type: ignore[attr-defined]
        seen.clear()
        Scale.apply(x, w).sum().backward()
        assert x.grad is not None
        return x.grad, list(seen), w

    plain_grad, plain_seen, plain_w = run()
    assert plain_seen[0][1] is plain_w
    with gs.record(memory=mode) as rec:
        grad, got, w = run()
    assert torch.equal(grad, plain_grad)
    assert got[0][1] is w
    if where == "twice":  # every save of one object hands it back (see NOTE [ one object saved twice ])
        assert got[0][2] is w
    assert rec.recording is not None and rec.recording.complete
