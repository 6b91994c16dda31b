"""OmniReduce aggregator side: per-lane look-ahead bookkeeping and block sums for one call.

Per channel and lane the aggregator keeps every worker's announced next non-zero block
(``nxt[w, lane]``); the lane's pending block is ``cur = min_w nxt[w, lane]``. In a round exactly the
workers with ``nxt[w, lane] == cur`` send that block, each with its next look-ahead; then
``min_w nxt[w, lane] > cur``: the block is complete, and its sum goes to every worker together with the
new minimum, which prompts exactly the holders of the next pending block (Fei et al., SIGCOMM'21,
Sec. 3.2; sands-lab/omnireduce ``omnireduce-RDMA/omnireduce/aggregator.cpp``). A block that is zero on
every worker is never a minimum, so it never travels. In round 0 every lane's pending block is its
position 0 (as in the reference), but only its non-zero holders send it (the reference sends it from
everybody, zero or not); the others announce their first non-zero block as metadata.

:class:`AggCall` serves one all-reduce call; it is driven either by a dedicated service endpoint
(:func:`serve`: a SimFabric service thread or an extra torch.distributed rank) or, in the colocated
deployment, interleaved with the hosting worker's own loop (:func:`.worker.run_worker`); a dedicated
endpoint's loop is :func:`.service.serve`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ProtocolError, SparseCommError  # noqa: F401 (ProtocolError: re-exported)
from . import wire
from .blocks import block_run
from .mailbox import Inbox, Outbox
from .wire import HDR, OK, TAG_HDR_UP, Buf, Key, Msg, tag_down, tag_up


class AggChannel:
    """Aggregator state of one channel: ``nxt`` (workers x lanes), active lanes and their pending blocks.

    A round is :meth:`expect` (who sends how many blocks), :meth:`begin` (place the sums), one
    :meth:`add` per sender, :meth:`finish` (the downstream message). Round 0's downstream is two
    messages, :meth:`finish` returns ``(lane words, sums)``; later rounds' one message.
    :meth:`set_home` (a one-round channel of a colocated in-place call): the sums accumulate in the
    hosting worker's result rows, which already hold its own blocks.
    """

    def __init__(self, ch: wire.Channel, n: int, block_size: int, up: torch.dtype, acc: torch.dtype,
                 down: torch.dtype) -> None:
        self.ch = ch
        self.n = n
        self.bs = block_size
        self.up, self.acc_dtype, self.down = up, acc, down
        #: one block per lane: round 0 is the whole stream, and a worker's first look-aheads are just
        #: "holds the lane's block or not"; ``nxt`` is then never needed, the holders are a bitmap
        self.single = wire.single(ch)
        self.nxt = np.empty((n, ch.lanes), dtype=np.int64) if not self.single else None
        self.held = np.empty((n, ch.lanes), dtype=bool) if self.single else None
        self.act = np.arange(ch.lanes, dtype=np.int64)   # round 0: position 0 of every lane is pending
        self.cur = self.act.copy()
        self.round = 0
        self.counts = np.zeros(n, dtype=np.int64)
        self.home: torch.Tensor | None = None
        self.home_w: int | None = None

    def set_home(self, rows: torch.Tensor, w: int) -> None:
        """Sum into ``rows`` (this channel's blocks of worker ``w``'s in-place result, dtype ``up``)."""
        if not self.single or rows.dtype != self.acc_dtype or rows.dtype != self.down:
            raise ProtocolError("omnireduce: in-place aggregation needs a one-round channel and the "
                                "accumulation dtype")
        self.home, self.home_w = rows, w

    @property
    def active(self) -> bool:
        return self.act.size > 0

    @property
    def slot(self) -> int:
        return self.ch.slot

    def round_keys(self) -> list:
        """The inbox keys of this round's messages (as :meth:`AggCall.step` takes them): its holders'."""
        return [Key(Msg.BLOCKS0 if self.round == 0 else Msg.UP, w, self.slot) for w in np.flatnonzero(self.counts)]

    def set_firsts(self, w: int, buf: torch.Tensor) -> None:
        """Worker ``w``'s first look-ahead of every lane (round-0 metadata, see :func:`wire.encode_firsts`)."""
        if self.single:
            self.held[w] = np.unpackbits(buf.numpy(), bitorder="little", count=self.ch.lanes).view(bool)
        else:
            self.nxt[w] = wire.decode_firsts(buf, self.ch)

    def expect(self) -> np.ndarray:
        """How many blocks each worker sends this round (the lanes whose pending block it holds)."""
        if self.single:          # the holders of every lane's only block: the bitmaps as they came
            self.counts = self.held.sum(axis=1)
            self.summed = np.logical_or.reduce(self.held, axis=0)
            self.rows = np.cumsum(self.summed) - 1
            self.k = int(self.rows[-1]) + 1 if self.rows.size else 0
            return self.counts
        self.held = self.nxt[:, self.act] == self.cur
        self.counts = self.held.sum(axis=1)
        summed = self.held.any(axis=0)
        self.rows = np.cumsum(summed) - 1          # lane position -> row of the sum buffer
        self.summed = summed
        self.k = int(summed.sum())
        if self.round > 0 and self.k != self.act.size:
            raise ProtocolError("omnireduce: an active lane has no holder of its pending block")
        return self.counts

    def begin(self, outbox: "Outbox") -> None:
        """Place the round's sums in a pooled downstream message (double-buffered across rounds)."""
        key = Buf(Msg.DOWN, slot=self.slot, parity=self.round % 2)
        if self.home is not None:   # the sums accumulate in place; the message is made by finish
            self._outbox, self._key = outbox, key
            self.msg = self.data = self.tail = None
            self.acc, self.fresh = self.home, False
            return
        self.msg, self.data, self.tail = outbox.message(key, self.k, self.bs, self.down, meta=self.round > 0)
        self.acc = self.data if self.acc_dtype == self.down else torch.empty(self.k, self.bs, dtype=self.acc_dtype)
        self.fresh = True   # acc not yet written: the first contribution is copied, not added

    def add(self, w: int, blocks: torch.Tensor | None, looks: torch.Tensor | None) -> None:
        """Add worker ``w``'s blocks (one per lane it holds, in lane order) and its new look-aheads
        (``None`` in round 0 of a one-round channel: every lane's next block is "none")."""
        pos = np.flatnonzero(self.held[w])
        if not self.single:
            self.nxt[w, self.act[pos]] = looks.numpy()
        if self.home is not None:
            if w != self.home_w:    # round 0 of a one-round channel: lane j holds local block j
                lanes = self.act[pos]
                run = block_run(lanes)
                if run is not None:
                    self.home[run[0]:run[1]].add_(blocks)
                else:
                    self.home.index_add_(0, torch.from_numpy(lanes), blocks)
            return
        if blocks.dtype != self.acc_dtype:
            blocks = blocks.to(self.acc_dtype)
        if pos.size == self.k:            # it holds every summed lane: rows in order, no scatter
            if self.fresh:
                self.acc.copy_(blocks)
            else:
                self.acc.add_(blocks)
        else:
            if self.fresh:
                self.acc.zero_()
            self.acc.index_add_(0, torch.from_numpy(self.rows[pos]), blocks)
        self.fresh = False

    def finish(self):
        """Complete every pending block that had holders; the downstream message(s)."""
        if self.single:          # every lane's only block is summed: nothing follows in any lane
            newc = np.full(self.act.size, self.ch.size, dtype=np.int64)
        else:
            newc = self.nxt[:, self.act].min(axis=0)
        if not (newc > self.cur).all():
            raise ProtocolError("omnireduce: a lane's pending block did not complete in its round")
        if self.home is not None:   # the message: the summed rows (a view when they are one run)
            ids = np.flatnonzero(self.summed)
            run = block_run(ids)
            nbytes = self.k * self.bs * self.down.itemsize
            if run is not None and nbytes % 4 == 0:
                self.msg = self.home[run[0]:run[1]].reshape(-1).view(torch.uint8)
            elif self.k:
                self.msg, self.data, _ = self._outbox.message(self._key, self.k, self.bs, self.down, meta=False)
                torch.index_select(self.home, 0, torch.from_numpy(ids), out=self.data)
        elif self.acc is not self.data:
            self.data.copy_(self.acc)
        if self.round == 0:
            out = (wire.encode_words(newc, self.summed, self.ch), self.msg if self.k else None)
        else:
            self.tail.copy_(torch.from_numpy(newc))
            out = self.msg
        keep = newc < self.ch.size
        self.act, self.cur = self.act[keep], newc[keep]
        self.round += 1
        self.msg = self.acc = self.data = self.tail = None
        if not self.single:
            self.held = None
        return out


