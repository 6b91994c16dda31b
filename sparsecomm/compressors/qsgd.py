"""QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-efficient SGD via gradient
quantization and encoding", NeurIPS 2017): stochastic rounding of s|x_i|/||x||_2 to the levels
{0, 1, ..., s}, per bucket.

    C(x)_i = (||x_b||/s) sign(x_i) xi_i,   xi_i in {l, l+1},  P(l+1) = s|x_i|/||x_b|| - l

Unbiased with omega = min(b/s^2, sqrt(b)/s) for the largest bucket length b (Lemma 3.1;
``theory.compressors.qsgd_omega``). Wire: 1 + ceil(log2(s+1)) bits per code plus one norm per bucket
(``qsgd_bits``).
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import check_int, scale_dtype
from ._quant import BucketQuantizer


class QSGD(BucketQuantizer):
    """``get("qsgd", levels=4, bucket_size=512)``; ``levels`` = s >= 1, ``bucket_size`` None = whole."""

    name = "qsgd"
    norm_kind = "l2"

    def __init__(self, levels=4, bucket_size=None):
        self.levels = check_int("levels", levels, 1, 2**31 - 1)
        super().__init__(bucket_size)

    def max_code(self):
        return self.levels

    def code_bits(self):
        return th.qsgd_code_bits(self.levels)

    def _scale_of(self, norms):
        return norms / self.levels

    def _codes_numba(self, a, bs, norms, key, codes):
        K.qsgd_codes(a, bs, norms, float(self.levels), key, codes)

    def _codes_torch(self, a, nrm, u):
        r = a * (self.levels / nrm)
        lvl = torch.floor(r)
        lvl = lvl + (u < r - lvl).to(lvl.dtype)
        return lvl.clamp(max=self.levels)

    def omega(self, d):
        return th.qsgd_omega(self._omega_dim(d), self.levels)

    def bits(self, d, dtype=torch.float32):
        return th.qsgd_bits(d, self.levels, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits)

    def hyper(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size}
