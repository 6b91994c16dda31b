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
            if ch.single and hi % BS == 0:
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
    # the last aggregator's range ends with the short last block: its host hands it over as it is (the
    # code before TailRun copied it; two workers: it sums there, HomeSums), its n - 1 remote workers send
    # the range of their tensor, unpadded
    # (wire.short_end; the code before that copied it into a message of whole blocks): no block is gathered
    assert gathered == []


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("lanes", [4, 5])
def test_hosted_tail_runs_over_several_rounds_keep_the_sums_bits(n, lanes):
    """Channels of several rounds: the host's later rounds' runs that end with the short last block
    (a lane's last block alone, or with some lanes only: joined, :meth:`.core.MessageSums.add`)."""
    numel, calls = 23 * BS + 77, 2
    res = sc.launch(functools.partial(_run, numel=numel, lanes=lanes, calls=calls), n, network=NET)
    for call in range(calls):
        exp = _expected(n, numel, call, lanes)
        for r in range(n):
            assert torch.equal(res[r][call], exp), (r, call)


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


def _run_holes(ctx, numel: int, lanes: int, holes: list[int]):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, lanes=lanes, channels=1, inplace=True)
    x = _x(ctx.rank, numel, 0)
    if ctx.rank == 1:
        for b in holes:
            x[b * BS:(b + 1) * BS] = 0
    return t.allreduce(x).clone()


def test_a_hosted_tail_run_holding_some_lanes_only_is_joined_and_keeps_the_bits(monkeypatch):
    """The host holds a run ending with the short last block but not every summed lane of the round:
    its blocks are added by index, as one tensor (:meth:`.blocks.TailRun.joined`)."""
    numel, lanes, holes = 23 * BS + 77, 4, [12, 16, 20]     # (found to give such a round: lanes of 6 blocks)
    joined = []
    join = blocks.TailRun.joined

    def counting(self):
        joined.append(self.numel())
        return join(self)

    monkeypatch.setattr(blocks.TailRun, "joined", counting)
    res = sc.launch(functools.partial(_run_holes, numel=numel, lanes=lanes, holes=holes), 2, network=NET)
    x0, x1 = _x(0, numel, 0), _x(1, numel, 0)
    for b in holes:
        x1[b * BS:(b + 1) * BS] = 0
    exp = x0 + x1
    assert joined, "the case no longer reaches the joined path"
    for r in range(2):
        assert torch.equal(res[r], exp), r
