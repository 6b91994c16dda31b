"""Every collective call carries its identity (bucket, step, round: ``CallId``) in what the workers
agree on, so that two workers whose paired calls are different calls raise ``MismatchError`` on every
worker instead of summing different tensors; and a call of several rounds (PowerSGD's P, then Q)
sends its later rounds before any later call's message, posted or not.

The replica drift this guards against: PowerSGD through the DDP hook on ``native`` with several
buckets, where a bucket's P round was posted by the autograd thread while the communication thread
still had the previous bucket's Q round to send, in an order that differed between workers.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.transports import _fold
from sparsecomm.transports._handshake import CallId, calling

from tests._faults_common import outcome

TIMEOUT = 30.0
BOUND = 5.0      # seconds: every rank has its error well within this (vs TIMEOUT)


# ----------------------------------------------------------------------------- the record
def test_the_fold_key_names_the_bucket_the_round_and_the_steps_since_the_last_call():
    s = _fold.Schedule()
    assert s.call_key() == ()                                   # no identity: nothing added
    with calling(CallId("a", step=7)):
        first = s.call_key()
        s.record(("k",) + first)
    code = CallId("a", 7).words[0]
    assert first == (("call", code, 0, None),)                  # no previous step known
    with calling(CallId("a", step=7, round=1)):
        assert s.call_key() == (("call", code, 1, 0),)
    with calling(CallId("b", step=8)):
        assert s.call_key() == (("call", CallId("b", 8).words[0], 0, 1),)
    with calling(CallId("b", step=9)):                        # a step skipped: another key
        assert s.call_key() == (("call", CallId("b", 9).words[0], 0, 2),)
    s.reset()
    with calling(CallId("b", step=9)):
        assert s.call_key()[0][3] is None


def test_a_training_loop_keeps_being_predicted_with_its_identities():
    s = _fold.Schedule()
    folds = {}
    guesses = []
    for step in range(1, 7):
        for bucket in (2, 1, 0):
            with calling(CallId(bucket, step)):
                key = ("native", 100) + s.call_key()
                guesses.append(s.predicted() is not None and s.predicted().key == key)
                folds.setdefault(key, _fold.Fold(key, 4, torch.float32, torch.device("cpu"), lambda t: None))
                s.record(key, folds[key])
    assert all(guesses[-6:]), guesses          # steady state: every call predicted


def test_predicts_is_the_prediction_of_the_key_that_call_key_gives():
    # Native.chain asks predicts() with its bucket's code computed once; the answer must be predicted() of the
    # key that call_key() gives the same call, and that key, for every call of a loop (and a deviating one)
    s = _fold.Schedule()
    folds = {}
    answers = []
    calls = [CallId(bucket, step) for step in range(1, 7) for bucket in (2, 1, 0)] + [CallId(0, 9)]
    for call in calls:
        key = ("native", 100) + s.call_key(call)
        p = s.predicted()
        want = (key, p) if p is not None and p.key == key else None
        got = s.predicts(("native", 100), call.words[0], call.step, call.round)
        assert got == want and s.key_of(*call.words) == s.call_key(call)
        answers.append(got is not None)
        folds.setdefault(key, _fold.Fold(key, 4, torch.float32, torch.device("cpu"), lambda t: None))
        s.record(key, folds[key], step=call.step)
    assert all(answers[-7:-1]) and not answers[-1], answers       # steady state predicted; a skipped step not


# ----------------------------------------------------------------------------- the handshake (sim)
def _identity_cases(ctx):
    r, f = ctx.rank, ctx.fabric
    out = {}
    x = torch.ones(64)
    for name in ("ring", "allgather", "omnireduce"):
        t = sc.transports.get(name, f)
        y = t.allreduce(x, call=CallId("b0", 1))
        out[name + " same"] = torch.equal(y, torch.full((64,), 3.0))
        out[name + " bucket"] = outcome(lambda: t.allreduce(x, call=CallId("b1" if r == 1 else "b0", 2)))
        out[name + " step"] = outcome(lambda: t.allreduce(x, call=CallId("b0", 4 if r == 2 else 3)))
        out[name + " round"] = outcome(lambda: t.allreduce(x, call=CallId("b0", 5, 1 if r == 0 else 0)))
        out[name + " none"] = outcome(lambda: t.allreduce(x, call=None if r == 0 else CallId("b0", 6)))
    return out


def test_workers_at_different_calls_get_a_mismatch_naming_the_part_on_every_transport():
    res = sc.launch(_identity_cases, 3, backend="sim")
    for name in ("ring", "allgather", "omnireduce"):
        assert all(rk[name + " same"] for rk in res), name
        for part, words in (("bucket", ("bucket",)), ("step", ("step 3", "step 4")),
                            ("round", ("round 0", "round 1")), ("none", ("without identity",))):
            got = [rk[f"{name} {part}"] for rk in res]
            assert [g[0] for g in got] == ["MismatchError"] * 3, (name, part, got)
            assert all("different collective calls" in g[1] for g in got), (name, part, got)
            assert all(w in g[1] for g in got for w in words), (name, part, got)


# ----------------------------------------------------------------------------- real processes
def _native_cases(ctx):
    r, f = ctx.rank, ctx.fabric
    nat = sc.transports.get("native", f)
    sched = _fold.schedule(f)
    out = {}
    x = torch.full((1000,), float(r + 1))
    step = [0]

    def steps(k=4, buckets=("a", "b")):
        for _ in range(k):
            step[0] += 1
            for bkt in buckets:
                nat.allreduce(x, call=CallId(bkt, step[0]))

    steps()
    before = sched.folded
    steps(1)
    out["folded"] = sched.folded - before == 2
    # a worker at another bucket of the same length: without the identity this call would fold
    steps()
    step[0] += 1
    out["bucket"] = outcome(lambda: nat.allreduce(x, call=CallId("b" if r == 1 else "a", step[0])))
    # a worker a step ahead (it skipped one)
    steps()
    step[0] += 1
    out["step"] = outcome(lambda: nat.allreduce(x, call=CallId("a", step[0] + (r == 2))))
    # posted calls: a call of several rounds whose later round is slow on worker 0, and the next call
    # started behind it: the later round still goes first on every worker
    steps()
    step[0] += 1

    def slow_more(agg):
        if slow_more.left:
            slow_more.left -= 1
            if r == 0:
                time.sleep(0.2)
            return torch.full((1000,), 10.0 * (r + 1))
        return None

    res = []
    for _ in range(4):
        step[0] += 1
        slow_more.left = 1
        w1 = nat.start(x.clone(), next_round=slow_more, call=CallId("a", step[0]))
        w2 = nat.start(x.clone(), call=CallId("b", step[0]))
        res.append((w1.wait(), w2.wait()))
    out["rounds"] = all(torch.equal(a, torch.full((1000,), 60.0)) and torch.equal(b, torch.full((1000,), 6.0))
                        for a, b in res)
    return out


@pytest.mark.multiprocess
def test_native_calls_carry_their_identity_folded_or_posted():
    res = sc.launch(_native_cases, 3, backend="gloo", timeout_s=TIMEOUT)
    assert all(rk["folded"] for rk in res)
    assert all(rk["rounds"] for rk in res), [rk["rounds"] for rk in res]
    for case, words in (("bucket", ("bucket",)), ("step", ("step",))):
        got = [rk[case] for rk in res]
        assert [g[0] for g in got] == ["MismatchError"] * 3, (case, got)
        assert all(g[2] < BOUND for g in got), (case, got)
        assert all("different collective calls" in g[1] and all(w in g[1] for w in words) for g in got), got


def _powersgd_ddp(ctx, delay: float, fold_max_bytes: int | None):
    """A 3-bucket MLP under DDP with the PowerSGD hook on ``native``. With ``delay``, worker 0's later
    rounds are slow (its autograd thread starts the next buckets while its communication thread still
    has Q rounds to send) and worker 1's backward is slow before the first layer (its communication
    thread sends the Q rounds before the last bucket starts): the orders in which the two workers
    would post their messages differ."""
    from sparsecomm.methods.powersgd import PowerSGD

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.2)
    kw = {} if fold_max_bytes is None else {"transport_kwargs": {"fold_max_bytes": fold_max_bytes}}
    sc.ddp.register(ddp, compressor="powersgd", matrix_approximation_rank=1, warmup_steps=2, transport="native", **kw)
    if delay and ctx.rank == 0:
        inner = PowerSGD._next_round

        def slow(self, *a, **k):
            time.sleep(delay)
            return inner(self, *a, **k)

        PowerSGD._next_round = slow          # this worker's process only
    if delay and ctx.rank == 1:
        net[0].register_full_backward_pre_hook(lambda *a: time.sleep(4 * delay))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(ctx.rank)
    try:
        for _ in range(12):
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    finally:
        if delay and ctx.rank == 0:
            PowerSGD._next_round = inner
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _slow_then_plain(ctx):
    """The delayed run on a fresh launch (nothing recorded before it), then, in the same processes, the run
    with nothing posted ahead (``fold_max_bytes=0``: no call folds, whatever the record holds)."""
    slow = _powersgd_ddp(ctx, delay=0.02, fold_max_bytes=None)
    return slow, _powersgd_ddp(ctx, delay=0.0, fold_max_bytes=0)


@pytest.mark.multiprocess
def test_powersgd_hook_on_native_with_several_buckets_keeps_the_replicas_identical():
    (slow0, plain0), (slow1, _) = sc.launch(_slow_then_plain, 2, backend="gloo", timeout_s=TIMEOUT)
    assert torch.equal(slow0, slow1), (slow0 - slow1).abs().max()
    # and the same trajectory as with nothing posted ahead (no folding at all)
    assert torch.equal(slow0, plain0)


# ----------------------------------------------------------------------------- the replica guard
def _guarded_optimizer(ctx):
    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="diana",
                                  transport="ring", ratio=0.5, module=model, verify_replicas_every=3)
    g = torch.Generator().manual_seed(ctx.rank)

    def step():
        x = torch.randn(8, 8, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    out = {}
    out["clean"] = outcome(lambda: [step() for _ in range(6)])          # checked after steps 3 and 6
    if ctx.rank == 2:
        with torch.no_grad():
            model[2].bias.add_(1e-7)                                       # one replica drifts
    out["drift"] = outcome(lambda: [step() for _ in range(3)])
    return out


def test_the_optimizers_replica_guard_names_the_first_parameter_that_differs_on_every_worker():
    res = sc.launch(_guarded_optimizer, 3, backend="sim")
    assert [rk["clean"][0] for rk in res] == [None] * 3, [rk["clean"] for rk in res]
    got = [rk["drift"] for rk in res]
    assert [g[0] for g in got] == ["MismatchError"] * 3, got
    assert all("'2.bias'" in g[1] and "after step 9" in g[1] and "worker 2" in g[1] for g in got), got


def _guarded_hook(ctx):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(net)
    sc.ddp.register(ddp, compressor="ef", ratio=0.5, transport="allgather", verify_replicas_every=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ctx.rank)

    def step():
        opt.zero_grad()
        ddp(torch.randn(8, 8, generator=g)).square().mean().backward()
        opt.step()

    out = {"clean": outcome(lambda: [step() for _ in range(5)])}
    if ctx.rank == 1:
        with torch.no_grad():
            net[0].weight[3, 4] += 1e-6
    out["drift"] = outcome(lambda: [step() for _ in range(2)])
    return out


@pytest.mark.multiprocess
def test_the_hooks_replica_guard_names_the_first_parameter_that_differs_on_every_worker():
    res = sc.launch(_guarded_hook, 2, backend="gloo", timeout_s=TIMEOUT)
    assert [rk["clean"][0] for rk in res] == [None] * 2, [rk["clean"] for rk in res]
    got = [rk["drift"] for rk in res]
    assert all(g[0] is not None and "MismatchError" in (g[0] + g[1]) for g in got), got
    assert all("'module.0.weight'" in g[1] or "'0.weight'" in g[1] for g in got), got
    assert all(g[2] < BOUND for g in got), got
