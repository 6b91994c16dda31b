"""The SimFabric's scheduler: which blocked endpoint runs next, in modelled time.

Timeouts are in *modelled* seconds and are decided by quiescence: a receive with a deadline whose
message has not arrived in modelled time keeps waiting until every live endpoint is blocked; then the
blocked endpoint with the earliest deadline times out (discrete-event semantics without real sleeps).
If every live endpoint is blocked and none has a deadline while a worker is waiting, the run is
deadlocked (for instance a peer crashed) and every waiting worker raises :class:`FabricTimeout`.

Receives from any source take, among the messages already posted, the one whose head arrives first
in modelled time. A message that a slower thread has not posted yet cannot be considered, so for
any-source protocols the modelled times can vary between runs; the data, and everything for
point-to-point protocols (ring, allgather), is deterministic. A ``per_port`` endpoint (a switch)
handles its any-source receives in modelled-time order instead: it takes a message only once every
other live endpoint is blocked and no earlier deadline or event is pending (conservative
discrete-event order), so each packet is processed at its own arrival time. Without this, a result
would leave at the switch's running-maximum clock, which a thread that is ahead in wall time has
pulled forward, and the error would feed back through self-clocked protocols.
:meth:`SimFabric.wait_any` (wait for whichever of several receives, or groups of receives, is in
first) uses the same conservative order, so an endpoint of any kind can serve its peers in the
order their messages arrive in modelled time, deterministically; its NIC then takes those messages
in arrival order (a fixed sequence of blocking receives would serialise them in the order asked).

Faults (:class:`Network`): ``loss`` drops datagrams sent with ``reliable=False`` with that probability,
decided by a generator per directed link seeded from ``(seed, src, dst)`` (deterministic for a seed);
``stragglers`` slows an endpoint's compute and its NIC; ``crash`` makes an endpoint die silently after a number of
sends, so that its peers can only notice by timing out.
"""

from __future__ import annotations

import threading

from ...errors import InvalidValueError
from .sim_network import Endpoint, Network


