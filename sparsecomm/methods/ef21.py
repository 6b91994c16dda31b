"""``ef21``: Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically Better, and
Practically Faster Error Feedback", NeurIPS 2021, arXiv 2106.05203.

Worker i keeps g_i, every worker keeps a copy of the global g = mean_i g_i::

    worker: c_i = C(grad_i - g_i);  g_i += decompress(c_i);  send c_i        # C in B(delta)
    all:    g += (1/n) sum_i decompress(c_i);   estimate = g

Invariant: g == mean_i g_i after every round (the aggregate tracks the mean of the g_i).

Initialisation (``init``):

- ``"grad"`` (default, as in the authors' code ``IgorSokoloff/ef21_experiments_source_code``):
  g_i^0 = grad_i^0, i.e. the first round of each bucket is sent uncompressed (an exact round), so
  G^0 = mean ||g_i^0 - grad_i^0||^2 = 0 in the rate of Thm 1;
- ``"zeros"``: g_i^0 = 0 and every round is compressed (the first message is C(grad)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..payload import Payload
from ..compressors._common import all_finite
from .base import Method, MethodState, raise_input_nonfinite
from ..errors import InvalidValueError

INITS = ("grad", "zeros")


@dataclass
class EF21State:
    """Per-bucket state of ``ef21``: this worker's ``g_local`` (g_i) and the shared ``g_global`` (g)."""

    g_local: torch.Tensor
    g_global: torch.Tensor


class EF21(Method):
    """EF21 around any (contractive) compressor (default: top-k, ratio 0.01)."""

    name = "ef21"
    default_compressor = "topk"
    default_compressor_hyper = {"ratio": 0.01}
    State = EF21State
    checks_input = True

    def __init__(self, compressor=None, *, init: str = "grad", **compressor_hyper) -> None:
        if init not in INITS:
            raise InvalidValueError(f"ef21: init must be one of {INITS}, got {init!r}")
        self.init_rule = init
        super().__init__(compressor, **compressor_hyper)

    def hyper(self) -> dict:
        return {**super().hyper(), "init": self.init_rule}

    def init_state(self, d: int, dtype: torch.dtype, device: torch.device) -> EF21State:
        return EF21State(g_local=torch.zeros(d, dtype=dtype, device=device),
                         g_global=torch.zeros(d, dtype=dtype, device=device))

    def _encode(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                exact: bool, world_size: int) -> Payload:
        st = ms.state
        exact = exact or (not ms.started and self.init_rule == "grad")
        grad.sub_(st.g_local)
        if not all_finite(grad):
            raise_input_nonfinite(self.name, "g - g_i (the gradient minus this worker's g_i)")
        msg = self._compress(grad, generator, exact)   # C(grad - g_i)
        self._add_decompressed(st.g_local, msg)                 # g_i += c_i
        ms.pending = exact
        return msg

    def _decode(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> None:
        ms.take_pending(self.name)
        st = ms.state
        st.g_global.add_(aggregate.to(st.g_global.dtype), alpha=1.0 / world_size)   # g += mean c_i
        out.copy_(st.g_global)
