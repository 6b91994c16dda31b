"""Compressor contract: registry, hyper-parameters, shapes/dtypes, wire bits, generators, bad input.

The statistical properties (omega, delta) are in test_compressors_stats.py / _topk.py / _theory.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.compressors import _kernels
from sparsecomm.compressors._common import (CompressorConfigError, CompressorInputError,
                                            GeneratorRequiredError, force_backend)
from sparsecomm.errors import NonFiniteError, OverflowError_, SparseCommError, UnknownNameError
from theory import compressors as th

# every test runs on both kernel paths (Numba, and the torch ops CUDA users run) unless it picks the
# path itself with a `backend` parameter (tests/conftest.py, sparsecomm.kernels)
pytestmark = pytest.mark.usefixtures("kernel_path")

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SHAPES = ((), (0,), (1,), (7,), (3, 4, 5), (2, 0, 3), (1000,))

#: (name, hyper-parameters) covering every registered operator
CASES = [
    ("identity", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"ratio": 0.1}),
    ("topk", {"k": 3}),
    ("randk", {"ratio": 0.1}),
    ("randk", {"k": 3}),
    ("threshold", {"threshold": 0.5}),
    ("qsgd", {"levels": 4}),
    ("qsgd", {"levels": 3, "bucket_size": 16}),
    ("natural", {}),
    ("natural_dithering", {"levels": 3}),
    ("natural_dithering", {"levels": 5, "bucket_size": 16, "p": math.inf}),
    ("terngrad", {}),
    ("terngrad", {"bucket_size": 16}),
    ("sign", {}),
    ("compose", {"first": "randk", "second": "natural", "ratio": 0.2}),
    ("compose", {"first": "qsgd", "second": "natural", "levels": 4}),
    ("induced", {"first": "topk", "second": "randk", "ratio": 0.1}),
    ("induced", {"first": "topk", "second": "natural", "ratio": 0.1}),
]
BACKENDS = ("numba", "torch")


def case_id(case):
    name, kw = case
    return name + "".join(f"-{k}={v}" for k, v in kw.items())


def build(name, kw):
    return sc.compressors.get(name, **kw)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_every_operator_is_registered_and_covered():
    names = set(sc.compressors.available())
    expected = {"identity", "fp16", "bf16", "topk", "randk", "threshold", "qsgd", "natural",
                "natural_dithering", "terngrad", "sign", "compose", "induced"}
    assert expected <= names
    assert names <= {n for n, _ in CASES}, "a registered operator has no test case"


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownNameError) as e:
        sc.compressors.get("top_k", ratio=0.1)
    msg = str(e.value)
    for n in sc.compressors.available():
        assert n in msg


@pytest.mark.parametrize("name,kw,needle", [
    ("topk", {"ratio": 0.0}, "ratio"),
    ("topk", {"ratio": 1.5}, "ratio"),
    ("topk", {"ratio": -0.1}, "ratio"),
    ("topk", {"ratio": float("nan")}, "ratio"),
    ("topk", {"k": 0}, "k"),
    ("topk", {"k": 2.5}, "k"),
    ("topk", {}, "exactly one"),
    ("topk", {"ratio": 0.1, "k": 3}, "exactly one"),
    ("randk", {"ratio": 0}, "ratio"),
    ("randk", {"k": -1}, "k"),
    ("randk", {"k": True}, "k"),
    ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 2.0}, "levels"),
    ("qsgd", {"bucket_size": 0}, "bucket_size"),
    ("natural_dithering", {"levels": 0}, "levels"),
    ("natural_dithering", {"levels": 64}, "levels"),
    ("natural_dithering", {"p": 1}, "p="),
    ("terngrad", {"bucket_size": -3}, "bucket_size"),
    ("threshold", {"threshold": -1.0}, "threshold"),
    ("threshold", {"threshold": math.inf}, "threshold"),
    ("threshold", {}, "threshold"),
    ("compose", {"first": "topk", "second": "natural", "ratio": 0.1}, "unbiased"),
    ("compose", {"first": "randk", "second": "natural", "ratio": 0.1, "levels": 3}, "levels"),
    ("induced", {"first": "randk", "second": "natural", "ratio": 0.1}, "contractive"),
    ("induced", {"first": "topk", "second": "sign", "ratio": 0.1}, "unbiased"),
    ("induced", {"first": "threshold", "second": "natural", "threshold": 1.0}, "contractive"),
])
def test_bad_hyper_parameters_raise_clearly(name, kw, needle):
    with pytest.raises(CompressorConfigError) as e:
        build(name, kw)
    assert needle in str(e.value)
    assert isinstance(e.value, SparseCommError) and isinstance(e.value, ValueError)


def test_unexpected_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        sc.compressors.get("natural", ratio=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_roundtrip_shape_dtype_bits(case, backend):
    name, kw = case
    c = build(name, kw)
    g = gen(1)
    with force_backend(backend):
        for dtype in DTYPES:
            for shape in SHAPES:
                x = torch.randn(shape, generator=gen(2), dtype=torch.float64).to(dtype)
                p = c.compress(x, g)
                y = c.decompress(p)
                assert y.shape == x.shape and y.dtype == x.dtype, (dtype, shape)
                assert bool(torch.isfinite(y).all())
                assert p.kind == c.payload_kind
                assert p.shape == x.shape and p.dtype == x.dtype
                d = x.numel()
                wire = p.meta["wire_bits"]
                assert p.bits == sum(wire.values())
                if name == "threshold":
                    assert p.bits <= c.bits(d, dtype)
                else:
                    assert p.bits == c.bits(d, dtype), (dtype, shape, p.bits, c.bits(d, dtype))
                check_wire_encoding(c, p, d, dtype)


def check_wire_encoding(c, p, d, dtype):
    """Each wire role's bits follow the documented encoding from the payload's tensor sizes, the
    values fit that encoding, and no encoding is wider than the tensor that holds it in memory."""
    wire = p.meta["wire_bits"]
    name = c.name
    mem = {"values": p.values, "indices": p.indices, "scale": p.scale}
    for role, b in wire.items():
        t = mem[role]
        if role == "indices" and p.kind == "aligned":
            assert b == 0  # regenerated from the shared seed
            continue
        if name != "induced":  # a dense induced payload holds C1 + C2 summed; the wire sends both parts
            assert b <= 8 * t.element_size() * t.numel(), role
    if p.indices is not None:
        assert p.indices.dtype == torch.int64
    if p.kind in ("sparse", "aligned") and name not in ("induced",):
        idx = p.indices
        assert bool((idx[1:] > idx[:-1]).all()), "indices strictly increasing"
        assert idx.numel() == 0 or (0 <= int(idx.min()) and int(idx.max()) < d)
    n_val = p.values.numel()
    if name == "identity":
        assert wire == {"values": n_val * torch.finfo(dtype).bits}
    elif name in ("fp16", "bf16"):
        assert p.values.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        assert wire == {"values": 16 * n_val}
    elif name in ("topk", "threshold"):
        assert wire == {"values": n_val * torch.finfo(dtype).bits, "indices": th.index_bits(d, n_val)}
    elif name == "randk":
        assert wire == {"values": n_val * torch.finfo(dtype).bits}
        assert n_val == c.size(d)
    elif name == "natural":
        ebits = {torch.float32: 8, torch.bfloat16: 8, torch.float16: 6, torch.float64: 11}[dtype]
        assert wire == {"values": n_val * (1 + ebits)}
        assert_signed_powers_of_two(p.values, dtype)
    elif p.kind == "quantized" and name in ("qsgd", "natural_dithering", "terngrad", "sign"):
        codes = p.values
        assert not codes.dtype.is_floating_point
        nb = th.n_buckets(d, c.bucket_size) if name != "sign" else (1 if d else 0)
        assert p.scale.numel() == nb
        sbits = 64 if dtype == torch.float64 else 32
        code_bits = {"qsgd": th.qsgd_code_bits(getattr(c, "levels", 1)),
                     "natural_dithering": th.qsgd_code_bits(getattr(c, "levels", 1)),
                     "terngrad": 2, "sign": 1}[name]
        assert wire == {"values": code_bits * codes.numel(), "scale": sbits * nb}
        a = codes.abs().to(torch.int64)
        if name == "qsgd":
            assert a.numel() == 0 or int(a.max()) <= c.levels
        elif name == "natural_dithering":
            ok = (a == 0) | ((a & (a - 1)) == 0)
            assert bool(ok.all()) and (a.numel() == 0 or int(a.max()) <= 2 ** (c.levels - 1))
        elif name == "terngrad":
            assert a.numel() == 0 or int(a.max()) <= 1
        else:
            assert bool((a == 1).all())


def assert_signed_powers_of_two(v, dtype):
    w = v.to(torch.float64)
    nz = w[w != 0].abs()
    if nz.numel():
        m, _ = torch.frexp(nz)
        assert bool((m == 0.5).all()), "natural values must be powers of two"
        lo = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -24, torch.float64: -1022}[dtype]
        assert float(nz.min()) >= 2.0**lo


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_zero_input_gives_zero_without_nan(case):
    c = build(*case)
    for dtype in DTYPES:
        x = torch.zeros(4, 25, dtype=dtype)
        y = c.decompress(c.compress(x, gen()))
        assert torch.equal(y, torch.zeros_like(x))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_payload_never_aliases_the_input(case):
    c = build(*case)
    x = torch.randn(64, dtype=torch.float64, generator=gen(3))
    p = c.compress(x, gen())
    before = c.decompress(p).clone()
    x.mul_(7.0)
    assert torch.equal(c.decompress(p), before)


def test_noncontiguous_and_requires_grad_inputs():
    x = torch.randn(8, 6, dtype=torch.float64, generator=gen(4)).t().requires_grad_(True)
    for name, kw in CASES:
        c = build(name, kw)
        y = c.decompress(c.compress(x, gen()))
        assert y.shape == x.shape and not y.requires_grad


# ----------------------------------------------------------------------------------- randomness
RANDOM = [case for case in CASES if build(*case).unbiased and case[0] != "identity"]


@pytest.mark.parametrize("case", RANDOM, ids=case_id)
def test_random_operator_without_generator_raises(case):
    c = build(*case)
    with pytest.raises(GeneratorRequiredError, match="generator"):
        c.compress(torch.randn(50), None)


def _generators_held(obj, seen=None) -> list:
    """The torch.Generators reachable from ``obj``'s attributes (dicts, lists and parts included)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Generator):
        return [obj]
    if isinstance(obj, dict):
        vals = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        vals = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        vals = list(vars(obj).values())
    else:
        return []
    return [g for v in vals for g in _generators_held(v, seen)]


