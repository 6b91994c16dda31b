"""SwitchML worker side: the self-clocked packet stream of one phase of a job, with loss recovery, and the
state a worker keeps between jobs on one switch program (:class:`SlotState`).

The transport (job set-up, quantisation, the control round) is :mod:`sparsecomm.transports.switchml`; the
wire format and the switch program are :mod:`.dataplane`, the switch's service loops :mod:`.service`.

The stream (Sapio et al., NSDI'21, Sec. 4): packet ``p`` goes on lane ``p % L`` (one switch slot per
lane); the lane's next packet ``p + L`` is sent when ``p``'s result arrives, so the switch's results clock
the workers. A lane whose result does not come within the timer is sent again, unchanged; the timer
doubles after ``timeout_threshold`` expiries (as the reference client does).

How results are received is the only difference between fabrics:

- SimFabric (one datagram per packet, modelled loss): one blocking receive at a time, with the timer.
- Real fabrics: an :class:`Inbox` of ``INBOX_DEPTH`` receives posted ahead from the switch, kept across
  jobs (gloo moves a message only once its receive is posted; with receives waiting, the switch's
  results flow as soon as they are sent; posted again ``REPOST_GROUP`` at a time), and an
  :class:`Uplink` thread posting the sends, at most ``SEND_AHEAD`` lane windows of bursts queued.

**Messages as long as their packets** (real fabrics): a message holds the packets that are ready, at most
a burst, in both directions; it is not padded to the burst. A receive is posted for a whole burst (the
switch's for ``RECV_SLACK`` of them) with every row's type ``T_EMPTY``, and gloo fills a prefix of it, so
the rows past the message read as empty; each side resets the types it read before posting the receive
again. So a job of a few packets (a control round: one) costs a few packets' bytes, not a burst's,
while a large job's messages are full bursts that amortise a message's fixed cost. The fabric books a
receive at its buffer's size; the worker takes back the unfilled rows (:meth:`Inbox.take`), so that its
ledger counts the bytes that arrived. On SimFabric a message is one packet (or a whole burst of rows,
padded: the SimFabric checks a message's shape against its receive's).

**An error inside a stream ends the job on every worker** (:func:`abandoning`, both switches): the
other workers wait for this worker's packets (a slot completes only with every worker's), so a worker
that leaves a stream -- a forged or corrupted result it refuses, a violated protocol invariant, the
switch's rejection notice (:func:`rejected`) -- stops every rank at once (the fabric's ``fail``), rather
than leaving them to wait for the timeout. Errors that every worker raises alike after a completed round
(the control round's verdict) leave the transport usable.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ...errors import FabricTimeout, InvalidValueError, MalformedMessage, ProtocolError, SparseCommError
from .._handshake import fail_stop
from .dataplane import (EXP_MIN, F_REJECTED, F_REJECTED_COUNT, F_TYPE, HEADER, T_DATA, T_EMPTY, T_REJECT,
                               T_RESULT, T_RETRANSMIT, TAG_DOWN, TAG_UP)

#: receives a worker keeps posted from the switch (real fabrics)
INBOX_DEPTH = 16
#: taken receives are posted again in groups of this many (see :class:`Inbox`)
REPOST_GROUP = 8
#: a worker waits for its oldest send once more than this many bursts per lane window are unfinished
SEND_AHEAD = 4


@contextmanager
def abandoning(fabric):
    """Around a stream (or the part of a job after its control round): an error raised inside leaves the
    other workers waiting for this worker's packets, so it stops every rank (``fail``) on its way out."""
    try:
        yield
    except Exception as exc:
        fail_stop(fabric, exc)
        raise


