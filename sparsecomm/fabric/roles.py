"""Roles, what a fabric runs: a protocol's endpoint as generators that yield typed requests for their I/O,
and the one scheduler of an endpoint that performs them (:func:`drive`, what :meth:`.base.Fabric.drive` runs).

A role is a generator (one side of a protocol, or one part of an endpoint's work); it yields requests
(:class:`Send`, :class:`SendEach`, :class:`Post`, :class:`PostInto`, :class:`Hand`, :class:`Recv`, :class:`Poll`,
:class:`Spawn`, :class:`Flush`) and never touches the fabric itself. The roles of an endpoint share an :class:`Inbox`
(receives posted ahead of need, messages handed over locally), an :class:`Outbox` (asynchronous sends) and a
:class:`Pool` (message buffers reused across rounds and calls). Nothing here reads a message: the scheduler
sees ``(key, buffer)`` pairs and, for each wait, its :class:`Stage`, a value the protocol defines (what the
wait is for, how it is preferred; :class:`Step` where a protocol needs no preference of its own). The
scheduler's rules and the argument that they cannot deadlock: ``docs/omnireduce-scheduler.md`` (stated for
OmniReduce's roles, the first protocol written as roles; the rules are this module's). A ``fabric`` below
is a :class:`.base.Fabric` (not imported here: the contract imports this module).
"""

from __future__ import annotations

import bisect
import inspect
import time
from functools import partial
from itertools import chain, compress
from operator import itemgetter, methodcaller
from typing import Generator, Iterable, NamedTuple, Protocol

import torch

from ..errors import FabricTimeout, ProtocolError

__all__ = ["Pool", "Inbox", "Outbox", "Stage", "Step", "Send", "SendEach", "Post", "PostInto", "Hand", "Recv", "Poll",
           "Spawn", "Flush", "drive"]


