"""The DDP hook's lanes (:mod:`sparsecomm.pipeline.lanes`): the same bits and records as one lane, outcomes
decided in call order across the lanes, the option's rule and checks."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.errors import InvalidValueError, NonFiniteError, ProtocolError
from sparsecomm.fabric.engine import CommWork
from sparsecomm.pipeline.lanes import CallOrder

from tests._faults_common import outcome

TIMEOUT = 60.0
BOUND = 10.0
STEPS = 7


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), *[m for _ in range(5) for m in (nn.ReLU(), nn.Linear(256, 256))],
                         nn.ReLU(), nn.Linear(256, 10))


def train_step(ctx, ddp, opt, t: int) -> None:
    """Step ``t`` of ``ddp`` (a 64-input, 10-class net) on this worker's batch ``t`` (seeded by rank and step)."""
    g = torch.Generator().manual_seed(100 * ctx.rank + t)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _train(ctx, transport: str, lanes, compressor: str = "none", steps: int = STEPS):
    hyper = {"method": "ef", "ratio": 0.1} if compressor == "topk" else {}
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)      # 6 buckets after the rebuild
    state = sc.ddp.register(ddp, transport=transport, lanes=lanes, compressor=compressor, fuse=False, **hyper)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    per_step = []
    for t in range(steps):
        train_step(ctx, ddp, opt, t)
        s = state.last_stats
        per_step.append((s.bytes_sent, s.bytes_received, s.messages))
    stats = state.compression_stats()
    return {"params": [p.detach().clone() for p in net.parameters()], "lanes": state.lane_count,
            "per_step": per_step, "steps": state.steps,
            "stats": {k: stats[k] for k in ("bytes_dense", "bytes_payload", "bytes_declared_sent", "rounds")},
            "state": state.state_dict()["pipeline"]["step"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("transport, compressor", [("omnireduce", "none"), ("ring", "none"),
                                                   ("allgather", "topk"), ("omnireduce", "topk")])
def test_lanes_give_the_bits_and_records_of_one_lane(transport, compressor, n):
    run = functools.partial(_train, transport=transport, compressor=compressor)
    one = sc.launch(functools.partial(run, lanes=1), n, backend="gloo", timeout_s=TIMEOUT)
    two = sc.launch(functools.partial(run, lanes=None), n, backend="gloo", timeout_s=TIMEOUT)
    for a, b in zip(one, two):
        assert a["lanes"] == 1 and b["lanes"] == 2
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        declared = a["stats"].pop("bytes_declared_sent"), b["stats"].pop("bytes_declared_sent")
        assert declared[0] == pytest.approx(declared[1], rel=1e-12)      # (floats added in another order)
        assert a["stats"] == b["stats"] and a["steps"] == b["steps"] == STEPS and a["state"] == b["state"]
        # each lane predicts its own calls (transports/_fold.py): the handshakes fold one step later on
        # lanes; from then on every step sends the same bytes and messages
        assert a["per_step"][:2] == b["per_step"][:2] and a["per_step"][-2:] == b["per_step"][-2:]
    assert all(torch.equal(x, y) for rk in two for x, y in zip(rk["params"], two[0]["params"]))


# ------------------------------------------------------------------------------- the rule and its checks
def _rule(ctx):
    out = {}
    net = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.05)
    state = functools.partial(sc.ddp.CommHookState, None, model=net)
    out["omnireduce"] = state(transport="omnireduce", fuse=False).lane_count
    out["omnireduce topk"] = state(transport="omnireduce", method="ef", compressor="topk", ratio=0.1).lane_count
    out["fused"] = state(transport="omnireduce").lane_count        # (plain averaging: one call a step)
    out["native"] = state(transport="native").lane_count
    small = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    out["one bucket"] = sc.ddp.CommHookState(None, transport="ring", model=small, fuse=False).lane_count
    out["three"] = state(transport="ring", lanes=3).lane_count
    out["refused"] = outcome(lambda: state(transport="native", lanes=2))[:2]
    return out


@pytest.mark.multiprocess
def test_the_default_rule_and_an_explicit_number_of_lanes():
    for rk in sc.launch(_rule, 2, backend="gloo", timeout_s=TIMEOUT):
        assert rk["omnireduce"] == rk["omnireduce topk"] == 2 and rk["fused"] == 1
        assert rk["native"] == 1 and rk["one bucket"] == 1 and rk["three"] == 3
        cls, text = rk["refused"]
        assert cls == "IncompatibleError" and "'native' keeps one lane" in text and "lanes=1" in text, text


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_number_of_lanes_is_refused_before_any_communication(bad):
    with pytest.raises(InvalidValueError, match="lanes must be None"):
        sc.ddp.CommHookState(None, lanes=bad)


def _disagree(ctx):
    net = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.05)
    return outcome(lambda: sc.ddp.CommHookState(None, transport="ring", model=net, lanes=1 + ctx.rank))[:2]


@pytest.mark.multiprocess
def test_workers_that_ask_for_different_lanes_are_a_mismatch_on_every_worker():
    for cls, text in sc.launch(_disagree, 2, backend="gloo", timeout_s=TIMEOUT):
        assert cls == "MismatchError" and "lanes is 1 on worker 0 and 2 on worker 1" in text, text


