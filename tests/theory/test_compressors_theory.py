"""The closed forms of theory/compressors.py, checked by derivation-independent computations
(enumeration, grid search, exact expectations), including the lines marked "(unverified)" in the
reference notes that the operators rely on."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from theory import compressors as th


def test_randk_omega_by_enumerating_all_subsets():
    """E||C(x) - x||^2 over all C(d, k) subsets equals (d/k - 1)||x||^2 for any x."""
    x = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float64)
    d = x.numel()
    for k in range(1, d + 1):
        errs = []
        for s in itertools.combinations(range(d), k):
            y = torch.zeros(d, dtype=torch.float64)
            y[list(s)] = x[list(s)] * d / k
            errs.append(float(((y - x) ** 2).sum()))
        assert sum(errs) / len(errs) == pytest.approx(th.randk_omega(d, k) * float(x @ x), rel=1e-12)


def test_natural_omega_is_the_max_of_the_binade_variance_at_four_thirds():
    t = torch.linspace(1, 2, 200_001, dtype=torch.float64)
    f = (t - 1) * (2 - t) / t**2
    assert float(f.max()) == pytest.approx(th.natural_omega(), abs=1e-10)
    assert float(t[f.argmax()]) == pytest.approx(4 / 3, abs=1e-4)


@pytest.mark.parametrize("d", [2, 4, 10, 100, 1000])
def test_terngrad_omega_is_the_worst_case_and_attained(d):
    """max_x ||x||_inf ||x||_1/||x||^2 - 1: over x = (1, t, ..., t) by grid, and over random x."""
    t = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    ratio = (1 + (d - 1) * t) / (1 + (d - 1) * t**2) - 1
    assert float(ratio.max()) == pytest.approx(th.terngrad_omega(d), rel=1e-8)
    assert float(t[ratio.argmax()]) == pytest.approx(1 / (math.sqrt(d) + 1), abs=1e-4)
    g = torch.Generator().manual_seed(d)
    x = torch.rand(2000, d, generator=g, dtype=torch.float64) ** 3
    r = x.amax(1) * x.sum(1) / (x * x).sum(1) - 1
    assert float(r.max()) <= th.terngrad_omega(d) + 1e-12


def _qsgd_rel_var(x, s):
    n = x.norm()
    r = x.abs() * s / n
    f = r - torch.floor(r)
    return float((n / s) ** 2 * (f * (1 - f)).sum() / (x @ x))


@pytest.mark.parametrize("d,s", [(1, 1), (10, 1), (100, 4), (100, 1), (1000, 16), (50, 100)])
def test_qsgd_omega_bounds_the_exact_variance(d, s):
    g = torch.Generator().manual_seed(d * s)
    worst = 0.0
    cands = [torch.ones(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)[0]]
    cands += list(torch.randn(300, d, generator=g, dtype=torch.float64))
    cands += list(torch.rand(300, d, generator=g, dtype=torch.float64) ** 4)
    for x in cands:
        worst = max(worst, _qsgd_rel_var(x, s))
    assert worst <= th.qsgd_omega(d, s) + 1e-12
    assert th.qsgd_omega(d, s) == min(d / s**2, math.sqrt(d) / s)
    if s == 1 and d > 1:  # Quant_2: exact worst case sqrt(d) - 1 at x = 1, below the QSGD bound
        assert _qsgd_rel_var(torch.ones(d, dtype=torch.float64), 1) == pytest.approx(math.sqrt(d) - 1)


def _natdither_rel_var(x, s, p):
    n = x.norm() if p == 2 else x.abs().max()
    unit = n * 2.0 ** (1 - s)
    t = x.abs() / unit
    lo = torch.exp2(torch.floor(torch.log2(t.clamp(min=1e-300))))
    v = torch.where(t < 1, t * (1 - t), (2 * lo - t) * (t - lo))
    return float(unit**2 * v.sum() / (x @ x))


@pytest.mark.parametrize("p", [2, math.inf])
@pytest.mark.parametrize("d,s", [(10, 1), (100, 2), (100, 4), (1000, 3), (64, 8)])
def test_natural_dithering_omega_bounds_the_exact_variance(d, s, p):
    g = torch.Generator().manual_seed(d + s)
    cands = [torch.ones(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)[0],
             torch.full((d,), 4 / 3, dtype=torch.float64)]
    cands += list(torch.randn(300, d, generator=g, dtype=torch.float64))
    cands += list(torch.rand(300, d, generator=g, dtype=torch.float64) ** 6)
    worst = max(_natdither_rel_var(x, s, p) for x in cands)
    assert worst <= th.natural_dithering_omega(d, s, p) + 1e-12


def test_reference_values():
    d, k, s = 100, 10, 4
    assert th.randk_omega(d, k) == 9
    assert th.qsgd_omega(d, s) == 2.5
    assert th.terngrad_omega(d) == 4.5
    assert th.natural_omega() == 0.125
    assert th.compose_omega(th.randk_omega(d, k), th.natural_omega()) == pytest.approx(10.25)
    assert th.compose_omega(th.natural_omega(), 9) == pytest.approx(9 / 8 * 9 + 1 / 8)  # C_nat o C
    assert th.induced_omega(9, th.topk_delta(d, k)) == pytest.approx(8.1)
    assert th.topk_delta(d, k) == 0.1
    assert th.sign_delta(d) == 0.01
    assert th.scaled_delta(9) == 0.1


def test_sign_error_ratio_matches_direct_computation():
    g = torch.Generator().manual_seed(3)
    for d in (1, 5, 100):
        x = torch.randn(d, generator=g, dtype=torch.float64)
        y = x.abs().sum() / d * torch.where(x < 0, -1.0, 1.0).double()
        direct = float(((y - x) ** 2).sum() / (x @ x))
        assert th.sign_error_ratio(float(x.abs().sum()), float(x @ x), d) == pytest.approx(direct, rel=1e-12)
        assert direct <= 1 - th.sign_delta(d) + 1e-12


def test_bits_functions():
    assert th.qsgd_code_bits(1) == 2      # sign + {0, 1}
    assert th.qsgd_code_bits(3) == 3      # sign + {0..3}
    assert th.qsgd_code_bits(4) == 4      # sign + {0..4}: 3 bits, not ceil(log2 4) = 2
    assert th.natural_bits(10) == 90
    assert th.index_bits(1000, 10) == 320 and th.index_bits(1000, 100) == 1000
    assert th.index_bits(2**33, 1) == 64
    assert th.topk_bits(10**6, 100) == 32 * 100 + 32 * 100
    assert th.randk_bits(10**6, 100) == 3200
    assert th.qsgd_bits(1000, 4, 512) == 4 * 1000 + 32 * 2
    assert th.terngrad_bits(1000) == 2000 + 32
    assert th.sign_bits(1000) == 1032 and th.sign_bits(0) == 0
    assert th.n_buckets(0, 7) == 0 and th.n_buckets(7, None) == 1 and th.n_buckets(15, 7) == 3


def test_rounding_delta_and_threshold_bound():
    assert th.rounding_delta(11) == 1 - (2.0**-11 + 2.0**-23) ** 2
    assert th.threshold_abs_error(100, 0.5) == 25.0


def test_domain_errors():
    with pytest.raises(ValueError):
        th.randk_omega(10, 0)
    with pytest.raises(ValueError):
        th.qsgd_omega(10, 0)
    with pytest.raises(ValueError):
        th.natural_dithering_omega(10, 2, p=1)
    assert th.randk_omega(0, 0) == 0.0 and th.topk_delta(0, 0) == 1.0
