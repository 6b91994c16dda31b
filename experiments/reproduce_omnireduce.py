"""Reproduce OmniReduce's scaling claims on the SimFabric (Fei et al., SIGCOMM'21, Figs. 4-5 analogue).

OmniReduce sends only the non-zero blocks of a tensor, so its time follows the data's block density,
and with dedicated aggregators (one per worker, each with the workers' bandwidth) no term grows with
the number of workers ``n``; ring all-reduce moves ``2 (n-1)/n`` of the dense tensor whatever the
density. For every point of the grid (``n`` in {2, 4, 8, 16, 32, 64} at block density in
{1, 0.5, 0.1, 0.01}, and ``n`` in {128, 256} at density 0.01; 10 and 100 Gbps) this script runs
OmniReduce (dedicated aggregators) and ring on the SimFabric and compares OmniReduce's modelled time with
the closed form :func:`theory.costs.omnireduce_allreduce`, fed with the data's measured rounds and
busiest-aggregator load (the expectation-only closed form is printed too). The wide points (128 and 256
workers, ``--wide-ns``) run only at ``--wide-densities`` (default 0.01): a dedicated call's messages grow
as ``n^2`` and its rounds with the density, so one 256-worker point at density 1 would take longer than
the rest of the grid. The ring's time does not depend on the data: it runs once per ``(bandwidth, n)``.

The endpoints are event-driven (:meth:`sparsecomm.fabric.base.Fabric.wait_any`): a dedicated aggregator
serves whichever channel's round is in first, a worker whichever reply is in first (in their fixed
pass order while several are), in modelled time and deterministically, so a late aggregator does not
hold back a worker's messages to the others.

Data: ``int(nb * density)`` non-zero blocks at random positions (the paper's micro-benchmark draws
them with ``random.sample``), shared by all workers (``--overlap full``: the union has the workers'
density, so the data volume is the same for every ``n``; the workers share one read-only tensor) or
drawn independently per worker (``--overlap random``: the union grows as ``1 - (1 - d)^n``).
``--placement stratified`` gives every aggregator's shard exactly its share of the non-zero blocks,
which removes the data's own imbalance across aggregators (balls into bins: with few non-zero blocks
per aggregator the busiest holds several times the mean; :func:`theory.costs.omnireduce_imbalance`,
column ``imbD``), so that what is left is the protocol's and the network's.

    python -m experiments.reproduce_omnireduce [--quick] [--out DIR] [--overlap full|random]
                                               [--placement random|stratified] [--numel N]
                                               [--densities D ...] [--bandwidths GBPS ...] [--ns N ...]
                                               [--wide-ns [N ...]] [--wide-densities D ...]

prints the table and writes ``omnireduce_vs_density.png``, ``omnireduce_vs_workers.png`` and
``omnireduce_<overlap>_<placement>.csv`` under ``DIR`` (default ``experiments/out/reproduce_omnireduce``).
The 256-worker points take the longest (the simulation is a single-threaded discrete-event loop over
every message: about 2 minutes of CPU each, of a default run's ~13); ``--quick`` runs n <= 16 at
100 Gb/s only, without wide points.

``--seed`` draws the non-zero blocks' positions, on which the rounds, the busiest aggregator and so the time
depend. ``--seeds K`` runs every point for position seeds ``--seed`` .. ``--seed + K - 1``: the CSV has a row
per seed (column ``seed``), the printed table a line per seed and then OmniReduce's time and the closed
form's error as mean ± std over the seeds, the figures the mean with a ± std band. Ring's time does not
depend on the data.
"""

from __future__ import annotations

import csv
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

import sparsecomm as sc
from sparsecomm.transports.omnireduce import wire
from sparsecomm.theory import costs

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U

