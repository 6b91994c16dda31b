"""Process CPU per call of the ``omnireduce`` transport on local gloo processes, and an A/B of two checkouts.

    python -m experiments.bench.omnireduce_cpu                                   # n = 2 4, d = 0.01 0.1 1
    python -m experiments.bench.omnireduce_cpu --workers 2 --densities 0.01 --profile /tmp/prof
    python -m experiments.bench.omnireduce_cpu --trees /tmp/omni_base . --rounds 5   # alternated A/B

Each of ``n`` gloo ranks on this host builds the benchmark's colocated case (``block_size=256,
lanes=65536, inplace=True``, as ``experiments.bench.transports``) and calls ``allreduce`` on 100 MB of
its block-sparse input (:func:`experiments.bench.transports.block_sparse`, the same seeds), restored
before every call (untimed). Per call, ``time.process_time()`` (the rank's whole process: its main
thread, gloo's threads and the fabric's helper threads) and the wall time, barrier to return, are taken
around ``allreduce``, and ``time.thread_time()`` (the main thread alone); the densities are
interleaved per repetition. Printed: per (n, d) the median CPU per call of every rank, the median
over ranks of those, and the median wall time of the slowest rank; and per call (median over ranks
and calls) the receives and sends this rank posted on the fabric and the receives handed to a helper
thread to learn of their completion (gloo reports completion only through a blocking wait:
:mod:`sparsecomm.fabric.torch.torch_waiters`); and the CPU per call of each thread (the main thread; the
others by name: gloo's, the helpers), barrier to barrier.
CPU per call is what this measures: on a shared host the wall times are load-bound, the CPU figures
much less so.

``--profile DIR``: each rank runs its timed calls under cProfile and writes
``DIR/n{n}.d{d}.rank{R}.prof`` (read with ``python -m pstats``), timed by the main thread's CPU
(``time.thread_time``: other threads' CPU is not in it, nor is waiting); the CPU figures then include
the profiler's overhead.

``--netbed GBPS``: the ranks run on the netbed (each in its own network namespace, links of ``GBPS``
Gbit/s; needs root), where the kernel's shaping and forwarding and gloo's slower writes add CPU that
loopback does not show.

``--trees A B ...`` (run from the repository root): run this benchmark once per tree and round,
alternating the trees' order each round, each with the tree's ``sparsecomm`` first on the path (a
symbolic link in a temporary folder; this benchmark and its input maker stay this checkout's) and
``NUMBA_CACHE_DIR=<tree>/.numba_cache``, and print per (n, d) and tree the per-round medians (over
ranks) and their median. A tree is any checkout, e.g. ``git worktree add --detach /tmp/omni_base main``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

KWARGS = {"block_size": 256, "lanes": 65536, "inplace": True}


def worker(ctx, numel: int, densities: list[float], calls: int, warmup: int, profile: str | None,
           kwargs: dict) -> dict:
    import sparsecomm as sc

    from .transports import block_sparse

    f = ctx.fabric
    t = sc.transports.get("omnireduce", f, **kwargs)
    ops = _count_ops(f)
    pristine = {d: block_sparse(numel, d, kwargs["block_size"], seed=1000 * ctx.rank + int(d * 1e4))
                for d in densities}
    work = {d: x.clone() for d, x in pristine.items()}
    cpu = {d: [] for d in densities}
    main = {d: [] for d in densities}
    counts = {d: [] for d in densities}
    wall = {d: [] for d in densities}
    profs = {}
    if profile:
        import cProfile

        profs = {d: cProfile.Profile(time.thread_time) for d in densities}   # the main thread's CPU

    def call(d: float, timed: bool) -> None:
        x = work[d]
        x.copy_(pristine[d])
        f.barrier()
        p = profs.get(d) if timed else None
        if p is not None:
            p.enable()
        before = dict(ops)
        c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        t.allreduce(x)
        c1, m1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        after = dict(ops)
        if p is not None:
            p.disable()
        if timed:
            cpu[d].append(c1 - c0)
            main[d].append(m1 - m0)
            counts[d].append({k: after[k] - before.get(k, 0) for k in after})
            wall[d].append(w1 - w0)

    for _ in range(warmup):
        for d in densities:
            call(d, False)
    threads0 = _thread_ticks()
    for _ in range(calls):
        for d in densities:
            call(d, True)
    threads1 = _thread_ticks()
    f.barrier()
    if profile:
        os.makedirs(profile, exist_ok=True)
        for d, p in profs.items():
            p.dump_stats(os.path.join(profile, f"n{ctx.world_size}.d{d:g}.rank{ctx.rank}.prof"))
    hz = os.sysconf("SC_CLK_TCK")
    threads: dict = {}
    for tid, (name, ticks) in threads1.items():
        spent = (ticks - threads0.get(tid, (name, 0))[1]) / hz / (calls * len(densities))
        threads[name] = threads.get(name, 0.0) + spent
    return {"rank": ctx.rank, "cpu": cpu, "main": main, "wall": wall, "counts": counts, "threads": threads}


def _thread_ticks() -> dict:
    """``{thread id: (name, utime + stime ticks)}`` of this process's threads (``/proc/self/task``)."""
    import threading

    out, main = {}, threading.main_thread().native_id
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                st = fh.read()
        except OSError:
            continue
        rest = st[st.rindex(")") + 2:].split()
        name = "main" if int(tid) == main else st[st.index("(") + 1:st.rindex(")")]
        out[int(tid)] = (name, int(rest[11]) + int(rest[12]))
    return out


