"""Nothing silently wrong at the frontends.

- bad numbers at construction are an ``InvalidValueError`` / ``InvalidTypeError`` naming the argument
  (:mod:`sparsecomm.validate`), not a value accepted and a raw Python error later (a ``ZeroDivisionError``
  at the first step, ``int(nan)``, ``Generator.manual_seed(2**64)``) or never (NaN compares false);
- a checkpoint saved by another method or compressor is refused, naming both, instead of failing later on
  the transport's agreement ("shared indices");
- a worker whose step counter differs (a tampered or mixed-up checkpoint) is a ``MismatchError`` on every
  rank at the next step, whatever ``verify_replicas_every`` (on real gloo processes);
- ``DistributedOptimizer`` over a model that ``DistributedDataParallel`` wraps (which averages the
  gradients itself) is refused, however it is built (on real gloo processes).

The real-process checks give every error within 5 s under a 30 s fabric timeout, on every rank.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidTypeError, InvalidValueError, MismatchError, SparseCommError

from tests._faults_common import outcome

TIMEOUT = 30.0
BOUND = 5.0
NAN, INF = math.nan, math.inf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _opt(**kw):
    """Build a DistributedOptimizer with ``kw`` on a one-worker sim launch; the error, or None."""
    def fn(ctx):
        model = _model()
        try:
            sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            return e
        return None
    return sc.launch(fn, 1)[0]


# ------------------------------------------------------------------ bad numbers at construction
@pytest.mark.parametrize("kw, cls, name", [
    (dict(bucket_cap_mb=NAN), InvalidValueError, "bucket_cap_mb"),
    (dict(bucket_cap_mb=INF), InvalidValueError, "bucket_cap_mb"),
    (dict(bucket_cap_mb=0), InvalidValueError, "bucket_cap_mb"),
    (dict(warmup_steps=NAN), InvalidTypeError, "warmup_steps"),
    (dict(warmup_steps=-1), InvalidValueError, "warmup_steps"),
    (dict(backward_passes_per_step=NAN), InvalidTypeError, "backward_passes_per_step"),
    (dict(backward_passes_per_step=True), InvalidTypeError, "backward_passes_per_step"),
    (dict(min_compress_size=NAN), InvalidTypeError, "min_compress_size"),
    (dict(seed=2 ** 64), InvalidValueError, "seed"),
    (dict(seed=2 ** 63), InvalidValueError, "seed"),
    (dict(seed=-1), InvalidValueError, "seed"),
    (dict(seed=1.5), InvalidTypeError, "seed"),
    (dict(transport="auto", transport_kwargs={"block_size": 0}), InvalidValueError, "block_size"),
    (dict(transport="auto", transport_kwargs={"block_size": -4}), InvalidValueError, "block_size"),
    (dict(transport="auto", transport_kwargs={"block_size": 2.5}), InvalidTypeError, "block_size"),
    (dict(transport="auto", transport_kwargs={"period": True}), InvalidTypeError, "period"),
    (dict(transport="auto", transport_kwargs={"margin": NAN}), InvalidValueError, "margin"),
])
def test_bad_optimizer_numbers_are_refused_at_construction_naming_the_argument(kw, cls, name):
    err = _opt(**kw)
    assert type(err) is cls and name in str(err), repr(err)


def test_the_largest_seed_and_seed_zero_still_train():
    """The bounds are tight: ``2**63 - 1`` (so that ``seed + rank`` stays a seed torch takes) and 0 run."""
    def fn(ctx, seed):
        model = _model()
        opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="randk",
                                      ratio=0.5, seed=seed)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        return True
    for seed in (0, 2 ** 63 - 1):
        assert sc.launch(functools.partial(fn, seed=seed), 2) == [True, True]


@pytest.mark.parametrize("kw, cls, name", [
    (dict(seed=2 ** 64), InvalidValueError, "seed"),
    (dict(seed=-3), InvalidValueError, "seed"),
    (dict(warmup_steps=NAN), InvalidTypeError, "warmup_steps"),
    (dict(min_compress_size=NAN), InvalidTypeError, "min_compress_size"),
])
def test_bad_hook_state_numbers_are_refused_before_any_communication(kw, cls, name):
    """No process group is needed to see them: the check comes first."""
    with pytest.raises(cls, match=name):
        sc.ddp.CommHookState(**kw)


@pytest.mark.parametrize("field", ["bandwidth_gbps", "latency_us", "loss", "timeout_s", "payload_fraction"])
@pytest.mark.parametrize("value", [NAN, INF, -1.0, "1"])
def test_every_number_of_a_network_is_checked(field, value):
    cls = InvalidTypeError if isinstance(value, str) else InvalidValueError
    if field == "latency_us" and value == INF:
        cls = InvalidValueError
    with pytest.raises(cls, match=field):
        sc.Network(**{field: value})


@pytest.mark.parametrize("kw, cls, what", [
    (dict(seed=-1), InvalidValueError, "seed"),
    (dict(seed=NAN), InvalidTypeError, "seed"),
    (dict(stragglers={1: NAN}), InvalidValueError, "straggler"),
    (dict(stragglers={1: 0.5}), InvalidValueError, "straggler"),
    (dict(crash={0: -1}), InvalidValueError, "crash"),
    (dict(crash={0: NAN}), InvalidTypeError, "crash"),
])
def test_a_networks_seed_stragglers_and_crashes_are_checked(kw, cls, what):
    with pytest.raises(cls, match=what):
        sc.Network(**kw)


def test_a_valid_network_keeps_its_numbers():
    net = sc.Network(bandwidth_gbps=10, latency_us=0, loss=0.5, stragglers={1: 2}, crash={2: 0},
                     timeout_s=5, payload_fraction=1)
    assert (net.bandwidth_gbps, net.latency_us, net.loss, net.stragglers, net.crash) == (10.0, 0.0, 0.5,
                                                                                          {1: 2.0}, {2: 0})


@pytest.mark.parametrize("kw, cls, name", [
    (dict(timeout_s=0), InvalidValueError, "timeout_s"),
    (dict(timeout_s=-1), InvalidValueError, "timeout_s"),
    (dict(timeout_s=NAN), InvalidValueError, "timeout_s"),
    (dict(timeout_s=NAN, backend="gloo"), InvalidValueError, "timeout_s"),
    (dict(world_size=True), InvalidTypeError, "world_size"),
    (dict(world_size=2.0), InvalidTypeError, "world_size"),
    (dict(world_size=0), InvalidValueError, "world_size"),
])
def test_bad_launch_numbers_are_refused_before_anything_starts(kw, cls, name):
    ran = []
    kw = {"world_size": 2, **kw}
    with pytest.raises(cls, match=name):
        sc.launch(ran.append, **kw)
    assert not ran


def test_a_torch_fabric_refuses_a_nan_timeout_before_anything_else():
    """Checked before the process group is looked at (none is initialised here)."""
    with pytest.raises(InvalidValueError, match="timeout_s"):
        sc.TorchFabric(timeout_s=NAN)


def test_a_stats_loggers_step_must_be_an_integer():
    from sparsecomm.integrations import StatsLogger

    def fn(ctx):
        model = _model()
        opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        log = StatsLogger(opt, lambda values, step: None)
        out = [outcome(lambda: log(step=NAN)), outcome(lambda: log(step=-1)), outcome(lambda: log(step=True))]
        return out, log(step=3) is not None
    out, logged = sc.launch(fn, 1)[0]
    assert [c for c, _, _ in out] == ["InvalidTypeError", "InvalidValueError", "InvalidTypeError"]
    assert all("step" in text for _, text, _ in out) and logged


# ------------------------------------------------------------------ a worker's step counter differs
#: (transport, verify_replicas_every, keys of rank 1's "sparsecomm" entry moved one step ahead)
TAMPERED = [
    ("native", 5, ("steps",)),          # the counter the replica guard reads (every 5th step: the 3rd is not)
    ("native", 3, ("steps",)),          # ... and one rank's 3rd step would be a guarded one
    ("native", 100, ("steps",)),        # the default: accepted before
    ("native", 3, ("steps", "step")),   # a checkpoint of another step altogether
    ("allgather", 3, ("steps",)),
    ("ring", 3, ("steps",)),
]


def _tampered_steps(ctx, transport: str, every: int, keys: tuple[str, ...], group=None):
    """Two clean steps, then every rank reloads its own checkpoint, rank 1's with its step counter one
    ahead (the ``keys`` of its ``"sparsecomm"`` entry); the outcome of the next step on this rank."""
    torch.set_num_threads(1)
    model = _model()
    kw = dict(compressor="topk", method="ef", ratio=0.25) if transport == "allgather" else {}
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), transport=transport,
                                  verify_replicas_every=every, process_group=group, **kw)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    for _ in range(2):
        step()
    sd = opt.state_dict()
    if ctx.rank == 1:
        for k in keys:
            sd["sparsecomm"][k] += 1
    opt.load_state_dict(sd)
    return outcome(step)


def _every_gloo_case(ctx):
    """This module's real-process cases in one launch, on this rank: ``_under_ddp`` and
    ``_hook_saved_then_loaded`` first (each builds its own models, DDPs and hooks on the launch's group,
    and ends with errors at construction or at loading, before any communication), then every case of
    ``TAMPERED``, each on a gloo process group of its own (what one case leaves unreceived after its
    MismatchError cannot reach the next)."""
    import torch.distributed as dist

    return {"under ddp": _under_ddp(ctx), "hook checkpoint": _hook_saved_then_loaded(ctx),
            "tampered": [_tampered_steps(ctx, *case, group=dist.new_group(backend="gloo")) for case in TAMPERED]}


@pytest.fixture(scope="module")
def gloo_outcomes():
    """What ``_every_gloo_case`` returned on both ranks, from one 2-process gloo launch."""
    return sc.launch(_every_gloo_case, 2, backend="gloo", timeout_s=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", range(len(TAMPERED)), ids=lambda i: "-".join(map(str, TAMPERED[i][:2])) +
                         "-" + "+".join(TAMPERED[i][2]))
def test_a_step_counter_that_differs_is_a_mismatch_at_the_next_step_on_every_rank(case, gloo_outcomes):
    for per_rank in (r["tampered"] for r in gloo_outcomes):
        cls, text, secs = per_rank[case]
        assert cls == "MismatchError" and "step" in text, (TAMPERED[case], cls, text)
        assert secs < BOUND, (TAMPERED[case], secs)


# ------------------------------------------------------------------ DistributedOptimizer under stock DDP
def _under_ddp(ctx):
    """Every way of building DistributedOptimizer over parameters that DDP averages, then one that
    does not overlap DDP's: ``(case, outcome)`` per case on this rank."""
    torch.set_num_threads(1)
    DDP = torch.nn.parallel.DistributedDataParallel
    sc.methods.build("topk", ratio=0.25)                # imports the optimizer's parts outside the timing
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    out = []

    def build(params, **kw):
        return sc.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), compressor="topk", ratio=0.25,
                                       transport="allgather", **kw)

    ddp = DDP(_model())
    out.append(("ddp parameters", outcome(lambda: build(ddp.parameters()))))
    out.append(("inner module's parameters", outcome(lambda: build(ddp.module.parameters()))))
    out.append(("param groups", outcome(lambda: build([{"params": ddp.module[0].parameters()},
                                                       {"params": ddp.module[2].parameters(), "lr": 0.01}]))))
    out.append(("module=", outcome(lambda: build(_model().parameters(), module=ddp))))
    hooked = DDP(_model())
    sc.ddp.register(hooked, transport="allgather")
    out.append(("ddp with sparsecomm's hook", outcome(lambda: build(hooked.parameters()))))

    model = _model()
    opt = build(model.parameters())                     # the optimizer first, DDP after it
    late = DDP(model)

    def first_step():
        opt.zero_grad()
        late(x).square().mean().backward()
        opt.step()
    out.append(("wrapped after the optimizer", outcome(first_step)))

    other, ddp_part = _model(), DDP(torch.nn.Linear(8, 1))  # DDP elsewhere in the process: not ours
    fine = build(other.parameters())

    def unrelated():
        fine.zero_grad()
        other(x).square().mean().backward()
        ddp_part(x).sum().backward()
        fine.step()
    out.append(("unrelated DDP", outcome(unrelated)))
    return out


