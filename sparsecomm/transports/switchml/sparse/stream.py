"""``sparse-switch`` worker side: the block stream's state machine, one compiled call per message of results.

Phase 3 of :mod:`sparsecomm.transports.switchml.sparse` (its docstring: "Stream"): every lane ``j`` keeps one
packet outstanding on its slot, for the lane's current position ``q``. The switch's result for it (matching
job, slot, set and position: SwitchML's rule, as :meth:`.rounds.Rounds.role` applies it to the other phases)
carries the union's sum of block ``j + q L`` and the minimum next position ``m`` every worker announced; the
worker keeps the sum, flips the slot's set, and sends the packet for position ``m``: its codes and its own next
position in the lane if it holds block ``j + m L`` (OmniReduce's look-ahead, Fei et al. SIGCOMM'21), else a skip
header carrying its pending look-ahead; ``m = NONE`` ends the lane.

A message on a real fabric carries up to ``burst`` results (1024 by default): :func:`_take` runs all of them
(match, check, keep, next packet) in one Numba call, with the lanes' state in arrays (:class:`LaneStream`);
:meth:`.rounds.Rounds.stream` sends the packets it wrote and keeps the timers. The same call on the SimFabric
(one result per message) gives the same packets, sums and modelled times as the row-by-row form it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ....errors import ProtocolError
from .dataplane import (HEADER, JOB_MASK, JOB_SHIFT, KIND_BITS, NONE, SET_SHIFT, SLOT_BITS, T_DATA, T_EMPTY, T_REJECT,
                        T_RESULT, T_RETRANSMIT, T_SKIP)

#: :attr:`LaneStream.counts`, in order: results taken, results ignored (another job, slot or round), packets
#: sent, data packets, skips, blocks kept, lanes still running
RESULTS, IGNORED, PACKETS, DATA, SKIPS, KEPT, LIVE = range(7)
#: :func:`_take`'s outcomes besides ``OK``: a rejection notice, a result whose next position no worker can have
#: announced
OK, REJECTED, FORGED = range(3)


@njit(cache=True, nogil=True)
def _packet(i, j, L, nb, cur, mine, nxt_of, row_of, codes, slots, parity, w0, wslot, out, counts):  # pragma: no cover - numba
    """Write lane ``j``'s packet for its current position into ``out[i]`` (header, then the codes of the block
    this worker holds there, or zeros: a skip, its pending look-ahead in the header)."""
    q = cur[j]
    row = out[i]
    if mine[j] == q:
        b = j + q * L
        following = nxt_of[b]                 # the lane's next non-zero block of this worker, as a position
        nxt = NONE if following >= nb else (following - j) // L
        mine[j] = nxt
        kind = T_DATA
        row[HEADER:] = codes[row_of[b]]
        counts[DATA] += 1
    else:
        nxt = mine[j]
        kind = T_SKIP
        row[HEADER:] = 0
        counts[SKIPS] += 1
    slot = slots[i]
    row[0] = w0 | kind | (parity[slot] << SET_SHIFT)
    row[1] = wslot | slot
    row[2] = q
    row[3] = nxt


@njit(cache=True, nogil=True)
def _first(active, L, nb, cur, mine, nxt_of, row_of, codes, slots, parity, w0, wslot, out, counts):  # pragma: no cover - numba
    """Every running lane's first packet (``active``: the indices of ``out``, whose lane is the same index)."""
    for i in range(active.size):
        _packet(i, active[i], L, nb, cur, mine, nxt_of, row_of, codes, slots, parity, w0, wslot, out, counts)


@njit(cache=True, nogil=True)
def _take(rows, filled, job, index, lanes, slots, parity, out, live, L, nb, cur, mine, nxt_of, row_of, codes,
          w0, wslot, sums, blocks, counts, send, deadline, since, now, timeout, bad):  # pragma: no cover - numba
    """Run a message's ``filled`` result rows in order; return how many packets it wrote (their indices in
    ``send``), and the outcome in ``bad[0]`` (``OK``; ``REJECTED``: row ``bad[1]`` is the switch's notice;
    ``FORGED``: lane ``bad[1]``'s result announced position ``bad[2]`` after ``bad[3]``). The rows before the one
    that stopped it are taken."""
    ns = 0
    bad[0] = OK
    for r in range(filled):
        a = rows[r, 0]
        kind = a & KIND_BITS
        if kind == T_EMPTY:
            continue                                    # an unused row of a burst
        if kind == T_REJECT:
            bad[0] = REJECTED
            bad[1] = r
            return ns
        s = rows[r, 1] & SLOT_BITS
        i = index[s] if s < index.size else -1
        if (kind != T_RESULT and kind != T_RETRANSMIT) or (a >> JOB_SHIFT) & JOB_MASK != job or i < 0 or not live[i]:
            counts[IGNORED] += 1
            continue
        if (a >> SET_SHIFT) & 1 != (out[i, 0] >> SET_SHIFT) & 1 or rows[r, 2] != out[i, 2]:
            counts[IGNORED] += 1                        # a stale result (an earlier round of this slot)
            continue
        counts[RESULTS] += 1
        parity[slots[i]] ^= 1
        j = lanes[i]
        q = cur[j]
        m = rows[r, 3]
        if not (q < m and (m == NONE or j + m * L < nb)) or m > mine[j]:
            bad[0] = FORGED
            bad[1] = j
            bad[2] = m
            bad[3] = q
            return ns
        k = counts[KEPT]
        sums[k] = rows[r, HEADER:]
        blocks[k] = j + q * L
        counts[KEPT] = k + 1
        cur[j] = m
        if m == NONE:
            live[i] = False
            deadline[i] = np.inf
            counts[LIVE] -= 1
        else:
            _packet(i, j, L, nb, cur, mine, nxt_of, row_of, codes, slots, parity, w0, wslot, out, counts)
            send[ns] = i
            ns += 1
            deadline[i] = now + timeout
            since[i] = now
            counts[PACKETS] += 1
    return ns


