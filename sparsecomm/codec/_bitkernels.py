"""Numba kernels of :mod:`sparsecomm.codec.bits` (``@njit(cache=True, nogil=True)``; no Python per element).

Three shapes of loop, chosen by the code width ``k`` (the layouts are defined in ``bits``):

* **words** (k = 1, 2, 4 from int8): eight codes are read as one 64-bit word and their low k bits
  gathered by a three-step shift-or tree (pairs of bytes into 16-bit lanes, then 32, then 64); one
  8/16/32-bit store per word. Unpacking spreads the bits back by the reverse tree and sign-extends the
  eight bytes at once (SWAR). LLVM vectorises both loops.
* **lanes** (k = 3, 5, 6, 7 from int8 codes, W = 8; k = 9..15 from int16 codes, W = 16): blocks of
  :data:`BLOCK_CODES` codes; the block's W rows of :data:`ROW_WORDS` 64-bit words are combined lane by
  lane (a lane = one W-bit field of a word): row ``i``'s codes go to bit ``k i`` of the lane's k-word
  output column, i.e. output row ``k i // W`` shifted left by ``k i % W`` (and the part that overflows
  the lane into the next output row, shifted right by ``W - k i % W``). Every inner loop runs over the
  contiguous words of one row with loop-invariant shifts and masks: plain 64-bit SWAR that LLVM turns
  into AVX2/AVX-512 code. No field ever crosses a lane, so no carry moves between words.
* **stream** (any k, any integer dtype; the tails): a 64-bit bit accumulator.

Natural compression of float32 (sign + exponent) has its own 8-values-per-step pair.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: codes per block of the lane layout, and 64-bit words per row of a block (``BLOCK_CODES = 64 ROW_WORDS``)
BLOCK_CODES = 4096
ROW_WORDS = 64

_B8 = 0x0101010101010101    # one in every byte
_B16 = 0x0001000100010001   # one in every 16-bit lane


# ------------------------------------------------------------------------------------------ words
@njit(cache=True, nogil=True)
def _gather8(w, k):
    """The low k bits of the 8 bytes of ``w`` (k = 1, 2, 4), gathered into its low 8k bits."""
    a1 = np.uint64((1 << k) - 1) * np.uint64(_B16)
    a2 = np.uint64((1 << (2 * k)) - 1) * np.uint64(0x0000000100000001)
    a3 = np.uint64((1 << (4 * k)) - 1)
    w = w & (np.uint64((1 << k) - 1) * np.uint64(_B8))
    w = (w & a1) | ((w >> np.uint64(8 - k)) & (a1 << np.uint64(k)))
    w = (w & a2) | ((w >> np.uint64(16 - 2 * k)) & (a2 << np.uint64(2 * k)))
    w = (w & a3) | ((w >> np.uint64(32 - 4 * k)) & (a3 << np.uint64(4 * k)))
    return w


@njit(cache=True, nogil=True)
def _spread8(v, k):
    """Inverse of ``_gather8``: the 8 k-bit fields of ``v``'s low 8k bits, one per byte."""
    a1 = np.uint64((1 << k) - 1) * np.uint64(_B16)
    a2 = np.uint64((1 << (2 * k)) - 1) * np.uint64(0x0000000100000001)
    a3 = np.uint64((1 << (4 * k)) - 1)
    v = (v & a3) | ((v << np.uint64(32 - 4 * k)) & (a3 << np.uint64(32)))
    v = (v & a2) | ((v << np.uint64(16 - 2 * k)) & (a2 << np.uint64(16)))
    v = (v & a1) | ((v << np.uint64(8 - k)) & (a1 << np.uint64(8)))
    return v


@njit(cache=True, nogil=True)
def _sext_consts(k, lane):
    """(top, neg, hi) of ``_sext`` for k-bit fields in ``lane``-bit lanes."""
    rep = np.uint64(_B8) if lane == 8 else np.uint64(_B16)
    return (rep * np.uint64(1 << (k - 1)), rep * np.uint64((1 << lane) - (1 << (k - 1))),
            rep << np.uint64(lane - 1))


@njit(cache=True, nogil=True)
def _sext(v, top, neg, hi):
    """Sign-extend the k-bit field in every lane of ``v``: ``(v ^ top) - top`` per lane (``top`` = the
    field's sign bit in every lane), the subtraction done as the addition of ``neg`` = ``2^W - top``
    with the carries out of each lane's top bit (``hi``) masked off."""
    t = v ^ top
    return ((t & ~hi) + (neg & ~hi)) ^ ((t ^ neg) & hi)


