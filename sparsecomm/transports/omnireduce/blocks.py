"""The worker's view of its data as blocks: which blocks are non-zero, gathering them into a message,
writing aggregated blocks into the result.

Two sources: :class:`DenseSource` (a flat tensor; blocks found by the codec's scan, gathered straight
from the tensor, no packing pass) and :class:`PackedSource` (blocks built directly from a sparse
payload's ``(indices, values)``, never densified). The last block of a tensor whose length is not a
multiple of ``block_size`` is short; it travels zero-padded, except in a message of every block of a
one-round channel, which is the tensor's range as it lies (:func:`.wire.short_end`: :meth:`DenseSource.run_to_end`
sends it, :meth:`BlockSink.write` takes it flat).
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import torch
from numba import njit

from ... import codec

NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int8: np.int8,
         torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8}


def block_run(ids: np.ndarray) -> tuple[int, int] | None:
    """``(first, stop)`` if ``ids`` is the ascending run ``first, first+1, ..., stop-1``, else None."""
    if ids.size and int(ids[-1]) - int(ids[0]) + 1 == ids.size and (ids.size == 1 or (ids[1:] - ids[:-1] == 1).all()):
        return int(ids[0]), int(ids[-1]) + 1
    return None



class TailRun:
    """A run of blocks that ends with a source's short last block, without a copy: the full blocks as a
    view of the source's rows (``head``) and the last one zero-padded to a whole block (``last``, one
    row, the source's own padded copy of it); as a ``(k, block_size)`` message of these blocks would be,
    split in two (:meth:`DenseSource.tail_run`; summed by :meth:`.core.MessageSums.add`)."""

    __slots__ = ("head", "last")

    def __init__(self, head: torch.Tensor, last: torch.Tensor) -> None:
        self.head, self.last = head, last

    @property
    def dtype(self) -> torch.dtype:
        return self.head.dtype

    def numel(self) -> int:
        return self.head.numel() + self.last.numel()

    def joined(self) -> torch.Tensor:
        """The blocks as one ``(k, block_size)`` tensor (a copy)."""
        return torch.cat((self.head, self.last))


class _Blocks:
    """Common part: ``numel``, ``block_size``, ``nb``, ``mask`` (bool per block); ``lazy``: ``mask`` is valid
    only where :meth:`scan` has made it so (else valid whole from the start)."""

    numel: int
    block_size: int
    nb: int
    mask: torch.Tensor
    dtype: torch.dtype
    lazy: bool = False

    @property
    def tail(self) -> int:
        """Length of the short last block (0 if every block is full)."""
        return self.numel % self.block_size

    def scan(self, lo: int, hi: int) -> None:
        """Make ``mask[lo:hi]`` valid (a no-op unless the source scans lazily)."""

    def settle(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Before any sum lands in blocks ``[lo, hi)`` of the result ``out`` (once they are scanned): make
        the blocks that count as zero zero there (a no-op unless the result is the source's own tensor)."""

    def tail_run(self, ids: np.ndarray) -> TailRun | None:
        """The blocks ``ids`` without a copy, when they are a run ending with the short last block
        (:class:`TailRun`); None where they are not, or where the source has no such view."""
        return None

    def run_to_end(self, ids: np.ndarray) -> torch.Tensor | None:
        """The blocks ``ids`` as the tensor's range, unpadded, when they are a run ending with the short last
        block; None where they are not, or where the source has no such view."""
        return None

    def run_bytes(self, ids: np.ndarray, to_end: bool) -> torch.Tensor | None:
        """The bytes of :meth:`view` (``to_end``: of :meth:`run_to_end`) as one ``uint8`` view of the tensor, where
        those are whole 4-byte words (a message of them as it lies); None where there is no such view."""
        return None


