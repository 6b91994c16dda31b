"""Numba kernels of the block codec (CPU path); the fixed-point kernels are in :mod:`._fixedkernels`.

Every kernel works on 1-D C-contiguous numpy buffers -- zero-copy views of CPU tensors -- and is
compiled lazily (``cache=True``: the machine code is written to the numba cache and reused by later
processes) and with ``nogil=True`` so that simulated workers running as threads execute them
concurrently. None uses ``parallel=True``: the default numba threading layer (workqueue) aborts when
two Python threads launch parallel kernels at once, which is exactly what the SimFabric's worker
threads would do; and nested thread pools would oversubscribe the cores those threads already use
(the scan is memory-bound, so ``prange`` has little to gain: BENCHMARKS.md, "Codec").

Signatures compiled (kept small on purpose; each costs compile time on the first run):

====================  =================================================================
kernel                specialisations actually used
====================  =================================================================
``scan_blocks``       bits uint32 (float32 input), uint64 (float64 input)
``block_absmax``      bits uint32, uint64
``select_blocks``     bool mask (one)
``pack_blocks``       float32, float64
``unpack_add``        float32, float64
``next_nonzero``      bool mask (one)
====================  =================================================================

Performance rules (the figures: BENCHMARKS.md, "Codec"): inner loops index a *slice* of the block
(``blk = a[s:e]; for i in range(blk.size): ... blk[i]``) rather than ``a[s + i]``, because numba's
negative-index wrap-around check on ``s + i`` stops LLVM from vectorising the loop. A vectorised scan
is memory-bound, so each dtype is read at its own width (wider words would not read fewer bytes).
Copies go through ``llvm.memcpy`` (libc ``memcpy``, the routine ``numpy.copyto`` uses), and the
gather of scattered blocks prefetches about ``_PREFETCH_AHEAD`` bytes of blocks ahead.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# --------------------------------------------------------------------------- intrinsics


@intrinsic
def _memcpy(typingctx, dst, dst_off, src, src_off, count):
    """``dst[dst_off:dst_off+count] = src[src_off:src_off+count]`` via ``llvm.memcpy`` (no overlap)."""
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        dty, _, sty, _, _ = signature.args
        d, doff, s, soff, cnt = args
        darr = context.make_array(dty)(context, builder, d)
        sarr = context.make_array(sty)(context, builder, s)
        dptr = builder.gep(darr.data, [doff])
        sptr = builder.gep(sarr.data, [soff])
        itemsize = context.get_abi_sizeof(context.get_value_type(dty.dtype))
        cgutils.raw_memcpy(builder, dptr, sptr, cnt, itemsize)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, off):
    """Hint the cache to load the line holding ``arr[off]`` (``llvm.prefetch``, read, high locality)."""
    sig = types.void(arr, types.intp)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# --------------------------------------------------------------------------- block scan


@njit(cache=True, nogil=True)
def scan_blocks(bits, block, absmask, thr_bits, out):
    """OmniReduce's non-zero block test (Fei et al., SIGCOMM'21): ``out[b] = max_i (bits[i] & absmask)
    > thr_bits`` over block ``b`` (the last one may be short).

    ``bits`` is the float buffer viewed as unsigned integers of the same width and ``absmask`` clears
    the sign bit, so ``bits & absmask`` is the bit pattern of ``|x|``. For non-negative IEEE floats the
    unsigned order of the bit patterns is the numeric order, and NaN patterns lie above +Inf: with
    ``thr_bits`` the pattern of the threshold, "some ``|x| > thr`` or NaN" is exactly this comparison.
    For ``thr_bits == 0`` the max is replaced by an OR reduction (same result: the OR of patterns is
    non-zero iff one of them is), which is the cheapest vectorisable reduction. A block whose first
    element already decides it is settled at once (dense data: one cache line per block instead of the
    whole block); the others, nearly all of them at low density, are reduced to their end.
    """
    nb = out.size
    zero = absmask ^ absmask
    if thr_bits == zero:
        for b in range(nb):
            blk = bits[b * block : (b + 1) * block]
            if (blk[0] & absmask) != zero:
                out[b] = True
                continue
            acc = zero
            for i in range(blk.size):
                acc |= blk[i]
            out[b] = (acc & absmask) != zero
    else:
        for b in range(nb):
            blk = bits[b * block : (b + 1) * block]
            if (blk[0] & absmask) > thr_bits:
                out[b] = True
                continue
            m = zero
            for i in range(blk.size):
                m = max(m, blk[i] & absmask)
            out[b] = m > thr_bits


@njit(cache=True, nogil=True)
def block_absmax(bits, block, absmask, out):
    """``out[b] = max_i (bits[i] & absmask)`` over block ``b``: the bit pattern of ``max |x|``, from
    which SwitchML's per-packet exponent is read (Sapio et al., NSDI'21)."""
    nb = out.size
    zero = absmask ^ absmask
    for b in range(nb):
        blk = bits[b * block : (b + 1) * block]
        m = zero
        for i in range(blk.size):
            m = max(m, blk[i] & absmask)
        out[b] = m


# --------------------------------------------------------------------------- mask -> indices


@intrinsic
def _cttz(typingctx, src):
    """Count trailing zero bits (``llvm.cttz``, one ``tzcnt`` instruction)."""

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return src(src), codegen


_Z64 = np.uint64(0)
_BYTE = np.uint64(0xFF)
_LOW3 = np.uint64(7)
_SH3 = np.uint64(3)


@njit(cache=True, nogil=True)
def select_blocks(mask, idx):
    """Write the indices of the true entries of the bool array ``mask`` to ``idx`` (ascending) and
    return their count. ``idx`` needs ``mask.size`` entries.

    The mask is read as 64-bit words (8 entries each) in tiles of 8 words: a tile is first
    OR-reduced (vectorised) and skipped if empty; in a non-empty tile each non-zero word yields its
    set bytes by count-trailing-zeros, so the cost is about one read of the mask plus a few cycles
    per selected block.
    """
    n = mask.size
    nw = n // 8
    words = mask[: nw * 8].view(np.uint64)
    k = 0
    for t in range(0, nw, 8):
        tile = words[t : t + 8]
        acc = _Z64
        for i in range(tile.size):
            acc |= tile[i]
        if acc != _Z64:
            for i in range(tile.size):
                w = tile[i]
                base = (t + i) * 8
                while w != _Z64:
                    tz = _cttz(w)
                    idx[k] = base + np.int64(tz >> _SH3)
                    k += 1
                    w &= ~(_BYTE << (tz & ~_LOW3))
    for b in range(nw * 8, n):
        if mask[b]:
            idx[k] = b
            k += 1
    return k


# --------------------------------------------------------------------------- pack / unpack-add

_PREFETCH_AHEAD = 8192  # bytes of isolated selected blocks prefetched ahead of the current copy
_PREFETCH_BYTES = 4096  # at most this many leading bytes of a block are prefetched


@njit(cache=True, nogil=True)
def _prefetch_distance(block, itemsize):
    """Selected blocks to prefetch ahead: ``_PREFETCH_AHEAD // (block * itemsize)`` clamped to
    ``[2, 32]`` (8 blocks of 256 float32, 32 of 64, 2 of 1024)."""
    return max(2, min(32, _PREFETCH_AHEAD // (block * itemsize)))


@njit(cache=True, nogil=True)
def _prefetch_block(a, start, stop):
    step = 64 // a.itemsize
    stop = min(stop, start + _PREFETCH_BYTES // a.itemsize)
    for p in range(start, stop, step):
        _prefetch(a, p)


@njit(cache=True, nogil=True)
def _selected_length(idx, k, block, n):
    """Summed length of the selected blocks ``idx[:k]`` of an ``n``-element buffer."""
    if k == 0:
        return 0
    return (k - 1) * block + min(block, n - idx[k - 1] * block)


@njit(cache=True, nogil=True)
def pack_blocks(x, mask, block, out):
    """OmniReduce block packing: copy the blocks of ``x`` selected by the bool ``mask``, in order, to
    the front of ``out`` (the last block of ``x`` may be short and packs short).

    Consecutive selected blocks are merged into one run and each run is one ``memcpy``, so a dense
    mask costs one copy of the buffer. Isolated blocks are prefetched about 8 KiB ahead so the loads
    of the next blocks overlap the current copy. Returns the number of elements written,
    or ``-(needed)`` without writing anything when ``out`` is too small.
    """
    n = x.size
    idx = np.empty(mask.size, np.int64)
    k = select_blocks(mask, idx)
    length = _selected_length(idx, k, block, n)
    if out.size < length:
        return -length
    dist = _prefetch_distance(block, x.itemsize)
    o = 0
    j = 0
    pf = 0  # entries of idx[:k] already prefetched
    while j < k:
        b0 = idx[j]
        j += 1
        while j < k and idx[j] == idx[j - 1] + 1:
            j += 1
        stop_pf = min(j + dist, k)
        for q in range(max(pf, j), stop_pf):
            bq = idx[q]
            if idx[q - 1] + 1 != bq:  # a contiguous successor is streamed by the hardware prefetcher
                _prefetch_block(x, bq * block, min((bq + 1) * block, n))
        pf = max(pf, stop_pf)
        s = b0 * block
        e = min(idx[j - 1] * block + block, n)
        _memcpy(out, o, x, s, e - s)
        o += e - s
    return o


@njit(cache=True, nogil=True)
def unpack_add(packed, mask, block, out):
    """Scatter-add: the ``r``-th selected block of ``out`` += the ``r``-th block of ``packed``.

    The inverse layout of :func:`pack_blocks`. Returns the number of elements the mask selects; if
    that is not ``packed.size`` nothing is written (the caller reports the mismatch).
    """
    n = out.size
    idx = np.empty(mask.size, np.int64)
    k = select_blocks(mask, idx)
    length = _selected_length(idx, k, block, n)
    if packed.size != length:
        return length
    dist = _prefetch_distance(block, out.itemsize)
    # The run/prefetch loop mirrors pack_blocks on purpose: numba compiles an inlined helper that
    # returns a tuple to slower code (experiments/bench/codec.py shows it), so it stays written out.
    o = 0
    j = 0
    pf = 0
    while j < k:
        b0 = idx[j]
        j += 1
        while j < k and idx[j] == idx[j - 1] + 1:
            j += 1
        stop_pf = min(j + dist, k)
        for q in range(max(pf, j), stop_pf):
            bq = idx[q]
            if idx[q - 1] + 1 != bq:
                _prefetch_block(out, bq * block, min((bq + 1) * block, n))
        pf = max(pf, stop_pf)
        s = b0 * block
        e = min(idx[j - 1] * block + block, n)
        dst = out[s:e]
        src = packed[o : o + (e - s)]
        for i in range(dst.size):
            dst[i] += src[i]
        o += e - s
    return o


# --------------------------------------------------------------------------- OmniReduce look-ahead


@njit(cache=True, nogil=True)
def next_nonzero(mask, num_lanes, nxt, first):
    """OmniReduce's look-ahead metadata (Fei et al., SIGCOMM'21): ``nxt[b]`` is the next selected
    block after ``b`` in lane ``b % num_lanes`` (``nb`` if none); ``first[l]`` the first selected
    block of lane ``l`` (``nb`` if none). One backward pass keeping the last selected block per lane."""
    nb = mask.size
    for lane in range(num_lanes):
        first[lane] = nb
    lane = nb % num_lanes  # lane of block nb; stepping back one block steps back one lane
    for b in range(nb - 1, -1, -1):
        lane -= 1
        if lane < 0:
            lane = num_lanes - 1
        nxt[b] = first[lane]
        if mask[b]:
            first[lane] = b
