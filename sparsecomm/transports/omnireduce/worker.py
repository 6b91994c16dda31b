"""OmniReduce worker side: the block stream of one call, with the colocated aggregator interleaved.

Per channel and lane, the worker tracks its own next non-zero block (``mine``, from the codec's
look-ahead :func:`sparsecomm.codec.next_nonzero`) and the lane's pending block announced by the
aggregator (``cur``). In each round it sends, fused in one message per channel, the lanes whose pending
block it holds, each with the look-ahead of its next non-zero block in that lane; the reply carries
every active lane's sum and its next pending block (Fei et al., SIGCOMM'21, Sec. 3.2).

Order of work (what makes it deadlock-free when every worker also hosts an aggregator): round 0 --
every worker first sends everything (a header per aggregator, every channel's first look-aheads, then
its position-0 blocks; colocated, aggregator by aggregator, each as soon as its range is scanned; while
it scans, the hosted aggregator posts the round-0 receives of the peers whose headers are in,
:meth:`.aggregator.AggCall.take_early`, so that their blocks travel meanwhile: gloo sends a message
only to a posted receive), then the hosted aggregator validates the headers and replies, then every
aggregator's verdict is taken. Then one event-driven loop: the candidates are the hosted aggregator's
next round of every active channel and this worker's next reply of every active channel; among those
whose messages are posted (or handed over locally), the first in preference order whose messages are
in runs (:meth:`~sparsecomm.fabric.base.Fabric.wait_any`; aggregator rounds first, then replies by
round, slot and visit order). A step only waits for messages sent at strictly earlier steps (an
aggregator's round ``p`` needs the up-messages sent on receipt of round ``p-1``; a reply needs the
aggregator step before it), every send is asynchronous, and the loop never blocks on one step while
another could run, so no cycle of waits can form, whatever the fabric's buffering. Every channel has
its own tags, carrying its rounds in order; receives are posted one round ahead, as soon as their size
is known, so a real fabric moves the data while the endpoint works on other channels.

In place (``home``), one-round channels move no data they need not: the hosted aggregator sums into
the input itself, whole-block runs are sent as views of it, and a channel summed everywhere is received
straight into it.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np
import torch

from ... import codec
from ...errors import MalformedMessage
from ...fabric.base import Fabric
from .._handshake import _fail
from . import wire
from .aggregator import AggCall
from .mailbox import Inbox, Outbox, Pool, Step, drive
from .wire import HDR, OK, ProtocolError, TAG_HDR_DOWN, TAG_HDR_UP, Buf, Key, Msg, tag_down, tag_up


class WorkerChannel:
    """Worker state of one channel: its own next non-zero block per lane (``mine``) and, per active
    lane, the lane's pending block (``cur``)."""

    def __init__(self, ch: wire.Channel, mask: torch.Tensor) -> None:
        self.ch = ch
        la = codec.next_nonzero(mask[ch.lo: ch.lo + ch.size], ch.lanes)
        self.next = la.next.numpy()
        self.mine = la.first.numpy().copy()
        self.act = np.arange(ch.lanes, dtype=np.int64)   # round 0: position 0 of every lane is pending
        self.cur = self.act.copy()
        self.round = 0

    @property
    def active(self) -> bool:
        return self.act.size > 0

    def take_up(self) -> tuple[np.ndarray, np.ndarray]:
        """This round's sends: the pending blocks this worker holds (channel-local ids, lane order)
        and its next non-zero block in each of those lanes (the look-ahead)."""
        mine = self.mine[self.act]
        if (mine < self.cur).any():
            raise ProtocolError("omnireduce: a non-zero block of this worker was skipped")
        held = mine == self.cur
        lanes = self.act[held]
        b = self.cur[held]
        look = self.next[b]
        self.mine[lanes] = look
        self.round += 1
        return b, look

    def pending0(self) -> int:
        """How many blocks this worker sends in round 0 (its non-zero blocks at position 0)."""
        return int(np.count_nonzero(self.mine == np.arange(self.ch.lanes)))

    def start(self, newc: np.ndarray) -> None:
        """After round 0: the next pending block of every lane."""
        if newc.size and (int(newc.min()) < 0 or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced a next block outside the channel's "
                                   f"{self.ch.size} blocks")
        self.act = np.flatnonzero(newc < self.ch.size)
        self.cur = newc[self.act]

    def down_bytes(self, bs: int, down: torch.dtype) -> int:
        return wire.block_bytes(self.act.size, bs, down.itemsize)

    def down(self, buf: torch.Tensor, sink, bs: int, down: torch.dtype) -> None:
        """Write the sums of the pending blocks; advance every lane to its next pending block."""
        data, newc = wire.split(buf, self.act.size, bs, down)
        newc = newc.numpy().astype(np.int64)
        if newc.size and (not (newc > self.cur).all() or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced next blocks that do not advance "
                                   f"within the channel's {self.ch.size} blocks")
        sink.write(self.cur + self.ch.lo, data)
        keep = newc < self.ch.size
        self.act, self.cur = self.act[keep], newc[keep]


