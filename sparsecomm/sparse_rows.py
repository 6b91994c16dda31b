"""Row-sparse gradients (``nn.Embedding(sparse=True)``) averaged without densifying the table: the
rounds of :meth:`CommPipeline.start_sparse <sparsecomm.pipeline.CommPipeline.start_sparse>`
(a mixin of the pipeline: it reads the pipeline's transport, fabric, stats and ``nonfinite`` rule)."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from .compression_stats import payload_bytes as _payload_bytes, wire_copies as _wire_copies
from .errors import SparseCommError
from .nonfinite import _check_aggregate, _finite
from .payload import Payload
from .transports import registry as _transports
from .transports.allgather import AllGather
from .transports._handshake import calling
from .transports.base import CommWork, engine

#: how :meth:`SparseRows.start_sparse` averages a row-sparse gradient
SPARSE_ROWS = ("gather", "transport")


class SparseRows:
    """The row-sparse rounds of :class:`~sparsecomm.pipeline.CommPipeline`."""

    def start_sparse(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable,
                     dtype: torch.dtype | None = None) -> CommWork:
        """Start the plain average of a row-sparse gradient (``None``: no rows) of a parameter of
        ``shape``; ``wait()`` returns the coalesced sparse average over the union of the workers' rows
        (as DDP's sparse allreduce: a row in the union whose sum is zero stays, with zeros). The table
        is never densified. Two ways (``sparse_rows=``):

        ``"gather"`` (default), as gloo's sparse allreduce: one gather of every worker's rows and their
        values (a row-sparse payload: the transport's own ``gather`` if it has one, else
        :meth:`Native.gather <sparsecomm.transports.native.Native.gather>` where the fabric has a native
        process group, else :meth:`AllGather.gather <sparsecomm.transports.allgather.AllGather.gather>`),
        concatenated in rank order and coalesced once (``(n - 1)`` copies of each worker's rows on the
        wire).

        ``"transport"``: two rounds through the pipeline's transport, neither of table size: (1) the
        union of the rows: a row-indicator vector of ``shape[0]`` entries, sent as a ``sparse`` payload
        (the touched rows' indices) on a transport that carries them, else dense; (2) the values of the
        union's rows (``|union| x row_len``, zeros for rows this worker did not touch), summed as a
        dense tensor by the same transport (the union's rows cross the wire about twice, whatever n)."""
        if self.sparse_rows == "gather":
            return self._start_gather(grad, torch.Size(shape), key, dtype or grad.dtype)
        shape = torch.Size(shape)
        dtype = dtype or grad.dtype
        nrows = int(shape[0]) if len(shape) else 1
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n = self.world_size
        check = self.nonfinite == "raise"
        if check and not _finite(vals):
            vals = torch.full_like(vals, float("nan"))
        ones = torch.ones(rows.numel(), dtype=torch.float32)
        if self.transport.can_carry("sparse"):
            marks: Any = Payload(kind="sparse", values=ones, indices=rows, shape=torch.Size([nrows]),
                                 dtype=torch.float32, bits=(4 + 8) * 8 * rows.numel())
        else:
            marks = torch.zeros(nrows, dtype=torch.float32)
            marks[rows] = 1.0
        elt = torch.empty(0, dtype=dtype).element_size()
        call = self.call_id(key)

        def job() -> torch.Tensor:
            counts = self.transport.run(marks, call)
            st = self.transport.last_stats
            union = counts.nonzero().flatten()
            mine = torch.zeros(union.numel(), row_len, dtype=dtype)
            if rows.numel():
                mine[torch.searchsorted(union, rows)] = vals
            total = self.transport.run(mine.reshape(-1), call.next_round()) if union.numel() else mine.reshape(-1)
            if check:
                _check_aggregate(total, key)
            total = total.reshape(union.numel(), *shape[1:]).div_(n)
            self.stats.rounds += 2
            self.stats.bytes_dense += int(shape.numel()) * elt
            pbytes = _payload_bytes(marks) + union.numel() * row_len * elt
            self.stats.bytes_payload += pbytes
            self.stats.bytes_declared_sent += _wire_copies(self.transport) * pbytes
            self.stats.bytes_dense_sent += _wire_copies(self.transport) * int(shape.numel()) * elt
            self.last_stats = self.last_stats + st + self.transport.last_stats
            return torch.sparse_coo_tensor(union[None], total, shape, is_coalesced=True,
                                           check_invariants=False)

        return engine(self.fabric).submit(job)

    def _make_gatherer(self) -> Any:
        """The transport's own ``gather`` if it has one, else torch.distributed's all-gather where the
        fabric has a native process group (``native``, as DDP), else an allgather on the fabric."""
        if callable(getattr(self.transport, "gather", None)):
            return self.transport
        if self.fabric.native_group is not None:
            return _transports.get("native", self.fabric, nonfinite="pass")
        return AllGather(self.fabric, nonfinite="pass")

    def _start_gather(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable,
                      dtype: torch.dtype) -> CommWork:
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n = self.world_size
        check = self.nonfinite == "raise"
        numel = int(shape.numel())
        payload = Payload(kind="sparse", values=vals.reshape(-1), indices=rows, shape=torch.Size([numel]),
                          dtype=dtype, bucket_size=row_len, bits=8 * (vals.numel() * vals.element_size()
                                                                      + 4 * rows.numel()))
        if self._gatherer is None:
            self._gatherer = self._make_gatherer()
        gatherer = self._gatherer
        elt = vals.element_size()
        call = self.call_id(key)

        def job() -> torch.Tensor:
            before = self.fabric.stats.copy()
            with calling(call):
                parts = gatherer.gather(payload)
            comm = self.fabric.stats - before
            idx = torch.cat([q.indices.reshape(-1) for q in parts])
            v = torch.cat([q.values.reshape(-1, row_len) for q in parts])
            if check:
                _check_aggregate(v, key)
            t = torch.sparse_coo_tensor(idx[None], v.reshape(idx.numel(), *shape[1:]), shape,
                                        check_invariants=False).coalesce()
            t.values().div_(n)
            pbytes = _payload_bytes(payload)
            copies = _wire_copies(gatherer)
            self.stats.rounds += 1
            self.stats.bytes_dense += numel * elt
            self.stats.bytes_payload += pbytes
            self.stats.bytes_declared_sent += copies * pbytes
            self.stats.bytes_dense_sent += _wire_copies(self.transport) * numel * elt
            self.last_stats = self.last_stats + comm
            return t

        return engine(self.fabric).submit(job)


def row_sparse_parts(grad: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows (int64) and their values (``rows x row_len``, in ``dtype``) of a row-sparse gradient
    (``None``: no rows) of a parameter of ``shape``, coalesced; only one sparse dimension (as
    ``nn.Embedding``'s) is supported."""
    nrows = int(shape[0]) if len(shape) else 1
    row_len = int(shape.numel()) // max(nrows, 1)
    if grad is None:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, row_len, dtype=dtype)
    g = grad.coalesce()
    if g.sparse_dim() != 1:
        raise SparseCommError(f"sparse gradients with {g.sparse_dim()} sparse dimensions are not "
                              f"supported (only row-sparse ones, as nn.Embedding's)")
    rows = g.indices()[0]
    return rows, g.values().reshape(rows.numel(), row_len).to(dtype)