def _count_ops(f) -> dict:
    """Count, from now on, this rank's receives and sends posted on the fabric and (gloo) the receives
    handed to a helper thread to learn of their completion (:mod:`sparsecomm.fabric.torch.torch_waiters`):
    wrappers on this process's own objects, for this benchmark only."""
    from sparsecomm.fabric.torch import torch_waiters

    ops = {"recvs": 0, "sends": 0, "handoffs": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            ops[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    f._post_recv = counting("recvs", f._post_recv)
    f._post_send = counting("sends", f._post_send)
    torch_waiters._WAITERS.submit = counting("handoffs", torch_waiters._WAITERS.submit)
    return ops


def measure(workers: int, size_mb: float, densities: list[float], calls: int, warmup: int,
            profile: str | None, kwargs: dict, netbed: float | None = None) -> dict:
    """One launch of ``workers`` gloo ranks; per density: every rank's median CPU per call (s), the
    median over ranks, and the median of the slowest rank's wall time per call."""
    import sparsecomm as sc

    numel = round(size_mb * 1e6) // 4
    res = sc.launch(functools.partial(worker, numel=numel, densities=densities, calls=calls, warmup=warmup,
                                      profile=profile, kwargs=kwargs),
                    workers, timeout_s=600.0,
                    **({"backend": "gloo"} if netbed is None else
                       {"backend": "netbed", "network": sc.Network(bandwidth_gbps=netbed)}))
    out = {}
    names = sorted({k for r in res for k in r["threads"]})
    by_name = {k: statistics.median(r["threads"].get(k, 0.0) for r in res) for k in names}
    print("# CPU ms per call by thread (main; others by name), barrier to barrier, all densities together, "
          "median over ranks: "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])), flush=True)
    for d in densities:
        per_rank = [statistics.median(r["cpu"][d]) for r in res]
        slowest = [max(r["wall"][d][j] for r in res) for j in range(calls)]
        main = statistics.median(statistics.median(r["main"][d]) for r in res)
        ops = {k: statistics.median(c[k] for r in res for c in r["counts"][d]) for k in ("recvs", "sends", "handoffs")}
        out[d] = {"cpu_ranks": per_rank, "cpu": statistics.median(per_rank), "main": main, "ops": ops,
                  "wall": statistics.median(slowest)}
    return out


