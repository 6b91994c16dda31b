"""DGC's sampled top-k (Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression", ICLR 2018, §3.1):
the operator method ``dgc`` sends (:mod:`sparsecomm.methods.dgc`), not in the catalog.

    t = the ceil(keep s)-th largest |x_j| of s entries sampled uniformly (with the caller's generator)
    C(x) = x_j for |x_j| >= t, at most k = round(keep d) of them (the k largest when more pass)

s = ``theory.dgc_sample_size(d, keep, sample_ratio)``; when s >= d every entry is a sample and the
threshold is the exact k-th largest magnitude. The payload is ``sparse`` (worker-specific positions).
No worst-case contraction holds (a sampled threshold may keep fewer than k entries): ``delta = 0``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import GeneratorRequiredError, check_ratio, gather, make_payload, use_numba
from .base import Compressor


class SampledTopK(Compressor):
    """The entries of x at or above a threshold estimated from a uniform sample (at most k of them)."""

    name, payload_kind = "dgc", "sparse"

    def __init__(self, ratio: float, sample_ratio: float) -> None:
        self.ratio, self.sample_ratio = check_ratio(ratio), check_ratio(sample_ratio)

    def compress(self, x, generator=None, keep: float | None = None):
        """``C(x)`` keeping the fraction ``keep`` (default: ``ratio``; DGC's warm-up passes its schedule)."""
        flat = x.reshape(-1)
        d, keep = flat.numel(), keep or self.ratio
        k, s = min(d, max(1, round(keep * d))), th.dgc_sample_size(d, keep, self.sample_ratio)
        if s < d and generator is None:
            raise GeneratorRequiredError("dgc samples its threshold with the worker's generator (never the "
                                         "global RNG): pass one (the optimizer and the DDP hook do)")
        pick = None if s >= d else torch.randint(0, d, (s,), generator=generator, device=flat.device)
        sample = _abs_at(flat, pick)
        thr = float(torch.topk(sample, min(s, math.ceil(keep * s)), sorted=False).values.min()) if d else 0.0
        idx = _at_or_above(flat, thr)
        if idx.numel() > k:
            idx = idx[torch.topk(_abs_at(flat, idx), k, sorted=False).indices].sort().values
        return make_payload("sparse", x.shape, x.dtype, gather(flat, idx)[0], indices=idx,
                            wire_bits={"values": torch.finfo(x.dtype).bits * idx.numel(),
                                       "indices": th.index_bits(d, idx.numel())})

    def delta(self, d):
        return 0.0   # a sampled threshold may send fewer than k entries: no worst-case contraction

    def bits(self, d, dtype=torch.float32):
        return th.topk_bits(d, min(d, max(1, round(self.ratio * d))), torch.finfo(dtype).bits)


def _numba(flat: torch.Tensor) -> bool:
    return use_numba(flat) and flat.dtype in (torch.float32, torch.float64)


def _abs_at(flat: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """``|x[idx]|`` (``|x|`` for ``idx = None``); a Numba gather on CPU float32/float64."""
    if idx is None:
        return flat.abs()
    if not _numba(flat):
        return flat[idx].abs()
    xn = flat.contiguous().numpy()
    out = np.empty(idx.numel(), dtype=xn.dtype)
    K.abs_gather(xn, idx.numpy(), out)
    return torch.from_numpy(out)


def _at_or_above(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """The indices (increasing) of the entries with ``|x_i| >= thr``, ``thr`` a value of x's dtype (or NaN:
    none). Numba: one pass over x, no |x| temporary (CPU float32/float64); torch ops elsewhere."""
    if not _numba(flat):
        return torch.nonzero(flat.abs() >= thr).reshape(-1)
    xn = flat.contiguous().numpy()
    buf = np.empty(xn.size, dtype=np.int64)     # only the pages that receive indices are touched
    return torch.from_numpy(buf[:K.collect_ge(xn, xn.dtype.type(thr), buf)].copy())
