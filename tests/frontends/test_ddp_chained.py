"""The DDP hook's plain average chained on gloo's own future (``CommEngine.chain``, ``Native.chain``):
the same numbers, records and errors as the calls the communication thread completes, and the
chained completions in call order."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.fabric.engine import CommEngine

from tests._faults_common import outcome

TIMEOUT = 60.0
BOUND = 10.0
CAP = 0.1                # MB: a bucket per Linear(128, 128) (66 KB: all_reduce, not the small all_gather)
STEPS = 7


# ---------------------------------------------------------------------------- the engine's order
def test_chained_completions_run_in_call_order_even_when_their_collectives_complete_out_of_order():
    eng = CommEngine("-test")
    ran: list[int] = []
    futs = [torch.futures.Future() for _ in range(3)]
    outs = [eng.chain(lambda f=f, i=i: (f, i), lambda i: ran.append(i) or i) for i, f in enumerate(futs)]
    futs[2].set_result(None)           # the third collective completes first, then the second
    futs[1].set_result(None)
    assert ran == []                   # neither may complete before the first call has
    futs[0].set_result(None)
    assert ran == [0, 1, 2]
    assert [o.wait() for o in outs] == [0, 1, 2]
    assert eng.close(5.0)


def test_a_call_queued_behind_chained_calls_runs_after_their_completions():
    eng = CommEngine("-test")
    ran: list[str] = []
    first, second = torch.futures.Future(), torch.futures.Future()
    a = eng.chain(lambda: (first, None), lambda _: ran.append("first"))
    b = eng.chain(lambda: (second, None), lambda _: ran.append("second"))   # still a prefix: chained
    work = eng.submit(lambda: ran.append("queued"))
    assert eng.chain(lambda: (torch.futures.Future(), None), lambda _: None) is None   # behind the queue
    assert not work._latch.acquire(True, 0.3)        # the queued job waits for the chained calls
    threading.Timer(0.1, lambda: first.set_result(None)).start()
    a.wait()
    assert ran == ["first"] and not eng.idle() and not eng.settle(0.2)     # (the second: still pending)
    second.set_result(None)
    b.wait()
    work.wait(5.0)
    assert ran == ["first", "second", "queued"]
    assert eng.close(5.0)


def test_a_failed_chained_completion_fails_later_calls_but_a_nonfinite_error_does_not():
    from sparsecomm.errors import MismatchError, NonFiniteError

    eng = CommEngine("-test")
    done = torch.futures.Future()
    done.set_result(None)

    def boom(exc):
        def complete(_):
            raise exc
        return complete

    nf = eng.chain(lambda: (done, None), boom(NonFiniteError("nan")))
    with pytest.raises(RuntimeError, match="NonFiniteError: nan"):    # (as DDP sees a failed future)
        nf.wait()
    assert eng.submit(lambda: 1).wait() == 1
    bad = eng.chain(lambda: (done, None), boom(MismatchError("differ")))
    with pytest.raises(RuntimeError, match="MismatchError: differ"):
        bad.wait()
    assert eng.chain(lambda: (done, None), lambda _: 2) is None       # the fabric failed: not chained
    with pytest.raises(MismatchError):
        eng.submit(lambda: 1).wait()
    assert eng.close(5.0)


def test_a_chained_post_that_raises_fails_the_engine_and_the_caller():
    # post() raising (the collective could not be posted): this worker's calls are out of step with the other
    # workers', so the caller gets the error and every later call fails with it
    from sparsecomm.errors import PeerFailure

    eng = CommEngine("-test")
    err = PeerFailure("all_reduce could not be posted")

    def post():
        raise err

    with pytest.raises(PeerFailure, match="could not be posted"):
        eng.chain(post, lambda _: 1)
    done = torch.futures.Future()
    done.set_result(None)
    assert eng.chain(lambda: (done, None), lambda _: 2) is None       # failed: not chained
    assert eng.post(lambda: "posted", lambda _: 3) is None             # nor posted
    with pytest.raises(PeerFailure, match="could not be posted"):
        eng.submit(lambda: 1).wait(5.0)
    assert eng.close(5.0)


def test_a_chained_completion_waits_for_its_collective_even_after_the_previous_completion_failed():
    # the previous call's future fails; the next completion must still wait for its own collective (a
    # collect_all of the failed future would end at once) and then run, after the failed one
    from sparsecomm.errors import NonFiniteError

    eng = CommEngine("-test")
    ran: list[str] = []
    first, second = torch.futures.Future(), torch.futures.Future()

    def fail(_):
        ran.append("first")
        raise NonFiniteError("nan")

    a = eng.chain(lambda: (first, None), fail)
    b = eng.chain(lambda: (second, "b"), lambda p: ran.append(p) or p)
    first.set_result(None)
    with pytest.raises(RuntimeError, match="NonFiniteError: nan"):
        a.wait()
    assert ran == ["first"] and not b.done()         # the second collective has not completed
    second.set_result(None)
    assert b.wait() == "b" and ran == ["first", "b"]
    assert eng.close(5.0)


# ---------------------------------------------------------------------------- under DDP, real processes
def _net() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 12)
    return net


def _batch(rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(16, 128, generator=g), torch.randn(16, 128, generator=g)


def _train(ctx, chain: bool, steps: int = STEPS, fault: str | None = None, compressor: str = "none"):
    from sparsecomm.transports import _fold
    from sparsecomm.transports.native import Native

    torch.set_num_threads(1)
    if not chain:
        Native.chain = lambda self, *a, **k: None            # (this process only: every call through start)
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=CAP)
    state = sc.ddp.register(ddp, compressor=compressor, verify_replicas_every=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    sched = _fold.schedule(state.pipeline.fabric)
    for t in range(steps):
        x, y = _batch(ctx.rank, t)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    out = {"params": [p.detach().clone() for p in net.parameters()], "steps": state.steps,
           "stats": state.compression_stats(), "last": state.last_stats, "ledger": state.pipeline.fabric.stats,
           "chained": sched.chained, "folded": sched.folded,
           "record": (sched._last, sched._run, sched._step, [(c, e[0], e[2]) for c, e in sched._next.items()])}
    if fault is not None:
        x, y = _batch(ctx.rank, steps)
        if ctx.rank == 1 and fault == "nan":
            x[0, 0] = float("nan")
        if ctx.rank == 1 and fault == "step":
            state.scheduler.restart(state.steps + 3)      # this worker's calls name another step
        opt.zero_grad()
        out["fault"] = outcome(lambda: ((ddp(x) - y) ** 2).mean().backward())
        out["error"] = type(state.error).__name__
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor", ["none", "fp16", "bf16"])
def test_a_chained_round_is_bit_identical_with_the_same_records_as_the_queued_one(compressor):
    run = functools.partial(_train, compressor=compressor)
    ons = sc.launch(functools.partial(run, chain=True), 3, backend="gloo", timeout_s=TIMEOUT)
    offs = sc.launch(functools.partial(run, chain=False), 3, backend="gloo", timeout_s=TIMEOUT)
    for on, off in zip(ons, offs):
        assert on["chained"] > 0 and off["chained"] == 0, (on["chained"], off["chained"])
        assert on["folded"] == off["folded"]
        assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
        assert on["steps"] == off["steps"] == STEPS
        assert on["record"] == off["record"]
        for k in ("bytes_dense", "bytes_payload", "bytes_declared_sent", "rounds", "compression_factor"):
            assert on["stats"][k] == off["stats"][k], k
        for s in ("last", "ledger"):
            assert on[s].bytes_sent == off[s].bytes_sent and on[s].messages == off[s].messages, s
            assert on[s].estimated_bytes == off[s].estimated_bytes and on[s].rounds == off[s].rounds, s
    assert all(torch.equal(a, b) for rk in ons for a, b in zip(rk["params"], ons[0]["params"]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor", ["none", "fp16"])
@pytest.mark.parametrize("fault, cls", [("nan", "NonFiniteError"), ("step", "MismatchError")])
def test_a_fault_behind_chained_buckets_is_the_same_error_on_every_worker(fault, cls, compressor):
    res = sc.launch(functools.partial(_train, chain=True, steps=5, fault=fault, compressor=compressor), 3,
                    backend="gloo", timeout_s=TIMEOUT)
    for rk in res:
        assert rk["chained"] > 0
        got_cls, text, secs = rk["fault"]
        assert got_cls == "RuntimeError" and f"{cls}: " in text, (got_cls, text)
        assert rk["error"] == cls, rk["error"]
        assert secs < BOUND


# ---------------------------------------------------------------------------- the casts' numbers
N = 40_000                 # 80 KB in fp16: all_reduce, not the small all_gather


def _cast_rounds(ctx, compressor: str):
    from sparsecomm.fabric.engine import CommWork
    from sparsecomm.pipeline import CommPipeline
    from sparsecomm.transports import _fold

    torch.set_num_threads(1)
    pipe = CommPipeline(compressor, "native", fabric=ctx.fabric, transport_kwargs={"inplace": True})
    sched = _fold.schedule(ctx.fabric)
    out = []
    for step in range(1, 7):
        pipe.begin_step(step)
        g = torch.Generator().manual_seed(100 * ctx.rank + step)
        # multiples of 1/8 up to 8 in size: the sum of 3 is exact in fp16 and bf16, in any order
        x = torch.randint(-64, 65, (N,), generator=g).float() / 8
        before = sched.chained
        got = pipe.chain(x.clone(), 0, compress=True)
        est = got.wait() if isinstance(got, CommWork) else got.wait()
        pipe.end_step()
        out.append((x, est.clone(), sched.chained - before))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_chained_cast_round_is_the_narrow_sum_widened_then_divided(compressor, dtype):
    res = sc.launch(functools.partial(_cast_rounds, compressor=compressor), 3, backend="gloo", timeout_s=TIMEOUT)
    assert [c for _, _, c in res[0]][-2:] == [1, 1]            # the last rounds were chained
    for step in range(len(res[0])):
        total = sum(rk[step][0].to(dtype) for rk in res)       # (exact: see _cast_rounds)
        expected = total.float() / 3                           # torch's fp16 hook: widen, then divide
        assert not torch.equal((total / 3).float(), expected)  # (dividing before widening is another number)
        for rk in res:
            assert torch.equal(rk[step][1], expected), step


def _cast_overflow(ctx, compressor: str, bad: str):
    from sparsecomm.fabric.engine import CommWork
    from sparsecomm.transports import _fold

    torch.set_num_threads(1)
    pipe = sc.pipeline.CommPipeline(compressor, "native", fabric=ctx.fabric, transport_kwargs={"inplace": True})
    sched = _fold.schedule(ctx.fabric)
    for step in range(1, 6):
        pipe.begin_step(step)
        x = torch.full((N,), 0.25)
        if step == 5 and bad == "overflow":
            x[N // 2 + 3] = 40_000.0        # finite on every worker; 3 x 40000 overflows float16 (65504)
        if step == 5 and bad == "nan" and ctx.rank == 2:
            x[7] = float("nan")
        before = sched.chained
        got = pipe.chain(x, 0, compress=True)
        res = outcome((got if isinstance(got, CommWork) else got).wait)
        pipe.end_step()
        if res[0] is not None:
            return step, sched.chained - before, res
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("bad", ["overflow", "nan"])
def test_a_chained_fp16_round_whose_sum_is_not_finite_raises_on_every_worker(bad):
    """The decode's pass checks the chained cast's sum for the transport (``checks``): a sum of finite inputs
    that overflows float16, and one that a worker's NaN made NaN, raise the transport's NonFiniteError on
    every worker (its check of a sum summed in place over the inputs, which names no worker: the inputs are
    overwritten by then)."""
    cls = "NonFiniteError"
    res = sc.launch(functools.partial(_cast_overflow, compressor="fp16", bad=bad), 3, backend="gloo",
                    timeout_s=TIMEOUT)
    for rk in res:
        assert rk is not None
        step, chained, (got_cls, text, secs) = rk
        assert step == 5 and chained == 1, (step, chained)       # the failing round was chained
        assert f"{cls}: " in text or got_cls == cls, (got_cls, text)
        # the sum was taken over the inputs: no worker is blamed for it (an overflow of finite inputs, or a NaN)
        assert "passed NaN" not in text and "sum overflowed" in text, text
        assert secs < BOUND
