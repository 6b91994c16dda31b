"""OmniReduce endpoints' scheduler and message plumbing: the requests a role yields, :func:`drive`
(the one scheduler of an endpoint), pooled buffers, receives posted ahead, asynchronous sends.

A role (:mod:`.core`) is a generator; it yields typed requests (:class:`Send`, :class:`Post`,
:class:`PostInto`, :class:`Hand`, :class:`Recv`, :class:`Poll`, :class:`Spawn`) and never touches the
fabric itself. Nothing here knows the protocol, only ``(key, buffer)`` pairs on a
:class:`~sparsecomm.fabric.base.Fabric`.
"""

from __future__ import annotations

from typing import Generator, NamedTuple

import torch

from ...fabric.base import Fabric
from ...errors import ProtocolError
from . import wire

__all__ = ["Inbox", "Outbox", "Pool", "Send", "Post", "PostInto", "Hand", "Recv", "Poll", "Spawn", "drive"]


class Pool:
    """Message buffers reused across rounds and calls, keyed by their role.

    Fresh large buffers cost page faults on first touch (tens of ms per 100 MB), more than the copy
    itself; an endpoint keeps one buffer per role (grown on demand) and reuses it once every send that
    used it has completed (:meth:`hold` records the sends, :meth:`get` waits for them).
    """

    def __init__(self) -> None:
        self._bufs: dict = {}
        self._busy: dict = {}

    def get(self, key, nbytes: int) -> torch.Tensor:
        for wk in self._busy.pop(key, ()):
            wk.wait()
        b = self._bufs.get(key)
        if b is None or b.numel() < nbytes:
            b = torch.empty(nbytes, dtype=torch.uint8)
            self._bufs[key] = b
        return b[:nbytes]

    def hold(self, key, work) -> None:
        self._busy.setdefault(key, []).append(work)

    def busy(self, key) -> list:
        """The sends still holding the send buffer of role ``key`` (:meth:`get` would wait for them; none
        for ``key=None``)."""
        return [w for w in self._busy.get(("out", key), ()) if not w.is_completed()]

    def release(self) -> None:
        """Forget the completed sends (call after waiting for them all)."""
        self._busy.clear()

    def nbytes(self) -> int:
        """Bytes of the buffers this pool holds (an endpoint's message memory; they are kept for reuse)."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class Inbox:
    """Receives posted ahead of need, so that a real fabric moves the data while this endpoint works on
    something else; messages from the colocated peer are ``put`` directly. Receives on one
    ``(source, tag)`` must be posted in the order the source sends them."""

    def __init__(self, fabric: Fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        self._box: dict = {}

    def post(self, key, nbytes: int, src: int, tag: int) -> None:
        buf = self.pool.get(("in", key), nbytes)
        self._box[key] = (self.fabric.irecv(buf, src, tag), buf)

    def post_into(self, key, buf: torch.Tensor, src: int, tag: int) -> None:
        """Receive straight into ``buf`` (contiguous bytes, e.g. a view of the result)."""
        self._box[key] = (self.fabric.irecv(buf, src, tag), buf)

    def put(self, key, buf: torch.Tensor) -> None:
        self._box[key] = (None, buf)

    def work(self, key):
        """The pending receive of ``key`` (``None`` if it was put locally); ``KeyError`` if none."""
        return self._box[key][0]

    def has(self, key) -> bool:
        """Is a receive of ``key`` posted, or its message put here?"""
        return key in self._box

    def ready(self, key) -> bool:
        """Has the message of ``key`` arrived (or been put locally)?"""
        work = self._box[key][0]
        return work is None or work.is_completed()

    def pending(self, keys) -> list:
        """The receives of ``keys`` (each posted or put) that have not completed yet."""
        out = []
        for k in keys:
            work = self._box[k][0]
            if work is not None and not work.is_completed():
                out.append(work)
        return out

    def take(self, key) -> torch.Tensor:
        work, buf = self._box.pop(key)
        if work is not None:
            work.wait()
        return buf


class Outbox:
    """Asynchronous sends; a pooled buffer is not reused before its sends have completed."""

    def __init__(self, fabric: Fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        self.pending: list = []

    def message(self, key, k: int, block_size: int, dtype: torch.dtype, extra: int = 0, meta: bool = True):
        """A pooled block message ``(buffer, blocks view, int32 tail view)``, see :func:`wire.split`."""
        buf = self.pool.get(("out", key), wire.block_bytes(k, block_size, dtype.itemsize, extra, meta))
        data, tail = wire.split(buf, k, block_size, dtype, extra, meta)
        return buf, data, tail

    def send(self, buf: torch.Tensor, dst: int, tag: int, key=None, deferrable: bool = False) -> None:
        wk = self.fabric.isend(buf, dst, tag)
        self.pending.append((wk, buf, deferrable))
        if key is not None:
            self.pool.hold(("out", key), wk)

    def reap(self, keep: int = 64) -> None:
        """Wait for all but the newest ``keep`` sends, except the ``deferrable`` ones, left to
        :meth:`finish`: the receiver may post their receives only once its window (:mod:`.window`) has
        room, which may wait for this endpoint's own later steps (a wait for them here could be circular)."""
        cut = len(self.pending) - keep
        if cut > 0:
            for wk, _, deferrable in self.pending[:cut]:
                if not deferrable:
                    wk.wait()
            self.pending[:cut] = [p for p in self.pending[:cut] if p[2]]

    def finish(self) -> None:
        """Wait for every send (the call's last step: all of them complete by then)."""
        for wk, _, _ in self.pending:
            wk.wait()
        self.pending.clear()
        self.pool.release()


