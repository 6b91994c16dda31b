"""The DDP comm hook (sparsecomm.ddp) under stock DistributedDataParallel on 2 gloo processes."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import sparsecomm as sc

from tests import _train_common as tc

STEPS = 5
SMALL_CAP = 300 / 2 ** 20          # several DDP buckets for the MLP


def _run(ctx, mode: str, steps: int, **hook):
    from sparsecomm import ddp as scddp

    model = tc.MLP(0, with_unused=False)
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL_CAP)
    state = scddp.register(net, **hook) if mode == "hook" else None
    opt = tc.make_inner(net)
    for t in range(steps):
        opt.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        tc.loss_fn(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], state


def _worker(ctx, steps: int, compressed: dict):
    out = {}
    out["builtin"], _ = _run(ctx, "builtin", steps)
    out["hook"], state = _run(ctx, "hook", steps, compressor="none")
    out["iter"] = state.steps
    with pytest.warns(FutureWarning, match="use CommHookState.steps"):
        out["iter_alias"] = state.iter
    with pytest.warns(FutureWarning, match="'steps'"):
        out["iterations_key"] = state.compression_stats()["iterations"]
    out["transport"] = state.pipeline.transport.name
    # a compressed method under DDP: every rank ends with the same parameters; the state pickles
    # without its process group and comes back bound to the default group with the same state
    out["ef"], st = _run(ctx, "hook", steps, **compressed)
    blob = pickle.dumps(st)
    back = pickle.loads(blob)
    out["pickle_has_pg"] = b"ProcessGroup" in blob or b"Fabric" in blob
    sd, sd2 = st.state_dict(), back.state_dict()
    out["roundtrip"] = (sd["steps"] == sd2["steps"] and
                        all(torch.equal(a.error, back.pipeline.states.state(k).error)
                            for k, a in ((k, st.pipeline.states.state(k)) for k in st.pipeline.states.keys())))
    out["keys"] = sorted(st.pipeline.states.keys())
    out["stats"] = st.compression_stats()
    return out


def _carrier():
    have = sc.transports.available()
    return next((n for n in ("allgather", "omnireduce") if n in have), None)


def _builtin_vs_hook(ctx):
    compressed = dict(compressor="topk", method="ef", ratio=0.3, transport=_carrier())
    return _worker(ctx, steps=STEPS, compressed=compressed)


@pytest.mark.multiprocess
def test_hook_equals_builtin_allreduce_gloo(launched):
    assert _carrier() is not None, "a transport that carries sparse payloads"
    res = _scenario(launched, _builtin_vs_hook)
    ref = tc.reference(2, STEPS, with_unused=False)
    for r in res:
        for a, b, c in zip(r["builtin"], r["hook"], ref):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
            torch.testing.assert_close(b, c, rtol=0, atol=1e-6)
        assert r["iter"] == r["iter_alias"] == r["iterations_key"] == STEPS
        assert not r["pickle_has_pg"] and r["roundtrip"]
        # keyed by parameters (EF + top-k runs per parameter: one state per parameter name)
        assert r["keys"] == [("param", n) for n in ("module.l1.bias", "module.l1.weight", "module.l2.bias",
                                                    "module.l2.weight")]
        assert r["stats"]["compression_factor"] > 1 and r["stats"]["steps"] == STEPS
    for a, b in zip(res[0]["ef"], res[1]["ef"]):
        assert torch.equal(a, b)
    # the compressed run really differs from the uncompressed one
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(res[0]["ef"], res[0]["hook"]))


# ------------------------------------------------------------------ overlap, resume, sparse
class Deep(nn.Module):
    """Six 32x32 layers: DDP's first-iteration layout (one bucket) differs from the rebuilt one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _deep_batch(rank, t):
    g = torch.Generator().manual_seed(100 * rank + t)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


