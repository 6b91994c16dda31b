"""1-bit SGD's codes and levels (Seide, Fu, Droppo, Li, Yu, "1-bit stochastic gradient descent and its
application to data-parallel distributed training of speech DNNs", Interspeech 2014): the operator
method ``onebit`` sends (:mod:`sparsecomm.methods.onebit`), not in the catalog.

Per bucket b of ``bucket_size`` entries: c_j = sign(x_j) (sign(0) := +1) and x is reconstructed as
q_j = a_b + s_b c_j, the two levels being the means of the bucket's non-negative and negative entries
(s_b = (mean+ - mean-)/2 >= 0, a_b = (mean+ + mean-)/2), or the single symmetric level
s_b = ||x_b||_1/b, a_b = 0. Contractive with delta = 1/b (``theory.onebit_delta``).
:func:`residual` is x - q given the codes and levels; :func:`expand` and :func:`per_bucket` map
between per-bucket values and entries.
"""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import (check_bucket_size, cpu_empty, flat_input, make_payload, raise_nonfinite, scale_dtype,
                      use_numba, work_dtype)
from .base import Compressor
from ..payload import SIGNS


class OneBit(Compressor):
    """Codes sign(x) with the symmetric level mean|x| per bucket (the round-1 payload of ``onebit``)."""

    name, payload_kind, shared_scale = "onebit", "quantized", False

    def __init__(self, bucket_size: int | None = 512, two_level: bool = True) -> None:
        self.bucket_size, self.two_level = check_bucket_size(bucket_size), two_level

    def levels(self, x: torch.Tensor):
        """(codes, s, a, bucket length b): x is reconstructed as a + s * codes, bucket by bucket
        (``a`` is ``None`` for the symmetric level). The levels are in ``scale_dtype(x.dtype)``; the
        Numba path sums each bucket in float64 and rounds the levels once (the torch path sums in that
        dtype: the two agree to its rounding)."""
        flat = flat_input(x, self.name)
        d = flat.numel()
        b = min(self.bucket_size or max(d, 1), max(d, 1))
        levels = self._levels_numba if use_numba(flat) and d else self._levels_torch
        codes, s, a, finite = levels(flat, b)
        if not finite:
            raise_nonfinite(self.name)
        return codes, s, a, b

    def _levels_numba(self, flat: torch.Tensor, b: int):
        """One Numba pass, then numpy on the per-bucket sums (on this thread: no torch op, whose thread
        pool a small tensor does not need)."""
        w = flat.to(work_dtype(flat.dtype)).numpy()
        d, nb = w.size, -(-w.size // b)
        codes = cpu_empty(d, torch.int8)
        pos, neg, nneg = np.empty(nb), np.empty(nb), np.empty(nb, dtype=np.int64)
        K.onebit_sums(w, b, codes.numpy(), pos, neg, nneg)
        cnt = np.full(nb, float(b))
        cnt[-1] = d - (nb - 1) * b
        sdt = np.float64 if flat.dtype == torch.float64 else np.float32     # scale_dtype
        with np.errstate(all="ignore"):       # non-finite sums are reported below
            if self.two_level:
                hi, lo = pos / np.maximum(cnt - nneg, 1), neg / np.maximum(nneg, 1)
                s, a = ((hi - lo) / 2).astype(sdt), ((hi + lo) / 2).astype(sdt)
            else:
                s, a = ((pos - neg) / cnt).astype(sdt), None
        finite = bool(np.isfinite(s).all()) and (a is None or bool(np.isfinite(a).all()))
        return codes, torch.from_numpy(s), None if a is None else torch.from_numpy(a), finite

    def _levels_torch(self, flat: torch.Tensor, b: int):
        w = flat.to(scale_dtype(flat.dtype))
        neg = w < 0
        cnt = per_bucket(torch.ones_like(w), b)
        if self.two_level:
            nneg, lo_sum = per_bucket(neg.to(w.dtype), b), per_bucket(torch.where(neg, w, 0.0), b)
            hi, lo = (per_bucket(w, b) - lo_sum) / (cnt - nneg).clamp(min=1), lo_sum / nneg.clamp(min=1)
            s, a = (hi - lo) / 2, (hi + lo) / 2
        else:
            s, a = per_bucket(w.abs(), b) / cnt, None
        finite = bool(torch.isfinite(s).all()) and (a is None or bool(torch.isfinite(a).all()))
        return torch.where(neg, -1, 1).to(torch.int8), s, a, finite

    def compress(self, x, generator=None):
        codes, s, _, b = OneBit(self.bucket_size, False).levels(x)
        return self.payload(x, codes, s, b)

    @staticmethod
    def payload(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, b: int):
        """The ``quantized`` payload of ``x``'s codes with the per-bucket scale ``s`` (buckets of ``b``):
        one bit per code and the scales (``SIGNS`` encoding)."""
        return make_payload("quantized", x.shape, x.dtype, codes, scale=s, bucket_size=b, shared_scale=False,
                            wire_bits={"values": codes.numel(), "scale": 8 * s.element_size() * s.numel()},
                            values_codec=(SIGNS, 0))

    def delta(self, d):
        return th.onebit_delta(min(self.bucket_size or max(d, 1), max(d, 1)))

    def bits(self, d, dtype=torch.float32):
        return th.onebit_bits(d, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits,
                              2 if self.two_level else 1)


def residual(p: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, a: torch.Tensor | None, b: int,
              err: torch.Tensor) -> None:
    """err = p - q, q = s * codes (+ a), bucket by bucket, computed in the levels' dtype and rounded to
    ``p``'s. Numba (one pass) where ``p`` is a contiguous CPU float32/float64 tensor: q takes two values
    per bucket, ``s + a`` and ``-s + a`` (``s * (+-1)`` is exact), so both paths give the same bits."""
    if use_numba(p) and p.dtype == s.dtype and p.is_contiguous() and err.is_contiguous() and p.numel():
        sn = s.numpy()
        qpos, qneg = (sn, -sn) if a is None else (sn + a.numpy(), -sn + a.numpy())
        K.two_level_residual(p.numpy(), codes.numpy(), qpos, qneg, b, err.numpy())
        return
    q = expand(s, b, p.numel()) * codes
    if a is not None:
        q += expand(a, b, p.numel())
    torch.sub(p, q.to(p.dtype), out=err)


def per_bucket(v: torch.Tensor, b: int) -> torch.Tensor:
    """The sum of every bucket of b consecutive entries (the last may be shorter)."""
    full = (v.numel() // b) * b
    sums = v[:full].view(-1, b).sum(1)
    return torch.cat([sums, v[full:].sum().reshape(1)]) if full < v.numel() else sums


def expand(vals: torch.Tensor, b: int, d: int) -> torch.Tensor:
    """Each bucket's value repeated over its entries (length d)."""
    return vals[:, None].expand(vals.numel(), b).reshape(-1)[:d]
