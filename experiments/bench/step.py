"""Time of one training step of an embedding-dominated model on 2 gloo processes, side by side:
stock DDP against DistributedOptimizer (and the DDP comm hook) with several compressor x transport pairs.

    python -m experiments.bench.step                     # vocab 400k x 64 (~100 MB of fp32 gradient)
    python -m experiments.bench.step --small             # a smoke run
    python -m experiments.bench.step --density 0.01,0.05 --steps 15
    python -m experiments.bench.step --netbed 1          # the 2 processes on a netbed at 1 Gbit/s (root)

The model is ``EmbeddingBag(vocab, dim, mode="sum") -> Linear(dim, classes)``. Each step a worker
looks up ``tokens`` ids drawn uniformly at random, so the embedding's gradient is dense in memory but
zero outside the touched rows: its *block density* (fraction of ``block_size``-element blocks holding a
non-zero) is set by ``--density`` (per worker; the union over the two workers is reported too).

Configurations (those whose transport is registered):

* ``ddp``              DistributedDataParallel(bucket_cap_mb=25), built-in allreduce (the baseline)
* ``local (no comm)``  plain SGD without any communication: the floor, ``ddp / local`` bounds every
                       speed-up over DDP that less communication can bring on this host
* ``none/native``      DistributedOptimizer(compressor="none", transport="native")
* ``hook none/native`` DDP with ``sparsecomm.ddp.comm_hook`` (identity, native)
* ``none/omnireduce``  the dense gradient through OmniReduce (only non-zero blocks travel)
* ``ef+topk/omnireduce``  error feedback + top-k (ratio = ``--topk-ratio``)
* ``diana+randk/omnireduce``  DIANA + shared-seed rand-k (ratio = ``--randk-ratio``)

``--models`` also runs (default ``mlp,emb,emb-sparse``; ``hooks`` on request):

* ``mlp``: a dense 8-layer MLP (``--mlp-width``, ``--mlp-cap-mb`` buckets for DDP and ours alike:
  several buckets), ``ddp`` against ``hook none/native`` and ``none/native`` (DistributedOptimizer with
  its overlap, and ``overlap=False``); targets 1.1x and 1.15x of DDP's step. And the same plain averaging
  through OmniReduce at its defaults (``hook none/omnireduce``: one call a step; ``none/omnireduce``), which on
  a dense gradient moves the ring's bytes: at best DDP's step.
* ``emb-sparse``: the embedding model with ``EmbeddingBag(sparse=True)``; ``ddp`` (gloo's sparse
  allreduce) against ``none/native``, ``none/omnireduce`` and ``none/allgather`` (the rows gathered
  once and coalesced, ``p.grad`` sparse; the dense head through the named transport), the hook on
  native and omnireduce, and ``none/omnireduce rows=transport`` (the union of the rows, then the
  union's rows, through omnireduce), with SGD on sparse gradients.

* ``hooks``: DDP with torch's own comm hooks against this library's hook with the same wire format, on
  MLPs of 4 x Linear(w, w) for each ``--hook-widths`` (default 512 and 144: 1.05M and 84k parameters),
  every configuration with the library's defaults: ``sc fp16`` (``register(net, compressor="fp16")``)
  against torch's ``fp16_compress_hook``, ``sc bf16`` against ``bf16_compress_hook`` (called through a
  wrapper: DDP refuses that hook by name off CUDA/NCCL, but gloo sums bfloat16), ``sc none`` against
  DDP's built-in allreduce, and torch's own ``allreduce_hook`` against it too (a registered hook gets its bucket
  undivided: torch's reducer divides while it copies the gradients into the bucket only when no hook is registered;
  ``allreduce_hook``, a division and the collective posted from Python, is the least a hook does), ``sc none``
  against ``allreduce_hook``; and ``sc none, replicas checked every step`` (``verify_replicas_every=1``)
  against ``sc none``, whose difference is the cost of one replica check (the default checks every
  100 steps); and ``sc powersgd r1`` / ``r2`` (``compressor="powersgd", matrix_approximation_rank=r,
  start_powerSGD_iter=2``) against torch's ``powerSGD_hook`` with the same rank and start (its
  ``PowerSGDState`` otherwise at its defaults). Target: each pair within 1.05x (PowerSGD: 1.00x).

All configurations are built first; then each round runs one step of every configuration in turn
(``--warmup`` untimed rounds, then ``--steps`` timed ones), so that other load on the machine hits them
alike. A step is ``zero_grad, forward, backward, step`` after a barrier, timed on every rank; a step's
time is the slower rank's. ``step ms`` is the median over rounds; ``vs ddp`` is the median over rounds
of the paired ratio to ``ddp``'s step in the same round; ``speed-up`` is its inverse. Targets:
``none/native`` <= 1.15x DDP; OmniReduce configurations >= 3x faster than DDP at block density <= 5%.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm as sc


class EmbModel(nn.Module):
    def __init__(self, vocab: int, dim: int, classes: int, seed: int = 0, sparse: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=sparse)
        self.head = nn.Linear(dim, classes)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(vocab, dim, generator=g) * 0.01)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids, offsets))


def tokens_for_density(vocab: int, dim: int, block: int, density: float) -> int:
    """Uniform ids touching about ``density`` of the embedding's blocks (rows map to blocks)."""
    rows_per_block = max(1, block // dim)
    nblocks = math.ceil(vocab / rows_per_block)
    # a block is hit by one uniform id with probability 1/nblocks
    return max(1, round(math.log(1 - density) / math.log(1 - 1 / nblocks)))


def batch(rank: int, step: int, vocab: int, tokens: int, bag: int, classes: int):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    offsets = torch.arange(0, tokens, bag)
    y = torch.randint(0, classes, (offsets.numel(),), generator=g)
    return ids, offsets, y


def block_density(flat: torch.Tensor, block: int) -> float:
    n = flat.numel() // block * block
    nz = flat[:n].reshape(-1, block).ne(0).any(dim=1)
    return nz.float().mean().item()


def _omni_kwargs(a: argparse.Namespace) -> dict:
    """OmniReduce's keywords in the configurations: none (the library's defaults, as a user gets them)
    unless ``--block-size`` asks for another block than the transport's default."""
    import inspect

    default = inspect.signature(sc.transports.registry.product("omnireduce")).parameters["block_size"].default
    return {} if a.block_size == default else {"block_size": a.block_size}


def _configs(a: argparse.Namespace) -> list[tuple[str, Callable[[nn.Module], Any]]]:
    have = set(sc.transports.available())
    omni = _omni_kwargs(a)
    cfg: list[tuple[str, Callable]] = [("ddp", None)]  # type: ignore[list-item]
    # the floor: the same step with no communication at all (bounds every speed-up over ddp)
    cfg.append(("local (no comm)", lambda m: torch.optim.SGD(m.parameters(), lr=a.lr)))
    if "native" in have:
        cfg.append(("none/native", lambda m: sc.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="native")))
        cfg.append(("hook none/native", "hook"))  # type: ignore[arg-type]
    if "omnireduce" in have:
        cfg.append(("none/omnireduce", lambda m: sc.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="omnireduce",
            transport_kwargs=omni)))
        cfg.append(("ef+topk/omnireduce", lambda m: sc.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=a.lr), compressor="topk", method="ef",
            ratio=a.topk_ratio, transport="omnireduce", transport_kwargs=omni)))
        cfg.append(("diana+randk/omnireduce", lambda m: sc.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=a.lr), compressor="diana", ratio=a.randk_ratio,
            transport="omnireduce", transport_kwargs=omni)))
    for name in a.extra:
        if name in have:
            cfg.append((f"none/{name}", lambda m, name=name: sc.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport=name)))
    if a.only:
        keep = set(a.only.split(","))
        cfg = [c for c in cfg if c[0] in keep or c[0] in ("ddp", "local (no comm)")]
    return cfg


