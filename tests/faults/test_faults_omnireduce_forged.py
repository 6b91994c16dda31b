"""Forged OmniReduce round-0 headers on real gloo processes (n = 3): every rank raises the library's
error well before the fabric's timeout, nothing sized by the forged header is allocated or received
(every rank runs under the address-space cap), and the aggregators go on serving: the next call through
the same transport and the same aggregators is exact.

Worker 1 rewrites one field of its round-0 header on the wire (:class:`tests._faults_common.CorruptingFabric`),
with the checksum left as it was (a header changed on the way: ``MalformedMessage``) or recomputed (a
peer that lies within the protocol's limits: a disagreement, ``MismatchError``). Either way the
aggregator receives nothing by that header: after its verdict every worker tells it what it did send in
round 0 (the manifest), and it consumes exactly that, so no stale message is left for the next call.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.transports.omnireduce import header, wire

from tests._faults_common import CorruptingFabric, cap_address_space, outcome

pytestmark = pytest.mark.multiprocess

TIMEOUT = 30.0
BOUND = 5.0       # seconds: every rank has its error within this (vs TIMEOUT)
N = 3


def _forged_then_good(ctx, deployment: str, numel: int, kwargs: dict, forgeries: list) -> list:
    """One good call, then per forgery ``(field, value, reseal)`` a call with worker 1's headers forged
    (its outcome) and a good call through the same transport (exact or not)."""
    cap_address_space()
    forge: dict = {}

    def rewrite(t, dst, tag):
        if tag == wire.TAG_HDR_UP and forge:
            out = t.detach().clone()
            h = out.view(torch.int64)
            h[forge["field"]] = forge["value"]
            if forge["reseal"]:
                header.seal(h.numpy())
            return out

    f = CorruptingFabric(ctx.fabric, rewrite) if ctx.rank == 1 else ctx.fabric
    t = sc.transports.get("omnireduce", f, deployment=deployment, **kwargs)
    x = torch.full((numel,), float(ctx.rank + 1))
    exp = torch.full((numel,), float(N * (N + 1) // 2))
    out = [torch.equal(t.allreduce(x), exp)]
    for field, value, reseal in forgeries:
        forge.update(field=field, value=value, reseal=reseal)
        out.append(outcome(lambda: t.allreduce(x)))
        forge.clear()
        out.append(torch.equal(t.allreduce(x), exp))
    return out


def _run(deployment: str, numel: int, kwargs: dict, forgeries: list) -> list:
    services = [f"omnireduce-agg:{i}" for i in range(N)] if deployment == "dedicated" else []
    return sc.launch(functools.partial(_forged_then_good, deployment=deployment, numel=numel, kwargs=kwargs,
                                       forgeries=forgeries), N, backend="gloo", timeout_s=TIMEOUT,
                     services=services)


def _check(res: list, expected: list[str]) -> None:
    for rank, out in enumerate(res):
        assert out[0] is True, (rank, out)
        for i, cls in enumerate(expected):
            got, after = out[1 + 2 * i], out[2 + 2 * i]
            assert got[0] == cls and "worker 1" in got[1], (rank, i, got)
            assert got[2] < BOUND, (rank, i, got)
            assert after is True, (rank, i, "the next call is not exact")


def test_a_dedicated_aggregator_rejects_forged_lanes_and_goes_on_serving():
    """``lanes = 2^24`` (within the protocol's limit): the aggregator posts no receive of the size that
    header announces (gloo aborts on a message longer than its receive), rejects it on every rank and
    goes on serving."""
    forgeries = [(wire.F_LANES, 2**24, False), (wire.F_LANES, 2**24, True), (wire.F_NUMEL, 2**40, True),
                 (wire.F_K0, 2**40, False)]
    res = _run("dedicated", 1000, {"block_size": 16, "lanes": 4}, forgeries)
    _check(res, ["MalformedMessage", "MismatchError", "MismatchError", "MalformedMessage"])


def test_colocated_aggregators_reject_forged_headers_on_every_rank_quickly():
    """``num_aggregators`` out of range or not the world size, position-0 blocks in a channel that does
    not exist: the forging worker's hosted aggregator accepts its own (true) header, so it runs its lanes
    while the others reject; it raises only once its sends to the others have left (gloo drops a send
    whose buffer is freed first), so every rank fails at once, not at the timeout."""
    forgeries = [(wire.F_AGGS, 10**13, False), (wire.F_AGGS, 4096, False), (wire.F_K0 + 5, 1, False),
                 (wire.F_AGGS, 4096, True)]
    res = _run("colocated", 100_000, {}, forgeries)
    _check(res, ["MalformedMessage"] * 4)
