"""TorchFabric: the :class:`~sparsecomm.fabric.base.Fabric` contract over torch.distributed
point-to-point messages (gloo on CPU, nccl on GPU; multi-node through torchrun).

Ranks ``0 .. world_size-1`` of the default process group are the workers; services (a SwitchML switch,
dedicated OmniReduce aggregators) are the extra ranks ``world_size + i`` that the launcher started for
``services[i]`` (:mod:`sparsecomm.launch_torch`). Every rank, services included, must construct the
fabric (it creates the workers' subgroup, a collective call).

What maps to what:

- ``send``/``isend``/``recv``/``irecv`` are ``ProcessGroup.send/recv/recvAnysource`` on the default group,
  with the tag (tags must lie in ``[0, 2**31)``; torch rejects negative tags). Messages of one
  (src, dst, tag) arrive in order. Tensors stay on their device: nothing here copies to the host, so a
  CUDA tensor travels over nccl.
- Two channels per pair (gloo, ``two_way=True``, the default without ``coalesce``): a message from a
  lower to a higher rank travels on the default group, one from a higher to a lower rank on a second
  group of the same ranks, so each TCP connection carries data in one direction only. gloo sends a
  message only after the receiver's "receive posted" notice arrives, and a pair queues that notice
  behind whatever data it is already writing; on one connection per pair, a receive posted while the
  rank sends a large message to the same peer therefore waits for that whole message: two ranks
  exchanging 10 MB at 1 Gbit/s took 180 ms instead of 90 in about a third of the runs on the netbed
  (BENCHMARKS.md, "Where the netbed's time went"). Consequence for ``src=None``: it receives messages
  from *lower* ranks only (services, the library's only any-source receivers, have the highest ranks);
  rank 0 asking for it raises :class:`IncompatibleError`; ``two_way=False`` restores one group.
- ``src=None`` (receive from any source) is gloo only; nccl raises :class:`IncompatibleError`. nccl also
  ignores tags: messages between two ranks are matched in posting order whatever their tag
  (``serial_pairs`` is true). With nccl (``coalesce=True``) ``isend``/``irecv`` are deferred until the
  next wait and then issued as one ``batch_isend_irecv`` group, so that two ranks that both send first
  do not wait for each other.
- ``reliable=False`` sends are plain sends (TCP / NCCL transports are reliable).
- ``barrier()`` synchronises the workers only (services excluded), by point-to-point messages through
  worker 0 (``2 (n-1)`` one-byte messages, counted in ``stats``, like SimFabric's).
- ``service(name)`` returns the rank the launcher started for ``name`` and raises
  :class:`ServiceNotStarted` (naming the ``services=`` argument to pass) otherwise.
- ``now()`` is wall time; ``device`` is ``cuda:<current>`` for nccl, ``cpu`` otherwise.
- ``stats`` counts bytes and messages of this rank (sends when posted, receives when completed).

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

Message length/dtype. torch.distributed cannot check them: gloo silently accepts a shorter message and
aborts the process on a longer one. Transports therefore agree on sizes first
(:mod:`sparsecomm.transports._handshake`); a receive adopting a stale receive of another size raises
:class:`MismatchError`.

Failure propagation (fail-stop). The first rank that sees a failure -- an error it raises that the others
may not see (a malformed message, a transport disagreement only it detected, an exception out of ``fn``:
:meth:`TorchFabric.fail`), or a connection to a peer that closed (a peer died) -- writes one record
(error class name, rank, text: plain text, never pickled) under ``<shutdown_key>/failed`` in the
rendezvous store (first writer wins; the spawning launcher writes it too when a rank exits without a
report, e.g. after kill -9), then *trips* its process group: a deliberately timed-out receive makes gloo
close every connection of this rank, which ends every wait of this process and every peer's wait on it
at once. A watchdog thread per rank polls the record every 50 ms and trips its own group when another
rank wrote it. Every wait that ends that way raises the recorded error's class (from
:data:`sparsecomm.errors.REPORTABLE`; :class:`PeerFailure` otherwise) naming the rank that failed first
-- a dead worker, not the switch or survivor that noticed it. After a failure the fabric is unusable.
gloo errors raised while *posting* a send or receive (a connection already closed) are
:class:`PeerFailure` too, never a raw ``RuntimeError``. On nccl, waits poll ``is_completed()`` under
the same ``timeout_s`` and the failure record, so no wait is unbounded.

Service ranks: a wait with no ``timeout=`` has no deadline; it raises
:class:`~sparsecomm.fabric.sim.ServiceShutdown` once every worker has finished ``fn`` (the launcher
counts finished workers under ``shutdown_key`` in the rendezvous store; services poll it every 50 ms).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import REPORTABLE, FabricTimeout, IncompatibleError, MismatchError, PeerFailure
from .base import Fabric, Work
from .sim import ServiceShutdown
from .stats import CommStats

#: reserved tags (top of the int32 range); transports use smaller non-negative tags
BARRIER_TAG = Fabric.barrier_tag
MAX_TAG = 2**31 - 1

_FOREVER = timedelta(days=365)
_SERVICE_POLL_S = 0.05
_WATCH_S = 0.05            # how often a rank polls the failure record
_ROOT_GRACE_S = 1.0        # how long a rank that lost a connection waits for a failure record naming the root
_TRIP_TAG = MAX_TAG - 7    # the tag of the receive that is timed out on purpose to trip the group
_SEP = "\x1f"


def encode_failure(exc: BaseException | str, rank: int, kind: str | None = None) -> str:
    """The failure record's text: error class name, rank, message (never pickled)."""
    if isinstance(exc, BaseException):
        kind = kind or type(exc).__name__
        text = str(exc).strip() or repr(exc)
    else:
        kind, text = kind or "PeerFailure", str(exc)
    return f"{kind}{_SEP}{int(rank)}{_SEP}{text[:4000]}"


