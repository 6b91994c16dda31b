"""OmniReduce's core, to be read top to bottom: the lane state machines and the roles that run them.

A channel (:class:`.wire.Channel`: a contiguous range of blocks of one aggregator) is dealt into
lanes; per lane, the blocks are a stream that every worker walks in order. Per lane:

* **announce** -- each worker tells the aggregator its first non-zero block (round 0), then, with
  every block it sends, its next one (the look-ahead, 4 bytes);
* **add** -- the aggregator adds the pending block of the workers that hold it;
* **complete** -- once every worker's announced next block is past the pending one, its sum is
  complete and goes to every worker, with the smallest announced block: the lane's next pending block;
* **prompt** -- that block tells exactly its holders to send it in the next round.

A block that is zero everywhere is never pending, so it never travels (Fei et al., SIGCOMM'21,
Sec. 3.2; sands-lab/omnireduce ``omnireduce-RDMA/omnireduce/aggregator.cpp``). The state of the lanes of
one channel is :class:`WorkerChannel` at a worker and :class:`AggChannel` at the aggregator; every lane
of a channel moves in the same message each round (block fusion).

The roles are generators that yield typed requests (:mod:`.mailbox`: ``Send``, ``Post``, ``PostInto``,
``Hand``, ``Recv``, ``Poll``, ``Spawn``) to one scheduler per endpoint, :func:`.mailbox.drive`, whose
docstring holds the deadlock-freedom argument. A worker endpoint runs :func:`worker` (and, colocated,
its hosted aggregator's :func:`aggregator`); a dedicated aggregator runs :func:`aggregator` alone
(:mod:`.service`). Each spawns one lane role per channel (:func:`worker_lane`, :func:`agg_lane`).
The fast paths are strategies (:mod:`.strategies`) called at named points: how blocks go up
(``send_up``), where the sums land (``MessageSums`` / ``HomeSums``; ``post_reply0``/``take_reply0``).
Message identities: :class:`.wire.Key` (inbox) and :class:`.wire.Buf` (pooled send buffers).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ... import codec
from ...errors import MalformedMessage, ProtocolError
from .._handshake import fail_stop as _fail
from . import header, strategies, wire
from .mailbox import Hand, Poll, Post, Recv, Send, Spawn
from .wire import (HDR, OK, TAG_FIRSTS, TAG_HDR_DOWN, TAG_HDR_UP, TAG_MANIFEST, Buf, Key, Msg, tag_down,
                   tag_sums0, tag_up)


#: pieces a colocated worker's scan is cut into, a ``Poll`` between them (:func:`scan`) running the roles
#: ordered below ``POLL_SCAN`` (headers, verdicts, hosted rounds; not the lanes landing sums)
SCAN_PIECES, POLL_SCAN = 8, (2,)


# ================================================================ the lane state machines
class WorkerChannel:
    """A worker's lanes of one channel: its own next non-zero block per lane (``mine``, announced) and,
    per active lane, the lane's pending block (``cur``, prompted by the aggregator)."""

    def __init__(self, ch: wire.Channel, mask: torch.Tensor) -> None:
        self.ch = ch
        la = codec.next_nonzero(mask[ch.lo: ch.lo + ch.size], ch.lanes)   # the look-ahead of every block
        self.next = la.next.numpy()
        self.mine = la.first.numpy().copy()
        self.act = np.arange(ch.lanes, dtype=np.int64)   # round 0: position 0 of every lane is pending
        self.cur = self.act.copy()
        self.round = 0

    @property
    def active(self) -> bool:
        return self.act.size > 0

    def pending0(self) -> int:
        """How many blocks this worker sends in round 0 (its non-zero blocks at position 0)."""
        return int(np.count_nonzero(self.mine == np.arange(self.ch.lanes)))

    def take_up(self) -> tuple[np.ndarray, np.ndarray]:
        """Answer the prompt: the pending blocks this worker holds (channel-local ids, lane order) and
        the next non-zero block in each of those lanes (the look-ahead it announces)."""
        mine = self.mine[self.act]
        if (mine < self.cur).any():
            raise ProtocolError("omnireduce: a non-zero block of this worker was skipped")
        held = mine == self.cur
        lanes, b = self.act[held], self.cur[held]
        look = self.next[b]
        self.mine[lanes] = look
        self.round += 1
        return b, look

    def start(self, newc: np.ndarray) -> None:
        """After round 0: the next pending block of every lane."""
        if newc.size and (int(newc.min()) < 0 or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced a next block outside the channel's "
                                   f"{self.ch.size} blocks")
        self.act = np.flatnonzero(newc < self.ch.size)
        self.cur = newc[self.act]

    def down(self, buf: torch.Tensor, sink, bs: int, down: torch.dtype) -> None:
        """A round's reply: write the completed sums; advance every lane to its next pending block."""
        data, newc = wire.split(buf, self.act.size, bs, down)
        newc = newc.numpy().astype(np.int64)
        if newc.size and (not (newc > self.cur).all() or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced next blocks that do not advance "
                                   f"within the channel's {self.ch.size} blocks")
        sink.write(self.cur + self.ch.lo, data)
        keep = newc < self.ch.size
        self.act, self.cur = self.act[keep], newc[keep]


