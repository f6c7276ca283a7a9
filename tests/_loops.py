"""Training loops written the way their projects write them (tiny sizes, random data), for the
tests of whole loops: PyTorch's examples (word_language_model's truncated-BPTT loop, DCGAN's
loop), a WGAN-GP critic loop as its implementations write it, a Hugging Face ``run_clm_no_trainer``
style loop with gradient accumulation on a tiny GPT-2, and two loops that are the same but for a
list of results kept across iterations (a leak) or their ``.item()`` (none).

Each loop is a function of the number of iterations it runs; the model, data and optimizers are
made by ``make_*`` (seeded), so a plain run and a recorded run start from the same state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - as PyTorch's examples import it

Loop = Callable[[int], Any]


# ---------------------------------------------------------------------- word_language_model
class RNNModel(nn.Module):
    """pytorch/examples word_language_model/model.py's RNNModel (LSTM or GRU)."""

    def __init__(self, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:  # noqa: A002
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> Any:
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h: Any) -> Any:
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def make_word_language_model(rnn_type: str = "LSTM", bptt: int = 5, batch_size: int = 4) -> Loop:
    """main.py's ``train()``: one iteration per chunk of ``bptt`` tokens, a backward each, gradients
    clipped and applied by hand (``p.data.add_``), no optimizer."""
    torch.manual_seed(0)
    ntokens, lr, clip = 50, 20.0, 0.25
    model = RNNModel(rnn_type, ntokens, 16, 32, 2, dropout=0.2)
    criterion = nn.NLLLoss()
    data = torch.randint(0, ntokens, (bptt * 400 + 1,))
    nbatch = data.size(0) // batch_size
    train_data = data.narrow(0, 0, nbatch * batch_size).view(batch_size, -1).t().contiguous()

    def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = min(bptt, len(source) - 1 - i)
        return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)

    def train(iterations: int) -> float:
        model.train()
        total_loss = 0.0
        hidden = model.init_hidden(batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
            if batch == iterations:
                break
            data, targets = get_batch(train_data, i)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            total_loss += loss.item()
        return total_loss

    train.model = model  # type: ignore[attr-defined]
    return train


# ---------------------------------------------------------------------- DCGAN
class Generator(nn.Module):
    """pytorch/examples dcgan/main.py's Generator (64x64 images), ``nz``, ``ngf``, ``nc`` small."""

    def __init__(self, nz: int, ngf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return self.main(input)


class Discriminator(nn.Module):
    """pytorch/examples dcgan/main.py's Discriminator."""

    def __init__(self, ndf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return self.main(input).view(-1, 1).squeeze(1)


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)  # type: ignore[arg-type]
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)  # type: ignore[arg-type]
        torch.nn.init.zeros_(m.bias)  # type: ignore[arg-type]


def make_dcgan(batch_size: int = 4) -> Loop:
    """main.py's loop: D on real (a backward), D on ``fake.detach()`` (a backward), D's step; G
    through D on ``fake`` (a backward), G's step."""
    torch.manual_seed(0)
    nz, ngf, ndf, nc = 8, 4, 4, 3
    netG = Generator(nz, ngf, nc)  # noqa: N806
    netG.apply(weights_init)
    netD = Discriminator(ndf, nc)  # noqa: N806
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=0.0002, betas=(0.5, 0.999))  # noqa: N806
    optimizerG = torch.optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999))  # noqa: N806
    images = torch.rand(64, nc, 64, 64) * 2 - 1

    def train(iterations: int) -> list[float]:
        out = []
        for i in range(iterations):
            real_cpu = images[(i * batch_size) % 64:(i * batch_size) % 64 + batch_size]
            netD.zero_grad()
            b = real_cpu.size(0)
            label = torch.full((b,), real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)  # noqa: N806
            errD_real.backward()
            noise = torch.randn(b, nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)  # noqa: N806
            errD_fake.backward()
            errD = errD_real + errD_fake  # noqa: N806
            optimizerD.step()
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)  # noqa: N806
            errG.backward()
            optimizerG.step()
            out.append(errD.item() + errG.item())
        return out

    train.models = (netG, netD)  # type: ignore[attr-defined]
    return train


