"""signsgd (majority vote), signum and onebit: the vote is exact over every integer-summing transport,
its error rate is the binomial tail of theory.majority_vote_error, signum's momentum, onebit's error
feedback identity and contraction constant."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError, NonFiniteError
from sparsecomm.compressors.vote import VoteSign
from sparsecomm.pipeline import CommPipeline
from tests._keyed import Worker
from theory import compressors as th

D = 4097


def _vote_worker(ctx, method, transport):
    pipe = CommPipeline(method, transport, fabric=ctx.fabric)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    outs, grads = [], []
    for step in range(3):
        x = torch.randn(D, generator=g)
        x[:5] = 0.0                       # sign(0) := +1 on the wire
        grads.append(x.clone())
        outs.append(pipe.reduce(x, 0).clone())
    return grads, outs, pipe.stats.bytes_payload, pipe.transport.name


@pytest.mark.parametrize("transport", ["ring", "omnireduce", "switch"])
@pytest.mark.parametrize("method", ["signsgd", "signum"])
def test_majority_vote_is_exact_in_the_network(method, transport):
    n = 3
    res = sc.launch(functools.partial(_vote_worker, method=method, transport=transport), world_size=n,
                    backend="sim")
    assert res[0][3] == transport
    beta = 0.9 if method == "signum" else 0.0
    mom = [torch.zeros(D) for _ in range(n)]
    for step in range(3):
        for i in range(n):
            mom[i] = beta * mom[i] + (1 - beta) * res[i][0][step] if beta else res[i][0][step]
        signs = [torch.where(m < 0, -1.0, 1.0) for m in mom]
        want = torch.sign(sum(signs))
        for r in res:
            assert torch.equal(r[1][step], want)
        assert not (want == 0).any()       # n odd: never a tie
    assert res[0][2] == 3 * math.ceil(th.sign_vote_bits(D) / 8)


def test_vote_ties_give_zero_and_exact_round_is_the_sign_of_the_sum():
    ms = [Worker(sc.methods.get("signsgd")) for _ in range(2)]
    x = [torch.tensor([1.0, -2.0, 3.0, -0.5]), torch.tensor([-1.0, -1.0, 1.0, 3.0])]
    agg = sum(m.encode(v, 0).to_dense() for m, v in zip(ms, x))
    assert torch.equal(ms[0].decode(agg, 2, 0), torch.tensor([0.0, -1.0, 1.0, 0.0]))
    agg = sum(m.encode(v, 0, exact=True).to_dense() for m, v in zip(ms, x))
    assert torch.equal(ms[0].decode(agg, 2, 0), torch.tensor([0.0, -1.0, 1.0, 1.0]))


@pytest.mark.parametrize("n,p", [(1, 0.3), (5, 0.3), (9, 0.4), (4, 0.2)])
def test_vote_error_rate_is_the_binomial_tail(n, p):
    """Each worker's sign is wrong independently with probability p: the vote is wrong (or tied)
    with probability theory.majority_vote_error(n, p); d coordinates are d Bernoulli trials."""
    d, g = 200_000, torch.Generator().manual_seed(n)
    ms = [Worker(sc.methods.get("signsgd")) for _ in range(n)]
    truth = torch.ones(d)
    agg = sum(m.encode(torch.where(torch.rand(d, generator=g) < p, -1.0, 1.0), 0).to_dense() for m in ms)
    est = ms[0].decode(agg, n, 0)
    for m in ms[1:]:
        m.decode(agg, n, 0)
    q = th.majority_vote_error(n, p)
    wrong = float((est != truth).double().mean())
    assert abs(wrong - q) <= 4 * math.sqrt(q * (1 - q) / d)
    assert th.majority_vote_error(9, 0.4) < th.majority_vote_error(5, 0.4) < 0.4


def test_signum_beta_zero_is_signsgd_and_bad_beta():
    a, b = Worker(sc.methods.get("signum", beta=0.0)), Worker(sc.methods.get("signsgd"))
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.encode(x, 0).to_dense(), b.encode(x, 0).to_dense())
    with pytest.raises(ValueError):
        sc.methods.get("signum", beta=1.0)
    sd = a.state_dict()
    assert set(sd["buckets"][0]) == {"momentum", "__rounds__"}     # the typed state and the round count


def test_signum_sends_its_momentum_without_copying_it_but_an_exact_round_copies():
    """signum's vote reads the momentum in place (its codes never alias it); an exact round's dense
    payload is a copy, untouched by later rounds."""
    m = Worker(sc.methods.get("signum", beta=0.5))
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    p = m.encode(x, 0, exact=True)
    mom = m.state(0).momentum
    assert p.values.data_ptr() != mom.data_ptr() and torch.equal(p.values, 0.5 * x)
    q = m.encode(x, 0)
    assert torch.equal(p.values, 0.5 * x) and torch.equal(mom, 0.75 * x)
    assert q.values.data_ptr() != mom.data_ptr() and torch.equal(q.to_dense(), torch.where(x < 0, -1.0, 1.0))


def test_vote_payload_is_one_bit_integer_codes_with_a_shared_scale():
    p = Worker(sc.methods.get("signsgd")).encode(torch.randn(1000), 0)
    assert p.kind == "quantized" and p.shared_scale and p.values.dtype == torch.int8
    assert set(p.values.unique().tolist()) <= {-1, 1} and p.bits == th.sign_vote_bits(1000) == 1000


def test_vote_codes_agree_on_both_kernel_paths():
    """VoteSign's one-pass Numba kernel gives the torch path's codes (sign(0) := +1, -0.0 too) and its
    decompressed votes, refuses NaN/Inf on both paths and accepts huge finite float64 values (the check
    is per entry, not a sum that could overflow)."""
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(4099, generator=torch.Generator().manual_seed(4)).to(dt)
        x[:3] = torch.tensor([0.0, -0.0, -1e-30]).to(dt)
        out = {}
        for path in ("numba", "torch"):
            with sc.kernels.force(path):
                p = VoteSign().compress(x)
                out[path] = (p.values, VoteSign().decompress(p))
                for bad in (math.nan, math.inf, -math.inf):
                    y = x.clone()
                    y[4000] = bad
                    with pytest.raises(NonFiniteError):
                        VoteSign().compress(y)
                big = torch.tensor([1e308, 1e308, -1e308], dtype=torch.float64)
                assert VoteSign().compress(big).values.tolist() == [1, 1, -1]
        assert torch.equal(out["numba"][0], out["torch"][0]) and out["numba"][0].dtype == torch.int8
        assert torch.equal(out["numba"][1], out["torch"][1]) and out["numba"][1].dtype == dt


# ------------------------------------------------------------------ onebit
def _onebit_step(m, x):
    """One worker alone (n = 1): the estimate (its own reconstruction) and the bits of every round."""
    msg = m.encode(x, 0)
    agg, bits = msg.to_dense(), [msg.bits]
    nxt = m.next_round(agg, 1, 0)
    if nxt is not None:
        agg, bits = nxt.to_dense(), bits + [nxt.bits]
        assert m.next_round(agg, 1, 0) is None
    return m.decode(agg, 1, 0), bits


def _two_means(p, b):
    """Seide et al.'s reconstruction, per bucket: the mean of the non-negative / of the negative entries."""
    q = torch.empty_like(p)
    for lo in range(0, p.numel(), b):
        blk, pos = p[lo:lo + b], p[lo:lo + b] >= 0
        hi = blk[pos].mean() if pos.any() else 0.0
        lo_ = blk[~pos].mean() if (~pos).any() else 0.0
        q[lo:lo + b] = torch.where(pos, hi, lo_)
    return q


