"""E1: DIANA vs DCGD on heterogeneous logistic regression.

Set-up after the DIANA-RR experiments (arXiv 2206.07021 §3 and the authors' RR code): 20 workers, rows
sorted by label and cut into contiguous chunks (every worker sees mostly one class, so
grad f_i(x*) != 0), rand-k with k/d ~ 0.02 (independent per worker), alpha = 1/(omega+1) and
gamma = DIANA's theoretical step 1/((1 + 6 omega/n) L_max) times {1, 2, 4, 8}; DCGD runs at the same
steps (so the only difference is the shifts). x^0 = 0.

Expected: DIANA converges linearly to x* (||x - x*||^2 < 1e-10), at least as fast as
the theorem's 1 - gamma mu per iteration; DCGD stalls at a neighbourhood below its floor
2 gamma omega sigma*^2/(mu n).

The bounds are certified only up to each method's theoretical step: DIANA's rate 1 - gamma mu for
gamma <= DIANA's step (the 1x row only), DCGD's floor for gamma <= 1/(L + 2 omega L_max/n) (DCGD's own step,
up to ~3x DIANA's). Rows above those steps print "n/a" and store ``None`` for the bound, with
``certified: False``: what they measure is the behaviour beyond the theory, not a check of it. Reproduction "in spirit" on substitute data (synthetic d = 100 by default,
or scikit-learn's digits, d = 61, k = 1).

    python -m experiments.reproduce_diana                    # the full grid
    python -m experiments.reproduce_diana --quick            # a reduced grid
    python -m experiments.reproduce_diana --problem digits --out /tmp/e1
    python -m experiments.reproduce_diana --quick --seeds 5  # rand-k's draws over 5 seeds: mean and band

``--seeds K`` keeps the problem (``--seed``) and runs every method and step for rand-k seeds ``--seed`` ..
``--seed + K - 1``: the printed lines give the log10 of the final distance and the iteration that reaches
the tolerance as mean ± std over them, the figure their geometric mean with a band of one geometric
standard deviation; the per-row numbers of summary.json stay the first seed's, with the seeds' under
``seeds``.
"""

from __future__ import annotations

import math

import torch

from sparsecomm.algorithms import DCGD, DIANA
from sparsecomm.theory import problems as P
from sparsecomm.theory import rates

from .common import cli, plots, report
from .common import seeds as S
from .common import reproduce as U

TOL = 1e-10


def build_problem(name: str, quick: bool, seed: int) -> P.FiniteSumProblem:
    if name == "synthetic":
        if quick:
            return P.synthetic_logistic(n_workers=20, rows_per_worker=25, d=50, kappa=10.0, split="label", seed=seed)
        return P.synthetic_logistic(n_workers=20, rows_per_worker=50, d=100, kappa=30.0, split="label", seed=seed)
    return P.logistic(name, n_workers=20, split="label", kappa=30.0 if not quick else 10.0, seed=seed)


def run(opt, x, prob, iters: int, every: int, stop_below: float | None = None):
    its, dist, bits = [0], [U.sqdist(x, prob.x_star)], [0]
    for it in range(1, iters + 1):
        try:
            opt.step()
        except Exception:                                  # non-finite gradients: diverged
            its.append(it), dist.append(math.inf), bits.append(opt.bits_sent)
            break
        if it % every == 0 or it == iters:
            e = U.sqdist(x, prob.x_star)
            its.append(it), dist.append(e), bits.append(opt.bits_sent)
            if not math.isfinite(e) or e > 1e8 * dist[0]:
                break
            if stop_below is not None and e < stop_below:
                break
    return its, dist, bits


