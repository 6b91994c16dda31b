"""The SimFabric's world: one discrete-event loop over every endpoint's processes, in modelled time.

Everything an endpoint waits for in the simulation is a *process* (:class:`Proc`): a generator that
yields what it waits for, a :class:`RecvWait` (one receive) or an :class:`AnyWait` (whichever of several
groups of receives is in first), and is resumed with the messages it takes. A worker's call (a
transport's roles run by ``Fabric.drive``, a blocking receive, a ``wait_any``), a service's main: each
is one process of its endpoint. :meth:`World.run` steps them, one at a time, in one thread, in a fixed
order: the processes able to run first (a plain receive whose message is in), first in first out (those
that threads handed over while the loop waited, in the order of their endpoints); then,
once none is and no endpoint's own thread is running (*quiescence*), the earliest pending *event* or
*deadline* of a blocked process, from a heap keyed ``(modelled time, event before deadline, endpoint,
process)``. No lock, no condition variable, no thread: code outside (a worker's training loop, which keeps
its thread up to the call) hands its processes to the world and parks (:mod:`sparsecomm.fabric.sim_gate`),
and the loop runs when every endpoint's thread has parked or finished.

Semantics (the same as a conservative parallel discrete-event simulation, deterministic):

- a *plain* receive (from one source, or from any source on an endpoint that is not ``per_port``) takes
  the first matching message as soon as it is in the mailbox (within its deadline, if any);
- an *ordered* wait (an any-source receive of a ``per_port`` endpoint, a switch; every ``wait_any``
  whose first group -- on a ``per_port`` endpoint, any group -- is not in by the endpoint's clock) takes
  a message only when its delivery is the earliest event of the world, so a packet is handled at its own
  arrival time and a self-clocked protocol sees the order of modelled time, not of the threads;
- a deadline (a receive's ``timeout=``, modelled seconds) fires when it is the earliest event;
- with nothing able to run and no event or deadline pending while a worker waits, the run is
  deadlocked: every waiting process raises :class:`FabricTimeout` naming what each waits for.

Since processes run only while no endpoint's thread runs, what a running thread does to the world
(sends: appending to a channel's queue, placing a message on a NIC's schedule by its head) commutes, and
the processes threads hand over are stepped in the order of their endpoints, not of the threads' arrival,
modelled times do not depend on how threads are scheduled: two runs give identical values.

Faults (:class:`~.sim_network.Network`): ``loss`` drops datagrams sent with ``reliable=False`` with that
probability, decided by a generator per directed link seeded from ``(seed, src, dst)``; ``stragglers``
slows an endpoint's compute and its NIC; ``crash`` makes an endpoint die silently after a number of
sends, so that its peers can only notice by timing out.
"""

from __future__ import annotations

import contextvars
import gc
import heapq
from collections import deque
from typing import Generator

from ...errors import EndpointCrashed, FabricTimeout, InvalidValueError, PeerFailure, ServiceShutdown
from .. import trace as _trace
from .sim_network import Endpoint, Msg, Network
from .sim_wait import OrderedWait, any_head

__all__ = ["World", "Proc", "RecvWait", "AnyWait"]


class RecvWait:
    """Wait for the first message from ``src`` (``None``: any source) on ``tag``, delivered by ``deadline``
    (modelled seconds; ``None``: none) if any; ``ordered``: take it only when its delivery is the world's
    earliest event. The process is resumed with the :class:`~.sim_network.Msg` it took (or a
    :class:`FabricTimeout` at the deadline; ``timeout``: the seconds it was given, for the message).
    ``tried``: :meth:`World.take_now` has just missed it, in the same step (not tried again when it is yielded,
    unless the run is failing or over)."""

    __slots__ = ("src", "tag", "deadline", "ordered", "timeout", "tried")

    def __init__(self, src: int | None, tag: int, deadline: float | None = None, ordered: bool = False,
                 timeout: float | None = None, tried: bool = False) -> None:
        self.src, self.tag, self.deadline, self.ordered, self.timeout = src, tag, deadline, ordered, timeout
        self.tried = tried


