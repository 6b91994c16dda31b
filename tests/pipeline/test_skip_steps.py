"""``nonfinite="skip"`` on simulated workers: a step whose gradients hold an Inf on one worker is dropped on
every worker with nothing changed (method states, round counts, generators, the inner optimizer), for every
stateful method of the registry, under the optimizer and under the DDP hook's bucket calls; the skipped
steps are counted; ``nonfinite="raise"`` leaves the engine usable after its NonFiniteError; the fp16 cast
counts an underflow instead of raising (``underflow="raise"`` stays the strict option)."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError, InvalidValueError, NonFiniteError, UnderflowError

from tests import _train_common as tc

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sparsecomm.pipeline.step_size.StepSizeWarning")]

STEPS, BAD = 5, 2
SMALL_CAP = 200 / 2 ** 20          # several buckets for the MLP: the Inf is in the last one started
#: the methods that keep a state, from the registry (so that a new one is covered)
STATEFUL = [n for n in sc.methods.available() if sc.methods.get(n).State is not None]


def test_the_stateful_methods_are_enumerated():
    assert {"ef", "diana", "powersgd"} <= set(STATEFUL)


def _states(store) -> dict:
    """Every state of a StateStore as plain values: rounds, started, typed fields (tensors cloned)."""
    out = {}
    for k, ms in store.by_key.items():
        st = ms.state
        fields = {} if st is None else {f: (None if v is None else v.clone()) if isinstance(v, torch.Tensor)
                                        or v is None else v for f, v in vars(st).items()}
        out[k] = (ms.rounds, ms.started, fields)
    return out


def _generators(pipe) -> dict:
    sd = pipe.generators.state_dict()
    return {**{("bucket", d): s.clone() for d, s in sd["generators"].items()},
            **{("param",) + k: s.clone() for k, s in sd["param_generators"].items()}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _inject(grad: torch.Tensor) -> torch.Tensor:
    g = grad.clone()
    g.view(-1)[3] = float("inf")
    return g


# ============================================================================ the optimizer
def _opt_run(ctx, method: str, bad: int | None, omit: int | None):
    model = tc.MLP(0, with_unused=False)
    opt = sc.DistributedOptimizer(tc.make_inner(model), method=method, nonfinite="skip", bucket_cap_mb=SMALL_CAP,
                                  verify_replicas_every=1)
    pipe = opt._sc_pipeline
    seen = {}
    for t in range(STEPS):
        if t == omit:
            continue
        opt.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        h = model.l1.weight.register_hook(_inject) if t == bad and ctx.rank == 1 else None
        if t == bad:        # (before backward: with overlap, the buckets are encoded during backward)
            seen["before"] = (_states(pipe.states), _generators(pipe), [p.detach().clone() for p in model.parameters()])
        tc.loss_fn(model(x), y).backward()
        if h is not None:
            h.remove()
        opt.step()
        if t == bad:
            seen["after"] = (_states(pipe.states), _generators(pipe), [p.detach().clone() for p in model.parameters()])
            seen["grad_nan"] = bool(torch.isnan(model.l1.weight.grad).any())
    return {"params": [p.detach().clone() for p in model.parameters()], "states": _states(pipe.states),
            "generators": _generators(pipe), "inner": opt.state_dict()["state"],
            "skipped": opt.compression_stats()["skipped_steps"], "seen": seen, "layout": len(opt.buckets())}


@pytest.mark.parametrize("method", STATEFUL)
def test_optimizer_skipped_step_changes_nothing(method):
    """The Inf is in ``l1.weight``, whose bucket starts last: the buckets started before it (finite sums)
    are rolled back too. The run that skipped step 2 ends bit-identical to a run that never saw it: the
    parameters, the inner optimizer's state, every method state (typed fields and round counts) and every
    generator."""
    got = sc.launch(lambda ctx: _opt_run(ctx, method, BAD, None), 2, backend="sim")
    ref = sc.launch(lambda ctx: _opt_run(ctx, method, None, BAD), 2, backend="sim")
    assert got[0]["layout"] > 1
    for g, r in zip(got, ref):
        assert g["skipped"] == 1 and r["skipped"] == 0
        assert g["seen"]["grad_nan"]                        # the averaged gradient tells the step was dropped
        for i in range(3):                                  # the skipped step itself changed nothing
            assert _same(g["seen"]["before"][i], g["seen"]["after"][i]), (method, i)
        assert _same(g["params"], r["params"]), method
        assert _same(g["inner"], r["inner"]), method
        assert _same(g["states"], r["states"]), method
        assert _same(g["generators"], r["generators"]), method
    assert _same(got[0]["params"], got[1]["params"])


# ============================================================================ the DDP hook's calls
def _hook_run(ctx, method: str, bad: int | None, omit: int | None):
    """The hook's bucket calls as DDP makes them (two buckets a step, the last layer's first), the update
    skipped where an average is not finite (as GradScaler skips it)."""
    from sparsecomm import ddp as scddp

    model = tc.MLP(0, with_unused=False)
    state = scddp.CommHookState(method=method, nonfinite="skip", model=model)
    buckets = [[model.l2.weight, model.l2.bias], [model.l1.weight, model.l1.bias]]
    pipe = state.pipeline
    seen = {}
    for t in range(STEPS):
        if t == omit:
            continue
        model.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        tc.loss_fn(model(x), y).backward()
        if t == bad and ctx.rank == 1:
            model.l1.weight.grad.view(-1)[5] = float("inf")
        if t == bad:
            seen["before"] = (_states(pipe.states), _generators(pipe))
        works = [state.start_bucket(torch.cat([p.grad.reshape(-1) for p in ps]), i, i == len(buckets) - 1, ps,
                                    [p.shape for p in ps]) for i, ps in enumerate(buckets)]
        avgs = [w.wait().clone() for w in works]
        if t == bad:
            seen["after"] = (_states(pipe.states), _generators(pipe))
        if all(bool(torch.isfinite(a).all()) for a in avgs):
            with torch.no_grad():
                for ps, a in zip(buckets, avgs):
                    o = 0
                    for p in ps:
                        p.sub_(0.1 * a[o:o + p.numel()].view_as(p))
                        o += p.numel()
        else:
            seen["skipped_update"] = t
    return {"params": [p.detach().clone() for p in model.parameters()], "states": _states(pipe.states),
            "generators": _generators(pipe), "skipped": state.compression_stats()["skipped_steps"], "seen": seen}


@pytest.mark.parametrize("method", STATEFUL)
def test_hook_skipped_step_changes_nothing(method):
    """Under the hook the step spans two buckets: the first one's sum is finite and decoded, the second's
    is not; both are rolled back once the step's last call completes."""
    got = sc.launch(lambda ctx: _hook_run(ctx, method, BAD, None), 2, backend="sim")
    ref = sc.launch(lambda ctx: _hook_run(ctx, method, None, BAD), 2, backend="sim")
    for g, r in zip(got, ref):
        assert g["skipped"] == 1 and r["skipped"] == 0 and g["seen"]["skipped_update"] == BAD
        assert _same(g["seen"]["before"], g["seen"]["after"]), method
        assert g["states"] and _same(g["states"], r["states"]), method
        assert _same(g["generators"], r["generators"]), method
        assert _same(g["params"], r["params"]), method


