"""The user's step as code: where its backward and optimizer calls are, and rewritings of it.

Pure syntax: nothing here runs the code (see :mod:`gradscope._analyses.diagnose.measure`). A rewriting is
printed with :func:`ast.unparse`, so what the user reads is exactly what was run.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

__all__ = ["Shape", "Statements", "free_names", "shape_of", "statements"]


def free_names(code: str) -> set[str]:
    """Names the code reads before it assigns them, statement by statement in order (a loop's
    target, a comprehension's and a lambda's variables count as assigned where they apply)."""
    assigned: set[str] = set()
    free: set[str] = set()

    def expr(node: ast.AST | None) -> None:
        if node is None:
            return
        local: set[str] = set()
        loads: set[str] = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                loads.add(n.id)
            elif isinstance(n, ast.comprehension):
                local |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
            elif isinstance(n, ast.Lambda):
                local |= {x.arg for x in ast.walk(n.args) if isinstance(x, ast.arg)}
        free.update(loads - assigned - local)

    def store(target: ast.AST) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                assigned.add(n.id)
            elif isinstance(n, ast.Subscript | ast.Attribute):
                expr(n)

    def block(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, ast.For | ast.AsyncFor):
                expr(st.iter)
                store(st.target)
                block(st.body)
                block(st.orelse)
            elif isinstance(st, ast.While | ast.If):
                expr(st.test)
                block(st.body)
                block(st.orelse)
            elif isinstance(st, ast.With | ast.AsyncWith):
                for item in st.items:
                    expr(item.context_expr)
                    if item.optional_vars is not None:
                        store(item.optional_vars)
                block(st.body)
            elif isinstance(st, ast.Try):
                block(st.body)
                for h in st.handlers:
                    expr(h.type)
                    if h.name:
                        assigned.add(h.name)
                    block(h.body)
                block(st.orelse)
                block(st.finalbody)
            elif isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                assigned.add(st.name)
            elif isinstance(st, ast.Assign):
                expr(st.value)
                for t in st.targets:
                    store(t)
            elif isinstance(st, ast.AugAssign | ast.AnnAssign):
                if isinstance(st, ast.AugAssign):
                    expr(st.target)
                expr(st.value)
                store(st.target)
            elif isinstance(st, ast.Delete):
                pass
            else:
                expr(st)
        return None

    block(ast.parse(code).body)
    return free


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_backward(st: ast.stmt) -> bool:
    return (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute)
            and st.value.func.attr == "backward")


def _locate(tree: ast.AST) -> tuple[list[ast.stmt], int] | None:
    """The statement list holding the first ``E.backward(...)`` statement (top level first, then
    inside loops and other blocks), and its index there."""
    queue: list[ast.AST] = [tree]
    while queue:
        node = queue.pop(0)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                for i, st in enumerate(stmts):
                    if isinstance(st, ast.stmt) and _is_backward(st):
                        return stmts, i
        queue.extend(ast.iter_child_nodes(node))
    return None


@dataclass(frozen=True)
class Statements:
    """A step's own statements, each as source text that runs alone (run one after the other in the same
    variables, they are the step), a dump of each to compare steps by, and the index of the first that
    is an ``E.backward(...)`` call (None: none of them is)."""

    texts: tuple[str, ...]
    dumps: tuple[str, ...]
    backward: int | None

    def common(self, other: Statements) -> int:
        """How many leading statements the two steps share."""
        n = 0
        for a, b in zip(self.dumps, other.dumps, strict=False):
            if a != b:
                break
            n += 1
        return n


@functools.lru_cache(maxsize=64)
def statements(source: str) -> Statements | None:
    """The step's top-level statements (see :class:`Statements`), where each stands on lines of its
    own; None otherwise, or for a step that does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    body = tree.body
    if not body:
        return None
    starts = [min([st.lineno, *(d.lineno for d in getattr(st, "decorator_list", []))]) for st in body]
    for i, st in enumerate(body):
        if st.col_offset != 0 or st.end_lineno is None or (i + 1 < len(body) and st.end_lineno >= starts[i + 1]):
            return None
    lines = source.splitlines(keepends=True)
    cuts = [0, *(s - 1 for s in starts[1:]), len(lines)]
    texts = tuple("".join(lines[cuts[i]:cuts[i + 1]]) for i in range(len(body)))
    found = _locate(tree)
    backward = found[1] if found is not None and found[0] is body else None
    return Statements(texts, tuple(ast.dump(st) for st in body), backward)


