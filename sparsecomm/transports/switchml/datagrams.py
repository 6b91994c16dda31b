"""The switches' requests beyond :mod:`sparsecomm.fabric.roles`: an unreliable send and a receive with a
deadline, and the driver that runs roles yielding them on today's fabrics.

SwitchML's packets are datagrams (every packet, both directions, may be lost: Sapio et al., NSDI'21,
Sec. 4) and its workers notice a loss by a retransmission timer. A role (:mod:`sparsecomm.fabric.roles`)
says so with two requests:

- :class:`Datagram`: a :class:`~sparsecomm.fabric.roles.Send` with ``reliable=False`` (the network model may
  drop it). Held under ``hold`` as a ``Send`` is (a :class:`~sparsecomm.fabric.roles.Flush` waits for it;
  on SimFabric a flush right after it is a blocking send: the sender's clock advances to the end of its
  transmission, the worker NIC's serialisation). ``hold=None``: nothing of the sender ever waits for it (a
  switch's port, which replies and goes on: its transmission holds back nothing else of the switch).
  ``hold=SENT``: a blocking send, waited for at once (on SimFabric the sender's clock advances to the end of
  its transmission, as a ``Flush`` right after it would move it, with no buffer held or send recorded between).
- :class:`Multicast`: a :class:`Datagram` with ``hold=None`` to each of several endpoints, one request (a
  switch's multicast of a result to every worker of the job: Sapio et al., NSDI'21); on a fabric with
  modelled time one pass (the fabric's ``isend_each``; elsewhere an ``isend`` per destination).
- :class:`RecvBy`: a :class:`~sparsecomm.fabric.roles.Recv` of one message with a deadline: the role is
  resumed once the message is in, or once ``timeout`` seconds (modelled seconds on SimFabric, wall seconds
  elsewhere) have passed, whichever comes first. It then asks ``inbox.ready(key)``: if the message is in,
  it takes it; if not, the deadline passed, and the receive stays posted as it was (the next message on
  its channel still goes to it, so a later wait on the same key takes it). On SimFabric the endpoint's
  clock then stands at the deadline. ``timeout=None`` is a plain ``Recv``.

:func:`drive` runs roles yielding these on any fabric, through :meth:`.Fabric.drive`: each role is wrapped
by an adapter that sends a :class:`Datagram` and a :class:`Multicast` itself and lowers a :class:`RecvBy` with a
deadline to the scheduler's :class:`~sparsecomm.fabric.roles.AwaitWithin` (which blocks the endpoint: the
switches' roles are one role per endpoint, so nothing else could run meanwhile), handing every other request on.
"""

from __future__ import annotations

from typing import Generator, NamedTuple

import torch

from ...fabric.roles import AwaitWithin, Inbox, Outbox, Recv, Spawn, Stage

__all__ = ["Datagram", "Multicast", "RecvBy", "SENT", "drive"]

#: :attr:`Datagram.hold` of a blocking send: waited for as it is made (nothing held, nothing recorded)
SENT = object()


class Datagram(NamedTuple):
    """Send ``buf`` to endpoint ``dst`` on ``tag`` as an unreliable datagram (``reliable=False``), held
    under ``hold`` as :attr:`.roles.Send.hold`; ``hold=None``: never waited for by the sender; ``hold=SENT``:
    waited for at once, a blocking send (module docstring)."""

    buf: torch.Tensor
    dst: int
    tag: int
    hold: object = None


class Multicast(NamedTuple):
    """Send ``buf`` to each endpoint of ``dsts``, in order, on ``tag``: a :class:`Datagram` with ``hold=None``
    per destination (a switch's multicast: its ports transmit in parallel and nothing waits for them), as one
    request rather than one per destination, sent by the fabric's ``isend_each`` (on a fabric with modelled time
    one pass)."""

    buf: torch.Tensor
    dsts: range
    tag: int


class RecvBy(NamedTuple):
    """Suspend the role until message ``key`` is in or ``timeout`` seconds have passed (module docstring);
    ``stage`` as :attr:`.roles.Recv.stage`."""

    key: object
    stage: Stage
    timeout: float | None = None


def drive(fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64) -> None:
    """Run ``roles`` (yielding the requests of :mod:`sparsecomm.fabric.roles` and of this module) on
    ``fabric`` with ``inbox`` and ``outbox`` until every one has returned (:meth:`.Fabric.drive`)."""
    fabric.drive([_adapt(fabric, inbox, outbox, r) for r in roles], inbox, outbox, keep=keep)


def drive_process(fabric, inbox: Inbox, outbox: Outbox, roles: list, keep: int = 64) -> Generator:
    """:func:`drive` as a process of the fabric's own loop (``Fabric.drive_process``; a fabric with modelled
    time), for a service whose main is a generator function."""
    yield from fabric.drive_process([_adapt(fabric, inbox, outbox, r) for r in roles], inbox, outbox, keep)


def _adapt(fabric, inbox: Inbox, outbox: Outbox, role):
    """``role`` with :class:`Datagram` and :class:`RecvBy` performed here, every other request yielded on."""
    while True:
        try:
            req = next(role)
        except StopIteration:
            return
        t = type(req)
        if t is Datagram:
            _send(fabric, outbox, req)
        elif t is Multicast:
            if fabric.modelled_time:        # (_send's case of a datagram nothing waits for: not recorded)
                fabric.isend_each(req.buf, req.dsts, req.tag, [], reliable=False)
            else:                           # (recorded as _send records each, those started before an error too)
                outbox.send_each(req.buf, req.dsts, req.tag, reliable=False)
        elif t is RecvBy:
            if req.timeout is None:
                yield Recv((req.key,), req.stage)
            else:
                yield AwaitWithin(req.key, req.timeout)
        elif t is Spawn:
            yield Spawn(_adapt(fabric, inbox, outbox, req.role))
        else:
            yield req


def _send(fabric, outbox: Outbox, req: Datagram) -> None:
    """:class:`Datagram`: an unreliable ``isend``, recorded as :meth:`.roles.Outbox.send` records a send
    (a send nothing waits for is not recorded on a modelled fabric, where waiting for it only moves the
    sender's clock; a real fabric's sends are all waited for by the call's end)."""
    wk = fabric.isend(req.buf, req.dst, req.tag, reliable=False)
    if req.hold is SENT:
        wk.wait()
        return
    if req.hold is None and fabric.modelled_time:
        return
    outbox.pending.append((wk, req.buf, False))
    if req.hold is not None:
        outbox.pool.hold(("out", req.hold), wk)
