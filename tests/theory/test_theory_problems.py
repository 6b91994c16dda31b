"""theory.problems: the constants, x*, and the oracles, each checked against an independent computation.

Independent means: per-worker losses written out directly (numpy / a plain torch loop), differentiated by
autograd; Hessian eigenvalues from ``numpy.linalg.eigvalsh``; x* re-derived by scipy's L-BFGS.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from theory import problems as P


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _direct_local_loss(prob: P.FiniteSumProblem, i: int, x: torch.Tensor) -> torch.Tensor:
    """f_i(x) written out from the raw blocks, without the padded/vectorised code."""
    A, b = prob.A_blocks[i], prob.b_blocks[i]
    z = A @ x
    if prob.loss_name == "logistic":
        data = torch.log1p(torch.exp(-b * z)).mean()
    else:
        data = 0.5 * ((z - b) ** 2).mean()
    return data + 0.5 * prob.lam * (x @ x) + prob.nc_lam * (x ** 2 / (1 + x ** 2)).sum()


CASES = [
    dict(kind="logistic", dataset="breast_cancer", n_workers=7, split="label", lam=1e-2),
    dict(kind="logistic", dataset="wine", n_workers=5, split="iid", lam=1e-3, nc_lam=0.1),
    dict(kind="least_squares", dataset="diabetes", n_workers=6, split="label", lam=1e-3),
]


def _build(case):
    case = dict(case)
    kind = case.pop("kind")
    return (P.logistic if kind == "logistic" else P.least_squares)(**case)


@pytest.fixture(scope="module", params=range(len(CASES)), ids=[f"{c['kind']}-{c['dataset']}" for c in CASES])
def prob(request):
    return _build(CASES[request.param])


def test_gradients_match_autograd(prob):
    rng = torch.Generator().manual_seed(0)
    X = torch.randn(prob.n, prob.d, generator=rng, dtype=torch.float64)
    G = prob.grads(X)                                   # per-worker points
    for i in range(prob.n):
        x = X[i].clone().requires_grad_(True)
        f = _direct_local_loss(prob, i, x)
        (g,) = torch.autograd.grad(f, x)
        torch.testing.assert_close(G[i], g, rtol=1e-12, atol=1e-13)
        assert float(prob.local_losses(X)[i]) == pytest.approx(float(f.detach()), rel=1e-13)


def test_smoothness_constants_against_hessian_eigenvalues(prob):
    """L_i is the largest Hessian eigenvalue of f_i at 0 (tight), and bounds it at random points."""
    zero = torch.zeros(prob.d, dtype=torch.float64)
    for i in range(prob.n):
        H = torch.autograd.functional.hessian(lambda v: _direct_local_loss(prob, i, v), zero).numpy()
        assert np.linalg.eigvalsh(H)[-1] == pytest.approx(float(prob.L_i[i]), rel=1e-10)
    rng = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(prob.d, generator=rng, dtype=torch.float64)
        Hs = prob.hessians(x).numpy()
        for i in range(prob.n):
            assert np.linalg.eigvalsh(Hs[i])[-1] <= float(prob.L_i[i]) * (1 + 1e-12)
    assert prob.L_max == pytest.approx(float(max(prob.L_i)))
    assert prob.L_tilde == pytest.approx(float(np.sqrt(np.mean(prob.L_i.numpy() ** 2))), rel=1e-14)
    assert prob.L <= prob.L_max * (1 + 1e-12) and prob.L <= prob.L_tilde * (1 + 1e-12)
    Hf = np.mean([torch.autograd.functional.hessian(lambda v: _direct_local_loss(prob, i, v), zero).numpy()
                  for i in range(prob.n)], axis=0)
    assert np.linalg.eigvalsh(Hf)[-1] == pytest.approx(prob.L, rel=1e-10)


def test_strong_convexity_and_x_star(prob):
    if not prob.convex:
        assert prob.mu is None and prob.x_star is None
        return
    assert prob.mu > 0
    rng = torch.Generator().manual_seed(2)
    for _ in range(3):  # mu lower-bounds the curvature everywhere
        x = 3 * torch.randn(prob.d, generator=rng, dtype=torch.float64)
        assert np.linalg.eigvalsh(prob.hessian(x).numpy())[0] >= prob.mu * (1 - 1e-9)
    assert float(prob.grad(prob.x_star).norm()) < 1e-10
    from scipy.optimize import minimize

    def fun(v):
        x = torch.from_numpy(v).requires_grad_(True)
        f = sum(_direct_local_loss(prob, i, x) for i in range(prob.n)) / prob.n
        (g,) = torch.autograd.grad(f, x)
        return float(f.detach()), g.numpy()

    res = minimize(fun, np.zeros(prob.d), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000})
    # strong convexity: ||x - x*|| <= ||grad f(x)|| / mu
    bound = np.linalg.norm(fun(res.x)[1]) / prob.mu
    assert np.linalg.norm(res.x - prob.x_star.numpy()) <= bound + 1e-9
    assert prob.f_star <= float(res.fun) + 1e-12
    assert prob.sigma_star_sq == pytest.approx(float((prob.grads(prob.x_star) ** 2).sum(1).mean()))


def test_sample_gradients_are_unbiased_exactly(prob):
    """The mean over each worker's own rows of the per-sample gradients is grad f_i (by enumeration)."""
    x = torch.linspace(-1, 1, prob.d, dtype=torch.float64)
    acc = torch.zeros(prob.n, prob.d, dtype=torch.float64)
    M = int(prob.counts.max())
    for j in range(M):
        idx = torch.minimum(torch.full((prob.n, 1), j), (prob.counts - 1).unsqueeze(1))
        gj = prob.sample_grads(x, idx)
        valid = (j < prob.counts).double().unsqueeze(1)
        acc += valid * gj / prob.counts.double().unsqueeze(1)
    torch.testing.assert_close(acc, prob.grads(x), rtol=1e-12, atol=1e-13)
    idx = prob.sample_indices(64, torch.Generator().manual_seed(3))
    assert idx.shape == (prob.n, 64) and bool((idx >= 0).all()) and bool((idx < prob.counts[:, None]).all())
    # per-sample smoothness bounds every row's curvature
    c = 0.25 if prob.loss_name == "logistic" else 1.0
    row_max = max(float((a ** 2).sum(1).max()) for a in prob.A_blocks)
    assert prob.L_sample_max == pytest.approx(c * row_max + prob.lam + 2 * prob.nc_lam)


