"""Per-bucket timeline of one DDP step: stock DDP (built-in all-reduce), DDP with torch's
``allreduce_hook`` and DDP with ``sparsecomm.ddp.comm_hook`` (none/native), side by side on one model.

    python -m experiments.bench.hook_trace --netbed 1 --workers 4      # root: a 4-host netbed at 1 Gbit/s

For every bucket (median over the timed steps, ms from the step's start, rank 0): when DDP hands it to
the hook (``call``), when the hook returns (``ret``: the bucket's all-reduce is posted by then, for
``allreduce_hook`` and for ours once its calls are predicted) and when the bucket's future completes
(``fut``: the all-reduce done, checked and divided); then when ``backward()`` returns and when the step
ends. ``--profile`` adds torch.profiler's collective events of the last step (stock DDP's posts).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm as sc

from .step import MLP

_T0 = [0.0]
_EV: list[tuple[str, int, float, str]] = []     # (event, bucket-ish id, t, thread)


def _now() -> float:
    return (time.perf_counter() - _T0[0]) * 1e3


def _ev(name: str, ident: int) -> None:
    _EV.append((name, ident, _now(), threading.current_thread().name))


def _traced(hook):
    """``hook`` with its call, its return and its future's completion recorded per bucket."""

    def traced(state, bucket):
        i = bucket.index()
        _ev("call", i)
        fut = hook(state, bucket)
        _ev("ret", i)

        def done(f):
            _ev("fut", i)
            return f.value()

        return fut.then(done)

    return traced


def _stock_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return _traced(allreduce_hook)(state, bucket)


def _our_hook(state, bucket):
    from sparsecomm.ddp import comm_hook

    return _traced(comm_hook)(state, bucket)


def _worker(ctx, a) -> dict:
    torch.set_num_threads(1)
    loss_fn = nn.MSELoss()
    nets = {}
    for name in ("ddp", "allreduce_hook", "ours", "optimizer"):
        if name == "optimizer":
            m = MLP(a.width)
            nets[name] = (m, sc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), compressor="none",
                                                     transport="native", bucket_cap_mb=a.cap_mb))
            continue
        net = nn.parallel.DistributedDataParallel(MLP(a.width), bucket_cap_mb=a.cap_mb)
        if name == "allreduce_hook":
            net.register_comm_hook(None, _stock_hook)
        elif name == "ours":
            from sparsecomm import ddp as scddp

            st = scddp.CommHookState(compressor="none", transport="native", model=net)
            net.register_comm_hook(st, _our_hook)
        nets[name] = (net, torch.optim.SGD(net.parameters(), lr=0.01))
    out = {n: [] for n in nets}
    profs: dict = {}
    for t in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(10_000 * ctx.rank + t)
        x, y = torch.randn(a.batch, a.width, generator=g), torch.randn(a.batch, a.width, generator=g)
        for name, (net, opt) in nets.items():
            dist.barrier()
            _EV.clear()
            _T0[0] = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            _ev("fwd", 0)
            prof = None
            if a.profile and t == a.warmup + a.steps - 1:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            loss.backward()
            _ev("bwd", 0)
            opt.step()
            _ev("end", 0)
            if prof is not None:
                prof.__exit__(None, None, None)
                base = None
                for e in prof.events():
                    if "gloo" in e.name or "all_reduce" in e.name or "allreduce" in e.name.lower():
                        profs.setdefault(name, []).append((e.name, e.time_range.start / 1e3, e.time_range.end / 1e3))
            if t >= a.warmup:
                out[name].append(list(_EV))
    out["_prof"] = profs
    return out


def _summary(steps: list[list[tuple]]) -> list[str]:
    """Median time of each (event, occurrence index) over steps."""
    keyed: dict[tuple, list[float]] = {}
    order: list[tuple] = []
    for evs in steps:
        seen: dict[str, int] = {}
        for name, ident, t, thr in evs:
            k = (name, seen.get(name, 0), ident if name in ("call", "ret", "fut") else "")
            seen[name] = seen.get(name, 0) + 1
            if k not in keyed:
                keyed[k] = []
                order.append(k)
            keyed[k].append(t)
    rows = sorted(((statistics.median(v), k) for k, v in keyed.items()), key=lambda r: r[0])
    return [f"  {t:8.1f}  {k[0]:5s} #{k[1]} {k[2]}" for t, k in rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netbed", type=float, default=None)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cap-mb", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also torch.profiler's comm events of the last step")
    a = p.parse_args(argv)
    from .transports import launch_options

    res = sc.launch(functools.partial(_worker, a=a), world_size=a.workers, **launch_options(a.netbed))
    for name, evs in res[a.rank]["_prof"].items():
        t0 = min(e[1] for e in evs)
        print(f"\n## profiler, {name} (ms from its first comm event):")
        for e in sorted(evs, key=lambda e: e[1]):
            print(f"  {e[1] - t0:8.1f} {e[2] - t0:8.1f}  {e[0]}")
    for name in [n for n in res[0] if n != "_prof"]:
        ends = [max(s[-1][2] for s in (r[name][i] for r in res)) for i in range(a.steps)]
        print(f"\n## {name}: step (slowest rank) median {statistics.median(ends):.1f} ms; rank {a.rank}'s events:")
        print("\n".join(_summary(res[a.rank][name])))
        print("  per rank, medians: fwd, first call, first ret, last fut, bwd, end")
        for r, rr in enumerate(res):
            cols = []
            for pick in (lambda e: e[0] == "fwd", lambda e: e[0] == "call", lambda e: e[0] == "ret"):
                cols.append(statistics.median(next((e[2] for e in s if pick(e)), float("nan")) for s in rr[name]))
            for ev in ("fut",):
                cols.append(statistics.median(max((e[2] for e in s if e[0] == ev), default=float("nan"))
                                              for s in rr[name]))
            for ev in ("bwd", "end"):
                cols.append(statistics.median(next(e[2] for e in s if e[0] == ev) for s in rr[name]))
            print(f"  rank {r}: " + " ".join(f"{c:7.1f}" for c in cols))


if __name__ == "__main__":
    main()
