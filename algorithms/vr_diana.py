"""VR-DIANA, the L-SVRG variant (Horvath, Kovalev, Mishchenko, Richtarik, Stich, "Stochastic Distributed
Learning with Gradient Quantization and Variance Reduction", arXiv 1904.05115).

Each worker holds a finite sum f_i = (1/N_i) sum_j f_ij and only evaluates mini-batches of size b. DIANA
is fed a loopless-SVRG estimator with a reference point w shared by all workers (one server coin):

    worker i:  g_i = grad f_iB(x) - grad f_iB(w) + grad f_i(w)           (B: b rows of worker i's own data)
               then DIANA's round on g_i (m_i = C(g_i - h_i), h_i += alpha m_i)
    server:    x -= gamma (h + mean_i m_i);  with probability p: w <- x (the point just used), every worker
               recomputes grad f_i(w)  (p = 1/m, m = N_i/b mini-batches per worker)

The compression goes through the library's ``diana`` method; the estimator is algorithm-specific code
here. Both noise sources vanish at x* (g_i -> grad f_i(x*), h_i -> grad f_i(x*)), so the method converges
linearly to x* with stochastic local gradients: O((kappa (1 + omega/n) + m + omega) log 1/eps) iterations
(abstract of arXiv 1904.05115; :func:`theory.rates.vr_diana_iterations`).

Default step: :func:`theory.rates.vr_diana` (a documented heuristic, tested at that default in
tests/algorithms/test_algorithms_vr_diana.py; the paper's strongly convex constant
could not be verified). ``grad_evals`` counts per-worker sample gradients (2b per step, + N_i per refresh).

Example::

    prob = problems.logistic("breast_cancer", n_workers=10, split="label", lam=1e-1)
    opt = VRDIANA([x], problem=prob, batch_size=1, compressor="randk", ratio=0.1)
    for _ in range(20000):
        opt.step()
"""

from __future__ import annotations

from typing import Any

import torch

import sparsecomm as sc
from sparsecomm.errors import SparseCommError
from sparsecomm.theory import rates

from .base import CompressedOptimizer, ConfigError


class VRDIANA(CompressedOptimizer):
    """VR-DIANA (L-SVRG estimator + the library's DIANA method). Needs ``problem=`` with
    ``grads``, ``sample_grads``, ``sample_indices`` and ``counts`` (a :class:`theory.problems.FiniteSumProblem`).

    Args: ``batch_size`` b, ``p`` (reference refresh probability; default b / max_i N_i), ``alpha``
    (default 1/(omega+1)), and the keywords of :class:`algorithms.base.CompressedOptimizer`.
    """

    default_compressor = "randk"
    _state_attrs = ("w", "grads_w")

    def __init__(self, params, *, problem: Any, batch_size: int = 1, p: float | None = None,
                 alpha: float | None = None, **kw: Any) -> None:
        for attr in ("grads", "sample_grads", "sample_indices", "counts"):
            if not hasattr(problem, attr):
                raise SparseCommError(f"VRDIANA needs a finite-sum problem with {attr!r}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.m_local = max(1, int(problem.counts.max()) // self.batch_size)
        super().__init__(params, problem=problem, **kw)
        self.p = float(p) if p is not None else 1.0 / self.m_local
        if not 0.0 < self.p <= 1.0:
            raise ConfigError(f"p must be in (0, 1], got {self.p}")
        self.alpha = float(alpha) if alpha is not None else 1.0 / (self.omega() + 1.0)
        self.use_method(sc.methods.get("diana", compressor=self.compressor, alpha=self.alpha))
        self._data_gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 424_242)
        self.w = None
        self.grads_w = None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["sparsecomm"]["data_generator"] = self._data_gen.get_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        gen = state_dict.get("sparsecomm", {}).get("data_generator")
        super().load_state_dict(state_dict)
        if gen is not None:
            self._data_gen.set_state(gen)

    def theory_lr(self) -> float:
        owner = type(self).__name__
        return rates.vr_diana(self.constants.get("L_sample_max", owner), self.omega(), self.n_eff,
                              self.m_local)[0]

    def _refresh(self, w: torch.Tensor) -> None:
        self.w = w.clone()
        self.grads_w = self.problem.grads(self.w)
        self.grad_evals += float(self.problem.counts.double().mean())

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """One round (the closure is not used: the estimator needs the problem's sample oracle).
        Returns the (n, d) stochastic estimates g_i."""
        if closure is not None:
            raise SparseCommError("VRDIANA.step takes no closure; it samples from problem=")
        x = self.flat_params()
        if self.w is None:
            self._refresh(x)
        idx = self.problem.sample_indices(self.batch_size, self._data_gen)
        G = self.problem.sample_grads(x, idx) - self.problem.sample_grads(self.w, idx) + self.grads_w
        self.grad_evals += 2.0 * self.batch_size
        est = self.run_methods(self.method, G.to(self.dtype))
        self._apply(est)
        if float(torch.rand((), generator=self._server_gen, dtype=torch.float64)) < self.p:
            self._refresh(x)
        self.rounds += 1
        return G
