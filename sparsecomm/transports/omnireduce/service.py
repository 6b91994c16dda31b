"""A dedicated OmniReduce aggregator's endpoint loop (a SimFabric service thread or an extra
torch.distributed rank): one :class:`.aggregator.AggCall` per call, its rounds on :func:`.mailbox.drive`."""

from __future__ import annotations

import functools

from ...fabric.base import Fabric
from . import wire
from .aggregator import AggCall
from .mailbox import Inbox, Outbox, Pool, Step, drive
from .wire import OK, Buf, Msg


def serve(fabric: Fabric, index: int) -> None:
    """Dedicated aggregator ``index``: serve calls until the run ends (ServiceShutdown ends the loop).

    Event-driven (:func:`.mailbox.drive`): the channel served next is the first, in (round, slot) order,
    whose round's messages are all in by the time the first such round is, so a channel
    whose holders are late does not hold back the replies of the others. Deadlock-free as the fixed
    order was: a channel's round only waits for messages its holders send on receipt of the previous
    round's reply, which has been sent.
    """
    n = fabric.world_size
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    while True:
        call = AggCall(index, n)
        call.post_headers(inbox)
        call.take_headers(inbox)
        if call.status == OK:
            call.prepare(inbox)
        reply = call.reply(outbox)
        for w in call.order:
            outbox.send(reply, w, wire.TAG_HDR_DOWN, key=Buf(Msg.REPLY))
        if call.status != OK:
            call.drain(inbox)
        else:
            drive(fabric, inbox, outbox, lambda: [
                Step(c.round_keys(), functools.partial(call.step, c, inbox, outbox))
                for c in sorted(call.schedule(), key=lambda c: (c.round, c.slot))])
        outbox.reap(0)
