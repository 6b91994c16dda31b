"""A dedicated OmniReduce aggregator's endpoint loop: per call, the :func:`.aggregator.aggregator` role (and
the lane roles it starts) run by the fabric (:mod:`sparsecomm.fabric.roles`). On a fabric with modelled time
(the SimFabric) a process of the simulated world's loop (:func:`serve_process`), so that where a call's
drive begins is ordered by modelled time alone; elsewhere (an extra torch.distributed rank) a blocking loop
(:func:`serve`)."""

from __future__ import annotations

from typing import Generator

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


def serve_process(fabric: Fabric, index: int) -> Generator:
    """:func:`serve` as a process of the fabric's loop (``Fabric.drive_process``; a fabric with modelled
    time): the next call's drive begins in the same step of the loop as the last one ends. ``finish`` there
    waits for no thread: a send of a modelled fabric is complete, its wait moves the endpoint's clock to
    the end of its transmission, as between two calls of :func:`serve`."""
    n = fabric.world_size
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    while True:
        yield from fabric.drive_process([aggregator(AggCall(index, n), inbox, outbox)], inbox, outbox)
        outbox.finish()
