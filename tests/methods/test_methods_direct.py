"""The direct calls of the pipeline's chained rounds (``Method.encode_direct`` / ``decode_direct``) and the
layout a PowerSGD bucket keeps from step to step (``StateStore.bind``): the same numbers and state as the
checked calls, bit for bit, and nothing kept past a change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError, SparseCommError
from sparsecomm.methods.base import Method
from sparsecomm.methods.none import NoMethod
from sparsecomm.pipeline.states import StateStore


class _Generic(NoMethod):
    """``none`` through the base class's direct calls (``_encode`` / ``_decode_finite``)."""

    name = "none-generic"
    encode_direct = Method.encode_direct
    decode_direct = Method.decode_direct


def _fields(ms):
    return {f.name: getattr(ms, f.name) for f in dataclasses.fields(ms)}


def _same_payload(a, b):
    assert (a.kind, a.shape, a.dtype, a.bits, a.meta, a.values_codec) == (b.kind, b.shape, b.dtype, b.bits, b.meta,
                                                                            b.values_codec)
    assert a.values.dtype == b.values.dtype and torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


@pytest.mark.parametrize("cls", [NoMethod, _Generic])
@pytest.mark.parametrize("cname", ["fp16", "bf16"])
def test_direct_calls_are_the_checked_calls(cls, cname):
    m = cls(cname)
    g = torch.Generator().manual_seed(3)
    for d in (1, 1000, 4099):
        x = torch.randn(d, generator=g) * 3
        x[: d // 7] *= 1e-9             # some underflow (counted in the payload's meta)
        ms_a, ms_b = m.init(d), m.init(d)
        ms_a.rounds = ms_b.rounds = 5
        pa, _ = m.encode(x.clone(), ms_a, None, world_size=3, inplace=True)
        pb = m.encode_direct(x.clone(), ms_b, None, 3)
        _same_payload(pa, pb)
        assert _fields(ms_a) == _fields(ms_b)
        agg = (pa.values.to(torch.float32) * 3).to(pa.values.dtype)
        for bad in (False, True):
            if bad:
                agg[d // 2] = float("inf")
            ms_a.pending = ms_b.pending = False
            out_a, out_b = torch.empty(d), torch.empty(d)
            est, _, ok_a = m.decode_finite(agg.clone(), 3, ms_a, out=out_a)
            ok_b = m.decode_direct(agg.clone(), 3, ms_b, out_b)
            assert ok_a == ok_b == (not bad)
            assert torch.equal(est.view(torch.int32), out_b.view(torch.int32))
            assert _fields(ms_a) == _fields(ms_b)


def test_decode_direct_without_an_encode_raises():
    m = NoMethod("fp16")
    with pytest.raises(SparseCommError, match="decode without a preceding encode"):
        m.decode_direct(torch.zeros(4, dtype=torch.float16), 2, m.init(4), torch.empty(4))


@pytest.mark.parametrize("cls", [NoMethod, _Generic])
def test_encode_direct_of_a_nonfinite_input_raises_and_leaves_the_state_as_encode_does(cls):
    m = cls("fp16")
    x = torch.ones(8)
    x[3] = float("nan")
    states = []
    for call in (lambda ms: m.encode(x.clone(), ms, None, world_size=2, inplace=True),
                 lambda ms: m.encode_direct(x.clone(), ms, None, 2)):
        ms = m.init(8)
        ms.rounds = 2
        with pytest.raises(NonFiniteError):
            call(ms)
        states.append(_fields(ms))
    assert states[0] == states[1] and states[0]["rounds"] == 2 and not states[0]["started"]


def _bucket(names_shapes):
    segs = tuple((n, int(torch.Size(s).numel())) for n, s in names_shapes)
    return segs, tuple(torch.Size(s) for _, s in names_shapes)


def test_bind_keeps_nothing_past_a_restore_onto_another_layout():
    """A bind that returns at once (the same tuples as a current one, nothing replaced since) keeps the state;
    after load_state_dict of another layout the same bind reassembles the state from the restored pieces."""
    m = sc.methods.get("powersgd", matrix_approximation_rank=1, start_powerSGD_iter=1)
    shapes = [("a", (6, 4)), ("b", (5, 3)), ("c", (4, 4))]
    segs, shp = _bucket(shapes)
    d = sum(k for _, k in segs)
    gen = torch.Generator().manual_seed(0)

    def run_round(store, key, segs, shp, x):
        store.bind(key, segs, shp)
        ms = store.get(key, x, 0)
        p, _ = m.encode(x.clone(), ms, gen, world_size=1, inplace=True, shapes=shp)
        while (nxt := m.next_round(p.to_dense(), 1, ms)[0]) is not None:
            p = nxt
        m.decode(p.to_dense(), 1, ms)

    store = StateStore(m)
    for _ in range(3):
        run_round(store, "k", segs, shp, torch.randn(d, generator=gen))
    held = store.by_key["k"]
    assert store.state("k") is not None and store.state("k").q is not None
    store.bind("k", segs, shp)                  # (the same tuples: kept)
    assert store.by_key["k"] is held
    # another bucket takes parameter a (its piece of k's state) while k keeps the same state object: the same
    # bind of k is not current any more and takes a back, reassembled
    copy = StateStore(m)
    copy.load_state_dict(store.state_dict())
    (sa, ha) = _bucket(shapes[:1])
    store.bind("ka", sa, ha)
    assert store.by_key["k"] is held and store.state("ka") is not None
    store.bind("k", segs, shp)
    assert store.by_key["k"] is not held and "ka" not in store.by_key
    assert torch.equal(store.state("k").q, copy.state("k").q)
    assert torch.equal(store.state("k").error, copy.state("k").error)
    held = store.by_key["k"]
    # the pieces on another layout: (a) and (b, c)
    other = StateStore(m)
    other.load_state_dict(store.state_dict())
    (sa, ha), (sbc, hbc) = _bucket(shapes[:1]), _bucket(shapes[1:])
    other.bind("ka", sa, ha)
    other.bind("kbc", sbc, hbc)
    for key, s_, h_ in (("ka", sa, ha), ("kbc", sbc, hbc)):
        n = sum(k for _, k in s_)
        run_round(other, key, s_, h_, torch.randn(n, generator=gen))
    q = torch.cat([other.state("ka").q, other.state("kbc").q])
    error = torch.cat([other.state("ka").error, other.state("kbc").error])
    # restored onto the first store, whose last bind of "k" was current with these very tuples: reassembled
    store.load_state_dict(other.state_dict())
    store.bind("k", segs, shp)
    assert store.by_key["k"] is not held
    assert torch.equal(store.state("k").q, q) and torch.equal(store.state("k").error, error)
    # and a reset forgets it: the same bind leaves no state behind
    store.reset()
    store.bind("k", segs, shp)
    assert store.state("k") is None
