"""Top-k and hard-threshold sparsification (``sparse`` payloads, biased).

**Selection rule** (exact, deterministic): the k entries of largest ``|x_i|``; ties at the k-th
magnitude are broken towards the **lower index**. Indices are returned in increasing order (int64 in
memory; on the wire ``theory.compressors.index_bits``: 32-bit indices or a bitmap). On tie-free inputs
this is exactly the set ``torch.topk(x.abs(), k)`` selects.

**Fast exact path** (CPU, Numba): sample ``|x|`` at ~1e5 positions (a private numpy Generator with a
fixed seed: the output does not depend on it, and the caller's generator is not consumed, so shared
generators stay in step across workers), take a sample order statistic a few standard deviations
*below* the k-th largest estimate as threshold, collect the candidates ``|x_i| >= thr`` in one pass,
and select the exact top-k among them (``np.partition`` + a tie-aware pass). If the sample overshoots
(fewer than k candidates) the threshold is lowered once, then everything becomes a candidate; the
result is exact in every case, only the time varies.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import (CompressorConfigError, SizeRule, all_finite, dtype_bits, flat_input, gather, make_payload,
                      raise_nonfinite, use_numba, work_dtype)
from .base import Compressor

#: below this length every entry is a candidate (no sampling)
SAMPLE_CUTOFF = 200_000
#: number of sampled magnitudes
SAMPLE_SIZE = 100_000
#: safety margin of the sampled threshold, in binomial standard deviations
SAMPLE_MARGIN = 5.0


def collect_ge(a: np.ndarray, thr: float, buf: np.ndarray) -> int:
    """Number of |a_i| >= thr, their indices (increasing) written to ``buf``."""
    ft = a.dtype.type
    with np.errstate(over="ignore"):  # a threshold beyond the dtype's range becomes inf
        t = ft(max(thr, 0.0))
    if float(t) < thr:  # the smallest value of a's dtype that is >= thr: exact for a float64 thr
        t = np.nextafter(t, ft(np.inf))
    return int(K.collect_ge(a, t, buf))


def _check_finite(a: np.ndarray, who: str) -> None:
    if not K.all_finite(a):
        raise_nonfinite(who)


def _exact_among(a: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    """Top-k (ties -> lower index) among candidate indices ``cand`` (increasing) of magnitudes of ``a``."""
    vals = np.empty(cand.size, dtype=a.dtype)
    K.abs_gather(a, cand, vals)
    vk = np.partition(vals, cand.size - k)[cand.size - k]
    out = np.empty(k, dtype=np.int64)
    K.select_exact(vals, cand, k, vk, out)
    return out


def sample_magnitudes(a: np.ndarray, m: int = SAMPLE_SIZE) -> np.ndarray:
    """``|a|`` at ``m`` random positions (a private generator of a fixed seed): the sample the threshold of
    the fast path is taken from."""
    return np.abs(a[np.random.default_rng(0x5EED).integers(0, a.size, m)])


def sample_rank(d: int, k: int, m: int = SAMPLE_SIZE) -> int:
    """The sample order statistic (counted from the largest) taken as the fast path's first threshold: the
    k-th largest's expected rank among ``m`` of ``d`` plus :data:`SAMPLE_MARGIN` standard deviations."""
    p = k / d
    return max(1, min(m, int(math.ceil(m * p + SAMPLE_MARGIN * math.sqrt(m * p * (1 - p)) + SAMPLE_MARGIN))))


def topk_indices_numba(a: np.ndarray, k: int, check: bool = True) -> np.ndarray:
    """Exact top-k indices (increasing) of a float32/float64 numpy vector; see the module docstring. ``check``:
    NonFiniteError on a NaN or Inf (a pass of its own; False: the caller found ``a`` finite)."""
    d = a.size
    if check:
        _check_finite(a, "topk")
    buf = np.empty(d, dtype=np.int64)  # only the pages that receive candidates are ever touched
    thr = -1.0
    if d > SAMPLE_CUTOFF:
        m = SAMPLE_SIZE
        sample = sample_magnitudes(a, m)
        r = sample_rank(d, k, m)
        for attempt in range(2):
            thr = float(np.partition(sample, m - r)[m - r])
            c = collect_ge(a, thr, buf)
            if c >= k:
                return _exact_among(a, buf[:c], k)
            if r == m:
                break
            r = min(m, 4 * r)  # sample overshoot (rare): lower the threshold once
        thr = -1.0
    c = collect_ge(a, thr, buf)
    return _exact_among(a, buf[:c], k)


def topk_indices_torch(flat: torch.Tensor, k: int, check: bool = True) -> torch.Tensor:
    """Same selection with torch ops (any device); ``check`` as for :func:`topk_indices_numba`."""
    a = flat.to(work_dtype(flat.dtype)).abs()
    if check and not bool(torch.isfinite(a).all()):
        raise_nonfinite("topk")
    vk = torch.topk(a, k, sorted=False).values.min()
    gt = torch.nonzero(a > vk).flatten()
    eq = torch.nonzero(a == vk).flatten()[: k - gt.numel()]
    return torch.sort(torch.cat([gt, eq])).values


