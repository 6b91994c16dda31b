"""Timelines of a run's communication, per endpoint, in Chrome's trace-event JSON (Perfetto, chrome://tracing).

A :class:`Recorder` collects, while it is the process's active recording (:func:`record`, :func:`start`):

- every transport call (``Transport.run``): one complete event (``ph: "X"``) named ``"<transport> allreduce"``
  on the endpoint's ``calls`` track, from the call's start to its end, with its bytes and messages;
- every message: a ``"send"`` event on the sender's ``sends`` track and a ``"recv"`` event (of no length, when
  the receive completed) on the receiver's ``receives`` track, with peer, tag and bytes, joined by a flow
  arrow (the k-th message of a channel ``(src, dst, tag)`` at both ends); the receiver's wait for it, if it
  waited, a ``"wait"`` event on its ``waits`` track;
- modelled computation (``SimFabric.compute``): a ``"compute"`` event on the ``compute`` track.

Clocks. On the SimFabric the timestamps are the endpoint's modelled clock (``fabric.now()``): a call lasts
exactly the ``last_stats.modelled_time_s`` the transport reports; a send lasts while the sender's NIC
transmits it; a receive completes at the message's delivery, or at the receiver's clock when it took the
message if that is later, and the wait runs from that clock to the delivery. On a real fabric
(``TorchFabric``) they are the wall clock (``time.perf_counter``) since the recorder started: a send lasts
from its post until its completion was seen, a wait from its start until the receive completed. Nothing real is modelled, so on a real fabric
``compute`` records nothing (the computation is the gap between the calls).

Tracks. The process of an endpoint (``pid``) is its rank (services after the workers), named
``"modelled rank 0"`` or ``"measured rank 0"`` (a service: ``"modelled switch"``); its tracks
(``tid = pid * 8 + lane``, unique in a file) are ``calls``, ``sends``, ``receives``, ``waits`` and ``compute``. The
simulated world of one process records into one file, every endpoint a process of it; each rank of a real
job records its own file (:func:`rank_path`: ``trace.rank0.json``), which :func:`merge` joins, aligned on
the wall clock. :func:`merge` also puts a modelled and a measured run of the same code side by side in
one file (the second run's processes from pid 1000 on), each run shifted so that its first call starts
at the same time.

Cost. Recording off, each hook is one check of the module attribute :data:`recorder`; recording on, it
appends events and changes neither the results nor the modelled times.

Open a file at https://ui.perfetto.dev ("Open trace file") or in chrome://tracing ("Load"). The format is
the JSON object format of the Trace Event Format (``traceEvents``; ``otherData`` holds what :func:`merge`
reads); Horovod's ``HOROVOD_TIMELINE`` and ``torch.profiler``'s ``export_chrome_trace`` write the same.
The environment variable :data:`ENV` (``SPARSECOMM_TIMELINE=path``) makes :func:`sparsecomm.launch` record
its run to ``path``, as Horovod's does.

Command line: ``python -m sparsecomm.fabric.trace merge a.json b.json -o both.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from typing import Any, Iterator, Sequence

from ..errors import InvalidValueError

__all__ = ["Recorder", "record", "start", "stop", "active", "rank_path", "merge", "load", "ENV", "LANES"]

#: the environment variable that makes ``sparsecomm.launch`` record its run (``SPARSECOMM_TIMELINE=path``)
ENV = "SPARSECOMM_TIMELINE"
#: the tracks of an endpoint: name -> lane (``tid = pid * LANE_STRIDE + lane``)
LANES = {"calls": 1, "sends": 2, "receives": 3, "waits": 4, "compute": 5}
LANE_STRIDE = 8
#: the pids of the k-th run of a file are ``k * RUN_STRIDE + endpoint``
RUN_STRIDE = 1000
#: the format's version in ``otherData["sparsecomm"]``
VERSION = 1

#: the active recording, or ``None`` (recording off); the fabrics' and transports' hooks check it
recorder: "Recorder | None" = None
_state_lock = threading.Lock()


def _flow_id(*key: Any) -> int:
    """A flow's id (``bind_id``) from its key: the same at both ends, in any process; 52 bits (a JSON number)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big") >> 12