def _deep_ddp(cap=10_000, **hook):
    from sparsecomm import ddp as scddp

    model = Deep()
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap / 2 ** 20)
    state = scddp.register(net, **hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return model, net, state, opt


def _deep_steps(ctx, net, opt, t0, t1, record=None):
    for t in range(t0, t1):
        opt.zero_grad()
        x, y = _deep_batch(ctx.rank, t)
        ((net(x) - y) ** 2).mean().backward()
        opt.step()


def _resume_worker(ctx, hook, resume_cap=10_000, probe=True):
    from sparsecomm.fabric.engine import engine

    # uninterrupted: 8 steps
    model, net, state, opt = _deep_ddp(**hook)
    _deep_steps(ctx, net, opt, 0, 8)
    straight = [p.detach().clone() for p in model.parameters()]
    # 4 steps, checkpoint, a fresh DDP (first-iteration layout, then rebuilt) restored, 4 more steps
    model, net, state, opt = _deep_ddp(**hook)
    _deep_steps(ctx, net, opt, 0, 4)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": pickle.loads(pickle.dumps(opt.state_dict())), "hook": pickle.loads(pickle.dumps(state.state_dict()))}
    n_keys = len(state.pipeline.states.keys())
    model, net, state, opt = _deep_ddp(cap=resume_cap, **hook)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    _deep_steps(ctx, net, opt, 4, 8)
    resumed = [p.detach().clone() for p in model.parameters()]
    if not probe:
        return straight, resumed, n_keys, None
    # the hook returns a pending future: a call queued behind a blocked one is not complete on return
    gate = __import__("threading").Event()
    pending = []
    orig = state.start_bucket

    def spy(*a, **k):
        w = orig(*a, **k)
        pending.append(not w.is_completed())
        gate.set()
        return w

    state.start_bucket = spy
    engine(state.pipeline.fabric).submit(lambda: gate.wait(30))
    _deep_steps(ctx, net, opt, 8, 9)
    return straight, resumed, n_keys, pending


def _fp16_ef_resume(ctx):
    return _resume_worker(ctx, hook=dict(compressor="fp16", method="ef", transport="allgather"))


def _caught(fn, ctx):
    """``fn(ctx)``, or the traceback of what it raised (so that one scenario's error fails its own test)."""
    try:
        return fn(ctx)
    except Exception:  # noqa: BLE001 - reported by the test that reads this scenario
        return __import__("traceback").format_exc()


def _every_scenario(ctx):
    torch.set_num_threads(1)
    # the probe of pending futures blocks the engine until the hook's next call: that scenario runs last
    return {fn.__name__: _caught(fn, ctx) for fn in (_builtin_vs_hook, _sparse_all, _diana_resume,
                                                        _powersgd_resume, _fp16_ef_resume)}


@pytest.fixture(scope="module")
def launched():
    """Every real-process scenario of this module on both ranks, from one 2-process gloo launch (each builds
    its own models, DDPs and hooks): a dict per rank, from the scenario's function name to what it returned
    (or the traceback of what it raised)."""
    return sc.launch(_every_scenario, world_size=2, backend="gloo")


def _scenario(launched, fn):
    """The scenario ``fn``'s results on both ranks; a failure naming it if it raised on a worker."""
    res = [r[fn.__name__] for r in launched]
    for r in res:
        if isinstance(r, str):
            pytest.fail(f"{fn.__name__} raised on a worker:\n{r}")
    return res


@pytest.mark.multiprocess
def test_hook_resume_across_bucket_rebuild_is_exact_and_futures_pending(launched):
    """EF + fp16 (element-wise, so the compressed result does not depend on how parameters are grouped)
    through the hook: a run restored from a checkpoint into a fresh DDP, whose first iteration uses
    another bucket layout than the saved one and then rebuilds, ends bit-identical to the uninterrupted
    run (the state is keyed by parameters and remapped exactly; keyed by bucket index it would not even
    load onto the first layout)."""
    res = _scenario(launched, _fp16_ef_resume)
    for straight, resumed, n_keys, pending in res:
        assert n_keys >= 2                      # several buckets after the rebuild
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)
        assert pending and pending[0]
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)


class SparseEmb(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = nn.Embedding(40, 4, sparse=True)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(40, 4, generator=g))
            self.head.weight.copy_(torch.randn(2, 4, generator=g))
            self.head.bias.zero_()

    def forward(self, ids):
        return self.head(self.emb(ids).sum(1))


