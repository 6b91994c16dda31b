"""The SimFabric's network model against a real one: the same all-reduce timed on a netbed and modelled.

    python -m experiments.bench.netbed_vs_sim                          # n = 2, 4; 10 and 100 MB; 1 Gbit/s
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --gbps 0.1 --repeats 2

For every (workers, size): on a netbed with links of ``--gbps``, the median over ``--repeats`` calls
(after one warm-up, each after a barrier, slowest rank) of ``native`` (``torch.distributed.all_reduce``,
gloo's ring for large CPU tensors) and of ``ring`` (this library's ring over the Fabric), in one launch,
interleaved; then the SimFabric's modelled time of ``ring`` at the same bandwidth, with the netbed's
TCP/Ethernet framing (:data:`sparsecomm.fabric.sim.TCP_OVER_ETHERNET`) and its measured one-way latency.
Both measured transports are compared to that modelled time (the model of a bandwidth-optimal ring; gloo's
native all-reduce moves the same bytes). ``ratio`` = modelled / measured.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.fabric.sim import TCP_OVER_ETHERNET

#: one-way latency of a netbed path (host - top of rack - host), half the ~20 us round trip measured here
NETBED_LATENCY_US = 10.0


def _measure(ctx, numel: int, repeats: int) -> dict[str, list[float]]:
    f = ctx.fabric
    cases = {"native": sc.transports.get("native", f, inplace=True),
             "ring": sc.transports.get("ring", f, inplace=True)}
    x = torch.ones(numel)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(repeats + 1):
        for name, t in cases.items():
            x.fill_(1.0)
            f.barrier()
            t0 = time.perf_counter()
            t.allreduce(x)
            if rep:
                times[name].append(time.perf_counter() - t0)
            if not torch.equal(x, torch.full_like(x, float(ctx.world_size))):
                raise AssertionError(f"{name}: wrong sum")
    return times


def measured(workers: int, size_mb: float, gbps: float, repeats: int = 3) -> dict[str, float]:
    """Median (over calls) of the slowest rank's time of native and ring on a netbed."""
    numel = int(size_mb * 1e6) // 4
    per_rank = sc.launch(functools.partial(_measure, numel=numel, repeats=repeats), workers, backend="netbed",
                         network=sc.Network(bandwidth_gbps=gbps), timeout_s=600)
    return {k: statistics.median(max(r[k][i] for r in per_rank) for i in range(repeats)) for k in per_rank[0]}


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
    sim = modelled(workers, size_mb, gbps)
    return {"native_s": real["native"], "ring_s": real["ring"], "sim_s": sim,
            "native_ratio": sim / real["native"], "ring_ratio": sim / real["ring"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10.0, 100.0])
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    print(f"# netbed links {a.gbps:g} Gbit/s; SimFabric: ring, latency {NETBED_LATENCY_US:g} us, payload "
          f"fraction {TCP_OVER_ETHERNET:.4f}")
    print("| workers | size MB | netbed native ms | netbed ring ms | SimFabric ms | sim/native | sim/ring |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.workers:
        for size in a.sizes_mb:
            c = compare(n, size, a.gbps, a.repeats)
            print(f"| {n} | {size:g} | {c['native_s'] * 1e3:.1f} | {c['ring_s'] * 1e3:.1f} | {c['sim_s'] * 1e3:.1f} "
                  f"| {c['native_ratio']:.2f} | {c['ring_ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
