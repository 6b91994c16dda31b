"""Time to accuracy on an emulated rack: each scheme trains the same model to the same held-out target
on real gloo processes over a netbed, against stock DDP (the end-to-end claim of OmniReduce, Fei et al.,
SIGCOMM '21, and SwitchML, Sapio et al., NSDI '21).

    python -m experiments.reproduce_training --netbed 1 --hosts 4                 # both models (root)
    python -m experiments.reproduce_training --netbed 1 --hosts 4 --models emb    # one model
    python -m experiments.reproduce_training --netbed 1 --hosts 2 --quick --models emb   # a smoke run
    python -m experiments.reproduce_training --netbed 1 --hosts 4 --models emb \
        --schemes "hook none/switch,hook none/sparse-switch" --time-cap 120 --merge     # redo some, keep the rest
    python -m experiments.reproduce_training --netbed 1 --hosts 2 --models mlp \
        --schemes "ddp,hook powersgd,torch powersgd" --breakdown     # where a step's time goes, per scheme
    python -m experiments.reproduce_training --remodel OUT --profile host.json   # a recorded run's modelled column
                                                                                  # again, nothing trained
    python -m experiments.reproduce_training --remodel OUT --profile host.json --compute compute_max_s

**Models.**

* ``emb``: a recommendation model in the DeepLight / NCF mould: ``FIELDS`` categorical fields, each a
  table of ``VOCAB`` rows of ``DIM`` floats (one ``nn.Embedding`` holding the tables one after another,
  ``sparse=False``: its gradient is dense in memory and zero outside the rows a batch touched, the
  block-sparse form OmniReduce exploits), a small dense tower on the concatenated field vectors and a
  logistic output. Synthetic click data with a known signal: a field's id is Zipf-distributed (exponent
  ``ZIPF``, the ranks scattered over the table by a fixed permutation, as hashed ids are), the label is
  ``Bernoulli(sigmoid(sum_f w_f[id_f]))`` with ``w_f[id] ~ N(0, SIGNAL^2)`` fixed; the metric is the
  held-out ROC AUC, the target a fixed fraction of the way from 0.5 to the Bayes AUC (the true logits'
  AUC on the same held-out set), so it is reachable by construction.
* ``mlp``: a dense MLP ``64 -> WIDTH -> WIDTH -> 10`` on scikit-learn's digits (1797 8x8 images, 20%
  held out); the metric is held-out accuracy. Its gradient has no zero blocks: block sparsity buys
  nothing here (the papers' CNNs gain about 1x too).

With ``nn.Embedding(sparse=True)`` the picture changes: stock DDP then runs gloo's sparse all-reduce,
which moves only the touched rows, the hook averages the rows without densifying the table
(:mod:`sparsecomm.ddp`, "Sparse gradients") and refuses compressing methods, so DDP itself is no longer
network-bound on the table (BENCHMARKS.md, "Embedding model on the netbed"); the dense-format gradient
with zero rows is the case OmniReduce's block sparsity addresses, and the one this study times.

**Schemes** (``--hosts`` workers on a netbed at ``--netbed`` Gbit/s, the switch services on the top of
rack; stock DDP in a launch of its own, then one launch per set of services, its schemes in turn): stock DDP (gloo's ring all-reduce); DDP with
:func:`sparsecomm.ddp.register` for ``compressor="none"`` on ``omnireduce``, ``switch`` and
``sparse-switch``; PowerSGD (rank ``POWERSGD_RANK``) and error feedback + top-k through the same hook
(the default transport); torch's own ``powerSGD_hook`` (``torch powersgd``: DDP with ``PowerSGDState(group,
matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=TORCH_POWERSGD_START)``, torch's smallest start,
one step after the library hook's first compressed step; the hook called for a bucket once the previous
bucket's future completed, as gloo needs: :class:`TorchPowerSGD`); :class:`~sparsecomm.DistributedOptimizer`
with ``none`` on ``omnireduce`` (no DDP buckets: the whole gradient after backward, in the optimizer). Every
scheme starts from the same
weights and sees the same batches (worker ``r``'s batch ``t`` is drawn from seed ``(r, t)``).

**Clock.** Each scheme first runs ``WARMUP`` steps on a throwaway replica (first calls: compilation,
connections, the services), then trains a fresh one. A step is ``zero_grad, forward, backward, step``;
its wall time is summed per worker; the held-out evaluation every ``eval_every`` steps is not timed
(the workers evaluate their identical replicas, then agree on the slowest worker's elapsed time and on
the metric with one small untimed all-reduce). ``time_to_target_s`` is that elapsed time at the first evaluation at or above the target;
a scheme that does not reach it within ``max_steps``, or within ``--time-cap`` seconds of training
(default ``--cap-factor`` = 2 times stock DDP's time to target, at least 30 s), is ``reached=False``.

**Columns.** ``bytes_per_step``: bytes on the busiest link direction per step, the mean over the run:
stock DDP's counted (its ring moves ``2 (n-1)/n`` of the gradient each way per worker), torch's
PowerSGD hook's counted alike from what it all-reduces (per bucket its uncompressed tensors, its Ps and its Qs;
the whole bucket before its start: :class:`TorchPowerSGD`), the library's from its ledgers (``last_stats``:
the larger of a worker's bytes sent and received, the busiest worker).
``compute_s``: a step with no communication at all (the same model, optimizer and batches, every
worker at once, so the CPU is shared as in training, each step started after a barrier as a training step starts
when the collectives before it let the workers go), the largest of the workers' medians over ``COMPUTE_STEPS``;
beside it (:func:`compute_stats`) ``compute_mean_s``, the largest of their means, and ``compute_max_s``, the mean
over the steps of each step's slowest worker; ``ddp_compute_s``, ``ddp_compute_mean_s`` and ``ddp_compute_max_s``,
the same of DistributedDataParallel's step whose comm hook communicates nothing (DDP's own work: its autograd hooks,
its copies of the gradients into its buckets and back). The modelled and link-only columns add ``compute_mean_s``
(the modelled column of a scheme trained under DDP, ``ddp_compute_mean_s``) to a step:
a time to target is a sum of steps, of which ``step_s`` is the mean, and on shared cores the step times are
right-skewed (the median falls below the mean). Not ``compute_max_s``: a bulk-synchronous step waits for its
slowest worker, but the host profile's ``sync_s`` already charges a call's wait for its last worker (the first call
of a step all of it, after the step's compute, which the model declares to the fabric; a call right after another
less, ``sync_work_s``), which a per-step maximum would count again (``--remodel DIR --compute NAME`` models a
recorded run with another);
``step_s``: the measured mean step; ``comm_fraction = 1 - compute_mean_s / step_s``, the share of a step not spent
in the model's own forward, backward and update (communication, and for compressors their encoding).
``modelled_s``: the prediction of the same run through the SimFabric, ``steps_to_target * (compute_mean_s +
modelled_comm_s)`` (``ddp_compute_mean_s`` under DDP), and ``modelled_ratio = modelled_s / time_to_target_s``.
``modelled_comm_s`` is one step's communication modelled by running the scheme's own calls on
``sc.launch(..., backend="sim")`` (:func:`modelled_comm_s`): the same model, batches and real gradients,
``MODEL_STEPS`` steps, the last one timed on the modelled clock (step 0 is the hook's uncompressed step); a ``hook`` scheme runs the hook's body
(``CommHookState.start_bucket``) on stock DDP's steady bucket layout (:func:`ddp_buckets`), stock DDP is the
hook's plain average on the ``ring`` (gloo's algorithm), the optimizer scheme is ``DistributedOptimizer``; DDP's
own work is in its measured step (``ddp_compute_mean_s``), the optimizer's gather of the gradients into its bucket
a host copy (:func:`_model_worker`).
The network (:func:`modelled_network`) is the netbed's links at TCP's payload rate
(:data:`sparsecomm.fabric.sim.sim_network.TCP_OVER_ETHERNET`) and the wire's latency, with the host of
``--profile PATH`` (``python -m sparsecomm.netbed calibrate --out PATH``: its rates, shared by the hosts and
services on this machine's cores) or, without one, the SimFabric's default host (no host cost; a full-size
switch is then modelled one 64-value datagram at a time and takes minutes). Overlap rule: none; the step is
compute then communication, as a step on the netbed's shared cores runs its host's communication work on
the cores its compute needs (an upper bound where backward and communication do overlap). ``link_only_s``
(``link_only_ratio``): the closed form beside it, ``steps_to_target * (compute_mean_s + bytes_per_step /
(rate * TCP_OVER_ETHERNET))``, the bytes at the link rate with no latency and no host. ``torch powersgd`` has
no modelled column (NaN): its hook calls ``torch.distributed``, which the SimFabric does not run.

**Breakdown** (``--breakdown``). After its timed run each scheme runs ``BREAKDOWN_STEPS`` more steps on the
trained replica, recorded on a timeline (:func:`sparsecomm.trace.record`: one file per worker,
``OUT/breakdown/<model>_<scheme>.rankR.json``, to open in Perfetto), and the table ``breakdown.csv`` (printed
too) splits a step, in ms, the mean over the steps and the workers: ``step`` (wall time), ``compute`` (the
same batch's step with no communication, on a local replica, right before it: timed under the same load),
``encode`` (the method's work before a round's send: for PowerSGD the error feedback, the
products and the orthogonalisation of both rounds), ``transport`` (time inside transport calls: messages,
sums, and ``wait``, the waits for a message within them; a posted ``native`` all-reduce is the wait for its
collective), ``decode`` (the estimate from the last sum, the error update) and ``remainder`` (the rest: the
hook's posting, futures and thread hand-offs). The transport and later rounds run on the communication
thread while backward goes on, so the remainder is what they do not hide and can be negative. Stock DDP and
torch's hook make no library call: their communication is all ``remainder``. Then CPU times: ``step_cpu`` and
``compute_cpu`` (the process's, every thread, over the step and over the step with no communication) and
``transport_cpu`` (the library calls' own thread's): a scheme whose ``compute`` and ``transport`` ran slower than
another's at the same CPU times ran in a slower window (cores shared with more work), not with more work of its own.

**Seeds.** ``--seed`` (default 0) draws the model's initial weights and the workers' batches; the click
data's true model and the held-out sets stay fixed. ``--seeds K`` runs every scheme for seeds ``--seed`` ..
``--seed + K - 1`` (each seed's schemes capped by that seed's DDP time): summary.csv and curves.csv have a
row per seed (column ``seed``), the printed tables a table per seed and then, per scheme, the time and
steps to target as mean ± std over the seeds that reached it (with how many did), the figures the mean
curve with a ± std band (over the evaluations every seed ran) and the mean time to target with ± std error
bars.

Outputs under ``--out`` (default ``experiments/out/reproduce_training``): ``summary.csv`` (one row per
model and scheme), ``breakdown.csv`` (with ``--breakdown``), ``curves.csv`` (every evaluation: model, scheme,
elapsed_s, step, metric),
``time_to_accuracy.png`` (the metric against wall-clock time per scheme, one panel per model) and
``time_to_target.png`` (time to target as bars, the speed-up over stock DDP above each; a scheme that
stopped short drawn hatched at its stopping time).
"""

