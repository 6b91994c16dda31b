"""Invariants of the stateful methods (none, ef, ef21, diana), in float64, without a network.

A round for n workers is simulated in-process: every worker encodes, the aggregate is the sum of the
decompressed messages (what every transport returns), every worker decodes.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError, InvalidTypeError, MismatchError, UnknownNameError
from sparsecomm.methods.state import states_from_dict, states_to_dict
from tests._keyed import Worker


D = 64
N = 4


def _grads(n=N, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(n)]


def _gens(compressor, n=N, seed=1):
    """Per-worker generators: the same seed everywhere where the compressor shares randomness."""
    return [torch.Generator().manual_seed(seed if compressor.shared_randomness else seed + r)
            for r in range(n)]


def _round(methods, grads, gens, key=0, exact=False):
    msgs = [m.encode(g, key, gen, exact=exact) for m, g, gen in zip(methods, grads, gens)]
    agg = sum(p.to_dense() for p in msgs)
    ests = [m.decode(agg, len(methods), key) for m in methods]
    return msgs, ests


def test_registry_names():
    assert {"none", "ef", "ef21", "diana"} <= set(sc.methods.available())
    with pytest.raises(UnknownNameError) as e:
        sc.methods.get("dianna")
    assert "dianna" in str(e.value) and "diana" in str(e.value) and "ef21" in str(e.value)


@pytest.mark.parametrize("cname", ["topk", "randk"])
def test_ef_identity_float64(cname):
    """g + e_old == decompress(m) + e_new on every round (nothing is lost, only delayed)."""
    c = sc.compressors.get(cname, ratio=0.1)
    m = Worker(sc.methods.get("ef", compressor=c))
    gen = _gens(c, 1)[0]
    e_old = torch.zeros(D, dtype=torch.float64)
    for t in range(20):
        g = _grads(1, seed=t)[0]
        msg = m.encode(g, 0, gen)
        e_new = m.state(0).error
        lhs = g + e_old
        torch.testing.assert_close(lhs, c.decompress(msg).reshape(-1) + e_new, rtol=0,
                                   atol=1e-14 * lhs.abs().max().item())
        est = m.decode(msg.to_dense(), 1, 0)
        torch.testing.assert_close(est, c.decompress(msg).reshape(-1), rtol=0, atol=0)
        assert e_new.abs().sum() > 0  # the compressor drops something: the test can fail
        e_old = e_new.clone()
    # an exact round flushes the residual
    m.encode(_grads(1, seed=99)[0], 0, gen, exact=True)
    assert torch.count_nonzero(m.state(0).error) == 0


def test_diana_shifts_learn_local_gradients():
    """On a fixed gradient, E||h_i - g_i||^2 contracts by (1 - alpha) per round; h == mean h_i."""
    c = sc.compressors.get("randk", ratio=0.25)            # omega = 3, alpha = 1/4
    methods = [Worker(sc.methods.get("diana", compressor=c)) for _ in range(N)]
    assert methods[0].alpha_for(D) == pytest.approx(1 / (c.omega(D) + 1))
    grads, gens = _grads(), _gens(c)
    mean = sum(grads) / N
    for t in range(300):
        _, ests = _round(methods, grads, gens)
        if t == 0:
            err0 = max((m.state(0).h_local - g).norm().item() for m, g in zip(methods, grads))
    # 0.75^300 ~ 3e-38: far below float64 resolution of the start
    for m, g in zip(methods, grads):
        assert (m.state(0).h_local - g).norm() <= 1e-10 * g.norm()
    h_mean = sum(m.state(0).h_local for m in methods) / N
    for m in methods:
        torch.testing.assert_close(m.state(0).h_global, h_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(ests[0], mean, rtol=0, atol=1e-10)
    assert err0 > 0.1  # the shifts did start far away


def test_diana_estimate_unbiased_and_exact_round():
    c = sc.compressors.get("randk", ratio=0.25)
    methods = [Worker(sc.methods.get("diana", compressor=c, alpha=0.1)) for _ in range(N)]
    grads, gens = _grads(), _gens(c)
    mean = sum(grads) / N
    _, ests = _round(methods, grads, gens, exact=True)     # warm-up round: exact, shifts jump to g_i
    torch.testing.assert_close(ests[0], mean, rtol=0, atol=1e-12)
    for m, g in zip(methods, grads):
        torch.testing.assert_close(m.state(0).h_local, g, rtol=0, atol=1e-12)


def test_diana_needs_unbiased():
    with pytest.raises(IncompatibleError, match="unbiased"):
        sc.methods.get("diana", compressor=sc.compressors.get("topk", ratio=0.1))


@pytest.mark.parametrize("init", ["grad", "zeros"])
def test_ef21_aggregate_tracks_mean(init):
    c = sc.compressors.get("topk", ratio=0.1)
    methods = [Worker(sc.methods.get("ef21", compressor=c, init=init)) for _ in range(N)]
    gens = _gens(c)
    for t in range(15):
        grads = _grads(seed=t)
        msgs, ests = _round(methods, grads, gens)
        g_mean = sum(m.state(0).g_local for m in methods) / N
        for m, e in zip(methods, ests):
            torch.testing.assert_close(m.state(0).g_global, g_mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(e, g_mean, rtol=0, atol=1e-12)
        if t == 0:
            # "grad": the first round is sent whole (g_i^0 = grad_i^0); "zeros": compressed
            assert (msgs[0].kind == "dense") == (init == "grad")
            if init == "grad":
                torch.testing.assert_close(ests[0], sum(grads) / N, rtol=0, atol=1e-12)


def test_none_is_the_mean_of_messages():
    c = sc.compressors.get("randk", ratio=0.5)
    methods = [Worker(sc.methods.get("none", compressor=c)) for _ in range(N)]
    msgs, ests = _round(methods, _grads(), _gens(c))
    torch.testing.assert_close(ests[0], sum(p.to_dense() for p in msgs) / N)
    # stateless: a bucket's state is only its round count (which a warm-up wrapper reads)
    assert methods[0].state_dict() == {"method": "none", "buckets": {0: {"__rounds__": 1}}}


def _run(methods, gens, rounds, seed0, keys=(0, "b")):
    out = []
    for t in range(rounds):
        for key in keys:
            d = D if key == 0 else 10
            grads = [g[:d] for g in _grads(seed=seed0 + t)]
            _, ests = _round(methods, grads, gens, key)
            out.append(ests[0])
    return out


@pytest.mark.parametrize("name,cname", [("ef", "topk"), ("ef21", "topk"), ("diana", "randk")])
def test_state_dict_round_trip(name, cname):
    c = sc.compressors.get(cname, ratio=0.2)
    methods = [Worker(sc.methods.get(name, compressor=c)) for _ in range(N)]
    gens = _gens(c)
    _run(methods, gens, 3, 0)
    # through torch.save, as a checkpoint would
    saved = []
    for m in methods:
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        buf.seek(0)
        saved.append(torch.load(buf))
    gen_states = [g.get_state() for g in gens]
    sd0 = methods[0].state_dict()
    assert set(sd0["buckets"]) == {0, "b"}
    # the state dict is a copy: the next rounds must not change it
    snapshot = copy.deepcopy(sd0)
    cont = _run(methods, gens, 4, 10)
    for key, fields in sd0["buckets"].items():
        for f, v in fields.items():
            w = snapshot["buckets"][key][f]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
    fresh = [Worker(sc.methods.get(name, compressor=c)) for _ in range(N)]
    for m, sd in zip(fresh, saved):
        m.load_state_dict(sd)
    for m, m0 in zip(fresh, methods):
        assert m.state_dict()["buckets"].keys() == sd0["buckets"].keys()
    gens2 = [torch.Generator() for _ in gens]
    for g, s in zip(gens2, gen_states):
        g.set_state(s)
    again = _run(fresh, gens2, 4, 10)
    for a, b in zip(cont, again):
        assert torch.equal(a, b)


def test_load_wrong_method_and_length_mismatch():
    c = sc.compressors.get("topk", ratio=0.1)
    ef = sc.methods.get("ef", compressor=c)
    st = ef.init(D, torch.float64)
    _, st = ef.encode(torch.ones(D, dtype=torch.float64), st)
    _, st = ef.decode(torch.ones(D, dtype=torch.float64), 1, st)
    with pytest.raises(MismatchError, match="ef21"):
        states_from_dict(sc.methods.get("ef21", compressor=c), states_to_dict(ef, {0: st}))
    with pytest.raises(MismatchError, match="layout"):
        ef.encode(torch.ones(D + 1, dtype=torch.float64), st)
    with pytest.raises(MismatchError, match="float32"):          # a state of another dtype
        ef.encode(torch.ones(D, dtype=torch.float64), ef.init(D))
    with pytest.raises(InvalidTypeError, match="MethodState"):   # no state kept by key in the method
        ef.encode(torch.ones(D, dtype=torch.float64), 0)


def test_hyper_parameters_apart_from_state():
    m = sc.methods.get("diana", compressor=sc.compressors.get("randk", ratio=0.2), alpha=0.3, init="grad")
    assert m.hyper()["alpha"] == 0.3 and m.hyper()["init"] == "grad"
    assert "diana" in sc.methods.registry.available()
    with pytest.raises(ValueError, match="alpha"):
        sc.methods.get("diana", compressor=sc.compressors.get("randk", ratio=0.2), alpha=2.0)
    with pytest.raises(TypeError, match="compressor object"):
        sc.methods.get("ef", compressor=sc.compressors.get("topk", ratio=0.1), ratio=0.2)


def test_default_compressors():
    """A method built by name alone gets its default compressor (ratio 0.01 for the sparsifiers)."""
    defaults = {"none": "identity", "ef": "topk", "ef21": "topk", "diana": "randk"}
    for name, cname in defaults.items():
        m = sc.methods.get(name)
        assert m.compressor.name == cname
        if cname != "identity":
            assert m.compressor.hyper().get("ratio") == 0.01


def test_inplace_encode_and_out_decode_match_pure_calls():
    """``encode(inplace=True)`` / ``decode(out=)`` (the optimizer's allocation-free path) give the same
    numbers as the pure calls, and the estimate never aliases the state."""
    for name, cname in (("ef", "topk"), ("ef21", "topk"), ("diana", "randk")):
        c = sc.compressors.get(cname, ratio=0.25)
        a, b = Worker(sc.methods.get(name, compressor=c)), Worker(sc.methods.get(name, compressor=c))
        ga, gb = _gens(c, 1)[0], _gens(c, 1)[0]
        out = torch.empty(D, dtype=torch.float64)
        for t in range(5):
            g = _grads(1, seed=t)[0]
            pa = a.encode(g, 0, ga)
            scratch = g.clone()
            pb = b.encode(scratch, 0, gb, inplace=True)
            assert torch.equal(pa.to_dense(), pb.to_dense())
            ea = a.decode(pa.to_dense(), 1, 0)
            eb = b.decode(pb.to_dense(), 1, 0, out=out)
            assert eb is out and torch.equal(ea, eb)
            st = b.state(0)
            for f in ("error", "g_local", "g_global", "h_local", "h_global"):
                if hasattr(st, f):
                    assert getattr(st, f).data_ptr() != out.data_ptr()


# ------------------------------------------------------------------ explicit state, typed factories (#16)
def test_typed_factories_match_the_catalog():
    """``sc.methods.<name>(...)`` builds what ``sc.methods.get(name, ...)`` builds, for every name."""
    rk = sc.compressors.get("randk", ratio=0.1)
    pairs = [(sc.methods.diana(rk, alpha=0.5), sc.methods.get("diana", compressor=rk, alpha=0.5)),
             (sc.methods.ef(sc.compressors.topk(ratio=0.1)), sc.methods.get("ef", compressor="topk", ratio=0.1)),
             (sc.methods.ef21(init="zeros"), sc.methods.get("ef21", init="zeros")),
             (sc.methods.none(), sc.methods.get("none")),
             (sc.methods.dgc(0.05), sc.methods.get("dgc", ratio=0.05)),
             (sc.methods.powersgd(2), sc.methods.get("powersgd", matrix_approximation_rank=2)),
             (sc.methods.signsgd(), sc.methods.get("signsgd")),
             (sc.methods.signum(0.5), sc.methods.get("signum", beta=0.5)),
             (sc.methods.onebit(16), sc.methods.get("onebit", bucket_size=16))]
    assert sorted(a.name for a, _ in pairs) == sc.methods.available()
    for a, b in pairs:
        assert type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize("name,hyper", [("diana", {"ratio": 0.2}), ("ef", {"ratio": 0.2}),
                                        ("ef21", {"ratio": 0.2}), ("onebit", {"bucket_size": 8}),
                                        ("powersgd", {"matrix_approximation_rank": 1})])
def test_the_state_holds_everything(name, hyper):
    """One method object, two explicit states (two workers): ``encode``/``next_round``/``decode`` on
    states give bit-identically what two method objects, one per worker, give; the method object keeps
    nothing (no tensor among its attributes), and a state copied between rounds resumes exactly."""
    import copy

    m = sc.methods.get(name, **hyper)
    own = [sc.methods.get(name, **hyper) for _ in range(2)]
    sts = [m.init(48) for _ in range(2)]
    osts = [o.init(48) for o in own]
    g = torch.Generator().manual_seed(0)
    shapes = [torch.Size([6, 8])]
    for t in range(4):
        G = torch.randn(2, 48, generator=g)
        seeds = [torch.Generator().manual_seed(100 * t + i % 2) for i in range(4)]
        pays, opays = [], []
        for i in range(2):
            p, sts[i] = m.encode(G[i], sts[i], seeds[i], shapes=shapes)
            pays.append(p)
            p, osts[i] = own[i].encode(G[i], osts[i], seeds[2 + i], shapes=shapes)
            opays.append(p)
        agg, oagg = sum(p.to_dense() for p in pays), sum(p.to_dense() for p in opays)
        assert torch.equal(agg, oagg)
        while True:
            nxt, onxt = [], []
            for i in range(2):
                q, sts[i] = m.next_round(agg, 2, sts[i])
                nxt.append(q)
                q, osts[i] = own[i].next_round(oagg, 2, osts[i])
                onxt.append(q)
            if nxt[0] is None:
                assert onxt[0] is None
                break
            agg, oagg = sum(p.to_dense() for p in nxt), sum(p.to_dense() for p in onxt)
        if t == 1:      # a checkpoint is the states: a deep copy resumes exactly
            sts = [copy.deepcopy(s) for s in sts]
        for i in range(2):
            est, sts[i] = m.decode(agg, 2, sts[i])
            oest, osts[i] = own[i].decode(oagg, 2, osts[i])
            assert torch.equal(est, oest)
    assert not [k for k, v in vars(m).items() if isinstance(v, (torch.Tensor, dict))]


def test_init_builds_the_typed_state():
    """``init(d, dtype, device)`` builds the typed state before any round, in the bucket's dtype."""
    st = sc.methods.diana(sc.compressors.randk(ratio=0.5)).init(10, torch.float64)
    assert st.state.h_local.shape == (10,) and st.state.h_local.dtype == torch.float64 and not st.started
    assert sc.methods.none().init(10).state is None


def test_warmup_wrapper_composes_and_resumes():
    """``sc.methods.warmup(m, k)``: the first k rounds of every state are exact (dense, the identity),
    later ones compressed; the count lives in the state, so a state saved after round 1 and loaded into
    a fresh wrapper continues with one exact round then compressed ones, as the uninterrupted run."""
    def run(split):
        m = sc.methods.warmup(sc.methods.ef21(sc.compressors.get("topk", ratio=0.25)), 2)
        st = m.init(16)
        kinds, ests = [], []
        for t in range(4):
            if split and t == 1:
                m = sc.methods.warmup(sc.methods.ef21(sc.compressors.get("topk", ratio=0.25)), 2)
                st = states_from_dict(m, states_to_dict(m, {0: st}))[0]
            g = torch.randn(16, generator=torch.Generator().manual_seed(t))
            p, st = m.encode(g, st, None)
            kinds.append(p.kind)
            e, st = m.decode(p.to_dense(), 1, st)
            ests.append(e)
        return kinds, ests

    kinds, ests = run(False)
    assert kinds == ["dense", "dense", "sparse", "sparse"]
    kinds2, ests2 = run(True)
    assert kinds2 == kinds and all(torch.equal(a, b) for a, b in zip(ests, ests2))
    assert sc.methods.warmup(sc.methods.none(), 0).name == "none"


def _storages(obj) -> set[int]:
    from dataclasses import fields, is_dataclass

    out = set()
    for f in fields(obj) if is_dataclass(obj) else ():
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor) and v.numel():
            out.add(v.untyped_storage().data_ptr())
    return out


