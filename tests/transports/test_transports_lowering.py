"""One lowering of payloads (``sparsecomm/transports/linear.py``): the base class turns ``aligned``,
shared-scale ``quantized`` (and, for the dense baselines and OmniReduce, ``dense``) payloads into linear
operands, so every transport that sums them in compressed form gets the same vector, the same finish
and the same agreement words."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError
from sparsecomm.payload import Payload
from sparsecomm.transports import registry
from sparsecomm.transports.linear import linear_operand

#: transports that sum payloads in compressed form on the SimFabric, with settings that keep the test small
SUMMING = {"ring": {}, "omnireduce": {"block_size": 64}, "switch": {"pool_size": 8},
           "sparse-switch": {"pool_size": 8, "slot_elems": 64}}


def test_every_transport_that_sums_aligned_or_quantized_payloads_takes_them_from_the_base_class():
    for name in sc.transports.available():
        cls = registry.product(name)
        if name == "allgather":          # gathers payloads as they are: nothing to lower
            continue
        for kind in ("aligned", "quantized"):
            if kind in cls.carries:
                assert kind in cls.linear, f"{name} carries {kind} but does not declare it in linear"


def _payloads(seed: int) -> dict[str, Payload]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(500, generator=torch.Generator().manual_seed(3))[:90]
    return {
        "dense16": Payload("dense", torch.randn(500, generator=g).half(), (500,), torch.float32),
        "aligned": Payload("aligned", torch.randn(90, generator=g, dtype=torch.float64), (500,), torch.float64,
                           indices=idx),
        "quantized": Payload("quantized", torch.randint(-9, 10, (500,), generator=g, dtype=torch.int8), (500,),
                             torch.float32, scale=torch.tensor([0.5, 0.25]), bucket_size=250, shared_scale=True),
    }


@pytest.mark.parametrize("kind", ["dense16", "aligned", "quantized"])
def test_an_operand_finished_on_its_own_vector_is_the_payloads_dense_value(kind):
    p = _payloads(0)[kind]
    op = linear_operand(p, "ring")
    assert torch.equal(op.finish(op.vector.clone()), p.to_dense())
    assert op.dtype == p.dtype and op.kind == ("dense" if kind == "dense16" else kind)


def test_the_agreement_word_changes_with_the_shared_indices_the_scale_and_the_bucket():
    p = _payloads(0)
    a, q = p["aligned"], p["quantized"]
    same = linear_operand(a, "x").check
    assert same == linear_operand(Payload("aligned", a.values * 2, a.shape, a.dtype, indices=a.indices), "x").check
    assert same != linear_operand(Payload("aligned", a.values, a.shape, a.dtype, indices=a.indices + 1), "x").check
    base = linear_operand(q, "x").check
    other_scale = Payload("quantized", q.values, q.shape, q.dtype, scale=q.scale * 2, bucket_size=250,
                          shared_scale=True)
    other_bucket = Payload("quantized", q.values, q.shape, q.dtype, scale=q.scale, bucket_size=125,
                           shared_scale=True)
    assert base != linear_operand(other_scale, "x").check and base != linear_operand(other_bucket, "x").check
    assert linear_operand(p["dense16"], "x").check == 0


def test_float_codes_holding_integers_are_summed_as_the_integer_codes_by_every_summing_transport():
    """One rule for quantized codes, on every transport: integers, or floats that hold integers (summed as
    int64); any other float code is an IncompatibleError naming the transport."""

    def fn(ctx):
        out = {}
        for name, kw in SUMMING.items():
            t = sc.transports.get(name, ctx.fabric, **kw)
            q = _payloads(ctx.rank)["quantized"]
            as_float = Payload("quantized", q.values.to(torch.float32), q.shape, q.dtype, scale=q.scale,
                               bucket_size=q.bucket_size, shared_scale=True)
            out[name] = (t.allreduce(q), t.allreduce(as_float))
            bad = Payload("quantized", q.values.to(torch.float32) + 0.5, q.shape, q.dtype, scale=q.scale,
                          bucket_size=q.bucket_size, shared_scale=True)
            try:
                t.allreduce(bad)
                out[name + " bad"] = "summed"
            except IncompatibleError as e:
                out[name + " bad"] = str(e)
        return out

    want = sum(_payloads(r)["quantized"].to_dense().double() for r in range(3))
    for res in sc.launch(fn, 3, backend="sim"):
        for name in SUMMING:
            ints, floats = res[name]
            assert torch.equal(ints, floats), name
            assert torch.allclose(ints.double(), want, rtol=0, atol=1e-6), name
            assert f"transport {name!r}" in res[name + " bad"] and "not integers" in res[name + " bad"]
