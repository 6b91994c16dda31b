"""Lanes: the DDP hook's buckets in flight together, each lane a fabric of its own (:class:`Lanes`), and the
order in which their calls' outcomes are decided (:class:`CallOrder`).

**Why.** A fabric runs its calls one at a time on its one communication thread
(:mod:`sparsecomm.fabric.engine`), over one gloo connection per pair and direction: under the DDP hook a
small bucket's call waits behind a large one's, its messages queued behind the large one's on the same
connections. With ``L`` lanes, bucket ``k`` (DDP's index) runs on lane ``k mod L``: lane 0 is the hook's
fabric, lane ``i > 0`` a :meth:`TorchFabric.lane <sparsecomm.fabric.torch.torch_fabric.TorchFabric.lane>`
of it (process groups of its own, its own communication thread and its own transport instance, built with
the same name and options), so the lanes' calls overlap on the wire and on the CPU. Each lane's calls keep
the call order among themselves on every worker, so each lane's messages match as one fabric's do; the
sums, the method states and the byte counts are those of one lane (every call is the same call on the
same numbers; a call's ``last_stats`` is its own lane transport's, read on that lane's thread).

**Where.** Only where it pays and is safe: a real fabric with lanes (:meth:`~sparsecomm.fabric.torch.
torch_fabric.TorchFabric.lane_refusal` says why not: no shared failure record, a process group, service
ranks, nccl), the transports without services that run on the communication thread (``ring``,
``omnireduce`` with its aggregators sharded over the workers, ``allgather``). ``native`` posts its
collectives from the calling thread already (gloo runs them on its own threads); the switches have a
service rank, which a lane's transport would have to reach on groups the service does not serve, so they
keep one lane; ``transport="auto"`` chooses per bucket and keeps one lane too. Where the hook runs a step's
buckets as one call (plain averaging by default: :func:`~sparsecomm.pipeline.scheduler.resolve_fuse`) there is
nothing to overlap, and the default rule gives one lane.

**Errors** (:class:`CallOrder`). The outcome of every call is decided in *call order*, across the lanes:
a call that fails (other than :class:`~sparsecomm.errors.NonFiniteError`, which every worker raises
after the same sum, so the streams stay in step) fails every later call on every lane with its error,
whatever the lanes' timing, so every worker reports the same error for the same calls; a call's work
completes only once every earlier call's outcome is known (DDP waits for every bucket anyway). Each lane
keeps running the calls queued on it until its own engine fails, as every worker does alike, so no lane's
stream of messages gets out of step on one worker only. A failure that stops the job (a dead peer, a
timeout, a malformed message: the fabric's fail-stop) is in the failure record every lane watches; the
lane that saw it also reports it to the other lanes at once (``fail``), so every wait on every lane ends
with the error naming the rank that failed first, never at the timeout.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import IncompatibleError, InvalidValueError, NonFiniteError
from ..fabric.engine import CommWork

#: the transports that run on lanes (without services, run on the communication thread)
LANE_TRANSPORTS = ("ring", "omnireduce", "allgather")
#: lanes of the default rule where lanes pay
DEFAULT_LANES = 2


class CallOrder:
    """The outcomes of calls started on several lanes, decided in call order (see the module doc):
    :meth:`add` takes each call's work in the order the calls are made and returns the work the caller
    waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued = 0                      # calls added
        self._decided = 0                     # calls whose outcome is decided (a prefix of them)
        self._outers: dict[int, CommWork] = {}
        self._held: dict[int, tuple[Any, BaseException | None]] = {}
        #: the first failure in call order (NonFiniteError aside), once decided
        self.failed: BaseException | None = None

    def add(self, work: CommWork) -> CommWork:
        """The work of the next call in call order: it completes with ``work``'s outcome once every earlier
        call's is decided, or fails with the first earlier call's error."""
        outer = CommWork()
        with self._lock:
            seq = self._issued
            self._issued += 1
            self._outers[seq] = outer
        work.add_done_callback(lambda w: self._done(seq, w))
        return outer

    def _done(self, seq: int, work: CommWork) -> None:
        exc = work.exception()
        value = None if exc is not None else work.wait()
        ready = []
        with self._lock:
            self._held[seq] = (value, exc)
            while self._decided in self._held:
                s = self._decided
                value, exc = self._held.pop(s)
                if self.failed is not None:
                    value, exc = None, self.failed
                elif exc is not None and not isinstance(exc, NonFiniteError):
                    self.failed = exc
                ready.append((self._outers.pop(s), value, exc))
                self._decided += 1
        for outer, value, exc in ready:
            outer.complete(value, exc)


