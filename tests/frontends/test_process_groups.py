"""Process groups: the transports, DistributedOptimizer and the DDP hook over a subgroup of the job.

One launch of 4 gloo ranks builds two splits of the job into data-parallel groups of 2, ``{0,1},{2,3}``
and the interleaved ``{0,2},{1,3}`` (which catches a fabric rank used as a job rank), and runs every
check in each split; the groups of a split run at the same time, each on its own data (seeded by the
job rank), so a group's result equal to its own members' sum is also the proof that the other group's
messages did not reach it.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import sparsecomm as sc

pytestmark = pytest.mark.multiprocess

SPLITS = {"blocks": ([0, 1], [2, 3]), "interleaved": ([0, 2], [1, 3])}
N = 1000          # elements of a transport's input: several OmniReduce blocks, some zero
STEPS = 3         # training steps of the optimizer and the DDP checks
LR = 0.1


def _vector(rank: int) -> torch.Tensor:
    """Job rank ``rank``'s input: distinct per rank, with zero blocks at rank-dependent places."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(100 + rank))
    x[(rank % 3) * 256:(rank % 3) * 256 + 256] = 0
    return x


def _sparse(rank: int) -> sc.Payload:
    """Job rank ``rank``'s top-k style payload (worker-specific indices)."""
    idx = torch.arange(rank, N, 7)[:50]
    return sc.Payload("sparse", _vector(rank)[idx] + 1.0, torch.Size([N]), torch.float32, indices=idx)


