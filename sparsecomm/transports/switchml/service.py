"""How packets reach the switch program (:mod:`.dataplane`) and its results leave: the service loops.

**SimFabric** (one datagram per packet, modelled time): one role (:func:`switch_role`, driven by the fabric)
receives a packet from any port, runs the program and replies with datagrams that it never waits for, so
the per-port links transmit in parallel.

**Real fabrics** (gloo over TCP; a message carries up to ``burst`` packets, as many as are ready: no
padding, in either direction, :mod:`.lanes`): a software switch with one receive
thread per port, as a multi-queue NIC gives each port its own RX ring. Each port keeps ``PORT_DEPTH``
receives posted from its worker (gloo moves a message only once the receiver has posted for it, so a
receive posted ahead lets the worker's next burst flow at once, with no round trip; they are posted
again ``PORT_GROUP`` at a time, which keeps gloo's event loop at the worker from spinning), runs the
program on each burst as it arrives (one compiled call, under the lock of the shared registers; the rest of the
loop runs while another port holds it) and queues the replies on the egress ports. Each egress port is a
thread sending its queue in order: a gloo send returns only once the socket took the message (about its
transmission time on a slow link), so a multicast sent from the receive thread would serialise the n
copies; on their own threads the ports transmit in parallel. A port with a full queue drops further replies, as a full egress queue does (SwitchML's retransmission recovers a dropped result when
a timer is set; only a worker that stops receiving can fill it: the queue holds every result a worker
can be waiting for, one per slot and set, plus ``EGRESS_CAP``). Ports never wait for each other: a
worker that sends more or fewer messages than the others (retransmissions, forged packets) cannot hold
the other ports back, which a single loop taking the ports in turn would.

A ``SHORT`` message (header-only packets, the dataplane's docstring) is answered with ``SHORT`` messages, its
results written over the packets they answer as a burst's are; one whose count is past the receive is
malformed, reported to every worker as a malformed packet is.

A message longer than the switch's receive is beyond reach: gloo aborts the receiving process on it, and
torch.distributed offers no receive of unknown size. So every switch receive holds ``RECV_SLACK`` bursts,
every row of type ``T_EMPTY`` when it is posted (gloo accepts a shorter message, leaving the rest
untouched): a message of up to ``RECV_SLACK`` bursts is processed packet by packet; only a longer one,
which no worker of this library sends, would abort it. The program resets each row's type as it reads it;
since gloo writes a prefix, a message of at most one burst leaves row ``burst`` empty, and then only the
first burst is read (the slack rows are touched only after a longer message).

Per message the switch's CPU goes to the kernel's copies, the program and the Python around them, and
nothing else: each result is written over the row it answers in the receive buffer, which is then sent as
the reply (no reply buffer to fill: one write of the summed bytes fewer, into cache-hot rows), receive
buffers come from a pool reused last-freed first (:class:`_Buffers`: no page faults of fresh buffers per
message), and the slack rows are not scanned and reset per message. The switch's CPU per call:
BENCHMARKS.md, "Switch CPU per call".
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Callable, Generator

import numpy as np
import torch

from ...errors import ServiceShutdown
from ...fabric import services
from ...fabric.base import Fabric
from ...fabric.roles import Inbox, Outbox, Pool, PostInto, Recv, SendEach, Step
from .dataplane import (F_TYPE, HEADER, RECV_SLACK, T_EMPTY, T_SHORT, TAG_DOWN, TAG_UP, Dataplane, SwitchConfig,
                        rejection, short_extent, short_frame, short_rows, split_messages)
from .datagrams import Datagram, Multicast, drive, drive_process

#: receives each port keeps posted from its worker (real fabrics)
PORT_DEPTH = 16
#: a port posts its receives again in groups of this many (at least PORT_DEPTH - PORT_GROUP stay
#: posted): each post sends the worker a "receive posted" notice on the connection its send thread
#: writes on, and gloo's event loop spins while a write holds the connection; grouped, the notices
#: arrive together, during one write rather than during nearly every write (see ``Link`` in
#: :mod:`.lanes`)
PORT_GROUP = 8
#: replies a port may have queued before it drops, beyond the most a worker can await (real fabrics)
EGRESS_CAP = 64
#: the stage of the switch role's waits (one role: no preference to state)
_STEP = Step()


def serve_process(dp: Dataplane, fabric: Fabric) -> Generator:
    """The switch on a fabric with modelled time as a process of the fabric's loop (no thread): its role
    (:func:`switch_role`) driven by ``Fabric.drive_process`` until the run ends."""
    dp.world = fabric.world_size
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    yield from drive_process(fabric, inbox, outbox, [switch_role(dp, inbox)])


def serve(dp: Dataplane, fabric: Fabric) -> None:
    """The switch's main loop on ``fabric`` until the run ends (the fabric's shutdown exception): on a
    modelled fabric its role (:func:`switch_role`) driven by the fabric (blocking; :func:`serve_process` is
    the same without a thread), elsewhere the ports' threads."""
    dp.world = fabric.world_size
    if fabric.modelled_time:
        pool = Pool()
        inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
        drive(fabric, inbox, outbox, [switch_role(dp, inbox)])
    else:
        _serve_ports(dp, fabric)


