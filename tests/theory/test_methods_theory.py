"""The closed forms of theory/compressors.py that the methods bringing their own operator read."""

from __future__ import annotations

import math

import pytest
import torch

from theory import compressors as th


def test_majority_vote_error_closed_forms():
    for p in (0.0, 0.1, 0.3, 0.5):
        assert th.majority_vote_error(1, p) == pytest.approx(p)
        assert th.majority_vote_error(3, p) == pytest.approx(3 * p**2 * (1 - p) + p**3)
        assert th.majority_vote_error(2, p) == pytest.approx(1 - (1 - p) ** 2)     # a tie counts as wrong
    errs = [th.majority_vote_error(n, 0.3) for n in (1, 3, 5, 11, 101)]
    assert all(a > b for a, b in zip(errs, errs[1:])) and errs[-1] < 1e-3
    with pytest.raises(ValueError):
        th.majority_vote_error(0, 0.1)
    with pytest.raises(ValueError):
        th.majority_vote_error(3, 1.5)


@pytest.mark.parametrize("n,m,r", [(6, 4, 1), (5, 5, 2), (3, 8, 2)])
def test_lowrank_delta_is_tight_at_equal_singular_values(n, m, r):
    g = torch.Generator().manual_seed(n * m)
    u = torch.linalg.qr(torch.randn(n, min(n, m), generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(m, min(n, m), generator=g, dtype=torch.float64)).Q
    mat = u @ v.T                                           # every singular value is 1
    U, S, Vh = torch.linalg.svd(mat, full_matrices=False)
    best = (U[:, :r] * S[:r]) @ Vh[:r]
    err = (mat - best).square().sum()
    assert float(err) == pytest.approx((1 - th.lowrank_delta(n, m, r)) * float(mat.square().sum()), rel=1e-10)


def test_powersgd_matrix_views_and_sizes():
    assert th.powersgd_matrix(()) == (1, 1)
    assert th.powersgd_matrix((5,)) == (5, 1)
    assert th.powersgd_matrix((4, 3, 2)) == (4, 6)
    assert not th.powersgd_compresses(100, 1, 1)          # vectors never
    assert th.powersgd_compresses(4, 4, 1, 1.9) and not th.powersgd_compresses(4, 4, 1, 2.0)


def test_dgc_keep_and_sample_size():
    assert th.dgc_keep(0, 0.5, 8) == 0.5                  # never below the final ratio
    assert th.dgc_keep(100, 0.001, 8) == 0.001
    assert th.dgc_sample_size(10_000, 0.001, 0.01) == 2000     # 2/keep dominates 1%
    assert th.dgc_sample_size(1_000_000, 0.01, 0.01) == 10_000
    assert th.dgc_sample_size(50, 0.001, 0.01) == 50


def test_onebit_and_vote_bits():
    assert th.onebit_bits(1000, 100) == 1000 + 2 * 32 * 10
    assert th.onebit_bits(1000, 100, 32, 1) == 1000 + 32 * 10
    assert th.sign_vote_bits(77) == 77 and th.sign_vote_bits(0) == 0
    assert th.onebit_delta(1) == 1.0 and th.onebit_delta(64) == 1 / 64
    assert math.isclose(th.lowrank_delta(0, 3, 1), 1.0)
