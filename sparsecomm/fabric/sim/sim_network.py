"""The SimFabric's network model: links, NICs and messages in modelled time.

The network model (alpha-beta with NIC serialisation), per endpoint:

- a full-duplex NIC of ``bandwidth`` payload bytes/s (the link rate times ``payload_fraction``: 1 for an
  ideal link, :data:`TCP_OVER_ETHERNET` for TCP over a 1500-byte MTU as on the netbed) and a latency;
- the one-way latency of a path is the mean of its two ends' latencies (each end's link contributes
  half), so every path is symmetric, and a path between two workers has the workers' ``latency_us``.
  It is the alpha of the alpha-beta model: a message's fixed cost *as a transport sees it*, the wire's
  and the hosts' (a rendezvous, the threads' wake-ups) alike. To model a real network, measure it at that
  level: :func:`sparsecomm.fabric.probe.fabric_latency_s` times ring shifts of a small message over any
  fabric (on this model it returns ``latency_us`` plus the serialisation; on real hosts, more than the
  kernel's path: BENCHMARKS.md, "SimFabric vs netbed"). A ring all-reduce pays it in every handshake
  round and once per pipeline (``experiments/bench/netbed_vs_sim.py`` models with it);
- a send issued at the sender's clock ``t`` starts at ``start = max(t, tx_free)`` and occupies the
  sender's NIC until ``tx_end = start + bytes/bw_src``; with ``Network.burst_us`` (a shaper's bucket, as
  ``tc htb``'s ``burst``: a link idle for that long may send that much of its time's bytes at once) the NIC keeps
  a virtual finish ``v``, the bucket being ``min(burst, t - v)`` of link time: ``v' = max(v, t - burst) +
  bytes/bw_src`` and ``tx_end = max(start, v')``, an exact token bucket of the link's rate (0, the default: none);
- the message's head reaches the receiver at ``head = start + latency``. The receiver's NIC takes the
  messages in *arrival* order (their heads; ties by source), whatever order the application asks for
  them in: ``rx_end = max(head - burst, rx_end of the message before it) + bytes/bw_dst`` (its bucket likewise); a
  message is
  delivered at ``max(rx_end, tx_end + latency)``, so on an idle path it takes ``latency + bytes/bw``.
  A message's slot is fixed once the application has taken it; a message that a thread behind in wall
  time posts later with an earlier head queues after the ones already taken (the only dependence on
  thread timing; deterministic whenever messages are posted before the receiver takes later ones);
- ``recv`` advances the receiver's clock to the delivery time; ``compute(s)`` advances it by ``s``;
- a straggler (``Network.stragglers``: endpoint -> factor f >= 1) is a slow host: its compute takes f
  times as long and its NIC moves bytes at 1/f of the rate, in and out (a host-bound TCP stack), so
  that it slows what transports do, not only ``compute()``;
- the hosts' CPU time (``Network.host``, a :class:`~.sim_host.HostModel`; ``None``, the default: none): per
  message sent, on the sender's clock before its NIC starts; per message taken, on the receiver's clock
  after its delivery (with a table by message size, after a wait that holds no CPU; with ``Network.host_streams``,
  only their fixed parts there, the parts that grow with the message's bytes streamed beside the wire: the
  sender's NIC sends no faster than its host streams, and the receiver takes the message no earlier than its first
  byte's arrival plus its own streamed part); and the work transports declare (``Fabric.host_work``: sums, block scans, switch
  packets and messages, each call's own cost), each stretched by the endpoint's CPU share and straggler factor (:mod:`.sim_host`).

Service endpoints (dedicated aggregators, a switch) have their own link; ``per_port=True`` gives a
switch one NIC per peer (ports work in parallel, as a switch's do).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from heapq import heapify, heappush
from itertools import count
from operator import attrgetter
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import InvalidTypeError
from ...validate import check_int, check_real, check_seed
from ..stats import CommStats
from .sim_host import HostModel


@dataclass
class Network:
    """The modelled network of a SimFabric run.

    ``bandwidth_gbps`` and ``latency_us`` are per worker NIC. ``loss`` is the drop probability of
    unreliable datagrams on every link, both directions. ``stragglers`` maps an endpoint to a factor
    (>= 1) multiplying its modelled compute time and dividing its NIC's rate. ``payload_fraction``:
    the share of the link rate that carries message bytes (:data:`TCP_OVER_ETHERNET` for a TCP link).
    ``crash`` maps an endpoint to the number of sends after which it dies silently. ``timeout_s`` bounds
    the wall time a worker's thread waits for the others to hand the world their calls (a worker stuck in
    its own code); the time the loop runs does not count, so a long simulation is not cut short (a
    deadlock in the modelled world is detected by the loop). ``host``: the hosts' CPU costs
    (:class:`~.sim_host.HostModel`); ``None`` charges none. :meth:`from_profile` loads a calibrated one.

    Args:
        bandwidth_gbps: each NIC's rate, Gbit/s.
        latency_us: each message's latency, microseconds.
        loss: the drop probability of unreliable datagrams, in [0, 1).
        seed: seeds the loss draws.
        stragglers: endpoint -> slow-down factor (>= 1).
        crash: endpoint -> sends after which it dies silently.
        timeout_s: bound of a wait for the other workers' calls, wall-clock seconds with the loop idle.
        payload_fraction: the share of the link rate that carries message bytes, in (0, 1].
        host: the hosts' CPU costs, or ``None`` for none.
        burst_us: each link's bucket, microseconds of link time (``tc htb``'s ``burst``, :data:`sparsecomm.netbed.
            topology.HTB_BURST_S` on the netbed): a NIC idle that long sends or takes that much of its time's bytes at
            once, as a shaper that saved up its tokens lets them through (module docstring); 0, the default: none.
        host_streams: whether the hosts' work on a message's bytes runs while the bytes cross the link (a NIC
            apart from the hosts' CPUs, as the netbed's veth links and a real network's are) rather than before
            and after them (``False``, the default: the link of a loopback, where the hosts' own copies are the
            wire and the host model's table by size was measured). With it, a message costs the host model's
            fixed part (:meth:`~.sim_host.HostModel.send_fixed_s`, ``recv_fixed_s``, ``wait_fixed_s``) before
            its first byte leaves and after its last arrives; the part that grows with its bytes (the sender's
            copies into its stack, the receiver's out of it into the posted buffer, their hand-offs) is a stage
            of a pipeline with the wire: the sender's NIC sends no faster than the sender streams, and the
            message is taken no earlier than its head's arrival plus the receiver's streamed part, so that a
            link slower than the hosts' stacks hides them (module docstring); the streamed part's CPU is still
            spent, so that an endpoint busy meanwhile (a switch taking several ports' messages) pays it. No host
            model: no effect.
    """

    bandwidth_gbps: float = 100.0
    latency_us: float = 2.0
    loss: float = 0.0
    seed: int = 0
    stragglers: dict[int, float] = field(default_factory=dict)
    crash: dict[int, int] = field(default_factory=dict)
    timeout_s: float = 120.0
    payload_fraction: float = 1.0
    host: HostModel | None = None
    host_streams: bool = False
    burst_us: float = 0.0

    def __post_init__(self) -> None:
        who = "Network"
        self.bandwidth_gbps = check_real("bandwidth_gbps", self.bandwidth_gbps, low=0.0, low_open=True, what=who)
        self.latency_us = check_real("latency_us", self.latency_us, low=0.0, what=who)
        self.burst_us = check_real("burst_us", self.burst_us, low=0.0, what=who)
        self.loss = check_real("loss", self.loss, low=0.0, high=1.0, high_open=True, what=who)
        self.seed = check_seed("seed", self.seed, what=who)
        self.timeout_s = check_real("timeout_s", self.timeout_s, low=0.0, low_open=True, what=who)
        self.payload_fraction = check_real("payload_fraction", self.payload_fraction, low=0.0, high=1.0,
                                           low_open=True, what=who)
        self.stragglers = {check_int("a straggler's endpoint", eid, low=0, what=who):
                           check_real(f"the factor of straggler {eid}", f, low=1.0, what=who)
                           for eid, f in self.stragglers.items()}
        self.crash = {check_int("a crashing endpoint", eid, low=0, what=who):
                      check_int(f"the sends before endpoint {eid} crashes", k, low=0, what=who)
                      for eid, k in self.crash.items()}
        if self.host is not None and not isinstance(self.host, HostModel):
            raise InvalidTypeError(f"{who}: host must be a HostModel or None, got {type(self.host).__name__}")

    @classmethod
    def from_profile(cls, path, **overrides) -> "Network":
        """A network whose ``host`` is the :class:`~.sim_host.HostModel` of the host profile at ``path``
        (written by ``python -m sparsecomm.netbed calibrate --out PATH``; format: :mod:`.sim_profile`).

        Args:
            path: the profile (a JSON file).
            **overrides: :class:`Network` fields (``bandwidth_gbps=10``) and :class:`~.sim_host.HostModel`
                fields (``cpu_share=2``, ``send_message_s=0``) replacing the defaults and the profile's.
        """
        from .sim_profile import network_from_profile

        return network_from_profile(cls, path, overrides)

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second of a worker NIC (the link rate times ``payload_fraction``)."""
        return self.bandwidth_gbps * 1e9 / 8 * self.payload_fraction


#: payload fraction of TCP over Ethernet at a 1500-byte MTU with TCP timestamps: 1448 payload bytes per
#: 1514-byte frame as a shaper (tc htb) counts it; pass ``Network(payload_fraction=TCP_OVER_ETHERNET)`` to
#: model a real TCP link (the netbed's; gloo's transport) rather than an ideal one.
TCP_OVER_ETHERNET = 1448 / 1514


#: :attr:`Msg.stamp` of a message whose NIC slot can no longer change
FIXED = 1 << 62


#: the order in which messages are placed on their receivers' NICs (:meth:`Endpoint.schedule`), the last key
#: of an entry of :attr:`Endpoint.any_heads`: two messages of one channel with the same head keep their order
ARRIVALS = count()


class TagHeap(list):
    """The heap of :attr:`Endpoint.any_heads` for one tag: ``(head, source, next(ARRIVALS), msg)`` of the
    messages queued on it, and of some taken since (dropped when they reach the top). Past ``limit`` entries
    (:meth:`Endpoint.schedule`) it is built afresh from the mailbox, of the queued ones alone, and ``limit``
    set to twice as many (plus :data:`TAG_HEAP_SLACK`): taken messages under an untaken top (a tag whose
    messages named receives take, looked up by an any-source receive once) are not kept for long."""

    __slots__ = ("limit",)

    def build(self, mailbox: dict, tag: int) -> None:
        """The messages queued on ``tag`` in ``mailbox``, as a heap (a channel's in its queue's order)."""
        self[:] = [(m.head, s, next(ARRIVALS), m) for (s, t), q in mailbox.items() if t == tag for m in q]
        heapify(self)
        self.limit = 2 * len(self) + TAG_HEAP_SLACK


#: the entries a :class:`TagHeap` may hold beyond twice the messages queued when it was built
TAG_HEAP_SLACK = 1024


@dataclass(eq=False, slots=True)
class Msg:
    """A message in the model: its bytes and its times (``start``, ``head``, ``tx_end``, ``rx_end``: the
    module docstring's formulas); ``delivered`` is when the receiving application may take it. ``data``: the
    bytes as they were at the send, a copy, or the buffer of the posted receive they were written into
    (:attr:`Endpoint.posted`), which holds them until the message is taken."""

    src: int
    tag: int
    data: torch.Tensor
    nbytes: int
    start: float
    head: float      # start + path latency
    tx_end: float    # start + bytes / bw_src
    rx_end: float = 0.0      # when the receiving NIC has taken its last byte (its place in arrival order)
    taken: bool = False      # delivered to the application: its NIC slot is fixed from then on
    #: ``max(rx_end, tx_end + (head - start))``, set with ``rx_end``; read it through
    #: :meth:`Endpoint.delivery` (it may be a lower bound of the current value, :meth:`Endpoint.schedule`)
    delivered: float = 0.0
    #: ``rx_end`` and ``delivered`` are exact while this is at least the receiver's ``epoch`` (:data:`FIXED`:
    #: its NIC slot is fixed)
    stamp: int = -1
    #: the posted receive whose buffer ``data`` is (it holds the bytes until the message is taken), if any
    into: object = None


#: a queued message's place on its receiving NIC: arrival (head) order, then the lower source
_nic_order = attrgetter("head", "src")


class Endpoint:
    """One endpoint's NIC(s) in the model: its clock, transmit schedule per port, the receive schedule
    (arrival order) and its mailbox; plus what the world's loop keeps per endpoint (:mod:`.sim_world`):
    the processes waiting on it, and, for an endpoint that a thread of user code owns, how many of its
    threads are parked in the world.

    ``bw`` is its NIC's payload bytes/s before a straggler's factor (``network.stragglers``), ``latency``
    its link's one-way latency in seconds; ``per_port``: one NIC per peer (a switch); ``threaded``: a
    thread outside the loop acts for it (a worker's training loop; a service whose main blocks)."""

    def __init__(self, network: Network, eid: int, bw: float, latency: float, per_port: bool, name: str,
                 threaded: bool = True) -> None:
        self.id = eid
        self.name = name
        self.slow = float(network.stragglers.get(eid, 1.0))
        self.bw = bw / self.slow      # a straggler's host stack moves bytes 1/factor as fast, both ways
        self.host = network.host      # CPU costs (None: none)
        self.cpu = self.slow * network.host.factor(eid) if network.host is not None else 1.0
        self.latency = latency
        self.burst = network.burst_us * 1e-6     # the links' bucket, seconds of link time (Network.burst_us)
        self.per_port = per_port            # one NIC port per peer (else one NIC)
        self.clock = 0.0
        self._tx_free: dict[int, float] = {}     # per port of a ``per_port`` endpoint, when it is free
        #: when the one NIC of an endpoint that is not ``per_port`` is free (:meth:`transmit`'s; a send without a
        #: host model places itself by it inline, :meth:`.sim.SimFabric.isend_each`)
        self.tx_free1 = -self.burst      # (a full bucket at time 0: Network.burst_us)
        # per NIC port (a ``per_port`` endpoint's by peer, ``_rx``; another's one NIC, ``_rx1``), a list: the queued
        # messages after the last one taken, in the order its NIC takes them (by :func:`_nic_order`), how many of
        # them (a prefix) have exact times, and the end of the one before them
        self._rx: dict[int, list] = {}
        self._rx1: list = [[], 0, -self.burst]
        #: bumped whenever messages' times become lower bounds (:meth:`schedule`): a message's times are
        #: exact if its ``stamp`` is at least this
        self.epoch = 0
        #: per ``(source, tag)`` with a message queued: its queue, in the order sent (a list: a channel holds a message
        #: or a few at a time, and a list of one is a tenth of a deque's bytes; the entry goes when its last message
        #: is taken: an endpoint that has heard from n peers on a few tags each keeps no n queues per tag for ever)
        self.mailbox: dict[tuple[int, int], list[Msg]] = {}
        #: per ``(source, tag)``: its posted receives from a named source, large enough to be written into at
        #: the send, not completed yet, in the order they were posted (a message sent with k queued on the
        #: channel is written into the k-th one's buffer: :class:`~.sim.SimFabric`; no entry once none is left)
        self.posted: dict[tuple[int, int], list] = {}
        #: per tag that an any-source receive has looked up (:func:`.sim_wait.any_head`): a heap of the messages
        #: queued on it since, ``(head, source, next(ARRIVALS), msg)``, each pushed as :meth:`schedule` places it
        #: (taken ones are dropped when they reach the top)
        self.any_heads: dict[int, TagHeap] = {}
        self.threaded = threaded
        self.parked = 0                      # its threads waiting in the world (running while none is)
        self.waiters: list = []              # its blocked processes (sim_world.Proc)
        self.waitset = None                  # the wait set of the roles a drive runs on it (sim_roles.RoleWaits)
        self.watch = None                    # that wait set while it records a receive: told of every message
                                             # put in or taken from the mailbox
        self.alive = True
        self.crashed = False
        self.sends = 0
        #: the sends after which it crashes (``network.crash``), if any
        self.crash_after: int | None = network.crash.get(eid)
        self.loss_rng: dict[int, np.random.Generator] = {}
        self.stats = CommStats()
        #: the hosts' work on a message's bytes runs while they cross the link (``Network.host_streams``)
        self.streams = bool(network.host_streams) and self.host is not None
        #: bytes of fresh buffers whose pages are charged as they are touched (:meth:`host_work`)
        self.untouched = 0
        #: CPU seconds (stretched) since this endpoint's last call ended (``"settle"``), which the next call's wait for
        #: its last worker counts (:meth:`host_work`); before any call, unbounded: the first call waits all of it
        self.unsynced = math.inf

    def transmit(self, peer: int, nbytes: int) -> tuple[float, float]:
        """Occupy the NIC (its port towards ``peer``) with ``nbytes`` from ``start = max(clock,
        when the port is free)`` until ``tx_end = start + nbytes / bw``; return ``(start, tx_end)``. With a
        host model the send's CPU time is charged to the clock first (:mod:`.sim_host`); with ``host_streams``
        only its fixed part first, its streamed part after the NIC starts, ``tx_end`` at least ``start`` plus it
        (:class:`Network`)."""
        link = nbytes / self.bw
        streamed = 0.0
        if self.host is not None:
            if self.streams:     # (the fixed part first; the bytes' part streams beside the NIC: Network.host_streams)
                fixed = self.host.send_fixed_s() * self.cpu
                streamed = max(0.0, self.host.send_s(nbytes) * self.cpu - fixed)
                self.clock += fixed
            else:
                self.clock += self.host.send_s(nbytes) * self.cpu
        start = self.clock
        # ``free``: the link's virtual finish, a token bucket of ``burst`` (0: when the NIC is free; module docstring)
        free = self._tx_free.get(peer, -self.burst) if self.per_port else self.tx_free1
        v = start - self.burst
        tx_end = (free if free > v else v) + link
        if free > start:
            start = free
        if tx_end < start + streamed:       # (at least its start; a host streaming slower than the link: its pace)
            tx_end = start + streamed
        if self.per_port:
            self._tx_free[peer] = tx_end
        else:
            self.tx_free1 = tx_end
        if streamed:
            self.clock += streamed       # (the CPU it spends streaming, beside the NIC)
        return start, tx_end

    def schedule(self, msg: Msg) -> bool:
        """Give arriving ``msg`` its place on the receiving NIC: arrival (head) order among the
        messages not yet taken by the application, after every message already taken (whose time has
        been observed and cannot change). Returns whether messages queued after it may have moved (it was
        placed before some).

        The later messages are re-timed lazily: their ``rx_end`` and ``delivered`` are left as they were, a
        lower bound of their new values (a message placed before them only delays them), and are brought up
        to date, in NIC order, when :meth:`delivery` reads one. ``msg``'s own times are exact if the messages
        before it are, else a lower bound likewise."""
        heads = self.any_heads
        if heads and msg.tag in heads:      # (the tag's index of an any-source receive: sim_wait.any_head)
            heap = heads[msg.tag]
            heappush(heap, (msg.head, msg.src, next(ARRIVALS), msg))
            if len(heap) > heap.limit:
                heap.build(self.mailbox, msg.tag)
        if self.per_port:
            rx = self._rx.get(msg.src)
            if rx is None:
                rx = self._rx[msg.src] = [[], 0, -self.burst]
        else:
            rx = self._rx1
        tail, valid = rx[0], rx[1]
        head = msg.head
        if not tail:                # (the common case: none queued before it)
            i = n = 0
            t = rx[2]
        else:                       # (after those of an equal order)
            last = tail[-1]
            key = (head, msg.src)
            if key >= (last.head, last.src):
                i = n = len(tail)
                t = last.rx_end
            else:                   # (before the last: not at the end, n is not needed)
                i, n = bisect_right(tail, key, key=_nic_order), -1
                t = tail[i - 1].rx_end if i else rx[2]
        head -= self.burst          # (a bucket lets the bytes of an idle NIC through at once: module docstring)
        msg.rx_end = t = (head if head > t else t) + msg.nbytes / self.bw     # (max, inline: once per message)
        d = msg.tx_end + (msg.head - msg.start)
        msg.delivered = d if d > t else t
        if i == n:
            tail.append(msg)
            if i == valid:           # timed from exact times: exact
                msg.stamp = self.epoch
                rx[1] = valid + 1
            return False
        tail.insert(i, msg)
        if i <= valid:               # exact; those after it are not any more
            self.epoch += 1
            msg.stamp = self.epoch
            rx[1] = i + 1
        return True

    def delivery(self, msg: Msg) -> float:
        """The delivery of queued ``msg`` (its ``delivered``, brought up to date: :meth:`schedule`)."""
        if msg.stamp >= self.epoch:
            return msg.delivered
        rx = self._rx[msg.src] if self.per_port else self._rx1
        tail = rx[0]
        i = 0
        if tail[0] is not msg:
            i = bisect_left(tail, (msg.head, msg.src), key=_nic_order)
            while tail[i] is not msg:
                i += 1
        valid, epoch = rx[1], self.epoch
        if i >= valid:               # re-time the messages before it in NIC order, and it
            t = tail[valid - 1].rx_end if valid else rx[2]
            bw, burst = self.bw, self.burst
            for k in range(valid, i + 1):    # (max, inline, as in schedule)
                m = tail[k]
                head = m.head - burst
                m.rx_end = t = (head if head > t else t) + m.nbytes / bw
                d = m.tx_end + (m.head - m.start)
                m.delivered = d if d > t else t
                m.stamp = epoch
            rx[1] = i + 1
        else:
            msg.stamp = epoch
        return msg.delivered

    def taken(self, msg: Msg) -> None:
        """``msg`` was delivered: fix its slot (and those of the messages before it on the NIC, still queued:
        a later arrival is placed after it). With a host model the clock moves to the delivery and on by the
        receive's CPU time (:mod:`.sim_host`; with its table by message size, to the delivery and the message's
        wait, if later)."""
        msg.taken = True
        stamp = msg.stamp
        if stamp < FIXED:           # (in the schedule still)
            if stamp < self.epoch:          # (delivery's own test: its times may be a lower bound)
                self.delivery(msg)
            rx = self._rx[msg.src] if self.per_port else self._rx1
            tail = rx[0]
            if tail[0] is msg:       # (the common case: the first on the NIC)
                del tail[0]
                rx[1] -= 1
            else:
                i = bisect_left(tail, (msg.head, msg.src), key=_nic_order)
                while tail[i] is not msg:
                    i += 1
                for k in range(i):
                    tail[k].stamp = FIXED
                rx[1] -= i + 1
                del tail[:i + 1]
            msg.stamp = FIXED
            rx[2] = msg.rx_end
        host = self.host
        if host is not None:
            if self.streams:        # (the bytes' part streamed as they arrived, from the head: Network.host_streams)
                nbytes = msg.nbytes
                wait0, recv0 = host.wait_fixed_s(), host.recv_fixed_s() * self.cpu
                cpu = max(0.0, host.recv_s(nbytes) * self.cpu - recv0)      # (the streamed part's CPU)
                arrival = msg.rx_end - nbytes / self.bw       # (its first byte on this NIC: at its head, or later
                if arrival < msg.head:                          # behind the messages before it)
                    arrival = msg.head
                done = arrival + max(0.0, host.wait_s(nbytes) - wait0) + cpu
                if done < msg.delivered:
                    done = msg.delivered
                # (its CPU is spent whatever else the endpoint does meanwhile: a receiver busy past the message
                # pays it all, as without streaming)
                self.clock = max(self.clock + cpu, done + wait0) + recv0
            elif host.tabled:         # (a wait between delivery and take: sim_host's table by size)
                nbytes = msg.nbytes
                self.clock = max(self.clock, msg.delivered + host.wait_s(nbytes)) + host.recv_s(nbytes) * self.cpu
            else:
                self.clock = max(self.clock, msg.delivered) + host.recv_s(msg.nbytes) * self.cpu

    def host_work(self, op: str, count: int, dtype=None, transport: str | None = None) -> None:
        """Charge ``count`` units of ``op`` to the clock (:meth:`.sim_host.HostModel.work_s`, stretched); no
        host model: nothing. ``"fresh_later"`` holds the bytes of a fresh buffer (one of at least the model's
        ``fresh_min_bytes``) in :attr:`untouched`, ``"fresh_touch"`` charges the bytes written of those held and
        uses them up, ``"sync"`` waits the model's :meth:`~.sim_host.HostModel.sync_wait_s` per call (not stretched
        again: :mod:`.sim_host`) for the CPU charged since the last ``"settle"`` (:attr:`unsynced`), which a call's
        end charges."""
        host = self.host
        if host is None:
            return
        if op == "fresh_later":
            host.work_s(op, count)          # (its checks)
            if count >= host.fresh_min_bytes:
                self.untouched += count
            return
        if op == "sync":                    # (a wait, not CPU: per unit of share above 1, not stretched)
            host.work_s(op, count)
            self.clock += count * host.sync_wait_s(self.id, self.unsynced / self.cpu)
            return
        if op == "settle":                  # (a call ended: the next call's sync counts the work from here)
            host.work_s(op, count)
            self.unsynced = 0.0
            return
        if op == "fresh_touch":
            host.work_s(op, count)
            count = min(count, self.untouched)
            self.untouched -= count
        spent = host.work_s(op, count, dtype, transport=transport) * self.cpu
        self.clock += spent
        self.unsynced += spent
