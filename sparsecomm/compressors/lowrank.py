"""PowerSGD's low-rank operator (Vogels, Karimireddy, Jaggi, NeurIPS 2019): the traits the rounds of
method ``powersgd`` declare (:mod:`sparsecomm.methods.powersgd`: dense payloads, a generator shared by
every worker), not in the catalog. As a single-worker operator, ``compress(x, generator)`` is one power
step from a Gaussian Q on ``x`` viewed as the matrix ``theory.powersgd_matrix(x.shape)``::

    M = x as (n, m);   Q ~ N(0, 1)^(m x r);   P = orth(M Q);   C(x) = P (M^T P)^T

with r = min(n, m, matrix_approximation_rank), computed in float64.
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from ..errors import GeneratorRequiredError
from ..payload import Payload
from .base import Compressor


class LowRank(Compressor):
    """The traits PowerSGD's rounds declare (dense payloads, a shared generator); ``compress`` is the
    single-worker operator: one power step from a Gaussian Q on ``x`` viewed as (x.shape[0], -1)."""

    name, payload_kind, shared_randomness = "powersgd", "dense", True

    def __init__(self, matrix_approximation_rank: int = 1) -> None:
        self.matrix_approximation_rank = matrix_approximation_rank

    def compress(self, x, generator=None):
        r = self.matrix_approximation_rank
        m = x.detach().reshape(*th.powersgd_matrix(x.shape)).to(torch.float64)
        q = torch.randn(m.shape[1], min(r, *m.shape), generator=need_generator(generator), dtype=m.dtype)
        p = torch.linalg.qr(m @ q).Q
        return Payload("dense", (p @ (m.T @ p).T).reshape(-1).to(x.dtype), x.shape, x.dtype,
                       bits=th.powersgd_bits([x.shape], r, 0.0, torch.finfo(x.dtype).bits))

    def delta(self, d):
        return 0.0   # no worst-case contraction (theory.lowrank_delta is the best rank-r's)

    def hyper(self):
        return {"matrix_approximation_rank": self.matrix_approximation_rank}


def need_generator(generator: torch.Generator | None) -> torch.Generator:
    """``generator``, or :class:`~sparsecomm.errors.GeneratorRequiredError` when there is none (PowerSGD
    draws its Qs from a generator every worker shares)."""
    if generator is None:
        raise GeneratorRequiredError("powersgd draws its starting Q from a generator shared by every worker "
                                     "(never the global RNG): pass one (the optimizer and the DDP hook do)")
    return generator
