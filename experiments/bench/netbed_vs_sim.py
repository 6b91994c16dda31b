"""The SimFabric's network model against a real one: the same all-reduce timed on a netbed and modelled.

    python -m experiments.bench.netbed_vs_sim                          # n = 2, 4; 10 and 100 MB; 1 Gbit/s
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --gbps 0.1 --repeats 2
    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 --transports native ring omnireduce switch \
        --profile host.json            # every transport named, link model and a calibrated host model
    python -m experiments.bench.netbed_vs_sim --loopback --profile host.json --workers 2 4 --sizes-mb 1 10 100 \
        --repeats 7                    # loopback (no netbed, no root): the fastest, measured and modelled

With ``--transports``: every transport named, at its defaults and at the densities of
:data:`experiments.bench.transports.CASES`, measured by that benchmark's code on the netbed and modelled on
the SimFabric by the same calls (:func:`compare_transports`); ``--profile``: a host profile
(``python -m sparsecomm.netbed calibrate``) modelled as well. ``--transports all``: every transport of
:data:`VALIDATED` (:func:`validated_cases`), the validation's set: ``native``, ``ring``, ``allgather``,
``omnireduce`` at densities 1, 0.1 and 0.01, ``switch`` and ``sparse-switch`` (at the same densities)::

    python -m experiments.bench.netbed_vs_sim --workers 2 --sizes-mb 10 100 --transports all \
        --repeats 5 --profile host.json --no-link-model

With ``--loopback`` (:func:`compare_loopback`, :func:`agreement`; needs ``--profile``, not root): the loopback
benchmark (:mod:`experiments.bench.transports`: local gloo processes on 127.0.0.1, no shaping) against the
model. Every case it runs -- each transport named by ``--transports`` (default: the benchmark's default
selection) at its defaults and the block densities it is fed, for every ``--workers`` and ``--sizes-mb`` --
is measured by that benchmark's code (one launch per set of services, each with the reference
``native (tuned: inplace=True)``; a call after a barrier, the slowest rank's time; ``--repeats`` calls,
interleaved) and modelled on the SimFabric by the same calls. Then, per (workers, size, density): the
measured fastest (the least median of its calls over its launch's reference's, which cancels a drifting
load), the modelled fastest, and a verdict: ``agree``, ``tie`` (the model's pick is within the run's noise
of the measured fastest: their paired ratio within ``--tie``, default 3%, or within twice the standard
error of its median, whichever is wider) or ``disagree``; a density at which one transport runs has nothing
to choose and is not counted (with the default selection only ``omnireduce`` is fed sparse blocks:
``--transports native ring omnireduce switch sparse-switch`` gives the sparse densities a choice). The
*strict* rate (``agree`` only) is the issue's figure: a tie names a case the measurement cannot decide,
reported beside it as the *tie-aware* rate, not hidden in it.

What the loopback model assumes:

- no wire of its own (:data:`LOOPBACK_WIRE`, as :mod:`sparsecomm.netbed.calibrate` models its loopback
  calls): a loopback message is the two hosts' work, all of it in the profile's rates -- its per-message
  and per-byte send and receive costs were fitted on loopback rounds --, plus the sums, scans, switch
  packets and per-call costs the transports declare;
- every process of a launch (the workers and the services, a switch too) busy on ``--cores`` cores
  (default: this machine's), each host cost stretched by ``max(1, processes / cores)``
  (:meth:`HostModel.sharing <sparsecomm.fabric.sim.sim_host.HostModel.sharing>`; where the profile has rates fitted
  with that many processes per core or fewer, above one, its ``by_share``, the largest such share's in place of
  its own); other jobs' load is not
  modelled: with no wire every modelled time scales with the host costs, so a uniform slowdown leaves the
  verdicts alone, but it makes the measured times noisier and their ratios to the model lower. Each launch
  probes its loopback (:func:`~sparsecomm.fabric.probe.link_parameters`: the one-way latency of a 256-byte
  message, the rate of 1 MiB, a further message of a burst), printed beside the same probe on the model:
  where they differ by one factor, the machine is that much slower than when it was calibrated; where by
  different factors, a rate of the profile is off for this load;
- ``native`` is modelled as gloo's ring all-reduce (:func:`model_transport`:
  :class:`~sparsecomm.transports.native.model.GlooRing`, its segments of at most 1 MiB, two in flight, each message
  charged the profile's native message rates, and ``native``'s own per-call cost), as with ``--profile`` on the
  netbed;
- the measured time of a call runs from each rank's own start after the barrier (the benchmark's), the
  modelled one from the last rank's start: the barrier's release skew (tens of microseconds unloaded) is in
  every measured time and in no modelled one.

Otherwise, for every (workers, size): on a netbed with links of ``--gbps``, the median over ``--repeats`` calls
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
import json
import math
import os
import statistics
import time

import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.fabric.sim.sim_network import TCP_OVER_ETHERNET
from sparsecomm.errors import InvalidValueError
from sparsecomm.fabric.probe import fabric_latency_s, link_parameters
from sparsecomm.netbed.calibrate import busy_endpoints

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
    rank's end (as ``<name>_best``, the least: load from other processes can only slow a call down, never
    speed it past the link; as ``<name>_skew``, the median spread of the ranks' starts); ``latency_s``: the
    fabric's one-way latency of a small message (:func:`~sparsecomm.netbed.probe.fabric_latency_s`)."""
    numel = int(size_mb * 1e6) // 4
    per_rank = sc.launch(functools.partial(_measure, numel=numel, repeats=repeats), workers, backend="netbed",
                         network=sc.Network(bandwidth_gbps=gbps), timeout_s=600)
    out = {"latency_s": per_rank[0][0]}
    for k in per_rank[0][1]:
        calls = [[r[1][k][i] for r in per_rank] for i in range(repeats)]
        spans = [max(e for _, e in c) - max(s for s, _ in c) for c in calls]
        out[k], out[k + "_best"] = statistics.median(spans), min(spans)
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
    """On the SimFabric, every rank: per (case, density) of ``cases`` (:class:`.transports.Case`), the
    ``(start, end)`` modelled clock of a call that follows a barrier, as ``measured`` times the netbed's: the same
    inputs (:func:`.transports.block_sparse`) and the same order, a case's densities taking turns call by call, a
    round of untimed calls, then the timed one (a call's work may depend on the call before it on the same
    transport: OmniReduce's cached result clears the blocks the previous call wrote and this one does not)."""
    from .transports import block_sparse

    f = ctx.fabric
    out = []
    for case in cases:
        t = model_transport(f, case.transport, **case.kwargs)
        inputs = [block_sparse(numel, d, case.block, seed=1000 * ctx.rank + int(d * 1e4)) for d in case.densities]
        for timed in (False, True):
            for x0 in inputs:
                x = x0.clone()
                f.barrier()
                t0 = f.now()
                t.allreduce(x)
                if timed:
                    out.append((t0, f.now()))
    return out


