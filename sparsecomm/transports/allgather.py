"""``allgather``: every worker's payload to every worker, then a local sum (SparCML / AGsparse style).

For payloads that cannot be summed in compressed form: ``sparse`` (top-k: indices differ per worker),
``quantized`` with per-worker scales; also ``aligned``, ``quantized`` with a shared scale and ``dense``
payloads or plain tensors (at ``n - 1`` times the traffic of a ring).

Protocol, on worker ``r`` of ``n``:

1. exchange a fixed-size int64 *header* with every other worker (original length, dtype, kind, scale
   sharing, bucket size, an indices checksum for ``aligned``, and the length and dtype of each wire
   tensor: values, indices (``sparse`` only), scale), in the agreement handshake's format and on its tag
   (:mod:`._handshake`: the same size for every transport, with a checksum), so that a worker running
   another transport gets a :class:`~sparsecomm.errors.MismatchError` rather than a message of an
   unexpected size;
2. check agreement and validate every header against what this worker knows (every announced length
   within ``0 .. numel``, dtype codes from a fixed list, indices as many as values) before anything is
   allocated; every worker holds the same headers, so a disagreement raises on every worker before any
   data moves; a header only this worker saw corrupted is :class:`~sparsecomm.errors.MalformedMessage`,
   reported to the others through the fabric (``fail``);
3. send the non-empty wire tensors to every other worker (destinations in the order ``r+1, r+2, ...``,
   so that every receiver gets one sender at a time) and receive everyone's, allocated from the headers
   (empty ones are never sent: ``k = 0`` costs only the headers). Each phase posts all its sends and
   receives before waiting, so it is one group on nccl;
4. rebuild each worker's :class:`~sparsecomm.payload.Payload` and sum their ``to_dense()`` in rank
   order (the same bits on every worker): integers in int64, range-checked against the input's dtype
   (:class:`~sparsecomm.errors.OverflowError_`, never wrapped); NaN/Inf in a float sum raise
   :class:`~sparsecomm.errors.NonFiniteError` (or ``OverflowError_`` for finite inputs that overflow)
   unless ``nonfinite="pass"``, on every worker (:mod:`._guards`).

Cost per worker: ``(n-1)`` headers plus ``(n-1)`` payloads up and down, two latency steps (one when
every payload is empty) on an idle network (:func:`theory.costs.allgather`).
"""

from __future__ import annotations

import torch

from ..errors import OverflowError_
from ..fabric.base import Fabric
from ..payload import Payload
from . import registry
from ..errors import MalformedMessage, MismatchError
from ._guards import abs_max, all_finite, guard_finite, is_integer, narrow, nonfinite_option
from ._handshake import (HANDSHAKE_TAG, HEADER_BYTES, _DTYPES, _PRE, _fail, _transport_name, dtype_code,
                         fingerprint, header_state, mismatch_error, transport_code, validate_state)
from .base import Transport
from .ring import KIND_CODE

#: the headers travel on the agreement handshake's tag, in its fixed-size format, so that a worker
#: running another transport exchanges headers of the same size and gets a MismatchError, not an abort
HEADER_TAG = HANDSHAKE_TAG
DATA_TAG = 0x5C21

# header fields (int64): six scalars, then (length, dtype code) for each of the three wire slots
_NUMEL, _DTYPE, _KIND, _SHARED, _BUCKET, _INDICES = range(6)
_SLOTS = ("values", "indices", "scale")
HEADER_FIELDS = 6 + 2 * len(_SLOTS)
_NAMES = ("numel", "dtype", "kind", "shared", "bucket", "indices", "values_len", "values_dtype",
          "indices_len", "indices_dtype", "scale_len", "scale_dtype")
#: dtypes a wire tensor may have (anything else in a header is malformed)
_WIRE_DTYPES = {dtype_code(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                           torch.bool)}


def _wire(p: Payload) -> list[torch.Tensor | None]:
    """The tensors that travel, by slot (aligned indices stay home: every worker has the same)."""
    values = p.values.reshape(-1)
    indices = p.indices.reshape(-1) if p.kind == "sparse" else None
    scale = p.scale.reshape(-1) if p.scale is not None else None
    return [values, indices, scale]


