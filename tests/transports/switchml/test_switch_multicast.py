"""The switches' multicast on the SimFabric: a buffer to several workers is one ``isend_each`` of the fabric
(one request, one pass), and what the model does with it is what an ``isend`` per worker did, under loss too: each destination's drop decision and its random
draw in the same order. So the lossy scenarios' modelled times (``float.hex``), every endpoint's messages and
bytes sent and received (a dropped datagram is sent, never received) and the switches' counters are pinned
to the values the simulator gave when the switches sent one ``isend`` per worker; a change to the protocol's
messages must update them deliberately, with the reason in the commit."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.fabric.base import Fabric
from sparsecomm.fabric.sim.sim import SimFabric

NUMEL = 64 * 96


def _data(rank: int, density: float) -> torch.Tensor:
    """Normal values per rank; below density 1, the same random fraction of 256-blocks non-zero on every rank."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    if density < 1:
        nb = NUMEL // 256
        keep = torch.zeros(nb, dtype=torch.bool)
        keep[torch.randperm(nb, generator=torch.Generator().manual_seed(7))[: max(1, int(density * nb))]] = True
        x = x * keep.repeat_interleave(256)
    return x


def _rank(ctx, name: str, kw: dict, density: float):
    t = sc.transports.get(name, ctx.fabric, **kw)
    y = t.allreduce(_data(ctx.rank, density))
    return t.last_stats.modelled_time_s, y, t.dataplane, ctx.fabric.world if ctx.rank == 0 else None


def _observe(name: str, kw: dict, density: float, n: int, loss: float):
    """``(each rank's modelled seconds as float.hex, each endpoint's (messages, bytes sent, bytes received), the
    switch's counters, the sum)`` of one all-reduce on ``n`` workers at ``loss`` (seed 11)."""
    out = sc.launch(functools.partial(_rank, name=name, kw=kw, density=density), n,
                    network=sc.Network(bandwidth_gbps=100.0, latency_us=2.0, loss=loss, seed=11))
    ends = [(ep.stats.messages, ep.stats.bytes_sent, ep.stats.bytes_received) for ep in out[0][3].endpoints]
    return [o[0].hex() for o in out], ends, dict(sorted(out[0][2].stats.items())), out[0][1]


#: (transport, options, density, workers, loss, each rank's modelled seconds (float.hex), each endpoint's
#: (messages, bytes sent, bytes received), the switch's counters), 100 Gbit/s, 2 us, seed 11; the last endpoint
#: is the switch
PINNED = [
    ('switch', {}, 1.0, 4, 0.05, [
        '0x1.ebd52ade32cd6p-6', '0x1.ebd52ade32cd6p-6', '0x1.ebd52ade32cd6p-6', '0x1.ebd52ade32cd6p-6'
    ], [
        (262, 75424, 57568), (261, 75136, 60448), (256, 73696, 59872), (257, 73984, 60160), (861, 247968, 278208)
    ], {'consumed': 772, 'dropped': 105, 'multicast': 193, 'packets': 966, 'retransmit': 89}),
    ('switch', {'burst': 4}, 1.0, 4, 0.05, [
        '0x1.ebd653bc71312p-6', '0x1.ebd653bc71312p-6', '0x1.ebd653bc71312p-6', '0x1.ebd653bc71312p-6'
    ], [
        (65, 73120, 56992), (64, 71968, 58144), (65, 73120, 59296), (64, 71968, 65056), (211, 243072, 270720)
    ], {'consumed': 772, 'dropped': 96, 'multicast': 193, 'packets': 928, 'retransmit': 60}),
    ('switch', {}, 1.0, 8, 0.1, [
        '0x1.70baf02dde609p-4', '0x1.99b05c2713018p-4', '0x1.70baf02dde609p-4', '0x1.70baf02dde609p-4',
        '0x1.70baf02dde609p-4', '0x1.70baf02dde609p-4', '0x1.70baf02dde609p-4', '0x1.70baf02dde609p-4'
    ], [
        (341, 98160, 59856), (353, 101616, 63312), (348, 100176, 58992), (352, 101328, 61008), (344, 99024, 58416),
        (346, 99600, 66480), (344, 99024, 62736), (342, 98448, 69648), (1893, 545184, 714528)
    ], {'consumed': 1544, 'dropped': 588, 'multicast': 193, 'packets': 2481, 'retransmit': 349}),
    ('sparse-switch', {}, 0.3, 4, 0.05, [
        '0x1.0a9c9851f2f34p-10', '0x1.0a9c9851f2f34p-10', '0x1.0a9c9851f2f34p-10', '0x1.0aa21c815f4afp-10'
    ], [
        (14, 13024, 9904), (14, 13024, 9904), (14, 13024, 9904), (14, 13024, 11984), (38, 39520, 44720)
    ], {'consumed': 36, 'dropped': 5, 'multicast': 9, 'packets': 43, 'retransmit': 2}),
    ('sparse-switch', {'burst': 4}, 0.3, 4, 0.05, [
        '0x1.0adf87858a091p-10', '0x1.0adf87858a091p-10', '0x1.0adf87858a091p-10', '0x1.0adf87858a091p-10'
    ], [
        (7, 21344, 17184), (7, 21344, 17184), (7, 21344, 17184), (7, 21344, 17184), (17, 70720, 74880)
    ], {'consumed': 36, 'dropped': 3, 'multicast': 9, 'packets': 42, 'retransmit': 3}),
    ('sparse-switch', {}, 0.3, 8, 0.1, [
        '0x1.089ef3954a69ep-9', '0x1.089ef3954a69ep-9', '0x1.089efc2c505e0p-9', '0x1.08a488f2c2a9ap-9',
        '0x1.089efc2c505e0p-9', '0x1.089efc2c505e0p-9', '0x1.089efc2c505e0p-9', '0x1.08aa1e503ae9bp-9'
    ], [
        (16, 14336, 10176), (16, 14336, 10176), (16, 14336, 11216), (17, 15376, 11216), (16, 14336, 11216),
        (16, 14336, 10176), (16, 14336, 12256), (18, 16416, 13296), (86, 89440, 104000)
    ], {'consumed': 72, 'dropped': 14, 'multicast': 9, 'packets': 100, 'retransmit': 14}),
]


