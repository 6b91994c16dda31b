"""Dense operators: ``identity`` and the rounding casts ``fp16`` / ``bf16``.

All three produce ``dense`` payloads. ``identity`` copies the input (a payload never aliases it).
``fp16``/``bf16`` round to nearest into the narrow dtype: biased, deterministic, and contractive with
``delta = theory.compressors.rounding_delta(p)`` (p = 11 / 8 significand bits) on inputs in the narrow
dtype's normal range; values that would overflow it raise :class:`~sparsecomm.errors.SumOverflowError`
(``OverflowError_``), a NaN or Inf :class:`~sparsecomm.errors.NonFiniteError`.

**Below the normal range** (|x| < 2^-14 for float16, < 2^-126 for bfloat16) rounding is absolute, not
relative (half the subnormal spacing, down to flushing to zero), so the contraction can fail: a
vector of entries around 1e-9 comes back as zeros, ||C(x) - x||^2 = ||x||^2. So the contract of a cast
depends on ``underflow``. ``compress`` finds an *underflow* when ``||C(x) - x||^2 > (1 - delta) ||x||^2``
with both sums in float64 (a vector with a few tiny entries among normal ones has none: its normal
entries' rounding error is far below the bound). On the CPU's float32 path the cast's own pass sums in
float32 with a proven error bound and decides from it where it can (nearly always), so the float64 sums
run only where it cannot, and the decision is theirs in every case; then

- ``"count"`` (default): it returns the rounded values anyway, as a float16 cast (torch's fp16 DDP hook)
  does, and marks the payload (``meta["underflow"]``), which the pipeline counts
  (``compression_stats()["underflow_rounds"]``): ``delta()`` holds on every call that counts none;
- ``"raise"`` (strict): it raises :class:`UnderflowError`, so ``delta()`` holds on every call that
  returns;
- ``"allow"``: anything finite is compressed and ``delta = 0`` is declared (no contraction is
  promised, only ``|C(x)_i - x_i| <= |x_i|``).
"""

from __future__ import annotations

import math

import torch

from sparsecomm.theory import compressors as th

import numpy as np
from numba import carray, njit

from ..errors import OverflowError_
from ..kernels import torch_forced
from ..payload import Payload
from . import _kernels
from ._common import (CompressorConfigError, abs_max, cpu_empty, dtype_bits, flat_input, make_payload,
                      raise_nonfinite, use_numba)
from .base import Compressor
from ..errors import UnderflowError  # noqa: F401 (re-exported)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _cast_error(x, ybits, is_bf16):
    """(sum (y_i - x_i)^2, sum x_i^2, special) in float64, y given by its float16 / bfloat16 bit
    patterns (int16); ``special`` counts the y that are Inf or NaN (an input that was not finite, or
    overflowed the narrow dtype: the caller then finds out which). Chunks of 4096: the bit patterns
    become float32 patterns in an integer pass (bfloat16: ``<< 16``; float16: magnitude ``<< 13`` then
    times 2^112, exact for normals and subnormals), then a pass accumulates in float64 (reassociated,
    so it vectorises; the sums serve a comparison)."""
    C = 4096
    tmp = np.empty(C, dtype=np.int32)
    tf = tmp.view(np.float32)
    err = 0.0
    nrm = 0.0
    special = 0
    n = x.size
    scale = np.float32(1.0) if is_bf16 else np.float32(2.0 ** 112)
    for s in range(0, n, C):
        m = min(C, n - s)
        yb = ybits[s: s + m]
        t = tmp[:m]
        if is_bf16:
            for i in range(m):
                h = np.int32(yb[i])
                special += (h & 0x7F80) == 0x7F80
                t[i] = h << 16
        else:
            for i in range(m):
                h = np.int32(yb[i])
                special += (h & 0x7C00) == 0x7C00
                t[i] = ((h & 0x7FFF) << 13) | ((h & 0x8000) << 16)
        xs = x[s: s + m]
        v = tf[:m]
        for i in range(m):
            xi = np.float64(xs[i])
            d = np.float64(v[i] * scale) - xi
            err += d * d
            nrm += xi * xi
    return err, nrm, special


_I = np.int32
_FM = {"reassoc", "contract", "nsz"}


