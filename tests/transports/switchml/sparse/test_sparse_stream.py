"""The sparse switch's stream phase, one message of results at a time (:mod:`...sparse.stream`): a burst whose rows
mix a result taken, another job's, an unused row and a stale round gives the counts, kept sums, flipped sets and
next packets the protocol says; a next position past the lane and a rejection notice stop it, naming what."""

from __future__ import annotations

import math

import numpy as np

from sparsecomm.transports.switchml.sparse.dataplane import (HEADER, JOB_SHIFT, NONE, SET_SHIFT, T_DATA, T_REJECT,
                                                             T_RESULT, T_SKIP)
from sparsecomm.transports.switchml.sparse.stream import (DATA, FORGED, IGNORED, KEPT, LIVE, OK, PACKETS, REJECTED,
                                                          RESULTS, SKIPS, LaneStream)

K, L, NB, JOB = 4, 2, 6, 9
SLOTS = np.array([5, 6])
W0, WSLOT = (JOB << JOB_SHIFT) | (1 << 4), 0      # this worker's bits of W0 (worker 1) and of the slot word


def _stream():
    """Lanes 0 (blocks 0, 2, 4) and 1 (blocks 1, 3, 5); this worker holds blocks 0, 3 and 4; the union starts at
    position 0 in both lanes."""
    codes = np.array([[10] * K, [30] * K, [40] * K], dtype=np.int32)          # blocks 0, 3, 4
    row_of = np.full(NB, -1, dtype=np.int64)
    row_of[[0, 3, 4]] = [0, 1, 2]
    nxt_of = np.array([4, NB, NB, NB, NB, NB], dtype=np.int64)           # its next block in the lane after b
    ls = LaneStream(L, NB, np.arange(2), SLOTS.copy(), cur=np.array([0, 0]), mine=np.array([0, 1]),
                    nxt_of=nxt_of, row_of=row_of, codes=codes)
    parity = np.zeros(8, dtype=np.int64)
    ls.first(parity, W0, WSLOT)
    index = np.full(8, -1, dtype=np.int64)
    index[SLOTS] = [0, 1]
    return ls, parity, index


def _row(kind, job, slot, set_, pos, nxt, value=0):
    return [kind | (set_ << SET_SHIFT) | (job << JOB_SHIFT), slot, pos, nxt] + [value] * K


def _take(ls, parity, index, rows):
    rows = np.array(rows, dtype=np.int32)
    S = ls.active.size
    return ls.take(rows, len(rows), JOB, index, parity, W0, WSLOT, np.full(S, math.inf), np.zeros(S), 1.0, 0.5)


def test_first_packets_are_a_block_with_its_look_ahead_or_a_skip_with_the_pending_one():
    ls, parity, _ = _stream()
    assert ls.out[0, :HEADER].tolist() == [W0 | T_DATA, 5, 0, 2] and ls.out[0, HEADER:].tolist() == [10] * K
    assert ls.out[1, :HEADER].tolist() == [W0 | T_SKIP, 6, 0, 1] and ls.out[1, HEADER:].tolist() == [0] * K
    assert ls.counts[DATA] == 1 and ls.counts[SKIPS] == 1


def test_a_burst_takes_its_results_and_ignores_another_job_an_unused_row_and_a_stale_round():
    ls, parity, index = _stream()
    sent = _take(ls, parity, index, [
        _row(T_RESULT, JOB, 5, 0, 0, 1, value=7),        # lane 0's round: taken, next position 1
        _row(T_RESULT, JOB + 1, 6, 0, 0, 1),             # another job's
        [0] * (HEADER + K),                               # an unused row of the burst
        _row(T_RESULT, JOB, 6, 1, 0, 1),                 # slot 6's other set: a stale round
        _row(T_RESULT, JOB, 6, 0, 0, 1, value=8),        # lane 1's round: taken
    ])
    assert ls.bad[0] == OK
    assert sent.tolist() == [0, 1]
    assert (ls.counts[RESULTS], ls.counts[IGNORED], ls.counts[PACKETS], ls.counts[KEPT]) == (2, 2, 2, 2)
    blocks, sums = ls.kept()
    assert blocks == [0, 1] and sums.tolist() == [[7] * K, [8] * K]
    assert parity[5] == 1 and parity[6] == 1
    set1 = 1 << SET_SHIFT
    # lane 0 at position 1 (block 2: not this worker's): a skip announcing its block 4 (position 2)
    assert ls.out[0, :HEADER].tolist() == [W0 | T_SKIP | set1, 5, 1, 2]
    # lane 1 at position 1 (block 3: this worker's, its last in the lane)
    assert ls.out[1, :HEADER].tolist() == [W0 | T_DATA | set1, 6, 1, NONE] and ls.out[1, HEADER:].tolist() == [30] * K
    # a lane whose result says NONE ends: no packet, one lane fewer
    sent = _take(ls, parity, index, [_row(T_RESULT, JOB, 6, 1, 1, NONE, value=3)])
    assert sent.tolist() == [] and ls.counts[LIVE] == 1 and not ls.live[1]
    assert _take(ls, parity, index, [_row(T_RESULT, JOB, 6, 0, 1, NONE)]).tolist() == []
    assert ls.counts[IGNORED] == 3                    # the ended lane's slot takes nothing more


def test_a_next_position_past_this_workers_block_or_the_lane_is_forged_and_a_notice_stops_the_burst():
    ls, parity, index = _stream()
    _take(ls, parity, index, [_row(T_RESULT, JOB, 5, 0, 0, 2)])     # lane 0 -> position 2 (block 4: mine)
    _take(ls, parity, index, [_row(T_RESULT, JOB, 5, 1, 2, 3)])     # position 3 is block 6: past the tensor
    assert ls.bad[0] == FORGED and ls.bad[1:].tolist() == [0, 3, 2]
    assert "lane 0's result announces next position 3 after 2" in str(ls.forged())
    ls, parity, index = _stream()
    _take(ls, parity, index, [_row(T_RESULT, JOB, 6, 0, 0, 2)])     # skips this worker's block 3 (position 1)
    assert ls.bad[0] == FORGED and "this worker's next block in the lane (position 1)" in str(ls.forged())
    ls, parity, index = _stream()
    _take(ls, parity, index, [_row(T_RESULT, JOB, 5, 0, 0, 1), _row(T_REJECT, JOB, 0, 0, 0, 0)])
    assert ls.bad[0] == REJECTED and ls.bad[1] == 1 and ls.counts[RESULTS] == 1