def rejected(fabric, name: str, worker: int, count: int, out_of_step: bool = False,
             refused: tuple[int, int, int, list[int]] | None = None) -> SparseCommError:
    """The error of the switch's rejection notice: it dropped ``count`` packets that came on ``worker``'s
    port, which it cannot parse (:class:`MalformedMessage`, naming ``worker``: its packets are the broken
    ones) or which are for another round than their slot holds (``out_of_step``, the sparse switch:
    :class:`ProtocolError`). Out of step, the refused packet and the packets that opened the round
    disagree, and either may be the forged one: ``refused`` (``(slot, refused position, the round's
    position, the workers that opened it)``, :func:`.sparse.dataplane.refusal`) names both sides and the
    error says that the sender of the wrong packet is unknown. A slot now holds part of a round that can
    never complete, so the job is over: every rank is stopped."""
    n = fabric.world_size
    if not 0 <= worker < n:
        return fail_stop(fabric, ProtocolError(f"{name}: the switch's rejection notice names worker {worker}, "
                                           f"outside 0..{n - 1}"))
    if out_of_step:
        if refused is None:
            side = "for another round than the one their slot holds"
        else:
            slot, pos, at, openers = refused
            who = ", ".join(f"worker {w}" for w in openers) or "no worker"
            side = (f"for position {pos} of slot {slot}, whose round is at position {at}, opened by the "
                    f"packet(s) of {who}")
        exc: SparseCommError = ProtocolError(
            f"{name}: the switch refused {count} packet(s) that came on worker {worker}'s port {side}; no worker "
            f"of this job sends packets that disagree on a round, so one was forged or corrupted on the way, "
            f"and the switch cannot tell whose: the sender of the wrong packet is unknown (worker {worker}, or "
            f"the workers that opened the round); the job is over")
        return fail_stop(fabric, exc)
    exc = MalformedMessage(
        f"{name}: the switch dropped {count} packet(s) of worker {worker} that it cannot parse (a type, "
        f"slot, set, worker id or worker count outside the job): worker {worker}'s messages were "
        f"corrupted on the way, or are not this library's; the job is over")
    return fail_stop(fabric, exc, rank=worker)


