"""OmniReduce: block-sparse streaming aggregation that sends only non-zero blocks.

Fei, Ho, Sahu, Canini, Sapio, "Efficient Sparse Collective Communication and its application to
Accelerate Distributed Deep Learning", SIGCOMM 2021; public implementation sands-lab/omnireduce.

>>> import torch
>>> import sparsecomm as sc
>>> def fn(ctx):
...     x = torch.zeros(1024)
...     x[:256] = ctx.rank + 1.0                      # one non-zero block of four
...     t = sc.transports.get("omnireduce", ctx.fabric, block_size=256)
...     y = t.allreduce(x)      # sum over workers; only non-zero blocks travel
...     return y[0].item(), y[-1].item()
>>> sc.launch(fn, world_size=3, backend="sim")
[(6.0, 0.0), (6.0, 0.0), (6.0, 0.0)]

The tensor is cut into blocks of ``block_size`` elements; aggregators own disjoint block ranges;
blocks are dealt into lanes, and per lane a worker sends a non-zero block together with the offset of
its own next non-zero block in that lane (4 bytes). The aggregator completes a block once the smallest
announced next offset is past it and returns the sum with that offset to every worker, which prompts
exactly the holders of the next block (see :mod:`.core`, :mod:`.wire`).

Reading order for a newcomer: :mod:`.core` top to bottom (the lane state machines,
:class:`.core.WorkerChannel` and :class:`.core.AggChannel`: announce, add, complete, prompt), then
:mod:`.reference`, a plain driver of them (one call in a loop of exchanges over the fabric; the fast
driver's results are checked against it bit for bit). Then the fast driver: the roles, generators that
yield typed requests (send, post a receive, receive into the result, hand over locally, wait) to one
scheduler per endpoint, ``Fabric.drive`` (:mod:`sparsecomm.fabric.roles`; what the roles wait for,
:mod:`.stages`; the rules and why they cannot deadlock: ``docs/omnireduce-scheduler.md``). A worker's
(:mod:`.worker`): :func:`.worker.worker` -- round 0's header, first look-aheads and position-0 blocks --,
:func:`.worker.verdict`, one per aggregator (it goes on as its last channel's lanes, or, on the SimFabric without a
host model, takes the round-0 replies of two or more one-round channels in one wait: :func:`.worker.land_singles`), and
:func:`.worker.worker_lane` for the other channels; an aggregator's
(:mod:`.aggregator`): :func:`.aggregator.aggregator` --
headers, verdict, drain -- and :func:`.aggregator.agg_lane`. The colocated worker runs its roles and
its hosted aggregator's together, a dedicated aggregator (:mod:`.service`) its own alone, on the
SimFabric and on torch alike. Then the fast paths, :mod:`.strategies` (how blocks go up: by hand, as
views of the tensor or copied; where sums land: a message, in place in the input, or straight into
the result); message identities and formats, :mod:`.wire` (:class:`.wire.Msg`, :class:`.wire.Key`,
:class:`.wire.Buf`); a worker's call and the aggregator's checks of it, :mod:`.header`; the data as
blocks, :mod:`.blocks`. A per-message trace of a call: :mod:`.trace`.

Per call and worker (``M`` = the tensor's bytes, ``d_w`` its non-zero block fraction, ``d_u`` the
union's, ``nb`` blocks, ``L`` lanes):

* dedicated aggregators: up ``d_w M + 4 d_w nb`` bytes, down ``d_u M + 4 d_u nb``, plus round 0
  (a 224-byte header and ``4 L`` bytes of first look-aheads each way, per aggregator; when every lane
  holds one block, one bit per lane and no per-block look-aheads at all). Flat in ``n``
  when aggregator bandwidth scales with the workers (one aggregator per worker).
* colocated (every worker hosts the aggregator of ``1/n`` of the blocks; its own shard never crosses
  the wire): up and down ``(n-1)/n (d_w + d_u) M`` each, i.e. ring's ``2 (n-1)/n M`` at ``d = 1``.

The closed form is :func:`theory.costs.omnireduce_allreduce`.

Payload kinds: ``dense`` (zero blocks skipped; narrower float values travel as they are), ``sparse``
(block-encoded from ``(indices, values)`` without densifying), ``aligned`` (the protocol runs on the
value vector, then scatters), ``quantized`` with a shared scale (integer codes summed exactly as
integers, downstream in the narrowest integer type that holds the sum, then scaled). Workers that
disagree on the length, dtype, kind, block size or shared indices/scale all raise
:class:`~sparsecomm.errors.MismatchError` after the first round; before it, the workers run the
agreement handshake every transport runs (:func:`.._handshake.agreement_role`, one fixed-size header
with the transport's name, run to its end first in the call's own drive), so a rank that calls another transport is a ``MismatchError`` naming both
on every rank, not a timeout. A repeated call skips that handshake where the fabric keeps a record of the
calls (real processes; :mod:`.._fold`): a dense float call that every worker predicts from the same record
runs at once, and a worker making another call joins the predicted one with NaN first, so the workers that
skipped it find NaN in the sum and run the handshake of the call (:meth:`OmniReduce._resolve`), which meets
the deviator's: the same ``MismatchError`` on every worker as without the skip. The result has the input's dtype:
integer sums are exact (the aggregators add in int64) and range-checked against it
(:class:`~sparsecomm.errors.OverflowError_`, never wrapped). NaN/Inf in a float sum raise
:class:`~sparsecomm.errors.NonFiniteError` (finite inputs that overflow, ``OverflowError_``) on every
worker unless ``nonfinite="pass"`` (:mod:`.._guards`). Aggregators check every header against the world
size, their own index, the protocol limits and its checksum before planning or allocating anything from
it (:func:`.header.validate_header`): a forged header is a :class:`~sparsecomm.errors.MalformedMessage` on
every worker. After any verdict that is not OK an aggregator receives nothing by a header: each worker
tells it what it sent in round 0 (a fixed-size manifest, :func:`.header.manifest`) and it consumes exactly
that, so it goes on serving and the next call through it is clean.

Defaults (fast where they run, :mod:`..defaults`): the real fabric's on every fabric, since the
SimFabric's reproduction sets its own lanes (``experiments/reproduce_omnireduce.py``): 256-element
blocks (the paper's), colocated aggregators, 2 channels per aggregator and 16384 lanes per channel,
i.e. messages of up to 16 MiB and a 100 MB tensor in 1-2 rounds on 2-4 workers, where each round trip
costs milliseconds (BENCHMARKS.md, "Transports on the netbed", measures them against other lane counts).
On a fabric whose messages want to be long (``fabric.message_bytes``: real processes) a colocated call
whose aggregator ranges fit in one round runs one channel per aggregator, unless it is a repeated call whose
union held at least ``message_bytes`` in an aggregator's range the last time (a dense bucket, every training step
after the first): the record of calls keeps each call's union (:meth:`OmniReduce.channels_for`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...errors import InvalidValueError
from .. import _fold
from .._handshake import KIND_CODE, agreement_role, check_agreement, dtype_code
from .._guards import abs_max, check_dtype, guard_finite, is_integer, narrow, nonfinite_option
from ...fabric import services
from ...fabric.roles import Pool
from ...payload import Payload
from ...theory import costs
from ..base import CallShape, Transport, registry
from ..linear import LinearOperand
from . import trace, wire
from .service import serve, serve_process
from .blocks import BlockSink, DenseSource, PackedSource, ResultCache
from .header import CallSpec
from .worker import run_worker

__all__ = ["OmniReduce", "service_main"]

DEPLOYMENTS = ("colocated", "dedicated")
#: channels per aggregator by default, where several pay (:meth:`OmniReduce.channels_for`)
CHANNELS = 2


def service_main(index: int, *, process: bool = False):
    """The loop of dedicated aggregator ``index`` (``main(fabric)``): a blocking loop (an extra
    torch.distributed rank), or with ``process`` a generator function, a process of the loop of a fabric
    whose time is modelled (``Fabric.service``; deterministic modelled times, no thread)."""

    if process:
        def main(fabric):
            yield from serve_process(fabric, index)
    else:
        def main(fabric) -> None:
            serve(fabric, index)

    main.__name__ = f"omnireduce_agg_{index}"
    return main


def _checked(sink: BlockSink) -> int:
    """The elements :meth:`.blocks.BlockSink.written_finite` reads: the whole result where the call wrote most
    of its blocks, else the written blocks."""
    ids = sink.written_ids()
    return 0 if not ids.size else sink.numel if 2 * ids.size > sink.full else int(ids.size) * sink.block_size


@services.registry.register("omnireduce-agg")
def _service_factory(arg: str | None):
    """``"omnireduce-agg:i"`` -> dedicated aggregator ``i`` (for an extra torch.distributed rank)."""
    return service_main(int(arg or 0))


@registry.register("omnireduce")
class OmniReduce(Transport):
    """Block-sparse streaming all-reduce (Fei et al., SIGCOMM'21).

    ``block_size`` elements per block (256, the paper's). ``deployment``: ``"colocated"`` (default;
    worker ``a`` hosts aggregator ``a``, interleaved with its own loop) or ``"dedicated"`` (service
    endpoints ``omnireduce-agg:0 .. A-1`` with their own links; ``num_aggregators`` defaults to the
    number of workers; on SimFabric ``aggregator_bandwidth_gbps``/``aggregator_latency_us`` set their
    links, on torch.distributed start them with ``launch(..., services=[...])``). ``lanes``: lanes per
    channel, i.e. blocks fused per message and aggregator memory (``lanes`` blocks per channel). A
    channel of ``S`` blocks runs ``ceil(S / lanes)`` rounds at density 1, and about
    ``1 + max lane load`` when sparse: each round is a round trip, so on real processes, where a
    message costs far more than its bytes, fuse aggressively (the default 16384 lanes puts a 100 MB
    tensor on 2 workers in 1-2 rounds); in a simulation, fewer lanes (more rounds, smaller messages)
    pipeline the up- and downstream better. ``channels`` (at most 16): independent streams (the
    paper's slots) per aggregator, whose up- and downstream overlap; by default 2, or 1 where a second
    one would not pay (:meth:`channels_for`). ``threshold > 0``: blocks with every ``|x| <= threshold`` count as zero (lossy, as the
    reference's threshold). ``inplace=True`` writes the sum into the input tensor, as
    ``dist.all_reduce`` does (only the union's blocks are written). Otherwise results come from a
    cache of ``result_cache`` buffers, reused once the caller holds no reference to them (a fresh
    dense result would cost a page fault per page, more than a sparse sum itself).
    """

    name = "omnireduce"
    folds = True        # a predicted dense call skips its handshake (:mod:`.._fold`); it keeps the call record
    carries = frozenset({"dense", "aligned", "sparse", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"dense", "aligned", "quantized"})

    def __init__(self, fabric, block_size: int = 256, *, deployment: str = "colocated",
                 num_aggregators: int | None = None, lanes: int = 16384, channels: int | None = None,
                 threshold: float = 0.0, inplace: bool = False, result_cache: int = 2,
                 aggregator_bandwidth_gbps: float | None = None,
                 aggregator_latency_us: float | None = None, nonfinite: str = "raise") -> None:
        super().__init__(fabric)
        self.nonfinite = nonfinite_option(nonfinite, "omnireduce")
        for nm, v in (("block_size", block_size), ("lanes", lanes), ("channels", channels)):
            if v is None and nm == "channels":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidValueError(f"omnireduce: {nm} must be a positive integer, got {v!r}")
        if channels is not None and channels > wire.MAX_CHANNELS:
            raise InvalidValueError(f"omnireduce: at most {wire.MAX_CHANNELS} channels per aggregator, got {channels}")
        if deployment not in DEPLOYMENTS:
            raise InvalidValueError(f"omnireduce: deployment must be one of {', '.join(DEPLOYMENTS)}, "
                             f"got {deployment!r}")
        if not threshold >= 0:
            raise InvalidValueError(f"omnireduce: threshold must be >= 0, got {threshold!r}")
        n = fabric.world_size
        self._pool = Pool()
        self._results = ResultCache(result_cache)
        self.block_size, self.lanes, self.channels = block_size, lanes, channels
        self.block_grid = block_size
        self.deployment, self.threshold, self.inplace = deployment, float(threshold), inplace
        if deployment == "colocated":
            if num_aggregators not in (None, n):
                raise InvalidValueError(f"omnireduce: colocated runs one aggregator per worker ({n}), "
                                 f"got num_aggregators={num_aggregators}")
            self.num_aggregators = n
            self.aggregators = list(range(n))
            self.own: int | None = fabric.rank
        else:
            A = n if num_aggregators is None else num_aggregators
            if isinstance(A, bool) or not isinstance(A, int) or A < 1:
                raise InvalidValueError(f"omnireduce: num_aggregators must be a positive integer, got {A!r}")
            self.num_aggregators = A
            link = {}
            if aggregator_bandwidth_gbps is not None:
                link["bandwidth_gbps"] = aggregator_bandwidth_gbps
            if aggregator_latency_us is not None:
                link["latency_us"] = aggregator_latency_us
            self.aggregators = [fabric.service(f"omnireduce-agg:{i}", service_main(i, process=fabric.modelled_time),
                                               **link) for i in range(A)]
            self.own = None

    def wire_copies(self) -> float:
        """Dense payloads: colocated, ``2 (n-1)/n`` (the shards of the other aggregators up, the sums
        of its own down); dedicated, 1 (up; the sums come down). Scattered ``sparse`` payloads cost a
        whole block per value (see docs/transports.md, "Bytes on the wire")."""
        n = self.fabric.world_size
        return 2.0 * (n - 1) / n if self.deployment == "colocated" else 1.0

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.omnireduce_allreduce` of the call's densities with this
        transport's blocks, deployment, aggregators, channels and lanes (a repeated call's: its union's blocks
        per aggregator from ``call.union_density``, :meth:`channels_for`)."""
        per = -(-call.numel // self.block_size) / self.num_aggregators
        union = None if call.union_density is None else int(call.union_density * per)
        return costs.omnireduce_allreduce(
            self.fabric.world_size, call.numel, density=call.density, union_density=call.union_density,
            elem_size=call.elem_size, block_size=self.block_size, deployment=self.deployment,
            num_aggregators=self.num_aggregators,
            channels=self.channels_for(call.numel, call.elem_size, union), lanes=self.lanes,
            bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    # ------------------------------------------------------------------ public
    def allreduce(self, x, *, call=None):
        out = super().allreduce(x, call=call)
        if self.inplace and isinstance(x, torch.Tensor) and out.data_ptr() != x.data_ptr():
            with torch.no_grad():      # the sum is data, as the call's input (Transport.check_input)
                x.copy_(out)
            return x
        return out

    def channels_for(self, numel: int, itemsize: int = 4, union_blocks: int | None = None) -> int:
        """The channels per aggregator of a call of ``numel`` elements of ``itemsize`` bytes: ``channels`` if it
        was given; else :data:`CHANNELS` (the paper's several streams per aggregator, whose up- and downstream
        overlap) on a modelled network (``fabric.message_bytes`` is ``None``) and with dedicated aggregators (a
        worker's up- and downlink carry different streams), and on a real fabric colocated :data:`CHANNELS`
        where one channel would take more than one round (an aggregator's range of more than ``lanes``
        blocks), else one: colocated, every link direction carries the blocks of one aggregator's range
        and the sums of another's, so a second stream shortens no link's time, while each stream costs
        every endpoint its messages, its roles and, on gloo, the helper threads that watch its large
        receives (BENCHMARKS.md, "Transports on loopback").

        Except where the call is dense: ``union_blocks``, the most blocks of the union (the blocks the sum
        holds) in one aggregator's range the last time this call was made (:meth:`_noted_union`; None: not
        known), and they held at least ``fabric.message_bytes``: then :data:`CHANNELS`. One channel of such a
        range is two phases in sequence on every link direction (the blocks up, then, once summed, the sums of
        another range down), with the link idle while the last block arrives, is summed and its sums start;
        two streams overlap the first one's sum and sums with the second one's blocks (the dense MLP's 4.2 MB
        bucket on 2 hosts at 1 Gbit/s). A sparse call keeps one: its short messages do not amortise a second
        stream's (a 10 MB call at density 0.01 on 2 netbed hosts took 15.2 ms on two channels against 11.3 on
        one). Only where the split cannot change the sums' bits: on two workers, or a tensor of whole blocks
        (with three or more workers an in-place channel that ends with the short last block is summed in
        message order and the others in place, :func:`.strategies.homed`, so a split there would reorder the
        first part's additions).

        Every worker computes the same value from the same call and the same record (it is in the call's
        header and its fold key, checked for agreement: workers that differ get a
        :class:`~sparsecomm.errors.MismatchError`, never a hang)."""
        if self.channels is not None:
            return self.channels
        message_bytes = self.fabric.message_bytes
        if message_bytes is None or self.deployment != "colocated":
            return CHANNELS
        nb = -(-numel // self.block_size)
        if -(-nb // self.num_aggregators) > self.lanes:
            return CHANNELS
        same_bits = self.fabric.world_size == 2 or numel % self.block_size == 0
        dense = union_blocks is not None and union_blocks * self.block_size * itemsize >= message_bytes
        return CHANNELS if dense and same_bits else 1

    # --------------------------------------------------------------- protocol
    def _spec(self, numel: int, up: torch.dtype, kind: str, check: int = 0, absmax: int = 0) -> CallSpec:
        union = self._noted_union(_fold.schedule(self.fabric), numel, up, kind, check)
        return CallSpec(numel, up, self.block_size, self.num_aggregators,
                        self.channels_for(numel, up.itemsize, union), self.lanes, wire.KINDS.index(kind), check,
                        absmax)

    # ------------------------------------------------------------------ the union, noted
    def _union_key(self, sched: _fold.Schedule, numel: int, up: torch.dtype, kind: str, check: int) -> tuple:
        """The key under which the record (:meth:`_fold.Schedule.note`) keeps this call's union: its shape, without
        the channels that the union decides, and its identity (:meth:`_fold.Schedule.call_key`: the bucket, the
        round, the steps since the previous call)."""
        return ("omnireduce union", self.deployment, self.block_size, self.num_aggregators, self.lanes, numel,
                dtype_code(up), kind, check, *sched.call_key())

    def _noted_union(self, sched: _fold.Schedule | None, numel: int, up: torch.dtype, kind: str,
                     check: int) -> int | None:
        """The union's most blocks in one aggregator's range, the last time this call completed (None: no record,
        or not made since the record was last reset), as :meth:`_note_union` noted it on every worker."""
        if sched is None:
            return None
        return sched.noted(self._union_key(sched, numel, up, kind, check))

    def _note_union(self, sched: _fold.Schedule, spec: CallSpec) -> None:
        """Note in the record the union of the call just completed (the blocks its result received, the same on
        every worker): its most blocks in one aggregator's range, for the next call of the same key
        (:meth:`channels_for`). An error clears it with the record, on every worker."""
        sink = self._last_sink
        if sink is None:
            return
        ids = sink.written_ids()
        nb, A = -(-spec.numel // spec.block_size), spec.num_aggregators
        bounds = np.searchsorted(ids, [a * nb // A for a in range(A + 1)])
        most = int(np.diff(bounds).max()) if ids.size else 0
        sched.note(self._union_key(sched, spec.numel, spec.up, wire.KINDS[spec.kind], spec.check), most)

    def _run(self, spec: CallSpec, source, make_sink, home: bool = False):
        """One call on this worker: its fold (:meth:`_enter`), the agreement handshake unless the call was
        predicted, the protocol (:func:`.worker.run_worker`), and a predicted call's check for a deviator
        (a NaN first element: :meth:`_resolve`); then the call is recorded."""
        sched, key, fold, fast = self._enter(spec, source)
        # the agreement header every transport's workers exchange first (fixed size, the transport's name
        # in it): a rank that runs another transport gets a MismatchError naming both, on every rank. It
        # runs to its end first, in the call's own drive (the role is made by run_worker on this thread).
        # A predicted call has none (a deviator joins it with NaN instead: :meth:`_enter`)
        first = None if fast else functools.partial(agreement_role, self.fabric, what=wire.WHAT,
                                                     transport=self.name)
        self._pending = None
        self._last_sink = None

        def sink_of(down):   # (remembered: its written blocks are what the finiteness guard checks)
            out, sink = make_sink(down)
            self._last_sink = sink
            return out, sink

        fabric = self.fabric
        if trace.enabled():
            self._traced = getattr(self, "_traced", -1) + 1
            fabric = trace.TraceFabric(fabric, trace.enabled(), self._traced)
        try:
            out = run_worker(fabric, spec, source, sink_of, self.aggregators, self.own, self._pool,
                             home=home, first=first)
            if fabric is not self.fabric:
                fabric.dump()
        except BaseException:
            if self._pending is not None:   # a half-written cached result must not be reused
                self._results.discard(self._pending[0])
            raise
        if self._pending is not None:       # a cached result: zero its stale blocks
            cleared = ResultCache.done(*self._pending)
            if cleared:     # (zeroed by index: their rows and bytes, the host model's "index" and "move", sim_host)
                self.fabric.host_work("index", cleared)
                self.fabric.host_work("move", cleared * spec.block_size * self._pending[1].out.element_size())
            self._pending = None
        if fast:
            sched.folded += 1
            if bool(torch.isnan(out[0][:1]).any()):    # a deviator's NaN fills every block: the handshake
                self._resolve(spec)
        if sched is not None:
            self._note_union(sched, spec)
            sched.record(key, fold)
        return out

    # ------------------------------------------------------------------ fold
    def _enter(self, spec: CallSpec, source):
        """The call's place in the fabric's record of calls (:mod:`.._fold`): ``(schedule, key, fold,
        fast)``. ``fold``: how a deviator joins this call (a dense float call of at most
        :data:`.._fold.FOLD_MAX_BYTES`; else None); ``fast``: this call is the predicted one (it skips
        its handshake). A call that is not the predicted one joins the predicted call first (NaN) and
        runs its handshake (:meth:`_resolve`), which meets those of the workers that took the fast path
        (or of the other deviators: all agree when every worker changed alike). No record (the
        SimFabric, one worker): ``(None, None, None, False)``."""
        sched = _fold.schedule(self.fabric)
        if sched is None:
            return None, None, None, False
        key = ("omnireduce", self.deployment, *self.aggregators, *self._fields(spec).values(),
               *sched.call_key())
        fold = None
        nbytes = spec.numel * spec.up.itemsize
        if (isinstance(source, DenseSource) and spec.kind == wire.KINDS.index("dense") and spec.up.is_floating_point
                and 0 < nbytes <= _fold.FOLD_MAX_BYTES):
            fold = _fold.Fold(key, spec.numel, spec.up, source.flat.device, functools.partial(self._join, spec))
        predicted = sched.predicted()
        fast = predicted is not None and fold is not None and predicted.key == key
        if predicted is not None and not fast:
            sched.deviate(predicted)
            self._resolve(spec)
        return sched, key, fold, fast

    @staticmethod
    def _fields(spec: CallSpec) -> dict:
        """What a fold's handshake compares: the call's description (the round-0 header's fields)."""
        return {"length": spec.numel, "dtype": dtype_code(spec.up),
                "payload_kind": KIND_CODE[wire.KINDS[spec.kind]], "block_size": spec.block_size,
                "aggregators": spec.num_aggregators, "channels": spec.channels, "lanes": spec.lanes,
                "shared_check": spec.check}

    def _resolve(self, spec: CallSpec) -> None:
        """The handshake of a call whose fold may have failed (:mod:`.._fold`): a deviator's after it
        joined the predicted call, a predicted call's whose sum has a NaN first element. Workers that
        disagree (another call, another transport) raise :class:`~sparsecomm.errors.MismatchError` on every
        worker; if all agree the NaN is the data's (the non-finite rules then apply)."""
        check_agreement(self.fabric, wire.WHAT, transport=self.name, **self._fields(spec))

    def _join(self, spec: CallSpec, vector: torch.Tensor) -> None:
        """A deviator's part in the predicted call ``spec`` (:meth:`_fold.Schedule.deviate`): the protocol run
        on ``vector`` (NaN in every block), without a handshake, its sum dropped."""
        def sink(down):
            out = torch.zeros(spec.numel, dtype=down)
            return out, BlockSink(out, spec.block_size)

        run_worker(self.fabric, spec, DenseSource(vector, spec.block_size, lazy=not self.fabric.modelled_time), sink,
                   self.aggregators,
                   self.own, self._pool)

    def _result(self, numel: int, dtype: torch.dtype):
        """A zero result tensor and its sink (from the result cache)."""
        out, entry = self._results.take(numel, dtype, self.block_size)
        sink = BlockSink(out, self.block_size)
        self._pending = (entry, sink)
        return out, sink

    @staticmethod
    def _check_dtype(dt: torch.dtype) -> None:
        check_dtype(dt, "omnireduce", wire.DTYPES)

    def _sum_blocks(self, flat: torch.Tensor, kind: str, check: int = 0, inplace: bool = False) -> torch.Tensor:
        """Sum a flat dense tensor (float, or integer codes) over workers, skipping zero blocks."""
        self._check_dtype(flat.dtype)
        flat = flat.contiguous()
        absmax = 0
        if not flat.is_floating_point() and flat.numel():
            absmax = max(int(flat.max()), -int(flat.min()))
        thr = self.threshold if flat.is_floating_point() else 0.0
        # scanned range by range on a real fabric (a worker sends one aggregator's blocks while it scans the
        # rest); on one of modelled time in one pass (the host model charges the pieces all the same)
        source = DenseSource(flat, self.block_size, thr, lazy=not self.fabric.modelled_time)
        spec = self._spec(flat.numel(), flat.dtype, kind, check, absmax)

        def make_sink(down: torch.dtype):
            if inplace and down == flat.dtype:   # (blocks under the threshold: zeroed range by range, DenseSource.settle)
                return flat, BlockSink(flat, self.block_size)
            return self._result(flat.numel(), down)

        # in place on floats summed in their own dtype: the hosted aggregator sums into the input itself
        home = inplace and flat.dtype in (torch.float32, torch.float64)
        out, _ = self._run(spec, source, make_sink, home=home)
        if out.is_floating_point():   # every worker holds the same sums: every worker raises alike
            self._guard(out, None if out is flat else flat)
        return out

    def _guard(self, out: torch.Tensor, local: torch.Tensor | None) -> None:
        """NaN/Inf in the float sum ``out``: only the blocks the call wrote are checked (the rest is zero;
        :meth:`BlockSink.written_finite`), so a sparse call does not pay a pass over the whole result."""
        sink = self._last_sink
        if self.nonfinite == "pass":
            return
        own = sink is not None and sink.out is out
        if self.fabric.charges_host_work:    # (the elements the check reads: the host model's "check", sim_host)
            self.fabric.host_work("check", _checked(sink) if own else out.numel())
        if own and sink.written_finite():
            return
        guard_finite(self.fabric, "omnireduce allreduce", out, local, self.nonfinite)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        out = self._sum_blocks(flat, "dense", inplace=self.inplace)
        if is_integer(flat.dtype):   # summed exactly, sent back in the narrowest type that holds it
            out = narrow(out.to(torch.int64), flat.dtype, "omnireduce allreduce")
        return out

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        """The operand's vector summed as blocks (its kind and shared indices' or scale's checksum in the
        header); dense integers summed exactly and range-checked against the payload's dtype."""
        out = self._sum_blocks(op.vector, op.kind, check=op.check)
        if op.kind == "dense" and is_integer(out.dtype) and is_integer(op.dtype):
            return narrow(out.to(torch.int64), op.dtype, "omnireduce allreduce")
        return out

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        if p.kind != "sparse":
            return super()._allreduce_payload(p)
        self._check_dtype(p.dtype)
        source = PackedSource(p.indices, p.values, p.numel, self.block_size, p.dtype)
        integer = is_integer(p.dtype)
        spec = self._spec(p.numel, p.dtype, "sparse", absmax=abs_max(p.values) if integer else 0)

        out, _ = self._run(spec, source, lambda down: self._result(p.numel, down))
        if integer:
            return narrow(out.to(torch.int64), p.dtype, "omnireduce allreduce")
        self._guard(out, p.values)
        return out