@pytest.mark.parametrize("name, kw, density, n, loss, times, ends, counters", PINNED,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}-d{c[2]}-n{c[3]}-loss{c[4]}"
                              for c in PINNED])
def test_lossy_multicasts_model_what_a_send_per_worker_did(name, kw, density, n, loss, times, ends, counters):
    got_times, got_ends, got_counters, y = _observe(name, kw, density, n, loss)
    assert got_times == times and got_ends == ends and got_counters == counters
    assert sum(e[1] for e in ends) > sum(e[2] for e in ends)      # datagrams were dropped: the cases are lossy
    exact = sum(_data(r, density).double() for r in range(n))
    assert (y.double() - exact).abs().max() < 1e-4 * (exact.abs().max() + 1)


@pytest.mark.parametrize("name, density", [("switch", 1.0), ("sparse-switch", 0.3)])
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_a_result_to_every_worker_is_one_isend_each(name, density, loss, monkeypatch):
    """Every send of the switch's endpoint is one ``isend_each`` per buffer: to all ``n`` workers (a result) or
    to one (a retransmission), never a result split into a call per worker."""
    n = 4
    calls: list = []
    orig = SimFabric.isend_each

    def isend_each(self, tensor, dsts, tag, works, reliable=True, stable=False):
        calls.append((self.rank, tuple(dsts), reliable))
        return orig(self, tensor, dsts, tag, works, reliable, stable)

    monkeypatch.setattr(SimFabric, "isend_each", isend_each)
    times, ends, _, _ = _observe(name, {}, density, n, loss)
    switch = [c for c in calls if c[0] == n]         # (the service endpoint follows the workers)
    widths = [len(d) for _, d, _ in switch]
    assert sum(widths) == ends[n][0]                 # every message of the switch went through these calls
    assert widths.count(n) > 0 and set(widths) <= {1, n}
    assert all(d == tuple(range(n)) for _, d, _ in switch if len(d) == n)
    assert all(not reliable for _, _, reliable in switch)
    if loss == 0.0:                                  # no retransmission: every send a multicast
        assert set(widths) == {n}
    else:
        assert 1 in widths                           # the faults happened: retransmissions to one worker


class _RealFabric:
    """A fabric without modelled time that records its sends, with the generic ``isend_each``."""

    modelled_time = False
    isend_each = Fabric.isend_each

    def __init__(self) -> None:
        self.sent: list = []

    def isend(self, tensor, dst, tag=0, *, reliable=True):
        self.sent.append((dst, tag, reliable))
        return ("work", dst)


def test_the_generic_isend_each_is_an_isend_per_destination_with_its_reliability():
    f, works = _RealFabric(), []
    assert f.isend_each(torch.zeros(3), range(3), 7, works, reliable=False) is works
    assert f.sent == [(0, 7, False), (1, 7, False), (2, 7, False)]
    assert works == [("work", 0), ("work", 1), ("work", 2)]
    f.isend_each(torch.zeros(3), [1], 8, works)
    assert f.sent[-1] == (1, 8, True)
