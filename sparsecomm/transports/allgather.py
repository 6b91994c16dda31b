"""``allgather``: every worker's payload to every worker, then a local sum (SparCML / AGsparse style).

For payloads that cannot be summed in compressed form: ``sparse`` (top-k: indices differ per worker),
``quantized`` with per-worker scales; also ``aligned``, ``quantized`` with a shared scale and ``dense``
payloads or plain tensors (at ``n - 1`` times the traffic of a ring).

Protocol, on worker ``r`` of ``n``:

1. exchange a fixed-size int64 *header* with every other worker (original length, dtype, kind, scale
   sharing, bucket size, an indices checksum for ``aligned``, and the element count, in-memory dtype
   and wire encoding of each slot: values, indices (``sparse`` only), scale: see
   :meth:`Payload.wire_layout <sparsecomm.payload.Payload.wire_layout>`), in the agreement handshake's
   format and on its tag (:mod:`._handshake`: the same size for every transport, with a checksum), so
   that a worker running another transport gets a :class:`~sparsecomm.errors.MismatchError` rather
   than a message of an unexpected size; a header that fails its checksum (seen perhaps by this worker
   only) is :class:`~sparsecomm.errors.MalformedMessage`, reported to the others through the fabric
   (``fail``), as is a header whose slots fail their checks;
2. send the non-empty wire tensors (:meth:`Payload.to_wire`: 1-bit signs, k-bit codes, natural
   sign + exponent, int32 indices or a bitmap: the bits the compressor declares) to every other worker
   (destinations in the order ``r+1, r+2, ...``, so that every receiver gets one sender at a time) and
   receive everyone's into buffers sized from the headers once each announced slot has been checked
   against this rank's own tensor (:func:`~sparsecomm.payload.check_slot`: at most ``numel`` elements,
   an encoding that fits the dtype; a header that fails raises
   :class:`~sparsecomm.errors.WireFormatError` on every worker, since every worker receives every
   header). Empty slots are never sent (``k = 0`` costs only the headers). Each phase posts all its
   sends and receives before waiting, so it is one group on nccl;
3. (before phase 2) check agreement locally on the gathered headers (every worker sees the same
   headers, so a mismatch raises :class:`~sparsecomm.errors.MismatchError` on every worker before any
   data is sent, and the fabric stays clean); after phase 2, rebuild each worker's :class:`~sparsecomm.payload.Payload` bit-exactly
   (:meth:`Payload.from_wire`) and sum their ``to_dense()`` in rank order (the same bits on every
   worker): integers in int64, range-checked against the input's dtype
   (:class:`~sparsecomm.errors.OverflowError_`, never wrapped); NaN/Inf in a float sum raise
   :class:`~sparsecomm.errors.NonFiniteError` (or ``OverflowError_`` for finite inputs that overflow)
   unless ``nonfinite="pass"``, on every worker (:mod:`._guards`).

Phases 1 and 2 are one role (:mod:`sparsecomm.fabric.roles`: it yields the receives it posts, its sends and its
waits) that the fabric runs (``Fabric.drive``), on SimFabric and TorchFabric alike.

Cost per worker: ``(n-1)`` headers plus ``(n-1)`` payloads up and down, two latency steps (one when
every payload is empty) on an idle network (:func:`theory.costs.allgather`). No setting depends on the
fabric (one message per peer and phase; :mod:`.defaults`).
"""

from __future__ import annotations

import torch

from ..fabric.base import Fabric
from ..fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step
from ..payload import Payload, check_slot, empty_slot
from . import _fold
from .base import registry
from ..errors import InvalidValueError, MalformedMessage, MismatchError, OverflowError_, WireFormatError
from ._guards import abs_max, all_finite, guard_finite, is_integer, narrow, nonfinite_option
from ._handshake import (HANDSHAKE_TAG, KIND_CODE, dtype_code, dtype_from_code, fail_stop, fingerprint,
                         header_fields, header_state, mismatch_error, read_header, same_call)
from ..theory import costs
from .base import CallShape, Transport

#: the headers travel on the agreement handshake's tag, in its fixed-size format, so that a worker
#: running another transport exchanges headers of the same size and gets a MismatchError, not an abort
HEADER_TAG = HANDSHAKE_TAG
DATA_TAG = 0x5C21
#: the stage of each of the role's waits (one role: no preference to state)
_STEP = Step()

