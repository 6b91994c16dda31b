"""OmniReduce's reference driver: the lane state machines of :mod:`.core` driven by a plain loop of
exchanges over the fabric, one call. No scheduler, no pooled buffers, no fast paths: it is to be read
after :mod:`.core`, and it checks the fast driver (:mod:`.worker`, :mod:`.aggregator`), whose results
must be the same bits (``tests/transports/omnireduce/test_omnireduce_reference.py``). It is not tuned.

Every endpoint runs the same steps. A step is one :func:`exchange`: the endpoint posts the receive of
every message it gets in that step, starts every send it owes, then waits for all of them. Both ends
of a message know it (peer, tag, size) from what they share by then, so every receive of a step is
posted before its endpoint waits, whatever the fabric buffers: the loop cannot deadlock. An endpoint
runs its sides (a worker's, an aggregator's, or colocated both) in lockstep, one exchange per step
(:func:`run`); colocated, worker ``a`` hosts aggregator ``a`` and their messages stay local.

The steps of a call (``A`` aggregators, ``n`` workers):

1. **header**, every worker to every aggregator: the call (:class:`.header.CallSpec`) and the worker's
   position-0 blocks per channel;
2. **verdict**, every aggregator to every worker (:func:`.header.verdict`, with the downstream dtype).
   An aggregator that rejects the call stops; the others serve it to the end, then every worker raises
   the lowest rejecting aggregator's error;
3. **announce**, every worker to every aggregator: every channel's first look-aheads (one message),
   and per channel its non-zero position-0 blocks with their look-aheads. Each channel then adds them
   and completes its round 0;
4. **round 0's words**, per channel to every worker: which lanes were summed, and each lane's next
   pending block;
5. **round 0's sums**, per channel with summed lanes (their count is in the words);
6. **rounds** 1, 2, ... while a channel is active, two steps each: **up**, every worker answers the
   prompt (the pending blocks it holds, with its look-aheads); **down**, the sums and the next prompt.

The fast driver sends the same blocks and sums; it overlaps steps 1 to 5 (round-0 data go before the
verdict, so a rejected call is drained by manifest; its verdict carries the round-0 sums' counts) and
lands sums in place. A driver's choices never change which blocks are added, nor their order
(:func:`.core.sum_order`), hence the bits, except where the fast driver sums in place
(:class:`.strategies.HomeSums`).
"""

from __future__ import annotations

from typing import Generator

import numpy as np
import torch

from ... import codec
from ...errors import MalformedMessage, ProtocolError
from ...fabric.base import Fabric
from . import core, header, wire
from .header import CallSpec
from .wire import HDR, OK, TAG_FIRSTS, TAG_HDR_DOWN, TAG_HDR_UP, tag_down, tag_sums0, tag_up

__all__ = ["allreduce", "serve", "run", "exchange", "worker_side", "aggregator_side"]

#: a step's messages: ``(sends, recvs)``, a send ``(dst, tag, bytes)``, a receive ``(src, tag, nbytes)``
Step = tuple[list[tuple[int, int, torch.Tensor]], list[tuple[int, int, int]]]


def allreduce(fabric: Fabric, x: torch.Tensor, *, block_size: int = 256, lanes: int = 16384, channels: int = 2,
              aggregators: list[int] | None = None, threshold: float = 0.0) -> tuple[torch.Tensor, torch.dtype]:
    """The sum over the workers of ``x`` (flattened), in the downstream dtype (floats: their own;
    integers: the narrowest that holds any sum, :func:`.wire.down_dtype`), and that dtype; on every
    worker. ``aggregators``: the endpoints of dedicated aggregators, each running :func:`serve`; ``None``:
    colocated (worker ``a`` hosts aggregator ``a``). ``threshold``: a block with every ``|x| <=
    threshold`` counts as zero. The transport's own arguments, with its defaults
    (:class:`~sparsecomm.transports.omnireduce.OmniReduce`)."""
    flat = x.reshape(-1).contiguous()
    n, rank = fabric.world_size, fabric.rank
    aggs = list(range(n)) if aggregators is None else list(aggregators)
    absmax = 0 if flat.is_floating_point() or not flat.numel() else max(int(flat.max()), -int(flat.min()))
    spec = CallSpec(flat.numel(), flat.dtype, block_size, len(aggs), channels, lanes,
                    wire.KINDS.index("dense"), 0, absmax)
    sides = [worker_side(fabric, flat, spec, aggs, threshold)]
    if aggregators is None:
        sides.insert(0, aggregator_side(fabric, rank, host=rank))
    return run(fabric, sides)[-1]


