"""``Native.gather``: every worker's row-sparse payload to every worker over torch.distributed, as gloo's
sparse allreduce does (the pipeline's sparse-gradient path), in one ``all_gather`` when it can.

**Unfolded** (a call not predicted): two ``all_gather`` calls: a fixed-size header per worker (length,
row length, dtype, row count), checked on every worker (:class:`~sparsecomm.errors.MismatchError` when
the workers disagree; :class:`~sparsecomm.errors.MalformedMessage` for a row count outside the table),
then every worker's rows padded to the largest row count: in one message per worker, the row index's
int32 bits in column 0 of each row when the values are 4 bytes wide, else indices and values apart.

**Folded** (:mod:`.._fold`: the record predicts this gather, the same table, row length and dtypes, on
every worker): one ``all_gather`` of a slot of ``cap + 1`` rows per worker, ``cap`` taken from the
record (1.1 x the largest row count of the last call, alike on every worker): row 0 holds a marker
and the worker's row count, rows ``1..`` its rows. A worker with more than ``cap`` rows sends the rest
in a second ``all_gather`` sized by the largest excess (every worker sees every count). A worker making
another call joins the slot ``all_gather`` with NaN, so its marker is wrong on every worker, and runs
its handshake; every worker then runs the handshake describing this gather, which raises the
MismatchError on every worker (a wrong marker without a disagreement is a MalformedMessage).

Received row counts are checked against this worker's table before anything is sized by them, and
every received row index against the rows after (:class:`~sparsecomm.errors.WireFormatError`).
"""

from __future__ import annotations

import functools
import math

import torch

from ...errors import InvalidValueError, MalformedMessage, WireFormatError
from ...payload import Payload
from .. import _fold
from .collectives import all_gather, book, collective
from .._handshake import KIND_CODE, check_agreement, dtype_code, fail_stop, mismatch_error

WHAT = "native gather"
#: first int32 word of a folded slot (any NaN's bits differ from it)
MARKER = 0x53434731
#: headroom of a folded slot over the largest row count of the last call, and its least row count
HEADROOM, MIN_CAP = 1.1, 16