class _Run:
    """One run the recorder saw: a simulated world (modelled clock) or a real job's rank (wall clock)."""

    __slots__ = ("index", "modelled", "world_size", "services", "keep")

    def __init__(self, index: int, modelled: bool, world_size: int, services, keep: object) -> None:
        self.index = index
        self.modelled = modelled
        self.world_size = world_size
        self.services = services          # () -> {name: endpoint}
        self.keep = keep                  # the run's shared dict, held so that its id stays its own


class Recorder:
    """The events of one recording and their JSON file (see the module docstring).

    Args:
        path: where :meth:`write` puts the file.
        job: names the real job this process is a rank of: :func:`merge` aligns the files of one job on the
            wall clock into one set of processes (default: ``TORCHELASTIC_RUN_ID``, else
            ``MASTER_ADDR:MASTER_PORT``, else this recording alone).
    """

    def __init__(self, path: str | os.PathLike, *, job: str | None = None) -> None:
        self.path = os.fspath(path)
        self.job = job or os.environ.get("TORCHELASTIC_RUN_ID") or (
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ else uuid.uuid4().hex)
        self.origin = time.perf_counter()
        self.origin_unix_s = time.time()
        self.events: list[dict] = []
        self._runs: dict[int, _Run] = {}
        self._seq: dict[tuple, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ runs
    def _run(self, shared: dict, modelled: bool, world_size: int, services) -> _Run:
        run = self._runs.get(id(shared))
        if run is None:
            with self._lock:
                run = self._runs.get(id(shared))
                if run is None:
                    run = self._runs[id(shared)] = _Run(len(self._runs), modelled, world_size, services, shared)
        return run

    def _sim_run(self, world) -> _Run:
        return self._run(world.scratch, True, world.world_size, lambda: dict(world.service_ids))

    def _fabric_run(self, fabric) -> _Run:
        return self._run(fabric.world_scratch, fabric.modelled_time, fabric.world_size, fabric.services)

    def _us(self, run: _Run, t: float) -> float:
        """``t`` (seconds of the run's clock) as the file's microseconds."""
        return t * 1e6 if run.modelled else (t - self.origin) * 1e6

    def _event(self, run: _Run, name: str, cat: str, eid: int, lane: str, t0: float, t1: float,
               args: dict) -> dict:
        pid = run.index * RUN_STRIDE + eid
        ts = self._us(run, t0)
        ev = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(0.0, (t1 - t0) * 1e6),
              "pid": pid, "tid": pid * LANE_STRIDE + LANES[lane], "args": args}
        self.events.append(ev)
        return ev

    def _flow(self, run: _Run, ev: dict, end: str, src: int, dst: int, tag: int) -> None:
        """Join ``ev`` to the other end of its message: the k-th on ``(src, dst, tag)`` at both ends."""
        key = (run.index, src, dst, tag, end)
        with self._lock:
            k = self._seq.get(key, 0)
            self._seq[key] = k + 1
        ev["bind_id"] = _flow_id(run.index, src, dst, tag, k)
        ev["flow_out" if end == "send" else "flow_in"] = True

    # ---------------------------------------------------- hooks: the SimFabric
    def sim_sent(self, world, src: int, dst: int, tag: int, nbytes: int, start: float, tx_end: float,
                 dropped: bool) -> None:
        """A message of the simulated ``world`` left ``src``'s NIC from ``start`` to ``tx_end`` (modelled);
        ``dropped``: the network model lost it."""
        run = self._sim_run(world)
        args = {"dst": dst, "tag": tag, "bytes": nbytes}
        if dropped:
            args["dropped"] = True
        ev = self._event(run, "send", "message", src, "sends", start, tx_end, args)
        if not dropped:
            self._flow(run, ev, "send", src, dst, tag)

    def _received(self, run: _Run, src: int, dst: int, tag: int, nbytes: int, t_wait: float,
                  t_done: float) -> None:
        """A receive completed at ``t_done`` after ``dst`` waited for it since ``t_wait`` (the run's clock): its
        wait, if any, and the receive itself, an event of no length at ``t_done`` that ends the message's flow
        (Perfetto binds a flow's end to an event that starts after the flow's start: the wait may not)."""
        args = {"src": src, "tag": tag, "bytes": nbytes}
        if t_done > t_wait:
            self._event(run, "wait", "wait", dst, "waits", t_wait, t_done, dict(args))
        ev = self._event(run, "recv", "message", dst, "receives", t_done, t_done, args)
        self._flow(run, ev, "recv", src, dst, tag)

    def sim_received(self, world, src: int, dst: int, tag: int, nbytes: int, clock: float,
                     delivered: float) -> None:
        """``dst`` took a message whose delivery is ``delivered``, its clock being ``clock`` (modelled)."""
        self._received(self._sim_run(world), src, dst, tag, nbytes, clock, max(clock, delivered))

    def sim_compute(self, world, eid: int, clock: float, seconds: float) -> None:
        """Endpoint ``eid`` computes ``seconds`` (modelled, a straggler's factor included) from ``clock``."""
        self._event(self._sim_run(world), "compute", "compute", eid, "compute", clock, clock + seconds,
                    {"seconds": seconds})

    # ------------------------------------------------ hooks: a real fabric
    def sent(self, fabric, dst: int, tag: int, nbytes: int) -> dict:
        """``fabric`` posted a message to ``dst`` now; returns its event, which :meth:`done` completes."""
        run = self._fabric_run(fabric)
        t = time.perf_counter()
        ev = self._event(run, "send", "message", fabric.rank, "sends", t, t, {"dst": dst, "tag": tag,
                                                                                "bytes": nbytes})
        self._flow(run, ev, "send", fabric.rank, dst, tag)
        return ev

    def done(self, ev: dict) -> None:
        """The send of ``ev`` (:meth:`sent`) was seen complete now."""
        ev["dur"] = max(0.0, (time.perf_counter() - self.origin) * 1e6 - ev["ts"])

    def received(self, fabric, src: int, tag: int, nbytes: int, t_wait: float) -> None:
        """``fabric`` completed a receive from ``src`` now, having waited for it since ``t_wait``
        (``time.perf_counter``; 0: now, the recording started during the wait)."""
        t = time.perf_counter()
        self._received(self._fabric_run(fabric), src, fabric.rank, tag, nbytes, t_wait or t, t)

    # ------------------------------------------------ hooks: transports
    def call(self, fabric, name: str, t0: float, t1: float, args: dict) -> None:
        """A transport call ``name`` on ``fabric`` from ``t0`` to ``t1`` (``fabric.now()``)."""
        run = self._fabric_run(fabric)
        self._event(run, name, "call", fabric.rank, "calls", t0, t1, args)

    # ------------------------------------------------------------------ file
    def trace(self) -> dict:
        """The recording as a trace-event JSON object: metadata naming every process and track, then the
        events by time."""
        meta: list[dict] = []
        runs = sorted(self._runs.values(), key=lambda r: r.index)
        pids = sorted({ev["pid"] for ev in self.events})
        by_index = {r.index: r for r in runs}
        for pid in pids:
            run = by_index[pid // RUN_STRIDE]
            meta += _metadata(pid, _process_name(run, pid % RUN_STRIDE))
        events = sorted(self.events, key=lambda e: (e["ts"], e["pid"], e["tid"]))
        return {"traceEvents": meta + events, "displayTimeUnit": "ns", "otherData": {"sparsecomm": {
            "version": VERSION, "origin_unix_s": self.origin_unix_s,
            "runs": [{"pid_base": r.index * RUN_STRIDE, "clock": "modelled" if r.modelled else "wall",
                      "job": None if r.modelled else self.job} for r in runs]}}}

    def write(self, path: str | os.PathLike | None = None) -> str:
        """Write :meth:`trace` to ``path`` (default: the recorder's) and return the path; folders are made."""
        path = os.fspath(path) if path is not None else self.path
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.trace(), fh)
        return path