# ============================================================================ the other modes
def _raise_then_go_on(ctx):
    model = tc.MLP(0, with_unused=False)
    opt = sc.DistributedOptimizer(tc.make_inner(model), compressor="none", transport="ring")
    out = []
    for t in range(3):
        opt.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        if t == 1 and ctx.rank == 0:
            x[0, 0] = float("nan")
        tc.loss_fn(model(x), y).backward()
        try:
            opt.step()
            out.append("ok")
        except NonFiniteError:
            out.append("NonFiniteError")
    return out, [p.detach().clone() for p in model.parameters()]


def test_raise_mode_leaves_the_engine_usable():
    """``nonfinite="raise"``: the NonFiniteError is raised on every worker, and the next step runs."""
    res = sc.launch(_raise_then_go_on, 2, backend="sim")
    for out, params in res:
        assert out == ["ok", "NonFiniteError", "ok"]
        assert all(bool(torch.isfinite(p).all()) for p in params)
    assert _same(res[0][1], res[1][1])


def test_skip_refuses_a_transport_that_cannot_sum_nan_and_a_closure():
    def fn(ctx):
        errs = []
        try:
            sc.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1),
                                    transport="switch", nonfinite="skip")
        except IncompatibleError as e:
            errs.append(str(e))
        w = torch.nn.Parameter(torch.zeros(4))
        opt = sc.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), nonfinite="skip")
        w.grad = torch.ones(4)
        try:
            opt.step(lambda: 0.0)
        except InvalidValueError as e:
            errs.append(str(e))
        return errs
    for errs in sc.launch(fn, 2, backend="sim"):
        assert len(errs) == 2 and "switch" in errs[0] and "closure" in errs[1]


def _fp16_run(ctx, underflow: str):
    w = torch.nn.Parameter(torch.zeros(64))
    opt = sc.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), compressor=sc.compressors.fp16(underflow=underflow),
                                  transport="allgather")
    out = []
    for scale in (1.0, 1e-9, 1.0):
        w.grad = torch.full((64,), scale)
        try:
            opt.step()
            out.append("ok")
        except UnderflowError:
            out.append("UnderflowError")
            break
    return out, opt.compression_stats()["underflow_rounds"]


def test_fp16_underflow_is_counted_by_default_and_strict_on_request():
    assert sc.compressors.get("fp16").underflow == "count"
    for out, n in sc.launch(lambda ctx: _fp16_run(ctx, "count"), 2, backend="sim"):
        assert out == ["ok"] * 3 and n == 1
    for out, _ in sc.launch(lambda ctx: _fp16_run(ctx, "raise"), 2, backend="sim"):
        assert out == ["ok", "UnderflowError"]


def _clip_recipe(ctx, sync_first: bool):
    """torch's clipping recipe with GradScaler: ``unscale_`` before ``step`` (of this worker's own gradients,
    or of the averages after ``opt.synchronize()``)."""
    model = tc.MLP(0, with_unused=False)
    opt = sc.DistributedOptimizer(tc.make_inner(model), compressor="topk", method="ef", ratio=0.3,
                                  transport="allgather", nonfinite="skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scales = []
    for t in range(4):
        opt.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        h = model.l1.weight.register_hook(_inject) if t == BAD and ctx.rank == 1 else None
        scaler.scale(tc.loss_fn(model(x), y)).backward()
        if h is not None:
            h.remove()
        if sync_first:
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("sync_first", [False, True])
def test_grad_scaler_clipping_recipe(sync_first):
    """``scaler.unscale_(opt)`` before the gradients are averaged records this worker's own inf check (rank 0
    saw none); the optimizer's step checks the averages again, so both scalers back off alike."""
    res = sc.launch(lambda ctx: _clip_recipe(ctx, sync_first), 2, backend="sim")
    for scales, params in res:
        assert scales == [2.0 ** 8] * BAD + [2.0 ** 7] * (4 - BAD), scales
        assert all(bool(torch.isfinite(p).all()) for p in params)
    assert _same(res[0][1], res[1][1])