@dataclass
class LaneStream:
    """One job's stream on ``L`` lanes of ``nb`` blocks: the lanes' positions and this worker's blocks (the
    transport's ``_stream`` fills it), and what the stream keeps (``sums``: row ``i`` block ``blocks[i]``'s).

    ``active``: the lanes that run (their union has a block), index ``i`` of every per-packet array is lane
    ``active[i]``; ``slots[i]`` its switch slot. ``cur[j]``: lane ``j``'s current position; ``mine[j]``: this
    worker's next non-zero position in it (``NONE``: none); ``nxt_of[b]``: this worker's next non-zero block
    after ``b`` in its lane (``>= nb``: none); ``row_of[b]``: block ``b``'s row of ``codes``."""

    L: int
    nb: int
    active: np.ndarray
    slots: np.ndarray
    cur: np.ndarray
    mine: np.ndarray
    nxt_of: np.ndarray
    row_of: np.ndarray
    codes: np.ndarray

    def __post_init__(self) -> None:
        S, k = self.active.size, self.codes.shape[1]
        self.out = np.zeros((S, HEADER + k), dtype=np.int32)        # each lane's packet in flight
        self.live = np.ones(S, dtype=np.bool_)
        self.sums = np.empty((self.nb, k), dtype=np.int32)          # (pages only where written)
        self.blocks = np.empty(self.nb, dtype=np.int64)
        self.counts = np.zeros(7, dtype=np.int64)
        self.counts[LIVE] = S
        self.send = np.empty(S, dtype=np.int64)
        self.bad = np.zeros(4, dtype=np.int64)

    def first(self, parity: np.ndarray, w0: int, wslot: int) -> None:
        """Every running lane's first packet into :attr:`out`."""
        _first(self.active, self.L, self.nb, self.cur, self.mine, self.nxt_of, self.row_of, self.codes, self.slots,
               parity, w0, wslot, self.out, self.counts)

    def take(self, rows: np.ndarray, filled: int, job: int, index: np.ndarray, parity: np.ndarray, w0: int,
             wslot: int, deadline: np.ndarray, since: np.ndarray, now: float, ahead: float) -> np.ndarray:
        """Run a message's ``filled`` result rows (:func:`_take`; ``index[slot]``: the slot's lane index or -1,
        ``parity``: every slot's set, flipped by each result taken); return the indices of the packets it wrote
        into :attr:`out`, to send in that order, their timers at ``now + ahead``. A rejection notice or a forged
        next position stops it: :attr:`bad` says which (:meth:`forged`)."""
        ns = _take(rows, filled, job, index, self.active, self.slots, parity, self.out, self.live, self.L, self.nb,
                   self.cur, self.mine, self.nxt_of, self.row_of, self.codes, w0, wslot, self.sums, self.blocks,
                   self.counts, self.send, deadline, since, now, ahead, self.bad)
        return self.send[:ns].copy()

    def kept(self) -> tuple[list[int], np.ndarray]:
        """The blocks summed, in the order their results came, and their sums."""
        k = int(self.counts[KEPT])
        return self.blocks[:k].tolist(), self.sums[:k]

    def forged(self) -> ProtocolError:
        """The error of a result whose next position :func:`_take` refused (``bad``)."""
        j, m, q = (int(v) for v in self.bad[1:])
        at = "none" if self.mine[j] == NONE else f"position {int(self.mine[j])}"
        return ProtocolError(f"sparse-switch: lane {j}'s result announces next position {m} after {q}, which skips "
                             f"this worker's next block in the lane ({at}) or leaves the lane (forged or corrupted "
                             f"packet)")
