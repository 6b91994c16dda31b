"""Block masks in the formats a block-sparse protocol sends (OmniReduce, Fei et al., SIGCOMM'21), and
its look-ahead metadata (the blocks themselves are scanned and packed by :mod:`.blocks`).

* ``mask_to_bitmap(mask)`` / ``bitmap_to_mask(bitmap, nb)``: uint8, block ``b`` = bit ``b % 8`` of
  byte ``b // 8``;
* ``mask_to_indices(mask)`` / ``indices_to_mask(idx, nb)``: ascending int64 block indices;
* ``next_nonzero(mask, num_lanes)`` -> ``LookAhead(next, first)``: the "next non-zero block" of each
  block in its lane.

CPU masks use :mod:`._kernels` (``backend="auto" | "numba" | "torch"``); the two paths agree exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..errors import CodecError
from . import _kernels as K
from ._common import use_numba

__all__ = ["mask_to_bitmap", "bitmap_to_mask", "mask_to_indices", "indices_to_mask", "LookAhead", "next_nonzero"]


# --------------------------------------------------------------------------- mask formats


def _check_bool_mask(mask) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CodecError(f"mask must be a 1-D torch.bool tensor, got {got}")


def mask_to_bitmap(mask: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Compact bitmap of a block mask: ``uint8[ceil(nb / 8)]``, LSB-first.

    Bit order: block ``b`` is bit ``b % 8`` (value ``1 << (b % 8)``) of byte ``b // 8`` -- numpy's
    ``packbits(..., bitorder="little")``. Padding bits of the last byte are zero. This is the
    per-message block bitmap a block-sparse protocol can send instead of a list of block indices
    (1 bit per block against 8 bytes per selected block: smaller above a density of 1/64).

    Args:
        mask: the block mask (``torch.bool``).
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    _check_bool_mask(mask)
    if use_numba(backend, True, mask):
        return torch.from_numpy(np.packbits(mask.contiguous().numpy(), bitorder="little"))
    nb = mask.numel()
    nbytes = -(-nb // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=mask.device)
    padded[:nb] = mask
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded.view(nbytes, 8) * weights).sum(dim=1, dtype=torch.uint8)


def bitmap_to_mask(bitmap: torch.Tensor, num_blocks: int, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`mask_to_bitmap`; raises :class:`CodecError` on a wrong length or on set
    padding bits (a corrupt or mismatched bitmap).

    Args:
        bitmap: the bitmap.
        num_blocks: the number of blocks it covers.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    if not isinstance(bitmap, torch.Tensor) or bitmap.dtype != torch.uint8 or bitmap.dim() != 1:
        raise CodecError("bitmap must be a 1-D torch.uint8 tensor")
    nb = int(num_blocks)
    nbytes = -(-nb // 8)
    if nb < 0 or bitmap.numel() != nbytes:
        raise CodecError(f"a bitmap of {nb} blocks has {nbytes} bytes, got {bitmap.numel()}")
    if use_numba(backend, True, bitmap):
        bits = torch.from_numpy(np.unpackbits(bitmap.contiguous().numpy(), bitorder="little").view(np.bool_))
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
        bits = ((bitmap.view(-1, 1) >> shifts) & 1).view(-1).bool()
    if bool(bits[nb:].any()):
        raise CodecError(f"bitmap has bits set past block {nb - 1} (padding must be zero)")
    return bits[:nb].clone() if bits.numel() != nb else bits


def mask_to_indices(mask: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Ascending ``int64`` indices of the selected blocks (``torch.nonzero(mask).flatten()``).

    Args:
        mask: the block mask.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    _check_bool_mask(mask)
    if use_numba(backend, True, mask):
        idx = torch.empty(mask.numel(), dtype=torch.int64)
        k = K.select_blocks(mask.numpy(), idx.numpy())
        return idx[:k].clone()
    return torch.nonzero(mask).flatten()


def indices_to_mask(indices: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Block mask with ``mask[indices] = True`` (order and repeats do not matter); indices outside
    ``[0, num_blocks)`` raise :class:`CodecError`. Torch ops on any device."""
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 1
        or indices.is_floating_point()
        or indices.is_complex()
        or indices.dtype == torch.bool
    ):
        raise CodecError("indices must be a 1-D integer tensor")
    nb = int(num_blocks)
    if nb < 0:
        raise CodecError(f"num_blocks must be >= 0, got {num_blocks}")
    mask = torch.zeros(nb, dtype=torch.bool, device=indices.device)
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= nb:
            raise CodecError(f"block index {lo if lo < 0 else hi} is outside [0, {nb})")
        mask[indices.long()] = True
    return mask


