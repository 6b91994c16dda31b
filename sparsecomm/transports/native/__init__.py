"""``native``: ``torch.distributed.all_reduce`` (gloo's or NCCL's own algorithm), the baseline.

Exists only on :class:`~sparsecomm.fabric.torch.torch_fabric.TorchFabric`; with services in the job it reduces
over the workers' subgroup only. Carries the same kinds as ``ring`` (``dense``; ``aligned`` value
vectors; ``quantized`` codes with a shared scale, summed as int32/int64: gloo's all_reduce rejects
int8) as their linear operand (:mod:`..linear`), after the same agreement handshake (folded into the
data for repeated calls, below). The collectives themselves, their booking and their errors:
:mod:`.collectives` (vectors of at most :data:`~.collectives.GATHER_SUM_BYTES`, 64 KiB, are summed by one
``all_gather`` and a local sum in rank order: ``n - 1`` latency steps rather than the ring's
``2 (n - 1)``).

**The agreement folds into the data** for repeated calls (:mod:`.._fold`): once the record of completed
calls predicts this call (length, dtype, payload kind, ... as the handshake compares them) on every
worker, a worker making exactly that call all-reduces at once, without the handshake; a worker making
another call joins the predicted all-reduce with NaN and runs its handshake, so the workers that took
the fast path see NaN, run theirs, and every worker raises the handshake's MismatchError. Float
vectors of at most ``fold_max_bytes`` (default 16 MiB, 0 never) fold.

**Posted at once** (``start``, the DDP hook's and the optimizer's overlapped buckets): a predicted call
is posted to gloo on the calling thread (``async_op``) whenever every call before it on the fabric is
posted too (:meth:`~sparsecomm.fabric.engine.CommEngine.post`); the wait, the check above and
``then`` run on the communication thread in call order. So the next bucket's all-reduce is queued
behind the running one, as torch's own ``allreduce_hook`` does, instead of leaving the link idle while
the communication thread wakes, checks, divides and picks the next call (the idle time this removes per
bucket: BENCHMARKS.md, "Training step"). A posted call's prediction and record are taken under the engine's lock, so
every worker posts the same calls in the same order. :meth:`Native.chain` (the DDP hook's steady state) posts
the same way but chains the completion on gloo's own future instead
(:meth:`~sparsecomm.fabric.engine.CommEngine.chain`: in call order too, each completion after the previous
one has returned, and only while nothing is queued on the communication thread, which then waits for them). If resolving a posted call's NaN raises (a worker
deviated: MismatchError; a non-finite input with ``nonfinite="raise"``: NonFiniteError) while this
worker has later calls posted, the workers that did not post them never will: the worker then stops
the job (``TorchFabric.fail``: every rank raises that error class, and the fabric is unusable after),
where a synchronous call leaves the fabric usable. A collective that fails (a rank died, raised or
timed out) raises the fabric's error naming the rank that failed first, on every rank
(:func:`.collectives.translated`). On a timeline (:mod:`sparsecomm.trace`) a posted or chained call is
the time its completion spent on the collective's wait and checks.

``last_stats``: torch.distributed does not report its traffic, so the collectives are booked as estimates
(:func:`.collectives.book`: the all-reduce at the bandwidth-optimal ring volume); ``last_stats.estimated``
is true and the measured part (the handshake, none on a folded call) is ``bytes_sent + bytes_received -
estimated_bytes``.

:meth:`Native.gather` gathers row-sparse payloads (the pipeline's sparse-gradient path, as gloo's sparse
allreduce does) in :mod:`.gather`: one ``all_gather`` of a slot sized from the last call when
the call is predicted, else a fixed-size header (length, row length, dtype, row count) checked on every
worker, then every worker's row indices and values padded to the largest row count.

Integer sums that could overflow are summed in a wider integer dtype (at least int32) and
range-checked; NaN/Inf raise unless ``nonfinite="pass"`` (:mod:`.._guards`), on every worker.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from ...errors import IncompatibleError, InvalidValueError
from ...fabric import trace as _trace
from ...fabric.base import Fabric
from ...fabric.engine import engine
from ...payload import Payload
from .. import _fold
from ..base import registry
from .._guards import all_finite, guard_finite, nonfinite_option
from .._handshake import calling, check_agreement, fail_stop
from ...theory import costs
from ..base import CallId, CallShape, Transport
from ..linear import LinearOperand, guarded_sum, linear_operand
from .collectives import GATHER_SUM_BYTES, book, join, join_figures, post_join, translated
from .gather import gather_rows
from ...fabric.torch.torch_waiters import retain_one

WHAT = "native allreduce"


@registry.register("native")
class Native(Transport):
    """``torch.distributed.all_reduce`` over the workers (see the module docstring)."""

    name = "native"
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"dense", "aligned", "quantized"})
    folds = True
    gathers = True

    def __init__(self, fabric: Fabric, *, inplace: bool = False, nonfinite: str = "raise",
                 fold_max_bytes: int = _fold.FOLD_MAX_BYTES) -> None:
        super().__init__(fabric)
        if fold_max_bytes < 0:
            raise InvalidValueError(f"fold_max_bytes must be >= 0 (0: never fold), got {fold_max_bytes}")
        self.fold_max_bytes = int(fold_max_bytes)
        self.nonfinite = nonfinite_option(nonfinite, "native")
        self.inplace = inplace   # all-reduce a plain tensor input in place (scratch buckets), no copy
        self._lanes: dict = {}   # (bucket, round, numel, dtype) -> what chain() keeps of it (see _lane)
        if fabric.native_group is None:
            raise IncompatibleError(
                f"transport 'native' calls torch.distributed.all_reduce, so it needs a TorchFabric "
                f"(launch backend 'gloo' or 'nccl'), not a {type(fabric).__name__}; on SimFabric use 'ring' "
                f"(the same dense sum, bandwidth-optimal, written against the Fabric) or 'allgather'")
        if not fabric.is_worker:
            raise InvalidValueError("transports run on workers, not on service endpoints")

    def start(self, x: torch.Tensor | Payload, then=None, *, next_round=None, call=None):
        """As :meth:`Transport.start`; a call predicted to fold (:mod:`.._fold`) is *posted* at once on
        the calling thread when every call before it is posted too
        (:meth:`~sparsecomm.fabric.engine.CommEngine.post`), so that gloo has it queued while the calls
        before it complete (a DDP bucket's all-reduce follows the previous one's with no idle link between
        them); its completion (the wait, the non-finite check, the later rounds of a call of several
        rounds, ``then``) runs on the communication thread in call order, and no call is posted while an earlier one has rounds left to send."""
        x = self.check_input(x)
        with calling(call):
            work = self._post_folded(x, then, next_round, call)
        return work if work is not None else super().start(x, then, next_round=next_round, call=call)

    def _post_folded(self, x: torch.Tensor | Payload, then, next_round, call):
        f = self.fabric
        sched = _fold.schedule(f)
        if sched is None or (isinstance(x, Payload) and (x.kind != "dense" or not self.can_carry(x.kind))):
            return None
        if sched.predicted() is None:
            return None
        op = linear_operand(x, self.name, inplace=self.inplace)
        v = op.vector
        if op.codes or not v.is_floating_point() or not 0 < v.numel() * v.element_size() <= self.fold_max_bytes:
            return None
        eng = engine(f)

        def post():
            # under the engine's lock, with nothing queued that sends messages when it runs: the
            # prediction, the record and the posts in call order
            key = _native_key(op, sched)
            predicted = sched.predicted()
            if predicted is None or predicted.key != key:
                return None
            acc = op.work_copy(f)
            pending = post_join(f, acc)
            sched.folded += 1
            sched.posted += 1
            sched.record(key, predicted)     # (this very call: its key holds the length and dtype)
            return acc, pending

        def complete(posted):
            acc, pending = posted
            t0 = time.perf_counter()
            try:
                with calling(call):
                    total, stats = pending()          # the sum, and what its collective booked
                    if self._suspect(total):
                        before = f.stats.copy()
                        total = self._resolve_folded(op, total, eng)
                        stats = stats + (f.stats - before)
                stats.wall_time_s = time.perf_counter() - t0
                self.last_stats = stats
                if _trace.recorder is not None:      # (its completion's wait and checks: the call's time here)
                    with calling(call):
                        self._trace_call(x, t0, stats)
                out = op.finish(total)
                if out.shape != x.shape:
                    out = out.reshape(x.shape)
                if out.dtype != x.dtype:
                    out = out.to(x.dtype)
                return self._later_rounds(out, then, next_round, call)
            except BaseException as exc:
                sched.reset()
                if eng.resolving():
                    # this worker's later calls are posted; a worker that has not posted them yet
                    # never will (its engine now fails every later call): stop the job
                    fail_stop(f, exc)
                raise        # (the engine stays resolving until it has recorded the failure)

        return eng.post(post, complete, issues=next_round is not None)

    def chain(self, x: torch.Tensor | Payload, call: CallId, then, done=None, *, scratch: bool = False,
              out: torch.Tensor | None = None, narrow: bool = False, checks: bool = False):
        """As :meth:`Transport.chain`: a call predicted to fold (:mod:`.._fold`) whose vector is summed by
        ``all_reduce`` in place (a tensor with ``inplace=True``, or a ``dense`` payload whose values are
        ``scratch``; flat, contiguous, larger than :data:`~.collectives.GATHER_SUM_BYTES`) is posted as
        :meth:`start` posts it, and its completion (the non-finite check that also resolves a deviation,
        the booking, a payload's sum cast to its dtype, into ``out`` if given, or as summed with ``narrow``,
        ``then``) is chained on gloo's future (:meth:`~sparsecomm.fabric.engine.CommEngine.chain`), in call
        order, with the same errors and the same fail-stop as :meth:`start`'s. With ``checks`` (and
        ``nonfinite="raise"``), ``then`` returns ``(value, finite)`` and its pass over the sum (a tensor's, or a
        payload's as summed or cast) is the non-finite check: a non-finite sum is resolved after it as before it
        (the same errors), its value dropped. What does not depend on the step (the eligibility, the fold key but for its step, the
        process group and the all-reduce's options, posted to the group directly) is kept per bucket, length
        and dtypes."""
        tensor = isinstance(x, torch.Tensor)
        v = x if tensor else x.values
        lane = self._lanes.get((call.bucket, call.round, v.numel(), v.dtype, x.dtype))
        if lane is None:
            lane = self._lane(x, v, call)
        if not lane or not (self.inplace if tensor else scratch) or not v.is_contiguous() or (
                out is not None and not narrow and (out.dtype != x.dtype or out.numel() != v.numel())):
            return None
        sched, eng, prefix, code, group, opts, booked = lane
        f = self.fabric
        # the sum's check is then's (checks) or this completion's own, before then
        own = not (checks and self.nonfinite == "raise")
        step = call.step

        def post():
            # under the engine's lock (CommEngine.chain): the prediction, the post and the record in call order
            if sched.take(prefix, code, step, call.round) is None:     # (predicted: recorded, as made)
                return None
            try:
                handle = group.allreduce([v], opts)     # (dist.all_reduce's own call, its checks made once)
            except RuntimeError as exc:
                sched.reset()       # (not made: the engine fails, CommEngine.chain)
                raise translated(f, "all_reduce", exc) from exc
            sched.folded += 1
            sched.posted += 1
            sched.chained += 1
            fut = handle.get_future()       # (the work itself is gloo's to keep: as dist.all_reduce's caller drops it)
            return fut, fut

        def complete(fut):
            t0 = time.perf_counter()
            try:
                try:
                    fut.wait()      # (complete: not the work's wait(), which waits for its callbacks)
                except RuntimeError as exc:
                    raise translated(f, "all_reduce", exc) from exc
                retain_one(v)   # (the tensor the work holds, so that gloo's thread never frees its Python object)
                stats = book(f, *booked)        # (book_join's figures for this lane, computed once)
                if own and self._suspect(v):
                    before = f.stats.copy()
                    with calling(call):
                        self._resolve_folded(linear_operand(x, self.name, inplace=True), v, eng)
                    stats = stats + (f.stats - before)
                stats.wall_time_s = time.perf_counter() - t0
                self.last_stats = stats
                if _trace.recorder is not None:
                    with calling(call):
                        self._trace_call(x, t0, stats)
                if tensor:
                    summed = v
                elif narrow:
                    summed = v if len(x.shape) == 1 else v.reshape(x.shape)     # (v is flat: no view of it)
                else:
                    summed = (out.copy_(v) if out is not None else v.to(x.dtype)).reshape(x.shape)  # (exact)
                if not checks:
                    return then(summed)
                value, finite = then(summed)
                if not (own or finite):     # (resolved as a suspect sum is: it raises on every worker)
                    with calling(call):
                        self._resolve_folded(linear_operand(x, self.name, inplace=True), v, eng)
                return value
            except BaseException as exc:
                sched.reset()
                if eng.resolving():
                    fail_stop(f, exc)      # later calls of this worker are posted: stop the job (see start)
                raise

        return eng.chain(post, complete, done)

    def _lane(self, x: torch.Tensor | Payload, v: torch.Tensor, call: CallId):
        """What :meth:`chain` keeps of a bucket: False when its calls are not chained, else the fabric's
        schedule and engine, the fold key's part that does not depend on the call, the code of the call's
        bucket (``CallId.words[0]``: a digest of its key's ``repr``), the workers' process group, the
        all-reduce's options (a sum, asynchronous: what ``dist.all_reduce`` gives the group) and what its
        collective books (:func:`.collectives.join_figures`)."""
        f = self.fabric
        sched = _fold.schedule(f)
        nbytes = v.numel() * v.element_size()
        ok = (sched is not None and v.dim() == 1 and v.is_floating_point()
              and GATHER_SUM_BYTES < nbytes <= self.fold_max_bytes
              and (isinstance(x, torch.Tensor) or (x.kind == "dense" and x.numel == v.numel())))
        lane = False
        if ok:
            op = linear_operand(x, self.name, inplace=True)
            prefix = ("native", *[(k, int(val)) for k, val in op.fields.items()])
            group = f.native_group if f.native_group is not None else dist.group.WORLD
            if not isinstance(group, dist.ProcessGroup):
                self._lanes[(call.bucket, call.round, v.numel(), v.dtype, x.dtype)] = False
                return False
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = True
            lane = (sched, engine(f), prefix, call.words[0], group, opts, join_figures(f.world_size, nbytes, False))
        self._lanes[(call.bucket, call.round, v.numel(), v.dtype, x.dtype)] = lane
        return lane

    def _check_folded(self, op: LinearOperand, total: torch.Tensor) -> torch.Tensor:
        """A folded call's sum (:meth:`_suspect`, then :meth:`_resolve_folded`)."""
        return self._resolve_folded(op, total) if self._suspect(total) else total

    def _suspect(self, total: torch.Tensor) -> bool:
        """Whether a folded call's sum may hide a deviating worker's NaN (or, with ``nonfinite="raise"``,
        a non-finite input): a non-finite sum, or with another rule a NaN first element."""
        if self.nonfinite == "raise":
            return not all_finite(total)
        return bool(torch.isnan(total[:1]).any())

    def _resolve_folded(self, op: LinearOperand, total: torch.Tensor, eng=None) -> torch.Tensor:
        """A suspect folded sum: a NaN in it (every element, if a worker deviated) is resolved by the
        handshake, then by the non-finite rules. A posted call (``eng``) resolves with no later call
        posted meanwhile; if it raises while later calls of this worker are already posted, its
        completion stops the job (fail-stop, :meth:`TorchFabric.fail`): workers that did not post
        them never will."""
        v = op.vector
        if eng is not None:
            eng.resolving()      # no call is posted while this one runs its handshakes
        check_agreement(self.fabric, WHAT, **op.fields)   # MismatchError on every worker if one deviated
        # (summed in place: the input is gone, whatever view of it ``op`` holds; it names no worker then)
        same = total.data_ptr() == v.data_ptr() and total.numel() == v.numel()
        guard_finite(self.fabric, WHAT, total, None if same else v, self.nonfinite)
        if eng is not None:
            eng.resolved()
        return total

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.native_allreduce` (the ring's volume and steps) of the call's
        wire bytes."""
        return costs.native_allreduce(self.fabric.world_size, call.wire_bytes, elem_size=call.elem_size,
                                      bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        op = linear_operand(flat, self.name, inplace=self.inplace)
        return op.finish(self._sum_linear(op))

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        """The operand's sum: folded into the data when predicted (:mod:`.._fold`), else after the
        handshake (:func:`~..linear.guarded_sum`)."""
        f = self.fabric
        sched = _fold.schedule(f)
        if sched is None:
            return guarded_sum(f, WHAT, op, {}, self.nonfinite, self._reduce, int_floor=torch.int32)
        v = op.vector
        key = _native_key(op, sched)
        fold = None
        if (v.is_floating_point() and 0 < v.numel() * v.element_size() <= self.fold_max_bytes
                and not op.codes):
            fold = _fold.Fold(key, v.numel(), v.dtype, v.device, functools.partial(join, f))
        predicted = sched.predicted()
        if predicted is not None and fold is not None and predicted.key == key:
            sched.folded += 1
            total = self._check_folded(op, self._reduce(op.work_copy(f)))   # the predicted call, at once
        else:
            if predicted is not None:
                sched.deviate(predicted)     # then this call's own handshake (in guarded_sum)
            total = guarded_sum(f, WHAT, op, {}, self.nonfinite, self._reduce, int_floor=torch.int32)
        sched.record(key, fold)
        return total

    def gather(self, p: Payload) -> list[Payload]:
        """Every worker's row-sparse payload (``sparse`` with ``bucket_size`` = the row length, or plain
        ``sparse``: rows of one element), in rank order, the same list on every worker. Every worker must
        call it: one ``all_gather`` when the call is predicted (:mod:`.._fold`), else two (a header, then
        the rows); workers that disagree on the length, row length or dtype (or make another call) get
        :class:`~sparsecomm.errors.MismatchError`, a row count outside the table is
        :class:`~sparsecomm.errors.MalformedMessage`, on every worker (:mod:`.gather`)."""
        if p.kind != "sparse" or p.indices is None:
            raise IncompatibleError(f"native gather carries row-sparse payloads, not {p.kind!r} ones")
        return gather_rows(self.fabric, p, self.fold_max_bytes)

    def _reduce(self, acc: torch.Tensor) -> torch.Tensor:
        return join(self.fabric, acc)


def _native_key(op, sched: _fold.Schedule) -> tuple:
    """The fold record's key of a ``native`` all-reduce: what its handshake compares (the operand's
    fields) and the identity of the call running on this thread (:meth:`_fold.Schedule.call_key`)."""
    return ("native", *[(k, int(val)) for k, val in op.fields.items()], *sched.call_key())
