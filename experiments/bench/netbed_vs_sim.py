"""The SimFabric's network model against a real one: the same all-reduce timed on a netbed and modelled.

    python -m experiments.bench.netbed_vs_sim                          # n = 2, 4; 10 and 100 MB; 1 Gbit/s
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --gbps 0.1 --repeats 2
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --transports native ring omnireduce switch \
        --profile host.json            # every transport named, link model and a calibrated host model

With ``--transports``: every transport named, at its defaults and at the densities of
:data:`experiments.bench.transports.CASES`, measured by that benchmark's code on the netbed and modelled on
the SimFabric by the same calls (:func:`compare_transports`); ``--profile``: a host profile
(``python -m sparsecomm.netbed calibrate``) modelled as well. Otherwise, as follows.

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
import dataclasses
import functools
import os
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


def _model_cases(ctx, cases: list, numel: int) -> list[tuple[float, float]]:
    """On the SimFabric, every rank: per (case, density) of ``cases`` (:class:`.transports.Case`), after one
    untimed call, the ``(start, end)`` modelled clock of a call that follows a barrier, as ``measured`` times
    the netbed's (the same inputs: :func:`.transports.block_sparse`)."""
    from .transports import block_sparse

    f = ctx.fabric
    out = []
    for case in cases:
        # native (gloo's ring all-reduce) is modelled as the library's ring: the same bytes, the same steps
        t = (sc.transports.get("ring", f) if case.transport == "native"
             else sc.transports.get(case.transport, f, **case.kwargs))
        for d in case.densities:
            x0 = block_sparse(numel, d, case.block, seed=1000 * ctx.rank + int(d * 1e4))
            for timed in (False, True):
                x = x0.clone()
                f.barrier()
                t0 = f.now()
                t.allreduce(x)
                if timed:
                    out.append((t0, f.now()))
    return out


def modelled_cases(workers: int, size_mb: float, cases: list, network: "sc.Network") -> list[float]:
    """The SimFabric's time of each (case, density) of ``cases`` on ``network``: from the last rank's start to
    the last rank's end, as the netbed's is measured (one launch per distinct set of services)."""
    numel = int(size_mb * 1e6) // 4
    times = []
    for case in cases:
        per_rank = sc.launch(functools.partial(_model_cases, cases=[case], numel=numel), workers,
                             services=list(case.services), network=network)
        for i in range(len(case.densities)):
            times.append(max(r[i][1] for r in per_rank) - max(r[i][0] for r in per_rank))
    return times


def compare_transports(workers: int, size_mb: float, gbps: float, names: list[str], repeats: int,
                       profile: str | None, link: bool = True) -> list[dict]:
    """Every transport of ``names`` at its defaults (:data:`.transports.CASES`' headline rows, their
    densities) measured on a netbed (:func:`.transports.run`) and modelled on the SimFabric: the link model
    alone (the small-message latency measured over the same netbed, TCP framing), and, with ``profile`` (a
    host profile, ``python -m sparsecomm.netbed calibrate``), the link plus that host model, its CPU share
    the processes per core of the netbed (workers and services, on this machine's cores) and its wire
    latency :data:`NETBED_LATENCY_US` (``native``, modelled as ``ring``, is charged ``native``'s cost per call);
    ``link=False``: the host model only (the link model of a large switch call, one datagram per 64-value
    packet, takes many minutes)."""
    import os

    from . import transports as tb

    cases = [c for c in tb.CASES if c.transport in names and not c.tuned]
    real = tb.run(workers, size_mb, cases, repeats, 1, 600.0, netbed_gbps=gbps)
    sims = {}
    if link:
        latency = measured(workers, 0.001, gbps, repeats=1)["latency_s"]
        net = sc.Network(bandwidth_gbps=gbps, latency_us=latency * 1e6, payload_fraction=TCP_OVER_ETHERNET)
        sims["link"] = modelled_cases(workers, size_mb, cases, net)
    if profile:
        host_times = []
        for c in cases:
            net = sc.Network.from_profile(profile, bandwidth_gbps=gbps, latency_us=NETBED_LATENCY_US,
                                          payload_fraction=TCP_OVER_ETHERNET)
            # the workers and the services (a switch on the top of rack is a process too) on this machine's cores
            host = net.host.sharing(workers + len(c.services), os.cpu_count() or 1)
            if c.transport == "native":     # modelled as the ring's messages, with native's own cost per call
                host = dataclasses.replace(host, call_s={**host.call_s, "ring": host.call_s.get("native", 0.0)})
            net.host = host
            host_times += modelled_cases(workers, size_mb, [c], net)
        sims["host"] = host_times
    rows = []
    for i, r in enumerate(real):
        row = dict(case=r["case"], density=r["density"], measured_s=r["median_s"],
                   link_limit_s=r.get("link_limit_s"))
        for k, v in sims.items():
            row[k + "_s"] = v[i]
            row[k + "_ratio"] = v[i] / r["median_s"]
        rows.append(row)
    return rows



def _load() -> str:
    """The load averages over 1, 5 and 15 minutes."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10.0, 100.0])
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=None,
                    help="every transport named (at its defaults and densities) instead of native and ring "
                         "against the ring's model: e.g. native ring allgather omnireduce switch sparse-switch")
    ap.add_argument("--profile", default=None,
                    help="a host profile (python -m sparsecomm.netbed calibrate) to model with as well")
    ap.add_argument("--no-link-model", action="store_true",
                    help="with --transports and --profile: model with the host profile only")
    a = ap.parse_args(argv)
    if a.no_link_model and not (a.transports and a.profile):
        ap.error("--no-link-model needs --transports and --profile")
    if a.transports:
        print(f"# netbed links {a.gbps:g} Gbit/s; modelled: link only (measured small-message latency), "
              f"and with the host profile {a.profile or '(none)'}")
        print("| workers | size MB | transport | density | netbed ms | link-limited ms | link model ms | ratio "
              "| link + host ms | ratio |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n in a.workers:
            for size in a.sizes_mb:
                for r in compare_transports(n, size, a.gbps, a.transports, a.repeats, a.profile,
                                            link=not a.no_link_model):
                    lim = f"{r['link_limit_s'] * 1e3:.1f}" if r.get("link_limit_s") is not None else ""
                    host = (f"{r['host_s'] * 1e3:.1f} | {r['host_ratio']:.2f}" if "host_s" in r else " | ")
                    link = f"{r['link_s'] * 1e3:.1f} | {r['link_ratio']:.2f}" if "link_s" in r else " | "
                    print(f"| {n} | {size:g} | {r['case']} | {r['density']:g} | {r['measured_s'] * 1e3:.1f} | {lim} "
                          f"| {link} | {host} |", flush=True)
        print("# load average at the end", _load())
        return
    load = _load()
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
    print("# load average at the end", _load())


if __name__ == "__main__":
    main()
