"""Numba kernels of the CPU hot paths (single pass, single thread, ``nogil`` so simulated workers in
threads run them concurrently). Each has a torch counterpart in the operator's module.

Random kernels take a 64-bit ``key`` drawn from the caller's torch.Generator and use the SplitMix64
finaliser of ``key + (i + 1) * golden`` as the uniform bits of element ``i`` (Steele, Lea & Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014): a counter-based stream, so the kernel
needs no RNG state and never touches numpy's or numba's global generators.

Status codes returned by kernels: 0 ok, 1 non-finite input, 2 a value too large for the operator
(natural compression of the top binade).
"""

from __future__ import annotations

import math
import platform

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from ..codec._fixedkernels import counter_bits as _bits

_U11 = np.uint64(11)
_U12 = np.uint64(12)
_U41 = np.uint64(41)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53

OK, NONFINITE, TOO_LARGE = 0, 1, 2

#: SplitMix64's increment (the golden gamma of Steele et al.), the step of the counter-based stream:
#: ``_bits(key + lo * GAMMA, t) == _bits(key, lo + t)``, so a bucket starting at ``lo`` draws element
#: ``lo + t``'s bits from an offset key
GAMMA = np.uint64(0x9E3779B97F4A7C15)


# Hot loops are written so that LLVM vectorises them: no early exits (non-finite inputs are
# detected by OR-ing flags or accumulating v * 0.0, which is NaN iff some v is NaN or Inf), no
# data-dependent branches (random comparisons become selects), and per-bucket work runs on slices
# (a loop over a slice vectorises; one over range(lo, hi) with a runtime start does not). The uniform
# of element i is always _bits(key, i), whatever the bucketing.
_FM = {"reassoc", "contract"}  # reassociation for reductions only; NaN/Inf semantics kept


@njit(cache=True, nogil=True, inline="always")
def _u01(key, i):
    """Uniform in [0, 1) with 53 random bits."""
    return np.float64(_bits(key, i) >> _U11) * _INV53


# ------------------------------------------------------------------------------ natural compression
@njit(cache=True, nogil=True)
def natural_f32(xi, key, max_field, out):
    """C_nat on float32 bit patterns ``xi`` (int32 view): keep sign and exponent, round the significand
    1.m up to 2 with probability m (23-bit uniform integer < mantissa bits). Inputs whose exponent
    field is >= ``max_field`` could round up past the target dtype's range: status 2."""
    bad = np.int32(0)
    big = np.int32(0)
    for i in range(xi.size):
        b = xi[i]
        e = (b >> 23) & 0xFF
        bad |= np.int32(e == 0xFF)
        big |= np.int32(e >= max_field)
        u = np.int32(_bits(key, i) >> _U41)
        out[i] = (b & np.int32(-8388608)) + (np.int32(u < (b & 0x7FFFFF)) << 23)
    return NONFINITE if bad else (TOO_LARGE if big else OK)


@njit(cache=True, nogil=True)
def natural_f64(xi, key, max_field, out):
    """C_nat on float64 bit patterns (int64 view); 52-bit uniform integers."""
    bad = np.int64(0)
    big = np.int64(0)
    for i in range(xi.size):
        b = xi[i]
        e = (b >> 52) & 0x7FF
        bad |= np.int64(e == 0x7FF)
        big |= np.int64(e >= max_field)
        u = np.int64(_bits(key, i) >> _U12)
        out[i] = (b & np.int64(-4503599627370496)) + (np.int64(u < (b & np.int64(0xFFFFFFFFFFFFF))) << 52)
    return NONFINITE if bad else (TOO_LARGE if big else OK)


# ----------------------------------------------------------------------------------- bucket norms
@njit(cache=True, nogil=True, fastmath=_FM)
def all_finite(x):
    chk = 0.0
    for i in range(x.size):
        chk += np.float64(x[i]) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def bucket_l2(x, bs, out):
    """l2 norm of each bucket of ``bs`` entries (accumulated in float64); NaN/Inf propagate."""
    n = x.size
    for j in range(out.size):
        xs = x[j * bs: min(n, j * bs + bs)]
        acc = 0.0
        for t in range(xs.size):
            v = np.float64(xs[t])
            acc += v * v
        out[j] = math.sqrt(acc)


