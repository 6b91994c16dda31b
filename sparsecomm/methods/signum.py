"""``signum``: signSGD with momentum and majority vote (Bernstein, Wang, Azizzadenesheli, Anandkumar,
"signSGD: compressed optimisation for non-convex problems", ICML 2018, and the ICLR 2019 majority-vote
paper)::

    worker i: m_i <- beta m_i + (1 - beta) g_i;   send sign(m_i)      (m_i^0 = 0, beta = 0.9)
    all:      estimate = sign(sum_i sign(m_i))                          (the majority vote)

The momentum stays on the worker (it is what gets signed); the aggregate is the vote of
:mod:`~sparsecomm.methods.signsgd`, carried as integer codes with a shared scale by every transport.
Use it with a momentum-free inner optimizer (plain SGD): the momentum is already here. An exact round
(warm-up) sends m_i itself and the estimate is the sign of the summed momenta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .signsgd import SignSGD
from ..errors import InvalidValueError


@dataclass
class SignumState:
    """Per-bucket state of ``signum``: the worker's momentum ``m_i``."""

    momentum: torch.Tensor


class Signum(SignSGD):
    """``get("signum", beta=0.9)``."""

    name = "signum"
    State = SignumState

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= float(beta) < 1.0:
            raise InvalidValueError(f"signum: beta must be in [0, 1), got {beta!r}")
        self.beta = float(beta)
        super().__init__()

    def hyper(self):
        return {"beta": self.beta}

    def init_state(self, d, dtype, device):
        return SignumState(torch.zeros(d, dtype=dtype, device=device))

    def _message(self, grad, ms):
        st = ms.state
        st.momentum.mul_(self.beta).add_(grad, alpha=1.0 - self.beta)
        return st.momentum          # the vote's codes never alias it (SignSGD._encode copies it when exact)
