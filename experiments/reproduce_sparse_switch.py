"""Where does OmniReduce's look-ahead on a SwitchML switch win? (``sparse-switch``), on the SimFabric.

Expected shape, to confirm or refute: ``sparse-switch`` is flat in the number of workers ``n`` like the
dense ``switch`` (every worker sends its blocks once and receives the union once, whatever ``n``) and
falls with the block density like OmniReduce (only non-zero blocks travel), so it beats both where
data are sparse and ``n`` is large; it should not win where the union is dense and the pool too small
to cover the bandwidth-delay product (pool pressure), nor on small tensors, where its two set-up round
trips (control, look-ahead) cost more than the data.

Experiments (100 Gbit/s, 2 us per hop; the switch is a per-port endpoint with the same links; dedicated
OmniReduce aggregators, one per worker, with the workers' bandwidth):

E1  time vs density (1, 0.5, 0.1, 0.01) and vs workers (2..64, and 256) for ring, switch (dense; past 32
    workers a bitmap of one 32-bit word per 32 workers), omnireduce colocated and dedicated (up to
    ``--omni-max`` workers, default 64, and at every n at ``--omni-wide-densities``, default 0.01:
    OmniReduce's messages grow as n^2, so its 256-worker points at every density would take the default
    run past its time), and sparse-switch, with the closed form
    :func:`theory.costs.sparse_switch_allreduce` (with the data's measured union, own blocks and waves
    of the stream; the expectation-only form in the CSV). The ring's and the dense switch's modelled times
    and bytes depend on the tensor's size, not on its values, so each is run once per ``(n, numel, pool)``
    and shared by the densities and seeds of that point;
E2  pool pressure: n = 8, density 1 and 0.1, pool 4..256 slots, sparse-switch against switch;
E3  small tensors: n = 8, density 0.5, 1 KiB .. 1 MiB;
E4  (``--netbed GBPS``, root, instead of E1-E3) the same five on real processes over a netbed at n = 4:
    median wall time per all-reduce and the link-limited time.

Data: ``int(nb * density)`` non-zero blocks (256 float32 of ones) at random positions, shared by every
worker (``--overlap full``, default: the union has the workers' density, so the data volume is the same
for every n) or drawn per worker (``--overlap random``: the union grows as ``1 - (1 - d)^n``).

    python -m experiments.reproduce_sparse_switch [--quick] [--out DIR] [--overlap full|random] [--numel N]
                                                  [--ns N ...] [--densities D ...] [--skip-extra]

prints the tables and writes ``sparse_switch_vs_density.png``, ``sparse_switch_vs_workers.png``,
``sparse_switch_pool.png`` and ``sparse_switch_<overlap>.csv`` under ``DIR`` (default
``experiments/out/reproduce_sparse_switch``). ``--quick``: n <= 8, three densities, 256 KiB (about a minute
on 2 busy cores).

``--seed`` draws the non-zero blocks' positions (E1-E3), on which the union, the waves and so the sparse
transports' times depend (ring's and the dense switch's do not). ``--seeds K`` runs every E1-E3 point for
position seeds ``--seed`` .. ``--seed + K - 1``: the CSV has a row per seed (column ``seed``), the tables a
line per seed and then E1's times as mean ± std over the seeds, the verdict the means, and the figures the
mean with a ± std band. E4 (the netbed) measures wall time on one draw and takes no ``--seeds``.
"""

from __future__ import annotations

import csv
import functools
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

import sparsecomm as sc
from sparsecomm.transports.switchml.sparse.dataplane import MAX_WORKERS as SPARSE_MAX
from sparsecomm.transports.switchml.dataplane import WIDEST as SWITCH_MAX
from sparsecomm.theory import costs

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U
from .reproduce_omnireduce import CHANNELS, lanes_for, masks

NUMEL = 1 << 18           # 1 MiB of float32 (1024 blocks): the 64-worker points stay tractable
BLOCK = 256
POOL = 256
LATENCY_US = 2.0
BANDWIDTH = 100.0
WALL_TIMEOUT_S = 900.0    # the SimFabric's wall-clock guard: 64 simulated endpoints in one process are slow
TRANSPORTS = ("ring", "switch", "omni-colocated", "omni-dedicated", "sparse-switch")
#: default workers of E1 (``--ns``)
NS = (2, 4, 8, 16, 32, 64, 256)
#: OmniReduce's points stop here by default (``--omni-max``), but at :data:`OMNI_WIDE_DENSITIES`
OMNI_MAX = 64
#: the densities at which OmniReduce runs at every ``n`` of E1 (``--omni-wide-densities``)
OMNI_WIDE_DENSITIES = (0.01,)
#: the transports whose modelled time and bytes depend only on the tensor's size: run once per (n, numel, pool)
SIZE_ONLY = ("ring", "switch")
_size_only: dict[tuple, tuple[float, float]] = {}