def model_transport(fabric, name: str, **kwargs):
    """The transport ``name`` with ``kwargs`` on the modelled ``fabric``: ``native`` (``torch.distributed``'s,
    which the SimFabric does not run) as its model, gloo's ring all-reduce
    (:class:`~sparsecomm.transports.native.model.GlooRing`: gloo's segments, its messages charged the host's native
    message rates, ``native``'s per-call cost); any other as it is."""
    if name == "native":
        from sparsecomm.transports.native.model import GlooRing

        return GlooRing(fabric, **kwargs)
    return sc.transports.get(name, fabric, **kwargs)


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


def profile_network(profile: str, case, workers: int, cores: float, pinned: bool = False, **wire) -> "sc.Network":
    """The network of ``case`` (:class:`.transports.Case`) modelled with the host ``profile``: ``wire``'s
    :class:`~sparsecomm.Network` fields, the profile's host model with the CPU share of the case's processes
    (:func:`sparsecomm.netbed.calibrate.busy_endpoints`; ``pinned``: the ranks measured on pinned cores, the
    services that compute only while the workers wait left out) on ``cores`` cores
    (:meth:`~sparsecomm.fabric.sim.sim_host.HostModel.sharing`; ``native`` is modelled by :func:`model_transport`)."""
    net = sc.Network.from_profile(profile, **wire)
    net.host = net.host.sharing(busy_endpoints(case.transport, workers, len(case.services), pinned), cores)
    return net


def netbed_burst_us(gbps: float) -> float:
    """The bucket of the netbed's shapers at ``gbps`` in microseconds of link time (``tc htb``'s ``burst``,
    :func:`sparsecomm.netbed.topology.htb_burst`), as a model of the netbed takes it (``Network(burst_us=...)``: a
    link idle that long passes that many bytes at once; a wave of a request-response protocol, the sparse switch's,
    pays its message's link time less the bucket)."""
    from sparsecomm.netbed.topology import htb_burst

    return htb_burst(gbps) * 8 / (gbps * 1e9) * 1e6