from __future__ import annotations

import csv
import functools
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm as sc
from sparsecomm.fabric.engine import drain
from sparsecomm.fabric.sim.sim_network import TCP_OVER_ETHERNET

#: the embedding model's shape (the full run): fields, rows per field's table, embedding width
FIELDS, VOCAB, DIM = 4, 50_000, 32
#: Zipf exponent of a field's ids, and the standard deviation of an id's true logit contribution
ZIPF, SIGNAL = 1.1, 1.0
#: the MLP's hidden width (the full run)
WIDTH = 1024
#: PowerSGD's rank and top-k's ratio in the compressing schemes; the click model's top-k keeps fewer
#: (``EMB_TOPK_RATIO``): below its gradient's share of non-zero elements (about 0.5% per worker), as
#: top-k of a vector with fewer non-zeros than k selects among ties at zero, its slow path
POWERSGD_RANK, TOPK_RATIO, EMB_TOPK_RATIO = 4, 0.01, 0.001
#: the first compressed step of torch's ``powerSGD_hook`` in the ``torch powersgd`` scheme: torch's smallest
#: (its ``PowerSGDState`` refuses a start below 2 with error feedback or warm start); the library's hook at its
#: defaults compresses from step 1 (step 0 is always uncompressed)
TORCH_POWERSGD_START = 2
#: steps of each scheme recorded for ``--breakdown``, after its timed run, on the trained replica
BREAKDOWN_STEPS = 10
#: untimed steps of each scheme on a throwaway replica before its run
WARMUP = 2
#: untimed warm-up and timed steps of the no-communication step (``compute_s``)
COMPUTE_WARMUP, COMPUTE_STEPS = 2, 20
#: the steps each worker runs on the SimFabric for the ``modelled`` column; the last one's communication is
#: the one modelled (step 0 is the hook's uncompressed one, step 1 a method's first compressed round)
MODEL_STEPS = 3
#: DDP's bucket caps (torch's defaults: a first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES``, then 25 MiB)
DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 1 << 20, 25 << 20
#: summary.csv's columns: the required ones first
COLUMNS = ("model", "scheme", "transport", "hosts", "gbps", "time_to_target_s", "steps_to_target", "reached",
           "bytes_per_step", "comm_fraction", "target", "metric", "compute_s", "step_s", "modelled_s",
           "modelled_ratio", "note", "seed", "modelled_comm_s", "link_only_s", "link_only_ratio", "compute_mean_s",
           "compute_max_s", "ddp_compute_s", "ddp_compute_mean_s", "ddp_compute_max_s")


# ----------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A model, its data and its target: ``build()`` a fresh model (fixed seed), ``batch(rank, t)`` the
    inputs and labels of worker ``rank``'s step ``t``, ``loss(model, batch)``, ``metric(model)`` on the
    held-out set (higher is better), reached at ``target``; SGD at ``lr`` (``momentum``)."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    metric: Callable[[nn.Module], float]
    target: float
    lr: float
    momentum: float
    max_steps: int
    eval_every: int
    describe: str
    emb_lr: float = 0.0
    #: per scheme name, options that replace the scheme's own for this task
    overrides: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD over ``model``'s parameters; an ``emb`` submodule's (the tables) at ``emb_lr``."""
        emb = getattr(model, "emb", None)
        tables = set(map(id, emb.parameters())) if emb is not None else set()
        rest = [p for p in model.parameters() if id(p) not in tables]
        groups = [{"params": rest}] + ([{"params": list(emb.parameters()), "lr": self.emb_lr}] if tables else [])
        return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their mean rank."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # mean rank over ties
    uniq, inv = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / counts)[inv]
    pos = labels.bool()
    n1, n0 = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


class ClickModel(nn.Module):
    """``fields`` tables of ``vocab`` x ``dim`` (one embedding, table ``f`` at rows ``f * vocab ..``), the
    field vectors concatenated into a tower ``Linear(fields * dim, 64) -> ReLU -> Linear(64, 1)``."""

    def __init__(self, fields: int, vocab: int, dim: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.emb = nn.Embedding(fields * vocab, dim, sparse=False)
        self.tower = nn.Sequential(nn.Linear(fields * dim, 64), nn.ReLU(), nn.Linear(64, 1))
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(fields * vocab, dim, generator=g) * 0.01)
            for p in self.tower.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1])))
        self.register_buffer("base", torch.arange(fields) * vocab, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids + self.base)                         # (batch, fields, dim)
        return self.tower(x.flatten(1)).squeeze(1)


#: a seed's offset of the batch streams (seed 0 keeps the streams ``(rank, t)`` of the module doc)
SEED_STRIDE = 1_000_000_007


def click_task(quick: bool, batch: int = 256, seed: int = 0) -> Task:
    fields, vocab, dim = (FIELDS, 5_000, 16) if quick else (FIELDS, VOCAB, DIM)
    g = torch.Generator().manual_seed(1234)
    cdf = torch.cumsum(torch.arange(1, vocab + 1, dtype=torch.float64) ** -ZIPF, 0)
    cdf /= cdf[-1].clone()
    perm = torch.stack([torch.randperm(vocab, generator=g) for _ in range(fields)])    # rank -> id, per field
    truth = torch.randn(fields, vocab, generator=g) * SIGNAL

    def draw(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.searchsorted(cdf, torch.rand(n, fields, generator=gen, dtype=torch.float64)).clamp_(max=vocab - 1)
        ids = torch.gather(perm, 1, r.T).T                 # (n, fields)
        logit = truth.gather(1, ids.T).sum(0)
        y = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        return ids, y, logit

    held_ids, held_y, held_logit = draw(torch.Generator().manual_seed(99), 20_000)
    bayes = auc(held_logit, held_y)

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return auc(m(held_ids), held_y)

    def make_batch(rank: int, t: int) -> tuple:
        ids, y, _ = draw(torch.Generator().manual_seed(1_000_003 * (rank + 1) + t + SEED_STRIDE * seed), batch)
        return ids, y

    target = 0.5 + (0.5 if quick else 0.7) * (bayes - 0.5)
    return Task("emb", lambda: ClickModel(fields, vocab, dim, seed=seed), make_batch,
                lambda m, b: nn.functional.binary_cross_entropy_with_logits(m(b[0]), b[1]),
                metric, target=target, lr=0.5, momentum=0.0, emb_lr=100.0, max_steps=40 if quick else 1500,
                eval_every=1 if quick else 10,        # --quick reaches its target in a few steps: show them
                describe=f"{fields} fields x Embedding({vocab}, {dim}) + tower {fields * dim}-64-1, batch {batch} "
                         f"per worker, Zipf({ZIPF}) ids; AUC target {target:.3f} (Bayes {bayes:.3f})",
                overrides={"hook ef+topk": {"ratio": EMB_TOPK_RATIO}},
                info={"bayes_auc": bayes})


def digits_task(quick: bool, batch: int = 32, seed: int = 0) -> Task:
    from sklearn.datasets import load_digits

    width = 256 if quick else WIDTH
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    held, train = order[: len(y) // 5], order[len(y) // 5:]
    # --quick: a target every scheme can reach within its step budget (about 35 steps of stock DDP at 2 hosts)
    target = 0.85 if quick else 0.95

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))

    def make_batch(rank: int, t: int) -> tuple:
        g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + t + SEED_STRIDE * seed)
        idx = train[torch.randint(0, len(train), (batch,), generator=g)]
        return x[idx], y[idx]

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float((m(x[held]).argmax(1) == y[held]).float().mean())

    return Task("mlp", build, make_batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), metric,
                target=target, lr=0.05, momentum=0.9, max_steps=80 if quick else 1500, eval_every=5,
                describe=f"MLP 64-{width}-{width}-10 on digits, batch {batch} per worker; accuracy target {target}")


TASKS = {"emb": click_task, "mlp": digits_task}


# ----------------------------------------------------------------------------- schemes
@dataclass(frozen=True)
class Scheme:
    """One way to average the gradients: ``kind`` ``"ddp"`` (stock DistributedDataParallel), ``"hook"``
    (DDP with :func:`sparsecomm.ddp.register` ``(**options)``), ``"torch-hook"`` (DDP with torch's own
    ``powerSGD_hook``, ``PowerSGDState(**options)``: :class:`TorchPowerSGD`) or ``"optimizer"``
    (:class:`~sparsecomm.DistributedOptimizer` ``(**options)``), with the ``services`` its launch starts."""

    name: str
    kind: str
    options: dict = field(default_factory=dict)
    services: tuple[str, ...] = ()

    @property
    def under_ddp(self) -> bool:
        """Whether its model trains wrapped in DistributedDataParallel (stock DDP, a hook): its modelled step adds
        the step of DDP with no communication (``ddp_compute_*``), which holds DDP's own work, to its calls."""
        return self.kind in ("ddp", "hook", "torch-hook")

    def compute_column(self, statistic: str = "compute_mean_s") -> str:
        """The column of the no-communication step its modelled step adds (:data:`COMPUTE_STATS`): the
        ``statistic`` of the plain step, or of DDP's (``ddp_`` before it) where it trains under DDP."""
        return f"ddp_{statistic}" if self.under_ddp else statistic

    def sharing_services(self, pinned: bool = False) -> int:
        """Its services that share the workers' cores, as a model of processes sharing cores counts them
        (:func:`sparsecomm.netbed.calibrate.busy_endpoints`: every one; on ``pinned`` ranks, none of the sparse
        switch's, which computes only while the workers wait)."""
        from sparsecomm.netbed.calibrate import busy_endpoints

        if not self.services:
            return 0
        return busy_endpoints(self.options["transport"], 0, len(self.services), pinned)


