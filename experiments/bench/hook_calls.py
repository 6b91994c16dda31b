"""The DDP hook's fixed cost per bucket, taken apart: how many Python and C calls one bucket makes, and how
minimal hooks of torch's shape compare with torch's own and with this library's, side by side.

    python -m experiments.bench.hook_calls                  # call counts, then the paired timing
    python -m experiments.bench.hook_calls --steps 200      # more timed rounds

2 gloo ranks over loopback, one torch thread each, DDP over ``4 x Linear(w, w)`` (``--width``, default 144:
84k parameters, one bucket), batch 32.

**Calls per bucket** (rank 0, ``sys.setprofile`` events of kind ``call`` and ``c_call``, a deterministic
count, median-free): on the thread that runs the hook (DDP's autograd thread), inside the hook; inside every
callback chained on a future with ``then`` (torch's hooks' completions and this library's chained ones, which
run on gloo's own thread, a C++ thread that ``threading.setprofile`` does not reach: the callbacks are wrapped
to profile themselves); and on every Python thread the library starts (its communication thread), during the
timed steps; divided by the buckets. A ``then`` registration counts as the one C call it is (``Future.then``,
which the wrapper replaces), on the thread and under the tag that makes it. The profiling's own calls (the
wrappers' ``setprofile``) are not counted.

**Paired timing** (the rounds of :mod:`experiments.bench.step`: every configuration one step per round, the
slower rank's time, the median of the per-round ratios): stock DDP, torch's ``allreduce_hook``, two minimal
hooks with its shape -- ``thread hop`` (the bucket's all-reduce posted in the hook, a Python thread waits on
the gloo work and completes the hook's future: the shape of this library's communication thread) and ``then +
checks`` (the completion chained with ``then`` from gloo's future: a finiteness check of the sum and the
division) -- and ``sc none`` (``sparsecomm.ddp.register(net)``, the library's defaults).
"""

from __future__ import annotations

import argparse
import collections
import functools
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm as sc

from .step import MLP, _bf16_compress_hook, _build, _pairs_table, _run_rounds

_COUNTS: collections.Counter = collections.Counter()
_ON = [False]


def _counter(tag: str):
    def f(frame, event, arg):
        # (the profiling wrappers' own frames and the C calls they make are not counted)
        if _ON[0] and event in ("call", "c_call") and frame.f_code not in _OWN:
            _COUNTS[tag] += 1
    f.tag = tag
    return f


_THEN = torch._C.Future.then


def _counted_then(self, callback):
    """``Future.then`` whose callback counts its own calls (under the tag ``completion``), on whichever
    thread runs it (gloo's, for a collective's future; the caller's, for a future already complete); the
    registration itself is one call of the caller's (the C call ``Future.then`` that this wrapper stands for),
    counted under the tag of the profile active on the calling thread."""
    prof = sys.getprofile()
    if _ON[0] and prof is not None:
        _COUNTS[prof.tag] += 1

    def run(fut):
        before = sys.getprofile()
        sys.setprofile(_counter("completion"))
        try:
            return callback(fut)
        finally:
            sys.setprofile(before)
    return _THEN(self, run)


def _counted(hook):
    """``hook`` with its calls counted on the calling thread (under the tag ``hook``)."""
    @functools.wraps(hook)
    def wrapper(state, bucket):
        if _ON[0]:
            _COUNTS["buckets"] += 1
        sys.setprofile(_counter("hook"))
        try:
            return hook(state, bucket)
        finally:
            sys.setprofile(None)
    _OWN.add(wrapper.__code__)
    return wrapper


#: the code of the profiling wrappers (their frames are not counted: :func:`_counter`)
_OWN = {_counted_then.__code__, *(c for c in _counted_then.__code__.co_consts if hasattr(c, "co_code"))}


_HOPS: queue.SimpleQueue = queue.SimpleQueue()


def _hop_loop() -> None:
    while True:
        work, fut, buf = _HOPS.get()
        work.wait()
        fut.set_result(buf)


def thread_hop_hook(state, bucket):
    """The average posted in the hook; a Python thread waits for it and completes the future."""
    buf = bucket.buffer().div_(dist.get_world_size())
    fut: torch.futures.Future = torch.futures.Future()
    _HOPS.put((dist.all_reduce(buf, async_op=True), fut, buf))
    return fut


def then_checks_hook(state, bucket):
    """The sum posted in the hook; a finiteness check and the division chained on gloo's future."""
    n = dist.get_world_size()

    def finish(fut):
        total = fut.value()[0]
        if not torch.isfinite(total.sum()):
            raise RuntimeError("a non-finite sum")
        return total.div_(n)

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(finish)


