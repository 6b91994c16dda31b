"""Bit packing of small integer codes for the wire: what a payload's declared ``bits`` count.

``n`` codes of ``k`` bits take exactly ``packed_nbytes(n, k) = ceil(n k / 8)`` bytes, in one of two
layouts fixed by ``k`` (never by the code dtype, so the receiver needs only ``n`` and ``k``):

* **stream** (k = 1, 2, 4, 8, 16; and the tail of the others): code ``i`` occupies bits
  ``[k i, k (i + 1))`` of a little-endian bit stream (bit ``j`` of the stream is bit ``j % 8`` of byte
  ``j // 8``); the last byte is zero-padded.
* **lanes** (k = 3, 5, 6, 7 with lane width W = 8; k = 9..15 with W = 16): the first
  ``4096 floor(n / 4096)`` codes, block by block. A block of 4096 codes is a W x (4096 / W) matrix
  (row ``r`` = codes ``r 4096 / W`` onwards); each of its columns (W codes) is stream-packed into
  ``k W`` bits, i.e. k units of W bits; the block's ``512 k`` bytes are the k x (4096 / W) matrix of
  those units, row-major, each unit little-endian. The remaining ``n mod 4096`` codes follow in the
  stream layout from the next byte. This is the layout 64-bit SWAR code packs at memory speed (see
  :mod:`._bitkernels`): no field crosses a W-bit lane, so whole words are combined with constant
  shifts, where the stream layout needs a data-dependent carry for these widths.

* ``pack_bits(codes, k)`` / ``unpack_bits(packed, n, k)``: the low ``k`` bits (1 <= k <= 16) of
  integer codes, i.e. their ``k``-bit two's complement; unpacking sign-extends (``signed=True``) or
  zero-extends. Codes in ``[-2^(k-1), 2^(k-1) - 1]`` (signed) or ``[0, 2^k)`` round-trip exactly;
  QSGD's codes in ``[-s, s]`` need ``k = 1 + ceil(log2(s + 1))`` (``theory.compressors.qsgd_code_bits``),
  TernGrad's ``{-1, 0, 1}`` need 2.
* ``pack_signs(codes)`` / ``unpack_signs(packed, n)``: one bit per code (stream layout), set when the
  code is negative (the IEEE convention); unpacking gives int8 ``{-1, +1}`` (a zero code comes back as
  ``+1``, the ``sign(0) := +1`` of scaled sign, signSGD and 1-bit SGD). Float tensors: the sign bit.
* ``pack_natural(values)`` / ``unpack_natural(packed, n, dtype)``: signed powers of two (and zeros),
  the values of natural compression (Horvath et al., arXiv 1905.10988), as sign + exponent: float32 /
  bfloat16 values as a byte plane of float32 exponent fields followed by a 1-bit sign plane (9 bits per
  entry, ``n + ceil(n / 8)`` bytes); float16 values as 7-bit codes (sign + 6-bit exponent index,
  ``2^-24 .. 2^15`` and zero); float64 values as 12-bit codes (sign + 11-bit exponent field).

CPU tensors use the Numba kernels of :mod:`._bitkernels`; other devices use the torch ops below (the
same bytes; ``_torch_pack`` / ``_torch_unpack`` are also the tests' statement of the layout).
Speed against ``numpy.copyto`` of the codes: ``experiments/bench/codec.py --bits`` and BENCHMARKS.md.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels as _kernel_paths
from ..errors import CodecError
from . import _bitkernels as K
from ._bitkernels import BLOCK_CODES

__all__ = ["packed_nbytes", "pack_bits", "unpack_bits", "pack_signs", "unpack_signs", "natural_nbytes",
           "pack_natural", "unpack_natural", "MAX_BITS", "NATURAL_BITS", "lane_width", "BLOCK_CODES"]

#: widest code ``pack_bits`` takes
MAX_BITS = 16

_NP_INT = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
           torch.uint8: np.uint8}


def packed_nbytes(n: int, k: int) -> int:
    """Bytes of ``n`` codes of ``k`` bits: ``ceil(n k / 8)``."""
    return (int(n) * int(k) + 7) // 8


def lane_width(k: int) -> int:
    """W of the lane layout of ``k``-bit codes (8 or 16), or 0 where ``k`` uses the stream layout only."""
    if k in (1, 2, 4, 8, 16):
        return 0
    return 8 if k < 8 else 16


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


# ============================================================================ torch path / reference
def _stream_pack(v: torch.Tensor, k: int) -> torch.Tensor:
    """The stream layout of the low ``k`` bits of int64 ``v``, with torch ops."""
    n = v.numel()
    nbytes = packed_nbytes(n, k)
    shifts = torch.arange(k, device=v.device, dtype=torch.int64)
    bits = ((v.reshape(-1, 1) >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = nbytes * 8 - bits.numel()
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=v.device, dtype=torch.int64))
    return (bits.view(-1, 8).to(torch.int64) * weights).sum(1).to(torch.uint8)


def _stream_unpack(packed: torch.Tensor, n: int, k: int, signed: bool) -> torch.Tensor:
    bits = ((packed.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    bits = bits[: n * k].view(n, k) if n else bits[:0].view(0, k)
    v = (bits << torch.arange(k, device=packed.device, dtype=torch.int64)).sum(1)
    if signed:
        v = torch.where(v >= (1 << (k - 1)), v - (1 << k), v)
    return v


def _torch_pack(v: torch.Tensor, k: int) -> torch.Tensor:
    """Both layouts (the module docstring) of int64 codes ``v``, with torch ops."""
    v = v.reshape(-1)
    w = lane_width(k)
    nblk = v.numel() // BLOCK_CODES if w else 0
    if not nblk:
        return _stream_pack(v, k)
    cols = v[: nblk * BLOCK_CODES].view(nblk, w, BLOCK_CODES // w).transpose(1, 2)     # (block, column, row)
    units = _stream_pack(cols.reshape(-1), k).view(nblk, BLOCK_CODES // w, k, w // 8)  # k units per column
    return torch.cat([units.permute(0, 2, 1, 3).reshape(-1), _stream_pack(v[nblk * BLOCK_CODES:], k)])


def _torch_unpack(packed: torch.Tensor, n: int, k: int, signed: bool) -> torch.Tensor:
    """Inverse of :func:`_torch_pack` (int64 codes)."""
    w = lane_width(k)
    nblk = n // BLOCK_CODES if w else 0
    if not nblk:
        return _stream_unpack(packed, n, k, signed)
    head = nblk * BLOCK_CODES * k // 8
    units = packed[:head].view(nblk, k, BLOCK_CODES // w, w // 8).permute(0, 2, 1, 3).reshape(-1)
    cols = _stream_unpack(units, nblk * BLOCK_CODES, k, signed).view(nblk, BLOCK_CODES // w, w)
    tail = _stream_unpack(packed[head:], n - nblk * BLOCK_CODES, k, signed)
    return torch.cat([cols.transpose(1, 2).reshape(-1), tail])


#: tests set this to run the torch-ops path (the one CUDA tensors take) on CPU tensors; so does the
#: library-wide switch ``sparsecomm.kernels.force("torch")`` / ``SPARSECOMM_KERNELS=torch``
_FORCE_TORCH = False


def _numba(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not _FORCE_TORCH and not _kernel_paths.torch_forced()


# ============================================================================================ API
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
    a = flat.contiguous().numpy()
    # the low 8 (16) bits of wider codes: numpy's integer casts wrap, so the low k bits are kept
    if k <= 8 and a.itemsize != 1:
        a = a.astype(np.int8)
    elif 8 < k <= 16 and a.itemsize != 2:
        a = a.astype(np.int16)
    out = np.empty(packed_nbytes(n, k), dtype=np.uint8)
    w = lane_width(k)
    start = 0
    if k in (8, 16):
        np.copyto(out, a.view(np.uint8))
        start = n
    elif w:
        nblk = n // BLOCK_CODES
        if nblk:
            K.pack_lanes(a[: nblk * BLOCK_CODES].view(np.uint64), k, w,
                         out[: nblk * BLOCK_CODES * k // 8].view(np.uint64))
        start = nblk * BLOCK_CODES
    else:   # 1, 2, 4 bits from int8
        nw = n // 8
        if nw:
            K.pack_words(a[: 8 * nw].view(np.uint64), k, out)
        start = 8 * nw
    if start < n:
        out[start * k // 8:] = 0
        K.pack_stream(a, start, k, out, start * k)
    return torch.from_numpy(out)


_NATIVE = {(8, True): np.int8, (8, False): np.uint8, (16, True): np.int16, (16, False): np.uint16}


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
    out = np.empty(n, dtype=_NATIVE[(8 if k <= 8 else 16, signed)])   # the kernels' width, then cast
    p = packed.numpy()
    w = lane_width(k)
    start = 0
    if k in (8, 16):
        np.copyto(out.view(np.uint8), p)
        start = n
    elif w:
        nblk = n // BLOCK_CODES
        if nblk:
            K.unpack_lanes(p[: nblk * BLOCK_CODES * k // 8].view(np.uint64), k, w, signed,
                           out[: nblk * BLOCK_CODES].view(np.uint64))
        start = nblk * BLOCK_CODES
    else:
        K.unpack_words(p, k, signed, out)
        start = 8 * (n // 8)
    if start < n:
        K.unpack_stream(p, start, k, signed, out)
    want = _NP_INT[dtype]
    return torch.from_numpy(out if out.dtype == want else out.astype(want))


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
        return _stream_pack((flat < 0).to(torch.int64), 1)
    a = flat.contiguous().numpy()
    if a.itemsize != 1:
        a = (a < 0).astype(np.int8) * np.int8(-1)
    out = np.empty(packed_nbytes(n, 1), dtype=np.uint8)
    nw = n // 8
    if nw:
        K.sign_words(a[: 8 * nw].view(np.uint64), out)
    if 8 * nw < n:
        out[nw:] = 0
        K.pack_stream((a[8 * nw:] < 0).astype(np.uint8), 0, 1, out, 8 * nw)
    return torch.from_numpy(out)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int8 ``{-1, +1}`` from :func:`pack_signs` output (``-1`` where the bit is set)."""
    n = int(n)
    if n < 0:
        raise CodecError(f"unpack_signs: n must be >= 0, got {n}")
    packed = _check_packed(packed, packed_nbytes(n, 1), "unpack_signs")
    if not _numba(packed):
        return (1 - 2 * _stream_unpack(packed, n, 1, False)).to(torch.int8)
    out = np.empty(n, dtype=np.int8)
    p = packed.numpy()
    K.unpack_signs_words(p, out)
    start = 8 * (n // 8)
    if start < n:
        tail = np.empty(n - start, dtype=np.int8)
        K.unpack_stream(p[start // 8:], 0, 1, False, tail)
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
            if K.natural32_pack(b.numpy(), out):
                _not_natural()
            return torch.from_numpy(out)
        if n and bool((b & 0x7FFFFF).any()):
            _not_natural()
        return torch.cat([((b >> 23) & 0xFF).to(torch.uint8), _stream_pack((b < 0).to(torch.int64), 1)])
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
            K.natural32_unpack(packed.numpy(), out)
            f = torch.from_numpy(out).view(torch.float32)
        else:
            e = packed[:n].to(torch.int32)
            s = _stream_unpack(packed[n:], n, 1, False).to(torch.int32)
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
