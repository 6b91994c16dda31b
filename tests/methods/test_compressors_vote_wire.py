"""signSGD's majority vote on the wire: the ring sums the votes as int8 partial sums (8x the declared bit
per coordinate), widening only when n needs it; allgather ships the signs packed, as declared; the default transport
takes the cheaper; ``compression_stats()`` reports both figures."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.compressors.vote import VoteSign
from sparsecomm.transports._guards import int_accumulator
from sparsecomm.transports._handshake import HEADER_BYTES

from tests._train_common import compression_stats_after_two_steps

D = 1 << 14
SLACK_BYTES = 1536      # handshakes and headers


def _vote_worker(ctx, transport):
    x = torch.randn(D, generator=torch.Generator().manual_seed(100 + ctx.rank))
    p = VoteSign().compress(x)
    t = sc.transports.get(transport, ctx.fabric)
    agg = t.allreduce(p)
    return t.last_stats.bytes_sent, t.wire_copies() * p.bits / 8, agg


@pytest.mark.parametrize("n", [2, 3])
def test_ring_sends_int8_partial_sums_and_allgather_the_declared_bits(n):
    ring = sc.launch(functools.partial(_vote_worker, transport="ring"), world_size=n)
    gather = sc.launch(functools.partial(_vote_worker, transport="allgather"), world_size=n)
    xs = [torch.randn(D, generator=torch.Generator().manual_seed(100 + r)) for r in range(n)]
    votes = sum(torch.where(x < 0, -1.0, 1.0) for x in xs)
    for sent, declared, agg in ring:
        assert torch.equal(agg, votes)                                   # the exact sum of the votes
        assert 8 * declared - 16 <= sent <= 8 * declared + SLACK_BYTES   # one byte per partial sum
    for sent, declared, agg in gather:
        assert torch.equal(agg, votes)
        assert declared - 16 <= sent <= 1.05 * declared + SLACK_BYTES    # packed: 1 bit per vote


def test_partial_sums_widen_only_when_the_worker_count_needs_it():
    assert [int_accumulator(torch.int8, n, 1, "t") for n in (2, 127, 128, 32767, 32768)] == \
        [torch.int8, torch.int8, torch.int16, torch.int16, torch.int32]
    assert int_accumulator(torch.int32, 4, 2**30, "t") == torch.int64    # plain tensors: own dtype or wider
    assert int_accumulator(torch.int16, 2, 100, "t") == torch.int16
    assert [VoteSign.sum_bits(n) for n in (2, 127, 128, 40000)] == [8, 8, 16, 32]


def test_ring_vote_sum_beyond_int8_is_exact():
    """200 simulated votes of magnitude 1 summed by 2 workers holding 100 each: int16 partial sums."""
    def worker(ctx):
        p = VoteSign().compress(torch.full((64,), -1.0))
        p = sc.payload.Payload("quantized", p.values * 100, p.shape, p.dtype, scale=p.scale,
                               bucket_size=p.bucket_size, shared_scale=True)   # codes of magnitude 100
        t = sc.transports.get("ring", ctx.fabric)
        return t.allreduce(p), t.last_stats.bytes_sent

    for agg, sent in sc.launch(worker, world_size=2):
        assert torch.equal(agg, torch.full((64,), -200.0))
        # one agreement header, then the ring's reduce-scatter and all-gather of 32 values each: 2-byte
        # partial sums (int32 ones would be 256 bytes)
        assert sent == HEADER_BYTES + 64 * 2


def _stats_worker(ctx, transport):
    return compression_stats_after_two_steps(ctx, transport, "signsgd", {}, D)


def test_compression_stats_and_auto_for_the_vote():
    name, s = sc.launch(functools.partial(_stats_worker, transport="ring"), world_size=2)[0]
    assert s["sent_over_declared"] == pytest.approx(8, rel=0.05)         # int8 sums for 1 declared bit
    name, s = sc.launch(functools.partial(_stats_worker, transport="default"), world_size=2)[0]
    assert name == "allgather"
    assert 1.0 <= s["sent_over_declared"] <= 1.05 + 2 * SLACK_BYTES / s["bytes_declared_sent"]   # 2 steps' headers
