"""The communication pipeline shared by :class:`~sparsecomm.optim.DistributedOptimizer` and the DDP
hook (:mod:`sparsecomm.ddp`): resolving a compressor / method / transport from names, checking that
the transport carries the method's payloads, and :class:`CommPipeline`, which takes one flat bucket
through ``method.encode -> transport.allreduce -> method.decode`` and holds the per-worker state that
checkpoints carry: the method's states (:attr:`CommPipeline.states`, one
:class:`~sparsecomm.methods.base.MethodState` per bucket key; the method object holds only
hyper-parameters), the generators and the byte counts. The rules (names, ``"auto"``, the
incompatibility error) are documented in :mod:`sparsecomm.optim`.

(One module on purpose, over 400 lines: the name resolution, the dense round, the per-parameter
round and the sparse-gradient rounds share the state above and its locking-free call-order rule.)

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
import inspect
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Hashable

import torch
import torch.distributed as dist

from . import compressors, methods, transports
from .compressors._common import abs_max
from .compressors.base import Compressor
from .errors import IncompatibleError, MismatchError, NonFiniteError, SparseCommError, UnknownNameError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .fabric.torch_fabric import TorchFabric
from .launch import current_context
from .methods.base import (HyperParameterError, Method, MethodState, check_kwargs, dense_payload, states_from_dict,
                           states_to_dict)
from .payload import Payload, check_sum_finite
from .transports.allgather import AllGather
from .transports.base import CommWork, Transport, engine
from .errors import InvalidTypeError, InvalidValueError

NONFINITE = ("raise", "pass")
#: how :meth:`CommPipeline.start_sparse` averages a row-sparse gradient
SPARSE_ROWS = ("gather", "transport")

AUTO_ORDER = ("ring", "omnireduce", "switch", "allgather")


# ============================================================================ resolution helpers
def build_method(compressor: str | Compressor | Method = "none", method: str | None = None,
                 **hyper: Any) -> Method:
    """A Method from a method or compressor name (+ hyper-parameters) or an object (see module doc)."""
    if isinstance(compressor, Method):
        if method is not None or hyper:
            raise InvalidTypeError(f"a Method object ({compressor!r}) was given; method= and hyper-parameters "
                            f"{sorted(hyper)} belong to its constructor")
        return compressor
    if isinstance(compressor, Compressor):
        mname = method or "none"
        _check_takes_compressor(mname)
        check_kwargs(methods.registry.factory(mname), hyper, f"method {mname!r}")
        return methods.get(mname, compressor=compressor, **hyper)
    if not isinstance(compressor, str):
        raise InvalidTypeError(f"compressor must be a name, a Compressor or a Method, got {compressor!r}")
    if compressor in methods.registry:
        if method is not None:
            raise InvalidTypeError(f"compressor={compressor!r} is a method; to pick its compressor use "
                            f"compressor=<compressor name>, method={compressor!r}")
        check_kwargs(methods.registry.factory(compressor), hyper, f"method {compressor!r}")
        return methods.get(compressor, **hyper)
    if compressor in compressors.registry:
        mname = method or "none"
        methods.registry.factory(mname)  # unknown method names raise, listing the valid ones
        _check_takes_compressor(mname)
        return methods.get(mname, compressor=compressor, **hyper)
    raise UnknownNameError(
        f"unknown compressor or method {compressor!r}; methods: {', '.join(methods.available())}; "
        f"compressors: {', '.join(compressors.available())}")


def _check_takes_compressor(mname: str) -> None:
    """Methods that bring their own operator (powersgd, dgc, the sign methods) take no compressor."""
    if not _accepts(methods.registry.factory(mname), "compressor"):
        raise HyperParameterError(f"method {mname!r} brings its own operator and takes no compressor; "
                                  f"use compressor={mname!r} (with its own hyper-parameters)")


def default_fabric() -> Fabric:
    """The fabric of the current :func:`sparsecomm.launch` worker, else a TorchFabric over the default
    process group."""
    ctx = current_context()
    if ctx is not None:
        return ctx.fabric
    if dist.is_available() and dist.is_initialized():
        return TorchFabric()
    raise SparseCommError("no fabric: call this inside sc.launch(fn, ...), pass fabric=, or initialise "
                          "torch.distributed first")


def _transport_class(name: str) -> Any:
    return transports.registry.factory(name)  # unknown names raise, listing the valid ones


def _payload_traits(comp: Compressor) -> tuple[str, bool]:
    return comp.payload_kind, bool(getattr(comp, "shared_scale", False))


def _carried_compressors(tcls: Any) -> list[str]:
    out = []
    for n in compressors.available():
        f = compressors.registry.factory(n)
        kind = getattr(f, "payload_kind", None)
        if kind is not None and tcls.can_carry(kind, bool(getattr(f, "shared_scale", False))):
            out.append(n)
    return out


def check_pair(method: Method, transport_name: str, tcls: Any) -> None:
    """Raise IncompatibleError when ``tcls`` cannot carry what ``method``'s compressor produces."""
    kind, shared = _payload_traits(method.compressor)
    if not hasattr(tcls, "can_carry") or tcls.can_carry(kind, shared):
        return
    ok = [n for n in transports.available() if transports.registry.factory(n).can_carry(kind, shared)]
    scale = " with a per-worker scale" if kind == "quantized" and not shared else ""
    comp = method.compressor
    cname = getattr(comp, "name", "") or type(comp).__name__
    carried = _carried_compressors(tcls)
    raise IncompatibleError(
        f"compressor {cname!r} (method {method.name!r}) produces {kind!r} payloads{scale}, which "
        f"transport {transport_name!r} cannot carry (it carries {', '.join(sorted(tcls.carries))}). "
        f"Transports that can: {', '.join(ok) or 'none registered'}"
        + (f"; compressors {transport_name!r} carries: {', '.join(carried)}" if carried else "") + ".")


