"""``transport="auto"`` per bucket against every single transport and the per-bucket oracle.

    python -m experiments.bench.auto                        # SimFabric, 8 workers, 10 and 100 Gbit/s, +- switch
    python -m experiments.bench.auto --netbed 1 --workers 4 # 4 gloo processes on a netbed at 1 Gbit/s (root)

The model (:class:`Model`): an ``EmbeddingBag(vocab, 64)`` whose gradient holds the rows that the step's
bags touch (each worker ``--tokens`` ids a step: about 1 % of the blocks of 256 in the union of 8
workers at the default vocabulary) and a dense MLP (64 -> 256 -> 256 -> 8), in buckets of at most 0.5 MB
(the embedding alone, the MLP in one). ``compressor="none"``: the buckets travel as dense tensors.

Every configuration is one launch of ``--steps`` training steps with ``transport="auto"``
(``estimate_steps=2``, ``period=--period``): ``auto`` chooses among every candidate; ``only T`` is auto
restricted to ``candidates=[T]`` (the whole model on ``T``, measured by the same code). A bucket's time
is the mean over the last decision's window (its ``estimate_steps`` steps) and the workers of its call's
time (modelled time on the SimFabric, wall time on real processes); a step's communication is the sum
over buckets (the calls run one after the other on the communication thread). The *oracle* takes, per
bucket, the fastest of the single-transport runs. Printed: every bucket's decision table under ``auto``
(densities, predicted time per candidate, chosen, measured, predicted for the measured transport), and
per configuration the step, its ratio to the oracle and to ``auto``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import time

import torch
from torch import nn

import sparsecomm as sc

DIM = 64


class Model(nn.Module):
    """An EmbeddingBag next to a dense MLP (see the module doc)."""

    def __init__(self, vocab: int = 4096) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))

    def forward(self, ids, offsets):
        return self.mlp(self.emb(ids, offsets))


def batch(rank: int, step: int, vocab: int = 4096, tokens: int = 2):
    """Worker ``rank``'s bag of step ``step``: ``tokens`` ids, one bag, one label."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    return ids, torch.tensor([0]), torch.randint(0, 8, (1,), generator=g)


def train(ctx, steps: int, kw: dict, vocab: int = 4096, tokens: int = 2) -> list[dict]:
    """``steps`` steps of SGD through ``transport="auto"`` with options ``kw``; returns the decision table
    with JSON-safe keys (the bucket's key as text)."""
    torch.set_num_threads(1)
    with ctx.seeded(0):
        model = Model(vocab)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="none",
                                  transport="auto", bucket_cap_mb=0.5, transport_kwargs=kw)
    for s in range(steps):
        ids, off, y = batch(ctx.rank, s, vocab, tokens)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids, off), y).backward()
        opt.step()
    return [{**row, "bucket": str(row["bucket"])} for row in opt.compression_stats().get("transport_decisions", [])]


def run(workers: int, singles: list[str], services: list[str], steps: int, period: int, launch_kw: dict,
        vocab: int, tokens: int, estimate: int = 2, decisions: int = 1) -> dict[str, dict[str, dict]]:
    """The decision table of every configuration, by bucket (``steps`` 0: enough for the exploration of
    the configuration's candidates and ``decisions`` decisions after the first)."""
    out = {}
    for name, extra in [("auto", {})] + [(f"only {t}", {"candidates": [t]}) for t in singles]:
        kw = {"estimate_steps": estimate, "period": period, "services": services, **extra}
        n = steps or 2 + estimate * (len(singles) if name == "auto" else 1) + decisions * period
        tables = sc.launch(functools.partial(train, steps=n, kw=kw, vocab=vocab, tokens=tokens), workers,
                           **launch_kw)
        if any(t != tables[0] for t in tables):
            raise AssertionError(f"{name}: the workers' decision tables differ")
        out[name] = {row["bucket"]: row for row in tables[0]}
    return out


