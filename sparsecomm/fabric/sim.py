"""SimFabric: n endpoints as threads in one process, over a modelled network.

The network model (alpha-beta with NIC serialisation), per endpoint:

- a full-duplex NIC of ``bandwidth`` payload bytes/s (the link rate times ``payload_fraction``: 1 for an
  ideal link, :data:`TCP_OVER_ETHERNET` for TCP over a 1500-byte MTU as on the netbed) and a latency;
- the one-way latency of a path is the mean of its two ends' latencies (each end's link contributes
  half), so every path is symmetric, and a path between two workers has the workers' ``latency_us``;
- a send issued at the sender's clock ``t`` starts at ``start = max(t, tx_free)`` and occupies the
  sender's NIC until ``tx_end = start + bytes/bw_src``;
- the message's head reaches the receiver at ``head = start + latency``. The receiver's NIC takes the
  messages in *arrival* order (their heads; ties by source), whatever order the application asks for
  them in: ``rx_end = max(head, rx_end of the message before it) + bytes/bw_dst``; a message is
  delivered at ``max(rx_end, tx_end + latency)``, so on an idle path it takes ``latency + bytes/bw``.
  A message's slot is fixed once the application has taken it; a message that a thread behind in wall
  time posts later with an earlier head queues after the ones already taken (the only dependence on
  thread timing; deterministic whenever messages are posted before the receiver takes later ones);
- ``recv`` advances the receiver's clock to the delivery time; ``compute(s)`` advances it by ``s``;
- a straggler (``Network.stragglers``: endpoint -> factor f >= 1) is a slow host: its compute takes f
  times as long and its NIC moves bytes at 1/f of the rate, in and out (a host-bound TCP stack), so
  that it slows what transports do, not only ``compute()``.

Service endpoints (dedicated aggregators, a switch) have their own link; ``per_port=True`` gives a
switch one NIC per peer (ports work in parallel, as a switch's do).

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
pulled forward, and the error feeds back through self-clocked protocols (measured: 1x-11x).
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
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import FabricTimeout, MismatchError, PeerFailure, SparseCommError
from .base import Fabric, Work
from .stats import CommStats

@dataclass
class Network:
    """The modelled network of a SimFabric run.

    ``bandwidth_gbps`` and ``latency_us`` are per worker NIC. ``loss`` is the drop probability of
    unreliable datagrams on every link, both directions. ``stragglers`` maps an endpoint to a factor
    (>= 1) multiplying its modelled compute time and dividing its NIC's rate. ``payload_fraction``:
    the share of the link rate that carries message bytes (:data:`TCP_OVER_ETHERNET` for a TCP link).
    ``crash`` maps an endpoint to the number of sends after which it dies silently. ``timeout_s`` bounds every wall-clock wait (a safety net; the
    modelled deadlock detection normally fires first).
    """

    bandwidth_gbps: float = 100.0
    latency_us: float = 2.0
    loss: float = 0.0
    seed: int = 0
    stragglers: dict[int, float] = field(default_factory=dict)
    crash: dict[int, int] = field(default_factory=dict)
    timeout_s: float = 120.0
    payload_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be positive, got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be non-negative, got {self.latency_us}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if not 0.0 < self.payload_fraction <= 1.0:
            raise ValueError(f"payload_fraction must be in (0, 1], got {self.payload_fraction}")
        for eid, f in self.stragglers.items():
            if not f >= 1.0:
                raise ValueError(f"a straggler's factor must be >= 1, got {f} for endpoint {eid}")

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second of a worker NIC (the link rate times ``payload_fraction``)."""
        return self.bandwidth_gbps * 1e9 / 8 * self.payload_fraction


#: payload fraction of TCP over Ethernet at a 1500-byte MTU with TCP timestamps: 1448 payload bytes per
#: 1514-byte frame as a shaper (tc htb) counts it; pass ``Network(payload_fraction=TCP_OVER_ETHERNET)`` to
#: model a real TCP link (the netbed's; gloo's transport) rather than an ideal one.
TCP_OVER_ETHERNET = 1448 / 1514


class EndpointCrashed(SparseCommError):
    """Raised inside an endpoint that the network model crashed (the launcher swallows it)."""


class ServiceShutdown(SparseCommError):
    """Raised inside a service endpoint when the run is over (its loop ends quietly)."""


