"""The SimFabric's host model (:mod:`sparsecomm.fabric.sim.sim_host`), host profiles and the calibrate command."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import threading

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidTypeError, InvalidValueError, MismatchError
from sparsecomm.fabric.sim.sim_host import MESSAGE_TABLES, RATE_UNITS, SIZES, SUM_DTYPES, HostModel
from sparsecomm.fabric.base import MESSAGE_BYTES
from sparsecomm.fabric.engine import engine
from sparsecomm.fabric.sim.sim_profile import FORMAT, VERSION, host_from_profile, netbed_latency_s, profile_dict
from sparsecomm.netbed.calibrate import CALL_GROUPS, CALL_ELEMS_OF, PEER_CALLS, PEER_WORKERS, SYNC_WORK_S
from sparsecomm.transports.ring import ring_allreduce_

N, CHUNK = 4, 1000          # a 4-worker ring over 4 chunks of 1000 float32: one segment per chunk


def _ring(ctx) -> float:
    acc = torch.full((N * CHUNK,), float(ctx.rank + 1))
    ring_allreduce_(ctx.fabric, acc)
    assert torch.equal(acc, torch.full_like(acc, sum(range(1, N + 1))))
    return ctx.fabric.now()


def _ring_times(host: HostModel | None) -> list[float]:
    return sc.launch(_ring, N, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=host))


HOST = HostModel(send_message_s=3e-6, recv_message_s=5e-6, send_byte_s=7e-10, recv_byte_s=1.1e-9,
                 sum_element_s={"float32": 2.5e-10})


def test_ring_allreduce_charges_each_message_and_sum_by_hand():
    base = _ring_times(None)
    timed = _ring_times(HOST)
    nbytes = CHUNK * 4
    # the ring is one chain of 2(n-1) hops: each a send (its CPU time before the NIC), the transfer, the
    # receiver taking it; the n-1 reduce-scatter hops add their chunk before the next send
    send = HOST.send_message_s + nbytes * HOST.send_byte_s
    recv = HOST.recv_message_s + nbytes * HOST.recv_byte_s
    extra = 2 * (N - 1) * (send + recv) + (N - 1) * CHUNK * HOST.sum_element_s["float32"]
    for b, t in zip(base, timed):
        assert t == pytest.approx(b + extra, rel=1e-12, abs=0)


def test_shared_cores_double_the_cpu_part():
    base = _ring_times(None)[0]
    one = _ring_times(HOST)[0]
    shared = HOST.sharing(endpoints=4, cores=2)
    assert shared.cpu_share == 2.0
    two = _ring_times(shared)[0]
    assert two - base == pytest.approx(2 * (one - base), rel=1e-12, abs=0)
    # per endpoint: only worker 2 shares its core; the others' CPU part is unchanged
    own = _ring_times(dataclasses.replace(HOST, cpu_share_by_endpoint={2: 3.0}))
    assert own[2] > one


def test_a_straggler_stretches_its_host_costs():
    t = sc.launch(lambda ctx: (ctx.fabric.host_work("copy", 10), ctx.fabric.now())[1], 2,
                  network=sc.Network(host=HostModel(copy_byte_s=1e-6), stragglers={1: 3.0}))
    assert t == pytest.approx([1e-5, 3e-5], rel=1e-12)


def _allreduce(ctx, name: str, kw: dict) -> float:
    x = torch.randn(1 << 12, generator=torch.Generator().manual_seed(ctx.rank))
    x[: 1 << 11] = 0               # half the blocks zero
    t = sc.transports.get(name, ctx.fabric, **kw)
    t.allreduce(x)
    return t.last_stats.modelled_time_s


CASES = [("ring", {}), ("omnireduce", {"lanes": 4}), ("omnireduce", {"lanes": 4, "deployment": "dedicated"}),
         ("switch", {}), ("sparse-switch", {})]


@pytest.mark.parametrize("name, kw", CASES, ids=[c[0] + "-" + "-".join(map(str, c[1].values())) for c in CASES])
def test_a_model_of_zero_costs_changes_no_modelled_time(name, kw):
    run = functools.partial(_allreduce, name=name, kw=kw)
    none = sc.launch(run, 4, network=sc.Network())
    zero = sc.launch(run, 4, network=sc.Network(host=HostModel(sum_element_s={d: 0.0 for d in SUM_DTYPES})))
    assert [t.hex() for t in zero] == [t.hex() for t in none]


#: each transport's declared host work, alone: a rate that only it charges must lengthen the call
WORK = [("ring", {}, {"sum_element_s": {"float32": 1e-8}}),
        ("omnireduce", {"lanes": 4}, {"scan_element_s": 1e-8}),
        ("omnireduce", {"lanes": 4, "deployment": "dedicated"},
         {"sum_element_s": {d: 1e-8 for d in SUM_DTYPES}}),
        ("switch", {}, {"switch_packet_s": 1e-6}),
        ("sparse-switch", {}, {"switch_packet_s": 1e-6}),
        ("ring", {}, {"copy_byte_s": 1e-8}),
        ("ring", {}, {"fresh_byte_s": 1e-8}),
        ("switch", {}, {"fresh_byte_s": 1e-8}),
        ("sparse-switch", {}, {"copy_byte_s": 1e-8}),
        ("sparse-switch", {}, {"fresh_byte_s": 1e-8}),
        ("omnireduce", {"lanes": 4}, {"scan_zero_element_s": 1e-8}),
        ("omnireduce", {"lanes": 4}, {"move_byte_s": 1e-8}),
        ("omnireduce", {"lanes": 1, "deployment": "dedicated"}, {"move_byte_s": 1e-8}),
        ("omnireduce", {"lanes": 4}, {"check_element_s": 1e-8}),
        ("ring", {}, {"check_element_s": 1e-8})]


@pytest.mark.parametrize("name, kw, rates", WORK, ids=[f"{c[0]}-{next(iter(c[2]))}" for c in WORK])
def test_each_transport_declares_its_host_work(name, kw, rates):
    run = functools.partial(_allreduce, name=name, kw=kw)
    none = sc.launch(run, 4, network=sc.Network())
    charged = sc.launch(run, 4, network=sc.Network(host=HostModel(**rates)))
    assert max(charged) > max(none)


def _call(ctx, name: str, numel: int) -> tuple[float, int, int | None, int, int]:
    """One call of ``name``: its modelled time, the messages this worker sent, the fabric's ``message_bytes``,
    (the switch) the packets this worker streamed, and the bytes it sent."""
    t = sc.transports.get(name, ctx.fabric)
    y = t.allreduce(torch.ones(numel))
    assert torch.equal(y, torch.full_like(y, float(ctx.world_size)))
    packets = sum(v["packets"] for v in t.last_info.values() if isinstance(v, dict)) if name == "switch" else 0
    return t.last_stats.modelled_time_s, t.last_stats.messages, ctx.fabric.message_bytes, packets, t.last_stats.bytes_sent


def test_a_call_is_charged_once_per_worker_at_its_start_by_hand():
    run = functools.partial(_call, name="ring", numel=N * CHUNK)
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = [r[0] for r in sc.launch(run, N, network=net())]
    # every worker's clock moves by the call's cost before its first message: the whole call shifts by it
    timed = [r[0] for r in sc.launch(run, N, network=net(host=HostModel(call_s={"ring": 1e-3})))]
    assert timed == pytest.approx([b + 1e-3 for b in base], rel=1e-12, abs=0)
    # stretched by the CPU share like every host cost
    shared = [r[0] for r in sc.launch(run, N, network=net(host=HostModel(call_s={"ring": 1e-3}, cpu_share=2.0)))]
    assert shared == pytest.approx([b + 2e-3 for b in base], rel=1e-12, abs=0)
    # another transport's cost is not this one's
    other = [r[0] for r in sc.launch(run, N, network=net(host=HostModel(call_s={"omnireduce": 1.0})))]
    assert [t.hex() for t in other] == [b.hex() for b in base]
    with pytest.raises(InvalidValueError, match="needs the name of the transport"):
        HostModel(call_s={"ring": 1.0}).work_s("call", 1)
    with pytest.raises(InvalidTypeError, match="call_s has key 3"):
        HostModel(call_s={3: 1.0})


SWITCH_ELEMS = 1 << 16      # 256 packets of the real fabric's 256 values; 1024 of the paper's 64


def _switch(host: HostModel) -> tuple[float, int, int | None, int, int]:
    """A 2-worker switch call's modelled time (the slower worker's), and of worker 0: its messages sent, the
    fabric's ``message_bytes``, the packets it streamed and its bytes sent."""
    out = sc.launch(functools.partial(_call, name="switch", numel=SWITCH_ELEMS), 2,
                    network=sc.Network(bandwidth_gbps=100.0, latency_us=1.0, host=host))
    assert out[0][1:] == out[1][1:]
    return (max(o[0] for o in out),) + out[0][1:]


def test_a_host_with_a_cost_per_message_sends_the_switch_bursts_charged_per_message():
    # no cost per message: the paper's one packet per datagram
    _, sent, mb, _, _ = _switch(HostModel(switch_packet_s=1e-6))
    assert mb is None and sent > SWITCH_ELEMS // 64                  # a datagram per 64-value packet
    # a cost per message: a real fabric's message size, so the switch's packets travel as bursts
    per_msg = dict(send_message_s=1e-9, recv_message_s=1e-9)
    base, sent, mb, packets, sent_bytes = _switch(HostModel(**per_msg))
    # a few bursts, not 256 messages: the agreement header, the control packet, and the job's 256 lanes' look-ahead
    # and data in four messages each (a lane window in four)
    assert mb == MESSAGE_BYTES and sent <= 10 and packets >= SWITCH_ELEMS // 256
    # messages as long as their packets (as over gloo), not padded to a burst of 1024: the bytes are the packets',
    # the look-ahead's (one packet per lane, exponents only) a header each in SHORT messages (a header each), as
    # over gloo, and the agreement header (272 bytes)
    row, header, lanes = (8 + 256) * 4, 8 * 4, SWITCH_ELEMS // 256
    assert sent_bytes == (packets - lanes) * row + (lanes + 4) * header + 272
    # with the switch's program the bottleneck (rates far above everything else's), the call lengthens by the
    # switch's serial work: one charge per message of each worker (but about one, which it runs while the
    # other worker's is on its way) ...
    S = 1e-2
    t, *_ = _switch(HostModel(**per_msg, switch_message_s=S))
    assert 2 * sent - 2 - 0.01 <= (t - base) / S <= 2 * sent
    # ... and one per data packet of both workers, none per row of padding
    S = 1e-4
    t, *_ = _switch(HostModel(**per_msg, switch_packet_s=S))
    assert 2 * packets - 1 <= (t - base) / S <= 2 * packets + 2 * sent


SPARSE_BLOCKS = 256           # blocks of 256 float32 of the sparse switch's call (one lane each: L = 256)


def _sparse_call(ctx) -> tuple[float, dict]:
    """A 2-worker sparse-switch call of :data:`SPARSE_BLOCKS` blocks: worker 0 holds the blocks ``b % 2 == 0``,
    worker 1 those with ``b % 4 in (0, 1)``; its modelled time and the worker's per-phase counts."""
    b = torch.arange(SPARSE_BLOCKS).repeat_interleave(256)
    held = (b % 2 == 0) if ctx.rank == 0 else (b % 4 <= 1)
    x = torch.where(held, torch.ones(b.numel()), torch.zeros(b.numel()))
    t = sc.transports.get("sparse-switch", ctx.fabric)
    y = t.allreduce(x)
    assert torch.equal(y, (b % 2 == 0).float() + (b % 4 <= 1).float())
    return t.last_stats.modelled_time_s, {k: dict(v) for k, v in t.last_info.items() if isinstance(v, dict)}


PER_MSG = dict(send_message_s=1e-9, recv_message_s=1e-9)       # a real fabric's bursts (1024 packets a message)


def _sparse(host: HostModel) -> tuple[float, list[dict]]:
    out = sc.launch(_sparse_call, 2, network=sc.Network(bandwidth_gbps=100.0, latency_us=1.0, host=host))
    return max(o[0] for o in out), [o[1] for o in out]


def test_the_sparse_switch_charges_its_own_rates_per_packet_value_packet_and_result_by_hand():
    base, info = _sparse(HostModel(**PER_MSG))
    # by hand: each worker sends the control packet, ceil((L + 1) / 256) = 2 look-ahead packets (values both) and
    # one packet per union block (b % 4 < 3: 192), a value packet where it holds the block (128 each), else a skip
    union, held, lookahead = 3 * SPARSE_BLOCKS // 4, SPARSE_BLOCKS // 2, 2
    packets = 2 * (1 + lookahead + union)
    values = 2 * (1 + lookahead) + 2 * held
    results = 1 + lookahead + union
    for i in info:
        assert [i[p]["packets"] for p in ("control", "lookahead", "stream")] == [1, lookahead, union]
        assert i["stream"]["data"] == held and i["stream"]["skips"] == union - held
        assert sum(i[p]["results"] for p in i) == results
    # with the program the bottleneck (a rate far above everything else's), the call lengthens by the switch's
    # serial work: the rate times the packets, the value packets or the results, stretched by the CPU share
    S = 1.0
    for rates, count in (({"sparse_switch_packet_s": S}, packets), ({"sparse_switch_value_s": S}, values),
                         ({"sparse_switch_result_s": S}, results)):
        for share in (1.0, 2.0):
            t, _ = _sparse(HostModel(**PER_MSG, **rates, cpu_share=share))
            assert (t - base) / (share * S) == pytest.approx(count, abs=0.01), rates
    # one charge per message the switch takes: at least each worker's control and look-ahead messages and one
    # stream message, at most one per packet
    t, _ = _sparse(HostModel(**PER_MSG, sparse_switch_message_s=S))
    assert 2 * 3 - 0.01 <= (t - base) / S <= packets
    assert abs((t - base) / S - round((t - base) / S)) < 0.01
    # the dense switch's rates are not the sparse switch's once it has its own
    own = dict(sparse_switch_packet_s=0.0, sparse_switch_value_s=0.0, sparse_switch_result_s=0.0,
               sparse_switch_message_s=0.0)
    t, _ = _sparse(HostModel(**PER_MSG, **own, switch_packet_s=S, switch_message_s=S))
    assert t.hex() == base.hex()


def test_the_sparse_switch_workers_are_charged_per_result_they_take_by_hand():
    base, info = _sparse(HostModel(**PER_MSG))
    results = [sum(i[p]["results"] for p in i) for i in info]
    assert results[0] == results[1] == 1 + 2 + 3 * SPARSE_BLOCKS // 4        # (control, look-ahead, union)
    # with the workers' Python the bottleneck (a rate far above everything else's): the call lengthens by a
    # worker's results times the rate, stretched by the CPU share (the workers take theirs at the same time)
    S = 1.0
    for share in (1.0, 2.0):
        t, _ = _sparse(HostModel(**PER_MSG, sparse_switch_round_s=S, cpu_share=share))
        assert (t - base) / (share * S) == pytest.approx(results[0], abs=0.01)
    # a model without it (None, as a profile written before it existed) charges nothing: the bits of a rate of 0
    t, _ = _sparse(HostModel(**PER_MSG, sparse_switch_round_s=0.0))
    assert t.hex() == base.hex() and HostModel().sparse_switch_round_s is None
    assert HostModel().work_s("sparse_switch_round", 5) == 0.0
    assert HostModel(sparse_switch_round_s=2.0).work_s("sparse_switch_round", 5) == 10.0


def test_a_model_without_the_sparse_switch_rates_charges_the_dense_switch_rates_as_before(tmp_path):
    # a profile without the sparse switch's rates (one written before they existed) loads with them None ...
    path = tmp_path / "host.json"
    profile = _profile(FULL)
    assert not any(k.startswith("sparse_switch") for k in profile["host"])
    path.write_text(json.dumps(profile))
    old = sc.Network.from_profile(path, bandwidth_gbps=100.0, latency_us=1.0)
    assert old.host.sparse_switch_packet_s is None and old.host.sparse_switch_result_s is None
    # ... and charges the dense switch's packet and message rates, nothing per value packet or result: the
    # same bits as those rates given as the sparse switch's own
    explicit = dataclasses.replace(FULL, sparse_switch_packet_s=FULL.switch_packet_s, sparse_switch_value_s=0.0,
                                   sparse_switch_result_s=0.0, sparse_switch_message_s=FULL.switch_message_s)
    got = sc.launch(_sparse_call, 2, network=old)
    want = sc.launch(_sparse_call, 2, network=dataclasses.replace(old, host=explicit))
    assert [g[0].hex() for g in got] == [w[0].hex() for w in want]
    # the dense switch's rates do reach the call (the comparison above is not of two calls that charge nothing)
    free = sc.launch(_sparse_call, 2, network=dataclasses.replace(
        old, host=dataclasses.replace(FULL, switch_packet_s=0.0, switch_message_s=0.0)))
    assert max(g[0] for g in got) > max(f[0] for f in free)
    # a profile with them round-trips them; None is no rate of a profile
    path.write_text(json.dumps(_profile(explicit)))
    assert sc.Network.from_profile(path).host == explicit
    with pytest.raises(InvalidValueError, match="sparse_switch_value_s"):
        HostModel(sparse_switch_value_s=-1.0)