@dataclass
class Shape:
    """A step's source and where its backward call is (``body[backward]`` is ``loss.backward(...)``,
    ``body`` the statement list that holds it: the step's, or a loop's)."""

    source: str
    body: list[ast.stmt]
    backward: int | None
    loss: ast.expr | None

    def fresh(self) -> tuple[ast.Module, list[ast.stmt]]:
        """A new tree of the step, and its statement list that holds the backward call."""
        tree = ast.parse(self.source)
        found = _locate(tree)
        return tree, (found[0] if found else tree.body)

    def optimizer_calls(self, ns: Mapping[str, Any], method: str) -> list[str]:
        """The user's optimizers whose ``<method>(...)`` the step calls as a statement, anywhere."""
        out = []
        for st in ast.walk(ast.parse(self.source)):
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                f = st.value.func
                if isinstance(f, ast.Attribute) and f.attr == method and isinstance(f.value, ast.Name):
                    if isinstance(ns.get(f.value.id), torch.optim.Optimizer) and f.value.id not in out:
                        out.append(f.value.id)
        return out

    def text(self, tree: ast.Module | None = None) -> str:
        return ast.unparse(ast.fix_missing_locations(tree if tree is not None else ast.parse(self.source))) + "\n"


def shape_of(source: str) -> Shape | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _locate(tree)
    if found is None:
        return Shape(source, tree.body, None, None)
    body, i = found
    st = body[i]
    assert isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute)
    return Shape(source, body, i, st.value.func.value)


def _fresh_name(source: str, want: str) -> str:
    used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    while want in used:
        want += "_"
    return want


class _Slice(ast.NodeTransformer):
    """`x` -> `x[i:i + m]` for batch tensors; `batch` -> `{k: v[i:i + m] for k, v in batch.items()}`."""

    def __init__(self, tensors: set[str], dicts: set[str], m: int, var: str) -> None:
        self.tensors, self.dicts, self.m, self.var = tensors, dicts, m, var

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if not isinstance(node.ctx, ast.Load):
            return node
        part = ast.Slice(lower=ast.Name(self.var, ast.Load()),
                         upper=ast.BinOp(ast.Name(self.var, ast.Load()), ast.Add(), ast.Constant(self.m)))
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
    for st in shape.body[: shape.backward + 1]:  # the backward statement may run the model itself
        read |= _names(st)
    # only the step's inputs: a variable the step makes itself before reading it (a diffusion step's
    # noise, drawn from the batch's shape) is already a micro-batch's inside the loop
    read &= free_names(shape.source)
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
    assert shape.backward is not None
    var = _fresh_name(shape.source, "start")
    tree, body = shape.fresh()
    k = shape.backward
    batch = tensors | dicts
    inside: list[ast.stmt] = []
    before: list[ast.stmt] = []
    touched = set(batch)
    for st in body[:k]:
        if _names(st) & touched:
            inside.append(_Slice(tensors, dicts, m, var).visit(st))
            touched |= {t.id for t in ast.walk(st) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        else:
            before.append(st)
    call = body[k]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call) and isinstance(call.value.func, ast.Attribute)
    scaled = ast.BinOp(call.value.func.value, ast.Mult(), ast.BinOp(ast.Constant(m), ast.Div(), ast.Constant(n)))
    back = ast.Expr(ast.Call(ast.Attribute(scaled, "backward", ast.Load()), call.value.args, call.value.keywords))
    if _names(back) & touched:  # the loss itself reads the batch: `model(x).mean().backward()`
        back = _Slice(tensors, dicts, m, var).visit(back)
    loop = ast.For(target=ast.Name(var, ast.Store()),
                   iter=ast.Call(ast.Name("range", ast.Load()), [ast.Constant(0), ast.Constant(n), ast.Constant(m)], []),
                   body=[*inside, back], orelse=[])
    body[:] = [*before, loop, *body[k + 1:]]
    return shape.text(tree)


