"""theory.rates checked independently of its formulas.

Nothing here re-types a formula of ``theory/rates.py``. Four kinds of checks:

1. **worked numbers**: constants chosen so that the closed forms of the papers come out as short exact
   numbers, computed by hand and written as literals (a mutation of a constant, e.g. 3x the step or a
   dropped term of a min, changes the number);
2. **limiting cases**: without compression (omega = 0, delta = 1, tau = m) every step is gradient
   descent's 1/L; DIANA's step tends to 1/L_max as n grows; the caps take over where they should;
3. **monotonicity**: steps shrink with omega and L, grow with n and delta; iteration counts grow with
   kappa, omega and 1/eps;
4. **empirical rates on a quadratic**: f_i(x) = ||x - b_i||^2/2 (L_i = mu = 1). For rand-k, whose variance is
   omega||x||^2 for *every* x (tests/compressors/test_compressors_stats.py), one DCGD step from any e = x - x* with
   b_i = x* (interpolation) has the exact expectation E||e+||^2 = ((1 - g)^2 + g^2 omega/n) ||e||^2 =: rho(g)
   ||e||^2 (**derived**: e+ = e - g mean_i C_i(e), independent C_i). The library's DCGD is run from a fixed e
   many times and the measured mean ratio must match rho(g) within its Monte-Carlo error and lie below the
   bound 1 - g mu at the library's steps; 3x the interpolation step must expand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import DCGD
from theory import rates


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ 1. worked numbers
def test_diana_worked_numbers():
    # L_max = 2, omega = 9, n = 10: 1 + 6*9/10 = 6.4, gamma = 1/12.8 = 0.078125; alpha = 1/10
    gamma, alpha = rates.diana(2.0, 9.0, 10)
    assert (gamma, alpha) == (pytest.approx(0.078125, rel=1e-14), pytest.approx(0.1, rel=1e-14))
    # mu = 0.01: the cap alpha/(2 mu) = 5 does not bind
    assert rates.diana(2.0, 9.0, 10, mu=0.01)[0] == pytest.approx(0.078125, rel=1e-14)
    # mu = 1: the cap alpha/(2 mu) = 0.05 binds
    assert rates.diana(2.0, 9.0, 10, mu=1.0)[0] == pytest.approx(0.05, rel=1e-14)
    # L_max = 1, omega = 3, n = 2: 1 + 9 = 10 -> 0.1; alpha = 0.25, mu = 2 -> cap 0.0625
    assert rates.diana(1.0, 3.0, 2, mu=2.0) == (pytest.approx(0.0625, rel=1e-14), pytest.approx(0.25, rel=1e-14))
    # the guaranteed contraction and the Lyapunov weight 4 omega gamma^2/(alpha n n_eff)
    assert rates.diana_rate(0.05, 1.0) == pytest.approx(0.95, rel=1e-15)
    assert rates.diana_lyapunov_coefficient(9.0, 0.05, 0.1, 10) == pytest.approx(0.009, rel=1e-13)   # 0.09/10
    assert rates.diana_lyapunov_coefficient(9.0, 0.05, 0.1, 10, n_eff=1) == pytest.approx(0.09, rel=1e-13)


def test_diana_iteration_count_worked_numbers():
    # kappa = 100, omega = 9, n = 10: max(100 * 6.4, 2 * 10) = 640 iterations per e-fold
    assert rates.diana_iterations(100.0, 9.0, 10, math.exp(-1)) == 640
    assert rates.diana_iterations(100.0, 9.0, 10, math.exp(-10)) == 6395      # ceil(10/-log(1 - 1/640)) = ceil(6395 - 0.003)
    # kappa = 1, omega = 99, n = 1000: the 2(omega + 1) = 200 term binds (kappa (1 + 0.594) = 1.594)
    assert rates.diana_iterations(1.0, 99.0, 1000, math.exp(-1)) == 200


def test_other_steps_worked_numbers():
    # DCGD: L_max = 2, omega = 9, n = 10: 1/(2 + 2*9*2/10) = 1/5.6
    assert rates.dcgd(2.0, 9.0, 10) == pytest.approx(1 / 5.6, rel=1e-14)
    assert rates.dcgd(2.0, 9.0, 10, L=1.0) == pytest.approx(1 / 4.6, rel=1e-14)
    # DCGD floor 2 gamma omega sigma*^2/(mu n) at gamma = 0.1, omega = 9, sigma*^2 = 3, mu = 0.01, n = 10: 54
    assert rates.dcgd_neighbourhood(0.1, 9.0, 10, 0.01, 3.0) == pytest.approx(54.0, rel=1e-13)
    # IS-SGD (interpolation): L = L_max = 2, m = 100, tau = 5 (omega = 19), n = 10: 1/(2 + 3.8) = 1/5.8
    assert rates.is_sgd(2.0, 100, 5, 10) == pytest.approx(1 / 5.8, rel=1e-14)
    assert rates.is_sgd_factor(100, 5, 10) == pytest.approx(2.9, rel=1e-14)
    # EF21: delta = 0.19 gives sqrt(1 - delta) = 0.9, theta = 0.1, beta = 0.81/0.1 = 8.1, sqrt(beta/theta) = 9
    theta, beta = rates.ef21_theta_beta(0.19)
    assert (theta, beta) == (pytest.approx(0.1, rel=1e-13), pytest.approx(8.1, rel=1e-13))
    assert rates.ef21(1.0, 1.0, 0.19) == pytest.approx(0.1, rel=1e-13)
    # delta = 0.36: theta = 0.2, beta = 3.2, sqrt(beta/theta) = 4; L = 1, L_tilde = 2 -> 1/9
    assert rates.ef21(1.0, 2.0, 0.36) == pytest.approx(1 / 9, rel=1e-13)
    # EF21 under PL, delta = 0.36: min{1/(1 + 2 sqrt(32)), 0.2/(2 mu)}
    assert rates.ef21_pl(1.0, 2.0, 0.36, 1e-3) == pytest.approx(1 / (1 + 8 * math.sqrt(2)), rel=1e-13)
    assert rates.ef21_pl(1.0, 2.0, 0.36, 10.0) == pytest.approx(0.01, rel=1e-13)
    # the EF21 paper's sanity value: sqrt(beta/theta) = 18.487 at delta = 0.1
    t, b = rates.ef21_theta_beta(0.1)
    assert math.sqrt(b / t) == pytest.approx(18.487, abs=5e-4)
    # MARINA: L = L_tilde = 1, omega = 8, n = 4, p = 1/9: (1-p)/p * omega/n = 16, gamma = 1/(1 + 4) = 0.2
    gamma, p = rates.marina(1.0, 1.0, 8.0, 4)
    assert (gamma, p) == (pytest.approx(0.2, rel=1e-13), pytest.approx(1 / 9, rel=1e-14))
    # p = 0.5 with omega = 8, n = 4: sqrt(1 * 2) -> 1/(1 + sqrt 2)
    assert rates.marina(1.0, 1.0, 8.0, 4, p=0.5)[0] == pytest.approx(1 / (1 + math.sqrt(2)), rel=1e-13)
    # non-convex DIANA / VR-DIANA "Th.4": L = 2, omega = 9, n = 10, m = 8: 1/(10*2*sqrt(1.9)*(4 + 10))
    g, a = rates.diana_nonconvex(2.0, 9.0, 10, m=8)
    assert a == pytest.approx(0.1) and g == pytest.approx(1 / (280 * math.sqrt(1.9)), rel=1e-13)
    # VR-DIANA default (documented heuristic): L_sample = 4, omega = 9, n = 10, m = 50: 1/(24 * 6.4) = 1/153.6
    g, a, p = rates.vr_diana(4.0, 9.0, 10, 50)
    assert (g, a, p) == (pytest.approx(1 / 153.6, rel=1e-13), pytest.approx(0.1), pytest.approx(0.02))
    assert rates.vr_diana_iterations(10.0, 9.0, 10, 50, math.exp(-1)) == 78            # 10*1.9 + 50 + 9
    assert rates.L_tilde([1.0, 2.0, 2.0]) == pytest.approx(math.sqrt(3.0))
    assert rates.is_optimal_tau(100, 10) == 10.0


# ------------------------------------------------------------------ 2. limiting cases
@pytest.mark.parametrize("L", [0.5, 3.0])
def test_no_compression_is_gradient_descent(L):
    assert rates.diana(L, 0.0, 7) == (pytest.approx(1 / L), 1.0)
    assert rates.dcgd(L, 0.0, 7) == pytest.approx(1 / L)
    assert rates.is_sgd(L, 40, 40, 7) == pytest.approx(1 / L)
    assert rates.ef21(L, L, 1.0) == pytest.approx(1 / L)
    assert rates.marina(L, L, 0.0, 7)[0] == pytest.approx(1 / L)
    assert rates.ef21_theta_beta(1.0) == (1.0, 0.0)
    # GD at 1/L_max on a kappa-conditioned problem: kappa log(1/eps) iterations (-log(1-r) >= r)
    assert rates.diana_iterations(50.0, 0.0, 3, 1e-3) <= math.ceil(50 * math.log(1e3))


def test_many_workers_and_the_caps():
    # DIANA's step tends to 1/L_max as n grows (the compression variance is averaged away)
    steps = [rates.diana(1.0, 9.0, n)[0] for n in (1, 10, 100, 10_000, 10 ** 8)]
    assert steps[-1] == pytest.approx(1.0, rel=1e-6) and steps[0] == pytest.approx(1 / 55)
    # the cap alpha/(2 mu) binds exactly when mu > alpha (1 + 6 omega/n) L_max / 2
    L, omega, n = 1.0, 9.0, 10
    mu_star = 0.1 * 6.4 * L / 2                       # 0.32
    assert rates.diana(L, omega, n, mu=mu_star * 0.99)[0] == pytest.approx(1 / 6.4)
    assert rates.diana(L, omega, n, mu=mu_star * 1.01)[0] == pytest.approx(0.1 / (2 * mu_star * 1.01))
    # EF21's PL step: the theta/(2 mu) cap takes over for large mu
    assert rates.ef21_pl(1.0, 1.0, 0.19, 100.0) == pytest.approx(0.1 / 200)
    # MARINA with p = 1 (always full gradients) is GD whatever omega
    assert rates.marina(2.0, 5.0, 99.0, 3, p=1.0)[0] == pytest.approx(0.5)
    # the "99%" knee: 1 + omega/n = 2 exactly at tau = m/(n + 1)
    assert rates.is_sgd_factor(110, 10, 10) == pytest.approx(2.0)


# ------------------------------------------------------------------ 3. monotonicity
def test_monotonicity():
    omegas = [0.0, 0.5, 3.0, 9.0, 99.0]
    for f in (lambda w: rates.diana(1.0, w, 8)[0], lambda w: rates.dcgd(1.0, w, 8),
              lambda w: rates.marina(1.0, 1.0, w, 8)[0], lambda w: rates.diana_nonconvex(1.0, w, 8)[0]):
        s = [f(w) for w in omegas]
        assert all(a > b for a, b in zip(s, s[1:])), s
    ns = [1, 2, 5, 20, 100]
    for f in (lambda n: rates.diana(1.0, 9.0, n)[0], lambda n: rates.dcgd(1.0, 9.0, n),
              lambda n: rates.marina(1.0, 1.0, 9.0, n)[0], lambda n: rates.is_sgd(1.0, 100, 3, n)):
        s = [f(n) for n in ns]
        assert all(a < b for a, b in zip(s, s[1:])), s
    deltas = [0.01, 0.1, 0.5, 0.9, 1.0]
    s = [rates.ef21(1.0, 1.0, d) for d in deltas]
    assert all(a < b for a, b in zip(s, s[1:]))
    s = [rates.diana(L, 9.0, 10)[0] for L in (0.5, 1.0, 4.0)]
    assert all(a > b for a, b in zip(s, s[1:]))
    # DCGD admits a larger step than DIANA (2 vs 6 in front of omega/n)
    assert rates.dcgd(1.0, 9.0, 10) > rates.diana(1.0, 9.0, 10)[0]
    # iteration counts
    its = [rates.diana_iterations(k, 9.0, 10, 1e-6) for k in (1.0, 10.0, 100.0)]
    assert its[0] < its[1] < its[2]
    its = [rates.diana_iterations(50.0, w, 10, 1e-6) for w in (0.0, 9.0, 99.0)]
    assert its[0] < its[1] < its[2]
    its = [rates.diana_iterations(50.0, 9.0, 10, e) for e in (1e-2, 1e-6, 1e-12)]
    assert its[0] < its[1] < its[2]
    its = [rates.is_sgd_iterations(50.0, 100, t, 10, 1e-6) for t in (100, 10, 1)]
    assert its[0] < its[1] < its[2]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="omega"):
        rates.diana(1.0, math.inf, 4)
    with pytest.raises(ValueError, match="omega"):
        rates.marina(1.0, 1.0, -1.0, 4)
    with pytest.raises(ValueError, match="L_max"):
        rates.diana(0.0, 1.0, 4)
    with pytest.raises(ValueError, match="n must"):
        rates.dcgd(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="n_eff"):
        rates.diana_lyapunov_coefficient(1.0, 0.1, 0.5, 4, n_eff=5)
    with pytest.raises(ValueError):
        rates.ef21(1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        rates.is_sgd_factor(10, 11, 2)


# ------------------------------------------------------------------ 4. empirical rates on a quadratic
class _Quadratic:
    """f_i(x) = ||x - b_i||^2 / 2: L_i = L = mu = 1, x* = mean b_i, grad f_i(x*) = x* - b_i."""

    def __init__(self, n: int, d: int, spread: float, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.B = torch.randn(n, d, generator=g, dtype=torch.float64) * spread
        self.n, self.d = n, d
        self.L = self.L_max = self.mu = 1.0
        self.x_star = self.B.mean(0)
        self.grads_star = self.x_star - self.B

    def grads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0) - self.B


def _one_step_ratios(prob, lr, k, trials, seed=0):
    """||e+||^2/||e||^2 of `trials` single DCGD steps from the same e (fresh generator draws each time)."""
    e0 = torch.linspace(-1.0, 2.0, prob.d, dtype=torch.float64)
    x = prob.x_star + e0
    opt = DCGD([x], compressor="randk", k=k, problem=prob, lr=lr, seed=seed)
    out = np.empty(trials)
    for t in range(trials):
        with torch.no_grad():
            x.copy_(prob.x_star + e0)
        opt.step()
        out[t] = float(((x - prob.x_star) ** 2).sum() / (e0 ** 2).sum())
    return out


def test_dcgd_one_step_contraction_matches_the_exact_expectation_and_the_bound():
    n, d, k = 4, 8, 2
    omega = d / k - 1                                         # 3
    prob = _Quadratic(n, d, spread=0.0)                       # interpolation: b_i = x* = 0
    rho = lambda g: (1 - g) ** 2 + g * g * omega / n          # noqa: E731  (derived in the module doc)
    g_dcgd = rates.dcgd(prob.L_max, omega, n)                 # 0.4: rho = 0.48, bound 0.6
    g_is = rates.is_sgd(prob.L_max, d, k, n)                  # 4/7: rho = 1 - g exactly (tight)
    for g, label in ((g_dcgd, "dcgd"), (g_is, "is_sgd")):
        r = _one_step_ratios(prob, g, k, trials=300)
        se = r.std(ddof=1) / math.sqrt(r.size)
        assert abs(r.mean() - rho(g)) <= 4.5 * se, (label, r.mean(), rho(g), se)
        assert r.mean() <= (1 - g * prob.mu) + 4.5 * se, (label, r.mean(), 1 - g)
    assert rho(g_dcgd) < 1 - g_dcgd - 0.1                     # DCGD's certified step has slack
    assert rho(g_is) == pytest.approx(1 - g_is, rel=1e-12)    # the interpolation step is tight
    # 3x the interpolation step expands in expectation (rho = 1.4): the bound is not vacuous
    r = _one_step_ratios(prob, 3 * g_is, k, trials=150)
    assert r.mean() > 1.2 and rho(3 * g_is) > 1.3


def test_dcgd_floor_is_below_the_bound_and_near_the_exact_fixed_point():
    """Heterogeneous b_i: E||e+||^2 = rho(g)||e||^2 + g^2 omega sigma*^2/n (the cross terms sum to zero
    over workers since sum_i (x* - b_i) = 0), fixed point r = g omega sigma*^2 / (n (2 - g (1 + omega/n)))
    (**derived**), which :func:`theory.rates.dcgd_neighbourhood` (2 g omega sigma*^2/(mu n)) must bound."""
    n, d, k = 4, 8, 2
    omega = d / k - 1
    prob = _Quadratic(n, d, spread=1.0, seed=3)
    sigma = float((prob.grads_star ** 2).sum(1).mean())
    x = prob.x_star.clone()
    opt = DCGD([x], compressor="randk", k=k, problem=prob, seed=5)
    g = opt.lr
    assert g == pytest.approx(rates.dcgd(1.0, omega, n))
    vals = []
    for it in range(3000):
        opt.step()
        if it >= 100:
            vals.append(float(((x - prob.x_star) ** 2).sum()))
    vals = np.asarray(vals)
    exact = g * omega * sigma / (n * (2 - g * (1 + omega / n)))
    bound = rates.dcgd_neighbourhood(g, omega, n, prob.mu, sigma)
    # batch means over 100-step batches (the chain mixes in a few steps: rho = 0.48)
    bm = vals[: vals.size // 100 * 100].reshape(-1, 100).mean(1)
    se = bm.std(ddof=1) / math.sqrt(bm.size)
    assert abs(vals.mean() - exact) <= 5 * se, (vals.mean(), exact, se)
    assert vals.mean() < bound and exact < bound / 2
