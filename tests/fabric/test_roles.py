"""Roles, what a fabric runs (:mod:`sparsecomm.fabric.roles`): a protocol that is not OmniReduce, with stages of
its own, runs on ``Fabric.drive`` of a SimFabric; the scheduler resumes the role whose messages come first in
modelled time among those able to run, a role that can never run is an error naming the endpoint, and a
``Flush`` waits for the sends holding a buffer before its role goes on."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import ProtocolError
from sparsecomm.fabric.base import Fabric
from sparsecomm.fabric.sim.sim import SimWorld
from sparsecomm.fabric.roles import (Flush, Hand, Inbox, Outbox, Poll, Pool, Post, PostInto, Recv, Send, SendEach, Spawn,
                                     Step)


class OwnStage(NamedTuple):
    """A stage of the test's protocol: ordered by ``phase``; never sure, never reaping."""

    phase: int
    sure: bool = False
    reaps: bool = False


def _exchange(ctx, delays: list[float]) -> list[tuple[int, float]]:
    """Every worker sends its rank to every other after ``delays[rank]`` modelled seconds; one role per peer
    receives it. Returns the (peer, value) pairs in the order the roles took them."""
    f: Fabric = ctx.fabric
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    got = []

    def receiver(peer: int):
        yield Post(("v", peer), 4, peer, 5)
        yield Recv((("v", peer),), OwnStage(phase=1))
        got.append((peer, inbox.take(("v", peer)).view(torch.float32).item()))

    def sender():
        f.compute(delays[f.rank])
        for peer in range(f.world_size):
            if peer != f.rank:
                yield Send(torch.tensor([float(f.rank)]).view(torch.uint8), peer, 5)
        yield Spawn(local())

    def local():   # a hand-over: in at once, preferred to nothing (phase 0 comes first)
        yield Hand("me", float(f.rank))
        yield Recv(("me",), OwnStage(phase=0))
        got.append((f.rank, inbox.take("me")))

    f.drive([receiver(p) for p in range(f.world_size) if p != f.rank] + [sender()], inbox, outbox)
    outbox.finish()
    return got


def test_roles_of_another_protocol_run_on_the_sim_fabric_in_modelled_arrival_order():
    # worker 1 sends 1 ms late, the others at once: worker 0 takes 2's message before 1's, though its role
    # for 1 began to wait first; every worker takes its own hand-over (an earlier phase) first of all
    delays = [0.0, 1e-3, 0.0]
    out = sc.launch(lambda ctx: _exchange(ctx, delays), 3, network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out[0] == [(0, 0.0), (2, 2.0), (1, 1.0)]
    assert out[1] == [(1, 1.0), (0, 0.0), (2, 2.0)]
    assert out[2] == [(2, 2.0), (0, 0.0), (1, 1.0)]


def test_a_role_that_can_never_run_names_the_endpoint():
    def stuck(ctx):
        pool = Pool()
        inbox = Inbox(ctx.fabric, pool)

        def role():
            yield Recv((("never",),), OwnStage(phase=0))

        ctx.fabric.drive([role()], inbox, Outbox(ctx.fabric, pool))

    with pytest.raises(ProtocolError, match="endpoint 0: no role of this call can run"):
        sc.launch(stuck, 1)


def test_every_fabric_runs_the_same_scheduler(monkeypatch):
    # TorchFabric blocks in the waits of roles.schedule (Fabric.drive); the SimFabric makes them events of
    # its loop: both run that one scheduler for several roles (a drive's only role, on the SimFabric, runs in
    # its driver by the same rules: the next tests)
    from sparsecomm.fabric import roles
    from sparsecomm.fabric.torch.torch_fabric import TorchFabric

    assert TorchFabric.drive is Fabric.drive
    calls = []
    real = roles.schedule

    def counted(fabric, *a, **k):
        calls.append(type(fabric).__name__)
        return real(fabric, *a, **k)

    monkeypatch.setattr(roles, "schedule", counted)
    sc.launch(lambda ctx: _ring(ctx, torch.ones(64), rival=True), 2)
    assert calls and set(calls) == {"SimFabric"}


def _nothing():
    """A role that returns at once: beside another, it makes a drive one of several roles (the scheduler's)."""
    return
    yield


def _ring(ctx, x: torch.Tensor, rival: bool) -> tuple:
    """The ring's role on ``x`` (the sum, and this endpoint's modelled clock after it), alone in its drive or,
    ``rival``, beside a role that returns at once (the scheduler then runs it)."""
    from sparsecomm.transports.ring import ring_role

    f, pool = ctx.fabric, Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    acc = x.clone()
    f.drive([ring_role(f, acc, inbox, segment=250)] + ([_nothing()] if rival else []), inbox, outbox)
    outbox.finish()
    return acc, f.now()


def test_the_sim_fabrics_only_role_runs_as_the_scheduler_would_run_it(monkeypatch):
    # the SimFabric's driver runs a drive's only role itself: the same sums and modelled clocks, to the bit,
    # as when the scheduler runs it (beside a role that returns at once)
    from sparsecomm.fabric import roles

    calls = []
    real = roles.schedule

    def counted(fabric, *a, **k):
        calls.append(type(fabric).__name__)
        return real(fabric, *a, **k)

    monkeypatch.setattr(roles, "schedule", counted)
    net = sc.Network(bandwidth_gbps=1, latency_us=3)
    x = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(5)]
    alone = sc.launch(lambda ctx: _ring(ctx, x[ctx.rank], rival=False), 5, network=net)
    assert calls == []          # (no scheduler: the driver ran the role)
    beside = sc.launch(lambda ctx: _ring(ctx, x[ctx.rank], rival=True), 5, network=net)
    assert len(calls) == 5
    for (a, ta), (b, tb) in zip(alone, beside):
        assert torch.equal(a, b) and ta.hex() == tb.hex()
    assert torch.allclose(alone[0][0], sum(x), atol=1e-5) and alone[0][1] > 0