class MLP(nn.Module):
    def __init__(self, width: int, depth: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / width ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _mlp_configs(a: argparse.Namespace) -> list[tuple[str, Any]]:
    cap = a.mlp_cap_mb
    cfg: list[tuple[str, Any]] = [("ddp", None), ("local (no comm)", lambda m: torch.optim.SGD(m.parameters(), lr=a.lr))]
    cfg.append(("hook none/native", ("hook", dict(compressor="none", transport="native"))))
    cfg.append(("none/native", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="native", bucket_cap_mb=cap)))
    cfg.append(("none/native overlap=False", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="native", bucket_cap_mb=cap,
        overlap=False)))
    cfg.append(("hook none/omnireduce", ("hook", dict(compressor="none", transport="omnireduce"))))
    cfg.append(("none/omnireduce", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="omnireduce", bucket_cap_mb=cap)))
    return cfg


def _sparse_configs(a: argparse.Namespace) -> list[tuple[str, Any]]:
    omni = _omni_kwargs(a)
    cfg: list[tuple[str, Any]] = [("ddp", None), ("local (no comm)", lambda m: torch.optim.SGD(m.parameters(), lr=a.lr))]
    cfg.append(("hook none/omnireduce", ("hook", dict(compressor="none", transport="omnireduce",
                                                      transport_kwargs=omni))))
    cfg.append(("none/omnireduce", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="omnireduce",
        transport_kwargs=omni)))
    cfg.append(("none/allgather", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="allgather")))
    cfg.append(("none/native", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="native")))
    cfg.append(("hook none/native", ("hook", dict(compressor="none", transport="native"))))
    cfg.append(("none/omnireduce rows=transport", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="none", transport="omnireduce",
        transport_kwargs=omni, sparse_rows="transport")))
    cfg.append(("ef+topk/omnireduce", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="topk", method="ef",
        ratio=a.topk_ratio, transport="omnireduce", transport_kwargs=omni)))
    cfg.append(("diana+randk/omnireduce", lambda m: sc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=a.lr), compressor="diana", ratio=a.randk_ratio,
        transport="omnireduce", transport_kwargs=omni)))
    return cfg


