"""The DDP hook's fused step (``fuse=``, ``HookScheduler._hold`` in :mod:`sparsecomm.pipeline.scheduler`): a
step's dense buckets as one call, the same numbers as a call per bucket, its records, the rule and its checks,
an error on every bucket of every worker."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.errors import InvalidValueError

from tests._faults_common import outcome
from tests.frontends.test_ddp_lanes import fail_at_step, outcomes, train_step

TIMEOUT = 60.0
STEPS = 6


def _net(double: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), *[m for _ in range(3) for m in (nn.ReLU(), nn.Linear(256, 256))],
                        nn.ReLU(), nn.Linear(256, 10))
    if double:       # a float64 layer in the middle: DDP gives each dtype buckets of its own
        net[2].double()
        net.insert(2, _Cast(torch.float64))
        net.insert(4, _Cast(torch.float32))
    return net


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _train(ctx, transport: str, fuse, double: bool = False, steps: int = STEPS):
    net = _net(double)
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)      # 5+ buckets after the rebuild
    state = sc.ddp.register(ddp, transport=transport, fuse=fuse, compressor="none")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rounds = []
    for t in range(steps):
        train_step(ctx, ddp, opt, t)
        rounds.append(state.compression_stats()["rounds"])
    grads = torch.cat([p.grad.reshape(-1).double() for p in net.parameters()])
    stats = state.compression_stats()
    return {"params": [p.detach().clone() for p in net.parameters()], "fused": state.fused,
            "lanes": state.lane_count, "grads": grads, "rounds": rounds, "steps": state.steps,
            "bytes_dense": stats["bytes_dense"]}




@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["omnireduce", "ring", "allgather"])
def test_fused_gives_the_bits_of_a_call_per_bucket(transport):
    """At 2 workers every transport's sum is a + b, whatever the layout: the same parameters bit for bit as a
    call per bucket, with one call a step (two in step 0, where DDP's initial buckets differ) instead of one
    per bucket, and the same bytes averaged."""
    run = functools.partial(_train, transport=transport)
    per_bucket = sc.launch(functools.partial(run, fuse=False), 2, backend="gloo", timeout_s=TIMEOUT)
    fused = sc.launch(functools.partial(run, fuse=None), 2, backend="gloo", timeout_s=TIMEOUT)
    for a, b in zip(per_bucket, fused):
        assert not a["fused"] and b["fused"] and b["lanes"] == 1 and a["steps"] == b["steps"] == STEPS
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert a["bytes_dense"] == b["bytes_dense"]
        per_step = [r1 - r0 for r0, r1 in zip([0] + b["rounds"], b["rounds"])]
        assert per_step[1:] == [1] * (STEPS - 1), per_step
        assert a["rounds"][-1] - a["rounds"][-2] > 1            # (the layout has several buckets)


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["omnireduce", "allgather"])
def test_fused_runs_of_one_dtype_and_three_workers(transport):
    """A float64 layer among float32 ones: one call per run of one dtype; 3 workers agree bit for bit and
    match the per-bucket calls to float rounding (allgather sums in rank order: bit for bit)."""
    run = functools.partial(_train, transport=transport, double=True)
    per_bucket = sc.launch(functools.partial(run, fuse=False), 3, backend="gloo", timeout_s=TIMEOUT)
    fused = sc.launch(functools.partial(run, fuse=True), 3, backend="gloo", timeout_s=TIMEOUT)
    for a, b in zip(per_bucket, fused):
        assert b["fused"]
        for x, y in zip(a["params"], b["params"]):
            if transport == "allgather":
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        per_step = b["rounds"][-1] - b["rounds"][-2]
        assert 2 <= per_step <= 3, per_step        # float32, float64, float32 runs in DDP's bucket order
    assert all(torch.equal(x, y) for rk in fused for x, y in zip(rk["params"], fused[0]["params"]))


class _Rows(nn.Module):
    """A table of ``ROWS`` rows of 256 and a 3-class head, plus a small layer on a constant whose output shifts the
    logits: DDP's first bucket holds the head's bias and weight (771 elements), then the table, whose rows then start 3
    elements past OmniReduce's 256-element blocks; its second, the small layer (created first in the forward pass,
    its gradient comes last)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table, self.head, self.shift = nn.Embedding(ROWS, 256), nn.Linear(256, 3), nn.Linear(8, 3)

    def forward(self, ids):
        shift = self.shift(torch.ones(1, 8))
        return self.head(self.table(ids)) + shift


ROWS = 1024


def _rows(ctx, fuse):
    net = nn.parallel.DistributedDataParallel(_Rows(), bucket_cap_mb=1)
    state = sc.ddp.register(net, transport="omnireduce", fuse=fuse)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sent, rounds = [], []
    for t in range(3):
        ids = torch.arange(2 * ctx.rank + t % 2, ROWS, 32)        # 32 rows a worker, none next to another
        opt.zero_grad()
        nn.functional.cross_entropy(net(ids), torch.arange(len(ids)) % 3).backward()
        opt.step()
        sent.append(state.last_stats.bytes_sent)
        rounds.append(state.compression_stats()["rounds"])
    return {"params": [p.detach().clone() for p in net.parameters()], "fused": state.fused, "sent": sent,
            "dense": state.compression_stats()["bytes_dense"], "rounds": rounds}


