"""A teacher-student classification task: 20 Gaussian features, 3 classes given by a hidden linear
teacher, learnt by a small MLP. Run it with::

    python -m sparsecomm.experiments.convergence --task my_task.tasks:build --workers 2
"""

from __future__ import annotations

import torch
from torch import nn

from sparsecomm.experiments.common.tasks import TaskSpec

FEATURES, CLASSES, HIDDEN = 20, 3, 32
N_TRAIN, N_TEST = 4000, 1000


def build(seed: int) -> TaskSpec:
    """The task for ``seed``: the same data and the same initial model in every process."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, FEATURES, generator=gen)
        return x, (x @ teacher).argmax(1)

    x_train, y_train = draw(N_TRAIN)
    x_test, y_test = draw(N_TEST)

    def model() -> nn.Module:
        # the same initial weights on every call (every worker builds its own copy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))

    def batch(rank: int, world_size: int, step: int, batch_size: int):
        # worker `rank` samples its own shard: every world_size-th example, from a seeded generator
        shard = torch.arange(rank, N_TRAIN, world_size)
        g = torch.Generator().manual_seed((seed * 65_536 + rank) * 1_000_000 + step)
        pick = shard[torch.randint(len(shard), (batch_size,), generator=g)]
        return x_train[pick], y_train[pick]

    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(model: nn.Module) -> tuple[float, float]:
        out = model(x_test)
        return (nn.functional.cross_entropy(out, y_test).item(),
                (out.argmax(1) == y_test).float().mean().item())

    return TaskSpec(name="teacher-mlp", model=model, batch=batch, loss=loss, evaluate=evaluate,
                    lr=0.2, steps=40, batch_size=32, metric="accuracy")
