"""The transport contract: a collective written once against a :class:`~sparsecomm.fabric.Fabric`.

``allreduce(x)`` returns, on every worker, the sum over workers of ``x`` (a tensor) or of
``x.to_dense()`` (a :class:`~sparsecomm.payload.Payload`), with the shape and dtype of the original
tensor (so a ``bool`` tensor, which cannot hold a sum, is refused: :meth:`Transport.check_input`; a
tensor that requires grad is summed as data). The call's :class:`CommStats` (bytes, messages, modelled
time on SimFabric) is at ``last_stats``. A transport never knows which compressor made a payload, only its kind
(``sparsecomm/payload.py``); ``carries`` declares the kinds it can sum. The public surface is
:meth:`Transport.allreduce`, :meth:`Transport.start` and :meth:`Transport.run` (the call on this thread,
for code already on the communication thread).

**Payloads** are lowered once, here: the kinds a transport lists in ``linear`` (``aligned``, shared-scale
``quantized``, for some ``dense``) become their linear operand (:mod:`.linear`: the vector whose
element-wise sum over workers gives the aggregate, how to finish it, what the workers must agree on),
which the transport sums (``_sum_linear``); other kinds are densified, unless the transport sums them
itself (``sparse``: OmniReduce's block encoding, allgather's gather).

**Asynchronous calls.** ``work = t.start(x)`` queues the call and returns at once; ``work.wait()``
returns the sum (``allreduce(x)`` is ``start(x).wait()``). Every fabric has one communication thread
(:class:`CommEngine`, as Horovod's background thread) that runs the calls of *all* transports on that
fabric one at a time, in submission order. Since every worker submits its calls in the same order,
the protocols' messages match exactly as in synchronous use, and every protocol gets the asynchronous
API without being rewritten. ``start(x, then=f)`` runs ``f(sum)`` on the communication thread right
after the sum (the DDP hook decodes there) and ``wait()`` returns ``f``'s result;
``work.get_future()`` is a ``torch.futures.Future`` completed at the same moment, for chaining with
``then`` as torch's DDP hooks do. ``x`` (and a payload's tensors) must not be modified until the work
completes. An error on the communication thread is raised by ``wait()`` of that call and of every
later one on the fabric (the protocols' message streams are then out of step). While calls are in
flight, do not drive the fabric directly (send/recv, ``barrier``, ``compute``): use ``wait()`` first.
``allreduce`` with nothing in flight runs on the calling thread (no thread hop), so synchronous use is
unchanged. A transport whose call is a single non-blocking collective (``native``'s predicted calls)
may instead *post* it on the calling thread while every earlier call is posted too
(:meth:`CommEngine.post`): the order of messages is the call order all the same, and its completion
runs on the communication thread in that order.

**Calls of several rounds** (``start(x, then, next_round=f)``: PowerSGD's P, then Q) run their later
rounds inside the same call, before any message of a later call, so a later call is never posted while
an earlier one still has rounds to send. **Identity**: ``start(x, call=CallId(bucket, step))`` names
the call; every agreement the call makes (the handshake's header, the folded key of ``native``)
carries it, so workers whose paired calls are different calls raise
:class:`~sparsecomm.errors.MismatchError` instead of summing different tensors
(:class:`~._handshake.CallId`).

On SimFabric the communication thread drives the worker's endpoint on its behalf: an endpoint is not
bound to a thread (its blocking, clock and quiescence bookkeeping are per endpoint), so the data and
the modelled communication times are those of the synchronous calls in the same order; only
``compute()`` (the modelled compute clock) must not be called while calls are in flight.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable, ClassVar, NamedTuple

import torch

from ..errors import IncompatibleError, NonFiniteError
from ..fabric.base import Fabric
from ..fabric.stats import CommStats
from ..payload import Payload
from ..registry import Registry
from ..theory import costs
from . import _fold
from ._guards import check_dtype
from ._handshake import CallId, calling, transport_code
from .linear import LinearOperand, linear_operand


class CallShape(NamedTuple):
    """One call as a transport's cost model (:meth:`Transport.cost`) sees it, per worker: the figures
    every worker agrees on before it chooses (``transport="auto"``)."""

    #: elements of the dense tensor
    numel: int
    #: bytes per element of the dense tensor
    elem_size: int
    #: the payload kind (``dense`` for a plain tensor)
    kind: str = "dense"
    #: declared bytes of the payload (0: the dense bytes)
    payload_bytes: int = 0
    #: fraction of 256-element blocks holding a non-zero on one worker, and in the sum (the union)
    density: float = 1.0
    union_density: float = 1.0

    @property
    def wire_bytes(self) -> int:
        """The bytes one worker's message carries: the dense bytes of a ``dense`` call, else the
        payload's declared bytes."""
        dense = self.numel * self.elem_size
        return dense if self.kind == "dense" or not self.payload_bytes else int(self.payload_bytes)


