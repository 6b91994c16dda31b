"""The sparse switch's compiled per-packet program against the module docstring's pseudocode, written out here
in Python over the same registers: random packet streams (new contributions, duplicates, both sets, MIN rounds,
skips, out-of-step and malformed packets, bitmaps of one and several words) give the same registers, replies
and counters, packet by packet."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sparsecomm.transports.switchml.sparse import dataplane as dp


class Reference:
    """The module docstring's program, one packet at a time, in Python (registers as :class:`dp.Dataplane`'s)."""

    def __init__(self, cfg: dp.SparseSwitchConfig, world: int | None) -> None:
        s, k = cfg.slots, cfg.elems
        self.cfg, self.world = cfg, world
        self.values = np.zeros((s, 2, k), dtype=np.int32)
        self.seen = np.zeros((s, 2, cfg.width // 64), dtype=np.uint64)
        self.count = np.zeros((s, 2), dtype=np.int16)
        self.nxt = np.zeros((s, 2), dtype=np.int32)
        self.pos = np.zeros((s, 2), dtype=np.int32)
        self.held = np.zeros((s, 2), dtype=np.bool_)
        self.stats: Counter = Counter()
        self.refused = None

    def process(self, row):
        cfg = self.cfg
        h = dp.Header.of(row)
        kind, v, w, n, slot, p, m = h.kind, h.set, h.worker, h.n, h.slot, h.pos, h.next
        ok = (kind in dp.TYPES_UP and 0 <= slot < cfg.slots and 0 <= w < n <= cfg.width and h.rest == 0
              and (self.world is None or n == self.world)
              and row.shape[0] == (dp.HEADER if kind == dp.T_SKIP else dp.HEADER + cfg.elems)
              and 0 <= p and (kind == dp.T_MIN or p < m))
        self.stats["packets"] += 1
        if not ok:
            self.stats["malformed"] += 1
            return None, None
        u, bit = w // 64, np.uint64(1 << (w % 64))
        before = self.seen[slot, v, u]
        if self.count[slot, v] and not before & bit and self.pos[slot, v] != p:
            self.stats["out_of_step"] += 1
            self.refused = (slot, p, int(self.pos[slot, v]), int(before), u)
            return None, None
        self.seen[slot, v, u] = before | bit
        self.seen[slot, 1 - v, u] &= ~bit
        if not before & bit:
            vec = row[dp.HEADER:]
            if self.count[slot, v] == 0:
                self.values[slot, v] = 0 if kind == dp.T_SKIP else vec
                self.nxt[slot, v], self.pos[slot, v] = m, p
                self.held[slot, v] = kind != dp.T_SKIP
                self.count[slot, v] = n - 1
            else:
                acc = self.values[slot, v]
                if kind == dp.T_MIN:
                    np.minimum(acc, vec, out=acc)
                elif kind == dp.T_DATA:
                    wide = acc.astype(np.int64) + vec
                    if wide.max(initial=0) > 2**31 - 1 or wide.min(initial=0) < -(2**31):
                        self.stats["overflow"] += 1
                    acc += vec
                if m < self.nxt[slot, v]:
                    self.nxt[slot, v] = m
                self.held[slot, v] |= kind != dp.T_SKIP
                self.count[slot, v] -= 1
            self.stats["consumed"] += 1
            if self.count[slot, v] == 0:
                if not self.held[slot, v]:
                    self.stats["empty"] += 1
                self.stats["multicast"] += 1
                return self._result(row, slot, v, dp.T_RESULT), None
            return None, None
        if self.count[slot, v] == 0:
            self.stats["retransmit"] += 1
            return None, self._result(row, slot, v, dp.T_RETRANSMIT)
        self.stats["dropped"] += 1
        return None, None

    def _result(self, row, slot, v, kind):
        out = np.empty(dp.HEADER + self.cfg.elems, dtype=np.int32)
        h = dp.Header.of(row)
        h._replace(kind=kind, set=v, slot=slot, pos=int(self.pos[slot, v]), next=int(self.nxt[slot, v])).write(out)
        out[dp.HEADER:] = self.values[slot, v]
        return out


def _packet(rng, kind, v, w, nw, slot, pos, nxt, k, width=None):
    width = width if width is not None else (dp.HEADER if kind == dp.T_SKIP else dp.HEADER + k)
    row = np.zeros(width, dtype=np.int32)
    dp.Header(kind, v, w, nw, 1, slot, pos, nxt).write(row)
    hi = 2**31 - 1 if rng.random() < 0.3 else 1000     # values near the int32 range: some adds wrap
    row[dp.HEADER:] = rng.integers(-hi, hi, size=width - dp.HEADER, dtype=np.int64).astype(np.int32)
    return row


def _noise(rng, n, cfg):
    """A packet of random fields: malformed, out of step, a duplicate or a stray contribution."""
    k = cfg.elems
    kind = int(rng.choice([dp.T_DATA, dp.T_SKIP, dp.T_MIN, dp.T_RESULT]))
    pos = int(rng.integers(0, 4))
    nxt = int(rng.integers(pos + 1, pos + 5)) if rng.random() > 0.1 else pos
    width = (dp.HEADER if kind == dp.T_SKIP else dp.HEADER + k) + (1 if rng.random() < 0.1 else 0)
    row = _packet(rng, kind, int(rng.integers(0, 2)), int(rng.integers(0, n + 1)), n if rng.random() > 0.1 else n + 1,
                  int(rng.integers(0, cfg.slots + 1)), pos, nxt, k, width)
    if rng.random() < 0.05:
        row[dp.F_SLOT] |= 1 << 27                      # bits this library never sets
    return row


def _stream(rng, n: int, cfg: dp.SparseSwitchConfig, rounds: int):
    """Rounds of every worker's packet in a random order (data and skips, or MIN), with duplicates and noise."""
    k = cfg.elems
    for _ in range(rounds):
        slot, v, pos = int(rng.integers(0, cfg.slots)), int(rng.integers(0, 2)), int(rng.integers(0, 4))
        kinds = [dp.T_MIN] * n if rng.random() < 0.3 else [int(rng.choice([dp.T_DATA, dp.T_SKIP])) for _ in range(n)]
        if rng.random() < 0.1:
            kinds = [dp.T_SKIP] * n                    # a round without data
        late = []
        for w in rng.permutation(n):
            row = _packet(rng, kinds[w], v, int(w), n, slot, pos, pos + 1 + int(rng.integers(0, 3)), k)
            yield row
            if rng.random() < 0.05:
                late.append(row)                       # sent again: before or after the round completes
            if rng.random() < 0.03:
                yield _noise(rng, n, cfg)
        yield from late


