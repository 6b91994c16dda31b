"""OmniReduce's fast paths: strategies the core (:mod:`.core`) calls at named points.

None of them changes what travels or which blocks are summed; they change only where bytes are copied:

* how a worker's blocks go up (:func:`send_up`): to the hosted aggregator by hand (a view of the
  tensor when the blocks are one run, in two parts when that run ends with the short last block:
  :class:`.blocks.TailRun`; nothing at all when they are summed in place), to a remote one
  as a view of the tensor when a one-round channel's blocks are one run of whole blocks (the message
  is the data itself), otherwise copied into a pooled message with their look-aheads;
* where the sums land at an aggregator: :class:`.core.MessageSums` (a pooled downstream message; the
  default) or :class:`HomeSums` (colocated, in place: a one-round channel of the hosting worker's
  in-place call is summed straight into its input, which already holds its own blocks, and the sums
  are sent from there), chosen by :func:`home_rows` / :func:`sum_at_home`;
* where round-0 sums land at a worker (:func:`post_reply0`, :func:`take_reply0`): with the lane words
  in one message (:func:`.wire.fused0`), written; a whole channel, summed everywhere, apart and
  straight into the result; otherwise into a pooled buffer, then written.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ProtocolError
from . import wire
from .blocks import block_run
from ...fabric.roles import Hand, Post, PostInto, Send
from .wire import Buf, Key, Msg, tag_down, tag_sums0, tag_up

_TAG_UP, _TAG_DOWN = tag_up(0), tag_down(0)     # (tag_up/tag_down(slot): these plus the slot; inline per message)


# ------------------------------------------------------------------ how blocks go up
def send_up(call, key: Buf, a: int, c, local_key: Key):
    """This round's blocks of channel ``c`` (:meth:`.core.WorkerChannel.take_up`) with their look-aheads,
    to aggregator ``a`` (no look-aheads in round 0 of a one-round channel: they would all be "none")."""
    meta = not (c.round == 0 and c.ch.single)
    b, look = c.take_up()
    if not b.size:
        return
    ids = b + c.ch.lo
    source = call.source
    if a == call.own:          # to the hosted aggregator: by hand; a view of the data if it can
        if homed(call, c.ch):  # the blocks already are where their sums go
            yield Hand(local_key, (None, None))
            return
        v = source.view(ids)
        if v is None:          # a run ending with the short last block: in two parts (.blocks.TailRun)
            v = source.tail_run(ids)
        if v is not None:      # (these blocks are written only once their sums are complete, later)
            yield Hand(local_key, (v, torch.from_numpy(look) if meta else None))
            return
    short = 0
    if not meta:               # a run of whole blocks, or every block unpadded, is the message itself:
        short = wire.short_end(c.ch, source.numel, source.block_size) if b.size == c.ch.size else 0
        if a != call.own:      # sent without a copy, and ``stable`` (:meth:`.base.Fabric.isend`): the source's bytes,
            # which the call writes (in place) only where the sums of ``a``'s range land, after ``a`` has taken every
            # worker's blocks of this one-round channel (its reply is their sum), and the caller only once the call
            # has returned; so a fabric that copies a send keeps a reference instead
            v = source.run_bytes(ids, short != 0)
            if v is not None:
                yield Send.new((v, call.aggregators[a], _TAG_UP + c.ch.slot, None, call.defer[a], True))
                return
    buf, data, tail = wire.message(call.outbox.pool, key, b.size, call.spec.block_size, call.spec.up, meta=meta)
    call.fabric.host_work("index", source.gather(ids, data))
    call.fabric.host_work("move", data.nbytes)         # (the blocks' bytes copied: sim_host)
    if meta:
        tail.copy_(torch.from_numpy(look))
    if a == call.own:
        yield Hand(local_key, buf)
    else:                      # (unpadded where the run is: :func:`.wire.short_end`)
        if short:
            buf = buf[:wire.block_bytes(b.size, call.spec.block_size, call.spec.up.itemsize, meta=False, short=short)]
        yield Send.new((buf, call.aggregators[a], _TAG_UP + c.ch.slot, key, call.defer[a], False))


# ------------------------------------------------------------------ where sums land: aggregator
def homed(call, ch: wire.Channel) -> bool:
    """Is the hosted channel ``ch`` summed in place (an in-place call, one round; whole blocks, or, with two
    workers, ending with the short last block: the host's block first is then the one addition
    :class:`.core.MessageSums` makes, the same bits)?"""
    return call.home and ch.agg == call.own and ch.single and (ch.lo + ch.size <= call.source.full or call.n == 2)


def home_rows(call) -> dict:
    """The range of the in-place result in which the hosted aggregator sums, per slot (flat: the channel's
    blocks as they lie, the short last block unpadded; the ``GO`` hand-over's content; empty unless the call
    is in place)."""
    if not call.home:
        return {}
    if call.result.data_ptr() != call.source.flat.data_ptr():
        raise ProtocolError("omnireduce: an in-place call's result is not its input")
    bs, out = call.spec.block_size, call.sink.out
    return {ch.slot: out[ch.lo * bs: (ch.lo + ch.size) * bs] for ch in call.plans[call.own] if homed(call, ch)}


def sum_at_home(channels: list, rows: dict, host: int) -> None:
    """Switch the channels named in ``rows`` to :class:`HomeSums` (before their round 0)."""
    for c in channels:
        if c.slot in rows:
            c.sums = HomeSums(c, rows[c.slot], host)


class HomeSums:
    """Colocated, in place: the sums of a one-round channel accumulate in ``span``, the channel's range of
    the hosting worker ``w``'s result (flat; the short last block, if the channel ends with it, unpadded),
    which already holds that worker's own blocks: they are not added.
    A lane's sum is thus the host's block, then the others' in :func:`.core.sum_order`: with three or
    more workers a float sum may round differently from :class:`.core.MessageSums`' (every worker
    still gets the same bits)."""

    in_place = True

    @staticmethod
    def buffer(c) -> None:
        return None   # (one round: its message, where it is a copy, is reused by the next call only)

    def __init__(self, c, span: torch.Tensor, w: int) -> None:
        if not c.single or span.dtype != c.acc_dtype or span.dtype != c.down:
            raise ProtocolError("omnireduce: in-place aggregation needs a one-round channel and the "
                                "accumulation dtype")
        if span.numel() != c.ch.size * c.bs - c.short:
            raise ProtocolError("omnireduce: an in-place channel's range is not its blocks' (a bug)")
        full = c.ch.size - (1 if c.short else 0)        # (its whole blocks)
        self.span, self.w, self.short = span, w, c.short
        self.rows, self.last = span[:full * c.bs].view(full, c.bs), span[full * c.bs:]

    def begin(self, c, message) -> None:
        self.message = message

    def add(self, c, w: int, pos: np.ndarray, blocks: torch.Tensor) -> int:
        """Add worker ``w``'s blocks into the range; returns the blocks added by index
        (:meth:`.core.AggChannel.add`)."""
        if w == self.w:
            return 0
        if blocks.dim() == 1:   # every block, unpadded (:func:`.wire.short_end`): the channel's range as it lies
            self.span.add_(blocks)
            return 0
        lanes = c.act[pos]      # round 0 of a one-round channel: lane j holds local block j (ascending)
        if self.short and lanes.size and lanes[-1] == c.ch.size - 1:    # the short last block: its values
            self.last.add_(blocks[-1, :self.last.numel()])
            lanes, blocks = lanes[:-1], blocks[:-1]
        run = block_run(lanes)
        if run is not None:
            self.rows[run[0]:run[1]].add_(blocks)
        elif lanes.size:
            self.rows.index_add_(0, torch.from_numpy(lanes), blocks)
            return int(lanes.size)
        return 0

    def finish(self, c):
        """The message: the summed range (a view when every block is summed and they travel alone; the short
        last block unpadded, :func:`.wire.short_end`), or a copy of the summed blocks with room for the lane
        words (:func:`.wire.fused0`)."""
        ids = c.summed.nonzero()[0]
        fused = wire.fused0(c.ch, c.k)
        if not fused and self.short:
            return self.span.view(torch.uint8), None
        run = block_run(ids)
        if not fused and run is not None and c.k * c.bs * c.down.itemsize % 4 == 0:
            return self.rows[run[0]:run[1]].reshape(-1).view(torch.uint8), None
        if not (fused or c.k):
            return None, None
        msg, data, tail = self.message(Buf(Msg.DOWN, slot=c.slot, parity=0), c.k, c.bs, c.down,
                                       extra=c.ch.words_ints if fused else 0, meta=False)
        if self.short and ids.size and ids[-1] == c.ch.size - 1:     # the short last block, zero-padded
            data[-1, :self.last.numel()].copy_(self.last)
            data[-1, self.last.numel():].zero_()
            ids, data = ids[:-1], data[:-1]
        run = block_run(ids)
        if run is not None:
            data.copy_(self.rows[run[0]:run[1]])
        elif ids.size:
            torch.index_select(self.rows, 0, torch.from_numpy(ids), out=data)
        return msg, tail


# ------------------------------------------------------------------ where sums land: worker
def post_reply0(call, a: int, ch: wire.Channel, k: int) -> Post | PostInto | None:
    """The receive of remote aggregator ``a``'s round-0 reply of channel ``ch`` (``k`` sums), as a request
    (``None``: none): one message, the sums then the lane words (:func:`.wire.fused0`); or, every block
    summed (the words are then implied), the sums alone on their own tag (:func:`post_sums0`)."""
    if k < ch.size:             # (wire.fused0, inline: once per channel of every aggregator)
        return Post.new((Key.new((Msg.WORDS, a, ch.slot)),
                         wire.block_bytes(k, call.spec.block_size, call.down.itemsize, ch.words_ints, meta=False),
                         call.aggregators[a], _TAG_DOWN + ch.slot))
    return post_sums0(call, a, ch, k)


def reply0_keys(call, a: int, ch: wire.Channel) -> tuple:
    """The messages of aggregator ``a``'s round-0 reply of ``ch``: by hand from the hosted one, the words
    and (if any) the sums; from a remote one, a single message (:func:`post_reply0`)."""
    k = call.sums0[a, ch.slot]
    if a == call.own:
        return (Key(Msg.WORDS, a, ch.slot), Key(Msg.SUMS0, a, ch.slot)) if k else (Key(Msg.WORDS, a, ch.slot),)
    return (Key.new((Msg.WORDS if k < ch.size else Msg.SUMS0, a, ch.slot)),)     # (wire.fused0, inline)


def take_reply0(call, a: int, ch: wire.Channel) -> np.ndarray | None:
    """Take round 0's reply of aggregator ``a``'s channel ``ch`` and land its sums in the result; return
    every lane's next pending block (``None`` for a one-round channel: none follows)."""
    k, bs = call.sums0[a, ch.slot], call.spec.block_size
    if ch.single:
        take_reply0_single(call, a, ch)
        return None
    ids = None
    if a == call.own:
        newc, summed = wire.decode_words(call.inbox.take(Key(Msg.WORDS, a, ch.slot)), ch)
    elif wire.fused0(ch, k):
        data, tail = wire.split(call.inbox.take(Key(Msg.WORDS, a, ch.slot)), k, bs, call.down,
                                ch.words_ints, meta=False)
        newc, summed = wire.decode_words(tail.view(torch.uint8)[:ch.meta_bytes], ch)
        if int(summed.sum()) != k:
            raise ProtocolError("omnireduce: the round-0 sums do not match their lane words")
        if k:
            call.fabric.host_work("index", call.sink.write(summed.nonzero()[0] + ch.lo, data))
            call.fabric.host_work("move", data.nbytes)
        return newc
    else:   # every block summed: one block per lane, nothing follows
        newc, ids = np.full(ch.lanes, ch.size, dtype=np.int64), np.arange(ch.lo, ch.lo + ch.size)
        summed = None
    if ids is None:
        if int(summed.sum()) != k:
            raise ProtocolError("omnireduce: the round-0 sums do not match their lane words")
        ids = summed.nonzero()[0] + ch.lo
    if k:
        land_sums0(call, a, ch, ids)
    return newc