@pytest.mark.multiprocess
def test_distributed_optimizer_over_a_ddp_model_is_refused_on_every_rank_however_it_is_built(gloo_outcomes):
    res = [r["under ddp"] for r in gloo_outcomes]
    for cases in res:
        *refused, (name, (cls, text, secs)) = cases
        assert name == "unrelated DDP" and cls is None, (cls, text)
        for name, (cls, text, secs) in refused:
            assert cls == "IncompatibleError", (name, cls, text)
            assert "DistributedDataParallel" in text and "DistributedOptimizer" in text, text
            assert "unwrap the model" in text and "sparsecomm.ddp.register" in text, text
            assert secs < BOUND, (name, secs)
        assert "at the first step" in dict(refused)["wrapped after the optimizer"][1]


# ------------------------------------------------------------------ checkpoints of another method or compressor
def _saved_then_loaded(ctx, saved: dict, loaded: dict):
    """Rank ``ctx.rank`` trains two steps with ``saved``'s method and compressor, checkpoints, and
    loads its own checkpoint into an optimizer built with ``loaded``'s; the outcome of loading."""
    model = _model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))

    def build(kw):
        return sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), transport="allgather", **kw)
    opt = build(saved)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    sd = opt.state_dict()
    other = build(loaded)
    return outcome(lambda: other.load_state_dict(sd))