# ----------------------------------------------------------------------------- SimFabric
def switch_role(dp: Dataplane, inbox: Inbox):
    """The switch on a modelled fabric as one role (:mod:`sparsecomm.fabric.roles`, :mod:`.datagrams`),
    forever: it posts a receive of one message from any port (``inbox`` key ``"up"``), waits for it, runs
    the program on it and yields its replies (whole padded bursts; on a SimFabric with a real fabric's
    ``message_bytes``, messages as long as their packets, both ways, header-only packets in ``SHORT`` messages
    as a real fabric's port takes and answers them: :func:`_short_replies`), datagrams that it never waits for
    (:class:`~.datagrams.Datagram` with no ``hold``: the per-port links transmit in parallel; a result to every
    worker is one :class:`~.datagrams.Multicast`); the rejection notice of malformed packets is a reliable
    :class:`~sparsecomm.fabric.roles.SendEach` to every worker (the dataplane's docstring). A
    message's port is its receive's source; the workers are ``dp.world`` (set by :func:`serve`)."""
    burst = dp.config.burst
    width = HEADER + dp.config.elems
    buf = torch.zeros((burst, width), dtype=torch.int32)
    arr = buf.numpy()
    padded = inbox.fabric.message_bytes is None     # the model's datagrams (else as long as their packets)
    # the paper's datagrams, one packet each: the program's reply rows, kept (a datagram holds a copy of its bytes)
    one = padded and burst == 1
    fabric = inbox.fabric
    charged = fabric.charges_host_work      # (host_work is a no-op elsewhere)
    mc1, uc1 = np.empty((1, width), dtype=np.int32), np.empty((1, width), dtype=np.int32)
    new1 = np.empty(1, dtype=np.uint8)
    mc1t, uc1t = torch.from_numpy(mc1), torch.from_numpy(uc1)
    everyone = range(dp.world)
    while True:
        yield PostInto("up", buf, None, TAG_UP)
        work = inbox.work("up")
        yield Recv(("up",), _STEP)
        inbox.take("up")
        src = work.wait()                  # completed by the take: the port the message came on
        if not 0 <= src < dp.world:        # only workers talk to the switch
            dp.stats["malformed"] += 1
            continue
        before = dp.stats["malformed"]
        if not padded and arr[0, F_TYPE] == T_SHORT:     # header-only packets, as on a real fabric
            yield from _short_replies(dp, inbox.fabric, arr, src, width, burst)
            continue
        if one:                          # (the paper's datagrams, one packet each: its replies as they are)
            packets = int(arr[0, F_TYPE] != T_EMPTY)
            nmc, nuc, _ = dp.execute(arr, mc1, uc1, new1, alias=False)
            mcast, ucast = (mc1t,) if nmc else (), (uc1t,) if nuc else ()
        elif padded:
            packets = int(np.count_nonzero(arr[:, F_TYPE] != T_EMPTY))     # a burst's padding is no packet
            mcast, ucast = ([torch.from_numpy(m) for m in r] for r in dp.process(arr, burst))
        else:           # messages as long as their packets, both ways (a host model's real fabric defaults)
            packets = int(np.count_nonzero(arr[:, F_TYPE] != T_EMPTY))
            used = np.flatnonzero(arr[:, F_TYPE])
            mc, uc = dp.process(arr[:int(used[-1]) + 1 if used.size else 0])
            arr[:, F_TYPE] = T_EMPTY     # the next message may be shorter
            mcast, ucast = ([torch.from_numpy(m) for m in split_messages(r, len(r), burst, pad=False)]
                            for r in (mc, uc))
        if charged:
            fabric.host_work("switch_message", 1)
            fabric.host_work("switch_packet", packets)
        if dp.stats["malformed"] > before:     # reported to every worker (the dataplane's docstring)
            notice = torch.from_numpy(rejection(width, burst, src, dp.world, dp.stats["malformed"] - before))
            yield SendEach(notice, tuple(range(dp.world)), TAG_DOWN)
        for msg in mcast:
            yield Multicast(msg, everyone, TAG_DOWN)
        for msg in ucast:
            yield Datagram(msg, src, TAG_DOWN)


