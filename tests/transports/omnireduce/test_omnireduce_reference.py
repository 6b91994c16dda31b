"""The fast OmniReduce driver (the transport: the roles on ``Fabric.drive`` with the strategies) gives
the same bits as the reference driver (:mod:`sparsecomm.transports.omnireduce.reference`: the lane state
machines in a plain loop of exchanges), over a grid of sizes, densities, block sizes, lanes, channels,
world sizes, deployments and dtypes, on the SimFabric and on gloo.

Float inputs are random normals (not integers), so a sum's bits depend on the order its blocks are added
in: the comparison holds the order too. The one documented exception, the fast driver's in-place sums
(:class:`.strategies.HomeSums`, the host's blocks first), is compared on sums that are exact in any
order. Every worker rebuilds every worker's input from seeds.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.payload import Payload
from sparsecomm.transports.omnireduce import reference

NET = sc.Network(bandwidth_gbps=100, latency_us=2)

CASES = [  # numel, block_size, density, lanes, channels
    (10_000, 16, 0.3, 4, 2),      # many rounds per channel
    (999, 32, 1.0, 3, 3),         # dense, short last block
    (1_000, 7, 0.0, 8, 2),        # all zero
    (5_000, 256, 0.5, 1024, 2),   # one round (lanes >= blocks per channel)
    (3, 256, 1.0, 4, 4),          # fewer blocks than aggregators x channels
    (0, 16, 1.0, 4, 2),           # empty
    (20_000, 64, 1.0, 4096, 2),   # one round, dense: whole channels as views, sums into the result
    (20_005, 64, 0.2, 4096, 3),   # one round, sparse, short last block
    (20_005, 64, 1.0, 4096, 2),   # one round, dense, short last block: the last channel's messages unpadded
    (30_000, 8, 0.05, 16, 1),     # very sparse, one channel, many rounds
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.int64]


def make_x(rank: int, numel: int, bs: int, density: float, case: int, dtype: torch.dtype,
           exact: bool = False) -> torch.Tensor:
    """Blocks non-zero with probability ``density`` (half of them shared by every worker): random normals
    scaled per block over four decades, or (``exact``, and integer dtypes) small integers."""
    nb = -(-numel // bs)
    shared = np.random.default_rng([case, 10_000]).random(nb) < density / 2
    own = np.random.default_rng([case, rank]).random(nb) < density / 2
    keep = torch.from_numpy(shared | own | (density >= 1.0)).repeat_interleave(bs)[:numel]
    g = torch.Generator().manual_seed(case * 1000 + rank)
    if dtype.is_floating_point and not exact:
        scale = torch.pow(10.0, torch.randint(-2, 2, (nb,), generator=g).double()).repeat_interleave(bs)[:numel]
        vals = torch.randn(numel, generator=g, dtype=torch.float64) * scale
    else:
        vals = torch.randint(-20, 21, (numel,), generator=g).double()
    return torch.where(keep, vals, torch.zeros((), dtype=torch.float64)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def _reference_aggregators(fabric, num: int) -> list[int]:
    return [fabric.service(f"omnireduce-reference-agg:{i}", functools.partial(reference.serve, index=i))
            for i in range(num)]


def _grid(ctx, deployment, num_aggregators=None, inplace=False, dtypes=None, cases=CASES):
    """Every case through the transport and through the reference, in each of ``dtypes`` (default: three
    of :data:`DTYPES` per case, rotating with the case and the world size); the differences found."""
    n, r = ctx.world_size, ctx.rank
    aggs = None if deployment == "colocated" else _reference_aggregators(ctx.fabric, num_aggregators or n)
    problems = []
    for i, (numel, bs, d, lanes, ch) in enumerate(cases):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment=deployment, num_aggregators=num_aggregators, inplace=inplace)
        for dtype in dtypes or [DTYPES[(3 * i + n + k) % len(DTYPES)] for k in range(3)]:
            exact = inplace and n > 2   # in place, the host's blocks come first in the sum: exact sums only
            x = make_x(r, numel, bs, d, i, dtype, exact)
            fast = t.allreduce(x.clone())
            ref, down = reference.allreduce(ctx.fabric, x, block_size=bs, lanes=lanes, channels=ch, aggregators=aggs)
            if not same_bits(fast, ref.to(dtype)):
                problems.append((deployment, n, i, str(dtype), "bits"))
            if exact or not dtype.is_floating_point:   # and the reference is the sum
                total = sum(make_x(v, numel, bs, d, i, dtype, exact).double() for v in range(n))
                if not torch.equal(ref.double(), total) or down.is_floating_point != dtype.is_floating_point:
                    problems.append((deployment, n, i, str(dtype), "sum"))
    return problems


@pytest.mark.parametrize("deployment, n, num_aggregators", [
    ("colocated", 1, None), ("colocated", 2, None), ("colocated", 3, None), ("colocated", 5, None),
    ("dedicated", 1, None), ("dedicated", 2, None), ("dedicated", 3, None), ("dedicated", 3, 2),
    ("dedicated", 4, 5)])
def test_the_fast_driver_gives_the_reference_drivers_bits(deployment, n, num_aggregators):
    out = sc.launch(functools.partial(_grid, deployment=deployment, num_aggregators=num_aggregators), n,
                    network=NET)
    assert [p for probs in out for p in probs] == []


@pytest.mark.parametrize("n", [2, 3])
def test_in_place_sums_are_the_reference_drivers(n):
    """In place, colocated: one-round float32/64 channels are summed into the input itself; n = 2 on random
    floats (two addends: any order is the same bits), n = 3 on sums exact in any order."""
    out = sc.launch(functools.partial(_grid, deployment="colocated", inplace=True,
                                      dtypes=[torch.float32, torch.float64, torch.float16]), n, network=NET)
    assert [p for probs in out for p in probs] == []


def _payloads(ctx):
    """A sparse payload (blocks built from its indices and values) and a thresholded dense tensor."""
    n, r = ctx.world_size, ctx.rank
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=8, channels=2)
    g = torch.Generator().manual_seed(r)
    idx = torch.randperm(4000, generator=g)[:300]
    p = Payload("sparse", torch.randn(300, generator=g), (4000,), torch.float32, indices=idx)
    ref, _ = reference.allreduce(ctx.fabric, p.to_dense(), block_size=16, lanes=8, channels=2)
    ok = [same_bits(t.allreduce(p), ref)]
    x = make_x(r, 5000, 16, 0.6, 3, torch.float32)          # blocks of 0.01-scale values fall under 0.2
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=8, channels=2, threshold=0.2)
    ref, _ = reference.allreduce(ctx.fabric, x, block_size=16, lanes=8, channels=2, threshold=0.2)
    ok.append(same_bits(t.allreduce(x.clone()), ref) and not torch.equal(ref, sum(
        make_x(v, 5000, 16, 0.6, 3, torch.float32) for v in range(n))))
    return ok


def test_a_sparse_payload_and_a_threshold_give_the_reference_drivers_bits():
    assert sc.launch(_payloads, 3, network=NET) == [[True, True]] * 3


def test_the_comparison_sees_a_fast_driver_that_adds_in_another_order(monkeypatch):
    """The check can fail: a fast driver whose aggregators add the holders' blocks in the reverse order
    gives other bits on random floats (three workers), which the comparison reports."""
    from sparsecomm.transports.omnireduce import aggregator

    monkeypatch.setattr(aggregator, "sum_order", lambda index, n: [(index - k) % n for k in range(n)])
    out = sc.launch(functools.partial(_grid, deployment="colocated", dtypes=[torch.float64], cases=CASES[:1]), 3,
                    network=NET)
    assert all(("colocated", 3, 0, "torch.float64", "bits") in probs for probs in out), out


@pytest.mark.multiprocess
def test_the_fast_driver_gives_the_reference_drivers_bits_on_gloo():
    cases = [CASES[0], CASES[1], CASES[6], CASES[7], CASES[8]]
    out = sc.launch(functools.partial(_grid, deployment="colocated", cases=cases,
                                      dtypes=[torch.float32, torch.float16, torch.int32]), 3, backend="gloo",
                    timeout_s=120)
    assert out == [[], [], []]
