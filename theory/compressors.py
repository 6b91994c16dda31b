"""Closed-form constants of the compression operators (the single source; operators read them here).

Classes: ``C`` is in **U(omega)** when ``E C(x) = x`` and
``E||C(x) - x||^2 <= omega ||x||^2``; it is in **B(delta)** (contractive) when
``E||C(x) - x||^2 <= (1 - delta) ||x||^2`` with ``0 < delta <= 1``.

Every function is plain Python on integers/floats. Each docstring gives the formula, where it comes
from (paper, or "derived" with the one-line derivation), and whether the bound is tight. Constants that
the literature states without proof or inconsistently were re-derived here; see
``natural_dithering_omega`` and ``qsgd_code_bits`` for the two places where a published value was
refined.

Wire encodings (the ``bits`` functions; ``value_bits`` is the width of one float value on the wire,
``scale_bits`` of one per-bucket norm/scale):

- float values: their dtype width (16, 32 or 64 bits);
- indices of a worker-specific sparse payload: ``index_bits`` -- ``k`` fixed-width (32-bit for
  ``d <= 2**31``) indices or a ``d``-bit bitmap, whichever is smaller;
- indices of an ``aligned`` payload (shared-seed rand-k): free, regenerated from the seed;
- QSGD / natural-dithering codes: sign bit + level index, ``1 + ceil(log2(s + 1))`` bits;
- TernGrad codes: 2 bits (``{-1, 0, 1}``); scaled sign: 1 bit;
- natural compression: sign + exponent, 9 bits per float32 entry (Horvath et al.).
"""

from __future__ import annotations

import math
from sparsecomm.errors import InvalidValueError

__all__ = [
    "identity_omega",
    "randk_omega",
    "qsgd_omega",
    "natural_omega",
    "natural_dithering_omega",
    "terngrad_omega",
    "compose_omega",
    "induced_omega",
    "topk_delta",
    "sign_delta",
    "sign_error_ratio",
    "rounding_delta",
    "scaled_delta",
    "threshold_abs_error",
    "n_buckets",
    "index_width",
    "index_bits",
    "dense_bits",
    "randk_bits",
    "sparse_bits",
    "topk_bits",
    "quantized_bits",
    "qsgd_code_bits",
    "qsgd_bits",
    "natural_bits",
    "natural_dithering_bits",
    "terngrad_bits",
    "sign_bits",
    "powersgd_matrix",
    "powersgd_compresses",
    "powersgd_bits",
    "lowrank_delta",
    "majority_vote_error",
    "sign_vote_bits",
    "onebit_bits",
    "onebit_delta",
    "dgc_keep",
    "dgc_sample_size",
    "DGC_MOMENTUM",
    "DGC_SAMPLE_RATIO",
    "DGC_RATIO",
]


# --------------------------------------------------------------------------------------- omega (U)
def identity_omega() -> float:
    """Identity: omega = 0 (no error)."""
    return 0.0


def randk_omega(d: int, k: int) -> float:
    """Rand-k scaled by d/k (k coordinates uniformly without replacement): omega = d/k - 1.

    Derived: each coordinate is kept with probability k/d and scaled by d/k, so
    E||C(x)||^2 = (d/k)^2 (k/d) ||x||^2 = (d/k) ||x||^2. The bound holds with **equality for every x**
    (E||C(x) - x||^2 = (d/k - 1)||x||^2). Stated e.g. in Stich et al., "Sparsified SGD with memory"
    (NeurIPS 2018) and Mishchenko et al., DIANA (arXiv 1901.09269). ``d = 0`` gives 0.
    """
    if d <= 0:
        return 0.0
    if not 1 <= k <= d:
        raise InvalidValueError(f"rand-k needs 1 <= k <= d, got k={k}, d={d}")
    return d / k - 1.0


