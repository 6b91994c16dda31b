"""A worker's round-0 replies of an aggregator's one-round channels, landed in one wait
(:func:`sparsecomm.transports.omnireduce.worker.land_singles`) where :attr:`.worker.Call.fold` holds (the SimFabric
without a host model): every rank's modelled time and sum are those of a lane per channel, bit for bit, with
fewer steps of the world's loop; under a host model, and on a real fabric, each channel keeps its lane."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.fabric.sim import sim_world
from sparsecomm.fabric.sim.sim_host import HostModel
from sparsecomm.transports.omnireduce import worker

NUMEL, BLOCK = 1 << 14, 256
#: the code under test, as imported (a test patches it twice)
_LAND, _STEP, _INIT = worker.land_singles, sim_world.World._step, worker.Call.__init__


def _x(rank: int, density: float) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    nb = NUMEL // BLOCK
    keep = torch.zeros(nb, dtype=torch.bool)
    keep[torch.randperm(nb, generator=torch.Generator().manual_seed(7))[: max(1, int(density * nb))]] = True
    return x * keep.repeat_interleave(BLOCK)


def _run(ctx, kw: dict, density: float):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BLOCK, **kw)
    y = t.allreduce(_x(ctx.rank, density))
    return t.last_stats.modelled_time_s, y


def _launch(monkeypatch, fold: bool | None, kw: dict, density: float, n: int, network=None):
    """Every rank's (modelled time, sum), how many times a verdict landed one-round replies together, and the
    world's loop steps; ``fold``: force :attr:`.worker.Call.fold` (``None``: as the fabric decides)."""
    landed, steps = [0], [0]
    real_land, real_step, real_init = _LAND, _STEP, _INIT

    def land(call, a, singles):
        landed[0] += 1
        return real_land(call, a, singles)

    def step(self, p):
        steps[0] += 1
        return real_step(self, p)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if fold is not None:
            self.fold = fold

    monkeypatch.setattr(worker, "land_singles", land)
    monkeypatch.setattr(sim_world.World, "_step", step)
    monkeypatch.setattr(worker.Call, "__init__", init)
    net = network or sc.Network(bandwidth_gbps=100.0, latency_us=2.0)
    got = sc.launch(functools.partial(_run, kw=kw, density=density), n, network=net)
    return got, landed[0], steps[0]


@pytest.mark.parametrize("kw, density", [
    ({}, 0.1),                                       # colocated, default lanes: every channel one round
    ({}, 1.0),                                       # every block: the sums apart, straight into the result
    ({"deployment": "dedicated"}, 0.1),
    ({"channels": 3}, 0.3),
])
def test_one_wait_for_the_one_round_replies_changes_no_modelled_time_and_no_sum(monkeypatch, kw, density):
    n = 8
    lanes, landed0, steps0 = _launch(monkeypatch, False, kw, density, n)
    folded, landed, steps = _launch(monkeypatch, None, kw, density, n)
    assert landed0 == 0 and landed > 0          # (the fold is the SimFabric's default, and it was taken)
    assert [t.hex() for t, _ in folded] == [t.hex() for t, _ in lanes]
    for (_, a), (_, b) in zip(folded, lanes):
        assert torch.equal(a, b)
    assert steps < steps0                       # a wake the fewer per worker and aggregator


def test_under_a_host_model_each_channel_keeps_its_lane(monkeypatch):
    host = sc.Network(bandwidth_gbps=100.0, latency_us=2.0, host=HostModel(move_byte_s=1e-9, index_block_s=1e-7))
    _, landed, _ = _launch(monkeypatch, None, {"channels": 2}, 0.1, 8, network=host)
    assert landed == 0


def test_a_multi_round_channel_keeps_its_lane_beside_one_round_ones(monkeypatch):
    # 16 blocks per aggregator over 3 channels of at most 6 lanes: 6, 5, 5 blocks (one round only where they fit)
    kw = {"channels": 3, "lanes": 5}
    lanes, _, _ = _launch(monkeypatch, False, kw, 0.5, 4)
    folded, landed, _ = _launch(monkeypatch, None, kw, 0.5, 4)
    assert landed > 0
    assert [t.hex() for t, _ in folded] == [t.hex() for t, _ in lanes]
    for (_, a), (_, b) in zip(folded, lanes):
        assert torch.equal(a, b)
