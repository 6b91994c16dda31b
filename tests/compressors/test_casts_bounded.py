"""The fp16/bf16 casts' one-pass paths, pinned against the formulas they replace.

The casts decide an underflow from float32 partial sums and a proven bound, falling back to the float64
sums where the bound leaves the call undecided: their values, errors and flags are pinned against the
float64 decision itself (the kernels that computed it alone before), on inputs that flush to zero,
overflow, hold NaN or Inf, lie in the subnormal ranges, or sit at the underflow threshold. The narrow sum
widened and divided in one pass (``widen_divide``, ``none``'s decode of a narrow sum) is pinned against
widening, then torch's division."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError, OverflowError_, UnderflowError

ident = importlib.import_module("sparsecomm.compressors.identity")
kern = importlib.import_module("sparsecomm.compressors._kernels")


def _float64_decision(c, x: torch.Tensor):
    """(bit patterns, outcome) of the cast as decided by the float64 sums alone: the cast kernel with its
    float64 sums, an error where they are not finite, an underflow where ``err > (1 - delta) nrm``."""
    flat = x.reshape(-1).contiguous()
    bf = c.target == torch.bfloat16
    ys = np.empty(flat.numel(), np.int16)
    err, nrm = (ident._cast_bf16 if bf else ident._cast_f16)(flat.numpy(), ys)
    checked = c.underflow != "allow" and flat.numel()
    y = torch.from_numpy(ys).view(c.target)
    try:
        if not math.isfinite(err):
            c._check_range(flat, y)
    except (NonFiniteError, OverflowError_) as exc:
        return ys, type(exc)
    under = bool(checked) and err > (1.0 - c.delta(flat.numel())) * nrm
    if under and c.underflow == "raise":
        return ys, UnderflowError
    return ys, ("underflow" if under else "ok")


def _decision(c, x: torch.Tensor):
    try:
        p = c.compress(x)
    except (NonFiniteError, OverflowError_, UnderflowError) as exc:
        return None, type(exc)
    return p.values.view(torch.int16).numpy().copy(), ("underflow" if p.meta.get("underflow") else "ok")


def _inputs(name: str):
    g = torch.Generator().manual_seed(7)
    tiny = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16).tiny
    big = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16).max
    n = 50_000
    cases = {"empty": torch.zeros(0), "zeros": torch.zeros(n), "neg_zeros": -torch.zeros(9000),
             "one": torch.ones(1), "one_tiny": torch.tensor([1e-30])}
    for s in (1.0, 1e-2, 1e-4, 1e-5, 1e-6, 1e-7, 1e-9, 1e-20, 1e-39, 1e-44):
        cases[f"randn*{s:g}"] = torch.randn(n, generator=g) * s
    # float32 subnormals, values flushed to zero, the narrow type's subnormals and its smallest normals
    cases["f32_subnormal"] = torch.tensor([1e-45, -3e-42, 1.1754942e-38, 2e-40] * 100)
    cases["narrow_subnormal"] = (torch.rand(n, generator=g) * tiny).float()
    cases["flush_mix"] = torch.cat([torch.randn(n, generator=g), torch.full((n,), tiny * 1e-4)])
    cases["ties"] = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -24 * 1.5, 2.0 ** -25, 1.0 + 2.0 ** -8,
                                  1.0 + 3 * 2.0 ** -8])
    # overflow, Inf, NaN (alone and among finite values), just below the overflow threshold
    over = 1e6 if name == "fp16" else torch.finfo(torch.float32).max      # (rounds to Inf in bfloat16)
    cases["overflow"] = torch.cat([torch.randn(1000, generator=g), torch.tensor([over])])
    cases["at_max"] = torch.tensor([big, -big, 1.0])
    cases["inf"] = torch.tensor([1.0, float("inf"), 2.0])
    cases["nan"] = torch.cat([torch.randn(5000, generator=g), torch.tensor([float("nan")])])
    cases["nan_tiny"] = torch.tensor([1e-30, float("nan")])
    if name == "bf16":      # float32 squares overflow (the float32 sums are not finite): the float64 sums decide
        cases["huge"] = torch.randn(n, generator=g) * 1e25
        cases["huge_tiny"] = torch.cat([torch.randn(n, generator=g) * 1e30, torch.full((n,), 1e-39)])
    # around the threshold: normal entries with a growing share of entries that flush to zero
    base = torch.randn(4096, generator=g)
    for k in range(40):
        share = 10.0 ** (-8 + 0.2 * k)
        cases[f"threshold{k}"] = torch.cat([base, torch.full((64,), math.sqrt(share * 4096 / 64) * tiny * 1e-6)])
    # at the threshold itself: m exact normal values v and k values t that flush to zero, so that
    # err / nrm = k t^2 / (m v^2 + k t^2) is the bound 1 - delta times 1 + eps
    bound = 1.0 - sc.compressors.get(name).delta(1)
    v, m, k = (2.0 ** -14, 4096, 8192) if name == "fp16" else (2.0 ** -126, 4096, 8192)
    for eps in (-1e-2, -1e-3, -1e-4, -1e-5, 1e-5, 1e-4, 1e-3, 1e-2):
        r = bound * (1 + eps)
        t = math.sqrt(r * m * v * v / (k * (1 - r)))
        cases[f"edge{eps:g}"] = torch.cat([torch.full((m,), v), torch.full((k,), t)])
    return cases


@pytest.mark.parametrize("mode", ["count", "raise", "allow"])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_decisions_are_the_float64_ones(name, mode):
    if name == "fp16" and not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")
    c = sc.compressors.get(name, underflow=mode)
    seen = set()
    for label, x in _inputs(name).items():
        want_bits, want = _float64_decision(c, x)
        got_bits, got = _decision(c, x)
        assert got == want, (label, got, want)
        if got_bits is not None:
            assert np.array_equal(got_bits, want_bits), label
        seen.add(want if isinstance(want, str) else want.__name__)
    # the cases reach every outcome the mode has
    expect = {"ok", "NonFiniteError", OverflowError_.__name__} | {"count": {"underflow"}, "raise": {"UnderflowError"},
                                                           "allow": set()}[mode]
    assert seen == expect, seen


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_float32_sums_decide_only_as_the_float64_ones_do(name):
    """``_verdict`` says "no underflow" or "underflow" only where the float64 sums say the same, on random
    vectors whose error ratio sweeps across the threshold (the float32 sums' and the float64 sums' rounding
    both at work), and it decides the common case (a gradient of normal values with a tail below the
    range) and the plain underflow (a vector far below the range)."""
    if name == "fp16" and not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")
    quick, exact = ((ident._quick_bf16, ident._cast_bf16) if name == "bf16"
                    else (lambda x, y: ident._quick_f16(x, y, 0), ident._cast_f16))
    c = sc.compressors.get(name)
    bound = 1.0 - c.delta(1)
    tiny = torch.finfo(c.target).tiny
    g = torch.Generator().manual_seed(3)
    said = {False: 0, True: 0, None: 0}
    under = 0
    for k in range(300):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        # a vector whose scale sweeps from mostly below the normal range to mostly within it (bfloat16:
        # from float32's subnormals to where float32 squares are normal)
        lo, hi = (-1, 4) if name == "fp16" else (-8, 40)
        x = torch.randn(n, generator=g) * tiny * float(10.0 ** (lo + torch.rand(1, generator=g) * (hi - lo)))
        xs, ys = x.numpy(), np.empty(n, np.int16)
        e, q = quick(xs, ys)
        err, nrm = exact(xs, ys)
        v = ident._verdict(e, q, n, bound)
        said[v] += 1
        if v is not None:
            assert v == (err > bound * nrm), (k, v, err, nrm, e, q)
        under += err > bound * nrm
    assert said[False] > 50 and under > 10, (said, under)
    # float16: both answers decided, the threshold's neighbourhood aside; bfloat16: an underflow lies among
    # float32's subnormals, whose float32 squares vanish: the float64 sums decide it
    assert (said[True] > 20) if name == "fp16" else (said[None] > 20), said
    # a gradient-like vector: normal values, some below fp16's range; decided without the float64 sums
    x = torch.randn(1 << 16, generator=g) * 1e-3
    e, q = quick(x.numpy(), np.empty(x.numel(), np.int16))
    assert ident._verdict(e, q, x.numel(), bound) is False
    if name == "fp16":     # and one far below it (bfloat16's: float32's subnormals, whose squares vanish)
        x = torch.randn(1 << 16, generator=g) * 1e-6
        e, q = quick(x.numpy(), np.empty(x.numel(), np.int16))
        assert ident._verdict(e, q, x.numel(), bound) is True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["numba", "torch"])
def test_widen_divide_is_widening_then_torch_division_bit_for_bit(dtype, path):
    from sparsecomm.compressors._common import widen_divide

    g = torch.Generator().manual_seed(11)
    info = torch.finfo(dtype)
    # every bit pattern of the narrow dtype (NaNs, Infs, subnormals, exact halves and powers of two included)
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, 0.5, 1.5, 3.0,
                            float("inf"), -float("inf"), float("nan")]).to(dtype)
    rand = (torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-8, 4, (100_000,), generator=g)).to(dtype)
    with sc.kernels.force(path):
        for v in (every, special, rand, rand[1:]):
            for n in (1, 2, 3, 7, 8, 48, 1000, 2 ** 20 + 1, 123456789):
                want = torch.div(torch.empty(v.numel()).copy_(v), n)
                got = widen_divide(v, n, torch.empty(v.numel()))
                # a NaN stays a NaN; its payload is not pinned (torch's own widening gives 0x7FC00000 in its
                # vector loop and 0x7FFFFFFF in its scalar tail, by position)
                nan = torch.isnan(want)
                assert torch.equal(torch.isnan(got), nan), (dtype, n)
                assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan]), (dtype, n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["numba", "torch"])
def test_widen_divide_finite_is_widen_divide_and_says_whether_every_element_was_finite(dtype, path):
    from sparsecomm.compressors._common import widen_divide, widen_divide_finite

    g = torch.Generator().manual_seed(12)
    rand = (torch.randn(50_003, generator=g) * 10.0 ** torch.randint(-6, 3, (50_003,), generator=g)).to(dtype)
    with sc.kernels.force(path):
        for n in (1, 3, 8):
            want = widen_divide(rand, n, torch.empty(rand.numel()))
            got = torch.empty(rand.numel())
            assert widen_divide_finite(rand, n, got) is True
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
            # one NaN or Inf anywhere (the vector loop's body, its tail, the first element) is found
            for pos in (0, 17, 25_000, rand.numel() - 1):
                for bad in (float("nan"), float("inf"), -float("inf")):
                    v = rand.clone()
                    v[pos] = bad
                    got = torch.empty(v.numel())
                    assert widen_divide_finite(v, n, got) is False, (pos, bad)
                    keep = torch.ones(v.numel(), dtype=torch.bool)
                    keep[pos] = False
                    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


def test_decode_finite_is_decode_and_the_aggregates_finiteness_with_or_without_the_folded_pass():
    from sparsecomm.methods.state import MethodState

    g = torch.Generator().manual_seed(6)
    m = sc.methods.get("none", compressor="fp16")
    assert type(m)._decode_finite is not sc.methods.base.Method._decode_finite      # none folds the check

    class Unfolded(type(m)):
        def _decode_finite(self, aggregate, world_size, ms, out):
            return sc.methods.base.Method._decode_finite(self, aggregate, world_size, ms, out)

    plain = Unfolded(compressor="fp16")
    for agg in ((torch.randn(5000, generator=g) * 3).half(), (torch.randn(5000, generator=g) * 3).bfloat16(),
                torch.randn(5000, generator=g)):
        for bad in (None, float("nan"), float("inf")):
            a = agg.clone()
            if bad is not None:
                a[4321] = bad
            want = m.decode(a, 3, MethodState(pending=False), out=torch.empty(5000))[0]
            got, _, ok = m.decode_finite(a, 3, MethodState(pending=False), out=torch.empty(5000))
            assert ok is (bad is None)
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
            # the default (a method that does not fold it): a pass of its own, the same answer
            got2, _, ok2 = plain.decode_finite(a, 3, MethodState(pending=False), out=torch.empty(5000))
            assert ok2 is ok and torch.equal(torch.isnan(got2), torch.isnan(want))
            assert torch.equal(got2[~torch.isnan(got2)], want[~torch.isnan(want)])


def test_none_decodes_a_narrow_sum_as_the_widened_one():
    from sparsecomm.methods.state import MethodState

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=g) * 1e-3
    for name in ("fp16", "bf16"):
        m = sc.methods.get("none", compressor=name)
        assert m.decodes_narrow
        got = []
        for widen in (True, False):
            p, ms = m.encode(x.clone(), MethodState(), None, world_size=3)
            agg = p.values * 3                    # (a sum of three, in the narrow dtype)
            est, _ = m.decode(agg.float() if widen else agg, 3, ms, out=torch.empty(5000))
            got.append(est.view(torch.int32).clone())
        assert torch.equal(got[0], got[1]), name


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("mode", ["count", "allow"])
def test_one_bad_entry_in_a_long_vector_raises_its_named_error(name, path, mode):
    """One NaN, +-Inf or overflowing entry anywhere in a 1M-entry vector (first, last, either side of a
    4096-entry chunk's edge, the middle) raises NonFiniteError / OverflowError_ naming the compressor, on
    the Numba and the torch path and with or without the contraction check (``underflow="allow"`` skips
    its sums, not the range check); the clean vector compresses. Without the check the payload would
    carry NaN or Inf."""
    if name == "fp16" and path == "numba" and not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(11))
    over = 7.0e4 if name == "fp16" else torch.finfo(torch.float32).max    # (bfloat16: rounds up to Inf)
    c = sc.compressors.get(name, underflow=mode)
    with sc.kernels.force(path):
        y = c.decompress(c.compress(x))
        assert bool(torch.isfinite(y).all())
        for pos in (0, 4095, 4096, n // 2, n - 1):
            for bad, err in ((float("nan"), NonFiniteError), (float("inf"), NonFiniteError),
                             (-float("inf"), NonFiniteError), (over, OverflowError_), (-over, OverflowError_)):
                xb = x.clone()
                xb[pos] = bad
                with pytest.raises(err, match=name):
                    c.compress(xb)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_casts_of_any_shape_and_layout_are_the_flat_contiguous_cast(name):
    """A multi-dimensional, a transposed (non-contiguous) and a strided input compress to the bit patterns
    of the same values flattened in row-major order (torch's cast of them), and decompress to the input's
    shape with the widened values."""
    g = torch.Generator().manual_seed(5)
    c = sc.compressors.get(name)
    base = torch.randn(384, 700, generator=g)
    for x in (base, base.t(), base[:, ::3], base.reshape(7, 96, 400)[2:5]):
        p = c.compress(x)
        want = x.reshape(-1).to(c.target)
        assert torch.equal(p.values.view(torch.int16), want.view(torch.int16))
        y = c.decompress(p)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(y.reshape(-1).view(torch.int32), want.to(torch.float32).view(torch.int32))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("path", ["numba", "torch"])
def test_decompress_of_every_bit_pattern_is_torchs_widening(name, path):
    """A flat payload holding every 16-bit pattern (normals, subnormals, both zeros, +-Inf, NaNs) decompresses
    to torch's widening of it bit for bit (a NaN to a NaN: its payload is not pinned), on both paths; a
    payload of another length than its shape's falls back to ``Payload.to_dense``'s answer."""
    target = torch.float16 if name == "fp16" else torch.bfloat16
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    v = bits.view(target)
    want = v.to(torch.float32)
    c = sc.compressors.get(name)
    p = sc.payload.Payload(kind="dense", values=v, shape=torch.Size([v.numel()]), dtype=torch.float32)
    with sc.kernels.force(path):
        got = c.decompress(p)
    assert got.shape == (65536,) and got.dtype == torch.float32
    nan = torch.isnan(want)
    assert int(nan.sum()) == (2046 if name == "fp16" else 254)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    p2 = sc.payload.Payload(kind="dense", values=v[:10], shape=torch.Size([10]), dtype=torch.float32)
    assert torch.equal(c.decompress(p2).view(torch.int32), p2.to_dense().view(torch.int32))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_flat_cast_pair_reshapes_nothing_and_builds_no_device(name):
    """compress + decompress of a flat float32 CPU vector, the DDP buckets' and the benchmark's case, makes
    no ``reshape`` (to a ``torch.Size`` it costs more than casting a few thousand elements), reads no
    ``Tensor.device`` (``is_cpu`` answers without building a ``torch.device``) and makes no ``Tensor.numpy()``
    (the kernels read the memory at ``data_ptr()``): torch calls are the fixed cost of a cast pair, several
    microseconds each. The values are the widened cast's, bit for bit, also for a view at a storage offset."""
    from torch.overrides import TorchFunctionMode

    if name == "fp16" and not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            owner = getattr(func, "__self__", None)
            self.names.append(getattr(owner, "__name__", None) if func.__name__ == "__get__" else func.__name__)
            return func(*args, **(kwargs or {}))

    c = sc.compressors.get(name)
    base = torch.randn(5003, generator=torch.Generator().manual_seed(3))
    for x in (base[:5000], base[3:]):       # (the second at a storage offset: the kernels read data_ptr())
        with Calls() as calls:
            y = c.decompress(c.compress(x))
        assert calls.names, "the counting mode saw no torch call"
        assert "reshape" not in calls.names and "device" not in calls.names, calls.names
        assert "numpy" not in calls.names, calls.names     # (the kernels read the tensors' memory by address)
        assert torch.equal(y.view(torch.int32), x.to(c.target).to(torch.float32).view(torch.int32))


def test_the_flat_fp16_cast_writes_torchs_patterns_at_every_length_and_lane():
    """The flat float32 path of ``fp16`` (one conversion per element, its patterns stored apart from the value
    its error term reads) writes torch's cast bit for bit: float32 patterns around every float16 rounding
    boundary (ties, one below and above, both signs, the subnormal and overflow edges) and random ones, at
    lengths of every remainder modulo the vector body's 16 elements and either side of a 4096-element chunk's
    edge, so the unrolled body, its vector tail and its scalar tail all write; one NaN, Inf or overflowing
    entry at any lane of a short vector raises its error."""
    if not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")
    low = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x3FFFFF, 0x7FE000, 0x7FF000,
                    0x7FFFFF], dtype=np.int64)
    pats = (np.arange(256, dtype=np.int64)[:, None] << 23 | low[None, :]).ravel()
    pats = np.concatenate([pats, np.random.default_rng(9).integers(0, 2 ** 31, 3 * 4096)])
    x = torch.from_numpy(np.concatenate([pats, pats | (1 << 31)]).astype(np.uint32).view(np.float32))
    x = x[torch.isfinite(x) & (x.abs() < 65504.0)]     # (the rest raise: below)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))]
    c = sc.compressors.get("fp16", underflow="allow")
    for n in [*range(1, 40), 4095, 4096, 4097, 4096 + 15, 8192 + 33, x.numel()]:
        for part in (x[:n], x[-n:]):
            p = c.compress(part)
            assert torch.equal(p.values.view(torch.int16), part.to(torch.float16).view(torch.int16)), n
            assert torch.equal(c.decompress(p).view(torch.int32), part.to(torch.float16).float().view(torch.int32))
    c = sc.compressors.get("fp16")
    base = torch.randn(37, generator=torch.Generator().manual_seed(4))
    for pos in range(37):
        for bad, err in ((float("nan"), NonFiniteError), (-float("inf"), NonFiniteError), (7.0e4, OverflowError_)):
            xb = base.clone()
            xb[pos] = bad
            with pytest.raises(err, match="fp16"):
                c.compress(xb)