@njit(cache=True, nogil=True)
def bucket_absmax_bits(xi, bs, mask, out):
    """max |x| of each bucket computed on the bit patterns (``xi``: int32/int64 view of float32/float64,
    ``mask`` clears the sign bit): for non-negative IEEE floats integer order is numeric order, and a
    NaN/Inf shows up as a pattern >= the exponent-all-ones value (integer max vectorises; float max
    with NaN semantics does not)."""
    n = xi.size
    for j in range(out.size):
        xs = xi[j * bs: min(n, j * bs + bs)]
        acc = mask & 0
        for t in range(xs.size):
            acc = max(acc, xs[t] & mask)
        out[j] = acc


@njit(cache=True, nogil=True, fastmath=_FM)
def copy_finite(src, dst):
    """dst[:] = src[:] in one pass; returns False if src holds a NaN or Inf."""
    chk = 0.0
    for i in range(src.size):
        v = src[i]
        dst[i] = v
        chk += np.float64(v) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def add_finite(a, b, out):
    """out[:] = a[:] + b[:] in one pass (``out`` distinct from ``a`` and ``b``); returns False if a sum is NaN or
    Inf."""
    chk = 0.0
    for i in range(out.size):
        v = a[i] + b[i]
        out[i] = v
        chk += np.float64(v) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def iadd_finite(a, b):
    """a[:] += b[:] in one pass (a loop of its own: ``add_finite(a, b, a)``'s aliased output defeats the
    vectoriser); returns False if a sum is NaN or Inf."""
    chk = 0.0
    for i in range(a.size):
        v = a[i] + b[i]
        a[i] = v
        chk += np.float64(v) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def div_finite(x, d):
    """x[:] = x / d in place (``d`` a scalar of x's dtype: one correctly rounded division each, torch's ``div_``
    by that scalar bit for bit) and whether every quotient is finite, in one pass (for an integer ``d >= 1``:
    whether every element of x was)."""
    chk = x.dtype.type(0.0)
    for i in range(x.size):
        y = x[i] / d
        x[i] = y
        chk += y * x.dtype.type(0.0)
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def scale_finite(x, r):
    """x[:] = x * r in place (``r`` a scalar of x's dtype: one correctly rounded product each) and whether every
    product is finite, in one pass. For ``r = 2**-k`` (exact in x's dtype) each product is the correctly rounded
    value of the same real number as ``x / 2**k``, so it is :func:`div_finite` by ``2**k`` bit for bit (subnormal
    and non-finite results included: IEEE 754 rounds both operations from the exact value), at the cost of a
    multiplication, several times the throughput of a division (the plain average's pass at a power-of-two
    worker count: :func:`sparsecomm.compressors._common.divide_finite`)."""
    chk = x.dtype.type(0.0)
    for i in range(x.size):
        y = x[i] * r
        x[i] = y
        chk += y * x.dtype.type(0.0)
    return chk == 0.0


@njit(cache=True, nogil=True)
def copy_sub(x, m, out, diff):
    """out[:] = x[:] and diff[:] = m[:] - x[:] in one pass."""
    for i in range(x.size):
        v = x[i]
        out[i] = v
        diff[i] = m[i] - v


# --------------------------------------------------------------------------------- quantisers
@njit(cache=True, nogil=True)
def qsgd_codes(x, bs, norms, s, key, codes):
    """QSGD: code_i = sign(x_i) * (floor(r) + [u < r - floor(r)]), r = s|x_i|/||x_bucket||."""
    n = x.size
    smax = np.int64(s)
    for j in range(norms.size):
        lo = j * bs
        xs = x[lo: min(n, lo + bs)]
        cs = codes[lo: min(n, lo + bs)]
        k2 = key + np.uint64(lo) * GAMMA  # _bits(k2, t) == _bits(key, lo + t)
        f = s / norms[j] if norms[j] > 0.0 else 0.0
        for t in range(xs.size):
            v = np.float64(xs[t])
            r = abs(v) * f
            lvl = np.int64(r)  # r >= 0: truncation is floor
            c = min(lvl + np.int64(_u01(k2, t) < r - lvl), smax)
            cs[t] = c * (1 - 2 * np.int64(v < 0))


