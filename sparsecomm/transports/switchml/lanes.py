"""SwitchML worker side: the self-clocked packet stream of one phase of a job, with loss recovery, and the
state a worker keeps between jobs on one switch program (:class:`SlotState`).

The transport (job set-up, quantisation, the control round) is :mod:`sparsecomm.transports.switchml`; the
wire format and the switch program are :mod:`.dataplane`, the switch's service loops :mod:`.service`.

The stream (Sapio et al., NSDI'21, Sec. 4): packet ``p`` goes on lane ``p % L`` (one switch slot per
lane); the lane's next packet ``p + L`` is sent when ``p``'s result arrives, so the switch's results clock
the workers. A lane whose result does not come within the timer is sent again, unchanged; the timer
doubles after ``timeout_threshold`` expiries (as the reference client does).

The stream is one role (:mod:`sparsecomm.fabric.roles`: a generator that yields its I/O, never waits
itself), :meth:`Lanes.role`, that the fabric drives (:func:`.datagrams.drive`: packets are datagrams, and
the timer is a receive with a deadline, :class:`~.datagrams.RecvBy`). Its messages go through the worker's
:class:`Link`, kept across jobs: a ring of ``INBOX_DEPTH`` receives posted ahead from the switch (gloo
moves a message only once its receive is posted; with receives waiting, the switch's results flow as soon
as they are sent; posted again ``REPOST_GROUP`` at a time) and the send buffers, at most ``SEND_AHEAD``
lane windows of bursts in flight. The fabrics differ in what a message is:

- SimFabric: one datagram of the model per packet (modelled loss), a whole burst of rows, padded, sent as
  a blocking send (the worker NIC's serialisation), the timer in modelled seconds; with a host model that
  charges per message (a real fabric's ``message_bytes``), messages as long as their packets, header-only
  packets in ``SHORT`` messages and sends asynchronous, as below (a real process's send returns once its
  bytes are queued, and it encodes the next burst while the NIC serialises this one): the real fabric's
  messages, byte for byte.
- Real fabrics: messages as long as their packets (below), sends asynchronous.

**Messages as long as their packets** (real fabrics): a message holds the packets that are ready, at most
a burst, in both directions; it is not padded to the burst. A receive is posted for a whole burst (the
switch's for ``RECV_SLACK`` of them) with every row's type ``T_EMPTY``, and gloo fills a prefix of it, so
the rows past the message read as empty; each side resets the types it read before posting the receive
again. So a job of a few packets (a control round: one) costs a few packets' bytes, not a burst's,
while a large job's messages are full bursts that amortise a message's fixed cost. The fabric books a
receive at its buffer's size; the worker takes back the unfilled rows (:meth:`Link.take`), so that its
ledger counts the bytes that arrived. Packets that carry no values (a float job's exponent look-ahead) go
header-only, in ``SHORT`` messages of their own both ways (:mod:`.dataplane`, "Header-only packets"). On
SimFabric a message is one packet (or a whole burst of rows, padded: the SimFabric checks a message's shape
against its receive's), unless a host model gives it a real fabric's ``message_bytes``: then its messages are
the real fabric's, these included.

**An error inside a stream ends the job on every worker** (:func:`abandoning`, both switches): the
other workers wait for this worker's packets (a slot completes only with every worker's), so a worker
that leaves a stream -- a forged or corrupted result it refuses, a violated protocol invariant, the
switch's rejection notice (:func:`rejected`) -- stops every rank at once (the fabric's ``fail``), rather
than leaving them to wait for the timeout. Errors that every worker raises alike after a completed round
(the control round's verdict) leave the transport usable.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ...errors import FabricTimeout, InvalidValueError, MalformedMessage, ProtocolError, SparseCommError
from ...fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Step
from .._handshake import fail_stop
from .dataplane import (EXP_MIN, F_REJECTED, F_REJECTED_COUNT, F_TYPE, HEADER, T_DATA, T_EMPTY, T_REJECT,
                        T_RESULT, T_RETRANSMIT, T_SHORT, TAG_DOWN, TAG_UP, short_extent, short_frame, short_rows)
from .datagrams import SENT, Datagram, RecvBy, drive

#: receives a worker keeps posted from the switch
INBOX_DEPTH = 16
#: taken receives are posted again in groups of this many (see :class:`Link`)
REPOST_GROUP = 8
#: a worker waits for its oldest send once more than this many bursts per lane window are unfinished
SEND_AHEAD = 4
#: the stage of the stream's waits (one role: no preference to state)
_STEP = Step()


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


class Link:
    """One worker's messages to and from the switch rank ``switch``, kept across jobs (:class:`SlotState`):
    the roles' :class:`~sparsecomm.fabric.roles.Pool`, :class:`~sparsecomm.fabric.roles.Inbox` and
    :class:`~sparsecomm.fabric.roles.Outbox` a stream is driven with, a ring of ``depth`` receives from the
    switch posted ahead (``burst x width`` int32 buffers) and the buffers its messages to the switch are
    built in. What it posts and sends, a stream's role yields (:meth:`post`, :meth:`release`,
    :meth:`buffer`); nothing here waits.

    Receives: gloo moves a message only once its receive is posted; with receives waiting, the switch's
    results flow as soon as they are sent. They are kept across jobs, since the results of one job may not
    fill a whole ring. Taken receives are posted again ``group`` at a time (at least ``depth - group + 1``
    stay posted). Why: each post sends the switch a small "receive posted" notice on the connection that
    the switch's egress thread is writing a result message on; gloo's event loop, finding the connection
    locked by that write, returns to ``epoll_wait`` at once and spins until the write ends (BENCHMARKS.md,
    "Switch CPU per call"). Posted one by one, a notice arrives during nearly every write; in groups, the
    notices of a group arrive together, during one write.

    Sends: a message is built in a buffer of the ring, which is not reused before its send has completed;
    at most ``cap`` buffers (:meth:`buffer`: the send-ahead bound), taken last-freed first so that the few
    a lane window keeps busy stay in the CPU cache."""

    def __init__(self, fabric, switch: int, burst: int, width: int, depth: int = INBOX_DEPTH,
                 group: int = REPOST_GROUP) -> None:
        if not 1 <= group < depth:
            raise InvalidValueError(f"group must be in [1, depth - 1], got {group} for depth {depth}")
        self.switch, self.burst, self.width, self.group = switch, burst, width, group
        self.pool = Pool()
        self.inbox, self.outbox = Inbox(fabric, self.pool), Outbox(fabric, self.pool)
        self.bufs = [torch.zeros((burst, width), dtype=torch.int32) for _ in range(depth)]
        self._rows = [b.numpy() for b in self.bufs]      # the same memory as arrays (cheap per-packet writes)
        self.posted = False       # the ring's first receives are posted
        self.i = 0                # the ring position of the next receive to take
        self.unposted = 0         # taken receives behind self.i not posted again yet
        self.filled = 0           # rows the taken message filled
        self.out: list[torch.Tensor] = []   # send buffers
        self.free: list[int] = []           # free send buffers (taken from the end: last freed first)
        self.busy: deque = deque()          # send buffers in use, oldest first
        self._spare: tuple[torch.Tensor, np.ndarray] | None = None     # the blocking sends' buffer (:meth:`spare`)

    @property
    def key(self):
        """The inbox key of the next receive to take."""
        return ("down", self.i)

    def post(self):
        """(role) Post the ring's receives, the first time."""
        if not self.posted:
            self.posted = True
            for k, b in enumerate(self.bufs):
                yield PostInto(("down", k), b, self.switch, TAG_DOWN)

    def take(self, fabric, whole: bool, unbook: bool = True) -> np.ndarray:
        """The rows of the message of :attr:`key`, which is in (valid until :meth:`release`): all of them
        (``whole``: a message is one padded datagram, SimFabric), or as many as it filled
        (:func:`message_rows`: with ``unbook``, a real fabric, the rest is taken back from ``fabric``'s
        ledger; a SimFabric books the message's own bytes); a ``SHORT`` message's header rows (``HEADER``
        words each, :func:`.dataplane.short_frame`; at most a burst of them, else
        :class:`~sparsecomm.errors.ProtocolError`)."""
        self.inbox.take(self.key)
        rows = self._rows[self.i]             # (the buffer of that receive, as an array: :meth:`post`, :meth:`release`)
        if whole or rows[0, F_TYPE] != T_SHORT:
            self.filled = len(rows) if whole else message_rows(fabric, self.switch, rows, unbook)
            return rows[:self.filled]
        short = short_rows(rows, self.burst)
        if short is None:
            self.filled = len(rows)          # how much of the buffer it filled is unknown: reset it all
            raise ProtocolError(f"the switch sent a message of header-only results whose count "
                                f"{int(rows.reshape(-1)[1])} is outside 0..{self.burst} (the burst): a forged "
                                f"or corrupted message")
        self.filled = short_extent(len(short), self.width)
        if unbook:
            fabric.stats.unbook_recv(self.switch, fabric.rank,
                                     (rows.size - HEADER * (len(short) + 1)) * rows.itemsize)
        return short

    def release(self):
        """(role) Done with the taken buffer (its rows' types are reset: the next message may be shorter);
        its receive is posted again with the group it completes."""
        self._rows[self.i][:self.filled, F_TYPE] = T_EMPTY
        D = len(self.bufs)
        self.i = (self.i + 1) % D
        self.unposted += 1
        if self.unposted == self.group:
            for k in range(self.i - self.group, self.i):
                yield PostInto(("down", k % D), self.bufs[k % D], self.switch, TAG_DOWN)
            self.unposted = 0

    def buffer(self, cap: int):
        """(role) A free send buffer ``(index, its rows as an array)``, held under ``("up", index)`` by the
        send it is given to; with ``cap`` in use, the oldest one's send is waited for first (``Flush``)."""
        if not self.free and len(self.out) < cap:
            self.free.append(len(self.out))
            self.out.append(torch.empty((self.burst, self.width), dtype=torch.int32))
        if not self.free:
            j = self.busy.popleft()
            yield Flush(("up", j))
            self.free.append(j)
        j = self.free.pop()
        self.busy.append(j)
        return j, self.out[j].numpy()

    def spare(self) -> tuple[torch.Tensor, np.ndarray]:
        """The buffer of blocking sends (:data:`.datagrams.SENT`: each is sent and waited for before the next
        is built, and a SimFabric's datagram holds a copy of its bytes), ``(tensor, the same as an array)``: one,
        kept; none of the send ring's."""
        if self._spare is None:
            t = torch.zeros((self.burst, self.width), dtype=torch.int32)
            self._spare = (t, t.numpy())
        return self._spare

    def finish(self) -> None:
        """Wait for every send (a stream's end); every send buffer is free again, the latest freed last."""
        self.outbox.finish()
        self.free.extend(self.busy)
        self.busy.clear()


