"""A dedicated OmniReduce aggregator's endpoint loop (a SimFabric service thread or an extra
torch.distributed rank): per call, the :func:`.aggregator.aggregator` role (and the lane roles it
starts) on :func:`.mailbox.drive`."""

from __future__ import annotations

from ...fabric.base import Fabric
from .aggregator import AggCall, aggregator
from .mailbox import Inbox, Outbox, Pool, drive


def serve(fabric: Fabric, index: int) -> None:
    """Dedicated aggregator ``index``: serve calls until the run ends (ServiceShutdown ends the loop).

    Event-driven: the channel served next is the first, in (round, slot) order, whose round's messages
    are all in by the time the first such round is, so a channel whose holders are late does not hold
    back the replies of the others.
    """
    n = fabric.world_size
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    while True:
        drive(fabric, inbox, outbox, [aggregator(AggCall(index, n), inbox, outbox)])
        outbox.finish()
