"""Fabric.wait_any: the generic polling version, and SimFabric's ordered one (the receive delivered
first in modelled time, whatever the threads' wall-clock order; list order among those already in)."""

from __future__ import annotations

import time

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import FabricTimeout
from sparsecomm.fabric.base import Fabric, Work

NET = dict(bandwidth_gbps=8.0, latency_us=1.0)   # 1 byte per ns: a 1000-byte message takes 1 us + 1 us


def _run(fn, n=3):
    return sc.launch(fn, n, network=sc.Network(**NET))


def test_sim_takes_the_first_delivered_in_modelled_time_not_wall_time():
    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            bufs = [torch.empty(250), torch.empty(250)]
            works = [f.irecv(bufs[0], 1), f.irecv(bufs[1], 2)]
            i = f.wait_any(works)
            t = f.now()
            works[1 - i].wait()
            return i, t, f.now()
        if ctx.rank == 1:          # first in wall time, but 50 us later in modelled time
            f.compute(50e-6)
            f.send(torch.ones(250), 0)
        else:                      # 0.3 s later in wall time, at modelled time 0
            time.sleep(0.3)
            f.send(torch.ones(250), 0)
        return None

    i, t_first, t_second = _run(fn)[0]
    assert i == 1                                    # worker 2's message: delivered at 2 us
    assert t_first == pytest.approx(2e-6, rel=1e-6)
    assert t_second == pytest.approx(52e-6, rel=1e-6)


def test_sim_keeps_list_order_among_messages_already_delivered():
    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            f.compute(1e-3)                          # both messages are in by now
            bufs = [torch.empty(250), torch.empty(250)]
            works = [f.irecv(bufs[0], 1), f.irecv(bufs[1], 2)]
            i = f.wait_any(works)
            works[1 - i].wait()
            return i
        if ctx.rank == 1:
            f.compute(20e-6)                         # delivered later than worker 2's
        f.send(torch.full((250,), float(ctx.rank)), 0)
        return None

    assert _run(fn)[0] == 0


def test_sim_wait_any_is_deterministic_in_an_omnireduce_run():
    from experiments import reproduce_omnireduce as R

    a = R.run_point(4, 0.1, 10.0, "full", ring=False)
    b = R.run_point(4, 0.1, 10.0, "full", ring=False)
    assert a.omni_s == b.omni_s


def test_sim_rejects_two_receives_on_one_channel():
    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            works = [f.irecv(torch.empty(1), 1), f.irecv(torch.empty(1), 1)]
            with pytest.raises(ValueError, match="two receives"):
                f.wait_any(works)
            for w in works:
                w.wait()
        elif ctx.rank == 1:
            f.send(torch.ones(1), 0)
            f.send(torch.ones(1), 0)
        return True

    assert all(r is not False for r in _run(fn))


class _Flag(Work):
    def __init__(self, at: float) -> None:
        self.at = at
        self.waited = False

    def wait(self, timeout=None):
        self.waited = True
        return None

    def is_completed(self) -> bool:
        return time.monotonic() >= self.at


class _Polling(Fabric):
    """Only what the generic wait_any uses."""

    rank, world_size, timeout_s = 0, 1, 0.5
    send = recv = isend = irecv = service = None


def test_generic_wait_any_polls_and_times_out():
    f = _Polling()
    now = time.monotonic()
    works = [_Flag(now + 3600), _Flag(now + 0.05), _Flag(now + 0.05)]
    assert f.wait_any(works) == 1 and works[1].waited
    with pytest.raises(FabricTimeout):
        f.wait_any([_Flag(now + 3600)])
    with pytest.raises(ValueError):
        f.wait_any([])