def _short_message(ctx) -> list[float]:
    if ctx.rank == 0:
        ctx.fabric.send(torch.ones(3), 1, 5)
        return []
    buf = torch.full((5,), 7.0)
    ctx.fabric.recv(buf, 0, 5)
    return buf.tolist()


def test_a_host_with_a_cost_per_message_receives_a_shorter_message_into_a_prefix_as_gloo():
    host = HostModel(send_message_s=1e-6)
    assert sc.launch(_short_message, 2, network=sc.Network(host=host))[1] == [1.0, 1.0, 1.0, 7.0, 7.0]
    for net in (sc.Network(), sc.Network(host=HostModel(copy_byte_s=1e-9))):   # the model's datagrams
        with pytest.raises(MismatchError, match="expected 5 x torch.float32 .* but received 3 x torch.float32"):
            sc.launch(_short_message, 2, network=net)


TABLE = dict(message_cpu_s={64: 2e-4, 4096: 3e-4, 1 << 20: 2.3e-3},
             message_wait_s={64: 1e-4, 4096: 1e-4, 1 << 20: 5e-4})


def test_a_table_by_message_size_interpolates_and_replaces_the_linear_message_rates():
    host = HostModel(send_message_s=1.0, recv_message_s=1.0, send_byte_s=1.0, recv_byte_s=1.0, **TABLE)
    assert host.tabled and host.per_message and not HostModel().tabled and not HostModel(copy_byte_s=1.0).per_message
    assert HostModel(**TABLE).per_message           # (a table alone: a real fabric's messages)
    half = {n: c / 2 for n, c in TABLE["message_cpu_s"].items()}
    for n in (1, 64):                               # below the first size: its values
        assert (host.send_s(n), host.recv_s(n), host.wait_s(n)) == (half[64], half[64], 1e-4)
    # between two sizes: linear in bytes; the linear rates (1 s a message) play no part
    n = 64 + (4096 - 64) // 4
    assert host.send_s(n) == pytest.approx(half[64] + (half[4096] - half[64]) * (n - 64) / (4096 - 64), rel=1e-12)
    assert host.recv_s(n) == host.send_s(n) and host.wait_s(n) == pytest.approx(1e-4, rel=1e-12)
    assert host.send_s(1 << 20) == half[1 << 20] and host.wait_s(1 << 20) == 5e-4
    # beyond the last size: the line of the last two
    slope = (half[1 << 20] - half[4096]) / ((1 << 20) - 4096)
    assert host.send_s(4 << 20) == pytest.approx(half[1 << 20] + slope * (3 << 20), rel=1e-12)
    assert host.wait_s(4 << 20) == pytest.approx(5e-4 + 4e-4 / ((1 << 20) - 4096) * (3 << 20), rel=1e-12)
    with pytest.raises(InvalidValueError, match="same message sizes"):
        HostModel(message_cpu_s={64: 1e-4}, message_wait_s={128: 1e-4})
    with pytest.raises(InvalidValueError, match="message_wait_s"):
        HostModel(message_cpu_s={64: 1e-4}, message_wait_s={64: -1e-4})
    with pytest.raises(InvalidValueError, match="a message size of message_cpu_s"):
        HostModel(message_cpu_s={0: 1e-4}, message_wait_s={0: 1e-4})


STREAM, SMALL = 20, 64          # messages of the stream and of the ping-pong, bytes each


def _stream_and_ping_pong(ctx) -> tuple[float, float]:
    """Worker 0 sends :data:`STREAM` messages at once, worker 1 takes them (a stream); then after a barrier
    they exchange :data:`STREAM` round trips (a ping-pong); each worker's modelled time of each."""
    f, peer = ctx.fabric, 1 - ctx.rank
    msg = torch.zeros(SMALL, dtype=torch.uint8)
    t0 = f.now()
    if ctx.rank == 0:
        for w in [f.isend(msg, 1, 1) for _ in range(STREAM)]:
            w.wait()
    else:
        for _ in range(STREAM):
            f.recv(msg, 0, 1)
    stream = f.now() - t0
    f.barrier()
    t0 = f.now()
    for _ in range(STREAM):
        if ctx.rank == 0:
            f.send(msg, 1, 2)
            f.recv(msg, 1, 2)
        else:
            f.recv(msg, 0, 2)
            f.send(msg, 0, 2)
    return stream, f.now() - t0


def test_a_stream_of_messages_overlaps_their_waits_where_a_ping_pong_pays_each_by_hand():
    host = HostModel(**TABLE)
    net = sc.Network(bandwidth_gbps=100.0, latency_us=0.0, host=host)
    (_, pp0), (stream1, _) = sc.launch(_stream_and_ping_pong, 2, network=net)
    cpu, wait, wire = host.send_s(SMALL), host.wait_s(SMALL), SMALL / net.bytes_per_s
    # the stream: the receiver pays the first message's send, wire and wait, then each message's receive
    # (its CPU: the sender's sends, as long, keep ahead of it)
    assert stream1 == pytest.approx(cpu + wire + wait + STREAM * cpu, rel=1e-9)
    # the ping-pong: every hop a send, the wire, the wait and the receive, one after the other
    assert pp0 == pytest.approx(2 * STREAM * (2 * cpu + wire + wait), rel=1e-9)
    # the linear rates of the same exchange charge the stream every message's whole cost
    line = HostModel(send_message_s=cpu + wait / 2, recv_message_s=cpu + wait / 2)
    (_, pp0), (stream1, _) = sc.launch(_stream_and_ping_pong, 2, network=dataclasses.replace(net, host=line))
    assert pp0 == pytest.approx(2 * STREAM * (2 * cpu + wire + wait), rel=1e-9)
    assert stream1 == pytest.approx(line.send_s(SMALL) + wire + STREAM * line.recv_s(SMALL), rel=1e-9)


def test_a_profile_with_the_table_by_message_size_round_trips_and_one_without_it_models_the_line(tmp_path):
    path = tmp_path / "host.json"
    tabled = dataclasses.replace(FULL, **TABLE)
    profile = _profile(tabled)
    assert profile["host"]["message_cpu_s"] == {"value": {"64": 2e-4, "4096": 3e-4, "1048576": 2.3e-3},
                                                "unit": "s/message"}
    path.write_text(json.dumps(profile))
    assert sc.Network.from_profile(path).host == tabled
    assert "message_cpu_s" not in _profile(FULL)["host"] and "message_wait_s" not in _profile(FULL)["host"]
    path.write_text(json.dumps(_profile(FULL)))
    assert sc.Network.from_profile(path).host == FULL and not FULL.tabled
    for key, value, error, match in (("message_cpu_s", {"64": 1e-4}, InvalidValueError, "same message sizes"),
                                     ("message_cpu_s", {"x": 1e-4}, InvalidValueError, "message sizes in bytes"),
                                     ("message_cpu_s", {}, InvalidTypeError, "maps message sizes"),
                                     ("message_wait_s", {"64": -1.0}, InvalidValueError, "finite rate >= 0")):
        bad = _profile(tabled)
        bad["host"][key]["value"] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(error, match=match):
            sc.Network.from_profile(path)


def _sparse_bytes(ctx) -> tuple[int, int]:
    """A sparse-switch call of :data:`SPARSE_BLOCKS` blocks (:func:`_sparse_call`): the worker's packets and the
    bytes it sent."""
    before = ctx.fabric.stats.bytes_sent
    _, info = _sparse_call(ctx)
    return sum(v.get("packets", 0) for v in info.values()), ctx.fabric.stats.bytes_sent - before


def test_the_sparse_switch_on_a_host_with_a_cost_per_message_sends_messages_as_long_as_their_packets():
    out = sc.launch(_sparse_bytes, 2, network=sc.Network(bandwidth_gbps=100.0, latency_us=1.0,
                                                          host=HostModel(**PER_MSG)))
    row = (4 + 256) * 4             # a packet's row: its header and 256 values
    for packets, sent in out:
        # (a burst padded to its 1024 rows would be a MiB a message; + the agreement's few hundred bytes)
        assert 0 < packets and packets * row <= sent <= (packets + 1) * row


def test_host_model_is_a_value():
    import copy
    import pickle

    again = pickle.loads(pickle.dumps(FULL))
    assert again == FULL and hash(again) == hash(FULL) and copy.deepcopy(FULL) == FULL
    assert FULL.sum_element_s["float32"] == 1e-10
    with pytest.raises(TypeError):
        FULL.sum_element_s["float32"] = 0.0        # frozen, its table too


def test_host_model_validates_its_rates():
    with pytest.raises(InvalidValueError, match="send_byte_s"):
        HostModel(send_byte_s=-1.0)
    with pytest.raises(InvalidValueError, match="cpu_share"):
        HostModel(cpu_share=0.5)
    with pytest.raises(InvalidValueError, match="fresh_byte_s"):
        HostModel(fresh_byte_s=-1e-9)
    with pytest.raises(InvalidValueError, match="fresh_min_bytes must be an integer >= 0"):
        HostModel(fresh_min_bytes=-1)
    with pytest.raises(InvalidTypeError, match="fresh_min_bytes must be an integer"):
        HostModel(fresh_min_bytes=1.5)
    with pytest.raises(InvalidValueError, match="no torch dtype"):
        HostModel(sum_element_s={"float33": 1e-9})
    with pytest.raises(InvalidValueError, match="int8"):
        HostModel().work_s("sum", 3, torch.int8)
    with pytest.raises(InvalidValueError,
                       match="unknown operation 'add'.*sum, scan, switch_packet, switch_message, copy, fresh, call"):
        HostModel().work_s("add", 3)
    with pytest.raises(InvalidTypeError, match="host must be a HostModel"):
        sc.Network(host={"send_message_s": 1.0})


# ------------------------------------------------------------------------------------------------ profiles
def _profile(host: HostModel) -> dict:
    return profile_dict(host, date="2026-01-01T00:00:00+00:00", machine={"cpu_count": 1}, method={})


FULL = HostModel(send_message_s=1e-5, recv_message_s=2e-5, send_byte_s=3e-10, recv_byte_s=4e-10, copy_byte_s=5e-11,
                 sum_element_s={d: (i + 1) * 1e-10 for i, d in enumerate(SUM_DTYPES)}, scan_element_s=6e-10,
                 switch_packet_s=7e-7, switch_message_s=8e-6, call_s={"ring": 1e-3, "omnireduce": 2e-3})


def test_from_profile_round_trips_and_takes_overrides(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_profile(FULL)))
    net = sc.Network.from_profile(path)
    assert net.host == FULL and net.bandwidth_gbps == sc.Network().bandwidth_gbps
    net = sc.Network.from_profile(str(path), bandwidth_gbps=1.0, cpu_share=2.0, send_message_s=0.0)
    assert net.bandwidth_gbps == 1.0 and net.host.cpu_share == 2.0 and net.host.send_message_s == 0.0
    assert net.host.recv_message_s == FULL.recv_message_s


def _broken(**edit) -> dict:
    p = _profile(FULL)
    for where, value in edit.items():
        *keys, last = where.split("__")
        d = p
        for k in keys:
            d = d[k]
        if value is None:
            del d[last]
        else:
            d[last] = value
    return p


@pytest.mark.parametrize("profile, error, match", [
    (_broken(extra=1), InvalidValueError, r"unknown key\(s\) \['extra'\]"),
    (_broken(version=3), InvalidValueError, "version 3 is not supported"),
    (_broken(version=1), InvalidValueError, "version 1 is not supported any more.*calibrate again"),
    (_broken(format="x"), InvalidValueError, "format is 'x'"),
    (_broken(host=None), InvalidValueError, "no 'host'"),
    (_broken(host__bogus_s={"value": 1.0, "unit": "s"}), InvalidValueError, r"unknown rate\(s\) \['bogus_s'\]"),
    (_broken(host__copy_byte_s=None), InvalidValueError, r"lacks the rate\(s\) \['copy_byte_s'\]"),
    (_broken(host__send_byte_s={"value": -1e-9, "unit": "s/byte"}), InvalidValueError,
     r"host\.send_byte_s\.value must be a finite rate >= 0"),
    (_broken(host__send_byte_s={"value": "1", "unit": "s/byte"}), InvalidTypeError, r"host\.send_byte_s\.value"),
    (_broken(host__switch_packet_s={"value": 1e-6, "unit": "s/message"}), InvalidValueError,
     r"host\.switch_packet_s has unit 's/message', expected 's/packet'"),
    (_broken(host__sum_element_s__value__bfloat16=None), InvalidValueError, r"lacks the dtype\(s\) \['bfloat16'\]"),
    (_broken(host__sum_element_s__value__int32=-1.0), InvalidValueError, r"sum_element_s\.value\['int32'\]"),
    (_broken(host__call_s={"value": 1e-3, "unit": "s/call"}), InvalidTypeError,
     r"host\.call_s\.value maps transport names to rates, got float"),
    (_broken(host__call_s__value__ring=-1e-3), InvalidValueError, r"host\.call_s\.value\['ring'\] must be a finite"),
    (_broken(host__switch_message_s=None), InvalidValueError, r"lacks the rate\(s\) \['switch_message_s'\]"),
    (_broken(host__fresh_byte_s={"value": -1e-9, "unit": "s/byte"}), InvalidValueError,
     r"host\.fresh_byte_s\.value must be a finite rate >= 0"),
    (_broken(host__fresh_min_bytes={"value": -1, "unit": "byte"}), InvalidValueError,
     r"host\.fresh_min_bytes\.value must be a size >= 0"),
    (_broken(host__fresh_min_bytes={"value": 1.5, "unit": "byte"}), InvalidTypeError,
     r"host\.fresh_min_bytes\.value must be an integer \(bytes\), got float"),
    (_broken(host__fresh_min_bytes={"value": 1, "unit": "s/byte"}), InvalidValueError,
     r"host\.fresh_min_bytes has unit 's/byte', expected 'byte'"),
], ids=["top-key", "version", "version-1", "format", "no-host", "rate-key", "missing-rate", "negative", "not-number", "unit",
        "missing-dtype", "negative-sum", "call-not-map", "call-negative", "no-switch-message", "fresh-negative",
        "fresh-min-negative", "fresh-min-float", "fresh-min-unit"])
def test_from_profile_refuses_a_bad_profile_naming_the_key(tmp_path, profile, error, match):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(error, match=match):
        sc.Network.from_profile(path)


NETBED = {"latency_s": 2.5e-4, "gbps": 1, "hosts": 2}


def test_a_profile_records_the_netbeds_latency_beside_the_host_model(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_profile(FULL)))
    assert netbed_latency_s(path) is None                 # (calibrated without a netbed, or an older profile)
    p = profile_dict(FULL, date="2026-01-01T00:00:00+00:00", machine={}, method={}, netbed=NETBED)
    assert p["netbed"] == {"latency_s": {"value": 2.5e-4, "unit": "s"}, "gbps": 1.0, "hosts": 2}
    path.write_text(json.dumps(p))
    assert netbed_latency_s(path) == 2.5e-4
    # not the host model's, nor any network's but the netbed's: from_profile leaves the latency alone
    net = sc.Network.from_profile(path)
    assert net.host == FULL and net.latency_us == sc.Network().latency_us
    with pytest.raises(InvalidValueError, match="hosts must be at least 2"):
        profile_dict(FULL, date="", machine={}, method={}, netbed={**NETBED, "hosts": 1})


def _with_netbed(**edit) -> dict:
    p = profile_dict(FULL, date="2026-01-01T00:00:00+00:00", machine={}, method={}, netbed=NETBED)
    for where, value in edit.items():
        *keys, last = where.split("__")
        d = p
        for k in keys:
            d = d[k]
        if value is None:
            del d[last]
        else:
            d[last] = value
    return p


@pytest.mark.parametrize("profile, match", [
    (_with_netbed(netbed__latency_s={"value": -1e-6, "unit": "s"}), r"netbed\.latency_s\.value must be a finite rate"),
    (_with_netbed(netbed__latency_s={"value": 1e-4, "unit": "us"}), r"netbed\.latency_s must be"),
    (_with_netbed(netbed__hosts=None), r"netbed must be \{'latency_s'"),
    (_with_netbed(netbed__gbps=0), r"netbed\.gbps must be > 0"),
], ids=["negative", "unit", "no-hosts", "gbps"])
def test_a_bad_netbed_section_is_refused_naming_the_key(tmp_path, profile, match):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile))
    for read in (netbed_latency_s, sc.Network.from_profile):
        with pytest.raises(InvalidValueError, match=match):
            read(path)


def test_from_profile_refuses_an_unknown_override_and_an_unreadable_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_profile(FULL)))
    with pytest.raises(InvalidValueError, match=r"unknown override\(s\) \['bandwith_gbps'\].*bandwidth_gbps"):
        sc.Network.from_profile(path, bandwith_gbps=1.0)
    with pytest.raises(InvalidValueError, match="cannot be read"):
        sc.Network.from_profile(tmp_path / "absent.json")
    path.write_text("{")
    with pytest.raises(InvalidValueError, match="is not JSON"):
        sc.Network.from_profile(path)


