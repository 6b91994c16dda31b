"""A dedicated OmniReduce aggregator's endpoint loop (a SimFabric service thread or an extra
torch.distributed rank): per call, the :func:`.aggregator.aggregator` role (and the lane roles it
starts) run by ``Fabric.drive`` (:mod:`sparsecomm.fabric.roles`)."""

from __future__ import annotations

from ...fabric.base import Fabric
from .aggregator import AggCall, aggregator
from ...fabric.roles import Inbox, Outbox, Pool


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
        fabric.drive([aggregator(AggCall(index, n), inbox, outbox)], inbox, outbox)
        outbox.finish()
