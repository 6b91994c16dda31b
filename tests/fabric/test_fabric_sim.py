"""SimFabric: the network model, faults, timeouts and failure propagation."""

from __future__ import annotations

import time

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import FabricTimeout, MismatchError, PeerFailure
from sparsecomm.launch import current_context

GBPS8 = sc.Network(bandwidth_gbps=8, latency_us=10)  # 1e9 bytes/s, 10 us


def test_one_message_takes_latency_plus_bytes_over_bandwidth():
    def fn(ctx):
        x = torch.zeros(250_000)  # 1e6 bytes -> 1 ms at 1e9 B/s
        if ctx.rank == 0:
            ctx.fabric.send(x, 1)
        else:
            ctx.fabric.recv(x, 0)
        return ctx.fabric.now()

    t_send, t_recv = sc.launch(fn, 2, network=GBPS8)
    assert t_send == pytest.approx(1e-3)
    assert t_recv == pytest.approx(1e-3 + 10e-6)


def test_receiver_nic_serialises_simultaneous_arrivals():
    def fn(ctx):
        x = torch.zeros(250_000)
        if ctx.rank == 0:
            ctx.fabric.recv(x, 1)
            ctx.fabric.recv(x, 2)
        else:
            ctx.fabric.send(x, 0)
        return ctx.fabric.now()

    t0, _, _ = sc.launch(fn, 3, network=GBPS8)
    # both heads arrive at 10 us; the receiver NIC needs 1 ms for each
    assert t0 == pytest.approx(10e-6 + 2e-3)


def test_sender_nic_serialises_isends_and_wait_advances_clock():
    def fn(ctx):
        x = torch.zeros(250_000)
        if ctx.rank == 0:
            works = [ctx.fabric.isend(x, d) for d in (1, 2)]
            before = ctx.fabric.now()
            for w in works:
                w.wait()
            return before, ctx.fabric.now()
        ctx.fabric.recv(x, 0)
        return ctx.fabric.now()

    (before, after), t1, t2 = sc.launch(fn, 3, network=GBPS8)
    assert before == 0.0 and after == pytest.approx(2e-3)
    assert t1 == pytest.approx(1e-3 + 10e-6)
    assert t2 == pytest.approx(2e-3 + 10e-6)


def test_wait_all_is_a_wait_for_each_in_order():
    """``Fabric.wait_all`` (the roles' reap) moves the clock as a ``wait`` of each operation in turn would: to the
    last byte of the latest send, once (a send waited for again moves it no more), and a receive is waited for."""
    def fn(ctx):
        fab, x = ctx.fabric, torch.zeros(250_000)
        if ctx.rank == 0:
            works = [fab.isend(x, d) for d in (1, 2)]
            before = fab.now()
            fab.wait_all(reversed(works))
            after = fab.now()
            fab.compute(1e-3)
            fab.wait_all(works)         # (complete already: the clock stays)
            y = torch.empty(4)
            fab.wait_all([fab.isend(x[:4], 1), fab.irecv(y, 1)])
            return before, after, fab.now(), y.tolist()
        fab.recv(x, 0)
        if ctx.rank == 1:
            fab.recv(torch.empty(4), 0)
            fab.send(torch.arange(4.0), 0)
        return fab.now()

    (before, after, end, y), _, _ = sc.launch(fn, 3, network=GBPS8)
    assert before == 0.0 and after == pytest.approx(2e-3)
    assert end > after + 1e-3 and y == [0.0, 1.0, 2.0, 3.0]


def test_per_port_service_receives_in_parallel():
    def echo(fabric):
        x = torch.zeros(250_000)
        while True:
            src = fabric.recv(x, None)
            fabric.isend(x, src)  # a dataplane never blocks on transmission

    def fn(ctx):
        sid = ctx.fabric.service("echo", echo, per_port=True, bandwidth_gbps=8, latency_us=10)
        x = torch.zeros(250_000)
        ctx.fabric.send(x, sid)
        ctx.fabric.recv(x, sid)
        return sid, ctx.fabric.now()

    out = sc.launch(fn, 4, network=GBPS8)
    assert {sid for sid, _ in out} == {4}
    # per port, the four uploads and the four replies do not queue behind each other
    for _, t in out:
        assert t == pytest.approx(2 * (1e-3 + 10e-6))