_entry_work = itemgetter(0)     # an inbox entry's receive
_is_completed = methodcaller("is_completed")
_dict_keys = type({}.keys())    # an ``any`` wait's keys as the role's live dict view (:class:`Recv`)


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
        """The first ``nbytes`` of the buffer of role ``key`` (``uint8``), once every send holding it has
        completed; it grows if it is shorter."""
        busy = self._busy
        if key in busy:
            for wk in busy.pop(key):
                wk.wait()
        bufs = self._bufs
        b = bufs[key] if key in bufs else None
        if b is None:
            b = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8)
            return b
        size = b.numel()
        if size < nbytes:
            b = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8)
            return b
        return b if size == nbytes else b[:nbytes]     # (the whole buffer: no view to make)

    def hold(self, key, work) -> None:
        """Record that the send ``work`` uses the buffer of role ``key`` (:meth:`get` waits for it)."""
        self._busy.setdefault(key, []).append(work)

    def busy(self, key) -> list:
        """The sends still holding the send buffer of role ``key`` (:meth:`get` would wait for them; none
        for ``key=None``)."""
        held = self._busy.get(("out", key)) if self._busy else None
        return [w for w in held if not w.is_completed()] if held else []

    def settle(self, key) -> None:
        """Wait for every send holding the send buffer of role ``key`` (those :meth:`busy` lists, in the order
        they started, and the completed ones), and forget them."""
        for wk in self._busy.pop(("out", key), ()):
            wk.wait()

    def release(self) -> None:
        """Forget the completed sends (call after waiting for them all)."""
        self._busy.clear()

    def nbytes(self) -> int:
        """Bytes of the buffers this pool holds (an endpoint's message memory; they are kept for reuse)."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class Inbox:
    """Receives posted ahead of need on ``fabric`` (pooled buffers from ``pool``), so that a real fabric
    moves the data while this endpoint works on something else; messages from another role of this
    endpoint are ``put`` directly. Receives on one ``(source, tag)`` must be posted in the order the source
    sends them. A message is known by its ``key`` (any hashable value the protocol chooses)."""

    def __init__(self, fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        #: key -> ``(receive, buffer)`` (receive ``None``: put locally): the inbox's entries, for a driver to read
        #: without a call per key (changed only through the methods below)
        self.box: dict = {}
        self._observer = None
        self._watched = None

    def observe(self, observer, watched=None) -> None:
        """Call ``observer(key, present)`` whenever a key is posted or put (``present=True``), taken
        (``False``), or posted or put again while there (``None``: its receive replaced); ``None`` stops it.
        ``watched``: a container of the keys the observer acts on (it does nothing for any other; looked up as
        it is, so it may change meanwhile): only those are reported (``None``: every key)."""
        self._observer = observer
        self._watched = watched

    def _add(self, key, entry) -> None:
        new = key not in self.box
        self.box[key] = entry
        if self._observer is not None and (self._watched is None or key in self._watched):
            self._observer(key, True if new else None)

    def post(self, key, nbytes: int, src: int, tag: int) -> None:
        """Post the receive of ``key``: ``nbytes`` from endpoint ``src`` on ``tag``, into the pooled buffer
        of role ``("in", key)``."""
        pool, role = self.pool, ("in", key)
        bufs = pool._bufs
        if role in bufs or role in pool._busy:
            buf = pool.get(role, nbytes)
        else:                   # (:meth:`Pool.get` of a role's first buffer, inline: once per message of a call)
            buf = bufs[role] = torch.empty(nbytes, dtype=torch.uint8)
        box = self.box          # (what _add does, inline)
        new = key not in box
        box[key] = (self.fabric.irecv(buf, src, tag), buf)
        if self._observer is not None and (self._watched is None or key in self._watched):
            self._observer(key, True if new else None)

    def post_into(self, key, buf: torch.Tensor, src: int, tag: int) -> None:
        """Post the receive of ``key`` from endpoint ``src`` on ``tag`` straight into ``buf`` (a contiguous
        tensor, e.g. a view of the result)."""
        box = self.box         # (what _add does, inline: once per message of a ring)
        new = key not in box
        box[key] = (self.fabric.irecv(buf, src, tag), buf)
        if self._observer is not None and (self._watched is None or key in self._watched):
            self._observer(key, True if new else None)

    def put(self, key, buf) -> None:
        """Put the message ``buf`` of ``key`` here (from another role of this endpoint: in at once)."""
        self._add(key, (None, buf))

    def work(self, key):
        """The pending receive of ``key`` (``None`` if it was put locally); ``KeyError`` if none."""
        return self.box[key][0]

    def works(self, keys) -> list:
        """:meth:`work` of each of ``keys``, in order (one call for many keys)."""
        return list(map(_entry_work, map(self.box.__getitem__, keys)))   # (no bytecode per key)

    def has(self, key) -> bool:
        """Is a receive of ``key`` posted, or its message put here?"""
        return key in self.box

    def ready(self, key) -> bool:
        """Has the message of ``key`` arrived (or been put locally)?"""
        work = self.box[key][0]
        return work is None or work.is_completed()

    def ready_keys(self, keys) -> list:
        """Those of ``keys`` whose messages have arrived (or been put locally), in order (:meth:`ready` of
        each, in one call). A look at every key: an ``any`` role that takes one key per wake takes the one it
        is resumed with (:class:`Recv`) instead."""
        works = list(map(_entry_work, map(self.box.__getitem__, keys)))
        if None in works:
            return [k for k, w in zip(keys, works) if w is None or w.is_completed()]
        return list(compress(keys, map(_is_completed, works)))      # (no bytecode per key)

    def pending(self, keys) -> list:
        """The receives of ``keys`` (each posted or put) that have not completed yet."""
        out = []
        for k in keys:
            work = self.box[k][0]
            if work is not None and not work.is_completed():
                out.append(work)
        return out

    def take(self, key):
        """The message of ``key`` (waiting for its receive to complete), removed from the inbox."""
        work, buf = self.box.pop(key)
        if self._observer is not None and (self._watched is None or key in self._watched):
            self._observer(key, False)
        if work is not None:
            work.wait()
        return buf


class Outbox:
    """Asynchronous sends on ``fabric``; a buffer of ``pool`` is not reused before its sends have completed."""

    def __init__(self, fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        self.pending: list = []

    def send(self, buf: torch.Tensor, dst: int, tag: int, key=None, deferrable: bool = False,
             stable: bool = False) -> None:
        """Start sending ``buf`` to endpoint ``dst`` on ``tag``. ``key``: the role of the pooled buffer it
        uses (held until the send completes). ``deferrable``: left to :meth:`finish` (:meth:`reap`).
        ``stable``: nothing writes ``buf`` before the message is taken (:meth:`.base.Fabric.isend`)."""
        wk = self.fabric.isend(buf, dst, tag, stable=True) if stable else self.fabric.isend(buf, dst, tag)
        # (the buffer kept while the send may still read it: not once it has completed, as a fabric that copies
        # at the send says at once -- an endpoint of n peers holds n such entries until :meth:`finish`)
        self.pending.append((wk, None if wk.is_completed() else buf, deferrable))
        if key is not None:         # (Pool.hold, inline)
            busy, role = self.pool._busy, ("out", key)
            if role in busy:
                busy[role].append(wk)
            else:
                busy[role] = [wk]

    def send_each(self, buf: torch.Tensor, dsts: tuple, tag: int, key=None, deferrable: bool = False, *,
                  reliable: bool = True) -> None:
        """:meth:`send` of ``buf`` to each endpoint of ``dsts``, in order, on ``tag`` (:class:`SendEach`), the sends
        started by one call of the fabric's :meth:`~.base.Fabric.isend_each`; the ones it started before an error
        are recorded all the same (held, finished by :meth:`finish`). ``key``: the role of the pooled buffer they
        use (held until every send completes). ``deferrable``: each left to :meth:`finish` (:meth:`reap`).
        ``reliable``: ``False``, datagrams the network model may drop (a switch's multicast)."""
        works: list = []
        try:
            self.fabric.isend_each(buf, dsts, tag, works, reliable=reliable)
        finally:
            self.pending += [(wk, buf, deferrable) for wk in works]
            if key is not None and works:       # (Pool.hold, inline)
                busy, role = self.pool._busy, ("out", key)
                if role in busy:
                    busy[role] += works
                else:
                    busy[role] = works

    def reap(self, keep: int = 64) -> None:
        """Wait for all but the newest ``keep`` sends, except the ``deferrable`` ones, left to
        :meth:`finish`: their receiver may post its receives late (after a step of its own that may wait
        for this endpoint's later steps: a wait for them here could be circular)."""
        cut = len(self.pending) - keep
        if cut > 0:
            head = self.pending[:cut]
            deferred = [p for p in head if p[2]]
            self.fabric.wait_all(map(_entry_work, head) if not deferred else
                                 [p[0] for p in head if not p[2]])     # (in order: one call for them all)
            self.pending[:cut] = deferred

    def finish(self) -> None:
        """Wait for every send (the call's last step: all of them complete by then)."""
        self.fabric.wait_all(map(_entry_work, self.pending))     # (in order: one call for them all)
        self.pending.clear()
        self.pool.release()


# ----------------------------------------------------------------------------------------- waits
class Stage(Protocol):
    """What a wait is for, as :func:`drive` reads it; a protocol defines its stages (a named tuple with
    these properties). Stages are totally ordered: among the roles able to run, the scheduler resumes the
    one with the smallest stage (then the one that began to wait first; an ``any`` wait on the keys left of the
    role's previous one, :class:`Recv`, began with that one). ``phase`` is what
    :attr:`Poll.below` is compared with. A ``typing.Protocol``, never instantiated (its constructor's
    ``*args``, ``**kwargs`` raise ``TypeError``)."""

    phase: object

    def __lt__(self, other) -> bool: ...

    @property
    def sure(self) -> bool:
        """Does the wait end whatever this endpoint does (its messages are sent by every peer before
        their first wait)? The role is then resumed to block in its takes at once, and a poll skips it."""

    @property
    def reaps(self) -> bool:
        """May this endpoint's sends be reaped before the wait (:meth:`Outbox.reap`), when every role able
        to run waits at such a stage?"""


class Step(NamedTuple):
    """A plain :class:`Stage`, for a protocol whose waits need no preference of their own (one role, such as
    a ring's steps): ordered by ``phase`` (then ``sure``, ``reaps``), neither sure nor reaping by default."""

    phase: int = 0
    sure: bool = False
    reaps: bool = False


# ----------------------------------------------------------------------------------------- requests
# A role (a generator) yields these to :func:`drive`. Send, SendEach, Post, PostInto, Hand and Spawn never block:
# the scheduler performs them and resumes the role at once. Recv suspends it until its messages are in;
# Poll lets the others run meanwhile; Flush blocks until sends of its own have completed; RecvWithin and
# AwaitWithin wait with a deadline, blocking this endpoint (for an endpoint of one role).


class Send(NamedTuple):
    """Send ``buf`` to endpoint ``dst`` on ``tag`` (asynchronous). ``hold``: the role of the pooled
    buffer, which is not reused before this send has completed (or any name for what ``buf`` is a view
    of, that a :class:`Flush` waits for). ``deferrable``: the receiver may post its
    receive late, after steps of its own (a reap does not wait for it, :meth:`Outbox.reap`). ``stable``: nothing
    writes ``buf`` before the receiver has taken the message, a promise that lets a fabric that would copy it
    keep a reference instead (:meth:`.base.Fabric.isend`)."""

    buf: torch.Tensor
    dst: int
    tag: int
    hold: object = None
    deferrable: bool = False
    stable: bool = False


class SendEach(NamedTuple):
    """Send ``buf`` to each endpoint of ``dsts`` (a tuple), in that order, on ``tag``: what a :class:`Send` per
    endpoint does, with the same ``hold`` and ``deferrable`` for each, as one request (one message to many
    peers at one instant, as an aggregator's reply to every worker). Every fabric starts the same sends in the
    same order (:meth:`.base.Fabric.isend_each`); one that models time enqueues them in one pass."""

    buf: torch.Tensor
    dsts: tuple
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
    """Post the receive of message ``key`` straight into ``buf`` (a contiguous tensor, e.g. a view of the
    result)."""

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
    from the inbox. ``stage``: what it waits for (:class:`Stage`); it orders the roles able to run,
    decides whether this endpoint's sends are reaped first (:attr:`Stage.reaps`) and whether the role is
    resumed to block in its takes at once (:attr:`Stage.sure`). The role is able to run once every key is
    posted or handed over, no key of ``gone`` is still waiting to be taken, and no send holding the pooled
    send buffer of role ``free`` is incomplete. ``any``: it is in once any one of ``keys`` is, and the role is
    resumed with (``yield`` returns) one key of ``keys`` to take: the one whose arrival chose it, where the
    scheduler knows it (the SimFabric's choices, a ``wait_any``), else the first that is in, else the first
    (its take then blocks). A role that takes its keys one at a time, as they come, then never looks at the
    others: a wake costs it nothing per key left. Without ``any`` it is resumed with ``None``.

    ``keys`` is a tuple; an ``any`` wait's may instead be the live keys view of a dict the role owns (``d.keys()``,
    the keys it has left, in order), on this contract: once resumed with a key, the role deletes that key from
    the dict, and changes it in no other way, before it waits on the view again. Its next wait on the same view
    then goes on with the scheduler's watch of the keys left without a look at them (O(1) per wake, where a
    tuple of the keys left costs a pass over them to build and one to compare); a wait on the view that breaks
    the contract is a :class:`ProtocolError`.
    The rules and why each exists: ``docs/omnireduce-scheduler.md``."""

    keys: tuple
    stage: Stage
    gone: tuple = ()
    any: bool = False
    free: object = None


class Poll(NamedTuple):
    """Run every other role whose messages are in already, then resume (between pieces of long local
    work). ``below``: only the roles whose stage's ``phase`` is smaller. A poll never blocks: it skips
    the roles whose wait is :attr:`~Stage.sure`."""

    below: object = None


class Spawn(NamedTuple):
    """Start another role on this endpoint (run at once up to its first wait)."""

    role: Generator


class Flush(NamedTuple):
    """Wait until every send held under ``hold`` (:attr:`Send.hold`) has completed, so that the role may
    overwrite what they sent (:meth:`Pool.settle`). It blocks this endpoint: as a reap
    (:meth:`Outbox.reap`), only for sends whose receives the peer posts without this endpoint's later
    steps (``docs/omnireduce-scheduler.md``, rule R12)."""

    hold: object


# Each of the requests above has ``new``, which builds it from all its fields, in order, as one tuple
# (``Send.new((buf, dst, tag, hold, deferrable, stable))``, no default filled in): a NamedTuple's own constructor is a
# Python function, a call per request; ``new`` is ``tuple.__new__`` bound to the class, a C call (for the requests a
# protocol builds per message).
for _request in (Send, SendEach, Post, PostInto, Hand, Recv, Poll, Spawn, Flush):
    _request.new = partial(tuple.__new__, _request)
del _request


class RecvWithin(NamedTuple):
    """Receive into ``buf`` from endpoint ``src`` (``None``: any) on ``tag``, waiting at most ``timeout``
    seconds (modelled seconds on a SimFabric, wall seconds elsewhere); the role is resumed with the
    source, or ``None`` once the time has passed without a message. It blocks this endpoint: no other role
    of it runs meanwhile, so it is for an endpoint that runs one role (a switch's port, a worker's stream of
    packets under a retransmission timer)."""

    buf: torch.Tensor
    src: int | None
    tag: int
    timeout: float


class AwaitWithin(NamedTuple):
    """Wait until the posted receive of message ``key`` is in, or ``timeout`` seconds have passed (as
    :class:`RecvWithin`); the role is resumed with whether it is in. A receive still out stays posted: the
    next message on its channel goes to it. It blocks this endpoint, as :class:`RecvWithin`."""

    key: object
    timeout: float


class WaitAny(NamedTuple):
    """What :func:`schedule` waits for: the first element of ``groups`` (lists of pending receives, in order
    of preference) that is in, by :meth:`.base.Fabric.wait_any`'s rule; the generator is sent its index."""

    groups: list


