"""The fast driver's scheduler and message plumbing: the requests a role yields, what a wait is for
(:class:`Stage`, :class:`Phase`), :func:`drive` (the one scheduler of an endpoint), pooled buffers,
receives posted ahead, asynchronous sends.

A role (:mod:`.worker`, :mod:`.aggregator`) is a generator; it yields typed requests (:class:`Send`,
:class:`Post`, :class:`PostInto`, :class:`Hand`, :class:`Recv`, :class:`Poll`, :class:`Spawn`) and never
touches the fabric itself. Nothing here reads a message: the scheduler sees ``(key, buffer)`` pairs on a
:class:`~sparsecomm.fabric.base.Fabric` and the stage of each wait. Its rules and the argument that
they cannot deadlock: ``docs/omnireduce-scheduler.md``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Generator, NamedTuple

import torch

from ...fabric.base import Fabric
from ...errors import ProtocolError
from . import wire

__all__ = ["Inbox", "Outbox", "Pool", "Phase", "Stage", "Send", "Post", "PostInto", "Hand", "Recv", "Poll", "Spawn",
           "drive"]


class Pool:
    """Message buffers reused across rounds and calls, keyed by their role.

    Fresh large buffers cost a page fault per page on first touch, more than the copy into them: an
    endpoint keeps one buffer per role (grown on demand) and reuses it once every send that used it has
    completed (:meth:`hold` records the sends, :meth:`get` waits for them).
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
        self._observer = None

    def observe(self, observer) -> None:
        """Call ``observer(key, present)`` whenever a key is posted or put (``present=True``) or taken
        (``False``); ``None`` stops it."""
        self._observer = observer

    def _add(self, key, entry) -> None:
        new = key not in self._box
        self._box[key] = entry
        if new and self._observer is not None:
            self._observer(key, True)

    def post(self, key, nbytes: int, src: int, tag: int) -> None:
        buf = self.pool.get(("in", key), nbytes)
        self._add(key, (self.fabric.irecv(buf, src, tag), buf))

    def post_into(self, key, buf: torch.Tensor, src: int, tag: int) -> None:
        """Receive straight into ``buf`` (contiguous bytes, e.g. a view of the result)."""
        self._add(key, (self.fabric.irecv(buf, src, tag), buf))

    def put(self, key, buf: torch.Tensor) -> None:
        self._add(key, (None, buf))

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
        if self._observer is not None:
            self._observer(key, False)
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


# ----------------------------------------------------------------------------------------- waits
class Phase(IntEnum):
    """What a role waits for; the scheduler prefers an earlier phase (``docs/omnireduce-scheduler.md``,
    rule 1). The first five are an aggregator's admission of a call, one role, in the order it meets
    them; round-0 data (every worker sends it before its first wait) are :data:`FIRSTS`, :data:`DRAIN`
    and round 0 of :data:`AGGREGATE`."""

    HEADERS = 0     #: aggregator: the workers' round-0 headers
    FIRSTS = 1      #: aggregator: a worker's first look-aheads
    MANIFESTS = 2   #: aggregator, after a verdict that is not OK: the workers' manifests
    DRAIN = 3       #: aggregator, after a verdict that is not OK: a round-0 message a manifest lists
    GO = 4          #: colocated aggregator: its host has taken the verdict (a hand-over)
    VERDICT = 5     #: worker: an aggregator's verdict
    AGGREGATE = 6   #: aggregator: a lane round's blocks from their holders
    LAND = 7        #: worker: a lane round's sums


class Stage(NamedTuple):
    """What a wait is for: its :class:`Phase` and, in a lane, the round, the channel's slot and the
    aggregator's place in the worker's visit order. Stages compare as tuples (phase, round, slot,
    visit): the scheduler resumes the smallest of the roles able to run."""

    phase: Phase
    round: int = 0
    slot: int = 0
    visit: int = 0

    @property
    def sure(self) -> bool:
        """Does it wait for round-0 data (sent by every worker before its first wait)?"""
        return self.phase == Phase.FIRSTS or self.phase == Phase.DRAIN or (
            self.phase == Phase.AGGREGATE and self.round == 0)

    @property
    def reaps(self) -> bool:
        """Is it a lane round's wait (before which this endpoint's sends may be reaped)?"""
        return self.phase >= Phase.AGGREGATE


# ----------------------------------------------------------------------------------------- requests
# A role (a generator: one side of the protocol) yields these to :func:`drive`. Send, Post, PostInto,
# Hand and Spawn never block: the scheduler performs them and resumes the role at once. Recv suspends it
# until its messages are in; Poll lets the others run meanwhile.


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
    """Suspend the role until the messages ``keys`` are in; the role then takes them, and only them,
    from the inbox. ``stage``: what it waits for; it orders the roles able to run, decides whether this
    endpoint's sends are reaped first (:attr:`Stage.reaps`) and whether the role is resumed to block in
    its takes at once (:attr:`Stage.sure`). The role is able to run once every key is posted or handed
    over, no key of ``gone`` is still waiting to be taken, and no send holding the pooled send buffer of
    role ``free`` (:class:`.wire.Buf`) is incomplete. ``any``: it is in once any one of ``keys`` is.
    The rules and why each exists: ``docs/omnireduce-scheduler.md``."""

    keys: tuple
    stage: Stage
    gone: tuple = ()
    any: bool = False
    free: object = None


class Poll(NamedTuple):
    """Run every other role whose messages are in already, then resume (between pieces of long local
    work). ``below``: only the roles of an earlier phase. A poll never blocks: it skips the roles whose
    wait is :attr:`~Stage.sure`."""

    below: Phase | None = None