# ----------------------------------------------------------------------------------------- requests
# A role (a generator: one side of the protocol, see :mod:`.core`) yields these to :func:`drive`.
# Send, Post, PostInto, Hand and Spawn never block: the scheduler performs them and resumes the role at
# once. Recv suspends it until its messages are in; Poll lets the others run meanwhile.


class Send(NamedTuple):
    """Send ``buf`` to endpoint ``dst`` on ``tag`` (asynchronous). ``hold``: the role of the pooled
    buffer (:class:`.wire.Buf`), which is not reused before this send has completed. ``deferrable``: the
    receiver takes it through a window (:mod:`.window`) and may post its receive late (a reap does not
    wait for it, :meth:`Outbox.reap`)."""

    buf: torch.Tensor
    dst: int
    tag: int
    hold: object = None
    deferrable: bool = False


class Post(NamedTuple):
    """Post the receive of message ``key``: ``nbytes`` from ``src`` on ``tag``, into a pooled buffer."""

    key: object
    nbytes: int
    src: int
    tag: int


class PostInto(NamedTuple):
    """Post the receive of message ``key`` straight into ``buf`` (contiguous bytes, e.g. the result's)."""

    key: object
    buf: torch.Tensor
    src: int
    tag: int


class Hand(NamedTuple):
    """Hand message ``key`` to another role of this endpoint (no fabric: it is in at once)."""

    key: object
    msg: object


