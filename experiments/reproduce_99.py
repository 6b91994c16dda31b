"""E4: the "99%" curve of Mishchenko, Hanzely, Richtarik (arXiv 1901.09437).

Iterations to reach ||x - x*||^2 <= eps ||x^0 - x*||^2 against tau, the number of blocks (of m) each worker
sends per round (independently of the others, scaled by m/tau), for n in {4, 10, 20}, overlaid on the
prediction kappa (1 + (m/tau - 1)/n) log(1/eps) (theory.rates.is_sgd_iterations).

Problem: least squares with an exact condition number kappa, interpolation (b = A x_true, so
grad f_i(x*) = 0 on every worker, the regime where IS-SGD needs no shifts) and equal local smoothness
(every worker's A_i^T A_i/N_i is the same matrix: L_i = L, so one kappa describes the problem); m = d blocks
(one coordinate each). Default step: the derived gamma = 1/(L (1 + (m/tau - 1)/n)) (theory.rates.is_sgd);
``--tune`` also reports the best over gamma x 2^(j/2), j = 0..4, below GD's limit 2/L (the knee is then a
property of the problem, not of the step-size formula). ``--method is_diana`` runs IS-DIANA on the non-interpolating variant instead.

Expected: flat (within 2x) down to tau = m/n, growing like m/(n tau) below: at tau = m/n the iteration
count at most doubles while each round carries n times fewer values. Counting only bits, the total to eps,
tau (1 + (m/tau - 1)/n) = tau (1 - 1/n) + m/n, is smallest at tau = 1 (derived; a "bits minimal
near tau = m/n" optimum needs a fixed per-round cost c0 besides the c1 per block: then the optimum is
tau* = sqrt(m c0/((n - 1) c1))).

    python -m experiments.reproduce_99 [--quick] [--tune] [--out DIR]
"""

from __future__ import annotations

import math

import torch

from sparsecomm.algorithms import ISDIANA, ISSGD
from sparsecomm.theory import problems as P
from sparsecomm.theory import rates

from .common import reproduce as U


def iterations_to_eps(prob, method: str, tau: int, eps: float, seed: int, mult: float = 1.0, maxit: int = 200000):
    x = torch.zeros(prob.d, dtype=torch.float64)
    cls = ISSGD if method == "is_sgd" else ISDIANA
    opt = cls([x], tau=tau, problem=prob, seed=seed)
    opt.param_groups[0]["lr"] *= mult
    e0 = U.sqdist(x, prob.x_star)
    for it in range(1, maxit + 1):
        try:
            opt.step()
        except Exception:
            return math.inf, opt.bits_sent
        e = U.sqdist(x, prob.x_star)
        if not e < 1e6 * e0:
            return math.inf, opt.bits_sent
        if e <= eps * e0:
            return it, opt.bits_sent
    return math.inf, opt.bits_sent


