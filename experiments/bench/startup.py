"""Start-up cost of a ``DistributedOptimizer`` on 2 gloo ranks, launched as a user does (``sc.launch``).

    python -m experiments.bench.startup                    # 5 launches, medians
    python -m experiments.bench.startup --launches 3 --profile /tmp/startup.prof   # cProfile of rank 0
    python -m experiments.bench.startup --start-method spawn   # every rank a fresh interpreter (as torchrun)

What it prints, each a median over ``--launches`` launches:

* ``import torch`` and ``import sparsecomm`` (after torch): timed in a fresh interpreter per launch
  (``python -c``), wall and process time;
* in each rank (one torch thread), with a barrier before each timed part and the slower rank's time:
  the build, ``sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=...), compressor="topk",
  method="ef", ratio=...)`` with the transport at its default, in its three parts: the first access of
  ``sc.DistributedOptimizer`` (the package imports its optimizer module then), torch's ``SGD(...)`` (the
  first torch optimizer of a process imports ``torch._dynamo``: torch's cost, every torch optimizer pays
  it) and the wrapping, and the three together; ``step 1``, ``step 2`` and ``step N``
  (``--later``): ``zero_grad, forward, backward, step()``; ``process_time`` of rank 0 next to each
  wall time (load on the machine distorts it less);
* the load average (``os.getloadavg``) before the first launch and after the last;
* the wall time of the whole ``sc.launch`` call: the first (which starts the fork server, and pays the
  imports it preloads once for the parent) and the median of the later ones. The per-rank medians are over
  every launch.

With ``--profile FILE``, rank 0 of the last launch runs the build and the first step under cProfile and
writes the stats to ``FILE`` (the top entries by cumulative time are printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

_IMPORT_SNIPPET = (
    "import time\n"
    "w0, p0 = time.perf_counter(), time.process_time()\n"
    "import torch\n"
    "w1, p1 = time.perf_counter(), time.process_time()\n"
    "import sparsecomm\n"
    "w2, p2 = time.perf_counter(), time.process_time()\n"
    "print(w1 - w0, p1 - p0, w2 - w1, p2 - p1)\n")


def time_imports() -> tuple[float, float, float, float]:
    """(torch wall, torch cpu, sparsecomm wall, sparsecomm cpu) in a fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    return tuple(float(x) for x in out)  # type: ignore[return-value]


def _timed(fn, barrier) -> tuple[float, float, object]:
    barrier()
    w, p = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - p, out


def worker(ctx, ratio: float, later: int, width: int, profile: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    import sparsecomm as sc

    torch.set_num_threads(1)
    group = ctx.fabric.native_group

    def barrier() -> None:
        dist.barrier(group=group)

    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 10))
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    prof = None
    if profile is not None and ctx.rank == 0:
        import cProfile

        prof = cProfile.Profile()

    if prof is not None:
        prof.enable()
    out: dict = {}
    # the parts of ``sc.DistributedOptimizer(torch.optim.SGD(...), ...)``, each timed on its own
    out["attr"], out["attr_cpu"], DistOpt = _timed(lambda: sc.DistributedOptimizer, barrier)
    out["sgd"], out["sgd_cpu"], inner = _timed(lambda: torch.optim.SGD(model.parameters(), lr=0.01), barrier)
    out["wrap"], out["wrap_cpu"], opt = _timed(
        lambda: DistOpt(inner, compressor="topk", method="ef", ratio=ratio), barrier)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    out["step1"], out["step1_cpu"], _ = _timed(step, barrier)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    out["step2"], out["step2_cpu"], _ = _timed(step, barrier)
    for _ in range(later - 3):
        step()
    out["stepN"], out["stepN_cpu"], _ = _timed(step, barrier)
    out["build"] = out["attr"] + out["sgd"] + out["wrap"]
    out["build_cpu"] = out["attr_cpu"] + out["sgd_cpu"] + out["wrap_cpu"]
    out["transport"] = opt.transport.name
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--width", type=int, default=256, help="hidden width of the MLP 64-w-w-10")
    p.add_argument("--later", type=int, default=10, help="the later step timed (>= 3)")
    p.add_argument("--start-method", default=None, choices=("forkserver", "spawn"),
                   help="sc.launch's start_method (default: the launcher's, forkserver where available); "
                        "spawn: every rank a fresh interpreter, as under torchrun")
    p.add_argument("--profile", default=None, help="cProfile rank 0's build and first step into this file")
    a = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    import functools

    load0 = os.getloadavg()
    imports = [time_imports() for _ in range(a.launches)]
    import sparsecomm as sc

    rows, launch_s = [], []
    for i in range(a.launches):
        prof = a.profile if i == a.launches - 1 else None
        t0 = time.perf_counter()
        res = sc.launch(functools.partial(worker, ratio=a.ratio, later=max(3, a.later), width=a.width,
                                          profile=prof), world_size=2, backend="gloo",
                        **({"start_method": a.start_method} if a.start_method else {}))
        launch_s.append(time.perf_counter() - t0)
        rows.append(res)
    load1 = os.getloadavg()
    med = statistics.median
    summary = {
        "import torch": (med(r[0] for r in imports), med(r[1] for r in imports)),
        "import sparsecomm": (med(r[2] for r in imports), med(r[3] for r in imports)),
    }
    for key, name in (("attr", "sc.DistributedOptimizer (lazy import)"), ("sgd", "torch.optim.SGD(...)"),
                      ("wrap", "DistributedOptimizer(...)"), ("build", "the three together"), ("step1", "step 1"),
                      ("step2", "step 2"), ("stepN", f"step {a.later}")):
        summary[name] = (med(max(r[0][key], r[1][key]) for r in rows), med(r[0][key + "_cpu"] for r in rows))
    print(f"2 gloo ranks, EF + top-k (ratio {a.ratio}), transport {rows[0][0]['transport']!r} (default), "
          f"MLP 64-{a.width}-{a.width}-10, {a.launches} launches ({a.start_method or 'default'} start); "
          f"load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after")
    print(f"{'':38s} {'wall s (slower rank)':>22s} {'cpu s (rank 0)':>16s}")
    for name, (wall, cpu) in summary.items():
        print(f"{name:38s} {wall:22.4f} {cpu:16.4f}")
    first = "it starts the fork server" if a.start_method != "spawn" else "spawned ranks"
    print(f"whole sc.launch(...) call: {launch_s[0]:.2f} s the first ({first}), "
          f"{med(launch_s[1:]) if len(launch_s) > 1 else float('nan'):.2f} s the later ones (median)")
    if a.profile:
        import pstats

        print(f"\ncProfile of rank 0 (build + step 1, last launch): {a.profile}")
        pstats.Stats(a.profile).sort_stats("cumulative").print_stats(40)
    return summary


if __name__ == "__main__":
    main()