class Recv(NamedTuple):
    """Suspend until the messages ``keys`` are in; the role then ``take``s them from the inbox. A role
    takes only messages its ``Recv`` named (``tests/transports/omnireduce/test_omnireduce_core.py``
    holds it), so the scheduler never blocks in a take it did not choose while another role's messages are
    in (e.g. a worker on a large round-0 sum while its hosted aggregator's data waits to be summed).

    The role can run only once every key is posted or handed over, and none of ``gone`` is still
    waiting to be taken (a local hand-over that a new one would replace). ``order``: preference
    among the roles that can run (smaller first). ``any``: resume once any one of them is in (or at
    once, as any other, when it is the only role able to run: it then takes them in order).
    ``reap``: before choosing among roles, :func:`drive` finishes all but ``keep`` of this endpoint's
    sends if every one of them waits with ``reap`` (the lane rounds; not round 0: the round-0 sends to an
    aggregator that rejected the call complete only after this worker's manifest,
    :meth:`.aggregator.AggCall.drain`; and not while a role without it, e.g. a verdict that posts the
    receives of an aggregator's replies, can still run: a dedicated deployment's worker, ``keep=0``,
    would otherwise wait for all its round-0 blocks to leave before posting the second aggregator's
    receives, and that aggregator's sums would wait for them). ``sure``: every peer sends these messages before its first
    wait (round 0 up), so a blocking take of them ends whatever this endpoint does: when the role is the
    most preferred one able to run, it is resumed at once (no watch for their arrival: on gloo that
    costs a helper thread per receive, :mod:`sparsecomm.fabric.torch.torch_waiters`); a ``Poll`` skips it
    (a poll never blocks: the poller may not have sent its own round 0 yet)
    A role that is the only one able to run is resumed at once: its takes then block in order, so that
    it works on the first messages while the later ones arrive.

    ``free``: also wait until the sends holding the pooled send buffer of that role (:class:`.wire.Buf`)
    have completed, so that the role then reuses it without blocking while another role could run (a
    send completes once the peer has posted its receive, which it may do only once its own roles run:
    two endpoints each blocked on such a send to the other would wait forever). As the only role able to
    run it is resumed at once, as any other, and waits in the pool: nothing else here could run."""

    keys: tuple
    order: tuple = ()
    gone: tuple = ()
    any: bool = False
    reap: bool = False
    sure: bool = False
    free: object = None


class Poll(NamedTuple):
    """Run every other role whose messages are in already, then resume (between pieces of long local
    work, so that receives that depend on arrived messages get posted meanwhile). ``below``: only the
    roles whose ``Recv.order`` is smaller (the cheap ones that post receives or send; work that is off
    the polling role's critical path waits until it is done). Never the ``sure`` ones: a poll never
    blocks (the scheduler resumes them later)."""

    below: tuple | None = None


class Spawn(NamedTuple):
    """Start another role on this endpoint (run at once up to its first wait)."""

    role: Generator


def drive(fabric: Fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64) -> None:
    """The one scheduler of an endpoint: run the roles (generators yielding the requests above) until
    every one has returned. While some wait, run the first (in ``Recv.order``) of those able to run whose
    messages are in by the time the first such is (:meth:`Fabric.wait_any`), finishing all but ``keep``
    of the sends first (``Recv.reap``). A role's exception ends the call (it propagates to the caller).

    Deadlock freedom, held by this structure rather than by any hand-made order: (1) sends never block (Send
    is asynchronous, Hand is a local put), and a role reuses a pooled send buffer only once the scheduler
    has seen its sends complete (``Recv.free``: a send completes once its receive is posted, which a peer
    may do only as its own lanes run, so a role blocking on it could wait for a peer blocked the same way),
    and a reap waits only for sends whose receives are posted without this endpoint's later steps (not the
    ``deferrable`` ones: an aggregator's window may post them only after other workers' messages, whose
    senders may wait for this one); (2) every Recv waits only for messages sent by steps that do not wait on
    it: a worker's round ``r`` answers its aggregator's round ``r - 1``, which it has received, and an
    aggregator's round ``r`` waits for the up-messages its holders send on receipt of round ``r - 1``, which
    it has sent; round 0 waits only for what every worker sends before its first wait (the headers, first
    look-aheads, position-0 blocks) and for the verdicts sent on them; a hand-over between two roles of one
    endpoint is in once handed, and ``gone`` waits only for a take by a role that can run at once; (3) the
    scheduler never blocks on one role while another could run, unless the one's messages come whatever this
    endpoint does (a role is a candidate only once every message it waits for is posted or handed over, and
    it blocks only on the one candidate, on a ``sure`` one, or on whichever candidate completes first). So
    every wait ends, on any fabric and whatever its buffering; a role left with nothing to run is a bug,
    reported as such.
    """
    _Scheduler(fabric, inbox, outbox).run(roles, keep)


