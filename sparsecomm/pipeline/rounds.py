"""The round strategies of :meth:`CommPipeline.start <sparsecomm.pipeline.core.CommPipeline.start>`:
how one flat bucket becomes a call (its first message, its later rounds, its decode), each strategy
one way of running the method over the bucket:

- :class:`PlainRound`: the plain average (``compress=False``, or method ``none`` around the identity),
  the bucket itself on the wire, divided by n after the sum;
- :class:`ParameterRounds`: the method run per *parameter* (``segments=``): each parameter its own
  state (key ``("param", name)``), generator and constants, the payloads concatenated into the bucket's
  one message (:func:`concat_payloads`) and the aggregate decoded slice by slice, so that the result
  does not depend on how parameters are grouped into buckets;
- :class:`BucketRounds`: the method over the whole bucket, in one round or in several (``next_round``:
  PowerSGD's P, then Q, each later round run by the transport on its communication thread right after
  the previous sum);
- :class:`DirectRound`: :class:`BucketRounds`' one round of a stateless method around an elementwise compressor
  (the fp16/bf16 casts) as :meth:`CommPipeline.chain <sparsecomm.pipeline.core.CommPipeline.chain>` chains it on
  an unmodelled fabric, with the fewest calls (the method's direct calls; its finish records the call itself).

A strategy encodes on the calling thread (so generators and states advance in call order) and returns
a :class:`Call`; the pipeline hands it to the transport and records every round of every strategy the
same way (:class:`~sparsecomm.pipeline.accounting.Accounting`). Each applies the non-finite rule
(:mod:`sparsecomm.pipeline.nonfinite`) to its input and to every sum; under ``nonfinite="skip"`` a
non-finite sum ends the call's rounds there (on every worker alike: the sums are the same) and its estimate
is NaN, with the method's decode left out (the step is rolled back: :meth:`CommPipeline.end_step
<sparsecomm.pipeline.core.CommPipeline.end_step>`).

On a fabric that charges host work (``fabric.charges_host_work``: a SimFabric whose network has a host model)
every strategy charges the host work of the calls it makes to the worker's clock
(:meth:`~sparsecomm.fabric.base.Fabric.host_work`), as the method declares it
(:meth:`~sparsecomm.methods.base.Method.work`: asked before each ``encode``, ``next_round`` and ``decode``,
charged after it); the plain round charges its division (one elementwise pass); a compressed round whose input
the non-finite rule checks (:meth:`MethodRounds.poisoned`) charges that read of the bucket (``"check"``, the host
model's ``check_element_s``). A host model without these rates charges nothing (every modelled time as without
them); any other fabric (a real one, a SimFabric without a host model, on which ``host_work`` is a no-op) is
not asked, nor is the method's ``work``: a round there makes no call to declare what nothing charges.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable

import torch

from ..compressors._common import divide_finite
from ..errors import MismatchError, NonFiniteError, SparseCommError
from ..methods.base import Method
from ..payload import Payload
from .accounting import Accounting
from .nonfinite import NonFiniteRule, poison
from .states import Generators, StateStore


def charging(fabric: Any) -> Any:
    """``fabric`` where it charges host work to its clock (:attr:`~sparsecomm.fabric.base.Fabric.charges_host_work`),
    else None (its ``host_work`` is a no-op: nothing to declare)."""
    return fabric if fabric is not None and fabric.charges_host_work else None


def charge(fabric: Any, work: dict[str, int]) -> None:
    """Charge host-work counts (:meth:`~sparsecomm.methods.base.Method.work`) to ``fabric``'s clock."""
    for op, count in work.items():
        if count:
            fabric.host_work(op, count)


class Call:
    """One bucket's call: ``sent`` (the first round's message: a tensor or a Payload), ``finish(sum)``
    (the estimate from the last round's sum), ``next_round(sum)`` for a method of several rounds (the
    next message, or ``None`` after the last), and ``last``, the message of the round in flight."""

    def __init__(self, sent: Any, dense_bytes: int, finish: Callable[[torch.Tensor], torch.Tensor],
                 next_round: Callable[[torch.Tensor], Payload | None] | None = None) -> None:
        self.sent, self.dense_bytes, self.finish, self.next_round = sent, dense_bytes, finish, next_round
        self.last = sent
        #: False once a sum of the call was not finite (``nonfinite="skip"``: its rounds end there)
        self.finite = True


