"""The block codec (sparsecomm.codec) against plain numpy/Python references.

Every kernel is checked on both backends (numba on CPU contiguous tensors, torch ops otherwise) and
the two must agree bit for bit. References are written independently of the kernels (per-block
Python loops, ``decimal`` rounding, ``math.frexp``), invariants in float64.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sparsecomm as sc
from sparsecomm.codec import CodecError
from sparsecomm.errors import NonFiniteError, OverflowError_, SparseCommError

# every test runs on both kernel paths (Numba, and the torch ops CUDA users run) unless it picks the
# path itself with a `backend` parameter (tests/conftest.py, sparsecomm.kernels)
pytestmark = pytest.mark.usefixtures("kernel_path")

C = sc.codec
BACKENDS = ["numba", "torch"]
DTYPES = [torch.float32, torch.float64]
NP = {torch.float32: np.float32, torch.float64: np.float64}


# --------------------------------------------------------------------------- references


def ref_mask(x: np.ndarray, block: int, thr: float = 0.0) -> np.ndarray:
    nb = -(-x.size // block)
    out = np.zeros(nb, dtype=bool)
    for b in range(nb):
        blk = x[b * block : (b + 1) * block]
        out[b] = bool(np.any(blk != 0)) if thr == 0 else bool(np.any(~(np.abs(blk) <= thr)))
    return out


def ref_pack(x: np.ndarray, mask: np.ndarray, block: int) -> np.ndarray:
    parts = [x[b * block : (b + 1) * block] for b in np.flatnonzero(mask)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=x.dtype)


def ref_unpack_add(packed: np.ndarray, mask: np.ndarray, block: int, out: np.ndarray) -> np.ndarray:
    out = out.copy()
    o = 0
    for b in np.flatnonzero(mask):
        seg = out[b * block : (b + 1) * block]
        seg += packed[o : o + seg.size]
        o += seg.size
    assert o == packed.size
    return out


def ref_next(mask: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    nb = mask.size
    nxt = np.full(nb, nb, dtype=np.int64)
    first = np.full(lanes, nb, dtype=np.int64)
    for b in range(nb):
        for c in range(b + lanes, nb, lanes):
            if mask[c]:
                nxt[b] = c
                break
    for lane in range(lanes):
        sel = [b for b in range(lane, nb, lanes) if mask[b]]
        if sel:
            first[lane] = sel[0]
    return nxt, first


def ref_round_half_away(v: float) -> int:
    return int(Decimal(v).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def block_sparse(n: int, block: int, density: float, dtype, seed: int) -> torch.Tensor:
    """A tensor whose blocks are each dense-random with probability ``density``, else all zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(NP[dtype])
    nb = -(-n // block)
    keep = rng.random(nb) < density
    x[~np.repeat(keep, block)[:n]] = 0
    return torch.from_numpy(x)


SIZES = [0, 1, 255, 256, 257, 1000, 4099]


# --------------------------------------------------------------------------- scan


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_matches_reference(dtype, backend):
    for n in SIZES:
        for block in (1, 7, 256):
            for density, seed in ((0.0, 1), (1.0, 2), (0.3, 3)):
                x = block_sparse(n, block, density, dtype, seed)
                got = C.nonzero_blocks(x, block, backend=backend)
                assert got.dtype == torch.bool and got.shape == (-(-n // block),)
                np.testing.assert_array_equal(got.numpy(), ref_mask(x.numpy(), block), err_msg=f"n={n} B={block}")
                if density == 0.0:
                    assert not got.any()
                if density == 1.0:
                    assert got.all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_special_values(dtype, backend):
    f = NP[dtype]
    tiny = np.finfo(f).smallest_subnormal
    vals = [np.nan, np.inf, -np.inf, -0.0, tiny, -tiny, 0.0]
    block = 4
    for at in (0, 2, block - 1):  # first (the kernel settles a block on its first element), middle, last
        x = np.zeros(block * len(vals), dtype=f)
        for b, v in enumerate(vals):
            x[b * block + at] = v  # one special value in an otherwise zero block
        got = C.nonzero_blocks(torch.from_numpy(x), block, backend=backend).numpy()
        np.testing.assert_array_equal(got, [True, True, True, False, True, True, False], err_msg=f"at {at}")
    # a block of -0.0 only is zero; a block with -0.0 and a NaN is not
    negz = np.full(8, -0.0, dtype=f)
    assert not C.nonzero_blocks(torch.from_numpy(negz), 8, backend=backend).any()
    negz[5] = np.nan
    assert C.nonzero_blocks(torch.from_numpy(negz), 8, backend=backend).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_threshold(dtype, backend):
    f = NP[dtype]
    half = f(0.5)
    above = np.nextafter(half, f(1))
    cases = [
        ([0.0, half, -half, 0.1], 0.5, False),  # every |x| <= thr
        ([0.0, -above, 0.0, 0.0], 0.5, True),  # one just above
        ([np.nan, 0.0, 0.0, 0.0], 0.5, True),  # NaN is never <= thr
        ([np.nan, 0.0, 0.0, 0.0], math.inf, True),
        ([np.inf, -np.inf, 1e30, 0.0], math.inf, False),  # |inf| <= inf
        ([np.inf, 0.0, 0.0, 0.0], 1e300, True),
        ([-0.0, 0.0, -0.0, 0.0], 0.0, False),
    ]
    for vals, thr, want in cases:
        x = torch.from_numpy(np.array(vals, dtype=f))
        assert bool(C.nonzero_blocks(x, 4, threshold=thr, backend=backend)[0]) is want, (vals, thr)
    # the threshold is compared exactly, not after rounding it to the data dtype: float32(0.1) is
    # 0.10000000149 > 0.1, so it is above a threshold of 0.1 but not above float32(0.1)
    v = f(0.1)
    x = torch.from_numpy(np.array([v], dtype=f))
    assert bool(C.nonzero_blocks(x, 1, threshold=0.1, backend=backend)[0]) is (float(v) > 0.1)
    assert not C.nonzero_blocks(x, 1, threshold=float(v), backend=backend)[0]
    # random data: reference semantics at a few thresholds
    xr = block_sparse(3000, 16, 0.5, dtype, 7)
    for thr in (0.0, 0.3, 1.7, 3.0):
        got = C.nonzero_blocks(xr, 16, threshold=thr, backend=backend).numpy()
        np.testing.assert_array_equal(got, ref_mask(xr.numpy(), 16, thr))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_block_scan_by_ranges_equals_the_scan(dtype):
    """``BlockScan.into`` range by range gives ``nonzero_blocks``' mask of the whole tensor (on the kernel path
    the fixture picks; float16 always on torch's), with special values, a short last block and thresholds; the
    entries outside the ranges scanned are left as they were."""
    block, n = 7, 7 * 40 + 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g).to(dtype)
    x[7 * 3: 7 * 9] = 0                     # zero blocks 3..8
    x[7 * 4 + 2] = -0.0                     # still zero
    x[7 * 6 + 6] = float("nan")             # block 6 non-zero (last element)
    x[7 * 7] = float("-inf")                # block 7 non-zero (first element)
    x[7 * 10: 7 * 11] = 1e-3                # small: zero under a threshold
    for thr in (0.0, 1e-2):
        want = C.nonzero_blocks(x, block, thr)
        scan = C.BlockScan(x, block, thr)
        mask = torch.zeros(want.numel(), dtype=torch.bool)
        for lo, hi in ((0, 5), (5, 5), (5, 12), (30, 41), (12, 30)):
            scan.into(mask, lo, hi)
        assert torch.equal(mask, want), thr
        part = torch.ones(want.numel(), dtype=torch.bool)
        C.BlockScan(x, block, thr).into(part, 3, 9)
        assert torch.equal(part[3:9], want[3:9]) and part[:3].all() and part[9:].all()
        assert want[3:9].tolist() == [False, False, False, True, True, False]


def test_scan_threshold_rejects_bad_values():
    x = torch.ones(8)
    for thr in (-1.0, math.nan, "a"):
        with pytest.raises(CodecError):
            C.nonzero_blocks(x, 4, threshold=thr)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scan_half_precision_takes_torch_path(dtype):
    x = block_sparse(1000, 16, 0.4, torch.float32, 11)
    xh = x.to(dtype)
    got = C.nonzero_blocks(xh, 16)
    np.testing.assert_array_equal(got.numpy(), ref_mask(xh.float().numpy(), 16))
    with pytest.raises(CodecError):
        C.nonzero_blocks(xh, 16, backend="numba")


def test_scan_non_contiguous_and_nd():
    base = block_sparse(2048, 8, 0.3, torch.float32, 5)
    strided = base[::2]  # non-contiguous: torch path
    assert not strided.is_contiguous()
    want = ref_mask(strided.contiguous().numpy(), 8)
    np.testing.assert_array_equal(C.nonzero_blocks(strided, 8).numpy(), want)
    with pytest.raises(CodecError):
        C.nonzero_blocks(strided, 8, backend="numba")
    two_d = base.view(64, 32)  # any shape: blocks of the flattened tensor
    np.testing.assert_array_equal(C.nonzero_blocks(two_d, 8).numpy(), ref_mask(base.numpy(), 8))


# --------------------------------------------------------------------------- pack / unpack-add


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_match_reference(dtype, backend):
    rng = np.random.default_rng(0)
    for n in SIZES:
        for block in (1, 7, 256):
            nb = -(-n // block)
            for mask_np in (np.zeros(nb, bool), np.ones(nb, bool), rng.random(nb) < 0.3):
                x = torch.from_numpy(rng.standard_normal(n).astype(NP[dtype]))
                mask = torch.from_numpy(mask_np.copy())
                want = ref_pack(x.numpy(), mask_np, block)
                assert C.packed_numel(mask, block, n) == want.size
                packed = C.pack_blocks(x, mask, block, backend=backend)
                assert packed.dtype == dtype and packed.dim() == 1
                np.testing.assert_array_equal(packed.numpy(), want)
                base = torch.from_numpy(rng.standard_normal(n).astype(NP[dtype]))
                out = base.clone()
                ret = C.unpack_add(packed, mask, block, out, backend=backend)
                assert ret is out
                np.testing.assert_array_equal(out.numpy(), ref_unpack_add(want, mask_np, block, base.numpy()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_round_trip_with_scan(backend):
    for dtype in DTYPES:
        for density in (0.0, 0.01, 0.3, 1.0):
            x = block_sparse(10_001, 64, density, dtype, 3)
            mask = C.nonzero_blocks(x, 64, backend=backend)
            packed = C.pack_blocks(x, mask, 64, backend=backend)
            back = C.unpack_add(packed, mask, 64, torch.zeros_like(x), backend=backend)
            assert torch.equal(back, x)


def test_pack_special_values_travel_bitwise():
    x = torch.zeros(12, dtype=torch.float64)
    x[1], x[5], x[9] = math.nan, -math.inf, -0.0
    mask = C.nonzero_blocks(x, 4)
    assert mask.tolist() == [True, True, False]
    packed = C.pack_blocks(x, mask, 4)
    np.testing.assert_array_equal(packed.numpy().view(np.uint64), x[:8].numpy().view(np.uint64))


def test_pack_out_buffer():
    x = block_sparse(1000, 10, 0.5, torch.float32, 9)
    mask = C.nonzero_blocks(x, 10)
    length = C.packed_numel(mask, 10, 1000)
    for backend in BACKENDS:
        buf = torch.full((length + 5,), 7.0)
        got = C.pack_blocks(x, mask, 10, out=buf, backend=backend)
        assert got.data_ptr() == buf.data_ptr() and got.numel() == length
        np.testing.assert_array_equal(got.numpy(), ref_pack(x.numpy(), mask.numpy(), 10))
        assert (buf[length:] == 7.0).all()
        exact = torch.empty(length)
        assert C.pack_blocks(x, mask, 10, out=exact, backend=backend) is exact
        strided = torch.zeros(2 * length)[::2]  # a non-contiguous destination (torch path)
        C.pack_blocks(x, mask, 10, out=strided, backend="torch" if backend == "torch" else "auto")
        np.testing.assert_array_equal(strided.numpy(), ref_pack(x.numpy(), mask.numpy(), 10))
        with pytest.raises(CodecError, match="elements but"):
            C.pack_blocks(x, mask, 10, out=torch.empty(length - 1), backend=backend)
        with pytest.raises(CodecError):
            C.pack_blocks(x, mask, 10, out=torch.empty(length, dtype=torch.float64), backend=backend)
        big = torch.zeros(length + 3)
        got = C.pack_blocks(x, mask, 10, out=big[1:], backend=backend)  # an unaligned destination
        np.testing.assert_array_equal(got.numpy(), ref_pack(x.numpy(), mask.numpy(), 10))
        assert big[0] == 0 and (big[length + 1 :] == 0).all()


def test_unpack_add_checks_and_converts():
    x = block_sparse(100, 8, 0.5, torch.float32, 4)
    mask = C.nonzero_blocks(x, 8)
    packed = C.pack_blocks(x, mask, 8)
    for backend in BACKENDS:
        with pytest.raises(CodecError, match="selects"):
            C.unpack_add(packed[:-1], mask, 8, torch.zeros(100), backend=backend)
        with pytest.raises(CodecError, match="entries"):
            C.unpack_add(packed, mask[:-1], 8, torch.zeros(100), backend=backend)
        out = torch.zeros(100, dtype=torch.float64)  # packed float32 into a float64 accumulator
        C.unpack_add(packed, mask, 8, out, backend=backend)
        np.testing.assert_array_equal(out.numpy(), x.numpy().astype(np.float64))
    # a non-contiguous out is updated in place through the torch path
    big = torch.zeros(100, 2)
    C.unpack_add(packed, mask, 8, big[:, 0])
    np.testing.assert_array_equal(big[:, 0].numpy(), x.numpy())
    assert not big[:, 1].any()


def test_pack_half_precision_torch_path():
    x = block_sparse(999, 16, 0.4, torch.float32, 2).to(torch.bfloat16)
    mask = C.nonzero_blocks(x, 16)
    packed = C.pack_blocks(x, mask, 16)
    assert packed.dtype == torch.bfloat16
    np.testing.assert_array_equal(packed.float().numpy(), ref_pack(x.float().numpy(), mask.numpy(), 16))
    back = C.unpack_add(packed, mask, 16, torch.zeros(999, dtype=torch.bfloat16))
    assert torch.equal(back, x)


def test_block_argument_errors():
    x = torch.ones(10)
    for bad in (0, -3, 1.5, True, "4"):
        with pytest.raises(CodecError):
            C.nonzero_blocks(x, bad)
    with pytest.raises(CodecError, match="integer codes"):
        C.nonzero_blocks(torch.ones(10, dtype=torch.int32), 4, threshold=0.5)
    with pytest.raises(CodecError):
        C.pack_blocks(x, torch.ones(3, dtype=torch.uint8), 4)
    with pytest.raises(CodecError, match="backend"):
        C.nonzero_blocks(x, 4, backend="cuda")
    assert issubclass(CodecError, SparseCommError) and issubclass(CodecError, ValueError)
    assert C.num_blocks(0, 4) == 0 and C.num_blocks(9, 4) == 3 and C.num_blocks(8, 4) == 2


def test_kernels_run_concurrently_from_threads():
    """The kernels release the GIL (SimFabric workers are threads): concurrent calls stay correct."""
    from concurrent.futures import ThreadPoolExecutor

    xs = [block_sparse(50_000, 64, 0.2, torch.float32, 100 + i) for i in range(4)]

    def work(x):
        out = torch.zeros_like(x)
        for _ in range(5):
            mask = C.nonzero_blocks(x, 64)
            C.unpack_add(C.pack_blocks(x, mask, 64), mask, 64, out)
        return out

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(work, xs))
    for x, out in zip(xs, outs):
        want = np.zeros(x.numel(), dtype=np.float32)
        for _ in range(5):
            want += x.numpy()  # the same float32 additions, in the same order
        np.testing.assert_array_equal(out.numpy(), want)


def test_benchmark_smoke():
    from experiments.bench import codec as bench

    rows = bench.run(n=5000, block=64, repeats=1, dtype=torch.float32, densities=[1.0, 0.1], cache="warm")
    assert [r["density"] for r in rows] == [1.0, 0.1]
    assert all(r["scan_gbs"] > 0 and r["pack_gbs"] > 0 for r in rows)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(0, 300),
        elements=st.sampled_from([0.0, -0.0, 1.0, -2.5, float(np.float32(1e-40)), float(np.float32(3e38))]),
    ),
    block=st.integers(1, 40),
)
def test_property_pack_unpack_inverts(x, block):
    t = torch.from_numpy(x)
    mask = C.nonzero_blocks(t, block)
    np.testing.assert_array_equal(mask.numpy(), ref_mask(x, block))
    packed = C.pack_blocks(t, mask, block)
    assert packed.numel() == C.packed_numel(mask, block, x.size) <= x.size
    back = C.unpack_add(packed, mask, block, torch.zeros_like(t))
    np.testing.assert_array_equal(back.numpy(), x)  # -0.0 == 0.0: -0.0-only blocks need not travel
    assert torch.equal(C.nonzero_blocks(t, block, backend="torch"), mask)


# --------------------------------------------------------------------------- mask formats


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmap_bit_order_and_round_trip(backend):
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    bm = C.mask_to_bitmap(mask, backend=backend)
    assert bm.dtype == torch.uint8 and bm.tolist() == [0b10000001, 0b00000010]
    assert torch.equal(C.bitmap_to_mask(bm, 10, backend=backend), mask)
    rng = np.random.default_rng(1)
    for nb in (0, 1, 7, 8, 9, 64, 1001):
        m = torch.from_numpy(rng.random(nb) < 0.4)
        bm = C.mask_to_bitmap(m, backend=backend)
        assert bm.numel() == -(-nb // 8)
        np.testing.assert_array_equal(bm.numpy(), np.packbits(m.numpy(), bitorder="little"))
        assert torch.equal(C.bitmap_to_mask(bm, nb, backend=backend), m)
    with pytest.raises(CodecError, match="padding"):
        C.bitmap_to_mask(torch.tensor([0b00000100], dtype=torch.uint8), 2, backend=backend)
    with pytest.raises(CodecError, match="bytes"):
        C.bitmap_to_mask(torch.tensor([1, 0], dtype=torch.uint8), 8, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_indices_round_trip(backend):
    rng = np.random.default_rng(2)
    for nb in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4097):
        for p in (0.0, 0.01, 0.5, 1.0):
            m = rng.random(nb) < p
            mask = torch.from_numpy(m)
            idx = C.mask_to_indices(mask, backend=backend)
            assert idx.dtype == torch.int64
            np.testing.assert_array_equal(idx.numpy(), np.flatnonzero(m))
            assert torch.equal(C.indices_to_mask(idx, nb), mask)
    shuffled = torch.tensor([5, 1, 5, 3])
    assert C.indices_to_mask(shuffled, 6).tolist() == [False, True, False, True, False, True]
    with pytest.raises(CodecError, match="outside"):
        C.indices_to_mask(torch.tensor([0, 6]), 6)
    with pytest.raises(CodecError, match="outside"):
        C.indices_to_mask(torch.tensor([-1]), 6)
    with pytest.raises(CodecError):
        C.indices_to_mask(torch.tensor([0.0]), 6)


def test_select_handles_any_nonzero_byte():
    # a bool tensor reinterpreted from uint8 may hold bytes other than 0/1
    raw = torch.tensor([0, 2, 0, 0, 0, 0, 0, 255, 0, 9, 1], dtype=torch.uint8)
    mask = raw.view(torch.bool)
    assert C.mask_to_indices(mask, backend="numba").tolist() == [1, 7, 9, 10]


# --------------------------------------------------------------------------- look-ahead


@pytest.mark.parametrize("backend", BACKENDS)
def test_next_nonzero_matches_reference(backend):
    rng = np.random.default_rng(3)
    for nb in (0, 1, 2, 17, 100):
        for lanes in (1, 3, 8, max(nb, 1), nb + 5):
            for p in (0.0, 0.2, 1.0):
                m = rng.random(nb) < p
                la = C.next_nonzero(torch.from_numpy(m), lanes, backend=backend)
                want_next, want_first = ref_next(m, lanes)
                assert la.next.dtype == torch.int64 and la.first.dtype == torch.int64
                np.testing.assert_array_equal(la.next.numpy(), want_next, err_msg=f"nb={nb} L={lanes}")
                np.testing.assert_array_equal(la.first.numpy(), want_first)
    with pytest.raises(CodecError):
        C.next_nonzero(torch.ones(3, dtype=torch.bool), 0, backend=backend)


def test_next_nonzero_drives_an_omnireduce_stream():
    """The aggregator protocol of the LookAhead docstring requests exactly the union of the
    workers' non-zero blocks, lane by lane in increasing order, and each worker sends exactly its
    own non-zero blocks."""
    rng = np.random.default_rng(4)
    nb, lanes, workers = 203, 4, 5
    masks = [rng.random(nb) < p for p in (0.05, 0.2, 0.0, 0.5, 0.01)]
    las = [C.next_nonzero(torch.from_numpy(m), lanes) for m in masks]
    for lane in range(lanes):
        ahead = [int(la.first[lane]) for la in las]
        requested, sent = [], [[] for _ in range(workers)]
        while min(ahead) < nb:
            b = min(ahead)
            requested.append(b)
            for w in range(workers):
                if ahead[w] == b:
                    sent[w].append(b)
                    ahead[w] = int(las[w].next[b])
        union = sorted({b for m in masks for b in np.flatnonzero(m) if b % lanes == lane})
        assert requested == union
        for w in range(workers):
            assert sent[w] == [b for b in np.flatnonzero(masks[w]) if b % lanes == lane]


# --------------------------------------------------------------------------- fixed point


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_fixed_nearest_matches_decimal_reference(dtype, backend):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(3001) * 10).astype(NP[dtype])
    x[:8] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.0]
    for scale, chunk in ((1.0, None), (1000.0, None), (3.7, None)):
        q = C.to_fixed(torch.from_numpy(x), scale, chunk=chunk, backend=backend)
        want = [ref_round_half_away(float(v) * scale) for v in x]
        assert q.dtype == torch.int32
        np.testing.assert_array_equal(q.numpy(), want)
    # per-chunk scales, n not a multiple of the chunk
    scales = torch.from_numpy(rng.uniform(1, 100, size=-(-3001 // 64)))
    q = C.to_fixed(torch.from_numpy(x), scales, chunk=64, dtype=torch.int64, backend=backend)
    want = [ref_round_half_away(float(v) * float(scales[i // 64])) for i, v in enumerate(x)]
    assert q.dtype == torch.int64
    np.testing.assert_array_equal(q.numpy(), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_to_fixed_hard_halfway_cases(backend):
    below_half = np.nextafter(0.5, 0.0)  # 0.49999999999999994: floor(v + 0.5) would give 1
    x = torch.tensor([below_half, -below_half, 0.5, -0.5, 4503599627370495.5, -4503599627370495.5], dtype=torch.float64)
    q = C.to_fixed(x, 1.0, dtype=torch.int64, backend=backend)
    assert q.tolist() == [0, 0, 1, -1, 4503599627370496, -4503599627370496]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_point_round_trip_error_bound(dtype, backend):
    rng = np.random.default_rng(6)
    x = torch.from_numpy((rng.standard_normal(5000) * 3).astype(NP[dtype]))
    for scale in (2.0**10, 2.0**20):  # power of two: x * f and q / f are exact
        for rounding, bound in (("nearest", 0.5), ("stochastic", 1.0)):
            q = C.to_fixed(x, scale, rounding=rounding, seed=1, backend=backend)
            back = C.from_fixed(q, scale, dtype=torch.float64)
            err = (x.double() - back).abs().max().item()
            assert err <= bound / scale, (rounding, err)
            if rounding == "stochastic":
                assert err > 0.5 / scale  # it does round away from nearest sometimes
    scale = 1234.567  # arbitrary: the product and the division round, a few ulps on top
    q = C.to_fixed(x, scale, backend=backend)
    err = (x.double() - C.from_fixed(q, scale, dtype=torch.float64)).abs()
    assert (err <= 0.5 / scale + 4 * np.finfo(np.float64).eps * x.double().abs()).all()
    # per-chunk scales
    scales = torch.exp2(torch.from_numpy(rng.integers(5, 20, size=-(-5000 // 256)).astype(np.float64)))
    q = C.to_fixed(x, scales, chunk=256, backend=backend)
    back = C.from_fixed(q, scales, chunk=256, dtype=torch.float64)
    per_elem = 0.5 / scales.repeat_interleave(256)[:5000]
    assert ((x.double() - back).abs() <= per_elem).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backends_agree_on_fixed_point(dtype):
    x = block_sparse(4097, 64, 0.7, dtype, 8) * 50
    scales = torch.linspace(1.0, 1e4, -(-4097 // 100), dtype=torch.float64)
    for rounding in ("nearest", "stochastic"):
        for out_dtype in (torch.int32, torch.int64):
            a = C.to_fixed(x, scales, chunk=100, rounding=rounding, seed=42, dtype=out_dtype, backend="numba")
            b = C.to_fixed(x, scales, chunk=100, rounding=rounding, seed=42, dtype=out_dtype, backend="torch")
            assert torch.equal(a, b), (rounding, out_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_deterministic_and_piecewise(backend):
    x = torch.from_numpy(np.random.default_rng(9).standard_normal(1000))
    a = C.to_fixed(x, 100.0, rounding="stochastic", seed=7, backend=backend)
    b = C.to_fixed(x, 100.0, rounding="stochastic", seed=7, backend=backend)
    c = C.to_fixed(x, 100.0, rounding="stochastic", seed=8, backend=backend)
    assert torch.equal(a, b) and not torch.equal(a, c)
    v = x.numpy() * 100.0
    assert np.all((a.numpy() == np.floor(v)) | (a.numpy() == np.ceil(v)))
    # quantising in two pieces with the stream offset gives the codes of the whole tensor
    head = C.to_fixed(x[:300], 100.0, rounding="stochastic", seed=7, backend=backend)
    tail = C.to_fixed(x[300:], 100.0, rounding="stochastic", seed=7, offset=300, backend=backend)
    assert torch.equal(torch.cat([head, tail]), a)
    # generators are accepted and deterministic for their own seed
    g1 = C.to_fixed(x, 100.0, rounding="stochastic", seed=torch.Generator().manual_seed(3), backend=backend)
    g2 = C.to_fixed(x, 100.0, rounding="stochastic", seed=torch.Generator().manual_seed(3), backend=backend)
    n1 = C.to_fixed(x, 100.0, rounding="stochastic", seed=np.random.default_rng(3), backend=backend)
    n2 = C.to_fixed(x, 100.0, rounding="stochastic", seed=np.random.default_rng(3), backend=backend)
    assert torch.equal(g1, g2) and torch.equal(n1, n2)
    with pytest.raises(CodecError, match="seed"):
        C.to_fixed(x, 100.0, rounding="stochastic", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_is_unbiased(backend):
    """E[q] = x * f. Each code is floor(v) + Bernoulli(p), p = v - floor(v), variance p(1 - p); the
    tolerances are 5 standard deviations of the tested averages."""
    n = 200_000
    # a single value: the fraction rounded up is Binomial(n, p) / n
    for v, p in ((0.3, 0.3), (-2.7, 0.3), (5.0, 0.0), (0.999, 0.999)):
        x = torch.full((n,), v, dtype=torch.float64)
        q = C.to_fixed(x, 1.0, rounding="stochastic", seed=11, backend=backend).numpy()
        up = np.mean(q == math.floor(v) + 1)
        assert abs(up - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (v, up)
    # a random vector: the mean error sum(q - v) / n has variance sum p(1-p) / n^2
    xs = np.random.default_rng(12).standard_normal(n) * 7
    q = C.to_fixed(torch.from_numpy(xs), 1.0, rounding="stochastic", seed=13, backend=backend).numpy()
    frac = xs - np.floor(xs)
    sd = math.sqrt(np.sum(frac * (1 - frac))) / n
    assert abs(np.mean(q - xs)) <= 5 * sd
    # nearest rounding is biased on the same data by much more than that tolerance (sanity: the
    # test can fail): values all at .3 above an integer round down
    x = torch.full((n,), 0.3, dtype=torch.float64)
    qn = C.to_fixed(x, 1.0, backend=backend).numpy()
    assert abs(np.mean(qn - 0.3)) > 5 * math.sqrt(0.21 / n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_point_overflow_is_reported_not_wrapped(backend):
    i32max = 2**31 - 1
    ok = torch.tensor([-(2.0**31), float(i32max), 0.0], dtype=torch.float64)
    assert C.to_fixed(ok, 1.0, backend=backend).tolist() == [-(2**31), i32max, 0]
    cases = [
        (torch.tensor([0.0, 2.0**31], dtype=torch.float64), 1.0, 1),
        (torch.tensor([1.0, 2.0, -(2.0**31) - 1], dtype=torch.float64), 1.0, 2),
        (torch.tensor([0.0, 0.0, 2147483647.5], dtype=torch.float64), 1.0, 2),  # rounding pushes it out
        (torch.tensor([1e-3, 3e38], dtype=torch.float32), 1e10, 1),  # finite input, product overflows
        (torch.tensor([1.0] * 2000 + [3.0], dtype=torch.float32), 2.0**30, 2000),  # past the first tile
    ]
    for x, scale, index in cases:
        with pytest.raises(OverflowError_, match=f"element {index}:"):
            C.to_fixed(x, scale, backend=backend)
    with pytest.raises(OverflowError_):
        C.to_fixed(torch.tensor([2.0**63]), 1.0, dtype=torch.int64, backend=backend)
    assert issubclass(OverflowError_, SparseCommError)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_point_non_finite_raises(dtype, backend):
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.zeros(50, dtype=dtype)
        x[17] = bad
        with pytest.raises(NonFiniteError, match="element 17 "):
            C.to_fixed(x, 10.0, backend=backend)
        with pytest.raises(NonFiniteError, match="element 17 "):
            C.chunk_exponents(x, 8, backend=backend)


def test_fixed_point_argument_errors():
    x = torch.ones(10)
    with pytest.raises(CodecError):
        C.to_fixed(x, 0.0)
    with pytest.raises(CodecError):
        C.to_fixed(x, math.inf)
    with pytest.raises(CodecError):
        C.to_fixed(x, torch.ones(3))  # per-chunk scales without chunk
    with pytest.raises(CodecError):
        C.to_fixed(x, torch.ones(2), chunk=3)  # 10 elements in chunks of 3 need 4 scales
    with pytest.raises(CodecError):
        C.to_fixed(x, 1.0, rounding="up")
    with pytest.raises(CodecError):
        C.to_fixed(x, 1.0, dtype=torch.int16)
    with pytest.raises(CodecError):
        C.from_fixed(x, 1.0)  # float codes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_exponents_match_frexp(dtype, backend):
    f = NP[dtype]
    emin = -126 if dtype == torch.float32 else -1022
    rng = np.random.default_rng(14)
    x = (rng.standard_normal(1000) * np.exp2(rng.integers(-30, 30, size=1000))).astype(f)
    x[64:128] = 0  # an all-zero chunk
    x[128:192] = -0.0
    x[192:256] = np.finfo(f).smallest_subnormal  # subnormal only
    x[256:320] = 0
    x[256] = 1.0  # exact power of two: 2^1 > 1 but 2^0 is not
    x[257] = -0.75
    x[320] = -np.finfo(f).max
    e = C.chunk_exponents(torch.from_numpy(x), 64, backend=backend)
    assert e.dtype == torch.int32 and e.numel() == -(-1000 // 64)
    for c in range(e.numel()):
        m = float(np.max(np.abs(x[c * 64 : (c + 1) * 64]).astype(np.float64)))
        want = max(math.frexp(m)[1], emin) if m > 0 else emin
        assert int(e[c]) == want, (c, m)
        assert Fraction(2) ** int(e[c]) > Fraction(m)  # exact (2.0**1024 overflows)
    assert int(e[4]) == 1
    assert C.chunk_exponents(torch.zeros(0, dtype=dtype), 64, backend=backend).numel() == 0


def test_chunk_exponents_half_precision():
    x = torch.tensor([0.0, 3.0, -0.75, 1024.0], dtype=torch.float16)
    assert C.chunk_exponents(x, 2).tolist() == [2, 11]


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_switchml_scales_never_overflow_the_sum(rounding, power_of_two):
    """Exponent per chunk on each worker, max over workers, shared scale: the integer sum of the
    workers' codes stays in int32 even for the worst case (every worker just below 2^e, same sign),
    and the dequantised sum is within n * (rounding bound) / f of the float64 sum."""
    rng = np.random.default_rng(15)
    chunk, n_elems = 64, 1000
    for workers in (1, 3, 8, 100):
        xs = [
            torch.from_numpy((rng.standard_normal(n_elems) * 10.0 ** rng.integers(-3, 4)).astype(np.float32))
            for _ in range(workers)
        ]
        worst = np.nextafter(np.float32(4.0), np.float32(0))  # just below 2^2
        for x in xs:
            x[:chunk] = torch.from_numpy(np.full(chunk, worst, dtype=np.float32))
        e = torch.stack([C.chunk_exponents(x, chunk) for x in xs]).amax(dim=0)
        f = C.scale_from_exponents(e, workers, power_of_two=power_of_two)
        if power_of_two:
            assert torch.equal(f, torch.exp2(torch.round(torch.log2(f))))
        acc = torch.zeros(n_elems, dtype=torch.int32)
        for w, x in enumerate(xs):
            q = C.to_fixed(x, f, chunk=chunk, rounding=rounding, seed=w)
            C.checked_add_(acc, q)  # raises if the sum left int32
        total = C.from_fixed(acc, f, chunk=chunk, dtype=torch.float64)
        exact = torch.stack([x.double() for x in xs]).sum(dim=0)
        # per code: the rounding (0.5 or 1) plus the float64 rounding of x * f (< 2^-21 units)
        unit = (0.5 if rounding == "nearest" else 1.0) + 2.0**-20
        bound = workers * unit / f.repeat_interleave(chunk)[:n_elems]
        assert ((total - exact).abs() <= bound).all()
        assert int(acc[:chunk].abs().max()) > 2**31 // 4  # the scale uses the range
    with pytest.raises(CodecError):
        C.scale_from_exponents(torch.tensor([0]), 2**31)
    # an all-zero float64 chunk (exponent -1022) still gets a finite scale
    assert torch.isfinite(C.scale_from_exponents(torch.tensor([-1022]), 4)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_checked_add(dtype, backend):
    info = torch.iinfo(dtype)
    rng = np.random.default_rng(16)
    a = torch.from_numpy(rng.integers(-1000, 1000, size=5000)).to(dtype)
    b = torch.from_numpy(rng.integers(-1000, 1000, size=5000)).to(dtype)
    want = a.numpy().astype(np.int64) + b.numpy()
    got = C.checked_add_(a.clone(), b, backend=backend)
    np.testing.assert_array_equal(got.numpy(), want)
    for index, (x0, y0) in ((3, (info.max, 1)), (4321, (info.min, -1)), (2500, (info.max - 5, 6))):
        acc = a.clone()
        acc[index] = x0
        before = acc.clone()
        y = b.clone()
        y[index] = y0
        with pytest.raises(OverflowError_, match=f"element {index}:"):
            C.checked_add_(acc, y, backend=backend)
        assert torch.equal(acc, before)  # left unchanged, including the tiles before the error
    edge = torch.tensor([info.max, info.min, info.max, 0], dtype=dtype)
    C.checked_add_(edge, torch.tensor([0, 0, info.min, info.min], dtype=dtype), backend=backend)
    assert edge.tolist() == [info.max, info.min, -1, info.min]
    with pytest.raises(CodecError):
        C.checked_add_(torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=torch.int16), backend=backend)
    with pytest.raises(CodecError):
        C.checked_add_(torch.zeros(3, dtype=dtype), torch.zeros(4, dtype=dtype), backend=backend)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float64, st.integers(0, 200), elements=st.floats(-1e6, 1e6, allow_nan=False)),
    log2_scale=st.integers(-10, 20),
)
def test_property_nearest_error_bound(x, log2_scale):
    scale = 2.0**log2_scale
    t = torch.from_numpy(x)
    q = C.to_fixed(t, scale, dtype=torch.int64)
    back = C.from_fixed(q, scale, dtype=torch.float64).numpy()
    assert np.all(np.abs(x - back) <= 0.5 / scale)
    assert torch.equal(q, C.to_fixed(t, scale, dtype=torch.int64, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_nonzero_blocks_of_integer_codes_match_reference(dtype):
    """Quantized payloads are summed as integer codes: their block mask is any(code != 0) per block."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 9, 64, 1000):
        codes = rng.integers(-2, 3, size=n) * (rng.random(n) < 0.05)
        x = torch.from_numpy(codes).to(dtype)
        got = C.nonzero_blocks(x, 8)
        nb = -(-n // 8)
        ref = np.array([np.any(codes[b * 8:(b + 1) * 8] != 0) for b in range(nb)], dtype=bool)
        assert got.dtype == torch.bool and np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_block_facts_are_the_three_scans_in_one(dtype, backend):
    """``block_facts``: whether every element is finite, ``chunk_exponents(x, n)[0]`` and ``nonzero_blocks``,
    as the three functions give them, on block-sparse tensors with a partial last block, ``-0.0``, subnormals,
    huge and tiny magnitudes, NaN and +-Inf, and the empty tensor."""
    from sparsecomm import codec
    from sparsecomm.codec.fixed import _EXP

    rng = np.random.default_rng(7)
    floor = _EXP[dtype][2]
    for case in range(40):
        n = int(rng.integers(0, 3000))
        x = torch.zeros(n, dtype=dtype)
        if n:
            hot = rng.random(-(-n // 64)) < rng.choice([0.0, 0.05, 0.5, 1.0])
            for b in np.flatnonzero(hot):
                x[b * 64:(b + 1) * 64] = torch.from_numpy(rng.standard_normal(len(x[b * 64:(b + 1) * 64])
                                                                              ) * 10.0 ** rng.integers(-40, 40))
            i = int(rng.integers(0, n))
            special = [-0.0, float(torch.finfo(dtype).tiny) / 4, float("nan"), float("inf"), -float("inf"), 3e38,
                       1e-30, 0.0][case % 8]
            x[i] = special
        finite, e, mask = codec.block_facts(x, 64, backend=backend)
        want_finite = bool(torch.isfinite(x).all())
        assert finite == want_finite, case
        if want_finite:
            assert e == (int(codec.chunk_exponents(x, n, backend=backend)[0]) if n else floor), case
        else:
            assert e == floor
        assert torch.equal(mask, codec.nonzero_blocks(x, 64, backend=backend)), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_from_fixed_blocks_is_from_fixed_then_a_scatter(dtype, backend):
    """``from_fixed_blocks``: bit for bit ``from_fixed`` of the rows written at their blocks (a short last block:
    its first values), the other blocks untouched, for int32 sums near the range's ends and random scales."""
    from sparsecomm import codec

    rng = np.random.default_rng(11)
    for case in range(30):
        k = int(rng.choice([64, 256]))
        n = int(rng.integers(1, 40)) * k - int(rng.integers(0, k)) * (case % 2)
        nb = -(-n // k)
        blocks = torch.from_numpy(rng.permutation(nb)[:int(rng.integers(0, nb + 1))].astype(np.int64))
        hi = 2**31 - 1 if case % 3 else 1000
        q = torch.from_numpy(rng.integers(-hi, hi, size=(len(blocks), k), dtype=np.int64).astype(np.int32))
        scale = float(codec.scale_from_exponents(torch.tensor([int(rng.integers(-40, 40))]), 2)[0]) * rng.random()
        out = torch.full((n,), 7.0, dtype=dtype)
        want = out.clone()
        vals = codec.from_fixed(q, scale, dtype=dtype).reshape(q.shape)
        for i, b in enumerate(blocks.tolist()):
            m = min(k, n - b * k)
            want[b * k:b * k + m] = vals[i, :m]
        codec.from_fixed_blocks(q, blocks, scale, out, backend=backend)
        assert torch.equal(out.view(torch.int64 if dtype == torch.float64 else torch.int32),
                           want.view(torch.int64 if dtype == torch.float64 else torch.int32)), case