def decode_failure(raw: bytes | str) -> tuple[str, int, str]:
    """``(class name, rank, text)`` of a failure record (plain text; malformed records read as text)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    parts = text.split(_SEP, 2)
    if len(parts) == 3 and parts[1].lstrip("-").isdigit():
        return parts[0], int(parts[1]), parts[2]
    return "PeerFailure", -1, text


def _watch(ref, store, key: str) -> None:
    """The watchdog of one fabric (a weak reference): trip it when another rank reports a failure."""
    import weakref  # noqa: F401 - ref is a weakref.ref

    while True:
        time.sleep(_WATCH_S)
        fab = ref()
        if fab is None or fab._failure is not None or fab._closed:
            return
        try:
            if not store.check([key]):
                del fab
                continue
            raw = store.get(key)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            return
        fab._adopt(raw)
        return


class ServiceNotStarted(IncompatibleError):
    """A transport asked for a service that the launcher did not start as a rank."""


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


class TorchFabric(Fabric):
    """One rank of a torch.distributed job seen as a :class:`Fabric` (see the module docstring).

    ``world_size`` is the number of workers (default: all ranks minus ``len(services)``); ``services``
    lists the service specs of ranks ``world_size, world_size+1, ...`` in order. ``store`` is the
    rendezvous store and ``shutdown_key`` the counter of finished workers that service ranks poll.
    """

    def __init__(self, world_size: int | None = None, services: Sequence[str] = (), *,
                 timeout_s: float = 120.0, store: dist.Store | None = None,
                 shutdown_key: str = "sparsecomm/workers_done", coalesce: bool | None = None,
                 two_way: bool | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchFabric needs an initialised torch.distributed process group "
                               "(use sparsecomm.launch(..., backend='gloo'/'nccl') or torchrun)")
        services = list(services)
        total = dist.get_world_size()
        if world_size is None:
            world_size = total - len(services)
        if world_size < 1 or world_size + len(services) != total:
            raise ValueError(f"{world_size} workers + {len(services)} services != {total} ranks in the "
                             f"process group")
        self.rank = dist.get_rank()
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.backend = str(dist.get_backend())
        self._cuda = self.backend == "nccl"
        self._pg = dist.distributed_c10d._get_default_group()
        self._service_ranks = {spec: world_size + i for i, spec in enumerate(services)}
        self._service_spec = services[self.rank - world_size] if self.rank >= world_size else None
        self._store = store
        self._shutdown_key = shutdown_key
        self._stale: dict[tuple[int | None, int], deque[_Pending]] = {}
        self._coalesce = self._cuda if coalesce is None else bool(coalesce)
        #: messages between two ranks share one ordered channel whatever their tag or direction (nccl):
        #: protocols must not let a pair's sends in one direction wait behind receives posted for later
        self.serial_pairs = self._cuda
        self._deferred: list[_Pending] = []
        self._failure: tuple[str, int, str] | None = None
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._fail_key = shutdown_key + "/failed"
        self.stats = CommStats()
        #: gloo: messages from a lower to a higher rank travel on the default group, the other way on a
        #: second group of the same ranks, so each TCP connection carries data one way only (see
        #: "Two channels per pair" in the module docstring)
        self._pg_down = self._pg
        if two_way is None:
            two_way = not self._coalesce
        if two_way and (self._cuda or self._coalesce):
            raise IncompatibleError("two_way channels are for gloo without coalesce (nccl and coalesced "
                                    "groups issue sends and receives on one group); pass two_way=False")
        if two_way and total > 1:
            self._pg_down = dist.new_group(list(range(total)), timeout=timedelta(seconds=self.timeout_s))
        self.worker_group = (dist.new_group(list(range(world_size)), timeout=timedelta(seconds=self.timeout_s))
                             if services else dist.group.WORLD)
        if store is not None and self.total_ranks > 1:
            import weakref

            self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), store, self._fail_key),
                                              name="sparsecomm-watchdog", daemon=True)
            self._watchdog.start()

    def close(self) -> None:
        """Stop this fabric's watchdog (before the process group is destroyed: a thread still polling
        the store during teardown can abort the process)."""
        self._closed = True
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2 * _WATCH_S + 1.0)

    # --------------------------------------------------------------- failure
    @property
    def failure(self) -> tuple[str, int, str] | None:
        """``(error class name, rank, text)`` of the first failure reported in the job, once known."""
        return self._failure

    def fail(self, exc: BaseException | str, rank: int | None = None) -> None:
        """Report a failure to every rank (see "Failure propagation" in the module docstring): record it
        in the store unless another failure came first, then trip this rank's process group."""
        if self._failure is not None:
            return
        record = encode_failure(exc, self.rank if rank is None else rank)
        if self._store is not None:
            try:
                record = self._store.compare_set(self._fail_key, "", record)
            except Exception:  # noqa: BLE001 - the store is gone; keep the local record
                pass
        self._adopt(record)

    def _adopt(self, raw) -> None:
        """Take ``raw`` as the job's first failure and trip this rank's group (idempotent)."""
        if self._failure is not None:
            return
        self._failure = decode_failure(raw)
        self._trip()

    def _trip(self) -> None:
        """Close every gloo connection of this rank: a receive timed out on purpose does it (gloo closes
        the context's pairs on a timeout), which ends every pending wait here and every peer's wait on
        this rank. nccl waits poll ``_failure`` instead."""
        if self._cuda or self.total_ranks < 2:
            return
        peer = 0 if self.rank != 0 else 1
        groups = [self._pg] + ([self._pg_down] if self._pg_down is not self._pg else [])
        if (self.worker_group is not dist.group.WORLD and self.is_worker and self.world_size > 1
                and isinstance(self.worker_group, dist.ProcessGroup)):
            groups.append(self.worker_group)     # the workers' subgroup (native's all_reduce) too
        for g in groups:
            try:
                g.recv([torch.zeros(1)], peer if g in (self._pg, self._pg_down) else (0 if self.rank != 0 else 1),
                       _TRIP_TAG).wait(timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - expected: the timeout is the point
                pass

    def _failure_error(self) -> BaseException:
        kind, rank, text = self._failure
        cls = REPORTABLE.get(kind, PeerFailure)
        me = self._name(self.rank)
        if rank == self.rank:
            return cls(f"{me}: {text}")
        who = self._name(rank) if rank >= 0 else "a rank"
        if cls is PeerFailure and kind != "PeerFailure":
            err = PeerFailure(f"{me}: stopped because {who} failed first: {kind}: {text}")
        else:
            err = cls(f"{me}: stopped because {who} failed first: {text}")
        err.sparsecomm_origin = rank     # a consequence of another rank's failure (the launcher reads it)
        return err

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise self._failure_error()

    # ----------------------------------------------------------------- props
    @property
    def device(self) -> torch.device:
        if self._cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def total_ranks(self) -> int:
        return self.world_size + len(self._service_ranks)

    def _name(self, r: int | None) -> str:
        if r is None:
            return "any rank"
        if r < self.world_size:
            return f"worker {r}"
        for spec, sr in self._service_ranks.items():
            if sr == r:
                return f"service {spec!r} (rank {r})"
        return f"rank {r}"

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.total_ranks:
            raise ValueError(f"{self._name(self.rank)}: no rank {peer} (the job has {self.total_ranks})")
        if peer == self.rank:
            raise ValueError(f"{self._name(self.rank)}: cannot send to or receive from itself")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tags on TorchFabric must lie in [0, 2**31), got {tag}")

    # --------------------------------------------------------------- sending
    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> _Pending:
        self._check_peer(dst)
        self._check_tag(tag)
        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self._check_failed()
        pend = _Pending(None, t, dst, tag, is_recv=False)
        if self._coalesce:
            self._deferred.append(pend)     # issued at the next wait, in one group
        else:
            try:
                pend.work = (self._pg if dst > self.rank else self._pg_down).send([t], dst, tag)
            except RuntimeError as exc:
                raise self._translate(exc, pend, None) from exc
        self.stats.record_send(self.rank, dst, t.numel() * t.element_size())
        return pend

    def _flush(self) -> None:
        """Issue the deferred sends and receives as one group (``batch_isend_irecv``).

        With nccl, the sends and receives between two ranks share one stream; issued one by one, two
        ranks that both send first would wait for each other forever. With ``coalesce`` every ``isend``
        and ``irecv`` is deferred until something waits, and then issued as one group, which NCCL runs
        concurrently: the ``isend``/``irecv``-then-``wait`` pattern of the ring, the handshake and the
        allgather is then safe on nccl as on gloo.
        """
        pends, self._deferred = self._deferred, []
        if not pends:
            return
        ops = [dist.P2POp(dist.irecv if p.is_recv else dist.isend, p.buf, p.src, tag=p.tag) for p in pends]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise self._translate(exc, pends[0], None) from exc
        if len(works) == len(pends):
            for p, w in zip(pends, works):
                p.work = w
        else:                               # nccl coalesces the group into one work
            for p in pends:
                p.work = works[-1]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        pend = self._post_send(tensor, dst, tag)
        self._flush()
        self._finish(pend, None, None)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> Work:
        return _TorchWork(self, self._post_send(tensor, dst, tag), None)

    # ------------------------------------------------------------- receiving
    def _post_recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> tuple[_Pending, torch.Tensor | None]:
        """Post (or adopt a stale) receive; return it and the tensor to copy into on completion."""
        self._check_tag(tag)
        self._check_failed()
        if src is not None:
            self._check_peer(src)
        elif self._cuda:
            raise IncompatibleError("receive from any source (src=None) is not supported by nccl; "
                                    "name the source, or use the gloo backend")
        elif self.rank == 0 and self._pg_down is not self._pg:
            raise IncompatibleError("with two-way channels (gloo's default here) a receive from any "
                                    "source (src=None) takes messages from lower ranks only, and rank 0 "
                                    "has none; name the source, or build the fabric with two_way=False")
        q = self._stale.get((src, tag))
        if q:
            pend = q[0]
            if pend.buf.numel() != tensor.numel() or pend.buf.dtype != tensor.dtype:
                raise MismatchError(
                    f"{self._name(self.rank)}: a receive from {self._name(src)} (tag {tag}) timed out "
                    f"earlier and stays posted for {pend.buf.numel()} x {pend.buf.dtype}; this receive "
                    f"on the same channel expects {tensor.numel()} x {tensor.dtype}")
            q.popleft()
            return pend, tensor
        if tensor.is_contiguous():
            buf, out = tensor, None
        else:
            buf, out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device), tensor
        pend = _Pending(None, buf, src, tag, is_recv=True)
        if self._coalesce and src is not None:
            self._deferred.append(pend)
        else:
            self._flush()
            try:
                pend.work = ((self._pg if src < self.rank else self._pg_down).recv([buf], src, tag)
                             if src is not None else self._pg.recv_anysource([buf], tag))
            except RuntimeError as exc:
                raise self._translate(exc, pend, None) from exc
        return pend, out

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        pend, out = self._post_recv(tensor, src, tag)
        return self._finish(pend, timeout, out)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        pend, out = self._post_recv(tensor, src, tag)
        return _TorchWork(self, pend, out)

    # ------------------------------------------------------------- completion
    def _finish(self, pend: _Pending, timeout: float | None, out: torch.Tensor | None) -> int | None:
        """Wait for ``pend`` (bounded as the module docstring says); account and copy a receive."""
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        if self._deferred:
            self._flush()
        service = self._service_spec is not None and pend.is_recv
        if timeout is None and not service and not pend.waited:
            self._wait_blocking(pend)
        else:
            limit = timeout if timeout is not None else (None if service else self.timeout_s)
            self._wait_timed(pend, limit, service)
        if not pend.is_recv:
            return None
        with torch.no_grad():
            if out is not None:
                out.copy_(pend.buf.reshape(out.shape))
        source = pend.source if pend.source is not None else pend.src
        self.stats.record_recv(source, self.rank, pend.buf.numel() * pend.buf.element_size())
        return source

    def _wait_blocking(self, pend: _Pending) -> None:
        if self._cuda:             # bounded by timeout_s and the failure record, like every gloo wait
            if not self._poll_cuda(pend, time.monotonic() + self.timeout_s, False):
                raise FabricTimeout(f"{self._name(self.rank)}: no {'message from' if pend.is_recv else 'send to'} "
                                    f"{self._name(pend.src)} (tag {pend.tag}) completed within "
                                    f"{self.timeout_s:.6g} s")
            return
        try:
            pend.work.wait(timedelta(seconds=self.timeout_s))
            if pend.is_recv and pend.src is None:
                pend.source = pend.work._source_rank()
        except RuntimeError as exc:
            raise self._translate(exc, pend, self.timeout_s) from exc

    def _wait_timed(self, pend: _Pending, limit: float | None, stop_on_shutdown: bool) -> None:
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
                if stop_on_shutdown and self._workers_done():
                    raise ServiceShutdown("every worker has finished")
                if stop_on_shutdown and self._failure is not None:
                    raise self._failure_error()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        if not done:
            if pend.is_recv:
                self._stale.setdefault((pend.src, pend.tag), deque()).append(pend)
            what = "message from" if pend.is_recv else "send to"
            raise FabricTimeout(
                f"{self._name(self.rank)}: no {what} {self._name(pend.src)} (tag {pend.tag}) completed "
                f"within {limit:.6g} s" + (" (the receive stays posted and the next receive on this "
                                           "channel adopts it)" if pend.is_recv else ""))
        if pend.error is not None:
            raise self._translate(pend.error, pend, limit) from pend.error

    def _poll_cuda(self, pend: _Pending, deadline: float | None, stop_on_shutdown: bool) -> bool:
        sleep, last_check = 1e-5, time.monotonic()
        while True:
            try:
                if pend.work.is_completed():
                    pend.work.wait()
                    return True
            except RuntimeError as exc:
                raise self._translate(exc, pend, None) from exc
            if self._failure is not None:
                raise self._failure_error()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if stop_on_shutdown and now - last_check >= _SERVICE_POLL_S:
                last_check = now
                if self._workers_done():
                    raise ServiceShutdown("every worker has finished")
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def _workers_done(self) -> bool:
        if self._store is None:
            return False
        try:
            return int(self._store.add(self._shutdown_key, 0)) >= self.world_size
        except RuntimeError:   # the store is gone: the job is over
            return True

    def wait_for_shutdown(self) -> None:
        """On a service rank: block until every worker has finished (the end of the run)."""
        while not self._workers_done():
            if self._store is None:
                return
            time.sleep(_SERVICE_POLL_S)

    def _translate(self, exc: BaseException, pend: _Pending, limit: float | None) -> BaseException:
        msg = str(exc)
        peer = self._name(pend.src)
        last = msg.strip().splitlines()[-1] if msg.strip() else repr(exc)
        if self._failure is not None:        # this rank tripped itself after a failure report
            return self._failure_error()
        if "Timed out" in msg or "timed out" in msg or "Timeout" in msg:
            err = FabricTimeout(f"{self._name(self.rank)}: no "
                                f"{'message from' if pend.is_recv else 'send to'} {peer} (tag {pend.tag}) "
                                f"completed within {limit if limit is not None else self.timeout_s:.6g} s; "
                                f"torch.distributed: {last}")
            self.fail(err)
            return err if self._failure is None or self._failure[1] == self.rank else self._failure_error()
        # a connection closed: a peer died, or tripped after a failure; name the first failure
        raw = self._await_record(_ROOT_GRACE_S)
        if raw is not None:
            self._adopt(raw)
            return self._failure_error()
        self.fail(f"lost the connection with {peer} (tag {pend.tag}): it died or was killed "
                  f"(torch.distributed: {last})", rank=pend.src if pend.src is not None else -1)
        return self._failure_error()

    def _await_record(self, grace: float):
        """The failure record, waiting up to ``grace`` s for one (the launcher writes it when a rank dies)."""
        if self._store is None:
            return None
        deadline = time.monotonic() + grace
        while True:
            try:
                if self._store.check([self._fail_key]):
                    return self._store.get(self._fail_key)
            except Exception:  # noqa: BLE001 - the store is gone
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    # --------------------------------------------------------------- services
    def service(self, name: str, main: Callable[[Fabric], None] | None = None, **link) -> int:
        """The rank of service ``name``; ``main`` and link options only matter on SimFabric.

        ``name`` is the spec given to the launcher (``"switch"``, ``"omnireduce-agg:2"``); a bare name
        also matches a unique ``"name:arg"`` spec.
        """
        if name in self._service_ranks:
            return self._service_ranks[name]
        base = [s for s in self._service_ranks if s.partition(":")[0] == name]
        if len(base) == 1:
            return self._service_ranks[base[0]]
        started = ", ".join(repr(s) for s in self._service_ranks) or "none"
        raise ServiceNotStarted(
            f"service {name!r} is not running: on torch.distributed a service is an extra rank that the "
            f"launcher starts, e.g. sparsecomm.launch(fn, world_size, backend={self.backend!r}, "
            f"services=[{name!r}]) (or torchrun with one more process per service); started: {started}")

    def services(self) -> dict[str, int]:
        return dict(self._service_ranks)