@pytest.mark.multiprocess
def test_fused_places_the_largest_parameter_on_the_block_grid():
    """A row-sparse table that DDP's first bucket puts 771 elements in: called as DDP lays it out, each touched row cuts
    across two of OmniReduce's blocks; the fused step starts the table on the grid, a row a block. The same
    parameters bit for bit (2 workers: a + b in any layout), the same dense bytes counted, and the steps after DDP's
    rebuild send fewer bytes: at most 0.7 of the per-bucket calls' (the table's blocks 32 against 64, each block's
    framing alike; measured 0.54)."""
    per_bucket = sc.launch(functools.partial(_rows, fuse=False), 2, backend="gloo", timeout_s=TIMEOUT)
    fused = sc.launch(functools.partial(_rows, fuse=None), 2, backend="gloo", timeout_s=TIMEOUT)
    for a, b in zip(per_bucket, fused):
        assert b["fused"] and not a["fused"]
        assert a["rounds"][2] - a["rounds"][0] == 4 and b["rounds"][2] - b["rounds"][0] == 2   # (2 buckets a step)
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert a["dense"] == b["dense"]
        for t in (1, 2):
            assert b["sent"][t] <= 0.7 * a["sent"][t], (a["sent"], b["sent"])


# ------------------------------------------------------------------------------- the rule and its checks
def _rule(ctx):
    net = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.05)
    state = functools.partial(sc.ddp.CommHookState, None, model=net, verify_replicas_every=0)
    out = {}
    for t in ("omnireduce", "ring", "allgather", "native"):
        s = state(transport=t)
        out[t] = (s.fused, s.lane_count)
    s = state(transport="omnireduce", method="ef", compressor="topk", ratio=0.1)
    out["topk"] = (s.fused, s.lane_count)
    s = state(transport="omnireduce", lanes=2)
    out["lanes=2"] = (s.fused, s.lane_count)
    out["native forced"] = state(transport="native", fuse=True).fused
    out["refused topk"] = outcome(lambda: state(transport="omnireduce", fuse=True, method="ef", compressor="topk",
                                                ratio=0.1))[:2]
    out["refused lanes"] = outcome(lambda: state(transport="ring", fuse=True, lanes=2))[:2]
    return out


@pytest.mark.multiprocess
def test_the_default_rule_and_its_refusals():
    for rk in sc.launch(_rule, 2, backend="gloo", timeout_s=TIMEOUT):
        assert rk["omnireduce"] == rk["ring"] == rk["allgather"] == (True, 1)
        assert rk["native"] == (False, 1) and rk["topk"] == (False, 2) and rk["lanes=2"] == (False, 2)
        assert rk["native forced"] is True
        cls, text = rk["refused topk"]
        assert cls == "IncompatibleError" and "only plain averaging" in text and "fuse=False" in text, text
        cls, text = rk["refused lanes"]
        assert cls == "IncompatibleError" and "lanes=2" in text and "fuse=False" in text, text


@pytest.mark.parametrize("bad", [0, 1, "yes"])
def test_a_bad_fuse_is_refused_before_any_communication(bad):
    with pytest.raises(InvalidValueError, match="fuse must be None"):
        sc.ddp.CommHookState(None, fuse=bad)


def _disagree(ctx):
    net = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.05)
    return outcome(lambda: sc.ddp.CommHookState(None, transport="ring", model=net, lanes=1,
                                                fuse=bool(ctx.rank)))[:2]


@pytest.mark.multiprocess
def test_workers_that_fuse_differently_are_a_mismatch_on_every_worker():
    for cls, text in sc.launch(_disagree, 2, backend="gloo", timeout_s=TIMEOUT):
        assert cls == "MismatchError" and "fuse is False on worker 0 and True on worker 1" in text, text


# ------------------------------------------------------------------------------- errors
def _fault(ctx):
    """Three buckets a step through the hook's body; at the third step the fused call raises on every worker
    alike: every bucket's work fails with its error, and so does every later call."""
    state = sc.ddp.CommHookState(None, transport="ring", verify_replicas_every=0)
    assert state.fused
    fail_at_step(state.pipeline.transport, 3, "injected")
    got = []
    for _ in range(4):
        works = [state.start_bucket(torch.full((30_000 - 10_000 * k,), float(ctx.rank + k)), k, k == 2)
                 for k in range(3)]
        got.append(outcomes(works, lambda v: (float(v[0]), v.numel())))
    return got, type(state.error).__name__


@pytest.mark.multiprocess
def test_an_error_in_the_fused_call_fails_every_bucket_on_every_worker():
    for got, kept in sc.launch(_fault, 2, backend="gloo", timeout_s=TIMEOUT):
        assert kept == "ProtocolError"
        for step in (0, 1):
            assert got[step] == [(0.5 + k, 30_000 - 10_000 * k) for k in range(3)], got[step]
        for step in (2, 3):
            assert got[step] == [("ProtocolError", "injected")] * 3, got[step]
