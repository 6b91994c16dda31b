"""Fault suite on real processes (gloo): what only real processes show -- gloo aborts on messages of an
unexpected size, kill -9, failure propagation to every rank -- plus the value and mismatch rules again on
real sockets. Every rank runs under an address-space cap (RLIMIT_AS: its size at start + 3 GiB), so an
allocation sized by a forged header fails the test instead of the machine. Every check asserts the
error class on every rank and a time far below the fabric timeout (``TIMEOUT`` = 60 s).
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import PeerFailure
from sparsecomm.payload import Payload

from tests._faults_common import CorruptingFabric, cap_address_space, outcome, run_in_place

pytestmark = pytest.mark.multiprocess

TIMEOUT = 60.0
BOUND = 10.0      # seconds: every rank must have its error well within this (vs TIMEOUT)


def _capped(ctx, case, **kw):
    cap_address_space()
    return CASES[case](ctx, **kw)


def _launch(case, n=3, services=(), **kw):
    return sc.launch(functools.partial(_capped, case=case, **kw), n, backend="gloo", timeout_s=TIMEOUT,
                     services=list(services))


# ----------------------------------------------------------------------------- values and mismatches
def _values_and_mismatches(ctx):
    r = ctx.rank
    out = {}
    for name in ("ring", "allgather", "native"):
        t = sc.transports.get(name, ctx.fabric)
        out[name, "int32 overflow"] = outcome(lambda: t.allreduce(torch.full((8,), 2**30, dtype=torch.int32)))
        out[name, "fp16 overflow"] = outcome(lambda: t.allreduce(torch.full((8,), 30000.0, dtype=torch.float16)))
        x = torch.ones(32)
        if r == 1:
            x[4] = float("nan")
        out[name, "nan"] = outcome(lambda: t.allreduce(x))
        out[name, "length"] = outcome(lambda: t.allreduce(torch.ones(9 + (r == 2))))
        out[name, "dtype"] = outcome(lambda: t.allreduce(torch.ones(9, dtype=torch.float64 if r else torch.float32)))
        out[name, "kind"] = outcome(lambda: t.allreduce(
            Payload("aligned", torch.ones(4), torch.Size([8]), torch.float32, indices=torch.arange(4))
            if r == 0 else torch.ones(8)))
        y = t.allreduce(torch.full((8,), [2**30, 2**30, -(2**30) - 5][r], dtype=torch.int32))
        out[name, "exact int32"] = (y.dtype == torch.int32 and torch.equal(y, torch.full((8,), 2**30 - 5,
                                                                                         dtype=torch.int32)))
        if name == "native":
            out[name, "estimated"] = t.last_stats.estimated and t.last_stats.estimated_bytes > 0
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=4)
    y = t.allreduce(torch.full((16,), 1000 * (r + 1), dtype=torch.int32))
    out["omnireduce int32"] = y.dtype == torch.int32 and torch.equal(y, torch.full((16,), 6000, dtype=torch.int32))
    out["omnireduce overflow"] = outcome(lambda: t.allreduce(torch.full((16,), 2**30, dtype=torch.int32)))
    out["after"] = torch.equal(sc.transports.get("ring", ctx.fabric).allreduce(torch.ones(5)), torch.full((5,), 3.0))
    # last: ranks that disagree on the transport itself (this ends the job: fail-stop)
    name = "native" if r == 1 else "ring"
    out["ring vs native"] = outcome(lambda: sc.transports.get(name, ctx.fabric).allreduce(torch.ones(8)))
    return out


def test_values_and_negotiated_fields_on_real_processes():
    res = _launch("values")
    expect = {"int32 overflow": "SumOverflowError", "fp16 overflow": "SumOverflowError", "nan": "NonFiniteError",
              "length": "MismatchError", "dtype": "MismatchError", "kind": "MismatchError"}
    for name in ("ring", "allgather", "native"):
        for case, cls in expect.items():
            got = [rk[name, case] for rk in res]
            assert [g[0] for g in got] == [cls] * 3, (name, case, got)
            assert all(g[2] < BOUND for g in got), (name, case, got)
        assert all(rk[name, "exact int32"] for rk in res), name
    assert all(rk["native", "estimated"] for rk in res)
    assert [rk["ring vs native"][0] for rk in res] == ["MismatchError"] * 3, res
    assert "'native'" in res[0]["ring vs native"][1] and "'ring'" in res[0]["ring vs native"][1]
    assert [rk["omnireduce overflow"][0] for rk in res] == ["SumOverflowError"] * 3
    assert all(rk["omnireduce int32"] and rk["after"] for rk in res)


# ----------------------------------------------------------------------------- one rank sees the fault
def _ring_vs_allgather(ctx):
    name = "allgather" if ctx.rank == 1 else "ring"
    return outcome(lambda: sc.transports.get(name, ctx.fabric).allreduce(torch.ones(64)))


def _corrupt_handshake(ctx, which):
    """Rank 1 is a corrupting peer: it rewrites a field of its agreement header (ring) or of its allgather
    header on the wire, without fixing the checksum, toward one peer only."""
    from sparsecomm.transports._handshake import HANDSHAKE_TAG

    f = ctx.fabric
    if ctx.rank == 1:
        def rw(t, dst, tag):
            if tag == HANDSHAKE_TAG and dst == 2:
                out = t.detach().clone()
                out[10] += 1000          # an announced count, rewritten
                return out
        f = CorruptingFabric(f, rw)
    if which == "ring":
        return outcome(lambda: sc.transports.get("ring", f).allreduce(torch.ones(64)))
    p = Payload("sparse", torch.ones(4), torch.Size([64]), torch.float32, indices=torch.arange(4))
    return outcome(lambda: sc.transports.get("allgather", f).allreduce(p))


def _forged_allgather_length(ctx):
    """Rank 0 announces 2.5e8 values (checksum recomputed) to every peer: nothing may be allocated
    from it (under the address-space cap, a 1 GB allocation per victim would show)."""
    from sparsecomm.transports._handshake import HANDSHAKE_TAG, _PRE, _checksum

    f = ctx.fabric
    if ctx.rank == 0:
        def rw(t, dst, tag):
            if tag == HANDSHAKE_TAG:
                out = t.detach().clone()
                out[_PRE + 6] = 250_000_000
                out[_PRE + 9] = 250_000_000     # indices count
                out[-1] = _checksum(out)
                return out
        f = CorruptingFabric(f, rw)
    p = Payload("sparse", torch.ones(4), torch.Size([64]), torch.float32, indices=torch.arange(4))
    return outcome(lambda: sc.transports.get("allgather", f).allreduce(p))


@pytest.mark.parametrize("case, cls", [
    ("ring_vs_allgather", "MismatchError"),
    ("corrupt_ring", "MalformedMessage"),
    ("corrupt_allgather", "MalformedMessage"),
    ("forged_allgather_length", "MalformedMessage"),
])
def test_a_fault_seen_by_one_rank_is_an_error_on_every_rank_quickly(case, cls):
    # four ranks for the transport disagreement: allgather then sends one header more than the ring's
    # dissemination receives, so a rank is left waiting unless the failure is propagated
    res = _launch(case, n=4 if case == "ring_vs_allgather" else 3)
    honest = res if case == "ring_vs_allgather" else [res[r] for r in range(3) if r != (1 if "corrupt" in case else 0)]
    assert [o[0] for o in honest] == [cls] * len(honest), res
    assert all(o[0] is not None and o[2] < BOUND for o in res), res


# ----------------------------------------------------------------------------- forged packets to services
def _forged_k0(ctx):
    """Worker 1 tells the dedicated aggregator it sends 2^40 position-0 blocks; the aggregator must
    reject the header (not allocate), answer every worker, and go on serving the next job."""
    from sparsecomm.transports.omnireduce import wire

    f = ctx.fabric
    if ctx.rank == 1:
        def rw(t, dst, tag):
            if tag == wire.TAG_HDR_UP:
                out = t.detach().clone()
                out.view(torch.int64)[wire.F_K0] = 2**40
                out.view(torch.int64)[wire.F_AGGS] = 10**13
                return out
        f = CorruptingFabric(f, rw)
    t = sc.transports.get("omnireduce", f, block_size=16, lanes=4, deployment="dedicated", num_aggregators=1)
    return outcome(lambda: t.allreduce(torch.ones(64)))


def _forged_switch_packet(ctx):
    from sparsecomm.transports.switchml import dataplane as dp

    t = sc.transports.get("switch", ctx.fabric, pool_size=4)
    if ctx.rank == 0:
        rows = torch.zeros((t.burst, dp.HEADER + t.slot_elems), dtype=torch.int32)
        rows[:, dp.F_TYPE], rows[:, dp.F_NW], rows[:, dp.F_WORKER] = dp.T_DATA, 32, 31
        rows[:, dp.F_SLOT] = torch.arange(1, t.burst + 1)
        ctx.fabric.send(rows, t.switch, dp.TAG_UP)
        # a message twice the burst: gloo would abort a receive of one burst; the switch takes it
        ctx.fabric.send(torch.cat([rows, rows]), t.switch, dp.TAG_UP)
    return outcome(lambda: t.allreduce(torch.ones(300) * (ctx.rank + 1)))


def test_forged_headers_and_packets_to_the_aggregator_and_the_switch():
    res = _launch("forged_k0", n=2, services=["omnireduce-agg:0"])
    assert [o[0] for o in res] == ["MalformedMessage"] * 2 and all(o[2] < BOUND for o in res), res
    assert "worker 1" in res[0][1]
    # the switch drops the forged packets (nothing reaches a register, a multicast or an allocation) and
    # tells every worker, naming the sender: it cannot tell them from corrupted packets a job needs
    res = _launch("forged_switch_packet", services=["switch"])
    assert [o[0] for o in res] == ["MalformedMessage"] * 3 and all(o[2] < BOUND for o in res), res
    assert all("worker 0" in o[1] for o in res), res


# ----------------------------------------------------------------------------- kill -9
def _kill(ctx, role, transport, outdir):
    """Every worker runs one good call, then ``role`` is killed (SIGKILL) and every worker calls again;
    the survivors raise (their errors reach the launcher), and the time each took is in the error."""
    f = ctx.fabric
    store = f._store
    store.set(f"pid/{ctx.rank}", str(os.getpid()))
    if transport == "switch":
        t = sc.transports.get("switch", f, pool_size=4)
    elif transport == "omnireduce":
        t = sc.transports.get("omnireduce", f, block_size=16, lanes=4, deployment="dedicated", num_aggregators=1)
    else:
        t = sc.transports.get(transport, f)
    t.allreduce(torch.ones(64))
    store.set(f"first/{ctx.rank}", "1")
    if role == "worker" and ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if role == "service" and ctx.rank == 0:
        # (every worker's first call is over: the one a dead service fails is the second)
        store.wait([f"first/{r}" for r in range(ctx.world_size)])
        workers = {int(store.get(f"pid/{r}")) for r in range(ctx.world_size)}
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) not in workers and int(pid) != os.getpid():
                try:
                    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == os.getppid():     # a sibling that is not a worker: the service
                    os.kill(int(pid), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t.allreduce(torch.ones(64))
    except Exception as e:  # noqa: BLE001
        with open(os.path.join(outdir, f"rank{ctx.rank}.txt"), "w") as fh:
            fh.write(f"{type(e).__name__} {time.monotonic() - t0:.3f}")
        raise
    return None


@pytest.mark.parametrize("role, transport, dead", [
    ("worker", "ring", "worker 2"),
    ("worker", "native", "worker 2"),
    ("worker", "switch", "worker 2"),           # named, not the switch that stopped because of it
    ("service", "switch", "service 'switch'"),
    ("service", "omnireduce", "service 'omnireduce-agg:0'"),
])
def test_kill_9_of_any_role_stops_every_rank_quickly_naming_the_dead_one(role, transport, dead, tmp_path):
    services = {"switch": ["switch"], "omnireduce": ["omnireduce-agg:0"]}.get(transport, [])
    t0 = time.monotonic()
    with pytest.raises(PeerFailure) as info:
        _launch("kill", services=services, role=role, transport=transport, outdir=str(tmp_path))
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert dead in str(info.value), str(info.value)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    survivors = [r for r in range(3) if not (role == "worker" and r == 2)]
    for r in survivors:
        line = next((ln for ln in notes.splitlines() if ln.startswith(f"worker {r}:")), None)
        assert line is not None and "PeerFailure" in line and dead in line, notes
        kind, seconds = (tmp_path / f"rank{r}.txt").read_text().split()
        assert kind == "PeerFailure" and float(seconds) < BOUND, (r, kind, seconds)


IN_PLACE_KILL = '''
import os, signal, sys, time, torch
import sparsecomm as sc

def fn(ctx):
    t = sc.transports.get(sys.argv[1], ctx.fabric)
    x = torch.ones(int(sys.argv[2]))
    for _ in range(3):                  # native: the next call is predicted, so it goes straight to gloo
        t.allreduce(x)
    ctx.fabric.barrier()
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t.allreduce(x)
        out = "None -"
    except Exception as e:
        out = f"{type(e).__name__} {e}"
    with open(f"out{ctx.rank}.txt", "w") as fh:
        fh.write(f"{time.monotonic() - t0:.3f} {out}")

if __name__ == "__main__":
    try:
        sc.launch(fn, 3, backend="gloo", timeout_s=30)
    except Exception:
        pass
'''


@pytest.mark.parametrize("transport, numel", [
    ("native", 64),             # gathered and summed locally (all_gather)
    ("native", 100_000),        # all_reduce
])
def test_kill_9_under_torchrun_every_survivor_names_the_dead_worker(transport, numel, tmp_path):
    """In place (torchrun's environment, no agent to stop the survivors, so no launcher writes a failure
    record): a collective on a lost connection names the dead worker, as a point-to-point wait does."""
    (tmp_path / "job.py").write_text(IN_PLACE_KILL)
    codes = run_in_place(tmp_path / "job.py", 3, tmp_path, args=(transport, str(numel)), torchrun=False)
    logs = "\n".join((tmp_path / f"log{r}.txt").read_text() for r in range(3))
    assert codes == [0, 0, -signal.SIGKILL], (codes, logs)
    for r in (0, 1):
        seconds, kind, text = (tmp_path / f"out{r}.txt").read_text().split(" ", 2)
        assert kind == "PeerFailure" and "worker 2" in text and float(seconds) < 5.0, (r, seconds, kind, text)


TORCHRUN_RESULTS = '''
import json, os, time
import torch.distributed as dist
import sparsecomm as sc
from sparsecomm.launch import results

def returns(ctx):
    return ctx.rank

def raises_late(ctx):
    if ctx.rank == 1:
        time.sleep(0.5)           # rank 0 has returned from fn: it waits in the results gather
        raise ValueError("rank one fails late")
    return ctx.rank

def crafted(result):              # rank 1's result header claims a tensor of 100,000 dimensions
    doc = json.dumps(["T", "torch.float32", [1] * 100_000, 0, 4]).encode()
    return len(doc).to_bytes(8, "little") + doc + bytes(4)

def outcome(fn):
    t0 = time.monotonic()
    try:
        sc.launch(fn, 2, backend="gloo", timeout_s=30)
        return [None, "", time.monotonic() - t0]
    except Exception as e:
        return [type(e).__name__, str(e), time.monotonic() - t0]

if __name__ == "__main__":
    dist.init_process_group("gloo")          # one group for both launches (launch runs in place)
    rank = dist.get_rank()
    honest = results.encode_result
    if rank == 1:
        results.encode_result = crafted
    out = {"crafted": outcome(returns)}
    results.encode_result = honest
    out["raises"] = outcome(raises_late)
    with open(f"out{rank}.json", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()
'''


def test_under_torchrun_a_failed_or_crafted_result_is_a_library_error_on_every_rank(tmp_path):
    """The results gather after ``fn`` (launch in place): a result header crafted by rank 1 is
    MalformedMessage on both ranks; rank 1 raising after rank 0 returned is, on rank 0, a PeerFailure
    naming worker 1 and its error (not gloo's "Connection closed by peer"); each in well under 5 s."""
    import json

    (tmp_path / "job.py").write_text(TORCHRUN_RESULTS)
    codes = run_in_place(tmp_path / "job.py", 2, tmp_path)
    logs = (tmp_path / "log0.txt").read_text()
    assert codes == [0], logs
    out = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert [o["crafted"][0] for o in out] == ["MalformedMessage"] * 2, out
    assert "rank 1" in out[0]["crafted"][1], out
    assert [o["raises"][0] for o in out] == ["PeerFailure", "ValueError"], out
    assert all(s in out[0]["raises"][1] for s in ("worker 1", "ValueError", "rank one fails late")), out
    assert all(o[k][2] < 5.0 for o in out for k in o), out


CASES = {
    "values": _values_and_mismatches,
    "ring_vs_allgather": _ring_vs_allgather,
    "corrupt_ring": functools.partial(_corrupt_handshake, which="ring"),
    "corrupt_allgather": functools.partial(_corrupt_handshake, which="allgather"),
    "forged_allgather_length": _forged_allgather_length,
    "forged_k0": _forged_k0,
    "forged_switch_packet": _forged_switch_packet,
    "kill": _kill,
}