def _process_name(run: _Run, eid: int) -> str:
    kind = "modelled" if run.modelled else "measured"
    if eid < run.world_size:
        name = f"{kind} rank {eid}"
    else:
        name = next((f"{kind} {s}" for s, e in run.services().items() if e == eid), f"{kind} endpoint {eid}")
    return name if run.index == 0 else f"{name} (run {run.index + 1})"


def _metadata(pid: int, name: str) -> list[dict]:
    meta = [{"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": pid * LANE_STRIDE,
             "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": pid * LANE_STRIDE,
             "args": {"sort_index": pid}}]
    for lane, k in LANES.items():
        tid = pid * LANE_STRIDE + k
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": lane}})
        meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                     "args": {"sort_index": k}})
    return meta


# ---------------------------------------------------------------------- the switch
def active() -> Recorder | None:
    """The active recording of this process, or ``None``."""
    return recorder


def start(path: str | os.PathLike, *, job: str | None = None) -> Recorder:
    """Make a new :class:`Recorder` writing to ``path`` the process's active recording and return it;
    :func:`stop` writes it. One recording at a time: another one open raises
    :class:`~sparsecomm.errors.InvalidValueError` naming its file.

    Args:
        path: the JSON file :func:`stop` writes.
        job: the real job this process is a rank of (:class:`Recorder`).
    """
    global recorder
    with _state_lock:
        if recorder is not None:
            raise InvalidValueError(f"a timeline is already being recorded to {recorder.path!r}; stop it "
                                    f"(sparsecomm.trace.stop()) or record inside it")
        recorder = Recorder(path, job=job)
        return recorder


