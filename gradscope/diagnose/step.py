"""The user's step as code: where its backward and optimizer calls are, and rewritings of it.

Pure syntax: nothing here runs the code (see :mod:`gradscope.diagnose.measure`). A rewriting is
printed with :func:`ast.unparse`, so what the user reads is exactly what was run.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Shape", "shape_of"]


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


@dataclass
class Shape:
    """A step's statements, split at its backward call (top level only)."""

    body: list[ast.stmt]
    backward: int | None  # index of the statement whose expression is `E.backward(...)`
    loss: ast.expr | None  # E

    def optimizer_calls(self, ns: Mapping[str, Any], method: str) -> list[tuple[int, str]]:
        """(statement index, variable) of top-level `opt.<method>(...)` statements of the user's optimizers."""
        out = []
        for i, st in enumerate(self.body):
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                f = st.value.func
                if isinstance(f, ast.Attribute) and f.attr == method and isinstance(f.value, ast.Name):
                    if isinstance(ns.get(f.value.id), torch.optim.Optimizer):
                        out.append((i, f.value.id))
        return out

    def text(self, body: list[ast.stmt] | None = None) -> str:
        return ast.unparse(ast.Module(body=body if body is not None else self.body, type_ignores=[])) + "\n"


def shape_of(source: str) -> Shape | None:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    for i, st in enumerate(body):
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            f = st.value.func
            if isinstance(f, ast.Attribute) and f.attr == "backward":
                return Shape(body, i, f.value)
    return Shape(body, None, None)


class _Slice(ast.NodeTransformer):
    """`x` -> `x[i:i + m]` for batch tensors; `batch` -> `{k: v[i:i + m] for k, v in batch.items()}`."""

    def __init__(self, tensors: set[str], dicts: set[str], m: int) -> None:
        self.tensors, self.dicts, self.m = tensors, dicts, m

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if not isinstance(node.ctx, ast.Load):
            return node
        part = ast.Slice(lower=ast.Name("i", ast.Load()),
                         upper=ast.BinOp(ast.Name("i", ast.Load()), ast.Add(), ast.Constant(self.m)))
        if node.id in self.tensors:
            return ast.Subscript(value=ast.Name(node.id, ast.Load()), slice=part, ctx=ast.Load())
        if node.id in self.dicts:
            return ast.DictComp(
                key=ast.Name("k", ast.Load()),
                value=ast.Subscript(value=ast.Name("v", ast.Load()), slice=part, ctx=ast.Load()),
                generators=[ast.comprehension(
                    target=ast.Tuple([ast.Name("k", ast.Store()), ast.Name("v", ast.Store())], ast.Store()),
                    iter=ast.Call(ast.Attribute(ast.Name(node.id, ast.Load()), "items", ast.Load()), [], []),
                    ifs=[], is_async=0)])
        return node


def batch_inputs(shape: Shape, ns: Mapping[str, Any]) -> tuple[set[str], set[str], int] | None:
    """The batch the forward statements read: tensors (and dicts of tensors) of the user's that need
    no gradient, sharing the first dimension N >= 2. (tensor names, dict names, N) or None."""
    if shape.backward is None:
        return None
    read: set[str] = set()
    for st in shape.body[: shape.backward]:
        read |= _names(st)
    sizes: dict[int, int] = {}
    cand: dict[str, int] = {}
    for n in sorted(read):
        v = ns.get(n)
        ts = [v] if isinstance(v, torch.Tensor) else list(v.values()) if isinstance(v, dict) and v else []
        if not ts or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 and not t.requires_grad for t in ts):
            continue
        dims = {int(t.shape[0]) for t in ts}
        if len(dims) != 1:
            continue
        d = dims.pop()
        cand[n] = d
        sizes[d] = sizes.get(d, 0) + 1
    if not sizes:
        return None
    n_batch = max(sizes, key=lambda d: (sizes[d], d))
    if n_batch < 2:
        return None
    names = {n for n, d in cand.items() if d == n_batch}
    tensors = {n for n in names if isinstance(ns.get(n), torch.Tensor)}
    return tensors, names - tensors, n_batch


def micro_batched(shape: Shape, tensors: set[str], dicts: set[str], n: int, m: int) -> str:
    """The step with its forward and backward run in micro-batches of ``m`` (``n`` divisible by ``m``),
    each loss scaled by its share of the batch; statements that read no batch stay before the loop."""
    assert shape.backward is not None and shape.loss is not None
    batch = tensors | dicts
    inside: list[ast.stmt] = []
    before: list[ast.stmt] = []
    touched = set(batch)
    for st in shape.body[: shape.backward]:
        if _names(st) & touched:
            inside.append(_Slice(tensors, dicts, m).visit(ast.parse(ast.unparse(st)).body[0]))
            touched |= {t.id for t in ast.walk(st) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        else:
            before.append(st)
    call = shape.body[shape.backward]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call) and isinstance(call.value.func, ast.Attribute)
    scaled = ast.BinOp(shape.loss, ast.Mult(), ast.BinOp(ast.Constant(m), ast.Div(), ast.Constant(n)))
    back = ast.Expr(ast.Call(ast.Attribute(scaled, "backward", ast.Load()), call.value.args, call.value.keywords))
    loop = ast.For(target=ast.Name("i", ast.Store()),
                   iter=ast.Call(ast.Name("range", ast.Load()), [ast.Constant(0), ast.Constant(n), ast.Constant(m)], []),
                   body=[*inside, back], orelse=[])
    body = [*before, loop, *shape.body[shape.backward + 1:]]
    return shape.text([ast.fix_missing_locations(s) for s in body])


def autocast(shape: Shape, device: str, dtype: str) -> str:
    """The step with its forward statements under ``torch.autocast``."""
    assert shape.backward is not None
    fwd = shape.body[: shape.backward]
    w = ast.With(items=[ast.withitem(ast.Call(
        ast.Attribute(ast.Name("torch", ast.Load()), "autocast", ast.Load()), [],
        [ast.keyword("device_type", ast.Constant(device)),
         ast.keyword("dtype", ast.Attribute(ast.Name("torch", ast.Load()), dtype, ast.Load()))]))], body=fwd)
    return shape.text([ast.fix_missing_locations(w), *shape.body[shape.backward:]])


def without(shape: Shape, drop: set[int]) -> str:
    return shape.text([s for i, s in enumerate(shape.body) if i not in drop])


def replaced_zero_grad(shape: Shape, ns: Mapping[str, Any]) -> str | None:
    """The step with every ``X.zero_grad(set_to_none=False)`` made ``set_to_none=True``; None if none."""
    tree = ast.parse(shape.text())
    hit = False
    for c in _calls(tree, "zero_grad"):
        for kw in c.keywords:
            if kw.arg == "set_to_none" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                kw.value = ast.Constant(True)
                hit = True
    return ast.unparse(tree) + "\n" if hit else None
