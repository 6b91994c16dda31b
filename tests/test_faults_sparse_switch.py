"""Faults of the SwitchML transports (``switch``, ``sparse-switch``) on real gloo processes: every rank gets
the library's error class within ``BOUND`` seconds under a ``TIMEOUT`` fabric timeout (never the timeout
itself, an abort or a silently wrong number). Every rank runs under the address-space cap of the fault
suite.

- ``sparse-switch`` against another transport: its workers exchange the fixed-size agreement header every
  transport exchanges before any packet goes to the switch (:mod:`sparsecomm.transports._handshake`), so a
  ring / native / omnireduce / switch worker reads it as its own transport's header: ``MismatchError``
  naming both transports.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401

from ._faults_common import cap_address_space, outcome

pytestmark = pytest.mark.multiprocess

TIMEOUT = 30.0
BOUND = 5.0       # seconds: every rank must have its error well within this (vs TIMEOUT)


def _sparse_vs(ctx, other: str, odd: int):
    cap_address_space()
    f = ctx.fabric
    sparse = sc.transports.get("sparse-switch", f, pool_size=4, slot_elems=64)
    good = sparse.allreduce(torch.ones(300) * (ctx.rank + 1))      # the sparse switch works before the mistake
    ok = torch.equal(good, torch.full((300,), float(sum(range(1, f.world_size + 1)))))
    if ctx.rank == odd:
        kw = {"block_size": 16, "lanes": 8} if other == "omnireduce" else {"pool_size": 4} if other == "switch" else {}
        t = sc.transports.get(other, f, **kw)
    else:
        t = sparse
    return ok, outcome(lambda: t.allreduce(torch.ones(640)))


@pytest.mark.parametrize("other, n, odd", [("ring", 2, 1), ("omnireduce", 3, 0), ("switch", 2, 0),
                                           ("native", 3, 2)])
def test_sparse_switch_vs_another_transport_is_a_mismatch_error_on_every_rank_quickly(other, n, odd):
    services = ["sparse-switch:elems=64"] + (["switch"] if other == "switch" else [])
    res = sc.launch(functools.partial(_sparse_vs, other=other, odd=odd), n, backend="gloo", timeout_s=TIMEOUT,
                    services=services)
    assert all(ok for ok, _ in res), res
    got = [o for _, o in res]
    assert [o[0] for o in got] == ["MismatchError"] * n, got
    assert all(o[2] < BOUND for o in got), got
    for _, msg, _ in got:
        assert "disagree on the transport" in msg and "'sparse-switch'" in msg and f"'{other}'" in msg, msg
