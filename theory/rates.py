"""Theoretical step sizes and predicted iteration counts of the DIANA family, EF21 and MARINA.

Plain functions of the problem constants (``theory.problems``: L, L_max, L_tilde, mu) and of the
compressor constants (omega for unbiased C in U(omega), delta for contractive C in B(delta); read them
from the compressor: ``c.omega(d)``, ``c.delta(d)``). Notation: n workers,
kappa = L/mu (``kappa_max`` = L_max/mu where a theorem uses L_max).

Labels: a citation means the formula was checked against the paper or the authors'
code; **derived** means the one-line derivation is in the docstring. Nothing unverified is used here as
a theorem; where no verified constant exists (VR-DIANA's strongly convex step)
the function says so and exposes the constant as a parameter.

Iteration counts are for a relative accuracy ``eps`` (V^k / V^0 <= eps for a contraction 1 - r per
iteration: ceil(log(1/eps)/r), using -log(1-r) >= r).
"""

from __future__ import annotations

import math

from sparsecomm.errors import InvalidValueError

__all__ = [
    "L_tilde", "iterations_for", "dcgd", "dcgd_neighbourhood", "dcgd_iterations",
    "diana", "diana_rate", "diana_iterations", "diana_lyapunov_coefficient", "diana_nonconvex",
    "vr_diana", "vr_diana_iterations", "is_sgd", "is_sgd_factor", "is_sgd_iterations", "is_optimal_tau",
    "ef21_theta_beta", "ef21", "ef21_pl", "marina", "step_scale", "STEP_RULES",
]


def _check_pos(**kw: float) -> None:
    for k, v in kw.items():
        if v is None or not v > 0 or not math.isfinite(v):
            raise InvalidValueError(f"{k} must be a positive finite number, got {v!r}")


def _check_omega(omega: float, n: int) -> None:
    if not (omega >= 0 and math.isfinite(omega)):
        raise InvalidValueError(f"omega must be finite and >= 0 (an unbiased compressor), got {omega!r}")
    if int(n) != n or n < 1:
        raise InvalidValueError(f"n must be a positive integer, got {n!r}")


def L_tilde(L_i) -> float:
    """L-tilde = sqrt((1/n) sum_i L_i^2), the quadratic mean of the local smoothness constants
    (EF21, MARINA)."""
    vals = [float(v) for v in L_i]
    return math.sqrt(sum(v * v for v in vals) / len(vals))


def iterations_for(rate: float, eps: float) -> int:
    """Iterations after which (1 - rate)^k <= eps, bounded by ceil(log(1/eps)/rate)."""
    _check_pos(rate=rate, eps=eps)
    if rate >= 1:
        return 1
    return math.ceil(math.log(1.0 / eps) / -math.log1p(-rate))


# ------------------------------------------------------------------------------------------ DCGD
def dcgd(L_max: float, omega: float, n: int, L: float | None = None) -> float:
    """Step size of DCGD (compressed GD without shifts):
    gamma = 1 / (L + 2 omega L_max / n)   (L defaults to L_max, giving 1/((1 + 2 omega/n) L_max)).

    **Derived**: for independent C_i in U(omega), with g_i = grad f_i(x), g_i* = grad f_i(x*),
    E||g_hat - grad f(x*)||^2 = ||grad f(x) - grad f(x*)||^2 + (1/n^2) sum_i E||C_i(g_i) - g_i||^2
    <= 2L D_f + (omega/n^2) sum_i (2||g_i - g_i*||^2 + 2||g_i*||^2) <= 2(L + 2 omega L_max/n) D_f
    + 2 omega sigma*^2/n, using ||g_i - g_i*||^2 <= 2 L_i D_{f_i}. Expanding ||x+ - x*||^2 and
    <grad f(x), x - x*> >= D_f + (mu/2)||x - x*||^2 gives E||x+ - x*||^2 <= (1 - gamma mu)||x - x*||^2
    - 2 gamma (1 - gamma A) D_f + gamma^2 D_1 with A = L + 2 omega L_max/n and D_1 = 2 omega sigma*^2/n,
    so gamma <= 1/A contracts at 1 - gamma mu down to the floor of :func:`dcgd_neighbourhood`.
    (The same structure as Gorbunov, Hanzely, Richtarik, arXiv 1905.11261.)
    """
    _check_pos(L_max=L_max)
    _check_omega(omega, n)
    L = L_max if L is None else L
    _check_pos(L=L)
    return 1.0 / (L + 2.0 * omega * L_max / n)


