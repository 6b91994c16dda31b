"""Timelines (sparsecomm.trace, sparsecomm.fabric.trace): valid trace-event JSON, events that match the ledger
and the modelled clock on the SimFabric, nothing changed when recording is off, per-rank wall-clock traces of real processes
merged into one file, and a modelled and a measured run side by side."""

from __future__ import annotations

import json
import numbers
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.errors import InvalidValueError
from sparsecomm import trace
from sparsecomm.fabric import trace as recorder

#: the top-level keys Perfetto's JSON importer reads; it ignores the rest of a file after any other key
PERFETTO_KEYS = {"traceEvents", "displayTimeUnit", "otherData", "systemTraceEvents", "metadata"}


def check_trace_event_format(data: dict) -> list[dict]:
    """Assert the JSON object format of the trace-event format as Perfetto reads it; return the X events."""
    assert isinstance(data, dict) and next(iter(data)) == "traceEvents", list(data)
    assert set(data) <= PERFETTO_KEYS, set(data) - PERFETTO_KEYS
    assert data.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e["ph"], str) and len(e["ph"]) == 1, e
        assert isinstance(e["name"], str), e
        assert isinstance(e["ts"], numbers.Real) and not isinstance(e["ts"], bool), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["pid"] >= 0 and e["tid"] >= 0, e
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], numbers.Real) and e["dur"] >= 0, e
            assert isinstance(e.get("args", {}), dict)
            if "bind_id" in e:
                assert isinstance(e["bind_id"], int) and 0 <= e["bind_id"] < 2 ** 53
                assert e.get("flow_out") is True or e.get("flow_in") is True
        else:
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
    named_threads = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    named_procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    xs = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in xs} <= named_threads and {e["pid"] for e in xs} <= named_procs
    tids = Counter((e["tid"], e["pid"]) for e in events)
    assert len({t for t, _ in tids}) == len(tids), "a tid in two processes"
    return xs


def _ring(ctx, numel: int = 3000, compute: float = 0.0):
    t = sc.transports.get("ring", ctx.fabric)
    ctx.fabric.compute(compute * (ctx.rank + 1))
    g = ctx.generator(ctx.rank)
    out = t.allreduce(torch.randn(numel, generator=g))
    s = t.last_stats
    return out, s.modelled_time_s, s.messages, s.messages_received, ctx.fabric.now()


def test_sim_ring_trace_matches_the_ledger_and_the_modelled_clock(tmp_path):
    path = tmp_path / "ring.json"
    with trace.record(path):
        res = sc.launch(_ring, world_size=4, backend="sim", network=sc.Network(stragglers={2: 1.5}))
    assert trace.active() is None
    data = json.loads(path.read_text())
    xs = check_trace_event_format(data)
    assert data["otherData"]["sparsecomm"]["runs"] == [{"pid_base": 0, "clock": "modelled", "job": None}]
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"modelled rank {r}" for r in range(4)}
    for r, (_, modelled, sent, received, _) in enumerate(res):
        calls = [e for e in xs if e["pid"] == r and e["cat"] == "call"]
        assert len(calls) == 1 and calls[0]["name"] == "ring allreduce"
        assert calls[0]["dur"] == modelled * 1e6           # the call lasts what the transport reports
        assert calls[0]["args"]["messages"] == sent
        sends = [e for e in xs if e["pid"] == r and e["name"] == "send"]
        recvs = [e for e in xs if e["pid"] == r and e["name"] == "recv"]
        assert len(sends) == sent > 0 and len(recvs) == received == sent
        assert all(calls[0]["ts"] <= e["ts"] and e["ts"] + e["dur"] <= calls[0]["ts"] + calls[0]["dur"] + 1e-6
                   for e in sends + recvs)
        compute = [e for e in xs if e["pid"] == r and e["name"] == "compute"]
        assert len(compute) == 1 and compute[0]["ts"] == 0.0 and compute[0]["dur"] == 0.0
    # every message is one flow: a send's bind_id is one receive's, and the receive ends after the send began
    out = {e["bind_id"]: e for e in xs if e.get("flow_out")}
    into = {e["bind_id"]: e for e in xs if e.get("flow_in")}
    assert len(out) == len(into) == sum(r[2] for r in res) and out.keys() == into.keys()
    for k, s in out.items():
        assert into[k]["args"]["src"] == s["pid"] and s["args"]["dst"] == into[k]["pid"]
        assert into[k]["ts"] >= s["ts"] + s["dur"]        # received after its last byte left (Perfetto: end >= start)
    waits = [e for e in xs if e["name"] == "wait"]
    assert waits and all(e["dur"] > 0 and e["tid"] == e["pid"] * recorder.LANE_STRIDE + recorder.LANES["waits"]
                         for e in waits)
    ends = {(e["pid"], e["args"]["src"], e["args"]["tag"], round(e["ts"], 6)) for e in into.values()}
    assert all((w["pid"], w["args"]["src"], w["args"]["tag"], round(w["ts"] + w["dur"], 6)) in ends for w in waits)


