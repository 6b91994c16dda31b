"""The OmniReduce scheduler (:func:`sparsecomm.transports.omnireduce.mailbox.drive`) on its own: roles
are generators yielding typed requests; the scheduler runs whichever can, in preference order, lets
others run while one polls, holds a hand-over's consumer back until it is taken (``gone``), and reports
a role that can never run as a bug instead of hanging."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import ProtocolError
from sparsecomm.transports.omnireduce.mailbox import (Hand, Inbox, Outbox, Pool, Poll, Post, Recv, Send,
                                                      Spawn, drive)


class _LocalFabric:
    """Enough of a fabric for roles that only hand messages to each other."""

    rank, world_size = 0, 1

    def wait_any(self, groups):
        for i, g in enumerate(groups):
            if all(w.is_completed() for w in g):
                return i
        raise AssertionError("a local-only schedule waited for a fabric operation")


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
            yield Recv((("pong", r),), order=(1, r))
            log.append(("ping got", _inbox[0].take(("pong", r))))

    def pong():
        for r in range(3):
            yield Recv((("ping", r),), order=(0, r))
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
        yield Recv((("never", 0),))

    with pytest.raises(ProtocolError, match="no role"):
        _run([stuck()])
    with pytest.raises(ProtocolError, match="asked for"):
        _run([iter([("not", "a request")])])


def test_gone_holds_a_producer_until_its_last_hand_over_is_taken_and_poll_lets_others_run():
    log = []
    box = [None]

    def producer():   # may hand round r+1 only once round r has been taken
        for r in range(3):
            yield Recv((), order=(0,), gone=(("msg",),))
            log.append(f"hand {r}")
            yield Hand(("msg",), r)

    def consumer():
        for r in range(3):
            yield Recv((("msg",),), order=(1,))
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
        yield Recv((("x", peer),), order=(peer,))
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
    role's messages are in (a hosted aggregator's data waiting behind its worker's take)."""
    import threading

    from sparsecomm.transports.omnireduce import mailbox

    local, bad = threading.local(), []
    resume, take = mailbox._Scheduler.resume, mailbox.Inbox.take

    def spy_resume(self, rw):
        stack = local.__dict__.setdefault("stack", [])
        stack.append(set(rw[1].keys))
        try:
            resume(self, rw)
        finally:
            stack.pop()

    def spy_take(self, key):
        stack = getattr(local, "stack", [])
        if not stack or key not in stack[-1]:
            bad.append(key)
        return take(self, key)

    monkeypatch.setattr(mailbox._Scheduler, "resume", spy_resume)
    monkeypatch.setattr(mailbox.Inbox, "take", spy_take)
    out = sc.launch(functools.partial(_sums, deployment=deployment), 3,
                    network=sc.Network(bandwidth_gbps=100, latency_us=2))
    assert out == [[True] * 3] * 3
    assert bad == []