@dataclass(eq=False)
class _Msg:
    src: int
    tag: int
    data: torch.Tensor
    nbytes: int
    start: float
    head: float      # start + path latency
    tx_end: float    # start + bytes / bw_src
    rx_end: float = 0.0      # when the receiving NIC has taken its last byte (its place in arrival order)
    taken: bool = False      # delivered to the application: its NIC slot is fixed from then on

    @property
    def delivered(self) -> float:
        return max(self.rx_end, self.tx_end + (self.head - self.start))


class _Endpoint:
    def __init__(self, world: "SimWorld", eid: int, bw: float, latency: float, per_port: bool,
                 name: str) -> None:
        self.id = eid
        self.name = name
        self.slow = float(world.network.stragglers.get(eid, 1.0))
        self.bw = bw / self.slow      # a straggler's host stack moves bytes 1/factor as fast, both ways
        self.latency = latency
        self.per_port = per_port
        self.clock = 0.0
        self._tx_free: dict[int, float] = {}
        self._rx_base: dict[int, float] = {}            # port -> end of the taken prefix of its schedule
        self._rx_sched: dict[int, list[_Msg]] = {}      # port -> messages in the order its NIC takes them
        self.mailbox: dict[tuple[int, int], deque[_Msg]] = {}
        self.cond = threading.Condition(world.lock)
        self.deadline: float | None = None   # modelled deadline of the current blocked receive
        self.fire_timeout = False
        self.event: float | None = None      # per_port any-source receive: delivery time of its candidate
        self.fire_event = False
        self.blocked = False
        self.alive = True
        self.crashed = False
        self.sends = 0
        self.loss_rng: dict[int, np.random.Generator] = {}
        self.stats = CommStats()
        self.waiting_for: tuple[int | None, int] | None = None

    def port(self, peer: int) -> int:
        return peer if self.per_port else -1

    def tx_free(self, peer: int) -> float:
        return self._tx_free.get(self.port(peer), 0.0)

    def schedule(self, msg: _Msg) -> None:
        """(lock held) Give arriving ``msg`` its place on the receiving NIC: arrival (head) order among the
        messages not yet taken by the application, after every message already taken (whose time has
        been observed and cannot change); the later ones are re-timed."""
        port = self.port(msg.src)
        sched = self._rx_sched.setdefault(port, [])
        i = len(sched)
        while i > 0 and not sched[i - 1].taken and (sched[i - 1].head, sched[i - 1].src) > (msg.head, msg.src):
            i -= 1
        sched.insert(i, msg)
        t = sched[i - 1].rx_end if i > 0 else self._rx_base.get(port, 0.0)
        for m in sched[i:]:
            if m.taken:
                t = max(t, m.rx_end)
            else:
                m.rx_end = max(m.head, t) + m.nbytes / self.bw
                t = m.rx_end

    def taken(self, msg: _Msg) -> None:
        """(lock held) ``msg`` was delivered: fix its slot, drop the schedule's taken prefix."""
        msg.taken = True
        port = self.port(msg.src)
        sched = self._rx_sched[port]
        k = 0
        while k < len(sched) and sched[k].taken:
            k += 1
        if k:
            self._rx_base[port] = max(self._rx_base.get(port, 0.0), sched[k - 1].rx_end)
            del sched[:k]