def test_splits_and_standardisation():
    X, y = P.load_dataset("digits")
    assert X.shape == (1797, 61)                      # 3 constant pixels dropped
    np.testing.assert_allclose(X.mean(0), 0, atol=1e-12)
    np.testing.assert_allclose(X.std(0), 1, atol=1e-12)
    assert set(np.unique(y)) == {-1.0, 1.0}
    parts = P.split_rows(y, 7, "label")
    assert [len(p) for p in parts] == [256] * 6 + [1797 - 6 * 256]
    labels = np.concatenate([y[p] for p in parts])
    assert np.all(np.diff(labels) >= 0)               # sorted by label: heterogeneous
    assert sorted(np.concatenate(parts).tolist()) == list(range(1797))
    iid = P.split_rows(y, 7, "iid", seed=0)
    assert sorted(np.concatenate(iid).tolist()) == list(range(1797))
    with pytest.raises(ValueError, match="valid"):
        P.split_rows(y, 7, "sorted")
    with pytest.raises(ValueError, match="valid names"):
        P.load_dataset("mnist")


def test_synthetic_condition_numbers():
    ls = P.synthetic_least_squares(n_workers=4, rows_per_worker=30, d=20, kappa=25.0)
    assert ls.kappa == pytest.approx(25.0, rel=1e-9)
    assert float(ls.grads_star.abs().max()) < 1e-10           # interpolation: every local gradient vanishes
    noisy = P.synthetic_least_squares(n_workers=4, rows_per_worker=30, d=20, kappa=25.0, interpolate=False)
    assert noisy.sigma_star_sq > 1e-3
    lg = P.synthetic_logistic(n_workers=5, rows_per_worker=20, d=30, kappa=200.0)
    assert lg.kappa == pytest.approx(200.0, rel=1e-9)
    assert lg.mu == pytest.approx(lg.lam)
    via_kappa = P.logistic("wine", n_workers=3, kappa=50.0)
    assert via_kappa.kappa == pytest.approx(50.0, rel=1e-9)