class WaitAll(NamedTuple):
    """What :func:`schedule` says before it resumes a role that takes the messages ``keys`` (its
    :class:`Recv`'s) at once, whether they are in or not (the only role able to run, or a :attr:`~Stage.sure`
    one): a driver whose waits are not calls that block (the SimFabric's loop) completes those receives first,
    in this order (``any``: only the first, and only if none of them is in); a blocking driver (:func:`drive`)
    lets the role's own takes block, as they would. The generator is sent back, for an ``any`` wait, the key
    found in or completed (the role's resume value, :class:`Recv`), or ``None``: the scheduler then looks
    (:meth:`Inbox.ready` of each key, up to the first in)."""

    keys: tuple
    any: bool = False


class Choose(NamedTuple):
    """What :func:`schedule` yields instead of a :class:`WaitAny` when its driver keeps a :class:`WaitSet`:
    ``order``, the ``(stage, sequence number)`` of the roles able to run in order of preference (the
    scheduler's own list, unchanged until the driver answers). The driver applies :class:`WaitAny`'s rule to
    the groups that :func:`groups` would build for those roles (from the wait set it keeps) and sends back
    ``(s, key)``: the sequence number of the role chosen, its group's receives completed, and, for an ``any``
    role chosen by one of its receives, that receive's key (else ``None``; the scheduler then looks, as after
    a :class:`WaitAll`)."""

    order: list