def main(argv=None) -> dict:
    ap = U.parser("python -m experiments.reproduce_diana", __doc__)
    ap.add_argument("--problem", default="synthetic", help="synthetic | digits | breast_cancer | wine")
    ap.add_argument("--ratio", type=float, default=0.02, help="k/d of rand-k (k = max(1, round(ratio d)))")
    ap.add_argument("--multipliers", default="1,2,4,8", help="step-size multipliers of the theoretical gamma")
    ap.add_argument("--iters", type=int, default=None, help="iteration cap per run (default: 4x the theorem's count)")
    cli.add_seeds(ap)
    args = ap.parse_args(argv)
    seeds = S.seeds_of(ap, args)
    prob = build_problem(args.problem, args.quick, args.seed)
    k = max(1, round(args.ratio * prob.d))
    omega = prob.d / k - 1
    gamma, alpha = rates.diana(prob.L_max, omega, prob.n, prob.mu)
    gamma_dcgd = rates.dcgd(prob.L_max, omega, prob.n, L=prob.L)
    mults = [float(m) for m in args.multipliers.split(",")]
    d0 = U.sqdist(torch.zeros(prob.d, dtype=torch.float64), prob.x_star)
    bound_iters = rates.diana_iterations(prob.kappa_max, omega, prob.n, TOL / d0)
    cap = args.iters or (min(bound_iters, 3000) if args.quick else 4 * bound_iters)
    config = dict(problem=repr(prob), k=k, omega=omega, gamma=gamma, alpha=alpha, gamma_dcgd=gamma_dcgd,
                  multipliers=mults,
                  L=prob.L, L_max=prob.L_max, mu=prob.mu, sigma_star_sq=prob.sigma_star_sq, cap=cap)
    R = U.Run("reproduce_diana", args, config)
    print(prob)
    print(f"rand-k k={k} (omega={omega:g}), theoretical gamma={gamma:.4g}, alpha={alpha:.4g}, "
          f"theorem's iterations to {TOL:g}: {bound_iters}")
    every = max(1, cap // 400)
    results = {}
    for mult in R.progress(mults, desc="step multipliers"):
        for name, cls in (("DIANA", DIANA), ("DCGD", DCGD)):
            stop = TOL / 1000 if name == "DIANA" else None
            iters = cap if name == "DIANA" else min(cap, max(2000, results.get(("DIANA", mult), {}).get("iters", cap)))
            per_seed = []
            for seed in seeds:             # the problem stays; rand-k's draws change with the seed
                x = torch.zeros(prob.d, dtype=torch.float64)
                opt = cls([x], compressor="randk", k=k, problem=prob, lr=mult * gamma, seed=seed)
                per_seed.append(run(opt, x, prob, iters, every, stop))
            its, dist, bits = per_seed[0]
            hit = next((i for i, e in zip(its, dist) if e < TOL), None)
            tail = [e for i, e in zip(its, dist) if i > its[-1] / 2]
            q_meas = U.fit_rate([e for e in dist if TOL / 1e3 < e < d0 * 1e-2],
                                [i for i, e in zip(its, dist) if TOL / 1e3 < e < d0 * 1e-2])
            step = mult * gamma
            # each bound holds only up to the method's own certified step (module doc)
            certified = step <= (gamma if name == "DIANA" else gamma_dcgd) * (1 + 1e-12)
            res = dict(iters=its[-1], final=dist[-1], hit_tol_at=hit, tail_mean=sum(tail) / len(tail),
                       rate_measured=q_meas, certified=certified,
                       rate_theorem=rates.diana_rate(step, prob.mu) if name == "DIANA" and certified else None,
                       floor_dcgd=(rates.dcgd_neighbourhood(step, omega, prob.n, prob.mu, prob.sigma_star_sq)
                                   if name == "DCGD" and certified else None),
                       bits_per_worker=bits[-1] / prob.n, its=its, dist=dist, bits=bits, per_seed=per_seed)
            if len(seeds) > 1:
                finals = [r[1][-1] for r in per_seed]
                hits = [next((i for i, e in zip(r[0], r[1]) if e < TOL), None) for r in per_seed]
                res["seeds"] = dict(seeds=seeds, final=finals, hit_tol_at=hits)
                reached = [h for h in hits if h is not None]
                over_seeds = (f"{name:5s} x{mult:<3g} over {len(seeds)} seeds: log10 final "
                      f"{report.fmt_mean_std([math.log10(f) for f in finals if 0 < f < math.inf], '.2f')}; "
                      f"hit {TOL:g} in {len(reached)}/{len(seeds)}"
                              + (f" at {report.fmt_mean_std(reached, '.0f')}" if reached else ""))
            results[(name, mult)] = res
            for i, e, b in zip(its, dist, bits):
                R.log({f"{name}_x{mult:g}/dist": e, f"{name}_x{mult:g}/bits_per_worker": b / prob.n})
            if name == "DIANA":
                bound = (f"theorem's rate {res['rate_theorem']:.6f}" if certified
                         else f"theorem's rate n/a (step {mult:g}x DIANA's, not certified)")
            else:
                bound = (f"floor bound {res['floor_dcgd']:.3e}" if certified
                         else f"floor bound n/a (step {step / gamma_dcgd:.3g}x DCGD's, not certified)")
            print(f"{name:5s} x{mult:<3g} iters={its[-1]:6d} final={dist[-1]:.3e} hit {TOL:g} at {hit} "
                  f"tail mean={res['tail_mean']:.3e} rate={q_meas:.6f}; {bound}")
            if len(seeds) > 1:
                print(over_seeds)
    plt = U.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, mult in enumerate(mults):
        for name, ls in (("DIANA", "-"), ("DCGD", "--")):
            col = colors[j % len(colors)]
            runs = results[(name, mult)]["per_seed"]
            its, dist = [r[0] for r in runs], [r[1] for r in runs]
            S.draw(axes[0], S.band(its, dist, log=True), ls=ls, color=col, label=f"{name} {mult:g}x")
            S.draw(axes[1], S.band(its, dist, [[b / prob.n for b in r[2]] for r in runs], log=True), ls=ls, color=col)
    for a in axes:
        a.set_yscale("log")
    axes[0].axhline(TOL, color="k", lw=0.5, label=f"tolerance {TOL:g}")
    axes[0].set_xlabel("iteration"), axes[1].set_xlabel("bits sent per worker")
    plots.count_axis(axes[0].xaxis)
    plots.si_axis(axes[1].xaxis)
    for a in axes:
        a.set_ylabel(r"squared distance to the optimum $\|x - x^*\|^2$")
    plots.legend_below(axes[0], ncol=3)
    fig.suptitle(f"E1: DIANA vs DCGD, {prob.name}, n={prob.n}, rand-{k} of {prob.d}, gamma x {args.multipliers}"
                 + (f"\n{S.caption(len(seeds), log=True)}" if len(seeds) > 1 else ""))
    R.save_figure(fig, "diana_vs_dcgd")
    summary = {f"{name}_x{m:g}": {k2: v for k2, v in r.items() if k2 not in ("its", "dist", "bits", "per_seed")}
               for (name, m), r in results.items()}
    summary.update(problem=repr(prob), k=k, omega=omega, gamma=gamma, gamma_dcgd=gamma_dcgd, alpha=alpha,
                   theorem_iterations=bound_iters)
    path = R.finish(summary)
    print(f"outputs in {R.out} ({path.name})")
    return summary


if __name__ == "__main__":
    main()
