"""The communication pipeline shared by :class:`~sparsecomm.optim.DistributedOptimizer` and the DDP
hook (:mod:`sparsecomm.ddp`): :class:`CommPipeline` takes one flat bucket through
``method.encode -> transport.start -> method.decode`` (the middle of a step's data path, gradient ->
bucket -> method -> transport -> method -> gradient) and holds the per-worker state that checkpoints
carry: the method's states (:attr:`CommPipeline.states`, one
:class:`~sparsecomm.methods.base.MethodState` per bucket key; the method object holds only
hyper-parameters), the generators and the byte counts. Its parts: the method and transport chosen
from names (:mod:`sparsecomm.resolve`; the rules are documented in :mod:`sparsecomm.optim`), the
states and checkpoints (:mod:`sparsecomm.pipeline_states`), row-sparse gradients
(:mod:`sparsecomm.sparse_rows`), the non-finite rule (:mod:`sparsecomm.nonfinite`) and the byte
counts (:mod:`sparsecomm.compression_stats`).

**Asynchronous rounds.** :meth:`CommPipeline.start` encodes on the calling thread (so the compressor's
generator and the method state advance in call order, which the optimizer and the hook keep identical
on every worker and identical to the synchronous order) and hands the payload to the transport's
communication thread, which decodes right after the sum; ``start(...).wait()`` is :meth:`reduce`.
A method's state is per bucket key, so decoding bucket ``a`` on the communication thread while bucket
``b`` is encoded on the caller's thread touches disjoint state: the results are bit-identical to the
synchronous path.

**Non-finite gradients** (``nonfinite="raise"``, the default). The same
:class:`~sparsecomm.errors.NonFiniteError` on every worker when any worker's bucket holds a NaN or Inf,
whatever the compressor and transport: a compressed round checks the input *before* compression (a
sampling compressor would not see an unsampled NaN) and, if it is not finite, still encodes (zeros, so
that generators and states advance alike) but sends NaN values (or a NaN scale), so that the
aggregate of *every* worker is non-finite; every round checks the aggregate after the sum (a
transport that cannot carry NaN, fixed point, raises its own ``NonFiniteError`` on every worker).
``nonfinite="pass"`` skips the checks: as DDP, NaN/Inf flow into the averaged gradient where the
compressor keeps them (a sampling compressor may drop them; compressors that check their input still
raise, on that worker).
"""
from __future__ import annotations

import hashlib
from typing import Any, Hashable

import torch

from . import methods
from .compressors.base import Compressor
from .compression_stats import CompressionStats, payload_bytes as _payload_bytes, wire_copies as _wire_copies
from .errors import InvalidValueError, MismatchError, NonFiniteError, SparseCommError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import Method, MethodState, dense_payload
from .nonfinite import NONFINITE, _check_aggregate, _finite, _poison
from .payload import Payload, check_sum_finite
from .pipeline_states import PipelineStates
from .settings import describe
from .resolve import AUTO_ORDER, build_transport, check_pair, default_fabric, warn_unguaranteed  # noqa: F401 (re-exported)
from .sparse_rows import SPARSE_ROWS, SparseRows, row_sparse_parts  # noqa: F401 (re-exported)
from .transports.base import CallId, CommWork, Transport