def dcgd_neighbourhood(gamma: float, omega: float, n: int, mu: float, sigma_star_sq: float) -> float:
    """DCGD's floor: lim sup E||x^k - x*||^2 <= 2 gamma omega sigma*^2 / (mu n), with
    sigma*^2 = (1/n) sum_i ||grad f_i(x*)||^2 (**derived**, see :func:`dcgd`: the recursion
    r+ <= (1 - gamma mu) r + gamma^2 D_1 has fixed point gamma D_1/mu).

    Args:
        gamma: the step size.
        omega: the compressor's variance constant.
        n: workers.
        mu: strong convexity of f.
        sigma_star_sq: sigma*^2.
    """
    _check_pos(gamma=gamma, mu=mu)
    _check_omega(omega, n)
    return 2.0 * gamma * omega * sigma_star_sq / (mu * n)


def dcgd_iterations(kappa: float, omega: float, n: int, eps: float) -> int:
    """Iterations for DCGD at gamma = 1/((1 + 2 omega/n) L_max) to bring the initial term below eps:
    (1 + 2 omega/n) kappa log(1/eps) with kappa = L_max/mu (**derived**; the floor is not removed)."""
    _check_pos(kappa=kappa)
    _check_omega(omega, n)
    return iterations_for(1.0 / ((1.0 + 2.0 * omega / n) * kappa), eps)


# ----------------------------------------------------------------------------------------- DIANA
def diana(L_max: float, omega: float, n: int, mu: float | None = None) -> tuple[float, float]:
    """(gamma, alpha) of DIANA, strongly convex, full local gradients:

        alpha = 1/(omega + 1),   gamma = min{ 1/((1 + 6 omega/n) L_max),  alpha/(2 mu) }

    (the second term only when ``mu`` is given). Conditions alpha <= 1/(omega+1) and
    gamma <= min{alpha/(2mu), 1/((1+6omega/n)L_max)} of Sadiev et al., "Don't Compress Gradients in
    Random Reshuffling", arXiv 2206.07021, Thm 2.2 (DIANA-RR with M workers; plain DIANA is its
    one-epoch case); method: Mishchenko, Gorbunov, Takac, Richtarik, arXiv 1901.09269. ``omega`` is the
    **per-worker** constant of independent compressors.
    """
    _check_pos(L_max=L_max)
    _check_omega(omega, n)
    alpha = 1.0 / (omega + 1.0)
    gamma = 1.0 / ((1.0 + 6.0 * omega / n) * L_max)
    if mu is not None:
        _check_pos(mu=mu)
        gamma = min(gamma, alpha / (2.0 * mu))
    return gamma, alpha


def diana_rate(gamma: float, mu: float) -> float:
    """The guaranteed contraction of DIANA's Lyapunov function per iteration, E V^{k+1} <= (1 - gamma mu) E V^k
    (arXiv 2206.07021 Thm 2.2, full gradients), with
    V^k = ||x^k - x*||^2 + (4 omega gamma^2/(alpha n^2)) sum_i ||h_i^k - grad f_i(x*)||^2."""
    _check_pos(gamma=gamma, mu=mu)
    return 1.0 - gamma * mu