@pytest.mark.multiprocess
def test_calibrate_command_writes_a_loadable_profile(tmp_path, capsys):
    """``calibrate --quick`` (the command's own entry, run in this process: its ranks come from the session's
    fork server) writes a profile of the documented format that loads. What holds on any machine under any
    load: a median of timed kernel runs is positive; every fitted rate is finite, at least 0 and the clipped
    fit of the measurements the profile records (a fit may reach 0 when the machine is busy)."""
    from sparsecomm.netbed.__main__ import main
    from sparsecomm.netbed.calibrate import fit_nonnegative

    out = tmp_path / "host.json"
    threads = torch.get_num_threads()
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads                       # the caller's threads given back
    assert capsys.readouterr().out.endswith(f"wrote {out}\n")
    profile = json.loads(out.read_text())
    assert profile["format"] == FORMAT and profile["version"] == VERSION
    assert set(profile) - {"netbed", "by_share"} == {"format", "version", "date", "machine", "method", "host"}
    assert datetime.datetime.fromisoformat(profile["date"]).tzinfo is not None
    m = profile["machine"]
    assert m["torch"] == torch.__version__ and m["cpu_count"] == os.cpu_count() and m["torch_threads"] == 1
    assert isinstance(m["platform"], str) and m["platform"]
    method, host = profile["method"], profile["host"]
    assert method["quick"] is True
    # (the slowdown with every core busy: measured where there are two cores or more, else none and left out)
    assert set(host) == set(RATE_UNITS) - (set() if os.cpu_count() >= 2 else {"codec_contention"})
    for name, unit in RATE_UNITS.items():
        if name not in host:
            continue
        entry = host[name]
        assert entry["unit"] == unit
        values = (entry["value"] if name in ("sum_element_s", "call_s", "codec_contention", "call_peer_s", *MESSAGE_TABLES)
                  else {name: entry["value"]})
        if name == "sum_element_s":
            assert set(values) == set(SUM_DTYPES)
        if name == "call_s":
            assert set(values) == {t for names in CALL_GROUPS.values() for t in names}
        if name == "call_peer_s":
            assert set(values) == set(PEER_CALLS)
        for v in values.values():
            assert isinstance(v, int if name in SIZES else float) and math.isfinite(v) and v >= 0
    # medians of timed kernel runs (each run takes time): positive
    assert all(host["sum_element_s"]["value"][d] > 0 for d in SUM_DTYPES)
    assert host["copy_byte_s"]["value"] > 0 and host["scan_element_s"]["value"] > 0
    assert host["move_byte_s"]["value"] > 0 and host["check_element_s"]["value"] > 0
    from sparsecomm.fabric.sim.sim_host import CODEC_RATES
    assert all(host[r]["value"] > 0 for r in CODEC_RATES.values())     # (medians of timed kernel runs too)
    # the message rates: the line through the recorded exchange times (each positive), clipped at 0 and split
    # evenly between sender and receiver; a line through positive points is positive somewhere in their
    # range, so the per-message and per-byte rates are not both 0
    fit = method["message_fit"]
    assert all(t > 0 for t in fit["exchange_s"])
    slope, intercept = np.polyfit(np.array(fit["sizes"], dtype=np.float64), np.array(fit["exchange_s"]), 1)
    assert (fit["slope_s_per_byte"], fit["intercept_s"]) == pytest.approx((slope, intercept), rel=1e-9, abs=1e-15)
    for side in ("send", "recv"):
        assert host[f"{side}_message_s"]["value"] == max(0.0, fit["intercept_s"]) / 2
        assert host[f"{side}_byte_s"]["value"] == max(0.0, fit["slope_s_per_byte"]) / 2
    assert host["send_message_s"]["value"] + host["send_byte_s"]["value"] > 0
    # the same exchanges by size: each one's CPU time (recorded; at most its time) and the rest of its time
    cpu, wait = host["message_cpu_s"]["value"], host["message_wait_s"]["value"]
    assert list(cpu) == list(wait) == [str(n) for n in fit["sizes"]]
    for n, t, c in zip(fit["sizes"], fit["exchange_s"], fit["exchange_cpu_s"]):
        assert cpu[str(n)] == min(c, t) and wait[str(n)] == pytest.approx(t - min(c, t), rel=1e-12, abs=1e-15)
    # the switch's rates: the clipped line through the recorded per-message times
    sw = method["switch_fit"]
    assert all(t >= 0 for t in sw["message_s"]) and len(sw["packets"]) == len(sw["message_s"]) >= 2
    slope, intercept = np.polyfit(np.array(sw["packets"], dtype=np.float64), np.array(sw["message_s"]), 1)
    assert host["switch_message_s"]["value"] == pytest.approx(max(0.0, intercept), rel=1e-9, abs=1e-15)
    assert host["switch_packet_s"]["value"] == pytest.approx(max(0.0, slope), rel=1e-9, abs=1e-15)
    # the sparse switch's rates: the non-negative fit of the recorded per-message times over the packets, value
    # packets and results of each message (worker 0's burst completes nothing, worker 1's every slot)
    ss = method["sparse_switch_fit"]
    assert all(t > 0 for t in ss["message_s"]) and len(ss["message_s"]) == len(ss["packets"]) >= 8
    assert {r == 0 for r in ss["results"]} == {True, False} and {v == 0 for v in ss["values"]} == {True, False}
    counts = np.column_stack([ss["packets"], ss["values"], ss["results"]]).astype(np.float64)
    c, packet, value, result = fit_nonnegative(counts, np.array(ss["message_s"]))
    assert ss["intercept_s"] == pytest.approx(c, rel=1e-9, abs=1e-15)
    assert host["sparse_switch_message_s"]["value"] == pytest.approx(max(0.0, c), rel=1e-9, abs=1e-15)
    for name, v in (("packet", packet), ("value", value), ("result", result)):
        assert host[f"sparse_switch_{name}_s"]["value"] == pytest.approx(v, rel=1e-9, abs=1e-15)
    # the time grows with the packets: some per-packet rate is positive
    assert host["sparse_switch_packet_s"]["value"] + host["sparse_switch_result_s"]["value"] > 0
    # a fresh buffer's rate and threshold: the step of the recorded sweep (fresh fills against mapped ones)
    from sparsecomm.netbed.calibrate import FRESH_SIZES, fresh_step
    ff = method["fresh_fit"]
    assert ff["sizes"] == list(FRESH_SIZES[True]) and len(ff["fresh_s"]) == len(ff["mapped_s"]) == len(ff["sizes"])
    assert all(t > 0 for t in ff["fresh_s"] + ff["mapped_s"])
    assert (host["fresh_byte_s"]["value"], host["fresh_min_bytes"]["value"]) == fresh_step(
        ff["sizes"], ff["fresh_s"], ff["mapped_s"], ff["step"])
    # an advised one's: its fills beyond the mapped ones, from the threshold on
    from sparsecomm.netbed.calibrate import advised_rate
    assert len(ff["advised_s"]) == len(ff["sizes"]) and all(t > 0 for t in ff["advised_s"])
    assert host["fresh_advised_byte_s"]["value"] == advised_rate(
        ff["sizes"], ff["advised_s"], ff["mapped_s"], host["fresh_min_bytes"]["value"])
    # OmniReduce's per-block rates: the non-negative fit of measured less modelled over the blocks charged
    bf = method["block_fit"]
    assert all(t > 0 for t in bf["measured_s"]) and all(t > 0 for t in bf["modelled_s"])
    counts = np.column_stack([bf["span_blocks"], bf["index_blocks"]])
    c, span, index = fit_nonnegative(counts, np.array(bf["measured_s"]) - np.array(bf["modelled_s"]))
    assert bf["intercept_s"] == pytest.approx(c, rel=1e-9, abs=1e-15)
    assert host["span_block_s"]["value"] == pytest.approx(span, rel=1e-9, abs=1e-15)
    assert host["index_block_s"]["value"] == pytest.approx(index, rel=1e-9, abs=1e-15)
    # gloo's own messages: the non-negative fit of dist.all_reduce's measured calls less the modelled ones (gloo's ring,
    # native rates 0) over the messages and bytes each charges (modelled again at a probe)
    from sparsecomm.netbed.calibrate import NATIVE_POINTS
    nf = method["native_fit"]
    assert nf["points"] == list(NATIVE_POINTS[True]) and len(nf["launches_s"]) == method["launches"]
    assert all(t > 0 for t in nf["measured_s"] + nf["modelled_s"])
    assert all(k > 0 for k in nf["messages"]) and nf["bytes"] == sorted(nf["bytes"]) and nf["bytes"][0] > 0
    c, message, byte = fit_nonnegative(np.column_stack([nf["messages"], nf["bytes"]]),
                                       np.array(nf["measured_s"]) - np.array(nf["modelled_s"]))
    assert nf["intercept_s"] == pytest.approx(c, rel=1e-9, abs=1e-15)
    assert host["native_message_s"]["value"] == pytest.approx(message, rel=1e-9, abs=1e-15)
    assert host["native_byte_s"]["value"] == pytest.approx(byte, rel=1e-9, abs=1e-15)
    # the sparse switch's workers' rate: the non-negative fit of measured less modelled over the results charged
    rf = method["sparse_switch_round_fit"]
    assert all(t > 0 for t in rf["measured_s"]) and all(t > 0 for t in rf["modelled_s"])
    assert rf["results"] == sorted(rf["results"]) and rf["results"][0] > 0       # (more packets, more results)
    c, rate = fit_nonnegative(np.array(rf["results"])[:, None], np.array(rf["measured_s"]) - np.array(rf["modelled_s"]))
    assert rf["intercept_s"] == pytest.approx(c, rel=1e-9, abs=1e-15)
    assert host["sparse_switch_round_s"]["value"] == pytest.approx(rate, rel=1e-9, abs=1e-15)
    # the netbed's latency, where this process may build a netbed: its probe less the same probe on loopback
    from sparsecomm.errors import NetbedError
    from sparsecomm.netbed.topology import check_privileges
    try:
        check_privileges()
        root = True
    except NetbedError:
        root = False
    assert ("netbed" in profile) == root == ("netbed_fit" in method)
    if root:
        nf, nb = method["netbed_fit"], profile["netbed"]
        assert len(nf["netbed_s"]) == len(nf["loopback_s"]) >= 1 and min(nf["netbed_s"] + nf["loopback_s"]) > 0
        import statistics
        assert nb["latency_s"]["value"] == max(0.0, statistics.median(nf["netbed_s"]) -
                                               statistics.median(nf["loopback_s"]))
        assert (nb["gbps"], nb["hosts"]) == (1.0, 2) and netbed_latency_s(out) == nb["latency_s"]["value"]
    # each call's cost is the measured call less the modelled one (at least 0), both recorded (OmniReduce's
    # left-over is a few ms once its block moves, check and zero scan are modelled: within a busy machine's
    # noise, so it may be fitted at 0 as any other)
    calls, call_fit = host["call_s"]["value"], method["call_fit"]
    assert set(call_fit) == set(calls)
    import statistics

    from sparsecomm.netbed.calibrate import LAUNCHES, PEER_LAUNCHES
    assert (method["launches"], method["peer_launches"]) == (LAUNCHES[True], PEER_LAUNCHES[True])
    for name, v in calls.items():
        each = call_fit[name]["launches_s"]        # (the measured call: the median of each launch's)
        assert len(each) == LAUNCHES[True] and call_fit[name]["measured_s"] == statistics.median(each)
        assert v == max(0.0, call_fit[name]["measured_s"] - call_fit[name]["modelled_s"]) / call_fit[name]["share"]
        assert call_fit[name]["measured_s"] > 0 and call_fit[name]["modelled_s"] > 0
    # the kernels' slowdown with every core busy: per operation, the median at once over the median alone, >= 1
    from sparsecomm.netbed.calibrate import CONTENDED_OPS
    cf = method["contention_fit"]
    assert cf["cores"] == os.cpu_count()
    if os.cpu_count() >= 2:
        import statistics
        factors = host["codec_contention"]["value"]
        assert set(factors) == set(CONTENDED_OPS) and all(v >= 1.0 for v in factors.values())
        for op in CONTENDED_OPS:
            alone, together = cf[op]["alone_s"], cf[op]["together_s"]
            assert len(alone) == len(together) >= 2 and min(alone + together) > 0
            assert factors[op] == max(1.0, statistics.median(together) / statistics.median(alone))
    # a call's cost per other worker: the CPU time's growth from 2 to PEER_WORKERS workers beyond the model's, per
    # added worker (at least 0), both sizes recorded
    peers, peer_fit = host["call_peer_s"]["value"], method["call_peer_fit"]
    assert set(peer_fit) == set(peers) and method["call_peer_workers"] == PEER_WORKERS
    for name, v in peers.items():
        fit = peer_fit[name]
        assert set(fit) == {"2", str(PEER_WORKERS)}
        assert all(f["measured_cpu_s"] > 0 and f["modelled_s"] > 0 for f in fit.values())
        # (each size's residual first, as the fit takes them: the same rounding)
        residual = {k: f["measured_cpu_s"] - f["modelled_s"] for k, f in fit.items()}
        assert v == max(0.0, (residual[str(PEER_WORKERS)] - residual["2"]) / (PEER_WORKERS - 2))
    # the wait for a call's last worker on shared cores: the measured loop of work and call beyond the modelled
    # one, per unit of share above 1 (at least 0); none measured on enough cores
    _check_sync(host["sync_s"]["value"], method["sync_fit"], host.get("sync_work_s"))
    # the rates fitted with PEER_WORKERS processes where they outnumber the cores: what their measurements say
    _check_shared(profile.get("by_share"), method["shared_fit"])
    loaded = sc.Network.from_profile(out).host
    assert all(getattr(loaded, name) == host[name]["value"] for name in RATE_UNITS
               if name in host and not isinstance(host[name]["value"], dict)), loaded
    assert dict(loaded.codec_contention) == host.get("codec_contention", {}).get("value", {})


def test_span_and_index_blocks_are_charged_at_their_rates_by_hand():
    host = HostModel(span_block_s=2e-7, index_block_s=3e-6, cpu_share=2.0)
    t = sc.launch(lambda ctx: (ctx.fabric.host_work("span", 1000), ctx.fabric.host_work("index", 30 + ctx.rank),
                               ctx.fabric.now())[2], 2, network=sc.Network(host=host))
    assert t == pytest.approx([2.0 * (1000 * 2e-7 + 30 * 3e-6), 2.0 * (1000 * 2e-7 + 31 * 3e-6)], rel=1e-12, abs=0)
    assert HostModel(span_block_s=1.0).work_s("span", 7) == 7.0
    assert HostModel(index_block_s=1.0).work_s("index", 4) == 4.0
    with pytest.raises(InvalidValueError, match="span_block_s"):
        HostModel(span_block_s=-1.0)


#: 8 blocks of 4 float32, 2 workers, one channel per aggregator: aggregator 0 (hosted by worker 0) sums blocks
#: 0-3, aggregator 1 (worker 1) blocks 4-7, one block per lane (one round)
BS, NZ = 4, {0: (0, 2, 4, 6), 1: (0, 1, 5, 7)}


def _omni_blocks(ctx) -> None:
    x = torch.zeros(8 * BS)
    for b in NZ[ctx.rank]:
        x[b * BS: (b + 1) * BS] = 1.0 + b
    y = sc.transports.get("omnireduce", ctx.fabric, block_size=BS, channels=1).allreduce(x)
    want = torch.zeros(8 * BS)
    for r in NZ:
        for b in NZ[r]:
            want[b * BS: (b + 1) * BS] += 1.0 + b
    assert torch.equal(y, want)


def test_omnireduce_charges_its_span_and_the_blocks_it_moves_by_index_by_hand(monkeypatch):
    from sparsecomm.fabric.sim.sim import SimFabric

    seen, real = [], SimFabric.host_work

    def record(self, op, count, dtype=None, *, transport=None):
        if op in ("span", "index") and count:
            seen.append((self.rank, op, count))
        return real(self, op, count, dtype, transport=transport)

    monkeypatch.setattr(SimFabric, "host_work", record)
    sc.launch(_omni_blocks, 2, network=sc.Network(host=HostModel()))
    total = {(r, op): sum(c for rr, o, c in seen if (rr, o) == (r, op)) for r in (0, 1) for op in ("span", "index")}
    # span: every worker scans both aggregators' ranges, 4 blocks each
    assert total[0, "span"] == total[1, "span"] == 8
    # index, worker 0: its blocks 0, 2 (to its own aggregator, by hand) and 4, 6 (to aggregator 1) are no run:
    # gathered, 2 + 2; its aggregator adds worker 1's blocks 0, 1 and its own 0, 2 at scattered rows of the 3
    # summed (0, 1, 2): 2 + 2. Worker 1: blocks 0, 1 are a run (sent as a view); 5, 7 gathered: 2; its
    # aggregator adds 4, 6 and 5, 7 at scattered rows of the 4 summed: 2 + 2. Every sum lands as a run (0-2, 4-7)
    assert (total[0, "index"], total[1, "index"]) == (8, 6)


