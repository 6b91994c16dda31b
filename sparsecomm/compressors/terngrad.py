"""TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary gradients to reduce communication
in distributed deep learning", NeurIPS 2017), without gradient clipping; DIANA's Quant_inf:

    C(x)_i = ||x_b||_inf sign(x_i) z_i,   z_i ~ Bernoulli(|x_i| / ||x_b||_inf)

Unbiased with omega = (sqrt(b) - 1)/2 for the largest bucket length b, tight at
x = (1, t, ..., t), t = 1/(sqrt(b)+1) (``theory.compressors.terngrad_omega``). Wire: 2 bits per
ternary code plus one max-norm per bucket (``terngrad_bits``).
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import scale_dtype
from ._quant import BucketQuantizer


class TernGrad(BucketQuantizer):
    """``get("terngrad", bucket_size=512)``; codes int8 in {-1, 0, 1}."""

    name = "terngrad"
    norm_kind = "linf"

    def max_code(self):
        return 1

    def code_bits(self):
        return 2

    def _scale_of(self, norms):
        return norms

    def _codes_numba(self, a, bs, norms, key, codes):
        K.terngrad_codes(a, bs, norms, key, codes)

    def _codes_torch(self, a, nrm, u):
        return (u < a / nrm).to(a.dtype)

    def omega(self, d):
        return th.terngrad_omega(self._omega_dim(d))

    def bits(self, d, dtype=torch.float32):
        return th.terngrad_bits(d, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits)

    def hyper(self):
        return {"bucket_size": self.bucket_size}
