"""``gs.predict_job``: each rank's peak of a ``torch.distributed`` job under DDP or FSDP, predicted
on meta (see NOTE [ what predict_job models ])."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradscope._base import compat as _compat
from gradscope._base import registry as _views
from gradscope._base.errors import GradscopeError
from gradscope._model.job import Job, RankEntry, RankStatus
from gradscope._model.recording import Recording

__all__ = ["JobPrediction", "RankPrediction", "predict_job"]


# ----------------------------------------------------------------------------------------------
# predict_job: each rank's peak under DDP or FSDP, on meta
# ----------------------------------------------------------------------------------------------
# NOTE [ what predict_job models ]: each rank runs the user's step on meta copies (no data, no
# process group) under the public ``gs.predict``, so its tensor bytes are exact; what the
# strategy adds is modelled around that run:
# - "ddp": every rank holds the whole model, its gradients and optimizer state. DDP's gradient
#   buckets (flat buffers as large as the gradients, made when DDP wraps the model) are resident;
#   its all-reduce works in place on them, so the step itself allocates what the local step does.
# - "fsdp" (FSDP2's ``fully_shard`` on each of ``units`` and on the root, full sharding): resident
#   are each rank's padded shards of the parameters (dim 0 split in world_size, padded to equal
#   sizes), the optimizer state of its shards (the unpadded chunk it owns), no unsharded
#   gradients. Around the step, hooks on the meta copy allocate and free what fully_shard does, in
#   its order: before a unit's forward, the all-gather (copy-in buffer of the shard, output buffer
#   of the whole unit, unsharded parameters copied out of it); after its forward the unsharded
#   parameters are freed (not the root's); before its backward, the all-gather again, and the
#   previous unit's prefetched; after its gradients are computed the unit reshards, frees the
#   previous unit's reduce-scatter input, allocates its own (the whole unit) and the sharded
#   gradients (a 1/world_size slice, viewed as each parameter's ``.grad``), and frees the
#   unsharded gradients. The optimizer runs on the shards.
# What it cannot see: communication buffers inside the backend (gloo's temporaries, NCCL's own
# memory), DDP's bucket rebuild at the start of the second iteration (that step allocates new
# buckets: the gradients' bytes once more; measured +405,544 B on a 101,386-parameter MLP), FSDP's all-gathers that overlap other work
# on GPU streams (everything here is in program order, as on CPU), mixed precision and CPU
# offload policies, gradient clipping across shards, and kernel workspaces (see gs.predict).
_STRATEGIES = ("ddp", "fsdp")


@dataclasses.dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted step.

    Attributes:
        rank: the rank.
        peak_bytes: the most bytes the step allocates above what exists before it (what
            ``gs.record`` reports as ``peak_bytes``), exact for the modelled tensors.
        resident_bytes: what the rank holds before the step: parameters (shards for FSDP),
            buffers, optimizer state, gradients left from before, the batch, DDP's buckets.
        prediction: the full :class:`~gradscope.predict.Prediction` (a Recording) of the meta run.
    """

    rank: int
    peak_bytes: int
    resident_bytes: int
    prediction: Recording

    @property
    def total_bytes(self) -> int:
        """``resident_bytes + peak_bytes``: the rank's memory at the step's peak."""
        return self.resident_bytes + self.peak_bytes


