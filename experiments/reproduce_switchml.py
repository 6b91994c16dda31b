"""Reproduce SwitchML's scaling behaviour (Sapio et al., NSDI'21, arXiv 1903.06701) on the SimFabric.

Three experiments, each against the closed forms of ``theory/costs.py``:

E1  time vs number of workers (2..16 and 256; past 32 the switch's bitmap has one 32-bit word per 32
    workers): the switch's all-reduce time is flat in ``n`` (every worker sends and
    receives the data once), the ring's grows towards 2x the data (2 (n-1)/n) plus 2 (n-1) latencies.
    SwitchML's claim: throughput constant in the number of workers (p4app-switchML README; ~2.8e9
    elements/s at 4/8/16 workers at 100 Gb/s vs NCCL 1.38/1.25/0.97e9).
E2  time vs pool size: throughput ``min(line rate, pool * slot_bytes / RTT)`` rises with the pool until
    the pool covers the bandwidth-delay product, then stays at the line rate (less the header).
E3  goodput vs loss rate: every datagram, both directions, dropped with probability ``p``; the result is
    bit-identical to the lossless run and each lost packet costs its lane a retransmission timeout
    (10 ms in the reference client, ~1 ms in the NSDI paper).

Modelled times come from the SimFabric's network model (100 Gb/s, 2 us per hop by default; the switch is
a per-port endpoint with the same links). Usage::

    python -m experiments.reproduce_switchml [--quick] [--out DIR] [--seeds K]

Seeds: E1 and E2 are deterministic in the seed (the modelled time of a dense all-reduce depends on the
tensor's size, not on its values; ``--seed`` only draws the values), so they run once. E3's loss is random:
``--seeds K`` runs every point for loss seeds ``--seed`` .. ``--seed + K - 1`` (default 4, ``--quick`` 1),
the table shows the goodput as mean ± std over them and the figure the mean with a ± std band.
"""

from __future__ import annotations

import torch

import sparsecomm as sc
from sparsecomm.theory.costs import ring_allreduce, switchml_allreduce, switchml_lossy_time, switchml_throughput

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U


def _run(transport: str, n: int, numel: int, net: sc.Network, seed: int, **kw) -> dict:
    def fn(ctx):
        t = sc.transports.get(transport, ctx.fabric, **kw)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + ctx.rank))
        y = t.allreduce(x)
        info = getattr(t, "last_info", {})
        fixed = getattr(t, "last_fixed", None)
        return dict(time=t.last_stats.modelled_time_s, sent=t.last_stats.bytes_sent, y=y,
                    sums=None if fixed is None else fixed.sums,
                    retx=info.get("data", {}).get("retransmissions", 0) + info.get("control", {}).get(
                        "retransmissions", 0))

    out = sc.launch(fn, n, network=net)
    return dict(time=max(o["time"] for o in out), sent=out[0]["sent"], y=out[0]["y"], sums=out[0]["sums"],
                retx=sum(o["retx"] for o in out))


def e1_workers(args, R, net_kw) -> dict:
    numel = 256 * (256 if args.quick else 1024)
    ns = [2, 4, 8] if args.quick else [2, 4, 8, 16, 256]
    sw = dict(pool_size=64, slot_elems=256)
    rows = []
    print(f"\nE1: all-reduce of {numel * 4 / 2**20:.2f} MiB float32, switch (pool 64, 256-element packets) vs ring")
    print(f"{'n':>3} {'switch sim us':>14} {'model':>9} {'ring sim us':>12} {'model':>9} {'ring/switch':>12}")
    for n in R.progress(ns, desc="workers"):
        s = _run("switch", n, numel, sc.Network(**net_kw), args.seed, **sw)
        r = _run("ring", n, numel, sc.Network(**net_kw), args.seed)
        sm = switchml_allreduce(n, numel * 4, **sw, **net_kw).time_s
        rm = ring_allreduce(n, numel * 4, **net_kw).time_s
        rows.append(dict(n=n, switch=s["time"], switch_model=sm, ring=r["time"], ring_model=rm,
                         switch_bytes=s["sent"], ring_bytes=r["sent"]))
        print(f"{n:>3} {s['time'] * 1e6:>14.1f} {sm * 1e6:>9.1f} {r['time'] * 1e6:>12.1f} {rm * 1e6:>9.1f} "
              f"{r['time'] / s['time']:>12.2f}")
        R.log({"e1/switch_us": s["time"] * 1e6, "e1/ring_us": r["time"] * 1e6, "e1/n": n})
    plt = U.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["n"] for r in rows]
    ax.plot(x, [r["switch"] * 1e6 for r in rows], "o-", label="switch (sim)")
    ax.plot(x, [r["switch_model"] * 1e6 for r in rows], "k:", label="switch (model)")
    ax.plot(x, [r["ring"] * 1e6 for r in rows], "s-", label="ring (sim)")
    ax.plot(x, [r["ring_model"] * 1e6 for r in rows], "k--", lw=0.8, label="ring (model)")
    ax.set_xscale("log", base=2)
    plots.count_axis(ax.xaxis, x)
    ax.set_xlabel("workers"), ax.set_ylabel("time per all-reduce (µs, modelled)")
    ax.set_title(f"E1: {numel * 4 / 2**20:.2f} MiB, 100 Gb/s: switch flat in n")
    ax.legend()
    R.save_figure(fig, "switchml_vs_workers")
    return {"rows": rows}


