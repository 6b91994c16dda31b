"""The ``sparse-switch`` transport on real processes: gloo workers and the switch as a launcher-started rank."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError

from .test_sparse_switch import blocky

pytestmark = pytest.mark.multiprocess


def _jobs(ctx):
    t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=8)
    out = []
    for j, (numel, d) in enumerate(((256 * 30 + 5, 0.2), (256 * 6, 1.0), (1000, 0.0))):
        x = blocky(ctx.rank, numel, d, seed=j)
        out.append((x, t.allreduce(x)))
    f = blocky(ctx.rank, 256 * 12 + 1, 0.3, ints=False)
    out.append((f, t.allreduce(f), t.last_fixed.sums.clone()))
    bad = torch.ones(10)
    if ctx.rank == 0:
        bad[3] = float("nan")
    try:
        t.allreduce(bad)
        err = None
    except NonFiniteError as e:
        err = str(e)
    small = t.allreduce(torch.ones(5))
    return out, err, small, t.config.spec(), (t.last_stats.bytes_sent, t.last_stats.bytes_received)


def test_sparse_switch_over_gloo_exact_sums_and_clean_shutdown():
    res = sc.launch(_jobs, 3, backend="gloo", services=["sparse-switch:elems=256,slots=64"], timeout_s=60)
    for j in range(3):
        exact = sum(r[0][j][0].long() for r in res)
        assert all(torch.equal(r[0][j][1].long(), exact) for r in res)
    fsums = res[0][0][3][2]
    for r in res:
        assert torch.equal(r[0][3][2], fsums) and torch.equal(r[0][3][1], res[0][0][3][1])
        assert r[1] is not None and "NaN" in r[1]
        assert torch.equal(r[2], torch.full((5,), 3.0))
        assert r[3] == "sparse-switch:slots=64,burst=1024"     # the started program, on a real fabric
        # messages as long as their packets (control, look-ahead, one block), not bursts of 1024 rows; the
        # ledger counts what arrived, not the receives' buffers
        assert r[4][0] == r[4][1] and r[4][0] < 3 * (4 + 256) * 4 + 1024, r[4]