def _net(width: int) -> nn.Module:
    return nn.parallel.DistributedDataParallel(MLP(width, depth=4))


def _calls(ctx, a, name: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from sparsecomm import ddp as scddp

    torch.manual_seed(0)
    net = _net(a.width)
    cast = "fp16" if "fp16" in name else "bf16" if "bf16" in name else None
    if name.startswith("sc"):
        state = scddp.CommHookState(model=net, compressor=cast)
        net.register_comm_hook(state, _counted(scddp.comm_hook))
    else:
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": _bf16_compress_hook,
                None: default_hooks.allreduce_hook}[cast]
        net.register_comm_hook(None, _counted(hook))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step(t):
        g = torch.Generator().manual_seed(10_000 * ctx.rank + t)
        x, y = torch.randn(32, a.width, generator=g), torch.randn(32, a.width, generator=g)
        opt.zero_grad()
        (((net(x) - y) ** 2).sum() / 32).backward()
        opt.step()

    for t in range(a.warmup):
        step(t)
    dist.barrier()
    _COUNTS.clear()
    _ON[0] = True
    for t in range(a.count_steps):
        step(t)
    dist.barrier()
    time.sleep(0.2)              # the communication thread's last completion
    _ON[0] = False
    buckets = _COUNTS["buckets"]
    return {"hook": _COUNTS["hook"] / buckets, "completion": _COUNTS["completion"] / buckets,
            "threads": _COUNTS["thread"] / buckets, "buckets": buckets / a.count_steps}


def _worker(ctx, a) -> dict:
    from sparsecomm.fabric.engine import engine

    torch.set_num_threads(1)
    threading.Thread(target=_hop_loop, daemon=True).start()
    threading.setprofile(_counter("thread"))     # every Python thread started from here on (the comm thread)
    torch._C.Future.then = _counted_then         # every callback chained from here on counts its calls
    try:
        out = {"calls": {name: _calls(ctx, a, name) for name in ("torch allreduce_hook", "sc none", "torch fp16",
                                                                   "sc fp16", "torch bf16", "sc bf16")}}
    finally:
        torch._C.Future.then = _THEN
        threading.setprofile(None)
    engine(ctx.fabric).close()                   # its thread leaves; the next one runs unprofiled
    if a.calls_only:
        return out
    configs = [("ddp", None), ("torch allreduce_hook", ("torch", _torch_allreduce_hook())),
               ("thread hop", ("torch", thread_hop_hook)), ("then + checks", ("torch", then_checks_hook)),
               ("sc none", ("hook", {}))]
    setups = [(name, *_build(name, make, MLP(a.width, depth=4), 25)) for name, make in configs]

    def make_batch(t):
        g = torch.Generator().manual_seed(10_000 * ctx.rank + t)
        return torch.randn(32, a.width, generator=g), torch.randn(32, a.width, generator=g)

    out["rounds"] = _run_rounds(a, setups, make_batch, lambda net, xy: ((net(xy[0]) - xy[1]) ** 2).sum() / 32)
    return out


def _torch_allreduce_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=144)
    p.add_argument("--steps", type=int, default=150, help="timed rounds of the paired timing")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--count-steps", type=int, default=50, help="steps whose calls are counted")
    p.add_argument("--calls-only", action="store_true", help="the call counts only (no paired timing)")
    a = p.parse_args(argv)
    res = sc.launch(functools.partial(_worker, a=a), world_size=2, backend="gloo")
    params = 4 * (a.width * a.width + a.width)
    print(f"# DDP hooks on 2 gloo ranks, 4 x Linear({a.width}, {a.width}) ({params / 1e3:.1f}k parameters), "
          f"rank 0\n## calls per bucket (sys.setprofile: Python and C calls)")
    print(f"{'hook':24s} {'buckets/step':>13s} {'in the hook':>12s} {'completions':>12s} {'library threads':>16s} "
          f"{'total':>8s}")
    for name, c in res[0]["calls"].items():
        print(f"{name:24s} {c['buckets']:13.1f} {c['hook']:12.1f} {c['completion']:12.1f} {c['threads']:16.1f} "
              f"{c['hook'] + c['completion'] + c['threads']:8.1f}")
    if a.calls_only:
        return res[0]
    print("## paired step time")
    _pairs_table([r["rounds"] for r in res], (("torch allreduce_hook", "ddp"), ("thread hop", "torch allreduce_hook"),
                                              ("then + checks", "torch allreduce_hook"),
                                              ("sc none", "torch allreduce_hook")))
    return res[0]


if __name__ == "__main__":
    main()