# header layout (int64): six scalars, then (count, dtype code, encoding code) for each of the three slots
_NUMEL, _DTYPE, _KIND, _SHARED, _BUCKET, _INDICES = range(6)
_SLOTS = ("values", "indices", "scale")
_SLOT_FIELDS = 3
HEADER_FIELDS = 6 + _SLOT_FIELDS * len(_SLOTS)
_NAMES = ("numel", "dtype", "kind", "shared", "bucket", "indices") + tuple(
    f"{slot}_{f}" for slot in _SLOTS for f in ("count", "dtype", "encoding"))


def _slot(h: list[int], slot: int) -> tuple[int, int, int]:
    base = 6 + _SLOT_FIELDS * slot
    return h[base], h[base + 1], h[base + 2]


def _header(p: Payload, layout: list, device: torch.device, rank: int) -> torch.Tensor:
    """This worker's header: the agreement handshake's fixed-size state (:func:`header_state`)."""
    fields: list = [p.numel, dtype_code(p.dtype), KIND_CODE[p.kind], int(bool(p.shared_scale)),
                    int(p.bucket_size or 0),
                    fingerprint(p.indices) if p.kind == "aligned" else 0]
    for lay in layout:
        fields += [lay[0], dtype_code(lay[1]), lay[2]] if lay is not None else [-1, 0, 0]
    return header_state(rank, "allgather", _NAMES, (), fields, device)


def _check_counts(p: Payload) -> None:
    if p.kind == "sparse" and p.indices is not None and p.indices.numel() * p.row_len != p.values.numel():
        raise InvalidValueError(f"sparse payload with {p.values.numel()} values but {p.indices.numel()} indices "
                         f"(rows of {p.row_len})")
    if p.kind == "sparse" and p.row_len > 1 and p.numel % p.row_len:
        raise InvalidValueError(f"row-sparse payload: {p.numel} elements are not rows of {p.row_len}")


