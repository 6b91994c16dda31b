"""The methods that bring their own operator, by name: accepted by the optimizer's builders, and carried by exactly the
transports of the table in docs/transports.md (every rank gets the same estimate)."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError
from sparsecomm.pipeline import CommPipeline
from tests._keyed import Worker

TRANSPORTS = ("ring", "allgather", "omnireduce", "switch", "sparse-switch")
TABLE = {"powersgd": TRANSPORTS, "signsgd": TRANSPORTS, "signum": TRANSPORTS,
         "onebit": ("allgather",), "dgc": ("allgather", "omnireduce", "sparse-switch")}


def _reduce(ctx, name, transport):
    try:
        pipe = CommPipeline(name, transport, fabric=ctx.fabric, **({"ratio": 0.1} if name == "dgc" else {}))
    except IncompatibleError as e:
        return str(e)
    x = torch.randn(300, generator=torch.Generator().manual_seed(ctx.rank))
    return [pipe.reduce(x.clone(), 0, shapes=[(20, 15)]).clone() for _ in range(2)]


def test_registered():
    assert set(TABLE) <= set(sc.methods.available())


@pytest.mark.parametrize("name", sorted(TABLE))
def test_carried_by_the_transports_of_the_table(name):
    for transport in TRANSPORTS:
        r0, r1 = sc.launch(functools.partial(_reduce, name=name, transport=transport), world_size=2, backend="sim")
        if transport in TABLE[name]:
            assert isinstance(r0, list) and all(torch.equal(a, b) for a, b in zip(r0, r1))
        else:
            assert isinstance(r0, str) and transport in r0 and TABLE[name][0] in r0   # names the alternative


def test_unknown_hyper_parameter_names_the_methods_own():
    from sparsecomm.errors import HyperParameterError
    from sparsecomm.methods import build as build_method

    with pytest.raises(HyperParameterError, match="rank"):
        build_method("powersgd", ratio=0.1)
    assert build_method("dgc", ratio=0.01).hyper()["ratio"] == 0.01


@pytest.mark.parametrize("name", sorted(TABLE))
def test_non_finite_gradient_raises_clearly(name):
    from sparsecomm.errors import NonFiniteError

    m = Worker(sc.methods.get(name))
    x = torch.ones(64)
    x[7] = float("nan")
    with pytest.raises(NonFiniteError):
        m.encode(x, 0, torch.Generator(), shapes=[(8, 8)])
    x[7] = float("inf")
    with pytest.raises(NonFiniteError):
        Worker(sc.methods.get(name)).encode(x, 0, torch.Generator(), shapes=[(8, 8)])


def _alone(m, x, seed):
    """One step of a single worker (n = 1) through every round; returns the estimate."""
    agg = m.encode(x.clone(), 0, torch.Generator().manual_seed(seed), shapes=[(8, 8)]).to_dense()
    while (nxt := m.next_round(agg, 1, 0)) is not None:
        agg = nxt.to_dense()
    return m.decode(agg, 1, 0)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_state_dict_round_trip_continues_identically(name):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(64, generator=g) for _ in range(4)]
    a = Worker(sc.methods.get(name))
    for t in range(2):
        _alone(a, xs[t], t)
    b = Worker(sc.methods.get(name))
    b.load_state_dict(a.state_dict())
    for t in (2, 3):
        assert torch.equal(_alone(a, xs[t], t), _alone(b, xs[t], t))


@pytest.mark.parametrize("name", ["powersgd", "dgc"])
def test_random_methods_never_fall_back_to_the_global_rng(name):
    from sparsecomm.compressors._common import GeneratorRequiredError

    with pytest.raises(GeneratorRequiredError):
        Worker(sc.methods.get(name)).encode(torch.randn(100_000), 0, None, shapes=[(400, 250)])


@pytest.mark.parametrize("name", sorted(TABLE))
def test_methods_with_their_own_operator_refuse_a_compressor(name):
    from sparsecomm.errors import HyperParameterError
    from sparsecomm.methods import build as build_method

    with pytest.raises(HyperParameterError, match=f"compressor='{name}'"):
        build_method("topk", method=name, ratio=0.1)
    with pytest.raises(HyperParameterError, match="own operator"):
        build_method(sc.compressors.get("sign"), method=name)


@pytest.mark.parametrize("name", ["powersgd", "onebit"])
def test_decode_before_the_last_round_raises(name):
    from sparsecomm.errors import SparseCommError

    m = Worker(sc.methods.get(name))
    agg = m.encode(torch.randn(64), 0, torch.Generator(), shapes=[(8, 8)]).to_dense()
    with pytest.raises(SparseCommError, match="next_round"):
        m.decode(agg, 1, 0)


def test_algorithms_runner_takes_every_round():
    """algorithms/base.py's in-process runner follows the contract: onebit's two rounds give the mean
    of the workers' two-level reconstructions, and both rounds' bits are counted."""
    import algorithms.base as ab

    class Stub:                         # the few attributes run_methods reads
        n, bits_sent = 3, 0

        def generators(self):
            return [torch.Generator().manual_seed(0) for _ in range(3)]

        def payload_bits(self, p):
            return int(p.bits)

    m = sc.methods.get("onebit", bucket_size=16)    # one method, one explicit state per worker
    G = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stub = Stub()
    stub.states = [m.init(64, torch.float64) for _ in range(3)]
    est = ab.CompressedOptimizer.run_methods(stub, m, G)
    local = [G[i] - stub.states[i].state.error for i in range(3)]
    torch.testing.assert_close(est, sum(local) / 3, rtol=0, atol=1e-12)
    assert stub.bits_sent == 3 * th_bits(64, 16)


def th_bits(d, b):
    from theory import compressors as th

    return th.onebit_bits(d, b, 64, 2)


def _opt_worker(ctx, name):
    model = torch.nn.Linear(12, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), compressor=name)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 12, generator=g)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.transport.name, opt.compression_stats()["rounds"]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_distributed_optimizer_takes_the_name(name):
    (p0, t, rounds), (p1, _, _) = sc.launch(functools.partial(_opt_worker, name=name), world_size=2, backend="sim")
    assert t in TABLE[name]                                     # "auto" picked a carrier of the table
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert rounds >= 3
