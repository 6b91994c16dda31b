"""experiments.bench.omnireduce_trace: the calling thread's time per call, and a traced call's first blocks up."""

import json
import sys
import time

import pytest

from experiments.bench.omnireduce_trace import first_blocks, thread_sched
from sparsecomm.transports.omnireduce import wire


def _event(kind, tag, post, nbytes=64):
    return {"kind": kind, "peer": 1, "tag": tag, "bytes": nbytes, "post": post, "wait0": None, "done": None}


def test_first_blocks_is_the_first_send_of_blocks_up_not_a_header_firsts_or_sums(tmp_path):
    start = 100.0
    events = [_event("send", wire.TAG_HDR_UP, start + 0.0005), _event("send", wire.TAG_FIRSTS, start + 0.001),
              _event("recv", wire.tag_up(0), start + 0.0012),          # a block received: not this rank's
              _event("send", wire.tag_down(0), start + 0.0015),        # sums down, not blocks up
              _event("send", wire.tag_up(1), start + 0.003, 1 << 20),
              _event("send", wire.tag_up(0), start + 0.002, 1 << 20)]  # (records are not in time order)
    (tmp_path / "rank0.call0.json").write_text(json.dumps({"rank": 0, "start": start, "events": events}))
    (tmp_path / "rank0.call1.json").write_text(json.dumps(
        {"rank": 0, "start": 5.0, "events": [_event("send", wire.tag_up(0), 5.004)]}))
    # a rank that sent no blocks up (every block with its hosted aggregator) has no entry
    (tmp_path / "rank1.call0.json").write_text(json.dumps(
        {"rank": 1, "start": 7.0, "events": [_event("send", wire.TAG_HDR_UP, 7.001)]}))
    (tmp_path / "notes.txt").write_text("not a trace")
    got = first_blocks(str(tmp_path))
    assert sorted(got) == [0]
    assert got[0] == pytest.approx([0.002, 0.004])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's per-thread counters are Linux's")
def test_thread_sched_counts_this_threads_cpu_and_never_goes_back():
    a = thread_sched()
    c0 = time.thread_time()
    while time.thread_time() - c0 < 0.05:      # 50 ms of this thread's CPU
        pass
    b = thread_sched()
    assert a is not None and b is not None
    cpu, wait, preempted = (y - x for x, y in zip(a, b))
    assert 0.045 <= cpu <= 0.5 and wait >= 0 and preempted >= 0
    assert isinstance(b[2], int)
