"""gs.predict: meta-device runs against real CPU runs, the allocator model, budgets and batch sizes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gradscope as gs
from gradscope.predict import Prediction, estimate_cuda_allocator

MiB = 1024 * 1024


def _sq(model, x):  # type: ignore[no-untyped-def]
    model(x).square().mean().backward()


def _ce(model, x):  # type: ignore[no-untyped-def]
    F.cross_entropy(model(x), torch.arange(x.shape[0]) % 10).backward()


def _lse(model, x):  # type: ignore[no-untyped-def]
    model(x).logsumexp(-1).mean().backward()


class _HandAttention(nn.Module):
    """Attention written out: q k^T, softmax, @ v (no Python-scalar scaling: see test below)."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.attn = _HandAttention(d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(self.norm(x))


def _models() -> dict[str, tuple[nn.Module, torch.Tensor, object]]:
    torch.manual_seed(0)
    return {
        "linear-relu": (
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
            torch.randn(32, 64),
            _sq,
        ),
        "cross-entropy": (
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
            torch.randn(32, 64),
            _ce,
        ),
        "logsumexp": (
            nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)),
            torch.randn(32, 64),
            _lse,
        ),
        "layernorm": (
            nn.Sequential(
                nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 128), nn.LayerNorm(128), nn.Linear(128, 10)
            ),
            torch.randn(64, 64),
            _sq,
        ),
        "rmsnorm": (
            nn.Sequential(nn.Linear(64, 128), nn.RMSNorm(128), nn.Linear(128, 10)),
            torch.randn(32, 64),
            _sq,
        ),
        "activations": (
            nn.Sequential(
                nn.Linear(64, 128),
                nn.GELU(),
                nn.Linear(128, 128),
                nn.SiLU(),
                nn.Linear(128, 128),
                nn.Tanh(),
                nn.Linear(128, 128),
                nn.Sigmoid(),
                nn.Softplus(),
                nn.LeakyReLU(),
                nn.Linear(128, 10),
            ),
            torch.randn(32, 64),
            _sq,
        ),
        "attention": (_HandAttention(), torch.randn(4, 32, 64), _sq),
        "attention-block": (nn.Sequential(_Block(), _Block()), torch.randn(4, 32, 64), _sq),
        "transformer-encoder": (
            nn.TransformerEncoder(
                nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True),
                2,
                enable_nested_tensor=False,
            ),
            torch.randn(8, 64, 128),
            _sq,
        ),
        "packed-projection": (_PackedProjection(), torch.randn(256, 64), _sq),
    }