def diana_lyapunov_coefficient(omega: float, gamma: float, alpha: float, n: int,
                               n_eff: int | None = None) -> float:
    """The weight 4 omega gamma^2 / (alpha n n_eff) of sum_i ||h_i - grad f_i(x*)||^2 in DIANA's Lyapunov
    function (arXiv 2206.07021 Thm 2.2), n_eff = n for independent compressors (the
    theorem's 4 omega gamma^2/(alpha n^2)).

    ``n_eff`` is the n that divides the compression variance of the average: n for independent
    compressors, 1 when every worker uses the same random coordinates (shared seeds). **Derived** (the
    n_eff substitution only): the shifts enter the theorem through sigma^2 = (1/n) sum_i ||h_i - h_i*||^2,
    weighted M gamma^2 with M = 4 omega/(alpha n) (a reading of the unified analysis of arXiv
    1905.11261, not checked against its proof; it reproduces the verified 4 omega gamma^2/(alpha n^2)); the 1/n in
    M is the variance of the averaged message, omega/n by independence. With shared coordinates the
    compressor is one linear map for all workers and Jensen gives omega instead, so M = 4 omega/(alpha n_eff)
    and the weight of the *sum* is 4 omega gamma^2/(alpha n n_eff), with the step of :func:`diana` computed
    at the same n_eff. Checked empirically: tests/algorithms/test_algorithms.py (shared seeds, V contracts at
    1 - gamma mu).
    """
    n_eff = n if n_eff is None else n_eff
    _check_omega(omega, n)
    _check_omega(omega, n_eff)
    if n_eff > n:
        raise InvalidValueError(f"n_eff must be <= n, got n_eff={n_eff}, n={n}")
    _check_pos(gamma=gamma, alpha=alpha)
    return 4.0 * omega * gamma ** 2 / (alpha * n * n_eff)


def diana_iterations(kappa: float, omega: float, n: int, eps: float) -> int:
    """Iterations of DIANA at the step of :func:`diana` (with mu) to reach E V^k <= eps V^0:
    max{kappa (1 + 6 omega/n), 2(omega + 1)} log(1/eps), kappa = L_max/mu.

    **Derived** from the conditions of :func:`diana`: 1/(gamma mu) = max{(1 + 6omega/n) kappa, 2(omega+1)}.
    The O-form O((kappa(1 + omega/n) + omega) log 1/eps) is the one stated in the VR-DIANA abstract
    (arXiv 1904.05115).
    """
    _check_pos(kappa=kappa)
    _check_omega(omega, n)
    return iterations_for(1.0 / max(kappa * (1.0 + 6.0 * omega / n), 2.0 * (omega + 1.0)), eps)


def diana_nonconvex(L: float, omega: float, n: int, m: int = 1) -> tuple[float, float]:
    """(gamma, alpha) of DIANA / VR-DIANA for non-convex f (no strong convexity):
    alpha = 1/(1 + omega),  gamma = 1/(10 L sqrt(1 + omega/n) (m^{2/3} + omega + 1)),
    with m = 1 for full local gradients (m = local size / batch for VR-DIANA).

    Source: the authors' code ``burlachenkok/marina``, ``linear_model_with_non_convex_loss/
    experiment_vr_all.py`` (the line marked "Th.4", the non-convex theorem of VR-DIANA, arXiv
    1904.05115); the code uses L = max_i L_i. Very conservative (see experiments/reproduce_marina.py).
    """
    _check_pos(L=L)
    _check_omega(omega, n)
    if m < 1:
        raise InvalidValueError(f"m must be >= 1, got {m}")
    alpha = 1.0 / (1.0 + omega)
    return 1.0 / (10.0 * L * math.sqrt(1.0 + omega / n) * (m ** (2.0 / 3.0) + omega + 1.0)), alpha