def e2_pool(args, R, net_kw) -> dict:
    n, numel = 4, 64 * (512 if args.quick else 2048)
    pools = [2, 8, 32, 128, 512] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    line = net_kw["bandwidth_gbps"]
    b = 8 * 4 + 64 * 4
    rtt = 2 * (net_kw["latency_us"] * 1e-6 + b * 8 / (line * 1e9))
    bdp = rtt * line * 1e9 / 8 / (64 * 4)
    rows = []
    print(f"\nE2: n={n}, {numel * 4 / 2**20:.2f} MiB, 64-element packets; RTT {rtt * 1e6:.2f} us, "
          f"bandwidth-delay product = {bdp:.0f} slots of 256 B")
    print(f"{'pool':>5} {'sim us':>10} {'model us':>10} {'goodput Gb/s':>13} {'model':>8} {'steady model':>13}")
    for pool in R.progress(pools, desc="pool sizes"):
        s = _run("switch", n, numel, sc.Network(**net_kw), args.seed, pool_size=pool)
        m = switchml_allreduce(n, numel * 4, pool_size=pool, **net_kw).time_s
        steady = switchml_throughput(pool_size=pool, **net_kw) * 8 / 1e9
        g, gm = numel * 32 / s["time"] / 1e9, numel * 32 / m / 1e9
        rows.append(dict(pool=pool, time=s["time"], model=m, goodput_gbps=g, model_gbps=gm, steady_gbps=steady))
        print(f"{pool:>5} {s['time'] * 1e6:>10.1f} {m * 1e6:>10.1f} {g:>13.2f} {gm:>8.2f} {steady:>13.2f}")
        R.log({"e2/goodput_gbps": g, "e2/pool": pool})
    plt = U.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["pool"] for r in rows]
    ax.plot(x, [r["goodput_gbps"] for r in rows], "o-", label="switch (sim)")
    ax.plot(x, [r["model_gbps"] for r in rows], "k:", label="model (this size)")
    ax.plot(x, [r["steady_gbps"] for r in rows], "k--", lw=0.8, label="min(line, pool*256B/RTT)")
    ax.axvline(bdp, color="gray", lw=0.8, label=f"bandwidth-delay product ({bdp:.0f} slots)")
    ax.set_xscale("log", base=2)
    plots.count_axis(ax.xaxis, x)
    ax.set_xlabel("pool size (slots)"), ax.set_ylabel("goodput (Gb/s, payload)")
    ax.set_title(f"E2: n={n}, 100 Gb/s, 2 us: goodput vs pool")
    ax.legend()
    R.save_figure(fig, "switchml_vs_pool")
    return {"rows": rows, "bdp_slots": bdp}


