"""Independent sparsification, the "99%" paper (Mishchenko, Hanzely, Richtarik, "99% of Worker-Master
Communication in Distributed Optimization Is Not Needed", UAI 2020, arXiv 1901.09437).

x is cut into m blocks; every round each worker sends an independent uniformly random set of tau blocks of
its message, scaled by m/tau (an unbiased compressor with omega = m/tau - 1, exactly):

    IS-SGD:    x^{k+1} = x^k - gamma (1/n) sum_i (m/tau) U_{S_i} grad f_i(x^k)        (DCGD with that compressor)
    IS-DIANA:  the same compressor inside DIANA (shifts remove the floor when grad f_i(x*) != 0)

The averaged message has variance (omega/n) mean_i ||g_i||^2, so the iteration count scales with
1 + omega/n = 1 + (m/tau - 1)/n: flat (within 2x) down to tau ~ m/n blocks per worker, growing like
m/(n tau) below (:func:`theory.rates.is_sgd_iterations`). With m = d (blocks = coordinates, the default)
the compressor is the library's rand-k with k = tau and a private seed per worker; for m < d the
block version :class:`IndependentBlockSparsifier` below (algorithm-specific, not registered).

Default steps. IS-SGD: gamma = 1/(L + 2 (m/tau - 1) L_max/n), DCGD's certified step
(:func:`theory.rates.dcgd`: linear convergence to a neighbourhood of x* of radius
2 gamma omega sigma*^2/(mu n), whatever the data), unless the interpolation regime grad f_i(x*) = 0 holds,
where the step with half the variance term, gamma = 1/(L + (m/tau - 1) L_max/n) (:func:`theory.rates.is_sgd`,
derived for interpolation only) is certified. ``interpolation=None`` (default) decides from the problem:
the interpolation step only when the problem exposes ``sigma_star_sq`` and it is zero up to rounding;
``interpolation=True`` insists and raises :class:`ConfigError` when the problem shows it is false;
``interpolation=False`` always takes DCGD's step. (On heterogeneous data the interpolation step would be
up to 2x the certified one, with no guarantee: 1.48x for tau = 5 of 50 on the label-sorted logistic
problem of tests/algorithms/test_algorithms.py.)
IS-DIANA: DIANA's (:func:`theory.rates.diana`) with omega = m/tau - 1, certified in both regimes.

Example::

    prob = problems.synthetic_least_squares(n_workers=10, d=40, kappa=10)     # interpolation
    opt = ISSGD([x], tau=4, problem=prob)         # m = d = 40 blocks; sigma*^2 = 0: the interpolation step
"""

from __future__ import annotations

import math
from typing import Any

import torch

import sparsecomm as sc
from sparsecomm.compressors.base import Compressor
from sparsecomm.payload import Payload
from sparsecomm.theory import rates

from .base import ConfigError
from .dcgd import DCGD
from .diana import DIANA


