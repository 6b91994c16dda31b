"""Every byte a transport puts on the wire is determined by its inputs: none is left unwritten.

A message built in a buffer taken from a pool (``torch.empty``: whatever the allocator handed back) and
sent with some bytes never written -- the padding between a fused message's blocks and its int32 tail, the
bytes of a lane bitmap's last word past the bitmap -- leaks the process's memory to a peer and makes the
wire differ from run to run (a receiver that ignores those bytes computes the same numbers; a checker that
compares wires, or hashes a message, sees noise).

The check: run the same calls twice on SimFabric with every fresh ``torch.empty``/``torch.empty_like``/
``numpy.empty`` buffer filled with a different poison byte (``0xA5``, then ``0x5A``), log every message each
rank sends (destination, tag, its bytes at the send), and require the two logs to be identical. Each
transport object runs its calls twice, so pooled buffers are also reused (a smaller message in a buffer a
larger one grew).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.fabric.sim.sim import SimFabric

NET = sc.Network(bandwidth_gbps=100, latency_us=2)

_torch_empty, _torch_empty_like, _np_empty = torch.empty, torch.empty_like, np.empty


def _poisoned(byte: int):
    """``torch.empty``, ``torch.empty_like`` and ``numpy.empty`` whose fresh memory holds ``byte`` everywhere."""

    def fill_t(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype != torch.bool and t.numel() \
                and t.is_contiguous():
            t.reshape(-1).view(torch.uint8).fill_(byte)
        return t

    def empty(*a, **k):
        return fill_t(_torch_empty(*a, **k))

    def empty_like(*a, **k):
        return fill_t(_torch_empty_like(*a, **k))

    def np_empty(*a, **k):
        out = _np_empty(*a, **k)
        if out.dtype != bool and out.size and out.flags.c_contiguous and out.dtype.kind in "biufc":
            out.reshape(-1).view(np.uint8).fill(byte)
        return out

    return empty, empty_like, np_empty


def _x(rank: int, numel: int, bs: int, density: float, case: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers in a random subset of blocks (partly shared across ranks): exact sums in any dtype."""
    nb = -(-numel // bs) if numel else 0
    shared = np.random.default_rng([case, 1000]).random(nb) < density / 2
    own = np.random.default_rng([case, rank]).random(nb) < density / 2
    mask = np.ones(nb, dtype=bool) if density >= 1.0 else shared | own
    m = torch.from_numpy(mask).repeat_interleave(bs)[:numel]
    g = torch.Generator().manual_seed(case * 1000 + rank)
    vals = torch.randint(1, 4, (numel,), generator=g) * (2 * torch.randint(0, 2, (numel,), generator=g) - 1)
    return torch.where(m, vals.to(dtype), torch.zeros((), dtype=dtype))


#: omnireduce cases: numel, block_size, density, lanes, channels, dtype. Odd block sizes of 1- and 2-byte
#: elements leave a block run that is not a multiple of 4 bytes (padding before the int32 tail); few lanes
#: make many rounds; lanes >= blocks make one-round channels whose lane words are a bitmap.
OMNI_CASES = [
    (2_000, 16, 0.3, 4, 2, torch.float32),         # many rounds
    (5_000, 256, 0.5, 1024, 2, torch.float32),     # one round, lane bitmaps of < 32 bits
    (6_005, 64, 0.2, 4096, 3, torch.float32),      # one round, short last block
    (3_001, 7, 0.4, 5, 2, torch.float16),          # 14-byte blocks: odd counts leave 2 bytes of padding
    (2_003, 5, 0.5, 3, 2, torch.int8),             # 5-byte blocks
    (4_000, 9, 0.3, 600, 1, torch.bfloat16),       # one round, odd blocks of 2-byte elements
]


def _omni(ctx, deployment: str, inplace: bool):
    for i, (numel, bs, d, lanes, ch, dtype) in enumerate(OMNI_CASES):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment=deployment, inplace=inplace)
        for k in range(2):
            t.allreduce(_x(ctx.rank, numel, bs, d, 10 * i + k, dtype))


def _other(ctx, name: str, dtype: torch.dtype, density: float):
    t = sc.transports.get(name, ctx.fabric)
    for k, numel in enumerate((5_003, 1_001)):     # a smaller second call in the same pooled buffers
        t.allreduce(_x(ctx.rank, numel, 64, density, k, dtype))


def _wire_log(fn, n: int, byte: int, monkeypatch) -> dict:
    """``fn`` on ``n`` SimFabric ranks with fresh memory poisoned with ``byte``: ``{(src, dst, tag): [bytes of
    each message, in send order]}``."""
    log: dict = {}
    lock = threading.Lock()
    orig = SimFabric.isend_each

    def isend_each(self, tensor, dsts, tag, works, reliable=True, stable=False):
        # (every send of the SimFabric, SimFabric.isend's one endpoint included, is an isend_each)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        with lock:
            for dst in dsts:
                log.setdefault((self.rank, dst, tag), []).append(data)
        return orig(self, tensor, dsts, tag, works, reliable, stable)

    empty, empty_like, np_empty = _poisoned(byte)
    with monkeypatch.context() as m:
        m.setattr(SimFabric, "isend_each", isend_each)
        m.setattr(torch, "empty", empty)
        m.setattr(torch, "empty_like", empty_like)
        m.setattr(np, "empty", np_empty)
        sc.launch(fn, n, network=NET)
    return log


def _undetermined(fn, n: int, monkeypatch) -> list:
    """The messages whose bytes differ between a run over ``0xA5``-poisoned and one over ``0x5A``-poisoned fresh
    memory: ``(src, dst, tag, index, nbytes, first differing offset)``."""
    a, b = (_wire_log(fn, n, byte, monkeypatch) for byte in (0xA5, 0x5A))
    assert a.keys() == b.keys() and a, "the two runs sent on different streams"
    bad = []
    for key in sorted(a):
        assert [len(m) for m in a[key]] == [len(m) for m in b[key]], f"stream {key}: different messages"
        for j, (ma, mb) in enumerate(zip(a[key], b[key])):
            if ma != mb:
                off = next(o for o, (p, q) in enumerate(zip(ma, mb)) if p != q)
                bad.append((*key, j, len(ma), off))
    return bad


@pytest.mark.parametrize("deployment, n", [("colocated", 3), ("dedicated", 2)])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_omnireduce_sends_no_unwritten_byte(deployment, n, inplace, monkeypatch):
    bad = _undetermined(functools.partial(_omni, deployment=deployment, inplace=inplace), n, monkeypatch)
    assert bad == []


@pytest.mark.parametrize("name, dtype, density", [
    ("switch", torch.float32, 1.0),
    ("sparse-switch", torch.float32, 0.2),
    ("ring", torch.float32, 1.0),
    ("ring", torch.float16, 1.0),
    ("allgather", torch.float32, 0.2),
])
def test_other_transports_send_no_unwritten_byte(name, dtype, density, monkeypatch):
    bad = _undetermined(functools.partial(_other, name=name, dtype=dtype, density=density), 3, monkeypatch)
    assert bad == []