def serve(fabric: Fabric, index: int) -> None:
    """Dedicated aggregator ``index``'s loop: one call after another (until the run ends)."""
    while True:
        run(fabric, [aggregator_side(fabric, index)])


# ---------------------------------------------------------------------------------------------- steps
def run(fabric: Fabric, sides: list[Generator]) -> list:
    """Drive an endpoint's sides (generators of :data:`Step`, each sent the messages it received) in
    lockstep, one :func:`exchange` per step, until each has returned; their return values."""
    steps: dict[int, Step] = {}
    results: list = [None] * len(sides)
    for i, side in enumerate(sides):
        _advance(sides, steps, results, i, None)
    while steps:
        got = exchange(fabric, [m for s, _ in steps.values() for m in s], [m for _, r in steps.values() for m in r])
        at = 0
        for i, (_, recvs) in list(steps.items()):
            _advance(sides, steps, results, i, got[at: at + len(recvs)])
            at += len(recvs)
    return results


def _advance(sides, steps, results, i, msgs) -> None:
    try:
        steps[i] = sides[i].send(msgs)
    except StopIteration as done:
        steps.pop(i, None)
        results[i] = done.value


def exchange(fabric: Fabric, sends: list, recvs: list) -> list[torch.Tensor]:
    """One step: post a receive of ``nbytes`` from ``src`` on ``tag`` for each of ``recvs``, start each
    send ``(dst, tag, bytes)``, wait for them all; the messages received, in ``recvs``' order. A message
    to this endpoint itself is handed over (at most one per tag and step)."""
    me = fabric.rank
    local = {tag: buf for dst, tag, buf in sends if dst == me}
    if len(local) != sum(dst == me for dst, _, _ in sends):
        raise ProtocolError("omnireduce reference: two local messages on one tag in a step (a bug)")
    out, works = [], []
    for src, tag, nbytes in recvs:
        if src == me:
            buf = local.pop(tag, None)
            if buf is None or buf.numel() != nbytes:
                raise ProtocolError(f"omnireduce reference: no local message of {nbytes} bytes on tag {tag:#x} (a bug)")
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            works.append(fabric.irecv(buf, src, tag))
        out.append(buf)
    if local:
        raise ProtocolError(f"omnireduce reference: local messages on tags {sorted(local)} nobody takes (a bug)")
    works += [fabric.isend(buf, dst, tag) for dst, tag, buf in sends if dst != me]
    for work in works:
        work.wait()
    return out