def message_rows(fabric, src: int, rows: np.ndarray, unbook: bool = True) -> int:
    """How many rows of a receive posted for ``rows`` (every row's type, column 0, ``T_EMPTY`` when
    posted; both switches) the message from ``src`` filled: up to its last row of another type (module
    docstring: messages as long as their packets). The fabric booked the whole receive; the rest is taken
    back from its ledger."""
    used = np.flatnonzero(rows[:, 0])
    m = int(used[-1]) + 1 if used.size else 0
    if unbook and m < len(rows):
        fabric.stats.unbook_recv(src, fabric.rank, (len(rows) - m) * rows.shape[1] * rows.itemsize)
    return m


@dataclass
class SlotState:
    """What a worker keeps between jobs on one switch program, the same on every worker: the set each slot's
    next use takes (``parity``, flipped by each accepted result), the lanes' rotation over the pool
    (``shift``) and the job counter; also its messages' endpoints (:class:`Link`: receives posted ahead,
    send buffers). The transports of one fabric that talk to the same program share it (both switches: the
    sparse switch's rounds keep their parity and job here too)."""

    parity: np.ndarray
    shift: int = 0
    job: int = 0
    _link: Link | None = None

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

    def link(self, fabric, switch: int, burst: int, width: int) -> Link:
        """The worker's :class:`Link` to the switch, created on first use."""
        if self._link is None:
            self._link = Link(fabric, switch, burst, width)
        return self._link


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

    def run(self, lane_slots: np.ndarray, P: int, pkt_base: int, payload, consume, phase: str,
            rows: int | None = None, short_below: int = 0) -> None:
        """Stream packets ``0..P-1`` of the current job over ``len(lane_slots)`` lanes, at most ``rows``
        packets per message (default and at most ``burst``; real fabrics): :meth:`role`, driven
        by the fabric (:func:`.datagrams.drive`) with the worker's :class:`Link`. Packets
        ``0..short_below-1`` carry no values: on real fabrics they travel header-only, in ``SHORT``
        messages (:func:`.dataplane.short_frame`; ``payload`` and ``consume`` get ``HEADER``-word rows
        for them), and their results come back so, as on a SimFabric with a real fabric's ``message_bytes``
        (a host model's); on SimFabric's own datagrams every packet is a whole row.

        ``payload(pkts, rows)`` fills new rows (their headers are set), ``consume(pkts, rows)`` takes
        accepted results (distinct packet numbers). A lane unanswered for the timer's ``give_up_s`` raises
        :class:`~sparsecomm.errors.FabricTimeout`; the switch's rejection notice, :func:`rejected`'s error;
        any error stops every rank (:func:`abandoning`). Per-phase counts land in ``info[phase]``.
        """
        fab = self.fabric
        link = self.state.link(fab, self.switch, self.burst, HEADER + self.elems)
        info = {"packets": 0, "retransmissions": 0, "results": 0, "ignored": 0}
        with abandoning(fab):
            drive(fab, link.inbox, link.outbox, [self.role(link, lane_slots, P, pkt_base, payload, consume, phase,
                                                           info, rows, short_below)])
            link.finish()
        if self.info.get("job") != self.state.job:
            self.info = {"job": self.state.job}
        self.info[phase] = info

    def role(self, link: Link, lane_slots: np.ndarray, P: int, pkt_base: int, payload, consume, phase: str,
             info: dict, rows: int | None = None, short_below: int = 0):
        """The stream of :meth:`run` as a role (:mod:`sparsecomm.fabric.roles`, :mod:`.datagrams`): it
        yields its messages to the switch (:class:`~.datagrams.Datagram`, each in a buffer of ``link``;
        on SimFabric's padded datagrams each a blocking send (:data:`~.datagrams.SENT`, in the link's one
        :meth:`~Link.spare` buffer): the worker's NIC serialises them; elsewhere up to ``SEND_AHEAD`` lane
        windows of them are in flight) and, per
        result message, a wait bounded by the earliest lane's deadline (:class:`~.datagrams.RecvBy`); a
        wait that ends without the message sends the expired lanes again. Counts go to ``info`` (the
        timeout it ends with too, ``final_timeout``)."""
        fab, st, sw = self.fabric, self.state, self.switch
        L, K = len(lane_slots), self.burst
        sim = self.sim
        padded = sim and fab.message_bytes is None      # SimFabric's datagrams (else as long as their packets)
        short_below = 0 if padded else short_below      # SimFabric's datagrams: the paper's whole rows
        S = K if rows is None or padded else max(1, min(K, int(rows)))     # packets per message sent
        job, rank, n = st.job, fab.rank, fab.world_size
        cap = 1 if padded else SEND_AHEAD * max(1, -(-L // S))
        spare = link.spare() if padded else None
        lane_pkt = np.arange(L, dtype=np.int64)           # outstanding packet per lane (-1: lane done)
        timer = self.timer
        timed = timer.timeout is not None
        lane_rows = np.zeros((L, HEADER + self.elems), dtype=np.int32) if timed else None   # to resend
        lane_deadline = np.full(L, math.inf)
        lane_first = np.zeros(L, dtype=np.float64)
        timeout, threshold, expiries = timer.timeout, timer.threshold, 0

        def send(lanes: np.ndarray, fresh: bool):
            rest = lanes
            if short_below > 0:                          # header-only packets, in messages of their own
                short = lane_pkt[lanes] < short_below
                if short.any():
                    yield from send_short(lanes[short], fresh)
                    rest = lanes[~short]
            for i in range(0, len(rest), S):              # one message of up to S rows per S lanes
                part = rest[i:i + S]
                m = len(part)
                if padded:      # (a blocking send: its one buffer, free again once it returns)
                    buf, msg = spare
                else:
                    j, msg = yield from link.buffer(cap)
                rows = msg[:m]
                if fresh:
                    _headers(rows, part, lane_pkt, lane_slots, st.parity, rank, job, n, pkt_base)
                    payload(lane_pkt[part], rows)
                    if timed:
                        _keep(rows, part, lane_rows)        # (lane_rows[part] = rows, one compiled call)
                else:
                    rows[:] = lane_rows[part]
                if padded:     # one datagram, sent as a blocking send (the worker NIC's serialisation)
                    if m < K:
                        msg[m:] = 0
                    yield Datagram(buf, sw, TAG_UP, hold=SENT)
                else:          # as long as its packets, the send asynchronous (its buffer held until sent)
                    yield Datagram(link.out[j][:m], sw, TAG_UP, hold=("up", j))
            if timed:
                _stamp(lanes, fab.now(), timeout, fresh, lane_deadline, lane_first)
            info["packets"] += len(lanes)

        def send_short(lanes: np.ndarray, fresh: bool):
            for i in range(0, len(lanes), S):            # a SHORT message of up to S header rows per S lanes
                part = lanes[i:i + S]
                j, msg = yield from link.buffer(cap)
                flat, rows = short_frame(msg, len(part))
                if fresh:
                    _headers(rows, part, lane_pkt, lane_slots, st.parity, rank, job, n, pkt_base)
                    payload(lane_pkt[part], rows)
                    if timed:
                        lane_rows[part, :HEADER] = rows
                else:
                    rows[:] = lane_rows[part, :HEADER]
                yield Datagram(link.out[j].view(-1)[:flat.size], sw, TAG_UP, hold=("up", j))

        def expire():
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
            yield from send(expired, False)
            if expiries >= threshold:            # reference client: double after a threshold
                timeout *= 2
                threshold += timer.increment
                expiries = 0

        at, pks, lanes = (np.empty(K, dtype=np.int64) for _ in range(3))    # _accept's outputs
        yield from link.post()
        yield from send(np.arange(L), True)
        done = 0
        while done < P:
            wait = None
            if timed:
                wait = max(_earliest(lane_deadline) - fab.now(), 1e-9)     # (a lane done: inf, _accept)
            yield RecvBy(link.key, _STEP, wait)
            if timed and not link.inbox.ready(link.key):
                yield from expire()
                continue
            rows = link.take(fab, padded, unbook=not sim)
            got, ignored, nxt, rej = _accept(rows, lane_pkt, lane_slots, st.parity, job, pkt_base, P, at, pks,
                                             lanes, lane_deadline)
            if rej >= 0:
                raise rejected(fab, "switch allreduce", int(rows[rej, F_REJECTED]), int(rows[rej, F_REJECTED_COUNT]))
            if got and rows.shape[1] == HEADER and int(pks[:got].max()) >= short_below:
                raise ProtocolError(f"switch allreduce: a header-only result for {phase} packet "
                                    f"{int(pks[:got].max())} of job {job}, which carries values (forged or "
                                    f"corrupted message)")
            info["ignored"] += ignored
            if got:
                consume(pks[:got], rows if got == len(rows) and at[got - 1] == got - 1 else rows[at[:got]])
            yield from link.release()
            done += got
            info["results"] += got
            if nxt:
                yield from send(lanes[:nxt].copy(), True)
        info["final_timeout"] = timeout


@njit(cache=True, nogil=True)
def _earliest(deadline):  # pragma: no cover - numba
    """``deadline.min()`` (a float array of at least one element) in one compiled call, without a ufunc
    reduction's set-up per packet."""
    t = deadline[0]
    for i in range(1, deadline.size):
        if deadline[i] < t:
            t = deadline[i]
    return t


@njit(cache=True, nogil=True)
def _keep(rows, lanes, lane_rows):  # pragma: no cover - numba
    """``lane_rows[lanes] = rows``: the packets just built, kept for their lanes' retransmission."""
    for i in range(lanes.size):
        lane_rows[lanes[i]] = rows[i]


@njit(cache=True, nogil=True)
def _stamp(lanes, now, timeout, fresh, lane_deadline, lane_first):  # pragma: no cover - numba
    """Lanes ``lanes`` were sent at ``now``: each one's deadline is ``now + timeout``; ``fresh`` (a new packet,
    not a retransmission): ``now`` is also when its packet was first sent."""
    t = now + timeout
    for i in range(lanes.size):
        lane_deadline[lanes[i]] = t
        if fresh:
            lane_first[lanes[i]] = now


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
def _accept(rows, lane_pkt, lane_slots, parity, job, pkt_base, P, at, pks, lanes,
            lane_deadline):  # pragma: no cover - numba
    """Take the results in ``rows`` for packets still outstanding, in row order: row ``at[i]`` answers
    packet ``pks[i]``; the lane's slot flips its set and the lane moves to its next packet (``-1``: done, its
    ``lane_deadline`` then ``inf``: the earliest deadline of the lanes still outstanding is the array's minimum).
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
        if pk + L < P:
            lane_pkt[j] = pk + L
        else:
            lane_pkt[j] = -1
            lane_deadline[j] = np.inf
    nxt = 0
    for i in range(got):
        j = pks[i] % L
        if lane_pkt[j] >= 0:
            lanes[nxt] = j
            nxt += 1
    return got, ignored, nxt, rej