class AnyWait:
    """Wait for whichever of the groups ``keys`` (lists of ``(source, tag)``) is in first in modelled time
    (:class:`~.sim_wait.OrderedWait`); resumed with ``(index, messages)``: the group chosen and its
    messages, in the group's order, taken in the order of their arrival. ``watch``: the state of the wait,
    kept elsewhere already (a drive's :class:`~.sim_roles.RoleWaits`, whose groups are its own, ``keys``
    ``None``; resumed with what its ``choose`` returns); by default an :class:`~.sim_wait.OrderedWait` of ``keys``.

    The state of the wait is read through ``choose`` (the choice, clock only or at the event, its messages taken:
    what the process is resumed with; ``None`` if none is in by then), ``bound`` (a lower
    bound of the event, the world's entry: checked against ``event`` when it fires, and entered again later if
    the event is later; ``arrived``, told of a message put in the mailbox, returns it), ``event``, and, with
    ``keys``, ``recompute``. A wait may be yielded again (it keeps no state of its
    own)."""

    __slots__ = ("keys", "watch")

    def __init__(self, keys: list[list[tuple[int | None, int]]] | None, watch=None) -> None:
        self.keys = keys
        self.watch = watch


class Proc:
    """A process of endpoint ``ep``: the generator ``gen``, what it waits for (``wait``, ``None`` while
    able to run), what it is resumed with next (``value``, or ``exc`` thrown in), and once it has returned
    (``done``) its ``result`` or ``error``. ``owner``: a thread parked on it (:mod:`sparsecomm.fabric.sim_gate`),
    whose endpoint runs again the moment it is done. It runs in the context (:mod:`contextvars`) of the code that
    spawned it, whichever thread runs the loop."""

    __slots__ = ("ep", "gen", "seq", "wait", "value", "exc", "done", "result", "error", "owner", "no",
                 "event", "queued", "retry", "context")

    def __init__(self, ep: Endpoint, gen: Generator, seq: int, owner: bool) -> None:
        self.ep, self.gen, self.seq, self.owner = ep, gen, seq, owner
        #: the context variables it runs with: those of the code that handed it over (a call's identity)
        self.context = contextvars.copy_context()
        self.wait: RecvWait | AnyWait | None = None
        self.value: object = None
        self.exc: BaseException | None = None
        self.done = False
        self.result: object = None
        self.error: BaseException | None = None
        self.no = 0                  # how many times it has blocked (a heap entry names the wait it is for)
        self.event: float | None = None     # an ordered wait's event, as last pushed
        self.queued = False
        self.retry: RecvWait | AnyWait | None = None    # woken without an outcome: try this wait again


def _by_endpoint(p: Proc) -> tuple[int, int]:
    return p.ep.id, p.seq


#: the world's heap is not compacted below this many entries (:meth:`World._compact`)
HEAP_FLOOR = 4096


def _live(entry) -> bool:
    """Would :meth:`World._fire` act on this heap entry (its wait is still the one it was pushed for, and an
    event's time still its event)? Once not, never again: a wait's number only grows, and a wait whose event
    moves back to an earlier value pushes an entry of it anew (:meth:`World._reevent`, :meth:`World.arrived`)."""
    t, kind, _, _, no, p = entry
    return p.wait is not None and no == p.no and (kind == 1 or t == p.event)


