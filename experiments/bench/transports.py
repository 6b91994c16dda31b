"""Transport benchmark: one allreduce of a float32 tensor on local gloo processes, side by side.

    python -m experiments.bench.transports                         # 100 MB, 2 and 4 workers
    python -m experiments.bench.transports --sizes-mb 10 100 --workers 2 4 --repeats 7 \\
        --transports native ring omnireduce
    python -m experiments.bench.transports --netbed 1 --repeats 3      # on a netbed at 1 Gbit/s (root)

``--netbed GBPS`` runs every launch on a :mod:`netbed <sparsecomm.netbed>` (each rank in its own network
namespace behind a forwarding top-of-rack namespace, links shaped to GBPS; the switch on the top of rack,
dedicated aggregators on hosts of their own) and adds two columns: the *link-limited time*, the bytes on
the busiest link direction (from the transports' ledgers: every byte of every message, protocol headers
included; TCP/IP framing excluded) divided by the link rate, and the *efficiency*, link-limited time over
measured time (TCP over a 1500-byte MTU tops out at 1448/1514 = 0.956). A worker's link carries what it
sends (up) and receives (down); a dedicated aggregator's link what the workers' ledgers sent to and
received from it; the top of rack has no link of its own. ``native``'s ledger is the ring volume
(torch.distributed reports no traffic).

**Headline rows use the library's defaults** (defaults are fast where they run: docs/transports.md, "Transports
and their defaults"): each is
constructed with no keyword arguments, its services started with no program arguments, as a user who
writes ``transport="switch"`` and ``services=["switch"]`` gets it (on gloo the defaults are the real
fabric's: :mod:`sparsecomm.transports.defaults`). Rows with settings are labelled ``(tuned: ...)`` with
them, e.g. in place (``inplace=True``: ``dist.all_reduce``'s own semantics, and no result to allocate
per call, nor its page faults). The reference of every ratio is
``native (tuned: inplace=True)``, i.e. ``torch.distributed.all_reduce`` itself.

For every (workers, size) every selected case runs in the same launch (same processes, same inputs),
after ``--warmup`` untimed calls, interleaved (one call of each case per repetition); each timed call
starts after a barrier and its time is the slowest rank's. The table reports the median (and min) over
``--repeats`` calls, the algorithmic bandwidth (size / time), the ratio to the reference of the same
run, as a ratio of medians and *paired* (the median over repetitions of this case's time over the
reference's in the same repetition, robust to a drifting machine load), and the largest relative
difference of the result from the first case's with the same input (a sanity check: float sums in
another order). Every call's input is restored from a pristine copy before it, untimed (in-place cases
overwrite it). With block-sparse cases the table also has ``scan only`` rows: the time of the codec's
scan for non-zero blocks of the same input (:func:`sparsecomm.codec.nonzero_blocks`), which any
block-sparse all-reduce of a dense tensor pays, so ``native / scan`` bounds the speed-up such a
protocol can show on the machine.

Adding a transport: append a :class:`Case` to ``CASES`` (name, constructor kwargs -- none for its
headline row --, block densities to feed it, services its launch needs). Cases with the same services
share one launch; a launch with services also times the reference again. ``--transports`` selects
cases by transport name (the reference with ``native``); cases whose transport is not registered are
skipped. Inputs of density ``d < 1`` keep a fraction ``d`` of the ``block``-element blocks non-zero, at
positions drawn with a seed per rank (independent positions).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace

import torch

import sparsecomm as sc
from sparsecomm.fabric.probe import link_parameters


@dataclass(frozen=True)
class Case:
    """One row group of the table: a transport, its constructor keywords and the services its launch
    starts. A *headline* row has no keywords and services with no program arguments: the library's
    defaults, what ``transport="name"`` gives a user. A row with keywords is *tuned*, labelled so, with
    its settings in its label."""

    transport: str
    kwargs: dict = field(default_factory=dict)
    densities: tuple[float, ...] = (1.0,)
    services: tuple[str, ...] = ()
    block: int = 256
    default: bool = True       # part of the default selection (when registered)

    @property
    def tuned(self) -> bool:
        return bool(self.kwargs)

    @property
    def label(self) -> str:
        if not self.tuned:
            return self.transport
        extra = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.transport} (tuned: {extra})"


#: the reference of every ratio: ``torch.distributed.all_reduce`` itself (in place, no result to allocate)
REFERENCE = Case("native", {"inplace": True})

CASES: list[Case] = [
    REFERENCE,
    # headline rows: the library's defaults (no keywords; services with no program arguments)
    Case("native"),
    Case("ring"),
    Case("allgather", default=False),     # n-1 times the ring's traffic on dense data
    Case("omnireduce", densities=(1.0, 0.1, 0.01)),
    Case("switch", services=("switch",)),
    Case("sparse-switch", densities=(1.0, 0.1, 0.01), services=("sparse-switch",), default=False),
    # tuned rows. In place: dist.all_reduce's own semantics, and no result to allocate per call (nor its
    # page faults)
    Case("ring", {"inplace": True}),
    # one block per lane for 100 MB on 2-4 workers: every call is a single round (no round trip beyond the first)
    Case("omnireduce", {"lanes": 65536, "inplace": True}, densities=(1.0, 0.1, 0.01)),
    # one stream per aggregator: fewer messages (sparse data), no overlap of a channel's up- and downstream
    Case("omnireduce", {"lanes": 65536, "channels": 1, "inplace": True}, densities=(1.0, 0.1, 0.01)),
    # dedicated aggregators on ranks (netbed: hosts) of their own, as in the paper's testbed
    Case("omnireduce", {"lanes": 65536, "deployment": "dedicated", "num_aggregators": 2, "inplace": True},
         densities=(1.0, 0.1, 0.01), services=("omnireduce-agg:0", "omnireduce-agg:1"), default=False),
    Case("switch", {"inplace": True}, services=("switch",)),
]


def block_sparse(numel: int, density: float, block: int, seed: int) -> torch.Tensor:
    """A float32 tensor whose non-zero ``block``-blocks are a random fraction ``density`` of all blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if density >= 1.0:
        return x
    nblocks = -(-numel // block)
    keep = torch.zeros(nblocks, dtype=torch.bool)
    keep[torch.randperm(nblocks, generator=g)[: round(density * nblocks)]] = True
    mask = keep.repeat_interleave(block)[:numel]
    return x * mask


class ScanOnly:
    """Not a transport: the codec's scan for non-zero blocks, timed like one (see the module docstring)."""

    def __init__(self, block: int) -> None:
        self.block = block

    def allreduce(self, x: torch.Tensor) -> None:
        from sparsecomm import codec

        codec.nonzero_blocks(x, self.block)


SCAN = Case("scan only", densities=(1.0, 0.1, 0.01))


def bench_worker(ctx, cases: list[Case], numel: int, repeats: int, warmup: int, probe: bool = False) -> list[dict]:
    """Runs on every rank: time every (case, density); return this rank's per-call times.

    ``probe``: first measure the fabric's :class:`~sparsecomm.fabric.probe.Link` (one-way latency of a small
    message, rate of a large one, cost of a further message of a burst; the medians of 30 shifts each) in the
    same processes, after the transports are built, and give it to every row as ``link``.

    The cases are interleaved (one call of each per repetition), so that a change in the machine's load
    affects them alike; inputs are shared by the cases with the same density, and restored from a
    pristine copy (untimed) before every call, since in-place cases overwrite them.
    """
    f = ctx.fabric
    pristine: dict[float, torch.Tensor] = {}
    runs = []
    for case in cases:
        t = ScanOnly(case.block) if case == SCAN else sc.transports.get(case.transport, f, **case.kwargs)
        for d in case.densities:
            if d not in pristine:
                pristine[d] = block_sparse(numel, d, case.block, seed=1000 * ctx.rank + int(d * 1e4))
            runs.append((case, d, t, []))
    work = {d: x.clone() for d, x in pristine.items()}
    link = list(link_parameters(f, rounds=30)) if probe else None

    def call(d: float, t, timed: list | None = None):
        x = work[d]
        x.copy_(pristine[d])
        f.barrier()
        t0 = time.perf_counter()
        y = t.allreduce(x)
        if timed is not None:
            timed.append(time.perf_counter() - t0)
        return y

    for _ in range(warmup):
        for case, d, t, _times in runs:
            call(d, t)
    for _ in range(repeats):
        for case, d, t, times in runs:
            call(d, t, times)
    out = []
    reference = {}
    for case, d, t, times in runs:
        err, sent = 0.0, 0
        if case != SCAN:
            y = call(d, t).clone()            # one more call, to compare the results between cases
            ref = reference.setdefault(d, y)
            err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if y is not ref else 0.0
            sent = t.last_stats.bytes_sent
            received = t.last_stats.bytes_received
            links = [[int(a), int(b), int(v)] for (a, b), v in t.last_stats.links.items()]
        else:
            received, links = 0, []
        out.append(dict(case=case.label, transport=case.transport, density=d, times=times,
                        rel_err_vs_first=err, bytes_sent=sent, bytes_received=received, links=links, link=link))
    return out


def busiest_link_bytes(items: list[dict], workers: int, services: tuple[str, ...]) -> int:
    """Bytes on the busiest link direction of the rack, from every worker's ledger of one call (``items``:
    rank-ordered rows of ``bench_worker``). Services on the top of rack (a switch) have no link."""
    from sparsecomm.netbed.launch import is_in_network

    per_dir = []
    for w, it in enumerate(items):
        per_dir += [it["bytes_sent"], it["bytes_received"]]
    for k, spec in enumerate(services):
        if is_in_network(spec):
            continue
        rank = workers + k
        up = sum(v for it in items for a, b, v in it["links"] if a == rank)
        down = sum(v for it in items for a, b, v in it["links"] if b == rank)
        per_dir += [up, down]
    return max(per_dir) if per_dir else 0


def run(workers: int, size_mb: float, cases: list[Case], repeats: int, warmup: int, timeout_s: float,
        netbed_gbps: float | None = None, probe: bool = False, pin_cores: bool = False) -> list[dict]:
    """One launch per distinct ``services`` tuple (``pin_cores``: each rank on a core of its own turn,
    :func:`sparsecomm.launch`'s option); each launch also times :data:`REFERENCE` (if selected),
    first, so that every ratio compares calls interleaved in the same processes (a row's ``ref_times_s``:
    the reference's calls of its launch, repetition by repetition). ``probe``: every row also has its
    launch's measured :class:`~sparsecomm.fabric.probe.Link` as ``link_latency_s``, ``link_bandwidth_Bps``
    and ``link_per_message_s`` (:func:`bench_worker`)."""
    numel = int(size_mb * 1e6) // 4
    reference = REFERENCE if REFERENCE in cases else None
    groups: dict[tuple[str, ...], list[Case]] = {}
    for c in cases:
        groups.setdefault(c.services, []).append(c)
    rows = []
    for svc, group in groups.items():
        extra = reference is not None and reference not in group
        launch_cases = group if reference is None else [reference] + [c for c in group if c != reference]
        per_rank = sc.launch(functools.partial(bench_worker, cases=launch_cases, numel=numel, repeats=repeats,
                                               warmup=warmup, probe=probe), workers, services=svc, timeout_s=timeout_s,
                             pin_cores=pin_cores, **launch_options(netbed_gbps))
        group_rows = []
        for i, item in enumerate(per_rank[0]):
            slowest = [max(rank[i]["times"][j] for rank in per_rank) for j in range(repeats)]
            group_rows.append(dict(workers=workers, size_mb=size_mb, case=item["case"],
                                   transport=item["transport"], density=item["density"],
                                   services=list(svc), median_s=statistics.median(slowest), min_s=min(slowest),
                                   times_s=slowest, rel_err=item["rel_err_vs_first"],
                                   bytes_sent=item["bytes_sent"]))
            if item["link"] is not None:
                group_rows[-1].update(zip(("link_latency_s", "link_bandwidth_Bps", "link_per_message_s"),
                                          item["link"]))
            if netbed_gbps is not None and item["transport"] != SCAN.transport:
                busiest = busiest_link_bytes([rank[i] for rank in per_rank], workers, svc)
                limit = busiest * 8 / (netbed_gbps * 1e9)
                group_rows[-1].update(netbed_gbps=netbed_gbps, busiest_link_bytes=busiest, link_limit_s=limit,
                                      efficiency=limit / group_rows[-1]["median_s"])
        ref = group_rows[0] if reference is not None else None
        for r in group_rows:
            r["vs_native"] = r["median_s"] / ref["median_s"] if ref else None
            r["ref_times_s"] = ref["times_s"] if ref else None
            # paired: the same repetition's native call ran just before or after (interleaved), so the
            # ratio of the two cancels most of a drifting machine load
            r["vs_native_paired"] = (statistics.median(a / b for a, b in zip(r["times_s"], ref["times_s"]))
                                     if ref else None)
        rows += group_rows[1:] if extra else group_rows
    return rows


def launch_options(netbed_gbps: float | None) -> dict:
    """``sc.launch`` options: local gloo processes, or a netbed at ``netbed_gbps``."""
    if netbed_gbps is None:
        return {"backend": "gloo"}
    return {"backend": "netbed", "network": sc.Network(bandwidth_gbps=netbed_gbps)}


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        model = platform.processor() or platform.machine()
    import os

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[100.0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--transports", nargs="+", default=None,
                    help="transport names (default: every registered case marked default)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                    help="run on a netbed with links of GBPS Gbit/s (needs root); adds link-limited time")
    ap.add_argument("--densities", type=float, nargs="+", default=None,
                    help="override the densities of the block-sparse cases")
    ap.add_argument("--headline", action="store_true",
                    help="only the headline rows (the library's defaults) and the reference, no tuned rows")
    args = ap.parse_args(argv)

    registered = set(sc.transports.available())
    if args.transports:
        unknown = set(args.transports) - {c.transport for c in CASES}
        if unknown:
            raise SystemExit(f"no benchmark case for {sorted(unknown)}; cases: {[c.transport for c in CASES]}")
        cases = [c for c in CASES if c.transport in args.transports]
    else:
        cases = [c for c in CASES if c.default]
    if args.headline:
        cases = [c for c in cases if not c.tuned or c == REFERENCE]
    skipped = [c.transport for c in cases if c.transport not in registered]
    cases = [c for c in cases if c.transport in registered]
    if args.densities:
        cases = [c if len(c.densities) == 1 else replace(c, densities=tuple(args.densities)) for c in cases]
    if any(d < 1.0 for c in cases for d in c.densities):
        cases.append(SCAN)
    print(f"# machine: {machine()}")
    if args.netbed is not None:
        print(f"# netbed: links of {args.netbed:g} Gbit/s (htb), every rank in its own namespace")
    if skipped:
        print(f"# not registered, skipped: {', '.join(skipped)}")
    rows = []
    nb = args.netbed is not None
    print("| workers | size MB | transport | density | median ms | min ms | GB/s (size/time) | vs all_reduce "
          "(medians) | vs all_reduce (paired) | rel. diff |" + (" link-limited ms | efficiency |" if nb else ""))
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if nb else ""))
    for n in args.workers:
        for size in args.sizes_mb:
            for r in run(n, size, cases, args.repeats, args.warmup, args.timeout_s, args.netbed):
                rows.append(r)
                ratio = f"{r['vs_native']:.2f}x" if r["vs_native"] is not None else "-"
                paired = f"{r['vs_native_paired']:.2f}x" if r["vs_native_paired"] is not None else "-"
                print(f"| {n} | {size:g} | {r['case']} | {r['density']:g} | {r['median_s'] * 1e3:.1f} | "
                      f"{r['min_s'] * 1e3:.1f} | {size / 1e3 / r['median_s']:.2f} | {ratio} | {paired} | "
                      f"{r['rel_err']:.1e} |" + (f" {r['link_limit_s'] * 1e3:.1f} | {r['efficiency']:.2f} |"
                                                   if nb and "link_limit_s" in r else (" - | - |" if nb else "")),
                      flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