@dataclasses.dataclass(frozen=True)
class JobPrediction:
    """Per-rank predictions of one training step of a job (see :func:`predict_job`)."""

    strategy: str
    world_size: int
    ranks: tuple[RankPrediction, ...]
    budget: int | None
    notes: tuple[str, ...]

    @property
    def fits(self) -> tuple[bool, ...] | None:
        """Per rank, whether resident + peak bytes fit ``budget`` (None without a budget)."""
        if self.budget is None:
            return None
        return tuple(r.total_bytes <= self.budget for r in self.ranks)

    @property
    def job(self) -> Job:
        """The predictions as a :class:`~gradscope.job.Job`, for the job view and its imbalance."""
        return Job(
            tuple(RankEntry(r.rank, RankStatus.COMPLETE, r.prediction, "", "predicted") for r in self.ranks),
            label=f"predicted {self.strategy} x{self.world_size}",
            notes=self.notes,
        )

    def summary(self) -> str:
        """The per-rank predictions as text (its view: ``gradscope._views.job_text``)."""
        return str(_views.render(_views.ViewKind.TEXT, self))

    def __repr__(self) -> str:
        peaks = ", ".join(str(r.peak_bytes) for r in self.ranks)
        return f"JobPrediction({self.strategy} x{self.world_size}: peak_bytes=[{peaks}])"


def predict_job(
    step: Callable[..., Any],
    model: torch.nn.Module,
    batches: Any,
    *,
    world_size: int | None = None,
    strategy: str = "ddp",
    optimizer: Any = None,
    units: Sequence[torch.nn.Module | str] | None = None,
    device: str = "cpu",
    budget: int | str | None = None,
    steady: bool = True,
    label: str = "",
) -> JobPrediction:
    """Predict each rank's peak for one training step of a DDP or FSDP job, on the meta device
    (no data, no GPU, no process group; the model, batches and optimizer are never touched).

    Args:
        step: ``step(model, batch)``, or ``step(model, batch, optimizer)`` when ``optimizer`` is
            given: forward, backward, and the optimizer step if you like, written as for one rank.
        model: the model before ``DistributedDataParallel`` / ``fully_shard`` (a DDP wrapper is
            unwrapped; it may live on the meta device).
        batches: a list with each rank's batch (a tensor, or a tuple/dict the step unpacks); or
            one batch, not in a list, used on every rank (then pass ``world_size``).
        world_size: number of ranks (default: ``len(batches)``).
        strategy: ``"ddp"`` (replicas) or ``"fsdp"`` (full sharding of parameters, gradients and
            optimizer state, as ``fully_shard`` on each of ``units`` and on the root). Both are
            modelled on meta, so both predict on every supported torch, 2.6 included, although
            PyTorch's own FSDP2 runs on CPU (gloo) only from torch 2.7.
        optimizer: an optimizer of ``model`` (rebuilt with its class and hyperparameters over each
            rank's parameters or shards) or a function ``params -> optimizer``.
        units: for FSDP, the submodules (or their dotted names) you pass to ``fully_shard`` before
            the root; default: the root alone.
        device: ``"cpu"`` or ``"cuda"``: which kernels attention and dropout take (see gs.predict).
        budget: each rank's device size (``"24GiB"`` or bytes): ``JobPrediction.fits`` compares
            resident + peak bytes with it.
        steady: run the step once before the predicted one, so that optimizer state exists
            (the recurring step); False predicts the first step. DDP rebuilds its buckets at the
            start of the second iteration, so a recording of iteration 2 allocates the gradients'
            bytes once more than this predicts; iteration 3 on matches.
        label: a name for the prediction.

    Returns:
        A :class:`JobPrediction`: per rank ``peak_bytes``, ``resident_bytes``, ``total_bytes`` and
        the meta recording; ``.job`` for the job view; ``notes`` on what it cannot see.

    Raises:
        GradscopeError: an unknown strategy, batches that do not match the world size, a model
            already sharded, units that are not submodules, or a step that cannot run on meta.

    Example:
        >>> import torch, gradscope as gs
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        >>> def step(model, batch, opt):
        ...     model(batch).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> adam = lambda params: torch.optim.Adam(params, lr=1e-3)
        >>> p = gs.predict_job(step, net, [torch.randn(32, 64), torch.randn(64, 64)], strategy="fsdp",
        ...                    units=[net[0], net[2]], optimizer=adam)
        >>> [r.peak_bytes for r in p.ranks], [r.resident_bytes for r in p.ranks]
        ([178232, 275512], [120384, 128576])
    """
    if strategy not in _STRATEGIES:
        raise GradscopeError(f"gradscope: predict_job(strategy={strategy!r}): use 'ddp' or 'fsdp'.")
    if not callable(step):
        raise GradscopeError("gradscope: predict_job's first argument must be the step function.")
    model = _unwrap(model)
    per_rank = _per_rank(batches, world_size)
    world = len(per_rank)
    if units is not None and strategy != "fsdp":
        raise GradscopeError("gradscope: predict_job(units=...) is for strategy='fsdp'.")
    from gradscope._base.units import parse_size

    cap = parse_size(budget)
    cache: dict[Any, RankPrediction] = {}
    out = []
    for rank, b in enumerate(per_rank):
        key = (_signature(b), _chunk_key(model, world, rank) if strategy == "fsdp" else None)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = _predict_rank(step, model, b, strategy, world, rank, optimizer, units,
                                             device, steady, label)
        rec = dataclasses.replace(hit.prediction, label=f"{label or 'predicted'} rank {rank}",
                                  where=dataclasses.replace(hit.prediction.where, rank=rank, world_size=world))
        out.append(RankPrediction(rank, hit.peak_bytes, hit.resident_bytes, rec))
    notes = (
        "predicted on the meta device: tensor bytes are exact for the step; the strategy's buffers are "
        "modelled (see NOTE [ what predict_job models ]).",
        "not seen: buffers inside the communication backend (gloo temporaries, NCCL's own memory), "
        + ("DDP's bucket rebuild in the second iteration (+ the gradients' bytes, once)" if strategy == "ddp" else
           "all-gathers overlapping compute on GPU streams (modelled in program order), mixed precision, "
           "CPU offload, gradient clipping across shards")
        + ", and kernel workspaces.",
    )
    return JobPrediction(strategy, world, tuple(out), cap, notes)


