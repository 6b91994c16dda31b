"""PowerSGD (sparsecomm.methods.powersgd): the two-round contract, error feedback, exactness on low-rank
sums, warm start, and parity with torch's ``powerSGD_hook`` under DDP (2 gloo processes)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import sparsecomm as sc
from tests._keyed import Worker
from theory import compressors as th

SHAPES = [(8, 6), (5,), (12, 10), (3, 2)]      # (5,) and (3, 2) are sent whole at rate 2
D = sum(math.prod(s) for s in SHAPES)


def _init(model):
    """Deterministic parameters from an explicit generator (never the global RNG: sim workers are threads)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def run_step(methods, grads, gen_seed, shapes=SHAPES):
    """One step of every worker's method, the transport being the exact sum; returns (estimates, rounds)."""
    n = len(methods)
    pays = [m.encode(g.clone(), 0, torch.Generator().manual_seed(gen_seed), shapes=shapes)
            for m, g in zip(methods, grads)]
    agg, rounds = sum(p.to_dense() for p in pays), 1
    while True:
        nxt = [m.next_round(agg, n, 0) for m in methods]
        assert len({x is None for x in nxt}) == 1, "every worker agrees on the number of rounds"
        if nxt[0] is None:
            break
        agg, rounds = sum(p.to_dense() for p in nxt), rounds + 1
    return [m.decode(agg, n, 0) for m in methods], rounds


def test_two_rounds_error_feedback_identity_float64():
    n, gen = 3, torch.Generator().manual_seed(1)
    ms = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=1)) for _ in range(n)]
    for step in range(4):
        grads = [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(n)]
        before = [m.state(0).error.clone() if m.state(0) else torch.zeros(D, dtype=torch.float64) for m in ms]
        est, rounds = run_step(ms, grads, step)
        assert rounds == 2
        for e in est[1:]:
            assert torch.equal(e, est[0])
        for m, g, e0 in zip(ms, grads, before):       # g + e_old == estimate + e_new (torch and epfml)
            torch.testing.assert_close(g + e0, est[0] + m.state(0).error, rtol=0, atol=1e-12)
        # the tensors sent whole get the exact mean of g + e
        mean = sum(g + e0 for g, e0 in zip(grads, before)) / n
        torch.testing.assert_close(est[0][48:53], mean[48:53], rtol=0, atol=1e-12)
        torch.testing.assert_close(est[0][-6:], mean[-6:], rtol=0, atol=1e-12)
        # warm start: q is the mean of the round-2 Qs (m r per compressed matrix)
        assert ms[0].state(0).q.numel() == 6 + 10
        assert ms[0].states[0].rounds == step + 1


def test_exact_when_the_workers_share_a_rank_r_column_space():
    n, r, gen = 4, 2, torch.Generator().manual_seed(2)
    u = torch.randn(12, r, generator=gen, dtype=torch.float64)
    ms = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=r, use_error_feedback=False)) for _ in range(n)]
    grads = [(u @ torch.randn(r, 10, generator=gen, dtype=torch.float64)).reshape(-1) for _ in range(n)]
    est, rounds = run_step(ms, grads, 0, shapes=[(12, 10)])
    assert rounds == 2
    torch.testing.assert_close(est[0], sum(grads) / n, rtol=0, atol=1e-10)
    # a rank-(r+1) sum is not recovered by rank r: the projection loses energy, bounded by ||mean||
    v = [torch.randn(12, 10, generator=gen, dtype=torch.float64).reshape(-1) for _ in range(n)]
    ms = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=r, use_error_feedback=False)) for _ in range(n)]
    est, _ = run_step(ms, v, 0, shapes=[(12, 10)])
    mean = sum(v) / n
    assert 0 < (est[0] - mean).norm() < mean.norm()