class Outputs:
    """The persistent estimate buffer of each key, reused every round (no fresh allocation); a caller
    may keep views of it until the key's next round (DDP's ``gradient_as_bucket_view``)."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, torch.Tensor] = {}

    def of(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        buf = self._by_key.get(key)
        # (equal shapes, the steady state, need no numel() call)
        if buf is None or (buf.shape != like.shape and buf.numel() != like.numel()) or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = self._by_key[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buf


class PlainRound:
    """The plain average: the bucket on the wire, the sum divided in place by n."""

    def __init__(self, rule: NonFiniteRule, world_size: int, fabric: Any = None) -> None:
        self.rule, self.n, self.fabric = rule, world_size, charging(fabric)

    def begin(self, flat: torch.Tensor, key: Hashable, checked: bool = False,
              dense_bytes: int | None = None) -> Call:
        """The call, of ``dense_bytes`` (default ``flat.nbytes``: :meth:`CommPipeline.start
        <sparsecomm.pipeline.core.CommPipeline.start>`); ``checked`` (where the transport checks the sum itself,
        ``not rule.checks_sums``): its ``finish`` returns ``(average, finite)``, the division checking the sum in
        the same pass (:func:`~sparsecomm.compressors._common.divide_finite`, bit for bit torch's division), so
        that a transport that chains it leaves its own pass to it (:meth:`Transport.chain
        <sparsecomm.transports.base.Transport.chain>`'s ``checks``)."""
        if checked:
            def finish(agg: torch.Tensor) -> tuple[torch.Tensor, bool]:
                ok = divide_finite(agg, self.n)
                if self.fabric is not None:
                    charge(self.fabric, {"elementwise": agg.numel()})
                return agg, ok

            return Call(flat, flat.nbytes, finish)

        def finish(agg: torch.Tensor) -> torch.Tensor:
            if self.rule.checks_sums:
                self.rule.plain_sum(agg, key)       # (skipped: the average below is not finite either)
            out = agg.div_(self.n)
            if self.fabric is not None:
                charge(self.fabric, {"elementwise": agg.numel()})
            return out

        return Call(flat, flat.nbytes if dense_bytes is None else dense_bytes, finish)


class MethodRounds:
    """A strategy that runs ``method`` with the worker's states and generators (:class:`ParameterRounds`,
    :class:`BucketRounds`)."""

    def __init__(self, method: Method, states: StateStore, generators: Generators, rule: NonFiniteRule,
                 outputs: Outputs, world_size: int, fabric: Any = None) -> None:
        self.method, self.states, self.generators = method, states, generators
        self.rule, self.outputs, self.n = rule, outputs, world_size
        #: the fabric charged the method's host work (None: it charges none, nothing declared)
        self.fabric = charging(fabric)

    def charged(self, phase: str, ms: Any, d: int, run: Callable[[], Any], **kw: Any) -> Any:
        """``run()`` (the method's call ``phase`` on state ``ms`` of a ``d``-element bucket), its declared host
        work (``kw``: encode's ``exact`` and ``shapes``) charged after it on a fabric that charges host work."""
        if self.fabric is None:
            return run()
        work = self.method.work(phase, ms, d, **kw)
        out = run()
        charge(self.fabric, work)
        return out

    def poisoned(self, flat: torch.Tensor, exact: bool) -> bool:
        """The rule's :meth:`~sparsecomm.pipeline.nonfinite.NonFiniteRule.poisoned` of the bucket ``flat``; where
        it reads the bucket (its ``check``, a compressed round, a float bucket) the read is charged on a fabric that
        charges host work (``"check"``, one pass over ``flat``: :func:`sparsecomm.compressors._common.all_finite`)."""
        rule = self.rule
        if self.fabric is not None and rule.check and not exact and flat.is_floating_point() and flat.numel():
            self.fabric.host_work("check", flat.numel())
        return rule.poisoned(flat, exact)


class ParameterRounds(MethodRounds):
    """The method per parameter of the bucket (see the module doc)."""

    def begin(self, flat: torch.Tensor, key: Hashable, steps_before: int, exact: bool,
              segments: tuple[tuple[str, int], ...]) -> Call:
        n, method = self.n, self.method
        # a method that checks what it compresses (checks_input) stands for the rule's check of the bucket
        poisoned = False if method.checks_input else self.poisoned(flat, exact)
        if poisoned:
            flat.zero_()
        segs = tuple((str(nm), int(k)) for nm, k in segments)
        if sum(k for _, k in segs) != flat.numel():
            raise MismatchError(f"segments {segs} do not add up to the bucket's {flat.numel()} elements")
        parts, off = [], 0
        for nm, k in segs:
            seg = flat[off:off + k]
            ms = self.states.get(("param", nm), seg, steps_before)

            def encode() -> Payload:
                return self.charged("encode", ms, k, lambda: method.encode(
                    seg, ms, self.generators.param(nm, flat.device), world_size=n, exact=exact, inplace=True),
                    exact=exact)[0]
            if method.checks_input:
                try:
                    p = encode()
                except NonFiniteError:      # (nothing changed: zeros encoded instead, the bucket sent as NaN)
                    poisoned = True
                    seg.zero_()
                    p = encode()
            else:
                p = encode()
            parts.append(p)
            off += k
        payload = concat_payloads(parts)
        if poisoned:
            poison(payload, key)

        def finish(agg: torch.Tensor) -> torch.Tensor:
            out = self.outputs.of(key, flat)
            if self.rule.checks_sums and not self.rule.sum(payload, agg, key):
                return out.fill_(float("nan"))      # a skipped step: no decode (see the module doc)
            a, o = agg.reshape(-1), 0
            for nm, k in segs:
                ms = self.states[("param", nm)]
                self.charged("decode", ms, k, lambda: self.method.decode(a[o:o + k], n, ms, out=out[o:o + k]))
                o += k
            return out

        return Call(payload, flat.nbytes, finish)


class BucketRounds(MethodRounds):
    """The method over the whole bucket, in one round or several (see the module doc)."""

    def __init__(self, method: Method, states: StateStore, generators: Generators, rule: NonFiniteRule,
                 outputs: Outputs, world_size: int, fabric: Any = None) -> None:
        super().__init__(method, states, generators, rule, outputs, world_size, fabric)
        # a stateless method around a compressor that raises NonFiniteError on a non-finite input: the
        # compressor's check of its input stands for the rule's (one pass less)
        self.input_checked_by_encode = method.State is None and method.compressor.checks_finite

    def begin(self, flat: torch.Tensor, key: Hashable, steps_before: int, exact: bool, shapes: Any,
              checked: bool = False) -> Call:
        """The call; ``checked`` (a one-round call whose sum the transport checks, ``not rule.checks_sums``): its
        ``finish`` returns ``(estimate, finite)``, the decode checking the sum
        (:meth:`~sparsecomm.methods.base.Method.decode_finite`: in its own pass where the method folds it), as
        :meth:`PlainRound.begin` does."""
        n, rule, method = self.n, self.rule, self.method
        enc_kw = {"shapes": shapes} if shapes is not None else {}
        ms = self.states.get(key, flat, steps_before)
        gen = self.generators.bucket(flat.device)
        d = flat.numel()

        def encode() -> Payload:
            if self.fabric is None:        # (nothing charged: the call itself, two frames fewer)
                return method.encode(flat, ms, gen, world_size=n, exact=exact, inplace=True, **enc_kw)[0]
            return self.charged("encode", ms, d, lambda: method.encode(flat, ms, gen, world_size=n, exact=exact,
                                                                       inplace=True, **enc_kw)[0],
                                exact=exact, shapes=shapes)

        payload = None
        if method.checks_input or (rule.check and not exact and self.input_checked_by_encode):
            # the method checks what it compresses (g + e: a NaN/Inf gradient, or a finite one whose sum with the
            # state overflowed; on an exact round too), or a stateless method's compressor checks the gradient:
            # either has changed nothing when it raises, so zeros are encoded instead and sent as NaN, in every
            # mode (under "pass" NaN then flows to every worker rather than an error on this one alone)
            try:
                payload = encode()
            except NonFiniteError:
                pass
            poisoned = payload is None
        else:
            poisoned = self.poisoned(flat, exact)
        if payload is None:
            if poisoned:
                flat.zero_()
            payload = encode()
        if poisoned:
            poison(payload, key)
        first = payload

        if checked:
            def finish_checked(agg: torch.Tensor) -> tuple[torch.Tensor, bool]:
                out = self.outputs.of(key, flat)
                if self.fabric is None:
                    est, _, ok = method.decode_finite(agg, n, ms, out=out)
                else:
                    est, _, ok = self.charged("decode", ms, d, lambda: method.decode_finite(agg, n, ms, out=out))
                return est, ok

            return Call(first, flat.nbytes, finish_checked)

        def finish(agg: torch.Tensor) -> torch.Tensor:
            out = self.outputs.of(key, flat)  # the estimate has the bucket's length (a last round's may not)
            if call.next_round is None and rule.checks_sums:   # (several rounds: each sum checked already)
                call.finite = rule.first_sum(first, agg, key)
            if not call.finite:
                return out.fill_(float("nan"))      # a skipped step: no decode (see the module doc)
            if self.fabric is None:         # (nothing charged: the call itself, two frames fewer)
                return method.decode(agg, n, ms, out=out)[0]
            return self.charged("decode", ms, d, lambda: method.decode(agg, n, ms, out=out)[0])

        call = Call(first, flat.nbytes, finish)
        if method.multi_round:
            def next_round(agg: torch.Tensor) -> Payload | None:
                if rule.checks_sums:
                    call.finite = (rule.first_sum if call.last is first else rule.sum)(call.last, agg, key)
                    if not call.finite:
                        return None                 # a skipped step: no further round, on every worker
                if self.fabric is None:     # (nothing charged: the call itself, two frames fewer)
                    nxt = method.next_round(agg, n, ms)[0]
                else:
                    nxt = self.charged("next_round", ms, d, lambda: method.next_round(agg, n, ms)[0])
                if nxt is not None:
                    call.last = nxt
                return nxt

            call.next_round = next_round
        return call


class DirectRound(MethodRounds):
    """The round of a stateless one-round method around an elementwise compressor whose sum the transport checks,
    chained on its collective (:meth:`CommPipeline.chain <sparsecomm.pipeline.core.CommPipeline.chain>`: the
    fp16/bf16 casts under ``none``, the DDP hook's steady state), on a fabric without modelled time: the numbers,
    state changes, checks and records of :class:`BucketRounds`' ``begin(..., checked=True)`` and the pipeline's
    finish of it, with the fewest calls: the method's direct calls (:meth:`Method.encode_direct
    <sparsecomm.methods.base.Method.encode_direct>`, :meth:`~sparsecomm.methods.base.Method.decode_direct`), no
    :class:`Call`, and the call and its round recorded by the finish itself (:meth:`Accounting.finished
    <sparsecomm.pipeline.accounting.Accounting.finished>`, on ``accounting`` with ``transport``'s figures)."""

    def __init__(self, method: Method, states: StateStore, generators: Generators, rule: NonFiniteRule,
                 outputs: Outputs, world_size: int, accounting: Accounting, transport: Any) -> None:
        super().__init__(method, states, generators, rule, outputs, world_size, None)
        self.accounting, self.transport = accounting, transport
        # the compressor's check of its input stands for the rule's (BucketRounds' input_checked_by_encode)
        self.input_checked_by_encode = rule.check and method.State is None and method.compressor.checks_finite

    def begin(self, flat: torch.Tensor, key: Hashable,
              steps_before: int) -> tuple[Payload, Callable[[torch.Tensor], tuple[torch.Tensor, bool]]]:
        """Encode ``flat`` (scratch) for bucket ``key``: ``(payload, finish)``, ``finish(sum)`` the estimate and
        whether the sum was finite (the call recorded when it was). A non-finite input (the compressor raises
        ``NonFiniteError``, having changed nothing) is encoded as zeros and sent as NaN (the rule's ``check``:
        :mod:`sparsecomm.pipeline.nonfinite`)."""
        # (no journal is open: the transport checks the sums, so the rule is not "skip")
        ms = self.states.by_key.get(key)
        if ms is None:
            ms = self.states.get(key, flat, steps_before)
        gen = self.generators.bucket(flat.device)
        method = self.method
        if self.input_checked_by_encode:
            try:
                payload = method.encode_direct(flat, ms, gen, self.n)
                return payload, functools.partial(self.finish, key, flat, ms, payload)
            except NonFiniteError:
                poisoned = True
        else:
            poisoned = self.rule.poisoned(flat, False)
        if poisoned:
            flat.zero_()
        payload = method.encode_direct(flat, ms, gen, self.n)
        if poisoned:
            poison(payload, key)
        return payload, functools.partial(self.finish, key, flat, ms, payload)

    def finish(self, key: Hashable, flat: torch.Tensor, ms: Any, payload: Payload,
               agg: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The estimate from the sum ``agg`` and whether ``agg`` was finite; the call and its round recorded
        unless it was not (the transport raises)."""
        out = self.outputs.of(key, flat)
        if not self.method.decode_direct(agg, self.n, ms, out):
            return out, False
        self.accounting.finished(flat.nbytes, payload, self.transport.last_stats)
        return out, True


def concat_payloads(parts: list[Payload]) -> Payload:
    """One payload of the concatenated tensor from the payloads of its consecutive pieces (kinds
    ``dense``, ``aligned``, ``sparse``; pieces of different kinds, an exact round's dense piece among
    compressed ones, are all made dense: the sum of their ``to_dense()`` is what matters)."""
    if len(parts) == 1:
        return parts[0]
    kinds = {p.kind for p in parts}
    dtype = parts[0].dtype
    total = sum(p.numel for p in parts)
    bits = sum(int(p.bits or 0) for p in parts)
    codecs = {tuple(p.values_codec) for p in parts}
    if len(kinds) == 1 and kinds <= {"aligned", "sparse"} and len(codecs) == 1 and \
            all(p.row_len == 1 for p in parts):
        idx, off = [], 0
        for p in parts:
            idx.append(p.indices.reshape(-1) + off)
            off += p.numel
        return Payload(parts[0].kind, torch.cat([p.values.reshape(-1) for p in parts]), torch.Size([total]),
                       dtype, indices=torch.cat(idx), bits=bits, values_codec=parts[0].values_codec,
                       meta=_joint_meta(parts))
    if kinds == {"dense"} and len(codecs) == 1 and len({p.values.dtype for p in parts}) == 1:
        # (fp16 values stay fp16 on the wire)
        return Payload("dense", torch.cat([p.values.reshape(-1) for p in parts]), torch.Size([total]), dtype,
                       bits=bits, meta=_joint_meta(parts), values_codec=parts[0].values_codec)
    if not kinds <= {"dense", "aligned", "sparse"}:
        raise SparseCommError(f"cannot concatenate payloads of kinds {sorted(kinds)} (per-parameter rounds "
                              f"take dense, aligned and sparse payloads)")
    vals = torch.cat([p.values.reshape(-1).to(dtype) if p.kind == "dense" else p.to_dense() for p in parts])
    return Payload("dense", vals, torch.Size([total]), dtype, bits=bits, meta=_joint_meta(parts))


def _joint_meta(parts: list[Payload]) -> dict:
    """The meta a concatenation keeps: ``exact`` when every piece is, ``underflow`` when one is."""
    meta = {"exact": True} if all(p.meta.get("exact") for p in parts) else {}
    if any(p.meta.get("underflow") for p in parts):
        meta["underflow"] = True
    return meta
