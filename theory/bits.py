"""Bits on the wire of the compression operators' payloads (the single source; the conventions are
listed under "Wire encodings" in :mod:`theory.compressors`, which re-exports every name here).
"""

from __future__ import annotations

import math

__all__ = ["n_buckets", "index_width", "index_bits", "dense_bits", "randk_bits", "sparse_bits",
           "topk_bits", "quantized_bits", "qsgd_code_bits", "qsgd_bits", "natural_bits",
           "natural_dithering_bits", "terngrad_bits", "sign_bits"]


def n_buckets(d: int, bucket_size: int | None) -> int:
    """Number of buckets of at most ``bucket_size`` entries (one bucket when ``None``; 0 when d = 0)."""
    if d <= 0:
        return 0
    if bucket_size is None:
        return 1
    return -(-d // bucket_size)


def index_width(d: int) -> int:
    """Bits of one fixed-width index into a length-d vector: 32 up to 2^31 entries (int32, what
    ``Payload.to_wire`` ships), else 64."""
    return 32 if d <= 2**31 else 64


def index_bits(d: int, k: int) -> int:
    """Positions of k entries among d: k fixed-width indices or a d-bit bitmap, whichever is smaller
    (MiniFL charges min{k log2 d, (d-k) log2 d, d}; we use fixed-width indices)."""
    if k <= 0 or d <= 0:
        return 0
    return min(index_width(d) * k, d)


def dense_bits(d: int, value_bits: int = 32) -> int:
    """A dense vector: d values.

    Args:
        d: the vector's length.
        value_bits: bits per value (32 for float32).
    """
    return value_bits * max(d, 0)


def randk_bits(d: int, k: int, value_bits: int = 32) -> int:
    """Shared-seed rand-k: k values; indices are regenerated from the seed.

    Args:
        d: the vector's length.
        k: the kept values.
        value_bits: bits per value (32 for float32).
    """
    return value_bits * k


def sparse_bits(d: int, k: int, value_bits: int = 32) -> int:
    """k values at worker-specific positions: k values + ``index_bits(d, k)``.

    Args:
        d: the vector's length.
        k: the kept values.
        value_bits: bits per value (32 for float32).
    """
    return value_bits * k + index_bits(d, k)


def topk_bits(d: int, k: int, value_bits: int = 32) -> int:
    """Top-k: ``sparse_bits(d, k)`` (32k + indices).

    Args:
        d: the vector's length.
        k: the kept values.
        value_bits: bits per value (32 for float32).
    """
    return sparse_bits(d, k, value_bits)


def quantized_bits(d: int, code_bits: int, buckets: int, scale_bits: int = 32) -> int:
    """Integer codes of ``code_bits`` each plus one scale per bucket.

    Args:
        d: the number of codes.
        code_bits: bits per code.
        buckets: the number of scales.
        scale_bits: bits per scale (norm).
    """
    return code_bits * max(d, 0) + scale_bits * buckets


def qsgd_code_bits(s: int) -> int:
    """Sign + level in {0..s}: 1 + ceil(log2(s+1)) bits. (flpytorch uses 1 + ceil(log2 s),
    which cannot represent level s when s is a power of two, e.g. s = 1.)"""
    return 1 + math.ceil(math.log2(s + 1))


def qsgd_bits(d: int, s: int, bucket_size: int | None = None, scale_bits: int = 32) -> int:
    """QSGD: codes of ``qsgd_code_bits(s)`` plus one norm per bucket.

    Args:
        d: the vector's length.
        s: the number of levels.
        bucket_size: entries per scale (``None``: one bucket).
        scale_bits: bits per scale (norm).
    """
    return quantized_bits(d, qsgd_code_bits(s), n_buckets(d, bucket_size), scale_bits)


def natural_bits(d: int, exponent_bits: int = 8) -> int:
    """Natural compression: sign + exponent per entry, 9 bits for float32 (NC paper).

    Args:
        d: the vector's length.
        exponent_bits: bits of the exponent (8 for float32).
    """
    return (1 + exponent_bits) * max(d, 0)


def natural_dithering_bits(d: int, s: int, bucket_size: int | None = None, scale_bits: int = 32) -> int:
    """Natural dithering: sign + level index in {0..s} per entry plus one norm per bucket.

    Args:
        d: the vector's length.
        s: the number of levels.
        bucket_size: entries per scale (``None``: one bucket).
        scale_bits: bits per scale (norm).
    """
    return quantized_bits(d, qsgd_code_bits(s), n_buckets(d, bucket_size), scale_bits)


def terngrad_bits(d: int, bucket_size: int | None = None, scale_bits: int = 32) -> int:
    """TernGrad: 2 bits per ternary code plus one max-norm per bucket.

    Args:
        d: the vector's length.
        bucket_size: entries per scale (``None``: one bucket).
        scale_bits: bits per scale (norm).
    """
    return quantized_bits(d, 2, n_buckets(d, bucket_size), scale_bits)


def sign_bits(d: int, scale_bits: int = 32) -> int:
    """Scaled sign: 1 bit per entry plus the scalar ||x||_1/d (0 bits for an empty vector).

    Args:
        d: the vector's length.
        scale_bits: bits per scale (norm).
    """
    return d + scale_bits if d > 0 else 0
