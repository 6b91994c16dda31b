"""TorchFabric: the :class:`~sparsecomm.fabric.base.Fabric` contract over torch.distributed
point-to-point messages (gloo on CPU, nccl on GPU; multi-node through torchrun).

Ranks ``0 .. world_size-1`` of the default process group are the workers; services (a SwitchML switch,
dedicated OmniReduce aggregators) are the extra ranks ``world_size + i`` that the launcher started for
``services[i]`` (:mod:`sparsecomm.launch.torch_backend`). Every rank, services included, must construct the
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

Timeouts. Every wait is bounded by ``timeout_s`` (past it: :class:`FabricTimeout`) or by ``timeout=``;
a timed-out receive stays posted and the next receive on its channel adopts it
(:mod:`sparsecomm.fabric.torch_waiters` says how and why).

Message length/dtype. torch.distributed cannot check them: gloo silently accepts a shorter message and
aborts the process on a longer one. Transports therefore agree on sizes first
(:mod:`sparsecomm.transports._handshake`); a receive adopting a stale receive of another size raises
:class:`MismatchError`.

Failure propagation (fail-stop): the first failure is recorded once in the rendezvous store and every
rank's group is tripped, so every wait ends at once naming the rank that failed first; see
:mod:`sparsecomm.fabric.torch_failure`.

Service ranks: a wait with no ``timeout=`` has no deadline; it raises
:class:`~sparsecomm.fabric.base.ServiceShutdown` once every worker has finished ``fn`` (the launcher
counts finished workers under ``shutdown_key`` in the rendezvous store; services poll it every 50 ms).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import FabricTimeout, IncompatibleError, InvalidValueError, MismatchError
from .base import Fabric, ServiceNotStarted, ServiceShutdown, Work
from .stats import CommStats
from .torch_failure import MAX_TAG, FailStop, decode_failure, encode_failure  # noqa: F401 (re-exported)
from .torch_waiters import DirectWait, _Pending, _TorchWork, gloo_wait, wait_any_blocking, waits_ended

__all__ = ["TorchFabric", "ServiceNotStarted", "ServiceShutdown", "encode_failure", "decode_failure"]

#: reserved tags (top of the int32 range); transports use smaller non-negative tags
BARRIER_TAG = Fabric.barrier_tag

_SERVICE_POLL_S = 0.05


class TorchFabric(FailStop, DirectWait, Fabric):
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
            raise InvalidValueError(f"{world_size} workers + {len(services)} services != {total} ranks in the "
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
        self._probes: list = []            # receives posted to find closed connections (torch_failure)
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
            self._start_watchdog(store)

    # ----------------------------------------------------------------- props
    native_group = property(lambda self: self.worker_group, doc="The workers' group (for collectives).")

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
            raise InvalidValueError(f"{self._name(self.rank)}: no rank {peer} (the job has {self.total_ranks})")
        if peer == self.rank:
            raise InvalidValueError(f"{self._name(self.rank)}: cannot send to or receive from itself")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise InvalidValueError(f"tags on TorchFabric must lie in [0, 2**31), got {tag}")

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

    def wait_any(self, works) -> int:   # gloo: blocks until a helper thread reports a completion
        return super().wait_any(works) if self._cuda or not works else wait_any_blocking(self, works)

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
            raise InvalidValueError("timeout must be non-negative")
        if self._deferred:
            self._flush()
        service = self._service_spec is not None and pend.is_recv
        if timeout is None and not service and not pend.waited:
            self._wait_blocking(pend)
        else:
            limit = timeout if timeout is not None else (None if service else self.timeout_s)
            self._wait_timed(pend, limit, service)
        return self._account(pend, out)

    def _wait_blocking(self, pend: _Pending) -> None:
        if self._cuda:             # bounded by timeout_s and the failure record, like every gloo wait
            if not self._poll_cuda(pend, time.monotonic() + self.timeout_s, False):
                raise FabricTimeout(f"{self._name(self.rank)}: no {'message from' if pend.is_recv else 'send to'} "
                                    f"{self._name(pend.src)} (tag {pend.tag}) completed within "
                                    f"{self.timeout_s:.6g} s")
            return
        try:
            with gloo_wait():
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

    def wait_for_shutdown(self, stop: Callable[[], bool] | None = None) -> bool:
        """On a service rank: wait for every worker to finish (True) or for ``stop()`` (False)."""
        while not self._workers_done():
            if stop() if stop is not None else self._store is None:    # no store: no end to see
                return False
            time.sleep(_SERVICE_POLL_S)
        return True

    def release(self, grace_s: float = 5.0) -> bool:
        """End the run on this rank after its last collective, before its process group is destroyed
        (the launcher calls it on every rank of a group it owns; :meth:`close` first). Once every rank has
        got here (a counter in the store: no rank may still be inside the last collective), close this
        rank's connections (the failure trip, without a failure), which ends every wait still posted on
        them -- a service's receives from workers that have finished, a stale receive's helper thread --
        and wait up to ``grace_s`` until no thread of this process is inside a gloo wait (True then).
        A thread left blocked in one is woken when a peer's process exits; if this interpreter is then
        finalizing, the thread is killed inside C++ code and the process aborts (SIGABRT)."""
        if self._cuda or self.total_ranks < 2:
            return True
        key = self._shutdown_key + "/released"
        deadline = time.monotonic() + self.timeout_s
        try:
            self._store.add(key, 1)
            while int(self._store.add(key, 0)) < self.total_ranks and time.monotonic() < deadline:
                time.sleep(0.005)
        except Exception:  # noqa: BLE001 - the store's host has left, which it does only once all arrived
            pass
        self._trip()
        return waits_ended(grace_s)

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