def netbed_latency_us(profile: str) -> float:
    """The wire latency (microseconds) of the netbed modelled with the host ``profile``: the netbed's
    per-message latency the profile records (:func:`~sparsecomm.fabric.sim.sim_profile.netbed_latency_s`, measured
    by ``python -m sparsecomm.netbed calibrate``: a small message's one-way time between two netbed hosts beyond
    the hosts' own per-message costs), else :data:`NETBED_LATENCY_US` (a profile calibrated without a netbed)."""
    from sparsecomm.fabric.sim.sim_profile import netbed_latency_s

    latency = netbed_latency_s(profile)
    return NETBED_LATENCY_US if latency is None else latency * 1e6


#: the transports the model is validated on, every one at its defaults (``--transports all``)
VALIDATED = ("native", "ring", "allgather", "omnireduce", "switch", "sparse-switch")


def validated_cases() -> list:
    """The headline cases (:data:`.transports.CASES`, the library's defaults) of every transport of
    :data:`VALIDATED`, with their densities (``omnireduce`` and ``sparse-switch`` at 1, 0.1 and 0.01); raises
    if one has none (the benchmark's table lost a transport the validation needs)."""
    from . import transports as tb

    cases = [c for c in tb.CASES if c.transport in VALIDATED and not c.tuned]
    missing = sorted(set(VALIDATED) - {c.transport for c in cases})
    if missing:
        raise InvalidValueError(f"netbed_vs_sim: no headline case of {missing} in experiments.bench.transports.CASES")
    return cases


def compare_transports(workers: int, size_mb: float, gbps: float, names: list[str], repeats: int,
                       profile: str | None, link: bool = True, pin_cores: bool = False) -> list[dict]:
    """Every transport of ``names`` (``"all"``: :func:`validated_cases`) at its defaults
    (:data:`.transports.CASES`' headline rows, their densities) measured on a netbed (:func:`.transports.run`)
    and modelled on the SimFabric: the link model alone (the small-message latency measured over the same netbed,
    TCP framing), and, with ``profile`` (a host profile, ``python -m sparsecomm.netbed calibrate``), the link plus
    that host model, its CPU share the processes per core of the netbed (workers and services,
    :func:`~sparsecomm.netbed.calibrate.busy_endpoints`, on this machine's cores) and its wire latency the
    netbed's per-message latency the profile records (:func:`netbed_latency_us`;
    ``native`` modelled as gloo's ring, :func:`model_transport`; the hosts stream a message's bytes beside the
    netbed's link, ``Network.host_streams``);
    ``link=False``: the host model only (the link model of a large switch call, one datagram per 64-value
    packet, takes many minutes); ``pin_cores``: the netbed's ranks each on a core of its own turn
    (:func:`sparsecomm.launch`'s option: the same sharing of the cores on every call, as the model's)."""
    from . import transports as tb

    cases = validated_cases() if "all" in names else [c for c in tb.CASES if c.transport in names and not c.tuned]
    real = tb.run(workers, size_mb, cases, repeats, 1, 600.0, netbed_gbps=gbps, pin_cores=pin_cores)
    sims = {}
    if link:
        latency = measured(workers, 0.001, gbps, repeats=1)["latency_s"]
        net = sc.Network(bandwidth_gbps=gbps, latency_us=latency * 1e6, payload_fraction=TCP_OVER_ETHERNET,
                         burst_us=netbed_burst_us(gbps))
        sims["link"] = modelled_cases(workers, size_mb, cases, net)
    if profile:
        host_times = []
        latency_us = netbed_latency_us(profile)
        for c in cases:
            net = profile_network(profile, c, workers, os.cpu_count() or 1, pin_cores, bandwidth_gbps=gbps,
                                  latency_us=latency_us, payload_fraction=TCP_OVER_ETHERNET, host_streams=True,
                                  burst_us=netbed_burst_us(gbps))
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


#: the loopback's wire as the model has it: none of its own (as :mod:`sparsecomm.netbed.calibrate` models its
#: loopback calls): no latency and a rate far beyond the hosts', every loopback cost is the host model's
LOOPBACK_WIRE = {"bandwidth_gbps": 1e4, "latency_us": 0.0}

#: :func:`agreement`'s default tie tolerance: two transports whose paired ratio is within 3% are a tie
TIE = 0.03


