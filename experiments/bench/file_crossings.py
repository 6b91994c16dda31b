"""How often one training step crosses from one source file of the library into another, per simulated worker.

    python -m experiments.bench.file_crossings                 # diana + rand-k over omnireduce, n = 2, 4, 8
    python -m experiments.bench.file_crossings --workers 2 16
    python -m experiments.bench.file_crossings --pairs --top 0    # every file pair, most frequent first

A reader follows a call by reading the files it enters: a protocol whose one step enters many files many
times is hard to read. This counts, for one ``DistributedOptimizer.step()`` of ``--method`` /
``--compressor`` (``--ratio``) over ``--transport`` on the SimFabric (a run of two steps less a run of one,
both after a run of one step whose count is dropped: what a process does once, its first launch's lazy
imports, caches and warnings, is in neither), every Python call whose callee's file differs from its
caller's, both under ``sparsecomm/``, in every thread of the process (the workers' threads, their
communication threads, and the thread that runs the SimFabric's loop), divided by the number of workers.
``sys.setprofile`` and ``threading.setprofile`` see the calls; C functions are not counted.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

import sparsecomm as sc

PKG = str(Path(sc.__file__).resolve().parent)


class Crossings:
    """A profile function counting calls from one file of the package into another."""

    def __init__(self) -> None:
        self.count = 0
        self.by_pair: dict[tuple[str, str], int] = {}

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        back = frame.f_back
        if back is None:
            return
        callee, caller = frame.f_code.co_filename, back.f_code.co_filename
        if callee != caller and callee.startswith(PKG) and caller.startswith(PKG):
            self.count += 1
            key = (caller[len(PKG) + 1:], callee[len(PKG) + 1:])
            self.by_pair[key] = self.by_pair.get(key, 0) + 1


def _steps(ctx, args, steps: int):
    model = torch.nn.Linear(64, 64)
    init = torch.Generator().manual_seed(0)     # (not the global RNG, which the workers' threads share)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) / 8)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), method=args.method,
                                  compressor=args.compressor, ratio=args.ratio, transport=args.transport)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _run(n: int, args, steps: int) -> Crossings:
    prof = Crossings()
    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        sc.launch(lambda ctx: _steps(ctx, args, steps), n)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return prof


def count(n: int, args, top: int = 10) -> tuple[float, dict]:
    """Crossings per worker of one step on ``n`` simulated workers (a run of 2 steps less a run of 1: the
    second step, after the first one built, compiled and agreed), and the ``top`` most frequent file pairs
    (every pair that one step crosses when ``top`` is 0). A first run of one step, not counted, warms the
    process: without it the once-per-process work of the first run (a registry's first look-ups, a cache's
    first fill) would be subtracted from the step, as negative pairs."""
    _run(n, args, 1)
    one, two = _run(n, args, 1), _run(n, args, 2)
    pairs = {k: v - one.by_pair.get(k, 0) for k, v in two.by_pair.items()}
    ranked = sorted(((k, v) for k, v in pairs.items() if v), key=lambda kv: (-kv[1], kv[0]))
    return (two.count - one.count) / n, dict(ranked[:top] if top else ranked)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--method", default="diana")
    ap.add_argument("--compressor", default="randk")
    ap.add_argument("--ratio", type=float, default=0.25, help="the compressor's kept fraction")
    ap.add_argument("--transport", default="omnireduce")
    ap.add_argument("--pairs", action="store_true", help="print the most frequent file pairs")
    ap.add_argument("--top", type=int, default=10, help="how many pairs --pairs prints (0: every pair)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.method} + {args.compressor} over {args.transport}: file crossings of one step, per worker")
    for n in args.workers:
        per, top = count(n, args, args.top)
        print(f"n = {n:3d}: {per:8.1f}", flush=True)
        if args.pairs:
            for (a, b), c in top.items():
                print(f"      {c / n:8.1f}  {a} -> {b}")


if __name__ == "__main__":
    main()