@dataclass
class Point:
    n: int
    density: float
    numel: int
    pool: int
    overlap: str
    union_density: float
    times_us: dict = field(default_factory=dict)    # transport -> modelled time (us), NaN if not run
    form_us: float = float("nan")                   # closed form, measured union / waves
    expected_us: float = float("nan")               # closed form, expectations only
    sparse_bytes: float = float("nan")              # sparse-switch bytes sent + received per worker
    ideal_bytes: float = float("nan")               # own blocks up + union down, 4-byte look-aheads, firsts
    seed: int = 0                                   # the non-zero blocks' positions

    @property
    def error(self) -> float:
        return self.times_us["sparse-switch"] / self.form_us - 1.0

    @property
    def winner(self) -> str:
        return min((t for t in self.times_us if self.times_us[t] == self.times_us[t]), key=self.times_us.get)


def _data(n: int, numel: int, density: float, overlap: str, seed: int) -> list[torch.Tensor]:
    nb = -(-numel // BLOCK)
    xs = []
    for m in masks(n, nb, density, overlap, seed):
        if xs and overlap == "full":
            xs.append(xs[0])
            continue
        x = torch.zeros(nb, BLOCK)
        x[torch.from_numpy(m)] = 1.0
        xs.append(x.view(-1)[:numel])
    return xs


def _time(name: str, n: int, xs: list[torch.Tensor], pool: int, check: bool = True) -> tuple[float, float]:
    """Modelled time (max over workers) and mean bytes moved per worker of one all-reduce."""
    net = sc.Network(bandwidth_gbps=BANDWIDTH, latency_us=LATENCY_US, timeout_s=WALL_TIMEOUT_S)
    kw: dict = {}
    if name == "switch":
        name, kw = "switch", dict(slot_elems=BLOCK, pool_size=pool)
    elif name == "sparse-switch":
        kw = dict(pool_size=pool, slot_elems=BLOCK)
    elif name.startswith("omni"):
        lanes = lanes_for(n, xs[0].numel())
        kw = dict(block_size=BLOCK, channels=CHANNELS, lanes=lanes)
        if name == "omni-dedicated":
            kw.update(deployment="dedicated", aggregator_bandwidth_gbps=BANDWIDTH)
        name = "omnireduce"

    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric, **kw)
        y = t.allreduce(xs[ctx.rank])
        return t.last_stats, float(y.sum())

    res = sc.launch(fn, n, network=net)
    if check:
        expect = float(sum(float(x.sum()) for x in xs))
        if any(abs(s - expect) > 1e-3 * max(1.0, expect) for _, s in res):
            raise AssertionError(f"{name} returned a wrong sum")
    return (max(s.modelled_time_s for s, _ in res) * 1e6,
            float(np.mean([s.bytes_sent + s.bytes_received for s, _ in res])))


def run_point(n: int, density: float, *, numel: int = NUMEL, pool: int = POOL, overlap: str = "full",
              seed: int = 0, transports=TRANSPORTS, omni_max: int | None = None) -> Point:
    xs = _data(n, numel, density, overlap, seed)
    ms = [np.asarray(x.view(-1, BLOCK).ne(0).any(1)) if numel % BLOCK == 0 else
          np.asarray(torch.nn.functional.pad(x, (0, -numel % BLOCK)).view(-1, BLOCK).ne(0).any(1)) for x in xs]
    union = np.logical_or.reduce(ms)
    p = Point(n, density, numel, pool, overlap, float(union.mean()), seed=seed)
    for t in transports:
        if ((t == "switch" and n > SWITCH_MAX) or (t == "sparse-switch" and n > SPARSE_MAX) or (t == "ring" and n == 1)
                or (t.startswith("omni") and omni_max is not None and n > omni_max)):
            p.times_us[t] = float("nan")
            continue
        if t in SIZE_ONLY:      # (its time does not depend on the values: once per size)
            key = (t, n, numel, pool)
            if key not in _size_only:
                _size_only[key] = _time(t, n, xs, pool)
            tm, moved = _size_only[key]
        else:
            tm, moved = _time(t, n, xs, pool)
        p.times_us[t] = tm
        if t == "sparse-switch":
            p.sparse_bytes = moved
    nb = union.size
    L = min(pool, nb)
    common = dict(density=density, overlap=overlap, pool_size=pool, slot_elems=BLOCK,
                  bandwidth_gbps=BANDWIDTH, latency_us=LATENCY_US)
    p.form_us = 1e6 * costs.sparse_switch_allreduce(
        n, numel, **common, own_blocks=float(np.mean([m.sum() for m in ms])), union_blocks=float(union.sum()),
        waves=waves_of(union, pool)).time_s
    p.expected_us = 1e6 * costs.sparse_switch_allreduce(n, numel, **common).time_s
    p.ideal_bytes = (float(np.mean([m.sum() for m in ms])) + float(union.sum())) * (4 * BLOCK + 4) + 8 * L
    return p


