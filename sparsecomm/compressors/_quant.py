"""Bucketed random quantisers (QSGD, TernGrad, natural dithering): shared driver.

The input is cut into buckets of ``bucket_size`` consecutive entries (one bucket when ``None``); each
bucket gets a norm (l2 or max), integer codes are drawn per entry, and the payload is ``quantized``:
``values`` = codes (smallest signed integer dtype that holds them; on the wire ``code_bits()`` bits
each, :meth:`BucketQuantizer.values_codec`), ``scale`` = one float per bucket
(float32, float64 for float64 inputs), ``shared_scale = False`` (every worker has its own norms), so
``to_dense() = codes * scale[bucket]``. Buckets never straddle: bucket j is ``x[j*b:(j+1)*b]``.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _kernels as K
from ._common import (check_bucket_size, check_generator, draw_key, flat_input, make_payload, raise_nonfinite,
                      scale_dtype,
                      use_numba, work_dtype)
from .base import Compressor
from ..errors import InvalidValueError


def int_dtype_for(max_abs: int) -> torch.dtype:
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        if max_abs <= torch.iinfo(dt).max:
            return dt
    raise InvalidValueError(f"codes up to {max_abs} do not fit in int64")


_NP = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
       torch.float32: np.float32, torch.float64: np.float64}


def _bucketed(t: torch.Tensor, bs: int) -> torch.Tensor:
    """``t`` zero-padded to a multiple of ``bs`` and viewed as (n_buckets, bs)."""
    d = t.numel()
    nb = -(-d // bs)
    if nb * bs != d:
        t = torch.cat([t, t.new_zeros(nb * bs - d)])
    return t.view(nb, bs)


class BucketQuantizer(Compressor):
    payload_kind = "quantized"
    unbiased = True
    shared_scale = False  # every worker quantises with its own norm
    norm_kind = "l2"  # or "linf"

    def __init__(self, bucket_size=None):
        self.bucket_size = check_bucket_size(bucket_size)

    # -- per-operator pieces -------------------------------------------------------------------
    def max_code(self) -> int:
        raise NotImplementedError

    def code_bits(self) -> int:
        raise NotImplementedError

    def values_codec(self) -> tuple[int, int]:
        """Wire encoding of the codes: ``code_bits()``-bit two's complement (codes in
        ``[-max_code, max_code]``), as the raw integers beyond ``codec.bits.MAX_BITS``."""
        from ..codec.bits import MAX_BITS
        from ..payload import INT, RAW

        k = self.code_bits()
        return (INT, k) if k <= MAX_BITS else (RAW, 0)

    def _scale_of(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-bucket scale (float64) from per-bucket norms: decompressed value = code * scale."""
        raise NotImplementedError

    def _codes_numba(self, a, bs, norms, key, codes) -> None:
        raise NotImplementedError

    def _codes_torch(self, a: torch.Tensor, f_norm: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Float64 code magnitudes from |x| (``a``), per-entry norms ``f_norm`` and uniforms ``u``."""
        raise NotImplementedError

    # -- driver ----------------------------------------------------------------------------------
    def _bs(self, d: int) -> int:
        return max(1, d if self.bucket_size is None else min(self.bucket_size, d))

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        g = check_generator(self.name, generator, flat.device)
        bs = self._bs(d)
        nb = -(-d // bs) if d else 0
        cdt = int_dtype_for(self.max_code())
        if use_numba(flat):
            a = flat.to(work_dtype(flat.dtype)).numpy()
            if self.norm_kind == "l2":
                norms = np.empty(nb, dtype=np.float64)
                K.bucket_l2(a, bs, norms)
            else:
                ib, mask = (np.int32, np.int32(0x7FFFFFFF)) if a.dtype == np.float32 else \
                    (np.int64, np.int64(0x7FFFFFFFFFFFFFFF))
                mbits = np.empty(nb, dtype=ib)
                K.bucket_absmax_bits(a.view(ib), bs, mask, mbits)
                norms = mbits.view(a.dtype).astype(np.float64)
            if not np.isfinite(norms).all():
                raise_nonfinite(self.name)
            codes = np.empty(d, dtype=_NP[cdt])
            key = np.uint64(draw_key(g))
            self._codes_numba(a, bs, norms, key, codes)
            codes_t = torch.from_numpy(codes)
            norms_t = torch.from_numpy(norms)
        else:
            xb = _bucketed(flat.to(torch.float64), bs)
            norms_t = (xb.norm(dim=1) if self.norm_kind == "l2" else xb.abs().amax(dim=1)) if d else \
                torch.zeros(0, dtype=torch.float64, device=flat.device)
            if not bool(torch.isfinite(norms_t).all()):
                raise_nonfinite(self.name)
            a = xb.abs()
            u = torch.rand(a.shape, generator=g, dtype=torch.float64, device=flat.device)
            mag = self._codes_torch(a, norms_t[:, None].expand_as(a), u)
            mag = torch.where(norms_t[:, None] > 0, mag, torch.zeros_like(mag))
            codes_t = torch.where(xb < 0, -mag, mag).reshape(-1)[:d].to(cdt)
        scale = self._scale_of(norms_t).to(scale_dtype(x.dtype))
        return make_payload("quantized", x.shape, x.dtype, codes_t, scale=scale, bucket_size=bs,
                            shared_scale=False, values_codec=self.values_codec(),
                            wire_bits={"values": self.code_bits() * d,
                                       "scale": torch.finfo(scale.dtype).bits * nb})

    def _omega_dim(self, d: int) -> int:
        """The largest bucket length: the bound per bucket is increasing in its length."""
        return d if self.bucket_size is None else min(self.bucket_size, d)

    def values_len(self, d: int) -> int:
        return d
