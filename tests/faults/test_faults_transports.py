"""Inputs and settings every transport must handle alike, on real gloo processes: every rank gets the same
outcome (the library's error class, or the sum) within ``BOUND`` seconds under a ``TIMEOUT`` fabric timeout,
and the transport stays usable after a refused call.

- A ``torch.bool`` tensor: :class:`UnsupportedDtypeError` (an ``InvalidTypeError``) on every transport, never
  a logical or (``True`` where the sum is 3): the result has the input's dtype, which cannot hold a count.
- A tensor that requires grad: summed like any other (``native`` too), and the next call is fine.
- ``transport="auto"`` with only the ``switch`` service: ``sparse-switch`` is no candidate (its program
  does not run), so the exploration never calls it.
- A fabric over a process group built by the optimizer: bounded by the launch's ``timeout_s``, not 120 s.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import InvalidTypeError

from tests._faults_common import cap_address_space, outcome

pytestmark = pytest.mark.multiprocess

TIMEOUT = 30.0
BOUND = 5.0       # seconds: every rank must have its outcome well within this (vs TIMEOUT)
ALL = ("ring", "allgather", "native", "omnireduce", "switch", "sparse-switch")


def _kw(name: str) -> dict:
    return {"block_size": 16, "lanes": 8} if name == "omnireduce" else {"pool_size": 4} if "switch" in name else {}


# ----------------------------------------------------------------------------- bool tensors
def _bools(ctx):
    cap_address_space()
    torch.set_num_threads(1)
    out = {}
    for name in ALL:
        t = sc.transports.get(name, ctx.fabric, **_kw(name))
        x = torch.ones(40, dtype=torch.bool)            # three workers: the sum is 3 everywhere
        refused = outcome(lambda: t.allreduce(x))
        asynchronous = outcome(lambda: t.start(x).wait())
        good = t.allreduce(torch.ones(40, dtype=torch.int32))
        out[name] = (refused, asynchronous, good.tolist())
    return out


def test_bool_tensors_are_refused_by_every_transport_on_every_rank_and_the_transport_stays_usable():
    res = sc.launch(_bools, 3, backend="gloo", timeout_s=TIMEOUT, services=["switch", "sparse-switch"])
    for rank in res:
        for name in ALL:
            refused, asynchronous, good = rank[name]
            for kind, msg, secs in (refused, asynchronous):
                assert kind == "UnsupportedDtypeError" and secs < BOUND, (name, kind, msg, secs)
                assert f"transport {name!r} cannot sum torch.bool" in msg and "x.to(torch.int32)" in msg, msg
            assert good == [3] * 40, (name, good)
    assert issubclass(sc.errors.UnsupportedDtypeError, InvalidTypeError)
    assert issubclass(sc.errors.UnsupportedDtypeError, sc.errors.IncompatibleError)   # as before for the others


# ----------------------------------------------------------------------------- tensors that require grad
def _grads(ctx):
    cap_address_space()
    torch.set_num_threads(1)
    out = {}
    for name in ("native", "ring", "allgather"):
        t = sc.transports.get(name, ctx.fabric)
        x = torch.full((300,), ctx.rank + 1.0, requires_grad=True)
        # repeated calls: native's later ones are predicted and posted at once (its folded path)
        sums = [outcome(lambda: out.setdefault(name, []).append(t.allreduce(x)))]
        sums += [outcome(lambda: out[name].append(t.start(x).wait())) for _ in range(3)]
        sums.append(outcome(lambda: out[name].append(t.allreduce(torch.ones(7)))))
        out[name] = ([s[0] for s in sums], [v.tolist() for v in out[name]], max(s[2] for s in sums),
                     x.grad is None and torch.equal(x.detach(), torch.full((300,), ctx.rank + 1.0)))
    return out


def test_a_tensor_that_requires_grad_is_summed_by_native_as_by_the_others_and_the_next_call_is_fine():
    res = sc.launch(_grads, 3, backend="gloo", timeout_s=TIMEOUT)
    for rank in res:
        for name, (errors, values, secs, untouched) in rank.items():
            assert errors == [None] * 5, (name, errors)
            assert values == [[6.0] * 300] * 4 + [[3.0] * 7], name
            assert secs < BOUND and untouched, name


# ----------------------------------------------------------------------------- auto with one switch program
def _auto(ctx):
    from sparsecomm.pipeline import CommPipeline

    cap_address_space()
    torch.set_num_threads(1)
    pipe = CommPipeline("none", "auto", transport_kwargs={"estimate_steps": 1, "period": 2})
    x = torch.zeros(64 * 256)
    x[: 256 * (ctx.rank + 1)] = 1.0
    sums = []
    for _ in range(9):       # the exploration of every candidate, then decisions
        pipe.begin_step()
        sums.append(outcome(lambda: pipe.reduce(x.clone(), 0)))
    return [s[0] for s in sums], [sorted(r["predicted_s"]) for r in pipe.stats.decisions]


def test_auto_with_only_the_switch_service_never_runs_the_sparse_switch():
    res = sc.launch(_auto, 2, backend="gloo", timeout_s=TIMEOUT, services=["switch"])
    for errors, decided in res:
        assert errors == [None] * 9, errors
        assert decided and all("switch" in c and "sparse-switch" not in c for c in decided), decided


# ----------------------------------------------------------------------------- a process group's own fabric
SHORT = 10.0     # the launch's timeout here (room for a loaded machine): the group's fabric waits that long, not 120 s


def _group(ctx):
    cap_address_space()
    torch.set_num_threads(1)
    pg = dist.new_group([0, 1, 2])      # a group of its own (not the launch's workers' group)
    model = torch.nn.Linear(4, 1)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), transport="ring",
                                  process_group=pg, verify_replicas_every=0)
    bound = opt.fabric.timeout_s
    if ctx.rank == 2:                   # stops calling: the others wait for its gradients
        return bound, None
    model(torch.ones(2, 4)).sum().backward()
    return bound, outcome(opt.step)


def test_an_optimizer_over_a_process_group_waits_the_launch_timeout_not_its_own():
    res = sc.launch(_group, 3, backend="gloo", timeout_s=SHORT)
    assert [bound for bound, _ in res] == [SHORT] * 3, res
    for kind, msg, secs in [o for _, o in res[:2]]:
        # the survivors stop at the launch's timeout (120 s before), one of them naming the rank that stopped
        assert kind in ("FabricTimeout", "PeerFailure") and SHORT - 0.5 < secs < SHORT + BOUND, (kind, msg, secs)
    assert any("worker 2" in o[1] for _, o in res[:2]), res
