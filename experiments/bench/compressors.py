"""Throughput of every compressor on one large float32 vector, side by side with torch.topk and memcpy,
and against GRACE's implementation of every operator both libraries have.

    python -m experiments.bench.compressors [--n 25600000] [--ratio 0.01] [--repeat 10]
                                            [--grace PATH] [--median-of 11] [--block 1] [--only throughput|grace]
                                            [--torch-threads T]

Every figure is the best of ``--repeat`` timed calls after one warm-up call (which also compiles the
Numba kernels or loads them from the cache), all measured in this one run, the entries interleaved
round by round so that load from other processes does not favour one entry. Columns:

- ``ms``: wall time of ``compress(x, generator)`` (and of ``decompress`` in ``dec ms``);
- ``GB/s``: input bytes (4 n) per second of ``compress``;
- ``x copy``: memcpy time / operator time, memcpy = ``dst.copy_(x)`` into a preallocated buffer
  (pure bandwidth; torch uses both cores for it; ``np.copyto`` is listed as the one-thread memcpy:
  the Numba kernels run on one thread); ``x clone``: ``x.clone()`` time / operator time (a copy that
  allocates its output in torch's allocator, i.e. pays 4 KiB page faults); 1.0 means memcpy speed,
  0.25 a quarter of it;
- ``vs topk``: ``torch.topk(x.abs(), k)`` time / operator time.

``topk`` is also checked to select exactly the set torch.topk selects (the input is tie-free).

**Against GRACE** (``--grace PATH``; Xu et al., "GRACE: A Compressed Communication Framework for
Distributed Machine Learning", ICDCS 2021, github.com/sands-lab/grace): PATH is a checkout of that
repository (a directory holding ``grace_dl/``) or a bare git mirror of it (its HEAD's ``grace_dl`` is
extracted to a temporary directory); its code is loaded from there at run time, never copied here.
Without ``--grace``, or when PATH holds no GRACE, that table is skipped with a message. For each
operator of ``grace_dl/torch/compressor`` that this library also has, both run ``compress`` then
``decompress`` on the same float32 vector; each entry is the median of ``--median-of`` timed calls
(after one warm-up), the entries interleaved round by round, in alternating order (``--block B``: B calls
in a row per entry and round, so that torch's thread pool is as warm as in a loop of that entry alone). Columns: the two
medians, ``GRACE / ours`` (> 1: this library is faster) and each side's min-max range. Settings: this
library's defaults, given to GRACE where it takes the same parameter (``--ratio`` for top-k, rand-k and
the threshold's kept fraction, 4 QSGD levels, DGC's 0.1%); GRACE's own defaults otherwise. The pairs (GRACE -> here):
``none`` -> identity, ``fp16`` -> fp16, ``topk`` -> topk, ``randomk`` -> randk (GRACE draws from the
global torch RNG, reseeded per call), ``threshold`` -> threshold, ``qsgd`` -> qsgd, ``terngrad`` ->
terngrad, ``efsignsgd`` -> sign (the scaled sign), ``signsgd`` -> the ``signsgd`` method's operator
(the vote's signs), ``signum`` -> the ``signum`` method's encode (momentum, then the vote's signs) and
its operator's decompress, ``onebit`` -> the ``onebit`` method's operator (buckets of 512 entries; GRACE:
the two means of the whole tensor), ``dgc`` -> the ``dgc`` method's sampled top-k (0.1%, 1% sampled).
GRACE's ``natural`` (CuPy, CUDA only) and ``powersgd`` (all-reduces inside ``compress``) are reported
as skipped. GRACE's ``none`` returns its input (no copy, no check): identity's checked copy cannot beat
it. ``--torch-threads T`` runs the whole benchmark with ``torch.set_num_threads(T)`` (the machine line
shows the count): torch's casts, GRACE's ``fp16`` among them, use every thread torch has, this library's
kernels one (the table's threads line says so), so only ``--torch-threads 1`` compares the two at one
thread each; the default compares one thread here against torch's count there. The table as BENCHMARKS.md
records it (GRACE fetched as a git mirror or cloned from GitHub)::

    python -m experiments.bench.compressors --only grace --n 25000000 --median-of 11 --grace PATH
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import sparsecomm as sc


def interleaved_samples(fns: dict, rounds: int, block: int = 1) -> dict:
    """Wall times of each callable over ``rounds`` rounds, the callables interleaved within each round
    (so a burst of load from other processes hits one sample of every entry, not all samples of one
    entry), in the given order in even rounds and the reverse order in odd ones (so each entry follows
    each of its neighbours equally often: what the one before leaves behind, its input in the cache, the
    buffers it freed, torch's thread pool awake or asleep, favours neither side of a pair), each called
    ``block`` times in a row per round (a sample per call: with a block, a thread pool stays as warm as in
    a loop of that callable alone). Each is called once first as warm-up (JIT compilation / cache load)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def interleaved_best(fns: dict, rounds: int) -> dict:
    """Best wall time of each callable (:func:`interleaved_samples`)."""
    return {name: min(ts) for name, ts in interleaved_samples(fns, rounds).items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def machine(load0: float, load1: float) -> str:
    return (f"# machine: {cpu_name()}, {os.cpu_count()} cpus, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), numpy {np.__version__}; load average {load0:.1f} -> {load1:.1f}")


def operators(ratio: float, thr: float) -> list[tuple[str, dict]]:
    return [
        ("identity", {}),
        ("fp16", {}),
        ("bf16", {}),
        ("topk", {"ratio": ratio}),
        ("randk", {"ratio": ratio}),
        ("threshold", {"threshold": thr}),
        ("qsgd", {"levels": 4, "bucket_size": 512}),
        ("qsgd", {"levels": 16}),
        ("natural", {}),
        ("natural_dithering", {"levels": 4, "bucket_size": 512}),
        ("terngrad", {"bucket_size": 512}),
        ("sign", {}),
        ("compose", {"first": "randk", "second": "natural", "ratio": ratio}),
        ("induced", {"first": "topk", "second": "randk", "ratio": ratio}),
    ]


# ------------------------------------------------------------------------------------------ GRACE
def grace_root(path: str, tmp: str) -> tuple[Path | None, str]:
    """The directory to import ``grace_dl`` from, or ``None`` and why: ``path`` itself when it holds
    ``grace_dl/torch``, else ``path`` read as a git directory (a bare mirror) whose HEAD's ``grace_dl``
    is extracted into ``tmp``."""
    p = Path(path)
    if (p / "grace_dl" / "torch").is_dir():
        return p, ""
    if not p.exists():
        return None, f"{path} does not exist"
    arch = subprocess.run(["git", "--git-dir", str(p), "archive", "--format=tar", "HEAD", "grace_dl"],
                          capture_output=True)
    if arch.returncode:
        return None, f"{path} holds no grace_dl/ and is not a git mirror of GRACE ({arch.stderr.decode().strip()})"
    with tarfile.open(fileobj=io.BytesIO(arch.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    return Path(tmp), ""


def grace_pairs(ratio: float, thr: float) -> list:
    """(GRACE module, its class, its keywords, this library's label, this library's operator: a
    Compressor, or a Method whose encode is timed with its operator's decompress)."""
    from sparsecomm.compressors.onebit import OneBit
    from sparsecomm.compressors.sampled_topk import SampledTopK
    from sparsecomm.compressors.vote import VoteSign
    from sparsecomm.theory import compressors as th

    C = sc.compressors
    return [
        ("none", "NoneCompressor", {}, "identity()", C.identity()),
        ("fp16", "FP16Compressor", {}, "fp16()", C.fp16()),
        ("topk", "TopKCompressor", {"compress_ratio": ratio}, f"topk({ratio})", C.topk(ratio)),
        ("randomk", "RandomKCompressor", {"compress_ratio": ratio}, f"randk({ratio})", C.randk(ratio)),
        ("threshold", "ThresholdCompressor", {"threshold": thr}, f"threshold({thr:.3f})", C.threshold(thr)),
        ("qsgd", "QSGDCompressor", {"quantum_num": 4}, "qsgd() (4 levels)", C.qsgd()),
        ("terngrad", "TernGradCompressor", {}, "terngrad()", C.terngrad()),
        ("efsignsgd", "EFSignSGDCompressor", {"lr": 0.1}, "sign()", C.sign()),
        ("signsgd", "SignSGDCompressor", {}, "signsgd's VoteSign", VoteSign()),
        ("signum", "SignumCompressor", {"momentum": 0.9}, "signum's encode (beta 0.9)", sc.methods.get("signum")),
        ("onebit", "OneBitCompressor", {}, "onebit's OneBit (bucket 512)", OneBit()),
        ("dgc", "DgcCompressor", {"compress_ratio": th.DGC_RATIO}, "dgc's SampledTopK (0.1%)",
         SampledTopK(th.DGC_RATIO, th.DGC_SAMPLE_RATIO)),
        ("natural", "NaturalCompressor", {}, "natural()", C.natural()),
        ("powersgd", "PowerSGDCompressor", {}, "powersgd", None),
    ]


def ours(op, x: torch.Tensor):
    """This library's compress + decompress of ``x`` (a method: its encode, then its operator's decompress)."""
    g = torch.Generator().manual_seed(1)
    if isinstance(op, sc.methods.Method):
        st = op.init(x.numel(), x.dtype, x.device)
        return lambda: op.compressor.decompress(op.encode(x, st, g)[0])
    return lambda: op.decompress(op.compress(x, g))


def theirs(compressor, x: torch.Tensor):
    """GRACE's compress + decompress of ``x`` (its ``Compressor`` interface: ``compress(tensor, name)``
    returns the tensors and a context, ``decompress(tensors, ctx)``)."""
    def run():
        tensors, ctx = compressor.compress(x, "x")
        return compressor.decompress(tensors, ctx)
    return run


def grace_table(path: str | None, x: torch.Tensor, ratio: float, thr: float, rounds: int, block: int = 1) -> None:
    n = x.numel()
    print(f"\n# against GRACE: compress + decompress, n = {n:,} float32, median of {rounds} interleaved rounds"
          + (f" of {block} calls in a row" if block > 1 else ""))
    if not path:
        print("# GRACE comparison skipped: no --grace PATH given (a checkout or git mirror of sands-lab/grace)")
        return
    with tempfile.TemporaryDirectory(prefix="grace-") as tmp:
        root, why = grace_root(path, tmp)
        if root is None:
            print(f"# GRACE comparison skipped: {why}")
            return
        sys.path.insert(0, str(root))
        fns, labels, skipped = {}, {}, []
        for mod, cls, kw, label, op in grace_pairs(ratio, thr):
            if op is None:
                skipped.append(f"{mod} (GRACE's compress all-reduces inside; no operator to time alone)")
                continue
            try:
                compressor = getattr(importlib.import_module(f"grace_dl.torch.compressor.{mod}"), cls)(**kw)
            except ImportError as e:
                skipped.append(f"{mod} ({e.name or e} is not importable here)")
                continue
            fns[("ours", mod)], fns[("grace", mod)] = ours(op, x), theirs(compressor, x)
            labels[mod] = label
        load0 = os.getloadavg()[0]
        times = interleaved_samples(fns, rounds, block)
    print(machine(load0, os.getloadavg()[0]))
    print(f"# threads: this library's kernels 1 (the calling thread); GRACE's torch ops {torch.get_num_threads()} "
          f"(torch's count{'' if torch.get_num_threads() == 1 else '; --torch-threads 1: one each'})")
    print(f"# GRACE from {path}")
    print(f"{'GRACE':<11}{'this library':<30}{'ours ms':>9}{'GRACE ms':>10}{'GRACE/ours':>11}"
          f"{'ours range':>16}{'GRACE range':>18}")
    for mod, label in labels.items():
        a, b = times[("ours", mod)], times[("grace", mod)]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{mod:<11}{label:<30}{ma * 1e3:9.1f}{mb * 1e3:10.1f}{mb / ma:11.2f}"
              f"{f'{min(a) * 1e3:.1f}-{max(a) * 1e3:.1f}':>16}{f'{min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}':>18}")
    for s in skipped:
        print(f"# skipped: {s}")


def throughput_table(x: torch.Tensor, ratio: float, k: int, thr: float, repeat: int) -> None:
    n = x.numel()
    xn = x.numpy()
    dst = torch.empty_like(x)

    fns = {
        "memcpy (dst.copy_(x))": lambda: dst.copy_(x),
        "memcpy 1 thread (np.copyto)": lambda: np.copyto(dst.numpy(), xn),
        "clone (x.clone())": lambda: x.clone(),
        "torch.topk(|x|, k)": lambda: torch.topk(x.abs(), k, sorted=False),
        "numpy.argpartition(|x|, n-k)": lambda: np.argpartition(np.abs(xn), n - k)[n - k:],
    }
    decs, comps = {}, {}
    for name, kw in operators(ratio, thr):
        label = name + "(" + ", ".join(f"{a}={b}" for a, b in kw.items()) + ")"
        c = sc.compressors.get(name, **kw)
        g = torch.Generator().manual_seed(1)
        p = c.compress(x, g)
        comps[label] = (c, p)
        fns[label] = (lambda c=c, g=g: c.compress(x, g))
        decs[label] = (lambda c=c, p=p: c.decompress(p))
        if name == "topk":
            ref = torch.topk(x.abs(), k, sorted=False).indices
            topk_same = torch.equal(torch.sort(ref).values, p.indices)
    load0 = os.getloadavg()[0]
    best = interleaved_best(fns, repeat)
    best_dec = interleaved_best(decs, repeat)
    load1 = os.getloadavg()[0]
    t_copy, t_clone, t_topk = best["memcpy (dst.copy_(x))"], best["clone (x.clone())"], best["torch.topk(|x|, k)"]

    print(f"# sparsecomm compressor throughput: n = {n:,} float32 ({4 * n / 1e6:.1f} MB), "
          f"k = {k:,} (ratio {ratio}), best of {repeat} interleaved rounds")
    print(machine(load0, load1))
    print(f"# topk selects exactly torch.topk's set: {topk_same}")
    print(f"{'operator':<50}{'ms':>8}{'dec ms':>8}{'GB/s':>7}{'x copy':>8}{'x clone':>8}{'vs topk':>8}")
    for label, t in best.items():
        td = best_dec.get(label)
        dec = f"{td * 1e3:8.1f}" if td is not None else f"{'':>8}"
        print(f"{label:<50}{t * 1e3:8.1f}{dec}{4 * n / t / 1e9:7.2f}{t_copy / t:8.3f}{t_clone / t:8.3f}"
              f"{t_topk / t:8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25_600_000)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=10, help="rounds of the throughput table (best of)")
    ap.add_argument("--grace", metavar="PATH", help="a checkout or bare git mirror of sands-lab/grace: "
                    "adds the table against GRACE's operators")
    ap.add_argument("--median-of", type=int, default=11, help="rounds of the GRACE table (median of)")
    ap.add_argument("--block", type=int, default=1, help="GRACE table: calls in a row per entry and round")
    ap.add_argument("--only", choices=("throughput", "grace"), help="print one table only")
    ap.add_argument("--torch-threads", type=int, metavar="T", help="torch.set_num_threads(T) for the whole run "
                    "(default: torch's own count)")
    args = ap.parse_args(argv)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            ap.error(f"--torch-threads must be at least 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
    n, ratio = args.n, args.ratio
    k = max(1, int(math.floor(ratio * n + 0.5)))

    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    # threshold that keeps a fraction `ratio` of N(0, 1) entries: P(|x| >= t) = ratio
    thr = math.sqrt(2.0) * float(torch.erfinv(torch.tensor(1.0 - ratio, dtype=torch.float64)))
    if args.only != "grace":
        throughput_table(x, ratio, k, thr, args.repeat)
    if args.only != "throughput":
        grace_table(args.grace, x, ratio, thr, args.median_of, args.block)


if __name__ == "__main__":
    main()
