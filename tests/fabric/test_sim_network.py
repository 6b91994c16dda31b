"""The SimFabric's receiving NIC (:meth:`sparsecomm.fabric.sim.sim_network.Endpoint.schedule`), which re-times the
queued messages lazily: every delivery read is bit for bit the one of the model's recurrence computed eagerly at
every arrival (arrival order among the messages not taken, after the taken ones), whatever the order of
arrivals, reads and takes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from sparsecomm.fabric.sim.sim_network import Endpoint, Msg, Network


class _Eager:
    """The receiving NIC's model, every time recomputed at every arrival (one port)."""

    def __init__(self, bw: float, burst: float = 0.0) -> None:
        self.bw, self.burst, self.sched, self.times = bw, burst, [], {}

    def arrive(self, m: Msg) -> None:
        i = len(self.sched)
        while i > 0:
            p = self.sched[i - 1]
            if p.taken or (p.head, p.src) <= (m.head, m.src):
                break
            i -= 1
        self.sched.insert(i, m)
        t = -self.burst
        for p in self.sched:          # (a taken message's slot is fixed: its times were final when taken)
            if p.taken:
                t = self.times[id(p)][0]
                continue
            r = max(p.head - self.burst, t) + p.nbytes / self.bw
            self.times[id(p)] = (r, max(r, p.tx_end + (p.head - p.start)))
            t = r

    def delivered(self, m: Msg) -> float:
        return self.times[id(m)][1]


def test_lazy_retiming_reads_the_eager_recurrence_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(60):
        per_port = bool(trial % 3 == 2)
        burst_us = 2.0 if trial % 2 else 0.0          # (a shaper's bucket: Network.burst_us)
        ep = Endpoint(Network(burst_us=burst_us), 0, 1e9, 1e-6, per_port, "ep")
        models: dict[int, _Eager] = {}
        queued: list[Msg] = []
        reads = retimed = 0
        for step in range(80):
            op = rng.random()
            if op < 0.55 or not queued:
                src, tag = int(rng.integers(1, 6)), int(rng.integers(0, 2))
                start = float(rng.uniform(0, 4e-6)) if rng.random() < 0.8 else 1e-6    # (ties of heads too)
                nbytes = int(rng.choice([0, 1, 64, 1500, 9000]))
                m = Msg(src, tag, torch.empty(0), nbytes, start, start + 1e-6, start + nbytes / 1e9)
                ep.mailbox.setdefault((src, tag), []).append(m)
                retimed += ep.schedule(m)
                models.setdefault(src if per_port else -1, _Eager(ep.bw, burst_us * 1e-6)).arrive(m)
                queued.append(m)
            elif op < 0.8:                # read one (the lazy times are brought up to date)
                m = queued[int(rng.integers(len(queued)))]
                assert ep.delivery(m) == models[m.src if per_port else -1].delivered(m)
                reads += 1
            else:                         # take the head of a channel, as the world does
                m = queued[int(rng.integers(len(queued)))]
                m = ep.mailbox[(m.src, m.tag)].pop(0)
                want = models[m.src if per_port else -1].delivered(m)
                ep.taken(m)
                assert m.delivered == want
                queued.remove(m)
            for m in queued:
                d = m.delivered
                assert d <= models[m.src if per_port else -1].delivered(m)     # a lower bound until read
        for m in queued:
            assert ep.delivery(m) == models[m.src if per_port else -1].delivered(m)
        assert reads and retimed


def _two_sends(ctx, nbytes: int, gap_s: float) -> list[float]:
    """Rank 0 sends ``nbytes`` twice, back to back, then again after ``gap_s`` idle; rank 1: each delivery."""
    f = ctx.fabric
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if ctx.rank == 0:
        f.send(buf, 1)
        f.send(buf, 1)
        f.compute(gap_s)
        f.send(buf, 1)
        return []
    out = []
    for _ in range(3):
        f.recv(buf, 0)
        out.append(f.now())
    return out


@pytest.mark.parametrize("burst_us", [0.0, 400.0])
def test_a_link_bucket_passes_its_burst_at_once_after_an_idle_and_then_the_rate(burst_us):
    # 125 kB at 1 Gbit/s is 1 ms of link time: with a bucket of 0.4 ms an idle link sends it in 0.6 ms, the next
    # message right behind it in its full 1 ms, and after 2 ms idle (a full bucket again) 0.6 ms again
    import sparsecomm as sc

    net = sc.Network(bandwidth_gbps=1.0, latency_us=0.0, burst_us=burst_us)
    _, times = sc.launch(functools.partial(_two_sends, nbytes=125_000, gap_s=2e-3), 2, network=net)
    b = burst_us * 1e-6
    assert times[0] == pytest.approx(1e-3 - b, abs=1e-12)
    assert times[1] == pytest.approx(times[0] + 1e-3, abs=1e-12)
    # the sender's clock: at its second send's end (a send returns when its NIC is done), then the gap
    assert times[2] == pytest.approx(times[1] + 2e-3 + 1e-3 - b, abs=1e-12)


def test_a_negative_burst_is_refused():
    from sparsecomm.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match="burst_us"):
        Network(burst_us=-1.0)
