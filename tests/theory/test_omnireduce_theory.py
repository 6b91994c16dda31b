"""OmniReduce's closed form (theory/costs.py) against the SimFabric, on a small grid of the reproduction
(experiments/reproduce_omnireduce.py): within 15 %, flat in the number of workers with dedicated
aggregators, falling with the block density, while ring grows with n."""

from __future__ import annotations

import pytest

from experiments import reproduce_omnireduce as R
from theory import costs


@pytest.fixture(scope="module")
def grid():
    return {(p.n, p.density): p for p in R.run_grid([2, 4, 8], [1.0, 0.5, 0.1], [100.0], "full", log=lambda s: None)}


def test_closed_form_tracks_the_simulation_within_15_percent(grid):
    for (n, d), p in grid.items():
        assert abs(p.error) <= 0.15, (n, d, p.omni_s, p.closed_form_s)
        assert abs(p.omni_s / p.expected_form_s - 1) <= 0.15, (n, d, p.omni_s, p.expected_form_s)


def test_flat_in_workers_falls_with_density_while_ring_grows(grid):
    for d in (1.0, 0.5, 0.1):
        ts = [grid[n, d].omni_s for n in (2, 4, 8)]
        assert max(ts) / min(ts) <= 1.15, (d, ts)
    for n in (2, 4, 8):
        assert grid[n, 0.1].omni_s < 0.35 * grid[n, 0.5].omni_s < 0.35 * grid[n, 1.0].omni_s
    assert grid[8, 1.0].ring_s / grid[2, 1.0].ring_s > 1.6          # ring: 2 (n-1)/n of the data
    assert grid[8, 1.0].ring_s == pytest.approx(grid[8, 1.0].ring_form_s, rel=0.05)


def test_closed_form_limits():
    """Per-worker bytes do not grow with n (dedicated); colocated at density 1 moves ring's volume."""
    a = costs.omnireduce_allreduce(2, 1 << 20, density=0.1, overlap="full")
    b = costs.omnireduce_allreduce(64, 1 << 20, density=0.1, overlap="full")
    assert b.bytes_sent == pytest.approx(a.bytes_sent, rel=0.05)
    ring = costs.ring_allreduce(8, 4 << 20)
    colo = costs.omnireduce_allreduce(8, 1 << 20, density=1.0, deployment="colocated")
    assert colo.bytes_sent == pytest.approx(ring.bytes_sent, rel=0.02)
    # random overlap: the union (downstream) grows as 1 - (1 - d)^n
    r = costs.omnireduce_allreduce(8, 1 << 20, density=0.1, overlap="random")
    assert r.bytes_received / a.bytes_received == pytest.approx((1 - 0.9 ** 8) / 0.1, rel=0.05)


def test_wire_constants_match_the_protocol():
    from sparsecomm.transports.omnireduce import wire

    assert costs.OMNIREDUCE_HEADER_BYTES == 8 * wire.HDR


def test_grid_runs_the_ring_once_per_workers_and_bandwidth(monkeypatch):
    """The ring's modelled time depends on the size, not the data: the grid simulates it once per
    ``(bandwidth, n)`` and every density there carries that time, the same bits as a ring run per point."""
    import sparsecomm as sc

    launches = []
    real = sc.launch
    monkeypatch.setattr(sc, "launch", lambda fn, n, **kw: launches.append(n) or real(fn, n, **kw))
    pts = R.run_grid([2, 4], [1.0, 0.1, 0.01], [100.0], "full", numel=8192, log=lambda s: None)
    assert len(launches) == len(pts) + 2                        # an OmniReduce launch per point, 2 rings
    monkeypatch.setattr(sc, "launch", real)
    for p in pts:
        alone = R.run_point(p.n, p.density, p.bandwidth_gbps, "full", 8192)
        assert (p.ring_s, p.omni_s) == (alone.ring_s, alone.omni_s)


def test_wide_workers_run_at_the_wide_densities_only():
    """``wide_ns`` joins ``ns`` at the wide densities (in increasing n), and nowhere else; a wide point is a
    point like the others (its closed form and ring with it); the figures draw no one-point curve."""
    from tests._figures import problems

    pts = R.run_grid([2], [1.0, 0.1], [100.0], "full", numel=8192, log=lambda s: None, wide_ns=[4],
                     wide_densities=[0.1, 0.01])
    assert [(p.density, p.n) for p in pts] == [(1.0, 2), (0.1, 2), (0.1, 4), (0.01, 4)]
    assert all(p.closed_form_s > 0 and p.ring_s > 0 for p in pts)
    figs = R.plot(pts, 8192)
    assert {stem: problems(fig) for stem, fig in figs.items()} == {stem: [] for stem in figs}