def _sparse_worker(ctx, mode):
    from sparsecomm import ddp as scddp
    from sparsecomm.errors import IncompatibleError

    model = SparseEmb()
    net = nn.parallel.DistributedDataParallel(model)
    if mode == "hook":
        scddp.register(net, compressor="none", transport="omnireduce")
    elif mode == "reject":
        try:
            scddp.register(net, compressor="topk", method="ef", ratio=0.1, transport="allgather")
        except IncompatibleError as e:
            return str(e)
        return None
    opts = [torch.optim.SparseAdam([model.emb.weight], lr=0.05), torch.optim.SGD(model.head.parameters(), lr=0.1)]
    for t in range(4):
        for o in opts:
            o.zero_grad()
        g = torch.Generator().manual_seed(10 * ctx.rank + t)
        ids, y = torch.randint(0, 40, (5, 3), generator=g), torch.randint(0, 2, (5,), generator=g)
        nn.functional.cross_entropy(net(ids), y).backward()
        assert model.emb.weight.grad.is_sparse
        for o in opts:
            o.step()
    return [p.detach().clone() for p in model.parameters()]


def _sparse_all(ctx):
    return {m: _sparse_worker(ctx, m) for m in ("builtin", "hook", "reject")}


def _diana_resume(ctx):
    # a resumed DDP with buckets of 3000 bytes (one or two parameters each) and one of 60000 (all)
    return [_resume_worker(ctx, dict(compressor="diana", ratio=0.1, transport="allgather", seed=5),
                           resume_cap=cap, probe=False) for cap in (3_000, 60_000)]


@pytest.mark.multiprocess
def test_hook_resume_diana_randk_any_layout(launched):
    """DIANA + shared-seed rand-k through the hook runs per parameter (state, generator, alpha and k per
    parameter): a run checkpointed after 4 steps and resumed into a fresh DDP with *another*
    ``bucket_cap_mb`` (so other buckets both before and after DDP's rebuild) ends bit-identical to the
    uninterrupted run, on every worker; keyed by bucket, the rand-k draws followed the layout."""
    res = _scenario(launched, _diana_resume)
    for runs in res:
        for straight, resumed, n_keys, _ in runs:
            assert n_keys == 12                 # one state per parameter (6 weights + 6 biases)
            moved = False
            for a, b in zip(straight, resumed):
                assert torch.equal(a, b)
            for a, b in zip(straight, Deep().parameters()):
                moved |= not torch.equal(a, b.detach())
            assert moved
    for a, b in zip(res[0][0][0], res[1][0][0]):
        assert torch.equal(a, b)


def _powersgd_resume(ctx):
    # after the first compressed step (iterations 1..3 compressed before the checkpoint at 4): any layout
    runs = [_resume_worker(ctx, dict(compressor="powersgd", matrix_approximation_rank=2, seed=5),
                           resume_cap=cap, probe=False) for cap in (3_000, 60_000)]
    # before it, with iterations in between: the first Qs are drawn on the same (rebuilt) layout
    runs.append(_resume_worker(ctx, dict(compressor="powersgd", start_powerSGD_iter=6, seed=5), probe=False))
    return runs


@pytest.mark.multiprocess
def test_hook_resume_powersgd_exact(launched):
    """PowerSGD through the hook keeps one state per bucket: the error per coordinate and the warm-start
    Q per matrix (``PowerSGD.state_sizes``). Restored into a fresh DDP, whose first iteration has the
    initial bucket layout and the next the rebuilt one (and, here, another ``bucket_cap_mb``), the state
    is split per parameter and rejoined for each layout, and the run ends bit-identical to the
    uninterrupted one: checkpointed after the first compressed step (warm start: no Q drawn after the
    restore), or before it with an iteration between the restore and the first draw."""
    res = _scenario(launched, _powersgd_resume)
    for runs in res:
        for straight, resumed, n_keys, _ in runs:
            assert n_keys >= 2
            for a, b in zip(straight, resumed):
                assert torch.equal(a, b)
            assert any(not torch.equal(a, b.detach()) for a, b in zip(straight, Deep().parameters()))
    for a, b in zip(res[0][0][0], res[1][0][0]):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_hook_sparse_embedding_matches_ddp_and_rejects_compression(launched):
    res = _scenario(launched, _sparse_all)
    for r in res:
        for a, b in zip(r["builtin"], r["hook"]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert "sparse" in r["reject"] and "DistributedOptimizer" in r["reject"] and "emb" in r["reject"]


def test_register_needs_a_ddp_model():
    """A bare module gets a library error that says to wrap it (before any process group is needed)."""
    from sparsecomm.errors import InvalidTypeError

    with pytest.raises(InvalidTypeError, match="DistributedDataParallel") as e:
        sc.ddp.register(nn.Sequential(nn.Linear(2, 2)), compressor="powersgd")
    assert "Sequential" in str(e.value) and "Wrap it first" in str(e.value)
