"""OmniReduce aggregator's admission of a call: the round-0 headers, the verdict, the drain.

Before an aggregator plans or allocates anything for a call it checks every worker's header
(:func:`wire.validate_header`: the world size, its own index, the protocol limits) and their agreement
(:func:`wire.check_headers`); the verdict (the reply header) goes to every worker, which raises the
error it describes on every rank. After a failed check the round-0 messages of the workers whose
announced size is bounded are drained, so that the fabric stays clean. The lanes themselves (the
:class:`.core.AggChannel` state machine and the :func:`.core.aggregator` role that runs this) are in
:mod:`.core`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ProtocolError, SparseCommError  # noqa: F401 (ProtocolError: re-exported)
from . import wire
from .core import AggChannel
from .mailbox import Inbox, Outbox, Post
from .wire import HDR, OK, TAG_FIRSTS, TAG_HDR_UP, Buf, Key, Msg, tag_up


class AggCall:
    """Aggregator ``index``'s admission of one call: its headers, its verdict, and (if it is OK) its
    channels (:class:`.core.AggChannel`). The methods that post receives return them as requests
    (:class:`.mailbox.Post`) for the role that runs this (:func:`.core.aggregator`) to yield.

    ``colocated``: the worker hosting it (whose messages are put into the inbox locally). Round 0 of a
    channel: per worker its first look-aheads and (if any) its position-0 blocks, on the channel's
    upstream tag, in that order.
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

    def remote(self) -> list[int]:
        return [w for w in self.order if w != self.colocated]

    # ------------------------------------------------------------------ round 0
    def post_headers(self) -> list:
        """The receives of the remote workers' headers."""
        return [Post(Key(Msg.HDR, w), 8 * HDR, w, TAG_HDR_UP) for w in self.remote()]

    def take_early(self, inbox: Inbox, w: int, ref: np.ndarray) -> list:
        """Colocated, while the hosting worker still scans: take worker ``w``'s header (it is in); if it
        is well-formed and agrees with the hosting worker's own call (``ref``, its header), its round-0
        receives (returned) are posted at once (their sizes are bounded by this worker's own tensor), so
        that its blocks travel while this endpoint works (gloo sends a message only to a posted receive)."""
        h = inbox.take(Key(Msg.HDR, w)).view(torch.int64).numpy().copy()
        self._early[w] = h
        if (wire.validate_header(h, self.n, self.index, True) is None
                and all(int(h[f]) == int(ref[f]) for f in wire.AGREE)):
            self._chans_of[w] = wire.plan_from_header(h)[self.index]
            self._posted.add(w)
            return self._post_round0(w, h)
        return []

    def _post_round0(self, w: int, h: np.ndarray) -> list:
        """Worker ``w``'s round-0 receives: its channels' (small) first look-aheads, one message, then
        its position-0 blocks per channel."""
        up = wire.code_dtype(h[wire.F_DTYPE])
        chans = self._chans_of[w]
        out = [Post(Key(Msg.FIRSTS, w), wire.firsts_bytes(chans), w, TAG_FIRSTS)] if chans else []
        for ch in chans:
            k0 = int(h[wire.F_K0 + ch.slot])
            if k0:
                out.append(Post(Key(Msg.BLOCKS0, w, ch.slot), wire.block_bytes(
                    k0, int(h[wire.F_BLOCK]), up.itemsize, meta=not wire.single(ch)), w, tag_up(ch.slot)))
        return out

    def headers_left(self) -> tuple:
        """The headers not taken by :meth:`take_early` (:meth:`take_headers` takes them)."""
        return tuple(Key(Msg.HDR, w) for w in self.order if w not in self._early)

    def take_headers(self, inbox: Inbox) -> list:
        """Take every header and validate it (:func:`wire.validate_header`: against the world size, this
        aggregator's index and the protocol limits) before planning anything from it; check agreement;
        then post every round-0 receive (their sizes are in the headers: each worker's layout, and its
        position-0 blocks per channel). A malformed header gets a ``MALFORMED`` verdict (every worker
        raises :class:`~sparsecomm.errors.MalformedMessage`) and nothing of that worker is received;
        after a disagreement, the workers' round-0 messages are drained only where their announced size
        is bounded (:data:`wire.DRAIN_SLACK_BYTES`). Workers whose receives :meth:`take_early` posted
        are drained in any case. Returns the round-0 receives to post."""
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
        posts = []
        for w in self.order:
            if w == self.colocated or w not in self._drain or w in self._posted:
                continue
            posts += self._post_round0(w, self.headers[w])
            self._posted.add(w)
        if self.status == OK:
            h = self.headers[0]
            up = wire.code_dtype(h[wire.F_DTYPE])
            down = wire.code_dtype(self.reply_hdr[wire.R_DOWN_DTYPE])
            self.channels = [AggChannel(ch, self.n, int(h[wire.F_BLOCK]), up, wire.accumulate_dtype(up), down)
                             for ch in wire.plan_from_header(h)[self.index]]
        return posts

    def reply(self, outbox: Outbox) -> torch.Tensor:
        """The reply header (the same for every worker): the verdict and, after :meth:`prepare`, the
        number of position-0 sums of every channel (so that the workers post their receives at once)."""
        for c in self.channels:
            self.reply_hdr[wire.R_K + c.slot] = c.k
        buf = outbox.pool.get(("out", Buf(Msg.REPLY)), 8 * HDR)
        buf.view(torch.int64).copy_(torch.from_numpy(self.reply_hdr))
        return buf

    def drain(self) -> tuple[list, list]:
        """After a failed validation: the round-0 messages to consume (first look-aheads, then blocks)."""
        firsts, blocks = [], []
        for w in self.remote():
            if w in self._drain:
                if self._chans_of[w]:
                    firsts.append(Key(Msg.FIRSTS, w))
                for ch in self._chans_of[w]:
                    if int(self.headers[w][wire.F_K0 + ch.slot]):
                        blocks.append(Key(Msg.BLOCKS0, w, ch.slot))
        return firsts, blocks

    def firsts(self) -> list:
        """The first look-aheads' keys (:meth:`prepare` takes them)."""
        return [Key(Msg.FIRSTS, w) for w in self.order] if self.channels else []

    def prepare(self, inbox: Inbox) -> None:
        """Take every channel's first look-aheads (small, sent before anything else): each channel's
        round-0 pending blocks and holders are then known."""
        chans = [c.ch for c in self.channels]
        for w in self.order if chans else ():
            for c, part in zip(self.channels, wire.split_firsts(inbox.take(Key(Msg.FIRSTS, w)), chans)):
                c.set_firsts(w, part)
        for c in self.channels:
            counts = c.expect()
            if any(int(counts[w]) != int(self.headers[w][wire.F_K0 + c.slot]) for w in self.order):
                raise ProtocolError("omnireduce: round-0 blocks do not match their look-aheads")
