"""The SimFabric's network model checked against a real network (a netbed): the modelled time of a
bandwidth-optimal all-reduce at the netbed's link rate (with TCP/Ethernet framing and the one-way latency
of a small message measured over the same fabric in the same launch) against the measured time of
``native`` (gloo's all-reduce) and ``ring`` (from the last rank's start to the last rank's end).

The default run checks one small point (2 workers, 10 MB, 100 Mbit/s: about a second per call); the
slow run covers n = 2 and 4, 10 and 100 MB at 100 Mbit/s, where the hosts' CPUs (2 cores, shared) are
not the limit (``experiments/bench/netbed_vs_sim.py`` prints the same table; BENCHMARKS.md records it).
"""

from __future__ import annotations

import pytest

from experiments.bench.netbed_vs_sim import measured, modelled

pytestmark = [pytest.mark.multiprocess, pytest.mark.netbed]
GRID = [(n, mb) for n in (2, 4) for mb in (10, 100)]


def test_sim_models_native_and_ring_allreduce_on_a_real_link():
    """Two workers: the library's ring exchanges both ways on one pair, the case that ran at up to half
    the link rate before TorchFabric's two-way channels (BENCHMARKS "Crossing exchanges on one gloo pair")."""
    real = measured(2, 10, 0.1, repeats=3)
    sim = modelled(2, 10, 0.1, latency_us=real["latency_s"] * 1e6)
    assert 0.8 <= sim / real["native"] <= 1.2, (sim, real)
    assert 0.8 <= sim / real["ring"] <= 1.2, (sim, real)


@pytest.mark.slow
@pytest.mark.parametrize("workers,size_mb", GRID)
def test_sim_within_20_percent_of_native_on_the_netbed(workers, size_mb):
    real = measured(workers, size_mb, 0.1, repeats=2)
    sim = modelled(workers, size_mb, 0.1, latency_us=real["latency_s"] * 1e6)
    assert 0.8 <= sim / real["native"] <= 1.2, (sim, real)


@pytest.mark.slow
@pytest.mark.parametrize("gbps", [0.1, 1.0])
@pytest.mark.parametrize("workers,size_mb", GRID)
def test_sim_within_20_percent_of_ring_on_the_netbed(workers, size_mb, gbps):
    """100 MB at 100 Mbit/s took 1.09-1.33x the model before the netbed capped a send burst to 0.5 ms of
    link time (sparsecomm/netbed/topology.py)."""
    real = measured(workers, size_mb, gbps, repeats=2)
    sim = modelled(workers, size_mb, gbps, latency_us=real["latency_s"] * 1e6)
    assert 0.8 <= sim / real["ring"] <= 1.2, (sim, real)