@pytest.mark.parametrize("case", RANDOM, ids=case_id)
def test_random_operator_holds_no_generator(case):
    """A compressor is stateless: ``seed=`` is none of its hyper-parameters and it keeps no generator of
    its own (nothing of it belongs in a checkpoint); the caller's generator is the only randomness, so
    the same generator state gives the same output and successive draws of one generator differ."""
    name, kw = case
    with pytest.raises((TypeError, ValueError), match="seed"):
        build(name, {**kw, "seed": 7})
    c = build(name, kw)
    x = torch.randn(200, dtype=torch.float64, generator=gen(5))
    g = gen(7)
    y1, y2 = c.decompress(c.compress(x, g)), c.decompress(c.compress(x, g))
    assert torch.equal(y1, c.decompress(c.compress(x, gen(7)))) and not torch.equal(y1, y2)
    assert _generators_held(c) == []


def test_the_counter_stream_steps_by_the_codec_gamma():
    """The bucketed kernels offset the counter-based stream by ``lo * GAMMA``, which must be the step of
    ``codec._fixedkernels.counter_bits``: then bucket j's element t draws element ``lo + t``'s bits."""
    key = np.uint64(0x1234_5678_9ABC_DEF0)
    with np.errstate(over="ignore"):                    # uint64 arithmetic wraps, as in the kernels
        for lo, t in ((0, 0), (5, 3), (4096, 17), (123_457, 999)):
            assert _kernels._bits(key + np.uint64(lo) * _kernels.GAMMA, t) == _kernels._bits(key, lo + t)
        assert _kernels._bits(key + np.uint64(5) * (_kernels.GAMMA + np.uint64(2)), 3) != _kernels._bits(key, 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", RANDOM, ids=case_id)
def test_randomness_only_from_the_generator(case, backend):
    c = build(*case)
    x = torch.randn(300, dtype=torch.float64, generator=gen(6))
    torch.manual_seed(123)
    np.random.seed(123)
    t_state, n_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    with force_backend(backend):
        y1 = c.decompress(c.compress(x, gen(9)))
        y2 = c.decompress(c.compress(x, gen(9)))
    assert torch.equal(y1, y2), "same generator state, same output"
    assert torch.equal(torch.get_rng_state(), t_state), "global torch RNG touched"
    assert np.array_equal(np.random.get_state()[1], n_state), "global numpy RNG touched"


def test_generator_on_wrong_device_or_wrong_type():
    c = sc.compressors.get("natural")
    with pytest.raises(CompressorInputError, match="torch.Generator"):
        c.compress(torch.randn(5), np.random.default_rng(0))


def test_randk_shared_seed_gives_the_same_coordinates_on_every_worker():
    c = sc.compressors.get("randk", ratio=0.05)
    assert c.shared_randomness and c.payload_kind == "aligned"
    xs = [torch.randn(10_000, generator=gen(10 + r)) for r in range(4)]
    ps = [c.compress(x, gen(42)) for x in xs]
    for p in ps[1:]:
        assert torch.equal(p.indices, ps[0].indices)
    # the aligned sum is the element-wise sum of the value vectors
    total = sum(p.to_dense() for p in ps)
    compact = torch.zeros(10_000).index_add_(0, ps[0].indices, sum(p.values for p in ps))
    assert torch.allclose(total, compact)
    assert not torch.equal(c.compress(xs[0], gen(43)).indices, ps[0].indices)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,k", [(10, 1), (10, 5), (10, 6), (10, 10), (64, 63), (65, 64), (1000, 999),
                                 (100_000, 37)])
