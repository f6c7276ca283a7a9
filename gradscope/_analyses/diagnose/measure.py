"""The one module of the diagnosis that runs the user's code or model (on copies)."""

from __future__ import annotations

import builtins
import collections
import contextlib
import copy
import dataclasses
import logging
import math
import random
import sys
import time
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._analyses.diagnose.indexed import MIN_SAVING
from gradscope._analyses.diagnose.step import free_names, statements
from gradscope._base import compat as _compat
from gradscope._base.errors import MemoryBudgetExceeded
from gradscope._model.recording import format_bytes

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
    from gradscope._analyses.predict.predictor import predict
    from gradscope._capture.record import record

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
    from gradscope._analyses.strategies import mixed_grad

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
    from gradscope._analyses.strategies import jacobian

    def run(model: nn.Module) -> None:
        dev = next(iter(model.parameters())).device
        jacobian(lambda v: model(v.view(1, -1)).view(-1), torch.zeros(n_in, device=dev), method=method)

    return run


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def micro_batch_proxy(xs: Any, n: int) -> Any:
    def run(model: nn.Module) -> None:
        dev = _device_of(model)  # the stand-in inputs go where the model is (meta under predict; a GPU)
        for x in xs:
            (model(x.to(dev)).float().square().mean() / n).backward()

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def two_pass_proxy(xs: Any, n: int) -> Any:
    from gradscope._analyses.strategies import many_inputs_backward

    def run(model: nn.Module) -> None:
        dev = _device_of(model)
        many_inputs_backward(model, [x.to(dev) for x in xs], lambda zs: zs.float().square().mean(), method="two_pass")

    return run if isinstance(xs, list | tuple) and xs and all(isinstance(x, torch.Tensor) for x in xs) else None


def hypergradient_proxy(a_shape: tuple[int, ...], x_shape: tuple[int, ...], steps: int) -> Any:
    from torch.func import functional_call

    from gradscope._analyses.strategies import hypergradient

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
# on copies of the user's objects as the user runs them: the modules' train/eval state as it is,
# dropout on where the user has it on. Its memory is measured on meta copies (see NOTE [ counted as
# a budget counts ] in gradscope._analyses.predict.predictor: no data, the tracker's exact bytes, cheap next to a real
# run), or by runs of a CPU copy (see NOTE [ meta or a CPU copy ] and NOTE [ the CPU allocator counts a
# run ]) where the step is small or meta cannot run it (code that reads values, ``.item()``; autocast,
# which casts only real tensors). Only a fix that is worth showing by its memory then runs for real,
# once, on a copy of the user's objects at full size (on CPU copies, the run that measured it), next to
# the user's own step (the block's source, see ``gradscope._base.source``) on another copy from the same
# state and the same random state (see NOTE [ results where randomness allows ]). Parameters, gradients,
# buffers (batch-norm statistics) and optimizer state must agree; variables that differ are named in
# the finding. The saving shown is the user's step's peak minus the fix's, both measured the same
# way from the objects as they are when the diagnosis runs.
_TOLERANCE = 1e-4  # largest relative difference of a result counted as equal (float32 reordering)
# NOTE [ two runs of a step ]: a step's memory is measured twice in a row on the same copies: the
# first run from the state the block started with, the next with what the first left (optimizer
# state, gradients, the variables that still hold the last step's output). A peak counts the tensors
# held when the run starts plus the most the run allocates at once. The first run's peak is the
# step's (the saving claimed is the user's minus the fix's); the next run's keeps a fix that helps a
# first step but raises later ones from being shown, and a fix fits a budget only if both runs do.
# The results compared are those of the first run: an optimizer like Adam turns rounding
# differences of a second step into larger ones.
RUNS = 2
# NOTE [ meta or a CPU copy ]: meta counts a run's bytes exactly as the tracker counts them (see NOTE
# [ counted as a budget counts ] in gradscope._analyses.predict.predictor), a CPU copy at least as many (see NOTE [ the CPU
# allocator counts a run ]). On meta no kernel computes, but every operator still passes the tracker
# and PyTorch's meta implementations (many in Python): for a step whose objects are small, a real run
# of a CPU copy costs less (GPT-2 with 2 layers of 64: 3x less under the tracker, 30x less counted by the
# allocator), and its first run is also the run its results are compared from. So a step whose
# objects hold at most SMALL_STEP_BYTES on the CPU, and whose recorded block allocated at most
# SMALL_STEP_ALLOCATED in all (it computes little), is measured on CPU copies; any other on meta (GPT-2
# 6 x 384, batch 16 x 256: 14.2x its plain step on CPU copies, 6.1x on meta). Both are read from the
# recording and the objects, never from a clock: the same diagnosis whatever the machine's load.
SMALL_STEP_BYTES = 64 * 1024 * 1024
SMALL_STEP_ALLOCATED = 256 * 1024 * 1024
# code meta cannot count as a real run does: autocast casts only real tensors, and forward AD's zero
# tangents stay empty under a dispatch mode (see the limits of gs.predict); it runs on CPU copies
_NOT_ON_META = ("autocast", "forward_ad", "jvp", "jacfwd", "input_grad", "mixed_grad")
# NOTE [ parameters after an optimizer's step ]: Adam's first step moves each element by about the
# learning rate whatever its gradient's size (m / sqrt(v)), so an element whose gradient is near
# epsilon turns a rounding difference of 1e-7 into a move of a few percent of the learning rate; and
# it would not see a gradient scaled by two at all. Gradients, optimizer state and buffers are
# compared at 1e-4 (relative to each tensor's largest value); parameters, which the step moved, at
# 1e-3. A finding's ``tolerance`` says when a fix needs more (autocast).
PARAMETER_TOLERANCE = 1e-3
_PARAM = "#parameter"
_GRAPH = " (with its graph)"
# NOTE [ results where randomness allows ]: the user's step and a fix run from the same random state
# (the user's own, as it is when the diagnosis runs; theirs is put back afterwards). A fix that draws
# the same random numbers in the same order (checkpointing replays dropout's masks; autocast; the
# optimizer in backward) gives the same results with dropout on, and is compared so. One that draws
# them in another order (micro-batches draw each slice's masks in turn) cannot: both then run again
# with every dropout module's p and every float attribute named dropout set to 0, and are compared
# so. Where even those runs draw random numbers (``torch.randn_like`` noise, a dropout call with its
# own p), the results are not compared, and the finding says so (``Trial.compared``). Micro-batches of
# a model with two dropout modules or more draw their masks in another order whatever the values
# (``Trial.reorders``): they are compared with dropout off at once, so that a micro-batched step whose
# memory was measured on meta is not run for real with dropout on for a comparison that cannot agree
# (GPT-2 6 x 384's diagnosis: six real runs of a step, seven before). The user's step with dropout off
# runs once for every fix compared so; a fix not run with dropout on has as its time its run's over the
# user's with dropout off.
COMPARED_PLAIN = "compared from the same state"  # the step draws no random numbers
COMPARED_ON = "compared with dropout as you have it, from the same random state"
COMPARED_OFF = ("compared with dropout off: with it on, the fix draws dropout's random masks in another order than "
                "your step")
