"""Timelines of a run, to open in Perfetto or chrome://tracing: the switch, and the merging of files.

``with sparsecomm.trace.record("t.json"):`` records every transport call, every message (peer, tag, bytes,
an arrow from its send to its receive), every wait, the SimFabric's modelled compute and the pipeline's
``encode`` and ``decode`` of this process, per endpoint, and writes them as Chrome trace-event JSON (the recorder
and the file's layout:
:mod:`sparsecomm.fabric.trace`); ``sparsecomm.launch(..., trace="t.json")`` records its run, and the
environment variable :data:`ENV` (``SPARSECOMM_TIMELINE=t.json``) makes every ``launch`` do so, as Horovod's
``HOROVOD_TIMELINE`` does. Timestamps are the modelled clock on the SimFabric, the wall clock on real
processes.

Files. The SimFabric's endpoints live in one process: one file, every endpoint a process of it. Each rank of a
real job records its own file (:func:`rank_path`: ``t.rank0.json``): ``launch`` joins its spawned ranks'
files into ``t.json`` once they are done (the parent has them all, on one machine; a gather through the
process group would add messages to the run it records); under torchrun each rank keeps its file, and
:func:`merge` joins them, aligned on the wall clock. :func:`merge` also puts a modelled and a measured run
of the same code side by side (the second run's processes from pid 1000 on, named "modelled rank 0" and
"measured rank 0"), each run shifted so that its first call starts with the other's.

Open a file at https://ui.perfetto.dev ("Open trace file") or in chrome://tracing ("Load").

Command line: ``python -m sparsecomm.trace merge a.json b.json -o both.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from typing import Iterator, Sequence

from .errors import InvalidValueError
from .fabric import trace as _rec
from .fabric.trace import LANE_STRIDE, RUN_STRIDE, VERSION, Recorder, flow_id

__all__ = ["record", "start", "stop", "active", "rank_path", "merge", "load", "main", "ENV", "Recorder"]

#: the environment variable that makes ``sparsecomm.launch`` record its run (``SPARSECOMM_TIMELINE=path``)
ENV = "SPARSECOMM_TIMELINE"
_lock = threading.Lock()


# ---------------------------------------------------------------------- the switch
def active() -> Recorder | None:
    """The active recording of this process, or ``None``."""
    return _rec.recorder


def start(path: str | os.PathLike, *, job: str | None = None) -> Recorder:
    """Make a new :class:`Recorder` writing to ``path`` the process's active recording and return it;
    :func:`stop` writes it. One recording at a time: another one open raises
    :class:`~sparsecomm.errors.InvalidValueError` naming its file.

    Args:
        path: the JSON file :func:`stop` writes.
        job: the real job this process is a rank of (:class:`Recorder`).
    """
    with _lock:
        if _rec.recorder is not None:
            raise InvalidValueError(f"a timeline is already being recorded to {_rec.recorder.path!r}; stop it "
                                    f"(sparsecomm.trace.stop()) or record inside it")
        rec = Recorder(path, job=job)
        _rec.activate(rec)
        return rec


def stop(write: bool = True) -> str | None:
    """End the active recording and write its file (``write=False``: discard it); returns the path
    written, or ``None`` when nothing was recording or nothing was written."""
    with _lock:
        rec = _rec.activate(None)
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
        if _rec.recorder is rec:
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
    groups: dict[tuple, dict] = {}      # run key -> index, clock, parts: [(events, pid base, the file's otherData)]
    for p in paths:
        data = load(p)
        info = data["otherData"]["sparsecomm"]
        for r in info.get("runs", []):
            base = int(r["pid_base"])
            key = ("wall", r["job"]) if r.get("clock") == "wall" and r.get("job") else ("file", os.fspath(p), base)
            g = groups.setdefault(key, {"index": len(groups), "parts": [], "clock": r.get("clock")})
            evs = [e for e in data["traceEvents"] if base <= e.get("pid", -1) < base + RUN_STRIDE]
            g["parts"].append((evs, base, info))
    firsts: dict[int, float] = {}       # run -> its first call's start
    staged: list[tuple[int, dict]] = []
    for g in groups.values():
        k = g["index"]
        origins = _origins([info for _, _, info in g["parts"]])
        for (evs, base, _), origin in zip(g["parts"], origins):
            shift = (origin - min(origins)) * 1e6 if g["clock"] == "wall" else 0.0
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
                    e["bind_id"] = flow_id("merged", k, e["bind_id"])
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


def _origins(infos: list[dict]) -> list[float]:
    """When each file's recorder started, in seconds on a clock the files share: ``time.perf_counter`` when they
    all come from one machine (one monotonic clock for its processes), else the wall clock."""
    if len({i.get("host") for i in infos}) == 1 and all("origin_perf_s" in i for i in infos):
        return [float(i["origin_perf_s"]) for i in infos]
    return [float(i.get("origin_unix_s", 0.0)) for i in infos]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparsecomm.trace merge a.json b.json -o both.json`` (:func:`merge`)."""
    ap = argparse.ArgumentParser(prog="python -m sparsecomm.trace",
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
