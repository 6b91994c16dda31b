"""The ``switch`` transport on real processes: 2 gloo workers and the switch as a launcher-started rank."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError
from sparsecomm.transports.switchml.dataplane import (F_EXP, F_NW, F_PKT, F_SLOT, F_TYPE, F_WORKER, HEADER,
                                                    T_DATA, T_RESULT, TAG_DOWN, TAG_UP)

pytestmark = pytest.mark.multiprocess


def _jobs(ctx):
    t = sc.transports.get("switch", ctx.fabric, pool_size=16, keep_fixed=True)
    out = []
    for k, numel in enumerate((3000, 64 * 40 + 7, 1)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(10 * ctx.rank + k))
        out.append((x, t.allreduce(x), t.last_fixed.sums.clone()))
    ints = t.allreduce(torch.arange(100, dtype=torch.int32) * (ctx.rank + 1))
    bad = torch.ones(10)
    if ctx.rank == 0:
        bad[3] = float("nan")
    try:
        t.allreduce(bad)
        err = None
    except NonFiniteError as e:
        err = str(e)
    # a retransmission timer on a real fabric: the inbox's receives are waited for by polling, so that a
    # wait that times out leaves them this worker's (and the two transports share the switch's inbox)
    timed = sc.transports.get("switch", ctx.fabric, pool_size=16, timeout=0.5)
    y = timed.allreduce(torch.arange(4000, dtype=torch.float32) * (ctx.rank + 1))
    return out, ints, err, t.allreduce(torch.ones(5)), y


def test_switch_over_gloo_consecutive_jobs_and_clean_shutdown():
    res = sc.launch(_jobs, 2, backend="gloo", services=["switch"], timeout_s=60)
    for k in range(3):
        exact = res[0][0][k][0].double() + res[1][0][k][0].double()
        assert torch.equal(res[0][0][k][1], res[1][0][k][1])
        assert torch.equal(res[0][0][k][2], res[1][0][k][2])
        assert (res[0][0][k][1].double() - exact).abs().max() < 1e-5
    for r in res:
        assert torch.equal(r[1], torch.arange(100, dtype=torch.int32) * 3)
        assert r[2] is not None and "NaN" in r[2]
        assert torch.equal(r[3], torch.full((5,), 2.0))
        assert torch.allclose(r[4], torch.arange(4000, dtype=torch.float32) * 3, rtol=1e-6)


def _program(ctx):
    try:
        sc.transports.get("switch", ctx.fabric, slot_elems=64)
        err = None
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    t = sc.transports.get("switch", ctx.fabric)        # adopts the started program
    return err, t.slot_elems, t.burst, _long_message(ctx, t), t.allreduce(torch.ones(1000) * (ctx.rank + 1))


def _long_message(ctx, t):
    """Two bursts in one message (within the switch's receive slack), on slots the transport never uses:
    every row is added, and the switch's results come back as messages of one burst each."""
    k = t.burst
    rows = torch.zeros((2 * k, HEADER + t.slot_elems), dtype=torch.int32)
    rows[:, F_TYPE], rows[:, F_SLOT], rows[:, F_WORKER], rows[:, F_NW] = T_DATA, 1000 + torch.arange(2 * k), ctx.rank, 2
    rows[:, F_PKT], rows[:, F_EXP] = torch.arange(2 * k), -128
    rows[:, HEADER:] = ctx.rank + 1
    ctx.fabric.send(rows, t.switch, TAG_UP)
    got = []
    for _ in range(2):
        buf = torch.zeros((k, HEADER + t.slot_elems), dtype=torch.int32)
        ctx.fabric.recv(buf, t.switch, TAG_DOWN)
        got.append(buf)
    return torch.cat(got)


def test_switch_program_constants_come_from_the_started_switch():
    res = sc.launch(_program, 2, backend="gloo", services=["switch:elems=256,burst=4"], timeout_s=60)
    for err, elems, burst, raw, y in res:
        assert err is not None and err[0] == "IncompatibleError" and "switch:elems=256,burst=4" in err[1]
        assert (elems, burst) == (256, 4) and torch.equal(y, torch.full((1000,), 3.0))
        assert (raw[:, F_TYPE] == T_RESULT).all() and (raw[:, HEADER:] == 3).all()
        assert sorted(raw[:, F_PKT].tolist()) == list(range(8)) and sorted(raw[:, F_SLOT].tolist()) == list(range(1000, 1008))


#: chunks of the window test's float job: above 8 lane windows of 8 bursts of 16 packets, so that the job takes
#: the whole default pool (a float job keeps at most chunks / 2 lanes)
WINDOW_CHUNKS = 3000


def _windows(ctx):
    """One float job on the default pool of a small program (bursts of 16 packets of 64 values) and on an
    explicit pool of four bursts: the pools, the data phase's packets (chunks plus look-ahead lanes), and the
    results and fixed-point sums."""
    x = torch.randn(WINDOW_CHUNKS * 64 - 5, generator=torch.Generator().manual_seed(ctx.rank))
    out = []
    for kw in ({}, {"pool_size": 64}):
        t = sc.transports.get("switch", ctx.fabric, keep_fixed=True, **kw)
        y = t.allreduce(x)
        out.append((t.pool_size, t.burst, t.last_info["data"]["packets"], y, t.last_fixed.sums.clone()))
    return x, out


def test_switch_default_window_is_eight_messages_and_changes_no_number():
    res = sc.launch(_windows, 2, backend="gloo", services=["switch:elems=64,burst=16"], timeout_s=60)
    exact = res[0][0].double() + res[1][0].double()
    for _, ((pool, burst, packets, y, sums), (pool4, _, packets4, y4, sums4)) in res:
        assert (burst, pool, pool4) == (16, 8 * 16, 4 * 16)
        assert (packets, packets4) == (WINDOW_CHUNKS + 8 * 16, WINDOW_CHUNKS + 4 * 16)   # one look-ahead per lane
        assert torch.equal(y, y4) and torch.equal(sums, sums4)        # the lanes change no number
        assert torch.equal(y, res[0][1][0][3])
        assert (y.double() - exact).abs().max() < 1e-5


#: chunks of the MLP's large DDP bucket (1,059,850 values in 256-value packets, experiments/reproduce_training.py)
MLP_CHUNKS = 4141


def _half_job_window(ctx):
    """The MLP's large bucket as one float job on the default program and pool, and on an explicit pool of 64
    lanes: the lanes, the data phase's packets and messages, the results and fixed-point sums."""
    x = torch.randn(MLP_CHUNKS * 256 - 246, generator=torch.Generator().manual_seed(ctx.rank))
    out = []
    for kw in ({}, {"pool_size": 64}):
        t = sc.transports.get("switch", ctx.fabric, keep_fixed=True, **kw)
        y = t.allreduce(x)
        out.append((t.last_info["data"]["packets"], t.last_stats.messages, y, t.last_fixed.sums.clone()))
    return out


def test_switch_default_window_holds_half_a_float_job_in_four_messages():
    """A 4.4 MB float job keeps half its chunks in flight (a window of 2.2 MB, above a message's round trip
    through the switch on a 2-host netbed at 1 Gbit/s; an eighth, 0.55 MB, left the link idle), its
    look-ahead a header per lane: chunks + chunks / 2 packets, the look-ahead in four messages and the data in
    eight of half a window; the same sums as a pool of 64 lanes, bit for bit."""
    res = sc.launch(_half_job_window, 2, backend="gloo", services=["switch"], timeout_s=120)
    half = -(-MLP_CHUNKS // 2)
    for (packets, messages, y, sums), (packets64, _, y64, sums64) in res:
        assert (packets, packets64) == (MLP_CHUNKS + half, MLP_CHUNKS + 64)
        # the agreement header, the control packet, 4 look-ahead messages and ceil(4141 / 518) = 8 of data
        assert messages == 1 + 1 + 4 + 8, messages
        assert torch.equal(y, y64) and torch.equal(sums, sums64)       # the lanes change no number
    assert torch.equal(res[0][0][2], res[1][0][2])