def report(res: dict[str, dict[str, dict]], title: str) -> dict[str, float]:
    """Print the decision table and the step of every configuration; returns the figures."""
    auto = res["auto"]
    singles = [k for k in res if k != "auto"]
    print(f"\n### {title}\n")
    print("| bucket | elements | own density | union density | predicted ms (per candidate) | chosen | "
          "ran (last window) | measured ms | predicted ms | off |")
    print("|---|---:|---:|---:|---|---|---|---:|---:|---:|")
    for k, r in auto.items():
        pred = ", ".join(f"{t} {v * 1e3:.4g}" for t, v in sorted(r["predicted_s"].items(), key=lambda kv: kv[1]))
        ran = _ran(r)
        m, p = r["measured_s"][ran], r["measured_predicted_s"][ran]
        print(f"| {k} | {r['numel']} | {r['density']:.4f} | {r['union_density']:.4f} | {pred} | {r['chosen']} | "
              f"{ran} | {m * 1e3:.4g} | {p * 1e3:.4g} | {m / p - 1:+.0%} |")
    print("\nthe single transports, per bucket: measured ms (predicted ms, by the model refit in that run)\n")
    print("| bucket | " + " | ".join(s.removeprefix("only ") for s in singles) + " |")
    print("|---|" + "---:|" * len(singles))
    for k in auto:
        cells = []
        for s in singles:
            t, r = s.removeprefix("only "), res[s][k]
            cells.append(f"{r['measured_s'][t] * 1e3:.4g} ({r['measured_predicted_s'][t] * 1e3:.4g})")
        print(f"| {k} | " + " | ".join(cells) + " |")
    step = {name: sum(r["measured_s"][_ran(r)] for r in res[name].values()) for name in res}
    oracle = sum(min(res[s][k]["measured_s"][s.removeprefix("only ")] for s in singles) for k in auto)
    best = {k: min(singles, key=lambda s: res[s][k]["measured_s"][s.removeprefix("only ")]).removeprefix("only ")
            for k in auto}
    print(f"\noracle per bucket: {best}\n")
    print("| configuration | step ms | / oracle | / auto |")
    print("|---|---:|---:|---:|")
    for name, t in step.items():
        print(f"| {name} | {t * 1e3:.4g} | {t / oracle:.3f} | {t / step['auto']:.3f} |")
    return {"auto": step["auto"], "oracle": oracle, **{k: v for k, v in step.items() if k != "auto"}}


def _ran(row: dict) -> str:
    """The transport a bucket ran on in the last window (the one measured there)."""
    (ran,) = row["measured_s"]
    return ran


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
        return f"{os.cpu_count()}-core {name or platform.processor()}"
    except OSError:
        return f"{os.cpu_count()} cores"


def _dump(path: str, name: str, res: dict) -> None:
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"case": name, "tables": res}) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--gbps", default="10,100", help="SimFabric bandwidths, comma-separated")
    p.add_argument("--switch", default="no,yes", help="with a switch service: no, yes or both")
    p.add_argument("--steps", type=int, default=0, help="steps per launch (0: the exploration, then "
                   "--decisions decisions: 2 + estimate_steps * candidates + decisions * period)")
    p.add_argument("--estimate-steps", type=int, default=2)
    p.add_argument("--decisions", type=int, default=1, help="decisions after the first (see --steps)")
    p.add_argument("--json", default="", help="write every configuration's decision table there")
    p.add_argument("--period", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2)
    p.add_argument("--netbed", type=float, default=None, metavar="GBPS",
                   help="real gloo processes on a netbed with links of GBPS Gbit/s (root)")
    a = p.parse_args(argv)
    print(f"# {_cpu()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()}")
    figures = []
    if a.netbed is not None:
        launch_kw = {"backend": "netbed", "network": sc.Network(bandwidth_gbps=a.netbed)}
        singles = ["native", "ring", "omnireduce", "allgather"]
        res = run(a.workers, singles, [], a.steps, a.period, launch_kw, a.vocab, a.tokens, a.estimate_steps,
                  a.decisions)
        _dump(a.json, f"netbed {a.netbed:g}", res)
        figures.append(report(res, f"netbed, {a.workers} hosts at {a.netbed:g} Gbit/s"))
    else:
        for gbps in [float(x) for x in a.gbps.split(",")]:
            for sw in a.switch.split(","):
                services = ["switch", "sparse-switch"] if sw == "yes" else []
                singles = ["ring", "omnireduce", "allgather"] + (["switch", "sparse-switch"] if services else [])
                launch_kw = {"network": sc.Network(bandwidth_gbps=gbps, latency_us=2.0)}
                res = run(a.workers, singles, services, a.steps, a.period, launch_kw, a.vocab, a.tokens,
                          a.estimate_steps, a.decisions)
                _dump(a.json, f"sim {gbps:g} switch {sw}", res)
                figures.append(report(res, f"SimFabric, {a.workers} workers at {gbps:g} Gbit/s, "
                                           f"switch service: {sw}"))
    print(f"\n# load after: {os.getloadavg()}")
    return figures


if __name__ == "__main__":
    main()