def _model(rank: int) -> nn.Module:
    torch.manual_seed(rank)           # a different model per rank: the replicas come from the group's rank 0
    return nn.Linear(8, 1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _train(model: nn.Module, rank: int, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    for t in range(STEPS):
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference(members: list[int]) -> list[torch.Tensor]:
    """SGD on the average of the members' gradients, from the first member's model (what data
    parallelism over ``members`` computes)."""
    model = _model(members[0])
    for t in range(STEPS):
        grads = []
        for r in members:
            model.zero_grad()
            x, y = _batch(r, t)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * (grads[0][i] + grads[1][i]) / 2
    return [p.detach().clone() for p in model.parameters()]


def _checks(ctx) -> dict:
    import torch.distributed as dist

    from sparsecomm.errors import IncompatibleError, InvalidValueError, PeerFailure, ServiceNotStarted

    torch.set_num_threads(1)
    me = ctx.rank
    # every rank creates every group, in the same order (torch.distributed's rule for new_group)
    groups = {name: [dist.new_group(m) for m in split] for name, split in SPLITS.items()}
    out: dict = {}
    for name, split in SPLITS.items():
        mine = next(i for i, m in enumerate(split) if me in m)
        pg, other = groups[name][mine], groups[name][1 - mine]
        res: dict = {"members": split[mine]}
        fabric = sc.TorchFabric(group=pg, timeout_s=60)
        res["fabric"] = (fabric.rank, fabric.world_size, fabric.native_group is pg)
        for t in ("native", "ring", "omnireduce", "allgather"):
            res[t] = sc.transports.get(t, fabric).allreduce(_vector(me))
        res["allgather-sparse"] = sc.transports.get("allgather", fabric).allreduce(_sparse(me))
        res["omnireduce-sparse"] = sc.transports.get("omnireduce", fabric).allreduce(_sparse(me))
        # sends and receives issued as one batch (nccl's mode) address the group's ranks too
        coalesced = sc.TorchFabric(group=pg, timeout_s=60, coalesce=True)
        res["ring-coalesced"] = sc.transports.get("ring", coalesced).allreduce(_vector(me))
        # point to point in fabric ranks: fabric rank 0 sends its job rank to fabric rank 1
        buf = torch.tensor([me])
        if fabric.rank == 0:
            fabric.send(buf, 1, tag=3)
        else:
            fabric.recv(buf, 0, tag=3)
        res["p2p"] = int(buf)
        # the switches need a service rank per group, which the launcher does not start: refused
        for t in ("switch", "sparse-switch"):
            try:
                sc.transports.get(t, fabric)
                res[t] = "accepted"
            except ServiceNotStarted as exc:
                res[t] = str(exc)
        # a rank outside the group (the other group of the split) is refused
        try:
            sc.TorchFabric(group=other)
            res["outside"] = "accepted"
        except InvalidValueError as exc:
            res["outside"] = str(exc)
        res["optim_refusals"] = []
        for kw in ({"process_group": other}, {"process_group": pg, "fabric": fabric}):
            try:
                sc.DistributedOptimizer(torch.optim.SGD(_model(me).parameters(), lr=LR), **kw)
                res["optim_refusals"].append("accepted")
            except InvalidValueError as exc:
                res["optim_refusals"].append(str(exc))
        # DistributedOptimizer over the group: replicas from the group's rank 0, averages within the group
        model = _model(me)
        opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), transport="ring",
                                      process_group=pg)
        res["optim"] = _train(model, me, opt)
        res["optim_world"] = opt.fabric.world_size
        # the DDP hook over the group the DDP model was built with (named, or taken from the model)
        model = _model(me)
        net = nn.parallel.DistributedDataParallel(model, process_group=pg)
        state = sc.ddp.register(net, process_group=pg if name == "blocks" else None, transport="omnireduce")
        res["ddp"] = _train(net, me, torch.optim.SGD(net.parameters(), lr=LR))
        res["ddp_world"] = state.pipeline.world_size
        # a hook group other than the model's is refused before any communication
        try:
            sc.ddp.register(net, process_group=dist.group.WORLD)
            res["ddp_mismatch"] = "accepted"
        except IncompatibleError as exc:
            res["ddp_mismatch"] = str(exc)
        out[name] = res
    # a failure in one group stops that group, naming the rank in both numberings, and not the other
    pg = groups["blocks"][me // 2]
    fabric = sc.TorchFabric(group=pg, timeout_s=60)
    buf = torch.zeros(1)
    if me == 1:
        fabric.fail(RuntimeError("deliberate"))
    try:
        if me in (0, 1):
            fabric.recv(buf, 1 - me, tag=4)
        elif me == 2:
            time.sleep(0.5)                       # after group {0,1} has failed
            fabric.send(torch.ones(1), 1, tag=4)
        elif me == 3:
            fabric.recv(buf, 0, tag=4)
        out["failure"] = float(buf)
    except PeerFailure as exc:
        out["failure"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return sc.launch(_checks, world_size=4, backend="gloo", timeout_s=90)


def _each(results):
    for rank, out in enumerate(results):
        for name in SPLITS:
            yield rank, name, out[name]


def test_every_transport_sums_within_its_group_only(results):
    for rank, name, res in _each(results):
        members = res["members"]
        assert res["fabric"] == (members.index(rank), 2, True), (rank, name)
        assert res["p2p"] == members[0], (rank, name)
        dense = _vector(members[0]) + _vector(members[1])        # two terms: every order gives these bits
        sparse = _sparse(members[0]).to_dense() + _sparse(members[1]).to_dense()
        for t in ("native", "ring", "omnireduce", "allgather", "ring-coalesced"):
            assert torch.equal(res[t], dense), (rank, name, t)
        assert torch.equal(res["allgather-sparse"], sparse), (rank, name)
        assert torch.equal(res["omnireduce-sparse"], sparse), (rank, name)


def test_optimizer_and_ddp_hook_average_within_their_group(results):
    for rank, name, res in _each(results):
        ref = _reference(res["members"])
        assert res["optim_world"] == res["ddp_world"] == 2
        for what in ("optim", "ddp"):
            for got, want in zip(res[what], ref):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{what} rank {rank} {name}")
    # the two groups of a split trained on different data: their models differ
    for name in SPLITS:
        a, b = SPLITS[name]
        assert not torch.equal(results[a[0]][name]["optim"][0], results[b[0]][name]["optim"][0])


def test_switches_and_ranks_outside_the_group_are_refused_clearly(results):
    for rank, name, res in _each(results):
        for t in ("switch", "sparse-switch"):
            msg = res[t]
            assert "process group" in msg and "ring" in msg and "omnireduce" in msg, (rank, t, msg)
        assert "not a member" in res["outside"], res["outside"]
        outside, both = res["optim_refusals"]
        assert "not a member" in outside and "not both" in both, res["optim_refusals"]
        assert "process_group" in res["ddp_mismatch"], res["ddp_mismatch"]


def test_a_failure_in_one_group_stops_that_group_only(results):
    assert "worker 1 (job rank 1): deliberate" in results[1]["failure"], results[1]["failure"]
    assert "worker 1 (job rank 1) failed first" in results[0]["failure"], results[0]["failure"]
    assert results[2]["failure"] == 0.0 and results[3]["failure"] == 1.0   # the other group goes on
