"""The switch's ledger against what it puts on the wire, under the DDP hook and the optimizer.

Every message a worker sends goes through its fabric's ``send``/``isend``; the tests count those bytes
themselves and compare them with the pipeline's ledger (``last_stats``, ``compression_stats()``), step by
step. On gloo a float job's exponent look-ahead (:mod:`sparsecomm.transports.switchml.jobs`) travels
header-only, so a step's bytes are the gradient's int32 codes in whole packets with their headers, a control
packet and an agreement header per bucket, and a header per look-ahead lane (and per message of them): the
4.5 MB of a 64-1024-1024-10 MLP take 1.049 times their bytes with half a job's chunks as lanes (1.038 with an
eighth; look-ahead lanes as whole packets took 1.21).
The lanes change no number: the hook's sums are the codec's fixed-point sums bit for bit, and its averaged
gradients those of an explicit ``pool_size=4096``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.transports._handshake import HEADER_BYTES as HANDSHAKE_BYTES
from sparsecomm.transports.switchml.dataplane import HEADER

TIMEOUT = 120.0


def _count_wire(fabric) -> dict:
    """Wrap ``fabric``'s ``send`` and ``isend`` (instance attributes): the bytes of every message sent."""
    wire = {"bytes": 0, "messages": 0}
    for name in ("send", "isend"):
        orig = getattr(fabric, name)

        def counted(t, dst, tag=0, *, reliable=True, _orig=orig):
            wire["bytes"] += t.numel() * t.element_size()
            wire["messages"] += 1
            return _orig(t, dst, tag, reliable=reliable)

        setattr(fabric, name, counted)
    return wire


def _mlp(widths) -> nn.Module:
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _batch(rank: int, step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)


def _hook_steps(ctx, steps: int):
    """Two DDP replicas of the 64-1024-1024-10 MLP over the switch, the default lanes and an explicit
    ``pool_size=4096``, on the same batches: per step the default's ledger, its wire bytes, and whether
    the two hooks' averaged gradients are bit-identical."""
    torch.set_num_threads(1)
    f = ctx.fabric
    wire = _count_wire(f)
    nets, states = [], []
    for kwargs in ({}, {"pool_size": 4096}):
        with ctx.seeded(0):
            model = _mlp((64, 1024, 1024, 10))
        net = nn.parallel.DistributedDataParallel(model, process_group=f.native_group)
        states.append(sc.ddp.register(net, transport="switch", transport_kwargs=kwargs or None))
        nets.append(net)
    grad_bytes = sum(p.numel() * p.element_size() for p in nets[0].parameters())
    rows = []
    for step in range(steps):
        x, y = _batch(ctx.rank, step, 64)
        before = wire["bytes"]
        nn.functional.cross_entropy(nets[0](x), y).backward()
        sent = wire["bytes"] - before
        st = states[0].last_stats
        nn.functional.cross_entropy(nets[1](x), y).backward()
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
        rows.append((st.bytes_sent, sent, same))
        for net in nets:
            net.zero_grad()
    elems = states[0].pipeline.transport.slot_elems
    return grad_bytes, elems, rows, states[0].compression_stats()["bytes_sent"], wire["bytes"]


@pytest.mark.multiprocess
def test_hook_switch_bytes_per_step_are_its_wire_bytes_near_the_gradient_on_gloo():
    res = sc.launch(functools.partial(_hook_steps, steps=3), 2, backend="gloo", timeout_s=TIMEOUT,
                    services=["switch"])
    for grad_bytes, elems, rows, total_ledger, total_wire in res:
        on_wire = grad_bytes * (1 + HEADER / elems)        # the gradient once, int32 codes with headers
        for ledger, sent, same in rows:
            assert ledger == sent, rows                    # the ledger books what the worker sent, no more
            assert same, rows                              # the lanes change no number
        # every step after DDP's bucket rebuild (two buckets: 4148 and 260 chunks of 256 values): a
        # look-ahead of 2074 + 256 packets (half of each job's chunks, at least 256)
        for ledger, _, _ in rows[1:]:
            assert ledger <= 1.25 * on_wire, (ledger / grad_bytes, rows)
        # the ledger of the whole run books the steps only, the wire also the hooks' construction
        assert total_ledger == sum(r[0] for r in rows) <= total_wire


def _optimizer_sim(ctx, steps: int):
    """``DistributedOptimizer`` (plain averaging) over the switch on SimFabric: per step the ledger and
    the wire bytes."""
    f = ctx.fabric
    wire = _count_wire(f)
    with ctx.seeded(0):
        model = _mlp((16, 256, 10))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), transport="switch")
    rows = []
    for step in range(steps):
        x, y = _batch(ctx.rank, step, 16)
        before = wire["bytes"]          # (buckets start during backward from the second step on)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rows.append((opt.last_stats.bytes_sent, wire["bytes"] - before))
    return rows, opt.compression_stats()["bytes_sent"]


