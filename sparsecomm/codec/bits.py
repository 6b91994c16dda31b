"""Bit packing of small integer codes for the wire: what a payload's declared ``bits`` count.

Layout (the same for every function and both backends): element ``i`` occupies bits
``[k i, k (i + 1))`` of a little-endian bit stream, i.e. bit ``j`` of the stream is bit ``j % 8`` of
byte ``j // 8``; the last byte is zero-padded. ``n`` codes of ``k`` bits take exactly
``packed_nbytes(n, k) = ceil(n k / 8)`` bytes.

* ``pack_bits(codes, k)`` / ``unpack_bits(packed, n, k)``: the low ``k`` bits (1 <= k <= 16) of
  integer codes, i.e. their ``k``-bit two's complement; unpacking sign-extends (``signed=True``) or
  zero-extends. Codes in ``[-2^(k-1), 2^(k-1) - 1]`` (signed) or ``[0, 2^k)`` round-trip exactly;
  QSGD's codes in ``[-s, s]`` need ``k = 1 + ceil(log2(s + 1))`` (``theory.compressors.qsgd_code_bits``),
  TernGrad's ``{-1, 0, 1}`` need 2.
* ``pack_signs(codes)`` / ``unpack_signs(packed, n)``: one bit per code, set when the code is negative
  (the IEEE convention); unpacking gives int8 ``{-1, +1}`` (so a zero code comes back as ``+1``, the
  ``sign(0) := +1`` of scaled sign, signSGD and 1-bit SGD). Also accepts float tensors (the sign bit).
* ``pack_natural(values)`` / ``unpack_natural(packed, n, dtype)``: signed powers of two (and zeros),
  the values of natural compression (Horvath et al., arXiv 1905.10988), as sign + exponent: float32 /
  bfloat16 values as a byte plane of float32 exponent fields followed by a 1-bit sign plane (9 bits per
  entry, ``n + ceil(n / 8)`` bytes); float16 values as 7-bit codes (sign + 6-bit exponent index,
  ``2^-24 .. 2^15`` and zero); float64 values as 12-bit codes (sign + 11-bit exponent field).

CPU tensors use the Numba kernels (``@njit(cache=True, nogil=True)``): codes of 1 to 8 bits from int8
are gathered eight at a time from a 64-bit word (a shift-or tree, no per-bit loop); widths 1, 2, 4
store one result per word, widths 3, 5, 6, 7 join 64 codes into k words (unrolled per k); wider codes
and wider code dtypes, and the tails, go through a 64-bit bit accumulator. Other devices use torch ops
(the same bytes).
Speed against ``numpy.copyto`` of the codes: ``experiments/bench/codec.py --bits`` and BENCHMARKS.md.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .. import kernels as _kernel_paths
from ._common import CodecError

__all__ = ["packed_nbytes", "pack_bits", "unpack_bits", "pack_signs", "unpack_signs", "natural_nbytes",
           "pack_natural", "unpack_natural", "MAX_BITS"]

#: widest code ``pack_bits`` takes
MAX_BITS = 16

_NP_INT = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
           torch.uint8: np.uint8}


def packed_nbytes(n: int, k: int) -> int:
    """Bytes of ``n`` codes of ``k`` bits: ``ceil(n k / 8)``."""
    return (int(n) * int(k) + 7) // 8


# ====================================================================================== kernels
# 8 codes of k bits (k = 1, 2, 4, 8), one per byte of a uint64 word (low k bits), gathered into the low
# 8k bits by a shift-or tree: pairs of bytes into 16-bit lanes, pairs of those into 32-bit lanes, ...
@njit(cache=True, nogil=True)
def _gather8(w, k):
    a1 = np.uint64((1 << k) - 1) * np.uint64(0x0001000100010001)
    a2 = np.uint64((1 << (2 * k)) - 1) * np.uint64(0x0000000100000001)
    a3 = np.uint64((1 << (4 * k)) - 1)
    w = w & (np.uint64((1 << k) - 1) * np.uint64(0x0101010101010101))
    w = (w & a1) | ((w >> np.uint64(8 - k)) & (a1 << np.uint64(k)))
    w = (w & a2) | ((w >> np.uint64(16 - 2 * k)) & (a2 << np.uint64(2 * k)))
    w = (w & a3) | ((w >> np.uint64(32 - 4 * k)) & (a3 << np.uint64(4 * k)))
    return w


@njit(cache=True, nogil=True)
def _pack_words(words, k, out):
    """``words``: uint64 view of int8 codes (8 per word; a multiple of 8 words for k = 3, 5, 6, 7);
    ``out``: uint8, ``k`` bytes per word. Widths 1, 2, 4 store one 8/16/32-bit result per word; the
    others go through ``_pack_mid`` (64 codes -> k output words)."""
    nw = words.size
    if k == 1:
        for g in range(nw):
            out[g] = np.uint8(_gather8(words[g], 1) & np.uint64(0xFF))
    elif k == 2:
        o16 = out[: 2 * nw].view(np.uint16)
        for g in range(nw):
            o16[g] = np.uint16(_gather8(words[g], 2) & np.uint64(0xFFFF))
    elif k == 4:
        o32 = out[: 4 * nw].view(np.uint32)
        for g in range(nw):
            o32[g] = np.uint32(_gather8(words[g], 4) & np.uint64(0xFFFFFFFF))
    else:
        _pack_mid(words, k, out[: k * nw].view(np.uint64))


@njit(cache=True, nogil=True)
def _sign_words(words, out):
    """One bit per int8 code of ``words`` (uint64 view): the code's sign bit."""
    for g in range(words.size):
        out[g] = np.uint8(_gather8(words[g] >> np.uint64(7), 1) & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def _pack_stream(codes, start, k, out, bit0):
    """Codes ``codes[start:]`` (any integer dtype, low ``k`` bits) into ``out`` from stream bit ``bit0``
    (``out`` zeroed beyond ``bit0``): a 64-bit accumulator, whole bytes written as they fill."""
    mask = np.uint64((1 << k) - 1)
    acc = np.uint64(0)
    nb = 0
    pos = bit0 // 8
    r = bit0 % 8
    if r:
        acc = np.uint64(out[pos]) & np.uint64((1 << r) - 1)
        nb = r
    for i in range(start, codes.size):
        acc |= (np.uint64(np.int64(codes[i])) & mask) << np.uint64(nb)
        nb += k
        while nb >= 8:
            out[pos] = np.uint8(acc & np.uint64(0xFF))
            pos += 1
            acc >>= np.uint64(8)
            nb -= 8
    if nb > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def _unpack_words(packed, k, signed, out):
    """Inverse of ``_pack_words`` for k in 1, 2, 4, 8 (int8 output, 8 codes per uint64 word)."""
    nw = out.size // 8
    o64 = out[: 8 * nw].view(np.uint64)
    m1 = np.uint64((1 << k) - 1) * np.uint64(0x0101010101010101)
    top = np.uint64(1 << (k - 1)) * np.uint64(0x0101010101010101)
    for g in range(nw):
        if k == 1:
            v = np.uint64(packed[g])
        elif k == 2:
            v = np.uint64(packed[2 * g]) | (np.uint64(packed[2 * g + 1]) << np.uint64(8))
        else:
            b = 4 * g
            v = (np.uint64(packed[b]) | (np.uint64(packed[b + 1]) << np.uint64(8)) |
                 (np.uint64(packed[b + 2]) << np.uint64(16)) | (np.uint64(packed[b + 3]) << np.uint64(24)))
        # spread 8k bits to one k-bit field per byte (reverse shift-or tree)
        v = (v | (v << np.uint64(32 - 4 * k))) & (np.uint64((1 << (4 * k)) - 1) * np.uint64(0x0000000100000001))
        v = (v | (v << np.uint64(16 - 2 * k))) & (np.uint64((1 << (2 * k)) - 1) * np.uint64(0x0001000100010001))
        v = (v | (v << np.uint64(8 - k))) & m1
        if signed:  # sign-extend each byte's k-bit field: (v ^ top) - top, per byte, without borrows
            t = v ^ top
            # per byte: t - top = t + (256 - top) mod 256 with no carry across bytes
            hi = np.uint64(0x8080808080808080)
            neg = (np.uint64(0x0101010101010101) * np.uint64(256 - (1 << (k - 1)))) & np.uint64(0xFFFFFFFFFFFFFFFF)
            s = ((t & ~hi) + (neg & ~hi)) ^ ((t ^ neg) & hi)
            v = s
        o64[g] = v


@njit(cache=True, nogil=True)
def _spread8(v, k):
    """Inverse of ``_gather8``: the 8 k-bit fields of ``v``'s low 8k bits, one per byte."""
    a1 = np.uint64((1 << k) - 1) * np.uint64(0x0001000100010001)
    a2 = np.uint64((1 << (2 * k)) - 1) * np.uint64(0x0000000100000001)
    a3 = np.uint64((1 << (4 * k)) - 1)
    v = (v & a3) | ((v << np.uint64(32 - 4 * k)) & (a3 << np.uint64(32)))
    v = (v & a2) | ((v << np.uint64(16 - 2 * k)) & (a2 << np.uint64(16)))
    v = (v & a1) | ((v << np.uint64(8 - k)) & (a1 << np.uint64(8)))
    return v


@njit(cache=True, nogil=True)
def _sext8(v, k):
    """Sign-extend the k-bit field in every byte of ``v`` (SWAR: (t ^ top) - top per byte)."""
    top = np.uint64(1 << (k - 1)) * np.uint64(0x0101010101010101)
    hi = np.uint64(0x8080808080808080)
    neg = np.uint64(0x0101010101010101) * np.uint64(256 - (1 << (k - 1)))
    t = v ^ top
    return ((t & ~hi) + (neg & ~hi)) ^ ((t ^ neg) & hi)


@njit(cache=True, nogil=True)
def _unpack_stream(packed, start, k, signed, out):
    """Codes ``out[start:]`` from stream bit ``start * k`` (any integer output dtype)."""
    mask = np.uint64((1 << k) - 1)
    half = np.int64(1 << (k - 1))
    bit = start * k
    pos = bit // 8
    r = bit % 8
    acc = np.uint64(0)
    nb = 0
    if start < out.size:
        acc = np.uint64(packed[pos]) >> np.uint64(r)
        nb = 8 - r
        pos += 1
    for i in range(start, out.size):
        while nb < k:
            acc |= np.uint64(packed[pos]) << np.uint64(nb)
            pos += 1
            nb += 8
        v = np.int64(acc & mask)
        acc >>= np.uint64(k)
        nb -= k
        if signed and v >= half:
            v -= 2 * half
        out[i] = v


@njit(cache=True, nogil=True)
def _unpack_signs_words(packed, out):
    nw = out.size // 8
    o64 = out[: 8 * nw].view(np.uint64)
    ones = np.uint64(0x0101010101010101)
    for g in range(nw):
        v = np.uint64(packed[g])
        v = (v | (v << np.uint64(28))) & np.uint64(0x0000000F0000000F)
        v = (v | (v << np.uint64(14))) & np.uint64(0x0003000300030003)
        v = (v | (v << np.uint64(7))) & ones
        # bit b -> byte 1 - 2b: +1 (0x01) or -1 (0xFF) = 0x01 + b * 0xFE per byte, no carries
        o64[g] = ones + v * np.uint64(0xFE)


@njit(cache=True, nogil=True)
def _natural32_pack(bits, out):
    """float32 bit patterns -> exponent byte plane (``n`` bytes) then sign bit plane; 8 values (four
    64-bit words in, one 64-bit word of exponents and one sign byte out) per step. Returns the OR of
    the significand bits (non-zero: some value was not a signed power of two or zero)."""
    n = bits.size
    nw = n // 8
    sg = out[n:]
    i64 = bits[: 8 * nw].view(np.uint64)
    e64 = out[: 8 * nw].view(np.uint64)
    ff = np.uint64(0xFF)
    mant = np.uint64(0)
    mm = np.uint64(0x007FFFFF007FFFFF)
    for g in range(nw):
        e = np.uint64(0)
        b = np.uint64(0)
        for h in range(4):
            w = i64[4 * g + h]
            mant |= w & mm
            e |= ((w >> np.uint64(23)) & ff) << np.uint64(16 * h)
            e |= ((w >> np.uint64(55)) & ff) << np.uint64(16 * h + 8)
            b |= ((w >> np.uint64(31)) & np.uint64(1)) << np.uint64(2 * h)
            b |= (w >> np.uint64(63)) << np.uint64(2 * h + 1)
        e64[g] = e
        sg[g] = np.uint8(b)
    if 8 * nw < n:
        b = 0
        for i in range(8 * nw, n):
            out[i] = np.uint8((bits[i] >> 23) & 0xFF)
            b |= ((bits[i] >> 31) & 1) << (i - 8 * nw)
            mant |= np.uint64(bits[i] & 0x7FFFFF)
        sg[nw] = np.uint8(b)
    return mant


@njit(cache=True, nogil=True)
def _natural32_unpack(packed, out):
    """Inverse of ``_natural32_pack`` (int32 bit patterns out), 8 values per step."""
    n = out.size
    nw = n // 8
    sg = packed[n:]
    e64 = packed[: 8 * nw].view(np.uint64)
    o64 = out[: 8 * nw].view(np.uint64)
    ff = np.uint64(0xFF)
    one = np.uint64(1)
    for g in range(nw):
        b = np.uint64(sg[g])
        w = e64[g]
        for h in range(4):
            lo = (w >> np.uint64(16 * h)) & ff
            hi = (w >> np.uint64(16 * h + 8)) & ff
            s0 = (b >> np.uint64(2 * h)) & one
            s1 = (b >> np.uint64(2 * h + 1)) & one
            o64[4 * g + h] = (lo << np.uint64(23)) | (s0 << np.uint64(31)) | (hi << np.uint64(55)) | \
                (s1 << np.uint64(63))
    for i in range(8 * nw, n):
        s = (np.int32(sg[nw]) >> (i - 8 * nw)) & 1
        out[i] = (np.int32(packed[i]) << 23) | (s << 31)


# ---------------------------------------------------------------------------- 3, 5, 6, 7 bits
# Eight codes gather into 8k bits (``_gather8``, a vectorised pass over a cache-sized chunk); 64 codes
# (8 groups) make k output words. The joins below are unrolled per k (the shifts are constants), which
# an accumulator loop with a data-dependent carry is not. Generated by this expression, kept as source so
# that numba can cache it: for output word i, OR of group j shifted by 8kj - 64i (right when negative)
# over the groups that overlap bits [64i, 64i + 64).
_CHUNK = 512   # words per chunk: 4 KiB of gathered groups, in L1


@njit(cache=True, nogil=True)
def _join3(tmp, o64, ob):
    """Blocks of 8 gathered 24-bit groups (``tmp``) into 3 words each, from ``o64[ob]``."""
    m = np.uint64(16777215)
    for b in range(tmp.size // 8):
        t = tmp[8 * b: 8 * b + 8]
        o = o64[ob + 3 * b: ob + 3 * b + 3]
        g0 = t[0] & m
        g1 = t[1] & m
        g2 = t[2] & m
        g3 = t[3] & m
        g4 = t[4] & m
        g5 = t[5] & m
        g6 = t[6] & m
        g7 = t[7] & m
        o[0] = g0 | (g1 << np.uint64(24)) | (g2 << np.uint64(48))
        o[1] = (g2 >> np.uint64(16)) | (g3 << np.uint64(8)) | (g4 << np.uint64(32)) | (g5 << np.uint64(56))
        o[2] = (g5 >> np.uint64(8)) | (g6 << np.uint64(16)) | (g7 << np.uint64(40))


@njit(cache=True, nogil=True)
def _split3(i64, ib, tmp):
    """Inverse of ``_join3``: 3 words each from ``i64[ib]`` into 8 groups of 24 bits."""
    m = np.uint64(16777215)
    for b in range(tmp.size // 8):
        s = i64[ib + 3 * b: ib + 3 * b + 3]
        t = tmp[8 * b: 8 * b + 8]
        i0 = s[0]
        i1 = s[1]
        i2 = s[2]
        t[0] = (i0) & m
        t[1] = ((i0 >> np.uint64(24))) & m
        t[2] = ((i0 >> np.uint64(48)) | (i1 << np.uint64(16))) & m
        t[3] = ((i1 >> np.uint64(8))) & m
        t[4] = ((i1 >> np.uint64(32))) & m
        t[5] = ((i1 >> np.uint64(56)) | (i2 << np.uint64(8))) & m
        t[6] = ((i2 >> np.uint64(16))) & m
        t[7] = ((i2 >> np.uint64(40))) & m


@njit(cache=True, nogil=True)
def _join5(tmp, o64, ob):
    """Blocks of 8 gathered 40-bit groups (``tmp``) into 5 words each, from ``o64[ob]``."""
    m = np.uint64(1099511627775)
    for b in range(tmp.size // 8):
        t = tmp[8 * b: 8 * b + 8]
        o = o64[ob + 5 * b: ob + 5 * b + 5]
        g0 = t[0] & m
        g1 = t[1] & m
        g2 = t[2] & m
        g3 = t[3] & m
        g4 = t[4] & m
        g5 = t[5] & m
        g6 = t[6] & m
        g7 = t[7] & m
        o[0] = g0 | (g1 << np.uint64(40))
        o[1] = (g1 >> np.uint64(24)) | (g2 << np.uint64(16)) | (g3 << np.uint64(56))
        o[2] = (g3 >> np.uint64(8)) | (g4 << np.uint64(32))
        o[3] = (g4 >> np.uint64(32)) | (g5 << np.uint64(8)) | (g6 << np.uint64(48))
        o[4] = (g6 >> np.uint64(16)) | (g7 << np.uint64(24))


@njit(cache=True, nogil=True)
def _split5(i64, ib, tmp):
    """Inverse of ``_join5``: 5 words each from ``i64[ib]`` into 8 groups of 40 bits."""
    m = np.uint64(1099511627775)
    for b in range(tmp.size // 8):
        s = i64[ib + 5 * b: ib + 5 * b + 5]
        t = tmp[8 * b: 8 * b + 8]
        i0 = s[0]
        i1 = s[1]
        i2 = s[2]
        i3 = s[3]
        i4 = s[4]
        t[0] = (i0) & m
        t[1] = ((i0 >> np.uint64(40)) | (i1 << np.uint64(24))) & m
        t[2] = ((i1 >> np.uint64(16))) & m
        t[3] = ((i1 >> np.uint64(56)) | (i2 << np.uint64(8))) & m
        t[4] = ((i2 >> np.uint64(32)) | (i3 << np.uint64(32))) & m
        t[5] = ((i3 >> np.uint64(8))) & m
        t[6] = ((i3 >> np.uint64(48)) | (i4 << np.uint64(16))) & m
        t[7] = ((i4 >> np.uint64(24))) & m


@njit(cache=True, nogil=True)
def _join6(tmp, o64, ob):
    """Blocks of 8 gathered 48-bit groups (``tmp``) into 6 words each, from ``o64[ob]``."""
    m = np.uint64(281474976710655)
    for b in range(tmp.size // 8):
        t = tmp[8 * b: 8 * b + 8]
        o = o64[ob + 6 * b: ob + 6 * b + 6]
        g0 = t[0] & m
        g1 = t[1] & m
        g2 = t[2] & m
        g3 = t[3] & m
        g4 = t[4] & m
        g5 = t[5] & m
        g6 = t[6] & m
        g7 = t[7] & m
        o[0] = g0 | (g1 << np.uint64(48))
        o[1] = (g1 >> np.uint64(16)) | (g2 << np.uint64(32))
        o[2] = (g2 >> np.uint64(32)) | (g3 << np.uint64(16))
        o[3] = g4 | (g5 << np.uint64(48))
        o[4] = (g5 >> np.uint64(16)) | (g6 << np.uint64(32))
        o[5] = (g6 >> np.uint64(32)) | (g7 << np.uint64(16))


@njit(cache=True, nogil=True)
def _split6(i64, ib, tmp):
    """Inverse of ``_join6``: 6 words each from ``i64[ib]`` into 8 groups of 48 bits."""
    m = np.uint64(281474976710655)
    for b in range(tmp.size // 8):
        s = i64[ib + 6 * b: ib + 6 * b + 6]
        t = tmp[8 * b: 8 * b + 8]
        i0 = s[0]
        i1 = s[1]
        i2 = s[2]
        i3 = s[3]
        i4 = s[4]
        i5 = s[5]
        t[0] = (i0) & m
        t[1] = ((i0 >> np.uint64(48)) | (i1 << np.uint64(16))) & m
        t[2] = ((i1 >> np.uint64(32)) | (i2 << np.uint64(32))) & m
        t[3] = ((i2 >> np.uint64(16))) & m
        t[4] = (i3) & m
        t[5] = ((i3 >> np.uint64(48)) | (i4 << np.uint64(16))) & m
        t[6] = ((i4 >> np.uint64(32)) | (i5 << np.uint64(32))) & m
        t[7] = ((i5 >> np.uint64(16))) & m


@njit(cache=True, nogil=True)
def _join7(tmp, o64, ob):
    """Blocks of 8 gathered 56-bit groups (``tmp``) into 7 words each, from ``o64[ob]``."""
    m = np.uint64(72057594037927935)
    for b in range(tmp.size // 8):
        t = tmp[8 * b: 8 * b + 8]
        o = o64[ob + 7 * b: ob + 7 * b + 7]
        g0 = t[0] & m
        g1 = t[1] & m
        g2 = t[2] & m
        g3 = t[3] & m
        g4 = t[4] & m
        g5 = t[5] & m
        g6 = t[6] & m
        g7 = t[7] & m
        o[0] = g0 | (g1 << np.uint64(56))
        o[1] = (g1 >> np.uint64(8)) | (g2 << np.uint64(48))
        o[2] = (g2 >> np.uint64(16)) | (g3 << np.uint64(40))
        o[3] = (g3 >> np.uint64(24)) | (g4 << np.uint64(32))
        o[4] = (g4 >> np.uint64(32)) | (g5 << np.uint64(24))
        o[5] = (g5 >> np.uint64(40)) | (g6 << np.uint64(16))
        o[6] = (g6 >> np.uint64(48)) | (g7 << np.uint64(8))


@njit(cache=True, nogil=True)
def _split7(i64, ib, tmp):
    """Inverse of ``_join7``: 7 words each from ``i64[ib]`` into 8 groups of 56 bits."""
    m = np.uint64(72057594037927935)
    for b in range(tmp.size // 8):
        s = i64[ib + 7 * b: ib + 7 * b + 7]
        t = tmp[8 * b: 8 * b + 8]
        i0 = s[0]
        i1 = s[1]
        i2 = s[2]
        i3 = s[3]
        i4 = s[4]
        i5 = s[5]
        i6 = s[6]
        t[0] = (i0) & m
        t[1] = ((i0 >> np.uint64(56)) | (i1 << np.uint64(8))) & m
        t[2] = ((i1 >> np.uint64(48)) | (i2 << np.uint64(16))) & m
        t[3] = ((i2 >> np.uint64(40)) | (i3 << np.uint64(24))) & m
        t[4] = ((i3 >> np.uint64(32)) | (i4 << np.uint64(32))) & m
        t[5] = ((i4 >> np.uint64(24)) | (i5 << np.uint64(40))) & m
        t[6] = ((i5 >> np.uint64(16)) | (i6 << np.uint64(48))) & m
        t[7] = ((i6 >> np.uint64(8))) & m



@njit(cache=True, nogil=True)
def _join(tmp, k, o64, ob):
    if k == 3:
        _join3(tmp, o64, ob)
    elif k == 5:
        _join5(tmp, o64, ob)
    elif k == 6:
        _join6(tmp, o64, ob)
    else:
        _join7(tmp, o64, ob)


@njit(cache=True, nogil=True)
def _split(i64, ib, k, tmp):
    if k == 3:
        _split3(i64, ib, tmp)
    elif k == 5:
        _split5(i64, ib, tmp)
    elif k == 6:
        _split6(i64, ib, tmp)
    else:
        _split7(i64, ib, tmp)


@njit(cache=True, nogil=True)
def _pack_mid(words, k, o64):
    """int8 codes (uint64 view, a multiple of 8 words) -> k-bit fields, k in 3, 5, 6, 7."""
    tmp = np.empty(_CHUNK, dtype=np.uint64)
    nw = words.size
    for s in range(0, nw, _CHUNK):
        m = min(_CHUNK, nw - s)
        w = words[s: s + m]
        t = tmp[:m]
        for i in range(m):
            t[i] = _gather8(w[i], k)
        _join(t, k, o64, (s // 8) * k)


@njit(cache=True, nogil=True)
def _unpack_mid(i64, k, signed, o64):
    """Inverse of ``_pack_mid`` into int8 codes (uint64 view ``o64``, a multiple of 8 words)."""
    tmp = np.empty(_CHUNK, dtype=np.uint64)
    nw = o64.size
    for s in range(0, nw, _CHUNK):
        m = min(_CHUNK, nw - s)
        t = tmp[:m]
        _split(i64, (s // 8) * k, k, t)
        o = o64[s: s + m]
        if signed:
            for i in range(m):
                o[i] = _sext8(_spread8(t[i], k), k)
        else:
            for i in range(m):
                o[i] = _spread8(t[i], k)


# ====================================================================================== helpers
def _check_k(k: int, hi: int = MAX_BITS) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= hi:
        raise CodecError(f"bit width must be an integer in [1, {hi}], got {k!r}")
    return int(k)


def _check_packed(packed: torch.Tensor, need: int, what: str) -> torch.Tensor:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise CodecError(f"{what}: packed data must be a uint8 tensor, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    packed = packed.reshape(-1)
    if packed.numel() != need:
        raise CodecError(f"{what}: expected {need} packed bytes, got {packed.numel()}")
    return packed.contiguous()


def _torch_pack(v: torch.Tensor, k: int) -> torch.Tensor:
    """Reference/fallback: low ``k`` bits of int64 ``v`` into the stream layout, with torch ops."""
    n = v.numel()
    nbytes = packed_nbytes(n, k)
    shifts = torch.arange(k, device=v.device, dtype=torch.int64)
    bits = ((v.reshape(-1, 1) >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = nbytes * 8 - bits.numel()
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=v.device, dtype=torch.int64))
    return (bits.view(-1, 8).to(torch.int64) * weights).sum(1).to(torch.uint8)


def _torch_unpack(packed: torch.Tensor, n: int, k: int, signed: bool) -> torch.Tensor:
    bits = ((packed.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    bits = bits[: n * k].view(n, k) if n else bits[:0].view(0, k)
    v = (bits << torch.arange(k, device=packed.device, dtype=torch.int64)).sum(1)
    if signed:
        v = torch.where(v >= (1 << (k - 1)), v - (1 << k), v)
    return v


#: tests set this to run the torch-ops path (the one CUDA tensors take) on CPU tensors; so does the
#: library-wide switch ``sparsecomm.kernels.force("torch")`` / ``SPARSECOMM_KERNELS=torch``
_FORCE_TORCH = False


def _numba(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not _FORCE_TORCH and not _kernel_paths.torch_forced()


# ====================================================================================== public API
def pack_bits(codes: torch.Tensor, k: int) -> torch.Tensor:
    """The low ``k`` bits of every integer code, packed (see the module docstring); uint8, exactly
    ``packed_nbytes(codes.numel(), k)`` bytes. Codes outside the ``k``-bit range lose their high bits:
    check the range first (the compressors' codes are in range by construction)."""
    k = _check_k(k)
    if not isinstance(codes, torch.Tensor) or codes.dtype not in _NP_INT:
        raise CodecError(f"pack_bits takes an integer tensor (int8/16/32/64, uint8), got "
                         f"{getattr(codes, 'dtype', type(codes).__name__)}")
    flat = codes.reshape(-1)
    n = flat.numel()
    if not _numba(codes):
        return _torch_pack(flat.to(torch.int64), k)
    flat = flat.contiguous()
    out = np.empty(packed_nbytes(n, k), dtype=np.uint8)
    a = flat.numpy()
    start = 0
    if a.dtype.itemsize == 1 and k <= 7:
        nw = n // 8 if k in (1, 2, 4) else 8 * (n // 64)
        if nw:
            _pack_words(a[: 8 * nw].view(np.uint64), k, out)
        start = 8 * nw
    elif a.dtype.itemsize == 1 and k == 8:
        np.copyto(out, a.view(np.uint8))
        start = n
    if start < n:
        out[start * k // 8:] = 0
        _pack_stream(a, start, k, out, start * k)
    return torch.from_numpy(out)


def unpack_bits(packed: torch.Tensor, n: int, k: int, *, signed: bool = True,
                dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """``n`` codes of ``k`` bits from ``packed`` (exactly ``packed_nbytes(n, k)`` bytes), sign-extended
    (``signed``) or zero-extended, as ``dtype`` (which must hold them)."""
    k = _check_k(k)
    n = int(n)
    if n < 0:
        raise CodecError(f"unpack_bits: n must be >= 0, got {n}")
    if dtype not in _NP_INT:
        raise CodecError(f"unpack_bits: dtype must be an integer dtype, got {dtype}")
    lim = (1 << (k - 1)) - 1 if signed else (1 << k) - 1
    info = torch.iinfo(dtype)
    if lim > info.max or (signed and info.min == 0):
        raise CodecError(f"unpack_bits: {k}-bit {'signed' if signed else 'unsigned'} codes do not fit {dtype}")
    packed = _check_packed(packed, packed_nbytes(n, k), "unpack_bits")
    if not _numba(packed):
        return _torch_unpack(packed, n, k, signed).to(dtype)
    out = np.empty(n, dtype=_NP_INT[dtype])
    p = packed.numpy()
    start = 0
    if out.dtype.itemsize == 1 and k in (1, 2, 4):
        _unpack_words(p, k, signed, out)
        start = 8 * (n // 8)
    elif out.dtype.itemsize == 1 and k < 8:
        nblk = n // 64
        _unpack_mid(p[: 8 * k * nblk].view(np.uint64), k, signed, out[: 64 * nblk].view(np.uint64))
        start = 64 * nblk
    elif out.dtype.itemsize == 1 and k == 8:
        np.copyto(out.view(np.uint8), p)
        start = n
    if start < n:
        _unpack_stream(p, start, k, signed, out)
    return torch.from_numpy(out)


def pack_signs(codes: torch.Tensor) -> torch.Tensor:
    """One bit per entry, set where the entry is negative (int8 codes, or a float tensor's sign bit);
    ``ceil(n / 8)`` bytes."""
    if not isinstance(codes, torch.Tensor):
        raise CodecError(f"pack_signs takes a tensor, got {type(codes).__name__}")
    flat = codes.reshape(-1)
    n = flat.numel()
    if flat.dtype.is_floating_point:
        flat = torch.signbit(flat).to(torch.int8).neg_()   # -1 where the sign bit is set
    elif flat.dtype not in _NP_INT or flat.dtype == torch.uint8:
        raise CodecError(f"pack_signs takes signed integer or float tensors, got {flat.dtype}")
    if not _numba(flat):
        return _torch_pack((flat < 0).to(torch.int64), 1)
    flat = flat.contiguous()
    a = flat.numpy()
    out = np.empty(packed_nbytes(n, 1), dtype=np.uint8)
    start = 0
    if a.dtype.itemsize == 1:
        nw = n // 8
        if nw:
            _sign_words(a[: 8 * nw].view(np.uint64), out)
        start = 8 * nw
    if start < n:
        out[start // 8:] = 0
        _pack_stream((a[start:] < 0).astype(np.uint8), 0, 1, out, start)
    return torch.from_numpy(out)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int8 ``{-1, +1}`` from :func:`pack_signs` output (``-1`` where the bit is set)."""
    n = int(n)
    if n < 0:
        raise CodecError(f"unpack_signs: n must be >= 0, got {n}")
    packed = _check_packed(packed, packed_nbytes(n, 1), "unpack_signs")
    if not _numba(packed):
        return (1 - 2 * _torch_unpack(packed, n, 1, False)).to(torch.int8)
    out = np.empty(n, dtype=np.int8)
    p = packed.numpy()
    _unpack_signs_words(p, out)
    start = 8 * (n // 8)
    if start < n:
        tail = np.empty(n - start, dtype=np.int8)
        _unpack_stream(p[start // 8:], 0, 1, False, tail)
        out[start:] = 1 - 2 * tail
    return torch.from_numpy(out)


# ----------------------------------------------------------------------------- natural compression
#: value dtype -> bits per entry of its natural (sign + exponent) encoding
NATURAL_BITS = {torch.float32: 9, torch.bfloat16: 9, torch.float16: 7, torch.float64: 12}


def natural_nbytes(n: int, dtype: torch.dtype) -> int:
    """Bytes of ``n`` natural-compressed values of ``dtype`` on the wire."""
    if dtype in (torch.float32, torch.bfloat16):
        return int(n) + packed_nbytes(n, 1)
    return packed_nbytes(n, NATURAL_BITS[dtype])


def _check_natural_dtype(dtype: torch.dtype) -> None:
    if dtype not in NATURAL_BITS:
        raise CodecError(f"natural encoding takes float16/bfloat16/float32/float64 values, got {dtype}")


def pack_natural(values: torch.Tensor) -> torch.Tensor:
    """Sign + exponent of values that are zeros or signed powers of two (natural compression's output),
    exactly ``natural_nbytes(n, values.dtype)`` bytes. A value with a non-zero significand (not a
    power of two, or a float32 subnormal) raises :class:`CodecError`: it would not come back."""
    _check_natural_dtype(values.dtype)
    flat = values.reshape(-1)
    n = flat.numel()
    if flat.dtype in (torch.float32, torch.bfloat16):
        b = flat.to(torch.float32).contiguous().view(torch.int32)
        if _numba(b):
            out = np.empty(natural_nbytes(n, flat.dtype), dtype=np.uint8)
            if _natural32_pack(b.numpy(), out):
                _not_natural()
            return torch.from_numpy(out)
        if n and bool((b & 0x7FFFFF).any()):
            _not_natural()
        return torch.cat([((b >> 23) & 0xFF).to(torch.uint8), _torch_pack((b < 0).to(torch.int64), 1)])
    if flat.dtype == torch.float16:
        b = flat.to(torch.float32).view(torch.int32)
        if n and bool((b & 0x7FFFFF).any()):
            _not_natural()
        e = (b >> 23) & 0xFF
        idx = torch.where(e == 0, torch.zeros_like(e), e - 102)      # 2^-24 -> 1 .. 2^15 -> 40
        code = ((b < 0).to(torch.int32) << 6) | idx
        return pack_bits(code.to(torch.int8), 7)
    b = flat.contiguous().view(torch.int64)
    if n and bool((b & ((1 << 52) - 1)).any()):
        _not_natural()
    return pack_bits(((b >> 52) & 0xFFF).to(torch.int16), 12)


def _not_natural() -> None:
    raise CodecError("pack_natural: a value is not zero or a signed power of two (a non-zero "
                     "significand); only natural compression's output travels as sign + exponent")


def unpack_natural(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n`` values of ``dtype`` that :func:`pack_natural` encoded (bit-exact for its inputs)."""
    _check_natural_dtype(dtype)
    n = int(n)
    packed = _check_packed(packed, natural_nbytes(n, dtype), "unpack_natural")
    if dtype in (torch.float32, torch.bfloat16):
        if _numba(packed):
            out = np.empty(n, dtype=np.int32)
            _natural32_unpack(packed.numpy(), out)
            f = torch.from_numpy(out).view(torch.float32)
        else:
            e = packed[:n].to(torch.int32)
            s = _torch_unpack(packed[n:], n, 1, False).to(torch.int32)
            f = ((e << 23) | (s << 31)).view(torch.float32)
        return f if dtype == torch.float32 else f.to(dtype)
    if dtype == torch.float16:
        code = unpack_bits(packed, n, 7, signed=False, dtype=torch.int16).to(torch.int32)
        idx = code & 63
        e = torch.where(idx == 0, torch.zeros_like(idx), idx + 102)
        b = ((code >> 6) << 31) | (e << 23)
        return b.view(torch.float32).to(torch.float16)
    code = unpack_bits(packed, n, 12, signed=False, dtype=torch.int16).to(torch.int64)
    return (code << 52).view(torch.float64)
