"""What an OmniReduce call keeps per peer on the SimFabric: at thousands of simulated workers each byte held per
(worker, aggregator) pair is megabytes per worker, so the structures that exist once per pair are bounded: no
mailbox queue or posted-receive list outlives its messages, a one-round channel holds no array of its own once
its blocks are sent, a worker's result remembers its written blocks as one mask, an aggregator reads its workers'
headers from one table, and a completed send's buffer is not kept."""

from __future__ import annotations

import functools

import numpy as np
import torch

import sparsecomm as sc
from sparsecomm.fabric.roles import Outbox, Pool
from sparsecomm.transports.omnireduce import aggregator, core, wire
from sparsecomm.transports.omnireduce.blocks import BlockSink


def _call(ctx, density: float):
    t = sc.transports.get("omnireduce", ctx.fabric)
    x = torch.zeros(1 << 14)
    gen = torch.Generator().manual_seed(ctx.rank)
    blocks = x.view(-1, 256)
    keep = torch.rand(blocks.shape[0], generator=gen) < density
    blocks[keep] = torch.randn(int(keep.sum()), 256, generator=gen)
    y = t.allreduce(x)
    world = ctx.fabric.world
    ctx.fabric.barrier()
    ep = world.endpoints[ctx.rank]
    return y.sum().item(), len(ep.mailbox), len(ep.posted)


def _dense_input(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _dense(ctx, numel: int, inplace: bool):
    t = sc.transports.get("omnireduce", ctx.fabric, inplace=inplace)
    return t.allreduce(_dense_input(ctx.rank, numel))


def test_a_dense_calls_blocks_are_not_copied_by_the_simfabric(monkeypatch):
    # a colocated worker's round-0 blocks of a one-round channel are views of its input, sent ``stable``: the
    # SimFabric keeps them by reference, not as a copy each until its aggregator takes it (at n workers, (n-1)/n
    # of every worker's input held twice until the takes; 4 MiB a worker for 1M float32). Counted: the bytes the
    # SimFabric's sends copy (Tensor.clone called from sim.py), below the blocks' bytes (the code before: above)
    import os
    import sys
    copied, sim_py = [], os.path.join("fabric", "sim", "sim.py")
    clone = torch.Tensor.clone

    def counting_clone(self, *args, **kwargs):
        out = clone(self, *args, **kwargs)
        if sys._getframe(1).f_code.co_filename.endswith(sim_py):
            copied.append(out.nbytes)
        return out

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    n, numel = 4, 1 << 14
    blocks = (n - 1) * numel * 4                # every worker's blocks to the n-1 other aggregators
    results = {}
    for inplace in (False, True):
        copied.clear()
        results[inplace] = sc.launch(functools.partial(_dense, numel=numel, inplace=inplace), n, backend="sim")
        assert 0 < sum(copied) < blocks
        # the workers' round-0 header and look-aheads are not copied either (``stable`` too): what is left are
        # the aggregators' replies, at most two messages (header, sums) to each worker (the code before: 68)
        assert len(copied) <= 2 * n * (n - 1)
    monkeypatch.undo()
    # the in-place call writes its source (its result) only once the blocks are taken: every worker the same sums,
    # those of the inputs (the two calls add in another order: equal to rounding)
    want = sum(_dense_input(r, numel) for r in range(n))
    for inplace, got in results.items():
        assert all(torch.equal(got[0], r) for r in got)
        torch.testing.assert_close(got[0], want)


def test_no_mailbox_queue_or_posted_list_outlives_its_messages():
    # a call between n workers puts messages on a few tags from every peer: 7 (source, tag) channels per peer
    # at every endpoint, which the old mailbox kept for ever as empty deques (760 bytes each)
    for density in (1.0, 0.05):
        res = sc.launch(functools.partial(_call, density=density), 6, backend="sim")
        assert len({r[0] for r in res}) == 1
        assert [r[1:] for r in res] == [(0, 0)] * 6


def test_a_one_round_channel_holds_no_array_of_its_own_once_sent():
    mask = np.zeros(64, dtype=bool)
    mask[[3, 9, 10, 40]] = True
    ch = wire.Channel(0, 0, 8, 40, 40)          # one block per lane: blocks 8..47
    c = core.WorkerChannel(ch, mask)
    old_mine = np.where(mask[8:48], np.arange(40), 40)      # what it held before: made when asked now
    assert c.mine.tolist() == old_mine.tolist() and c.pending0() == 3
    b, look = c.take_up()
    assert b.tolist() == [1, 2, 32] and look.tolist() == [40, 40, 40]
    assert c.held0.size == 0 and not c.held0.flags.writeable            # (shared, read-only)
    assert c.mine.tolist() == [40] * 40 and not c.mine.flags.writeable
    c.start(None)
    assert not c.active and c.act is c.cur and not c.act.flags.writeable
    assert not hasattr(c, "__dict__")


def test_a_sink_remembers_its_written_blocks_as_one_mask():
    out = torch.zeros(10 * 4 + 3)
    sink = BlockSink(out, 4)
    for ids in (np.arange(2, 5), np.array([9, 0]), np.array([10]), np.arange(3, 6)):
        sink.write(ids, torch.ones(ids.size, 4))
    sink.mark(np.array([7]))
    assert sink.written_ids().tolist() == [0, 2, 3, 4, 5, 7, 9, 10]
    assert out.view(-1)[40:].tolist() == [1.0, 1.0, 1.0]
    assert not hasattr(sink, "written")         # (no list of the writes' index arrays: n of them per call)


def test_an_aggregator_reads_its_workers_headers_from_one_table(monkeypatch):
    # every aggregator of the call keeps its headers as one (workers, words) table, and not a second copy per
    # worker past the verdict
    seen = []
    take = aggregator.AggCall.take_headers

    def spy(self, inbox):
        out = take(self, inbox)
        seen.append((type(self.headers), self.headers.shape if isinstance(self.headers, np.ndarray) else None,
                     len(self._words), self.k0.base is not None))
        return out

    monkeypatch.setattr(aggregator.AggCall, "take_headers", spy)
    sc.launch(functools.partial(_call, density=1.0), 4, backend="sim")
    assert seen == [(np.ndarray, (4, wire.HDR), 0, True)] * 4


class _Done:
    def is_completed(self):
        return True

    def wait(self, timeout=None):
        return None


class _Open(_Done):
    def is_completed(self):
        return False


class _Fabric:
    def __init__(self, work):
        self.work = work

    def isend(self, buf, dst, tag):
        return self.work

    def wait_all(self, works):
        for w in works:
            w.wait()


def test_a_completed_sends_buffer_is_not_kept_and_an_open_ones_is():
    buf = torch.ones(4)
    done, open_ = Outbox(_Fabric(_Done()), Pool()), Outbox(_Fabric(_Open()), Pool())
    done.send(buf, 1, 0, deferrable=True)
    open_.send(buf, 1, 0, deferrable=True)
    assert done.pending[0][1] is None and open_.pending[0][1] is buf
