"""The per-message trace of OmniReduce calls (a diagnostic, off by default): every message of a call is
recorded, bytes as the ledger counts them, and the merged timeline names every rank."""

from __future__ import annotations

import json

import torch

import sparsecomm as sc
from sparsecomm.transports._handshake import HANDSHAKE_TAG, HEADER_BYTES
from sparsecomm.transports.omnireduce import trace


def _call(ctx):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=4)
    x = torch.zeros(400)
    x[16 * ctx.rank: 16 * ctx.rank + 40] = ctx.rank + 1.0
    y = t.allreduce(x)
    return y, t.last_stats.bytes_sent, t.last_stats.bytes_received


def _expected(n=3):
    want = torch.zeros(400)
    for r in range(n):
        want[16 * r: 16 * r + 40] += r + 1.0
    return want


def test_trace_is_off_by_default_and_records_every_message_when_on(tmp_path, monkeypatch):
    built = []
    init = trace.TraceFabric.__init__

    def counting(self, *a, **kw):
        built.append(a[1] if len(a) > 1 else kw.get("directory"))
        init(self, *a, **kw)

    monkeypatch.setattr(trace.TraceFabric, "__init__", counting)
    monkeypatch.delenv(trace.ENV, raising=False)
    assert trace.enabled() is None
    res = sc.launch(_call, 3)
    assert built == []                              # off: no call runs on a traced fabric
    assert all(torch.equal(y, _expected()) for y, _, _ in res)

    monkeypatch.setenv(trace.ENV, str(tmp_path))
    res = sc.launch(_call, 3)
    assert built == [str(tmp_path)] * 3             # on: every worker's call, into the directory
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"rank{r}.call0.json" for r in range(3)]
    for r, (y, sent, received) in enumerate(res):
        assert torch.equal(y, _expected())          # the traced call's sum is the sum
        rec = json.loads((tmp_path / f"rank{r}.call0.json").read_text())
        ev = rec["events"]
        # every message goes through the trace, the agreement handshake's too (ceil(log2 3) = 2 headers each
        # way: it runs first in the call's own drive)
        assert sum(e["bytes"] for e in ev if e["kind"] == "send") == sent
        assert sum(e["bytes"] for e in ev if e["kind"] == "recv") == received
        hs = [(e["kind"], e["bytes"]) for e in ev if e["tag"] == HANDSHAKE_TAG]
        assert sorted(hs) == [("recv", HEADER_BYTES)] * 2 + [("send", HEADER_BYTES)] * 2
        assert all(e["done"] is not None and e["post"] <= e["done"] for e in ev)
    text = trace.report(str(tmp_path), 0)
    assert all(f"== rank {r} (worker)" in text for r in range(3))