def _short_replies(dp: Dataplane, fabric: Fabric, arr: np.ndarray, src: int, width: int, burst: int):
    """(role, :func:`switch_role`) A ``SHORT`` message from worker ``src`` in the receive buffer ``arr`` on a
    SimFabric with a real fabric's messages: its header-only packets through the program and their results as
    ``SHORT`` messages, as a real fabric's port answers them (:func:`_serve_ports`); ``arr``'s rows are left
    ``T_EMPTY``. A count past the burst is malformed, reported to every worker as a malformed packet is."""
    rows = short_rows(arr, burst)
    if rows is None:
        arr[:, F_TYPE] = T_EMPTY
        dp.stats["malformed"] += 1
        notice = torch.from_numpy(rejection(width, burst, src, dp.world, 1))
        yield SendEach(notice, tuple(range(dp.world)), TAG_DOWN)
        return
    before = dp.stats["malformed"]
    mc, uc = dp.process(rows.copy())
    arr[:short_extent(len(rows), width), F_TYPE] = T_EMPTY      # (the rows whose type word it overwrote)
    fabric.host_work("switch_message", 1)
    fabric.host_work("switch_packet", len(rows))
    if dp.stats["malformed"] > before:
        notice = torch.from_numpy(rejection(width, burst, src, dp.world, dp.stats["malformed"] - before))
        yield SendEach(notice, tuple(range(dp.world)), TAG_DOWN)
    for res, dsts in ((mc, range(dp.world)), (uc, None)):
        if len(res):
            msg, out = short_frame(np.empty(HEADER * (len(res) + 1), dtype=np.int32), len(res))
            out[:] = res
            if dsts is None:
                yield Datagram(torch.from_numpy(msg), src, TAG_DOWN)
            else:
                yield Multicast(torch.from_numpy(msg), dsts, TAG_DOWN)


