"""An OmniReduce worker's call in the fast driver: its state (:class:`Call`), its roles (:func:`worker`,
one :func:`verdict` per aggregator, which goes on as the lanes of the aggregator's last channel, or lands the
round-0 replies of its one-round channels together, :func:`land_singles`, and one :func:`worker_lane` per
other channel) and :func:`run_worker`, which
runs them (and, colocated, the hosted aggregator's roles, :mod:`.aggregator`) on the endpoint's
scheduler (``Fabric.drive``, :mod:`sparsecomm.fabric.roles`). The lanes' state machine is
:class:`.core.WorkerChannel`; the fast paths the roles call are :mod:`.strategies`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...errors import MalformedMessage
from ...fabric.base import Fabric
from .._handshake import fail_stop
from . import core, header, strategies, wire
from .aggregator import AggCall, aggregator, may_defer
from .blocks import DenseSource
from .header import CallSpec
from .stages import Phase, Stage
from ...fabric.roles import Hand, Inbox, Outbox, Poll, Pool, Post, PostInto, Recv, Send, Spawn
from .wire import HDR, OK, TAG_FIRSTS, TAG_HDR_DOWN, TAG_HDR_UP, TAG_MANIFEST, Buf, Key, Msg, tag_down


#: pieces a colocated worker's scan of an aggregator's range is cut into, a ``Poll`` between them
#: (:func:`scan`) running the roles of the phases before ``POLL_SCAN`` (headers, verdicts, hosted rounds;
#: not the lanes landing sums); a piece has at least ``SCAN_MIN_BLOCKS`` blocks (a shorter scan is not
#: long local work: cut finer, its pieces' and polls' fixed costs would exceed it, n^2 of them per call),
#: on real processes ``SCAN_MIN_BLOCKS_REAL`` (a fabric whose time is not modelled: there a piece's and a
#: poll's fixed costs are tens of microseconds of Python, a 1024-block piece's scan about as long)
SCAN_PIECES, SCAN_MIN_BLOCKS, SCAN_MIN_BLOCKS_REAL, POLL_SCAN = 8, 1024, 8192, Phase.LAND
_POLL_SCAN = Poll(POLL_SCAN)    # (the request: one value, yielded twice per aggregator)
#: the flags (``sure``, ``reaps``) of every verdict's and every lane's wait (they do not depend on the round),
#: for the stages built per message by :attr:`.stages.Stage.new`
_VERDICT_FLAGS, _LAND_FLAGS = Stage(Phase.VERDICT)[4:], Stage(Phase.LAND)[4:]


def _no_mark(label: str) -> None:
    """An untraced call's phase mark: nothing."""


def agg_order(rank: int, num_aggregators: int) -> list[int]:
    """The order in which a worker visits the aggregators: ``rank-1, rank-2, ...`` (mod ``A``), the
    order in which their replies reach it (each aggregator serves the workers ``a+1, a+2, ...``)."""
    return [(rank - 1 - k) % num_aggregators for k in range(num_aggregators)]