def ab(trees: list[str], rounds: int, argv: list[str]) -> None:
    """Alternated runs of this benchmark, one subprocess per tree and round (see the module docstring)."""
    root = os.getcwd()
    res: dict = {}
    for r in range(rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for tree in order:
            code = os.path.abspath(tree)
            with tempfile.TemporaryDirectory(prefix="omnireduce_cpu_") as tmp:
                os.symlink(os.path.join(code, "sparsecomm"), os.path.join(tmp, "sparsecomm"))
                out = os.path.join(tmp, "rows.json")
                env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{root}",
                           NUMBA_CACHE_DIR=os.path.join(code, ".numba_cache"))
                t0 = time.time()
                subprocess.run([sys.executable, "-m", "experiments.bench.omnireduce_cpu", *argv, "--json", out],
                               env=env, cwd=tmp, check=True, stdout=subprocess.DEVNULL)   # (-m: cwd first on the path)
                with open(out) as fh:
                    rows = json.load(fh)
            for row in rows:
                res.setdefault((row["workers"], row["density"]), {}).setdefault(tree, []).append(row)
            print(f"# round {r}, {tree}: {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    print("| n | d | tree | CPU ms per call per rank, median over ranks, per round | median | main thread | "
          "wall ms (median) | receives / sends / hand-offs |")
    print("|---:|---:|---|---|---:|---:|---:|---|")
    for (n, d), per in sorted(res.items()):
        for tree in trees:
            rows = per.get(tree, [])
            cpus = [row["cpu"] * 1e3 for row in rows]
            walls = [row["wall"] * 1e3 for row in rows]
            mains = [row["main"] * 1e3 for row in rows]
            ops = " / ".join(f"{statistics.median(row['ops'][k] for row in rows):g}"
                             for k in ("recvs", "sends", "handoffs"))
            print(f"| {n} | {d:g} | {tree} | {' '.join(f'{c:.1f}' for c in cpus)} | "
                  f"{statistics.median(cpus):.1f} | {statistics.median(mains):.1f} | {statistics.median(walls):.1f} | "
                  f"{ops} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--numel", type=int, default=None,
                    help="elements per call (instead of --size-mb), e.g. 1059850 and 66560: the MLP's two buckets")
    ap.add_argument("--lanes", type=int, default=None,
                    help="the transport's lanes (default: the benchmark's 65536; 16384 is the transport's own)")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--channels", type=int, default=None, help="the transport's channels (default: its own)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="cProfile every rank's timed calls into DIR")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                    help="run the ranks on the netbed (links of GBPS Gbit/s; needs root) instead of loopback")
    ap.add_argument("--trees", nargs="+", default=None, metavar="TREE",
                    help="alternated A/B: run this benchmark in each tree (PYTHONPATH=TREE) per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --trees")
    a = ap.parse_args(argv)
    if a.trees:
        rest, skip = [], False
        for arg in argv:   # everything but --trees/--rounds goes to each run
            if skip and not arg.startswith("--"):
                continue
            skip = arg.startswith("--trees") or arg.startswith("--rounds")
            if not skip:
                rest.append(arg)
        ab(a.trees, a.rounds, rest)
        return
    kwargs = dict(KWARGS)
    if a.channels is not None:
        kwargs["channels"] = a.channels
    if a.lanes is not None:
        kwargs["lanes"] = a.lanes
    if a.numel is not None:
        a.size_mb = 4 * a.numel / 1e6
    rows = []
    where = "loopback" if a.netbed is None else f"netbed {a.netbed:g} Gbit/s"
    print(f"# {a.size_mb:g} MB, {where}, {kwargs}, {a.calls} calls, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| n | d | CPU ms per call, per rank | median over ranks | main thread | wall ms (slowest rank, median) "
          "| receives / sends / hand-offs per call |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for n in a.workers:
        res = measure(n, a.size_mb, a.densities, a.calls, a.warmup, a.profile, kwargs, a.netbed)
        for d, r in res.items():
            rows.append(dict(workers=n, density=d, **r))
            print(f"| {n} | {d:g} | {' '.join(f'{c * 1e3:.1f}' for c in r['cpu_ranks'])} | {r['cpu'] * 1e3:.1f} | "
                  f"{r['main'] * 1e3:.1f} | {r['wall'] * 1e3:.1f} | {r['ops']['recvs']:g} / {r['ops']['sends']:g} / "
                  f"{r['ops']['handoffs']:g} |", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh)


if __name__ == "__main__":
    main()
