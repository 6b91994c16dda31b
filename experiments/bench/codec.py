"""Throughput of the block codec against ``numpy.copyto`` of the same buffer, measured side by side.

    python -m experiments.bench.codec [--n 25600000] [--block 256] [--repeats 11] [--dtype float32]
                                      [--cache cold|warm] [--backend auto|numba|torch]
    python -m experiments.bench.codec --small          # smoke run: n = 1M, 3 repeats
    python -m experiments.bench.codec --bits [--small] [--stat median|min] [--clock wall|thread]  # codec.bits

``--bits`` times the wire encodings of :mod:`sparsecomm.codec.bits` instead, side by side with
``numpy.copyto`` of the unpacked buffer (int8 codes for k <= 8, int16 for k = 9..16, float32 values for
natural compression), every width 1..9, 12, 15, 16 and natural float32, each
round-robin and cold as below: pack (codes -> bits) and unpack (bits -> codes) through the public API
(output allocated per call, as a transport does) and the Numba kernel alone into a preallocated buffer.
``x copy`` = copyto time / operation time; bytes processed = the unpacked buffer's bytes in both
directions. The target is the same, >= 0.8.

For each block density (fraction of blocks holding a non-zero; exactly ``round(density * nb)``
blocks drawn uniformly at random, the others zeroed) it times, through the public API on CPU
tensors (the Numba path unless ``--backend torch``):

* scan   ``nonzero_blocks(x, block)``                    -- reads the whole buffer
* pack   ``pack_blocks(x, mask, block, out=buf)``        -- mask given, output preallocated (as copyto's)
* unpack ``unpack_add(packed, mask, block, acc)``        -- read-modify-write of the selected blocks
* pack kernel-only: the Numba kernel on numpy views, to separate the Python call overhead

and, as the reference, ``numpy.copyto(dst, x.numpy())``: a copy of *the same buffer* (same torch
allocation, same page size) into a preallocated ``dst``. Every function gets one untimed warm-up call
(JIT compile or cache load, page faults), then each figure is the median of ``--repeats`` runs.

Cache state (``--cache``). In both modes the calls are interleaved round-robin (copyto, scan,
pack, unpack, kernel-only, copyto, ...; one of each per round) so that on a shared machine the
ratios compare runs made under the same load, and each timed call is preceded by an untimed one:

* ``cold`` (default): a read of a 96 MiB scratch buffer (larger than the L3 it is meant to evict;
  read-only, so no dirty lines are left to write back), then the same call on tiny buffers. The call's
  data come from DRAM, its code does not (a pipeline calls these kernels in a loop, so it does not pay
  a cold call's dispatch). This is the conservative figure: a 100 MB gradient does not stay in the L3,
  so a transport packs blocks that mostly come from DRAM.
* ``warm``: the same call on the same data, back to back. At low density the selected blocks, the
  mask and the output then stay in the L3 between the two, which flatters pack and unpack.

Bandwidth convention: bytes *processed* per second, each buffer counted once, as for copyto
(``nbytes / t``):

* scan:   the input bytes (``n * itemsize``): every element must be read, whatever the density;
* pack:   the bytes moved (``packed_numel * itemsize``): the selected blocks only;
* unpack: the bytes moved (``packed_numel * itemsize``).

``x copy`` is that bandwidth divided by copyto's (``n * itemsize / t_copyto``) in the same row; the
target is >= 0.8 for scan and pack at every density. ``pack/copyto time`` is the plain time ratio
against copying the whole buffer (what packing costs relative to sending the tensor dense).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import numpy as np
import torch

from sparsecomm import codec
from sparsecomm.codec import _kernels

TARGET = 0.8
_SCRATCH_BYTES = 96 * 2**20  # read before every cold call: three times a 32 MiB L3


def _medians(fns: dict, repeats: int, before: dict, stat=np.median, clock=time.perf_counter) -> dict:
    """Median wall time of each function, timed round-robin (copyto, scan, pack, ...; one run of each
    per round, so that all of them see the same machine load), ``before[k]`` run untimed just
    before each timed call of ``fns[k]``. One untimed warm-up call of each first (JIT/cache load,
    page faults). ``clock=time.thread_time``: CPU time of this thread instead (a call that the
    scheduler preempts on a loaded machine is not charged for the wait; memory contention still is)."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            before[k]()
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
    return {k: float(stat(v)) for k, v in times.items()}


