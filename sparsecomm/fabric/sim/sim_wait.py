"""The state of one :meth:`SimFabric.wait_any <sparsecomm.fabric.sim.sim.SimFabric.wait_any>`: when each
of its groups of receives is in, kept up to date as messages arrive.

A group (a list of ``(source, tag)`` receives) is in once each of its receives has a message at the head
of its queue, at ``t_g = max(0, delivered of those heads)``. The wait's event is
``max(clock, min t_g)`` over the groups in, and its choice ``(t, i)`` the lowest ``i`` with ``t_i <= t``
(the caller's order of preference), except on a ``per_port`` endpoint (a switch): there it is the group in
first, the lowest ``i`` among those in at ``min t_g``, even when the endpoint's clock is past several of them.
A switch's port is a queue: a worker's packets are taken in the order they arrived, whatever their tags (the
sparse switch's value packets and skip headers travel on two), which the switches' loss recovery relies on (a
worker's retransmission must not be taken after its packet of the slot's next round:
:mod:`sparsecomm.transports.switchml.sparse.dataplane`).
Recomputing that from the mailbox costs a pass over every receive of every group; here an arrival costs
O(1) in the common case: a message that becomes the head of a queue of a group not yet in lowers that
group's count of missing heads and raises its running maximum. When the arrival may have re-timed messages
already queued (its head is earlier than theirs: the receiving NIC takes it first,
:meth:`~.sim_network.Endpoint.schedule`), every group is measured again (deliveries read through
:meth:`~.sim_network.Endpoint.delivery`); an any-source receive's group is measured again on
each arrival on its tag (the message may be the new first match). The endpoint's clock and its mailbox's
heads change only through this endpoint's own process, which does not take messages while the wait is
open, so nothing else invalidates the state.
"""

from __future__ import annotations

from heapq import heappop

from .sim_network import Endpoint, Msg, TagHeap

__all__ = ["OrderedWait", "any_head"]


def _scan(ep: Endpoint, tag: int) -> Msg | None:
    best = None
    for (s, t), q in ep.mailbox.items():
        if t == tag and q and (best is None or (q[0].head, s) < (best.head, best.src)):
            best = q[0]
    return best


def any_head(ep: Endpoint, tag: int) -> Msg | None:
    """The message an any-source receive on ``tag`` takes from ``ep``'s mailbox: the first by head (when its
    first byte arrives), then by source, among the heads of the queues on ``tag``; ``None`` if none.

    Not a pass over the mailbox (an endpoint of n peers has n queues on a tag): the first call for a ``tag``
    puts every message queued on it in a heap, ``ep.any_heads[tag]``, keyed ``(head, source, arrival)``, to
    which each later arrival on it is pushed (:meth:`~.sim_network.Endpoint.schedule`, which places every
    message put in the mailbox); a message taken since is popped when it reaches the top (or dropped when the
    heap is built afresh, :class:`~.sim_network.TagHeap`). Every queued message
    being in the heap, its first untaken one is first among the queues' heads if it is a head itself: it is,
    as a channel's messages are queued in the order they were sent, which is the order of their heads (a
    sender's port starts them in order, the link's latency is fixed). Were it not the head of its queue, the
    mailbox is scanned instead."""
    heap = ep.any_heads.get(tag)
    if heap is None:
        heap = ep.any_heads[tag] = TagHeap()
        heap.build(ep.mailbox, tag)
    while heap:
        msg = heap[0][3]
        if not msg.taken:
            return msg if ep.mailbox[(msg.src, tag)][0] is msg else _scan(ep, tag)
        heappop(heap)
    return None


