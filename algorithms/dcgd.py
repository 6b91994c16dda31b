"""DCGD: distributed compressed gradient descent without shifts.

    x^{k+1} = x^k - gamma (1/n) sum_i C_i(grad f_i(x^k)),     C_i in U(omega), independent

Driven by the library's ``none`` method (``sparsecomm.methods.none``): worker i sends C(g_i), the estimate
is the mean of the decompressed messages. With heterogeneous data (grad f_i(x*) != 0) it converges only
to a neighbourhood of x* of radius 2 gamma omega sigma*^2/(mu n) (:func:`theory.rates.dcgd_neighbourhood`);
DIANA removes that floor.

Default step: gamma = 1/(L + 2 omega L_max/n) (:func:`theory.rates.dcgd`, derived there).

Example::

    opt = DCGD([x], compressor="randk", ratio=0.02, problem=prob)   # n_workers from prob.n
    for _ in range(1000):
        opt.step()
"""

from __future__ import annotations

from typing import Any

import torch

import sparsecomm as sc
from sparsecomm.theory import rates

from .base import CompressedOptimizer


class DCGD(CompressedOptimizer):
    """Compressed gradient descent through ``sc.methods.get("none")`` on every worker.

    Args: ``params`` (x), ``n_workers``, ``compressor`` (name or object, default ``"randk"``; its
    hyper-parameters as keywords), ``lr`` (default: :func:`theory.rates.dcgd` from ``problem``/``constants``),
    ``problem`` (oracle with ``grads(x) -> (n, d)`` and constants), ``seed``, ``independent``.
    """

    default_compressor = "randk"

    def __init__(self, params, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.methods = [sc.methods.get("none", compressor=self.compressor) for _ in range(self.n)]

    def theory_lr(self) -> float:
        c = self.constants
        owner = type(self).__name__
        L = c.get("L", owner) if c.has("L") else None
        return rates.dcgd(c.get("L_max", owner), self.omega(), self.n_eff, L=L)

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:
        return self.run_methods(self.methods, G)
