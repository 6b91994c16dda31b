"""``sparse-switch`` worker side: self-clocked rounds on switch slots with SwitchML's loss recovery, and the
packets they carry (which switch program a transport talks to: :func:`..control.started_program`).

The transport (one job top to bottom, its control, look-ahead and stream phases) is
:mod:`sparsecomm.transports.switchml.sparse`; the wire format and the switch program are
:mod:`.dataplane`. A round is one packet per slot outstanding: its result (matching job, slot, set and position) flips the slot's parity
and clocks the lane's next packet; a packet unanswered within the timer is resent unchanged (the
switch's seen-bitmap absorbs a duplicate, a duplicate after completion gets the stored result), the
timer doubling after ``timeout_threshold`` expiries (Sapio et al., NSDI'21, Sec. 4; the p4app-switchML
client's rule). A phase's rounds are one role (:meth:`Rounds.role`, :mod:`sparsecomm.fabric.roles`) that
yields its packets as :class:`.requests.Datagram` and waits for results with :class:`.requests.RecvFor` (its
timer); :meth:`Rounds.run` has ``Fabric.drive`` run it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ....errors import FabricTimeout
from ....fabric.roles import Flush, Inbox, Outbox, Pool, Step
from .dataplane import (F_POS, F_SLOT, HEADER, JOB_MASK, JOB_SHIFT, KIND_BITS, NONE, OUT_OF_STEP, SET_SHIFT, SLOT_BITS,
                        T_EMPTY, T_REJECT, T_RESULT, T_RETRANSMIT, T_SKIP, TAG_DOWN, TAG_SKIP, TAG_UP, W0, Header,
                        refusal)
from ..lanes import SlotState, Timer, abandoning, message_rows, rejected
from .requests import Datagram, RecvFor, lowered
from .stream import FORGED, IGNORED, LIVE, PACKETS, REJECTED, RESULTS, LaneStream

_UP, _DOWN = "up", "down"      # what the worker's packets are held under; the key of its receive of results
_STAGE = Step(0, reaps=True)   # the one role's wait for results: its sends are reaped first
_KEEP = 64                     # sends left unreaped (real fabrics: bursts in flight)


class Rounds:
    """One worker's rounds on the sparse switch rank ``switch``: ``elems`` values per value packet, up to
    ``burst`` packets per fabric message, the retransmission ``timer``, the program's ``state``
    (:class:`~..lanes.SlotState`: each slot's parity, the job counter, the lanes' rotation). ``info``
    holds the last job's per-phase counts (packets, retransmissions, results, ignored)."""

    def __init__(self, fabric, switch: int, state: SlotState, elems: int, burst: int, timer: Timer) -> None:
        self.fabric, self.switch, self.state = fabric, switch, state
        self.elems, self.burst, self.timer = elems, burst, timer
        self.sim = fabric.modelled_time
        self.info: dict = {}
        self.pool = Pool()
        self._sender: tuple[int, int, int] | None = None     # (job, its W0 and SLOT words' sender bits)
        #: the receive buffer of results (``burst`` rows), the same for every phase and job that ends cleanly: a
        #: megabyte on real fabrics, zeroed once rather than per phase (:meth:`run`)
        self._buf: torch.Tensor | None = None

    def packet(self, kind: int, slot: int, pos: int, nxt: int, vec: np.ndarray | None = None) -> np.ndarray:
        """A packet for ``slot``'s next round (the set is the slot's current parity): :class:`.dataplane.Header`'s
        layout, its words formed here (once per packet)."""
        st = self.state
        w0, wslot = self._sender_words()
        if kind == T_SKIP:
            row = np.empty(HEADER, dtype=np.int32)
        else:
            row = np.empty(HEADER + self.elems, dtype=np.int32)
            row[HEADER:] = vec
        row[:HEADER] = (w0 | kind | (int(st.parity[slot]) << SET_SHIFT), wslot | slot, pos, nxt)
        return row

    def _datagrams(self, rows: np.ndarray):
        """Send the packets ``rows`` (one a row, a skip's values zero), in order, as a role's requests: on SimFabric
        with one packet a message one datagram each, waited for as it leaves (:class:`~sparsecomm.fabric.roles.Flush`:
        the worker's NIC serialises them, and its timers start from its clock), a skip as its 16-byte header on its
        own tag; elsewhere ``burst`` rows a message, as long as its packets (a receive of ``burst`` rows takes it
        into a prefix), but on a SimFabric without real hosts' messages (``message_bytes`` None) padded to its
        receive's shape."""
        sim, sw, K = self.sim, self.switch, self.burst
        for c in range(0, len(rows), K):
            part = rows[c:c + K]
            if sim and K == 1:
                row = part[0]
                skip = row[W0] & KIND_BITS == T_SKIP
                yield Datagram(torch.from_numpy(row[:HEADER] if skip else row), sw, TAG_SKIP if skip else TAG_UP,
                               hold=_UP)
                yield Flush(_UP)
                continue
            if sim and self.fabric.message_bytes is None and len(part) < K:
                part = np.concatenate([part, np.zeros((K - len(part), rows.shape[1]), dtype=np.int32)])
            m = torch.from_numpy(part)
            if sim:
                yield Datagram(m, sw, TAG_UP, hold=_UP)
                yield Flush(_UP)
            else:
                yield Datagram(m, sw, TAG_UP)

    def _counts(self, phase: str) -> dict:
        """A fresh record of ``phase``'s packet counts in :attr:`info` (a new job's record starts at its control
        phase, or at the first phase of another job)."""
        info = {"packets": 0, "retransmissions": 0, "results": 0, "ignored": 0}
        if phase == "control" or self.info.get("job") != self.state.job:
            self.info = {"job": self.state.job}
        self.info[phase] = info
        return info

    def _take_buffer(self) -> torch.Tensor:
        """The receive buffer of results (``burst`` rows, every row ``T_EMPTY``), this phase's until its loop ends
        with every receive taken (it then puts it back in ``_buf``): a phase that raises (or is closed) leaves it
        behind, a receive perhaps still posted into it, and the next phase makes another."""
        buf, self._buf = self._buf, None
        shape = (self.burst, HEADER + self.elems)
        if buf is None or buf.shape != shape:
            buf = torch.zeros(shape, dtype=torch.int32)
        buf.numpy()[:, W0] = 0
        return buf

    def _sender_words(self) -> tuple[int, int]:
        """This worker's bits of a packet's W0 and SLOT words (worker, n, job: fixed for a job)."""
        st, sender = self.state, self._sender
        if sender is None or sender[0] != st.job:
            h = Header(0, 0, self.fabric.rank, self.fabric.world_size, st.job & JOB_MASK, 0, 0, 0).write(
                np.zeros(HEADER, dtype=np.int32))
            sender = self._sender = (st.job, int(h[W0]), int(h[F_SLOT]))
        return sender[1], sender[2]

    def run(self, slots: np.ndarray, rows: list[np.ndarray], on_result, phase: str) -> None:
        """The rounds of :meth:`role` on this worker, run by ``Fabric.drive`` (its datagrams and timed receives
        lowered by :func:`.requests.lowered`); every send has completed when it returns. Any error stops every
        rank (:func:`..lanes.abandoning`: the others would wait for this worker's packets)."""
        self._drive(self.role(slots, rows, on_result, phase))

    def stream(self, ls: LaneStream) -> None:
        """The stream phase's rounds (:mod:`.stream`: the lanes' state machine, a message's results in one
        compiled call) on this worker, run by ``Fabric.drive`` as :meth:`run` runs the others'."""
        self._drive(self.stream_role(ls))

    def _drive(self, role) -> None:
        fab = self.fabric
        inbox, outbox = Inbox(fab, self.pool), Outbox(fab, self.pool)
        with abandoning(fab):
            fab.drive([lowered(role, fab, inbox, outbox, _KEEP)], inbox, outbox, keep=_KEEP)
            outbox.finish()

    def role(self, slots: np.ndarray, rows: list[np.ndarray], on_result, phase: str):
        """Self-clocked rounds on ``slots`` (one outstanding packet each), with SwitchML's loss recovery, as a
        role (:mod:`sparsecomm.fabric.roles`, with :class:`.requests.Datagram` and :class:`.requests.RecvFor`).

        ``rows[i]`` is the first packet on ``slots[i]``; when its result arrives (matching job, slot,
        set and position) the slot's parity flips and ``on_result(lane, result)`` returns the lane's
        next packet, or ``None`` when the lane is done (``lane`` = ``i``; ``result`` is the
        row in the receive buffer, valid until ``on_result`` returns: it copies what it keeps). A
        packet unanswered within the timer is resent unchanged; after ``threshold`` expiries the timer
        doubles; unanswered for ``give_up_s`` raises :class:`FabricTimeout`. The switch's rejection
        notice raises :func:`..lanes.rejected`'s error. Packets go up as datagrams (``reliable=False``): on
        SimFabric one per message, each waited for as it leaves (:class:`~sparsecomm.fabric.roles.Flush`: the
        worker's NIC serialises them, and its timers start from its clock), skips as 16-byte headers on their
        own tag; elsewhere ``burst`` rows per message, reaped by the scheduler.
        """
        fab, st, sw, K = self.fabric, self.state, self.switch, self.burst
        k, sim, timer = self.elems, self.sim, self.timer
        S = len(slots)
        index = {int(s): i for i, s in enumerate(slots)}
        out: list[np.ndarray | None] = list(rows)
        deadline = np.full(S, math.inf)
        since = np.zeros(S)
        timeout, threshold, expiries = timer.timeout, timer.threshold, 0
        info = self._counts(phase)

        queue: list[np.ndarray] = []

        def send(i: int, fresh: bool):
            queue.append(out[i])
            now = fab.now()
            deadline[i] = now + (timeout if timeout is not None else math.inf)
            if fresh:
                since[i] = now
            info["packets"] += 1
            if K == 1:
                yield from flush()

        def flush():
            """The queued packets (:meth:`_datagrams`)."""
            if queue:
                rows = np.zeros((len(queue), HEADER + k), dtype=np.int32)      # (a skip: its header, zeros)
                for r, row in enumerate(queue):
                    rows[r, :row.size] = row
                queue.clear()
                yield from self._datagrams(rows)

        for i in range(S):
            yield from send(i, True)
        yield from flush()
        live = S
        buf = self._take_buffer()
        msg_rows = buf.numpy()
        while live:
            wait = None if timeout is None else max(float(deadline.min()) - fab.now(), 1e-9)
            src = yield RecvFor(_DOWN, buf, sw, TAG_DOWN, wait, _STAGE)
            if src is None:                            # the timer expired
                now = fab.now()
                for i in np.flatnonzero(deadline <= now + 1e-12):
                    if now - since[i] > timer.give_up_s:
                        raise _unanswered(fab, phase, int(slots[i]), st.job, now - since[i])
                    expiries += 1
                    info["retransmissions"] += 1
                    yield from send(int(i), False)
                yield from flush()
                if expiries >= threshold:
                    timeout *= 2
                    threshold += timer.increment
                    expiries = 0
                continue
            filled = len(msg_rows) if sim else message_rows(fab, sw, msg_rows)
            job = st.job & JOB_MASK
            taken = info["results"]
            for res in msg_rows[:filled]:
                w0, word, pos, _ = res[:HEADER].tolist()    # (Header.of's fields, read once per result)
                kind = w0 & KIND_BITS
                if kind == T_EMPTY:
                    continue                       # an unused row of a burst
                if kind == T_REJECT:               # the switch dropped packets it cannot take: the job is over
                    raise _rejection(fab, res)
                i = index.get(word & SLOT_BITS)
                if ((kind != T_RESULT and kind != T_RETRANSMIT) or (w0 >> JOB_SHIFT) & JOB_MASK != job or i is None
                        or out[i] is None):
                    info["ignored"] += 1
                    continue
                sent = out[i]
                if (w0 >> SET_SHIFT) & 1 != (int(sent[W0]) >> SET_SHIFT) & 1 or pos != int(sent[F_POS]):
                    info["ignored"] += 1           # a stale result (an earlier round of this slot)
                    continue
                info["results"] += 1
                st.parity[slots[i]] ^= 1
                out[i] = on_result(i, res)
                if out[i] is None:
                    deadline[i] = math.inf
                    live -= 1
                else:
                    yield from send(i, True)
            msg_rows[:filled, W0] = 0              # every row T_EMPTY again: the next message may be shorter
            fab.host_work("sparse_switch_round", info["results"] - taken)    # (its work per result: sim_host)
            yield from flush()
        self._buf = buf

    def stream_role(self, ls: LaneStream):
        """The stream phase's rounds as a role: :meth:`role`'s rounds, timers and sends, with each message's
        results run by :func:`.stream._take` (match, keep, next packet) in one call and the lanes' packets in
        ``ls.out``. On SimFabric (one result per message) the same packets, sums, clock and counts as
        :meth:`role` with the lanes' ``on_result`` would give."""
        fab, st, sw, K = self.fabric, self.state, self.switch, self.burst
        sim, timer = self.sim, self.timer
        S = ls.active.size
        timeout, threshold, expiries = timer.timeout, timer.threshold, 0
        ahead = math.inf if timeout is None else timeout
        info = self._counts("stream")
        counts = ls.counts
        w0, wslot = self._sender_words()
        ls.first(st.parity, w0, wslot)
        index = np.full(st.parity.size, -1, dtype=np.int64)
        index[ls.slots] = np.arange(S)
        deadline = np.full(S, math.inf)
        since = np.zeros(S)
        out = ls.out

        def arm(idx: np.ndarray, fresh: bool) -> None:
            now = fab.now()
            deadline[idx] = now + ahead
            if fresh:
                since[idx] = now
            counts[PACKETS] += len(idx)

        def flush(idx: np.ndarray):
            """The packets ``out[idx]``, in order (:meth:`_datagrams`)."""
            if len(idx):
                yield from self._datagrams(out[idx])

        everyone = np.arange(S)
        if K == 1:                                  # (as role: each packet flushed as it is sent)
            for i in range(S):
                arm(everyone[i:i + 1], True)
                yield from flush(everyone[i:i + 1])
        else:
            arm(everyone, True)
            yield from flush(everyone)
        buf = self._take_buffer()
        msg_rows = buf.numpy()
        job = st.job & JOB_MASK
        while counts[LIVE]:
            wait = None if timeout is None else max(float(deadline.min()) - fab.now(), 1e-9)
            src = yield RecvFor(_DOWN, buf, sw, TAG_DOWN, wait, _STAGE)
            if src is None:                            # the timer expired
                now = fab.now()
                late = np.flatnonzero(deadline <= now + 1e-12)
                for i in late:
                    if now - since[i] > timer.give_up_s:
                        raise _unanswered(fab, "stream", int(ls.slots[i]), st.job, now - since[i])
                    expiries += 1
                    info["retransmissions"] += 1
                    if K == 1:                      # (as role: each packet flushed as it is sent)
                        one = np.array([i])
                        arm(one, False)
                        yield from flush(one)
                if K != 1:
                    arm(late, False)
                    yield from flush(late)
                if expiries >= threshold:
                    timeout *= 2
                    ahead = timeout
                    threshold += timer.increment
                    expiries = 0
                continue
            filled = len(msg_rows) if sim else message_rows(fab, sw, msg_rows)
            taken = int(counts[RESULTS])
            sent = ls.take(msg_rows, filled, job, index, st.parity, w0, wslot, deadline, since, fab.now(), ahead)
            if ls.bad[0] == REJECTED:
                raise _rejection(fab, msg_rows[ls.bad[1]])
            if ls.bad[0] == FORGED:
                raise ls.forged()
            if K == 1:
                yield from flush(sent)
            msg_rows[:filled, W0] = 0              # every row T_EMPTY again: the next message may be shorter
            fab.host_work("sparse_switch_round", int(counts[RESULTS]) - taken)    # (its work per result: sim_host)
            if K != 1:
                yield from flush(sent)
        info.update(packets=int(counts[PACKETS]), results=int(counts[RESULTS]), ignored=int(counts[IGNORED]))
        self._buf = buf


def _unanswered(fab, phase: str, slot: int, job: int, waited: float) -> FabricTimeout:
    """The error of a packet unanswered past the timer's ``give_up_s``, despite retransmissions."""
    return FabricTimeout(f"worker {fab.rank}: sparse-switch {phase} packet on slot {slot} of job {job} unanswered for "
                         f"{waited:.3g} s despite retransmissions: a peer or the switch is gone")


def _rejection(fab, res: np.ndarray) -> Exception:
    """The error of the switch's rejection notice ``res``: it dropped packets it cannot take."""
    h = Header.of(res)
    out_of_step = h.pos == OUT_OF_STEP
    return rejected(fab, "sparse-switch allreduce", h.worker, h.next, out_of_step, refusal(res) if out_of_step else None)


def to_pos(blocks: np.ndarray, lanes: np.ndarray, L: int, nb: int) -> np.ndarray:
    """Lane positions of block ids (``nb``, the look-ahead's "none", becomes ``NONE``)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return np.where(blocks >= nb, NONE, (blocks - lanes) // L)