# ---------------------------------------------------------------------------------------------- a worker
def worker_side(fabric: Fabric, flat: torch.Tensor, spec: CallSpec, aggregators: list[int],
                threshold: float = 0.0):
    """A worker's call, a generator of :data:`Step`; returns ``(sum, its dtype)``."""
    n, rank, bs = fabric.world_size, fabric.rank, spec.block_size
    numel = flat.numel()
    nb = -(-numel // bs)
    rows = torch.zeros(nb * bs, dtype=flat.dtype)
    rows[:numel] = flat
    rows = rows.view(nb, bs)                                   # the blocks (the last one zero-padded)
    mask = codec.nonzero_blocks(flat, bs, threshold)
    plans = wire.plan(numel, bs, spec.num_aggregators, spec.channels, spec.lanes)
    lanes = {(a, ch.slot): core.WorkerChannel(ch, mask) for a, chans in enumerate(plans) for ch in chans}

    def up(c: core.WorkerChannel, meta: bool = True) -> torch.Tensor | None:
        """Answer the prompt: the pending blocks held, then (``meta``) their look-aheads."""
        b, look = c.take_up()
        if not b.size:
            return None
        buf, data, tail = _message(None, b.size, bs, spec.up, meta=meta)
        data.copy_(rows[torch.from_numpy(b + c.ch.lo)])
        if meta:
            tail.copy_(torch.from_numpy(look))
        short = wire.short_end(c.ch, numel, bs) if not meta and b.size == c.ch.size else 0
        return buf[:wire.block_bytes(b.size, bs, spec.up.itemsize, meta=False, short=short)] if short else buf

    # 1. header
    hdrs = [spec.header(n, {g: c.pending0() for (b, g), c in lanes.items() if b == a})
            for a in range(len(aggregators))]
    yield [(aggregators[a], TAG_HDR_UP, h.view(torch.uint8)) for a, h in enumerate(hdrs)], []

    # 2. verdict
    got = yield [], [(dst, TAG_HDR_DOWN, 8 * HDR) for dst in aggregators]
    errors, down = {}, None
    for a, buf in enumerate(got):
        v = buf.view(torch.int64).numpy()
        if int(v[wire.R_STATUS]) != OK:
            errors[a] = v.copy()
            continue
        d = wire.code_dtype(v[wire.R_DOWN_DTYPE])
        if down not in (None, d):
            raise MalformedMessage(f"omnireduce: aggregator {a} announces sums of {d}, another one {down} "
                                   f"(this is worker {rank})")
        down = d
    live = [(a, c) for (a, _), c in lanes.items() if a not in errors]
    out = torch.zeros(nb, bs, dtype=down or flat.dtype)

    # 3. announce
    sends = []
    for a in (a for a in range(len(aggregators)) if a not in errors and plans[a]):
        cs = [lanes[a, ch.slot] for ch in plans[a]]
        sends.append((aggregators[a], TAG_FIRSTS, torch.cat([wire.encode_firsts(c.mine, c.ch) for c in cs])))
        for c in cs:
            msg = up(c, meta=not c.ch.single)
            if msg is not None:
                sends.append((aggregators[a], tag_up(c.ch.slot), msg))
    yield sends, []

    # 4. round 0's words
    got = yield [], [(aggregators[a], tag_down(c.ch.slot), c.ch.meta_bytes) for a, c in live]
    words = [wire.decode_words(buf, c.ch) for (_, c), buf in zip(live, got)]

    # 5. round 0's sums
    summed = [(a, c, newc, np.flatnonzero(s)) for (a, c), (newc, s) in zip(live, words)]
    shorts = [wire.short_end(c.ch, numel, bs) if ids.size == c.ch.size else 0 for _, c, _, ids in summed]
    got = iter((yield [], [(aggregators[a], tag_sums0(c.ch.slot), wire.block_bytes(ids.size, bs, down.itemsize,
                                                                                 meta=False, short=short))
                          for (a, c, _, ids), short in zip(summed, shorts) if ids.size]))
    for (a, c, newc, ids), short in zip(summed, shorts):
        if ids.size:
            data = wire.split(next(got), ids.size, bs, down, meta=False, short=short)[0]
            if short:       # every block of the channel, unpadded: the run to the tensor's end
                out.view(-1)[c.ch.lo * bs: numel] = data
            else:
                out[torch.from_numpy(ids + c.ch.lo)] = data
        c.start(newc)

    # 6. rounds
    sink = _Rows(out)
    live = [(a, c) for a, c in live if c.active]
    while live:
        sends = [(aggregators[a], tag_up(c.ch.slot), msg) for a, c in live for msg in [up(c)] if msg is not None]
        yield sends, []
        got = yield [], [(aggregators[a], tag_down(c.ch.slot), wire.block_bytes(c.act.size, bs, down.itemsize))
                         for a, c in live]
        for (a, c), buf in zip(live, got):
            c.down(buf, sink, bs, down)
        live = [(a, c) for a, c in live if c.active]

    if errors:
        header.raise_for_reply(errors[min(errors)], hdrs[min(errors)].numpy(), rank)
    return out.view(-1)[:numel], down


class _Rows:
    """Where a worker's lanes write the completed sums (:meth:`.core.WorkerChannel.down`)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def write(self, ids: np.ndarray, data: torch.Tensor) -> None:
        self.rows[torch.from_numpy(ids)] = data


# ---------------------------------------------------------------------------------------------- an aggregator
def aggregator_side(fabric: Fabric, index: int, host: int | None = None):
    """Aggregator ``index``'s call, a generator of :data:`Step` (``host``: the worker hosting it)."""
    n = fabric.world_size
    order = core.sum_order(index, n)

    # 1. header
    got = yield [], [(w, TAG_HDR_UP, 8 * HDR) for w in range(n)]
    headers = [buf.view(torch.int64).numpy().copy() for buf in got]

    # 2. verdict
    verdict = header.verdict(headers, order, index, host is not None)
    yield [(w, TAG_HDR_DOWN, torch.from_numpy(verdict).view(torch.uint8)) for w in range(n)], []
    if int(verdict[wire.R_STATUS]) != OK:
        return
    h = headers[0]
    bs, up, down = int(h[wire.F_BLOCK]), wire.code_dtype(h[wire.F_DTYPE]), wire.code_dtype(verdict[wire.R_DOWN_DTYPE])
    numel = int(h[wire.F_NUMEL])
    chans = [core.AggChannel(ch, n, bs, up, wire.accumulate_dtype(up), down, wire.short_end(ch, numel, bs))
             for ch in wire.plan_from_header(h)[index]]

    # 3. announce: each channel adds its position-0 blocks and completes round 0
    sizes = [header.round0_sizes(headers[w], index) for w in range(n)]
    got = iter((yield [], [m for w in range(n) for m in
                           ([(w, TAG_FIRSTS, sizes[w][0])] if sizes[w][0] else [])
                           + [(w, tag_up(g), nbytes) for g, nbytes in sizes[w][1].items()]]))
    blocks0: dict = {c.slot: {} for c in chans}
    for w in range(n):
        if sizes[w][0]:
            for c, part in zip(chans, wire.split_firsts(next(got), [c.ch for c in chans])):
                c.set_firsts(w, part)
        for g in sizes[w][1]:
            blocks0[g][w] = next(got)
    replies = []
    for c in chans:
        counts = c.expect()
        if any(int(counts[w]) != int(headers[w][wire.F_K0 + c.slot]) for w in range(n)):
            raise ProtocolError("omnireduce: round-0 blocks do not match their look-aheads")
        replies.append(_round(c, order, blocks0[c.slot], meta=not c.single))

    # 4. round 0's words; 5. round 0's sums
    yield [(w, tag_down(c.slot), r.words) for c, r in zip(chans, replies) for w in range(n)], []
    yield [(w, tag_sums0(c.slot), r.sums[:wire.block_bytes(r.k, bs, down.itemsize, meta=False,
                                                             short=c.short if r.k == c.ch.size else 0)])
           for c, r in zip(chans, replies) if r.k for w in range(n)], []

    # 6. rounds
    live = [c for c in chans if c.active]
    while live:
        counts = [c.expect() for c in live]
        got = iter((yield [], [(w, tag_up(c.slot), wire.block_bytes(int(k[w]), bs, up.itemsize))
                               for c, k in zip(live, counts) for w in order if k[w]]))
        sums = [_round(c, order, {w: next(got) for w in order if k[w]}, meta=True) for c, k in zip(live, counts)]
        yield [(w, tag_down(c.slot), msg) for c, msg in zip(live, sums) for w in range(n)], []
        live = [c for c in live if c.active]


def _round(c: core.AggChannel, order: list[int], msgs: dict, meta: bool):
    """Add the holders' blocks (``msgs[w]``: worker ``w``'s message) in ``order``, and complete the round
    (:meth:`.core.AggChannel.finish`)."""
    c.begin(_message)
    for w in order:
        if w in msgs:
            k = int(c.counts[w])
            data, looks = wire.split(msgs[w], k, c.bs, c.up, meta=meta,
                                     short=c.short if not meta and k == c.ch.size else 0)
            c.add(w, data, looks)
    return c.finish()


def _message(_role, k: int, block_size: int, dtype: torch.dtype, extra: int = 0, meta: bool = True):
    """A fresh block message ``(buffer, blocks view, int32 tail view)`` (the fast driver pools them by
    role, :func:`.wire.message`)."""
    buf = torch.empty(wire.block_bytes(k, block_size, dtype.itemsize, extra, meta), dtype=torch.uint8)
    data, tail = wire.split(buf, k, block_size, dtype, extra, meta)
    wire.clear_pad(buf, k, block_size, dtype)
    return buf, data, tail
