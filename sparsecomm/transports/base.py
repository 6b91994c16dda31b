"""The transport contract: a collective written once against a :class:`~sparsecomm.fabric.Fabric`.

``allreduce(x)`` returns, on every worker, the sum over workers of ``x`` (a tensor) or of
``x.to_dense()`` (a :class:`~sparsecomm.payload.Payload`), with the shape and dtype of the original
tensor. The call's :class:`CommStats` (bytes, messages, modelled time on SimFabric) is at
``last_stats``. A transport never knows which compressor made a payload, only its kind
(DESIGN.md, "Payload kinds"); ``carries`` declares the kinds it can sum.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..errors import IncompatibleError
from ..fabric.base import Fabric
from ..fabric.stats import CommStats
from ..payload import Payload


class Transport(ABC):
    """Base class of the collectives. Subclasses implement :meth:`_allreduce_tensor` and, for the
    compressed kinds they carry natively, :meth:`_allreduce_payload`."""

    name: ClassVar[str] = ""
    #: payload kinds this transport sums (``dense`` means plain tensors too)
    carries: ClassVar[frozenset[str]] = frozenset({"dense"})
    #: whether ``quantized`` payloads must share their scale across workers to be carried
    quantized_needs_shared_scale: ClassVar[bool] = True

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.last_stats = CommStats()

    # ------------------------------------------------------------------ public
    def allreduce(self, x: torch.Tensor | Payload) -> torch.Tensor:
        """Sum of ``x`` over all workers, on every worker; ``last_stats`` holds this call's CommStats."""
        before = self.fabric.stats.copy()
        t0_model = self.fabric.now()
        t0_wall = time.perf_counter()
        if isinstance(x, Payload):
            self.check_payload(x)
            out = self._allreduce_payload(x)
            out = out.reshape(x.shape).to(x.dtype)
        else:
            out = self._allreduce_tensor(x.reshape(-1)).reshape(x.shape)
        stats = self.fabric.stats - before
        stats.wall_time_s = time.perf_counter() - t0_wall
        stats.modelled_time_s = self._modelled(t0_model)
        self.last_stats = stats
        return out

    def wire_copies(self) -> float:
        """How many copies of one worker's payload this transport's sends amount to, per worker, when
        the payload travels as declared (ring-like reduce-scatter + all-gather: ``2 (n-1)/n``). The
        pipeline multiplies the declared bytes by it to compare them with the ledger
        (``compression_stats()["sent_over_declared"]``)."""
        n = self.fabric.world_size
        return 2.0 * (n - 1) / n

    @classmethod
    def can_carry(cls, kind: str, shared_scale: bool = False) -> bool:
        """True if this transport sums payloads of ``kind`` (with that scale sharing)."""
        if kind not in cls.carries:
            return False
        if kind == "quantized" and cls.quantized_needs_shared_scale and not shared_scale:
            return False
        return True

    def check_payload(self, p: Payload) -> None:
        if not self.can_carry(p.kind, p.shared_scale):
            raise IncompatibleError(incompatible_message(self.name, p.kind, p.shared_scale))

    # --------------------------------------------------------------- protocol
    @abstractmethod
    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum a flat dense tensor over workers."""

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        """Sum payloads; the default densifies, which is right for ``dense`` payloads."""
        return self._allreduce_tensor(p.to_dense())

    def _modelled(self, t0: float) -> float:
        from ..fabric.sim import SimFabric  # local import: only the sim has a modelled clock

        return self.fabric.now() - t0 if isinstance(self.fabric, SimFabric) else 0.0


def incompatible_message(transport: str, kind: str, shared_scale: bool = False, source: str | None = None) -> str:
    """The error text for a payload kind a transport cannot sum, naming the transports that can."""
    from . import registry

    ok = [n for n in registry.available() if registry.factory(n).can_carry(kind, shared_scale)]
    what = f"{source!r} produces {kind!r} payloads" if source else f"{kind!r} payloads"
    if kind == "quantized" and not shared_scale:
        what += " with a per-worker scale"
    return (f"transport {transport!r} cannot carry {what}; transports that can: {', '.join(ok) or 'none'}")
