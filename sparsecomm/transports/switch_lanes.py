"""SwitchML worker side: the self-clocked packet stream of one phase of a job, with loss recovery.

Split from :mod:`.switch` (the transport: job set-up, quantisation, the control handshake); the wire
format and the switch program are in :mod:`.switch_dataplane`.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from ..errors import FabricTimeout
from .switch_dataplane import (EXP_MIN, F_EXP, F_JOB, F_NW, F_PKT, F_SET, F_SLOT, F_TYPE, F_WORKER, HEADER,
                               T_DATA, T_RESULT, T_RETRANSMIT, TAG_DOWN, TAG_UP)


def run_lanes(t, lane_slots: np.ndarray, P: int, pkt_base: int, payload, consume, phase: str) -> None:
    """Self-clocked streaming of packets ``0..P-1`` of transport ``t``'s current job over
    ``len(lane_slots)`` lanes (switch slots), with retransmission (Sapio et al., NSDI'21, Sec. 4).

    Packet ``p`` goes on lane ``p % L``; the lane's next packet ``p + L`` is sent when ``p``'s result
    arrives. ``payload(pkts, rows)`` fills new rows, ``consume(pkts, rows)`` takes accepted results.
    A lane whose result does not come within ``t.timeout`` is resent (the timeout doubles after
    ``t.timeout_threshold`` expiries, as the reference client does); one unanswered for ``t.give_up_s``
    raises :class:`~sparsecomm.errors.FabricTimeout`. Per-phase counts land in ``t.last_info[phase]``.
    """
    fab, st, sw = t.fabric, t._state, t.switch
    L, E, K = len(lane_slots), t.slot_elems, t.burst
    width = HEADER + E
    job, rank, n = st.job, fab.rank, fab.world_size
    lane_pkt = np.arange(L, dtype=np.int64)           # outstanding packet per lane (-1: lane done)
    lane_rows = np.zeros((L, width), dtype=np.int32)  # what was sent, for retransmission
    lane_deadline = np.zeros(L, dtype=np.float64)
    lane_first = np.zeros(L, dtype=np.float64)
    timeout, threshold, expiries = t.timeout, t.timeout_threshold, 0
    info = {"packets": 0, "retransmissions": 0, "results": 0, "ignored": 0}
    pending: deque = deque()

    def send(lanes: np.ndarray, fresh: bool) -> None:
        if fresh:
            pk = lane_pkt[lanes]
            rows = np.zeros((len(lanes), width), dtype=np.int32)
            slots = lane_slots[lanes]
            rows[:, F_TYPE] = T_DATA
            rows[:, F_SLOT] = slots
            rows[:, F_SET] = st.parity[slots]
            rows[:, F_WORKER] = rank
            rows[:, F_PKT] = pk + pkt_base
            rows[:, F_JOB] = job
            rows[:, F_NW] = n
            rows[:, F_EXP] = EXP_MIN
            payload(pk, rows)
            lane_rows[lanes] = rows
        else:
            rows = lane_rows[lanes]
        for i in range(0, len(rows), K):
            part = rows[i:i + K]
            if len(part) < K:
                part = np.concatenate([part, np.zeros((K - len(part), width), dtype=np.int32)])
            msg = torch.from_numpy(np.ascontiguousarray(part))
            if t.sim:       # a blocking send models the worker's NIC serialisation
                fab.send(msg, sw, TAG_UP, reliable=False)
            else:              # gloo sends complete only when the switch posts its receive
                pending.append((fab.isend(msg, sw, TAG_UP, reliable=False), msg))
                while len(pending) > 4 * max(1, L // K):
                    pending.popleft()[0].wait()
        now = fab.now()
        lane_deadline[lanes] = now + (timeout if timeout is not None else math.inf)
        if fresh:
            lane_first[lanes] = now
        info["packets"] += len(lanes)

    send(np.arange(L), True)
    rbuf = torch.zeros((K, width), dtype=torch.int32)
    rarr = rbuf.numpy()
    done = 0
    while done < P:
        active = lane_pkt >= 0
        try:
            if timeout is None:   # no timer (reliable fabric): the fabric's timeout_s bounds the wait
                fab.recv(rbuf, sw, TAG_DOWN)
            else:
                wait = float(lane_deadline[active].min()) - fab.now()
                fab.recv(rbuf, sw, TAG_DOWN, timeout=max(wait, 1e-9))
        except FabricTimeout:
            if timeout is None:
                raise
            now = fab.now()
            expired = np.nonzero(active & (lane_deadline <= now + 1e-12))[0]
            if len(expired) == 0:
                continue
            stale = expired[now - lane_first[expired] > t.give_up_s]
            if len(stale):
                p = int(lane_pkt[stale[0]])
                raise FabricTimeout(
                    f"worker {rank}: switch {phase} packet {p} of job {job} unanswered for "
                    f"{now - lane_first[stale[0]]:.3g} s despite retransmissions: a peer or the switch "
                    f"is gone, or workers disagree on pool_size / slot_elems") from None
            expiries += len(expired)
            info["retransmissions"] += len(expired)
            send(expired, False)
            if expiries >= threshold:            # reference client: double after a threshold
                timeout *= 2
                threshold += t.timeout_increment
                expiries = 0
            continue
        kinds = rarr[:, F_TYPE]
        ok = ((kinds == T_RESULT) | (kinds == T_RETRANSMIT)) & (rarr[:, F_JOB] == job)
        pk = rarr[:, F_PKT].astype(np.int64) - pkt_base
        ok &= (pk >= 0) & (pk < P)
        lanes = np.where(ok, pk % L, 0)
        ok &= lane_pkt[lanes] == pk
        info["ignored"] += int(((kinds == T_RESULT) | (kinds == T_RETRANSMIT)).sum() - ok.sum())
        if not ok.any():
            continue
        pk, lanes, rows = pk[ok], lanes[ok], rarr[ok]
        pk, first = np.unique(pk, return_index=True)
        lanes, rows = lanes[first], rows[first]
        consume(pk, rows)
        done += len(pk)
        info["results"] += len(pk)
        st.parity[lane_slots[lanes]] ^= 1
        nxt = pk + L
        more = nxt < P
        lane_pkt[lanes] = np.where(more, nxt, -1)
        if more.any():
            send(lanes[more], True)
    while pending:
        pending.popleft()[0].wait()
    info["final_timeout"] = timeout
    if t.last_info.get("job") != job:
        t.last_info = {"job": job}
    t.last_info[phase] = info