def loopback_cases(names: list[str] | None = None) -> list:
    """The headline cases (the library's defaults, :data:`.transports.CASES`) of the transports ``names``
    that are registered; ``None``: the loopback benchmark's default selection."""
    from . import transports as tb

    registered = set(sc.transports.available())
    return [c for c in tb.CASES if not c.tuned and c.transport in registered
            and (c.default if names is None else c.transport in names)]


def _probe(ctx) -> tuple[float, float, float]:
    return tuple(link_parameters(ctx.fabric))


def modelled_link(workers: int, network: "sc.Network") -> tuple[float, float, float]:
    """The :class:`~sparsecomm.fabric.probe.Link` that :func:`~sparsecomm.fabric.probe.link_parameters`
    measures on the SimFabric with ``network`` (what the model says the loopback's probe should find)."""
    return sc.launch(_probe, workers, network=network)[0]


def compare_loopback(workers: int, size_mb: float, profile: str, names: list[str] | None = None, *,
                     repeats: int = 5, warmup: int = 1, cores: float | None = None,
                     timeout_s: float = 600.0, pin_cores: bool = False) -> dict:
    """The loopback benchmark's cases measured (:func:`.transports.run` on local gloo processes, the
    reference :data:`.transports.REFERENCE` in every launch, the fabric probed in the same launch) and
    modelled on the SimFabric (:func:`modelled_cases`) with the host ``profile`` on :data:`LOOPBACK_WIRE`,
    every case's processes sharing ``cores`` cores (default: this machine's; :func:`profile_network`).

    Returns ``rows`` (per transport and density: ``measured_s``, the median of the slowest rank's time of
    a call; ``times_s`` and ``ref_times_s``, its calls and its launch's reference's, repetition by
    repetition; ``modelled_s``), ``link`` (the probe of every launch: ``(latency_s, bandwidth_Bps,
    per_message_s)``) and ``modelled_link`` (the same probe on the model)."""
    from . import transports as tb

    cores = cores or os.cpu_count() or 1
    cases = loopback_cases(names)
    real = tb.run(workers, size_mb, [tb.REFERENCE] + cases, repeats, warmup, timeout_s, probe=True,
                  pin_cores=pin_cores)
    modelled = {}
    for c in cases:
        net = profile_network(profile, c, workers, cores, pin_cores, **LOOPBACK_WIRE)
        modelled.update(zip(((c.label, d) for d in c.densities), modelled_cases(workers, size_mb, [c], net)))
    link = {tuple(r["services"]): (r["link_latency_s"], r["link_bandwidth_Bps"], r["link_per_message_s"])
            for r in real}
    rows = [dict(workers=workers, size_mb=size_mb, case=r["case"], density=r["density"], services=r["services"],
                 measured_s=r["median_s"], times_s=r["times_s"], ref_times_s=r["ref_times_s"],
                 modelled_s=modelled[(r["case"], r["density"])])
            for r in real if (r["case"], r["density"]) in modelled]
    probe_net = profile_network(profile, tb.Case("ring"), workers, cores, **LOOPBACK_WIRE)
    return {"rows": rows, "link": link, "modelled_link": modelled_link(workers, probe_net)}


def _relative(r: dict) -> list[float]:
    """Row ``r``'s calls over its launch's reference's, repetition by repetition (its own calls without one)."""
    return [t / q for t, q in zip(r["times_s"], r.get("ref_times_s") or [1.0] * len(r["times_s"]))]


def paired_ratio(a: dict, b: dict) -> tuple[float, float]:
    """Row ``a``'s time over row ``b``'s, each relative to its launch's reference (the rows of
    :func:`compare_loopback`), as ``(ratio, noise)``: ``ratio``, the median over repetitions of ``t_a / ref_a``
    over that of ``t_b / ref_b`` (the key that ranks the rows, so that the fastest's ratio to any other is at
    most 1); ``noise``, twice the standard error of the median of the per-repetition log ratios
    ``ln((t_a / ref_a) / (t_b / ref_b))`` (1.2533 * 1.4826 * MAD / sqrt(n), normal errors)."""
    ra, rb = _relative(a), _relative(b)
    if not ra or len(ra) != len(rb):
        raise InvalidValueError(f"paired_ratio: the rows need the same number of repetitions, at least one "
                                f"(times_s of {a.get('case')!r}: {len(ra)}, of {b.get('case')!r}: {len(rb)})")
    logs = [math.log(x / y) for x, y in zip(ra, rb)]
    med = statistics.median(logs)
    mad = statistics.median(abs(v - med) for v in logs)
    return statistics.median(ra) / statistics.median(rb), 2 * 1.2533 * 1.4826 * mad / math.sqrt(len(logs))


