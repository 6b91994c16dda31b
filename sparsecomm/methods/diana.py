"""``diana``: Mishchenko, Gorbunov, Takac, Richtarik, "Distributed Learning with Compressed Gradient
Differences", arXiv 1901.09269.

Worker i keeps the shift h_i, every worker keeps a copy of the global shift h = mean_i h_i::

    worker: m_i = C(grad_i - h_i);  h_i += alpha * decompress(m_i);  send m_i     # C in U(omega)
    all:    estimate = h + (1/n) sum_i decompress(m_i);  h += alpha * (1/n) sum_i decompress(m_i)

The estimate is unbiased, and on a fixed gradient the shifts converge to the local gradients
(h_i -> grad_i), so the compression variance vanishes at the optimum: DIANA converges to x* where
plain compressed SGD (``none``) stalls at a floor.

``alpha`` defaults to 1/(omega(d)+1) with omega the compressor's declared constant for the bucket's
length d (the largest step the theory allows, alpha in (0, 1/(omega+1)]); a float sets it for every
bucket. ``init``: ``"zeros"`` (default, h_i^0 = 0, the paper's first option) or ``"grad"``
(h_i^0 = grad_i^0: the first round of a bucket is sent uncompressed). On exact rounds (warm-up) the
compressor is the identity (omega = 0), so the step is 1 and the shifts jump to the gradients.
The compressor must be unbiased; the default is shared-seed rand-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..payload import Payload
from ..compressors._common import all_finite
from .base import Method, MethodState, raise_input_nonfinite
from ..errors import InvalidValueError

INITS = ("zeros", "grad")


@dataclass
class DianaState:
    """Per-bucket state of ``diana``: this worker's shift ``h_local`` (h_i) and the shared ``h_global`` (h)."""

    h_local: torch.Tensor
    h_global: torch.Tensor


class Diana(Method):
    """DIANA around an unbiased compressor (default: shared-seed rand-k, ratio 0.01)."""

    name = "diana"
    default_compressor = "randk"
    default_compressor_hyper = {"ratio": 0.01}
    State = DianaState
    checks_input = True
    needs_unbiased = True

    def __init__(self, compressor=None, *, alpha: float | None = None, init: str = "zeros",
                 **compressor_hyper) -> None:
        if init not in INITS:
            raise InvalidValueError(f"diana: init must be one of {INITS}, got {init!r}")
        if alpha is not None and not 0.0 < float(alpha) <= 1.0:
            raise InvalidValueError(f"diana: alpha must be in (0, 1], got {alpha!r}")
        self.alpha = None if alpha is None else float(alpha)
        self.init_rule = init
        super().__init__(compressor, **compressor_hyper)

    def hyper(self) -> dict:
        return {**super().hyper(), "alpha": self.alpha, "init": self.init_rule}

    def alpha_for(self, d: int) -> float:
        """The shift step for a bucket of length ``d``: ``alpha`` or 1/(omega(d)+1)."""
        if self.alpha is not None:
            return self.alpha
        omega = float(self.compressor.omega(d))
        if not math.isfinite(omega) or omega < 0:
            raise InvalidValueError(f"diana: compressor {self.compressor!r} declares omega={omega}; "
                             f"pass alpha= explicitly")
        return 1.0 / (omega + 1.0)

    def _alpha(self, ms: MethodState, d: int) -> float:
        """:meth:`alpha_for` the bucket's length, derived once per state (``ms.constants``)."""
        if ms.constants is None:
            ms.constants = self.alpha_for(d)
        return ms.constants

    def init_state(self, d: int, dtype: torch.dtype, device: torch.device) -> DianaState:
        return DianaState(h_local=torch.zeros(d, dtype=dtype, device=device),
                          h_global=torch.zeros(d, dtype=dtype, device=device))

    def _encode(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                exact: bool, world_size: int) -> Payload:
        st = ms.state
        exact = exact or (not ms.started and self.init_rule == "grad")
        alpha = 1.0 if exact else self._alpha(ms, grad.numel())
        grad.sub_(st.h_local)
        if not all_finite(grad):
            raise_input_nonfinite(self.name, "g - h_i (the gradient minus this worker's shift h_i)")
        msg = self._compress(grad, generator, exact)   # C(grad - h_i)
        self._add_decompressed(st.h_local, msg, alpha)          # h_i += alpha m_i
        ms.pending = alpha
        return msg

    def _decode(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> None:
        alpha = ms.take_pending(self.name)
        st = ms.state
        agg = aggregate.to(st.h_global.dtype)
        torch.add(st.h_global, agg, alpha=1.0 / world_size, out=out)     # h + mean m_i
        st.h_global.add_(agg, alpha=alpha / world_size)                 # h += alpha mean m_i
