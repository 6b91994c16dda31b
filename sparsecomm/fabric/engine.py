"""The communication thread of a fabric: one per fabric, running the asynchronous calls of every protocol on it
one at a time, in submission order (:class:`CommEngine`, as Horovod's background thread), with the handle of a
started call (:class:`CommWork`) and the engines' settling at interpreter exit.

**Order.** A job (:meth:`CommEngine.submit`) sends its messages when it runs, on the communication thread. Since
every worker submits its jobs in the same order, the protocols' messages match exactly as in synchronous use,
and every protocol gets an asynchronous API without being rewritten (``Transport.start``,
:mod:`sparsecomm.transports.base`). A job whose call is a single non-blocking collective may instead *post* it on
the calling thread while every earlier job is posted too (:meth:`CommEngine.post`): the order of messages is the
submission order all the same, and its completion runs on the communication thread in that order. Or it may
*chain* its completion on the collective's own ``torch.futures.Future`` (:meth:`CommEngine.chain`) while nothing
is queued: the chained completions run one at a time in call order, on the thread that completes the collective,
and a call queued later runs only after them.

**Lanes.** Calls that should not queue behind each other run on fabrics of their own, each with its engine
(the DDP hook's lanes, :mod:`sparsecomm.pipeline.lanes`, which decides their outcomes in call order across the
engines).

**Errors.** A job's error is raised by ``wait()`` of its :class:`CommWork` and of every later one on the
fabric (the protocols' message streams are then out of step), except a
:class:`~sparsecomm.errors.NonFiniteError`, which every worker raises after the same sum, so the streams are
still in step. While jobs are in flight, do not drive the fabric directly (send/recv, ``barrier``,
``compute``): wait for them first (:func:`drain`).

**Futures.** :meth:`CommWork.get_future` is a ``torch.futures.Future`` completed with the job's result, for
chaining with ``then`` as torch's DDP hooks do; a failed job fails the chained future with its exception.

**Exit.** At interpreter exit every engine completes its jobs, ends its thread and joins it, within
:data:`EXIT_GRACE_S` (``_settle_at_exit``), so that no thread of the library is alive when the interpreter
finalizes.

On SimFabric the communication thread drives the worker's endpoint on its behalf: an endpoint is not bound to a
thread (what it waits for is a process of the world's loop, and whether it runs is counted per endpoint,
:mod:`sparsecomm.fabric.sim_gate`), so the data and the modelled
communication times are those of the synchronous calls in the same order; only ``compute()`` (the modelled
compute clock) must not be called while jobs are in flight.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import torch

from ..errors import FabricTimeout, NonFiniteError
from .base import Fabric

__all__ = ["CommWork", "CommEngine", "engine", "drain", "EXIT_GRACE_S"]


class CommWork:
    """Handle of a started collective: ``wait()`` returns its result (or raises its error)."""

    __slots__ = ("_latch", "_lock", "_completed", "_value", "_exc", "_callbacks", "__weakref__")

    def __init__(self) -> None:
        # a lock held until the call completes: a waiter blocks on it (then lets the next waiter through)
        self._latch = threading.Lock()
        self._latch.acquire()
        self._completed = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["CommWork"], None]] = []
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call completed and return its result; re-raise its error. ``timeout``
        (wall seconds) raises :class:`~sparsecomm.errors.FabricTimeout` (the fabric's own timeouts
        normally end a stuck call first)."""
        if not self._completed:
            if not self._latch.acquire(True, -1 if timeout is None else max(0.0, timeout)):
                raise FabricTimeout(f"a started collective did not complete within {timeout:g} s")
            self._latch.release()
        if self._exc is not None:
            raise self._exc
        return self._value

    def is_completed(self) -> bool:
        """True once the call completed (with a result or an error)."""
        return self._completed

    def exception(self) -> BaseException | None:
        """The call's error once it completed with one, else None (without waiting)."""
        return self._exc if self._completed else None

    def add_done_callback(self, fn: Callable[["CommWork"], None]) -> None:
        """Call ``fn(work)`` once complete (at once if it is; else on the communication thread)."""
        with self._lock:
            if not self._completed:
                self._callbacks.append(fn)
                return
        fn(self)

    def get_future(self) -> "torch.futures.Future[Any]":
        """A ``torch.futures.Future`` completed with the result (or the error) of this call.

        The error is the future's error as torch's C++ layer sees it too (a DDP comm hook's future is
        waited on there): the future is chained with ``then`` from one that carries the outcome, so a
        failed call fails the chained future with this call's exception, which DDP's backward re-raises
        (a ``RuntimeError`` whose text starts with the exception's). ``Future.set_exception`` would
        store the exception as the value, and DDP would try to use it as the bucket's tensor."""
        fut: torch.futures.Future = torch.futures.Future()

        def done(w: "CommWork") -> None:
            fut.set_result((w._value, w._exc))

        self.add_done_callback(done)
        return fut.then(_unwrap_outcome)

    def complete(self, value: Any = None, exc: BaseException | None = None) -> None:
        """Complete the call with ``value``, or fail it with ``exc`` (once; later calls do nothing): for a
        handle whose outcome is decided outside an engine (the DDP hook's lanes decide their calls' outcomes in
        call order: :class:`sparsecomm.pipeline.lanes.CallOrder`)."""
        self._finish(value, exc)

    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            if self._completed:
                return
            self._value, self._exc = value, exc
            self._completed = True
            cbs, self._callbacks = self._callbacks, []
        self._latch.release()
        for cb in cbs:
            try:
                cb(self)
            except Exception as e:  # noqa: BLE001 - a callback's error must not kill the comm thread
                import warnings

                warnings.warn(f"a CommWork done-callback raised {e!r}", RuntimeWarning)


