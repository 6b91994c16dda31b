"""Unbiasedness and variance of the random operators, against their declared omega (float64).

Samples. N independent compressions C_1..C_N of a fixed x (for operators that act per bucket or per
coordinate, one call on R copies of x with ``bucket_size = d`` gives R independent samples; others
are called N times with one generator). Z_j = ||C_j - x||^2/||x||^2.

Variance. mean(Z) estimates V = E||C(x) - x||^2/||x||^2 with standard error sd(Z)/sqrt(N); by the
CLT we assert mean(Z) <= omega + 5 se (one-sided false alarm ~3e-7), and, against the *exact*
expectation V computed in closed form for this x (a per-coordinate formula for each operator, below),
|mean(Z) - V| <= 5 se. Where omega is attained (rand-k any x, TernGrad at (1,t,...,t), natural at
4/3) V = omega, so the estimate is checked to be close to omega itself.

Unbiasedness. With M = mean_j C_j, E||M - x||^2 = V||x||^2/N when E C = x. Under the CLT,
N||M - x||^2/(V||x||^2) is a Gaussian quadratic form with weights summing to 1, whose tail above
t >= 1.54 is at most that of chi-square(1) (Szekely & Bakirov 2003), so it exceeds 30 with
probability <= 4e-8. A bias b adds N||b||^2/(V||x||^2): the negative controls below show it fires.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparsecomm as sc
from sparsecomm.compressors._common import force_backend

# every test runs on both kernel paths (Numba, and the torch ops CUDA users run) unless it picks the
# path itself with a `backend` parameter (tests/conftest.py, sparsecomm.kernels)
pytestmark = pytest.mark.usefixtures("kernel_path")

D = 100
Z_SE = 5.0
UNBIASED_T = 30.0


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def inputs(d=D):
    g = gen(100)
    t = 1.0 / (math.sqrt(d) + 1.0)
    sparse = torch.zeros(d, dtype=torch.float64)
    sparse[::10] = torch.randn(d // 10, generator=g, dtype=torch.float64)
    alt = torch.ones(d, dtype=torch.float64)
    alt[1::2] = -1
    return {
        "ones": torch.ones(d, dtype=torch.float64),
        "spike": torch.eye(d, dtype=torch.float64)[3] * -2.5,
        "gauss": torch.randn(d, generator=g, dtype=torch.float64),
        "terngrad_worst": torch.cat([torch.ones(1), torch.full((d - 1,), t)]).double(),
        "four_thirds": torch.full((d,), 4.0 / 3.0, dtype=torch.float64),
        "heavy": torch.randn(d, generator=g, dtype=torch.float64) / torch.rand(d, generator=g, dtype=torch.float64),
        "sparse": sparse,
        "alternating": alt * 0.7,
        "tiny": torch.randn(d, generator=g, dtype=torch.float64) * 1e-30,
        "huge": torch.randn(d, generator=g, dtype=torch.float64) * 1e30,
    }


# ---------------------------------------------------------------------------- exact expectations
def _frac_var(r):
    """Variance of unbiased rounding of r >= 0 to the integers around it: f(1-f), f = frac(r)."""
    f = r - torch.floor(r)
    return f * (1 - f)


def _pow2_var(t):
    """Variance of unbiased rounding of t > 0 to the powers of two around it (0 at powers of two)."""
    lo = torch.exp2(torch.floor(torch.log2(t)))
    lo = torch.where(lo * 2 <= t, lo * 2, lo)  # guard log2 rounding
    lo = torch.where(lo > t, lo / 2, lo)
    return (2 * lo - t) * (t - lo)


def exact_variance(name, kw, x):
    """E||C(x) - x||^2 in closed form for one bucket (the whole of x)."""
    a = x.abs()
    if name == "randk":
        k = kw["k"]
        return (x.numel() / k - 1) * float(x @ x)
    if name == "natural":
        nz = a[a > 0]
        return float(_pow2_var(nz).sum())
    if name == "qsgd":
        s, nrm = kw["levels"], float(x.norm())
        return (nrm / s) ** 2 * float(_frac_var(a * s / nrm).sum())
    if name == "terngrad":
        return float((a.max() * a - a * a).sum())
    if name == "natural_dithering":
        s = kw["levels"]
        nrm = float(x.norm()) if kw.get("p", 2) == 2 else float(a.max())
        unit = nrm * 2.0 ** (1 - s)
        t = a / unit
        small = t < 1
        v = torch.where(small, t * (1 - t), torch.zeros_like(t))
        v[~small] = _pow2_var(t[~small])
        return unit**2 * float(v.sum())
    if name == "compose":  # rand-k then natural on the k scaled values
        k, d = kw["k"], x.numel()
        nz = a[a > 0] * (d / k)
        return (k / d) * float(_pow2_var(nz).sum()) + (d / k - 1) * float(x @ x)
    if name == "induced":  # top-k then rand-k of the rest
        k, d = kw["k"], x.numel()
        rest = x.clone()
        rest[torch.topk(a, k).indices] = 0
        return (d / k - 1) * float(rest @ rest)
    raise KeyError(name)


# ---------------------------------------------------------------------------------- sampling
BUCKETED = ("qsgd", "terngrad", "natural_dithering", "natural")


def samples(name, kw, x, n, seed, batched):
    """(n, d) float64 matrix of independent decompressed compressions of x."""
    d = x.numel()
    g = gen(seed)
    if batched:
        c = sc.compressors.get(name, **({**kw, "bucket_size": d} if name != "natural" else kw))
        return c.decompress(c.compress(x.repeat(n), g)).view(n, d)
    c = sc.compressors.get(name, **kw)
    return torch.stack([c.decompress(c.compress(x, g)) for _ in range(n)])


def check(name, kw, x, n, seed, batched, tight=False):
    c = sc.compressors.get(name, **kw)
    omega = c.omega(x.numel())
    ys = samples(name, kw, x, n, seed, batched)
    nx = float(x @ x)
    z = ((ys - x) ** 2).sum(dim=1) / nx
    zbar, se = float(z.mean()), float(z.std()) / math.sqrt(n)
    v = exact_variance(name, kw, x) / nx
    # variance: never above omega beyond its statistical tolerance, and equal to the exact expectation
    assert v <= omega * (1 + 1e-12), f"exact variance {v} exceeds omega {omega}"
    assert zbar <= omega + Z_SE * se + 1e-12 * omega, f"estimate {zbar} > omega {omega} (se {se})"
    assert abs(zbar - v) <= Z_SE * se + 1e-9 * v, f"estimate {zbar} vs exact {v} (se {se})"
    if tight:
        assert abs(v - omega) <= 1e-9 * omega, f"expected the bound to be attained: {v} vs {omega}"
    # unbiasedness
    if v > 0:
        m = ys.mean(dim=0)
        t_stat = n * float(((m - x) ** 2).sum()) / (v * nx)
        assert t_stat <= UNBIASED_T, f"mean of {n} compressions is off x: statistic {t_stat:.1f}"
    else:
        assert torch.equal(ys[0], x)
    return zbar, v, omega


QUANTISERS = [
    ("natural", {}),
    ("qsgd", {"levels": 4}),
    ("qsgd", {"levels": 1}),
    ("terngrad", {}),
    ("natural_dithering", {"levels": 4}),
    ("natural_dithering", {"levels": 2, "p": math.inf}),
    ("natural_dithering", {"levels": 6}),
]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("case", QUANTISERS, ids=lambda c: c[0] + "".join(f"-{k}={v}" for k, v in c[1].items()))
def test_quantisers_unbiased_within_omega_on_adversarial_inputs(case, backend):
    name, kw = case
    xs = inputs()
    if backend == "torch":  # the reference path: fewer inputs, to keep the suite quick
        xs = {k: xs[k] for k in ("gauss", "terngrad_worst", "four_thirds", "heavy")}
    with force_backend(backend):
        for i, (label, x) in enumerate(xs.items()):
            tight = (name == "terngrad" and label == "terngrad_worst") or (name == "natural" and label == "four_thirds")
            check(name, kw, x, 10_000, seed=i, batched=True, tight=tight)


@pytest.mark.parametrize("case", QUANTISERS, ids=lambda c: c[0] + "".join(f"-{k}={v}" for k, v in c[1].items()))
def test_quantisers_unbucketed_path_separate_calls(case):
    """The bucket_size=None path through separate calls (fewer samples)."""
    name, kw = case
    xs = inputs()
    for i, label in enumerate(("gauss", "heavy")):
        check(name, kw, xs[label], 1000, seed=50 + i, batched=False)


def test_tight_values_match_the_reference_table():
    """Reference values (d = 100, k = 10, s = 4): TernGrad 4.497 vs 4.5, C_nat 0.1252 vs 0.125."""
    xs = inputs()
    zbar, v, omega = check("terngrad", {}, xs["terngrad_worst"], 40_000, seed=7, batched=True, tight=True)
    assert omega == 4.5 and abs(zbar - 4.5) < 0.05
    zbar, v, omega = check("natural", {}, xs["four_thirds"], 40_000, seed=8, batched=True, tight=True)
    assert omega == 0.125 and abs(zbar - 0.125) < 0.002


@pytest.mark.parametrize("k", [1, 10, 100])
def test_randk_variance_equals_omega_for_every_x(k):
    xs = inputs()
    for i, label in enumerate(("gauss", "spike", "heavy")):
        zbar, v, omega = check("randk", {"k": k}, xs[label], 1500, seed=i, batched=False, tight=True)
    # at x = 1 every sample has exactly the error d/k - 1
    c = sc.compressors.get("randk", k=k)
    x = torch.ones(D, dtype=torch.float64)
    y = c.decompress(c.compress(x, gen(3)))
    assert float(((y - x) ** 2).sum()) / D == pytest.approx(D / k - 1, rel=1e-12)


def test_compose_randk_natural():
    """Reference values: C_nat o rand-k estimate 10.22 vs bound 10.25 at d = 100, k = 10."""
    xs = inputs()
    xs["attains"] = torch.full((D,), 4.0 / 30.0, dtype=torch.float64)  # (d/k) x = 4/3: bound attained
    for i, label in enumerate(("gauss", "attains", "spike")):
        tight = label == "attains"
        zbar, v, omega = check("compose", {"first": "randk", "second": "natural", "k": 10}, xs[label], 2000,
                               seed=i, batched=False, tight=tight)
        assert omega == pytest.approx(10.25)


def test_induced_topk_randk():
    """Unbiased, omega = 9 (1 - 0.1) = 8.1; the exact variance 9 ||x - topk(x)||^2 is below it."""
    xs = inputs()
    for i, label in enumerate(("gauss", "ones", "heavy")):
        zbar, v, omega = check("induced", {"first": "topk", "second": "randk", "k": 10}, xs[label], 2000,
                               seed=i, batched=False, tight=(label == "ones"))
        assert omega == pytest.approx(8.1)


# ------------------------------------------------------------------------ negative controls
def test_unbiasedness_check_detects_a_bias():
    """The statistic fires on operators that are biased by construction: unscaled rand-k (bias
    -(1 - k/d) x) and natural compression whose decode is off by 2 %."""
    x = inputs()["gauss"]
    n = 3000
    c = sc.compressors.get("randk", k=10)
    g = gen(1)
    ys = torch.stack([c.decompress(c.compress(x, g)) for _ in range(n)]) * (10 / D)
    v = exact_variance("randk", {"k": 10}, x) * (10 / D) ** 2
    t_stat = n * float(((ys.mean(0) - x) ** 2).sum()) / v
    assert t_stat > 100 * UNBIASED_T
    ys = samples("natural", {}, x, 20_000, 2, True) * 1.02
    v = exact_variance("natural", {}, x)
    assert 20_000 * float(((ys.mean(0) - x) ** 2).sum()) / v > 2 * UNBIASED_T


def test_variance_check_detects_an_excess():
    """A 10 % excess of the error over omega is beyond the tolerance at this sample size."""
    x = inputs()["terngrad_worst"]
    ys = samples("terngrad", {}, x, 20_000, 3, True)
    z = ((ys - x) ** 2).sum(1) / float(x @ x)
    se = float(z.std()) / math.sqrt(z.numel())
    assert 1.1 * float(z.mean()) > 4.5 + Z_SE * se
