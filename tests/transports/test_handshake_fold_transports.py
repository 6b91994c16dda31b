"""OmniReduce's and the ring's repeated calls skip the agreement handshake (``sparsecomm.transports._fold``), on
real gloo processes: a predicted float call sends no handshake message, its sums are unchanged, and every way a
worker can leave a predicted call (another length, dtype, call identity, payload kind, another transport, all
workers at once) still gives every worker the handshake's error, or the right sum; the non-finite rules on a
predicted call are those of an unpredicted one. On the SimFabric nothing is predicted.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.payload import Payload
from sparsecomm.transports import _fold
from sparsecomm.transports._handshake import CallId, handshake_bytes

from tests._faults_common import cap_address_space, outcome

TIMEOUT = 60.0
BOUND = 10.0      # seconds: every rank has its error well within this (vs TIMEOUT)
N = 3


def _warm(t, x, k=4, **kw):
    """``k`` identical calls: from the fourth on, the call is predicted."""
    for _ in range(k):
        t.allreduce(x, **kw)


#: each transport's options in these tests (small OmniReduce blocks and lanes: several of each per call)
OPTIONS = {"omnireduce": dict(block_size=16, lanes=8), "ring": {}}
#: the transport a worker runs instead of the predicted call (the last case)
OTHER = {"omnireduce": "ring", "ring": "omnireduce"}


def _cases(ctx, name):
    cap_address_space()
    r, f = ctx.rank, ctx.fabric
    t = sc.transports.get(name, f, **OPTIONS[name])
    sched = _fold.schedule(f)
    out = {}
    x = torch.arange(1000, dtype=torch.float32) * (r + 1)
    want = torch.arange(1000, dtype=torch.float32) * 6
    # the first calls run the handshake; the predicted ones do not, with the same sums
    first = t.allreduce(x.clone())
    unfolded = t.last_stats
    _warm(t, x)
    before = sched.folded
    y = t.allreduce(x.clone())
    folded = t.last_stats
    out["folded"] = sched.folded == before + 1 and torch.equal(y, want) and torch.equal(first, want)
    # ceil(log2 3) = 2 handshake headers fewer per worker (each of handshake_bytes()), nothing else changed
    hs = (N - 1).bit_length()
    out["messages"] = (unfolded.messages - folded.messages == hs
                       and unfolded.bytes_sent - folded.bytes_sent == hs * handshake_bytes())
    # one worker leaves the predicted call: another length, another dtype, another call identity, a payload
    _warm(t, x)
    out["length"] = outcome(lambda: t.allreduce(torch.ones(1000 + (r == 2))))
    _warm(t, x)
    out["dtype"] = outcome(lambda: t.allreduce(x.double() if r == 1 else x))
    _warm(t, x, call=CallId("a", 1))
    out["identity"] = outcome(lambda: t.allreduce(x, call=CallId("b" if r == 0 else "a", 1)))
    _warm(t, x)
    p = Payload("aligned", torch.ones(2), torch.Size([1000]), torch.float32, indices=torch.tensor([1, 3]))
    out["payload"] = outcome(lambda: t.allreduce(p if r == 0 else x))
    # NaN in a predicted call: the non-finite rules, naming the worker
    _warm(t, x)
    z = x.clone()
    if r == 1:
        z[0] = float("nan")
    before = sched.folded
    out["nan"] = outcome(lambda: t.allreduce(z))
    out["nan folded"] = sched.folded == before + 1
    # nonfinite="pass": a NaN in element 0 is the data's (the handshake finds every worker agreeing)
    passing = sc.transports.get(name, f, **OPTIONS[name], nonfinite="pass")
    _warm(passing, x)
    z = x.clone()
    if r == 2:
        z[0] = float("nan")
    before = sched.folded
    y = passing.allreduce(z)
    out["pass nan"] = (bool(torch.isnan(y[0])) and torch.equal(y[1:], want[1:]) and sched.folded == before + 1)
    # every worker changes alike: the call runs with its handshake, right
    _warm(t, x)
    dev = sched.deviated
    y = t.allreduce(torch.full((300,), float(r)))
    out["all change"] = torch.equal(y, torch.full((300,), 3.0)) and sched.deviated == dev + 1
    out["after"] = torch.equal(sc.transports.get(OTHER[name], f).allreduce(torch.ones(5)), torch.full((5,), 3.0))
    # last: another transport instead of the predicted call (fail-stop, as without the fold)
    _warm(t, x)
    mine = OTHER[name] if r == 1 else name
    out["transport"] = outcome(lambda: sc.transports.get(mine, f, **OPTIONS[mine]).allreduce(x))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_predicted_call_skips_its_handshake_and_a_worker_leaving_it_gets_the_handshakes_error(name):
    res = sc.launch(functools.partial(_cases, name=name), N, backend="gloo", timeout_s=TIMEOUT)
    for case in ("folded", "messages", "all change", "nan folded", "pass nan", "after"):
        assert all(rk[case] for rk in res), (case, [rk[case] for rk in res])
    for case, cls, words in (("length", "MismatchError", ("length", "worker 2")),
                             ("dtype", "MismatchError", ("dtype", "float64")),
                             ("identity", "MismatchError", ("different collective calls", "bucket")),
                             ("payload", "MismatchError", ("disagree", "worker 0")),
                             ("nan", "NonFiniteError", ("worker 1",)),
                             ("transport", "MismatchError", (f"'{name}'", f"'{OTHER[name]}'"))):
        got = [rk[case] for rk in res]
        assert [g[0] for g in got] == [cls] * N, (case, got)
        assert all(g[2] < BOUND for g in got), (case, got)
        assert all(w in g[1] for g in got for w in words), (case, got)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_simfabric_keeps_no_record_and_runs_every_handshake(name):
    """The SimFabric's modelled times must not change: its calls are never predicted."""
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric, **OPTIONS[name])
        x = torch.ones(1000)
        t.allreduce(x)
        first = (t.last_stats.messages, t.last_stats.modelled_time_s)
        _warm(t, x, k=6)
        return (_fold.schedule(ctx.fabric) is None and first[0] == t.last_stats.messages
                and first[1] == pytest.approx(t.last_stats.modelled_time_s, rel=1e-9))

    assert all(sc.launch(fn, N, backend="sim"))