@pytest.mark.parametrize("loaded, names", [
    (dict(method="ef", compressor="randk", ratio=0.25), ("'topk'", "'randk'")),
    (dict(compressor="randk", ratio=0.25), ("'ef'", "'none'", "'topk'", "'randk'")),
])
def test_a_checkpoint_of_another_method_or_compressor_is_refused_naming_both(loaded, names):
    saved = dict(method="ef", compressor="topk", ratio=0.25)
    res = sc.launch(functools.partial(_saved_then_loaded, saved=saved, loaded=loaded), 2)
    for cls, text, _ in res:
        assert cls == "MismatchError" and "checkpoint" in text and "shared indices" not in text, (cls, text)
        assert all(n in text for n in names), text


def test_a_checkpoint_of_the_same_method_and_compressor_still_loads():
    kw = dict(method="ef", compressor="topk", ratio=0.25)
    res = sc.launch(functools.partial(_saved_then_loaded, saved=kw, loaded=dict(kw, ratio=0.5)), 2)
    assert [cls for cls, _, _ in res] == [None, None]


def _hook_saved_then_loaded(ctx):
    torch.set_num_threads(1)
    net = torch.nn.parallel.DistributedDataParallel(_model())
    state = sc.ddp.register(net, method="ef", compressor="topk", ratio=0.25, transport="allgather")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(3):
        net.zero_grad()
        net(x).square().mean().backward()
    sd = state.state_dict()
    other = sc.ddp.CommHookState(method="ef", compressor="randk", ratio=0.25, transport="allgather")
    return outcome(lambda: other.load_state_dict(sd))