class AggChannel:
    """The aggregator's lanes of one channel: every worker's announced next block (``nxt``, workers x
    lanes; the pending block of a lane is its column minimum), the active lanes and their pending blocks.

    A round is :meth:`expect` (who holds each pending block: their counts size the receives),
    :meth:`begin`, one :meth:`add` per holder, :meth:`finish` (complete; the downstream message). The
    sums accumulate where ``sums`` (a strategy, :mod:`.strategies`) puts them: a pooled message by
    default. With one block per lane (``wire.single``) round 0 is the whole stream and the announce is
    a bitmap of holders (``held``) instead of ``nxt``."""

    def __init__(self, ch: wire.Channel, n: int, block_size: int, up: torch.dtype, acc: torch.dtype,
                 down: torch.dtype) -> None:
        self.ch, self.n, self.bs = ch, n, block_size
        self.up, self.acc_dtype, self.down = up, acc, down
        self.single = wire.single(ch)
        self.nxt = np.empty((n, ch.lanes), dtype=np.int64) if not self.single else None
        self.held = np.empty((n, ch.lanes), dtype=bool) if self.single else None
        self.act = np.arange(ch.lanes, dtype=np.int64)   # round 0: position 0 of every lane is pending
        self.cur = self.act.copy()
        self.round = 0
        self.counts = np.zeros(n, dtype=np.int64)
        self.sums = strategies.MessageSums()
        self.order, self.window = [], None   # this round's holders in summing order; the receive window

    @property
    def active(self) -> bool:
        return self.act.size > 0

    @property
    def slot(self) -> int:
        return self.ch.slot

    def set_firsts(self, w: int, buf: torch.Tensor) -> None:
        """Worker ``w``'s announce of round 0: its first non-zero block of every lane."""
        if self.single:
            self.held[w] = np.unpackbits(buf.numpy(), bitorder="little", count=self.ch.lanes).view(bool)
        else:
            self.nxt[w] = wire.decode_firsts(buf, self.ch)

    def expect(self) -> np.ndarray:
        """The prompt's effect: how many blocks each worker sends this round (the lanes whose pending
        block it holds); ``rows[lane position]``: where that lane's sum goes in the message."""
        if not self.single:
            self.held = self.nxt[:, self.act] == self.cur
        self.counts = self.held.sum(axis=1)
        self.summed = self.held.any(axis=0)
        self.rows = np.cumsum(self.summed) - 1
        self.k = int(self.rows[-1]) + 1 if self.rows.size else 0
        if self.round > 0 and self.k != self.act.size:
            raise ProtocolError("omnireduce: an active lane has no holder of its pending block")
        return self.counts

    def begin(self, outbox) -> None:
        self.sums.begin(self, outbox)

    def add(self, w: int, blocks: torch.Tensor | None, looks: torch.Tensor | None) -> None:
        """Add worker ``w``'s blocks (one per lane it holds, lane order) and take its announced
        look-aheads (``None`` in round 0 of a one-round channel: nothing follows)."""
        pos = np.flatnonzero(self.held[w])
        if not self.single:
            self.nxt[w, self.act[pos]] = looks.numpy()
        self.sums.add(self, w, pos, blocks)

    def finish(self):
        """Complete every pending block; each lane's next pending block is the smallest announced one.
        The downstream: round 0, a :class:`Reply0`; later rounds, one message."""
        newc = (np.full(self.act.size, self.ch.size, dtype=np.int64) if self.single
                else self.nxt[:, self.act].min(axis=0))
        if not (newc > self.cur).all():
            raise ProtocolError("omnireduce: a lane's pending block did not complete in its round")
        msg, tail = self.sums.finish(self)
        if self.round == 0:
            words, fused = wire.encode_words(newc, self.summed, self.ch), wire.fused0(self.ch, self.k)
            if fused:   # the words ride in the sums' message, after them (the strategy left room)
                tail.view(torch.uint8)[:words.numel()].copy_(words)
            out = Reply0(words, msg if self.k or fused else None, fused, self.k)
        else:
            tail.copy_(torch.from_numpy(newc))
            out = msg
        keep = newc < self.ch.size
        self.act, self.cur = self.act[keep], newc[keep]
        self.round += 1
        if not self.single:
            self.held = None
        return out