@njit(cache=True, nogil=True, fastmath=_FM)
def _cast_f16(x, ybits):
    """Round float32 ``x`` to float16 (nearest, ties to even) in hardware (:func:`._kernels.f16_bits`, where
    ``_kernels.NATIVE_HALF``), writing the bit patterns into ``ybits`` (int16): torch's CPU cast bit for
    bit; returns ``(sum (y_i - x_i)^2, sum x_i^2)`` in float64 from the same pass. ``y_i - x_i`` is exact
    in float32 (the error of rounding a float32 to fewer bits), and Inf or NaN where ``x_i`` is Inf or NaN
    or overflows the narrow dtype, so the first sum is finite iff every ``y_i`` is (the caller then finds
    out which check failed); reassociated, the sums serve a comparison."""
    err = 0.0
    nrm = 0.0
    for i in range(x.size):
        xv = x[i]
        h = _kernels.f16_bits(xv)
        ybits[i] = h
        d = np.float64(_kernels.f16_value(h) - xv)
        err += d * d
        nrm += np.float64(xv) * np.float64(xv)
    return err, nrm


@njit(cache=True, nogil=True, fastmath=_FM)
def _cast_bf16(x, ybits):
    """:func:`_cast_f16` for bfloat16, on the float32 pattern w (int32, wrapping; Numba's default int64
    would halve the vector width): ``(w + 0x7FFF + bit16(w)) >> 16`` (round to nearest, ties to even; a
    carry steps the exponent, up to Inf), a NaN as 0xFFFF: torch's vectorised CPU cast bit for bit."""
    err = 0.0
    nrm = 0.0
    xi = x.view(np.int32)
    for i in range(x.size):
        w = xi[i]
        r = _I(w + _I(_I(0x7FFF) + _I(_I(w >> _I(16)) & _I(1))))
        nan = _I(w & _I(0x7FFFFFFF)) > _I(0x7F800000)
        ybits[i] = _I(-1) if nan else _I(r >> _I(16))
        xv = x[i]
        y = np.float32(np.nan) if nan else _I(r & _I(-0x10000)).view(np.float32)
        d = np.float64(y - xv)
        err += d * d
        nrm += np.float64(xv) * np.float64(xv)
    return err, nrm


#: the chunk of :func:`_quick_f16` / :func:`_quick_bf16` (float32 partial sums of at most this many terms)
_CHUNK = 4096


@njit(cache=True, nogil=True, fastmath=_FM)
def _quick_f16(x, ybits, zero):
    """:func:`_cast_f16`'s cast, bit for bit, with its two sums accumulated in float32 per chunk of
    :data:`_CHUNK` elements (the chunks' sums added in float64): the same terms (``y_i - x_i`` exact in float32),
    a bound on them only, twice the vector width; :func:`_verdict` reads it.

    ``zero`` is 0, passed at run time and XORed into the stored patterns: where the stored value is the
    conversion itself, LLVM's x86 back end folds the store into a second ``vcvtps2ph`` to memory beside the
    one the error term reads (two of the pass's most expensive instructions where one does); an operand it
    cannot see through keeps one conversion and a plain store."""
    err = 0.0
    nrm = 0.0
    n = x.size
    z = np.int16(zero)
    for s in range(0, n, _CHUNK):
        xs = x[s: s + _CHUNK]
        ys = ybits[s: s + _CHUNK]
        e = np.float32(0.0)
        q = np.float32(0.0)
        for i in range(xs.size):
            xv = xs[i]
            h = _kernels.f16_bits(xv)
            ys[i] = h ^ z
            d = _kernels.f16_value(h) - xv
            e += d * d
            q += xv * xv
        err += np.float64(e)
        nrm += np.float64(q)
    return err, nrm


