"""The floor of a colocated block-sparse all-reduce on this machine, side by side with native gloo.

    python -m experiments.bench.omnireduce_floor                 # 100 MB, 2 workers, densities 1, 0.1, 0.01

What OmniReduce's data flow costs with no protocol at all (Fei et al., SIGCOMM'21, colocated
aggregators, one block per lane): each worker scans its tensor for non-zero blocks (the codec's scan),
exchanges its block bitmap of every other worker's shard, sends those non-zero blocks (gathered), sums
the blocks it receives into its own shard in place, gathers the union's sums of its shard and sends them
to every other worker, which writes them into its tensor. Straight ``torch.distributed`` sends and
receives of exactly the bytes OmniReduce sends (two exchanges per peer: bitmap and blocks up, bitmap and
sums down), no look-aheads, lanes, headers or checks; runs of consecutive blocks are sent, summed and
written as slices of the tensor (no gather), and receive buffers are kept across calls (a fresh one costs
page faults), as the transport does. The transport cannot beat this; the ratio of
``native`` to it bounds the speed-up any implementation of this data flow can show on the machine.

Inputs as in :mod:`experiments.bench.transports` (``block_sparse``, seed per rank, restored untimed
before every call), calls interleaved with native's, the slowest rank's time, median over repeats. The
result is checked against native's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.transports.omnireduce.blocks import block_run

from .transports import block_sparse, machine


def _run(ids: np.ndarray) -> slice | None:
    """``ids`` as a slice when they are consecutive (the transport's :func:`block_run`)."""
    run = block_run(ids)
    return slice(*run) if run is not None else None


_BUFS: dict = {}


def _buf(key, rows: int, bs: int) -> torch.Tensor:
    """A receive buffer of ``rows`` blocks, kept (and grown) across calls."""
    b = _BUFS.get(key)
    if b is None or b.shape[0] < rows:
        b = _BUFS[key] = torch.empty(rows, bs)
    return b[:rows]


def _take(rows: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    run = _run(ids)
    return rows[run] if run is not None else rows.index_select(0, torch.from_numpy(ids))


def floor_allreduce(x: torch.Tensor, bs: int) -> None:
    """The data flow of colocated one-round OmniReduce, in place, on the default process group."""
    n, r = dist.get_world_size(), dist.get_rank()
    full = x.numel() // bs
    if full * bs != x.numel():
        raise ValueError("the floor handles whole blocks only")
    rows = x.view(full, bs)
    mask = codec.nonzero_blocks(x, bs).numpy()
    bounds = [a * full // n for a in range(n + 1)]
    peers = [p for p in range(n) if p != r]
    lo, hi = bounds[r], bounds[r + 1]
    # up: my bitmap of each peer's shard, then my non-zero blocks there
    bits_in = {p: torch.empty(hi - lo, dtype=torch.bool) for p in peers}
    works = [dist.irecv(bits_in[p], p, tag=1) for p in peers]
    works += [dist.isend(torch.from_numpy(mask[bounds[p]:bounds[p + 1]]), p, tag=1) for p in peers]
    outs = {p: _take(rows, np.flatnonzero(mask[bounds[p]:bounds[p + 1]]) + bounds[p]) for p in peers}
    for w in works:
        w.wait()
    ins = {p: _buf(("in", p), int(bits_in[p].sum()), bs) for p in peers}
    works = [dist.irecv(ins[p], p, tag=2) for p in peers if ins[p].numel()]
    works += [dist.isend(outs[p], p, tag=2) for p in peers if outs[p].numel()]
    for w in works:
        w.wait()
    # my shard: sum in place; the union's sums down, with its bitmap
    mine = rows[lo:hi]
    union = mask[lo:hi].copy()
    for p in peers:
        held = bits_in[p].numpy()
        union |= held
        ids = np.flatnonzero(held)
        if ids.size:
            run = _run(ids)
            if run is not None:
                mine[run].add_(ins[p])
            else:
                mine.index_add_(0, torch.from_numpy(ids), ins[p])
    sums = _take(mine, np.flatnonzero(union))
    ub_in = {p: torch.empty(bounds[p + 1] - bounds[p], dtype=torch.bool) for p in peers}
    works = [dist.irecv(ub_in[p], p, tag=3) for p in peers]
    works += [dist.isend(torch.from_numpy(union), p, tag=3) for p in peers]
    for w in works:
        w.wait()
    got = {p: _buf(("got", p), int(ub_in[p].sum()), bs) for p in peers}
    works = [dist.irecv(got[p], p, tag=4) for p in peers if got[p].numel()]
    works += [dist.isend(sums, p, tag=4) for p in peers if sums.numel()]
    for w in works:
        w.wait()
    for p in peers:
        ids = np.flatnonzero(ub_in[p].numpy()) + bounds[p]
        run = _run(ids)
        if run is not None:
            rows[run].copy_(got[p])
        elif ids.size:
            rows.index_copy_(0, torch.from_numpy(ids), got[p])


def _worker(ctx, numel: int, densities: list[float], repeats: int, warmup: int, bs: int):
    f = ctx.fabric
    native = sc.transports.get("native", f, inplace=True)
    out = {}
    for d in densities:
        x0 = block_sparse(numel, d, bs, seed=1000 * ctx.rank + int(d * 1e4))
        x = x0.clone()
        times = {"native": [], "floor": []}
        fns = {"native": native.allreduce, "floor": functools.partial(floor_allreduce, bs=bs)}
        for i in range(warmup + repeats):
            for name, fn in fns.items():
                x.copy_(x0)
                f.barrier()
                t0 = time.perf_counter()
                fn(x)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        x.copy_(x0)
        native.allreduce(x)
        ref = x.clone()
        x.copy_(x0)
        floor_allreduce(x, bs)
        err = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        out[d] = (times, err)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.1, 0.01])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=256)
    args = ap.parse_args(argv)
    numel = int(args.size_mb * 1e6) // 4 // args.block * args.block
    res = sc.launch(functools.partial(_worker, numel=numel, densities=args.densities, repeats=args.repeats,
                                      warmup=args.warmup, bs=args.block), args.workers, backend="gloo")
    print(f"# machine: {machine()}; {args.workers} workers, {numel * 4 / 1e6:g} MB float32")
    print("| density | native ms | floor ms | native / floor (paired) | rel. diff |")
    print("|---:|---:|---:|---:|---:|")
    for d in args.densities:
        slow = {k: [max(r[d][0][k][j] for r in res) for j in range(args.repeats)] for k in ("native", "floor")}
        paired = statistics.median(a / b for a, b in zip(slow["native"], slow["floor"]))
        print(f"| {d:g} | {statistics.median(slow['native']) * 1e3:.1f} | "
              f"{statistics.median(slow['floor']) * 1e3:.1f} | {paired:.2f}x | {max(r[d][1] for r in res):.1e} |")


if __name__ == "__main__":
    main()
