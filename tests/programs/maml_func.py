"""MAML with torch.func, as its tutorial writes the inner loop: functional_call on a dict of
parameters, gradients taken with create_graph=True, the outer loss over a batch of tasks."""
# --- setup
import torch
from torch.func import functional_call

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
tasks = [(torch.randn(64, 1), torch.randn(64, 1), torch.randn(64, 1), torch.randn(64, 1)) for _ in range(4)]
inner_lr = 0.01


def inner_adapt(params, x, y, steps=2):
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {k: p - inner_lr * g for (k, p), g in zip(params.items(), grads)}
    return params
# --- step
meta_opt.zero_grad()
outer = 0.0
for x_s, y_s, x_q, y_q in tasks:
    adapted = inner_adapt(dict(model.named_parameters()), x_s, y_s)
    outer = outer + torch.nn.functional.mse_loss(functional_call(model, adapted, (x_q,)), y_q)
outer.backward()
meta_opt.step()