@pytest.mark.parametrize("name", sc.methods.available())
def test_no_payload_aliases_the_method_state(name):
    """Every round's payload of every method, exact rounds included, shares no storage with the method's
    state (it may alias the scratch gradient with ``inplace=True``): whatever a transport or a caller
    does with a payload cannot corrupt the state."""
    hyper = {"ratio": 0.25} if name in ("diana", "ef", "ef21", "dgc") else {}
    m = sc.methods.warmup(sc.methods.get(name, **hyper), 1)
    st = m.init(48)
    g = torch.Generator().manual_seed(0)
    for t in range(4):
        grad = torch.randn(48, generator=g)
        p, st = m.encode(grad, st, torch.Generator().manual_seed(t), inplace=True, shapes=[torch.Size([6, 8])])
        agg = p.to_dense()
        while p is not None:
            for v in (p.values, p.indices, p.scale):
                if isinstance(v, torch.Tensor) and v.numel():
                    assert v.untyped_storage().data_ptr() not in _storages(st.state), (name, t)
            p, st = m.next_round(agg, 1, st)
            if p is not None:
                agg = p.to_dense()
        _, st = m.decode(agg, 1, st)


@pytest.mark.parametrize("name", ["ef", "ef21", "diana"])
def test_a_method_that_checks_its_input_leaves_out_the_compressors_own_pass_with_the_same_payload(name, monkeypatch):
    """EF forms g + e and checks it in one pass (``checks_input``); top-k's own finiteness pass over the same
    input (``compress``) is left out (``compress_finite``), with the same payload and state; ``compress`` called
    alone still checks. (EF21 and DIANA check after their subtraction; DIANA's rand-k makes no pass of its own.)"""
    import importlib

    from sparsecomm.errors import NonFiniteError

    topk_mod = importlib.import_module("sparsecomm.compressors.topk")     # (the package's ``topk`` is the factory)

    comp = sc.compressors.get("randk" if name == "diana" else "topk", k=50)
    method = sc.methods.get(name, compressor=comp)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    checks = []
    real = topk_mod._check_finite
    monkeypatch.setattr(topk_mod, "_check_finite", lambda a, who: (checks.append(who), real(a, who))[1])

    def run():
        st, out = method.init(1000), []
        for i, x in enumerate(grads):
            p, st = method.encode(x, st, torch.Generator().manual_seed(i), world_size=1)
            out.append((p.values.clone(), None if p.indices is None else p.indices.clone()))
            method.decode(p.to_dense(), 1, st)
        return out, [t.clone() for t in vars(st.state).values() if isinstance(t, torch.Tensor)]

    checked, fields_checked = run()
    assert checks == []                     # the method's pass stood for the compressor's
    monkeypatch.setattr(type(comp), "compress_finite", lambda self, x, generator=None: self.compress(x, generator))
    full, fields_full = run()           # what compress itself gives: the same bits
    for (v1, i1), (v2, i2) in zip(checked, full):
        assert torch.equal(v1, v2) and (i1 is None or torch.equal(i1, i2))
    assert all(torch.equal(a, b) for a, b in zip(fields_checked, fields_full))
    if name != "diana":
        assert checks and set(checks) == {"topk"}       # (EF21's first round is exact: no compress)
        with pytest.raises(NonFiniteError):
            comp.compress(torch.tensor([1.0, float("inf")] * 500))
