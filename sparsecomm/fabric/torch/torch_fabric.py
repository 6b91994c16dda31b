"""TorchFabric: the :class:`~sparsecomm.fabric.base.Fabric` contract over torch.distributed
point-to-point messages (gloo on CPU, nccl on GPU; multi-node through torchrun).

Ranks ``0 .. world_size-1`` of the default process group are the workers; services (a SwitchML switch,
dedicated OmniReduce aggregators) are the extra ranks ``world_size + i`` that the launcher started for
``services[i]`` (:mod:`sparsecomm.launch.torch_backend`; :mod:`.torch_ranks` names them). Every rank,
services included, must construct the fabric (it creates the workers' subgroup, a collective call).

Over a process group (``group=pg``, e.g. one data-parallel group of a job that also has tensor- or
pipeline-parallel groups): the workers are ``pg``'s members, worker ``i`` being the member of rank ``i``
in ``pg`` (job rank ``dist.get_global_rank(pg, i)``; errors name both, "worker 1 (job rank 3)"), and
every send, receive and collective runs on ``pg`` itself (``ProcessGroup.send/recv`` take ranks in
their group; a batch names ``group_peer``). So fabrics over different groups of one job never share a
channel: their messages cannot meet whatever their tags, and each group's fail-stop trips only its own
connections and keeps its store keys under ``sparsecomm/group/<job ranks>/`` (with a store). Only
``pg``'s members construct it (no collective call: it creates no group); a rank outside ``pg``
gets :class:`InvalidValueError`. Such a fabric has no services (they are ranks of the whole job that
the launcher starts for all its workers, not for one group): :meth:`~TorchFabric.service` raises
:class:`ServiceNotStarted` naming the transports that run over a group (ring, omnireduce with its
aggregators sharded over the workers, native, allgather); and one channel per pair (``two_way=False``:
a second group of the same ranks would have to be created by every rank of the job).

What maps to what:

- ``send``/``isend``/``recv``/``irecv`` are ``ProcessGroup.send/recv/recvAnysource`` on the default group
  (on ``pg`` over a process group), with the tag (tags must lie in ``[0, 2**31)``; torch rejects
  negative tags). Messages of one (src, dst, tag) arrive in order. Tensors stay on their device:
  nothing here copies to the host, so a CUDA tensor travels over nccl.
- Two channels per pair (gloo, ``two_way=True``, the default without ``coalesce`` or ``group``): a
  message from a lower to a higher rank travels on the default group, one from a higher to a lower rank
  on a second group of the same ranks, so each TCP connection carries data in one direction only. gloo sends a
  message only after the receiver's "receive posted" notice arrives, and a pair queues that notice
  behind whatever data it is already writing; on one connection per pair, a receive posted while the
  rank sends a large message to the same peer therefore waits for that whole message, and an exchange
  of two messages would take the time of both in sequence instead of one (BENCHMARKS.md, "Transports on
  the netbed"). Consequence for ``src=None``: it receives messages
  from *lower* ranks only (services, the library's only any-source receivers, have the highest ranks);
  rank 0 asking for it raises :class:`IncompatibleError`; ``two_way=False`` restores one group.
- Express tags (:func:`~sparsecomm.fabric.base.express`): with two channels per pair, a worker's express message to
  another worker travels on the pair's *other* connection, the one whose direction carries only "receive posted"
  notices (a lower rank's on the second group, a higher rank's on the default one), so that a protocol's verdict
  is not written behind the megabytes its sender is already streaming to the same peer (OmniReduce's round-0
  verdict waited 13-20 ms there on 2 netbed hosts at 1 Gbit/s). Its own notice then travels on the receiver's
  data direction: a protocol posts an express receive before it sends that peer its data. Messages to or from
  services, and fabrics with one channel per pair, use the one channel as for any tag.
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
a timed-out receive stays posted and the next receive on its channel adopts it (the fabric's
:class:`~.torch_waiters.Waits`; :mod:`.torch_waiters` says how and why).

Message length/dtype. torch.distributed cannot check them: gloo silently accepts a shorter message and
aborts the process on a longer one. Transports therefore agree on sizes first
(:mod:`sparsecomm.transports._handshake`); a receive adopting a stale receive of another size raises
:class:`MismatchError`.

Lanes. :meth:`TorchFabric.lane` builds another fabric of the same workers on process groups of its own
(``down_group=`` carries its second direction), so that calls in flight together on the two never share a gloo
connection (the DDP hook's buckets: :mod:`sparsecomm.pipeline.lanes`); it shares this fabric's failure record and
is closed and released with it.

Failure propagation (fail-stop): the first failure is recorded once in the rendezvous store and every
rank's group is tripped, so every wait ends at once naming the rank that failed first; the fabric's
:class:`~.torch_failure.FailStop` does it (:mod:`.torch_failure`).

Service ranks: a wait with no ``timeout=`` has no deadline; it raises
:class:`~sparsecomm.errors.ServiceShutdown` once every worker has finished ``fn`` (the launcher
counts finished workers under ``shutdown_key`` in the rendezvous store; services poll it every 50 ms).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ...errors import IncompatibleError, InvalidValueError, ServiceNotStarted
from .. import trace as _trace
from ..base import Fabric, Work, check_any_source, is_express
from ..stats import CommStats
from .torch_failure import MAX_TAG, FailStop
from .torch_ranks import JobRanks
from .torch_waiters import WATCHED_SEND_BYTES, Pending, Waits, waits_ended
from ...validate import check_real

__all__ = ["TorchFabric"]

#: the bound of every wait when no ``timeout_s`` is given (the launcher's default too)
DEFAULT_TIMEOUT_S = 120.0


def _members(group, services: Sequence[str]) -> list[int]:
    """The job ranks of ``group``'s members, in the order of their ranks in it; a group this rank is not
    a member of, or services beside a group, are refused."""
    me = dist.get_rank()
    if not isinstance(group, dist.ProcessGroup) or dist.get_rank(group) < 0:
        which = (f" (job ranks {dist.get_process_group_ranks(group)})"
                 if isinstance(group, dist.ProcessGroup) else "")
        raise InvalidValueError(
            f"job rank {me} is not a member of the process group it was given{which}: every rank builds "
            f"the fabric (the DistributedOptimizer, the DDP hook) over the group it belongs to, its own "
            f"data-parallel group (torch.distributed.new_group returns a placeholder, not a group, on the "
            f"ranks it does not list)")
    if services:
        raise IncompatibleError("a fabric over a process group has no service ranks: services are ranks of "
                                "the whole job (sparsecomm.launch(..., services=[...]) with group=None)")
    return dist.get_process_group_ranks(group)


class TorchFabric(Fabric):
    """One rank of a torch.distributed job seen as a :class:`Fabric` (see the module docstring).

    ``world_size`` is the number of workers (default: all ranks minus ``len(services)``); ``services``
    lists the service specs of ranks ``world_size, world_size+1, ...`` in order. ``group``: a
    torch.distributed process group whose members are the workers, numbered by their rank in it (no
    services; see "Over a process group" in the module docstring); ``None`` or the default group: the
    whole job. ``store`` is the rendezvous store and ``shutdown_key`` the counter of finished workers
    that service ranks poll (default ``sparsecomm/workers_done``, over a group
    ``sparsecomm/group/<job ranks>/workers_done``; the failure record is ``<shutdown_key>/failed``).
    It owns the job's fail-stop propagation for this rank (a :class:`~.torch_failure.FailStop`) and the
    waits for its posted operations (a :class:`~.torch_waiters.Waits`).

    Args:
        world_size: the number of workers (default: all ranks minus ``len(services)``).
        services: the service specs of the ranks after the workers, in order (``"switch"``,
            ``"omnireduce-agg:0"``).
        timeout_s: bound of every wait, seconds (``FabricTimeout``).
        store: the rendezvous store (fail-stop records, the shutdown counter).
        shutdown_key: the store counter of finished workers that service ranks poll.
        coalesce: defer ``isend``/``irecv`` to one batched call (default: on for nccl).
        two_way: one process group per direction of a pair (default on gloo without ``coalesce``; module doc).
        down_group: with ``group``, the group of the same ranks that carries the messages from a higher
            to a lower rank (two channels per pair over a group), which every rank created in the same
            order (:meth:`lane` builds one); ``None``: one channel per pair over a group.
    """

    direct_waits = True   # the capability (:mod:`sparsecomm.fabric.base`): :meth:`wait_unbounded`

    def __init__(self, world_size: int | None = None, services: Sequence[str] = (), *,
                 group: dist.ProcessGroup | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 store: dist.Store | None = None, shutdown_key: str | None = None,
                 coalesce: bool | None = None, two_way: bool | None = None,
                 down_group: dist.ProcessGroup | None = None) -> None:
        timeout_s = check_real("timeout_s", timeout_s, low=0.0, low_open=True, what="TorchFabric")
        if not dist.is_initialized():
            raise RuntimeError("TorchFabric needs an initialised torch.distributed process group "
                               "(use sparsecomm.launch(..., backend='gloo'/'nccl') or torchrun)")
        services = list(services)
        if group is dist.group.WORLD:
            group = None
        members = None if group is None else _members(group, services)
        total = dist.get_world_size() if group is None else len(members)
        if world_size is None:
            world_size = total - len(services)
        if world_size < 1 or world_size + len(services) != total:
            raise InvalidValueError(f"{world_size} workers + {len(services)} services != {total} ranks in the "
                             f"process group")
        self.rank = dist.get_rank(group)
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = str(dist.get_backend(group))
        self._cuda = self.backend == "nccl"
        self._pg = dist.group.WORLD if group is None else group
        self._ranks = JobRanks(world_size, services, members)
        self._total = self._ranks.total     # (:attr:`total_ranks`, read per message)
        self._store = store
        if shutdown_key is None:
            shutdown_key = ("sparsecomm/workers_done" if members is None else
                            "sparsecomm/group/" + "-".join(map(str, members)) + "/workers_done")
        self._shutdown_key = shutdown_key
        self._coalesce = self._cuda if coalesce is None else bool(coalesce)
        #: messages between two ranks share one ordered channel whatever their tag or direction (nccl):
        #: protocols must not let a pair's sends in one direction wait behind receives posted for later
        self.serial_pairs = self._cuda
        self._deferred: list[Pending] = []
        self._any_since: tuple[int, float] | None = None    # (thread, when) a recorded wait_any began: _finish
        self.stats = CommStats()
        #: gloo: messages from a lower to a higher rank travel on the default group, the other way on a
        #: second group of the same ranks, so each TCP connection carries data one way only (see
        #: "Two channels per pair" in the module docstring)
        self._pg_down = self._pg
        if down_group is not None:
            if group is None or self._cuda or self._coalesce or two_way is False:
                raise IncompatibleError("down_group is the second channel of a fabric over a process group "
                                        "on gloo without coalesce (two_way): pass group= too, or no down_group")
            two_way = None
            self._pg_down = down_group
        if two_way is None:
            two_way = not self._coalesce and group is None
        if two_way and (self._cuda or self._coalesce):
            raise IncompatibleError("two_way channels are for gloo without coalesce (nccl and coalesced "
                                    "groups issue sends and receives on one group); pass two_way=False")
        if two_way and group is not None:
            raise IncompatibleError("two_way channels need a second group of the same ranks, which every rank "
                                    "of the job would have to create; over a process group the fabric uses "
                                    "one channel per pair: pass two_way=False (or leave it unset)")
        if two_way and total > 1:
            self._pg_down = dist.new_group(list(range(total)), timeout=timedelta(seconds=self.timeout_s))
        #: a worker's express messages to and from workers travel on the pair's other connection (module
        #: docstring, "Express tags"): only with two channels per pair
        self._express = self._pg_down is not self._pg and self.rank < world_size
        if group is not None:
            self.worker_group = group
        else:
            self.worker_group = (dist.new_group(list(range(world_size)),
                                                timeout=timedelta(seconds=self.timeout_s))
                                 if services else dist.group.WORLD)
        #: fabrics over fresh groups of the same ranks that share this one's failure record (:meth:`lane`)
        self._lanes: list[TorchFabric] = []
        # a trip closes every gloo group of this rank: both directions' and the workers' subgroup (native's)
        trips = [(self._pg, self.rank, total)]
        if self._pg_down is not self._pg:
            trips.append((self._pg_down, self.rank, total))
        if (self.worker_group is not self._pg and self.is_worker and world_size > 1
                and isinstance(self.worker_group, dist.ProcessGroup)):
            trips.append((self.worker_group, self.rank, world_size))
        self._failstop = FailStop(self.rank, self._ranks, store=store, key=shutdown_key + "/failed",
                                  timeout_s=self.timeout_s, cuda=self._cuda, trips=trips, probes=self._pg)
        self._waits = Waits(self.rank, self._ranks, self._failstop, service=not self.is_worker,
                            cuda=self._cuda, timeout_s=self.timeout_s, store=store, shutdown_key=shutdown_key)

    # ----------------------------------------------------------------- props
    native_group = property(lambda self: self.worker_group, doc="The workers' group (for collectives).")

    @property
    def device(self) -> torch.device:
        if self._cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def total_ranks(self) -> int:
        """Workers plus service ranks: the size of the process group."""
        return self._ranks.total

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._total or peer == self.rank:      # (the names only for the error)
            me = self._ranks.name(self.rank)
            if peer == self.rank:
                raise InvalidValueError(f"{me}: cannot send to or receive from itself")
            raise InvalidValueError(f"{me}: no rank {peer} (the job has {self.total_ranks})")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise InvalidValueError(f"tags on TorchFabric must lie in [0, 2**31), got {tag}")

    # -------------------------------------------------------------- failures
    @property
    def failure(self) -> tuple[str, int, str] | None:
        """``(error class name, rank, text)`` of the first failure reported in the job, once known."""
        return self._failstop.failure

    def fail(self, exc: BaseException | str, rank: int | None = None) -> None:
        """Report a failure to every rank (:meth:`FailStop.fail <.torch_failure.FailStop.fail>`): every
        wait of the job ends at once, naming the rank that failed first.

        Args:
            exc: the failure (an exception or its text).
            rank: the rank it is blamed on (default: this one).
        """
        self._failstop.fail(exc, rank)

    def collective_error(self, exc: BaseException, what: str) -> BaseException:
        """The library's error for the torch.distributed collective ``what`` (on any group of this job)
        having raised ``exc`` (:meth:`FailStop.collective_error <.torch_failure.FailStop.collective_error>`:
        the job's recorded failure, a timeout, or a lost connection naming the rank that failed first),
        reported to every rank."""
        return self._failstop.collective_error(exc, what)

    def close(self) -> None:
        """Stop this fabric's watchdog, and its lanes' (:meth:`lane`), before the process group is destroyed
        (a thread still polling the store during teardown can abort the process)."""
        for lane in self._lanes:
            lane.close()
        self._failstop.close()

    def lane_refusal(self) -> str | None:
        """Why this fabric cannot build a :meth:`lane` (the same answer on every rank), or None when it can."""
        if self._store is None:
            return ("the fabric has no rendezvous store, in which its lanes would share the job's failure record "
                    "(build it with TorchFabric(store=...), as sparsecomm.launch does)")
        if self._ranks.job_ranks is not None:
            return ("the fabric runs over a process group: a lane's groups would have to be created by every "
                    "rank of the job")
        if self._ranks.services:
            return "the job has service ranks, which a lane's transports would have to reach"
        if self._cuda or self._coalesce:
            return "lanes are for gloo without coalesce"
        if self.world_size < 2:
            return "a single worker has nothing to communicate"
        return None

    def lane(self, index: int) -> "TorchFabric":
        """Lane ``index`` (1, 2, ...) of this fabric: another fabric of the same workers on process groups of its
        own (one per direction of a pair, as ``two_way``), so that its messages never queue behind this fabric's
        on a gloo connection, for calls in flight together (the DDP hook's buckets: :mod:`sparsecomm.pipeline.lanes`).
        Built on first request, a collective (every rank at the same point: it creates the groups), lanes in
        order (``index`` at most one more than the lanes built so far); then the same fabric for every caller:
        every pipeline that asks for lane ``index`` shares it, as pipelines share this fabric (its calls run one
        at a time on its communication thread), so building hooks again and again in one process holds as many
        lanes as the most that one of them asked for. The lane shares this fabric's failure record (the store key
        ``<shutdown_key>/failed``), so a failure on either trips both (each one's watchdog reads the record), is
        closed by :meth:`close` and its connections closed by :meth:`release` with this fabric's.
        :class:`IncompatibleError` with the reason when :meth:`lane_refusal` has one.

        Args:
            index: the lane's number, from 1 (lane 0 is this fabric).
        """
        why = self.lane_refusal()
        if why is not None:
            raise IncompatibleError(f"TorchFabric.lane: {why}; use one lane")
        built = len(self._lanes)
        if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index <= built + 1:
            raise InvalidValueError(f"TorchFabric.lane: index must be an int from 1 to {built + 1} (lanes are "
                                    f"built in order; {built} built so far), got {index!r}")
        if index <= built:
            return self._lanes[index - 1]
        ranks = list(range(self.total_ranks))
        bound = timedelta(seconds=self.timeout_s)
        up = dist.new_group(ranks, timeout=bound)
        down = dist.new_group(ranks, timeout=bound)
        lane = TorchFabric(self.world_size, group=up, down_group=down, timeout_s=self.timeout_s,
                           store=self._store, shutdown_key=self._shutdown_key)
        self._lanes.append(lane)
        return lane

    def _group(self, up: bool, peer: int, tag: int):
        """The process group of a message to or from ``peer`` on ``tag`` whose data flows from the lower rank to the
        higher (``up``): the default group, else the second one (the same one where there is one channel per pair);
        an express message between workers takes the other (module docstring, "Express tags")."""
        if self._express and peer < self.world_size and is_express(tag):
            up = not up
        return self._pg if up else self._pg_down

    # --------------------------------------------------------------- sending
    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        if not 0 <= dst < self._total or dst == self.rank:     # (the checks inline: once per message)
            self._check_peer(dst)
        if not 0 <= tag <= MAX_TAG:
            self._check_tag(tag)
        t = tensor.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self._failstop.check()
        rec = _trace.recorder
        t_post = time.perf_counter() if rec is not None else 0.0      # before the bytes may leave
        pend = Pending(None, t, dst, tag, False)
        if self._coalesce:
            self._deferred.append(pend)     # issued at the next wait, in one group
        else:
            try:
                pend.work = self._group(dst > self.rank, dst, tag).send([t], dst, tag)
            except RuntimeError as exc:
                raise self._waits.error(exc, pend) from exc
            if t.nbytes >= WATCHED_SEND_BYTES and not self._cuda:
                # a helper thread waits for it in any case (:meth:`Waits.wait`): from now on, so that by
                # the caller's wait it has mostly seen it end (no hand-off to wait for then)
                pend.start_waiter()
        nbytes = t.nbytes
        self.stats.record_send(self.rank, dst, nbytes)
        if rec is not None:
            pend.trace = (rec, rec.sent(self, dst, tag, nbytes, t_post))
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
        ops = [dist.P2POp(dist.irecv if p.is_recv else dist.isend, p.buf, group=self._pg, tag=p.tag,
                          group_peer=p.src) for p in pends]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise self._waits.error(exc, pends[0]) from exc
        if len(works) == len(pends):
            for p, w in zip(pends, works):
                p.work = w
        else:                               # nccl coalesces the group into one work
            for p in pends:
                p.work = works[-1]

    def wait_any(self, works) -> int:   # gloo: blocks until a helper thread reports a completion
        if self._cuda or not works:
            return super().wait_any(works)
        if _trace.recorder is None:
            return self._waits.any(works)
        # recorded: the receive that ends the wait is booked as waited for since the wait began (its
        # ``_finish`` runs inside ``any``, on this thread), not from when it was taken; the others of its
        # group, complete by then, are not waited for
        self._any_since = (threading.get_ident(), time.perf_counter())
        try:
            return self._waits.any(works)
        finally:
            self._any_since = None

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        pend = self._post_send(tensor, dst, tag)
        self._flush()
        self._finish(pend, None, None)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True,
              stable: bool = False) -> Work:
        # (``stable`` changes nothing here: torch's send reads the caller's tensor until it completes, no copy)
        return TorchWork(self, self._post_send(tensor, dst, tag), None)

    # ------------------------------------------------------------- receiving
    def _post_recv(self, tensor: torch.Tensor, src: int | None,
                   tag: int) -> tuple[Pending, torch.Tensor | None]:
        """Post (or adopt a stale) receive; return it and the tensor to copy into on completion."""
        if not 0 <= tag <= MAX_TAG:
            self._check_tag(tag)
        self._failstop.check()
        if src is not None:
            if not 0 <= src < self._total or src == self.rank:
                self._check_peer(src)
        else:
            check_any_source(tag)
            if self._cuda:
                raise IncompatibleError("receive from any source (src=None) is not supported by nccl; "
                                        "name the source, or use the gloo backend")
            if self.rank == 0 and self._pg_down is not self._pg:
                raise IncompatibleError("with two-way channels (gloo's default here) a receive from any "
                                        "source (src=None) takes messages from lower ranks only, and rank 0 "
                                        "has none; name the source, or build the fabric with two_way=False")
        if self._waits.stale:
            pend = self._waits.adopt(src, tag, tensor)
            if pend is not None:
                return pend, tensor
        if tensor.is_contiguous():
            buf, out = tensor, None
        else:
            buf, out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device), tensor
        pend = Pending(None, buf, src, tag, True)
        if self._coalesce and src is not None:
            self._deferred.append(pend)
        else:
            self._flush()
            try:
                pend.work = (self._group(src < self.rank, src, tag).recv([buf], src, tag) if src is not None
                             else self._pg.recv_anysource([buf], tag))
            except RuntimeError as exc:
                raise self._waits.error(exc, pend) from exc
        return pend, out

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        pend, out = self._post_recv(tensor, src, tag)
        return self._finish(pend, timeout, out)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        pend, out = self._post_recv(tensor, src, tag)
        return TorchWork(self, pend, out)

    # ------------------------------------------------------------- completion
    def _finish(self, pend: Pending, timeout: float | None, out: torch.Tensor | None) -> int | None:
        """Wait for ``pend`` (bounded as the module docstring says); account and copy a receive."""
        if timeout is not None and timeout < 0:
            raise InvalidValueError("timeout must be non-negative")
        if self._deferred:
            self._flush()
        t_wait = 0.0
        if _trace.recorder is not None:
            since = self._any_since
            if since is not None and pend.is_recv and since[0] == threading.get_ident():
                t_wait, self._any_since = since[1], None        # (the first receive a wait_any ends: wait_any)
            else:
                t_wait = time.perf_counter()
        self._waits.wait(pend, timeout)
        return self._account(pend, out, t_wait)

    def _account(self, pend: Pending, out: torch.Tensor | None, t_wait: float = 0.0) -> int | None:
        """A completed operation: for a receive, copy it out (into ``out``), count it, return its source;
        on the active timeline (:mod:`sparsecomm.fabric.trace`), the send's end, or the receive waited for
        since ``t_wait``."""
        if not pend.is_recv:
            if pend.trace is not None:
                rec, ev = pend.trace
                rec.done(ev)
                pend.trace = None
            return None
        if out is not None:
            with torch.no_grad():
                out.copy_(pend.buf.reshape(out.shape))
        source = pend.source if pend.source is not None else pend.src
        nbytes = pend.buf.nbytes
        self.stats.record_recv(source, self.rank, nbytes)
        if _trace.recorder is not None:
            _trace.recorder.received(self, source, pend.tag, nbytes, t_wait)
        return source

    def wait_unbounded(self, work: Work) -> int | None:
        """Wait for ``work`` (posted by this fabric) on the calling thread itself, with no deadline and no
        helper thread; for a receive, return its source. For a service's own receive threads: a
        service's wait (``work.wait()``) is otherwise done by a helper thread, which the caller polls
        for the end of the run, one more thread hand-off per message. Here the end of the run is not
        seen (the service watches it on another thread: :meth:`wait_for_shutdown` with ``stop``); a
        failure is (the tripped group ends the wait with the failure's error). Once the fabric is
        closed, a wait that ends with an error raises :class:`~sparsecomm.errors.ServiceShutdown` (the
        run is over)."""
        if not isinstance(work, TorchWork) or work._fabric is not self:
            raise InvalidValueError("wait_unbounded takes a Work posted by this fabric")
        if work._finished:
            return work._result
        if self._deferred:
            self._flush()
        t_wait = time.perf_counter() if _trace.recorder is not None else 0.0
        self._waits.unbounded(work._pend)
        work._result = self._account(work._pend, work._out, t_wait)
        work._finished = True
        return work._result

    def wait_for_shutdown(self, stop: Callable[[], bool] | None = None) -> bool:
        """On a service rank: wait for every worker to finish (True) or for ``stop()`` (False)."""
        return self._waits.wait_for_shutdown(stop)

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
        self._failstop.trip()
        for lane in self._lanes:
            lane._failstop.trip()
        return waits_ended(grace_s)

    # --------------------------------------------------------------- services
    def service(self, name: str, main: Callable[[Fabric], None] | None = None, **link) -> int:
        """The rank of service ``name``; ``main`` and link options only matter on SimFabric.

        ``name`` is the spec given to the launcher (``"switch"``, ``"omnireduce-agg:2"``); a bare name
        also matches a unique ``"name:arg"`` spec.
        """
        ranks = self._ranks.services
        if self._ranks.job_ranks is not None:
            raise ServiceNotStarted(
                f"service {name!r} is not available over a process group (job ranks "
                f"{self._ranks.job_ranks}): a service is an extra rank of the whole job that the launcher "
                f"starts for the job's workers, not for one group of them. Over a process group use a "
                f"transport without services: 'ring', 'omnireduce' (its aggregators sharded over the "
                f"workers, the default), 'native' or 'allgather'; or run {name!r} over the whole job "
                f"(sparsecomm.launch(fn, world_size, backend={self.backend!r}, services=[{name!r}]), "
                f"process_group=None)")
        if name in ranks:
            return ranks[name]
        base = [s for s in ranks if s.partition(":")[0] == name]
        if len(base) == 1:
            return ranks[base[0]]
        started = ", ".join(repr(s) for s in ranks) or "none"
        raise ServiceNotStarted(
            f"service {name!r} is not running: on torch.distributed a service is an extra rank that the "
            f"launcher starts, e.g. sparsecomm.launch(fn, world_size, backend={self.backend!r}, "
            f"services=[{name!r}]) (or torchrun with one more process per service); started: {started}")

    def services(self) -> dict[str, int]:
        return dict(self._ranks.services)


class TorchWork(Work):
    """The handle of an operation a :class:`TorchFabric` posted (:meth:`~TorchFabric.isend`,
    :meth:`~TorchFabric.irecv`): ``wait`` completes it (once), ``is_completed`` asks without blocking."""

    def __init__(self, fabric: TorchFabric, pend: Pending, out: torch.Tensor | None) -> None:
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
        pend = self._pend
        if pend.ended:              # (a helper thread has seen it end: the common look, no call)
            return True
        fabric = self._fabric
        if fabric._deferred:
            fabric._flush()
        if fabric._cuda:
            return bool(pend.work.is_completed())
        if pend.done is None:
            pend.start_waiter()     # gloo reports completion only through wait()
        return pend.ended
