"""The switch service's in-place replies: the program writes each result over the row it answers in the
received message (``Dataplane.execute(rows, rows, ...)``), and the service sends that buffer back."""

import numpy as np
import pytest

from sparsecomm.transports.switchml.dataplane import HEADER, Dataplane, SwitchConfig, T_EMPTY
from sparsecomm.transports.switchml.service import _Buffers

from .test_switch import random_rows


@pytest.mark.parametrize("world", [1, 2, 3])
def test_results_over_the_rows_they_answer_equal_separate_reply_buffers(world):
    """The same random messages through two dataplanes, one writing its multicast results into a buffer
    of their own (the reference path), one over the received rows: the same results in the same order,
    the same registers and counters; every row past the results is T_EMPTY (read and cleared). Every
    world size: with one worker the first contribution completes a slot (written over its own row)."""
    rng = np.random.default_rng(world)
    cfg = SwitchConfig(elems=64, slots=6)
    ref, dp = Dataplane(cfg), Dataplane(cfg)
    ref.world = dp.world = world
    width = HEADER + 64
    multicast = 0
    for step in range(400):
        k = int(rng.integers(1, 9))
        rows = random_rows(rng, step, k, width, world=world)
        mc, uc = np.empty_like(rows), np.empty_like(rows)
        nmc, nuc, bad = ref.execute(rows.copy(), mc, uc)
        own = rows.copy()
        uc2 = np.empty_like(rows)
        got = dp.execute(own, own, uc2, clear=True)
        assert got == (nmc, nuc, bad)
        assert own[:nmc].tolist() == mc[:nmc].tolist() and uc2[:nuc].tolist() == uc[:nuc].tolist()
        assert (own[nmc:, 0] == T_EMPTY).all()
        multicast += nmc
    for name in ("values", "seen", "count", "exponent"):
        assert np.array_equal(getattr(dp, name), getattr(ref, name))
    assert dict(dp.stats) == dict(ref.stats) and multicast > 20 and ref.stats["retransmit"] > 10


def test_buffers_return_to_the_pool_empty_after_their_last_send():
    """A buffer held for n sends comes back (last-freed first) only after the n-th release, with its reply
    rows reset to T_EMPTY: ready to be posted as a receive again."""
    pool = _Buffers(rows=8, width=HEADER + 4, keep=4)
    a = pool.take()
    assert a.shape == (8, HEADER + 4) and (a[:, 0] == T_EMPTY).all()
    a[:3, 0] = 2                                   # three reply rows
    pool.hold(a, 2, reset=3)
    b = pool.take()
    assert b is not a                              # still being sent
    pool.release(id(a))
    assert id(a) in pool.pending
    pool.release(id(a))
    assert not pool.pending and (a[:, 0] == T_EMPTY).all()
    pool.give_back(b)
    assert pool.take() is b and pool.take() is a   # last freed first
    pool.release(None)                             # a message of its own: nothing held


def test_link_posts_taken_receives_again_in_groups_and_never_takes_an_unposted_one():
    """The worker's link posts its taken receives again ``group`` at a time, in ring order, and the
    receive it takes next is always posted: at least ``depth - group`` stay posted. Its role methods yield
    the posts (:class:`~sparsecomm.fabric.roles.PostInto`), performed here as a fabric's driver would."""
    from sparsecomm.errors import InvalidValueError
    from sparsecomm.fabric.roles import PostInto
    from sparsecomm.transports.switchml.lanes import Link

    class _Work:
        def __init__(self, log, buf):
            self.log, self.buf, self.done = log, buf, False

        def wait(self, timeout=None):
            assert not self.done, "a receive taken twice without being posted again"
            self.done = True

        def is_completed(self):
            return True

    class _Fabric:
        def __init__(self):
            from sparsecomm.fabric.stats import CommStats

            self.posts, self.rank, self.stats = [], 0, CommStats()

        def irecv(self, buf, src, tag):
            self.posts.append(buf.data_ptr())
            return _Work(self.posts, buf)

    def perform(link, requests):
        for req in requests:
            assert type(req) is PostInto
            link.inbox.post_into(req.key, req.buf, req.src, req.tag)

    fab = _Fabric()
    link = Link(fab, switch=2, burst=4, width=HEADER + 4, depth=6, group=4)
    ptrs = [b.data_ptr() for b in link.bufs]
    perform(link, link.post())
    perform(link, link.post())           # posted once only
    assert fab.posts == ptrs
    taken = []
    for step in range(40):
        assert link.inbox.has(link.key)
        link.take(fab, whole=False)
        taken.append(link.bufs[link.i].data_ptr())
        perform(link, link.release())
        posted = sum(link.inbox.has(("down", k)) for k in range(6))
        assert posted >= 6 - 4 and link.inbox.has(link.key)
    assert taken == [ptrs[k % 6] for k in range(40)]
    # reposts come in groups of 4, each the 4 buffers taken last, in ring order
    again = fab.posts[6:]
    assert len(again) == 40 // 4 * 4
    assert again == [ptrs[k % 6] for k in range(len(again))]
    with pytest.raises(InvalidValueError):
        Link(fab, switch=2, burst=4, width=HEADER + 4, depth=4, group=4)
