"""The block codec: Numba kernels (CPU) with an equivalent torch-ops path (CUDA, non-contiguous,
float16/bfloat16) for the encodings the sparse and in-network transports put on the wire.

Block sparsity (OmniReduce, Fei et al., SIGCOMM'21) -- :mod:`sparsecomm.codec.blocks` (mask formats and
look-ahead: :mod:`sparsecomm.codec.masks`)::

    mask = nonzero_blocks(x, block_size)                 # bool per block: holds a non-zero (NaN/Inf too)
    BlockScan(x, block_size).into(mask, lo, hi)          # the same, range by range into a kept mask
    packed = pack_blocks(x, mask, block_size)            # selected blocks, concatenated (last one short)
    unpack_add(packed, mask, block_size, out)            # out[selected blocks] += packed, in place
    mask_to_bitmap(mask) / bitmap_to_mask(bitmap, nb)    # uint8, block b = bit b % 8 of byte b // 8
    mask_to_indices(mask) / indices_to_mask(idx, nb)     # ascending int64 block indices
    next_nonzero(mask, num_lanes) -> LookAhead(next, first)   # "next non-zero block" metadata

Fixed point (SwitchML, Sapio et al., NSDI'21) -- :mod:`sparsecomm.codec.fixed`::

    e = chunk_exponents(x, chunk)                        # per chunk: smallest e with 2^e > max|x|
    f = scale_from_exponents(e_max_over_workers, n)      # the n-worker int32 sum cannot overflow
    q = to_fixed(x, f, chunk=chunk, rounding="nearest" | "stochastic", seed=...)
    checked_add_(acc, q)                                 # the switch's integer add, overflow reported
    x = from_fixed(q_sum, f, chunk=chunk)

Wire bit packing (the encodings payloads travel in, ``Payload.to_wire``) -- :mod:`sparsecomm.codec.bits`::

    packed = bits.pack_bits(codes, k) ; codes = bits.unpack_bits(packed, n, k)      # k-bit two's complement
    packed = bits.pack_signs(codes)   ; codes = bits.unpack_signs(packed, n)        # 1 bit, int8 {-1, +1}
    packed = bits.pack_natural(vals)  ; vals = bits.unpack_natural(packed, n, dtype) # sign + exponent

Every function takes and returns torch tensors and accepts ``backend="auto" | "numba" | "torch"``
where both paths exist.
"""

from ..errors import CodecError
from . import bits
from ._common import num_blocks
from .blocks import BlockScan, nonzero_blocks, pack_blocks, packed_numel, unpack_add
from .fixed import (block_facts, checked_add_, chunk_exponents, from_fixed, from_fixed_blocks, scale_from_exponents,
                    to_fixed)
from .masks import LookAhead, bitmap_to_mask, indices_to_mask, mask_to_bitmap, mask_to_indices, next_nonzero

__all__ = [
    "bits",
    "CodecError",
    "num_blocks",
    "nonzero_blocks",
    "BlockScan",
    "packed_numel",
    "pack_blocks",
    "unpack_add",
    "mask_to_bitmap",
    "bitmap_to_mask",
    "mask_to_indices",
    "indices_to_mask",
    "LookAhead",
    "next_nonzero",
    "to_fixed",
    "from_fixed",
    "from_fixed_blocks",
    "chunk_exponents",
    "block_facts",
    "scale_from_exponents",
    "checked_add_",
]
