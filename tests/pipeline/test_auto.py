"""transport="auto" per bucket (sparsecomm.pipeline.auto): the choice follows the cost model on the
network it runs on, every worker makes the same one, the decisions are reported, the model is refit where
it is off, and a change of transport mid-training changes no number."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidTypeError, InvalidValueError
from sparsecomm.pipeline import CommPipeline
from sparsecomm.pipeline.auto import Fit, block_density

from experiments.bench import auto as bench

VOCAB, DIM = 4096, 64          # the embedding: 262144 elements, 1024 blocks of 256


#: the exploration (steps 2 .. 1 + 2 k for k candidates), a decision at step 2 + 2 k and another 3 steps
#: later, whose window (2 steps) measured every bucket on its chosen transport
AUTO = {"estimate_steps": 2, "period": 3}


def _steps(k: int) -> int:
    return 2 + 2 * k + 3


@pytest.mark.parametrize("switch,gbps", [
    (False, 10.0),
    # default suite: [False-10.0] covers auto against the per-bucket oracle (the same checks on another link)
    pytest.param(False, 100.0, marks=pytest.mark.slow),
    pytest.param(True, 10.0, marks=pytest.mark.slow),
    pytest.param(True, 100.0, marks=pytest.mark.slow),
])
def test_auto_is_within_5_percent_of_the_per_bucket_oracle_and_beats_every_single_transport(gbps, switch):
    """The model of experiments/bench/auto.py (an EmbeddingBag about 1 % block-dense in the union of 8
    workers, a dense MLP), 8 workers on the SimFabric: auto's step is within 1.05x of the best transport
    per bucket after the fact and no slower than any single transport for the whole model; strictly
    faster than each that is not the fastest on every bucket (omnireduce without a switch, sparse-switch
    with one at 10 Gbit/s are: the oracle is then that transport's step)."""
    net = sc.Network(bandwidth_gbps=gbps, latency_us=2.0)
    services = ["switch", "sparse-switch"] if switch else []
    singles = ["ring", "omnireduce", "allgather"] + (["switch", "sparse-switch"] if switch else [])
    res = bench.run(8, singles, services, _steps(len(singles)), AUTO["period"], {"network": net}, VOCAB, 2)
    auto = res["auto"]
    for t in singles:
        assert all(set(r["measured_s"]) == {t} for r in res[f"only {t}"].values()), (t, res[f"only {t}"])
    assert all(set(r["measured_s"]) == {r["chosen"]} for r in auto.values())
    step = {t: sum(r["measured_s"][t] for r in res[f"only {t}"].values()) for t in singles}
    auto_step = sum(r["measured_s"][r["chosen"]] for r in auto.values())
    oracle = sum(min(res[f"only {t}"][k]["measured_s"][t] for t in singles) for k in auto)
    assert auto_step <= 1.05 * oracle, (auto_step, oracle, {k: r["chosen"] for k, r in auto.items()})
    # the embedding's bucket is sparse in blocks and goes to a transport that sends only non-zero blocks
    emb = max(auto.values(), key=lambda r: r["numel"])
    assert emb["numel"] == VOCAB * DIM and emb["union_density"] < 0.05
    assert emb["chosen"] in ("omnireduce", "sparse-switch")
    for t, s in step.items():      # (1 %: the modelled times of two launches of the same choices vary by 0.1 %)
        assert auto_step <= s * 1.01, (t, s, auto_step)
    best = {min(singles, key=lambda t: res[f"only {t}"][k]["measured_s"][t]) for k in auto}
    for t in singles:
        if best != {t}:      # a transport that is not the oracle's for every bucket is strictly slower
            assert auto_step < step[t], (t, step[t], auto_step)


def _densities(ctx, own: float):
    """A bucket whose block density differs per worker (worker r: r+1 blocks of 64, its own ones)."""
    torch.set_num_threads(1)
    pipe = CommPipeline("none", "auto", transport_kwargs={"estimate_steps": 1, "period": 2})
    x = torch.zeros(64 * 256)
    nb = 1 + int(own * 63 * ctx.rank)
    x.view(64, 256)[ctx.rank::4][:nb] = 1.0
    for _ in range(5):     # exploring ring, omnireduce, allgather in steps 2-4, a decision at step 5
        pipe.begin_step()
        pipe.reduce(x.clone(), 0)
    (row,) = pipe.stats.decisions
    return block_density(x, 256), row


def test_workers_with_different_local_densities_choose_alike():
    out = sc.launch(functools.partial(_densities, own=0.2), 4, network=sc.Network(bandwidth_gbps=10.0))
    own = [d for d, _ in out]
    assert len(set(own)) > 1, "the workers' own densities differ"
    rows = [r for _, r in out]
    assert all(r == rows[0] for r in rows)
    assert rows[0]["density"] == pytest.approx(sum(own) / len(own))


def _refit(ctx):
    torch.set_num_threads(1)
    pipe = CommPipeline("none", "auto", transport_kwargs={"estimate_steps": 1, "period": 2,
                                                          "candidates": ["ring"]})
    for _ in range(5):
        pipe.begin_step()
        pipe.reduce(torch.ones(1 << 14), 0)
    return pipe.chooser.fits["ring"], pipe.chooser.refits, pipe.stats.decisions[0]


def test_the_model_is_within_10_percent_for_the_ring_on_the_simfabric_and_not_reported(caplog):
    with caplog.at_level(logging.INFO, logger="sparsecomm.pipeline.auto"):
        out = sc.launch(_refit, 2, network=sc.Network(bandwidth_gbps=10.0))
    fit, refits, row = out[0]
    assert refits == 0 and fit.a == pytest.approx(1.0, rel=0.1)
    assert row["measured_s"]["ring"] == pytest.approx(row["measured_predicted_s"]["ring"], rel=0.1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_prediction_off_by_more_than_25_percent_is_reported_and_refit(caplog):
    """The omnireduce closed form (colocated) over-predicts the SimFabric's dense bucket by about 50 %
    (tests/theory/test_costs.py checks the dedicated deployment): the first window on it reports it
    and the refit model predicts the next window within 25 %."""
    def run(ctx):
        torch.set_num_threads(1)
        pipe = CommPipeline("none", "auto", transport_kwargs={"estimate_steps": 1, "period": 2,
                                                              "candidates": ["omnireduce"]})
        rows = []
        for _ in range(6):      # decisions at 3 (from step 2: refit), 5 (checked)
            pipe.begin_step()
            pipe.reduce(torch.ones(1 << 16), 0)
            rows.append(dict(pipe.stats.decisions[0]) if pipe.stats.decisions else None)
        return rows, pipe.chooser.fits["omnireduce"]

    with caplog.at_level(logging.INFO, logger="sparsecomm.pipeline.auto"):
        out = sc.launch(run, 4, network=sc.Network(bandwidth_gbps=10.0))
    rows, fit = out[0]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "omnireduce" in r.getMessage()]
    assert warned, "the first prediction is off by more than 25 %"
    assert fit.a != 1.0 or fit.c != 0.0
    last = rows[-1]
    assert abs(last["measured_s"]["omnireduce"] / last["measured_predicted_s"]["omnireduce"] - 1) <= 0.25


def test_fit_solves_time_and_per_message_cost():
    f = Fit()
    f.refit([(1.0, 10, 1.0 * 1.5 + 10 * 0.01), (2.0, 100, 2.0 * 1.5 + 100 * 0.01)])
    assert f.a == pytest.approx(1.5) and f.c == pytest.approx(0.01)
    g = Fit(c=0.0)
    g.refit([(1.0, 10, 0.5)])          # a single observation: the scale absorbs it
    assert g.a == pytest.approx(0.5) and g.c == 0.0


def _grad(rank: int, step: int) -> torch.Tensor:
    """Dense gradients for 3 steps, then one block of 64 per worker (EF21's message, the difference of
    two gradients, is then 2 blocks)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(64 * 256, generator=g)
    if step > 3:
        x.view(64, 256)[(rank + step) % 64 + 1:] = 0
        x.view(64, 256)[:(rank + step) % 64] = 0
    return x


def _ef21(ctx, steps: int, plan: list[str] | None):
    """EF21 (its state: the worker's estimate per bucket) around the identity: through auto (``plan``
    None), or by hand following ``plan`` (the transport of every step: a new pipeline, loading the state
    of the last, at every change)."""
    torch.set_num_threads(1)
    kw = dict(compressor="identity", method="ef21")
    pipe = CommPipeline(transport="auto", transport_kwargs={"estimate_steps": 1, "period": 2}, **kw) \
        if plan is None else None
    outs, used = [], []
    for s in range(1, steps + 1):
        if plan is not None and (pipe is None or pipe.transport.name != plan[s - 1]):
            state = pipe.state_dict() if pipe is not None else None
            pipe = CommPipeline(transport=plan[s - 1], **kw)
            if state is not None:
                pipe.load_state_dict(state)
        pipe.begin_step()
        g = _grad(ctx.rank, s)
        if plan is None:
            used.append(pipe.chooser.pick(0, "dense", g).name)     # the transport of this step's call
        outs.append(pipe.reduce(g, 0).clone())
    return outs, used


def test_a_re_decision_mid_training_gives_the_same_numbers_as_the_new_transport_from_that_step():
    """A bucket whose gradients turn block-sparse after 3 steps moves from ring to omnireduce at a later
    decision; EF21's state goes with it: every step's estimate is bit for bit that of a run that
    switches by hand (a new pipeline on the new transport, loading the state) at the same step."""
    net = sc.Network(bandwidth_gbps=10.0)
    auto = sc.launch(functools.partial(_ef21, steps=9, plan=None), 4, network=net)
    outs, used = auto[0]
    assert all(u == used for _, u in auto)
    assert len(set(used)) >= 2, f"the test needs a change of transport: {used}"
    by_hand = sc.launch(functools.partial(_ef21, steps=9, plan=used), 4, network=net)
    for r in range(4):
        for a, b in zip(auto[r][0], by_hand[r][0]):
            assert torch.equal(a, b)


def test_auto_options_are_checked_and_name_the_valid_ones():
    with pytest.raises(InvalidTypeError, match="estimate_steps"):
        sc.launch(lambda ctx: CommPipeline("none", "auto", transport_kwargs={"segment_bytes": 1}), 1)
    with pytest.raises(InvalidValueError, match="ring"):
        sc.launch(lambda ctx: CommPipeline("none", "auto", transport_kwargs={"candidates": ["rnig"]}), 1)
    with pytest.raises(InvalidValueError, match="period"):
        sc.launch(lambda ctx: CommPipeline("none", "auto", transport_kwargs={"period": 1}), 1)


def _default_and_auto(ctx):
    out = []
    for transport, kw in (("default", None), ("auto", {"estimate_steps": 1, "period": 2})):
        with ctx.seeded(0):
            net = torch.nn.Linear(64, 4)
        opt = sc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), transport=transport,
                                      transport_kwargs=kw)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(6):
            opt.zero_grad()
            net(torch.randn(8, 64, generator=g)).sum().backward()
            opt.step()
        out.append((opt.transport.name, bool(opt.compression_stats().get("transport_decisions"))))
    return out


def test_the_default_transport_is_one_fixed_transport_and_auto_is_the_per_bucket_choice():
    """The frontends' default (``transport="default"``) is the payload kind's transport for the whole
    model, with no measurement or decision behind it (run after run the same summation order); ``"auto"``
    starts from the same transport and decides per bucket."""
    (fixed, fixed_decided), (start, auto_decided) = sc.launch(_default_and_auto, world_size=2)[0]
    assert fixed == start == "ring"
    assert not fixed_decided and auto_decided


def _prices(ctx):
    from sparsecomm.theory import costs
    from sparsecomm.transports.base import CallShape

    call = CallShape(1 << 20, 4, "dense", 0, 0.05, 0.1)
    net = {"bandwidth_gbps": 10.0, "latency_us": 5.0}
    out = {}
    for name in sc.transports.available():
        if name == "native":     # torch.distributed's all-reduce: priced as the ring, needs a TorchFabric
            continue
        kw = {"block_size": 64, "lanes": 8, "channels": 4} if name == "omnireduce" else {}
        out[name] = sc.transports.get(name, ctx.fabric, **kw).cost(call, **net)
    mine = costs.omnireduce_allreduce(2, 1 << 20, density=0.05, union_density=0.1, block_size=64, lanes=8,
                                      channels=4, deployment="colocated", **net)
    stock = costs.omnireduce_allreduce(2, 1 << 20, density=0.05, union_density=0.1, deployment="colocated", **net)
    return out, mine, stock


def test_every_transport_prices_a_call_with_its_own_configuration():
    """``auto`` asks each transport for its cost (``Transport.cost``): a transport built with other options
    is priced with them, and every registered transport (but ``native``, which needs torch.distributed)
    has a model."""
    out, mine, stock = sc.launch(_prices, 2, network=sc.Network(bandwidth_gbps=10.0), services=["switch"])[0]
    assert set(out) == set(sc.transports.available()) - {"native"}
    assert out["omnireduce"] == mine and mine != stock
    assert all(c.time_s > 0 for c in out.values())