class _PackedProjection(nn.Module):
    """nn.MultiheadAttention's packed in-projection: three selects of one tensor, whose gradients
    the engine accumulates into one buffer (see NOTE [ observers change gradient accumulation ])."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 192))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = (x @ self.w).unflatten(-1, (3, 64)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        return proj[0] * proj[1] * proj[2]


def _real_peak(model: nn.Module, x: torch.Tensor, step) -> int:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(model)
    with gs.record(memory="cpu") as rec:
        step(model, x)
    assert rec.recording is not None
    return rec.recording.peak_bytes


@pytest.mark.parametrize("name", list(_models()))
def test_cpu_prediction_equals_real_cpu_run_byte_for_byte(name: str) -> None:
    model, x, step = _models()[name]
    real = _real_peak(model, x, step)
    p = gs.predict(step, model, x, device="cpu")
    assert isinstance(p, Prediction) and isinstance(p, gs.Recording)
    assert p.peak_bytes == real
    assert p.peak_bytes > 0


def test_prediction_never_touches_the_originals() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    before = [p.detach().clone() for p in model.parameters()]
    p = gs.predict(_sq, model, x, device="cpu")
    assert all(q.device.type == "cpu" and q.grad is None for q in model.parameters())
    assert x.grad is None and x.device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # the recording is a full one: graph, saved tensors, parameter names (prefixed with the
    # caller's name for the model)
    assert sorted(n.leaf for n in p.nodes if n.leaf) == [
        "input",
        "model.0.bias",
        "model.0.weight",
        "model.2.bias",
        "model.2.weight",
    ]
    assert p.saved_bytes > 0


def test_a_prediction_can_be_diagnosed_with_the_callers_names() -> None:
    G = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 64)).requires_grad_(False)  # noqa: N806

    def step(G, y, zs):  # type: ignore[no-untyped-def]  # noqa: N803
        out = [
            torch.autograd.grad(((G(z.requires_grad_()) * y) ** 2).sum(), z, create_graph=True)[0] for z in zs
        ]
        torch.stack(out).sum().backward()

    y = torch.randn(64, requires_grad=True)
    p = gs.predict(step, G, y, [torch.randn(128, 16) for _ in range(8)], device="cuda", budget="2MiB")
    assert p.fits is False
    d = gs.diagnose(p, namespace={})
    assert d.moment == "peak" and d.live_bytes == p.peak_bytes
    f = d.findings[0]
    assert f.pattern == "create_graph" and f.module == "G"
    # no variables given: the step cannot run on copies, so no code is shown and nothing is claimed
    assert not f.ran and f.code == "" and f.saves_bytes is None
    assert f.sketch.startswith('dgdy = sum(mixed_grad(f, G, z, y, v=v[i], method="forward_ad")')
    assert "not run:" in d.text()


def test_existing_gradients_are_mirrored() -> None:
    model = nn.Linear(16, 16)
    x = torch.randn(8, 16)
    _sq(model, x)  # grads now exist: the second step accumulates in place
    real = _real_peak(model, x, _sq)
    p = gs.predict(_sq, model, x, device="cpu")
    assert p.peak_bytes == real


def test_convolution_gets_a_note_and_is_not_claimed_exact() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    x = torch.randn(4, 3, 16, 16)
    real = _real_peak(model, x, _sq)
    p = gs.predict(_sq, model, x, device="cpu")
    assert any("convolution" in n and "workspaces" in n for n in p.notes)
    assert p.peak_bytes <= real  # what meta cannot see only adds


def test_norm_backward_temporaries_are_noted() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 10))
    p = gs.predict(_sq, model, torch.randn(32, 64), device="cpu")
    assert any("aten::native_batch_norm_backward" in n for n in p.notes)


def test_multihead_attention_is_exact_with_its_wrapped_scalar() -> None:
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(4, 16, 64)

    def step(m, x):  # type: ignore[no-untyped-def]
        m(x, x, x)[0].square().mean().backward()

    real = _real_peak(mha, x, step)
    p = gs.predict(step, mha, x, device="cpu")
    # a Python float becomes a 0-dim double tensor outside any operator (8 bytes), saved for backward
    # by a multiplication: meta tensors never see it, the prediction counts it
    assert p.peak_bytes == real
    assert [n for n in p.notes if "Python number saved for backward: 1 (8 bytes" in n]


def test_sdpa_uses_the_cpu_kernel_not_the_math_path() -> None:
    class Sdpa(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model, x = Sdpa(), torch.randn(4, 32, 64)
    p = gs.predict(_sq, model, x, device="cpu")
    names = {n.name for n in p.nodes}
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in names
    assert not any(n.startswith("SoftmaxBackward") for n in names)
    # the real run's operator outputs are the same bytes (its flash backward kernel also allocates
    # internal buffers, which only the CPU allocator's events show)
    twin = copy.deepcopy(model)
    with gs.record(memory="tracker") as rec:
        _sq(twin, x)
    assert rec.recording is not None and p.peak_bytes == rec.recording.peak_bytes
    assert p.saved_bytes == rec.recording.saved_bytes
    # and the attention function is restored afterwards
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_factory_calls_inside_the_step_are_counted() -> None:
    model = nn.Linear(32, 10)

    def step(model, x):  # type: ignore[no-untyped-def]
        target = torch.zeros(x.shape[0], 10)
        ((model(x) - target) ** 2).mean().backward()

    x = torch.randn(16, 32)
    assert gs.predict(step, model, x, device="cpu").peak_bytes == _real_peak(model, x, step)


def test_optimizer_step_state_is_predicted() -> None:
    model = nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())

    def step(model, opt, x):  # type: ignore[no-untyped-def]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    x = torch.randn(8, 256)
    p = gs.predict(step, model, opt, x, device="cpu")
    params = sum(q.numel() * 4 for q in model.parameters())
    assert p.peak_bytes >= 3 * params  # gradients + exp_avg + exp_avg_sq
    assert not opt.state  # the user's optimizer was not stepped
    m2, o2 = copy.deepcopy(model), None
    o2 = torch.optim.Adam(m2.parameters())
    with gs.record(memory="cpu") as rec:
        step(m2, o2, x)
    assert rec.recording is not None
    # Adam's per-parameter step counters (0-dim tensors made by torch.tensor) and Python numbers
    # wrapped as 0-dim tensors are not operator outputs: a few bytes the meta run does not count.
    assert 0 <= rec.recording.peak_bytes - p.peak_bytes <= 64


OPTIMIZERS = {
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "RMSprop": torch.optim.RMSprop,
    "Adagrad": torch.optim.Adagrad,  # makes its state (and step counters) in its constructor
    "NAdam": torch.optim.NAdam,
    "RAdam": torch.optim.RAdam,
    "Adamax": torch.optim.Adamax,
    "Adadelta": torch.optim.Adadelta,
    "Rprop": torch.optim.Rprop,
}


def _train_step(model, opt, x):  # type: ignore[no-untyped-def]
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("stepped_before", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_are_predicted_like_the_real_step(name: str, stepped_before: bool) -> None:
    # The optimizers read their 0-dim step counters with .item(): on torch 2.6-2.8 the counter
    # follows the default device (meta inside a prediction), and an optimizer that has stepped
    # before holds counters the copy must keep with their values.
    torch.manual_seed(0)
    model, x = nn.Linear(64, 64), torch.randn(8, 64)
    opt = OPTIMIZERS[name](model.parameters())
    if stepped_before:
        _train_step(model, opt, x)
    state = copy.deepcopy(opt.state_dict())
    p = gs.predict(_train_step, model, opt, x, device="cpu")
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for k, st in state["state"].items():  # the user's optimizer was not stepped
        for key, v in st.items():
            assert torch.equal(after["state"][k][key], v) if isinstance(v, torch.Tensor) else after["state"][k][key] == v
    m2 = copy.deepcopy(model)
    o2 = OPTIMIZERS[name](m2.parameters())
    o2.load_state_dict(copy.deepcopy(state))
    with gs.record(memory="cpu") as rec:
        _train_step(m2, o2, x)
    assert rec.recording is not None
    real = rec.recording.peak_bytes
    # the optimizer's state and temporaries (a weight-sized buffer at least) are in both peaks
    assert real > 64 * 64 * 4 * (2 if name == "SGD-momentum" and not stepped_before else 1)
    # step counters and Python numbers wrapped as 0-dim tensors: a few bytes the meta run does not count
    assert 0 <= real - p.peak_bytes <= 64
    assert torch.tensor(0.0).device.type == "cpu"


def test_an_optimizer_step_that_raises_leaves_the_default_device_alone() -> None:
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    opt = torch.optim.Adam(model.parameters())

    def step(model, opt, x):  # type: ignore[no-untyped-def]
        def closure():  # type: ignore[no-untyped-def]
            model(x).sum().backward()
            raise ValueError("user code failed inside the optimizer step")

        opt.step(closure)

    with pytest.raises(gs.GradscopeError, match="user code failed inside the optimizer step"):
        gs.predict(step, model, opt, x, device="cpu")
    assert torch.get_default_device().type == "cpu"
    assert torch.tensor(0.0).device.type == "cpu" and torch.zeros(3).device.type == "cpu"
    # and a later prediction with a plain step still runs on meta, with no hook left over
    assert gs.predict(_train_step, model, opt, x, device="cpu").peak_bytes > 0
    assert torch.tensor(0.0).device.type == "cpu"


# ----- the allocator model --------------------------------------------------------------------
def test_allocator_rounds_to_512_and_uses_pools() -> None:
    e = estimate_cuda_allocator([(1, 1)])
    assert (e.allocated_peak, e.reserved_peak, e.segments) == (512, 2 * MiB, 1)
    e = estimate_cuda_allocator([(1, 1 * MiB + 1)])  # large pool, under 10 MiB: a 20 MiB segment
    assert (e.allocated_peak, e.reserved_peak) == (1 * MiB + 512, 20 * MiB)
    e = estimate_cuda_allocator([(1, 11 * MiB)])  # 10 MiB or more: rounded to 2 MiB
    # the 1 MiB left over is not more than 1 MiB, so the block is not split: it counts whole
    assert (e.allocated_peak, e.reserved_peak) == (12 * MiB, 12 * MiB)
    e = estimate_cuda_allocator([(1, 15 * MiB)])  # 15 of 16 MiB: again unsplit
    assert (e.allocated_peak, e.reserved_peak) == (16 * MiB, 16 * MiB)


def test_allocator_reuses_free_blocks_and_merges_neighbours() -> None:
    # two 1 MiB blocks fill one 2 MiB small segment; freed and merged, a third fits without a new one
    ev = [(1, 1 * MiB), (2, 1 * MiB), (1, -1), (2, -1), (3, 1 * MiB), (4, 1 * MiB)]
    e = estimate_cuda_allocator(ev)
    assert (e.allocated_peak, e.reserved_peak, e.segments) == (2 * MiB, 2 * MiB, 1)
    # thirteen 1.5 MiB tensors share one 20 MiB large segment; a fourteenth needs a second one
    e = estimate_cuda_allocator([(i, 3 * MiB // 2) for i in range(13)])
    assert (e.segments, e.reserved_peak) == (1, 20 * MiB)
    e = estimate_cuda_allocator([(i, 3 * MiB // 2) for i in range(14)])
    assert (e.segments, e.reserved_peak) == (2, 40 * MiB)


def test_allocator_capacity_releases_cache_before_failing() -> None:
    # a free 20 MiB segment is cached; a 30 MiB request with 40 MiB capacity releases it and fits
    ev = [(1, 2 * MiB), (1, -1), (2, 30 * MiB)]
    assert not estimate_cuda_allocator(ev, capacity=40 * MiB).out_of_memory
    e = estimate_cuda_allocator([(1, 2 * MiB), (2, 30 * MiB)], capacity=40 * MiB)
    assert e.out_of_memory and e.oom_request == 30 * MiB


def test_cuda_prediction_budget_and_batches() -> None:
    model = nn.Linear(1024, 1024)
    x = torch.randn(8, 1024)
    p = gs.predict(_sq, model, x, budget="64MiB", batch_sizes=[8, 1024, 4096])
    assert p.device == "cuda"
    assert p.resident_bytes == (1024 * 1024 + 1024 + 8 * 1024) * 4
    assert p.allocated_bytes is not None and p.allocated_bytes >= p.resident_bytes + p.peak_bytes
    assert p.reserved_bytes is not None and p.reserved_bytes >= p.allocated_bytes
    assert p.reserved_bytes % (2 * MiB) == 0
    assert [b.batch_size for b in p.batches] == [8, 1024, 4096]
    assert [b.fits for b in p.batches] == [True, True, False]
    assert p.largest_batch == 1024 and p.fits is True
    assert p.batches[1].peak_bytes > p.batches[0].peak_bytes
    assert any("cannot know kernel workspaces" in n for n in p.notes)
    text = p.summary()
    assert "largest batch that fits: 1024" in text and "estimated CUDA reserved peak" in text


def test_batch_sizes_scale_only_the_batch_dimension() -> None:
    model = nn.Linear(64, 8)
    x = torch.randn(4, 64)
    real = {}
    for b in (4, 32):
        real[b] = _real_peak(model, torch.randn(b, 64), _sq)
    p = gs.predict(_sq, model, x, device="cpu", batch_sizes=[4, 32])
    assert [b.peak_bytes for b in p.batches] == [real[4], real[32]]


def test_make_args_builds_each_batch_on_meta() -> None:
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    calls = []

    def make_args(b: int):  # type: ignore[no-untyped-def]
        x = torch.randn(b, 128)
        calls.append(x.device.type)
        return model, x

    budget = 2 * MiB
    p = gs.predict(_sq, device="cpu", budget=budget, batch_sizes=[16, 256, 4096], make_args=make_args)
    assert calls == ["meta", "meta", "meta"]
    assert [b.fits for b in p.batches] == [True, True, False]
    assert p.largest_batch == 256
    assert p.peak_bytes == p.batches[1].peak_bytes  # the recording shown is the largest that fits
    assert p.peak_bytes == _real_peak(model, torch.randn(256, 128), _sq)


def test_prediction_round_trips_through_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = gs.predict(_sq, nn.Linear(8, 8), torch.randn(2, 8), budget="1GiB")
    path = tmp_path / "p.gscope.json"
    p.save(path)
    back = gs.load(path)
    assert back.extra["prediction"]["reserved_peak_bytes"] == p.reserved_bytes
    assert back.peak_bytes == p.peak_bytes


def test_mistakes_raise_gradscope_errors() -> None:
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    with pytest.raises(gs.GradscopeError, match="device='cuda' or device='cpu'"):
        gs.predict(_sq, model, x, device="tpu")
    with pytest.raises(gs.GradscopeError, match="cannot read the memory size"):
        gs.predict(_sq, model, x, budget="lots")
    with pytest.raises(gs.GradscopeError, match="batch_sizes must be a list"):
        gs.predict(_sq, model, x, batch_sizes=[0])

    def reads_values(model, x):  # type: ignore[no-untyped-def]
        if model(x).sum().item() > 0:
            pass

    with pytest.raises(gs.GradscopeError, match=r"\.item\(\)"):
        gs.predict(reads_values, model, x, device="cpu")


def _encoder(dropout: float, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dtype)


def test_dropout_on_cpu_equals_the_real_run() -> None:
    model, x = _encoder(0.1), torch.randn(8, 64, 128)
    assert gs.predict(_sq, model, x, device="cpu").peak_bytes == _real_peak(model, x, _sq)


def test_cuda_prediction_takes_the_gpu_kernels() -> None:
    x = torch.randn(8, 64, 128)
    p = gs.predict(_sq, _encoder(0.1), x, device="cuda")
    names = {n.name for n in p.nodes}
    # fp32 attention: memory-efficient kernel; dropout: the fused kernel with a one-byte mask
    assert "ScaledDotProductEfficientAttentionBackward0" in names
    assert "NativeDropoutBackward0" in names and "SoftmaxBackward0" not in names
    masks = [s for s in p.saved if p.nodes[s.node].name == "NativeDropoutBackward0"]
    assert masks and all(s.dtype == "bool" for s in masks)
    cpu = gs.predict(_sq, _encoder(0.1), x, device="cpu")
    assert p.peak_bytes < cpu.peak_bytes  # the GPU's kernels save less than the CPU's math path
    half = gs.predict(_sq, _encoder(0.0, torch.bfloat16), x.to(torch.bfloat16), device="cuda")
    assert "ScaledDotProductFlashAttentionBackward0" in {n.name for n in half.nodes}
    # and everything patched for the prediction is back
    import torch.nn.functional as F  # noqa: N812

    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert F.dropout.__name__ == "dropout" and F.dropout.__module__ == "torch.nn.functional"


def test_forward_mode_ad_under_the_mode_is_said_where_it_changes_the_peak() -> None:
    """Under a dispatch mode PyTorch keeps forward AD's zero tangents of weights as empty zero
    tensors; a real run materializes them. The prediction says so, and the real run (the
    profiler's own events) does peak far higher (546,820 vs 120,832 bytes on 2.13: the second
    layer's 512 KiB weight tangent, materialized, outweighs everything else)."""
    from gradscope.strategies import jacobian

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 512))
    x = torch.randn(16)

    def step(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return jacobian(lambda v: net(v.view(1, -1)).view(-1), x, method="jacfwd")

    p = gs.predict(step, net, x, device="cpu")
    assert any("Forward-mode AD ran here" in n for n in p.notes)
    with gs.record(memory="cpu") as rec:
        step(net, x)
    assert rec.recording.peak_bytes > 2 * p.peak_bytes
    plain = gs.predict(lambda net, x: net(x).sum().backward(), net, x, device="cpu")
    assert not any("Forward-mode AD" in n for n in plain.notes)


# ----- argument objects, refusals, warnings (issue 39) ----------------------------------------------
class _Store(dict):  # what torch_geometric's Data keeps its tensors in: a mapping under `_store`
    pass


class _Graph:
    """A torch_geometric ``Data``-like batch: tensors behind attribute access, held in `_store`."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__["_store"] = _Store(tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["_store"][name]
        except KeyError:
            raise AttributeError(name) from None


def test_tensors_inside_argument_objects_are_moved_and_counted_exactly() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    class Slotted:
        __slots__ = ("x", "y")

        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randn(32, 4)

    def step(model: nn.Module, batch: object) -> None:
        (model(batch.x) - batch.y).square().mean().backward()  # type: ignore[attr-defined]

    for batch in (Batch(x, y), _Graph(x=x, y=y), Slotted(x, y), {"b": [Batch(x, y)]}):
        arg = batch["b"][0] if isinstance(batch, dict) else batch
        p = gs.predict(lambda m, b: step(m, b["b"][0] if isinstance(b, dict) else b), model, batch, device="cpu")
        twin = copy.deepcopy(model)
        with gs.record(memory="cpu") as rec:
            step(twin, arg)
        assert p.peak_bytes == rec.recording.peak_bytes
        assert p.resident_bytes == sum(t.numel() * 4 for t in (*model.parameters(), x, y))
    assert x.device.type == "cpu" and model[0].weight.grad is None  # the user's objects untouched


def test_a_refusal_names_the_first_error_not_the_one_raised_while_handling_it() -> None:
    model = nn.Linear(8, 1)

    def step(model: nn.Module, x: torch.Tensor) -> None:
        try:
            if model(x).sum().item() > 0:  # reads a value: cannot run on meta
                pass
        finally:
            raise RuntimeError("the framework's teardown failed")

    with pytest.raises(gs.GradscopeError) as info:
        gs.predict(step, model, torch.randn(4, 8), device="cpu")
    text = str(info.value)
    assert text.index("Tensor.item() cannot be called on meta tensors") < text.index("teardown failed")
    assert "while handling it, the step raised RuntimeError: the framework's teardown failed" in text


def test_an_lr_scheduler_and_its_copied_optimizer_leave_no_warning() -> None:
    import warnings

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)

    def step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, x: torch.Tensor) -> None:
        model(x).square().sum().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gs.predict(step, model, opt, sched, torch.randn(4, 8), device="cpu")
    assert [str(w.message) for w in seen] == []
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1  # the user's scheduler did not step
    # the user's own scheduler still steps without a warning afterwards
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(model, opt, sched, torch.randn(4, 8))
    assert [str(w.message) for w in seen] == [] and sched.last_epoch == 1


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_autocast_step_is_refused_by_name_never_predicted_as_float32(device: str) -> None:
    import warnings

    model = nn.Linear(64, 64)

    def step(model: nn.Module, x: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()

    def caught(model: nn.Module, x: torch.Tensor) -> None:  # a step that swallows the refusal
        try:
            step(model, x)
        except Exception:
            model(x).sum().backward()

    for fn in (step, caught):
        with warnings.catch_warnings(record=True) as seen, pytest.raises(gs.GradscopeError) as info:
            warnings.simplefilter("always")
            gs.predict(fn, model, torch.randn(8, 64), device=device)
        assert f"torch.autocast('{device}', dtype=torch.bfloat16)" in str(info.value)
        assert "float32" in str(info.value) and seen == []
    # autocast turned off is no autocast; and the patch is gone after the prediction
    gs.predict(lambda m, x: m(x).sum().backward(), model, torch.randn(8, 64), device=device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(2, 64)).dtype == torch.bfloat16


def test_the_cublas_workspace_is_named_in_a_cuda_prediction() -> None:
    model = nn.Linear(64, 64)
    p = gs.predict(lambda m, x: m(x).sum().backward(), model, torch.randn(8, 64), device="cuda")
    cublas = [n for n in p.notes if n.startswith("cuBLAS workspace not counted")]
    assert len(cublas) == 1 and "two here" in cublas[0] and "CUBLAS_WORKSPACE_CONFIG" in cublas[0]
    p = gs.predict(lambda m, x: m(x).sum().backward(), nn.ReLU(), torch.randn(8, 64, requires_grad=True),
                   device="cuda")
    assert not any(n.startswith("cuBLAS workspace") for n in p.notes)  # no matmul, no workspace