def test_warm_start_converges_to_the_best_rank_r_approximation():
    """Repeated steps on a fixed gradient (no EF) are subspace iterations: the error approaches the
    truncated SVD's, sqrt(sum of the dropped singular values squared) (theory.lowrank_delta)."""
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(12, 10, generator=gen, dtype=torch.float64)
    s = torch.linalg.svdvals(m)
    best = s[2:].square().sum().sqrt()
    meth = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2, use_error_feedback=False))]
    errs = [(run_step(meth, [m.reshape(-1)], k, shapes=[(12, 10)])[0][0] - m.reshape(-1)).norm()
            for k in range(60)]
    assert errs[-1] <= best * (1 + 1e-6) and errs[-1] >= best * (1 - 1e-9)
    assert errs[0] > errs[-1]
    # and the best rank-r error is within the lowrank_delta bound
    assert best ** 2 <= (1 - th.lowrank_delta(12, 10, 2)) * m.square().sum() + 1e-12


def test_start_iter_and_exact_rounds_are_plain_averages():
    n, gen = 2, torch.Generator().manual_seed(4)
    ms = [Worker(sc.methods.get("powersgd", start_powerSGD_iter=2)) for _ in range(n)]
    for step in range(3):
        grads = [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(n)]
        est, rounds = run_step(ms, grads, step)
        if step < 2:
            assert rounds == 1
            torch.testing.assert_close(est[0], sum(grads) / n, rtol=0, atol=1e-12)
            assert not ms[0].state(0).error.any()
        else:
            assert rounds == 2


def test_state_dict_round_trip_continues_identically():
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(3)]
    a = [Worker(sc.methods.get("powersgd")) for _ in range(2)]
    run_step(a, grads[0], 0)
    b = [Worker(sc.methods.get("powersgd")) for _ in range(2)]
    for x, y in zip(a, b):
        y.load_state_dict(x.state_dict())
    for t in (1, 2):
        ea, _ = run_step(a, grads[t], t)
        eb, _ = run_step(b, grads[t], t)
        assert torch.equal(ea[0], eb[0])


def test_bits_and_layout_follow_theory():
    assert th.powersgd_compresses(8, 6, 1) and not th.powersgd_compresses(5, 1, 1)
    assert not th.powersgd_compresses(3, 2, 1)
    assert th.powersgd_bits(SHAPES, 1) == 32 * ((8 + 6) + 5 + (12 + 10) + 6)
    with pytest.raises(ValueError):
        sc.methods.get("powersgd", matrix_approximation_rank=0)


def _sim_worker(ctx, transport):
    model = _init(nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3)))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="powersgd",
                                  transport=transport)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 10, generator=g)
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.compression_stats()


@pytest.mark.parametrize("transport", ["ring", "allgather"])
def test_optimizer_runs_both_rounds_over_a_transport(transport):
    res = sc.launch(functools.partial(_sim_worker, transport=transport), world_size=2, backend="sim")
    (p0, st0), (p1, _) = res
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    shapes = [(12, 10), (12,), (3, 12), (3,)]
    assert st0["rounds"] == 3 * 2
    assert st0["bytes_payload"] == 3 * th.powersgd_bits(shapes, 1) // 8


# ------------------------------------------------------------------ parity with torch's powerSGD_hook
STEPS, WARM, RANK, SEED, SNAP = 60, 2, 2, 123, 20
OUT = 16


def _make_data(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(16, OUT, generator=torch.Generator().manual_seed(7)) / 4
    x = torch.randn(steps, 32, 16, generator=g)
    return x, x @ w + 0.1 * torch.randn(steps, 32, OUT, generator=g)


def _model():
    """Matrices (16,16), (8,16), (16,8), (16,16): a repeated shape, so torch's hook groups the first
    and the last when it draws its starting Qs; the biases are sent whole."""
    return _init(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16),
                               nn.Tanh(), nn.Linear(16, OUT)))


