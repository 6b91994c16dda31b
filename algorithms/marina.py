"""MARINA (Gorbunov, Burlachenko, Li, Richtarik, ICML 2021, arXiv 2102.07845).

    x^{k+1} = x^k - gamma g^k;   the server draws c_k ~ Bernoulli(p) and broadcasts it
    worker i: sends grad f_i(x^{k+1}) uncompressed if c_k, else C_i(grad f_i(x^{k+1}) - grad f_i(x^k))
    server:   g^{k+1} = mean_i grad f_i(x^{k+1}) if c_k, else g^k + mean_i C_i(...)        (g^0 = grad f(x^0))

A biased estimator (unlike DIANA's); C_i in U(omega), independent. The library has no ``marina`` method,
so the update is implemented here on top of the compressor (``compress`` / ``decompress``); the
uncompressed rounds and the first round cost d values per worker (64 d bits in float64).

Default parameters (:func:`theory.rates.marina`): p = 1/(omega+1), gamma = 1/(L + L_tilde sqrt((1-p) omega/(p n))).

Example::

    prob = problems.logistic("digits", n_workers=5, split="iid", lam=0.0, nc_lam=0.1)
    opt = MARINA([x], compressor="randk", ratio=1/61, problem=prob)
    for _ in range(5000):
        opt.step()
"""

from __future__ import annotations

from typing import Any

import torch

from sparsecomm.theory import rates

from .base import CompressedOptimizer, ConfigError, dense_bits


class MARINA(CompressedOptimizer):
    """MARINA over an unbiased compressor (default rand-k). Args: ``p`` (default 1/(omega+1)) and the
    keywords of :class:`algorithms.base.CompressedOptimizer`."""

    default_compressor = "randk"
    _state_attrs = ("g", "prev", "full_rounds")

    def __init__(self, params, *, p: float | None = None, **kw: Any) -> None:
        self._p_arg = p
        super().__init__(params, **kw)
        self.p = float(p) if p is not None else 1.0 / (self.omega() + 1.0)
        if not 0.0 < self.p <= 1.0:
            raise ConfigError(f"p must be in (0, 1], got {self.p}")
        self.g = None
        self.prev = None
        self.full_rounds = 0

    def theory_lr(self) -> float:
        c = self.constants
        owner = type(self).__name__
        return rates.marina(c.get("L", owner), c.get("L_tilde", owner), self.omega(), self.n_eff, p=self._p_arg)[0]

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:
        full = self.g is None or bool(torch.rand((), generator=self._server_gen, dtype=torch.float64) < self.p)
        if full:
            self.g = G.mean(0)
            self.bits_sent += dense_bits(self.d, self.dtype) * self.n
            self.full_rounds += 1
        else:
            gens = self.generators()
            agg = torch.zeros(self.d, dtype=self.dtype)
            for i in range(self.n):
                payload = self.compressor.compress(G[i] - self.prev[i], gens[i])
                agg += self.compressor.decompress(payload).reshape(-1).to(self.dtype)
                self.bits_sent += self.payload_bits(payload)
            self.g = self.g + agg / self.n
        self.prev = G.clone()
        return self.g
