"""One DistributedOptimizer training step per torchrun rank: the netbed's "beyond one machine" recipe.

Run one torchrun per host (here: per netbed host; on a real cluster: per machine)::

    python -m sparsecomm.netbed run --hosts 2 --gbps 1 -- \\
        torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-id netbed \\
                 --rdzv-endpoint {store_addr}:{store_port} --rdzv-conf is_host=false \\
                 --local-addr {host_addr} -m experiments.netbed_train_step --out /tmp/step

(the rendezvous store on the netbed's top of rack, which outlives every agent: docs/netbed.md).

Every rank builds the same small model (fixed seed), computes a gradient on its own batch, and takes
one ``DistributedOptimizer`` step (plain SGD, gradients averaged by ``--transport``); with ``--out DIR``
it writes its parameters after the step to ``DIR/rank<R>.pt`` (each rank its own file, nothing is
gathered across ranks) and prints one line.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import sparsecomm as sc

IN, OUT = 6, 3


def model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Linear(IN, OUT)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)


def loss(m: nn.Module, rank: int) -> torch.Tensor:
    x, y = batch(rank)
    return ((m(x) - y) ** 2).mean()


def reference(world_size: int, lr: float = 0.1) -> list[torch.Tensor]:
    """The same step in one process: SGD on the mean of every rank's gradient."""
    m = model()
    grads = []
    for r in range(world_size):
        m.zero_grad()
        loss(m, r).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p -= lr * sum(g[i] for g in grads) / world_size
    return [p.detach().clone() for p in m.parameters()]


def step(ctx, transport: str = "native", lr: float = 0.1) -> list[torch.Tensor]:
    m = model()
    opt = sc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr), transport=transport)
    opt.zero_grad()
    loss(m, ctx.rank).backward()
    opt.step()
    return [p.detach().clone() for p in m.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="native")
    ap.add_argument("--out", default=None, help="directory for this rank's parameters after the step")
    a = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    params: list[torch.Tensor] = []

    def fn(ctx):
        params[:] = step(ctx, a.transport)

    sc.launch(fn, world_size=world, backend="gloo", timeout_s=60)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        torch.save(params, os.path.join(a.out, f"rank{rank}.pt"))
    print(f"rank {rank}/{world} on {os.environ.get('NETBED_HOST_ADDR', 'this host')}: step done, "
          f"|w| = {float(sum(p.norm() for p in params)):.6f}")


if __name__ == "__main__":
    main()
