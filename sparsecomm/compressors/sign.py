"""Scaled sign (Karimireddy, Rebjock, Stich, Jaggi, "Error feedback fixes SignSGD and other gradient
compression schemes", ICML 2019):

    C(x) = (||x||_1 / d) sign(x),   with sign(0) := +1 (codes are exactly one bit)

Deterministic, biased, contractive: ||C(x) - x||^2 = ||x||^2 - ||x||_1^2/d exactly (whatever sign(0)
is, since c_i x_i = |x_i| and c_i^2 = 1), so delta = ||x||_1^2/(d||x||^2) >= 1/d
(``theory.compressors.sign_delta``, tight at a single spike). Payload ``quantized``: int8 codes in
{-1, +1} and one scale ||x||_1/d (per worker: ``shared_scale = False``); wire cost d + 32 bits
(``sign_bits``): the codes travel as one bit each (``SIGNS`` encoding, :mod:`sparsecomm.codec.bits`).
"""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import flat_input, make_payload, raise_nonfinite, scale_dtype, use_numba, work_dtype
from .base import Compressor
from ..payload import SIGNS


class ScaledSign(Compressor):
    """``get("sign")``."""

    name = "sign"
    payload_kind = "quantized"
    unbiased = False
    shared_scale = False  # every worker quantises with its own norm

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        if use_numba(flat):
            codes = np.empty(d, dtype=np.int8)
            l1 = K.sign_codes(flat.to(work_dtype(x.dtype)).numpy(), codes)
            codes_t = torch.from_numpy(codes)
        else:
            l1 = float(flat.to(torch.float64).abs().sum())
            codes_t = torch.where(flat < 0, -1, 1).to(torch.int8)
        if not np.isfinite(l1):
            raise_nonfinite(self.name)
        sdt = scale_dtype(x.dtype)
        scale = torch.tensor([l1 / d] if d else [], dtype=sdt, device=flat.device)
        return make_payload("quantized", x.shape, x.dtype, codes_t, scale=scale, bucket_size=max(d, 1),
                            shared_scale=False, values_codec=(SIGNS, 0),
                            wire_bits={"values": d, "scale": torch.finfo(sdt).bits * scale.numel()})

    def delta(self, d):
        return th.sign_delta(d)

    def bits(self, d, dtype=torch.float32):
        return th.sign_bits(d, torch.finfo(scale_dtype(dtype)).bits)

    def values_len(self, d):
        return d