# ---------------------------------------------------------------------- WGAN-GP
def make_wgan_gp(batch_size: int = 8, n_critic: int = 5) -> Loop:
    """A WGAN-GP loop as its implementations write it: ``n_critic`` critic steps with a gradient
    penalty (``autograd.grad(create_graph=True)``) on ``fake = generator(z).detach()``, then a
    generator step."""
    torch.manual_seed(0)
    nz = 16
    generator = nn.Sequential(nn.ConvTranspose2d(nz, 32, 4, 1, 0, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
                              nn.ConvTranspose2d(32, 1, 4, 2, 1, bias=False), nn.Tanh())
    critic = nn.Sequential(nn.Conv2d(1, 32, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
                           nn.Conv2d(32, 1, 4, 1, 0, bias=False))
    opt_c = torch.optim.Adam(critic.parameters(), 1e-4, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(generator.parameters(), 1e-4, betas=(0.5, 0.9))
    reals = torch.randn(64, 1, 8, 8)

    def gradient_penalty(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        alpha = torch.rand(real.size(0), 1, 1, 1)
        interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_interp = critic(interp)
        grads = torch.autograd.grad(d_interp, interp, torch.ones_like(d_interp), create_graph=True)[0]
        return ((grads.view(real.size(0), -1).norm(2, dim=1) - 1) ** 2).mean()

    def train(iterations: int) -> None:
        for i in range(iterations):
            real = reals[(i * batch_size) % 64:(i * batch_size) % 64 + batch_size]
            z = torch.randn(batch_size, nz, 1, 1)
            fake = generator(z).detach()
            opt_c.zero_grad()
            loss_c = critic(fake).mean() - critic(real).mean() + 10 * gradient_penalty(real, fake)
            loss_c.backward()
            opt_c.step()
            if i % n_critic == n_critic - 1:
                opt_g.zero_grad()
                loss_g = -critic(generator(torch.randn(batch_size, nz, 1, 1))).mean()
                loss_g.backward()
                opt_g.step()

    train.models = (generator, critic)  # type: ignore[attr-defined]
    return train


# ---------------------------------------------------------------------- Hugging Face, gradient accumulation
def make_hf_accumulation(accumulation: int = 2, batch_size: int = 2) -> Loop:
    """transformers' ``run_clm_no_trainer.py`` loop on a tiny random GPT-2: ``loss /
    gradient_accumulation_steps``, a backward per batch, the optimizer's and the scheduler's step
    every ``accumulation`` batches."""
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    model.train()
    no_decay = ["bias", "layer_norm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=5e-5)
    ids = torch.randint(0, 64, (256, 12))

    def train(iterations: int) -> None:
        steps = iterations * accumulation
        lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0,
                                                       num_training_steps=math.ceil(steps / accumulation))
        for step in range(steps):
            start = (step * batch_size) % 256
            batch = {"input_ids": ids[start:start + batch_size], "labels": ids[start:start + batch_size]}
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / accumulation
            loss.backward()
            if step % accumulation == accumulation - 1 or step == steps - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

    train.model = model  # type: ignore[attr-defined]
    return train


# ---------------------------------------------------------------------- a leak, and the same loop without it
def make_classifier(keep: str) -> Loop:
    """A classifier's loop that keeps something of each iteration in a list: ``"loss"`` (the loss
    tensor: a classic leak), ``"output"`` (the logits, kept across iterations) or ``"item"`` (the
    loss's ``.item()``: no leak)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = torch.randn(512, 32), torch.randint(0, 10, (512,))
    history: list[Any] = []

    def train(iterations: int) -> list[Any]:
        for i in range(iterations):
            x, y = xs[(i * 16) % 512:(i * 16) % 512 + 16], ys[(i * 16) % 512:(i * 16) % 512 + 16]
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            history.append(loss if keep == "loss" else out if keep == "output" else loss.item())
        return history

    train.model = model  # type: ignore[attr-defined]
    train.history = history  # type: ignore[attr-defined]
    return train