# --------------------------------------------------------------------------- look-ahead


class LookAhead(NamedTuple):
    """OmniReduce's "next non-zero block" metadata of one worker (Fei et al. SIGCOMM'21, Sec. 3).

    Blocks are dealt to ``num_lanes`` lanes round-robin: block ``b`` is in lane ``b % num_lanes``
    (a lane is the stream of blocks one aggregator slot handles, in increasing order).

    ``next[b]`` (int64, one per block): the smallest selected block ``b' > b`` of the same lane, or
    the sentinel ``num_blocks`` when there is none. Defined for every ``b``, selected or not, so a
    worker can answer "what is my next block after ``b``" wherever the stream stands.
    ``first[l]`` (int64, one per lane): the first selected block of lane ``l``, or ``num_blocks``.

    Protocol use: a worker starts lane ``l`` by sending block ``first[l]`` (if ``< num_blocks``) with
    ``next[first[l]]`` attached; whenever it sends block ``b`` it attaches ``next[b]``. The aggregator
    keeps, per lane, the latest look-ahead of every worker; the next block the lane needs is their
    minimum -- the sentinel is larger than any block index, so ``min`` needs no special case -- and
    the lane is finished when that minimum equals ``num_blocks``. The workers whose look-ahead equals
    the requested block send it; the others contribute zeros for it without sending.
    """

    next: torch.Tensor
    first: torch.Tensor


def next_nonzero(mask: torch.Tensor, num_lanes: int, *, backend: str = "auto") -> LookAhead:
    """Look-ahead arrays of a block mask for ``num_lanes`` lanes; see :class:`LookAhead`.

    CPU kernel: one backward pass keeping the last selected block seen per lane. Torch path (any
    device): a suffix minimum (``cummin`` on the flipped ``(rows, num_lanes)`` grid) per lane.

    Args:
        mask: the block mask.
        num_lanes: the number of lanes (OmniReduce's aggregator slots).
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    _check_bool_mask(mask)
    if isinstance(num_lanes, bool) or not isinstance(num_lanes, (int, np.integer)) or num_lanes < 1:
        raise CodecError(f"num_lanes must be a positive integer, got {num_lanes!r}")
    num_lanes = int(num_lanes)
    if use_numba(backend, True, mask):
        nxt = torch.empty(mask.numel(), dtype=torch.int64)
        first = torch.empty(num_lanes, dtype=torch.int64)
        K.next_nonzero(mask.numpy(), num_lanes, nxt.numpy(), first.numpy())
        return LookAhead(nxt, first)
    return _next_nonzero_torch(mask, num_lanes)


def _next_nonzero_torch(mask: torch.Tensor, num_lanes: int) -> LookAhead:
    nb = mask.numel()
    dev = mask.device
    rows = -(-nb // num_lanes)
    if rows == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return LookAhead(empty, torch.full((num_lanes,), nb, dtype=torch.int64, device=dev))
    padded = torch.zeros(rows * num_lanes, dtype=torch.bool, device=dev)
    padded[:nb] = mask
    pos = torch.arange(rows * num_lanes, dtype=torch.int64, device=dev)
    grid = torch.where(padded, pos, torch.full_like(pos, nb)).view(rows, num_lanes)
    # suffix minimum down each lane (column): smallest selected block at or after row r
    suffix = grid.flip(0).cummin(dim=0).values.flip(0)
    nxt = torch.cat([suffix[1:], torch.full((1, num_lanes), nb, dtype=torch.int64, device=dev)])
    return LookAhead(nxt.reshape(-1)[:nb].contiguous(), suffix[0].contiguous())