@njit(cache=True, nogil=True)
def pack_words(words, k, out):
    """``words``: uint64 view of int8 codes (8 per word); ``out``: uint8, ``k`` bytes per word (k = 1, 2, 4)."""
    nw = words.size
    if k == 1:
        for g in range(nw):
            out[g] = np.uint8(_gather8(words[g], 1) & np.uint64(0xFF))
    elif k == 2:
        o16 = out[: 2 * nw].view(np.uint16)
        for g in range(nw):
            o16[g] = np.uint16(_gather8(words[g], 2) & np.uint64(0xFFFF))
    else:
        o32 = out[: 4 * nw].view(np.uint32)
        for g in range(nw):
            o32[g] = np.uint32(_gather8(words[g], 4) & np.uint64(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def sign_words(words, out):
    """One bit per int8 code of ``words`` (uint64 view): the code's sign bit."""
    for g in range(words.size):
        out[g] = np.uint8(_gather8(words[g] >> np.uint64(7), 1) & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def unpack_words(packed, k, signed, out):
    """Inverse of ``pack_words`` into int8 ``out`` (its whole 8-code words; k = 1, 2, 4)."""
    nw = out.size // 8
    o64 = out[: 8 * nw].view(np.uint64)
    top, neg, hi = _sext_consts(k, 8)
    for g in range(nw):
        if k == 1:
            v = np.uint64(packed[g])
        elif k == 2:
            v = np.uint64(packed[2 * g]) | (np.uint64(packed[2 * g + 1]) << np.uint64(8))
        else:
            b = 4 * g
            v = (np.uint64(packed[b]) | (np.uint64(packed[b + 1]) << np.uint64(8)) |
                 (np.uint64(packed[b + 2]) << np.uint64(16)) | (np.uint64(packed[b + 3]) << np.uint64(24)))
        v = _spread8(v, k)
        o64[g] = _sext(v, top, neg, hi) if signed else v


@njit(cache=True, nogil=True)
def unpack_signs_words(packed, out):
    """int8 ``{+1, -1}`` (bit clear / set) for the whole 8-code words of ``out``."""
    nw = out.size // 8
    o64 = out[: 8 * nw].view(np.uint64)
    ones = np.uint64(_B8)
    for g in range(nw):
        v = _spread8(np.uint64(packed[g]), 1)
        o64[g] = ones + v * np.uint64(0xFE)    # per byte 0x01 + b 0xFE: +1 or -1, no carries


# ------------------------------------------------------------------------------------------ lanes
@njit(cache=True, nogil=True)
def pack_lanes(words, k, lane, out):
    """Whole blocks of ``words`` (uint64 view of int8 codes for ``lane`` = 8, int16 for 16; a multiple
    of ``lane * ROW_WORDS`` words) into ``out`` (uint64, ``k * ROW_WORDS`` words per block)."""
    L = ROW_WORDS
    rep = np.uint64(_B8) if lane == 8 else np.uint64(_B16)
    full = (1 << lane) - 1
    cm = (1 << k) - 1
    for blk in range(words.size // (lane * L)):
        ib = blk * lane * L
        ob = blk * k * L
        for i in range(lane):
            j = (k * i) // lane
            s = (k * i) % lane
            src = words[ib + i * L: ib + i * L + L]
            dst = out[ob + j * L: ob + j * L + L]
            m = rep * np.uint64((cm << s) & full)
            sh = np.uint64(s)
            if s == 0:   # the first field of an output row: assign
                for q in range(L):
                    dst[q] = src[q] & m
            else:
                for q in range(L):
                    dst[q] |= (src[q] << sh) & m
            if s + k > lane:   # the rest of the field starts the next output row
                nxt = out[ob + (j + 1) * L: ob + (j + 2) * L]
                m2 = rep * np.uint64(cm >> (lane - s))
                sh2 = np.uint64(lane - s)
                for q in range(L):
                    nxt[q] = (src[q] >> sh2) & m2


@njit(cache=True, nogil=True)
def unpack_lanes(packed, k, lane, signed, out):
    """Inverse of ``pack_lanes``: ``packed`` (uint64, whole blocks) into ``out`` (uint64 view of the
    int8 / int16 codes), sign-extended or zero-extended."""
    L = ROW_WORDS
    rep = np.uint64(_B8) if lane == 8 else np.uint64(_B16)
    top, neg, hi = _sext_consts(k, lane)
    cm = (1 << k) - 1
    for blk in range(out.size // (lane * L)):
        ib = blk * k * L
        ob = blk * lane * L
        for i in range(lane):
            j = (k * i) // lane
            s = (k * i) % lane
            a = packed[ib + j * L: ib + j * L + L]
            o = out[ob + i * L: ob + i * L + L]
            sh = np.uint64(s)
            if s + k > lane:   # the field's low lane - s bits end row j, the rest start row j + 1
                b = packed[ib + (j + 1) * L: ib + (j + 2) * L]
                m = rep * np.uint64((1 << (lane - s)) - 1)
                m2 = rep * np.uint64(cm & ~((1 << (lane - s)) - 1))
                sh2 = np.uint64(lane - s)
                if signed:
                    for q in range(L):
                        o[q] = _sext(((a[q] >> sh) & m) | ((b[q] << sh2) & m2), top, neg, hi)
                else:
                    for q in range(L):
                        o[q] = ((a[q] >> sh) & m) | ((b[q] << sh2) & m2)
            else:
                m = rep * np.uint64(cm)
                if signed:
                    for q in range(L):
                        o[q] = _sext((a[q] >> sh) & m, top, neg, hi)
                else:
                    for q in range(L):
                        o[q] = (a[q] >> sh) & m


# ----------------------------------------------------------------------------------------- stream
@njit(cache=True, nogil=True)
def pack_stream(codes, start, k, out, bit0):
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
def unpack_stream(packed, start, k, signed, out):
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


# ------------------------------------------------------------------------------- natural float32
@njit(cache=True, nogil=True)
def natural32_pack(bits, out):
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
def natural32_unpack(packed, out):
    """Inverse of ``natural32_pack`` (int32 bit patterns out), 8 values per step."""
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
