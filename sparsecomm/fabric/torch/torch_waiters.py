"""How TorchFabric waits for its posted operations (:class:`Waits`): the record of a posted send or
receive (:class:`Pending`), the helper threads that wait on it for callers with a deadline, the stale
receives that later receives adopt, and the end of the run that a service rank's waits watch.

Timeouts. Without ``timeout=`` a wait is bounded by the fabric's ``timeout_s`` (also the process
group's timeout): past it the wait raises :class:`FabricTimeout`, and gloo closes the connection to
that peer (the run is considered failed). With ``timeout=`` (wall seconds) the wait is done by a helper
thread that blocks in ``Work.wait()`` while the caller waits on an event until the deadline, because a
gloo ``Work`` neither reports completion without ``wait()`` nor survives a timed-out ``wait()`` (gloo
closes the pair). gloo cannot cancel a posted receive, so on timeout the receive *stays posted*: the
fabric keeps it, and the next receive on the same ``(src, tag)`` adopts it (:meth:`Waits.adopt`), so
the late message is delivered there (in order) rather than lost or mismatched. Caveat: a stale
``src=None`` receive may take a message that a later receive from a specific source on the same tag was
waiting for; it is then delivered to the next ``src=None`` receive on that tag. On nccl, waits poll
``Work.is_completed()``. A peer that dies surfaces as :class:`PeerFailure` (gloo reports the closed
connection) or, for receives from any source, as :class:`FabricTimeout`.

Service ranks. A service's receive with no ``timeout=`` has no deadline: it raises
:class:`ServiceShutdown` once every worker has finished ``fn`` (the launcher counts finished workers
under ``shutdown_key`` in the rendezvous store; the wait polls it every ``_SERVICE_POLL_S``, 50 ms) and
the job's failure record as soon as there is one. A service's own receive threads may instead wait on
the calling thread with no deadline (:meth:`Waits.unbounded`) and watch the end of the run on another
(:meth:`Waits.wait_for_shutdown`).

Retention. gloo's worker thread drops its reference to a collective's work only *after* marking it
complete; if Python has dropped the work's tensors by then, that thread frees their Python objects and
must take the GIL, and if the interpreter is finalizing (a script that ends right after its last
collective) the thread is ended inside a C++ destructor, which aborts the process. :func:`retain` keeps
a finished collective's work and tensors referenced from Python for the next few collectives, so that
the last reference is Python's.

Failures. Every error a wait meets is the fabric's :class:`~.torch_failure.FailStop`'s to name
(:meth:`Waits.error`), so that every rank raises the job's first failure. gloo does not end a send that its
receiver's death cut off mid-message when the job is tripped, so a send of at least
:data:`WATCHED_SEND_BYTES` is waited for by a helper thread and ends as soon as the job's failure record is
known (polled every ``_SERVICE_POLL_S``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Sequence

import torch

from ...errors import FabricTimeout, MismatchError, ServiceShutdown
from ..base import Work
from .torch_failure import FailStop
from .torch_ranks import JobRanks

_FOREVER = timedelta(days=365)
_SERVICE_POLL_S = 0.05
#: a gloo send of at least this many bytes is waited for by a helper thread while the caller watches the
#: failure record: a send cut off mid-message by its receiver's death (gloo aborts a process that receives a
#: message longer than its receive: a 5 MiB one to the switch) stays blocked in gloo after the job's trip.
#: Smaller sends, which the sockets' buffers mostly absorb whole, keep the calling thread's wait (no thread
#: hop on the small messages of the latency-bound protocols; beside a 1 MiB transmission a hop is noise).
#: The helper thread of such a send starts waiting when the send is posted, so that by the caller's wait
#: (a call's last step, for most protocols) it has mostly seen the send end: the caller finds it done
#: rather than waiting for two thread hand-offs per send
WATCHED_SEND_BYTES = 1 << 20

#: how many threads of this process are inside a gloo wait now (changed under :data:`_IN_WAIT`).
#: A thread blocked in one until its connection closes is woken by the close; if that happens while the
#: interpreter finalizes, the thread is killed inside C++ code and the process aborts (std::terminate,
#: SIGABRT), so :meth:`~sparsecomm.fabric.torch.torch_fabric.TorchFabric.release` waits for none to be left
#: (:func:`waits_ended` polls it: a plain lock costs a wait two C calls, where a condition notified on
#: every exit cost it a dozen Python ones, and only the end of a run looks)
_IN_WAIT = threading.Lock()
_in_wait = [0]
#: how often :func:`waits_ended` looks at :data:`_in_wait`
_ENDED_POLL_S = 0.001


#: the works and tensors of the last few finished collectives (:func:`retain`)
_RETAINED: deque = deque(maxlen=4)


def retain(*objs) -> None:
    """Keep ``objs`` (a finished collective's work and tensors) referenced from Python until four
    later collectives were retained ("Retention" in the module docstring)."""
    _RETAINED.append(objs)


#: :func:`retain` of one object, in one C call (a completion's hot path)
retain_one = _RETAINED.append


def waits_ended(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until no thread of this process is inside a gloo wait (True then)."""
    deadline = time.monotonic() + timeout
    while _in_wait[0] > 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_ENDED_POLL_S)
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

    def submit(self, pend: "Pending") -> None:
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
#: :meth:`Waits.any` blocks until something completes instead of polling
COMPLETIONS = threading.Condition()
_generation = [0]