def e3_loss(args, R, net_kw, seeds: list[int]) -> dict:
    n, numel, pool = 4, 64 * (512 if args.quick else 1024), 64
    losses = [0.0, 1e-3, 1e-2, 5e-2] if args.quick else [0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 5e-2]
    timeouts = [1e-3, 1e-4] if args.quick else [10e-3, 1e-3, 1e-4]
    rows, ref = [], None
    print(f"\nE3: n={n}, {numel * 4 / 2**20:.2f} MiB, pool {pool}, loss on every link both ways, "
          f"mean over {len(seeds)} loss seed(s)")
    print(f"{'timeout':>8} {'loss':>7} {'sim us':>10} {'goodput Gb/s':>15} {'model Gb/s':>11} {'retx':>6} {'exact':>6}")
    for to in R.progress(timeouts, desc="timeouts"):
        for loss in losses:
            times, goodputs, retx, same = [], [], 0, True
            for sd in seeds:
                s = _run("switch", n, numel, sc.Network(**net_kw, loss=loss, seed=sd), args.seed,
                         pool_size=pool, timeout=to, keep_fixed=True)
                if ref is None:
                    ref = s["sums"]
                same &= bool(torch.equal(s["sums"], ref))
                times.append(s["time"])
                goodputs.append(numel * 32 / s["time"] / 1e9)
                retx += s["retx"]
            t = sum(times) / len(times)
            m = switchml_lossy_time(n, numel * 4, loss, timeout_s=to, pool_size=pool, **net_kw)
            g, gm = numel * 32 / t / 1e9, numel * 32 / m / 1e9
            rows.append(dict(timeout=to, loss=loss, time=t, goodput_gbps=g, model_gbps=gm,
                             goodput_over_seeds=S.stats(goodputs), retransmissions=retx, bit_identical=same))
            print(f"{to * 1e3:>6.1f}ms {loss:>7.4f} {t * 1e6:>10.1f} {report.fmt_mean_std(goodputs):>15} "
                  f"{gm:>11.3f} {retx:>6d} {'yes' if same else 'NO':>6}")
            R.log({f"e3/goodput_gbps_timeout_{to * 1e3:g}ms": g, "e3/loss": loss})
    plt = U.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5.2))
    for to in timeouts:
        rr = [r for r in rows if r["timeout"] == to and r["loss"] > 0]
        per_seed = [[r["goodput_over_seeds"]["per_seed"][i] for r in rr] for i in range(len(seeds))]
        line = S.draw(ax, S.band([[r["loss"] for r in rr]] * len(seeds), per_seed), marker="o", ls="-",
                      label=f"timeout {to * 1e3:g} ms" + (f", mean ± std of {len(seeds)} seeds" if len(seeds) > 1
                                                         else ""))
        ax.plot([r["loss"] for r in rr], [r["model_gbps"] for r in rr], ":", color=line.get_color(),
                label=f"timeout {to * 1e3:g} ms (rough model)")
    lossless = next(r["goodput_gbps"] for r in rows if r["loss"] == 0)
    ax.axhline(lossless, color="k", lw=0.8, label="lossless")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("packet loss rate per link"), ax.set_ylabel("goodput (Gb/s)")
    ax.set_title(f"E3: n={n}, pool {pool}: goodput vs loss")
    plots.legend_below(ax, ncol=2)
    fig.tight_layout()
    R.save_figure(fig, "switchml_vs_loss")
    return {"rows": rows, "all_bit_identical": all(r["bit_identical"] for r in rows)}


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_switchml", __doc__)
    ap.add_argument("--bandwidth-gbps", type=float, default=100.0)
    ap.add_argument("--latency-us", type=float, default=2.0)
    cli.add_seeds(ap, default=None, help="E3's loss seeds (--seed, --seed+1, ...; default 4, --quick 1): its table "
                                          "shows goodput mean ± std, its plot the mean with a ± std band; E1 and E2 "
                                          "are deterministic in the seed and run once")
    args = ap.parse_args(argv)
    if args.seeds is None:              # E3's loss seeds: 4, or 1 for --quick
        args.seeds = 1 if args.quick else 4
    seeds = S.seeds_of(ap, args)
    net_kw = dict(bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us)
    R = U.Run("reproduce_switchml", args, dict(quick=args.quick, e3_seeds=seeds, **net_kw))
    summary = {"network": net_kw,
               "e1_workers": e1_workers(args, R, net_kw),
               "e2_pool": e2_pool(args, R, net_kw),
               "e3_loss": e3_loss(args, R, net_kw, seeds)}
    rel = [abs(r["switch"] / r["switch_model"] - 1) for r in summary["e1_workers"]["rows"]]
    rel += [abs(r["time"] / r["model"] - 1) for r in summary["e2_pool"]["rows"]]
    summary["max_model_error"] = max(rel)
    print(f"\nlargest |sim/model - 1| over E1 and E2: {max(rel):.3%}; "
          f"E3 results bit-identical to lossless: {summary['e3_loss']['all_bit_identical']}")
    path = R.finish(summary)
    print(f"outputs in {R.out} ({path.name})")
    return summary


if __name__ == "__main__":
    main()
