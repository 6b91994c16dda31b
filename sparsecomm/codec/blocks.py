"""Block-sparse encoding: non-zero block scan, pack, unpack-add (the mask formats and the look-ahead
metadata are in :mod:`.masks`).

The format is OmniReduce's (Fei et al., "Efficient Sparse Collective Communication and its
application to Accelerate Distributed Deep Learning", SIGCOMM'21): a flat tensor of ``n`` elements
is cut into ``nb = ceil(n / block_size)`` blocks of ``block_size`` consecutive elements (the last one
holds the remaining ``n - (nb - 1) * block_size`` elements), only the blocks that hold a non-zero
travel, and the receiver adds them into place.

* ``nonzero_blocks(x, B)`` -> ``mask`` (``torch.bool``, one entry per block): ``mask[b]`` is true iff
  block ``b`` holds an element that is not zero. NaN and +-Inf count as non-zero, ``-0.0`` as zero.
  With ``threshold=t > 0`` (OmniReduce's optional threshold), a block is zero iff every element has
  ``|x| <= t`` (NaN is never ``<= t``, so a NaN block is always sent).
* ``pack_blocks(x, mask, B)`` -> the selected blocks concatenated in block order; the last block
  packs short, so ``packed.numel() == packed_numel(mask, B, n)`` = the summed lengths of the selected
  blocks.
* ``unpack_add(packed, mask, B, out)``: ``out[block r-th selected] += packed[r-th block]``, in place.

Each function dispatches on its tensors: CPU, contiguous, float32/float64 -> the Numba kernels in
:mod:`sparsecomm.codec._kernels` (zero-copy on ``tensor.numpy()`` views); anything else (CUDA,
non-contiguous, float16/bfloat16) -> equivalent torch ops. ``backend="numba"`` / ``"torch"`` forces
one path (for tests and benchmarks). The two paths give identical results. No autograd.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CodecError
from . import _kernels as K
from ._common import (
    BITS,
    NUMBA_FLOATS,
    as_np,
    check_block_size,
    check_float,
    check_mask,
    num_blocks,
    use_numba,
)

__all__ = [
    "num_blocks",
    "nonzero_blocks",
    "BlockScan",
    "packed_numel",
    "pack_blocks",
    "unpack_add",
]


# --------------------------------------------------------------------------- threshold


def _threshold_value(threshold, np_float):
    """The largest ``np_float`` value ``<= threshold``: for data of that dtype, ``|x| <= threshold``
    iff ``|x| <= result`` (rounding the threshold to nearest could round it up past a datum)."""
    try:
        thr = float(threshold)
    except (TypeError, ValueError):
        raise CodecError(f"threshold must be a real number, got {threshold!r}") from None
    if not thr >= 0.0:  # also rejects NaN
        raise CodecError(f"threshold must be >= 0, got {threshold!r}")
    with np.errstate(over="ignore"):
        t = np_float(thr)
    if float(t) > thr:
        t = np.nextafter(t, np_float(0))
    return t


# --------------------------------------------------------------------------- scan


def nonzero_blocks(x: torch.Tensor, block_size: int, threshold: float = 0.0, *, backend: str = "auto") -> torch.Tensor:
    """Mask of the blocks of ``x.reshape(-1)`` that must travel (OmniReduce, Fei et al. SIGCOMM'21).

    ``mask[b] = any(x[i] != 0 for i in block b)`` for ``threshold == 0`` (NaN/Inf are non-zero, -0.0
    is zero), and ``mask[b] = not all(|x[i]| <= threshold)`` otherwise. Returns a ``torch.bool``
    tensor of ``ceil(n / block_size)`` entries on ``x.device``. Integer tensors (the codes of a
    quantized payload) are accepted with ``threshold == 0`` and scanned with torch ops.

    CPU kernel: the floats are read as unsigned integers with the sign bit masked off and reduced
    per block with OR (threshold 0) or max (threshold > 0, compared with the threshold's bit pattern,
    valid since non-negative IEEE floats order like their bit patterns and NaN lies above Inf);
    branch-free, vectorised, no early exit.

    Args:
        x: the tensor.
        block_size: elements per block.
        threshold: see above.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
        # integer codes (quantized payloads summed as integers): a block travels iff any code != 0
        block_size = check_block_size(block_size)
        if not (isinstance(threshold, (int, float)) and threshold == 0):
            raise CodecError("a threshold applies to float tensors only; integer codes use 0")
        return _block_any(x.reshape(-1) != 0, block_size, -(-x.numel() // block_size))
    check_float(x)
    block_size = check_block_size(block_size)
    n = x.numel()
    nb = -(-n // block_size)
    if use_numba(backend, x.dtype in NUMBA_FLOATS, x):
        uint, absmask = BITS[x.dtype]
        if isinstance(threshold, (int, float)) and threshold == 0:
            thr_bits = uint(0)
        else:
            np_float = np.float32 if x.dtype == torch.float32 else np.float64
            thr_bits = _threshold_value(threshold, np_float).view(uint)
        mask = torch.empty(nb, dtype=torch.bool)
        K.scan_blocks(as_np(x).view(uint), block_size, absmask, thr_bits, mask.numpy())
        return mask
    return _nonzero_blocks_torch(x.reshape(-1), block_size, nb, threshold)


class BlockScan:
    """:func:`nonzero_blocks` of one tensor, prepared once and run range by range into a mask the caller keeps:
    ``BlockScan(x, block_size, threshold).into(mask, lo, hi)`` sets ``mask[lo:hi]`` to ``nonzero_blocks`` of
    blocks ``[lo, hi)`` of ``x`` (the same values). The arguments are checked and the path chosen here, not per
    range: on the Numba path a range is one kernel call on views made once (``x``'s bits, ``mask``'s array),
    where :func:`nonzero_blocks` of a slice pays its checks, a fresh mask and the copy of it into the caller's
    (several times the kernel's own time on a dense range: the kernel reads one element per block). A range
    scan of a worker that sends one range while it scans the next (OmniReduce's colocated worker)."""

    __slots__ = ("x", "block_size", "threshold", "numel", "_bits", "_absmask", "_thr_bits", "_np_mask", "_mask")

    def __init__(self, x: torch.Tensor, block_size: int, threshold: float = 0.0) -> None:
        check_float(x)
        self.x = x if x.dim() == 1 else x.reshape(-1)
        self.block_size, self.threshold = check_block_size(block_size), threshold
        self.numel = x.numel()
        self._bits = None
        if use_numba("auto", x.dtype in NUMBA_FLOATS, x):
            uint, self._absmask = BITS[x.dtype]
            if isinstance(threshold, (int, float)) and threshold == 0:
                self._thr_bits = uint(0)
            else:
                self._thr_bits = _threshold_value(threshold, np.float32 if x.dtype == torch.float32
                                                  else np.float64).view(uint)
            self._bits = as_np(x).view(uint)
        else:
            _threshold_value(threshold, np.float32)      # (checked here as on the Numba path)
        self._mask = self._np_mask = None

    def into(self, mask: torch.Tensor, lo: int, hi: int) -> None:
        """``mask[lo:hi] = nonzero_blocks(blocks [lo, hi) of x)`` (``mask``: a CPU ``torch.bool`` tensor of at
        least ``hi`` entries; its numpy view is kept for the next range)."""
        if hi <= lo:
            return
        bs = self.block_size
        end = min(hi * bs, self.numel)
        if self._bits is None:
            mask[lo:hi] = nonzero_blocks(self.x[lo * bs: end], bs, self.threshold)
            return
        if mask is not self._mask:
            self._mask, self._np_mask = mask, mask.numpy()
        K.scan_blocks(self._bits[lo * bs: end], bs, self._absmask, self._thr_bits, self._np_mask[lo:hi])


def _nonzero_blocks_torch(x: torch.Tensor, block_size: int, nb: int, threshold) -> torch.Tensor:
    if x.dtype in NUMBA_FLOATS:
        thr = float(_threshold_value(threshold, np.float32 if x.dtype == torch.float32 else np.float64))
    else:  # float16 / bfloat16 values are exact in float32: compare there
        thr = float(_threshold_value(threshold, np.float32))
        x = x.float()
    nz = (x != 0) if thr == 0.0 else ~(x.abs() <= thr)
    return _block_any(nz, block_size, nb)


def _block_any(nz: torch.Tensor, block_size: int, nb: int) -> torch.Tensor:
    """Per block of ``block_size`` (the last one possibly short), whether any entry of ``nz`` is set."""
    mask = torch.empty(nb, dtype=torch.bool, device=nz.device)
    full = nz.numel() // block_size
    if full:
        mask[:full] = nz[: full * block_size].view(full, block_size).any(dim=1)
    if nb > full:
        mask[full] = nz[full * block_size :].any()
    return mask


# --------------------------------------------------------------------------- pack / unpack


def packed_numel(mask: torch.Tensor, block_size: int, n: int) -> int:
    """Number of elements :func:`pack_blocks` produces: the summed lengths of the selected blocks of
    an ``n``-element tensor (the last block is ``n - (nb - 1) * block_size`` long).

    Args:
        mask: the block mask.
        block_size: elements per block.
        n: the tensor's length.
    """
    block_size = check_block_size(block_size)
    nb = num_blocks(n, block_size)
    check_mask(mask, nb)
    if mask.device.type == "cpu" and mask.is_contiguous():
        count = int(np.count_nonzero(mask.numpy()))
    else:
        count = int(mask.sum())
    total = count * block_size
    if count and n % block_size and bool(mask[nb - 1]):
        total -= block_size - n % block_size
    return total


def _split(mask: torch.Tensor, block_size: int, n: int):
    """(number of full blocks, indices of the selected full blocks, whether the short tail block
    is selected and its length) -- the torch path works on the ``(full, block_size)`` row view."""
    full = n // block_size
    rows = torch.nonzero(mask[:full]).flatten()
    tail = n - full * block_size
    tail_sel = bool(tail) and bool(mask[full])
    return full, rows, tail_sel, tail


def _pack_torch(x: torch.Tensor, mask: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    if not out.is_contiguous():
        tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
        _pack_torch(x, mask, block_size, tmp)
        out.copy_(tmp)
        return
    n = x.numel()
    flat = x.reshape(-1)
    full, rows, tail_sel, tail = _split(mask, block_size, n)
    body = rows.numel() * block_size
    if body:
        grid = flat[: full * block_size].view(full, block_size)
        torch.index_select(grid, 0, rows, out=out[:body].view(-1, block_size))
    if tail_sel:
        out[body:].copy_(flat[full * block_size :])


def pack_blocks(
    x: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Concatenate the blocks of ``x.reshape(-1)`` selected by ``mask``, in block order (OmniReduce).

    Returns a 1-D tensor of :func:`packed_numel` elements with the dtype and device of ``x``. With
    ``out`` (a 1-D tensor of the same dtype/device with at least that many elements) the blocks are
    written into ``out`` and ``out`` itself (if exactly that long) or its leading view is returned:
    no allocation, as a transport reusing one send buffer wants.

    CPU kernel: runs of consecutive selected blocks are copied with one ``memcpy`` each (a dense
    mask is one copy of the buffer) and isolated blocks are prefetched a few blocks ahead.

    Args:
        x: the tensor.
        mask: the blocks to keep.
        block_size: elements per block.
        out: see above.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    check_float(x)
    block_size = check_block_size(block_size)
    n = x.numel()
    nb = -(-n // block_size)
    check_mask(mask, nb, x.device)
    if out is not None and (
        not isinstance(out, torch.Tensor) or out.dtype != x.dtype or out.device != x.device or out.dim() != 1
    ):
        raise CodecError(
            f"out must be a 1-D {x.dtype} tensor on {x.device}, got "
            f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} "
            f"on {getattr(out, 'device', '?')}"
        )
    if out is None:
        out = torch.empty(packed_numel(mask, block_size, n), dtype=x.dtype, device=x.device)
    if use_numba(backend, x.dtype in NUMBA_FLOATS, x, out, mask):
        written = K.pack_blocks(as_np(x), mask.numpy(), block_size, as_np(out))
        if written < 0:
            raise CodecError(f"out has {out.numel()} elements but {-written} are packed")
        return out if written == out.numel() else out[:written]
    length = packed_numel(mask, block_size, n)
    if out.numel() < length:
        raise CodecError(f"out has {out.numel()} elements but {length} are packed")
    if out.numel() != length:
        out = out[:length]
    if length:
        _pack_torch(x, mask, block_size, out)
    return out


def unpack_add(
    packed: torch.Tensor, mask: torch.Tensor, block_size: int, out: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Scatter-add ``packed`` (the layout of :func:`pack_blocks`) into the selected blocks of ``out``.

    ``out.reshape(-1)[block b] += packed[its slice]`` for each selected ``b``, in place; returns
    ``out``. ``packed`` must hold exactly ``packed_numel(mask, block_size, out.numel())`` elements; it
    is converted to ``out.dtype`` if needed. The receive side of OmniReduce's block stream.

    Args:
        packed: the packed blocks.
        mask: their blocks.
        block_size: elements per block.
        out: the tensor added to.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    check_float(out, "out")
    check_float(packed, "packed")
    block_size = check_block_size(block_size)
    n = out.numel()
    nb = -(-n // block_size)
    check_mask(mask, nb, out.device)
    if packed.device != out.device:
        raise CodecError(f"packed is on {packed.device} but out is on {out.device}")
    if packed.dtype != out.dtype:
        packed = packed.to(out.dtype)
    if use_numba(backend, out.dtype in NUMBA_FLOATS, out, packed, mask):
        length = K.unpack_add(as_np(packed), mask.numpy(), block_size, as_np(out))
    else:
        length = packed_numel(mask, block_size, n)
        if packed.numel() == length and length:
            if out.is_contiguous():
                _unpack_add_torch(packed.reshape(-1), mask, block_size, out)
            else:
                flat = out.contiguous()
                _unpack_add_torch(packed.reshape(-1), mask, block_size, flat)
                out.copy_(flat)
    if packed.numel() != length:
        raise CodecError(
            f"packed has {packed.numel()} elements but the mask selects {length} "
            f"(block_size={block_size}, n={n})"
        )
    return out


def _unpack_add_torch(packed, mask, block_size, out):
    flat = out.view(-1)
    n = flat.numel()
    full, rows, tail_sel, tail = _split(mask, block_size, n)
    body = rows.numel() * block_size
    if body:  # the selected rows are distinct: one addition per element, as in the kernel
        flat[: full * block_size].view(full, block_size).index_add_(0, rows, packed[:body].view(-1, block_size))
    if tail_sel:
        flat[full * block_size :].add_(packed[body:])
