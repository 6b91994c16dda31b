"""OmniReduce's messages of every block of a one-round channel that ends with the tensor's short last block
(:func:`.wire.short_end`): a remote worker sends its range of the tensor as it is and receives the sums
straight into its result, without the last block's padding and without a copy; the sums keep their bits."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.payload import Payload
from sparsecomm.transports.omnireduce import blocks, core, reference, wire

NET = sc.Network(bandwidth_gbps=100, latency_us=2)
BS = 256


def _x(rank: int, numel: int, call: int) -> torch.Tensor:
    """Non-integer float32 values, so that the order of a sum shows in its bits."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * call + rank))


def _expected(n: int, numel: int, call: int, inplace: bool) -> torch.Tensor:
    """Every aggregator's range summed in its order (:func:`.core.sum_order`); in place, the host's first
    where its input holds the sums (a range of whole blocks, :class:`.strategies.HomeSums`)."""
    xs = [_x(r, numel, call) for r in range(n)]
    out = torch.empty(numel)
    for a, chans in enumerate(wire.plan(numel, BS, n, 1, 1 << 14)):
        for ch in chans:
            lo, hi = ch.lo * BS, min((ch.lo + ch.size) * BS, numel)
            order = core.sum_order(a, n)
            if inplace and hi % BS == 0:
                order = [a] + order[:-1]
            acc = xs[order[0]][lo:hi].clone()
            for w in order[1:]:
                acc += xs[w][lo:hi]
            out[lo:hi] = acc
    return out


def _patch(setattr_) -> tuple[list, list]:
    """Count the blocks gathered into a message and the sums written from one (``(first, stop)`` of each
    run), through ``setattr_`` (a test's ``monkeypatch.setattr``, or plain ``setattr`` in a process of its own)."""
    gathered, written = [], []
    gather, write = blocks.DenseSource.gather, blocks.BlockSink.write

    def counting_gather(self, ids, out):
        gathered.append((int(ids[0]), int(ids[-1]) + 1))
        return gather(self, ids, out)

    def counting_write(self, ids, data):
        written.append((int(ids[0]), int(ids[-1]) + 1))
        return write(self, ids, data)

    setattr_(blocks.DenseSource, "gather", counting_gather)
    setattr_(blocks.BlockSink, "write", counting_write)
    return gathered, written


def _calls(ctx, numel: int, calls: int, inplace: bool, count: bool = False):
    """Each call's result (and, ``count``: this process's counts, :func:`_patch`)."""
    counts = _patch(setattr) if count else None
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, channels=1, inplace=inplace)
    return [t.allreduce(_x(ctx.rank, numel, call)).clone() for call in range(calls)], counts


def _check_sums(res, n: int, numel: int, calls: int, inplace: bool) -> None:
    for r, (outs, _) in enumerate(res):
        for call in range(calls):
            assert torch.equal(outs[call], _expected(n, numel, call, inplace)), (r, call)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("inplace", [True, False])
def test_every_block_of_a_channel_ending_short_travels_unpadded_and_uncopied(n, inplace, monkeypatch):
    numel, calls = 37 * BS + 10, 2
    gathered, written = _patch(monkeypatch.setattr)      # (every rank of the SimFabric: this process)
    res = sc.launch(functools.partial(_calls, numel=numel, calls=calls, inplace=inplace), n, network=NET)
    _check_sums(res, n, numel, calls, inplace)
    # the last aggregator's range, every block: no worker gathers it into a padded message (the code
    # before short_end: each remote worker did); the others receive the sums straight into their result
    # (before: each wrote them from a message); its host writes them from its hosted aggregator's message,
    # but for two workers in place, where they are summed in its input (HomeSums: no write)
    nb = -(-numel // BS)
    lo = wire.plan(numel, BS, n, 1, 1 << 14)[n - 1][0].lo
    assert (lo, nb) not in gathered, gathered
    host_writes = 0 if inplace and n == 2 else calls
    assert [w for w in written if w == (lo, nb)] == [(lo, nb)] * host_writes, written


def _holes(ctx, numel: int, holes: dict):
    x = _x(ctx.rank, numel, 0)
    for b in holes.get(ctx.rank, ()):
        x[b * BS:min((b + 1) * BS, numel)] = 0
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, channels=1, inplace=True)
    return t.allreduce(x).clone()


