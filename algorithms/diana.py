"""DIANA: compressed gradient *differences* with learned shifts (Mishchenko, Gorbunov, Takac, Richtarik,
arXiv 1901.09269).

    worker i: m_i = C(g_i - h_i);  h_i += alpha m_i;  send m_i              (C in U(omega), independent)
    server:   g_hat = h + (1/n) sum_i m_i;  h += alpha (1/n) sum_i m_i;  x -= gamma g_hat

Driven by the library's ``diana`` method (``sparsecomm.methods.diana``, one object per worker, h_i and the
copy of h live there). With full local gradients it converges linearly to x* even when grad f_i(x*) != 0.

Default parameters (:func:`theory.rates.diana`, arXiv 2206.07021 Thm 2.2), when ``mu`` is known:
alpha = 1/(omega+1), gamma = min{1/((1 + 6 omega/n) L_max), alpha/(2 mu)}, with the guarantee
E V^k <= (1 - gamma mu)^k V^0 for V^k = ||x^k - x*||^2 + (4 omega gamma^2/(alpha n^2)) sum_i ||h_i^k - grad f_i(x*)||^2.
Without ``mu`` (non-convex), the VR-DIANA "Th.4" step of :func:`theory.rates.diana_nonconvex` (m = 1).

Example::

    prob = problems.logistic("digits", n_workers=20, split="label", lam=1e-2)
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = DIANA([x], compressor="randk", ratio=0.02, problem=prob)
    for _ in range(20000):
        opt.step()
    opt.lyapunov(prob)     # the theorem's V^k
"""

from __future__ import annotations

from typing import Any

import torch

import sparsecomm as sc
from sparsecomm.theory import rates

from .base import CompressedOptimizer


class DIANA(CompressedOptimizer):
    """DIANA through ``sc.methods.get("diana", alpha=...)`` on every worker.

    Args: as :class:`algorithms.dcgd.DCGD`, plus ``alpha`` (shift step; default 1/(omega+1)) and ``init``
    (``"zeros"``: h_i^0 = 0, the paper's choice, or ``"grad"``: h_i^0 = grad f_i(x^0) sent uncompressed).
    """

    default_compressor = "randk"

    def __init__(self, params, *, alpha: float | None = None, init: str = "zeros", **kw: Any) -> None:
        self._alpha_arg = alpha
        super().__init__(params, **kw)
        self.alpha = float(alpha) if alpha is not None else 1.0 / (self.omega() + 1.0)
        self.methods = [sc.methods.get("diana", compressor=self.compressor, alpha=self.alpha, init=init)
                        for _ in range(self.n)]

    def theory_lr(self) -> float:
        c = self.constants
        owner = type(self).__name__
        omega = self.omega()
        if c.has("mu"):
            gamma, _ = rates.diana(c.get("L_max", owner), omega, self.n_eff, mu=c.get("mu", owner))
        else:
            gamma, _ = rates.diana_nonconvex(c.get("L_max", owner), omega, self.n_eff)
        return gamma

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:
        return self.run_methods(self.methods, G)

    def shifts(self) -> torch.Tensor:
        """(n, d) the current local shifts h_i (zeros before the first step)."""
        rows = []
        for m in self.methods:
            st = m.state(0)
            rows.append(torch.zeros(self.d, dtype=self.dtype) if st is None else st.h_local.clone())
        return torch.stack(rows)

    def lyapunov(self, problem: Any = None) -> float:
        """DIANA's Lyapunov function V = ||x - x*||^2 + (4 omega gamma^2/(alpha n n_eff)) sum_i ||h_i - grad f_i(x*)||^2
        (:func:`theory.rates.diana_lyapunov_coefficient`; n_eff = n for independent compressors, 1 for shared
        seeds, the same n_eff as the default step), for a problem with ``x_star`` and ``grads_star``."""
        problem = self.problem if problem is None else problem
        x = self.flat_params()
        coef = rates.diana_lyapunov_coefficient(self.omega(), self.lr, self.alpha, self.n, n_eff=self.n_eff)
        h = self.shifts()
        return float(((x - problem.x_star) ** 2).sum() + coef * ((h - problem.grads_star) ** 2).sum())
