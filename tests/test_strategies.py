"""The strategies against independent computations: naive double backward, autograd.functional,
finite differences, torch.optim, and the joint backward."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import count_packs, saved_tensors_hooks_active
from torch import nn
from torch.func import functional_call

from gradscope._base import compat as _compat
from gradscope.errors import GradscopeError
from gradscope.strategies import (
    JACOBIAN_METHODS,
    PenaltyBranches,
    frozen,
    hypergradient,
    jacobian,
    many_inputs_backward,
    mixed_grad,
    unrolled_params,
)


# ----- mixed second derivatives (seed 000) -------------------------------------------------------
def _frozen_G(depth: int = 3, width: int = 6, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def _f(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return ((y.sum(dim=1, keepdim=True) + g) ** 3).sum() + (y * g.sin()).sum()


def _naive(f, G, z, y, v):  # the thread's double backward, written out independently
    z = z.detach().clone().requires_grad_(True)
    (dfdz,) = torch.autograd.grad(f(y, G(z)), z, create_graph=True)
    (out,) = torch.autograd.grad(dfdz, y, grad_outputs=v)
    return out


def test_mixed_grad_thread_example_forward_ad_equals_double_backward():
    # the exact functions of the forum answer
    def G(x):
        return x.sum(dim=1).exp()

    def f(y, g_out):
        return ((y.sum(dim=1) + g_out) ** 3).sum()

    torch.manual_seed(1)
    z = torch.rand(3, 4, dtype=torch.float64)
    y = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    want = _naive(f, G, z, y, torch.ones_like(z))
    got = mixed_grad(f, G, z, y, method="forward_ad")
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(mixed_grad(f, G, z, y, method="create_graph"), want, rtol=1e-12, atol=1e-12)
    assert want.abs().sum() > 1  # not trivially zero


@pytest.mark.parametrize("method", ["create_graph", "forward_ad"])
def test_mixed_grad_module_with_direction_v(method):
    G = _frozen_G()
    torch.manual_seed(2)
    z = torch.randn(5, 6, dtype=torch.float64)
    y = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 6, dtype=torch.float64)
    want = _naive(_f, G, z, y, v)
    got = mixed_grad(_f, G, z, y, v, method=method)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert y.grad is None  # autograd.grad, nothing accumulated


def test_forward_ad_leaves_requires_grad_flags_and_grads_alone():
    G = _frozen_G()
    G[0].bias.requires_grad_(False)  # a mixed state must come back exactly
    z = torch.randn(2, 6, dtype=torch.float64)
    y = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    mixed_grad(_f, G, z, y, method="forward_ad")
    assert [p.requires_grad for p in G.parameters()] == [True, False] + [True] * 4
    assert all(p.grad is None for p in G.parameters())


def test_forward_ad_restores_flags_when_G_raises():
    lin = nn.Linear(3, 3)

    def G(x):
        assert not lin.weight.requires_grad  # frozen for the duration
        raise ValueError("boom")

    y = torch.randn(1, 3, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        mixed_grad(_f, G, torch.randn(1, 3), y, method="forward_ad", frozen_params=lin.parameters())
    assert lin.weight.requires_grad and lin.bias.requires_grad


def test_frozen_restores_on_exception():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(KeyError), frozen([p]):
        assert not p.requires_grad
        raise KeyError
    assert p.requires_grad


def test_forward_ad_builds_no_graph_through_G():
    G = _frozen_G(depth=4)
    seen: list[str] = []

    def f(y, g):
        # g arrives as a fresh leaf: nothing of G is behind it
        seen.append(f"leaf={g.is_leaf} grad_fn={g.grad_fn}")
        return (y * g).pow(2).sum()

    y = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    mixed_grad(f, G, torch.randn(2, 6, dtype=torch.float64), y, method="forward_ad")
    assert seen == ["leaf=True grad_fn=None"]


def test_split_returns_no_gradient_and_naive_grad_raises_like_the_thread():
    G = _frozen_G()
    z = torch.randn(2, 6, dtype=torch.float64)
    y = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert mixed_grad(_f, G, z, y, method="split") is None
    assert _naive(_f, G, z, y, torch.ones_like(z)).abs().sum() > 0  # the true answer is not zero


def test_mixed_grad_zero_when_df_dz_does_not_depend_on_y():
    G = _frozen_G()
    z = torch.randn(2, 6, dtype=torch.float64)
    y = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)

    def f(y, g):
        return y.pow(2).sum() + g.pow(2).sum()

    for method in ("create_graph", "forward_ad"):
        out = mixed_grad(f, G, z, y, method=method)
        assert torch.equal(out, torch.zeros_like(y))


def test_mixed_grad_bad_arguments_name_the_argument():
    G = _frozen_G()
    z = torch.randn(2, 6, dtype=torch.float64)
    y = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(GradscopeError, match="`y` must require grad"):
        mixed_grad(_f, G, z, y.detach())
    with pytest.raises(GradscopeError, match=r"`v` must have the shape of `z` \(2, 6\), got \(3,\)"):
        mixed_grad(_f, G, z, y, v=torch.ones(3))
    with pytest.raises(GradscopeError, match="`G` must be callable"):
        mixed_grad(_f, "G", z, y)
    with pytest.raises(GradscopeError, match="`method` must be one of"):
        mixed_grad(_f, G, z, y, method="fast")
    with pytest.raises(GradscopeError, match="`f` must return a scalar"):
        mixed_grad(lambda y, g: y * g, G, z, y)


# ----- many inputs, two passes (seed 001) --------------------------------------------------------
def _bn_dropout_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.4),
        nn.Linear(16, 5),
        nn.BatchNorm1d(5, momentum=None),
        nn.Dropout(0.2),
        nn.Linear(5, 3),
    ).double()


def _g(zs: torch.Tensor) -> torch.Tensor:
    return (zs.tanh().sum(0) ** 2).mean() + zs.logsumexp(0).sum()


def test_two_pass_equals_stacked_grads_bn_stats_and_rng():
    f1 = _bn_dropout_net()
    f2 = copy.deepcopy(f1)
    torch.manual_seed(4)
    xs = [torch.randn(7, 6, dtype=torch.float64) for _ in range(5)]
    torch.manual_seed(5)
    L1 = many_inputs_backward(f1, xs, _g, method="stacked")
    rng1 = torch.get_rng_state()
    torch.manual_seed(5)
    L2 = many_inputs_backward(f2, xs, _g, method="two_pass")
    rng2 = torch.get_rng_state()
    assert torch.allclose(L1, L2, rtol=1e-12, atol=0)
    for (n, a), (_, b) in zip(f1.named_parameters(), f2.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12), n
    for (n, a), (_, b) in zip(f1.named_buffers(), f2.named_buffers(), strict=True):
        assert torch.equal(a, b), n
    assert f2[1].num_batches_tracked.item() == 5
    assert torch.equal(rng1, rng2)
    # the recompute left the norm layers as they were
    assert f2[1].track_running_stats and f2[5].track_running_stats


def test_two_pass_without_rng_restore_would_differ():
    # guards the test above: with dropout the two runs only agree because of the RNG handling
    f = _bn_dropout_net()
    xs = [torch.randn(7, 6, dtype=torch.float64) for _ in range(2)]
    torch.manual_seed(0)
    a = f(xs[0])
    b = f(xs[0])
    assert not torch.allclose(a, b)


def test_two_pass_eval_mode_and_plain_function():
    f = _bn_dropout_net().eval()
    xs = torch.randn(3, 4, 6, dtype=torch.float64)  # a tensor is split along dim 0
    many_inputs_backward(f, xs, _g, method="two_pass")
    got = [p.grad.clone() for p in f.parameters()]
    f.zero_grad(set_to_none=True)
    _g(torch.stack([f(x) for x in xs])).backward()
    for a, p in zip(got, f.parameters(), strict=True):
        assert torch.allclose(a, p.grad, rtol=1e-10, atol=1e-12)
    w = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    many_inputs_backward(lambda x: x @ w, list(xs), lambda zs: zs.pow(3).sum(), method="two_pass")
    want = torch.autograd.grad(torch.stack([x @ w for x in xs]).pow(3).sum(), w)[0]
    assert torch.allclose(w.grad, want, rtol=1e-12)


def test_many_inputs_bad_arguments():
    f = nn.Linear(2, 2)
    with pytest.raises(GradscopeError, match="`inputs` is empty"):
        many_inputs_backward(f, [], _g)
    with pytest.raises(GradscopeError, match=r"`inputs\[1\]` must be a torch.Tensor"):
        many_inputs_backward(f, [torch.ones(1, 2), [1.0, 2.0]], _g)
    with pytest.raises(GradscopeError, match="`g` must return a scalar"):
        many_inputs_backward(f, [torch.ones(1, 2)], lambda zs: zs)


# ----- hypergradients (seed 002) -----------------------------------------------------------------
def _hyper_setup():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x, t = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    xv, tv = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)  # per-sample weights (the thread's A)

    def train(p):
        return (w * (functional_call(model, p, (x,)) - t).squeeze(1) ** 2).mean()

    def val(p):
        return ((functional_call(model, p, (xv,)) - tv) ** 2).mean()

    return model, w, train, val


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_hypergradient_matches_finite_differences(optimizer):
    model, w, train, val = _hyper_setup()
    before = [p.detach().clone() for p in model.parameters()]
    hg = hypergradient(model, w, train, val, steps=3, optimizer=optimizer, lr=0.05)
    eps = 1e-6
    fd = torch.zeros_like(w)
    for i in range(w.numel()):
        vals = []
        for sign in (1, -1):
            with torch.no_grad():
                w[i] += sign * eps
            vals.append(val(unrolled_params(model, train, 3, optimizer, 0.05)).item())
            with torch.no_grad():
                w[i] -= sign * eps
        fd[i] = (vals[0] - vals[1]) / (2 * eps)
    assert torch.allclose(hg, fd, rtol=1e-5, atol=1e-8)
    assert hg.abs().max() > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_unrolled_params_follow_torch_optim(optimizer):
    model, _, train, _ = _hyper_setup()
    m2 = copy.deepcopy(model)
    params = list(m2.parameters())
    opt = torch.optim.SGD(params, lr=0.05) if optimizer == "sgd" else torch.optim.Adam(params, lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        train(dict(m2.named_parameters())).backward()
        opt.step()
    got = unrolled_params(model, train, 3, optimizer, 0.05)
    for n, p in m2.named_parameters():
        assert torch.allclose(got[n], p, rtol=1e-12, atol=1e-14), n


def test_hypergradient_of_learning_rate_tensor():
    model, _, _, val = _hyper_setup()
    x = torch.randn(6, 3, dtype=torch.float64)
    lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)

    def train(p):
        return functional_call(model, p, (x,)).pow(2).mean()

    hg = hypergradient(model, lr, train, val, steps=2, lr=lr)
    eps = 1e-6
    up = val(unrolled_params(model, train, 2, "sgd", 0.1 + eps)).item()
    down = val(unrolled_params(model, train, 2, "sgd", 0.1 - eps)).item()
    assert torch.allclose(hg, torch.tensor((up - down) / (2 * eps), dtype=torch.float64), rtol=1e-6)


def test_inplace_update_cuts_the_graph_like_the_thread():
    model, w, train, val = _hyper_setup()
    before = [p.detach().clone() for p in model.parameters()]
    assert hypergradient(model, w, train, val, steps=2, method="inplace") is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_hypergradient_bad_arguments():
    model, w, train, val = _hyper_setup()
    with pytest.raises(GradscopeError, match="`hyper` must require grad"):
        hypergradient(model, w.detach(), train, val)
    with pytest.raises(GradscopeError, match=r"`hyper\[1\]` must be a torch.Tensor"):
        hypergradient(model, [w, 3.0], train, val)
    with pytest.raises(GradscopeError, match="`steps` must be a positive int"):
        hypergradient(model, w, train, val, steps=0)
    with pytest.raises(GradscopeError, match="`optimizer` must be one of"):
        hypergradient(model, w, train, val, optimizer="lbfgs")


# ----- penalty branches (seed 003) ---------------------------------------------------------------
def _penalty_model():
    torch.manual_seed(7)
    trunk = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)]).double()
    heads = nn.ModuleList([nn.Linear(8, 32) for _ in range(4)]).double()
    return trunk, heads


def _run_penalties(method, trunk, heads, x):
    pb = PenaltyBranches(method)
    h = x
    for layer, head in zip(trunk, heads, strict=True):
        h = torch.tanh(layer(h))
        pb.add(0.1 * head(h).pow(2).mean() + h.abs().mean(), at=h)
    return pb.backward(h.pow(2).sum())


@pytest.mark.parametrize("method", ["early", "retain_graph"])
def test_penalty_branches_equal_joint_backward(method):
    trunk, heads = _penalty_model()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    total = _run_penalties(method, trunk, heads, x)
    got = [p.grad.clone() for p in [*trunk.parameters(), *heads.parameters(), x]]
    for p in [*trunk.parameters(), *heads.parameters(), x]:
        p.grad = None
    # the independent joint computation, written out
    h, loss = x, 0
    for layer, head in zip(trunk, heads, strict=True):
        h = torch.tanh(layer(h))
        loss = loss + 0.1 * head(h).pow(2).mean() + h.abs().mean()
    loss = loss + h.pow(2).sum()
    loss.backward()
    want = [p.grad for p in [*trunk.parameters(), *heads.parameters(), x]]
    assert torch.allclose(total, loss.detach(), rtol=1e-12)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_early_release_frees_the_branch_before_the_end():
    trunk, heads = _penalty_model()
    x = torch.randn(5, 8, dtype=torch.float64)
    pb = PenaltyBranches("early")
    h = torch.tanh(trunk[0](x))
    branch = heads[0](h).exp()
    penalty = branch.pow(2).mean()
    node = branch.grad_fn  # ExpBackward0 saves its result
    assert node._saved_result.shape == (5, 32)
    pb.add(penalty, at=h)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _ = node._saved_result  # the branch's saved tensors are gone already
    assert h.grad_fn._saved_result.shape == (5, 8)  # the trunk's are still there
    pb.backward(h.sum())
    assert heads[0].weight.grad is not None and trunk[0].weight.grad is not None


def test_penalty_bad_arguments():
    with pytest.raises(GradscopeError, match="`method` must be one of"):
        PenaltyBranches("lazy")
    pb = PenaltyBranches()
    h = torch.randn(3)
    with pytest.raises(GradscopeError, match="`at` does not require grad"):
        pb.add(h.sum(), at=h)
    with pytest.raises(GradscopeError, match="`penalty` must return a scalar"):
        pb.add(h.requires_grad_() * 2, at=h)


# ----- Jacobians (seed 004) ----------------------------------------------------------------------
def _mlp(n_in=5, n_out=4):
    torch.manual_seed(8)
    return nn.Sequential(nn.Linear(n_in, 7), nn.Tanh(), nn.Linear(7, n_out)).double()


@pytest.mark.parametrize("method", JACOBIAN_METHODS)
def test_jacobian_full_matches_autograd_functional(method):
    net = _mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    want = torch.autograd.functional.jacobian(net, x)
    got = jacobian(net, x, method=method)
    assert got.shape == (3, 4, 3, 5)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", JACOBIAN_METHODS)
def test_jacobian_per_sample_matches_autograd_functional(method):
    net = _mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    want = torch.stack([torch.autograd.functional.jacobian(lambda v: net(v[None])[0], xi) for xi in x])
    got = jacobian(net, x, method=method, batch_dim=0)
    assert got.shape == (3, 4, 5)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


def test_jacobian_of_elementwise_function_is_diagonal():
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    for method in JACOBIAN_METHODS:
        assert torch.allclose(jacobian(torch.sin, x, method=method), torch.diag(torch.cos(x)))


def test_jacobian_bad_arguments():
    net = _mlp()
    with pytest.raises(GradscopeError, match="`x` must be a floating-point tensor"):
        jacobian(net, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(GradscopeError, match="must keep the batch size 3"):
        jacobian(lambda v: v.sum(0), torch.ones(3, 5), batch_dim=0)
    with pytest.raises(GradscopeError, match="`batch_dim` must be None"):
        jacobian(net, torch.ones(2, 5), batch_dim=1)
    with pytest.raises(GradscopeError, match="`fn` must return a tensor"):
        jacobian(lambda v: (v, v), torch.ones(2))


@pytest.mark.parametrize("method", JACOBIAN_METHODS)
def test_jacobian_runs_under_saved_tensor_hooks_and_puts_them_back(method):
    net = _mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    want = jacobian(net, x, method="loop", batch_dim=0)
    hooks = torch.autograd.graph.save_on_cpu()
    packs = count_packs(hooks)
    if method in ("jacrev", "vmap") and _compat.top_saved_tensors_hooks() is _compat.NOT_VISIBLE:
        # torch 2.6 cannot set the hooks aside: a GradscopeError that says so, the hooks kept
        with hooks:
            with pytest.raises(GradscopeError, match="cannot set them aside"):
                jacobian(net, x, method=method, batch_dim=0)
            before = packs[0]
            torch.ones(2, requires_grad=True).exp()
            assert packs[0] == before + 1
        assert not saved_tensors_hooks_active()
        return
    with hooks:
        got = jacobian(net, x, method=method, batch_dim=0)
        before = packs[0]
        y = torch.ones(2, requires_grad=True).exp()  # saves its result: the user's pack hook runs
        assert packs[0] == before + 1, "the user's hooks are no longer the innermost pair"
        del y
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    assert not saved_tensors_hooks_active()


@pytest.mark.parametrize("method", ["stacked", "two_pass"])
def test_many_inputs_outputs_of_different_shapes_name_the_input(method):
    f = nn.Linear(2, 3)
    xs = [torch.ones(4, 2), torch.ones(4, 2), torch.ones(5, 2)]
    with pytest.raises(
        GradscopeError, match=r"`f\(inputs\[2\]\)` has shape \(5, 3\) but `f\(inputs\[0\]\)` has \(4, 3\)"
    ):
        many_inputs_backward(f, xs, _g, method=method)


def _saved_bytes_packed(fn) -> int:
    """Bytes of every tensor saved for backward while ``fn`` runs (an independent pack-hook count)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_forward_ad_saves_the_same_bytes_whatever_the_depth_of_G():
    z = torch.randn(4, 6, dtype=torch.float64)
    y = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    fwd = [
        _saved_bytes_packed(lambda d=d: mixed_grad(_f, _frozen_G(d), z, y, method="forward_ad"))
        for d in (2, 8)
    ]
    dbl = [
        _saved_bytes_packed(lambda d=d: mixed_grad(_f, _frozen_G(d), z, y, method="create_graph"))
        for d in (2, 8)
    ]
    assert fwd[0] == fwd[1] > 0
    assert dbl[1] > dbl[0] + 6 * 4 * 6 * 8  # every extra layer saves at least one (4, 6) activation