def test_any_source_recv_takes_earliest_arrival_and_reports_source():
    def fn(ctx):
        x = torch.zeros(4)
        if ctx.rank == 0:
            for r in (1, 2):  # both data messages are posted before the any-source receives
                ctx.fabric.recv(x, r, tag=1)
            return [ctx.fabric.recv(x, None) for _ in range(2)]
        ctx.fabric.compute(1e-3 if ctx.rank == 1 else 0.0)
        ctx.fabric.send(x, 0)
        ctx.fabric.send(x, 0, tag=1)

    assert sc.launch(fn, 3)[0] == [2, 1]


def test_loss_is_deterministic_for_a_seed_and_has_the_declared_rate():
    n_msgs, p = 2000, 0.1

    def fn(ctx):
        x = torch.zeros(1)
        if ctx.rank == 1:
            for _ in range(n_msgs):
                ctx.fabric.send(x, 0, reliable=False)
            ctx.fabric.send(x, 0, tag=1)  # a reliable end marker is never dropped
            return None
        got = 0
        while True:
            try:
                ctx.fabric.recv(x, 1, timeout=1.0)
                got += 1
            except FabricTimeout:
                break
        ctx.fabric.recv(x, 1, tag=1)
        return got

    a = sc.launch(fn, 2, network=sc.Network(loss=p, seed=3))[0]
    b = sc.launch(fn, 2, network=sc.Network(loss=p, seed=3))[0]
    c = sc.launch(fn, 2, network=sc.Network(loss=p, seed=4))[0]
    assert a == b
    assert a != c
    # binomial(2000, 0.9): sd = sqrt(2000*0.09) = 13.4; 5 sd
    assert abs(a - n_msgs * (1 - p)) < 5 * 13.5
    # reliable sends are never dropped
    assert sc.launch(fn, 2, network=sc.Network(loss=0.0))[0] == n_msgs


def test_timeout_is_in_modelled_time():
    def fn(ctx):
        if ctx.rank == 0:
            with pytest.raises(FabricTimeout, match="modelled seconds"):
                ctx.fabric.recv(torch.zeros(1), 1, timeout=5e-3)
            t = ctx.fabric.now()
            ctx.fabric.send(torch.zeros(1), 1)
            return t
        ctx.fabric.recv(torch.zeros(1), 0)
        return ctx.fabric.now()

    t0, t1 = sc.launch(fn, 2)
    assert t0 == pytest.approx(5e-3)
    assert t1 > 5e-3


def test_crashed_rank_makes_the_others_raise_quickly():
    def fn(ctx):
        x = torch.zeros(8)
        for _ in range(10):
            if ctx.rank == 1:
                ctx.fabric.send(x, 0)
            else:
                ctx.fabric.recv(x, 1)

    start = time.monotonic()
    with pytest.raises(FabricTimeout, match="crashed: worker1"):
        sc.launch(fn, 2, network=sc.Network(crash={1: 3}))
    assert time.monotonic() - start < 5.0


def test_failure_on_one_rank_ends_every_rank_with_that_error():
    seen = []

    def fn(ctx):
        if ctx.rank == 2:
            raise ValueError("bad input on rank 2")
        try:
            ctx.fabric.recv(torch.zeros(1), 2)
        except PeerFailure as e:
            seen.append(str(e))
            raise

    with pytest.raises(ValueError, match="bad input on rank 2"):
        sc.launch(fn, 3)
    assert len(seen) == 2 and all("worker2 failed" in s for s in seen)


def test_mismatched_message_length_is_a_clear_error():
    def fn(ctx):
        if ctx.rank == 0:
            ctx.fabric.recv(torch.zeros(100), 1)
        else:
            ctx.fabric.send(torch.zeros(99), 0)

    with pytest.raises(MismatchError, match="expected 100 x torch.float32 .* received 99"):
        sc.launch(fn, 2)


def test_stragglers_slow_compute_and_barrier_waits_for_them():
    def fn(ctx):
        ctx.fabric.compute(1e-3)
        ctx.fabric.barrier()
        return ctx.fabric.now()

    out = sc.launch(fn, 3, network=sc.Network(stragglers={1: 5.0}))
    assert all(t >= 5e-3 for t in out)


def test_a_fresh_ledger_has_its_own_empty_links_counter():
    from collections import Counter
    import pickle

    from sparsecomm.fabric.stats import CommStats

    a, b = CommStats(), CommStats()
    assert type(a.links) is Counter and a.links == Counter() and a.links is not b.links
    a.record_send(0, 1, 5)
    b.links[(2, 3)] += 7                              # a Counter: a missing link counts from 0
    assert a.links == Counter({(0, 1): 5}) and b.links == Counter({(2, 3): 7})
    assert CommStats().links == Counter() and a.copy().links is not a.links and (a - a).links == Counter()
    assert pickle.loads(pickle.dumps(a)) == a