# ------------------------------------------------------------------------------- outcomes in call order
def test_call_order_decides_outcomes_in_call_order_whatever_the_completion_order():
    order = CallOrder()
    inner = [CommWork() for _ in range(5)]
    outer = [order.add(w) for w in inner]
    inner[1].complete(value="b")                         # done before call 0: held
    assert not outer[1].is_completed()
    inner[3].complete(value="d")
    inner[0].complete(exc=NonFiniteError("nan"))          # every worker raises it after the same sum: not spread
    assert isinstance(outer[0].exception(), NonFiniteError) and outer[1].wait() == "b"
    assert not outer[3].is_completed()
    err = ProtocolError("call 2 failed")
    inner[2].complete(exc=err)
    assert outer[2].exception() is err and outer[3].exception() is err     # call 3 completed first: fails too
    inner[4].complete(value="e")
    assert outer[4].exception() is err


def _lane_fault(ctx, fault_lane: int):
    """Two buckets a step (bucket k on lane k mod 2), through the hook's body; at step 3 the call on
    ``fault_lane`` raises on every worker alike, then a fourth step's calls are made on both lanes."""
    state = sc.ddp.CommHookState(None, transport="ring", lanes=2, verify_replicas_every=0)
    assert state.lane_count == 2
    fail_at_step(state.pipeline.lane_transport(fault_lane), 3, f"injected on lane {fault_lane}")
    got = []
    for step in range(4):
        works = [state.start_bucket(torch.full((50_000 - 40_000 * k,), float(ctx.rank + k)), k, k == 1)
                 for k in range(2)]
        t0 = time.monotonic()
        res = outcomes(works, lambda v: float(v[0]))
        got.append((res, time.monotonic() - t0))
    return got, type(state.error).__name__


def fail_at_step(t, step: int, text: str) -> None:
    """Make transport ``t``'s calls of the pipeline's step ``step`` raise ``ProtocolError(text)`` (on every worker
    alike: each patches its own)."""
    run = t.run

    def failing(x, call=None):
        if call is not None and call.step == step:
            raise ProtocolError(text)
        return run(x, call)

    t.run = failing


def outcomes(works, read) -> list:
    """Each work's ``read(result)``, or its error's class name and text."""
    res = []
    for w in works:
        try:
            res.append(read(w.wait()))
        except Exception as e:  # noqa: BLE001 - the class and text are what the tests check
            res.append((type(e).__name__, str(e)))
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault_lane", [0, 1])
def test_an_error_on_one_lane_fails_every_later_call_on_both_lanes_on_every_worker(fault_lane):
    res = sc.launch(functools.partial(_lane_fault, fault_lane=fault_lane), 2, backend="gloo", timeout_s=TIMEOUT)
    for got, kept in res:
        assert kept == "ProtocolError"
        for step in range(2):
            assert got[step][0] == [0.5, 1.5], got[step]          # (rank 0's + rank 1's, averaged)
        faulted, later = got[2][0], got[3][0]
        want = ("ProtocolError", f"injected on lane {fault_lane}")
        # the call before the failed one in call order completes; the failed one and every later one fail
        assert faulted == ([want, want] if fault_lane == 0 else [0.5, want]), faulted
        assert later == [want, want], later
        assert got[2][1] < BOUND and got[3][1] < BOUND


# ------------------------------------------------------------------------------- lanes built once per process
def _two_models(ctx, lanes):
    """Two DDP models, each with its own hook (``lanes``), trained step by step in turn; then four more hooks
    built in the same process. Returns both models' parameters, whether the hooks' lane fabrics are the same
    objects, and the process's Python threads after the first two hooks and after all six."""
    import threading

    nets = [_net() for _ in range(2)]
    ddps = [nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05) for net in nets]
    states = [sc.ddp.register(d, transport="ring", lanes=lanes, fuse=False) for d in ddps]
    opts = [torch.optim.SGD(d.parameters(), lr=0.05) for d in ddps]
    for t in range(STEPS):
        for d, opt in zip(ddps, opts):
            train_step(ctx, d, opt, t)
    threads = threading.active_count()
    more = [sc.ddp.CommHookState(None, transport="ring", model=ddps[0], fuse=False, lanes=lanes) for _ in range(4)]
    fabrics = [s.scheduler.lanes.fabrics if s.scheduler.lanes is not None else [] for s in states + more]
    shared = all(len(f) == len(fabrics[0]) and all(a is b for a, b in zip(f, fabrics[0])) for f in fabrics)
    return {"params": [[p.detach().clone() for p in net.parameters()] for net in nets], "shared": shared,
            "threads": (threads, threading.active_count()),
            "skipped": [outcome(lambda: ctx.fabric.lane(i))[:2] for i in (0, len(fabrics[0]) + 1)]}


@pytest.mark.multiprocess
def test_hooks_built_again_and_again_share_their_lanes_and_keep_their_bits():
    one = sc.launch(functools.partial(_two_models, lanes=1), 2, backend="gloo", timeout_s=TIMEOUT)
    three = sc.launch(functools.partial(_two_models, lanes=3), 2, backend="gloo", timeout_s=TIMEOUT)
    for a, b in zip(one, three):
        for x, y in zip(a["params"], b["params"]):          # (each model: the bits of one lane)
            assert all(torch.equal(p, q) for p, q in zip(x, y))
        assert b["shared"] and b["threads"][1] == b["threads"][0], b["threads"]
        for cls, text in b["skipped"]:       # (lane 0 is the fabric itself; lanes are built in order)
            assert cls == "InvalidValueError" and "index must be an int from 1 to 3" in text, text