def autocast(shape: Shape, device: str, dtype: str) -> str:
    """The step with its forward statements (before the backward call) under ``torch.autocast``."""
    assert shape.backward is not None
    tree, body = shape.fresh()
    k = shape.backward
    if k == 0:
        return shape.text(tree)
    w = ast.With(items=[ast.withitem(ast.Call(
        ast.Attribute(ast.Name("torch", ast.Load()), "autocast", ast.Load()), [],
        [ast.keyword("device_type", ast.Constant(device)),
         ast.keyword("dtype", ast.Attribute(ast.Name("torch", ast.Load()), dtype, ast.Load()))]))], body=body[:k])
    body[:] = [w, *body[k:]]
    return shape.text(tree)


def _accumulation(st: ast.stmt) -> tuple[str, ast.expr] | None:
    """``(L, E)`` for a statement ``L = L + E`` or ``L += E`` (``E`` not reading ``L``), else None."""
    if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name) and isinstance(st.op, ast.Add):
        name, term = st.target.id, st.value
    elif (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
          and isinstance(st.value, ast.BinOp) and isinstance(st.value.op, ast.Add)
          and isinstance(st.value.left, ast.Name) and st.value.left.id == st.targets[0].id):
        name, term = st.targets[0].id, st.value.right
    else:
        return None
    return None if name in _names(term) else (name, term)


def backward_per_iteration(shape: Shape) -> tuple[str, str] | None:
    """The step with a loss accumulated over a loop's iterations (``L = L + E`` or ``L += E`` in a ``for``
    loop of the step's statements, ``L.backward()``, or ``L`` times or over a factor the loop does not
    change, after it) differentiated in each iteration instead: ``E`` under a name of its own, its
    backward called there (scaled as the call scaled ``L``), ``L`` adding up its value detached, and the
    call after the loop gone. The gradients add up in ``.grad`` to the same values, and each
    iteration's graph is freed once its backward ran. ``(the step, L)``, or None where the step has no
    such loop (nothing between the loop and the call may read ``L``)."""
    if shape.backward is None:
        return None
    tree, body = shape.fresh()
    k = shape.backward
    call = body[k]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call) and isinstance(call.value.func, ast.Attribute)
    target = call.value.func.value
    factor: tuple[ast.operator, ast.expr] | None = None
    if isinstance(target, ast.BinOp) and isinstance(target.op, ast.Div | ast.Mult) and isinstance(target.left, ast.Name):
        factor = (target.op, target.right)
        target = target.left
    if not isinstance(target, ast.Name):
        return None
    name = target.id
    for j in range(k - 1, -1, -1):
        loop = body[j]
        if not isinstance(loop, ast.For):
            if name in _names(loop):
                return None  # read or changed between the loop and the call
            continue
        found = [(i, acc) for i, st in enumerate(loop.body) if (acc := _accumulation(st)) is not None and acc[0] == name]
        if len(found) != 1 or loop.orelse:
            return None
        i, (_, term) = found[0]
        if any(name in _names(st) for n, st in enumerate(loop.body) if n != i):
            return None
        stored = {t.id for st in loop.body for t in ast.walk(st) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        stored |= {t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)}
        if factor is not None and _names(factor[1]) & (stored | {name}):
            return None  # a factor the loop changes
        fresh = _fresh_name(shape.source, "term")
        use: ast.expr = ast.Name(fresh, ast.Load())
        if factor is not None:
            use = ast.BinOp(use, factor[0], factor[1])
        back = ast.Expr(ast.Call(ast.Attribute(use, "backward", ast.Load()), call.value.args, call.value.keywords))
        add = ast.Assign(targets=[ast.Name(name, ast.Store())],
                         value=ast.BinOp(ast.Name(name, ast.Load()), ast.Add(),
                                         ast.Call(ast.Attribute(ast.Name(fresh, ast.Load()), "detach", ast.Load()), [], [])))
        loop.body[i:i + 1] = [ast.Assign(targets=[ast.Name(fresh, ast.Store())], value=term), back, add]
        del body[k]
        return shape.text(tree), name
    return None


