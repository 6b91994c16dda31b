"""The SimFabric's wait set of a drive's roles (:mod:`sparsecomm.fabric.sim.sim_roles`): the scheduler's choices
among the roles able to run, read from records kept across choices, are the choices of the groups built per
choice (``WaitAny``), in the same order and at the same modelled times, on a randomized protocol of several
roles per endpoint: stages of their own, messages of random sizes from random peers, ``any`` waits, a
channel two roles share (the records then do not decide: that choice builds the groups), hand-overs."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import ProtocolError
from sparsecomm.fabric.roles import Hand, Inbox, Outbox, Pool, Post, Recv, RecvWithin, Send
from sparsecomm.fabric import roles as roles_mod
from sparsecomm.fabric.sim import sim as sim_mod
from sparsecomm.fabric.sim import sim_roles


class Stage(NamedTuple):
    phase: int
    sure: bool = False
    reaps: bool = False


ROLES, ROUNDS = 4, 5


def _plan(seed: int, n: int) -> dict:
    """Per (endpoint, role, round) of the receiving end: the message's size, the wait's phase, whether the
    wait is ``any`` (of the message and a second, small one on another tag) and whether a hand-over comes
    first."""
    rng = random.Random(seed)
    return {(e, j, r): dict(size=4 * rng.choice([1, 16, 256, 4096]), phase=rng.randrange(3),
                            any=rng.random() < 0.3, hand=rng.random() < 0.2)
            for e in range(n) for j in range(ROLES) for r in range(ROUNDS)}


def _protocol(ctx, plan: dict, shared: bool) -> list:
    """Role ``j`` of endpoint ``e`` receives each round from role ``j`` of ``(e - 1 - j) % n`` and sends to
    ``(e + 1 + j) % n`` (a ring per role; every round's send before its wait). ``shared``: role 1 is a second
    copy of role 0 (the same peers, tags and sizes): two roles' receives on one channel. Returns the resumes
    of this endpoint's roles, in order, with the clock."""
    f = ctx.fabric
    n, e = f.world_size, f.rank
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    order = []

    def role(j: int):
        like = 0 if shared and j == 1 else j          # whose peers, tags and sizes
        src, dst = (e - 1 - like) % n, (e + 1 + like) % n
        for r in range(ROUNDS):
            p_out, p_in = plan[dst, like, r], plan[e, like, r]
            ta, tb = 100 * like + 2 * r, 100 * like + 2 * r + 1
            yield Send(torch.full((p_out["size"] // 4,), float(e)).view(torch.uint8), dst, ta)
            if p_out["any"]:
                yield Send(torch.full((4,), float(e)).view(torch.uint8), dst, tb)
            keys = (("m", j, r, 0),) + ((("m", j, r, 1),) if p_in["any"] else ())
            yield Post(keys[0], p_in["size"], src, ta)
            if p_in["any"]:
                yield Post(keys[1], 16, src, tb)
            if p_in["hand"]:
                yield Hand(("h", j, r), r)
                yield Recv((("h", j, r),), Stage(p_in["phase"]))
                inbox.take(("h", j, r))
                order.append((j, r, "h", f.now()))
            yield Recv(keys, Stage(p_in["phase"]), any=p_in["any"])
            order.append((j, r, 0, f.now()))
            if p_in["any"]:
                yield Recv(keys, Stage(p_in["phase"]))     # and the other one
                order.append((j, r, 1, f.now()))
            for k in keys:
                inbox.take(k)

    f.drive([role(j) for j in range(ROLES)], inbox, outbox)
    outbox.finish()
    return order


def _run(plan: dict, n: int, shared: bool, waitset: bool, monkeypatch) -> tuple:
    counts = {"exact": 0, "built": 0}
    choose, groups = sim_roles.RoleWaits.choose, roles_mod.groups

    def spy_choose(self, world, clock_only=False, at=None):     # a choice that waited, decided by the records
        got = choose(self, world, clock_only, at)
        counts["exact"] += got is not None
        return got

    def spy_groups(*a):                     # a choice that built its groups (with a wait set: the drive's)
        counts["built"] += 1
        return groups(*a)

    with monkeypatch.context() as m:
        m.setattr(sim_roles.RoleWaits, "choose", spy_choose)
        m.setattr(roles_mod, "groups", spy_groups)
        if not waitset:     # every choice builds its groups (the scheduler without a wait set)
            m.setattr(sim_mod, "RoleWaits", lambda *a: None)
        out = sc.launch(lambda ctx: _protocol(ctx, plan, shared), n,
                        network=sc.Network(bandwidth_gbps=10, latency_us=2))
    return out, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_the_wait_set_chooses_as_the_groups_built_per_choice(monkeypatch, seed, shared):
    n = 5
    plan = _plan(seed, n)
    built, none = _run(plan, n, shared, waitset=False, monkeypatch=monkeypatch)
    kept, counts = _run(plan, n, shared, waitset=True, monkeypatch=monkeypatch)
    assert none["exact"] == 0 and none["built"] > 0     # (no records: every choice built its groups)
    assert kept == built            # the same resumes, in the same order, at the same modelled times
    assert counts["exact"] > 0      # the records decided choices that waited
    if shared:
        assert counts["built"] > 0  # and a channel two roles share made some choices build their groups


def _gather(ctx, seed: int) -> list:
    """Every endpoint sends one message to each other one on tags 7 and 8 (sizes by the pair and the tag, in an
    order of its own, two at a time, each pair after a tick from the previous endpoint); two roles gather them,
    one per tag, as an OmniReduce aggregator takes its headers: a wait ``any`` on the keys left, then each key
    whose message is in (or the first); each wait is resumed with the one key in (checked). Returns the takes,
    with the clock."""
    f = ctx.fabric
    n, e = f.world_size, f.rank
    rng = random.Random(1000 * seed + e)
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    size = lambda src, dst, tag: 4 ** (1 + (3 * src + 5 * dst + tag) % 6)   # noqa: E731
    taken = []

    def sender():       # two messages at a time, then a tick to the next endpoint and one from the previous
        sends = rng.sample([(d, t) for d in range(n) if d != e for t in (7, 8)], 2 * (n - 1))
        for j in range(0, len(sends), 2):
            for dst, tag in sends[j:j + 2]:
                yield Send(torch.zeros(size(e, dst, tag), dtype=torch.uint8), dst, tag)
            yield Send(torch.zeros(1, dtype=torch.uint8), (e + 1) % n, 9)
            yield Post(("tick", j), 1, (e - 1) % n, 9)
            yield Recv((("tick", j),), Stage(9))
            inbox.take(("tick", j))

    def gather(tag: int):
        left = [(tag, src) for src in range(n) if src != e]
        for k in left:
            yield Post(k, size(k[1], e, tag), k[1], tag)
        while left:
            got = yield Recv(tuple(left), Stage(tag), any=True)
            assert inbox.ready_keys(left) == [got]      # resumed with the one key in (one per wake here)
            for k in inbox.ready_keys(left) or left[:1]:
                left.remove(k)
                inbox.take(k)
                taken.append((k, f.now()))

    f.drive([gather(7), gather(8), sender()], inbox, outbox)
    outbox.finish()
    return taken


@pytest.mark.parametrize("seed", [0, 1])
def test_a_kept_any_group_chooses_as_the_groups_built_per_choice(monkeypatch, seed):
    """A role that waits ``any`` on the keys it has left keeps its group from one wait to the next
    (:attr:`~sparsecomm.fabric.sim.sim_roles.RoleWaits.spare`): the same takes, in the same order, at the same
    modelled times as with the groups built per choice."""
    n = 6
    adopted = []
    adopt = sim_roles.RoleWaits._adopt

    def spy(self, g, s, req):
        got = adopt(self, g, s, req)
        adopted.append(got)
        return got

    net = sc.Network(bandwidth_gbps=10, latency_us=2)
    with monkeypatch.context() as m:
        m.setattr(sim_mod, "RoleWaits", lambda *a: None)
        built = sc.launch(lambda ctx: _gather(ctx, seed), n, network=net)
    with monkeypatch.context() as m:
        m.setattr(sim_roles.RoleWaits, "_adopt", spy)
        kept = sc.launch(lambda ctx: _gather(ctx, seed), n, network=net)
    assert kept == built
    assert sum(adopted) > n         # groups were kept and taken over


US = 1e-6


def _regather(ctx, case: str) -> list:
    """Endpoint 0 gathers ``k1``, ``k2``, ``k3`` (64 bytes from endpoints 1, 2, 3 on tag 7) as :func:`_gather`
    does (a wait ``any`` on the keys left, then each one in, or the first), in role A, while role B, preferred
    (phase 1), waits for a message of endpoint 4's that comes last (at 100 us): B is never in when A is
    chosen, so A's choices are made by the wait, not at once by the clock. What happens between A's waits:

    - ``"arrived"``: after its first choice (``k1``), A sends endpoint 3 a go and waits for its tick; endpoint 3
      answers with ``k3`` and then the tick, so that ``k3`` arrives while A's group is kept, before its next
      wait (``k2`` comes at 50 us);
    - ``"taken"``: after its first choice (``k1``, with ``k2``'s first message in), A sends endpoint 2 a go and
      takes that first message on ``k2``'s channel itself (:class:`RecvWithin`), which leaves the channel empty
      until the go's answer, ``k2``'s second message (``k3`` comes at 30 us);
    - ``"heap"``: A first waits for a tick of endpoint 5's (at 10 us), by which ``k1`` and ``k3`` are in
      (``k2`` comes at 50 us): its first choice, by the wait, finds two receives in, takes ``k1``, and its next
      wait, at once, must choose ``k3``.

    Returns what endpoint 0 took, in order, with the clock (``float.hex``)."""
    f = ctx.fabric
    e = f.rank
    byte = lambda n: torch.zeros(n, dtype=torch.uint8)     # noqa: E731
    if e == 1:
        f.send(byte(64), 0, 7)
    elif e == 2:
        if case == "taken":
            f.send(byte(64), 0, 7)
            f.recv(byte(1), 0, 10)
        else:
            f.compute(50 * US)
        f.send(byte(64), 0, 7)
    elif e == 3:
        if case == "arrived":
            f.recv(byte(1), 0, 10)
            f.send(byte(64), 0, 7)
            f.send(byte(1), 0, 9)
        else:
            f.compute(30 * US if case == "taken" else 0.0)
            f.send(byte(64), 0, 7)
    elif e == 4:
        f.compute(100 * US)
        f.send(byte(64), 0, 20)
    elif e == 5 and case == "heap":
        f.compute(10 * US)
        f.send(byte(1), 0, 9)
    if e != 0:
        return []
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    taken = []

    def take(k):
        inbox.take(k)
        taken.append((k, f.now().hex()))

    def a():
        left = [("k", src) for src in (1, 2, 3)]
        for k in left:
            yield Post(k, 64, k[1], 7)
        if case == "heap":
            yield Post("tick", 1, 5, 9)
            yield Recv(("tick",), Stage(7))
            take("tick")
        first = True
        while left:
            got = yield Recv(tuple(left), Stage(7), any=True)
            assert inbox.ready_keys(left) == [got]      # resumed with the one key in (one per wake here)
            for k in inbox.ready_keys(left) or left[:1]:
                left.remove(k)
                take(k)
            if first and case == "arrived":
                yield Send(byte(1), 3, 10)
                yield Post("tick", 1, 3, 9)
                yield Recv(("tick",), Stage(7))
                take("tick")
            elif first and case == "taken":
                yield Send(byte(1), 2, 10)
                src = yield RecvWithin(byte(64), 2, 7, 1.0)
                taken.append((("within", src), f.now().hex()))
            first = False

    def b():
        yield Post("z", 64, 4, 20)
        yield Recv(("z",), Stage(1))
        take("z")

    f.drive([a(), b()], inbox, outbox)
    outbox.finish()
    return taken


def _regathered(monkeypatch, case: str) -> tuple[list, list, list]:
    """:func:`_regather` on 6 endpoints with the groups built per choice, and with the wait set; and the wait
    set's calls of ``_adopt``: (the kept group's ``stale``, whether it waits on the keys of the wait, the
    receives of its heap in by the clock, taken over)."""
    adopted = []
    adopt = sim_roles.RoleWaits._adopt

    def spy(self, g, s, req):
        clock = self.ep.clock
        units = [j for lb, j in g.units if g.heads[j] == lb and lb <= clock]
        seen = (g.stale, list(g.keys) == list(req.keys), len(units))
        got = adopt(self, g, s, req)
        adopted.append(seen + (got,))
        return got

    net = sc.Network(bandwidth_gbps=10, latency_us=2)
    with monkeypatch.context() as m:
        m.setattr(sim_mod, "RoleWaits", lambda *a: None)
        built = sc.launch(lambda ctx: _regather(ctx, case), 6, network=net)[0]
    with monkeypatch.context() as m:
        m.setattr(sim_roles.RoleWaits, "_adopt", spy)
        kept = sc.launch(lambda ctx: _regather(ctx, case), 6, network=net)[0]
    return built, kept, adopted


@pytest.mark.parametrize("case", ["arrived", "taken"])
def test_a_kept_group_whose_receives_changed_is_not_taken_over(monkeypatch, case):
    """A message that arrives on (``"arrived"``), or is taken from (``"taken"``), the channel of a live receive of
    a kept group between the role's resume and its next ``any`` wait on the keys left leaves the group's records
    behind (``stale``): that wait records its group afresh, and chooses as the groups built per choice."""
    built, kept, adopted = _regathered(monkeypatch, case)
    assert kept == built
    order = [k for k, _ in built]
    if case == "arrived":   # k3, arrived during A's wait for the tick, is chosen before k2
        assert order == [("k", 1), "tick", ("k", 3), ("k", 2), "z"]
    else:                   # k2's first message went to the RecvWithin; its second, after the go, to k2
        assert order == [("k", 1), ("within", 2), ("k", 2), ("k", 3), "z"]
    # the kept group was refused for that alone: it waited on the keys of the wait
    assert (True, True) in [a[:2] for a in adopted]


def test_a_kept_group_keeps_the_receives_its_choice_found_in(monkeypatch):
    """A choice that finds several of a kept group's receives in (``k1`` and ``k3``) takes the first and leaves
    the others in the group's heap: the role's next wait takes the group over and chooses ``k3`` at once, as the
    groups built per choice do."""
    built, kept, adopted = _regathered(monkeypatch, "heap")
    assert kept == built
    assert [k for k, _ in built] == ["tick", ("k", 1), ("k", 3), ("k", 2), "z"]
    assert built[1][1] == built[2][1]       # k3 at once, at k1's time
    # taken over with a receive in by the clock that the choice had found
    assert (False, True, 1, True) in adopted


class _CountedKey:
    """A key that counts its hashes (each a look-up of it in a dict or a set: the work a wake does per key)."""

    hashes = 0
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __hash__(self) -> int:
        _CountedKey.hashes += 1
        return hash(self.i)

    def __eq__(self, other) -> bool:
        return type(other) is _CountedKey and other.i == self.i

    def __repr__(self) -> str:
        return f"K{self.i}"


def _headers(ctx, n: int, form: str, delete: bool = True) -> list:
    """Endpoint 1 sends endpoint 0 ``n`` messages, one per tag, 5 us apart; endpoint 0's role A takes them as an
    aggregator takes its headers (one per wake, the one it is resumed with; its wait ``any`` on the keys left:
    ``form`` ``"view"``, the live view of its dict of them; ``"tuple"``, a tuple of them), while role B, waiting at a
    later stage for a message that comes last, is able to run (every choice a choice of two). ``delete``: A
    deletes the key it took from its dict (the view's contract). Returns what endpoint 0 took, in order, with the
    clock (``float.hex``), and the hashes of the keys per wake of A."""
    f = ctx.fabric
    byte = lambda k: torch.zeros(k, dtype=torch.uint8)     # noqa: E731
    if ctx.rank == 1:
        for i in range(n):
            f.compute(5 * US)
            f.send(byte(8), 0, 100 + i)
        f.compute(5 * US)
        f.send(byte(8), 0, 7)
        return []
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    taken = []

    def a():
        keys = [_CountedKey(i) for i in range(n)]
        for k in keys:
            yield Post(k, 8, 1, 100 + k.i)
        left = dict.fromkeys(keys)
        rest = left.keys()
        while left:
            got = yield Recv(rest if form == "view" else tuple(left), Stage(1), any=True)
            if delete:
                del left[got]
            inbox.take(got)
            taken.append((got.i, f.now().hex()))

    def b():
        yield Post("z", 8, 1, 7)
        yield Recv(("z",), Stage(2))
        inbox.take("z")
        taken.append(("z", f.now().hex()))

    _CountedKey.hashes = 0
    f.drive([a(), b()], inbox, outbox)
    outbox.finish()
    return taken, _CountedKey.hashes / n


@pytest.mark.parametrize("form", ["view", "tuple"])
def test_an_any_wait_on_the_keys_left_chooses_as_the_groups_built_per_choice(monkeypatch, form):
    """An ``any`` wait on the keys left, as a live dict view or a tuple, with the wait set (a kept group taken
    over) or with the groups built per choice: the same takes, in the same order, at the same modelled times."""
    net = sc.Network(bandwidth_gbps=10, latency_us=2)
    with monkeypatch.context() as m:
        m.setattr(sim_mod, "RoleWaits", lambda *a: None)
        built = sc.launch(lambda ctx: _headers(ctx, 12, form), 2, network=net)[0][0]
    kept = sc.launch(lambda ctx: _headers(ctx, 12, form), 2, network=net)[0][0]
    view = sc.launch(lambda ctx: _headers(ctx, 12, "view"), 2, network=net)[0][0]
    assert kept == built == view
    assert [k for k, _ in kept] == list(range(12)) + ["z"]


def test_an_any_wait_on_a_live_view_wakes_in_constant_work():
    """A wake of an ``any`` wait on the live view of the keys left costs a few look-ups, however many keys are
    left: the scheduler goes on with its watch of them, and the wait set takes its kept group over, without a
    look at each (a tuple of them costs one per key left per wake, O(n^2) per role: n = 64 against n = 16)."""
    net = sc.Network(bandwidth_gbps=10, latency_us=2)
    per = {n: sc.launch(lambda ctx: _headers(ctx, n, "view"), 2, network=net)[0][1] for n in (16, 64)}
    tup = {n: sc.launch(lambda ctx: _headers(ctx, n, "tuple"), 2, network=net)[0][1] for n in (16, 64)}
    assert per[64] <= per[16] + 1, per          # (the first wait's pass over the keys: a constant per wake)
    assert tup[64] > tup[16] + 10, tup          # (what the test tells apart)


def test_an_any_wait_on_a_view_whose_role_kept_its_key_is_an_error():
    """A role that waits on its live view again without deleting the key it was resumed with breaks the view's
    contract (:class:`~sparsecomm.fabric.roles.Recv`): a :class:`ProtocolError` that says so, not a wrong choice."""
    net = sc.Network(bandwidth_gbps=10, latency_us=2)
    with pytest.raises(ProtocolError, match="endpoint 0: an any wait on a dict's keys view .* deleted the key it was "
                                            "resumed with"):
        sc.launch(lambda ctx: _headers(ctx, 4, "view", delete=False), 2, network=net)
