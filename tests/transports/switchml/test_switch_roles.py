"""The switch as roles: its streams and its SimFabric service are driven by the fabric (``Fabric.drive``), and
the requests the switches add to the roles' (:mod:`sparsecomm.transports.switchml.datagrams`) keep their
contract."""

from __future__ import annotations

import torch

import sparsecomm as sc
from sparsecomm.fabric.roles import Inbox, Outbox, Pool, PostInto, Step
from sparsecomm.fabric.sim.sim import SimFabric
from sparsecomm.transports.switchml.datagrams import Datagram, RecvBy, drive


def test_a_timed_wait_that_ends_first_leaves_its_receive_posted_for_the_message():
    """A ``RecvBy`` whose deadline comes first resumes the role at the deadline (modelled) with the message
    not in; the receive stays posted, and a later wait on the same key takes the message."""

    def fn(ctx):
        f = ctx.fabric
        if f.rank == 1:
            f.compute(5e-3)
            f.send(torch.tensor([7, 8], dtype=torch.int32), 0, 3)
            return None
        pool = Pool()
        inbox, log = Inbox(f, pool), []

        def role():
            buf = torch.zeros(2, dtype=torch.int32)
            yield PostInto("m", buf, 1, 3)
            yield RecvBy("m", Step(), 1e-3)
            log.append((inbox.ready("m"), f.now()))
            yield RecvBy("m", Step(), 1.0)
            log.append((inbox.ready("m"), inbox.take("m").tolist(), f.now()))

        drive(f, inbox, Outbox(f, pool), [role()])
        return log

    log = sc.launch(fn, 2)[0]
    assert log[0] == (False, 1e-3)
    assert log[1][:2] == (True, [7, 8]) and log[1][2] > 5e-3


def test_a_datagram_may_be_lost_and_a_held_one_is_a_blocking_send_once_flushed():
    """``Datagram`` is unreliable (the network model drops some under loss); flushed under its hold, the
    sender's clock stands at the end of its transmission, as after a blocking send."""
    from sparsecomm.fabric.roles import Flush

    def fn(ctx):
        f = ctx.fabric
        k = 200
        if f.rank == 1:
            got = 0
            buf = torch.zeros(1000, dtype=torch.int32)
            while True:
                try:
                    f.recv(buf, 0, 5, timeout=1.0)
                except sc.errors.FabricTimeout:
                    return got
                got += 1
        pool = Pool()
        outbox = Outbox(f, pool)
        ends = []

        def role():
            msg = torch.zeros(1000, dtype=torch.int32)
            for _ in range(k):
                yield Datagram(msg, 1, 5, hold="m")
                yield Flush("m")
                ends.append(f.now())

        drive(f, Inbox(f, pool), outbox, [role()])
        outbox.finish()
        return ends

    ends, got = sc.launch(fn, 2, network=sc.Network(loss=0.2, seed=4, bandwidth_gbps=1.0))
    tx = 4000 * 8 / 1e9
    assert abs(ends[0] - tx) < 1e-12 and all(abs(b - a - tx) < 1e-12 for a, b in zip(ends, ends[1:]))
    assert 100 < got < 200        # about 160 of 200 arrive at 20% loss


def test_the_streams_and_the_simulated_switch_are_driven_by_the_fabric(monkeypatch):
    """Every stream of a job (the control round's and the data's) and the SimFabric's switch run as roles
    that ``Fabric.drive`` runs (the switch, a process of the loop: ``Fabric.drive_process``): no blocking receive
    of their own."""
    calls: list = []
    processes: list = []
    original, original_process = SimFabric.drive, SimFabric.drive_process

    def counted(self, roles, inbox, outbox, **kw):
        calls.append(self.rank)
        return original(self, roles, inbox, outbox, **kw)

    def counted_process(self, roles, inbox, outbox, *args, **kw):
        processes.append(self.rank)
        return original_process(self, roles, inbox, outbox, *args, **kw)

    monkeypatch.setattr(SimFabric, "drive", counted)
    monkeypatch.setattr(SimFabric, "drive_process", counted_process)

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4)
        return t.allreduce(torch.arange(300, dtype=torch.int32) * (ctx.rank + 1))

    out = sc.launch(fn, 3)
    assert all(torch.equal(o, torch.arange(300, dtype=torch.int32) * 6) for o in out)
    assert all(calls.count(r) >= 2 for r in range(3))                  # control round, data (at least)
    assert processes.count(3) == 1 and 3 not in calls                   # the switch (endpoint 3), no thread