# -------------------------------------------------------------------------------------- VR-DIANA
def vr_diana(L_sample: float, omega: float, n: int, m: int, c: float = 6.0) -> tuple[float, float, float]:
    """(gamma, alpha, p) for VR-DIANA, the L-SVRG variant (Horvath, Kovalev, Mishchenko, Richtarik,
    Stich, arXiv 1904.05115), strongly convex:

        alpha = 1/(omega + 1),   p = 1/m,   gamma = 1/(6 L_sample (1 + c omega/n)).

    ``L_sample`` is the smoothness of the individual f_ij (``problem.L_sample_max``), m the number of
    mini-batches per worker (reference-point refresh probability p = 1/m).

    **Not the paper's constant**: the strongly-convex step of arXiv 1904.05115 could not be checked
    here (no verified constant; gamma = 1/((1 + c omega/n)L) with a tunable c is the usual fallback).
    This default combines loopless SVRG's 1/(6L) (Kovalev, Horvath, Richtarik, arXiv 1901.08689) with
    DIANA's (1 + 6 omega/n) factor (:func:`diana`) and is validated only empirically, at this default step
    (tests/algorithms/test_algorithms_vr_diana.py: linear convergence to x* on a heterogeneous kappa = 2 logistic
    regression with omega = 1.5, where stochastic DIANA at the same step stalls; larger kappa or omega are
    not tested).
    """
    _check_pos(L_sample=L_sample, c=c)
    _check_omega(omega, n)
    if m < 1:
        raise InvalidValueError(f"m must be >= 1, got {m}")
    return 1.0 / (6.0 * L_sample * (1.0 + c * omega / n)), 1.0 / (omega + 1.0), 1.0 / m


def vr_diana_iterations(kappa: float, omega: float, n: int, m: int, eps: float) -> int:
    """The order of VR-DIANA's iteration complexity, (kappa (1 + omega/n) + m + omega) log(1/eps), with
    every hidden constant set to 1: O((kappa + kappa omega/n + omega + m) log 1/eps) is the abstract of
    arXiv 1904.05115 (linear convergence to x* with stochastic local gradients). An order, not a bound."""
    _check_pos(kappa=kappa)
    _check_omega(omega, n)
    return math.ceil((kappa * (1.0 + omega / n) + m + omega) * math.log(1.0 / eps))


# ----------------------------------------------------------------------------------- "99%" IS-SGD
def is_sgd_factor(m: int, tau: int, n: int) -> float:
    """1 + (m/tau - 1)/n = 1 + omega/n for independent rand-tau-of-m block sparsification scaled by m/tau
    (omega = m/tau - 1, rand-k). The slow-down of IS-SGD over uncompressed GD."""
    if not 1 <= tau <= m:
        raise InvalidValueError(f"need 1 <= tau <= m, got tau={tau}, m={m}")
    if n < 1:
        raise InvalidValueError(f"n must be >= 1, got {n}")
    return 1.0 + (m / tau - 1.0) / n


def is_sgd(L_max: float, m: int, tau: int, n: int, L: float | None = None) -> float:
    """Step size of IS-SGD ("99%" paper: Mishchenko, Hanzely, Richtarik, arXiv 1901.09437), each worker
    sending an independent random tau of m blocks scaled by m/tau, when grad f_i(x*) = 0 for all i
    (interpolation): gamma = 1/(L + (m/tau - 1) L_max/n), = 1/(L_max (1 + (m/tau - 1)/n)) for L = L_max.

    **Derived** (as :func:`dcgd` with g_i* = 0): E||g_hat||^2 = ||grad f||^2 + (omega/n^2) sum_i ||g_i||^2
    <= 2(L + omega L_max/n) D_f(x, x*), so gamma <= 1/(L + omega L_max/n) contracts at 1 - gamma mu.
    Without interpolation (and without shifts) DCGD's floor remains (:func:`dcgd_neighbourhood`).
    """
    _check_pos(L_max=L_max)
    L = L_max if L is None else L
    _check_pos(L=L)
    return 1.0 / (L + (is_sgd_factor(m, tau, n) - 1.0) * L_max)


def is_sgd_iterations(kappa: float, m: int, tau: int, n: int, eps: float) -> int:
    """The "99%" prediction: kappa (1 + (m/tau - 1)/n) log(1/eps) iterations (kappa = L_max/mu), flat (within
    a factor 2) for tau >= m/(n+1) ~ m/n and growing like m/(n tau) below (**derived**)."""
    _check_pos(kappa=kappa)
    return iterations_for(1.0 / (kappa * is_sgd_factor(m, tau, n)), eps)