@njit(cache=True, nogil=True)
def terngrad_codes(x, bs, maxes, key, codes):
    """TernGrad: code_i = sign(x_i) * [u < |x_i|/max_bucket]."""
    n = x.size
    for j in range(maxes.size):
        lo = j * bs
        xs = x[lo: min(n, lo + bs)]
        cs = codes[lo: min(n, lo + bs)]
        k2 = key + np.uint64(lo) * GAMMA
        f = 1.0 / maxes[j] if maxes[j] > 0.0 else 0.0
        for t in range(xs.size):
            v = np.float64(xs[t])
            c = np.int64(_u01(k2, t) < abs(v) * f)
            cs[t] = c * (1 - 2 * np.int64(v < 0))


_CHUNK = 4096


@njit(cache=True, nogil=True)
def natdither_codes(x, bs, norms, s, key, codes):
    """Natural dithering in units of the lowest level 2^(1-s)||x_b||: t = 2^(s-1)|x_i|/||x_b|| in
    [0, 2^(s-1)]; t < 1 rounds to 0 or 1 (probability t), otherwise to the two powers of two around
    t, unbiasedly, on t's float64 bit pattern (exponent kept, significand fraction = probability of
    rounding up). Chunks of t go through a small buffer viewed as int64 to read the bits."""
    n = x.size
    top = 2.0 ** (s - 1)
    itop = np.int64(1) << np.int64(s - 1)
    tbuf = np.empty(_CHUNK, dtype=np.float64)
    ibuf = tbuf.view(np.int64)
    for j in range(norms.size):
        f = top / norms[j] if norms[j] > 0.0 else 0.0
        b_lo = j * bs
        b_hi = min(n, b_lo + bs)
        for lo in range(b_lo, b_hi, _CHUNK):
            hi = min(b_hi, lo + _CHUNK)
            xs = x[lo:hi]
            cs = codes[lo:hi]
            k2 = key + np.uint64(lo) * GAMMA
            m = hi - lo
            for t in range(m):
                tbuf[t] = min(abs(np.float64(xs[t])) * f, top)  # rounding may overshoot top
            for t in range(m):
                tv = tbuf[t]
                b = ibuf[t]
                z = _bits(k2, t)
                small = np.int64(np.float64(z >> _U11) * _INV53 < tv)
                up = np.int64(np.int64(z >> _U12) < (b & np.int64(0xFFFFFFFFFFFFF)))
                e = max((b >> 52) - 1023 + up, np.int64(0))
                c = small if tv < 1.0 else min(np.int64(1) << e, itop)
                cs[t] = c * (1 - 2 * np.int64(xs[t] < 0))


@njit(cache=True, nogil=True, fastmath=_FM)
def sign_codes(x, codes):
    """Scaled sign: codes = -1 where x < 0 else +1 (sign(0) := +1), returns ||x||_1 (float64)."""
    acc = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        codes[i] = 1 - 2 * np.int64(v < 0)
        acc += abs(v)
    return acc


@njit(cache=True, nogil=True, fastmath=_FM)
def vote_codes(x, codes):
    """Majority-vote signs: codes = -1 where x < 0 else +1 (sign(0) := +1); returns False if x holds a
    NaN or Inf (no sum of |x| that a finite float64 input could overflow)."""
    chk = 0.0
    for i in range(x.size):
        v = x[i]
        codes[i] = 1 - 2 * np.int64(v < 0)
        chk += np.float64(v) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def onebit_sums(x, bs, codes, pos, neg, nneg):
    """1-bit SGD, per bucket ``j`` of ``bs`` entries (the last may be shorter): codes = sign(x)
    (sign(0) := +1), ``pos[j]`` / ``neg[j]`` the float64 sums of the non-negative / negative entries
    and ``nneg[j]`` the count of negative ones. A NaN or Inf in a bucket makes its sums non-finite."""
    n = x.size
    for j in range(pos.size):
        lo = j * bs
        xs = x[lo: min(n, lo + bs)]
        cs = codes[lo: min(n, lo + bs)]
        sp = 0.0
        sn = 0.0
        c = 0
        for t in range(xs.size):
            v = np.float64(xs[t])
            m = v < 0
            cs[t] = 1 - 2 * np.int64(m)
            sn += v if m else 0.0
            sp += 0.0 if m else v
            c += np.int64(m)
        pos[j] = sp
        neg[j] = sn
        nneg[j] = c