def _unwrap(model: Any) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ == "DistributedDataParallel":
        model = inner
    if not isinstance(model, torch.nn.Module):
        raise GradscopeError(f"gradscope: predict_job takes the model (an nn.Module), not a {type(model).__name__}.")
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            raise GradscopeError(
                f"gradscope: predict_job: parameter {name!r} is already sharded (a DTensor); pass the model "
                "before fully_shard (it may be built on the meta device: with torch.device('meta'): ...)."
            )
    return model


def _per_rank(batches: Any, world_size: int | None) -> list[Any]:
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise GradscopeError(f"gradscope: predict_job(world_size={world_size!r}): give a positive int.")
    if isinstance(batches, list):
        if not batches:
            raise GradscopeError("gradscope: predict_job got an empty list of batches.")
        if world_size is not None and world_size != len(batches):
            raise GradscopeError(
                f"gradscope: predict_job got {len(batches)} batches for world_size={world_size}: give one "
                "batch per rank, or one batch (not in a list) for every rank."
            )
        return list(batches)
    if world_size is None:
        raise GradscopeError(
            "gradscope: predict_job got one batch: pass world_size= to use it on every rank, or a list "
            "with each rank's batch."
        )
    return [batches] * world_size


def _signature(obj: Any) -> Any:
    """What a prediction depends on in a batch: shapes, dtypes and requires_grad of its tensors."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), str(obj.dtype), obj.requires_grad)
    if isinstance(obj, dict):
        return ("D", tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return ("L", type(obj).__name__, tuple(_signature(v) for v in obj))
    return ("O", id(obj))


def _chunk_key(model: torch.nn.Module, world: int, rank: int) -> tuple[int, ...]:
    """Ranks whose parameter chunks have the same sizes share a prediction."""
    return tuple(_chunk_rows(p.shape[0] if p.dim() else 1, world, rank) for p in model.parameters())


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that rank owns under ``torch.chunk`` (what FSDP2's sharding uses)."""
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