def test_two_pass_with_random_draws_in_g_leaves_the_rng_where_stacked_does():
    f1 = _bn_dropout_net()
    f2 = copy.deepcopy(f1)
    xs = [torch.randn(7, 6, dtype=torch.float64) for _ in range(3)]

    def g(zs):
        return nn.functional.dropout(zs, 0.5).pow(2).sum()

    torch.manual_seed(9)
    L1 = many_inputs_backward(f1, xs, g, method="stacked")
    rng1 = torch.get_rng_state()
    torch.manual_seed(9)
    L2 = many_inputs_backward(f2, xs, g, method="two_pass")
    assert torch.equal(rng1, torch.get_rng_state())
    assert torch.allclose(L1, L2, rtol=1e-12)
    for a, b in zip(f1.parameters(), f2.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


class _NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + 0 * torch.rand(())  # draws from the RNG during backward


def test_two_pass_refuses_a_backward_that_draws_random_numbers():
    f = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    xs = [torch.randn(4, 3) for _ in range(3)]
    with pytest.raises(GradscopeError, match=r"before recomputing `f\(inputs\[1\]\)` differs"):
        many_inputs_backward(lambda x: _NoisyBackward.apply(f(x)), xs, lambda zs: zs.sum(), method="two_pass")


def test_mixed_grad_gives_the_threads_full_dg_dy_through_v():
    # the thread wants d/dy g(df/dz) for a general g: with v = dg/d(df/dz) held fixed, that is
    # d/dy <v, df/dz>, which forward AD computes without G's graph
    G = _frozen_G()
    torch.manual_seed(10)
    z = torch.randn(3, 6, dtype=torch.float64)
    y = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)

    def g(dfdz):
        return (dfdz.sin() ** 2).sum()

    z_ = z.clone().requires_grad_(True)
    (dfdz,) = torch.autograd.grad(_f(y, G(z_)), z_, create_graph=True)
    (want,) = torch.autograd.grad(g(dfdz), y)  # naive: the whole double-backward graph
    d = dfdz.detach().requires_grad_(True)
    (v,) = torch.autograd.grad(g(d), d)
    got = mixed_grad(_f, G, z, y, v=v, method="forward_ad")
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
