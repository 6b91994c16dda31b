"""The SwitchML cost model (theory/costs.py) against the switch transport on SimFabric."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc
from theory.costs import SWITCHML_HANDSHAKE_FIELDS, handshake, ring_allreduce, switchml_allreduce, switchml_throughput

NET = dict(bandwidth_gbps=100.0, latency_us=2.0)


def _time(n: int, numel: int, **kw) -> float:
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, **kw)
        t.allreduce(torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)))
        return t.last_stats.modelled_time_s

    return max(sc.launch(fn, n, network=sc.Network(**NET)))


@pytest.mark.parametrize("pool", [2, 16, 64, 512])
def test_time_vs_pool_size_matches_model(pool):
    numel = 64 * 512
    sim = _time(2, numel, pool_size=pool)
    model = switchml_allreduce(2, numel * 4, pool_size=pool, **NET).time_s
    assert sim == pytest.approx(model, rel=0.15)


def test_time_is_flat_in_workers_and_matches_model():
    numel = 256 * 256
    # the data path is flat in n; only the workers' agreement header (ceil(log2 n) small messages) grows
    times = {n: _time(n, numel, pool_size=64, slot_elems=256) - handshake(n, SWITCHML_HANDSHAKE_FIELDS, **NET).time_s
             for n in (4, 8, 16)}
    model = switchml_allreduce(4, numel * 4, pool_size=64, slot_elems=256, **NET).time_s
    model -= handshake(4, SWITCHML_HANDSHAKE_FIELDS, **NET).time_s
    for n, t in times.items():
        assert t == pytest.approx(model, rel=0.15), n
        full = switchml_allreduce(n, numel * 4, pool_size=64, slot_elems=256, **NET).time_s
        assert full - handshake(n, SWITCHML_HANDSHAKE_FIELDS, **NET).time_s == pytest.approx(model, rel=1e-12)
    assert max(times.values()) / min(times.values()) < 1.02
    # the ring's time grows with n while the switch's does not
    assert ring_allreduce(16, numel * 4, **NET).time_s > ring_allreduce(4, numel * 4, **NET).time_s


def test_throughput_formula():
    line = 100e9 / 8
    # 256-element packets: payload 1024 of 1056 bytes -> ~97 % of the line rate once the pool covers the BDP
    assert switchml_throughput(pool_size=256, slot_elems=256, **NET) == pytest.approx(line * 1024 / 1056)
    small = switchml_throughput(pool_size=4, slot_elems=64, **NET)
    assert small == pytest.approx(4 * 256 / (2 * (2e-6 + 288 / line)))


def test_header_only_lookahead_moves_a_header_per_lane_and_takes_no_longer():
    """The library's switch on a real fabric sends a float job's exponent look-ahead header-only: ``(1 + M)``
    whole packets and ``L`` headers each way, in no more time than the paper's whole look-ahead packets."""
    numel, pool, elems, h = 1_000_000, 512, 256, 32
    M = -(-numel // elems)
    hs = handshake(2, SWITCHML_HANDSHAKE_FIELDS, **NET)
    whole = switchml_allreduce(2, numel * 4, pool_size=pool, slot_elems=elems, **NET)
    short = switchml_allreduce(2, numel * 4, pool_size=pool, slot_elems=elems, header_only_lookahead=True, **NET)
    assert whole.bytes_sent - hs.bytes_sent == (1 + M + pool) * (h + 4 * elems)
    assert short.bytes_sent - hs.bytes_sent == short.bytes_received - hs.bytes_received
    assert short.bytes_sent - hs.bytes_sent == (1 + M) * (h + 4 * elems) + pool * h
    assert short.messages == whole.messages and short.time_s < whole.time_s
    # an integer job has no look-ahead: the option changes nothing
    ints = dict(pool_size=pool, slot_elems=elems, fp32=False, **NET)
    assert switchml_allreduce(2, numel * 4, header_only_lookahead=True, **ints) == switchml_allreduce(2, numel * 4,
                                                                                                     **ints)