class Call:
    """One worker's all-reduce: what its roles and the strategies of :mod:`.strategies` share.
    ``aggregators[a]``: aggregator ``a``'s endpoint; ``own``: the aggregator this worker hosts
    (colocated), whose messages stay local; ``visit``: the aggregators in the order their replies reach
    this worker (the hosted one first); ``wch[a, slot]``: its lanes of each channel."""

    def __init__(self, fabric: Fabric, spec: CallSpec, source, make_sink, aggregators: list[int],
                 own: int | None, pool: Pool, home: bool) -> None:
        self.fabric, self.spec, self.source, self.make_sink = fabric, spec, source, make_sink
        self.n, self.rank = fabric.world_size, fabric.rank
        self.aggregators, self.own = aggregators, own
        self.plans = wire.plan(spec.numel, spec.block_size, spec.num_aggregators, spec.channels, spec.lanes)
        self.inbox, self.outbox = Inbox(fabric, pool), Outbox(fabric, pool)
        # the verdicts' receives: aggregator ``a``'s into row ``a`` of one buffer (its role has no peer: one buffer kept
        # across calls, not one per aggregator)
        self.replies = pool.get(("in", Buf(Msg.REPLY)), 8 * HDR * spec.num_aggregators)
        self.replies_np = self.replies.numpy().view(np.int64)     # (the same rows as numpy: a verdict's words read)
        self.visit = ([own] if own is not None else []) + [a for a in agg_order(self.rank, spec.num_aggregators)
                                                           if a != own]
        self.pos = {a: i for i, a in enumerate(self.visit)}
        self.home = home and own is not None
        self.wch: dict = {}
        self.into_sink: set = set()     # (a, slot): round-0 sums received straight into the result
        self.result = self.sink = self.down = self.down_code = None
        self.sums0: dict = {}
        self.errors: dict = {}          # aggregator -> its verdict, where it is not OK (raised at the end)
        self.hdr0: dict = {}            # aggregator -> the round-0 header this worker built for it
        # the round-0 headers built, by their position-0 counts ``((slot, blocks), ...)``: ``(words, message)``,
        # one per distinct counts (most aggregators of a sparse call get the same); nothing writes either
        self.hdr_msgs: dict = {}
        self.hdr_base = spec.header(self.n).numpy()     # the header with no position-0 block (sealed)
        #: ``defer[a]``: may aggregator ``a`` post its receives of this worker's data late (:meth:`deferrable`)
        self.defer = [may_defer(self.rank, a, self.n) for a in range(spec.num_aggregators)]
        self.mask_np = None             # the source's block mask as numpy (a view, made by the first :func:`scan`)
        # colocated on a real fabric, a remote aggregator's position-0 blocks of at least ``message_bytes`` wait
        # until the hosted aggregator has posted the receives of that aggregator's host (:func:`release_up`);
        # ``held``: the aggregators whose blocks wait for that, ``opened``: the hosts whose receives were posted
        # first. None: not held
        self.held: set | None = set() if own is not None and not fabric.modelled_time else None
        self.opened: set = set()
        # the round-0 replies of an aggregator's one-round channels landed together, in one wait
        # (:func:`land_singles`): where that is the same in every respect, a fabric of modelled time that charges no
        # host work (the moment a reply's sums land is then no part of the model); elsewhere a lane per channel, each
        # landing its sums as they come
        self.fold = fabric.modelled_time and not fabric.charges_host_work
        mark = getattr(fabric, "mark", None)   # a traced call's phase marks (.trace)
        self.traced = mark is not None          # (a mark per message is formatted only then)
        self.mark = mark if mark is not None else _no_mark

    def round0_batches(self) -> list[list[int]]:
        """Colocated: one aggregator at a time, the hosted one (no message) last, so that the remote
        ones' transfers overlap the rest of the scan; dedicated: all at once."""
        if self.own is None:
            return [self.visit]
        return [[a] for a in self.visit[1:]] + [[self.own]]

    def up(self, a: int, key: wire.Key, buf: torch.Tensor, tag: int, data: bool = False):
        """The request of a round-0 message to aggregator ``a``: by hand to the hosted one, else sent
        (``data``: received through ``a``'s window, :meth:`deferrable`), ``stable`` (:meth:`.base.Fabric.isend`):
        a header of :attr:`hdr_msgs` or a look-ahead message, made for this call (or shared and read-only,
        :func:`.wire.no_firsts`) and never written."""
        return Hand(key, buf) if a == self.own else Send.new((buf, self.aggregators[a], tag, None,
                                                              data and self.defer[a], True))

    def deferrable(self, a: int) -> bool:
        """May aggregator ``a`` post its receives of this worker's data late (:func:`.aggregator.may_defer`)?
        (:attr:`defer`'s entry: a hot path reads it there.)"""
        return self.defer[a]


# ------------------------------------------------------------------ the roles
def worker(call):
    """One worker's call (``call``: :class:`Call`). Round 0 up, before any wait: per aggregator
    the header, first look-aheads, position-0 blocks (colocated: each remote one's once its range is
    scanned, the hosted one last). Each verdict has its own role (:func:`verdict`): none waits for another."""
    for batch in call.round0_batches():
        for a in batch:
            yield from scan(call, a)
        yield from send_round0(call, batch)
        for a in batch:
            yield Spawn.new((verdict(call, a),))
        yield _POLL_SCAN
    call.mark("round 0 sent")


