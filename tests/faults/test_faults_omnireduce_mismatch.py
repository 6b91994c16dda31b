"""Ranks that disagree on the transport, one of them OmniReduce (real gloo processes): every rank gets a
:class:`~sparsecomm.errors.MismatchError` naming both transports, well before the fabric's timeout.

OmniReduce's workers run the agreement handshake every transport runs first (one fixed-size header with
the transport's name, :func:`sparsecomm.transports._handshake.check_agreement`), so they never post a
receive of another transport's size (gloo would abort the process) nor wait for a message that the
other transport never sends (a timeout with no word of why).
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401

from tests._faults_common import cap_address_space, outcome

pytestmark = pytest.mark.multiprocess

TIMEOUT = 60.0
BOUND = 10.0      # seconds: every rank must have its error well within this (vs TIMEOUT)


def _mixed(ctx, other: str, omni_ranks: tuple[int, ...], deployment: str):
    cap_address_space()
    if ctx.rank in omni_ranks:
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=8, deployment=deployment)
    else:
        t = sc.transports.get(other, ctx.fabric)
    name = "omnireduce" if ctx.rank in omni_ranks else other
    cls, msg, seconds = outcome(lambda: t.allreduce(torch.ones(1000) * (ctx.rank + 1)))
    return name, cls, msg, seconds


@pytest.mark.parametrize("other, n, omni_ranks, deployment", [
    ("ring", 2, (0,), "colocated"),
    ("native", 3, (1,), "colocated"),
    ("allgather", 4, (0, 3), "colocated"),
    ("ring", 3, (0, 2), "dedicated"),
])
def test_omnireduce_against_another_transport_is_a_mismatch_on_every_rank(other, n, omni_ranks, deployment):
    services = [f"omnireduce-agg:{i}" for i in range(n)] if deployment == "dedicated" else []
    res = sc.launch(functools.partial(_mixed, other=other, omni_ranks=omni_ranks, deployment=deployment), n,
                    backend="gloo", timeout_s=TIMEOUT, services=services)
    assert len(res) == n
    for rank, (name, cls, msg, seconds) in enumerate(res):
        assert name == ("omnireduce" if rank in omni_ranks else other)
        assert cls == "MismatchError", (rank, res)
        assert "disagree on the transport" in msg and "'omnireduce'" in msg and repr(other) in msg, (rank, msg)
        assert seconds < BOUND, (rank, res)