class Pending:
    """A posted torch.distributed operation (``work``) on ``buf`` with peer ``src`` (``None``: any source)
    and ``tag``; ``source`` is a completed receive's sender. For timed waits on gloo a helper thread waits
    on it (:meth:`start_waiter`), then sets ``done`` (and ``error``, if the wait raised); ``done`` is
    ``None`` until then (most operations are waited for on the calling thread: no event to make).
    ``ended``: the helper thread has seen it end (set before ``done``; a look at it is an attribute's
    read, where ``done.is_set()`` is a call: the schedulers look at their pending receives often)."""

    __slots__ = ("work", "buf", "src", "tag", "is_recv", "done", "error", "source", "trace", "ended")

    def __init__(self, work, buf: torch.Tensor, src: int | None, tag: int, is_recv: bool) -> None:
        self.work = work
        self.buf = buf
        self.src = src
        self.tag = tag
        self.is_recv = is_recv
        self.done: threading.Event | None = None
        self.error: BaseException | None = None
        self.source: int | None = src
        #: a send's recorder and event on the active timeline (:mod:`sparsecomm.fabric.trace`), ended when
        #: the send completes
        self.trace: tuple | None = None
        self.ended = False

    @property
    def waited(self) -> bool:
        """True once a helper thread waits on it (then only ``done`` tells its completion)."""
        return self.done is not None

    def start_waiter(self) -> None:
        if self.done is None:
            self.done = threading.Event()
            _WAITERS.submit(self)

    def wait_here(self, timeout: timedelta) -> None:
        """Block this thread in gloo's ``Work.wait`` (counted in :data:`_in_wait`); learn the source of a
        receive from any source."""
        with _IN_WAIT:
            _in_wait[0] += 1
        try:
            self.work.wait(timeout)
        finally:
            with _IN_WAIT:
                _in_wait[0] -= 1
        if self.is_recv and self.src is None:
            self.source = self.work.source_rank()

    def run(self) -> None:
        """A helper thread's wait: until completion, however long; then ``done`` and a notice."""
        try:
            self.wait_here(_FOREVER)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.error = exc
        self.ended = True
        self.done.set()
        with COMPLETIONS:
            _generation[0] += 1
            COMPLETIONS.notify_all()