def _bf16_compress_hook(state, bucket):
    """torch's ``bf16_compress_hook`` under another name (DDP refuses the original by name off CUDA/NCCL)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _torch_powersgd_state(rank: int):
    """torch's ``PowerSGDState`` at its defaults but the rank, compressing from step 2 (as ours below)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    return ph.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)


#: (configuration, baseline) pairs of the ``hooks`` case
HOOK_PAIRS = (("sc fp16", "torch fp16"), ("sc bf16", "torch bf16"), ("sc none", "ddp"),
              ("torch allreduce_hook", "ddp"), ("sc none", "torch allreduce_hook"),
              ("sc powersgd r1", "torch powersgd r1"), ("sc powersgd r2", "torch powersgd r2"),
              ("sc none, replicas checked every step", "sc none"))


def _hook_configs() -> list[tuple[str, Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    return [("ddp", None), ("torch fp16", ("torch", default_hooks.fp16_compress_hook)),
            ("sc fp16", ("hook", dict(compressor="fp16"))),
            ("torch bf16", ("torch", _bf16_compress_hook)), ("sc bf16", ("hook", dict(compressor="bf16"))),
            ("sc none", ("hook", {})), ("torch allreduce_hook", ("torch", default_hooks.allreduce_hook)),
            ("sc none, replicas checked every step", ("hook", dict(verify_replicas_every=1)))] + [
            cfg for r in (1, 2) for cfg in (
                (f"torch powersgd r{r}", ("torch", powerSGD_hook.powerSGD_hook,
                                          functools.partial(_torch_powersgd_state, r))),
                (f"sc powersgd r{r}", ("hook", dict(compressor="powersgd", matrix_approximation_rank=r,
                                                    start_powerSGD_iter=2))))]


def _pairs_table(r: dict, pairs) -> None:
    """Per pair: the slower rank's step time of each, medians, and the median over rounds of the paired
    ratio (the two ran in the same round)."""
    print(f"{'configuration':40s} {'step ms':>9s} {'baseline':>12s} {'ms':>8s} {'ratio':>7s}")
    slow = {k: [max(ts) for ts in zip(*(rr[k]["times"] for rr in r))] for k in r[0] if "times" in r[0][k]}
    for name, base in pairs:
        rel = statistics.median(x / b for x, b in zip(slow[name], slow[base]))
        print(f"{name:40s} {1e3 * statistics.median(slow[name]):9.2f} {base:>12s} "
              f"{1e3 * statistics.median(slow[base]):8.2f} {rel:6.3f}x")


def _select(cfg: list, a: argparse.Namespace) -> list:
    if a.only:
        keep = set(a.only.split(","))
        cfg = [c for c in cfg if c[0] in keep or c[0] in ("ddp", "local (no comm)")]
    return cfg


def _run_rounds(a, setups, make_batch, forward) -> dict[str, Any]:
    """Interleaved rounds: one step of every configuration per round, timed after a barrier."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in setups}
    for t in range(a.warmup + a.steps):
        inputs = make_batch(t)
        for name, net, opt in setups:
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            forward(net, inputs).backward()
            opt.step()
            if t >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    dist.barrier()
    res: dict[str, Any] = {}
    for name, net, opt in setups:
        r: dict[str, Any] = {"times": times[name]}
        if isinstance(opt, sc.DistributedOptimizer):
            r["bytes_sent"] = opt.last_stats.bytes_sent
            r["bytes_received"] = opt.last_stats.bytes_received
            r["estimated"] = opt.last_stats.estimated
            r["factor"] = opt.compression_stats()["compression_factor_sent"]   # measured on the wire
        res[name] = r
    return res


def _build(name, make, model, ddp_cap):
    if name == "ddp" or isinstance(make, tuple):
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ddp_cap)
        if isinstance(make, tuple) and make[0] == "torch":
            net.register_comm_hook(make[2]() if len(make) > 2 else None, make[1])
        elif isinstance(make, tuple):
            from sparsecomm import ddp as scddp

            scddp.register(net, **make[1])
        return net, torch.optim.SGD(net.parameters(), lr=0.05)
    return model, make(model)


def _worker(ctx, a: argparse.Namespace) -> dict:
    out = _worker_emb(ctx, a, sparse=False) if "emb" in a.models else {"density": {}}
    if "emb-sparse" in a.models:
        out["sparse"] = _worker_emb(ctx, a, sparse=True)["density"]
    if "mlp" in a.models:
        torch.set_num_threads(a.threads)
        loss_fn = nn.MSELoss()
        setups = [(name, *_build(name, make, MLP(a.mlp_width), a.mlp_cap_mb))
                  for name, make in _select(_mlp_configs(a), a)]

        def make_batch(t):
            g = torch.Generator().manual_seed(10_000 * ctx.rank + t)
            return torch.randn(a.mlp_batch, a.mlp_width, generator=g), torch.randn(a.mlp_batch, a.mlp_width, generator=g)

        out["mlp"] = _run_rounds(a, setups, make_batch, lambda net, xy: loss_fn(net(xy[0]), xy[1]))
    if "hooks" in a.models:
        torch.set_num_threads(a.threads)
        out["hooks"] = {}
        for width in a.hook_widths:
            setups = [(name, *_build(name, make, MLP(width, depth=4), 25)) for name, make in _hook_configs()]

            def make_batch(t, width=width):
                g = torch.Generator().manual_seed(10_000 * ctx.rank + t)
                return torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)

            out["hooks"][width] = _run_rounds(a, setups, make_batch,
                                              lambda net, xy: ((net(xy[0]) - xy[1]) ** 2).sum() / 32)
    from sparsecomm.transports import _fold

    sched = _fold.schedule(ctx.fabric)      # native's calls whose agreement folded into the data
    out["fold"] = (sched.folded, sched.deviated, sched.posted) if sched is not None else (0, 0, 0)
    return out


def _worker_emb(ctx, a: argparse.Namespace, sparse: bool) -> dict:
    torch.set_num_threads(a.threads)
    rank = ctx.rank
    out: dict[str, Any] = {"density": {}}
    loss_fn = nn.CrossEntropyLoss()
    for density in a.densities:
        tokens = tokens_for_density(a.vocab, a.dim, a.block_size, density)
        res: dict[str, Any] = {"tokens": tokens}
        # measured block density of one step's embedding gradient, per worker and for the union
        m = EmbModel(a.vocab, a.dim, a.classes)
        ids, off, y = batch(rank, 0, a.vocab, tokens, a.bag, a.classes)
        loss_fn(m(ids, off), y).backward()
        g = m.emb.weight.grad.reshape(-1)
        res["block_density"] = block_density(g, a.block_size)
        mask = g.reshape(-1, a.block_size).ne(0).any(dim=1).to(torch.uint8)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        res["block_density_union"] = mask.float().mean().item()
        del m, g
        # every configuration is built first, then the rounds interleave them (one step of each per
        # round), so that load from elsewhere on the machine hits all of them alike
        cfgs = _select(_sparse_configs(a), a) if sparse else _configs(a)
        setups = [(name, *_build(name, make if make != "hook" else ("hook", dict(compressor="none",
                                                                                 transport="native")),
                                 EmbModel(a.vocab, a.dim, a.classes, sparse=sparse), 25))
                  for name, make in cfgs]
        res.update(_run_rounds(a, setups, lambda t: batch(rank, t, a.vocab, tokens, a.bag, a.classes),
                               lambda net, b: loss_fn(net(b[0], b[1]), b[2])))
        # the last step's rows of this worker's embedding gradient (distinct ids: the coalesced gradient)
        res["rows"] = int(batch(rank, a.warmup + a.steps - 1, a.vocab, tokens, a.bag, a.classes)[0].unique().numel())
        del setups
        out["density"][density] = res
    return out


def _table(rs: list[dict]) -> None:
    """Print one case: the slowest rank's time per round, medians, paired ratios to ddp."""
    print(f"{'configuration':28s} {'step ms':>9s} {'vs ddp':>8s} {'speed-up':>9s} {'MB sent':>9s} "
          f"{'factor sent':>11s}")
    names = [k for k in rs[0] if isinstance(rs[0][k], dict) and "times" in rs[0][k]]
    slow = {k: [max(ts) for ts in zip(*(r[k]["times"] for r in rs))] for k in names}
    for name, ts in slow.items():
        t = statistics.median(ts)
        rel = statistics.median(x / d for x, d in zip(ts, slow["ddp"]))   # paired, per round
        mb = rs[0][name].get("bytes_sent")
        ratio = rs[0][name].get("factor")
        print(f"{name:28s} {1e3 * t:9.1f} {rel:7.2f}x {1 / rel:8.2f}x "
              f"{'' if mb is None else f'{mb / 1e6:9.2f}':>9s} "
              f"{'' if ratio is None else f'{ratio:11.1f}':>11s}")


def _busiest_link(rs: list[dict], dim: int) -> None:
    """Bytes of the last step on the busiest link direction (a host's up- or downlink), ``sparse=True``.

    ``ddp`` (gloo's sparse all-reduce: every worker's coalesced rows gathered around a ring) by counting:
    host ``i`` forwards the rows of every worker but its successor, ``k_j (4 dim + 8)`` bytes each
    (values and an int64 index). Our configurations from their ledgers (``last_stats``: colocated
    OmniReduce's aggregator ``i`` is worker ``i``, so every byte a worker sends or receives crosses its
    link; ``native`` books a formula, marked ``est``): the largest of any worker's bytes sent or
    received. The ratio ``ddp / config`` bounds the speed-up that fewer bytes can bring on a
    network-bound step."""
    n = len(rs)
    rows = [r["rows"] for r in rs]
    rb = 4 * dim + 8
    ddp = max(sum(rows[j] for j in range(n) if j != (i + 1) % n) for i in range(n)) * rb
    print(f"busiest link direction, last step: ddp {ddp / 1e6:.3f} MB (rows per worker {rows}, counted)")
    names = [k for k in rs[0] if isinstance(rs[0][k], dict) and "bytes_sent" in rs[0][k]]
    for name in names:
        b = max(max(r[name]["bytes_sent"], r[name]["bytes_received"]) for r in rs)
        est = " est" if rs[0][name].get("estimated") else ""
        print(f"  {name:30s} {b / 1e6:9.3f} MB{est}   ddp / this {ddp / b if b else float('inf'):6.2f}x")


def _cpu() -> str:
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((l.split(":", 1)[1].strip() for l in txt.splitlines() if l.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        name = platform.processor() or "?"
    return f"{name}, {os.cpu_count()} logical CPUs, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--bag", type=int, default=8)
    p.add_argument("--density", default="0.01,0.05", help="target block densities, comma-separated")
    p.add_argument("--block-size", type=int, default=256, help="OmniReduce's block (256: its default)")
    p.add_argument("--topk-ratio", type=float, default=0.001,
                   help="top-k ratio (keep it below the gradient's element density: top-k of a vector with "
                        "fewer non-zeros than k selects among ties at zero, its slow path)")
    p.add_argument("--randk-ratio", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--extra", default="", help="more transports to run with compressor none (e.g. ring)")
    p.add_argument("--only", default="", help="comma-separated configuration names (ddp and local always run)")
    p.add_argument("--small", action="store_true", help="vocab 50k, 5 steps: a smoke run")
    p.add_argument("--models", default="mlp,emb,emb-sparse", help="cases: mlp, emb, emb-sparse")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mlp-width", type=int, default=1024)
    p.add_argument("--mlp-batch", type=int, default=64)
    p.add_argument("--mlp-cap-mb", type=float, default=8.0, help="bucket cap of DDP and ours for the MLP")
    p.add_argument("--hook-widths", default="512,144", help="widths of the hooks case's 4-layer MLPs")
    p.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                   help="run the processes on a netbed (own namespaces, links shaped to GBPS; needs root)")
    a = p.parse_args(argv)
    if a.small:
        a.vocab, a.steps, a.warmup = 50_000, 5, 2
    a.densities = [float(x) for x in a.density.split(",") if x]
    a.extra = [x for x in a.extra.split(",") if x]
    a.models = [x for x in a.models.split(",") if x]
    a.hook_widths = [int(x) for x in a.hook_widths.split(",") if x]
    from .transports import launch_options

    res = sc.launch(functools.partial(_worker, a=a), world_size=a.workers, **launch_options(a.netbed))
    grad_mb = (a.vocab * a.dim + a.dim * a.classes + a.classes) * 4 / 2 ** 20
    where = f"on a netbed at {a.netbed:g} Gbit/s" if a.netbed is not None else "over loopback"
    print(f"# step time, {a.workers} gloo processes x {a.threads} thread(s) {where}; {_cpu()}")
    print(f"# model: EmbeddingBag({a.vocab}, {a.dim}) + Linear({a.dim}, {a.classes}): "
          f"{grad_mb:.1f} MiB fp32 gradient; block {a.block_size}; bag {a.bag}")
    for key, label in (("density", "dense embedding"), ("sparse", "EmbeddingBag(sparse=True)")):
        if key == "density" and "emb" not in a.models or key == "sparse" and "emb-sparse" not in a.models:
            continue
        for density in a.densities:
            rs = [r[key][density] for r in res]
            print(f"\n## {label}, target block density {density:.0%}: tokens/worker {rs[0]['tokens']}, "
                  f"measured {rs[0]['block_density']:.2%} per worker, {rs[0]['block_density_union']:.2%} union")
            _table(rs)
            if key == "sparse":
                _busiest_link(rs, a.dim)
    if "mlp" in a.models:
        mb = 8 * (a.mlp_width ** 2 + a.mlp_width) * 4 / 2 ** 20
        print(f"\n## dense MLP: 8 x Linear({a.mlp_width}, {a.mlp_width}), {mb:.1f} MiB fp32 gradient, "
              f"batch {a.mlp_batch}, buckets of {a.mlp_cap_mb:g} MiB (DDP and ours)")
        _table([r["mlp"] for r in res])
    for width in a.hook_widths if "hooks" in a.models else ():
        params = 4 * (width * width + width)
        print(f"\n## comm hooks: 4 x Linear({width}, {width}), {params / 1e6:.3g}M parameters, batch 32, "
              f"DDP's default buckets; the library's defaults")
        _pairs_table([r["hooks"][width] for r in res], HOOK_PAIRS)
    folded, deviated, posted = res[0]["fold"]
    print(f"\n# native calls with the agreement folded into the data (rank 0): {folded}, of which posted at once "
          f"on the calling thread: {posted}; mispredicted (a NaN join and a handshake): {deviated}")
    return res


if __name__ == "__main__":
    main()
