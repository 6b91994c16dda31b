"""The closed form :func:`theory.costs.sparse_switch_allreduce` against the SimFabric: modelled time within
15 % (with the data's measured union, own blocks and waves of the stream, and with the expectations only), and
the bytes it books equal to the ledger's."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecomm as sc
from sparsecomm import codec
from theory import costs

from experiments.reproduce_sparse_switch import waves_of

from tests._figures import problems
from tests.transports.switchml.sparse.test_sparse_switch import K, blocky

POINTS = [  # n, numel, density, overlap, pool
    (4, 256 * 1024, 0.1, "random", 256),     # bandwidth-bound and lane-bound comparable
    (3, 256 * 1024, 1.0, "full", 48),        # the pool just short of the bandwidth-delay product
    (8, 256 * 512, 0.02, "random", 256),     # sparse: a few rounds per lane
    (3, 256 * 256, 1.0, "random", 8),        # dense, small pool: pool pressure (lane-bound)
    (4, 256 * 48 + 9, 0.5, "full", 256),     # small tensor: the set-up round trips dominate
]


@pytest.mark.parametrize("n,numel,density,overlap,pool", POINTS)
def test_closed_form_within_15_percent_of_the_simulation(n, numel, density, overlap, pool):
    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=pool)
        x = blocky(ctx.rank, numel, density, overlap=overlap)
        t.allreduce(x)
        return x, t.last_stats

    out = sc.launch(fn, n, network=sc.Network(bandwidth_gbps=100, latency_us=2))
    sim = max(s.modelled_time_s for _, s in out)
    masks = [codec.nonzero_blocks(x, K).numpy() for x, _ in out]
    union = np.logical_or.reduce(masks)
    measured = dict(own_blocks=float(np.mean([m.sum() for m in masks])), union_blocks=float(union.sum()),
                    waves=waves_of(union, pool))
    common = dict(density=density, overlap=overlap, pool_size=pool, slot_elems=K)
    form = costs.sparse_switch_allreduce(n, numel, **common, **measured)
    expect = costs.sparse_switch_allreduce(n, numel, **common)
    assert abs(sim / form.time_s - 1) <= 0.15, (sim, form.time_s)
    assert abs(sim / expect.time_s - 1) <= 0.15, (sim, expect.time_s)
    # the bytes it books are the ledger's (worker 0: its own blocks)
    own0 = float(masks[0].sum())
    f0 = costs.sparse_switch_allreduce(n, numel, **common, **{**measured, "own_blocks": own0})
    assert out[0][1].bytes_sent == pytest.approx(f0.bytes_sent)
    assert out[0][1].bytes_received == pytest.approx(f0.bytes_received)


def test_closed_form_shape_flat_in_n_and_falling_with_density():
    t = {(n, d): costs.sparse_switch_allreduce(n, 256 * 4096, density=d, overlap="full").time_s
         for n in (2, 8, 32) for d in (1.0, 0.1, 0.01)}
    hs = {n: costs.handshake(n, costs.SPARSE_SWITCH_HANDSHAKE_FIELDS).time_s for n in (2, 32)}
    for d in (1.0, 0.1, 0.01):
        # full overlap: nothing depends on n but the workers' agreement handshake (log2 n small messages)
        assert t[32, d] - hs[32] == pytest.approx(t[2, d] - hs[2])
    assert t[8, 1.0] > 5 * t[8, 0.1] and t[8, 0.1] > 2 * t[8, 0.01]   # falls with density (set-up floors it)
    with pytest.raises(ValueError):
        costs.sparse_switch_allreduce(4, 100, overlap="some")


def test_e1_runs_omnireduce_past_omni_max_at_the_wide_densities_only():
    from experiments import reproduce_sparse_switch as R

    pts = R.e1([2, 3], [1.0, 0.25], 256 * 16, "full", log=lambda s: None, omni_max=2, omni_wide=(0.25,))
    ran = {(p.density, p.n): p.times_us["omni-dedicated"] == p.times_us["omni-dedicated"] for p in pts}
    assert ran == {(1.0, 2): True, (1.0, 3): False, (0.25, 2): True, (0.25, 3): True}
    assert all(p.times_us["omni-colocated"] == p.times_us["omni-colocated"] for p in pts if ran[p.density, p.n])


def test_reproduction_smoke():
    from experiments import reproduce_sparse_switch as R

    pts = [R.run_point(n, d, numel=256 * 16) for n in (2, 3) for d in (1.0, 0.25)]
    for p in pts:
        assert set(p.times_us) == set(R.TRANSPORTS) and all(t > 0 for t in p.times_us.values())
        assert abs(p.error) <= 0.15
    figs = R.plot(pts, [], [2, 3], [1.0, 0.25])
    assert set(figs) == {"sparse_switch_vs_density", "sparse_switch_vs_workers"}
    assert {stem: problems(fig) for stem, fig in figs.items()} == {stem: [] for stem in figs}
