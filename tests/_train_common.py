"""Shared pieces of the optimizer / DDP tests: a small MLP, per-rank data, the plain-SGD reference.

Module-level functions only, so that spawned gloo processes can import them.
"""

from __future__ import annotations

import torch
from torch import nn

IN, HID, OUT = 6, 16, 3


class MLP(nn.Module):
    """A small MLP plus a parameter that never receives a gradient (``unused``)."""

    def __init__(self, seed: int = 0, dtype=torch.float32, with_unused: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1 = nn.Linear(IN, HID).to(dtype)
        self.l2 = nn.Linear(HID, OUT).to(dtype)
        if with_unused:
            self.unused = nn.Parameter(torch.zeros(5, dtype=dtype))
        with torch.no_grad():
            for p in (self.l1.weight, self.l1.bias, self.l2.weight, self.l2.bias):
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def batch(rank: int, step: int, n: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, IN, generator=g, dtype=dtype)
    y = torch.randn(n, OUT, generator=g, dtype=dtype)
    return x, y


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def make_inner(model, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def reference(world_size: int, steps: int, dtype=torch.float32, inner=make_inner, with_unused=True):
    """Plain averaged SGD (or ``inner(model)``): the mean of the workers' gradients, one process."""
    model = MLP(0, dtype, with_unused)
    opt = inner(model)
    for t in range(steps):
        grads = []
        for r in range(world_size):
            opt.zero_grad()
            x, y = batch(r, t, dtype=dtype)
            loss_fn(model(x), y).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            gs = [g[i] for g in grads if g[i] is not None]
            p.grad = sum(gs) / world_size if gs else torch.zeros_like(p)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train(ctx, steps: int, make_opt, dtype=torch.float32):
    """Train the MLP on this rank's data with the optimizer ``make_opt(model)``; return the params."""
    model = MLP(0, dtype)
    opt = make_opt(model)
    for t in range(steps):
        opt.zero_grad()
        x, y = batch(ctx.rank, t, dtype=dtype)
        loss_fn(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def compression_stats_after_two_steps(ctx, transport, compressor, kw, d):
    """Two ``DistributedOptimizer`` steps of a linear loss on ``d`` weights (gradients seeded per rank
    and step); returns the transport's name and ``compression_stats()``."""
    import sparsecomm as sc

    w = nn.Parameter(torch.randn(d, generator=torch.Generator().manual_seed(1)))
    opt = sc.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), compressor=compressor, transport=transport, **kw)
    for step in range(2):
        opt.zero_grad()
        g = torch.randn(d, generator=torch.Generator().manual_seed(10 * ctx.rank + step))
        (w * g).sum().backward()
        opt.step()
    return opt.transport.name, opt.compression_stats()