class _Drop(ast.NodeTransformer):
    def __init__(self, calls: set[tuple[str, str]]) -> None:
        self.calls = calls

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and all(isinstance(s, ast.stmt) for s in stmts):
                kept = [s for s in stmts if not self._dropped(s)]
                setattr(node, field, kept or ([ast.Pass()] if field == "body" and not isinstance(node, ast.Module) else []))
        return node

    def _dropped(self, st: ast.stmt) -> bool:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            f = st.value.func
            return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in self.calls
        return False


def without(shape: Shape, calls: set[tuple[str, str]]) -> str:
    """The step without the statements that are the calls ``(variable, method)`` (anywhere)."""
    return shape.text(_Drop(calls).visit(ast.parse(shape.source)))


def replaced_zero_grad(shape: Shape, ns: Mapping[str, Any]) -> str | None:
    """The step with every ``X.zero_grad(set_to_none=False)`` made ``set_to_none=True``; None if none."""
    tree = ast.parse(shape.source)
    hit = False
    for c in _calls(tree, "zero_grad"):
        for kw in c.keywords:
            if kw.arg == "set_to_none" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                kw.value = ast.Constant(True)
                hit = True
    return shape.text(tree) if hit else None


def inline(source: str, ns: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A step that is one call of the user's own function (``train_step(model, batch)``,
    ``loss = step(**state)``) as that function's body, its parameters bound to the call's
    arguments, and the names its body reads from the function's module. None when the step is
    not such a call, or the body returns anywhere but at its end."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    if len(body) != 1:
        return None
    st = body[0]
    call = st.value if isinstance(st, ast.Expr | ast.Assign | ast.Return) else None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        return None
    fn = ns.get(call.func.id)
    if not isinstance(fn, types.FunctionType) or fn.__closure__:
        return None
    try:
        fdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(fdef, ast.FunctionDef) or fdef.decorator_list:
        return None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in call.args:
        if isinstance(a, ast.Starred):
            return None
        args.append(ast.unparse(a))
    for kw in call.keywords:
        if kw.arg is not None:
            kwargs[kw.arg] = ast.unparse(kw.value)
            continue
        d = ns.get(kw.value.id) if isinstance(kw.value, ast.Name) else None
        if not isinstance(d, Mapping) or not all(isinstance(k, str) for k in d):
            return None
        for k, v in d.items():  # **state: the names the namespace holds, else the dict's items
            kwargs[k] = k if ns.get(k) is v else f"{ast.unparse(kw.value)}[{k!r}]"
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    lines: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return None
        if p.name in bound.arguments:
            if bound.arguments[p.name] != p.name:
                lines.append(f"{p.name} = {bound.arguments[p.name]}")
        elif p.default is not p.empty and isinstance(p.default, int | float | str | bool | type(None)):
            lines.append(f"{p.name} = {p.default!r}")
        else:
            return None
    stmts = list(fdef.body)
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
        stmts = stmts[1:]  # the docstring
    last = stmts[-1] if stmts else None
    if any(isinstance(n, ast.Return) for s in stmts[:-1] for n in ast.walk(s)):
        return None
    if isinstance(last, ast.Return):
        value = last.value or ast.Constant(None)
        if isinstance(st, ast.Assign):
            stmts[-1] = ast.Assign(targets=st.targets, value=value, lineno=0)
        else:
            stmts[-1] = ast.Expr(value=value)
    elif last is not None and any(isinstance(n, ast.Return) for n in ast.walk(last)):
        return None
    text = "\n".join(lines) + ("\n" if lines else "") + ast.unparse(ast.fix_missing_locations(
        ast.Module(body=stmts, type_ignores=[]))) + "\n"
    module_names = {k: v for k, v in fn.__globals__.items() if not k.startswith("__")}
    return text, module_names


def compose(setup: str, step: str) -> str:
    """The code a finding shows: the one-time setup first (when there is one), then the step."""
    if not setup:
        return step
    return "# once, before the steps:\n" + setup + "# each step:\n" + step


# ----- rewritings for the patterns found in the recording's graph --------------------------------
def _calls_name(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(node))


