"""``--seeds K`` on the reproductions: a statistic over K runs, as mean ± std in the tables and a mean with a
band in the figures, through one helper (experiments/common/seeds.py); the reproductions whose numbers do
not depend on the seed say so instead."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from experiments.common import seeds as S
from tests._figures import problems


def _keep_figures(monkeypatch) -> dict:
    from experiments.common import reproduce as U

    figures = {}
    real = U.Run.save_figure

    def keep(self, fig, stem):
        figures[stem] = fig
        return real(self, fig, stem)

    monkeypatch.setattr(U.Run, "save_figure", keep)
    return figures


# ----------------------------------------------------------------------------- the helper
def test_band_is_the_mean_and_std_at_the_points_every_run_has():
    b = S.band([[0, 1, 2], [0, 1, 2, 3]], [[1.0, 2.0, 3.0], [3.0, 4.0, math.inf, 9.0]])
    assert b.n == 2 and b.x.tolist() == [0.0, 1.0]                 # 2: not finite in run 2; 3: not in run 1
    assert b.mid.tolist() == [2.0, 3.0]
    assert np.allclose(b.hi - b.mid, math.sqrt(2.0)) and np.allclose(b.mid - b.lo, math.sqrt(2.0))


def test_band_on_a_log_axis_is_the_geometric_mean_times_and_over_the_gsd():
    b = S.band([[0, 1], [0, 1]], [[1e-2, 1e-4], [1e-4, 1e-8]], [[0, 10], [0, 30]], log=True)
    assert np.allclose(b.mid, [1e-3, 1e-6]) and b.x.tolist() == [0.0, 20.0]
    assert np.allclose(np.log10(b.hi / b.mid), np.log10(b.mid / b.lo))
    assert np.allclose(np.log10(b.hi / b.mid), [math.sqrt(2.0), 2 * math.sqrt(2.0)])


def test_one_run_is_its_own_curve_without_a_band():
    import matplotlib.pyplot as plt

    b = S.band([[0, 1, 2]], [[3.0, 2.0, 1.0]])
    assert b.lo.tolist() == b.mid.tolist() == b.hi.tolist() == [3.0, 2.0, 1.0]
    fig, ax = plt.subplots()
    S.draw(ax, b, label="one")
    assert not ax.collections, "a band drawn for a single seed"
    S.draw(ax, S.band([[0, 1], [0, 1]], [[1.0, 2.0], [2.0, 3.0]]), label="two")
    assert len(ax.collections) == 1
    plt.close(fig)


def test_stats_ignore_nans_and_use_the_sample_std():
    st = S.stats([1.0, None, 3.0, float("nan")])
    assert st["mean"] == 2.0 and st["std"] == pytest.approx(math.sqrt(2.0)) and len(st["per_seed"]) == 4
    assert S.stats([5.0])["std"] == 0.0 and math.isnan(S.stats([])["mean"])


# ----------------------------------------------------------------------------- the algorithm reproductions
#: ~10 s of CPU; in the default suite instead: the band's tests above, test_marina_over_seeds_... below (the same
#: per-seed loop and figure) and test_experiments_plots.py::test_reproduction_figures_keep_the_rules[reproduce_ef21]
@pytest.mark.slow
def test_ef21_over_seeds_draws_x0_per_seed_and_shows_mean_and_band(tmp_path, monkeypatch, capsys):
    from experiments import reproduce_ef21

    figures = _keep_figures(monkeypatch)
    summary = reproduce_ef21.main(["--quick", "--no-progress", "--no-wandb", "--out", str(tmp_path), "--iters", "20",
                                   "--multipliers", "1,4", "--seeds", "2", "--seed", "3"])
    assert summary["EF21_x1"]["seeds"]["seeds"] == [3, 4]
    assert len(set(summary["EF21_x1"]["seeds"]["final"])) == 2, "the seeds started from the same x0"
    assert "over 2 seeds: log10 final" in capsys.readouterr().out
    for stem in ("ef21_vs_ef", "ef21_vs_tuned_ef"):
        fig = figures[stem]
        assert problems(fig) == [] and all(ax.collections for ax in fig.axes), stem


def test_marina_over_seeds_shows_the_band_and_every_curve(tmp_path, monkeypatch, capsys):
    """rand-K's draws change with the seed; the figure draws the geometric mean with a band, and DIANA's
    curves against bits, which lie on one line for every K, each carry their own marker."""
    from experiments import reproduce_marina

    figures = _keep_figures(monkeypatch)
    summary = reproduce_marina.main(["--quick", "--no-progress", "--no-wandb", "--out", str(tmp_path), "--iters",
                                     "40", "--ks", "1,5", "--seeds", "2"])
    assert len(set(summary["DIANA_K1"]["seeds"]["final"])) == 2, "the seeds drew the same rand-K"
    assert "over 2 seeds: log10 final" in capsys.readouterr().out
    fig = figures["marina_vs_diana"]
    assert problems(fig) == [] and all(ax.collections for ax in fig.axes)
    bits = {ln.get_label(): ln for ln in fig.axes[1].get_lines()}
    assert bits["DIANA K=1"].get_marker() != bits["DIANA K=5"].get_marker()
    assert bits["DIANA K=1"].get_zorder() > bits["DIANA K=5"].get_zorder(), "the shorter curve drawn under"
    fig.canvas.draw()
    for ax in fig.axes:
        assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())


# ----------------------------------------------------------------------------- the network reproductions
def test_switchml_loss_seeds_give_mean_std_and_a_band(tmp_path, monkeypatch, capsys):
    """E3's goodput is random in the loss seed: over the seeds its table shows mean ± std and its figure a
    band (the switch emulation replaced by a stand-in whose time depends on the loss seed)."""
    import argparse

    import torch

    from experiments import reproduce_switchml as R
    from experiments.common import reproduce as U

    def fake(transport, n, numel, net, seed, **kw):
        return dict(time=1e-3 * (1 + net.loss * kw["timeout"] * 1e4 * (1 + net.seed)), sent=numel * 4, y=None,
                    sums=torch.zeros(4), retx=0)

    monkeypatch.setattr(R, "_run", fake)
    figures = _keep_figures(monkeypatch)
    args = argparse.Namespace(quick=True, seed=0, out=tmp_path, no_wandb=True, no_progress=True, threads=1)
    out = R.e3_loss(args, U.Run("t", args, {}), dict(bandwidth_gbps=100.0, latency_us=2.0), [0, 1, 2])
    lossy = next(r for r in out["rows"] if r["loss"] > 0)
    assert len(set(lossy["goodput_over_seeds"]["per_seed"])) == 3 and lossy["goodput_over_seeds"]["std"] > 0
    assert " ± " in capsys.readouterr().out
    fig = figures["switchml_vs_loss"]
    assert problems(fig) == [] and fig.axes[0].collections


def test_switchml_help_says_which_experiments_do_not_depend_on_the_seed(capsys):
    from experiments import reproduce_switchml as R

    with pytest.raises(SystemExit):
        R.main(["--help"])
    assert "E1 and E2 are deterministic in the seed" in " ".join(capsys.readouterr().out.split())


def test_omnireduce_over_seeds_draws_positions_per_seed(tmp_path):
    """The non-zero blocks' positions follow the seed, and with them the rounds and the busiest aggregator:
    one row per seed, mean ± std per grid point, bands in the figures."""
    from experiments import reproduce_omnireduce as R

    pts = R.run_grid([2, 4], [0.5, 0.05], [100.0], "random", numel=8192, log=lambda s: None, seeds=(0, 1))
    assert [p.seed for p in pts] == [0, 1] * 4
    assert any(a.omni_s != b.omni_s for a, b in zip(pts[::2], pts[1::2])), "the seeds drew the same positions"
    table = R.seeds_table(pts)
    assert " ± " in table and len(table.splitlines()) == 2 + 4
    third = [dataclasses.replace(p, seed=2) for p in pts[::2]]            # three seeds: 0.1 * 3 / 3 != 0.1
    means = [R.mean_point(runs) for runs in R.by_point(pts + third).values()]
    assert sorted((p.n, p.density) for p in means) == [(2, 0.05), (2, 0.5), (4, 0.05), (4, 0.5)]
    for stem, fig in R.plot(pts, 8192).items():
        assert problems(fig) == [] and fig.axes[0].collections, stem


def _sparse_point(R, n, d, seed, t):
    p = R.Point(n, d, 16384, R.POOL, "full", d, seed=seed)
    p.times_us = {name: t * (1 + i) * (1 + 0.1 * seed if name != "ring" else 1) for i, name in enumerate(R.TRANSPORTS)}
    p.form_us = p.times_us["sparse-switch"] * 1.05
    return p


def test_sparse_switch_over_seeds_keeps_each_and_draws_the_mean_with_a_band():
    from experiments import reproduce_sparse_switch as R

    pts = [_sparse_point(R, n, d, sd, 10.0 * n / d) for d in (1.0, 0.1) for n in (2, 8) for sd in (0, 1)]
    table = R.seeds_table(pts)
    assert " ± " in table and len(table.splitlines()) == 2 + 4
    mean = R.mean_point([p for p in pts if (p.n, p.density) == (8, 0.1)])
    assert mean.times_us["sparse-switch"] == pytest.approx(10.0 * 80 * 5 * 1.05)
    pool = [_sparse_point(R, 8, d, sd, 64.0 / size / d) for d in (1.0, 0.1) for size in (4, 16) for sd in (0, 1)]
    for p, size in zip(pool, [size for _ in (1.0, 0.1) for size in (4, 16) for _ in (0, 1)]):
        p.pool, p.times_us["switch"] = size, 50.0 / size          # the dense switch: the same for any density
    figs = R.plot(pts, pool, [2, 8], [1.0, 0.1])
    for stem, fig in figs.items():
        assert problems(fig) == [] and any(ax.collections for ax in fig.axes), stem


def test_sparse_switch_seed_moves_the_blocks():
    from experiments import reproduce_sparse_switch as R

    a, b = (R._data(2, 8192, 0.1, "full", sd)[0] for sd in (0, 1))
    assert a.sum() == b.sum() and not bool((a == b).all())


# ----------------------------------------------------------------------------- the training reproduction
def test_training_seed_changes_weights_and_batches_and_seed_0_is_the_old_stream():
    import torch

    from experiments import reproduce_training as T

    t0, t1 = T.digits_task(quick=True), T.digits_task(quick=True, seed=1)
    assert not torch.equal(t0.batch(0, 0)[0], t1.batch(0, 0)[0])
    w0, w1 = (next(t.build().parameters()) for t in (t0, t1))
    assert not torch.equal(w0, w1)
    g = torch.Generator().manual_seed(1_000_003 * 1 + 0)          # worker 0's step 0, as before --seeds
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))
    idx = order[1797 // 5:][torch.randint(0, 1797 - 1797 // 5, (32,), generator=g)]
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    assert torch.equal(t0.batch(0, 0)[0], x[idx])


def _run(model, scheme, seed, curve, target, reached):
    elapsed = curve[-1][0]
    row = {"model": model, "scheme": scheme, "transport": "t", "hosts": 2, "gbps": "loopback",
           "time_to_target_s": elapsed if reached else float("nan"), "steps_to_target": curve[-1][1] if reached else "",
           "reached": reached, "bytes_per_step": 1e5 * (1 + seed), "comm_fraction": 0.5, "target": target,
           "metric": curve[-1][2], "compute_s": 0.01, "step_s": elapsed / curve[-1][1], "modelled_s": float("nan"),
           "modelled_ratio": float("nan"), "note": "", "seed": seed}
    return {"row": row, "curve": curve, "describe": "", "info": {}}


def test_training_over_seeds_tables_mean_std_and_draws_bands_and_error_bars(tmp_path, monkeypatch):
    from experiments import reproduce_training as T
    from experiments.common import plots

    figs = {}
    real = plots.save

    def keep(fig, path, *a, **kw):
        figs[path.name] = fig
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(plots, "save", keep)
    results = []
    for sd in (0, 1, 2):
        f = 1 + 0.1 * sd
        results += [_run("mlp", "ddp", sd, [(0.5 * t * f, 5 * t, 0.2 * t) for t in range(1, 6)], 0.9, True),
                    _run("mlp", "hook powersgd", sd, [(0.3 * t * f, 5 * t, 0.1 * t) for t in range(1, 6)], 0.9,
                         sd == 0)]
    table = T.seeds_table(results)
    assert "over 3 seeds" in table and "1/3" in table and "3/3" in table and "2.75 ± 0.25" in table
    T.figures(results, tmp_path)
    acc, ttt = figs["time_to_accuracy.png"], figs["time_to_target.png"]
    assert problems(acc) == [] and problems(ttt) == []
    assert len(acc.axes[0].collections) == 2, "one band per scheme"
    assert any(len(c.get_segments()) for c in ttt.axes[0].collections), "no error bars on the time to target"
    assert T.merge(results[:2], results[2:]) == sorted(results, key=lambda r: (r["row"]["model"],
                                                                               r["row"]["scheme"] != "ddp",
                                                                               r["row"]["seed"]))
