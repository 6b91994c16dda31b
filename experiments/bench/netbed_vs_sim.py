"""The SimFabric's network model against a real one: the same all-reduce timed on a netbed and modelled.

    python -m experiments.bench.netbed_vs_sim                          # n = 2, 4; 10 and 100 MB; 1 Gbit/s
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --gbps 0.1 --repeats 2

For every (workers, size): on a netbed with links of ``--gbps``, the median over ``--repeats`` calls
(after one warm-up, each after a barrier) of ``native`` (``torch.distributed.all_reduce``, gloo's ring for
large CPU tensors) and of ``ring`` (this library's ring over the Fabric), in one launch, interleaved; then
the SimFabric's modelled time of ``ring`` at the same bandwidth, with the netbed's TCP/Ethernet framing
(:data:`sparsecomm.fabric.sim.sim_network.TCP_OVER_ETHERNET`) and the one-way latency of a small message
measured over the same fabric in the same launch (:func:`sparsecomm.fabric.probe.fabric_latency_s`: the
kernel's path plus gloo's rendezvous and the ranks' wake-ups, which on a shared host can be most of it).
Both measured transports are compared to that modelled time (the model of a bandwidth-optimal ring;
gloo's native all-reduce moves the same bytes). ``ratio`` = modelled / measured.

A call's measured time runs from the moment its *last* rank called it to the moment its last rank
returned (one clock, ``time.monotonic``, for every namespace of the machine), as the model's does (every
rank starts at modelled time 0): the barrier before a call releases the ranks one after another (worker 0
sends the releases in turn), and no rank of an all-reduce can finish before the last one has started, so
timing each rank from its own start would add that release skew to the all-reduce. The table shows the
skew's median.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.fabric.sim.sim_network import TCP_OVER_ETHERNET
from sparsecomm.fabric.probe import fabric_latency_s

#: :func:`modelled`'s default one-way latency: a netbed path in the kernel (host - top of rack - host; its
#: round trip: ``python -m sparsecomm.netbed check``); :func:`compare` passes the fabric's own latency
#: measured in the same launch instead (module docstring)
NETBED_LATENCY_US = 10.0


def _measure(ctx, numel: int, repeats: int) -> tuple[float, dict[str, list[tuple[float, float]]]]:
    f = ctx.fabric
    latency = fabric_latency_s(f)
    cases = {"native": sc.transports.get("native", f, inplace=True),
             "ring": sc.transports.get("ring", f, inplace=True)}
    x = torch.ones(numel)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for rep in range(repeats + 1):
        for name, t in cases.items():
            x.fill_(1.0)
            f.barrier()
            t0 = time.monotonic()
            t.allreduce(x)
            if rep:
                times[name].append((t0, time.monotonic()))
            if not torch.equal(x, torch.full_like(x, float(ctx.world_size))):
                raise AssertionError(f"{name}: wrong sum")
    return latency, times


def measured(workers: int, size_mb: float, gbps: float, repeats: int = 3) -> dict[str, float]:
    """On a netbed: per transport, the median over calls of the time from the last rank's start to the last
    rank's end (and, as ``<name>_skew``, the median spread of the ranks' starts); ``latency_s``: the
    fabric's one-way latency of a small message (:func:`~sparsecomm.netbed.probe.fabric_latency_s`)."""
    numel = int(size_mb * 1e6) // 4
    per_rank = sc.launch(functools.partial(_measure, numel=numel, repeats=repeats), workers, backend="netbed",
                         network=sc.Network(bandwidth_gbps=gbps), timeout_s=600)
    out = {"latency_s": per_rank[0][0]}
    for k in per_rank[0][1]:
        calls = [[r[1][k][i] for r in per_rank] for i in range(repeats)]
        out[k] = statistics.median(max(e for _, e in c) - max(s for s, _ in c) for c in calls)
        out[k + "_skew"] = statistics.median(max(s for s, _ in c) - min(s for s, _ in c) for c in calls)
    return out


def _model(ctx, numel: int) -> float:
    t = sc.transports.get("ring", ctx.fabric, inplace=True)
    t0 = ctx.fabric.now()
    t.allreduce(torch.ones(numel))
    return ctx.fabric.now() - t0


def modelled(workers: int, size_mb: float, gbps: float, *, framing: float = TCP_OVER_ETHERNET,
             latency_us: float = NETBED_LATENCY_US) -> float:
    """The SimFabric's time of a ring all-reduce of ``size_mb`` on ``workers`` at ``gbps``."""
    numel = int(size_mb * 1e6) // 4
    net = sc.Network(bandwidth_gbps=gbps, latency_us=latency_us, payload_fraction=framing)
    return max(sc.launch(functools.partial(_model, numel=numel), workers, network=net))


def compare(workers: int, size_mb: float, gbps: float, repeats: int = 3) -> dict[str, float]:
    real = measured(workers, size_mb, gbps, repeats)
    sim = modelled(workers, size_mb, gbps, latency_us=real["latency_s"] * 1e6)
    return {"native_s": real["native"], "ring_s": real["ring"], "sim_s": sim, "latency_s": real["latency_s"],
            "skew_s": statistics.median([real["native_skew"], real["ring_skew"]]),
            "native_ratio": sim / real["native"], "ring_ratio": sim / real["ring"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10.0, 100.0])
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    print(f"# netbed links {a.gbps:g} Gbit/s; SimFabric: ring at the fabric latency measured on the netbed, "
          f"payload fraction {TCP_OVER_ETHERNET:.4f}; load average {load}")
    print("| workers | size MB | fabric latency us | start skew ms | netbed native ms | netbed ring ms "
          "| SimFabric ms | sim/native | sim/ring |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.workers:
        for size in a.sizes_mb:
            c = compare(n, size, a.gbps, a.repeats)
            print(f"| {n} | {size:g} | {c['latency_s'] * 1e6:.0f} | {c['skew_s'] * 1e3:.1f} | {c['native_s'] * 1e3:.1f} "
                  f"| {c['ring_s'] * 1e3:.1f} | {c['sim_s'] * 1e3:.1f} | {c['native_ratio']:.2f} "
                  f"| {c['ring_ratio']:.2f} |", flush=True)
    with open("/proc/loadavg") as fh:
        print("# load average at the end", " ".join(fh.read().split()[:3]))


if __name__ == "__main__":
    main()
