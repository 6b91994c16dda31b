"""The sparse switch as roles: its worker rounds and switch ports do no fabric I/O of their own (they yield it to
``Fabric.drive``), and the two requests they add (:mod:`sparsecomm.transports.switchml.sparse.requests`) do what
they say on SimFabric: a timed receive resumes with ``None`` after its modelled timeout, a datagram arrives with
its source, an untracked one is left out of the outbox."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import sparsecomm as sc
from sparsecomm.fabric.roles import Inbox, Outbox, Pool, Step
from sparsecomm.transports.switchml.sparse import requests as rq

SPARSE = Path(sc.__file__).resolve().parent / "transports" / "switchml" / "sparse"
IO = {"send", "recv", "isend", "irecv", "wait_any", "wait", "wait_unbounded", "barrier"}


def test_the_protocol_modules_leave_their_io_to_the_fabric():
    """Only :mod:`.requests` (the lowering onto today's drive) touches the fabric's sends, receives and waits;
    the rounds, the switch program and the transport yield requests, and start no thread."""
    for name in ("__init__.py", "dataplane.py", "rounds.py"):
        tree = ast.parse((SPARSE / name).read_text())
        calls = sorted({n.func.attr for n in ast.walk(tree)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in IO})
        assert calls == [], f"{name} calls {calls} itself"
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if name != "__init__.py":   # (the transport's lock guards the world's shared program; no thread)
            assert "threading" not in mods, name


def _pair(ctx):
    f = ctx.fabric
    pool = Pool()
    inbox, outbox = Inbox(f, pool), Outbox(f, pool)
    got = {}
    buf = torch.zeros(4, dtype=torch.int32)

    def first():        # worker 0: a timed receive that expires (worker 1 sends only after it), then two datagrams
        got["expired"] = yield rq.RecvFor("x", buf, 1, 7, 1e-3, Step())
        got["clock"] = f.now()
        yield rq.Datagram(torch.arange(4, dtype=torch.int32), 1, 7, reliable=True)
        yield rq.Datagram(torch.arange(4, dtype=torch.int32) * 2, 1, 8, tracked=False)
        got["pending"] = len(outbox.pending)
        got["late"] = yield rq.RecvFor("x", buf, 1, 7, 1.0, Step())
        got["data"] = buf.tolist()

    def second():       # worker 1: both messages with their source, no timer; then one back
        got["src"] = yield rq.RecvFor("a", buf, None, 7, None, Step())
        a = buf.tolist()
        got["src2"] = yield rq.RecvFor("b", buf, 0, 8, None, Step())
        got["data"] = (a, buf.tolist())
        yield rq.Datagram(torch.full((4,), 9, dtype=torch.int32), 0, 7)

    role = first() if ctx.rank == 0 else second()
    f.drive([rq.lowered(role, f, inbox, outbox)], inbox, outbox)
    outbox.finish()
    return got


def test_timed_receives_expire_in_modelled_time_and_datagrams_arrive_with_their_source():
    g0, g1 = sc.launch(_pair, 2)
    assert g0["expired"] is None and g0["clock"] >= 1e-3
    assert g0["pending"] == 1                    # the tracked datagram only
    assert g0["late"] == 1 and g0["data"] == [9] * 4
    assert g1["src"] == 0 and g1["src2"] == 0 and g1["data"] == ([0, 1, 2, 3], [0, 2, 4, 6])