def _header(p: Payload, wire: list[torch.Tensor | None], device: torch.device, rank: int) -> torch.Tensor:
    """This worker's header: the agreement handshake's fixed-size state (:func:`header_state`)."""
    fields: list = [p.numel, dtype_code(p.dtype), KIND_CODE[p.kind], int(bool(p.shared_scale)),
                    int(p.bucket_size or 0),
                    fingerprint(p.indices) if p.kind == "aligned" else 0]
    for t in wire:
        fields += [t.numel(), dtype_code(t.dtype)] if t is not None else [-1, 0]
    return header_state(rank, "allgather", _NAMES, (), fields, device)


def _read_header(buf: torch.Tensor, src: int, rank: int, n: int) -> list[int]:
    """A peer's header fields, after checking that it is a well-formed allgather header."""
    what = "allgather allreduce"
    validate_state(buf, src, what, rank, n)
    rows = buf[:, :-1].tolist()
    mine = transport_code("allgather")
    if rows[0][1] != mine or rows[2][1] != mine or rows[0] != rows[2]:
        theirs = rows[0][1] if rows[0][1] != mine else rows[2][1]
        raise MismatchError(f"{what}: workers disagree on the transport: worker {src} runs "
                            f"{_transport_name(theirs)}, this worker ({rank}) runs 'allgather'; every worker "
                            f"must call the same transport in the same order")
    if rows[0][3] != HEADER_FIELDS:
        raise MalformedMessage(f"{what}: worker {src}'s header has {rows[0][3]} fields, expected "
                               f"{HEADER_FIELDS}; this is worker {rank}")
    return rows[0][_PRE:_PRE + HEADER_FIELDS]