class WaitSet(Protocol):
    """A driver's record of the roles able to run, kept across choices (the SimFabric's: the groups of
    :class:`Choose` measured as messages arrive, rather than once per choice). While two or more roles are
    able to run (every key of its :class:`Recv` posted or handed over, no ``gone`` key left), :func:`schedule`
    has :meth:`add` ed each of them and :meth:`remove` s each that no longer is or is about to be resumed (a
    :meth:`remove` of a role not added is a no-op); with one or none, none is added."""

    def add(self, s: int, req: Recv, first: tuple | None = None) -> None:
        """Role ``s``, waiting on ``req``, is able to run; ``first``: ``(s0, req0)``, the role able alone until
        now, added first (with ``s``, there is a choice to record)."""

    def remove(self, s: int, last: int | None = None) -> None:
        """Role ``s`` is no longer able to run (or is about to be resumed); ``last``: the one left able alone,
        removed after it (no choice to record)."""

    def ready(self) -> Iterable[int]:
        """The roles added whose messages are in (:meth:`Inbox.ready` of every key, of one for an ``any``
        role) and whose ``free`` sends have completed: those a :class:`Poll` may resume."""


def groups(inbox: Inbox, outbox: Outbox, cands, upto_empty: bool = False) -> tuple[list, list, list]:
    """``(groups, owner, picks)``: what a :class:`WaitAny` waits for, for the roles ``cands`` (``(sequence
    number, Recv)`` in order of preference): per role the pending receives of its keys and the sends holding
    its ``free`` buffer (an ``any`` role whose every key is pending: each receive alone; one whose some key is
    in: an empty group), and for each group its role's sequence number and the key it stands for (an ``any``
    role's receive alone; else ``None``). ``upto_empty``: the groups up to the first empty one (a
    :class:`WaitAny` never chooses a group after a complete one; on gloo a look at a later role's receives
    would start a helper thread for each, :func:`drive`)."""
    out, owner, picks = [], [], []
    for s, req in cands:
        pend = inbox.pending(req.keys)
        if req.free is not None:
            pend += outbox.pool.busy(req.free)
        if req.any and len(pend) == len(req.keys):
            out += [[w] for w in pend]
            owner += [s] * len(pend)
            picks += req.keys if req.free is None else [None] * len(pend)    # (with ``free``: the scheduler looks)
        else:
            out.append([] if req.any else pend)
            owner.append(s)
            picks.append(None)
            if upto_empty and (req.any or not pend):
                break
    return out, owner, picks


#: a blocking driver (:func:`drive`) resumes a role able to run whose wait is :attr:`~Stage.sure` at once, ahead
#: of preferred roles whose waits are not, when the receives it still lacks hold at most this many bytes
#: (``docs/omnireduce-scheduler.md``, rule R3): such messages were sent before their senders' first wait,
#: so they are in or on their way, and a few tens of microseconds of wire beat a helper thread per receive
#: that a :class:`WaitAny` costs on gloo (two thread hand-offs each)
SURE_BLOCK_BYTES = 1 << 16


def schedule(fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64,
             waitset: WaitSet | None = None, *, blocking: bool = False) -> Generator:
    """The scheduler of an endpoint as a generator (the sans-I/O core of :func:`drive`): it runs the
    ``roles`` and yields only what it must wait for, a :class:`WaitAny` (sent back the index chosen) or a
    :class:`WaitAll`; its driver performs those waits (:func:`drive` blocks in them, or in the role's takes;
    the SimFabric makes them events of its loop). Sends are never waited for here beyond what :class:`Outbox` and
    :class:`Pool` do, which on every fabric completes without another endpoint's progress (rule R12).
    ``waitset``: the driver's :class:`WaitSet`, told which roles are able to run; the scheduler then yields a
    :class:`Choose` (sent back the role chosen) where it would yield a :class:`WaitAny`, the same choice
    without rebuilding the groups each time. ``blocking``: the driver learns of an arrival only by blocking
    (or by a helper thread per receive, :func:`drive` on gloo): a small :attr:`~Stage.sure` wait is then
    resumed at once rather than raced in a :class:`WaitAny` (:data:`SURE_BLOCK_BYTES`)."""
    return _Scheduler(fabric, inbox, outbox, waitset, blocking).run(roles, keep)


def drive(fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64) -> None:
    """The generic scheduler of an endpoint (what :meth:`.base.Fabric.drive` runs): run the ``roles``
    (generators yielding the requests above) on ``fabric``, with ``inbox`` and ``outbox``, until every one
    has returned. While some wait, resume the first (by :class:`Stage`) of those able to run whose messages
    are in by the time the first such is (:meth:`.base.Fabric.wait_any`); the only one able to run, or a
    preferred one whose wait is :attr:`~Stage.sure`, once its messages are in (an ``any`` wait with none
    in: its first key's); else the first sure one whose receives are small (:data:`SURE_BLOCK_BYTES`), the
    same way. Before choosing, when every role able to run waits at a stage that
    :attr:`~Stage.reaps`, finish all but ``keep`` of this endpoint's sends. A role's exception ends the
    call (it propagates to the caller); a role that can never run is a bug, reported as
    :class:`~sparsecomm.errors.ProtocolError`. It never blocks on one role while another could run, unless
    on messages that come whatever this endpoint does: every wait ends, on any fabric
    (``docs/omnireduce-scheduler.md``). This driver performs :func:`schedule`'s waits by blocking."""
    sched = schedule(fabric, inbox, outbox, roles, keep, blocking=True)
    value = None
    while True:
        try:
            req = sched.send(value)
        except StopIteration:
            return
        t = type(req)
        if t is WaitAny:
            value = fabric.wait_any(req.groups)
        elif t is RecvWithin:
            try:
                value = fabric.recv(req.buf, req.src, req.tag, timeout=req.timeout)
            except FabricTimeout:
                value = None
        elif t is AwaitWithin:
            value = _await_within(fabric, inbox.work(req.key), req.timeout)
        else:
            value = None        # WaitAll: the role's takes block (an ``any`` one's key: the scheduler looks)


