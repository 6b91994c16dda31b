"""The one-pass finiteness check that the methods, compressors and transports share agrees with torch's; so do the
checked add and the copy-and-subtract of PowerSGD's error feedback, and the plain average's checked division."""

import pytest
import torch

from sparsecomm.compressors._common import add_finite, all_finite, copy_sub, divide_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (1000,), (33, 31)])
def test_all_finite_is_torchs_isfinite_all(dtype, shape, kernel_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).to(dtype)
    views = [lambda t: t, (lambda t: t.t()) if base.dim() == 2 else (lambda t: t[::2])]   # contiguous, strided
    for view in views:
        assert all_finite(view(base)) is True
        for bad in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, min(1, base.numel() - 1), base.numel() // 2, base.numel() - 1} if base.numel() else ():
                b = base.clone()
                b.view(-1)[pos] = bad
                y = view(b)
                assert all_finite(y) is bool(torch.isfinite(y).all()), (bad, pos)
                if y.is_contiguous() or y.dim() == 2:
                    assert all_finite(y) is False, (bad, pos)


def test_all_finite_reads_a_tensor_that_requires_grad():
    x = torch.ones(10, requires_grad=True)
    assert all_finite(x) is True
    assert all_finite(x * float("inf")) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_add_finite_is_torchs_add_and_isfinite(dtype, inplace, kernel_path):
    """The checked add (PowerSGD's residual, in place or into another buffer) writes torch's sums bit for bit and
    flags a NaN or Inf input, and a sum that overflows."""
    g = torch.Generator().manual_seed(1)
    for n in (0, 1, 7, 1000, 4099):
        x, y = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
        want = torch.add(x, y)
        out = x.clone() if inplace else torch.full((n,), 7.0, dtype=dtype)
        assert add_finite(out if inplace else x, y, out) is True
        assert torch.equal(out, want)
        big = torch.finfo(dtype).max
        for bad in ((float("nan"), 0.0), (float("inf"), 1.0), (big, big)):       # the last: finite, the sum is not
            for pos in {0, n // 2, n - 1} if n else ():
                a, b = x.clone(), y.clone()
                a[pos], b[pos] = bad
                out = a.clone() if inplace else torch.empty(n, dtype=dtype)
                assert add_finite(out if inplace else a, b, out) is False, (bad, pos)
                assert torch.equal(out.isnan(), torch.add(a, b).isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_copy_sub_is_torchs_copy_and_sub(dtype, kernel_path):
    g = torch.Generator().manual_seed(2)
    for n in (0, 1, 7, 1000, 4099):
        x, m = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
        out, diff = torch.empty(n + 3, dtype=dtype)[3:], torch.empty(n, dtype=dtype)   # an unaligned view too
        copy_sub(x, m, out, diff)
        assert torch.equal(out, x) and torch.equal(diff, torch.sub(m, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 1024])
def test_divide_finite_is_torchs_div_and_flags_a_nan_or_inf(dtype, n, kernel_path):
    """The plain average's division (the DDP hook's chained sum): torch's ``div_`` by the worker count bit for bit
    (values across the whole range, subnormal quotients included), in place, and False exactly where an element
    is NaN or Inf."""
    g = torch.Generator().manual_seed(3)
    lo, hi = {torch.float16: (-30, 13), torch.float64: (-1060, 37)}.get(dtype, (-140, 37))   # (down to subnormals)
    for size in (0, 1, 7, 1000, 4099):
        x = (torch.randn(size, generator=g, dtype=torch.float64) * torch.logspace(lo, hi, size, base=2.0,
                                                                                  dtype=torch.float64)).to(dtype)
        got = x.clone()
        assert divide_finite(got, n) is True
        assert torch.equal(got, x.clone().div_(n))
        for bad in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, size // 2, size - 1} if size else ():
                b = x.clone()
                b[pos] = bad
                want = b.clone().div_(n)
                assert divide_finite(b, n) is False, (bad, pos)
                assert torch.equal(b.isnan(), want.isnan()) and torch.equal(b[~b.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 10, 60])
def test_scaling_by_a_power_of_two_is_the_division_bit_for_bit(dtype, k):
    """The plain average's pass at a power-of-two worker count multiplies by ``2**-k`` (``_kernels.scale_finite``):
    the same bits as the division by ``2**k`` on every pattern that matters -- quotients down to and through the
    subnormals, the largest values, signed zeros, infinities and NaNs with payloads -- and the same verdict."""
    import numpy as np

    from sparsecomm.compressors import _kernels

    g = torch.Generator().manual_seed(4)
    lo, hi = (-1074, 1019) if dtype == torch.float64 else (-149, 123)    # (|randn| < 16: finite)
    x = (torch.randn(20_000, generator=g, dtype=torch.float64) * torch.logspace(lo, hi, 20_000, base=2.0,
                                                                              dtype=torch.float64)).to(dtype)
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 2, info.max, -info.max, info.eps],
                            dtype=dtype)
    x = torch.cat([x, specials, torch.arange(1, 64, dtype=dtype) * info.tiny * info.eps])   # subnormal inputs
    ints = torch.int64 if dtype == torch.float64 else torch.int32
    for bad in (None, float("nan"), float("inf"), -float("inf")):
        a, b = x.clone(), x.clone()
        if bad is not None:
            a[5] = b[5] = bad
        want = b.div_(2 ** k)
        assert bool(_kernels.scale_finite(a.numpy(), a.numpy().dtype.type(2.0 ** -k))) is (bad is None)
        assert torch.equal(a.view(ints), want.view(ints)), k
    # a NaN's payload and sign: as the division leaves them (both quiet the same operand)
    nan_bits = torch.tensor([0x7FC00001, 0xFFC12345 - (1 << 32), 0x7F800001], dtype=torch.int32)
    if dtype == torch.float32:
        a, b = nan_bits.clone().view(torch.float32), nan_bits.clone().view(torch.float32)
        _kernels.scale_finite(a.numpy(), np.float32(2.0 ** -k))
        _kernels.div_finite(b.numpy(), np.float32(2.0 ** k))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