def take_reply0_single(call, a: int, ch: wire.Channel) -> None:
    """:func:`take_reply0` of a one-round channel (``ch.single``: no next blocks follow): the lane words are a
    bitmap of the summed lanes (:func:`.wire.decode_words`), read as one integer; the lanes are looked up only
    where sums came."""
    k, bs = call.sums0[a, ch.slot], call.spec.block_size
    data = None
    if a == call.own:
        words = call.inbox.take(Key.new((Msg.WORDS, a, ch.slot))).numpy()
    elif k < ch.size:           # (wire.fused0, inline)
        msg = call.inbox.take(Key.new((Msg.WORDS, a, ch.slot)))
        if k:                   # (the words read where the blocks end, :func:`.wire.block_bytes`: numpy's slice)
            data, _ = wire.split(msg, k, bs, call.down, ch.words_ints, meta=False)
            lo = wire.block_bytes(k, bs, call.down.itemsize, meta=False)
            words = msg.numpy()[lo:lo + ch.meta_bytes]
        else:   # no sums: the words are the message's tail, at its start (:func:`.wire.split` of 0 blocks)
            words = msg.numpy()[:ch.meta_bytes]
    else:   # every block summed: one block per lane, nothing follows
        land_sums0(call, a, ch, np.arange(ch.lo, ch.lo + ch.size))
        return
    bits = int.from_bytes(words.tobytes(), "little") & ((1 << ch.lanes) - 1)
    if not k:               # (no sums: no lane may be marked summed)
        if bits:
            raise ProtocolError("omnireduce: the round-0 sums do not match their lane words")
        return
    if bits.bit_count() != k:
        raise ProtocolError("omnireduce: the round-0 sums do not match their lane words")
    if k == ch.lanes:       # every lane summed (a dense channel): the bitmap is all ones
        ids = np.arange(ch.lo, ch.lo + ch.lanes)
    else:
        ids = np.unpackbits(words, bitorder="little", count=ch.lanes).astype(bool).nonzero()[0] + ch.lo
    if data is not None:
        written = call.sink.write(ids, data)
        if call.fabric.charges_host_work:
            call.fabric.host_work("index", written)
            call.fabric.host_work("move", data.nbytes)
    else:
        land_sums0(call, a, ch, ids)


