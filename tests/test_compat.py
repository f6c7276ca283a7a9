"""Each private PyTorch touchpoint in gradscope._base.compat, checked on a tiny tensor against what
PyTorch computes another way; each capability probe against the behaviour it stands for. Runs
on every supported torch (2.6 through 2.15): where a capability is absent, the test checks the
fallback the recorder relies on (a sentinel, a note), not a skip."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
import torch.autograd.graph as agg
from torch.utils.checkpoint import checkpoint

import gradscope as gs
from gradscope._base import compat as C

CAPS = C.capabilities()


# ----- sequence numbers ---------------------------------------------------------------------------
def test_sequence_numbers_name_the_node_made_next() -> None:
    assert CAPS.sequence_nr
    x = torch.ones(3, requires_grad=True)
    before = C.sequence_nr()
    y = x.exp()
    z = y.sin()
    assert y.grad_fn is not None and z.grad_fn is not None
    assert C.node_sequence_nr(y.grad_fn) == before and C.node_sequence_nr(z.grad_fn) == before + 1
    assert C.sequence_nr() == before + 2 == C.sequence_nr_fn()()
    assert C.node_seq(z.grad_fn) == before + 1
    acc = y.grad_fn.next_functions[0][0]
    assert type(acc).__name__ == "AccumulateGrad" and C.node_sequence_nr(acc) == C.ACC_SEQ == 2**64 - 1
    # a counter per thread: another thread's nodes do not move ours
    threading.Thread(target=lambda: [torch.ones(1, requires_grad=True).exp() for _ in range(5)]).start()
    assert C.sequence_nr() == before + 2


def test_current_node_is_the_one_running() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x.exp()
    seen: list[Any] = []
    y.register_hook(lambda g: seen.append(C.current_node()))
    assert C.current_node() is None
    y.sum().backward()
    # the hook of y runs as the engine is about to run y's node
    assert len(seen) == 1 and type(seen[0]).__name__ in ("SumBackward0", "ExpBackward0")


# ----- tensors and storages ---------------------------------------------------------------------
def test_version_view_and_storage_keys() -> None:
    t = torch.zeros(4)
    v0 = C.tensor_version(t)
    t.add_(1)
    assert C.tensor_version(t) == v0 + 1
    view = t[1:]
    assert C.is_view(view) and not C.is_view(t)
    assert C.storage_key(view) == C.storage_key(t) == int(C.storage_cdata(t.untyped_storage()))
    assert C.storage_key(torch.zeros(4)) != C.storage_key(t)
    assert C.storage_key(torch.ones(2).to_sparse()) is None  # no storage: no key


def test_storage_weak_references_expire_with_the_storage() -> None:
    t = torch.zeros(1000)
    ref = C.storage_weak_ref(t.untyped_storage())
    assert C.storage_weak(t.untyped_storage()) != 0
    assert not C.weak_ref_expired(ref)
    del t
    gc.collect()
    assert C.weak_ref_expired(ref)
    C.free_weak_ref(ref)


def test_zero_tensors_are_told_apart() -> None:
    assert not C.is_zero_tensor(torch.zeros(3))
    z = torch._efficientzerotensor(3)
    assert C.is_zero_tensor(z)


# ----- saved variables --------------------------------------------------------------------------
class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 + 0 * x


def test_saved_attributes_name_each_saved_tensor() -> None:
    a = torch.ones(3, requires_grad=True)
    b = torch.full((3,), 2.0, requires_grad=True)
    assert C.saved_tensor_attributes(a.exp().grad_fn) == (("_saved_result", "_raw_saved_result"),)
    assert C.saved_tensor_attributes((a * b).grad_fn) == (("_saved_other", "_raw_saved_other"),
                                                        ("_saved_self", "_raw_saved_self"))
    # scalars a node saves have no raw variable: not listed
    assert C.saved_tensor_attributes(a.pow(2.5).grad_fn) == (("_saved_self", "_raw_saved_self"),)
    assert C.saved_tensor_attributes(_Twice.apply(a).grad_fn) == (("saved_tensors", "_raw_saved_tensors"),)
    cat = torch.cat([a, b]).grad_fn
    assert cat is not None and C.saved_tensor_attributes(cat) == ()  # cat saves sizes only
    stack = torch.stack([a.exp(), b.exp()]).exp().grad_fn
    assert [r[0] for r in C.saved_tensor_attributes(stack)] == ["_saved_result"]


def test_raw_saved_reads_without_unpacking() -> None:
    unpacked = []
    x = torch.ones(3, requires_grad=True)
    with agg.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(1) or t):
        y = x.exp()
    fn = y.grad_fn
    raws = C.raw_saved(fn, "_raw_saved_result")
    assert len(raws) == 1 and unpacked == []
    assert C.raw_saved(fn, "_raw_saved_nothing") == []
    # a list of saved tensors (index_put's indices): one raw variable each
    out = torch.index_put(torch.zeros(3, 3), (torch.tensor([0, 1]), torch.tensor([2, 0])), x[:2])
    assert C.saved_tensor_attributes(out.grad_fn) == (("_saved_indices", "_raw_saved_indices"),)
    assert len(C.raw_saved(out.grad_fn, "_raw_saved_indices")) == 2
    assert unpacked == []


def test_packed_value_and_unpack_hook_or_the_sentinel() -> None:
    marker = object()
    x = torch.ones(3, requires_grad=True)

    def unpack(p: Any) -> torch.Tensor:
        return x.detach().exp()

    with agg.saved_tensors_hooks(lambda t: marker, unpack):
        y = x.exp()
    (raw,) = C.raw_saved(y.grad_fn, "_raw_saved_result")
    plain = C.raw_saved(x.sin().grad_fn, "_raw_saved_self")[0]
    if CAPS.saved_data:
        assert C.packed_value(raw) is marker
    else:
        assert C.packed_value(raw) is C.NOT_VISIBLE
    if CAPS.saved_hook:
        assert C.unpack_hook_of(raw) is unpack and C.unpack_hook_of(plain) is None
    else:
        assert C.unpack_hook_of(raw) is C.NOT_VISIBLE
        # the only question that torch answers: a second pair is refused
        assert C.probe_saved(raw, lambda t: t, lambda t: t) == "hooked"


def test_probe_saved_tells_hooked_plain_and_freed() -> None:
    x = torch.ones(3, requires_grad=True)
    with agg.saved_tensors_hooks(lambda t: t, lambda t: t):
        hooked = x.exp()
    plain = x.exp()
    packed: list[torch.Tensor] = []
    assert C.probe_saved(C.raw_saved(hooked.grad_fn, "_raw_saved_result")[0], lambda t: t, lambda t: t) == "hooked"
    raw = C.raw_saved(plain.grad_fn, "_raw_saved_result")[0]
    assert C.probe_saved(raw, lambda t: packed.append(t) or t, lambda t: t) == "registered"
    assert len(packed) == 1 and torch.equal(packed[0], plain.detach())
    # the pair registered behaves as none: the gradient is the plain one
    plain.sum().backward()
    assert torch.allclose(x.grad, x.detach().exp())
    freed = x.exp()
    raw2 = C.raw_saved(freed.grad_fn, "_raw_saved_result")[0]
    freed.sum().backward()
    assert C.probe_saved(raw2, lambda t: t, lambda t: t) in ("freed", "none")


# ----- the hook stack -----------------------------------------------------------------------------
def test_hook_stack_top_push_pop() -> None:
    if not CAPS.hook_stack:
        assert C.top_saved_tensors_hooks() is C.NOT_VISIBLE
        return
    assert C.top_saved_tensors_hooks() is None

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with agg.saved_tensors_hooks(pack, unpack):
        assert C.top_saved_tensors_hooks() == (pack, unpack)
        C.pop_saved_tensors_hooks()
        assert C.top_saved_tensors_hooks() is None
        C.push_saved_tensors_hooks(pack, unpack)
    assert C.top_saved_tensors_hooks() is None


def test_one_class_pushes_every_pair() -> None:
    """gradscope patches this class's __enter__ on torch <= 2.8 to see other pairs: save_on_cpu
    and non-reentrant checkpoint must go through it."""
    cls = C.hooks_class()
    entered: list[str] = []
    orig = cls.__enter__

    def spy(self: Any) -> Any:
        entered.append(type(self).__name__)
        return orig(self)

    cls.__enter__ = spy  # type: ignore[method-assign]
    try:
        x = torch.ones(3, requires_grad=True)
        with agg.save_on_cpu():
            x.exp()
        checkpoint(torch.exp, x, use_reentrant=False).sum().backward()
    finally:
        cls.__enter__ = orig  # type: ignore[method-assign]
    assert entered[0] == "save_on_cpu" and len(entered) >= 2
    mod = C.disable_hooks_module()
    assert mod is not None and callable(mod.disable_saved_tensors_hooks)


# ----- the engine's entry point -------------------------------------------------------------------
def test_engine_entry_point_and_its_arguments() -> None:
    mod = C.engine_entry_module()
    assert CAPS.engine_entry == (mod is not None)
    if mod is None:
        return
    calls: list[C.EngineCall] = []
    orig = getattr(mod, C.ENGINE_ENTRY)

    def spy(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(C.engine_call(args, kwargs))
        return orig(t_outputs, *args, **kwargs)

    setattr(mod, C.ENGINE_ENTRY, spy)
    try:
        x = torch.ones(3, requires_grad=True)
        w = torch.ones(3, requires_grad=True)
        (x * w).sum().backward(retain_graph=True)
        (g,) = torch.autograd.grad((x * w).sum(), [x], create_graph=True)
        (x * w).sum().backward(inputs=[w])
    finally:
        setattr(mod, C.ENGINE_ENTRY, orig)
    assert [(c.create_graph, c.retain_graph, c.accumulate_grad, len(c.inputs)) for c in calls] == [
        (False, True, True, 0), (True, True, False, 1), (False, False, True, 1)]
    assert calls[1].inputs[0] is x and calls[2].inputs[0] is w
    assert g.requires_grad


def test_engine_callback_runs_when_backward_ends() -> None:
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: (C.queue_engine_callback(lambda: order.append("callback")), order.append("hook"))[1])
    z = y.sin()
    z.register_hook(lambda g: order.append("first"))
    z.sum().backward()
    assert order == ["first", "hook", "callback"]


# ----- the profiler --------------------------------------------------------------------------------
def _flatten(roots: list[Any]) -> list[Any]:
    out, stack = [], list(roots)
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.children)
    return out


@pytest.mark.parametrize("ops", [False, True])
def test_lean_profiler_records_memory_nodes_and_user_scopes(ops: bool) -> None:
    assert not C.profiler_enabled()
    x = torch.ones(1000, requires_grad=True)
    C.start_node_profiler(ops=ops)
    try:
        assert C.profiler_enabled()
        h = C.record_scope_enter("gradscope-test-scope")
        y = x.exp()  # 4,000 bytes
        C.record_scope_exit(h)
        y.sum().backward()
    finally:
        results = C.stop_profiler()
    assert not C.profiler_enabled()
    events = _flatten(C.results_event_tree(results))
    allocs = [e for e in events if e.typed[0] == C.allocation_tag()]
    assert any(e.typed[1].alloc_size == 4000 for e in allocs)
    names = {e.name for e in events}
    assert "gradscope-test-scope" in names
    nodes = [e for e in events if e.typed[0] != C.allocation_tag() and e.typed[1].scope == C.node_scope()]
    assert {e.name.rsplit("::", 1)[-1] for e in nodes} >= {"ExpBackward0", "SumBackward0"}
    assert ("aten::exp" in names) == ops  # op scopes only when asked for
    if ops:  # with their inputs' shapes: x is 1,000 float32
        exp = next(e for e in events if e.name == "aten::exp")
        assert C.event_input_bytes(exp.typed[1]) == [x.numel() * x.element_size()] == [4000]


# ----- dispatch modes and compilers ---------------------------------------------------------------
def test_dispatch_modes_seen_and_set_aside() -> None:
    seen: list[str] = []

    class Spy(C.torch_dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    assert not C.dispatch_modes_active()
    with Spy():
        assert C.dispatch_modes_active()
        torch.ones(2).exp()
        n = len(seen)
        with C.no_dispatch_modes():
            torch.ones(2).exp()
        assert len(seen) == n
    assert C.has_ignore_compile_internals() == CAPS.ignore_compile_internals
    assert C.tree_leaves({"a": [1, (2, 3)], "b": 4}) == [1, 2, 3, 4]


def test_fake_tensors_and_compiling_are_told() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not C.is_fake(torch.ones(2)) and not C.is_fake(3)
    with FakeTensorMode():
        f = torch.ones(2)
    assert C.is_fake(f)
    assert C.is_compiling() is False
    flags: list[bool] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        flags.append(C.is_compiling())
        return t + 1

    torch._dynamo.reset()
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert flags and flags[0] is True


# ----- CUDA allocator and prediction helpers ---------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_history_has_the_keys_read() -> None:
    C.cuda_start_history(1000)
    t = torch.empty(1 << 20, device="cuda")
    del t
    snap = C.cuda_stop_history(torch.device("cuda"))
    traces = snap[C.SNAPSHOT_TRACES][torch.cuda.current_device()]
    allocs = [e for e in traces if e[C.TRACE_ACTION] == "alloc"]
    assert any(e[C.TRACE_SIZE] == 4 << 20 for e in allocs)
    assert all(C.TRACE_ADDR in e and C.TRACE_TIME_US in e for e in allocs)


def test_fused_attention_choice_and_dense_layouts() -> None:
    q = torch.randn(2, 4, 8, 16)
    choice = C.fused_sdp_choice(q, q, q, None, 0.0, False)
    assert choice is None or choice in (0, 1, 2, 3, 4)
    t = torch.zeros(4, 6)
    assert C.non_overlapping_and_dense(t) and C.non_overlapping_and_dense(t.t())
    assert not C.non_overlapping_and_dense(t[:, ::2])


# ----- node objects and capabilities -----------------------------------------------------------------
def test_nodes_persist_probe_matches_id_stability() -> None:
    x = torch.ones(1, requires_grad=True)
    y = x.exp()
    ida = id(y.grad_fn)
    decoys = [(x * float(i)).grad_fn for i in range(16)]
    assert (id(y.grad_fn) == ida) == CAPS.nodes_persist
    del decoys


def test_capabilities_are_probed_and_missing_ones_noted() -> None:
    assert all(isinstance(v, bool) for v in CAPS.__dict__.values())
    assert set(C.MISSING_NOTES) <= set(CAPS.__dict__)
    assert CAPS.hook_stack == (C.top_saved_tensors_hooks() is not C.NOT_VISIBLE)


def test_a_missing_sequence_counter_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    no_seq = C.Capabilities(**{**CAPS.__dict__, "sequence_nr": False})
    monkeypatch.setattr(C, "capabilities", lambda: no_seq)
    x = torch.ones(3, requires_grad=True)
    with gs.record(memory="off") as rec:
        x.exp().sum().backward()
    assert C.MISSING_NOTES["sequence_nr"] in rec.recording.notes