@dataclass
class CallSpec:
    """What a worker tells the aggregators about its call (the round-0 header)."""

    numel: int
    up: torch.dtype
    block_size: int
    num_aggregators: int
    channels: int
    lanes: int
    kind: int
    check: int = 0
    absmax: int = 0

    def header(self, world: int, k0: dict[int, int] | None = None) -> torch.Tensor:
        """The round-0 header; ``k0[slot]``: this worker's position-0 blocks in that channel."""
        h = torch.zeros(HDR, dtype=torch.int64)
        for g, k in (k0 or {}).items():
            h[wire.F_K0 + g] = k
        vals = {wire.F_MAGIC: wire.MAGIC, wire.F_NUMEL: self.numel, wire.F_DTYPE: wire.dtype_code(self.up),
                wire.F_BLOCK: self.block_size, wire.F_AGGS: self.num_aggregators,
                wire.F_CHANNELS: self.channels, wire.F_LANES: self.lanes, wire.F_KIND: self.kind,
                wire.F_CHECK: self.check, wire.F_WORLD: world, wire.F_ABSMAX: self.absmax}
        for f, v in vals.items():
            h[f] = int(v)
        return h


#: pieces a scan is cut into, with a look at the inbox between them (colocated; see ``scan``)
SCAN_PIECES = 8


def agg_order(rank: int, num_aggregators: int) -> list[int]:
    """The order in which a worker visits the aggregators: ``rank-1, rank-2, ...`` (mod ``A``), the
    order in which their replies reach it (each aggregator serves the workers ``a+1, a+2, ...``)."""
    return [(rank - 1 - k) % num_aggregators for k in range(num_aggregators)]


