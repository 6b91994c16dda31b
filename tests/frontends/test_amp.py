"""``torch.amp.GradScaler`` with torch's plain recipe (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``, unchanged) on 2 gloo processes, over :class:`~sparsecomm.DistributedOptimizer` and over
the DDP hook (:func:`sparsecomm.ddp.register`), with ``nonfinite="skip"``: an Inf injected into one rank's
gradient at a known step is skipped on both ranks, the scaler lowers its scale on both, the method state
and the parameters are unchanged by that step, training goes on, and the replicas stay bit-identical."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import sparsecomm as sc

from tests import _train_common as tc

STEPS, BAD, INIT_SCALE = 5, 2, 2.0 ** 10
SMALL_CAP = 300 / 2 ** 20          # several buckets: the Inf is in one of them only
CONFIGS = {"ef": dict(compressor="topk", method="ef", ratio=0.3, transport="allgather"),
           "diana": dict(compressor="randk", method="diana", ratio=0.3, transport="allgather"),
           "powersgd": dict(compressor="powersgd", transport="allgather"),
           "fp16": dict(compressor="fp16")}        # stateless, on the default transport (native)


def _inject(grad: torch.Tensor) -> torch.Tensor:
    g = grad.clone()
    g.view(-1)[3] = float("inf")
    return g


def _method_state(frontend, opt, state) -> dict:
    sd = state.state_dict()["pipeline"] if frontend == "ddp" else opt.state_dict()["sparsecomm"]
    return {"method": sd["method"], "generators": sd["generators"], "param_generators": sd["param_generators"]}


def _run(ctx, frontend: str, kw: dict) -> dict:
    from sparsecomm import ddp as scddp

    torch.set_num_threads(1)
    model = tc.MLP(0, with_unused=False)
    state = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # step-size hints; torch's FutureWarning about its protocol
        if frontend == "ddp":
            net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL_CAP)
            state = scddp.register(net, nonfinite="skip", **kw)
            opt = tc.make_inner(net)
        else:
            net = model
            opt = sc.DistributedOptimizer(tc.make_inner(model), nonfinite="skip", bucket_cap_mb=SMALL_CAP, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        out: dict = {"scale": [], "params": [], "states": []}
        for t in range(STEPS):
            opt.zero_grad()
            x, y = tc.batch(ctx.rank, t)
            h = model.l1.weight.register_hook(_inject) if t == BAD and ctx.rank == 1 else None
            loss = tc.loss_fn(net(x), y)
            scaler.scale(loss).backward()           # torch's recipe, unchanged
            scaler.step(opt)
            scaler.update()
            if h is not None:
                h.remove()
            out["scale"].append(scaler.get_scale())
            out["params"].append([p.detach().clone() for p in model.parameters()])
            out["states"].append(_method_state(frontend, opt, state))
    stats = state.compression_stats() if frontend == "ddp" else opt.compression_stats()
    out["skipped"] = stats["skipped_steps"]
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _worker(ctx) -> dict:
    return {(frontend, name): _run(ctx, frontend, kw) for frontend in ("optimizer", "ddp")
            for name, kw in CONFIGS.items()}


@pytest.mark.multiprocess
def test_grad_scaler_skips_a_non_finite_step_on_every_rank_gloo():
    res = sc.launch(functools.partial(_worker), world_size=2, backend="gloo")
    for key in res[0]:
        r0, r1 = res[0][key], res[1][key]
        for r in (r0, r1):
            # the scaler skipped the step (and lowered its scale) on both ranks, and only that one
            assert r["scale"] == [INIT_SCALE] * BAD + [INIT_SCALE / 2] * (STEPS - BAD), (key, r["scale"])
            assert r["skipped"] == 1, key
            # the skipped step changed neither the parameters nor the method state or generators
            assert _same(r["params"][BAD], r["params"][BAD - 1]), key
            assert _same(r["states"][BAD], r["states"][BAD - 1]), key
            # and training went on
            for t in range(1, STEPS):
                if t != BAD:
                    assert not _same(r["params"][t], r["params"][t - 1]), (key, t)
            assert all(bool(torch.isfinite(p).all()) for p in r["params"][-1])
        # replicas bit-identical at every step
        assert _same(r0["params"], r1["params"]), key