def gather_rows(f, p: Payload, fold_max_bytes: int) -> list[Payload]:
    """:meth:`Native.gather <sparsecomm.transports.native.Native.gather>` on ``f`` (see the module
    docstring): a gather folds while its slot is at most ``fold_max_bytes``."""
    n = f.world_size
    row = p.row_len
    k = p.indices.numel()
    if k * row != p.values.numel() or p.numel % row:
        raise InvalidValueError(f"row-sparse payload: {p.values.numel()} values for {k} rows of {row}")
    if n == 1:
        return [p]
    rows = p.numel // row
    # described as the all-reduce of its table (row counts differ between workers; they are not
    # compared): an error names the length or the payload kind that differs
    desc = dict(length=p.numel, dtype=dtype_code(p.dtype), payload_kind=KIND_CODE["sparse"],
                values_length=p.numel, values_dtype=dtype_code(p.values.dtype))
    packed = p.values.element_size() == 4 and rows <= 2**31
    sched = _fold.schedule(f)
    key = ("native gather", p.numel, row, desc["dtype"], desc["values_dtype"]) + \
        (sched.call_key() if sched is not None else ())
    predicted = sched.predicted() if sched is not None else None
    try:
        if predicted is not None and packed and predicted.key == key:
            sched.folded += 1
            out, kmax = _folded(f, p, predicted.numel // (row + 1) - 1, desc)
        else:
            if predicted is not None:
                sched.deviate(predicted)
                check_agreement(f, WHAT, transport="native", **desc)
            out, kmax = _unfolded(f, p)
    except BaseException:
        if sched is not None:
            sched.reset()          # raised on every worker alike
        raise
    if sched is not None:
        fold = None
        slot = (max(MIN_CAP, math.ceil(HEADROOM * kmax)) + 1) * (row + 1)
        if packed and slot * 4 <= fold_max_bytes:
            fold = _fold.Fold(key, slot, p.values.dtype, p.values.device, functools.partial(_slots, f))
        sched.record(key, fold)
    return out


def _slots(f, buf: torch.Tensor) -> torch.Tensor:
    """Every worker's ``buf`` (one slot each), ``(n, numel)``; booked in the fabric's stats."""
    n = f.world_size
    out = torch.empty(n * buf.numel(), dtype=buf.dtype, device=buf.device)
    collective(f, lambda: all_gather(out, buf, group=f.native_group))
    book(f, (n - 1) * buf.numel() * buf.element_size(), 1, 1)
    return out.view(n, -1)


def _packed(p: Payload, lo: int, hi: int, count: int, row: int, skip: int = 0) -> torch.Tensor:
    """Rows ``lo:hi`` of ``p`` as packed rows (index bits in column 0) from row ``skip`` of ``count``
    rows, the rest zero."""
    vals = p.values.reshape(-1, row)
    buf = torch.zeros(count, row + 1, dtype=vals.dtype, device=vals.device)
    m = max(0, min(hi, vals.shape[0]) - lo)
    if m:
        buf[skip:skip + m, 0] = p.indices.reshape(-1)[lo:lo + m].to(torch.int32).view(vals.dtype)
        buf[skip:skip + m, 1:] = vals[lo:lo + m]
    return buf


def _folded(f, p: Payload, cap: int, desc: dict) -> tuple[list[Payload], int]:
    n = f.world_size
    row = p.row_len
    rows = p.numel // row
    k = p.indices.numel()
    slot = _packed(p, 0, cap, cap + 1, row, skip=1)
    head = slot[0].view(torch.int32)
    head[0], head[1] = MARKER, k
    out = _slots(f, slot.view(-1)).view(n, cap + 1, row + 1)
    heads = out[:, 0, :2].contiguous().view(torch.int32).tolist()
    if any(h[0] != MARKER for h in heads):
        # a worker deviated from the predicted gather: the handshakes raise on every worker
        check_agreement(f, WHAT, transport="native", **desc)
        j = next(j for j, h in enumerate(heads) if h[0] != MARKER)
        raise fail_stop(f, MalformedMessage(f"{WHAT}: worker {j} sent a slot without the marker although every "
                                        f"worker agrees on the call; this is worker {f.rank}"))
    counts = [h[1] for h in heads]
    _check_counts(f, counts, rows)
    kmax = max(counts)
    extra = kmax - cap
    rest = _slots(f, _packed(p, cap, k, extra, row).view(-1)).view(n, extra, row + 1) if extra > 0 else None
    parts = []
    for j in range(n):
        body = out[j, 1:1 + min(counts[j], cap)]
        if rest is not None and counts[j] > cap:
            body = torch.cat([body, rest[j, :counts[j] - cap]])
        parts.append(body)
    return _payloads(f, p, [b[:, 0].contiguous().view(torch.int32).to(torch.int64) for b in parts],
                     [b[:, 1:] for b in parts], counts), kmax


def _check_counts(f, counts: list[int], rows: int) -> None:
    bad = [j for j, c in enumerate(counts) if not 0 <= c <= rows]
    if bad:
        raise fail_stop(f, MalformedMessage(f"{WHAT}: worker {bad[0]} announced {counts[bad[0]]} rows of a table "
                                        f"of {rows}; this is worker {f.rank}"))


def _unfolded(f, p: Payload) -> tuple[list[Payload], int]:
    n, r = f.world_size, f.rank
    row = p.row_len
    rows = p.numel // row
    k = p.indices.numel()
    group = f.native_group
    dev = p.values.device
    header = torch.tensor([p.numel, row, dtype_code(p.dtype), k], dtype=torch.int64, device=dev)
    hs = torch.empty(n * 4, dtype=torch.int64, device=dev)
    collective(f, lambda: all_gather(hs, header, group=group))
    h = hs.view(n, 4).tolist()
    for name, i in (("tensor length", 0), ("row length", 1), ("dtype", 2)):
        col = [x[i] for x in h]
        if min(col) != max(col):
            raise mismatch_error(WHAT, name, col, r)
    counts = [x[3] for x in h]
    bad = [j for j, c in enumerate(counts) if not 0 <= c <= rows]
    if bad:
        raise MalformedMessage(f"{WHAT}: worker {bad[0]} announced {counts[bad[0]]} rows of a table of {rows}")
    kmax = max(counts)
    if kmax == 0:
        return [Payload("sparse", p.values.new_empty(0), p.shape, p.dtype, indices=p.indices.new_empty(0),
                        bucket_size=p.bucket_size) for _ in range(n)], 0
    vals = p.values.reshape(k, row)
    # one message per worker: its row indices (int32 bits in the values' 4-byte dtype) and values
    if vals.element_size() == 4 and rows <= 2**31:
        out = _slots(f, _packed(p, 0, k, kmax, row).view(-1)).view(n, kmax, row + 1)
        idx_all = out[:, :, 0].contiguous().view(torch.int32).to(torch.int64)
        val_all = out[:, :, 1:]
    else:
        ib = torch.zeros(kmax, dtype=torch.int64, device=dev)
        ib[:k] = p.indices.reshape(-1)
        vb = torch.zeros(kmax, row, dtype=vals.dtype, device=dev)
        vb[:k] = vals
        idx_all = _slots(f, ib)
        val_all = _slots(f, vb.view(-1)).view(n, kmax, row)
    book(f, (n - 1) * 4 * 8, 1, 1)
    return _payloads(f, p, list(idx_all), list(val_all), counts), kmax


def _payloads(f, p: Payload, idx: list[torch.Tensor], val: list[torch.Tensor], counts: list[int]) -> list[Payload]:
    """Each worker's payload from its received row indices and values (its own: ``p``), indices checked."""
    rows = p.numel // p.row_len
    out = []
    for j in range(f.world_size):
        if j == f.rank:
            out.append(p)
            continue
        ij = idx[j][:counts[j]]
        if counts[j] and (int(ij.min()) < 0 or int(ij.max()) >= rows):
            raise WireFormatError(f"{WHAT}: worker {j} sent row indices outside [0, {rows})")
        out.append(Payload("sparse", val[j][:counts[j]].reshape(-1), p.shape, p.dtype, indices=ij,
                           bucket_size=p.bucket_size))
    return out
