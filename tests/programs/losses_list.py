"""Losses kept in a list for one backward after the loop (a pattern of the forum threads): the block
never calls backward; the list keeps every batch's graph, and the optimizer trains only the head."""
# --- setup
import torch

torch.manual_seed(0)
backbone = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh())
head = torch.nn.Linear(512, 10)
opt = torch.optim.SGD(head.parameters(), lr=0.1)
batches = [(torch.randn(64, 128), torch.randint(0, 10, (64,))) for _ in range(8)]
losses = []
# --- step
for x, y in batches:
    losses.append(torch.nn.functional.cross_entropy(head(backbone(x)), y))