def test_randk_subsets_are_distinct_and_sized(d, k, backend):
    c = sc.compressors.get("randk", k=k)
    with force_backend(backend):
        p = c.compress(torch.ones(d), gen(d + k))
    assert p.indices.numel() == k and torch.unique(p.indices).numel() == k
    assert torch.allclose(p.values, torch.full((k,), d / k))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [2, 3])
def test_randk_subset_is_uniform_on_a_small_universe(k, backend):
    """All C(5,k) = 10 subsets of rand-k-of-5 appear with frequency 1/10 (k = 3 takes the
    complement path): chi-square with 9 degrees of freedom; 40 is beyond its 1 - 1e-5 quantile
    (about 37.3)."""
    c = sc.compressors.get("randk", k=k)
    g = gen(11)
    counts: dict[tuple, int] = {}
    n = 5000
    with force_backend(backend):
        for _ in range(n):
            key = tuple(c.compress(torch.ones(5), g).indices.tolist())
            counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 10
    chi2 = sum((v - n / 10) ** 2 / (n / 10) for v in counts.values())
    assert chi2 < 40, counts


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_non_finite_input_raises(case, backend):
    name, kw = case
    if name == "randk":
        kw = {"ratio": 1.0}  # a NaN that is not selected does not travel
    if name == "compose" and kw.get("first") == "randk":
        kw = {**kw, "ratio": 1.0}
    c = build(name, kw)
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(40, dtype=torch.float32, generator=gen(12))
        x[17] = bad
        with force_backend(backend), pytest.raises(NonFiniteError):
            c.compress(x, gen())