class AggCall:
    """Aggregator ``index`` of one call: validates the round-0 headers, then runs its channels.

    ``colocated``: the worker hosting it (whose messages are put into the inbox locally). Every channel
    has its own tags (:func:`wire.tag_up`, :func:`wire.tag_down`) carrying its rounds in order, so the
    receives of a channel can be posted whenever its next round is known, independently of the others.
    Round 0 of a channel: per worker its first look-aheads and (if any) its position-0 blocks; the
    reply is the lane words and (if any) the position-0 sums.
    """

    def __init__(self, index: int, n: int, colocated: int | None = None) -> None:
        self.index = index
        self.n = n
        self.colocated = colocated
        self.order = [(index + 1 + k) % n for k in range(n)]
        self.channels: list[AggChannel] = []
        self.status = OK
        self.headers: list = [None] * n
        self._chans_of: dict[int, list[wire.Channel]] = {}
        self._drain: set[int] = set()
        self._early: dict[int, np.ndarray] = {}   # remote headers taken before take_headers
        self._posted: set[int] = set()            # workers whose round-0 receives are posted
        self._blocks0: list = []

    def _remote(self) -> list[int]:
        return [w for w in self.order if w != self.colocated]

    # ------------------------------------------------------------------ round 0
    def post_headers(self, inbox: Inbox) -> None:
        for w in self._remote():
            inbox.post(Key(Msg.HDR, w), 8 * HDR, w, TAG_HDR_UP)
            inbox.ready(Key(Msg.HDR, w))   # (starts watching it: a later poll sees it arrived)

    def take_early(self, inbox: Inbox, ref: np.ndarray) -> None:
        """Colocated, while the hosting worker still scans: take the remote headers already in; one that
        is well-formed and agrees with the hosting worker's own call (``ref``, its header) has its
        round-0 receives posted at once (their sizes are bounded by this worker's own tensor), so that
        its blocks travel while this endpoint works (gloo sends a message only to a posted receive)."""
        for w in self._remote():
            if w in self._early or not inbox.ready(Key(Msg.HDR, w)):
                continue
            h = inbox.take(Key(Msg.HDR, w)).view(torch.int64).numpy().copy()
            self._early[w] = h
            if (wire.validate_header(h, self.n, self.index, True) is None
                    and all(int(h[f]) == int(ref[f]) for f in wire.AGREE)):
                self._chans_of[w] = wire.plan_from_header(h)[self.index]
                self._post_round0(inbox, w, h)
                self._posted.add(w)

    def _post_round0(self, inbox: Inbox, w: int, h: np.ndarray) -> None:
        """Post worker ``w``'s round-0 receives: every channel's (small) first look-aheads, then its
        position-0 blocks (a pair's messages on one tag arrive in the order they were sent)."""
        up = wire.code_dtype(h[wire.F_DTYPE])
        for ch in self._chans_of[w]:
            inbox.post(Key(Msg.FIRSTS, w, ch.slot), wire.meta_bytes(ch), w, tag_up(ch.slot))
        for ch in self._chans_of[w]:
            k0 = int(h[wire.F_K0 + ch.slot])
            if k0:
                inbox.post(Key(Msg.BLOCKS0, w, ch.slot), wire.block_bytes(
                    k0, int(h[wire.F_BLOCK]), up.itemsize, meta=not wire.single(ch)), w, tag_up(ch.slot))

    def take_headers(self, inbox: Inbox) -> None:
        """Take every header and validate it (:func:`wire.validate_header`: against the world size, this
        aggregator's index and the protocol limits) before planning anything from it; check agreement;
        then post every round-0 receive (their sizes are in the headers: each worker's layout, and its
        position-0 blocks per channel). A malformed header gets a ``MALFORMED`` verdict (every worker
        raises :class:`~sparsecomm.errors.MalformedMessage`) and nothing of that worker is received;
        after a disagreement, the workers' round-0 messages are drained only where their announced size
        is bounded (:data:`wire.DRAIN_SLACK_BYTES`). Workers whose receives :meth:`take_early` posted
        are drained in any case."""
        bad = None
        for w in self.order:
            h = self._early[w] if w in self._early else inbox.take(Key(Msg.HDR, w)).view(torch.int64).numpy().copy()
            self.headers[w] = h
            why = wire.validate_header(h, self.n, self.index, self.colocated is not None)
            if why is not None and bad is None:
                bad = (w, why[0], int(h[why[0]]) if why[0] < HDR else 0)
        valid = [w for w in self.order if bad is None or w != bad[0]]
        for w in valid:
            if w in self._posted:
                continue
            if wire.validate_header(self.headers[w], self.n, self.index, self.colocated is not None) is None:
                self._chans_of[w] = wire.plan_from_header(self.headers[w])[self.index]
            else:
                self._chans_of[w] = []
        if bad is not None:
            self.reply_hdr = np.zeros(HDR, dtype=np.int64)
            self.reply_hdr[[wire.R_STATUS, wire.R_FIELD, wire.R_WMIN, wire.R_VMIN]] = [wire.MALFORMED, bad[1],
                                                                                       bad[0], bad[2]]
        else:
            self.reply_hdr = wire.check_headers(self.headers)
        if bad is None and int(self.reply_hdr[wire.R_STATUS]) == OK:
            self._drain = set(self.order)
        else:   # drain the well-formed workers whose announced size is bounded; nothing of the others
            ok = [w for w in self.order if wire.validate_header(self.headers[w], self.n, self.index,
                                                                self.colocated is not None) is None]
            sizes = {w: wire.round0_bytes(self.headers[w], self.index) for w in ok}
            cap = 2 * min(sizes.values(), default=0) + wire.DRAIN_SLACK_BYTES
            self._drain = {w for w in ok if sizes[w] <= cap} | self._posted
        self.status = int(self.reply_hdr[wire.R_STATUS])
        for w in self.order:
            if w == self.colocated or w not in self._drain or w in self._posted:
                continue
            self._post_round0(inbox, w, self.headers[w])
            self._posted.add(w)
        if self.status == OK:
            h = self.headers[0]
            up = wire.code_dtype(h[wire.F_DTYPE])
            down = wire.code_dtype(self.reply_hdr[wire.R_DOWN_DTYPE])
            self.channels = [AggChannel(ch, self.n, int(h[wire.F_BLOCK]), up, wire.accumulate_dtype(up), down)
                             for ch in wire.plan_from_header(h)[self.index]]

    def reply(self, outbox: Outbox) -> torch.Tensor:
        """The reply header (the same for every worker): the verdict and, after :meth:`prepare`, the
        number of position-0 sums of every channel (so that the workers post their receives at once)."""
        for c in self.channels:
            self.reply_hdr[wire.R_K + c.slot] = c.k
        buf = outbox.pool.get(("out", Buf(Msg.REPLY)), 8 * HDR)
        buf.view(torch.int64).copy_(torch.from_numpy(self.reply_hdr))
        return buf

    def drain(self, inbox: Inbox) -> None:
        """After a failed validation: consume every worker's round-0 channel messages."""
        for w in self._remote():
            if w not in self._drain:
                continue
            for ch in self._chans_of[w]:
                inbox.take(Key(Msg.FIRSTS, w, ch.slot))
                if int(self.headers[w][wire.F_K0 + ch.slot]):
                    inbox.take(Key(Msg.BLOCKS0, w, ch.slot))

    def prepare(self, inbox: Inbox) -> None:
        """Take every channel's first look-aheads (small, sent before anything else): each channel's
        round-0 pending blocks and holders are then known."""
        for c in self.channels:
            for w in self.order:
                c.set_firsts(w, inbox.take(Key(Msg.FIRSTS, w, c.slot)))
            counts = c.expect()
            if any(int(counts[w]) != int(self.headers[w][wire.F_K0 + c.slot]) for w in self.order):
                raise ProtocolError("omnireduce: round-0 blocks do not match their look-aheads")

    def schedule(self) -> list["AggChannel"]:
        """The active channels, in slot order: every pass serves them in the same order, so a channel's
        consecutive rounds are a whole pass apart and its next messages have arrived by its turn."""
        return [c for c in self.channels if c.active]

    # ------------------------------------------------------------------ rounds
    def post_round(self, c: AggChannel, inbox: Inbox, outbox: Outbox) -> None:
        """Post the receives of channel ``c``'s next round (its holders' messages); place its sums."""
        counts = c.expect()
        c.begin(outbox)
        for w in self._remote():
            k = int(counts[w])
            if k:
                inbox.post(Key(Msg.UP, w, c.slot), wire.block_bytes(k, c.bs, c.up.itemsize), w, tag_up(c.slot))

    def step(self, c: AggChannel, inbox: Inbox, outbox: Outbox, rank: int | None = None) -> None:
        """One round of channel ``c``: add every holder's blocks (the smallest messages first: they
        arrive first) and send the result to every worker (to the hosting worker ``rank`` through the
        inbox); post the next round's receives."""
        r0 = c.round == 0
        single = r0 and wire.single(c.ch)   # round 0 of a one-round channel: blocks without look-aheads
        if r0:
            c.begin(outbox)
        for w in sorted(self.order, key=lambda v: c.counts[v]):
            k = int(c.counts[w])
            if k:
                key = Key(Msg.BLOCKS0, w, c.slot) if r0 else Key(Msg.UP, w, c.slot)
                msg = inbox.take(key)
                # the hosting worker may hand over (blocks, look-aheads) directly
                data, looks = msg if isinstance(msg, tuple) else wire.split(msg, k, c.bs, c.up, meta=not single)
                c.add(w, data, looks)
        out = c.finish()
        if c.active:
            self.post_round(c, inbox, outbox)
        tag = tag_down(c.slot)
        if r0:
            words, sums = out
            for w in self.order:
                if w == rank:
                    inbox.put(Key(Msg.WORDS, self.index, c.slot), words)
                    if sums is not None:   # (None: already in place in the hosting worker's result)
                        inbox.put(Key(Msg.SUMS0, self.index, c.slot), None if c.home is not None else sums)
                else:
                    outbox.send(words, w, tag)
                    if sums is not None:
                        outbox.send(sums, w, tag, key=Buf(Msg.DOWN, slot=c.slot, parity=0))
            return
        key = Buf(Msg.DOWN, slot=c.slot, parity=(c.round - 1) % 2)
        for w in self.order:
            if w == rank:
                inbox.put(Key(Msg.DOWN, self.index, c.slot), out)
            else:
                outbox.send(out, w, tag, key=key)
