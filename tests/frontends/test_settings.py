"""Workers built with different settings get one error naming the setting, on every worker, at
construction (sparsecomm.pipeline.settings): on the SimFabric through the optimizer, and on 2 gloo processes
through the DDP hook."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.errors import MalformedMessage, MismatchError


def _build(ctx, per_rank):
    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 4))
    kw = {k: (v[ctx.rank] if isinstance(v, list) else v) for k, v in per_rank.items()}
    try:
        sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    except MismatchError as e:
        return str(e)
    return None


CASES = [
    # (per-rank settings, the setting named, its values on worker 0 and on the differing worker)
    (dict(compressor="diana", ratio=[0.25, 0.1, 0.25], transport="ring"), "ratio of compressor 'randk'", "0.25", "0.1"),
    (dict(compressor=["diana", "ef21", "diana"], transport="allgather"), "method", "'diana'", "'ef21'"),
    (dict(compressor="powersgd", matrix_approximation_rank=[2, 4, 2]), "matrix_approximation_rank of method "
     "'powersgd'", "2", "4"),
    (dict(compressor="none", transport=["ring", "allgather", "ring"]), "transport", "'ring'", "'allgather'"),
    (dict(compressor="diana", ratio=0.25, warmup_steps=[0, 3, 0]), "warmup_steps", "0", "3"),
    (dict(compressor="diana", ratio=0.25, seed=[1, 1, 2]), "seed", "1", "2"),
    (dict(compressor="none", transport="omnireduce", transport_kwargs=[{"block_size": 64}, {"block_size": 128},
                                                                        {"block_size": 64}]),
     "block_size of transport 'omnireduce'", "64", "128"),
    (dict(compressor="none", bucket_cap_mb=[25, 25, 1]), "bucket_cap_mb", "25.0", "1.0"),
]


@pytest.mark.parametrize("per_rank,name,v0,vr", CASES, ids=[c[1].split()[0] for c in CASES])
def test_a_differing_setting_is_named_with_both_values_on_every_worker(per_rank, name, v0, vr):
    res = sc.launch(functools.partial(_build, per_rank=per_rank), world_size=3, backend="sim")
    r = next(i for i in (1, 2) if any(isinstance(v, list) and v[i] != v[0] for v in per_rank.values()))
    for rank, msg in enumerate(res):
        assert msg is not None, rank
        assert f"{name} is {v0} on worker 0 and {vr} on worker {r} (this is worker {rank})" in msg, msg
        assert "DistributedOptimizer" in msg


def test_settings_given_as_objects_or_names_agree():
    """Settings are compared as built: a typed compressor object and its name agree."""
    def fn(ctx):
        comp = sc.compressors.randk(ratio=0.25) if ctx.rank else "randk"
        hyper = {} if ctx.rank else {"ratio": 0.25}
        with ctx.seeded(0):
            model = nn.Linear(8, 2)
        sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor=comp, method="diana",
                                **hyper)
        return True

    assert sc.launch(fn, world_size=2, backend="sim") == [True, True]


def test_a_forged_settings_header_is_malformed():
    from sparsecomm.pipeline.settings import TAG

    def fn(ctx):
        if ctx.rank == 1:
            ctx.fabric.send(torch.tensor([7, 7], dtype=torch.int64), 0, TAG)
            return None
        try:
            sc.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), init_sync="off")
        except MalformedMessage as e:
            return str(e)

    assert "worker 1 sent a settings header of another protocol" in sc.launch(fn, world_size=2, backend="sim")[0]


def _hook(ctx, per_rank):
    import warnings

    from sparsecomm import ddp as scddp
    from sparsecomm.pipeline.step_size import StepSizeWarning

    net = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
    kw = {k: (v[ctx.rank] if isinstance(v, list) else v) for k, v in per_rank.items()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = scddp.register(net, **kw)
    except MismatchError as e:
        return str(e)
    # built alike: the step-size hint at the parameters' sizes, warned on rank 0 only
    return state.step_size_hint, [str(w.message) for w in caught if issubclass(w.category, StepSizeWarning)]


def _hooks(ctx):
    return [_hook(ctx, dict(compressor="powersgd", matrix_approximation_rank=[2, 4])),
            _hook(ctx, dict(compressor=["diana", "ef21"], transport="allgather")),
            _hook(ctx, dict(compressor="diana", ratio=0.25))]


@pytest.mark.multiprocess
def test_the_hook_names_the_differing_setting_on_every_gloo_rank():
    res = sc.launch(_hooks, world_size=2, backend="gloo")
    for rank, (rank_msg, method_msg, same) in enumerate(res):
        assert "matrix_approximation_rank of method 'powersgd' is 2 on worker 0 and 4 on worker 1 " \
               f"(this is worker {rank})" in rank_msg
        assert "sparsecomm.ddp hook state" in rank_msg
        assert f"method is 'diana' on worker 0 and 'ef21' on worker 1 (this is worker {rank})" in method_msg
        hint, warned = same             # DIANA + rand-k(0.25): omega = 3 on the 16x16 and 4x16 weights
        assert hint.variance == "omega" and hint.factor == pytest.approx(3.0) and hint.n_eff == 1
        assert len(warned) == (1 if rank == 0 else 0) and (not warned or "state.step_size_hint" in warned[0])
