"""How repeatable the calibration is: ``calibrate --no-netbed`` run several times, max/min per host constant.

    python -m experiments.bench.calibration_spread --runs 3 --out-dir /tmp/spread      # the checkout it runs in
    python -m experiments.bench.calibration_spread --runs 3 --out-dir /tmp/spread \
        --trees /path/to/old/checkout /path/to/new/checkout        # two versions, their runs taking turns
    python -m experiments.bench.calibration_spread --profiles a.json b.json c.json    # profiles already written

Each run is ``python -m sparsecomm.netbed calibrate --no-netbed --out ...`` in a fresh process, with the tree's
``sparsecomm`` first on ``PYTHONPATH`` (never the netbed: it needs root and the namespaces, and its latency is not
a host constant). With several trees the runs take turns (tree 1, tree 2, tree 1, ...), so that a change of the
machine's load falls on each alike. Then per tree and per constant of the profiles' ``host`` (a table's entries
each: ``call_s.ring``, ``message_wait_s.4096``): the largest value over the smallest (``inf`` where some run
wrote 0 and another did not; 1 where every run wrote 0) and the runs' values, with each run's wall time and the
machine's load average. Calibrate on a quiet machine: the figures are of the machine as much as of the method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def constants(profile: dict) -> dict[str, float]:
    """A profile's host constants by name, a table's entries each as ``name.key``."""
    out: dict[str, float] = {}
    for name, entry in profile["host"].items():
        value = entry["value"]
        if isinstance(value, dict):
            out.update({f"{name}.{k}": float(v) for k, v in value.items()})
        else:
            out[name] = float(value)
    return out


def ratio(values: list[float]) -> float:
    """max/min of ``values`` (at least 0): 1 where all are 0, ``inf`` where some are 0 and some are not."""
    hi, lo = max(values), min(values)
    if hi == 0:
        return 1.0
    return math.inf if lo <= 0 else hi / lo


def spread(profiles: list[dict]) -> dict[str, tuple[float, list[float | None]]]:
    """Per constant of any of ``profiles``: ``(max/min over the profiles that have it, each profile's value or
    None)``."""
    rows = [constants(p) for p in profiles]
    names = sorted(set().union(*rows))
    out = {}
    for name in names:
        values = [r.get(name) for r in rows]
        out[name] = (ratio([v for v in values if v is not None]), values)
    return out


def table(profiles: list[dict]) -> str:
    lines = [f"{'constant':32s} {'max/min':>8s}  values"]
    for name, (r, values) in spread(profiles).items():
        shown = " ".join("-" if v is None else f"{v:.3g}" for v in values)
        lines.append(f"{name:32s} {r:8.2f}  {shown}")
    return "\n".join(lines)


def run_calibration(tree: Path, out: Path) -> float:
    """One ``calibrate --no-netbed`` of ``tree``'s sparsecomm into ``out``; its wall seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sparsecomm.netbed", "calibrate", "--no-netbed", "--out", str(out)],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.calibration_spread",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="calibrations per tree (default %(default)s)")
    p.add_argument("--trees", nargs="+", type=Path, default=[Path(".")],
                   help="checkouts whose sparsecomm is calibrated, taking turns (default: the current directory)")
    p.add_argument("--out-dir", type=Path, help="where the profiles are written (needed unless --profiles)")
    p.add_argument("--profiles", nargs="+", type=Path, help="compare these profiles; run nothing")
    args = p.parse_args(argv)
    if args.profiles:
        print(table([json.loads(f.read_text()) for f in args.profiles]))
        return 0
    if args.out_dir is None:
        p.error("--out-dir is needed to run calibrations")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[int, list[Path]] = {i: [] for i in range(len(args.trees))}
    for run in range(args.runs):
        for i, tree in enumerate(args.trees):
            out = args.out_dir / f"tree{i}.run{run}.json"
            took = run_calibration(tree.resolve(), out)
            written[i].append(out)
            print(f"tree {i} ({tree}) run {run}: {took:.0f} s, load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for i, tree in enumerate(args.trees):
        print(f"\n== tree {i}: {tree}")
        print(table([json.loads(f.read_text()) for f in written[i]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