def _symmetric_error(p, b):
    pb = torch.nn.functional.pad(p, (0, (-p.numel()) % b)).view(-1, b)
    cnt = torch.full((pb.shape[0],), float(b), dtype=p.dtype)
    if p.numel() % b:
        cnt[-1] = p.numel() % b
    return p.square().sum() - (pb.abs().sum(1).square() / cnt).sum()


@pytest.mark.parametrize("levels", ["two", "symmetric"])
def test_onebit_error_feedback_identity_and_exact_contraction(levels):
    m = Worker(sc.methods.get("onebit", bucket_size=16, levels=levels))
    g = torch.Generator().manual_seed(1)
    err = torch.zeros(1000, dtype=torch.float64)
    for _ in range(5):
        x = torch.randn(1000, generator=g, dtype=torch.float64) * torch.rand(1000, generator=g, dtype=torch.float64)
        p = x + err
        est, bits = _onebit_step(m, x)
        new = m.state(0).error
        torch.testing.assert_close(p, est + new, rtol=0, atol=1e-12)          # g + e_old == q + e_new
        if levels == "two":
            torch.testing.assert_close(est, _two_means(p, 16), rtol=0, atol=1e-12)
            assert new.square().sum() <= _symmetric_error(p, 16) * (1 + 1e-12)
        else:
            torch.testing.assert_close(new.square().sum(), _symmetric_error(p, 16), rtol=1e-10, atol=0)
        assert new.square().sum() <= (1 - th.onebit_delta(16)) * p.square().sum()
        err = new.clone()
        nl = 2 if levels == "two" else 1                      # 1000 entries, 63 buckets, float64 levels
        assert sum(bits) == th.onebit_bits(1000, 16, 64, nl) == 1000 + nl * 64 * 63
        assert len(bits) == nl


@pytest.mark.parametrize("levels", ["two", "symmetric"])
def test_onebit_delta_is_tight_at_a_spike(levels):
    m = Worker(sc.methods.get("onebit", bucket_size=8, levels=levels))
    x = torch.zeros(8, dtype=torch.float64)
    x[3] = 2.0
    _onebit_step(m, x)
    assert float(m.state(0).error.square().sum()) == pytest.approx((1 - th.onebit_delta(8)) * 4.0, rel=1e-12)


