"""Trace one OmniReduce call on the netbed: the per-message timeline with phase marks.

    python -m experiments.bench.omnireduce_trace --workers 4 --density 0.01 --dir /tmp/omni_trace
    python -m sparsecomm.transports.omnireduce.trace /tmp/omni_trace      # the merged timeline

Each rank runs ``--calls`` calls of native ``all_reduce`` and ``omnireduce`` interleaved (the benchmark's
block-sparse input and settings: 100 MB float32, 256-element blocks, ``lanes=65536``, in place, colocated)
and traces only the last omnireduce call (``SPARSECOMM_OMNIREDUCE_TRACE`` set around it; ``--every``: every
call after the first, ``rank{R}.call{K}.json``, to compare slow calls with fast ones); it prints each
call's time (slowest rank), each rank's process CPU per call and the paired native / omnireduce ratio.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import sparsecomm as sc
from sparsecomm.transports.omnireduce import trace

from .transports import block_sparse


def _rank(ctx, numel: int, density: float, calls: int, directory: str, every: bool = False) -> tuple[list, list, list]:
    f = ctx.fabric
    pristine = block_sparse(numel, density, 256, seed=1000 * ctx.rank + int(density * 1e4))
    native = sc.transports.get("native", f, inplace=True)
    omni = sc.transports.get("omnireduce", f, block_size=256, lanes=65536, inplace=True)
    x = pristine.clone()
    times, ntimes, cpu = [], [], []
    for i in range(calls):
        for t, out in ((native, ntimes), (omni, times)):
            if t is omni and (i == calls - 1 or (every and i > 0)):
                os.environ[trace.ENV] = directory
            x.copy_(pristine)
            f.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            t.allreduce(x)
            out.append(time.perf_counter() - t0)
            if t is omni:
                cpu.append(time.process_time() - c0)
            os.environ.pop(trace.ENV, None)
    return times, ntimes, cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--dir", required=True, help="trace directory (rank{R}.call0.json per rank)")
    ap.add_argument("--every", action="store_true",
                    help="trace every call after the first (rank{R}.call{K}.json, K = 0, 1, ...), not only the last")
    a = ap.parse_args(argv)
    numel = int(a.size_mb * 1e6) // 4
    res = sc.launch(functools.partial(_rank, numel=numel, density=a.density, calls=a.calls, directory=a.dir,
                                      every=a.every),
                    a.workers, backend="netbed", network=sc.Network(bandwidth_gbps=a.gbps), timeout_s=600)
    om = [max(r[0][i] for r in res) for i in range(a.calls)]
    na = [max(r[1][i] for r in res) for i in range(a.calls)]
    print("omnireduce ms", [round(1e3 * v, 1) for v in om])
    print("native ms    ", [round(1e3 * v, 1) for v in na])
    print("process CPU ms per call, per rank (median after the first)",
          [round(1e3 * statistics.median(r[2][1:]), 1) for r in res])
    print("native / omnireduce (paired, median after the first): "
          f"{statistics.median(n / o for n, o in zip(na[1:], om[1:])):.1f}x")
    print(f"timeline: python -m sparsecomm.transports.omnireduce.trace {a.dir}")


if __name__ == "__main__":
    main()