class Uplink:
    """The worker's sends to the switch on real fabrics, posted by a thread of their own: a gloo send
    returns only once the socket took the message (about its transmission time on a slow link), so
    posting from the loop would leave the link idle while the worker encodes and decodes. Messages are
    built in a ring of reusable buffers (:meth:`buffer` waits for a free one: the send-ahead bound),
    kept with the thread across jobs (:meth:`ensure` grows the ring for a job with more lanes; fresh
    buffers every job cost page faults); :meth:`drain` waits for every send and re-raises a send's error.
    Free buffers are taken last-freed first, so the few that a lane window keeps busy stay in the CPU
    cache (taken in turn, every buffer of the ring would pass through the cache in every window)."""

    def __init__(self, fabric, switch: int, burst: int, width: int, depth: int) -> None:
        self.fabric, self.switch, self.burst, self.width = fabric, switch, burst, width
        self.bufs: list[torch.Tensor] = []
        self.free: queue.LifoQueue = queue.LifoQueue()
        self.ensure(depth)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="switch-uplink", daemon=True)
        self.thread.start()

    def ensure(self, depth: int) -> None:
        """At least ``max(2, depth)`` buffers (call between jobs only)."""
        while len(self.bufs) < max(2, depth):
            self.free.put(len(self.bufs))
            self.bufs.append(torch.empty((self.burst, self.width), dtype=torch.int32))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            i, rows = item
            try:
                if self.error is None:
                    self.fabric.send(self.bufs[i][:rows], self.switch, TAG_UP, reliable=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the worker's loop
                self.error = exc
            self.free.put(i)

    def buffer(self) -> tuple[int, np.ndarray]:
        """A free message buffer (its index and rows)."""
        if self.error is not None:
            raise self.error
        i = self.free.get()
        return i, self.bufs[i].numpy()

    def put(self, i: int, rows: int) -> None:
        """Send the first ``rows`` rows of buffer ``i`` (module docstring: messages as long as their
        packets)."""
        self.q.put((i, rows))

    def drain(self) -> None:
        """Wait until every buffer is free again (every send done); re-raise a send's error."""
        idle = [self.free.get() for _ in self.bufs]
        for i in idle:
            self.free.put(i)
        if self.error is not None:
            raise self.error


class Inbox:
    """Receives from the switch posted ahead, in a ring (real fabrics); kept across jobs, since results
    of one job may not fill a whole ring.

    Taken receives are posted again ``group`` at a time (at least ``depth - group + 1`` stay posted).
    Why: each post sends the switch a small "receive posted" notice on the connection that the
    switch's egress thread is writing a result message on; gloo's event loop, finding the connection
    locked by that write, returns to ``epoll_wait`` at once and spins until the write ends (BENCHMARKS.md,
    "Switch CPU per call"). Posted one by one, a notice arrives during nearly every write; in groups, the
    notices of a group arrive together, during one write."""

    def __init__(self, fabric, switch: int, burst: int, width: int, depth: int = INBOX_DEPTH,
                 group: int = REPOST_GROUP) -> None:
        if not 1 <= group < depth:
            raise InvalidValueError(f"group must be in [1, depth - 1], got {group} for depth {depth}")
        self.fabric, self.switch, self.group = fabric, switch, group
        self.bufs = [torch.zeros((burst, width), dtype=torch.int32) for _ in range(depth)]
        self.works = [fabric.irecv(b, switch, TAG_DOWN) for b in self.bufs]
        self.i = 0
        self.unposted = 0         # taken receives behind self.i not posted again yet
        self.filled = 0           # rows the taken message filled

    def take(self, timeout: float | None) -> np.ndarray | None:
        """The next message's rows, as many as it filled (valid until :meth:`release`), or ``None`` if none
        came in ``timeout`` seconds. A timed wait polls, so that the receive stays this inbox's (a
        fabric's timed-out receive would be adopted by the next receive on the channel)."""
        work = self.works[self.i]
        if timeout is not None:
            deadline = time.perf_counter() + timeout
            delay = 2e-5
            while not work.is_completed():
                if time.perf_counter() >= deadline:
                    return None
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
        work.wait()
        rows = self.bufs[self.i].numpy()
        self.filled = message_rows(self.fabric, self.switch, rows)
        return rows[:self.filled]

    def release(self) -> None:
        """Done with the taken buffer (its rows' types are reset: the next message may be shorter); its
        receive is posted again with the group it completes."""
        self.bufs[self.i][:self.filled, F_TYPE] = T_EMPTY
        D = len(self.bufs)
        self.i = (self.i + 1) % D
        self.unposted += 1
        if self.unposted == self.group:
            for k in range(self.i - self.group, self.i):
                self.works[k % D] = self.fabric.irecv(self.bufs[k % D], self.switch, TAG_DOWN)
            self.unposted = 0


def message_rows(fabric, src: int, rows: np.ndarray) -> int:
    """How many rows of a receive posted for ``rows`` (every row's type, column 0, ``T_EMPTY`` when
    posted; both switches) the message from ``src`` filled: up to its last row of another type (module
    docstring: messages as long as their packets). The fabric booked the whole receive; the rest is taken
    back from its ledger."""
    used = np.flatnonzero(rows[:, 0])
    m = int(used[-1]) + 1 if used.size else 0
    if m < len(rows):
        fabric.stats.unbook_recv(src, fabric.rank, (len(rows) - m) * rows.shape[1] * rows.itemsize)
    return m


@dataclass
class SlotState:
    """What a worker keeps between jobs on one switch program, the same on every worker: the set each slot's
    next use takes (``parity``, flipped by each accepted result), the lanes' rotation over the pool
    (``shift``) and the job counter; on real fabrics also its receives posted ahead (:class:`Inbox`) and its
    sending thread (:class:`Uplink`). The transports of one fabric that talk to the same program share it
    (both switches: the sparse switch's rounds keep their parity and job here too)."""

    parity: np.ndarray
    shift: int = 0
    job: int = 0
    _inbox: Inbox | None = None
    _uplink: Uplink | None = None

    def next_job(self, modulus: int) -> int:
        """Number the next job (the job counter modulo ``modulus``, the width of the packets' job field)."""
        self.job = (self.job + 1) % modulus
        return self.job

    def lane_slots(self, lanes: int, pool: int) -> np.ndarray:
        """The switch slots of lanes ``0..lanes-1`` of a pool of ``pool`` slots (slot 0 is the control
        slot): lane ``j`` owns slot ``1 + (j + shift) mod pool``."""
        return 1 + (np.arange(lanes, dtype=np.int64) + self.shift) % pool

    def rotate(self, by: int, pool: int) -> None:
        """Advance the lanes' rotation by ``by`` slots (after a job)."""
        self.shift = (self.shift + by) % pool

    def inbox(self, fabric, switch: int, burst: int, width: int) -> Inbox:
        """The receives from the switch posted ahead (real fabrics), created on first use."""
        if self._inbox is None:
            self._inbox = Inbox(fabric, switch, burst, width)
        return self._inbox

    def uplink(self, fabric, switch: int, burst: int, width: int, depth: int) -> Uplink:
        """The sending thread (real fabrics) with at least ``depth`` buffers; a new one after a send failed."""
        if self._uplink is None or self._uplink.error is not None:
            self._uplink = Uplink(fabric, switch, burst, width, depth)
        self._uplink.ensure(depth)
        return self._uplink


@dataclass(frozen=True)
class Timer:
    """SwitchML's retransmission timer (the p4app-switchML client's rule): a packet unanswered for
    ``timeout`` seconds (modelled on SimFabric) is sent again, unchanged; after ``threshold`` expiries the
    timeout doubles and the threshold grows by ``increment``; a packet unanswered ``give_up_s`` after it
    was first sent raises :class:`~sparsecomm.errors.FabricTimeout`. ``timeout=None``: no timer (a
    fabric that never drops a message)."""

    timeout: float | None
    threshold: int
    increment: int
    give_up_s: float


class Lanes:
    """One worker's packet streams to the switch rank ``switch``: each job phase streams its packets over
    lanes (module docstring), ``elems`` values and a header per packet, up to ``burst`` packets per fabric
    message, with the retransmission ``timer``; ``state`` is the program's :class:`SlotState`. ``info``
    holds the last job's per-phase counts (packets, retransmissions, results, ignored, final timeout)."""

    def __init__(self, fabric, switch: int, state: SlotState, elems: int, burst: int, timer: Timer) -> None:
        self.fabric, self.switch, self.state = fabric, switch, state
        self.elems, self.burst, self.timer = elems, burst, timer
        self.sim = fabric.modelled_time
        self.info: dict = {}

    def run(self, lane_slots: np.ndarray, P: int, pkt_base: int, payload, consume, phase: str) -> None:
        """Stream packets ``0..P-1`` of the current job over ``len(lane_slots)`` lanes.

        ``payload(pkts, rows)`` fills new rows (their headers are set), ``consume(pkts, rows)`` takes
        accepted results (distinct packet numbers). A lane unanswered for the timer's ``give_up_s`` raises
        :class:`~sparsecomm.errors.FabricTimeout`; the switch's rejection notice, :func:`rejected`'s error;
        any error stops every rank (:func:`abandoning`). Per-phase counts land in ``info[phase]``.
        """
        fab, st, sw = self.fabric, self.state, self.switch
        L, E, K = len(lane_slots), self.elems, self.burst
        width = HEADER + E
        job, rank, n = st.job, fab.rank, fab.world_size
        lane_pkt = np.arange(L, dtype=np.int64)           # outstanding packet per lane (-1: lane done)
        timer = self.timer
        timed = timer.timeout is not None
        lane_rows = np.zeros((L, width), dtype=np.int32) if timed else None   # what was sent, to resend
        lane_deadline = np.full(L, math.inf)
        lane_first = np.zeros(L, dtype=np.float64)
        timeout, threshold, expiries = timer.timeout, timer.threshold, 0
        info = {"packets": 0, "retransmissions": 0, "results": 0, "ignored": 0}
        inbox = None if self.sim else st.inbox(fab, sw, K, width)
        uplink = None if self.sim else st.uplink(fab, sw, K, width, SEND_AHEAD * max(1, -(-L // K)))

        def send(lanes: np.ndarray, fresh: bool) -> None:
            for i in range(0, len(lanes), K):            # one message of K rows per K lanes
                part = lanes[i:i + K]
                m = len(part)
                if uplink is not None:
                    slot, msg = uplink.buffer()
                else:
                    msg = np.zeros((K, width), dtype=np.int32)
                rows = msg[:m]
                if fresh:
                    _headers(rows, part, lane_pkt, lane_slots, st.parity, rank, job, n, pkt_base)
                    payload(lane_pkt[part], rows)
                    if timed:
                        lane_rows[part] = rows
                else:
                    rows[:] = lane_rows[part]
                if uplink is None:     # a blocking send models the worker's NIC serialisation
                    msg[m:, F_TYPE] = T_EMPTY
                    fab.send(torch.from_numpy(msg), sw, TAG_UP, reliable=False)
                else:
                    uplink.put(slot, m)
            if timed:
                now = fab.now()
                lane_deadline[lanes] = now + timeout
                if fresh:
                    lane_first[lanes] = now
            info["packets"] += len(lanes)

        def receive(wait: float | None) -> np.ndarray | None:
            if inbox is not None:
                return inbox.take(wait)
            try:
                fab.recv(rbuf, sw, TAG_DOWN, timeout=wait)
            except FabricTimeout:
                if wait is None:
                    raise
                return None
            return rarr

        def expire() -> None:
            nonlocal timeout, threshold, expiries
            now = fab.now()
            expired = np.nonzero((lane_pkt >= 0) & (lane_deadline <= now + 1e-12))[0]
            if len(expired) == 0:
                return
            stale = expired[now - lane_first[expired] > timer.give_up_s]
            if len(stale):
                p = int(lane_pkt[stale[0]])
                raise FabricTimeout(
                    f"worker {rank}: switch {phase} packet {p} of job {job} unanswered for "
                    f"{now - lane_first[stale[0]]:.3g} s despite retransmissions: a peer or the switch "
                    f"is gone, or workers disagree on pool_size / slot_elems")
            expiries += len(expired)
            info["retransmissions"] += len(expired)
            send(expired, False)
            if expiries >= threshold:            # reference client: double after a threshold
                timeout *= 2
                threshold += timer.increment
                expiries = 0

        rbuf = torch.zeros((K, width), dtype=torch.int32) if inbox is None else None    # SimFabric's receive
        rarr = rbuf.numpy() if rbuf is not None else None
        at, pks, lanes = (np.empty(K, dtype=np.int64) for _ in range(3))    # _accept's outputs
        with abandoning(fab):
            send(np.arange(L), True)
            done = 0
            while done < P:
                wait = None
                if timed:
                    wait = max(float(lane_deadline[lane_pkt >= 0].min()) - fab.now(), 1e-9)
                rows = receive(wait)
                if rows is None:
                    expire()
                    continue
                got, ignored, nxt, rej = _accept(rows, lane_pkt, lane_slots, st.parity, job, pkt_base, P, at, pks,
                                                 lanes)
                if rej >= 0:
                    raise rejected(fab, "switch allreduce", int(rows[rej, F_REJECTED]), int(rows[rej, F_REJECTED_COUNT]))
                info["ignored"] += ignored
                if got:
                    consume(pks[:got], rows if got == len(rows) and at[got - 1] == got - 1 else rows[at[:got]])
                if inbox is not None:
                    inbox.release()
                done += got
                info["results"] += got
                if nxt:
                    send(lanes[:nxt].copy(), True)
            if uplink is not None:
                uplink.drain()
        info["final_timeout"] = timeout
        if self.info.get("job") != job:
            self.info = {"job": job}
        self.info[phase] = info


@njit(cache=True, nogil=True)
def _headers(rows, lanes, lane_pkt, lane_slots, parity, rank, job, n, pkt_base):  # pragma: no cover - numba
    """The header of ``rows[i]``: lane ``lanes[i]``'s outstanding packet on its slot's current set."""
    for i in range(lanes.size):
        j = lanes[i]
        slot = lane_slots[j]
        rows[i, 0] = T_DATA
        rows[i, 1] = slot
        rows[i, 2] = parity[slot]
        rows[i, 3] = rank
        rows[i, 4] = lane_pkt[j] + pkt_base
        rows[i, 5] = job
        rows[i, 6] = n
        rows[i, 7] = EXP_MIN                 # the payload sets a chunk's exponent


@njit(cache=True, nogil=True)
def _accept(rows, lane_pkt, lane_slots, parity, job, pkt_base, P, at, pks, lanes):  # pragma: no cover - numba
    """Take the results in ``rows`` for packets still outstanding, in row order: row ``at[i]`` answers
    packet ``pks[i]``; the lane's slot flips its set and the lane moves to its next packet (``-1``: done).
    Anything else -- a duplicate, a previous job's result, padding -- is ignored. Returns (results taken,
    results ignored, lanes with a next packet: ``lanes[:that]``, the first row that is the switch's
    rejection notice or -1)."""
    L = lane_pkt.size
    got = 0
    ignored = 0
    rej = -1
    for r in range(rows.shape[0]):
        kind = rows[r, 0]
        if kind == T_REJECT and rej < 0:
            rej = r
        if kind != T_RESULT and kind != T_RETRANSMIT:
            continue
        pk = np.int64(rows[r, 4]) - pkt_base
        if rows[r, 5] != job or pk < 0 or pk >= P or lane_pkt[pk % L] != pk:
            ignored += 1                     # not outstanding (also a second copy in this message)
            continue
        j = pk % L
        at[got] = r
        pks[got] = pk
        got += 1
        parity[lane_slots[j]] ^= 1
        lane_pkt[j] = pk + L if pk + L < P else -1
    nxt = 0
    for i in range(got):
        j = pks[i] % L
        if lane_pkt[j] >= 0:
            lanes[nxt] = j
            nxt += 1
    return got, ignored, nxt, rej