def run_worker(fabric: Fabric, spec: CallSpec, source, make_sink, aggregators: list[int],
               own: int | None, pool: Pool | None = None, home: bool = False) -> tuple[torch.Tensor, torch.dtype]:
    """One all-reduce on this worker; returns the result (from ``make_sink(down_dtype)``) and its dtype.

    ``aggregators[a]`` is aggregator ``a``'s endpoint; ``own`` is the index of the aggregator this
    worker hosts (colocated: aggregator ``rank``), whose messages to and from it stay local. ``pool``
    keeps message buffers across calls. ``home``: the call is in place on a float32/float64
    :class:`DenseSource` (``make_sink`` returns the source tensor itself); the hosted aggregator then
    sums its one-round channels straight into that tensor, which already holds this worker's blocks
    (no copy of them, no write-back of the sums), and sends the sums from there.
    """
    n, rank, bs = fabric.world_size, fabric.rank, spec.block_size
    A, G = spec.num_aggregators, spec.channels
    plans = wire.plan(spec.numel, bs, A, G, spec.lanes)
    wch: dict[tuple[int, int], WorkerChannel] = {}
    pool = Pool() if pool is None else pool
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    agg = AggCall(own, n, colocated=rank) if own is not None else None
    visit = ([own] if own is not None else []) + [a for a in agg_order(rank, A) if a != own]
    home = home and own is not None
    mark = getattr(fabric, "mark", lambda label: None)   # a traced call's phase marks (see .trace)
    mark("start")

    def homed(ch: wire.Channel) -> bool:
        """Is hosted channel ``ch`` summed in place (one round, whole blocks only)?"""
        return home and ch.agg == own and wire.single(ch) and ch.lo + ch.size <= source.full

    def send_blocks(key, a: int, c: WorkerChannel, local_key) -> None:
        """This round's blocks of channel ``c`` with their look-aheads, to aggregator ``a`` (none in
        round 0 of a one-round channel: they would all say "no next block")."""
        meta = not (c.round == 0 and wire.single(c.ch))
        b, look = c.take_up()
        if not b.size:
            return
        ids = b + c.ch.lo
        if a == own:           # to the hosted aggregator: no message; a view of the data if it can
            if homed(c.ch):    # the blocks already are where their sums go
                inbox.put(local_key, (None, None))
                return
            v = source.view(ids)
            if v is not None:  # (these blocks are written only once their sums are complete, later)
                inbox.put(local_key, (v, torch.from_numpy(look) if meta else None))
                return
        elif not meta:         # a run of whole blocks is the message itself: sent without a copy
            v = source.view(ids)   # (overwritten in place only after the aggregator has it all)
            if v is not None and v.numel() * v.element_size() % 4 == 0:
                outbox.send(v.reshape(-1).view(torch.uint8), aggregators[a], tag_up(c.ch.slot))
                return
        buf, data, tail = outbox.message(key, b.size, bs, spec.up, meta=meta)
        source.gather(ids, data)
        if meta:
            tail.copy_(torch.from_numpy(look))
        if a == own:
            inbox.put(local_key, buf)
        else:
            outbox.send(buf, aggregators[a], tag_up(c.ch.slot), key=key)

    def scan(a: int, poll=None) -> None:
        """Find this worker's non-zero blocks in aggregator ``a``'s range; set up its channels.
        ``poll``: called between pieces of the scan (so that receives are posted while it runs)."""
        chans = plans[a]
        if chans:
            lo, hi = chans[0].lo, chans[-1].lo + chans[-1].size
            step = hi - lo if poll is None else max(1, -(-(hi - lo) // SCAN_PIECES))
            for s in range(lo, hi, step):
                source.scan(s, min(hi, s + step))
                if poll is not None:
                    poll()
        for ch in chans:
            wch[a, ch.slot] = WorkerChannel(ch, source.mask)
        mark(f"scanned {a}")

    def send_round0(aggs: list[int]) -> None:
        """Round 0 to ``aggs``, sent before any wait: a header each; per channel the first look-aheads,
        then the position-0 blocks (slot-major; per slot the heaviest aggregators first)."""
        for a in aggs:
            hdr = spec.header(n, {ch.slot: wch[a, ch.slot].pending0() for ch in plans[a]}).view(torch.uint8)
            if a == own:
                inbox.put(Key(Msg.HDR, rank), hdr)
            else:
                outbox.send(hdr, aggregators[a], TAG_HDR_UP)
                inbox.post(Key(Msg.REPLY, a), 8 * HDR, aggregators[a], TAG_HDR_DOWN)
        for g in range(G):     # all first look-aheads (small) before any block
            for a in aggs:
                c = wch.get((a, g))
                if c is not None:
                    firsts = wire.encode_firsts(c.mine, c.ch)
                    if a == own:
                        inbox.put(Key(Msg.FIRSTS, rank, g), firsts)
                    else:
                        outbox.send(firsts, aggregators[a], tag_up(g))
        for g in range(G):
            for a in sorted(aggs, key=lambda a: -wch[a, g].pending0() if (a, g) in wch else 0):
                if (a, g) in wch:
                    send_blocks(Buf(Msg.BLOCKS0, a, g), a, wch[a, g], Key(Msg.BLOCKS0, rank, g))

    if agg is not None:
        agg.post_headers(inbox)
        # colocated: each remote aggregator's round 0 leaves as soon as its range is scanned, the hosted
        # one (no message) last, so the transfers overlap the rest of the scan
        # after each, the remote headers already in have their blocks' receives posted (take_early)
        ref = spec.header(n).numpy()

        def poll() -> None:
            agg.take_early(inbox, ref)

        for a in visit[1:]:
            scan(a, poll)
            send_round0([a])
            poll()
        scan(own, poll)
        send_round0([own])
    else:
        for a in visit:
            scan(a)
        send_round0(visit)

    # ---- the hosted aggregator validates the headers; every aggregator's verdict; every round-0 reply
    # receive posted at once (the verdict carries the number of position-0 sums of every channel)
    if agg is not None:
        agg.take_headers(inbox)
        if agg.status == OK:
            agg.prepare(inbox)
        reply = agg.reply(outbox)
        for w in agg.order:
            if w == rank:
                inbox.put(Key(Msg.REPLY, own), reply)
            else:
                outbox.send(reply, w, TAG_HDR_DOWN, key=Buf(Msg.REPLY))
        if agg.status != OK:
            agg.drain(inbox)
    error = None
    down = None
    sums0 = {}
    mark("verdict sent")
    for a in visit:
        rh = inbox.take(Key(Msg.REPLY, a)).view(torch.int64).numpy()
        if int(rh[wire.R_STATUS]) != OK:
            error = rh.copy()
            continue
        try:
            down = wire.code_dtype(rh[wire.R_DOWN_DTYPE])
            for ch in plans[a]:
                k = int(rh[wire.R_K + ch.slot])
                if not 0 <= k <= ch.lanes:
                    raise MalformedMessage(f"omnireduce: aggregator {a} announces {k} round-0 sums in a "
                                           f"channel of {ch.lanes} lanes (this is worker {rank})")
                sums0[a, ch.slot] = k
        except MalformedMessage as exc:
            raise _fail(fabric, exc) from None
    if error is not None:
        if not (int(error[wire.R_STATUS]) == wire.MALFORMED and int(error[wire.R_WMIN]) == rank):
            outbox.reap(0)   # (a worker whose header was rejected: nothing of it is received, no wait)
        wire.raise_for_reply(error, spec.header(n).numpy(), rank)
    result, sink = make_sink(down)
    if home:
        if result.data_ptr() != source.flat.data_ptr():
            raise ProtocolError("omnireduce: an in-place call's result is not its input")
        for ac in agg.channels:
            if homed(ac.ch):
                ac.set_home(sink.rows[ac.ch.lo: ac.ch.lo + ac.ch.size], rank)
    into_sink = set()      # round-0 sums received straight into the result (a whole channel, summed)
    for a in visit:
        if a == own:
            continue
        for ch in plans[a]:
            tag, k = tag_down(ch.slot), sums0[a, ch.slot]
            inbox.post(Key(Msg.WORDS, a, ch.slot), wire.meta_bytes(ch), aggregators[a], tag)
            nbytes = wire.block_bytes(k, bs, down.itemsize, meta=False)
            if (k == ch.size and result.dtype == down and ch.lo + ch.size <= sink.full
                    and nbytes == k * bs * down.itemsize):
                into_sink.add((a, ch.slot))
                inbox.post_into(Key(Msg.SUMS0, a, ch.slot),
                                sink.rows[ch.lo: ch.lo + ch.size].reshape(-1).view(torch.uint8),
                                aggregators[a], tag)
            elif k:
                inbox.post(Key(Msg.SUMS0, a, ch.slot), nbytes, aggregators[a], tag)

    mark("downstream posted")

    def worker_step(a: int, c: WorkerChannel) -> None:
        """Channel ``c``'s reply of this round: write the sums, advance the lanes, send the next round."""
        g = c.ch.slot
        if c.round == 1:       # round 0's reply: lane words, then the position-0 sums
            newc, summed = wire.decode_words(inbox.take(Key(Msg.WORDS, a, g)), c.ch)
            k = int(summed.sum())
            if k != sums0[a, g]:
                raise ProtocolError("omnireduce: the round-0 sums do not match their lane words")
            if k:
                got = inbox.take(Key(Msg.SUMS0, a, g))
                ids = np.flatnonzero(summed) + c.ch.lo
                if got is None or (a, g) in into_sink:   # summed in place / received in place
                    sink.mark(ids)
                else:
                    data, _ = wire.split(got, k, bs, down, meta=False)
                    sink.write(ids, data)
            c.start(newc)
        else:
            c.down(inbox.take(Key(Msg.DOWN, a, g)), sink, bs, down)
        if c.active:
            send_blocks(Buf(Msg.UP, a, g, c.round % 2), a, c, Key(Msg.UP, rank, g))
            if a != own:
                inbox.post(Key(Msg.DOWN, a, g), c.down_bytes(bs, down), aggregators[a], tag_down(g))
        mark(f"reply {a}.{g} r{c.round}")

    def reply_step(a: int, c: WorkerChannel) -> Step:
        return Step([Key(Msg.WORDS if c.round == 1 else Msg.DOWN, a, c.ch.slot)], lambda: worker_step(a, c))

    pos = {a: i for i, a in enumerate(visit)}
    if agg is None:
        # dedicated aggregators: the replies in (round, slot, visit) order while they are there, else
        # whichever arrives first, so a late aggregator does not hold back this worker's next round to
        # the others. The sends are finished first (keep=0: they would only queue behind each other):
        # the replies in by then are served in the staggered order, which spreads the next round over
        # the aggregators. Every reply waited for answers an up-message already sent.
        drive(fabric, inbox, outbox, lambda: [reply_step(a, c) for a, c in sorted(
            ((a, c) for (a, _), c in wch.items() if c.active), key=lambda ac: (ac[1].round, ac[1].ch.slot, pos[ac[0]]))],
            keep=0)
    else:
        # colocated: the hosted aggregator's channel rounds first (others wait for their sums), then
        # this worker's replies by (round, slot, visit order). A local message exists only once the step
        # that makes it has run, so a step is a candidate only then; a round of the hosted aggregator
        # waits until this worker has taken the previous round's reply handed over here (it would
        # replace it, and reuse its buffer a round later).
        def agg_step(ac) -> None:
            agg.step(ac, inbox, outbox, rank)
            mark(f"agg {own}.{ac.slot} r{ac.round - 1}")

        def steps() -> list:
            aggs = sorted((ac for ac in agg.channels if ac.active and not inbox.has(Key(Msg.WORDS, own, ac.slot))
                           and not inbox.has(Key(Msg.DOWN, own, ac.slot))), key=lambda ac: (ac.round, ac.slot))
            mine = sorted(((a, c) for (a, _), c in wch.items() if c.active),
                          key=lambda ac: (ac[1].round, ac[1].ch.slot, pos[ac[0]]))
            return ([Step(ac.round_keys(), functools.partial(agg_step, ac)) for ac in aggs]
                    + [reply_step(a, c) for a, c in mine])

        drive(fabric, inbox, outbox, steps)
    mark("steps done")
    outbox.reap(0)
    mark("sends done")
    return result, down
