"""The one module of the diagnosis that runs the user's code or model (on copies)."""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import dataclasses
import logging
import math
import time
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope import _compat

# NOTE [ measuring a strategy's own peak ]: a fix that runs the model another way (forward AD,
# two passes, micro-batches, an unrolled inner loop) has a peak of its own, which the replay of the
# user's timeline cannot know. It is measured by running that way on a copy of the user's model
# (``copy.deepcopy``: the user's parameters, batch-norm statistics and gradients are never touched;
# the RNG is forked) with zero inputs of the recorded shapes, under ``gs.record(memory="cpu")``.
# Where the model is not on the CPU (or too large to copy) it is predicted on the meta device
# with ``gs.predict`` instead. The strategy's loss is a stand-in (a sum of squares) of the same
# shape: its cost is small next to the model's. None when it cannot run (the finding is then not
# given: a saving that is not known is not claimed).
MAX_COPY_BYTES = 256 * 1024 * 1024


def proxy_peak(proxy: Any, model: nn.Module, *args: Any) -> int | None:
    if proxy is None:
        return None
    from gradscope.predict import predict
    from gradscope.record import record

    params = list(model.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    on_cpu = all(p.device.type == "cpu" for p in params)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on_cpu and size <= MAX_COPY_BYTES:
                twin = copy.deepcopy(model)
                for p in twin.parameters():
                    p.grad = None
                with torch.random.fork_rng(devices=[]):
                    r = record(memory="cpu")
                    with r:
                        proxy(twin, *args)
                measured = r.recording
                return None if measured is None else int(measured.peak_bytes)
            return int(predict(proxy, model, *args, device="cpu").peak_bytes)
    except Exception:  # a stand-in that does not fit the user's model: no claim
        return None


def mixed_grad_proxy(z_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> Any:
    from gradscope.strategies import mixed_grad

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        z = torch.zeros(z_shape, device=dev)
        y = torch.zeros(y_shape, device=dev, requires_grad=True)

        def f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            n = min(g.numel(), y.numel())
            return (g.tanh().reshape(-1)[:n] * y.reshape(-1)[:n]).sum()

        mixed_grad(f, model, z, y, method="forward_ad")

    return run


def jacobian_proxy(n_in: int, method: str) -> Any:
    from gradscope.strategies import jacobian

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        jacobian(lambda v: model(v.view(1, -1)).view(-1), torch.zeros(n_in, device=dev), method=method)

    return run


def micro_batch_proxy(xs: Any, n: int) -> Any:
    def run(model: nn.Module) -> None:
        for x in xs:
            (model(x).float().square().mean() / n).backward()

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def two_pass_proxy(xs: Any, n: int) -> Any:
    from gradscope.strategies import many_inputs_backward

    def run(model: nn.Module) -> None:
        many_inputs_backward(model, list(xs), lambda zs: zs.float().square().mean(), method="two_pass")

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def hypergradient_proxy(a_shape: tuple[int, ...], x_shape: tuple[int, ...], steps: int) -> Any:
    from torch.func import functional_call

    from gradscope.strategies import hypergradient

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        A = torch.zeros(a_shape, device=dev, requires_grad=True)  # noqa: N806
        x = torch.zeros(x_shape, device=dev)

        def train_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, p, (x,)).square()
            if out.shape[0] == A.numel():
                return (A.reshape(-1) * out.reshape(out.shape[0], -1).sum(-1)).mean()
            return out.mean() * A.sum()

        def val_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(model, p, (x,)).square().mean()

        hypergradient(model, A, train_loss, val_loss, steps=steps, optimizer="sgd", lr=0.1)

    return run




# ----------------------------------------------------------------------------------------------
# NOTE [ nothing shown that was not run ]: a fix's code is shown only after it ran here, verbatim,
# on copies of the user's objects: on the meta device for its peak (``gs.predict``'s machinery: no
# data, exact tensor bytes; on a CPU copy under the tracker when the code reads values, such as
# ``.item()``), and on a CPU copy at full size for its results, next to the user's own step (the
# block's source, see ``gradscope._source``) on another copy from the same state, with the same
# seed and dropout off in both (a fix that changes how many draws dropout makes could not be
# compared otherwise). Parameters, gradients, buffers (batch-norm statistics) and optimizer state
# must agree; variables that differ are named in the finding. The saving shown is the user's
# step's peak minus the fix's, both measured the same way from the objects as they are when the
# diagnosis runs.
_TOLERANCE = 1e-4  # largest relative difference of a result counted as equal (float32 reordering)
# NOTE [ two runs of a step ]: a step is measured twice in a row on the same copies: the first run
# from the state the block started with, the next with what the first left (optimizer state,
# gradients, the variables that still hold the last step's output). A peak counts the tensors held
# when the run starts plus the most the run allocates at once. The first run's peak is the step's
# (the saving claimed is the user's minus the fix's); the next run's keeps a fix that helps a first
# step but raises later ones from being shown, and a fix fits a budget only if both runs do. The
# results compared are those of the first run: an optimizer like Adam turns rounding differences
# of a second step into larger ones.
RUNS = 2
# NOTE [ parameters after an optimizer's step ]: Adam's first step moves each element by about the
# learning rate whatever its gradient's size (m / sqrt(v)), so an element whose gradient is near
# epsilon turns a rounding difference of 1e-7 into a move of a few percent of the learning rate; and
# it would not see a gradient scaled by two at all. Gradients, optimizer state and buffers are
# compared at 1e-4 (relative to each tensor's largest value); parameters, which the step moved, at
# 1e-3. A finding's ``tolerance`` says when a fix needs more (autocast).
PARAMETER_TOLERANCE = 1e-3
_PARAM = "#parameter"


@dataclass(frozen=True)
class Trial:
    """One piece of code run on copies: its peak, its results against the user's step."""

    error: str | None = None
    peak: int | None = None  # bytes allocated inside the code at its peak (meta, else the CPU copy's)
    how: str = ""  # "meta" | "cpu copy"
    same: bool | None = None  # results equal the user's step's (None: not compared)
    worst: float = 0.0  # largest relative difference of a result
    worst_at: str = ""
    differs: tuple[str, ...] = ()  # other variables the code leaves with other values
    freed: int = 0  # gradients the code leaves freed (None) where the user's step kept them
    seconds: float | None = None  # wall time of one run of the step on the CPU copy
    resident: int = 0  # bytes of the copies' tensors when the first run starts
    later: int | None = None  # the same peak for the next run, with what the first left


class Bench:
    """The user's step and namespace, and the copies fixes run on (see NOTE [ nothing shown that
    was not run ])."""

    def __init__(self, source: str, namespace: Mapping[str, Any], device: str = "cpu", *,
                 fresh_optimizers: bool = False, fresh_gradients: bool = False) -> None:
        self.source = source
        self.ns = namespace
        self.device = device
        # NOTE [ copies start as the block started ]: the objects are copied as they are when the
        # diagnosis runs, after the block; optimizer state and gradients the block itself created
        # (the recording says so) are dropped from the copies, so that a first step that failed
        # is measured as the first step it was, not as a later one with that state resident.
        self.fresh_optimizers = fresh_optimizers
        self.fresh_gradients = fresh_gradients
        self._user: Trial | None = None
        self._user_state: dict[str, Any] | None = None

    # ----- what the code needs ------------------------------------------------------------------
    def _names(self, code: str) -> set[str]:
        names = free_names(code)
        more: set[str] = set()
        for n in names:  # functions of the user's that read other variables of the namespace
            f = self.ns.get(n)
            if isinstance(f, types.FunctionType):
                more |= set(f.__code__.co_names) & set(self.ns)
        return (names | more) & set(self.ns)

    def _split(self, code: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(objects to copy, objects passed as they are: Python modules, functions, classes, numbers)."""
        copied: dict[str, Any] = {}
        kept: dict[str, Any] = {}
        for n in sorted(self._names(code) | self._names(self.source)):
            v = self.ns[n]
            if isinstance(v, types.ModuleType | types.FunctionType | types.BuiltinFunctionType | type | int
                          | float | str | bool | bytes | torch.dtype | torch.device) or v is None:
                kept[n] = v
            else:
                copied[n] = v
        return copied, kept

    @staticmethod
    def _env(kept: Mapping[str, Any], copies: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {"__builtins__": builtins, "torch": torch, **kept, **copies}
        for n, v in kept.items():  # the user's functions read the copies, not the originals
            if isinstance(v, types.FunctionType):
                g = dict(v.__globals__)
                g.update(copies)
                env[n] = types.FunctionType(v.__code__, g, v.__name__, v.__defaults__, v.__closure__)
        return env

    # ----- runs ---------------------------------------------------------------------------------
    def _meta_peak(self, code: str, setup: str) -> int:
        from gradscope.predict import predict

        compiled = compile(code, "<gradscope fix>", "exec")
        once = compile(setup, "<gradscope fix>", "exec")
        copied, kept = self._split(setup + code)

        def run(objs: dict[str, Any]) -> None:
            self._as_at_start(objs)
            env = self._env(kept, objs)
            exec(once, env)
            for _ in range(RUNS):
                exec(compiled, env)

        with warnings.catch_warnings(), _quiet_logging():
            warnings.simplefilter("ignore")
            p = predict(run, copied, device=self.device)
            return int(p.resident_bytes) + int(p.peak_bytes)

    def _cpu_run(self, code: str, setup: str = "") -> tuple[Trial, dict[str, Any]]:
        from gradscope.record import record

        compiled = compile(code, "<gradscope fix>", "exec")
        copied, kept = self._split(setup + code)
        copies = _replica(copied)
        self._as_at_start(copies)
        env = self._env(kept, copies)
        before = set(env)
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), _quiet_logging():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            exec(compile(setup, "<gradscope fix>", "exec"), env)
            resident = resident_bytes(env.values())
            totals: list[int] = []
            seconds = 0.0
            state: dict[str, Any] = {}
            for i in range(RUNS):  # see NOTE [ two runs of a step ]
                held = resident if i == 0 else resident_bytes(env.values())
                r = record(memory="tracker")
                t0 = time.perf_counter()
                with r:
                    exec(compiled, env)
                seconds += time.perf_counter() - t0
                rec = r.recording
                totals.append(held + (0 if rec is None else int(rec.peak_bytes)))
                if i == 0:
                    state = _results(env, set(copies) | {k for k in set(env) - before if not k.startswith("_")})
            seconds /= RUNS
        return Trial(peak=totals[0], later=max(totals[1:], default=None), how="cpu copy",
                     seconds=seconds, resident=resident), state

    def _trial(self, code: str, setup: str = "") -> tuple[Trial, dict[str, Any] | None]:
        try:
            ran, state = self._cpu_run(code, setup)
        except Exception as e:  # the code fails on the copies: it is not shown
            return Trial(error=f"{type(e).__name__}: {e}"), None
        if self.device == "cpu":  # the CPU copy's tracker peak is the CPU's own, exactly
            return ran, state
        try:
            return dataclasses.replace(ran, peak=self._meta_peak(code, setup), how="meta"), state
        except Exception:  # reads values (.item()): the copy's peak
            return ran, state

    def _as_at_start(self, copies: Mapping[str, Any]) -> None:
        """See NOTE [ copies start as the block started ]."""
        for v in copies.values():
            if self.fresh_optimizers and isinstance(v, torch.optim.Optimizer):
                v.state.clear()
            if self.fresh_gradients and isinstance(v, nn.Module):
                for p in v.parameters():
                    p.grad = None

    def execute(self, code: str) -> Trial:
        """Run ``code`` once on copies (a pattern's code, which replaces part of the step)."""
        try:
            return self._cpu_run(code)[0]
        except Exception as e:
            return Trial(error=f"{type(e).__name__}: {e}")

    def user(self) -> Trial:
        """The user's own step, run on copies the same way."""
        if self._user is None:
            self._user, self._user_state = self._trial(self.source)
            if self._user.error is None:  # the first run pays for warming up: time a second one
                again, _ = self._trial(self.source)
                if again.seconds is not None and self._user.seconds is not None:
                    self._user = dataclasses.replace(self._user, seconds=min(again.seconds, self._user.seconds))
        return self._user

    def run(self, code: str, *, setup: str = "", tolerance: float = _TOLERANCE) -> Trial:
        """Run ``setup`` once and ``code`` (the step) twice on copies, and compare the results with
        the user's step's, run the same way."""
        user = self.user()
        trial, state = self._trial(code, setup)
        if trial.error is not None or state is None or self._user_state is None or user.error is not None:
            return trial
        worst, where, differs, freed = _compare(self._user_state, state, set(self._split(self.source)[0]))
        return dataclasses.replace(trial, same=worst <= tolerance, worst=worst, worst_at=where, differs=differs,
                                   freed=freed)


@contextlib.contextmanager
def _quiet_logging() -> Any:
    """Libraries' log records (transformers: "use_cache=True is incompatible with gradient
    checkpointing") from runs on copies are not the user's: none reaches their output."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)


def resident_bytes(values: Any) -> int:
    """Bytes of the distinct storages of the tensors reachable from ``values`` (modules' parameters,
    buffers and gradients, optimizers' state, tensors in containers)."""
    from gradscope.predict import _collect_tensors

    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors([v for v in values if not isinstance(v, types.ModuleType | types.FunctionType | type)],
                     tensors, set())
    for t in list(tensors.values()):
        if t.is_leaf and t.grad is not None:
            tensors[id(t.grad)] = t.grad
    seen: dict[int, int] = {}
    for t in tensors.values():
        try:
            st = t.untyped_storage()
            key = _compat.storage_key(t)
            if key is not None:
                seen[key] = int(st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    return sum(seen.values())


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


def _replica(objs: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of the user's objects on their device, with dropout off: tensors that are
    results of autograd (not leaves) are copied detached, as they cannot be deep-copied."""
    from gradscope.predict import _collect_tensors

    tensors: dict[int, torch.Tensor] = {}
    _collect_tensors(dict(objs), tensors, set())
    memo: dict[int, Any] = {}
    for i, t in tensors.items():
        if not t.is_leaf:
            memo[i] = t.detach().clone().requires_grad_(t.requires_grad)
    out = copy.deepcopy(dict(objs), memo)
    for v in out.values():
        if isinstance(v, nn.Module):
            for m in v.modules():
                if isinstance(m, nn.modules.dropout._DropoutNd):
                    m.p = 0.0
                for k, a in list(vars(m).items()):
                    if "dropout" in k and isinstance(a, float):
                        setattr(m, k, 0.0)
    return out


def _tensors_of(name: str, v: Any, out: dict[str, torch.Tensor], params: set[str] | None = None) -> None:
    if isinstance(v, torch.Tensor):
        out[name] = v
        if v.is_leaf and v.grad is not None:
            out[name + ".grad"] = v.grad
    elif isinstance(v, nn.Module):
        for k, p in v.named_parameters():
            out[f"{name}.{k}"] = p
            if params is not None:
                params.add(f"{name}.{k}")
            if p.grad is not None:
                out[f"{name}.{k}.grad"] = p.grad
        for k, b in v.named_buffers():
            out[f"{name}.{k}"] = b
    elif isinstance(v, torch.optim.Optimizer):
        for i, st in enumerate(v.state.values()):
            for k, t in st.items():
                if isinstance(t, torch.Tensor):
                    out[f"{name}.state[{i}][{k!r}]"] = t
    elif isinstance(v, bool):
        return
    elif isinstance(v, int | float):  # a number where the step kept a tensor (`losses.append(loss.item())`)
        out[name] = torch.tensor(float(v), dtype=torch.float64)
    elif isinstance(v, list | tuple):
        for i, x in enumerate(v[:10_000]):
            _tensors_of(f"{name}[{i}]", x, out, params)
    elif isinstance(v, dict):
        for k, x in list(v.items())[:10_000]:
            _tensors_of(f"{name}[{k!r}]", x, out, params)


def _results(env: Mapping[str, Any], names: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Detached copies of every tensor the named variables hold (see ``_tensors_of``)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        flat: dict[str, torch.Tensor] = {}
        params: set[str] = set()
        _tensors_of(name, env[name], flat, params)
        out[name] = {k + (_PARAM if k in params else ""): t.detach().clone() for k, t in flat.items()}
    return out


def _compare(a: Mapping[str, Any], b: Mapping[str, Any], objects: set[str]) -> tuple[float, str, tuple[str, ...], int]:
    """The largest relative difference over the user's objects' tensors (parameters, gradients,
    buffers, optimizer state, inputs), and the other variables whose values differ."""
    worst, where = 0.0, ""
    differs: list[str] = []
    freed = 0
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        if name in objects:
            freed += sum(1 for k in set(ta) - set(tb) if k.endswith(".grad"))
        d = _difference(ta, tb)
        if name in objects:
            if d[0] > worst:
                worst, where = d[0], d[1]
        elif d[0] > _TOLERANCE:
            differs.append(name)
    return worst, where, tuple(differs), freed


def _difference(ta: Mapping[str, torch.Tensor], tb: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """Gradients the fix left freed (None) where the step kept them are not a difference: the fix
    applied them already (the finding says so through ``Trial.freed``)."""
    if set(tb) - set(ta) or any(not k.endswith(".grad") for k in set(ta) - set(tb)):
        return math.inf, ", ".join(sorted(set(ta) ^ set(tb))[:3])
    ta = {k: v for k, v in ta.items() if k in tb}
    worst, where = 0.0, ""
    for k in ta:
        x, y = ta[k].detach(), tb[k].detach()
        if x.dim() == 0 and y.dim() == 0 and x.is_floating_point() and y.is_floating_point():
            x, y = x.double(), y.double()  # a number and a 0-dim tensor of the same value are the same result
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf, k
        if not x.is_floating_point():
            d = 0.0 if torch.equal(x, y) else math.inf
        else:
            x, y = x.double(), y.double()
            scale = float(x.abs().max()) if x.numel() else 0.0
            d = float((x - y).abs().max()) / scale if scale > 0 else float((x - y).abs().max()) if x.numel() else 0.0
            if k.endswith(_PARAM):
                d *= _TOLERANCE / PARAMETER_TOLERANCE  # see NOTE [ parameters after an optimizer's step ]
        if d > worst:
            worst, where = d, k.removesuffix(_PARAM)
    return worst, where