@njit(cache=True, nogil=True)
def two_level_residual(p, codes, qpos, qneg, bs, err):
    """err = p - q with q = ``qneg[j]`` where the code is negative, else ``qpos[j]`` (bucket ``j`` of
    ``bs`` entries); ``q`` is in ``p``'s dtype, so each entry is one IEEE subtraction."""
    n = p.size
    for j in range(qpos.size):
        lo = j * bs
        ps = p[lo: min(n, lo + bs)]
        cs = codes[lo: min(n, lo + bs)]
        es = err[lo: min(n, lo + bs)]
        qp = qpos[j]
        qn = qneg[j]
        for t in range(ps.size):
            es[t] = ps[t] - (qn if cs[t] < 0 else qp)


# ------------------------------------------------------------------------------------ decompression
@njit(cache=True, nogil=True)
def dequantize(codes, scale, bs, out):
    """out = codes * scale[bucket] per bucket of ``bs`` entries; ``scale`` is in ``out``'s dtype, so each
    entry is the exact conversion of its code rounded once by the product (what torch's
    ``codes.to(dtype) * scale`` computes)."""
    n = out.size
    for j in range(scale.size):
        lo = j * bs
        cs = codes[lo: min(n, lo + bs)]
        os_ = out[lo: min(n, lo + bs)]
        s = scale[j]
        for t in range(cs.size):
            os_[t] = cs[t] * s