def build_transport(transport: str | Transport, method: Method, fabric: Fabric | None,
                    transport_kwargs: dict | None) -> Transport:
    """The transport (checked against the method's payload kind) on ``fabric``."""
    if isinstance(transport, Transport):
        if transport_kwargs:
            raise InvalidTypeError("transport_kwargs given with a Transport object")
        if fabric is not None and transport.fabric is not fabric:
            raise SparseCommError("fabric= differs from the fabric of the Transport object")
        check_pair(method, transport.name or type(transport).__name__, type(transport))
        return transport
    if not isinstance(transport, str):
        raise InvalidTypeError(f"transport must be a name or a Transport, got {transport!r}")
    fabric = fabric if fabric is not None else default_fabric()
    if transport == "auto":
        transport = _auto_transport(method, fabric)
    tcls = _transport_class(transport)
    check_pair(method, transport, tcls)
    kwargs = dict(transport_kwargs or {})
    check_kwargs(tcls, kwargs, f"transport {transport!r}")
    if "inplace" not in kwargs and _accepts(tcls, "inplace"):
        kwargs["inplace"] = True   # the buckets are scratch: let the transport sum into them
    return transports.get(transport, fabric, **kwargs)


def _accepts(factory: Any, name: str) -> bool:
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _auto_transport(method: Method, fabric: Fabric) -> str:
    """The first of ``AUTO_ORDER`` that carries the payload, steered by bytes on the wire: scattered
    ``sparse`` payloads go to allgather (through omnireduce each value costs a whole block: ~46x the
    declared bytes for top-k 1%); payloads whose values travel packed only where no sum is formed on
    the wire (``packed_values``: natural compression, 9 of 32 bits; majority-vote signs, 1 bit against
    the ring's int8 partial sums, ``sum_bits``) go to allgather while its ``(n-1)`` packed copies cost
    less than a ring's ``2 (n-1)/n`` unpacked ones."""
    comp = method.compressor
    kind, shared = _payload_traits(comp)
    order = list(AUTO_ORDER)
    n = int(fabric.world_size)
    if kind == "sparse":
        order.remove("allgather")
        order.insert(0, "allgather")
    elif getattr(comp, "packed_values", False) and n > 1:
        probe = 1 << 20
        packed = comp.bits(probe, torch.float32) / probe
        summed = comp.sum_bits(n) if hasattr(comp, "sum_bits") else 32    # a summing transport's unit
        if (n - 1) * packed < 2.0 * (n - 1) / n * summed:
            order.remove("allgather")
            order.insert(0, "allgather")
    if kind == "dense" and fabric.native_group is not None and order[0] != "allgather":
        order.insert(0, "native")
    for name in order:
        if name in transports.registry and _transport_class(name).can_carry(kind, shared):
            return name
    raise IncompatibleError(f"no registered transport carries {kind!r} payloads "
                            f"(registered: {', '.join(transports.available())})")


