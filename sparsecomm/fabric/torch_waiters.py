"""Completion of TorchFabric's posted operations: the handle (:class:`_TorchWork`), the record of a
posted send or receive (:class:`_Pending`) and the helper threads that wait on it for callers with a
deadline (:class:`_Waiters`).

Timeouts. Without ``timeout=`` a wait is bounded by the fabric's ``timeout_s`` (also the process
group's timeout): past it the wait raises :class:`FabricTimeout`, and gloo closes the connection to
that peer (the run is considered failed). With ``timeout=`` (wall seconds) the wait is done by a helper
thread that blocks in ``Work.wait()`` while the caller waits on an event until the deadline, because a
gloo ``Work`` neither reports completion without ``wait()`` nor survives a timed-out ``wait()`` (gloo
closes the pair). gloo cannot cancel a posted receive, so on timeout the receive *stays posted*: the
fabric keeps it, and the next receive on the same ``(src, tag)`` adopts it, so the late message is
delivered there (in order) rather than lost or mismatched. Caveat: a stale ``src=None`` receive may
take a message that a later receive from a specific source on the same tag was waiting for; it is
then delivered to the next ``src=None`` receive on that tag. On nccl, timed waits poll
``Work.is_completed()``. A peer that dies surfaces as :class:`PeerFailure` (gloo reports the closed
connection) or, for receives from any source, as :class:`FabricTimeout`.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .base import Work

if TYPE_CHECKING:
    from .torch_fabric import TorchFabric

_FOREVER = timedelta(days=365)


class _Waiters:
    """Daemon threads that block in ``Work.wait()`` on behalf of callers with a deadline.

    A thread is reused once its wait completes; a new one is started only when every thread is busy
    (a stale receive keeps its thread until its message arrives). Daemon threads never delay exit.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._queued = 0

    def submit(self, pend: "_Pending") -> None:
        with self._lock:
            self._queued += 1
            if self._queued > self._idle:
                self._idle += 1
                threading.Thread(target=self._loop, name="sparsecomm-wait", daemon=True).start()
        self._q.put(pend)

    def _loop(self) -> None:
        while True:
            pend = self._q.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            pend.run()
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()


class _Pending:
    """A posted torch.distributed operation; for timed waits on gloo, a helper thread waits on it."""

    __slots__ = ("work", "buf", "src", "tag", "is_recv", "done", "error", "source", "_started")

    def __init__(self, work, buf: torch.Tensor, src: int | None, tag: int, is_recv: bool) -> None:
        self.work = work
        self.buf = buf
        self.src = src
        self.tag = tag
        self.is_recv = is_recv
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.source: int | None = src
        self._started = False

    @property
    def waited(self) -> bool:
        return self._started

    def start_waiter(self) -> None:
        if not self._started:
            self._started = True
            _WAITERS.submit(self)

    def run(self) -> None:
        try:
            self.work.wait(_FOREVER)
            if self.is_recv and self.src is None:
                self.source = self.work._source_rank()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.error = exc
        self.done.set()


class _TorchWork(Work):
    def __init__(self, fabric: "TorchFabric", pend: _Pending, out: torch.Tensor | None) -> None:
        self._fabric = fabric
        self._pend = pend
        self._out = out
        self._result: int | None = None
        self._finished = False

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._finished:
            self._result = self._fabric._finish(self._pend, timeout, self._out)
            self._finished = True
        return self._result

    def is_completed(self) -> bool:
        if self._finished:
            return True
        if self._fabric._deferred:
            self._fabric._flush()
        if self._fabric._cuda:
            return bool(self._pend.work.is_completed())
        self._pend.start_waiter()   # gloo reports completion only through wait()
        return self._pend.done.is_set()
