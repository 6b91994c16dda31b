"""Closed-form constants of the methods that bring their own operator (PowerSGD, DGC, the sign
methods, 1-bit SGD): their matrices and ranks, bits on the wire and bounds. The conventions (classes
U(omega) and B(delta), wire encodings) are those of :mod:`theory.compressors`, which re-exports every
name here: operators read them as ``theory.compressors.<name>``.
"""

from __future__ import annotations

import math

from sparsecomm.errors import InvalidValueError

from .bits import n_buckets, quantized_bits

__all__ = ["powersgd_matrix", "powersgd_compresses", "powersgd_bits", "lowrank_delta",
           "majority_vote_error", "sign_vote_bits", "onebit_bits", "onebit_delta", "dgc_keep",
           "dgc_sample_size", "DGC_MOMENTUM", "DGC_SAMPLE_RATIO", "DGC_RATIO"]


def powersgd_matrix(shape) -> tuple[int, int]:
    """The matrix PowerSGD compresses a tensor as: ``(shape[0], numel/shape[0])`` (a scalar: (1, 1)),
    as torch's ``powerSGD_hook`` views each gradient (Vogels, Karimireddy, Jaggi, "PowerSGD:
    Practical low-rank gradient compression for distributed optimization", NeurIPS 2019)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    n = shape[0]
    numel = math.prod(shape)
    return n, (numel // n if n else 0)


def powersgd_compresses(n: int, m: int, rank: int, min_compression_rate: float = 2.0) -> bool:
    """Whether an n x m matrix is sent as rank-r factors: ``(n + m) r * rate < n m`` with
    r = min(n, m, rank) (torch's ``_should_compress``; vectors, m = 1, never qualify for rate >= 1).

    Args:
        n: rows.
        m: columns.
        rank: r, the approximation rank.
        min_compression_rate: torch's ``min_compression_rate``.
    """
    r = min(n, m, rank)
    return r > 0 and (n + m) * r * min_compression_rate < n * m


def powersgd_bits(shapes, rank: int, min_compression_rate: float = 2.0, value_bits: int = 32) -> int:
    """Bits one worker sends per step (both rounds): P (n r) and Q (m r) for every compressed matrix,
    the whole tensor for the others (derived from the algorithm: round 1 carries the Ps and the
    uncompressed tensors, round 2 the Qs).

    Args:
        shapes: the shapes of the tensors (each as a matrix: :func:`powersgd_matrix`).
        rank: r, the approximation rank.
        min_compression_rate: torch's ``min_compression_rate``.
        value_bits: bits per value (32 for float32).
    """
    total = 0
    for s in shapes:
        n, m = powersgd_matrix(s)
        r = min(n, m, rank)
        total += (n + m) * r if powersgd_compresses(n, m, rank, min_compression_rate) else n * m
    return value_bits * total


def lowrank_delta(n: int, m: int, rank: int) -> float:
    """Best rank-r approximation of an n x m matrix (truncated SVD, Eckart-Young): it keeps the r
    largest of the min(n, m) squared singular values, so ||M - M_r||^2 <= (1 - r/min(n, m)) ||M||^2,
    **tight** when all singular values are equal (derived). PowerSGD's single power step from a warm
    start approaches M_r over steps (Vogels et al. 2019, §3) but has no worst-case contraction of its
    own (a fresh Gaussian Q may miss the top singular direction), which is why it is used with error
    feedback."""
    k = min(n, m)
    if k <= 0:
        return 1.0
    return min(rank, k) / k


def majority_vote_error(n: int, p: float) -> float:
    """Probability that the majority vote of n workers' signs is wrong when each is wrong
    independently with probability p < 1/2 (ties, possible for even n, count as wrong): the binomial
    tail P[Bin(n, p) >= n/2] (derived). The majority vote is from Bernstein, Wang, Azizzadenesheli,
    Anandkumar, "signSGD: compressed optimisation for non-convex problems", ICML 2018 (who bound the
    per-worker p under unimodal symmetric noise with Gauss's inequality) and Bernstein, Zhao,
    Azizzadenesheli, Anandkumar, "signSGD with majority vote is communication efficient and fault
    tolerant", ICLR 2019."""
    if not 0.0 <= p <= 1.0 or n < 1:
        raise InvalidValueError(f"need n >= 1 and p in [0, 1], got n={n}, p={p}")
    return float(sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(math.ceil(n / 2), n + 1)))


def sign_vote_bits(d: int) -> int:
    """signSGD / signum with majority vote: one bit per coordinate, no scale (the scale is the shared
    constant 1); the vote itself is the sign of the integer sum (Bernstein et al. 2019).

    Args:
        d: the vector's length.
    """
    return max(d, 0)


def onebit_bits(d: int, bucket_size: int | None = None, scale_bits: int = 32, levels: int = 2) -> int:
    """1-bit SGD (Seide, Fu, Droppo, Li, Yu, "1-bit stochastic gradient descent and its application
    to data-parallel distributed training of speech DNNs", Interspeech 2014): one bit per entry plus
    the ``levels`` reconstruction values of each bucket (column): two in the paper (the means of the
    non-negative and of the negative entries), one for the symmetric variant.

    Args:
        d: the vector's length.
        bucket_size: entries per scale (``None``: one bucket).
        scale_bits: bits per level.
        levels: levels per bucket (2, or 1 for the symmetric variant).
    """
    return quantized_bits(d, 1, levels * n_buckets(d, bucket_size), scale_bits)


def onebit_delta(bucket_size: int) -> float:
    """1-bit quantisation per bucket of b entries: with the symmetric level mean|x| the error is
    ||x_b||^2 - ||x_b||_1^2/b (as scaled sign), so delta = 1/b; Seide's two levels (the means of each
    sign class) minimise the error over all reconstructions constant on the sign classes, so they do
    at least as well. **Tight** for both at a single spike in a bucket (derived: x = (1, 0, ..., 0)
    puts every entry in the non-negative class, level 1/b, error 1 - 1/b).

    Args:
        bucket_size: b, entries per bucket.
    """
    return 1.0 / max(int(bucket_size), 1)


def dgc_keep(step: int, ratio: float = 0.001, warmup_steps: int = 0) -> float:
    """DGC's warm-up of the sparsity (Lin, Han, Mao, Wang, Dally, "Deep gradient compression",
    ICLR 2018, §3.4; the schedule 75%, 93.75%, 98.4375%, 99.6%, 99.9% of e.g. PaddlePaddle's
    ``DGCMomentumOptimizer``): the kept fraction is 1/4, 1/16, 1/64, 1/256 over four equal stages of
    ``warmup_steps`` steps (never below ``ratio``), then ``ratio`` (0.1% in the paper).

    Args:
        step: the step, from 0.
        ratio: the kept fraction after warm-up.
        warmup_steps: the warm-up's length in steps.
    """
    if warmup_steps <= 0 or step >= warmup_steps:
        return ratio
    stage = (4 * step) // warmup_steps
    return max(ratio, 0.25 * 4.0 ** -stage)


def dgc_sample_size(d: int, keep: float, sample_ratio: float = 0.01) -> int:
    """Entries DGC samples to estimate its threshold (§3.4: "we sample only 0.1% to 1% of the
    gradients"): ceil(sample_ratio d), raised so that the sample holds at least 2/keep entries (the
    rule of the authors' code, ``synxlin/deep-gradient-compression``), capped at d."""
    if d <= 0:
        return 0
    return min(d, max(math.ceil(sample_ratio * d), math.ceil(2.0 / keep)))


#: DGC's defaults (Lin et al. 2018): momentum 0.9, 1% sampled for the threshold, 99.9% sparsity
DGC_MOMENTUM = 0.9
DGC_SAMPLE_RATIO = 0.01
DGC_RATIO = 0.001
