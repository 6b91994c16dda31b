"""algorithms/: the DIANA family, EF21 and MARINA against their theory (fast versions of the
reproductions E1 and E4, the Lyapunov guarantee, exact reductions to gradient descent, the API)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from algorithms import DCGD, DIANA, EF, EF21, ISDIANA, ISSGD, MARINA, ConfigError, IndependentBlockSparsifier
from sparsecomm.errors import MismatchError, SparseCommError
from theory import problems as P
from theory import rates


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dist(x, prob):
    return float(((x - prob.x_star) ** 2).sum())


@pytest.fixture(scope="module")
def hetero():
    """Heterogeneous (label-sorted) logistic regression, 20 workers, d = 50, kappa = 10."""
    return P.synthetic_logistic(n_workers=20, rows_per_worker=25, d=50, kappa=10.0, split="label", seed=0)


# ------------------------------------------------------------------------ E1, fast version
def test_diana_reaches_x_star_where_dcgd_stalls(hetero):
    """E1: rand-2 of 50 (omega = 24), both at DIANA's theoretical step: DIANA gets ||x - x*||^2 < 1e-10,
    DCGD stays above 1e-4 and below its theoretical floor 2 gamma omega sigma*^2/(mu n)."""
    prob, k = hetero, 2
    omega = prob.d / k - 1
    gamma, alpha = rates.diana(prob.L_max, omega, prob.n, prob.mu)
    assert prob.sigma_star_sq > 1e-2                       # heterogeneous: grad f_i(x*) != 0

    x = torch.zeros(prob.d, dtype=torch.float64)
    diana = DIANA([x], compressor="randk", k=k, problem=prob, seed=1)
    assert diana.lr == pytest.approx(gamma) and diana.alpha == pytest.approx(alpha)
    hit = None
    for it in range(1, 4001):
        diana.step()
        if _dist(x, prob) < 1e-10:
            hit = it
            break
    assert hit is not None, f"DIANA did not reach 1e-10 in 4000 iterations ({_dist(x, prob):.2e})"
    # the theorem's iteration count is an upper bound (on the expectation of the Lyapunov function)
    assert hit <= rates.diana_iterations(prob.kappa_max, omega, prob.n, 1e-10 / _dist(torch.zeros(prob.d), prob))

    y = torch.zeros(prob.d, dtype=torch.float64)
    dcgd = DCGD([y], compressor="randk", k=k, problem=prob, lr=gamma, seed=1)
    tail = []
    for it in range(1, 601):        # 1 - gamma mu = 0.994: the start's 3.5 is below 0.1 by step 300
        dcgd.step()
        if it > 300:
            tail.append(_dist(y, prob))
    floor = rates.dcgd_neighbourhood(gamma, omega, prob.n, prob.mu, prob.sigma_star_sq)
    assert min(tail) > 1e-4, "DCGD should stall at a neighbourhood of x*"
    assert np.mean(tail) < floor
    assert diana.bits_sent == hit * prob.n * k * 64 and dcgd.bits_sent == 600 * prob.n * k * 64


# ------------------------------------------------------------------------ E4, fast version
def _iters_to_eps(prob, tau, eps=1e-6, seed=0, maxit=5000):
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = ISSGD([x], tau=tau, problem=prob, seed=seed)
    e0 = _dist(x, prob)
    for it in range(1, maxit + 1):
        opt.step()
        e = _dist(x, prob)
        if not e < 1e6 * e0:
            return math.inf
        if e <= eps * e0:
            return it
    return math.inf


def test_99_percent_knee_at_m_over_n():
    """E4: IS-SGD (independent rand-tau of m = d blocks) on an interpolating quadratic with equal L_i:
    iterations flat within 2x down to tau ~ m/n, growing below; the measured knee (where the count doubles)
    is at m/n within a factor 2, and each count tracks kappa (1 + (m/tau - 1)/n) within 1.5x."""
    n, d = 10, 40
    prob = P.synthetic_least_squares(n_workers=n, rows_per_worker=d, d=d, kappa=10.0, homogeneous=True)
    assert prob.L_max == pytest.approx(prob.L)
    taus = [1, 2, 3, 4, 6, 10, 20, 40]
    its = {t: _iters_to_eps(prob, t) for t in taus}
    assert all(math.isfinite(v) for v in its.values()), its
    ratio = {t: its[t] / its[d] for t in taus}
    for t in taus:
        pred = rates.is_sgd_factor(d, t, n)
        assert pred / 1.5 <= ratio[t] <= pred * 1.5, (t, ratio[t], pred)
    # knee: log-log interpolation of the tau where the ratio crosses 2
    knee = None
    for lo, hi in zip(taus, taus[1:]):
        if ratio[lo] >= 2 > ratio[hi]:
            w = math.log(ratio[lo] / 2) / math.log(ratio[lo] / ratio[hi])
            knee = math.exp(math.log(lo) + w * (math.log(hi) - math.log(lo)))
    assert knee is not None, ratio
    m_over_n = rates.is_optimal_tau(d, n)
    assert m_over_n / 2 <= knee <= 2 * m_over_n, (knee, ratio)
    assert ratio[1] >= 3.0 and max(ratio[t] for t in taus if t >= m_over_n) <= 2.2


# ------------------------------------------------------------------------ DIANA's theorem
def test_diana_lyapunov_contracts_at_least_as_fast_as_the_theorem(hetero):
    """E V^k <= (1 - gamma mu)^k V^0 (arXiv 2206.07021 Thm 2.2): the mean over seeds of V^k after k steps
    is below the bound, at several checkpoints."""
    prob = hetero
    checkpoints = (50, 150, 400)
    vals = {c: [] for c in checkpoints}
    for seed in range(2):
        x = torch.zeros(prob.d, dtype=torch.float64)
        opt = DIANA([x], compressor="randk", k=5, problem=prob, seed=seed)
        V0 = opt.lyapunov()
        for it in range(1, checkpoints[-1] + 1):
            opt.step()
            if it in vals:
                vals[it].append(opt.lyapunov() / V0)
    q = rates.diana_rate(opt.lr, prob.mu)
    for c in checkpoints:
        assert np.mean(vals[c]) <= q ** c, (c, np.mean(vals[c]), q ** c)
    assert np.mean(vals[checkpoints[-1]]) < 1e-2                      # and it did move


class _Quadratic:
    """f_i(x) = ||x - b_i||^2 / 2: L_i = L = mu = 1 (kappa = 1), x* = mean b_i, grad f_i(x*) = x* - b_i != 0."""

    def __init__(self, n: int, d: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.B = torch.randn(n, d, generator=g, dtype=torch.float64)
        self.n, self.d = n, d
        self.L = self.L_max = self.mu = 1.0
        self.x_star = self.B.mean(0)
        self.grads_star = self.x_star - self.B

    def grads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0) - self.B


def test_diana_default_step_is_the_papers_closed_form():
    """The optimizer's default step against the conditions of arXiv 2206.07021 Thm 2.2 worked by hand:
    alpha = 1/(omega + 1), gamma = min{1/((1 + 6 omega/n) L_max), alpha/(2 mu)}; omega = 9 (rand-1 of 10)."""
    x = torch.zeros(10, dtype=torch.float64)
    # n = 10, L_max = 2, mu = 0.01: 1/(2 * 6.4) = 0.078125 (the cap 0.1/0.02 = 5 is slack)
    a = DIANA([x], n_workers=10, compressor="randk", k=1, constants={"L_max": 2.0, "mu": 0.01})
    assert (a.lr, a.alpha) == (pytest.approx(0.078125, rel=1e-14), pytest.approx(0.1, rel=1e-14))
    # mu = 1: the cap alpha/(2 mu) = 0.05 binds
    b = DIANA([x], n_workers=10, compressor="randk", k=1, constants={"L_max": 2.0, "mu": 1.0})
    assert b.lr == pytest.approx(0.05, rel=1e-14)
    # shared seeds (n_eff = 1): 1/(2 * (1 + 54)) = 1/110
    c = DIANA([x], n_workers=10, compressor="randk", k=1, constants={"L_max": 2.0, "mu": 0.01}, independent=False)
    assert c.lr == pytest.approx(1 / 110, rel=1e-14)
    # without mu: the non-convex "Th.4" step 1/(10 L sqrt(1 + omega/n)(omega + 2)) = 1/(20 sqrt(1.9) 11)
    d_ = DIANA([x], n_workers=10, compressor="randk", k=1, constants={"L_max": 2.0})
    assert d_.lr == pytest.approx(1 / (220 * math.sqrt(1.9)), rel=1e-13)


def _mean_lyapunov_ratios(prob, lr, checkpoints, seeds, independent=True):
    vals = {c: [] for c in checkpoints}
    for seed in range(seeds):
        x = torch.zeros(prob.d, dtype=torch.float64)
        opt = DIANA([x], compressor="randk", k=1, problem=prob, seed=seed, independent=independent)
        if lr is not None:
            opt.param_groups[0]["lr"] = lr
        V0 = opt.lyapunov()
        for it in range(1, checkpoints[-1] + 1):
            opt.step()
            if it in vals:
                vals[it].append(opt.lyapunov() / V0)
    return opt.lr, {c: float(np.mean(v)) for c, v in vals.items()}


def test_diana_lyapunov_bound_holds_at_the_default_step_and_fails_above_it():
    """E V^k <= (1 - gamma mu)^k V^0 at the library's default step, on a problem where the bound is close
    to tight, and violated by 3x that step and by the step without the alpha/(2 mu) cap.

    Why it can fail (**derived**): with rand-k (variance exactly omega||v||^2) and alpha = 1/(omega+1), at
    x = x* each shift obeys E||h_i+ - h_i*||^2 = ((1 - alpha)^2 + alpha^2 omega)||h_i - h_i*||^2
    = (1 - alpha)||h_i - h_i*||^2: the shifts, hence V, cannot contract faster than 1 - alpha per step. On a
    kappa = 1 problem with n = 10 > 6 workers, 1/((1 + 6 omega/n) L) > alpha/mu, so only the cap
    alpha/(2 mu) keeps the promised 1 - gamma mu above 1 - alpha; 3x the capped step promises 1 - 1.5 alpha.
    """
    prob = _Quadratic(n=10, d=10)
    cps = (10, 25, 50)
    lr, v = _mean_lyapunov_ratios(prob, None, cps, seeds=4)
    assert lr == pytest.approx(0.05, rel=1e-14)                       # the cap binds: alpha/(2 mu)
    for c in cps:
        assert v[c] <= (1 - lr * prob.mu) ** c, (c, v[c], (1 - lr) ** c)
    assert v[cps[-1]] < 0.5 * (1 - lr) ** cps[-1]                     # and it did contract
    # the same check at steps the theorem does not certify fails by a wide margin
    for bad in (3 * lr, 1 / (1 + 6 * 9 / 10)):
        _, w = _mean_lyapunov_ratios(prob, bad, (cps[-1],), seeds=2)
        assert w[cps[-1]] > 10 * (1 - bad * prob.mu) ** cps[-1], (bad, w)


def test_diana_lyapunov_uses_n_eff_with_shared_seeds():
    """With shared seeds the averaged message's variance is omega (not omega/n), so the shifts' weight in
    V is 4 omega gamma^2/(alpha n n_eff) with n_eff = 1, and V contracts at the default (n_eff) step."""
    prob = _Quadratic(n=10, d=10, seed=1)
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = DIANA([x], compressor="randk", k=1, problem=prob, independent=False, seed=2)
    assert opt.n_eff == 1 and opt.lr == pytest.approx(1 / 55, rel=1e-14)  # min{1/(1 + 54), 0.05}
    for _ in range(3):
        opt.step()
    h = opt.shifts()
    want = float(((x - prob.x_star) ** 2).sum()) + 4 * 9 * opt.lr ** 2 / (0.1 * 10 * 1) * float(
        ((h - prob.grads_star) ** 2).sum())
    assert opt.lyapunov() == pytest.approx(want, rel=1e-12)
    lr, v = _mean_lyapunov_ratios(prob, None, (20, 60), seeds=3, independent=False)
    for c, val in v.items():
        assert val <= (1 - lr) ** c, (c, val, (1 - lr) ** c)


# -------------------------------------------------------------- exact reductions to GD
@pytest.mark.parametrize("cls,kw", [(DCGD, {}), (DIANA, {}), (EF21, {}), (MARINA, {})])
def test_identity_compressor_is_gradient_descent(cls, kw, hetero):
    """With C = I (omega = 0, delta = 1) every method is gradient descent: same iterates in float64."""
    prob = hetero
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = cls([x], compressor="identity", problem=prob, **kw)
    lr = opt.lr
    expected = {DCGD: 1 / prob.L, DIANA: min(1 / prob.L_max, 1 / (2 * prob.mu)), EF21: 1 / prob.L,
                MARINA: 1 / prob.L}[cls]
    assert lr == pytest.approx(expected)
    z = torch.zeros(prob.d, dtype=torch.float64)
    for _ in range(30):
        opt.step()
        z = z - lr * prob.grad(z)
    torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-14)


def test_step_with_closure_and_bad_input(hetero):
    prob = hetero
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = DIANA([x], n_workers=prob.n, compressor="randk", k=5, constants=prob, seed=0)
    y = torch.zeros(prob.d, dtype=torch.float64)
    ref = DIANA([y], compressor="randk", k=5, problem=prob, seed=0)
    for _ in range(5):
        G = opt.step(lambda: prob.grads(x))
        ref.step()
        assert G.shape == (prob.n, prob.d)
    torch.testing.assert_close(x, y, rtol=0, atol=0)                 # closure == problem oracle
    with pytest.raises(MismatchError, match=r"\(20, 50\)"):
        opt.step(lambda: prob.grads(x)[:3])
    with pytest.raises(SparseCommError, match="lr="):
        EF([x], n_workers=prob.n, compressor="topk", k=1)            # EF has no theoretical step
    with pytest.raises(SparseCommError, match="L_max"):
        DIANA([x], n_workers=4, compressor="randk", k=5)               # no constants, no lr
    with pytest.raises(SparseCommError, match="unbiased|U\\(omega\\)"):
        DIANA([x], compressor="topk", k=5, problem=prob)
    with pytest.raises(SparseCommError, match="closure"):
        DIANA([x], n_workers=prob.n, compressor="randk", k=5, lr=0.1).step()


def test_shared_seeds_lose_the_one_over_n(hetero):
    """omega/n in the theory needs independent compressors; with shared seeds the default uses n = 1."""
    prob = hetero
    x = torch.zeros(prob.d, dtype=torch.float64)
    ind = DIANA([x], compressor="randk", k=5, problem=prob)
    shared = DIANA([x.clone()], compressor="randk", k=5, problem=prob, independent=False)
    assert ind.lr == pytest.approx(rates.diana(prob.L_max, 9.0, 20, prob.mu)[0])
    assert shared.lr == pytest.approx(rates.diana(prob.L_max, 9.0, 1, prob.mu)[0])
    shared.step()
    idx = [p.indices for p in shared.last_payloads]
    assert all(torch.equal(i, idx[0]) for i in idx)                   # same coordinates everywhere
    ind.step()
    assert not all(torch.equal(p.indices, ind.last_payloads[0].indices) for p in ind.last_payloads)


# --------------------------------------------------------------------- EF21 / EF / MARINA
def test_ef21_theoretical_step_decreases_gradient_norm_and_beats_ef_in_bits():
    """E2 in miniature: top-1, logistic + non-convex regulariser, EF21 at its theoretical step:
    ||grad f||^2 falls by 100x; the Thm-1 bound (1/T) sum ||grad f(x^t)||^2 <= 2(f(x^0) - f_inf)/(gamma T) holds
    with f_inf >= 0 (G^0 = 0 by the exact first round)."""
    prob = P.logistic("wine", n_workers=10, split="label", lam=0.0, nc_lam=0.1)
    x = torch.full((prob.d,), 0.5, dtype=torch.float64)
    f0 = prob.loss(x)
    opt = EF21([x], compressor="topk", k=1, problem=prob)
    assert opt.lr == pytest.approx(rates.ef21(prob.L, prob.L_tilde, 1 / prob.d))
    g0 = prob.grad_norm_sq(x)
    T, acc = 750, 0.0                  # (measured: below g0 / 100 from step 523 on, g0 / 175 at step 750)
    for _ in range(T):
        acc += prob.grad_norm_sq(x)
        opt.step()
    assert prob.grad_norm_sq(x) < g0 / 100
    assert acc / T <= 2 * f0 / (opt.lr * T)
    assert opt.bits_sent == prob.n * (64 * prob.d + (T - 1) * opt.compressor.bits(prob.d, torch.float64))


def test_marina_full_rounds_and_convergence():
    prob = P.logistic("wine", n_workers=5, split="iid", lam=0.0, nc_lam=0.1)
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = MARINA([x], compressor="randk", k=1, problem=prob, seed=3)
    omega = prob.d - 1.0
    assert opt.p == pytest.approx(1 / (omega + 1))
    assert opt.lr == pytest.approx(rates.marina(prob.L, prob.L_tilde, omega, prob.n)[0])
    g0 = prob.grad_norm_sq(x)
    K = 750                            # (measured: below g0 / 1e3 from step 373 on)
    for _ in range(K):
        opt.step()
    assert prob.grad_norm_sq(x) < g0 / 1e3
    # the number of uncompressed rounds is 1 + Binomial(K - 1, p): within 5 standard deviations
    mean, sd = 1 + (K - 1) * opt.p, math.sqrt((K - 1) * opt.p * (1 - opt.p))
    assert abs(opt.full_rounds - mean) <= 5 * sd
    assert opt.bits_sent == prob.n * 64 * (prob.d * opt.full_rounds + (K - opt.full_rounds))


# -------------------------------------------------------------- independent block sparsifier
def test_independent_block_sparsifier_is_unbiased_with_declared_omega():
    m, tau, d, trials = 6, 2, 20, 20000
    c = IndependentBlockSparsifier(m, tau)
    assert c.omega(d) == m / tau - 1
    x = torch.linspace(-1.0, 2.0, d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    acc = torch.zeros(d, dtype=torch.float64)
    sq = 0.0
    for _ in range(trials):
        y = c.decompress(c.compress(x, gen))
        acc += y
        sq += float((y ** 2).sum())
    # every coordinate is kept with probability tau/m (scaled by m/tau): mean within 5 sigma of x
    sd = x.abs() * math.sqrt((m / tau - 1) / trials)
    assert bool(((acc / trials - x).abs() <= 5 * sd + 1e-12).all())
    # E||C(x)||^2 = (m/tau)||x||^2 exactly in expectation; ||C(x)||^2 takes C(6,2) = 15 values
    expect = (m / tau) * float((x ** 2).sum())
    assert sq / trials == pytest.approx(expect, rel=0.03)
    with pytest.raises(ValueError):
        IndependentBlockSparsifier(4, 5)


def test_is_variants_build_their_compressor(hetero):
    prob = hetero
    x = torch.zeros(prob.d, dtype=torch.float64)
    a = ISSGD([x], tau=5, problem=prob)
    assert a.compressor.name == "randk" and a.omega() == 9.0
    assert not a.interpolation                                           # heterogeneous: DCGD's step
    assert a.lr == pytest.approx(rates.dcgd(prob.L_max, 9.0, prob.n, L=prob.L))
    b = ISDIANA([x], tau=2, m=10, problem=prob)
    assert isinstance(b.compressor, IndependentBlockSparsifier) and b.omega() == 4.0
    assert b.lr == pytest.approx(rates.diana(prob.L_max, 4.0, prob.n, prob.mu)[0])
    assert "randk" in sc.compressors.available()


def test_is_sgd_default_step_is_certified_outside_interpolation(hetero):
    """IS-SGD's 1/(L + omega L_max/n) is derived for grad f_i(x*) = 0 only: on heterogeneous data the default
    is DCGD's certified 1/(L + 2 omega L_max/n) (with its floor), insisting on interpolation raises, and an
    interpolating problem gets the larger step. Worked numbers: L = L_max = 1, omega = 9 (tau = 5 of 50), n = 20."""
    prob = hetero
    x = torch.zeros(prob.d, dtype=torch.float64)
    with pytest.raises(ConfigError, match="sigma\\*\\^2.*ISDIANA"):
        ISSGD([x], tau=5, problem=prob, interpolation=True)
    # constants only (the regime cannot be checked): the certified step 1/(1 + 2*9/20) = 1/1.9
    c = ISSGD([x], tau=5, n_workers=20, constants={"L": 1.0, "L_max": 1.0})
    assert not c.interpolation and c.lr == pytest.approx(1 / 1.9, rel=1e-14)
    # asked for explicitly on a problem that cannot tell: the interpolation step 1/(1 + 9/20) = 1/1.45
    e = ISSGD([x], tau=5, n_workers=20, constants={"L": 1.0, "L_max": 1.0}, interpolation=True)
    assert e.interpolation and e.lr == pytest.approx(1 / 1.45, rel=1e-14)
    f = ISSGD([x], tau=5, problem=prob, interpolation=False)
    assert not f.interpolation and f.lr == pytest.approx(rates.dcgd(prob.L_max, 9.0, prob.n, L=prob.L))
    # an interpolating problem (sigma*^2 ~ 1e-31): the interpolation step, chosen automatically
    interp = P.synthetic_least_squares(n_workers=10, rows_per_worker=40, d=40, kappa=10.0, homogeneous=True)
    y = torch.zeros(interp.d, dtype=torch.float64)
    g = ISSGD([y], tau=4, problem=interp)
    assert g.interpolation and g.lr == pytest.approx(1 / (interp.L + 0.9 * interp.L_max), rel=1e-12)
    with pytest.raises(ConfigError, match="None, True or False"):
        ISSGD([y], tau=4, problem=interp, interpolation="yes")


@pytest.mark.parametrize("name", ["DIANA", "MARINA", "VRDIANA"])
def test_state_dict_round_trip_continues_exactly(name, hetero):
    from algorithms import VRDIANA

    prob = hetero

    def build(x):
        if name == "DIANA":
            return DIANA([x], compressor="randk", k=3, problem=prob, seed=7)
        if name == "MARINA":
            return MARINA([x], compressor="randk", k=3, problem=prob, seed=7, p=0.3)
        return VRDIANA([x], problem=prob, batch_size=2, compressor="randk", k=3, seed=7, p=0.3)

    x = torch.zeros(prob.d, dtype=torch.float64)
    a = build(x)
    for _ in range(7):
        a.step()
    sd = a.state_dict()
    x_saved = x.clone()
    for _ in range(7):
        a.step()
    y = x_saved.clone()
    b = build(y)
    b.load_state_dict(sd)
    for _ in range(7):
        b.step()
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert (b.bits_sent, b.rounds) == (a.bits_sent, a.rounds)