def _predict_rank(step: Callable[..., Any], model: torch.nn.Module, batch: Any, strategy: str, world: int,
                  rank: int, optimizer: Any, units: Sequence[Any] | None, device: str, steady: bool,
                  label: str) -> RankPrediction:
    from gradscope._analyses.predict.predictor import predict

    meta_model, twins = _meta_copy(model)
    meta_batch = _meta_batch(batch)
    sim = _FsdpSim(meta_model, _units(meta_model, model, units), world, rank) if strategy == "fsdp" else None
    try:
        opt_params = twins if sim is None else {i: sim.shard_of[id(m)] for i, m in twins.items()}
        opt = _optimizer(optimizer, model, meta_model, opt_params)
        args = (meta_model, meta_batch) if opt is None else (meta_model, meta_batch, opt)
        if steady:
            from gradscope._analyses.predict.on_meta import _optimizer_steps_on

            outside = torch.get_default_device()
            try:
                # see NOTE [ optimizer steps keep the default device ] in gradscope._analyses.predict.on_meta
                with torch.device("meta"), _optimizer_steps_on(outside):
                    step(*args)
            except Exception as e:
                raise GradscopeError(
                    f"gradscope: predict_job: the step could not run on meta tensors ({type(e).__name__}: {e}). "
                    "Code that reads values (.item(), printing tensors, data-dependent shapes) cannot be "
                    "predicted; move it out of the step."
                ) from e
        resident = _resident(meta_model, meta_batch, opt, sim)
        if strategy == "ddp":
            resident += sum(p.numel() * p.element_size() for p in meta_model.parameters() if p.requires_grad)
        pred = predict(lambda: step(*args), device=device, label=label or f"rank {rank}")
    finally:
        if sim is not None:
            sim.remove()
    extra = dict(pred.extra)
    extra["predict_job"] = {"strategy": strategy, "world_size": world, "rank": rank, "resident_bytes": resident}
    rec = dataclasses.replace(pred, baseline_bytes=resident, extra=extra)
    return RankPrediction(rank, pred.peak_bytes, resident, rec)


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(m, requires_grad=t.requires_grad)
    return m.requires_grad_(t.requires_grad) if t.is_leaf else m


