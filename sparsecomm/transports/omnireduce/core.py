"""OmniReduce's protocol: the lane state machines of one channel, at a worker and at its aggregator.

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
of a channel moves in the same message each round (block fusion). An aggregator adds the holders'
blocks in :func:`sum_order`, which fixes every float sum's rounding.

Nothing here sends or receives: a driver moves the messages. :mod:`.reference` is the plain one (a
loop of exchanges, to be read after this module); the fast one runs the roles of :mod:`.worker` and
:mod:`.aggregator` on one scheduler per endpoint (``Fabric.drive``, :mod:`sparsecomm.fabric.roles`), with the
fast paths of :mod:`.strategies`. Both give the same bits
(``tests/transports/omnireduce/test_omnireduce_reference.py``), but where the fast one sums in place
(:class:`.strategies.HomeSums`: the host's blocks first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ... import codec
from ...errors import MalformedMessage, ProtocolError
from . import wire
from .blocks import TailRun
from .wire import Buf, Msg


def sum_order(index: int, n: int) -> list[int]:
    """The workers in the order aggregator ``index`` of ``n`` workers adds their blocks: ``index + 1,
    index + 2, ...`` (mod ``n``), the order in which their round 0 reaches it (each worker visits the
    aggregator ``rank - 1`` first)."""
    return [(index + 1 + k) % n for k in range(n)]


# ================================================================ the lane state machines
@functools.lru_cache(maxsize=64)
def _nowhere(size: int) -> np.ndarray:
    """The look-aheads of a one-round channel of ``size`` blocks: ``size`` (none) for every block (read-only,
    shared by the channels of that size)."""
    out = np.full(size, size, dtype=np.int64)
    out.flags.writeable = False
    return out


#: no lane, no block (read-only, shared): a one-round channel's lanes once done, and its round-0 blocks and
#: look-aheads where it holds none
_NONE = np.empty(0, dtype=np.int64)
_NONE.flags.writeable = False


@functools.lru_cache(maxsize=64)
def _positions(lanes: int) -> np.ndarray:
    """``arange(lanes)``: the pending positions of every lane in round 0 (read-only, shared by the channels of
    that many lanes)."""
    out = np.arange(lanes, dtype=np.int64)
    out.flags.writeable = False
    return out


class WorkerChannel:
    """A worker's lanes of one channel: its own next non-zero block per lane (``mine``, announced) and,
    per active lane, the lane's pending block (``cur``, prompted by the aggregator).

    ``mask``: the worker's block mask, a bool tensor or its numpy view (a caller that builds a channel per
    aggregator and slot passes the view it made once: :attr:`.worker.Call.mask_np`). A one-round channel
    (``ch.single``) reads its slice of the mask once, here: its round-0 blocks (:meth:`pending0`,
    :meth:`take_up`) are that slice's non-zero ones, and its lanes start as a shared read-only
    ``arange`` (``act`` and ``cur`` are replaced, never written in place).

    Memory: a worker holds one per channel of every aggregator (``n`` of them, each a call long), so a
    one-round channel keeps only the indices of its non-zero blocks until it sends them (:meth:`take_up`) and
    shared read-only arrays after that; its ``mine`` is made when asked (:attr:`mine`), and a channel whose
    lanes are done holds no array of its own (:meth:`start`)."""

    __slots__ = ("ch", "round", "act", "cur", "next", "held0", "_mine")

    def __init__(self, ch: wire.Channel, mask: torch.Tensor | np.ndarray) -> None:
        self.ch = ch
        self.round = 0
        if ch.single:       # one block per lane: its first block is position 0 or none, nothing follows it
            self.act = self.cur = _positions(ch.lanes)     # round 0: position 0 of every lane is pending
            self.next = _nowhere(ch.size)
            held = (mask if isinstance(mask, np.ndarray) else mask.numpy())[ch.lo: ch.lo + ch.size]
            self.held0 = held.nonzero()[0]      # (its non-zero blocks: lane positions, ascending)
            self._mine = None                   # (made when asked: :attr:`mine`)
            return
        self.held0 = None
        self.act = np.arange(ch.lanes, dtype=np.int64)   # round 0: position 0 of every lane is pending
        self.cur = self.act.copy()
        if isinstance(mask, np.ndarray):
            mask = torch.from_numpy(mask)
        la = codec.next_nonzero(mask[ch.lo: ch.lo + ch.size], ch.lanes)   # the look-ahead of every block
        self.next = la.next.numpy()
        self._mine = la.first.numpy().copy()

    @property
    def mine(self) -> np.ndarray:
        """This worker's next non-zero block of every lane (``ch.size``: none). A one-round channel's is made
        from its round-0 blocks when asked (before :meth:`take_up`; after it, every lane's is none: a shared
        read-only array)."""
        if self._mine is not None:
            return self._mine
        ch = self.ch
        if self.round or not self.held0.size:      # (none left, or none held: the shared read-only look-aheads)
            return _nowhere(ch.size)
        out = np.full(ch.lanes, ch.size, dtype=np.int64)
        out[self.held0] = self.held0
        return out

    @property
    def active(self) -> bool:
        return self.act.size > 0

    def pending0(self) -> int:
        """How many blocks this worker sends in round 0 (its non-zero blocks at position 0; asked before
        :meth:`take_up`)."""
        if self.held0 is not None:
            return int(self.held0.size)
        return int(np.count_nonzero(self._mine == np.arange(self.ch.lanes)))

    def take_up(self) -> tuple[np.ndarray, np.ndarray]:
        """Answer the prompt: the pending blocks this worker holds (channel-local ids, lane order) and
        the next non-zero block in each of those lanes (the look-ahead it announces)."""
        if self.held0 is not None and self.round == 0:   # one-round channel: its non-zero blocks, none follows
            b = self.held0
            self.held0 = _NONE      # (sent: none left; every lane's next block is none, :attr:`mine`)
            self.round = 1
            if not b.size:          # (none held: nothing to send, no look-ahead: no array made)
                return b, _NONE
            return b, self.next[b]
        mine = self.mine[self.act]
        if (mine < self.cur).any():
            raise ProtocolError("omnireduce: a non-zero block of this worker was skipped")
        held = mine == self.cur
        lanes, b = self.act[held], self.cur[held]
        look = self.next[b]
        self._mine[lanes] = look
        self.round += 1
        return b, look

    def start(self, newc: np.ndarray | None) -> None:
        """After round 0: the next pending block of every lane (``None``: none, every lane is done; a
        one-round channel's)."""
        if newc is None:
            self.act = self.cur = _NONE
            return
        if newc.size and (int(newc.min()) < 0 or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced a next block outside the channel's "
                                   f"{self.ch.size} blocks")
        self.act = (newc < self.ch.size).nonzero()[0]
        self.cur = newc[self.act]

    def down(self, buf: torch.Tensor, sink, bs: int, down: torch.dtype) -> int:
        """A round's reply: write the completed sums; advance every lane to its next pending block. Returns
        the blocks written by their index (:meth:`.blocks.BlockSink.write`)."""
        data, newc = wire.split(buf, self.act.size, bs, down)
        newc = newc.numpy().astype(np.int64)
        if newc.size and (not (newc > self.cur).all() or int(newc.max()) > self.ch.size):
            raise MalformedMessage(f"omnireduce: an aggregator announced next blocks that do not advance "
                                   f"within the channel's {self.ch.size} blocks")
        moved = sink.write(self.cur + self.ch.lo, data)
        keep = newc < self.ch.size
        self.act, self.cur = self.act[keep], newc[keep]
        return moved


class AggChannel:
    """The aggregator's lanes of one channel: every worker's announced next block (``nxt``, workers x
    lanes; the pending block of a lane is its column minimum), the active lanes and their pending blocks.

    A round is :meth:`expect` (who holds each pending block: their counts size the receives),
    :meth:`begin`, one :meth:`add` per holder in :func:`sum_order`, :meth:`finish` (complete; the
    downstream message). The sums accumulate in ``sums``: a :class:`MessageSums` unless a driver puts
    another accumulator with its interface there before round 0 (:class:`.strategies.HomeSums`). With
    one block per lane (``Channel.single``) round 0 is the whole stream and the announce is a bitmap of
    holders (``held``) instead of ``nxt``. ``short``: the elements a message of every block of the channel
    leaves off (:func:`.wire.short_end` of the call's tensor). ``held``: a one-round channel's bitmap of
    holders, ``(n, lanes)`` bool, where the caller keeps it (the channel's columns of one bitmap of the
    aggregator's range, filled by one unpack per worker: :meth:`.aggregator.AggCall.prepare`); by default its
    own."""

    def __init__(self, ch: wire.Channel, n: int, block_size: int, up: torch.dtype, acc: torch.dtype,
                 down: torch.dtype, short: int = 0, held: np.ndarray | None = None) -> None:
        self.ch, self.n, self.bs, self.short = ch, n, block_size, short
        self.up, self.acc_dtype, self.down = up, acc, down
        self.single = ch.single
        self.nxt = np.empty((n, ch.lanes), dtype=np.int64) if not self.single else None
        if held is not None and (not self.single or held.shape != (n, ch.lanes) or held.dtype != bool):
            raise ProtocolError("omnireduce: a channel's holders bitmap must be (workers, lanes) bool, of a "
                                "one-round channel (a bug)")
        self.held = (np.empty((n, ch.lanes), dtype=bool) if held is None else held) if self.single else None
        self.act = self.cur = _positions(ch.lanes)   # round 0: position 0 of every lane (replaced, not written)
        self.round = 0
        self.counts = np.zeros(n, dtype=np.int64)
        self.sums = MessageSums()
        self.order, self.window = [], None   # this round's holders in summing order; the receive window
        self.slot = ch.slot                  # (its channel's, read per message)

    @property
    def active(self) -> bool:
        return self.act.size > 0

    def set_firsts(self, w: int, part: np.ndarray) -> None:
        """Worker ``w``'s announce of round 0: its first non-zero block of every lane (``part``: this channel's
        bytes of its message, :func:`.wire.split_firsts`)."""
        if self.single:
            self.held[w] = np.unpackbits(part, bitorder="little", count=self.ch.lanes).view(bool)
        else:
            self.nxt[w] = wire.decode_firsts(part, self.ch)

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

    def begin(self, message) -> None:
        """Start a round's sums; ``message(role, k, block_size, dtype, extra=0, meta=True)`` gives a
        block message ``(buffer, blocks view, int32 tail view)``, :func:`.wire.split` (a fresh one, or
        one pooled by its role: :func:`.wire.message`)."""
        self.sums.begin(self, message)

    def add(self, w: int, blocks: torch.Tensor | None, looks: torch.Tensor | None) -> int:
        """Add worker ``w``'s blocks (one per lane it holds, lane order; a flat run of every lane without the
        short last block's padding, :func:`.wire.short_end`) and take its announced look-aheads (``None`` in
        round 0 of a one-round channel: nothing follows). Returns the blocks added at scattered rows (by
        their index; the host model's ``"index"`` count)."""
        pos = self.held[w].nonzero()[0]
        if not self.single:
            self.nxt[w, self.act[pos]] = looks.numpy()
        return self.sums.add(self, w, pos, blocks)

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
                room = tail.view(torch.uint8)   # (a lane bitmap's last int32 word: its bytes past the bitmap zeroed)
                room[:words.numel()].copy_(words)
                if room.numel() > words.numel():
                    room[words.numel():].zero_()
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


# ================================================================ the sums
class MessageSums:
    """A round's sums, accumulated in its downstream message (in the accumulation dtype first where the
    downstream dtype is narrower): :meth:`begin`, one :meth:`add` per holder, :meth:`finish` -> the
    message and its int32 tail. The first contribution is copied, every later one added, so a lane's
    sum is its holders' blocks added in :func:`sum_order`. ``in_place``: whether the sums are already
    where the workers' results are (here: no)."""

    in_place = False

    @staticmethod
    def buffer(c) -> Buf:
        """The role of round ``c.round``'s message (a driver that pools messages keeps two per channel,
        by round parity)."""
        return Buf(Msg.DOWN, slot=c.slot, parity=c.round % 2)

    def begin(self, c, message) -> None:
        extra = c.ch.words_ints if c.round == 0 and wire.fused0(c.ch, c.k) else 0   # (room for the words)
        self.msg, self.data, self.tail = message(self.buffer(c), c.k, c.bs, c.down, extra=extra, meta=c.round > 0)
        self.acc = self.data if c.acc_dtype == c.down else torch.empty(c.k, c.bs, dtype=c.acc_dtype)
        self.fresh = True   # acc not yet written: the first contribution is copied, not added

    def add(self, c, w: int, pos: np.ndarray, blocks) -> int:
        """Add worker ``w``'s blocks (a ``(pos.size, block_size)`` tensor, the hosting worker's
        :class:`.blocks.TailRun`, or a flat run of every lane without the short last block's padding,
        :func:`.wire.short_end`) at the message rows of lane positions ``pos``; returns the blocks added
        by index. The sums' padding is zero, as the sum of zero-padded blocks."""
        if isinstance(blocks, TailRun):
            if pos.size != c.k:        # (some lanes only: by index, as one tensor)
                return self.add(c, w, pos, blocks.joined())
            for acc, part in ((self.acc[:-1], blocks.head), (self.acc[-1:], blocks.last)):   # rows in order
                part = part if part.dtype == c.acc_dtype else part.to(c.acc_dtype)
                if self.fresh:
                    acc.copy_(part)
                else:
                    acc.add_(part)
            self.fresh = False
            return 0
        if blocks.dim() == 1:          # every lane, unpadded: the same elements added, the padding kept zero
            if blocks.dtype != c.acc_dtype:
                blocks = blocks.to(c.acc_dtype)
            acc, m = self.acc.view(-1), blocks.numel()
            if self.fresh:
                acc[:m].copy_(blocks)
                acc[m:].zero_()
            else:
                acc[:m].add_(blocks)
            self.fresh = False
            return 0
        if blocks.dtype != c.acc_dtype:
            blocks = blocks.to(c.acc_dtype)
        moved = 0
        if pos.size == c.k:            # it holds every summed lane: rows in order, no scatter
            if self.fresh:
                self.acc.copy_(blocks)
            else:
                self.acc.add_(blocks)
        else:
            if self.fresh:
                self.acc.zero_()
            self.acc.index_add_(0, torch.from_numpy(c.rows[pos]), blocks)
            moved = int(pos.size)
        self.fresh = False
        return moved

    def finish(self, c):
        if self.acc is not self.data:
            self.data.copy_(self.acc)
        out = self.msg, self.tail
        self.msg = self.acc = self.data = self.tail = None
        return out