# ----------------------------------------------------------------------------- real fabrics
class _Buffers:
    """Message buffers reused across messages, shared by the ports (a fresh 1 MiB array per message would
    pay its page faults on every message): receive buffers that become the replies they hold
    (results are written over the rows they answer, see :func:`_serve_ports`), and, with the audit on,
    separate reply buffers. A buffer returns to the pool when every send of its messages has completed:
    :meth:`hold` sets how many sends will :meth:`release` it, and how many leading rows (replies) to
    reset to ``T_EMPTY`` then (a receive buffer has every row ``T_EMPTY`` when posted). Buffers are taken
    last-freed first (the few in use stay in the cache); the pool keeps at most ``keep`` free ones."""

    def __init__(self, rows: int, width: int, keep: int) -> None:
        self.rows, self.width, self.keep = rows, width, keep
        self.free: list[np.ndarray] = []
        self.pending: dict[int, list] = {}
        self.lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self.lock:
            if self.free:
                return self.free.pop()
        return np.zeros((self.rows, self.width), dtype=np.int32)     # every row T_EMPTY

    def hold(self, buf: np.ndarray, sends: int, reset: int = 0) -> None:
        if sends == 0:
            self.give_back(buf, reset)
        else:
            with self.lock:
                self.pending[id(buf)] = [buf, sends, reset]

    def release(self, key: int | None) -> None:
        """One send of the buffer ``key`` (``id`` of it) is done; ``None``: a message of its own."""
        if key is None:
            return
        with self.lock:
            entry = self.pending[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self.pending[key]
        self.give_back(entry[0], entry[2])

    def give_back(self, buf: np.ndarray, reset: int = 0) -> None:
        if reset:
            buf[:reset, F_TYPE] = T_EMPTY
        with self.lock:
            if len(self.free) < self.keep:
                self.free.append(buf)


class _Egress:
    """One output port: a thread sends the queued replies in order (a gloo send returns only once the
    socket took the message, about its transmission time on a slow link, so each port sends on its own
    thread and the ports transmit in parallel); past ``cap`` queued replies the port drops."""

    def __init__(self, fabric: Fabric, dst: int, cap: int, failures: list, replies: _Buffers) -> None:
        self.fabric, self.dst, self.cap, self.failures, self.replies = fabric, dst, cap, failures, replies
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name=f"switch-egress-{dst}", daemon=True)
        self.thread.start()

    def send(self, msg: torch.Tensor, key: int | None) -> None:
        if self.q.qsize() >= self.cap:
            self.dropped += 1
            self.replies.release(key)
            return
        self.q.put((msg, key))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                self.fabric.send(item[0], self.dst, TAG_DOWN, reliable=False)
            except BaseException as exc:  # noqa: BLE001 - handed to the service's main thread
                self.failures.append(exc)
                return
            self.replies.release(item[1])


