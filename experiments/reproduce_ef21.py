"""E2: EF21 vs classic EF with top-1, non-convex logistic regression.

Set-up after the EF21 authors' code (``IgorSokoloff/ef21_experiments_source_code``): loss
logistic + lam sum_j x_j^2/(1 + x_j^2) with lam = 0.1 (no l2 term), n = 20 workers, x^0 ~ N(0, I), top-1.
EF21 at its theoretical step gamma = 1/(L + L_tilde sqrt(beta/theta)) (theta = 1 - sqrt(1-delta),
beta = (1-delta)/(1-sqrt(1-delta)), delta = 1/d) times multipliers; classic EF has no closed-form step and
is tuned over the same grid (best final ||grad f||^2). Substitute data: scikit-learn's digits (d = 61,
label-sorted split: heterogeneous) instead of LIBSVM phishing.

Expected: EF21 is stable at the theoretical step and tolerates large multipliers; for the same bits it
reaches a smaller ||grad f||^2 than tuned EF. The plot is ||grad f(x)||^2 against bits sent per worker.

    python -m experiments.reproduce_ef21 [--quick] [--dataset breast_cancer] [--out DIR]
    python -m experiments.reproduce_ef21 --quick --seeds 5     # x^0 drawn for 5 seeds: mean and band

``--seeds K`` keeps the problem (``--seed``) and draws x^0 for seeds ``--seed`` .. ``--seed + K - 1`` (top-k
itself is deterministic): the printed lines add the log10 of the final ||grad f||^2 as mean ± std over them,
EF's tuning picks the multiplier with the smallest mean log10 final, and the figures draw the geometric mean
with a band of one geometric standard deviation; summary.json keeps the first seed's numbers per row, the
seeds' under ``seeds``.
"""

from __future__ import annotations

import math

import torch

from sparsecomm.algorithms import EF, EF21
from sparsecomm.theory import problems as P
from sparsecomm.theory import rates

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U