def post_sums0(call, a: int, ch: wire.Channel, k: int) -> Post | PostInto | None:
    """The receive of remote aggregator ``a``'s round-0 sums of channel ``ch`` apart (``k`` blocks, all
    of the channel's), as a request (``None``: no sums): straight into the result when its bytes are the
    result's, else pooled."""
    tag, sink, down, bs = tag_sums0(ch.slot), call.sink, call.down, call.spec.block_size
    short = wire.short_end(ch, sink.numel, bs) if k == ch.size else 0     # (every block: unpadded)
    nbytes = wire.block_bytes(k, bs, down.itemsize, meta=False, short=short)
    if k == ch.size and call.result.dtype == down and nbytes == (k * bs - short) * down.itemsize:
        call.into_sink.add((a, ch.slot))
        return PostInto(Key(Msg.SUMS0, a, ch.slot), sink.range_bytes(ch.lo * bs, (ch.lo + k) * bs - short),
                        call.aggregators[a], tag)
    if k:
        return Post(Key(Msg.SUMS0, a, ch.slot), nbytes, call.aggregators[a], tag)
    return None


def land_sums0(call, a: int, ch: wire.Channel, ids: np.ndarray) -> None:
    """Round-0 sums of blocks ``ids`` of channel ``ch`` into the result (recorded only, when they were
    received or summed in place there)."""
    got = call.inbox.take(Key(Msg.SUMS0, a, ch.slot))
    if got is None or (a, ch.slot) in call.into_sink:
        call.sink.mark(ids)
    else:                   # (from a remote aggregator, every block: unpadded, :func:`.wire.short_end`)
        short = wire.short_end(ch, call.sink.numel, call.spec.block_size) \
            if a != call.own and ids.size == ch.size else 0
        data, _ = wire.split(got, ids.size, call.spec.block_size, call.down, meta=False, short=short)
        call.fabric.host_work("index", call.sink.write(ids, data))
        call.fabric.host_work("move", data.nbytes)