def _serve_ports(dp: Dataplane, fabric: Fabric) -> None:
    n, burst = dp.world, dp.config.burst
    width = HEADER + dp.config.elems
    registers = threading.Lock()
    failures: list[BaseException] = []
    # a worker awaits at most one result per slot and set: that many replies, plus EGRESS_CAP, never drop
    cap = -(-2 * dp.config.slots // burst) + EGRESS_CAP
    buffers = _Buffers(burst * RECV_SLACK, width, keep=4 * n * PORT_DEPTH)
    egress = [_Egress(fabric, dst, cap, failures, buffers) for dst in range(n)]
    # results overwrite the rows they answer (the program writes result k over row k <= the row it answers,
    # which it has read): the receive buffer is the reply, no copy. The audit reads the rows afterwards, so
    # with it on, results go to buffers of their own.
    in_place = dp.audit is None
    # a port thread waits on its receives itself where the fabric offers it (one wake-up per message:
    # gloo's loop -> the port), while this thread watches the end of the run; else each wait is a
    # helper thread's, which the port polls for the end of the run (gloo's loop -> helper -> port)
    direct = fabric.wait_unbounded if fabric.direct_waits else None
    watch = fabric.wait_for_shutdown if fabric.direct_waits else None

    def short(w: int, arr: np.ndarray, uc: np.ndarray, scratch: np.ndarray) -> None:
        """A SHORT message from worker ``w`` in receive buffer ``arr``: its header-only packets through the
        program, their results as SHORT messages (over the packets they answer, as whole rows are)."""
        rows = short_rows(arr, burst * RECV_SLACK)
        if rows is None:                      # a count past the buffer: malformed, reported as any
            buffers.give_back(arr, len(arr))  # (how much of the buffer it filled is unknown)
            with registers:
                dp.stats["malformed"] += 1
            notice = torch.from_numpy(rejection(width, 1, w, n, 1))
            for e in egress:
                e.send(notice, None)
            return
        out = arr if in_place else buffers.take()
        msg, mc = short_frame(out, len(rows))
        with registers:
            nmc, nuc, bad = dp.execute(rows, mc, uc, scratch, clear=True)
        if bad:
            notice = torch.from_numpy(rejection(width, 1, w, n, bad))
            for e in egress:
                e.send(notice, None)
        if not in_place:
            buffers.give_back(arr, short_extent(len(rows), width))
        msg, _ = short_frame(out, nmc)
        buffers.hold(out, n if nmc else 0, reset=short_extent(len(rows), width))
        if nmc:
            reply = torch.from_numpy(msg)
            for e in egress:
                e.send(reply, id(out))
        if nuc:
            ureply, urows = short_frame(np.empty(HEADER * (nuc + 1), dtype=np.int32), nuc)
            urows[:] = uc[:nuc]
            egress[w].send(torch.from_numpy(ureply), None)

    def port(w: int) -> None:
        try:
            posted: deque = deque()

            def repost() -> None:
                if len(posted) <= PORT_DEPTH - PORT_GROUP:
                    for _ in range(PORT_GROUP):
                        b = buffers.take()
                        posted.append((fabric.irecv(torch.from_numpy(b), w, TAG_UP), b))

            for _ in range(PORT_DEPTH):
                b = buffers.take()
                posted.append((fabric.irecv(torch.from_numpy(b), w, TAG_UP), b))
            uc = np.empty((burst * RECV_SLACK, width), dtype=np.int32)     # unicasts: rare, copied out
            uc_short = np.empty((burst * RECV_SLACK, HEADER), dtype=np.int32)
            scratch = np.empty(burst * RECV_SLACK, dtype=np.uint8)
            while not failures:
                work, arr = posted.popleft()
                if direct is not None:
                    direct(work)
                else:
                    work.wait()
                if arr[0, F_TYPE] == T_SHORT:         # header-only packets (the dataplane's docstring)
                    short(w, arr, uc_short, scratch)
                    repost()
                    continue
                mc = arr if in_place else buffers.take()
                # every row is T_EMPTY before the receive is posted and gloo writes a prefix: a message of
                # at most `burst` rows (all this library's workers send) leaves row `burst` empty
                rows = arr[:burst] if arr[burst, F_TYPE] == T_EMPTY else arr
                with registers:
                    nmc, nuc, bad = dp.execute(rows, mc, uc, scratch, clear=True)
                if bad:       # malformed rows, dropped: reported to every worker (the dataplane's docstring)
                    notice = torch.from_numpy(rejection(width, 1, w, n, bad))
                    for e in egress:
                        e.send(notice, None)
                repost()
                if not in_place:
                    buffers.give_back(arr)
                mcast = split_messages(mc, nmc, burst, pad=False)
                buffers.hold(mc, n * len(mcast), reset=nmc)
                for msg in mcast:
                    msg = torch.from_numpy(msg)
                    for e in egress:
                        e.send(msg, id(mc))
                if nuc:
                    ucast = split_messages(uc[:nuc].copy(), nuc, burst, pad=False)
                    for msg in ucast:
                        egress[w].send(torch.from_numpy(msg), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the service's main thread
            failures.append(exc)

    threads = [threading.Thread(target=port, args=(w,), name=f"switch-port-{w}", daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    try:
        if watch is not None:
            if watch(lambda: bool(failures)):       # the run is over; the ports stay blocked (daemons)
                raise ServiceShutdown("every worker has finished")
        else:
            for t in threads:
                t.join()
        raise failures[0]
    finally:
        for e in egress:
            e.q.put(None)


def service_main(config: SwitchConfig) -> Callable[[Fabric], None]:
    """A launcher-started switch rank's loop: a fresh dataplane running ``config`` on the rank's fabric."""

    def main(fabric: Fabric) -> None:
        serve(Dataplane(config.on(fabric)), fabric)

    return main


@services.registry.register("switch")
def _switch_service(arg: str | None) -> Callable[[Fabric], None]:
    return service_main(SwitchConfig.parse(arg))
