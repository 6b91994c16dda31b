"""Dense operators: ``identity`` and the rounding casts ``fp16`` / ``bf16``.

All three produce ``dense`` payloads. ``identity`` copies the input (a payload never aliases it).
``fp16``/``bf16`` round to nearest into the narrow dtype: biased, deterministic, and contractive with
``delta = theory.compressors.rounding_delta(p)`` (p = 11 / 8 significand bits) on inputs in the narrow
dtype's normal range; values that would overflow it raise :class:`~sparsecomm.errors.OverflowError_`.

**Below the normal range** (|x| < 2^-14 for float16, < 2^-126 for bfloat16) rounding is absolute, not
relative (half the subnormal spacing, down to flushing to zero), so the contraction can fail: a
vector of entries around 1e-9 comes back as zeros, ||C(x) - x||^2 = ||x||^2. So ``delta()`` is only
declared for calls where it holds, and every call checks it: ``compress`` measures
``||C(x) - x||^2`` (one Numba pass over x and the rounded values, in float64) and, when it exceeds
``(1 - delta) ||x||^2``, raises :class:`UnderflowError` (``underflow="raise"``, the default; a vector
with a few tiny entries among normal ones passes, as the normal entries' rounding error is far below
its bound). ``underflow="allow"`` compresses anything finite and declares ``delta = 0`` (no
contraction is promised, only ``|C(x)_i - x_i| <= |x_i|``). ``underflow="allow"`` skips the check.

On CPU float32 inputs the cast, max |x| (the finiteness and overflow checks) and the check's two sums
are one Numba pass (``_cast_narrow``: torch's round-to-nearest-even bit for bit, checked on all
2^32 float32 patterns); elsewhere max |x|, torch's cast and ``_cast_error`` are three.
"""

from __future__ import annotations

import math

import torch

from sparsecomm.theory import compressors as th

import numpy as np
from numba import njit

from ..errors import OverflowError_, SparseCommError
from . import _kernels
from ._common import (CompressorConfigError, abs_max, cpu_empty, dtype_bits, flat_input, make_payload,
                      raise_nonfinite, use_numba)
from .base import Compressor
from ..errors import UnderflowError  # noqa: F401 (re-exported)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _cast_error(x, ybits, is_bf16):
    """(sum (y_i - x_i)^2, sum x_i^2) in float64, y given by its float16 / bfloat16 bit patterns
    (int16). Chunks of 4096: the bit patterns become float32 patterns in an integer pass (bfloat16:
    ``<< 16``; float16: magnitude ``<< 13`` then times 2^112, exact for normals and subnormals), then
    a pass accumulates in float64 (reassociated, so it vectorises; the sums serve a comparison)."""
    C = 4096
    tmp = np.empty(C, dtype=np.int32)
    tf = tmp.view(np.float32)
    err = 0.0
    nrm = 0.0
    n = x.size
    scale = np.float32(1.0) if is_bf16 else np.float32(2.0 ** 112)
    for s in range(0, n, C):
        m = min(C, n - s)
        yb = ybits[s: s + m]
        t = tmp[:m]
        if is_bf16:
            for i in range(m):
                t[i] = np.int32(yb[i]) << 16
        else:
            for i in range(m):
                h = np.int32(yb[i])
                t[i] = ((h & 0x7FFF) << 13) | ((h & 0x8000) << 16)
        xs = x[s: s + m]
        v = tf[:m]
        for i in range(m):
            xi = np.float64(xs[i])
            d = np.float64(v[i] * scale) - xi
            err += d * d
            nrm += xi * xi
    return err, nrm


