"""The bundled training tasks: a model, its data sharded over workers, a loss and an evaluation.

Every task is deterministic for a seed and draws randomness only from explicit generators (model
initialisation included), so that n simulated workers in threads and n real processes build the same
model and the same shards.

``recsys-zipf``
    An embedding-heavy click model on synthetic interactions: users and items are drawn from Zipf
    distributions (ids ranked by popularity), labels from a hidden low-rank model. The embedding tables
    hold ~97 % of the parameters and a batch touches a few dozen rows, so the gradient is genuinely
    block-sparse: most blocks of ``block_size`` consecutive coordinates are exactly zero (the case
    OmniReduce was built for, Fei et al. SIGCOMM'21, DeepLight/NCF).
``digits-mlp``
    A two-layer MLP on scikit-learn's bundled 8x8 digits (1797 images, 10 classes): dense gradients.
``breast-cancer-logreg``
    Logistic regression on scikit-learn's bundled breast-cancer set (569 x 30, standardised by
    :func:`theory.problems.load_dataset`): a convex problem with 31 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from sparsecomm.registry import Registry

registry: Registry[Callable[..., "Task"]] = Registry("task")


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Task:
    """A model factory, per-worker batches and a held-out evaluation. Subclasses fill the data."""

    name = ""
    #: defaults a run may override
    lr = 0.1
    batch_size = 32
    steps = 100
    #: standard deviation of the embedding tables' initialisation
    embedding_std = 0.1

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    # -- model
    def build_model(self) -> nn.Module:
        """The model, initialised from the task's seed only (identical on every worker)."""
        model = self._model()
        gen = torch.Generator().manual_seed(self.seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    bound = 1.0 / math.sqrt(m.in_features)
                    m.weight.uniform_(-bound, bound, generator=gen)
                    if m.bias is not None:
                        m.bias.uniform_(-bound, bound, generator=gen)
                elif isinstance(m, nn.Embedding):
                    m.weight.normal_(0.0, self.embedding_std, generator=gen)
        return model

    def _model(self) -> nn.Module:
        raise NotImplementedError

    # -- data
    def batch(self, rank: int, world_size: int, step: int, batch_size: int) -> Batch:
        """Worker ``rank``'s mini-batch at ``step``: a deterministic draw (with replacement) from its
        shard, the ``rank``-th of ``world_size`` interleaved slices of a seeded permutation."""
        idx = self._permutation()[rank::world_size]
        gen = torch.Generator().manual_seed(hash_seed(self.seed, rank, step))
        pick = idx[torch.randint(len(idx), (batch_size,), generator=gen)]
        return Batch(self.x_train[pick], self.y_train[pick])

    def _permutation(self) -> torch.Tensor:
        perm = getattr(self, "_perm", None)
        if perm is None:  # computed once (a race between worker threads computes the same tensor)
            perm = self._perm = torch.randperm(len(self.y_train),
                                               generator=torch.Generator().manual_seed(self.seed + 2))
        return perm

    @staticmethod
    def _criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._criterion(model(batch.x), batch.y)

    def param_groups(self, model: nn.Module, lr: float) -> list[dict]:
        """Parameter groups for the inner optimizer (one group at ``lr`` by default)."""
        return [{"params": list(model.parameters()), "lr": lr}]

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(loss, accuracy) on the held-out set."""
        with torch.no_grad():
            out = model(self.x_test)
            return float(self._criterion(out, self.y_test)), float(self._accuracy(out, self.y_test))

    @classmethod
    def describe(cls) -> str:
        return cls.__doc__.strip().splitlines()[0] if cls.__doc__ else cls.name


class _BinaryTask(Task):
    """Tasks with one logit per example and labels in {0, 1}."""

    @staticmethod
    def _criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y)

    @staticmethod
    def _accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out.reshape(-1) > 0).float() == y).float().mean()


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


# ------------------------------------------------------------------------------- recsys-zipf
class ClickModel(nn.Module):
    """Embedding tables for users and items, concatenated into a small MLP (a DLRM/NCF-style tower)."""

    def __init__(self, n_users: int, n_items: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.users = nn.Embedding(n_users, dim)
        self.items = nn.Embedding(n_items, dim)
        self.item_bias = nn.Embedding(n_items, 1)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = self.users(x[:, 0]), self.items(x[:, 1])
        mlp = self.mlp(torch.cat([u, i], dim=1)).squeeze(1)
        return mlp + (u * i).sum(1) + self.item_bias(x[:, 1]).squeeze(1)


@registry.register("recsys-zipf")
class RecsysZipf(_BinaryTask):
    """Click prediction on synthetic Zipf-distributed interactions (embedding-heavy, block-sparse gradients)."""

    name = "recsys-zipf"
    lr = 0.5
    batch_size = 32
    steps = 60
    embedding_std = 0.05

    def __init__(self, seed: int = 0, n_users: int = 2048, n_items: int = 1024, dim: int = 16,
                 hidden: int = 32, zipf_a: float = 1.2, n_train: int = 100_000, n_test: int = 4096) -> None:
        super().__init__(seed)
        self.n_users, self.n_items, self.dim, self.hidden = n_users, n_items, dim, hidden
        rng = np.random.default_rng([seed, 7])
        # hidden preferences: a low-rank affinity plus a popularity bias (popular items are clicked more)
        rank = 4
        tu = rng.normal(size=(n_users, rank))
        ti = rng.normal(size=(n_items, rank))
        item_bias = 1.5 - 3.0 * np.log1p(np.arange(n_items)) / np.log1p(n_items)
        pu = zipf_probs(n_users, zipf_a)
        pi = zipf_probs(n_items, zipf_a)

        def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            u = rng.choice(n_users, size=n, p=pu)
            i = rng.choice(n_items, size=n, p=pi)
            logit = 1.5 * (tu[u] * ti[i]).sum(1) / math.sqrt(rank) + item_bias[i]
            y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
            return torch.from_numpy(np.stack([u, i], 1)).long(), torch.from_numpy(y)

        self.x_train, self.y_train = draw(n_train)
        self.x_test, self.y_test = draw(n_test)

    def _model(self) -> nn.Module:
        return ClickModel(self.n_users, self.n_items, self.dim, self.hidden)

    #: embedding rows see a 1/batch share of the loss, so they step ``embedding_lr_mult`` times faster
    embedding_lr_mult = 40.0

    def param_groups(self, model: nn.Module, lr: float) -> list[dict]:
        emb = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
        ids = {id(p) for p in emb}
        dense = [p for p in model.parameters() if id(p) not in ids]
        return [{"params": emb, "lr": lr * self.embedding_lr_mult}, {"params": dense, "lr": lr}]


def zipf_probs(n: int, a: float) -> np.ndarray:
    """P(rank k) proportional to k^-a, k = 1..n (id 0 is the most popular)."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -a
    return p / p.sum()


# --------------------------------------------------------------------------- classification
class _Classification(Task):
    """Shared by the scikit-learn tasks: standardised features, a stratification-free 80/20 split."""

    def _split(self, X: np.ndarray, y: np.ndarray, y_dtype: torch.dtype) -> None:
        perm = np.random.default_rng([self.seed, 11]).permutation(len(y))
        cut = int(0.8 * len(y))
        tr, te = perm[:cut], perm[cut:]
        X = torch.tensor(X, dtype=torch.float32)
        y = torch.tensor(y).to(y_dtype)
        self.x_train, self.y_train = X[tr], y[tr]
        self.x_test, self.y_test = X[te], y[te]


@registry.register("digits-mlp")
class DigitsMLP(_Classification):
    """A 64-64-10 MLP on scikit-learn's bundled digits (dense gradients)."""

    name = "digits-mlp"
    lr = 0.2
    batch_size = 32
    steps = 60

    def __init__(self, seed: int = 0, hidden: int = 64) -> None:
        super().__init__(seed)
        from sklearn.datasets import load_digits

        X, t = load_digits(return_X_y=True)
        X = X / 16.0
        X = (X - X.mean(0)) / (X.std(0) + 1e-6)
        self.hidden = hidden
        self._split(X, t, torch.long)

    def _model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))

    @staticmethod
    def _criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    @staticmethod
    def _accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.argmax(1) == y).float().mean()


@registry.register("breast-cancer-logreg")
class BreastCancerLogReg(_Classification, _BinaryTask):
    """Logistic regression on scikit-learn's bundled breast-cancer set (convex, 31 parameters)."""

    name = "breast-cancer-logreg"
    lr = 0.5
    batch_size = 16
    steps = 60

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        from sparsecomm.theory.problems import load_dataset

        X, y = load_dataset("breast_cancer")          # standardised, labels in {-1, +1}
        self._split(X, (y > 0).astype(np.float32), torch.float32)

    def _model(self) -> nn.Module:
        return nn.Linear(self.x_train.shape[1], 1)


def get(name: str, seed: int = 0) -> Task:
    """Build task ``name``; an unknown name raises listing the bundled tasks."""
    return registry.get(name, seed=seed)


def available() -> list[str]:
    return registry.available()
