"""sim_wait.OrderedWait: the state of an open wait_any, updated per arrival, equals the state measured
afresh from the mailbox after every arrival (groups of several receives, any-source receives, arrivals
out of head order that re-time queued messages, messages for receives of no group)."""

from __future__ import annotations


import numpy as np
import torch

from sparsecomm.fabric.sim.sim_network import FIXED, TAG_HEAP_SLACK, Endpoint, Msg, Network
from sparsecomm.fabric.sim.sim_wait import OrderedWait, any_head


def _state(w: OrderedWait):
    return list(w.missing), list(w.latest), w.t_min, w.first(), w.first(clock_only=True)


def test_incremental_state_matches_a_fresh_measure_after_every_arrival():
    rng = np.random.default_rng(0)
    for trial in range(40):
        ep = Endpoint(Network(), 0, 1e9, 1e-6, bool(trial % 2), "ep")
        ep.clock = float(rng.uniform(0, 2e-6))
        keys = [[(1, 0)], [(2, 0), (3, 0)], [(None, 1)], [(4, 0), (5, 2), (6, 0)], [(7, 0)]]
        w = OrderedWait(ep, keys)
        w.recompute()
        fresh = OrderedWait(ep, keys)
        for _ in range(30):
            src, tag = int(rng.integers(1, 9)), int(rng.integers(0, 3))
            start = float(rng.uniform(0, 3e-6))
            nbytes = int(rng.integers(1, 2000))
            msg = Msg(src, tag, torch.empty(0), nbytes, start, start + 1e-6, start + nbytes / 1e9)
            ep.mailbox.setdefault((src, tag), []).append(msg)
            w.arrived(msg, ep.schedule(msg))
            fresh.recompute()
            assert _state(w) == _state(fresh)


def test_a_switch_takes_a_ports_messages_in_arrival_order_whatever_their_tags():
    """A ``per_port`` endpoint (a switch) whose clock is past two messages of one worker on two tags takes the
    earlier first, though the wait lists the other tag's receive first; any other endpoint follows the order of
    preference while both are in, and on a tie a switch does too."""
    for per_port, ahead in ((True, True), (False, True), (True, False)):
        ep = Endpoint(Network(), 0, 1e9, 1e-6, per_port, "ep")
        for tag, start in ((1, 0.0), (0, 1e-6)):           # tag 1 sent first
            msg = Msg(3, tag, torch.empty(0), 16, start, start + 1e-6, start + 16 / 1e9)
            ep.mailbox.setdefault((3, tag), []).append(msg)
            ep.schedule(msg)
        if not ahead:                                      # the same delivery: a tie
            for q in ep.mailbox.values():
                q[0].delivered, q[0].stamp = 5e-6, FIXED
        ep.clock = 1e-3                                    # busy past both
        w = OrderedWait(ep, [[(None, 0)], [(None, 1)]])
        want = 1 if per_port and ahead else 0
        assert w.first(clock_only=True) == (1e-3, want)
        w.recompute()
        assert w.first() == (1e-3, want)


def _scan(ep: Endpoint, tag: int):
    best = None
    for (s, t), q in ep.mailbox.items():
        if t == tag and q and (best is None or (q[0].head, s) < (best.head, best.src)):
            best = q[0]
    return best


def test_the_any_source_heap_finds_the_first_head_the_scan_would():
    """any_head (a heap per tag, built at the first lookup, pushed as messages are placed, taken ones popped
    lazily) answers what a pass over the mailbox answers after every arrival and take: heads tied across
    sources (the lower source), within a channel (the earlier sent), a channel whose later message has the
    earlier head (not a sender's order: the mailbox is scanned), tags never looked up."""
    rng = np.random.default_rng(1)
    for trial in range(30):
        ep = Endpoint(Network(), 0, 1e9, 1e-6, bool(trial % 2), "ep")
        monotone = trial % 3 != 0
        last: dict = {}
        looked: set = set()
        for step in range(120):
            if rng.random() < 0.6:
                src, tag = int(rng.integers(1, 6)), int(rng.integers(0, 3))
                start = float(rng.integers(0, 8)) * 1e-7      # (coarse: ties)
                if monotone:
                    start = max(start, last.get((src, tag), 0.0))
                    last[(src, tag)] = start
                msg = Msg(src, tag, torch.empty(0), 16, start, start + 1e-6, start + 16 / 1e9)
                ep.mailbox.setdefault((src, tag), []).append(msg)
                ep.schedule(msg)
            else:
                tag = int(rng.integers(0, 3))
                if tag != 2:            # (tag 2 is never looked up: no heap for it)
                    looked.add(tag)
                    msg = any_head(ep, tag)
                    assert msg is _scan(ep, tag)
                    if msg is not None and rng.random() < 0.7:
                        ep.mailbox[(msg.src, tag)].pop(0)
                        ep.taken(msg)
                else:                   # a named receive takes a head of its own
                    qs = [q for (s, t), q in ep.mailbox.items() if t == 2 and q]
                    if qs:
                        m = qs[int(rng.integers(len(qs)))].pop(0)
                        ep.taken(m)
            for tag in looked:
                assert any_head(ep, tag) is _scan(ep, tag)
        assert 2 not in ep.any_heads


def test_the_any_source_heap_of_a_tag_taken_by_named_receives_stays_small():
    """A tag looked up once by an any-source receive, whose messages named receives then take while its first
    message stays queued (the heap's top untaken): the heap is built afresh past its limit, so that it holds
    about the queued messages, not every one since, and still answers as the scan."""
    ep = Endpoint(Network(), 0, 1e9, 1e-6, False, "ep")

    def put(src: int, start: float) -> Msg:
        msg = Msg(src, 0, torch.empty(0), 16, start, start + 1e-6, start + 16 / 1e9)
        ep.mailbox.setdefault((src, 0), []).append(msg)
        ep.schedule(msg)
        return msg

    first = put(1, 0.0)
    assert any_head(ep, 0) is first
    for i in range(5000):
        put(2, 1e-6 * (i + 1))
        m = ep.mailbox[(2, 0)].pop(0)        # (a named receive's take)
        ep.taken(m)
        assert len(ep.any_heads[0]) <= 2 * 2 + TAG_HEAP_SLACK + 1
    assert any_head(ep, 0) is first is _scan(ep, 0)