class World:
    """Shared state of one simulated run: the endpoints, their mailboxes, the network model, and the loop
    (:meth:`run`) over their processes. Not thread-safe: every call comes from the one thread that holds
    the world (:mod:`sparsecomm.fabric.sim_gate` serialises the threads of user code)."""

    def __init__(self, world_size: int, network: Network | None = None) -> None:
        if world_size < 1:
            raise InvalidValueError(f"world_size must be >= 1, got {world_size}")
        self.network = network or Network()
        self.world_size = world_size
        self.endpoints: list[Endpoint] = [
            Endpoint(self.network, r, self.network.bytes_per_s, self.network.latency_us * 1e-6, False,
                     f"worker{r}")
            for r in range(world_size)
        ]
        #: endpoints whose thread is running (outside the world): the loop fires events only when none is
        self.running = world_size
        self.failure: tuple[int, BaseException] | None = None
        self.closed = False
        self.deadlocked = False
        self.deadlock_info = ""
        self.service_ids: dict[str, int] = {}
        self.service_errors: list[tuple[int, BaseException]] = []
        #: state the layers above share between this world's endpoints (``Fabric.world_scratch``)
        self.scratch: dict = {}
        self._runq: deque[Proc] = deque()
        self._heap: list = []
        #: the heap's length past which its stale entries are dropped (:meth:`_compact`)
        self._heap_cap = HEAP_FLOOR
        self._blocked = 0
        self._seq = 0

    # ----------------------------------------------------------------- endpoints
    def add_endpoint(self, bw: float, latency: float, per_port: bool, name: str, threaded: bool) -> Endpoint:
        """A new live endpoint (a service's) with the next id; ``threaded``: a thread acts for it."""
        ep = Endpoint(self.network, len(self.endpoints), bw, latency, per_port, name, threaded)
        self.endpoints.append(ep)
        if threaded:
            self.running += 1
        return ep

    def park(self, ep: Endpoint) -> None:
        """A thread of ``ep`` waits in the world: once none of its threads runs, it counts as blocked."""
        if ep.parked == 0 and ep.alive and ep.threaded:
            self.running -= 1
        ep.parked += 1

    def unpark(self, ep: Endpoint) -> None:
        """A thread of ``ep`` leaves the world (its process is done, or it gave up)."""
        ep.parked -= 1
        if ep.parked == 0 and ep.alive and ep.threaded:
            self.running += 1

    def finished(self, eid: int) -> None:
        """Endpoint ``eid``'s thread has returned (or crashed): it will send nothing more."""
        ep = self.endpoints[eid]
        if ep.alive:
            ep.alive = False
            if ep.threaded and ep.parked == 0:
                self.running -= 1

    def fail(self, eid: int, exc: BaseException) -> None:
        """Record that endpoint ``eid`` failed: every wait of every other endpoint raises :class:`PeerFailure`."""
        if self.failure is None:
            self.failure = (eid, exc)
        World.finished(self, eid)
        self._wake_all()

    def close(self) -> None:
        """End the run: the processes still waiting (services) raise :class:`ServiceShutdown`."""
        self.closed = True
        self._wake_all()

    def _wake_all(self) -> None:
        for ep in self.endpoints:
            for p in list(ep.waiters):
                self._unblock(p, retry=True)

    # ----------------------------------------------------------------- processes
    def spawn(self, ep: Endpoint, gen: Generator, owner: bool = False) -> Proc:
        """Hand the process ``gen`` of ``ep`` to the loop (it runs at the loop's next :meth:`run`)."""
        self._seq += 1
        p = Proc(ep, gen, self._seq, owner)
        self._ready(p)
        return p

    def cancel(self, p: Proc) -> None:
        """Withdraw ``p`` (its thread gave up waiting): it is closed and runs no more."""
        if p.done:
            return
        self._withdraw(p)
        p.done = True
        p.gen.close()

    def run(self) -> None:
        """Step the processes able to run; at quiescence (none able to run, no endpoint's thread running)
        fire the earliest event or deadline; repeat until nothing can happen without a thread. The processes
        that threads made able to run since the last run (calls handed over, processes their sends woke) are
        stepped in the order of their endpoints (then of their creation), not in the order the threads came,
        which is their scheduling's: a process stepped first may send what another finds in by its clock. An exception
        of a process, or of the loop's handling of its wait (its endpoint's records, :meth:`_fault`), is that
        process's outcome, whichever thread runs the loop; any other exception of the loop propagates."""
        runq = self._runq
        if len(runq) > 1:           # (what threads handed over since the last run, in the order of their endpoints)
            handed = sorted(runq, key=_by_endpoint)
            runq.clear()
            runq.extend(handed)
        paused = gc.isenabled()     # the cyclic garbage collector waits while the loop runs (as ``timeit``
        if paused:                  # pauses it): at a few hundred endpoints its full passes over every live
            gc.disable()            # object cost a third of the loop; what the loop leaves in cycles is found later
        try:
            self._run()
        finally:
            if paused:
                gc.enable()

    def _run(self) -> None:
        runq = self._runq
        while True:
            while runq:
                p = runq.popleft()
                p.queued = False
                self._step(p)
            if self.running > 0 or not self._blocked:
                return
            if not self._fire():
                self._deadlock()
                if not runq:
                    return

    def _ready(self, p: Proc) -> None:
        if not p.queued:
            p.queued = True
            self._runq.append(p)

    def _step(self, p: Proc) -> None:
        """Resume ``p`` and run it until it waits for what is not in, or returns (its ``retry`` first)."""
        req, p.retry = p.retry, None
        resume = req is None
        gen, run = p.gen, p.context.run
        while True:
            if resume:
                try:
                    if p.exc is not None:
                        exc, p.exc = p.exc, None
                        req = run(gen.throw, exc)
                    else:
                        value, p.value = p.value, None
                        req = run(gen.send, value)
                except StopIteration as stop:
                    self._done(p, stop.value, None)
                    return
                except BaseException as exc:  # noqa: BLE001 - the process's outcome, given to its owner
                    self._done(p, None, exc)
                    return
            resume = True
            if (type(req) is RecvWait and self.failure is None and not self.closed and not self.deadlocked
                    and not p.ep.crashed):
                if req.tried:
                    req.tried = False       # (missed in this step already: it blocks; a retry tries it)
                    self._block(p, req)
                    return
                if not req.ordered and req.src is not None:     # (_try's named receive, inline)
                    ep = p.ep
                    box, ch = ep.mailbox, (req.src, req.tag)
                    q = box[ch] if ch in box else None
                    try:
                        if q and (req.deadline is None or ep.delivery(q[0]) <= req.deadline):
                            p.value = self.take(ep, q[0])
                            continue
                        self._block(p, req)
                    except Exception as exc:  # noqa: BLE001 - the wait's own code (its endpoint's records) raised
                        self._fault(p, exc)
                    return
            elif (type(req) is AnyWait and req.keys is None and self.failure is None and not self.closed
                    and not self.deadlocked and not p.ep.crashed):     # (_try's choice of a kept state, inline)
                # its event first: the clock-only choice (the first group in order, in by the clock) can succeed
                # only if the event is the clock (never before it), and the block needs the event anyway
                try:
                    ep = p.ep
                    watch = req.watch
                    t = watch.event()
                    if t is not None and t <= ep.clock:
                        got = watch.choose(self, clock_only=True)
                        if got is not None:
                            p.value = got
                            continue
                    p.wait = req            # (_block, inline, with the event read above: once per choice)
                    p.no += 1
                    p.event = t
                    ep.waiters.append(p)
                    self._blocked += 1
                    if t is not None:
                        heapq.heappush(self._heap, (t, 0, ep.id, p.seq, p.no, p))
                except Exception as exc:  # noqa: BLE001 - the wait's own code (its endpoint's records) raised
                    self._fault(p, exc)
                return
            try:
                if not self._try(p, req):
                    self._block(p, req)
                    return
            except Exception as exc:  # noqa: BLE001 - the wait's own code (its endpoint's records) raised
                self._fault(p, exc)
                return

    def _done(self, p: Proc, result: object, error: BaseException | None) -> None:
        p.done, p.result, p.error = True, result, error
        if p.owner:
            self.unpark(p.ep)       # its thread runs from now on: no event fires before it parks again
        elif error is not None and not isinstance(error, (ServiceShutdown, EndpointCrashed, PeerFailure)):
            self.service_errors.append((p.ep.id, error))      # a service's main, a process of the loop
            World.fail(self, p.ep.id, error)
        elif not p.ep.threaded:
            World.finished(self, p.ep.id)

    def _withdraw(self, p: Proc) -> None:
        """Take ``p`` out of the loop: off its endpoint's waiters and the run queue."""
        if p.wait is not None:
            p.ep.waiters.remove(p)
            p.wait = None
            self._blocked -= 1
        if p.queued:
            self._runq.remove(p)
            p.queued = False

    def _fault(self, p: Proc, exc: BaseException) -> None:
        """The loop's handling of ``p``'s wait raised ``exc``: code of ``p``'s endpoint (the records of its
        drive's wait set, :mod:`.sim_roles`), whichever thread runs the loop or sends the message. It is ``p``'s
        outcome, as if ``p`` had raised it (its owner's thread raises it, a service's fails the run): withdrawn
        from the loop, closed (its ``finally`` blocks run), done."""
        if p.done:
            raise exc
        self._withdraw(p)
        p.retry = p.value = p.exc = None
        try:
            p.context.run(p.gen.close)
        except Exception as also:  # noqa: BLE001 - the first error is the one reported
            exc.add_note(f"(closing {p.ep.name}'s process then raised {type(also).__name__}: {also})")
        exc.add_note(f"(raised by the simulated world's loop on {p.ep.name}'s wait)")
        self._done(p, None, exc)

    def _check(self, p: Proc) -> BaseException | None:
        """The error a wait of ``p`` raises at once, if any (a failed peer, the end of the run, ...)."""
        ep, failure = p.ep, self.failure
        if failure is not None and failure[0] != ep.id:
            eid, exc = failure
            err = PeerFailure(f"{self.endpoints[eid].name} failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            return err
        if ep.crashed:
            return EndpointCrashed(f"{ep.name} has crashed")
        if self.closed:
            return ServiceShutdown("the run is over")
        if self.deadlocked:
            return FabricTimeout(f"{ep.name}: deadlock, every endpoint is waiting and none can make "
                                 f"progress ({self.deadlock_info})")
        return None

    def _try(self, p: Proc, req) -> bool:
        """Satisfy ``req`` of ``p`` now if it may be (setting what ``p`` is resumed with)."""
        ep = p.ep
        if self.failure is not None or ep.crashed or self.closed or self.deadlocked:
            err = self._check(p)
            if err is not None:
                p.exc = err
                return True
        if type(req) is RecvWait:
            if req.ordered:
                return False
            if req.src is None:
                msg = match(ep, None, req.tag)
            else:
                q = ep.mailbox.get((req.src, req.tag))
                msg = q[0] if q else None
            if msg is not None and (req.deadline is None or ep.delivery(msg) <= req.deadline):
                p.value = self.take(ep, msg)
                return True
            return False
        if type(req) is AnyWait:
            watch = req.watch
            if req.keys is not None:        # (measured afresh, a retry included; a kept state is current)
                watch = req.watch = OrderedWait(ep, req.keys)
            got = watch.choose(self, clock_only=True)
            if got is None:
                return False
            p.value = got
            return True
        p.exc = InvalidValueError(f"{ep.name}: a simulated process waited for {req!r}, which is not a wait")
        return True

    def take_now(self, ep: Endpoint, src: int | None, tag: int, timeout: float | None = None) -> Msg | None:
        """The message a :class:`RecvWait` of ``ep`` (not ordered; ``timeout``: modelled seconds from its clock)
        would take at once, taken; ``None`` if the wait would block or raise (a process then yields it). For a
        process's receive whose message is in: the same outcome without a step of the loop."""
        if (src is None and ep.per_port) or self.failure is not None or ep.crashed or self.closed \
                or self.deadlocked:
            return None
        if src is None:
            msg = match(ep, src, tag)
        else:
            q = ep.mailbox.get((src, tag))
            msg = q[0] if q else None
        if msg is None or (timeout is not None and ep.delivery(msg) > ep.clock + timeout):
            return None
        return self.take(ep, msg)

    def _block(self, p: Proc, req) -> None:
        ep = p.ep
        p.wait = req
        p.no += 1
        p.event = None
        ep.waiters.append(p)
        self._blocked += 1
        if type(req) is RecvWait:
            if req.deadline is not None:
                heap = self._heap
                heapq.heappush(heap, (req.deadline, 1, ep.id, p.seq, p.no, p))
                if len(heap) > self._heap_cap:
                    self._compact()
            if req.ordered:
                self._reevent(p, self._candidate(p))
        else:                       # (its event as it is now; arrivals enter lower bounds, :meth:`arrived`)
            watch = req.watch
            if req.keys is not None:
                watch.recompute()
            t = p.event = watch.event()
            if t is not None:
                heapq.heappush(self._heap, (t, 0, ep.id, p.seq, p.no, p))

    def _compact(self) -> None:
        """Drop the heap's stale entries (those :meth:`_fire` would skip), and let it grow to twice what is left
        before the next time. A receive with a deadline that its message ends (a retransmission timer, the
        common case) leaves its deadline's entry behind, later than the run's events: one per wait, never
        popped before the run ends, were they kept (a switch job at n = 1024: millions). Every entry's key is
        distinct and only stale ones go, so the events fire in the same order."""
        heap = self._heap
        heap[:] = [e for e in heap if _live(e)]
        heapq.heapify(heap)
        self._heap_cap = max(HEAP_FLOOR, 2 * len(heap))

    def _reevent(self, p: Proc, t: float | None) -> None:
        if t is not None and t != p.event:
            heapq.heappush(self._heap, (t, 0, p.ep.id, p.seq, p.no, p))
        p.event = t

    def _candidate(self, p: Proc) -> float | None:
        """An ordered receive's event: when its first matching message is delivered, if by its deadline."""
        req = p.wait
        msg = match(p.ep, req.src, req.tag)
        if msg is None:
            return None
        t = p.ep.delivery(msg)
        return None if req.deadline is not None and t > req.deadline else t

    def _unblock(self, p: Proc, retry: bool = False) -> None:
        """``p`` waits no more: it runs at the loop's next turn, with its outcome set (``retry``: its wait
        is tried again then)."""
        waiters = p.ep.waiters
        if waiters[-1] is p:
            del waiters[-1]
        else:
            waiters.remove(p)
        if retry:
            p.retry = p.wait
        p.wait = None
        p.event = None
        self._blocked -= 1
        if not p.queued:            # (_ready, inline: once per message a process waited for)
            p.queued = True
            self._runq.append(p)

    def arrived(self, ep: Endpoint, msg: Msg, retimed: bool) -> None:
        """``msg`` was put in ``ep``'s mailbox (``retimed``: queued messages may have moved,
        :meth:`~.sim_network.Endpoint.schedule`): a
        plain receive it matches can run; an ordered wait's event is updated (the endpoint's ``watch``, a
        drive's wait set, first)."""
        kept = ep.watch
        kb = None                   # (its bound after the arrival)
        if kept is not None:
            try:
                kb = kept.arrived(msg, retimed)
            except Exception as exc:  # noqa: BLE001 - ep's records raised, not the sender
                owner = self._watcher(ep, kept)
                if owner is None:
                    exc.add_note(f"(raised by the records of {ep.name}'s drive, on a message to it)")
                    raise
                self._fault(owner, exc)
        for p in ep.waiters[:]:
            req = p.wait
            if req is None:
                continue        # (failed above)
            try:
                if type(req) is RecvWait:
                    if req.ordered:
                        self._reevent(p, self._candidate(p))
                    elif req.tag == msg.tag and (req.src is None or req.src == msg.src):
                        self._unblock(p, retry=True)
                else:               # (a new entry only if its bound fell: a later one is checked when it fires)
                    watch = req.watch
                    t = kb if watch is kept else watch.arrived(msg, retimed)
                    if t is not None and (p.event is None or t < p.event):
                        heapq.heappush(self._heap, (t, 0, ep.id, p.seq, p.no, p))
                        p.event = t
            except Exception as exc:  # noqa: BLE001 - p's wait raised, not the sender
                self._fault(p, exc)

    @staticmethod
    def _watcher(ep: Endpoint, kept) -> Proc | None:
        """The process of ``ep`` whose drive keeps the records ``kept`` (``ep.watch``): the one that waits on them,
        else ``ep``'s only waiting process (a drive waiting on one receive); ``None`` if none is known."""
        for p in ep.waiters:
            if type(p.wait) is AnyWait and p.wait.watch is kept:
                return p
        return ep.waiters[0] if len(ep.waiters) == 1 else None

    def _fire(self) -> bool:
        """Fire the earliest valid event or deadline; False if there is none. The process whose wait an event ends
        runs at once (:meth:`_step`; a deadline's, through the run queue). An :class:`AnyWait`'s entry is its
        event when it blocked, or a lower bound of it entered by an arrival (:meth:`arrived`; a re-timed message
        may also have moved the event later): its wait chooses only if its event is the entry's time, else it
        is entered again at its event, so the waits fire in the order of their exact events, as if every arrival
        had read each event afresh."""
        heap = self._heap
        while heap:
            t, kind, _, _, no, p = heapq.heappop(heap)
            req = p.wait
            if req is None or no != p.no or (kind == 0 and t != p.event):
                continue                # stale: that wait is over, or its event moved
            ep = p.ep
            if kind == 1:
                self._unblock(p)
                ep.clock = max(ep.clock, t)
                who = "any endpoint" if req.src is None else self.endpoints[req.src].name
                p.exc = FabricTimeout(f"{ep.name}: no message from {who} (tag {req.tag}) within "
                                      f"{req.timeout:.6g} modelled seconds")
                return True
            try:
                if type(req) is RecvWait:
                    got = self.take(ep, match(ep, req.src, req.tag))
                else:
                    watch = req.watch
                    got = watch.choose(self, at=t)
                    if got is None:    # the entry was a lower bound: its event is later (or none is in)
                        e = watch.event()
                        if e is not None and e <= t:
                            raise AssertionError(f"{ep.name}: a wait's event {e!r} is not after its bound {t!r}")
                        p.event = e
                        if e is not None:
                            heapq.heappush(heap, (e, 0, ep.id, p.seq, no, p))
                        continue
                waiters = ep.waiters        # (_unblock, inline: once per event)
                if waiters[-1] is p:
                    del waiters[-1]
                else:
                    waiters.remove(p)
                p.wait = p.event = None
                self._blocked -= 1
                p.value = got
            except Exception as exc:  # noqa: BLE001 - p's wait (its endpoint's records) raised
                self._fault(p, exc)
                return True
            # ready, it runs now: the run queue is empty when an event fires (:meth:`_run`), so it would be
            # the first out of it (no pass through it)
            self._step(p)
            return True
        return False

    def _deadlock(self) -> None:
        """At quiescence with nothing to fire: if a worker waits, every waiting process raises."""
        waits = [p for ep in self.endpoints for p in ep.waiters]
        if not any(p.ep.id < self.world_size for p in waits):
            return          # only services wait (for the next call, or the end of the run)
        self.deadlocked = True
        self.deadlock_info = self.describe_waits()
        for p in waits:
            self._unblock(p, retry=True)

    # ----------------------------------------------------------------- messages
    def take(self, ep: Endpoint, msg: Msg) -> Msg:
        """Deliver ``msg``, the head of its queue in ``ep``'s mailbox, to ``ep``'s application: off the mailbox,
        its NIC slot fixed, the clock moved, counted (the world's receive; a process's own take of a message in
        already, :meth:`take_now`, or a receive's that found it so; a posted receive's that finds it so,
        ``_RecvWork.take_now`` of :mod:`.sim`, does the same inline)."""
        box, ch = ep.mailbox, (msg.src, msg.tag)
        q = box[ch]
        del q[0]
        if not q:                   # (an empty channel's queue is not kept: :attr:`~.sim_network.Endpoint.mailbox`)
            del box[ch]
        ep.taken(msg)
        if ep.watch is not None:
            ep.watch.taken(msg)
        if _trace.recorder is not None:
            _trace.recorder.sim_received(self, msg.src, ep.id, msg.tag, msg.nbytes, ep.clock, msg.delivered)
        if msg.delivered > ep.clock:
            ep.clock = msg.delivered
        stats, nbytes = ep.stats, msg.nbytes    # (CommStats.record_recv, inline: once per message)
        stats.bytes_received += nbytes
        stats.messages_received += 1
        stats.links[(msg.src, ep.id)] += nbytes
        return msg

    def take_group(self, ep: Endpoint, keys: list[tuple[int | None, int]]) -> list[Msg]:
        """Take the head message of each receive of ``keys`` (all in), in arrival order; in ``keys``' order."""
        msgs = [match(ep, s, t) for s, t in keys]
        if not msgs[1:]:            # (one receive: nothing to order)
            for m in msgs:
                self.take(ep, m)
            return msgs
        for j in sorted(range(len(msgs)), key=lambda j: msgs[j].head):
            self.take(ep, msgs[j])
        return msgs

    def describe_waits(self) -> str:
        parts = []
        for ep in self.endpoints:
            for p in ep.waiters:
                req = p.wait
                if type(req) is RecvWait:
                    src, tag = req.src, req.tag
                else:
                    src, tag = req.watch.first_key() if req.keys is None else req.keys[0][0]
                parts.append(f"{ep.name} waits for {'any' if src is None else self.endpoints[src].name}"
                             f" (tag {tag})")
        dead = [ep.name for ep in self.endpoints if ep.crashed]
        s = "; ".join(parts)
        if dead:
            s += f"; crashed: {', '.join(dead)}"
        return s


def match(ep: Endpoint, src: int | None, tag: int) -> Msg | None:
    """The message a receive from ``src`` (``None``: any, the earliest head, then the lowest source) on
    ``tag`` would take from ``ep``'s mailbox, or ``None``."""
    if src is not None:
        q = ep.mailbox.get((src, tag))
        return q[0] if q else None
    return any_head(ep, tag)