class Transport(ABC):
    """Base class of the collectives. Subclasses implement :meth:`_allreduce_tensor` and, for the payload
    kinds they sum in compressed form, :meth:`_sum_linear` (the kinds named in :attr:`linear`) or
    :meth:`_allreduce_payload` (any other).

    Args:
        fabric: the fabric the collective runs over.
    """

    name: ClassVar[str] = ""
    #: payload kinds this transport sums (``dense`` means plain tensors too)
    carries: ClassVar[frozenset[str]] = frozenset({"dense"})
    #: whether ``quantized`` payloads must share their scale across workers to be carried
    quantized_needs_shared_scale: ClassVar[bool] = True
    #: payload kinds this transport sums as their linear operand (:func:`~.linear.linear_operand`, by
    #: :meth:`_sum_linear`); :meth:`_allreduce_payload` densifies the others
    linear: ClassVar[frozenset[str]] = frozenset()
    #: the transport checks a predicted call inside its data collective and keeps the call record
    #: itself (``native``; :mod:`._fold`); the others are told of a prediction by :meth:`run`
    folds: ClassVar[bool] = False
    #: the transport has a :meth:`gather` of its own (every worker's payload, unsummed)
    gathers: ClassVar[bool] = False
    #: the transport's own rule for a NaN/Inf in a sum: ``"raise"``, it raises
    #: :class:`~sparsecomm.errors.NonFiniteError` on every worker itself (so the pipeline need not check),
    #: or ``"pass"``, it sums them through or has no rule of its own (the pipeline checks); transports
    #: that take a ``nonfinite=`` option set it per instance
    nonfinite: str = "pass"
    #: the transport can sum NaN/Inf through (``nonfinite="pass"``, the pipeline's ``"skip"``); the
    #: fixed-point switches cannot
    sums_nonfinite: ClassVar[bool] = True

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            transport_code(cls.name)    # an agreement error can name this transport (handshake.transport_name)

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.last_stats = CommStats()

    # ------------------------------------------------------------------ public
    def allreduce(self, x: torch.Tensor | Payload, *, call: CallId | None = None) -> torch.Tensor:
        """Sum of ``x`` over all workers, on every worker; ``last_stats`` holds this call's CommStats.

        ``start(x, call=call).wait()``; with nothing in flight on this fabric it runs on the calling
        thread. ``call`` (a :class:`~._handshake.CallId`) is the call's identity, which the workers'
        agreement compares (a worker making another call raises :class:`~sparsecomm.errors.MismatchError`
        on every worker)."""
        eng = engine(self.fabric, create=False)
        if eng is None or eng.idle():
            return self.run(x, call)
        return self.start(x, call=call).wait()

    def start(self, x: torch.Tensor | Payload, then: Callable[[torch.Tensor], Any] | None = None, *,
              next_round: Callable[[torch.Tensor], Payload | torch.Tensor | None] | None = None,
              call: CallId | None = None) -> "CommWork":
        """Queue ``allreduce(x)`` (then ``then(sum)``) on the fabric's communication thread; returns a
        :class:`CommWork` at once. ``x`` must stay untouched until the work completes.

        A call of several rounds (PowerSGD: P, then Q): ``next_round(sum)`` returns the next round's
        input (or None: no more rounds); each later round runs in the same call, right after the
        previous sum and before any message of a later call on this fabric, with identity
        ``call.next_round()``; ``then`` gets the last round's sum. ``call``: the identity of the first
        round (:meth:`allreduce`)."""
        x = self.check_input(x)       # a bad pair or dtype fails here, on the caller's thread
        return engine(self.fabric).submit(lambda: self._later_rounds(self.run(x, call), then, next_round, call))

    def _later_rounds(self, out: torch.Tensor, then, next_round, call: CallId | None) -> Any:
        """Run a started call's later rounds (:meth:`start`) from its first sum ``out``, then ``then``."""
        while next_round is not None and (nxt := next_round(out)) is not None:
            call = call.next_round() if call is not None else None
            out = self.run(nxt, call)
        return then(out) if then is not None else out

    def run(self, x: torch.Tensor | Payload, call: CallId | None = None) -> torch.Tensor:
        """The call, on this thread, now: for code that already runs on the fabric's communication thread
        (a job of :meth:`CommEngine.submit`, such as the pipeline's row-sparse rounds) or with nothing in
        flight on the fabric; anywhere else use :meth:`start` or :meth:`allreduce`.

        Args:
            x: a tensor or a payload, as for :meth:`allreduce`.
            call: the call's identity (bucket, step, round) that the workers agree on.
        """
        with calling(call):
            return self._call_now(x)

    def _call_now(self, x: torch.Tensor | Payload) -> torch.Tensor:
        before = self.fabric.stats.copy()
        t0_model = self.fabric.now()
        t0_wall = time.perf_counter()
        x = self.check_input(x)
        # a call predicted to fold into its data (``native``, :mod:`._fold`) that this one is not:
        # join it and say so first; a transport that folds (``folds``) keeps its own record
        sched = None if self.folds else _fold.enter(self.fabric, self.name, f"{self.name} allreduce")
        try:
            if isinstance(x, Payload):
                out = self._allreduce_payload(x)
                out = out.reshape(x.shape).to(x.dtype)
            else:
                out = self._allreduce_tensor(x.reshape(-1)).reshape(x.shape)
        except BaseException:
            s = _fold.schedule(self.fabric) if self.folds else sched
            if s is not None:
                s.reset()        # raised on every worker alike: every record forgets alike
            raise
        _fold.leave(sched, self.name)
        stats = self.fabric.stats - before
        stats.wall_time_s = time.perf_counter() - t0_wall
        stats.modelled_time_s = self._modelled(t0_model)
        self.last_stats = stats
        return out

    def wire_copies(self) -> float:
        """How many copies of one worker's payload this transport's sends amount to, per worker, when
        the payload travels as declared (ring-like reduce-scatter + all-gather: ``2 (n-1)/n``). The
        pipeline multiplies the declared bytes by it to compare them with the ledger
        (``compression_stats()["sent_over_declared"]``)."""
        n = self.fabric.world_size
        return 2.0 * (n - 1) / n

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """The closed-form cost of ``call`` with this transport's configuration on a link of
        ``bandwidth_gbps`` and ``latency_us`` (:mod:`sparsecomm.theory.costs`, the SimFabric's model).
        The base class prices the call's wire bytes with the transport's entry of
        :data:`~sparsecomm.theory.costs.MODELS`; transports whose cost depends on their options or on the
        payload's sparsity override it.

        Args:
            call: the call's shape (agreed by every worker).
            bandwidth_gbps: the link's rate.
            latency_us: the link's latency per message.
        """
        return costs.MODELS[self.name](self.fabric.world_size, call.wire_bytes, bandwidth_gbps=bandwidth_gbps,
                                       latency_us=latency_us)

    def gather(self, p: Payload) -> list[Payload]:
        """Every worker's payload, unsummed, in rank order, on every worker: for the transports that
        declare :attr:`gathers`.

        Args:
            p: this worker's payload.
        """
        raise IncompatibleError(f"transport {self.name!r} has no gather; use 'allgather' or 'native'")

    @classmethod
    def can_carry(cls, kind: str, shared_scale: bool = False) -> bool:
        """True if this transport sums payloads of ``kind`` (with that scale sharing).

        Args:
            kind: a payload kind.
            shared_scale: for ``quantized``: whether the workers share the scale.
        """
        if kind not in cls.carries:
            return False
        if kind == "quantized" and cls.quantized_needs_shared_scale and not shared_scale:
            return False
        return True

    def check_input(self, x: torch.Tensor | Payload) -> torch.Tensor | Payload:
        """``x`` as the call sums it: a tensor detached from autograd (the sum is data, as
        ``torch.distributed.all_reduce`` gives; a tensor that requires grad is summed like any other);
        raises :class:`~sparsecomm.errors.UnsupportedDtypeError` for a dtype no transport sums into a
        result of that dtype (``bool``, :func:`._guards.check_dtype`) and
        :class:`~sparsecomm.errors.IncompatibleError` for a payload this transport cannot sum
        (:meth:`check_payload`), on the calling worker, before anything is sent."""
        if isinstance(x, Payload):
            check_dtype(x.dtype, self.name)
            self.check_payload(x)
            return x
        check_dtype(x.dtype, self.name)
        return x.detach()

    def check_payload(self, p: Payload) -> None:
        """Raise :class:`~sparsecomm.errors.IncompatibleError` if this transport cannot sum ``p``
        (:meth:`can_carry`).

        Args:
            p: the payload.
        """
        if not self.can_carry(p.kind, p.shared_scale):
            raise IncompatibleError(incompatible_message(self.name, p.kind, p.shared_scale))

    # --------------------------------------------------------------- protocol
    @abstractmethod
    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum a flat dense tensor over workers."""

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        """Sum payloads: a kind in :attr:`linear` as its linear operand (:func:`~.linear.linear_operand`:
        summed by :meth:`_sum_linear`, then finished into the aggregate); any other densified
        (``to_dense``) and summed by :meth:`_allreduce_tensor`."""
        if p.kind in self.linear:
            op = linear_operand(p, self.name)
            return op.finish(self._sum_linear(op))
        return self._allreduce_tensor(p.to_dense())

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        """The element-wise sum over workers of ``op.vector``, in a dtype ``op.finish`` takes: for the
        transports that declare :attr:`linear` kinds."""
        raise IncompatibleError(incompatible_message(self.name, op.kind))

    def _modelled(self, t0: float) -> float:
        return self.fabric.now() - t0 if self.fabric.modelled_time else 0.0


#: name -> transport class; every transport module registers itself here (``sc.transports.get``)
registry: "Registry[Transport]" = Registry("transport")


# ============================================================================ asynchronous calls
class CommWork:
    """Handle of a started collective: ``wait()`` returns its result (or raises its error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["CommWork"], None]] = []
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call completed and return its result; re-raise its error. ``timeout``
        (wall seconds) raises :class:`~sparsecomm.errors.FabricTimeout` (the fabric's own timeouts
        normally end a stuck call first)."""
        if not self._done.wait(timeout):
            from ..errors import FabricTimeout

            raise FabricTimeout(f"a started collective did not complete within {timeout:g} s")
        if self._exc is not None:
            raise self._exc
        return self._value

    def is_completed(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, fn: Callable[["CommWork"], None]) -> None:
        """Call ``fn(work)`` once complete (at once if it is; else on the communication thread)."""
        with self._lock:
            if not self._done.is_set():
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

    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._value, self._exc = value, exc
            self._done.set()
            cbs, self._callbacks = self._callbacks, []
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
    """

    idle_s = 60.0

    def __init__(self, name: str = "") -> None:
        _live_engines.add(self)
        self._cond = threading.Condition()
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

    def resolving(self) -> int:
        """Called by a posted call's completion before it runs messages of its own (a handshake): no
        further call is posted until :meth:`resolved`. Returns how many posted calls are queued
        after it: their messages are already out, so if the resolution raises, the caller must stop
        the job (fail-stop), since workers that did not post them never will."""
        with self._cond:
            self._resolving = True
            return sum(1 for _, _, posted, _ in self._queue if posted)

    def resolved(self) -> None:
        with self._cond:
            self._resolving = False

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
            return not self._queue and not self._busy

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted call has completed (errors are left to their works)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """Block until every submitted call has completed *and* its done-callbacks have returned (True
        then). A callback that completes a ``torch.futures.Future`` (:meth:`CommWork.get_future`) wakes
        the future's waiter before torch's C++ layer has released the callbacks chained on it; the
        interpreter must not finalize until it has (see :func:`_settle_at_exit`)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._busy and not self._finishing, timeout)

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
            thread = self._thread
            if thread is None:
                return True
            self._closing = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._queue) or self._closing, self.idle_s) \
                        or not self._queue:
                    self._thread = None
                    self._closing = False
                    return
                job, work, posted, issues = self._queue.popleft()
                self._busy = True
                failed = self._failed
            value, exc = None, failed
            if failed is None:
                try:
                    with torch.no_grad():
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
    """The communication engine of ``fabric`` (created on first use when ``create``)."""
    eng = fabric.scratch.get("transports/comm_engine")
    if eng is None and create:
        with _engines_lock:
            eng = fabric.scratch.get("transports/comm_engine")
            if eng is None:
                eng = CommEngine(str(fabric.rank))
                fabric.scratch["transports/comm_engine"] = eng
    return eng


def drain(fabric: Fabric, timeout: float | None = None) -> None:
    """Wait for every call started on ``fabric`` (the launcher does so before a worker finishes)."""
    eng = engine(fabric, create=False)
    if eng is not None:
        eng.drain(timeout)


def incompatible_message(transport: str, kind: str, shared_scale: bool = False, source: str | None = None) -> str:
    """The error text for a payload kind a transport cannot sum, naming the transports that can.

    Args:
        transport: the transport's name.
        kind: the payload kind.
        shared_scale: for ``quantized``: whether the scale is shared.
        source: the compressor or method that produces it, if known.
    """
    ok = [n for n in registry.available() if registry.factory(n).can_carry(kind, shared_scale)]
    what = f"{source!r} produces {kind!r} payloads" if source else f"{kind!r} payloads"
    if kind == "quantized" and not shared_scale:
        what += " with a per-worker scale"
    return (f"transport {transport!r} cannot carry {what}; transports that can: {', '.join(ok) or 'none'}")
