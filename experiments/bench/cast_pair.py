"""Where the time of a rounding cast's compress + decompress goes: the fp16 / bf16 pair at n elements, its
calls and its kernels alone and back to back, with this library's buffers (numpy's), torch's allocator's, or
preallocated ones, against torch's own two casts (what GRACE's ``fp16`` runs).

    python -m experiments.bench.cast_pair [--n 1000000] [--rounds 40] [--block 10] [--casts fp16,bf16]
                                          [--torch-threads T]

Rows, per cast:

- ``compress``, ``decompress``, ``pair`` (``decompress(compress(x))``): the compressor's calls;
- ``kernels, numpy buffers``: the fused cast-and-check kernel then the widening kernel, each into a fresh
  ``np.empty`` (what the calls allocate), without the calls' Python; ``kernels, torch.empty buffers``: the
  same into buffers from torch's CPU allocator; ``kernels, preallocated``: the same into two buffers
  allocated once (no allocation at all); ``cast kernel, preallocated`` and ``widen kernel, preallocated``:
  each alone;
- ``torch x.to(dt).to(float32)``: torch's two casts on its ``T`` threads (GRACE's ``fp16`` compress +
  decompress).

Columns: the median and minimum wall time of a call; the median CPU time of the calling thread
(``time.thread_time``: time spent descheduled under load is not in it, cache misses are); minor page faults
and system CPU time per call (``getrusage``, the whole process: torch's worker threads included). Every
row is called ``--block`` times in a row per round (a loop of that row alone, as far as the cache and
glibc's heap go), the rows interleaved round by round in alternating order (load from other processes hits
every row alike). What separates an allocation's cost from a cache's: ``kernels, preallocated`` against the
two ``..., preallocated`` rows alone (nothing is allocated; what is lost back to back is the working set,
x, the payload and the output, no longer in cache), and ``kernels, numpy buffers`` against ``kernels,
preallocated`` (the allocator's share: page faults, system time). One thread here runs every kernel; a
machine with other load gives wide ranges: the fault and system-time counts do not depend on it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch

import sparsecomm as sc
from sparsecomm.compressors import _kernels
from sparsecomm.compressors.identity import _quick_bf16_at, _quick_f16_at

from .compressors import machine


def rows(cast: str, x: torch.Tensor) -> dict:
    """The callables of one cast's rows (the kernel rows only where the cast has its fused kernels)."""
    c = sc.compressors.get(cast)
    p = c.compress(x)
    dt = torch.float16 if cast == "fp16" else torch.bfloat16
    out = {"compress": lambda: c.compress(x), "decompress": lambda: c.decompress(p),
           "pair": lambda: c.decompress(c.compress(x))}
    n = x.numel()
    xp = x.data_ptr()
    if cast == "fp16" and not _kernels.NATIVE_HALF:
        print(f"# {cast}: no fused kernels here (the CPU does not convert float16 in hardware): the calls only")
    else:
        if cast == "fp16":
            cast_k = lambda yp: _quick_f16_at(xp, yp, n, 0)         # noqa: E731
            widen_k = _kernels.widen_f16_at
        else:
            cast_k = lambda yp: _quick_bf16_at(xp, yp, n)           # noqa: E731
            widen_k = _kernels.widen_bf16_at
        y_pre, o_pre = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.float32)

        def numpy_buffers():
            y = np.empty(n, dtype=np.int16)
            cast_k(y.ctypes.data)
            o = np.empty(n, dtype=np.float32)
            widen_k(y.ctypes.data, o)

        def torch_buffers():
            y = torch.empty(n, dtype=torch.int16)
            cast_k(y.data_ptr())
            o = torch.empty(n, dtype=torch.float32)
            widen_k(y.data_ptr(), o.numpy())

        def preallocated():
            cast_k(y_pre.ctypes.data)
            widen_k(y_pre.ctypes.data, o_pre)

        out.update({"kernels, numpy buffers": numpy_buffers, "kernels, torch.empty buffers": torch_buffers,
                    "kernels, preallocated": preallocated,
                    "cast kernel, preallocated": lambda: cast_k(y_pre.ctypes.data),
                    "widen kernel, preallocated": lambda: widen_k(y_pre.ctypes.data, o_pre)})
    out[f"torch x.to({str(dt)[6:]}).to(float32)"] = lambda: x.to(dt).to(torch.float32)
    return out


def measure(fns: dict, rounds: int, block: int) -> dict:
    """Per row: (wall times, thread CPU times, minor faults per call, system seconds per call), the rows
    interleaved round by round in alternating order, each called ``block`` times in a row per round, after
    a warm-up call each."""
    for fn in fns.values():
        fn()
    acc = {k: ([], [], 0, 0.0) for k in fns}
    order = list(fns)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            fn = fns[k]
            walls, cpus, flt, sys_s = acc[k]
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(block):
                c0, t0 = time.thread_time(), time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            acc[k] = (walls, cpus, flt + u1.ru_minflt - u0.ru_minflt, sys_s + u1.ru_stime - u0.ru_stime)
    calls = rounds * block
    return {k: (w, c, f / calls, s / calls) for k, (w, c, f, s) in acc.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=10, help="calls in a row per row and round")
    ap.add_argument("--casts", default="fp16,bf16")
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    for cast in args.casts.split(","):
        fns = rows(cast, x)
        load0 = os.getloadavg()[0]
        res = measure(fns, args.rounds, args.block)
        print(f"\n# {cast}: n = {args.n:,} float32, {args.rounds} rounds of {args.block} calls per row")
        print(machine(load0, os.getloadavg()[0]))
        print(f"{'row':<34}{'med us':>9}{'min us':>9}{'cpu us':>9}{'faults':>9}{'sys us':>9}")
        for k, (w, c, f, s) in res.items():
            print(f"{k:<34}{statistics.median(w) * 1e6:9.1f}{min(w) * 1e6:9.1f}{statistics.median(c) * 1e6:9.1f}"
                  f"{f:9.2f}{s * 1e6:9.1f}")
        med = {k: statistics.median(v[0]) for k, v in res.items()}
        lost = (med["pair"] - med["compress"] - med["decompress"]) * 1e6
        line = f"# medians: pair - (compress + decompress) {lost:+.1f} us"
        if "kernels, preallocated" in med:
            both = med["kernels, preallocated"] - med["cast kernel, preallocated"] - med["widen kernel, preallocated"]
            line += f"; kernels back to back - alone, preallocated {both * 1e6:+.1f} us"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