@pytest.mark.parametrize("n,workers,world", [(3, None, 3), (5, None, None), (130, 192, 130), (70, 128, 70)])
def test_the_compiled_program_is_the_docstrings(n, workers, world):
    cfg = dp.SparseSwitchConfig(elems=64, slots=3, workers=workers)
    plane, ref = dp.Dataplane(cfg), Reference(cfg, world)
    plane.world = world
    rng = np.random.default_rng(n)
    for row in _stream(rng, n, cfg, max(60, 1500 // n)):
        got, want = plane.process(row.copy()), ref.process(row.copy())
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert np.array_equal(g, w)
        assert plane.refused == ref.refused
    for name in ("values", "seen", "count", "nxt", "pos", "held"):
        assert np.array_equal(getattr(plane, name), getattr(ref, name)), name
    assert plane.stats == ref.stats
    # the stream exercised every branch of the program
    assert all(ref.stats[c] > 0 for c in ("malformed", "out_of_step", "consumed", "multicast", "retransmit",
                                          "dropped", "overflow")), ref.stats


def _same_replies(got, want):
    (gs, gr), (ws, wr) = got, want
    assert gr == wr and len(gs) == len(ws)
    for (gm, gd, grel), (wm, wd, wrel) in zip(gs, ws):
        assert list(gd) == list(wd) and grel == wrel
        assert gm.dtype == wm.dtype and gm.shape == wm.shape and np.array_equal(gm.numpy(), wm.numpy())


@pytest.mark.parametrize("n,workers,burst,pad", [(3, None, 7, False), (3, None, 7, True), (70, 128, 16, False),
                                                 (5, None, 1, False)])
def test_a_message_run_in_one_compiled_call_is_its_rows_run_one_by_one(n, workers, burst, pad):
    """:meth:`dp.Dataplane.answer` (every row of a message in one compiled call) against the row-by-row path
    (:meth:`~dp.Dataplane.packets` then :meth:`~dp.Dataplane.replies`, :meth:`~dp.Dataplane.process` per row): the
    same messages out (byte for byte, in order, to the same endpoints), the same registers, counters and refusal
    records, over bursts of random lengths (unused rows ``T_EMPTY``, skips padded to a value row) holding new
    contributions, duplicates, MIN rounds, malformed and out-of-step packets; ``burst`` 1: one packet per
    message (a 1-D receive buffer, as on SimFabric)."""
    cfg = dp.SparseSwitchConfig(elems=64, slots=3, workers=workers, burst=burst)
    width = dp.HEADER + cfg.elems
    fast, slow = dp.Dataplane(cfg), dp.Dataplane(cfg)
    fast.world = slow.world = n
    rng = np.random.default_rng(n + burst)
    rows = list(_stream(rng, n, cfg, max(60, 1500 // n)))
    i = 0
    while i < len(rows):
        take = 1 if burst == 1 else int(rng.integers(1, burst + 1))
        part, i = rows[i:i + take], i + take
        src = int(rng.integers(0, n))
        if burst == 1:
            arr = part[0]
        else:
            arr = np.zeros((burst, width), dtype=np.int32)
            for r, row in enumerate(part):
                arr[r, :min(row.size, width)] = row[:width]
        want = slow.replies(slow.packets(arr.copy()), src, burst, burst == 1, pad)
        got_arr = arr.copy()
        got = fast.answer(got_arr, src, burst, pad)
        _same_replies(got, want)
        if burst > 1:
            assert not (got_arr[:, dp.W0] & dp.KIND_BITS).any()     # the buffer ready for the next message
        assert fast.refused == slow.refused
    for name in ("values", "seen", "count", "nxt", "pos", "held"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.stats == slow.stats
    assert all(slow.stats[c] > 0 for c in ("malformed", "out_of_step", "consumed", "multicast", "retransmit",
                                           "dropped")), slow.stats