NUMEL = 1 << 20           # 4 MiB of float32: the 64-worker simulation stays fast; modelled time scales
BLOCK = 256
CHANNELS = 4              # streams per aggregator, so that up- and downstream overlap
POSITIONS = 4             # blocks per lane: lanes = blocks per channel / POSITIONS
LATENCY_US = 2.0
#: default workers (``--ns``), run at every density
NS = (2, 4, 8, 16, 32, 64)
#: default wide points (``--wide-ns``), run at :data:`WIDE_DENSITIES` only: a dedicated call's messages
#: grow as n^2 (every worker with every aggregator on every channel, each round) and its rounds with the
#: density, so a 256-worker point at density 1 alone would take longer than the rest of the grid
WIDE_NS = (128, 256)
#: the densities of the wide points (``--wide-densities``)
WIDE_DENSITIES = (0.01,)


@dataclass
class Point:
    n: int
    density: float
    overlap: str
    bandwidth_gbps: float
    union_density: float
    rounds: int
    imbalance_up: float
    imbalance_down: float
    omni_s: float
    closed_form_s: float
    expected_form_s: float
    ring_s: float
    ring_form_s: float
    bytes_sent: float
    bytes_received: float
    seed: int = 0

    @property
    def error(self) -> float:
        return self.omni_s / self.closed_form_s - 1.0


def lanes_for(n: int, numel: int = NUMEL) -> int:
    """Lanes per channel giving every lane ``POSITIONS`` blocks (so every channel runs that many rounds
    at density 1 and the ``CHANNELS`` streams pipeline)."""
    m = -(-numel // BLOCK) // n
    return max(1, m // (CHANNELS * POSITIONS))


def masks(n: int, nb: int, density: float, overlap: str, seed: int = 0, placement: str = "random") -> list[np.ndarray]:
    """Per-worker non-zero block masks: ``int(nb * density)`` positions drawn at random (the paper's
    ``random.sample``), shared by every worker (``overlap="full"``) or per worker (``"random"``).
    ``placement="stratified"``: the same count, but every aggregator's shard (``n`` of them) gets its
    exact share, at random positions inside it -- the data's own imbalance across aggregators removed."""
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, 0 if overlap == "full" else r + 1])
        m = np.zeros(nb, dtype=bool)
        if placement == "stratified":
            for a in range(n):
                lo, hi = a * nb // n, (a + 1) * nb // n
                m[lo + rng.choice(hi - lo, int(round((hi - lo) * density)), replace=False)] = True
        else:
            m[rng.choice(nb, int(nb * density), replace=False)] = True
        out.append(m)
    return out


def measured_stats(ms: list[np.ndarray], n: int, lanes: int):
    """Union density, the fraction of the union's blocks completed in each round (round 0: position 0
    of every lane; round r: one block of every lane with at least r union blocks past position 0), and
    the busiest aggregator's up/down load relative to the mean, and the busiest channel's blocks in and
    out at its aggregator, for the layout the transport uses."""
    nb = ms[0].size
    union = np.logical_or.reduce(ms)
    own = np.sum(ms, axis=0)
    per_round = np.zeros(nb + 1)
    up_loads, dn_loads, chan = [], [], (0, 0)
    for chans in wire.plan(nb * BLOCK, BLOCK, n, CHANNELS, lanes):
        up_loads.append(sum(int(own[c.lo:c.lo + c.size].sum()) for c in chans))
        dn_loads.append(sum(int(union[c.lo:c.lo + c.size].sum()) for c in chans))
        for c in chans:
            load = (int(own[c.lo:c.lo + c.size].sum()), n * int(union[c.lo:c.lo + c.size].sum()))
            chan = max(chan, load, key=sum)
            P = -(-c.size // c.lanes)
            grid = np.zeros(P * c.lanes, dtype=bool)
            grid[:c.size] = union[c.lo:c.lo + c.size]
            grid = grid.reshape(P, c.lanes)
            per_round[0] += grid[0].sum()
            later = grid[1:].sum(axis=0)            # union blocks past position 0, per lane
            for r in range(1, int(later.max(initial=0)) + 1):
                per_round[r] += (later >= r).sum()
    total = max(1.0, float(union.sum()))
    rounds = 1 + int(np.flatnonzero(per_round[1:]).max(initial=-1)) + 1
    fractions = [float(v) / total for v in per_round[:rounds]]
    imb = [max(x) / np.mean(x) if np.mean(x) > 0 else 1.0 for x in (up_loads, dn_loads)]
    return float(union.mean()), fractions, imb[0], imb[1], chan


def _omni(ctx, xs, lanes, agg_bw):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=BLOCK, deployment="dedicated",
                          channels=CHANNELS, lanes=lanes, aggregator_bandwidth_gbps=agg_bw)
    y = t.allreduce(xs[ctx.rank])
    return t.last_stats, float(y.sum())