def _await_within(fabric, work, timeout: float) -> bool:
    """:class:`AwaitWithin` by blocking: is ``work`` (a posted receive, ``None`` if put locally) complete
    within ``timeout``? A modelled fabric's timed wait leaves a receive that timed out posted; elsewhere the
    wait polls, so that the receive stays the inbox's (a real fabric's timed-out receive would be adopted by
    the next receive posted on its channel)."""
    if work is None or work.is_completed():
        return True
    if fabric.modelled_time:
        try:
            work.wait(timeout=timeout)
        except FabricTimeout:
            return False
        return True
    deadline = time.perf_counter() + timeout
    delay = 2e-5
    while not work.is_completed():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    return True


def note_role(exc: BaseException, role, rank: int) -> None:
    """Note on ``exc``, raised by ``role``'s own code, which role of endpoint ``rank`` raised it (what a driver
    that runs a role itself, not through :func:`schedule`, adds as the scheduler does)."""
    name = role.__qualname__ if inspect.isgenerator(role) else type(role).__qualname__
    exc.add_note(f"(raised by role {name} of endpoint {rank})")


_name_role = note_role      # (the scheduler's name for it)


class _Scheduler:
    """:func:`drive`'s state: the suspended roles, each with the :class:`Recv` it waits on, and which of
    them are able to run (rule R1 without ``free``), kept per change of the inbox: a role counts the
    conditions it still lacks (a key not posted, a ``gone`` key not taken), and a key posted, put or
    taken updates only the roles that wait on it.

    An ``any`` role resumed with one of its keys (:meth:`_woken`) keeps its watch of the others (:attr:`kept`);
    if its next wait is ``any`` on exactly those, in order (an aggregator's headers left), that wait goes on
    under the same sequence number, with the same watch and count: a wake then costs no pass over the keys
    in Python (only C's compare of the two tuples; none where the keys are the role's live dict view,
    :class:`Recv`: then the wake costs O(1)). It keeps its place among roles waiting at an equal stage
    (it began to wait at its first ``any`` wait); any other next request of the role drops the watch. A key of
    the kept watch posted, put, taken or replaced meanwhile (:attr:`touched`) makes the wait set record the
    continued wait afresh (its keys as a tuple: :meth:`WaitSet.add` takes a group over without a look at the keys
    only for the same live view and sequence number: a wait that went on, each of its keys watched since)."""

    def __init__(self, fabric, inbox: Inbox, outbox: Outbox, waitset: WaitSet | None = None,
                 blocking: bool = False) -> None:
        self.fabric, self.inbox, self.outbox, self.waitset = fabric, inbox, outbox, waitset
        self.blocking = blocking    # (:func:`schedule`: small sure waits are resumed at once, R3)
        self.waiting: dict = {}     # sequence number -> [role, Recv]; in the order the roles began to wait
        self.lacks: dict = {}       # sequence number -> conditions of R1 not met yet (a role in ``waiting`` with
                                    # none lacking is able to run: in ``order``)
        self.order: list = []       # (stage, sequence number) of the able ones, sorted: the preference order
        self.choice = Choose(self.order)    # (what every choice yields: the order itself, answered before it changes)
        self.stays: int = 0         # how many able ones wait at a stage that does not reap
        self.watchers: dict = {}    # key -> [(sequence number, True for a key awaited / False for gone)]
        self.seq = 0
        self.polling = False
        self.keep = 64
        self.solo = False           # one role, none spawned: after its first wait it waits in place (advance)
        self.kept = None            # (sequence number, role, keys left): an ``any`` wait's watch, kept for its next
                                    # wait; then the key it was resumed with (None: ``keys left`` is a tuple of
                                    # them; else the role's live dict view, which still holds that key until the
                                    # role deletes it) and how many keys the next wait must have
        self.touched = False        # a key of the kept watch changed since it was kept (:meth:`changed`)
        self.nest = 1               # 0 while the role being advanced was resumed by :meth:`run`'s loop itself (not
                                    # started by it, nor spawned or polled by another role): :meth:`_first_sure`

    def run(self, roles: list, keep: int) -> Generator:
        """Run ``roles`` (:func:`schedule`). The only role (none spawned), after its first wait, waits in
        place, nothing watched, and its frequent requests are performed here, in the driver's generator
        frame; from a rarer one on, :meth:`advance` runs it (after a :class:`Spawn`, up to its next wait, and
        the loop below goes on). Then, while roles wait, resume them by the rules
        (``docs/omnireduce-scheduler.md``), in this generator's own frame (the driver's waits pass through
        one generator the fewer)."""
        self.keep = keep
        inbox, outbox = self.inbox, self.outbox
        inbox.observe(self.changed, self.watchers)      # (it acts only on the keys watched)
        try:
            for role in roles:
                yield from self.advance(role)
            if len(roles) == 1 and self.solo is not None and self.waiting:
                role, req = self.forget(self.seq)
                inbox.observe(None)
                self.solo = True
                box = inbox.box
                send, post_into, settle = outbox.send, inbox.post_into, outbox.pool.settle
                while req is not None:
                    for k in req.keys:
                        if k not in box:
                            raise ProtocolError(f"endpoint {self.fabric.rank}: no role of this call can run (a bug)")
                    if req.gone:
                        self._check_solo(req)
                    elif req.stage.reaps:
                        outbox.reap(keep)
                    got = yield WaitAll(req.keys, req.any)
                    value = self._woken(req, got) if req.any else None
                    while True:
                        try:
                            req = next(role) if value is None else role.send(value)
                        except StopIteration:
                            req = None
                            break
                        except Exception as exc:
                            _name_role(exc, role, self.fabric.rank)
                            raise
                        value = None
                        t = type(req)
                        if t is Send:
                            send(req.buf, req.dst, req.tag, req.hold, req.deferrable, req.stable)
                        elif t is SendEach:
                            outbox.send_each(req.buf, req.dsts, req.tag, req.hold, req.deferrable)
                        elif t is PostInto:
                            post_into(req.key, req.buf, req.src, req.tag)
                        elif t is Recv:
                            break
                        elif t is Flush:
                            settle(req.hold)
                        elif t is RecvWithin or t is AwaitWithin:
                            value = yield req       # the driver's wait, this endpoint's alone
                        else:
                            yield from self.advance(role, req)
                            req = None
                            break
            waiting, order, ws = self.waiting, self.order, self.waitset
            self.nest = 0               # (a role resumed below is advanced by this loop: :meth:`_first_sure`)
            while waiting:              # resume the waiting roles by the rules until none waits
                if not order:
                    raise ProtocolError(f"endpoint {self.fabric.rank}: no role of this call can run (a bug)")
                if not self.stays:      # every role able to run waits at a stage that reaps
                    outbox.reap(keep)
                first = order[0][1]
                req = waiting[first][1]
                if not order[1:] or req.stage.sure:   # the only one, or sure: its own takes block
                    if ws is not None and order[1:]:
                        ws.remove(first)
                    got = yield WaitAll(req.keys, req.any)
                    yield from self.resume(first, got)
                    continue
                if ws is not None:
                    s, got = yield self.choice
                    yield from self.resume(s, got)
                    continue
                if self.blocking:
                    s = self._small_sure()
                    if s is not None:       # (its wait ends whatever this endpoint does: R3, R4)
                        req = waiting[s][1]
                        got = yield WaitAll(req.keys, req.any)
                        yield from self.resume(s, got)
                        continue
                groups_, owner, picks = groups(inbox, outbox, [(s, waiting[s][1]) for _, s in order], self.blocking)
                if self.blocking and not groups_[0]:    # (in already: what the WaitAny would choose at once)
                    yield from self.resume(owner[0], picks[0])
                    continue
                i = yield WaitAny(groups_)
                yield from self.resume(owner[i], picks[i])
        finally:
            inbox.observe(None)

    def _small_sure(self) -> int | None:
        """A blocking driver's shortcut (rule R3): the first role able to run, in preference order, whose wait
        is :attr:`~Stage.sure`, not ``any``, with no ``free`` buffer, whose posted receives (in or not: a look
        would cost a helper thread) hold at most :data:`SURE_BLOCK_BYTES` in all; else ``None``."""
        box = self.inbox.box
        for stage, s in self.order:
            if not stage.sure:
                continue
            req = self.waiting[s][1]
            if req.any or req.free is not None:
                continue
            nbytes = 0
            for k in req.keys:
                work, buf = box[k]
                if work is not None and buf is not None:
                    nbytes += buf.nbytes
            if nbytes <= SURE_BLOCK_BYTES:
                return s
        return None

    def advance(self, role, first=None, value=None) -> Generator:
        """Run ``role`` until it waits (or returns), performing its non-blocking requests (a generator: a
        :class:`Poll` may resume others, whose waits it yields); ``first``: a request it has yielded already,
        performed first; ``value``: what it is resumed with (an ``any`` wait's key).

        The role is resumed by a ``for`` loop (no call of ``next`` per request), and with ``send`` only to give
        it a value; ``step``, the request being performed, tells the role's own exceptions (noted with its
        name) from those of their performing."""
        inbox, outbox = self.inbox, self.outbox
        requests = role if first is None else chain((first,), role)
        while True:
            if value is not None:
                try:
                    req = role.send(value)      # (a role may be a plain iterator: never sent None)
                except StopIteration:
                    if self.kept is not None and self.kept[1] is role:
                        self._drop_kept()
                    return
                except Exception as exc:
                    _name_role(exc, role, self.fabric.rank)
                    raise
                value = None
                requests = chain((req,), role)
            step = None
            try:
                for req in requests:
                    step = req
                    t = type(req)
                    if t is Send:
                        outbox.send(req.buf, req.dst, req.tag, req.hold, req.deferrable, req.stable)
                    elif t is SendEach:
                        outbox.send_each(req.buf, req.dsts, req.tag, req.hold, req.deferrable)
                    elif t is Post:
                        inbox.post(req.key, req.nbytes, req.src, req.tag)
                    elif t is PostInto:
                        inbox.post_into(req.key, req.buf, req.src, req.tag)
                    elif t is Hand:
                        inbox.put(req.key, req.msg)
                    elif t is Recv:
                        if self.solo:       # the only role: it waits in place (nothing to watch, no other to run)
                            self._check_solo(req)
                            got = yield WaitAll(req.keys, req.any)
                            if req.any:
                                value = self._woken(req, got)
                                break
                        elif not self.nest and (req.stage.sure or not self.order) and self._first_sure(role, req):
                            # (what the resume loop would do next: resume this role at once, its takes blocking;
                            # without a watch, a sequence number, the wait set's record or a resume)
                            yield WaitAll(req.keys)
                        else:
                            self.wait(role, req)
                            return
                    elif t is Spawn:
                        if self.solo:
                            inbox.observe(self.changed, self.watchers)
                        self.solo = None    # (two roles: every wait is watched from now on; none is suspended yet)
                        self.nest += 1
                        yield from self.advance(req.role)
                        self.nest -= 1
                    elif t is Flush:
                        outbox.pool.settle(req.hold)
                    elif t is Poll:
                        if not self.polling:
                            self.polling = True
                            self.nest += 1
                            try:
                                yield from self.poll(req.below)
                            finally:
                                self.polling = False
                                self.nest -= 1
                    elif t is RecvWithin or t is AwaitWithin:
                        value = yield req   # the driver's wait, this endpoint's alone (no other role runs meanwhile)
                        if value is not None:
                            break
                    else:
                        raise ProtocolError(f"endpoint {self.fabric.rank}: a role asked for {req!r} (a bug)")
                    step = None
                else:                   # the role has returned
                    if self.kept is not None and self.kept[1] is role:
                        self._drop_kept()
                    return
            except Exception as exc:
                if step is None:        # (raised by the role's own code)
                    _name_role(exc, role, self.fabric.rank)
                raise

    def _first_sure(self, role, req: Recv) -> bool:
        """Would :meth:`run`'s loop, right after ``role`` suspended on ``req`` (its stage sure, or no other role
        able to run), resume it at once to block in its takes (rule R3: the only role able to run, or the
        preferred one with a sure wait)? Asked only for a role that loop resumed (:attr:`nest` 0: the loop is the
        next to act once the role waits): yes when ``req`` is a plain wait (not ``any``, no ``gone``, no ``free``)
        on keys all posted or handed over (R1), and no role is able to run or its stage is sure and smaller than
        every able role's (a new wait comes after those of an equal stage). The role then waits in place, as the
        only role does (:attr:`solo`): the same ``WaitAll`` at the same moment, after the reap the loop would make
        first (its stage reaps and no able role's stays), and the same takes (while it blocks, nothing of this
        endpoint changes its inbox: no other role becomes able meanwhile); nothing is watched, numbered or
        recorded for a wait that no other role can come before (an aggregator's first look-aheads, worker after
        worker; a worker's verdict while its other roles lack messages: ``docs/omnireduce-scheduler.md``, R3 and
        R4). A watch this role kept (:attr:`kept`) is dropped, as :meth:`wait` drops it for such a wait."""
        if req.any or req.gone or req.free is not None:
            return False
        order, stage = self.order, req.stage
        if order and not stage < order[0][0]:      # (order non-empty: the caller saw the stage sure)
            return False
        box = self.inbox.box
        for k in req.keys:
            if k not in box:
                return False
        if self.kept is not None and self.kept[1] is role:
            self._drop_kept()
        if stage.reaps and not self.stays:      # (the loop's reap before its choice: every able role reaps)
            self.outbox.reap(self.keep)
        return True

    def _check_solo(self, req: Recv) -> None:
        """The only role waits on ``req``: able to run (rule R1; else a bug), after the reap its stage asks for."""
        box = self.inbox.box
        for k in req.keys:
            if k not in box:
                raise ProtocolError(f"endpoint {self.fabric.rank}: no role of this call can run (a bug)")
        for k in req.gone:
            if k in box:
                raise ProtocolError(f"endpoint {self.fabric.rank}: no role of this call can run (a bug)")
        if req.stage.reaps:
            self.outbox.reap(self.keep)

    def wait(self, role, req: Recv) -> None:
        """Suspend ``role`` on ``req``: count what it lacks, and watch its keys (or go on with its
        :attr:`kept` watch, for an ``any`` wait on the keys it had left)."""
        kept = self.kept
        if kept is not None and kept[1] is role:
            keys = req.keys
            if req.any and not req.gone:
                if kept[3] is not None:     # (the role's live view: the same object, the key it took deleted)
                    same = keys is kept[2]
                    if same and (len(keys) != kept[4] or kept[3] in keys):
                        raise ProtocolError(
                            f"endpoint {self.fabric.rank}: an any wait on a dict's keys view goes on only once its "
                            f"role has deleted the key it was resumed with ({kept[3]!r}), and no other; wait on a "
                            f"tuple of keys to name any others (roles.Recv)")
                else:
                    same = (keys if type(keys) is tuple else tuple(keys)) == kept[2]
                if same:
                    self.kept = None
                    s = kept[0]
                    if self.touched:        # (a wait set records it afresh: not the live view it may have kept)
                        req = Recv.new((tuple(keys), req.stage, (), True, req.free))
                    self.waiting[s] = [role, req]
                    if not self.lacks[s]:
                        self._able(s, req.stage)
                    return
            self._drop_kept()
        s = self.seq = self.seq + 1
        box, watchers = self.inbox.box, self.watchers
        self.waiting[s] = [role, req]
        lacks = 0
        entry = (s, True)
        for k in req.keys:          # (a loop over many keys: no call but the append to a shared key's watchers)
            if k not in box:
                lacks += 1
            if k in watchers:
                watchers[k].append(entry)
            else:
                watchers[k] = [entry]
        for k in req.gone:
            if k in box:
                lacks += 1
            watchers.setdefault(k, []).append((s, False))
        self.lacks[s] = lacks
        if not lacks:               # (:meth:`_able`, inline: once per wait)
            order, stage = self.order, req.stage
            bisect.insort(order, (stage, s))
            if not stage.reaps:
                self.stays += 1
            ws = self.waitset
            if ws is not None and order[1:]:
                if not order[2:]:       # (the one able before: a choice to record from now on)
                    other = order[0][1] if order[1][1] == s else order[1][1]
                    ws.add(s, req, (other, self.waiting[other][1]))
                else:
                    ws.add(s, req)

    def _able(self, s: int, stage) -> None:
        """Role ``s`` (waiting at ``stage``) has become able to run: into the preference order."""
        order = self.order
        bisect.insort(order, (stage, s))
        if not stage.reaps:
            self.stays += 1
        ws = self.waitset
        if ws is not None and order[1:]:       # (a wait set records the able roles while there is a choice)
            if not order[2:]:
                other = order[0][1] if order[1][1] == s else order[1][1]
                ws.add(s, self.waiting[s][1], (other, self.waiting[other][1]))
            else:
                ws.add(s, self.waiting[s][1])

    def _unable(self, s: int, stage) -> None:
        """Role ``s`` (able to run, waiting at ``stage``) is no more: out of the preference order."""
        order = self.order
        del order[bisect.bisect_left(order, (stage, s))]
        if not stage.reaps:
            self.stays -= 1
        ws = self.waitset
        if ws is not None and order:            # (there were two or more: recorded)
            ws.remove(s, order[0][1] if not order[1:] else None)

    def changed(self, key, present: bool | None) -> None:
        """The inbox's observer: ``key`` was posted or put (``present``), taken, or replaced (``None``).
        A wait on a role's live dict view (:class:`Recv`) one of whose keys changes goes on with its keys as a
        tuple, as does a :attr:`kept` watch's next wait (:attr:`touched`): a wait set takes a record it kept over
        without a look at the keys only for the same view, untouched (:meth:`.WaitSet.add`)."""
        lacks, waiting = self.lacks, self.waiting     # (able: waiting, none lacking)
        if present is None:     # the same conditions; a wait set's record of the receive is stale
            for s, awaited in self.watchers.get(key, ()):
                if s not in waiting:
                    self.touched = True
                elif awaited and type(waiting[s][1].keys) is _dict_keys:
                    self._pin(s)
            if self.waitset is not None and self.order[1:]:
                for s, awaited in self.watchers.get(key, ()):
                    if awaited and not lacks[s] and s in waiting:
                        self.waitset.remove(s)
                        self.waitset.add(s, self.waiting[s][1])
            return
        for s, awaited in self.watchers.get(key, ()):
            was = lacks[s]
            n = lacks[s] = was + (-1 if awaited == present else 1)
            if s not in waiting:    # (a :attr:`kept` one's: not able, whatever it lacks)
                self.touched = True
                continue
            if awaited and type(waiting[s][1].keys) is _dict_keys:
                self._pin(s)
            if not was:
                self._unable(s, waiting[s][1].stage)
            elif not n:
                self._able(s, waiting[s][1].stage)

    def _pin(self, s: int) -> None:
        """Role ``s`` waits on a live dict view: on a tuple of its keys from now on (a key of it changed)."""
        w = self.waiting[s]
        req = w[1]
        w[1] = Recv.new((tuple(req.keys), req.stage, req.gone, req.any, req.free))

    def resume(self, s: int, got=None) -> Generator:
        """Resume role ``s``: :meth:`forget` it now, and return the generator that advances it (:meth:`advance`,
        for the caller to ``yield from``; not a generator itself: one frame the fewer between the driver and the
        role); an ``any`` one with the key ``got`` (the one whose arrival chose it, as its driver tells), or, if
        ``None``, the one :meth:`_woken` finds."""
        req = self.waiting[s][1]
        if req.any:
            got = self._woken(req, got)
            return self.advance(self.forget(s, got)[0], value=got)
        return self.advance(self.forget(s)[0])

    def _woken(self, req: Recv, got):
        """The key an ``any`` role waiting on ``req`` is resumed with: ``got`` (what its driver's choice
        took), else the first of its keys that is in, else its first (its take then blocks). Only without
        ``got`` does it look at the keys (a scheduler's choice of a role with a key in already, a poll, a
        blocking driver's :class:`WaitAll`)."""
        if got is not None:
            return got
        ready = self.inbox.ready
        for k in req.keys:
            if ready(k):
                return k
        return next(iter(req.keys))     # (a tuple or a live dict view, :class:`Recv`)

    def forget(self, s: int, got=None) -> tuple:
        """Role ``s`` waits no more: out of the waiting ones and their watch; ``(role, its Recv)``. ``got``: the
        key an ``any`` role is resumed with; the watch of its other keys is :attr:`kept` (out of the watch:
        ``got`` alone)."""
        waiting = self.waiting
        role, req = waiting[s]
        del waiting[s]
        if not self.lacks[s]:       # (it was able to run; :meth:`_unable`, inline: once per resume)
            order, stage = self.order, req.stage
            if order[0][1] == s:    # (the common case: the first in preference order; no search)
                del order[0]
            else:
                del order[bisect.bisect_left(order, (stage, s))]
            if not stage.reaps:
                self.stays -= 1
            ws = self.waitset
            if ws is not None and order:
                ws.remove(s, order[0][1] if not order[1:] else None)
        if got is not None and len(req.keys) > 1 and not req.gone:     # (no copy of the keys to ask)
            if self.kept is not None:
                self._drop_kept()
            keys = req.keys
            self._unwatch(s, (got,))
            self.touched = False
            if type(keys) is _dict_keys:    # (the role's live view: the role deletes ``got``; O(1))
                self.kept = (s, role, keys, got, len(keys) - 1)
            else:
                i = keys.index(got)
                self.kept = (s, role, keys[:i] + keys[i + 1:], None, 0)
            return role, req
        del self.lacks[s]
        watchers = self.watchers
        for k in tuple(req.keys) + req.gone if req.gone else req.keys:  # (:meth:`_unwatch`, inline: once per resume)
            w = watchers[k]
            if not w[1:]:           # (the common case: this role alone waits on the key)
                del watchers[k]
                continue
            w[:] = [e for e in w if e[0] != s]
            if not w:
                del watchers[k]
        return role, req

    def _drop_kept(self) -> None:
        """Forget the :attr:`kept` watch (its role waits on something else, or has returned)."""
        s, _, keys, got, _ = self.kept
        self.kept = None
        del self.lacks[s]
        if got is not None and got in keys:     # (a live view whose role has not deleted its key: unwatched already)
            keys = [k for k in keys if k != got]
        self._unwatch(s, keys)

    def _unwatch(self, s: int, keys) -> None:
        """Role ``s`` watches ``keys`` no more."""
        watchers = self.watchers
        for k in keys:
            w = watchers[k]
            if not w[1:]:
                del watchers[k]
                continue
            w[:] = [e for e in w if e[0] != s]
            if not w:
                del watchers[k]

    def poll(self, below=None) -> Generator:
        """Run the roles whose messages are in already (without blocking), best first, until none is
        (``below``: only those of an earlier phase)."""
        ready, waiting, busy, ws = self.inbox.ready, self.waiting, self.outbox.pool.busy, self.waitset
        while True:   # (the roles at or past ``below``, and sure ones, are skipped before any look at their messages)
            if ws is not None and self.order[1:]:     # the wait set knows which are in
                best = None
                for s in ws.ready():
                    stage = waiting[s][1].stage
                    if (below is None or stage.phase < below) and not stage.sure \
                            and (best is None or (stage, s) < best):
                        best = (stage, s)
                if best is None:
                    return
                s = best[1]
            else:
                got = None
                for stage, s in self.order:         # the first in the preference order whose messages are in
                    if (below is None or stage.phase < below) and not stage.sure:
                        req = waiting[s][1]
                        if req.any:
                            got = next(filter(ready, req.keys), None)     # (the key it is resumed with)
                            if got is not None and not busy(req.free):
                                break
                        elif all(ready(k) for k in req.keys) and not busy(req.free):
                            break
                else:
                    return
                yield from self.resume(s, got)
                continue
            yield from self.resume(s)
