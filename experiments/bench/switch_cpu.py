"""CPU per process (and per thread) of the ``switch`` transport's calls on local gloo processes.

    python -m experiments.bench.switch_cpu                      # n = 2, 100 MB, 10 timed calls
    python -m experiments.bench.switch_cpu --workers 4 --calls 5 --threads
    python -m experiments.bench.switch_cpu --perf /tmp/p.data --perf-args=-g        # perf record, call graphs
    python -m experiments.bench.switch_cpu --perf /tmp/s.txt --perf-args "stat -e syscalls:sys_enter_epoll_wait"
    python -m experiments.bench.switch_cpu --burst 256                              # per-message cost

Launches ``n`` workers and the switch rank as ``experiments.bench.transports`` does for its tuned switch
row: the library's defaults (a rank started as ``"switch"``: on gloo 256-element packets, bursts of
1024, a pool of 8191), in place; ``--burst`` starts the switch rank with another burst and ``--pool``
sets the workers' pool. It runs ``--warmup`` untimed calls, then reads
every sibling process's CPU time (``/proc/<pid>/stat`` utime + stime, and with ``--threads`` each
thread's) before and after ``--calls`` calls, from rank 0, with a barrier on each side: the CPU-seconds
per call of each worker and of the switch. Only the calls run between the two readings (the input is
not restored between calls: the switch sums whatever the previous call left, which costs the same).
On a shared machine the figures are CPU, not wall time: other processes' load changes them little.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

import sparsecomm as sc

SERVICE = "switch"
KWARGS = {"inplace": True}


def _ticks(path: str) -> tuple[int, int, str] | None:
    try:
        with open(path) as fh:
            s = fh.read()
    except OSError:
        return None
    name = s[s.index("(") + 1:s.rindex(")")]
    rest = s[s.rindex(")") + 2:].split()
    return int(rest[11]), int(rest[12]), name       # utime, stime (fields 14, 15)


def _siblings() -> list[int]:
    me, parent = os.getpid(), os.getppid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                s = fh.read()
        except OSError:
            continue
        if int(s[s.rindex(")") + 2:].split()[1]) == parent:
            out.append(int(d))
    return sorted(out) if me in out else [me]


def _snapshot(pids: list[int], threads: bool) -> dict:
    snap = {}
    for pid in pids:
        t = _ticks(f"/proc/{pid}/stat")
        if t is not None:
            snap[(pid, None)] = t
        if threads:
            for tid in os.listdir(f"/proc/{pid}/task"):
                t = _ticks(f"/proc/{pid}/task/{tid}/stat")
                if t is not None:
                    snap[(pid, int(tid))] = t
    return snap


def worker(ctx, numel: int, calls: int, warmup: int, threads: bool, perf: str | None = None,
           perf_args: tuple[str, ...] = (), kwargs: dict | None = None):
    f = ctx.fabric
    t = sc.transports.get("switch", f, **(kwargs or KWARGS))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(warmup):
        x.normal_(generator=torch.Generator().manual_seed(ctx.rank))
        t.allreduce(x)
    x.normal_(generator=torch.Generator().manual_seed(ctx.rank))
    pids = _siblings() if ctx.rank == 0 else []
    rec = None
    if perf and ctx.rank == 0:      # sample every process of the job during the timed calls
        import subprocess

        cmd = (["perf", "stat", "--per-thread", "-x", ",", "-o", perf, *perf_args[1:]] if perf_args[:1] == ("stat",)
               else ["perf", "record", "-F", "1999", *perf_args, "-o", perf])
        rec = subprocess.Popen([*cmd, "-p", ",".join(map(str, pids))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    f.barrier()
    before = _snapshot(pids, threads)
    c0 = time.process_time()
    w0 = time.perf_counter()
    for _ in range(calls):
        f.barrier()
        t.allreduce(x)
    f.barrier()
    wall = time.perf_counter() - w0
    own = time.process_time() - c0
    after = _snapshot(pids, threads)
    if rec is not None:
        import signal

        rec.send_signal(signal.SIGINT)
        rec.wait()
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    for key, (u, k, name) in after.items():
        if key in before:
            b = before[key]
            rows.append((key[0], key[1], name, (u + k - b[0] - b[1]) / hz / calls, (k - b[1]) / hz / calls))
    return {"rank": ctx.rank, "pid": os.getpid(), "own_cpu": own / calls, "wall": wall / calls, "rows": rows,
            "pool": t.pool_size, "burst": t.burst}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", action="store_true", help="also each thread's CPU (busiest first)")
    ap.add_argument("--perf", default=None, metavar="FILE",
                    help="also `perf record` every process of the job during the timed calls into FILE")
    ap.add_argument("--perf-args", default="", metavar="ARGS",
                    help="extra arguments for `perf record`, e.g. '-g' (call graphs); 'stat -e EVENTS' runs "
                         "`perf stat --per-thread -e EVENTS` instead (e.g. syscall counts per thread into FILE)")
    ap.add_argument("--burst", type=int, default=None,
                    help="packets per message, the switch rank's (default: the fabric's, 1024 on gloo)")
    ap.add_argument("--pool", type=int, default=None, help="the transport's pool_size (default: 8 bursts, at most the slots less one)")
    a = ap.parse_args(argv)
    kwargs = dict(KWARGS, **({} if a.pool is None else {"pool_size": a.pool}))
    service = SERVICE if a.burst is None else f"{SERVICE}:burst={a.burst}"
    numel = int(a.size_mb * 1e6) // 4
    res = sc.launch(functools.partial(worker, numel=numel, calls=a.calls, warmup=a.warmup, threads=a.threads,
                                      perf=a.perf, perf_args=tuple(a.perf_args.split()), kwargs=kwargs),
                    a.workers, backend="gloo", services=(service,), timeout_s=600.0)
    r0 = res[0]
    pid_rank = {r["pid"]: f"worker {r['rank']}" for r in res}
    procs = {p: (c, k) for p, tid, _n, c, k in r0["rows"] if tid is None}
    total = kernel = 0.0
    print(f"# n = {a.workers}, {a.size_mb:g} MB, pool {r0['pool']}, burst {r0['burst']}, {a.calls} calls, wall {r0['wall'] * 1e3:.1f} ms per call "
          f"(barrier to barrier), load average {os.getloadavg()[0]:.1f}")
    for p, (c, k) in sorted(procs.items()):
        who = pid_rank.get(p, "switch" if c > 0.005 else f"pid {p}")
        if c <= 0.0005:
            continue
        total += c
        kernel += k
        print(f"{who:>10}: {c * 1e3:7.1f} ms CPU per call ({k * 1e3:.1f} in the kernel)")
        if a.threads:
            ths = sorted(((c2, k2, tid, n) for p2, tid, n, c2, k2 in r0["rows"] if p2 == p and tid is not None),
                         reverse=True)
            for c2, k2, tid, n in ths:
                if c2 > 0.0005:
                    print(f"{'':>14}thread {tid} {n}: {c2 * 1e3:6.1f} ({k2 * 1e3:.1f} kernel)")
    print(f"{'total':>10}: {total * 1e3:7.1f} ms CPU per call ({kernel * 1e3:.1f} in the kernel)")


if __name__ == "__main__":
    main()