@pytest.mark.parametrize("holes", [     # (blocks 19-37 are the last aggregator's; 37 is the short one)
    {0: [30], 1: [30, 33]},     # both hold the short last block, not every block summed: its sum goes padded (fused)
    {0: [25], 1: [37]},         # the host lacks the short last block: the remote's, padded, is added
    {0: [37], 1: [20]},         # the remote lacks it: the host's stays
    {0: [37], 1: [37]},         # nobody holds it: it is not summed (fused)
    {0: [20, 22]},              # the remote holds blocks by index, then the short one
    {1: [19]},                  # the remote holds every block: its range, unpadded, added to the host's
])
def test_two_workers_sum_a_channel_ending_short_in_the_hosts_input(holes):
    """Two workers, in place: the last aggregator sums its channel that ends with the short last block in its
    host's input (:class:`.strategies.HomeSums` over the range), whichever blocks each holds; the sums are
    the plain sums (one addition each, the same bits in either order)."""
    numel = 37 * BS + 10
    res = sc.launch(functools.partial(_holes, numel=numel, holes=holes), 2, network=NET)
    xs = [_x(r, numel, 0) for r in range(2)]
    for r, bs_ in holes.items():
        for b in bs_:
            xs[r][b * BS:min((b + 1) * BS, numel)] = 0
    for r in range(2):
        assert torch.equal(res[r], xs[0] + xs[1]), r


def _bytes(ctx, numel: int):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, channels=1)
    t.allreduce(_x(ctx.rank, numel, 0))
    return t.last_stats.bytes_sent


def test_the_short_last_blocks_padding_does_not_travel():
    """Two workers: worker 0 sends the last aggregator its blocks and gets their sums, each exactly its range
    of the tensor (10 elements of the last block, not 256); every other message the same as without a
    short block."""
    whole, short = sc.launch(functools.partial(_bytes, numel=38 * BS), 2, network=NET), \
        sc.launch(functools.partial(_bytes, numel=37 * BS + 10), 2, network=NET)
    lost = (BS - 10) * 4
    assert whole[0] - short[0] == lost          # worker 0's blocks to aggregator 1
    assert whole[1] - short[1] == lost          # aggregator 1's sums to worker 0


def _sparse_every_block(ctx, numel: int, bs: int):
    """A sparse payload with a value in every block (the last one short), against the reference's bits."""
    g = torch.Generator().manual_seed(ctx.rank)
    idx = torch.cat([torch.arange(0, numel, bs), torch.randint(0, numel, (200,), generator=g)])
    p = Payload("sparse", torch.randn(idx.numel(), generator=g), (numel,), torch.float32, indices=idx)
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=4096, channels=1)
    ref, _ = reference.allreduce(ctx.fabric, p.to_dense(), block_size=bs, lanes=4096, channels=1)
    got = t.allreduce(p)
    return got.view(torch.int32).equal(ref.view(torch.int32))


@pytest.mark.parametrize("n", [2, 3])
def test_a_sparse_payload_holding_every_block_gives_the_reference_bits(n):
    """A packed source has no view of its blocks: gathered into a message whose padding is left off."""
    assert sc.launch(functools.partial(_sparse_every_block, numel=3001, bs=64), n, network=NET) == [True] * n


def test_short_end_is_the_last_one_round_channels_padding_only():
    chans = wire.plan(37 * BS + 10, BS, 2, 1, 1 << 14)
    assert [wire.short_end(ch, 37 * BS + 10, BS) for a in chans for ch in a] == [0, BS - 10]
    assert [wire.short_end(ch, 38 * BS, BS) for a in wire.plan(38 * BS, BS, 2, 1, 1 << 14) for ch in a] == [0, 0]
    several = wire.plan(37 * BS + 10, BS, 2, 1, 4)          # several rounds: messages keep whole blocks
    assert [wire.short_end(ch, 37 * BS + 10, BS) for a in several for ch in a] == [0, 0]
    x = torch.arange(3 * BS + 5, dtype=torch.float32)
    v = blocks.DenseSource(x, BS).run_to_end(np.arange(1, 4))
    assert v is not None and v.data_ptr() == x[BS:].data_ptr() and v.numel() == 2 * BS + 5
    assert blocks.DenseSource(x, BS).run_to_end(np.arange(1, 3)) is None


@pytest.mark.multiprocess
def test_on_gloo_every_block_of_a_channel_ending_short_travels_unpadded_and_uncopied():
    numel, calls = 37 * BS + 10, 2
    res = sc.launch(functools.partial(_calls, numel=numel, calls=calls, inplace=True, count=True), 2,
                    backend="gloo", timeout_s=60)
    _check_sums(res, 2, numel, calls, True)
    nb = -(-numel // BS)
    lo = wire.plan(numel, BS, 2, 1, 1 << 14)[1][0].lo
    (_, (gathered0, written0)), (_, (gathered1, written1)) = res
    assert gathered0 == gathered1 == []                      # worker 0 sends its range of the tensor
    assert written0 == written1 == []      # worker 0 receives the sums into it, worker 1 sums in its input
