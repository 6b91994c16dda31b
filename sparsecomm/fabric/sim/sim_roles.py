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
other group has, each once, and from a named source: where one is not, :meth:`RoleWaits.exact` says so and
the driver builds the groups as before for that choice (the records are kept all the same). On a SimFabric a
send is complete once started, so a role's ``free`` sends are never pending and are not recorded.
"""

from __future__ import annotations

from .sim_network import Endpoint, Msg

__all__ = ["RoleWaits"]


class _Group:
    """The record of role ``s``'s group (its :class:`~sparsecomm.fabric.roles.Recv` ``req``): its pending
    receives ``works`` on ``chans`` (``index``: a channel's place in them), and per receive its head's
    delivery (at least 0) or ``None`` (``heads``); ``any``: each receive alone; otherwise ``missing`` receives
    without a head and ``latest``, the latest delivery of the heads (0 if none). ``empty``: no receive pending
    (chosen at once); ``odd``: a receive the records cannot follow (an any-source one, or a ``(source, tag)``
    twice); ``chosen``: taken by a choice, about to be dropped."""

    __slots__ = ("s", "req", "works", "chans", "index", "any", "heads", "missing", "latest", "empty", "odd",
                 "chosen")

    def __init__(self, s: int, req, works: list, chans: list, any_: bool) -> None:
        self.s, self.req, self.works, self.chans, self.any = s, req, works, chans, any_
        self.index = {c: j for j, c in enumerate(chans)}
        self.heads: list = []
        self.missing, self.latest = 0, 0.0
        self.empty = not works and not any_
        self.odd = len(self.index) < len(chans) or any(c[0] is None for c in chans)
        self.chosen = False


class RoleWaits:
    """The :class:`~sparsecomm.fabric.roles.WaitSet` of one drive on endpoint ``ep`` (its process's), whose
    roles post their receives in ``inbox``; ``recv_type``: the SimFabric's posted receive (a receive of
    another kind makes the groups odd). While it records a receive it is the endpoint's ``watch``, which the
    world tells of every message put in or taken from the mailbox. For the world's loop it is also the state
    of the wait of a choice (as :class:`~.sim_wait.OrderedWait`: :meth:`first`, :meth:`recompute`,
    :meth:`event`, :meth:`receives`), over the groups in the order of :meth:`choose`."""

    def __init__(self, ep: Endpoint, inbox, recv_type: type) -> None:
        self.ep, self.inbox, self.recv_type = ep, inbox, recv_type
        self.groups: dict[int, _Group] = {}
        self.by_chan: dict[tuple, list[_Group]] = {}   # (source, tag) -> the groups with a receive on it
        self.empties: set[int] = set()
        self.odd = 0                 # odd groups, and channels shared by two groups: the records do not decide
        self.order: list = []        # the scheduler's order of preference, as of the last choose()
        self.t_min: float | None = None     # min over the groups in of their time (valid unless ``stale``)
        self.stale = True

    # ------------------------------------------------------------------ the scheduler's calls
    def add(self, s: int, req) -> None:
        """Role ``s`` is able to run, waiting on ``req``: record its group (measured from the mailbox)."""
        work, recv = self.inbox.work, self.recv_type
        pend, chans = [], []
        for k in req.keys:
            w = work(k)
            if w is None:
                continue
            if type(w) is recv:
                if w.is_completed():
                    continue
                chans.append(w.channel)
            elif w.is_completed():
                continue
            else:
                chans.append((None, None))      # (a receive of another kind: odd)
            pend.append(w)
        any_ = req.any and len(pend) == len(req.keys)
        if req.any and not any_:
            pend, chans = [], []     # a key is in: an empty group
        g = _Group(s, req, pend, chans, any_)
        self.groups[s] = g
        if g.empty:
            self.empties.add(s)
            return
        if g.odd:
            self.odd += 1
        if g.chans and not self.by_chan:
            self.ep.watch = self     # (told of the mailbox while it records a receive)
        for c in g.chans:
            lst = self.by_chan.get(c)
            if lst is None:
                self.by_chan[c] = [g]
            else:
                if len(lst) == 1:
                    self.odd += 1
                lst.append(g)
        self._measure(g)
        self._lower_group(g)

    def remove(self, s: int) -> None:
        """Role ``s`` is resumed or no longer able to run: drop its group (nothing if none)."""
        g = self.groups.pop(s, None)
        if g is None:
            return
        if g.empty:
            self.empties.discard(s)
            return
        if g.odd:
            self.odd -= 1
        for c in g.chans:
            lst = self.by_chan[c]
            if len(lst) == 1:
                del self.by_chan[c]
            else:
                lst.remove(g)
                if len(lst) == 1:
                    self.odd -= 1
        if not self.by_chan:
            self.ep.watch = None
        self.stale = True            # (it may have been the earliest)

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
    def arrived(self, msg: Msg, moved: list[Msg]) -> None:
        """``msg`` was put in the mailbox; ``moved``: the queued messages whose deliveries its arrival moved."""
        box, by_chan = self.ep.mailbox, self.by_chan
        c = (msg.src, msg.tag)
        lst = by_chan.get(c)
        if lst is not None and box[c][0] is msg:       # a new head
            d = msg.delivered
            v = d if d > 0.0 else 0.0
            for g in lst:
                if g.chosen:
                    continue
                g.heads[g.index[c]] = v
                if g.any:
                    self._lower(v)
                else:
                    g.missing -= 1
                    if v > g.latest:
                        g.latest = v
                    if not g.missing:
                        self._lower(g.latest)
        for m in moved:       # a head whose delivery moved: its groups' latest follows (the minimum is taken afresh)
            c = (m.src, m.tag)
            lst = by_chan.get(c)
            if lst is not None and box[c][0] is m:
                d = m.delivered
                v = d if d > 0.0 else 0.0
                for g in lst:
                    if g.chosen:
                        continue
                    heads, j = g.heads, g.index[c]
                    old, heads[j] = heads[j], v
                    if not g.any:
                        if v > g.latest:
                            g.latest = v
                        elif old == g.latest and v < old:     # (the latest came earlier)
                            g.latest = max((h for h in heads if h is not None), default=0.0)
                    self.stale = True

    def taken(self, msg: Msg) -> None:
        """``msg`` was taken from the mailbox (the next on its channel is the head)."""
        lst = self.by_chan.get((msg.src, msg.tag))
        if lst is not None:
            for g in lst:
                if not g.chosen:
                    self._measure(g)
                    self.stale = True

    def ready(self) -> set[int]:
        """The roles whose messages are in: those with no receive pending (on a SimFabric a receive is
        complete once taken, and a send once started), or, for an ``any`` one, with one not pending."""
        return self.empties

    # ------------------------------------------------------------------ a choice
    def exact(self) -> bool:
        """Do the records decide the choice (no odd group, no channel two groups share)?"""
        return not self.odd

    def choose(self, order: list) -> int | None:
        """Start a choice over the groups of ``order`` (``(stage, sequence number)`` of the roles able to
        run, in order of preference): the role of the first empty group, chosen at once; ``None`` if none is
        (the choice is then a wait, this object its state)."""
        self.order = order
        if self.empties:
            groups = self.groups
            return min((groups[s].req.stage, s) for s in self.empties)[1]
        return None

    def _measure(self, g: _Group) -> None:
        box = self.ep.mailbox
        heads, missing, latest = [], 0, 0.0
        for c in g.chans:
            q = box.get(c)
            if q:
                d = q[0].delivered
                if d > latest:
                    latest = d
                heads.append(d if d > 0.0 else 0.0)
            else:
                missing += 1
                heads.append(None)
        g.heads, g.missing, g.latest = heads, missing, latest

    def _lower(self, t: float) -> None:
        if not self.stale and (self.t_min is None or t < self.t_min):
            self.t_min = t

    def _lower_group(self, g: _Group) -> None:
        if g.any:
            for d in g.heads:
                if d is not None:
                    self._lower(d)
        elif not g.missing:
            self._lower(g.latest)

    def recompute(self) -> None:
        """Take the minimum over the groups in afresh, if a group's time may have risen."""
        if self.stale:
            self.stale, self.t_min = False, None
            for g in self.groups.values():
                if not (g.empty or g.chosen):
                    self._lower_group(g)

    def event(self) -> float | None:
        """When the first group is in (at the earliest the endpoint's clock); ``None`` if none is."""
        self.recompute()
        return None if self.t_min is None else max(self.ep.clock, self.t_min)

    def first(self, clock_only: bool = False) -> tuple[float, tuple] | None:
        """``(t, (s, j))``: :meth:`event`, and the first group in order in by then (role ``s``'s; ``j``: the
        receive of an ``any`` one, else ``None``); its role is marked chosen. ``clock_only``: the first group,
        and only if it is in by the clock."""
        groups = self.groups
        if clock_only:
            clock = self.ep.clock
            for _, s in self.order:
                g = groups[s]
                if g.any:
                    if not g.heads:
                        continue     # (no receive: no group)
                    d = g.heads[0]
                    if d is None or d > clock:
                        return None
                    g.chosen = True
                    return clock, (s, 0)
                if g.missing or g.latest > clock:
                    return None
                g.chosen = True
                return clock, (s, None)
            return None
        t = self.event()
        if t is None:
            return None
        for _, s in self.order:
            g = groups[s]
            if g.any:
                for j, d in enumerate(g.heads):
                    if d is not None and d <= t:
                        g.chosen = True
                        return t, (s, j)
            elif not g.missing and g.latest <= t:
                g.chosen = True
                return t, (s, None)
        raise AssertionError("unreachable: the earliest group is in by the event")

    def receives(self, token: tuple) -> list[tuple[int, int]]:
        """The ``(source, tag)`` of the receives of the group ``token`` (of :meth:`first`)."""
        s, j = token
        chans = self.groups[s].chans
        return chans if j is None else [chans[j]]

    def works(self, token: tuple) -> list:
        """The pending receives of the group ``token`` (of :meth:`first`), in the order of :meth:`receives`."""
        s, j = token
        works = self.groups[s].works
        return works if j is None else [works[j]]

    def first_key(self) -> tuple[int | None, int]:
        """The first receive of the first group (for a report of what the endpoint waits for)."""
        for _, s in self.order:
            g = self.groups.get(s)
            if g is not None and g.chans:
                return g.chans[0]
        return (None, -1)