SCHEMES = (
    Scheme("ddp", "ddp"),
    Scheme("hook none/omnireduce", "hook", dict(compressor="none", transport="omnireduce")),
    Scheme("hook none/switch", "hook", dict(compressor="none", transport="switch"), ("switch",)),
    Scheme("hook none/sparse-switch", "hook", dict(compressor="none", transport="sparse-switch"), ("sparse-switch",)),
    Scheme("hook powersgd", "hook", dict(compressor="powersgd", matrix_approximation_rank=POWERSGD_RANK)),
    Scheme("hook ef+topk", "hook", dict(compressor="topk", method="ef", ratio=TOPK_RATIO)),
    Scheme("torch powersgd", "torch-hook", dict(matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=TORCH_POWERSGD_START)),
    Scheme("optimizer none/omnireduce", "optimizer", dict(compressor="none", transport="omnireduce")),
)


class TorchPowerSGD:
    """torch's own ``powerSGD_hook`` on ``net`` (a DDP model over ``group``), with ``PowerSGDState(group,
    **options)``, and its bytes per step (:attr:`last_stats`).

    **Order.** torch's hook posts a bucket's P and Q all-reduces from the completion callbacks of its earlier
    all-reduces, so with two or more buckets the ranks can post a bucket's P and the next bucket's first
    all-reduce in different orders, which gloo cannot tell apart (on 2 gloo processes the MLP's two buckets
    aborted the run with gloo's "Received data size doesn't match expected size"). The hook is therefore
    called for bucket ``k > 0`` once bucket ``k - 1``'s future has completed: torch's code and numbers, in one
    order on every rank (the last bucket's encoding waits for the previous bucket's rounds).

    **Bytes** (:attr:`last_stats`: the last step's, counted as torch's hook sends them): an uncompressed step
    (before ``start_powerSGD_iter``) all-reduces the bucket; a compressed one all-reduces per bucket its
    uncompressed tensors, its Ps and its Qs (torch's ``_should_compress`` decides which tensors), each at
    gloo's ring volume ``2 (n-1)/n`` of its bytes each way per link, as stock DDP's are counted."""

    def __init__(self, net: nn.parallel.DistributedDataParallel, group, **options: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

        self.state = ph.PowerSGDState(process_group=group, **options)
        self._hook, self._should_compress = ph.powerSGD_hook, ph._should_compress
        self._ring = 2 * (dist.get_world_size(group) - 1) / dist.get_world_size(group)
        self._prev: torch.futures.Future | None = None
        self._bytes = 0.0
        net.register_comm_hook(self.state, self.hook)

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future:
        """torch's hook on ``bucket``, after the previous bucket's future (see the class doc)."""
        if bucket.index() == 0:
            self._bytes, self._prev = 0.0, None
        elif self._prev is not None:
            self._prev.wait()
        self._bytes += self._ring * self._sent(bucket)
        self._prev = self._hook(state, bucket)
        return self._prev

    def _sent(self, bucket: dist.GradBucket) -> int:
        """The bytes torch's hook all-reduces for ``bucket`` this step (before it runs: ``state.iter`` counts
        the steps before this one)."""
        size = bucket.buffer().element_size()
        if self.state.iter < self.state.start_powerSGD_iter:
            return bucket.buffer().numel() * size
        sent = 0
        for g in bucket.gradients():
            n, m = g.view(g.shape[0], -1).shape
            r = min(n, m, self.state.matrix_approximation_rank)
            sent += (n + m) * r if self._should_compress(n, m, r, self.state.min_compression_rate)[0] else g.numel()
        return sent * size

    @property
    def last_stats(self) -> sc.CommStats:
        """The last step's bytes per link direction (see the class doc), sent and received alike."""
        return sc.CommStats(bytes_sent=int(self._bytes), bytes_received=int(self._bytes))


# DDP checks the hook's annotations as objects (this module's are strings under PEP 563)
TorchPowerSGD.hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _transport_name(transport) -> str:
    """A transport's catalog name (the default transport resolves to one per payload: the name of the one it chose)."""
    return str(getattr(transport, "name", None) or type(transport).__name__)


def _timed_step(task: Task, net: nn.Module, opt, b) -> float:
    """The wall time of one step (``zero_grad``, forward, backward, ``step``) of ``opt`` through ``net`` on
    batch ``b``."""
    start = time.perf_counter()
    opt.zero_grad()
    task.loss(net, b).backward()
    opt.step()
    return time.perf_counter() - start


def _no_communication(state, bucket):       # (unannotated: DDP checks a hook's annotations, here strings)
    """A DDP comm hook that communicates nothing: the bucket as it stands, at once (:func:`_compute_steps`)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _compute_steps(task: Task, rank: int, group, ddp: bool = False) -> list[float]:
    """The times of :data:`COMPUTE_STEPS` steps with no communication (a fresh model and optimizer, the same
    batches), every worker at once: each started after a barrier, as a training step starts once the collectives
    of the step before have let every worker go. ``ddp``: the model wrapped in DistributedDataParallel whose comm
    hook communicates nothing (:func:`_no_communication`), so that the steps hold DDP's own work (its autograd
    hooks, its copies of the gradients into its buckets and of the buckets back into ``.grad``) and no call."""
    model = task.build()
    opt = task.optimizer(model)
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(model, process_group=group)
        net.register_comm_hook(None, _no_communication)
    times = []
    for t in range(COMPUTE_WARMUP + COMPUTE_STEPS):
        b = task.batch(rank, t)
        dist.barrier(group=group)
        took = _timed_step(task, net, opt, b)
        if t >= COMPUTE_WARMUP:
            times.append(took)
    return times


def compute_stats(per_rank: list[list[float]]) -> dict[str, float]:
    """The no-communication step's statistics over the workers' step times (``per_rank[r][t]``, step ``t`` of worker
    ``r``, the steps started together): ``compute_s``, the largest of the workers' medians; ``compute_mean_s``, the
    largest of their means (the figure the modelled column adds to a step); ``compute_max_s``, the mean over the
    steps of each step's slowest worker (what a bulk-synchronous step waits for)."""
    steps = min(len(t) for t in per_rank)
    return {"compute_s": max(statistics.median(t) for t in per_rank),
            "compute_mean_s": max(statistics.mean(t) for t in per_rank),
            "compute_max_s": statistics.mean(max(t[k] for t in per_rank) for k in range(steps))}


