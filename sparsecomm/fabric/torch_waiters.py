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
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidValueError, ServiceShutdown
from .base import Work

if TYPE_CHECKING:
    from .torch_fabric import TorchFabric

_FOREVER = timedelta(days=365)

#: how many threads of this process are inside a gloo wait now (notified on every exit from one).
#: A thread blocked in one until its connection closes is woken by the close; if that happens while the
#: interpreter finalizes, the thread is killed inside C++ code and the process aborts (std::terminate,
#: SIGABRT), so :meth:`~sparsecomm.fabric.torch_fabric.TorchFabric.release` waits for none to be left
_IN_WAIT = threading.Condition()
_in_wait = [0]


@contextmanager
def gloo_wait():
    """Around a blocking gloo ``Work.wait()``: counted in :data:`_in_wait`."""
    with _IN_WAIT:
        _in_wait[0] += 1
    try:
        yield
    finally:
        with _IN_WAIT:
            _in_wait[0] -= 1
            _IN_WAIT.notify_all()


def waits_ended(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until no thread of this process is inside a gloo wait (True then)."""
    deadline = time.monotonic() + timeout
    with _IN_WAIT:
        while _in_wait[0] > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _IN_WAIT.wait(remaining)
    return True


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

#: notified (and its generation bumped) whenever a helper thread sees an operation complete, so that
#: ``wait_any`` blocks until something completes instead of polling
COMPLETIONS = threading.Condition()
_generation = [0]


def completion_generation() -> int:
    """A counter bumped on every completion seen by a helper thread (read under :data:`COMPLETIONS`)."""
    return _generation[0]


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
            with gloo_wait():
                self.work.wait(_FOREVER)
            if self.is_recv and self.src is None:
                self.source = self.work._source_rank()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.error = exc
        self.done.set()
        with COMPLETIONS:
            _generation[0] += 1
            COMPLETIONS.notify_all()


def wait_any_blocking(fabric: "TorchFabric", works) -> int:
    """gloo's ``wait_any``: the lowest index complete, sleeping on :data:`COMPLETIONS` between checks
    (each check starts the helper threads that report completion), bounded by ``timeout_s`` and the
    job's failure record."""
    import time

    from ..errors import FabricTimeout

    groups = [list(el) if isinstance(el, (list, tuple)) else [el] for el in works]
    deadline = time.monotonic() + fabric.timeout_s
    while True:
        with COMPLETIONS:
            seen = _generation[0]
        for i, g in enumerate(groups):
            if all(w.is_completed() for w in g):
                for w in g:
                    w.wait()
                return i
        fabric._check_failed()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FabricTimeout(f"{fabric._name(fabric.rank)}: none of {len(works)} operations completed "
                                f"within {fabric.timeout_s:g} s")
        with COMPLETIONS:
            if _generation[0] == seen:
                COMPLETIONS.wait(min(remaining, 0.05))


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


class DirectWait:
    """The completion half of :class:`~sparsecomm.fabric.torch_fabric.TorchFabric` that service threads
    use (a mixin: it uses the fabric's ``_flush``, ``_deferred``, ``_cuda``, ``_poll_cuda``, ``_closed``,
    ``_translate``, ``stats``, ``rank``)."""

    direct_waits = True   # the capability (:mod:`sparsecomm.fabric.base`)

    def _account(self, pend: _Pending, out: torch.Tensor | None) -> int | None:
        """A completed operation: for a receive, copy it out (into ``out``), count it, return its source."""
        if not pend.is_recv:
            return None
        with torch.no_grad():
            if out is not None:
                out.copy_(pend.buf.reshape(out.shape))
        source = pend.source if pend.source is not None else pend.src
        self.stats.record_recv(source, self.rank, pend.buf.numel() * pend.buf.element_size())
        return source

    def wait_unbounded(self, work: Work) -> int | None:
        """Wait for ``work`` (posted by this fabric) on the calling thread itself, with no deadline and no
        helper thread; for a receive, return its source. For a service's own receive threads: a
        service's wait (``work.wait()``) is otherwise done by a helper thread, which the caller polls
        for the end of the run, one more thread hand-off per message. Here the end of the run is not
        seen (the service watches it on another thread: :meth:`wait_for_shutdown` with ``stop``); a
        failure is (the tripped group ends the wait with the failure's error). Once the fabric is
        closed, a wait that ends with an error raises :class:`ServiceShutdown` (the run is over)."""
        if not isinstance(work, _TorchWork) or work._fabric is not self:
            raise InvalidValueError("wait_unbounded takes a Work posted by this fabric")
        if work._finished:
            return work._result
        pend = work._pend
        if self._deferred:
            self._flush()
        if pend.waited:            # a helper thread already waits on it: wait for its report
            pend.done.wait()
            if pend.error is not None:
                if self._closed:
                    raise ServiceShutdown("the run is over")
                raise self._translate(pend.error, pend, None) from pend.error
        elif self._cuda:
            self._poll_cuda(pend, None, False)
        else:
            try:
                with gloo_wait():
                    pend.work.wait(_FOREVER)
                if pend.is_recv and pend.src is None:
                    pend.source = pend.work._source_rank()
            except RuntimeError as exc:
                if self._closed:
                    raise ServiceShutdown("the run is over") from exc
                raise self._translate(exc, pend, None) from exc
        work._result = self._account(pend, work._out)
        work._finished = True
        return work._result