@pytest.mark.parametrize("mode", ["count", "allow"])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_fused_flat_payload_is_the_generic_paths_in_every_field(name, mode):
    """The flat float32 path builds its payload by position, without ``make_payload`` (its keywords cost a
    third of the constructor's call): every field (kind, shape, dtype, indices, scale, bucket size, shared
    scale, bits, meta, values codec) and every value bit is the one the generic path (``force("torch")``:
    torch's cast, then ``make_payload``) gives, so a field order that moved would show here; the values are
    an owned 16-bit tensor of their own memory (not the input's), read back by ``decompress`` as the
    widened cast."""
    if name == "fp16" and not kern.NATIVE_HALF:
        pytest.skip("no hardware float16 conversion: the fused float16 cast does not run here")
    c = sc.compressors.get(name, underflow=mode)
    for n in (1, 17, 4096, 70001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        got = c.compress(x)
        with sc.kernels.force("torch"):
            want = c.compress(x)
        for field in ("kind", "shape", "dtype", "indices", "scale", "bucket_size", "shared_scale", "bits", "meta",
                      "values_codec"):
            assert getattr(got, field) == getattr(want, field), (n, field, getattr(got, field), getattr(want, field))
        assert type(got.shape) is torch.Size and got.bits == 16 * n and got.meta == {"wire_bits": {"values": 16 * n}}
        assert got.values.dtype == c.target and got.values.shape == (n,) and got.values.is_contiguous()
        assert got.values.data_ptr() != x.data_ptr()
        assert torch.equal(got.values.view(torch.int16), want.values.view(torch.int16)), n
        assert torch.equal(c.decompress(got).view(torch.int32), x.to(c.target).float().view(torch.int32)), n
