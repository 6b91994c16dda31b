"""``allgather``: every worker's payload to every worker, then a local sum (SparCML / AGsparse style).

For payloads that cannot be summed in compressed form: ``sparse`` (top-k: indices differ per worker),
``quantized`` with per-worker scales; also ``aligned``, ``quantized`` with a shared scale and ``dense``
payloads or plain tensors (at ``n - 1`` times the traffic of a ring).

Protocol, on worker ``r`` of ``n``:

1. exchange a fixed-size int64 *header* with every other worker (original length, dtype, kind, scale
   sharing, bucket size, an indices checksum for ``aligned``, and the element count, in-memory dtype
   and wire encoding of each slot: values, indices (``sparse`` only), scale: see
   :meth:`Payload.wire_layout <sparsecomm.payload.Payload.wire_layout>`);
2. send the non-empty wire tensors (:meth:`Payload.to_wire`: 1-bit signs, k-bit codes, natural
   sign + exponent, int32 indices or a bitmap: the bits the compressor declares) to every other worker
   (destinations in the order ``r+1, r+2, ...``, so that every receiver gets one sender at a time) and
   receive everyone's into buffers sized from the headers once each announced slot has been checked
   against this rank's own tensor (:func:`~sparsecomm.payload.check_slot`: at most ``numel`` elements,
   an encoding that fits the dtype; a header that fails raises
   :class:`~sparsecomm.payload.WireFormatError` on every worker, since every worker receives every
   header). Empty slots are never sent (``k = 0`` costs only the headers). Each phase posts all its
   sends and receives before waiting, so it is one group on nccl;
3. (before phase 2) check agreement locally on the gathered headers (every worker sees the same
   headers, so a mismatch raises :class:`~sparsecomm.errors.MismatchError` on every worker before any
   data is sent, and the fabric stays clean); after phase 2, rebuild each worker's :class:`~sparsecomm.payload.Payload` bit-exactly
   (:meth:`Payload.from_wire`) and sum their ``to_dense()`` in rank order (the same bits on every
   worker).

Cost per worker: ``(n-1)`` headers plus ``(n-1)`` payloads up and down, two latency steps (one when
every payload is empty) on an idle network (:func:`theory.costs.allgather`).
"""

from __future__ import annotations

import torch

from ..fabric.base import Fabric
from ..payload import Payload, WireFormatError, check_slot, empty_slot
from . import registry
from ._handshake import dtype_code, dtype_from_code, fingerprint, mismatch_error
from .base import Transport
from .ring import KIND_CODE

HEADER_TAG = 0x5C20
DATA_TAG = 0x5C21

# header layout (int64): six scalars, then (count, dtype code, encoding code) for each of the three slots
_NUMEL, _DTYPE, _KIND, _SHARED, _BUCKET, _INDICES = range(6)
_SLOTS = ("values", "indices", "scale")
_SLOT_FIELDS = 3
HEADER_FIELDS = 6 + _SLOT_FIELDS * len(_SLOTS)
HEADER_BYTES = 8 * HEADER_FIELDS


def _slot(h: list[int], slot: int) -> tuple[int, int, int]:
    base = 6 + _SLOT_FIELDS * slot
    return h[base], h[base + 1], h[base + 2]


def _header(p: Payload, layout: list, device: torch.device) -> torch.Tensor:
    fields: list = [p.numel, dtype_code(p.dtype), KIND_CODE[p.kind], int(bool(p.shared_scale)),
                    int(p.bucket_size or 0),
                    fingerprint(p.indices) if p.kind == "aligned" else 0]
    for lay in layout:
        fields += [lay[0], dtype_code(lay[1]), lay[2]] if lay is not None else [-1, 0, 0]
    return torch.stack([torch.as_tensor(f, dtype=torch.int64).reshape(()).to(device) for f in fields])


