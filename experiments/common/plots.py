"""Figures of the studies (matplotlib, Agg backend: no display needed).

Colour = compression scheme, line style / hatch = transport, so one legend reads every panel. The figure
functions return the ``Figure`` (tests inspect it: ``tests/_figures.py``); :func:`save` writes it.

What every figure keeps: axes labelled in words with their units; integer ticks on an axis that counts
(:func:`count_axis`); log axes labelled with plain numbers at 1-2-5 steps or decades, never overlapping
(:func:`log_axis`); no empty panel (a series of one point is drawn as a marker); legends that match what is
drawn, outside the data; no hidden curve: series with the same numbers are drawn once, labelled with every
series they stand for, and curves that differ but lie on top of each other (within :data:`COINCIDE` of the
panel's range everywhere, under a pixel) each get a marker of their own (:func:`plot_series`). Several
seeds: the mean with a band of +- one standard deviation (:func:`mean_std`).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

#: line style per transport (a dash pattern each, so that no two transports look alike)
LINESTYLES = {"ring": "-", "omnireduce": "--", "switch": ":", "sparse-switch": (0, (4, 1.5, 1, 1.5, 1, 1.5)),
              "allgather": "-.", "native": (0, (1, 1))}
HATCHES = {"ring": "", "omnireduce": "//", "switch": "..", "sparse-switch": "\\\\", "allgather": "xx",
           "native": "--"}
#: two curves closer than this fraction of the panel's data range, at every point, lie on top of each other
#: (under a pixel): each is drawn with a marker of its own (:func:`plot_series`)
COINCIDE = 2e-3
#: two curves this close are the same numbers (up to rounding): drawn once, the legend naming both
IDENTICAL = 1e-6
#: curves closer than this fraction of the panel's range everywhere are near enough to need markers
NEAR = 1e-2
#: markers that tell coinciding curves apart
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DPI = 110


def _colours(keys: Sequence[str]) -> dict[str, Any]:
    keys = list(dict.fromkeys(keys))
    cmap = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    return {k: cmap(i % cmap.N) for i, k in enumerate(keys)}


def save(fig, path: Path, description: str | None = None) -> Path:
    """Write ``fig`` as a PNG (creating the folder), with ``description`` in its ``Description`` text chunk
    when given, and release it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Description": description} if description else None)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- axes
def count_axis(axis, values: Sequence[float] | None = None) -> None:
    """An axis that counts (steps, workers, iterations): integer ticks; at ``values`` when given."""
    if values is not None:
        axis.set_major_locator(FixedLocator(sorted(set(int(v) for v in values))))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v))}"))
    else:
        axis.set_major_locator(MaxNLocator(integer=True))


def _number(v: float) -> str:
    """A tick value as a short plain number (``0.02``, ``300``, ``2k``, ``1.5M``), ``1e-05`` when tiny."""
    if v == 0:
        return "0"
    a = abs(v)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def log_axis(axis, lo: float, hi: float) -> None:
    """A log axis over the data range [lo, hi]: ticks at 1-2-5 steps when it spans less than two decades
    (finer under 0.7), else at decades (every second or third when there are many); plain-number labels;
    minor ticks unlabelled."""
    lo, hi = max(lo, 1e-300), max(hi, 1e-300)
    decades = math.log10(hi / lo) if hi > lo else 0.0
    if decades < 0.7:
        locator = LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0), numticks=12)
    elif decades < 2:
        locator = LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12)
    else:
        locator = LogLocator(base=10, numticks=7)
    axis.set_major_locator(locator)
    axis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))
    axis.set_minor_formatter(NullFormatter())


def log_axes(ax, xs: Sequence[float] | None = None, ys: Sequence[float] | None = None) -> None:
    """:func:`log_axis` on the x axis over ``xs`` and the y axis over ``ys`` (the data drawn), where given."""
    for axis, values in ((ax.xaxis, xs), (ax.yaxis, ys)):
        v = _finite(values) if values is not None else np.array([])
        v = v[v > 0]
        if v.size:
            log_axis(axis, v.min(), v.max())


