"""The agreement handshake as a role (:func:`~sparsecomm.transports._handshake.agreement_role`): run first
inside another role's drive (``yield from``), it sends what :func:`check_agreement` sends and raises what
it raises; the header, with the identity of the calling thread's call, is built when the role is made.
"""

from __future__ import annotations

import re

import torch

import sparsecomm as sc
from sparsecomm.errors import MismatchError
from sparsecomm.fabric.roles import Inbox, Outbox, Pool
from sparsecomm.transports._handshake import (HEADER_BYTES, CallId, agreement_role, calling, check_agreement,
                                              dtype_code)
from sparsecomm.transports.ring import ring_role

from tests._faults_common import outcome

N = 5   # not a power of two: the dissemination's rounds overlap


def _drive(fabric, make):
    """Run the role ``make(inbox)`` alone on ``fabric``; its return value."""
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    out = {}

    def into():
        out["got"] = yield from make(inbox)

    fabric.drive([into()], inbox, outbox)
    outbox.finish()
    return out["got"]


def _counts(fabric) -> tuple[int, int, int, int]:
    s = fabric.stats
    return s.messages, s.messages_received, s.bytes_sent, s.rounds


def test_the_agreement_runs_first_in_a_ring_drive_with_the_messages_of_check_agreement():
    def fn(ctx):
        f = ctx.fabric
        x = torch.arange(40, dtype=torch.float32) * (ctx.rank + 1)
        before = _counts(f)
        got_alone = check_agreement(f, "ring allreduce", numel=x.numel(), dtype=dtype_code(x.dtype),
                                    info={"bound": ctx.rank * 10})
        alone = [a - b for a, b in zip(_counts(f), before)]

        def agree_then_sum(inbox):
            got = yield from agreement_role(f, inbox, "ring allreduce", numel=x.numel(),
                                            dtype=dtype_code(x.dtype), info={"bound": ctx.rank * 10})
            yield from ring_role(f, x, inbox)
            return got

        before = _counts(f)
        got = _drive(f, agree_then_sum)
        together = [a - b for a, b in zip(_counts(f), before)]
        return got_alone, alone, got, together, x

    out = sc.launch(fn, N)
    rounds = (N - 1).bit_length()
    want = torch.arange(40, dtype=torch.float32) * sum(range(1, N + 1))
    for got_alone, alone, got, together, x in out:
        assert got_alone == got == {"bound": ((N - 1) * 10, N - 1)}
        assert alone == [rounds, rounds, rounds * HEADER_BYTES, rounds]
        # the ring's own messages follow (its rounds are counted by ring_allreduce_, not by the role)
        assert together[0] > rounds and together[3] == rounds
        assert torch.equal(x, want)


def test_a_mismatch_inside_a_drive_is_the_same_error_on_every_worker_naming_both():
    def fn(ctx):
        numel = 12 if ctx.rank == 3 else 10
        return outcome(lambda: _drive(ctx.fabric, lambda inbox: agreement_role(
            ctx.fabric, inbox, "ring allreduce", numel=numel)))

    out = sc.launch(fn, N, timeout_s=30)
    assert all(o[0] == "MismatchError" for o in out), out
    for rank, (_, text, _) in enumerate(out):   # (which worker of 10 is named depends on the merges)
        assert re.search(r"disagree on the numel: worker [0124] has 10, worker 3 has 12 \(this is worker "
                         + str(rank) + r", with 1[02]\)", text), text


def test_the_call_identity_is_the_one_of_the_thread_that_made_the_role():
    """Made inside ``calling(...)``, run after it: the header carries the call the role was made for (a
    role read at run time would carry no identity, and the workers would agree)."""
    def fn(ctx):
        pool = Pool()
        inbox, outbox = Inbox(ctx.fabric, pool), Outbox(ctx.fabric, pool)
        with calling(CallId("bucket", step=7 if ctx.rank == 2 else 6)):
            role = agreement_role(ctx.fabric, inbox, "ring allreduce", numel=10)

        def run():
            ctx.fabric.drive([role], inbox, outbox)

        return outcome(run)

    out = sc.launch(fn, 3, timeout_s=30)
    assert all(o[0] == "MismatchError" for o in out), out
    for rank, (_, text, _) in enumerate(out):
        assert re.search(r"worker [01] is at step 6, worker 2 at step 7", text), text
        step = 7 if rank == 2 else 6
        assert f"this is worker {rank}, at round 0 of bucket 'bucket' in step {step}" in text, text


def test_one_worker_yields_nothing_and_returns_the_info():
    def fn(ctx):
        role = agreement_role(ctx.fabric, None, "ring allreduce", numel=3, info={"bound": 4})
        return list(role) == [] and check_agreement(ctx.fabric, "ring allreduce", info={"bound": 4})

    assert sc.launch(fn, 1) == [{"bound": (4, 0)}]
