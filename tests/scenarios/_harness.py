"""What a scenario is, how it is run and measured, and how advice is recognised in a diagnosis.

A scenario is a piece of code written the way a user writes it (a plain function over the user's
own variable names), the right fix for it as code, the advice a diagnosis must give for it (or none),
the advice it must never give, and ground truth measured by running both: peaks under
``gs.record(memory="cpu")`` and results compared with ``torch.allclose``.

NOTE [ what a result is ]: a scenario's result is everything the user could look at afterwards:
the function's return value, and for every variable of the scenario's state the parameters, their
``.grad``, and the buffers of modules (batch-norm running statistics, ``num_batches_tracked``), and
the value and ``.grad`` of tensors that require grad. A fix must leave all of it equal, except the
names a scenario lists in ``ignore`` with the reason why nobody reads them (``backbone``'s gradients
when no optimizer trains it). Comparing everything by default keeps a fix from hiding a change in a
place the scenario's author did not think of.

NOTE [ the user's variables at the diagnosed moment ]: a diagnosis looks through the user's
variables (which list holds graphs, which model is trained by which optimizer). In a notebook those
are the cell's globals; here the user's code is a function, so its locals are captured when it
returns or raises (a profile hook on its code object) and merged with the scenario's state, the way
a notebook's namespace holds both.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import fnmatch
import linecache
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gradscope as gs

__all__ = [
    "ADVICE_KINDS",
    "EFFECTS",
    "Advice",
    "Run",
    "Scenario",
    "Wrong",
    "advice_in",
    "diagnose_user",
    "outcome",
    "run",
    "same_results",
]

# Advice kinds and how each is recognised in a finding's code (what the user would paste).
ADVICE_KINDS: dict[str, str] = {
    "mixed_grad_forward_ad": r"mixed_grad\(.*forward_ad|input_grad\(",
    "no_grad": r"no_grad\(\)",
    "freeze": r"requires_grad_\(False\)",
    "no_grad_or_freeze": r"no_grad\(\)|requires_grad_\(False\)",
    "item": r"\.item\(\)",
    "detach": r"\.detach\(\)",
    "checkpoint": r"checkpoint\((?![^\n]*context_fn)",  # plain: batch norm counts the recompute too
    "checkpoint_bn_exact": r"checkpoint\([^\n]*context_fn",  # the recompute leaves running stats as they were
    "two_pass": r"many_inputs_backward\(.*two_pass",
    "penalty_branches": r"PenaltyBranches\(",
    "jacobian": r"(?<!\.)jacobian\(",
    "drop_create_graph": r"retain_graph=True",
    "hypergradient": r"hypergradient\(|unrolled_params\(",
    "sum_losses": r"\+[^\n]*\)\.backward\(\)",
    "backward_per_micro_batch": r"/[^\n]*\)\.backward\(\)",
    "drop_retain_graph": r"\w\.backward\(\)(?![^\n]*retain_graph=True)",
    "set_to_none": r"set_to_none=True",
    "step_in_backward": r"register_post_accumulate_grad_hook\(",
    "other_optimizer": r"optim\.SGD\(",
    "detach_output": r"\w+\(\w+\)\.detach\(\)",
}


@dataclass(frozen=True)
class Advice:
    """A fix a diagnosis can advise, recognised in a finding by its code.

    ``target`` is the user's name the advice must mention (``G``, ``losses``; a tuple: any one of
    them), or None when any mention will do. ``pattern`` is the finding pattern it must come with,
    or None for any.
    """

    kind: str
    target: str | tuple[str, ...] | None = None
    pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ADVICE_KINDS:
            raise ValueError(f"unknown advice kind {self.kind!r}; add it to ADVICE_KINDS")

    def given_by(self, finding: Any, step: str = "") -> bool:
        """Whether ``finding`` gives this advice: its kind in what the finding's code adds to
        the user's ``step`` (a rewritten step repeats the user's own lines)."""
        if self.pattern is not None and finding.pattern != self.pattern:
            return False
        code = finding.code or finding.sketch or ""  # (a finding gradscope could not run keeps its call aside)
        if not re.search(ADVICE_KINDS[self.kind], _added(code, step), flags=re.DOTALL):
            return False
        if self.target is None:
            return True
        names = (self.target,) if isinstance(self.target, str) else self.target
        if self.kind in ("no_grad", "freeze", "no_grad_or_freeze"):
            return any(_frozen_in(code, n, self.kind) for n in names)
        return any(re.search(rf"(?<![\w.]){re.escape(n)}\b", code) for n in names)

    def __str__(self) -> str:
        if self.target is None:
            return self.kind
        names = (self.target,) if isinstance(self.target, str) else self.target
        return f"{self.kind}({' or '.join(names)})"


def _frozen_in(code: str, name: str, kind: str) -> bool:
    """Whether ``code`` runs ``name`` under ``torch.no_grad()`` or turns its requires_grad off (a
    finding's code is a whole step: other models may run under no_grad in it)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a one-line sketch with a comment: read it as text
        return bool(re.search(rf"(?<![\w.]){re.escape(name)}\b", code))
    calls = lambda node: any(  # noqa: E731
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(node))
    no_grad = any(isinstance(w, ast.With) and "no_grad" in ast.unparse(w.items[0].context_expr)
                  and any(calls(st) for st in w.body) for w in ast.walk(tree))
    freeze = re.search(rf"(?<![\w.]){re.escape(name)}\.requires_grad_\(False\)", code) is not None
    return {"no_grad": no_grad, "freeze": freeze, "no_grad_or_freeze": no_grad or freeze}[kind]


def advice_in(diagnosis: Any, advice: Advice) -> list[Any]:
    """The findings of ``diagnosis`` that give ``advice``."""
    return [f for f in diagnosis.findings if advice.given_by(f, getattr(diagnosis, "step", ""))]


def _added(code: str, step: str) -> str:
    """The lines of ``code`` that are not the user's ``step`` (compared without indentation, so
    that a statement moved under a new ``with`` stays the user's)."""
    if not step:
        return code
    new = code.splitlines()
    a, b = [ln.strip() for ln in step.splitlines()], [ln.strip() for ln in new]
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return "\n".join(ln for tag, _, _, j1, j2 in ops if tag in ("insert", "replace") for ln in new[j1:j2])


EFFECTS = ("changes the result", "raises the peak", "does not lower the peak")


@dataclass(frozen=True)
class Wrong:
    """Advice that must never be given for a scenario, with the user's code after applying it.

    ``effect`` is what applying it does, measured by the tests: ``"changes the result"`` (some
    result is not allclose to the right one, is None, or the code raises), ``"raises the peak"``
    (the peak under ``memory="cpu"`` is ``peak`` bytes, above the user's own) or ``"does not lower
    the peak"`` (same results, and the peak is ``peak`` bytes, not below the user's own: advice
    that costs the user work or time for nothing). ``error`` is part of the message the applied
    advice raises with, when it raises (so that a mistake in the scenario is not taken for the
    advice's effect); None when it runs and gives other numbers.
    """

    advice: Advice
    apply: Callable[..., Any]
    effect: str
    why: str
    peak: int | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.effect not in EFFECTS:
            raise ValueError(f"unknown effect {self.effect!r}")
        if self.effect != "changes the result" and self.peak is None:
            raise ValueError(f"a wrong advice that {self.effect} needs the measured peak")


@dataclass(frozen=True)
class Scenario:
    """One user situation, its right fix and its measured ground truth.

    Attributes:
        name: registry key.
        title: one line saying what the user does.
        origin: ``"seed 000"`` ... ``"seed 004"`` (the forum threads) or ``"common"``.
        setup: builds the user's variables (models, data, optimizers), seeded; called afresh per run.
        user: the user's code, ``user(**state)``.
        fix: the user's code with the right fix applied, ``fix(**state)``; None when the right
            answer is to change nothing.
        fix_code: the fix as the diagnosis should show it, in the user's names.
        right: advice the diagnosis should give, as alternatives (any one of them is right;
            empty: the right answer is no finding).
        wrong: advice it must never give, each measured.
        peak_user / peak_fix: peaks in bytes under ``gs.record(memory="cpu")``, measured (torch
            2.13 CPU build); ``peak_fix`` None without a fix.
        budget: a simulated device (bytes, ``gs.record(budget=...)``) where the user's code fails
            and the fix fits; None where the scenario is not about running out of memory.
        reference: the right result when the user's code does not give it (it raises), or an
            independent computation of it; by default the user's code is the reference.
        user_error: part of the message the user's code raises with, when it raises.
        ignore: result names the fix may change (``fnmatch`` patterns: ``backbone.*.grad``), with
            the reason (see NOTE [ what a result is ]).
        rtol / atol: tolerances of the comparison (floating-point sums in another order).
        notes: what the numbers mean, what the diagnosis says today.
    """

    name: str
    title: str
    origin: str
    setup: Callable[[], dict[str, Any]]
    user: Callable[..., Any]
    fix: Callable[..., Any] | None
    fix_code: str
    right: tuple[Advice, ...]
    wrong: tuple[Wrong, ...]
    peak_user: int
    peak_fix: int | None
    budget: int | None = None
    reference: Callable[..., Any] | None = None
    user_error: str | None = None
    ignore: Mapping[str, str] = field(default_factory=dict)
    rtol: float = 1e-5
    atol: float = 1e-6
    notes: str = ""

    @property
    def measured_saving(self) -> int | None:
        """Peak of the user's code minus peak of the fix (bytes, ``memory="cpu"``)."""
        return None if self.peak_fix is None else self.peak_user - self.peak_fix

    @property
    def expects_no_finding(self) -> bool:
        return not self.right

    def state(self) -> dict[str, Any]:
        """A fresh copy of the user's variables; the RNG is put at a fixed point afterwards, so
        the user's code and every fix draw the same numbers."""
        st = self.setup()
        torch.manual_seed(1234)
        return st


@dataclass
class Run:
    """One run of a scenario's code: what it returned or raised, its recording and its locals."""

    state: dict[str, Any]
    returned: Any
    error: BaseException | None
    recording: gs.Recording | None
    locals: dict[str, Any]

    @property
    def peak(self) -> int:
        assert self.recording is not None
        return self.recording.peak_bytes

    def outcome(self, ignore: Mapping[str, str] = {}) -> dict[str, Any]:  # noqa: B006 - read only
        return outcome(self.state, self.returned, self.error, ignore)


def run(
    scenario: Scenario,
    fn: Callable[..., Any],
    *,
    memory: str | None = "cpu",
    budget: int | None = None,
    modules: bool = False,
    keep_locals: bool = False,
) -> Run:
    """Run ``fn(**state)`` on a fresh state, recorded unless ``memory`` is None.

    ``modules=True`` names the state's models to the recorder by their variables (what
    ``%gradscope oom on`` does in a notebook). Exceptions from ``fn`` are caught and kept.
    """
    state = scenario.state()
    captured: dict[str, Any] = {}
    code = getattr(fn, "__code__", None)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is code:
            captured.update(frame.f_locals)

    returned: Any = None
    error: BaseException | None = None
    rec = None
    old = sys.getprofile()
    if keep_locals:
        sys.setprofile(profile)
    try:
        if memory is None:
            returned = fn(**state)
        else:
            mods = {k: v for k, v in state.items() if isinstance(v, nn.Module)} if modules else None
            rec = gs.record(memory=memory, budget=budget, modules=mods or None)
            if modules:
                with rec:
                    returned = fn(**state)
            else:
                returned = _as_a_script(fn, state, rec)
    except Exception as e:  # the user's code may raise: that is part of the scenario
        error = e
    finally:
        if keep_locals:
            sys.setprofile(old)
    recording = rec.recording if rec is not None else None
    if error is not None:
        error.__traceback__ = None  # do not keep the failing frames (and their graphs) alive
    return Run(state, returned, error, recording, captured)


# NOTE [ a script's block ]: a script (or a function) writes ``with gs.record(): ...`` where its
# variables are: the frame in which the block ends holds ``G``, ``zs`` as its own names, and the
# recorder names the models it ran by those variables (by identity). A scenario's code is a
# function of the user's variables; run as a script, its block is placed in a frame whose locals
# are exactly the state's variables, as in the user's file. Nothing else is told to the recorder.
def _as_a_script(fn: Callable[..., Any], state: dict[str, Any], rec: Any) -> Any:
    names = [k for k in state if k.isidentifier()]
    args = ", ".join(names)
    src = f"def _script({args}):\n    with rec:\n        return fn({', '.join(f'{k}={k}' for k in names)})\n"
    scope: dict[str, Any] = {"rec": rec, "fn": fn}
    linecache.cache["<script>"] = (len(src), None, src.splitlines(True), "<script>")  # a script's file
    exec(compile(src, "<script>", "exec"), scope)  # noqa: S102 - our own two lines, no user input
    return scope["_script"](**state)


def diagnose_user(scenario: Scenario, *, budget: bool, modules: bool = True) -> tuple[Any, Run, list[str]]:
    """The diagnosis of the user's code as a notebook user gets it: the state's models named by
    their variables, the namespace being the state and the code's locals (see NOTE [ the user's
    variables at the diagnosed moment ]); at the failing allocation when ``budget`` is set,
    else at the peak of a plain recording. ``modules=False`` records as a script does, with a
    plain ``gs.record()`` that is told no names. Also returns the warnings ``gs.diagnose`` itself
    raised (the user's own code may warn; gradscope must not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user's code (seed 002 warns about create_graph)
        r = run(
            scenario,
            scenario.user,
            memory="tracker" if budget else "cpu",
            budget=scenario.budget if budget else None,
            modules=modules,
            keep_locals=True,
        )
    if budget:
        assert isinstance(r.error, gs.MemoryBudgetExceeded), f"{scenario.name}: the user's code fit the budget"
    # the step the recording ran is `fn(**state)`: the diagnosis runs its fixes on that function's body
    namespace = {**r.state, **r.locals, "fn": scenario.user, "state": r.state}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a scenario with a budget is a step that does not fit its device: at its peak too the user
        # asks for the fixes that make it fit (the toolbox runs by itself only at a failure)
        d = gs.diagnose(r.recording, namespace=namespace, toolbox=True if scenario.budget is not None else None)
    return d, r, [f"{w.category.__name__}: {w.message}" for w in caught]


# ----- results --------------------------------------------------------------------------------
def outcome(
    state: Mapping[str, Any],
    returned: Any,
    error: BaseException | None = None,
    ignore: Mapping[str, str] = {},  # noqa: B006 - read only
) -> dict[str, Any]:
    """Every result of a run by name (see NOTE [ what a result is ]), as detached copies."""
    out: dict[str, Any] = {}
    if error is not None:
        out["error"] = f"{type(error).__name__}: {error}"
    _flatten("out", returned, out)
    for name, v in state.items():
        if isinstance(v, nn.Module):
            for pn, p in v.named_parameters():
                out[f"{name}.{pn}"] = p.detach().clone()
                out[f"{name}.{pn}.grad"] = None if p.grad is None else p.grad.detach().clone()
            for bn, b in v.named_buffers():
                out[f"{name}.{bn}"] = b.detach().clone()
        elif isinstance(v, torch.Tensor):
            _leaf(name, v, out)
        elif isinstance(v, list | tuple):
            for i, t in enumerate(v):
                if isinstance(t, torch.Tensor):
                    _leaf(f"{name}[{i}]", t, out)
    return {k: v for k, v in out.items() if not any(fnmatch.fnmatchcase(k, p) for p in ignore)}


def _leaf(name: str, t: torch.Tensor, out: dict[str, Any]) -> None:
    if t.is_leaf and t.requires_grad:
        out[name] = t.detach().clone()
        out[f"{name}.grad"] = None if t.grad is None else t.grad.detach().clone()


def _flatten(name: str, v: Any, out: dict[str, Any]) -> None:
    if isinstance(v, torch.Tensor):
        out[name] = v.detach().clone()
    elif isinstance(v, list | tuple):
        for i, x in enumerate(v):
            _flatten(f"{name}[{i}]", x, out)
    elif isinstance(v, dict):
        for k in sorted(v):
            _flatten(f"{name}.{k}", v[k], out)
    elif isinstance(v, float | int | bool):
        out[name] = torch.tensor(v, dtype=torch.float64)
    elif v is not None:
        raise TypeError(f"a scenario returned a {type(v).__name__}; return tensors, numbers or containers")


def same_results(a: Mapping[str, Any], b: Mapping[str, Any], rtol: float, atol: float) -> list[str]:
    """Names whose results differ (missing on one side, None on one side, another shape or
    dtype, not allclose, or an error on one side); empty when everything matches."""
    diff = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k, "missing"), b.get(k, "missing")
        if isinstance(x, str) or isinstance(y, str) or x is None or y is None:
            if not (x is None and y is None) and x != y:
                diff.append(k)
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            diff.append(k)
        elif x.is_floating_point():
            if not torch.allclose(x, y, rtol=rtol, atol=atol):
                diff.append(k)
        elif not torch.equal(x, y):
            diff.append(k)
    return diff


def replace(scenario: Scenario, **changes: Any) -> Scenario:
    return dataclasses.replace(scenario, **changes)
