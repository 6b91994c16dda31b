"""``none``: send the compressor's output as it is (DCGD).

worker i sends ``m_i = C(g_i)``; the estimate is ``(1/n) sum_i m_i``. Stateless. With an unbiased
compressor the estimate is unbiased with variance <= (omega/n) mean_i ||g_i||^2; with a biased one
(top-k) it is neither, and the bias is never corrected (use ``ef`` or ``ef21``).
"""

from __future__ import annotations

import torch

from ..compressors._common import all_finite, divide_finite, widen_divide, widen_divide_finite
from ..payload import Payload
from .base import Method, MethodState


class NoMethod(Method):
    """Compression without memory: ``encode(g) = C(g)``, ``decode(sum) = sum / n``."""

    name = "none"
    default_compressor = "identity"
    State = None
    decodes_narrow = True

    def _encode(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                exact: bool, world_size: int) -> Payload:
        ms.pending = exact
        return self._compress(grad, generator, exact)

    def _decode(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> None:
        ms.take_pending(self.name)
        if aggregate.dtype == out.dtype:
            torch.div(aggregate, world_size, out=out)
        else:       # a narrow sum (decodes_narrow): widened and divided in one pass, the same bits
            widen_divide(aggregate, world_size, out)

    def _decode_finite(self, aggregate: torch.Tensor, world_size: int, ms: MethodState,
                       out: torch.Tensor) -> bool:
        # each quotient of the division by n >= 1 is finite iff its element of the sum is: the division's pass
        # checks (the same bits as _decode's); NoMethod's direct decode is that (named: whatever a subclass
        # makes of decode_direct)
        return NoMethod.decode_direct(self, aggregate, world_size, ms, out)

    # the round is the compressor's alone: the direct calls make no call of their own (the same state changes as
    # encode's and decode_finite's, in the same order)
    def encode_direct(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                      world_size: int) -> Payload:
        ms.length = grad.shape[0]       # (flat: its numel)
        ms.last_round = False
        ms.pending = False
        payload = self.compressor.compress(grad, generator)
        ms.started = True
        ms.rounds += 1
        return payload

    def decode_direct(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> bool:
        ms.last_round = False
        ms.take_pending(self.name)
        if aggregate.dtype == out.dtype:
            if out is aggregate:
                return divide_finite(out, world_size)
            torch.div(aggregate, world_size, out=out)
            return all_finite(out)
        return widen_divide_finite(aggregate, world_size, out)