def _stores(st: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _walk_bodies(tree: ast.AST) -> list[list[ast.stmt]]:
    out = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and all(isinstance(s, ast.stmt) for s in stmts):
                out.append(stmts)
    return out


def _no_grad(stmts: list[ast.stmt]) -> ast.With:
    return ast.With(items=[ast.withitem(ast.Call(
        ast.Attribute(ast.Name("torch", ast.Load()), "no_grad", ast.Load()), [], []))], body=stmts)


def _feeds_backward(body: list[ast.stmt], i: int) -> bool:
    """Whether what statement ``i`` assigns reaches a backward call later in the same list (or in it)."""
    tainted = _stores(body[i])
    for st in body[i:]:
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("backward", "grad")
               for n in ast.walk(st)) and _names(st) & tainted:
            return True
        if _names(st) & tainted:
            tainted |= _stores(st)
    return False


def under_no_grad(source: str, model: str, *, only_dead: bool) -> str | None:
    """Statements that call ``model(...)`` wrapped in ``torch.no_grad()``; with ``only_dead`` only
    those whose results reach no backward call. None when no statement changes."""
    tree = ast.parse(source)
    hit = False
    for body in _walk_bodies(tree):
        for i, st in enumerate(body):
            if isinstance(st, ast.With | ast.For | ast.While | ast.If | ast.Try | ast.FunctionDef):
                continue  # their own bodies are visited
            if _calls_name(st, model) and not (only_dead and _feeds_backward(body, i)):
                body[i] = _no_grad([st])
                hit = True
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" if hit else None


def detached_calls(source: str, model: str) -> str | None:
    """Every ``model(...)`` call made ``model(...).detach()``; None if there is none."""

    class _Detach(ast.NodeTransformer):
        hit = False

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.func, ast.Name) and node.func.id == model:
                _Detach.hit = True
                return ast.Call(ast.Attribute(node, "detach", ast.Load()), [], [])
            return node

    tree = _Detach().visit(ast.parse(source))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" if _Detach.hit else None


def numbers_appended(source: str, var: str) -> str | None:
    """Every ``var.append(E)`` made ``var.append(E.item())``; None if there is none."""
    tree = ast.parse(source)
    hit = False
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
                and isinstance(n.func.value, ast.Name) and n.func.value.id == var and len(n.args) == 1):
            n.args = [ast.Call(ast.Attribute(n.args[0], "item", ast.Load()), [], [])]
            hit = True
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" if hit else None


def without_retain_graph(source: str) -> str | None:
    """Every ``retain_graph=...`` (True, or a variable: the recording saw it true) dropped from
    backward and grad calls; None if there is none."""
    tree = ast.parse(source)
    hit = False
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            kept = [k for k in n.keywords if not (k.arg == "retain_graph" and not (
                isinstance(k.value, ast.Constant) and not k.value.value))]
            if len(kept) != len(n.keywords):
                n.keywords = kept
                hit = True
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" if hit else None


def _is_grad_call(n: ast.AST) -> TypeGuard[ast.Call]:
    """``torch.autograd.grad(...)``, ``autograd.grad(...)`` or a bare ``grad(...)``."""
    if not isinstance(n, ast.Call):
        return False
    f = n.func
    if isinstance(f, ast.Name):
        return f.id == "grad"
    return (isinstance(f, ast.Attribute) and f.attr == "grad" and isinstance(f.value, ast.Name | ast.Attribute)
            and ast.unparse(f.value) in ("torch.autograd", "autograd"))


def _true_keyword(n: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in n.keywords)


