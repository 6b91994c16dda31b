"""A blocking driver's choice (:func:`sparsecomm.fabric.roles.drive`) when the preferred role's messages are in
already: it resumes that role without a ``wait_any`` and without looking at the other roles' receives (on gloo a
look at a receive starts a helper thread to learn of its completion, two thread hand-offs)."""

from __future__ import annotations

import torch

from sparsecomm.fabric.roles import Hand, Inbox, Outbox, Pool, Post, Recv, drive, groups
from sparsecomm.transports.omnireduce.stages import Phase, Stage


class _Work:
    """A posted receive that completes only when waited for (as gloo's), counting the looks at it."""

    def __init__(self, log: dict) -> None:
        self.log = log

    def is_completed(self) -> bool:
        self.log["looks"] += 1
        return False

    def wait(self, timeout=None):
        self.log["waits"] += 1


class _Fabric:
    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.log = {"looks": 0, "waits": 0, "wait_any": 0}

    def irecv(self, buf, src, tag):
        return _Work(self.log)

    def wait_any(self, groups):
        self.log["wait_any"] += 1
        for i, g in enumerate(groups):
            if all(w.is_completed() for w in g):
                return i
        return len(groups) - 1      # (the last: what gloo would end with, once its receive is in)

    def host_work(self, op, count, dtype=None):
        """No host model."""


def test_the_preferred_role_in_already_is_resumed_without_a_look_at_the_others():
    f = _Fabric()
    pool = Pool()
    inbox = Inbox(f, pool)
    order = []

    def later():            # a posted receive, a later stage (not sure)
        yield Post("b", 8, 1, 0)
        yield Recv(("b",), Stage(Phase.LAND))
        inbox.take("b")
        order.append("later")

    def preferred():        # its message handed over: in at once
        yield Hand("a", torch.zeros(1))
        yield Recv(("a",), Stage(Phase.VERDICT))
        inbox.take("a")
        order.append("preferred")

    drive(f, inbox, Outbox(f, pool), [later(), preferred()])
    assert order == ["preferred", "later"]
    assert f.log == {"looks": 0, "waits": 1, "wait_any": 0}     # ("b" taken blocking, once the only role)


def test_groups_up_to_the_first_empty_one():
    f = _Fabric()
    pool = Pool()
    inbox = Inbox(f, pool)
    inbox.put("a", 1)
    inbox.post("b", 8, 1, 0)
    inbox.post("c", 8, 1, 1)
    cands = [(1, Recv(("b",), Stage(Phase.VERDICT))), (2, Recv(("a",), Stage(Phase.AGGREGATE))),
             (3, Recv(("c",), Stage(Phase.LAND)))]
    g, owner, picks = groups(inbox, Outbox(f, pool), cands)
    assert [len(x) for x in g] == [1, 0, 1] and owner == [1, 2, 3] and f.log["looks"] == 2
    f.log["looks"] = 0
    g, owner, picks = groups(inbox, Outbox(f, pool), cands, upto_empty=True)
    assert [len(x) for x in g] == [1, 0] and owner == [1, 2] and picks == [None, None] and f.log["looks"] == 1