def legend_below(ax, *, ncol: int = 2, fontsize: float = 7, **kw):
    """The panel's legend under its x label, outside the data (``fig.tight_layout()`` makes room for it)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, fontsize=fontsize,
                     frameon=False, **kw)


def log_bars(ax, values: Sequence[float]) -> float:
    """A log y axis for bars: its bottom at a stated baseline, the decade at or below the smallest bar
    (a bar's length then reads against that baseline, named in the axis label by the caller); returns it."""
    v = _finite(values)
    v = v[v > 0]
    ax.set_yscale("log")
    if not v.size:
        return 1.0
    base = 10.0 ** math.floor(math.log10(v.min()))
    ax.set_ylim(bottom=base, top=v.max() * 1.3)
    log_axis(ax.yaxis, base, v.max())
    return base


def si_axis(axis) -> None:
    """Large counts (bits, bytes) as ``50k``, ``1.5M``: short labels that do not run into each other."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))


def _span(values: np.ndarray, log: bool) -> float:
    v = values[np.isfinite(values)]
    if log:
        v = np.log10(v[v > 0])
    return float(v.max() - v.min()) if v.size else 0.0


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], span: tuple[float, float],
          log: tuple[bool, bool], tol: float = COINCIDE) -> bool:
    """Do two curves coincide: the same number of points, each within ``tol`` of the panel's range."""
    if a[0].shape != b[0].shape:
        return False
    for k in (0, 1):
        u, v = a[k], b[k]
        if log[k]:
            if np.any(u <= 0) or np.any(v <= 0):
                return False
            u, v = np.log10(u), np.log10(v)
        if np.any(np.abs(u - v) > tol * max(span[k], 1e-300)):
            return False
    return True


def plot_series(ax, series: list[dict[str, Any]], *, xlog: bool = False, ylog: bool = False,
                label_group=None, merge_identical: bool = True) -> None:
    """Draw ``series`` (dicts ``x``, ``y``, ``label``, optional ``merge`` and line keywords ``color``,
    ``ls``, ``marker``, ...) on ``ax`` so that no curve hides another.

    - Series with the same numbers (within :data:`IDENTICAL` of the panel's range; only when
      ``merge_identical``), or with the same ``merge`` key (e.g. one scheme over transports that compute
      the same sum) that coincide (:data:`COINCIDE`), are one curve: drawn once, labelled by
      ``label_group(labels)`` (default :func:`coincide_label`).
    - Curves that lie on or near each other (within :data:`NEAR` of the panel's range everywhere) and do not
      already carry distinct markers are each given a marker of their own (:data:`MARKERS`, at staggered
      points), so every one of them shows and the legend tells them apart.

    A series of one point is drawn as a marker."""
    pts = [(np.asarray(s["x"], dtype=float), np.asarray(s["y"], dtype=float)) for s in series]
    if not pts:
        return
    allx = np.concatenate([p[0] for p in pts])
    ally = np.concatenate([p[1] for p in pts])
    span = (_span(allx, xlog), _span(ally, ylog))
    log = (xlog, ylog)
    groups: list[list[int]] = []
    for i, p in enumerate(pts):
        for g in groups:
            head = series[g[0]]
            same_key = head.get("merge") is not None and head.get("merge") == series[i].get("merge")
            if ((same_key and _same(pts[g[0]], p, span, log, COINCIDE))
                    or (merge_identical and _same(pts[g[0]], p, span, log, IDENTICAL))):
                g.append(i)
                break
        else:
            groups.append([i])
    clusters: list[list[int]] = []
    for gi, g in enumerate(groups):
        for cl in clusters:
            if _same(pts[groups[cl[0]][0]], pts[g[0]], span, log, NEAR):
                cl.append(gi)
                break
        else:
            clusters.append([gi])
    marker_of: dict[int, dict[str, Any]] = {}
    for cl in clusters:
        own = [series[groups[gi][0]].get("marker") for gi in cl]
        if len(cl) > 1 and (None in own or len(set(own)) < len(own)):
            for j, gi in enumerate(cl):
                n = len(pts[groups[gi][0]][0])
                every = len(cl) if n > 2 * len(cl) else 1
                marker_of[gi] = dict(marker=MARKERS[j % len(MARKERS)], ms=5, markevery=(j % every, every))
    for gi, g in enumerate(groups):
        s = series[g[0]]
        label = s["label"] if len(g) == 1 else (label_group or coincide_label)([series[i]["label"] for i in g])
        kw = {k: v for k, v in s.items() if k not in ("x", "y", "label", "merge")}
        kw.update(marker_of.get(gi, {}))
        x, y = pts[g[0]]
        if np.sum(np.isfinite(x) & np.isfinite(y)) == 1:
            kw.setdefault("marker", "o")
        ax.plot(x, y, label=label, **kw)


def coincide_label(labels: Sequence[str]) -> str:
    """The label of curves drawn as one: ``"A = B (same curve)"``; labels ``"scheme / transport"`` that
    share their scheme are listed once (``"none / ring, switch = QSGD / allgather (same curve)"``); wrapped
    to stay narrow."""
    by_head: dict[str, list[str]] = {}
    for lab in labels:
        head, sep, tail = lab.partition(" / ")
        by_head.setdefault(head, []).append(tail if sep else "")
    parts = [head + (" / " + ", ".join(t for t in tails if t) if any(tails) else "")
             for head, tails in by_head.items()]
    return textwrap.fill(" = ".join(parts) + " (same curve)", width=60)


def _finite(values) -> np.ndarray:
    a = np.asarray(list(values), dtype=float)
    return a[np.isfinite(a)]


# ------------------------------------------------------------------------------------- the demo
def demo_figure(by_task: dict[str, list[dict]], bandwidths: Sequence[float], title: str = ""):
    """One row per task: held-out loss vs training step; held-out loss vs cumulative modelled communication
    time (at the first bandwidth); bytes sent per worker per step; modelled communication time per step at
    each bandwidth. ``by_task[task]`` holds entries ``{"scheme", "transport", "records", "initial",
    "summary", "comm_per_step": {bw: seconds}}``. Returns the figure."""
    tasks_ = list(by_task)
    fig, axes = plt.subplots(len(tasks_), 4, figsize=(23, 5.4 * len(tasks_)), squeeze=False,
                             gridspec_kw={"width_ratios": (1, 1, 1.15, 1.15)})
    colours = _colours([e["scheme"] for es in by_task.values() for e in es])
    bw0 = bandwidths[0]
    for row, task in enumerate(tasks_):
        entries = by_task[task]
        ax_step, ax_time, ax_bytes, ax_comm = axes[row]
        style = {id(e): dict(color=colours[e["scheme"]], ls=LINESTYLES.get(e["transport"], "-"), lw=1.6)
                 for e in entries}
        steps = []
        for e in entries:
            recs = ([e["initial"]] if e.get("initial") else []) + e["records"]
            steps.append([(r["step"], r["test_loss"]) for r in recs if "test_loss" in r])
        # the transport does not change training: a scheme's curves coincide, and are drawn once
        ran = {}
        for e in entries:
            ran.setdefault(e["scheme"], set()).add(e["transport"])

        def every_transport(labels: list[str]) -> str:
            schemes = list(dict.fromkeys(lab.partition(" / ")[0] for lab in labels))
            if all({lab.partition(" / ")[2] for lab in labels if lab.startswith(f"{sc} / ")} == ran[sc]
                   for sc in schemes):
                return " = ".join(f"{sc} / all {len(ran[sc])} transports" for sc in schemes) + " (same curve)"
            return coincide_label(labels)

        plot_series(ax_step, [dict(x=[p[0] for p in s], y=[p[1] for p in s], label=f"{e['scheme']} / {e['transport']}",
                                   merge=e["scheme"], **style[id(e)]) for e, s in zip(entries, steps)],
                    label_group=every_transport)
        ax_step.set(title=f"{task}: held-out loss vs training step", xlabel="training step",
                    ylabel="held-out loss")
        count_axis(ax_step.xaxis)
        ax_step.legend(fontsize=7)
        times = []
        for e in entries:
            pts = [(r["modelled_time_s"] * 1e3, r["test_loss"]) for r in e["records"] if "test_loss" in r]
            times.append(pts)
            ax_time.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                         label=f"{e['scheme']} / {e['transport']}", **style[id(e)])
        ax_time.set(title=f"{task}: held-out loss vs communication time ({bw0:g} Gbps)",
                    xlabel="cumulative modelled communication time (ms, log scale)", ylabel="held-out loss")
        ax_time.set_xscale("log")
        xs = _finite(p[0] for pts in times for p in pts)
        if xs.size:
            log_axis(ax_time.xaxis, xs.min(), xs.max())
        labels = [f"{e['scheme']}\n{e['transport']}" for e in entries]
        x = np.arange(len(entries))
        cols = [colours[e["scheme"]] for e in entries]
        hatches = [HATCHES.get(e["transport"], "") for e in entries]
        vals = [e["summary"]["bytes_per_step"] for e in entries]
        bars = ax_bytes.bar(x, vals, color=cols, edgecolor="black", linewidth=0.4)
        for b, h in zip(bars, hatches):
            b.set_hatch(h)
        base = log_bars(ax_bytes, vals)
        ax_bytes.set(title=f"{task}: bytes sent per worker per step\n(bars from {_number(base)} B)",
                     ylabel="bytes sent per worker per step (log scale)")
        width = 0.8 / max(1, len(bandwidths))
        comm = []
        for j, bw in enumerate(bandwidths):
            v = [e["comm_per_step"].get(bw, np.nan) * 1e6 for e in entries]
            comm += v
            bars = ax_comm.bar(x + (j - (len(bandwidths) - 1) / 2) * width, v, width, color=cols,
                               alpha=1.0 if j == 0 else 0.45, edgecolor="black", linewidth=0.4)
            for b, h in zip(bars, hatches):
                b.set_hatch(h)
        base = log_bars(ax_comm, comm)
        ax_comm.set(title=f"{task}: modelled communication time per step\n(solid: {bandwidths[0]:g} Gbps, "
                          f"pale: {', '.join(f'{b:g}' for b in bandwidths[1:])} Gbps; bars from {_number(base)} µs)",
                    ylabel="modelled communication time per step (µs, log scale)")
        for ax in (ax_bytes, ax_comm):
            ax.set_xticks(x, labels, rotation=90, fontsize=7)
            ax.set_xlabel("compression scheme / transport")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    handles, labels = axes[0][1].get_legend_handles_labels()
    ncol = min(6, len(labels))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9,
               title="colour: compression scheme; line style / hatch: transport", title_fontsize=9)
    if title:
        fig.suptitle(title)
    rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, (0.035 + 0.022 * rows) * 2 / len(tasks_), 1, 0.98))
    return fig