class DenseSource(_Blocks):
    """Blocks of a flat tensor. ``threshold > 0`` (OmniReduce's optional threshold) treats blocks with
    every ``|x| <= threshold`` as zero; they are then zeroed in ``x`` if the result is written in place
    (:meth:`settle`, range by range: a range's blocks are known only once it is scanned).
    ``lazy=True``: ``mask`` is filled range by range by :meth:`scan` (so that a worker can send one
    aggregator's blocks while it still scans the rest)."""

    def __init__(self, flat: torch.Tensor, block_size: int, threshold: float = 0.0, lazy: bool = False) -> None:
        self.flat = flat
        self.numel = flat.numel()
        self.block_size = block_size
        self.dtype = flat.dtype
        self.nb = -(-self.numel // block_size)
        self.full = self.numel // block_size
        self.threshold = threshold
        self._scan = None
        if lazy:
            self.mask = torch.zeros(self.nb, dtype=torch.bool)
            if flat.is_floating_point():   # (integer codes: nonzero_blocks' torch path, per range)
                self._scan = codec.BlockScan(flat, block_size, threshold)
        else:
            self.mask = codec.nonzero_blocks(flat, block_size, threshold)   # floats, or integer codes
        self.lazy = lazy
        self.rows = flat[: self.full * block_size].view(self.full, block_size)
        self._flat_bytes = None     # (the tensor's bytes, viewed by the first :meth:`run_bytes`)
        self._tail_block = None
        if self.tail:
            self._tail_block = torch.zeros(block_size, dtype=flat.dtype, device=flat.device)
            self._tail_block[: self.tail] = flat[self.full * block_size:]

    def scan(self, lo: int, hi: int) -> None:
        """Find the non-zero blocks among ``[lo, hi)`` (lazy sources; the codec's scan of that range, float data
        through a :class:`~sparsecomm.codec.BlockScan` made once per source: one kernel call per range)."""
        if self.lazy and hi > lo:
            if self._scan is not None:     # (prepared once: a kernel call per range on the Numba path)
                self._scan.into(self.mask, lo, hi)
                return
            bs = self.block_size
            self.mask[lo:hi] = codec.nonzero_blocks(self.flat[lo * bs: min(hi * bs, self.numel)], bs, self.threshold)

    def settle(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """In place (``out`` is this source's tensor) with a threshold: zero the non-zero blocks of
        ``[lo, hi)`` under it (not in ``mask``). ``mask[lo:hi]`` must be valid (scanned) and no sum written
        there yet; the caller (:func:`.worker.verdict`, aggregator ``a``'s range at ``a``'s OK verdict) sees to
        both. Not at the result's making: that is the first OK verdict, which may come before the later
        ranges are scanned (a ``Poll`` of the scan takes it where receives complete on their own)."""
        if not (self.threshold > 0 and hi > lo and out.data_ptr() == self.flat.data_ptr()
                and out.dtype == self.flat.dtype):
            return
        bs = self.block_size
        below = codec.nonzero_blocks(self.flat[lo * bs: min(hi * bs, self.numel)], bs) & ~self.mask[lo:hi]
        ids = below.nonzero().flatten()
        if not ids.numel():
            return
        ids = ids + lo
        full = ids[ids < self.full]
        if full.numel():
            self.rows.index_fill_(0, full, 0)
        if full.numel() < ids.numel():     # the short last block
            self.flat[self.full * bs:] = 0

    def view(self, ids: np.ndarray) -> torch.Tensor | None:
        """The blocks ``ids`` as a view of the tensor, when they are a run of full blocks (no copy)."""
        run = block_run(ids)
        return self.rows[run[0]:run[1]] if run is not None and run[1] <= self.full else None

    def tail_run(self, ids: np.ndarray) -> TailRun | None:
        """The blocks ``ids`` without a copy when they are a run ending with the short last block (which
        :meth:`view` cannot give: the tensor ends inside that block), as a :class:`TailRun`."""
        run = block_run(ids)
        if run is None or self._tail_block is None or run[1] != self.nb:
            return None
        return TailRun(self.rows[run[0]:self.full], self._tail_block.view(1, -1))

    def run_to_end(self, ids: np.ndarray) -> torch.Tensor | None:
        """The blocks ``ids`` as the tensor's range itself, unpadded, when they are a run ending with the
        short last block (a message of them without the padding, :func:`.wire.short_end`); else None."""
        run = block_run(ids)
        if run is None or self._tail_block is None or run[1] != self.nb:
            return None
        return self.flat[run[0] * self.block_size:]

    def run_bytes(self, ids: np.ndarray, to_end: bool) -> torch.Tensor | None:
        """:meth:`_Blocks.run_bytes`: a slice of the tensor's bytes, viewed once per source (one view per message,
        not a view, a reshape and a byte view of it)."""
        run = block_run(ids)
        if run is None or (run[1] > self.full if not to_end else self._tail_block is None or run[1] != self.nb):
            return None
        width = self.block_size * self.dtype.itemsize
        lo, hi = run[0] * width, (run[1] * width if not to_end else self.numel * self.dtype.itemsize)
        if (hi - lo) % 4:
            return None
        flat = self._flat_bytes
        if flat is None:
            flat = self._flat_bytes = self.flat.view(torch.uint8)
        return flat[lo:hi]

    def gather(self, ids: np.ndarray, out: torch.Tensor) -> int:
        """``out[i] = block ids[i]`` (global block ids); returns how many blocks were moved by their index
        (0: a run of blocks, one copy; the host model's ``"index"`` count, :mod:`sparsecomm.fabric.sim.sim_host`)."""
        run = block_run(ids)
        if run is not None and run[1] <= self.full:   # a run of full blocks: one copy
            out.copy_(self.rows[run[0]:run[1]])
            return 0
        if run is not None:                            # a run ending with the short last block
            out[:-1].copy_(self.rows[run[0]:self.full])
            out[-1].copy_(self._tail_block)
            return 0
        t = torch.from_numpy(ids)
        if self._tail_block is not None and ids.size and (ids == self.full).any():
            last = ids == self.full
            keep = torch.from_numpy(~last)
            out[keep] = self.rows.index_select(0, t[keep])
            out[torch.from_numpy(last)] = self._tail_block
        else:
            torch.index_select(self.rows, 0, t, out=out)
        return int(ids.size)


class PackedSource(_Blocks):
    """Blocks of a ``sparse`` payload, encoded from ``(indices, values)`` without densifying:
    block ids ``unique(indices // block_size)``, then the values are added into their block rows
    (repeated indices add up, as in ``Payload.to_dense``)."""

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, numel: int, block_size: int,
                 dtype: torch.dtype) -> None:
        self.numel = numel
        self.block_size = block_size
        self.dtype = dtype
        self.nb = -(-numel // block_size)
        idx = indices.reshape(-1).long()
        vals = values.reshape(-1).to(dtype)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            from ...errors import SparseCommError

            raise SparseCommError(f"sparse payload index out of range [0, {numel})")
        bid = idx // block_size
        self.ids, inv = torch.unique(bid, sorted=True, return_inverse=True)
        self.packed = torch.zeros(self.ids.numel(), block_size, dtype=dtype, device=vals.device)
        self.packed.view(-1).index_add_(0, inv * block_size + idx % block_size, vals)
        self.mask = codec.indices_to_mask(self.ids, self.nb)
        self._ids_np = self.ids.cpu().numpy()

    def view(self, ids: np.ndarray) -> None:
        return None

    def gather(self, ids: np.ndarray, out: torch.Tensor) -> int:
        """``out[i] = block ids[i]``; returns the blocks moved by index (every one: the packed rows are looked up)."""
        rows = torch.from_numpy(np.searchsorted(self._ids_np, ids))
        torch.index_select(self.packed, 0, rows, out=out)
        return int(ids.size)


class BlockSink:
    """Writes aggregated blocks into a flat result tensor (the short last block truncated), and
    remembers which blocks it wrote."""

    def __init__(self, out: torch.Tensor, block_size: int) -> None:
        #: the blocks written, as a mask of the result's blocks (made by the first write): one byte per block,
        #: not the index arrays of the writes (a call writes one per channel of every aggregator, ``n`` of them)
        self._seen: np.ndarray | None = None
        self._ids: np.ndarray | None = None     # written_ids(), until the next write or mark
        self.out = out
        self.block_size = block_size
        self.numel = out.numel()
        self.full = self.numel // block_size
        self.rows = out[: self.full * block_size].view(self.full, block_size)
        self.tail = self.numel % block_size
        self._bytes = None      # (the result's bytes, viewed by the first :meth:`range_bytes`)

    def range_bytes(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the result as a ``uint8`` view (a receive straight into it): a slice of its
        bytes, viewed once (one view per receive, not a slice and a byte view of it)."""
        b = self._bytes
        if b is None:
            b = self._bytes = self.out.view(torch.uint8)
        size = self.out.dtype.itemsize
        return b[lo * size: hi * size]

    def write(self, ids: np.ndarray, data: torch.Tensor) -> int:
        """``block ids[i] = data[i]`` (``data``: one row per block, or, where ``ids`` is a run ending with the
        short last block, that run's elements flat and unpadded); returns how many blocks were written by their
        index (0: none, or a run of blocks, one copy; the host model's ``"index"`` count,
        :mod:`sparsecomm.fabric.sim.sim_host`)."""
        if not ids.size:
            return 0
        self._note(ids)
        if data.dtype != self.out.dtype:
            data = data.to(self.out.dtype)
        if data.dim() == 1:                            # a run to the tensor's end, unpadded
            self.out[int(ids[0]) * self.block_size:].copy_(data)
            return 0
        run = block_run(ids)
        if run is not None and run[1] <= self.full:
            self.rows[run[0]:run[1]].copy_(data)
            return 0
        if run is not None:                            # a run ending with the short last block
            self.rows[run[0]:self.full].copy_(data[:-1])
            self.out[self.full * self.block_size:] = data[-1, : self.tail]
            return 0
        t = torch.from_numpy(ids)
        if self.tail and (ids == self.full).any():
            last = ids == self.full
            keep = torch.from_numpy(~last)
            self.rows.index_copy_(0, t[keep], data[keep])
            self.out[self.full * self.block_size:] = data[torch.from_numpy(last)][0, : self.tail]
        else:
            self.rows.index_copy_(0, t, data)
        return int(ids.size)

    def mark(self, ids: np.ndarray) -> None:
        """Record blocks ``ids`` as written (their sums were put in place by other means)."""
        if ids.size:
            self._note(ids)

    def _note(self, ids: np.ndarray) -> None:
        """Record blocks ``ids`` (non-empty) as written, in the mask."""
        seen = self._seen
        if seen is None:
            seen = self._seen = np.zeros(-(-self.numel // self.block_size), dtype=bool)
        seen[ids] = True
        self._ids = None

    def written_ids(self) -> np.ndarray:
        """The blocks written, ascending (the mask's: no sort, no hash of the ids); read-only, remembered until the
        next write (the finiteness guard and the record of the union both read it)."""
        if self._ids is not None:
            return self._ids
        if self._seen is None:
            return np.empty(0, dtype=np.int64)
        ids = self._seen.nonzero()[0]
        ids.flags.writeable = False
        self._ids = ids
        return ids

    def written_finite(self) -> bool:
        """Whether every written block is finite (float results). A call writes only the union's blocks;
        every other block of the result is zero (a cached result's stale blocks are zeroed, an in-place
        input's blocks outside the union were zero here too), so this is the whole result's finiteness,
        at the cost of the union's blocks rather than a pass over the tensor."""
        ids = self.written_ids()
        if not ids.size:
            return True
        if 2 * ids.size > self.full:       # most of the tensor: one streaming pass over it is cheaper
            from .._guards import all_finite

            return all_finite(self.out)
        full = ids[ids < self.full]
        if full.size and self.out.dtype in (torch.float32, torch.float64):
            ok = bool(_rows_finite(self.rows.detach().numpy(), full))
        elif full.size:   # (half floats: torch; no Numba kernel for them)
            ok = bool(torch.isfinite(self.rows.index_select(0, torch.from_numpy(full))).all())
        else:
            ok = True
        if ok and full.size < ids.size:   # the short last block
            ok = bool(torch.isfinite(self.out[self.full * self.block_size:]).all())
        return ok

    def zero(self, ids: np.ndarray) -> None:
        """Zero the blocks ``ids`` in place (no buffer: they may be most of the tensor)."""
        if not ids.size:
            return
        full = ids[ids < self.full]
        if full.size:
            self.rows.index_fill_(0, torch.from_numpy(full), 0)
        if self.tail and full.size < ids.size:
            self.out[self.full * self.block_size:] = 0


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})   # NaN/Inf semantics kept
def _rows_finite(rows, ids):
    """Whether ``rows[ids]`` holds only finite values: ``x * 0`` is 0 for finite ``x``, NaN otherwise."""
    chk = 0.0
    for t in range(ids.size):
        r = rows[ids[t]]
        for j in range(r.size):
            chk += np.float64(r[j]) * 0.0
    return chk == 0.0


def lazy_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages are not touched until written (calloc'd through numpy: the kernel
    hands out zero pages lazily), so that a result with few non-zero blocks costs what is written,
    not a pass over the whole tensor (``torch.zeros`` writes every page)."""
    if dtype in NUMPY and numel > (1 << 16):
        return torch.from_numpy(np.zeros(numel, dtype=NUMPY[dtype]))
    return torch.zeros(numel, dtype=dtype)


class _Entry:
    __slots__ = ("buf", "key", "prev")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.buf = mmap.mmap(-1, max(1, key[0] * key[1].itemsize))   # anonymous: zero pages
        self.prev = np.empty(0, dtype=np.int64)


class ResultCache:
    """Result tensors of non-in-place calls, recycled once the caller has dropped every reference.

    A sparse all-reduce writes only the union's blocks, but a fresh dense result costs a page fault per
    page it touches (more than the data itself at low density). A cached result buffer is an anonymous
    memory map; a tensor handed out views it through numpy, so the map's reference count tells whether
    any tensor (or view of one) still uses it. A free buffer is reused: the call writes the new union's
    blocks and zeroes the blocks that were non-zero last time and are not any more. At most
    ``capacity`` buffers are kept; when all are in use a fresh lazily-zeroed tensor is returned.
    """

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self._entries: list[_Entry] = []

    def take(self, numel: int, dtype: torch.dtype, block_size: int) -> tuple[torch.Tensor, _Entry | None]:
        if not self.capacity or dtype not in NUMPY or numel <= (1 << 16):
            return lazy_zeros(numel, dtype), None
        key = (numel, dtype, block_size)
        free = [e for e in self._entries if sys.getrefcount(e.buf) == 2]   # e.buf and the call only
        same = [e for e in free if e.key == key]
        entry = min(same, key=lambda e: e.prev.size) if same else None   # the fewest blocks to clear
        if entry is None:
            if len(self._entries) >= self.capacity:
                if not free:
                    return lazy_zeros(numel, dtype), None
                self._entries.remove(free[0])
            entry = _Entry(key)
            self._entries.append(entry)
        arr = np.frombuffer(entry.buf, dtype=NUMPY[dtype], count=numel)
        return torch.from_numpy(arr), entry

    def discard(self, entry: _Entry | None) -> None:
        if entry in self._entries:
            self._entries.remove(entry)

    @staticmethod
    def done(entry: _Entry | None, sink: BlockSink) -> int:
        """After the call: zero the blocks that were non-zero last time and were not written now; how many."""
        if entry is None:
            return 0
        now = sink.written_ids()
        stale = np.setdiff1d(entry.prev, now, assume_unique=True)
        sink.zero(stale)
        entry.prev = now
        return int(stale.size)
