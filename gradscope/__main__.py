"""``python -m gradscope demo``: record the seed-000 problem and compare the strategies that solve it.

The problem: ``d/dy <1, d f(y, G(z)) / dz>`` through a frozen model ``G`` (a stack of Linear + Tanh
layers). Double backward with ``create_graph=True`` keeps ``G``'s graph and the graph of its backward;
forward AD keeps neither; the thread's two-step "split" loses the gradient.

Example:
    >>> from gradscope.__main__ import main
    >>> main(["demo", "--depth", "2", "--width", "16", "--batch", "4", "--out", ""])  # doctest: +ELLIPSIS
    seed 000: ...
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

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


def demo(out: str = "demo.html", depth: int = 24, width: int = 512, batch: int = 64) -> int:
    """Record the seed-000 problem, print its summary and the strategy comparison, write ``out``.

    Args:
        out: where to write the comparison as one HTML page; ``""`` to write nothing.
        depth: number of Linear + Tanh layers in ``G``.
        width: layer width.
        batch: batch size of ``z`` and ``y``.

    Returns:
        The process exit status (0).
    """
    import gradscope as gs
    from gradscope.strategies import mixed_grad

    f, G, z, y = _problem(depth, width, batch)
    print(
        f"seed 000: d/dy <1, d f(y, G(z))/dz> through a frozen G of {depth} x (Linear {width} + Tanh), batch {batch}"
    )
    print()
    with gs.record(label="seed 000: create_graph", modules={"G": G}) as rec:
        mixed_grad(f, G, z, y, method="create_graph")
    assert rec.recording is not None
    print(rec.recording.summary())
    print()
    candidates = {
        method: (lambda method=method: mixed_grad(f, G, z, y, method=method))
        for method in ("create_graph", "forward_ad", "split")
    }
    cmp = gs.compare(candidates, reference="create_graph", modules={"G": G})
    print(cmp.summary())
    if out:
        print()
        try:
            from gradscope.html import comparison_html
        except ImportError as e:
            print(f"gradscope.html is not available ({e}); no {out} written.")
        else:
            problem = (
                f"The problem (seed 000): d/dy <1, d f(y, G(z))/dz> through a frozen G of {depth} x (Linear {width} + "
                f"Tanh), batch {batch}; double backward with create_graph=True keeps G's graph and the graph of its "
                "own backward alive at once, forward AD needs neither, and the two-step split loses the gradient."
            )
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(comparison_html(cmp, problem=problem))
            print(f"wrote {out}")
    return 0


def setup() -> int:
    """``python -m gradscope setup``: compile the fast saved-tensor hooks for this PyTorch now (or wait
    for the builder at work), say how long it took and where the build went (a first recording
    would otherwise build them in the background; see NOTE [ first use never waits for the
    compiler ] in gradscope._native).

    Returns:
        The process exit status: 0 when built, cached or skipped (``GRADSCOPE_NATIVE=0``), 1 when
        the build failed (said on stderr; the Python hooks then record).
    """
    from gradscope import _native

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
    p = sub.add_parser("demo", help="record the seed-000 problem and compare create_graph, forward_ad, split")
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