class IndependentBlockSparsifier(Compressor):
    """Keep tau of m (near-)equal contiguous blocks, chosen uniformly without replacement from the given
    generator, scaled by m/tau: unbiased, omega = m/tau - 1 exactly (E||C(x)||^2 = (m/tau)||x||^2 whatever
    the block sizes). Payload ``sparse`` (worker-specific positions); bits = the dtype's width per kept
    value plus ceil(log2 m) per block id."""

    name = "independent_blocks"
    payload_kind = "sparse"
    unbiased = True
    shared_randomness = False

    def __init__(self, m: int, tau: int) -> None:
        if not 1 <= tau <= m:
            raise ConfigError(f"need 1 <= tau <= m, got tau={tau}, m={m}")
        self.m, self.tau = int(m), int(tau)

    def hyper(self) -> dict:
        return {"m": self.m, "tau": self.tau}

    def _bounds(self, d: int) -> torch.Tensor:
        if d < self.m:
            raise ConfigError(f"cannot cut a length-{d} vector into m = {self.m} blocks")
        return torch.tensor([(b * d) // self.m for b in range(self.m + 1)])

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        bounds = self._bounds(d)
        blocks = torch.randperm(self.m, generator=generator)[: self.tau]
        idx = torch.cat([torch.arange(int(bounds[b]), int(bounds[b + 1])) for b in blocks.tolist()])
        vals = flat[idx] * (self.m / self.tau)
        bits = torch.finfo(x.dtype).bits * idx.numel() + self.tau * max(1, math.ceil(math.log2(self.m)))
        return Payload("sparse", vals, x.shape, x.dtype, indices=idx, bits=bits)

    def omega(self, d: int) -> float:
        return self.m / self.tau - 1.0

    def delta(self, d: int) -> float:
        return 0.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> int:
        """Bits of a payload whose kept blocks hold the average number of values, d tau/m."""
        return torch.finfo(dtype).bits * (d * self.tau // self.m) + self.tau * max(1, math.ceil(math.log2(self.m)))


def rand_tau_compressor(tau: int, d: int, m: int | None = None) -> Compressor:
    """The IS compressor: the library's rand-k with k = tau when m = d (blocks are coordinates), else
    :class:`IndependentBlockSparsifier`. Checks the declared omega equals m/tau - 1."""
    m = d if m is None else int(m)
    if m == d:
        c = sc.compressors.randk(k=int(tau))
    else:
        c = IndependentBlockSparsifier(m, tau)
    want = m / tau - 1.0
    if not math.isclose(float(c.omega(d)), want, rel_tol=1e-12, abs_tol=1e-12):
        raise ConfigError(f"{c!r} declares omega={c.omega(d)} for d={d}, expected m/tau - 1 = {want}")
    return c


class ISSGD(DCGD):
    """IS-SGD: DCGD with independent rand-tau-of-m block sparsification (see module doc).

    Args: ``params``, ``tau`` (blocks per worker), ``m`` (number of blocks; default d), ``interpolation``
    (``None``: decide from the problem's ``sigma_star_sq``; ``True``: the interpolation step, checked
    against the problem when it can be; ``False``: DCGD's certified step), and the keywords of
    :class:`algorithms.dcgd.DCGD` except ``compressor``. ``self.interpolation`` records the regime used.
    """

    #: sigma*^2 below this fraction of L_max^2 ||x*||^2 (the scale of the local gradients between 0 and x*)
    #: counts as zero: the solver's rounding, not heterogeneity
    INTERPOLATION_RTOL = 1e-16

    def __init__(self, params, *, tau: int, m: int | None = None, interpolation: bool | None = None,
                 **kw: Any) -> None:
        if "compressor" in kw:
            raise TypeError("ISSGD builds its own compressor from tau and m")
        if interpolation not in (None, True, False):
            raise ConfigError(f"interpolation must be None, True or False, got {interpolation!r}")
        params = _as_list(params)
        d = _numel(params)
        self.tau, self.m = int(tau), (d if m is None else int(m))
        self._interpolation_arg = interpolation
        self.interpolation = bool(interpolation)
        super().__init__(params, compressor=rand_tau_compressor(self.tau, d, self.m), **kw)

    def _interpolates(self) -> bool | None:
        """Whether the problem shows grad f_i(x*) = 0 for all i (None when it cannot tell)."""
        src = self.problem
        s = getattr(src, "sigma_star_sq", None)
        if s is None:
            return None
        x_star = getattr(src, "x_star", None)
        scale = float(self.constants.get("L_max", "ISSGD")) ** 2
        scale *= max(float((x_star.double() ** 2).sum()), 1.0) if x_star is not None else 1.0
        return float(s) <= self.INTERPOLATION_RTOL * scale

    def theory_lr(self) -> float:
        c = self.constants
        owner = type(self).__name__
        L = c.get("L", owner) if c.has("L") else None
        seen = self._interpolates()
        if self._interpolation_arg is None:
            self.interpolation = bool(seen)
        elif self._interpolation_arg and seen is False:
            raise ConfigError(
                f"ISSGD(interpolation=True): the problem has sigma*^2 = {self.problem.sigma_star_sq:.3g} > 0 "
                f"(grad f_i(x*) != 0), so the interpolation step 1/(L + omega L_max/n) is not certified; use "
                f"interpolation=None/False (DCGD's step 1/(L + 2 omega L_max/n), converging to a neighbourhood), "
                f"ISDIANA (shifts remove the floor), or pass lr= explicitly")
        if self.interpolation:
            return rates.is_sgd(c.get("L_max", owner), self.m, self.tau, self.n_eff, L=L)
        return rates.dcgd(c.get("L_max", owner), self.omega(), self.n_eff, L=L)


class ISDIANA(DIANA):
    """IS-DIANA: DIANA with independent rand-tau-of-m block sparsification (see module doc)."""

    def __init__(self, params, *, tau: int, m: int | None = None, **kw: Any) -> None:
        if "compressor" in kw:
            raise TypeError("ISDIANA builds its own compressor from tau and m")
        params = _as_list(params)
        d = _numel(params)
        self.tau, self.m = int(tau), (d if m is None else int(m))
        super().__init__(params, compressor=rand_tau_compressor(self.tau, d, self.m), **kw)


def _as_list(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _numel(params: list) -> int:
    out = 0
    for p in params:
        if isinstance(p, dict):
            out += sum(q.numel() for q in p["params"])
        else:
            out += p.numel()
    return out