def _ring(ctx, numel):
    t = sc.transports.get("ring", ctx.fabric)
    t.allreduce(torch.ones(numel))
    return t.last_stats


def ring_time(n: int, bandwidth_gbps: float, numel: int = NUMEL) -> float:
    """Ring all-reduce's modelled time (max over workers) of ``numel`` float32 on ``n`` simulated workers.
    It depends on the size, the network and ``n``, not on the values: :func:`run_grid` runs it once per
    ``(n, bandwidth)`` and shares it by every density and seed of that pair."""
    net = sc.Network(bandwidth_gbps=bandwidth_gbps, latency_us=LATENCY_US)
    return max(s.modelled_time_s for s in sc.launch(lambda ctx: _ring(ctx, numel), n, network=net))


def run_point(n: int, density: float, bandwidth_gbps: float, overlap: str = "full", numel: int = NUMEL,
              ring: bool | float = True, seed: int = 0, placement: str = "random") -> Point:
    """One grid point: OmniReduce (dedicated aggregators) and ring on the SimFabric, and the models.
    ``ring``: ``True`` simulates the ring here (:func:`ring_time`), ``False`` leaves its time NaN, a float is
    its time already simulated for this ``(n, bandwidth, numel)`` (the ring's time does not depend on the data)."""
    nb = -(-numel // BLOCK)
    ms = masks(n, nb, density, overlap, seed, placement)
    xs = []
    for m in ms:
        if xs and overlap == "full":    # every worker the same data: one read-only tensor, shared
            xs.append(xs[0])
            continue
        x = torch.zeros(nb, BLOCK)
        x[torch.from_numpy(m)] = 1.0
        xs.append(x.view(-1)[:numel])
    lanes = lanes_for(n, numel)
    net = sc.Network(bandwidth_gbps=bandwidth_gbps, latency_us=LATENCY_US)
    res = sc.launch(lambda ctx: _omni(ctx, xs, lanes, bandwidth_gbps), n, network=net)
    expect = float(np.sum(ms) * BLOCK)
    if any(abs(s - expect) > 1e-6 * max(1.0, expect) for _, s in res):
        raise AssertionError("omnireduce returned a wrong sum")
    stats = [s for s, _ in res]
    du, fractions, imb_up, imb_dn, chan = measured_stats(ms, n, lanes)
    common = dict(density=float(np.mean([m.mean() for m in ms])), union_density=du, block_size=BLOCK,
                  bandwidth_gbps=bandwidth_gbps, latency_us=LATENCY_US, deployment="dedicated",
                  channels=CHANNELS, lanes=lanes)
    closed = costs.omnireduce_allreduce(n, numel, round_fractions=fractions, imbalance=(imb_up, imb_dn),
                                        channel_load=chan, **common)
    expected = costs.omnireduce_allreduce(n, numel, overlap=overlap,
                                          imbalance=(1.0, 1.0) if placement == "stratified" else None,
                                          **{**common, "density": density, "union_density": None})
    if ring is True:
        ring_s = ring_time(n, bandwidth_gbps, numel) if n > 1 else float("nan")
    else:
        ring_s = float("nan") if ring is False else float(ring)
    ring_form = costs.ring_allreduce(n, numel * 4, bandwidth_gbps=bandwidth_gbps, latency_us=LATENCY_US)
    return Point(n, density, overlap, bandwidth_gbps, du, len(fractions), imb_up, imb_dn,
                 max(s.modelled_time_s for s in stats), closed.time_s, expected.time_s, ring_s,
                 ring_form.time_s, float(np.mean([s.bytes_sent for s in stats])),
                 float(np.mean([s.bytes_received for s in stats])), seed)


def run_grid(ns, densities, bandwidths, overlap: str, numel: int = NUMEL, log=print,
             placement: str = "random", progress=None, seeds=(0,), wide_ns=(), wide_densities=()) -> list[Point]:
    """Every (bandwidth, density, n) point for every position seed of ``seeds`` (the seeds of a point one
    after the other), and the wide points: ``wide_ns`` at the ``wide_densities`` only (each density's
    workers in increasing order); ``progress`` (e.g. ``Run.progress``) wraps the loop in a bar. The ring
    runs once per ``(bandwidth, n)``, at that pair's first point, and its time is shared by the others (it
    does not depend on the data); a point's printed wall time includes the ring's where it ran."""
    points = []
    rings: dict[tuple[float, int], float] = {}
    per_density = {d: sorted({*(ns if d in densities else ()), *(wide_ns if d in wide_densities else ())})
                   for d in dict.fromkeys([*densities, *wide_densities])}
    grid = [(bw, d, n, sd) for bw in bandwidths for d, dns in per_density.items() for n in dns for sd in seeds]
    for bw, d, n, sd in (progress(grid, desc="points") if progress is not None else grid):
        t0 = time.perf_counter()
        if (bw, n) not in rings:
            rings[bw, n] = ring_time(n, bw, numel) if n > 1 else float("nan")
        p = run_point(n, d, bw, overlap, numel, ring=rings[bw, n], placement=placement, seed=sd)
        points.append(p)
        log(f"{bw:>5g} {d:>6g} {n:>3d} | {p.omni_s * 1e6:9.1f} {p.closed_form_s * 1e6:9.1f} "
            f"{100 * p.error:+6.1f}% {p.expected_form_s * 1e6:9.1f} | {p.rounds:2d} "
            f"{p.imbalance_down:5.2f} | {p.ring_s * 1e6:9.1f} {p.ring_form_s * 1e6:9.1f} | "
            f"{p.ring_s / p.omni_s:6.2f}x  ({time.perf_counter() - t0:.1f} s)"
            + (f" seed {sd}" if len(seeds) > 1 else ""))
    return points


def by_point(points: list[Point]) -> dict[tuple[float, float, int], list[Point]]:
    """The points by ``(bandwidth, density, n)``, each the list of its seeds' runs."""
    out: dict[tuple[float, float, int], list[Point]] = {}
    for p in points:
        out.setdefault((p.bandwidth_gbps, p.density, p.n), []).append(p)
    return out


def mean_point(runs: list[Point]) -> Point:
    """One grid point's seeds as one :class:`Point`: every number their mean (the rounds rounded), ``seed``
    the first seed's."""
    grid = ("n", "density", "overlap", "bandwidth_gbps", "seed")      # the point's coordinates, kept as they are
    num = {k: float(np.mean([getattr(p, k) for p in runs])) for k, v in asdict(runs[0]).items()
           if isinstance(v, float) and k not in grid}
    return Point(**{**asdict(runs[0]), **num, "rounds": int(round(np.mean([p.rounds for p in runs])))})


def seeds_table(points: list[Point]) -> str:
    """Per grid point, OmniReduce's time and the closed form's error as mean ± std over the seeds."""
    rows = [(f"{bw:g}", f"{d:g}", str(n), report.fmt_mean_std([p.omni_s * 1e6 for p in runs], ".1f"),
             report.fmt_mean_std([100 * p.error for p in runs], ".1f"),
             report.fmt_mean_std([p.imbalance_down for p in runs], ".2f"))
            for (bw, d, n), runs in by_point(points).items()]
    return report.table(("Gbps", "density", "n", "omni (us)", "error (%)", "imbD"), rows, align="rrrrrr")


HEADER = ("Gbps   dens   n |  omni(us)  form(us)    err  expct(us) |  R  imbD |  ring(us) rform(us) |"
          " ring/omni")


def plot(points: list[Point], numel: int = NUMEL) -> dict:
    """The figures by file stem: time per all-reduce vs block density, and vs workers, per bandwidth. A
    curve needs two points: the workers run at one density only (the wide points) are drawn against the
    workers, not the density, and a density run at one ``n`` only against neither."""
    plt = U.pyplot()
    figs = {}
    bws = sorted({p.bandwidth_gbps for p in points})
    nseeds = len({p.seed for p in points})
    mean = f", mean ± std of {nseeds} seeds" if nseeds > 1 else ""
    fig, axes = plt.subplots(1, len(bws), figsize=(6.5 * len(bws), 4.6), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        pts = [p for p in points if p.bandwidth_gbps == bw]
        for n in sorted({p.n for p in pts}):
            row = [p for p in pts if p.n == n]
            if len({p.density for p in row}) < 2:
                continue
            line = S.draw(ax, _band(row, "density", "omni_s"), marker="o", ls="-",
                          label=f"OmniReduce, n={n} (simulated{mean})")
            S.draw(ax, _band(row, "density", "closed_form_s"), ls="--", color=line.get_color(), alpha=0.6,
                   label=f"OmniReduce, n={n} (closed form{mean})")
            S.draw(ax, _band(row, "density", "ring_s"), ls=":", color=line.get_color(),
                   label=f"ring, n={n} (simulated)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        plots.log_axes(ax, [p.density for p in pts], [v for p in pts for v in (p.omni_s * 1e3, p.ring_s * 1e3,
                                                                          p.closed_form_s * 1e3)])
        ax.set_xlabel("block density (fraction of blocks holding a non-zero)")
        ax.set_ylabel("time per all-reduce (ms, modelled)")
        ax.set_title(f"{bw:g} Gbps: OmniReduce vs ring")
        plots.legend_below(ax, ncol=2)
    fig.tight_layout()
    figs["omnireduce_vs_density"] = fig

    fig, axes = plt.subplots(1, len(bws), figsize=(6.5 * len(bws), 4.6), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        pts = [p for p in points if p.bandwidth_gbps == bw]
        for d in sorted({p.density for p in pts}, reverse=True):
            row = [p for p in pts if p.density == d]
            if len({p.n for p in row}) < 2:
                continue
            line = S.draw(ax, _band(row, "n", "omni_s"), marker="o", ls="-",
                          label=f"OmniReduce, density {d:g} (simulated{mean})")
            S.draw(ax, _band(row, "n", "closed_form_s"), ls="--", color=line.get_color(), alpha=0.6,
                   label=f"OmniReduce, density {d:g} (closed form{mean})")
        row = list({(p.n, p.seed): p for p in pts}.values())      # the ring: one time per n, whatever the density
        S.draw(ax, _band(row, "n", "ring_s"), ls=":", color="k", label="ring, any density (simulated)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plots.log_axes(ax, None, [v for p in pts for v in (p.omni_s * 1e3, p.ring_s * 1e3, p.closed_form_s * 1e3)])
        plots.count_axis(ax.xaxis, [p.n for p in pts])
        ax.set_xlabel("workers (one dedicated aggregator per worker)")
        ax.set_ylabel("time per all-reduce (ms, modelled)")
        ax.set_title(f"{bw:g} Gbps, {numel * 4 / 2**20:g} MiB float32")
        plots.legend_below(ax, ncol=2)
    fig.tight_layout()
    figs["omnireduce_vs_workers"] = fig
    return figs


def _band(points: list[Point], key: str, attr: str) -> S.Band:
    """``attr`` (a time, drawn in ms) against ``key`` (``"n"`` or ``"density"``) over the points' seeds."""
    runs = [sorted((p for p in points if p.seed == sd), key=lambda p: getattr(p, key))
            for sd in dict.fromkeys(p.seed for p in points)]
    return S.band([[getattr(p, key) for p in r] for r in runs], [[getattr(p, attr) * 1e3 for p in r] for r in runs])


def main(argv=None) -> list[Point]:
    ap = U.parser("python -m experiments.reproduce_omnireduce", __doc__)
    ap.add_argument("--overlap", choices=("full", "random"), default="full",
                    help="non-zero block positions shared by all workers (full) or drawn per worker")
    ap.add_argument("--placement", choices=("random", "stratified"), default="random",
                    help="stratified: every aggregator's shard gets exactly its share of non-zero blocks")
    ap.add_argument("--numel", type=int, default=NUMEL, help="float32 elements of the tensor")
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.1, 0.01])
    ap.add_argument("--bandwidths", type=float, nargs="+", default=None, help="Gbit/s (default 10 and 100)")
    ap.add_argument("--ns", type=int, nargs="+", default=None,
                    help=f"workers, at every density (default {' '.join(map(str, NS))}; quick: 2 4 8 16)")
    ap.add_argument("--wide-ns", type=int, nargs="*", default=None,
                    help=f"more workers, at the --wide-densities only (default {' '.join(map(str, WIDE_NS))}; "
                         "quick: none; give the option alone for none)")
    ap.add_argument("--wide-densities", type=float, nargs="+", default=list(WIDE_DENSITIES),
                    help=f"the densities of the --wide-ns points (default {' '.join(map(str, WIDE_DENSITIES))})")
    cli.add_seeds(ap)
    args = ap.parse_args(argv)
    seeds = S.seeds_of(ap, args)
    ns = args.ns or ([2, 4, 8, 16] if args.quick else list(NS))
    wide_ns = [] if args.quick and args.wide_ns is None else (WIDE_NS if args.wide_ns is None else args.wide_ns)
    bws = args.bandwidths or ([100.0] if args.quick else [10.0, 100.0])
    densities = args.densities
    R = U.Run("reproduce_omnireduce", args, dict(ns=ns, bandwidths=bws, densities=densities, numel=args.numel,
                                               overlap=args.overlap, placement=args.placement,
                                               seeds=seeds, wide_ns=wide_ns, wide_densities=args.wide_densities))
    out = str(R.out)
    print(f"OmniReduce (dedicated aggregators, {CHANNELS} channels, {POSITIONS} blocks per lane) vs ring, "
          f"{args.numel} float32, block {BLOCK}, latency {LATENCY_US} us, overlap={args.overlap}, "
          f"placement={args.placement}")
    print("form: closed form with the data's measured rounds and busiest aggregator/channel; expct: with "
          "their expectations; R: rounds; imbD: busiest aggregator's union load / mean")
    print(HEADER)
    points = run_grid(ns, densities, bws, args.overlap, numel=args.numel, placement=args.placement,
                      progress=R.progress, seeds=seeds, wide_ns=wide_ns, wide_densities=args.wide_densities)
    if len(seeds) > 1:
        print(f"\nover {len(seeds)} position seeds ({seeds[0]}..{seeds[-1]}): mean ± std")
        print(seeds_table(points))
    errs = [abs(p.error) for p in points]
    within = sum(e <= 0.15 for e in errs)
    print(f"closed form vs simulation: max |error| {100 * max(errs):.1f}%, mean {100 * np.mean(errs):.1f}%, "
          f"{within}/{len(errs)} points within 15%")
    means = [mean_point(runs) for runs in by_point(points).values()]
    for bw in bws:
        for d in dict.fromkeys(p.density for p in means):
            row = [p for p in means if p.bandwidth_gbps == bw and p.density == d]
            ts = [p.omni_s for p in row]
            print(f"{bw:g} Gbps, density {d:g}: omni max/min over n = {max(ts) / min(ts):.2f}; ring at n={row[-1].n}: "
                  f"{row[-1].ring_s / row[0].ring_s:.2f}x its n={row[0].n} time")
    tag = "" if args.numel == NUMEL else f"_{args.numel}"
    with open(os.path.join(out, f"omnireduce_{args.overlap}_{args.placement}{tag}.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(asdict(points[0])))
        w.writeheader()
        for p in points:
            w.writerow(asdict(p))
    for stem, fig in plot(points, args.numel).items():
        print("wrote", R.save_figure(fig, stem))
    R.finish({"points": [asdict(p) for p in points], "max_abs_error": max(errs)})
    return points


if __name__ == "__main__":
    main()