def run(opt, x, prob, iters: int, every: int):
    its, gn, bits = [0], [prob.grad_norm_sq(x)], [0]
    for it in range(1, iters + 1):
        try:
            opt.step()
        except Exception:
            its.append(it), gn.append(math.inf), bits.append(opt.bits_sent)
            break
        if it % every == 0 or it == iters:
            g = prob.grad_norm_sq(x)
            its.append(it), gn.append(g), bits.append(opt.bits_sent)
            if not math.isfinite(g) or g > 1e8 * gn[0]:
                gn[-1] = math.inf
                break
    return its, gn, bits


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_ef21", __doc__)
    ap.add_argument("--dataset", default="digits", help="digits | breast_cancer | wine")
    ap.add_argument("--workers", type=int, default=20)
    ap.add_argument("--nc-lam", type=float, default=0.1, help="weight of the non-convex regulariser")
    ap.add_argument("--k", type=int, default=1, help="top-k")
    ap.add_argument("--multipliers", default="1,4,16,64,256", help="multipliers of EF21's theoretical step")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default 10000, quick 600)")
    cli.add_seeds(ap)
    args = ap.parse_args(argv)
    seeds = S.seeds_of(ap, args)
    prob = P.logistic(args.dataset, n_workers=args.workers, split="label", lam=0.0, nc_lam=args.nc_lam, seed=args.seed)
    delta = args.k / prob.d
    gamma = rates.ef21(prob.L, prob.L_tilde, delta)
    theta, beta = rates.ef21_theta_beta(delta)
    mults = [float(m) for m in args.multipliers.split(",")]
    iters = args.iters or (600 if args.quick else 10000)
    every = max(1, iters // 300)
    x0s = [torch.randn(prob.d, generator=torch.Generator().manual_seed(sd), dtype=torch.float64) for sd in seeds]
    R = U.Run("reproduce_ef21", args, dict(problem=repr(prob), k=args.k, delta=delta, gamma_ef21=gamma,
                                            theta=theta, beta=beta, multipliers=mults, iters=iters,
                                            seeds=seeds))
    print(prob)
    print(f"top-{args.k}: delta={delta:.4g}, sqrt(beta/theta)={math.sqrt(beta / theta):.4g}, EF21 gamma={gamma:.4g}")
    results = {}
    for name, cls in R.progress((("EF21", EF21), ("EF", EF)), desc="methods"):
        for m in mults:
            per_seed = []
            for sd, x0 in zip(seeds, x0s):
                x = x0.clone()
                opt = cls([x], compressor="topk", k=args.k, problem=prob, lr=m * gamma, seed=sd)
                per_seed.append(run(opt, x, prob, iters, every))
            its, gn, bits = per_seed[0]
            finals = [r[1][-1] for r in per_seed]
            results[(name, m)] = dict(its=its, gn=gn, bits=bits, final=gn[-1], min=min(gn),
                                      bits_per_worker=bits[-1] / prob.n, per_seed=per_seed,
                                      log10_final=S.stats([_log10(f) for f in finals]))
            if len(seeds) > 1:
                results[(name, m)]["seeds"] = dict(seeds=seeds, final=finals)
            for i, g, b in zip(its, gn, bits):
                R.log({f"{name}_x{m:g}/grad_norm_sq": g, f"{name}_x{m:g}/bits_per_worker": b / prob.n})
            print(f"{name:4s} x{m:<5g} final ||grad f||^2 = {gn[-1]:.3e}  (min {min(gn):.3e}, start {gn[0]:.3e}), "
                  f"bits/worker {bits[-1] / prob.n:.3g}")
            if len(seeds) > 1:
                print(f"{name:4s} x{m:<5g} over {len(seeds)} seeds: log10 final ||grad f||^2 "
                      f"{report.fmt_mean_std(results[(name, m)]['log10_final']['per_seed'], '.2f')}")

    def rank(key):                         # smallest mean log10 final; a diverged run (inf) ranks last
        mean = results[key]["log10_final"]["mean"]
        return mean if math.isfinite(mean) else math.inf

    best_ef = min(mults, key=lambda m: rank(("EF", m)))
    best_ef21 = min(mults, key=lambda m: rank(("EF21", m)))
    plt = U.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, m in enumerate(mults):
        S.draw(axes[0], _band(results[("EF21", m)], prob.n), ls="-", color=colors[j], label=f"EF21 {m:g}x")
        S.draw(axes[1], _band(results[("EF", m)], prob.n), ls="--", color=colors[j], label=f"EF {m:g}x")
    for a in axes:
        a.set_yscale("log")
        a.set_xlabel("bits sent per worker"), a.set_ylabel(r"squared gradient norm $\|\nabla f(x)\|^2$")
        plots.legend_below(a, ncol=3)
        plots.si_axis(a.xaxis)
    axes[0].set_title(f"EF21, gamma x multiplier (theory gamma={gamma:.3g})")
    axes[1].set_title("EF (no theoretical step), same grid")
    fig.suptitle(f"E2: top-{args.k}, {prob.name}, n={prob.n}, nc_lam={args.nc_lam}"
                 + (f"\n{S.caption(len(seeds), log=True)}" if len(seeds) > 1 else ""))
    fig.tight_layout()
    R.save_figure(fig, "ef21_vs_ef")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    shown = [("EF21", 1.0, "-", "EF21 1x (theory" + (", and best)" if best_ef21 == 1.0 else ")")),
             *([("EF21", best_ef21, "-", f"EF21 {best_ef21:g}x (best)")] if best_ef21 != 1.0 else []),
             ("EF", best_ef, "--", f"EF {best_ef:g}x (tuned)")]
    for name, m, ls, label in shown:          # the theory's step drawn once where it is also the best
        S.draw(ax, _band(results[(name, m)], prob.n), ls=ls, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("bits sent per worker"), ax.set_ylabel(r"squared gradient norm $\|\nabla f(x)\|^2$")
    plots.legend_below(ax, ncol=3, fontsize=8)
    plots.si_axis(ax.xaxis)
    ax.set_title("EF21 (theory and best) vs tuned EF"
                 + (f"\n{S.caption(len(seeds), log=True)}" if len(seeds) > 1 else ""), fontsize=9)
    fig.tight_layout()
    R.save_figure(fig, "ef21_vs_tuned_ef")
    summary = {f"{n}_x{m:g}": {k: v for k, v in r.items() if k not in ("its", "gn", "bits", "per_seed")}
               for (n, m), r in results.items()}
    summary.update(problem=repr(prob), gamma_ef21=gamma, delta=delta, best_ef_multiplier=best_ef,
                   best_ef21_multiplier=best_ef21)
    R.finish(summary)
    print(f"best EF x{best_ef:g}: {results[('EF', best_ef)]['final']:.3e}; EF21 x1: {results[('EF21', 1.0)]['final']:.3e}; "
          f"best EF21 x{best_ef21:g}: {results[('EF21', best_ef21)]['final']:.3e}; outputs in {R.out}")
    return summary


def _log10(v: float) -> float:
    return math.log10(v) if 0 < v < math.inf else (math.inf if v == math.inf else math.nan)


def _band(result: dict, n: int) -> S.Band:
    """||grad f||^2 against bits sent per worker over the seeds: geometric mean and band."""
    runs = result["per_seed"]
    return S.band([r[0] for r in runs], [r[1] for r in runs], [[b / n for b in r[2]] for r in runs], log=True)


if __name__ == "__main__":
    main()
