"""OmniReduce in place on a dense tensor whose last block is short: the hosting worker hands its run of
blocks that ends with that block to its aggregator without copying it (:class:`.blocks.TailRun`), and
every sum keeps its bits (the aggregator's order, :func:`.core.sum_order`, the host's blocks last)."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.transports.omnireduce import blocks, core, wire

NET = sc.Network(bandwidth_gbps=100, latency_us=2)
BS = 256


def _x(rank: int, numel: int, call: int) -> torch.Tensor:
    """Non-integer float32 values, so that the order of a sum shows in its bits."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * call + rank))


def _expected(n: int, numel: int, call: int, lanes: int) -> torch.Tensor:
    """The sum of every worker's input, each aggregator's range in its order: :func:`.core.sum_order`
    (the host's blocks last); the host's first where its in-place input holds the sums (a range of
    whole blocks, :class:`.strategies.HomeSums`)."""
    xs = [_x(r, numel, call) for r in range(n)]
    out = torch.empty(numel)
    for a, chans in enumerate(wire.plan(numel, BS, n, 1, lanes)):
        for ch in chans:
            lo, hi = ch.lo * BS, min((ch.lo + ch.size) * BS, numel)
            order = core.sum_order(a, n)
            if hi % BS == 0:
                order = [a] + order[:-1]
            acc = xs[order[0]][lo:hi].clone()
            for w in order[1:]:
                acc += xs[w][lo:hi]
            out[lo:hi] = acc
    return out


def _run(ctx, numel: int, lanes: int, calls: int):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, lanes=lanes, channels=1, inplace=True)
    outs = []
    for call in range(calls):
        x = _x(ctx.rank, numel, call)
        y = t.allreduce(x)
        assert y.data_ptr() == x.data_ptr()
        outs.append(y.clone())
    return outs


@pytest.mark.parametrize("n", [2, 3])
def test_a_hosted_run_ending_with_the_short_last_block_is_handed_over_uncopied(n, monkeypatch):
    numel, lanes, calls = 37 * BS + 10, 64, 2
    gathered = []
    gather = blocks.DenseSource.gather

    def counting(self, ids, out):
        gathered.append((int(ids[0]), int(ids[-1]) + 1))
        return gather(self, ids, out)

    monkeypatch.setattr(blocks.DenseSource, "gather", counting)
    res = sc.launch(functools.partial(_run, numel=numel, lanes=lanes, calls=calls), n, network=NET)
    for call in range(calls):
        exp = _expected(n, numel, call, lanes)
        for r in range(n):
            assert torch.equal(res[r][call], exp), (r, call)
    # the last aggregator's range ends with the short last block: its n - 1 remote workers copy it into
    # their message (a message is whole blocks); its host hands it over as it is (the old code copied it too)
    nb = -(-numel // BS)
    lo = wire.plan(numel, BS, n, 1, lanes)[n - 1][0].lo
    assert gathered == [(lo, nb)] * ((n - 1) * calls)


def test_tail_run_parts_are_views_of_the_source_and_its_padded_last_block():
    x = torch.arange(3 * BS + 5, dtype=torch.float32)
    src = blocks.DenseSource(x, BS)
    import numpy as np

    run = src.tail_run(np.arange(1, 4))
    assert run is not None and run.head.data_ptr() == x[BS:].data_ptr() and run.head.shape == (2, BS)
    assert run.last.shape == (1, BS) and torch.equal(run.last[0, :5], x[3 * BS:]) and not run.last[0, 5:].any()
    assert run.numel() == 3 * BS
    assert src.tail_run(np.arange(1, 3)) is None            # no short last block in it: a plain view
    assert src.tail_run(np.array([1, 3])) is None           # not a run
    assert blocks.DenseSource(x[:3 * BS], BS).tail_run(np.arange(1, 3)) is None    # no short block at all
