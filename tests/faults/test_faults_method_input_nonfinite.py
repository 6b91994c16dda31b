"""A finite gradient whose method input is not finite: a stateful method compresses what it forms from the
gradient and its state (EF's ``g + e``, EF21's ``g - g_i``, DIANA's ``g - h_i``, PowerSGD's ``g + e``), and that
sum can overflow to Inf on one worker while every gradient is finite. The pipeline's check must cover that input,
so that the worker tells every other worker through the round (its payload poisoned with NaN) and every worker
raises the same :class:`~sparsecomm.errors.NonFiniteError`, naming the method's input; never one worker's error
while the others wait for its message (a hang until the fabric's timeout) or go on.

The overflow is crafted: after a first, ordinary step, rank 0's state field is set to +-3.3e38 (float32's largest
is 3.4028e38) with the sign that makes the method's input overflow on a gradient of 2e37 (every gradient finite on
every worker).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError
from sparsecomm.methods.warmup import warmup

from tests._faults_common import outcome

#: method name -> (factory, the state field crafted, its sign: + where the method adds it to the gradient)
METHODS = {
    "ef": (lambda: sc.methods.ef(sc.compressors.get("topk", k=4)), "error", 1.0),
    "ef21": (lambda: sc.methods.ef21(sc.compressors.get("topk", k=4)), "g_local", -1.0),
    "diana": (lambda: sc.methods.diana(sc.compressors.get("randk", k=4)), "h_local", -1.0),
    "powersgd": (lambda: sc.methods.powersgd(1), "error", 1.0),
    "onebit": (lambda: sc.methods.onebit(8), "error", 1.0),
    "dgc": (lambda: sc.methods.dgc(0.25), "velocity", 1.0),
    # the optimizer's warmup_steps wrapper: its first round exact, the traits (checks_input) the inner method's
    "ef-warmup": (lambda: warmup(sc.methods.ef(sc.compressors.get("topk", k=4)), 1), "error", 1.0),
}

TIMEOUT = 30.0   # the fabric's bound on every wait (gloo); every rank must have its error far sooner
BOUND = 10.0


def _overflow_step(ctx, method: str, nonfinite: str = "raise"):
    """Rank 0's method input overflows at the second step; each rank's outcome of that step."""
    factory, field, sign = METHODS[method]
    with ctx.seeded(0):
        model = torch.nn.Linear(16, 4)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-30), method=factory(),
                                  verify_replicas_every=0, nonfinite=nonfinite)
    opt.zero_grad()
    model(torch.ones(1, 16)).sum().backward()
    opt.step()
    if ctx.rank == 0:
        for ms in opt.method_states.values():
            getattr(ms.state, field).fill_(sign * 3.3e38)
    opt.zero_grad()
    x = torch.full((1, 16), 2e37)        # the weight's gradient 2e37: 2e37 + 3.3e38 > 3.4028e38

    def step():
        model(x).sum().backward()       # (buckets start during the backward pass: overlap)
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    crafted = [getattr(ms.state, field).clone() for ms in opt.method_states.values()]
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))      # (the same gradients, untouched)
    res = outcome(step)
    res += (all(bool(torch.isfinite(g).all()) for g in grads),)
    if nonfinite == "raise":
        return res
    after = {"skipped": opt.compression_stats()["skipped_steps"],
             "params_kept": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
             "state_kept": all(torch.equal(c, getattr(ms.state, field))
                               for c, ms in zip(crafted, opt.method_states.values())),
             "params_nan": any(bool(torch.isnan(p).any()) for p in model.parameters()),
             "params": [p.detach().clone() for p in model.parameters()]}
    return res + (after,)


def _check(res):
    names = [r[0] for r in res]
    assert names == [NonFiniteError.__name__] * len(res), res
    assert len({r[1] for r in res}) == 1, res          # the same message on every worker
    for r in res:
        assert "residual" in r[1] or "state" in r[1], r[1]      # it names the method's input, not the gradient alone
        assert r[2] < BOUND, res
        assert r[3], res                                # every gradient was finite


@pytest.mark.parametrize("method", sorted(METHODS))
def test_an_overflowing_method_input_is_the_same_error_on_every_worker_sim(method):
    _check(sc.launch(functools.partial(_overflow_step, method=method), 2, backend="sim"))


def test_under_skip_every_worker_skips_the_step_with_nothing_changed():
    """``nonfinite="skip"``: the poisoned round is a skipped step on every worker, rank 0's crafted state restored."""
    for method in ("ef", "powersgd"):
        res = sc.launch(functools.partial(_overflow_step, method=method, nonfinite="skip"), 2, backend="sim")
        for r in res:
            assert r[0] is None and r[3], (method, res)
            assert r[4]["skipped"] == 1 and r[4]["params_kept"] and r[4]["state_kept"], (method, r)


def test_under_pass_the_nan_reaches_every_worker_alike():
    """``nonfinite="pass"``: no error on one worker alone; the NaN the poisoned round carries is in every worker's
    update (the same parameters on every worker)."""
    res = sc.launch(functools.partial(_overflow_step, method="ef", nonfinite="pass"), 2, backend="sim")
    for r in res:
        assert r[0] is None and r[3] and r[4]["params_nan"], res
    for a, b in zip(res[0][4]["params"], res[1][4]["params"]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["ef", "powersgd"])
def test_an_overflowing_method_input_is_the_same_error_on_every_worker_gloo(method):
    t0 = time.monotonic()
    res = sc.launch(functools.partial(_overflow_step, method=method), 2, backend="gloo", timeout_s=TIMEOUT)
    _check(res)
    assert time.monotonic() - t0 < TIMEOUT, res


def _overflow_under_ddp(ctx):
    """The same crafted overflow under the DDP comm hook (method ``ef`` around top-k)."""
    with ctx.seeded(0):
        net = torch.nn.Linear(16, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    state = sc.ddp.register(ddp, method=METHODS["ef"][0]())
    for _ in range(2):          # clean iterations first (the hook's states exist from its second)
        ddp(torch.ones(1, 16)).sum().backward()
    assert state.pipeline.states.by_key
    if ctx.rank == 0:
        for ms in state.pipeline.states.by_key.values():
            ms.state.error.fill_(3.3e38)
    got = outcome(lambda: ddp(torch.full((1, 16), 2e37)).sum().backward())
    return got, type(state.error).__name__


@pytest.mark.multiprocess
def test_an_overflowing_method_input_under_the_ddp_hook_is_the_same_error_on_every_worker():
    res = sc.launch(_overflow_under_ddp, 2, backend="gloo", timeout_s=TIMEOUT)
    for (cls, text, secs), kept in res:
        assert cls == "RuntimeError" and "NonFiniteError: " in text and "residual" in text, (cls, text)
        assert kept == "NonFiniteError" and secs < BOUND, res
