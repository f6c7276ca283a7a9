"""Truncated backpropagation through time, as the word-language-model example writes it: an LSTM over
a long sequence in chunks, the hidden state detached between them, a step per chunk."""
# --- setup
import torch

torch.manual_seed(0)
rnn = torch.nn.LSTM(32, 256, num_layers=2, dropout=0.2)
decoder = torch.nn.Linear(256, 32)
params = list(rnn.parameters()) + list(decoder.parameters())
optimizer = torch.optim.SGD(params, lr=0.1)
data = torch.randn(256, 16, 32)
bptt = 64
hidden = (torch.zeros(2, 16, 256), torch.zeros(2, 16, 256))
# --- step
for i in range(0, data.size(0) - 1, bptt):
    seq = data[i:i + bptt]
    target = data[i + 1:i + 1 + bptt]
    hidden = tuple(h.detach() for h in hidden)
    output, hidden = rnn(seq[: target.size(0)], hidden)
    loss = torch.nn.functional.mse_loss(decoder(output), target)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.25)
    optimizer.step()
