"""The same all-reduce modelled and measured, as one timeline: where the model and the real run part, per message.

    python -m experiments.bench.trace_compare                                  # ring, 2 workers, 4 MB
    python -m experiments.bench.trace_compare --transport omnireduce --size-mb 16 --gbps 10 --out /tmp/traces

Runs ``--calls`` calls of ``--transport`` on ``--size-mb`` of float32 per worker, after a barrier, twice: on
``--workers`` gloo processes of this machine (loopback) and on the SimFabric with a network of ``--gbps``
and ``--latency-us``, each run recorded (:mod:`sparsecomm.trace`). Writes ``OUT/measured.json``,
``OUT/modelled.json`` and ``OUT/side_by_side.json`` (both runs, each shifted so that its first call starts
at the same time; processes "measured rank r" and "modelled rank r"), and prints each call's duration per
rank in both. Open ``side_by_side.json`` at https://ui.perfetto.dev ("Open trace file") or in chrome://tracing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm import trace


def _calls(ctx, transport: str, numel: int, calls: int) -> float:
    t = sc.transports.get(transport, ctx.fabric)
    x = torch.ones(numel)
    ctx.fabric.barrier()
    for _ in range(calls):
        out = t.allreduce(x)
    return float(out[0])


def call_durations(path: str) -> dict[str, list[float]]:
    """Per process (its name), the durations of its calls in milliseconds, in order."""
    with open(path, encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[float]] = {}
    for e in sorted((e for e in events if e.get("cat") == "call"), key=lambda e: e["ts"]):
        out.setdefault(names.get(e["pid"], str(e["pid"])), []).append(e["dur"] / 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.trace_compare", description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="ring")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size-mb", type=float, default=4.0)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--gbps", type=float, default=10.0, help="the modelled links' rate")
    ap.add_argument("--latency-us", type=float, default=50.0, help="the modelled links' one-way latency")
    ap.add_argument("--out", default="traces")
    args = ap.parse_args(argv)
    numel = int(args.size_mb * 1e6 / 4)
    fn = functools.partial(_calls, transport=args.transport, numel=numel, calls=args.calls)
    measured, modelled = os.path.join(args.out, "measured.json"), os.path.join(args.out, "modelled.json")
    sc.launch(fn, world_size=args.workers, backend="gloo", trace=measured, timeout_s=120)
    sc.launch(fn, world_size=args.workers, backend="sim", trace=modelled,
              network=sc.Network(bandwidth_gbps=args.gbps, latency_us=args.latency_us))
    both = os.path.join(args.out, "side_by_side.json")
    trace.merge([modelled, measured], both)
    for path in (modelled, measured):
        for name, ms in call_durations(path).items():
            print(f"{name:20s} " + "  ".join(f"{v:9.3f} ms" for v in ms))
    print(f"side by side: {both} (open it at https://ui.perfetto.dev, 'Open trace file')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
