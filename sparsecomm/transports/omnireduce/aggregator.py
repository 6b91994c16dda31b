"""OmniReduce aggregator's admission of a call: the round-0 headers, the verdict, the drain.

Before an aggregator plans or allocates anything for a call it checks every worker's header
(:func:`header.validate_header`: the world size, its own index, the protocol limits, the checksum) and
their agreement (:func:`header.check_headers`); the verdict (the reply header) goes to every worker, which
raises the error it describes on every rank. Round-0 receives are posted from the headers only for an
agreeing, well-formed call (colocated, a header that agrees with the hosting worker's own call as soon
as it is in). After a verdict that is not OK nothing is received by a header, which may be the wrong
one: every remote worker sends a manifest of what it sent in round 0 (:func:`header.manifest`), and the
aggregator consumes exactly those messages, so that the fabric is clean for the next call and nothing a
header announces is allocated. The lanes themselves (the :class:`.core.AggChannel` state machine and the
:func:`.core.aggregator` role that runs this) are in :mod:`.core`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import MalformedMessage, ProtocolError, SparseCommError  # noqa: F401 (ProtocolError: re-exported)
from .._handshake import _fail
from . import header, wire
from .core import AggChannel
from .mailbox import Inbox, Outbox, Post, PostInto, Recv
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
        self._early: dict[int, np.ndarray] = {}   # remote headers taken before take_headers
        self._posted: dict[int, list] = {}        # worker -> the keys of its round-0 receives, posted

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
        if (header.validate_header(h, self.n, self.index, True) is None
                and all(int(h[f]) == int(ref[f]) for f in wire.AGREE)):
            return self._post_round0(w, h)
        return []

    def _post_round0(self, w: int, h: np.ndarray) -> list:
        """Worker ``w``'s round-0 receives, as its (validated) header announces them: its channels'
        (small) first look-aheads, one message, then its position-0 blocks per channel."""
        firsts, blocks = header.round0_sizes(h, self.index)
        out = [Post(Key(Msg.FIRSTS, w), firsts, w, TAG_FIRSTS)] if firsts else []
        out += [Post(Key(Msg.BLOCKS0, w, g), nbytes, w, tag_up(g)) for g, nbytes in blocks.items()]
        self._posted[w] = [p.key for p in out]
        return out

    def headers_left(self) -> tuple:
        """The headers not taken by :meth:`take_early` (:meth:`take_headers` takes them)."""
        return tuple(Key(Msg.HDR, w) for w in self.order if w not in self._early)

    def take_headers(self, inbox: Inbox) -> list:
        """Take every header and validate it (:func:`header.validate_header`: against the world size, this
        aggregator's index, the protocol limits and its checksum) before planning anything from it; check
        agreement. A malformed header gets a ``MALFORMED`` verdict naming its worker (every worker raises
        :class:`~sparsecomm.errors.MalformedMessage`). Returns the round-0 receives left to post: if the
        verdict is OK, every remote worker's (their sizes are in the headers: each worker's layout, and
        its position-0 blocks per channel); otherwise none (:meth:`drain_plan` consumes the messages)."""
        bad = None
        for w in self.order:
            h = self._early[w] if w in self._early else inbox.take(Key(Msg.HDR, w)).view(torch.int64).numpy().copy()
            self.headers[w] = h
            why = header.validate_header(h, self.n, self.index, self.colocated is not None)
            if why is not None and bad is None:
                bad = (w, why[0], int(h[why[0]]))
        if bad is not None:
            self.reply_hdr = np.zeros(HDR, dtype=np.int64)
            self.reply_hdr[[wire.R_STATUS, wire.R_FIELD, wire.R_WMIN, wire.R_VMIN]] = [wire.MALFORMED, bad[1],
                                                                                       bad[0], bad[2]]
        else:
            self.reply_hdr = header.check_headers(self.headers)
        self.status = int(self.reply_hdr[wire.R_STATUS])
        if self.status != OK:
            return []
        posts = []
        for w in self.remote():
            if w not in self._posted:
                posts += self._post_round0(w, self.headers[w])
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

    # ------------------------------------------------------------------ after a verdict that is not OK
    def drain(self, inbox: Inbox):
        """A generator of requests (for the role to ``yield from``): take every remote worker's manifest
        (:func:`.header.manifest`, fixed size), then consume exactly the round-0 messages it lists, one
        at a time into one scratch buffer; a worker whose round-0 receives :meth:`take_early` posted has
        those taken instead. A manifest changed on the way, or announcing a message over
        :data:`.header.DRAIN_MAX_BYTES`, ends the job (:class:`~sparsecomm.errors.MalformedMessage`,
        reported to every rank): its messages would stay on the fabric."""
        keys = [Key(Msg.MANIFEST, w) for w in self.remote()]
        for k in keys:
            yield Post(k, 8 * wire.MAN, k.peer, wire.TAG_MANIFEST)
        yield Recv(tuple(keys), order=(0,))
        todo = []
        for w in self.remote():
            try:
                firsts, blocks = header.read_manifest(inbox.take(Key(Msg.MANIFEST, w)).view(torch.int64).numpy(), w)
            except MalformedMessage as exc:
                raise _fail(inbox.fabric, exc) from None
            if w in self._posted:
                todo += [(k, None, w, None) for k in self._posted[w]]
                continue
            if firsts:
                todo.append((Key(Msg.FIRSTS, w), firsts, w, TAG_FIRSTS))
            todo += [(Key(Msg.BLOCKS0, w, g), nbytes, w, tag_up(g)) for g, nbytes in blocks.items()]
        scratch = torch.empty(max((nb for _, nb, _, _ in todo if nb), default=0), dtype=torch.uint8)
        for key, nbytes, src, tag in todo:
            if nbytes is not None:
                yield PostInto(key, scratch[:nbytes], src, tag)
            yield Recv((key,), order=(0,), sure=True)   # (round 0 up: sent before the worker's first wait)
            inbox.take(key)

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