def agreement(rows: list[dict], tie: float = TIE) -> dict:
    """Which transport is fastest per case (``workers``, ``size_mb``, ``density``) of ``rows`` (each with
    ``case``, ``modelled_s``, ``times_s``, ``ref_times_s``), measured and modelled, and whether they agree.
    Measured, the fastest has the least median over repetitions of its time over its launch's reference's
    (the benchmark's "vs all_reduce (paired)": on a machine whose load drifts, the median of the raw times
    can rank two transports against the ratio of their calls side by side); modelled, the least ``modelled_s``.

    A case with one transport has nothing to choose (verdict ``single``, not counted). Otherwise the verdict
    is ``agree`` when the model picks the measured fastest; ``tie`` when it picks another whose measured
    time is within the run's noise of the fastest's: ``|ln r| <= max(ln(1 + tie), noise)`` for their paired
    ratio ``r`` and its noise (:func:`paired_ratio`); else ``disagree``. Every counted case also has
    ``margin``, the measured runner-up's paired ratio to the fastest, and ``close`` (that margin within the
    same tolerance: an agreement there is a coin toss too).

    Returns ``cases`` (one dict per case) and ``counted``, ``strict`` (the share of ``agree``) and
    ``tie_aware`` (the share of ``agree`` or ``tie``), ``None`` when nothing is counted."""
    if tie < 0:
        raise InvalidValueError(f"agreement: tie must be >= 0 (a relative tolerance, e.g. {TIE}), got {tie}")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workers"], r["size_mb"], r["density"]), []).append(r)
    out = []
    for (n, mb, d), rs in groups.items():
        by_measured = sorted(rs, key=lambda r: statistics.median(_relative(r)))
        fastest, pick = by_measured[0], min(rs, key=lambda r: r["modelled_s"])
        case = dict(workers=n, size_mb=mb, density=d, measured=fastest["case"], modelled=pick["case"])
        if len(rs) == 1:
            out.append({**case, "verdict": "single"})
            continue
        ratio, noise = paired_ratio(pick, fastest)
        margin, margin_noise = paired_ratio(by_measured[1], fastest)
        tol = math.log1p(tie)
        verdict = ("agree" if pick is fastest else "tie" if abs(math.log(ratio)) <= max(tol, noise)
                   else "disagree")
        out.append({**case, "verdict": verdict, "pick_ratio": ratio, "runner_up": by_measured[1]["case"],
                    "margin": margin, "close": abs(math.log(margin)) <= max(tol, margin_noise)})
    counted = [c for c in out if c["verdict"] != "single"]
    share = (lambda ok: sum(c["verdict"] in ok for c in counted) / len(counted)) if counted else (lambda ok: None)
    return {"cases": out, "counted": len(counted), "strict": share(("agree",)),
            "tie_aware": share(("agree", "tie"))}


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
                         "against the ring's model: e.g. native ring omnireduce switch; 'all': every transport "
                         "the model is validated on (" + " ".join(VALIDATED) + ")")
    ap.add_argument("--profile", default=None,
                    help="a host profile (python -m sparsecomm.netbed calibrate) to model with as well")
    ap.add_argument("--no-link-model", action="store_true",
                    help="with --transports and --profile: model with the host profile only")
    ap.add_argument("--loopback", action="store_true",
                    help="the loopback benchmark (local gloo processes, no netbed) against the model with "
                         "--profile: which transport is fastest per case, measured and modelled")
    ap.add_argument("--tie", type=float, default=TIE,
                    help="--loopback: the relative difference within which two measured transports tie")
    ap.add_argument("--cores", type=float, default=None,
                    help="--loopback: the cores the processes share in the model (default: this machine's)")
    ap.add_argument("--json", default=None, help="--loopback: also write the rows and verdicts to this file")
    ap.add_argument("--pin-cores", action="store_true",
                    help="with --transports or --loopback: every measured rank on a core of its own turn "
                         "(sparsecomm.launch(pin_cores=True)), the same sharing of the cores on every call; the model "
                         "leaves out of the share a service that computes only while the workers wait (the sparse "
                         "switch's). Model with a profile calibrated so too (calibrate --pin-cores)")
    a = ap.parse_args(argv)
    if a.no_link_model and not (a.transports and a.profile):
        ap.error("--no-link-model needs --transports and --profile")
    if a.profile:       # (read and checked before minutes of measurement, not after them)
        try:
            sc.Network.from_profile(a.profile)
        except sc.errors.SparseCommError as exc:
            ap.error(str(exc))
    if a.loopback:
        if not a.profile:
            ap.error("--loopback needs --profile (python -m sparsecomm.netbed calibrate --out host.json)")
        loopback_main(a)
        return
    if a.transports:
        print(f"# netbed links {a.gbps:g} Gbit/s; modelled: link only (measured small-message latency), "
              f"and with the host profile {a.profile or '(none)'}; ranks {'pinned' if a.pin_cores else 'unpinned'}")
        print("| workers | size MB | transport | density | netbed ms | link-limited ms | link model ms | ratio "
              "| link + host ms | ratio |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n in a.workers:
            for size in a.sizes_mb:
                for r in compare_transports(n, size, a.gbps, a.transports, a.repeats, a.profile,
                                            link=not a.no_link_model, pin_cores=a.pin_cores):
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


def loopback_main(a: argparse.Namespace) -> dict:
    """``--loopback``: the per-transport table, the verdict per case and the agreement rates."""
    cores = a.cores or os.cpu_count() or 1
    shares = sorted(sc.Network.from_profile(a.profile).host.by_share)
    fitted = (f"its rates fitted at a share of {', '.join(f'{s:g}' for s in shares)} where the processes per core "
              f"reach it" if shares else "its two-process rates stretched by the share (no rates by share)")
    print(f"# loopback (gloo on 127.0.0.1, no shaping), {a.repeats} calls per case; model: the host profile "
          f"{a.profile}, no wire of its own, the processes sharing {cores:g} cores ({fitted}); a tie: within "
          f"{a.tie:.0%} or the pair's noise; ranks {'pinned' if a.pin_cores else 'unpinned'}; load average {_load()}")
    rows, links = [], []
    print("| workers | size MB | transport | density | measured ms | vs all_reduce (paired) | modelled ms "
          "| modelled / measured |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for n in a.workers:
        for size in a.sizes_mb:
            c = compare_loopback(n, size, a.profile, a.transports, repeats=a.repeats, cores=cores,
                                 pin_cores=a.pin_cores)
            links.append((n, size, c["link"], c["modelled_link"]))
            for r in c["rows"]:
                print(f"| {n} | {size:g} | {r['case']} | {r['density']:g} | {r['measured_s'] * 1e3:.2f} "
                      f"| {statistics.median(_relative(r)):.2f}x | {r['modelled_s'] * 1e3:.2f} "
                      f"| {r['modelled_s'] / r['measured_s']:.2f} |", flush=True)
            rows += c["rows"]
    print("\n# the loopback probed in each launch (latency of a 256-byte message, rate of 1 MiB, a further "
          "message of a burst) against the same probe on the model")
    print("| workers | size MB | launch services | latency us | rate GB/s | per message us "
          "| model: latency us | rate GB/s | per message us |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, size, link, (ml, mb, mp) in links:
        for svc, (lat, bw, pm) in link.items():
            print(f"| {n} | {size:g} | {','.join(svc) or '-'} | {lat * 1e6:.0f} | {bw / 1e9:.2f} | {pm * 1e6:.0f} "
                  f"| {ml * 1e6:.0f} | {mb / 1e9:.2f} | {mp * 1e6:.0f} |")
    ag = agreement(rows, a.tie)
    print("\n| workers | size MB | density | measured fastest | runner-up (paired ratio) | modelled fastest "
          "(its paired ratio) | verdict |")
    print("|---:|---:|---:|---|---|---|---|")
    for v in ag["cases"]:
        if v["verdict"] == "single":
            print(f"| {v['workers']} | {v['size_mb']:g} | {v['density']:g} | {v['measured']} | - | - "
                  f"| single transport, not counted |")
            continue
        close = ", within noise" if v["close"] else ""
        print(f"| {v['workers']} | {v['size_mb']:g} | {v['density']:g} | {v['measured']} | {v['runner_up']} "
              f"({v['margin']:.2f}x{close}) | {v['modelled']} ({v['pick_ratio']:.2f}x) | {v['verdict']} |")
    if ag["counted"]:
        print(f"# agreement over {ag['counted']} cases: strict {ag['strict']:.0%}, tie-aware {ag['tie_aware']:.0%}")
    else:
        print("# no case with two transports or more: nothing to agree on")
    print("# load average at the end", _load())
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "agreement": ag, "links": [
                {"workers": n, "size_mb": size, "measured": {",".join(k): v for k, v in link.items()},
                 "modelled": ml} for n, size, link, ml in links]}, fh, indent=1)
    return ag


if __name__ == "__main__":
    main()