def _spawner(ctx, rival: bool) -> tuple:
    """Endpoint 0's role receives endpoint 1's first message, then spawns a role that receives its second
    (sent later, on another tag) and hands it back; with ``rival``, beside a role that returns at once. Returns
    what endpoint 0's roles took, in order, with its modelled clock then, and its clock at the end."""
    f, pool = ctx.fabric, Pool()
    if f.rank:
        f.send(torch.tensor([1.0]).view(torch.uint8), 0, 1)
        f.compute(1e-3)
        f.send(torch.tensor([2.0]).view(torch.uint8), 0, 2)
        f.recv(torch.empty(100_000, dtype=torch.uint8), 0, 3)
        return [], f.now()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    got = []

    def helper():
        yield Post("second", 4, 1, 2)
        yield Recv(("second",), OwnStage(phase=0))
        yield Hand("back", inbox.take("second").view(torch.float32).item())

    def main():
        yield Send(torch.zeros(100_000, dtype=torch.uint8), 1, 3, hold="big")
        yield Flush("big")          # (the clock moves to the end of that send: 0.8 ms at 1 Gbit/s)
        yield Post("first", 4, 1, 1)
        yield Recv(("first",), OwnStage(phase=1))
        got.append((inbox.take("first").view(torch.float32).item(), f.now().hex()))
        yield Spawn(helper())
        yield Recv(("back",), OwnStage(phase=1))
        got.append((inbox.take("back"), f.now().hex()))

    f.drive([main()] + ([_nothing()] if rival else []), inbox, outbox)
    outbox.finish()
    return got, f.now()


def test_the_sim_fabrics_only_role_that_spawns_goes_on_under_the_scheduler():
    # alone until its Spawn, then the scheduler runs it with the role it spawned: the same takes and clocks
    net = sc.Network(bandwidth_gbps=1, latency_us=3)
    alone = sc.launch(lambda ctx: _spawner(ctx, rival=False), 2, network=net)
    beside = sc.launch(lambda ctx: _spawner(ctx, rival=True), 2, network=net)
    assert [v for v, _ in alone[0][0]] == [1.0, 2.0] and float.fromhex(alone[0][0][0][1]) >= 8e-4
    assert [(g, t.hex()) for g, t in alone] == [(g, t.hex()) for g, t in beside]


def test_an_error_of_the_sim_fabrics_only_role_names_it():
    def role(inbox):
        yield Post("k", 4, 1, 1)
        raise RuntimeError("boom")

    def fn(ctx):
        pool = Pool()
        inbox = Inbox(ctx.fabric, pool)
        ctx.fabric.drive([role(inbox)], inbox, Outbox(ctx.fabric, pool))

    with pytest.raises(RuntimeError, match="boom") as info:
        sc.launch(fn, 2)
    assert any("raised by role test_an_error_of_the_sim_fabrics_only_role_names_it.<locals>.role of endpoint"
               in n for n in getattr(info.value, "__notes__", []))


