"""OmniReduce's default channels per aggregator (:meth:`OmniReduce.channels_for`): 2 on a modelled network and
with dedicated aggregators; colocated on a fabric whose messages want to be long (a SimFabric whose host model
charges per message declares a real fabric's ``message_bytes``, as gloo does), 1 where each aggregator's range
fits in one round, else 2. The sums do not depend on the channels: bit for bit the same as with 2."""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
from sparsecomm.fabric.sim.sim_host import HostModel
from sparsecomm.transports.omnireduce import CHANNELS


def _x(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))


def _run(ctx, numel: int, kw: dict):
    t = sc.transports.get("omnireduce", ctx.fabric, **kw)
    y = t.allreduce(_x(ctx.rank, numel))
    return t.channels_for(numel), y, ctx.fabric.message_bytes


REAL = sc.Network(host=HostModel(send_message_s=1e-5, recv_message_s=1e-5))


@pytest.mark.parametrize("numel, lanes, want", [
    (4096, 16384, 1),           # 16 blocks per aggregator: one round
    (4096, 8, CHANNELS),        # 16 blocks per aggregator over 8 lanes: two rounds in one channel
    (4096, 16, 1),              # exactly the lanes: one round
    (4097, 16, CHANNELS),       # one more block on the first aggregator's range
])
def test_colocated_on_a_real_fabric_one_channel_where_one_round_holds_the_range(numel, lanes, want):
    kw = {"lanes": lanes, "block_size": 128}
    got = sc.launch(functools.partial(_run, numel=numel, kw=kw), 2, backend="sim", network=REAL)
    assert {r[2] for r in got} == {1 << 20}      # the host model makes the SimFabric declare a real fabric's
    assert [r[0] for r in got] == [want, want]
    ref = sc.launch(functools.partial(_run, numel=numel, kw={**kw, "channels": 2}), 2, backend="sim", network=REAL)
    for (_, y, _), (_, yr, _) in zip(got, ref):
        assert torch.equal(y, yr)                # the same sums, bit for bit


def test_modelled_network_dedicated_and_explicit_keep_their_channels():
    got = sc.launch(functools.partial(_run, numel=4096, kw={"block_size": 128}), 2, backend="sim")
    assert [r[0] for r in got] == [CHANNELS, CHANNELS] and got[0][2] is None
    got = sc.launch(functools.partial(_run, numel=4096, kw={"block_size": 128, "deployment": "dedicated"}), 2,
                    backend="sim", network=REAL)
    assert [r[0] for r in got] == [CHANNELS, CHANNELS]
    got = sc.launch(functools.partial(_run, numel=4096, kw={"block_size": 128, "channels": 3}), 2,
                    backend="sim", network=REAL)
    assert [r[0] for r in got] == [3, 3]