def test_stats_and_context():
    def fn(ctx):
        assert current_context() is ctx
        x = torch.zeros(10, dtype=torch.float64)
        if ctx.rank == 0:
            ctx.fabric.send(x, 1)
        else:
            ctx.fabric.recv(x, 0)
        s = ctx.fabric.stats
        return s.bytes_sent, s.bytes_received, s.messages, dict(s.links)

    (s0, r0, m0, l0), (s1, r1, m1, l1) = sc.launch(fn, 2)
    assert (s0, r0, m0) == (80, 0, 1) and (s1, r1, m1) == (0, 80, 0)
    assert l0 == {(0, 1): 80} and l1 == {(0, 1): 80}
    assert current_context() is None


def test_results_come_back_in_rank_order_and_bad_world_size_raises():
    assert sc.launch(lambda ctx: ctx.rank ** 2, 5) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError):
        sc.launch(lambda ctx: None, 0)
    with pytest.raises(sc.errors.UnknownNameError, match="valid names: .*sim"):
        sc.launch(lambda ctx: None, 2, backend="carrier-pigeon")


# ----------------------------------------------------------------------------- model fixes (#15 item 7)
def _arrivals(order):
    """Rank 1 sends 1 MB at 0 (in by 1.01 ms), rank 2 sends 1 MB at 1.5 ms (its head at 1.51 ms); each
    then sends a 4-byte note, which rank 0 waits for first, so both data messages are posted by the time
    rank 0 asks for them, in ``order``."""

    def fn(ctx):
        f, x = ctx.fabric, torch.zeros(250_000)
        note = torch.zeros(1)
        if ctx.rank == 0:
            f.recv(note, 1, tag=1)
            f.recv(note, 2, tag=1)
            for src in order:
                f.recv(x, src)
        else:
            if ctx.rank == 2:
                f.compute(1.5e-3)
            f.send(x, 0)
            f.send(note, 0, tag=1)
        return f.now()

    return sc.launch(fn, 3, network=GBPS8)[0]


def test_receiver_nic_takes_messages_in_arrival_order_not_in_recv_order():
    """The NIC takes data 1 (0.01-1.01 ms), then data 2 (1.51-2.51 ms), whatever order the application
    asks in; the old model served them in the order of the recv calls (data 2 then data 1: 3.51 ms, and
    the notes first: 4.51 ms)."""
    t21 = _arrivals((2, 1))
    t12 = _arrivals((1, 2))
    assert t21 == pytest.approx(t12)
    assert t21 == pytest.approx(2.51e-3 + 4e-9)


def _ring_time(ctx):
    t = sc.transports.get("ring", ctx.fabric)
    t.allreduce(torch.ones(100_000))
    return ctx.fabric.now()


def test_a_straggler_slows_what_transports_do():
    """A straggler (factor f) is a slow host: its compute and its host stack (bytes in and out) take f
    times as long, so a ring all-reduce, which calls no compute(), slows down too. The old model only
    scaled compute(): identical times."""
    net = dict(bandwidth_gbps=8, latency_us=1)
    base = max(sc.launch(_ring_time, 4, network=sc.Network(**net)))
    slow = max(sc.launch(_ring_time, 4, network=sc.Network(stragglers={1: 4.0}, **net)))
    # every ring step passes through worker 1's NIC at a quarter of the rate
    assert slow > 3.0 * base


def test_a_service_latency_keeps_links_symmetric():
    """Worker to service and service to worker take the same time: the path's latency is the mean of its
    two ends' (a worker-worker path keeps its latency). The old model used the sender's latency only, so
    a 100 us service answered a 10 us worker 90 us later than the worker reached it."""
    arrived = []

    def echo(fabric):
        x = torch.zeros(1)
        while True:
            src = fabric.recv(x, None)
            arrived.append(fabric.now())
            fabric.send(x, src)

    def fn(ctx):
        sid = ctx.fabric.service("echo", echo, latency_us=100)
        x = torch.zeros(1)
        ctx.fabric.send(x, sid)
        ctx.fabric.recv(x, sid)
        return ctx.fabric.now()

    (back,) = sc.launch(fn, 1, network=sc.Network(bandwidth_gbps=8, latency_us=10))
    there = arrived[0]
    assert there == pytest.approx(back - there, rel=1e-9)
    assert there == pytest.approx(55e-6 + 4e-9)