def _meta_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, torch.Tensor]]:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are empty meta tensors
    (``copy.deepcopy`` with a memo that already holds every tensor's twin: no data is copied).
    Returns the copy and ``id(original parameter) -> meta parameter``."""
    import copy

    memo: dict[int, Any] = {}
    params: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values(),
                  *(v for v in vars(m).values() if isinstance(v, torch.Tensor))):
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = _meta_twin(t)
                if isinstance(t, torch.nn.Parameter):
                    params[id(t)] = memo[id(t)]
                if t.grad is not None:
                    memo[id(t)].grad = _meta_twin(t.grad)
    try:
        return copy.deepcopy(model, memo), params
    except Exception as e:
        raise GradscopeError(
            f"gradscope: predict_job could not copy the model to the meta device ({type(e).__name__}: {e})."
        ) from e


def _meta_batch(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _meta_twin(obj.detach()).requires_grad_(obj.requires_grad)
    if isinstance(obj, dict):
        return type(obj)({k: _meta_batch(v) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_meta_batch(v) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_meta_batch(v) for v in obj)
    return obj


def _units(meta_model: torch.nn.Module, model: torch.nn.Module, units: Sequence[Any] | None) -> list[torch.nn.Module]:
    """The meta copies of ``units`` (given as modules of ``model`` or dotted names), root last."""
    names = {id(m): n for n, m in model.named_modules()}
    meta = dict(meta_model.named_modules())
    out: list[torch.nn.Module] = []
    for u in units or ():
        name = u if isinstance(u, str) else names.get(id(u))
        if name is None or name not in meta:
            raise GradscopeError(
                f"gradscope: predict_job(units=...): {u if isinstance(u, str) else type(u).__name__!r} is not a "
                "submodule of the model; pass the modules (or dotted names) you give fully_shard."
            )
        if meta[name] is not meta_model and meta[name] not in out:
            out.append(meta[name])
    return [*out, meta_model]


def _optimizer(spec: Any, model: torch.nn.Module, meta_model: torch.nn.Module,
               params: dict[int, torch.Tensor]) -> Any:
    if spec is None:
        return None
    if isinstance(spec, torch.optim.Optimizer):
        groups = []
        for g in spec.param_groups:
            try:
                mapped = [params[id(p)] for p in g["params"]]
            except KeyError:
                raise GradscopeError(
                    "gradscope: predict_job(optimizer=...): the optimizer holds tensors that are not the "
                    "model's parameters; pass a function params -> optimizer instead."
                ) from None
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mapped})
        return type(spec)(groups, **spec.defaults)
    if callable(spec):
        ordered = [params[id(p)] for p in model.parameters() if id(p) in params]
        return spec(ordered)
    raise GradscopeError(
        f"gradscope: predict_job(optimizer=...) takes an optimizer or a function params -> optimizer, not "
        f"{type(spec).__name__}."
    )


def _resident(meta_model: torch.nn.Module, batch: Any, opt: Any, sim: _FsdpSim | None) -> int:
    """Bytes of each distinct storage the rank holds before the step."""
    tensors: list[torch.Tensor] = []
    if sim is None:
        tensors.extend(meta_model.parameters())
    else:
        tensors.extend(sim.shard_of.values())
    tensors.extend(t.grad for t in list(tensors) if t.grad is not None)
    tensors.extend(meta_model.buffers())
    tensors.extend(_tensors(batch))
    if opt is not None:
        for st in opt.state.values():
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    seen: dict[int, int] = {}
    for t in tensors:
        key = _compat.storage_key(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Unit:
    __slots__ = ("module", "params", "padded", "unsharded", "order", "started", "pending", "done", "root")

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], world: int, root: bool) -> None:
        self.module = module
        self.params = params
        self.padded = sum(_padded_numel(p, world) * p.element_size() for p in params)  # bytes, whole unit
        self.unsharded: torch.Tensor | None = None
        self.order: list[int] = []
        self.started = False
        self.pending: set[int] = set()
        self.done = False
        self.root = root


def _padded_numel(p: torch.Tensor, world: int) -> int:
    rows = p.shape[0] if p.dim() else 1
    rest = p.numel() // rows if rows else 0
    return -(-rows // world) * world * rest


class _FsdpSim:
    """See NOTE [ what predict_job models ]: fully_shard's allocations around a meta step."""

    def __init__(self, root: torch.nn.Module, units: list[torch.nn.Module], world: int, rank: int) -> None:
        self.world = world
        owned: set[int] = set()
        self.units: list[_Unit] = []
        for m in units:  # innermost first: a unit owns the parameters no unit inside it owns
            params = [p for p in m.parameters() if id(p) not in owned]
            owned.update(id(p) for p in params)
            self.units.append(_Unit(m, params, world, m is root))
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.shard_of: dict[int, torch.Tensor] = {}
        for u in self.units:
            for p in u.params:
                self.shard_of[id(p)] = self._shard(p, rank)
        self.post_forward_order: list[_Unit] = []
        self.rs_pending: torch.Tensor | None = None
        self.callback_queued = False
        self.handles: list[Any] = []
        for u in self.units:
            self.handles.append(u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u)))
            self.handles.append(u.module.register_forward_hook(lambda m, a, o, u=u: self._post_forward(u, o)))
        for u in self.units:
            for param in u.params:
                if param.requires_grad:
                    self.handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def _shard(self, p: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's shard: a padded storage (what fully_shard keeps), viewed as the rows it owns
        (what the optimizer's state is shaped like)."""
        rows = p.shape[0] if p.dim() else 1
        rest = tuple(p.shape[1:]) if p.dim() else ()
        per = -(-rows // self.world)
        storage = torch.empty((per, *rest), dtype=p.dtype, device="meta")
        own = _chunk_rows(rows, self.world, rank)
        shard = storage.narrow(0, 0, own) if own < per else storage
        return torch.nn.Parameter(shard, requires_grad=p.requires_grad)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- forward -------------------------------------------------------------------------------
    def _unshard(self, u: _Unit) -> None:
        if u.unsharded is not None or not u.padded:
            return
        copy_in = torch.empty(u.padded // self.world, dtype=torch.uint8, device="meta")  # the shard, flattened
        gathered = torch.empty(u.padded, dtype=torch.uint8, device="meta")  # all-gather output
        del copy_in
        u.unsharded = torch.empty(u.padded, dtype=torch.uint8, device="meta")  # parameters copied out of it
        del gathered

    def _pre_forward(self, u: _Unit) -> None:
        if u.root:  # a new iteration
            self.post_forward_order.clear()
            for v in self.units:
                v.done = v.started = False
                v.order.clear()
        self._unshard(u)

    def _post_forward(self, u: _Unit, output: Any) -> Any:
        if not u.root:
            u.unsharded = None  # reshard after forward (the root keeps its parameters)
        u.order.append(len(self.post_forward_order))
        self.post_forward_order.append(u)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(lambda g, u=u: self._pre_backward(u))
        return None

    # -- backward ------------------------------------------------------------------------------
    def _pre_backward(self, u: _Unit) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            _compat.queue_engine_callback(self._final)
        if u.started:
            return
        u.started = True
        u.pending = {id(p) for p in u.params if p.requires_grad}
        self._unshard(u)
        if u.order:
            index = u.order.pop()
            if index > 0:  # fully_shard's implicit backward prefetch: the unit before it
                self._unshard(self.post_forward_order[index - 1])

    def _grad_ready(self, p: torch.Tensor) -> None:
        u = self.unit_of[id(p)]
        if not u.started:
            u.started = True
            u.pending = {id(q) for q in u.params if q.requires_grad}
        u.pending.discard(id(p))
        if not u.pending:
            self._post_backward(u)

    def _post_backward(self, u: _Unit) -> None:
        if u.done:
            return
        u.done = True
        grads = [(p, p.grad) for p in u.params if p.grad is not None]
        u.unsharded = None  # reshard after backward
        self.rs_pending = None  # the previous unit's reduce-scatter input (one kept in flight)
        if not grads:
            return
        rs_input = torch.empty(u.padded, dtype=torch.uint8, device="meta")  # the unsharded gradients copied in
        sizes: dict[torch.dtype, int] = {}
        for p, _ in grads:
            p.grad = None
            sizes[p.dtype] = sizes.get(p.dtype, 0) + _padded_numel(p, self.world) // self.world
        grads.clear()  # the unsharded gradients are freed
        outputs = {dt: torch.empty(n, dtype=dt, device="meta") for dt, n in sizes.items()}  # reduce-scatter output
        offsets = dict.fromkeys(outputs, 0)
        for p in u.params:
            shard = self.shard_of[id(p)]
            if not p.requires_grad:
                continue
            dt = p.dtype
            offset = offsets[dt]
            view = torch.as_strided(outputs[dt], tuple(shard.shape), _contiguous_strides(shard.shape), offset)
            offsets[dt] = offset + _padded_numel(p, self.world) // self.world
            if shard.grad is None:
                shard.grad = view
            else:
                shard.grad.add_(view)
        del outputs
        self.rs_pending = rs_input

    def _final(self) -> None:
        self.callback_queued = False
        for u in self.units:
            if u.started and not u.done:
                self._post_backward(u)
        self.rs_pending = None
        for u in self.units:
            u.unsharded = None
            u.started = False


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
    return out