NOT_COMPARED = ("not compared: your step draws random numbers that the fix draws in another order, so no two runs "
                "of them can be compared")


@dataclass(frozen=True)
class Trial:
    """One piece of code measured on copies: its peak, and (once run for real) its results
    against the user's step's."""

    error: str | None = None
    peak: int | None = None  # the most held at once over its first run, what the copies held at its start included
    how: str = ""  # "meta" | "cpu copy"
    same: bool | None = None  # results equal the user's step's (None: not compared, or not run yet)
    worst: float = 0.0  # largest relative difference of a result
    worst_at: str = ""
    differs: tuple[str, ...] = ()  # other variables the code leaves with other values
    freed: int = 0  # gradients the code leaves freed (None) where the user's step kept them
    seconds: float | None = None  # wall time of a run of the step on the CPU copy (the fastest of its runs)
    resident: int = 0  # bytes of the copies' tensors when the first run starts
    later: int | None = None  # the same peak for the next run, with what the first left
    later_resident: int = 0  # bytes of the copies' tensors when the next run starts
    compared: str = ""  # how the results were compared (see NOTE [ results where randomness allows ])
    verified: bool = False  # ran for real and compared (Bench.verify)
    code: str = ""  # the step it runs
    setup: str = ""  # run once before the steps
    tolerance: float = _TOLERANCE
    reorders: bool = False  # known to draw dropout's masks in another order than the step (see Bench.verify)
    # not run: the least its first run would hold at once (see NOTE [ runs a fix needs ]), too much to be shown
    bound: int | None = None
    # the user's step: the most its first run's own allocations held at once through each of its statements
    through: tuple[int, ...] | None = None

    @property
    def complete(self) -> bool:
        """Both runs measured (see NOTE [ two runs of a step ]), or nothing more to measure."""
        return self.later is not None or self.error is not None or self.bound is not None


# NOTE [ one budget ]: the number the user gave is the budget every line uses. A notebook's
# ``--budget`` is a device: what the user's variables hold when the cell starts is on it (named by
# variable), and the cell may allocate the rest. ``gs.record(budget=...)`` and ``--cell-only``
# count only what the block allocates. A fix fits when a run of its step on copies allocates no
# more than that, in its first run and in the next (whose variables then hold what the first left:
# on a device, the next cell has that much less), its one-time set-up counted with the step.
@dataclass(frozen=True)
class Room:
    """What a fixed step may allocate under the budget the block ran out of (see NOTE [ one budget ])."""

    budget: int  # the number the user gave
    resident: int  # held by the user's variables when the block started and counted by the budget (a device)
    device: bool  # the budget counts what the variables held (a notebook's --budget), else only the block's own
    base: int  # what the copies of the step's objects held at the step's start

    @property
    def allowed(self) -> int:
        """What the step itself may allocate."""
        return self.budget - self.resident

    def allocates(self, trial: Trial) -> tuple[int, int | None]:
        """What a trial's step allocates at once at most, in its first run and the next (counted
        as this budget counts them)."""
        first = int(trial.peak or 0) - self.base
        if trial.later is None:
            return first, None
        return first, trial.later - (self.base if self.device else trial.later_resident)

    def fits(self, trial: Trial) -> bool:
        """Whether both runs of the trial's step fit (a trial whose next run was not measured does not)."""
        first, later = self.allocates(trial)
        return first <= self.allowed and later is not None and later <= self.allowed

    def fits_first(self, peak: int) -> bool:
        """Whether a first run that holds ``peak`` at once fits."""
        return peak - self.base <= self.allowed


# NOTE [ runs a fix needs ]: a fix is shown when it saves at least MIN_SAVING of the user's step's peak,
# or makes a step that does not fit fit (``worth_showing``), its results agree with the user's step's, and
# its next run (see NOTE [ two runs of a step ]) neither goes over the budget nor raises the peak. So each
# run is made only once what came before says that the fix may still be shown: its first run (its memory,
# and on CPU copies the results compared), then where that saves enough its results are compared
# (``Bench.settled``: with dropout off, two more runs, only where the fix draws dropout's masks in another
# order: see NOTE [ results where randomness allows ]), then where they agree its next run, in the
# variables its first run left (kept for KEPT fixes; ``Bench.complete``). A size that is tried in turn
# (the micro-batch, the checkpointed segments) is settled only where its first run fits. A fix left at
# its first run is noted with that run's numbers. The user's
# step runs twice at once, statement by statement: what its first run allocates through each of its
# statements bounds a fix that runs those statements as they are (``Bench.least``): a fix whose set-up
# makes no tensor allocates there what the user's step allocates, until the first statement whose work
# the fix changes; the optimizer step in backward runs the backward call itself with at most the
# parameters' gradients less alive (it frees each once applied; the optimizer's state and temporaries it
# makes there only add). Where that bound alone keeps a fix from being shown, it is not run at all and a
# note gives the bound. GPT-2 of the docs: the optimizer step in backward, whose step allocates 6.3 MiB
# before its backward and could save at most the 532 KiB of gradients, is not run; micro-batches of 4 and
# checkpointing run twice each, the user's step twice, and micro-batches' results compared with dropout
# off take two runs: eight runs of the step in all, each of them one that something shown needs (their
# memory on CPU copies: see NOTE [ meta or a CPU copy ]): 9 of the 10.9 step-times of a profiled
# diagnosis; the copies of the objects (see NOTE [ a module's containers copied ahead ]), the results
# and their comparisons most of the rest.
def worth_showing(user: Trial, peak: int, room: Room | None, fits: bool) -> bool:
    """Whether a fix whose first run holds ``peak`` at once is shown next to the user's step, ``fits``
    saying whether it fits the room (see NOTE [ runs a fix needs ])."""
    top = int(user.peak or 0)
    saving = top - peak
    fails = room is not None and not room.fits(user)
    return saving > 0 and (saving >= MIN_SAVING * top or (fails and fits))


KEPT = 2  # fixes whose variables are kept after their first run, for their next (see NOTE [ runs a fix needs ])


@dataclass
class _Pending:
    """A fix's variables after its first run, kept for its next: its compiled step, the random
    state its first run left, and whether it runs on meta."""

    env: dict[str, Any]
    pieces: list[Any]
    random: _RandomState
    meta: bool


@dataclass
class _Real:
    """One real run of a step on copies: what its variables hold after it, its time, and whether
    it drew random numbers."""

    state: dict[str, Any]
    seconds: float
    drew: bool
    # timed under the tracker (a first run that measured memory too: 3x a plain run); one the allocator's
    # counter counted times as a plain run does (see NOTE [ the CPU allocator counts a run ])
    tracked: bool = False


