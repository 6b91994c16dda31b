"""Defaults are fast where they run (:mod:`sparsecomm.transports.defaults`): the settings a transport picks
on each kind of fabric, from what the fabric declares (``message_bytes``), and on real processes the
worker's defaults are the running switch's program."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import sparsecomm as sc
from sparsecomm.fabric.base import MESSAGE_BYTES, Fabric
from sparsecomm.transports import defaults
from sparsecomm.transports.switchml.sparse.dataplane import SparseSwitchConfig
from sparsecomm.transports.switchml.dataplane import PACKET_ELEMS, SwitchConfig

MODELLED = SimpleNamespace(message_bytes=None, world_size=4)     # a fabric whose messages are datagrams of a model
REAL = SimpleNamespace(message_bytes=MESSAGE_BYTES, world_size=4)  # a real fabric: 1 MiB amortises a message's cost


def test_the_base_declares_a_real_fabrics_message_size():
    assert Fabric.message_bytes == MESSAGE_BYTES == 1 << 20


def test_the_rule_on_a_modelled_and_a_real_fabric():
    # SimFabric: the paper's program (64-value packets, one per message) and pool
    assert SwitchConfig().on(MODELLED) == SwitchConfig(elems=64, burst=1)
    assert SparseSwitchConfig().on(MODELLED) == SparseSwitchConfig(elems=256, burst=1)
    assert defaults.pool_size(MODELLED, 1, 8192) == 256
    # real fabrics: the largest packet, as many as fill 1 MiB, eight messages of lanes in flight (less the
    # control slot)
    assert SwitchConfig().on(REAL) == SwitchConfig(elems=256, burst=1024)
    assert SparseSwitchConfig().on(REAL) == SparseSwitchConfig(elems=256, burst=1024)
    assert defaults.pool_size(REAL, 1024, 8192) == 8191
    assert defaults.pool_size(REAL, 1024, 16384) == 8 * 1024
    assert defaults.pool_size(REAL, 1024, 1024) == 1023            # never the control slot
    # what a program was started with stays; the rest follows the fabric
    assert SwitchConfig(elems=64).on(REAL) == SwitchConfig(elems=64, burst=4096)
    assert SwitchConfig(burst=8).on(REAL) == SwitchConfig(elems=256, burst=8)
    assert SparseSwitchConfig(elems=64).on(REAL).burst == 1024     # the program's largest burst
    assert defaults.packet_elems(REAL, PACKET_ELEMS) == 256 and defaults.packet_elems(MODELLED, PACKET_ELEMS) == 64


def _settings(ctx):
    sw = sc.transports.get("switch", ctx.fabric)
    sp = sc.transports.get("sparse-switch", ctx.fabric)
    x = torch.arange(3000, dtype=torch.float32) * (ctx.rank + 1)
    ints = torch.arange(3000, dtype=torch.int32) * (ctx.rank + 1)
    y = sw.allreduce(x)
    stats = sw.last_stats
    return ((sw.slot_elems, sw.burst, sw.pool_size), (sp.k, sp.burst, sp.pool_size, sp.config.slots),
            y, sp.allreduce(ints), (stats.bytes_sent, stats.bytes_received), ctx.fabric.message_bytes)


def test_the_simulated_switches_keep_the_papers_settings():
    for got in sc.launch(_settings, 2):
        assert got[0] == (64, 1, 256) and got[1] == (256, 1, 256, 1024) and got[5] is None
        assert torch.allclose(got[2], torch.arange(3000, dtype=torch.float32) * 3)
        assert torch.equal(got[3], torch.arange(3000, dtype=torch.int32) * 3)


@pytest.mark.multiprocess
def test_on_gloo_the_workers_take_the_started_programs_and_the_real_fabrics_defaults():
    """``transport="switch"`` with ``services=["switch"]`` and no keywords is the real fabric's program
    (256-value packets, 1024 to a message, 8191 lanes); a sparse switch started with its own burst gives
    the workers that burst, and their pool follows it (8 messages of 8 packets). A small job's messages
    are as long as its packets, not a burst of 1 MiB each: 3000 values are a control packet and 12 data
    packets of 264 int32 each way, 12 exponent packets as 8-word headers (header-only, in a message of
    their own) and the agreement header, and the ledger counts what arrived, not the receives' 1 MiB
    buffers."""
    res = sc.launch(_settings, 2, backend="gloo", services=["switch", "sparse-switch:burst=8"], timeout_s=60)
    for got in res:
        assert got[0] == (256, 1024, 8191) and got[1] == (256, 8, 64, 1024) and got[5] == MESSAGE_BYTES
        assert torch.allclose(got[2], torch.arange(3000, dtype=torch.float32) * 3)
        assert torch.equal(got[3], torch.arange(3000, dtype=torch.int32) * 3)
        sent, received = got[4]
        least = 13 * 264 * 4 + 12 * 8 * 4
        assert sent == received and least <= sent < least + 2048, got[4]