class OrderedWait:
    """The groups ``keys`` (lists of ``(source, tag)``; a ``source`` of
    ``None`` matches any) of a wait of endpoint ``ep``: :meth:`first` with ``clock_only`` measures only
    group 0; :meth:`recompute` measures them all, after which :meth:`arrived` must be called on each
    message put in the mailbox while the wait is open."""

    def __init__(self, ep: Endpoint, keys: list[list[tuple[int | None, int]]]) -> None:
        self.ep = ep
        self.keys = keys
        self.group: dict[tuple[int | None, int], int] = {}     # receive -> its group's index
        self.any_tag: dict[int, list[int]] = {}                 # tag -> groups with an any-source receive
        self.missing: list[int] = []     # per group: receives without a message yet
        self.latest: list[float] = []    # per group: the latest delivery of its receives' heads
        self.t_min: float | None = None  # min over the groups in of their time
        self.measured = False            # recompute() has run (first(clock_only=True) needs only group 0)
        self.arrival = ep.per_port       # choose the group in first, not the first in order (module docstring)

    def _measure(self, i: int) -> None:
        missing, latest, box = 0, 0.0, self.ep.mailbox
        for key in self.keys[i]:
            if key[0] is None:
                msg = any_head(self.ep, key[1])
            else:
                q = box.get(key)
                msg = q[0] if q else None
            if msg is None:
                missing += 1
            else:
                d = self.ep.delivery(msg)
                if d > latest:
                    latest = d
        self.missing[i], self.latest[i] = missing, latest

    def recompute(self) -> None:
        """Measure every group from the mailbox."""
        n = len(self.keys)
        if not self.measured:
            self.measured = True
            for i, g in enumerate(self.keys):
                for key in g:
                    self.group[key] = i
                    if key[0] is None:
                        self.any_tag.setdefault(key[1], []).append(i)
        self.missing, self.latest = [0] * n, [0.0] * n
        for i in range(n):
            self._measure(i)
        ins = [self.latest[i] for i in range(n) if not self.missing[i]]
        self.t_min = min(ins) if ins else None

    def _lower(self, t: float) -> None:
        if self.t_min is None or t < self.t_min:
            self.t_min = t

    def arrived(self, msg: Msg, retimed: bool) -> float | None:
        """``msg`` was put in the mailbox; ``retimed``: queued messages may have moved
        (:meth:`~.sim_network.Endpoint.schedule`; every group is then measured again). Returns :meth:`bound`."""
        if retimed:
            self.recompute()
            return self.bound()
        i = self.group.get((msg.src, msg.tag))
        if i is not None and self.missing[i]:
            q = self.ep.mailbox[(msg.src, msg.tag)]
            if q[0] is msg:          # a new head: one receive fewer missing
                self.missing[i] -= 1
                d = self.ep.delivery(msg)
                if d > self.latest[i]:
                    self.latest[i] = d
                if not self.missing[i]:
                    self._lower(self.latest[i])
        for j in self.any_tag.get(msg.tag, ()):
            self._measure(j)
            if not self.missing[j]:
                self.recompute()     # a group's time may have risen or fallen: take the minimum afresh
                return self.bound()
        return self.bound()

    def choose(self, world, clock_only: bool = False, at: float | None = None) -> tuple[int, list[Msg]] | None:
        """:meth:`first`'s choice (``None``: none) and its messages taken (:meth:`take`): what the waiting
        process is resumed with."""
        best = self.first(clock_only, at)
        return None if best is None else self.take(world, best[1])

    def receives(self, i: int) -> list[tuple[int | None, int]]:
        """The receives of group ``i``."""
        return self.keys[i]

    def take(self, world, i: int) -> tuple[int, list[Msg]]:
        """Take the messages of group ``i`` (of :meth:`first`; in) from the mailbox of ``world``
        (:class:`~.sim_world.World`): what the waiting process is resumed with, ``(i, messages)``."""
        return i, world.take_group(self.ep, self.keys[i])

    def event(self) -> float | None:
        """When the first group is in (at the earliest this endpoint's clock); ``None`` if none is."""
        return None if self.t_min is None else max(self.ep.clock, self.t_min)

    def bound(self) -> float | None:
        """A lower bound of :meth:`event` (the world's entry for the wait): :meth:`event` itself."""
        return None if self.t_min is None else max(self.ep.clock, self.t_min)

    def first(self, clock_only: bool = False, at: float | None = None) -> tuple[float, int] | None:
        """``(t, i)``: :meth:`event` and the lowest index of a group in by then (on a ``per_port`` endpoint the
        group in first, the lowest index on a tie). ``clock_only``: group 0, and only if it is in by the clock
        (on a ``per_port`` endpoint the group in first, if it is in by the clock). ``at``: only if the event is
        ``at`` (else ``None``)."""
        clock = self.ep.clock
        if self.arrival:
            if clock_only and not self.measured:
                self.recompute()
            t = clock if clock_only else self.event()
            if at is not None and t != at:
                return None
            if t is None:
                return None
            best = None
            for i, (m, d) in enumerate(zip(self.missing, self.latest)):
                if not m and d <= t and (best is None or d < self.latest[best]):
                    best = i
            return None if best is None else (t, best)
        if clock_only:
            if not self.measured:
                self.missing, self.latest = [0], [0.0]
                self._measure(0)
            if self.missing[0] or self.latest[0] > clock:
                return None
            return clock, 0
        t = self.event()
        if t is None or (at is not None and t != at):
            return None
        for i, (m, d) in enumerate(zip(self.missing, self.latest)):
            if not m and d <= t:
                return t, i
        raise AssertionError("unreachable: the earliest group is in by the event")
