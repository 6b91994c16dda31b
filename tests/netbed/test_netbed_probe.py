"""The fabric-level latency probe (sparsecomm.fabric.probe.fabric_latency_s) measures the model's own
alpha: run on the SimFabric it gives back the configured one-way latency plus the message's serialisation,
on every worker alike, for any world size; so what it measures on the netbed is the quantity that
``Network.latency_us`` stands for (experiments/bench/netbed_vs_sim.py models with it)."""

from __future__ import annotations

import functools

import pytest

import sparsecomm as sc
from sparsecomm.fabric.probe import fabric_latency_s


def _probe(ctx, nbytes):
    return fabric_latency_s(ctx.fabric, rounds=5, nbytes=nbytes)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("latency_us,gbps", [(10.0, 1.0), (1000.0, 100.0)])
def test_the_probe_recovers_the_simfabric_latency(n, latency_us, gbps):
    nbytes = 256
    got = sc.launch(functools.partial(_probe, nbytes=nbytes), n,
                    network=sc.Network(bandwidth_gbps=gbps, latency_us=latency_us))
    assert len(set(got)) == 1
    assert got[0] == pytest.approx(latency_us * 1e-6 + nbytes / (gbps * 1e9 / 8), rel=1e-3)


def test_a_world_of_one_has_no_latency():
    assert sc.launch(functools.partial(_probe, nbytes=256), 1) == [0.0]
