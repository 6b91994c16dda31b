"""The one-pass finiteness check that the methods, compressors and transports share agrees with torch's."""

import pytest
import torch

from sparsecomm.compressors._common import all_finite


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