class Reply0(NamedTuple):
    """A channel's round-0 downstream: lane words, the message of the ``k`` sums (``None``: none and
    nothing rides with them), ``fused``: the words ride in it (:func:`.wire.fused0`)."""
    words: torch.Tensor
    sums: torch.Tensor | None
    fused: bool
    k: int


# ================================================================ the worker's roles
def worker(call):
    """One worker's call (``call``: :class:`.worker.Call`). Round 0 up, before any wait: per aggregator
    the header, first look-aheads, position-0 blocks (colocated: each remote one's once its range is
    scanned, the hosted one last). Each verdict has its own role (:func:`verdict`): none waits for another."""
    for batch in call.round0_batches():
        for a in batch:
            yield from scan(call, a)
        yield from send_round0(call, batch)
        for a in batch:
            yield Spawn(verdict(call, a))
        yield Poll(POLL_SCAN)
    call.mark("round 0 sent")


def verdict(call, a: int):
    """Aggregator ``a``'s verdict. OK (the downstream dtype, each channel's count of round-0 sums): make
    the result (first OK verdict), post ``a``'s round-0 receives (hosted: ``GO``), start ``a``'s lanes.
    Not OK: a remote ``a`` gets this worker's manifest (:meth:`.aggregator.AggCall.drain`), then sends
    nothing more; the error is raised once the others' lanes are done (:func:`.worker.run_worker`)."""
    yield Recv((Key(Msg.REPLY, a),), order=(0, call.pos[a]))
    rh = call.inbox.take(Key(Msg.REPLY, a)).view(torch.int64).numpy()
    if int(rh[wire.R_STATUS]) != OK:
        call.errors[a] = rh.copy()
        if a != call.own:
            yield Send(header.manifest(call.hdr0[a], a).view(torch.uint8), call.aggregators[a], TAG_MANIFEST)
        return
    try:
        down = wire.code_dtype(rh[wire.R_DOWN_DTYPE])
        if call.down is not None and down != call.down:
            raise MalformedMessage(f"omnireduce: aggregator {a} announces sums of {down}, another one "
                                   f"{call.down} (this is worker {call.rank})")
        for ch in call.plans[a]:
            k = int(rh[wire.R_K + ch.slot])
            if not 0 <= k <= ch.lanes:
                raise MalformedMessage(f"omnireduce: aggregator {a} announces {k} round-0 sums in a "
                                       f"channel of {ch.lanes} lanes (this is worker {call.rank})")
            call.sums0[a, ch.slot] = k
    except MalformedMessage as exc:
        raise _fail(call.fabric, exc) from None
    if call.sink is None:
        call.down = down
        call.result, call.sink = call.make_sink(down)
    if a == call.own:           # the hosted aggregator's lanes may start
        yield Hand(Key(Msg.GO, call.rank), strategies.home_rows(call))
    else:                       # the round-0 replies' receives
        for ch in call.plans[a]:
            yield from strategies.post_reply0(call, a, ch, call.sums0[a, ch.slot])
    call.mark(f"downstream posted {a}")
    for ch in call.plans[a]:
        yield Spawn(worker_lane(call, a, call.wch[a, ch.slot]))


