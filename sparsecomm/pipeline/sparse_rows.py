"""Row-sparse gradients (``nn.Embedding(sparse=True)``) averaged without densifying the table: the
rounds of :meth:`CommPipeline.start_sparse <sparsecomm.pipeline.core.CommPipeline.start_sparse>`
(:class:`SparseRows`), through the transport's public API only, recorded like every other round
(:class:`~sparsecomm.pipeline.accounting.Accounting`)."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from .. import transports
from ..compressors.base import finite
from ..errors import SparseCommError
from ..fabric.engine import CommWork, engine
from ..fabric.stats import CommStats
from ..payload import Payload
from ..transports.base import CallId, calling
from .accounting import Accounting
from .nonfinite import NonFiniteRule

#: how :meth:`SparseRows.start` averages a row-sparse gradient
SPARSE_ROWS = ("gather", "transport")


class SparseRows:
    """The row-sparse rounds of a pipeline over ``transport`` (see :meth:`start`; ``mode``: one of
    :data:`SPARSE_ROWS`)."""

    def __init__(self, mode: str, transport: Any, rule: NonFiniteRule, accounting: Accounting) -> None:
        self.mode, self.transport, self.rule, self.accounting = mode, transport, rule, accounting
        self.fabric = transport.fabric
        self.n = int(self.fabric.world_size)
        self._gatherer: Any = None

    def start(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable, call: CallId,
              dtype: torch.dtype | None = None) -> CommWork:
        """Start the plain average of a row-sparse gradient (``None``: no rows) of a parameter of
        ``shape`` (call ``call``); ``wait()`` returns the coalesced sparse average over the union of the
        workers' rows (as DDP's sparse allreduce: a row in the union whose sum is zero stays, with
        zeros). The table is never densified. Two ways (``sparse_rows=``):

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
        shape = torch.Size(shape)
        dtype = dtype or grad.dtype
        if self.mode == "gather":
            return self._start_gather(grad, shape, key, call, dtype)
        nrows = int(shape[0]) if len(shape) else 1
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n, rule, check, transport, acc = self.n, self.rule, self.rule.check, self.transport, self.accounting
        if check and not finite(vals):
            vals = torch.full_like(vals, float("nan"))
        ones = torch.ones(rows.numel(), dtype=torch.float32)
        if transport.can_carry("sparse"):
            marks: Any = Payload(kind="sparse", values=ones, indices=rows, shape=torch.Size([nrows]),
                                 dtype=torch.float32, bits=(4 + 8) * 8 * rows.numel())
        else:
            marks = torch.zeros(nrows, dtype=torch.float32)
            marks[rows] = 1.0
        elt = torch.empty(0, dtype=dtype).element_size()

        def job() -> torch.Tensor:
            counts = transport.run(marks, call)
            first = transport.last_stats
            union = counts.nonzero().flatten()
            mine = torch.zeros(union.numel(), row_len, dtype=dtype)
            if rows.numel():
                mine[torch.searchsorted(union, rows)] = vals
            if union.numel():
                total = transport.run(mine.reshape(-1), call.next_round())
                second = transport.last_stats
            else:           # no worker has a row: the second round is empty, nothing travels
                total, second = mine.reshape(-1), CommStats()
            if check:
                rule.plain_sum(total, key)      # (raises, or marks a skipped step: nonfinite="skip")
            total = total.reshape(union.numel(), *shape[1:]).div_(n)
            acc.round(marks, first)
            acc.round(mine, second)
            acc.call(int(shape.numel()) * elt)
            return torch.sparse_coo_tensor(union[None], total, shape, is_coalesced=True,
                                           check_invariants=False)

        return engine(self.fabric).submit(job)

    def _gatherer_of(self) -> Any:
        """The transport's own ``gather`` if it has one, else torch.distributed's all-gather where the
        fabric has a native process group (``native``, as DDP), else an allgather on the fabric."""
        if self._gatherer is None:
            if self.transport.gathers:
                self._gatherer = self.transport
            elif self.fabric.native_group is not None:
                self._gatherer = transports.get("native", self.fabric, nonfinite="pass")
            else:
                self._gatherer = transports.get("allgather", self.fabric, nonfinite="pass")
        return self._gatherer

    def _start_gather(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable, call: CallId,
                      dtype: torch.dtype) -> CommWork:
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n, rule, check, acc, fabric = self.n, self.rule, self.rule.check, self.accounting, self.fabric
        numel = int(shape.numel())
        payload = Payload(kind="sparse", values=vals.reshape(-1), indices=rows, shape=torch.Size([numel]),
                          dtype=dtype, bucket_size=row_len, bits=8 * (vals.numel() * vals.element_size()
                                                                      + 4 * rows.numel()))
        gatherer = self._gatherer_of()
        elt = vals.element_size()

        def job() -> torch.Tensor:
            before = fabric.stats.copy()
            with calling(call):
                parts = gatherer.gather(payload)
            comm = fabric.stats - before
            idx = torch.cat([q.indices.reshape(-1) for q in parts])
            v = torch.cat([q.values.reshape(-1, row_len) for q in parts])
            if check:
                rule.plain_sum(v, key)          # (raises, or marks a skipped step: nonfinite="skip")
            t = torch.sparse_coo_tensor(idx[None], v.reshape(idx.numel(), *shape[1:]), shape,
                                        check_invariants=False).coalesce()
            t.values().div_(n)
            acc.round(payload, comm, copies=gatherer.wire_copies())
            acc.call(numel * elt)
            return t

        return engine(fabric).submit(job)


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
