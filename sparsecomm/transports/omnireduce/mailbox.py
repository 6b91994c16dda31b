"""OmniReduce endpoints' message plumbing: pooled buffers, receives posted ahead, asynchronous sends.

Shared by the worker (:mod:`.worker`) and the aggregator (:mod:`.aggregator`) of one endpoint; nothing
here knows the protocol, only ``(key, buffer)`` pairs on a :class:`~sparsecomm.fabric.base.Fabric`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...fabric.base import Fabric
from . import wire

__all__ = ["Inbox", "Outbox", "Pool", "Step", "drive"]


class Pool:
    """Message buffers reused across rounds and calls, keyed by their role.

    Fresh large buffers cost page faults on first touch (tens of ms per 100 MB), more than the copy
    itself; an endpoint keeps one buffer per role (grown on demand) and reuses it once every send that
    used it has completed (:meth:`hold` records the sends, :meth:`get` waits for them).
    """

    def __init__(self) -> None:
        self._bufs: dict = {}
        self._busy: dict = {}

    def get(self, key, nbytes: int) -> torch.Tensor:
        for wk in self._busy.pop(key, ()):
            wk.wait()
        b = self._bufs.get(key)
        if b is None or b.numel() < nbytes:
            b = torch.empty(nbytes, dtype=torch.uint8)
            self._bufs[key] = b
        return b[:nbytes]

    def hold(self, key, work) -> None:
        self._busy.setdefault(key, []).append(work)

    def release(self) -> None:
        """Forget the completed sends (call after waiting for them all)."""
        self._busy.clear()


class Inbox:
    """Receives posted ahead of need, so that a real fabric moves the data while this endpoint works on
    something else; messages from the colocated peer are ``put`` directly. Receives on one
    ``(source, tag)`` must be posted in the order the source sends them."""

    def __init__(self, fabric: Fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        self._box: dict = {}

    def post(self, key, nbytes: int, src: int, tag: int) -> None:
        buf = self.pool.get(("in", key), nbytes)
        self._box[key] = (self.fabric.irecv(buf, src, tag), buf)

    def post_into(self, key, buf: torch.Tensor, src: int, tag: int) -> None:
        """Receive straight into ``buf`` (contiguous bytes, e.g. a view of the result)."""
        self._box[key] = (self.fabric.irecv(buf, src, tag), buf)

    def put(self, key, buf: torch.Tensor) -> None:
        self._box[key] = (None, buf)

    def work(self, key):
        """The pending receive of ``key`` (``None`` if it was put locally); ``KeyError`` if none."""
        return self._box[key][0]

    def has(self, key) -> bool:
        """Is a receive of ``key`` posted, or its message put here?"""
        return key in self._box

    def ready(self, key) -> bool:
        """Has the message of ``key`` arrived (or been put locally)?"""
        work = self._box[key][0]
        return work is None or work.is_completed()

    def pending(self, keys) -> list:
        """The receives of ``keys`` (each posted or put) that have not completed yet."""
        out = []
        for k in keys:
            work = self._box[k][0]
            if work is not None and not work.is_completed():
                out.append(work)
        return out

    def take(self, key) -> torch.Tensor:
        work, buf = self._box.pop(key)
        if work is not None:
            work.wait()
        return buf


class Outbox:
    """Asynchronous sends; a pooled buffer is not reused before its sends have completed."""

    def __init__(self, fabric: Fabric, pool: Pool) -> None:
        self.fabric = fabric
        self.pool = pool
        self.pending: list = []

    def message(self, key, k: int, block_size: int, dtype: torch.dtype, extra: int = 0, meta: bool = True):
        """A pooled block message ``(buffer, blocks view, int32 tail view)``, see :func:`wire.split`."""
        buf = self.pool.get(("out", key), wire.block_bytes(k, block_size, dtype.itemsize, extra, meta))
        data, tail = wire.split(buf, k, block_size, dtype, extra, meta)
        return buf, data, tail

    def send(self, buf: torch.Tensor, dst: int, tag: int, key=None) -> None:
        wk = self.fabric.isend(buf, dst, tag)
        self.pending.append((wk, buf))
        if key is not None:
            self.pool.hold(("out", key), wk)

    def reap(self, keep: int = 64) -> None:
        """Wait for all but the newest ``keep`` sends."""
        cut = len(self.pending) - keep
        if cut > 0:
            for wk, _ in self.pending[:cut]:
                wk.wait()
            del self.pending[:cut]
        if keep == 0:
            self.pool.release()


class Step(NamedTuple):
    """A step an endpoint can take: the inbox keys of the messages it waits for (it is a candidate once
    every one is posted or put), and what it does then."""

    keys: list
    run: Callable[[], None]


def drive(fabric: Fabric, inbox: Inbox, outbox: Outbox, steps: Callable[[], list], keep: int = 64) -> None:
    """The one scheduler of an endpoint's rounds: until ``steps()`` (the candidates, in order of
    preference) is empty, run the first candidate whose messages are in by the time the first one is
    (:meth:`Fabric.wait_any`), finishing all but ``keep`` of the sends first.

    It never blocks on one step while another could run; with steps that each wait only for messages
    sent by earlier steps (of any endpoint) and asynchronous sends, no cycle of waits can form.
    """
    from .wire import ProtocolError

    while True:
        outbox.reap(keep)
        cands = steps()
        if not cands:
            return
        ready = [st for st in cands if all(inbox.has(k) for k in st.keys)]
        if not ready:
            raise ProtocolError("omnireduce: no step of this call can run (a bug)")
        if len(ready) == 1:     # the only step that can run: its own blocking waits (no polling)
            ready[0].run()
        else:
            ready[fabric.wait_any([inbox.pending(st.keys) for st in ready])].run()
