"""The one module of the diagnosis that runs the user's code or model (on copies)."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import time
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradscope._analyses.diagnose.copies import (
    _TOLERANCE,
    _closure_objects,
    _compare,
    _dropouts,
    _global_reads,
    _passed_as_is,
    _Rebuilt,
    _replica,
    _results,
    quiet_logging,
    resident_bytes,
)
from gradscope._analyses.diagnose.counts import (
    RUN_LIMIT_FACTOR,
    RUN_LIMIT_FLOOR,
    _AllocatorCount,
    _counter,
    _RandomState,
    _TrackerCount,
)
from gradscope._analyses.diagnose.indexed import MIN_SAVING
from gradscope._analyses.diagnose.step import free_names, statements
from gradscope._base.errors import MemoryBudgetExceeded
from gradscope._model.recording import format_bytes

# NOTE [ nothing shown that was not run ]: a fix's code is shown only after it ran here, verbatim,
# on copies of the user's objects as the user runs them: the modules' train/eval state as it is,
# dropout on where the user has it on. Its memory is measured on meta copies (see NOTE [ counted as
# a budget counts ] in gradscope._analyses.predict.predictor: no data, the tracker's exact bytes, cheap next to a real
# run), or by runs of a CPU copy (see NOTE [ meta or a CPU copy ] and NOTE [ the CPU allocator counts a
# run ] in gradscope._analyses.diagnose.counts) where the step is small or meta cannot run it (code that reads values, ``.item()``; autocast,
# which casts only real tensors). Only a fix that is worth showing by its memory then runs for real,
# once, on a copy of the user's objects at full size (on CPU copies, the run that measured it), next to
# the user's own step (the block's source, see ``gradscope._base.source``) on another copy from the same
# state and the same random state (see NOTE [ results where randomness allows ]). Parameters, gradients,
# buffers (batch-norm statistics) and optimizer state must agree; variables that differ are named in
# the finding. The saving shown is the user's step's peak minus the fix's, both measured the same
# way from the objects as they are when the diagnosis runs.
# NOTE [ two runs of a step ]: a step's memory is measured twice in a row on the same copies: the
# first run from the state the block started with, the next with what the first left (optimizer
# state, gradients, the variables that still hold the last step's output). A peak counts the tensors
# held when the run starts plus the most the run allocates at once. The first run's peak is the
# step's (the saving claimed is the user's minus the fix's); the next run's keeps a fix that helps a
# first step but raises later ones from being shown, and a fix fits a budget only if both runs do.
# The results compared are those of the first run: an optimizer like Adam turns rounding
# differences of a second step into larger ones. Times compare first runs with first runs (each
# from the same state: an optimizer's first step makes its state).
# NOTE [ the user's step's next run ]: the user's step runs its next run only where something
# shown depends on it: where its first run fits the budget (whether it fits at all is then the
# question), and where a fix whose next run was measured does not fit the budget in both its runs,
# or there is no budget (``_raises_later`` in gradscope._analyses.diagnose then compares the two
# next runs; a fix that fits both is shown whatever the user's next run holds), or fails on copies
# (``_fails_again``: the user's own step may fail so). A step that ran out of memory in its first
# run, diagnosed under a budget, so runs once (its variables kept for a next run that may yet be
# wanted).
RUNS = 2
# NOTE [ meta or a CPU copy ]: meta counts a run's bytes exactly as the tracker counts them (see NOTE
# [ counted as a budget counts ] in gradscope._analyses.predict.predictor), a CPU copy at least as many (see NOTE [ the CPU
# allocator counts a run ] in gradscope._analyses.diagnose.counts). On meta no kernel computes, but every operator still passes the tracker
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
# (one real run of a step fewer). The user's step with dropout off runs once for every fix compared
# so; a fix not run with dropout on has as its time its run's over the user's with dropout off.
# NOTE [ one reference with dropout off ]: where the user's step and a fix were both measured on meta
# (a large step: see NOTE [ meta or a CPU copy ]) and the step's models hold dropout to turn off, the
# real runs are there only to compare results and times: memory was counted on meta, with dropout on,
# as the user runs it. Every such fix is then compared with dropout off at once, against one real run
# of the user's step with dropout off, and its time is its run's over that one's. The user's step is
# not also run with dropout on for the fixes that replay dropout's masks (checkpointing), which saves
# one real run of the step (GPT-2 6 x 384: four real runs where five ran, the step 5 s). What that
# gives up: such a fix's comparison with dropout on (the masks it replays). Where the run with dropout
# off still draws random numbers, the fix is compared as above.
COMPARED_PLAIN = "compared from the same state"  # the step draws no random numbers
COMPARED_ON = "compared with dropout as you have it, from the same random state"
COMPARED_OFF = ("compared with dropout off: with it on, the fix draws dropout's random masks in another order than "
                "your step")
COMPARED_OFF_ONCE = ("compared with dropout off: your step's memory was measured on meta, without running it, and "
                     "one real run of it with dropout off is what every fix is compared with")
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
# step's first run runs statement by statement (its next only where wanted: see NOTE [ the user's
# step's next run ]): what its first run allocates through each of its
# statements bounds a fix that runs those statements as they are (``Bench.least``): a fix whose set-up
# makes no tensor allocates there what the user's step allocates, until the first statement whose work
# the fix changes; the optimizer step in backward runs the backward call itself with at most the
# parameters' gradients less alive (it frees each once applied; the optimizer's state and temporaries it
# makes there only add). Where that bound alone keeps a fix from being shown, it is not run at all and a
# note gives the bound. GPT-2 of the docs, every fix tried (``alternatives=True``; by default the
# diagnosis stops at checkpointing, which fits: NOTE [ the first fix that fits ]): the optimizer step in backward, whose step allocates 6.3 MiB
# before its backward and could save at most the 532 KiB of gradients, is not run; micro-batches of 4 and
# checkpointing run twice each, the user's step once, and micro-batches' results compared with dropout
# off take two runs: seven runs of the step in all, each of them one that something shown needs (their
# memory on CPU copies: see NOTE [ meta or a CPU copy ]): 8.4 of the 10.3 step-times of a profiled
# diagnosis; the copies of the objects (see NOTE [ a module's containers copied ahead ] in gradscope._analyses.diagnose.copies), the results
# and their comparisons most of the rest.
# NOTE [ the first fix that fits ]: under a budget, the diagnosis stops at the first fix that fits it
# (run, compared and its next run measured, as above): the toolbox's fixes after it are not tried, and a
# note names them (``gs.diagnose(..., alternatives=True)`` tries them too). A pattern's fix (a forum
# thread's rewriting) does not stop the toolbox: a fix of the toolbox may cost less (a MAML loss summed
# over tasks: checkpointing each call of the model fits, and so does a backward in each iteration,
# which costs no time). The toolbox's order (``TOOLBOX`` in
# gradscope._analyses.diagnose.toolbox) puts first the fixes that change least and cost no time: forwards
# put under no_grad, a loop's backward per iteration, then checkpointing (a recomputed forward),
# micro-batches, the optimizer step in backward, set_to_none, and autocast (results change) last.
# Each fix shown costs two to four runs of the step (its first and next run, and with dropout off two more
# for micro-batches): the docs' GPT-2 example showed checkpointing and micro-batches, seven runs of the step
# in all, and shows checkpointing now, three runs (9.6x its step's time -> 4.8x: see benchmarks/RESULTS.md).
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
    # counter counted times as a plain run does (see NOTE [ the CPU allocator counts a run ] in gradscope._analyses.diagnose.counts)
    tracked: bool = False
    # ``state`` holds the tensors of variables that may run again (a first run's, kept for its next): they
    # are copied only before they do (``own``), which most never do (see NOTE [ results copied late ])
    shared: bool = False

    def own(self) -> None:
        """``state`` made of copies, before the variables it was read from run again."""
        if self.shared:
            for name, tensors in self.state.items():
                self.state[name] = {k: t.clone() for k, t in tensors.items()}
            self.shared = False


# NOTE [ results copied late ]: a first run on a CPU copy is also the run its results are compared
# from, and its variables are kept for its next run, which changes them in place (an optimizer's step).
# Its results are read as they are (detached, not copied) and copied only before its next run starts:
# a fix's results are compared before its next run (and let go once compared), and the user's step runs
# its next run only where it is wanted (see NOTE [ the user's step's next run ]). On the docs' GPT-2 example that leaves two
# copies of some hundred tensors out of every diagnosis.


@functools.lru_cache(maxsize=256)
def _compiled(code: str) -> types.CodeType:
    """A step's code compiled once for all its runs (code objects do not change)."""
    return compile(code, "<gradscope fix>", "exec")