def _setup(task: Task, scheme: Scheme, group) -> tuple[nn.Module, nn.Module, Any, Any, str]:
    """``(model, net, optimizer, ledger, transport)``: a fresh model, what the loss is computed through
    (DDP or the model), the optimizer stepped, the object whose ``last_stats`` books the bytes (None for
    stock DDP) and the transport's name."""
    model = task.build()
    options = {**scheme.options, **task.overrides.get(scheme.name, {})}
    if scheme.kind == "optimizer":
        opt = sc.DistributedOptimizer(task.optimizer(model), **options)
        return model, model, opt, opt, _transport_name(opt.transport)
    net = nn.parallel.DistributedDataParallel(model, process_group=group)
    if scheme.kind == "ddp":
        return model, net, task.optimizer(model), None, "native (gloo ring)"
    if scheme.kind == "torch-hook":
        return model, net, task.optimizer(model), TorchPowerSGD(net, group, **options), "native (gloo ring)"
    state = sc.ddp.register(net, **options)
    return model, net, task.optimizer(model), state, _transport_name(state.pipeline.transport)


def _train_one(ctx, task: Task, scheme: Scheme, group, time_cap_s: float,
               breakdown: str | None = None) -> dict[str, Any]:
    """One worker's run of ``scheme`` to ``task``'s target (module doc, "Clock"), after ``WARMUP`` steps
    of the same scheme on a throwaway replica (first calls: compilation, connections, the services); with
    ``breakdown`` (a trace file), then :data:`BREAKDOWN_STEPS` more steps recorded (:func:`_breakdown`)."""
    n = ctx.world_size
    _, net, opt, _, _ = _setup(task, scheme, group)
    for t in range(WARMUP):
        opt.zero_grad()
        task.loss(net, task.batch(ctx.rank, -1 - t)).backward()
        opt.step()
    del net, opt
    model, net, opt, ledger, transport = _setup(task, scheme, group)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elapsed, link_bytes, curve = 0.0, 0.0, []
    reached, steps, metric = False, 0, float("nan")
    for t in range(task.max_steps):
        elapsed += _timed_step(task, net, opt, task.batch(ctx.rank, t))
        steps = t + 1
        if ledger is not None:
            st = ledger.last_stats
            link_bytes += max(st.bytes_sent, st.bytes_received)
        else:                        # gloo's ring: 2 (n-1)/n of the gradient each way on every link
            link_bytes += 2 * (n - 1) / n * grad_bytes
        if steps % task.eval_every and steps != task.max_steps:
            continue
        # untimed: evaluate this replica, then agree on the slowest worker's clock and the lowest metric
        m = task.metric(model)
        agreed = torch.tensor([elapsed, -m], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        metric = -float(agreed[1])
        curve.append((float(agreed[0]), steps, metric))
        if metric >= task.target:
            reached = True
            break
        if float(agreed[0]) > time_cap_s:
            break
    out = {"curve": curve, "reached": reached, "steps": steps, "metric": metric,
           "link_bytes": link_bytes / steps, "transport": transport}
    if breakdown is not None:
        out["breakdown"] = _breakdown(ctx, task, net, opt, group, steps, breakdown)
    return out


def _breakdown(ctx, task: Task, net: nn.Module, opt, group, t0: int, path: str) -> dict[str, float]:
    """One worker's step split into phases, the mean of :data:`BREAKDOWN_STEPS` steps (batches ``t0 ..``)
    recorded on a timeline (:func:`sparsecomm.trace.record`, written to ``path``'s rank file), each after a step
    of the same batch with no communication (a fresh local replica, every worker at once: ``compute_s``, timed
    under the same load as the step beside it): ``step_s`` (wall time), ``encode_s`` and ``decode_s`` (the pipeline's ``encode`` and ``decode`` events: the method's work
    before a round's send, on the calling thread for the first round and the communication thread for later
    ones, and after the last sum), ``transport_s`` (the transport calls: their messages, waits and sums; a
    posted ``native`` call, the wait for its collective) and ``wait_s`` (within them, the waits for a
    message the fabric saw). Stock DDP and torch's hook make no library call: all theirs is in the module
    doc's ``remainder``. Beside them the CPU time: ``compute_cpu_s`` and ``step_cpu_s``, the process's (every
    thread's, ``time.process_time``) over the step with no communication and over the step, and
    ``transport_cpu_s``, the calls' own (their thread's, the trace's ``cpu_us``), so that a window in which every
    step ran slower (wall time up, CPU time not) tells itself apart from more work."""
    sums = {"compute_s": 0.0, "step_s": 0.0, "encode_s": 0.0, "decode_s": 0.0, "transport_s": 0.0, "wait_s": 0.0,
            "compute_cpu_s": 0.0, "step_cpu_s": 0.0, "transport_cpu_s": 0.0}
    local = task.build()
    local_opt = task.optimizer(local)
    with sc.trace.record(sc.trace.rank_path(path, ctx.rank)) as rec:
        for t in range(t0, t0 + BREAKDOWN_STEPS):
            b = task.batch(ctx.rank, t)
            dist.barrier(group=group)
            c0 = time.process_time()
            sums["compute_s"] += _timed_step(task, local, local_opt, b)
            sums["compute_cpu_s"] += time.process_time() - c0
            dist.barrier(group=group)
            c0 = time.process_time()
            sums["step_s"] += _timed_step(task, net, opt, b)
            sums["step_cpu_s"] += time.process_time() - c0
        for e in rec.events:
            key = {"phase": f"{e['name']}_s", "call": "transport_s", "wait": "wait_s"}.get(e["cat"])
            if key in sums:
                sums[key] += e["dur"] * 1e-6
            if e["cat"] == "call":
                sums["transport_cpu_s"] += e["args"].get("cpu_us", 0.0) * 1e-6
    return {k: v / BREAKDOWN_STEPS for k, v in sums.items()}


def _train(ctx, task_name: str, quick: bool, schemes: tuple[Scheme, ...], time_cap_s: float,
           seed: int = 0, breakdown: str | None = None) -> dict[str, Any]:
    """One worker: the no-communication step's time, then every scheme in turn (module doc)."""
    torch.set_num_threads(1)
    task = TASKS[task_name](quick, seed=seed)
    group = ctx.fabric.native_group if ctx.fabric.services() else None
    out = {"compute_steps": _compute_steps(task, ctx.rank, group),
           "ddp_compute_steps": _compute_steps(task, ctx.rank, group, ddp=True), "target": task.target,
           "describe": task.describe, "info": task.info, "runs": {}}
    for scheme in schemes:
        trace = None if breakdown is None else os.path.join(
            breakdown, f"{task_name}_{scheme.name.replace(' ', '_').replace('/', '-')}.json")
        out["runs"][scheme.name] = _train_one(ctx, task, scheme, group, time_cap_s, trace)
    return out


def run_schemes(task_name: str, schemes: tuple[Scheme, ...], hosts: int, gbps: float | None, quick: bool,
                time_cap_s: float, timeout_s: float, seed: int = 0, profile: str | None = None,
                breakdown: str | None = None, pin_cores: bool = False) -> list[dict[str, Any]]:
    """One launch: ``hosts`` workers (and the schemes' services, which must be the same) on a netbed at
    ``gbps`` (gloo over loopback when ``gbps`` is None) train with each scheme in turn; per scheme the
    row of summary.csv and the curve. On a netbed each scheme's step is then modelled on the SimFabric
    (:func:`modelled_comm_s` over :func:`modelled_network` with the host ``profile``, if any; not torch's
    hook: NaN). With ``breakdown`` (a folder), each scheme's result has its ``"breakdown"`` (:func:`_breakdown`,
    the mean over the workers; its timelines under that folder). ``pin_cores``: each rank on a core of its own
    turn (:func:`sparsecomm.launch`'s option)."""
    services = {s.services for s in schemes}
    if len(services) != 1:
        raise ValueError(f"one launch runs schemes with the same services, got {sorted(services)}")
    if gbps is None:
        opts: dict[str, Any] = {"backend": "gloo"}
    else:
        opts = {"backend": "netbed", "network": sc.Network(bandwidth_gbps=gbps)}
    res = sc.launch(functools.partial(_train, task_name=task_name, quick=quick, schemes=schemes,
                                      time_cap_s=time_cap_s, seed=seed, breakdown=breakdown),
                    world_size=hosts, services=list(services.pop()), timeout_s=timeout_s, pin_cores=pin_cores, **opts)
    stats = compute_stats([r["compute_steps"] for r in res])
    stats |= {f"ddp_{k}": v for k, v in compute_stats([r["ddp_compute_steps"] for r in res]).items()}
    compute = stats["compute_mean_s"]
    out = []
    for scheme in schemes:
        r0 = res[0]["runs"][scheme.name]
        link = max(r["runs"][scheme.name]["link_bytes"] for r in res)
        elapsed = r0["curve"][-1][0] if r0["curve"] else float("nan")
        step_s = elapsed / r0["steps"]
        modelled = comm = link_only = float("nan")
        if gbps is not None:
            link_only = r0["steps"] * (compute + link / (gbps * 1e9 / 8 * TCP_OVER_ETHERNET))
        if gbps is not None and scheme.kind != "torch-hook":   # (torch's hook calls torch.distributed: no model)
            step = stats[scheme.compute_column()]        # (the statistic a modelled step adds: the module docstring)
            comm = modelled_comm_s(TASKS[task_name](quick, seed=seed), scheme, hosts,
                                   modelled_network(gbps, hosts, scheme.sharing_services(pin_cores), profile),
                                   compute_s=step)
            modelled = r0["steps"] * (step + comm)
        row = {"model": task_name, "scheme": scheme.name, "transport": r0["transport"], "hosts": hosts,
               "gbps": gbps if gbps is not None else "loopback",
               "time_to_target_s": elapsed if r0["reached"] else float("nan"),
               "steps_to_target": r0["steps"] if r0["reached"] else "", "reached": r0["reached"],
               "bytes_per_step": link, "comm_fraction": max(0.0, 1.0 - compute / step_s),
               "target": res[0]["target"], "metric": r0["metric"], "step_s": step_s,
               "modelled_s": modelled, "modelled_ratio": modelled / elapsed, "note": "", "seed": seed,
               "modelled_comm_s": comm, "link_only_s": link_only, "link_only_ratio": link_only / elapsed,
               **{k: stats[k] for k in COMPUTE_STATS + DDP_COMPUTE_STATS}}
        if not r0["reached"]:
            row["note"] = (f"stopped at step {r0['steps']} after {elapsed:.1f} s at {r0['metric']:.4f} "
                           f"(target {res[0]['target']:.4f})")
        result = {"row": row, "curve": r0["curve"], "describe": res[0]["describe"], "info": res[0]["info"]}
        if breakdown is not None:
            parts = [r["runs"][scheme.name]["breakdown"] for r in res]
            result["breakdown"] = {k: statistics.mean(p[k] for p in parts) for k in parts[0]}
        out.append(result)
    return out


# ----------------------------------------------------------------------------- the modelled step
def modelled_network(gbps: float, hosts: int, services: int, profile: str | None = None) -> sc.Network:
    """The SimFabric's model of the netbed the schemes train on: links of ``gbps`` Gbit/s at TCP's payload
    rate (:data:`~sparsecomm.fabric.sim.sim_network.TCP_OVER_ETHERNET`), the wire's one-way latency
    (:data:`experiments.bench.netbed_vs_sim.NETBED_LATENCY_US`), and the hosts: with ``profile`` (written by
    ``python -m sparsecomm.netbed calibrate --out host.json``) its calibrated :class:`~sparsecomm.HostModel`,
    shared by the ``hosts + services`` processes on this machine's cores (``HostModel.sharing``: with the
    profile's rates fitted at that share where it has them, its ``by_share``), a message's
    bytes' host work beside the link (``Network.host_streams``, as ``netbed_vs_sim`` models the netbed; ``services``:
    those that share the workers' cores, :meth:`Scheme.sharing_services`); without
    one, the SimFabric's default host (``host=None``: no host cost). ``native``'s calls are modelled by gloo's ring
    (:func:`_model_worker`)."""
    from .bench.netbed_vs_sim import NETBED_LATENCY_US

    link = dict(bandwidth_gbps=gbps, latency_us=NETBED_LATENCY_US, payload_fraction=TCP_OVER_ETHERNET)
    if profile is None:
        return sc.Network(**link)
    net = sc.Network.from_profile(profile, **link, host_streams=True)   # (the netbed's NICs stream a message's bytes)
    net.host = net.host.sharing(hosts + services, os.cpu_count() or 1)
    return net


def ddp_buckets(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each of DDP's buckets, in bucket order, as stock DDP lays them out in steady state
    (torch's ``_compute_bucket_assignment_by_size`` over the parameters in reverse order, a first bucket of
    :data:`DDP_FIRST_BUCKET_BYTES`, then :data:`DDP_BUCKET_BYTES`: gradients become ready from the last layer)."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    order, _ = dist._compute_bucket_assignment_by_size(params, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES],
                                                       [False] * len(params))
    return [[params[i] for i in bucket] for bucket in order]


def _model_worker(ctx, task: Task, scheme: Scheme, steps: int, init: dict,
                  compute_s: float = 0.0) -> list[tuple[float, float]]:
    """One simulated worker: ``steps`` steps of ``scheme`` on ``task`` (real gradients of its real batches),
    each step's ``(start, end)`` on the modelled clock. A ``"hook"`` scheme runs the DDP hook's own body
    (:meth:`sparsecomm.ddp.CommHookState.start_bucket`) on each of DDP's buckets (:func:`ddp_buckets`), every
    bucket started after backward and then waited for, in DDP's bucket order; stock DDP is the hook's plain
    average on gloo's ring all-reduce, and so is a hook whose calls go to ``native`` on the netbed (its default
    transport for dense payloads there, :func:`sparsecomm.pipeline.resolve.build_transport`; the SimFabric's
    default is ``ring``): ``native``'s model, :class:`~sparsecomm.transports.native.model.GlooRing` (gloo's
    segments, its messages at the host's native rates), in place as the hook's buckets are summed;
    ``"optimizer"`` is :class:`~sparsecomm.DistributedOptimizer` itself. Backward and the update are measured
    (``compute_s``, a step with no communication, every worker at once; for a scheme under DDP, DDP's step whose
    hook communicates nothing, :meth:`Scheme.compute_column`): each step declares ``compute_s`` to the fabric
    (``fabric.compute``) as it starts, before backward (whose hooks start the optimizer's call), the work the step's
    first call waits out its last worker after (the host model's ``sync_work_s``), and its ``(start, end)`` leaves
    it out. DDP's own work (its autograd hooks, its copies of each gradient into its bucket and of the bucket's
    result back into ``.grad``) is in that measured step, so nothing here charges it. Stock DDP divides by the
    world size as it copies into its bucket (``at::mul_out``), where the measured step's hook only copies: its
    modelled plain average charges the division as its decode's elementwise pass, one pass over the gradient more
    than stock DDP makes. The optimizer's own gather
    of the gradients into its buckets (:meth:`sparsecomm.pipeline.buckets.Bucket.gather`, a copy; ``p.grad`` then
    views the average, no copy back) is charged by the optimizer itself, as a copy of the bucket's bytes. The model
    starts from ``init`` (its state dict, built once by the caller): the workers are threads of one process,
    and ``task.build()`` seeds and draws from torch's global generator, which they would share in whatever order
    the threads are scheduled in."""
    torch.set_num_threads(1)
    fabric = ctx.fabric
    model = task.build()
    model.load_state_dict(init)
    inner = task.optimizer(model)
    options = {**scheme.options, **task.overrides.get(scheme.name, {})}
    if scheme.kind == "optimizer":
        opt = sc.DistributedOptimizer(inner, **options)
        average = None
    else:
        from sparsecomm.transports.native.model import GlooRing

        if scheme.kind == "ddp":
            options = dict(compressor="none", transport="ring")
        state = sc.ddp.CommHookState(None, model=model, **options)
        if ((scheme.kind == "ddp" or "transport" not in options) and state.pipeline.transport.name == "ring"
                and state.pipeline.method.compressor.payload_kind == "dense"):     # (native on the netbed)
            options = {**options, "transport": GlooRing(ctx.fabric, inplace=True)}
            state = sc.ddp.CommHookState(None, model=model, **options)
        buckets = ddp_buckets(model)
        shaped = state.pipeline.method.uses_shapes
        opt = inner

        def average() -> None:
            works = []
            for i, params in enumerate(buckets):
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                works.append(state.start_bucket(flat, i, i == len(buckets) - 1, params,
                                                [p.shape for p in params] if shaped else None))
            for params, work in zip(buckets, works):
                torch.nn.utils.vector_to_parameters(work.wait(), [p.grad for p in params])
            # every call's charges (the communication thread's too) on the clock before the step's end is read
            drain(fabric)
    out = []
    for t in range(steps):
        fabric.compute(compute_s)      # (before backward: the optimizer's hooks start its call as backward ends)
        start = ctx.fabric.now()
        opt.zero_grad()
        task.loss(model, task.batch(ctx.rank, t)).backward()
        if average is not None:
            average()
        opt.step()
        out.append((start, ctx.fabric.now()))
    return out


def modelled_comm_s(task: Task, scheme: Scheme, hosts: int, network: sc.Network, steps: int = MODEL_STEPS,
                    compute_s: float = 0.0) -> float:
    """The modelled communication of one training step of ``scheme`` on ``hosts`` workers (and the scheme's
    services) over ``network``, on the SimFabric (``sc.launch(..., backend="sim")``): the last of ``steps``
    steps (:func:`_model_worker`), from the moment the slowest worker starts its communication to the moment the
    slowest ends it (a step is bulk-synchronous). ``compute_s``: the measured step without communication, declared
    to the fabric before each step's communication (:func:`_model_worker`) and not part of the result."""
    init = task.build().state_dict()
    per_rank = sc.launch(functools.partial(_model_worker, task=task, scheme=scheme, steps=steps, init=init,
                                           compute_s=compute_s), hosts,
                         backend="sim", services=list(scheme.services), network=network)
    return max(r[-1][1] for r in per_rank) - max(r[-1][0] for r in per_rank)


# ----------------------------------------------------------------------------- outputs
def write_csv(rows: list[dict], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path


def by_scheme(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The results by ``(model, scheme)``, each the list of its seeds' results (in run order)."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        out.setdefault((r["row"]["model"], r["row"]["scheme"]), []).append(r)
    return out


def over_seeds(runs: list[dict]) -> dict[str, Any]:
    """One scheme's seeds: how many reached the target, the time and steps to it over those (mean and std,
    :func:`.common.seeds.stats`), the time at which the others stopped, and the link bytes per step."""
    from .common import seeds as S

    rows = [r["row"] for r in runs]
    hit = [r for r in rows if r["reached"]]
    return {"n": len(rows), "reached": len(hit), "time": S.stats([r["time_to_target_s"] for r in hit]),
            "steps": S.stats([r["steps_to_target"] for r in hit]),
            "stopped": S.stats([r["step_s"] * _stopped_steps(runs, r) for r in rows if not r["reached"]]),
            "bytes_per_step": S.stats([r["bytes_per_step"] for r in rows]), "target": rows[0]["target"]}


def figures(results: list[dict], out: Path) -> list[Path]:
    """``time_to_accuracy.png``: the held-out metric against the workers' training time, one curve per
    scheme (over several seeds the mean at the evaluations every seed ran, with a ± std band), the target
    dashed, one panel per model; ``time_to_target.png``: time to target as bars (over several seeds the mean
    over the seeds that reached it, ± std error bars; a scheme that reached it in none drawn hatched at the
    time it stopped, labelled so)."""
    from .common import plots
    from .common import seeds as S

    import matplotlib.pyplot as plt

    groups = by_scheme(results)
    nseeds = max(len(g) for g in groups.values())
    models = list(dict.fromkeys(m for m, _ in groups))
    colours = plots._colours([s.name for s in SCHEMES])
    gbps, hosts = results[0]["row"]["gbps"], results[0]["row"]["hosts"]
    where = f"{hosts} hosts, {gbps} Gbit/s netbed" if gbps != "loopback" else f"{hosts} gloo processes, loopback"
    seeds_note = f"; mean ± std of {nseeds} seeds" if nseeds > 1 else ""
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        series, bands = [], []
        for (m, scheme), runs in groups.items():
            curves = [r["curve"] for r in runs if r["curve"]]
            if m != model or not curves:
                continue
            b = S.band([[c[1] for c in cv] for cv in curves], [[c[2] for c in cv] for cv in curves],
                       [[c[0] for c in cv] for cv in curves])
            series.append({"x": b.x, "y": b.mid, "label": scheme, "color": colours[scheme]})
            bands.append((b, colours[scheme]))
        plots.plot_series(ax, series)
        for b, colour in bands:
            if b.n > 1:
                ax.fill_between(b.x, b.lo, b.hi, color=colour, alpha=0.15, lw=0)
        ax.axhline(groups[next(k for k in groups if k[0] == model)][0]["row"]["target"], color="k", ls="--",
                   lw=0.8, label="target")
        ax.set_xlabel("training time (s, evaluation not counted)")
        ax.set_ylabel("held-out AUC" if model == "emb" else "held-out accuracy")
        ax.set_title(f"{model}: {where}{seeds_note}", fontsize=9)
        plots.legend_below(ax, ncol=2)
    fig.tight_layout()
    paths = [plots.save(fig, out / "time_to_accuracy.png", "held-out metric against training time per scheme")]
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = {scheme: over_seeds(runs) for (m, scheme), runs in groups.items() if m == model}
        names = list(mine)
        if not any(a["reached"] for a in mine.values()):  # nothing to compare: a note, not a panel of hatching
            ax.axis("off")
            ax.text(0.5, 0.5, f"{model}: {where}\n\nno scheme reached the target "
                              f"{next(iter(mine.values()))['target']:.3g}\n"
                              f"(stock DDP included) within its steps or time cap;\nsee time_to_accuracy.png "
                              f"and summary.csv", ha="center", va="center", fontsize=9, transform=ax.transAxes)
            continue
        heights = [a["time"]["mean"] if a["reached"] else a["stopped"]["mean"] for a in mine.values()]
        errs = [a["time"]["std"] if a["reached"] > 1 else 0.0 for a in mine.values()]
        bars = ax.bar(range(len(names)), heights, color=[colours[s] for s in names],
                      yerr=errs if nseeds > 1 else None, ecolor="0.2")
        ddp = mine.get("ddp") if mine.get("ddp", {}).get("reached") else None
        for bar, err, (scheme, a) in zip(bars, errs, mine.items()):
            if not a["reached"]:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
            label = "not reached" if not a["reached"] else (
                f"{ddp['time']['mean'] / a['time']['mean']:.2g}x" if ddp else "")
            if a["reached"] and a["reached"] < a["n"]:
                label += f" ({a['reached']}/{a['n']} reached)"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height() + err), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("time to target (s; speed-up over DDP above)" if nseeds == 1 else
                      "time to target (s, mean ± std; speed-up over DDP above)", fontsize=8)
        ax.set_xlabel("scheme (hatched: stopped short of the target)")
        ax.set_title(f"{model}: {where}{seeds_note}", fontsize=9)
    fig.tight_layout()
    paths.append(plots.save(fig, out / "time_to_target.png", "time to the held-out target per scheme"))
    plt.close("all")
    return paths


#: the columns of breakdown.csv and of its printed table (ms per step)
BREAKDOWN = ("step", "compute", "encode", "transport", "wait", "decode", "remainder", "step_cpu", "compute_cpu",
             "transport_cpu")


def breakdown_table(results: list[dict], path: Path | None = None) -> str:
    """The ``--breakdown`` of every result (``run_schemes(..., breakdown=)``) as a table of ms per step, and
    as ``path`` (CSV) if given: ``step`` (the recorded steps' mean wall time), ``compute`` (the same steps with
    no communication), ``encode``, ``transport`` (``wait`` within it) and ``decode`` (:func:`_breakdown`), and
    ``remainder = step - compute - encode - transport - decode``: the time in none of them (the hook's and
    DDP's own posting, futures and thread hand-offs; for stock DDP and torch's hook, all their communication).
    The phases on the communication thread overlap backward, so the remainder can be below the time they
    hide (even negative). Then the CPU times (:func:`_breakdown`): ``step_cpu`` and ``compute_cpu`` (the process's,
    every thread), ``transport_cpu`` (the calls' own); NaN in a result recorded without them."""
    from .common import report

    rows = []
    for r in results:
        b = {k: math.nan for k in BREAKDOWN}
        b.update({k[:-2]: v for k, v in r["breakdown"].items()})
        b["remainder"] = b["step"] - b["compute"] - b["encode"] - b["transport"] - b["decode"]
        rows.append((r["row"]["model"], r["row"]["scheme"], r["row"].get("seed", 0), b))
    if path is not None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("model", "scheme", "seed") + tuple(f"{k}_ms" for k in BREAKDOWN))
            for model, scheme, seed, b in rows:
                w.writerow((model, scheme, seed) + tuple(f"{1e3 * b[k]:.3f}" for k in BREAKDOWN))
    return (f"\n## a step's breakdown, ms (mean of {BREAKDOWN_STEPS} recorded steps over the workers)\n"
            + report.table(["model", "scheme", "seed", *BREAKDOWN],
                           [[m, s, str(seed)] + [f"{1e3 * b[k]:.1f}" for k in BREAKDOWN] for m, s, seed, b in rows]))


def load(out: Path) -> list[dict]:
    """The results an earlier run wrote under ``out`` (summary.csv and curves.csv), typed as
    :func:`run_schemes` returns them (``describe`` empty), so that a run of some schemes can be merged
    with it (``--merge``)."""
    if not (out / "summary.csv").exists():
        return []
    curves: dict[tuple[str, str, int], list] = {}
    with open(out / "curves.csv", newline="") as f:
        for c in csv.DictReader(f):
            curves.setdefault((c["model"], c["scheme"], int(c.get("seed") or 0)), []).append(
                (float(c["elapsed_s"]), int(c["step"]), float(c["metric"])))
    results = []
    with open(out / "summary.csv", newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = dict(r)
            for k in ("time_to_target_s", "bytes_per_step", "comm_fraction", "target", "metric", "compute_s",
                      "step_s", "modelled_s", "modelled_ratio"):
                row[k] = float(r[k])
            for k in ("modelled_comm_s", "link_only_s", "link_only_ratio", "compute_mean_s", "compute_max_s",
                      *DDP_COMPUTE_STATS):    # (absent from older runs)
                row[k] = float(r.get(k) or "nan")
            row["hosts"] = int(r["hosts"])
            row["steps_to_target"] = int(r["steps_to_target"]) if r["steps_to_target"] else ""
            row["reached"] = r["reached"] == "True"
            row["seed"] = int(r.get("seed") or 0)
            results.append({"row": row, "curve": curves.get((r["model"], r["scheme"], row["seed"]), []),
                            "describe": "",
                            "info": {}})
    return results


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` and the results of ``old`` for (model, scheme, seed) triples that ``new`` lacks, by model, then
    in :data:`SCHEMES` order, then by seed."""
    def key(r: dict) -> tuple:
        return r["row"]["model"], r["row"]["scheme"], r["row"].get("seed", 0)

    done = {key(r) for r in new}
    order = {s.name: i for i, s in enumerate(SCHEMES)}
    out = [r for r in old if key(r) not in done] + list(new)
    return sorted(out, key=lambda r: (r["row"]["model"], order.get(r["row"]["scheme"], len(order)),
                                      r["row"].get("seed", 0)))


def seeds_table(results: list[dict]) -> str:
    """Per scheme of one model, over its seeds: how many reached the target, the time and steps to it
    (mean ± std over those that did), the speed-up of the mean time over stock DDP's, the link MB per step."""
    from .common import report

    groups = {scheme: over_seeds(runs) for (_, scheme), runs in by_scheme(results).items()}
    ddp = groups.get("ddp") if groups.get("ddp", {}).get("reached") else None
    rows = [[scheme, f"{a['reached']}/{a['n']}", report.fmt_mean_std(a["time"]["per_seed"], ".2f"),
             report.fmt_mean_std(a["steps"]["per_seed"], ".0f"),
             f"{ddp['time']['mean'] / a['time']['mean']:.2f}x" if ddp and a["reached"] else "",
             report.fmt_mean_std([b / 1e6 for b in a["bytes_per_step"]["per_seed"]], ".3f")]
            for scheme, a in groups.items()]
    n = max(a["n"] for a in groups.values())
    return (f"over {n} seeds (mean ± std over the seeds that reached the target):\n"
            + report.table(["scheme", "reached", "time to target s", "steps", "vs ddp", "MB/step"], rows))


#: the statistics of the no-communication step a remodelled column may add to a step (:func:`compute_stats`)
COMPUTE_STATS = ("compute_s", "compute_mean_s", "compute_max_s")
#: the same statistics of DDP's step with no communication (:func:`_compute_steps`), which a scheme trained under
#: DDP adds (:meth:`Scheme.compute_column`)
DDP_COMPUTE_STATS = tuple(f"ddp_{k}" for k in COMPUTE_STATS)


def remodel(results: list[dict], profile: str | None, quick: bool = False,
            compute: str = "compute_mean_s") -> list[dict]:
    """The rows of recorded ``results`` (:func:`load` of an earlier netbed run) with their modelled columns
    computed again, with the host ``profile`` (``None``: the default host), without training: per row of a
    netbed run (``gbps`` a number; not torch's hook), ``modelled_comm_s`` of its scheme at its ``hosts`` and
    seed (:func:`modelled_comm_s`), and ``modelled_s = steps * (compute + modelled_comm_s)`` over the steps
    it ran (to the target, or to where it stopped), ``modelled_ratio`` against its measured time; the other
    columns as recorded. ``compute`` is the statistic of the no-communication step added to each step
    (:data:`COMPUTE_STATS`, :func:`compute_stats`; default ``compute_mean_s``, the figure a run models with), of
    DDP's step for a scheme trained under DDP (:meth:`Scheme.compute_column`: ``ddp_compute_mean_s``); a row that
    does not have its column (a run recorded before the column existed) raises. (``--remodel DIR --profile P``: a
    change to the model or the profile checked against measurements already made.)"""
    if compute not in COMPUTE_STATS:
        raise ValueError(f"remodel: compute must be one of {COMPUTE_STATS}, got {compute!r}")
    by_name = {s.name: s for s in SCHEMES}
    out = []
    for r in results:
        row = dict(r["row"])
        scheme = by_name.get(row["scheme"])
        try:
            gbps = float(row["gbps"])
        except ValueError:          # (loopback: nothing modelled)
            gbps = None
        if gbps is not None and scheme is not None and scheme.kind != "torch-hook":
            steps = row["steps_to_target"] if row["reached"] else _stopped_steps(results, r["row"])
            elapsed = row["time_to_target_s"] if row["reached"] else (r["curve"][-1][0] if r["curve"] else
                                                                        float("nan"))
            column = scheme.compute_column(compute)
            step = row[column]
            if not math.isfinite(step):
                hint = ("train it again: a scheme under DDP adds DDP's own step, which that run did not measure"
                        if scheme.under_ddp else "remodel it with --compute compute_s")
                raise ValueError(f"remodel: the row {row['model']} {row['scheme']!r} has no {column} (a run "
                                 f"recorded before the column existed); {hint}")
            comm = modelled_comm_s(TASKS[row["model"]](quick, seed=row["seed"]), scheme, row["hosts"],
                                   modelled_network(gbps, row["hosts"], scheme.sharing_services(), profile),
                                   compute_s=step)
            row.update(modelled_comm_s=comm, modelled_s=steps * (step + comm))
            row["modelled_ratio"] = row["modelled_s"] / elapsed
        out.append(row)
    return out


def _stopped_steps(results: list[dict], row: dict) -> int:
    r = next(x for x in results if x["row"] is row)
    return r["curve"][-1][1] if r["curve"] else 0


def main(argv: list[str] | None = None) -> list[dict]:
    from .common import cli, report
    from .common import reproduce as U
    from .common import seeds as S

    p = U.parser("reproduce_training", __doc__)
    p.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                   help="links of GBPS Gbit/s on a netbed (needs root); without it: gloo over loopback")
    p.add_argument("--hosts", type=int, default=4, help="workers (each a netbed host)")
    p.add_argument("--models", default="emb,mlp", help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--schemes", default="", help="comma-separated scheme names (default: all)")
    p.add_argument("--time-cap", type=float, default=None,
                   help="stop a scheme after this much training time, s (default --cap-factor x DDP's time to "
                        "target, "
                        "else 300; --quick: 10)")
    p.add_argument("--cap-factor", type=float, default=2.0,
                   help="without --time-cap: stop a scheme after this many times DDP's time to target")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows (and curves) of --out's summary.csv that this run does not redo")
    p.add_argument("--timeout-s", type=float, default=900.0, help="a launch's timeout")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="a host profile (python -m sparsecomm.netbed calibrate --out PATH) for the modelled column "
                        "(default: the SimFabric's default host, no host cost)")
    p.add_argument("--breakdown", action="store_true",
                   help=f"after each scheme's run, record {BREAKDOWN_STEPS} more steps and print a step's breakdown "
                        f"(compute, encode, transport, decode, remainder; breakdown.csv, timelines under "
                        f"OUT/breakdown)")
    cli.add_seeds(p, help="run every scheme for K seeds (--seed, --seed+1, ...: initial weights and batches): "
                          "tables show mean ± std over the seeds that reached the target, plots the mean with "
                          "a ± std band (default 1)")
    p.add_argument("--pin-cores", action="store_true",
                   help="every rank on a core of its own turn (sparsecomm.launch(pin_cores=True)): the same sharing "
                        "of the cores on every step, as the modelled column's")
    p.add_argument("--remodel", default=None, metavar="DIR",
                   help="train nothing: the modelled columns of DIR's recorded netbed run (summary.csv, curves.csv) "
                        "computed again with --profile (or the default host), printed and written to "
                        "OUT/remodelled.csv (not into DIR)")
    p.add_argument("--compute", default="compute_mean_s", choices=COMPUTE_STATS,
                   help="with --remodel: the recorded statistic of the no-communication step added to each modelled "
                        "step, of DDP's step for a scheme under DDP (compute_mean_s, the default: the workers' "
                        "largest mean, as a run models; compute_s: their largest median, as runs recorded without "
                        "compute_mean_s modelled; compute_max_s: the mean of each step's slowest worker)")
    a = p.parse_args(argv)
    if a.remodel is not None:
        return _remodel_main(a)
    seeds = S.seeds_of(p, a)
    keep = {s for s in a.schemes.split(",") if s}
    unknown = keep - {s.name for s in SCHEMES}
    if unknown:
        p.error(f"unknown schemes {sorted(unknown)}; known: {[s.name for s in SCHEMES]}")
    schemes = [s for s in SCHEMES if not keep or s.name in keep]
    if a.profile is not None:
        if a.netbed is None:
            p.error("--profile models the netbed's hosts: it needs --netbed GBPS (on loopback nothing is modelled)")
        modelled_network(a.netbed, a.hosts, 0, a.profile)      # a profile that does not load: now, not after training
    R = U.Run("reproduce_training", a, {"gbps": a.netbed, "hosts": a.hosts, "models": a.models,
                                        "schemes": [s.name for s in schemes], "quick": a.quick,
                                        "seeds": seeds})
    out = R.out
    results: list[dict] = []
    for model in [m for m in a.models.split(",") if m]:
        cap = a.time_cap if a.time_cap is not None else (10.0 if a.quick else 300.0)
        # stock DDP first (its time sets the others' cap), then one launch per set of services
        groups = [(s,) for s in schemes if s.kind == "ddp"]
        for services in dict.fromkeys(s.services for s in schemes):
            groups.append(tuple(s for s in schemes if s.services == services and s.kind != "ddp"))
        launches = [(g, seed) for seed in seeds for g in groups if g]
        for group, seed in R.progress(launches, desc=f"{model}: launches"):
            for r in run_schemes(model, group, a.hosts, a.netbed, a.quick, cap, a.timeout_s, seed=seed,
                                 profile=a.profile, breakdown=str(out / "breakdown") if a.breakdown else None,
                                 pin_cores=a.pin_cores):
                results.append(r)
                row = r["row"]
                reach = (f"t={row['time_to_target_s']:.2f}s steps={row['steps_to_target']}" if row["reached"]
                         else "not reached")
                modelled = (f" modelled/measured={row['modelled_ratio']:.2f}"
                            if math.isfinite(row["modelled_ratio"]) else "")
                print(f"{model:4s} {row['scheme']:28s} {reach} "
                      f"step={1e3 * row['step_s']:.1f}ms compute={1e3 * row['compute_s']:.1f}ms "
                      f"comm={row['comm_fraction']:.2f} link={row['bytes_per_step'] / 1e6:.3f}MB"
                      f"{modelled} {row['note']}" + (f" seed={seed}" if len(seeds) > 1 else ""), flush=True)
                if row["scheme"] == "ddp" and row["reached"] and a.time_cap is None and not a.quick:
                    cap = max(a.cap_factor * row["time_to_target_s"], 30.0)
    results = merge(load(out) if a.merge else [], results)
    rows = [r["row"] for r in results]
    write_csv(rows, out / "summary.csv")
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("model", "scheme", "elapsed_s", "step", "metric", "seed"))
        for r in results:
            for c in r["curve"]:
                w.writerow((r["row"]["model"], r["row"]["scheme"], f"{c[0]:.4f}", c[1], f"{c[2]:.5f}",
                            r["row"].get("seed", 0)))
    figures(results, out)
    for model in dict.fromkeys(r["model"] for r in rows):
        desc = next((r["describe"] for r in results if r["row"]["model"] == model and r["describe"]), "")
        mine = [r for r in rows if r["model"] == model]
        # speed-ups against stock DDP of the same seed (the same initial weights and batches)
        ddp = {r.get("seed", 0): r for r in mine if r["scheme"] == "ddp" and r["reached"]}
        seeded = len({r.get("seed", 0) for r in mine}) > 1
        print(f"\n## {model}: {desc}")
        modelled = any(math.isfinite(r["modelled_s"]) for r in mine)   # a netbed's link model; not on loopback
        headers = ["scheme"] + (["seed"] if seeded else []) + [
            "transport", "time to target s", "steps", "vs ddp", "step ms", "compute ms", "comm",
            "MB/step"] + (["modelled s", "modelled/measured", "link-only s", "link-only/measured"] if modelled else [])

        def speedup(r: dict) -> str:
            base = ddp.get(r.get("seed", 0))
            return f"{base['time_to_target_s'] / r['time_to_target_s']:.2f}x" if base and r["reached"] else ""

        print(report.table(
            headers,
            [[r["scheme"]] + ([str(r.get("seed", 0))] if seeded else []) + [
              r["transport"], f"{r['time_to_target_s']:.2f}" if r["reached"] else "not reached",
              str(r["steps_to_target"]), speedup(r),
              f"{1e3 * r['step_s']:.1f}", f"{1e3 * r['compute_s']:.1f}", f"{r['comm_fraction']:.2f}",
              f"{r['bytes_per_step'] / 1e6:.3f}"] + ([f"{r['modelled_s']:.2f}", f"{r['modelled_ratio']:.2f}",
                                                      f"{r['link_only_s']:.2f}", f"{r['link_only_ratio']:.2f}"]
                                                     if modelled else [])
             for r in mine], align="lr" + "l" + "r" * (len(headers) - 3) if seeded else None))
        if len({r.get("seed", 0) for r in mine}) > 1:
            print(seeds_table([r for r in results if r["row"]["model"] == model]))
        if not any(r["reached"] for r in mine):
            print(f"no scheme reached the target {mine[0]['target']:.3g} on {model} (stock DDP included): raise "
                  f"--time-cap, or see curves.csv for how far each got")
    if a.breakdown:
        print(breakdown_table([r for r in results if "breakdown" in r], out / "breakdown.csv"))
    R.finish({"rows": rows})
    print(f"\nwrote {out / 'summary.csv'}, {out / 'curves.csv'}, {out / 'time_to_accuracy.png'}, "
          f"{out / 'time_to_target.png'}")
    return rows


def _remodel_main(a) -> list[dict]:
    """``--remodel DIR``: :func:`remodel` of DIR's results, printed beside the recorded modelled columns."""
    from .common import report

    recorded = load(Path(a.remodel))
    if not recorded:
        raise SystemExit(f"--remodel: no summary.csv under {a.remodel}")
    rows = remodel(recorded, a.profile, a.quick, a.compute)
    print(report.table(
        ["model", "scheme", "hosts", "measured s", "modelled s (recorded)", "ratio (recorded)", "modelled s",
         "modelled/measured", "modelled comm ms"],
        [[r["model"], r["scheme"], str(r["hosts"]), f"{o['row']['time_to_target_s']:.2f}",
          f"{o['row']['modelled_s']:.2f}", f"{o['row']['modelled_ratio']:.2f}", f"{r['modelled_s']:.2f}",
          f"{r['modelled_ratio']:.2f}", f"{1e3 * r['modelled_comm_s']:.2f}"] for r, o in zip(rows, recorded)]))
    from .common.reproduce import OUT_DEFAULT

    out = Path(a.out) if a.out is not None else OUT_DEFAULT / "reproduce_training"
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "remodelled.csv")
    print(f"\nwrote {out / 'remodelled.csv'}")
    return rows


if __name__ == "__main__":
    main()
