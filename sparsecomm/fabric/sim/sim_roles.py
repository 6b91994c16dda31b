"""The wait set of a drive's roles on the SimFabric: the groups the roles' scheduler chooses among, kept from
one choice to the next and measured as messages arrive.

The roles' scheduler (:func:`sparsecomm.fabric.roles.schedule`) chooses among the roles able to run by
:class:`~sparsecomm.fabric.roles.WaitAny`'s rule over their groups of pending receives
(:func:`sparsecomm.fabric.roles.groups`). Built afresh per choice, with the groups measured from the mailbox
(:class:`~.sim_wait.OrderedWait`), a choice costs a pass over every receive of every role able to run.
Here a role's group is recorded once, when it becomes able to run (:meth:`RoleWaits.add`), and dropped when
it is resumed or no longer able (:meth:`RoleWaits.remove`); the endpoint tells it of each message put in
its mailbox (:meth:`RoleWaits.arrived`) and each one taken (:meth:`RoleWaits.taken`), which update only the
groups with a receive on that message's ``(source, tag)``. A choice (:class:`~sparsecomm.fabric.roles.Choose`)
then reads the records in the scheduler's order of preference.

A group's record is what :class:`~.sim_wait.OrderedWait` measures: how many of its receives have no message
at the head of their queue, and the latest delivery of the heads (an ``any`` role whose every key is
pending: each receive alone). The choice is :meth:`~sparsecomm.fabric.sim.sim.SimFabric.wait_any`'s, so the
same as with the groups built per choice, provided every group's receives are on ``(source, tag)`` that no
other group has, each once, and from a named source: where one is not (:attr:`RoleWaits.odd`; or on a
``per_port`` endpoint, whose choice is by arrival: :mod:`.sim_wait`), the drive
(:meth:`~.sim.SimFabric.drive_process`) builds the groups as before for that choice (the records are kept all
the same). On a SimFabric a send is complete once started, so a role's ``free`` sends are never pending and are
not recorded.

A record holds lower bounds of its heads' deliveries (the endpoint re-times queued messages lazily: an arrival
placed before them only delays them, :meth:`~.sim_network.Endpoint.schedule`). The groups in are kept in two
heaps: by the lower bound of their time, and, once that bound is by a time the wait reached, by the order of
preference; only a group at the top of one is measured exactly (and moved if it was late). A choice then
costs O(log g) for g groups, plus the receives of the groups it measures.

An ``any`` role that takes the message of its choice and waits again, ``any``, on the rest of its keys (an
aggregator's headers: one wait per header, over the headers left) would cost a pass over its receives per
wait to record them afresh. Its group is kept instead (:attr:`RoleWaits.spare`): when the role is resumed by
a choice of the records, the receive chosen is dropped from the group (its slot left dead: tokens keep their
places), the others stay recorded with their heads, and the role's next wait, if it is ``any`` on exactly
those keys with the same receives, takes the group over as it is, unless a message of one of them arrived or
was taken meanwhile. Where the wait names its keys as the role's live dict view the group was recorded from
(:class:`~sparsecomm.fabric.roles.Recv`), that is known in O(1) (the same view, as many keys as live slots, the
group not stale); a tuple of keys is compared and its receives looked up. The choices are those of a group
recorded afresh (its bounds may differ; the times read exactly do not).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush, heapreplace
from operator import attrgetter, itemgetter

from .sim_network import Endpoint, Msg

__all__ = ["RoleWaits"]

_done = attrgetter("done")
_entry_work = itemgetter(0)     # an inbox entry's receive (:attr:`~sparsecomm.fabric.roles.Inbox.box`)
_head = attrgetter("head")


class _Group:
    """The record of role ``s``'s group (its :class:`~sparsecomm.fabric.roles.Recv` ``req``): its pending
    receives ``works`` on ``chans`` (``index``: a channel's place in them), and per receive a lower bound of its
    head's delivery (at least 0) or ``None`` (``heads``); ``any``: each receive alone; otherwise ``missing``
    receives without a head and ``latest``, the latest of the heads (0 if none). ``empty``: no receive pending
    (chosen at once); ``odd``: a receive the records cannot follow (an any-source one, or a ``(source, tag)``
    twice); ``chosen``: taken by a choice, about to be dropped. ``tick``: its entry in the wait set's heaps
    (-1: none), whose time ``lb`` is at most its time; ``exact``: the endpoint's ``epoch`` when ``heads`` were
    last read exactly (-1: changed since), its time then ``time`` (``None``: not in). ``units``: an ``any`` one's
    receives with a head, ``(bound, j)``, as a heap (an entry whose bound is not ``heads[j]`` is stale).
    An ``any`` group that may be kept (:attr:`RoleWaits.spare`): ``slots``, the keys of its receives as recorded
    (``req.keys``, slot by slot, as a tuple; also for any group whose ``req.keys`` is a role's live dict view);
    ``keys``, the keys of its live slots, in order, as a dict (O(1) removal; else ``None``); ``src``, the
    ``req.keys`` it was recorded from; ``dead``, the slots of the receives chosen since it was recorded; ``lo``,
    the first live slot; ``pick``, the slot of the last choice; ``stale``: a message of a live receive arrived or
    was taken while it was chosen or kept (it is not taken over)."""

    __slots__ = ("s", "req", "works", "chans", "index", "any", "heads", "missing", "latest", "empty", "odd",
                 "chosen", "tick", "lb", "exact", "time", "units", "slots", "keys", "src", "dead", "lo", "pick",
                 "stale")

    def __init__(self, s: int, req, works: list, chans: list, any_: bool) -> None:
        self.s, self.req, self.works, self.chans, self.any = s, req, works, chans, any_
        if chans[1:]:           # (a loop, not comprehensions: no call per group)
            index, odd, j = {}, False, 0
            for c in chans:
                index[c] = j
                j += 1
                if c[0] is None:
                    odd = True
            self.index, self.odd = index, odd or len(index) < j
        elif chans:             # (one receive, the common case: no call per receive)
            c = chans[0]
            self.index, self.odd = {c: 0}, c[0] is None
        else:
            self.index, self.odd = {}, False
        self.heads: list = []
        self.missing, self.latest = 0, 0.0
        self.empty = not works and not any_
        self.chosen = False
        self.tick, self.lb, self.exact, self.time = -1, 0.0, -1, None
        self.units: list = []
        self.slots = self.keys = self.src = self.pick = None
        self.dead, self.lo, self.stale = (), 0, False


class RoleWaits:
    """The :class:`~sparsecomm.fabric.roles.WaitSet` of one drive on endpoint ``ep`` (its process's), whose
    roles post their receives in ``inbox``; ``recv_type``: the SimFabric's posted receive (a receive of
    another kind makes the groups odd). While it records a receive it is the endpoint's ``watch``, which the
    world tells of every message put in or taken from the mailbox. For the world's loop it is also the state
    of the wait of a choice (as :class:`~.sim_wait.OrderedWait`: :meth:`choose`, :meth:`bound`,
    :meth:`event`), over the groups in the :attr:`order` of the choice (set by the drive,
    :meth:`~.sim.SimFabric.drive_process`, which chooses a role of an empty group, :attr:`empties`, at once)."""

    def __init__(self, ep: Endpoint, inbox, recv_type: type) -> None:
        self.ep, self.inbox, self.recv_type = ep, inbox, recv_type
        self.groups: dict[int, _Group] = {}
        self.by_chan: dict[tuple, list[_Group]] = {}   # (source, tag) -> the groups with a receive on it
        self.empties: set[int] = set()
        #: odd groups, and channels shared by two groups: while any, the records do not decide a choice
        self.odd = 0
        self.order: list = []        # the scheduler's order of preference, as of the last choice
        # the groups in, each once (its ``tick``): by a lower bound of their time, or, once that was by a time
        # the wait reached, by preference; entries of another tick are stale
        self.heap: list = []         # (lb, tick, group)
        self.due: list = []          # (stage, s, tick, group)
        self.ticks = 0
        #: the ``any`` group of a role resumed by a choice, kept for its next wait (not in ``groups``)
        self.spare: _Group | None = None
        #: the event as :meth:`event` last found it, while no message has arrived on a channel recorded (nor
        #: re-timed those queued) since: what a choice at that time (:meth:`choose` ``at``) need not read again;
        #: ``None``: not known
        self.seen: float | None = None
        #: while :attr:`seen` holds, the group :meth:`_due` finds at that time, where :meth:`event` knew it (the
        #: only entry by then, as :meth:`_due`'s shortcut finds it): a choice at that time takes it without
        #: reading it again; ``None``: not known
        self.seen_group: _Group | None = None

    # ------------------------------------------------------------------ the scheduler's calls
    def add(self, s: int, req, first: tuple | None = None) -> None:
        """Role ``s`` is able to run, waiting on ``req``: record its group (measured from the mailbox; or the
        :attr:`spare`, if ``req`` waits ``any`` on its live receives: another role's wait leaves it kept).
        ``first``: ``(s0, req0)``, a role recorded first in the same way (the one able alone until now)."""
        if first is not None:
            self.add(*first)
        spare = self.spare
        if spare is not None and req.any and self._adopt(spare, s, req):
            self.spare = None
            return
        recv, keys, box = self.recv_type, req.keys, self.inbox.box
        if not req.any and keys and not keys[1:]:      # (one key, the common case: no call per key)
            w = box[keys[0]][0]
            if w is None or (w.done if type(w) is recv else w.is_completed()):
                pend, chans = [], []    # (put locally, or completed)
            else:
                pend, chans = [w], [w.channel if type(w) is recv else (None, None)]     # (another kind: odd)
            g = _Group(s, req, pend, chans, False)
        else:
            if type(keys) is not tuple:     # (an ``any`` role's live dict view of its keys left: a snapshot)
                keys = tuple(keys)
            works = list(map(_entry_work, map(box.__getitem__, keys)))     # (no bytecode per key)
            pend, chans, plain, j = works, [None] * len(works), True, 0
            for w in works:         # (the common case: every one a pending receive of this fabric's; no call)
                if type(w) is not recv or w.done:
                    plain = False
                    break
                chans[j] = w.channel
                j += 1
            if not plain:           # (put locally, completed or of another kind)
                pend, chans = [], []
                for w in works:
                    if w is None or w.is_completed():
                        continue
                    chans.append(w.channel if type(w) is recv else (None, None))    # (another kind: odd)
                    pend.append(w)
            any_ = req.any and len(pend) == len(keys)
            if req.any and not any_:
                pend, chans = [], []     # a key is in: an empty group
            g = _Group(s, req, pend, chans, any_)
            if any_ and pend[1:] and not g.odd:     # (an ``any`` one of two receives or more: it may be kept,
                g.slots, g.keys, g.src, g.dead = keys, dict.fromkeys(keys), req.keys, set()     # :attr:`spare`)
            elif keys is not req.keys:
                g.slots = keys          # (the keys a choice answers with, by slot)
        self.groups[s] = g
        if g.empty:
            self.empties.add(s)
            return
        # record its receives under their channels (the :attr:`spare` dropped if it has one of them), and
        # measure it
        if g.odd:
            self.odd += 1
        if chans and not self.by_chan:
            self.ep.watch = self     # (told of the mailbox while it records a receive)
        by_chan, shared = self.by_chan, False
        for c in chans:
            if c in by_chan:
                lst = by_chan[c]
                if not lst[1:]:
                    self.odd += 1
                shared = shared or spare in lst
                lst.append(g)
            else:
                by_chan[c] = [g]
        if shared:                   # (a receive of the kept group's: it goes, the records decide again)
            self.spare = None
            self._drop(spare)
        self._measure(g)

    def remove(self, s: int, last: int | None = None) -> None:
        """Role ``s`` is resumed or no longer able to run: drop its group (nothing if none); then, if ``last`` is
        given, that role's too (the one left able alone)."""
        if last is not None:
            self.remove(s)
            s = last
        groups = self.groups
        if s not in groups:
            return
        g = groups[s]
        del groups[s]
        g.tick = -1
        if not groups:
            self.heap.clear()
            self.due.clear()
        if g.empty:
            self.empties.discard(s)
            return
        if g.chosen and g.keys is not None and len(g.keys) > 1 and g.pick is not None:
            # (resumed by a choice of the records, receives left: kept for the role's next wait)
            if self.spare is not None:
                self._drop(self.spare)
            self._kill(g, g.pick)
            self.spare = g
            return
        if g.odd:                    # (:meth:`_drop`, inline: once per resume)
            self.odd -= 1
        by_chan = self.by_chan
        for c in g.chans if not g.dead else list(g.index):
            lst = by_chan[c]
            if not lst[1:]:
                del by_chan[c]
            else:
                lst.remove(g)
                if not lst[1:]:
                    self.odd -= 1
        if not by_chan:
            self.ep.watch = None

    def _drop(self, g: _Group) -> None:
        """Forget ``g`` (out of ``groups`` already): its receives are recorded no more."""
        if g.odd:
            self.odd -= 1
        by_chan = self.by_chan
        for c in g.chans if not g.dead else list(g.index):     # (a kept group's live receives)
            lst = by_chan[c]
            if not lst[1:]:          # (g alone)
                del by_chan[c]
            else:
                lst.remove(g)
                if not lst[1:]:
                    self.odd -= 1
        if not self.by_chan:
            self.ep.watch = None

    def _kill(self, g: _Group, j: int) -> None:
        """Drop receive ``j`` (chosen) from kept group ``g``; its slot stays, dead."""
        c = g.chans[j]
        del g.index[c]
        lst = self.by_chan[c]
        if not lst[1:]:
            del self.by_chan[c]
        else:
            lst.remove(g)
            if not lst[1:]:
                self.odd -= 1
        g.dead.add(j)
        del g.keys[g.slots[j]]
        g.heads[j] = None
        while g.lo in g.dead:
            g.lo += 1

    def _adopt(self, g: _Group, s: int, req) -> bool:
        """Take kept group ``g`` over for role ``s``'s wait ``req`` (``any``) if it waits on ``g``'s live receives,
        pending, each still the one posted; into the heaps at its earliest head (as :meth:`_measure`).

        Where ``req.keys`` is the live dict view ``g`` was recorded from (:class:`~sparsecomm.fabric.roles.Recv`),
        (or last taken over for), for the same role's wait that went on (sequence number ``g.s``), with as many
        keys as ``g`` has live, it is taken over without a look at the keys (O(1)): the role deleted from the view
        exactly the keys it was resumed with, and each receive chosen here (killed) was one of them, so equal
        counts mean equal keys; the scheduler has watched every key of a wait that goes on (under one sequence
        number) and names them as a tuple instead where one was posted, put, taken or replaced meanwhile
        (:attr:`~sparsecomm.fabric.roles._Scheduler.touched`), and a message of a live receive arrived or taken
        made ``g`` :attr:`~_Group.stale`. Otherwise the keys are compared and their receives looked up (O(n))."""
        keys = req.keys
        if g.stale or len(keys) != len(g.keys):
            return False
        if keys is not g.src or s != g.s:
            if list(g.keys) != list(keys):
                return False
            dead = g.dead
            live = [w for j, w in enumerate(g.works) if j not in dead]
            posted = list(map(_entry_work, map(self.inbox.box.__getitem__, keys)))
            if posted != live or any(map(_done, live)):    # (each the receive posted, pending)
                return False
            g.src = keys            # (the same keys: a next wait on this object, if a view, is taken over in O(1))
        g.s, g.req, g.chosen, g.pick, g.exact = s, req, False, None, -1
        self.groups[s] = g
        units, heads = g.units, g.heads
        while units and heads[units[0][1]] != units[0][0]:
            heappop(units)           # (stale)
        if units:
            self._push(g, units[0][0])
        return True

    def completed(self, works) -> None:
        """``works`` (receives of this endpoint) have completed: a group still recording one is recorded
        afresh (a receive two groups share, completed for one of them)."""
        for w in works:
            if type(w) is not self.recv_type:
                continue
            for g in list(self.by_chan.get(w.channel, ())):
                if not g.chosen and self.groups.get(g.s) is g and any(x is w for x in g.works):
                    self.remove(g.s)
                    self.add(g.s, g.req)

    # ------------------------------------------------------------------ the endpoint's mailbox
    def arrived(self, msg: Msg, retimed: bool) -> float | None:
        """``msg`` was put in the mailbox (``retimed``: queued messages may have moved; a record's bounds hold);
        returns :meth:`bound` as it is then (what the world's entry for the wait is compared with)."""
        c, by_chan = (msg.src, msg.tag), self.by_chan
        lst = by_chan[c] if c in by_chan else None
        if lst is not None or retimed:
            self.seen = self.seen_group = None
        if lst is not None and self.ep.mailbox[c][0] is msg:       # a new head
            d = msg.delivered
            v = d if d > 0.0 else 0.0
            for g in lst:
                if g.chosen:
                    g.stale = True      # (a kept group's records miss it: not taken over)
                    continue
                j = g.index[c]
                g.heads[j] = v
                g.exact = -1
                if g.any:
                    heappush(g.units, (v, j))
                    if g.tick < 0 or v < g.lb:
                        self.ticks = tick = self.ticks + 1     # (:meth:`_push`, inline)
                        g.tick, g.lb = tick, v
                        heappush(self.heap, (v, tick, g))
                else:
                    g.missing -= 1
                    if v > g.latest:
                        g.latest = v
                    if not g.missing and (g.tick < 0 or g.latest < g.lb):
                        self.ticks = tick = self.ticks + 1     # (:meth:`_push`, inline)
                        g.tick, g.lb = tick, g.latest
                        heappush(self.heap, (g.latest, tick, g))
        clock = self.ep.clock       # (:meth:`bound`, inline: once per message)
        if self.due:
            return clock
        heap = self.heap
        if heap:
            lb = heap[0][0]
            return lb if lb > clock else clock
        return None

    def taken(self, msg: Msg) -> None:
        """``msg`` was taken from the mailbox (the next on its channel is the head)."""
        c, by_chan = (msg.src, msg.tag), self.by_chan
        lst = by_chan[c] if c in by_chan else None
        if lst is not None:
            self.seen_group = None      # (its heads read again: a choice finds its group afresh)
            for g in lst:
                if not g.chosen:
                    self._measure(g)
                elif g.index[c] != g.pick:      # (not the message chosen: a kept group would be stale)
                    g.stale = True

    def ready(self) -> set[int]:
        """The roles whose messages are in: those with no receive pending (on a SimFabric a receive is
        complete once taken, and a send once started), or, for an ``any`` one, with one not pending."""
        return self.empties

    # ------------------------------------------------------------------ a choice
    def _measure(self, g: _Group) -> None:
        """Read ``g``'s heads from the mailbox (bounds), and enter it in the heaps if it is in earlier."""
        chans = g.chans
        if not chans[1:] and not g.any and chans:      # (one receive, the common case: no call per receive)
            box, c = self.ep.mailbox, chans[0]
            q = box[c] if c in box else None
            g.exact = -1
            if not q:
                g.heads, g.missing, g.latest = [None], 1, 0.0
                return
            d = q[0].delivered
            t = g.latest = d if d > 0.0 else 0.0
            g.heads, g.missing = [t], 0
            if g.tick < 0 or t < g.lb:
                self.ticks = tick = self.ticks + 1     # (:meth:`_push`, inline)
                g.tick, g.lb = tick, t
                heappush(self.heap, (t, tick, g))
            return
        box, heads = self.ep.mailbox, [None] * len(chans)     # (a loop, not comprehensions: no call per receive)
        missing, latest, j = 0, 0.0, 0
        for c in chans:
            q = box[c] if c in box else None
            if q:
                d = q[0].delivered
                v = heads[j] = d if d > 0.0 else 0.0
                if v > latest:
                    latest = v
            else:
                missing += 1
            j += 1
        if g.dead:                   # (a kept group's dead slots: not counted)
            for j in g.dead:
                heads[j] = None
            missing = heads.count(None)
            latest = max([v for v in heads if v is not None], default=0.0)
        g.heads, g.missing, g.exact = heads, missing, -1
        g.latest = latest
        if g.any:
            g.units = units = [(v, j) for j, v in enumerate(heads) if v is not None]
            heapify(units)
            t = units[0][0] if units else None
        else:
            t = None if missing else g.latest
        if t is not None and (g.tick < 0 or t < g.lb):
            self.ticks = tick = self.ticks + 1     # (:meth:`_push`, inline)
            g.tick, g.lb = tick, t
            heappush(self.heap, (t, tick, g))

    def _push(self, g: _Group, t: float) -> None:
        """Enter ``g`` in the heaps anew, at lower bound ``t`` (its earlier entry is stale)."""
        self.ticks = tick = self.ticks + 1
        g.tick, g.lb = tick, t
        heappush(self.heap, (t, tick, g))

    def _time(self, g: _Group) -> float | None:
        """``g``'s time (when it is in; ``None``: not in): the latest of its heads, read exactly, or an ``any``
        one's earliest (its receives read exactly in the order of their bounds until one is exact)."""
        ep = self.ep
        epoch = ep.epoch
        if g.exact == epoch:
            return g.time
        g.exact = epoch
        box, heads, chans = ep.mailbox, g.heads, g.chans
        if g.any:
            units = g.units
            while units:
                lb, j = units[0]
                if heads[j] != lb:
                    heappop(units)          # (stale)
                    continue
                m = box[chans[j]][0]
                d = m.delivered if m.stamp >= epoch else ep.delivery(m)
                v = d if d > 0.0 else 0.0
                if v == lb:
                    g.time = v
                    return v
                heads[j] = v
                heapreplace(units, (v, j))
            g.time = None
            return None
        if g.missing:
            g.time = None
            return None
        t = 0.0
        for j, c in enumerate(chans):
            m = box[c][0]
            d = m.delivered if m.stamp >= epoch else ep.delivery(m)
            v = heads[j] = d if d > 0.0 else 0.0
            if v > t:
                t = v
        g.latest = g.time = t
        return t

    def _due(self, t: float) -> _Group | None:
        """The first group in order of preference in by ``t``, if any.

        When no group waits in :attr:`due` and the top of :attr:`heap` is the only entry whose bound is by ``t``
        (the common case), that group is the only candidate: it is read where it is, its entry left at the top
        (no pass through :attr:`due`; stale once the group is chosen, dropped when next met)."""
        heap, due = self.heap, self.due
        if not due and heap:
            top, rest = heap[0], heap[1:3]      # (the top's children: the next smallest is one of them)
            if top[0] <= t and top[2].tick == top[1] and (not rest or (rest[0][0] > t and rest[-1][0] > t)):
                g = top[2]
                e = self._time(g)
                if e is not None and e <= t:
                    return g
                if e is None:
                    heappop(heap)
                    g.tick = -1
                else:               # (:meth:`_push`, its entry replaced)
                    self.ticks = tick = self.ticks + 1
                    g.tick, g.lb = tick, e
                    heapreplace(heap, (e, tick, g))
                return None
        while heap and heap[0][0] <= t:
            _, tick, g = heappop(heap)
            if g.tick == tick:
                heappush(due, (g.req.stage, g.s, tick, g))
        while due:
            _, _, tick, g = due[0]
            if g.tick == tick:
                e = self._time(g)
                if e is not None and e <= t:
                    return g
                heappop(due)
                if e is None:
                    g.tick = -1
                else:
                    self._push(g, e)
            else:
                heappop(due)
        return None

    def bound(self) -> float | None:
        """A lower bound of :meth:`event` (``None``: no group is in, nor can be before a message arrives): the
        world's entry for the wait, read without measuring a group (:meth:`event` is read when the entry
        fires). A group in has an entry in :attr:`heap` or :attr:`due` whose time is at most its own, and the
        event is never before the clock."""
        clock = self.ep.clock
        if self.due:
            return clock
        heap = self.heap
        if heap:
            lb = heap[0][0]
            return lb if lb > clock else clock
        return None

    def event(self) -> float | None:
        """When the first group is in (at the earliest the endpoint's clock); ``None`` if none is. Where the
        group a choice at that time takes is known (the only entry by then), it is :attr:`seen_group`."""
        clock = self.ep.clock
        heap = self.heap
        self.seen_group = None
        while heap and heap[0][2].tick != heap[0][1]:
            heappop(heap)           # (stale tops, a chosen group's above all: dropped here, not through _due)
        if (self.due or (heap and heap[0][0] <= clock)) and self._due(clock) is not None:
            self.seen = clock       # (none due by the clock, the common case: _due would find none, not called)
            return clock
        while heap:
            lb, tick, g = heap[0]
            if g.tick != tick:
                heappop(heap)
                continue
            e = self._time(g)
            if e == lb:
                self.seen = e
                rest = heap[1:3]    # (the top's children: the next smallest is one of them)
                if not self.due and (not rest or (rest[0][0] > e and rest[-1][0] > e)):
                    self.seen_group = g     # (the only entry by e: what _due(e) returns, read at e already)
                return e
            if e is None:
                heappop(heap)
                g.tick = -1
            else:
                self.ticks = tick = self.ticks + 1
                g.tick, g.lb = tick, e
                heapreplace(heap, (e, tick, g))
        self.seen = None
        return None

    def choose(self, world, clock_only: bool = False, at: float | None = None) -> tuple[int, object] | None:
        """Make the choice: at :meth:`event`, the first group in order in by then (``clock_only``: the first group,
        and only if it is in by the clock; ``at``: only if the event is ``at``); ``None`` if there is none (nothing
        chosen). Its role is marked chosen, its group's messages are taken from the mailbox (through ``world``,
        :meth:`~.sim_world.World.take`, in the order of their arrival) and its receives completed with them (an
        ``any`` one's: the receive that chose it, the first in order of those in by then). Returns ``(s, key)``,
        what the drive is resumed with: the role chosen and, for an ``any`` one, the key of the receive that chose
        it (what the role is resumed with, :class:`~sparsecomm.fabric.roles.Recv`; a kept group's slots are those
        it was recorded with, :attr:`_Group.slots`), else ``None``. The records decide the choice (none
        :attr:`odd`): no other group holds these receives."""
        groups = self.groups
        if clock_only:
            clock = self.ep.clock
            for _, s in self.order:
                g = groups[s]
                if g.any:
                    if not g.heads:
                        continue     # (no receive: no group)
                    lo = g.lo        # (its first live receive)
                    if g.heads[lo] is None or g.heads[lo] > clock:
                        return None
                    ep = self.ep
                    d = ep.delivery(ep.mailbox[g.chans[lo]][0])
                    if (d if d > 0.0 else 0.0) > clock:
                        return None
                    g.chosen, g.tick, g.pick = True, -1, lo
                    j = lo
                    break
                if g.missing or g.latest > clock:
                    return None
                if self._time(g) > clock:
                    return None
                g.chosen, g.tick = True, -1
                j = None
                break
            else:
                return None
            self.seen = self.seen_group = None     # (what event() found is read again before a choice at it)
        else:
            if at is not None and at == self.seen:
                t, g = at, self.seen_group
                if g is None:
                    g = self._due(t)
            else:
                t = self.event()
                if t is None or (at is not None and t != at):
                    return None
                g = self._due(t)
            self.seen_group = None
            if g is None:
                raise AssertionError("unreachable: the earliest group is in by the event")
            g.chosen, g.tick = True, -1
            if not g.any:
                j = None
            else:
                ep, heads, chans, units = self.ep, g.heads, g.chans, g.units
                box, epoch, pick, seen = ep.mailbox, ep.epoch, None, []
                while units and units[0][0] <= t:      # its receives in by t: the first of them in order
                    lb, k = heappop(units)
                    if heads[k] == lb:
                        seen.append((lb, k))
                        if pick is None or k < pick:
                            m = box[chans[k]][0]
                            d = m.delivered if m.stamp >= epoch else ep.delivery(m)
                            if d <= t:
                                pick = k
                if g.keys is not None:       # (it may be kept: its heap as it was)
                    for e in seen:
                        heappush(units, e)
                g.pick = j = pick
        # the messages taken, the receives completed
        ep = self.ep
        box, take = ep.mailbox, world.take
        if j is None:
            chans = g.chans
            if chans[2:]:
                msgs = [box[c][0] for c in chans]
                for m in sorted(msgs, key=_head):     # (taken in the order they arrived; sorted is stable)
                    take(ep, m)
                for w, m in zip(g.works, msgs):
                    w.complete(m)
            elif chans[1:]:          # (two: sorted's order without its calls)
                m0, m1 = box[chans[0]][0], box[chans[1]][0]
                if m1.head < m0.head:
                    take(ep, m1)
                    take(ep, m0)
                else:
                    take(ep, m0)
                    take(ep, m1)
                works = g.works
                works[0].complete(m0)
                works[1].complete(m1)
            elif chans:
                g.works[0].complete(take(ep, box[chans[0]][0]))
            return g.s, None
        m = take(ep, box[g.chans[j]][0])
        g.works[j].complete(m)
        return g.s, (g.slots if g.slots is not None else g.req.keys)[j]

    def first_key(self) -> tuple[int | None, int]:
        """The first receive of the first group (for a report of what the endpoint waits for)."""
        for _, s in self.order:
            g = self.groups.get(s)
            if g is not None and g.chans:
                return g.chans[g.lo]
        return (None, -1)