class SimWorld:
    """Shared state of one simulated run: the endpoints, their mailboxes and the network model."""

    def __init__(self, world_size: int, network: Network | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.network = network or Network()
        self.world_size = world_size
        self.lock = threading.Lock()
        self.endpoints: list[_Endpoint] = [
            _Endpoint(self, r, self.network.bytes_per_s, self.network.latency_us * 1e-6, False,
                      f"worker{r}")
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

    # ----------------------------------------------------------------- control
    def fabric(self, rank: int) -> "SimFabric":
        return SimFabric(self, rank)

    def wake(self, ep: _Endpoint) -> None:
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
        waiting = [ep for ep in self.endpoints if ep.alive and ep.blocked]
        timed = [(ep.deadline, 1, ep.id, ep) for ep in waiting
                 if ep.deadline is not None and not ep.fire_timeout]
        timed += [(ep.event, 0, ep.id, ep) for ep in waiting if ep.event is not None and not ep.fire_event]
        if timed:
            _, kind, _, ep = min(timed, key=lambda c: c[:3])
            if kind == 0:
                ep.fire_event = True
            else:
                ep.fire_timeout = True
            self.wake(ep)
        elif any(ep.id < self.world_size for ep in waiting):
            self.deadlocked = True
            self.deadlock_info = self.describe_waits()
            for ep in waiting:
                self.wake(ep)

    def may_take(self, me: _Endpoint, t: float) -> bool:
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


class _DoneWork(Work):
    def __init__(self, result: int | None = None, on_wait: Callable[[], None] | None = None) -> None:
        self._result = result
        self._on_wait = on_wait

    def wait(self, timeout: float | None = None) -> int | None:
        if self._on_wait is not None:
            self._on_wait()
            self._on_wait = None
        return self._result

    def is_completed(self) -> bool:
        return True


class _RecvWork(Work):
    def __init__(self, fabric: "SimFabric", tensor: torch.Tensor, src: int | None, tag: int) -> None:
        self._args = (tensor, src, tag)
        self._fabric = fabric
        self._result: int | None = None
        self._done = False

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._done:
            self._result = self._fabric.recv(*self._args, timeout=timeout)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done


class SimFabric(Fabric):
    """One endpoint of a :class:`SimWorld`; the same interface as ``TorchFabric``."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout_s = world.network.timeout_s
        self._ep = world.endpoints[rank]

    @property
    def stats(self) -> CommStats:
        return self._ep.stats

    @property
    def network(self) -> Network:
        return self.world.network

    def now(self) -> float:
        return self._ep.clock

    def compute(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("compute time must be non-negative")
        factor = self.world.network.stragglers.get(self.rank, 1.0)
        self._ep.clock += seconds * factor

    # --------------------------------------------------------------- sending
    def _post(self, tensor: torch.Tensor, dst: int, tag: int, reliable: bool) -> float:
        world, ep = self.world, self._ep
        if not 0 <= dst < len(world.endpoints):
            raise ValueError(f"{ep.name}: no endpoint {dst} (world has {len(world.endpoints)})")
        if dst == self.rank:
            raise ValueError(f"{ep.name}: cannot send to itself")
        data = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = data.numel() * data.element_size()
        with world.lock:
            self._raise_if_failed()
            if ep.crashed:
                raise EndpointCrashed(f"{ep.name} has crashed")
            dst_ep = world.endpoints[dst]
            start = max(ep.clock, ep.tx_free(dst))
            tx_end = start + nbytes / ep.bw
            latency = (ep.latency + dst_ep.latency) / 2   # each end's link contributes half: symmetric
            ep._tx_free[ep.port(dst)] = tx_end
            ep.stats.record_send(self.rank, dst, nbytes)
            dropped = False
            if not reliable and world.network.loss > 0.0:
                rng = ep.loss_rng.get(dst)
                if rng is None:
                    rng = ep.loss_rng[dst] = np.random.default_rng([world.network.seed, self.rank, dst])
                dropped = bool(rng.random() < world.network.loss)
            if not dropped and not dst_ep.crashed:
                msg = _Msg(self.rank, tag, data, nbytes, start, start + latency, tx_end)
                dst_ep.mailbox.setdefault((self.rank, tag), deque()).append(msg)
                dst_ep.schedule(msg)
                world.wake(dst_ep)
            ep.sends += 1
            limit = world.network.crash.get(self.rank)
            if limit is not None and ep.sends >= limit:
                ep.crashed = True
                raise EndpointCrashed(f"{ep.name} crashed after {ep.sends} sends (fault injection)")
        return tx_end

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        tx_end = self._post(tensor, dst, tag, reliable)
        self._ep.clock = max(self._ep.clock, tx_end)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> Work:
        tx_end = self._post(tensor, dst, tag, reliable)
        ep = self._ep

        def done() -> None:
            ep.clock = max(ep.clock, tx_end)

        return _DoneWork(None, done)

    # ------------------------------------------------------------- receiving
    def _match(self, src: int | None, tag: int) -> _Msg | None:
        box = self._ep.mailbox
        if src is not None:
            q = box.get((src, tag))
            return q[0] if q else None
        best = None
        for (s, t), q in box.items():
            if t == tag and q and (best is None or (q[0].head, s) < (best.head, best.src)):
                best = q[0]
        return best

    @staticmethod
    def _delivery(msg: _Msg) -> tuple[float, float]:
        return msg.delivered, msg.rx_end

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        world, ep = self.world, self._ep
        wall_deadline = time.monotonic() + self.timeout_s
        with world.lock:
            deadline = None if timeout is None else ep.clock + timeout
            while True:
                self._raise_if_failed()
                if ep.crashed:
                    raise EndpointCrashed(f"{ep.name} has crashed")
                msg = self._match(src, tag)
                ep.event = None
                if msg is not None:
                    delivered, rx_end = self._delivery(msg)
                    if deadline is None or delivered <= deadline:
                        if (src is not None or not ep.per_port or ep.fire_event
                                or world.may_take(ep, delivered)):
                            ep.fire_timeout = ep.fire_event = False
                            break
                        ep.event = delivered    # ordered: wait until it is the earliest event
                if ep.fire_timeout:
                    ep.fire_timeout = False
                    ep.clock = max(ep.clock, deadline)
                    raise FabricTimeout(
                        f"{ep.name}: no message from "
                        f"{'any endpoint' if src is None else world.endpoints[src].name} (tag {tag}) "
                        f"within {timeout:.6g} modelled seconds")
                self._raise_if_stuck()
                remaining = wall_deadline - time.monotonic()
                if remaining <= 0:
                    raise FabricTimeout(
                        f"{ep.name}: waited {self.timeout_s:g} s (wall) for "
                        f"{'any endpoint' if src is None else world.endpoints[src].name} (tag {tag})")
                self._park(deadline, (src, tag), remaining)
            ep.mailbox[(msg.src, msg.tag)].popleft()
            ep.taken(msg)
            ep.clock = max(ep.clock, delivered)
            ep.stats.record_recv(msg.src, self.rank, msg.nbytes)
        if msg.data.numel() != tensor.numel() or msg.data.dtype != tensor.dtype:
            raise MismatchError(
                f"{ep.name} expected {tensor.numel()} x {tensor.dtype} from "
                f"{world.endpoints[msg.src].name} (tag {tag}) but received "
                f"{msg.data.numel()} x {msg.data.dtype}: workers disagree on the message's length "
                f"or dtype")
        with torch.no_grad():
            tensor.copy_(msg.data.reshape(tensor.shape))
        return msg.src

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        return _RecvWork(self, tensor, src, tag)

    def _first_of(self, groups, clock_only: bool = False) -> tuple[float, int] | None:
        """(lock held) ``(t, i)`` for ``groups`` (lists of receives; a group is in once all of its
        messages are): this NIC serialises the arrived messages in arrival (head) order from its
        current state; ``t`` is when the first group is in (or this endpoint's clock, if later), ``i``
        the lowest index in by ``t``. ``clock_only``: only group 0, and only if it is in by the clock."""
        ep = self._ep
        got, complete = [], []
        for i, g in enumerate(groups[:1] if clock_only else groups):
            for w in g:
                msg = self._match(w._args[1], w._args[2])
                if msg is None:
                    break
                got.append((msg.head, i, msg))
            else:
                complete.append(i)
        if not complete:
            return None
        when: dict[int, float] = {}
        for head, i, msg in got:
            when[i] = max(when.get(i, 0.0), msg.delivered)   # its NIC slot: arrival order (_Endpoint.schedule)
        inn = {i: when[i] for i in complete}
        t = max(ep.clock, min(inn.values()))
        if clock_only and t > ep.clock:
            return None
        return t, min(i for i, d in inn.items() if d <= t)

    def wait_any(self, works) -> int:
        """The first element of ``works`` (in list order) that is in by the time the first of them is,
        in modelled time; an element is a receive or a list of receives (in once all of them are).
        Its receives are completed (in arrival order); an already completed element (e.g. a send) is
        returned at once. A caller lists the elements in order of preference: that order holds while
        the messages are there, and whichever arrives first is served when none is.

        Ordered, like a ``per_port`` endpoint's any-source receive: unless the first element is in by
        this endpoint's clock already, the choice is made only once every other live endpoint is
        blocked and no earlier deadline or event is pending, so a message that a thread behind in wall
        time has yet to send cannot be overtaken, and the choice is deterministic. This NIC serialises
        the messages in their arrival order, not in the order a fixed loop would have asked for them.
        """
        if not works:
            raise ValueError("wait_any needs at least one operation")
        world, ep = self.world, self._ep
        groups, keys = [], set()
        for i, el in enumerate(works):
            g = list(el) if isinstance(el, (list, tuple)) else [el]
            if all(w.is_completed() for w in g):
                for w in g:
                    w.wait()
                return i
            g = [w for w in g if not w.is_completed()]
            for w in g:
                if not isinstance(w, _RecvWork) or w._fabric is not self:
                    raise TypeError(f"{ep.name}: wait_any takes this endpoint's pending receives and "
                                    f"sends, got {type(w).__name__}")
                key = w._args[1:]
                if key in keys:
                    raise ValueError(f"{ep.name}: wait_any was given two receives on (source, tag) {key};"
                                     f" only the next one posted on a channel may be waited for")
                keys.add(key)
            groups.append(g)
        wall_deadline = time.monotonic() + self.timeout_s
        with world.lock:
            best = self._first_of(groups, clock_only=True)
            while best is None:
                self._raise_if_failed()
                if ep.crashed:
                    raise EndpointCrashed(f"{ep.name} has crashed")
                first = self._first_of(groups)
                ep.event = None
                if first is not None:
                    if ep.fire_event or world.may_take(ep, first[0]):
                        ep.fire_event = False
                        best = first
                        break
                    ep.event = first[0]
                self._raise_if_stuck()
                remaining = wall_deadline - time.monotonic()
                if remaining <= 0:
                    raise FabricTimeout(f"{ep.name}: waited {self.timeout_s:g} s (wall) for any of "
                                        f"{len(works)} receives")
                self._park(None, (None, groups[0][0]._args[2]), remaining)
            g = groups[best[1]]
            heads = sorted(range(len(g)), key=lambda j: self._match(g[j]._args[1], g[j]._args[2]).head)
        for j in heads:      # each the head of its (source, tag) queue: taken at once, in arrival order
            g[j].wait()
        return best[1]

    def _raise_if_stuck(self) -> None:
        """(lock held) Raise if the run is over or every endpoint waits with nothing in flight."""
        world = self.world
        if world.closed:
            raise ServiceShutdown("the run is over")
        if world.deadlocked:
            raise FabricTimeout(f"{self._ep.name}: deadlock, every endpoint is waiting and none can make "
                                f"progress ({world.deadlock_info})")

    def _park(self, deadline: float | None, waiting_for: tuple, remaining: float) -> None:
        """(lock held) Block this endpoint until a message, a modelled timeout or an ordered event wakes
        it (or a second of wall time passes: the caller loops)."""
        ep, world = self._ep, self.world
        ep.blocked, ep.deadline, ep.waiting_for = True, deadline, waiting_for
        world.nblocked += 1
        world._check_quiescent()
        try:
            if ep.blocked:
                ep.cond.wait(timeout=min(remaining, 1.0))
        finally:
            world.wake(ep)
            ep.deadline, ep.waiting_for, ep.event = None, None, None

    def _raise_if_failed(self) -> None:
        failure = self.world.failure
        if failure is not None and failure[0] != self.rank:
            eid, exc = failure
            raise PeerFailure(f"{self.world.endpoints[eid].name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    # --------------------------------------------------------------- services
    def service(self, name: str, main: Callable[[Fabric], None], *, bandwidth_gbps: float | None = None,
                latency_us: float | None = None, per_port: bool = False) -> int:
        world = self.world
        with world.lock:
            if name in world.service_ids:
                return world.service_ids[name]
            net = world.network
            eid = len(world.endpoints)
            bw = (bandwidth_gbps if bandwidth_gbps is not None else net.bandwidth_gbps) * 1e9 / 8 * net.payload_fraction
            lat = (latency_us if latency_us is not None else net.latency_us) * 1e-6
            world.endpoints.append(_Endpoint(world, eid, bw, lat, per_port, name))
            world.live += 1
            world.service_ids[name] = eid
            fabric = SimFabric(world, eid)
            t = threading.Thread(target=_run_service, args=(world, eid, main, fabric),
                                 name=f"sparsecomm-{name}", daemon=True)
            world.service_threads.append(t)
        t.start()
        return eid

    def services(self) -> dict[str, int]:
        return dict(self.world.service_ids)

    def endpoint_stats(self, eid: int) -> CommStats:
        """The ledger of any endpoint (e.g. a switch or an aggregator) of this simulated world."""
        return self.world.endpoints[eid].stats


def _run_service(world: SimWorld, eid: int, main: Callable[[Fabric], None], fabric: SimFabric) -> None:
    try:
        main(fabric)
    except (ServiceShutdown, EndpointCrashed):
        pass
    except PeerFailure:
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to every worker
        world.service_errors.append((eid, exc))
        world.fail(eid, exc)
        return
    world.finished(eid)