def _train(hook, state_fn, rank, steps, lr=0.05, momentum=0.9):
    """(held-out loss after ``steps``, the parameters after ``SNAP`` steps)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    net = DDP(model)
    if hook is not None:
        net.register_comm_hook(state_fn(), hook)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    x, y = _make_data(rank, steps)
    snap = None
    for t in range(steps):
        if t == SNAP:
            snap = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        ((net(x[t]) - y[t]) ** 2).mean().backward()
        opt.step()
    xe, ye = _make_data(99, 4)
    with torch.no_grad():
        return float(((model(xe.reshape(-1, 16)) - ye.reshape(-1, OUT)) ** 2).mean()), snap


class _FixedSeed:
    """Stands in for PowerSGDState.rng (a numpy RandomState): the seed torch's hook draws its Qs with."""

    def randint(self, high):
        return SEED


def _parity_worker(ctx):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    from sparsecomm import ddp as scddp

    def torch_state(**kw):
        st = ph.PowerSGDState(None, start_powerSGD_iter=WARM, **kw)
        st.rng = _FixedSeed()
        return st

    out = {"plain": _train(None, None, ctx.rank, STEPS)[0], "start": _train(None, None, ctx.rank, 0)[0]}
    out["torch"] = _train(ph.powerSGD_hook, lambda: torch_state(matrix_approximation_rank=RANK), ctx.rank, STEPS)
    # torch's keywords (start_powerSGD_iter counts the hook's iterations, as torch's does)
    out["ours"] = _train(scddp.comm_hook, lambda: scddp.CommHookState(
        compressor="powersgd", matrix_approximation_rank=RANK, start_powerSGD_iter=WARM, seed=SEED), ctx.rank, STEPS)
    # full rank and no size rule: both are the exact average
    out["torch_full"] = _train(ph.powerSGD_hook, lambda: torch_state(
        matrix_approximation_rank=32, min_compression_rate=0), ctx.rank, STEPS)[0]
    out["ours_full"] = _train(scddp.comm_hook, lambda: scddp.CommHookState(
        compressor="powersgd", matrix_approximation_rank=32, min_compression_rate=0, warmup_steps=WARM), ctx.rank,
        STEPS)[0]
    # the other methods with their own operator under the DDP hook (20 steps each); the sign methods take steps
    # of lr per coordinate, signum and dgc carry their own momentum
    for name, kw, lr, mom in (("signsgd", {"transport": "native"}, 0.01, 0.9),
                              ("signum", {"transport": "native"}, 0.01, 0.0),
                              ("onebit", {"transport": "allgather"}, 0.05, 0.9),
                              ("dgc", {"ratio": 0.1, "transport": "allgather"}, 0.05, 0.0)):
        out[name] = _train(scddp.comm_hook, lambda: scddp.CommHookState(compressor=name, **kw), ctx.rank,
                           20, lr, mom)[0]
    return out


@pytest.mark.multiprocess
def test_parity_with_torch_powerSGD_hook_gloo():
    """Same model, data and starting Qs (torch's hook seeded through its ``rng``, ours through the
    pipeline's shared generator): the same trajectory up to float32 rounding (Gram-Schmidt there, QR
    here), measured at ~1e-7 relative after 20 steps; the tolerance 1e-5 leaves room for the rounding's
    slow growth but not for any algorithmic difference (a different Q draw is ~1e-1 apart)."""
    r0, r1 = sc.launch(_parity_worker, world_size=2, backend="gloo")
    assert r0["torch"][0] == r1["torch"][0] and r0["ours"][0] == r1["ours"][0]   # replicas agree
    for a, b in zip(r0["torch"][1], r0["ours"][1]):
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    assert r0["ours"][0] == pytest.approx(r0["torch"][0], rel=1e-2)        # 60 steps: rounding drift only
    assert r0["plain"] < r0["torch"][0] < 0.5 * r0["start"]                # rank 2 loses a little
    assert r0["torch_full"] == pytest.approx(r0["plain"], rel=1e-4)
    assert r0["ours_full"] == pytest.approx(r0["plain"], rel=1e-4)
    for name in ("signsgd", "signum", "onebit", "dgc"):                   # 20 steps: they learn
        assert r0[name] < 0.75 * r0["start"], name