# ------------------------------------------------------------------------------------- ablations
def ablation_figure(cells: list[dict], target: float | None, metric: str = "test_acc",
                    metric_name: str = "held-out accuracy"):
    """Three panels over finished cells ``{"label", "series", "scheme", "transport", "workers", "records",
    "summary"}`` (a series is a cell without its worker count; a cell run for several seeds appears once
    per seed): the best ``metric_name`` so far vs modelled communication time (time to accuracy) and vs
    cumulative bytes sent per worker (bytes to accuracy), at the largest worker count; modelled
    communication time per step vs workers. One colour per series, line style = transport; the target is a
    labelled line; over several seeds the mean, with a band (error bars in the workers panel) of +- one
    standard deviation. The legend is below the panels. Returns the figure."""
    fig, (ax_t, ax_b, ax_w) = plt.subplots(1, 3, figsize=(20, 5.8))
    series = list(dict.fromkeys(c["series"] for c in cells))
    colour = _colours(series)
    # every series its own marker too: curves that coincide (the same bytes, the same accuracy) all show
    marker = {key: MARKERS[i % len(MARKERS)] for i, key in enumerate(series)}
    top = max((c["workers"] for c in cells), default=0)
    nseeds = max((sum(1 for d in cells if (d["series"], d["workers"]) == (c["series"], c["workers"]))
                  for c in cells), default=1)
    tcurves, bcurves, bands = [], [], []
    for key in series:
        runs = []
        for c in cells:
            if c["series"] != key or c["workers"] != top:
                continue
            sent, evals = 0.0, []
            for r in c["records"]:
                sent += r["bytes_sent"]
                if metric in r:
                    evals.append({"step": r["step"], "t": r["modelled_time_s"] * 1e3, "b": sent, "v": r[metric]})
            best = np.maximum.accumulate([e["v"] for e in evals]) if evals else []
            runs.append([{**e, "best": b} for e, b in zip(evals, best)])
        runs = [r for r in runs if r]
        if not runs:
            continue
        tr = next(c["transport"] for c in cells if c["series"] == key)
        n = min(len(r) for r in runs)
        every = 3 if n > 6 else 1
        style = dict(color=colour[key], ls=LINESTYLES.get(tr, "-"), lw=1.4, marker=marker[key], ms=5, mfc="none",
                     markevery=(series.index(key) % every, every))
        _, t, _ = mean_std(runs, "t")
        _, b, _ = mean_std(runs, "b")
        _, best, sd = mean_std(runs, "best")
        tcurves.append(dict(x=t, y=best, label=key, **style))
        bcurves.append(dict(x=b, y=best, label=key, **style))
        if len(runs) > 1:
            bands.append((t, b, best, sd, colour[key]))
    for t, b, best, sd, col in bands:
        ax_t.fill_between(t, best - sd, best + sd, color=col, alpha=0.15, lw=0)
        ax_b.fill_between(b, best - sd, best + sd, color=col, alpha=0.15, lw=0)
    plot_series(ax_t, tcurves, xlog=True, merge_identical=False)
    plot_series(ax_b, bcurves, xlog=True, merge_identical=False)
    if target is not None:
        for ax in (ax_t, ax_b):
            ax.axhline(target, color="0.45", lw=1.0, ls=(0, (6, 3)), label=f"target {metric_name} {target:g}")
    ylabel = f"best {metric_name} so far"
    seeds = f", mean of {nseeds} seeds" if nseeds > 1 else ""
    ax_t.set(title=f"time to accuracy ({top} workers{seeds})",
             xlabel="modelled communication time (ms, log scale)", ylabel=ylabel)
    ax_b.set(title=f"bytes to accuracy ({top} workers{seeds})",
             xlabel="cumulative bytes sent per worker (log scale)", ylabel=ylabel)
    for ax, curves in ((ax_t, tcurves), (ax_b, bcurves)):
        ax.set_xscale("log")
        xs = _finite(v for s in curves for v in s["x"])
        if xs.size:
            log_axis(ax.xaxis, xs.min(), xs.max())
    wcurves, workers = [], set()
    for key in series:
        by_n: dict[int, list[float]] = {}
        for c in cells:
            if c["series"] == key:
                by_n.setdefault(c["workers"], []).append(c["summary"]["modelled_comm_per_step_s"] * 1e6)
        ns = sorted(by_n)
        workers |= set(ns)
        mean = np.array([np.mean(by_n[n]) for n in ns])
        sd = np.array([np.std(by_n[n], ddof=1) if len(by_n[n]) > 1 else 0.0 for n in ns])
        tr = next(c["transport"] for c in cells if c["series"] == key)
        wcurves.append(dict(x=ns, y=mean, label=key, marker=marker[key], ms=8, mfc="none", mew=1.3,
                            color=colour[key], ls=LINESTYLES.get(tr, "-")))
        if np.any(sd > 0):
            ax_w.errorbar(ns, mean, yerr=sd, fmt="none", ecolor=colour[key], elinewidth=1.0)
    plot_series(ax_w, wcurves, ylog=True, merge_identical=False)
    ax_w.set(title=f"modelled communication time per step vs workers{seeds}", xlabel="workers",
             ylabel="modelled communication time per step (µs, log scale)")
    ax_w.set_yscale("log")
    ys = _finite(v for s in wcurves for v in s["y"])
    if ys.size:
        log_axis(ax_w.yaxis, ys.min(), ys.max())
    count_axis(ax_w.xaxis, workers)
    for ax in (ax_t, ax_b, ax_w):
        ax.grid(alpha=0.3)
    # one legend for the three panels, below them: each curve's label once
    handles, labels = [], []
    for ax in (ax_w, ax_t, ax_b):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = 2 if len(labels) > 4 else len(labels) or 1
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8,
               title=f"shaded: ± one standard deviation over {nseeds} seeds" if nseeds > 1 else None,
               title_fontsize=8)
    lines = sum(lab.count("\n") + 1 for lab in labels[::ncol]) if labels else 1
    fig.tight_layout(rect=(0, min(0.6, 0.03 + 0.032 * (lines + (nseeds > 1))), 1, 1))
    return fig


