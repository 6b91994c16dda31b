"""Deterministic operators: top-k selects exactly (ties -> lower index), contractions hold exactly.

Top-k / threshold / sign / fp16 / bf16 have no randomness, so their delta is checked on each input
exactly (float64 arithmetic, relative slack 1e-12 for summation rounding).
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.compressors.identity import UnderflowError
from sparsecomm.compressors._common import force_backend
from theory import compressors as th

#: the module (``sc.compressors.topk`` is the typed factory)
topk_mod = importlib.import_module("sparsecomm.compressors.topk")

# every test runs on both kernel paths (Numba, and the torch ops CUDA users run) unless it picks the
# path itself with a `backend` parameter (tests/conftest.py, sparsecomm.kernels)
pytestmark = pytest.mark.usefixtures("kernel_path")

BACKENDS = ("numba", "torch")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The documented rule: order by (-|x|, index), take the first k, return them sorted."""
    a = x.abs().to(torch.float64).numpy()
    order = np.lexsort((np.arange(a.size), -a))
    return torch.from_numpy(np.sort(order[:k]).astype(np.int64))


def err2(c, x):
    y = c.decompress(c.compress(x, gen())).to(torch.float64)
    return float(((y - x.to(torch.float64)) ** 2).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,k", [(1000, 1), (1000, 10), (1000, 999), (300_000, 1), (300_000, 3000),
                                 (300_000, 150_000)])
def test_topk_equals_torch_topk_on_tie_free_inputs(d, k, backend):
    x = torch.randn(d, generator=gen(d + k), dtype=torch.float64)
    assert torch.unique(x.abs()).numel() == d  # tie-free
    with force_backend(backend):
        p = sc.compressors.get("topk", k=k).compress(x)
    ref = torch.sort(torch.topk(x.abs(), k).indices).values
    assert torch.equal(p.indices, ref)
    assert torch.equal(p.values, x[ref])


ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TIE_CASES = ([(1000, dt, b) for dt in ALL_DTYPES for b in BACKENDS]
             + [(300_000, dt, "numba") for dt in (torch.float16, torch.float32)])  # the sampling path


