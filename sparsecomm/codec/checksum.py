"""A tensor's 64-bit checksum: what workers compare to tell that they hold the same bits.

The bytes of the tensor are read as little-endian 64-bit words ``w_0 .. w_{m-1}`` (the last one padded
with zero bytes) and combined position by position::

    checksum = nbytes * K3 + sum_i ((w_i XOR i K1) * K2)      (mod 2^64, as a signed int64)

with the odd constants ``K1``, ``K2``, ``K3`` below. Multiplying by an odd constant is a bijection of
the 64-bit words, so a change of any single word changes the sum; the position term makes a
permutation of words change it too. It detects accidental differences (replicas that drifted apart, a
flipped bit), not adversaries. The terms are independent, so the loop vectorises: one pass over the
memory, no allocation (Numba); the torch path (CUDA, non-contiguous tensors) gives the same value.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ._common import numba_eligible
from .. import kernels as _kernel_paths

K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
K3 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


@njit(cache=True, nogil=True)
def _words_sum(words, k1, k2):  # pragma: no cover - compiled
    acc = np.uint64(0)
    for i in range(words.size):
        acc += (words[i] ^ (np.uint64(i) * k1)) * k2
    return acc


def checksum(t: torch.Tensor, *, backend: str = "auto") -> int:
    """The checksum of ``t``'s bytes (module doc) as a Python int in the int64 range."""
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    m, tail = divmod(nbytes, 8)
    use_numba = backend == "numba" or (backend == "auto" and not _kernel_paths.torch_forced()
                                        and numba_eligible(t))
    if use_numba:
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        words = raw[:8 * m].view(np.uint64)
        acc = int(_words_sum(words, np.uint64(K1), np.uint64(K2)))
        if tail:
            last = int.from_bytes(raw[8 * m:].tobytes(), "little")
            acc += (last ^ ((m * K1) & _MASK)) * K2
        return _signed(acc + nbytes * K3)
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    if tail:
        raw = torch.cat([raw, raw.new_zeros(8 - tail)])
    words = raw.view(torch.int64)
    pos = torch.arange(words.numel(), dtype=torch.int64, device=words.device) * _signed(K1)
    acc = int(torch.bitwise_xor(words, pos).mul_(_signed(K2)).sum())
    return _signed(acc + nbytes * K3)
