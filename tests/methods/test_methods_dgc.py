"""DGC (sparsecomm.methods.dgc): momentum correction and factor masking against a float64 reference,
the sampled threshold (a top set of at most k entries, its expected size from the order-statistics
law), the sparsity warm-up, local clipping, and training through allgather/omnireduce."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from tests._keyed import Worker
from theory import compressors as th


def _init(model):
    """Deterministic parameters from an explicit generator (never the global RNG: sim workers are threads)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def test_momentum_correction_and_factor_masking_float64():
    m = Worker(sc.methods.get("dgc", ratio=0.05, momentum=0.9, sample_ratio=1.0))
    g = torch.Generator().manual_seed(0)
    d = 400
    u = torch.zeros(d, dtype=torch.float64)
    v = torch.zeros(d, dtype=torch.float64)
    for _ in range(6):
        x = torch.randn(d, generator=g, dtype=torch.float64)
        u = 0.9 * u + x
        v = v + u
        p = m.encode(x, 0, g)
        # sample_ratio 1: the threshold is exact, the k = 20 largest |v| are sent
        assert torch.equal(p.indices, torch.topk(v.abs(), 20).indices.sort().values)
        torch.testing.assert_close(p.values, v[p.indices], rtol=0, atol=0)
        v[p.indices] = 0.0
        u[p.indices] = 0.0
        st = m.state(0)
        torch.testing.assert_close(st.velocity, v, rtol=0, atol=1e-12)
        torch.testing.assert_close(st.momentum, u, rtol=0, atol=1e-12)
        torch.testing.assert_close(m.decode(p.to_dense() * 3, 3, 0), p.to_dense(), rtol=0, atol=1e-12)


def test_sampled_threshold_sends_a_top_set_of_expected_size():
    """The threshold is the ceil(keep s)-th largest of s uniform draws, so the population fraction F
    above it follows Beta(j, s - j + 1) (uniform order statistics, j = ceil(keep s)); the sent count
    is min(F d, k). Its mean over T trials is compared with the Beta law's, within 4 standard errors."""
    d, keep, T = 20_000, 0.01, 60
    k = round(keep * d)
    s = th.dgc_sample_size(d, keep, 0.01)
    j = math.ceil(keep * s)
    rng = np.random.default_rng(0)
    law = np.minimum(rng.beta(j, s - j + 1, 200_000) * d, k) / k
    g = torch.Generator().manual_seed(1)
    counts = []
    for t in range(T):
        m = Worker(sc.methods.get("dgc", ratio=keep, momentum=0.0))
        x = torch.randn(d, generator=g)
        p = m.encode(x, t, g)
        sent = p.indices
        assert sent.numel() <= k
        rest = torch.ones(d, dtype=torch.bool)
        rest[sent] = False
        assert x[sent].abs().min() >= x[rest].abs().max()          # a top set
        counts.append(sent.numel() / k)
    se = law.std() / math.sqrt(T)
    assert abs(np.mean(counts) - law.mean()) <= 4 * se + 1.0 / k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampled_threshold_is_the_same_on_both_kernel_paths(dtype):
    """The Numba path (gathered sample, one collecting pass, no |x| temporary) sends the torch path's
    indices and values, draws the same sample (the generator ends in the same state), and decompresses
    to the same bits; a NaN in the sample gives a NaN threshold and an empty message on both."""
    from sparsecomm.compressors.sampled_topk import SampledTopK

    x = torch.randn(300_001, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    for keep in (0.001, 0.01, 0.3):
        for y in (x, torch.where(torch.arange(x.numel()) % 7 == 0, torch.nan, x)):
            out = {}
            for path in ("numba", "torch"):
                g = torch.Generator().manual_seed(8)
                with sc.kernels.force(path):
                    c = SampledTopK(keep, 0.01)
                    p = c.compress(y, g)
                    out[path] = (p.indices, p.values, c.decompress(p), g.get_state())
            (i1, v1, d1, g1), (i2, v2, d2, g2) = out["numba"], out["torch"]
            assert torch.equal(i1, i2) and torch.equal(g1, g2)
            assert torch.equal(v1, v2) and torch.equal(d1, d2) and v1.dtype == d1.dtype == dtype
            assert (i1.numel() == 0) == (y is not x)


def test_sparsity_warmup_schedule():
    assert [1 - th.dgc_keep(t, 0.001, 8) for t in range(9)] == pytest.approx(
        [0.75, 0.75, 0.9375, 0.9375, 0.984375, 0.984375, 0.99609375, 0.99609375, 0.999])
    m = Worker(sc.methods.get("dgc", ratio=0.001, warmup_steps=4, sample_ratio=1.0))
    g = torch.Generator().manual_seed(2)
    sizes = [m.encode(torch.randn(4096, generator=g), 0, g).indices.numel() for _ in range(6)]
    assert sizes == [1024, 256, 64, 16, 4, 4]


def test_local_clipping_uses_the_world_size():
    m = sc.methods.get("dgc", ratio=1.0, momentum=0.0, clip_norm=2.0, sample_ratio=1.0)
    x = torch.full((100,), 1.0)                  # ||x|| = 10 > 2/sqrt(4) = 1
    p, _ = m.encode(x, m.init(100), world_size=4)
    assert float(p.to_dense().norm()) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError):
        sc.methods.get("dgc", momentum=1.0)


def test_exact_round_is_dense_momentum_sgd():
    m = Worker(sc.methods.get("dgc", momentum=0.5))
    a, b = torch.ones(10), 2 * torch.ones(10)
    assert torch.equal(m.encode(a, 0, exact=True).to_dense(), a)
    m.decode(a, 1, 0)
    assert torch.equal(m.encode(b, 0, exact=True).to_dense(), b + 0.5 * a)    # momentum kept
    assert not m.state(0).velocity.any()


def _train(ctx, transport):
    model = _init(torch.nn.Linear(40, 1))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02), compressor="dgc",
                                  transport=transport, ratio=0.1, warmup_steps=4)
    g = torch.Generator().manual_seed(ctx.rank)
    w = torch.randn(40, 1, generator=torch.Generator().manual_seed(9))
    losses = []
    for _ in range(60):
        opt.zero_grad()
        x = torch.randn(32, 40, generator=g)
        loss = ((model(x) - x @ w) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("transport", ["allgather", "omnireduce"])
def test_training_through_sparse_transports(transport):
    res = sc.launch(functools.partial(_train, transport=transport), world_size=2, backend="sim")
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)
    losses = res[0][1]
    assert np.mean(losses[-5:]) < 0.1 * np.mean(losses[:5])
