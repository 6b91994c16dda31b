"""theory.costs: the closed forms agree with the SimFabric's modelled time and measured bytes."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.payload import Payload
from theory import costs

NET = dict(bandwidth_gbps=100.0, latency_us=2.0)
NS = (2, 4, 8, 16, 64)


def _grid(sizes, default_at_64):
    """``(*size, n)`` for every size and every n of NS. At 64 workers (seconds a case on the SimFabric) one
    size per closed form, ``default_at_64``, runs in the default suite; the others are slow (default suite:
    the same size at n <= 16 and ``default_at_64`` at n = 64 cover that closed form)."""
    cases = []
    for size in sizes:
        size = size if isinstance(size, tuple) else (size,)
        for n in NS:
            slow = n == 64 and size != (default_at_64 if isinstance(default_at_64, tuple) else (default_at_64,))
            cases.append(pytest.param(*size, n, marks=pytest.mark.slow) if slow else (*size, n))
    return cases


def _ring(ctx, numel, segment_bytes=costs.RING_SEGMENT_BYTES):
    t = sc.transports.get("ring", ctx.fabric, segment_bytes=segment_bytes)
    t.allreduce(torch.ones(numel))
    return t.last_stats


def _allgather_sparse(ctx, k):
    t = sc.transports.get("allgather", ctx.fabric)
    idx = torch.randperm(100 * k + 1, generator=torch.Generator().manual_seed(ctx.rank))[:k]
    p = Payload("sparse", torch.ones(k), torch.Size([100 * k + 1]), torch.float32, indices=idx)
    t.allreduce(p)
    return t.last_stats


def _measured(stats):
    n = len(stats)
    return (max(s.modelled_time_s for s in stats), sum(s.bytes_sent for s in stats) / n,
            sum(s.bytes_received for s in stats) / n, sum(s.messages for s in stats) / n)


@pytest.mark.parametrize("numel, n", _grid([1000, 1 << 16], default_at_64=1000))
def test_ring_time_and_bytes_match_the_closed_form(n, numel):
    stats = sc.launch(functools.partial(_ring, numel=numel), n, network=sc.Network(**NET))
    time_s, sent, received, msgs = _measured(stats)
    c = costs.ring_allreduce(n, 4 * numel, elem_size=4, **NET)
    assert time_s == pytest.approx(c.time_s, rel=0.10)
    assert sent == pytest.approx(c.bytes_sent, rel=1e-9) and received == pytest.approx(c.bytes_received, rel=1e-9)
    assert msgs == c.messages
    # the bandwidth term alone is 2(n-1)/n of the data per worker, as the ring promises
    assert c.bytes_sent - costs.handshake(n, costs.RING_HANDSHAKE_FIELDS["dense"]).bytes_sent == pytest.approx(2 * (n - 1) / n * 4 * numel)


@pytest.mark.parametrize("numel, segment_bytes, n", _grid([(1 << 16, 4096), (1 << 18, 1 << 17)],
                                                         default_at_64=(1 << 16, 4096)))
def test_pipelined_ring_matches_the_closed_form(n, numel, segment_bytes):
    stats = sc.launch(functools.partial(_ring, numel=numel, segment_bytes=segment_bytes), n,
                      network=sc.Network(**NET))
    time_s, sent, _, msgs = _measured(stats)
    c = costs.ring_allreduce(n, 4 * numel, segment_bytes=segment_bytes, **NET)
    assert time_s == pytest.approx(c.time_s, rel=0.10)
    assert sent == pytest.approx(c.bytes_sent, rel=1e-9)
    assert msgs == pytest.approx(c.messages, rel=0.02)
    # pipelining hides latency: never slower than the unsegmented ring
    assert time_s <= costs.ring_allreduce(n, 4 * numel, segment_bytes=1 << 40, **NET).time_s * 1.000001


@pytest.mark.parametrize("k, n", _grid([0, 300, 4096], default_at_64=0))
def test_allgather_time_and_bytes_match_the_closed_form(n, k):
    stats = sc.launch(functools.partial(_allgather_sparse, k=k), n, network=sc.Network(**NET))
    time_s, sent, received, msgs = _measured(stats)
    c = costs.allgather(n, k * (4 + 4), tensors=2, **NET)    # float32 values + int32 indices on the wire
    assert time_s == pytest.approx(c.time_s, rel=0.10)
    assert sent == received == c.bytes_sent
    assert msgs == c.messages


def test_closed_forms_have_the_textbook_shape():
    B, alpha = costs.link(100, 2)
    big = costs.ring_allreduce(8, 10**8, handshake_fields=0, segment_bytes=10**9)   # unsegmented
    assert big.steps == 14 and big.time_s == pytest.approx(14 * alpha + 2 * 7 / 8 * 1e8 / B, rel=1e-6)
    # pipelined in segments: the latency is paid once, the bandwidth term is unchanged
    piped = costs.ring_allreduce(8, 10**8, handshake_fields=0, segment_bytes=1 << 20)
    assert piped.time_s == pytest.approx(alpha + 2 * 7 / 8 * 1e8 / B, rel=1e-6)
    # allgather: (n-1) payloads in, after the sizes (one latency each)
    ag = costs.allgather(8, 10**6, header_bytes=0)
    assert ag.bytes_received == 7 * 10**6 and ag.time_s == pytest.approx(2 * alpha + 7e6 / B)
    assert costs.ring_allreduce(1, 10**6) == costs.ZERO == costs.allgather(1, 10**6)
    assert costs.handshake(64, 5).steps == 6
    with pytest.raises(ValueError):
        costs.link(0, 1)
