"""Trace OmniReduce calls on the netbed: the per-message timeline with phase marks, and where each call's
calling thread spends its time beside ``dist.all_reduce``'s.

    python -m experiments.bench.omnireduce_trace --workers 4 --density 0.01 --dir /tmp/omni_trace
    python -m sparsecomm.transports.omnireduce.trace /tmp/omni_trace      # the merged timeline
    python -m experiments.bench.omnireduce_trace --workers 2 --density 1 --size-mb 4.5056 --calls 30 --every \\
        --dir /tmp/omni_mlp                                               # the dense MLP's gradient, every call

Each rank runs ``--calls`` calls of native ``all_reduce`` and ``omnireduce`` interleaved, each after a barrier (the
benchmark's block-sparse input: 100 MB float32 by default, 256-element blocks; OmniReduce colocated, in place as the
DDP hook and ``DistributedOptimizer`` build it, its lanes the library's default unless ``--lanes``) and traces only the
last omnireduce call (``SPARSECOMM_OMNIREDUCE_TRACE`` set around it; ``--every``: every call after the first,
``rank{R}.call{K}.json``, to compare slow calls with fast ones). It prints each call's time (slowest rank), each rank's
process CPU per call and the paired native / omnireduce ratio; then, per transport and rank, medians over the calls
after the first of what the calling thread did during a call (Linux: ``/proc/thread-self``): its own CPU time, its
time runnable but not running (``schedstat``'s run-queue wait: the cores were busy with other threads, the peer's
process, gloo's receiving threads, the kernel's shaping) and how often it was preempted (involuntary context
switches); and, from the traced calls, how long after its call began each rank sent its first blocks up to a remote
aggregator (round 0's header exchange and the hold of :func:`~sparsecomm.transports.omnireduce.worker.release_up`
come first). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import sparsecomm as sc
from sparsecomm.transports.omnireduce import trace, wire

from .transports import block_sparse


def thread_sched() -> tuple[float, float, int] | None:
    """The calling thread's ``(CPU s, run-queue wait s, involuntary context switches)`` so far (Linux's
    ``/proc/thread-self``), or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            run_ns, wait_ns = (int(v) for v in fh.read().split()[:2])
        with open("/proc/thread-self/status") as fh:
            preempted = next(int(line.split()[1]) for line in fh if line.startswith("nonvoluntary_ctxt_switches"))
    except (OSError, ValueError, StopIteration):
        return None
    return run_ns * 1e-9, wait_ns * 1e-9, preempted


def _rank(ctx, numel: int, density: float, calls: int, directory: str, every: bool = False,
          lanes: int | None = None) -> tuple[list, list, list, dict]:
    f = ctx.fabric
    pristine = block_sparse(numel, density, 256, seed=1000 * ctx.rank + int(density * 1e4))
    native = sc.transports.get("native", f, inplace=True)
    omni = sc.transports.get("omnireduce", f, block_size=256, inplace=True,
                             **({} if lanes is None else {"lanes": lanes}))
    x = pristine.clone()
    times, ntimes, cpu = [], [], []
    sched: dict[str, list] = {"native": [], "omnireduce": []}
    for i in range(calls):
        for t, out in ((native, ntimes), (omni, times)):
            if t is omni and (i == calls - 1 or (every and i > 0)):
                os.environ[trace.ENV] = directory
            x.copy_(pristine)
            f.barrier()
            s0 = thread_sched()
            c0, t0 = time.process_time(), time.perf_counter()
            t.allreduce(x)
            out.append(time.perf_counter() - t0)
            s1 = thread_sched()
            if t is omni:
                cpu.append(time.process_time() - c0)
            if s0 is not None and s1 is not None:
                sched["omnireduce" if t is omni else "native"].append(tuple(b - a for a, b in zip(s0, s1)))
            os.environ.pop(trace.ENV, None)
    return times, ntimes, cpu, sched


def first_blocks(directory: str) -> dict[int, list[float]]:
    """Per rank, from every traced call in ``directory``: seconds from the call's start to its first message of
    blocks to a remote aggregator (the tags of :func:`.wire.tag_up`)."""
    lo, hi = wire.tag_up(0), wire.tag_down(0)
    out: dict[int, list[float]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as fh:
                rec = json.load(fh)
            ups = [e["post"] for e in rec["events"] if e["kind"] == "send" and lo <= e["tag"] < hi]
            if ups:
                out.setdefault(rec["rank"], []).append(min(ups) - rec["start"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--lanes", type=int, help="OmniReduce's lanes per channel (default: the library's)")
    ap.add_argument("--dir", required=True, help="trace directory (rank{R}.call0.json per rank)")
    ap.add_argument("--every", action="store_true",
                    help="trace every call after the first (rank{R}.call{K}.json, K = 0, 1, ...), not only the last")
    a = ap.parse_args(argv)
    numel = int(a.size_mb * 1e6) // 4
    res = sc.launch(functools.partial(_rank, numel=numel, density=a.density, calls=a.calls, directory=a.dir,
                                      every=a.every, lanes=a.lanes),
                    a.workers, backend="netbed", network=sc.Network(bandwidth_gbps=a.gbps), timeout_s=600)
    om = [max(r[0][i] for r in res) for i in range(a.calls)]
    na = [max(r[1][i] for r in res) for i in range(a.calls)]
    print("omnireduce ms", [round(1e3 * v, 1) for v in om])
    print("native ms    ", [round(1e3 * v, 1) for v in na])
    print("process CPU ms per call, per rank (median after the first)",
          [round(1e3 * statistics.median(r[2][1:]), 1) for r in res])
    print("native / omnireduce (paired, median after the first): "
          f"{statistics.median(n / o for n, o in zip(na[1:], om[1:])):.2f}x")
    if res[0][3]["native"]:
        print("the calling thread per call (median after the first): CPU ms, run-queue wait ms, preempted")
        for name in ("native", "omnireduce"):
            for rank, r in enumerate(res):
                rows = r[3][name][1:]
                cpu_ms, wait_ms, pre = (statistics.median(row[k] for row in rows) for k in range(3))
                print(f"  {name:10s} rank {rank}: {1e3 * cpu_ms:6.2f}  {1e3 * wait_ms:6.2f}  {pre:5.1f}")
    firsts = first_blocks(a.dir)
    if firsts:
        print("first blocks up after the call's start, ms (traced calls): median (least - most)")
        for rank in sorted(firsts):
            v = [1e3 * s for s in firsts[rank]]
            print(f"  rank {rank}: {statistics.median(v):.2f} ({min(v):.2f} - {max(v):.2f}) over {len(v)} calls")
    print(f"timeline: python -m sparsecomm.transports.omnireduce.trace {a.dir}")


if __name__ == "__main__":
    main()
