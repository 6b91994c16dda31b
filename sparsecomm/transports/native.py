"""``native``: ``torch.distributed.all_reduce`` (gloo's or NCCL's own algorithm), the baseline.

Exists only on :class:`~sparsecomm.fabric.torch_fabric.TorchFabric`; with services in the job it reduces
over the workers' subgroup only. Carries the same kinds as ``ring`` (``dense``; ``aligned`` value
vectors; ``quantized`` codes with a shared scale, summed as int32/int64: gloo's all_reduce rejects
int8) through :func:`sparsecomm.transports.ring.linear_operand`, after the same agreement handshake
(folded into the data for repeated calls, below).

Vectors of at most :data:`GATHER_SUM_BYTES` (64 KiB) are summed by one ``all_gather`` and a local sum in
rank order instead: ``n - 1`` latency steps rather than the ring's ``2 (n - 1)``, which is what a small
bucket costs (4 gloo hosts: about half the time of ``all_reduce``).

**The agreement folds into the data** for repeated calls (:mod:`._fold`): once the record of completed
calls predicts this call (length, dtype, payload kind, ... as the handshake compares them) on every
worker, a worker making exactly that call all-reduces at once, without the handshake; a worker making
another call joins the predicted all-reduce with NaN and runs its handshake, so the workers that took
the fast path see NaN, run theirs, and every worker raises the handshake's MismatchError. Float
vectors of at most ``fold_max_bytes`` (default 16 MiB, 0 never) fold.

``last_stats``: torch.distributed does not report its traffic, so the all-reduce itself is booked at the
bandwidth-optimal ring volume, ``2 (n-1)/n`` of the vector each way per worker, in one message per
direction and ``2 (n-1)`` rounds (an estimate: gloo and NCCL use ring-like algorithms for large
tensors; a gathered small vector: ``n - 1`` copies, ``n - 1`` rounds); ``CommStats.estimated_bytes``
counts those booked bytes, so ``last_stats.estimated`` is true and the measured part (the handshake,
none on a folded call) is ``bytes_sent + bytes_received - estimated_bytes``.

:meth:`Native.gather` gathers row-sparse payloads (the pipeline's sparse-gradient path, as gloo's sparse
allreduce does): two ``all_gather`` calls, a fixed-size header (length, row length, dtype, row count)
checked on every worker, then every worker's row indices and values padded to the largest row count.

Integer sums that could overflow are summed in a wider integer dtype (at least int32) and
range-checked; NaN/Inf raise unless ``nonfinite="pass"`` (:mod:`._guards`), on every worker.
"""

from __future__ import annotations

import functools

import torch

from ..errors import FabricTimeout, IncompatibleError, InvalidValueError, PeerFailure
from ..fabric.base import Fabric
from ..payload import Payload
from . import _fold
from .base import registry
from ._guards import all_finite, guard_finite, nonfinite_option
from ._handshake import check_agreement
from .base import Transport
from .ring import guarded_sum, linear_operand