class Waits:
    """The waits of one rank's posted operations (see the module docstring).

    ``rank`` is this rank (``service``: it serves a service), ``ranks`` names the job's ranks, ``failstop``
    names every error; ``cuda`` (nccl): waits poll; ``timeout_s`` bounds a wait without ``timeout=``;
    ``store`` and ``shutdown_key``: the counter of finished workers that a service's waits watch.
    """

    def __init__(self, rank: int, ranks: JobRanks, failstop: FailStop, *, service: bool, cuda: bool,
                 timeout_s: float, store, shutdown_key: str) -> None:
        self._rank = rank
        self._ranks = ranks
        self._failstop = failstop
        self._service = service
        self._cuda = cuda
        self._timeout_s = timeout_s
        self._store = store
        self._shutdown_key = shutdown_key
        #: receives that timed out and stay posted, per channel (module docstring, "Timeouts"); empty
        #: (false) when there is none to adopt
        self.stale: dict[tuple[int | None, int], deque[Pending]] = {}
        self._limit = timedelta(seconds=timeout_s)      # (a wait's bound, as gloo takes it)

    def error(self, exc: BaseException, pend: Pending, limit: float | None = None) -> BaseException:
        """The library's error for posting or waiting for ``pend`` (waited up to ``limit`` s) having
        raised ``exc`` (:meth:`FailStop.wait_error`)."""
        return self._failstop.wait_error(exc, peer=pend.src, tag=pend.tag, is_recv=pend.is_recv, limit=limit)

    def adopt(self, src: int | None, tag: int, tensor: torch.Tensor) -> Pending | None:
        """The oldest stale receive on ``(src, tag)``, which a receive into ``tensor`` takes over instead
        of posting its own, or ``None``; :class:`MismatchError` if it was posted for another size or
        dtype."""
        q = self.stale.get((src, tag))
        if not q:
            return None
        pend = q[0]
        if pend.buf.numel() != tensor.numel() or pend.buf.dtype != tensor.dtype:
            raise MismatchError(
                f"{self._ranks.name(self._rank)}: a receive from {self._ranks.name(src)} (tag {tag}) timed out "
                f"earlier and stays posted for {pend.buf.numel()} x {pend.buf.dtype}; this receive "
                f"on the same channel expects {tensor.numel()} x {tensor.dtype}")
        q.popleft()
        if not q:
            del self.stale[(src, tag)]
        return pend

    def wait(self, pend: Pending, timeout: float | None) -> None:
        """Wait until ``pend`` has completed: within ``timeout`` s if given, else within ``timeout_s``
        (a service's receive: until the run ends), as the module docstring says."""
        service = self._service and pend.is_recv
        watched = not pend.is_recv and not self._cuda and pend.buf.nbytes >= WATCHED_SEND_BYTES
        if timeout is None and not service and (pend.done is None or watched):   # (else a helper thread's)
            if self._cuda:
                self._blocking(pend)
            elif not watched:
                try:            # (:meth:`_blocking`, inline: once per message)
                    pend.wait_here(self._limit)
                except RuntimeError as exc:
                    raise self.error(exc, pend, self._timeout_s) from exc
            else:
                self._watched(pend)
        else:
            limit = timeout if timeout is not None else (None if service else self._timeout_s)
            if pend.done is not None and pend.done.is_set():    # a helper thread saw it complete: as _timed ends
                if pend.error is not None:
                    raise self.error(pend.error, pend, limit) from pend.error
                return
            self._timed(pend, limit, service)

    def _blocking(self, pend: Pending) -> None:
        if self._cuda:             # bounded by timeout_s and the failure record, like every gloo wait
            if not self._poll_cuda(pend, time.monotonic() + self._timeout_s, False):
                raise FabricTimeout(f"{self._ranks.name(self._rank)}: no "
                                    f"{'message from' if pend.is_recv else 'send to'} "
                                    f"{self._ranks.name(pend.src)} (tag {pend.tag}) completed within "
                                    f"{self._timeout_s:.6g} s")
            return
        try:
            pend.wait_here(timedelta(seconds=self._timeout_s))
        except RuntimeError as exc:
            raise self.error(exc, pend, self._timeout_s) from exc

    def _watched(self, pend: Pending) -> None:
        """A large gloo send (:data:`WATCHED_SEND_BYTES`), bounded by ``timeout_s`` like :meth:`_blocking`
        and ended by the job's failure record as soon as there is one (a helper thread waits in gloo,
        started when the send was posted: :meth:`.torch_fabric.TorchFabric.isend`)."""
        pend.start_waiter()
        if pend.done.is_set():      # (seen to end before this wait: no sleep, no wake-up)
            if pend.error is not None:
                raise self.error(pend.error, pend, self._timeout_s) from pend.error
            return
        deadline = time.monotonic() + self._timeout_s
        while not pend.done.wait(_SERVICE_POLL_S):
            if self._failstop.failure is not None:
                raise self._failstop.error()
            if time.monotonic() >= deadline:
                raise self.error(RuntimeError(f"Timed out after {self._timeout_s:g} s"), pend, self._timeout_s)
        if pend.error is not None:
            raise self.error(pend.error, pend, self._timeout_s) from pend.error

    def _timed(self, pend: Pending, limit: float | None, stop_on_shutdown: bool) -> None:
        deadline = None if limit is None else time.monotonic() + limit
        if self._cuda:
            done = self._poll_cuda(pend, deadline, stop_on_shutdown)
        else:
            pend.start_waiter()
            done = False
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                step = _SERVICE_POLL_S if stop_on_shutdown else remaining
                if step is not None and remaining is not None:
                    step = min(step, remaining)
                if pend.done.wait(max(step, 0.0) if step is not None else None):
                    done = True
                    break
                if stop_on_shutdown and self.workers_done():
                    raise ServiceShutdown("every worker has finished")
                if stop_on_shutdown and self._failstop.failure is not None:
                    raise self._failstop.error()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        if not done:
            if pend.is_recv:
                self.stale.setdefault((pend.src, pend.tag), deque()).append(pend)
            what = "message from" if pend.is_recv else "send to"
            raise FabricTimeout(
                f"{self._ranks.name(self._rank)}: no {what} {self._ranks.name(pend.src)} (tag {pend.tag}) "
                f"completed within {limit:.6g} s" + (" (the receive stays posted and the next receive on "
                                                     "this channel adopts it)" if pend.is_recv else ""))
        if pend.error is not None:
            raise self.error(pend.error, pend, limit) from pend.error

    def _poll_cuda(self, pend: Pending, deadline: float | None, stop_on_shutdown: bool) -> bool:
        sleep, last_check = 1e-5, time.monotonic()
        while True:
            try:
                if pend.work.is_completed():
                    pend.work.wait()
                    return True
            except RuntimeError as exc:
                raise self.error(exc, pend) from exc
            self._failstop.check()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if stop_on_shutdown and now - last_check >= _SERVICE_POLL_S:
                last_check = now
                if self.workers_done():
                    raise ServiceShutdown("every worker has finished")
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def unbounded(self, pend: Pending) -> None:
        """Wait for ``pend`` on the calling thread itself, with no deadline and no helper thread (unless
        one already waits on it: then for its report). The end of the run is not seen here; a failure
        is (the tripped group ends the wait with the failure's error); once the fabric is closed, a wait
        that ends with an error raises :class:`ServiceShutdown`."""
        if pend.waited:            # a helper thread already waits on it: wait for its report
            pend.done.wait()
            if pend.error is not None:
                if self._failstop.closed:
                    raise ServiceShutdown("the run is over")
                raise self.error(pend.error, pend) from pend.error
        elif self._cuda:
            self._poll_cuda(pend, None, False)
        else:
            try:
                pend.wait_here(_FOREVER)
            except RuntimeError as exc:
                if self._failstop.closed:
                    raise ServiceShutdown("the run is over") from exc
                raise self.error(exc, pend) from exc

    def any(self, works: Sequence[Work | Sequence[Work]]) -> int:
        """gloo's ``wait_any``: the lowest index complete, sleeping on :data:`COMPLETIONS` between checks
        (each check starts the helper threads that report completion), bounded by ``timeout_s`` and the
        job's failure record."""
        groups = [list(el) if isinstance(el, (list, tuple)) else [el] for el in works]
        deadline = time.monotonic() + self._timeout_s
        while True:
            seen = _generation[0]      # (an int's read: the wait below compares it under the lock)
            for i, g in enumerate(groups):
                if all(w.is_completed() for w in g):
                    for w in g:
                        w.wait()
                    return i
            self._failstop.check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FabricTimeout(f"{self._ranks.name(self._rank)}: none of {len(works)} operations "
                                    f"completed within {self._timeout_s:g} s")
            with COMPLETIONS:
                if _generation[0] == seen:
                    COMPLETIONS.wait(min(remaining, 0.05))

    def workers_done(self) -> bool:
        """Has every worker finished ``fn`` (the counter under ``shutdown_key``)? True once the store is
        gone (the job is over); False without a store."""
        if self._store is None:
            return False
        try:
            return int(self._store.add(self._shutdown_key, 0)) >= self._ranks.world_size
        except RuntimeError:   # the store is gone: the job is over
            return True

    def wait_for_shutdown(self, stop: Callable[[], bool] | None = None) -> bool:
        """On a service rank: wait for every worker to finish (True) or for ``stop()`` (False)."""
        while not self.workers_done():
            if stop() if stop is not None else self._store is None:    # no store: no end to see
                return False
            time.sleep(_SERVICE_POLL_S)
        return True