def test_single_worker_operator_is_a_rank_r_projection():
    c = sc.methods.get("powersgd", matrix_approximation_rank=2).compressor
    g = torch.Generator().manual_seed(6)
    low = torch.randn(9, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(c.decompress(c.compress(low, g)), low, rtol=0, atol=1e-10)
    x = torch.randn(9, 7, generator=g, dtype=torch.float64)
    err = (c.decompress(c.compress(x, g)) - x).norm()
    assert torch.linalg.svdvals(x)[2:].square().sum().sqrt() <= err * (1 + 1e-12) and err <= x.norm()
    assert c.compress(x, g).bits == th.powersgd_bits([(9, 7)], 2, 0.0, 64) == 64 * 2 * 16


# ------------------------------------------------------------------ half precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_orthogonalises_in_float32(dtype):
    """CPU QR has no half-precision kernel: PowerSGD orthogonalises the Ps and Qs in float32 and casts
    the bases back, so a bf16/fp16 bucket runs, and follows the float32 run of the same (rounded)
    gradients from the same warm start to the half type's precision: measured within 3.4 eps of the
    largest entry after 3 steps over 5 seeds; 16 eps leaves room for that but not for an algorithmic
    difference (another subspace is O(1) away). (The warm start is shared because fresh Gaussian Qs of
    16 or more values differ between dtypes: torch draws them with another kernel.)"""
    gen = torch.Generator().manual_seed(8)
    g0 = [torch.randn(D, generator=gen) for _ in range(2)]
    half = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2)) for _ in range(2)]
    full = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2)) for _ in range(2)]
    run_step(half, g0, 0)
    run_step(full, g0, 0)
    for m in half:
        st = m.states[0].state
        st.error, st.q = st.error.to(dtype), st.q.to(dtype)
    for step in range(1, 4):
        grads = [torch.randn(D, generator=gen).to(dtype) for _ in range(2)]
        eh, rounds = run_step(half, grads, step)
        ef, _ = run_step(full, [g.float() for g in grads], step)
        assert rounds == 2 and eh[0].dtype == dtype and half[0].states[0].state.q.dtype == dtype
        assert float((eh[0].float() - ef[0]).abs().max()) <= 16 * torch.finfo(dtype).eps * float(ef[0].abs().max())


def _bf16_worker(ctx):
    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3)).to(torch.bfloat16)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="powersgd",
                                  transport="ring")
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 10, generator=g).to(torch.bfloat16)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bf16_model_trains_through_the_optimizer():
    p0, p1 = sc.launch(_bf16_worker, world_size=2, backend="sim")
    for a, b in zip(p0, p1):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_torch_keywords_and_deprecated_aliases():
    """torch's ``PowerSGDState`` keywords are the names; the old ones still work with a warning that
    names the replacement, and both at once is an error."""
    from sparsecomm.errors import HyperParameterError

    m = sc.methods.get("powersgd", matrix_approximation_rank=3, start_powerSGD_iter=5, min_compression_rate=1.5,
                       use_error_feedback=False, warm_start=False)
    assert m.hyper() == {"matrix_approximation_rank": 3, "start_powerSGD_iter": 5, "min_compression_rate": 1.5,
                         "use_error_feedback": False, "warm_start": False}
    for old, new, v in (("rank", "matrix_approximation_rank", 2), ("start_iter", "start_powerSGD_iter", 4),
                        ("error_feedback", "use_error_feedback", False)):
        with pytest.warns(FutureWarning, match=f"{old}=.*use {new}="):
            assert sc.methods.get("powersgd", **{old: v}).hyper()[new] == v
    with pytest.raises(HyperParameterError, match="matrix_approximation_rank"):
        sc.methods.get("powersgd", rank=2, matrix_approximation_rank=3)


