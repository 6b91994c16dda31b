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

A researcher's own task is named ``module:attr`` (``--task my_task.tasks:build``): ``attr`` is a function
``build(seed: int) -> TaskSpec`` in an importable module (an installed package, or a folder on
``PYTHONPATH``). :class:`TaskSpec` is the protocol; :func:`get` imports, builds and checks it (one trial
step before any run), raising :class:`~sparsecomm.errors.ConfigError` that names the task and what is
wrong. ``docs/your-own-task.md`` is the guide.
"""

from __future__ import annotations

import importlib
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from sparsecomm.errors import ConfigError, InvalidTypeError, InvalidValueError, UnknownNameError
from sparsecomm.registry import Registry

registry: Registry[Callable[..., "Task"]] = Registry("task")


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Task:
    """A model factory, per-worker batches and a held-out evaluation. Subclasses fill the data."""

    name = ""
    #: what :meth:`evaluate`'s second number measures (higher is better; the ``test_acc`` column)
    metric = "accuracy"
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


# ------------------------------------------------------------------------------- your own task
@dataclass(frozen=True)
class TaskSpec:
    """What a researcher's ``build(seed: int)`` returns: the protocol of a task named ``module:attr``.

    ``build`` is called once per process (the simulated workers of one process share the result; under
    ``gloo`` or ``torchrun`` every process calls it) and must be deterministic in ``seed``: every worker
    must build the same data and the same initial model.

    :param name: a short name for titles, file names and wandb groups (e.g. ``"sine-regression"``).
    :param model: ``model() -> nn.Module``: a fresh model, called once per worker; every call returns the
        same initial weights (seed them from ``build``'s ``seed``, e.g. under ``torch.random.fork_rng``).
    :param batch: ``batch(rank, world_size, step, batch_size)``: worker ``rank``'s mini-batch at ``step``
        (``1..steps``), anything ``loss`` takes; draw it from worker ``rank``'s shard of the data.
    :param loss: ``loss(model, batch) -> torch.Tensor``: the scalar training loss (backpropagated).
    :param evaluate: ``evaluate(model) -> (held_out_loss, metric)``: two numbers on held-out data, the
        metric higher-is-better (the ``test_acc`` column; time-to-target reaches it from below).
    :param lr: learning rate of the inner SGD (``--lr`` overrides it).
    :param steps: optimizer steps (``--steps`` overrides it).
    :param batch_size: mini-batch per worker (``--batch-size`` overrides it).
    :param metric: what ``evaluate``'s second number is, for axis labels (``"accuracy"``, ``"AUC"``, ...).
    :param param_groups: ``param_groups(model, lr) -> list[dict]`` for the inner SGD; ``None``: one group
        of every parameter at ``lr``.
    :raises InvalidTypeError: a field of the wrong type.
    :raises InvalidValueError: an empty name, or a non-positive ``lr``, ``steps`` or ``batch_size``.
    """

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int, int, int, int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    evaluate: Callable[[nn.Module], tuple[float, float]]
    lr: float = 0.1
    steps: int = 100
    batch_size: int = 32
    metric: str = "accuracy"
    param_groups: Callable[[nn.Module, float], list[dict]] | None = None

    def __post_init__(self) -> None:
        for field_name in ("name", "metric"):
            v = getattr(self, field_name)
            if not isinstance(v, str) or not v:
                raise InvalidValueError(f"TaskSpec.{field_name} must be a non-empty string, got {v!r}")
        for field_name in ("model", "batch", "loss", "evaluate"):
            if not callable(getattr(self, field_name)):
                raise InvalidTypeError(f"TaskSpec.{field_name} must be callable (a function), got "
                                       f"{type(getattr(self, field_name)).__name__}")
        if self.param_groups is not None and not callable(self.param_groups):
            raise InvalidTypeError(f"TaskSpec.param_groups must be callable or None, got "
                                   f"{type(self.param_groups).__name__}")
        for field_name in ("steps", "batch_size"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise InvalidValueError(f"TaskSpec.{field_name} must be a positive integer, got {v!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, numbers.Real) or not self.lr > 0:
            raise InvalidValueError(f"TaskSpec.lr must be a positive number, got {self.lr!r}")


class SpecTask(Task):
    """A :class:`TaskSpec` behind the interface the training loop uses (the bundled tasks' own)."""

    def __init__(self, spec: TaskSpec, seed: int, ref: str) -> None:
        super().__init__(seed)
        self.spec, self.ref = spec, ref
        self.name, self.metric = spec.name, spec.metric
        self.lr, self.steps, self.batch_size = float(spec.lr), int(spec.steps), int(spec.batch_size)

    def build_model(self) -> nn.Module:
        return self.spec.model()

    def batch(self, rank: int, world_size: int, step: int, batch_size: int) -> Any:
        return self.spec.batch(rank, world_size, step, batch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.spec.loss(model, batch)

    def param_groups(self, model: nn.Module, lr: float) -> list[dict]:
        if self.spec.param_groups is None:
            return super().param_groups(model, lr)
        return self.spec.param_groups(model, lr)

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            loss, metric = self.spec.evaluate(model)
        return float(loss), float(metric)

    def describe(self) -> str:  # type: ignore[override]
        return f"{self.name} ({self.ref})"


def is_external(ref: str) -> bool:
    """Whether ``ref`` names a researcher's task (``module:attr``) rather than a bundled one."""
    return isinstance(ref, str) and ":" in ref


def _load_external(ref: str, seed: int) -> SpecTask:
    module_name, _, attr = ref.partition(":")
    where = f"task {ref!r}"
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"{where}: expected module:function, e.g. my_task.tasks:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e}); install "
                          f"its package or put its folder on PYTHONPATH") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{where}: {attr!r} is a {type(target).__name__}, not a function build(seed) -> TaskSpec")
    try:
        spec = target(seed)
    except Exception as e:  # the researcher's code: say whose and keep their message
        raise ConfigError(f"{where}: {attr}(seed={seed}) raised {type(e).__name__}: {e}") from e
    if not isinstance(spec, TaskSpec):
        raise ConfigError(f"{where}: {attr}(seed={seed}) returned {type(spec).__name__}, expected a TaskSpec "
                          f"(from sparsecomm.experiments.common.tasks import TaskSpec)")
    task = SpecTask(spec, seed, ref)
    trial(task)
    return task


def trial(task: SpecTask, world_size: int = 2) -> None:
    """Check a researcher's task once before any run: two models with the same initial weights, a
    mini-batch whose loss is a differentiable scalar, an evaluation of two numbers.

    :raises ConfigError: naming the task, the function and what it returned.
    """
    where, spec = f"task {task.ref!r}", task.spec

    def call(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise ConfigError(f"{where}: {what} raised {type(e).__name__}: {e}") from e

    models = [call("model()", spec.model) for _ in range(2)]
    for m in models:
        if not isinstance(m, nn.Module):
            raise ConfigError(f"{where}: model() returned {type(m).__name__}, expected a torch.nn.Module")
    params = [list(m.parameters()) for m in models]
    if not any(p.requires_grad for p in params[0]):
        raise ConfigError(f"{where}: model() returned a module with no trainable parameters")
    if len(params[0]) != len(params[1]) or any(a.shape != b.shape or not torch.equal(a, b)
                                               for a, b in zip(*params)):
        raise ConfigError(f"{where}: two calls of model() returned different initial weights; every worker "
                          f"must start from the same model (seed its initialisation from build's seed)")
    batch = call(f"batch(0, {world_size}, 1, {task.batch_size})",
                 lambda: spec.batch(0, world_size, 1, task.batch_size))
    loss = call("loss(model, batch)", lambda: spec.loss(models[0], batch))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"{where}: loss(model, batch) returned {got}, expected a scalar float tensor")
    if not loss.requires_grad:
        raise ConfigError(f"{where}: loss(model, batch) does not depend on the model's parameters "
                          f"(it has no gradient)")
    with torch.no_grad():
        ev = call("evaluate(model)", lambda: spec.evaluate(models[0]))
    if not isinstance(ev, (tuple, list)) or len(ev) != 2 or not all(_is_number(v) for v in ev):
        raise ConfigError(f"{where}: evaluate(model) returned {ev!r}, expected two numbers "
                          f"(held_out_loss, metric)")


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


_lock = threading.Lock()
_built: dict[tuple[str, int], Task] = {}


def get(name: str, seed: int = 0) -> Task:
    """Task ``name`` built for ``seed``, once per process (simulated workers share its read-only data):
    a bundled name, or ``module:attr`` naming a ``build(seed) -> TaskSpec`` (imported, built and checked
    by :func:`trial`).

    :raises UnknownNameError: an unknown bundled name (the message lists them and the ``module:attr`` form).
    :raises ConfigError: a ``module:attr`` that does not import, is not a function, or builds a task that
        fails its trial (the message names what is wrong).
    """
    key = (name, int(seed))
    with _lock:
        task = _built.get(key)
        if task is None:
            if len(_built) >= 16:
                _built.pop(next(iter(_built)))
            task = _built[key] = _load_external(name, seed) if is_external(name) else _bundled(name)(seed=seed)
        return task


def _bundled(name: str) -> Callable[..., Task]:
    try:
        return registry.factory(name)
    except UnknownNameError:
        raise UnknownNameError(f"unknown task {name!r}; valid names: {', '.join(available())}, or module:function "
                               f"naming your own build(seed) -> TaskSpec (docs/your-own-task.md)") from None


def defaults(name: str, seed: int = 0) -> tuple[int, int, float]:
    """``(steps, batch_size, lr)`` of task ``name`` (a bundled one's without building it)."""
    t: Any = get(name, seed) if is_external(name) else _bundled(name)
    return int(t.steps), int(t.batch_size), float(t.lr)


def check(name: str, seed: int = 0) -> None:
    """Raise the error :func:`get` would for ``name`` (bundled names are looked up, not built)."""
    get(name, seed) if is_external(name) else _bundled(name)


def metric_of(name: str, seed: int = 0) -> str:
    """What task ``name``'s evaluation metric is (``"accuracy"`` for the bundled tasks)."""
    return (get(name, seed) if is_external(name) else _bundled(name)).metric


def display_name(name: str, seed: int = 0) -> str:
    """The task's short name: a bundled name as is, a researcher's task by its ``TaskSpec.name``."""
    return get(name, seed).name if is_external(name) else name


def available() -> list[str]:
    """The bundled task names."""
    return registry.available()