def knee(taus, ratio):
    """The tau where the measured ratio iterations(tau)/iterations(m) crosses 2 (log-log interpolation)."""
    for lo, hi in zip(taus, taus[1:]):
        if ratio[lo] >= 2 > ratio[hi]:
            w = math.log(ratio[lo] / 2) / math.log(ratio[lo] / ratio[hi])
            return math.exp(math.log(lo) + w * (math.log(hi) - math.log(lo)))
    return math.nan


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_99", __doc__)
    ap.add_argument("--method", choices=("is_sgd", "is_diana"), default="is_sgd")
    ap.add_argument("--ns", default="4,10,20", help="numbers of workers")
    ap.add_argument("--m", type=int, default=None, help="blocks = d (default 80, quick 40)")
    ap.add_argument("--kappa", type=float, default=10.0)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--seeds", type=int, default=None, help="runs per point (default 2, quick 1)")
    ap.add_argument("--tune", action="store_true", help="also the best step over gamma x 2^(j/2), j=0..4")
    args = ap.parse_args(argv)
    ns = [int(v) for v in args.ns.split(",")]
    m = args.m or (40 if args.quick else 80)
    seeds = args.seeds or (1 if args.quick else 2)
    taus = sorted({t for t in (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 27, 40, 80) if t <= m} | {m})
    if args.quick:
        taus = [t for t in taus if t in (1, 2, 4, 10, m)] if m >= 20 else taus
        ns = ns[:2] if len(ns) > 2 else ns
    R = U.Run("reproduce_99", args, dict(method=args.method, ns=ns, m=m, kappa=args.kappa, eps=args.eps,
                                          seeds=seeds, taus=taus, tune=args.tune))
    results = {}
    for n in R.progress(ns, desc="workers"):
        prob = P.synthetic_least_squares(n_workers=n, rows_per_worker=m, d=m, kappa=args.kappa, homogeneous=True,
                                         interpolate=(args.method == "is_sgd"), seed=args.seed)
        print(prob)
        res = {"taus": taus, "iters": {}, "bits": {}, "pred": {}, "tuned": {}}
        for tau in taus:
            runs = [iterations_to_eps(prob, args.method, tau, args.eps, seed=args.seed + s) for s in range(seeds)]
            its = sum(r[0] for r in runs) / seeds
            res["iters"][tau] = its
            res["bits"][tau] = sum(r[1] for r in runs) / seeds / n
            if args.method == "is_sgd":
                res["pred"][tau] = rates.is_sgd_iterations(prob.kappa_max, m, tau, n, args.eps)
            else:
                res["pred"][tau] = rates.diana_iterations(prob.kappa_max, m / tau - 1, n, args.eps)
            if args.tune:   # absolute grid: theory step x 2^(j/2), kept below GD's stability limit 2/L
                g0 = rates.is_sgd(prob.L_max, m, tau, n, L=prob.L)
                mults = [2 ** (j / 2) for j in range(5) if g0 * 2 ** (j / 2) < 2 / prob.L]
                res["tuned"][tau] = min(iterations_to_eps(prob, args.method, tau, args.eps, args.seed, mult)[0]
                                        for mult in mults)
            R.log({f"n{n}/iters": its, f"n{n}/tau": tau, f"n{n}/pred": res["pred"][tau]})
            print(f"n={n:3d} tau={tau:3d} iterations={its:9.1f} predicted bound={res['pred'][tau]:7d} "
                  f"factor 1+(m/tau-1)/n={rates.is_sgd_factor(m, tau, n):6.3f}"
                  + (f" tuned={res['tuned'][tau]}" if args.tune else ""))
        ratio = {t: res["iters"][t] / res["iters"][m] for t in taus}
        res["ratio"] = ratio
        res["knee"] = knee(taus, ratio)
        if args.tune:
            # normalised by the best count over tau (at tau = m the grid is cut by GD's limit 2/L)
            best = min(res["tuned"].values())
            tr = {t: res["tuned"][t] / best for t in taus}
            res["tuned_ratio"], res["tuned_knee"] = tr, knee(taus, tr)
        res["best_bits_tau"] = min(taus, key=lambda t: res["bits"][t])
        print(f"n={n}: measured iterations(tau)/iterations(m): "
              + ", ".join(f"{t}:{ratio[t]:.2f}" for t in taus) + "; predicted 1+(m/tau-1)/n: "
              + ", ".join(f"{t}:{rates.is_sgd_factor(m, t, n):.2f}" for t in taus))
        print(f"n={n}: knee (iterations double) at tau={res['knee']:.2f}, m/n={m / n:.2f}, m/(n+1)={m / (n + 1):.2f}; "
              f"fewest bits at tau={res['best_bits_tau']}"
              + (f"; tuned knee {res['tuned_knee']:.2f}" if args.tune else ""))
        results[n] = res
    plt = U.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, n in enumerate(ns):
        r, c = results[n], colors[j]
        axes[0].loglog(taus, [r["iters"][t] for t in taus], "o", color=c, label=f"n={n} measured")
        axes[0].loglog(taus, [r["pred"][t] for t in taus], "-", color=c, alpha=0.6, label=f"n={n} predicted bound")
        if args.method == "is_sgd":
            axes[0].loglog(taus, [r["iters"][m] * rates.is_sgd_factor(m, t, n) for t in taus], "--", color=c,
                           lw=1, alpha=0.8, label=f"n={n} iters(m) (1+(m/tau-1)/n)")
        if args.tune:
            axes[0].loglog(taus, [r["tuned"][t] for t in taus], "x", color=c, label=f"n={n} tuned")
        axes[0].axvline(m / n, color=c, ls=":", lw=1, label=f"n={n}: tau = m/n = {m / n:g}")
        axes[1].loglog(taus, [r["bits"][t] for t in taus], "o-", color=c, label=f"n={n}")
        axes[1].axvline(m / n, color=c, ls=":", lw=1, label=f"n={n}: tau = m/n = {m / n:g}")
    axes[0].set_xlabel("blocks per worker tau"), axes[0].set_ylabel(f"iterations to reach eps = {args.eps:g}")
    axes[1].set_xlabel("blocks per worker tau"), axes[1].set_ylabel(f"bits per worker to reach eps = {args.eps:g}")
    axes[0].legend(fontsize=7), axes[1].legend(fontsize=7)
    fig.suptitle(f"E4 '99%': {args.method}, m={m} blocks, kappa={args.kappa:g}; "
                 f"prediction kappa(1+(m/tau-1)/n)log(1/eps)")
    R.save_figure(fig, "iterations_vs_tau")
    summary = {f"n{n}": {"knee": r["knee"], "m_over_n": m / n, "best_bits_tau": r["best_bits_tau"],
                         "ratio": {str(t): v for t, v in r["ratio"].items()},
                         "iters": {str(t): v for t, v in r["iters"].items()},
                         "pred": {str(t): v for t, v in r["pred"].items()},
                         **({"tuned_knee": r["tuned_knee"]} if args.tune else {})}
               for n, r in results.items()}
    R.finish(summary)
    print(f"outputs in {R.out}")
    return summary


if __name__ == "__main__":
    main()