def waves_of(union: np.ndarray, pool: int) -> list[float]:
    """The stream's waves for a union block mask: wave ``r`` = the lanes with at least ``r`` union blocks
    (:func:`theory.costs.sparse_switch_waves` gives their expectation)."""
    nb = union.size
    L = min(pool, nb)
    P = -(-nb // L)
    grid = np.zeros(P * L, dtype=bool)
    grid[:nb] = union
    per_lane = grid.reshape(P, L).sum(0)
    return [float((per_lane >= r).sum()) for r in range(1, int(per_lane.max(initial=0)) + 1)]


HEADER = ("dens   n |     ring   switch omni-col omni-ded   sparse |  form(us)    err | winner")


def _row(p: Point) -> str:
    ts = " ".join(f"{p.times_us.get(t, float('nan')):8.1f}" for t in TRANSPORTS)
    return f"{p.density:>4g} {p.n:>3d} | {ts} | {p.form_us:9.1f} {100 * p.error:+6.1f}% | {p.winner}"


def _plain(iterable, **_):
    return iterable


def _seed_note(p: Point, seeds) -> str:
    return f" seed {p.seed}" if len(seeds) > 1 else ""


def e1(ns, densities, numel, overlap, log=print, progress=_plain, seeds=(0,), omni_max: int | None = None,
       omni_wide=()) -> list[Point]:
    """E1's points; OmniReduce runs up to ``omni_max`` workers, and at the densities of ``omni_wide`` at
    every ``n``."""
    log(f"\nE1: {numel * 4 / 2**20:g} MiB float32, block {BLOCK}, pool {POOL}, overlap={overlap}; modelled us")
    log(HEADER)
    points = []
    for d, n, sd in progress([(d, n, sd) for d in densities for n in ns for sd in seeds], desc="E1 points"):
        t0 = time.perf_counter()
        p = run_point(n, d, numel=numel, overlap=overlap, seed=sd, omni_max=None if d in omni_wide else omni_max)
        points.append(p)
        log(_row(p) + f"   ({time.perf_counter() - t0:.1f} s)" + _seed_note(p, seeds))
    return points


def e2(pools, numel, log=print, progress=_plain, seeds=(0,)) -> list[Point]:
    log(f"\nE2: pool pressure, n=8, {numel * 4 / 2**20:g} MiB; sparse-switch vs switch with the same pool (us)")
    log(f"{'dens':>4} {'pool':>5} | {'switch':>8} {'sparse':>8} {'form':>8} | sparse/switch")
    out = []
    for d, pool, sd in progress([(d, pool, sd) for d in (1.0, 0.1) for pool in pools for sd in seeds],
                                desc="E2 points"):
        p = run_point(8, d, numel=numel, pool=pool, transports=("switch", "sparse-switch"), seed=sd)
        out.append(p)
        log(f"{d:>4g} {pool:>5d} | {p.times_us['switch']:8.1f} {p.times_us['sparse-switch']:8.1f} "
            f"{p.form_us:8.1f} | {p.times_us['sparse-switch'] / p.times_us['switch']:.2f}" + _seed_note(p, seeds))
    return out


def e3(sizes, log=print, progress=_plain, seeds=(0,)) -> list[Point]:
    log("\nE3: small tensors, n=8, density 0.5 (us)")
    log(HEADER)
    out = []
    for numel, sd in progress([(numel, sd) for numel in sizes for sd in seeds], desc="E3 sizes"):
        p = run_point(8, 0.5, numel=numel, seed=sd)
        out.append(p)
        log(f"[{numel * 4 / 1024:g} KiB] " + _row(p) + _seed_note(p, seeds))
    return out


def by_point(points: list[Point]) -> dict[tuple, list[Point]]:
    """The points by ``(n, density, numel, pool)``, each the list of its seeds' runs."""
    out: dict[tuple, list[Point]] = {}
    for p in points:
        out.setdefault((p.n, p.density, p.numel, p.pool), []).append(p)
    return out


def mean_point(runs: list[Point]) -> Point:
    """One point's seeds as one :class:`Point`: every time and byte count their mean, ``seed`` the first's."""
    mean = lambda f: float(np.mean([f(p) for p in runs]))  # noqa: E731
    p0 = runs[0]
    return Point(p0.n, p0.density, p0.numel, p0.pool, p0.overlap, mean(lambda p: p.union_density),
                 {t: mean(lambda p: p.times_us[t]) for t in p0.times_us}, mean(lambda p: p.form_us),
                 mean(lambda p: p.expected_us), mean(lambda p: p.sparse_bytes), mean(lambda p: p.ideal_bytes),
                 p0.seed)


def seeds_table(points: list[Point]) -> str:
    """E1's modelled times (us) per point as mean ± std over the seeds, and the closed form's error."""
    rows = [(f"{d:g}", str(n), *(report.fmt_mean_std([p.times_us[t] for p in runs], ".1f") for t in TRANSPORTS),
             report.fmt_mean_std([100 * p.error for p in runs], ".1f"))
            for (n, d, _, _), runs in by_point(points).items()]
    return report.table(("dens", "n", *TRANSPORTS, "error (%)"), rows, align="r" * (3 + len(TRANSPORTS)))


def _netbed_worker(ctx, name, kw, xs, repeats):
    """On one netbed worker: a warm-up call, then ``repeats`` timed calls (barrier before each)."""
    t = sc.transports.get(name, ctx.fabric, **kw)
    x = xs[ctx.rank]
    y = t.allreduce(x)
    times = []
    for _ in range(repeats):
        ctx.fabric.barrier()
        t0 = time.perf_counter()
        y = t.allreduce(x)
        times.append(time.perf_counter() - t0)
    s = t.last_stats
    return times, float(y.sum()), s.bytes_sent, s.bytes_received


def e4_netbed(gbps: float, numel: int, densities, repeats: int = 3, n: int = 4, log=print,
              progress=_plain) -> list[dict]:
    """The same transports on real processes over a netbed (each worker its own namespace and link of
    ``gbps`` Gbit/s; the switches on the top-of-rack namespace, dedicated aggregators on hosts of their
    own): median wall time per all-reduce (the slowest worker's), and the link-limited time (the busiest
    worker link's bytes over the link rate)."""
    rows = []
    log(f"\nE4: netbed, n={n}, links of {gbps:g} Gbit/s, {numel * 4 / 2**20:g} MiB, median of {repeats}; "
        f"wall ms (link-limited ms)")
    log(f"{'dens':>4} | " + " ".join(f"{t:>18}" for t in TRANSPORTS))
    for d in progress(densities, desc="E4 densities"):
        xs = _data(n, numel, d, "full", 0)
        expect = float(sum(float(x.sum()) for x in xs))
        cells = {}
        for t in TRANSPORTS:
            name, kw, services = t, {}, []
            if t == "switch":
                kw, services = dict(slot_elems=BLOCK, pool_size=POOL), ["switch:elems=256"]
            elif t == "sparse-switch":
                kw, services = dict(pool_size=POOL), ["sparse-switch"]
            elif t.startswith("omni"):
                name, kw = "omnireduce", dict(block_size=BLOCK)
                if t == "omni-dedicated":
                    kw["deployment"] = "dedicated"
                    services = [f"omnireduce-agg:{i}" for i in range(n)]
            res = sc.launch(functools.partial(_netbed_worker, name=name, kw=kw, xs=xs, repeats=repeats), n,
                            backend="netbed", network=sc.Network(bandwidth_gbps=gbps), services=services,
                            timeout_s=300)
            if any(abs(r[1] - expect) > 1e-3 * max(1.0, expect) for r in res):
                raise AssertionError(f"{t} returned a wrong sum on the netbed")
            wall = float(np.median(np.max([r[0] for r in res], axis=0)))
            busiest = max(max(r[2], r[3]) for r in res)
            cells[t] = (wall, busiest * 8 / (gbps * 1e9))
            rows.append(dict(density=d, transport=t, wall_s=wall, link_limit_s=cells[t][1], n=n, gbps=gbps,
                             numel=numel))
        log(f"{d:>4g} | " + " ".join(f"{1e3 * w:>9.2f} ({1e3 * l:6.2f})" for w, l in cells.values()))
    return rows


def summary(points: list[Point], ns, densities, log=print) -> None:
    log("\nVerdict (E1):")
    for d in densities:
        row = [p for p in points if p.density == d]
        sp = [p.times_us["sparse-switch"] for p in row if p.times_us["sparse-switch"] == p.times_us["sparse-switch"]]
        sw = [p.times_us["switch"] for p in row if p.times_us["switch"] == p.times_us["switch"]]
        od = [p.times_us["omni-dedicated"] for p in row if p.times_us["omni-dedicated"] == p.times_us["omni-dedicated"]]
        rg = [p.times_us["ring"] for p in row if p.times_us["ring"] == p.times_us["ring"]]
        log(f"  density {d:g}: max/min over n: sparse-switch {max(sp) / min(sp):.2f}, switch {max(sw) / min(sw):.2f}, "
            f"omni-dedicated {max(od) / min(od):.2f}, ring {max(rg) / min(rg):.2f}")
    for n in ns:
        row = {p.density: p.times_us["sparse-switch"] for p in points if p.n == n}
        if 1.0 in row and len(row) > 1:
            log(f"  n={n}: sparse-switch time relative to density 1: "
                + ", ".join(f"d={d:g}: {row[d] / row[1.0]:.3f}" for d in sorted(row, reverse=True)))
    lost = [p for p in points if p.winner != "sparse-switch"]
    log(f"  sparse-switch fastest at {len(points) - len(lost)}/{len(points)} points; elsewhere:")
    for p in lost:
        s = p.times_us["sparse-switch"]
        log(f"    d={p.density:g} n={p.n}: {p.winner} {p.times_us[p.winner]:.1f} us vs sparse-switch "
            + (f"{s:.1f} us ({s / p.times_us[p.winner]:.2f}x)" if s == s else f"n/a (more than {SPARSE_MAX} workers)"))
    errs = [abs(p.error) for p in points if p.error == p.error]
    ratios = [p.sparse_bytes / p.ideal_bytes for p in points if p.sparse_bytes == p.sparse_bytes]
    if ratios:
        log(f"  sparse-switch bytes / ideal (own blocks up, union down, look-aheads): "
            f"{min(ratios):.3f} .. {max(ratios):.3f}")
    log(f"  closed form vs simulation: max |error| {100 * max(errs):.1f}%, mean {100 * np.mean(errs):.1f}%, "
        f"{sum(e <= 0.15 for e in errs)}/{len(errs)} within 15%")


#: the transports whose time depends on where the non-zero blocks are (the others move the dense tensor)
DATA_DEPENDENT = ("omni-colocated", "omni-dedicated", "sparse-switch")
#: how each transport is drawn (marker and line style; colours from the default cycle)
STYLE = {"ring": "k:", "switch": "s--", "omni-colocated": "^-.", "omni-dedicated": "v-", "sparse-switch": "o-"}
LABEL = {"ring": "ring", "switch": "switch (dense)", "omni-colocated": "OmniReduce, colocated aggregators",
         "omni-dedicated": "OmniReduce, dedicated aggregators", "sparse-switch": "sparse-switch (simulated)"}


def plot(points: list[Point], pool_points: list[Point], ns, densities) -> dict:
    """The figures by file stem: E1 time vs density and vs workers, E2 time vs pool size."""
    plt = U.pyplot()
    figs = {}
    nseeds = len({p.seed for p in points})
    mean = f", mean ± std of {nseeds} seeds" if nseeds > 1 else ""
    ncol = [n for n in (8, 32) if n in ns] or [max(ns)]
    fig, axes = plt.subplots(1, len(ncol), figsize=(6.5 * len(ncol), 4.6), squeeze=False)
    for ax, n in zip(axes[0], ncol):
        row = [p for p in points if p.n == n]
        for t in TRANSPORTS:
            S.draw(ax, _band(row, "density", lambda p: p.times_us[t]), **_style(t), label=LABEL[t] + (mean if t in DATA_DEPENDENT else ""))
        S.draw(ax, _band(row, "density", lambda p: p.form_us), ls=":", color="r", lw=2,
               label="sparse-switch (closed form)" + mean)
        ax.set_xscale("log"), ax.set_yscale("log")
        plots.log_axes(ax, [p.density for p in row], [v for p in row for v in (*p.times_us.values(), p.form_us)])
        ax.set_xlabel("block density (fraction of blocks holding a non-zero)")
        ax.set_ylabel("time per all-reduce (µs, modelled)")
        ax.set_title(f"n={n}, {points[0].numel * 4 / 2**20:g} MiB, {BANDWIDTH:g} Gbit/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    figs["sparse_switch_vs_density"] = fig

    fig, axes = plt.subplots(1, len(densities), figsize=(5 * len(densities), 4.6), squeeze=False)
    for ax, d in zip(axes[0], sorted(densities, reverse=True)):
        row = [p for p in points if p.density == d]
        for t in TRANSPORTS:
            S.draw(ax, _band(row, "n", lambda p: p.times_us[t]), **_style(t), label=LABEL[t] + (mean if t in DATA_DEPENDENT else ""))
        S.draw(ax, _band(row, "n", lambda p: p.form_us), ls=":", color="r", lw=2,
               label="sparse-switch (closed form)" + mean)
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        plots.log_axes(ax, None, [v for p in row for v in (*p.times_us.values(), p.form_us)])
        plots.count_axis(ax.xaxis, [p.n for p in row])
        ax.set_xlabel("workers"), ax.set_title(f"density {d:g}")
        ax.set_ylabel("time per all-reduce (µs, modelled)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    figs["sparse_switch_vs_workers"] = fig

    if pool_points:
        fig, ax = plt.subplots(figsize=(6.5, 4.6))
        for d in sorted({p.density for p in pool_points}, reverse=True):
            row = [p for p in pool_points if p.density == d]
            line = S.draw(ax, _band(row, "pool", lambda p: p.times_us["sparse-switch"]), marker="o", ls="-",
                          label=f"sparse-switch, density {d:g} (simulated{mean})")
            S.draw(ax, _band(row, "pool", lambda p: p.form_us), ls=":", color=line.get_color(),
                   label=f"sparse-switch, density {d:g} (closed form{mean})")
        # the dense switch sends every block whatever the density: its curves coincide, drawn once
        dense = []
        for d in sorted({p.density for p in pool_points}, reverse=True):
            b = _band([p for p in pool_points if p.density == d], "pool", lambda p: p.times_us["switch"])
            dense.append(dict(x=b.x, y=b.mid, marker="s", ls="--",
                              color="0.4", label=f"switch (dense), density {d:g}"))
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        plots.plot_series(ax, dense, xlog=True, ylog=True)
        plots.log_axes(ax, None, [v for p in pool_points for v in (p.times_us["sparse-switch"], p.form_us,
                                                                    p.times_us["switch"])])
        plots.count_axis(ax.xaxis, [p.pool for p in pool_points])
        ax.set_xlabel("switch slots in flight (pool size)"), ax.set_ylabel("time per all-reduce (µs, modelled)")
        ax.set_title(f"E2: pool pressure, n={pool_points[0].n}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        figs["sparse_switch_pool"] = fig
    return figs


def _style(t: str) -> dict:
    """:data:`STYLE`'s format string of transport ``t`` as line keywords."""
    fmt = STYLE[t]                      # a colour or a marker, then the line style
    return dict(ls=fmt[1:], **({"color": fmt[0]} if fmt[0] == "k" else {"marker": fmt[0]}))


def _band(points: list[Point], key: str, value) -> S.Band:
    """``value(point)`` against the attribute ``key`` (``"n"``, ``"density"``, ``"pool"``) over the points'
    seeds; a NaN (a transport that did not run there) leaves the point out."""
    runs = [sorted((p for p in points if p.seed == sd), key=lambda p: getattr(p, key))
            for sd in dict.fromkeys(p.seed for p in points)]
    return S.band([[getattr(p, key) for p in r] for r in runs], [[value(p) for p in r] for r in runs])


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_sparse_switch", __doc__)
    ap.add_argument("--overlap", choices=("full", "random"), default="full")
    ap.add_argument("--numel", type=int, default=None, help=f"float32 elements (default {NUMEL}; quick: 65536)")
    ap.add_argument("--ns", type=int, nargs="+", default=None,
                    help=f"workers (default {' '.join(map(str, NS))}; quick: 2 4 8)")
    ap.add_argument("--omni-max", type=int, default=OMNI_MAX,
                    help=f"E1: OmniReduce's points only up to this many workers (default {OMNI_MAX}), but at "
                         "--omni-wide-densities")
    ap.add_argument("--omni-wide-densities", type=float, nargs="*", default=list(OMNI_WIDE_DENSITIES),
                    help="E1: the densities at which OmniReduce runs at every n, past --omni-max (default "
                         f"{' '.join(map(str, OMNI_WIDE_DENSITIES))}; give the option alone for none)")
    ap.add_argument("--densities", type=float, nargs="+", default=None, help="default 1 0.5 0.1 0.01")
    ap.add_argument("--skip-extra", action="store_true", help="E1 only")
    ap.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                    help="only E4: the transports on a netbed with links of GBPS Gbit/s, n=4 (needs root)")
    ap.add_argument("--repeats", type=int, default=3, help="E4: timed calls per transport")
    cli.add_seeds(ap, help="repeat every E1-E3 point for K position seeds (--seed, --seed+1, ...): tables show "
                           "mean ± std, plots the mean with a ± std band (default 1); not with --netbed")
    args = ap.parse_args(argv)
    seeds = S.seeds_of(ap, args)
    if args.netbed is not None and len(seeds) > 1:
        ap.error("--seeds applies to the simulated E1-E3; --netbed (E4) measures one draw: leave --seeds out")
    ns = args.ns or ([2, 4, 8] if args.quick else list(NS))
    densities = args.densities or ([1.0, 0.1, 0.01] if args.quick else [1.0, 0.5, 0.1, 0.01])
    numel = args.numel or (1 << 16 if args.quick else NUMEL)
    R = U.Run("reproduce_sparse_switch", args, dict(ns=ns, densities=densities, numel=numel, overlap=args.overlap,
                                                  netbed_gbps=args.netbed, repeats=args.repeats,
                                                  seeds=seeds))
    out = str(R.out)
    t0 = time.perf_counter()
    if args.netbed is not None:
        rows = e4_netbed(args.netbed, numel, densities, args.repeats, progress=R.progress)
        with open(os.path.join(out, f"sparse_switch_netbed_{args.netbed:g}gbps.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"total {time.perf_counter() - t0:.0f} s")
        R.finish({"E4": rows})
        return {"E4": rows}
    points = e1(ns, densities, numel, args.overlap, progress=R.progress, seeds=seeds, omni_max=args.omni_max,
                omni_wide=args.omni_wide_densities)
    if len(seeds) > 1:
        print(f"\nE1 over {len(seeds)} position seeds ({seeds[0]}..{seeds[-1]}): modelled us, mean ± std")
        print(seeds_table(points))
    summary([mean_point(runs) for runs in by_point(points).values()], ns, densities)
    pool_points, small = [], []
    if not args.skip_extra:
        pool_points = e2([4, 16, 64] if args.quick else [4, 8, 16, 32, 64, 128, 256], numel, progress=R.progress,
                         seeds=seeds)
        small = e3([256, 4096] if args.quick else [256, 1024, 4096, 16384, 65536, 262144], progress=R.progress,
                   seeds=seeds)
    tag = "" if numel == NUMEL else f"_{numel}"
    with open(os.path.join(out, f"sparse_switch_{args.overlap}{tag}.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["experiment", "n", "density", "numel", "pool", "overlap", "union_density", *TRANSPORTS,
                    "form_us", "expected_us", "sparse_bytes", "ideal_bytes", "seed"])
        for name, pts in (("E1", points), ("E2", pool_points), ("E3", small)):
            for p in pts:
                w.writerow([name, p.n, p.density, p.numel, p.pool, p.overlap, p.union_density,
                            *(p.times_us.get(t, float("nan")) for t in TRANSPORTS), p.form_us, p.expected_us,
                            p.sparse_bytes, p.ideal_bytes, p.seed])
    for stem, fig in plot(points, pool_points, ns, densities).items():
        print("wrote", R.save_figure(fig, stem))
    print(f"total {time.perf_counter() - t0:.0f} s")
    R.finish({"E1": [asdict(p) for p in points], "E2": [asdict(p) for p in pool_points],
              "E3": [asdict(p) for p in small]})
    return {"E1": points, "E2": pool_points, "E3": small}


if __name__ == "__main__":
    main()