@njit(cache=True, nogil=True, fastmath=_FM)
def _quick_bf16(x, ybits):
    """:func:`_quick_f16` for bfloat16: :func:`_cast_bf16`'s rounding, its sums in float32 per chunk; the pattern
    written for a NaN is the rounding's, not torch's 0xFFFF (no select): a NaN ``x_i`` makes ``y_i - x_i`` NaN,
    so the first sum is NaN, and the caller then runs :func:`_cast_bf16`, which writes every pattern (torch's
    NaN among them) before the check raises; every other pattern, Inf and an overflow to Inf included, is
    torch's. ``x`` is read once, as integers (its float32 value a bit cast of the same load)."""
    err = 0.0
    nrm = 0.0
    xi = x.view(np.int32)
    n = x.size
    for s in range(0, n, _CHUNK):
        ws = xi[s: s + _CHUNK]
        ys = ybits[s: s + _CHUNK]
        e = np.float32(0.0)
        q = np.float32(0.0)
        for i in range(ws.size):
            w = ws[i]
            r = _I(w + _I(_I(0x7FFF) + _I(_I(w >> _I(16)) & _I(1))))
            ys[i] = _I(r >> _I(16))
            xv = _I(w).view(np.float32)
            d = _I(r & _I(-0x10000)).view(np.float32) - xv     # (NaN where x is NaN, Inf - Inf where x is Inf)
            e += d * d
            q += xv * xv
        err += np.float64(e)
        nrm += np.float64(q)
    return err, nrm


@njit(cache=True, nogil=True)
def _quick_f16_at(addr, yaddr, n, zero):
    """:func:`_quick_f16` of the ``n`` float32 at ``addr`` into the ``n`` 16-bit patterns at ``yaddr`` (tensors'
    ``data_ptr()``: no ``Tensor.numpy()`` call and no array argument to type, see :func:`._kernels.f32_at`);
    ``zero``: 0, as there."""
    return _quick_f16(carray(_kernels.f32_at(addr), n), carray(_kernels.i16_at(yaddr), n), zero)


@njit(cache=True, nogil=True)
def _quick_bf16_at(addr, yaddr, n):
    """:func:`_quick_bf16` of the ``n`` float32 at ``addr`` into the ``n`` patterns at ``yaddr`` (see
    :func:`_quick_f16_at`)."""
    return _quick_bf16(carray(_kernels.f32_at(addr), n), carray(_kernels.i16_at(yaddr), n))


def _verdict(e: float, q: float, n: int, bound: float) -> bool | None:
    """``err > bound * nrm`` for the float64 sums ``err``, ``nrm`` that :func:`_cast_f16` / :func:`_cast_bf16`
    return, where :func:`_quick_f16` / :func:`_quick_bf16`'s ``e``, ``q`` for the same ``n`` elements decide it;
    ``None`` where they do not.

    Their terms are the same non-negative numbers ``(y_i - x_i)^2`` and ``x_i^2``, exact in float64.
    A float32 sum of ``m <= 4096`` of them, in any order, is within ``gamma_m < 2^-11.9`` relatively, plus
    ``2^-126`` absolutely per operation where a result leaves float32's normal range (a flush to zero
    included); the float64 sums of ``n < 2^31`` terms within ``n * 2^-53 < 2^-22``. So the exact ``err`` lies
    in ``(e -+ n 2^-124)(1 -+ 2^-10)``, the exact ``nrm`` in ``(q -+ n 2^-124)(1 -+ 2^-10)``, and the float64
    comparison is False when ``err``'s upper end times ``1 + 2^-20`` is at most ``bound`` times ``nrm``'s
    lower end times ``1 - 2^-20``, True when its lower end times ``1 - 2^-20`` exceeds ``bound`` times
    ``nrm``'s upper end times ``1 + 2^-20`` (the float64 roundings here included). A rounding cast's error
    is about a third of the bound on typical data, so this decides nearly every call; a call it leaves
    undecided (within about 2^-9 of the bound, or beyond float32's range) is run through the float64 sums."""
    if not (n < 2 ** 31 and math.isfinite(e) and math.isfinite(q)):
        return None
    slack = n * 2.0 ** -124
    if (e + slack) * (1.0 + 2.0 ** -10) * (1.0 + 2.0 ** -20) <= bound * (q - slack) * (1.0 - 2.0 ** -10) * (1.0 - 2.0 ** -20):
        return False
    if (e - slack) * (1.0 - 2.0 ** -10) * (1.0 - 2.0 ** -20) > bound * (q + slack) * (1.0 + 2.0 ** -10) * (1.0 + 2.0 ** -20):
        return True
    return None