def qsgd_omega(d: int, s: int) -> float:
    """QSGD, l2 norm, s levels (Alistarh et al., NeurIPS 2017, Lemma 3.1): omega = min(d/s^2, sqrt(d)/s).

    For bucketed QSGD pass the largest bucket length as ``d`` (the bound is increasing in d and sums
    over buckets). Derived check: coordinate i is rounded between adjacent levels with variance
    (||x||/s)^2 p_i (1 - p_i), p_i(1-p_i) <= min(1/4, s|x_i|/||x||), and ||x||_1 <= sqrt(d)||x||, so
    E||C(x)-x||^2 <= min(d/(4 s^2), sqrt(d)/s) ||x||^2 -- Alistarh's min(d/s^2, sqrt(d)/s) is valid
    (not tight; for s = 1 the exact worst case is sqrt(d) - 1 at x = 1).
    """
    if d <= 0:
        return 0.0
    if s < 1:
        raise InvalidValueError(f"QSGD needs s >= 1 levels, got {s}")
    return min(d / s**2, math.sqrt(d) / s)


def natural_omega() -> float:
    """Natural compression C_nat (Horvath et al., "Natural compression for distributed deep learning",
    MSML 2022, arXiv 1905.10988, Thm 3): omega = 1/8.

    Derived: for t in [1, 2] (a value scaled to its binade) rounding to 1 or 2 unbiasedly has relative
    variance (t - 1)(2 - t)/t^2, maximised at t = 4/3 with value 1/8 -- **tight** at x = 4/3.
    """
    return 0.125


def natural_dithering_omega(d: int, s: int, p: float = 2.0) -> float:
    """Natural dithering with s levels {2^(1-s), ..., 1/2, 1} and the l_p norm (Horvath et al., NC paper,
    Thm 7): omega = 1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s)),  r = min(p, 2).

    Re-derived for the p in {2, inf} that the operator supports (r = 2): with y_i = |x_i|/||x||_p,
    a coordinate between two levels 2^-j-1 <= y <= 2^-j contributes at most y^2/8 (as C_nat), one
    below the lowest level 2^(1-s) contributes y(2^(1-s) - y) <= min(y 2^(1-s), 4^(-s)); summing,
    with ||x||_p <= ||x||_2 and ||x||_1 <= sqrt(d)||x||_2, gives the formula (the second min branch
    is loose by a factor 4). For bucketed use pass the largest bucket length as ``d``.
    """
    if d <= 0:
        return 0.0
    if s < 1:
        raise InvalidValueError(f"natural dithering needs s >= 1 levels, got {s}")
    if not (p >= 2):
        raise InvalidValueError("natural_dithering_omega is derived here for p >= 2 (p = 2 or inf)")
    r = min(p, 2.0)
    a = d ** (1.0 / r) * 2.0 ** (1 - s)
    return 0.125 + a * min(1.0, a)


def terngrad_omega(d: int) -> float:
    """TernGrad (Wen et al., NeurIPS 2017; = DIANA's Quant_inf): omega = (sqrt(d) - 1)/2.

    Derived: E||C(x)||^2 = ||x||_inf ||x||_1, so omega = max_x ||x||_inf||x||_1/||x||^2 - 1. With
    x = (1, t, ..., t) the ratio (1 + (d-1)t)/(1 + (d-1)t^2) is maximised where (d-1)t^2 + 2t - 1 = 0,
    i.e. t = 1/(sqrt(d)+1), with value (sqrt(d)+1)/2 -- **tight** at that x. Bucketed: pass the
    largest bucket length.
    """
    if d <= 0:
        return 0.0
    return (math.sqrt(d) - 1.0) / 2.0


def compose_omega(w1: float, w2: float) -> float:
    """Composition of independent unbiased compressors (NC paper, Thm 5): omega = (w1+1)(w2+1) - 1.

    E||C2(C1 x)||^2 <= (w2+1) E||C1 x||^2 <= (w2+1)(w1+1)||x||^2. The order does not matter.
    """
    return (w1 + 1.0) * (w2 + 1.0) - 1.0