class _LoggedWork:
    """A send of a fake fabric that never completes by itself; its waits go to ``log``."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self, timeout=None):
        self.log.append(f"wait {self.name}")

    def is_completed(self):
        return False


def test_flush_waits_for_the_sends_holding_a_buffer_before_the_role_goes_on():
    log = []

    class _Fabric:
        rank, world_size = 0, 2
        wait_all = Fabric.wait_all      # (the contract's generic version: each work's wait, in order)

        def isend(self, buf, dst, tag, *, reliable=True):
            return _LoggedWork(log, f"send {tag}")

    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)

    def role():
        yield Send(torch.zeros(1), 1, 1, hold="a")
        yield Send(torch.zeros(1), 1, 2, hold="b")
        yield Send(torch.zeros(1), 1, 3, hold="a")
        yield Flush("a")
        log.append("flushed a")
        assert [w.name for w in pool.busy("b")] == ["send 2"] and pool.busy("a") == []

    Fabric.drive(f, [role()], inbox, outbox)   # (the generic scheduler, on a fake fabric)
    assert log == ["wait send 1", "wait send 3", "flushed a"]
    outbox.finish()
    assert log[3:] == ["wait send 1", "wait send 2", "wait send 3"]


def test_send_each_is_a_send_per_endpoint_each_held_and_recorded_even_after_an_error():
    """On a fabric with the contract's generic ``isend_each`` (an ``isend`` per endpoint, in order), a ``SendEach``
    makes the sends a ``Send`` per endpoint makes, each held under its buffer's role and reaped by its own
    ``deferrable``; a send that raises leaves those started before it held and finished."""
    log = []

    class _Fabric:
        rank, world_size = 0, 4
        wait_all = Fabric.wait_all
        isend_each = Fabric.isend_each      # (the contract's generic version)

        def isend(self, buf, dst, tag, *, reliable=True):
            if dst == 9:
                raise ValueError("no endpoint 9")
            return _LoggedWork(log, f"{dst}.{tag}")

    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)

    def role():
        yield SendEach(torch.zeros(1), (3, 1), 7, hold="a", deferrable=True)
        yield Send(torch.zeros(1), 2, 8, hold="a")
        assert [w.name for w in pool.busy("a")] == ["3.7", "1.7", "2.8"]
        yield SendEach(torch.zeros(1), (2, 9, 1), 6, hold="b")

    with pytest.raises(ValueError, match="no endpoint 9"):
        Fabric.drive(f, [role()], inbox, outbox)
    assert [w.name for w in pool.busy("b")] == ["2.6"]
    outbox.reap(keep=0)                 # (the deferrable ones are left to finish)
    assert log == ["wait 2.8", "wait 2.6"]
    outbox.finish()
    assert log[2:] == ["wait 3.7", "wait 1.7"]


def test_the_only_role_waits_in_place_once_per_recv_around_a_rarer_request():
    # one role, none spawned: the scheduler performs its requests in its own frame and yields one WaitAll per
    # Recv; a rarer request (a Poll) hands the role to the general path, which must do the same
    from sparsecomm.fabric import roles
    from sparsecomm.fabric.roles import Poll, Step

    class Local:
        rank = 0

    inbox = Inbox(Local(), Pool())
    outbox = Outbox(Local(), inbox.pool)
    got = []

    def role():
        for i, key in enumerate(("a", "b", "c", "d")):
            yield Hand(key, i)
            yield Recv((key,), Step())
            got.append(inbox.take(key))
            if key == "b":
                yield Poll()

    waits = []
    for req in roles.schedule(Local(), inbox, outbox, [role()]):
        assert isinstance(req, roles.WaitAll)
        waits.append(req.keys)
        assert len(waits) <= 4, f"the scheduler waits again on {req.keys} (it went round on one Recv)"
    assert waits == [("a",), ("b",), ("c",), ("d",)] and got == [0, 1, 2, 3]


def _gather_any(ctx, rival: bool) -> list:
    """Endpoints 1, 2, 3 each send endpoint 0 one message, 3, 1 and 2 ms late; endpoint 0 takes them in one role
    that waits ``any`` on the keys left and takes the key it is resumed with, and nothing else. ``rival``: a
    second role, preferred, waits for endpoint 4's message, which comes last (10 ms): the choices are then the
    scheduler's among two roles, by arrival; alone, the role waits in place (the first key left, blocking).
    Returns endpoint 0's takes (the key each wake was resumed with) and whether each was in when resumed."""
    f = ctx.fabric
    if f.rank:
        f.compute([0, 3e-3, 1e-3, 2e-3, 10e-3][f.rank])
        if f.rank < 4 or rival:
            f.send(torch.ones(1).view(torch.uint8), 0, 7 if f.rank < 4 else 8)
        return []
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    taken = []

    def gather():
        left = dict.fromkeys(("k", src) for src in (1, 2, 3))
        for k in left:
            yield Post(k, 4, k[1], 7)
        while left:
            k = yield Recv(tuple(left), OwnStage(phase=1), any=True)
            taken.append((k, inbox.ready(k)))
            del left[k]
            inbox.take(k)

    def late():
        yield Post("z", 4, 4, 8)
        yield Recv(("z",), OwnStage(phase=0))
        taken.append(("z", inbox.ready("z")))
        inbox.take("z")

    f.drive([gather(), late()] if rival else [gather()], inbox, outbox)
    outbox.finish()
    return taken