class _Dense(Compressor):
    payload_kind = "dense"
    elementwise = True
    checks_finite = True

    def values_len(self, d: int) -> int:
        """Number of values in a payload of a length-d input (used by ``compose``)."""
        return d


class Identity(_Dense):
    """C(x) = x. omega = 0, delta = 1; 32 bits per float32 entry (the input dtype's width)."""

    name = "identity"
    unbiased = True

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        if use_numba(flat) and flat.dtype in (torch.float32, torch.float64):
            out = cpu_empty(flat.numel(), flat.dtype)
            ok = _kernels.copy_finite(flat.numpy(), out.numpy())
        else:
            out = flat.clone()
            ok = bool(torch.isfinite(flat).all())
        if not ok:
            raise_nonfinite(self.name)
        return make_payload("dense", x.shape, x.dtype, out,
                            {"values": th.dense_bits(flat.numel(), dtype_bits(x.dtype))})

    def omega(self, d):
        return th.identity_omega()

    def delta(self, d):
        return 1.0

    def bits(self, d, dtype=torch.float32):
        return th.dense_bits(d, dtype_bits(dtype))


class _Cast(_Dense):
    target: torch.dtype = torch.float16
    precision_bits: int = 11

    def __init__(self, underflow: str = "count"):
        if underflow not in ("count", "raise", "allow"):
            raise CompressorConfigError(f"{self.name}: underflow must be 'count' (an underflow is counted in "
                                        f"the statistics), 'raise' (delta holds on every call, or an "
                                        f"UnderflowError) or 'allow' (delta = 0), got {underflow!r}")
        self.underflow = underflow
        #: 1 - delta, the contraction check's bound (delta does not depend on d), asked once here
        self._bound = 1.0 - self.delta(0)

    #: whether the fused Numba cast runs for a float32 CPU input (float16: where the CPU converts in hardware)
    _fused: bool = True
    #: ``target == torch.bfloat16``, answered once per class (a dtype comparison per call otherwise)
    _bf16: bool = False

    def hyper(self):
        return {"underflow": self.underflow}

    def _contraction_error(self, flat: torch.Tensor, y: torch.Tensor) -> tuple[float, float, bool]:
        """(||C(x) - x||^2, ||x||^2, whether some y is Inf or NaN) in float64: one pass on the CPU."""
        if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
            err, nrm, special = _cast_error(flat.numpy(), y.view(torch.int16).numpy(),
                                            self.target == torch.bfloat16)
            return err, nrm, bool(special)
        xd = flat.to(torch.float64)
        return (float(((y.to(torch.float64) - xd) ** 2).sum()), float((xd * xd).sum()),
                not bool(torch.isfinite(y).all()))

    def _check_range(self, flat: torch.Tensor, y: torch.Tensor) -> None:
        """NonFiniteError for a non-finite input, OverflowError_ for one beyond the narrow dtype."""
        big = abs_max(flat)
        if not math.isfinite(big):
            raise_nonfinite(self.name)
        if big > torch.finfo(self.target).max and bool(torch.isinf(y).any()):
            raise OverflowError_(f"{self.name}: |x| up to {big:g} overflows {self.target} "
                                 f"(max {torch.finfo(self.target).max:g}); rescale the input first")

    def compress(self, x, generator=None):
        if type(x) is torch.Tensor and x.dtype == torch.float32 and x.ndim == 1 and self._fused and x.is_cpu \
                and not x.requires_grad and x.is_contiguous() and not torch_forced():
            flat, fused = x, True      # (flat_input's and use_numba's answers here, without their calls)
        else:
            flat = flat_input(x, self.name)
            fused = self._fused and flat.dtype == torch.float32 and use_numba(flat)
        bf = self._bf16
        n = flat.numel()
        checked = self.underflow != "allow" and flat.dtype != self.target and n
        bound = self._bound
        under = False
        if fused:   # the cast and every check in one pass; the float64 sums where it leaves them undecided
            # (numpy's memory, see cpu_empty; float16 wrapped as it is, no view: a microsecond of a small cast)
            y = torch.from_numpy(np.empty(n, dtype=np.int16)).view(torch.bfloat16) if bf \
                else torch.from_numpy(np.empty(n, dtype=np.float16))
            # (flat and y: alive, contiguous, n elements each)
            e, q = _quick_bf16_at(flat.data_ptr(), y.data_ptr(), n) if bf \
                else _quick_f16_at(flat.data_ptr(), y.data_ptr(), n, 0)
            # e finite: every y is finite; then the float64 sums' decision where the float32 ones settle it
            verdict = (_verdict(e, q, n, bound) if checked else False) if math.isfinite(e) else None
            if verdict is None or (verdict and self.underflow == "raise"):      # ("raise": the exact ratio)
                err, nrm = (_cast_bf16 if bf else _cast_f16)(flat.numpy(), y.view(torch.int16).numpy())
                if not math.isfinite(err):    # a non-finite or overflowing input makes err non-finite
                    self._check_range(flat, y)
                under = bool(checked) and err > bound * nrm
            elif not verdict:       # (the common case: a payload built without make_payload's generic steps,
                #                     positional: keywords cost a third of the constructor's call)
                return Payload("dense", y, x.shape, x.dtype, None, None, None, False, 16 * n,
                               {"wire_bits": {"values": 16 * n}})
            else:
                under = True
        else:
            y = (cpu_empty(flat.numel(), self.target).copy_(flat) if flat.device.type == "cpu"
                 else flat.to(self.target, copy=True))
            if not checked:
                self._check_range(flat, y)
            else:       # the contraction check's pass also finds a non-finite or overflowing input
                err, nrm, special = self._contraction_error(flat, y)
                if special or not math.isfinite(err):
                    self._check_range(flat, y)
                under = err > bound * nrm
        if under and self.underflow == "raise":
            tiny = torch.finfo(self.target).tiny
            raise UnderflowError(
                f"{self.name}: this input lies below {self.target}'s normal range (|x| < {tiny:g}) on "
                f"enough of its mass that rounding loses {err / nrm if nrm else 1.0:.3g} of ||x||^2, more "
                f"than the declared 1 - delta = {1.0 - self.delta(flat.numel()):.3g}; rescale it (e.g. "
                f"loss scaling), use 'bf16' (float32's range) or 'identity', or build "
                f"{self.name}(underflow='allow'), which declares delta = 0")
        if under:
            return make_payload("dense", x.shape, x.dtype, y, {"values": 16 * n}, underflow=True)
        return make_payload("dense", x.shape, x.dtype, y, {"values": 16 * n})

    def decompress(self, payload):
        """As :meth:`Compressor.decompress`, bit for bit; a flat float32 CPU payload of this cast's values (the
        DDP buckets' and the benchmarks' case) goes straight to the widening pass (:func:`._kernels.widen_f16`,
        :func:`._kernels.widen_bf16`) into a numpy-allocated buffer, without the generic dispatch's calls."""
        v = payload.values
        if payload.dtype == torch.float32 and v.dtype == self.target and payload.kind == "dense" and v.ndim == 1 \
                and self._fused and v.is_cpu and v.is_contiguous() and not torch_forced():
            shape = payload.shape
            n = v.shape[0]
            if n and len(shape) == 1 and shape[0] == n:
                out = np.empty(n, dtype=np.float32)
                (_kernels.widen_bf16_at if self.target == torch.bfloat16 else _kernels.widen_f16_at)(v.data_ptr(), out)
                return torch.from_numpy(out)
        return super().decompress(payload)

    def delta(self, d):
        """1 - (2^-p + 2^-23)^2 (see rounding_delta), checked on every call (``underflow="raise"``: an
        UnderflowError where it fails; ``"count"``: the call is counted); 0 with ``underflow="allow"``, which
        promises no contraction."""
        if self.underflow == "allow":
            return 0.0
        return th.rounding_delta(self.precision_bits)

    def bits(self, d, dtype=torch.float32):
        return th.dense_bits(d, 16)


class FP16(_Cast):
    """Round to nearest float16 (normal range 2^-14 .. 65504, 11 significand bits); 16 bits/entry."""

    name = "fp16"
    target = torch.float16
    precision_bits = 11
    _fused = _kernels.NATIVE_HALF


class BF16(_Cast):
    """Round to nearest bfloat16 (float32's exponent range, 8 significand bits); 16 bits/entry."""

    name = "bf16"
    target = torch.bfloat16
    precision_bits = 8
    _bf16 = True