# ============================================================================ the pipeline
@dataclass
class CompressionStats:
    """Cumulative counters of a pipeline (bytes are per worker)."""

    rounds: int = 0             # aggregations (a multi-round method counts each of its rounds)
    bytes_dense: int = 0        # what plain fp32/fp64 allreduce inputs would be
    bytes_payload: int = 0      # what the compressor declares it sends (Payload.bits / 8)
    comm: CommStats = field(default_factory=CommStats)
    bytes_declared_sent: float = 0.0   # declared bytes x the transport's wire_copies()
    bytes_dense_sent: float = 0.0      # dense bytes x the transport's wire_copies()

    def as_dict(self) -> dict[str, float]:
        """Declared figures (``bytes_payload``, ``ratio``: what the compressor's ``bits`` count) next to
        measured ones (``bytes_sent`` from the transport's ledger, headers included), and how they
        compare: ``bytes_declared_sent`` is what the ledger would show if every payload travelled as
        declared (declared bytes x the transport's ``wire_copies()``), ``sent_over_declared`` the
        measured / that (about 1 when the wire carries the declared bits; 3.56 for natural on a
        summing transport, tens for scattered top-k through omnireduce's blocks), ``ratio_sent`` the
        compression ratio measured on the wire (dense bytes x ``wire_copies()`` / bytes sent)."""
        nan = float("nan")
        sent = self.comm.bytes_sent
        return {"rounds": self.rounds, "bytes_dense": self.bytes_dense,
                "bytes_payload": self.bytes_payload,
                "ratio": self.bytes_dense / self.bytes_payload if self.bytes_payload else nan,
                "bytes_sent": sent, "bytes_received": self.comm.bytes_received,
                "messages": self.comm.messages, "modelled_time_s": self.comm.modelled_time_s,
                "bytes_declared_sent": self.bytes_declared_sent,
                "sent_over_declared": sent / self.bytes_declared_sent if self.bytes_declared_sent else nan,
                "ratio_sent": self.bytes_dense_sent / sent if sent else nan}


