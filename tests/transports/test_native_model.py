"""``native``'s model on the SimFabric (:mod:`sparsecomm.transports.native.model`): gloo's ring all-reduce, its
messages charged the host's native message rates."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidValueError
from sparsecomm.fabric.sim.sim_host import HostModel
from sparsecomm.fabric.sim.sim_profile import profile_dict
from sparsecomm.transports.native.model import GlooRing, gloo_ring_plan
from sparsecomm.transports.ring import ring_allreduce_

MIB = 1 << 20


def gloo_sends(numel: int, elem: int, n: int, rank: int, max_segment: int = MIB) -> list[int]:
    """The bytes of every send of ``rank`` in gloo's ring (``gloo/allreduce.cc``, ``ring``), transcribed from its
    loops: ``computeReduceScatterOffsets`` and ``computeAllgatherOffsets`` for ``i < numSegments -
    numSegmentsPerRank``, a send where its length is positive."""
    total = numel * elem
    max_seg = elem * max(1, max_segment // elem)
    num = max((total + max_seg - 1) // max_seg, n * 2)
    num = (num + n - 1) // n * n
    per = num // n
    seg = ((total + num - 1) // num + elem - 1) // elem * elem
    out = []
    for first in (rank + 1, rank):          # (reduce-scatter's send offsets, then all-gather's)
        for i in range(num - per):
            offset = ((first * per + i) * seg) % (num * seg)
            length = min(seg, total - offset)
            if length > 0:
                out.append(length)
    return out


@pytest.mark.parametrize(("numel", "n", "plan"), [
    (250_000, 4, (8, 31_250)),              # 1 MB on 4: 2n segments, 125 kB each
    (2_500_000, 2, (10, 250_000)),          # 10 MB on 2: 10 segments of 1 MB (below 1 MiB)
    (25_000_000, 4, (96, 260_417)),         # 100 MB on 4: ceil(1e8 / 2^20) = 96 segments, 1_041_668 bytes
    (5, 3, (6, 1)),                         # fewer elements than segments: some empty
])
def test_the_plan_is_gloos_segments_by_hand(numel, n, plan):
    assert gloo_ring_plan(numel, 4, n) == plan


def _call(ctx, numel: int, dtype: torch.dtype = torch.float32, **kw):
    t = GlooRing(ctx.fabric, **kw)
    x = (torch.arange(numel) % 1000).to(dtype) + ctx.rank
    t0 = ctx.fabric.now()
    y = t.allreduce(x)
    took = ctx.fabric.now() - t0
    n = ctx.world_size
    assert torch.equal(y, n * ((torch.arange(numel) % 1000).to(dtype)) + sum(range(n)))
    return t.last_stats.messages, t.last_stats.bytes_sent, took


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 5, 1000, 262_145, 2_500_001])
def test_each_rank_sends_gloos_messages_and_sums_exactly(n, numel):
    got = sc.launch(functools.partial(_call, numel=numel), n, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0))
    for rank, (messages, sent, _) in enumerate(got):
        want = gloo_sends(numel, 4, n, rank)
        assert (messages, sent) == (len(want), sum(want)), rank


def test_an_integer_input_is_summed_in_int32_after_the_handshake():
    got = sc.launch(functools.partial(_call, numel=3000, dtype=torch.int16), 3,
                    network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0))
    assert all(m > len(gloo_sends(3000, 4, 3, r)) for r, (m, _, _) in enumerate(got))      # (the handshake's too)


def _net(host: HostModel) -> sc.Network:
    return sc.Network(bandwidth_gbps=1e9, latency_us=0.0, host=host)     # (no wire to speak of: 1e-14 s a message)


def test_the_native_rates_charge_each_message_on_each_side_by_hand():
    """Two workers, 4 segments (2 per rank): each rank sends 2 and takes 2 per phase, every one on its own clock,
    one after the other (a message is in as its sender's send ends, with no wire): 8 messages' cost; the model's
    own message rates, however large, are not charged to them."""
    numel = 1000
    own = HostModel(send_message_s=1.0, recv_message_s=1.0, send_byte_s=1e-3, recv_byte_s=1e-3)
    base = [t for *_, t in sc.launch(functools.partial(_call, numel=numel, inplace=True, nonfinite="pass"), 2,
                                      network=_net(dataclasses.replace(own, native_message_s=0.0, native_byte_s=0.0)))]
    assert base == pytest.approx([0.0, 0.0], rel=0, abs=1e-12)
    m, b = 3e-5, 2e-10
    timed = [t for *_, t in sc.launch(functools.partial(_call, numel=numel, inplace=True, nonfinite="pass"), 2,
                                       network=_net(dataclasses.replace(own, native_message_s=m, native_byte_s=b)))]
    seg = gloo_ring_plan(numel, 4, 2)[1] * 4
    assert timed == pytest.approx([8 * (m + seg * b)] * 2, rel=1e-9, abs=1e-12)
    # without native rates (None, an old profile): the model's own message costs, as every message's
    old = [t for *_, t in sc.launch(functools.partial(_call, numel=numel, inplace=True, nonfinite="pass"), 2,
                                     network=_net(own))]
    assert old == pytest.approx([8 * (1.0 + seg * 1e-3)] * 2, rel=1e-9, abs=1e-12)


def _ring(ctx) -> float:
    acc = torch.ones(4000)
    ring_allreduce_(ctx.fabric, acc)
    return ctx.fabric.now()


def test_the_native_rates_change_no_other_transports_time():
    host = HostModel(send_message_s=3e-6, recv_message_s=5e-6, send_byte_s=7e-10, recv_byte_s=1.1e-9,
                     sum_element_s={"float32": 2.5e-10})
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_ring, 4, network=net(host=host))
    native = dataclasses.replace(host, native_message_s=1e-3, native_byte_s=1e-9)
    assert [t.hex() for t in sc.launch(_ring, 4, network=net(host=native))] == [t.hex() for t in base]


def test_the_native_rates_are_both_or_neither_and_checked():
    with pytest.raises(InvalidValueError, match="native_message_s and native_byte_s"):
        HostModel(native_message_s=1e-5)
    with pytest.raises(InvalidValueError, match="native_byte_s"):
        HostModel(native_message_s=1e-5, native_byte_s=-1.0)
    h = HostModel(native_message_s=1e-5, native_byte_s=2e-10, send_message_s=7.0, message_cpu_s={64: 1.0},
                  message_wait_s={64: 2.0}, copy_byte_s=3e-10)
    n = h.native_messages()
    assert (n.send_message_s, n.recv_message_s, n.send_byte_s, n.recv_byte_s) == (1e-5, 1e-5, 2e-10, 2e-10)
    assert not n.tabled and n.copy_byte_s == h.copy_byte_s and n.native_messages() is n.native_messages()
    assert HostModel().native_messages() == HostModel()


def test_a_profile_without_the_native_rates_loads_and_one_with_them_round_trips(tmp_path):
    host = HostModel(send_message_s=1e-5, recv_message_s=2e-5, call_s={"native": 1e-3})
    old = profile_dict(host, date="2026-01-01T00:00:00+00:00", machine={}, method={})
    assert "native_message_s" not in old["host"] and "native_byte_s" not in old["host"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path).host
    assert loaded == host and loaded.native_message_s is None and loaded.native_messages() is loaded
    new = dataclasses.replace(host, native_message_s=2e-5, native_byte_s=3e-10)
    prof = profile_dict(new, date="2026-01-01T00:00:00+00:00", machine={}, method={})
    assert prof["host"]["native_message_s"] == {"value": 2e-5, "unit": "s/message"}
    assert prof["host"]["native_byte_s"] == {"value": 3e-10, "unit": "s/byte"}
    path.write_text(json.dumps(prof))
    assert sc.Network.from_profile(path).host == new
    del prof["host"]["native_byte_s"]
    path.write_text(json.dumps(prof))
    with pytest.raises(InvalidValueError, match="native_message_s and native_byte_s"):
        sc.Network.from_profile(path)
