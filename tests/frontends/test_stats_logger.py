"""The communication statistics as logged scalars (sparsecomm/integrations/stats.py): the values are those
``compression_stats()`` and ``last_stats`` report, the cadence is every N steps, and the sinks people use
(a callable, TensorBoard's SummaryWriter read back from its event files, a wandb run) take them."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidTypeError, InvalidValueError
from sparsecomm.integrations import NAMES, StatsLogger, scalars

NET = sc.Network(bandwidth_gbps=10, latency_us=5)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _train(ctx, steps: int, every: int, sink=None):
    """Rank ``ctx.rank`` trains a small model with top-k through the optimizer and logs with a
    StatsLogger into ``sink(ctx)`` (rank 0; a list elsewhere); returns, per logged step, what the logger
    returned and sent, and per step what the optimizer reported then."""
    with ctx.seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 1))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compressor="topk", ratio=0.25,
                                  transport="allgather")
    sent = []
    target = sink(ctx) if sink is not None and ctx.rank == 0 else (lambda values, step: sent.append((step, values)))
    log = StatsLogger(opt, target, every=every)
    g = torch.Generator().manual_seed(ctx.rank)
    logged, reported = [], {}
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        s = opt.compression_stats()
        reported[s["steps"]] = (dict(s), opt.last_stats.as_dict())
        values = log()
        if values is not None:
            logged.append((s["steps"], values))
        assert log() is None                                 # once per step, however often it is called
    if hasattr(target, "close"):
        target.close()
    return logged, sent, reported


def test_logged_values_are_what_the_optimizer_reports():
    out = sc.launch(functools.partial(_train, steps=7, every=3), world_size=2, backend="sim", network=NET)
    for logged, sent, reported in out:
        assert sent == logged and [step for step, _ in logged] == [3, 6]      # every 3rd step, and only then
        for step, values in logged:
            s, last = reported[step]
            assert list(values) == ["sparsecomm/" + n for n in NAMES]
            v = {k.removeprefix("sparsecomm/"): x for k, x in values.items()}
            for k in ("bytes_dense", "bytes_payload", "compression_factor", "bytes_sent", "compression_factor_sent",
                      "steps"):
                assert _same(v[k], s[k]), k
            assert v["bytes_saved"] == s["bytes_dense"] - s["bytes_payload"] > 0
            assert v["compression_factor"] > 1.5            # top-k at 1/4 sends values and indices
            assert v["step_bytes_sent"] == last["bytes_sent"] > 0
            assert v["step_comm_time_s"] == last["wall_time_s"] > 0
            assert v["step_modelled_time_s"] == last["modelled_time_s"] > 0     # SimFabric's network model
        assert logged[1][1]["sparsecomm/bytes_sent"] > logged[0][1]["sparsecomm/bytes_sent"]    # cumulative


def test_cadence_follows_the_step_given():
    class Source:
        last_stats = sc.CommStats()

        def compression_stats(self):
            return {"bytes_dense": 8, "bytes_payload": 2, "compression_factor": 4.0, "bytes_sent": 4,
                    "compression_factor_sent": 2.0, "steps": 0}

    seen = []
    log = StatsLogger(Source(), lambda values, step: seen.append(step), every=4, prefix="")
    for step in [0, 1, 2, 3, 4, 4, 5, 8, 9, 12]:
        log(step=step)
    assert seen == [0, 4, 8, 12]
    assert scalars(Source(), prefix="x.")["x.bytes_saved"] == 6


def test_summary_writer_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    run = functools.partial(_train, steps=4, every=2, sink=lambda ctx: SummaryWriter(str(tmp_path / "tb")))
    logged, _, _ = sc.launch(run, world_size=2, backend="sim", network=NET)[0]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted("sparsecomm/" + n for n in NAMES)
    assert [step for step, _ in logged] == [2, 4]
    for step, values in logged:
        for tag, value in values.items():
            (event,) = [e for e in acc.Scalars(tag) if e.step == step]
            assert _same(event.value, torch.tensor(float(value), dtype=torch.float32).item()), (tag, step)


def test_wandb_run_takes_them():
    import wandb

    run = wandb.init(mode="disabled")
    try:
        train = functools.partial(_train, steps=3, every=1, sink=lambda ctx: run)
        logged, _, _ = sc.launch(train, world_size=2, backend="sim", network=NET)[0]
        summary = dict(run.summary)
        assert summary.pop("sparsecomm/step") == 3
        assert summary == logged[-1][1] and summary["sparsecomm/bytes_saved"] > 0
    finally:
        run.finish()


def test_bad_sources_and_sinks_are_named():
    class Source:
        last_stats = sc.CommStats()

        def compression_stats(self):
            return {"bytes_dense": 0, "bytes_payload": 0, "compression_factor": math.nan, "bytes_sent": 0,
                    "compression_factor_sent": math.nan, "steps": 0}

    with pytest.raises(InvalidTypeError, match="compression_stats"):
        StatsLogger(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), print)
    with pytest.raises(InvalidTypeError, match="SummaryWriter"):
        StatsLogger(Source(), "runs/")
    with pytest.raises(InvalidValueError, match="every"):
        StatsLogger(Source(), print, every=0)
