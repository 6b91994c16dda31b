"""The ring's default segment rule: a chunk of at least 2 * MIN_SEGMENT_BYTES travels in at least two
pipelined segments (so a step's forwarding overlaps its own arrival), none longer than
DEFAULT_SEGMENT_BYTES; an explicit ``segment_bytes`` is kept. The SimFabric's time and message count follow
theory.costs' closed form under that rule."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.transports.ring import DEFAULT_SEGMENT_BYTES, MIN_SEGMENT_BYTES, segment_length
from theory import costs

MIB = 1 << 20


@pytest.mark.parametrize("chunk_bytes,segment_bytes,expected_bytes", [
    (2_500_000, None, 1_250_000),                    # n = 4, 10 MB: two halves (was one 2.5 MB piece)
    (5_000_000, None, 2_500_000),                    # n = 2, 10 MB: two halves (was 4 MiB + 0.8 MiB)
    (25_000_000, None, DEFAULT_SEGMENT_BYTES),       # n = 4, 100 MB: unchanged
    (2 * MIN_SEGMENT_BYTES, None, MIN_SEGMENT_BYTES),            # the smallest chunk cut in two
    (2 * MIN_SEGMENT_BYTES - 8, None, 2 * MIN_SEGMENT_BYTES - 8),   # below: one piece
    (1000, None, 1000),
    (2_500_000, 4096, 4096),                         # an explicit segment is kept ...
    (2_500_000, DEFAULT_SEGMENT_BYTES, 2_500_000),   # ... also one longer than the chunk: unsegmented
])
def test_segment_length(chunk_bytes, segment_bytes, expected_bytes):
    seg = None if segment_bytes is None else segment_bytes // 4
    assert segment_length(chunk_bytes // 4, seg, 4) * 4 == expected_bytes


def test_segment_length_never_exceeds_the_chunk_or_drops_to_zero():
    for chunk in (0, 1, 2, 3, 1 << 18, (1 << 18) + 1, 1 << 22):
        for seg in (None, 1, 7, 1 << 20):
            s = segment_length(chunk, seg, 4)
            assert 1 <= s <= max(1, chunk)
            assert seg is None or s <= seg


def _ring(ctx, numel):
    t = sc.transports.get("ring", ctx.fabric)
    base = (torch.arange(numel) % 1000).to(torch.float32)      # small integers: every order sums exactly
    out = t.allreduce(base * (ctx.rank + 1))
    n = ctx.world_size
    assert torch.equal(out, base * (n * (n + 1) // 2))
    return t.last_stats


@pytest.mark.parametrize("n", [2, 4])
def test_a_midsize_chunk_travels_in_two_segments_as_the_closed_form_says(n):
    """4 workers x 10 MB at 1 Gbit/s: the netbed point where one 2.5 MB piece per step cost 1-3 ms a step."""
    numel = 10_000_000 // 4
    net = dict(bandwidth_gbps=1.0, latency_us=10.0)
    stats = sc.launch(functools.partial(_ring, numel=numel), n, network=sc.Network(**net))
    c = costs.ring_allreduce(n, 4 * numel, **net)
    hs = costs.handshake(n, costs.RING_HANDSHAKE_FIELDS["dense"])
    assert all(s.messages - hs.messages == 2 * 2 * (n - 1) for s in stats)   # two segments per step
    assert c.messages == max(s.messages for s in stats)
    assert max(s.modelled_time_s for s in stats) == pytest.approx(c.time_s, rel=0.02)