def test_a_message_is_the_bytes_sent_whichever_posted_receive_takes_it():
    """Sends on a channel with receives posted write into their buffers at the send (the k-th message sent
    into the k-th receive posted, for messages of at least WRITE_THROUGH_BYTES); receives waited for in another
    order, or a blocking receive in between, still get the messages in the order sent, each the bytes at its
    send (the sender's buffer changes after)."""
    from sparsecomm.fabric.sim.sim import WRITE_THROUGH_BYTES

    numel = WRITE_THROUGH_BYTES // 4

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            f.recv(torch.zeros(1), 1, tag=9)        # rank 1's receives are posted
            x = torch.zeros(numel)
            for i in range(5):
                x.fill_(i + 1)
                f.send(x, 1, tag=3)
            x.fill_(-1)
            return None
        bufs = [torch.zeros(numel) for _ in range(4)]
        works = [f.irecv(b, 0, tag=3) for b in bufs[:3]]
        f.send(torch.zeros(1), 0, tag=9)
        works[1].wait()                            # first message into the second receive's buffer
        works[0].wait()
        tail = torch.zeros(numel)
        f.recv(tail, 0, tag=3)                     # a blocking receive takes the third
        works[2].wait()
        w = f.irecv(bufs[3], 0, tag=3)
        w.wait()
        got = [b.unique().tolist() for b in bufs[:3]] + [tail.unique().tolist(), bufs[3].unique().tolist()]
        return got

    _, got = sc.launch(fn, 2, network=GBPS8)
    assert got == [[2.0], [1.0], [4.0], [3.0], [5.0]]


def test_a_drive_that_raises_leaves_no_receive_for_a_send_to_write_into():
    """A drive whose role raises may leave a receive posted into a buffer that the next receive is posted
    into again; the messages sent after are still each the bytes sent (none written over another)."""
    from sparsecomm.fabric.roles import Inbox, Outbox, Pool, PostInto
    from sparsecomm.fabric.sim.sim import WRITE_THROUGH_BYTES

    numel = WRITE_THROUGH_BYTES // 4

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            f.recv(torch.zeros(1), 1, tag=9)
            x = torch.zeros(numel)
            for i in range(2):
                x.fill_(i + 1)
                f.send(x, 1, tag=3)
            return None
        buf = torch.zeros(numel)

        def role():
            yield PostInto("k", buf, 0, 3)
            raise ValueError("the role fails")

        pool = Pool()
        with pytest.raises(ValueError):
            f.drive([role()], Inbox(f, pool), Outbox(f, pool))
        other = torch.zeros(numel)
        w1, w2 = f.irecv(buf, 0, tag=3), f.irecv(other, 0, tag=3)     # buf again: the stale one's memory
        f.send(torch.zeros(1), 0, tag=9)
        w1.wait()
        w2.wait()
        return [buf.unique().tolist(), other.unique().tolist()]

    _, got = sc.launch(fn, 2, network=GBPS8)
    assert got == [[1.0], [2.0]]


def _fan_out(ctx, each: bool, numel: int):
    """Rank 0 sends one buffer to ranks 3, 1, 2 (in that order), by ``isend_each`` (``each``) or an ``isend``
    per rank, then overwrites it; rank 1 has its receive posted before (written through when large enough), the
    others receive after. Returns each rank's clock, what it received and, for rank 0, the messages' times."""
    f = ctx.fabric
    x = torch.full((numel,), 7.0)
    if ctx.rank == 0:
        f.recv(torch.zeros(1), 1, tag=9)            # rank 1's receive is posted
        f.compute(1e-6)
        if each:
            works = f.isend_each(x, (3, 1, 2), 5, [])
        else:
            works = [f.isend(x, d, 5) for d in (3, 1, 2)]
        x.fill_(-1.0)                               # the messages are the bytes at the send
        world = f.world
        times = [(m.start, m.head, m.tx_end, m.delivered) for d in (3, 1, 2)
                 for m in world.endpoints[d].mailbox.get((0, 5), ())]
        f.wait_all(works)
        return f.now(), len(works), times, f.stats.messages, f.stats.bytes_sent
    buf = torch.zeros(numel)
    w = f.irecv(buf, 0, tag=5)
    if ctx.rank == 1:
        f.send(torch.zeros(1), 0, tag=9)
    w.wait()
    return f.now(), buf.unique().tolist()