def test_integer_input_is_rejected():
    for name, kw in CASES:
        with pytest.raises(CompressorInputError, match="float"):
            build(name, kw).compress(torch.arange(10), gen())


@pytest.mark.parametrize("backend", BACKENDS)
def test_natural_top_binade_raises_overflow(backend):
    c = sc.compressors.get("natural")
    cases = [(torch.float32, 2.0**127 * 1.5), (torch.float16, 40000.0), (torch.float64, 2.0**1023 * 1.1),
             (torch.bfloat16, 2.0**127)]
    with force_backend(backend):
        for dtype, big in cases:
            x = torch.tensor([1.0, big], dtype=dtype)
            with pytest.raises(OverflowError_):
                c.compress(x, gen())
        # just below the limit is fine (float16: 2^15 - 32 rounds to 2^14 or 2^15)
        y = c.decompress(c.compress(torch.tensor([32736.0], dtype=torch.float16), gen()))
        assert float(y) in (16384.0, 32768.0)


def test_casts_raise_on_overflow():
    with pytest.raises(OverflowError_, match="float16"):
        sc.compressors.get("fp16").compress(torch.tensor([1.0, 1e6]))
    with pytest.raises(OverflowError_):
        sc.compressors.get("bf16").compress(torch.tensor([1.0, 1e300], dtype=torch.float64))


# --------------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_declared_constants_are_consistent(case):
    c = build(*case)
    for d in (1, 10, 100, 12345):
        if c.unbiased:
            assert 0 <= c.omega(d) < math.inf
        else:
            assert c.omega(d) == math.inf
            assert 0 <= c.delta(d) <= 1
        assert c.bits(d) > 0
    assert repr(c).startswith(type(c).__name__)