def is_optimal_tau(m: int, n: int) -> float:
    """tau = m/n: the number of blocks per worker below which the iteration count starts to grow
    ("the optimal number of blocks to be updated by each of n units in every iteration is equal to
    m/n", arXiv 1901.09437 v1 abstract). Exactly, 1 + omega/n = 2 at tau = m/(n + 1)."""
    if m < 1 or n < 1:
        raise InvalidValueError("m and n must be >= 1")
    return m / n


# ------------------------------------------------------------------------------------------ EF21
def ef21_theta_beta(delta: float) -> tuple[float, float]:
    """(theta, beta) of EF21 for C in B(delta): theta = 1 - sqrt(1 - delta), beta = (1 - delta)/(1 - sqrt(1 - delta)).
    Source: ``IgorSokoloff/ef21_experiments_source_code``, ``Logistic regression/.ipynb_checkpoints/
    bdfg_distributed_stable-checkpoint.py`` (t = sqrt(1/(1-delta)) - 1, theta = 1 - (1-delta)(1+t),
    beta = (1-delta)(1+1/t); gamma = 1/(L_0 + L_tilde sqrt(beta/theta)) with L_0 the smoothness of the whole f)
    for Richtarik, Sokolov, Fatkhullin, arXiv 2106.05203.
    Note sqrt(beta/theta) = sqrt(1-delta)/(1-sqrt(1-delta)) = (sqrt(1-delta) + 1 - delta)/delta <= 2/delta - 1
    (**derived**)."""
    if not 0.0 < delta <= 1.0:
        raise InvalidValueError(f"delta must be in (0, 1], got {delta!r}")
    s = math.sqrt(1.0 - delta)
    theta = 1.0 - s
    beta = (1.0 - delta) / theta
    return theta, beta


def ef21(L: float, L_tilde: float, delta: float) -> float:
    """EF21's non-convex step size gamma = 1/(L + L_tilde sqrt(beta/theta)) (arXiv 2106.05203; constants
    from the authors' code). delta = 1 (no compression) gives 1/L."""
    _check_pos(L=L, L_tilde=L_tilde)
    theta, beta = ef21_theta_beta(delta)
    return 1.0 / (L + L_tilde * math.sqrt(beta / theta))


def ef21_pl(L: float, L_tilde: float, delta: float, mu: float) -> float:
    """EF21 under the PL condition ("EF21+" setting of the authors' code):
    gamma = min{1/(L + L_tilde sqrt(2 beta/theta)), theta/(2 mu)}.

    Args:
        L: smoothness of f.
        L_tilde: the quadratic mean of the L_i (:func:`L_tilde`).
        delta: the compressor's contraction constant (theta, beta: :func:`ef21_theta_beta`).
        mu: the PL constant.
    """
    _check_pos(L=L, L_tilde=L_tilde, mu=mu)
    theta, beta = ef21_theta_beta(delta)
    return min(1.0 / (L + L_tilde * math.sqrt(2.0 * beta / theta)), theta / (2.0 * mu))