def stop(write: bool = True) -> str | None:
    """End the active recording and write its file (``write=False``: discard it); returns the path
    written, or ``None`` when nothing was recording or nothing was written."""
    global recorder
    with _state_lock:
        rec, recorder = recorder, None
    if rec is None or not write:
        return None
    return rec.write()


@contextlib.contextmanager
def record(path: str | os.PathLike, *, job: str | None = None) -> Iterator[Recorder]:
    """Record the block's communication in this process to ``path`` (:func:`start`, then :func:`stop`, also
    when the block raises: a failed run's timeline is written too).

    >>> import torch, sparsecomm as sc, tempfile, os, json
    >>> path = os.path.join(tempfile.mkdtemp(), "ring.json")
    >>> fn = lambda ctx: sc.transports.get("ring", ctx.fabric).allreduce(torch.ones(1000)).sum().item()
    >>> with sc.trace.record(path):
    ...     sc.launch(fn, world_size=4, backend="sim")
    [4000.0, 4000.0, 4000.0, 4000.0]
    >>> sorted({e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"})
    ['recv', 'ring allreduce', 'send', 'wait']

    Args:
        path: the JSON file written at the end of the block.
        job: the real job this process is a rank of (:class:`Recorder`).
    """
    rec = start(path, job=job)
    try:
        yield rec
    finally:
        with _state_lock:
            mine = recorder is rec
        if mine:
            stop()


def rank_path(path: str | os.PathLike, rank: int) -> str:
    """The file of ``rank`` of a real job recording to ``path``: ``out/trace.json`` -> ``out/trace.rank3.json``.

    Args:
        path: the job's file.
        rank: the rank (its position in the job, services after the workers).
    """
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.rank{int(rank)}{ext or '.json'}"