def test_declared_values_come_from_theory():
    d = 100
    assert sc.compressors.get("randk", k=10).omega(d) == th.randk_omega(d, 10) == 9
    assert sc.compressors.get("qsgd", levels=4).omega(d) == th.qsgd_omega(d, 4) == 2.5
    assert sc.compressors.get("qsgd", levels=4, bucket_size=16).omega(d) == th.qsgd_omega(16, 4)
    assert sc.compressors.get("natural").omega(d) == 0.125
    assert sc.compressors.get("terngrad").omega(d) == th.terngrad_omega(d) == 4.5
    assert sc.compressors.get("topk", k=10).delta(d) == th.topk_delta(d, 10) == 0.1
    assert sc.compressors.get("sign").delta(d) == th.sign_delta(d) == 0.01
    comp = sc.compressors.get("compose", first="randk", second="natural", k=10)
    assert comp.omega(d) == pytest.approx(10.25)
    ind = sc.compressors.get("induced", first="topk", second="randk", k=10)
    assert ind.omega(d) == pytest.approx(8.1)
    assert sc.compressors.get("natural").bits(d) == 900
    assert sc.compressors.get("randk", k=10).bits(d) == 320
    assert sc.compressors.get("topk", k=10).bits(d) == 320 + 100  # bitmap beats 10 x 32-bit indices
    assert sc.compressors.get("topk", k=10).bits(10**6) == 320 + 320


def test_kernel_status_codes_are_distinct():
    assert len({_kernels.OK, _kernels.NONFINITE, _kernels.TOO_LARGE}) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_randk_large_k_path_is_sized_and_spread_evenly(backend):
    """k = 70 000 of d = 2e6 (torch: exercises the recursive excess drop); the counts in 10 equal
    ranges are hypergeometric with sd < sqrt(7000), so each lies within 7000 +- 6 sd."""
    d, k = 2_000_000, 70_000
    with force_backend(backend):
        p = sc.compressors.get("randk", k=k).compress(torch.ones(d), gen(77))
    idx = p.indices
    assert idx.numel() == k and torch.unique(idx).numel() == k
    counts = torch.bincount(idx // (d // 10), minlength=10)
    assert bool(((counts - k / 10).abs() <= 6 * math.sqrt(k / 10)).all()), counts


# ------------------------------------------------------------------ the two kernel paths agree
def _payload_equal(a, b) -> bool:
    """Kind, wire bits, values and indices bit for bit; a scale (a reduction over the bucket, summed in a
    different order by the two paths) within its rounding error, n ulp for a sum of n terms."""
    same = (a.kind == b.kind and a.bits == b.bits and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.values, b.values))
    u, v = a.indices, b.indices
    same = same and ((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v)))
    u, v = a.scale, b.scale
    if u is None or v is None:
        return same and u is None and v is None
    n = max(1, a.values.numel())
    return same and u.dtype == v.dtype and torch.allclose(u, v, rtol=n * torch.finfo(u.dtype).eps, atol=0)


@pytest.mark.kernel_paths("numba")                      # switches between the paths itself
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paths_agree_bit_for_bit_for_deterministic_operators(case):
    """sparsecomm.kernels' contract: a deterministic operator gives the same payload on the Numba and the
    torch path (bit for bit but for a scale that is a sum: the sign operator's l1 norm); a random operator gives a valid payload of the same kind, size and wire
    bits on both (its values agree in distribution only: the statistical tests of
    test_compressors_stats.py and the rand-k uniformity test run on both paths)."""
    name, kw = case
    c = build(name, kw)
    rand = c.unbiased and name != "identity"
    for dtype in DTYPES:
        for n in (1, 37, 1000):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 3).to(dtype)
            out = {}
            for path in ("numba", "torch"):
                with force_backend(path):
                    out[path] = c.compress(x, torch.Generator().manual_seed(7))
                    dec = c.decompress(out[path])
                    assert dec.shape == x.shape and dec.dtype == x.dtype
            a, b = out["numba"], out["torch"]
            if rand:
                assert (a.kind, a.bits, a.values.shape, a.dtype) == (b.kind, b.bits, b.values.shape, b.dtype)
            else:
                assert _payload_equal(a, b), (name, kw, dtype, n)
                if a.scale is None:
                    assert torch.equal(c.decompress(a), c.decompress(b))