class _Scheduler:
    """:func:`drive`'s state: the suspended roles, each with the :class:`Recv` it waits on."""

    def __init__(self, fabric: Fabric, inbox: Inbox, outbox: Outbox) -> None:
        self.fabric, self.inbox, self.outbox = fabric, inbox, outbox
        self.waiting: list = []     # [role, Recv], in the order the roles were started
        self.polling = False

    def run(self, roles: list, keep: int) -> None:
        for role in roles:
            self.advance(role)
        while self.waiting:
            cands = self.runnable()
            if not cands:
                raise ProtocolError("omnireduce: no role of this call can run (a bug)")
            if all(rw[1].reap for rw in cands):
                self.outbox.reap(keep)
            if len(cands) == 1 or cands[0][1].sure:   # the only one, or sure: its own takes block
                self.resume(cands[0])
                continue
            groups, owner = [], []   # per candidate its pending receives; an ``any`` one, each alone
            for i, (_, req) in enumerate(cands):
                pend = self.inbox.pending(req.keys) + self.outbox.pool.busy(req.free)
                if req.any and len(pend) == len(req.keys):
                    groups += [[w] for w in pend]
                    owner += [i] * len(pend)
                else:
                    groups.append([] if req.any else pend)
                    owner.append(i)
            self.resume(cands[owner[self.fabric.wait_any(groups)]])

    def advance(self, role) -> None:
        """Run ``role`` until it waits (or returns), performing its non-blocking requests."""
        inbox, outbox = self.inbox, self.outbox
        while True:
            try:
                req = next(role)
            except StopIteration:
                return
            t = type(req)
            if t is Send:
                outbox.send(req.buf, req.dst, req.tag, key=req.hold, deferrable=req.deferrable)
            elif t is Post:
                inbox.post(req.key, req.nbytes, req.src, req.tag)
            elif t is PostInto:
                inbox.post_into(req.key, req.buf, req.src, req.tag)
            elif t is Hand:
                inbox.put(req.key, req.msg)
            elif t is Spawn:
                self.advance(req.role)
            elif t is Poll:
                if not self.polling:
                    self.polling = True
                    try:
                        self.poll(req.below)
                    finally:
                        self.polling = False
            elif t is Recv:
                self.waiting.append([role, req])
                return
            else:
                raise ProtocolError(f"omnireduce: a role asked for {req!r} (a bug)")

    def runnable(self) -> list:
        """The roles that can run (every awaited message posted or handed over, no ``gone`` one left),
        in order of preference."""
        has = self.inbox.has
        return sorted((rw for rw in self.waiting if all(has(k) for k in rw[1].keys)
                       and not any(has(k) for k in rw[1].gone)), key=lambda rw: rw[1].order)

    def resume(self, rw) -> None:
        self.waiting.remove(rw)
        self.advance(rw[0])

    def poll(self, below: tuple | None = None) -> None:
        """Run the roles whose messages are in already (without blocking), best first, until none is
        (``below``: only those whose order is smaller)."""
        ready, has = self.inbox.ready, self.inbox.has
        while True:   # (the roles at or past ``below`` are skipped before any look at their messages)
            now = sorted((rw for rw in self.waiting if (below is None or rw[1].order < below)
                          and all(has(k) for k in rw[1].keys) and not any(has(k) for k in rw[1].gone)
                          and not rw[1].sure and (any if rw[1].any else all)(ready(k) for k in rw[1].keys)
                          and not self.outbox.pool.busy(rw[1].free)),
                         key=lambda rw: rw[1].order)
            if not now:
                return
            self.resume(now[0])
