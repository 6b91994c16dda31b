"""A per-message trace of OmniReduce calls, off by default (a diagnostic, not part of the protocol).

Set ``SPARSECOMM_OMNIREDUCE_TRACE=DIR`` in the environment of every rank: each call of a worker then
runs on a :class:`TraceFabric` wrapped around the endpoint's fabric (its agreement handshake, which
runs first in the call's drive, included; dedicated aggregators are not traced), and writes ``DIR/rank{R}.call{K}.json`` (``K``: the
transport's traced calls so far): one record per message (``send`` or ``recv``, peer, tag, bytes, when
it was posted, when the endpoint first waited for it, when that wait ended) and any marks a caller adds
(:meth:`TraceFabric.mark`). Times are ``time.perf_counter()`` (CLOCK_MONOTONIC: comparable across processes of one machine, e.g. the
netbed's namespaces). ``python -m sparsecomm.transports.omnireduce.trace DIR`` prints a merged timeline.

A receive's ``done`` is when the endpoint learned it had completed: if ``wait0 == done`` (the wait did
not block) the message had arrived by ``wait0``; if the wait blocked, ``done`` is its arrival (within
the waiting thread's wake-up).
"""

from __future__ import annotations

import json
import os
import sys
import time

from ...fabric import roles as fabric_roles
from ...fabric.base import Fabric

ENV = "SPARSECOMM_OMNIREDUCE_TRACE"


def enabled() -> str | None:
    """The trace directory, or ``None`` (tracing off: the default)."""
    return os.environ.get(ENV) or None


class _Work:
    __slots__ = ("inner", "rec")

    def __init__(self, inner, rec: dict) -> None:
        self.inner, self.rec = inner, rec

    def _seen(self, t0: float) -> None:
        if self.rec["done"] is None:
            self.rec["wait0"] = t0
            self.rec["done"] = time.perf_counter()

    def wait(self, timeout=None):
        t0 = time.perf_counter()
        out = self.inner.wait(timeout) if timeout is not None else self.inner.wait()
        self._seen(t0)
        return out

    def is_completed(self) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.is_completed()
        if ok:
            self._seen(t0)
        return ok


class TraceFabric:
    """``inner`` with every ``isend``/``irecv`` recorded (everything else delegated)."""

    def __init__(self, inner, directory: str, call: int = 0) -> None:
        self._inner = inner
        self._dir = directory
        self._call = call
        self.events: list[dict] = []
        self.marks: list[tuple[float, str]] = []
        self.t_start = time.perf_counter()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _rec(self, kind: str, tensor, peer, tag: int) -> dict:
        rec = {"kind": kind, "peer": peer, "tag": tag, "bytes": tensor.numel() * tensor.element_size(),
               "post": time.perf_counter(), "wait0": None, "done": None}
        self.events.append(rec)
        return rec

    def isend(self, tensor, dst, tag=0, **kw):
        rec = self._rec("send", tensor, dst, tag)
        return _Work(self._inner.isend(tensor, dst, tag, **kw), rec)

    def irecv(self, tensor, src=None, tag=0):
        rec = self._rec("recv", tensor, src, tag)
        w = self._inner.irecv(tensor, src, tag)
        rec["post_end"] = time.perf_counter()
        return _Work(w, rec)

    def send(self, tensor, dst, tag=0, **kw):
        self.isend(tensor, dst, tag, **kw).wait()

    #: a send to each of several endpoints: :meth:`isend` per endpoint (each recorded), not the inner fabric's
    isend_each = Fabric.isend_each

    def recv(self, tensor, src=None, tag=0, **kw):
        rec = self._rec("recv", tensor, src, tag)
        rec["wait0"] = time.perf_counter()
        out = self._inner.recv(tensor, src, tag, **kw)
        rec["done"] = time.perf_counter()
        return out

    def wait_any(self, works):
        groups = [list(el) if isinstance(el, (list, tuple)) else [el] for el in works]
        t0 = time.perf_counter()
        inner = [[w.inner if isinstance(w, _Work) else w for w in g] for g in groups]
        i = self._inner.wait_any(inner)
        for w in groups[i]:
            if isinstance(w, _Work):
                w._seen(t0)
        return i

    def drive(self, roles: list, inbox, outbox, *, keep: int = 64) -> None:
        """Run ``roles`` on the generic scheduler (:func:`sparsecomm.fabric.roles.drive`) over this wrapper,
        so that the waits of ``inbox`` and ``outbox`` are recorded (``keep``: as ``Fabric.drive``)."""
        fabric_roles.drive(self, inbox, outbox, roles, keep)

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter(), label, time.thread_time()))

    def dump(self, role: str = "worker") -> None:
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, f"rank{self._inner.rank}.call{self._call}.json")
        with open(path, "w") as fh:
            json.dump({"rank": self._inner.rank, "role": role, "start": self.t_start, "end": time.perf_counter(),
                       "events": self.events, "marks": self.marks}, fh)


def report(directory: str, call: int) -> str:
    """A merged timeline of call ``call`` of every rank (ms from the earliest start)."""
    recs = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(f".call{call}.json"):
            with open(os.path.join(directory, name)) as fh:
                recs.append(json.load(fh))
    t0 = min(r["start"] for r in recs)
    lines = []
    for r in recs:
        lines.append(f"== rank {r['rank']} ({r['role']}): {1e3 * (r['start'] - t0):.2f} .. "
                     f"{1e3 * (r['end'] - t0):.2f} ms")
        rows = [(e["post"], f"{e['kind']:4s} peer={e['peer']} tag={e['tag']:#x} {e['bytes']:>10d} B  post "
                 f"{1e3 * (e['post'] - t0):8.2f}  wait {_ms(e['wait0'], t0)}  done {_ms(e['done'], t0)}")
                for e in r["events"]]
        c0 = r["marks"][0][2] if r["marks"] and len(r["marks"][0]) > 2 else None
        rows += [(m[0], f"mark {m[1]:40s} {1e3 * (m[0] - t0):8.2f}"
                  + (f"  (cpu {1e3 * (m[2] - c0):7.2f})" if c0 is not None and len(m) > 2 else ""))
                 for m in r["marks"]]
        lines += [s for _, s in sorted(rows, key=lambda x: x[0])]
    return "\n".join(lines)


def _ms(t, t0) -> str:
    return f"{1e3 * (t - t0):8.2f}" if t is not None else "       -"


if __name__ == "__main__":
    d = sys.argv[1]
    print(report(d, int(sys.argv[2]) if len(sys.argv) > 2 else 0))