def test_omnireduce_charges_its_zero_blocks_block_copies_and_check_by_hand(monkeypatch):
    from sparsecomm.fabric.sim.sim import SimFabric

    ops = ("scan", "scan_zero", "move", "check")
    seen, real = [], SimFabric.host_work

    def record(self, op, count, dtype=None, *, transport=None):
        if op in ops:
            seen.append((self.rank, op, count))
        return real(self, op, count, dtype, transport=transport)

    monkeypatch.setattr(SimFabric, "host_work", record)
    sc.launch(_omni_blocks, 2, network=sc.Network(host=HostModel()))
    total = {(r, op): sum(c for rr, o, c in seen if (rr, o) == (r, op)) for r in (0, 1) for op in ops}
    # every worker scans both ranges, 8 blocks of 4; 4 of its blocks are zero (worker 0: 1, 3, 5, 7; 1: 2, 3, 4, 6)
    assert [total[r, "scan"] for r in (0, 1)] == [32, 32]
    assert [total[r, "scan_zero"] for r in (0, 1)] == [16, 16]
    # moved (16 bytes a block): worker 0 gathers its blocks 0, 2 (for its own aggregator) and 4, 6 (aggregator 1):
    # 4 blocks; it writes the 3 sums of its own aggregator (0-2) into its result; aggregator 1's sums of all 4
    # blocks of its channel are received straight into the result (not moved): 7 blocks. Worker 1: its blocks
    # 0, 1 go as a view, 5, 7 gathered; it writes aggregator 0's 3 sums (they ride with the lane words) and its
    # own aggregator's 4: 9 blocks
    assert [total[r, "move"] for r in (0, 1)] == [7 * 16, 9 * 16]
    # the union is 7 of the 8 blocks: the guard reads the whole result (32 elements) on each worker
    assert [total[r, "check"] for r in (0, 1)] == [32, 32]


def test_the_new_rates_charge_at_their_rates_and_a_profile_without_them_models_the_times_it_modelled(tmp_path):
    """``scan_zero_element_s``, ``move_byte_s`` and ``check_element_s``: charged per unit, stretched by the CPU
    share; a version-2 profile written before they existed loads with them 0 and models an OmniReduce and a
    ring call to the bit as before."""
    host = HostModel(scan_zero_element_s=2e-9, move_byte_s=3e-10, check_element_s=5e-10, cpu_share=2.0)
    t = sc.launch(lambda ctx: (ctx.fabric.host_work("scan_zero", 1000), ctx.fabric.host_work("move", 4000),
                               ctx.fabric.host_work("check", 100 * (ctx.rank + 1)), ctx.fabric.now())[3], 2,
                  network=sc.Network(host=host))
    assert t == pytest.approx([2.0 * (1000 * 2e-9 + 4000 * 3e-10 + k * 100 * 5e-10) for k in (1, 2)], rel=1e-12)
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    runs = (_omni_sparse, functools.partial(_ring_call, numel=1000, inplace=False))
    base = [sc.launch(run, 2, network=net(host=FULL)) for run in runs]
    new = ("scan_zero_element_s", "move_byte_s", "check_element_s")
    old = _profile(FULL)
    assert all(old["host"][name]["value"] == 0.0 for name in new)
    for name in new:
        del old["host"][name]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL
    for run, b in zip(runs, base):
        assert [x.hex() for x in sc.launch(run, 2, network=loaded)] == [x.hex() for x in b]
    rated = dataclasses.replace(FULL, **dict(zip(new, (1e-9, 2e-10, 3e-10))))
    path.write_text(json.dumps(_profile(rated)))
    assert sc.Network.from_profile(path).host == rated
    for run, b in zip(runs, base):
        assert max(sc.launch(run, 2, network=net(host=rated))) > max(b)


def _omni_sparse(ctx) -> float:
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(ctx.rank))
    x.view(-1, 256)[torch.randperm(64, generator=torch.Generator().manual_seed(10 + ctx.rank))[:48]] = 0
    t = sc.transports.get("omnireduce", ctx.fabric)
    t.allreduce(x)
    return t.last_stats.modelled_time_s


def test_zero_block_rates_and_a_profile_without_them_change_no_modelled_time(tmp_path):
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_omni_sparse, 2, network=net(host=FULL))
    zero = sc.launch(_omni_sparse, 2, network=net(host=dataclasses.replace(FULL, span_block_s=0.0, index_block_s=0.0)))
    assert [t.hex() for t in zero] == [t.hex() for t in base]
    # a version-2 profile written before these rates existed: they are 0, the times it modelled then
    old = _profile(FULL)
    for name in ("span_block_s", "index_block_s"):
        del old["host"][name]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL
    assert [t.hex() for t in sc.launch(_omni_sparse, 2, network=loaded)] == [t.hex() for t in base]
    # and charged, they lengthen the call
    for rate in ("span_block_s", "index_block_s"):
        more = sc.launch(_omni_sparse, 2, network=net(host=dataclasses.replace(FULL, **{rate: 1e-5})))
        assert max(more) > max(base)


def _powersgd_step(ctx) -> float:
    from sparsecomm.pipeline.core import CommPipeline

    pipe = CommPipeline(method="powersgd", transport="ring", fabric=ctx.fabric, matrix_approximation_rank=1)
    pipe.begin_step()
    pipe.reduce(torch.randn(54, generator=torch.Generator().manual_seed(ctx.rank)), "b",
                shapes=[torch.Size([8, 6]), torch.Size([6])])
    return ctx.fabric.now()


def test_a_profile_without_the_codec_rates_loads_and_models_the_times_it_modelled(tmp_path):
    """A version-2 profile written before a method's encode/decode rates existed (CODEC_RATES) loads with them
    0 (``matmul_outer_mac_s``: None, its fallback's) and models a compressed step to the bit as before; one with
    them round-trips them."""
    from sparsecomm.fabric.sim.sim_host import CODEC_RATES, FALLBACK_RATES

    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_powersgd_step, 2, network=net(host=FULL))
    old = _profile(FULL)
    for name in CODEC_RATES.values():
        old["host"].pop(name, None)      # (matmul_outer_mac_s, None in FULL: not written)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL and all(getattr(loaded.host, r) == (None if r in FALLBACK_RATES else 0.0)
                                       for r in CODEC_RATES.values())
    assert [t.hex() for t in sc.launch(_powersgd_step, 2, network=loaded)] == [t.hex() for t in base]
    rates = {r: 1e-9 * (i + 1) for i, r in enumerate(CODEC_RATES.values())}
    path.write_text(json.dumps(_profile(dataclasses.replace(FULL, **rates))))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert {r: getattr(loaded.host, r) for r in rates} == rates
    assert min(sc.launch(_powersgd_step, 2, network=loaded)) > max(base)
    with pytest.raises(InvalidValueError, match="matmul_mac_s"):
        bad = _profile(FULL)
        bad["host"]["matmul_mac_s"]["value"] = -1.0
        path.write_text(json.dumps(bad))
        sc.Network.from_profile(path)


def test_matmul_outer_charges_its_own_rate_or_without_it_matmul_mac_s(tmp_path):
    """By hand: 10 multiply-adds of PowerSGD's estimate ``P Q^T`` cost 10 x ``matmul_outer_mac_s`` (3 ns: 30 ns);
    without the rate (``None``, a profile written before it existed) 10 x ``matmul_mac_s`` (2 ns: 20 ns), the
    charge the decode's product had before; the profile leaves a ``None`` out and round-trips a rate."""
    old = HostModel(matmul_mac_s=2e-9)
    assert old.matmul_outer_mac_s is None
    assert old.work_s("matmul_outer", 10) == 10 * 2e-9 and old.work_s("matmul", 10) == 10 * 2e-9
    new = dataclasses.replace(old, matmul_outer_mac_s=3e-9)
    assert new.work_s("matmul_outer", 10) == 10 * 3e-9 and new.work_s("matmul", 10) == 10 * 2e-9
    assert "matmul_outer_mac_s" not in _profile(old)["host"]
    path = tmp_path / "host.json"
    for host in (old, new):
        path.write_text(json.dumps(_profile(host)))
        assert sc.Network.from_profile(path).host == host
    with pytest.raises(InvalidValueError, match="matmul_outer_mac_s"):
        HostModel(matmul_outer_mac_s=-1.0)


def test_collect_charges_its_own_rate_or_without_it_the_elementwise_pass_contended(tmp_path):
    """By hand: 10 elements of the sampled top-k's candidate pass cost 10 x ``collect_element_s`` (3 ns: 30 ns),
    times its own ``codec_contention`` factor where it has one (2: 60 ns); without the rate (``None``, a profile
    written before it existed) the elementwise pass's whole charge, its rate times its factor (1 ns x 1.5: 15 ns),
    as the pass was counted before; the profile leaves a ``None`` out and round-trips a rate; a negative rate is
    refused naming it."""
    old = HostModel(elementwise_element_s=1e-9, codec_contention={"elementwise": 1.5})
    assert old.collect_element_s is None
    assert old.work_s("collect", 10) == old.work_s("elementwise", 10) == pytest.approx(15e-9, rel=1e-15)
    new = dataclasses.replace(old, collect_element_s=3e-9)
    assert new.work_s("collect", 10) == pytest.approx(30e-9, rel=1e-15)
    both = dataclasses.replace(new, codec_contention={"elementwise": 1.5, "collect": 2.0})
    assert both.work_s("collect", 10) == pytest.approx(60e-9, rel=1e-15)
    assert "collect_element_s" not in _profile(old)["host"]
    path = tmp_path / "host.json"
    for host in (old, new, both):
        path.write_text(json.dumps(_profile(host)))
        assert sc.Network.from_profile(path).host == host
    with pytest.raises(InvalidValueError, match="collect_element_s"):
        HostModel(collect_element_s=-1.0)
    with pytest.raises(InvalidValueError, match="count must be >= 0"):
        old.work_s("collect", -1)


def test_powersgd_decode_is_charged_the_outer_rate_and_an_old_profile_the_time_it_modelled(tmp_path):
    """PowerSGD's step with ``matmul_outer_mac_s`` unset (a profile before it) models the same bits as with it set
    to ``matmul_mac_s``; set higher, the step grows (the decode's product is charged it)."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    rates = dataclasses.replace(FULL, matmul_mac_s=1e-9, elementwise_element_s=1e-9)
    base = sc.launch(_powersgd_step, 2, network=net(host=rates))
    same = sc.launch(_powersgd_step, 2, network=net(host=dataclasses.replace(rates, matmul_outer_mac_s=1e-9)))
    assert [t.hex() for t in same] == [t.hex() for t in base]
    more = sc.launch(_powersgd_step, 2, network=net(host=dataclasses.replace(rates, matmul_outer_mac_s=5e-9)))
    assert min(more) > max(base)


def test_codec_contention_multiplies_the_rates_it_names_by_hand():
    """By hand: 10 multiply-adds of ``M^T P`` at 2 ns with ``codec_contention`` 1.5 for ``matmul_t`` cost 30 ns;
    the operations it does not name are charged their rates alone (an elementwise pass of 10 at 1 ns: 10 ns), and
    ``matmul_outer`` without its own rate takes ``matmul_mac_s`` times its own factor; the factors are checked
    (operations of CODEC_RATES, each at least 1)."""
    host = HostModel(matmul_mac_s=4e-9, matmul_t_mac_s=2e-9, elementwise_element_s=1e-9,
                     codec_contention={"matmul_t": 1.5, "matmul_outer": 3.0})
    assert host.work_s("matmul_t", 10) == pytest.approx(30e-9, rel=1e-15)
    assert host.work_s("elementwise", 10) == 10 * 1e-9 and host.work_s("matmul", 10) == 10 * 4e-9
    assert host.work_s("matmul_outer", 10) == pytest.approx(120e-9, rel=1e-15)
    assert dataclasses.replace(host, codec_contention={}).work_s("matmul_t", 10) == 10 * 2e-9
    assert hash(host) != hash(dataclasses.replace(host, codec_contention={"matmul_t": 2.0}))
    with pytest.raises(InvalidValueError, match="codec_contention has key 'sum'"):
        HostModel(codec_contention={"sum": 2.0})
    with pytest.raises(InvalidValueError, match="codec_contention"):
        HostModel(codec_contention={"matmul": 0.5})
    with pytest.raises(InvalidTypeError, match="codec_contention must map"):
        HostModel(codec_contention=2.0)


def test_a_powersgd_step_is_charged_its_products_contended_by_hand():
    """By hand: PowerSGD (rank 1) on 2 workers over an 8 x 6 matrix and a 6-vector runs ``M^T P`` once per step,
    8 * 6 = 48 multiply-adds, on every worker's path between the two rounds: with ``matmul_t_mac_s`` at 1 us, a
    ``codec_contention`` of 2.5 for it makes every worker's step 1.5 * 48 us longer, and none (or one naming
    only an operation the step does not run) changes no bit."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    rates = dataclasses.replace(FULL, matmul_t_mac_s=1e-6)
    base = sc.launch(_powersgd_step, 2, network=net(host=rates))
    more = sc.launch(_powersgd_step, 2, network=net(host=dataclasses.replace(rates, codec_contention={"matmul_t": 2.5})))
    for b, m in zip(base, more):
        assert m - b == pytest.approx(1.5 * 48 * 1e-6, rel=1e-9, abs=0)
    same = sc.launch(_powersgd_step, 2, network=net(host=dataclasses.replace(rates, codec_contention={"select": 4.0})))
    assert [t.hex() for t in same] == [t.hex() for t in base]


def test_a_profile_without_codec_contention_models_the_times_it_modelled_and_one_with_it_round_trips(tmp_path):
    """A profile written before ``codec_contention`` existed (or on one core: none measured, left out) loads with
    none and models a compressed step to the bit as before; one with it round-trips it; a factor below 1 or an
    unknown operation in it is refused, naming the key."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    rates = dataclasses.replace(FULL, matmul_mac_s=1e-9, matmul_t_mac_s=2e-9, elementwise_element_s=1e-9)
    base = sc.launch(_powersgd_step, 2, network=net(host=rates))
    old = _profile(rates)
    assert "codec_contention" not in old["host"]
    path = tmp_path / "host.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == rates and not loaded.host.codec_contention
    assert [t.hex() for t in sc.launch(_powersgd_step, 2, network=loaded)] == [t.hex() for t in base]
    contended = dataclasses.replace(rates, codec_contention={"matmul_t": 1.8, "elementwise": 1.25})
    new = _profile(contended)
    assert new["host"]["codec_contention"] == {"value": {"matmul_t": 1.8, "elementwise": 1.25}, "unit": "factor"}
    path.write_text(json.dumps(new))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == contended
    assert min(sc.launch(_powersgd_step, 2, network=loaded)) > max(base)
    for value, match in (({"matmul_t": 0.9}, "codec_contention"), ({"scan": 2.0}, "codec_contention has key"),
                         ({"matmul_t": -1.0}, r"codec_contention.value\['matmul_t'\]")):
        bad = _profile(contended)
        bad["host"]["codec_contention"]["value"] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(InvalidValueError, match=match):
            sc.Network.from_profile(path)


def _allgather_sparse(ctx) -> float:
    p = sc.compressors.get("topk", k=3 + ctx.rank).compress(torch.randn(100, generator=torch.Generator().manual_seed(ctx.rank)))
    sc.transports.get("allgather", ctx.fabric).allreduce(p)
    return ctx.fabric.now()


def test_allgather_charges_its_sum_as_elementwise_passes():
    """By hand: the sum of 2 workers' top-k payloads (3 and 4 values) of 100 elements zeroes and checks the result
    (200) and adds the 7 values, on each worker; nothing else of the call is elementwise."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_allgather_sparse, 2, network=net(host=FULL))
    more = sc.launch(_allgather_sparse, 2, network=net(host=dataclasses.replace(FULL, elementwise_element_s=1e-6)))
    for b, m in zip(base, more):
        assert m - b == pytest.approx(207 * 1e-6, rel=1e-9, abs=0)


def _ring_call(ctx, numel: int, inplace: bool) -> float:
    x = torch.full((numel,), float(ctx.rank + 1))
    t = sc.transports.get("ring", ctx.fabric, inplace=inplace)
    y = t.allreduce(x)
    assert torch.equal(y, torch.full_like(y, 3.0)) and (y.data_ptr() == x.data_ptr()) == inplace
    return t.last_stats.modelled_time_s


