""":class:`CommPipeline`: one worker's method + transport, taking one flat bucket through
``method.encode -> transport.start -> method.decode``, composed of objects that own their state:

- the method and the transport, built once from names or objects (:func:`sparsecomm.methods.build`,
  :mod:`sparsecomm.pipeline.resolve`) and checked to fit;
- :class:`~sparsecomm.pipeline.states.StateStore` (the method states by bucket key) and
  :class:`~sparsecomm.pipeline.states.Generators` (the compressor's randomness), which checkpoints
  carry;
- the round strategies of :meth:`CommPipeline.start` (:mod:`sparsecomm.pipeline.rounds`) and the
  row-sparse rounds (:class:`~sparsecomm.pipeline.sparse_rows.SparseRows`), all applying the
  non-finite rule (:mod:`sparsecomm.pipeline.nonfinite`) and recorded by one
  :class:`~sparsecomm.pipeline.accounting.Accounting`.

It uses only the transport's public API (``start``, ``run``, ``last_stats``, ``can_carry``,
``wire_copies``).

**Asynchronous rounds.** :meth:`CommPipeline.start` encodes on the calling thread (so the compressor's
generator and the method state advance in call order, which the optimizer and the hook keep identical
on every worker and identical to the synchronous order) and hands the payload to the transport's
communication thread, which decodes right after the sum; ``start(...).wait()`` is :meth:`reduce`.
A method's state is per bucket key, so decoding bucket ``a`` on the communication thread while bucket
``b`` is encoded on the caller's thread touches disjoint state: the results are bit-identical to the
synchronous path.

**Transactions** (``nonfinite="skip"``). :meth:`CommPipeline.begin_step` opens a journal of the method
states and generators (:mod:`sparsecomm.pipeline.states`) and :meth:`CommPipeline.end_step`, called by the
frontend once every call of the step has completed, commits it, or rolls it back when a round of the step
had a non-finite sum (the same on every worker: every worker's sum is the same non-finite one), so that a
skipped step leaves every worker as it found it; the frontends skip the rest of the step (the optimizer its
inner step, a ``GradScaler`` the optimizer's step after DDP's backward).

**Call identity.** Every call of a step is named ``CallId(bucket key, step, round)``
(:meth:`CommPipeline.call_id`; :meth:`CommPipeline.begin_step` starts a step), which every worker's
agreement compares.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable

import torch

from .. import methods
from ..compressors._common import divide_finite
from ..compressors.base import Compressor
from ..errors import IncompatibleError, InvalidValueError, MismatchError
from ..fabric import trace as _trace
from ..fabric.base import Fabric
from ..fabric.engine import CommWork
from ..fabric.stats import CommStats
from ..methods.base import Method
from ..transports.base import CallId, Transport
from ..validate import check_int, check_seed
from .accounting import Accounting, CompressionStats, payload_bytes
from .auto import SWITCH_TRANSPORTS, Chooser, block_density, options as auto_options
from .nonfinite import NONFINITE, NonFiniteRule
from .resolve import build_transport, warn_unguaranteed
from .rounds import BucketRounds, Call, DirectRound, Outputs, ParameterRounds, PlainRound
from .settings import describe
from .sparse_rows import SPARSE_ROWS, SparseRows
from .states import Generators, StateStore


class CommPipeline:
    """One worker's method + transport: ``start(flat, key).wait()`` is the averaged estimate.

    ``CommPipeline(compressor=None, transport="default", *, method=None, transport_kwargs=None, fabric=None,
    seed=0, nonfinite="raise", sparse_rows="gather", warmup_steps=0, **hyper)``: ``compressor``,
    ``method`` and ``**hyper`` as :func:`sparsecomm.methods.build` takes them (the method is wrapped in
    :func:`sparsecomm.methods.warmup` for ``warmup_steps``), ``transport`` as
    :func:`~sparsecomm.pipeline.resolve.build_transport`. Shared by
    :class:`~sparsecomm.DistributedOptimizer` and the DDP comm hook (:mod:`sparsecomm.ddp`).
    """

    def __init__(self, compressor: str | Compressor | None = None, transport: str | Transport = "default",
                 *, method: str | Method | None = None, transport_kwargs: dict | None = None,
                 fabric: Fabric | None = None, seed: int = 0, nonfinite: str = "raise",
                 sparse_rows: str = "gather", warmup_steps: int = 0, **hyper: Any) -> None:
        if sparse_rows not in SPARSE_ROWS:
            raise InvalidValueError(f"sparse_rows must be one of {', '.join(map(repr, SPARSE_ROWS))}, got {sparse_rows!r}")
        if nonfinite not in NONFINITE:
            raise InvalidValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
        warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        seed = check_seed("seed", seed)
        if nonfinite == "skip" and isinstance(transport, str) and transport in SWITCH_TRANSPORTS:
            raise IncompatibleError(f"nonfinite='skip' needs a transport that sums NaN/Inf through; transport "
                                    f"{transport!r} (fixed point) raises NonFiniteError on them. Use ring, "
                                    f"omnireduce, allgather or native, or nonfinite='raise'")
        self.method = methods.warmup(methods.build(compressor, method, **hyper), warmup_steps)
        warn_unguaranteed(self.method)
        auto = isinstance(transport, str) and transport == "auto"
        opts = auto_options(transport_kwargs) if auto else None
        self.transport = build_transport(transport, self.method, fabric, None if auto else transport_kwargs)
        self.transport_kwargs = dict(transport_kwargs or {})
        #: whether the transport was given by name (a lane builds its own from it: :meth:`add_lane`)
        self.transport_by_name = isinstance(transport, str)
        # the transports of the lanes after the first (:meth:`add_lane`; lane 0 is :attr:`transport`)
        self._lanes: list[Transport] = []
        self.warmup_steps = int(warmup_steps)
        self._follow_rule(self.transport, nonfinite)
        self.rule = NonFiniteRule(nonfinite, self.transport)
        #: the per-bucket choice of ``transport="auto"`` (:mod:`sparsecomm.pipeline.auto`), else None
        self.chooser: Chooser | None = None
        if auto:
            comp = self.method.compressor
            fab = self.transport.fabric

            def make(name: str) -> Transport:
                t = build_transport(name, self.method, fab, None)
                self._follow_rule(t, nonfinite)
                return t

            self.chooser = Chooser(self.transport, make, comp.payload_kind, comp.shared_scale,
                                   multi_round=self.method.multi_round, nonfinite=nonfinite, opts=opts)
            self.rule.checks_sums = self.rule.check   # a chosen transport may not check its sums itself
        self.nonfinite = nonfinite
        self.fabric = self.transport.fabric
        self.world_size = int(self.fabric.world_size)
        self.rank = int(self.fabric.rank)
        self.seed = int(seed)
        self.shared_randomness = self.method.compressor.shared_randomness
        #: whether the method is plain averaging (method ``none`` around the identity): its rounds skip
        #: the compressor's copy (and, as DDP, its finiteness check), and row-sparse gradients travel as
        #: rows (:meth:`start_sparse`)
        self.plain = self.method.name == "none" and self.method.compressor.name == "identity"
        #: the method states by bucket key (the method object holds none)
        self.states = StateStore(self.method)
        #: the compressor's generators
        self.generators = Generators(self.seed, self.rank, self.shared_randomness)
        #: the byte counts of every round
        self.accounting = Accounting(self.transport)
        self.rows = SparseRows(sparse_rows, self.transport, self.rule, self.accounting)
        self.sparse_rows = sparse_rows
        outputs = Outputs()
        self._plain_round = PlainRound(self.rule, self.world_size, self.fabric)
        self._parameter_rounds = ParameterRounds(self.method, self.states, self.generators, self.rule, outputs,
                                                 self.world_size, self.fabric)
        self._bucket_rounds = BucketRounds(self.method, self.states, self.generators, self.rule, outputs,
                                           self.world_size, self.fabric)
        # the rounds chain() runs with the fewest calls (a fabric without modelled time)
        self._direct_round = None if self.fabric.modelled_time else DirectRound(
            self.method, self.states, self.generators, self.rule, outputs, self.world_size, self.accounting,
            self.transport)
        #: steps begun (:meth:`begin_step`): part of every call's identity, and of checkpoints
        self.step = 0
        #: steps skipped (``nonfinite="skip"``: :meth:`end_step` rolled them back), among :attr:`step`
        self.skipped = 0
        self._open = False          # a step begun and not yet ended (end_step)

    @staticmethod
    def _follow_rule(transport: Transport, nonfinite: str) -> None:
        """The transport's own NaN/Inf rule follows the pipeline's ``"pass"`` and ``"skip"``."""
        if nonfinite == "skip" and not transport.sums_nonfinite:
            raise IncompatibleError(f"nonfinite='skip' needs a transport that sums NaN/Inf through; transport "
                                    f"{transport.name!r} (fixed point) raises NonFiniteError on them")
        if nonfinite in ("pass", "skip") and transport.nonfinite != "pass":
            transport.nonfinite = "pass"

    # ------------------------------------------------------------------ configuration
    def settings(self) -> list[tuple[str, str]]:
        """The configuration the workers must share (:mod:`sparsecomm.pipeline.settings`): the method,
        its compressor, their hyper-parameters, the transport and its options, then ``warmup_steps``,
        ``seed``, ``nonfinite`` and ``sparse_rows``; the frontends add their own and agree on them at
        construction (:func:`sparsecomm.pipeline.settings.agree`)."""
        if self.chooser is not None:
            head = describe(self.method, self.transport) + [("transport_kwargs of 'auto'",
                                                             repr(sorted(self.transport_kwargs.items())))]
        else:
            head = describe(self.method, self.transport, self.transport_kwargs)
        return head + [
            ("warmup_steps", repr(self.warmup_steps)), ("seed", repr(self.seed)),
            ("nonfinite", repr(self.nonfinite)), ("sparse_rows", repr(self.sparse_rows))]

    @property
    def per_parameter(self) -> bool:
        """Whether :meth:`start` runs the method per parameter (``segments=``): a one-round method
        whose payloads concatenate (``dense``, ``aligned``, ``sparse``), unless the method keeps no
        state and its compressor is ``elementwise`` (the fp16/bf16 casts): then the whole bucket's
        round is the same numbers, in one call."""
        c = self.method.compressor
        if self.method.State is None and c.elementwise:
            return False
        return not self.method.multi_round and not self.method.uses_shapes and \
            c.payload_kind in ("dense", "aligned", "sparse")

    def add_lane(self, fabric: Fabric) -> int:
        """Build this pipeline's transport (the same name and options) on ``fabric``, another lane of the
        pipeline's fabric (:mod:`sparsecomm.pipeline.lanes`); returns the lane's number for :meth:`start`."""
        if not self.transport_by_name or self.chooser is not None:
            raise IncompatibleError("a lane builds its transport from the pipeline's transport name: pass the "
                                    "transport by name (not 'auto', not an object)")
        t = build_transport(self.transport.name, self.method, fabric, self.transport_kwargs or None)
        self._follow_rule(t, self.nonfinite)
        self._lanes.append(t)
        return len(self._lanes)

    def lane_transport(self, lane: int) -> Transport:
        """The transport of ``lane`` (0: :attr:`transport`; :meth:`add_lane`)."""
        return self._lanes[lane - 1] if lane else self.transport

    # ------------------------------------------------------------------ rounds
    def reduce(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False,
               compress: bool = True, shapes: Any = None) -> torch.Tensor:
        """``start(flat, key, ...).wait()``: the averaged estimate (see :meth:`start`)."""
        return self.start(flat, key, exact=exact, compress=compress, shapes=shapes).wait()

    def start(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False, compress: bool = True,
              shapes: Any = None, segments: tuple[tuple[str, int], ...] | None = None,
              then: Callable[[torch.Tensor], Any] | None = None, lane: int = 0,
              dense_bytes: int | None = None) -> CommWork:
        """Start the round of bucket ``key`` on this worker's flat ``flat``; ``wait()`` returns the
        averaged estimate (or ``then(estimate)``, run on the communication thread).

        ``compress=False`` bypasses the method (plain average, no state); ``exact=True`` runs the
        method's exact (uncompressed) round. ``flat`` is scratch: the method may overwrite it and a
        transport built with ``inplace=True`` may write the sum into it. The result is the transport's
        output divided in place (a fresh tensor, or ``flat`` itself), or the method's estimate written
        into this bucket's persistent buffer; either stays valid until the next round of ``key``
        (callers keep views of it, as DDP's ``gradient_as_bucket_view``). ``flat`` must not be touched
        until the work completes. A method of several rounds (``next_round``,
        :mod:`sparsecomm.methods.base`) runs its later rounds on the communication thread right after the
        previous sum; ``shapes`` (the tensors laid out in ``flat``) is passed to the method.

        ``segments`` (``(name, numel)`` of the parameters laid out in ``flat``, in order), where
        :attr:`per_parameter` holds: the method runs per *parameter*
        (:class:`~sparsecomm.pipeline.rounds.ParameterRounds`), so that the result does not depend on
        how the parameters are grouped into buckets (see :mod:`sparsecomm.ddp`).

        ``lane``: the lane whose transport runs the call (:meth:`add_lane`; 0: :attr:`transport`), on
        that lane's communication thread; the caller orders the lanes' outcomes
        (:class:`~sparsecomm.pipeline.lanes.CallOrder`).

        ``dense_bytes`` (a plain average only): the bytes that ``flat`` averages, where it holds more than them
        (the DDP hook's fused step places its buckets on the transport's block grid with zeros between them); the
        records count these (default: ``flat.nbytes``).
        """
        steps_before = max(0, self.step - 1 - self.skipped)    # (the steps committed before this one)
        identity = self.call_id(key)
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        if not compress or self.plain:
            call = self._plain_round.begin(flat, key, dense_bytes=dense_bytes)
        elif segments is not None and self.per_parameter:
            call = self._parameter_rounds.begin(flat, key, steps_before, exact, segments)
        else:
            call = self._bucket_rounds.begin(flat, key, steps_before, exact, shapes)
        if _trace.recorder is not None:
            self._phase("encode", t0, identity)
        t, seen = (self._lanes[lane - 1] if lane else self.transport), None
        if self.chooser is not None:
            kind = "dense" if not compress or self.plain or exact else self.chooser.kind
            t = self.chooser.pick(key, kind, flat)
            if call.next_round is None and self.chooser.observing():
                # this worker's density, before an in-place transport writes the sum over the message
                seen = (key, kind, t.name, block_density(call.sent, self.chooser.block), payload_bytes(call.sent))
        later = None if call.next_round is None else (lambda agg: self._next_round(call, agg, t, identity))
        return t.start(call.sent, then=lambda agg: self._finish(call, agg, then, t, seen, identity),
                       next_round=later, call=identity)

    def chain(self, flat: torch.Tensor, key: Hashable, *, compress: bool = False,
              done: Callable[[Any, BaseException | None], None] | None = None) -> "torch.futures.Future | CommWork | None":
        """Bucket ``key``'s round as :meth:`start` runs it (the same encode, call, checks, decode and records),
        its completion chained on the transport's collective where the transport chains it
        (:meth:`Transport.chain <sparsecomm.transports.base.Transport.chain>`: a predicted ``native``
        all-reduce, the DDP hook's steady state): a ``torch.futures.Future`` of the estimate;
        ``done(value, error)`` runs before it completes. Chained: the plain average (``flat`` summed in
        place, then divided by n) and, with ``compress``, the round of a stateless one-round method around
        an elementwise compressor (the fp16/bf16 casts: its payload is the round's own, summed in place,
        and the sum is widened into ``flat``, as torch's ``fp16_compress_hook`` decompresses into the
        bucket, before the method's decode; or widened by the decode itself, in the same pass as its division,
        where the method :attr:`~sparsecomm.methods.base.Method.decodes_narrow`) whose sums the transport checks;
        in both, the pass that divides checks the sum for the transport (``checks``: :func:`divide_finite
        <sparsecomm.compressors._common.divide_finite>`, :meth:`Method.decode_finite
        <sparsecomm.methods.base.Method.decode_finite>`; on a fabric without modelled time and with no trace recording,
        through the method's direct calls, :class:`~sparsecomm.pipeline.rounds.DirectRound`: the same numbers, state
        and records with the fewest calls). A compressed round that the transport does not chain after all
        was encoded: it is started (:meth:`start`'s :class:`~sparsecomm.fabric.engine.CommWork`, which
        ``done`` is not given). None when nothing was done (any other round, ``transport="auto"``): use
        :meth:`start`."""
        if self.chooser is not None:
            return None
        t, identity = self.transport, CallId(key, self.step)       # (call_id(key), inlined)
        if not compress or self.plain:
            # where the transport checks the sum (not rule.checks_sums), the division's pass checks it for it
            checks = not self.rule.checks_sums
            if checks and self._plain_round.fabric is None:
                # (PlainRound.begin(checked=True)'s call and its _finish_checked in one: nothing is charged)
                return t.chain(flat, identity, functools.partial(self._finish_plain, flat.nbytes, identity), done,
                               checks=True)
            call = self._plain_round.begin(flat, key, checked=checks)
            finish = (functools.partial(self._finish_checked, call, identity) if checks else
                      lambda agg: self._finish(call, agg, None, t, None, identity))
            return t.chain(flat, identity, finish, done, checks=checks)
        m = self.method
        if not (m.State is None and m.compressor.elementwise and not m.multi_round and not m.uses_shapes
                and not self.rule.checks_sums):
            return None
        # the transport checks the sum (not rule.checks_sums): the decode's pass checks it for it
        steps_before = self.step - 1 - self.skipped
        if steps_before < 0:
            steps_before = 0
        if _trace.recorder is None and self._direct_round is not None:
            # (what follows, with the fewest calls: nothing charged, no phases recorded)
            payload, finish = self._direct_round.begin(flat, key, steps_before)
            fut = t.chain(payload, identity, finish, done, scratch=True, out=None if m.decodes_narrow else flat,
                          narrow=m.decodes_narrow, checks=True)
            return fut if fut is not None else t.start(payload, then=lambda agg: finish(agg)[0], call=identity)
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        call = self._bucket_rounds.begin(flat, key, steps_before, False, None, checked=True)
        if _trace.recorder is not None:
            self._phase("encode", t0, identity)
        finish = functools.partial(self._finish_checked, call, identity)
        # a method that widens the narrow sum itself gets it as summed (one pass less), else it is widened
        # into flat (scratch)
        fut = t.chain(call.sent, identity, finish, done, scratch=True, out=None if m.decodes_narrow else flat,
                      narrow=m.decodes_narrow, checks=True)
        # (started instead: the transport checks the sum before then, so it is finite there)
        return fut if fut is not None else t.start(call.sent, then=lambda agg: finish(agg)[0], call=identity)

    def _next_round(self, call: Call, agg: torch.Tensor, t: Transport, identity: CallId | None = None) -> Any:
        """A later round's message (on the communication thread); the round just summed is recorded."""
        done = call.last
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        nxt = call.next_round(agg)
        if _trace.recorder is not None:
            self._phase("encode", t0, identity)
        if nxt is not None:
            self.accounting.round(done, t.last_stats, t.wire_copies())
        return nxt

    def _finish(self, call: Call, agg: torch.Tensor, then: Callable[[torch.Tensor], Any] | None,
                t: Transport, seen: tuple | None, identity: CallId | None = None, checked: bool = False) -> Any:
        """The estimate from the last sum (on the communication thread); the last round and the call
        are recorded (and, under ``transport="auto"``, measured). ``checked``: the call's finish also
        checks the sum (:meth:`PlainRound.begin <sparsecomm.pipeline.rounds.PlainRound.begin>`), and so does
        this: ``(estimate, finite)``, nothing recorded for a non-finite sum (the transport raises)."""
        if seen is not None:
            s = t.last_stats
            self.chooser.observe(*seen, agg, s.modelled_time_s if self.fabric.modelled_time else s.wall_time_s)
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        out = call.finish(agg)
        if checked:
            out, finite = out
            if not finite:
                return out, False
        if _trace.recorder is not None:
            self._phase("decode", t0, identity)
        copies = None if t is self.transport else t.wire_copies()      # (None: the pipeline's, kept)
        self.accounting.finished(call.dense_bytes, call.last, t.last_stats, copies)
        if checked:
            return (out if then is None else then(out)), True
        return out if then is None else then(out)

    def _finish_checked(self, call: Call, identity: CallId, agg: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """:meth:`_finish` of a call on the pipeline's own transport whose finish checks the sum (``checked``),
        with nothing measured (:meth:`chain`'s rounds): ``(estimate, finite)``, the call and its one round
        recorded (:meth:`Accounting.finished <sparsecomm.pipeline.accounting.Accounting.finished>`) unless the
        sum is not finite (the transport raises)."""
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        out, finite = call.finish(agg)
        if not finite:
            return out, False
        if _trace.recorder is not None:
            self._phase("decode", t0, identity)
        self.accounting.finished(call.dense_bytes, call.last, self.transport.last_stats)
        return out, True

    def _finish_plain(self, nbytes: int, identity: CallId, agg: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """:meth:`_finish_checked` of a plain average of ``nbytes`` on an unmodelled fabric (:meth:`chain`): the sum
        divided by n in place in the pass that checks it (:meth:`PlainRound.begin
        <sparsecomm.pipeline.rounds.PlainRound.begin>`'s checked finish, bit for bit), then the call and its round
        recorded (:meth:`Accounting.finished_plain <sparsecomm.pipeline.accounting.Accounting.finished_plain>`),
        unless the sum is not finite: ``(average, finite)``."""
        t0 = self.fabric.now() if _trace.recorder is not None else 0.0
        if not divide_finite(agg, self.world_size):
            return agg, False
        if _trace.recorder is not None:
            self._phase("decode", t0, identity)
        self.accounting.finished_plain(nbytes, self.transport.last_stats)
        return agg, True

    def _phase(self, name: str, t0: float, identity: CallId | None) -> None:
        """Record the pipeline's ``name`` (``"encode"``, ``"decode"``) from ``t0`` to now on the active timeline
        (:mod:`sparsecomm.trace`; nothing when none records): what a per-step breakdown sets apart from the
        transport's calls. ``identity``: the call's first round."""
        rec = _trace.recorder
        if rec is None:
            return
        rec.phase(self.fabric, name, t0, self.fabric.now(), {"call": str(identity)} if identity is not None else {})

    def start_sparse(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable,
                     dtype: torch.dtype | None = None) -> CommWork:
        """Start the plain average of a row-sparse gradient of a parameter of ``shape`` (bucket ``key``):
        :meth:`SparseRows.start <sparsecomm.pipeline.sparse_rows.SparseRows.start>`."""
        return self.rows.start(grad, shape, key, self.call_id(key), dtype)

    def call_id(self, key: Hashable, round: int = 0) -> CallId:
        """The identity of this step's call for bucket ``key`` (what every worker's agreement
        compares: :class:`~sparsecomm.transports.base.CallId`)."""
        return CallId(key, self.step, round)

    def begin_step(self, step: int | None = None) -> None:
        """Start a new step: its calls' identity (:meth:`call_id`) and a new ``last_stats``
        accumulation (one per optimizer step); under ``nonfinite="skip"``, a journal of the method states
        and generators the step touches (a step begun and never ended is ended here first:
        :meth:`end_step`).

        Args:
            step: the step's number (1 for the first) as the frontend counts its steps (the counter its
                checkpoints restore and its replica guard reads), so that workers whose counters differ
                make different calls, which their agreement refuses; ``None``: the next number.
        """
        if self._open:
            self.end_step()
        self.step = self.step + 1 if step is None else int(step)
        self._open = True
        if self.rule.skip:
            self.rule.flagged = False
            self.states.begin()
            self.generators.begin()
        self.accounting.begin_step()
        if self.chooser is not None:
            self.chooser.begin_step(self.step)
            self.accounting.stats.decisions = self.chooser.table()

    def end_step(self) -> bool:
        """End the step begun by :meth:`begin_step`, once every call of it has completed; returns whether
        it was skipped: under ``nonfinite="skip"``, when a round had a non-finite sum (the same answer on
        every worker), every method state and generator is put back as it was before the step and the
        step is counted in ``skipped_steps``; otherwise the step's changes are kept. A second call (or one
        with no step begun) returns False and does nothing."""
        if not self._open:
            return False
        self._open = False
        if not self.rule.skip:
            return False        # (no journal was opened: begin_step opens one under "skip" only)
        if self.rule.flagged:
            self.rule.flagged = False
            self.states.rollback()
            self.generators.rollback()
            self.skipped += 1
            self.accounting.stats.skipped_steps += 1
            return True
        self.states.commit()
        self.generators.commit()
        return False

    # ------------------------------------------------------------------ figures
    @property
    def last_stats(self) -> CommStats:
        """The current step's CommStats, summed over its rounds."""
        return self.accounting.last_stats

    @property
    def stats(self) -> CompressionStats:
        """The cumulative counters, the current step's rounds included."""
        return self.accounting.stats

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The method states and their layout, the generators, the step, and who saved them."""
        return {**self.states.state_dict(), **self.generators.state_dict(),
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "shared_randomness": self.shared_randomness, "step": self.step, "skipped": self.skipped,
                "compressor": self.compressor_name}

    @property
    def compressor_name(self) -> str:
        """The name of the method's compressor (its class name if it has none), as checkpoints record it."""
        comp = self.method.compressor
        return comp.name or type(comp).__name__

    def check_saved_by(self, state: dict[str, Any]) -> None:
        """Raise :class:`~sparsecomm.errors.MismatchError` naming both unless ``state`` (a
        :meth:`state_dict`) was saved by this method with this compressor (a state from before checkpoints
        named the compressor: the method, and whether the generators were shared across workers)."""
        saved = state.get("method")
        method = saved.get("method") if isinstance(saved, dict) else None
        comp = state.get("compressor")
        shared = state.get("shared_randomness")
        differs = (method is not None and method != self.method.name) or (
            comp is not None and comp != self.compressor_name)
        if comp is None and shared is not None and bool(shared) != self.shared_randomness and (
                state.get("generators") or state.get("param_generators")):
            differs = True      # generators seeded per worker loaded as shared ones, or the reverse
        if not differs:
            return
        was = f"method {method!r} with compressor {comp!r}" if comp is not None else (
            f"method {method!r} with a compressor whose randomness was "
            f"{'shared by' if shared else 'its own on'} every worker")
        raise MismatchError(
            f"this checkpoint's sparsecomm state was saved by {was}; it cannot be loaded into method "
            f"{self.method.name!r} with compressor {self.compressor_name!r} (its method state and generators "
            f"are that method's and compressor's). Build the optimizer or hook state with the checkpoint's "
            f"method and compressor, or start the method afresh: load the optimizer's state dict without "
            f"its 'sparsecomm' entry (the DDP hook: do not load its state)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; a state saved on another rank or world size raises
        :class:`~sparsecomm.errors.MismatchError` (unless it holds nothing rank-specific), as does one saved
        by another method or compressor (:meth:`check_saved_by`)."""
        self.check_saved_by(state)
        # a stateless method with shared (or no) randomness has nothing rank-specific
        rank_free = self.method.State is None and (self.shared_randomness or not (
            state.get("generators") or state.get("param_generators")))
        if state.get("world_size") != self.world_size or (state.get("rank") != self.rank and not rank_free):
            raise MismatchError(
                f"sparsecomm state saved on rank {state.get('rank')} of {state.get('world_size')} "
                f"cannot be loaded on rank {self.rank} of {self.world_size} (the method state is per "
                f"worker); delete the 'sparsecomm' entry to load only the inner optimizer's state")
        self._open = False
        self.states.load_state_dict(state)
        self.step = int(state.get("step", 0))
        self.skipped = int(state.get("skipped", 0))
        self.generators.load_state_dict(state)