def induced_omega(w2: float, delta1: float) -> float:
    """Induced compressor C(x) = C1(x) + C2(x - C1(x)), C1 in B(delta1) deterministic, C2 in U(w2)
    (Horvath & Richtarik, "A better alternative to error feedback", arXiv 2006.11077):
    omega = w2 (1 - delta1), and C is unbiased.

    Derived: C(x) - x = C2(y) - y with y = x - C1 x, and ||y||^2 <= (1 - delta1)||x||^2.
    """
    return w2 * (1.0 - delta1)


# --------------------------------------------------------------------------------------- delta (B)
def topk_delta(d: int, k: int) -> float:
    """Top-k (largest magnitudes): delta = k/d, **tight** at x = 1 (e.g. Stich et al. 2018, EF21).

    Derived: the d - k dropped squares are the smallest, so their sum is <= (1 - k/d)||x||^2.
    ``d = 0`` gives 1 (nothing is lost).
    """
    if d <= 0:
        return 1.0
    return min(k, d) / d


def sign_error_ratio(l1: float, l2sq: float, d: int) -> float:
    """Exact relative error of scaled sign: ||C(x) - x||^2/||x||^2 = 1 - ||x||_1^2/(d ||x||_2^2).

    Derived (codes c_i = +-1 with c_i x_i = |x_i|): ||a c - x||^2 = d a^2 - 2a||x||_1 + ||x||^2 with
    a = ||x||_1/d.

    Args:
        l1: ||x||_1.
        l2sq: ||x||_2^2.
        d: the vector's length.
    """
    if l2sq == 0:
        return 0.0
    return 1.0 - l1 * l1 / (d * l2sq)


def sign_delta(d: int) -> float:
    """Scaled sign (||x||_1/d) sign(x) (Karimireddy et al., "Error feedback fixes SignSGD", ICML 2019):
    delta = ||x||_1^2/(d||x||^2) >= 1/d, worst case **1/d** at a single spike (see ``sign_error_ratio``)."""
    if d <= 0:
        return 1.0
    return 1.0 / d


def rounding_delta(precision_bits: int) -> float:
    """Round-to-nearest into a float format with p significand bits (fp16: 11, bf16: 8):
    delta = 1 - (2^-p + 2^-23)^2 for inputs in the target's normal range (zeros allowed).

    Derived: |fl(x) - x| <= 2^-p |x| (unit roundoff; Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., Thm 2.2). The 2^-23 slack covers float64 inputs, which torch converts via
    float32 (double rounding: error <= 2^-p|x| + 2^-24|x|(1 + 2^-p)). Outside the normal range
    (subnormal results) only |fl(x) - x| <= |x| holds, i.e. no contraction; overflow is an error.

    Args:
        precision_bits: p, the target format's significand bits.
    """
    u = 2.0 ** (-precision_bits) + 2.0**-23
    return 1.0 - u * u


def scaled_delta(omega: float) -> float:
    """C/(omega+1) for C in U(omega) is contractive with delta = 1/(omega+1) (derived: minimise
    E||lambda C(x) - x||^2 = lambda^2 E||C||^2 - 2 lambda ||x||^2 + ||x||^2 over lambda)."""
    return 1.0 / (omega + 1.0)


def threshold_abs_error(d: int, threshold: float) -> float:
    """Hard threshold (keep |x_i| >= lambda) is an *absolute* compressor (Sahu et al., "Rethinking
    gradient sparsification as total error minimization", NeurIPS 2021): ||C(x) - x||^2 <= d lambda^2
    (every dropped entry has |x_i| < lambda). It is neither unbiased nor contractive: for
    ||x||_inf < lambda, C(x) = 0 and the relative error is 1."""
    return d * float(threshold) ** 2


# the wire encodings and the closed forms of the methods that bring their own operator, re-exported
# (operators read every constant as ``theory.compressors.<name>``)
from .bits import *  # noqa: E402,F401,F403
from .method_operators import *  # noqa: E402,F401,F403