def scan(call, a: int):
    """Find this worker's non-zero blocks in aggregator ``a``'s range (colocated: in pieces, with a
    ``Poll`` after each); set up its channels."""
    chans = call.plans[a]
    if chans:
        lo, hi = chans[0].lo, chans[-1].lo + chans[-1].size
        step = hi - lo if call.own is None else max(1, -(-(hi - lo) // SCAN_PIECES))
        for s in range(lo, hi, step):
            call.source.scan(s, min(hi, s + step))
            if call.own is not None:
                yield Poll(POLL_SCAN)
    for ch in chans:
        call.wch[a, ch.slot] = WorkerChannel(ch, call.source.mask)
    call.mark(f"scanned {a}")


def send_round0(call, aggs: list[int]):
    """Round 0 to ``aggs``: a header each; then to each its channels' first look-aheads (small, one
    message), then the position-0 blocks (slot-major; per slot the heaviest aggregators first)."""
    for a in aggs:
        hdr = call.spec.header(call.n, {ch.slot: call.wch[a, ch.slot].pending0() for ch in call.plans[a]})
        call.hdr0[a] = hdr.numpy()
        yield from call.up(a, Key(Msg.HDR, call.rank), hdr.view(torch.uint8), TAG_HDR_UP)
        if a != call.own:
            yield Post(Key(Msg.REPLY, a), 8 * HDR, call.aggregators[a], TAG_HDR_DOWN)
    for a in (a for a in aggs if call.plans[a]):
        firsts = torch.cat([wire.encode_firsts(call.wch[a, ch.slot].mine, ch) for ch in call.plans[a]])
        yield from call.up(a, Key(Msg.FIRSTS, call.rank), firsts, TAG_FIRSTS, data=True)
    for g in range(call.spec.channels):
        for a in sorted(aggs, key=lambda a: -call.wch[a, g].pending0() if (a, g) in call.wch else 0):
            if (a, g) in call.wch:
                yield from strategies.send_up(call, Buf(Msg.BLOCKS0, a, g), a, call.wch[a, g],
                                              Key(Msg.BLOCKS0, call.rank, g))


def worker_lane(call, a: int, c: WorkerChannel):
    """A worker's lanes of aggregator ``a``'s channel ``c``: take each round's reply (the completed sums
    and the prompt), answer the prompt, until every lane is done."""
    g, pos, bs = c.ch.slot, call.pos[a], call.spec.block_size
    # round 0's reply: words and sums in one message, or waited for together (never a blocking take of
    # large sums)
    yield Recv(strategies.reply0_keys(call, a, c.ch), order=(2, c.round, g, pos), reap=True)
    c.start(strategies.take_reply0(call, a, c.ch))
    while True:
        if c.active:   # answer the prompt; post the receive of the reply
            yield from strategies.send_up(call, Buf(Msg.UP, a, g, c.round % 2), a, c, Key(Msg.UP, call.rank, g))
            if a != call.own:
                yield Post(Key(Msg.DOWN, a, g), wire.block_bytes(c.act.size, bs, call.down.itemsize),
                           call.aggregators[a], tag_down(g))
        call.mark(f"reply {a}.{g} r{c.round}")
        if not c.active:
            return
        yield Recv((Key(Msg.DOWN, a, g),), order=(2, c.round, g, pos), reap=True)
        c.down(call.inbox.take(Key(Msg.DOWN, a, g)), call.sink, bs, call.down)


# ================================================================ the aggregator's roles
def aggregator(adm, inbox, outbox, host: int | None = None, ref: np.ndarray | None = None, mark=None):
    """Aggregator ``adm.index``'s call (``adm``: its :class:`.aggregator.AggCall`): take the headers
    (colocated: as they arrive, each agreeing one's round-0 receives posted at once, ``ref`` being the
    host's own header), validate them, take the first look-aheads, send the verdict (after a failed
    one, drain); then its lanes. ``host``: the colocated worker, which gets its messages by hand and
    starts the lanes (``GO``) once it has taken this verdict (its result, where in place they sum, made)."""
    posts = adm.post_headers()
    yield from posts
    for p in posts:
        inbox.ready(p.key)        # (starts watching it: a later poll sees it arrived)
    left = [p.key for p in posts] if host is not None else []
    while left:
        yield Recv(tuple(left), order=(0,), any=True)
        for k in [k for k in left if inbox.ready(k)] or left[:1]:   # (none in: the first, blocking)
            left.remove(k)
            yield from adm.take_early(inbox, k.peer, ref)
    yield Recv(adm.headers_left(), order=(0,))
    yield from adm.take_headers(inbox)
    if adm.status == OK:
        yield from adm.prepare(inbox)
    reply = adm.reply(outbox)
    for w in adm.order:
        if w != host:
            yield Send(reply, w, TAG_HDR_DOWN, Buf(Msg.REPLY))
    if adm.status != OK:
        yield from adm.drain(inbox)
    if host is not None:
        yield Hand(Key(Msg.REPLY, adm.index), reply)
    if adm.status != OK:
        return
    if host is not None:
        yield Recv((Key(Msg.GO, host),), order=(0,))
        strategies.sum_at_home(adm.channels, inbox.take(Key(Msg.GO, host)), host)
    for c in adm.channels:
        yield Spawn(agg_lane(adm, c, inbox, outbox, host, mark))


def agg_lane(adm, c: AggChannel, inbox, outbox, host: int | None, mark=None):
    """The aggregator's lanes of channel ``c``: per round, add each holder's blocks in ``c.order`` (their
    receives' order in ``c.window``, where each added message frees room for the next receive), complete,
    queue the next round's receives, send the sums with the prompt to every worker. Colocated, a round
    waits until the host has taken the previous one."""
    gone = (Key(Msg.WORDS, adm.index, c.slot), Key(Msg.DOWN, adm.index, c.slot)) if host is not None else ()
    while c.active:
        r0 = c.round == 0
        keys = [Key(Msg.BLOCKS0 if r0 else Msg.UP, w, c.slot) for w in c.order]
        # (the next message and the later ones posted or handed over; round 0 up: sure; later: Recv.free)
        group = keys[:1] + [k for k in keys[1:] if inbox.has(k)]
        yield Recv(tuple(group), order=(1, c.round, c.slot), gone=gone, reap=True, sure=r0,
                   free=None if r0 else c.sums.buffer(c))
        c.begin(outbox)
        for i, (w, key) in enumerate(zip(c.order, keys)):
            if key not in group:   # (posted once the window had room, or handed over since)
                group = [key] + [k for k in keys[i + 1:] if inbox.has(k)]
                yield Recv(tuple(group), order=(1, c.round, c.slot), reap=True, sure=r0)
            msg = inbox.take(key)   # (the host may hand over (blocks, look-aheads) directly)
            data, looks = msg if isinstance(msg, tuple) else wire.split(
                msg, int(c.counts[w]), c.bs, c.up, meta=not (r0 and c.single))
            c.add(w, data, looks)
            if w != host:
                yield from c.window.done(key)
        out = c.finish()
        if c.active:   # the next round's holders (the prompt just computed): queue their receives
            counts = c.expect()
            c.order = [w for w in adm.order if counts[w]]
            for w in (w for w in c.order if w != host):
                c.window.want(Key(Msg.UP, w, c.slot), wire.block_bytes(int(counts[w]), c.bs, c.up.itemsize), w,
                              tag_up(c.slot))
            yield from c.window.feed()
        yield from send_down(adm, c, out, host)
        if mark is not None:
            mark(f"agg {adm.index}.{c.slot} r{c.round - 1}")


def send_down(adm, c: AggChannel, out, host: int | None):
    """A completed round to every worker (by hand to the host): round 0's :class:`Reply0`, or a later
    round's message (double-buffered: :class:`.wire.Buf` by round parity)."""
    tag = tag_down(c.slot)
    if c.round == 1:
        for w in adm.order:
            if w == host:   # by hand: words and sums apart (the sums None: already in its result)
                yield Hand(Key(Msg.WORDS, adm.index, c.slot), out.words)
                if out.k:
                    yield Hand(Key(Msg.SUMS0, adm.index, c.slot), None if c.sums.in_place else out.sums)
            else:   # the words ride with the sums, or (every block summed) are implied
                yield Send(out.sums, w, tag if out.fused else tag_sums0(c.slot), Buf(Msg.DOWN, slot=c.slot, parity=0))
        return
    for w in adm.order:
        if w == host:
            yield Hand(Key(Msg.DOWN, adm.index, c.slot), out)
        else:
            yield Send(out, w, tag, Buf(Msg.DOWN, slot=c.slot, parity=(c.round - 1) % 2))
