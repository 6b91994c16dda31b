"""The agreement folded into the data (``sparsecomm.transports._fold``): a repeated ``native`` call skips
its handshake, and workers that then disagree still get the handshake's error on every worker.

The record and the prediction are checked alone; then, on real gloo processes, every way a worker can
leave a predicted call (another length, dtype, a gather, another transport, all of them at once) and
the non-finite rules on a folded call.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.payload import Payload
from sparsecomm.transports import _fold

from tests._faults_common import cap_address_space, outcome

TIMEOUT = 60.0
BOUND = 10.0      # seconds: every rank has its error well within this (vs TIMEOUT)


def _fold_of(key, numel=4, log=None):
    return _fold.Fold(key, numel, torch.float32, torch.device("cpu"),
                      (lambda t: log.append((key, t.numel(), bool(torch.isnan(t).all())))) if log is not None
                      else (lambda t: None))


def test_a_successor_is_predicted_after_it_followed_twice_in_a_row():
    s = _fold.Schedule()
    a, b = _fold_of("a"), _fold_of("b")
    s.record("a", a)
    assert s.predicted() is None
    s.record("b", b)             # a -> b once
    s.record("a", a)             # b -> a once
    s.record("b", b)             # a -> b twice
    assert s.predicted() is None  # b -> a only once
    s.record("a", a)             # b -> a twice
    assert s.predicted() is b
    s.record("b", b)
    assert s.predicted() is a
    s.record("c")                # b -> c: c is not foldable
    assert s.predicted() is None
    s.record("a", a)
    assert s.predicted() is b     # a -> b is still confirmed
    s.record("b", b)
    assert s.predicted() is None  # b -> c once since


def test_runs_of_equal_calls_are_predicted_by_their_run_length():
    s = _fold.Schedule()
    k, m = _fold_of("k"), _fold_of("m")
    s.record("k", k)
    s.record("k", k)
    s.record("k", k)
    assert s.predicted() is k     # k -> k twice (a run length not seen before: k alone)
    s.record("m", m)
    guesses = []
    for _ in range(5):           # rounds of k k k k m: each run length predicts its own successor
        for key, fold in (("k", k), ("k", k), ("k", k), ("k", k), ("m", m)):
            guesses.append(s.predicted())
            s.record(key, fold)
    want = [k, k, k, k, m]
    assert guesses[10:] == want * 3, guesses                          # from the third round on
    # the only wrong guess: the first end of a run of a length not seen before (k predicted, m came)
    assert [i for i, (g, w) in enumerate(zip(guesses, want * 5)) if g is not None and g is not w] == [4]
    endless = _fold.Schedule()
    for _ in range(3 * _fold.MAX_RUN):
        endless.record("k", k)
    assert endless.predicted() is k


def test_a_second_run_of_a_call_is_predicted_once_confirmed_whatever_the_first_run_left():
    """A run of ``k`` (one frontend's steps), other calls, then another run of ``k`` (the next frontend's, the same
    key): the first run met each run length once, and those exact contexts, seen once, must not hide the general
    context that the second run confirms: from its fourth call on ``k`` is predicted (and folds), not only once the
    run is longer than any before it (at most MAX_RUN calls)."""
    s = _fold.Schedule()
    k, c = _fold_of("k"), _fold_of("c")
    for _ in range(40):
        s.record("k", k)
    for _ in range(3):
        s.record("c", c)
    guesses = []
    for _ in range(40):
        guesses.append(s.predicted())
        s.record("k", k)
    assert guesses[3:] == [k] * 37, [i for i, g in enumerate(guesses) if g is not k]


def test_a_deviation_joins_with_nan_of_the_predicted_size_and_the_next_record_replaces_the_guess():
    log: list = []
    s = _fold.Schedule()
    k = _fold_of("k", numel=7, log=log)
    for _ in range(3):
        s.record("k", k)
    assert s.predicted() is k
    s.deviate(k)
    assert log == [("k", 7, True)] and s.deviated == 1
    s.record("x")                     # the call that came instead
    s.record("k", k)
    s.record("k", k)
    assert s.predicted() is None      # (k, run 1) -> x, then k once since
    s.record("k", k)
    s.record("k", k)
    assert s.predicted() is k


def test_take_records_a_predicted_call_as_predicts_then_record_do():
    # two schedules fed the same calls, one through take(), one through predicts() then record(): the same answers
    # and the same record after every call (runs of several lengths, a bucket that changes, a step that jumps)
    prefix = ("native", ("numel", 4))
    calls = [(c, st, 0) for st in range(1, 40) for c in ((7, 7, 9) if st % 5 else (7, 9))]
    calls[50] = (8, calls[50][1], 0)          # another bucket once
    calls[70:] = [(c, st + 3, r) for c, st, r in calls[70:]]    # a step skipped
    folds = {}

    def fold(code, step, last_step):
        key = prefix + (("call", code, 0, None if last_step is None else step - last_step),)
        return folds.setdefault(key, _fold.Fold(key, 4, torch.float32, torch.device("cpu"), lambda t: None))

    a, b = _fold.Schedule(), _fold.Schedule()
    taken = 0
    for code, step, rnd in calls:
        got = b.predicts(prefix, code, step, rnd)
        key = a.take(prefix, code, step, rnd)
        assert (key is None) == (got is None)
        if got is not None:
            assert key == got[0]
            b.record(*got, step=step)
            taken += 1
        else:           # (not predicted: made and recorded as a call with its handshake)
            f = fold(code, step, a._step)
            assert f.key == prefix + b.key_of(code, step, rnd)
            a.record(f.key, f, step=step)
            b.record(f.key, f, step=step)
        assert (a._last, a._run, a._step, list(a._next.items())) == (b._last, b._run, b._step, list(b._next.items()))
    assert taken > len(calls) // 2


def test_the_record_is_bounded_alike_on_every_worker():
    s = _fold.Schedule()
    for i in range(3 * _fold.MAX_KEYS):
        s.record(i, _fold_of(i + 1))
    assert len(s._next) == _fold.MAX_KEYS


def test_fabrics_without_a_native_group_keep_no_record():
    def fn(ctx):
        return _fold.schedule(ctx.fabric) is None

    assert all(sc.launch(fn, 2, backend="sim"))


# ----------------------------------------------------------------------------- real processes
def _warm(t, x, k=4):
    """``k`` identical calls: from the fourth on, the call is predicted (and folds)."""
    for _ in range(k):
        t.allreduce(x)


def _cases(ctx):
    cap_address_space()
    r, f = ctx.rank, ctx.fabric
    nat = sc.transports.get("native", f)
    sched = _fold.schedule(f)
    out = {}
    x = torch.full((1000,), float(r + 1))
    before = sched.folded
    _warm(nat, x)
    y = nat.allreduce(x)
    out["folded"] = sched.folded - before >= 2 and torch.equal(y, torch.full((1000,), 6.0))
    out["folded stats"] = nat.last_stats.bytes_sent == nat.last_stats.estimated_bytes // 2  # no handshake
    # one worker leaves the predicted call: another length, another dtype
    _warm(nat, x)
    out["length"] = outcome(lambda: nat.allreduce(torch.ones(1000 + (r == 2))))
    _warm(nat, x)
    out["dtype"] = outcome(lambda: nat.allreduce(x.double() if r == 1 else x))
    # a gather instead of the predicted all-reduce
    _warm(nat, x)
    p = Payload("sparse", torch.ones(2, 4), torch.Size([40]), torch.float32, indices=torch.tensor([1, 3]),
                bucket_size=4)
    out["gather"] = outcome(lambda: nat.gather(p) if r == 0 else nat.allreduce(x))
    # every worker changes alike: the call runs unfolded, right
    _warm(nat, x)
    dev = sched.deviated
    y = nat.allreduce(torch.full((300,), float(r)))
    out["all change"] = torch.equal(y, torch.full((300,), 3.0)) and sched.deviated == dev + 1
    _warm(nat, x)
    mine = Payload("sparse", torch.ones(r + 1, 4), torch.Size([40]), torch.float32, indices=torch.arange(r + 1),
                   bucket_size=4)            # every worker gathers, each its own number of rows
    parts = nat.gather(mine)
    out["all gather"] = [q.indices.tolist() for q in parts] == [[0], [0, 1], [0, 1, 2]]
    # a predicted gather travels in one all_gather; a worker with more rows than its slot sends the rest
    def rows_of(j, count, table=400):
        return Payload("sparse", torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) + 100 * j,
                       torch.Size([table]), torch.float32, indices=torch.arange(count), bucket_size=4)

    for _ in range(4):
        nat.gather(rows_of(r, r + 1))
    before = sched.folded
    ok = True
    for counts in ((1, 2, 3), (2, 1, 0), (0, 0, 0), (30, 1, 2)):    # 30 rows overflow the slot (16 rows)
        parts = nat.gather(rows_of(r, counts[r]))
        want = [rows_of(j, c) for j, c in enumerate(counts)]
        ok = ok and all(torch.equal(q.indices, w.indices) and torch.equal(q.values.reshape(-1), w.values.reshape(-1))
                        for q, w in zip(parts, want))
    out["gather folded"] = ok and sched.folded - before == 4
    for _ in range(3):
        nat.gather(rows_of(r, 2))
    out["gather vs allreduce"] = outcome(lambda: nat.allreduce(x) if r == 2 else nat.gather(rows_of(r, 2)))
    for _ in range(4):
        nat.gather(rows_of(r, 2))
    out["gather vs gather"] = outcome(lambda: nat.gather(rows_of(r, 2, table=440 if r == 1 else 400)))
    for _ in range(4):
        nat.gather(rows_of(r, 2))
    y = nat.allreduce(torch.full((7,), 1.0))       # every worker leaves the predicted gather alike
    out["gather all change"] = torch.equal(y, torch.full((7,), 3.0))
    # NaN in a folded call: the non-finite rules, naming the worker
    _warm(nat, x)
    z = x.clone()
    if r == 1:
        z[5] = float("nan")
    before = sched.folded
    out["nan"] = outcome(lambda: nat.allreduce(z))
    out["nan folded"] = sched.folded == before + 1
    # nonfinite="pass": a NaN in element 0 is the data's; a deviator is still a MismatchError
    passing = sc.transports.get("native", f, nonfinite="pass")
    _warm(passing, x)
    z = x.clone()
    if r == 2:
        z[0] = float("nan")
    y = passing.allreduce(z)
    out["pass nan"] = bool(torch.isnan(y[0])) and torch.equal(y[1:], torch.full((999,), 6.0))
    _warm(passing, x)
    out["pass length"] = outcome(lambda: passing.allreduce(torch.ones(999 if r == 0 else 1000)))
    # fold_max_bytes=0 never folds
    never = sc.transports.get("native", f, fold_max_bytes=0)
    before = sched.folded
    _warm(never, x)
    out["never"] = sched.folded == before
    out["after"] = torch.equal(sc.transports.get("ring", f).allreduce(torch.ones(5)), torch.full((5,), 3.0))
    # last: another transport instead of the predicted call (fail-stop, as without the fold)
    _warm(nat, x)
    name = "ring" if r == 1 else "native"
    out["transport"] = outcome(lambda: sc.transports.get(name, f).allreduce(x))
    return out


@pytest.mark.multiprocess
def test_workers_leaving_a_folded_call_get_the_handshakes_error_on_every_worker():
    res = sc.launch(_cases, 3, backend="gloo", timeout_s=TIMEOUT)
    for case in ("folded", "folded stats", "all change", "all gather", "nan folded", "pass nan", "never",
                 "after", "gather folded", "gather all change"):
        assert all(rk[case] for rk in res), (case, [rk[case] for rk in res])
    for case, cls, words in (("length", "MismatchError", ("length", "worker 2")),
                             ("dtype", "MismatchError", ("dtype", "float64")),
                             ("gather", "MismatchError", ("disagree on the length: worker 0 has 40,",)),
                             ("nan", "NonFiniteError", ("worker 1",)),
                             ("gather vs allreduce", "MismatchError", ("length", "400", "1000")),
                             ("gather vs gather", "MismatchError", ("length", "worker 1 has 440")),
                             ("pass length", "MismatchError", ("length", "worker 0")),
                             ("transport", "MismatchError", ("'native'", "'ring'"))):
        got = [rk[case] for rk in res]
        assert [g[0] for g in got] == [cls] * 3, (case, got)
        assert all(g[2] < BOUND for g in got), (case, got)
        assert all(w in g[1] for g in got for w in words), (case, got)


def _posted_cases(ctx):
    cap_address_space()
    r, f = ctx.rank, ctx.fabric
    nat = sc.transports.get("native", f)
    passing = sc.transports.get("native", f, nonfinite="pass")
    sched = _fold.schedule(f)
    out = {}
    a = torch.full((100_000,), float(r + 1))     # 400 KB: all_reduce
    b = torch.full((1000,), float(r + 1))        # 4 KB: all_gather and a sum

    def round_(t, xa, xb):
        works = [t.start(xa.clone()), t.start(xb.clone())]
        return [w.wait() for w in works]

    for _ in range(4):
        round_(nat, a, b)
    before = sched.posted
    ya, yb = round_(nat, a, b)
    # both calls of a round posted at once on the calling thread, the second before the first completed
    out["posted"] = (sched.posted - before == 2 and torch.equal(ya, torch.full((100_000,), 6.0))
                     and torch.equal(yb, torch.full((1000,), 6.0)))
    # nonfinite="pass", a NaN in element 0 of the first call while the second is posted: the handshake
    # finds every worker agreeing, the NaN is the data's, the second call completes as posted
    for _ in range(4):
        round_(passing, a, b)
    z = a.clone()
    if r == 2:
        z[0] = float("nan")
    ya, yb = round_(passing, z, b)
    out["posted pass nan"] = (bool(torch.isnan(ya[0])) and torch.equal(ya[1:], torch.full((99_999,), 6.0))
                              and torch.equal(yb, torch.full((1000,), 6.0)))
    out["after"] = torch.equal(nat.allreduce(torch.ones(5)), torch.full((5,), 3.0))
    # last: worker 2 leaves the predicted call while the others post the next calls behind it: the
    # handshake's MismatchError on every worker (those with calls posted ahead stop the job)
    for _ in range(4):
        round_(nat, a, b)
    first = nat.start(torch.ones(777) if r == 2 else a.clone())
    later = [nat.start(b.clone()), nat.start(a.clone())]
    out["posted length"] = outcome(first.wait)
    for w in later:
        outcome(w.wait)
    # the calls posted ahead can never complete: the job stopped, so nothing after it runs out of step
    out["stopped"] = outcome(lambda: nat.allreduce(torch.ones(5)))
    return out


@pytest.mark.multiprocess
def test_calls_posted_ahead_complete_in_order_and_a_deviation_is_still_a_mismatch_on_every_worker():
    res = sc.launch(_posted_cases, 3, backend="gloo", timeout_s=TIMEOUT)
    for case in ("posted", "posted pass nan", "after"):
        assert all(rk[case] for rk in res), (case, [rk[case] for rk in res])
    got = [rk["posted length"] for rk in res]
    assert [g[0] for g in got] == ["MismatchError"] * 3, got
    assert all(g[2] < BOUND for g in got), got
    assert all("length" in g[1] for g in got), got
    stopped = [rk["stopped"] for rk in res]
    assert all(g[0] is not None and g[2] < BOUND for g in stopped), stopped
