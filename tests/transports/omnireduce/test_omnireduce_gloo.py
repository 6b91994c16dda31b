"""OmniReduce on real gloo processes: colocated aggregators and dedicated aggregator ranks started by the
launcher (``services=["omnireduce-agg:0", ...]``). One launch per deployment; every check runs inside it
and returns the problems it found (exact sums of integer-valued float64 inputs, payload kinds, and a
length mismatch that must raise on every worker and leave the transport usable)."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports and the aggregator service)
from sparsecomm.errors import MismatchError
from tests.transports.omnireduce.test_omnireduce import CASES, _aligned, _dense16, _quantized, _sparse, make_x


def _gloo_checks(ctx, deployment):
    n, r = ctx.world_size, ctx.rank
    problems = []
    for i, (numel, bs, d, lanes, ch) in enumerate(CASES):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment=deployment)
        exp = sum(make_x(v, numel, bs, d, i) for v in range(n))
        for k in range(2):
            if not torch.equal(t.allreduce(make_x(r, numel, bs, d, i) * (k + 1)), exp * (k + 1)):
                problems.append(("case", i, k))
    for i, (numel, bs, d, lanes, ch) in enumerate(CASES):      # in place: the sum lands in the input
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment=deployment, inplace=True)
        exp = sum(make_x(v, numel, bs, d, i, torch.float32) for v in range(n))
        for k in range(2):
            x = make_x(r, numel, bs, d, i, torch.float32) * (k + 1)
            if t.allreduce(x).data_ptr() != x.data_ptr() or not torch.equal(x, exp * (k + 1)):
                problems.append(("in place", i, k))
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=8, lanes=4, deployment=deployment)
    for mk in (_sparse, _aligned, _quantized, _dense16):
        exp = sum(mk(v).to_dense() for v in range(n)).reshape(mk(r).shape).to(mk(r).dtype)
        if not torch.equal(t.allreduce(mk(r)), exp):
            problems.append(("payload", mk.__name__))
    try:
        t.allreduce(torch.ones(100 + (r == 1)))
        problems.append("no mismatch error")
    except MismatchError as e:
        if "numel" not in str(e):
            problems.append(("message", str(e)))
    y = t.allreduce(torch.full((1000,), float(r)))
    if not torch.equal(y, torch.full((1000,), float(sum(range(n))))):
        problems.append("after the error")
    return problems


@pytest.mark.multiprocess
def test_gloo_colocated():
    out = sc.launch(functools.partial(_gloo_checks, deployment="colocated"), 3, backend="gloo", timeout_s=60)
    assert out == [[], [], []]


@pytest.mark.multiprocess
def test_gloo_dedicated_aggregator_ranks():
    out = sc.launch(functools.partial(_gloo_checks, deployment="dedicated"), 2, backend="gloo", timeout_s=60,
                    services=["omnireduce-agg:0", "omnireduce-agg:1"])
    assert out == [[], []]


def _lanes_ahead(ctx):
    """n = 2, colocated, one channel of 4 lanes per aggregator (8 rounds): each worker holds every block
    of its own aggregator's range but only position 0 of the other's, so each aggregator's rounds >= 1
    have its host as their only holder and run ahead of the other worker's lane."""
    bs, lanes, per = 16, 4, 32
    me, other = ctx.rank, 1 - ctx.rank
    x = torch.zeros(2 * per, bs, dtype=torch.float64)
    x[me * per:(me + 1) * per] = torch.arange(per * bs, dtype=torch.float64).view(per, bs) + me
    x[other * per: other * per + lanes] = 2.0
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=1)
    exp = torch.zeros_like(x)
    for r in (0, 1):
        exp[r * per:(r + 1) * per] += torch.arange(per * bs, dtype=torch.float64).view(per, bs) + r
        exp[(1 - r) * per: (1 - r) * per + lanes] += 2.0
    return [torch.equal(t.allreduce(x.reshape(-1).clone()), exp.reshape(-1)) for _ in range(3)]


@pytest.mark.multiprocess
def test_gloo_an_aggregator_running_ahead_does_not_wait_blocking_for_its_old_sends():
    """An aggregator reuses a round's message buffer two rounds later, once that buffer's sends have
    completed; a gloo send completes only when the peer has posted its receive, which the peer's lane
    does only when its scheduler runs it, so two aggregators each blocking on that would wait for each
    other. The scheduler waits for those sends instead (``Recv.free``; ``docs/omnireduce-scheduler.md``,
    R10), and the lanes run."""
    out = sc.launch(_lanes_ahead, 2, backend="gloo", timeout_s=30)
    assert out == [[True] * 3] * 2


def _more_workers_than_windows(ctx):
    """Dense and sparse multi-round cases, several calls: each aggregator has more holders per round than
    its windows hold (:data:`~sparsecomm.transports.omnireduce.aggregator.WINDOW_MESSAGES`), so it posts
    some workers' receives only as earlier messages are summed."""
    n, r = ctx.world_size, ctx.rank
    out = []
    for i in (0, 1):
        numel, bs, d, lanes, ch = CASES[i]
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment="dedicated")
        exp = sum(make_x(v, numel, bs, d, i) for v in range(n))
        out += [torch.equal(t.allreduce(make_x(r, numel, bs, d, i) * (k + 1)), exp * (k + 1)) for k in range(3)]
    return out


@pytest.mark.multiprocess
def test_gloo_windows_smaller_than_the_workers_never_deadlock():
    """n = 3 dedicated aggregators, each taking its workers in its own order through a window of two
    messages per channel: a worker's send to an aggregator where it comes third may wait for the others'
    messages there, while a dedicated worker finishes its sends before each wait (``keep=0``). Waiting for
    such a send could close a cycle (worker 0 waits for worker 2 at aggregator 0, worker 2 for worker 0 at
    aggregator 2); the worker does not wait for it (:func:`~sparsecomm.transports.omnireduce.aggregator.may_defer`)."""
    out = sc.launch(_more_workers_than_windows, 3, backend="gloo", timeout_s=60,
                    services=[f"omnireduce-agg:{i}" for i in range(3)])
    assert out == [[True] * 6] * 3