def _unwrap_outcome(fut: "torch.futures.Future[Any]") -> Any:
    value, exc = fut.value()
    if exc is not None:
        raise exc
    return value


def _settled(fut: "torch.futures.Future[Any]") -> None:
    """Nothing, once ``fut`` has completed, with a value or an error (:meth:`CommEngine.chain`'s order)."""
    return None


class CommEngine:
    """One fabric's communication thread: runs submitted calls one at a time in submission order.

    The thread starts on the first submission and leaves after ``idle_s`` seconds without work, or at
    :meth:`close` (a new one starts on the next submission). After a call fails, every later call fails
    with the same error, unless it is a :class:`~sparsecomm.errors.NonFiniteError`: that one is raised by
    every worker after the same sum (the non-finite rule's checks, :mod:`sparsecomm.pipeline.nonfinite`, and
    the transports' own), so the workers' streams of calls are still in step and later calls run.
    ``idle_s`` is long enough for a training loop's (or a benchmark's interleaved) steps to find the thread
    still there: starting one blocks the submitting thread (the autograd thread, in a DDP hook) until
    the new thread runs, which on a host with more runnable threads than cores is a scheduling delay.

    Args:
        name: the suffix of the thread's name (``sparsecomm-comm<name>``; :func:`engine` gives the rank).
    """

    idle_s = 60.0

    def __init__(self, name: str = "") -> None:
        _live_engines.add(self)
        # the condition's lock, entered directly where nothing waits on the condition (:meth:`chain`: a C
        # call where the condition's ``with`` is two Python ones)
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        # (job, work, posted: its first messages are out, issues: it sends messages when it runs)
        self._queue: deque[tuple[Callable[[], Any], CommWork, bool, bool]] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._name = name
        self._issuing = 0           # queued or running jobs that send messages when they run
        self._finishing = 0         # completed jobs whose done-callbacks are still running
        self._resolving = False     # a posted call is being resolved (it runs handshakes): no posts
        self._closing = False       # close(): the thread leaves once nothing is queued
        self._chained = 0           # chained calls (:meth:`chain`) whose completion has not returned
        self._tail: Any = None      # the last chained call's future (the caller's), or None
        self._watchers = 0          # threads in drain() or settle()
        # guards _chained where a chained completion returns (not _cond: a post may hold that one while
        # its collective is enqueued, and the completion must not wait for it)
        self._chain_lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> CommWork:
        """Queue ``job`` (which sends its messages when it runs, on the communication thread)."""
        work = CommWork()
        with self._cond:
            if self._failed is not None:
                work._finish(exc=self._failed)
                return work
            self._enqueue(job, work, posted=False, issues=True)
        return work

    def post(self, post: Callable[[], Any], complete: Callable[[Any], Any], *,
             issues: bool = False) -> CommWork | None:
        """Post a call's messages now, on the calling thread, and queue its completion: ``post()`` (it
        must only post non-blocking collectives, in the order the calls are made) and, on the
        communication thread in submission order, ``complete(posted)``; ``post()`` returning None
        posts nothing (the call is not postable after all). Done only while no queued or running job
        sends messages when it runs (every one is the completion of a posted call that sends nothing
        more) and none is being resolved (:meth:`resolving`): then the call's messages follow every
        earlier call's on every worker, as with :meth:`submit`, and the next call's messages are on
        their way while this one completes (no idle gap between them). ``issues``: the completion
        sends messages of its own (the later rounds of a call of several rounds), so no call is posted
        until it has run. Returns None (post nothing) otherwise; the caller then submits the call
        (:meth:`submit`)."""
        work = CommWork()
        with self._cond:
            if self._failed is not None or self._issuing or self._resolving:
                return None
            try:
                posted = post()
            except BaseException as exc:  # noqa: BLE001 - the stream is out of step: later calls fail too
                self._failed = exc
                work._finish(exc=exc)
                return work
            if posted is None:
                return None
            self._enqueue(lambda: complete(posted), work, posted=True, issues=issues)
        return work

    def chain(self, post: Callable[[], Any], complete: Callable[[Any], Any],
              done: Callable[[Any, BaseException | None], None] | None = None) -> "torch.futures.Future | None":
        """Post a call's single non-blocking collective now, on the calling thread, and chain its
        completion on the collective's own future, with no hop through the communication thread:
        ``post()`` returns ``(future, posted)`` (the collective's ``torch.futures.Future`` and what
        ``complete`` needs) or None (not postable after all); ``complete(posted)`` runs once the
        collective has completed *and* the previous chained call's completion has returned, so the
        chained completions run one at a time in call order (on whichever thread completes the last of
        the two: a collective's own thread, or this one), as :meth:`post`'s do on the communication
        thread; then ``done(value, error)`` (the caller's bookkeeping), then the returned future
        completes with ``complete``'s value, or fails with its error.

        The returned future is the one ``then`` chains on the collective's (a single callback: the
        completion's outcome is the future's, with no second callback to unwrap it). While the previous
        chained call's future is still pending, this call's completion also waits for it, through a
        future that completes when it does, failed or not (``collect_all`` of a failed future ends at
        once, and a completion must never block a collective's thread on another collective).

        Done only when nothing is queued or running on the communication thread and nothing blocks
        :meth:`post` (no call sends messages when it runs, none is being resolved, none failed): the
        chained calls are then a prefix of the fabric's calls, and a call queued later (submitted or
        posted) runs its completion only once every chained completion has returned
        (:meth:`_loop`). Errors are recorded as for a queued call: a chained completion that raises
        fails every later call, unless its error is a :class:`~sparsecomm.errors.NonFiniteError`.
        Returns None when not done; the caller then posts or submits the call. A ``post()`` that raises
        (its collective could not be posted, or not all of it) leaves this worker's stream of calls out of
        step with the other workers': the engine fails, as for a failed :meth:`post`, and the error is
        raised to the caller here; every later call fails with it."""
        with self._mutex:
            if (self._failed is not None or self._issuing or self._resolving or self._queue
                    or self._busy):
                return None
            try:
                got = post()
            except BaseException as exc:  # noqa: BLE001 - the stream is out of step: later calls fail too
                self._failed = exc
                raise
            if got is None:
                return None
            gfut, posted = got
            prev = self._tail
            with self._chain_lock:
                self._chained += 1
            if prev is None or prev.done():
                gate, dep = None, gfut
            else:
                gate = prev.then(_settled)
                dep = torch.futures.collect_all([gate, gfut])
            tail = self._tail = dep.then(functools.partial(self._run_chained, complete, posted, done, gate))
        return tail

    def _run_chained(self, complete, posted, done, gate, _dep) -> Any:
        """A chained completion (:meth:`chain`): ``complete``'s value, or its error raised (which fails
        the caller's future), once ``done`` has run and the engine has recorded the outcome."""
        if gate is not None and not gate.done():
            gate.wait()         # (the collective failed first: collect_all ended early)
        value, exc = None, None
        try:
            value = complete(posted)
        except BaseException as e:  # noqa: BLE001 - handed to the future
            exc = e
        try:
            if done is not None:
                done(value, exc)
        finally:
            if exc is not None:
                with self._cond:
                    if self._failed is None and not isinstance(exc, NonFiniteError):
                        self._failed = exc
            self._resolving = False     # (set by this completion only: no call is posted meanwhile)
            with self._chain_lock:
                self._chained -= 1
                left = self._chained
            if not left and (self._queue or self._watchers):
                with self._cond:
                    self._cond.notify_all()     # (a queued call, or a drain, waits for it)
        if exc is not None:
            raise exc
        return value

    def resolving(self) -> int:
        """Called by a posted call's completion before it runs messages of its own (a handshake): no
        further call is posted until :meth:`resolved`. Returns how many posted calls are queued
        after it: their messages are already out, so if the resolution raises, the caller must stop
        the job (fail-stop), since workers that did not post them never will."""
        with self._cond:
            self._resolving = True
            # (a chained call resolving: the chained calls after it; they all come before the queue)
            return sum(1 for _, _, posted, _ in self._queue if posted) + max(0, self._chained - 1)

    def resolved(self) -> None:
        """Called once the resolution announced by :meth:`resolving` is over: calls may be posted again."""
        with self._cond:
            self._resolving = False

    def in_order(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at its place in submission order, without blocking: at once (on this thread) when nothing
        is queued, running, chained or completing, or when called on the communication thread itself (a call's
        own code); otherwise as a job queued after every call submitted before it, which the communication thread
        runs before any submitted after it. For what the calling thread does to state the calls also change,
        whose outcome must not depend on how the threads are scheduled (a SimFabric's modelled clock:
        :meth:`sparsecomm.fabric.sim.sim.SimFabric.host_work`). After a call failed, a queued ``fn`` is not run
        (the calls after it fail too)."""
        if threading.current_thread() is self._thread:
            fn()
            return
        with self._cond:
            if self._queue or self._busy or self._chained or self._finishing:
                self._enqueue(fn, CommWork(), posted=False, issues=False)
                return
            fn()            # (under the lock: no call starts meanwhile)

    def _enqueue(self, job: Callable[[], Any], work: CommWork, posted: bool, issues: bool) -> None:
        self._queue.append((job, work, posted, issues))
        if issues:
            self._issuing += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"sparsecomm-comm{self._name}",
                                            daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing queued or running."""
        with self._cond:
            return not self._queue and not self._busy and not self._chained

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted call has completed (errors are left to their works), or for at most
        ``timeout`` wall seconds (None: no limit)."""
        with self._cond:
            self._watchers += 1
            try:
                self._cond.wait_for(lambda: not self._queue and not self._busy and not self._chained, timeout)
            finally:
                self._watchers -= 1

    def settle(self, timeout: float | None = None) -> bool:
        """Block until every submitted call has completed *and* its done-callbacks have returned (True
        then; False when ``timeout`` wall seconds passed first). A callback that completes a
        ``torch.futures.Future`` (:meth:`CommWork.get_future`) wakes the future's waiter before torch's C++
        layer has released the callbacks chained on it; the interpreter must not finalize until it has
        (see :func:`_settle_at_exit`)."""
        with self._cond:
            self._watchers += 1
            try:
                return self._cond.wait_for(
                    lambda: not self._queue and not self._busy and not self._chained and not self._finishing,
                    timeout)
            finally:
                self._watchers -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Let every submitted call complete and its done-callbacks return (:meth:`settle`), then end the
        communication thread and join it, within ``timeout`` seconds in all; True once no thread is left.
        The thread's last call (its job, work and result: tensors, torch futures, a posted collective's
        gloo work) is released on that thread, with the interpreter whole. A later submission starts
        a new thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.settle(timeout):
            return False
        with self._cond:
            self._tail = None          # (the last chained call's future: its result, released)
            thread = self._thread
            if thread is None:
                return True
            self._closing = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not thread.is_alive()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)      # (thread-local: every job runs without autograd)
        while True:
            with self._cond:
                # (a queued call runs once every chained call before it has completed: :meth:`chain`)
                ready = self._cond.wait_for(lambda: (bool(self._queue) and not self._chained) or
                                            (self._closing and not self._queue), self.idle_s)
                if not self._queue:
                    self._thread = None
                    self._closing = False
                    return
                if not ready:
                    continue        # (still waiting for a chained completion)
                job, work, posted, issues = self._queue.popleft()
                self._busy = True
                failed = self._failed
            value, exc = None, failed
            if failed is None:
                try:
                    value = job()
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    exc = e
            with self._cond:
                if exc is not None and self._failed is None and not isinstance(exc, NonFiniteError):
                    self._failed = exc
                if issues:
                    self._issuing -= 1
                self._resolving = False
                self._busy = False
                self._finishing += 1
                self._cond.notify_all()
            try:
                work._finish(value, exc)
            finally:
                with self._cond:
                    self._finishing -= 1
                    self._cond.notify_all()


#: every CommEngine not yet collected, for :func:`_settle_at_exit`
_live_engines: "weakref.WeakSet[CommEngine]" = weakref.WeakSet()

#: how long the interpreter's exit waits for the communication threads' calls to complete
EXIT_GRACE_S = 10.0


def _settle_at_exit() -> None:
    """Close every communication engine (:meth:`CommEngine.close`: its calls complete, its thread ends and
    is joined; up to :data:`EXIT_GRACE_S` in all) before the interpreter finalizes, so that no thread of
    the library is alive then. The threads are daemons, and a daemon thread that returns into Python
    from torch's C++ layer once finalization has begun is ended by ``pthread_exit`` inside a C++
    destructor, which aborts the process ("terminate called without an active exception", exit -6):
    this happens when a script ends right after DDP's backward returns, while the comm thread is still
    releasing the callbacks chained on the bucket's future. A thread left parked would also keep its
    last call (a posted collective's gloo work, its tensors, the bucket's futures) referenced until
    the process is gone; joined, it releases them first, on its own thread."""
    deadline = time.monotonic() + EXIT_GRACE_S
    for eng in list(_live_engines):
        eng.close(max(0.0, deadline - time.monotonic()))


atexit.register(_settle_at_exit)


_engines_lock = threading.Lock()


def engine(fabric: Fabric, create: bool = True) -> CommEngine | None:
    """The communication engine of ``fabric`` (created on first use when ``create``; else None until then).

    Args:
        fabric: the fabric whose calls the engine runs (its ``scratch`` holds the engine).
        create: create the engine if the fabric has none yet.
    """
    eng = fabric.scratch.get("fabric/comm_engine")
    if eng is None and create:
        with _engines_lock:
            eng = fabric.scratch.get("fabric/comm_engine")
            if eng is None:
                eng = CommEngine(str(fabric.rank))
                fabric.scratch["fabric/comm_engine"] = eng
    return eng


def drain(fabric: Fabric, timeout: float | None = None) -> None:
    """Wait for every call started on ``fabric`` (the launcher does so before a worker finishes).

    Args:
        fabric: the fabric whose engine to wait for (nothing to wait for if it has none).
        timeout: the most wall seconds to wait (None: no limit).
    """
    eng = engine(fabric, create=False)
    if eng is not None:
        eng.drain(timeout)
