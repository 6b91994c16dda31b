"""The SimFabric's network model checked against a real network (a netbed): the modelled time of a
bandwidth-optimal all-reduce at the netbed's link rate (with TCP/Ethernet framing and the netbed's
latency) against the measured time of ``native`` (gloo's all-reduce) and ``ring``.

The default run checks one small point (2 workers, 10 MB, 100 Mbit/s: about a second per call); the
slow run covers n = 2 and 4, 10 and 100 MB at 1 Gbit/s (``experiments/bench/netbed_vs_sim.py`` prints
the same table, recorded in BENCHMARKS.md).
"""

from __future__ import annotations

import pytest

from experiments.bench.netbed_vs_sim import measured, modelled

pytestmark = [pytest.mark.multiprocess, pytest.mark.netbed]


def test_sim_models_native_allreduce_on_a_real_link():
    real = measured(2, 10, 0.1, repeats=2)
    sim = modelled(2, 10, 0.1)
    assert 0.8 <= sim / real["native"] <= 1.2, (sim, real)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("size_mb", [10, 100])
def test_sim_within_20_percent_of_netbed(workers, size_mb):
    real = measured(workers, size_mb, 1.0, repeats=3)
    sim = modelled(workers, size_mb, 1.0)
    assert 0.8 <= sim / real["native"] <= 1.2, (sim, real)
    if workers == 2:
        # known: this library's ring on 2 real gloo ranks takes ~1.5-1.8x the modelled (and native's) time
        # at 100 Mbit/s-1 Gbit/s, while allgather with the same full-duplex traffic runs at the modelled
        # rate, so the loss is in the ring's interplay with gloo's send/recv on one TCP pair, not in the
        # network model (reported for issue #14; the transport is not the netbed's to tune)
        assert sim / real["ring"] < 0.8, "the ring on 2 ranks now matches the model: tighten this check"
    else:
        assert 0.8 <= sim / real["ring"] <= 1.2, (sim, real)