def _native_half() -> bool:
    """Whether the code Numba generates converts float32 <-> float16 in hardware: an x86-64 target with F16C
    (and AVX, which it needs). Elsewhere LLVM would call a runtime helper that Numba's JIT does not provide
    (``NUMBA_CPU_NAME=generic`` crashes the process), so the callers keep torch's cast there."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding
        from numba.core import config

        features = config.CPU_FEATURES if config.CPU_FEATURES is not None else \
            binding.get_host_cpu_features().flatten()
        return bool(config.ENABLE_AVX) and "+f16c" in features.split(",") and "+avx" in features.split(",")
    except Exception:  # noqa: BLE001 - unknown target: torch's cast
        return False


#: float16 <-> float32 in Numba kernels (:func:`f16_bits`, :func:`f16_value`) is safe on this process's target
NATIVE_HALF = _native_half()


@intrinsic
def f16_bits(typingctx, x):
    """The float16 bit pattern (int16) of float32 ``x`` rounded to nearest, ties to even (LLVM's
    ``fptrunc``: the F16C instruction, which torch's CPU cast also uses). Only where :data:`NATIVE_HALF`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


@intrinsic
def f16_value(typingctx, h):
    """The float32 value of the float16 bit pattern ``h`` (int16), exact (LLVM's ``fpext``). Only where
    :data:`NATIVE_HALF`."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def f32_at(typingctx, addr):
    """The float32 pointer at the integer address ``addr`` (a contiguous CPU tensor's ``data_ptr()``): with
    ``numba.carray`` a kernel reads a torch tensor's memory without the ``Tensor.numpy()`` call (a microsecond
    or two per call, the cost of a cast of thousands of elements). The caller keeps the tensor alive and
    checks it contiguous, on the CPU, of that dtype."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.FloatType().as_pointer())
    return types.CPointer(types.float32)(types.int64), codegen


@intrinsic
def i16_at(typingctx, addr):
    """:func:`f32_at` for 16-bit patterns (a float16 or bfloat16 tensor's memory read as int16)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(16).as_pointer())
    return types.CPointer(types.int16)(types.int64), codegen


@njit(cache=True, nogil=True)
def widen_f16(hbits, out):
    """out[i] = the float32 value of the float16 bit pattern ``hbits[i]`` (int16): torch's cast bit for bit
    (a NaN quieted, as the hardware converts it). Only where :data:`NATIVE_HALF`."""
    for i in range(hbits.size):
        out[i] = f16_value(hbits[i])


@njit(cache=True, nogil=True)
def widen_bf16(hbits, out):
    """out[i] = the float32 value of the bfloat16 bit pattern ``hbits[i]`` (int16): ``h << 16``, torch's cast
    bit for bit."""
    ob = out.view(np.int32)
    for i in range(hbits.size):
        ob[i] = np.int32(np.int32(hbits[i]) << np.int32(16))


@njit(cache=True, nogil=True)
def widen_f16_at(addr, out):
    """:func:`widen_f16` of the ``out.size`` float16 patterns at ``addr`` (see :func:`f32_at`)."""
    widen_f16(carray(i16_at(addr), out.size), out)


@njit(cache=True, nogil=True)
def widen_bf16_at(addr, out):
    """:func:`widen_bf16` of the ``out.size`` bfloat16 patterns at ``addr`` (see :func:`f32_at`)."""
    widen_bf16(carray(i16_at(addr), out.size), out)


@njit(cache=True, nogil=True, fastmath=_FM)
def widen_div_f16(hbits, d, out):
    """out[i] = (the float32 value of the float16 bit pattern ``hbits[i]``) / ``d`` (float32): :func:`widen_f16`
    then torch's float32 division by the scalar (one correctly rounded division), bit for bit, in one pass;
    returns whether every quotient is finite (for ``d >= 1``: whether every ``hbits[i]`` was), from the same
    pass (``fastmath`` reassociates the check's sum only). Only where :data:`NATIVE_HALF`."""
    chk = np.float32(0.0)
    for i in range(hbits.size):
        y = f16_value(hbits[i]) / d
        out[i] = y
        chk += y * np.float32(0.0)
    return chk == 0.0


@njit(cache=True, nogil=True, fastmath=_FM)
def widen_div_bf16(hbits, d, out):
    """out[i] = (the float32 value of the bfloat16 bit pattern ``hbits[i]``) / ``d`` (float32): :func:`widen_bf16`
    then torch's float32 division by the scalar, bit for bit, in one pass; returns whether every quotient is
    finite, as :func:`widen_div_f16`."""
    chk = np.float32(0.0)
    for i in range(hbits.size):
        y = np.int32(np.int32(hbits[i]) << np.int32(16)).view(np.float32) / d
        out[i] = y
        chk += y * np.float32(0.0)
    return chk == 0.0


@njit(cache=True, nogil=True)
def scatter_dense(idx, vals, out):
    """out[:] = 0, then out[idx[j]] += vals[j] in order of j (``index_add_`` onto zeros); returns False,
    with ``out`` partly written, at the first index outside [0, out.size)."""
    n = out.size
    for i in range(n):
        out[i] = 0
    for j in range(idx.size):
        i = idx[j]
        if i < 0 or i >= n:
            return False
        out[i] += vals[j]
    return True


# ------------------------------------------------------------------------------------ rand-k
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_POS = np.array([0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51,
                          43, 22, 45, 39, 33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52,
                          21, 44, 32, 23, 11, 46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
                         dtype=np.int64)


@njit(cache=True, nogil=True)
def sample_bitmap(d, m, key, words):
    """Set m distinct bits of a d-bit bitmap: uniform draws (rejection from the next power of two, so
    exactly uniform) until m distinct positions are in hand -- the first m distinct values of an
    i.i.d. uniform sequence form a uniform m-subset. Returns the number of draws used."""
    mask = np.uint64(1)
    while mask < np.uint64(d):
        mask = mask << np.uint64(1)
    mask -= np.uint64(1)
    cnt = 0
    j = 0
    while cnt < m:
        r = np.int64(_bits(key, j) & mask)
        j += 1
        if r < d:
            w = r >> 6
            b = np.uint64(1) << np.uint64(r & 63)
            if (words[w] & b) == np.uint64(0):
                words[w] |= b
                cnt += 1
    return j


@njit(cache=True, nogil=True)
def bitmap_positions(words, d, take_set, out):
    """Positions (increasing) of the set bits (``take_set``) or of the clear bits below d."""
    c = 0
    for wi in range(words.size):
        w = words[wi] if take_set else ~words[wi]
        if wi == words.size - 1 and d & 63:
            w &= (np.uint64(1) << np.uint64(d & 63)) - np.uint64(1)
        while w != np.uint64(0):
            low = w & (~w + np.uint64(1))
            out[c] = (wi << 6) + _DEBRUIJN_POS[np.int64((low * _DEBRUIJN) >> np.uint64(58))]
            c += 1
            w ^= low
    return c


# ------------------------------------------------------------------------------------ selection
@njit(cache=True, nogil=True)
def collect_ge(x, thr, buf):
    """Indices i (increasing) with |x_i| >= thr (``thr`` of x's dtype) into ``buf``: a branch-free
    store-then-advance loop (a NaN is never collected: check finiteness separately, ``all_finite``, so
    that this loop stays free of the extra dependency that keeps it from vectorising)."""
    c = 0
    for i in range(x.size):
        buf[c] = i
        c += np.int64(abs(x[i]) >= thr)
    return c


@njit(cache=True, nogil=True, fastmath=_FM)
def gather_scaled(x, idx, s, out):
    """out[j] = x[idx[j]] * s (s = 1 copies exactly); returns False if a gathered value is NaN/Inf."""
    chk = 0.0
    for j in range(idx.size):
        v = x[idx[j]]
        out[j] = v * s
        chk += np.float64(v) * 0.0
    return chk == 0.0


@njit(cache=True, nogil=True)
def abs_gather(x, idx, out):
    for j in range(idx.size):
        out[j] = abs(x[idx[j]])


@njit(cache=True, nogil=True)
def select_exact(vals, idx, k, vk, out):
    """Among candidates (``idx`` increasing, ``vals`` = |x| there) keep every value > vk and the first
    ``k - #(> vk)`` values == vk: the top-k with ties broken towards the lower index."""
    g = 0
    for j in range(vals.size):
        if vals[j] > vk:
            g += 1
    need_eq = k - g
    c = 0
    for j in range(vals.size):
        v = vals[j]
        if v > vk:
            out[c] = idx[j]
            c += 1
        elif v == vk and need_eq > 0:
            out[c] = idx[j]
            c += 1
            need_eq -= 1
    return c


# ------------------------------------------------------------------------------ the default path
def default_path_signatures() -> list:
    """``(kernel, argument types)`` of every kernel that the default CPU path's first step runs, as its
    callers type them: error feedback with top-k on float32 (the finiteness pass, the absolute maximum,
    the sampled threshold's candidates, their exact selection and the gather of the kept values; Python
    ints are int64, the thresholds float32 scalars), and the DDP hook's default (the plain average, its
    division and finiteness check in one pass where chained on its collective). The fork server of
    ``sc.launch`` loads these from Numba's on-disk cache (:func:`sparsecomm._numba_warm.load_cached`) so that
    its ranks start with them."""
    from numba import typeof

    f32, i32, i64 = (typeof(np.zeros(1, dt)) for dt in (np.float32, np.int32, np.int64))
    n, s32 = typeof(0), typeof(np.float32(0))
    return [
        (all_finite, (f32,)),
        (bucket_absmax_bits, (i32, n, typeof(np.int32(0)), i32)),
        (collect_ge, (f32, s32, i64)),
        (abs_gather, (f32, i64, f32)),
        (select_exact, (f32, i64, n, s32, i64)),
        (gather_scaled, (f32, i64, s32, f32)),
        (div_finite, (f32, s32)),
        (scale_finite, (f32, s32)),
    ]