def test_optimizer_switch_ledger_is_its_wire_bytes_on_simfabric():
    # the first step's wire also carries the optimizer's one-time agreement on which parameters have sparse
    # gradients (at its first synchronisation), which the ledger leaves out as it leaves out construction
    for rows, total in sc.launch(functools.partial(_optimizer_sim, steps=3), 2):
        assert 0 < rows[0][0] < rows[0][1], rows
        assert all(ledger == sent > 0 for ledger, sent in rows[1:]), rows
        assert total == sum(r[0] for r in rows)


def _hook_jobs(ctx, steps: int, fuse: bool | None):
    """One DDP replica of the 64-1024-1024-10 MLP over the switch (its default lanes; the two buckets DDP
    makes of it with ``bucket_cap_mb=1`` after its first step, one call a step with ``fuse=None``, the
    default, a call per bucket with ``fuse=False``): per step the ledger, the bytes the worker
    handed to its fabric, and per float job its input, its sum, its chunks and lanes (the inputs of both
    workers, gathered after the step, outside the counted bytes)."""
    torch.set_num_threads(1)
    f = ctx.fabric
    wire = _count_wire(f)
    with ctx.seeded(0):
        model = _mlp((64, 1024, 1024, 10))
    net = nn.parallel.DistributedDataParallel(model, process_group=f.native_group, bucket_cap_mb=1)
    state = sc.ddp.register(net, transport="switch", fuse=fuse)
    t = state.pipeline.transport
    jobs = []
    float_job = t._float_job

    def recorded(flat, *args, **kwargs):
        x = flat.detach().reshape(-1).clone()
        out = float_job(flat, *args, **kwargs)
        chunks = -(-x.numel() // t.slot_elems)
        jobs.append((x, out.clone(), chunks, t._float_lanes(chunks)[0]))
        return out

    t._float_job = recorded
    rows = []
    for step in range(steps):
        x, y = _batch(ctx.rank, step, 64)
        before = wire["bytes"]
        jobs.clear()
        nn.functional.cross_entropy(net(x), y).backward()
        sent = wire["bytes"] - before
        gathered = []
        for xj, out, chunks, lanes in jobs:
            every = [torch.empty_like(xj) for _ in range(ctx.world_size)]
            torch.distributed.all_gather(every, xj, group=f.native_group)
            gathered.append((every, out, chunks, lanes))
        rows.append((state.last_stats.bytes_sent, sent, gathered))
        net.zero_grad()
    return rows, t.slot_elems


def _fixed_point_sum(xs: list[torch.Tensor], E: int) -> torch.Tensor:
    """The switch's float sum of the workers' ``xs``, from the codec alone: per chunk of ``E`` values the
    scale of the largest exponent over the workers, each worker's codes rounded at it, their integer sum
    divided by it."""
    e = torch.stack([codec.chunk_exponents(x, E).clamp_min(-126) for x in xs]).max(dim=0).values
    scales = codec.scale_from_exponents(e, len(xs))
    q = sum(codec.to_fixed(x, scales, chunk=E).to(torch.int64) for x in xs)
    return codec.from_fixed(q, scales, chunk=E, dtype=xs[0].dtype)


@pytest.mark.multiprocess
@pytest.mark.parametrize("fuse", [None, False])
def test_hook_switch_wire_bytes_are_the_gradient_with_headers_and_its_sums_exact_on_gloo(fuse):
    """Per step, over several steps of a two-bucket model: the ledger books exactly the bytes the worker
    handed to its fabric, and those are the gradient's int32 codes in whole packets with their headers, one
    control packet per job and the workers' agreement headers, plus the exponent look-ahead at the size of a
    header per lane (and at most one more per message); the sums are the codec's fixed-point sums bit for
    bit."""
    res = sc.launch(functools.partial(_hook_jobs, steps=4, fuse=fuse), 2, backend="gloo", timeout_s=TIMEOUT,
                    services=["switch"])
    rounds = 1                                   # ceil(log2 n) agreement rounds of 2 workers
    for rows, E in res:
        packet = 4 * (HEADER + E)
        # DDP rebuilds after step 0 (two buckets); fused, one job a step
        assert [len(jobs) for _, _, jobs in rows] == [1] + [1 if fuse is None else 2] * (len(rows) - 1)
        for ledger, sent, jobs in rows:
            assert ledger == sent, (ledger, sent)
            needed = sum(packet * (chunks + 1) + HANDSHAKE_BYTES * rounds for _, _, chunks, _ in jobs)
            lookahead = sent - needed
            lanes = sum(lanes for _, _, _, lanes in jobs)
            assert 0 <= lookahead <= 2 * 4 * HEADER * lanes, (sent, needed, lanes, lookahead / lanes)
            for xs, out, _, _ in jobs:
                assert torch.equal(out, _fixed_point_sum(xs, E))