@pytest.mark.parametrize("numel", [4, 4096])
def test_isend_each_makes_the_sends_of_an_isend_per_endpoint(numel):
    """``isend_each`` to several endpoints is ``isend`` to each in order: the same modelled times at every
    endpoint bit for bit, the same ledger, each message the bytes at the send (into a posted receive or a copy)."""
    net = sc.Network(bandwidth_gbps=8, latency_us=10)
    each = sc.launch(lambda ctx: _fan_out(ctx, True, numel), 4, network=net)
    one = sc.launch(lambda ctx: _fan_out(ctx, False, numel), 4, network=net)
    assert each == one
    assert each[0][1] == 3 and [r[1] for r in each[1:]] == [[7.0]] * 3
    assert each[0][2][0] < each[0][2][1] < each[0][2][2]        # (serialised by rank 0's NIC, in dsts' order)


def test_isend_each_to_an_invalid_endpoint_has_started_the_sends_before_it():
    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            works = []
            with pytest.raises(ValueError, match="cannot send to itself"):
                f.isend_each(torch.ones(2), (1, 0, 2), 5, works)
            f.send(torch.ones(2), 2, 5)
            return len(works), f.stats.messages
        got = torch.zeros(2)
        f.recv(got, 0, 5)
        return got.tolist()

    assert sc.launch(fn, 3, network=GBPS8) == [(1, 2), [1.0, 1.0], [1.0, 1.0]]


def test_a_stable_send_is_the_senders_tensor_until_taken_and_another_send_a_copy():
    """``stable=True`` (the sender writes nothing before the take) lets the SimFabric keep a reference to the
    sender's tensor instead of copying it; a plain send is copied at the send. Shown here by breaking the promise:
    the sender writes both tensors after the sends, before their receiver takes them (no receive posted: neither
    is written through)."""

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            x, y = torch.full((1024,), 1.0), torch.full((1024,), 1.0)
            f.isend(x, 1, tag=3, stable=True).wait()
            f.isend(y, 1, tag=4).wait()
            x.fill_(2.0)
            y.fill_(2.0)
            f.send(torch.zeros(1), 1, tag=9)
            return None
        f.recv(torch.zeros(1), 0, tag=9)           # (rank 0 has written both by now)
        a, b = torch.zeros(1024), torch.zeros(1024)
        f.recv(a, 0, tag=3)
        f.recv(b, 0, tag=4)
        return a.unique().tolist(), b.unique().tolist()

    _, got = sc.launch(fn, 2, network=GBPS8)
    assert got == ([2.0], [1.0])


def test_express_tags_are_modelled_as_any_message_and_their_receives_name_the_source():
    """An express tag (:func:`sparsecomm.fabric.base.express`) on the SimFabric: the same modelled time as the plain
    tag (one NIC queue per endpoint: the small message leaves after the megabyte before it), and a receive from any
    source on one is refused, on every fabric alike (TorchFabric carries them on paths of their own per source)."""
    from sparsecomm.errors import IncompatibleError, InvalidValueError
    from sparsecomm.fabric.base import EXPRESS_SPAN, express, is_express

    def fn(ctx, tag):
        f, big, small = ctx.fabric, torch.zeros(250_000), torch.zeros(1)
        if ctx.rank == 0:
            w = f.isend(big, 1, tag=1)
            f.send(torch.ones(1), 1, tag=tag)
            w.wait()
            return 0.0
        f.recv(small, 0, tag=tag)
        t = f.now()
        f.recv(big, 0, tag=1)
        for receive in (f.irecv, f.recv):
            with pytest.raises(IncompatibleError, match="must name its source"):
                receive(small, None, tag=express(5))
        return t

    plain = sc.launch(lambda ctx: fn(ctx, 3), 2, network=GBPS8)[1]
    fast = sc.launch(lambda ctx: fn(ctx, express(3)), 2, network=GBPS8)[1]
    assert plain == fast == pytest.approx(1e-3 + 4e-9 + 10e-6)
    assert is_express(express(0)) and is_express(express(EXPRESS_SPAN - 1)) and not is_express(3)
    assert not is_express(2**31 - 9)    # (the library's reserved tags near 2**31 are not)
    for bad in (-1, EXPRESS_SPAN, 1.0, True):
        with pytest.raises(InvalidValueError, match="express"):
            express(bad)