# NOTE [ the bench is one piece ]: Bench is longer than a class should be (about 470 lines) and stays
# one piece: it holds the state every run of a diagnosis shares (the copies made as the block
# started, the user's step measured once, the fixes whose variables are kept for their next run,
# the random state every run starts from, the count of runs made) and decides run by run what the
# next one must be (NOTE [ runs a fix needs ]): a fix's memory, its results against the user's, its
# next run, each only where what came before allows it. What a run needs and is not that state
# lives beside it: the copies and the comparison in gradscope._analyses.diagnose.copies, the counting
# and the bound in gradscope._analyses.diagnose.counts. Split, each run would hand that state over.
class Bench:
    """The user's step and namespace, and the copies fixes run on (see NOTE [ nothing shown that
    was not run ])."""

    def __init__(self, source: str, namespace: Mapping[str, Any], device: str = "cpu", *,
                 fresh_optimizers: bool = False, fresh_gradients: bool = False,
                 progress: Any = None, step_allocated: int = 0,
                 room: Callable[[Trial], Room | None] | None = None, limit: int | None = None) -> None:
        self.source = source
        self.limit = limit  # see NOTE [ a bound on runs of copies ] in gradscope._analyses.diagnose.counts
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
        self._dropout_on: bool | None = None  # its models hold dropout to turn off (Bench._off_at_once)
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
        names no code can spell (see NOTE [ the user's functions as they are ] in gradscope._analyses.diagnose.copies). Worked out once
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
        runs there, else by runs of a CPU copy (see NOTE [ the CPU allocator counts a run ] in gradscope._analyses.diagnose.counts). Measured
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
        """What a run stopped by the bound says (see NOTE [ a bound on runs of copies ] in gradscope._analyses.diagnose.counts), or the
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
        pieces = [_compiled(t) for t in (parts.texts if parts is not None else (code,))]
        exec(_compiled(setup), env)
        rng = torch.get_rng_state()  # (a tensor of its own: taken before the run's count begins)
        held, peak, seconds, through = self._run_once(env, pieces, counter, split=parts is not None)
        if first_run is not None:
            first_run(seconds, rng)
        trial = Trial(peak=peak, resident=held, later_resident=held, seconds=seconds,
                      through=through if parts is not None else None)
        if self._complete:
            self._own((setup, code))
            later_held, later, _, _ = self._run_once(env, pieces, counter)
            return dataclasses.replace(trial, later=later, later_resident=later_held)
        if user or not self._hopeless(peak):
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
        """A step's variables after its first run, for its next: the user's step's, and at most KEPT
        fixes' (the oldest goes, and runs both again if it is wanted)."""
        self._pending[key] = pending
        fixes = [k for k in self._pending if k != ("", self.source)]
        while len(fixes) > KEPT:
            self._pending.pop(fixes.pop(0))

    def _continue(self, key: tuple[str, str], trial: Trial) -> Trial | None:
        """The next run of a fix whose variables were kept after its first; None where they were not."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return None
        self._own(key)
        from gradscope._analyses.predict.predictor import counted_on_meta

        counter = _TrackerCount("meta") if pending.meta else self._counter()
        with self._quiet(), (torch.random.fork_rng(devices=[]) if pending.meta else pending.random.used()):
            counter.start()
            try:
                with (counted_on_meta(self.device, counter.source) if isinstance(counter, _TrackerCount)
                      and pending.meta else contextlib.nullcontext()):
                    held, later, _, _ = self._run_once(pending.env, pending.pieces, counter)
            finally:
                counter.stop()
        return dataclasses.replace(trial, later=later, later_resident=held)

    def _own(self, key: tuple[str, str]) -> None:
        """The results of a first run copied before its variables run again (see NOTE [ results copied late ])."""
        real = self._reals.get(key)
        if real is not None:
            real.own()

    def close(self) -> None:
        """Let go of the variables kept for next runs."""
        self._pending.clear()

    def _counter(self) -> _TrackerCount | _AllocatorCount:
        """What counts the runs of CPU copies, decided once (``counted_by``): every run of a diagnosis
        is counted the same way. A step that starts PyTorch's profiler is counted by the tracker: the
        profiler needs the thread's profiler slot, where the allocator's counter sits while it counts."""
        if not self.counted_by:
            bounded = "profil" in self.source or self.limit is not None  # see NOTE [ a bound on runs of copies ] in gradscope._analyses.diagnose.counts
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
        CPU allocator counts a run ] in gradscope._analyses.diagnose.counts). Its first run is also the real run its results are compared
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
            state = _results(env, set(copies) | {k for k in set(env) - before if not k.startswith("_")}, clone=False)
            self._reals[(setup, code)] = _Real(state, seconds, drew, tracked=counter.name == "tracker", shared=True)

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
        compiled = _compiled(code)
        copied, kept = self._split(setup + code)
        with self._quiet():
            copies = _replica(copied, dropout=dropout, tensors=self._tensors(copied))
        self._as_at_start(copies)
        env = self._env(kept, copied, copies)
        before = set(env)
        with self._quiet(), self.random_state.used():
            exec(_compiled(setup), env)
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
            if self.room is not None and self.room.fits_first(int(self._user.peak or 0)):
                self._user = self.complete(self._user)  # whether it fits: both runs (see Room.fits)
        # (measured on meta: its time is that of a real run; where only its run with dropout off ran
        # for real, that one's: see NOTE [ one reference with dropout off ])
        ref = self._real.get(True) or (self._real.get(False) if True not in self._real else None)
        if ref is not None and self._user.seconds is None:
            self._user = dataclasses.replace(self._user, seconds=ref.seconds)
        return self._user

    def user_complete(self) -> Trial:
        """The user's step with its next run measured too (see NOTE [ the user's step's next run ])."""
        user = self.user()
        if not user.complete:
            user = self._user = self.complete(user)
        return user

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
        objects = set(self._split(self.source)[0])
        if self._off_at_once(trial):
            done = self._compared_off(trial, objects, None)
            if done is not None:
                return done if trial.reorders else dataclasses.replace(done, compared=COMPARED_OFF_ONCE)
        ref = self.reference()
        if ref is None:
            return dataclasses.replace(trial, verified=True)
        if trial.reorders and ref.drew:
            done = self._compared_off(trial, objects, ref)
            if done is not None:
                return done
        try:
            mine = self._real_run(trial)
        except Exception as e:  # the code fails on the copies: it is not shown
            return dataclasses.replace(trial, error=f"{type(e).__name__}: {e}", verified=True)
        worst, where, differs, freed = _compare(ref.state, mine.state, objects)
        if (trial.setup, trial.code) != ("", self.source):  # compared: its results are not read again (see
            self._reals.pop((trial.setup, trial.code), None)  # NOTE [ results copied late ])
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

    def _off_at_once(self, trial: Trial) -> bool:
        """Whether ``trial`` is compared with dropout off before any run with it on (see NOTE [ one
        reference with dropout off ]): the user's step and the fix were measured on meta, the user's
        step has not run for real with dropout on, and its models hold dropout to turn off."""
        if trial.how != "meta" or self._user is None or self._user.how != "meta" or self._real.get(True):
            return False
        if self._dropout_on is None:
            copied, _ = self._split(self.source)
            self._dropout_on = any(m.training and getattr(m, k) > 0 for m, k in _dropouts(copied))
        return self._dropout_on

    def _compared_off(self, trial: Trial, objects: set[str], ref: _Real | None,
                      seconds: float | None = None) -> Trial | None:
        """``trial`` compared with the user's step with dropout off, both run again so (the user's
        run once for every fix compared so); None where either fails or still draws random numbers.
        Its ``seconds``, where it was not run with dropout on (its memory measured on meta): the user's
        step's times the fix's over the user's step's with dropout off; without a run of the user's step
        with dropout on (``ref`` None), the fix's with dropout off, the user's step's time being its run's
        with dropout off (:meth:`user`)."""
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
        if ref is None:
            seconds = seconds or trial.seconds or mine.seconds
        else:
            seconds = seconds or trial.seconds or (mine.seconds * ref.seconds / off.seconds if off.seconds > 0 else None)
        return dataclasses.replace(trial, same=worst <= trial.tolerance, worst=worst, worst_at=where, differs=differs,
                                   freed=freed, seconds=seconds, compared=COMPARED_OFF, verified=True)

    @contextlib.contextmanager
    def _quiet(self) -> Any:
        with warnings.catch_warnings(), quiet_logging():
            warnings.simplefilter("ignore")
            yield