@pytest.mark.multiprocess
def test_a_hook_state_refuses_a_checkpoint_of_another_compressor_on_every_rank(gloo_outcomes):
    for cls, text, secs in (r["hook checkpoint"] for r in gloo_outcomes):
        assert cls == "MismatchError" and "'topk'" in text and "'randk'" in text, (cls, text)
        assert secs < BOUND


# ------------------------------------------------------------------ checkpoint files
def test_a_truncated_checkpoint_file_is_named_and_called_truncated(tmp_path):
    from sparsecomm import checkpoint

    def fn(ctx):
        model = _model()
        opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), method="ef",
                                      compressor="topk", ratio=0.25)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        checkpoint.save(opt.state_dict(), tmp_path / "rank0.pt")
        back = checkpoint.load(tmp_path / "rank0.pt")
        opt.load_state_dict(back)
        return back["sparsecomm"]["steps"]
    assert sc.launch(fn, 1) == [1]
    whole = (tmp_path / "rank0.pt").read_bytes()
    assert not [p.name for p in tmp_path.iterdir() if p.name != "rank0.pt"]       # no temporary left
    for cut in (len(whole) - 1, len(whole) - 21, len(whole) - 22, len(whole) - 30, len(whole) // 2, 10, 0):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(whole[:cut])
        with pytest.raises(InvalidValueError) as e:
            checkpoint.load(bad)
        assert str(bad) in str(e.value) and "truncated" in str(e.value), (cut, str(e.value))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(InvalidValueError, match="junk.pt"):
        checkpoint.load(junk)


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    from sparsecomm import checkpoint

    target = tmp_path / "ckpt.pt"
    checkpoint.save({"steps": 1}, target)
    with pytest.raises(Exception):
        checkpoint.save({"steps": 2, "bad": lambda: None}, target)     # a lambda cannot be pickled
    assert checkpoint.load(target) == {"steps": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