def verdict(call, a: int):
    """Aggregator ``a``'s verdict. OK (the downstream dtype, each channel's count of round-0 sums): make
    the result (first OK verdict), settle ``a``'s range in it (in place: its blocks under the threshold
    zeroed, :meth:`.blocks.DenseSource.settle`; ``a``'s range is scanned, its header went after the scan), post
    ``a``'s round-0 receives (hosted: ``GO``), start the lanes of ``a``'s channels but the last
    (:func:`worker_lane`), then go on as the last one's (the same requests as a role of its own: one
    generator fewer per aggregator).
    Two or more one-round channels (``lanes`` at least their blocks, the default) on a fabric where it changes
    nothing but the wakes (:attr:`Call.fold`): their round-0 replies are taken by this role in one wait
    (:func:`land_singles`), lanes spawned only for the others.
    Not OK: a remote ``a`` gets this worker's manifest (:meth:`.aggregator.AggCall.drain`), then sends
    nothing more; the error is raised once the others' lanes are done (:func:`run_worker`)."""
    key = Key.new((Msg.REPLY, a, -1))
    yield Recv.new(((key,), Stage.new((Phase.VERDICT, 0, 0, call.pos[a]) + _VERDICT_FLAGS), (), False, None))
    msg = call.inbox.take(key)  # (a remote one's: received into its row of the replies)
    rv = (msg.view(torch.int64) if a == call.own else call.replies_np[a * HDR:(a + 1) * HDR]).tolist()   # (read once)
    if rv[wire.R_STATUS] != OK:
        call.errors[a] = np.asarray(rv, dtype=np.int64)
        if a != call.own:
            yield Send(header.manifest(call.hdr0[a], a).view(torch.uint8), call.aggregators[a], TAG_MANIFEST)
        return
    try:
        code = rv[wire.R_DOWN_DTYPE]
        down = call.down if code == call.down_code else wire.code_dtype(code)   # (the first verdict's, known)
        if call.down is not None and down != call.down:
            raise MalformedMessage(f"omnireduce: aggregator {a} announces sums of {down}, another one "
                                   f"{call.down} (this is worker {call.rank})")
        for ch in call.plans[a]:
            k = rv[wire.R_K + ch.slot]
            if not 0 <= k <= ch.lanes:
                raise MalformedMessage(f"omnireduce: aggregator {a} announces {k} round-0 sums in a "
                                       f"channel of {ch.lanes} lanes (this is worker {call.rank})")
            call.sums0[a, ch.slot] = k
    except MalformedMessage as exc:
        raise fail_stop(call.fabric, exc) from None
    del rv                      # (read: this role lives on as the lanes, n of them per worker, without the words)
    if call.sink is None:
        call.down, call.down_code = down, code
        call.result, call.sink = call.make_sink(down)
    chans = call.plans[a]
    if chans:                   # a's range is scanned and holds no sum yet: its blocks that count as zero
        call.source.settle(chans[0].lo, chans[-1].lo + chans[-1].size, call.result)
    if a == call.own:           # the hosted aggregator's lanes may start
        yield Hand(Key(Msg.GO, call.rank), strategies.home_rows(call))
    else:                       # the round-0 replies' receives
        for ch in chans:
            post = strategies.post_reply0(call, a, ch, call.sums0[a, ch.slot])
            if post is not None:
                yield post
    if call.traced:
        call.mark(f"downstream posted {a}")
    singles = chans.singles if call.fold else ()
    if singles[1:]:             # one-round channels: their round-0 replies taken by this role, in one wait
        for ch in chans:
            if not ch.single:
                yield Spawn.new((worker_lane(call, a, call.wch[a, ch.slot]),))
        yield from land_singles(call, a, singles)
        return
    for ch in chans[:-1]:
        yield Spawn.new((worker_lane(call, a, call.wch[a, ch.slot]),))
    if chans:                   # the last channel's lanes: this role's own (a role fewer per aggregator)
        yield from worker_lane(call, a, call.wch[a, chans[-1].slot])


def land_singles(call, a: int, singles: list):
    """The round-0 replies of aggregator ``a``'s one-round channels ``singles`` (two or more), waited for
    together and landed in their order: what a :func:`worker_lane` per channel does (each takes its reply and
    is done), with one wait and one wake for them all instead of one each. A one-round lane sends nothing and
    lands its sums in blocks of its own, so on a fabric of modelled time that charges no host work
    (:attr:`Call.fold`) taking the replies together changes no message, no sum and no modelled time: a take
    moves the clock to the message's delivery, which every later event of the endpoint passes anyway, and the
    order of pure takes among the roles able to run moves no other role's send. (Under a host model the landing
    work would be charged when the last reply is in, and on a real fabric the first channel's sums would land
    later: there each channel keeps its lane.) Every reply comes whatever this worker does (each channel's
    round 0 needs only round-0 data): the wait ends (``docs/omnireduce-scheduler.md``). Its stage is the first
    channel's lane's."""
    keys = ()
    for ch in singles:
        keys += strategies.reply0_keys(call, a, ch)
    first = singles[0]
    yield Recv.new((keys, Stage.new((Phase.LAND, 0, first.slot, call.pos[a]) + _LAND_FLAGS), (), False, None))
    for ch in singles:          # (one-round: strategies.take_reply0's, which returns no next blocks)
        strategies.take_reply0_single(call, a, ch)
        call.wch[a, ch.slot].start(None)
        if call.traced:
            call.mark(f"reply {a}.{ch.slot} r0")