def _validate(headers: list[list[int]], rank: int) -> None:
    """Check every header's sizes and codes against what this worker knows (the agreed length), before
    anything is allocated from them. Every worker holds the same headers, so every worker raises alike."""
    what = "allgather allreduce"
    numel = headers[rank][_NUMEL]
    for src, h in enumerate(headers):
        for slot, name in enumerate(_SLOTS):
            length, code = h[6 + 2 * slot], h[7 + 2 * slot]
            if length == -1 and code == 0:
                continue
            if code not in _WIRE_DTYPES or not 0 <= length <= max(numel, 1):
                raise MalformedMessage(
                    f"{what}: worker {src} announces {length} {name} of dtype code {code}; a tensor of "
                    f"{numel} elements allows 0..{max(numel, 1)} of a known dtype (this is worker {rank})")
        if h[_KIND] in (KIND_CODE["dense"], KIND_CODE["quantized"]) and h[6] != numel:
            raise MalformedMessage(f"{what}: worker {src} announces {h[6]} values for a tensor of {numel} "
                                   f"elements (this is worker {rank})")
        if h[6] < 0 or (h[_KIND] == KIND_CODE["sparse"] and (h[8] != h[6] or not is_integer(
                _WIRE_DTYPES[h[9]]))):
            raise MalformedMessage(f"{what}: worker {src}'s header describes an invalid payload (values "
                                   f"{h[6]}, indices {h[8]}); this is worker {rank}")


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
            raise ValueError("transports run on workers, not on service endpoints")
        self.header_tag = header_tag
        self.data_tag = data_tag

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._gather_sum(Payload("dense", flat, flat.shape, flat.dtype))

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        return self._gather_sum(p)

    def _gather_sum(self, p: Payload) -> torch.Tensor:
        f = self.fabric
        n, r = f.world_size, f.rank
        wire = _wire(p)
        if wire[1] is not None and wire[1].numel() != wire[0].numel():
            raise ValueError(f"sparse payload with {wire[0].numel()} values but {wire[1].numel()} indices")
        if n == 1:
            return p.to_dense().clone()
        dev = p.values.device
        # phase 1: headers, every worker to every worker (the handshake's fixed-size format)
        header = _header(p, wire, dev, r)
        hbufs = [torch.empty_like(header) for _ in range(n)]
        works = [f.isend(header, (r + k) % n, self.header_tag) for k in range(1, n)]
        works += [f.irecv(hbufs[(r - k) % n], (r - k) % n, self.header_tag) for k in range(1, n)]
        for w in works:
            w.wait()
        headers: list[list[int]] = [[] for _ in range(n)]
        for src in range(n):
            try:
                headers[src] = (header[0, _PRE:_PRE + HEADER_FIELDS].tolist() if src == r
                                else _read_header(hbufs[src], src, r, n))
            except (MalformedMessage, MismatchError) as exc:   # possibly seen by this worker only
                raise _fail(f, exc) from None
        # agreement and sizes before anything is allocated from a header; every worker holds the same
        # headers, so every worker raises alike, before any data moves (the fabric stays clean)
        self._check(headers, r)
        try:
            _validate(headers, r)
        except MalformedMessage as exc:
            raise _fail(f, exc) from None
        # phase 2: the wire tensors, sized by the headers (empty ones are not sent)
        works = []
        for k in range(1, n):
            dst = (r + k) % n
            works += [f.isend(t, dst, self.data_tag) for t in wire if t is not None and t.numel()]
        received: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
        received[r] = wire
        for k in range(1, n):
            src = (r - k) % n
            for slot in range(len(_SLOTS)):
                length, code = headers[src][6 + 2 * slot], headers[src][7 + 2 * slot]
                if length < 0:
                    received[src].append(None)
                    continue
                buf = torch.empty(length, dtype=_WIRE_DTYPES[code], device=dev)
                if length:
                    works.append(f.irecv(buf, src, self.data_tag))
                received[src].append(buf)
        for w in works:
            w.wait()
        f.stats.rounds += 2
        return self._sum(p, received, headers, r)

    def _sum(self, p: Payload, received, headers, r: int) -> torch.Tensor:
        """Every worker's payload, summed in rank order (the same bits on every worker): integers in
        int64 and range-checked, floats checked for NaN/Inf (the cause is known locally: every worker
        holds every payload)."""
        what = "allgather allreduce"
        n = len(received)
        dev = p.values.device
        out_dtype = p.dtype
        integer = is_integer(out_dtype)
        acc_dtype = torch.int64 if integer else out_dtype
        if integer and out_dtype == torch.int64:
            bound = sum(abs_max(rv[0]) for rv in received if rv[0] is not None)
            if bound > torch.iinfo(torch.int64).max:
                raise OverflowError_(f"{what}: the workers' int64 values can sum beyond int64 (bound {bound})")
        out = torch.zeros(p.numel, dtype=acc_dtype, device=dev)
        for j in range(n):
            values, indices, scale = received[j]
            h = headers[j]
            if p.kind == "sparse" or p.kind == "aligned":
                idx = indices if p.kind == "sparse" else p.indices.reshape(-1)
                if values.numel():
                    idx = idx.to(torch.int64)
                    if p.kind == "sparse" and (int(idx.min()) < 0 or int(idx.max()) >= p.numel):
                        raise MalformedMessage(f"{what}: worker {j}'s indices leave [0, {p.numel}) (this is "
                                               f"worker {r})")
                    out.index_add_(0, idx, values.to(acc_dtype))
            else:
                if p.kind == "quantized" and scale is not None and scale.numel() != 1 and (
                        not h[_BUCKET] or -(-p.numel // h[_BUCKET]) != scale.numel()):
                    raise MalformedMessage(f"{what}: worker {j}'s quantized payload has {scale.numel()} "
                                           f"scales for {p.numel} codes in buckets of {h[_BUCKET]}")
                pj = Payload(p.kind, values, p.shape, p.dtype, scale=scale, bucket_size=h[_BUCKET] or None,
                             shared_scale=bool(h[_SHARED]))
                out += pj.to_dense().to(acc_dtype)
        if integer:
            return narrow(out, out_dtype, what)

        def first_nonfinite() -> int:   # (only on the error path: every worker holds every payload)
            for j, (values, _, _) in enumerate(received):
                if values is not None and values.is_floating_point() and values.numel() and not all_finite(values):
                    return j
            return -1

        guard_finite(self.fabric, what, out, None, self.nonfinite, cause=first_nonfinite)
        return out

    def _check(self, headers: list[list[int]], rank: int) -> None:
        """Raise on every worker (they all hold the same headers) unless the layouts agree."""
        what = "allgather allreduce"
        checks = [("tensor length", _NUMEL), ("dtype", _DTYPE), ("payload kind", _KIND)]
        kind = headers[rank][_KIND]
        if kind == KIND_CODE["dense"]:
            checks += [("values length", 6), ("values dtype", 7)]
        elif kind == KIND_CODE["aligned"]:
            checks += [("number of values", 6), ("values dtype", 7), ("shared indices (checksum)", _INDICES)]
        elif kind == KIND_CODE["quantized"]:
            checks += [("shared_scale flag", _SHARED), ("codes length", 6)]
        for name, i in checks:
            col = [h[i] for h in headers]
            if min(col) != max(col):
                raise mismatch_error(what, name, col, rank)