# ---------------------------------------------------------------------- merging
def load(path: str | os.PathLike) -> dict:
    """Read a trace file, checking that it is one of this module's (:class:`~sparsecomm.errors.InvalidValueError`
    naming the file otherwise).

    Args:
        path: the JSON file.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InvalidValueError(f"cannot read trace {path!r}: {exc}") from exc
    info = data.get("otherData", {}).get("sparsecomm") if isinstance(data, dict) else None
    if not isinstance(info, dict) or not isinstance(data.get("traceEvents"), list):
        raise InvalidValueError(f"{path!r} is not a timeline written by sparsecomm.trace (no traceEvents, or "
                                f"no otherData.sparsecomm); merge takes the files of record() or launch(trace=)")
    return data


def merge(paths: Sequence[str | os.PathLike], out: str | os.PathLike | None = None, *,
          align: str = "calls") -> dict:
    """Join trace files into one: the files of one real job (the ranks' ``trace.rankR.json``) become one run,
    aligned on the wall clock; every other run (a simulated world, another job) gets its own processes
    (the k-th from pid ``k * 1000``). ``align="calls"`` shifts each run so that its first call starts when
    the latest run's first call does (a modelled and a measured run of the same code side by side);
    ``"none"`` keeps each run's own times. Writes ``out`` if given; returns the merged trace.

    Args:
        paths: the files (:func:`load`).
        out: the file to write, or ``None``.
        align: ``"calls"`` or ``"none"``.
    """
    if align not in ("calls", "none"):
        raise InvalidValueError(f"align must be 'calls' or 'none', got {align!r}")
    if not paths:
        raise InvalidValueError("merge needs at least one trace file")
    groups: dict[tuple, dict] = {}      # run key -> index, clock, parts: [(events, pid base, origin)]
    for p in paths:
        data = load(p)
        info = data["otherData"]["sparsecomm"]
        for r in info.get("runs", []):
            base = int(r["pid_base"])
            key = ("wall", r["job"]) if r.get("clock") == "wall" and r.get("job") else ("file", os.fspath(p), base)
            g = groups.setdefault(key, {"index": len(groups), "parts": [], "clock": r.get("clock")})
            evs = [e for e in data["traceEvents"] if base <= e.get("pid", -1) < base + RUN_STRIDE]
            g["parts"].append((evs, base, float(info.get("origin_unix_s", 0.0))))
    firsts: dict[int, float] = {}       # run -> its first call's start
    staged: list[tuple[int, dict]] = []
    for g in groups.values():
        k = g["index"]
        origin0 = min(o for _, _, o in g["parts"])
        for evs, base, origin in g["parts"]:
            shift = (origin - origin0) * 1e6 if g["clock"] == "wall" else 0.0
            for e in evs:
                e = dict(e)
                pid = k * RUN_STRIDE + (e["pid"] - base)
                e["tid"] = e["tid"] + (pid - e["pid"]) * LANE_STRIDE
                e["pid"] = pid
                if e["ph"] != "M":
                    e["ts"] = e["ts"] + shift
                    if e.get("cat") == "call":
                        firsts[k] = min(firsts.get(k, e["ts"]), e["ts"])
                if "bind_id" in e and k:
                    e["bind_id"] = _flow_id("merged", k, e["bind_id"])
                staged.append((k, e))
    target = max(firsts.values()) if align == "calls" and firsts else 0.0
    merged: list[dict] = []
    seen_meta: set = set()
    names: set = set()
    for k, e in staged:
        if e["ph"] == "M":
            key = (e["name"], e["pid"], e["tid"])
            if key in seen_meta:
                continue
            seen_meta.add(key)
            if e["name"] == "process_name":
                name = e["args"].get("name", "")
                if name in names:          # two runs of one kind: tell them apart
                    name = f"{name} (run {k + 1})"
                names.add(name)
                e["args"] = {**e["args"], "name": name}
        elif align == "calls" and k in firsts:
            e["ts"] = e["ts"] + (target - firsts[k])
        merged.append(e)
    merged.sort(key=lambda e: (e["ph"] != "M", e["ts"], e["pid"], e["tid"]))
    trace = {"traceEvents": merged, "displayTimeUnit": "ns", "otherData": {"sparsecomm": {
        "version": VERSION, "origin_unix_s": 0.0,
        "runs": [{"pid_base": g["index"] * RUN_STRIDE, "clock": g["clock"], "job": None} for g in groups.values()],
        "merged_from": [os.fspath(p) for p in paths], "align": align}}}
    if out is not None:
        out = os.fspath(out)
        if os.path.dirname(out):
            os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(trace, fh)
    return trace


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparsecomm.fabric.trace merge a.json b.json -o both.json`` (:func:`merge`)."""
    ap = argparse.ArgumentParser(prog="python -m sparsecomm.fabric.trace",
                                 description="Join sparsecomm timelines (Chrome trace-event JSON) into one file.")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="join trace files: a job's per-rank files, or a modelled and a measured run")
    m.add_argument("paths", nargs="+", help="trace files written by sparsecomm.trace.record or launch(trace=)")
    m.add_argument("-o", "--out", required=True, help="the merged file")
    m.add_argument("--align", choices=("calls", "none"), default="calls",
                   help="shift each run so that its first call starts together (default), or keep its times")
    args = ap.parse_args(argv)
    trace = merge(args.paths, args.out, align=args.align)
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"{args.out}: {n} events of {len(trace['otherData']['sparsecomm']['runs'])} run(s); open it at "
          f"https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