_CAST_CHUNK = 4096


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _cast_narrow(xu, is_bf16, with_error, ybits):
    """float32 (bit patterns ``xu``, uint32) rounded to nearest-even float16 or bfloat16 (bit patterns
    written to ``ybits``, int16) in one pass; returns (max |x| as float32 bits, sum (y - x)^2,
    sum x^2), the two sums in float64 (0.0 unless ``with_error``; meaningless where a value
    overflowed). Bit for bit the IEEE conversion for every finite input (NaN/Inf: max |x| >= 0x7F800000
    says so, the output is then not defined):

    - bfloat16: the top 16 bits after adding 0x7FFF plus the lowest kept bit (ties to even; a carry
      into the exponent rounds up to the next binade or to infinity);
    - float16, |x| >= 2^-14: the exponent rebiased (-112) and the 13 dropped significand bits rounded
      the same way (0xFFF plus the lowest kept bit), |x| >= 65536 set to infinity (65520 <= |x| carries
      there by itself); |x| < 2^-14: the subnormal code rint(|x| 2^24), exact in float32 and rounded to
      even by rint (1024 is the smallest normal's code).

    Chunks of 4096: an integer pass computes the codes and the float32 patterns of their values (the
    float16 one divided by 2^112, as in ``_cast_error``), then a float pass sums the errors."""
    n = xu.size
    tmp = np.empty(_CAST_CHUNK, dtype=np.int32)
    tf = tmp.view(np.float32)
    xf = xu.view(np.float32)
    scale = np.float32(1.0) if is_bf16 else np.float32(2.0 ** 112)
    two24 = np.float32(16777216.0)
    small = np.float32(2.0 ** -14)
    top = np.int64(0)
    err = 0.0
    nrm = 0.0
    for s in range(0, n, _CAST_CHUNK):
        m = min(_CAST_CHUNK, n - s)
        xs = xu[s: s + m]
        fs = xf[s: s + m]
        ys = ybits[s: s + m]
        t = tmp[:m]
        for i in range(m):
            b = np.int64(xs[i])
            sign = b & 0x80000000
            f = b ^ sign
            top = max(top, f)
            if is_bf16:
                o = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
                t[i] = np.int32(o << 16)
            else:
                on = (f - (112 << 23) + 0xFFF + ((f >> 13) & 1)) >> 13
                on = 0x7C00 if f >= 0x47800000 else on
                osub = np.int64(np.rint(min(abs(fs[i]), small) * two24))
                o = osub if f < 0x38800000 else on
                t[i] = np.int32(o << 13)
            ys[i] = o | (sign >> 16)
        if with_error:
            for i in range(m):
                xi = np.float64(fs[i])
                d = np.float64(tf[i] * scale) - abs(xi)
                err += d * d
                nrm += xi * xi
    return top, err, nrm


class _Dense(Compressor):
    payload_kind = "dense"

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

    def __init__(self, underflow: str = "raise"):
        if underflow not in ("raise", "allow"):
            raise CompressorConfigError(f"{self.name}: underflow must be 'raise' (delta holds on every "
                                        f"call, or an UnderflowError) or 'allow' (delta = 0), got {underflow!r}")
        self.underflow = underflow

    def hyper(self):
        return {"underflow": self.underflow}

    def _contraction_error(self, flat: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(||C(x) - x||^2, ||x||^2) in float64."""
        if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
            return _cast_error(flat.numpy(), y.view(torch.int16).numpy(), self.target == torch.bfloat16)
        xd = flat.to(torch.float64)
        return float(((y.to(torch.float64) - xd) ** 2).sum()), float((xd * xd).sum())

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        check = self.underflow == "raise" and flat.dtype != self.target and flat.numel() > 0
        fused = use_numba(flat) and flat.dtype == torch.float32
        if fused:   # one pass: the cast, max |x| and the contraction's two sums (_cast_narrow)
            y = cpu_empty(flat.numel(), self.target)
            top, err, nrm = _cast_narrow(flat.numpy().view(np.uint32), self.target == torch.bfloat16,
                                                 check, y.view(torch.int16).numpy())
            big = float(np.array([top], dtype=np.uint32).view(np.float32)[0])
        else:
            big = abs_max(flat)
            if math.isfinite(big):
                y = (cpu_empty(flat.numel(), self.target).copy_(flat) if flat.device.type == "cpu"
                     else flat.to(self.target, copy=True))
        if not math.isfinite(big):
            raise_nonfinite(self.name)
        if big > torch.finfo(self.target).max and bool(torch.isinf(y).any()):
            raise OverflowError_(f"{self.name}: |x| up to {big:g} overflows {self.target} "
                                 f"(max {torch.finfo(self.target).max:g}); rescale the input first")
        if check:
            if not fused:
                err, nrm = self._contraction_error(flat, y)
            if err > (1.0 - self.delta(flat.numel())) * nrm:
                tiny = torch.finfo(self.target).tiny
                raise UnderflowError(
                    f"{self.name}: this input lies below {self.target}'s normal range (|x| < {tiny:g}) on "
                    f"enough of its mass that rounding loses {err / nrm if nrm else 1.0:.3g} of ||x||^2, more "
                    f"than the declared 1 - delta = {1.0 - self.delta(flat.numel()):.3g}; rescale it (e.g. "
                    f"loss scaling), use 'bf16' (float32's range) or 'identity', or build "
                    f"{self.name}(underflow='allow'), which declares delta = 0")
        return make_payload("dense", x.shape, x.dtype, y, {"values": 16 * y.numel()})

    def delta(self, d):
        """1 - (2^-p + 2^-23)^2 (see rounding_delta), checked on every call (``underflow="raise"``);
        0 with ``underflow="allow"``, which promises no contraction."""
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


class BF16(_Cast):
    """Round to nearest bfloat16 (float32's exponent range, 8 significand bits); 16 bits/entry."""

    name = "bf16"
    target = torch.bfloat16
    precision_bits = 8
