"""Two requests the sparse switch's roles need beyond :mod:`sparsecomm.fabric.roles`, and their lowering onto
:meth:`~sparsecomm.fabric.base.Fabric.drive` as it is.

A switch's packets are datagrams: the network may drop them (``reliable=False``), a worker notices by a timer and
sends again (SwitchML's loss recovery), and the switch's ports transmit in parallel, so that the program never
waits for its replies. :class:`~sparsecomm.fabric.roles.Send` is reliable and always waited for, and
:class:`~sparsecomm.fabric.roles.Recv` has no timer, hence:

- :class:`Datagram`: :class:`~sparsecomm.fabric.roles.Send` with ``reliable`` and ``tracked``; :class:`Datagrams`,
  several of them (none held) as one request, a buffer to several endpoints sent by one
  :meth:`~sparsecomm.fabric.base.Fabric.isend_each` (a switch's multicast: on a fabric with modelled time one
  pass);
- :class:`RecvFor`: a receive whose wait also ends after ``timeout`` (modelled seconds where the fabric's time
  is modelled); the role is resumed with the message's source, or ``None`` when the timer expired first.

:func:`lowered` runs a role that yields them on ``Fabric.drive``: it sends a :class:`Datagram` itself and lowers
a :class:`RecvFor` to :class:`~sparsecomm.fabric.roles.PostInto` and :class:`~sparsecomm.fabric.roles.Recv`, or,
with a timer, to the scheduler's :class:`~sparsecomm.fabric.roles.RecvWithin` (on the SimFabric an event of
its loop at ``now + timeout``); every other request is yielded on.
"""

from __future__ import annotations

from typing import Generator, NamedTuple

import torch

from ....fabric.roles import Inbox, Outbox, PostInto, Recv, RecvWithin, Stage

__all__ = ["Datagram", "Datagrams", "RecvFor", "lowered"]


class Datagram(NamedTuple):
    """Send ``buf`` to endpoint ``dst`` on ``tag`` (asynchronous), as :class:`~sparsecomm.fabric.roles.Send`
    (``hold``: the name a :class:`~sparsecomm.fabric.roles.Flush` waits for), with two more choices.
    ``reliable=False``: a datagram the network model may drop (``Fabric.isend``'s ``reliable``).
    ``tracked=False``: nobody ever waits for it, not even the outbox at the end of a call (a switch's port:
    on a fabric with modelled time a send completes at once, and a wait would move the sender's clock to
    the end of that port's transmission, delaying its other ports); only for such a fabric: elsewhere a
    send must be waited for, and a role sends ``tracked`` (reaped by the scheduler, finished by
    :meth:`~sparsecomm.fabric.roles.Outbox.finish`)."""

    buf: torch.Tensor
    dst: int
    tag: int
    reliable: bool = False
    hold: object = None
    tracked: bool = True


class Datagrams(NamedTuple):
    """For each ``(buf, dsts, reliable)`` of ``sends``, in order, a :class:`Datagram` ``(buf, dst, reliable)`` to
    each endpoint of ``dsts`` in order, on ``tag``, none held: one request for a switch's replies to a message
    (its multicast: ``buf`` to every worker, ``dsts`` a ``range``; a retransmission: ``dsts`` one endpoint),
    each ``buf`` sent by one ``Fabric.isend_each`` (on a fabric with modelled time one pass, with each
    destination's drop decision as an ``isend`` per destination)."""

    sends: list
    tag: int
    tracked: bool = True


class RecvFor(NamedTuple):
    """Receive one message ``key`` into ``buf`` (a contiguous tensor of the message's shape and dtype) from
    ``src`` (``None``: any) on ``tag``, posted now; suspend the role until it is in or ``timeout`` seconds
    have passed on this endpoint's clock (modelled seconds on a fabric with modelled time; ``None``: no
    timer, the fabric's own ``timeout_s`` bounds the wait). The role is resumed with the message's source,
    or ``None`` when the timer expired first: then nothing was received, and the next receive on the same
    ``(src, tag)`` takes the next message sent there (on TorchFabric the timed-out receive stays posted and
    that next receive adopts it). ``stage``: as :attr:`~sparsecomm.fabric.roles.Recv.stage`. Before it
    blocks, this endpoint's sends are reaped when the stage reaps (as before any wait)."""

    key: object
    buf: torch.Tensor
    src: int | None
    tag: int
    timeout: float | None
    stage: Stage


def lowered(role: Generator, fabric, inbox: Inbox, outbox: Outbox, keep: int = 64) -> Generator:
    """``role`` as a role of :func:`sparsecomm.fabric.roles.drive`: its :class:`Datagram` and :class:`Datagrams`
    requests are sent here (``Fabric.isend``, ``Fabric.isend_each``; a tracked one joins ``outbox``'s
    sends, held under its ``hold``), its :class:`RecvFor` requests are lowered (no timer:
    :class:`~sparsecomm.fabric.roles.PostInto` and :class:`~sparsecomm.fabric.roles.Recv`, then the message taken
    and its source read; with a timer: the sends reaped to ``keep`` if the stage reaps, then the scheduler's
    :class:`~sparsecomm.fabric.roles.RecvWithin`, ``None`` the timer's expiry); every other request is yielded on,
    and what the scheduler resumes the role with is passed back to it."""
    value = None
    while True:
        try:
            req = role.send(value)
        except StopIteration:
            return
        value = None
        t = type(req)
        if t is Datagram:
            wk = fabric.isend(req.buf, req.dst, req.tag, reliable=req.reliable)
            if req.tracked:
                outbox.pending.append((wk, req.buf, False))
                if req.hold is not None:
                    outbox.pool.hold(("out", req.hold), wk)
        elif t is Datagrams:
            tag, tracked = req.tag, req.tracked
            for buf, dsts, reliable in req.sends:
                if tracked:             # (recorded, those started before an error too)
                    outbox.send_each(buf, dsts, tag, reliable=reliable)
                else:
                    fabric.isend_each(buf, dsts, tag, [], reliable=reliable)
        elif t is RecvFor:
            if req.timeout is None:
                yield PostInto(req.key, req.buf, req.src, req.tag)
                yield Recv((req.key,), req.stage)
                work = inbox.work(req.key)
                inbox.take(req.key)
                value = work.wait()         # completed: its source
            else:
                if req.stage.reaps:
                    outbox.reap(keep)
                value = yield RecvWithin(req.buf, req.src, req.tag, req.timeout)
        else:
            value = yield req
