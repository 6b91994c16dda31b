"""DGC's local gradient clipping as the paper states it (Lin et al., ICLR 2018, §3.2; arXiv:1712.01887):
the norm threshold scaled by N^(-1/2) for N workers, applied to each worker's gradient *before* it
joins the accumulation (so the accumulated velocity itself is never clipped)."""

from __future__ import annotations

import math

import pytest
import torch

import sparsecomm as sc
from tests._keyed import Worker


def _dgc(n, **kw):
    """One worker of ``n`` (``encode``'s ``world_size``)."""
    return Worker(sc.methods.get("dgc", sample_ratio=1.0, **kw), world_size=n)


@pytest.mark.parametrize("n", [1, 4, 9])
def test_threshold_scales_with_the_inverse_square_root_of_the_worker_count(n):
    m = _dgc(n, ratio=1.0, momentum=0.0, clip_norm=6.0)
    g = torch.full((100,), 1.0)                                  # ||g|| = 10 > 6 / sqrt(n) for every n here
    sent = m.encode(g, 0, torch.Generator().manual_seed(0)).to_dense()
    assert float(sent.norm()) == pytest.approx(6.0 / math.sqrt(n), rel=1e-6)
    assert torch.allclose(sent, g * (6.0 / math.sqrt(n) / 10.0))   # a rescaling: the direction is kept
    small = _dgc(n, ratio=1.0, momentum=0.0, clip_norm=6.0)
    h = torch.full((100,), 0.5 / math.sqrt(n))                   # ||h|| = 5 / sqrt(n) < 6 / sqrt(n): untouched
    assert torch.equal(small.encode(h, 0, torch.Generator().manual_seed(0)).to_dense(), h)


def test_clipping_acts_on_the_gradient_before_the_accumulation():
    """Two steps of ||g|| = 10 with limit 2 / sqrt(4) = 1: each clipped gradient is 0.1 per entry; half
    the entries are sent at step 1, the other half accumulate to 0.2 and are sent at step 2 with norm
    sqrt(50) 0.2 = 1.41 > 1: the accumulation is not clipped, only each new gradient."""
    m = _dgc(4, ratio=0.5, momentum=0.0, clip_norm=2.0)
    g = torch.full((100,), 1.0)
    gen = torch.Generator().manual_seed(0)
    first = m.encode(g, 0, gen).to_dense()
    assert int((first != 0).sum()) == 50 and torch.allclose(first[first != 0], torch.tensor(0.1))
    second = m.encode(g, 0, gen).to_dense()
    left = first == 0
    assert torch.allclose(second[left], torch.tensor(0.2))       # 0.1 held over + 0.1 new, both clipped alone
    assert float(second.norm()) == pytest.approx(math.sqrt(50) * 0.2, rel=1e-5)