@pytest.mark.parametrize("d,dtype,backend", TIE_CASES)
def test_topk_ties_break_towards_lower_index(d, dtype, backend):
    g = gen(d)
    inputs = {
        "small_ints": torch.randint(-4, 5, (d,), generator=g).to(dtype),
        "zeros": torch.zeros(d, dtype=dtype),
        "ones": torch.ones(d, dtype=dtype),
        "mostly_zero": torch.where(torch.rand(d, generator=g) < 0.003, torch.randn(d, generator=g),
                                   torch.zeros(d)).to(dtype),
        "gauss": torch.randn(d, generator=g).to(dtype),
    }
    for label, x in inputs.items():
        for k in (1, d // 100, d // 2, d - 1):
            with force_backend(backend):
                p = sc.compressors.get("topk", k=k).compress(x)
            assert torch.equal(p.indices, reference_topk(x, k)), (label, k)


@pytest.mark.kernel_paths("numba")              # the Numba path's sampling internals
def test_topk_sample_overshoot_falls_back_and_stays_exact(monkeypatch):
    """Force the sampled threshold above the k-th magnitude (negative margin): the threshold is
    lowered, then everything becomes a candidate, and the result is still exact."""
    calls = []
    real = topk_mod.collect_ge

    def spy(a, thr, buf):
        calls.append(thr)
        return real(a, thr, buf)

    monkeypatch.setattr(topk_mod, "collect_ge", spy)
    monkeypatch.setattr(topk_mod, "SAMPLE_MARGIN", -60.0)
    x = torch.randn(400_000, generator=gen(5), dtype=torch.float64)
    k = 4000
    p = sc.compressors.get("topk", k=k).compress(x)
    assert torch.equal(p.indices, reference_topk(x, k))
    assert len(calls) >= 2 and calls[-1] < calls[0], calls


@pytest.mark.kernel_paths("numba")              # the Numba path's sampling internals
def test_topk_uses_one_candidate_pass_normally(monkeypatch):
    calls = []
    real = topk_mod.collect_ge
    monkeypatch.setattr(topk_mod, "collect_ge", lambda a, thr, buf: calls.append(thr) or real(a, thr, buf))
    x = torch.randn(1_000_000, generator=gen(6))
    p = sc.compressors.get("topk", ratio=0.01).compress(x)
    assert len(calls) == 1 and calls[0] > 0
    assert torch.equal(p.indices, torch.sort(torch.topk(x.abs(), 10_000).indices).values)


def test_topk_does_not_consume_the_callers_generator():
    g = gen(9)
    state = g.get_state()
    sc.compressors.get("topk", ratio=0.01).compress(torch.randn(500_000), g)
    assert torch.equal(g.get_state(), state)


# ------------------------------------------------------------------------------ contractions
def adversarial(d=100):
    g = gen(10)
    spike = torch.zeros(d, dtype=torch.float64)
    spike[7] = 3.0
    return {
        "ones": torch.ones(d, dtype=torch.float64),
        "spike": spike,
        "gauss": torch.randn(d, generator=g, dtype=torch.float64),
        "heavy": torch.randn(d, generator=g, dtype=torch.float64) / torch.rand(d, generator=g, dtype=torch.float64),
        "ramp": torch.linspace(-1, 1, d, dtype=torch.float64),
        "two_level": torch.cat([torch.full((5,), 10.0), torch.full((d - 5,), 0.1)]).double(),
    }


@pytest.mark.parametrize("k", [1, 10, 50, 100])
def test_topk_contraction_exact_and_tight_at_ones(k):
    c = sc.compressors.get("topk", k=k)
    for label, x in adversarial().items():
        e, n = err2(c, x), float(x @ x)
        assert e <= (1 - c.delta(100)) * n * (1 + 1e-12), label
        if label == "ones":
            assert e == pytest.approx((1 - k / 100) * n, rel=1e-12)
        # the kept energy is the largest possible: the k largest squares
        assert n - e == pytest.approx(float(torch.topk(x * x, k).values.sum()), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_sign_error_identity_and_contraction(backend):
    c = sc.compressors.get("sign")
    for d in (1, 2, 100, 1001):
        for label, x in adversarial(d).items() if d >= 10 else [("gauss", torch.randn(d, dtype=torch.float64))]:
            with force_backend(backend):
                e = err2(c, x)
            n, l1 = float(x @ x), float(x.abs().sum())
            assert e == pytest.approx(n * th.sign_error_ratio(l1, n, d), rel=1e-9, abs=1e-12)
            assert e <= (1 - c.delta(d)) * n * (1 + 1e-12) + 1e-300, (d, label)
            if label == "spike":  # the worst case: delta = 1/d attained
                assert e == pytest.approx((1 - 1 / d) * n, rel=1e-12)
    # zeros inside a vector get code +1: the error identity still holds
    x = torch.tensor([0.0, 2.0, -1.0, 0.0], dtype=torch.float64)
    assert err2(c, x) == pytest.approx(5.0 - 9.0 / 4.0)


@pytest.mark.parametrize("name,p", [("fp16", 11), ("bf16", 8)])
def test_casts_are_contractive_in_the_normal_range(name, p):
    c = sc.compressors.get(name, underflow="raise")      # (the strict option; the default counts)
    lo = 2.0**-14 if name == "fp16" else 2.0**-126
    hi = 60000.0 if name == "fp16" else 1e38
    g = gen(11)
    mag = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=g))
    x64 = mag * torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0).double()
    for x, u in ((x64.float(), 2.0**-p), (x64, 2.0**-p + 2.0**-23)):
        y = c.decompress(c.compress(x)).double()
        xd = x.double()
        assert bool(((y - xd).abs() <= u * xd.abs()).all())
        assert float(((y - xd) ** 2).sum()) <= (1 - c.delta(x.numel())) * float(xd @ xd)
    # the rounding bound is attained up to a hair: delta is not loose by much
    rel = ((c.decompress(c.compress(x64.float())).double() - x64.float().double()).abs() / x64.float().double().abs())
    assert float(rel.max()) > 0.99 * 2.0**-p
    # below the normal range only |C(x) - x| <= |x| holds: the declared delta fails, so the strict
    # compressor refuses such an input, the default one counts it and underflow="allow" (delta = 0) takes it
    tiny = torch.tensor([lo / 3, -lo / 1000], dtype=torch.float64)
    with pytest.raises(UnderflowError):
        c.compress(tiny)
    assert sc.compressors.get(name).compress(tiny).meta.get("underflow") is True
    assert not sc.compressors.get(name).compress(x64.float()).meta.get("underflow")
    lax = sc.compressors.get(name, underflow="allow")
    y = lax.decompress(lax.compress(tiny)).double()
    assert bool(((y - tiny).abs() <= tiny.abs()).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_keeps_exactly_the_large_entries(backend):
    lam = 0.8
    c = sc.compressors.get("threshold", threshold=lam)
    for dtype in (torch.float16, torch.float32, torch.float64):
        x = torch.randn(5000, generator=gen(12), dtype=torch.float64).to(dtype)
        x[3] = lam  # exactly at the threshold: kept (|x| >= threshold)
        with force_backend(backend):
            p = c.compress(x)
        expect = torch.nonzero(x.double().abs() >= lam).flatten()
        assert torch.equal(p.indices, expect)
        y = c.decompress(p).double()
        assert float(((y - x.double()) ** 2).sum()) <= c.abs_error_bound(x.numel())
    # not contractive: below the threshold everywhere the whole vector is dropped
    x = torch.full((10,), 0.5)
    assert err2(c, x) == float(x @ x) and c.delta(10) == 0.0


def test_induced_with_topk_is_exact_on_the_kept_part():
    """C1 = top-k, C2 = rand-k: the top-k coordinates are transmitted exactly (x - C1 x is 0 there)."""
    c = sc.compressors.get("induced", first="topk", second="randk", ratio=0.1)
    x = torch.randn(1000, generator=gen(13), dtype=torch.float64)
    y = c.decompress(c.compress(x, gen(14)))
    top = torch.topk(x.abs(), 100).indices
    assert torch.equal(y[top], x[top])