class World:
    """Shared state of one simulated run: the endpoints, their mailboxes and the network model, and the
    scheduler's bookkeeping (how many endpoints are live and blocked; the first failure)."""

    def __init__(self, world_size: int, network: Network | None = None) -> None:
        if world_size < 1:
            raise InvalidValueError(f"world_size must be >= 1, got {world_size}")
        self.network = network or Network()
        self.world_size = world_size
        self.lock = threading.Lock()
        self.endpoints: list[Endpoint] = [
            Endpoint(self.network, self.lock, r, self.network.bytes_per_s, self.network.latency_us * 1e-6,
                     False, f"worker{r}")
            for r in range(world_size)
        ]
        self.live = world_size
        self.nblocked = 0
        self.failure: tuple[int, BaseException] | None = None
        self.closed = False
        self.deadlocked = False
        self.deadlock_info = ""
        self.service_ids: dict[str, int] = {}
        self.service_threads: list[threading.Thread] = []
        self.service_errors: list[tuple[int, BaseException]] = []
        #: state the layers above share between this world's endpoints (``Fabric.world_scratch``)
        self.scratch: dict = {}

    # ----------------------------------------------------------------- control
    def add_endpoint(self, bw: float, latency: float, per_port: bool, name: str) -> Endpoint:
        """(lock held) A new live endpoint (a service's) with the next id."""
        ep = Endpoint(self.network, self.lock, len(self.endpoints), bw, latency, per_port, name)
        self.endpoints.append(ep)
        self.live += 1
        return ep

    def block(self, ep: Endpoint, deadline: float | None, waiting_for: tuple[int | None, int],
              candidate=None) -> None:
        """(lock held) ``ep`` starts waiting (until a modelled ``deadline``, if any, for a message from
        ``waiting_for = (source, tag)``): it counts as blocked until :meth:`wake`, and if every live
        endpoint now is, the scheduler fires the earliest deadline or event (or declares a deadlock).
        ``candidate``: an ordered wait's event (``ep.event``, the delivery time of what it would take,
        or ``None``), re-evaluated by :meth:`arrived`."""
        ep.blocked, ep.deadline, ep.waiting_for, ep.candidate = True, deadline, waiting_for, candidate
        self.nblocked += 1
        self._check_quiescent()

    def arrived(self, ep: Endpoint, msg, retimed: list) -> None:
        """(lock held) ``msg`` was put in ``ep``'s mailbox (``retimed``: the messages queued there that its
        arrival re-timed, :meth:`~.sim_network.Endpoint.schedule`). An open ``wait_any``'s state
        (``ep.watch``) is updated. A blocked plain receive wakes if it matches its ``(source, tag)``.
        A blocked ordered wait stays blocked (it may take a message only at quiescence, when the
        earliest event fires, and its sender is running): its event is updated."""
        if ep.watch is not None:
            ep.watch.arrived(msg, retimed)
        if not ep.blocked:
            return          # running: it looks at its mailbox before it blocks again
        if ep.candidate is not None:
            ep.event = ep.candidate()
            return
        src, tag = ep.waiting_for
        if tag == msg.tag and (src is None or src == msg.src):
            self.wake(ep)

    def wake(self, ep: Endpoint) -> None:
        """Unblock ``ep`` (lock held): it no longer counts as blocked until it waits again."""
        if ep.blocked:
            ep.blocked = False
            self.nblocked -= 1
        ep.cond.notify_all()

    def fail(self, eid: int, exc: BaseException) -> None:
        """Record that endpoint ``eid`` failed and wake every waiter (they raise PeerFailure)."""
        with self.lock:
            if self.failure is None:
                self.failure = (eid, exc)
            self._retire(eid)
            for ep in self.endpoints:
                self.wake(ep)

    def finished(self, eid: int) -> None:
        """Endpoint ``eid``'s thread has returned (or crashed)."""
        with self.lock:
            self._retire(eid)

    def _retire(self, eid: int) -> None:
        ep = self.endpoints[eid]
        if ep.alive:
            ep.alive = False
            self.live -= 1
            self._check_quiescent()

    def close(self) -> None:
        """End the run: services leave their loops; waits raise ServiceShutdown."""
        with self.lock:
            self.closed = True
            for ep in self.endpoints:
                self.wake(ep)
        for t in self.service_threads:
            t.join(timeout=self.network.timeout_s)

    def _check_quiescent(self) -> None:
        """Called with the lock held whenever an endpoint blocks or retires."""
        if self.live <= 0 or self.nblocked < self.live:
            return
        best, worker_waits = None, False    # the earliest (time, event 0 / deadline 1, id) of a waiter
        for ep in self.endpoints:
            if not (ep.alive and ep.blocked):
                continue
            worker_waits = worker_waits or ep.id < self.world_size
            if ep.event is not None and not ep.fire_event and (best is None or (ep.event, 0, ep.id) < best[:3]):
                best = (ep.event, 0, ep.id, ep)
            if (ep.deadline is not None and not ep.fire_timeout
                    and (best is None or (ep.deadline, 1, ep.id) < best[:3])):
                best = (ep.deadline, 1, ep.id, ep)
        if best is not None:
            _, kind, _, ep = best
            if kind == 0:
                ep.fire_event = True
            else:
                ep.fire_timeout = True
            self.wake(ep)
        elif worker_waits:
            self.deadlocked = True
            self.deadlock_info = self.describe_waits()
            for ep in self.endpoints:
                if ep.alive and ep.blocked:
                    self.wake(ep)

    def may_take(self, me: Endpoint, t: float) -> bool:
        """(lock held) May ordered endpoint ``me`` take a message delivered at ``t`` now? Only if every
        other live endpoint is blocked with no deadline or event before ``t``."""
        if self.nblocked < self.live - 1:
            return False
        for ep in self.endpoints:
            if ep is me or not ep.alive or not ep.blocked:
                continue
            if ep.deadline is not None and not ep.fire_timeout and ep.deadline < t:
                return False
            if ep.event is not None and not ep.fire_event and ep.event < t:
                return False
        return True

    def describe_waits(self) -> str:
        parts = []
        for ep in self.endpoints:
            if ep.alive and ep.blocked and ep.waiting_for is not None:
                src, tag = ep.waiting_for
                parts.append(f"{ep.name} waits for {'any' if src is None else self.endpoints[src].name}"
                             f" (tag {tag})")
        dead = [ep.name for ep in self.endpoints if ep.crashed]
        s = "; ".join(parts)
        if dead:
            s += f"; crashed: {', '.join(dead)}"
        return s