class Bench:
    """The user's step and namespace, and the copies fixes run on (see NOTE [ nothing shown that
    was not run ])."""

    def __init__(self, source: str, namespace: Mapping[str, Any], device: str = "cpu", *,
                 fresh_optimizers: bool = False, fresh_gradients: bool = False,
                 progress: Any = None, step_allocated: int = 0,
                 room: Callable[[Trial], Room | None] | None = None, limit: int | None = None) -> None:
        self.source = source
        self.limit = limit  # see NOTE [ a bound on runs of copies ]
        self.ns = namespace
        self.device = device
        # NOTE [ copies start as the block started ]: the objects are copied as they are when the
        # diagnosis runs, after the block; optimizer state and gradients the block itself created
        # (the recording says so) are dropped from the copies, so that a first step that failed
        # is measured as the first step it was, not as a later one with that state resident.
        self.fresh_optimizers = fresh_optimizers
        self.fresh_gradients = fresh_gradients
        self.random_state = _RandomState.now()  # the user's: every run starts from it
        self.step_allocated = step_allocated  # bytes the recorded block allocated (see NOTE [ meta or a CPU copy ])
        self.progress = progress if progress is not None else (lambda what: None)
        self._user: Trial | None = None
        self._real: dict[bool, _Real | None] = {}  # the user's step run for real, by dropout on/off
        self._measured: dict[tuple[str, str], Trial] = {}
        self._reals: dict[tuple[str, str], _Real] = {}  # first runs of the CPU copies, counted
        self._is_small: bool | None = None
        self._room_of = room  # the room of the user's step, once measured (None: no budget to fit)
        self.room: Room | None = None
        self._complete = False  # measuring both runs at once (complete() of a fix whose variables were not kept)
        self._pending: dict[tuple[str, str], _Pending] = {}  # fixes' variables after their first run
        self.counted_by = ""  # "allocator" | "tracker": what counted the runs of CPU copies
        self._splits: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # see _split
        self._collected: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}  # see _tensors

    # ----- what the code needs ------------------------------------------------------------------
    def _names(self, code: str) -> set[str]:
        names = free_names(code)
        more: set[str] = set()
        for n in names:  # functions of the user's that read other variables of the namespace
            f = self.ns.get(n)
            if isinstance(f, types.FunctionType):
                more |= _global_reads(f) & set(self.ns)
        return (names | more) & set(self.ns)

    def _tensors(self, copied: Mapping[str, Any]) -> dict[int, torch.Tensor]:
        """The tensors reachable from the user's objects ``copied``, by id (collected once: the user's
        objects do not change while the diagnosis runs)."""
        from gradscope._analyses.predict.copies import _collect_tensors

        key = tuple(id(v) for v in copied.values())
        if key not in self._collected:
            tensors: dict[int, torch.Tensor] = {}
            _collect_tensors(dict(copied), tensors, set())
            self._collected[key] = tensors
        return self._collected[key]

    def _split(self, code: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(objects to copy, objects passed as they are: Python modules, functions, classes,
        numbers). Objects a function of the user's holds in its closure are copied too, under
        names no code can spell (see NOTE [ the user's functions as they are ]). Worked out once
        per code."""
        if code not in self._splits:
            self._splits[code] = self._split_now(code)
        copied, kept = self._splits[code]
        return dict(copied), dict(kept)

    def _split_now(self, code: str) -> tuple[dict[str, Any], dict[str, Any]]:
        copied: dict[str, Any] = {}
        kept: dict[str, Any] = {}
        for n in sorted(self._names(code) | self._names(self.source)):
            v = self.ns[n]
            if _passed_as_is(v):
                kept[n] = v
            else:
                copied[n] = v
        for f in list(kept.values()):
            if isinstance(f, types.FunctionType):
                for i, v in enumerate(_closure_objects(f)):
                    if not _passed_as_is(v) and not any(v is c for c in copied.values()):
                        copied[f"<closure {i} of {f.__qualname__}>"] = v
        return copied, kept

    @staticmethod
    def _env(kept: Mapping[str, Any], copied: Mapping[str, Any], copies: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {"__builtins__": builtins, "torch": torch, **kept, **copies}
        twins = {id(copied[n]): copies[n] for n in copied}
        rebuilt = _Rebuilt(twins)
        for n, v in kept.items():
            if isinstance(v, types.FunctionType):
                env[n] = rebuilt.function(v)
        return env

    # ----- memory -------------------------------------------------------------------------------
    def measure(self, code: str, setup: str = "", *, least: int | None = None) -> Trial:
        """The code's memory on copies (see NOTE [ nothing shown that was not run ]): on meta where it
        runs there, else by runs of a CPU copy (see NOTE [ the CPU allocator counts a run ]). Measured
        once per code: a fix's first run (:meth:`complete` runs its next, :meth:`settled` compares its
        results first; see NOTE [ runs a fix needs ]). ``least``: the least its first run holds at once
        (:meth:`least`); where that keeps it from being shown, it is not run (``Trial.bound``)."""
        key = (setup, code)
        if key not in self._measured:
            if least is not None and self._hopeless(least):
                self._measured[key] = Trial(bound=least, code=code, setup=setup)
                return self._measured[key]
            trial = None
            if not any(w in setup + code for w in _NOT_ON_META) and not self._small():
                try:
                    trial = self._meta(code, setup)
                except Exception:  # it reads values (.item()): a real run
                    trial = None
            if trial is None:
                try:
                    trial = self._on_cpu(code, setup)
                except MemoryBudgetExceeded as e:
                    trial = Trial(error=self._over_limit(e))
                except Exception as e:  # the code fails on the copies: it is not shown
                    trial = Trial(error=f"{type(e).__name__}: {e}")
            self._measured[key] = dataclasses.replace(trial, code=code, setup=setup)
        return self._measured[key]

    def _over_limit(self, e: MemoryBudgetExceeded) -> str:
        """What a run stopped by the bound says (see NOTE [ a bound on runs of copies ]), or the
        user's own budget's message where no bound was set."""
        if self.limit is None:
            return f"{type(e).__name__}: {e}"
        return (f"it went over {format_bytes(self.limit)}, where runs of copies of a block that ran out of memory "
                f"stop: {RUN_LIMIT_FACTOR} times what the block held or its budget, at least "
                f"{format_bytes(RUN_LIMIT_FLOOR)}")

    def complete(self, trial: Trial) -> Trial:
        """``trial`` with its next run measured too (see NOTE [ two runs of a step ]): in the variables
        its first run left where they were kept, else both runs again."""
        if trial.complete:
            return trial
        key = (trial.setup, trial.code)
        try:
            done = self._continue(key, trial)
        except Exception as e:  # its next run fails on the copies: it is not shown
            done = dataclasses.replace(trial, error=f"{type(e).__name__}: {e}")
        if done is None:
            self._measured.pop(key, None)
            self._complete = True
            try:
                done = self.measure(trial.code, trial.setup)
            finally:
                self._complete = False
        self._measured[key] = dataclasses.replace(done, tolerance=self._measured.get(key, done).tolerance)
        return dataclasses.replace(trial, later=done.later, later_resident=done.later_resident, error=done.error,
                                   seconds=done.seconds if done.seconds is not None else trial.seconds)

    def fitted(self, trial: Trial, room: Room) -> Trial:
        """For a search over sizes (micro-batches, checkpointed segments): ``trial`` settled where its first
        run fits ``room`` (:meth:`settled`), else as it is."""
        if trial.error is None and trial.peak is not None and room.fits_first(trial.peak):
            return self.settled(trial)
        return trial

    def settled(self, trial: Trial) -> Trial:
        """A fix as the diagnosis may show it: its results compared with the user's step's (:meth:`verify`),
        then, where they agree, its next run measured (:meth:`complete`); see NOTE [ runs a fix needs ]."""
        trial = self.verify(trial)
        if trial.error is None and trial.same is not False:
            trial = self.complete(trial)
        key = (trial.setup, trial.code)
        if key in self._measured:  # (measured() says what was compared)
            self._measured[key] = dataclasses.replace(trial, tolerance=self._measured[key].tolerance)
        return trial

    def measured(self) -> list[Trial]:
        """The fixes measured so far (the user's step left out)."""
        return [t for (setup, code), t in self._measured.items() if (setup, code) != ("", self.source)
                and t.error is None and t.bound is None]

    def _small(self) -> bool:
        """Whether the step's objects are small enough on the CPU that a real run costs less than one
        on meta (see NOTE [ meta or a CPU copy ]). Decided once."""
        if self._is_small is None:
            copied, _ = self._split(self.source)
            self._is_small = (self.device == "cpu" and resident_bytes(copied.values()) <= SMALL_STEP_BYTES
                              and self.step_allocated <= SMALL_STEP_ALLOCATED)
        return self._is_small

    def least(self, code: str, *, before: int | None = None, slack: int = 0) -> int | None:
        """The least the first run of the step ``code`` holds at once, from the user's step's first run
        measured statement by statement (see NOTE [ runs a fix needs ]), for a fix whose set-up makes
        no tensor and frees none: its leading statements that are the user's (at most ``before`` of them,
        where the set-up changes what the later ones do) allocate what the user's did; where the next
        statement is the user's too and ``slack`` is given, it holds at most ``slack`` bytes less than
        the user's step during it. None: nothing known."""
        user = self.user()
        mine, theirs = statements(code), statements(self.source)
        if user.through is None or mine is None or theirs is None:
            return None
        n = mine.common(theirs)
        if before is not None:
            n = min(n, before)
        most = user.through[n - 1] if n > 0 else 0
        if slack > 0 and n < len(mine.dumps) and n < len(theirs.dumps) and mine.dumps[n] == theirs.dumps[n]:
            most = max(most, user.through[n] - slack)
        return user.resident + most if most > 0 else None

    def _hopeless(self, peak: int) -> bool:
        """Whether a fix whose first run holds ``peak`` at once is not shown whatever its next run
        does (see NOTE [ runs a fix needs ]): the rule of gradscope.diagnose's toolbox."""
        user = self._user
        if user is None or user.peak is None:
            return False
        return not worth_showing(user, peak, self.room, self.room is not None and self.room.fits_first(peak))

    def _runs(self, env: dict[str, Any], code: str, setup: str, counter: _TrackerCount | _AllocatorCount,
              first_run: Callable[[float, torch.Tensor], None] | None = None, *, meta: bool = False) -> Trial:
        """``setup`` once, then the step's first run in ``env``, its own allocations counted by ``counter``
        (see NOTE [ two runs of a step ]); ``first_run(seconds, rng_before)`` is called after it, before
        anything else runs. The user's step runs again at once, statement by statement, what its first run
        allocates through each counted; a fix's next run waits until it is wanted (:meth:`complete`), its
        variables kept (see NOTE [ runs a fix needs ])."""
        user = (setup, code) == ("", self.source)
        parts = statements(code) if user else None
        pieces = [compile(t, "<gradscope fix>", "exec") for t in (parts.texts if parts is not None else (code,))]
        exec(compile(setup, "<gradscope fix>", "exec"), env)
        rng = torch.get_rng_state()  # (a tensor of its own: taken before the run's count begins)
        held, peak, seconds, through = self._run_once(env, pieces, counter, split=parts is not None)
        if first_run is not None:
            first_run(seconds, rng)
        trial = Trial(peak=peak, resident=held, later_resident=held, seconds=seconds,
                      through=through if parts is not None else None)
        if user or self._complete:
            later_held, later, again, _ = self._run_once(env, pieces, counter)
            return dataclasses.replace(trial, later=later, later_resident=later_held, seconds=min(seconds, again))
        if not self._hopeless(peak):
            self._keep((setup, code), _Pending(env, pieces, _RandomState.now(), meta))
        return trial

    def _run_once(self, env: dict[str, Any], pieces: list[Any], counter: _TrackerCount | _AllocatorCount,
                  split: bool = False) -> tuple[int, int, float, tuple[int, ...]]:
        """One run of the step (its compiled ``pieces``, one after the other) in ``env``: what the
        variables held at its start, that plus the most its own allocations held at once, its seconds,
        and (``split``) the most they held through each piece."""
        held = resident_bytes(env.values())
        through: list[int] = []
        counter.begin()
        t0 = time.perf_counter()
        for piece in pieces:
            exec(piece, env)
            if split:
                through.append(counter.most())
        seconds = time.perf_counter() - t0
        return held, held + counter.most(), seconds, tuple(through)

    def _keep(self, key: tuple[str, str], pending: _Pending) -> None:
        """A fix's variables after its first run, for its next (at most KEPT of them: the oldest
        goes, and runs both again if it is wanted)."""
        self._pending[key] = pending
        while len(self._pending) > KEPT:
            self._pending.pop(next(iter(self._pending)))

    def _continue(self, key: tuple[str, str], trial: Trial) -> Trial | None:
        """The next run of a fix whose variables were kept after its first; None where they were not."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return None
        from gradscope._analyses.predict.predictor import counted_on_meta

        counter = _TrackerCount("meta") if pending.meta else self._counter()
        with self._quiet(), (torch.random.fork_rng(devices=[]) if pending.meta else pending.random.used()):
            counter.start()
            try:
                with (counted_on_meta(self.device, counter.source) if isinstance(counter, _TrackerCount)
                      and pending.meta else contextlib.nullcontext()):
                    held, later, seconds, _ = self._run_once(pending.env, pending.pieces, counter)
            finally:
                counter.stop()
        return dataclasses.replace(trial, later=later, later_resident=held,  # (times on meta are no kernel's)
                                   seconds=trial.seconds if trial.seconds is None or pending.meta
                                   else min(trial.seconds, seconds))

    def close(self) -> None:
        """Let go of the variables kept for next runs."""
        self._pending.clear()

    def _counter(self) -> _TrackerCount | _AllocatorCount:
        """What counts the runs of CPU copies, decided once (``counted_by``): every run of a diagnosis
        is counted the same way. A step that starts PyTorch's profiler is counted by the tracker: the
        profiler needs the thread's profiler slot, where the allocator's counter sits while it counts."""
        if not self.counted_by:
            bounded = "profil" in self.source or self.limit is not None  # see NOTE [ a bound on runs of copies ]
            self.counted_by = "tracker" if bounded else _counter(self.device).name
        if self.counted_by == "allocator":
            return _AllocatorCount()
        return _TrackerCount(self.device if self.device == "cpu" else "cuda", self.limit)

    def _meta(self, code: str, setup: str) -> Trial:
        from gradscope._analyses.predict.copies import _to_meta
        from gradscope._analyses.predict.predictor import counted_on_meta

        copied, kept = self._split(setup + code)
        names = list(copied)
        with self._quiet():
            metas = dict(zip(names, _to_meta(tuple(copied[n] for n in names))[0], strict=True))
        self._as_at_start(metas)
        env = self._env(kept, copied, metas)
        counter = _TrackerCount("meta", self.limit)
        with self._quiet(), torch.random.fork_rng(devices=[]):
            counter.start()
            try:
                with counted_on_meta(self.device, counter.source):
                    trial = self._runs(env, code, setup, counter, meta=True)
            finally:
                counter.stop()
        self.progress("meta")
        return dataclasses.replace(trial, how="meta", seconds=None)  # (times on meta are no kernel's)

    def _on_cpu(self, code: str, setup: str) -> Trial:
        """The code's memory by runs of a CPU copy (code meta cannot run, or a small step), counted
        by the CPU allocator where the compiled hooks are in use, else by the tracker (see NOTE [ the
        CPU allocator counts a run ]). Its first run is also the real run its results are compared
        from."""
        copied, kept = self._split(setup + code)
        with self._quiet():
            copies = _replica(copied, tensors=self._tensors(copied))
        self._as_at_start(copies)
        env = self._env(kept, copied, copies)
        before = set(env)
        counter = self._counter()

        def first_run(seconds: float, rng: torch.Tensor) -> None:
            drew = not torch.equal(rng, torch.get_rng_state())
            state = _results(env, set(copies) | {k for k in set(env) - before if not k.startswith("_")})
            self._reals[(setup, code)] = _Real(state, seconds, drew, tracked=counter.name == "tracker")

        with self._quiet(), self.random_state.used():
            counter.start()
            try:
                trial = self._runs(env, code, setup, counter, first_run)
            finally:
                counter.stop()
        self.progress("run")
        return dataclasses.replace(trial, how="cpu copy")


    def _as_at_start(self, copies: Mapping[str, Any]) -> None:
        """See NOTE [ copies start as the block started ]."""
        for v in copies.values():
            if self.fresh_optimizers and isinstance(v, torch.optim.Optimizer):
                v.state.clear()
            if self.fresh_gradients and isinstance(v, nn.Module):
                for p in v.parameters():
                    p.grad = None

    # ----- results ------------------------------------------------------------------------------
    def _run_for_real(self, code: str, setup: str = "", *, dropout: bool = True) -> _Real:
        """One run of ``setup`` and the step on copies, as the user runs it (``dropout=False``: with
        dropout off, see NOTE [ results where randomness allows ])."""
        compiled = compile(code, "<gradscope fix>", "exec")
        copied, kept = self._split(setup + code)
        with self._quiet():
            copies = _replica(copied, dropout=dropout, tensors=self._tensors(copied))
        self._as_at_start(copies)
        env = self._env(kept, copied, copies)
        before = set(env)
        with self._quiet(), self.random_state.used():
            exec(compile(setup, "<gradscope fix>", "exec"), env)
            start = torch.get_rng_state()
            t0 = time.perf_counter()
            exec(compiled, env)
            seconds = time.perf_counter() - t0
            drew = not torch.equal(start, torch.get_rng_state())
            # (the copies are let go after this run: their tensors are the results)
            state = _results(env, set(copies) | {k for k in set(env) - before if not k.startswith("_")}, clone=False)
        self.progress("run")
        return _Real(state, seconds, drew)

    def reference(self, dropout: bool = True) -> _Real | None:
        """The user's own step run for real on copies (None: it fails there)."""
        if dropout not in self._real:
            cached = self._reals.get(("", self.source)) if dropout else None
            try:
                self._real[dropout] = cached or self._run_for_real(self.source, dropout=dropout)
            except Exception:
                self._real[dropout] = None
        return self._real[dropout]

    def _real_run(self, trial: Trial) -> _Real:
        """The fix's first run for real: the one that measured its memory on a CPU copy where the user's
        step's real run was timed the same way (times compare like with like), else a plain one."""
        cached = self._reals.get((trial.setup, trial.code))
        ref = self._real.get(True)
        if cached is not None and ref is not None and cached.tracked == ref.tracked:
            return cached
        return self._run_for_real(trial.code, trial.setup)

    def user(self) -> Trial:
        """The user's own step, measured the same way as the fixes (its memory; its time once it
        ran for real)."""
        if self._user is None:
            self._user = self.measure(self.source)
            self.room = self._room_of(self._user) if self._room_of is not None and self._user.peak is not None else None
        ref = self._real.get(True)
        if ref is not None and self._user.seconds is None:  # (measured on meta: its time is that of a real run)
            self._user = dataclasses.replace(self._user, seconds=ref.seconds)
        return self._user

    def run(self, code: str, *, setup: str = "", tolerance: float = _TOLERANCE, least: int | None = None,
            reorders: bool = False) -> Trial:
        """``setup`` once and the step (``code``) measured on copies (see :meth:`measure`); :meth:`settled`
        compares its results with the user's step's and measures its next run. ``reorders``: the code is
        known to draw dropout's masks in another order than the step (see :meth:`verify`)."""
        return dataclasses.replace(self.measure(code, setup, least=least), tolerance=tolerance, reorders=reorders)

    def verify(self, trial: Trial) -> Trial:
        """The fix of a measured ``trial`` run once for real on copies, next to the user's step,
        its results compared (see NOTE [ results where randomness allows ]): with dropout as the user
        has it, else (the fix draws random numbers in another order) with dropout off. A fix known
        to draw them in another order (``Trial.reorders``: micro-batches of a model with two dropout
        modules or more) in a step that draws them is compared with dropout off at once: it is not run
        with dropout on for a comparison that cannot agree (a micro-batched step measured on meta)."""
        if trial.error is not None or trial.verified or trial.bound is not None:
            return trial
        ref = self.reference()
        if ref is None:
            return dataclasses.replace(trial, verified=True)
        objects = set(self._split(self.source)[0])
        if trial.reorders and ref.drew:
            done = self._compared_off(trial, objects, ref)
            if done is not None:
                return done
        try:
            mine = self._real_run(trial)
        except Exception as e:  # the code fails on the copies: it is not shown
            return dataclasses.replace(trial, error=f"{type(e).__name__}: {e}", verified=True)
        worst, where, differs, freed = _compare(ref.state, mine.state, objects)
        compared = COMPARED_ON if ref.drew else ""
        if worst > trial.tolerance and (ref.drew or mine.drew):
            done = (None if trial.reorders and ref.drew
                    else self._compared_off(trial, objects, ref, trial.seconds or mine.seconds))
            if done is not None:
                return done
            return dataclasses.replace(trial, same=None, compared=NOT_COMPARED, seconds=trial.seconds or mine.seconds,
                                       verified=True)
        return dataclasses.replace(trial, same=worst <= trial.tolerance, worst=worst, worst_at=where,
                                   differs=differs, freed=freed, seconds=trial.seconds or mine.seconds, compared=compared,
                                   verified=True)

    def _compared_off(self, trial: Trial, objects: set[str], ref: _Real, seconds: float | None = None) -> Trial | None:
        """``trial`` compared with the user's step with dropout off, both run again so (the user's
        run once for every fix compared so); None where either fails or still draws random numbers.
        Its ``seconds``, where it was not run with dropout on (its memory measured on meta): the user's
        step's times the fix's over the user's step's with dropout off."""
        off = self.reference(dropout=False)
        if off is None or off.drew:
            return None
        try:
            mine = self._run_for_real(trial.code, trial.setup, dropout=False)
        except Exception:
            return None
        if mine.drew:
            return None
        worst, where, differs, freed = _compare(off.state, mine.state, objects)
        seconds = seconds or trial.seconds or (mine.seconds * ref.seconds / off.seconds if off.seconds > 0 else None)
        return dataclasses.replace(trial, same=worst <= trial.tolerance, worst=worst, worst_at=where, differs=differs,
                                   freed=freed, seconds=seconds, compared=COMPARED_OFF, verified=True)

    @contextlib.contextmanager
    def _quiet(self) -> Any:
        with warnings.catch_warnings(), quiet_logging():
            warnings.simplefilter("ignore")
            yield


# NOTE [ the CPU allocator counts a run ]: a run of a CPU copy counts its memory with the allocator's
# counter of the compiled hooks where they are in use (the CPU allocator's own reports of each
# allocation and free, a run's count: see NOTE [ the allocator's counter ] in hooks.cc), else with the
# tracker (gradscope.memory.TrackerSource, the budget's own count). The tracker passes every operator
# through Python (about 40 us each on top of the operator: a run of the docs' GPT-2 step under it
# takes 3.2 times the plain step); the allocator's reports cost a lookup (1.05 to 1.2 times). Both
# count a run's own allocations only (``_most_above``; the counter in C++), and the allocator counts
# every byte the tracker counts: each storage an operator makes is one of the allocator's
# allocations, from its allocation to its free. It counts more, never less: the kernels' own
# temporaries (CPU convolution's work buffers; the 0-d tensor PyTorch wraps a Python number in),
# the allocations of the threads the step's thread hands its work to (autograd's), and storages the
# tracker skips, where they hold bytes. So a fix
# whose runs fit as the allocator counts them fits as the budget counts them, and the bytes shown are
# at least those the budget counts (48 B more on the docs' GPT-2 step; tests/test_diagnose.py compares
# the two on steps with convolutions, optimizers and tensors made from Python data). The one way the
# tracker counts more is a storage it sees freed late: one held at the end only by a tensor made
# outside the dispatcher (autograd's unpacked saves) is counted until the next sweep, which the
# recorder does at each backward step; that lateness makes the budget stricter, never a fix's count.
# NOTE [ a bound on runs of copies ]: a block that ran out of memory may have been on its way to
# far more: a loop appending every step's loss (and graph) to a list stops at the budget or the
# device, and its step run again on a copy, with nothing to stop it, runs every iteration the loop
# has (1,000 iterations of a small MLP kept 20 GB on the CPU and ran past ten minutes). So the runs
# of copies of such a block are counted by the tracker with a budget of RUN_LIMIT_FACTOR times the
# block's peak or its budget, whichever is more (at least RUN_LIMIT_FLOOR): a run that goes over it
# stops there, as a run that failed on the copies (nothing shown from it); the allocator's counter
# counts but cannot stop a run. Only a step with a loop (a for or while statement) is bounded: a step
# without one holds, run again, what it held, once (the docs' GPT-2 step keeps the allocator's faster
# count). The bound is generous because the user's whole step must run for its
# results to be compared with a fix's: a step that failed at its tenth iteration of a hundred needs
# ten times the budget (tests/test_diagnose.py's gradient penalty through a frozen G).
RUN_LIMIT_FACTOR = 16
RUN_LIMIT_FLOOR = 256 << 20


class _TrackerCount:
    """A run's own allocations as the tracker counts them (on meta, or where the compiled hooks are
    not in use)."""

    name = "tracker"

    def __init__(self, device_type: str, limit: int | None = None) -> None:
        from gradscope._capture.memory.tracker import TrackerSource

        self.source = TrackerSource(device_type, limit)  # see NOTE [ a bound on runs of copies ]
        self.first = 0

    def start(self) -> None:
        self.source.start()

    def begin(self) -> None:
        self.source.sweep()
        self.first = len(self.source.events)

    def most(self) -> int:
        """The most the current run's own allocations held at once so far."""
        self.source.sweep()
        return _most_above(self.source.events[self.first:])

    def stop(self) -> None:
        self.source.stop()


class _AllocatorCount:
    """A run's own allocations as the CPU allocator reports them, counted by the allocator's counter
    of the compiled hooks (see NOTE [ the CPU allocator counts a run ]): a new one per start."""

    name = "allocator"

    def __init__(self) -> None:
        self.counter: Any = None

    def start(self) -> None:
        from gradscope._capture import native as _native

        self.counter = _native.counter(run=True)
        self.counter.start()

    def begin(self) -> None:
        self.counter.restart()

    def most(self) -> int:
        return int(self.counter.read()[1])

    def stop(self) -> None:
        counter, self.counter = self.counter, None
        if counter is not None:
            counter.stop()


def _counter(device: str) -> _TrackerCount | _AllocatorCount:
    """What counts a run of a copy on ``device`` (``"cpu"``: the allocator's counter where the compiled
    hooks are in use, else the tracker)."""
    if device == "cpu":
        from gradscope._capture import native as _native

        if _native.counter(run=True) is not None:
            return _AllocatorCount()
    return _TrackerCount(device if device == "cpu" else "cuda")


def _most_above(events: Any) -> int:
    """The most bytes a run of tracker events had allocated at once: its own allocations alive.
    Frees of what was allocated before it are not counted, as a budget run of the step does not
    see them (its tracker starts with the step)."""
    live = most = 0
    mine: set[int] = set()
    for e in events:
        if e.size > 0:
            mine.add(e.key)
        elif e.key not in mine:
            continue
        live += e.size
        most = max(most, live)
    return most


class _RandomState:
    """The random generators' states (PyTorch's CPU and CUDA ones, Python's ``random``, numpy's
    where it is loaded): every run on copies starts from the same ones, and the user's are put
    back after it (a diagnosis draws nothing from the user's program's streams)."""

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor] | None, py: Any, np_state: Any) -> None:
        self.cpu, self.cuda, self.py, self.np = cpu, cuda, py, np_state

    @staticmethod
    def now() -> _RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        np = sys.modules.get("numpy")
        return _RandomState(torch.get_rng_state(), cuda, random.getstate(),
                            np.random.get_state() if np is not None else None)

    @contextlib.contextmanager
    def used(self) -> Any:
        outside = _RandomState.now()
        self._set()
        try:
            yield
        finally:
            outside._set()

    def _set(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.py)
        np = sys.modules.get("numpy")
        if np is not None and self.np is not None:
            np.random.set_state(self.np)


# NOTE [ the user's functions as they are ]: a step calls the user's functions (``train_step``,
# ``inner_loss``) that read the user's objects through their module's globals or their closure; on
# the copies they must read the copies. Only such a function is rebuilt: its code, defaults,
# keyword-only defaults (``__kwdefaults__``), attributes and name kept, its globals a copy of its
# module's with the copies in, each closure cell that holds one of the user's objects (or such a
# function) a new cell holding its copy. Every other function, a library's above all
# (``torch.func.functional_call``), is passed as it is.
def _passed_as_is(v: Any) -> bool:
    return isinstance(v, types.ModuleType | types.FunctionType | types.BuiltinFunctionType | type | int
                      | float | str | bool | bytes | torch.dtype | torch.device) or v is None


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _global_reads(f: types.FunctionType, seen: set[int] | None = None) -> set[str]:
    """Names ``f`` reads from its globals, and those the functions it reads there read from theirs."""
    seen = seen if seen is not None else set()
    if id(f) in seen:
        return set()
    seen.add(id(f))
    names = _code_names(f.__code__) & set(f.__globals__)
    out = set(names)
    for n in names:
        g = f.__globals__.get(n)
        if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
            out |= _global_reads(g, seen)
    return out


def _closure_objects(f: types.FunctionType, seen: set[int] | None = None) -> list[Any]:
    """The objects ``f``'s closure cells hold (and those of the functions there), in order."""
    seen = seen if seen is not None else set()
    if id(f) in seen:
        return []
    seen.add(id(f))
    out: list[Any] = []
    for cell in f.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, types.FunctionType):
            out += _closure_objects(v, seen)
        else:
            out.append(v)
    for n in _code_names(f.__code__) & set(f.__globals__):
        g = f.__globals__.get(n)
        if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
            out += _closure_objects(g, seen)
    return out


