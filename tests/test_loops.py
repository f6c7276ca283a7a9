"""Whole training loops recorded (loops from tests/_loops.py, written as their projects write them):
what a block over several iterations holds.

Saved bytes are checked against a bare ``saved_tensors_hooks`` pack hook that keeps every storage
it is given alive until the end, so that each storage is one object and no address names two (see
NOTE [ a storage's identity in a block ] in gradscope.capture.saves); the objects handed back to
the program against the program run without gradscope.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _loops
import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

import gradscope as gs
from gradscope import _native
from gradscope._passes import UNSEEN_NODE

MODES = ["off", "cpu", "tracker"]
PAIRS = ["compiled", "python"]


def _pair(pair: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if pair == "python":
        monkeypatch.setattr(_native, "hooks", lambda: None)
    elif _native.hooks() is None:
        pytest.skip(f"the compiled hooks are not in use here: {_native.status()['reason']}")


def _bare_saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the distinct storages a bare pack hook saw saved by ``run``: every storage is kept
    alive to the end (one object each), so their keys name one storage each."""
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        kept.setdefault(s._cdata, s)
        return t.detach() if t.requires_grad else t

    with saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(s.nbytes() for s in kept.values())


LOOPS: dict[str, Callable[[], Callable[[int], Any]]] = {
    "word_language_model": lambda: _loops.make_word_language_model("LSTM"),
    "dcgan": _loops.make_dcgan,
    "wgan_gp": _loops.make_wgan_gp,
}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", list(LOOPS))
def test_saved_bytes_of_a_loop_equal_a_bare_hooks(loop: str, mode: str, pair: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Three iterations, a backward each (TBPTT over chunks, a GAN's critic and generator steps):
    a storage freed by one chunk's backward and a new one made at its address in the next are two
    storages (each storage id's saves have one size), and the saves of a graph dropped before any
    backward (WGAN-GP's ``fake = generator(z).detach()``) are counted, on unseen nodes that name the
    generator's modules."""
    _pair(pair, monkeypatch)
    expected = _bare_saved_bytes(lambda: LOOPS[loop]()(3))
    train = LOOPS[loop]()
    names = {"dcgan": ("netG", "netD"), "wgan_gp": ("generator", "critic")}.get(loop)
    given = dict(zip(names, train.models, strict=True)) if names else None  # type: ignore[attr-defined]
    with gs.record(memory=mode, modules=given) as rec:
        train(3)
    r = rec.recording
    assert r is not None and r.complete
    assert r.saved_bytes == expected
    sizes: dict[int, set[int]] = {}
    for s in r.saved:
        sizes.setdefault(s.storage, set()).add(s.bytes)
    assert all(len(v) == 1 for v in sizes.values())
    unseen = [n for n in r.nodes if n.name == UNSEEN_NODE]
    if loop != "wgan_gp":  # DCGAN's G step backpropagates through the fake its D step detached
        assert not unseen
    else:  # the generator's forward under fake.detach(): its BatchNorm and activations saved
        assert names is not None and unseen and {str(n.module).split(".")[0] for n in unseen} == {names[0]}
        assert any(UNSEEN_NODE in note for note in r.notes)


def _saved_object_identity() -> tuple[bool, bool]:
    """The body of PyTorch's ``test_checkpointing_without_reentrant_saved_object_identity`` (its
    test/test_autograd.py): a custom Function saves a tensor that needs no grad; read back in its
    backward it is the object saved, also when a non-reentrant checkpoint saved it first (as its
    input) and the Function saved it again in the recomputation."""
    x_backward = None

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx: Any, x: torch.Tensor) -> Any:
            nonlocal x_backward
            (x_backward,) = ctx.saved_tensors
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    first = b is x_backward
    x_backward = None
    checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    return first, b is x_backward


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", MODES)
def test_pytorchs_saved_object_identity_test_passes_recorded(mode: str, pair: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _pair(pair, monkeypatch)
    assert _saved_object_identity() == (True, True)  # as PyTorch's test asserts, without gradscope
    with gs.record(memory=mode) as rec:
        got = _saved_object_identity()
    assert got == (True, True)
    r = rec.recording
    assert r is not None and r.complete and not any("internal error" in n for n in r.notes)


@pytest.mark.parametrize("pair", PAIRS)
def test_one_object_saved_twice_is_checked_for_in_place_changes_per_save(pair: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save of one object keeps its own version (see NOTE [ one object saved twice ]): a change
    between the two saves fails the first save's backward, as without gradscope, and not the second's."""
    _pair(pair, monkeypatch)

    def run() -> list[str]:
        w = torch.ones(4, requires_grad=True)
        c = torch.full((4,), 2.0)
        first = (w * c).sum()  # saves c (version 0)
        with torch.no_grad():
            c.add_(1)  # version 1
        second = (w * c).sum()  # saves c again (version 1)
        errors = []
        for loss in (second, first):
            try:
                loss.backward()
            except RuntimeError as e:
                errors.append("modified by an inplace operation" in str(e))
        return errors

    plain = run()
    assert plain == [True]  # the first save's backward fails, the second's does not
    with gs.record(memory="off"):
        assert run() == plain
