"""In place with a threshold: every worker's result is the exact sum of the inputs with the threshold's
semantics applied (a block whose every ``|x| <= threshold`` counts as zero), on the SimFabric over several
world sizes, densities and sizes that span several aggregators' ranges and channels, and on gloo processes
where a worker's scan is slow, so that the first verdict reaches it (at a ``Poll`` of its scan) before it
has scanned its later ranges."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.transports.omnireduce import worker as om_worker
from sparsecomm.transports.omnireduce.blocks import DenseSource

THR = 0.5


def make_t(rank: int, numel: int, bs: int, density: float, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Integer-valued blocks (exact sums), a ``density`` share of them non-zero; of those, about a third
    hold only ``+-0.25`` (under :data:`THR`), the rest at least one ``|x| >= 1`` (above it). The last
    aggregator ranges (scanned late by most workers) get their share too."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    nb = -(-numel // bs)
    live = torch.rand(nb, generator=g) < density
    small = torch.rand(nb, generator=g) < 0.35
    vals = torch.randint(1, 6, (nb * bs,), generator=g).to(dtype) * (2 * torch.randint(0, 2, (nb * bs,), generator=g) - 1)
    vals = vals.view(nb, bs)
    vals[small] = 0.25 * torch.sign(vals[small])
    vals[~live] = 0
    return vals.reshape(-1)[:numel].clone()


def exact_sum(n: int, numel: int, bs: int, density: float, seed: int, dtype=torch.float64) -> torch.Tensor:
    """The sum over workers with every block under the threshold dropped (float64: exact here)."""
    out = torch.zeros(numel, dtype=torch.float64)
    for r in range(n):
        x = make_t(r, numel, bs, density, seed, dtype).double()
        nb = -(-numel // bs)
        pad = torch.zeros(nb * bs, dtype=torch.float64)
        pad[:numel] = x
        keep = (pad.view(nb, bs).abs() > THR).any(1).repeat_interleave(bs)[:numel]
        out += torch.where(keep, x, torch.zeros((), dtype=torch.float64))
    return out


# numel, block_size, density, lanes, channels: several ranges per worker, ranges of several scan pieces
# (om_worker.SCAN_MIN_BLOCKS blocks each), several channels, short last blocks, many rounds and one round
SIM_CASES = [
    (5 * 2 * om_worker.SCAN_MIN_BLOCKS * 4 + 3, 4, 0.6, 512, 2),
    (40_000, 8, 0.3, 64, 3),
    (30_001, 16, 1.0, 4096, 2),
    (12_345, 4, 0.05, 16, 2),
]


def _sim(ctx, dtype, deployment="colocated"):
    n, problems = ctx.world_size, []
    for i, (numel, bs, d, lanes, ch) in enumerate(SIM_CASES):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              inplace=True, threshold=THR, deployment=deployment)
        exp = exact_sum(n, numel, bs, d, i, dtype)
        for k in range(2):      # a second call through the same transport
            x = make_t(ctx.rank, numel, bs, d, i, dtype)
            y = t.allreduce(x)
            if y.data_ptr() != x.data_ptr() or not torch.equal(x.double(), exp):
                problems.append((i, k, float((x.double() - exp).abs().max())))
    return problems


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inplace_threshold_gives_the_exact_thresholded_sum_on_the_simfabric(n, dtype):
    out = sc.launch(functools.partial(_sim, dtype=dtype), n, backend="sim",
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [[]] * n


def test_inplace_threshold_with_dedicated_aggregators():
    out = sc.launch(functools.partial(_sim, dtype=torch.float32, deployment="dedicated"), 3, backend="sim",
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [[]] * 3


def _slow_scan(ctx, dtype):
    """The last rank scans slowly once its first range is done (a busy host): the first verdict, from the
    aggregator of the range it sent first, arrives while it still scans the rest."""
    n, r = ctx.world_size, ctx.rank
    bs = 8
    per = 4 * om_worker.SCAN_MIN_BLOCKS_REAL                # blocks per range: four scan pieces (on gloo)
    numel = n * per * bs
    scan = DenseSource.scan
    if r == n - 1:
        def slow(self, lo, hi):
            if self.lazy and self.mask.numel() == numel // bs and lo // per != (r - 1) % n:
                time.sleep(0.15)
            scan(self, lo, hi)
        DenseSource.scan = slow
    problems = []
    try:
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, inplace=True, threshold=THR)
        for seed, d in ((1, 1.0), (2, 0.4)):
            exp = exact_sum(n, numel, bs, d, seed, dtype)
            x = make_t(r, numel, bs, d, seed, dtype)
            y = t.allreduce(x)
            if y.data_ptr() != x.data_ptr() or not torch.equal(x.double(), exp):
                bad = (x.double() != exp).view(-1, bs).any(1).nonzero().flatten()
                problems.append((seed, int(bad.numel()), np.unique((bad // per).numpy()).tolist()))
    finally:
        DenseSource.scan = scan
    return problems


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_inplace_threshold_with_a_slow_scan_on_gloo(n):
    out = sc.launch(functools.partial(_slow_scan, dtype=torch.float32), n, backend="gloo", timeout_s=90)
    assert out == [[]] * n
