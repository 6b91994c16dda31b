"""Supervision of spawned ranks: their reports, deaths and the root failure the parent re-raises.

Every child reports once on the :class:`Reports` channel: its pickled result, or its exception and
traceback (:func:`pack_error`). For a rank that raises, the parent terminates every other process and
re-raises that exception (with the traceback text as a note). A rank that dies without reporting is a
crash: the parent writes the store's failure record (so the survivors stop at once, naming it), gives
them up to ``timeout_s`` + 2 s to notice, then terminates the rest and raises :class:`PeerFailure`
naming the dead rank, with the survivors' errors as notes. Errors that are the effect of another rank's
failure (:func:`_is_consequence`) never hide the root.
"""

from __future__ import annotations

import pickle
import time
import traceback
from multiprocessing.connection import wait as _mp_wait
from typing import Any

from ..errors import FabricTimeout, PeerFailure, WorkerError

DONE_KEY = "sparsecomm/workers_done"
_CRASH_GRACE_S = 2.0
_CONSEQUENCE_GRACE_S = 1.0


class Reports:
    """The channel on which spawned ranks report to their parent: ``("ok", rank, pickled result or None)``
    or ``("err", rank, pack_error(exc))``. One pipe that every child writes under one lock (so a report
    is never interleaved with another), read by the parent only, in the order the reports were written;
    :attr:`reader` is waitable (:func:`multiprocessing.connection.wait`). A child gets it as an argument
    of its process (while it is spawned)."""

    def __init__(self, ctx) -> None:
        self.reader, self._writer = ctx.Pipe(duplex=False)
        self._lock = ctx.Lock()

    def put(self, report: tuple) -> None:
        with self._lock:
            self._writer.send(report)

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


def pack_error(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """``exc`` for its parent: pickled if it round-trips, its type's name, its text and its traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - not round-trippable: send the text only
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb


def _unpack_error(packed: tuple[bytes | None, str, str, str]) -> tuple[BaseException, str]:
    blob, typename, text, tb = packed
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = WorkerError(f"{typename}: {text}")
    return exc, tb


_PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "caused pair closure")


def _is_consequence(exc: BaseException, rank: int | None = None) -> bool:
    """True for errors that are (usually) the effect of another rank's failure."""
    origin = getattr(exc, "sparsecomm_origin", None)
    if origin is not None and origin != rank:
        return True
    if isinstance(exc, (PeerFailure, FabricTimeout)):
        return True
    msg = str(exc)
    # gloo's words for a peer that went away; "caused pair closure" is what a wait reports when a failing
    # peer closes its connections on purpose (see the failure record), which can reach the parent first
    return isinstance(exc, RuntimeError) and any(s in msg for s in _PEER_GONE)


def _describe(rank: int, world_size: int, services: tuple[str, ...]) -> str:
    return f"worker {rank}" if rank < world_size else f"service {services[rank - world_size]!r} (rank {rank})"


def supervise(procs, reports: Reports, world_size: int, services: tuple[str, ...], timeout_s: float,
              store=None) -> list[Any]:
    """The workers' results in rank order once every worker has reported one; else raise the root
    failure (the module docstring), with the other ranks' failures as notes. ``procs`` are the started
    ranks in rank order, ``store`` the rendezvous store in which a death is recorded."""
    total = len(procs)
    results: list[Any] = [None] * world_size
    done: set[int] = set()                                     # ranks that reported success
    errors: dict[int, tuple[BaseException, str]] = {}          # rank -> (exception, traceback text)
    order: list[int] = []                                      # ranks in order of failure
    deaths: dict[int, int] = {}                                # rank -> exit code, without a report
    fail_since: float | None = None
    reader = reports.reader

    def drain() -> None:
        while reader.poll():
            kind, rank, data = reader.recv()
            if kind == "ok":
                done.add(rank)
                if rank < world_size:
                    results[rank] = pickle.loads(data)
            else:
                errors[rank] = _unpack_error(data)
                order.append(rank)

    while True:
        drain()
        for r, p in enumerate(procs):
            if p.exitcode is not None and r not in done and r not in errors and r not in deaths:
                drain()   # its report may have just arrived
                if r not in done and r not in errors:
                    deaths[r] = p.exitcode
                    order.append(r)
                    _record_death(store, r, p.exitcode, world_size, services)
        if all(r in done for r in range(world_size)):
            return results
        if any(not _is_consequence(errors[r][0], r) for r in errors):
            break
        if errors or deaths:
            now = time.monotonic()
            if fail_since is None:
                fail_since = now
            accounted = all(r in done or r in errors or r in deaths for r in range(total))
            grace = (timeout_s + _CRASH_GRACE_S) if deaths and not errors else _CONSEQUENCE_GRACE_S
            if accounted or now - fail_since > grace:
                break
        _mp_wait([reader] + [p.sentinel for r, p in enumerate(procs) if r not in deaths], timeout=0.25)

    # pick the root failure: a real error first, then a crash, then the first consequence
    root = next((r for r in order if r in errors and not _is_consequence(errors[r][0], r)), None)
    if root is None:
        root = next((r for r in order if r in deaths), None)
    if root is None:
        root = order[0]
    if root in errors:
        exc, tb = errors[root]
        exc.add_note(f"(raised on {_describe(root, world_size, services)} of {world_size} workers; its "
                     f"traceback:\n{tb.rstrip()})")
    else:
        exc = PeerFailure(f"{_describe(root, world_size, services)} exited with code {deaths[root]} without "
                          f"reporting a result (it crashed or was killed)")
    for r in order:
        if r == root:
            continue
        if r in errors:
            e = errors[r][0]
            exc.add_note(f"{_describe(r, world_size, services)}: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        else:
            exc.add_note(f"{_describe(r, world_size, services)}: exited with code {deaths[r]} without a report")
    raise exc


def _record_death(store, rank: int, code: int, world_size: int, services: tuple[str, ...]) -> None:
    """Tell the surviving ranks (through the store's failure record, which their watchdogs poll) that
    ``rank`` died without a report, so that they stop at once, naming it."""
    if store is None:
        return
    from ..fabric.torch.torch_failure import encode_failure

    what = "killed by signal " + str(-code) if code is not None and code < 0 else f"exit code {code}"
    text = f"{_describe(rank, world_size, services)} died without reporting ({what})"
    try:
        store.compare_set(DONE_KEY + "/failed", "", encode_failure(text, rank, "PeerFailure"))
    except Exception:  # noqa: BLE001 - the store is gone
        pass


def reap(procs, grace_s: float) -> None:
    """Give the children ``grace_s`` to exit on their own, then terminate (and if need be kill) the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.is_alive():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