@pytest.mark.parametrize("rival", [True, False])
def test_an_any_role_is_resumed_with_the_key_whose_arrival_chose_it(rival):
    # on the SimFabric: with two roles, the keys in the order their messages arrive (2, 3, 1), each in when the role
    # is resumed with it; the only role waits in place on the first key left (1, then 2 and 3, in by then)
    out = sc.launch(lambda ctx: _gather_any(ctx, rival), 5, network=sc.Network(bandwidth_gbps=100, latency_us=2))
    if rival:
        assert out[0] == [(("k", 2), True), (("k", 3), True), (("k", 1), True), ("z", True)]
    else:
        assert out[0] == [(("k", 1), True), (("k", 2), True), (("k", 3), True)]


def test_an_any_role_on_a_blocking_driver_is_resumed_with_the_first_key_in_else_the_first():
    # the generic (blocking) driver, on a fake fabric where only c's message is in: c first, then, none in, the
    # first key left (a, whose take blocks), then b; each wake looks at the keys only up to the first in
    looked = []

    class _Work:
        def __init__(self, name, done):
            self.name, self.done = name, done

        def is_completed(self):
            looked.append(self.name)
            return self.done

        def wait(self, timeout=None):
            self.done = True

    class _Fabric:
        rank, world_size = 0, 4

        def irecv(self, buf, src, tag):
            return _Work("abc"[src - 1], src == 3)

    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    got = []

    def role():
        left = dict.fromkeys("abc")
        for src, k in enumerate(left, 1):
            yield Post(k, 4, src, 1)
        while left:
            k = yield Recv(tuple(left), OwnStage(phase=0), any=True)
            got.append(k)
            del left[k]
            inbox.take(k)

    Fabric.drive(f, [role()], inbox, outbox)
    assert got == ["c", "a", "b"]
    assert looked == ["a", "b", "c", "a", "b", "b"]


def test_an_any_wait_on_the_keys_left_goes_on_with_the_watch_it_had(monkeypatch):
    # a role that waits any on n keys and then, woken, on the n - 1 left (as an OmniReduce aggregator takes its
    # headers) is resumed with the key whose group the wait chose, and its next wait goes on with the scheduler's
    # watch of the keys left: suspending and resuming it hash no key but the one taken (a fresh watch per wake
    # would hash every key left: O(n^2) over the n wakes)
    from sparsecomm.fabric import roles

    n, hashed, counting = 40, [0], [False]

    class K:
        def __init__(self, i):
            self.i = i

        def __hash__(self):
            hashed[0] += counting[0]
            return self.i

    class _Work:
        done = False

        def is_completed(self):
            return self.done

        def wait(self, timeout=None):
            self.done = True

    class _Fabric:
        rank, world_size = 0, 2

        def irecv(self, buf, src, tag):
            return _Work()

    for name in ("wait", "forget"):
        real = getattr(roles._Scheduler, name)

        def spy(self, *a, _real=real):
            counting[0] = True
            try:
                return _real(self, *a)
            finally:
                counting[0] = False

        monkeypatch.setattr(roles._Scheduler, name, spy)
    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    keys, got = [K(i) for i in range(n)], []

    def gather():
        for k in keys:
            yield Post(k, 1, 1, 0)
        left = dict.fromkeys(keys)
        while left:
            k = yield Recv(tuple(left), OwnStage(phase=1), any=True)
            got.append(k)
            del left[k]
            inbox.take(k)

    def other():                # a second role able to run: the choices are WaitAny's
        yield Post("z", 1, 1, 1)
        yield Recv(("z",), OwnStage(phase=2))
        inbox.take("z")

    sched, value = roles.schedule(f, inbox, outbox, [gather(), other()]), None
    arrivals = keys[::-1] + ["z"]       # the messages come in reverse order, z last
    while True:
        try:
            req = sched.send(value)
        except StopIteration:
            break
        value = None
        if isinstance(req, roles.WaitAny):
            w = inbox.work(arrivals[len(got) + (len(got) == n)])
            w.done = True
            value = [g == [w] for g in req.groups].index(True)
    assert got == keys[::-1]
    assert hashed[0] < 10 * n, hashed[0]