def test_sim_compute_is_on_its_own_track(tmp_path):
    path = tmp_path / "c.json"
    with trace.record(path):
        sc.launch(_ring, world_size=2, backend="sim", network=sc.Network(stragglers={1: 2.0}))
        sc.launch(functools_partial_ring_compute, world_size=2, backend="sim",
                  network=sc.Network(stragglers={1: 2.0}))
    xs = check_trace_event_format(json.loads(path.read_text()))
    comp = {e["pid"]: e for e in xs if e["name"] == "compute" and e["pid"] >= recorder.RUN_STRIDE}
    assert comp[1000]["dur"] == pytest.approx(1e-3 * 1e6) and comp[1001]["dur"] == pytest.approx(2 * 2e-3 * 1e6)
    assert comp[1000]["tid"] == 1000 * recorder.LANE_STRIDE + recorder.LANES["compute"]
    call = next(e for e in xs if e["pid"] == 1001 and e["cat"] == "call")
    assert call["ts"] == pytest.approx(4e-3 * 1e6)        # the call starts when the straggler's compute ends
    names = {e["pid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["name"] == "process_name"}
    assert names[1] == "modelled rank 1" and names[1001] == "modelled rank 1 (run 2)"


def functools_partial_ring_compute(ctx):
    return _ring(ctx, compute=1e-3)


def test_recording_changes_neither_results_nor_modelled_times(tmp_path):
    net = sc.Network(bandwidth_gbps=10, latency_us=5, stragglers={1: 1.3})
    off = sc.launch(functools_partial_ring_compute, world_size=4, backend="sim", network=net)
    with trace.record(tmp_path / "on.json") as rec:
        on = sc.launch(functools_partial_ring_compute, world_size=4, backend="sim", network=net)
    assert rec.events
    for a, b in zip(off, on):
        assert torch.equal(a[0], b[0])
        assert a[1:] == b[1:]                   # modelled time, messages, the clock after: bit for bit


def test_switch_service_is_a_named_process(tmp_path):
    path = tmp_path / "switch.json"

    def fn(ctx):
        return sc.transports.get("switch", ctx.fabric).allreduce(torch.ones(512))[0].item()

    assert sc.launch(fn, world_size=2, backend="sim", trace=str(path)) == [2.0, 2.0]
    data = json.loads(path.read_text())
    xs = check_trace_event_format(data)
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names[0] == "modelled rank 0" and names[2] == "modelled switch", names
    assert any(e["pid"] == 2 and e["name"] == "recv" for e in xs)


def test_environment_variable_records_a_launch(tmp_path, monkeypatch):
    path = tmp_path / "env" / "t.json"
    monkeypatch.setenv(trace.ENV, str(path))
    sc.launch(_ring, world_size=2, backend="sim")
    assert sum(e.get("cat") == "call" for e in json.loads(path.read_text())["traceEvents"]) == 2


def _fails_on_rank_1(ctx):
    t = sc.transports.get("ring", ctx.fabric)
    t.allreduce(torch.ones(100))
    if ctx.rank == 1:
        raise ValueError("boom")
    return t.allreduce(torch.ones(100))


def test_a_failed_run_writes_its_timeline(tmp_path):
    path = tmp_path / "failed.json"
    with pytest.raises(ValueError, match="boom"):
        sc.launch(_fails_on_rank_1, world_size=2, backend="sim", trace=str(path))
    assert trace.active() is None
    xs = check_trace_event_format(json.loads(path.read_text()))
    assert sum(e["cat"] == "call" and "error" not in e["args"] for e in xs) == 2      # the first call of each
    assert [e["pid"] for e in xs if e["cat"] == "call" and "error" in e["args"]] == [0]   # rank 0's second


def test_one_recording_at_a_time_and_bad_files(tmp_path):
    with trace.record(tmp_path / "a.json"):
        with pytest.raises(InvalidValueError, match="already being recorded"):
            trace.start(tmp_path / "b.json")
    assert trace.active() is None and trace.stop() is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": []}')
    with pytest.raises(InvalidValueError, match="not a timeline written by sparsecomm.trace"):
        trace.merge([bad], tmp_path / "m.json")
    with pytest.raises(InvalidValueError, match="align"):
        trace.merge([bad], align="start")
    assert trace.rank_path("out/t.json", 3) == "out/t.rank3.json"


def _gloo_ring(ctx):
    torch.set_num_threads(1)
    t = sc.transports.get("ring", ctx.fabric)
    out = t.allreduce(torch.full((20000,), float(ctx.rank + 1)))
    s = t.last_stats
    return out[0].item(), s.messages, s.messages_received, s.wall_time_s


@pytest.mark.multiprocess
def test_gloo_ranks_record_wall_clock_traces_merged_and_side_by_side(tmp_path, capsys):
    measured = tmp_path / "measured.json"
    res = sc.launch(_gloo_ring, world_size=2, backend="gloo", trace=str(measured), timeout_s=60)
    assert [r[0] for r in res] == [3.0, 3.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measured.json"]     # the ranks' parts joined
    data = json.loads(measured.read_text())
    xs = check_trace_event_format(data)
    assert [r["clock"] for r in data["otherData"]["sparsecomm"]["runs"]] == ["wall"]
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "measured rank 0", 1: "measured rank 1"}
    for r, (_, sent, received, wall) in enumerate(res):
        (call,) = [e for e in xs if e["pid"] == r and e["cat"] == "call"]
        assert call["name"] == "ring allreduce" and "modelled_time_s" not in call["args"]
        # wall clock since the recorder started: the call's span covers the time the transport measured
        assert call["ts"] > 0 and wall * 1e6 <= call["dur"] <= wall * 1e6 + 200e3
        # and the CPU time of the thread that ran it, within its span
        assert 0 < call["args"]["cpu_us"] <= call["dur"] + 1e3
        assert sum(e["pid"] == r and e["name"] == "send" for e in xs) == sent
        assert sum(e["pid"] == r and e["name"] == "recv" for e in xs) == received
    out = {e["bind_id"]: e for e in xs if e.get("flow_out")}
    into = {e["bind_id"]: e for e in xs if e.get("flow_in")}
    assert out and out.keys() == into.keys()                                   # flows across the ranks' files
    assert all(into[k]["ts"] >= out[k]["ts"] for k in out)     # a receive completes after its send's post

    # the same call modelled, and both in one file, first calls aligned
    modelled = tmp_path / "modelled.json"
    sc.launch(_gloo_ring, world_size=2, backend="sim", trace=str(modelled))
    both = tmp_path / "both.json"
    assert trace.main(["merge", str(modelled), str(measured), "-o", str(both)]) == 0
    assert "both.json" in capsys.readouterr().out
    data = json.loads(both.read_text())
    xs = check_trace_event_format(data)
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "modelled rank 0", 1: "modelled rank 1", 1000: "measured rank 0", 1001: "measured rank 1"}
    assert all(("cpu_us" in e["args"]) == (e["pid"] >= 1000) for e in xs if e["cat"] == "call")   # (measured only)
    first = {k: min(e["ts"] for e in xs if e["cat"] == "call" and e["pid"] // 1000 == k) for k in (0, 1)}
    assert first[0] == pytest.approx(first[1])
    assert Counter(e["name"] for e in xs if e["cat"] == "call") == {"ring allreduce": 4}
    assert not {e["bind_id"] for e in xs if e["pid"] < 1000 and "bind_id" in e} \
        & {e["bind_id"] for e in xs if e["pid"] >= 1000 and "bind_id" in e}


def _late_sender(ctx):
    f = ctx.fabric
    dist.barrier()      # (both ranks start together: the receiver then waits the sender's whole sleep, not less)
    if ctx.rank == 1:
        time.sleep(0.3)
        f.send(torch.ones(4), 0, tag=7)
        return None
    buf = torch.zeros(4)
    work = f.irecv(buf, 1, tag=7)
    t0 = time.perf_counter()
    assert f.wait_any([work]) == 0
    return time.perf_counter() - t0


@pytest.mark.multiprocess
def test_gloo_a_wait_for_any_receive_is_booked_to_the_receive_that_ended_it(tmp_path):
    """The time a rank blocks in ``wait_any`` (the roles' scheduler's wait for one of several receives) is a
    wait on the timeline, for the receive that ended it, not a gap with a wait of no length at its end."""
    path = tmp_path / "t.json"
    res = sc.launch(_late_sender, world_size=2, backend="gloo", trace=str(path), timeout_s=60)
    xs = check_trace_event_format(json.loads(path.read_text()))
    (wait,) = [e for e in xs if e["pid"] == 0 and e["name"] == "wait"]
    assert wait["args"]["tag"] == 7 and wait["args"]["src"] == 1
    assert 0.2e6 <= wait["dur"] <= res[0] * 1e6 + 1e3      # (the sender slept 0.3 s; within the blocked time)
