"""The ``sparse-switch`` transport on the netbed: real gloo processes, one per namespace host, the switch
program a process on the forwarding (top-of-rack) namespace, links shaped by tc. Needs root."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc

from .test_sparse_switch import blocky

pytestmark = [pytest.mark.multiprocess, pytest.mark.netbed]


def _jobs(ctx):
    t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=16)
    problems = []
    for j, (numel, d, overlap) in enumerate(((256 * 40 + 7, 0.2, "random"), (256 * 8, 1.0, "random"),
                                              (999, 0.0, "random"), (256 * 24, 0.5, "full"))):
        x = blocky(ctx.rank, numel, d, seed=j, overlap=overlap)
        want = sum(blocky(r, numel, d, seed=j, overlap=overlap).long() for r in range(ctx.world_size))
        y = t.allreduce(x)
        if y.dtype != torch.int32 or not torch.equal(y.long(), want):
            problems.append(f"job {j} ({numel}, d={d}, {overlap}): wrong sum")
    return problems


def test_sparse_switch_exact_on_the_netbed_with_the_switch_on_the_top_of_rack():
    out = sc.launch(_jobs, 3, backend="netbed", network=sc.Network(bandwidth_gbps=1), timeout_s=120,
                    services=["sparse-switch"])
    assert out == [[], [], []]