@registry.register("allgather")
class AllGather(Transport):
    """Gather every worker's payload on every worker and sum locally (see the module docstring)."""

    name = "allgather"
    carries = frozenset({"dense", "aligned", "sparse", "quantized"})
    quantized_needs_shared_scale = False

    def __init__(self, fabric: Fabric, *, header_tag: int = HEADER_TAG, data_tag: int = DATA_TAG,
                 nonfinite: str = "raise") -> None:
        super().__init__(fabric)
        self.nonfinite = nonfinite_option(nonfinite, "allgather")
        if not fabric.is_worker:
            raise InvalidValueError("transports run on workers, not on service endpoints")
        self.header_tag = header_tag
        self.data_tag = data_tag

    gathers = True

    def wire_copies(self) -> float:
        """Every payload goes to each of the ``n - 1`` other workers."""
        return float(self.fabric.world_size - 1)

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.allgather` of the call's wire bytes (a compressed payload in two
        messages: its indices or codes, then its values)."""
        return costs.allgather(self.fabric.world_size, call.wire_bytes, tensors=1 if call.kind == "dense" else 2,
                               bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._gather_sum(Payload("dense", flat, flat.shape, flat.dtype))

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        return self._gather_sum(p)

    def _gather_sum(self, p: Payload) -> torch.Tensor:
        if p.kind == "sparse" and p.row_len > 1:
            raise InvalidValueError("a row-sparse payload (sparse with bucket_size) is gathered, not summed: "
                             "use AllGather.gather")
        if self.fabric.world_size == 1:
            _check_counts(p)
            return p.to_dense().clone()
        return self._sum(p, self._gather(p))

    def gather(self, p: Payload) -> list[Payload]:
        """Every worker's payload (this worker's own ``p`` at its rank), in rank order, after the checks
        of the module doc (phases 1-3, without the sum): the same list on every worker. A ``sparse``
        payload may be row-sparse (``bucket_size`` = the row length, agreed by every worker); its
        indices are checked against the rows ``[0, numel / row_len)``. A ``native`` all-reduce
        predicted to come next (:mod:`._fold`) is joined and resolved first."""
        sched = _fold.enter(self.fabric, self.name, "allgather gather")
        try:
            out = self._gather(p)
        except BaseException:
            if sched is not None:
                sched.reset()
            raise
        _fold.leave(sched, self.name)
        return out

    def _gather(self, p: Payload) -> list[Payload]:
        f = self.fabric
        n, r = f.world_size, f.rank
        _check_counts(p)
        if n == 1:
            return [p]
        pool = Pool()
        inbox, outbox = Inbox(f, pool), Outbox(f, pool)
        out: dict = {}
        f.drive([self._exchange(p, inbox, out)], inbox, outbox)
        if "fail" in out:     # a malformed header, possibly seen by this worker only: the job stops (fail-stop)
            exc, cause = out["fail"]
            raise fail_stop(f, exc) from cause
        outbox.finish()
        f.stats.rounds += 2
        headers, layouts, received = out["headers"], out["layouts"], out["received"]
        pjs = []
        for j in range(n):
            h = headers[j]
            pj = p if j == r else Payload.from_wire(
                p.kind, p.shape, p.dtype, layouts[j], received[j],
                indices=p.indices if p.kind == "aligned" else None,
                bucket_size=h[_BUCKET] or None, shared_scale=bool(h[_SHARED]))
            if pj.kind == "sparse" and pj.indices is not None and pj.indices.numel():
                idx = pj.indices.reshape(-1)
                rows = p.numel // pj.row_len
                if int(idx.min()) < 0 or int(idx.max()) >= rows:
                    raise WireFormatError(f"allgather: worker {j} sent indices outside [0, {rows})")
            pjs.append(pj)
        return pjs

    def _exchange(self, p: Payload, inbox: Inbox, out: dict):
        """Phases 1 and 2 of the module doc on this worker, as one role (:mod:`sparsecomm.fabric.roles`) that
        :meth:`_gather` has the fabric run: it yields the receives it posts, its sends and a wait for each
        phase's receives (:class:`~sparsecomm.fabric.roles.Recv`, then it takes them from ``inbox``) and for its
        header sends (:class:`~sparsecomm.fabric.roles.Flush`); the data sends are left to the outbox's
        ``finish``. It fills ``out``: ``headers``, ``layouts`` and ``received`` (each worker's wire tensors,
        ``None`` for an absent slot), or ``fail``, ``(error, cause)`` for a header that only this worker may
        have seen malformed, which :meth:`_gather` reports to the others (``fail_stop``) once the role has
        returned; a mismatch every worker sees is raised from the role."""
        n, r = self.fabric.world_size, self.fabric.rank
        dev = p.values.device
        layout = p.wire_layout()
        wire = p.to_wire()
        # phase 1: headers, every worker to every worker (the handshake's fixed-size format)
        header = _header(p, layout, dev, r)
        hbufs = [torch.empty_like(header) for _ in range(n)]
        keys = [("header", (r - k) % n) for k in range(1, n)]
        for key in keys:
            yield PostInto(key, hbufs[key[1]], key[1], self.header_tag)
        for k in range(1, n):
            yield Send(header, (r + k) % n, self.header_tag, hold="header")
        yield Recv(tuple(keys), _STEP)
        for key in keys:
            inbox.take(key)
        yield Flush("header")
        headers: list[list[int]] = [[] for _ in range(n)]
        for src in range(n):
            try:
                headers[src] = (header_fields(header.tolist(), HEADER_FIELDS) if src == r else
                                read_header(hbufs[src], src, "allgather allreduce", self.name, HEADER_FIELDS, r, n))
            except (MalformedMessage, MismatchError) as exc:   # possibly seen by this worker only
                out["fail"] = (exc, None)
                return
        # every worker holds every header: agreement (length, dtype, kind, encoding, ...) and each
        # announced slot (against this rank's own tensor) are checked before any data moves or any buffer
        # is allocated, so every worker raises the same error and nothing is left in flight
        self._check(headers, r)
        try:
            layouts = [self._peer_layout(headers[j], p.numel, j) for j in range(n)]
        except (WireFormatError, MalformedMessage) as exc:   # a lying header
            out["fail"] = (exc if isinstance(exc, MalformedMessage) else MalformedMessage(str(exc)), exc)
            return
        # phase 2: the wire tensors, sized by the checked layouts (empty ones are not sent); receives are
        # posted first, so their "posted" notices leave before this rank's data (gloo sends only to a
        # posted receive)
        keys = []
        received: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
        received[r] = wire
        for k in range(1, n):
            src = (r - k) % n
            for i, lay in enumerate(layouts[src]):
                if lay is None:
                    received[src].append(None)
                    continue
                buf = empty_slot(*lay, numel=p.numel, device=dev)
                if buf.numel():
                    keys.append(("data", src, i))
                    yield PostInto(keys[-1], buf, src, self.data_tag)
                received[src].append(buf)
        for k in range(1, n):
            dst = (r + k) % n
            for t in wire:
                if t is not None and t.numel():
                    yield Send(t, dst, self.data_tag)
        yield Recv(tuple(keys), _STEP)
        for key in keys:
            inbox.take(key)
        out.update(headers=headers, layouts=layouts, received=received)

    def _sum(self, p: Payload, pjs: list[Payload]) -> torch.Tensor:
        """Every worker's payload, summed in rank order (the same bits on every worker): integers in
        int64 and range-checked, floats checked for NaN/Inf (the culprit is found locally, on the error
        path only: every worker holds every payload)."""
        what = "allgather allreduce"
        dev = p.values.device
        integer = is_integer(p.dtype)
        acc = torch.int64 if integer else p.dtype
        out = torch.zeros(p.numel, dtype=acc, device=dev)
        # the host work (sim_host): the result allocated, zeroed and checked, each worker's values added into it
        self.fabric.host_work("fresh", out.nbytes)
        self.fabric.host_work("elementwise", (1 if integer else 2) * p.numel + sum(
            pj.values.numel() if pj.kind in ("sparse", "aligned") else p.numel for pj in pjs))
        for pj in pjs:
            if pj.kind in ("sparse", "aligned"):
                if pj.values.numel():
                    out.index_add_(0, pj.indices.reshape(-1).to(torch.int64), pj.values.reshape(-1).to(acc))
            else:
                out += pj.to_dense().to(acc)
        if integer:
            if p.dtype == torch.int64:    # int64 partial sums could wrap: bound them first
                bound = sum(abs_max(pj.values.reshape(-1)) for pj in pjs if not pj.values.is_floating_point())
                if bound > torch.iinfo(torch.int64).max:
                    raise OverflowError_(f"{what}: the workers' int64 values can sum beyond int64 (bound {bound})")
            return narrow(out, p.dtype, what)

        def first_nonfinite() -> int:   # (only on the error path)
            for j, pj in enumerate(pjs):
                for v in (pj.values, pj.scale):
                    if v is not None and v.is_floating_point() and v.numel() and not all_finite(v):
                        return j
            return -1

        guard_finite(self.fabric, what, out, None, self.nonfinite, cause=first_nonfinite)
        return out

    @staticmethod
    def _peer_layout(h: list[int], numel: int, rank: int) -> list:
        out = []
        for slot, name in enumerate(_SLOTS):
            count, dcode, code = _slot(h, slot)
            if count < 0:
                out.append(None)
                continue
            try:
                dt = dtype_from_code(dcode)
            except Exception as e:  # an unknown dtype code
                raise WireFormatError(f"allgather: worker {rank} announced an unknown dtype for its "
                                      f"{name}") from e
            check_slot(count, dt, code, numel, max_count=max(numel, 1), what=f"allgather {name} of worker {rank}")
            out.append((count, dt, code))
        return out

    def _check(self, headers: list[list[int]], rank: int) -> None:
        """Raise on every worker (they all hold the same headers) unless the layouts agree."""
        what = "allgather allreduce"
        checks = [("tensor length", _NUMEL), ("dtype", _DTYPE), ("payload kind", _KIND)]
        kind = headers[rank][_KIND]
        checks += [("values encoding", 8)]
        if kind == KIND_CODE["dense"]:
            checks += [("values length", 6), ("values dtype", 7)]
        elif kind == KIND_CODE["sparse"]:
            checks += [("row length (bucket_size)", _BUCKET)]
        elif kind == KIND_CODE["aligned"]:
            checks += [("number of values", 6), ("values dtype", 7), ("shared indices (checksum)", _INDICES)]
        elif kind == KIND_CODE["quantized"]:
            checks += [("shared_scale flag", _SHARED), ("codes length", 6)]
        same_call(what, [h[HEADER_FIELDS:] for h in headers], rank)   # the same call first: the fields follow
        for name, i in checks:
            col = [h[i] for h in headers]
            if min(col) != max(col):
                raise mismatch_error(what, name, col, rank)
        if kind == KIND_CODE["sparse"]:     # every worker sees the same headers: the same error everywhere
            for j, h in enumerate(headers):
                row = max(h[_BUCKET], 1)
                if h[_BUCKET] < 0 or _slot(h, 0)[0] != _slot(h, 1)[0] * row:
                    raise MalformedMessage(f"{what}: worker {j} announced {_slot(h, 0)[0]} values for "
                                           f"{_slot(h, 1)[0]} indices of rows of {row} elements")