@pytest.mark.kernel_paths("numba")                      # switches between the paths itself
def test_kernel_path_switch_routes_auto_dispatch():
    """sparsecomm.kernels.force("torch") sends the codec's and the operators' "auto" dispatch to torch
    (an explicit backend= still wins); SPARSECOMM_KERNELS sets it for a process; bad names raise."""
    from sparsecomm import kernels
    from sparsecomm.codec import _common as codec_common
    from sparsecomm.compressors import _common as comp_common

    t = torch.zeros(8)
    outer = kernels.forced()                                # "numba": this test's kernel_path fixture
    assert codec_common.use_numba("auto", True, t) and comp_common.use_numba(t)
    with kernels.force("torch"):
        assert kernels.forced() == "torch"
        assert not codec_common.use_numba("auto", True, t) and not comp_common.use_numba(t)
        assert codec_common.use_numba("numba", True, t)
        with force_backend("numba"):
            assert comp_common.use_numba(t)
    assert kernels.forced() == outer == "numba" and sc.kernels is kernels
    with pytest.raises(kernels.KernelPathError, match="auto, numba, torch"):
        with kernels.force("cuda"):
            pass
    # the environment variable is read when the module is (re)loaded
    import importlib
    import os

    before = os.environ.get("SPARSECOMM_KERNELS")
    try:
        os.environ["SPARSECOMM_KERNELS"] = "torch"
        assert importlib.reload(kernels).forced() == "torch" and not comp_common.use_numba(t)
        os.environ["SPARSECOMM_KERNELS"] = "gpu"
        with pytest.raises(SparseCommError, match="auto, numba, torch"):
            importlib.reload(kernels)
    finally:
        if before is None:
            os.environ.pop("SPARSECOMM_KERNELS", None)
        else:
            os.environ["SPARSECOMM_KERNELS"] = before
        importlib.reload(kernels)
        kernels._forced = outer            # the fixture's setting, which its exit restores from


def _same_bits(a, b):
    """Equal values, dtypes and signs of zero."""
    return a.dtype == b.dtype and torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.kernel_paths("numba")
def test_decompress_kernels_are_to_dense_bit_for_bit():
    """Compressor.decompress writes CPU dense, quantized and sparse payloads of float32/float64 into a
    numpy-allocated buffer, by one Numba pass for the last two (compressors._common.decompressed): the
    same bits as Payload.to_dense (the codes' exact conversion times the bucket's scale, rounded once;
    index_add_ onto zeros, so a -0.0 value gives +0.0; torch's cast of float16/bfloat16 values),
    including a short last bucket, int16 and int32 codes, and a malformed payload left to to_dense
    (which raises)."""
    from sparsecomm.compressors._common import decompressed
    from sparsecomm.payload import Payload

    g = torch.Generator().manual_seed(3)
    cases = []
    for dt in (torch.float32, torch.float64):
        for cdt, hi in ((torch.int8, 127), (torch.int16, 30000), (torch.int32, 2**30)):
            codes = torch.randint(-hi, hi + 1, (1003,), generator=g, dtype=torch.int64).to(cdt)
            for bs in (1003, 16, 1):
                scale = torch.randn(-(-1003 // bs), generator=g, dtype=torch.float64).to(dt) * 1e-3
                scale[0] = -0.0
                cases.append(Payload("quantized", codes, (17, 59), dt, scale=scale, bucket_size=bs))
        idx = torch.randperm(5000, generator=g)[:300].sort().values
        vals = torch.randn(300, generator=g, dtype=dt)
        vals[:3] = torch.tensor([-0.0, 0.0, -1e-30], dtype=dt)
        cases.append(Payload("sparse", vals, (5000,), dt, indices=idx))
        for narrow in (torch.float16, torch.bfloat16):
            cases.append(Payload("dense", (vals * 1e3).to(narrow), (300,), dt))
    for p in cases:
        assert _same_bits(decompressed(p), p.to_dense()), (p.kind, p.dtype, p.values.dtype, p.bucket_size)
    same = Payload("dense", vals, (300,), torch.float64)
    assert decompressed(same).data_ptr() == vals.data_ptr()         # as to_dense: no copy, no cast
    bad = Payload("sparse", torch.ones(2), (10,), torch.float32, indices=torch.tensor([3, 10]))
    with pytest.raises(IndexError):
        decompressed(bad)
    short = Payload("quantized", torch.ones(10, dtype=torch.int8), (10,), torch.float32,
                    scale=torch.ones(2), bucket_size=4)          # 3 buckets, 2 scales
    with pytest.raises(IndexError):
        decompressed(short)
