"""``onebit``: 1-bit SGD with error feedback (Seide, Fu, Droppo, Li, Yu, "1-bit stochastic gradient
descent and its application to data-parallel distributed training of speech DNNs", Interspeech 2014)::

    worker i: p = g + e;  per bucket b (a column in the paper) of ``bucket_size`` entries:
              c_j = sign(p_j) (sign(0) := +1);  q_j = mean{p_l : c_l = c_j, l in b}    (two levels)
              e <- p - q;   send c (1 bit each) and the two levels of every bucket
    all:      estimate = (1/n) sum_i q_i

Two levels per bucket, the means of its non-negative and of its negative entries, are the paper's
reconstruction (also GRACE's ``onebit``). On the wire they are q_j = a_b + s_b c_j with
s_b = (mean+ - mean-)/2 >= 0 and a_b = (mean+ + mean-)/2: round 1 is a standard ``quantized``
payload (codes +-1, one scale s_b per bucket, which every wire format packs to one bit), round 2 the
offsets a_b (dense, one per bucket). ``levels="symmetric"`` drops round 2 with the single level
mean|p| (s_b = ||p_b||_1/b, a_b = 0), as DeepSpeed's and BytePS's 1-bit compressors do. Both are
contractive with delta = 1/b (``theory.onebit_delta``, tight at a single spike; the two-level error
is never above the symmetric one), so the residual e stays bounded. The scales differ between
workers: the codes travel through ``allgather``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from ..compressors import _kernels as K
from ..compressors._common import (check_bucket_size, cpu_empty, flat_input, make_payload, raise_nonfinite,
                                   scale_dtype, use_numba, work_dtype)
from ..compressors.base import Compressor
from ..payload import SIGNS, Payload
from .base import Method, dense_payload
from ..errors import InvalidValueError

LEVELS = ("two", "symmetric")


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
        """One Numba pass, then numpy on the per-bucket sums (no torch op: small torch ops wake its
        thread pool, which costs milliseconds on a loaded host)."""
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
        cnt = _per_bucket(torch.ones_like(w), b)
        if self.two_level:
            nneg, lo_sum = _per_bucket(neg.to(w.dtype), b), _per_bucket(torch.where(neg, w, 0.0), b)
            hi, lo = (_per_bucket(w, b) - lo_sum) / (cnt - nneg).clamp(min=1), lo_sum / nneg.clamp(min=1)
            s, a = (hi - lo) / 2, (hi + lo) / 2
        else:
            s, a = _per_bucket(w.abs(), b) / cnt, None
        finite = bool(torch.isfinite(s).all()) and (a is None or bool(torch.isfinite(a).all()))
        return torch.where(neg, -1, 1).to(torch.int8), s, a, finite

    def compress(self, x, generator=None):
        codes, s, _, b = OneBit(self.bucket_size, False).levels(x)
        return make_payload("quantized", x.shape, x.dtype, codes, scale=s, bucket_size=b, shared_scale=False,
                            wire_bits={"values": codes.numel(), "scale": 8 * s.element_size() * s.numel()},
                            values_codec=(SIGNS, 0))

    def delta(self, d):
        return th.onebit_delta(min(self.bucket_size or max(d, 1), max(d, 1)))

    def bits(self, d, dtype=torch.float32):
        return th.onebit_bits(d, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits,
                              2 if self.two_level else 1)


@dataclass
class OneBitState:
    """Per-bucket state of ``onebit``: the worker's residual ``e``."""

    error: torch.Tensor


class OneBitSGD(Method):
    """``get("onebit", bucket_size=512, levels="two")``."""

    name, multi_round, State = "onebit", True, OneBitState

    def __init__(self, bucket_size: int | None = 512, *, levels: str = "two") -> None:
        if levels not in LEVELS:
            raise InvalidValueError(f"onebit: levels must be one of {LEVELS}, got {levels!r}")
        super().__init__(OneBit(bucket_size, levels == "two"))

    def hyper(self):
        return {"bucket_size": self.compressor.bucket_size,
                "levels": "two" if self.compressor.two_level else "symmetric"}

    def _encode(self, grad, ms, generator, exact):
        st = ms.state
        if st is None:
            st = ms.state = OneBitState(torch.zeros_like(grad))
        p = grad.add_(st.error)
        if exact:
            st.error.zero_()
            ms.pending = ("exact",)
            return dense_payload(p)
        codes, s, a, b = self.compressor.levels(p)
        _residual(p, codes, s, a, b, st.error)
        ms.pending = ("codes", a, b)
        return make_payload("quantized", p.shape, p.dtype, codes, scale=s, bucket_size=b, shared_scale=False,
                            wire_bits={"values": codes.numel(), "scale": 8 * s.element_size() * s.numel()},
                            values_codec=(SIGNS, 0))

    def _next_round(self, aggregate, world_size, ms):
        pend = ms.pending
        if pend[0] != "codes" or pend[1] is None:
            return None
        ms.pending = ("offsets", aggregate.clone(), pend[2])
        a = pend[1]
        return Payload("dense", a, a.shape, a.dtype, bits=8 * a.numel() * a.element_size())

    def _decode(self, aggregate, world_size, ms, out):
        pend = ms.take_pending(self.name)
        if pend[0] == "offsets":                       # codes' sum + the offsets' sum, per bucket
            torch.add(pend[1], _expand(aggregate.to(pend[1].dtype), pend[2], out.numel()), out=out)
            out.div_(world_size)
        else:
            torch.div(aggregate, world_size, out=out)


def _residual(p: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, a: torch.Tensor | None, b: int,
              err: torch.Tensor) -> None:
    """err = p - q, q = s * codes (+ a), bucket by bucket, computed in the levels' dtype and rounded to
    ``p``'s. Numba (one pass) where ``p`` is a contiguous CPU float32/float64 tensor: q takes two values
    per bucket, ``s + a`` and ``-s + a`` (``s * (+-1)`` is exact), so both paths give the same bits."""
    if use_numba(p) and p.dtype == s.dtype and p.is_contiguous() and err.is_contiguous() and p.numel():
        sn = s.numpy()
        qpos, qneg = (sn, -sn) if a is None else (sn + a.numpy(), -sn + a.numpy())
        K.two_level_residual(p.numpy(), codes.numpy(), qpos, qneg, b, err.numpy())
        return
    q = _expand(s, b, p.numel()) * codes
    if a is not None:
        q += _expand(a, b, p.numel())
    torch.sub(p, q.to(p.dtype), out=err)


def _per_bucket(v: torch.Tensor, b: int) -> torch.Tensor:
    """The sum of every bucket of b consecutive entries (the last may be shorter)."""
    full = (v.numel() // b) * b
    sums = v[:full].view(-1, b).sum(1)
    return torch.cat([sums, v[full:].sum().reshape(1)]) if full < v.numel() else sums


def _expand(vals: torch.Tensor, b: int, d: int) -> torch.Tensor:
    """Each bucket's value repeated over its entries (length d)."""
    return vals[:, None].expand(vals.numel(), b).reshape(-1)[:d]