# ------------------------------------------------------------------------------------- one run
def mean_std(runs: Sequence[Sequence[dict]], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, mean, std)`` of ``key`` over ``runs`` (lists of records), at the ``x`` values every run has
    (sorted); std is the sample standard deviation (``ddof=1``; 0 for a single run)."""
    per_run = [{r[x]: r[key] for r in recs if key in r and x in r} for recs in runs]
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    vals = np.array([[d[k] for k in common] for d in per_run], dtype=float).reshape(len(per_run), len(common))
    mean = vals.mean(0) if len(per_run) else np.array([])
    std = vals.std(0, ddof=1) if len(per_run) > 1 else np.zeros_like(mean)
    return np.asarray(common, dtype=float), mean, std


def _band(ax, x: np.ndarray, mean: np.ndarray, std: np.ndarray, n: int, color: str, label: str, **kw) -> None:
    """A mean curve, with a shaded band of +- one standard deviation when there are several runs."""
    if n > 1:
        ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, lw=0)
        label = f"{label}, mean ± std of {n} seeds"
    ax.plot(x, mean, color=color, label=label, **kw)


def convergence_figure(runs: Sequence[tuple[list[dict], dict | None]], title: str, *, modelled: bool,
                       metric_name: str = "held-out accuracy"):
    """One configuration over one or more seeds (``runs``: ``(records, initial)`` per seed): training and
    held-out loss vs training step; ``metric_name`` vs training step; held-out loss vs cumulative
    communication time (modelled by the SimFabric when ``modelled``, else the measured wall-clock time of
    the collectives). Several runs are drawn as their mean with a shaded band of +- one standard deviation.
    Returns the figure."""
    fig, (ax_l, ax_a, ax_c) = plt.subplots(1, 3, figsize=(17, 4.8))
    n = len(runs)
    recs = [([initial] if initial else []) + list(records) for records, initial in runs]
    _band(ax_l, *mean_std([r for r, _ in runs], "loss"), n, "tab:blue", "training loss (mini-batches)", lw=1.2)
    _band(ax_l, *mean_std(recs, "test_loss"), n, "tab:orange", "held-out loss", marker="o", ms=3, lw=1.6)
    ax_l.set(title="loss vs training step", xlabel="training step", ylabel="loss")
    ax_l.legend(fontsize=8)
    _band(ax_a, *mean_std(recs, "test_acc"), n, "tab:green", metric_name, marker="o", ms=3)
    ax_a.set(title=f"{metric_name} vs training step", xlabel="training step", ylabel=metric_name)
    ax_a.legend(fontsize=8)
    what = "modelled" if modelled else "measured"
    timed = []
    for records, initial in runs:
        cum, t = ([{"step": 0, "comm_ms": 0.0}] if initial else []), 0.0
        for r in records:
            t += r["modelled_comm_s"] if modelled else r["measured_comm_s"]
            cum.append({"step": r["step"], "comm_ms": t * 1e3})
        timed.append(cum)
    steps, loss, std = mean_std(recs, "test_loss")
    _, comm, _ = mean_std(timed, "comm_ms")
    at = {s: c for s, c in zip(mean_std(timed, "comm_ms")[0], comm)}
    keep = [i for i, s in enumerate(steps) if s in at]
    x = np.array([at[steps[i]] for i in keep])
    _band(ax_c, x, loss[keep], std[keep], n, "tab:orange", "held-out loss", marker="o", ms=3)
    ax_c.set(title=f"held-out loss vs {what} communication time",
             xlabel=f"cumulative {what} communication time (ms{', mean of the seeds' if n > 1 else ''})",
             ylabel="held-out loss")
    ax_c.legend(fontsize=8)
    for ax in (ax_l, ax_a):
        count_axis(ax.xaxis)
    for ax in (ax_l, ax_a, ax_c):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
