"""Rand-k: k coordinates uniformly at random without replacement, scaled by d/k (unbiased).

``aligned`` payload with ``shared_randomness = True``: the coordinates are a deterministic function
of the generator state and d, so workers whose generators share a seed pick the same coordinates and
the sum of their value vectors is the compact aggregate; indices never travel (bits = k values).

Sampling: draw uniform indices with replacement until k distinct ones are in hand (when k > d/2
the d - k dropped coordinates are drawn instead). The distinct set of i.i.d. uniform draws is, given
its size, a uniform subset (the procedure is invariant under relabelling coordinates), so the result
is a uniform k-subset. Indices are sorted increasingly. CPU (Numba): the draws set bits of a d-bit
bitmap until exactly k are set, then the bitmap is read out in order (O(k + d/64)). Other devices
(torch): batches of draws are merged with ``torch.unique`` and a uniformly random excess is dropped
(O(k log k)). The two paths draw different (equally distributed) subsets from the same seed, so
workers sharing a seed must also share the device type.

``independent=True``: per-worker coordinates (the setting of the DIANA/EF21/MARINA theory, where the
workers' compressors are independent): the optimizer and the DDP hook seed this compressor's generator
``seed + rank`` (``shared_randomness = False``), and the payload is ``sparse`` (indices travel:
``bits = theory.compressors.sparse_bits``), carried by ``allgather`` and ``omnireduce``. omega is
unchanged (d/k - 1 per worker); what changes is the variance of the *average*: with independent
coordinates the workers' errors are independent, so at a point where the local gradients differ but
sum to zero, compressed GD (DCGD) keeps a noise floor while DIANA's shifts remove it; with shared
coordinates ``C(sum_i g_i) = sum_i C(g_i)`` vanishes there. The other random compressors (``natural``,
``natural_dithering``, ``qsgd``, ``terngrad``) always draw per worker (``seed + rank``).
"""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import (CompressorConfigError, SizeRule, check_generator, draw_key, dtype_bits, flat_input, gather,
                      make_payload, raise_nonfinite, use_numba)
from .base import Compressor


def sample_subset_numba(d: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """CPU path: one 64-bit key from ``generator``, then a Numba bitmap draw (``_kernels.sample_bitmap``)
    of the k chosen coordinates (or of the d - k dropped ones when k > d/2), read out in order."""
    if k >= d:
        return torch.arange(d, dtype=torch.int64)
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    m = k if 2 * k <= d else d - k
    words = np.zeros((d + 63) // 64, dtype=np.uint64)
    K.sample_bitmap(d, m, np.uint64(draw_key(generator)), words)
    out = np.empty(k, dtype=np.int64)
    K.bitmap_positions(words, d, m == k, out)
    return torch.from_numpy(out)


def sample_subset(d: int, k: int, generator: torch.Generator, device) -> torch.Tensor:
    """A uniformly random k-subset of range(d), sorted, int64, drawn from ``generator`` only."""
    if k >= d:
        return torch.arange(d, dtype=torch.int64, device=device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    m = k if 2 * k <= d else d - k
    chosen = torch.empty(0, dtype=torch.int64, device=device)
    while chosen.numel() < m:
        have, need = chosen.numel(), m - chosen.numel()
        # draw enough that duplicates (about need*(have + need/2)/d) rarely leave us short
        dup = need * (have + need / 2) / max(d - have - need, 1)
        draws = torch.randint(0, d, (need + int(dup + 3 * dup**0.5) + 16,), generator=generator,
                              dtype=torch.int64, device=device)
        chosen = torch.unique(torch.cat([chosen, draws]))
    j = chosen.numel()
    if j > m:  # drop a uniformly random (small) excess of j - m positions
        if j <= 65536:
            drop = torch.randperm(j, generator=generator, device=device)[: j - m]
        else:  # randperm(j) would cost O(j): draw the few positions the same way instead
            drop = sample_subset(j, j - m, generator, device)
        keep = torch.ones(j, dtype=torch.bool, device=device)
        keep[drop] = False
        chosen = chosen[keep]
    if m == k:
        return chosen
    mask = torch.ones(d, dtype=torch.bool, device=device)
    mask[chosen] = False
    return torch.nonzero(mask).flatten()


class RandK(Compressor):
    """Rand-k scaled by d/k: ``get("randk", ratio=0.01)`` or ``get("randk", k=1000)``.

    omega = d/k - 1 (``theory.compressors.randk_omega``; equality for every x);
    bits = k values (``randk_bits``: indices come from the shared seed).
    """

    name = "randk"
    payload_kind = "aligned"
    unbiased = True
    shared_randomness = True

    def __init__(self, ratio=None, k=None, independent=False):
        self.size = SizeRule(ratio, k, "randk")
        if not isinstance(independent, bool):
            raise CompressorConfigError(f"independent must be True or False, got {independent!r}")
        self.independent = independent
        if independent:     # instance attributes shadow the class's shared-seed declarations
            self.payload_kind = "sparse"
            self.shared_randomness = False

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        g = check_generator(self.name, generator, flat.device)
        k = self.size(d)
        idx = sample_subset_numba(d, k, g) if use_numba(flat) else sample_subset(d, k, g, flat.device)
        vals, ok = gather(flat, idx, d / k if k else 1.0)
        if not ok:
            raise_nonfinite(self.name)
        if self.independent:
            return make_payload("sparse", x.shape, x.dtype, vals, indices=idx,
                                wire_bits={"values": dtype_bits(x.dtype) * k, "indices": th.index_bits(d, k)})
        return make_payload("aligned", x.shape, x.dtype, vals, indices=idx,
                            wire_bits={"values": dtype_bits(x.dtype) * k})

    def omega(self, d):
        return th.randk_omega(d, self.size(d))

    def bits(self, d, dtype=torch.float32):
        if self.independent:
            return th.sparse_bits(d, self.size(d), dtype_bits(dtype))
        return th.randk_bits(d, self.size(d), dtype_bits(dtype))

    def values_len(self, d):
        return self.size(d)

    def hyper(self):
        return {**self.size.hyper(), **({"independent": True} if self.independent else {})}
