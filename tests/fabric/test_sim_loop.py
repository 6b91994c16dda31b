"""The SimFabric as one event loop: deterministic modelled times, services as processes, no hidden threads."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import ProtocolError
from sparsecomm.fabric import roles
from sparsecomm.fabric.roles import Inbox, Outbox, Pool, PostInto, Recv, Send, Step


def _omnireduce_times(ctx, deployment: str) -> list[float]:
    t = sc.transports.get("omnireduce", ctx.fabric, lanes=2, deployment=deployment)
    x = torch.randn(1 << 13, generator=torch.Generator().manual_seed(ctx.rank))
    x[torch.rand(1 << 13, generator=torch.Generator().manual_seed(ctx.rank + 99)) < 0.7] = 0
    out = []
    for _ in range(2):
        t.allreduce(x.clone())
        out.append(t.last_stats.modelled_time_s)
    return out


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_modelled_times_of_an_any_source_protocol_are_identical_between_runs(deployment):
    # OmniReduce's aggregators take the workers' blocks in the order they arrive (wait_any): with threads
    # that order could depend on the threads' timing; as one loop, three runs give the same bits
    runs = [sc.launch(functools.partial(_omnireduce_times, deployment=deployment), 6) for _ in range(3)]
    assert [[t.hex() for t in r] for r in runs[0]] == [[t.hex() for t in r] for r in runs[1]] \
        == [[t.hex() for t in r] for r in runs[2]]


def _exact_blocks(seed: int, numel: int, density: float, thr: float) -> torch.Tensor:
    """Small integers (sums exact in any order) in a ``density`` fraction of 256-blocks shared by every rank;
    with ``thr``, 30% of the blocks (per ``seed``) hold +-1/32 instead: blocks that count as zero."""
    nb = numel // 256
    x = torch.randint(-20, 21, (numel,), generator=torch.Generator().manual_seed(seed)).float()
    if density < 1:
        keep = torch.zeros(nb, dtype=torch.bool)
        keep[torch.randperm(nb, generator=torch.Generator().manual_seed(7))[: max(1, int(density * nb))]] = True
        x = x * keep.repeat_interleave(256)
    if thr > 0:
        small = torch.rand(nb, generator=torch.Generator().manual_seed(100 + seed)) < 0.3
        x = torch.where(small.repeat_interleave(256), x.sign() / 32, x)
    return x


def _dedicated_calls(ctx, kw: dict, numel: int, density: float, thr: float, calls: int, worlds: list):
    """``calls`` all-reduces through dedicated aggregators: per call this rank's modelled time (float.hex)
    and whether its result is the exact sum (the blocks under ``thr`` left out); its clock at the end."""
    if ctx.rank == 0:
        worlds.append(ctx.fabric.world)
    t = sc.transports.get("omnireduce", ctx.fabric, deployment="dedicated", threshold=thr, **kw)
    out = []
    for call in range(calls):
        y = t.allreduce(_exact_blocks(ctx.rank + 17 * call, numel, density, thr))
        xs = [_exact_blocks(r + 17 * call, numel, density, thr) for r in range(ctx.world_size)]
        want = sum(torch.where(x.abs() <= thr, torch.zeros(()), x) for x in xs)
        out.append((t.last_stats.modelled_time_s.hex(), torch.equal(y, want)))
    return out, ctx.fabric.now().hex()


#: (workers, options, numel, density, threshold, calls per launch); on threads, the first two gave other
#: modelled times in about one launch of three
DEDICATED = [
    (5, {"lanes": 4}, 1 << 16, 0.1, 0.05, 2),
    (4, {"lanes": 2, "num_aggregators": 2}, 1 << 15, 0.3, 0.0, 3),
    (3, {"lanes": 8}, 1 << 15, 1.0, 0.0, 2),
]


@pytest.mark.parametrize("n, kw, numel, density, thr, calls", DEDICATED)
def test_dedicated_aggregators_give_the_same_modelled_times_in_every_run(n, kw, numel, density, thr, calls):
    # a dedicated aggregator serves call after call, and a worker's thread makes one call after another: the
    # order in which threads hand their next call to the loop is their scheduling's, and a thread of the
    # aggregator's own would re-enter the loop whenever it got to. As processes of the loop, stepped in the order
    # of their endpoints, every worker's and every aggregator's modelled clock is the same bits in every launch,
    # and every result is the exact sum
    runs, clocks = [], []
    for _ in range(8):
        worlds: list = []
        runs.append(sc.launch(functools.partial(_dedicated_calls, kw=kw, numel=numel, density=density, thr=thr,
                                                calls=calls, worlds=worlds), n,
                              network=sc.Network(bandwidth_gbps=100.0, latency_us=2.0)))
        clocks.append([ep.clock.hex() for ep in worlds[0].endpoints])
    assert all(ok for r in runs[0] for _, ok in r[0])
    assert all(r == runs[0] for r in runs[1:]), [[[t for t, _ in c[0]] for c in r] for r in runs]
    assert all(c == clocks[0] for c in clocks[1:]), clocks


def _echo(fabric):
    """A service as a process of the loop: echo one 4-float message from each worker, as roles."""
    n = fabric.world_size
    inbox, outbox = Inbox(fabric, Pool()), None
    outbox = Outbox(fabric, inbox.pool)
    bufs = {w: torch.empty(4) for w in range(n)}

    def role(w):
        yield PostInto(("in", w), bufs[w], w, 5)
        yield Recv((("in", w),), Step())
        buf = inbox.take(("in", w))
        yield Send(buf * 2, w, 6)

    yield from fabric.drive_process([role(w) for w in range(n)], inbox, outbox)
    outbox.finish()


def _echo_blocking(fabric):
    """The same service with a blocking body: it runs on a thread of its own."""
    bufs = {w: torch.empty(4) for w in range(fabric.world_size)}
    for w in range(fabric.world_size):
        fabric.recv(bufs[w], w, 5)
    for w in range(fabric.world_size):
        fabric.send(bufs[w] * 2, w, 6)


@pytest.mark.parametrize("main, threaded", [(_echo, False), (_echo_blocking, True)])
def test_a_service_whose_main_is_a_generator_runs_in_the_loop_without_a_thread(main, threaded):
    name = "echo"
    worlds, named = [], []

    def fn(ctx):
        worlds.append(ctx.fabric.world)
        sid = ctx.fabric.service(name, main)
        named.append(any(t.name == f"sparsecomm-{name}" for t in threading.enumerate()))
        ctx.fabric.send(torch.full((4,), float(ctx.rank)), sid, 5)
        out = torch.empty(4)
        ctx.fabric.recv(out, sid, 6)
        return out.tolist()

    res = sc.launch(fn, 3)
    assert res == [[2.0 * r] * 4 for r in range(3)]
    # a thread started for the service only if its main blocks (other ranks' threads are not counted)
    assert len(worlds[0].gate.service_threads) == int(threaded) and all(v == threaded for v in named)


@pytest.mark.parametrize("name, kw", [("omnireduce", {"deployment": "dedicated", "lanes": 4}), ("switch", {}),
                                      ("sparse-switch", {})])
def test_the_librarys_services_run_in_the_loop_without_a_thread(name, kw):
    worlds = []

    def fn(ctx):
        worlds.append(ctx.fabric.world)
        t = sc.transports.get(name, ctx.fabric, **kw)
        x = torch.zeros(4096)
        x[:512] = ctx.rank + 1.0
        return t.allreduce(x)[:2].tolist()

    assert sc.launch(fn, 3) == [[6.0, 6.0]] * 3
    world = worlds[0]
    assert len(world.endpoints) > 3 and world.gate.service_threads == []


def test_a_process_that_blocks_on_a_receive_itself_is_a_protocol_error():
    def bad(fabric):
        fabric.recv(torch.empty(1), 0, 3)     # a blocking call inside the loop: it would wait for itself
        yield

    def fn(ctx):
        ctx.fabric.service("bad", bad)
        ctx.fabric.barrier()

    with pytest.raises(ProtocolError, match="blocked on a wait itself"):
        sc.launch(fn, 2)


def test_the_scheduler_is_sans_io_its_waits_are_yielded():
    # the roles' scheduler performs no wait itself: it yields them (a driver performs them)
    class NoWaits:
        rank, world_size, device = 0, 2, torch.device("cpu")

        def irecv(self, buf, src, tag):
            class W:
                def is_completed(self):
                    return False

                def wait(self):
                    raise AssertionError("the scheduler waited itself")
            return W()

    fab = NoWaits()
    inbox = Inbox(fab, Pool())
    outbox = Outbox(fab, inbox.pool)

    def role():
        yield PostInto("k", torch.empty(1), 1, 0)
        yield Recv(("k",), Step())

    sched = roles.schedule(fab, inbox, outbox, [role()])
    req = next(sched)
    assert isinstance(req, roles.WaitAll) and req.keys == ("k",)


def test_a_timed_receive_of_a_role_resumes_at_its_deadline_or_with_the_message():
    from sparsecomm.fabric.roles import AwaitWithin, RecvWithin

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 1:
            f.compute(5e-3)
            f.send(torch.ones(2), 0, 4)
            f.send(torch.ones(2), 0, 5)
            return None
        pool = Pool()
        inbox, outbox = Inbox(f, pool), Outbox(f, pool)
        got = []

        def role():
            buf = torch.zeros(2)
            got.append(((yield RecvWithin(buf, 1, 4, 1e-3)), f.now()))      # nothing by 1 ms
            got.append(((yield RecvWithin(buf, None, 4, 1.0)), buf.tolist()))
            yield PostInto("k", torch.zeros(2), 1, 5)
            got.append((yield AwaitWithin("k", 1.0)))
            inbox.take("k")

        f.drive([role()], inbox, outbox)
        return got

    got = sc.launch(fn, 2, network=sc.Network(bandwidth_gbps=100, latency_us=2))[0]
    assert got[0] == (None, pytest.approx(1e-3))
    assert got[1] == (1, [1.0, 1.0]) and got[2] is True


def test_a_service_thread_that_starts_after_the_run_closed_leaves_at_once():
    # a world closed before its service thread's first wait (a transport built on a throwaway world): the
    # service's wait raises ServiceShutdown at once, and close() returns without waiting for its timeout
    import time

    from sparsecomm.fabric.sim.sim import SimWorld

    def main(fabric):
        time.sleep(0.5)                       # its first wait comes after the close
        fabric.recv(torch.empty(1), 0, 3)

    world = SimWorld(2, sc.Network(timeout_s=60))
    world.fabric(0).service("late", main)
    t0 = time.monotonic()
    world.close()                             # joins the service thread (up to the network's timeout)
    assert time.monotonic() - t0 < 10


def _sleeps_in_the_loop(seconds):
    time.sleep(seconds)                       # wall time inside the loop, no modelled time
    return
    yield


def test_wall_time_spent_in_the_loop_does_not_count_against_a_threads_wait():
    # a simulation of many workers may run its loop longer than the network's timeout_s of wall time; a
    # thread whose call is still pending after such a run (here rank 0's receive, which only rank 1's next
    # call completes) is not timed out: only wall time with the loop idle counts
    def fn(ctx):
        if ctx.rank == 0:
            x = torch.zeros(2)
            ctx.fabric.recv(x, 1, 7)
            return x.tolist()
        inbox = Inbox(ctx.fabric, Pool())
        ctx.fabric.drive([_sleeps_in_the_loop(1.0)], inbox, Outbox(ctx.fabric, inbox.pool))
        time.sleep(0.1)                       # rank 0's thread sees the first run end with its call pending
        ctx.fabric.send(torch.ones(2), 0, 7)
        return None

    assert sc.launch(fn, 2, network=sc.Network(timeout_s=0.3))[0] == [1.0, 1.0]


def test_a_worker_stuck_in_its_own_code_times_the_others_out_in_wall_time():
    from sparsecomm.errors import FabricTimeout

    def fn(ctx):
        if ctx.rank == 1:
            time.sleep(2.0)                   # never hands a call to the world within the timeout
            return None
        ctx.fabric.recv(torch.zeros(1), 1, 7)

    t0 = time.monotonic()
    with pytest.raises(FabricTimeout, match=r"s \(wall\)"):
        sc.launch(fn, 2, network=sc.Network(timeout_s=0.3))
    assert time.monotonic() - t0 < 30


# ----------------------------------------------------------------------------- who raised
def _faulty_launch(n: int, target: int, break_role: bool) -> tuple[BaseException, dict]:
    """Run the randomized roles of :mod:`tests.fabric.test_sim_roles` on ``n`` workers, with a fault on endpoint
    ``target`` only (``break_role``: its roles raise; else its drive's wait set, patched by the caller): the
    error the launch raises, and what each rank raised."""
    from tests.fabric.test_sim_roles import _plan, _protocol

    plan = _plan(0, n)
    seen: dict = {}

    def fn(ctx):
        if break_role and ctx.rank == target:
            real = ctx.fabric.drive

            def drive(rs, inbox, outbox, **kw):
                def broken(role):
                    yield next(role)
                    raise IndexError("broken role")
                real([broken(r) for r in rs], inbox, outbox, **kw)
            ctx.fabric.drive = drive
        try:
            return _protocol(ctx, plan, False)
        except BaseException as exc:
            seen[ctx.rank] = exc
            raise

    with pytest.raises(IndexError) as info:
        sc.launch(fn, n, network=sc.Network(bandwidth_gbps=10, latency_us=2, timeout_s=20))
    return info.value, seen


def _check_blamed(exc: BaseException, seen: dict, n: int, target: int) -> None:
    assert f"(raised on endpoint {target} of {n} workers)" in exc.__notes__
    assert seen[target] is exc
    assert sorted(seen) == list(range(n))          # every rank raised, none hung
    for r in set(range(n)) - {target}:
        assert isinstance(seen[r], sc.errors.PeerFailure) and f"worker{target} failed: IndexError" in str(seen[r])


@pytest.mark.parametrize("target", [0, 3])
@pytest.mark.parametrize("where", ["arrived", "taken", "event", "choose"])
def test_an_error_of_an_endpoints_wait_set_is_that_endpoints_whichever_thread_runs_the_loop(monkeypatch, where,
                                                                                         target):
    # the wait set's records of a drive are touched by the loop (in the thread of whichever worker parked last)
    # and by the senders of its messages: an error there is the drive's endpoint's, on every rank, not a hang
    from sparsecomm.fabric.sim import sim_roles

    real = getattr(sim_roles.RoleWaits, where)

    def broken(self, *args, **kwargs):
        if self.ep.id == target:
            raise IndexError(f"broken {where}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sim_roles.RoleWaits, where, broken)
    exc, seen = _faulty_launch(6, target, break_role=False)
    assert str(exc) == f"broken {where}"
    _check_blamed(exc, seen, 6, target)
    assert f"(raised by the simulated world's loop on worker{target}'s wait)" in exc.__notes__


@pytest.mark.parametrize("target", [0, 3])
def test_an_error_of_a_role_names_its_endpoint_and_the_role(target):
    exc, seen = _faulty_launch(6, target, break_role=True)
    assert str(exc) == "broken role"
    _check_blamed(exc, seen, 6, target)
    assert any(n.startswith("(raised by role ") and n.endswith(f".broken of endpoint {target})") for n in exc.__notes__)


def _switch_times(ctx) -> list:
    t = sc.transports.get("switch", ctx.fabric, timeout=2e-5)     # (deadlines that fire during the run too)
    x = torch.randn(64 * 700, generator=torch.Generator().manual_seed(ctx.rank))
    y = t.allreduce(x)
    return [t.last_stats.modelled_time_s, t.last_stats.messages, y]


def test_the_heap_drops_the_deadlines_that_messages_ended_and_every_modelled_time_stays(monkeypatch):
    """Each switch packet's retransmission timer is a receive with a deadline that its result ends, leaving its
    deadline's heap entry behind (one per packet and worker); the heap drops such stale entries once it holds
    twice the live ones (past ``HEAP_FLOOR``): the same events in the same order, the same modelled times."""
    from sparsecomm.fabric.sim import sim_world

    net = sc.Network(bandwidth_gbps=100, latency_us=2, loss=0.03, seed=5)
    monkeypatch.setattr(sim_world, "HEAP_FLOOR", 1 << 40)        # never compacted
    kept = sc.launch(_switch_times, 4, backend="sim", network=net)
    monkeypatch.setattr(sim_world, "HEAP_FLOOR", 8)
    compactions, compact = [], sim_world.World._compact

    def counted(self):
        compactions.append(len(self._heap))
        compact(self)

    monkeypatch.setattr(sim_world.World, "_compact", counted)
    dropped = sc.launch(_switch_times, 4, backend="sim", network=net)
    assert len(compactions) >= 10            # (4 workers x ~1000 packets: dozens of passes at a cap of 8)
    for a, b in zip(kept, dropped):
        assert a[:2] == b[:2]
        assert torch.equal(a[2], b[2])
