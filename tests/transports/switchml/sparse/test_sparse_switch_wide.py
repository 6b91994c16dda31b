"""The sparse switch past 64 workers: a worker bitmap as wide as the job (64-bit words, one per packet), the
high bits of the worker id and count in the header's slot word; exact sums at 128 workers on SimFabric."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.transports.switchml.sparse import dataplane as dp

from .test_sparse_switch import _union_blocks, blocky


def test_128_workers_sum_exactly_on_the_simfabric():
    n, numel = 128, 256 * 12 + 5

    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=4, switch_slots=16)
        x = blocky(ctx.rank, numel, 0.25)
        y = t.allreduce(x)
        return x, y, t.last_info["stream"], t.config.width, t.dataplane

    out = sc.launch(fn, n, network=sc.Network(bandwidth_gbps=100, latency_us=2))
    want = torch.stack([o[0].to(torch.int64) for o in out]).sum(0)
    assert all(torch.equal(o[1].to(torch.int64), want) for o in out)
    assert {o[3] for o in out} == {128}
    # every union block went round once; each worker sent its own blocks and a skip for the others'
    union = _union_blocks([o[0] for o in out])
    for x, _, info, _, _ in out:
        mine = int(np.count_nonzero(sc.codec.nonzero_blocks(x, 256).numpy()))
        assert (info["data"], info["data"] + info["skips"], info["results"]) == (mine, union, union)
    plane = out[0][4]
    assert plane.seen.shape == (16, 2, 2) and plane.state_bits() == plane.declared_bits()
    assert plane.stats["malformed"] == plane.stats["out_of_step"] == 0


def test_the_header_carries_worker_ids_and_counts_past_64_and_is_unchanged_below():
    for w, n in ((0, 1), (63, 64), (64, 65), (1000, 1024), (1023, 1024)):
        row = np.zeros(dp.HEADER, dtype=np.int32)
        h = dp.Header(dp.T_SKIP, 1, w, n, 7, 5, 3, 9)
        assert dp.Header.of(h.write(row)) == h
        assert (row[dp.F_SLOT] == 5) == (w < 64 and n < 128)     # up to 64 workers: the slot alone, as before


def _pkt(slot, v, w, n, pos, k=64):
    row = np.zeros(dp.HEADER + k, dtype=np.int32)
    dp.Header(dp.T_DATA, v, w, n, 1, slot, pos, pos + 1).write(row)
    row[dp.HEADER:] = 1
    return row


def test_a_wide_program_counts_each_worker_once_and_refuses_what_it_cannot_take():
    plane = dp.Dataplane(dp.SparseSwitchConfig(elems=64, slots=4, workers=192))
    plane.world = 130
    for w in range(130):
        mc, _ = plane.process(_pkt(1, 0, w, 130, 0))
        if w == 64:                    # a duplicate in another word than the first packet's: dropped
            assert plane.process(_pkt(1, 0, 64, 130, 0)) == (None, None) and plane.stats["dropped"] == 1
    assert mc is not None and (mc[dp.HEADER:] == 130).all() and plane.stats["consumed"] == 130
    # the next round of the set opens with the first new packet once every worker moved through the other set
    for w in range(130):
        plane.process(_pkt(1, 1, w, 130, 1))
    assert plane.process(_pkt(1, 0, 129, 130, 2))[0] is None and int(plane.count[1, 0]) == 129
    # out of step: the notice names the round's workers of the refused packet's word
    assert plane.process(_pkt(1, 0, 128, 130, 3)) == (None, None) and plane.stats["out_of_step"] == 1
    notice = dp.rejection(64, 128, 130, dp.OUT_OF_STEP, 1, plane.refused)
    assert dp.refusal(notice) == (1, 3, 2, [129])
    assert dp.Header.of(notice)[2:4] == (128, 130)
    # a job wider than the program, and bits this library never sets in the slot word, are malformed
    narrow = dp.Dataplane(dp.SparseSwitchConfig(elems=64, slots=4))
    assert narrow.process(_pkt(1, 0, 3, 65, 0)) == (None, None) and narrow.stats["malformed"] == 1
    bad = _pkt(1, 0, 3, 4, 0)
    bad[dp.F_SLOT] |= 1 << 27
    assert narrow.process(bad) == (None, None) and narrow.stats["malformed"] == 2


@pytest.mark.parametrize("workers", [0, 65, 1088, True])
def test_the_bitmap_width_is_checked(workers):
    with pytest.raises(ValueError, match="multiple of 64"):
        dp.SparseSwitchConfig(workers=workers)