# ---------------------------------------------------------------------------------------- MARINA
def marina(L: float, L_tilde: float, omega: float, n: int, p: float | None = None) -> tuple[float, float]:
    """(gamma, p) of MARINA (Gorbunov, Burlachenko, Li, Richtarik, ICML 2021, arXiv 2102.07845), non-convex:

        p = 1/(omega + 1) by default,   gamma = 1/(L + L_tilde sqrt((1 - p) omega/(p n))).

    With p = 1/(omega+1), (1-p)/p = omega, so gamma = 1/(L + L_tilde omega/sqrt(n)), the authors' setting
    1/(L(1 + omega/sqrt(n))) of ``burlachenkok/marina`` when L = L_tilde. The general form is MiniFL's
    ``get_theoretical_step_size_ab`` with A = omega/n, B = 0 (which puts the mean of the L_i, >= L, in the
    first slot). **Derived** reason for L (of f) there: it enters only through the descent lemma on f,
    f(x+) <= f(x) - (gamma/2)||grad f||^2 - (1/(2gamma) - L/2)||x+ - x||^2 + (gamma/2)||g - grad f||^2, while the
    estimator's error obeys E||g+ - grad f(x+)||^2 <= (1-p)||g - grad f(x)||^2 + (1-p)(omega/n) L_tilde^2 ||x+ - x||^2;
    the Lyapunov argument needs 1/gamma - L - gamma (1-p) omega L_tilde^2/(p n) >= 0, which this gamma satisfies.
    """
    _check_pos(L=L, L_tilde=L_tilde)
    _check_omega(omega, n)
    if p is None:
        p = 1.0 / (omega + 1.0)
    if not 0.0 < p <= 1.0:
        raise InvalidValueError(f"p must be in (0, 1], got {p!r}")
    return 1.0 / (L + L_tilde * math.sqrt((1.0 - p) * omega / (p * n))), p


# ------------------------------------------------------------------------- relative to uncompressed GD
#: the rules :func:`step_scale` knows: the theorems' worst case (the default) and the i.i.d.-data rule
STEP_RULES = ("worst-case", "iid")


def step_scale(method: str, *, omega: float | None = None, delta: float | None = None,
               n: int = 1, rule: str = "worst-case") -> float | None:
    """gamma L: the step size theory allows ``method`` as a fraction of uncompressed gradient descent's
    1/L, for f_i of equal smoothness (L_max = L_tilde = L), so that a learning rate tuned without
    compression scales by it.

    ``rule="worst-case"`` (the default): the theorems' steps, which hold for any data split, however
    different the workers' gradients (heterogeneous data):

        "diana": 1/(1 + 6 omega/n)            (:func:`diana`; Sadiev et al., arXiv 2206.07021, Thm 2.2)
        "dcgd":  1/(1 + 2 omega/n)            (:func:`dcgd`, derived; the method "none" around C in U(omega))
        "ef21":  1/(1 + sqrt(beta/theta))     (:func:`ef21`; arXiv 2106.05203, the authors' constants)

    ``rule="iid"``: the practical rule for data-parallel training, where every worker's gradient
    estimates the same full gradient g (i.i.d. shards): "diana" and "dcgd": 1/(1 + omega/n). **Derived**:
    n independent C in U(omega) of the same g average to an estimate with E||.||^2 = (1 + omega/n)||g||^2,
    and the descent lemma f(x - gamma ghat) <= f(x) - gamma ||g||^2 + (L gamma^2/2)(1 + omega/n)||g||^2
    has its largest guaranteed decrease at gamma L = 1/(1 + omega/n) (DIANA's shifts only remove
    variance). It is up to 2x (DCGD) and 6x (DIANA) larger than the worst case when omega/n is large; it is no
    guarantee on heterogeneous data. "ef21" has no such rule (its worst-case step is returned).

    ``omega``: the per-worker variance constant of an unbiased compressor, ``delta``: the contraction
    of a contractive one; ``n``: the workers over which the compression errors average out (the number
    of workers for independent compressors, 1 when every worker uses the same random coordinates:
    :func:`diana_lyapunov_coefficient`'s n_eff). ``None`` for a method this module holds no bound of this
    form for (error feedback "ef", PowerSGD, DGC, the sign methods)."""
    if rule not in STEP_RULES:
        raise InvalidValueError(f"step_scale: rule must be one of {STEP_RULES}, got {rule!r}")
    if method in ("diana", "dcgd") and rule == "iid":
        _check_omega(omega, n)
        return 1.0 / (1.0 + omega / n)
    if method == "diana":
        return diana(1.0, omega, n)[0]
    if method == "dcgd":
        return dcgd(1.0, omega, n)
    if method == "ef21":
        return ef21(1.0, 1.0, delta)
    return None
