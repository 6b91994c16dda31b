"""The SimFabric's modelled times of fixed scenarios, pinned bit for bit.

The simulator's speed may change; what it models may not: each scenario's per-rank modelled time of one
all-reduce (``last_stats.modelled_time_s``, as ``float.hex``) is the value the simulator gave before its
scheduler was made faster. A change to the model itself (the network formulas of
:mod:`sparsecomm.fabric.sim.sim_network`, a protocol's messages) must update these values deliberately, with
the reason in the commit.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc

NUMEL = 1 << 14
BLOCK = 256


def _data(rank: int, density: float) -> torch.Tensor:
    """Normal values per rank; below density 1, the same random fraction of 256-blocks non-zero on every rank."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    if density < 1:
        nb = NUMEL // BLOCK
        keep = torch.zeros(nb, dtype=torch.bool)
        keep[torch.randperm(nb, generator=torch.Generator().manual_seed(7))[: max(1, int(density * nb))]] = True
        x = x * keep.repeat_interleave(BLOCK)
    return x


def _modelled(ctx, name: str, kw: dict, density: float) -> float:
    t = sc.transports.get(name, ctx.fabric, **kw)
    t.allreduce(_data(ctx.rank, density))
    return t.last_stats.modelled_time_s


#: (transport, options, density, workers, each rank's modelled seconds (float.hex)), 100 Gbit/s, 2 us
PINNED = [
    ('ring', {}, 1.0, 4, [
        '0x1.911b641333bc3p-16', '0x1.911b641333bc3p-16', '0x1.911b641333bc3p-16', '0x1.911b641333bc3p-16'
    ]),
    ('ring', {}, 1.0, 16, [
        '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14',
        '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14',
        '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14',
        '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14', '0x1.46cf36d256a6fp-14'
    ]),
    ('omnireduce', {'lanes': 4}, 0.1, 4, [
        '0x1.b0f18557021b7p-17', '0x1.b660672f77599p-17', '0x1.b922d6dba2b55p-17', '0x1.bea7b633f96cdp-17'
    ]),
    ('omnireduce', {'lanes': 4}, 0.1, 16, [
        '0x1.1e24e68ec9c26p-16', '0x1.20e4968af8eefp-16', '0x1.23a44687281b8p-16', '0x1.02165745bc407p-16',
        '0x1.fa514d7927574p-17', '0x1.ffd0ad7185b06p-17', '0x1.02a806b4f204cp-16', '0x1.0567b6b121315p-16',
        '0x1.082766ad505dep-16', '0x1.0ae716a97f8a7p-16', '0x1.0da6c6a5aeb70p-16', '0x1.106676a1dde39p-16',
        '0x1.1326269e0d102p-16', '0x1.15e5d69a3c3cbp-16', '0x1.18a586966b694p-16', '0x1.1b6536929a95dp-16'
    ]),
    ('omnireduce', {'lanes': 4}, 1.0, 4, [
        '0x1.1ddf7e732a1bbp-16', '0x1.1ddf7e732a1bbp-16', '0x1.1ddf7e732a1bbp-16', '0x1.1ddf7e732a1bbp-16'
    ]),
    ('omnireduce', {'lanes': 4}, 1.0, 16, [
        '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16',
        '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16',
        '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16',
        '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16', '0x1.734698709cc5fp-16'
    ]),
    ('omnireduce', {'lanes': 4, 'deployment': 'dedicated'}, 0.1, 4, [
        '0x1.d94e2e6efacb0p-17', '0x1.c8bf9065f6a48p-17', '0x1.ce446fbe4d5c0p-17', '0x1.d3c94f16a4138p-17'
    ]),
    ('omnireduce', {'lanes': 4, 'deployment': 'dedicated'}, 0.1, 16, [
        '0x1.221a834d4ab5cp-16', '0x1.24da334979e25p-16', '0x1.2799e345a90eep-16', '0x1.2a599341d83b7p-16',
        '0x1.027f7b512a4cdp-16', '0x1.03ddf37743cb8p-16', '0x1.069da37372f81p-16', '0x1.095d536fa224ap-16',
        '0x1.0c1d036bd1513p-16', '0x1.0edcb368007dcp-16', '0x1.119c63642faa5p-16', '0x1.145c13605ed6ep-16',
        '0x1.171bc35c8e037p-16', '0x1.19db7358bd300p-16', '0x1.1c9b2354ec5c9p-16', '0x1.1f5ad3511b892p-16'
    ]),
    ('switch', {}, 1.0, 4, [
        '0x1.9120e3732c1b1p-16', '0x1.9120e3732c1b1p-16', '0x1.9120e3732c1b1p-16', '0x1.9120e3732c1b1p-16'
    ]),
    ('switch', {}, 1.0, 16, [
        '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16',
        '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16',
        '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16',
        '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16', '0x1.d4f7acb50053ap-16'
    ]),
    ('sparse-switch', {}, 0.1, 4, [
        '0x1.1c8525d50ae39p-16', '0x1.1c8525d50ae39p-16', '0x1.1c8525d50ae39p-16', '0x1.1c8525d50ae39p-16'
    ]),
    ('sparse-switch', {}, 0.1, 16, [
        '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16',
        '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16',
        '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16',
        '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16', '0x1.605bef16df21ap-16'
    ]),
]


@pytest.mark.parametrize("name, kw, density, n, pinned", PINNED,
                         ids=[f"{c[0]}-d{c[2]}-n{c[3]}-" + "-".join(map(str, c[1].values())) for c in PINNED])
def test_modelled_times_are_pinned(name, kw, density, n, pinned):
    times = sc.launch(functools.partial(_modelled, name=name, kw=kw, density=density), n,
                      network=sc.Network(bandwidth_gbps=100.0, latency_us=2.0))
    assert [t.hex() for t in times] == pinned
