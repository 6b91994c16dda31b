"""``ef``: classic error feedback (Seide et al. 2014; Stich & Karimireddy 2019).

Worker i keeps the residual e_i (e_i^0 = 0)::

    p_i = g_i + e_i;   m_i = C(p_i);   e_i <- p_i - decompress(m_i);   send m_i
    estimate = (1/n) sum_i decompress(m_i)

so ``g_i + e_old == decompress(m_i) + e_new`` exactly (up to float rounding): nothing the compressor
drops is lost, only delayed. Works with any compressor; meant for contractive ones (top-k, sign).

The residual is kept in *gradient* units (the learning rate is applied afterwards by the inner
optimizer), as in GRACE's ``ResidualMemory`` and PowerSGD; with a constant learning rate this is the
textbook ``e + gamma g`` form scaled by 1/gamma. An exact round (warm-up) sends ``g + e`` whole and
flushes the residual to zero.

``p`` is checked for NaN/Inf in the pass that forms it (:attr:`~sparsecomm.methods.base.Method.checks_input`): a
residual grown near the dtype's largest value overflows ``g + e`` to Inf with every gradient finite, and the
pipeline then makes that the same ``NonFiniteError`` on every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressors._common import add_finite, all_finite
from ..payload import Payload
from .base import Method, MethodState, add_work, raise_input_nonfinite


@dataclass
class EFState:
    """Per-bucket state of ``ef``: the worker's residual ``e_i``."""

    error: torch.Tensor


class ErrorFeedback(Method):
    """Error feedback around any compressor (default: top-k, ratio 0.01)."""

    name = "ef"
    default_compressor = "topk"
    default_compressor_hyper = {"ratio": 0.01}
    State = EFState
    checks_input = True

    def init_state(self, d: int, dtype: torch.dtype, device: torch.device) -> EFState:
        return EFState(error=torch.zeros(d, dtype=dtype, device=device))

    def _encode(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                exact: bool, world_size: int) -> Payload:
        st = ms.state
        p = grad                                               # p = g + e (in the scratch copy), checked in the
        if not (add_finite(grad, st.error, grad) if ms.started else all_finite(grad)):     # same pass
            raise_input_nonfinite(self.name, "g + e (the gradient plus the error-feedback residual)")
        msg = self._compress(p, generator, exact)
        err = st.error
        err.copy_(p)
        self._add_decompressed(err, msg, -1.0)                 # e_new = p - decompress(m)
        ms.pending = exact
        return msg

    def work(self, phase, state, d, *, exact=False, shapes=None):
        """Encode: ``g + e`` checked in the same pass (after the first round; before it, the check of ``g``), the
        compression (without its own finiteness read), the residual's copy and the message decompressed out of
        it; decode: the division."""
        if phase != "encode":
            return super().work(phase, state, d, exact=exact, shapes=shapes)
        sent = {"elementwise": d} if exact else add_work(self.compress_work(d), self.compressor.decompress_work(d))
        formed = {"elementwise": 2 * d} if state.started else {"check": d, "elementwise": d}
        return add_work(sent, formed, {"kernel": 1})

    def _decode(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> None:
        ms.take_pending(self.name)
        torch.div(aggregate, world_size, out=out)
