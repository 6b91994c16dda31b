"""Wall time per simulated message of each transport on the SimFabric, side by side with the ring.

    python -m experiments.bench.sim_scale                               # n = 64, 256, 1024; every transport
    python -m experiments.bench.sim_scale --workers 16 64 --transports ring omni-1% omni-dense

One all-reduce of ``--numel`` float32 (default 1M) at 100 Gbit/s, 2 us, per transport and number of
simulated workers ``n`` (``sc.launch(fn, world_size=n, backend="sim")``), each launch timed from start to
return; a launch at n = 2 first loads what every transport imports (not timed). A simulated message is
one ``send`` of any endpoint (workers and services: aggregators, the switch), counted from each
endpoint's :class:`~sparsecomm.fabric.stats.CommStats`; the table gives the wall time, the messages,
wall time per message and its ratio to the ring's at the same ``n``, the modelled time, and the process's
peak resident memory after the point (``ru_maxrss``: a peak, so the points run in increasing ``n``) with its
growth over the peak before the first point, per simulated worker.

Transports: ``ring``; ``omni-1%`` and ``omni-dense`` (OmniReduce, 256-element blocks, colocated, the
library's defaults; 1% of the blocks non-zero, the same on every worker, or all of them); ``switch``
(SwitchML's defaults on the SimFabric: 64-value packets, a pool of 256; past 32 workers a bitmap of one
32-bit word per 32 workers, at most :data:`~sparsecomm.transports.switchml.dataplane.WIDEST`) and
``sparse-switch-1%`` (a bitmap as wide as the job, at most
:data:`~sparsecomm.transports.switchml.sparse.dataplane.MAX_WORKERS`). A point beyond a
transport's worker limit is printed as ``n/a``; a point whose wall time, projected from the
transport's previous point as ``wall * (n / n_prev)^g``, exceeds ``--max-wall`` seconds (default 600) is
skipped: ``g = 3`` for the ring and OmniReduce (messages grow as n^2, and an endpoint's scheduler works per
message over its n peers), ``g = 2`` for the switches (a worker's packets do not grow with n: messages grow
as n, and the switch's work per message over its n workers at most as n).
``--no-ring`` leaves the ring out (it runs first at every ``n`` otherwise, for the ratio column);
``--shared-input`` gives every worker the same input tensor rather than a copy each.
"""

from __future__ import annotations

import argparse
import functools
import resource
import time

import torch

import sparsecomm as sc
from sparsecomm.transports.switchml.dataplane import WIDEST as SWITCH_MAX
from sparsecomm.transports.switchml.sparse.dataplane import MAX_WORKERS as SPARSE_MAX

from .transports import block_sparse

#: name -> (transport, options, block density, most workers, g: wall time projected to grow as n^g)
TRANSPORTS = {
    "ring": ("ring", {}, 1.0, None, 3),
    "omni-1%": ("omnireduce", {"block_size": 256}, 0.01, None, 3),
    "omni-dense": ("omnireduce", {"block_size": 256}, 1.0, None, 3),
    "switch": ("switch", {}, 1.0, SWITCH_MAX, 2),
    "sparse-switch-1%": ("sparse-switch", {}, 0.01, SPARSE_MAX, 2),
}


def _rank(ctx, name: str, kw: dict, x: torch.Tensor, shared: bool = False):
    t = sc.transports.get(name, ctx.fabric, **kw)
    t.allreduce(x if shared else x.clone())
    return t.last_stats.modelled_time_s, ctx.fabric.world if ctx.rank == 0 else None


def measure(label: str, n: int, numel: int, gbps: float = 100.0, shared: bool = False) -> tuple[float, int, float]:
    """``(wall seconds, simulated messages, modelled seconds)`` of one all-reduce of transport ``label``
    on ``n`` simulated workers; ``shared``: every worker passes the same input tensor (no copy per worker;
    only for a transport that does not write its input)."""
    name, kw, density, _, _ = TRANSPORTS[label]
    x = block_sparse(numel, density, 256, seed=1)    # the same blocks on every worker
    net = sc.Network(bandwidth_gbps=gbps, latency_us=2.0, timeout_s=3600.0)
    t0 = time.perf_counter()
    res = sc.launch(functools.partial(_rank, name=name, kw=kw, x=x, shared=shared), n, backend="sim", network=net)
    wall = time.perf_counter() - t0
    msgs = sum(ep.stats.messages for ep in res[0][1].endpoints)
    return wall, msgs, max(r[0] for r in res)


def _peak_mib() -> float:
    """The process's peak resident memory so far, MiB (Linux: ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--max-wall", type=float, default=600.0)
    ap.add_argument("--no-ring", action="store_true",
                    help="leave the ring out unless named in --transports (no ratio column): a switch alone at n = 1024, "
                         "where the ring's point takes ~10 GB and minutes")
    ap.add_argument("--shared-input", action="store_true",
                    help="every worker passes the same input tensor instead of its own copy (4 MiB a worker at 1M "
                         "elements: 4 GiB at n = 1024); for transports that do not write their input (not "
                         "inplace ones)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    labels = ([] if a.no_ring and "ring" not in a.transports else ["ring"]) + [t for t in a.transports if t != "ring"]
    for label in labels:     # warm-up: imports and compiled kernels, not timed
        measure(label, 2, 4096)
    print(f"{a.numel} float32, 100 Gbit/s, 2 us; wall = one launch")
    base = _peak_mib()
    print(f"peak memory before the first point: {base:.0f} MiB")
    print(f"{'transport':>17} {'n':>4} | {'wall s':>8} {'messages':>9} {'us/msg':>8} {'/ring':>6} | {'modelled us':>11}"
          f" | {'peak MiB':>8} {'KiB/worker':>10}")
    last: dict = {}     # transport -> (n, wall) of its previous point
    for n in sorted(a.workers):
        ring_per = None
        for label in labels:
            limit, grows = TRANSPORTS[label][3:]
            if limit is not None and n > limit:
                print(f"{label:>17} {n:>4} | {'n/a':>8}   (at most {limit} workers)", flush=True)
                continue
            if label in last and last[label][1] * (n / last[label][0]) ** grows > a.max_wall:
                est = last[label][1] * (n / last[label][0]) ** grows
                print(f"{label:>17} {n:>4} | {'skipped':>8}   (projected {est:.0f} s > --max-wall)", flush=True)
                continue
            wall, msgs, modelled = measure(label, n, a.numel, shared=a.shared_input)
            last[label] = (n, wall)
            per = wall / msgs
            ring_per = per if label == "ring" else ring_per
            ratio = f"{per / ring_per:6.2f}" if ring_per else "     -"
            peak = _peak_mib()
            print(f"{label:>17} {n:>4} | {wall:8.2f} {msgs:9d} {1e6 * per:8.1f} {ratio} | {1e6 * modelled:11.2f}"
                  f" | {peak:8.0f} {1024 * (peak - base) / n:10.1f}", flush=True)


if __name__ == "__main__":
    main()