class _Rebuilt:
    """The user's functions rebuilt to read the copies (see NOTE [ the user's functions as they are ])."""

    def __init__(self, twins: Mapping[int, Any]) -> None:
        self.twins = twins  # id(the user's object) -> its copy
        self.done: dict[int, types.FunctionType] = {}
        self.globals: dict[int, dict[str, Any]] = {}

    def needs(self, f: types.FunctionType, seen: set[int] | None = None) -> bool:
        seen = seen if seen is not None else set()
        if id(f) in seen:
            return False
        seen.add(id(f))
        g = f.__globals__
        for n in _code_names(f.__code__) & set(g):
            v = g[n]
            if id(v) in self.twins or (isinstance(v, types.FunctionType) and self.needs(v, seen)):
                return True
        for cell in f.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if id(v) in self.twins or (isinstance(v, types.FunctionType) and self.needs(v, seen)):
                return True
        return False

    def function(self, f: types.FunctionType) -> types.FunctionType:
        if id(f) in self.done:
            return self.done[id(f)]
        if not self.needs(f):
            return f
        g = self.globals.get(id(f.__globals__))
        if g is None:
            g = dict(f.__globals__)
            self.globals[id(f.__globals__)] = g
            for n, v in list(g.items()):
                if id(v) in self.twins:
                    g[n] = self.twins[id(v)]
        closure = None
        if f.__closure__ is not None:
            closure = tuple(self._cell(c) for c in f.__closure__)
        new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, closure)
        self.done[id(f)] = new
        new.__kwdefaults__ = dict(f.__kwdefaults__) if f.__kwdefaults__ is not None else None
        new.__qualname__ = f.__qualname__
        new.__module__ = f.__module__
        new.__doc__ = f.__doc__
        new.__annotations__ = dict(getattr(f, "__annotations__", {}) or {})
        new.__dict__.update(f.__dict__)
        for n, v in list(g.items()):  # the functions of that module that read the copies
            if isinstance(v, types.FunctionType) and v.__globals__ is f.__globals__ and v is not f:
                if self.needs(v):
                    g[n] = self.function(v)
        return new

    def _cell(self, cell: Any) -> Any:
        try:
            v = cell.cell_contents
        except ValueError:
            return cell
        if id(v) in self.twins:
            return types.CellType(self.twins[id(v)])
        if isinstance(v, types.FunctionType) and self.needs(v):
            return types.CellType(self.function(v))
        return cell


