"""An OmniReduce aggregator's call in the fast driver: its admission (the round-0 headers, the verdict,
the drain; :class:`AggCall`) and its roles (:func:`aggregator`, :func:`agg_lane`), run on the endpoint's
scheduler (``Fabric.drive``) by a dedicated aggregator (:mod:`.service`) or, colocated, beside
its hosting worker's roles (:func:`.worker.run_worker`).

Before an aggregator plans or allocates anything for a call it checks every worker's header
(:func:`header.validate_header`: the world size, its own index, the protocol limits, the checksum) and
their agreement (:func:`header.check_headers`); the verdict (the reply header) goes to every worker, which
raises the error it describes on every rank. Round-0 receives are posted from the headers only for an
agreeing, well-formed call (colocated, a header that agrees with the hosting worker's own call as soon
as it is in). After a verdict that is not OK nothing is received by a header, which may be the wrong
one: every remote worker sends a manifest of what it sent in round 0 (:func:`header.manifest`), and the
aggregator consumes exactly those messages, so that the fabric is clean for the next call and nothing a
header announces is allocated. The lanes' state machine is :class:`.core.AggChannel`.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np
import torch

from ...errors import MalformedMessage, ProtocolError, SparseCommError  # noqa: F401 (ProtocolError: re-exported)
from ...fabric.roles import Hand, Inbox, Outbox, Post, PostInto, Recv, SendEach, Spawn
from .._handshake import fail_stop
from . import header, strategies, wire
from .core import AggChannel, sum_order
from .stages import Phase, Stage
from .window import ALIGN, Window
from .wire import HDR, OK, TAG_FIRSTS, TAG_HDR_DOWN, TAG_HDR_UP, Buf, Key, Msg, tag_down, tag_sums0, tag_up


#: a channel's receive ring (:class:`.window.Window`) holds this many of its largest messages: one is
#: summed while the next arrives, and the aggregator's memory does not depend on the number of workers
WINDOW_MESSAGES = 2
FIRSTS = -1   #: the key of the first look-aheads' window in :attr:`AggCall.windows` (the others: slots)
#: the stages of an admission's waits (one value each: built once, not per wait)
_HEADERS, _FIRSTS, _MANIFESTS, _DRAIN, _GO = (Stage(p) for p in (Phase.HEADERS, Phase.FIRSTS, Phase.MANIFESTS,
                                                                   Phase.DRAIN, Phase.GO))


def may_defer(worker: int, index: int, n: int) -> bool:
    """May aggregator ``index`` post its receive of ``worker``'s data (first look-aheads, blocks) late?
    Its window takes the workers in :attr:`AggCall.order` and always has room for the first
    :data:`WINDOW_MESSAGES` of them (each message is at most a channel's largest); a later one's
    receive may wait for earlier messages to be summed, so its sender must not wait for that send
    before its own next steps (:meth:`sparsecomm.fabric.roles.Outbox.reap`)."""
    return (worker - index - 1) % n >= WINDOW_MESSAGES


class AggCall:
    """Aggregator ``index``'s admission of one call: its headers, its verdict, and (if it is OK) its
    channels (:class:`.core.AggChannel`). The methods that post receives return them as requests
    (:class:`sparsecomm.fabric.roles.PostInto`) for the role that runs this (:func:`aggregator`) to yield.

    ``colocated``: the worker hosting it (whose messages are put into the inbox locally). Round 0: per
    worker its first look-aheads (one message) and, per channel, its position-0 blocks (if any), on the
    channel's upstream tag. Every receive of the workers' data goes through a window
    (:class:`.window.Window`; one per channel, one for the first look-aheads), posted and consumed in
    :attr:`order` (:func:`.core.sum_order`), which is the order of the sums in every round.
    Colocated, a worker's round-0 receives are queued as soon as its header and those of the workers
    before it are in and agree with the host's call.
    """

    def __init__(self, index: int, n: int, colocated: int | None = None) -> None:
        self.index = index
        self.n = n
        self.colocated = colocated
        self.order = sum_order(index, n)
        self.channels: list[AggChannel] = []
        self.status = OK
        self.headers: list | np.ndarray = [None] * n     # (take_headers: a table, a row per worker)
        self._agreed: set[int] = set()            # colocated: early headers that agree with the host's
        self._valid: set[int] = set()             # colocated: early headers that validate_header accepted
        self._words: dict[int, bytes] = {}        # worker -> its header's bytes (early ones: :meth:`take_early`)
        self._ref = None                          # colocated: the host's header's bytes, compared
        self._remote = tuple(w for w in self.order if w != colocated)
        at = self.order.index(colocated) if colocated is not None else n
        self._around = (tuple(self.order[:at]), tuple(self.order[at + 1:]))
        self._queued: list[int] = []              # workers whose round-0 receives are queued, in order
        self.windows: dict[int, Window] = {}      # slot -> its window; FIRSTS: the first look-aheads'
        self.bitmap = None                        # one-round channels' holders, (worker, block) (take_headers)
        self._table = None                        # the remote headers' receive buffer (post_headers), numpy

    def remote(self) -> tuple[int, ...]:
        """The workers other than the hosting one, in :attr:`order`."""
        return self._remote

    def around(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The workers before the hosting one in :attr:`order`, and those after it (dedicated: every worker, and
        none): a message to every worker goes to the first, by hand to the host, then to the others."""
        return self._around

    # ------------------------------------------------------------------ round 0
    def post_headers(self, pool) -> list:
        """The receives of the remote workers' headers, each into its worker's row of one buffer of ``pool`` (its
        role has no peer: one buffer kept across calls, not one per worker)."""
        size = 8 * HDR
        table = pool.get(("in", Buf(Msg.HDR)), size * self.n)
        self._table = table.numpy()     # (its bytes as numpy: a header taken early is read from its row here)
        return [PostInto.new((Key.new((Msg.HDR, w, -1)), table[w * size:(w + 1) * size], w, TAG_HDR_UP))
                for w in self.remote()]

    def open_windows(self, h: np.ndarray, pool) -> None:
        """The receive windows of the call that (validated) header ``h`` describes, from ``pool``: per
        channel :data:`WINDOW_MESSAGES` of its largest message, and as many first look-ahead messages."""
        up = wire.code_dtype(h[wire.F_DTYPE])
        chans = wire.plan_from_header(h)[self.index]
        room = lambda nbytes: WINDOW_MESSAGES * -(-nbytes // ALIGN) * ALIGN   # noqa: E731
        for ch in chans:
            nbytes = room(wire.block_bytes(ch.lanes, int(h[wire.F_BLOCK]), up.itemsize))
            self.windows[ch.slot] = Window(pool.get(("in", Buf(Msg.UP, slot=ch.slot)), nbytes))
        if chans:
            self.windows[FIRSTS] = Window(pool.get(("in", Buf(Msg.FIRSTS)), room(wire.firsts_bytes(chans))))

    def take_early(self, inbox: Inbox, key: Key, ref: np.ndarray) -> list:
        """Colocated, while the hosting worker still scans: take the header ``key`` (worker ``w = key.peer``'s;
        it is in); if it
        is well-formed and agrees with the hosting worker's own call (``ref``, its header), its round-0
        receives are queued once those of every worker before it in :attr:`order` are, and the ones that
        fit are posted at once (returned), so that its blocks travel while this endpoint works (gloo
        sends a message only to a posted receive)."""
        w = key.peer
        msg, size = inbox.take(key), 8 * HDR
        # (its bytes, a copy, are the checks' key; received into its row of the table, read there as numpy)
        words = self._words[w] = (self._table[w * size:(w + 1) * size] if self._table is not None
                                  else msg.numpy()).tobytes()
        if header.validate_words(words, self.n, self.index, True) is None:
            self._valid.add(w)      # (not validated again by the verdict: :meth:`take_headers`)
            if self._ref is None:
                self._ref = np.ascontiguousarray(ref, dtype=np.int64).tobytes()
            if header.agrees(words, self._ref):
                if not self.windows:
                    self.open_windows(ref, inbox.pool)
                self._agreed.add(w)
        remote, queued, agreed = self._remote, self._queued, self._agreed
        i, r = len(queued), len(remote)
        while i < r and remote[i] in agreed:   # (the next in order agrees: it and those after it queued;
            self._queue(remote[i], self._words[remote[i]])   # no copy of the rest of the order per header)
            i += 1
        return self._feed()

    def _queue(self, w: int, words: bytes) -> None:
        """Queue worker ``w``'s round-0 receives in the windows, as its (validated) header, whose int64 words are
        ``words``, announces them."""
        firsts, blocks = header.round0_sizes_of_words(words, self.index)
        if firsts:
            self.windows[FIRSTS].want(Key.new((Msg.FIRSTS, w, -1)), firsts, w, TAG_FIRSTS)
        for g, nbytes in blocks:
            self.windows[g].want(Key.new((Msg.BLOCKS0, w, g)), nbytes, w, tag_up(g))
        self._queued.append(w)

    def _feed(self) -> list:
        """The receives that fit now: the first look-aheads' window first, then the channels'. Each worker
        sends its first look-aheads (small) before its blocks, and :meth:`prepare` takes them before any
        block, for the verdict; gloo moves a peer's messages in the order their receives are posted once
        the peer has sent them all, so a look-ahead posted after the blocks would wait for the whole of them
        on the wire, and the verdict with it (every worker's receives of the sums wait for that)."""
        wins = self.windows
        firsts = wins.get(FIRSTS)
        out = firsts.feed() if firsts is not None and firsts.queue else []
        for g, win in wins.items():
            if g != FIRSTS and win.queue:   # (a window with nothing queued posts nothing: not asked)
                out += win.feed()
        return out

    def queued(self) -> list[int]:
        """The remote workers whose round-0 receives are queued in the windows, in :attr:`order` (those that
        fit posted: :meth:`take_early`, :meth:`take_headers`)."""
        return self._queued

    def headers_left(self) -> tuple:
        """The headers not taken by :meth:`take_early` (:meth:`take_headers` takes them)."""
        return tuple(Key(Msg.HDR, w) for w in self.order if w not in self._words)

    def take_headers(self, inbox: Inbox) -> list:
        """Take every header and validate it (:func:`.header.validate_header`: against the world size, this
        aggregator's index, the protocol limits and its checksum; an early one, :meth:`take_early`, was
        validated as it came, and is not again) before planning anything from it; check agreement. A malformed header gets a ``MALFORMED`` verdict naming its worker (every worker raises
        :class:`~sparsecomm.errors.MalformedMessage`). If the verdict is OK, the remote workers' round-0
        receives are queued (their sizes are in the headers: each worker's layout, and its position-0
        blocks per channel); returned, the ones that fit now. Otherwise nothing more is received by a
        header (:meth:`drain` consumes the messages)."""
        words = self._words
        for w in self.order:
            if w not in words:
                words[w] = inbox.take(Key(Msg.HDR, w)).numpy().tobytes()
        joined = b"".join(map(words.__getitem__, range(self.n)))    # (worker order; read-only: nothing writes one)
        if len(joined) == 8 * HDR * self.n:     # (one table, a row per worker: no array object per worker)
            self.headers = np.frombuffer(joined, dtype=np.int64).reshape(self.n, HDR)
        else:
            self.headers = [np.frombuffer(words[w], dtype=np.int64) for w in range(self.n)]
        self.reply_hdr = header.verdict(self.headers, self.order, self.index, self.colocated is not None,
                                        self._valid)
        self.status = int(self.reply_hdr[wire.R_STATUS])
        if self.status != OK:
            words.clear()
            return []
        h = self.headers[0]
        up = wire.code_dtype(h[wire.F_DTYPE])
        down = wire.code_dtype(self.reply_hdr[wire.R_DOWN_DTYPE])
        bs, numel = int(h[wire.F_BLOCK]), int(h[wire.F_NUMEL])
        chans = wire.plan_from_header(h)[self.index]
        # one-round channels whose first look-aheads are one bitmap of the range (:func:`.wire.one_bitmap`): the
        # channels' holders are columns of one (worker, block) bitmap, a worker's row filled by one unpack
        self.bitmap = np.empty((self.n, sum(ch.lanes for ch in chans)), dtype=bool) if chans.bitmap else None
        cols = np.cumsum([0] + [ch.lanes for ch in chans]).tolist()
        self.channels = [AggChannel(ch, self.n, bs, up, wire.accumulate_dtype(up), down, wire.short_end(ch, numel, bs),
                                    None if self.bitmap is None else self.bitmap[:, cols[i]:cols[i + 1]])
                         for i, ch in enumerate(chans)]
        if not self.windows:
            self.open_windows(h, inbox.pool)
        table = self.headers if isinstance(self.headers, np.ndarray) else np.stack(self.headers)
        self.k0 = table[:, wire.F_K0:wire.F_K0 + wire.MAX_CHANNELS]   # (worker, slot; a view of the table: no copy)
        for c in self.channels:
            k0 = self.k0[:, c.slot].tolist()
            c.order = [w for w in self.order if k0[w]]
            c.window = self.windows[c.slot]
        for w in self.remote()[len(self._queued):]:   # (colocated: those not queued as their headers came)
            self._queue(w, words[w])
        words.clear()       # (read in :attr:`headers` from now on: not a second copy per worker for the call)
        return self._feed()

    def reply(self, outbox: Outbox) -> torch.Tensor:
        """The reply header (the same for every worker): the verdict and, after :meth:`prepare`, the
        number of position-0 sums of every channel (so that the workers post their receives at once)."""
        for c in self.channels:
            self.reply_hdr[wire.R_K + c.slot] = c.k
        buf = outbox.pool.get(("out", Buf(Msg.REPLY)), 8 * HDR)
        buf.view(torch.int64).copy_(torch.from_numpy(self.reply_hdr))
        return buf

    def prepare(self, inbox: Inbox):
        """A generator of requests (for the role to ``yield from``): take every worker's first
        look-aheads (small, sent before anything else), in :attr:`order`, through their window; each
        channel's round-0 pending blocks and holders are then known."""
        chans = [c.ch for c in self.channels]
        bitmap = self.bitmap
        bits = bitmap.shape[1] if bitmap is not None else 0
        for w in self.order if chans else ():
            key = Key.new((Msg.FIRSTS, w, -1))
            yield Recv.new(((key,), _FIRSTS, (), False, None))   # (each right after its header)
            if bitmap is not None:      # (every channel's holders at once: what set_firsts of each writes)
                bitmap[w] = np.unpackbits(inbox.take(key).numpy(), bitorder="little", count=bits)   # (0/1 as bool)
            else:
                for c, part in zip(self.channels, wire.split_firsts(inbox.take(key), chans)):
                    c.set_firsts(w, part)
            if w != self.colocated:
                yield from self.windows[FIRSTS].done(key)
        for c in self.channels:
            counts = c.expect()     # (per worker; every worker is in :attr:`order`)
            if bool((counts != self.k0[:, c.slot]).any()):
                raise ProtocolError("omnireduce: round-0 blocks do not match their look-aheads")

    # ------------------------------------------------------------------ after a verdict that is not OK
    def drain(self, inbox: Inbox):
        """A generator of requests (for the role to ``yield from``): take every remote worker's manifest
        (:func:`.header.manifest`, fixed size), then consume the round-0 receives already posted (through
        the windows, from headers that agreed), and the other round-0 messages the manifests list, one at
        a time into one scratch buffer. A manifest changed on the way, or announcing a message over
        :data:`.header.DRAIN_MAX_BYTES`, ends the job (:class:`~sparsecomm.errors.MalformedMessage`,
        reported to every rank): its messages would stay on the fabric."""
        keys = [Key(Msg.MANIFEST, w) for w in self.remote()]
        for k in keys:
            yield Post(k, 8 * wire.MAN, k.peer, wire.TAG_MANIFEST)
        yield Recv(tuple(keys), _MANIFESTS)
        posted = [k for win in self.windows.values() for k in win.posted()]
        todo = [(k, None, None, None) for k in posted]
        for w in self.remote():
            try:
                man = inbox.take(Key(Msg.MANIFEST, w)).view(torch.int64).numpy()
                firsts, blocks = header.read_manifest(man, w)
            except MalformedMessage as exc:
                raise fail_stop(inbox.fabric, exc) from None
            sent = [(Key(Msg.FIRSTS, w), firsts, w, TAG_FIRSTS)] if firsts else []
            sent += [(Key(Msg.BLOCKS0, w, g), nbytes, w, tag_up(g)) for g, nbytes in blocks.items()]
            todo += [m for m in sent if m[0] not in posted]
        scratch = torch.empty(max((nb for _, nb, _, _ in todo if nb), default=0), dtype=torch.uint8)
        for key, nbytes, src, tag in todo:
            if nbytes is not None:
                yield PostInto(key, scratch[:nbytes], src, tag)
            yield Recv((key,), _DRAIN)
            inbox.take(key)


# ------------------------------------------------------------------ the roles
def aggregator(adm, inbox, outbox, host: int | None = None, ref: np.ndarray | None = None, mark=None,
               taken=None):
    """Aggregator ``adm.index``'s call (``adm``: its :class:`AggCall`): take the headers
    (colocated: as they arrive, each agreeing one's round-0 receives posted at once, ``ref`` being the
    host's own header), validate them, take the first look-aheads, send the verdict (after a failed
    one, drain); then its lanes. ``host``: the colocated worker, which gets its messages by hand and
    starts the lanes (``GO``) once it has taken this verdict (its result, where in place they sum, made).

    Colocated, each wake of the wait ``any`` on the headers left takes the one header it is resumed with
    (:class:`~sparsecomm.fabric.roles.Recv`: the one whose arrival chose it), not every one in: the scheduler
    knows which arrived, and a look at the others would cost each wake a call per header left (O(n) per
    header, O(n^2) per aggregator). The waits name the headers left as the live view of a dict (``left.keys()``):
    each goes on with the scheduler's watch of them, and the SimFabric's record, in O(1), where a tuple of them
    would cost a pass to build, one to compare and one to look each up again. Where several are in at once
    (gloo), the role is resumed again at once for each of the others. ``taken``: colocated, ``taken(w)`` gives the
    requests to make once worker ``w``'s round-0 receives are queued (those that fit posted), or at the latest
    once every remote header is taken (the host's blocks to ``w``'s aggregator: :func:`.worker.release_up`; a
    second ``taken(w)`` makes none)."""
    posts = adm.post_headers(inbox.pool)
    yield from posts
    inbox.ready_keys([p.key for p in posts])     # (starts watching them: a later poll sees them arrived)
    left = dict.fromkeys(p.key for p in posts) if host is not None else {}   # (in order; O(1) removal)
    rest = left.keys()          # (the live view the waits name: each goes on with the scheduler's watch, O(1))
    released = 0
    while left:     # one header per wake, the one the scheduler resumes this with: no look at the others
        k = yield Recv.new((rest, _HEADERS, (), True, None))
        del left[k]             # (that key alone, before the next wait: the view's contract, :class:`Recv`)
        yield from adm.take_early(inbox, k, ref)
        if taken is not None:   # (the workers whose round-0 receives this header queued: it, and those after it)
            for w in adm.queued()[released:]:
                yield from taken(w)
            released = len(adm.queued())
    if taken is not None:       # (every remote header is in; those not queued: not agreeing, or not yet in order)
        for w in adm.remote():
            yield from taken(w)
    yield Recv(adm.headers_left(), _HEADERS)
    yield from adm.take_headers(inbox)
    if adm.status == OK:
        yield from adm.prepare(inbox)
    reply = adm.reply(outbox)
    if adm.remote():            # (one request for them all: :class:`~sparsecomm.fabric.roles.SendEach`)
        yield SendEach.new((reply, adm.remote(), TAG_HDR_DOWN, Buf(Msg.REPLY), False))
    if adm.status != OK:
        yield from adm.drain(inbox)
    if host is not None:
        yield Hand(Key(Msg.REPLY, adm.index), reply)
    if adm.status != OK:
        return
    if host is not None:
        yield Recv((Key(Msg.GO, host),), _GO)
        strategies.sum_at_home(adm.channels, inbox.take(Key(Msg.GO, host)), host)
    for c in adm.channels:
        yield Spawn(agg_lane(adm, c, inbox, outbox, host, mark))


def agg_lane(adm, c: AggChannel, inbox, outbox, host: int | None, mark=None):
    """The aggregator's lanes of channel ``c``: per round, add each holder's blocks in ``c.order`` (their
    receives' order in ``c.window``, where each added message frees room for the next receive), complete,
    queue the next round's receives, send the sums with the prompt to every worker. Colocated, a round
    waits until the host has taken the previous one."""
    slot = c.slot
    gone = (Key(Msg.WORDS, adm.index, slot), Key(Msg.DOWN, adm.index, slot)) if host is not None else ()
    fabric = inbox.fabric
    charged = fabric.charges_host_work
    while c.active:
        r0 = c.round == 0
        kind = Msg.BLOCKS0 if r0 else Msg.UP
        keys = [Key.new((kind, w, slot)) for w in c.order]
        at = {k: i for i, k in enumerate(keys)}
        mine = Key(kind, host, slot) if host is not None else None
        mine = mine if mine in at else None     # (the host's message, if it holds a pending block)
        # (the next message and the later ones posted or handed over; round 0 up: sure; later: Recv.free)
        group = _group(keys, 0, at, c.window, inbox, mine) if keys else ()
        yield Recv(group, Stage(Phase.AGGREGATE, c.round, c.slot), gone=gone,
                   free=None if r0 else c.sums.buffer(c))
        c.begin(functools.partial(wire.message, outbox.pool))
        waited = set(group)
        for i, (w, key) in enumerate(zip(c.order, keys)):
            if key not in waited:   # (posted once the window had room, or handed over since)
                group = _group(keys, i, at, c.window, inbox, mine)
                waited = set(group)
                yield Recv(group, Stage(Phase.AGGREGATE, c.round, c.slot))
            msg = inbox.take(key)   # (the host may hand over (blocks, look-aheads) directly)
            if isinstance(msg, tuple):
                data, looks = msg
            else:               # (round 0 of a one-round channel, every block: unpadded, :func:`.wire.short_end`)
                k = int(c.counts[w])
                data, looks = wire.split(msg, k, c.bs, c.up, meta=not (r0 and c.single),
                                         short=c.short if r0 and k == c.ch.size and w != host else 0)
            moved = c.add(w, data, looks)
            if charged:
                fabric.host_work("index", moved)     # (blocks added at scattered rows)
                if data is not None:     # (each contribution's elements, the first one's copy counted as a sum)
                    fabric.host_work("sum", data.numel(), c.acc_dtype)
            if w != host:
                yield from c.window.done(key)
        out = c.finish()
        if c.active:   # the next round's holders (the prompt just computed): queue their receives
            counts = c.expect()
            c.order = [w for w in adm.order if counts[w]]
            tag, window, bs, size = tag_up(slot), c.window, c.bs, c.up.itemsize
            for w in c.order:
                if w != host:
                    window.want(Key.new((Msg.UP, w, slot)), wire.block_bytes(int(counts[w]), bs, size), w, tag)
            yield from c.window.feed()
        yield from send_down(adm, c, out, host)
        if mark is not None:
            mark(f"agg {adm.index}.{c.slot} r{c.round - 1}")


def _group(keys: list, i: int, at: dict, window: Window, inbox: Inbox, mine: Key | None) -> tuple:
    """What a lane round waits for before it adds ``keys[i]`` (``keys``: the round's messages in summing order,
    ``at``: their places): that one and every later one whose receive is posted or which is handed over
    (``inbox.has``), in order. The later ones posted are those of the channel's window (:meth:`.window.Window.posted`:
    its posted receives not yet consumed, every one a message of this round, posted in this order); the one
    handed over can only be the host's, ``mine``. A look at the window's few receives, not at every later
    key: a round of ``n`` holders through a window of a few messages is ``n`` such looks, not ``n^2``."""
    later = [k for k in window.posted() if at.get(k, -1) > i]
    if mine is not None and at[mine] > i and inbox.has(mine):
        bisect.insort(later, mine, key=at.__getitem__)
    return (keys[i], *later)


def send_down(adm, c: AggChannel, out, host: int | None):
    """A completed round to every worker, in :attr:`AggCall.order` (by hand to the host; to the others by one
    :class:`~sparsecomm.fabric.roles.SendEach` before it and one after it, :meth:`AggCall.around`): round 0's
    :class:`Reply0`, or a later round's message (double-buffered: :class:`.wire.Buf` by round parity)."""
    slot = c.slot
    tag = tag_down(slot)
    before, after = adm.around()
    if c.round == 1:
        # the words ride with the sums, or (every block summed) are implied
        tag, buf, sums = tag if out.fused else tag_sums0(slot), Buf(Msg.DOWN, slot=slot, parity=0), out.sums
        if (before or after) and not out.fused and c.short:     # (the sums alone, every block: unpadded,
            sums = sums[:wire.block_bytes(out.k, c.bs, c.down.itemsize, meta=False, short=c.short)]   # short_end)
        if before:
            yield SendEach.new((sums, before, tag, buf, False))
        if host is not None:    # by hand: words and sums apart (the sums None: already in its result)
            yield Hand(Key(Msg.WORDS, adm.index, slot), out.words)
            if out.k:
                yield Hand(Key(Msg.SUMS0, adm.index, slot), None if c.sums.in_place else out.sums)
        if after:
            yield SendEach.new((sums, after, tag, buf, False))
        return
    buf = Buf(Msg.DOWN, slot=slot, parity=(c.round - 1) % 2)
    if before:
        yield SendEach.new((out, before, tag, buf, False))
    if host is not None:
        yield Hand(Key(Msg.DOWN, adm.index, slot), out)
    if after:
        yield SendEach.new((out, after, tag, buf, False))