def test_a_ring_that_does_not_sum_in_place_charges_its_copy_and_fresh_buffer_by_hand():
    """By hand: a ring of 2 workers over 1000 float32 copies the caller's 4000 bytes into a buffer allocated for
    the call when it does not sum in place: ``copy`` of 4000 bytes on each worker (stretched by its CPU
    share), and ``fresh`` of them from ``fresh_min_bytes`` on; in place, neither."""
    numel, nbytes = 1000, 4000
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)

    def times(host: HostModel, inplace: bool) -> list[float]:
        return sc.launch(functools.partial(_ring_call, numel=numel, inplace=inplace), 2, network=net(host=host))

    base = times(HostModel(), False)
    assert [t.hex() for t in times(HostModel(), True)] == [t.hex() for t in base]   # (a zero rate: no time)
    copy = HostModel(copy_byte_s=3e-9, cpu_share=2.0)
    assert [t.hex() for t in times(copy, True)] == [t.hex() for t in base]          # in place: no copy
    # each worker's copy (stretched by its share) delays the ring's every step alike: the call ends later by it
    assert times(copy, False) == pytest.approx([b + nbytes * 3e-9 * 2.0 for b in base], rel=1e-12, abs=0)
    assert times(dataclasses.replace(copy, cpu_share=1.0), False) == pytest.approx(
        [b + nbytes * 3e-9 for b in base], rel=1e-12, abs=0)
    # fresh: charged from the threshold on, at the threshold too
    for threshold, charged in ((0, True), (nbytes, True), (nbytes + 1, False)):
        fresh = HostModel(fresh_byte_s=5e-9, fresh_min_bytes=threshold)
        want = [b + (nbytes * 5e-9 if charged else 0.0) for b in base]
        assert times(fresh, False) == pytest.approx(want, rel=1e-12, abs=0), threshold
        assert [t.hex() for t in times(fresh, True)] == [t.hex() for t in base]
    assert HostModel(fresh_byte_s=1.0, fresh_min_bytes=10).work_s("fresh", 9) == 0.0
    assert HostModel(fresh_byte_s=1.0, fresh_min_bytes=10).work_s("fresh", 10) == 10.0


