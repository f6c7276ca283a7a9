"""A physics-informed network for the heat equation, as PINN tutorials write it: u(x, t) by an MLP,
its derivatives by autograd.grad with create_graph=True, the residual's mean square."""
# --- setup
import torch

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(2, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                          torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
x = torch.rand(1024, 1, requires_grad=True)
t = torch.rand(1024, 1, requires_grad=True)
# --- step
u = net(torch.cat([x, t], dim=1))
u_t = torch.autograd.grad(u, t, torch.ones_like(u), create_graph=True)[0]
u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
loss = ((u_t - 0.1 * u_xx) ** 2).mean()
optimizer.zero_grad()
loss.backward()
optimizer.step()
