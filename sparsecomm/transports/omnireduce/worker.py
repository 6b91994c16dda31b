"""An OmniReduce worker's call: its description (:class:`CallSpec`, the round-0 header), its state
(:class:`Call`), and :func:`run_worker`, which runs the worker's role (and, colocated, its hosted
aggregator's) on the endpoint's scheduler. The protocol itself is :mod:`.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fabric.base import Fabric
from . import core, header, wire
from .aggregator import AggCall, may_defer
from .mailbox import Hand, Inbox, Outbox, Pool, Send, drive
from .wire import HDR


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
        """The round-0 header, sealed (:func:`.header.seal`); ``k0[slot]``: this worker's position-0 blocks in
        that channel."""
        h = torch.zeros(HDR, dtype=torch.int64)
        for g, k in (k0 or {}).items():
            h[wire.F_K0 + g] = k
        vals = {wire.F_MAGIC: wire.MAGIC, wire.F_NUMEL: self.numel, wire.F_DTYPE: wire.dtype_code(self.up),
                wire.F_BLOCK: self.block_size, wire.F_AGGS: self.num_aggregators,
                wire.F_CHANNELS: self.channels, wire.F_LANES: self.lanes, wire.F_KIND: self.kind,
                wire.F_CHECK: self.check, wire.F_WORLD: world, wire.F_ABSMAX: self.absmax}
        for f, v in vals.items():
            h[f] = int(v)
        header.seal(h.numpy())
        return h


def agg_order(rank: int, num_aggregators: int) -> list[int]:
    """The order in which a worker visits the aggregators: ``rank-1, rank-2, ...`` (mod ``A``), the
    order in which their replies reach it (each aggregator serves the workers ``a+1, a+2, ...``)."""
    return [(rank - 1 - k) % num_aggregators for k in range(num_aggregators)]


class Call:
    """One worker's all-reduce: what the roles of :mod:`.core` and the strategies of :mod:`.strategies`
    share. ``aggregators[a]``: aggregator ``a``'s endpoint; ``own``: the aggregator this worker hosts
    (colocated), whose messages stay local; ``visit``: the aggregators in the order their replies reach
    this worker (the hosted one first); ``wch[a, slot]``: its lanes of each channel."""

    def __init__(self, fabric: Fabric, spec: CallSpec, source, make_sink, aggregators: list[int],
                 own: int | None, pool: Pool, home: bool) -> None:
        self.fabric, self.spec, self.source, self.make_sink = fabric, spec, source, make_sink
        self.n, self.rank = fabric.world_size, fabric.rank
        self.aggregators, self.own = aggregators, own
        self.plans = wire.plan(spec.numel, spec.block_size, spec.num_aggregators, spec.channels, spec.lanes)
        self.inbox, self.outbox = Inbox(fabric, pool), Outbox(fabric, pool)
        self.visit = ([own] if own is not None else []) + [a for a in agg_order(self.rank, spec.num_aggregators)
                                                           if a != own]
        self.pos = {a: i for i, a in enumerate(self.visit)}
        self.home = home and own is not None
        self.wch: dict = {}
        self.into_sink: set = set()     # (a, slot): round-0 sums received straight into the result
        self.result = self.sink = self.down = None
        self.sums0: dict = {}
        self.errors: dict = {}          # aggregator -> its verdict, where it is not OK (raised at the end)
        self.hdr0: dict = {}            # aggregator -> the round-0 header this worker built for it
        self.mark = getattr(fabric, "mark", lambda label: None)   # a traced call's phase marks (.trace)

    def round0_batches(self) -> list[list[int]]:
        """Colocated: one aggregator at a time, the hosted one (no message) last, so that the remote
        ones' transfers overlap the rest of the scan; dedicated: all at once."""
        if self.own is None:
            return [self.visit]
        return [[a] for a in self.visit[1:]] + [[self.own]]

    def up(self, a: int, key: wire.Key, buf: torch.Tensor, tag: int, data: bool = False):
        """A round-0 message to aggregator ``a``: by hand to the hosted one, else sent (``data``: received
        through ``a``'s window, :meth:`deferrable`)."""
        yield Hand(key, buf) if a == self.own else Send(buf, self.aggregators[a], tag,
                                                         deferrable=data and self.deferrable(a))

    def deferrable(self, a: int) -> bool:
        """May aggregator ``a`` post its receives of this worker's data late (:func:`.aggregator.may_defer`)?"""
        return may_defer(self.rank, a, self.n)


def run_worker(fabric: Fabric, spec: CallSpec, source, make_sink, aggregators: list[int],
               own: int | None, pool: Pool | None = None, home: bool = False) -> tuple[torch.Tensor, torch.dtype]:
    """One all-reduce on this worker; returns the result (from ``make_sink(down_dtype)``) and its dtype.

    ``pool`` keeps message buffers across calls. ``home``: the call is in place on a float32/float64
    :class:`.blocks.DenseSource` (``make_sink`` returns the source tensor itself); the hosted aggregator
    then sums its one-round channels straight into that tensor (:class:`.strategies.HomeSums`).
    Colocated, the sends are reaped lazily (all but 64 in flight); with dedicated aggregators, all of
    them before each wait (they would only queue behind each other)."""
    call = Call(fabric, spec, source, make_sink, aggregators, own, Pool() if pool is None else pool, home)
    call.mark("start")
    roles = [core.worker(call)]
    if own is not None:
        adm = AggCall(own, call.n, colocated=call.rank)
        roles.insert(0, core.aggregator(adm, call.inbox, call.outbox, host=call.rank,
                                        ref=spec.header(call.n).numpy(), mark=call.mark))
    drive(fabric, call.inbox, call.outbox, roles, keep=64 if own is not None else 0)
    call.mark("steps done")
    # every send completes (an aggregator that rejected the call consumes its round 0 by the manifest), and
    # none may be dropped before: gloo would lose a send whose buffer is freed before the peer's receive
    call.outbox.finish()
    if call.errors:   # (every worker has every verdict: the lowest aggregator's error, on every worker)
        header.raise_for_reply(call.errors[min(call.errors)], spec.header(call.n).numpy(), call.rank)
    call.mark("sends done")
    return call.result, call.down
