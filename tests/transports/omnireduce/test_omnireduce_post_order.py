"""The order in which an aggregator posts a worker's round-0 receives: its first look-aheads before its blocks.

gloo moves a peer's messages to the receives in the order they are posted once the peer has sent them; the
aggregator takes the first look-aheads (small) before any block, to send its verdict, so a look-ahead posted
after the blocks would wait on the wire for all of them, and every worker's receives of the sums (posted at
the verdict) with it."""

from __future__ import annotations

import torch

from sparsecomm.fabric.roles import Inbox, Pool, PostInto
from sparsecomm.transports.omnireduce import wire
from sparsecomm.transports.omnireduce.aggregator import AggCall
from sparsecomm.transports.omnireduce.header import CallSpec


def _headers(n: int, numel: int, channels: int, lanes: int, index: int) -> list[torch.Tensor]:
    """Every worker's round-0 header of a dense call (every block non-zero: position-0 blocks in every
    channel of aggregator ``index``)."""
    spec = CallSpec(numel, torch.float32, 256, n, channels, lanes, wire.KINDS.index("dense"))
    chans = wire.plan(numel, 256, n, channels, lanes)[index]
    return [spec.header(n, {ch.slot: min(ch.lanes, ch.size) for ch in chans}) for _ in range(n)]


def _posted(posts: list) -> list:
    assert all(isinstance(p, PostInto) for p in posts)
    return [p.key for p in posts]


def _check(keys: list) -> None:
    """Per worker, its first look-aheads' receive is posted before any of its blocks'."""
    peers = {k.peer for k in keys}
    assert peers
    for w in peers:
        mine = [k.msg for k in keys if k.peer == w]
        assert wire.Msg.FIRSTS in mine and wire.Msg.BLOCKS0 in mine, keys
        assert mine.index(wire.Msg.FIRSTS) < mine.index(wire.Msg.BLOCKS0), keys


def test_dedicated_aggregator_posts_the_first_look_aheads_before_the_blocks():
    for n, channels in ((2, 1), (3, 2)):
        hs = _headers(n, 100_000, channels, 64, index=0)
        adm = AggCall(0, n)
        inbox = Inbox(None, Pool())
        for w, h in enumerate(hs):
            inbox.put(wire.Key(wire.Msg.HDR, w), h.view(torch.uint8))
        posts = adm.take_headers(inbox)
        assert adm.status == wire.OK
        _check(_posted(posts))


def test_colocated_aggregator_posts_the_first_look_aheads_before_the_blocks_as_each_header_comes():
    n = 3
    hs = _headers(n, 100_000, 1, 1 << 14, index=1)
    adm = AggCall(1, n, colocated=1)
    inbox = Inbox(None, Pool())
    keys = []
    for w in adm.remote():          # (the headers taken early, as they arrive while the host scans)
        inbox.put(wire.Key(wire.Msg.HDR, w), hs[w].view(torch.uint8))
        keys += _posted(adm.take_early(inbox, wire.Key(wire.Msg.HDR, w), hs[1].numpy()))
    _check(keys)