@registry.register("allgather")
class AllGather(Transport):
    """Gather every worker's payload on every worker and sum locally (see the module docstring)."""

    name = "allgather"
    carries = frozenset({"dense", "aligned", "sparse", "quantized"})
    quantized_needs_shared_scale = False

    def __init__(self, fabric: Fabric, *, header_tag: int = HEADER_TAG, data_tag: int = DATA_TAG) -> None:
        super().__init__(fabric)
        if not fabric.is_worker:
            raise ValueError("transports run on workers, not on service endpoints")
        self.header_tag = header_tag
        self.data_tag = data_tag

    def wire_copies(self) -> float:
        """Every payload goes to each of the ``n - 1`` other workers."""
        return float(self.fabric.world_size - 1)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._gather_sum(Payload("dense", flat, flat.shape, flat.dtype))

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        return self._gather_sum(p)

    def _gather_sum(self, p: Payload) -> torch.Tensor:
        f = self.fabric
        n, r = f.world_size, f.rank
        if p.kind == "sparse" and p.indices is not None and p.indices.numel() != p.values.numel():
            raise ValueError(f"sparse payload with {p.values.numel()} values but {p.indices.numel()} indices")
        if n == 1:
            return p.to_dense().clone()
        dev = p.values.device
        layout = p.wire_layout()
        wire = p.to_wire()
        # phase 1: headers, every worker to every worker
        header = _header(p, layout, dev)
        hbuf = torch.empty((n, HEADER_FIELDS), dtype=torch.int64, device=dev)
        hbuf[r] = header
        works = [f.isend(header, (r + k) % n, self.header_tag) for k in range(1, n)]
        works += [f.irecv(hbuf[(r - k) % n], (r - k) % n, self.header_tag) for k in range(1, n)]
        for w in works:
            w.wait()
        headers = hbuf.tolist()
        # every worker holds every header: agreement (length, dtype, kind, encoding, ...) and each
        # announced slot (against this rank's own tensor) are checked before any data moves or any buffer
        # is allocated, so every worker raises the same error and nothing is left in flight
        self._check(headers, r)
        layouts = [self._peer_layout(headers[j], p.numel, j) for j in range(n)]
        # phase 2: the wire tensors, sized by the checked layouts (empty ones are not sent)
        works = []
        for k in range(1, n):
            dst = (r + k) % n
            works += [f.isend(t, dst, self.data_tag) for t in wire if t is not None and t.numel()]
        received: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
        received[r] = wire
        for k in range(1, n):
            src = (r - k) % n
            for lay in layouts[src]:
                if lay is None:
                    received[src].append(None)
                    continue
                buf = empty_slot(*lay, numel=p.numel, device=dev)
                if buf.numel():
                    works.append(f.irecv(buf, src, self.data_tag))
                received[src].append(buf)
        for w in works:
            w.wait()
        f.stats.rounds += 2
        out = torch.zeros(p.numel, dtype=p.dtype, device=dev)
        for j in range(n):
            h = headers[j]
            if j == r:
                pj = p
            else:
                pj = Payload.from_wire(p.kind, p.shape, p.dtype, layouts[j], received[j],
                                       indices=p.indices if p.kind == "aligned" else None,
                                       bucket_size=h[_BUCKET] or None, shared_scale=bool(h[_SHARED]))
            if pj.kind in ("sparse", "aligned"):
                if pj.values.numel():
                    idx = pj.indices.reshape(-1).to(torch.int64)
                    if pj.kind == "sparse" and (int(idx.min()) < 0 or int(idx.max()) >= p.numel):
                        raise WireFormatError(f"allgather: worker {j} sent indices outside [0, {p.numel})")
                    out.index_add_(0, idx, pj.values.reshape(-1).to(p.dtype))
            else:
                out += pj.to_dense()
        return out

    @staticmethod
    def _peer_layout(h: list[int], numel: int, rank: int) -> list:
        from ._handshake import dtype_from_code

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
        elif kind == KIND_CODE["aligned"]:
            checks += [("number of values", 6), ("values dtype", 7), ("shared indices (checksum)", _INDICES)]
        elif kind == KIND_CODE["quantized"]:
            checks += [("shared_scale flag", _SHARED), ("codes length", 6)]
        for name, i in checks:
            col = [h[i] for h in headers]
            if min(col) != max(col):
                raise mismatch_error(what, name, col, rank)
