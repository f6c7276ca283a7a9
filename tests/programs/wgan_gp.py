"""A WGAN-GP critic step as the paper's reference code writes it: the gradient penalty takes the
critic's input gradient with create_graph=True and differentiates its norm."""
# --- setup
import torch

torch.manual_seed(0)
G = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
D = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LeakyReLU(0.2), torch.nn.Linear(256, 256),
                        torch.nn.LeakyReLU(0.2), torch.nn.Linear(256, 1))
opt_D = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.0, 0.9))
real = torch.randn(64, 256)
z = torch.randn(64, 32)
lambda_gp = 10.0
# --- step
fake = G(z).detach()
alpha = torch.rand(real.size(0), 1)
interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
d_interpolates = D(interpolates)
gradients = torch.autograd.grad(outputs=d_interpolates, inputs=interpolates,
                                grad_outputs=torch.ones_like(d_interpolates), create_graph=True)[0]
gradient_penalty = ((gradients.norm(2, dim=1) - 1) ** 2).mean()
loss_D = D(fake).mean() - D(real).mean() + lambda_gp * gradient_penalty
opt_D.zero_grad()
loss_D.backward()
opt_D.step()