def topk_indices(flat: torch.Tensor, k: int, check: bool = True) -> torch.Tensor:
    """The exact top-k indices (increasing) of ``flat``; NonFiniteError on a NaN or Inf unless ``check`` is False
    (the caller found ``flat`` finite: that pass left out)."""
    d = flat.numel()
    if k >= d:
        if check and not all_finite(flat):
            raise_nonfinite("topk")
        return torch.arange(d, dtype=torch.int64, device=flat.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    if use_numba(flat):
        a = flat.to(work_dtype(flat.dtype)).numpy()
        return torch.from_numpy(topk_indices_numba(a, k, check))
    return topk_indices_torch(flat, k, check)


class _Sparse(Compressor):
    payload_kind = "sparse"
    unbiased = False

    def _sparse_payload(self, x, flat, idx):
        d = flat.numel()
        vb = dtype_bits(x.dtype)
        vals, _ = gather(flat, idx)
        return make_payload("sparse", x.shape, x.dtype, vals, indices=idx,
                            wire_bits={"values": vb * idx.numel(), "indices": th.index_bits(d, idx.numel())})


class TopK(_Sparse):
    """Top-k by magnitude: ``get("topk", ratio=0.01)`` or ``get("topk", k=1000)``.

    delta = k/d (``theory.compressors.topk_delta``, tight at x = 1);
    bits = k values + ``index_bits(d, k)`` (``topk_bits``).
    """

    name = "topk"

    def __init__(self, ratio=None, k=None):
        self.size = SizeRule(ratio, k, "topk")

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        return self._sparse_payload(x, flat, topk_indices(flat, self.size(flat.numel())))

    def compress_finite(self, x, generator=None):
        """:meth:`compress` without its finiteness pass, for an ``x`` the caller found finite (the same payload)."""
        if type(self).compress is not TopK.compress:        # a subclass's own compress is what it means
            return self.compress(x, generator)
        flat = flat_input(x, self.name)
        return self._sparse_payload(x, flat, topk_indices(flat, self.size(flat.numel()), check=False))

    def delta(self, d):
        return th.topk_delta(d, self.size(d))

    def bits(self, d, dtype=torch.float32):
        return th.topk_bits(d, self.size(d), dtype_bits(dtype))

    def values_len(self, d):
        return self.size(d)

    def work(self, d, dtype=torch.float32):
        """The selection (module docstring): below :data:`SAMPLE_CUTOFF` every element is a candidate (the
        whole selection, its finiteness check included, is ``"select"``'s rate); above it, the input checked
        for NaN and Inf (one read, ``"check"``: :func:`._kernels.all_finite`), :data:`SAMPLE_SIZE` magnitudes
        sampled, the candidate pass (``"collect"``: :func:`collect_ge`, a kernel of its own, slower per element
        than an elementwise pass) and the selection among its candidates (about ``d r / m``:
        :func:`sample_rank`); then the ``k`` values gathered."""
        k = self.size(d)
        if k == 0 or k >= d:
            return {"elementwise": d + k, "kernel": 1}
        if d <= SAMPLE_CUTOFF:
            return {"select": d, "elementwise": k, "kernel": 1}
        cand = min(d, math.ceil(d * sample_rank(d, k) / SAMPLE_SIZE))
        return {"check": d, "sample": SAMPLE_SIZE, "collect": d, "elementwise": k, "select": cand, "kernel": 1}

    def decompress_work(self, d, dtype=torch.float32):
        """Its ``k`` values scattered (into the output, or added into a residual)."""
        return {"elementwise": self.size(d)}

    def hyper(self):
        return self.size.hyper()


class Threshold(_Sparse):
    """Hard threshold: keep the entries with ``|x_i| >= threshold``.

    Biased and **not** contractive (``delta = 0``: an input below the threshold everywhere is dropped
    whole); what holds is the absolute bound ||C(x) - x||^2 <= d threshold^2
    (``abs_error_bound``, ``theory.compressors.threshold_abs_error``). The payload size depends on
    the data: ``bits(d)`` is the worst case (every entry kept); each payload's ``bits`` is exact.
    """

    name = "threshold"

    def __init__(self, threshold=None):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                0.0 <= float(threshold) < math.inf):
            raise CompressorConfigError(f"threshold must be a finite number >= 0, got {threshold!r}")
        self.threshold = float(threshold)

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        if use_numba(flat):
            a = flat.to(work_dtype(flat.dtype)).numpy()
            _check_finite(a, self.name)
            buf = np.empty(d, dtype=np.int64)
            c = collect_ge(a, self.threshold, buf)
            idx = torch.from_numpy(buf[:c].copy())
        else:
            if d and not bool(torch.isfinite(flat).all()):
                raise_nonfinite(self.name)
            # compared in float64: exact for every input dtype, like the Numba path
            idx = torch.nonzero(flat.to(torch.float64).abs() >= self.threshold).flatten()
        return self._sparse_payload(x, flat, idx)

    def delta(self, d):
        return 0.0

    def abs_error_bound(self, d):
        """||C(x) - x||^2 <= d * threshold^2 for every x of length d."""
        return th.threshold_abs_error(d, self.threshold)

    def bits(self, d, dtype=torch.float32):
        return th.sparse_bits(d, d, dtype_bits(dtype))

    def hyper(self):
        return {"threshold": self.threshold}
