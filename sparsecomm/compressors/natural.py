"""Natural compression and natural dithering (Horvath, Ho, Horvath, Sahu, Canini, Richtarik,
"Natural compression for distributed deep learning", MSML 2022, arXiv 1905.10988).

``natural``: every entry is rounded, unbiasedly, to one of the two signed powers of two around it:
for |x| = 2^e (1 + m), m in [0, 1), C(x) = sign(x) 2^(e+1) with probability m, else sign(x) 2^e.
omega = 1/8 (Thm 3; tight at 4/3). The payload is ``dense`` with values that are signed powers of
two in the input dtype; on the wire only sign + exponent travel (``theory.compressors.natural_bits``):
9 bits per float32/bfloat16 entry, 6+1 per float16 entry (exponents 2^-24..2^15 and zero), 11+1 per
float64 entry. Implemented on the IEEE bit pattern (exponent kept, significand rounded up to the next
binade with probability = significand fraction), which makes the result exactly sign + exponent.

Domain: omega = 1/8 holds for entries that are zero or normal in the compute format (float32 for
16/32-bit inputs, float64 for float64): a float32 subnormal (|x| < 2^-126) is rounded, still
unbiasedly, to 0 or 2^-126. Entries whose rounding up could overflow the input dtype (|x| >= 2^127
for float32/bfloat16, >= 2^15 for float16, >= 2^1023 for float64) raise OverflowError_.

``natural_dithering``: levels {0, 2^(1-s), ..., 1/2, 1} of ||x_b||_p (p = 2 or inf) per bucket; an
entry is rounded unbiasedly between the two levels around |x_i|/||x_b||_p. omega is
``theory.compressors.natural_dithering_omega`` (NC paper Thm 7). The payload is ``quantized``: codes
are integer multiples of the lowest level (0 or +-2^j, j < s), scale = 2^(1-s)||x_b||_p, so the codes
of workers sharing a scale would sum exactly; wire cost 1 + ceil(log2(s+1)) bits per entry (sign +
level index) plus one norm per bucket.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import CompressorConfigError, check_generator, check_int, draw_key, flat_input, make_payload, \
    scale_dtype, use_numba
from ._quant import BucketQuantizer
from .base import Compressor
from ..errors import NonFiniteError, OverflowError_
from ..payload import DITHER, NATURAL

# input dtype -> (compute dtype, exponent field at/above which rounding up may overflow, exponent bits)
_NATURAL = {
    torch.float32: (torch.float32, 254, 8),
    torch.bfloat16: (torch.float32, 254, 8),
    torch.float16: (torch.float32, 127 + 15, 6),
    torch.float64: (torch.float64, 2046, 11),
}


class Natural(Compressor):
    """``get("natural")``: unbiased random rounding to a signed power of two; omega = 1/8."""

    name = "natural"
    payload_kind = "dense"
    unbiased = True
    #: the values travel as sign + exponent only where no sum is formed on the wire (allgather)
    packed_values = True

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        g = check_generator(self.name, generator, flat.device)
        cdt, max_field, ebits = _NATURAL[x.dtype]
        a = flat.to(cdt)
        idt = torch.int32 if cdt == torch.float32 else torch.int64
        bits = a.view(idt)
        if use_numba(flat):
            out = np.empty(d, dtype=np.int32 if idt == torch.int32 else np.int64)
            kern = K.natural_f32 if idt == torch.int32 else K.natural_f64
            status = kern(bits.numpy(), np.uint64(draw_key(g)), max_field, out) if d else 0
            y = torch.from_numpy(out)
        else:
            mbits, emask = (23, 0xFF) if idt == torch.int32 else (52, 0x7FF)
            e = (bits >> mbits) & emask
            status = K.NONFINITE if bool((e == emask).any()) else (
                K.TOO_LARGE if bool((e >= max_field).any()) else K.OK)
            u = torch.randint(0, 2**mbits, (d,), generator=g, dtype=idt, device=flat.device)
            low = bits & ~((1 << mbits) - 1)
            y = low + ((u < (bits & ((1 << mbits) - 1))).to(idt) << mbits)
        if status == K.NONFINITE:
            raise NonFiniteError(f"{self.name}: the input contains NaN or Inf")
        if status == K.TOO_LARGE:
            raise OverflowError_(f"{self.name}: |x| >= 2^{max_field - (127 if idt == torch.int32 else 1023)} "
                                 f"may round up past the range of {x.dtype}; rescale the input first")
        vals = y.view(cdt).to(x.dtype)
        return make_payload("dense", x.shape, x.dtype, vals, {"values": th.natural_bits(d, ebits)},
                            values_codec=(NATURAL, 0))

    def omega(self, d):
        return th.natural_omega()

    def bits(self, d, dtype=torch.float32):
        return th.natural_bits(d, _NATURAL[dtype][2])

    def values_len(self, d):
        return d


class NaturalDithering(BucketQuantizer):
    """``get("natural_dithering", levels=4, bucket_size=None, p=2)``; levels s in [1, 63], p in {2, inf}."""

    name = "natural_dithering"

    def __init__(self, levels=4, bucket_size=None, p=2):
        self.levels = check_int("levels", levels, 1, 63)
        if p not in (2, math.inf, "inf"):
            raise CompressorConfigError(f"natural_dithering supports p=2 or p=inf, got p={p!r}")
        self.p = 2.0 if p == 2 else math.inf
        self.norm_kind = "l2" if self.p == 2 else "linf"
        super().__init__(bucket_size)

    def max_code(self):
        return 2 ** (self.levels - 1)

    def code_bits(self):
        return th.qsgd_code_bits(self.levels)

    def values_codec(self):
        return (DITHER, self.code_bits())

    def _scale_of(self, norms):
        return norms * 2.0 ** (1 - self.levels)

    def _codes_numba(self, a, bs, norms, key, codes):
        K.natdither_codes(a, bs, norms, self.levels, key, codes)

    def _codes_torch(self, a, nrm, u):
        top = 2.0 ** (self.levels - 1)
        t = a * (top / nrm)
        mant, e = torch.frexp(t)
        low = torch.ldexp(torch.ones_like(t), e - 1)
        hi = torch.where(u < 2 * mant - 1, 2 * low, low).clamp(max=top)
        return torch.where(t < 1, (u < t).to(t.dtype), hi)

    def omega(self, d):
        return th.natural_dithering_omega(self._omega_dim(d), self.levels, self.p)

    def bits(self, d, dtype=torch.float32):
        return th.natural_dithering_bits(d, self.levels, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits)

    def hyper(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "p": self.p}
