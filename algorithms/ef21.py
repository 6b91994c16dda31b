"""EF21 and classic error feedback, for contractive compressors.

EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, arXiv 2106.05203), through the library's ``ef21``
method (``sparsecomm.methods.ef21``; g_i^0 = grad f_i(x^0) sent uncompressed, as in the authors' code)::

    x^{t+1} = x^t - gamma g^t
    worker i: c_i = C(grad f_i(x^{t+1}) - g_i);  g_i += c_i;  send c_i        (C in B(delta))
    server:   g^{t+1} = g^t + (1/n) sum_i c_i

Default step (non-convex, :func:`theory.rates.ef21`): gamma = 1/(L + L_tilde sqrt(beta/theta)), theta = 1 - sqrt(1-delta),
beta = (1-delta)/(1-sqrt(1-delta)). Rate (1/T) sum_t E||grad f(x^t)||^2 <= 2(f(x^0) - f_inf)/(gamma T) for G^0 = 0.

EF (Seide et al. 2014), through the library's ``ef`` method: p_i = g_i + e_i, c_i = C(p_i), e_i = p_i - c_i,
x -= gamma mean_i c_i. No closed-form step without extra assumptions, so ``lr`` is required (tune it).

Example::

    prob = problems.logistic("digits", n_workers=20, split="label", lam=0.0, nc_lam=0.1)
    opt = EF21([x], compressor="topk", k=1, problem=prob)     # or ratio=1/d
    for _ in range(10000):
        opt.step(); print(prob.grad_norm_sq(x), opt.bits_sent / prob.n)
"""

from __future__ import annotations

from typing import Any

import torch

import sparsecomm as sc
from sparsecomm.errors import SparseCommError
from sparsecomm.theory import rates

from .base import CompressedOptimizer


class EF21(CompressedOptimizer):
    """EF21 through ``sc.methods.get("ef21")`` on every worker (default compressor: top-k)."""

    default_compressor = "topk"

    def __init__(self, params, *, init: str = "grad", **kw: Any) -> None:
        super().__init__(params, **kw)
        self.methods = [sc.methods.get("ef21", compressor=self.compressor, init=init) for _ in range(self.n)]

    def theory_lr(self) -> float:
        c = self.constants
        owner = type(self).__name__
        return rates.ef21(c.get("L", owner), c.get("L_tilde", owner), self.delta())

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:
        return self.run_methods(self.methods, G)


class EF(CompressedOptimizer):
    """Classic error feedback through ``sc.methods.get("ef")`` on every worker; ``lr`` is required."""

    default_compressor = "topk"

    def __init__(self, params, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.methods = [sc.methods.get("ef", compressor=self.compressor) for _ in range(self.n)]

    def theory_lr(self) -> float:
        raise SparseCommError("EF has no closed-form step size without bounded-gradient or "
                              "heterogeneity assumptions: pass lr= (tune it)")

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:
        return self.run_methods(self.methods, G)