def test_allgather_charges_its_result_as_a_fresh_buffer():
    """By hand: the sum of 2 workers' top-k payloads of 100 float32 allocates its 400-byte result, on each worker."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_allgather_sparse, 2, network=net(host=FULL))
    for threshold, extra in ((400, 400 * 1e-6), (401, 0.0)):
        more = sc.launch(_allgather_sparse, 2, network=net(
            host=dataclasses.replace(FULL, fresh_byte_s=1e-6, fresh_min_bytes=threshold)))
        assert more == pytest.approx([b + extra for b in base], rel=1e-9, abs=0)


def _touches(ctx) -> list[float]:
    f, out = ctx.fabric, []
    f.host_work("fresh_later", 99)              # below fresh_min_bytes: not fresh, not held
    f.host_work("fresh_touch", 50)
    out.append(f.now())
    f.host_work("fresh_later", 1000)
    for n in (300, 900, 10):                    # 300 of the 1000 held, the other 700, then none left
        f.host_work("fresh_touch", n)
        out.append(f.now())
    return out


def test_a_fresh_buffer_touched_piecewise_is_charged_as_its_parts_are_written_by_hand():
    host = HostModel(fresh_byte_s=1e-6, fresh_min_bytes=100)
    for times in sc.launch(_touches, 2, network=sc.Network(host=host)):
        assert times == pytest.approx([0.0, 300e-6, 1000e-6, 1000e-6], rel=1e-12, abs=0)
    with pytest.raises(InvalidValueError, match="count must be >= 0"):
        sc.launch(lambda ctx: ctx.fabric.host_work("fresh_later", -1), 1, network=sc.Network(host=host))


def _switch_result(ctx) -> tuple[float, float]:
    """A 2-worker switch call of 64 KiB float32 that does not sum in place (a fresh result): its modelled time
    and the bytes the worker sent."""
    x = torch.full((1 << 14,), float(ctx.rank + 1))
    t = sc.transports.get("switch", ctx.fabric)
    y = t.allreduce(x)
    assert torch.equal(y, torch.full_like(x, 3.0))
    return t.last_stats.modelled_time_s, ctx.fabric.stats.bytes_sent


def test_the_switch_charges_its_fresh_result_as_its_chunks_are_decoded_not_at_once():
    """The whole result's pages are charged, once (the same total as a charge at its allocation), but after the
    results arrive: the call lengthens by less than the whole charge where the link hides part of it."""
    F = 1e-6                                    # 64 KiB: 65.5 ms of fresh pages at 1 us a byte
    net = functools.partial(sc.Network, bandwidth_gbps=0.01, latency_us=5.0)     # a slow link: 52 ms each way
    base = max(t for t, _ in sc.launch(_switch_result, 2, network=net(host=HostModel(**PER_MSG))))
    timed = max(t for t, _ in sc.launch(_switch_result, 2, network=net(host=HostModel(**PER_MSG, fresh_byte_s=F))))
    whole = (1 << 16) * F
    assert 0 < timed - base < 0.8 * whole      # (about 0.6: the first chunks' pages while later results travel)
    # without the link to hide it, the whole charge (the last chunk's, at least, is after the last result)
    net = functools.partial(sc.Network, bandwidth_gbps=1e4, latency_us=0.0)
    base = max(t for t, _ in sc.launch(_switch_result, 2, network=net(host=HostModel(**PER_MSG))))
    timed = max(t for t, _ in sc.launch(_switch_result, 2, network=net(host=HostModel(**PER_MSG, fresh_byte_s=F))))
    assert timed - base == pytest.approx(whole, rel=1e-3)


def _switch_mib(ctx) -> float:
    """A 2-worker switch call of 4 MiB float32 with a fresh result: its modelled time."""
    t = sc.transports.get("switch", ctx.fabric)
    y = t.allreduce(torch.ones(1 << 20))
    assert torch.equal(y, torch.full_like(y, 2.0))
    return t.last_stats.modelled_time_s


def test_the_switch_on_a_host_with_a_cost_per_message_sends_asynchronously():
    """As over gloo, a worker's send returns once its message is queued: it decodes the results that have arrived
    (here: writing the fresh result's pages) while its next bursts are on the wire, instead of waiting for each
    send's last byte (about 0.97 of the whole charge added when each send was waited for)."""
    F = 16e-9                                   # 4 MiB of fresh pages: 67 ms, against ~33 ms of wire each way
    net = functools.partial(sc.Network, bandwidth_gbps=1.0, latency_us=5.0)
    base = max(sc.launch(_switch_mib, 2, network=net(host=HostModel(**PER_MSG))))
    timed = max(sc.launch(_switch_mib, 2, network=net(host=HostModel(**PER_MSG, fresh_byte_s=F, fresh_min_bytes=0))))
    whole = (4 << 20) * F
    assert 0.3 * whole < timed - base < 0.75 * whole      # (about 0.53)


def test_omnireduce_charges_no_fresh_buffer():
    """OmniReduce keeps its result buffers from call to call (blocks.ResultCache): no fresh charge."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(_omni_sparse, 2, network=net(host=FULL))
    fresh = sc.launch(_omni_sparse, 2, network=net(host=dataclasses.replace(FULL, fresh_byte_s=1e-6)))
    assert [t.hex() for t in fresh] == [t.hex() for t in base]


CLEAR_ELEMS = 1 << 18       # > 2^16: a cached result (blocks.ResultCache); 1024 blocks of 256


def _omni_after(ctx, first: float) -> tuple[float, int]:
    """A call at density ``first`` then one at 5% on the same OmniReduce transport: the second's modelled time and
    how many blocks its cached result clears (written by the first and not by it)."""
    torch.manual_seed(ctx.rank)
    b = torch.arange(CLEAR_ELEMS // 256).repeat_interleave(256)
    t = sc.transports.get("omnireduce", ctx.fabric)
    t.allreduce(torch.where(b % round(1 / first) == 0, 1.0, 0.0))
    held = ((b % 20 == 0) if ctx.rank == 0 else (b % 20 == 1)).float()
    t.allreduce(held)
    union = {i for i in range(CLEAR_ELEMS // 256) if i % 20 in (0, 1)}
    return t.last_stats.modelled_time_s, len(set(range(0, CLEAR_ELEMS // 256, round(1 / first))) - union)


def test_omnireduce_charges_the_blocks_its_cached_result_clears_by_hand():
    """A cached result zeroes, after the call, the blocks the call before wrote and this one did not (by index: the
    rows' ``"index"`` and their bytes' ``"move"``); a call after one of the same blocks clears none."""
    S, B = 1e-4, 1e-8
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    for rates in (dict(index_block_s=S), dict(move_byte_s=B)):
        base_dense = sc.launch(functools.partial(_omni_after, first=1.0), 2, network=net(host=HostModel(**PER_MSG)))
        dense = sc.launch(functools.partial(_omni_after, first=1.0), 2, network=net(host=HostModel(**PER_MSG, **rates)))
        base_same = sc.launch(functools.partial(_omni_after, first=0.05), 2, network=net(host=HostModel(**PER_MSG)))
        same = sc.launch(functools.partial(_omni_after, first=0.05), 2, network=net(host=HostModel(**PER_MSG, **rates)))
        cleared = dense[0][1]
        assert cleared == 1024 - 104 and same[0][1] == 0       # (the union: 52 blocks i % 20 == 0, 52 == 1)
        # the sparse call's own charges are the same after either call; after the dense one, the clearing too
        per_block = S if "index_block_s" in rates else B * 256 * 4
        extra = (max(t for t, _ in dense) - max(t for t, _ in base_dense)) - (
            max(t for t, _ in same) - max(t for t, _ in base_same))
        assert extra == pytest.approx(cleared * per_block, rel=1e-6)


def test_a_profile_without_the_fresh_rates_loads_with_them_0_and_one_with_them_round_trips(tmp_path):
    """A version-2 profile written before ``fresh_byte_s`` and ``fresh_min_bytes`` existed loads with both 0 and
    models a ring call to the bit as before; one with them round-trips them (the threshold an int)."""
    run = functools.partial(_ring_call, numel=1000, inplace=False)
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = sc.launch(run, 2, network=net(host=FULL))
    old = _profile(FULL)
    del old["host"]["fresh_byte_s"], old["host"]["fresh_min_bytes"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL and loaded.host.fresh_byte_s == 0.0 and loaded.host.fresh_min_bytes == 0
    assert [t.hex() for t in sc.launch(run, 2, network=loaded)] == [t.hex() for t in base]
    host = dataclasses.replace(FULL, fresh_byte_s=2e-9, fresh_min_bytes=32 << 20)
    profile = _profile(host)
    assert profile["host"]["fresh_min_bytes"] == {"value": 32 << 20, "unit": "byte"}
    path.write_text(json.dumps(profile))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == host and type(loaded.host.fresh_min_bytes) is int


def test_fresh_step_finds_the_allocators_step():
    """The threshold is the smallest size from which every size swept fills markedly slower fresh; the rate the
    median of their differences per byte; no step: none."""
    from sparsecomm.netbed.calibrate import fresh_step

    mib = 1 << 20
    sizes = [8 * mib, 16 * mib, 32 * mib, 64 * mib]
    mapped = [0.001, 0.002, 0.004, 0.008]
    # a step at 32 MiB, an 8 MiB size that happened to fault (not a step: 16 MiB did not)
    fresh = [0.003, 0.002, 0.004 + 32 * mib * 2e-9, 0.008 + 64 * mib * 1e-9]
    rate, threshold = fresh_step(sizes, fresh, mapped)
    assert threshold == 32 * mib and rate == pytest.approx(1.5e-9, rel=1e-9)
    assert fresh_step(sizes, mapped, mapped) == (0.0, 0)
    assert fresh_step(sizes, [m * 1.9 for m in mapped], mapped) == (0.0, 0)      # (below the step)
    every = [m + b * 1e-9 * 3 for m, b in zip(mapped, sizes)]
    assert fresh_step(sizes, every, mapped) == (pytest.approx(3e-9), 8 * mib)


def test_codec_rates_quick_are_finite_and_positive():
    """The rates of a method's encode and decode, measured with the library's kernels (a quick run): one per
    codec operation, each a median of timed runs over a positive count, so finite and > 0."""
    from sparsecomm.fabric.sim.sim_host import CODEC_RATES
    from sparsecomm.netbed.calibrate import codec_costs

    rates = codec_costs(quick=True)
    assert set(rates) == set(CODEC_RATES.values())
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates.values()), rates
    assert HostModel(**rates).work_s("matmul_t", 10) == 10 * rates["matmul_t_mac_s"]
    assert HostModel(**rates).work_s("matmul_outer", 10) == 10 * rates["matmul_outer_mac_s"]


def test_codec_products_are_timed_as_powersgd_runs_them(monkeypatch):
    """PowerSGD's products are timed on its QR's orthonormal factors, each call on the next of MATMUL_BUFFERS
    matrices (full: beyond a 32 MiB last-level cache; a matrix timed over and over stays in the cache), the
    estimate written into the next of as many kept buffers."""
    import importlib

    from sparsecomm.netbed import calibrate as cal

    ps = importlib.import_module("sparsecomm.methods.powersgd")
    rows, cols, _ = cal.MATMUL_SHAPE[False]
    assert cal.MATMUL_BUFFERS[False] * rows * cols * 4 > 32 << 20
    seen = []
    real_fp, real_outer = ps.factor_product, ps.outer_product

    def fp(x, f, transpose=False):
        seen.append(("fp", x.data_ptr(), f))
        return real_fp(x, f, transpose)

    def outer(p, q, out):
        seen.append(("outer", out.data_ptr(), p))
        return real_outer(p, q, out)

    monkeypatch.setattr(ps, "factor_product", fp)
    monkeypatch.setattr(ps, "outer_product", outer)
    cal.codec_costs(quick=True)
    for kind in ("fp", "outer"):
        calls = [(ptr, f) for k, ptr, f in seen if k == kind]
        ptrs = [ptr for ptr, _ in calls]
        assert len(set(ptrs)) == cal.MATMUL_BUFFERS[True] and all(a != b for a, b in zip(ptrs, ptrs[1:]))
        for _, f in calls:      # (the factor as the method's QR leaves it: orthonormal columns)
            assert torch.allclose(f.T @ f, torch.eye(f.shape[1]), atol=1e-5)


def test_calibrate_times_natives_call_on_gloos_all_reduce(monkeypatch):
    """``call_s["native"]`` is timed on a call just above GATHER_SUM_BYTES, which gloo all-reduces (the path of
    the calls the model's ``native``, gloo's ring, stands for), not on one of at most that size, which
    native sums by an all_gather; the other transports on CALL_ELEMS. (The launches run on a SimFabric here:
    what is checked is the inputs the calls are timed on.)"""
    from sparsecomm.netbed import calibrate as cal
    from sparsecomm.transports.native.collectives import GATHER_SUM_BYTES

    seen, real_input, real_launch = {}, cal.call_input, sc.launch

    def call_input(name, numel, rank):
        seen.setdefault(name, set()).add(numel)
        return real_input(name, numel, rank)

    def launch(fn, n, backend=None, timeout_s=None, network=None, **kw):
        return real_launch(fn, n, network=network or sc.Network(bandwidth_gbps=1e4, latency_us=0.0), **kw)

    monkeypatch.setattr(cal, "call_input", call_input)
    monkeypatch.setattr(sc, "launch", launch)
    got = cal.call_costs(HostModel(), quick=True)
    assert set(got["call_s"]) == {name for names in CALL_GROUPS.values() for name in names}
    assert seen.pop("native") == {GATHER_SUM_BYTES // 4 + 1}
    assert seen and all(v == {cal.CALL_ELEMS} for v in seen.values())


def test_the_exchanges_send_a_just_written_message_and_receive_beyond_the_last_ones():
    """calibrate's exchanges (``message_cpu_s``, ``message_wait_s``) receive each message into a region last touched
    TURN_VECTORS * (span / size) exchanges before, the next of TURN_VECTORS buffers in turn, and send a message
    written just before: one buffer received into over and over stays in the cache, as no call's buffers do."""
    from types import SimpleNamespace

    from sparsecomm.netbed import calibrate as cal

    class Done:
        def wait(self):
            pass

    seen = []

    class Recording:
        def irecv(self, buf, src, tag):
            seen.append(("recv", buf.numel(), buf.data_ptr()))
            return Done()

        def isend(self, buf, dst, tag):
            seen.append(("send", buf.numel(), buf.data_ptr(), int(buf[0]), int(buf[-1])))
            return Done()

        def send(self, buf, dst, tag):      # (rank 1's statistics to rank 0)
            pass

    size, span, rounds = 1024, 4096, 40
    assert cal._exchanges(SimpleNamespace(fabric=Recording(), world_size=2, rank=1), (size,), rounds, span) == []
    timed = max(10, rounds // 2) + max(2, rounds // 20)     # (the warm-ups before the timed rounds)
    recv = [s for s in seen if s[0] == "recv"][timed:]
    send = [s for s in seen if s[0] == "send"][timed:]
    assert len(recv) == len(send) == rounds and {r[1] for r in recv} == {size}
    apart = cal.TURN_VECTORS * span // size                 # 3 buffers of 4 slots: 12 regions
    ptrs = [r[2] for r in recv]
    assert len(set(ptrs[:apart])) == apart                  # no region twice within the cycle
    assert all(ptrs[i] == ptrs[i + apart] for i in range(rounds - apart))
    assert [(s[3], s[4]) for s in send] == [(i & 0xFF, i & 0xFF) for i in range(rounds)]   # written for its round


def test_calibrate_takes_the_median_over_launches(monkeypatch):
    """A measurement made between processes is made in LAUNCHES launches and takes the median over them of each
    launch's statistic, every launch's recorded: one launch whose processes landed badly (here ten times slower)
    moves nothing. (The launches are injected: what is checked is what the calibration makes of them.)"""
    from sparsecomm.netbed import calibrate as cal

    monkeypatch.setitem(cal.LAUNCHES, True, 3)
    sizes = cal.MESSAGE_SIZES[True]
    line = lambda scale: [(scale * (1e-4 + n * 1e-9), scale * 5e-5) for n in sizes]  # noqa: E731
    scripted = iter([line(10.0), line(1.0), line(1.1)])    # rank 0's (exchange, cpu) per size, launch by launch
    launched = []

    def fake_exchanges(fn, n, backend=None, timeout_s=None, **kw):
        launched.append((n, backend))
        return [next(scripted), []]

    monkeypatch.setattr(sc, "launch", fake_exchanges)
    got = cal.message_costs(quick=True)
    assert launched == [(2, "gloo")] * 3
    assert got["fit"]["exchange_s"] == pytest.approx([t for t, _ in line(1.1)], rel=1e-12)
    assert got["fit"]["launches_exchange_s"] == [[t for t, _ in line(k)] for k in (10.0, 1.0, 1.1)]
    assert got["send_message_s"] == pytest.approx(1.1 * 1e-4 / 2, rel=1e-6)
    assert got["message_cpu_s"] == {n: pytest.approx(1.1 * 5e-5, rel=1e-12) for n in sizes}

    # call_s: per transport the median over launches of each launch's median call, less the modelled call, over
    # the share of the cores the model stretched the call by (and will stretch call_s by)
    monkeypatch.undo()
    monkeypatch.setitem(cal.LAUNCHES, True, 3)
    real_launch = sc.launch
    per_launch = iter([1.0, 0.01, 0.02] * len(cal.CALL_GROUPS))

    def fake_calls(fn, n, backend=None, timeout_s=None, network=None, services=None, **kw):
        if network is not None:         # (the modelled call: run as it is)
            return real_launch(fn, n, network=network, services=services, **kw)
        took = next(per_launch)
        return [{name: [took] * fn.keywords["calls"] for name in fn.keywords["names"]} for _ in range(n)]

    monkeypatch.setattr(sc, "launch", fake_calls)
    got = cal.call_costs(HostModel(), quick=True)
    for name, fit in got["call_fit"].items():
        assert fit["launches_s"] == [1.0, 0.01, 0.02] and fit["measured_s"] == 0.02
        assert got["call_s"][name] == max(0.0, 0.02 - fit["modelled_s"]) / fit["share"]
        services = next(svc for svc, names in cal.CALL_GROUPS.items() if name in names)
        assert fit["share"] == max(1.0, cal.busy_endpoints(name, 2, len(services)) / (os.cpu_count() or 1))


def _modelled_call_s(host: HostModel, name: str, calls: int) -> float:
    """The slowest rank's median call of ``name`` as the calibration times it (2 workers and the transport's
    services on this machine's cores), on the SimFabric with ``host``."""
    import statistics

    from sparsecomm.netbed import calibrate as cal

    services = next(svc for svc, names in cal.CALL_GROUPS.items() if name in names)
    share_of = host.sharing(cal.busy_endpoints(name, 2, len(services)), os.cpu_count() or 1)
    fn = functools.partial(cal._clocked_calls, names=(name,), numel=cal.CALL_ELEMS, calls=calls,
                           numel_of=cal.CALL_ELEMS_OF)
    runs = sc.launch(fn, 2, services=list(services), network=sc.Network(bandwidth_gbps=1e4, latency_us=0.0,
                                                                         host=share_of))
    return statistics.median(max(r[name][i] for r in runs) for i in range(calls))


def test_calls_into_fits_call_s_so_that_the_modelled_call_is_the_measured_one(tmp_path, capsys):
    """``calibrate --calls-into P --out Q`` fits ``call_s`` again to the calls ``P`` recorded, measuring nothing:
    each the recorded call less the call modelled with ``P``'s other rates, over the share of the cores the model
    stretches the call (and ``call_s``) by, so that the call modelled with ``Q`` is the call measured, on any
    number of cores (on two, the switch's call shares them with its switch: 1.5; the residual itself, as fitted
    before, modelled 1.5 times over); every other rate is ``P``'s."""
    from sparsecomm.netbed.calibrate import CALLS, main

    calls = CALLS[True]
    names = ("ring", "switch")
    measured = {name: {"measured_s": 0.05, "launches_s": [0.05]} for name in names}
    host = dataclasses.replace(TABLED, call_s={"ring": 1.0, "switch": 1.0, "native": 2e-4})
    profile = _profile(host)
    profile["method"] = {"call_fit": measured, "calls": calls, "pin_cores": False}
    src, out = tmp_path / "p.json", tmp_path / "q.json"
    src.write_text(json.dumps(profile))
    assert main(["--calls-into", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out}\n")
    got = json.loads(out.read_text())
    fitted = host_from_profile(got)
    assert dataclasses.replace(fitted, call_s={}) == dataclasses.replace(host, call_s={})
    assert fitted.call_s["native"] == 2e-4                  # (not recorded: kept)
    cores = os.cpu_count() or 1
    for name in names:
        fit = got["method"]["call_fit"][name]
        assert fit["share"] == max(1.0, (2 if name == "ring" else 3) / cores)
        assert fitted.call_s[name] == (0.05 - fit["modelled_s"]) / fit["share"] > 0
        assert _modelled_call_s(fitted, name, calls) == pytest.approx(0.05, rel=1e-9)
    with pytest.raises(InvalidValueError, match="records no calls"):
        profile["method"] = {}
        src.write_text(json.dumps(profile))
        main(["--calls-into", str(src), "--out", str(out)])


def test_fit_nonnegative_fits_exactly_and_drops_a_negative_rate():
    from sparsecomm.netbed.calibrate import fit_nonnegative

    x = np.array([[100.0, 10.0], [100.0, 50.0], [1000.0, 10.0], [1000.0, 80.0]])
    c = fit_nonnegative(x, 0.01 + x @ np.array([2e-7, 3e-6]))
    assert c == pytest.approx([0.01, 2e-7, 3e-6], rel=1e-9)
    # a slope that fits below zero is 0, the others fitted again without it
    y = 0.01 + x @ np.array([2e-7, -3e-6])
    c = fit_nonnegative(x, y)
    assert c[2] == 0.0 and c[1] >= 0
    a = np.column_stack([np.ones(4), x[:, 0]])
    assert c[:2] == pytest.approx(np.linalg.lstsq(a, y, rcond=None)[0], rel=1e-9)


@pytest.mark.multiprocess
def test_calibrate_fits_omnireduce_blocks_on_real_calls():
    import statistics

    from sparsecomm.netbed.calibrate import BLOCK, LAUNCHES, block_costs

    points = ((1 << 14, 0.25), (1 << 16, 0.25), (1 << 16, 0.75))
    out = block_costs(HostModel(send_message_s=1e-5, recv_message_s=1e-5), quick=True, points=points)
    assert set(out) == {"span_block_s", "index_block_s", "block_fit"}
    assert all(isinstance(out[k], float) and math.isfinite(out[k]) and out[k] >= 0
               for k in ("span_block_s", "index_block_s"))
    fit = out["block_fit"]
    assert set(fit) == {"points", "block", "measured_s", "modelled_s", "span_blocks", "index_blocks", "intercept_s",
                        "launches_s"}
    assert fit["points"] == [list(p) for p in points] and fit["block"] == BLOCK
    # (each point's measured time: the median over the launches of each launch's)
    assert len(fit["launches_s"]) == LAUNCHES[True] and all(len(e) == len(points) for e in fit["launches_s"])
    assert fit["measured_s"] == [statistics.median(e[i] for e in fit["launches_s"]) for i in range(len(points))]
    assert all(m > 0 for m in fit["measured_s"]) and all(m > 0 for m in fit["modelled_s"])
    # the blocks each rate charges on the modelled call's critical path: every worker spans the whole tensor
    assert fit["span_blocks"] == pytest.approx([n / BLOCK for n, _ in points], rel=1e-6)
    # and moves some of its non-zero blocks by index, more of them in a larger or denser call
    i = fit["index_blocks"]
    assert 0 < i[0] < i[1] < i[2] and all(abs(v - round(v)) < 1e-6 for v in i)


def _charge_beside_a_call(ctx, charge_first: bool) -> list[float]:
    """Rank 0's training thread charges an encode (``host_work``) while a call it started runs on its
    communication thread: ``charge_first``, the call's job waits until the charge has been made; otherwise the
    charge waits until the job's messages are done. Returns each job's clock at its end, then the clock."""
    eng = engine(ctx.fabric)
    charged, ran = threading.Event(), threading.Event()

    def job() -> float:
        if charge_first:
            assert charged.wait(30)
        acc = torch.full((2 * CHUNK,), float(ctx.rank + 1))
        ring_allreduce_(ctx.fabric, acc)
        ran.set()
        return ctx.fabric.now()

    first = eng.submit(job)
    if not charge_first:
        assert ran.wait(30)
    if ctx.rank == 0:
        ctx.fabric.host_work("elementwise", 10**6)        # the next bucket's encode, on the training thread
    charged.set()
    second = eng.submit(job)
    return [first.wait(), second.wait(), ctx.fabric.now()]


def test_a_charge_on_the_training_thread_beside_a_call_in_flight_lands_in_submission_order():
    # the clock the calls and the training thread's charges share is advanced in the order the calls were
    # submitted, whatever the threads' scheduling: the charge made while the first call is in flight lands after it
    net = sc.Network(bandwidth_gbps=10.0, latency_us=5.0,
                     host=HostModel(send_message_s=3e-6, recv_message_s=5e-6, elementwise_element_s=1e-9,
                                    sum_element_s={"float32": 2.5e-10}))
    first = sc.launch(functools.partial(_charge_beside_a_call, charge_first=True), 2, network=net)
    later = sc.launch(functools.partial(_charge_beside_a_call, charge_first=False), 2, network=net)
    assert first == later
    alone = sc.launch(functools.partial(_charge_beside_a_call, charge_first=False), 2,
                      network=dataclasses.replace(net, host=dataclasses.replace(net.host, elementwise_element_s=0.0)))
    assert first[0][0] == alone[0][0] and first[1][0] == alone[1][0]    # the first call: as without the charge
    assert first[0][1] > alone[0][1] + 0.9e-3                            # the second: after it


def test_a_call_is_charged_per_other_worker_at_its_start_by_hand():
    """``call_peer_s``: a call of n workers costs (n - 1) * call_peer_s more on every worker, before its first
    message (the whole call shifts by it), stretched by the CPU share; another transport's rate, or none, changes
    nothing to the bit."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    for n in (2, N):
        run = functools.partial(_call, name="ring", numel=N * CHUNK)
        base = [r[0] for r in sc.launch(run, n, network=net(host=HostModel(call_s={"ring": 1e-3})))]
        timed = [r[0] for r in sc.launch(run, n, network=net(host=HostModel(call_s={"ring": 1e-3},
                                                                             call_peer_s={"ring": 1e-4})))]
        assert timed == pytest.approx([b + (n - 1) * 1e-4 for b in base], rel=1e-12, abs=0)
        shared = [r[0] for r in sc.launch(run, n, network=net(host=HostModel(
            call_s={"ring": 1e-3}, call_peer_s={"ring": 1e-4}, cpu_share=2.0)))]
        shared_base = [r[0] for r in sc.launch(run, n, network=net(host=HostModel(call_s={"ring": 1e-3},
                                                                                   cpu_share=2.0)))]
        assert shared == pytest.approx([b + 2 * (n - 1) * 1e-4 for b in shared_base], rel=1e-12, abs=0)
        other = [r[0] for r in sc.launch(run, n, network=net(host=HostModel(call_s={"ring": 1e-3},
                                                                             call_peer_s={"omnireduce": 1.0})))]
        assert [t.hex() for t in other] == [b.hex() for b in base]
    assert HostModel(call_peer_s={"ring": 2e-3}).work_s("call_peer", 3, transport="ring") == 3 * 2e-3
    assert HostModel().work_s("call_peer", 3, transport="ring") == 0.0
    with pytest.raises(InvalidValueError, match="needs the name of the transport"):
        HostModel(call_peer_s={"ring": 1.0}).work_s("call_peer", 1)
    with pytest.raises(InvalidTypeError, match="call_peer_s has key 3"):
        HostModel(call_peer_s={3: 1.0})
    with pytest.raises(InvalidValueError, match="call_peer_s"):
        HostModel(call_peer_s={"ring": -1.0})
    with pytest.raises(InvalidTypeError, match="call_peer_s must map transport names"):
        HostModel(call_peer_s=1.0)


def test_a_profile_without_call_peer_s_models_what_it_modelled_and_one_with_it_round_trips(tmp_path):
    """A profile written before ``call_peer_s`` existed loads with none and models an OmniReduce call of 4 workers
    to the bit as before; one with it round-trips it (unit ``s/peer``) and charges it; a bad value is refused,
    naming the key."""
    run = functools.partial(_call, name="omnireduce", numel=1 << 12)
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    base = [r[0] for r in sc.launch(run, N, network=net(host=FULL))]
    old = _profile(FULL)
    assert "call_peer_s" not in old["host"]          # (none: not written, as a profile before it existed)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL and dict(loaded.host.call_peer_s) == {}
    assert [r[0].hex() for r in sc.launch(run, N, network=loaded)] == [t.hex() for t in base]
    peer = dataclasses.replace(FULL, call_peer_s={"omnireduce": 1e-3})
    new = _profile(peer)
    assert new["host"]["call_peer_s"] == {"value": {"omnireduce": 1e-3}, "unit": "s/peer"}
    path.write_text(json.dumps(new))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == peer
    assert [r[0] for r in sc.launch(run, N, network=loaded)] == pytest.approx([b + 3e-3 for b in base], rel=1e-12,
                                                                                abs=0)
    bad = _profile(peer)
    bad["host"]["call_peer_s"]["value"]["omnireduce"] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(InvalidValueError, match=r"host\.call_peer_s\.value\['omnireduce'\]"):
        sc.Network.from_profile(path)
    bad["host"]["call_peer_s"] = {"value": 1e-3, "unit": "s/peer"}
    path.write_text(json.dumps(bad))
    with pytest.raises(InvalidTypeError, match=r"host\.call_peer_s\.value maps transport names"):
        sc.Network.from_profile(path)


BIG = 4 << 20           # bytes of one message, beyond the table's last size (its line)


def _one_message(ctx, busy: float = 0.0) -> float:
    """Worker 0 sends one message of :data:`BIG` bytes to worker 1, which takes it after ``busy`` seconds of its own
    work: worker 1's modelled time."""
    f = ctx.fabric
    buf = torch.zeros(BIG, dtype=torch.uint8)
    if ctx.rank == 0:
        f.send(buf, 1, 3)
    else:
        f.compute(busy)
        f.recv(buf, 0, 3)
    return f.now()


def test_a_host_that_streams_hides_a_message_bytes_work_behind_a_slower_link_and_paces_a_faster_one():
    host = HostModel(**TABLE)
    lat = 10e-6
    send, wait, recv = host.send_s(BIG), host.wait_s(BIG), host.recv_s(BIG)
    send0, wait0, recv0 = host.send_fixed_s(), host.wait_fixed_s(), host.recv_fixed_s()
    assert (send0, wait0, recv0) == (1e-4, 1e-4, 1e-4)     # (the table at its smallest size)
    assert (HostModel(send_message_s=3e-6, recv_message_s=5e-6, send_byte_s=1e-9).send_fixed_s(),
            HostModel(send_message_s=3e-6, recv_message_s=5e-6).recv_fixed_s(), HOST.wait_fixed_s()) == (3e-6, 5e-6, 0)
    # a 1 Gbit/s link, slower than the hosts' streams: serial (the default), every part of the message's host
    # time before or after the wire; streaming, only the fixed parts
    net = sc.Network(bandwidth_gbps=1.0, latency_us=lat * 1e6, host=host)
    wire = BIG / net.bytes_per_s
    assert wire > (send - send0) and wire > (wait - wait0) + (recv - recv0)
    serial = sc.launch(_one_message, 2, network=net)[1]
    assert serial == pytest.approx(send + wire + lat + wait + recv, rel=1e-12)
    streamed = sc.launch(_one_message, 2, network=dataclasses.replace(net, host_streams=True))[1]
    assert streamed == pytest.approx(send0 + wire + lat + wait0 + recv0, rel=1e-12)
    # a link far faster than the hosts: the sender's stream paces its NIC, the receiver's stream starts at the
    # message's head and ends after its delivery, then the fixed parts
    fast = sc.Network(bandwidth_gbps=1e4, latency_us=lat * 1e6, host=host, host_streams=True)
    assert BIG / fast.bytes_per_s < send - send0 < (wait - wait0) + (recv - recv0)
    t = sc.launch(_one_message, 2, network=fast)[1]
    assert t == pytest.approx(send0 + lat + (wait - wait0) + (recv - recv0) + wait0 + recv0, rel=1e-12)
    # a receiver busy past the message's delivery pays its whole receive, streamed part included (CPU spent
    # meanwhile), and no wait: as without streaming
    for network in (net, dataclasses.replace(net, host_streams=True)):
        busy = sc.launch(functools.partial(_one_message, busy=1.0), 2, network=network)[1]
        assert busy == pytest.approx(1.0 + recv, rel=1e-12)
    # no host model: nothing to stream, the link alone either way
    bare = sc.Network(bandwidth_gbps=1.0, latency_us=lat * 1e6)
    assert (sc.launch(_one_message, 2, network=dataclasses.replace(bare, host_streams=True))[1]
            == sc.launch(_one_message, 2, network=bare)[1] == pytest.approx(wire + lat, rel=1e-12))


def test_the_sparse_switch_charges_its_result_built_after_the_last_result_by_hand():
    from sparsecomm.transports.switchml.sparse.dataplane import HEADER
    base, _ = _sparse(HostModel(**PER_MSG))
    # after its last result each worker stacks the union's result rows (a row copied per block), scatters their
    # sums into the integer result and, decoded (three passes: cast, divide, cast), into the float result it
    # zeroed first (a pass over every element): blocks by index and their bytes, and elementwise passes
    N, k, union = SPARSE_BLOCKS * 256, 256, 3 * SPARSE_BLOCKS // 4
    index, move, elementwise = 3 * union, union * ((HEADER + k) * 4 + k * 4 + k * 4), N + 3 * union * k
    for share in (1.0, 2.0):
        t, _ = _sparse(HostModel(**PER_MSG, index_block_s=1e-3, move_byte_s=1e-6, elementwise_element_s=1e-5,
                                 cpu_share=share))
        # (within the per-message costs of PER_MSG, 1e-9 s: the end moves, the messages' overlaps shift slightly)
        assert (t - base) / share == pytest.approx(index * 1e-3 + move * 1e-6 + elementwise * 1e-5, abs=1e-7)
    # a model without the rates (0, as a profile without them) charges nothing: the bits of the call before
    t, _ = _sparse(HostModel(**PER_MSG, index_block_s=0.0, move_byte_s=0.0, elementwise_element_s=0.0))
    assert t.hex() == base.hex()


def _check_sync(value: float, fit: dict, work: dict | None = None) -> None:
    """``sync_s`` is what its recorded measurement says (:func:`sparsecomm.netbed.calibrate.sync_costs`), and
    ``sync_work_s`` (``work``, the profile's entry, if any) the work per call of its loop."""
    assert fit["workers"] == PEER_WORKERS and fit["cores"] == os.cpu_count()
    assert fit["share"] == max(1.0, PEER_WORKERS / os.cpu_count())
    if fit["share"] <= 1.0:
        assert value == 0.0 and "measured_s" not in fit and work is None
        return
    assert work == {"value": fit["work_s"], "unit": "s"}
    import statistics
    assert fit["work_reps"] >= 1 and fit["work_s"] == pytest.approx(SYNC_WORK_S, rel=0.5)
    assert fit["numel"] == CALL_ELEMS_OF["native"]
    assert len(fit["launches_s"]) >= 1 and fit["measured_s"] == statistics.median(fit["launches_s"])
    # the modelled loop: the work stretched by the share, and a call that takes time
    assert fit["modelled_s"] > fit["work_s"] * fit["share"]
    assert fit["measured_s"] > 0
    assert value == max(0.0, fit["measured_s"] - fit["modelled_s"]) / (fit["share"] - 1.0)


def _check_shared(by_share: dict | None, fit: dict) -> None:
    """A profile's ``by_share`` is what its recorded measurement says (:func:`sparsecomm.netbed.calibrate.
    shared_costs`): none on as many cores as PEER_WORKERS; else one entry at PEER_WORKERS per core, its message
    tables the exchanges' CPU (at most the exchange over the share) and the rest, its native rates the non-negative
    fit of gloo's measured calls less the modelled ones, its ``call_s`` the measured calls less the modelled ones
    over the share (the model stretches it by the share), at least 0."""
    import statistics

    from sparsecomm.fabric.sim.sim_host import SHARED_RATES
    from sparsecomm.netbed.calibrate import fit_nonnegative

    share = PEER_WORKERS / os.cpu_count()
    assert fit["workers"] == PEER_WORKERS and fit["cores"] == os.cpu_count() and fit["share"] == max(1.0, share)
    if share <= 1.0:
        assert by_share is None and set(fit) == {"workers", "cores", "share"}
        return
    assert list(by_share) == [f"{share:g}"]
    entry = by_share[f"{share:g}"]
    assert set(entry) == set(SHARED_RATES)
    mf = fit["message_fit"]
    cpu, wait = entry["message_cpu_s"]["value"], entry["message_wait_s"]["value"]
    assert list(cpu) == list(wait) == [str(n) for n in mf["sizes"]]
    for n, t, c in zip(mf["sizes"], mf["exchange_s"], mf["exchange_cpu_s"]):
        assert t > 0 and c > 0
        assert cpu[str(n)] == min(c, t / share) and wait[str(n)] == pytest.approx(max(0.0, t - share * cpu[str(n)]),
                                                                                  rel=1e-12, abs=1e-15)
    nf = fit["native_fit"]
    assert all(t > 0 for t in nf["measured_s"] + nf["modelled_s"]) and all(k > 0 for k in nf["messages"])
    c, message, byte = fit_nonnegative(np.column_stack([nf["messages"], nf["bytes"]]),
                                       np.array(nf["measured_s"]) - np.array(nf["modelled_s"]))
    assert entry["native_message_s"]["value"] == pytest.approx(message, rel=1e-9, abs=1e-15)
    assert entry["native_byte_s"]["value"] == pytest.approx(byte, rel=1e-9, abs=1e-15)
    calls, cf = entry["call_s"]["value"], fit["call_fit"]
    assert set(calls) == set(cf) == set(CALL_GROUPS[()])
    for name, v in calls.items():
        assert cf[name]["measured_s"] == statistics.median(cf[name]["launches_s"]) and cf[name]["modelled_s"] > 0
        assert v == max(0.0, cf[name]["measured_s"] - cf[name]["modelled_s"]) / share


@pytest.mark.multiprocess
def test_shared_into_writes_the_profile_with_its_rates_by_share_measured(tmp_path, capsys):
    """``calibrate --shared-into P --out Q`` (the rates by share alone, on loopback, and ``sync_s`` again with
    them): ``Q`` is ``P`` with ``by_share`` and ``sync_s`` as their recorded measurements say, every other rate as
    ``P`` has it."""
    from sparsecomm.netbed.calibrate import main

    src, out = tmp_path / "p.json", tmp_path / "q.json"
    host = dataclasses.replace(TABLED, call_s={"native": 2e-4, "ring": 1e-4, "switch": 3e-4})
    profile = _profile(host)
    profile["netbed"] = {"latency_s": {"value": 5e-5, "unit": "s"}, "gbps": 1.0, "hosts": 2}
    src.write_text(json.dumps(profile))
    assert main(["--shared-into", str(src), "--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out}\n")
    got = json.loads(out.read_text())
    _check_shared(got.get("by_share"), got["method"]["shared_fit"])
    _check_sync(got["host"]["sync_s"]["value"], got["method"]["sync_fit"], got["host"].get("sync_work_s"))
    unsynced = lambda rates: {k: v for k, v in rates.items() if k not in ("sync_s", "sync_work_s")}  # noqa: E731
    assert unsynced(got["host"]) == unsynced(profile["host"])
    assert got["netbed"] == profile["netbed"] and got["date"] == profile["date"]
    loaded = sc.Network.from_profile(out).host
    assert dataclasses.replace(loaded, by_share={}, sync_s=host.sync_s, sync_work_s=None) == host


def _end_of_call(ctx, name: str, numel: int) -> tuple[float, float]:
    """One call of ``name`` on ones: the worker's clock at its end and the call's modelled time."""
    t = sc.transports.get(name, ctx.fabric)
    y = t.allreduce(torch.ones(numel))
    assert torch.equal(y, torch.full_like(y, float(ctx.world_size)))
    return ctx.fabric.now(), t.last_stats.modelled_time_s


def _ends(host: HostModel | None, name: str = "ring") -> list[tuple[float, float]]:
    return sc.launch(functools.partial(_end_of_call, name=name, numel=N * CHUNK), N,
                     network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=host))


def test_a_call_on_shared_cores_waits_sync_s_for_its_last_worker_by_hand():
    """``sync_s``: on shared cores every worker waits ``sync_s * (share - 1)`` at a call's start (a wait, not CPU:
    not stretched by the share again), so the whole call shifts by it on every worker and its modelled time grows by
    it; on cores of one's own (share 1), and with ``sync_s`` 0 (a profile without it), nothing changes to the bit."""
    sync = 1.5e-3
    for name in ("ring", "allgather"):
        for share in (1.5, 2.0, 3.0):
            shared = dataclasses.replace(HOST, cpu_share=share)
            base = _ends(shared, name)
            timed = _ends(dataclasses.replace(shared, sync_s=sync), name)
            wait = sync * (share - 1)
            assert [t[0] for t in timed] == pytest.approx([b[0] + wait for b in base], rel=1e-12, abs=0)
            assert [t[1] for t in timed] == pytest.approx([b[1] + wait for b in base], rel=1e-12, abs=0)
        assert [t[0].hex() for t in _ends(dataclasses.replace(HOST, sync_s=sync), name)] == \
            [t[0].hex() for t in _ends(HOST, name)]
        assert [t[0].hex() for t in _ends(dataclasses.replace(HOST, cpu_share=2.0, sync_s=0.0), name)] == \
            [t[0].hex() for t in _ends(dataclasses.replace(HOST, cpu_share=2.0), name)]
    # a straggler's factor is not a share of the cores: no wait; per endpoint, only the one that shares its core
    own = dataclasses.replace(HOST, sync_s=sync, cpu_share_by_endpoint={2: 2.0})
    assert own.sync_wait_s(2) == sync and own.sync_wait_s(0) == 0.0
    slow = sc.launch(functools.partial(_end_of_call, name="ring", numel=N * CHUNK), N,
                     network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=dataclasses.replace(HOST, sync_s=sync),
                                        stragglers={1: 2.0}))
    assert [t[0].hex() for t in slow] == [t[0].hex() for t in sc.launch(
        functools.partial(_end_of_call, name="ring", numel=N * CHUNK), N,
        network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=HOST, stragglers={1: 2.0}))]
    assert HostModel(sync_s=sync).work_s("sync", 3) == 3 * sync
    with pytest.raises(InvalidValueError, match="sync_s"):
        HostModel(sync_s=-1e-3)


def test_a_profile_without_sync_s_models_what_it_modelled_and_one_with_it_round_trips(tmp_path):
    """A profile written before ``sync_s`` existed loads with 0 and models a call on shared cores to the bit as
    before; one with it round-trips it (unit ``s/call``) and charges it; a bad value is refused, naming the key."""
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    run = functools.partial(_end_of_call, name="ring", numel=N * CHUNK)
    base = [r[0] for r in sc.launch(run, N, network=net(host=FULL.sharing(4, 2)))]
    old = _profile(FULL)
    del old["host"]["sync_s"]           # (a profile written before it existed)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == FULL and loaded.host.sync_s == 0.0
    assert [r[0].hex() for r in sc.launch(run, N, network=net(host=loaded.host.sharing(4, 2)))] == \
        [t.hex() for t in base]
    synced = dataclasses.replace(FULL, sync_s=2e-3)
    new = _profile(synced)
    assert new["host"]["sync_s"] == {"value": 2e-3, "unit": "s/call"}
    path.write_text(json.dumps(new))
    loaded = sc.Network.from_profile(path, bandwidth_gbps=10.0, latency_us=5.0)
    assert loaded.host == synced
    assert [r[0] for r in sc.launch(run, N, network=net(host=loaded.host.sharing(4, 2)))] == pytest.approx(
        [b + 2e-3 for b in base], rel=1e-12, abs=0)
    bad = _profile(synced)
    bad["host"]["sync_s"]["value"] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(InvalidValueError, match=r"sync_s"):
        sc.Network.from_profile(path)


def test_sync_into_writes_the_profile_with_sync_s_measured(tmp_path, capsys):
    """``calibrate --sync-into P --out Q`` (the measurement of ``sync_s`` alone, on loopback): ``Q`` is ``P`` with
    ``sync_s`` as its recorded measurement says, every other rate as ``P`` has it."""
    from sparsecomm.netbed.calibrate import main

    src, out = tmp_path / "p.json", tmp_path / "q.json"
    host = dataclasses.replace(FULL, call_s={"native": 2e-4, "ring": 1e-4})
    profile = _profile(host)
    profile["netbed"] = {"latency_s": {"value": 5e-5, "unit": "s"}, "gbps": 1.0, "hosts": 2}
    del profile["host"]["sync_s"]
    src.write_text(json.dumps(profile))
    assert main(["--sync-into", str(src), "--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out}\n")
    got = json.loads(out.read_text())
    _check_sync(got["host"]["sync_s"]["value"], got["method"]["sync_fit"], got["host"].get("sync_work_s"))
    assert {k: v for k, v in got["host"].items() if k not in ("sync_s", "sync_work_s")} == profile["host"]
    assert got["netbed"] == profile["netbed"] and got["date"] == profile["date"]
    work = got["host"].get("sync_work_s")
    assert sc.Network.from_profile(out).host == dataclasses.replace(host, sync_s=got["host"]["sync_s"]["value"],
                                                                     sync_work_s=work and work["value"])


def test_an_advised_fresh_buffer_is_charged_its_own_rate_or_half_a_copy():
    """``"fresh_advised"`` (a fresh buffer advised as huge pages): ``fresh_advised_byte_s`` per byte from
    ``fresh_min_bytes`` on, nothing below; without the rate (``None``, a profile without it) half of
    ``copy_byte_s``; a profile round-trips it, and one without it loads as ``None``."""
    h = HostModel(copy_byte_s=4e-10, fresh_byte_s=8e-10, fresh_min_bytes=100)
    assert h.fresh_advised_byte_s is None
    assert h.work_s("fresh_advised", 99) == 0.0
    assert h.work_s("fresh_advised", 100) == 100 * 2e-10
    assert h.work_s("fresh", 100) == 100 * 8e-10           # (the plain fresh buffer's charge, unchanged)
    given = dataclasses.replace(h, fresh_advised_byte_s=1e-10)
    assert given.work_s("fresh_advised", 1000) == 1000 * 1e-10 and given.work_s("fresh_advised", 10) == 0.0
    with pytest.raises(InvalidValueError, match="fresh_advised_byte_s"):
        HostModel(fresh_advised_byte_s=-1.0)
    assert "fresh_advised_byte_s" not in _profile(h)["host"]
    assert host_from_profile(_profile(h)).fresh_advised_byte_s is None
    assert host_from_profile(_profile(given)).fresh_advised_byte_s == 1e-10


class _Declared:
    """A fabric stand-in that records what is declared to its host model (a modelled one's: ``modelled_time``)."""

    modelled_time = True

    def __init__(self) -> None:
        self.work = []

    def host_work(self, op, count, dtype=None, *, transport=None):
        self.work.append((op, count))


def test_the_work_copy_declares_an_advised_buffer_from_the_advice_threshold_on():
    """The ring's and ``native``'s work copy (``LinearOperand.work_copy``) declares its bytes copied and, from
    :data:`~sparsecomm.transports.buffers.ADVISE_MIN_BYTES` on, an advised fresh buffer (below: a plain one);
    the copy holds the input's bits and is not the input; in place, nothing."""
    from sparsecomm.transports.buffers import ADVISE_MIN_BYTES
    from sparsecomm.transports.linear import linear_operand

    for numel, op in ((ADVISE_MIN_BYTES // 4 - 1, "fresh"), (ADVISE_MIN_BYTES // 4, "fresh_advised")):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        f = _Declared()
        y = linear_operand(x, "ring").work_copy(f)
        assert f.work == [("copy", 4 * numel), (op, 4 * numel)]
        assert y.data_ptr() != x.data_ptr() and torch.equal(y.view(torch.int32), x.view(torch.int32))
        f = _Declared()
        assert linear_operand(x, "ring", inplace=True).work_copy(f) is x and f.work == []


def test_calibrate_pinned_times_the_sparse_switch_on_pinned_ranks_and_models_its_workers_sharing_the_cores(
        monkeypatch):
    """``--pin-cores``: the sparse switch's per-result fit and the per-call costs on ranks pinned one to a core in
    turn, modelled with the processes that compute at the same moments sharing the cores (the sparse switch's
    switch computes only while its two workers wait: ``services_share_cores``), as a run on pinned ranks is
    modelled; unpinned, every process shares them. (The launches are injected: what is checked is how the
    calibration launches and models them.)"""
    from sparsecomm.netbed import calibrate as cal

    real_launch = sc.launch
    cores = os.cpu_count() or 1
    for pinned in (True, False):
        launched, shares = [], []

        def fake(fn, n, backend=None, timeout_s=None, network=None, services=None, **kw):
            if network is not None:         # (the modelled call: run as it is)
                shares.append((tuple(services or ()), network.host.cpu_share))
                return real_launch(fn, n, network=network, services=services, **kw)
            launched.append(kw)
            if "points" in fn.keywords:      # the per-result fit's calls: a time per point and call
                return [[[0.01 * (k + 1)] * fn.keywords["calls"] for k in range(len(fn.keywords["points"]))]
                        for _ in range(n)]
            return [{name: [0.02] * fn.keywords["calls"] for name in fn.keywords["names"]} for _ in range(n)]

        monkeypatch.setattr(sc, "launch", fake)
        got = cal.sparse_switch_round_costs(HostModel(), quick=True, pin_cores=pinned)
        assert got["sparse_switch_round_s"] >= 0
        assert launched and all(kw.get("pin_cores", False) is pinned for kw in launched)
        assert shares and {s for _, s in shares} == {max(1.0, (2 if pinned else 3) / cores)}
        launched.clear(), shares.clear()
        cal.call_costs(HostModel(), quick=True, pin_cores=pinned)
        assert launched and all(kw.get("pin_cores", False) is pinned for kw in launched)
        expect = {(): 2, ("switch",): 3, ("sparse-switch",): 2 if pinned else 3}     # (a group's modelled calls
        assert [s for _, s in shares] == [max(1.0, expect[svc] / cores) for svc in cal.CALL_GROUPS]  # in turn)


# ------------------------------------------------------------------------------------------ rates by share
#: rates fitted with two processes per core: the library's messages dearer, gloo's cheaper, ring's call dearer
SHARED = {"message_cpu_s": {64: 3e-5, 1 << 20: 4e-4}, "message_wait_s": {64: 2e-4, 1 << 20: 3e-4},
          "native_message_s": 1e-6, "native_byte_s": 2e-10, "call_s": {"ring": 5e-4, "native": 1e-4}}
TABLED = dataclasses.replace(FULL, message_cpu_s={64: 2e-5, 1 << 20: 3e-4}, message_wait_s={64: 1e-5, 1 << 20: 5e-5},
                             native_message_s=0.0, native_byte_s=5e-10)


def test_sharing_takes_the_rates_of_the_largest_share_not_above_the_runs():
    """``sharing(endpoints, cores)`` puts the ``by_share`` entry of the largest share not above the run's in place of
    the model's own rates (``call_s`` per transport: the entry's replace the model's, the others stay), stretched by
    the run's share; a share below every entry (1, on cores of one's own) takes the model's own rates."""
    host = dataclasses.replace(TABLED, by_share={2: SHARED})
    own = {name: getattr(TABLED, name) for name in SHARED}
    for endpoints, share, rates in ((2, 1.0, own), (3, 1.5, own), (4, 2.0, SHARED), (5, 2.5, SHARED),
                                    (8, 4.0, SHARED)):
        got = host.sharing(endpoints, 2)
        assert got.cpu_share == share
        for name in ("message_cpu_s", "message_wait_s", "native_message_s", "native_byte_s"):
            assert getattr(got, name) == rates[name], (endpoints, name)
        assert dict(got.call_s) == {**TABLED.call_s, **rates["call_s"]}
        # every other rate the model's own; the table applied once (gone from a model it was applied to)
        assert got.send_message_s == TABLED.send_message_s and got.sum_element_s == TABLED.sum_element_s
        assert dict(got.by_share) == ({} if rates is SHARED else dict(host.by_share))
    # two entries: each run takes its own, the largest share not above it
    four = {"native_message_s": 0.0, "native_byte_s": 1e-10}
    both = dataclasses.replace(TABLED, by_share={4: four, 2: SHARED})
    assert list(both.by_share) == [2.0, 4.0]
    assert both.sharing(6, 2).native_byte_s == SHARED["native_byte_s"]
    assert both.sharing(8, 2).native_byte_s == both.sharing(16, 2).native_byte_s == four["native_byte_s"]
    assert both.sharing(8, 2).message_cpu_s == TABLED.message_cpu_s        # (an entry without it: the model's own)


def _native_ends(ctx, numel: int) -> float:
    from sparsecomm.transports.native.model import GlooRing

    t = GlooRing(ctx.fabric)
    y = t.allreduce(torch.ones(numel))
    assert torch.equal(y, torch.full_like(y, float(ctx.world_size)))
    return ctx.fabric.now()


def test_a_run_on_shared_cores_is_charged_the_entrys_rates_stretched_by_hand():
    """A run at a share with an entry is modelled to the bit as a model that holds the entry's rates as its own at
    that share (the ring's messages by the entry's tables, gloo's by its native rates, the calls by its ``call_s``);
    a model without the table (``by_share`` empty: the default and every profile before it) shares as before, its
    own rates stretched by the share, to the bit."""
    host = dataclasses.replace(TABLED, by_share={2: SHARED})
    by_hand = dataclasses.replace(TABLED, cpu_share=2.0, **{k: v for k, v in SHARED.items() if k != "call_s"},
                                  call_s={**TABLED.call_s, **SHARED["call_s"]})
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    for fn in (functools.partial(_end_of_call, name="ring", numel=N * CHUNK),
               functools.partial(_native_ends, numel=1 << 16)):
        shared = [repr(r) for r in sc.launch(fn, N, network=net(host=host.sharing(4, 2)))]
        assert shared == [repr(r) for r in sc.launch(fn, N, network=net(host=by_hand))]
        stretched = [repr(r) for r in sc.launch(fn, N, network=net(host=TABLED.sharing(4, 2)))]
        assert shared != stretched                  # (the entry's rates moved the modelled times)
        assert stretched == [repr(r) for r in sc.launch(fn, N, network=net(
            host=dataclasses.replace(TABLED, cpu_share=2.0)))]
        # on cores of their own the table charges nothing: the model's own rates, to the bit
        assert [repr(r) for r in sc.launch(fn, N, network=net(host=host.sharing(2, 2)))] == \
            [repr(r) for r in sc.launch(fn, N, network=net(host=TABLED))]


def test_host_model_validates_its_rates_by_share():
    with pytest.raises(InvalidValueError, match="a share of by_share"):
        HostModel(by_share={1: {"native_message_s": 0.0, "native_byte_s": 1e-10}})
    with pytest.raises(InvalidValueError, match=r"by_share\[2\] has \['copy_byte_s'\].*message_cpu_s"):
        HostModel(by_share={2: {"copy_byte_s": 1e-10}})
    with pytest.raises(InvalidValueError, match="message_cpu_s and message_wait_s both or neither"):
        HostModel(by_share={2: {"message_cpu_s": {64: 1e-5}}})
    with pytest.raises(InvalidValueError, match="native_message_s and native_byte_s both or neither"):
        HostModel(by_share={2: {"native_byte_s": 1e-10}})
    with pytest.raises(InvalidValueError, match=r"by_share\[2\].*native_byte_s"):
        HostModel(by_share={2: {"native_message_s": 0.0, "native_byte_s": -1.0}})
    with pytest.raises(InvalidTypeError, match="by_share must map"):
        HostModel(by_share=[(2, {})])
    # a value, its table too: equal, hashed and pickled as one
    import pickle
    host = dataclasses.replace(TABLED, by_share={2: SHARED})
    again = pickle.loads(pickle.dumps(host))
    assert again == host and hash(again) == hash(host) and again != TABLED
    with pytest.raises(TypeError):
        host.by_share[2]["native_byte_s"] = 0.0


def test_a_profile_with_rates_by_share_round_trips_and_one_without_them_shares_as_before(tmp_path):
    """``by_share`` in a profile (optional): its entries round-trip (shares as decimal strings, each rate as
    ``host``'s with its unit); a profile without it (every profile before it, the recorded ones) loads with none and
    models a run on shared cores to the bit as before; a bad entry is refused, naming its key."""
    path = tmp_path / "host.json"
    host = dataclasses.replace(TABLED, by_share={2: SHARED, 2.5: {"native_message_s": 0.0, "native_byte_s": 1e-10}})
    profile = _profile(host)
    assert list(profile["by_share"]) == ["2", "2.5"]
    assert profile["by_share"]["2"]["native_byte_s"] == {"value": 2e-10, "unit": "s/byte"}
    assert profile["by_share"]["2"]["message_cpu_s"] == {"value": {"64": 3e-5, "1048576": 4e-4}, "unit": "s/message"}
    assert profile["by_share"]["2"]["call_s"] == {"value": SHARED["call_s"], "unit": "s/call"}
    path.write_text(json.dumps(profile))
    assert sc.Network.from_profile(path).host == host
    old = _profile(TABLED)
    assert "by_share" not in old
    path.write_text(json.dumps(old))
    loaded = sc.Network.from_profile(path).host
    assert loaded == TABLED and dict(loaded.by_share) == {}
    fn = functools.partial(_end_of_call, name="ring", numel=N * CHUNK)
    net = functools.partial(sc.Network, bandwidth_gbps=10.0, latency_us=5.0)
    assert [repr(r) for r in sc.launch(fn, N, network=net(host=loaded.sharing(4, 2)))] == \
        [repr(r) for r in sc.launch(fn, N, network=net(host=dataclasses.replace(TABLED, cpu_share=2.0)))]
    for edit, error, match in (
            (lambda p: p["by_share"].update({"1": p["by_share"].pop("2")}), InvalidValueError,
             r"by_share has key '1'.*above 1"),
            (lambda p: p["by_share"].update({"two": p["by_share"].pop("2")}), InvalidValueError, "key 'two'"),
            (lambda p: p["by_share"]["2"].update(copy_byte_s={"value": 1e-10, "unit": "s/byte"}), InvalidValueError,
             r"unknown rate\(s\) \['copy_byte_s'\] in by_share\['2'\]"),
            (lambda p: p["by_share"]["2"]["native_byte_s"].update(unit="s/message"), InvalidValueError,
             r"by_share\['2'\].native_byte_s has unit 's/message'"),
            (lambda p: p["by_share"]["2"]["native_byte_s"].update(value=-1.0), InvalidValueError,
             r"by_share\['2'\].native_byte_s.value must be a finite rate"),
            (lambda p: p["by_share"]["2"].pop("message_wait_s"), InvalidValueError, "both or neither"),
            (lambda p: p.update(by_share=[]), InvalidTypeError, "'by_share' is a JSON object")):
        bad = json.loads(json.dumps(profile))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(error, match=match):
            sc.Network.from_profile(path)


# ------------------------------------------------------------------------------------------ fresh pages
def test_the_fresh_sweep_runs_each_size_as_a_run_of_calls_in_a_process_of_its_own(monkeypatch):
    """calibrate's fresh-page fit times work copies made in a run of calls, plain and advised each in a launched
    process of its own (a worker's fresh heap, not a tight loop after the calibration's other work), and takes the
    mean of the timed calls (the faults come in some calls only), the median of the mapped copies. (The runs are
    injected: what is checked is what the calibration makes of them.)"""
    from sparsecomm.netbed import calibrate as cal

    sizes, reps, warm = cal.FRESH_SIZES[True], cal.FRESH_REPEATS[True], cal.FRESH_WARMUP
    launched = []

    def fake_launch(fn, n, backend=None, timeout_s=None, **kw):
        numel, calls, advised = fn.keywords["n"], fn.keywords["calls"], fn.keywords["advised"]
        launched.append((n, backend, numel, calls, advised))
        mapped = numel * 1e-10
        # a warm-up call that faults, then calls that fault one in two (advised: a quarter as dear)
        cost = (1.0 if advised else 4.0) * mapped
        work = [100 * mapped] * warm + [mapped + (cost if i % 2 else 0.0) for i in range(calls - warm)]
        return [(work, [mapped] * calls)]

    monkeypatch.setattr(sc, "launch", fake_launch)
    got = cal.fresh_costs(quick=True)
    assert launched == [(1, "gloo", b // 4, warm + reps, adv) for b in sizes for adv in (False, True)]
    mean = lambda k: sum(k * (i % 2) for i in range(reps)) / reps   # noqa: E731
    fit = got["fresh_fit"]
    for b, f, a, m in zip(sizes, fit["fresh_s"], fit["advised_s"], fit["mapped_s"]):
        m0 = b // 4 * 1e-10
        assert m == pytest.approx(m0) and f == pytest.approx(m0 + mean(4 * m0)) and a == pytest.approx(m0 + mean(m0))
    assert got["fresh_min_bytes"] == sizes[0]     # (mean 3x the mapped copy: at least FRESH_STEP from the first size)
    assert got["fresh_byte_s"] == pytest.approx(mean(4e-10) / 4)
    assert got["fresh_advised_byte_s"] == pytest.approx(mean(1e-10) / 4)



def _two_calls(ctx, name: str, numel: int, work_s: float) -> list[float]:
    """A call, ``work_s`` of compute, a second call, a third right after it: the worker's clock after each."""
    t = sc.transports.get(name, ctx.fabric)
    out = []
    for before in (0.0, work_s, 0.0):
        ctx.fabric.compute(before)
        t.allreduce(torch.ones(numel))
        out.append(ctx.fabric.now())
    return out


def test_a_call_waits_sync_s_in_proportion_to_the_work_since_the_previous_call_by_hand():
    """``sync_work_s``: a call waits ``sync_s * (share - 1) * min(1, w / sync_work_s)`` for its last worker, ``w``
    the endpoint's work since its previous call ended over its share (its compute and charged host work; the call's
    own CPU is not work between calls): the first call (no call before it) waits all of it, one after ``w`` of work
    the fraction, one right after another nothing; ``None`` (a profile without it) waits all of it at every call, as
    before it existed."""
    sync, share, numel = 2e-3, 2.0, N * CHUNK
    shared = dataclasses.replace(HOST, cpu_share=share, sync_s=sync)
    wait = sync * (share - 1)
    for name in ("ring", "allgather"):
        for frac in (0.25, 0.5, 1.0, 3.0):
            work = 4e-3
            run = functools.partial(_two_calls, name=name, numel=numel, work_s=frac * work * share)
            full = sc.launch(run, N, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=shared))
            scaled = sc.launch(run, N, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0,
                                                          host=dataclasses.replace(shared, sync_work_s=work)))
            for f, s in zip(full, scaled):
                assert s[0] == pytest.approx(f[0], rel=1e-12, abs=0)          # the first call: all of it
                saved = wait * (1 - min(1.0, frac))                              # the second: the fraction
                assert s[1] == pytest.approx(f[1] - saved, rel=1e-12, abs=1e-15)
                assert s[2] == pytest.approx(f[2] - saved - wait, rel=1e-12, abs=1e-15)   # the third: none
    # on cores of its own nothing waits, whatever the work
    own = dataclasses.replace(HOST, sync_s=sync, sync_work_s=4e-3)
    run = functools.partial(_two_calls, name="ring", numel=numel, work_s=1e-3)
    assert [[t.hex() for t in r] for r in sc.launch(run, N, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0,
                                                                                host=own))] == \
        [[t.hex() for t in r] for r in sc.launch(run, N, network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0,
                                                                             host=HOST))]
    assert shared.sync_wait_s(0, 1.0) == shared.sync_wait_s(0) == wait
    assert dataclasses.replace(shared, sync_work_s=4e-3).sync_wait_s(0, 1e-3) == pytest.approx(wait / 4)
    with pytest.raises(InvalidValueError, match="sync_work_s"):
        HostModel(sync_work_s=-1.0)


def test_a_profile_without_sync_work_s_waits_in_full_and_calls_into_adds_its_measurements_work(tmp_path):
    """A profile written before ``sync_work_s`` existed, with ``sync_s``, loads with ``None`` (every call waits all of
    ``sync_s``: ``method`` is a record, not read); ``calibrate --calls-into`` adds the work its ``method.sync_fit``
    recorded (``work_s``) and keeps a rate the profile has; a bad record is refused, naming it; one with the rate
    round-trips it (unit ``s``)."""
    from sparsecomm.netbed.calibrate import CALLS, main

    synced = dataclasses.replace(TABLED, sync_s=2e-3, call_s={"ring": 1.0})
    old = _profile(synced)
    assert "sync_work_s" not in old["host"]
    old["method"] = {"call_fit": {"ring": {"measured_s": 0.05, "launches_s": [0.05]}}, "calls": CALLS[True],
                     "pin_cores": False, "sync_fit": {"work_s": 4e-3, "share": 2.0}}
    src, out = tmp_path / "p.json", tmp_path / "q.json"
    src.write_text(json.dumps(old))
    assert sc.Network.from_profile(src).host.sync_work_s is None
    assert main(["--calls-into", str(src), "--out", str(out)]) == 0
    assert sc.Network.from_profile(out).host.sync_work_s == 4e-3
    assert json.loads(out.read_text())["host"]["sync_work_s"] == {"value": 4e-3, "unit": "s"}
    has = _profile(dataclasses.replace(synced, sync_work_s=3e-3))
    has["method"] = old["method"]                   # (the rate, where given, is kept; not the record)
    src.write_text(json.dumps(has))
    assert main(["--calls-into", str(src), "--out", str(out)]) == 0
    assert sc.Network.from_profile(out).host.sync_work_s == 3e-3
    old["method"] = {**old["method"], "sync_fit": {"work_s": "4 ms"}}
    src.write_text(json.dumps(old))
    with pytest.raises(InvalidValueError, match=r"sync_fit.work_s"):
        main(["--calls-into", str(src), "--out", str(out)])
