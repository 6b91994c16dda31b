"""``native``: ``torch.distributed.all_reduce`` (gloo's or NCCL's own algorithm), the baseline.

Exists only on :class:`~sparsecomm.fabric.torch_fabric.TorchFabric`; with services in the job it reduces
over the workers' subgroup only. Carries the same kinds as ``ring`` (``dense``; ``aligned`` value
vectors; ``quantized`` codes with a shared scale, summed as int32/int64: gloo's all_reduce rejects
int8) through :func:`sparsecomm.transports.ring.linear_operand`, after the same agreement handshake.

``last_stats``: torch.distributed does not report its traffic, so the all-reduce itself is booked at the
bandwidth-optimal ring volume, ``2 (n-1)/n`` of the vector each way per worker, in one message per
direction and ``2 (n-1)`` rounds (an estimate: gloo and NCCL use ring-like algorithms for large
tensors); ``CommStats.estimated_bytes`` counts those booked bytes, so ``last_stats.estimated`` is true and
the measured part (the handshake) is ``bytes_sent + bytes_received - estimated_bytes``.

Integer sums that could overflow are summed in a wider integer dtype (at least int32) and
range-checked; NaN/Inf raise unless ``nonfinite="pass"`` (:mod:`._guards`), on every worker.
"""

from __future__ import annotations

import torch

from ..errors import FabricTimeout, IncompatibleError, PeerFailure
from ..fabric.base import Fabric
from ..payload import Payload
from .base import registry
from ._guards import nonfinite_option
from .base import Transport
from .ring import guarded_sum, linear_operand


@registry.register("native")
class Native(Transport):
    """``torch.distributed.all_reduce`` over the workers (see the module docstring)."""

    name = "native"
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True

    def __init__(self, fabric: Fabric, *, inplace: bool = False, nonfinite: str = "raise") -> None:
        super().__init__(fabric)
        self.nonfinite = nonfinite_option(nonfinite, "native")
        self.inplace = inplace   # all-reduce a plain tensor input in place (scratch buckets), no copy
        if fabric.native_group is None:
            raise IncompatibleError(
                f"transport 'native' calls torch.distributed.all_reduce, so it needs a TorchFabric "
                f"(launch backend 'gloo' or 'nccl'), not a {type(fabric).__name__}; on SimFabric use 'ring' "
                f"(the same dense sum, bandwidth-optimal, written against the Fabric) or 'allgather'")
        if not fabric.is_worker:
            raise ValueError("transports run on workers, not on service endpoints")

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._run(flat)

    def _allreduce_payload(self, p: Payload) -> torch.Tensor:
        return self._run(p)

    def _run(self, x: torch.Tensor | Payload) -> torch.Tensor:
        import torch.distributed as dist

        f = self.fabric
        n = f.world_size
        op = linear_operand(x, n, self.name)
        return op.finish(guarded_sum(f, "native allreduce", op, {}, self.nonfinite,
                                     self.inplace and isinstance(x, torch.Tensor), self._reduce,
                                     int_floor=torch.int32))

    def _reduce(self, acc: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        f = self.fabric
        n = f.world_size
        if n > 1:
            try:
                dist.all_reduce(acc, group=f.native_group)
            except RuntimeError as exc:
                msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
                if "Timed out" in msg or "timed out" in msg:
                    raise FabricTimeout(f"worker {f.rank}: torch.distributed.all_reduce timed out: {msg}") from exc
                raise PeerFailure(f"worker {f.rank}: torch.distributed.all_reduce failed, probably because "
                                  f"another rank died: {msg}") from exc
            nbytes = acc.numel() * acc.element_size()
            moved = 2 * (n - 1) * nbytes // n
            st = f.stats
            st.bytes_sent += moved
            st.bytes_received += moved
            st.messages += 1
            st.messages_received += 1
            st.rounds += 2 * (n - 1)
            st.estimated_bytes += 2 * moved
        return acc