def scan(call, a: int):
    """Find this worker's non-zero blocks in aggregator ``a``'s range (colocated: in pieces, with a
    ``Poll`` after each); set up its channels. A source scanned whole already (not :attr:`~.blocks._Blocks.lazy`:
    on a fabric of modelled time, where the overlap of a real scan buys nothing) is not scanned again; the
    pieces, their ``Poll`` and the work declared (where it is charged) are the same."""
    chans = call.plans[a]
    if chans:
        lo, hi = chans[0].lo, chans[-1].lo + chans[-1].size
        fabric, source = call.fabric, call.source
        # (finer while blocks are held, :func:`release_up`: a poll takes the peer's header and releases them)
        least = SCAN_MIN_BLOCKS if fabric.modelled_time or call.held else SCAN_MIN_BLOCKS_REAL
        step = hi - lo if call.own is None else max(least, -(-(hi - lo) // SCAN_PIECES))
        lazy, charged = source.lazy, fabric.charges_host_work
        for s in range(lo, hi, step):
            e = hi if hi < s + step else s + step
            if lazy:
                source.scan(s, e)
            if charged:
                bs = source.block_size      # the elements scanned: blocks [s, e)
                fabric.host_work("scan", min(e * bs, source.numel) - s * bs)
                if fabric.modelled_time and isinstance(source, DenseSource):   # (read to their end: sim_host)
                    fabric.host_work("scan_zero", _zero_elements(source, s, e))
            if call.own is not None:
                yield _POLL_SCAN
        if charged:
            fabric.host_work("span", hi - lo)     # the range's per-block work beyond the scan (sim_host)
    mask = call.mask_np
    if mask is None:                # (the mask's numpy view, made once per call: filled in place by the scans)
        mask = call.mask_np = call.source.mask.numpy() if call.source.mask.device.type == "cpu" else call.source.mask
    for ch in chans:
        call.wch[a, ch.slot] = core.WorkerChannel(ch, mask)
    if call.traced:
        call.mark(f"scanned {a}")


def _zero_elements(source: DenseSource, lo: int, hi: int) -> int:
    """The elements of the zero blocks among ``[lo, hi)`` of a scanned ``source`` (the host model's
    ``"scan_zero"``: the scan reads a zero block to its end, a non-zero one only to its first non-zero value)."""
    mask = source.mask.numpy()      # (numpy's slice and count: no tensor made per range)
    elements = (hi - lo - int(np.count_nonzero(mask[lo:hi]))) * source.block_size     # (the zero blocks': full ones)
    if source.tail and lo < source.nb <= hi and not bool(mask[source.nb - 1]):
        elements -= source.block_size - source.tail       # (the short last block, zero)
    return elements


def send_round0(call, aggs: list[int]):
    """Round 0 to ``aggs``: a header each; then to each its channels' first look-aheads (small, one
    message), then the position-0 blocks (slot-major; per slot the heaviest aggregators first)."""
    p0, counts = {}, {}         # (a, slot) -> its position-0 blocks (once each); a -> ((slot, blocks), ...)
    some = {}                   # the aggregators of ``aggs`` to which this worker sends some position-0 block
    wch = call.wch
    for a in aggs:              # (loops, not comprehensions: no call per aggregator)
        k0 = []
        for ch in call.plans[a]:
            k = p0[a, ch.slot] = wch[a, ch.slot].pending0()
            k0.append((ch.slot, k))
            if k:
                some[a] = True
        counts[a] = tuple(k0)
    hdr_key, firsts_key = Key.new((Msg.HDR, call.rank, -1)), Key.new((Msg.FIRSTS, call.rank, -1))
    hdrs = call.hdr_msgs
    for a in aggs:
        k0 = counts[a]
        if k0 not in hdrs:  # (the same counts as to an aggregator before: the same header, one message for both)
            h = header.with_k0(call.hdr_base, k0)
            hdrs[k0] = h, torch.from_numpy(h.view(np.uint8))
        h, msg = hdrs[k0]
        call.hdr0[a] = h
        yield call.up(a, hdr_key, msg, TAG_HDR_UP)
        if a != call.own:
            yield PostInto.new((Key.new((Msg.REPLY, a, -1)), call.replies[a * 8 * HDR:(a + 1) * 8 * HDR],
                                call.aggregators[a], TAG_HDR_DOWN))
    for a in aggs:
        chans = call.plans[a]
        if not chans:
            continue
        if chans.bitmap and call.mask_np.__class__ is np.ndarray:   # (one pack of the range's mask)
            # (a bitmap's one-round lanes: position 0 pending exactly where a block is held; none held in the
            # range, its bitmap is zeros, one shared tensor of that size: no pack)
            firsts = (wire.firsts_of_range(call.mask_np, chans) if a in some else
                      wire.no_firsts(-(-(chans[-1].lo + chans[-1].size - chans[0].lo) // 8)))
        else:
            firsts = wire.encode_all_firsts([call.wch[a, ch.slot].mine for ch in chans], chans)
        yield call.up(a, firsts_key, firsts, TAG_FIRSTS, data=True)
    held = call.held
    if held is not None:        # (colocated: one remote aggregator per batch, or the hosted one)
        least = call.fabric.message_bytes or 0
        per_block = call.spec.block_size * call.spec.up.itemsize
        for a in aggs:
            if (a != call.own and a not in call.opened
                    and sum(p0.get((a, ch.slot), 0) for ch in call.plans[a]) * per_block >= least):
                held.add(a)
        aggs = [a for a in aggs if a not in held]
    yield from blocks0(call, aggs, p0)


def blocks0(call, aggs: list[int], p0: dict | None = None):
    """The position-0 blocks to ``aggs`` (slot-major; per slot the heaviest aggregators first, by ``p0``)."""
    wch = call.wch
    for g in range(call.spec.channels):
        for a in aggs if not aggs[1:] else sorted(aggs, key=lambda a: -p0.get((a, g), 0)):
            if (a, g) in wch:
                if p0 is not None and (a, g) in p0 and not p0[a, g]:   # (none to send: the prompt answered, empty)
                    wch[a, g].take_up()
                    continue
                yield from strategies.send_up(call, Buf.new((Msg.BLOCKS0, a, g, 0)), a, wch[a, g],
                                              Key.new((Msg.BLOCKS0, call.rank, g)))


def release_up(call, w: int):
    """Colocated on a real fabric: the hosted aggregator has queued the receives of worker ``w``'s round-0
    messages, posting those that fit (:meth:`.aggregator.AggCall.take_early`; or it has taken every remote header),
    so this worker's position-0 blocks to aggregator ``w`` (which ``w`` hosts) may go: now if the header and first
    look-aheads to it went already (:func:`send_round0` held the blocks), else as soon as they go. A second
    call for ``w`` makes no request.

    Held only where the blocks to ``w`` hold at least ``fabric.message_bytes`` (1 MiB on gloo, 8 ms at 1 Gbit/s):
    a notice queued behind fewer bytes waits less than the release may (the hosted aggregator takes ``w``'s
    header only at this worker's next poll or wait, after the scan of the next range; the sparse 10 MB call
    on 2 netbed hosts).

    Why: gloo sends a message only once the receiver's "receive posted" notice has arrived, and that notice
    travels on the link that carries this worker's blocks to ``w`` (the two-way channels of the TorchFabric keep
    them on different connections, not on different links). Sent first, the blocks fill the link's queues (the
    socket's and the shaper's) as soon as ``w`` posts their receive, and the notices for ``w``'s first
    look-aheads and blocks wait behind them (2-3 ms at 1 Gbit/s in the netbed's timelines of the dense MLP),
    while nothing moves from ``w`` to this worker. The blocks cannot move before ``w`` has taken this worker's
    header anyway, which it does about when this worker takes ``w``'s: holding them until this worker's receives
    are posted costs the wire nothing.

    Every wait still ends (``docs/omnireduce-scheduler.md``): the header that releases the blocks is sent
    before its sender's first wait, and the hosted aggregator takes the headers before any wait of this endpoint
    that blocks (its first look-aheads and round-0 blocks are its only sure waits; a worker's roles have none),
    while the scheduler can only wait on them (R1-R3)."""
    call.opened.add(w)
    if w in call.held:
        call.held.discard(w)
        yield from blocks0(call, [w])


def worker_lane(call, a: int, c: core.WorkerChannel):
    """A worker's lanes of aggregator ``a``'s channel ``c``: take each round's reply (the completed sums
    and the prompt), answer the prompt, until every lane is done."""
    g, pos, bs = c.ch.slot, call.pos[a], call.spec.block_size
    # round 0's reply: words and sums in one message, or waited for together (never a blocking take of
    # large sums)
    yield Recv.new((strategies.reply0_keys(call, a, c.ch), Stage.new((Phase.LAND, c.round, g, pos) + _LAND_FLAGS), (),
                    False, None))
    c.start(strategies.take_reply0(call, a, c.ch))
    if not c.active:            # (every lane done in round 0, a one-round channel's: no key of a later round made)
        if call.traced:
            call.mark(f"reply {a}.{g} r{c.round}")
        return
    up_bufs = (Buf.new((Msg.UP, a, g, 0)), Buf.new((Msg.UP, a, g, 1)))     # (by round parity)
    up_key, down_key = Key.new((Msg.UP, call.rank, g)), Key.new((Msg.DOWN, a, g))
    down_keys = (down_key,)
    while True:
        active = c.active
        if active:     # answer the prompt; post the receive of the reply
            yield from strategies.send_up(call, up_bufs[c.round % 2], a, c, up_key)
            if a != call.own:
                yield Post.new((down_key, wire.block_bytes(c.act.size, bs, call.down.itemsize),
                                call.aggregators[a], tag_down(g)))
        if call.traced:
            call.mark(f"reply {a}.{g} r{c.round}")
        if not active:
            return
        yield Recv.new((down_keys, Stage.new((Phase.LAND, c.round, g, pos) + _LAND_FLAGS), (), False, None))
        nbytes = c.act.size * bs * call.down.itemsize     # (the sums' bytes written into the result: sim_host)
        call.fabric.host_work("index", c.down(call.inbox.take(down_key), call.sink, bs, call.down))
        call.fabric.host_work("move", nbytes)


def run_worker(fabric: Fabric, spec: CallSpec, source, make_sink, aggregators: list[int],
               own: int | None, pool: Pool | None = None, home: bool = False,
               first=None) -> tuple[torch.Tensor, torch.dtype]:
    """One all-reduce on this worker; returns the result (from ``make_sink(down_dtype)``) and its dtype.

    ``first``: ``first(inbox)`` is a role run to its end in the same drive before the call's roles start
    (the agreement handshake, :func:`.._handshake.agreement_role`). ``pool`` keeps message buffers across calls. ``home``: the call is in place on a float32/float64
    :class:`.blocks.DenseSource` (``make_sink`` returns the source tensor itself); the hosted aggregator
    then sums its one-round channels straight into that tensor (:class:`.strategies.HomeSums`).
    Colocated, the sends are reaped lazily (all but 64 in flight); with dedicated aggregators, all of
    them before each wait (they would only queue behind each other)."""
    call = Call(fabric, spec, source, make_sink, aggregators, own, Pool() if pool is None else pool, home)
    call.mark("start")
    roles = [worker(call)]
    if own is not None:
        adm = AggCall(own, call.n, colocated=call.rank)
        roles.insert(0, aggregator(adm, call.inbox, call.outbox, host=call.rank,
                                        ref=call.hdr_base, mark=call.mark if call.traced else None,
                                        taken=None if call.held is None else functools.partial(release_up, call)))
    if first is not None:
        roles = [_after(first(call.inbox), roles)]
    fabric.drive(roles, call.inbox, call.outbox, keep=64 if own is not None else 0)
    call.mark("steps done")
    # every send completes (an aggregator that rejected the call consumes its round 0 by the manifest), and
    # none may be dropped before: gloo would lose a send whose buffer is freed before the peer's receive
    call.outbox.finish()
    if call.errors:   # (every worker has every verdict: the lowest aggregator's error, on every worker)
        header.raise_for_reply(call.errors[min(call.errors)], spec.header(call.n).numpy(), call.rank)
    call.mark("sends done")
    return call.result, call.down


def _after(first, roles: list):
    """A role that runs ``first`` to its end, then starts ``roles`` in their order (as a drive starts them)."""
    yield from first
    for role in roles:
        yield Spawn(role)
