"""VR-DIANA (L-SVRG estimator inside the library's DIANA method): linear convergence to x* with
stochastic local gradients where DIANA fed plain mini-batch gradients stalls at its noise floor."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import DIANA, VRDIANA
from theory import problems as P
from theory import rates


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_vr_diana_converges_where_stochastic_diana_stalls():
    """At VR-DIANA's default step (:func:`theory.rates.vr_diana`, the documented heuristic
    1/(6 L_sample (1 + 6 omega/n))), unchanged: linear convergence to x* (10^3x in 500 steps), where plain
    stochastic DIANA at the same step stays at its noise floor. kappa = 2 and rand-8 of 20 (omega = 1.5) keep
    the default step's run short."""
    prob = P.synthetic_logistic(n_workers=10, rows_per_worker=20, d=20, kappa=2.0, split="label", seed=0)
    x = torch.zeros(prob.d, dtype=torch.float64)
    vr = VRDIANA([x], problem=prob, batch_size=1, compressor="randk", k=8, seed=0)
    gamma, alpha, p = rates.vr_diana(prob.L_sample_max, 1.5, prob.n, 20)
    assert (vr.lr, vr.alpha, vr.p) == (pytest.approx(gamma), pytest.approx(alpha), pytest.approx(p))
    # worked number: 1 + 6 * 1.5/10 = 1.9, so gamma = 1/(11.4 L_sample)
    assert vr.lr * prob.L_sample_max == pytest.approx(1 / 11.4, rel=1e-12)
    y = torch.zeros(prob.d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    sg = DIANA([y], n_workers=prob.n, compressor="randk", k=8, lr=vr.lr, seed=0)
    d0 = float(((x - prob.x_star) ** 2).sum())
    dist = {}
    for it in range(1, 1001):
        vr.step()
        sg.step(lambda: prob.sample_grads(y, prob.sample_indices(1, gen)))
        if it in (500, 1000):
            dist[it] = (float(((x - prob.x_star) ** 2).sum()), float(((y - prob.x_star) ** 2).sum()))
    assert dist[1000][0] < 1e-4 * d0 and dist[1000][0] < dist[500][0] / 100        # linear, to x*
    assert dist[1000][1] > 1e-2 * d0 and dist[1000][1] > dist[500][1] / 10         # the SGD floor
    # oracle count: 2 samples per step, plus a full local pass (mean N_i = 20) per refresh
    refreshes = (vr.grad_evals - 2 * 1000) / 20
    assert refreshes == int(refreshes) and 1 <= refreshes <= 1 + 1000 * p + 5 * math.sqrt(1000 * p)
