"""``python -m gradscope demo``: record a mixed second derivative through a frozen model and compare
three ways to compute it, saying what each result means.

The problem (from a user's thread): ``d/dy <1, d f(y, G(z)) / dz>`` through a frozen model ``G`` (a
stack of Linear + Tanh layers). Double backward with ``create_graph=True`` keeps ``G``'s graph and
the graph of its backward (the reference); forward AD keeps neither (the same result, a fraction of
the memory); the thread's two-step "split" loses the gradient, and the comparison shows it as
*wrong*: that is the point of checking results, not only memory.

Example:
    >>> from gradscope.__main__ import main
    >>> main(["demo", "--depth", "2", "--width", "16", "--batch", "4", "--out", ""])  # doctest: +ELLIPSIS
    The problem: ...
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradscope._model.recording import atomic_write_text, format_bytes

__all__ = ["demo", "main", "setup"]


def _problem(
    depth: int, width: int, batch: int
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    G = nn.Sequential(*layers).eval()  # "pretrained": its parameters still require grad, as loaded

    def f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return ((y + g) ** 3).sum()

    z = torch.randn(batch, width)
    y = torch.randn(batch, width, requires_grad=True)
    return f, G, z, y


def _problem_text(depth: int, width: int, batch: int) -> str:
    return (f"d/dy <1, d f(y, G(z))/dz>, a mixed second derivative through a frozen G of {depth} x "
            f"(Linear {width} + Tanh), batch {batch}")


def _meanings(cmp: Any) -> list[str]:
    """What each candidate's row means, from the comparison's own figures."""
    rows = {r.name: r for r in cmp.rows}
    ref = rows["create_graph"]
    out = []
    if ref.status == "ok":
        out.append(f"create_graph: the reference. Double backward with create_graph=True keeps G's graph and the "
                   f"graph of its own backward alive at once: peak {format_bytes(ref.peak_bytes)}.")
    else:
        out.append(f"create_graph: the reference {ref.status}: {ref.message}")
    for name, what in (("forward_ad", "Forward-mode AD through G keeps neither graph"),):
        r = rows[name]
        if r.status == "ok" and ref.status == "ok" and ref.peak_bytes:
            ratio = r.peak_bytes / ref.peak_bytes
            out.append(f"{name}: {what}: the same result (max abs error {r.max_abs_error:g}) at "
                       f"{format_bytes(r.peak_bytes)}, {ratio:.2f}x the reference's peak"
                       + ("; the one to use." if ratio < 1 else "."))
        else:
            out.append(f"{name}: {r.status}: {r.message}")
    split = rows["split"]
    if split.status == "wrong":
        lower = (split.peak_bytes is not None and ref.peak_bytes is not None and split.peak_bytes < ref.peak_bytes)
        out.append(f"split: wrong, and that is the point: the thread's two-step split (backward through G first, "
                   f"then through f) loses the gradient ({split.message}). "
                   + ("Its peak is lower too, which is why " if lower else "That is why ")
                   + "gs.compare checks every result against the reference before it compares memory.")
    else:
        out.append(f"split: {split.status} (expected wrong: the two-step split loses the gradient): {split.message}")
    return out


def demo(out: str = "demo.html", depth: int = 24, width: int = 512, batch: int = 64) -> int:
    """Record the mixed second derivative, print its summary, the strategy comparison and what each
    result means, write ``out``.

    Args:
        out: where to write the comparison as one HTML page; ``""`` to write nothing.
        depth: number of Linear + Tanh layers in ``G``.
        width: layer width.
        batch: batch size of ``z`` and ``y``.

    Returns:
        The process exit status (0).
    """
    from gradscope._analyses.compare import compare
    from gradscope._analyses.strategies.mixed import mixed_grad
    from gradscope._capture.record import record

    f, G, z, y = _problem(depth, width, batch)
    print(f"The problem: {_problem_text(depth, width, batch)}.")
    print("Three ways to compute it are recorded and compared: create_graph (the reference), forward_ad, split.")
    print()
    with record(label="create_graph", modules={"G": G}) as rec:
        mixed_grad(f, G, z, y, method="create_graph")
    assert rec.recording is not None
    print(rec.recording.summary())
    print()
    candidates = {
        method: (lambda method=method: mixed_grad(f, G, z, y, method=method))
        for method in ("create_graph", "forward_ad", "split")
    }
    cmp = compare(candidates, reference="create_graph", modules={"G": G})
    print(cmp.summary())
    print()
    print("What the results mean:")
    meanings = _meanings(cmp)
    for line in meanings:
        print(f"  {line}")
    if out:
        print()
        try:
            from gradscope._views.html import comparison_html
        except ImportError as e:
            print(f"gradscope.html is not available ({e}); no {out} written.")
        else:
            problem = f"The problem: {_problem_text(depth, width, batch)}. " + " ".join(meanings)
            atomic_write_text(out, comparison_html(cmp, problem=problem))
            print(f"wrote {out}")
    return 0


def setup() -> int:
    """``python -m gradscope setup``: compile the fast saved-tensor hooks for this PyTorch now (or wait
    for the builder at work), say how long it took and where the build went (a first recording
    would otherwise build them in the background; see NOTE [ first use never waits for the
    compiler ] in gradscope._capture.native).

    Returns:
        The process exit status: 0 when built, cached or skipped (``GRADSCOPE_NATIVE=0``), 1 when
        the build failed (said on stderr; the Python hooks then record).
    """
    from gradscope._capture import native as _native

    if _native._mode() == "0":
        print("gradscope: GRADSCOPE_NATIVE=0: the Python hooks record; nothing built")
        return 0
    try:
        path = _native.build()
    except OSError as e:
        print(f"gradscope: the compiled hooks could not be built ({str(e).splitlines()[0]}); the Python hooks "
              "record instead, more slowly. Install a C++ compiler (or set CXX) and run this again.", file=sys.stderr)
        return 1
    print(f"gradscope: the compiled saved-tensor hooks for torch {torch.__version__} are in {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m gradscope demo [--out demo.html] [--depth 24] [--width 512] [--batch 64]``,
    ``python -m gradscope setup``."""
    parser = argparse.ArgumentParser(prog="python -m gradscope", description="gradscope command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="record a mixed second derivative through a frozen model and compare three ways "
                                    "to compute it (create_graph, forward_ad, and split, which is wrong on purpose)")
    p.add_argument("--out", default="demo.html", help="HTML file to write ('' for none)")
    p.add_argument("--depth", type=int, default=24, help="Linear + Tanh layers in the frozen model")
    p.add_argument("--width", type=int, default=512, help="layer width")
    p.add_argument("--batch", type=int, default=64, help="batch size")
    sub.add_parser("setup", help="compile gradscope's fast saved-tensor hooks now (else done in the background)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.out, args.depth, args.width, args.batch)
    if args.command == "setup":
        return setup()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
