"""E3: MARINA vs DIANA on a non-convex problem with rand-K, K in {1, 5, 10}.

Set-up after the MARINA authors' code (``burlachenkok/marina``, ``experiment_no_vr_all.py``): n = 5
workers with equal chunks, x^0 = 0, rand-K (independent per worker), both methods at their theoretical
steps:

- MARINA: p = 1/(omega+1), gamma = 1/(L + L_tilde sqrt((1-p) omega/(p n)))  (theory.rates.marina);
- DIANA: alpha = 1/(omega+1), gamma = 1/(10 L_max sqrt(1 + omega/n) (omega + 2))  (the code's "Th.4", m = 1;
  theory.rates.diana_nonconvex).

Substitute problem: logistic loss + 0.1 sum_j x_j^2/(1+x_j^2) (non-convex) on scikit-learn's digits (d = 61)
instead of the code's (1 - sigmoid)^2 loss on LIBSVM sets. Expected: MARINA reaches a much smaller
||grad f||^2 for the same bits; DIANA's non-convex step is very conservative.

    python -m experiments.reproduce_marina [--quick] [--dataset breast_cancer] [--out DIR]
    python -m experiments.reproduce_marina --quick --seeds 5   # rand-K's draws over 5 seeds: mean and band

``--seeds K`` keeps the problem (``--seed``) and runs both methods with rand-K seeds ``--seed`` ..
``--seed + K - 1``: the printed lines add the log10 of the final ||grad f||^2 as mean ± std over them, the
figure the geometric mean with a band of one geometric standard deviation; summary.json keeps the first
seed's numbers per row, the seeds' under ``seeds``. In the figure the method is the line style, K the colour
and the marker: against bits, DIANA's curves for every K lie on one line (its rate per bit hardly depends on
K), so the markers tell them apart.
"""

from __future__ import annotations

import math

import torch

from sparsecomm.algorithms import DIANA, MARINA
from sparsecomm.theory import problems as P
from sparsecomm.theory import rates

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_marina", __doc__)
    ap.add_argument("--dataset", default="digits", help="digits | breast_cancer | wine")
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--nc-lam", type=float, default=0.1)
    ap.add_argument("--ks", default="1,5,10", help="rand-K sizes")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default 20000, quick 500)")
    cli.add_seeds(ap)
    args = ap.parse_args(argv)
    seeds = S.seeds_of(ap, args)
    prob = P.logistic(args.dataset, n_workers=args.workers, split="iid", lam=0.0, nc_lam=args.nc_lam, seed=args.seed)
    ks = [int(k) for k in args.ks.split(",")]
    iters = args.iters or (500 if args.quick else 20000)
    every = max(1, iters // 400)
    R = U.Run("reproduce_marina", args, dict(problem=repr(prob), ks=ks, iters=iters, seeds=seeds))
    print(prob)
    results = {}
    for k in R.progress(ks, desc="K values"):
        omega = prob.d / k - 1
        for name in ("MARINA", "DIANA"):
            per_seed = []
            for sd in seeds:             # the problem stays; rand-K's draws change with the seed
                x = torch.zeros(prob.d, dtype=torch.float64)
                if name == "MARINA":
                    opt = MARINA([x], compressor="randk", k=k, problem=prob, seed=sd)
                else:
                    gamma, _ = rates.diana_nonconvex(prob.L_max, omega, prob.n)
                    opt = DIANA([x], compressor="randk", k=k, problem=prob, lr=gamma, seed=sd)
                its, gn, bits = [0], [prob.grad_norm_sq(x)], [0]
                for it in range(1, iters + 1):
                    opt.step()
                    if it % every == 0 or it == iters:
                        its.append(it), gn.append(prob.grad_norm_sq(x)), bits.append(opt.bits_sent)
                per_seed.append((its, gn, bits))
            its, gn, bits = per_seed[0]
            finals = [r[1][-1] for r in per_seed]
            results[(name, k)] = dict(its=its, gn=gn, bits=bits, gamma=opt.lr, final=gn[-1],
                                      bits_per_worker=bits[-1] / prob.n,
                                      p=getattr(opt, "p", None), per_seed=per_seed)
            if len(seeds) > 1:
                results[(name, k)]["seeds"] = dict(seeds=seeds, final=finals)
            for i, g, b in zip(its, gn, bits):
                R.log({f"{name}_K{k}/grad_norm_sq": g, f"{name}_K{k}/bits_per_worker": b / prob.n})
            print(f"K={k:3d} {name:6s} gamma={opt.lr:.4g} final ||grad f||^2={gn[-1]:.3e} (start {gn[0]:.3e}) "
                  f"bits/worker={bits[-1] / prob.n:.3g}")
            if len(seeds) > 1:
                logs = [math.log10(f) if f > 0 else math.nan for f in finals]
                print(f"K={k:3d} {name:6s} over {len(seeds)} seeds: log10 final ||grad f||^2 "
                      f"{report.fmt_mean_std(logs, '.2f')}")
    plt = U.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, k in enumerate(ks):
        for name, ls in (("MARINA", "-"), ("DIANA", "--")):
            runs = results[(name, k)]["per_seed"]
            its, gn = [r[0] for r in runs], [r[1] for r in runs]
            # the colour and the marker say K; the shortest curves on top (DIANA K=1 ends first under the others)
            style = dict(ls=ls, color=colors[j], marker=MARKERS[j % len(MARKERS)], ms=5, zorder=3 + len(ks) - j,
                         label=f"{name} K={k}")
            band = S.band(its, gn, log=True)
            S.draw(axes[0], band, markevery=_every(len(band.x), j, len(ks)), **style)
            band = S.band(its, gn, [[b / prob.n for b in r[2]] for r in runs], log=True)
            S.draw(axes[1], band, markevery=_every(len(band.x), j, len(ks)), **style)
    axes[0].set_xlabel("iteration"), axes[1].set_xlabel("bits sent per worker")
    plots.count_axis(axes[0].xaxis)
    plots.si_axis(axes[1].xaxis)
    for a in axes:
        a.set_yscale("log")
        a.set_ylabel(r"squared gradient norm $\|\nabla f(x)\|^2$")
    plots.legend_below(axes[0], ncol=len(ks), fontsize=8)
    plots.legend_below(axes[1], ncol=len(ks), fontsize=8)
    fig.suptitle(f"E3: MARINA vs DIANA at theoretical steps, {prob.name}, n={prob.n}, nc_lam={args.nc_lam}"
                 + (f"\n{S.caption(len(seeds), log=True)}" if len(seeds) > 1 else ""))
    fig.tight_layout()
    R.save_figure(fig, "marina_vs_diana")
    summary = {f"{n}_K{k}": {a: v for a, v in r.items() if a not in ("its", "gn", "bits", "per_seed")}
               for (n, k), r in results.items()}
    summary["problem"] = repr(prob)
    R.finish(summary)
    print(f"outputs in {R.out}")
    return summary


#: markers of the K values (the colour says K too; the markers tell coinciding curves apart)
MARKERS = ("o", "s", "^", "D", "v", "P")


def _every(npoints: int, j: int, nk: int) -> tuple[int, int]:
    """About 8 markers a curve, staggered by K so that markers of coinciding curves do not cover each other."""
    step = max(nk, npoints // 8)
    return (j * step // nk, step)


if __name__ == "__main__":
    main()