class CommPipeline:
    """One worker's method + transport + generator: ``reduce(flat, key) -> averaged estimate``.

    Shared by :class:`DistributedOptimizer` and the DDP comm hook (:mod:`sparsecomm.ddp`).
    """

    def __init__(self, compressor: str | Compressor | Method = "none", transport: str | Transport = "auto",
                 *, method: str | None = None, transport_kwargs: dict | None = None,
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
        self.method = methods.warmup(build_method(compressor, method, **hyper), warmup_steps)
        warn_unguaranteed(self.method)
        self.transport = build_transport(transport, self.method, fabric, transport_kwargs)
        if nonfinite == "pass" and getattr(self.transport, "nonfinite", "pass") != "pass":
            self.transport.nonfinite = "pass"   # the transport's own NaN/Inf rule follows the optimizer's
        self.fabric = self.transport.fabric
        self.world_size = int(self.fabric.world_size)
        self.rank = int(self.fabric.rank)
        self.method.world_size = self.world_size
        self.seed = int(seed)
        self.shared_randomness = bool(getattr(self.method.compressor, "shared_randomness", False))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._param_generators: dict[tuple[str, torch.device], torch.Generator] = {}
        # method none + identity is plain averaging: skip the compressor's copy (and, as DDP, its
        # finiteness check)
        self._plain = self.method.name == "none" and getattr(self.method.compressor, "name", "") == "identity"
        self.stats = CompressionStats()
        self.last_stats = CommStats()
        self._outs: dict[Hashable, torch.Tensor] = {}
        #: the method state of every key (bucket, or ``("param", name)``): the pipeline holds them
        self.states: dict[Hashable, MethodState] = {}
        # parameter-keyed state (the DDP hook): the (name, numel) segments of each key's state and
        # the key that holds the current state of each named segment
        self._segments: dict[Hashable, tuple[tuple[str, int], ...]] = {}
        self._owner: dict[str, Hashable] = {}

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
        """Whether :meth:`start` can run the method per parameter (``segments=``): a one-round method
        whose payloads concatenate (``dense``, ``aligned``, ``sparse``)."""
        kind = getattr(self.method.compressor, "payload_kind", None)
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
        if not compress or self._plain:
            payload = dense_payload(flat)
            sent = flat
            # a transport that raises on a non-finite sum itself has checked it: no second pass
            recheck = check and getattr(self.transport, "nonfinite", None) != "raise"

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if recheck:
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
                payload_k, _ = self.method.encode(flat[off:off + k], self._state_of(("param", nm)),
                                                  self.param_generator(nm, flat.device), exact=exact, inplace=True)
                parts.append(payload_k)
                off += k
            payload = concat_payloads(parts)
            if poison:
                _poison(payload, key)
            sent = payload

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check:
                    _check_aggregate(agg, key)
                else:
                    check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                out = self._out(key, flat)
                a, o = agg.reshape(-1), 0
                for nm, k in segs:
                    self.method.decode(a[o:o + k], n, self.states[("param", nm)], out=out[o:o + k])
                    o += k
                return out
        else:
            poison = check and not exact and not _finite(flat)
            if poison:
                flat.zero_()
            enc_kw = {"shapes": shapes} if shapes is not None else {}
            ms = self._state_of(key)
            payload, _ = self.method.encode(flat, ms, self.generator(flat.device), exact=exact, inplace=True,
                                            **enc_kw)
            if poison:
                _poison(payload, key)
            sent = payload
            multi = self.method.multi_round

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check and not _finite(agg):
                    if not bool(torch.isnan(agg).any()):
                        # inputs were finite (checked) and no worker sent NaN: narrow floats (fp16) summed
                        # in their own dtype overflowed; say so (OverflowError_, on every worker)
                        check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                    _check_aggregate(agg, key)
                else:       # narrow floats summed in their dtype: an overflow is not a passed-through NaN
                    check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                # a method of several rounds (PowerSGD: P, then Q): the later rounds run here, on the
                # communication thread, right after the first (same order on every worker)
                while multi and (nxt := self.method.next_round(agg, n, ms)[0]) is not None:
                    self.last_stats = self.last_stats + self.transport.last_stats
                    self.stats.rounds += 1
                    self.stats.bytes_payload += _payload_bytes(nxt)
                    self.stats.bytes_declared_sent += _wire_copies(self.transport) * _payload_bytes(nxt)
                    agg = self.transport._call(nxt)
                    if check:
                        _check_aggregate(agg, key)
                    else:
                        check_sum_finite(nxt, agg, f"transport {self.transport.name!r}")
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

        return self.transport.start(sent, then=then)

    def _state_of(self, key: Hashable) -> MethodState:
        ms = self.states.get(key)
        if ms is None:
            ms = self.states[key] = self.method.init()
        return ms

    def keys(self) -> list[Hashable]:
        """The keys (buckets, or ``("param", name)`` per parameter) that hold a method state."""
        return [k for k, ms in self.states.items() if ms.state is not None]

    def state(self, key: Hashable) -> Any:
        """The method's typed state for ``key`` (``None`` before its first round)."""
        ms = self.states.get(key)
        return None if ms is None else ms.state

    def reset_states(self) -> None:
        """Forget every method state (a new layout, a world-size change)."""
        self.states = {}
        self._segments, self._owner = {}, {}

    def bind(self, key: Hashable, segments: tuple[tuple[str, int], ...]) -> None:
        """Declare that bucket ``key`` holds the named parameter segments ``(name, numel)`` in this
        order, before its round. When the method's state for ``key`` is missing or stale (its
        segments now live in other keys' states, after a bucket rebuild or a restore onto another
        layout), it is reassembled exactly, segment by segment, from the keys that hold them; a
        method state that is not per coordinate cannot be split and raises
        :class:`~sparsecomm.errors.MismatchError`, as does a bucket only partly covered by states."""
        segments = tuple((str(n), int(k)) for n, k in segments)
        st = {k: ms.state for k, ms in self.states.items() if ms.state is not None}
        names = [n for n, _ in segments]
        current = key in st and self._segments.get(key) == segments and \
            all(self._owner.get(n) == key for n in names)
        if not current:
            owned = [n for n in names if n in self._owner and self._owner[n] in st]
            if owned and len(owned) != len(names):
                missing = sorted(set(names) - set(owned))
                raise MismatchError(f"cannot restore the method state of a bucket holding "
                                    f"{names}: no state for {missing} while the others have one "
                                    f"(a checkpoint of another model or parameter set)")
            if owned:
                st[key] = self._assemble(segments)
            else:
                st.pop(key, None)    # a fresh bucket (or stale state of nothing current)
            self._segments[key] = segments
            for n in names:
                self._owner[n] = key
            # drop states none of whose segments they own any more
            live = set(self._owner.values())
            for k in [k for k in list(st) if k not in live and k in self._segments]:
                del st[k]
                self._segments.pop(k, None)
            rounds = max((ms.rounds for ms in self.states.values()), default=0)
            new: dict[Hashable, MethodState] = {}
            for k, v in st.items():
                ms = self.states.get(k)
                new[k] = ms if ms is not None and ms.state is v else MethodState(state=v, rounds=rounds)
            self.states = new

    def _assemble(self, segments: tuple[tuple[str, int], ...]) -> Any:
        st = {k: ms.state for k, ms in self.states.items() if ms.state is not None}
        pieces: dict[str, list[torch.Tensor]] = {}
        cls = None
        for name, numel in segments:
            k = self._owner[name]
            src = st[k]
            cls = type(src)
            layout = self._segments[k]
            off = 0
            for n2, k2 in layout:
                if n2 == name:
                    break
                off += k2
            total = sum(k2 for _, k2 in layout)
            if dict(layout)[name] != numel:
                raise MismatchError(f"parameter {name!r} has {numel} elements but {dict(layout)[name]} in "
                                    f"the saved method state")
            for f in fields(src):
                v = getattr(src, f.name)
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != total:
                    raise MismatchError(
                        f"method {self.method.name!r}: its state field {f.name!r} is not one value per "
                        f"coordinate, so it cannot be remapped onto another bucket layout; restore onto "
                        f"the same layout (DDP rebuilds its buckets after the first iteration)")
                pieces.setdefault(f.name, []).append(v[off:off + numel])
        return cls(**{n: torch.cat(v) for n, v in pieces.items()})

    def start_sparse(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable,
                     dtype: torch.dtype | None = None) -> CommWork:
        """Start the plain average of a row-sparse gradient (``None``: no rows) of a parameter of
        ``shape``; ``wait()`` returns the coalesced sparse average over the union of the workers' rows
        (as DDP's sparse allreduce: a row in the union whose sum is zero stays, with zeros). The table
        is never densified. Two ways (``sparse_rows=``):

        ``"gather"`` (default), as gloo's sparse allreduce: one gather of every worker's rows and their
        values (a row-sparse payload: the transport's own ``gather`` if it has one, else
        :meth:`Native.gather <sparsecomm.transports.native.Native.gather>` where the fabric has a native
        process group, else :meth:`AllGather.gather <sparsecomm.transports.allgather.AllGather.gather>`),
        concatenated in rank order and coalesced once (``(n - 1)`` copies of each worker's rows on the
        wire).

        ``"transport"``: two rounds through the pipeline's transport, neither of table size: (1) the
        union of the rows: a row-indicator vector of ``shape[0]`` entries, sent as a ``sparse`` payload
        (the touched rows' indices) on a transport that carries them, else dense; (2) the values of the
        union's rows (``|union| x row_len``, zeros for rows this worker did not touch), summed as a
        dense tensor by the same transport (the union's rows cross the wire about twice, whatever n)."""
        if self.sparse_rows == "gather":
            return self._start_gather(grad, torch.Size(shape), key, dtype or grad.dtype)
        shape = torch.Size(shape)
        dtype = dtype or grad.dtype
        nrows = int(shape[0]) if len(shape) else 1
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n = self.world_size
        check = self.nonfinite == "raise"
        if check and not _finite(vals):
            vals = torch.full_like(vals, float("nan"))
        ones = torch.ones(rows.numel(), dtype=torch.float32)
        if self.transport.can_carry("sparse"):
            marks: Any = Payload(kind="sparse", values=ones, indices=rows, shape=torch.Size([nrows]),
                                 dtype=torch.float32, bits=(4 + 8) * 8 * rows.numel())
        else:
            marks = torch.zeros(nrows, dtype=torch.float32)
            marks[rows] = 1.0
        elt = torch.empty(0, dtype=dtype).element_size()

        def job() -> torch.Tensor:
            counts = self.transport._call(marks)
            st = self.transport.last_stats
            union = counts.nonzero().flatten()
            mine = torch.zeros(union.numel(), row_len, dtype=dtype)
            if rows.numel():
                mine[torch.searchsorted(union, rows)] = vals
            total = self.transport._call(mine.reshape(-1)) if union.numel() else mine.reshape(-1)
            if check:
                _check_aggregate(total, key)
            total = total.reshape(union.numel(), *shape[1:]).div_(n)
            self.stats.rounds += 2
            self.stats.bytes_dense += int(shape.numel()) * elt
            pbytes = _payload_bytes(marks) + union.numel() * row_len * elt
            self.stats.bytes_payload += pbytes
            self.stats.bytes_declared_sent += _wire_copies(self.transport) * pbytes
            self.stats.bytes_dense_sent += _wire_copies(self.transport) * int(shape.numel()) * elt
            self.last_stats = self.last_stats + st + self.transport.last_stats
            return torch.sparse_coo_tensor(union[None], total, shape, is_coalesced=True,
                                           check_invariants=False)

        return engine(self.fabric).submit(job)

    def _make_gatherer(self) -> Any:
        """The transport's own ``gather`` if it has one, else torch.distributed's all-gather where the
        fabric has a native process group (``native``, as DDP), else an allgather on the fabric."""
        if callable(getattr(self.transport, "gather", None)):
            return self.transport
        if self.fabric.native_group is not None:
            return _transport_class("native")(self.fabric, nonfinite="pass")
        return AllGather(self.fabric, nonfinite="pass")

    def _start_gather(self, grad: torch.Tensor | None, shape: torch.Size, key: Hashable,
                      dtype: torch.dtype) -> CommWork:
        rows, vals = row_sparse_parts(grad, shape, dtype)
        row_len = vals.shape[1]
        n = self.world_size
        check = self.nonfinite == "raise"
        numel = int(shape.numel())
        payload = Payload(kind="sparse", values=vals.reshape(-1), indices=rows, shape=torch.Size([numel]),
                          dtype=dtype, bucket_size=row_len, bits=8 * (vals.numel() * vals.element_size()
                                                                      + 4 * rows.numel()))
        if self._gatherer is None:
            self._gatherer = self._make_gatherer()
        gatherer = self._gatherer
        elt = vals.element_size()

        def job() -> torch.Tensor:
            before = self.fabric.stats.copy()
            parts = gatherer.gather(payload)
            comm = self.fabric.stats - before
            idx = torch.cat([q.indices.reshape(-1) for q in parts])
            v = torch.cat([q.values.reshape(-1, row_len) for q in parts])
            if check:
                _check_aggregate(v, key)
            t = torch.sparse_coo_tensor(idx[None], v.reshape(idx.numel(), *shape[1:]), shape,
                                        check_invariants=False).coalesce()
            t.values().div_(n)
            pbytes = _payload_bytes(payload)
            copies = _wire_copies(gatherer)
            self.stats.rounds += 1
            self.stats.bytes_dense += numel * elt
            self.stats.bytes_payload += pbytes
            self.stats.bytes_declared_sent += copies * pbytes
            self.stats.bytes_dense_sent += _wire_copies(self.transport) * numel * elt
            self.last_stats = self.last_stats + comm
            return t

        return engine(self.fabric).submit(job)

    def _out(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The persistent estimate buffer of bucket ``key`` (reused every round: no fresh allocation)."""
        buf = self._outs.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._outs[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buf

    def begin_step(self) -> None:
        """Start a new ``last_stats`` accumulation (one per optimizer step)."""
        self.stats.comm = self.stats.comm + self.last_stats
        self.last_stats = CommStats()

    def totals(self) -> CompressionStats:
        return CompressionStats(self.stats.rounds, self.stats.bytes_dense, self.stats.bytes_payload,
                                self.stats.comm + self.last_stats, self.stats.bytes_declared_sent,
                                self.stats.bytes_dense_sent)

    def state_dict(self) -> dict[str, Any]:
        return {"method": states_to_dict(self.method, self.states),
                "segments": dict(self._segments), "owner": dict(self._owner),
                "generators": {str(d): g.get_state() for d, g in self._generators.items()},
                "param_generators": {(nm, str(d)): g.get_state() for (nm, d), g in self._param_generators.items()},
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "shared_randomness": self.shared_randomness}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a stateless method with shared (or no) randomness has nothing rank-specific
        rank_free = self.method.State is None and (self.shared_randomness or not (
            state.get("generators") or state.get("param_generators")))
        if state.get("world_size") != self.world_size or (state.get("rank") != self.rank and not rank_free):
            raise MismatchError(
                f"sparsecomm state saved on rank {state.get('rank')} of {state.get('world_size')} "
                f"cannot be loaded on rank {self.rank} of {self.world_size} (the method state is per "
                f"worker); delete the 'sparsecomm' entry to load only the inner optimizer's state")
        self.states = states_from_dict(self.method, state["method"])
        self._segments = dict(state.get("segments", {}))
        self._owner = dict(state.get("owner", {}))
        self._generators = {}
        for d, s in state.get("generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._generators[torch.device(d)] = g
        self._param_generators = {}
        for (nm, d), s in state.get("param_generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._param_generators[(nm, torch.device(d))] = g



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


def row_sparse_parts(grad: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows (int64) and their values (``rows x row_len``, in ``dtype``) of a row-sparse gradient
    (``None``: no rows) of a parameter of ``shape``, coalesced; only one sparse dimension (as
    ``nn.Embedding``'s) is supported."""
    nrows = int(shape[0]) if len(shape) else 1
    row_len = int(shape.numel()) // max(nrows, 1)
    if grad is None:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, row_len, dtype=dtype)
    g = grad.coalesce()
    if g.sparse_dim() != 1:
        raise SparseCommError(f"sparse gradients with {g.sparse_dim()} sparse dimensions are not "
                              f"supported (only row-sparse ones, as nn.Embedding's)")
    rows = g.indices()[0]
    return rows, g.values().reshape(rows.numel(), row_len).to(dtype)

def _finite(x: torch.Tensor) -> bool:
    return math.isfinite(abs_max(x.reshape(-1))) if x.is_floating_point() else True


_NONFINITE_HELP = ("pass nonfinite='pass' to let NaN/Inf through as DDP does, or find the cause "
                   "(learning rate, loss scaling, torch.autograd.set_detect_anomaly)")


def _check_aggregate(agg: torch.Tensor, key: Hashable) -> None:
    if not _finite(agg):
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on at least one worker "
                             f"(the aggregate is not finite, or a float16/bfloat16 sum overflowed; raised on every "
                             f"worker); {_NONFINITE_HELP}")