class Spawn(NamedTuple):
    """Start another role on this endpoint (run at once up to its first wait)."""

    role: Generator


def drive(fabric: Fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64) -> None:
    """The one scheduler of an endpoint: run the roles (generators yielding the requests above) until
    every one has returned. While some wait, resume the first (by :class:`Stage`) of those able to run
    whose messages are in by the time the first such is (:meth:`Fabric.wait_any`); the only one able to
    run, or a preferred one whose wait is :attr:`~Stage.sure`, at once. Before choosing, when every role
    able to run waits in a lane round (:attr:`Stage.reaps`), finish all but ``keep`` of this endpoint's
    sends. A role's exception ends the call (it propagates to the caller); a role that can never run is
    a bug, reported as :class:`~sparsecomm.errors.ProtocolError`. It never blocks on one role while
    another could run, unless on messages that come whatever this endpoint does: every wait ends, on
    any fabric (``docs/omnireduce-scheduler.md``)."""
    _Scheduler(fabric, inbox, outbox).run(roles, keep)


class _Scheduler:
    """:func:`drive`'s state: the suspended roles, each with the :class:`Recv` it waits on, and which of
    them are able to run (rule R1 without ``free``), kept per change of the inbox: a role counts the
    conditions it still lacks (a key not posted, a ``gone`` key not taken), and a key posted, put or
    taken updates only the roles that wait on it."""

    def __init__(self, fabric: Fabric, inbox: Inbox, outbox: Outbox) -> None:
        self.fabric, self.inbox, self.outbox = fabric, inbox, outbox
        self.waiting: dict = {}     # sequence number -> [role, Recv]; in the order the roles began to wait
        self.lacks: dict = {}       # sequence number -> conditions of R1 not met yet
        self.able: set = set()      # sequence numbers with none lacking
        self.watchers: dict = {}    # key -> [(sequence number, True for a key awaited / False for gone)]
        self.seq = 0
        self.polling = False

    def run(self, roles: list, keep: int) -> None:
        self.inbox.observe(self.changed)
        try:
            self._run(roles, keep)
        finally:
            self.inbox.observe(None)

    def _run(self, roles: list, keep: int) -> None:
        for role in roles:
            self.advance(role)
        while self.waiting:
            cands = self.runnable()
            if not cands:
                raise ProtocolError("omnireduce: no role of this call can run (a bug)")
            if all(rw[1].stage.reaps for _, rw in cands):
                self.outbox.reap(keep)
            if len(cands) == 1 or cands[0][1][1].stage.sure:   # the only one, or sure: its own takes block
                self.resume(cands[0][0])
                continue
            groups, owner = [], []   # per candidate its pending receives; an ``any`` one, each alone
            for s, (_, req) in cands:
                pend = self.inbox.pending(req.keys) + self.outbox.pool.busy(req.free)
                if req.any and len(pend) == len(req.keys):
                    groups += [[w] for w in pend]
                    owner += [s] * len(pend)
                else:
                    groups.append([] if req.any else pend)
                    owner.append(s)
            self.resume(owner[self.fabric.wait_any(groups)])

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
                self.wait(role, req)
                return
            else:
                raise ProtocolError(f"omnireduce: a role asked for {req!r} (a bug)")

    def wait(self, role, req: Recv) -> None:
        """Suspend ``role`` on ``req``: count what it lacks, and watch its keys."""
        s = self.seq = self.seq + 1
        has = self.inbox.has
        self.waiting[s] = [role, req]
        self.lacks[s] = sum(not has(k) for k in req.keys) + sum(has(k) for k in req.gone)
        if not self.lacks[s]:
            self.able.add(s)
        for k in req.keys:
            self.watchers.setdefault(k, []).append((s, True))
        for k in req.gone:
            self.watchers.setdefault(k, []).append((s, False))

    def changed(self, key, present: bool) -> None:
        """The inbox's observer: ``key`` was posted or put (``present``) or taken."""
        for s, awaited in self.watchers.get(key, ()):
            n = self.lacks[s] + (-1 if awaited == present else 1)
            self.lacks[s] = n
            if n:
                self.able.discard(s)
            else:
                self.able.add(s)

    def runnable(self) -> list:
        """``(sequence number, [role, Recv])`` of the roles that can run (every awaited message posted or
        handed over, no ``gone`` one left), in order of preference (stage; then the order they began to
        wait)."""
        waiting = self.waiting
        return sorted(((s, waiting[s]) for s in self.able), key=lambda e: (e[1][1].stage, e[0]))

    def resume(self, s: int) -> None:
        role, req = self.waiting.pop(s)
        del self.lacks[s]
        self.able.discard(s)
        for k in req.keys + req.gone:
            w = self.watchers[k]
            w[:] = [e for e in w if e[0] != s]
            if not w:
                del self.watchers[k]
        self.advance(role)

    def poll(self, below: Phase | None = None) -> None:
        """Run the roles whose messages are in already (without blocking), best first, until none is
        (``below``: only those of an earlier phase)."""
        ready, waiting = self.inbox.ready, self.waiting
        while True:   # (the roles at or past ``below``, and sure ones, are skipped before any look at their messages)
            now = min((e for e in ((s, waiting[s]) for s in self.able)
                       if (below is None or e[1][1].stage.phase < below) and not e[1][1].stage.sure
                       and (any if e[1][1].any else all)(ready(k) for k in e[1][1].keys)
                       and not self.outbox.pool.busy(e[1][1].free)),
                      key=lambda e: (e[1][1].stage, e[0]), default=None)
            if now is None:
                return
            self.resume(now[0])
