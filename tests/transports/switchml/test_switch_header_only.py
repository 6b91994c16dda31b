"""Header-only packets of the ``switch`` (a float job's exponent look-ahead on real fabrics): the program
takes them as packets of zero values and answers them header-only; a ``SHORT`` message whose count no
buffer holds is malformed, and reported as every malformed packet is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.transports.switchml import dataplane as sdp
from sparsecomm.transports.switchml.dataplane import (F_EXP, F_NW, F_PKT, F_SET, F_SLOT, F_TYPE, F_WORKER, HEADER,
                                                    T_DATA, T_RESULT, T_RETRANSMIT, T_SHORT, Dataplane, SwitchConfig)
from tests._faults_common import CorruptingFabric, outcome


def _header(slot: int, worker: int, exp: int, n: int = 2) -> np.ndarray:
    row = np.zeros((1, HEADER), dtype=np.int32)
    row[0, F_TYPE], row[0, F_SLOT], row[0, F_SET], row[0, F_WORKER] = T_DATA, slot, 0, worker
    row[0, F_PKT], row[0, F_NW], row[0, F_EXP] = 7, n, exp
    return row


def test_header_only_packets_sum_as_zeros_and_their_results_are_headers_with_the_largest_exponent():
    dp = Dataplane(SwitchConfig(elems=64, slots=4))
    dp.world = 2
    dp.values[:] = 99                                   # a previous job's values in every slot
    mc, uc = dp.process(_header(1, 0, -3))
    assert mc.shape == (0, HEADER) and uc.shape == (0, HEADER)
    mc, uc = dp.process(_header(1, 1, 5))
    assert mc.shape == (1, HEADER) and uc.shape == (0, HEADER)
    assert mc[0, F_TYPE] == T_RESULT and mc[0, F_EXP] == 5 and mc[0, F_PKT] == 7 and mc[0, F_SLOT] == 1
    assert (dp.values[1, 0] == 0).all()                 # the slot holds zeros, not the previous job's values
    mc, uc = dp.process(_header(1, 0, -3))              # a duplicate after completion: the stored result
    assert mc.shape == (0, HEADER) and uc.shape == (1, HEADER)
    assert uc[0, F_TYPE] == T_RETRANSMIT and uc[0, F_EXP] == 5
    assert dp.stats["malformed"] == 0
    # a row as wide as neither a packet nor a header is malformed
    mc, _ = dp.process(np.concatenate([_header(2, 0, 0), np.zeros((1, 3), dtype=np.int32)], axis=1))
    assert len(mc) == 0 and dp.stats["malformed"] == 1


def test_short_frame_and_short_rows_are_inverse_and_refuse_a_count_past_the_buffer():
    buf = np.zeros((2, HEADER + 64), dtype=np.int32)
    msg, rows = sdp.short_frame(buf, 3)
    assert msg.size == HEADER * 4 and msg[F_TYPE] == T_SHORT and rows.shape == (3, HEADER)
    rows[:] = 5
    assert np.array_equal(sdp.short_rows(buf, 16), rows) and sdp.short_extent(3, HEADER + 64) == 1
    assert sdp.short_rows(buf, 2) is None                # more than the most the receiver takes
    buf.reshape(-1)[1] = buf.size                       # more rows than the buffer holds
    assert sdp.short_rows(buf, 10**9) is None
    buf.reshape(-1)[1] = -1
    assert sdp.short_rows(buf, 16) is None


def _forged_count(ctx):
    """After a good call (first calls: compilation), worker 1 rewrites the count of its SHORT messages to the
    switch beyond any receive buffer."""
    f = ctx.fabric
    forging = [False]
    if ctx.rank == 1:
        def rw(t, dst, tag):
            if forging[0] and tag == sdp.TAG_UP and t.dtype == torch.int32 and int(t.reshape(-1)[0]) == T_SHORT:
                out = t.detach().clone()
                out.view(-1)[1] = 2**30
                return out
            return None
        f = CorruptingFabric(f, rw)
    t = sc.transports.get("switch", f)
    good = torch.equal(t.allreduce(torch.ones(3000) * (ctx.rank + 1)), torch.full((3000,), 3.0))
    forging[0] = True
    return good, outcome(lambda: t.allreduce(torch.ones(3000) * (ctx.rank + 1)))


@pytest.mark.multiprocess
def test_a_short_message_whose_count_no_buffer_holds_stops_every_rank_naming_its_worker():
    res = sc.launch(_forged_count, 2, backend="gloo", timeout_s=30.0, services=["switch"])
    assert all(good for good, _ in res), res
    got = [o for _, o in res]
    assert [o[0] for o in got] == ["MalformedMessage"] * 2, got
    assert all(o[2] < 5.0 and "worker 1" in o[1] for o in got), got



def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _audited(ctx):
    t = sc.transports.get("switch", ctx.fabric, audit=True)
    return t.allreduce(_inputs(ctx.rank)), t.slot_elems


@pytest.mark.multiprocess
def test_header_only_look_ahead_through_an_audited_switch_gives_the_codecs_sum():
    """The audit keeps the switch's results apart from its receive buffers (the other path of its ports): the
    look-ahead's header-only packets go through it too, and the sums are the codec's bit for bit."""
    res = sc.launch(_audited, 2, backend="gloo", timeout_s=60.0, services=["switch:audit=1"])
    E = res[0][1]
    xs = [_inputs(r) for r in range(2)]
    e = torch.stack([codec.chunk_exponents(x, E).clamp_min(-126) for x in xs]).max(dim=0).values
    scales = codec.scale_from_exponents(e, 2)
    want = codec.from_fixed(sum(codec.to_fixed(x, scales, chunk=E).to(torch.int64) for x in xs), scales, chunk=E)
    for out, _ in res:
        assert torch.equal(out, want)


def _modelled_calls(ctx):
    """Two float calls of 200,000 values (a look-ahead of 391 lanes: 4 SHORT messages each way) on the switch
    with its default lanes: per call the sum, the ledger's bytes sent and received and the lanes."""
    t = sc.transports.get("switch", ctx.fabric)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(ctx.rank)) * (ctx.rank + 1)
    out = []
    for _ in range(2):
        y = t.allreduce(x)
        out.append((y, t.last_stats.bytes_sent, t.last_stats.bytes_received,
                    t._float_lanes(-(-x.numel() // t.slot_elems))[0], t.slot_elems))
    return out


def test_a_simfabric_with_real_messages_sends_the_look_ahead_header_only_and_sums_as_the_codec():
    """A host model with a cost per message gives the SimFabric a real fabric's messages (docs/netbed.md, "Host
    costs"), and with them the real fabric's header-only look-ahead (``SHORT`` messages both ways, answered by
    the modelled switch as a real port answers them): per call each worker sends and receives the agreement
    header, a whole control packet, the codes in whole packets and a header per look-ahead lane and per message
    of them, not a whole packet per lane (the model charged 2.2 MB more a step for the 4.4 MB MLP, 18 ms of a
    1 Gbit/s link); the sums are the codec's bit for bit."""
    host = sc.HostModel(send_message_s=1e-5, recv_message_s=1e-5)
    res = sc.launch(_modelled_calls, 2, network=sc.Network(bandwidth_gbps=1.0, latency_us=50.0, host=host))
    E = res[0][0][4]
    xs = [torch.randn(200_000, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(2)]
    want = _fixed_point_sum_of(xs, E)
    for calls in res:
        for y, sent, received, lanes, elems in calls:
            assert torch.equal(y, want)
            chunks = -(-200_000 // elems)
            assert lanes == -(-chunks // 2) and lanes < chunks
            codes = chunks * (HEADER + elems) * 4
            control, agreement = (HEADER + elems) * 4, 272
            look_ahead = (lanes + 4) * HEADER * 4        # a header per lane, and one per message (4 a window)
            assert sent == received == agreement + control + codes + look_ahead, (sent, received)


def _fixed_point_sum_of(xs: list[torch.Tensor], E: int) -> torch.Tensor:
    e = torch.stack([codec.chunk_exponents(x, E).clamp_min(-126) for x in xs]).max(dim=0).values
    scales = codec.scale_from_exponents(e, len(xs))
    return codec.from_fixed(sum(codec.to_fixed(x, scales, chunk=E).to(torch.int64) for x in xs), scales, chunk=E)


def test_on_a_simfabric_with_real_messages_a_short_message_whose_count_no_buffer_holds_stops_every_rank():
    """The modelled switch takes a ``SHORT`` message as a real port does: a count past the burst is malformed,
    reported to every worker, and every rank stops naming the worker it came from (no hang, no wrong sum)."""
    host = sc.HostModel(send_message_s=1e-5, recv_message_s=1e-5)
    res = sc.launch(_forged_count, 2, network=sc.Network(bandwidth_gbps=1.0, latency_us=50.0, host=host),
                    timeout_s=30.0)
    assert all(good for good, _ in res), res
    got = [o for _, o in res]
    assert [o[0] for o in got] == ["MalformedMessage"] * 2, got
    assert all("worker 1" in o[1] for o in got), got