class CommPipeline(PipelineStates, SparseRows):
    """One worker's method + transport + generator: ``reduce(flat, key) -> averaged estimate``.

    Shared by :class:`DistributedOptimizer` and the DDP comm hook (:mod:`sparsecomm.ddp`).
    """

    def __init__(self, compressor: str | Compressor | None = None, transport: str | Transport = "auto",
                 *, method: str | Method | None = None, transport_kwargs: dict | None = None,
                 fabric: Fabric | None = None, seed: int = 0, nonfinite: str = "raise",
                 sparse_rows: str = "gather", warmup_steps: int = 0, **hyper: Any) -> None:
        if sparse_rows not in SPARSE_ROWS:
            raise InvalidValueError(f"sparse_rows must be one of {', '.join(map(repr, SPARSE_ROWS))}, got {sparse_rows!r}")
        self.sparse_rows = sparse_rows
        self._gatherer: Any = None
        if nonfinite not in NONFINITE:
            raise InvalidValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        if warmup_steps < 0:
            raise InvalidValueError(f"warmup_steps must be non-negative, got {warmup_steps}")
        self.method = methods.warmup(methods.build(compressor, method, **hyper), warmup_steps)
        warn_unguaranteed(self.method)
        self.transport = build_transport(transport, self.method, fabric, transport_kwargs)
        self.transport_kwargs = dict(transport_kwargs or {})
        self.warmup_steps = int(warmup_steps)
        if nonfinite == "pass" and getattr(self.transport, "nonfinite", "pass") != "pass":
            self.transport.nonfinite = "pass"   # the transport's own NaN/Inf rule follows the optimizer's
        self.fabric = self.transport.fabric
        self.world_size = int(self.fabric.world_size)
        self.rank = int(self.fabric.rank)
        self.seed = int(seed)
        self.shared_randomness = bool(getattr(self.method.compressor, "shared_randomness", False))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._param_generators: dict[tuple[str, torch.device], torch.Generator] = {}
        # method none + identity is plain averaging: skip the compressor's copy (and, as DDP, its
        # finiteness check)
        self._plain = self.method.name == "none" and getattr(self.method.compressor, "name", "") == "identity"
        # a stateless method around a compressor that raises NonFiniteError on a non-finite input: the
        # compressor's check is the pipeline's (start)
        self._input_checked_by_encode = self.method.State is None and \
            getattr(self.method.compressor, "checks_finite", False)
        self.stats = CompressionStats()
        self.last_stats = CommStats()
        #: steps begun (:meth:`begin_step`): part of every call's identity, and of checkpoints
        self.step = 0
        self._outs: dict[Hashable, torch.Tensor] = {}
        #: the method state of every key (bucket, or ``("param", name)``): the pipeline holds them
        self.states: dict[Hashable, MethodState] = {}
        # parameter-keyed state (the DDP hook): the (name, numel) segments of each key's state and
        # the key that holds the current state of each named segment
        self._segments: dict[Hashable, tuple[tuple[str, int], ...]] = {}
        self._owner: dict[str, Hashable] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}      # each named segment's shape (bind)

    def settings(self) -> list[tuple[str, str]]:
        """The configuration the workers must share (:mod:`sparsecomm.settings`): the method, its
        compressor, their hyper-parameters, the transport and its options, then ``warmup_steps``,
        ``seed``, ``nonfinite`` and ``sparse_rows``; the frontends add their own and agree on them at
        construction (:func:`sparsecomm.settings.agree`)."""
        return describe(self.method, self.transport, self.transport_kwargs) + [
            ("warmup_steps", repr(self.warmup_steps)), ("seed", repr(self.seed)),
            ("nonfinite", repr(self.nonfinite)), ("sparse_rows", repr(self.sparse_rows))]

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """This worker's compressor generator on ``device`` (``seed`` everywhere if shared, else
        ``seed + rank``)."""
        device = torch.device(device)
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed if self.shared_randomness else self.seed + self.rank)
            self._generators[device] = g
        return g

    @property
    def per_parameter(self) -> bool:
        """Whether :meth:`start` runs the method per parameter (``segments=``): a one-round method
        whose payloads concatenate (``dense``, ``aligned``, ``sparse``), unless the method keeps no
        state and its compressor is ``elementwise`` (the fp16/bf16 casts): then the whole bucket's
        round is the same numbers, in one call."""
        c = self.method.compressor
        kind = getattr(c, "payload_kind", None)
        if self.method.State is None and getattr(c, "elementwise", False):
            return False
        return not self.method.multi_round and not self.method.uses_shapes and \
            kind in ("dense", "aligned", "sparse")

    def param_generator(self, name: str, device: torch.device | str = "cpu") -> torch.Generator:
        """The compressor generator of parameter ``name`` (per-parameter rounds): seeded from ``seed``
        and the name (and the rank, unless the compressor shares its randomness), so its draws do not
        depend on the other parameters or on the bucket layout."""
        device = torch.device(device)
        g = self._param_generators.get((name, device))
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(_name_seed(self.seed, name, None if self.shared_randomness else self.rank))
            self._param_generators[(name, device)] = g
        return g

    def reduce(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False,
               compress: bool = True, shapes: Any = None) -> torch.Tensor:
        """``start(flat, key, ...).wait()``: the averaged estimate (see :meth:`start`)."""
        return self.start(flat, key, exact=exact, compress=compress, shapes=shapes).wait()

    def start(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False,
              compress: bool = True, shapes: Any = None,
              segments: tuple[tuple[str, int], ...] | None = None) -> CommWork:
        """Start the round of bucket ``key``; ``wait()`` returns the averaged estimate.

        The averaged estimate for this worker's flat ``flat`` of bucket ``key``.

        ``compress=False`` bypasses the method (plain average, no state); ``exact=True`` runs the
        method's exact (uncompressed) round. ``flat`` is scratch: the method may overwrite it and a
        transport built with ``inplace=True`` may write the sum into it. The result is the transport's
        output divided in place (a fresh tensor, or ``flat`` itself), or the method's estimate written
        into this bucket's persistent buffer; either stays valid until the next ``reduce`` of ``key``
        (callers keep views of it, as DDP's ``gradient_as_bucket_view``). ``flat`` must not be touched
        until the work completes. A method of several rounds (``next_round``,
        :mod:`sparsecomm.methods.base`) runs its later rounds on the communication thread right after the
        previous sum; ``shapes`` (the tensors laid out in ``flat``) is passed to the method.

        ``segments`` (``(name, numel)`` of the parameters laid out in ``flat``, in order), where
        :attr:`per_parameter` holds: the method runs per *parameter* (state key ``("param", name)``,
        a generator of that parameter's own, its own ``alpha``/``k``), the payloads are concatenated
        into the bucket's one message and the aggregate is decoded slice by slice, so that the result
        does not depend on how the parameters are grouped into buckets (see :mod:`sparsecomm.ddp`).
        """
        dense_bytes = flat.numel() * flat.element_size()
        n = self.world_size
        check = self.nonfinite == "raise"
        # a transport that raises on a non-finite sum itself has checked it: no second pass
        transport_checks = check and getattr(self.transport, "nonfinite", None) == "raise"
        next_round = None
        if not compress or self._plain:
            payload = dense_payload(flat)
            sent = flat

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check and not transport_checks:
                    _check_aggregate(agg, key)
                return agg.div_(n)
        elif segments is not None and self.per_parameter:
            poison = check and not exact and not _finite(flat)
            if poison:
                flat.zero_()
            segs = tuple((str(nm), int(k)) for nm, k in segments)
            if sum(k for _, k in segs) != flat.numel():
                raise MismatchError(f"segments {segs} do not add up to the bucket's {flat.numel()} elements")
            parts, off = [], 0
            for nm, k in segs:
                seg = flat[off:off + k]
                payload_k, _ = self.method.encode(seg, self._state_of(("param", nm), seg),
                                                  self.param_generator(nm, flat.device), world_size=n,
                                                  exact=exact, inplace=True)
                parts.append(payload_k)
                off += k
            payload = concat_payloads(parts)
            if poison:
                _poison(payload, key)
            sent = payload

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check and not transport_checks:
                    _check_aggregate(agg, key)
                elif not check:
                    check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                out = self._out(key, flat)
                a, o = agg.reshape(-1), 0
                for nm, k in segs:
                    self.method.decode(a[o:o + k], n, self.states[("param", nm)], out=out[o:o + k])
                    o += k
                return out
        else:
            enc_kw = {"shapes": shapes} if shapes is not None else {}
            ms = self._state_of(key, flat)
            gen = self.generator(flat.device)
            payload = None
            if check and not exact and self._input_checked_by_encode:
                # the compressor's own check of its input stands for the pipeline's (one pass less): a
                # stateless method has changed nothing when it raises, so zeros are encoded instead
                try:
                    payload, _ = self.method.encode(flat, ms, gen, world_size=n, exact=exact, inplace=True, **enc_kw)
                except NonFiniteError:
                    pass
                poison = payload is None
            else:
                poison = check and not exact and not _finite(flat)
            if payload is None:
                if poison:
                    flat.zero_()
                payload, _ = self.method.encode(flat, ms, gen, world_size=n, exact=exact, inplace=True, **enc_kw)
            if poison:
                _poison(payload, key)
            sent = payload
            if self.method.multi_round:
                # a method of several rounds (PowerSGD: P, then Q): the transport runs the later rounds
                # in the same call, right after each sum (the same order on every worker)
                last = [payload]

                def next_round(agg: torch.Tensor) -> Payload | None:
                    if last[0] is payload:
                        check_first(agg, payload)
                    elif check and not transport_checks:
                        _check_aggregate(agg, key)
                    elif not check:
                        check_sum_finite(last[0], agg, f"transport {self.transport.name!r}")
                    nxt = self.method.next_round(agg, n, ms)[0]
                    if nxt is not None:
                        self.last_stats = self.last_stats + self.transport.last_stats
                        self.stats.rounds += 1
                        self.stats.bytes_payload += _payload_bytes(nxt)
                        self.stats.bytes_declared_sent += _wire_copies(self.transport) * _payload_bytes(nxt)
                        last[0] = nxt
                    return nxt

            def check_first(agg: torch.Tensor, p: Payload) -> None:
                if transport_checks:
                    return          # the transport raised on a non-finite sum (and on an overflow)
                if check and not _finite(agg):
                    if not bool(torch.isnan(agg).any()):
                        # inputs were finite (checked) and no worker sent NaN: narrow floats (fp16) summed
                        # in their own dtype overflowed; say so (SumOverflowError, on every worker)
                        check_sum_finite(p, agg, f"transport {self.transport.name!r}")
                    _check_aggregate(agg, key)
                else:       # narrow floats summed in their dtype: an overflow is not a passed-through NaN
                    check_sum_finite(p, agg, f"transport {self.transport.name!r}")

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if next_round is None:       # (a method of several rounds checked each sum already)
                    check_first(agg, payload)
                # the estimate has the bucket's length (a last round's aggregate may be shorter)
                return self.method.decode(agg, n, ms, out=self._out(key, flat))[0]

        def then(agg: torch.Tensor) -> torch.Tensor:
            out = finish(agg)
            pbytes = _payload_bytes(payload)
            copies = _wire_copies(self.transport)
            self.stats.rounds += 1
            self.stats.bytes_dense += dense_bytes
            self.stats.bytes_payload += pbytes
            self.stats.bytes_declared_sent += copies * pbytes
            self.stats.bytes_dense_sent += copies * dense_bytes
            self.last_stats = self.last_stats + self.transport.last_stats
            return out

        return self.transport.start(sent, then=then, next_round=next_round, call=self.call_id(key))

    def call_id(self, key: Hashable, round: int = 0) -> CallId:
        """The identity of this step's call for bucket ``key`` (what every worker's agreement
        compares: :class:`~sparsecomm.transports.base.CallId`)."""
        return CallId(key, self.step, round)

    def _out(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The persistent estimate buffer of bucket ``key`` (reused every round: no fresh allocation)."""
        buf = self._outs.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._outs[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buf

    def begin_step(self) -> None:
        """Start a new step: its calls' identity (:meth:`call_id`) and a new ``last_stats``
        accumulation (one per optimizer step)."""
        self.step += 1
        self.stats.comm = self.stats.comm + self.last_stats
        self.last_stats = CommStats()

    def totals(self) -> CompressionStats:
        return CompressionStats(self.stats.rounds, self.stats.bytes_dense, self.stats.bytes_payload,
                                self.stats.comm + self.last_stats, self.stats.bytes_declared_sent,
                                self.stats.bytes_dense_sent)


def _name_seed(seed: int, name: str, rank: int | None) -> int:
    """A 63-bit seed from ``(seed, name[, rank])`` (blake2b: stable across processes and runs)."""
    msg = f"{int(seed)}\x00{name}\x00{'' if rank is None else int(rank)}".encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") & ((1 << 63) - 1)


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
                       dtype, indices=torch.cat(idx), bits=bits, values_codec=parts[0].values_codec)
    if kinds == {"dense"} and len(codecs) == 1 and len({p.values.dtype for p in parts}) == 1:
        # (fp16 values stay fp16 on the wire)
        exact = all(p.meta.get("exact") for p in parts)
        return Payload("dense", torch.cat([p.values.reshape(-1) for p in parts]), torch.Size([total]), dtype,
                       bits=bits, meta={"exact": True} if exact else {}, values_codec=parts[0].values_codec)
    if not kinds <= {"dense", "aligned", "sparse"}:
        raise SparseCommError(f"cannot concatenate payloads of kinds {sorted(kinds)} (per-parameter rounds "
                              f"take dense, aligned and sparse payloads)")
    vals = torch.cat([p.values.reshape(-1).to(dtype) if p.kind == "dense" else p.to_dense() for p in parts])
    exact = all(p.meta.get("exact") for p in parts)
    return Payload("dense", vals, torch.Size([total]), dtype, bits=bits, meta={"exact": True} if exact else {})