class Lanes:
    """``count`` lanes of one pipeline (see the module doc): lane 0 is the pipeline's own fabric and
    transport, lane ``i`` the fabric's ``fabric.lane(i)`` (shared with every pipeline that asks for it) with the
    pipeline's transport built on it
    (:meth:`CommPipeline.add_lane <sparsecomm.pipeline.core.CommPipeline.add_lane>`). Building them is a
    collective (the lanes' process groups, the first time): every worker at the same point, with the same
    ``count``."""

    def __init__(self, pipeline: Any, count: int) -> None:
        self.count = int(count)
        self.fabrics = [pipeline.fabric]
        for i in range(1, self.count):
            fabric = pipeline.fabric.lane(i)
            pipeline.add_lane(fabric)
            self.fabrics.append(fabric)
        self.order = CallOrder()

    def of(self, index: int) -> int:
        """The lane of DDP's bucket ``index``."""
        return index % self.count

    def ordered(self, work: CommWork, lane: int) -> CommWork:
        """The work the caller waits for, for a call started on ``lane`` (:class:`CallOrder`); a failure
        that stops the job on that lane is reported to the other lanes at once."""
        if self.count > 1:
            work.add_done_callback(lambda w: self._spread(w, lane))
        return self.order.add(work)

    def _spread(self, work: CommWork, lane: int) -> None:
        """Report the job's failure, seen on ``lane``, to the other lanes' fabrics (each trips its groups)."""
        exc = work.exception()
        if exc is None or self.fabrics[lane].failure is None:
            return
        for i, fabric in enumerate(self.fabrics):
            if i != lane and fabric.failure is None:
                try:
                    fabric.fail(exc, self.fabrics[lane].failure[1])
                except Exception:  # noqa: BLE001 - the report must not mask the error
                    pass


def resolve_lanes(requested: int | None, pipeline: Any, buckets: int | None = None) -> int:
    """The number of lanes: ``requested`` checked (an int >= 1; more than 1 only where lanes run, else
    :class:`~sparsecomm.errors.IncompatibleError` saying why and what runs), or, for ``None``, the default
    rule: :data:`DEFAULT_LANES` where lanes run (the module doc's "Where") and the model's gradients take
    more than one bucket (``buckets``, where known); else 1. The same answer on every worker (it reads only
    what they agree on)."""
    check_lanes(requested)
    why = why_one_lane(pipeline)
    if requested is None:
        if why is not None:
            return 1
        if buckets is not None and buckets <= 1:
            return 1        # (one bucket: nothing to overlap)
        return DEFAULT_LANES
    if requested > 1 and why is not None:
        raise IncompatibleError(f"lanes={requested}: {why}; pass lanes=1 (or None: the default rule)")
    return requested


def check_lanes(requested: Any) -> None:
    """:class:`~sparsecomm.errors.InvalidValueError` unless ``requested`` is None or an int >= 1."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise InvalidValueError(f"lanes must be None (the default rule) or an int >= 1, got {requested!r}")


def why_one_lane(pipeline: Any) -> str | None:
    """Why ``pipeline`` runs on one lane only (the same on every worker), or None when lanes run."""
    if pipeline.chooser is not None:
        return "transport='auto' chooses a transport per bucket, on one lane"
    name = pipeline.transport.name
    if name not in LANE_TRANSPORTS:
        return (f"transport {name!r} keeps one lane (lanes run {', '.join(LANE_TRANSPORTS)}: 'native' posts its "
                f"collectives from the calling thread already; the switches' service rank serves one lane)")
    if not pipeline.transport_by_name:
        return "the transport was given as an object: a lane builds its own from the transport's name"
    return pipeline.fabric.lane_refusal()       # (dedicated aggregators: service ranks, which it names)