def _cold_before(primes: dict) -> dict:
    """Cold data, warm code: a 96 MiB scratch read evicts the caches (read-only, so no dirty lines
    are left to write back), then ``primes[k]`` -- the same call on tiny buffers -- brings the
    interpreter, dispatcher and kernel code back (a cold call's dispatch, which a pipeline calling these
    kernels in a loop does not pay)."""
    scratch = np.ones(_SCRATCH_BYTES // 8)

    def make(prime):
        def before():
            scratch.sum()
            prime()

        return before

    return {k: make(p) for k, p in primes.items()}


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def make_input(n: int, block: int, density: float, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense-random tensor with exactly ``round(density * nb)`` non-zero blocks, and its mask."""
    g = torch.Generator().manual_seed(seed)
    nb = codec.num_blocks(n, block)
    k = min(nb, max(1, round(density * nb))) if density > 0 else 0
    chosen = torch.randperm(nb, generator=g)[:k]
    mask = torch.zeros(nb, dtype=torch.bool)
    mask[chosen] = True
    x = torch.randn(n, generator=g, dtype=dtype)
    x[~mask.repeat_interleave(block)[:n]] = 0
    return x, mask


def run(
    n: int,
    block: int,
    repeats: int,
    dtype: torch.dtype,
    densities: list[float],
    seed: int = 0,
    backend: str = "auto",
    cache: str = "cold",
) -> list[dict]:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = n * itemsize
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, numpy {np.__version__}")
    print(
        f"n={n} {str(dtype).replace('torch.', '')} ({nbytes / 1e6:.1f} MB), block={block}, backend={backend}, "
        f"cache={cache}, median of {repeats}; reference: numpy.copyto of the same buffer, timed in the same run"
    )
    print()
    head = (
        f"{'density':>8} | {'copyto GB/s':>11} | {'scan ms':>8} {'GB/s':>6} {'x copy':>6} | {'pack ms':>8} "
        f"{'GB/s':>6} {'x copy':>6} | {'unpack ms':>9} {'GB/s':>6} {'x copy':>6} | target"
    )
    detail_head = (
        f"{'density':>8} | {'moved MB':>8} | {'pack/copyto time':>16} | {'pack kernel-only GB/s':>21} {'x copy':>6} "
        f"| {'API overhead us':>15}"
    )
    rows = []
    for density in densities:
        x, mask = make_input(n, block, density, dtype, seed + 1)
        # correctness first: the kernels must reproduce the mask and the tensor
        if not torch.equal(codec.nonzero_blocks(x, block, backend=backend), mask):
            raise AssertionError(f"scan mismatch at density {density}")
        length = codec.packed_numel(mask, block, n)
        buf = torch.empty(length, dtype=dtype)
        packed = codec.pack_blocks(x, mask, block, out=buf, backend=backend)
        back = codec.unpack_add(packed, mask, block, torch.zeros(n, dtype=dtype), backend=backend)
        if not torch.equal(back, x):
            raise AssertionError(f"pack/unpack round trip mismatch at density {density}")
        acc = torch.zeros(n, dtype=dtype)
        src, dst = x.numpy(), torch.zeros_like(x).numpy()
        xn, mn, bn = x.numpy(), mask.numpy(), buf.numpy()
        fns = {
            "copy": lambda: np.copyto(dst, src),
            "scan": lambda: codec.nonzero_blocks(x, block, backend=backend),
            "pack": lambda: codec.pack_blocks(x, mask, block, out=buf, backend=backend),
            "unpack": lambda: codec.unpack_add(packed, mask, block, acc, backend=backend),
        }
        # the same calls on tiny buffers, to re-warm the code (not the data) in cold mode
        tx, tm = make_input(4 * block, block, 0.5, dtype, seed + 2)
        tbuf = torch.empty(4 * block, dtype=dtype)
        tpacked = codec.pack_blocks(tx, tm, block)
        tacc = torch.zeros_like(tx)
        tsrc, tdst = tx.numpy(), torch.zeros_like(tx).numpy()
        primes = {
            "copy": lambda: np.copyto(tdst, tsrc),
            "scan": lambda: codec.nonzero_blocks(tx, block, backend=backend),
            "pack": lambda: codec.pack_blocks(tx, tm, block, out=tbuf, backend=backend),
            "unpack": lambda: codec.unpack_add(tpacked, tm, block, tacc, backend=backend),
        }
        if backend != "torch":
            fns["kernel"] = lambda: _kernels.pack_blocks(xn, mn, block, bn)
            tmn, tbn = tm.numpy(), tbuf.numpy()
            primes["kernel"] = lambda: _kernels.pack_blocks(tsrc, tmn, block, tbn)
        # warm: the same call just before (what fits stays cached); cold: evict, then re-warm the code
        before = _cold_before(primes) if cache == "cold" else fns
        t = _medians(fns, repeats, before)
        bw_copy = nbytes / t["copy"]
        moved = length * itemsize
        r = dict(
            density=density,
            copy_ms=t["copy"] * 1e3,
            copy_gbs=bw_copy / 1e9,
            scan_ms=t["scan"] * 1e3,
            scan_gbs=nbytes / t["scan"] / 1e9,
            scan_x=nbytes / t["scan"] / bw_copy,
            moved_mb=moved / 1e6,
            pack_ms=t["pack"] * 1e3,
            pack_gbs=moved / t["pack"] / 1e9,
            pack_x=moved / t["pack"] / bw_copy,
            pack_time_ratio=t["pack"] / t["copy"],
            unpack_ms=t["unpack"] * 1e3,
            unpack_gbs=moved / t["unpack"] / 1e9,
            unpack_x=moved / t["unpack"] / bw_copy,
        )
        if "kernel" in t:
            r.update(
                kernel_gbs=moved / t["kernel"] / 1e9,
                kernel_x=moved / t["kernel"] / bw_copy,
                overhead_us=(t["pack"] - t["kernel"]) * 1e6,
            )
        r["ok"] = r["scan_x"] >= TARGET and r["pack_x"] >= TARGET
        rows.append(r)
        if len(rows) == 1:
            print(head)
            print("-" * len(head))
        print(
            f"{density:>8.3%} | {r['copy_gbs']:>11.1f} | "
            f"{r['scan_ms']:>8.3f} {r['scan_gbs']:>6.1f} {r['scan_x']:>6.2f} | "
            f"{r['pack_ms']:>8.3f} {r['pack_gbs']:>6.1f} {r['pack_x']:>6.2f} | "
            f"{r['unpack_ms']:>9.3f} {r['unpack_gbs']:>6.1f} {r['unpack_x']:>6.2f} | {'ok' if r['ok'] else 'BELOW'}"
        )
    print()
    print(detail_head)
    print("-" * len(detail_head))
    for r in rows:
        kern = (
            f"{r['kernel_gbs']:>21.1f} {r['kernel_x']:>6.2f} | {r['overhead_us']:>15.1f}"
            if "kernel_gbs" in r
            else f"{'-':>21} {'-':>6} | {'-':>15}"
        )
        print(f"{r['density']:>8.3%} | {r['moved_mb']:>8.2f} | {r['pack_time_ratio']:>16.4f} | {kern}")
    print()
    print(
        "GB/s = bytes processed per second, each buffer counted once as for copyto: scan = input bytes; "
        "pack and unpack = bytes moved (the packed size).\n"
        f"x copy = that / copyto GB/s of the same row. Target: scan and pack x copy >= {TARGET} at every density.\n"
        "pack/copyto time = pack time / time to copy the whole buffer; kernel-only = the Numba kernel called "
        "on numpy views (no torch wrapper); API overhead = public call minus kernel-only."
    )
    return rows


def run_bits(n: int, repeats: int, cache: str = "cold", seed: int = 0, stat: str = "median",
             clock: str = "wall") -> list[dict]:
    """Pack / unpack of the wire encodings against numpy.copyto of the unpacked buffer (see the module
    docstring); round trips are checked bit for bit first. ``stat="min"``: the fastest of the interleaved
    runs of each function, an estimate of its uncontended time on a loaded machine; ``clock="thread"``:
    this thread's CPU time, not wall time (preemption by other processes is not charged)."""
    from sparsecomm.codec import _bitkernels as K
    from sparsecomm.codec import bits as B

    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, numpy {np.__version__}")
    print(f"n={n} codes, cache={cache}, {stat} of {repeats}, {clock} clock; reference: numpy.copyto of the unpacked buffer "
          f"(int8 codes: {n / 1e6:.1f} MB; int16 codes: {2 * n / 1e6:.1f} MB; float32 values: {4 * n / 1e6:.1f} MB), "
          f"timed in the same run")
    n -= n % B.BLOCK_CODES    # whole blocks: the kernels alone are timed on the whole buffer
    g = torch.Generator().manual_seed(seed)
    cases = []
    for label, k in (("signs (1 bit)", 1), ("k=2 (terngrad)", 2), ("k=3 (qsgd s=2,3)", 3), ("k=4 (qsgd s=4..7)", 4),
                     ("k=5 (qsgd s=8..15)", 5), ("k=6 (qsgd s=16..31)", 6), ("k=7 (fp16 natural)", 7),
                     ("k=8 (= copyto)", 8), ("k=9 int16 (qsgd s=128+)", 9), ("k=12 int16 (f64 natural)", 12),
                     ("k=15 int16", 15), ("k=16 int16 (= copyto)", 16)):
        c = torch.randint(-(1 << (k - 1)), 1 << (k - 1), (n,), generator=g).to(torch.int8 if k <= 8 else torch.int16)
        if k == 1:
            c = torch.where(c == 0, torch.ones_like(c), c)
        cases.append((label, k, c))
    vals = torch.ldexp(torch.ones(n), torch.randint(-30, 30, (n,), generator=g)) * \
        (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    rows = []
    head = (f"{'encoding':>24} | {'wire MB':>7} | {'copyto ms':>9} | {'pack ms':>8} {'x copy':>6} | "
            f"{'kernel ms':>9} {'x copy':>6} | {'unpack ms':>9} {'x copy':>6} | {'kernel ms':>9} {'x copy':>6} "
            f"| target")
    print()
    print(head)
    print("-" * len(head))
    for label, k, c in cases + [("natural f32 (9 bits)", 0, vals)]:
        nat = k == 0
        if nat:
            pk, up = (lambda: B.pack_natural(vals)), (lambda: B.unpack_natural(packed, n, torch.float32))
        elif k == 1:
            pk, up = (lambda: B.pack_signs(c)), (lambda: B.unpack_signs(packed, n))
        else:
            pk, up = (lambda: B.pack_bits(c, k)), (lambda: B.unpack_bits(packed, n, k, dtype=c.dtype))
        packed = pk()
        back = up()
        if not torch.equal(back.view(torch.int32) if nat else back, vals.view(torch.int32) if nat else c):
            raise AssertionError(f"{label}: round trip mismatch")
        src = (vals if nat else c).numpy()
        dst = np.empty_like(src)
        pbuf = np.empty(packed.numel(), dtype=np.uint8)
        ubuf = np.empty_like(src)
        pn = packed.numpy()
        w = 0 if nat else B.lane_width(k)
        if nat:
            kpack = lambda: K.natural32_pack(src.view(np.int32), pbuf)  # noqa: E731
            kunpack = lambda: K.natural32_unpack(pn, ubuf.view(np.int32))  # noqa: E731
        elif k == 1:
            kpack = lambda: K.sign_words(src.view(np.uint64), pbuf)  # noqa: E731
            kunpack = lambda: K.unpack_signs_words(pn, ubuf)  # noqa: E731
        elif k in (2, 4):
            kpack = lambda: K.pack_words(src.view(np.uint64), k, pbuf)  # noqa: E731
            kunpack = lambda: K.unpack_words(pn, k, True, ubuf)  # noqa: E731
        elif k in (8, 16):
            kpack = lambda: np.copyto(pbuf, src.view(np.uint8))  # noqa: E731
            kunpack = lambda: np.copyto(ubuf.view(np.uint8), pn)  # noqa: E731
        else:
            kpack = lambda: K.pack_lanes(src.view(np.uint64), k, w, pbuf.view(np.uint64))  # noqa: E731
            kunpack = lambda: K.unpack_lanes(pn.view(np.uint64), k, w, True, ubuf.view(np.uint64))  # noqa: E731
        fns = {"copy": lambda: np.copyto(dst, src), "pack": pk, "kpack": kpack, "unpack": up, "kunpack": kunpack}
        tiny = {name: (lambda: None) for name in fns}
        before = _cold_before(tiny) if cache == "cold" else fns
        t = _medians(fns, repeats, before, np.min if stat == "min" else np.median,
                     time.thread_time if clock == "thread" else time.perf_counter)
        r = dict(encoding=label, wire_mb=packed.numel() / 1e6, copy_ms=t["copy"] * 1e3,
                 **{f"{key}_ms": t[key] * 1e3 for key in ("pack", "kpack", "unpack", "kunpack")},
                 **{f"{key}_x": t["copy"] / t[key] for key in ("pack", "kpack", "unpack", "kunpack")})
        r["ok"] = min(r["kpack_x"], r["kunpack_x"]) >= TARGET
        rows.append(r)
        print(f"{label:>24} | {r['wire_mb']:>7.2f} | {r['copy_ms']:>9.2f} | {r['pack_ms']:>8.2f} {r['pack_x']:>6.2f} | "
              f"{r['kpack_ms']:>9.2f} {r['kpack_x']:>6.2f} | {r['unpack_ms']:>9.2f} {r['unpack_x']:>6.2f} | "
              f"{r['kunpack_ms']:>9.2f} {r['kunpack_x']:>6.2f} | {'ok' if r['ok'] else 'BELOW'}")
    print()
    print("x copy = copyto time / operation time (the same unpacked buffer: int8 codes for k <= 8, int16 for "
          "k > 8, float32 for natural). pack/unpack: the public API, output allocated per call; kernel: the "
          f"Numba kernel into a preallocated buffer. Target: kernel x copy >= {TARGET}. The k=8 and k=16 "
          "rows are copyto itself: their spread is the noise of the machine.")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=25_600_000, help="elements in the buffer")
    p.add_argument("--block", type=int, default=256, help="block size (elements)")
    p.add_argument("--repeats", type=int, default=11, help="timed runs per measurement (median)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--densities", default="1,0.1,0.01,0.001", help="comma-separated block densities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "numba", "torch"], default="auto", help="codec backend to time")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold", help="cache state of each timed call")
    p.add_argument("--small", action="store_true", help="smoke run: n=1M, 3 repeats (about a second)")
    p.add_argument("--bits", action="store_true", help="time the wire bit packing (codec.bits) instead")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="--bits: median of the interleaved runs, or their minimum (uncontended estimate under load)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="--bits: wall time, or this thread's CPU time (not charged for preemption under load)")
    a = p.parse_args(argv)
    if a.small:
        a.n, a.repeats = 1_000_000, 3
    if a.bits:
        run_bits(a.n, a.repeats, a.cache, a.seed, a.stat, a.clock)
        return
    densities = [float(d) for d in a.densities.split(",")]
    run(a.n, a.block, a.repeats, getattr(torch, a.dtype), densities, a.seed, a.backend, a.cache)


if __name__ == "__main__":
    main()