@contextlib.contextmanager
def quiet_logging() -> Any:
    """Libraries' log records (transformers: "use_cache=True is incompatible with gradient
    checkpointing") from runs on copies are not the user's: none reaches their output. Nothing to do
    inside another (a switch costs a walk over every logger: the diagnosis holds one around its runs)."""
    before = logging.root.manager.disable
    if before >= logging.CRITICAL:
        yield
        return
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)


def resident_bytes(values: Any) -> int:
    """Bytes of the distinct storages of the tensors reachable from ``values`` (modules' parameters,
    buffers and gradients, optimizers' state, tensors in containers)."""
    from gradscope._analyses.predict.copies import _collect_tensors

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


def _replica(objs: Mapping[str, Any], *, dropout: bool = True,
             tensors: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
    """A deep copy of the user's objects on their device, as the user has them (train/eval state,
    dropout); ``dropout=False``: with dropout off (see NOTE [ results where randomness allows ]).
    Tensors that are results of autograd (not leaves) are copied detached, as they cannot be
    deep-copied. ``tensors``: the objects' tensors by id, where they were collected already."""
    from gradscope._analyses.predict.copies import _collect_tensors, copied_schedulers

    if tensors is None:
        tensors = {}
        _collect_tensors(dict(objs), tensors, set())
    memo: dict[int, Any] = {}
    storages = collections.Counter(t.untyped_storage().data_ptr() for t in tensors.values() if t.layout == torch.strided)
    for i, t in tensors.items():
        if not t.is_leaf:
            memo[i] = t.detach().clone().requires_grad_(t.requires_grad)
        elif _clones_as_deepcopy(t, storages):  # (what deepcopy would make, without its Python per tensor)
            c = t.detach().clone()
            memo[i] = nn.Parameter(c, t.requires_grad) if type(t) is nn.Parameter else c.requires_grad_(t.requires_grad)
    _containers_ahead(objs, memo)
    out = copy.deepcopy(dict(objs), memo)
    copied_schedulers(dict(objs), memo)
    for i, t in tensors.items():  # a parameter's deep copy leaves its gradient behind: the copy has it too
        twin = memo.get(i)
        if isinstance(twin, torch.Tensor) and t.is_leaf and t.grad is not None and twin.grad is None:
            twin.grad = t.grad.detach().clone()
    if not dropout:
        for v in out.values():
            if isinstance(v, nn.Module):
                for m in v.modules():
                    if isinstance(m, nn.modules.dropout._DropoutNd):
                        m.p = 0.0
                    for k, a in list(vars(m).items()):
                        if "dropout" in k and isinstance(a, float):
                            setattr(m, k, 0.0)
    return out


# NOTE [ a module's containers copied ahead ]: ``copy.deepcopy`` of a module rebuilds each of its
# dicts (a dozen per module: parameters, buffers, submodules and every kind of hook) through its
# ``__reduce_ex__``, most of them empty: three quarters of the Python a copy of the docs' GPT-2 runs.
# A plain dict, ``OrderedDict`` or set of a module's attributes that is empty, or that holds only
# tensors already copied (``memo``) or None under names (its parameters, its buffers), is made here and put in
# deepcopy's memo, as deepcopy would make it: the same type, the copies in the same order. Anything
# else (a subclass, a container of other things) is left to deepcopy.
_PLAIN = (dict, collections.OrderedDict, set)


def _containers_ahead(objs: Mapping[str, Any], memo: dict[int, Any]) -> None:
    """See NOTE [ a module's containers copied ahead ]."""
    for v in objs.values():
        if not isinstance(v, nn.Module):
            continue
        for m in v.modules():
            for a in vars(m).values():
                if type(a) not in _PLAIN or id(a) in memo:
                    continue
                if not a:
                    memo[id(a)] = type(a)()
                elif isinstance(a, dict) and all(type(k) is str and (x is None or id(x) in memo)
                                                 for k, x in a.items()):
                    memo[id(a)] = type(a)((k, None if x is None else memo[id(x)]) for k, x in a.items())


def _clones_as_deepcopy(t: torch.Tensor, storages: Mapping[int, int]) -> bool:
    """Whether a leaf tensor's clone is what ``copy.deepcopy`` makes of it: a plain tensor or parameter,
    dense, no attributes of its own, alone on a storage it fills (deepcopy keeps storages shared; a
    clone would not)."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_quantized or t.is_meta:
        return False
    if t.__dict__ or t.is_conj() or t.is_neg() or t.storage_offset() != 0 or not t.is_contiguous():
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size():
        return False
    ptr = storage.data_ptr()
    return ptr != 0 and storages.get(ptr) == 1  # (``storages``: how many of the objects' tensors are on each)


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
        for i, (k, x) in enumerate(list(v.items())[:10_000]):
            # a key that is no plain value (a parameter: the optimizer in backward's ``opt_of``) by its place
            key = repr(k) if isinstance(k, str | int | float | bool | tuple) or k is None else f"<{type(k).__name__} {i}>"
            _tensors_of(f"{name}[{key}]", x, out, params)


def _results(env: Mapping[str, Any], names: set[str], *, clone: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the named variables hold (see ``_tensors_of``), detached: copies where the
    variables run on (``clone``), the tensors themselves where nothing runs in ``env`` again."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        flat: dict[str, torch.Tensor] = {}
        params: set[str] = set()
        _tensors_of(name, env[name], flat, params)
        # a result that carries a graph (a loss kept for a later backward) differs from one that does
        # not, whatever its value: the later backward would fail
        out[name] = {k + (_PARAM if k in params else _GRAPH if t.requires_grad else ""):
                     t.detach().clone() if clone else t.detach() for k, t in flat.items()}
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


def _marked(t: torch.Tensor) -> torch.Tensor:
    """Non-finite values as numbers that ``torch.equal`` compares: NaN 0, inf 1, -inf -1."""
    return t.nan_to_num(0.0, 1.0, -1.0)


def _difference(ta: Mapping[str, torch.Tensor], tb: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """Gradients the fix left freed (None) where the step kept them are not a difference: the fix
    applied them already (the finding says so through ``Trial.freed``). Each tensor's difference is its
    largest one relative to its largest value (parameters scaled, see NOTE [ parameters after an
    optimizer's step ]); NaN and inf are the same where both hold them at the same places."""
    if set(tb) - set(ta) or any(not k.endswith(".grad") for k in set(ta) - set(tb)):
        return math.inf, ", ".join(sorted(set(ta) ^ set(tb))[:3])
    found: list[tuple[str, float | None]] = []  # each tensor's difference (None: a float one, worked out below)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # the float ones' tensors, in order
    for k in ta:
        if k not in tb:
            continue
        x, y = ta[k].detach(), tb[k].detach()
        if x.dim() == 0 and y.dim() == 0 and x.is_floating_point() and y.is_floating_point():
            x, y = x.double(), y.double()  # a number and a 0-dim tensor of the same value are the same result
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf, k.removesuffix(_PARAM)
        if not x.is_floating_point():
            found.append((k, 0.0 if torch.equal(x, y) else math.inf))
        elif x.numel() == 0:
            found.append((k, 0.0))
        else:
            if x.dtype not in (torch.float32, torch.float64):
                x, y = x.float(), y.float()
            found.append((k, None))
            pairs.append((x, y))
    floats = iter(zip(pairs, _largest(pairs), strict=True))
    worst, where = 0.0, ""
    for k, d in found:
        if d is None:
            (x, y), (scale, most) = next(floats)
            if not (math.isfinite(scale) and math.isfinite(most)):  # NaN or inf: the same where both have them
                fx, fy = x.isfinite(), y.isfinite()
                if not torch.equal(fx, fy) or not torch.equal(_marked(x[~fx]), _marked(y[~fy])):
                    return math.inf, k.removesuffix(_PARAM)
                x, y = x.where(fx, 0.0), y.where(fy, 0.0)
                scale, most = torch.stack([x.abs().max(), (x - y).abs().max()]).double().tolist()
            d = most / scale if scale > 0 else most
            if k.endswith(_PARAM):
                d *= _TOLERANCE / PARAMETER_TOLERANCE  # see NOTE [ parameters after an optimizer's step ]
        if d > worst:
            worst, where = d, k.removesuffix(_PARAM)
    return worst, where


def _largest(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, float]]:
    """Each pair's largest absolute value of its first tensor and largest absolute difference: a few
    operators over all of them at once (the results of the docs' GPT-2 step hold some hundred tensors,
    and an operator or four for each cost a fifth of the step per comparison), else a pair at a time."""
    if not pairs:
        return []
    found = _compat.largest_differences([x for x, _ in pairs], [y for _, y in pairs])
    if found is not None:
        return found
    return [tuple(torch.stack([x.abs().max(), (x - y).abs().max()]).double().tolist())  # type: ignore[misc]
            for x, y in pairs]
