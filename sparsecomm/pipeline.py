"""The communication pipeline shared by :class:`~sparsecomm.optim.DistributedOptimizer` and the DDP
hook (:mod:`sparsecomm.ddp`): resolving a compressor / method / transport from names, checking that
the transport carries the method's payloads, and :class:`CommPipeline`, which takes one flat bucket
through ``method.encode -> transport.allreduce -> method.decode`` and keeps the per-worker state
(method state, generators, byte counts) that checkpoints carry. The rules (names, ``"auto"``, the
incompatibility error) are documented in :mod:`sparsecomm.optim`.

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

import math
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from .compressors.base import Compressor
from .errors import IncompatibleError, MismatchError, NonFiniteError, SparseCommError, UnknownNameError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import HyperParameterError, Method, check_kwargs, dense_payload
from .payload import Payload, check_sum_finite
from .transports.base import CommWork, Transport, engine

NONFINITE = ("raise", "pass")

AUTO_ORDER = ("ring", "omnireduce", "switch", "allgather")


# ============================================================================ resolution helpers
def build_method(compressor: str | Compressor | Method = "none", method: str | None = None,
                 **hyper: Any) -> Method:
    """A Method from a method or compressor name (+ hyper-parameters) or an object (see module doc)."""
    from . import compressors, methods

    if isinstance(compressor, Method):
        if method is not None or hyper:
            raise TypeError(f"a Method object ({compressor!r}) was given; method= and hyper-parameters "
                            f"{sorted(hyper)} belong to its constructor")
        return compressor
    if isinstance(compressor, Compressor):
        mname = method or "none"
        _check_takes_compressor(mname)
        check_kwargs(methods.registry.factory(mname), hyper, f"method {mname!r}")
        return methods.get(mname, compressor=compressor, **hyper)
    if not isinstance(compressor, str):
        raise TypeError(f"compressor must be a name, a Compressor or a Method, got {compressor!r}")
    if compressor in methods.registry:
        if method is not None:
            raise TypeError(f"compressor={compressor!r} is a method; to pick its compressor use "
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
    from . import methods

    if not _accepts(methods.registry.factory(mname), "compressor"):
        raise HyperParameterError(f"method {mname!r} brings its own operator and takes no compressor; "
                                  f"use compressor={mname!r} (with its own hyper-parameters)")


def default_fabric() -> Fabric:
    """The fabric of the current :func:`sparsecomm.launch` worker, else a TorchFabric over the default
    process group."""
    from .launch import current_context

    ctx = current_context()
    if ctx is not None:
        return ctx.fabric
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .fabric.torch_fabric import TorchFabric

        return TorchFabric()
    raise SparseCommError("no fabric: call this inside sc.launch(fn, ...), pass fabric=, or initialise "
                          "torch.distributed first")


def _transport_class(name: str) -> Any:
    from . import transports

    return transports.registry.factory(name)  # unknown names raise, listing the valid ones


def _payload_traits(comp: Compressor) -> tuple[str, bool]:
    return comp.payload_kind, bool(getattr(comp, "shared_scale", False))


def _carried_compressors(tcls: Any) -> list[str]:
    from . import compressors

    out = []
    for n in compressors.available():
        f = compressors.registry.factory(n)
        kind = getattr(f, "payload_kind", None)
        if kind is not None and tcls.can_carry(kind, bool(getattr(f, "shared_scale", False))):
            out.append(n)
    return out


def check_pair(method: Method, transport_name: str, tcls: Any) -> None:
    """Raise IncompatibleError when ``tcls`` cannot carry what ``method``'s compressor produces."""
    from . import transports

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
    from . import transports

    if isinstance(transport, Transport):
        if transport_kwargs:
            raise TypeError("transport_kwargs given with a Transport object")
        if fabric is not None and transport.fabric is not fabric:
            raise SparseCommError("fabric= differs from the fabric of the Transport object")
        check_pair(method, transport.name or type(transport).__name__, type(transport))
        return transport
    if not isinstance(transport, str):
        raise TypeError(f"transport must be a name or a Transport, got {transport!r}")
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
    import inspect

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
    from . import transports

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
                 **hyper: Any) -> None:
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.method = build_method(compressor, method, **hyper)
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
        # method none + identity is plain averaging: skip the compressor's copy (and, as DDP, its
        # finiteness check)
        self._plain = self.method.name == "none" and getattr(self.method.compressor, "name", "") == "identity"
        self.stats = CompressionStats()
        self.last_stats = CommStats()
        self._outs: dict[Hashable, torch.Tensor] = {}
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

    def reduce(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False,
               compress: bool = True, shapes: Any = None) -> torch.Tensor:
        """``start(flat, key, ...).wait()``: the averaged estimate (see :meth:`start`)."""
        return self.start(flat, key, exact=exact, compress=compress, shapes=shapes).wait()

    def start(self, flat: torch.Tensor, key: Hashable, *, exact: bool = False,
              compress: bool = True, shapes: Any = None) -> CommWork:
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
        """
        dense_bytes = flat.numel() * flat.element_size()
        n = self.world_size
        check = self.nonfinite == "raise"
        if not compress or self._plain:
            payload = dense_payload(flat)
            sent = flat

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check:
                    _check_aggregate(agg, key)
                return agg.div_(n)
        else:
            poison = check and not exact and not _finite(flat)
            if poison:
                flat.zero_()
            enc_kw = {"shapes": shapes} if shapes is not None else {}
            payload = self.method.encode(flat, key, self.generator(flat.device), exact=exact, inplace=True,
                                         **enc_kw)
            if poison:
                _poison(payload, key)
            sent = payload
            next_round = getattr(self.method, "next_round", None)

            def finish(agg: torch.Tensor) -> torch.Tensor:
                if check and not _finite(agg) and not bool(torch.isnan(agg).any()):
                    # inputs were finite (checked) and no worker sent NaN: narrow floats (fp16) summed
                    # in their own dtype overflowed; say so (OverflowError_, on every worker)
                    check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                if check:
                    _check_aggregate(agg, key)
                else:       # narrow floats summed in their dtype: an overflow is not a passed-through NaN
                    check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
                # a method of several rounds (PowerSGD: P, then Q): the later rounds run here, on the
                # communication thread, right after the first (same order on every worker)
                while next_round is not None and (nxt := next_round(agg, n, key)) is not None:
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
                return self.method.decode(agg, n, key, out=self._out(key, flat))

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

    def bind(self, key: Hashable, segments: tuple[tuple[str, int], ...]) -> None:
        """Declare that bucket ``key`` holds the named parameter segments ``(name, numel)`` in this
        order, before its round. When the method's state for ``key`` is missing or stale (its
        segments now live in other keys' states, after a bucket rebuild or a restore onto another
        layout), it is reassembled exactly, segment by segment, from the keys that hold them; a
        method state that is not per coordinate cannot be split and raises
        :class:`~sparsecomm.errors.MismatchError`, as does a bucket only partly covered by states."""
        segments = tuple((str(n), int(k)) for n, k in segments)
        st = self.method._state
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

    def _assemble(self, segments: tuple[tuple[str, int], ...]) -> Any:
        from dataclasses import fields

        st = self.method._state
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
        (as DDP's sparse allreduce: a row in the union whose sum is zero stays, with zeros).

        Two rounds on the communication thread, neither of table size: (1) the union of the rows: a
        row-indicator vector of ``shape[0]`` entries, sent as a ``sparse`` payload (the touched rows'
        indices) on a transport that carries them, else dense; (2) the values of the union's rows
        (``|union| x row_len``, zeros for rows this worker did not touch), summed as a dense tensor by
        the same transport. The table is never densified."""
        from .payload import Payload

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
        return {"method": self.method.state_dict(),
                "segments": dict(self._segments), "owner": dict(self._owner),
                "generators": {str(d): g.get_state() for d, g in self._generators.items()},
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "shared_randomness": self.shared_randomness}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a stateless method with shared (or no) randomness has nothing rank-specific
        rank_free = self.method.State is None and (self.shared_randomness or not state.get("generators"))
        if state.get("world_size") != self.world_size or (state.get("rank") != self.rank and not rank_free):
            raise MismatchError(
                f"sparsecomm state saved on rank {state.get('rank')} of {state.get('world_size')} "
                f"cannot be loaded on rank {self.rank} of {self.world_size} (the method state is per "
                f"worker); delete the 'sparsecomm' entry to load only the inner optimizer's state")
        self.method.load_state_dict(state["method"])
        self._segments = dict(state.get("segments", {}))
        self._owner = dict(state.get("owner", {}))
        self._generators = {}
        for d, s in state.get("generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._generators[torch.device(d)] = g



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
    from .compressors._common import abs_max

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
    import warnings

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