def _poison(p: Payload, key: Hashable) -> None:
    """Make ``p`` (encoded from zeros) carry NaN, so every worker's aggregate is non-finite."""
    nan = float("nan")
    if p.values.is_floating_point() and p.values.numel():
        p.values.fill_(nan)
    elif p.scale is not None and p.scale.is_floating_point() and p.scale.numel():
        p.scale.fill_(nan)
    else:
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on this worker and its "
                             f"{p.kind!r} payload cannot carry the fact to the other workers; "
                             f"{_NONFINITE_HELP}")


def warn_unguaranteed(method: Method) -> None:
    """Warn about a method x compressor pair with no convergence guarantee that diverges in practice:
    error feedback (EF, EF21) around an unbiased compressor that is not contractive (omega >= 1, e.g.
    QSGD with few levels): EF's analysis needs ``delta``-contraction (Stich et al. 2018; Richtarik et
    al. 2021), and a scaled unbiased operator with omega >= 1 expands the error it feeds back."""
    comp = method.compressor
    if method.name not in ("ef", "ef21") or not getattr(comp, "unbiased", False):
        return
    try:
        omega = float(comp.omega(1 << 16))
    except Exception:  # noqa: BLE001 - compressors without omega: nothing to say
        return
    if omega >= 1.0:
        cname = getattr(comp, "name", "") or type(comp).__name__
        warnings.warn(
            f"method {method.name!r} with compressor {cname!r} (unbiased, omega={omega:.3g} >= 1) has no "
            f"convergence guarantee and can diverge (EF + QSGD with 4 levels reached 3.4e7): error "
            f"feedback needs a contractive compressor (topk, or {cname!r} scaled by 1/(omega+1): "
            f"'induced'/'compose'), or use 'diana' for unbiased compressors", UserWarning, stacklevel=3)


def _wire_copies(transport: Any) -> float:
    f = getattr(transport, "wire_copies", None)
    if f is not None:
        return float(f())
    n = transport.fabric.world_size
    return 2.0 * (n - 1) / n


def _payload_bytes(p: Any) -> int:
    if isinstance(p, torch.Tensor):
        return p.numel() * p.element_size()
    bits = int(getattr(p, "bits", 0) or 0)
    if bits:
        return (bits + 7) // 8
    return sum(t.numel() * t.element_size() for t in p.wire_tensors())
