"""The communication pipeline shared by :class:`~sparsecomm.optim.DistributedOptimizer` and the DDP
hook (:mod:`sparsecomm.ddp`): resolving a compressor / method / transport from names, checking that
the transport carries the method's payloads, and :class:`CommPipeline`, which takes one flat bucket
through ``method.encode -> transport.allreduce -> method.decode`` and keeps the per-worker state
(method state, generators, byte counts) that checkpoints carry. The rules (names, ``"auto"``, the
incompatibility error) are documented in :mod:`sparsecomm.optim`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from .compressors.base import Compressor
from .errors import IncompatibleError, MismatchError, SparseCommError, UnknownNameError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import Method, check_kwargs, dense_payload
from .payload import check_sum_finite
from .transports.base import Transport

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
        check_kwargs(methods.registry.factory(mname), hyper, f"method {mname!r}")
        return methods.get(mname, compressor=compressor, **hyper)
    if not isinstance(compressor, str):
        raise TypeError(f"compressor must be a name, a Compressor or a Method, got {compressor!r}")
    if compressor in methods.registry:
        if method is not None:
            raise TypeError(f"compressor={compressor!r} is a method; to pick its compressor use "
                            f"compressor=<compressor name>, method={compressor!r}")
        return methods.get(compressor, **hyper)
    if compressor in compressors.registry:
        mname = method or "none"
        methods.registry.factory(mname)  # unknown method names raise, listing the valid ones
        return methods.get(mname, compressor=compressor, **hyper)
    raise UnknownNameError(
        f"unknown compressor or method {compressor!r}; methods: {', '.join(methods.available())}; "
        f"compressors: {', '.join(compressors.available())}")


def default_fabric() -> Fabric:
    """The fabric of the current :func:`sparsecomm.launch` worker, else a TorchFabric over the default
    process group."""
    from .launch import current_context

    ctx = current_context()
    if ctx is not None:
        return ctx.fabric
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            from .fabric.torch_fabric import TorchFabric
        except ModuleNotFoundError as e:  # pragma: no cover - until TorchFabric lands
            raise SparseCommError("torch.distributed is initialised but sparsecomm.fabric.torch_fabric "
                                  "is not available; pass fabric=") from e
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
    the wire (``packed_values``: natural compression, 9 of 32 bits) go to allgather while its
    ``(n-1)`` packed copies cost less than a ring's ``2 (n-1)/n`` unpacked ones."""
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
        if (n - 1) * packed < 2.0 * (n - 1) / n * 32:
            order.remove("allgather")
            order.insert(0, "allgather")
    if kind == "dense" and type(fabric).__name__ == "TorchFabric" and order[0] != "allgather":
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

    rounds: int = 0
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
                 fabric: Fabric | None = None, seed: int = 0, **hyper: Any) -> None:
        self.method = build_method(compressor, method, **hyper)
        self.transport = build_transport(transport, self.method, fabric, transport_kwargs)
        self.fabric = self.transport.fabric
        self.world_size = int(self.fabric.world_size)
        self.rank = int(self.fabric.rank)
        self.seed = int(seed)
        self.shared_randomness = bool(getattr(self.method.compressor, "shared_randomness", False))
        self._generators: dict[torch.device, torch.Generator] = {}
        # method none + identity is plain averaging: skip the compressor's copy (and, as DDP, its
        # finiteness check)
        self._plain = self.method.name == "none" and getattr(self.method.compressor, "name", "") == "identity"
        self.stats = CompressionStats()
        self.last_stats = CommStats()
        self._outs: dict[Hashable, torch.Tensor] = {}

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
               compress: bool = True) -> torch.Tensor:
        """The averaged estimate for this worker's flat ``flat`` of bucket ``key``.

        ``compress=False`` bypasses the method (plain average, no state); ``exact=True`` runs the
        method's exact (uncompressed) round. ``flat`` is scratch: the method may overwrite it and a
        transport built with ``inplace=True`` may write the sum into it. The result is the transport's
        output divided in place (a fresh tensor, or ``flat`` itself), or the method's estimate written
        into this bucket's persistent buffer; either stays valid until the next ``reduce`` of ``key``
        (callers keep views of it, as DDP's ``gradient_as_bucket_view``).
        """
        dense_bytes = flat.numel() * flat.element_size()
        if not compress or self._plain:
            payload = dense_payload(flat)
            out = self.transport.allreduce(flat).div_(self.world_size)
        else:
            payload = self.method.encode(flat, key, self.generator(flat.device), exact=exact, inplace=True)
            agg = self.transport.allreduce(payload)
            check_sum_finite(payload, agg, f"transport {self.transport.name!r}")
            out = self.method.decode(agg, self.world_size, key, out=self._out(key, agg))
        pbytes = _payload_bytes(payload)
        copies = _wire_copies(self.transport)
        self.stats.rounds += 1
        self.stats.bytes_dense += dense_bytes
        self.stats.bytes_payload += pbytes
        self.stats.bytes_declared_sent += copies * pbytes
        self.stats.bytes_dense_sent += copies * dense_bytes
        self.last_stats = self.last_stats + self.transport.last_stats
        return out

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
        self._generators = {}
        for d, s in state.get("generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._generators[torch.device(d)] = g


def _wire_copies(transport: Any) -> float:
    f = getattr(transport, "wire_copies", None)
    if f is not None:
        return float(f())
    n = transport.fabric.world_size
    return 2.0 * (n - 1) / n


def _payload_bytes(p: Any) -> int:
    bits = int(getattr(p, "bits", 0) or 0)
    if bits:
        return (bits + 7) // 8
    return sum(t.numel() * t.element_size() for t in p.wire_tensors())
