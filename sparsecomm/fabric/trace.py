"""The recorder of a run's timeline, per endpoint, and its file in Chrome's trace-event JSON (Perfetto).

A :class:`Recorder` collects, while it is the process's active recording (:data:`recorder`, set by the
switch users call, :mod:`sparsecomm.trace`):

- every transport call (``Transport.run``): one complete event (``ph: "X"``) named ``"<transport> allreduce"``
  on the endpoint's ``calls`` track, from the call's start to its end, with its bytes and messages (and on a real
  fabric ``cpu_us``, the CPU time of the thread that ran it: its wall time less its waits and its CPU is the time
  it was runnable but not running, cores shared with other threads and processes);
- every message: a ``"send"`` event on the sender's ``sends`` track and a ``"recv"`` event (of no length, when
  the receive completed) on the receiver's ``receives`` track, with peer, tag and bytes, joined by a flow
  arrow (``bind_id``: the k-th message of a channel ``(src, dst, tag)`` at both ends, in any process); the
  receiver's wait for it, if it waited, a ``"wait"`` event on its ``waits`` track;
- modelled computation (``SimFabric.compute``): a ``"compute"`` event on the ``compute`` track;
- the pipeline's own work around its transport calls (:class:`~sparsecomm.pipeline.core.CommPipeline`): an
  ``"encode"`` event for a round's message (the method's work before sending: the first round's on the
  calling thread, a later round's on the communication thread) and a ``"decode"`` event for the estimate
  from the last sum, on the ``phases`` track, with the call's identity.

Clocks. On the SimFabric the timestamps are the endpoint's modelled clock (``fabric.now()``): a call lasts
exactly the ``last_stats.modelled_time_s`` the transport reports; a send lasts while the sender's NIC
transmits it; a receive completes at the message's delivery, or at the receiver's clock when it took the
message if that is later, and the wait runs from that clock to the delivery. On a real fabric
(``TorchFabric``) they are the wall clock (``time.perf_counter``) since the recorder started: a send lasts
from its post until its completion was seen, a wait from its start until the receive completed (a wait for
any of several receives, ``wait_any``, is booked to the receive that ended it, from the wait's start). Nothing
real is modelled, so there ``compute`` records nothing (the computation is the gap between the calls).

Processes and tracks. The process of an endpoint (``pid``) is its rank (services after the workers), named
``"modelled rank 0"`` or ``"measured rank 0"`` (a service: ``"modelled switch"``); the k-th run one recorder
sees (a second simulated world) has the pids from ``k * RUN_STRIDE``. Its tracks (``tid = pid * LANE_STRIDE
+ lane``, unique in a file, as Perfetto wants) are ``calls``, ``sends``, ``receives``, ``waits``,
``compute`` and ``phases``, named by metadata events (``ph: "M"``). ``otherData["sparsecomm"]`` says each run's
clock and, for a real job, its name, and when the recorder started, on the wall clock and on
``time.perf_counter`` (one clock for every process of a machine), with the machine's name: what
:func:`sparsecomm.trace.merge` aligns.

Cost. Recording off, each hook (in ``Transport.run``, the SimFabric's send, take and compute, TorchFabric's
post and completion) is one check of :data:`recorder`; recording on, it appends events and changes neither
the results nor the modelled times.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

__all__ = ["Recorder", "recorder", "activate", "flow_id", "LANES", "LANE_STRIDE", "RUN_STRIDE"]

#: the tracks of an endpoint: name -> lane (``tid = pid * LANE_STRIDE + lane``)
LANES = {"calls": 1, "sends": 2, "receives": 3, "waits": 4, "compute": 5, "phases": 6}
LANE_STRIDE = 8
#: the pids of the k-th run of a file are ``k * RUN_STRIDE + endpoint``
RUN_STRIDE = 1000
#: the format's version in ``otherData["sparsecomm"]``
VERSION = 1

#: the active recording, or ``None`` (recording off); the fabrics' and transports' hooks check it
recorder: "Recorder | None" = None
_state_lock = threading.Lock()


def flow_id(*key: Any) -> int:
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
        job: names the real job this process is a rank of: :func:`sparsecomm.trace.merge` aligns the files of
            one job on the wall clock into one set of processes (default: ``TORCHELASTIC_RUN_ID``, else
            ``MASTER_ADDR:MASTER_PORT``, else this recording alone).
    """

    def __init__(self, path: str | os.PathLike, *, job: str | None = None) -> None:
        self.path = os.fspath(path)
        self.job = job or os.environ.get("TORCHELASTIC_RUN_ID") or (
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ else uuid.uuid4().hex)
        self.origin = time.perf_counter()
        self.origin_unix_s = time.time()
        self.host = socket.gethostname()
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
        ev["bind_id"] = flow_id(run.index, src, dst, tag, k)
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
    def sent(self, fabric, dst: int, tag: int, nbytes: int, t_post: float) -> dict:
        """``fabric`` posted a message to ``dst`` at ``t_post`` (``time.perf_counter``, taken before the post:
        its receive cannot complete earlier); returns its event, which :meth:`done` completes."""
        run = self._fabric_run(fabric)
        ev = self._event(run, "send", "message", fabric.rank, "sends", t_post, t_post,
                         {"dst": dst, "tag": tag, "bytes": nbytes})
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

    # ------------------------------------------------ hooks: the pipeline
    def phase(self, fabric, name: str, t0: float, t1: float, args: dict) -> None:
        """The pipeline's ``name`` (``"encode"``, ``"decode"``) on ``fabric`` from ``t0`` to ``t1``
        (``fabric.now()``)."""
        self._event(self._fabric_run(fabric), name, "phase", fabric.rank, "phases", t0, t1, args)

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
            "version": VERSION, "origin_unix_s": self.origin_unix_s, "origin_perf_s": self.origin,
            "host": self.host,
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


def activate(rec: Recorder | None) -> Recorder | None:
    """Make ``rec`` the process's active recording (``None``: recording off); return the one it replaces.
    The switch users call is :mod:`sparsecomm.trace` (``record``, ``start``, ``stop``).

    Args:
        rec: the recorder the hooks write to from now on, or ``None``.
    """
    global recorder
    with _state_lock:
        old, recorder = recorder, rec
    return old

