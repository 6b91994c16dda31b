"""The studies' figures keep the rules of ``tests/_figures.py`` (labels in words with units, integer ticks on
counts, no empty panel, no overlapping tick labels, legends that match what is drawn, coinciding curves drawn
once and named), checked on the ``Figure`` objects the plotting functions return; and the checker catches
each defect it names."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from experiments import ablation, convergence  # noqa: E402
from experiments.common import plots  # noqa: E402

from tests._figures import problems  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    plt.close("all")


@pytest.fixture
def saved(monkeypatch):
    """The figures the code under test hands to ``plots.save``, by file name."""
    figures = {}
    real = plots.save

    def keep(fig, path, **kw):
        figures[path.name] = fig
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save", keep)
    return figures


# ----------------------------------------------------------------------------- the checker can fail
def _good(ax):
    ax.plot([1, 2, 3], [3, 1, 2], color="C0", label="measured time")
    ax.set(xlabel="training step", ylabel="held-out loss")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend()


@pytest.mark.parametrize("spoil, words", [
    (lambda fig, ax: None, None),
    (lambda fig, ax: fig.add_subplot(2, 1, 2).set(xlabel="training step", ylabel="loss"), "empty panel"),
    (lambda fig, ax: ax.set_ylabel("best test_acc so far"), "not in words"),
    (lambda fig, ax: ax.set_xlabel(""), "no x label"),
    (lambda fig, ax: ax.set_ylabel("communication time"), "without its unit"),
    (lambda fig, ax: ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(0.25)), "counts"),
    (lambda fig, ax: ax.axhline(2.5, color="grey", ls="--"), "is in no legend"),
    (lambda fig, ax: (ax.plot([1, 2, 3], [3, 1, 2], color="C1", label="other"), ax.legend()), "hidden under"),
    (lambda fig, ax: (ax.plot([1, 2, 3], [2, 2, 2], color="C0", label="twin"), ax.legend()), "look the same"),
    (lambda fig, ax: ax.set_yticks([1 + i / 20 for i in range(41)]), "overlap"),
    (lambda fig, ax: (ax.plot([], [], color="C3", label="nothing"), ax.legend()), "matches no visible"),
])
def test_the_checker_names_each_defect(spoil, words):
    fig = plt.figure(figsize=(5, 4))
    ax = fig.add_subplot(2, 1, 1) if words == "empty panel" else fig.add_subplot(1, 1, 1)
    _good(ax)
    spoil(fig, ax)
    found = problems(fig)
    if words is None:
        assert found == []
    else:
        assert any(words in p for p in found), found


# ----------------------------------------------------------------------------- the studies' figures
def _ablation_argv(tmp_path):
    # none and ef on allgather send the same bytes: their time per step coincides (and so may the curves)
    return ["--task", "breast-cancer-logreg", "--compressor", "topk", "--method", "none", "ef", "--transport",
            "allgather", "--workers", "2", "3", "--density", "0.2", "--steps", "4", "--eval-every", "1",
            "--target-acc", "0.6", "--out", str(tmp_path), "--no-progress"]


def test_ablation_figure_keeps_the_rules_and_shows_coinciding_curves(tmp_path, saved):
    assert ablation.main(_ablation_argv(tmp_path)) == 0
    fig = saved["ablation.png"]
    assert problems(fig) == []
    ax_t, ax_b, ax_w = fig.axes
    assert ax_t.get_ylabel() == "best held-out accuracy so far"
    assert [round(t) for t in ax_w.get_xticks()] == [2, 3]
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    # the two series take the same time per step: both curves drawn in the workers panel, told apart by
    # their markers, each once in the legend (no entry merging them, none twice)
    assert labels == ["topk(ratio=0.2) / allgather", "ef+topk(ratio=0.2) / allgather",
                      "target held-out accuracy 0.6"], labels
    lines = {ln.get_label(): ln for ln in ax_w.get_lines()}
    a, b = lines["topk(ratio=0.2) / allgather"], lines["ef+topk(ratio=0.2) / allgather"]
    assert list(a.get_ydata()) == list(b.get_ydata()) and a.get_marker() != b.get_marker()
    # the legend is outside the panels (below them)
    fig.canvas.draw()
    legend_top = fig.legends[0].get_window_extent().y1
    assert all(legend_top <= ax.get_window_extent().y0 for ax in fig.axes)


def test_convergence_writes_a_plot_under_a_clean_name(tmp_path, saved):
    argv = ["--task", "breast-cancer-logreg", "--compressor", "topk", "--ratio", "0.3", "--method", "ef",
            "--transport", "allgather", "--workers", "2", "--steps", "4", "--eval-every", "2", "--no-progress",
            "--out", str(tmp_path)]
    assert convergence.main(argv) == 0
    stem = "breast-cancer-logreg_ef-topk-ratio-0.3_allgather_n2_s0"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.csv", f"{stem}.json", f"{stem}.png"]
    assert problems(saved[f"{stem}.png"]) == []


#: each reproduction at a size that runs in seconds (its figures are the same functions as at full size)
REPRODUCTIONS = {
    "reproduce_diana": ["--iters", "40", "--multipliers", "1,4", "--ratio", "1"],   # 6-digit bit counts
    "reproduce_ef21": ["--iters", "40", "--multipliers", "1,4"],
    "reproduce_marina": ["--iters", "40", "--ks", "1,5"],
    "reproduce_99": ["--ns", "4,10", "--m", "20", "--eps", "1e-3"],
    "reproduce_rates": ["--omegas", "0,1,3", "--ns", "1,4", "--d", "8", "--rows", "64"],
    "reproduce_switchml": [],
    "reproduce_omnireduce": ["--numel", "16384", "--densities", "1", "0.1"],
    "reproduce_sparse_switch": ["--numel", "16384", "--ns", "2", "4", "--densities", "1", "0.1"],
}


#: the switch emulation of the quick SwitchML reproduction takes about 20 s
SLOW = {"reproduce_switchml"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                  for n in sorted(REPRODUCTIONS)])
def test_reproduction_figures_keep_the_rules(name, tmp_path, monkeypatch):
    import importlib

    from experiments.common import reproduce as U

    figures = {}
    real = U.Run.save_figure

    def keep(self, fig, stem):
        figures[stem] = fig
        return real(self, fig, stem)

    monkeypatch.setattr(U.Run, "save_figure", keep)
    mod = importlib.import_module(f"experiments.{name}")
    mod.main(["--quick", "--no-progress", "--no-wandb", "--out", str(tmp_path), *REPRODUCTIONS[name]])
    assert figures, f"{name} drew no figure"
    found = {stem: problems(fig) for stem, fig in figures.items()}
    assert found == {stem: [] for stem in figures}
    for stem in LEGENDS_OUTSIDE.intersection(figures):
        assert _legends_inside(figures[stem]) == [], stem


#: figures whose legends would cover their curves: drawn outside the panels
LEGENDS_OUTSIDE = {"diana_vs_dcgd", "omnireduce_vs_density", "omnireduce_vs_workers"}


def _legends_inside(fig) -> list[str]:
    """The panels whose own legend overlaps their plotting area."""
    fig.canvas.draw()
    out = []
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None and leg.get_window_extent().overlaps(ax.get_window_extent()):
            out.append(ax.get_title() or "panel")
    return out


# ----------------------------------------------------------------------------- the drawing rules
def test_curves_that_differ_but_coincide_are_all_drawn_with_their_own_markers():
    fig, ax = plt.subplots()
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    y = [5.0, 4.0, 3.5, 3.0, 2.8, 2.7, 2.6]
    close = [v + 1e-3 for v in y]                       # differs, but under a pixel on this panel
    plots.plot_series(ax, [dict(x=x, y=y, label="none / ring", color="C0"),
                           dict(x=x, y=close, label="top-k + EF / ring", color="C1")])
    ax.set(xlabel="training step", ylabel="held-out loss")
    ax.legend()
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == ["none / ring", "top-k + EF / ring"]
    assert lines[0].get_marker() != lines[1].get_marker()
    assert problems(fig) == []
    plt.close(fig)


def test_only_the_same_numbers_or_one_merge_key_are_one_curve():
    fig, ax = plt.subplots()
    x, y = [1.0, 2.0, 3.0], [3.0, 2.0, 1.5]
    plots.plot_series(ax, [dict(x=x, y=y, label="a / ring", color="C0"),
                           dict(x=x, y=list(y), label="a / switch", color="C0"),
                           dict(x=x, y=[v + 1e-4 for v in y], label="b / ring", color="C1", merge="b"),
                           dict(x=x, y=[v + 2e-4 for v in y], label="b / switch", color="C1", merge="b")])
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert labels == ["a / ring, switch (same curve)", "b / ring, switch (same curve)"], labels
    plt.close(fig)


def test_bars_on_a_log_axis_start_at_a_stated_decade():
    fig, ax = plt.subplots()
    ax.bar([0, 1, 2], [350.0, 2e4, 1.2e5])
    assert plots.log_bars(ax, [350.0, 2e4, 1.2e5]) == 100.0
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] == 100.0
    plt.close(fig)


def test_a_reproduction_over_seeds_draws_the_mean_with_a_band(tmp_path, monkeypatch, capsys):
    from experiments import reproduce_diana
    from experiments.common import reproduce as U

    figures = {}
    real = U.Run.save_figure

    def keep(self, fig, stem):
        figures[stem] = fig
        return real(self, fig, stem)

    monkeypatch.setattr(U.Run, "save_figure", keep)
    summary = reproduce_diana.main(["--quick", "--no-progress", "--no-wandb", "--out", str(tmp_path), "--iters", "40",
                                    "--multipliers", "1", "--ratio", "0.1", "--seeds", "3"])
    assert summary["DIANA_x1"]["seeds"]["seeds"] == [0, 1, 2]
    assert len(set(summary["DIANA_x1"]["seeds"]["final"])) == 3, "the seeds drew the same rand-k"
    assert "over 3 seeds: log10 final" in capsys.readouterr().out
    fig = figures["diana_vs_dcgd"]
    assert problems(fig) == [] and all(ax.collections for ax in fig.axes)