WHAT = "native allreduce"
#: vectors of at most this many bytes are summed by an all_gather and a local sum in rank order (half
#: the latency steps of gloo's ring all-reduce); a constant, so that every worker picks alike
GATHER_SUM_BYTES = 64 << 10


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """Every rank's ``inp`` into ``out`` (flat, ``world_size * numel``), torch's current name for it."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@registry.register("native")
class Native(Transport):
    """``torch.distributed.all_reduce`` over the workers (see the module docstring)."""

    name = "native"
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True
    folds = True

    def __init__(self, fabric: Fabric, *, inplace: bool = False, nonfinite: str = "raise",
                 fold_max_bytes: int = _fold.FOLD_MAX_BYTES) -> None:
        super().__init__(fabric)
        if fold_max_bytes < 0:
            raise InvalidValueError(f"fold_max_bytes must be >= 0 (0: never fold), got {fold_max_bytes}")
        self.fold_max_bytes = int(fold_max_bytes)
        self.nonfinite = nonfinite_option(nonfinite, "native")
        self.inplace = inplace   # all-reduce a plain tensor input in place (scratch buckets), no copy
        if fabric.native_group is None:
            raise IncompatibleError(
                f"transport 'native' calls torch.distributed.all_reduce, so it needs a TorchFabric "
                f"(launch backend 'gloo' or 'nccl'), not a {type(fabric).__name__}; on SimFabric use 'ring' "
                f"(the same dense sum, bandwidth-optimal, written against the Fabric) or 'allgather'")
        if not fabric.is_worker:
            raise InvalidValueError("transports run on workers, not on service endpoints")

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._run(flat)

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        return self._run(p)

    def _run(self, x: torch.Tensor | Payload) -> torch.Tensor:
        f = self.fabric
        op = linear_operand(x, f.world_size, self.name)
        inplace = self.inplace and isinstance(x, torch.Tensor)
        sched = _fold.schedule(f)
        if sched is None:
            return op.finish(guarded_sum(f, WHAT, op, {}, self.nonfinite, inplace, self._reduce,
                                         int_floor=torch.int32))
        v = op.vector
        key = ("native",) + tuple((k, int(val)) for k, val in op.fields.items())
        fold = None
        if (v.is_floating_point() and 0 < v.numel() * v.element_size() <= self.fold_max_bytes
                and not op.codes):
            fold = _fold.Fold(key, v.numel(), v.dtype, v.device, functools.partial(_join, f))
        predicted = sched.predicted()
        if predicted is not None and fold is not None and predicted.key == key:
            sched.folded += 1
            total = self._folded(op, inplace)
        else:
            if predicted is not None:
                sched.deviate(predicted)     # then this call's own handshake (in guarded_sum)
            total = guarded_sum(f, WHAT, op, {}, self.nonfinite, inplace, self._reduce, int_floor=torch.int32)
        sched.record(key, fold)
        return op.finish(total)

    def _folded(self, op, inplace: bool) -> torch.Tensor:
        """The predicted call (:mod:`._fold`): the all-reduce at once; a NaN in the sum (every element
        of it, if a worker deviated) is resolved by the handshake, then by the non-finite rules."""
        v = op.vector
        total = self._reduce(op.work_copy(inplace))
        if self.nonfinite == "raise":
            suspect = not all_finite(total)
        else:
            suspect = bool(torch.isnan(total[:1]).any())
        if suspect:
            check_agreement(self.fabric, WHAT, **op.fields)   # MismatchError on every worker if one deviated
            guard_finite(self.fabric, WHAT, total, v if total is not v else None, self.nonfinite)
        return total

    def gather(self, p: Payload) -> list[Payload]:
        """Every worker's row-sparse payload (``sparse`` with ``bucket_size`` = the row length, or plain
        ``sparse``: rows of one element), in rank order, the same list on every worker. Every worker must
        call it (it is two collectives, without the agreement handshake of the other calls); the
        headers are checked on every worker (:class:`~sparsecomm.errors.MismatchError` when the workers
        disagree on the length, row length or dtype; :class:`~sparsecomm.errors.MalformedMessage` for
        a row count outside the table) before the data, and the indices against the rows after.
        A predicted all-reduce (:mod:`._fold`) is joined and resolved first."""
        if p.kind != "sparse" or p.indices is None:
            raise IncompatibleError(f"native gather carries row-sparse payloads, not {p.kind!r} ones")
        from ._handshake import dtype_code
        from .ring import KIND_CODE

        # described as the all-reduce of its table (row counts differ between workers; they are not
        # compared): an error names the length or the payload kind that differs
        sched = _fold.enter(self.fabric, self.name, "native gather", length=p.numel, dtype=dtype_code(p.dtype),
                            payload_kind=KIND_CODE["sparse"], values_length=p.numel,
                            values_dtype=dtype_code(p.values.dtype))
        try:
            out = self._gather(p)
        except BaseException:
            if sched is not None:
                sched.reset()
            raise
        _fold.leave(sched, "native gather")
        return out

    def _gather(self, p: Payload) -> list[Payload]:
        from ..errors import MalformedMessage, MismatchError
        from ..payload import WireFormatError
        from ._handshake import dtype_code, mismatch_error

        f = self.fabric
        n, r = f.world_size, f.rank
        row = p.row_len
        rows = p.numel // row
        k = p.indices.numel()
        if k * row != p.values.numel() or p.numel % row:
            raise InvalidValueError(f"row-sparse payload: {p.values.numel()} values for {k} rows of {row}")
        if n == 1:
            return [p]
        group = f.native_group
        dev = p.values.device
        what = "native gather"
        header = torch.tensor([p.numel, row, dtype_code(p.dtype), k], dtype=torch.int64, device=dev)
        hs = torch.empty(n * 4, dtype=torch.int64, device=dev)
        self._collective(lambda: _all_gather(hs, header, group=group))
        h = hs.view(n, 4).tolist()
        for name, i in (("tensor length", 0), ("row length", 1), ("dtype", 2)):
            col = [x[i] for x in h]
            if min(col) != max(col):
                raise mismatch_error(what, name, col, r)
        counts = [x[3] for x in h]
        bad = [j for j, c in enumerate(counts) if not 0 <= c <= rows]
        if bad:
            raise MalformedMessage(f"{what}: worker {bad[0]} announced {counts[bad[0]]} rows of a table of {rows}")
        kmax = max(counts)
        if kmax == 0:
            return [Payload("sparse", p.values.new_empty(0), p.shape, p.dtype, indices=p.indices.new_empty(0),
                            bucket_size=p.bucket_size) for _ in range(n)]
        vals = p.values.reshape(k, row)
        # one message per worker: its row indices (int32 bits in the values' 4-byte dtype) and values
        packed = vals.element_size() == 4 and rows <= 2**31
        if packed:
            buf = torch.zeros(kmax, row + 1, dtype=vals.dtype, device=dev)
            buf[:k, 0] = p.indices.reshape(-1).to(torch.int32).view(vals.dtype)
            buf[:k, 1:] = vals
            out = torch.empty(n * kmax * (row + 1), dtype=vals.dtype, device=dev)
            self._collective(lambda: _all_gather(out, buf.view(-1), group=group))
            out = out.view(n, kmax, row + 1)
            idx_all = out[:, :, 0].contiguous().view(torch.int32).to(torch.int64)
            val_all = out[:, :, 1:]
        else:
            ib = torch.zeros(kmax, dtype=torch.int64, device=dev)
            ib[:k] = p.indices.reshape(-1)
            vb = torch.zeros(kmax, row, dtype=vals.dtype, device=dev)
            vb[:k] = vals
            idx_all = torch.empty(n * kmax, dtype=torch.int64, device=dev)
            val_all = torch.empty(n * kmax * row, dtype=vals.dtype, device=dev)
            self._collective(lambda: _all_gather(idx_all, ib, group=group))
            self._collective(lambda: _all_gather(val_all, vb.view(-1), group=group))
            idx_all, val_all = idx_all.view(n, kmax), val_all.view(n, kmax, row)
        nbytes = (idx_all.numel() * 4 + val_all.numel() * vals.element_size()) // n
        st = f.stats
        st.bytes_sent += (n - 1) * nbytes
        st.bytes_received += (n - 1) * nbytes
        st.messages += 2
        st.messages_received += 2
        st.rounds += 2
        st.estimated_bytes += 2 * (n - 1) * nbytes
        outp = []
        for j in range(n):
            if j == r:
                outp.append(p)
                continue
            idx = idx_all[j, :counts[j]]
            if counts[j] and (int(idx.min()) < 0 or int(idx.max()) >= rows):
                raise WireFormatError(f"{what}: worker {j} sent row indices outside [0, {rows})")
            outp.append(Payload("sparse", val_all[j, :counts[j]].reshape(-1), p.shape, p.dtype, indices=idx,
                                bucket_size=p.bucket_size))
        return outp

    def _collective(self, call) -> None:
        try:
            call()
        except RuntimeError as exc:
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            if "Timed out" in msg or "timed out" in msg:
                raise FabricTimeout(f"worker {self.fabric.rank}: torch.distributed timed out: {msg}") from exc
            raise PeerFailure(f"worker {self.fabric.rank}: torch.distributed failed, probably because "
                              f"another rank died: {msg}") from exc

    def _reduce(self, acc: torch.Tensor) -> torch.Tensor:
        return _join(self.fabric, acc)


def _join(f: Fabric, acc: torch.Tensor) -> torch.Tensor:
    """The sum of ``acc`` over the workers' group, in place, booked in ``f.stats`` (an estimate): gloo's
    ``all_reduce``, or for a vector of at most :data:`GATHER_SUM_BYTES` an ``all_gather`` and a sum in
    rank order (the same bits on every worker; ``n - 1`` latency steps instead of the ring's ``2 (n - 1)``,
    for ``n - 1`` instead of ``2 (n - 1) / n`` copies of a vector that small). The choice depends on
    the length and dtype only, which every worker agreed on, so every worker makes the same one."""
    import torch.distributed as dist

    n = f.world_size
    if n <= 1:
        return acc
    nbytes = acc.numel() * acc.element_size()
    small = nbytes <= GATHER_SUM_BYTES and acc.is_contiguous()
    try:
        if small:
            rows = torch.empty(n * acc.numel(), dtype=acc.dtype, device=acc.device)
            _all_gather(rows, acc, group=f.native_group)
            rows = rows.view(n, -1)
            acc.copy_(rows[0])
            for j in range(1, n):
                acc.add_(rows[j])
        else:
            dist.all_reduce(acc, group=f.native_group)
    except RuntimeError as exc:
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        if "Timed out" in msg or "timed out" in msg:
            raise FabricTimeout(f"worker {f.rank}: torch.distributed {'all_gather' if small else 'all_reduce'} "
                                f"timed out: {msg}") from exc
        raise PeerFailure(f"worker {f.rank}: torch.distributed {'all_gather' if small else 'all_reduce'} "
                          f"failed, probably because another rank died: {msg}") from exc
    moved = (n - 1) * nbytes if small else 2 * (n - 1) * nbytes // n
    st = f.stats
    st.bytes_sent += moved
    st.bytes_received += moved
    st.messages += 1
    st.messages_received += 1
    st.rounds += (n - 1) if small else 2 * (n - 1)
    st.estimated_bytes += 2 * moved
    return acc