@pytest.mark.parametrize("large", [False, True])
def test_a_blocking_driver_resumes_a_small_sure_role_at_once_and_races_a_large_one(large):
    # the generic (blocking) driver: a preferred role that is not sure waits on "a", a sure one on "b". With b's
    # receive small, the sure role is resumed at once (its take blocks; no wait_any, so no helper thread per
    # receive on gloo), then the other; with b's receive over SURE_BLOCK_BYTES, the two are raced in a
    # wait_any (R3), where the preferred one's message comes first here
    from sparsecomm.fabric.roles import SURE_BLOCK_BYTES

    events = []

    class _Work:
        def __init__(self, name):
            self.name, self.done = name, False

        def is_completed(self):
            return self.done

        def wait(self, timeout=None):
            events.append(("wait", self.name))
            self.done = True

    class _Fabric:
        rank, world_size = 0, 3

        def irecv(self, buf, src, tag):
            return _Work("ab"[src - 1])

        def wait_any(self, groups):
            events.append(("wait_any", len(groups)))
            for w in groups[0]:
                w.wait()
            return 0

    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    taken = []

    def preferred():
        yield Post("a", 4, 1, 1)
        yield Recv(("a",), OwnStage(phase=0))
        taken.append("a")
        inbox.take("a")

    def sure():
        yield Post("b", SURE_BLOCK_BYTES + 1 if large else SURE_BLOCK_BYTES, 2, 1)
        yield Recv(("b",), OwnStage(phase=1, sure=True))
        taken.append("b")
        inbox.take("b")

    Fabric.drive(f, [preferred(), sure()], inbox, outbox)
    if large:
        assert taken == ["a", "b"] and events[0] == ("wait_any", 2)
    else:
        assert taken == ["b", "a"] and events == [("wait", "b"), ("wait", "a")]


def test_an_inbox_reports_only_the_keys_its_observer_watches():
    """Inbox.observe with ``watched``: posts, puts, replacements and takes of a watched key are reported (the
    container looked up as it is then), those of any other key are not; without it, every key is."""
    f = SimWorld(2).fabric(0)
    for watched in ({"a": 1}, None):
        inbox = Inbox(f, Pool())
        seen = []
        inbox.observe(lambda k, p: seen.append((k, p)), watched)
        inbox.put("a", torch.zeros(1))
        inbox.put("b", torch.zeros(1))
        inbox.put("a", torch.zeros(1))
        if watched is not None:
            watched["b"] = 1            # (watched from now on)
        inbox.take("b")
        inbox.post_into("c", torch.zeros(8), 1, 5)
        inbox.take("a")
        want = [("a", True), ("b", True), ("a", None), ("b", False), ("c", True), ("a", False)]
        assert seen == ([w for w in want if w[0] != "c" and w != ("b", True)] if watched is not None else want)


def test_requests_built_by_new_equal_those_of_their_constructors():
    """``Cls.new(fields)`` (one C call) builds the request its constructor builds from the same fields, of its
    class, with its fields readable by name; the omnireduce keys and buffer roles likewise."""
    from sparsecomm.transports.omnireduce.wire import Buf, Key, Msg
    buf, role = torch.zeros(4), iter(())
    cases = [
        (Send, (buf, 3, 7, "h", True, True)), (SendEach, (buf, (3, 1), 7, "h", True)), (Post, ("k", 16, 2, 9)), (PostInto, ("k", buf, 2, 9)), (Hand, ("k", buf)),
        (Recv, (("a", "b"), Step(1), ("c",), True, "f")), (Poll, (2,)), (Spawn, (role,)), (Flush, ("h",)),
        (Key, (Msg.DOWN, 5, 2)), (Buf, (Msg.UP, 1, 3, 1)),
    ]
    for cls, fields in cases:
        got, want = cls.new(fields), cls(*fields)
        assert type(got) is cls and got == want and hash(got) == hash(tuple(fields))
        assert [getattr(got, f) for f in cls._fields] == list(fields)
    assert Key.new((Msg.REPLY, 4, -1)) == Key(Msg.REPLY, 4)          # (the default slot, written out)
    assert Key.new((Msg.REPLY, 4)) != Key(Msg.REPLY, 4)               # (no default filled in)
