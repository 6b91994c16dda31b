"""The endpoint scheduler (:func:`sparsecomm.fabric.roles.drive`) on its own, with OmniReduce's stages: roles
are generators yielding typed requests; the scheduler runs whichever can, in preference order, lets
others run while one polls, holds a hand-over's consumer back until it is taken (``gone``), and reports
a role that can never run as a bug instead of hanging."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import ProtocolError
from sparsecomm.fabric.roles import Hand, Inbox, Outbox, Pool, Poll, Post, Recv, Send, Spawn, drive
from sparsecomm.transports.omnireduce.stages import Phase, Stage


class _LocalFabric:
    """Enough of a fabric for roles that only hand messages to each other."""

    rank, world_size = 0, 1

    def wait_any(self, groups):
        for i, g in enumerate(groups):
            if all(w.is_completed() for w in g):
                return i
        raise AssertionError("a local-only schedule waited for a fabric operation")

    def host_work(self, op, count, dtype=None):
        """No host model (``Fabric.host_work``)."""


def _run(roles):
    f = _LocalFabric()
    pool = Pool()
    inbox = Inbox(f, pool)
    drive(f, inbox, Outbox(f, pool), roles)
    return inbox


def test_roles_take_turns_by_hand_over_and_preference():
    log = []

    def ping():
        for r in range(3):
            yield Hand(("ping", r), r)
            yield Recv((("pong", r),), Stage(Phase.VERDICT, visit=r))
            log.append(("ping got", _inbox[0].take(("pong", r))))

    def pong():
        for r in range(3):
            yield Recv((("ping", r),), Stage(Phase.HEADERS, round=r))
            log.append(("pong got", _inbox[0].take(("ping", r))))
            yield Hand(("pong", r), 10 + r)

    _inbox = [None]
    f = _LocalFabric()
    pool = Pool()
    _inbox[0] = Inbox(f, pool)
    drive(f, _inbox[0], Outbox(f, pool), [ping(), pong()])
    assert log == [("pong got", 0), ("ping got", 10), ("pong got", 1), ("ping got", 11),
                   ("pong got", 2), ("ping got", 12)]


def test_a_role_that_can_never_run_is_reported_as_a_bug():
    def stuck():
        yield Recv((("never", 0),), Stage(Phase.VERDICT))

    with pytest.raises(ProtocolError, match="no role"):
        _run([stuck()])
    with pytest.raises(ProtocolError, match="asked for"):
        _run([iter([("not", "a request")])])


def test_gone_holds_a_producer_until_its_last_hand_over_is_taken_and_poll_lets_others_run():
    log = []
    box = [None]

    def producer():   # may hand round r+1 only once round r has been taken
        for r in range(3):
            yield Recv((), Stage(Phase.HEADERS), gone=(("msg",),))
            log.append(f"hand {r}")
            yield Hand(("msg",), r)

    def consumer():
        for r in range(3):
            yield Recv((("msg",),), Stage(Phase.VERDICT))
            log.append(f"take {box[0].take(('msg',))}")
            yield Poll()      # nothing else is ready: returns at once

    def poller():   # long local work in pieces: the others run between them
        for piece in range(2):
            log.append(f"piece {piece}")
            yield Poll()
        yield Spawn(consumer())

    f = _LocalFabric()
    pool = Pool()
    box[0] = Inbox(f, pool)
    drive(f, box[0], Outbox(f, pool), [producer(), poller()])
    assert log == ["piece 0", "hand 0", "piece 1", "take 0", "hand 1", "take 1", "hand 2", "take 2"]


def _crossing(ctx):
    """Every rank sends to every other before it waits, and posts its receives as the requests say:
    a crossing exchange of large messages completes on any fabric."""
    f = ctx.fabric
    n, me = f.world_size, f.rank
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    got = {}

    def role(peer):
        yield Post(("x", peer), 4 * 100_000, peer, 7)
        yield Send(torch.full((100_000,), float(me)).view(torch.uint8), peer, 7)
        yield Recv((("x", peer),), Stage(Phase.VERDICT, visit=peer))
        got[peer] = float(inbox.take(("x", peer)).view(torch.float32)[0])

    drive(f, inbox, outbox, [role(p) for p in range(n) if p != me])
    outbox.reap(0)
    return got


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_crossing_exchanges_between_endpoints_complete(backend):
    out = sc.launch(_crossing, 3, backend=backend)
    assert out == [{p: float(p) for p in range(3) if p != r} for r in range(3)]


def _sums(ctx, deployment):
    """Two sparse and one dense call; returns whether each was exact."""
    out = []
    for i, (numel, d) in enumerate([(20_005, 0.2), (20_005, 0.2), (9_000, 1.0)]):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=64, lanes=4096 if i < 2 else 16, channels=2,
                              deployment=deployment)
        xs = []
        for r in range(ctx.world_size):
            g = torch.Generator().manual_seed(100 * i + r)
            keep = (torch.rand(-(-numel // 64), generator=g) < d).repeat_interleave(64)[:numel]
            xs.append(torch.randint(-5, 6, (numel,), generator=g).double() * keep)
        out.append(torch.equal(t.allreduce(xs[ctx.rank]), sum(xs)))
    return out


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_a_role_takes_only_messages_its_wait_named(monkeypatch, deployment):
    """Every message a role takes was named in the ``Recv`` it was resumed from, so the scheduler never
    blocks on a message (e.g. round 0's sums, large) that it did not choose to wait for while another
    role's messages are in (a hosted aggregator's data waiting behind its worker's take). A role that the
    scheduler lets wait in place (``_Scheduler._first_sure``: it would be resumed at once) goes on from its new
    ``Recv``, which it may take from."""
    from sparsecomm.fabric import roles
    from sparsecomm.fabric.sim.sim import SimFabric

    stacks, bad = {}, []        # per endpoint's inbox: the keys of the roles being resumed, innermost last
    resume, take, run = roles._Scheduler.resume, roles.Inbox.take, roles._Scheduler.run
    first_sure = roles._Scheduler._first_sure
    in_place = []               # the waits in place seen (the test covers them)

    def spy_first_sure(self, role, req):
        ok = first_sure(self, role, req)
        stack = stacks.get(id(self.inbox))
        if ok and stack:        # (resumed by the loop: the role goes on from this wait)
            stack[-1] = set(req.keys)
            in_place.append(req.keys)
        return ok
    scheds = {}                 # per inbox: the scheduler of its latest drive
    alone = set()               # the inboxes of drives whose only role the SimFabric's driver runs (in place)
    drive_one = SimFabric._drive_one

    def spy_run(self, roles_, keep):
        scheds[id(self.inbox)] = self
        return run(self, roles_, keep)

    def spy_drive_one(self, role, inbox, outbox, keep):
        alone.add(id(inbox))
        try:
            return (yield from drive_one(self, role, inbox, outbox, keep))
        finally:
            alone.discard(id(inbox))

    def spy_resume(self, s, got=None):
        stack = stacks.setdefault(id(self.inbox), [])
        stack.append(set(self.waiting[s][1].keys))
        try:
            yield from resume(self, s, got)
        finally:
            stack.pop()

    def spy_take(self, key):
        stack = stacks.get(id(self), [])
        sched = scheds.get(id(self))
        # a drive's only role waits in place: never resumed
        solo = id(self) in alone or (sched is not None and sched.solo is True)
        if (not stack and not solo) or (stack and key not in stack[-1]):
            bad.append(key)
        return take(self, key)

    monkeypatch.setattr(roles._Scheduler, "run", spy_run)
    monkeypatch.setattr(SimFabric, "_drive_one", spy_drive_one)
    monkeypatch.setattr(roles._Scheduler, "resume", spy_resume)
    monkeypatch.setattr(roles._Scheduler, "_first_sure", spy_first_sure)
    monkeypatch.setattr(roles.Inbox, "take", spy_take)
    out = sc.launch(functools.partial(_sums, deployment=deployment), 3,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [[True] * 3] * 3
    assert bad == []
    assert in_place                 # (the aggregators' first look-aheads, worker after worker)


def test_first_look_ahead_waits_are_in_place_and_change_nothing(monkeypatch):
    """An aggregator's waits on the first look-aheads (sure, preferred over every other role of the endpoint,
    resumed by the scheduler's loop) wait in place (``_Scheduler._first_sure``): none is suspended through
    ``_Scheduler.wait`` (no watch, no sequence number, no resume), and the sums are exact (the modelled times:
    tests/fabric/test_sim_pinned.py)."""
    from sparsecomm.fabric import roles
    from sparsecomm.transports.omnireduce.stages import Phase

    suspended = []
    wait = roles._Scheduler.wait

    def spy_wait(self, role, req):
        if getattr(req.stage, "phase", None) == Phase.FIRSTS:
            suspended.append(req.keys)
        return wait(self, role, req)

    monkeypatch.setattr(roles._Scheduler, "wait", spy_wait)
    out = sc.launch(functools.partial(_sums, deployment="colocated"), 4,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [[True] * 3] * 4
    assert suspended == []


def _late_own_range(ctx, record):
    """Rank 2 is slow (50 ms of modelled time) after scanning its own range, which it scans last."""
    from sparsecomm.transports.omnireduce import strategies, worker

    scan, land = worker.scan, strategies.land_sums0

    def slow_scan(call, a):
        yield from scan(call, a)
        if call.rank == 2 and a == 2:
            call.fabric.compute(0.05)
            record["slow until", call.rank] = call.fabric.now()

    def spy_land(call, a, g, ids):
        record.setdefault(("landed", call.rank, a), call.fabric.now())
        return land(call, a, g, ids)

    worker.scan, strategies.land_sums0 = slow_scan, spy_land   # (restored by the test's monkeypatch)
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=64, lanes=4096, channels=2)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(-5, 6, (20_005,), generator=g).double()
    return torch.equal(t.allreduce(x.clone()), sum(torch.randint(-5, 6, (20_005,), generator=torch.Generator()
                                                                   .manual_seed(r)).double() for r in range(3)))


def test_an_aggregator_whose_data_is_in_does_not_wait_for_another_aggregators_verdict(monkeypatch):
    """Rank 2 is late only for its own aggregator (it scans that range last): aggregators 0 and 1 have
    every block, so their sums reach rank 0 before rank 2 is done, without waiting for every
    aggregator's verdict."""
    from sparsecomm.transports.omnireduce import strategies, worker

    monkeypatch.setattr(worker, "scan", worker.scan)
    monkeypatch.setattr(strategies, "land_sums0", strategies.land_sums0)
    record: dict = {}
    out = sc.launch(functools.partial(_late_own_range, record=record), 3,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [True] * 3
    slow = record["slow until", 2]
    assert record["landed", 0, 1] < slow - 0.04, record
    assert record["landed", 0, 2] >= slow, record


@pytest.mark.parametrize("field", ["F_K0", "F_MAGIC"])
def test_a_header_forged_for_one_aggregator_is_an_error_on_every_worker_after_the_others_finish(field):
    """Worker 1 forges only its header to aggregator 0: aggregator 0 rejects it, aggregators 1 and 2 run
    their lanes to the end (every worker takes their sums: no receive is left posted), then every worker
    raises aggregator 0's error."""
    from sparsecomm.errors import MalformedMessage
    from sparsecomm.transports.omnireduce import wire

    from tests._faults_common import CorruptingFabric

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 1:
            def rw(t, dst, tag):
                if tag == wire.TAG_HDR_UP and dst == 0:
                    out = t.detach().clone()
                    out.view(torch.int64)[getattr(wire, field)] = 2**40
                    return out
            f = CorruptingFabric(f, rw)
        t = sc.transports.get("omnireduce", f, block_size=16, lanes=4, channels=2)
        try:
            t.allreduce(torch.ones(200))
        except MalformedMessage as e:
            return str(e)
        return None

    out = sc.launch(fn, 3, timeout_s=30)
    assert all(o is not None and "worker 1" in o for o in out), out


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_a_header_changed_on_the_way_fails_its_checksum_and_the_next_call_is_exact(deployment):
    """Worker 1's integer bound rewritten to 0 on the way (in range, so only the checksum shows it): the
    aggregators would pick int8 sums for a sum of 150 and return -106 on every worker. Instead every worker
    raises ``MalformedMessage``; the aggregators consume worker 1's round 0 by its manifest, so the next
    call through the same transport is exact."""
    from sparsecomm.errors import MalformedMessage
    from sparsecomm.transports.omnireduce import wire

    from tests._faults_common import CorruptingFabric

    def fn(ctx):
        forge = [True]
        f = ctx.fabric
        if ctx.rank == 1:
            def rw(t, dst, tag):
                if tag == wire.TAG_HDR_UP and forge[0]:
                    out = t.detach().clone()
                    out.view(torch.int64)[wire.F_ABSMAX] = 0
                    return out
            f = CorruptingFabric(f, rw)
        t = sc.transports.get("omnireduce", f, block_size=16, lanes=4, deployment=deployment)
        x = torch.full((100,), 50, dtype=torch.int32)
        try:
            got = t.allreduce(x)[:1].tolist()
        except MalformedMessage as e:
            got = str(e)
        forge[0] = False
        return got, t.allreduce(x)[:1].tolist()

    out = sc.launch(fn, 3, timeout_s=30)
    assert all(isinstance(o[0], str) and "worker 1" in o[0] and "checksum" in o[0] for o in out), out
    assert all(o[1] == [150] for o in out), out


def _mixed_channels(ctx, posted, lock, inplace):
    """n = 2, two aggregators of two one-round channels of 8 blocks each: channel 0 of each aggregator
    has 3 non-zero blocks per worker (some summed, not all), channel 1 all 8 (summed everywhere)."""
    from sparsecomm.fabric.sim.sim import SimFabric

    f = ctx.fabric
    irecv = SimFabric.irecv

    def spy(tensor, src=None, tag=0):
        with lock:
            posted[f.rank, src, tag] += 1
        return irecv(f, tensor, src, tag)

    f.irecv = spy
    bs = 16
    x = torch.zeros(32, bs, dtype=torch.float64)
    g = torch.Generator().manual_seed(ctx.rank)
    for a in range(2):
        x[16 * a + ctx.rank: 16 * a + ctx.rank + 3] = torch.randint(-5, 6, (3, bs), generator=g).double()
        x[16 * a + 8: 16 * a + 16] = torch.randint(-5, 6, (8, bs), generator=g).double()
    t = sc.transports.get("omnireduce", f, block_size=bs, lanes=4096, channels=2, inplace=inplace)
    y = t.allreduce(x.reshape(-1).clone())
    return y.clone(), x.reshape(-1)


@pytest.mark.parametrize("inplace", [False, True])
def test_round0_sums_of_a_channel_not_summed_everywhere_travel_with_its_lane_words(inplace):
    """A remote aggregator's round-0 reply of a channel is one message: with some blocks summed, the
    sums then the lane words; with every block summed, the sums alone on their own tag (the words are
    implied; the sums can be received straight into the result). Exact sums, also where the hosted
    aggregator sums in place (the sums are then copied out of the result)."""
    import collections
    import threading

    from sparsecomm.transports.omnireduce import wire

    posted, lock = collections.Counter(), threading.Lock()
    out = sc.launch(functools.partial(_mixed_channels, posted=posted, lock=lock, inplace=inplace), 2,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    total = out[0][1] + out[1][1]
    assert all(torch.equal(y, total) for y, _ in out)
    for me, agg in ((0, 1), (1, 0)):
        assert posted[me, agg, wire.tag_down(0)] == 1 and posted[me, agg, wire.tag_sums0(0)] == 0, posted
        assert posted[me, agg, wire.tag_down(1)] == 0 and posted[me, agg, wire.tag_sums0(1)] == 1, posted


def test_a_workers_first_look_aheads_of_every_channel_are_one_message():
    """Round 0 up, per worker and aggregator: the header, one message of every channel's first
    look-aheads (on ``TAG_FIRSTS``), then one message of position-0 blocks per channel (on its tag)."""
    import collections
    import threading

    from sparsecomm.transports.omnireduce import wire

    posted, lock = collections.Counter(), threading.Lock()
    out = sc.launch(functools.partial(_mixed_channels, posted=posted, lock=lock, inplace=False), 2,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert all(torch.equal(y, out[0][1] + out[1][1]) for y, _ in out)
    for agg, w in ((0, 1), (1, 0)):
        assert posted[agg, w, wire.TAG_HDR_UP] == 1 and posted[agg, w, wire.TAG_FIRSTS] == 1, posted
        assert posted[agg, w, wire.tag_up(0)] == 1 and posted[agg, w, wire.tag_up(1)] == 1, posted


@pytest.mark.parametrize("poll", [False, True])
def test_a_sure_wait_is_resumed_without_watching_its_receives(poll):
    """A role whose messages come whatever this endpoint does (``Stage.sure``: round-0 data) is resumed at
    once when it is the preferred candidate: its receive is taken blocking, never polled for arrival
    (on gloo each poll of a receive costs a helper thread) and ``wait_any`` is not needed. A ``Poll``
    never runs it (a poll never blocks): the other role runs there, the sure one after."""
    looked, log = [], []

    class _Work:
        def __init__(self, name):
            self.name = name

        def is_completed(self):
            looked.append(self.name)
            return True

        def wait(self):
            log.append(f"wait {self.name}")

    class _Fabric(_LocalFabric):
        def irecv(self, buf, src, tag):
            return _Work(tag)

        def wait_any(self, groups):
            log.append("wait_any")
            return 0

    f, pool = _Fabric(), Pool()
    inbox = Inbox(f, pool)

    def sure():
        yield Post(("a",), 4, 0, 1)
        yield Recv((("a",),), Stage(Phase.FIRSTS))   # round-0 data: sure
        inbox.take(("a",))

    def other():
        yield Post(("b",), 4, 0, 2)
        yield Recv((("b",),), Stage(Phase.VERDICT))
        inbox.take(("b",))

    def poller():
        log.append("poll")
        yield Poll()
        log.append("polled")

    drive(f, inbox, Outbox(f, pool), [sure(), other()] + ([poller()] if poll else []))
    assert 1 not in looked, looked
    assert log == (["poll", "wait 2", "polled", "wait 1"] if poll else ["wait 1", "wait 2"]), log


def test_a_window_posts_receives_in_order_while_its_ring_has_room():
    """A window's receives are posted in the order they are queued, each at a multiple of ``ALIGN`` of one
    ring, as long as it has room; consuming the oldest frees its room (wrapping around to the start)."""
    from sparsecomm.transports.omnireduce.window import ALIGN, Window

    ring = torch.empty(3 * ALIGN, dtype=torch.uint8)
    w = Window(ring)
    for k, nbytes in enumerate((ALIGN + 8, ALIGN, 2 * ALIGN, ALIGN)):
        w.want(k, nbytes, 0, 7)
    starts = lambda posts: [p.buf.data_ptr() - ring.data_ptr() for p in posts]   # noqa: E731
    assert starts(w.feed()) == [0, 2 * ALIGN] and w.posted() == [0, 1]        # 2: no room after 1, nor before
    assert starts(w.done(0)) == [0] and w.posted() == [1, 2]                    # 2 wraps around, up to 1
    assert starts(w.done(1)) == [2 * ALIGN] and w.posted() == [2, 3]
    assert starts(w.done(2)) == [] and w.posted() == [3]
    with pytest.raises(ProtocolError):
        w.done(2)                                                                # not the oldest posted
    with pytest.raises(ProtocolError):
        w.want(9, 3 * ALIGN + 1, 0, 7)                                           # larger than the ring


def test_a_windows_receives_of_one_size_cycle_through_the_same_views_of_its_ring():
    """Receives of one size through a window (a worker's first look-aheads at an aggregator) land in the same few
    spans of its ring: each span's view is made once and posted again (the same tensor, the same bytes), never
    two posted receives on one; only the first ``VIEWS`` spans are kept (memory bounded whatever the sizes)."""
    from sparsecomm.transports.omnireduce.window import ALIGN, VIEWS, Window

    ring = torch.empty(2 * ALIGN, dtype=torch.uint8)
    w = Window(ring)
    for k in range(6):
        w.want(k, ALIGN, 0, 7)
    posts = w.feed()                                   # 0, 1 posted; each later one as the oldest is consumed
    for k in range(4):
        posts += w.done(k)
    bufs = [p.buf for p in posts]
    assert [b.data_ptr() - ring.data_ptr() for b in bufs] == [0, ALIGN] * 3
    assert all(bufs[i] is bufs[i % 2] for i in range(6))
    assert bufs[0] is not bufs[1]
    big = Window(torch.empty((VIEWS + 4) * ALIGN, dtype=torch.uint8))
    for k in range(VIEWS + 4):                         # every span a new one: only the first VIEWS kept
        big.want(k, ALIGN, 0, 7)
    assert len(big.feed()) == VIEWS + 4 and len(big.views) == VIEWS


def test_sends_are_reaped_only_when_every_role_able_to_run_reaps():
    """This endpoint's sends are finished before a wait only when every role able to run waits in a lane
    round (``Stage.reaps``): a role of another phase (a verdict, which posts the receives of an
    aggregator's replies) runs first (``docs/omnireduce-scheduler.md``, R6)."""
    log = []

    class _Work:
        def is_completed(self):
            return True

        def wait(self):
            pass

    class _Fabric(_LocalFabric):
        def irecv(self, buf, src, tag):
            return _Work()

        def wait_any(self, groups):
            log.append("wait_any")
            return 0

    class _Reaping(Outbox):
        def reap(self, keep=64):
            log.append(f"reap {keep}")

    f, pool = _Fabric(), Pool()
    inbox = Inbox(f, pool)

    def lane():
        yield Post(("down",), 4, 0, 1)
        yield Recv((("down",),), Stage(Phase.LAND))   # a lane round: reaps
        inbox.take(("down",))
        log.append("lane")

    def verdict():
        yield Post(("verdict",), 4, 0, 2)
        yield Recv((("verdict",),), Stage(Phase.VERDICT))
        inbox.take(("verdict",))
        log.append("verdict")

    drive(f, inbox, _Reaping(f, pool), [lane(), verdict()], keep=0)
    # (the verdict's receive is in: a blocking driver resumes it without a wait_any)
    assert log == ["verdict", "reap 0", "lane"], log


def test_a_role_reusing_a_send_buffer_waits_in_the_scheduler_not_blocking():
    """``Recv.free``: a role about to reuse a pooled send buffer whose send has not completed (its
    receive not yet posted by the peer, which may first need this endpoint's other roles) is resumed only
    once the send completes; meanwhile another role runs. Without it the role, preferred, would be
    resumed at once and block in the pool."""
    log = []

    class _Work:
        def __init__(self, name, done):
            self.name, self.done = name, done

        def is_completed(self):
            return self.done

        def wait(self):
            if not self.done:
                log.append(f"blocked on {self.name}")
                self.done = True

    class _Fabric(_LocalFabric):
        def isend(self, buf, dst, tag, *, reliable=True):
            return _Work("send", False)

        def irecv(self, buf, src, tag):
            return _Work("recv", True)

    f, pool = _Fabric(), Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)

    def sender(free):
        buf = pool.get(("out", "msg"), 8)
        yield Send(buf, 1, 7, hold="msg")
        yield Recv((), Stage(Phase.HEADERS), free="msg" if free else None)
        pool.get(("out", "msg"), 8)
        log.append("reused")

    def other():
        yield Post(("b",), 4, 1, 8)
        yield Recv((("b",),), Stage(Phase.VERDICT))
        inbox.take(("b",))
        log.append("other")

    drive(f, inbox, outbox, [sender(True), other()])
    assert log[0] == "other" and log[-1] == "reused", log
    log.clear()   # the contrast, on a fresh endpoint (the roles see the new pool and inbox)
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    drive(f, inbox, outbox, [sender(False), other()])
    assert log[:2] == ["blocked on send", "reused"], log


def test_stages_order_by_phase_then_round_slot_and_visit_and_say_what_blocks_and_reaps():
    """The scheduler prefers the smallest :class:`Stage` (a tuple: phase, round, slot, visit); a wait
    for round-0 data is ``sure`` (the workers' first look-aheads, the drained messages, a lane's round
    0 at the aggregator) and only a lane round's wait ``reaps``."""
    stages = [Stage(Phase.LAND, 0, 1, 0), Stage(Phase.HEADERS), Stage(Phase.AGGREGATE, 1, 0),
              Stage(Phase.VERDICT, visit=2), Stage(Phase.AGGREGATE, 0, 1), Stage(Phase.LAND, 0, 0, 3),
              Stage(Phase.VERDICT, visit=1), Stage(Phase.FIRSTS)]
    assert sorted(stages) == [Stage(Phase.HEADERS), Stage(Phase.FIRSTS), Stage(Phase.VERDICT, visit=1),
                              Stage(Phase.VERDICT, visit=2), Stage(Phase.AGGREGATE, 0, 1),
                              Stage(Phase.AGGREGATE, 1, 0), Stage(Phase.LAND, 0, 0, 3), Stage(Phase.LAND, 0, 1, 0)]
    sure = {p for p in Phase if Stage(p).sure}
    assert sure == {Phase.FIRSTS, Phase.DRAIN, Phase.AGGREGATE} and not Stage(Phase.AGGREGATE, 1).sure
    assert {p for p in Phase if Stage(p).reaps} == {Phase.AGGREGATE, Phase.LAND}


def test_a_colocated_aggregator_looks_at_each_header_a_bounded_number_of_times(monkeypatch):
    """A colocated aggregator takes its headers as they arrive, one per wake (the key its ``any`` wait is resumed
    with): no wake looks at the headers left, so the looks at header receives per endpoint grow linearly with
    the workers, not with their square (a look at every header left per wake: n(n-1)/2 more). Here: the role's
    first look at each (it starts watching them) and a poll's look before the first is in, 2(n - 1)."""
    from sparsecomm.fabric import roles
    from sparsecomm.transports.omnireduce.wire import Msg

    looks = {}
    ready, ready_keys = roles.Inbox.ready, roles.Inbox.ready_keys

    def count(inbox, keys):
        n = sum(1 for k in keys if getattr(k, "msg", None) == Msg.HDR)
        looks[id(inbox)] = looks.get(id(inbox), 0) + n

    def spy_ready(self, key):
        count(self, (key,))
        return ready(self, key)

    def spy_ready_keys(self, keys):
        count(self, keys)
        return ready_keys(self, keys)

    monkeypatch.setattr(roles.Inbox, "ready", spy_ready)
    monkeypatch.setattr(roles.Inbox, "ready_keys", spy_ready_keys)
    n = 12

    def call(ctx):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=64, lanes=256, channels=1)
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.randint(-5, 6, (8192,), generator=g).double()
        x[torch.rand(8192, generator=g) < 0.5] = 0
        return t.allreduce(x).sum().item()

    out = sc.launch(call, n, network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert len(set(out)) == 1
    assert len(looks) == n and max(looks.values()) <= 3 * (n - 1), looks     # (a look per header left per wake: 88)


def test_a_header_with_position0_counts_is_the_specs_header_word_for_word():
    """``header.with_k0`` (the worker's per-aggregator round-0 header, from the call's sealed header) gives the
    words of ``CallSpec.header(world, k0)``: counts set, checksum resealed; a copy, ``base`` untouched."""
    import numpy as np

    from sparsecomm.transports.omnireduce import header

    spec = header.CallSpec(1000, torch.float32, 256, 2, 2, 16384, 0, 0, 0)
    base = spec.header(3).numpy()
    kept = base.copy()
    for k0 in ([(0, 0), (1, 0)], [(0, 3), (1, 0)], [(0, 1), (1, 2)], []):
        assert np.array_equal(header.with_k0(base, k0), spec.header(3, dict(k0)).numpy()), k0
    assert np.array_equal(base, kept)


def test_a_stages_flags_follow_its_phase_and_round_however_it_is_made():
    # sure: round-0 data (FIRSTS, DRAIN, round 0 of AGGREGATE); reaps: a lane round's wait (AGGREGATE, LAND)
    for phase in Phase:
        for rnd in (0, 1):
            st = Stage(phase, rnd, 1, 2)
            sure = phase in (Phase.FIRSTS, Phase.DRAIN) or (phase == Phase.AGGREGATE and rnd == 0)
            assert (st.sure, st.reaps) == (sure, phase >= Phase.AGGREGATE), st
            again = Stage(Phase.HEADERS)._replace(phase=phase, round=rnd, slot=1, visit=2)
            assert again == st and (again.sure, again.reaps) == (st.sure, st.reaps)
            flags = Stage(phase, rnd)[4:]
            made = Stage.new((phase, rnd, 1, 2) + flags)       # (one C call: the flags given)
            assert type(made) is Stage and made == st and (made.sure, made.reaps) == (st.sure, st.reaps)
            if phase in (Phase.VERDICT, Phase.LAND):        # (the worker's per-message stages: flags of any round)
                assert flags == Stage(phase)[4:]
    assert Stage(Phase.AGGREGATE, 0) < Stage(Phase.AGGREGATE, 1) < Stage(Phase.LAND)
    with pytest.raises(ValueError, match="sure"):
        Stage(Phase.LAND)._replace(sure=True)


def test_remembered_header_checks_answer_for_the_words_and_arguments_they_were_asked_for():
    """``validate_header``, ``round0_sizes`` and ``with_k0`` remember their last answers: an answer belongs to the
    header's exact words and the arguments (another world size, index or one changed word is checked anew), and
    what a caller gets is its own (a mutated answer does not change the next one)."""
    import numpy as np

    from sparsecomm.transports.omnireduce import header, wire

    spec = header.CallSpec(300_000, torch.float32, 256, 3, 1, 16384, 0, 0, 0)
    h = header.with_k0(spec.header(3).numpy(), [(0, 5)])
    for _ in range(2):                                  # (the second time from memory)
        assert header.validate_header(h, 3, 1, True) is None
        assert header.validate_header(h, 4, 1, True)[0] == wire.F_WORLD       # another world size
        assert header.validate_header(h, 3, 3, False)[0] == wire.F_AGGS       # an index past the aggregators
        forged = h.copy()
        forged[wire.F_NUMEL] += 256
        assert header.validate_header(forged, 3, 1, True)[0] == wire.F_SUM    # one word changed on the way
    sizes = header.round0_sizes(h, 1)
    assert sizes[1] == {0: wire.block_bytes(5, 256, 4, meta=False)}
    sizes[1][0] = -1
    assert header.round0_sizes(h, 1) == (sizes[0], {0: wire.block_bytes(5, 256, 4, meta=False)})
    a = header.with_k0(spec.header(3).numpy(), [(0, 5)])
    a[wire.F_K0] = 7
    assert np.array_equal(header.with_k0(spec.header(3).numpy(), [(0, 5)]), h)


def test_remembered_spec_headers_and_verdicts_are_the_callers_own():
    """``CallSpec.header`` (without position-0 counts) and ``check_headers`` remember their words: a header or a
    reply a caller changes (the aggregator writes its round-0 counts into its reply) does not change the next
    one; another spec, world size or one differing word gets its own answer."""
    import numpy as np

    from sparsecomm.transports.omnireduce import header, wire

    spec = header.CallSpec(300_000, torch.float32, 256, 3, 1, 16384, 0, 0, 0)
    first = spec.header(3).numpy()
    kept = first.copy()
    first[wire.F_NUMEL] = 1
    assert np.array_equal(spec.header(3).numpy(), kept)
    assert header.checksum(kept, wire.F_SUM) == kept[wire.F_SUM]                 # sealed
    assert spec.header(4).numpy()[wire.F_WORLD] == 4
    other = header.CallSpec(300_256, torch.float32, 256, 3, 1, 16384, 0, 0, 0).header(3).numpy()
    assert other[wire.F_NUMEL] == 300_256 and other[wire.F_SUM] != kept[wire.F_SUM]
    hs = [kept.copy() for _ in range(3)]
    for _ in range(2):                                  # (the second time from memory)
        reply = header.check_headers(hs)
        assert reply[wire.R_STATUS] == wire.OK and reply[wire.R_DOWN_DTYPE] == wire.dtype_code(torch.float32)
        reply[wire.R_K] = 99                            # (as AggCall.reply does)
    assert header.check_headers(hs)[wire.R_K] == 0
    hs[2] = other
    bad = header.check_headers(hs)
    assert bad[wire.R_STATUS] == wire.MISMATCH and bad[wire.R_FIELD] == wire.F_NUMEL
    assert (bad[wire.R_WMIN], bad[wire.R_VMIN], bad[wire.R_WMAX], bad[wire.R_VMAX]) == (0, 300_000, 2, 300_256)


def test_first_look_aheads_of_one_round_channels_are_one_bitmap_of_the_range_read_back_per_channel():
    """Where an aggregator's channels are one-round and all but the last fill whole bytes (``wire.one_bitmap``), a
    worker's first look-aheads are one pack of its mask over the range (``wire.firsts_of_range``): the same bytes
    as each channel's bitmap joined (``encode_all_firsts``); an aggregator that keeps the channels' holders as
    columns of one bitmap reads, by one unpack per worker, what ``set_firsts`` of each channel reads. Elsewhere
    (a channel of several rounds, or one ending inside a byte) ``one_bitmap`` says no."""
    import numpy as np

    from sparsecomm.transports.omnireduce import core, wire

    rng = np.random.default_rng(0)
    seen = set()
    # (numel, block size, aggregators, channels, lanes): 32-block channels; 8-block ones; 13-block ones (not
    # whole bytes); channels of several rounds (lanes below their blocks); a short last block
    for numel, bs, aggs, chans_n, lanes in ((4096 * 256, 256, 64, 2, 65536), (48 * 256, 256, 3, 2, 4096),
                                            (78 * 256, 256, 3, 2, 4096), (4096 * 256, 256, 4, 2, 64),
                                            (64 * 256 - 100, 256, 2, 2, 4096)):
        plans = wire.plan(numel, bs, aggs, chans_n, lanes)
        nb = -(-numel // bs)
        for density in (0.0, 0.3, 1.0):
            mask = torch.from_numpy(rng.random(nb) < density)
            for chans in plans:
                bitmap = wire.one_bitmap(chans)
                seen.add(bitmap)
                if not bitmap:
                    continue
                joined = wire.encode_all_firsts([core.WorkerChannel(ch, mask).mine for ch in chans], chans)
                packed = wire.firsts_of_range(mask.numpy(), chans)
                assert torch.equal(packed, joined), (numel, aggs, chans)
                n, w = 3, 1
                held = np.zeros((n, sum(ch.lanes for ch in chans)), dtype=bool)
                held[w] = np.unpackbits(packed.numpy(), bitorder="little", count=held.shape[1])
                col = 0
                for ch, part in zip(chans, wire.split_firsts(joined, list(chans))):
                    one = core.AggChannel(ch, n, bs, torch.float32, torch.float32, torch.float32)
                    one.set_firsts(w, part)
                    assert np.array_equal(held[w, col:col + ch.lanes], one.held[w])
                    cols = core.AggChannel(ch, n, bs, torch.float32, torch.float32, torch.float32,
                                           held=held[:, col:col + ch.lanes])
                    assert np.shares_memory(cols.held, held)
                    col += ch.lanes
    assert seen == {True, False}
    with pytest.raises(ProtocolError, match="holders bitmap"):
        ch = wire.plan(48 * 256, 256, 3, 2, 4096)[0][0]
        core.AggChannel(ch, 3, 256, torch.float32, torch.float32, torch.float32, held=np.zeros((3, 1), dtype=bool))


def test_a_one_round_channels_round0_is_its_mask_slices_non_zero_blocks_from_a_tensor_or_its_numpy_view():
    """A one-round channel's round 0 (``WorkerChannel``: ``pending0``, ``take_up``) sends exactly its non-zero
    blocks with "none" as look-ahead, and leaves no lane announcing anything, whether it was built from the mask
    tensor or the numpy view a worker makes once per call; its shared starting lanes are never written."""
    import numpy as np

    from sparsecomm.transports.omnireduce import core, wire

    ch = wire.plan(40 * 256, 256, 1, 1, 4096)[0][0]
    assert ch.single
    mask = torch.zeros(40, dtype=torch.bool)
    mask[[0, 7, 8, 39]] = True
    for m in (mask, mask.numpy()):
        c = core.WorkerChannel(ch, m)
        assert c.pending0() == 4
        assert np.array_equal(c.mine, np.where(mask.numpy(), np.arange(40), 40))
        b, look = c.take_up()
        assert b.tolist() == [0, 7, 8, 39] and look.tolist() == [40] * 4
        assert (c.mine == ch.size).all() and c.round == 1
        c.start(None)
        assert not c.active
    assert core.WorkerChannel(ch, mask).act.tolist() == list(range(40))     # (the shared lanes, unchanged)
    # a channel holding no non-zero block (most of a sparse call's): nothing to send, and no array of its own:
    # its announce is the shared "none" look-aheads, which its round 0 does not write
    empty = core.WorkerChannel(ch, torch.zeros(40, dtype=torch.bool))
    assert empty.pending0() == 0 and empty.mine is empty.next and not empty.mine.flags.writeable
    assert empty.mine.tolist() == [40] * 40
    b, look = empty.take_up()
    assert b.size == 0 and look.size == 0 and empty.round == 1 and empty.mine.tolist() == [40] * 40
    empty.start(None)
    assert not empty.active


def test_the_first_look_aheads_of_a_range_without_a_non_zero_block_are_shared_zeros():
    """Where a worker holds no non-zero block in an aggregator's range, its first look-aheads are the bytes the
    range's pack would give (zeros, as long), one tensor shared by every such message of that length."""
    import numpy as np

    from sparsecomm.transports.omnireduce import wire

    for numel, aggs in ((4096 * 256, 256), (4096 * 256, 64), (48 * 256, 3), (64 * 256 - 100, 2)):
        for chans in wire.plan(numel, 256, aggs, 2, 65536):
            if not wire.one_bitmap(chans):
                continue
            packed = wire.firsts_of_range(np.zeros(-(-numel // 256), dtype=bool), chans)
            zeros = wire.no_firsts(-(-(chans[-1].lo + chans[-1].size - chans[0].lo) // 8))
            assert torch.equal(packed, zeros)
            assert zeros is wire.no_firsts(zeros.numel())


def test_an_early_headers_checks_by_its_bytes_are_the_arrays_checks():
    """``validate_words`` and ``agrees`` (an early header checked by its bytes) answer as ``validate_header`` and a
    comparison of the agreed fields: other position-0 counts agree, another tensor size does not."""
    import numpy as np

    from sparsecomm.transports.omnireduce import header, wire

    spec = header.CallSpec(300_000, torch.float32, 256, 3, 1, 16384, 0, 0, 0)
    base = spec.header(3).numpy()
    h = header.with_k0(base, [(0, 5)])
    other = header.with_k0(header.CallSpec(300_256, torch.float32, 256, 3, 1, 16384, 0, 0, 0).header(3).numpy(), [])
    for words in (h.tobytes(), other.tobytes()):
        arr = np.frombuffer(words, dtype=np.int64)
        for n, index in ((3, 1), (4, 1), (3, 3)):
            assert header.validate_words(words, n, index, True) == header.validate_header(arr, n, index, True)
    assert header.agrees(h.tobytes(), base.tobytes())
    assert not header.agrees(other.tobytes(), base.tobytes())
    assert header.round0_sizes_of_words(h.tobytes(), 1)[1] == ((0, wire.block_bytes(5, 256, 4, meta=False)),)
    forged = h.copy()
    forged[wire.F_NUMEL] += 256
    assert header.validate_words(forged.tobytes(), 3, 1, True)[0] == wire.F_SUM