def input_grads(source: str, model: str, y: str) -> str | None:
    """Every ``grad(E, z, create_graph=True)[0]`` whose ``E`` calls ``model(z)`` once made
    ``input_grad(lambda y, out: E', model, z, y)`` (``E'``: ``E`` with that call replaced by ``out``;
    just ``input_grad(fn, model, z, y)`` when ``E`` is ``fn(y, model(z))``), which keeps no graph of
    ``model`` (see :func:`gradscope.strategies.input_grad`). None when no call has that shape."""
    tree = _inline_grad_outputs(ast.parse(source), model)
    out = _fresh_name(source, "out")

    def rewritten(call: ast.Call) -> ast.expr | None:
        if not _is_grad_call(call) or not _true_keyword(call, "create_graph") or len(call.args) != 2:
            return None
        if any(k.arg not in ("create_graph", "retain_graph") for k in call.keywords):
            return None
        expr, z = call.args
        if not isinstance(z, ast.Name):
            return None
        hits = [n for n in ast.walk(expr) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == model and len(n.args) == 1 and not n.keywords
                and isinstance(n.args[0], ast.Name) and n.args[0].id == z.id]
        if len(hits) != 1 or sum(isinstance(n, ast.Name) and n.id == z.id for n in ast.walk(expr)) != 1:
            return None  # z must reach E only through the model
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and not expr.keywords
                and len(expr.args) == 2 and isinstance(expr.args[0], ast.Name) and expr.args[0].id == y
                and expr.args[1] is hits[0]):
            fn: ast.expr = ast.Name(expr.func.id, ast.Load())
        else:
            class _Put(ast.NodeTransformer):
                def visit_Call(self, node: ast.Call) -> ast.AST:
                    return ast.Name(out, ast.Load()) if node is hits[0] else self.generic_visit(node)

            body = _Put().visit(expr)
            args = ast.arguments(posonlyargs=[], args=[ast.arg(y), ast.arg(out)], kwonlyargs=[], kw_defaults=[],
                                 defaults=[])
            fn = ast.Lambda(args=args, body=body)
        return ast.Call(ast.Name("input_grad", ast.Load()),
                        [fn, ast.Name(model, ast.Load()), ast.Name(z.id, ast.Load()), ast.Name(y, ast.Load())], [])

    class _Swap(ast.NodeTransformer):
        hit = False

        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            if (isinstance(node.value, ast.Call) and isinstance(node.slice, ast.Constant)
                    and node.slice.value == 0 and (new := rewritten(node.value)) is not None):
                _Swap.hit = True
                return new
            return self.generic_visit(node)

        def visit_Call(self, node: ast.Call) -> ast.AST:
            new = rewritten(node)
            if new is None:
                return self.generic_visit(node)
            _Swap.hit = True
            return ast.Tuple([new], ast.Load())

    tree = _Swap().visit(tree)
    if not _Swap.hit:
        return None
    tree.body.insert(0, ast.ImportFrom("gradscope.strategies", [ast.alias("input_grad")], 0))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def create_graph_dropped(source: str) -> str | None:
    """Every ``create_graph=True`` of a grad or backward call made ``retain_graph=True`` (the
    forward graph stays for the next call; no graph of the backward is built). None if none."""
    tree = ast.parse(source)
    hit = False
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and _true_keyword(n, "create_graph"):
            kept = [k for k in n.keywords if k.arg not in ("create_graph", "retain_graph")]
            n.keywords = [*kept, ast.keyword("retain_graph", ast.Constant(True))]
            hit = True
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" if hit else None


def _inline_grad_outputs(tree: ast.Module, model: str) -> ast.Module:
    """``f = E`` followed by ``grad(f, z, ...)`` in the same statement list, where ``E`` calls
    ``model`` and ``f`` is read nowhere else: the assignment dropped and ``E`` written in the call."""
    for body in _walk_bodies(tree):
        i = 0
        while i < len(body):
            st = body[i]
            if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and _calls_name(st.value, model)):
                name = st.targets[0].id
                reads = [(j, n) for j, later in enumerate(body[i + 1:], i + 1) for n in ast.walk(later)
                         if isinstance(n, ast.Name) and n.id == name]
                uses = [(j, c) for j, later in enumerate(body[i + 1:], i + 1) for c in ast.walk(later)
                        if _is_grad_call(c) and _true_keyword(c, "create_graph") and c.args
                        and isinstance(c.args[0], ast.Name) and c.args[0].id == name]
                anywhere = sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))
                if len(reads) == 1 and len(uses) == 1 and anywhere == 2:  # (its store and this read)
                    uses[0][1].args[0] = st.value
                    del body[i]
                    continue
            i += 1
    return tree


def plain_derivatives(source: str) -> int:
    """How many ``grad(...)`` / ``.backward(...)`` calls of the step do not build a graph of their own
    (no ``create_graph=True``): the derivatives the step itself takes of what it computed."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 0
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and not _true_keyword(n, "create_graph")
               and (_is_grad_call(n) or (isinstance(n.func, ast.Attribute) and n.func.attr == "backward")))