def test_state_splits_per_tensor_and_rejoins_onto_another_layout():
    """``state_sizes``: the error per coordinate, the warm-start Q per compressed matrix (m r values),
    nothing for a tensor sent whole; split into one piece per tensor and joined in another grouping,
    a bucket's state is the state that bucket would hold (what the DDP hook's ``bind`` does after a
    bucket rebuild), and joining the pieces back gives the original bit for bit."""
    from sparsecomm.errors import MismatchError
    from sparsecomm.methods.state import join_state, split_state

    gen = torch.Generator().manual_seed(9)
    ms = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=1)) for _ in range(2)]
    for step in range(2):
        run_step(ms, [torch.randn(D, generator=gen) for _ in range(2)], step)
    m, st = ms[0], ms[0].states[0].state
    shapes = [torch.Size(s) for s in SHAPES]
    assert m.state_sizes(shapes) == {"q": [6, 0, 10, 0]}
    pieces = split_state(m, st, shapes)
    assert [p.error.numel() for p in pieces] == [48, 5, 120, 6] and [p.q.numel() for p in pieces] == [6, 0, 10, 0]
    back = join_state(m, pieces, shapes)
    assert torch.equal(back.error, st.error) and torch.equal(back.q, st.q)
    # another bucket holding (12, 10) then (5,): its Q is that matrix's, its error those coordinates
    other = join_state(m, [pieces[2], pieces[1]], [shapes[2], shapes[1]])
    assert torch.equal(other.q, st.q[6:]) and torch.equal(other.error, torch.cat([st.error[53:173], st.error[48:53]]))
    # a bias-only bucket before any warm start holds no Q: joined with a matrix piece, the Q is the matrix's
    bias = type(st)(error=torch.zeros(5), q=None)
    assert torch.equal(join_state(m, [pieces[0], bias], [shapes[0], shapes[1]]).q, st.q[:6])
    with pytest.raises(MismatchError, match="'q'"):
        split_state(m, st, [torch.Size([D])])           # the shapes of another model


def test_torchs_other_state_keywords_are_taken_and_change_no_number():
    """``orthogonalization_epsilon``, ``batch_tensors_with_same_shape`` and
    ``compression_stats_logging_frequency`` of torch's ``PowerSGDState`` are accepted by name (and checked);
    the estimate is the same with them as without."""
    kw = dict(orthogonalization_epsilon=1e-8, batch_tensors_with_same_shape=True,
              compression_stats_logging_frequency=100)
    m = sc.methods.get("powersgd", matrix_approximation_rank=2, **kw)
    assert (m.orthogonalization_epsilon, m.batch_tensors_with_same_shape, m.compression_stats_logging_frequency) \
        == (1e-8, True, 100)
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(2)]
    plain = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2)) for _ in range(2)]
    torchy = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2, **kw)) for _ in range(2)]
    assert torch.equal(run_step(plain, grads, 3)[0][0], run_step(torchy, grads, 3)[0][0])
    for bad in (dict(orthogonalization_epsilon=-1.0), dict(compression_stats_logging_frequency=0)):
        with pytest.raises(sc.errors.InvalidValueError, match="powersgd"):
            sc.methods.get("powersgd", **bad)


def test_random_seed_draws_the_qs_torchs_rng_seeds():
    """``random_seed=s`` draws the starting Qs from ``RandomState(s).randint(10**9)``, the integer torch's hook
    seeds its first bucket's Qs with: the same step as passing that integer as the generator's seed, whatever
    generator the frontend passes; it is a setting every worker must share (in ``hyper()``)."""
    import numpy as np

    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(2)]
    torch_int = int(np.random.RandomState(7).randint(1_000_000_000))
    seeded = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2, random_seed=7)) for _ in range(2)]
    plain = [Worker(sc.methods.get("powersgd", matrix_approximation_rank=2)) for _ in range(2)]
    got, ref = run_step(seeded, grads, 123)[0][0], run_step(plain, grads, torch_int)[0][0]
    assert torch.equal(got, ref)
    assert not torch.equal(got, run_step([Worker(sc.methods.get("powersgd", matrix_approximation_rank=2))
                                          for _ in range(2)], grads, 123)[0][0])
    assert seeded[0].method.hyper()["random_seed"] == 7 and "random_seed" not in plain[0].method.hyper()
    with pytest.raises(sc.errors.InvalidValueError, match="random_seed"):
        sc.methods.get("powersgd", random_seed=-1)
