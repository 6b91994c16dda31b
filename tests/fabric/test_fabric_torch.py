"""TorchFabric over gloo, in real processes: the Fabric contract (tags, any source, views, timeouts that
leave the channel usable, is_completed, barrier over workers only, services, stats).

All point-to-point checks run in one launched function (``p2p_checks``) that returns its problems.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import FabricTimeout, IncompatibleError, MismatchError
from sparsecomm.fabric import services
from sparsecomm.errors import ServiceShutdown

pytestmark = pytest.mark.multiprocess


def _expect(problems, label, cond, detail=""):
    if not cond:
        problems.append(f"{label} {detail}")


def p2p_checks(ctx) -> list[str]:
    from sparsecomm.fabric.base import express
    from sparsecomm.fabric.torch.torch_fabric import TorchFabric

    f = ctx.fabric
    r, n = ctx.rank, ctx.world_size
    problems: list[str] = []
    _expect(problems, "context", sc.current_context() is ctx and isinstance(f, TorchFabric))
    _expect(problems, "device", f.device == torch.device("cpu") and ctx.device == f.device)
    t0 = f.now()

    # tags are matched independently: 0 sends tag 2 then tag 1, 1 receives tag 1 first
    if r == 0:
        w = f.isend(torch.tensor([2.0]), 1, tag=2)
        f.send(torch.tensor([1.0]), 1, tag=1, reliable=False)
        w.wait()
    elif r == 1:
        a, b = torch.zeros(1), torch.zeros(1)
        f.recv(a, 0, tag=1)
        f.recv(b, 0, tag=2)
        _expect(problems, "tags", a.item() == 1.0 and b.item() == 2.0, (a, b))

    # express tags (fabric.base.express): between workers on the pair's other connection, which sender and
    # receiver agree on (a message on the wrong one is never taken: the wait times out); in order per tag, beside
    # the plain tag of the same number; a receive from any source on one is refused
    if r < 2:
        peer, xt = 1 - r, express(12)
        outs = [f.isend(torch.tensor([float(10 * r + i)]), peer, tag=xt) for i in range(3)]
        plain = f.isend(torch.tensor([-1.0 - r]), peer, tag=12)
        got, mine = [torch.zeros(1) for _ in range(3)], torch.zeros(1)
        ins = [f.irecv(got[i], peer, tag=xt) for i in range(3)]
        f.recv(mine, peer, tag=12, timeout=10)
        for w in [*ins, *outs, plain]:
            w.wait(timeout=10)
        _expect(problems, "express in order", [t.item() for t in got] == [10.0 * peer + i for i in range(3)], got)
        _expect(problems, "plain beside express", mine.item() == -1.0 - peer, mine)
    try:
        f.irecv(torch.zeros(1), None, tag=express(12))
        problems.append("an any-source receive on an express tag was accepted")
    except IncompatibleError as exc:
        _expect(problems, "express any-source refusal", "must name its source" in str(exc), exc)

    # receive from any source reports the source; with two-way channels it takes lower ranks' messages
    # (the highest rank receives from all the others), and rank 0, with no lower rank, is refused
    if r == n - 1:
        seen = set()
        for _ in range(n - 1):
            buf = torch.zeros(2, dtype=torch.int64)
            src = f.recv(buf, None, tag=5)
            _expect(problems, "any-source payload", buf.tolist() == [src, src * 10], (src, buf))
            seen.add(src)
        _expect(problems, "any-source sources", seen == set(range(n - 1)), seen)
    else:
        f.send(torch.tensor([r, r * 10]), n - 1, tag=5)
    if r == 0:
        try:
            f.irecv(torch.zeros(1), None, tag=5)
            problems.append("rank 0's any-source receive was accepted on two-way channels")
        except IncompatibleError as exc:
            _expect(problems, "any-source refusal names the way out", "two_way=False" in str(exc), exc)

    # two-way channels: large messages crossing on one pair both move at once (a receive posted after a
    # send to the same peer is not queued behind it), and messages of one direction stay in order
    if r < 2 and n >= 2:
        peer = 1 - r
        big_out = torch.full((1 << 20,), float(r + 1))
        big_in = torch.zeros(1 << 20)
        ws = f.isend(big_out, peer, tag=9)
        wr = f.irecv(big_in, peer, tag=9)
        small = [torch.zeros(1) for _ in range(3)]
        sends = [f.isend(torch.tensor([float(10 * r + i)]), peer, tag=10) for i in range(3)]
        recvs = [f.irecv(small[i], peer, tag=10) for i in range(3)]
        for w in [ws, wr, *sends, *recvs]:
            w.wait()
        _expect(problems, "crossing payload", bool((big_in == float(peer + 1)).all()), big_in[:2])
        _expect(problems, "order within a direction", [t.item() for t in small] == [10 * peer + i for i in range(3)],
                small)

    # non-contiguous tensors and views with a storage offset, both ways
    if r == 0:
        m = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        f.send(m.t(), 1, tag=6)                  # non-contiguous source
        f.send(m.reshape(-1)[5:9], 1, tag=6)     # view with an offset
    elif r == 1:
        m = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        out = torch.zeros(4, 3, dtype=torch.float64)
        f.recv(out, 0, tag=6)
        _expect(problems, "non-contiguous send", torch.equal(out, m.t()))
        big = torch.zeros(20, 2, dtype=torch.float64)
        f.recv(big[3:7, 1], 0, tag=6)            # non-contiguous destination
        _expect(problems, "strided recv", big[3:7, 1].tolist() == [5.0, 6.0, 7.0, 8.0] and big.sum() == 26)

    # a timed-out receive stays posted; the next receive on the channel gets the late message
    if r == 0:
        buf = torch.zeros(3)
        t1 = time.monotonic()
        try:
            f.recv(buf, 1, tag=9, timeout=0.3)
            problems.append("timeout: no FabricTimeout")
        except FabricTimeout as e:
            _expect(problems, "timeout message", "stays posted" in str(e), e)
        _expect(problems, "timeout duration", 0.25 < time.monotonic() - t1 < 5)
        try:   # a receive of another size on the same channel is a clear error, and leaves it intact
            f.recv(torch.zeros(2), 1, tag=9, timeout=0.1)
            problems.append("stale mismatch: no error")
        except MismatchError:
            pass
        f.barrier()
        late, later = torch.zeros(3), torch.zeros(3)
        src = f.recv(late, 1, tag=9)
        f.recv(later, 1, tag=9)
        _expect(problems, "adopted late message", src == 1 and late.tolist() == [42.0] * 3 and
                later.tolist() == [43.0] * 3, (late, later))
    else:
        f.barrier()
        if r == 1:
            f.send(torch.full((3,), 42.0), 0, tag=9)
            f.send(torch.full((3,), 43.0), 0, tag=9)

    # is_completed on a posted receive becomes true without wait(); wait returns the source
    if r == 0:
        buf = torch.zeros(4)
        w = f.irecv(buf, 1, tag=11)
        deadline = time.monotonic() + 10
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        _expect(problems, "is_completed", w.is_completed())
        _expect(problems, "irecv", w.wait() == 1 and buf.tolist() == [7.0] * 4, buf)
    elif r == 1:
        time.sleep(0.1)
        f.isend(torch.full((4,), 7.0), 0, tag=11).wait(timeout=10)

    # bad arguments
    for label, call in [("send to self", lambda: f.send(torch.zeros(1), r)),
                        ("negative tag", lambda: f.send(torch.zeros(1), (r + 1) % n, tag=-1)),
                        ("no such rank", lambda: f.recv(torch.zeros(1), n + 5))]:
        try:
            call()
            problems.append(f"{label}: no error")
        except ValueError:
            pass

    # the ring also runs over a fabric that groups sends with the next receive (nccl's mode)
    g = TorchFabric(n, timeout_s=30, coalesce=True)
    y = sc.transports.get("ring", g).allreduce(torch.full((10,), float(r + 1)))
    _expect(problems, "coalesced ring", torch.equal(y, torch.full((10,), n * (n + 1) / 2)), y)
    _expect(problems, "coalesced stats", g.stats.messages == g.stats.messages_received > 0)

    f.barrier()
    _expect(problems, "clock", f.now() > t0)
    _expect(problems, "stats", f.stats.bytes_sent > 0 and f.stats.messages > 0 and f.stats.bytes_received > 0)
    return problems


@pytest.mark.parametrize("n", [2, 3])
def test_torch_fabric_point_to_point(n):
    for rank, problems in enumerate(sc.launch(p2p_checks, n, backend="gloo", timeout_s=30)):
        assert not problems, f"rank {rank}: " + "\n".join(problems)


# --------------------------------------------------------------------------- services
def _echo_factory(arg):
    """A test service: doubles what it receives; on shutdown writes ``arg`` (a path) if given."""

    def main(fabric):
        served = 0
        try:
            while True:
                buf = torch.zeros(2)
                src = fabric.recv(buf, None, tag=7)
                fabric.send(buf * 2, src, tag=8)
                served += 1
        except ServiceShutdown:
            if arg:
                Path(arg).write_text(f"served {served}")
            raise

    return main


if "test-echo" not in services.registry:
    services.registry.register("test-echo")(_echo_factory)


def service_checks(ctx, path) -> list[str]:
    from sparsecomm.errors import ServiceNotStarted

    f = ctx.fabric
    problems: list[str] = []
    spec = f"test-echo:{path}"
    srank = f.service(spec, _echo_factory(None))
    _expect(problems, "service rank", srank == ctx.world_size and f.service("test-echo") == srank, srank)
    _expect(problems, "services()", f.services() == {spec: ctx.world_size}, f.services())
    for i in range(3):
        f.send(torch.tensor([ctx.rank, i], dtype=torch.float32), srank, tag=7)
        out = torch.zeros(2)
        f.recv(out, srank, tag=8)
        _expect(problems, "echo", out.tolist() == [2.0 * ctx.rank, 2.0 * i], out)
    f.barrier()                                  # workers only: the service is not in it
    y = sc.transports.get("native", f).allreduce(torch.ones(5))   # over the workers' subgroup
    _expect(problems, "native with a service", y.tolist() == [float(ctx.world_size)] * 5, y)
    y = sc.transports.get("ring", f).allreduce(torch.ones(5))
    _expect(problems, "ring with a service", y.tolist() == [float(ctx.world_size)] * 5, y)
    try:
        f.service("switch")
        problems.append("missing service: no error")
    except ServiceNotStarted as e:
        _expect(problems, "missing service message", "services=['switch']" in str(e), e)
    return problems


def test_services_are_extra_ranks_and_shut_down_when_workers_finish(tmp_path):
    path = tmp_path / "echo-shutdown.txt"
    t0 = time.perf_counter()
    out = sc.launch(functools.partial(service_checks, path=str(path)), 2, backend="gloo",
                    services=(f"test-echo:{path}",), timeout_s=30)
    for rank, problems in enumerate(out):
        assert not problems, f"rank {rank}: " + "\n".join(problems)
    # the service left its loop through ServiceShutdown (the workers' done-counter), not by being killed
    assert path.read_text() == "served 6"
    assert time.perf_counter() - t0 < 30


def _ask_for_missing_service(ctx):
    ctx.fabric.service("switch")


def test_service_not_started_is_a_clear_error():
    from sparsecomm.errors import ServiceNotStarted

    with pytest.raises(ServiceNotStarted, match=r"services=\['switch'\]"):
        sc.launch(_ask_for_missing_service, 2, backend="gloo", timeout_s=30)



# --------------------------------------------------------------------------- large sends
def _large_send(ctx) -> list:
    """A gloo send of at least WATCHED_SEND_BYTES is watched by a helper thread from its post; a smaller one
    is waited for on the calling thread (no helper); both deliver."""
    from sparsecomm.fabric.torch.torch_waiters import WATCHED_SEND_BYTES

    f, out = ctx.fabric, []
    for nbytes in (WATCHED_SEND_BYTES, WATCHED_SEND_BYTES // 2):
        n = nbytes // 4
        if ctx.rank == 0:
            wk = f.isend(torch.arange(n, dtype=torch.float32), 1, tag=11)
            out.append(wk._pend.waited)          # (the fabric's own record of the send)
            wk.wait()
            out.append(wk.is_completed())
        else:
            buf = torch.zeros(n)
            f.recv(buf, 0, tag=11)
            out.append(torch.equal(buf, torch.arange(n, dtype=torch.float32)))
    return out


def test_a_large_gloo_send_is_watched_from_its_post():
    got = sc.launch(_large_send, 2, backend="gloo", timeout_s=30)
    assert got == [[True, True, False, True], [True, True]]