@pytest.mark.parametrize("levels", ["two", "symmetric"])
def test_onebit_residual_stays_bounded(levels):
    """EF with a delta-contractive operator: ||e_t|| <= sqrt(1-delta) (||e_{t-1}|| + ||g_t||), so
    ||e_t|| <= G sqrt(1-delta) / (1 - sqrt(1-delta)) for ||g_t|| <= G (derived)."""
    m, g = Worker(sc.methods.get("onebit", bucket_size=32, levels=levels)), torch.Generator().manual_seed(2)
    c = math.sqrt(1 - th.onebit_delta(32))
    G = 0.0
    for _ in range(200):
        x = torch.randn(512, generator=g, dtype=torch.float64) + 0.5
        G = max(G, float(x.norm()))
        _onebit_step(m, x)
        assert float(m.state(0).error.norm()) <= G * c / (1 - c)


@pytest.mark.parametrize("bucket", [512, 7, None])
def test_onebit_levels_are_rounded_once_and_both_paths_agree(bucket):
    """The Numba path sums each bucket in float64 and rounds the levels once to float32: they are the
    float64 levels (the reference: torch float64 sums) rounded to nearest, which the float32 torch path
    matches to a few ulp; the codes agree bit for bit, and so does the residual e = p - q given the same
    levels (q = s + a or -s + a per bucket in float32, one subtraction per entry)."""
    from sparsecomm.compressors.onebit import OneBit, residual

    x = torch.randn(10_007, generator=torch.Generator().manual_seed(5)) + 0.3
    x[:2] = torch.tensor([0.0, -0.0])
    x[600:1200] = 1.0                                 # a bucket with no negative entry
    for two in (True, False):
        c = OneBit(bucket, two)
        with sc.kernels.force("numba"):
            codes, s, a, b = c.levels(x)
        with sc.kernels.force("torch"):
            codes_t, s_t, a_t, b_t = c.levels(x)
        _, s64, a64, _ = OneBit(bucket, two).levels(x.double())
        assert torch.equal(codes, codes_t) and b == b_t
        assert torch.equal(s, s64.float())
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(s_t, s, rtol=4 * eps, atol=0)
        if two:
            assert torch.equal(a, a64.float())
            torch.testing.assert_close(a_t, a, rtol=0, atol=4 * eps * float(s.max()))
        errs = []
        for path in ("numba", "torch"):
            with sc.kernels.force(path):
                e = torch.empty_like(x)
                residual(x, codes, s, a, b, e)
                errs.append(e)
        assert torch.equal(errs[0], errs[1]) and torch.equal(errs[0].signbit(), errs[1].signbit())


def _onebit_worker(ctx, levels):
    pipe = CommPipeline("onebit", "allgather", fabric=ctx.fabric, bucket_size=64, levels=levels)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(ctx.rank))
    out = pipe.reduce(x.clone(), 0).clone()
    return x - pipe.states.state(0).error, out, pipe.stats.rounds


@pytest.mark.parametrize("levels", ["two", "symmetric"])
def test_onebit_through_allgather_and_refused_by_ring(levels):
    res = sc.launch(functools.partial(_onebit_worker, levels=levels), world_size=3, backend="sim")
    want = sum(r[0] for r in res) / 3
    for r in res:
        torch.testing.assert_close(r[1], want, rtol=1e-6, atol=1e-6)
        assert r[2] == (2 if levels == "two" else 1)
    with pytest.raises(IncompatibleError, match="allgather"):
        sc.launch(lambda ctx: CommPipeline("onebit", "ring", fabric=ctx.fabric), world_size=2, backend="sim")
    with pytest.raises(ValueError):
        sc.methods.get("onebit", levels="three")


def _ledger_worker(ctx, method, kw):
    pipe = CommPipeline(method, "allgather", fabric=ctx.fabric, **kw)
    x = torch.randn(1 << 15, generator=torch.Generator().manual_seed(ctx.rank))
    pipe.reduce(x, 0)
    return pipe.stats.as_dict()


@pytest.mark.parametrize("method,kw", [("signsgd", {}), ("onebit", {"levels": "two"}),
                                       ("onebit", {"levels": "symmetric"})])
def test_one_bit_codes_travel_as_one_bit_through_allgather(method, kw):
    """The codes use the SIGNS wire encoding: the ledger matches the declared bits (one per code plus
    the levels) within 1.05x plus the headers of each round (tests/codec/test_wire_formats.py's rule)."""
    s = sc.launch(functools.partial(_ledger_worker, method=method, kw=kw), world_size=3, backend="sim")[0]
    slack = 1536 * s["rounds"]
    assert s["bytes_declared_sent"] <= s["bytes_sent"] <= 1.05 * s["bytes_declared_sent"] + slack
    assert s["bytes_sent"] < 4 * (1 << 15) * 2 / 16       # under 1/16 of float32 to the 2 peers
