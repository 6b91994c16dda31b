"""Numba kernels of the fixed-point codec (SwitchML, :mod:`sparsecomm.codec.fixed`; CPU path), split
from :mod:`._kernels` (same conventions: 1-D C-contiguous numpy views, ``cache=True, nogil=True``, no
``parallel=True``). ``counter_bits`` is the library's one counter-based random stream: the compressors'
sampling kernels (:mod:`sparsecomm.compressors._kernels`) draw from it too.

====================  =================================================================
kernel                specialisations actually used
====================  =================================================================
``quantize``          (float32 | float64) x (int32 | int64)
``checked_add``       int32, int64
====================  =================================================================
"""

from __future__ import annotations

import numpy as np
from numba import njit

# --------------------------------------------------------------------------- fixed point

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_TWO_M53 = 2.0**-53
_QTILE = 1024


@njit(cache=True, nogil=True, inline="always")
def _mix64(z):
    """SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit hash."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True, inline="always")
def counter_bits(key, i):
    """The 64 random bits of element ``i`` of the counter-based stream ``key``: the SplitMix64
    finaliser of ``key + (i + 1) * golden``. Every random kernel of the library (stochastic rounding
    here, the compressors' sampling) draws from this one stream, so no kernel holds RNG state."""
    return _mix64(key + np.uint64(i + 1) * _GOLDEN)


@njit(cache=True, nogil=True)
def quantize(x, scale, chunk, stochastic, key, offset, lo, hi, out):
    """SwitchML fixed point (Sapio et al., NSDI'21): ``out[i] = round(x[i] * scale[i // chunk])`` as
    an integer. Returns -1, or the first index whose value is non-finite or rounds outside
    ``[lo, hi]`` (then ``out`` is partly written and must be discarded).

    The product is formed in float64. Nearest rounding is half away from zero (``std::round``, as in
    the SwitchML client): ``t = trunc(v); r = t + sign(v) * (|v - t| >= 0.5)`` (``v - t`` is exact,
    unlike ``floor(v + 0.5)``). Stochastic rounding: ``r = floor(v) + (u_i < v - floor(v))`` with
    ``u_i = mix64(key + (offset + i + 1) * golden) >> 11`` scaled to [0, 1) -- a counter-based
    SplitMix64 stream, so ``u_i`` depends only on the key and the global position ``offset + i``
    (deterministic, independent of tiling), and ``E[r] = v``.
    """
    n = x.size
    for c0 in range(0, n, chunk):
        s = scale[c0 // chunk]
        c1 = min(c0 + chunk, n)
        for t0 in range(c0, c1, _QTILE):
            t1 = min(t0 + _QTILE, c1)
            xs = x[t0:t1]
            os = out[t0:t1]
            ok = True
            for i in range(xs.size):
                v = np.float64(xs[i]) * s
                if stochastic:
                    r = np.floor(v)
                    z = counter_bits(key, offset + t0 + i)
                    u = np.float64(z >> _S11) * _TWO_M53
                    r += np.float64(u < v - r)
                else:
                    r = np.trunc(v)
                    r += np.float64(np.abs(v - r) >= 0.5) * np.sign(v)
                good = (r >= lo) & (r <= hi)  # False for NaN
                ok &= good
                os[i] = r if good else 0.0
            if not ok:
                for i in range(xs.size):
                    v = np.float64(xs[i]) * s
                    if not (np.abs(v) < np.inf):
                        return t0 + i
                    r = np.floor(v) if stochastic else np.trunc(v)
                    # the candidates around v: a value is bad iff its rounding is out of range
                    if stochastic:
                        z = counter_bits(key, offset + t0 + i)
                        u = np.float64(z >> _S11) * _TWO_M53
                        r += np.float64(u < v - r)
                    else:
                        r += np.float64(np.abs(v - r) >= 0.5) * np.sign(v)
                    if not ((r >= lo) & (r <= hi)):
                        return t0 + i
    return -1


@njit(cache=True, nogil=True)
def checked_add(acc, x, lo, hi):
    """A switch slot's integer addition (SwitchML), checked: ``acc += x`` element-wise unless some sum
    leaves ``[lo, hi]``; returns -1 or the first such index. Each tile is checked before it is
    written; on error the tiles already added are subtracted again (exactly: they did not
    overflow), so ``acc`` is left as it was.

    The sum is formed in int64 (exact for int32 operands); for int64 operands the wrapped sum ``s``
    overflowed iff ``a`` and ``b`` have the same sign and ``s`` the other one.
    """
    n = acc.size
    wide = acc.itemsize < 8
    for t0 in range(0, n, _QTILE):
        a = acc[t0 : t0 + _QTILE]
        b = x[t0 : t0 + _QTILE]
        ok = True
        if wide:
            for i in range(a.size):
                s = np.int64(a[i]) + np.int64(b[i])
                ok &= (s >= lo) & (s <= hi)
        else:
            for i in range(a.size):
                ai = np.int64(a[i])
                bi = np.int64(b[i])
                s = ai + bi
                ok &= ((ai ^ s) & (bi ^ s)) >= 0
        if not ok:
            bad = t0
            for i in range(a.size):
                ai = np.int64(a[i])
                bi = np.int64(b[i])
                s = ai + bi
                if wide:
                    if not ((s >= lo) & (s <= hi)):
                        bad = t0 + i
                        break
                elif ((ai ^ s) & (bi ^ s)) < 0:
                    bad = t0 + i
                    break
            for j in range(t0):
                acc[j] -= x[j]
            return bad
        for i in range(a.size):
            a[i] += b[i]
    return -1


@njit(cache=True, nogil=True)
def dequantize_blocks(q, blocks, scale, out):
    """``out[b k : b k + k] = q[i] / scale`` for ``b = blocks[i]`` (``k = q.shape[1]``; the last block of ``out``
    may be short: its first values): each value divided in float64 and rounded once to ``out``'s dtype, as
    ``(q.to(float64) / scale).to(dtype)``; the other blocks of ``out`` are left as they are."""
    k = q.shape[1]
    n = out.size
    for i in range(q.shape[0]):
        b0 = blocks[i] * k
        m = min(k, n - b0)
        row = q[i]
        for j in range(m):
            out[b0 + j] = np.float64(row[j]) / scale
