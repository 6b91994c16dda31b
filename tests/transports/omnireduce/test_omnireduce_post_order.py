"""The order in which an aggregator posts a worker's round-0 receives: its first look-aheads before its blocks;
and, colocated on gloo, a worker's receives of a peer's round-0 messages before its own blocks to that peer.

gloo moves a peer's messages to the receives in the order they are posted once the peer has sent them; the
aggregator takes the first look-aheads (small) before any block, to send its verdict, so a look-ahead posted
after the blocks would wait on the wire for all of them, and every worker's receives of the sums (posted at
the verdict) with it."""

from __future__ import annotations

import functools

import pytest
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


def _dense_call(ctx, numel: int, directory: str):
    import os

    import sparsecomm as sc
    from sparsecomm.transports.omnireduce import trace

    os.environ[trace.ENV] = directory        # (this rank's calls traced into it)
    t = sc.transports.get("omnireduce", ctx.fabric)
    x = torch.arange(numel, dtype=torch.float32) % 7 + ctx.rank + 1.0      # every block non-zero
    y = t.allreduce(x)
    return bool(torch.equal(y, sum(torch.arange(numel, dtype=torch.float32) % 7 + r + 1.0
                                   for r in range(ctx.world_size))))


def _traced_dense_call(tmp_path, n: int = 3) -> list[list[dict]]:
    """Each rank's traced events of one dense call on ``n`` gloo workers, colocated (1100 blocks per aggregator:
    1.1 MB, at least ``message_bytes``, so a worker's blocks to a peer are held, :func:`.worker.release_up`)."""
    import json

    import sparsecomm as sc

    got = sc.launch(functools.partial(_dense_call, numel=n * 256 * 1100, directory=str(tmp_path)), n, backend="gloo",
                    timeout_s=60)
    assert got == [True] * n
    return [json.loads((tmp_path / f"rank{r}.call0.json").read_text())["events"] for r in range(n)]


@pytest.mark.multiprocess
def test_colocated_worker_posts_a_peers_round0_receives_before_its_blocks_to_that_peer_leave(tmp_path):
    """On gloo a message moves once its receive's notice reaches the sender, on the link that carries the
    receiver's own blocks to that sender: each worker posts its receives of a peer's first look-aheads and
    position-0 blocks before it sends that peer's aggregator its blocks where they hold at least
    ``message_bytes`` (:func:`.worker.release_up`), so the notices do not queue behind its blocks."""
    events = _traced_dense_call(tmp_path)
    for r, ev in enumerate(events):
        for p in (p for p in range(len(events)) if p != r):
            blocks_out = [e["post"] for e in ev if e["kind"] == "send" and e["peer"] == p
                          and e["tag"] == wire.tag_up(0)]
            ins = [e["post"] for e in ev if e["kind"] == "recv" and e["peer"] == p
                   and e["tag"] in (wire.TAG_FIRSTS, wire.tag_up(0))]
            assert len(blocks_out) == 1 and len(ins) == 2, (r, p, ev)
            assert max(ins) < blocks_out[0], (r, p, ins, blocks_out)


@pytest.mark.multiprocess
def test_colocated_express_receives_are_posted_before_any_data_to_their_peer(tmp_path):
    """The admission's header and verdict are express (:func:`sparsecomm.fabric.base.express`): on gloo each travels on
    the pair's connection whose direction carries the *receiver's* data to the sender, so its "receive posted" notice
    leaves in time only if it is posted before that data: every worker (with its hosted aggregator) posts its receives
    of a peer's header and of the peer aggregator's verdict before it sends that peer any block."""
    from sparsecomm.fabric.base import is_express

    assert is_express(wire.TAG_HDR_UP) and is_express(wire.TAG_HDR_DOWN) and not is_express(wire.TAG_FIRSTS)
    events = _traced_dense_call(tmp_path)
    for r, ev in enumerate(events):
        for p in (p for p in range(len(events)) if p != r):
            data_out = [e["post"] for e in ev if e["kind"] == "send" and e["peer"] == p and e["tag"] == wire.tag_up(0)]
            express_in = [e["post"] for e in ev if e["kind"] == "recv" and e["peer"] == p
                          and e["tag"] in (wire.TAG_HDR_UP, wire.TAG_HDR_DOWN)]
            assert len(data_out) == 1 and len(express_in) == 2, (r, p, ev)
            assert max(express_in) < data_out[0], (r, p, express_in, data_out)
