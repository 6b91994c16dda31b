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

**Asynchronous calls.** ``work = t.start(x)`` queues the call on the fabric's communication thread
(:class:`~sparsecomm.fabric.engine.CommEngine`: one per fabric, running the calls of *all* transports on
that fabric one at a time, in submission order; its rules on order, errors and exit are
:mod:`sparsecomm.fabric.engine`'s) and returns at once; ``work.wait()`` returns the sum
(``allreduce(x)`` is ``start(x).wait()``). ``start(x, then=f)`` runs ``f(sum)`` on the communication
thread right after the sum (the DDP hook decodes there) and ``wait()`` returns ``f``'s result;
``work.get_future()`` is a ``torch.futures.Future`` completed at the same moment. ``x`` (and a
payload's tensors) must not be modified until the work completes. ``allreduce`` with nothing in flight
runs on the calling thread (no thread hop), so synchronous use is unchanged. A transport whose call is a
single non-blocking collective (``native``'s predicted calls) may instead *post* it on the calling thread
(:meth:`~sparsecomm.fabric.engine.CommEngine.post`).

**Calls of several rounds** (``start(x, then, next_round=f)``: PowerSGD's P, then Q) run their later
rounds inside the same call, before any message of a later call, so a later call is never posted while
an earlier one still has rounds to send. **Identity**: ``start(x, call=CallId(bucket, step))`` names
the call; every agreement the call makes (the handshake's header, the folded key of ``native``)
carries it, so workers whose paired calls are different calls raise
:class:`~sparsecomm.errors.MismatchError` instead of summing different tensors
(:class:`~._handshake.CallId`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, NamedTuple

import torch

from ..errors import IncompatibleError
from ..fabric import trace as _trace
from ..fabric.base import Fabric
from ..fabric.engine import CommWork, engine
from ..fabric.stats import CommStats
from ..payload import Payload
from ..registry import Registry
from ..theory import costs
from . import _fold
from ._guards import check_dtype
from ._handshake import CallId, calling, current_call, transport_code
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
    #: the transport's service ranks (a switch, dedicated aggregators) compute at the same moments as its
    #: workers, so that a model of processes sharing cores (``HostModel.sharing``) counts them among the busy
    #: ones; ``False``: they compute only while every worker waits for them and the workers only while they
    #: wait (rounds in lock-step, as the sparse switch's waves), and only the workers share the cores
    services_share_cores: ClassVar[bool] = True
    #: the grid, in elements, on which the transport cuts its input into blocks and leaves out a block that is
    #: zero (on every worker, or on the sender): a caller that lays several tensors into one call starts the
    #: large ones on it (the DDP hook's fused step); 1 for a transport that leaves nothing out
    block_grid: int = 1

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
              call: CallId | None = None) -> CommWork:
        """Queue ``allreduce(x)`` (then ``then(sum)``) on the fabric's communication thread; returns a
        :class:`~sparsecomm.fabric.engine.CommWork` at once. ``x`` must stay untouched until the work completes.

        A call of several rounds (PowerSGD: P, then Q): ``next_round(sum)`` returns the next round's
        input (or None: no more rounds); each later round runs in the same call, right after the
        previous sum and before any message of a later call on this fabric, with identity
        ``call.next_round()``; ``then`` gets the last round's sum. ``call``: the identity of the first
        round (:meth:`allreduce`)."""
        x = self.check_input(x)       # a bad pair or dtype fails here, on the caller's thread
        return engine(self.fabric).submit(lambda: self._later_rounds(self.run(x, call), then, next_round, call))

    def chain(self, x: torch.Tensor | Payload, call: CallId, then: Callable[[torch.Tensor], Any],
              done: Callable[[Any, BaseException | None], None] | None = None, *,
              scratch: bool = False, out: torch.Tensor | None = None,
              narrow: bool = False, checks: bool = False) -> "torch.futures.Future | None":
        """The sum of the flat tensor or ``dense`` payload ``x`` as a ``torch.futures.Future`` of
        ``then(sum)``, its collective posted now and its completion chained on the collective's own future
        (:meth:`~sparsecomm.fabric.engine.CommEngine.chain`; ``done(value, error)`` runs before the future
        completes), or None when this call cannot be chained: the caller then :meth:`start`\\ s it (nothing
        was sent). A tensor may be summed in place where the transport sums tensors in place
        (``inplace``), a payload's values where the caller says they are ``scratch`` (nobody else reads
        them); ``out`` (a payload's length and dtype) takes a payload's sum cast to its dtype, else a new
        tensor does; with ``narrow``, ``then`` gets a payload's sum as summed, in its values' dtype (not cast:
        ``out`` unused); with ``checks``, ``then`` returns ``(value, finite)``, ``finite`` whether the sum it read
        (a tensor's, or a payload's as summed or cast) was finite, which stands for the transport's own check of
        the sum (a non-finite one is handled as that check would, after ``then``). The base class chains nothing;
        ``native`` chains a predicted all-reduce."""
        return None

    def _later_rounds(self, out: torch.Tensor, then, next_round, call: CallId | None) -> Any:
        """Run a started call's later rounds (:meth:`start`) from its first sum ``out``, then ``then``."""
        while next_round is not None and (nxt := next_round(out)) is not None:
            call = call.next_round() if call is not None else None
            out = self.run(nxt, call)
        return then(out) if then is not None else out

    def run(self, x: torch.Tensor | Payload, call: CallId | None = None) -> torch.Tensor:
        """The call, on this thread, now: for code that already runs on the fabric's communication thread
        (a job of :meth:`~sparsecomm.fabric.engine.CommEngine.submit`, such as the pipeline's row-sparse
        rounds) or with nothing in flight on the fabric; anywhere else use :meth:`start` or :meth:`allreduce`.

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
        # (a recorded call carries its thread's CPU time: what of its wall time it ran, not waited or was preempted)
        t0_cpu = time.thread_time() if _trace.recorder is not None else 0.0
        x = self.check_input(x)
        # the wait for the call's last worker on shared cores, then the call's own CPU time beyond its messages
        # and kernels, where the fabric models hosts (sim_host; elsewhere host_work is a no-op, not called)
        charged = self.fabric.charges_host_work
        if charged:
            self.fabric.host_work("sync", 1, transport=self.name)
            self.fabric.host_work("call", 1, transport=self.name)
            self.fabric.host_work("call_peer", self.fabric.world_size - 1, transport=self.name)
        # a call predicted to fold into its data (``native``, :mod:`._fold`) that this one is not:
        # join it and say so first; a transport that folds (``folds``) keeps its own record
        sched = None if self.folds else _fold.enter(self.fabric, self.name, f"{self.name} allreduce")
        try:
            if isinstance(x, Payload):
                out = self._allreduce_payload(x)
                out = out.reshape(x.shape).to(x.dtype)
            else:
                out = self._allreduce_tensor(x.reshape(-1)).reshape(x.shape)
        except BaseException as exc:
            s = _fold.schedule(self.fabric) if self.folds else sched
            if s is not None:
                s.reset()        # raised on every worker alike: every record forgets alike
            if _trace.recorder is not None:
                self._trace_call(x, t0_model, self.fabric.stats - before, exc, t0_cpu)
            raise
        _fold.leave(sched, self.name)
        # the call's end, where the workers last met: the next call's wait for its last worker counts the work
        # from here (sim_host's "sync")
        if charged:
            self.fabric.host_work("settle", 1, transport=self.name)
        stats = self.fabric.stats - before
        stats.wall_time_s = time.perf_counter() - t0_wall
        stats.modelled_time_s = self._modelled(t0_model)
        self.last_stats = stats
        if _trace.recorder is not None:
            self._trace_call(x, t0_model, stats, cpu0=t0_cpu)
        return out

    def _trace_call(self, x: torch.Tensor | Payload, t0: float, stats: CommStats,
                    exc: BaseException | None = None, cpu0: float | None = None) -> None:
        """Record this call on the active timeline (:mod:`sparsecomm.fabric.trace`): from ``t0`` to now on
        the fabric's clock, with its input, its ledger and its identity; on a fabric of wall time, with
        ``cpu0`` (``time.thread_time()`` at its start), ``cpu_us``: the CPU time of the thread that ran it
        (the hosted aggregator's roles included), so that a call's wall time splits into the waits it records,
        its own CPU and the rest (runnable but not running: cores shared with other processes and threads)."""
        rec = _trace.recorder
        if rec is None:
            return
        payload = isinstance(x, Payload)
        args = {"kind": x.kind if payload else "dense", "numel": int(x.numel if payload else x.numel()),
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                "messages": stats.messages, "messages_received": stats.messages_received}
        if self.fabric.modelled_time:
            args["modelled_time_s"] = stats.modelled_time_s
        elif cpu0 is not None:
            args["cpu_us"] = round((time.thread_time() - cpu0) * 1e6, 1)
        call = current_call()
        if call is not None:
            args["call"] = str(call)
        if exc is not None:
            args["error"] = f"{type(exc).__name__}: {exc}"
        rec.call(self.fabric, f"{self.name} allreduce", t0, self.fabric.now(), args)

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
        return x.detach() if x.requires_grad else x

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
