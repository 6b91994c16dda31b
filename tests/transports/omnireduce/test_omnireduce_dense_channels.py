"""OmniReduce's channels per aggregator of a repeated colocated call on a real fabric (:meth:`OmniReduce.channels_for`):
a call whose union, the last time it was made, held at least ``message_bytes`` in an aggregator's range runs two
channels; a sparse one keeps one; the first one (no record) keeps today's rule, one. The union is noted in the fold
record (:meth:`sparsecomm.transports._fold.Schedule.note`), the same on every worker, so a worker whose own density
differs changes nothing; workers that still differ on the channels get a MismatchError, never a hang; an error clears
the note with the record. The sums are the same, bit for bit, as on one channel.

On 2 workers one channel is 5 messages a call (header, first look-aheads, blocks, verdict, sums), two channels 7
(blocks and sums per channel), plus the agreement handshake's 1 where the call is not predicted."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import MismatchError
from sparsecomm.transports import _fold
from sparsecomm.fabric.sim.sim_host import HostModel

NUMEL = 600_001         # 2345 blocks of 256 (the last one short): 1172-1173 per aggregator, 1.15 MB >= 1 MiB


def _dense(rank: int, k: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * k + rank))


def _sparse(rank: int, k: int) -> torch.Tensor:
    """Every 100th block (from block ``rank``) non-zero: density 0.01, in both halves of every aggregator's range."""
    x = torch.zeros(NUMEL)
    rows = x[: NUMEL // 256 * 256].view(-1, 256)
    rows[rank::100] = _dense(rank, k)[: rows[rank::100].numel()].view(-1, 256)
    return x


def _checks(ctx):
    r, f = ctx.rank, ctx.fabric
    t = sc.transports.get("omnireduce", f)
    one = sc.transports.get("omnireduce", f, channels=1)
    sched = _fold.schedule(f)
    problems = []

    def call(make, k, tag):
        x = make(r, k)
        y = t.allreduce(x.clone())
        msgs = t.last_stats.messages
        ref = one.allreduce(x.clone())
        if not torch.equal(y, ref):
            problems.append((tag, k, "sums differ from one channel's"))
        return msgs

    # dense: the first call (no record) one channel and the handshake, then two channels, folded once predicted
    got = [call(_dense, k, "dense") for k in range(6)]
    if got[0] != 6 or any(m not in (7, 8) for m in got[1:]) or got[-1] != 7 or sched.folded < 1:
        problems.append(("dense channels", got, sched.folded))
    # a worker whose own density differs (rank 1 sparse, rank 0 dense): the union is dense, both run two channels
    mk = _dense if r == 0 else _sparse
    got = [call(mk, k, "mixed") for k in range(3)]
    if any(m not in (7, 8) for m in got):
        problems.append(("mixed densities", got))
    # sparse (another length: a call of its own): one channel throughout
    s = sc.transports.get("omnireduce", f)
    got = []
    for k in range(5):
        x = _sparse(r, k)[:NUMEL - 1]
        y = s.allreduce(x.clone())
        got.append(s.last_stats.messages)
        if not torch.equal(y, one.allreduce(x.clone())):
            problems.append(("sparse sums", k))
    if any(m not in (5, 6) for m in got[1:]):      # (the first joins the predicted dense call: a deviator's)
        problems.append(("sparse channels", got))
    return problems


@pytest.mark.multiprocess
def test_repeated_dense_call_runs_two_channels_and_a_sparse_one_keeps_one():
    assert sc.launch(_checks, 2, backend="gloo", timeout_s=60) == [[], []]


def _disagree(ctx):
    """Rank 1 decides one channel where rank 0 decides two (as if its record differed): a MismatchError on both, then
    the record is clear on both (one channel again), and two once the call is made again."""
    r, f = ctx.rank, ctx.fabric
    t = sc.transports.get("omnireduce", f)
    x = _dense(r, 0)
    for _ in range(6):
        t.allreduce(x.clone())
    before = t.last_stats.messages
    if r == 1:
        t.channels_for = lambda numel, itemsize=4, union_blocks=None: 1
    try:
        t.allreduce(x.clone())
        err = None
    except MismatchError as e:
        err = str(e)
    if r == 1:
        del t.channels_for
    after = []
    for _ in range(2):
        t.allreduce(x.clone())
        after.append(t.last_stats.messages)
    return before, err, after


@pytest.mark.multiprocess
def test_workers_that_differ_on_the_channels_get_a_mismatch_error_and_the_note_is_cleared():
    out = sc.launch(_disagree, 2, backend="gloo", timeout_s=60)
    for before, err, after in out:
        assert before == 7                              # predicted, two channels
        assert err is not None and "channels" in err    # the field that differs, on every worker
        assert after == [6, 8]                          # the record cleared: one channel, then two (unpredicted)


def _rule(ctx, numel=NUMEL):
    t = sc.transports.get("omnireduce", ctx.fabric)
    per = (1 << 20) // (256 * 4)      # blocks of one aggregator's range holding message_bytes in float32
    return (ctx.fabric.message_bytes, t.channels_for(numel), t.channels_for(numel, 4, per),
            t.channels_for(numel, 4, per - 1), t.channels_for(numel, 2, per), t.channels_for(numel, 2, 2 * per))


def test_channels_for_two_only_for_a_noted_union_of_message_bytes_per_aggregator():
    """(A SimFabric whose host model charges per message declares a real fabric's ``message_bytes``.)"""
    real = sc.Network(host=HostModel(send_message_s=1e-5, recv_message_s=1e-5))
    assert sc.launch(_rule, 2, backend="sim", network=real)[0] == (1 << 20, 1, 2, 1, 1, 2)
    # three workers: only a tensor of whole blocks (the split would reorder an in-place short block's additions)
    assert sc.launch(_rule, 3, backend="sim", network=real)[0] == (1 << 20, 1, 1, 1, 1, 1)
    whole = functools.partial(_rule, numel=3 * 256 * 2048)
    assert sc.launch(whole, 3, backend="sim", network=real)[0] == (1 << 20, 1, 2, 1, 1, 2)
    # a modelled network without a host model keeps two whatever the record
    assert sc.launch(_rule, 2, backend="sim")[0][1:] == (2, 2, 2, 2, 2)
